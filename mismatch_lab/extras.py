"""What each `mismatch-lab` command needs beyond the light install (`pip install mismatch-lab`: numpy, pyarrow,
duckdb, pandas), and the one line that says what to install when it is missing.

The light install runs `analyze`, `doctor` (its store checks), `runs`, `import`, `export` and the `Recorder`.
The other commands are checked before their module is imported (cli.py), so a missing package is a one-line
error naming the extra, exit status 2, never a traceback. torch is named on its own: no extra lists it, as pip
would otherwise pull a multi-GB CUDA build onto a CPU machine (pyproject.toml).
"""

from __future__ import annotations

import importlib.util

TORCH_HINT = "install torch, the build for your machine (https://pytorch.org/get-started/locally/)"
"""How to install torch, named instead of an extra."""

NEEDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "collect": ("collect", ("torch", "transformers", "safetensors")),
    "train": ("train", ("torch", "transformers", "safetensors")),
    "model": ("collect", ("torch", "transformers", "safetensors", "gguf", "accelerate")),
    "layers": ("collect", ("torch", "transformers", "safetensors")),
    "routing": ("collect", ("torch", "transformers", "safetensors", "vllm")),
    "corrections": ("", ("torch",)),
    "figures": ("figures", ("matplotlib",)),
    "app": ("app", ("streamlit", "matplotlib")),
}
"""command -> (the extra that installs its packages, '' for torch alone; the modules it imports)."""


IMPORT_NEEDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "slime": ("", ("torch",)),  # torch.load of the dumps
    "miles": ("", ("torch",)),
    "skyrl": ("", ("torch",)),  # its pickles hold torch tensors
    "--tokenizer": ("collect", ("transformers",)),
}
"""`import` format (or option) -> (extra, modules): the formats read with torch; --tokenizer loads a transformers
tokenizer. jsonl, prime-rl and nemo-rl need nothing beyond the light install."""


def missing(modules: tuple[str, ...]) -> list[str]:
    """The modules of `modules` this environment cannot import (looked up, not imported)."""
    return [m for m in modules if importlib.util.find_spec(m) is None]


def missing_line(command: str, needs: dict[str, tuple[str, tuple[str, ...]]] = NEEDS) -> str | None:
    """None when `command` (a key of `needs`) has what it needs; else one line naming what is missing and what
    to install."""
    extra, modules = needs.get(command, ("", ()))
    absent = missing(modules)
    if not absent:
        return None
    installs = [f"pip install 'mismatch-lab[{extra}]'"] if set(absent) - {"torch"} else []
    installs += [TORCH_HINT] if "torch" in absent else []
    return f"needs {', '.join(absent)}, which this install lacks: {'; '.join(installs)}"
