"""mismatch-lab's own JSON-lines format, for every framework without an importer: one sequence a line.

    {"step": 3, "token_ids": [791, 4320, 374], "logp_rollout": [-0.11, -2.3, -0.01],
     "logp_trainer": [-0.12, -2.2, -0.01], "advantage": 0.7, "reward": 1.0, "prompt_id": "gsm8k-17"}

| field              | type                                  | required | meaning                                                        |
|--------------------|---------------------------------------|----------|----------------------------------------------------------------|
| step               | integer >= 0                          | yes      | training step (sequences.step)                                  |
| token_ids          | list of integers in [0, 2^31)         | yes      | the sequence's tokens (response only, or prompt + response with `mask`) |
| logp_rollout       | list of numbers or null, len = token_ids | yes   | log mu: the rollout engine's log-prob of each token            |
| logp_trainer       | list of numbers or null, len = token_ids | yes   | log pi: the trainer's log-prob of the same token               |
| mask               | list of booleans (or 0/1), len = token_ids | no   | true = a response (loss-mask) token, stored; default: all true |
| advantage          | number, or list of numbers/null (per token) | no  | the advantage trained on                                       |
| reward             | number or null                        | no       | the sequence's reward                                          |
| prompt_id          | string or integer                     | no       | the prompt (GRPO group) the sequence answers                   |
| entropy            | list of numbers or null, len = token_ids | no    | the trainer's entropy at each position, nats                   |
| rollout_topk_ids   | list (per token) of lists of ids      | no       | the rollout engine's top-K token ids at each position          |
| rollout_topk_logps | list (per token) of lists of numbers  | no       | their log-probs; same shape as rollout_topk_ids (both or neither) |
| rank               | integer in [0, 4096)                  | no       | the writer (data-parallel rank); default 0                     |
| policy_lag         | integer in [0, 2^31), or a list of them (per token) | no | optimizer updates between the weights that sampled the sequence and those of logp_trainer (sequences.policy_lag); a per-token list must hold one value over the stored positions |

Other fields are ignored. null, NaN and +-Infinity in log-probs are stored as NULL with nonfinite = true; a
log-prob above 0 (beyond the rounding allowance `record.flat.LOGP_TOLERANCE`) at a stored position refuses the
file, naming the line: probabilities were passed for log-probabilities.
The bulk path reads the file with Arrow; a file that mixes forms (advantage a number on some lines and a
list on others, integer prompt_id, 0/1 masks) is read by a slower line-by-line pass, with the same result.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from mismatch_lab.errors import UserError
from mismatch_lab.importers.base import Discovery, Source
from mismatch_lab.importers.jsonlines import (
    ID_TEXT,
    Problems,
    bad_id_rows,
    check_aligned,
    check_list,
    flat_values,
    has_null_items,
    is_all_null,
    lengths,
    logp_problem,
    number,
    read_batches,
)
from mismatch_lab.record.arrow import INT_RANGE, MAX_RANKS, STEP_END, is_token_id
from mismatch_lab.record.flat import FlatBatch

FRAMEWORK = "jsonl"
HELP = "mismatch-lab's own JSON-lines format, one sequence a line (docs/import.md)"
EXPECTED = "a .jsonl file, or a folder holding .jsonl files (not its subfolders), one sequence a line (docs/import.md)"
PYTHON_BATCH = 5000  # lines per batch on the line-by-line path
STEP_TEXT = f"field 'step' must be an integer in {INT_RANGE}"
LAG_TEXT = (f"field 'policy_lag' must be an integer in {INT_RANGE} (optimizer updates between the sampling weights "
            "and the trainer's), or a list of them, one per token")
LAG_MIXED = ("field 'policy_lag' differs between the stored tokens of the line: the store keeps one lag per sequence "
             "(sequences.policy_lag); split the sequence where its lag changes, or give one number")

_F = pa.list_(pa.float64())
_I = pa.list_(pa.int64())
CANONICAL = pa.schema([
    ("step", pa.int64()), ("rank", pa.int64()), ("token_ids", _I), ("logp_rollout", _F), ("logp_trainer", _F),
    ("mask", pa.list_(pa.bool_())), ("adv_tok", _F), ("adv_seq", pa.float64()), ("reward", pa.float64()),
    ("prompt_id", pa.string()), ("entropy", _F), ("rollout_topk_ids", pa.list_(_I)),
    ("rollout_topk_logps", pa.list_(_F)), ("policy_lag", pa.int64()),
])  # fmt: skip
"""What each path turns the file into: `advantage` split by its form (per token / per sequence)."""
PER_POSITION = {"logp_rollout": True, "logp_trainer": True, "mask": False, "adv_tok": False, "entropy": False,
                "rollout_topk_ids": False, "rollout_topk_logps": False}


def _arrow_schema(advantage: pa.DataType) -> pa.Schema:
    fields = [f if f.name not in ("adv_tok", "adv_seq") else None for f in CANONICAL]
    fields = [f for f in fields if f is not None] + [pa.field("advantage", advantage)]
    return pa.schema(fields)


def add_arguments(parser) -> None:
    pass


def discover(path: Path, args) -> Discovery:
    if path.is_file():
        return Discovery(sources=[Source(path)], run_name=path.stem)
    files = sorted(p for p in path.iterdir() if p.is_file() and p.name.endswith(".jsonl"))
    return Discovery(sources=[Source(p) for p in files], run_name=path.name)


def read(src: Source, args):
    path = src.path
    for advantage in (_F, pa.float64()):  # the per-token form first, then the per-sequence one
        schema = _arrow_schema(advantage)
        batches = []
        try:
            for row0, batch in read_batches(path, schema, None, src.n_lines):
                batches.append((row0, batch))
        except UserError:
            continue  # another form, or a bad line: the next try, then the line-by-line pass, says which
        for row0, batch in batches:
            adv = batch.column("advantage")
            cols = {f.name: batch.column(f.name) for f in schema if f.name != "advantage"}
            cols["adv_tok"] = adv if advantage == _F else pa.nulls(batch.num_rows, _F)
            cols["adv_seq"] = adv if advantage != _F else pa.nulls(batch.num_rows, pa.float64())
            yield from _batches(path, row0, pa.RecordBatch.from_pydict(cols, schema=CANONICAL))
        return
    yield from _python_batches(path)


def _batches(path: Path, row0: int, batch: pa.RecordBatch):
    """Check a canonical batch (UserError naming file:line) and split it by (step, rank)."""
    p = Problems(path, row0)
    step = batch.column("step")
    p.add(step.is_null().to_numpy(zero_copy_only=False), "field 'step' is missing (or null)")
    s = pc.fill_null(step, 0).to_numpy()
    p.add((s < 0) | (s >= STEP_END), STEP_TEXT)
    r = pc.fill_null(batch.column("rank"), 0).to_numpy()
    p.add((r < 0) | (r >= MAX_RANKS), f"field 'rank' must be an integer in [0, {MAX_RANKS})")
    lag = pc.fill_null(batch.column("policy_lag"), 0).to_numpy()
    p.add((lag < 0) | (lag >= STEP_END), LAG_TEXT)
    token_ids = batch.column("token_ids")
    n = lengths(token_ids)
    p.add(n < 0, "field 'token_ids' is missing (or null)")
    check_aligned(p, batch, n, PER_POSITION, {"adv_tok": "advantage"})  # a per-token `advantage` of the file
    for name in ("token_ids", "mask"):
        p.add(has_null_items(batch.column(name)), f"field {name!r} has a null item")
    p.add(bad_id_rows(token_ids), f"field 'token_ids' must be a list of {ID_TEXT}")
    ids, lps = batch.column("rollout_topk_ids"), batch.column("rollout_topk_logps")
    p.add(ids.is_null().to_numpy(zero_copy_only=False) != lps.is_null().to_numpy(zero_copy_only=False),
          "rollout_topk_ids and rollout_topk_logps go together: give both or neither")
    both = ~ids.is_null().to_numpy(zero_copy_only=False) & ~lps.is_null().to_numpy(zero_copy_only=False)
    if both.any():
        rows_both = np.flatnonzero(both)
        ki, kl = ids.take(pa.array(rows_both)), lps.take(pa.array(rows_both))
        inner_ids, inner_lps = pc.list_flatten(ki), pc.list_flatten(kl)
        if len(inner_ids) == len(inner_lps):  # else a per-row length is wrong, which check_aligned reports
            row_of = rows_both[pc.list_parent_indices(ki).to_numpy()]
            null_entry = (inner_ids.is_null().to_numpy(zero_copy_only=False)
                          | inner_lps.is_null().to_numpy(zero_copy_only=False))  # as the line-by-line path
            for bad_tok, message in ((null_entry, "field 'rollout_topk_ids' must be a list (one per token) of lists"),
                                     (lengths(inner_ids) != lengths(inner_lps),
                                      "rollout_topk_ids and rollout_topk_logps have different shapes"),
                                     (has_null_items(inner_ids), "field 'rollout_topk_ids' has a null item"),
                                     (bad_id_rows(inner_ids), f"field 'rollout_topk_ids' must hold {ID_TEXT}")):
                bad_row = np.zeros(batch.num_rows, dtype=bool)
                bad_row[row_of[bad_tok]] = True
                p.add(bad_row, message)
    p.raise_first()
    _check_logprobs(path, row0, batch, n)
    keys = s * MAX_RANKS + r
    for key in np.unique(keys):
        rows = np.flatnonzero(keys == key)
        sub = batch if len(rows) == batch.num_rows else batch.take(pa.array(rows))
        yield _flat(sub, n[rows], int(key // MAX_RANKS), int(key % MAX_RANKS))


def _check_logprobs(path: Path, row0: int, batch: pa.RecordBatch, row_len: np.ndarray) -> None:
    """UserError naming file:line, the field, the count and the largest when log mu or log pi holds a value
    above 0 (beyond `flat.LOGP_TOLERANCE`) at a stored position: probabilities passed for log-probabilities.
    Top-K log-probs are checked where the rows are built (`flat.check_batch_logprobs`)."""
    p = Problems(path, row0)
    stored = _mask(batch, row_len)
    for name in ("logp_rollout", "logp_trainer"):
        logp_problem(p, flat_values(batch.column(name), row_len), stored, row_len, name)
    p.raise_first()


def _mask(batch: pa.RecordBatch, row_len: np.ndarray) -> np.ndarray:
    """[N] the stored positions: the `mask` of the line, all true where it has none."""
    mask_col = batch.column("mask")
    mask = np.ones(int(row_len.sum()), dtype=bool)
    if not is_all_null(mask_col):
        values = pc.list_flatten(mask_col).to_numpy(zero_copy_only=False).astype(bool)
        mask[np.repeat(~mask_col.is_null().to_numpy(zero_copy_only=False), row_len)] = values
    return mask


def _per_token_lists(col: pa.Array, row_len: np.ndarray) -> pa.Array:
    """[N] the inner lists of a list<list<...>> column; positions of a row without the field are null."""
    inner = pc.list_flatten(col)
    if col.null_count == 0:
        return inner
    valid = ~col.is_null().to_numpy(zero_copy_only=False)
    index = np.full(int(row_len.sum()), len(inner), dtype=np.int64)
    index[np.repeat(valid, row_len)] = np.arange(len(inner))
    return pa.concat_arrays([inner, pa.nulls(1, inner.type)]).take(pa.array(index))


def _flat(batch: pa.RecordBatch, row_len: np.ndarray, step: int, rank: int) -> FlatBatch:
    mask = _mask(batch, row_len)

    def optional(name):
        col = batch.column(name)
        return None if is_all_null(col) else flat_values(col, row_len)

    def per_row(name):
        col = batch.column(name)
        return None if is_all_null(col) else col.to_numpy(zero_copy_only=False).astype(np.float64)

    topk = batch.column("rollout_topk_ids")
    prompt = batch.column("prompt_id")
    return FlatBatch(
        step=step, rank=rank, offsets=np.concatenate([[0], np.cumsum(row_len)]).astype(np.int64),
        token_ids=flat_values(batch.column("token_ids"), row_len, np.int64), mask=mask,
        logp_rollout=flat_values(batch.column("logp_rollout"), row_len),
        logp_trainer=flat_values(batch.column("logp_trainer"), row_len),
        advantage=optional("adv_tok"), seq_advantage=per_row("adv_seq"), entropy=optional("entropy"),
        reward=per_row("reward"),
        prompt_id=None if is_all_null(prompt) else np.array(prompt.to_pylist(), dtype=object),
        topk_ids=None if is_all_null(topk) else _per_token_lists(topk, row_len),
        topk_logps=None if is_all_null(topk) else _per_token_lists(batch.column("rollout_topk_logps"), row_len),
        extra=_lag_column(batch.column("policy_lag")),
    )  # fmt: skip


def _lag_column(lag: pa.Array) -> dict[str, pa.Array]:
    """{'policy_lag': [S] int32} for sequences.policy_lag; {} when no line of the batch gives one."""
    return {} if is_all_null(lag) else {"policy_lag": lag.cast(pa.int32())}


# -- the line-by-line path ----------------------------------------------------------------------------


def _integer(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _num_or_null(x) -> bool:
    return x is None or number(x)


def _normalize(obj: dict) -> dict | str:
    """One line's object in the canonical columns, or the problem with it."""
    if not isinstance(obj, dict):
        return "not a JSON object"
    step = obj.get("step")
    if step is None:
        return "field 'step' is missing (or null)"
    if not _integer(step) or not 0 <= step < STEP_END:
        return STEP_TEXT
    rank = obj.get("rank", 0)
    if rank is None:
        rank = 0
    if not _integer(rank) or not 0 <= rank < MAX_RANKS:
        return f"field 'rank' must be an integer in [0, {MAX_RANKS})"
    problem = check_list(obj, "token_ids", is_token_id, ID_TEXT, True, None)
    if problem:
        return problem
    n = len(obj["token_ids"])
    for name, required in (("logp_rollout", True), ("logp_trainer", True), ("entropy", False)):
        problem = check_list(obj, name, _num_or_null, "numbers or null", required, n)
        if problem:
            return problem
    mask = obj.get("mask")
    if mask is not None:
        problem = check_list(obj, "mask", lambda x: isinstance(x, bool) or x in (0, 1), "booleans (or 0/1)", False, n)
        if problem:
            return problem
        mask = [bool(x) for x in mask]
    adv = obj.get("advantage")
    adv_tok = adv_seq = None
    if isinstance(adv, list):
        problem = check_list(obj, "advantage", _num_or_null, "numbers or null", False, n)
        if problem:
            return problem
        adv_tok = adv
    elif adv is not None:
        if not number(adv):
            return "field 'advantage' must be a number or a list of numbers (one per token)"
        adv_seq = adv
    reward = obj.get("reward")
    if reward is not None and not number(reward):
        return "field 'reward' must be a number or null"
    prompt = obj.get("prompt_id")
    if prompt is not None and not (isinstance(prompt, str) or _integer(prompt)):
        return "field 'prompt_id' must be a string or an integer"
    ids, lps = obj.get("rollout_topk_ids"), obj.get("rollout_topk_logps")
    if (ids is None) != (lps is None):
        return "rollout_topk_ids and rollout_topk_logps go together: give both or neither"
    if ids is not None:
        for name, v, item in (("rollout_topk_ids", ids, is_token_id), ("rollout_topk_logps", lps, _num_or_null)):
            if not isinstance(v, list) or not all(isinstance(k, list) and all(item(x) for x in k) for k in v):
                return f"field {name!r} must be a list (one per token) of lists"
            if len(v) != n:
                return f"field {name!r} has a different length than token_ids (misaligned)"
        if any(len(a) != len(b) for a, b in zip(ids, lps)):
            return "rollout_topk_ids and rollout_topk_logps have different shapes"
    lag = _lag(obj.get("policy_lag"), mask, n)
    if isinstance(lag, str):
        return lag
    return {"step": step, "rank": rank, "token_ids": obj["token_ids"], "logp_rollout": obj["logp_rollout"],
            "logp_trainer": obj["logp_trainer"], "mask": mask, "adv_tok": adv_tok, "adv_seq": adv_seq,
            "reward": reward, "prompt_id": None if prompt is None else str(prompt), "entropy": obj.get("entropy"),
            "rollout_topk_ids": ids, "rollout_topk_logps": lps, "policy_lag": lag}  # fmt: skip


def _lag(value, mask: list[bool] | None, n: int) -> int | None | str:
    """The sequence's policy lag from a number or a per-token list (one value over the stored positions), or
    the problem with it."""
    if value is None:
        return None
    if isinstance(value, list):
        if len(value) != n:
            return "field 'policy_lag' has a different length than token_ids (misaligned)"
        if not all(_integer(v) and 0 <= v < STEP_END for v in value):
            return LAG_TEXT
        kept = {v for v, m in zip(value, mask or [True] * n) if m}
        if len(kept) > 1:
            return LAG_MIXED
        return kept.pop() if kept else None
    return value if _integer(value) and 0 <= value < STEP_END else LAG_TEXT


def _python_batches(path: Path):
    rows: list[dict] = []
    row0 = 0
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise UserError(f"{path}:{lineno}: not valid JSON ({exc})") from None
            out = _normalize(obj)
            if isinstance(out, str):
                raise UserError(f"{path}:{lineno}: {out}")
            rows.append(out)
            if len(rows) >= PYTHON_BATCH:
                yield from _batches(path, row0, pa.RecordBatch.from_pylist(rows, schema=CANONICAL))
                row0, rows = row0 + len(rows), []
    if rows:
        yield from _batches(path, row0, pa.RecordBatch.from_pylist(rows, schema=CANONICAL))
