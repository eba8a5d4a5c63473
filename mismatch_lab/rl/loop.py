"""The reference training loop: vLLM rollout -> HF trainer update -> weight push, logging the mismatch.

    from mismatch_lab.rl.loop import TrainConfig, train
    train(TrainConfig(model="default", loss="dppo_binary_tv", steps=8, db="runs/x.duckdb"))

One step (`step` = 1 … `steps`):
    1. problems   `prompts_per_step` distinct problems of the task split, seeded by (seed, step)
    2. rollout    the in-process vLLM engine at `rollout_dtype` samples each `samples_per_prompt` times at
                  T=1, recording μ of every sampled token and its top-K (K = 20, sampled token included)
    3. reward     the task's verifier (1/0), then `group_advantages` per prompt
    4. score      the HF trainer at `trainer_dtype` recomputes log π of the sampled tokens (and at the
                  rollout's top-K ids for dppo_topk_*) with gradients; logits h @ W.T in the trainer dtype,
                  log-softmax in fp32, only at response positions (small shapes: no vocabulary chunking)
    5. update     `policy_loss` -> backward -> grad clip -> AdamW, once per mini-batch (`minibatches`)
    6. rescore    no-grad forward on the same tokens: `bad_update_metrics` against μ (the paper's definition)
    7. sync       `engine.load_state_dict(model.state_dict())` (reload_weights + reset_prefix_cache, with
                  lm_head.weight) so the next rollout samples from the updated policy; with `policy_lag` N > 0
                  the weights of N updates ago instead (`LaggedSync`), so step s samples with the weights of
                  update max(s − 1 − N, 0) and π is N updates (fewer in the first N steps) newer than μ
    8. write      the step's sequences / tokens / scores, built by the Recorder's row builder
                  (record.tables.step_tables; scorer 'hf:<trainer dtype>', π *before* the
                  update, i.e. what the loss saw; `sequences.policy_lag` = the updates between the engine's
                  weights and π's) and its `train_metrics` rows in ONE `write_chunk` call with
                  chunk = step: a step is in the store entirely or not at all.

Resume: every `checkpoint_every` steps (and after the last) model + optimizer + step + RNG states go to
`<out>/<run_id>/checkpoint.pt`, written after the step's DB commit (so the checkpoint is never ahead of
the store). Re-running the same command loads the checkpoint, deletes the store's rows of steps after
it (they were trained from weights the checkpoint does not hold) and redoes them. Rollouts use
per-request seeds derived from (seed, step, prompt, sample), so redone steps sample what the
uninterrupted run would have sampled from the same weights. The checkpoint holds the newest weights only:
a resumed run with `policy_lag` > 0 restarts the engine on them, so its lag grows back from 0 (the stored
`policy_lag` of each step says what it was).
"""

from __future__ import annotations

import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from mismatch_lab import DTYPES
from mismatch_lab.errors import UserError

# LossConfig fields exposed on TrainConfig under the same names (one flat config for study files and flags)
LOSS_FIELDS = ("eps_low", "eps_high", "delta", "is_cap", "tis_cap", "cispo_eps_low", "cispo_eps_high",
               "aggregation", "constant_norm", "anchor", "topk", "gspo_eps_low", "gspo_eps_high", "gmpo_eps",
               "correction")
# fields added after runs were stored: left out of the run id at their default, so stored runs keep their ids
_IN_RUN_ID_UNLESS_DEFAULT = ("gspo_eps_low", "gspo_eps_high", "gmpo_eps", "correction", "correction_args", "preset",
                             "dynamic_sampling", "max_rounds", "overlong_cache", "overlong_max", "rollout_weights",
                             "split_scorer", "leave_one_out", "policy_lag")
# fields that do not change what a run computes: excluded from the run id, so `--steps 20` extends a run of 10
_NOT_IN_RUN_ID = ("steps", "db", "out", "checkpoint_every", "study", "kv_cache_mb")


@dataclass
class TrainConfig:
    """What `mismatch-lab train` does; study file keys ([train] table) and flags use these names."""

    model: str = "default"  # 'default' (embedded SmolLM2-135M-Instruct) or an HF checkpoint directory
    loss: str = "dppo_binary_tv"  # a base objective of mismatch_lab.corrections.registry.OBJECTIVES
    correction: str = "none"  # a rollout correction of mismatch_lab.corrections.registry.CORRECTIONS
    correction_args: str = ""  # overrides of the correction's thresholds, 'name=value,name=value' (e.g. 'cap=3')
    task: str = "arithmetic"
    split: str = "sanity"
    prompts_per_step: int = 4
    samples_per_prompt: int = 4  # group size of the baseline, >= 2
    max_tokens: int = 32
    lr: float = 1e-5
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0  # grad/norm/value is logged before clipping
    minibatches: int = 1  # optimizer steps per rollout batch; > 1 makes later mini-batches off-policy
    normalize_std: bool = True  # GRPO advantages; False is Dr. GRPO
    leave_one_out: bool = False  # group-size bias correction: baseline of the other responses (× G/(G−1))
    bad_update_delta: float = 0.5  # δ of bad_update_metrics (the DPPO paper plots 0.5)
    steps: int = 8
    seed: int = 0
    rollout_dtype: str = "bf16"
    rollout_weights: str = "none"  # fp8: the engine gets weights rounded to e4m3 per output channel (engines/weights.py)
    trainer_dtype: str = "fp32"
    # bf16 / fp16 / fp8: also score each step's tokens on the trainer weights rounded to that grid, computed in fp32,
    # and log mismatch/weight_rounding/* (weight rounding alone; docs/rl.md). Off by default
    split_scorer: str = "none"
    # sample with the weights of N optimizer updates ago (a run of known staleness; 0: push after every update)
    policy_lag: int = 0
    checkpoint_every: int = 4
    db: str = "runs/train.duckdb"
    out: str = "runs"  # checkpoints go to <out>/<run_id>/checkpoint.pt (runs/ is git-ignored)
    study: str = "adhoc"
    kv_cache_mb: int = 1024
    # recipes (mismatch_lab/rl/recipes.py): a named preset, DAPO dynamic sampling and soft overlong punishment
    # none, dr_grpo, dapo: sets its fields where they are still at their defaults; or a framework preset
    # (e.g. verl/decoupled_geo_rs, `mismatch-lab corrections --list-presets`): that framework's loss code is the loss
    preset: str = "none"
    dynamic_sampling: bool = False  # drop all-equal-reward groups and sample more (DAPO)
    max_rounds: int = 4  # dynamic sampling: generation rounds per step at most
    overlong_cache: int = 0  # L_cache of the soft overlong punishment (0 = off)
    overlong_max: int = 0  # L_max of the soft overlong punishment (0 = max_tokens)
    # LossConfig fields (defaults as in LossConfig; see docs/rl.md)
    eps_low: float = 0.2
    eps_high: float = 0.2
    delta: float | None = None
    is_cap: float = math.inf
    tis_cap: float = 3.0
    cispo_eps_low: float = 1.0
    cispo_eps_high: float = 2.0
    aggregation: str = "token-mean"
    constant_norm: float | None = None
    anchor: str = "rollout"
    topk: int = 20
    gspo_eps_low: float = 3e-4
    gspo_eps_high: float = 4e-4
    gmpo_eps: float = 0.4

    def loss_config(self):
        from mismatch_lab.rl.losses import LossConfig

        try:
            return LossConfig(**{k: getattr(self, k) for k in LOSS_FIELDS}, correction_args=self.correction_overrides())
        except ValueError as exc:
            raise UserError(str(exc)) from exc

    def correction_overrides(self) -> dict[str, float]:
        """`correction_args` ('cap=3,low=0.5') as a dict; UserError naming the format."""
        out = {}
        for part in filter(None, (p.strip() for p in str(self.correction_args or "").split(","))):
            key, sep, value = part.partition("=")
            try:
                out[key.strip()] = float(value)
            except ValueError:
                sep = ""
            if not sep:
                raise UserError(f"--correction-args {self.correction_args!r}: write name=value pairs, e.g. 'cap=3' "
                                "or 'low=0.5,high=5'")
        return out

    def validate(self) -> None:
        from mismatch_lab.corrections.registry import (
            CORRECTIONS,
            OBJECTIVES,
            check_pair,
        )
        from mismatch_lab.rl.recipes import apply_preset

        if self.framework_preset() is None:
            apply_preset(self)
        elif self.minibatches != 1:
            raise UserError(f"--preset {self.preset} needs --minibatches 1: a framework's loss reads π_old from "
                            "before the step's first update, which the loop does not keep past one mini-batch")
        from mismatch_lab.rl.tasks import TASKS

        if self.loss not in OBJECTIVES:
            raise UserError(f"--loss {self.loss}: unknown objective; use one of {', '.join(OBJECTIVES)}")
        if self.correction in CORRECTIONS:
            try:
                check_pair(OBJECTIVES[self.loss], CORRECTIONS[self.correction])
            except ValueError as exc:
                raise UserError(f"--loss {self.loss} --correction {self.correction}: {exc}") from None
        if self.task not in TASKS:
            raise UserError(f"task {self.task!r}: unknown; use one of {', '.join(TASKS)}")
        task = TASKS[self.task]
        if self.split not in task.SPLITS:
            raise UserError(f"--split {self.split}: unknown; use one of {', '.join(task.SPLITS)}")
        for d, flag in ((self.rollout_dtype, "--rollout-dtype"), (self.trainer_dtype, "--trainer-dtype")):
            if d not in DTYPES:
                raise UserError(f"{flag} {d}: use one of {', '.join(DTYPES)}")
        if self.rollout_weights not in ("none", "fp8"):
            raise UserError(f"--rollout-weights {self.rollout_weights}: use none or fp8")
        from mismatch_lab.engines.weights import ROUNDINGS

        if self.split_scorer not in ROUNDINGS:
            raise UserError(f"--split-scorer {self.split_scorer}: use one of {', '.join(ROUNDINGS)}")
        if self.split_scorer != "none" and self.trainer_dtype != "fp32":
            raise UserError(f"--split-scorer {self.split_scorer} needs --trainer-dtype fp32: against a "
                            f"{self.trainer_dtype} trainer the difference would mix in compute precision")
        if self.overlong_cache < 0 or self.overlong_cache > (self.overlong_max or self.max_tokens):
            raise UserError(f"--overlong-cache {self.overlong_cache} must be in 0..L_max (--overlong-max, 0 = max_tokens)")
        for name in ("prompts_per_step", "max_tokens", "steps", "checkpoint_every", "minibatches", "kv_cache_mb",
                     "max_rounds"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name.replace('_', '-')} must be at least 1")
        if not 0 <= self.policy_lag <= self.steps:
            raise UserError(f"--policy-lag {self.policy_lag} must be in 0..--steps ({self.steps}): the optimizer "
                            "updates the rollout engine's weights lag behind the trainer's")
        if self.samples_per_prompt < 2:
            raise UserError("--samples-per-prompt must be at least 2: the advantage baseline is the group mean")
        if (self.prompts_per_step * self.samples_per_prompt) % self.minibatches:
            raise UserError(f"--minibatches {self.minibatches} must divide prompts x samples "
                            f"= {self.prompts_per_step * self.samples_per_prompt}")
        if not self.lr > 0:
            raise UserError(f"--lr {self.lr} must be > 0")
        if not 1 <= self.topk <= 20:
            raise UserError(f"--topk {self.topk} must be in 1..20 (vLLM returns at most 20 log-probs)")
        self.loss_config()

    def framework_preset(self):
        """The framework preset `preset` names ('<framework>/<name>'), else None (a recipe); UserError for an
        unknown one."""
        if "/" not in str(self.preset):
            return None
        from mismatch_lab.corrections import frameworks

        try:
            return frameworks.get(self.preset)
        except ValueError as exc:
            raise UserError(f"--preset: {exc}") from None

    def run_id(self) -> str:
        from mismatch_lab.runtime import config_key, run_identity

        key = config_key(run_identity(self, leave_out=_NOT_IN_RUN_ID, unless_default=_IN_RUN_ID_UNLESS_DEFAULT))
        return f"{self.study}-train-{self.loss}-{key}"


def framework_loss(preset, lp, lmu, adv, mask, metrics: dict[str, float]) -> tuple:
    """`train --preset <framework>/<name>`: the framework's own loss on one mini-batch, π_old = π before the
    update (the loop's one mini-batch), μ = the rollout's log-probs, A [B] broadcast over the tokens.
    `metrics` (the objective's, from policy_loss) keep their loss-independent diagnostics (mismatch/, ratio/,
    counts); loss/value and mask/* then describe the preset (mask: tokens its masks drop) and its own metrics
    are added as framework/<the framework's name>."""
    import torch

    from mismatch_lab.corrections.frameworks import Tokens

    advantages = torch.where(mask, adv.to(lp.dtype)[:, None], torch.zeros((), dtype=lp.dtype))
    result = preset(Tokens(lp, lp.detach(), lmu.to(lp.dtype), advantages, mask))
    dropped, nonzero = mask & ~result.keep, mask & (advantages != 0)
    n_nonzero = max(int(nonzero.sum()), 1)
    out = dict(metrics) | {
        "loss/value": float(result.loss.detach()),
        "mask/all/frac": float(dropped.sum()) / max(int(mask.sum()), 1),
        "mask/nonzero_adv/frac": float((dropped & nonzero).sum()) / n_nonzero,
        "mask/negative_adv/frac": float((dropped & (advantages < 0)).sum()) / n_nonzero,
        "mask/positive_adv/frac": float((dropped & (advantages > 0)).sum()) / n_nonzero,
    }
    return result.loss, out | {f"framework/{k}": float(v) for k, v in result.metrics.items()}


def coerce(cfg: TrainConfig) -> TrainConfig:
    """Cast study-file / flag values to the field types (TOML ints for floats, 'inf' strings); UserError if not."""
    for f in fields(TrainConfig):
        v = getattr(cfg, f.name)
        if v is None:
            continue
        kind = f.type if isinstance(f.type, str) else f.type.__name__
        try:
            if kind.startswith("int"):
                setattr(cfg, f.name, int(v))
            elif kind.startswith("float"):
                setattr(cfg, f.name, float(v))
            elif kind == "bool" and isinstance(v, str):
                setattr(cfg, f.name, v.lower() in ("1", "true", "yes"))
        except (TypeError, ValueError) as exc:
            raise UserError(f"{f.name} must be a number, got {v!r}") from exc
    return cfg


# ------------------------------------------------------------------------------------------------------
def _pad(rows: list[list], fill, dtype):
    from mismatch_lab.rl.step import pad

    return pad(rows, fill, dtype)


def response_logps(model, prompt_ids, response_ids, topk_ids=None, *, trainer_dtype: str):
    """Trainer log-probs of the response tokens, [B, T] (right-padded; pad = 0), with gradients if enabled.

    prompt_ids / response_ids: per sequence token lists; topk_ids: per sequence, per response token, the
    rollout's top-K ids (sampled token included), or None. Logits are h @ W.T at the trainer dtype for the
    response positions only, log-softmax in fp32 (the scorer's definition of π).
    Returns (logp [B, T], entropy [B, T] detached, topk_logps [B, T, K] or None, valid_topk [B, T, K] or None).
    """
    import torch

    from mismatch_lab.scoring.positions import response_rows

    B = len(prompt_ids)
    full = [list(p) + list(r) for p, r in zip(prompt_ids, response_ids)]
    ids = _pad(full, 0, torch.long)
    attn = _pad([[1] * len(f) for f in full], 0, torch.long)
    T = max((len(r) for r in response_ids), default=0)
    b_np, pos_np = response_rows([len(p) for p in prompt_ids], [len(r) for r in response_ids])  # p predicts p + 1
    rb, rt, tb = b_np.tolist(), pos_np.tolist(), b_np.tolist()
    tt = [j for r in response_ids for j in range(len(r))]
    tgt = [tok for r in response_ids for tok in r]
    dev = next(model.parameters()).device
    h = model.get_decoder()(input_ids=ids.to(dev), attention_mask=attn.to(dev)).last_hidden_state
    h = h[torch.tensor(rb, device=dev), torch.tensor(rt, device=dev)]  # [N, H]
    w = model.get_output_embeddings().weight
    lp_all = torch.log_softmax((h @ w.T).float(), dim=-1)  # [N, V] fp32
    tgt_t = torch.tensor(tgt, dtype=torch.long, device=dev)
    logp_flat = lp_all.gather(1, tgt_t[:, None]).squeeze(1)
    with torch.no_grad():
        ent_flat = -(lp_all.exp() * lp_all).nan_to_num(0.0).sum(-1)
    bi, ti = torch.tensor(tb, device=dev), torch.tensor(tt, device=dev)
    logp = torch.zeros((B, T), dtype=torch.float32, device=dev).index_put((bi, ti), logp_flat)
    entropy = torch.zeros((B, T), dtype=torch.float32, device=dev).index_put((bi, ti), ent_flat)
    tk, valid = None, None
    if topk_ids is not None:
        K = max(len(row) for seq in topk_ids for row in seq)
        flat = [row for seq in topk_ids for row in seq]
        idx = _pad(flat, 0, torch.long).to(dev)  # [N, K]
        ok = _pad([[True] * len(row) for row in flat], False, torch.bool).to(dev)
        g = lp_all.gather(1, idx).detach()  # the top-K divergence is a hard gate: no gradient through it
        tk = torch.zeros((B, T, K), dtype=torch.float32, device=dev).index_put((bi, ti), g)
        valid = torch.zeros((B, T, K), dtype=torch.bool, device=dev).index_put((bi, ti), ok)
    return logp, entropy, tk, valid


def step_arrays(samples, seq_rows, logp_mu, logp_before, entropy, mask, adv, rewards):
    """One step's rollout and scores as record.tables.StepArrays ([n, T] numpy; ragged top-K lists padded
    with id -1), with the sequences' prompt, sample, text and finish reason."""
    import numpy as np

    from mismatch_lab.record.tables import StepArrays

    n, T = mask.shape
    ids = np.zeros((n, T), dtype=np.int64)
    for i, smp in enumerate(samples):
        ids[i, : len(smp.token_ids)] = smp.token_ids
    tk_ids = tk_lps = None
    if all(smp.topk_ids for smp in samples):
        K = max((len(row) for smp in samples for row in smp.topk_ids), default=0)
        tk_ids, tk_lps = np.full((n, T, K), -1, dtype=np.int64), np.full((n, T, K), np.nan)
        for i, smp in enumerate(samples):
            for p, (row_ids, row_lps) in enumerate(zip(smp.topk_ids, smp.topk_logps)):
                tk_ids[i, p, : len(row_ids)] = row_ids
                tk_lps[i, p, : len(row_lps)] = [np.nan if x is None else x for x in row_lps]
    extra = {"prompt_id": [r["prompt_id"] for r in seq_rows], "sample_idx": [r["sample_idx"] for r in seq_rows],
             "response_text": [smp.text for smp in samples], "finish_reason": [smp.finish_reason for smp in samples],
             "prompt_len": [r["prompt_len"] for r in seq_rows]}  # fmt: skip
    return StepArrays(token_ids=ids, mask=mask.numpy(), logp_rollout=logp_mu.numpy(),
                      logp_trainer=logp_before.float().numpy(), advantages=adv.float().numpy(),
                      rewards=np.asarray(rewards, dtype=np.float64), rollout_topk_ids=tk_ids, rollout_topk_logps=tk_lps,
                      entropy=entropy.float().numpy(), sequence_columns=extra)


# ------------------------------------------------------------------------------------------------------
def _checkpoint_path(cfg: TrainConfig, run_id: str) -> Path:
    return Path(cfg.out) / run_id / "checkpoint.pt"


def save_checkpoint(path: Path, model, optimizer, step: int) -> None:
    """Model + optimizer + step + RNG, written to a temporary name and renamed: a kill leaves the old one."""
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "torch_rng": torch.get_rng_state(), "python_rng": random.getstate()}, tmp)
    os.replace(tmp, path)


def _delete_steps_after(con, run_id: str, step: int) -> int:
    """Remove every row of steps > `step` (redone after a resume) in one transaction; returns steps removed."""
    n = con.execute("SELECT count(*) FROM chunks_done WHERE run_id = ? AND chunk > ?", [run_id, step]).fetchone()[0]
    from mismatch_lab.store.writer import transaction

    with transaction(con):
        seqs = "SELECT seq_id FROM sequences WHERE run_id = ? AND step > ?"
        for table in ("tokens", "scores"):
            con.execute(f"DELETE FROM {table} WHERE run_id = ? AND seq_id IN ({seqs})", [run_id, run_id, step])
        con.execute("DELETE FROM sequences WHERE run_id = ? AND step > ?", [run_id, step])
        con.execute("DELETE FROM train_metrics WHERE run_id = ? AND step > ?", [run_id, step])
        con.execute("DELETE FROM chunks_done WHERE run_id = ? AND chunk > ?", [run_id, step])
    return n


def problems_for_step(cfg: TrainConfig, step: int, round_: int = 0):
    """The step's problems: distinct within the step, seeded by (seed, step) so every run sees the same data
    (round > 0: dynamic sampling's extra rounds, seeded apart)."""
    from mismatch_lab.rl.tasks import TASKS

    seed = cfg.seed * 1_000_003 + step + round_ * 7_919_000_033
    return TASKS[cfg.task].generate(cfg.split, cfg.prompts_per_step, seed=seed)


# ------------------------------------------------------------------------------------------------------
def _load_trainer(cfg: TrainConfig, model_path: str, ckpt_path: Path):
    """(model, optimizer, start step): the HF trainer at `trainer_dtype`, restored from the checkpoint if any."""
    import torch
    from transformers import AutoModelForCausalLM

    from mismatch_lab.engines.base import TORCH_DTYPES

    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, TORCH_DTYPES[cfg.trainer_dtype]))
    model.train()
    # dropout-free decoders: the loss must see the same π as the no-grad re-score, so dropout is switched off
    for mod in model.modules():
        if isinstance(mod, torch.nn.Dropout):
            mod.p = 0.0
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    if not ckpt_path.is_file():
        return model, optimizer, 0
    state = torch.load(ckpt_path, map_location="cpu", weights_only=False)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["torch_rng"])
    random.setstate(state["python_rng"])
    return model, optimizer, int(state["step"])


def _start_run(cfg: TrainConfig, writer, run_id: str, model_path: str, engine, scorer: str) -> None:
    import torch

    from mismatch_lab.engines.weights import weights_label
    from mismatch_lab.models import weights_sha256
    from mismatch_lab.runtime import device_name, versions

    run_cfg = dict(asdict(cfg), loss_config=asdict(cfg.loss_config()), model_resolved=model_path, run_kind="train",
                   sampling=engine.sampling_config(), scorer=scorer,
                   problems_seed="seed * 1000003 + step", rollout_seed="sample_seed(seed, step * prompts + p, s)")
    writer.start_run(run_id, study=cfg.study, kind="train", model=model_path, weights_sha256=weights_sha256(model_path),
                     engine="vllm", engine_dtype=weights_label(cfg.rollout_dtype, cfg.rollout_weights),
                     device=device_name("cuda" if torch.cuda.is_available() else "cpu"), versions=versions(),
                     config=run_cfg)


def run_step(cfg: TrainConfig, ctx: dict, step: int) -> dict[str, float]:
    """One step, rollout to commit (see the module docstring); returns its metrics."""
    from mismatch_lab.rl import step as parts

    t_step = time.perf_counter()
    times: dict[str, float] = {}
    with parts.timed(times, "rollout"):
        batch = parts.rollout_batch(cfg, ctx["engine"], ctx["tokenizer"], ctx["task"], step, top_k=cfg.topk)
    split = {}
    if cfg.split_scorer != "none":  # on the weights that rolled out, before this step's update
        with parts.timed(times, "split_score"):
            split = parts.weight_rounding_metrics(ctx["model"], batch, cfg.split_scorer, ctx)
    scored = parts.train_on_batch(ctx["model"], ctx["optimizer"], batch, cfg, ctx["loss_cfg"], topk=ctx["use_topk"],
                                  times=times)
    with parts.timed(times, "rescore"):
        bad = parts.rescore(ctx["model"], batch, scored.logp_before, trainer_dtype=cfg.trainer_dtype,
                            delta=cfg.bad_update_delta)
    lag = ctx["sync"].lag(step)  # of this step's rollout, before the sync below moves the engine on
    with parts.timed(times, "sync"):
        ctx["sync"].after_update(step)
    times["time/step/seconds"] = time.perf_counter() - t_step
    metrics = parts.step_metrics(batch, scored, bad, times, lr=cfg.lr) | split | {"policy_lag/value": float(lag)}
    parts.write_step(ctx["writer"], ctx["run_id"], step, batch, scored, metrics, scorer=ctx["scorer"],
                     texts=ctx["texts"], seconds=time.perf_counter() - t_step, policy_lag=lag)
    return metrics


def train(cfg: TrainConfig, *, progress: bool = True, log=None) -> str:
    """Run (or resume) the training run described by `cfg`; returns its run id.

    `log(step, metrics)` is called after each committed step (the CLI's progress bar uses it).
    """
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # vLLM's environment is set by _import_vllm
    cfg.validate()
    import transformers

    from mismatch_lab.models import resolve_model
    from mismatch_lab.runtime import load_tokenizer
    from mismatch_lab.store.writer import StoreWriter

    transformers.utils.logging.disable_progress_bar()
    model_path = resolve_model(cfg.model)
    tokenizer, model_ctx = load_tokenizer(model_path)
    run_id = cfg.run_id()
    ckpt_path = _checkpoint_path(cfg, run_id)
    writer = StoreWriter(cfg.db)
    try:
        return _train_in(cfg, writer, run_id, tokenizer, model_ctx, model_path, ckpt_path, log)
    finally:
        writer.close()


def _train_in(cfg: TrainConfig, writer, run_id: str, tokenizer, model_ctx, model_path: str, ckpt_path: str,
              log) -> str:
    """`train` once the store is open (the caller closes it): resume point, engine, steps."""
    from mismatch_lab.corrections.registry import OBJECTIVES
    from mismatch_lab.engines.base import make_engine
    from mismatch_lab.record.flat import TextLookup
    from mismatch_lab.rl.tasks import TASKS

    if writer.run_status(run_id) == "complete" and max(writer.done_chunks(run_id), default=0) >= cfg.steps:
        print(f"{run_id}: already complete, nothing to do", file=sys.stderr)
        return run_id
    model, optimizer, start = _load_trainer(cfg, model_path, ckpt_path)
    if start >= cfg.steps:  # the checkpoint already covers the requested steps: no engine needed
        # only rows after the checkpoint are unbacked; the steps between cfg.steps and the checkpoint are the
        # checkpoint's own history and stay (deleting them lost steps when a smaller --steps followed a kill)
        _delete_steps_after(writer.con, run_id, start)
        writer.set_status(run_id, "complete")
        return run_id
    redone = _delete_steps_after(writer.con, run_id, start)
    if start or redone:
        print(f"{run_id}: resuming after step {start} (checkpoint {ckpt_path if start else 'none'}); "
              f"{redone} committed step(s) after it are redone", file=sys.stderr)
    engine = None  # built inside the try: an interrupt or failure of the engine's start-up still marks the run
    try:
        engine = make_engine("vllm", model_path, cfg.rollout_dtype, seed=cfg.seed,
                             max_model_len=min(2048, model_ctx or 2048), kv_cache_bytes=cfg.kv_cache_mb << 20,
                             max_logprobs=20)
        ctx = {"engine": engine, "tokenizer": tokenizer, "task": TASKS[cfg.task], "model": model,
               "optimizer": optimizer, "loss_cfg": cfg.loss_config(), "use_topk": "topk" in OBJECTIVES[cfg.loss].needs,
               "writer": writer, "run_id": run_id, "scorer": f"hf:{cfg.trainer_dtype}", "texts": TextLookup(tokenizer)}
        if start or cfg.rollout_weights != "none":
            sync_weights(engine, model, cfg.rollout_weights)  # the checkpoint's (or rounded) weights, not the base
        ctx["sync"] = LaggedSync(engine, model, cfg.rollout_weights, cfg.policy_lag, version=start)
        _start_run(cfg, writer, run_id, model_path, engine, ctx["scorer"])
        for step in range(start + 1, cfg.steps + 1):
            metrics = run_step(cfg, ctx, step)
            if step % cfg.checkpoint_every == 0 or step == cfg.steps:
                save_checkpoint(ckpt_path, model, optimizer, step)
            if log is not None:
                log(step, metrics)
        writer.set_status(run_id, "complete")
    except BaseException:
        if writer.run_status(run_id) == "running":
            writer.set_status(run_id, "failed")
        raise
    finally:
        if engine is not None:
            engine.close()
    return run_id


def sync_weights(engine, model, rollout_weights: str = "none", state=None) -> None:
    """The trainer's weights (or `state`, a copy of them) into the engine, rounded as `rollout_weights` says
    (the trainer keeps its own)."""
    from functools import partial

    from mismatch_lab.engines.weights import round_state
    from mismatch_lab.rl.step import push_state

    transform = None if rollout_weights == "none" else partial(round_state, kind=rollout_weights)
    push_state(engine, model.state_dict() if state is None else state, transform)


class LaggedSync:
    """The weight push of `train --policy-lag N`: after update s the engine gets the weights of update s − N
    (kept as CPU copies of the last N versions), so the rollout of step s + 1 samples N updates behind the
    trainer; N = 0 pushes every update. `version` = the update the engine holds at the start (0, or the
    resumed checkpoint's step)."""

    def __init__(self, engine, model, rollout_weights: str, lag: int, *, version: int = 0):
        from collections import deque

        self.engine, self.model, self.rollout_weights, self.n = engine, model, rollout_weights, lag
        self.version = version
        self.kept = deque()  # (update, state dict copy), oldest first

    def lag(self, step: int) -> int:
        """The lag of step `step`'s rollout: π is at update step − 1, μ at the engine's."""
        return step - 1 - self.version

    def after_update(self, step: int) -> None:
        """The trainer is now at update `step`: push the update `step` − N (if newer than the engine's)."""
        if self.n == 0:
            sync_weights(self.engine, self.model, self.rollout_weights)
            self.version = step
            return
        self.kept.append((step, {k: v.detach().clone() for k, v in self.model.state_dict().items()}))
        due = None
        while self.kept and self.kept[0][0] <= step - self.n:
            due = self.kept.popleft()
        if due is not None and due[0] > self.version:
            sync_weights(self.engine, self.model, self.rollout_weights, state=due[1])
            self.version = due[0]
