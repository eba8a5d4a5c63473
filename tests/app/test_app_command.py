"""`mismatch-lab app`: the command line it builds, and the mistakes it refuses."""

from __future__ import annotations

import argparse
import sys

import pytest

from mismatch_lab import app_command
from mismatch_lab.errors import UserError


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    app_command.add_arguments(parser)
    return parser.parse_args(argv)


def test_the_command_runs_the_entry_file_with_the_study_passed_through(study_dir):
    cmd = app_command.build_command(study_dir, 8600, True)
    assert cmd[:5] == [sys.executable, "-m", "streamlit", "run", str(app_command.APP)]
    assert cmd[cmd.index("--server.port") + 1] == "8600"
    assert cmd[cmd.index("--server.headless") + 1] == "true"
    assert cmd[-3:] == ["--", "--study", str(study_dir.resolve())]
    assert app_command.APP.name == "streamlit_app.py" and app_command.APP.is_file()


def test_without_a_study_the_app_offers_every_study_of_the_checkout():
    cmd = app_command.build_command(None, app_command.DEFAULT_PORT, False)
    assert "--study" not in cmd and "--" not in cmd


@pytest.mark.parametrize(
    "kind, message",
    [
        ("absent", "no study at"),
        ("empty folder", "holds no results.*or shard store: pass a study folder, a store, or the --out folder of"),
        ("study without data", r"collect into it first \(`mismatch-lab collect --study .*/study.toml`\)"),
        ("text file", "not a .duckdb store"),
    ],
)
def test_a_path_that_is_not_a_store_is_a_user_error(tmp_path, kind, message):
    path = {"absent": tmp_path / "absent", "empty folder": tmp_path, "text file": tmp_path / "notes.txt",
            "study without data": tmp_path}[kind]
    if kind == "text file":
        path.write_text("not a store")
    if kind == "study without data":
        (path / "study.toml").write_text("[collect]\n")
    with pytest.raises(UserError, match=message):
        app_command.build_command(path, 8501, True)


@pytest.mark.parametrize("port", [0, 70000])
def test_a_port_out_of_range_is_a_user_error(port):
    with pytest.raises(UserError, match="not a TCP port"):
        app_command.build_command(None, port, True)


def test_run_hands_the_process_to_streamlit_with_the_study_as_argument_and_environment(monkeypatch, duckdb_store):
    class Exec(Exception):
        pass

    def fake_execve(path, cmd, env):
        raise Exec(path, cmd, env)

    monkeypatch.setattr(app_command.os, "execve", fake_execve)
    with pytest.raises(Exec) as exc:
        app_command.run(parse(["--study", str(duckdb_store), "--port", "8601", "--headless"]))
    path, cmd, env = exc.value.args
    assert path == sys.executable and cmd[0] == sys.executable
    assert env[app_command.ENV_VAR] == str(duckdb_store.resolve())
    assert cmd[-1] == str(duckdb_store.resolve())
    assert cmd[cmd.index("--server.port") + 1] == "8601"
