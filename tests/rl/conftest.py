"""The loss tests share the naive references of the corrections registry (tests/corrections)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "corrections"))
