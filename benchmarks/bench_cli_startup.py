"""Start-up time of `mismatch-lab`: each command line in a fresh interpreter, wall and CPU seconds.

    .venv/bin/python benchmarks/bench_cli_startup.py                       # this working tree, 5 rounds
    .venv/bin/python benchmarks/bench_cli_startup.py --baseline e20a28a    # also a commit, same rounds

Command lines: `--help`, `COMMAND --help` of the light commands, `runs --db` on a small DuckDB store and
`import jsonl` of a 17-token file (the store and file are built in a temporary folder). Each round runs
every line once, in turn (baseline and tree alternate, so both see the same load); the table shows
the median and the best. `--baseline REV` extracts REV with `git archive` and puts it first on
PYTHONPATH. Prints the CPU model, the core count and the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LINES = [
    "--help",
    "analyze --help",
    "doctor --help",
    "import --help",
    "runs --help",
    "export --help",
    "corrections --help",
    "train --help",
    "runs --db {db}",
    "import jsonl {jsonl} --out {out}",
]


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def fixtures(tmp: Path) -> dict[str, str]:
    """A small DuckDB store and a 17-token JSON-lines file."""
    from mismatch_lab.store.synthetic import SyntheticSpec, synthetic_store

    db = tmp / "small.duckdb"
    synthetic_store(db, SyntheticSpec(n_sequences=4, max_len=6))
    rows = [{"step": 0, "token_ids": list(range(1, 10)), "logp_rollout": [-0.1] * 9, "logp_trainer": [-0.2] * 9},
            {"step": 0, "token_ids": list(range(1, 9)), "logp_rollout": [-0.3] * 8, "logp_trainer": [-0.3] * 8}]
    jsonl = tmp / "tiny.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"db": str(db), "jsonl": str(jsonl), "out": str(tmp / "store")}


def timed(line: str, env: dict, tmp: Path) -> tuple[float, float]:
    """(wall, CPU) seconds of one `python -m mismatch_lab.cli LINE` in a fresh process."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "mismatch_lab.cli", *line.split()], cwd=tmp, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"`mismatch-lab {line}` failed: {proc.stderr.read().decode()[-2000:]}")
    proc.stderr.close()
    return wall, usage.ru_utime + usage.ru_stime


def baseline_tree(rev: str, tmp: Path) -> Path:
    """REV's files, extracted from git into tmp/baseline."""
    root = tmp / "baseline"
    root.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
    return root


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--baseline", metavar="REV", help="also time this git revision (e.g. the commit before)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        values = fixtures(tmp)
        trees = {"tree": REPO}
        if args.baseline:
            trees = {args.baseline: baseline_tree(args.baseline, tmp), "tree": REPO}
        envs = {label: {**os.environ, "PYTHONPATH": str(root)} for label, root in trees.items()}
        load0 = os.getloadavg()
        results: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for _ in range(args.rounds):
            for line in LINES:
                for label, env in envs.items():
                    out = Path(values["out"])
                    if out.exists():
                        subprocess.run(["rm", "-rf", str(out)], check=True)
                    results.setdefault((label, line), []).append(timed(line.format(**values), env, tmp))
        load1 = os.getloadavg()
    print(f"CPU: {cpu_model()}, {os.cpu_count()} cores; Python {platform.python_version()}; "
          f"load average {load0[0]:.2f} before, {load1[0]:.2f} after; {args.rounds} rounds; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"{'mismatch-lab ...':36s} {'tree':>10s} {'wall med':>9s} {'wall min':>9s} {'CPU med':>8s}")
    for (label, line), runs in results.items():
        walls, cpus = [w for w, _ in runs], [c for _, c in runs]
        print(f"{line.replace(' {db}', ' DB').replace(' {jsonl} --out {out}', ' FILE --out S'):36s} {label:>10s} "
              f"{statistics.median(walls):9.2f} {min(walls):9.2f} {statistics.median(cpus):8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
