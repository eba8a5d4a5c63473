"""verl 0.9.1's own modules, from the wheel `scripts/setup.sh` installs with --no-deps into .venv/verl-0.9.1 (kept
out of site-packages: its pins clash with ours). `verl/protocol.py` imports ray at module level, which the loss code
never calls: a stub stands in for it while verl is imported, and is removed afterwards."""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path

import pytest

VERL_DIR = Path(__file__).resolve().parents[1] / ".venv" / "verl-0.9.1"


def import_verl(*modules: str) -> list[types.ModuleType]:
    """The named verl modules (e.g. 'verl.trainer.ppo.core_algos'); a failed test naming the set-up when the
    wheel is missing (never a skip: CI must run these)."""
    if not (VERL_DIR / "verl").is_dir():
        pytest.fail(f"{VERL_DIR} is missing: run `bash scripts/setup.sh` (it installs verl 0.9.1 there)")
    stub = types.ModuleType("ray")
    stub.ObjectRef = type("ObjectRef", (), {})
    had_ray = sys.modules.get("ray")
    sys.modules["ray"] = stub
    sys.path.insert(0, str(VERL_DIR))
    try:
        return [importlib.import_module(m) for m in modules]
    finally:
        sys.path.remove(str(VERL_DIR))
        if had_ray is None:
            del sys.modules["ray"]
        else:
            sys.modules["ray"] = had_ray
