"""NeMo-RL's own mismatch metric, `token_mult_prob_error`, per step of the runs whose trainer side is NeMo-RL's.

NeMo-RL (NVIDIA-NeMo/RL @7ea279ab, `nemo_rl/algorithms/loss/loss_functions.py`, `ClippedPGLossFn.__call__`)
logs, on every microbatch of a GRPO step,

    mask = token_mask[:, 1:] * sample_mask[:, None]
    lp_error = |generation_logprobs - prev_logprobs|                          (log mu, log pi of the sampled token)
    token_mult_prob_error = masked_mean(exp(lp_error * mask), mask, global_normalization_factor=global_valid_toks)

with `masked_mean(v, m, g) = sum(v * m) / (g + 1e-8)` (`nemo_rl/algorithms/utils.py`) and `global_valid_toks` =
sum(token_mask[:, 1:] * sample_mask) over the global batch, all data-parallel ranks
(`nemo_rl/models/automodel/data.py`); the microbatch values are summed (`grpo.py`: `np.sum` of
`all_mb_metrics`), divided by the number of global batches (`models/automodel/train.py`). For a step that is
one global batch (NeMo-RL's recipes: `train_global_batch_size` = prompts × generations) that is the mean of
exp|log π − log μ| (= max(r, 1/r), ≥ 1) over the step's loss-mask tokens, which is what this table gives:

    token_mult_prob_error = mean over the step's finite stored (token, scorer) rows of exp(|lpi - lmu|)

The stored tokens of a NeMo-RL import are exactly NeMo-RL's mask (docs/import.md). Where ours and theirs part:
NeMo-RL divides by (n + 1e-8) (a relative 1e-8 / n, below float32's rounding); a step of G global batches is
logged as the mean of the G batch means (equal to ours when they hold equal token counts); a non-finite log-prob
anywhere in the batch makes NeMo-RL's value NaN (exp(inf · 0) at a masked one too), while ours leaves the
non-finite rows out and counts them (`n_nonfinite`), as every table does.

Only the runs whose scorer is NeMo-RL's (`nemo-rl:<dtype>`: `mismatch-lab import nemo-rl`, or a Recorder with
framework='nemo-rl') get rows: the metric, its band and its name are NeMo-RL's. Its published band
(`docs/guides/dtensor-tp-accuracy.md`: above 1.05 "indicative of a potential framework issue that warrants further
investigation"; `grpo.py` plots the step's worst samples then) is `BAND`; `doctor` judges each NeMo-RL pair's
median step by it (`pair_summary`).
"""

from __future__ import annotations

import duckdb
import pandas as pd

from mismatch_lab.analysis.relations import Filters, empty, query, rollout_base
from mismatch_lab.doctor.bands import NEMO_RL_MULT_PROB_ERROR

SCORER_PREFIX = "nemo-rl:"
"""The scorer label of NeMo-RL's trainer side (record.recorder.scorer_label('nemo-rl', dtype))."""
BAND = NEMO_RL_MULT_PROB_ERROR.warn
"""NeMo-RL's level, 1.05 (doctor/bands.py): a token_mult_prob_error above it warrants investigation."""
KEYS = ["run_id", "rollout", "scorer", "step"]
COLUMNS = [*KEYS, "n_tokens", "n_nonfinite", "n_finite", "token_mult_prob_error"]
PAIR_COLUMNS = ["rollout", "scorer", "n_steps", "n_finite", "median_step", "max_step", "max_at", "steps_above"]


def has_nemo_rl(con: duckdb.DuckDBPyConnection) -> bool:
    """Whether the store holds a scored row of NeMo-RL's trainer side."""
    sql = "SELECT EXISTS (SELECT 1 FROM scores WHERE starts_with(scorer, ?))"
    return bool(con.execute(sql, [SCORER_PREFIX]).fetchone()[0])


def nemo_rl_table(con: duckdb.DuckDBPyConnection, *, rollout=None, scorer=None, run_ids=None, _rows=None) -> pd.DataFrame:
    """Per (run_id, rollout, scorer, step) of the NeMo-RL runs: counts and token_mult_prob_error (module
    docstring); empty (these columns) when the store holds none. `_rows` (run_all's shared row set) is
    accepted and not used: only a store with NeMo-RL rows pays for this pass."""
    if not has_nemo_rl(con):
        return empty(COLUMNS)
    base, params = rollout_base(con, Filters.make(rollout, scorer, run_ids), topk=False, advantage=True)
    sql = f"""
        SELECT run_id::VARCHAR AS run_id, rollout::VARCHAR AS rollout, scorer::VARCHAR AS scorer, step,
               count(*) AS n_tokens, count(*) FILTER (WHERE NOT finite) AS n_nonfinite,
               count(*) FILTER (WHERE finite) AS n_finite,
               avg(exp(abs(lpi - lmu))) FILTER (WHERE finite) AS token_mult_prob_error
        FROM ({base}) WHERE starts_with(scorer::VARCHAR, $nemo_prefix)
        GROUP BY ALL ORDER BY ALL"""
    out = query(con, sql, {**params, "nemo_prefix": SCORER_PREFIX})
    return out[COLUMNS] if not out.empty else empty(COLUMNS)


def pair_summary(table: pd.DataFrame) -> pd.DataFrame:
    """Per (rollout, scorer) of `nemo_rl_table`'s rows: the steps with a value, the median and the largest step
    value (and its step), and how many steps lie above BAND."""
    rows = []
    for (rollout, scorer), g in table.dropna(subset=["token_mult_prob_error"]).groupby(["rollout", "scorer"]):
        v = g["token_mult_prob_error"]
        rows.append({"rollout": rollout, "scorer": scorer, "n_steps": len(g), "n_finite": int(g["n_finite"].sum()),
                     "median_step": float(v.median()), "max_step": float(v.max()),
                     "max_at": g.loc[v.idxmax(), "step"], "steps_above": int((v > BAND).sum())})
    return pd.DataFrame(rows, columns=PAIR_COLUMNS)
