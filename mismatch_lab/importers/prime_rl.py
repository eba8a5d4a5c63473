"""prime-rl's token export (`trainer.enable_token_export = true`), parsed by DuckDB into Arrow (no Python
per line) and turned into contract rows with numpy.

Layout (prime-rl `src/prime_rl/trainer/rl/token_export.py`):

    <output_dir>/token_exports/step_<N>/rank_<R>.jsonl            single run
    <output_dir>/<run_id>/token_exports/step_<N>/rank_<R>.jsonl   multi-run trainer (one folder per run)
    .../step_<N>/STABLE                                           written once every rank flushed step N

PATH may be the output dir (or a run's folder under it), the token_exports folder, one step folder or
one rank file. Each line is one JSON object (schema_version 1) holding one slice of a trainer micro
batch: per-position arrays aligned with `token_ids`, prompt positions included (loss_mask false, their
inference_logprobs 0.0), non-finite values written as null, trailing padding trimmed. The exporter
writes one line per entry of the micro batch's `sequence_lengths`, i.e. per packed sample; a line that
holds several samples (position_ids restarting at 0 inside it) is split at each restart, so both forms
read the same.

What is read -> where it goes:
    token_ids                                  tokens.token_id
    loss_mask (and the "rl" channel of losses)  the stored positions (see `_stored`)
    inference_logprobs                         tokens.logp_rollout (log mu)
    trainer_logprobs                           scores.logp (log pi), scorer 'prime-rl:<--trainer-dtype>'
    entropy                                    scores.entropy
    advantages                                 tokens.advantage (extra column) and sequences.advantage (mean)
    rewards                                    sequences.reward (the value at the first stored position)
    env_name                                   sequences.env_name (extra column)
    export_step (else step), the step_N folder  sequences.step; must agree
    rank_R of the file name                    the rank part of seq_id
Dropped: micro_step, micro_sequence_idx, export_sequence_idx, run_id (the folder gives it), the loss
channels' values, mismatch_kl, log_importance_ratio, importance_ratio, prob_delta, is_masked,
is_masked_high, is_masked_low (all derived from log mu, log pi and the advantage).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from mismatch_lab.errors import UserError
from mismatch_lab.importers.base import Discovery, Source, format_hint
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
    read_batches_duckdb,
)
from mismatch_lab.record.arrow import is_token_id
from mismatch_lab.record.flat import FlatBatch

FRAMEWORK = "prime-rl"
HELP = "prime-rl token exports (trainer.enable_token_export): <output_dir>/token_exports/step_N/rank_R.jsonl"
EXPECTED = "<output_dir>/token_exports/step_N/rank_R.jsonl: the output dir, its token_exports folder, a step folder or a file"
SCHEMA_VERSION = 1
STEP_DIR = re.compile(r"^step_(\d+)$")
RANK_FILE = re.compile(r"^rank_(\d+)\.jsonl$")
STABLE = "STABLE"

_F = pa.list_(pa.float64())
SCHEMA = pa.schema([
    ("schema_version", pa.int64()), ("step", pa.int64()), ("export_step", pa.int64()), ("env_name", pa.string()),
    ("token_ids", pa.list_(pa.int64())), ("position_ids", pa.list_(pa.int64())), ("loss_mask", pa.list_(pa.bool_())),
    ("advantages", _F), ("rewards", _F), ("inference_logprobs", _F), ("trainer_logprobs", _F), ("entropy", _F),
    ("losses", pa.list_(pa.struct([("rl", pa.struct([("mask", pa.bool_())]))]))),
])  # fmt: skip
"""The fields read; every other field of a line is skipped by the parser."""
SCHEMA_RL_ONLY = pa.schema([f for f in SCHEMA if f.name != "losses"])
"""Without `losses`, for a file that never mentions another loss channel than "rl": there the rl mask is
the loss_mask, and not converting the per-position dicts saves 10-30 % of the parse."""
CE_KEY = b'"ce":{'
"""How prime-rl writes the "ce" (cross-entropy) channel into `losses` (json.dumps, compact separators)."""
STRICT_INTS = ("token_ids", "position_ids")
PROBES = (CE_KEY,)
"""Looked for while the driver hashes the file (`Source.found`): decides SCHEMA or SCHEMA_RL_ONLY."""
PER_POSITION = {"position_ids": True, "loss_mask": True, "inference_logprobs": True, "trainer_logprobs": True,
                "advantages": False, "rewards": False, "entropy": False, "losses": False}
"""Per-position fields (name -> required) that must be as long as token_ids."""


def add_arguments(parser) -> None:
    parser.add_argument("--include-unstable", action="store_true",
                        help="also import step folders without prime-rl's STABLE marker (a step still being "
                             "written, or an export from a prime-rl version that did not write the marker)")


def _exports_dir(path: Path) -> Path:
    """The token_exports folder PATH points at (UserError naming the layouts otherwise)."""
    if (path / "token_exports").is_dir():
        return path / "token_exports"
    if any(STEP_DIR.match(p.name) for p in path.iterdir() if p.is_dir()):
        return path
    runs = sorted(p for p in path.iterdir() if p.is_dir() and (p / "token_exports").is_dir())
    if len(runs) == 1:
        return runs[0] / "token_exports"
    if runs:
        raise UserError(
            f"{path} holds the token exports of {len(runs)} runs ({', '.join(p.name for p in runs)}); import each "
            f"into its own run: mismatch-lab import prime-rl {runs[0]} --out STORE"
        )
    raise UserError(
        f"no prime-rl token exports under {path}: expected <output_dir>/token_exports/step_N/rank_R.jsonl "
        "(trainer.enable_token_export = true); pass the output dir, the token_exports folder or a step folder"
        + format_hint(path, FRAMEWORK)
    )


def _step(d: Path) -> int:
    return int(STEP_DIR.match(d.name).group(1))


def discover(path: Path, args) -> Discovery:
    only: Path | None = None
    if path.is_file():
        if not (RANK_FILE.match(path.name) and STEP_DIR.match(path.parent.name)):
            raise UserError(f"{path} is not a prime-rl export file: expected .../token_exports/step_N/rank_R.jsonl"
                            + format_hint(path, FRAMEWORK))
        only, step_dirs, exports = path, [path.parent], path.parent.parent
    elif STEP_DIR.match(path.name):
        step_dirs, exports = [path], path.parent
    else:
        exports = _exports_dir(path)
        step_dirs = sorted((p for p in exports.iterdir() if p.is_dir() and STEP_DIR.match(p.name)), key=_step)
    run_name = exports.parent.name if exports.name == "token_exports" else exports.name
    sources, unstable = [], []
    for d in step_dirs:
        if not (d / STABLE).is_file() and not args.include_unstable:
            unstable.append(d.name)
            continue
        files = [only] if only else [p for p in d.iterdir() if RANK_FILE.match(p.name)]
        for f in sorted(files, key=lambda p: int(RANK_FILE.match(p.name).group(1))):
            sources.append(Source(f, step=_step(d), rank=int(RANK_FILE.match(f.name).group(1))))
    notes = []
    if unstable:
        notes.append(f"{len(unstable)} step folder(s) without a STABLE marker skipped ({', '.join(unstable[:5])}"
                     f"{' ...' if len(unstable) > 5 else ''}): still being written, or exported by a prime-rl "
                     "version that writes no marker; --include-unstable imports them")
    config = {"include_unstable": bool(args.include_unstable), "unstable_skipped": len(unstable)}
    return Discovery(sources=sources, run_name=run_name, notes=notes, config=config)


def _check_line(step: int):
    """Line-level validation (to name the first bad line when Arrow rejects the file)."""

    def integer(x):
        return isinstance(x, int) and not isinstance(x, bool)

    def boolean(x):
        return isinstance(x, bool)

    def num_or_null(x):
        return x is None or number(x)

    def check(obj: dict) -> str | None:
        if obj.get("schema_version") != SCHEMA_VERSION:
            return f"schema_version {obj.get('schema_version')!r}: this importer reads prime-rl schema_version {SCHEMA_VERSION}"
        s = obj.get("export_step", obj.get("step"))
        if s != step:
            return f"export_step/step {s!r} differs from the step folder step_{step}"
        problem = check_list(obj, "token_ids", is_token_id, ID_TEXT, True, None)
        if problem:
            return problem
        n = len(obj["token_ids"])
        for name, what, item in (("position_ids", "integers", integer), ("loss_mask", "booleans", boolean),
                                 ("inference_logprobs", "numbers or null", num_or_null),
                                 ("trainer_logprobs", "numbers or null", num_or_null),
                                 ("advantages", "numbers or null", num_or_null), ("rewards", "numbers or null", num_or_null),
                                 ("entropy", "numbers or null", num_or_null)):
            problem = check_list(obj, name, item, what, PER_POSITION[name], n)
            if problem:
                return problem
        losses = obj.get("losses")
        if losses is not None and (not isinstance(losses, list) or len(losses) != n):
            return "field 'losses' has a different length than token_ids (misaligned)"
        if not isinstance(obj.get("env_name"), (str, type(None))):
            return "field 'env_name' must be a string"
        return None

    return check


def _stored(batch: pa.RecordBatch, loss_mask: np.ndarray, row_len: np.ndarray) -> np.ndarray:
    """The stored positions: loss_mask true and, where the line carries prime-rl's per-position `losses`
    channels, the "rl" channel's mask true. loss_mask is the union of every channel's mask; a position
    trained only by the "ce" channel (tokens from another actor) has no rollout log-prob to compare."""
    if "losses" not in batch.schema.names:
        return loss_mask
    losses = batch.column("losses")
    if is_all_null(losses):
        return loss_mask
    rl = pc.struct_field(pc.struct_field(pc.list_flatten(losses), [0]), [0])
    rl_mask = pc.fill_null(rl, False).to_numpy(zero_copy_only=False)
    has = ~losses.is_null().to_numpy(zero_copy_only=False)
    keep = np.ones(len(loss_mask), dtype=bool)
    keep[np.repeat(has, row_len)] = rl_mask
    return loss_mask & keep


def read(src: Source, args):
    path, step = src.path, src.step
    schema = SCHEMA if CE_KEY in src.found else SCHEMA_RL_ONLY
    for row0, batch in read_batches_duckdb(path, schema, _check_line(step), src.n_lines, STRICT_INTS):
        if batch.num_rows == 0:
            continue
        p = Problems(path, row0)
        sv = batch.column("schema_version")
        p.add(pc.fill_null(pc.not_equal(sv, SCHEMA_VERSION), True).to_numpy(zero_copy_only=False),
              f"schema_version is not {SCHEMA_VERSION} (this importer reads prime-rl token export schema_version "
              f"{SCHEMA_VERSION})")
        row_step = pc.coalesce(batch.column("export_step"), batch.column("step"))
        p.add(pc.fill_null(pc.not_equal(row_step, step), True).to_numpy(zero_copy_only=False),
              f"export_step/step differs from the step folder step_{step} (or is missing)")
        token_ids = batch.column("token_ids")
        n = lengths(token_ids)
        p.add(n < 0, "field 'token_ids' is missing (or null)")
        check_aligned(p, batch, n, {k: v for k, v in PER_POSITION.items() if k in batch.schema.names})
        for name in ("token_ids", "position_ids", "loss_mask"):
            p.add(has_null_items(batch.column(name)), f"field {name!r} has a null item")
        p.add(~batch.column("_ints_ok").to_numpy(zero_copy_only=False),
              "field 'token_ids' or 'position_ids' holds something else than whole numbers")
        p.add(bad_id_rows(token_ids), f"field 'token_ids' must be a list of {ID_TEXT}")
        p.raise_first()
        flat = _batch(batch, n, step, src.rank)
        p = Problems(path, row0)  # log-probs above 0 at stored positions: probabilities, not log-probabilities
        for field, values in (("inference_logprobs", flat.logp_rollout), ("trainer_logprobs", flat.logp_trainer)):
            logp_problem(p, values, flat.mask, n, field)
        p.raise_first()
        yield flat


def _batch(batch: pa.RecordBatch, row_len: np.ndarray, step: int, rank: int) -> FlatBatch:
    row_off = np.concatenate([[0], np.cumsum(row_len)])
    N = int(row_off[-1])
    positions = flat_values(batch.column("position_ids"), row_len, np.int64)
    # a sample starts at each line start and wherever position_ids restarts at 0 (packed samples)
    starts = np.union1d(np.flatnonzero(positions == 0), row_off[:-1][row_len > 0])
    offsets = np.append(starts, N).astype(np.int64)
    row_of_sample = np.searchsorted(row_off, starts, side="right") - 1
    loss_mask = flat_values(batch.column("loss_mask"), row_len, None).astype(bool)

    def optional(name):
        col = batch.column(name)
        return None if is_all_null(col) else flat_values(col, row_len)

    env = batch.column("env_name")
    return FlatBatch(
        step=step, rank=rank, offsets=offsets,
        token_ids=flat_values(batch.column("token_ids"), row_len, np.int64),
        mask=_stored(batch, loss_mask, row_len),
        logp_rollout=flat_values(batch.column("inference_logprobs"), row_len),
        logp_trainer=flat_values(batch.column("trainer_logprobs"), row_len),
        advantage=optional("advantages"), entropy=optional("entropy"), token_reward=optional("rewards"),
        prompt_before_mask=True,
        extra={"env_name": env.take(pa.array(row_of_sample))},
    )  # fmt: skip
