"""Figure 11 (figures/routing.py): expert-set flips per MoE layer and rollout margin, and the mismatch of tokens
with vs without a flip, drawn from a small MoE store the real writer wrote (tests/routing_stores.py)."""

from __future__ import annotations

import pytest
from routing_stores import routing_store

from mismatch_lab.analysis.routing import routing_table
from mismatch_lab.figures import FIGURES, Skip
from mismatch_lab.figures.routing import fig11_routing
from mismatch_lab.store.reader import open_store


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return routing_store(tmp_path_factory.mktemp("moe-fig") / "moe.duckdb")


def test_figure_11_draws_each_pairs_layer_and_margin_flip_rates_and_the_split_mismatch(moe):
    assert FIGURES["11"] is fig11_routing
    con = open_store(moe.path)
    try:
        (stem, fig), = fig11_routing(con)
        table = routing_table(con)
    finally:
        con.close()
    assert stem == "fig11_routing" and fig._suptitle.get_text()
    ax_layer, ax_margin, ax_split = [ax for ax in fig.axes if ax.get_label() != "colorbar"]
    for pair, line in zip(("hf:fp32", "hf:fp32-r3"), ax_layer.get_lines()):
        want = table[(table["view"] == "layer") & (table["scorer"] == pair)]["flip_rate"].tolist()
        assert list(line.get_ydata()) == want
    margin = table[(table["view"] == "margin") & (table["scorer"] == "hf:fp32")]["flip_rate"].tolist()
    assert list(ax_margin.get_lines()[0].get_ydata()) == margin
    pair = table[(table["view"] == "pair") & (table["scorer"] == "hf:fp32")].iloc[0]
    heights = [p.get_height() for p in ax_split.patches]
    assert pair["abs_dp_mean_flip"] in heights and pair["abs_dp_mean_no_flip"] in heights
    for ax in (ax_layer, ax_margin, ax_split):
        assert "(" in ax.get_ylabel()  # a unit


def test_figure_11_is_skipped_on_a_store_without_routing(plain_study):
    con = open_store(plain_study)
    try:
        with pytest.raises(Skip, match="no MoE routing"):
            fig11_routing(con)
    finally:
        con.close()
