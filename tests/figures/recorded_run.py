"""The recorded run planted in the figure study (tests/figures/conftest.py). A module of its own: test
files import these names, and `conftest` is not a unique module name across test folders."""

RECORDED = "recorded-trl"
RECORDED_STEPS = 3  # one per prompt group of the copied run (12 sequences, 4 per prompt)
RECORDED_DRIFT = 0.3  # nats per step: well above the dtype noise and the planted ratios
