"""What every importer shares: finding what was imported before, staging one import in one
`store.shards.Transaction`, the run row, progress and the summary.

An importer module (see `importers.FORMATS`) provides

    FRAMEWORK                      the framework name: the scorer label is '<FRAMEWORK>:<trainer dtype>'
    HELP                           one line for `mismatch-lab import --help`
    EXPECTED                       what PATH may be, for the error when nothing is found there
    PROBES (optional)              byte strings to look for while the file is hashed (Source.found)
    add_arguments(parser)          its own options
    discover(path, args)           -> Discovery: the source files, the default run name, notes
    read(source, args)             -> iterator of flat.FlatBatch (UserError naming file:line on bad input)
    summary_notes(sources) (optional) -> lines for the summary (e.g. the framework's own metrics, from Source.facts)

Rules kept here for all formats:
* dedup: a source file's shards are named `import-<first 16 hex digits of the sha256 of its bytes>`
  (`-pNNNN` for further parts of a large file); a file whose digest already names a committed
  sequences shard of the run is skipped, so importing the same files again adds nothing;
* all or nothing: every shard of one import is staged in one Transaction and committed at the end;
  any error (or Ctrl-C, SIGTERM) before the commit removes what was staged, so the store is left as it
  was; the commit (run row as running, renames, run row as complete) runs with those signals deferred
  (`_commit`), and a process killed outright during it leaves a journal that the next import of the run
  finishes (`commit_journal`): committed rows never lack their run row;
* sequence ids: `record.arrow.seq_ids(step, rank, index)`, the index continuing after the highest one
  the run already holds for that (step, rank): imports of different files into one run never collide.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from mismatch_lab.errors import UserError
from mismatch_lab.record.arrow import INDEX_BITS, MAX_RANKS, RANK_BITS
from mismatch_lab.record.flat import TOKENS_STORED, BatchStats, TextLookup, batch_tables
from mismatch_lab.record.recorder import DTYPES, package_versions, scorer_label
from mismatch_lab.store import shards

ENGINES = ("vllm", "sglang", "unknown")
"""What `--rollout-engine` may declare (runs.engine)."""
SHARD_TOKENS = 2_000_000
"""Batches of one source file and step are gathered into shards of about this many tokens."""
IMPORT_NAME = re.compile(r"^import-([0-9a-f]{16})(-p\d{4})?$")
IMPORT_PACKAGES = ("mismatch-lab", "pyarrow", "numpy", "torch", "transformers")


@dataclass
class Source:
    """One file to import. `step`/`rank` when its place tells them (prime-rl's step_N/rank_R.jsonl)."""

    path: Path
    step: int | None = None
    rank: int | None = None
    n_lines: int | None = None  # set by the driver (newline count) before `read`
    found: frozenset[bytes] = frozenset()  # which of the format's PROBES occur in the file (set by the driver)
    listed: bool = False  # found by listing a folder (not named by the user): a file of another kind may be skipped
    skipped: str | None = None  # set by `read` when it skipped the file (why): a note in the summary
    facts: dict = field(default_factory=dict)  # set by `read`: what the format's `summary_notes` reports


@dataclass
class Discovery:
    sources: list[Source]
    run_name: str  # default run name, before sanitising
    notes: list[str] = field(default_factory=list)  # printed in the summary (e.g. unstable steps skipped)
    config: dict = field(default_factory=dict)  # format-specific facts for runs.config


def sanitize_name(name: str) -> str:
    """A run name usable by `shards.check_name`: other characters become '-'."""
    s = re.sub(r"[^A-Za-z0-9._+-]+", "-", name).lstrip("-._+")[:200].rstrip("-")
    return s or "import"


def file_digest(path: Path, probes: tuple[bytes, ...] = ()) -> tuple[str, int, frozenset[bytes]]:
    """One pass over the file's bytes: the sha256 hex digest, the number of lines (newline-terminated
    or last) and which of the byte strings `probes` occur in it (a format's cheap hint, e.g. prime-rl's
    "ce" loss channel)."""
    h = hashlib.sha256()
    lines, last, tail = 0, b"\n", b""
    todo, found = set(probes), set()
    keep = max((len(p) for p in probes), default=1) - 1
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            h.update(chunk)
            lines += int(np.count_nonzero(np.frombuffer(chunk, dtype=np.uint8) == 10))
            last = chunk[-1:]
            if todo:
                window = tail + chunk
                for p in [p for p in todo if p in window]:
                    todo.discard(p)
                    found.add(p)
                tail = window[-keep:] if keep else b""
    return h.hexdigest(), lines + (last != b"\n"), frozenset(found)


def line_of_row(path: Path, row: int) -> int:
    """1-based line number of the `row`-th (0-based) non-blank line of a JSON-lines file."""
    seen, lineno = -1, 1
    with open(path, "rb") as fh:
        for lineno, line in enumerate(fh, 1):
            if line.strip():
                seen += 1
                if seen == row:
                    return lineno
    return lineno


def count_nonblank(path: Path) -> int:
    with open(path, "rb") as fh:
        return sum(1 for line in fh if line.strip())


def imported_digests(root: Path, run_id: str) -> set[str]:
    """The 16-hex-digit source digests that name committed sequences shards of the run."""
    out = set()
    for p in (root / "sequences" / run_id).glob("step-*/import-*.parquet"):
        m = IMPORT_NAME.match(p.stem)
        if m:
            out.add(m.group(1))
    return out


def next_free_index(root: Path, run_id: str, step: int, rank: int) -> int:
    """The first sequence index of (step, rank) that the run's committed shards do not use."""
    files = sorted(shards.step_dir(root, "sequences", run_id, step).glob("*.parquet"))
    if not files:
        return 0
    ids = np.concatenate([pq.read_table(p, columns=["seq_id"]).column("seq_id").to_numpy() for p in files])
    ranks = (ids >> INDEX_BITS) & (MAX_RANKS - 1)
    mine = ids[ranks == rank] & ((1 << INDEX_BITS) - 1)
    return int(mine.max()) + 1 if len(mine) else 0


class Progress:
    """Progress lines on stderr, at most one a second (and the last)."""

    def __init__(self, n_files: int, stream=None):
        self.n_files, self.stream = n_files, stream or sys.stderr
        self.t0 = self.last = time.perf_counter()

    def update(self, files: int, tokens: int, final: bool = False) -> None:
        now = time.perf_counter()
        if not final and now - self.last < 1.0:
            return
        self.last = now
        rate = tokens / max(now - self.t0, 1e-9)
        print(f"import: {files}/{self.n_files} files, {tokens:,} tokens, {rate / 1e6:.2f} M tokens/s",
              file=self.stream, flush=True)


@dataclass
class Summary:
    run_id: str
    store: Path
    fmt: str
    scorer: str
    rollout: str
    files_read: int = 0
    files_skipped: int = 0  # imported before (same bytes)
    steps: set = field(default_factory=set)
    stats: BatchStats = field(default_factory=BatchStats)
    shards: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def text(self) -> str:
        s, n = self.stats, self.stats.tokens
        steps = sorted(self.steps)
        step_txt = "none" if not steps else f"{len(steps)} ({steps[0]} .. {steps[-1]})" if len(steps) > 1 else f"1 ({steps[0]})"
        mean = f"{s.abs_diff_sum / s.finite:.6g} over {s.finite:,} finite tokens" if s.finite else "n/a (no finite token)"
        rate = f"{n / self.seconds / 1e6:.2f} M tokens/s" if self.seconds > 0 else "-"
        lines = [
            f"mismatch-lab import {self.fmt}: run {self.run_id}",
            f"  files       {self.files_read} read, {self.files_skipped} skipped (imported before: same bytes)",
            f"  steps       {step_txt}",
            f"  sequences   {s.sequences:,}" + (f" ({s.skipped_samples:,} samples without a loss-mask token not stored)"
                                                if s.skipped_samples else ""),
            f"  tokens      {n:,} response (loss-mask) tokens",
            (f"  non-finite  {s.nonfinite:,} tokens not counted as finite by the analyses: log mu or log pi "
             "NaN/inf/missing (stored NULL, nonfinite = true) or r = pi/mu overflowing a double (values kept)"),
            f"  mean |log pi - log mu|  {mean}",
            f"  rollout     {self.rollout}    scorer {self.scorer}",
            f"  time        {self.seconds:.1f} s ({rate})",
            f"  store       {self.store}",
        ]
        lines += [f"  note        {x}" for x in self.notes]
        if n == 0:
            lines.append("  nothing new was added to the store")
        lines += ["next:", f"  mismatch-lab analyze --db {self.store}", f"  mismatch-lab app --study {self.store}"]
        return "\n".join(lines)


def run_row(run_id: str, root: Path, fmt: str, framework: str, args, disc: Discovery, source: Path) -> dict:
    scorer = scorer_label(framework, args.trainer_dtype)
    return {
        "run_id": run_id, "study": root.name, "kind": "import", "created_at": shards.now_utc(), "status": "complete",
        "model": None, "weights_sha256": None, "engine": args.rollout_engine, "engine_dtype": args.rollout_dtype,
        "device": None, "versions": package_versions(IMPORT_PACKAGES),
        "config": {"framework": framework, "format": fmt, "trainer_dtype": args.trainer_dtype, "scorer": scorer,
                   "source": str(source), "tokens_stored": TOKENS_STORED,
                   "tokenizer": getattr(args, "tokenizer", None), **disc.config},
    }  # fmt: skip


LOOKS_LIKE = {"prime-rl": "prime-rl token export", "slime": "slime dump", "jsonl": "mismatch-lab jsonl file",
              "nemo-rl": "NeMo-RL training-data log", "skyrl": "SkyRL training-batch dump"}


def guess_format(path: Path) -> str | None:
    """The import format (importers.FORMATS) a file or folder looks like, from names and the first 4 kB;
    None when unclear. Only for the hint of an error: the importers check the format themselves."""
    if path.is_dir():
        if (path / "token_exports").is_dir() or any(path.glob("step_*/rank_*.jsonl")) or any(path.glob("rank_*.jsonl")):
            return "prime-rl"
        if (path / "train_data").is_dir() or any(path.glob("*.pt")):
            return "slime"
        if any(path.glob("train_data_step*.jsonl")) or any(path.glob("exp_*/train_data_step*.jsonl")):
            return "nemo-rl"
        if (path / "dumped_data").is_dir() or any(path.glob("global_step_*_training_input.pkl")):
            return "skyrl"
        first = next(iter(sorted(path.glob("*.jsonl"))), None)
        return None if first is None else guess_format(first)
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return None
    if path.suffix == ".pt" or head.startswith(b"PK\x03\x04"):  # torch.save writes a zip archive
        return "slime"
    if b'"generation_logprobs"' in head or path.name.startswith("train_data_step"):  # NeMo-RL's lines open with content
        return "nemo-rl"
    return "prime-rl" if b'"inference_logprobs"' in head else "jsonl" if b'"logp_rollout"' in head else None


def format_hint(path: Path, fmt: str) -> str:
    """'; PATH looks like ...: mismatch-lab import <other> ...' when `path` looks like another format."""
    other = guess_format(path)
    if other is None or other == fmt:
        return ""
    return f"; {path} looks like a {LOOKS_LIKE[other]}: mismatch-lab import {other} {path} --out STORE"


def _read(module, fmt: str, src: Source, args):
    """`module.read(src, args)`, its errors ending in the importer to use where the file looks like
    another format's (`format_hint`)."""
    try:
        yield from module.read(src, args)
    except UserError as exc:
        hint = format_hint(src.path, fmt)
        if not hint or hint in str(exc):  # no other format fits, or the importer named it already
            raise
        raise UserError(f"{exc}{hint}") from exc


def run_import(fmt: str, module, args, out=None) -> Summary:
    """Import `args.path` with the format module `module` into the store `args.out` (module docstring)."""
    out = out or sys.stdout
    t0 = time.perf_counter()
    if args.rollout_engine not in ENGINES:
        raise UserError(f"--rollout-engine {args.rollout_engine!r} is not one of {', '.join(ENGINES)}")
    for flag, dt in (("--trainer-dtype", args.trainer_dtype), ("--rollout-dtype", args.rollout_dtype)):
        if dt is not None and dt not in DTYPES:
            raise UserError(f"{flag} {dt!r} is not one of {', '.join(DTYPES)}")
    path = Path(args.path).expanduser()
    if not path.exists():
        raise UserError(f"no such file or directory: {path}")
    disc = module.discover(path, args)
    if not disc.sources:
        raise UserError(f"no {fmt} files to import under {path}" + (f" ({'; '.join(disc.notes)})" if disc.notes else "")
                        + f"; import {fmt} reads {module.EXPECTED}{format_hint(path, fmt)}")
    run_id = shards.check_name(args.run_name or sanitize_name(disc.run_name))
    texts = TextLookup(_load_tokenizer(args.tokenizer)) if getattr(args, "tokenizer", None) else None
    new_store = not Path(args.out).expanduser().exists()
    root = shards.init_store(args.out)
    progress = Progress(len(disc.sources))
    try:
        with shards.run_lock(root, run_id):
            finished = shards.replay_journal(root, commit_journal(root, run_id))  # a commit killed half way
            stale = shards.remove_stale_tmp(root, run_id, "import-")  # a killed import's staged files
            summary = _import_locked(root, run_id, fmt, module, args, disc, texts, path, progress, stale)
            if finished:
                summary.notes.append(f"finished the commit of an import killed during it ({finished} files)")
    except BaseException:
        if new_store:
            _remove_new_store(root)
        raise
    summary.seconds = time.perf_counter() - t0
    progress.update(len(disc.sources), summary.stats.tokens, final=True)
    print(summary.text(), file=out, flush=True)
    return summary


def _import_locked(root: Path, run_id: str, fmt: str, module, args, disc: Discovery, texts, path: Path,
                   progress: Progress, stale: int = 0) -> Summary:
    """run_import's work once the run's import lock is held: read, stage, commit (`_commit`), or abort and
    remove what this import created. `stale`: staged files of a killed import found (and removed) before:
    then a run left running may hold a partial commit (of an older version, which kept no journal) and
    stays running."""
    row = run_row(run_id, root, fmt, module.FRAMEWORK, args, disc, path)
    old = shards.existing_run(root, run_id)
    if old is not None:
        diff = shards.run_differences(old, row)
        if diff:
            raise UserError(f"run {run_id!r} is already in this store with {', '.join(diff)}; pass the same "
                            "--rollout-engine/--rollout-dtype/--trainer-dtype as before, or another --run-name")
        row["created_at"] = old["created_at"]
    if old is None or old.get("kind") == "import":  # a killed import's runs-row temp file (no Recorder's)
        shards.remove_stale_tmp(root, run_id, shards.rank_prefix(0), tables=())

    rollout = args.rollout_engine + (f":{args.rollout_dtype}" if args.rollout_dtype else " (dtype not given)")
    summary = Summary(run_id=run_id, store=root, fmt=fmt, scorer=row["config"]["scorer"], rollout=rollout,
                      notes=list(disc.notes))
    done = imported_digests(root, run_id)
    if old is None and done:
        raise UserError(f"run {run_id!r} of {root} holds imported rows but no run row (left by an import of an "
                        f"older version stopped after its commit); drop them with `mismatch-lab runs --db {root} "
                        f"--drop {run_id}`, then import again")
    stager = _Stager(shards.Transaction(root), root, run_id, summary)
    try:
        _stage(stager, module, fmt, args, disc, texts, done, progress)
        summary.notes += getattr(module, "summary_notes", lambda sources: [])(disc.sources)  # format's own metrics
        if disc.sources and all(src.skipped for src in disc.sources):
            raise UserError(f"no {fmt} file to import under {path}: {'; '.join(summary.notes)}")
        stager.tx.sync()  # the slow part of the commit, while an interrupt still undoes everything
        if summary.shards:
            _commit(root, stager, row, old)
    except BaseException:
        if not stager.tx.left_renamed:  # nothing of it is in the store: remove what it staged
            stager.tx.abort()
            _remove_empty(stager.dirs, root)
        raise
    if not summary.shards and old is not None and old.get("status") == "running" and not stale:
        # a run left running by an import killed after its renames is complete once nothing is left to add
        shards.write_run_row(root, row, 0)
    return summary


def _stage(stager: _Stager, module, fmt: str, args, disc: Discovery, texts, done: set[str],
           progress: Progress) -> None:
    """Read every source not imported before (`done`: digests) and stage its shards in `stager`."""
    root, run_id, summary = stager.root, stager.run_id, stager.summary
    next_index: dict[tuple[int, int], int] = {}
    for i, src in enumerate(disc.sources, 1):
        digest, src.n_lines, src.found = file_digest(src.path, getattr(module, "PROBES", ()))
        key = digest[:16]
        if key in done:
            summary.files_skipped += 1
            continue
        done.add(key)  # the same bytes twice in one import count once
        stager.start(key)
        for batch in _read(module, fmt, src, args):
            if not 0 <= batch.rank < MAX_RANKS:
                raise UserError(f"{src.path}: rank {batch.rank} outside [0, {1 << RANK_BITS})")
            k = (batch.step, batch.rank)
            if k not in next_index:
                next_index[k] = next_free_index(root, run_id, batch.step, batch.rank)
            try:
                tables, st = batch_tables(run_id, batch, next_index[k], summary.scorer, texts)
            except ValueError as exc:  # seq_ids: step or sequence count out of range
                raise UserError(f"{src.path}: {exc}") from exc
            next_index[k] += st.sequences
            summary.stats.add(st)
            if st.sequences:
                summary.steps.add(batch.step)
                stager.add(batch.step, tables, st.tokens)
            progress.update(i - 1, summary.stats.tokens)
        stager.finish()
        if src.skipped:
            summary.notes.append(f"{src.path.name} skipped: {src.skipped}")
            continue
        summary.files_read += 1
        progress.update(i, summary.stats.tokens)


def commit_journal(root: Path, run_id: str) -> Path:
    """The journal of an import's commit renames (`shards.Transaction.commit`), in the run's runs folder:
    the next import of the run finishes a commit killed half way (`shards.replay_journal`)."""
    return root / "runs" / run_id / "import-commit.json"


def _commit(root: Path, stager: _Stager, row: dict, old: dict | None) -> None:
    """Write the run row as running, rename the staged shards into place, write the row as `row` says,
    with SIGINT/SIGTERM deferred throughout (`shards.signals_deferred`): a signal takes effect once the run
    is whole, so no signal leaves committed rows without their run row. An error before any rename stayed
    puts back the row it found (or removes the one it wrote); once one stayed, the row is never removed
    (a failure leaves it running, as a kill would: the next import of the run finishes it)."""
    run_id = stager.run_id
    with shards.signals_deferred():
        try:
            # before the renames, as running: committed data always has its run row, and a kill before the
            # renames leaves no run that claims to be complete
            shards.write_run_row(root, {**row, "status": "running"}, 0)
            stager.tx.commit(journal=commit_journal(root, run_id))
        except BaseException:
            if not stager.tx.left_renamed:
                _put_back_row(root, run_id, old)
            raise
        shards.write_run_row(root, row, 0)


def _put_back_row(root: Path, run_id: str, old: dict | None) -> None:
    """The run row an import found, as it was (`old`), or none when the import created the run."""
    if old is not None:
        shards.write_run_row(root, old, 0)
        return
    row_path = shards.run_row_path(root, run_id, 0)
    row_path.unlink(missing_ok=True)
    if row_path.parent.is_dir() and not any(row_path.parent.iterdir()):
        os.rmdir(row_path.parent)


class _Stager:
    """Stages one source file's batches, gathered per step into shards of about SHARD_TOKENS tokens named
    `import-<key>` (then `import-<key>-p0001`, ...), in the import's one Transaction: a shard of each step
    table the batches hold rows of (sequences, tokens and scores always; routing where a format read some)."""

    def __init__(self, tx: shards.Transaction, root: Path, run_id: str, summary: Summary):
        self.tx, self.root, self.run_id, self.summary = tx, root, run_id, summary
        self.dirs: set[Path] = set()  # folders the staged shards go to (removed again if left empty)

    def start(self, key: str) -> None:
        self.key = key
        self.pending: dict[int, list[tuple[dict[str, pa.Table], int]]] = defaultdict(list)
        self.part: dict[int, int] = defaultdict(int)

    def add(self, step: int, tables: dict[str, pa.Table], tokens: int) -> None:
        self.pending[step].append((tables, tokens))
        if sum(n for _, n in self.pending[step]) >= SHARD_TOKENS:
            self.flush(step)

    def flush(self, step: int) -> None:
        parts = self.pending.pop(step, [])
        if not parts:
            return
        name = f"import-{self.key}" + (f"-p{self.part[step]:04d}" if self.part[step] else "")
        for table in ("sequences", "tokens", "scores", "routing"):
            held = [p[table] for p, _ in parts if table in p]
            if table == "routing" and not sum(t.num_rows for t in held):
                continue  # no route read: no routing shard (absent = none)
            data = pa.concat_tables(held, promote_options="default")
            self.tx.add(table, self.run_id, step, name, data)
            self.dirs.add(shards.shard_path(self.root, table, self.run_id, step, name).parent)
            self.summary.shards += 1
        self.part[step] += 1

    def finish(self) -> None:
        for step in list(self.pending):
            self.flush(step)


def _remove_empty(dirs: set[Path], root: Path) -> None:
    """Remove the step, run and table folders an aborted import created and left empty."""
    todo = {a for d in dirs for a in (d, d.parent, d.parent.parent) if root in a.parents}
    for d in sorted(todo, key=lambda p: -len(p.parts)):
        try:
            if d.is_dir() and not any(d.iterdir()):
                os.rmdir(d)
        except OSError:
            pass


def _remove_new_store(root: Path) -> None:
    """Remove a store this failed import created, when it holds nothing but its marker and empty folders."""
    try:
        for folder, _, _ in sorted(os.walk(root), key=lambda w: -len(w[0])):  # deepest first
            if Path(folder) != root and not any(Path(folder).iterdir()):
                os.rmdir(folder)
        if [p.name for p in root.iterdir()] == [shards.MARKER]:
            (root / shards.MARKER).unlink()
            root.rmdir()
    except OSError:
        pass


def _load_tokenizer(path: str):
    p = Path(path).expanduser()
    if not p.is_dir():
        raise UserError(f"--tokenizer {path}: not a directory; pass a folder with a Hugging Face tokenizer "
                        "(e.g. the model's checkpoint folder)")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(p))
    except Exception as exc:  # transformers raises many kinds for a folder that is not a tokenizer
        raise UserError(f"--tokenizer {path}: cannot load a tokenizer from it ({type(exc).__name__}: {exc})") from exc
