"""Framework presets: each module of this package reproduces one framework's policy-loss code and lists its
presets in a module-level `PRESETS` tuple (base.Preset). The registry below imports them on first use
(they need torch)."""

from __future__ import annotations

import importlib

from mismatch_lab.corrections.frameworks.base import FRAMEWORKS, Preset, Result, Tokens

MODULES = ("verl", "trl", "slime", "prime_rl", "nemo_rl", "skyrl", "areal", "roll")
"""Modules of this package holding presets, one per framework."""

_PRESETS: dict[str, Preset] = {}


def presets() -> dict[str, Preset]:
    """Every preset by name, in MODULES order (imported once)."""
    if not _PRESETS:
        for module in MODULES:
            try:
                mod = importlib.import_module(f"{__name__}.{module}")
            except ModuleNotFoundError as exc:
                if exc.name != f"{__name__}.{module}":
                    raise
                continue  # a framework whose module is not written yet
            for preset in mod.PRESETS:
                if preset.name in _PRESETS:
                    raise AssertionError(f"preset {preset.name} declared twice")
                _PRESETS[preset.name] = preset
    return _PRESETS


def get(name: str) -> Preset:
    """The preset `name`; ValueError naming the known ones."""
    table = presets()
    if name not in table:
        raise ValueError(f"unknown preset {name!r}; `mismatch-lab corrections --list-presets` lists them "
                         f"({', '.join(table)})")
    return table[name]


def of_framework(framework: str) -> list[Preset]:
    """A framework's presets, its default first; ValueError for a framework we do not know."""
    if framework not in FRAMEWORKS:
        raise ValueError(f"unknown framework {framework!r}; choose one of {', '.join(FRAMEWORKS)}")
    found = [p for p in presets().values() if p.framework == framework]
    return sorted(found, key=lambda p: not p.default)


__all__ = ["FRAMEWORKS", "MODULES", "Preset", "Result", "Tokens", "get", "of_framework", "presets"]
