"""The layers of a causal LM (transformers, or vLLM's model in its in-process engine), found from the
architecture, and forward hooks capturing their outputs.

A model maps when `model.<base_model_prefix>` holds a ModuleList of blocks under one of ATTRIBUTES["blocks"],
each block an attention and an MLP submodule under ATTRIBUTES["attn"] / ["mlp"], the base a final norm
under ATTRIBUTES["norm"], and `get_input_embeddings()` / `get_output_embeddings()` answer (Llama, Qwen2/3,
Mistral, Gemma: `model.layers[i].self_attn`, `.mlp`, `model.norm`, `lm_head`; GPT-2: `transformer.h[i].attn`,
`.mlp`, `transformer.ln_f`). Anything else is a UserError naming what was missing. vLLM's models keep the
same layout under `model.model` (`find_vllm_layers`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Self

from mismatch_lab.errors import UserError

ATTRIBUTES = {
    "blocks": ("layers", "h", "blocks"),
    "attn": ("self_attn", "attn", "self_attention", "attention"),
    "mlp": ("mlp", "feed_forward", "ffn"),
    "norm": ("norm", "final_layernorm", "ln_f", "final_norm"),
}
"""role -> the attribute names tried, in order, for that role."""
KINDS = ("embed", "attn", "mlp", "norm", "logits")


@dataclass(frozen=True)
class Layer:
    """One measured point: `name` ('embed', 'attn.3', 'mlp.3', 'norm', 'logits'), its kind (KINDS), the block
    index (None outside the blocks), the module's path in the model and the module itself."""

    name: str
    kind: str
    index: int | None
    path: str
    module: object


def _child(parent, role: str, arch: str, where: str):
    for attr in ATTRIBUTES[role]:
        found = getattr(parent, attr, None)
        if found is not None:
            return found
    raise UserError(f"{arch}: no {role} module under {where} (tried {', '.join(ATTRIBUTES[role])}); "
                    "`layers` maps Llama/Qwen/Mistral/Gemma/GPT-2-style models, pass one of those")


def _points(arch: str, base, embed, head) -> list[tuple]:
    """(name, kind, index, module) in input-to-output order; `head` None: the logits come from no hook."""
    import torch

    blocks = _child(base, "blocks", arch, "the base model")
    if not isinstance(blocks, torch.nn.ModuleList):
        raise UserError(f"{arch}: the blocks are not a ModuleList; `layers` cannot map this architecture")
    points = [("embed", "embed", None, embed)]
    for i, block in enumerate(blocks):
        points += [(f"attn.{i}", "attn", i, _child(block, "attn", arch, f"block {i}")),
                   (f"mlp.{i}", "mlp", i, _child(block, "mlp", arch, f"block {i}"))]
    return points + [("norm", "norm", None, _child(base, "norm", arch, "the base model")),
                     ("logits", "logits", None, head)]


def _layers(model, points: list[tuple]) -> list[Layer]:
    paths = {id(m): name for name, m in model.named_modules()}
    return [Layer(name, kind, index, paths.get(id(m), "compute_logits"), m) for name, kind, index, m in points]


def find_layers(model) -> list[Layer]:
    """The measured layers of a transformers `model` in input-to-output order: embed, attn.i and mlp.i per
    block, norm, logits (the output head). UserError for an architecture that does not map (module doc)."""
    arch = type(model).__name__
    base = getattr(model, getattr(model, "base_model_prefix", ""), None)
    if base is None:
        raise UserError(f"{arch}: no base model under `base_model_prefix`; pass a causal LM of transformers")
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if embed is None or head is None:
        raise UserError(f"{arch}: no input embeddings or output head; pass a causal LM with an lm_head")
    return _layers(model, _points(arch, base, embed, head))


def find_vllm_layers(model) -> list[Layer]:
    """The same layers in a vLLM model (`model.model.embed_tokens`, `.layers[i].self_attn` / `.mlp`, `.norm`);
    the logits layer has no module: vLLM's `model.compute_logits` is applied to the captured norm output
    (its runner computes logits only at the positions it samples)."""
    arch = f"vLLM {type(model).__name__}"
    base = getattr(model, "model", None)
    embed = getattr(base, "embed_tokens", None)
    if embed is None or not hasattr(model, "compute_logits"):
        raise UserError(f"{arch}: no `model.embed_tokens` or `compute_logits`; use --engine hf for this model")
    return _layers(model, _points(arch, base, embed, None))


class Capture:
    """Forward hooks on `layers` (those with a module) keeping each module's outputs of one sequence as a
    [T, D] tensor in the model's dtype: a tuple output counts by its first element (the sublayer's output
    before the residual add, the normed state of a fused add+norm), a batch dimension of one is dropped,
    and the rows of successive calls (a prefill split into chunks) are concatenated (`outputs`).
    Use as a context manager: the hooks are removed on exit."""

    def __init__(self, layers: list[Layer]):
        self.layers = layers
        self._parts: dict[str, list] = {}
        self._handles = []

    def _hook(self, name: str):
        def keep(module, inputs, output):
            out = output[0] if isinstance(output, tuple) else output
            self._parts.setdefault(name, []).append(out.detach().reshape(-1, out.shape[-1]))
        return keep

    @property
    def outputs(self) -> dict:
        import torch

        return {name: torch.cat(parts) for name, parts in self._parts.items()}

    def __enter__(self) -> Self:
        self._handles = [la.module.register_forward_hook(self._hook(la.name)) for la in self.layers
                         if la.module is not None]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
