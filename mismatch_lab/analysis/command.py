"""`mismatch-lab analyze`: a one-screen summary of a store's analyses, any table in full, and every table
as one JSON document.

    mismatch-lab analyze --db studies/default/default.duckdb --json analysis.json
    mismatch-lab analyze --db studies/precision-sweep --rollout vllm:bf16 --scorer hf:fp32
    mismatch-lab analyze --db studies/precision-sweep --table volatility --table clipping    # tables in full
    mismatch-lab analyze --db studies/precision-sweep --all                                    # every table

By default it prints the summary (analysis/summary.py): what the store holds, per (rollout, scorer) pair
the key numbers with their units, the scorers' noise floor, and the names `--table` takes. --db takes anything `open_store` reads (a .duckdb file, even while a collect writes it; a directory of
<table>.parquet files; a study directory). The JSON holds one key per analysis (volatility, clipping,
precision, violations, approximation, steps, staleness, support, token_mult_prob_error), each a list of row objects; NaN and +-inf
become null. Every key is defined in docs/analysis.md.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import TYPE_CHECKING

from mismatch_lab.analysis import ANALYSES
from mismatch_lab.cli import json_output
from mismatch_lab.errors import UserError
from mismatch_lab.store.reader import STORE_HELP
from mismatch_lab.store.run_option import add_run_id_argument, asked_runs, open_runs

# The column that splits each analysis into its sub-tables for printing (see run_all).
SPLIT = {"volatility": "scale", "clipping": "view", "precision": "comparison", "violations": "source", "support": "view",
         "routing": "view"}

if TYPE_CHECKING:  # pandas is imported where a table is printed: `analyze --help` needs none of it
    import pandas as pd


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--db", required=True, metavar="PATH",
                        help=STORE_HELP)
    parser.add_argument("--json", metavar="FILE", help="also write every table to FILE as JSON (NaN -> null)")
    parser.add_argument("--rollout", action="append", metavar="ENGINE:DTYPE",
                        help="only this rollout, e.g. vllm:bf16, or the engine alone (vllm) for a run whose dtype is "
                        "unknown (repeatable; default: all)")
    parser.add_argument("--scorer", action="append", metavar="ENGINE:DTYPE",
                        help="only this scorer, e.g. hf:fp32 (repeatable; default: all)")
    add_run_id_argument(parser)
    parser.add_argument("--top-n", type=int, default=30, help="how many most-clipped token strings to list (default 30)")
    shown = parser.add_mutually_exclusive_group()
    shown.add_argument("--table", action="append", choices=ANALYSES, metavar="NAME",
                       help=f"print this table in full instead of the summary (repeatable): {', '.join(ANALYSES)}")
    shown.add_argument("--all", action="store_true", help="print every table in full instead of the summary")


def run(args: argparse.Namespace) -> int:
    from mismatch_lab.analysis import run_all
    from mismatch_lab.analysis.summary import analyze_summary, store_counts
    if args.top_n < 1:
        raise UserError(f"--top-n must be at least 1, got {args.top_n}")
    json_path = json_output(args.json, "analysis.json")
    run_ids = asked_runs(args)
    con = open_runs(args.db, run_ids, restrict=False)  # a run asked for by name must be whole; run_all filters
    try:
        t0 = time.perf_counter()

        tables = run_all(con, rollout=args.rollout, scorer=args.scorer, run_ids=run_ids,
                         top_n=args.top_n, progress=_progress(sys.stderr.isatty()), flags=True)  # fmt: skip
        if sys.stderr.isatty():
            print("\r\033[K", end="", file=sys.stderr, flush=True)  # the progress line is gone before the output
        counts = None if args.all or args.table else store_counts(con)
    finally:
        con.close()
    if counts is not None:
        print("\n".join(analyze_summary(args.db, counts, tables, _filters(args))))
    for name in ANALYSES if args.all else args.table or ():
        print_table(name, tables[name])
    if json_path is not None:
        json_path.write_text(json.dumps(to_json(tables), indent=1, allow_nan=False) + "\n")
        print(f"\nwrote {json_path} ({sum(map(len, tables.values())):,} rows of {len(tables)} tables)")
    print(f"analyze: {time.perf_counter() - t0:.1f} s; definitions and denominators: docs/analysis.md", file=sys.stderr)
    return 0


def _progress(terminal: bool):
    """Progress on stderr after each analysis: one line rewritten in place on a terminal (so the summary keeps
    the screen), one line each otherwise (logs)."""

    def progress(name: str, seconds: float) -> None:
        text = f"analyze: {name} done at {seconds:.1f} s"
        print(f"\r{text}\033[K" if terminal else text, end="" if terminal else "\n", file=sys.stderr, flush=True)

    return progress


def _filters(args: argparse.Namespace) -> list[str]:
    """The filter options given, as the command line spelled them."""
    given = {"--rollout": args.rollout, "--scorer": args.scorer, "--run-id": args.run_ids}
    return [f"{flag} {v}" for flag, values in given.items() for v in values or ()]


def print_table(name: str, df: pd.DataFrame) -> None:
    import pandas as pd

    split = SPLIT.get(name)
    parts = [(None, df)] if split is None or df.empty else list(df.groupby(split, sort=False))
    for key, part in parts:
        title = name if key is None else f"{name} [{split} = {key}]"
        print(f"\n== {title} ({len(part)} rows) ==")
        if part.empty:
            print("(no rows: the store holds no data for this analysis)")
            continue
        shown = part.drop(columns=[split] if key is not None else []).dropna(axis=1, how="all")
        with pd.option_context("display.max_columns", None, "display.width", 250, "display.max_colwidth", 24):
            print(shown.to_string(index=False, float_format=lambda v: f"{v:.4g}"))


def to_json(tables: dict[str, pd.DataFrame]) -> dict[str, list[dict]]:
    """{analysis: [row objects]} with NaN/NA/+-inf as None and numpy scalars as Python ones."""
    return {name: [{k: _plain(v) for k, v in row.items()} for row in df.to_dict("records")] for name, df in tables.items()}


def _plain(v):
    import numpy as np
    import pandas as pd

    if v is None or v is pd.NA or v is pd.NaT:
        return None
    if isinstance(v, (np.integer,)):
        return int(v)
    if isinstance(v, (np.bool_, bool)):
        return bool(v)
    if isinstance(v, (float, np.floating)):
        return float(v) if math.isfinite(v) else None
    if isinstance(v, pd.Timestamp):
        return v.isoformat()
    return v
