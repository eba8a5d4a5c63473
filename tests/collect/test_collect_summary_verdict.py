"""The end of `collect`: the pair table with units, the doctor's verdict per pair, and `next:` commands that run
exactly as printed. A real collect (HF engine, the tiny model) into a study folder, as README command (1) does."""

from __future__ import annotations

import json
import os
import shlex
import stat

import pytest

from mismatch_lab.cli import build_parser, main


def _study(root, model: str) -> str:
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"What is {i} + {i}?", "answer": str(2 * i)}) + "\n"
                               for i in range(3)))
    study = root / "studies" / "tiny" / "study.toml"
    study.parent.mkdir(parents=True)
    study.write_text(f'[collect]\nmodel = "{model}"\nprompts = "{prompts}"\nsamples = 2\nmax_tokens = 6\n'
                     'engine = "hf"\nrollout_dtypes = ["fp32", "bf16"]\nscorer_dtypes = ["fp32"]\ntop_k = 3\n'
                     "max_model_len = 128\nchunk_prompts = 2\nseed = 0\n")
    return "studies/tiny/study.toml"  # relative, as README command (1) passes it


@pytest.fixture(scope="module")
def collected(tmp_path_factory, tiny_model):
    """(the folder collect ran in, everything it printed) for one real collect run."""
    import contextlib
    import io

    root = tmp_path_factory.mktemp("readme")
    cwd = os.getcwd()
    os.chdir(root)
    try:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(["collect", "--study", _study(root, tiny_model), "--no-progress"]) == 0
    finally:
        os.chdir(cwd)
    return root, out.getvalue()


def _summary(out: str) -> list[str]:
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("study tiny: "))
    return lines[start:]


def _next_commands(summary: list[str]) -> list[list[str]]:
    start = summary.index("next:")
    return [shlex.split(line, comments=True) for line in summary[start + 1:] if line.strip()]


def test_the_summary_fits_one_screen_with_units_and_percent(collected):
    _, out = collected
    summary = _summary(out)
    assert len(summary) <= 40 and max(map(len, summary)) <= 120
    (head,) = [i for i, line in enumerate(summary) if line.startswith("rollout ")]
    assert "r∉[0.8,1.28]" in summary[head] and "% tokens" in summary[head + 1] and "nats" in summary[head + 1]
    assert summary[0].endswith("-> studies/tiny/tiny.duckdb")


def test_the_summary_ends_with_the_doctors_own_verdict_lines(collected, monkeypatch):
    from mismatch_lab.doctor.report import (
        VERDICT_KEY,
        advice_lines,
        diagnose,
        verdict_lines,
    )
    from mismatch_lab.store.reader import open_store

    root, out = collected
    con = open_store(root / "studies" / "tiny" / "tiny.duckdb")
    dx = diagnose(con)
    con.close()
    expected = verdict_lines(dx)
    assert {line.split()[0] for line in expected} == {"hf:bf16/hf:fp32", "hf:fp32/hf:fp32"}
    summary = _summary(out)
    at = summary.index(f"  {VERDICT_KEY}")
    assert summary[at + 1: at + 1 + len(expected)] == [f"  {v}" for v in expected]
    advice = advice_lines(dx, 120, limit=3, because=False)
    assert advice and summary[at + 2 + len(expected): at + 2 + len(expected) + len(advice)] == advice


def test_every_next_command_runs_as_printed_from_the_folder_collect_ran_in(collected, monkeypatch, capsys):
    from mismatch_lab import app_command

    root, out = collected
    commands = _next_commands(_summary(out))
    assert [c[:2] for c in commands] == [["mismatch-lab", "doctor"], ["mismatch-lab", "analyze"], ["mismatch-lab", "app"]]
    monkeypatch.chdir(root)
    capsys.readouterr()
    for words in commands[:2]:
        assert main(words[1:]) == 0, words
        printed = capsys.readouterr().out
        assert "hf:bf16/hf:fp32" in printed or "hf:bf16  hf:fp32" in printed, words
    args = build_parser().parse_args(commands[2][1:])
    streamlit = app_command.build_command(args.study, args.port, args.headless)  # resolved, not started
    assert streamlit[-2:] == ["--study", str((root / "studies" / "tiny" / "tiny.duckdb").resolve())]


def test_commands_are_printed_as_the_shell_finds_the_program_again(tmp_path, monkeypatch):
    from mismatch_lab.collect.summary import next_lines

    exe = tmp_path / ".venv" / "bin" / "mismatch-lab"
    exe.parent.mkdir(parents=True)
    exe.write_text("#!/bin/sh\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", [".venv/bin/mismatch-lab", "collect"])
    monkeypatch.setenv("PATH", str(tmp_path / "elsewhere"))
    lines = next_lines("my runs/a b.duckdb")
    assert shlex.split(lines[1], comments=True) == [".venv/bin/mismatch-lab", "doctor", "--db", "my runs/a b.duckdb"]
    monkeypatch.setenv("PATH", str(exe.parent))  # the same program on PATH: its plain name
    assert shlex.split(next_lines("x.duckdb")[2], comments=True) == ["mismatch-lab", "analyze", "--db", "x.duckdb"]
