"""Framework presets on a store's tokens: per preset and (rollout, scorer) pair, the share of response tokens
and of sequences the framework's loss keeps, and the metrics it would log (under its own names).

The store is read and laid out as `compare` does it (layout.chunks, Chunk.parts: whole sequences, [B, T] per
response-length bucket); each part is one batch handed to the preset's loss with π = π_old = the scorer's
log-probs (a store holds no π_old: what the framework does at the first mini-batch of the step that produced
the tokens), μ = the rollout's, A = the stored advantage, else reward minus the prompt group's mean. Sequences
with neither run twice, with A = +1 and A = −1: a token counts as kept only when both runs keep it
(two-sided, as `compare` counts sign-dependent rules) and the metrics are those of the A = +1 run.

Metrics: a framework logs them per batch; here each is the mean over the parts weighted by the parts'
response tokens (verl's max/min statistics included: verl averages its micro-batches' metrics); a part
whose value is NaN is left out of that metric's mean (e.g. verl's token-mean loss of a part in which every
token was rejected: 0/0), and the metric is NaN (null in JSON) when every part's was. Counts (COUNTS: numbers
of tokens or sequences, which a token-weighted mean would turn into a number of no batch) are summed over the
parts instead: the row's `summed_metrics` names them and `n_batches` is the number of parts they add over.
Extremes that a framework reduces by max or min over its micro-batches (EXTREMES) are the max or min over the
parts, as that framework reports them for the whole batch. Means over sequences (BY_SEQUENCE: a sum of
per-sequence values over the batch's sequences) are weighted by the parts' sequences instead of their tokens,
which gives the mean over every sequence of the store.
Kept sequences: sequences with at least one kept token.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from mismatch_lab.corrections.frameworks import Preset, Tokens
from mismatch_lab.corrections.layout import chunks, pair_info

COLUMNS = ("preset", "framework", "default", "rollout", "scorer", "n_tokens", "n_seqs", "kept_token_share",
           "kept_seq_share", "advantage_source", "metrics", "summed_metrics", "n_batches")
"""The columns of the `presets` table (`metrics`: {the framework's metric name: value}; `summed_metrics`: the
names among them that are counts summed over the `n_batches` batches, every other one a token-weighted mean)."""

COUNTS: dict[str, frozenset[str]] = {
    "areal": frozenset({"n_valid_tokens", "clipped_tokens", "dual_clipped_tokens", "unclipped_behave_tokens"}),
    "nemo-rl": frozenset({"num_valid_samples", "num_masked_seqs_by_logprob_error"}),
    "roll": frozenset({"actor/valid_samples@sum", "actor/total_samples@sum"}),
}
"""Per framework, the logged metrics that count tokens or sequences of the batch (not fractions, means or
extremes): summed over batches. Every other metric of every preset is a per-batch statistic."""


def _suffixed(sep: str) -> Callable[[str], str | None]:
    """The reduction ('max' or 'min') a metric's name asks for by ending in sep + max / sep + min, else None."""
    return lambda name: next((e for e in ("max", "min") if name.endswith(sep + e)), None)


_NEMO_RL_EXTREMES = {"probs_ratio_max": "max", "probs_ratio_clamped_max": "max", "probs_ratio_min": "min",
                     "probs_ratio_clamped_min": "min", "max_seq_mult_prob_error": "max",
                     "max_seq_mult_prob_error_after_mask": "max", "min_seq_mult_prob_error": "min",
                     "min_seq_mult_prob_error_after_mask": "min"}

EXTREMES: dict[str, Callable[[str], str | None]] = {
    "nemo-rl": _NEMO_RL_EXTREMES.get,
    "roll": _suffixed("@"),
    "skyrl": _suffixed("_"),
}
"""Per framework, metric name -> 'max' / 'min' where the framework reduces that metric over its micro-batches
by max / min (None: a token-weighted mean or a COUNTS sum). NeMo-RL @7ea279ab: grpo.py takes the min/max of
probs_ratio(_clamped)_min/_max over micro-batches and computes the *_seq_mult_prob_error extremes over the
step's whole batch; ROLL @8eb27cc2: roll/utils/functionals.py reduce_metrics reads the '@max'/'@min' tag;
SkyRL @a9564572: skyrl_train/workers/worker_utils.py reduce_metrics takes max/min of names ending _max/_min."""

_EXTREME = {"max": max, "min": min}

_ROLL_SEQUENCE_MEANS = frozenset({f"actor/train_infer_{kind}_{agg}_mean@sum" for kind in ("ratio", "diff")
                                  for agg in ("token", "geometric", "sequence", "segment")}
                                 | {"actor/ratio_mean@sum", "actor/valid_sample_ratio@sum"})
_ROLL_LOSS_MEANS = frozenset({"actor/pg_loss@sum", "actor/weighted_pg_loss@sum", "actor/total_loss@sum",
                              "actor/approxkl@sum", "actor/policykl@sum", "actor/clipfrac@sum"})


def _roll_by_sequence(preset: Preset, name: str) -> bool:
    """ROLL's seq-mean-token-mean metrics: always the train-infer means and ratio_mean, the loss and its
    statistics under loss_agg_mode seq-mean-token-mean (token-mean ones stay token-weighted)."""
    return name in _ROLL_SEQUENCE_MEANS or (
        preset.settings["loss_agg_mode"] == "seq-mean-token-mean" and name in _ROLL_LOSS_MEANS)


BY_SEQUENCE: dict[str, Callable[[Preset, str], bool]] = {
    "slime": lambda preset, name: True,
    "nemo-rl": lambda preset, name: name in {"mean_seq_mult_prob_error", "mean_seq_mult_prob_error_after_mask"},
    "roll": _roll_by_sequence,
}
"""Per framework, (preset, metric name) -> whether the metric is a mean over the batch's sequences (weighted by
sequences over the parts). slime @624b824a: loss.py reduces every reported metric with sum_of_sample_mean
(per-sequence means summed) and train_one_step divides the micro-batches' sum by the step's sample count;
NeMo-RL @7ea279ab: grpo.py's mean_seq_mult_prob_error is the mean over the step's valid sequences; ROLL @8eb27cc2:
agg_loss seq-mean-token-mean divides by the mini-batch's global_valid_samples and reduce_metrics sums '@sum'."""


def _no_extreme(name: str) -> None:
    """The reduction of a framework without EXTREMES: none of its metrics is a max/min over micro-batches."""


def _by_token(name: str) -> bool:
    """The weighting of a framework without BY_SEQUENCE: every mean weighted by the parts' tokens."""
    return False


@dataclass
class _Sums:
    tokens: int = 0
    kept: int = 0
    seqs: int = 0
    seqs_kept: int = 0
    metric_sums: dict[str, float] = field(default_factory=dict)
    metric_weights: dict[str, int] = field(default_factory=dict)
    counts: frozenset[str] = frozenset()
    extreme: Callable[[str], str | None] = _no_extreme
    by_sequence: Callable[[str], bool] = _by_token
    batches: int = 0

    def add(self, mask, keep, metrics: dict[str, float]) -> None:
        n, n_seqs = int(mask.sum()), int(mask.any(-1).sum())
        self.batches += 1
        self.tokens += n
        self.kept += int((keep & mask).sum())
        self.seqs += n_seqs
        self.seqs_kept += int((keep & mask).any(-1).sum())
        for name, value in metrics.items():
            self.metric_sums.setdefault(name, 0.0)
            self.metric_weights.setdefault(name, 0)
            if not math.isnan(value):
                w = n_seqs if self.by_sequence(name) else n
                self.metric_sums[name] = self._fold(name, value, w)
                self.metric_weights[name] += w

    def _fold(self, name: str, value: float, w: int) -> float:
        """The running sum (counts), extreme (EXTREMES) or weighted sum (weight w: the part's tokens or
        sequences) of one metric with a new part."""
        if name in self.counts:
            return self.metric_sums[name] + value
        if (kind := self.extreme(name)) is not None:
            return _EXTREME[kind](self.metric_sums[name], value) if self.metric_weights[name] else value
        return self.metric_sums[name] + w * value

    def metrics(self) -> dict[str, float]:
        """Counts as their sum over the batches, extremes as their max/min, every other metric as its token-
        (or BY_SEQUENCE: sequence-) weighted mean; NaN where no batch gave a number."""
        def value(k: str) -> float:
            if k in self.counts or self.extreme(k) is not None:
                return self.metric_sums[k]
            return self.metric_sums[k] / self.metric_weights[k]

        return {k: value(k) if self.metric_weights[k] else math.nan for k in self.metric_sums}

    def summed(self) -> list[str]:
        return [k for k in self.metric_sums if k in self.counts]


def evaluate(preset: Preset, batch) -> tuple[object, dict[str, float]]:
    """(keep [B, T] bool, metrics) of `preset` on one laid-out batch (corrections.batch.Batch)."""
    import torch

    def run(adv):
        with torch.no_grad():
            return preset(Tokens(batch.lp, batch.lp, batch.lmu, adv, batch.mask))

    if batch.adv is not None:
        result = run(batch.adv)
        return result.keep, result.metrics
    one = torch.where(batch.mask, 1.0, 0.0).to(batch.lp.dtype)
    up, down = run(one), run(-one)
    return up.keep & down.keep, up.metrics


def run_presets(con, presets: Sequence[Preset], *, chunk_tokens: int = 1 << 20,
                progress: Callable[[int, int], None] | None = None) -> pd.DataFrame:
    """The `presets` table (COLUMNS) of the store on `con`: one row per preset and pair, presets in the
    given order."""
    info = pair_info(con)
    sums = {(p.name, i): _Sums(counts=COUNTS.get(p.framework, frozenset()),
                               extreme=EXTREMES.get(p.framework, _no_extreme),
                               by_sequence=functools.partial(BY_SEQUENCE[p.framework], p)
                               if p.framework in BY_SEQUENCE else _by_token)
            for p in presets
            for i in range(len(info))}
    for chunk in chunks(con, info, chunk_tokens=chunk_tokens, progress=progress):
        groups = np.zeros(chunk.n, dtype=np.int64)
        for part in chunk.parts(groups, 1, np.zeros(len(chunk.seq_start), dtype=np.int64)):
            for p in presets:
                keep, metrics = evaluate(p, part.batch)
                sums[(p.name, chunk.pair)].add(part.batch.mask, keep, metrics)
    rows = []
    for p in presets:
        for i, pair in enumerate(info.itertuples()):
            s = sums[(p.name, i)]
            rows.append((p.name, p.framework, p.default, pair.rollout, pair.scorer, s.tokens, s.seqs,
                         s.kept / s.tokens if s.tokens else math.nan,
                         s.seqs_kept / s.seqs if s.seqs else math.nan, pair.advantage_source, s.metrics(),
                         s.summed(), s.batches))
    return pd.DataFrame(rows, columns=list(COLUMNS))


def format_presets(table: pd.DataFrame) -> str:
    """Per preset and pair: one line of kept shares, then the logged metrics, two to a line."""
    lines = []
    for row in table.itertuples():
        lines.append(f"{row.preset}  {row.rollout} × {row.scorer}: kept tokens {_pct(row.kept_token_share)}, "
                     f"kept sequences {_pct(row.kept_seq_share)}  ({row.n_tokens:,} tokens, {row.n_seqs:,} "
                     f"sequences; advantage: {row.advantage_source})")
        summed = set(row.summed_metrics)
        cells = [f"{k} = {v:.6g}" + (f" (sum over {row.n_batches} batches)" if k in summed else "")
                 for k, v in row.metrics.items()]
        width = max((len(c) for c in cells), default=0)
        for i in range(0, len(cells), 2):
            lines.append("    " + "  ".join(c.ljust(width) for c in cells[i:i + 2]).rstrip())
    return "\n".join(lines)


def _pct(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{100 * x:.2f}%"


def presets_json(table: pd.DataFrame) -> list[dict]:
    """The table as JSON rows, non-finite numbers (metrics included) as null."""
    def plain(v):
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        if isinstance(v, (np.integer, np.bool_)):
            return v.item()
        if isinstance(v, (float, np.floating)):
            return float(v) if math.isfinite(v) else None
        return v

    return [{k: plain(v) for k, v in row.items()} for row in table.to_dict("records")]


def list_presets(presets: Sequence[Preset]) -> str:
    """The --list-presets listing: per preset its name, framework, whether it is the framework's default,
    source, formula and settings."""
    lines = []
    for p in presets:
        settings = ", ".join(f"{k}={v}" for k, v in p.settings.items()) or "(the framework's defaults)"
        lines += [f"{p.name}  [framework {p.framework}{', default' if p.default else ''}]",
                  f"    source:   {p.source}", f"    formula:  {p.summary}", f"    settings: {settings}"]
    return "\n".join(lines)
