"""`mismatch-lab corrections`: every objective and rollout correction of the registry on the same tokens.

    mismatch-lab corrections --db studies/precision-sweep/results --json corrections.json
    mismatch-lab corrections --db runs/import-store --set seq_mis.cap=2 --set geo_mis.low=0.99
    mismatch-lab corrections --db studies/precision-sweep/results --preset verl/decoupled_geo_rs --preset verl/default
    mismatch-lab corrections --db studies/precision-sweep/results --framework verl --json verl.json
    mismatch-lab corrections --list-presets

--db takes anything `open_store` reads (a .duckdb file, a Parquet export, a recorded or imported shard
store). The JSON file is an object: key `corrections` holds one row per (method, rollout, scorer), keys
`by_adv_sign`, `by_mu_bucket`, `by_category` the splits (columns: mismatch_lab/corrections/report.py).

--preset / --framework run framework presets instead (what the framework's own loss code, so configured, does
to the tokens: mismatch_lab/corrections/frameworks); the JSON file then holds key `presets`, one row per preset
and pair (columns: mismatch_lab/corrections/presets_report.py).
"""

from __future__ import annotations

import argparse
import json
import sys

from mismatch_lab.cli import json_output
from mismatch_lab.errors import UserError
from mismatch_lab.store.reader import STORE_HELP
from mismatch_lab.store.run_option import add_run_id_argument, asked_runs, open_runs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--db", metavar="PATH", help=STORE_HELP + " (required unless --list-presets)")
    parser.add_argument("--json", metavar="FILE", help="also write every table to FILE as JSON (NaN -> null)")
    add_run_id_argument(parser)
    parser.add_argument("--set", action="append", default=[], metavar="METHOD.PARAM=VALUE", dest="overrides",
                        help="override a published threshold, e.g. seq_mis.cap=2 (repeatable; docs/corrections.md)")
    parser.add_argument("--chunk-tokens", type=int, default=1 << 20,
                        help="tokens read and laid out at once (bounds memory; default 1048576)")
    parser.add_argument("--preset", action="append", default=[], metavar="NAME", dest="presets",
                        help="run a framework preset instead of the generic rules, e.g. verl/decoupled_geo_rs "
                             "(repeatable; --list-presets lists them)")
    parser.add_argument("--framework", action="append", default=[], metavar="NAME", dest="frameworks",
                        help="run every preset of a framework, its default first, e.g. verl (repeatable)")
    parser.add_argument("--list-presets", action="store_true",
                        help="list the framework presets (name, framework, default, source, formula) and exit")


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


def chosen_presets(names: list[str], frameworks: list[str]) -> list:
    """The presets of --preset NAME and --framework NAME, in the order given, each once; UserError for an
    unknown name or a framework without presets."""
    from mismatch_lab.corrections import frameworks as F

    out = {}
    try:
        for framework in frameworks:
            found = F.of_framework(framework)
            if not found:
                raise UserError(f"--framework {framework}: no presets for {framework} yet; "
                                "`mismatch-lab corrections --list-presets` lists the presets there are")
            out |= {p.name: p for p in found}
        for name in names:
            out[name] = F.get(name)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    return list(out.values())


def run(args: argparse.Namespace) -> int:
    if args.list_presets:
        from mismatch_lab.corrections.frameworks import presets
        from mismatch_lab.corrections.presets_report import list_presets

        print(list_presets(list(presets().values())))
        return 0
    if not args.db:
        raise UserError("pass --db STORE (or --list-presets to list the framework presets)")
    json_path = json_output(args.json, "corrections.json")
    if args.chunk_tokens < 1024:
        raise UserError(f"--chunk-tokens {args.chunk_tokens}: use at least 1024")
    chosen = chosen_presets(args.presets, args.frameworks)
    if chosen and args.overrides:
        raise UserError("--set changes the generic rules' thresholds; a preset is fixed: drop --set or --preset")
    overrides = parse_overrides(args.overrides)
    con = open_runs(args.db, asked_runs(args))  # only these runs' tokens are compared
    if chosen:
        return _run_presets(con, chosen, args, json_path)
    return _run_rules(con, overrides, args, json_path)


def _progress(done: int, total: int) -> None:
    print(f"\r{done:,} / {total:,} tokens", end="", file=sys.stderr, flush=True)


def _run_presets(con, chosen: list, args: argparse.Namespace, json_path) -> int:
    from mismatch_lab.corrections.presets_report import (
        format_presets,
        presets_json,
        run_presets,
    )

    table = run_presets(con, chosen, chunk_tokens=args.chunk_tokens, progress=_progress)
    print(file=sys.stderr)
    if table.empty:
        print(f"{args.db}: no (rollout, scorer) pair with tokens; nothing to run the presets on")
    print(format_presets(table))
    if json_path is not None:
        json_path.write_text(json.dumps({"presets": presets_json(table)}, indent=1, allow_nan=False) + "\n")
        print(f"\nwrote {json_path} (presets: {len(table)} rows)")
    return 0


def _run_rules(con, overrides, args: argparse.Namespace, json_path) -> int:
    from mismatch_lab.analysis.command import to_json
    from mismatch_lab.corrections.compare import compare
    from mismatch_lab.corrections.report import format_table

    try:
        tables = compare(con, overrides=overrides, chunk_tokens=args.chunk_tokens, progress=_progress)
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
