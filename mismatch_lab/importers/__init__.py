"""`mismatch-lab import <format> PATH --out STORE`: other frameworks' dumps into a shard store.

    mismatch-lab import prime-rl outputs/ --out runs/prime --rollout-engine vllm --trainer-dtype bf16
    mismatch-lab import slime dump/ --out runs/slime --trust-pickle --rollout-engine sglang
    mismatch-lab import jsonl my_run.jsonl --out runs/mine

`FORMATS` maps a format name to the module that reads it (`importers.base` says what such a module
provides); adding a format is one entry here. docs/import.md describes each format and the rules every
import follows (what is stored, dedup, all or nothing).
"""

from __future__ import annotations

import importlib
from types import ModuleType

FORMATS: dict[str, str] = {
    "prime-rl": "mismatch_lab.importers.prime_rl",
    "slime": "mismatch_lab.importers.slime",
    "jsonl": "mismatch_lab.importers.jsonl",
    "nemo-rl": "mismatch_lab.importers.nemo_rl",
    "skyrl": "mismatch_lab.importers.skyrl",
    "miles": "mismatch_lab.importers.miles",
}


def importer(name: str) -> ModuleType:
    """The module of format `name` (KeyError for an unknown one)."""
    return importlib.import_module(FORMATS[name])
