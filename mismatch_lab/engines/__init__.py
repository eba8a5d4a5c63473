"""Rollout engines behind one Protocol (`base.RolloutEngine`): `vllm` and `hf`.

Heavy imports (vllm, torch, transformers) happen inside the engine modules' functions, so importing
this package is cheap.
"""

from mismatch_lab.engines.base import GenRequest, RolloutEngine, Sample, make_engine

__all__ = ["GenRequest", "RolloutEngine", "Sample", "make_engine"]
