"""`mismatch-lab` imports only what the chosen command needs: the top-level `--help` no subcommand module,
and no command that works without torch imports torch, transformers, vLLM, matplotlib or Streamlit.

Each command runs in a fresh interpreter (`python -m mismatch_lab.cli ...`) that prints, at exit, which of
those packages it loaded; the test asserts that set. Timings are measured by
benchmarks/bench_cli_startup.py, not here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mismatch_lab.cli import SUBCOMMANDS, main

HEAVY = ("torch", "transformers", "vllm", "matplotlib", "streamlit")

# Runs the CLI as `python -m mismatch_lab.cli` does, then prints the heavy packages loaded, whatever the exit.
_PROBE = """
import atexit, json, runpy, sys
heavy = {heavy!r}
atexit.register(lambda: print("HEAVY=" + json.dumps(sorted(m for m in heavy if m in sys.modules)), file=sys.stderr))
sys.argv = ["mismatch-lab", *json.loads(sys.argv[1])]
runpy.run_module("mismatch_lab.cli", run_name="__main__")
"""


def heavy_modules_of(args: list[str], cwd: Path | None = None) -> tuple[list[str], subprocess.CompletedProcess]:
    """The heavy packages a fresh `mismatch-lab ARGS` loaded, and the finished process."""
    proc = subprocess.run([sys.executable, "-c", _PROBE.format(heavy=HEAVY), json.dumps(args)], cwd=cwd,
                          capture_output=True, text=True, timeout=300, check=False)
    line = [x for x in proc.stderr.splitlines() if x.startswith("HEAVY=")]
    assert line, proc.stderr
    return json.loads(line[-1].removeprefix("HEAVY=")), proc


LIGHT_HELP = [[], ["analyze"], ["doctor"], ["import"], ["import", "jsonl"], ["runs"], ["export"],
              ["corrections"], ["figures"], ["app"], ["model"], ["collect"]]


@pytest.mark.parametrize("command", LIGHT_HELP, ids=lambda c: " ".join(c) or "top-level")
def test_help_of_a_command_that_needs_no_torch_imports_no_heavy_package(command):
    loaded, proc = heavy_modules_of([*command, "--help"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"usage: mismatch-lab {' '.join(command)}".rstrip())
    assert loaded == []


def test_the_top_level_help_lists_every_subcommand_with_its_help_and_imports_none_of_their_modules():
    code = ("import sys; from mismatch_lab.cli import main\n"
            "try: main(['--help'])\nexcept SystemExit: pass\n"
            "print(sorted(m for m in sys.modules if m.startswith('mismatch_lab.')), file=sys.stderr)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    listed = " ".join(proc.stdout.split())  # argparse wraps long help strings
    for name, (_, help_text) in SUBCOMMANDS.items():
        assert f" {name} {help_text}" in listed
    assert proc.stderr.strip() == "['mismatch_lab.cli', 'mismatch_lab.errors']"


@pytest.mark.parametrize("command", sorted(SUBCOMMANDS))
def test_every_command_help_still_shows_its_own_options(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: mismatch-lab {command}")
    assert "options:" in out and ("--" in out.split("options:", 1)[1] or command == "import")


def test_one_parser_parses_two_command_lines_as_each_command_defines_them():
    from mismatch_lab.cli import build_parser

    parser = build_parser()
    a = parser.parse_args(["runs", "--db", "x.duckdb"])
    b = parser.parse_args(["runs", "--db", "y.duckdb", "--drop", "r1"])
    assert (a.command, a.db, b.db, b.drop) == ("runs", "x.duckdb", "y.duckdb", ["r1"])
    assert a._run is b._run and a._run.__module__ == SUBCOMMANDS["runs"][0]


def test_an_unknown_command_is_refused_with_the_list_of_commands(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["nosuch"])
    assert exit_.value.code == 2
    assert "invalid choice: 'nosuch'" in capsys.readouterr().err


@pytest.fixture(scope="module")
def small_store(tmp_path_factory):
    from mismatch_lab.store.synthetic import SyntheticSpec, synthetic_store

    db = tmp_path_factory.mktemp("startup") / "small.duckdb"
    synthetic_store(db, SyntheticSpec(n_sequences=4, max_len=6))
    return db


@pytest.mark.parametrize(("command", "printed"), [(["runs"], "vllm:bf16"), (["analyze"], "precision"),
                                                  (["export", "--out", "{tmp}/export"], "runs")])
def test_a_command_on_a_small_store_imports_no_heavy_package(small_store, tmp_path, command, printed):
    args = [c.format(tmp=tmp_path) for c in command]
    loaded, proc = heavy_modules_of([*args, "--db", str(small_store)])
    assert proc.returncode == 0, proc.stderr
    assert printed in proc.stdout
    assert loaded == []


def test_import_jsonl_of_a_tiny_file_stores_it_and_imports_no_heavy_package(tmp_path):
    rows = [{"step": 0, "token_ids": [1, 2, 3, 4, 5, 6, 7, 8, 9], "logp_rollout": [-0.1] * 9, "logp_trainer": [-0.2] * 9},
            {"step": 0, "token_ids": [1, 2, 3, 4, 5, 6, 7, 8], "logp_rollout": [-0.3] * 8, "logp_trainer": [-0.3] * 8}]
    (tmp_path / "tiny.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    loaded, proc = heavy_modules_of(["import", "jsonl", "tiny.jsonl", "--out", "store"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "17 response (loss-mask) tokens" in proc.stdout
    assert loaded == []
