"""Write tests/durations.txt (seconds per test file, slowest first) from a JUnit XML report of a test run.

    .venv/bin/python -m pytest --junitxml=/tmp/junit.xml     # README command (2) also takes PYTEST_ADDOPTS
    .venv/bin/python scripts/test_durations.py /tmp/junit.xml

tests/conftest.py hands the slowest files out first (`--dist loadfile`), so that the two workers finish
together. A file's figure is the sum of its tests' times (setup, call and teardown) in that run. The script
also prints the two-worker finish times that order gives (each file to the worker free first): a check of
the balance, not a measurement.
"""

from __future__ import annotations

import argparse
import heapq
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "tests" / "durations.txt"


def test_file(classname: str) -> str | None:
    """`tests.collect.test_x[.Class]` -> `tests/collect/test_x.py`, or None when no such file exists."""
    parts = classname.split(".")
    for n in range(len(parts), 0, -1):
        path = "/".join(parts[:n]) + ".py"
        if (REPO / path).exists():
            return path
    return None


def file_seconds(junit: Path) -> dict[str, float]:
    seconds: dict[str, float] = defaultdict(float)
    for case in ET.parse(junit).getroot().iter("testcase"):
        path = test_file(case.get("classname", ""))
        if path is not None:
            seconds[path] += float(case.get("time", 0.0))
    return dict(seconds)


def finish_times(durations: list[float], workers: int = 2) -> list[float]:
    """Greedy list schedule: each duration, in order, goes to the worker that is free first."""
    free = [(0.0, w) for w in range(workers)]
    ends = [0.0] * workers
    for d in durations:
        t, w = heapq.heappop(free)
        ends[w] = t + d
        heapq.heappush(free, (ends[w], w))
    return ends


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("junit", type=Path, help="the JUnit XML of a whole test run (pytest --junitxml)")
    args = parser.parse_args(argv)
    seconds = file_seconds(args.junit)
    if not seconds:
        print(f"error: no test case of this repository in {args.junit}; pass the report of a run of tests/",
              file=sys.stderr)
        return 2
    ranked = sorted(seconds.items(), key=lambda kv: (-kv[1], kv[0]))
    lines = [f"# seconds per test file, slowest first: scripts/test_durations.py {args.junit.name}"]
    lines += [f"{s:.1f} {path}" for path, s in ranked]
    OUT.write_text("\n".join(lines) + "\n")
    ends = finish_times([s for _, s in ranked])
    print(f"{len(ranked)} files, {sum(seconds.values()):.0f} s in all; two workers, slowest first, finish at "
          + ", ".join(f"{e:.0f} s" for e in ends) + f" -> {OUT.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
