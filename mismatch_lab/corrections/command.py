"""`mismatch-lab corrections`: every objective and rollout correction of the registry on the same tokens.

    mismatch-lab corrections --db studies/precision-sweep/results --json corrections.json
    mismatch-lab corrections --db runs/import-store --set seq_mis.cap=2 --set geo_mis.low=0.99

--db takes anything `open_store` reads (a .duckdb file, a Parquet export, a recorded or imported shard
store). The JSON file is an object: key `corrections` holds one row per (method, rollout, scorer), keys
`by_adv_sign`, `by_mu_bucket`, `by_category` the splits (columns: mismatch_lab/corrections/report.py).
"""

from __future__ import annotations

import argparse
import json
import sys

from mismatch_lab.cli import json_output
from mismatch_lab.errors import UserError
from mismatch_lab.store.reader import STORE_HELP


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--db", required=True, metavar="PATH",
                        help=STORE_HELP)
    parser.add_argument("--json", metavar="FILE", help="also write every table to FILE as JSON (NaN -> null)")
    parser.add_argument("--set", action="append", default=[], metavar="METHOD.PARAM=VALUE", dest="overrides",
                        help="override a published threshold, e.g. seq_mis.cap=2 (repeatable; docs/corrections.md)")
    parser.add_argument("--chunk-tokens", type=int, default=1 << 20,
                        help="tokens read and laid out at once (bounds memory; default 1048576)")


def parse_overrides(items: list[str]) -> dict[str, dict[str, float]]:
    """['seq_mis.cap=2', ...] -> {'seq_mis': {'cap': 2.0}}; UserError naming the format."""
    out: dict[str, dict[str, float]] = {}
    for item in items:
        name, _, rest = item.partition(".")
        param, sep, value = rest.partition("=")
        try:
            out.setdefault(name, {})[param] = float(value)
        except ValueError:
            sep = ""
        if not (sep and name and param):
            raise UserError(f"--set {item!r}: write METHOD.PARAM=VALUE, e.g. --set seq_mis.cap=2")
    return out


def run(args: argparse.Namespace) -> int:
    from mismatch_lab.analysis.command import to_json
    from mismatch_lab.corrections.compare import compare
    from mismatch_lab.corrections.report import format_table
    from mismatch_lab.store.reader import open_store

    json_path = json_output(args.json, "corrections.json")
    if args.chunk_tokens < 1024:
        raise UserError(f"--chunk-tokens {args.chunk_tokens}: use at least 1024")
    overrides = parse_overrides(args.overrides)
    con = open_store(args.db)

    def progress(done: int, total: int) -> None:
        print(f"\r{done:,} / {total:,} tokens", end="", file=sys.stderr, flush=True)

    try:
        tables = compare(con, overrides=overrides, chunk_tokens=args.chunk_tokens, progress=progress)
    except ValueError as exc:  # unknown method or parameter, bad threshold
        raise UserError(str(exc)) from None
    print(file=sys.stderr)
    if tables["corrections"].empty:
        print(f"{args.db}: no (rollout, scorer) pair with tokens; nothing to compare")
    print(format_table(tables["corrections"]))
    if json_path is not None:
        json_path.write_text(json.dumps(to_json(tables), indent=1, allow_nan=False) + "\n")
        print(f"\nwrote {json_path} ({', '.join(f'{k}: {len(v)} rows' for k, v in tables.items())})")
    return 0
