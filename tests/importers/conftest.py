"""Fixtures of the importer tests (helpers: import_fixtures.py)."""

from __future__ import annotations

import pytest

from mismatch_lab.cli import main


@pytest.fixture
def cli(capsys):
    """Run `mismatch-lab ARGS` in this process: (exit code, stdout, stderr)."""

    def run(*args) -> tuple[int, str, str]:
        code = main([str(a) for a in args])
        out = capsys.readouterr()
        return code, out.out, out.err

    return run
