"""The app's pages read per unit on a shard store still being written: page -> (the source of its units, its
look-ups), each look-up named as the whole-store function it equals (its module given) and done per unit
(`store.units`, `units_overview`, `units_clipping`, `units_routing`). `lab_ui.per_unit` reads them."""

from __future__ import annotations

from mismatch_lab.store import units, units_clipping, units_overview, units_routing

INSPECTOR = {  # the token inspector's look-ups: the whole-store function's module -> its per-unit form
    "list_runs": ("mismatch_lab.analysis.browse", units_overview.list_runs),
    "training_steps": ("mismatch_lab.analysis.browse", units.training_steps),
    "list_sequences": ("mismatch_lab.analysis.browse", units.list_sequences),
    "sequence_tokens": ("mismatch_lab.analysis.browse", units.sequence_tokens),
    "token_topk": ("mismatch_lab.analysis.browse", units.token_topk),
    "worst_sequences": ("mismatch_lab.analysis.browse", units_clipping.worst_sequences),
}

TRAINING = {  # the Training page's look-ups
    "train_runs": ("mismatch_lab.analysis.browse", units.train_runs),
    "training_steps": ("mismatch_lab.analysis.browse", units.training_steps),
    "list_sequences": ("mismatch_lab.analysis.browse", units.list_sequences),
    "train_series": ("mismatch_lab.analysis.violations", units.train_series),
    "step_series": ("mismatch_lab.analysis.steps", units.step_series),
}

CLIPPING = {  # the Clipping page's look-ups
    "list_pairs": ("mismatch_lab.analysis.browse", units_clipping.list_pairs),
    "list_categories": ("mismatch_lab.analysis.browse", units_clipping.list_categories),
    "clipping_by_category": ("mismatch_lab.analysis.clipping", units_clipping.clipping_by_category),
    "top_clipped_tokens": ("mismatch_lab.analysis.clipping", units_clipping.top_clipped_tokens),
}

ROUTING = {"routing_table": ("mismatch_lab.analysis.routing", units_routing.routing_table)}  # the Routing page's

PAGES = {"training": (units.ShardUnits, TRAINING), "inspector": (units.InspectorUnits, INSPECTOR),
         "clipping": (units_clipping.ClippingUnits, CLIPPING), "routing": (units_routing.RoutingUnits, ROUTING)}
"""page -> (the source of its units, its look-ups)."""
