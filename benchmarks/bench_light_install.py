"""Benchmark: the light install from nothing, then a NeMo-RL run imported and analysed in it.

    .venv/bin/python benchmarks/bench_light_install.py                  # 1 M response tokens, uv's cache as it is
    .venv/bin/python benchmarks/bench_light_install.py --cold           # an empty uv cache: every wheel from PyPI
    .venv/bin/python benchmarks/bench_light_install.py --tokens 10000000

In a temporary folder: a copy of the package source (pyproject.toml + mismatch_lab/, so that building it leaves
nothing in the checkout), `uv venv`, `uv pip install SRC` without extras (what `pip install mismatch-lab` installs:
numpy, pyarrow, duckdb, pandas), then, with that venv's `mismatch-lab`, `import nemo-rl` of a synthetic NeMo-RL log
dir (written beforehand, untimed, by benchmarks/bench_import_frameworks.py's writer, the way NeMo-RL's logger writes
it) and `analyze --json`. Prints the seconds of each phase, their sum against the 2-minute goal, and the CPU model.
uv is the one scripts/setup.sh installs beside this interpreter.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_import_frameworks import cpu_model, write_nemo

GOAL_S = 120.0
UV = Path(sys.executable).parent / "uv"


def timed(cmd: list[str], env: dict | None = None) -> float:
    start = time.perf_counter()
    done = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr}")
    return time.perf_counter() - start


def phases(tmp: Path, dump: Path, cold: bool) -> dict[str, float]:
    src, venv = tmp / "src", tmp / "venv"
    src.mkdir()
    shutil.copy(ROOT / "pyproject.toml", src)
    shutil.copytree(ROOT / "mismatch_lab", src / "mismatch_lab", ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, **({"UV_CACHE_DIR": str(tmp / "uv-cache")} if cold else {})}
    cli = str(venv / "bin" / "mismatch-lab")
    return {
        "uv venv": timed([str(UV), "venv", "-q", "--python", sys.executable, str(venv)], env),
        "uv pip install (no extras)": timed([str(UV), "pip", "install", "-q", "--python", str(venv / "bin" / "python"),
                                             str(src)], env),
        "mismatch-lab import nemo-rl": timed([cli, "import", "nemo-rl", str(dump), "--out", str(tmp / "store")]),
        "mismatch-lab analyze --json": timed([cli, "analyze", "--db", str(tmp / "store"), "--json",
                                              str(tmp / "analyze.json")]),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=1_000_000, help="response tokens of the NeMo-RL dump")
    ap.add_argument("--cold", action="store_true", help="an empty uv cache: every wheel downloaded from PyPI")
    args = ap.parse_args()
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-light-") as t:
        tmp = Path(t)
        tokens, lines, size = write_nemo(tmp / "logs", args.tokens)
        print(f"NeMo-RL log dir: {tokens:,} response tokens, {lines:,} lines, {size / 2**20:.0f} MiB (untimed)")
        times = phases(tmp, tmp / "logs", args.cold)
        freeze = subprocess.run([str(UV), "pip", "freeze", "--python", str(tmp / "venv" / "bin" / "python")],
                                check=True, capture_output=True, text=True).stdout.split()
    for name, s in times.items():
        print(f"{name:30s} {s:7.2f} s")
    total = sum(times.values())
    print(f"{'total':30s} {total:7.2f} s  (goal < {GOAL_S:.0f} s: {'met' if total < GOAL_S else 'NOT met'})")
    print(f"installed: {' '.join(freeze)}")
    print(f"uv cache: {'empty (--cold)' if args.cold else 'as it is'}; CPU: {cpu_model()}, {os.cpu_count()} cores; "
          f"load average before {load:.1f}, after "
          f"{os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
