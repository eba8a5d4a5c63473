"""The `import` subcommand: one sub-parser per format of `importers.FORMATS`, the options every format
shares, then `base.run_import`."""

from __future__ import annotations

import argparse

from mismatch_lab.importers import FORMATS, importer
from mismatch_lab.importers.base import ENGINES, run_import
from mismatch_lab.record.recorder import DTYPES


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", metavar="PATH", help="the dump to import (a file or a folder; see docs/import.md)")
    p.add_argument("--out", required=True, metavar="STORE", help="the shard store to write (created if missing)")
    p.add_argument("--run-name", help="run id in the store (default: from the source folder or file name)")
    p.add_argument("--rollout-engine", default="unknown", choices=ENGINES,
                   help="the engine that sampled the rollouts (runs.engine; default unknown)")
    p.add_argument("--rollout-dtype", choices=DTYPES, help="the rollout engine's dtype (runs.engine_dtype)")
    p.add_argument("--trainer-dtype", choices=DTYPES,
                   help="the trainer's dtype: the scorer label is '<framework>:<dtype>' ('<framework>:trainer' if not given)")
    p.add_argument("--tokenizer", metavar="DIR",
                   help="a Hugging Face tokenizer folder: fills tokens.token_text and tokens.category")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="format", required=True, metavar="FORMAT")
    for name in FORMATS:
        module = importer(name)
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        _common(p)
        module.add_arguments(p)


def run(args) -> int:
    from mismatch_lab.errors import UserError
    from mismatch_lab.extras import IMPORT_NEEDS, missing_line

    for what in (args.format, "--tokenizer" if args.tokenizer else ""):
        if line := missing_line(what, IMPORT_NEEDS):  # a light install: say which package, before reading
            raise UserError(f"{what} {line}" if what.startswith("--") else f"import {what} {line}")
    run_import(args.format, importer(args.format), args)
    return 0
