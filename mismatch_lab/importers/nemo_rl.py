"""NeMo-RL's per-step training-data dumps: `LOG_DIR/**/train_data_step<N>.jsonl`, parsed by DuckDB into
Arrow (no Python per line) and turned into contract rows with numpy.

Source of the format (NVIDIA-NeMo/RL, commit 7ea279abfbeb698b092856d0dab61e7cf39bc909):
* `nemo_rl/algorithms/grpo.py` (sync and async GRPO, "Log training data"): every step, unless
  `env.should_log_nemo_gym_responses`, writes `log_data` with `content`, `rewards` (and
  `filtered_rewards`), `input_lengths`, `token_ids` (train_data["input_ids"]: prompt + response, right
  padded to the batch's length), `token_loss_mask`, `sample_loss_mask`, `advantages` (per token),
  `generation_logprobs` (the rollout engine's log mu, 0.0 on prompt and padding positions) and
  `prev_logprobs` (the trainer's log pi at the weights that generated the rollout: `policy.get_logprobs`
  before the update), all per position lists of the padded length, to `train_data_step{N}.jsonl`
  (N = the training step, from 1). Versions before f11f99c79 (2026-02-21; from 0fae6bc24, 2025-04-28)
  write only `content`, `rewards`, `generation_logprobs`, `prev_logprobs`, `input_lengths`.
* `nemo_rl/utils/logger.py` `Logger.log_batched_dict_as_jsonl`: one line per sample, from
  `make_microbatch_iterator(1)` (a slice [i:i+1] of every list), so each value is wrapped in a list once
  more (`"rewards": [1.0]`, `"token_ids": [[...]]`), plus `"idx": i`; `json.dumps` writes non-finite
  floats as `NaN` / `Infinity`. The log dir is `logger.log_dir` or an `exp_NNN` folder under it
  (`get_next_experiment_dir`).
* `nemo_rl/algorithms/loss/loss_functions.py` `ClippedPGLossFn.__call__`: log-prob index t is the
  log-prob of token_ids[t] (the loss takes `[:, 1:]` of every per-position field; position 0 is never
  trained), mask = token_mask * sample_mask, and the two metrics its users watch:
  `token_mult_prob_error` = masked mean of exp(|generation_logprobs - prev_logprobs|) (docs/guides/grpo.md:
  above 1.05 warrants a look) and `gen_kl_error` = masked mean of `calculate_kl(generation_logprobs,
  prev_logprobs, k3)` = exp(log r) - 1 - log r with log r = prev - generation, i.e. our kl_k3.

What is read -> where it goes:
    token_ids                                   tokens.token_id (old form: NULL, it has none)
    token_loss_mask * sample_loss_mask           the stored positions (position 0 never), new form
    [first non-zero generation log-prob, input_lengths)  the stored positions, old form (see `_old_mask`)
    generation_logprobs                          tokens.logp_rollout (log mu)
    prev_logprobs                                scores.logp (log pi), scorer 'nemo-rl:<--trainer-dtype>'
    advantages                                   tokens.advantage and sequences.advantage (mean)
    rewards                                      sequences.reward
    N of the file name                           sequences.step
Dropped: content, idx, filtered_rewards, agent_ref, input_lengths (beyond the old form's mask).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from mismatch_lab.doctor.bands import NEMO_RL_MULT_PROB_ERROR
from mismatch_lab.errors import UserError
from mismatch_lab.importers.base import Discovery, Source
from mismatch_lab.importers.jsonlines import (
    ID_TEXT,
    Problems,
    bad_id_rows,
    has_null_items,
    lengths,
    logp_problem,
    read_batches_duckdb,
)
from mismatch_lab.record.flat import FlatBatch
from mismatch_lab.store.schema import MAX_LOG_RATIO

FRAMEWORK = "nemo-rl"
HELP = "NeMo-RL GRPO training-data logs: LOG_DIR/**/train_data_step<N>.jsonl"
EXPECTED = "the train_data_step<N>.jsonl files NeMo-RL writes into its log dir (exp_NNN folders included)"
STEP_FILE = re.compile(r"^train_data_step(\d+)\.jsonl$")
EXP_DIR = re.compile(r"^exp_\d+$")
NEW = ("token_ids", "token_loss_mask", "advantages", "generation_logprobs", "prev_logprobs")
OLD = ("generation_logprobs", "prev_logprobs")
"""Per-position fields of the two forms (all required); per-sample fields: PER_SAMPLE."""
PER_SAMPLE = {"input_lengths": True, "rewards": False, "sample_loss_mask": False}
METRICS = {
    "token_mult_prob_error": "mean over the stored finite tokens of exp(|log pi - log mu|) (= mean max(r, 1/r))",
    "gen_kl_error": "kl_k3: mean of r - log r - 1 (NeMo-RL's default reference_policy_kl_type k3)",
}


def add_arguments(parser) -> None:
    """No options of its own."""


def _step(p: Path) -> int:
    return int(STEP_FILE.match(p.name).group(1))


def discover(path: Path, args) -> Discovery:
    if path.is_file():
        if not STEP_FILE.match(path.name):
            raise UserError(f"{path} is not a NeMo-RL training-data log: expected train_data_step<N>.jsonl")
        files = [path]
    else:
        files = sorted((p for p in path.rglob("train_data_step*.jsonl") if STEP_FILE.match(p.name)),
                       key=lambda p: (str(p.parent), _step(p)))
    folder = path.parent if path.is_file() else path
    run_name = folder.parent.name if EXP_DIR.match(folder.name) else folder.name
    notes, seen = [], {}
    for f in files:
        seen.setdefault(_step(f), []).append(f.parent.name)
    repeated = {s: d for s, d in seen.items() if len(d) > 1}
    if repeated:
        s, d = next(iter(sorted(repeated.items())))
        notes.append(f"{len(repeated)} step(s) appear in several files (e.g. step {s} in {', '.join(d)}): a resumed "
                     "run logs them again; all are imported")
    return Discovery(sources=[Source(f, step=_step(f), listed=not path.is_file()) for f in files],
                     run_name=run_name, notes=notes, config={"metrics": METRICS})


def _first_object(path: Path) -> dict | None:
    """The first non-blank line's object (to tell the forms apart), None for an empty file."""
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            if raw.strip():
                try:
                    obj = json.loads(raw)
                except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                    raise UserError(f"{path}:{lineno}: not valid JSON ({exc})") from None
                if not isinstance(obj, dict):
                    raise UserError(f"{path}:{lineno}: not a JSON object")
                return obj
    return None


def _form(path: Path, obj: dict) -> tuple[tuple[str, ...], bool]:
    """(per-position fields, wrapped): the new or old field set, and whether each value is wrapped in a
    list once more (the Logger's batch of one)."""
    fields = NEW if "token_ids" in obj else OLD
    for name in fields:
        if not isinstance(obj.get(name), list):
            raise UserError(f"{path}:1: field {name!r} is missing or not a list (NeMo-RL's "
                            f"train_data_step<N>.jsonl holds {', '.join(fields)})")
    v = obj[fields[-1]]
    return fields, bool(v) and isinstance(v[0], list)


def _schema(fields: tuple[str, ...], wrapped: bool) -> pa.Schema:
    position, sample = pa.list_(pa.float64()), pa.float64()
    if wrapped:
        position, sample = pa.list_(position), pa.list_(sample)
    return pa.schema([(n, position) for n in fields] + [(n, sample) for n in PER_SAMPLE])


def _check_line(fields: tuple[str, ...], wrapped: bool):
    """Line-level validation, to name the first bad line when DuckDB rejects the file."""

    def check(obj: dict) -> str | None:
        n = None
        for name in fields:
            v = obj.get(name)
            if wrapped:
                if not isinstance(v, list) or len(v) != 1:
                    return f"field {name!r} must be a list holding one list (the logger's batch of one)"
                v = v[0]
            if not isinstance(v, list) or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v):
                return f"field {name!r} must be a list of numbers"
            if n is not None and len(v) != n:
                return f"field {name!r} has a different length than {fields[0]!r} (misaligned)"
            n = len(v)
        return None

    return check


def _unwrap(p: Problems, batch: pa.RecordBatch, names, wrapped: bool) -> dict[str, pa.Array]:
    """The columns `names` with the logger's extra list level removed (each row must hold exactly one)."""
    out = {}
    for name in names:
        col = batch.column(name)
        if wrapped:
            n = lengths(col)
            p.add((n >= 0) & (n != 1), f"field {name!r} must be a list holding one value (the logger's batch of one)")
            p.raise_first()
            col = pc.list_element(col, 0)  # a null row (missing field) stays null
        out[name] = col
    return out


def read(src: Source, args):
    path = src.path
    obj = _first_object(path)
    if obj is None:
        return
    fields, wrapped = _form(path, obj)
    src.facts = {"step": src.step, "form": "new" if fields == NEW else "old", "tokens": 0, "mult": 0.0, "k3": 0.0}
    schema = _schema(fields, wrapped)
    for row0, batch in read_batches_duckdb(path, schema, _check_line(fields, wrapped), src.n_lines):
        if batch.num_rows == 0:
            continue
        p = Problems(path, row0)
        cols = _unwrap(p, batch, [*fields, *PER_SAMPLE], wrapped)
        n = lengths(cols[fields[0]])
        for name in fields:
            m = lengths(cols[name])
            p.add(m < 0, f"field {name!r} is missing (or null)")
            p.add((m >= 0) & (m != n), f"field {name!r} has a different length than {fields[0]!r} (misaligned)")
        input_len = cols["input_lengths"].to_numpy(zero_copy_only=False)
        p.add(~((input_len >= 0) & (input_len <= np.maximum(n, 0)) & (input_len == np.floor(input_len))),
              f"field 'input_lengths' must be a whole number from 0 to the length of {fields[0]!r}")
        if fields == NEW:
            for name in ("token_ids", "token_loss_mask"):
                p.add(has_null_items(cols[name]), f"field {name!r} has a null item")
            p.add(bad_id_rows(cols["token_ids"]), f"field 'token_ids' must be a list of {ID_TEXT}")
        p.raise_first()
        flat = _batch(cols, n, input_len.astype(np.int64), src.step, fields == NEW)
        p = Problems(path, row0)  # log-probs above 0 at stored positions: probabilities, not log-probabilities
        for field, values in (("generation_logprobs", flat.logp_rollout), ("prev_logprobs", flat.logp_trainer)):
            logp_problem(p, values, flat.mask, n, field)
        p.raise_first()
        _check_trainer_pass(path, flat)
        _accumulate(src.facts, flat)
        yield flat


def _positions(row_len: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[N] each position's index within its row, and its row."""
    row = np.repeat(np.arange(len(row_len)), row_len)
    starts = np.concatenate([[0], np.cumsum(row_len)[:-1]]) if len(row_len) else np.zeros(0, np.int64)
    return np.arange(int(row_len.sum())) - starts[row], row


def _old_mask(mu: np.ndarray, pos: np.ndarray, row: np.ndarray, input_len: np.ndarray, n_rows: int) -> np.ndarray:
    """The old form's stored positions: it has no loss mask, and NeMo-RL writes 0.0 as the generation
    log-prob of every prompt (non-assistant) token, so a sample's response is taken as the positions from
    its first non-zero generation log-prob up to input_lengths (padding excluded). A response whose first
    tokens have log mu exactly 0.0 (probability 1) loses them; inside the span nothing is dropped (a
    multi-turn sample's tool or user tokens between assistant turns would be kept: that form cannot tell)."""
    inside = (pos >= 1) & (pos < input_len[row])
    nz = np.flatnonzero(inside & (mu != 0.0))
    first = np.full(n_rows, np.iinfo(np.int64).max)
    rows, at = np.unique(row[nz], return_index=True)
    first[rows] = pos[nz[at]]
    return inside & (pos >= first[row])


def _batch(cols: dict[str, pa.Array], row_len: np.ndarray, input_len: np.ndarray, step: int, new: bool) -> FlatBatch:
    def values(name):
        return pc.list_flatten(cols[name]).to_numpy(zero_copy_only=False).astype(np.float64)

    def per_sample(name, default):
        col = cols[name]
        return np.full(len(row_len), default) if col.null_count == len(col) else pc.fill_null(col, default).to_numpy(
            zero_copy_only=False).astype(np.float64)

    mu, pi = values("generation_logprobs"), values("prev_logprobs")
    pos, row = _positions(row_len)
    if new:
        sample_mask = per_sample("sample_loss_mask", 1.0)
        mask = (values("token_loss_mask") != 0) & (sample_mask[row] != 0) & (pos >= 1) & (pos < input_len[row])
    else:
        mask = _old_mask(mu, pos, row, input_len, len(row_len))
    rewards = cols["rewards"]
    return FlatBatch(
        step=step, rank=0, offsets=np.concatenate([[0], np.cumsum(row_len)]).astype(np.int64),
        token_ids=values("token_ids").astype(np.int64) if new else None, mask=mask,
        logp_rollout=mu, logp_trainer=pi, advantage=values("advantages") if new else None,
        reward=None if rewards.null_count == len(rewards) else per_sample("rewards", np.nan),
        prompt_before_mask=True,
    )  # fmt: skip


def _check_trainer_pass(path: Path, f: FlatBatch) -> None:
    """NeMo-RL writes prev_logprobs = 0.0 everywhere when it skips the trainer's log-prob pass
    (loss_fn.force_on_policy_ratio = true): then there is no log pi to compare."""
    pi, mu = f.logp_trainer[f.mask], f.logp_rollout[f.mask]
    if len(pi) and not pi.any() and mu.any():
        raise UserError(f"{path}: prev_logprobs is 0.0 at every stored position while generation_logprobs is not: "
                        "this run skipped the trainer's log-prob pass (loss_fn.force_on_policy_ratio = true), so "
                        "it logged no trainer log-prob to compare; import a run trained without that option")


def _accumulate(facts: dict, f: FlatBatch) -> None:
    """Sums of NeMo-RL's token_mult_prob_error and gen_kl_error over the stored tokens the analyses count
    as finite (both log-probs finite, r not overflowing a double)."""
    mu, pi = f.logp_rollout[f.mask], f.logp_trainer[f.mask]
    with np.errstate(invalid="ignore", over="ignore"):
        d = pi - mu
        good = np.isfinite(d) & (d < MAX_LOG_RATIO)
        d = d[good]
        facts["tokens"] += int(good.sum())
        facts["mult"] += float(np.exp(np.abs(d)).sum())
        facts["k3"] += float((np.exp(d) - 1.0 - d).sum())


def step_metrics(sources: list[Source]) -> dict[int, tuple[float, float, int]]:
    """step -> (token_mult_prob_error, gen_kl_error, finite tokens) over the files read."""
    acc: dict[int, list] = {}
    for src in sources:
        f = src.facts
        if f and f["tokens"]:
            a = acc.setdefault(f["step"], [0.0, 0.0, 0])
            a[0], a[1], a[2] = a[0] + f["mult"], a[1] + f["k3"], a[2] + f["tokens"]
    return {s: (m / n, k / n, n) for s, (m, k, n) in sorted(acc.items())}


def summary_notes(sources: list[Source]) -> list[str]:
    """The summary's lines on NeMo-RL's own mismatch metrics, per step (METRICS says which of ours they are)."""
    per = step_metrics(sources)
    if not per:
        return []
    mult = np.array([v[0] for v in per.values()])
    worst = list(per)[int(np.argmax(mult))]
    band = NEMO_RL_MULT_PROB_ERROR.warn  # NeMo-RL's published level, 1.05
    over = [s for s, v in per.items() if v[0] > band]
    shown = list(per.items())
    shown = shown if len(shown) <= 8 else shown[:4] + shown[-4:]
    lines = [(f"NeMo-RL token_mult_prob_error (mean exp|log pi - log mu|) per step: median {np.median(mult):.6g}, max "
             f"{mult.max():.6g} at step {worst}; {len(over)} of {len(per)} steps above NeMo-RL's {band} band"),
             ("NeMo-RL gen_kl_error = our kl_k3 (mean r - log r - 1) per step: median "
             f"{np.median([v[1] for v in per.values()]):.6g}"),
             "per step (token_mult_prob_error, gen_kl_error): "
             + ", ".join(f"{s}: {m:.6g}, {k:.6g}" for s, (m, k, _) in shown) + (" ..." if len(per) > 8 else "")]
    return lines
