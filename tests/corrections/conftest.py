"""The rule tests reuse the random batches of the loss tests (tests/rl)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rl"))
