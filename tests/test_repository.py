"""The repository stands on its own and keeps its style: ruff is clean, and no file points to material
outside the repository (a user's clone has only what is in it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUTSIDE = ("../" + "shared", "DESIGN" + ".md", "ENVIRONMENT" + ".md", "PAPERS" + ".md")  # split: not a hit here


def test_ruff_finds_nothing():
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", str(REPO)], capture_output=True, text=True,
                          check=False, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-1000:]


def test_no_file_points_outside_the_repository():
    files = subprocess.run(["git", "ls-files"], capture_output=True, text=True, check=True, cwd=REPO).stdout.split()
    hits = []
    for name in files:
        path = REPO / name
        if path.suffix not in (".py", ".md", ".toml", ".sh", ".txt", ".cfg", ".ini", ".yaml", ".yml") and name != ".ci/run":
            continue
        text = path.read_text(errors="replace") if path.is_file() else ""
        hits += [f"{name}: {word}" for word in OUTSIDE if word in text]
    assert not hits, hits
