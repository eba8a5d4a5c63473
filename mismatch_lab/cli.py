"""The `mismatch-lab` command.

    mismatch-lab collect --study studies/default/study.toml
    mismatch-lab analyze --db studies/default/default.duckdb --json out.json
    mismatch-lab train --study studies/dppo-sanity/study.toml --loss dppo_binary_tv
    mismatch-lab figures studies/precision-sweep    |  mismatch-lab figures --all
    mismatch-lab app --study studies/precision-sweep
    mismatch-lab model prepare
    mismatch-lab export --db X.duckdb --out studies/x/results
    mismatch-lab runs --db X.duckdb [--drop RUN_ID]
    mismatch-lab corrections --db studies/precision-sweep/results --json corrections.json

Each subcommand lives in its own module exposing `add_arguments(parser)` and `run(args) -> int`. The
top-level parser is built from SUBCOMMANDS' help strings alone; a module is imported (and its arguments
added) only when its subcommand is chosen, `COMMAND --help` included. So `mismatch-lab --help` imports no
subcommand module, and the commands that need no torch (analyze, doctor, runs, import, export) and every
`--help` but train's import neither torch, transformers nor vLLM (tests/test_cli_startup.py;
benchmarks/bench_cli_startup.py times them).
User mistakes raise `UserError`, printed as one line with exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
import threading
from pathlib import Path

from mismatch_lab.errors import UserError

# subcommand -> (module, one-line help)
SUBCOMMANDS = {
    "collect": ("mismatch_lab.collect", "run a checkpoint through the rollout engine and the trainer scorer into DuckDB"),
    "analyze": ("mismatch_lab.analysis.command", "print the analyses of a store and write them as JSON"),
    "train": ("mismatch_lab.rl.command", "reference DPPO / GRPO / CISPO / PG-IS training run logging mismatch metrics"),
    "figures": ("mismatch_lab.figures.command", "regenerate the paper-style figures of stored studies"),
    "app": ("mismatch_lab.app_command", "start the Streamlit app"),
    "model": ("mismatch_lab.models", "prepare the embedded default model (SmolLM2-135M-Instruct)"),
    "export": ("mismatch_lab.store.parquet", "export a DuckDB store to compact Parquet (zstd)"),
    "runs": ("mismatch_lab.store.runs_command", "list the runs of a DuckDB store, or drop one with all its rows"),
    "import": ("mismatch_lab.importers.command", "import prime-rl / slime / JSON-lines dumps into a run store"),
    "corrections": ("mismatch_lab.corrections.command",
                    "every correction method (verl, TRL, slime, prime-rl, DPPO, ...) on the same tokens of a store"),
    "doctor": ("mismatch_lab.doctor.command", "verdicts on each rollout/trainer pair against published bands; a CI gate"),
    "layers": ("mismatch_lab.layers.command", "per-layer relative error of a bf16/fp16 model against fp32 on the same tokens"),
    "routing": ("mismatch_lab.routing.command", "MoE expert routing of vLLM at a dtype vs HF fp32 on the same tokens; R3 replay"),
}


def json_output(value: str | None, example: str = "out.json") -> Path | None:
    """The file a command's `--json` writes (None without it), checked before any work is done: its folder
    must exist and the path must not itself be a folder."""
    if not value:
        return None
    path = Path(value)
    if not path.parent.is_dir():
        raise UserError(f"the folder of --json {path} does not exist; create it or pass another path")
    if path.is_dir():
        raise UserError(f"--json {path} is a folder; pass a file path, e.g. {path / example}")
    return path


class _LazySubcommands(argparse._SubParsersAction):
    """The subcommands, each parser left empty until its command is chosen: then its module is imported
    and its `add_arguments` called, so `mismatch-lab --help` and `mismatch-lab runs ...` import only what
    the chosen command imports (tests/test_cli_startup.py)."""

    def __call__(self, parser, namespace, values, option_string=None):
        chosen = self._name_parser_map.get(values[0])
        if chosen is not None and not chosen.get_default("_run"):
            from mismatch_lab.extras import missing_line

            if line := missing_line(values[0]):  # a light install: say which extra, before any import fails
                parser.exit(2, f"mismatch-lab {values[0]}: error: {line}\n")
            module = importlib.import_module(SUBCOMMANDS[values[0]][0])
            module.add_arguments(chosen)
            chosen.set_defaults(_run=module.run)
        super().__call__(parser, namespace, values, option_string)


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser, built from SUBCOMMANDS' help strings alone (no subcommand module imported)."""
    parser = argparse.ArgumentParser(prog="mismatch-lab", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", action=_LazySubcommands)
    for name, (_, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, description=help_text)
    return parser


class Terminated(KeyboardInterrupt):
    """SIGTERM (`timeout`, `scancel`, `docker stop`, `kill`), handled as Ctrl-C is: work in flight is undone."""


_TERMINATED: list[bool] = []  # set once SIGTERM arrived: DuckDB turns the exception into 'Query interrupted'


def _terminate(signum, frame) -> None:
    _TERMINATED.append(True)
    raise Terminated


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _TERMINATED.clear()
    in_main = threading.current_thread() is threading.main_thread()
    if in_main and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:  # a host's own handler stays
        signal.signal(signal.SIGTERM, _terminate)
    try:
        return int(args._run(args) or 0)
    except UserError as exc:
        print(f"mismatch-lab {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, Exception) as exc:
        terminated = isinstance(exc, Terminated) or bool(_TERMINATED)  # (an interrupted DuckDB query re-raises)
        if not terminated and not isinstance(exc, KeyboardInterrupt):
            from mismatch_lab.errors import storage_error_line

            line = storage_error_line(exc, args)  # a full disk, a read-only folder, a denied permission
            if line is None:
                raise
            print(f"mismatch-lab {args.command}: error: {line}", file=sys.stderr)
            return 2
        what = "terminated (SIGTERM)" if terminated else "interrupted"
        print(f"\nmismatch-lab {args.command}: {what}; committed work is kept, re-run the same command to resume",
              file=sys.stderr)
        return 143 if terminated else 130
    finally:
        if in_main and signal.getsignal(signal.SIGTERM) is _terminate:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


if __name__ == "__main__":
    sys.exit(main())
