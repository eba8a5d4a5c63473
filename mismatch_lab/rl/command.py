"""`mismatch-lab train`: the reference RL run (DPPO and its baselines) logging mismatch metrics per step.

    mismatch-lab train --study studies/dppo-sanity/study.toml --loss dppo_binary_tv
    mismatch-lab train --model default --loss grpo --eps-high 0.28 --steps 8 --lr 1e-5 --db runs/x.duckdb

Defaults < the study file's [train] table < flags. Killed runs resume when the same command is re-run
(see mismatch_lab/rl/loop.py). The run id hashes the configuration without `steps`, so raising `--steps`
continues a finished run.
"""

from __future__ import annotations

import sys
import time
from dataclasses import fields

from mismatch_lab.engines.weights import weights_label
from mismatch_lab.rl.loop import TrainConfig, coerce
from mismatch_lab.studyfile import apply_study

_HELP = {
    "model": "'default' (embedded SmolLM2-135M-Instruct) or an HF checkpoint directory",

    "split": "task split: sanity (learnable) or hard",
    "prompts_per_step": "problems per step (default 4)",
    "samples_per_prompt": "samples per problem, the advantage group (default 4)",
    "max_tokens": "max generated tokens per response (default 32)",
    "lr": "AdamW learning rate (default 1e-5)",
    "steps": "training steps (default 8)",
    "seed": "seed of data, rollouts and init (default 0)",
    "rollout_dtype": "vLLM dtype: bf16 (default), fp16, fp32",
    "trainer_dtype": "HF trainer dtype: fp32 (default), bf16, fp16",
    "checkpoint_every": "checkpoint every N steps (default 4); a killed run redoes the steps after the last one",
    "db": "DuckDB file (default: studies/<name>/<name>.duckdb with --study, else runs/train.duckdb)",
    "out": "checkpoint directory (default runs/, git-ignored)",
    "minibatches": "optimizer steps per rollout batch (default 1: on-policy up to the mismatch)",
    "policy_lag": "sample with the weights of N optimizer updates ago, a run of known staleness; each sequence "
                  "records its lag (sequences.policy_lag; analyze's staleness table) (default 0)",
    "preset": "named recipe: none (default), dr_grpo (no std normalisation, constant normaliser = max tokens), "
              "dapo (dynamic sampling, eps-high 0.28, token-mean, overlong cache = max tokens / 5); or a framework "
              "preset, e.g. verl/decoupled_geo_rs: that framework's own loss replaces --loss (`mismatch-lab "
              "corrections --list-presets`)",
    "dynamic_sampling": "DAPO dynamic sampling: drop groups whose rewards are all equal and sample more (default false)",
    "max_rounds": "dynamic sampling: at most this many generation rounds per step (default 4)",
    "overlong_cache": "DAPO soft overlong punishment: L_cache in tokens (default 0 = off)",
    "overlong_max": "DAPO soft overlong punishment: L_max in tokens (default 0 = max tokens)",
    "leave_one_out": "group-size bias correction: advantages against the mean of the other responses of the "
                     "group, i.e. the residual times G/(G-1) (default false)",
}


def _registry_help() -> dict[str, str]:
    from mismatch_lab.corrections.registry import help_text

    return {"loss": f"base objective (docs/corrections.md): {help_text('objective')}",
            "correction": f"rollout correction applied on top (default none): {help_text('correction')}",
            "correction_args": "override the correction's thresholds: name=value[,name=value], e.g. cap=3",
            "split_scorer": "also score each step's tokens on the trainer weights rounded to this grid, in fp32 "
                            "(needs an fp32 trainer): logs mismatch/weight_rounding/abs_dlogp (default none)"}


def add_arguments(parser) -> None:
    helps = _HELP | _registry_help()
    parser.add_argument("--study", help="studies/<name>/study.toml; its [train] table sets defaults, flags override")
    for f in fields(TrainConfig):
        if f.name == "study":  # the run's study name comes from the study file's directory
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = f.type if isinstance(f.type, str) else f.type.__name__
        if kind == "bool":
            parser.add_argument(flag, dest=f.name, type=lambda s: s.lower() in ("1", "true", "yes"), metavar="BOOL",
                                help=helps.get(f.name, f"{f.name} (default {f.default})"))
        else:
            choices = _choices(f.name)
            parser.add_argument(flag, dest=f.name, choices=choices, help=helps.get(
                f.name, f"LossConfig/TrainConfig {f.name} (default {f.default}); see docs/rl.md"))
    parser.add_argument("--no-progress", dest="no_progress", action="store_true", help="plain per-step lines instead of tqdm")


def _choices(name: str):
    from mismatch_lab.corrections.registry import CORRECTIONS, OBJECTIVES
    from mismatch_lab.engines.weights import ROUNDINGS

    # --preset: a recipe (PRESETS) or a framework preset; TrainConfig.validate checks it (listing the framework
    # presets here would import torch for every command)
    return {"loss": list(OBJECTIVES), "correction": list(CORRECTIONS), "split_scorer": list(ROUNDINGS)}.get(name)


def load_config(args) -> TrainConfig:
    cfg = TrainConfig()
    names = {f.name for f in fields(TrainConfig)}
    if getattr(args, "study", None):
        apply_study(cfg, args.study, "train", names, path_keys=("db", "out"), required=True)
    for k in names - {"study"}:
        v = getattr(args, k, None)
        if v is not None:
            setattr(cfg, k, v)
    if isinstance(cfg.delta, str) and cfg.delta.lower() in ("none", ""):
        cfg.delta = None
    if isinstance(cfg.constant_norm, str) and cfg.constant_norm.lower() in ("none", ""):
        cfg.constant_norm = None
    coerce(cfg)
    cfg.validate()
    return cfg


def run(args) -> int:
    from mismatch_lab.rl.loop import train

    cfg = load_config(args)
    plain = getattr(args, "no_progress", False)
    t_start = time.perf_counter()
    history: list[tuple[int, dict]] = []
    pbar = None
    if not plain:
        from tqdm import tqdm

        pbar = tqdm(total=cfg.steps, unit="step", desc=f"train {cfg.loss}", file=sys.stderr, dynamic_ncols=True)

    def log(step: int, m: dict) -> None:
        history.append((step, m))
        line = (f"reward {m['reward/mean']:.2f} mism|Δp| {m['mismatch/abs_dp/mean']:.4f} "
                f"mask {m['mask/nonzero_adv/frac']:.3f} bad {m['bad_update/negative_adv/frac']:.3f} "
                f"{m['time/step/seconds']:.1f}s")
        if pbar is not None:
            pbar.n = step
            pbar.set_postfix_str(line)
            pbar.refresh()
        else:
            print(f"step {step}/{cfg.steps} committed: {line}", flush=True)

    try:
        run_id = train(cfg, progress=not plain, log=log)
    finally:
        if pbar is not None:
            pbar.close()
    method = cfg.loss if cfg.correction == "none" else f"{cfg.loss} + {cfg.correction}"
    rollout = weights_label(cfg.rollout_dtype, cfg.rollout_weights)  # 'bf16-wfp8' behind fp8-rounded weights
    print(f"\nrun {run_id} ({method}, {rollout} rollout / {cfg.trainer_dtype} trainer) -> {cfg.db}")
    if history:
        first, last = history[0][1], history[-1][1]
        print(f"steps {history[0][0]}..{history[-1][0]} this invocation, {time.perf_counter() - t_start:.0f} s")
        for name in ("reward/mean", "mismatch/abs_dp/mean", "mismatch/kl_k3/mean", "mask/nonzero_adv/frac",
                     "bad_update/negative_adv/frac", "entropy/mean", "response/length/mean", "grad/norm/value"):
            print(f"  {name:32s} first {first.get(name, float('nan')):.4g}  last {last.get(name, float('nan')):.4g}")
    print(f"next: mismatch-lab export --db {cfg.db} --out <dir>   |   query train_metrics WHERE run_id = '{run_id}'")
    return 0
