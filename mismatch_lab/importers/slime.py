"""slime / miles train-data dumps: `--save-debug-train-data PATH_TEMPLATE`, or `--dump-details DIR`
(which writes DIR/train_data/{rollout_id}.pt).

A dump is a `torch.save` pickle (slime `slime/observability/train_data_utils.py`):

    {"format_version": 2, "rollout_id": int, "rank": int, "samples": [sample, ...], "dp_shards": [...],
     "raw_reward": [...]}   # raw_reward: a whole-batch field, present when the trainer had it

one file per rollout, written by the data-parallel source rank with the samples of every DP shard,
context-parallel fields gathered back to full length. A sample is a dict of the trainer's per-sample
columns (the names keep their plural form): `tokens` (prompt + response ids, `total_lengths` long),
`response_lengths`, `total_lengths`, and per response token `loss_masks`, `rollout_log_probs` (mu),
`log_probs` (pi), `advantages`, `returns`, `entropy`, optional `rollout_topk_token_ids` /
`rollout_topk_log_probs` ([response_length, K]), plus scalars (`rewards`, `sample_index`,
`rollout_position`, ...). miles writes 0.0 into masked rollout log-prob slots: only loss-mask positions
are stored, so those placeholders never reach the store.

What is read -> where it goes:
    rollout_id                                   sequences.step
    rank                                         the rank part of seq_id
    tokens[total - response:]                    tokens.token_id
    loss_masks                                   the stored positions
    rollout_log_probs / log_probs                tokens.logp_rollout / scores.logp
    entropy                                      scores.entropy
    advantages                                   tokens.advantage and sequences.advantage (mean)
    raw_reward[rollout_position] (else rewards)  sequences.reward
    total_lengths - response_lengths             sequences.prompt_len
    rollout_topk_token_ids / _log_probs          tokens.topk_ids_rollout / topk_logps_rollout
    rollout_routed_experts [T - 1, layers, k]    routing rows (side 'rollout'): response token p (sequence
      (where the dump holds it)                  position T - R + p) takes row T - R + p - 1, the forward
                                                 whose output gives it; layer = the dump's layer axis; ids as
                                                 dumped (weights, margin NULL)
Dropped: returns, values, ref_log_probs, kl, dp_shards (the DP / micro-batch layout) and the rest.

`rollout_routed_experts` (slime @624b824a `slime/utils/types.py` ~l.361: SGLang's routed experts of
len(tokens) - 1 forwards, [rows, num_layers, moe_router_topk], every transformer layer: the trainer skips the
dense ones by moe_layer_freq, `actor.py` `fill_routing_replay`) is a per-sample column of rollout_data, so the
dump's samples carry it when rollout_data still holds it at the dump. slime captures it only with
--use-rollout-routing-replay, and `fill_routing_replay` then deletes it from rollout_data before training, hence
before `save_debug_train_data`: a dump of that commit lacks it (miles likewise, importers/miles.py).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pyarrow as pa

from mismatch_lab.errors import UserError
from mismatch_lab.importers.base import Discovery, Source
from mismatch_lab.importers.jsonlines import ID_TEXT
from mismatch_lab.record.arrow import bad_token_ids, describe_bad_ids
from mismatch_lab.record.flat import (
    PROBABILITIES_FIX,
    FlatBatch,
    describe_excess,
    logp_excess,
)

FRAMEWORK = "slime"
HELP = "slime / miles --save-debug-train-data dumps (torch.save pickles; needs --trust-pickle)"
EXPECTED = ("the .pt train dumps of --save-debug-train-data: <dump dir>/train_data/<rollout_id>[_<rank>].pt, given as "
            "the dump dir, its train_data folder, or a .pt file")
FORMAT_VERSION = 2
PER_TOKEN = ("loss_masks", "rollout_log_probs", "log_probs", "advantages", "entropy")


def add_arguments(parser) -> None:
    parser.add_argument("--trust-pickle", action="store_true",
                        help="load the dumps: they are Python pickles (torch.save), and loading a pickle can "
                             "run any code it contains; pass this only for files you trust")


def discover(path: Path, args) -> Discovery:
    if not getattr(args, "trust_pickle", False):
        raise UserError(
            "slime dumps are Python pickles (torch.save) and loading a pickle can run any code it contains: "
            f"pass --trust-pickle to load the files under {path} if you trust them"
        )
    if path.is_file():
        files, folder = [path], path.parent
    else:
        folder = path / "train_data" if (path / "train_data").is_dir() else path
        files = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix == ".pt")
    run_name = folder.parent.name if folder.name == "train_data" else folder.name
    return Discovery(sources=[Source(p, listed=not path.is_file()) for p in sorted(files, key=_natural)],
                     run_name=run_name)


def _natural(p: Path):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p.name)]


def _array(value, dtype) -> np.ndarray:
    """A 1-D or 2-D numpy array of a tensor (any dtype/device) or a list."""
    if hasattr(value, "detach"):
        value = value.detach().cpu()
        if value.is_floating_point():
            value = value.float()
        value = value.numpy()
    return np.asarray(value, dtype=dtype)


def _scalar(value):
    if hasattr(value, "item"):
        return value.item()
    return value


def _whole(value, where: str, name: str) -> int:
    """An integer field (a Python or numpy number, or a one-element tensor) that must be a whole number."""
    v = _scalar(value)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not float(v).is_integer():
        raise UserError(f"{where}: field {name!r} must be a whole number, got {type(v).__name__} {v!r:.40}")
    return int(v)


def _floats(value, where: str, name: str) -> np.ndarray:
    """A number field as a float64 array of its shape (UserError naming the field otherwise)."""
    try:
        return _array(value, np.float64)
    except (TypeError, ValueError) as exc:
        raise UserError(f"{where}: field {name!r} must be a list or tensor of numbers ({exc})") from None


def _ids(value, where: str, name: str) -> np.ndarray:
    """A token-id field (any shape) as int64, each id a whole number in INT_RANGE (UserError otherwise)."""
    try:
        a = _array(value, None)
    except (TypeError, ValueError) as exc:
        raise UserError(f"{where}: field {name!r} must be a list or tensor of {ID_TEXT} ({exc})") from None
    bad = bad_token_ids(a)
    if bad.any():
        raise UserError(f"{where}: field {name!r} must hold {ID_TEXT}; got {describe_bad_ids(a, bad)}")
    return a.astype(np.int64)


def read(src: Source, args):
    import torch  # only this importer needs torch

    path = src.path
    try:
        payload = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # a truncated or foreign file: torch/pickle raise many kinds
        raise UserError(f"{path}: cannot be loaded with torch.load ({type(exc).__name__}: {exc})") from exc
    if not isinstance(payload, dict) or payload.get("format_version") != FORMAT_VERSION:
        found = payload.get("format_version") if isinstance(payload, dict) else type(payload).__name__
        rollout_dump = isinstance(payload, dict) and "samples" in payload and "format_version" not in payload
        foreign = not isinstance(payload, dict) or not ({"format_version", "rollout_data"} & payload.keys())
        if src.listed and foreign:  # a folder may hold rollout dumps or checkpoints beside the train dumps
            src.skipped = "a rollout dump (--save-debug-rollout-data)" if rollout_dump else "not a slime train dump"
            return
        hint = ""
        if rollout_dump:
            hint = " (this looks like a rollout dump, --save-debug-rollout-data; pass the train_data dumps)"
        elif isinstance(payload, dict) and "rollout_data" in payload:
            hint = (" (a per-rank train dump, as miles' --dump-details writes: mismatch-lab import miles "
                    f"{path.parent.parent if path.parent.name == 'train_data' else path.parent} --out STORE --trust-pickle)")
        raise UserError(f"{path}: not a slime train-data dump of format_version {FORMAT_VERSION} "
                        f"(format_version {found!r}){hint}")
    for key in ("rollout_id", "samples"):
        if key not in payload:
            raise UserError(f"{path}: field {key!r} is missing")
    step = _whole(payload["rollout_id"], str(path), "rollout_id")
    rank = 0 if payload.get("rank") is None else _whole(payload["rank"], str(path), "rank")
    samples = payload["samples"]
    if not isinstance(samples, (list, tuple)):
        raise UserError(f"{path}: field 'samples' is not a list")
    if not samples:
        return
    raw = payload.get("raw_reward")
    positions = [s.get("rollout_position") if isinstance(s, dict) else None for s in samples]
    use_raw = (isinstance(raw, (list, tuple)) and len(raw) == len(samples)
               and sorted(p for p in positions if p is not None) == list(range(len(samples))))
    yield _batch(path, samples, step, rank, raw if use_raw else None)


def _batch(path: Path, samples, step: int, rank: int, raw_reward) -> FlatBatch:
    cols: dict[str, list] = {k: [] for k in ("tokens", *PER_TOKEN)}
    rewards, prompt_lens, topk_ids, topk_lps = [], [], [], []
    has = {k: None for k in ("advantages", "entropy", "topk", "rollout_routed_experts")}
    routes: list[tuple[np.ndarray, np.ndarray]] = []
    for i, s in enumerate(samples):
        where = f"{path}: sample {i}"
        if not isinstance(s, dict):
            raise UserError(f"{where} is not a dict")
        for key in ("tokens", "response_lengths", "loss_masks", "rollout_log_probs", "log_probs"):
            if s.get(key) is None:
                extra = (" (the trainer's log-probs: slime dumps them when it computed or captured them in the "
                         "training forward; some versions skip that pass, e.g. for a single optimizer step without "
                         "KL)") if key == "log_probs" else ""
                raise UserError(f"{where}: field {key!r} is missing{extra}")
        R = _whole(s["response_lengths"], where, "response_lengths")
        tokens = _ids(s["tokens"], where, "tokens").reshape(-1)
        T = _whole(s["total_lengths"], where, "total_lengths") if s.get("total_lengths") is not None else len(tokens)
        if len(tokens) != T:
            raise UserError(f"{where}: field 'tokens' has {len(tokens)} ids, total_lengths says {T} (misaligned)")
        if not 0 <= R <= T:
            raise UserError(f"{where}: response_lengths {R} outside [0, total_lengths {T}]")
        cols["tokens"].append(tokens[T - R:])
        for key in PER_TOKEN:
            v = s.get(key)
            if key in has:
                if has[key] is None:
                    has[key] = v is not None
                elif has[key] != (v is not None):
                    raise UserError(f"{where}: field {key!r} is present in some samples and missing in others")
            if v is None:
                continue
            a = _floats(v, where, key).reshape(-1)
            if len(a) != R:
                raise UserError(f"{where}: field {key!r} has {len(a)} values, response_lengths is {R} (misaligned)")
            cols[key].append(a)
        ids, lps = s.get("rollout_topk_token_ids"), s.get("rollout_topk_log_probs")
        if (ids is None) != (lps is None):
            raise UserError(f"{where}: rollout_topk_token_ids and rollout_topk_log_probs go together")
        if has["topk"] is None:
            has["topk"] = ids is not None
        elif has["topk"] != (ids is not None):
            raise UserError(f"{where}: rollout top-K is present in some samples and missing in others")
        if ids is not None:
            ids, lps = _ids(ids, where, "rollout_topk_token_ids"), _floats(lps, where, "rollout_topk_log_probs")
            if ids.ndim != 2 or ids.shape != lps.shape or ids.shape[0] != R:
                raise UserError(f"{where}: rollout_topk_token_ids / rollout_topk_log_probs have shapes "
                                f"{ids.shape} / {lps.shape}, expected [{R}, K] both")
            topk_ids.append(ids)
            topk_lps.append(lps)
        if _present(has, "rollout_routed_experts", s.get("rollout_routed_experts") is not None, where):
            routes.append(_sample_routes(s["rollout_routed_experts"], where, T, R))
        reward = _scalar(raw_reward[int(_scalar(s["rollout_position"]))]) if raw_reward is not None else _scalar(s.get("rewards"))
        if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))):
            raise UserError(f"{where}: field 'rewards' must be a number, got {type(reward).__name__} {reward!r:.40}")
        rewards.append(reward)
        prompt_lens.append(T - R)
    lens = np.array([len(t) for t in cols["tokens"]], dtype=np.int64)
    cat = {k: (np.concatenate(v) if v else np.zeros(0)) for k, v in cols.items()}
    _check_logprobs(path, step, cat, lens, topk_lps)
    routing, routing_mask = _concat_routes(path, routes) if has["rollout_routed_experts"] else (None, None)
    return FlatBatch(
        step=step, rank=rank, offsets=np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
        token_ids=cat["tokens"].astype(np.int64), mask=cat["loss_masks"] != 0,
        logp_rollout=cat["rollout_log_probs"], logp_trainer=cat["log_probs"],
        advantage=cat["advantages"] if has["advantages"] else None, entropy=cat["entropy"] if has["entropy"] else None,
        reward=np.array([np.nan if r is None else float(r) for r in rewards], dtype=np.float64),
        prompt_len=np.array(prompt_lens, dtype=np.int64),
        topk_ids=_lists(topk_ids, pa.int64()) if has["topk"] else None,
        topk_logps=_lists(topk_lps, pa.float64()) if has["topk"] else None,
        routing=routing, routing_mask=routing_mask,
    )  # fmt: skip


def _present(has: dict, key: str, present: bool, where: str) -> bool:
    """`present`, after checking that every sample so far had `key` present or every one lacked it."""
    if has[key] is None:
        has[key] = present
    elif has[key] != present:
        raise UserError(f"{where}: field {key!r} is present in some samples and missing in others")
    return present


def _sample_routes(value, where: str, T: int, R: int) -> tuple[np.ndarray, np.ndarray]:
    """([R, layers, k] routes, [R] captured) of a sample's response tokens from its `rollout_routed_experts`
    [rows, layers, k] (row i: the forward of token i): response token p takes row T - R + p - 1, captured when
    that row exists."""
    try:
        a = _array(value, None)
    except (TypeError, ValueError) as exc:
        raise UserError(f"{where}: field 'rollout_routed_experts' must be a tensor of expert ids ({exc})") from None
    if a.ndim != 3 or a.dtype.kind not in "iu" or len(a) > T:
        raise UserError(f"{where}: field 'rollout_routed_experts' has shape {list(a.shape)} of {a.dtype}, expected "
                        f"integer [at most {T} tokens, layers, k]")
    rows = np.arange(T - R - 1, T - 1)
    captured = (rows >= 0) & (rows < len(a))
    if not len(a):
        return np.zeros((R, *a.shape[1:]), dtype=a.dtype), captured
    return a[np.clip(rows, 0, len(a) - 1)], captured


def _concat_routes(path: Path, routes: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """The samples' routes laid end to end (UserError when their [layers, k] differ)."""
    shapes = sorted({r.shape[1:] for r, _ in routes})
    if len(shapes) > 1:
        raise UserError(f"{path}: rollout_routed_experts of different [layers, k] {[list(x) for x in shapes]} "
                        "in one dump")
    return np.concatenate([r for r, _ in routes]), np.concatenate([m for _, m in routes])


def _check_logprobs(path: Path, step: int, cat: dict, lens: np.ndarray, topk_lps: list[np.ndarray]) -> None:
    """UserError naming the file, rollout, field, count, largest and first sample when a log-prob at a
    loss-mask position exceeds `flat.LOGP_TOLERANCE`: probabilities passed for log-probabilities."""
    stored = cat["loss_masks"] != 0
    n = len(stored)
    fields = [("rollout_log_probs", cat["rollout_log_probs"], np.arange(n)), ("log_probs", cat["log_probs"], np.arange(n))]
    if topk_lps:  # [R, K] per sample: each value's token position
        k = np.concatenate([np.full(a.shape[0], a.shape[1], dtype=np.int64) for a in topk_lps])
        values = np.concatenate([a.reshape(-1) for a in topk_lps])
        fields.append(("rollout_topk_log_probs", values, np.repeat(np.arange(n), k)))
    for name, values, token in fields:
        bad = logp_excess(values, stored[token])
        if bad.any():
            first = np.searchsorted(np.cumsum(lens), token[np.argmax(bad)], side="right")
            raise UserError(f"{path} (rollout_id {step}): field {name!r} has {describe_excess(values, bad)} at "
                            f"loss-mask positions, the first in sample {first}: {PROBABILITIES_FIX}")


def _lists(arrays: list[np.ndarray], typ: pa.DataType) -> pa.Array:
    """[N] list array of the rows of per-sample [R, K] arrays (K may differ between samples)."""
    rows = sum(a.shape[0] for a in arrays)
    sizes = np.concatenate([np.full(a.shape[0], a.shape[1], dtype=np.int64) for a in arrays]) if arrays else np.zeros(0, np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
    values = np.concatenate([a.reshape(-1) for a in arrays]) if arrays else np.zeros(0)
    assert len(offsets) == rows + 1
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type=typ))
