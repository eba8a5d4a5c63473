"""The probe behind `mismatch-lab doctor --model M`: a short, fixed collection through `collect`'s public
entry point (`mismatch_lab.collect.collect(CollectConfig)`), then the verdicts on its store.

The probe is fixed so that two probes compare: PROBE_PROMPTS (12 prompts of data/mixed_prompts.jsonl: 4
arithmetic, 4 chat, 4 code) × PROBE["samples"] samples × at most PROBE["max_tokens"] tokens, seed 0, no top-K:
at most 576 sampled tokens per (rollout, scorer) pair. The prompts are written beside the store
(`<db>.probe-prompts.jsonl`), so the run ids stay the same and an interrupted probe resumes like any
`collect` (re-run the same command; a complete probe is not redone).
"""

from __future__ import annotations

import json
from pathlib import Path

from mismatch_lab.errors import UserError

DEFAULT_DB = "doctor-probe.duckdb"
STUDY = "doctor-probe"
PROBE = {"samples": 2, "max_tokens": 24, "top_k": 0, "seed": 0}
PROBE_PROMPTS = (
    ("arith-000", "What is 7 + 7? Give the final answer as a number at the end.", "14"),
    ("arith-001", "What is 2 * 6? Give the final answer as a number at the end.", "12"),
    ("arith-002", "What is 75 + 72? Give the final answer as a number at the end.", "147"),
    ("arith-003", "What is 75 - 29? Give the final answer as a number at the end.", "46"),
    ("chat-000", "What is the capital of France?", None),
    ("chat-001", "Give me three tips for better sleep.", None),
    ("chat-002", "Explain photosynthesis in two sentences.", None),
    ("chat-003", "Write a haiku about autumn leaves.", None),
    ("code-000", "Write a Python function that reverses a string.", None),
    ("code-001", "Write a Python function to check if a number is prime.", None),
    ("code-002", "Write a SQL query that counts rows in a table named users.", None),
    ("code-003", "Write a JavaScript function that adds two numbers.", None),
)


def prompts_file(db: Path) -> Path:
    """Write the probe prompts beside the store (unchanged content is not rewritten) and return the path."""
    path = db.with_name(db.name + ".probe-prompts.jsonl")
    text = "".join(json.dumps({"id": i, "prompt": p, **({"answer": a} if a else {})}) + "\n"
                   for i, p, a in PROBE_PROMPTS)
    if not path.is_file() or path.read_text(encoding="utf-8") != text:
        path.write_text(text, encoding="utf-8")
    return path


def probe_config(model: str, db: Path, *, engine: str, rollout_dtypes: list[str], trainer_dtypes: list[str]):
    """The CollectConfig of the probe (module doc)."""
    from mismatch_lab.collect import CollectConfig

    cfg = CollectConfig(model=model, prompts=str(prompts_file(db)), engine=engine, rollout_dtypes=rollout_dtypes,
                        scorer_dtypes=trainer_dtypes, db=str(db), study=STUDY, **PROBE)
    cfg.validate()
    return cfg


def run_probe(model: str, db: str | None, *, engine: str, rollout_dtypes: list[str], trainer_dtypes: list[str],
              progress: bool = True) -> Path:
    """Collect the probe into `db` (DEFAULT_DB when None) and return the store's path."""
    from mismatch_lab.collect import collect

    path = Path(db or DEFAULT_DB)
    if path.exists() and not path.is_file():
        raise UserError(f"--db {path}: the probe writes a DuckDB file; pass a .duckdb path, not a directory")
    if not path.parent.is_dir():
        raise UserError(f"--db {path}: its folder does not exist; create it or pass another path")
    cfg = probe_config(model, path, engine=engine, rollout_dtypes=rollout_dtypes, trainer_dtypes=trainer_dtypes)
    collect(cfg, progress=progress)
    return path
