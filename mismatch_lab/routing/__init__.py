"""MoE routing: which experts each side chose per token and layer, how often they disagree, and R3 replay.

- `compare.py`: the `Routing` record (expert ids in rank order, top-k weights, router margin) and the pure
  comparison of two of them (per-layer flip rate, `any_layer_differs`, flips by margin bucket). numpy only.
- `hf.py`: capture on a transformers Qwen3-MoE model (hooks on each `mlp.gate` and `mlp.experts`) and the
  replayed forward (the rollout's expert ids, and weights when given, forced into every MoE block).
- `vllm_side.py`: capture inside the in-process vLLM engine (hooks on each block's `gate` and its router).
- `command.py`: `mismatch-lab routing`: vLLM at a dtype against HF fp32 on the same token ids.

docs/moe.md describes the tiny MoE model, what is measured and what is not yet.
"""
