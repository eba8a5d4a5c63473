"""The memory plan: what `collect` will hold on its device, computed from the HF config before anything loads.

Sizes come from the config alone (vocabulary, hidden size, layers, heads, KV heads, MLP width): parameter
bytes of each engine and scorer dtype, the engine's KV cache, activations of one scorer micro-batch. The
plan is checked against the device's memory (GPU: total memory; CPU: available RAM) and a plan that
cannot fit is refused with the flag that fixes it. The estimates are upper bounds of the main terms, not a
profile: the allocator, CUDA context and kernels' workspaces sit in `OVERHEAD` and `HEADROOM`.

Per GPU, the collector holds the rollout engine (vLLM: the share `--gpu-memory-utilization` of the GPU,
which covers its weights / tensor-parallel size, its activations and its KV cache) beside the HF scorer:
every scorer dtype resident when they fit, else each dtype's decoder in turn (models in host memory,
the lm_heads on the GPU), else (a model larger than one GPU) spread with `device_map="auto"`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mismatch_lab.errors import UserError

BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
GiB = 1 << 30
OVERHEAD = 1 * GiB  # CUDA context, allocator slack, library workspaces (per GPU)
HEADROOM = 0.05  # share of a device's memory left free
ENGINE_BATCH_TOKENS = 8192  # tokens per vLLM forward step assumed for its activation profile
CPU_KV_BYTES = 1 << 30  # vLLM CPU backend: KV cache given explicitly (kv_cache_memory_bytes)


@dataclass(frozen=True)
class Shapes:
    """The sizes of a decoder-only transformer that the plan needs, read from its HF config. An MoE decoder
    (Qwen2/Qwen3-MoE and Mixtral-style configs: `num_experts` / `num_local_experts`, `moe_intermediate_size`,
    `num_experts_per_tok`, `decoder_sparse_step`, `mlp_only_layers`) has `experts` > 0: its MoE layers hold
    every expert's gate/up/down, the router and any shared expert; its other layers the dense MLP."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tied: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # RMSNorm on each head's q and k (Qwen3, Qwen3-MoE)
    experts: int = 0  # routed experts per MoE layer (0: a dense decoder)
    expert_intermediate: int = 0
    experts_per_token: int = 0
    shared_intermediate: int = 0  # a shared expert's width (Qwen2-MoE), 0 without
    moe_layers: int = 0

    @classmethod
    def from_config(cls, config: dict) -> Shapes:
        c = config.get("text_config") or config
        if c.get("n_routed_experts"):  # DeepSeek-style MoE: other layer and expert layouts
            raise UserError("the memory plan knows dense and Qwen/Mixtral-style MoE decoders, not this config's "
                            "experts (n_routed_experts); pass --memory-plan off to run without it")
        try:
            heads = int(c["num_attention_heads"])
            hidden = int(c["hidden_size"])
            bias = bool(c.get("attention_bias", c.get("model_type") in ("qwen2", "qwen2_moe")))
            return cls(vocab=int(c["vocab_size"]), hidden=hidden, layers=int(c["num_hidden_layers"]), heads=heads,
                       kv_heads=int(c.get("num_key_value_heads") or heads),
                       head_dim=int(c.get("head_dim") or hidden // heads), intermediate=int(c["intermediate_size"]),
                       tied=bool(c.get("tie_word_embeddings", False)), qkv_bias=bias,
                       o_bias=bool(c.get("attention_bias", False)), mlp_bias=bool(c.get("mlp_bias", False)),
                       qk_norm=c.get("model_type") in ("qwen3", "qwen3_moe"), **_moe_shapes(c))
        except (KeyError, TypeError, ValueError) as exc:
            raise UserError(f"the model config lacks {exc} for the memory plan; pass --memory-plan off") from exc

    def layer_params(self) -> int:
        """Parameters of a dense layer (an MoE layer's MLP: `moe_mlp_params`)."""
        d, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        attn = d * q + 2 * d * kv + q * d + (q + 2 * kv if self.qkv_bias else 0) + (d if self.o_bias else 0)
        return attn + self.dense_mlp_params() + 2 * d + (2 * self.head_dim if self.qk_norm else 0)  # RMSNorm weights

    def dense_mlp_params(self) -> int:
        """A dense layer's MLP: gate, up, down (and their biases)."""
        d, i = self.hidden, self.intermediate
        return 3 * d * i + (2 * i + d if self.mlp_bias else 0)

    def moe_mlp_params(self) -> int:
        """An MoE layer's MLP: every expert's gate/up/down, the router, a shared expert and its gate."""
        d = self.hidden
        shared = 3 * d * self.shared_intermediate + d if self.shared_intermediate else 0
        return self.experts * 3 * d * self.expert_intermediate + d * self.experts + shared

    def all_layer_params(self) -> int:
        """Every layer: `layer_params` each, an MoE layer's MLP in place of the dense one."""
        return self.layers * self.layer_params() + self.moe_layers * (self.moe_mlp_params() - self.dense_mlp_params())

    def head_params(self) -> int:
        return self.vocab * self.hidden

    def params(self) -> int:
        """Every parameter: embedding, layers, final norm, and the lm_head unless tied to the embedding."""
        return self.head_params() * (1 if self.tied else 2) + self.all_layer_params() + self.hidden

    def kv_bytes_per_token(self, dtype: str) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * BYTES[dtype]

    def forward_activation_bytes(self, tokens: int, width: int, dtype: str) -> int:
        """Peak live activations of a no-grad forward over `tokens` padded tokens of sequences `width` long:
        the residual stream and its norm, q/k/v/attention output, the MLP's gate/up/product, and the
        attention scores of a non-fused kernel (tokens x heads x width)."""
        moe = 3 * (self.expert_intermediate * self.experts_per_token + self.shared_intermediate) + self.experts
        mlp = max(3 * self.intermediate if self.moe_layers < self.layers else 0, moe if self.experts else 0)
        per_token = 2 * self.hidden + 2 * (self.heads + self.kv_heads) * self.head_dim + mlp
        return tokens * (per_token + self.heads * width) * BYTES[dtype]

    def vocab_chunk_bytes(self, rows: int, dtype: str) -> int:
        """One chunk of the vocabulary projection: logits in the dtype, fp32 log-softmax, its exp, the reference
        chunk's log-softmax and exp, and one temporary (`logsoftmax.chunked_row_stats`)."""
        return rows * self.vocab * (BYTES[dtype] + 5 * 4)


def _moe_shapes(c: dict) -> dict:
    """The MoE fields of `Shapes` from a config (all 0 for a dense decoder)."""
    experts = int(c.get("num_experts") or c.get("num_local_experts") or 0)
    if not experts:
        return {}
    layers, step = int(c["num_hidden_layers"]), int(c.get("decoder_sparse_step") or 1)
    dense = set(c.get("mlp_only_layers") or ())
    moe_layers = sum(1 for n in range(layers) if n not in dense and (n + 1) % step == 0)
    return {"experts": experts, "expert_intermediate": int(c.get("moe_intermediate_size") or c["intermediate_size"]),
            "experts_per_token": int(c["num_experts_per_tok"]),
            "shared_intermediate": int(c.get("shared_expert_intermediate_size") or 0), "moe_layers": moe_layers}


@dataclass
class Item:
    label: str
    bytes: int
    note: str = ""
    where: str = "device"  # 'device' | 'host' (in_turn scorer models, kept hidden states)


@dataclass
class MemoryPlan:
    device: str
    capacity: int  # bytes usable on the device (total x (1 - HEADROOM) on a GPU, available RAM on a CPU)
    items: list[Item] = field(default_factory=list)
    placement: str = "resident"  # scorer placement: resident | in_turn | auto
    gpu_memory_utilization: float | None = None
    fix: str = ""

    @property
    def device_bytes(self) -> int:
        return sum(i.bytes for i in self.items if i.where == "device")

    @property
    def fits(self) -> bool:
        return not self.fix

    def lines(self) -> list[str]:
        out = [f"memory plan for {self.device} ({gib(self.capacity)} usable), scorer placement: {self.placement}"]
        out += [f"  {i.label:<34s} {gib(i.bytes):>10s}  {'(host) ' if i.where == 'host' else ''}{i.note}"
                for i in self.items]
        verdict = "fits" if self.fits else f"does not fit: {self.fix}"
        out.append(f"  {'total on the device':<34s} {gib(self.device_bytes):>10s}  {verdict}")
        return out

    def check(self) -> None:
        if not self.fits:
            raise UserError(f"memory plan: {gib(self.device_bytes)} needed on {self.device}, {gib(self.capacity)} "
                            f"usable; {self.fix}")


def gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


@dataclass
class Workload:
    """What the collector will run, as far as memory goes (from CollectConfig and the prompts)."""

    engine: str  # 'vllm' | 'hf'
    rollout_dtypes: list
    scorer_dtypes: list  # HF scorer dtypes
    prefill_dtypes: list  # vllm:<dtype> scorers
    max_model_len: int
    seq_len: int  # longest prompt + max_tokens
    batch_tokens: int
    chunk_rows: int
    chunk_tokens: int  # response tokens of one chunk at most (kept hidden states)
    gen_batch: int  # sequences per HF generate call
    gpu_memory_utilization: float = 0.0  # 0 = from the plan
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1


def plan_memory(shapes: Shapes, w: Workload, device: str, total: int, *, gpus: int = 1) -> MemoryPlan:
    """The plan for `device` with `total` bytes (GPU: its memory; CPU: available RAM) and `gpus` visible GPUs.

    Scorer placements are tried in order resident, in_turn (GPU), auto (GPU, a model larger than one GPU with
    several GPUs); the first that fits is the plan, else the last is returned with the fix it needs."""
    gpu = device.startswith("cuda")
    placements = ["resident"] + (["in_turn"] + (["auto"] if gpus > 1 else []) if gpu else [])
    plan = None
    for placement in placements:
        plan = MemoryPlan(device, int(total * (1 - HEADROOM)) if gpu else total, placement=placement)
        plan.items = _scorer_items(shapes, w, placement, gpus)
        _add_engines(plan, shapes, w, gpu, total)
        if plan.fits:
            return plan
    return plan


def _bytes(scorer_dtype: str) -> int:
    """Bytes per parameter of an HF scorer dtype: that of its compute dtype ('fp32-wbf16' computes in fp32, the
    R3 scorer 'fp32-r3' too; counted as a model of its own even where it shares the loaded fp32 one)."""
    return BYTES[scorer_dtype.partition("-")[0]]


def _scorer_items(shapes: Shapes, w: Workload, placement: str, gpus: int) -> list[Item]:
    if not w.scorer_dtypes:
        return []
    P, H = shapes.params(), shapes.hidden
    model_where = "host" if placement == "in_turn" else "device"
    share = gpus if placement == "auto" else 1
    items = [Item(f"HF scorer {d}", P * _bytes(d) // share, "model" + (f" / {gpus} GPUs" if share > 1 else ""), model_where)
             for d in w.scorer_dtypes]
    if placement == "in_turn":
        big = max(w.scorer_dtypes, key=_bytes)
        items.append(Item("HF scorer decoder in its turn", P * _bytes(big), f"the largest ({big}), one at a time"))
        items += [Item(f"HF scorer lm_head {d}", shapes.head_params() * _bytes(d), "on the device for phase 2")
                  for d in w.scorer_dtypes]
    worst = max(w.scorer_dtypes, key=_bytes).partition("-")[0]
    width = min(w.seq_len, w.batch_tokens)
    act = shapes.forward_activation_bytes(w.batch_tokens, width, worst) + shapes.vocab_chunk_bytes(w.chunk_rows, worst)
    kept = sum(_bytes(d) for d in w.scorer_dtypes) * H
    items.append(Item("scorer activations per micro-batch", act + w.batch_tokens * kept,
                      f"{w.batch_tokens} tokens, {w.chunk_rows} vocabulary rows"))
    items.append(Item("scorer hidden states of a chunk", w.chunk_tokens * kept, f"{w.chunk_tokens} response tokens",
                      "host" if placement == "in_turn" else "device"))
    return items


def _engines_at_peak(w: Workload) -> list[tuple[str, str]]:
    """(engine, dtype) alive together at the worst moment: one rollout engine and every vLLM prefill scorer."""
    worst, best = [], -1
    for dt in w.rollout_dtypes:
        alive = [(w.engine, dt)] + [("vllm", p) for p in w.prefill_dtypes if not (w.engine == "vllm" and p == dt)]
        size = sum(BYTES[d] for _, d in alive)
        if size > best:
            worst, best = alive, size
    return worst


def _add_engines(plan: MemoryPlan, shapes: Shapes, w: Workload, gpu: bool, total: int) -> None:
    alive = _engines_at_peak(w)
    vllm_gpu = [(e, d) for e, d in alive if e == "vllm" and gpu]
    fixed = [_engine_item(shapes, w, e, d, gpu) for e, d in alive if (e, d) not in vllm_gpu]
    plan.items += fixed
    if vllm_gpu:
        _add_vllm_gpu(plan, shapes, w, vllm_gpu, total)
    if plan.device_bytes > plan.capacity and not plan.fix:
        plan.fix = _fix(w, gpu)


def _engine_item(shapes: Shapes, w: Workload, engine: str, dt: str, gpu: bool) -> Item:
    weights = shapes.params() * BYTES[dt]
    if engine == "vllm":  # CPU backend: the KV cache is given explicitly
        act = shapes.forward_activation_bytes(ENGINE_BATCH_TOKENS, min(w.max_model_len, ENGINE_BATCH_TOKENS), dt)
        return Item(f"vLLM engine {dt}", weights + CPU_KV_BYTES + act,
                    f"weights {gib(weights)} + KV cache {gib(CPU_KV_BYTES)} + activations {gib(act)}")
    kv = w.gen_batch * w.seq_len * shapes.kv_bytes_per_token(dt)
    logits = 2 * w.gen_batch * w.seq_len * shapes.vocab * 4  # generate(output_logits) kept, and their log-softmax
    return Item(f"HF engine {dt}", weights + kv + logits,
                f"weights {gib(weights)} + KV cache {gib(kv)} + kept logits {gib(logits)} ({w.gen_batch} sequences)")


def _add_vllm_gpu(plan: MemoryPlan, shapes: Shapes, w: Workload, engines: list, total: int) -> None:
    """vLLM engines on the GPU: each gets `--gpu-memory-utilization` x total (computed from what is left)."""
    tp = w.tensor_parallel_size
    need = {}
    for _, dt in engines:
        act = shapes.forward_activation_bytes(ENGINE_BATCH_TOKENS, min(w.max_model_len, ENGINE_BATCH_TOKENS), dt) // tp
        need[dt] = (shapes.params() * BYTES[dt] // tp, act, w.max_model_len * shapes.kv_bytes_per_token(dt) // tp)
    left = plan.capacity - plan.device_bytes - OVERHEAD
    util = w.gpu_memory_utilization or min(0.9, int(100 * left / len(engines) / total) / 100)
    plan.gpu_memory_utilization = util
    plan.items.append(Item("CUDA context and allocator", OVERHEAD))
    for dt, (weights, act, kv_min) in need.items():
        budget = int(util * total)
        kv = budget - weights - act
        tokens = max(kv, 0) // max(1, shapes.kv_bytes_per_token(dt) // tp)
        plan.items.append(Item(f"vLLM engine {dt}", budget, f"--gpu-memory-utilization {util:.2f}: weights "
                               f"{gib(weights)} + activations {gib(act)} + KV cache {gib(max(kv, 0))} ({tokens} tokens)"))
        if kv < kv_min:
            plan.fix = (f"vLLM {dt} needs {gib(weights + act + kv_min)} (KV for one {w.max_model_len}-token sequence); "
                        + ("raise --gpu-memory-utilization, or " if w.gpu_memory_utilization else "")
                        + _fix(w, True))


def _fix(w: Workload, gpu: bool) -> str:
    fixes = ["pass fewer --scorer-dtypes (e.g. bf16,fp32)", "a smaller --score-batch-tokens"]
    if gpu:
        fixes[1:1] = ["a larger --tensor-parallel-size"] + (["a lower --gpu-memory-utilization"]
                                                           if w.gpu_memory_utilization else [])
    else:
        fixes.append("or run on a GPU (--device cuda)")
    if w.engine == "hf":  # its generate keeps every sequence's logits: the batch is the lever
        fixes.insert(0, f"a smaller --gen-batch (the HF engine keeps the logits of all {w.gen_batch} sequences of a call)")
    return ", ".join(fixes)
