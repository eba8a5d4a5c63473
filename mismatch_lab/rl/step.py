"""One training step in parts, each testable alone (mismatch_lab/rl/loop.py::train strings them together):

    rollout_batch    problems -> vLLM samples -> rewards -> advantages: a `Batch`
    train_on_batch   per mini-batch: `score_minibatch` (π with gradients) -> `policy_loss` -> `update`
    rescore          no-grad π after the update: bad-update metrics against μ and against π before
    sync_weights     the trainer's weights into the rollout engine
    step_metrics     the step's metric row (pure: numbers in, dict out)
    write_step       sequences / tokens / scores / metrics of the step in one `write_chunk` call

Timing goes through `timed(times, name)` (seconds added to times['time/<name>/seconds']). Metrics that
average over mini-batches are reduced exactly by `reduce_minibatches`: every per-mini-batch mean is turned
back into its sum with its count (tokens, tokens with A ≠ 0, sequences) and the sums are divided once.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


@contextmanager
def timed(times: dict, name: str):
    """Add the seconds the block takes to times['time/<name>/seconds'] (summed over repeated blocks)."""
    key = f"time/{name}/seconds"
    t0 = time.perf_counter()
    try:
        yield
    finally:
        times[key] = times.get(key, 0.0) + time.perf_counter() - t0


def pad(rows: list[list], fill, dtype):
    width = max((len(r) for r in rows), default=0)
    return torch.tensor([list(r) + [fill] * (width - len(r)) for r in rows], dtype=dtype)


# ------------------------------------------------------------------------------------------------- rollout
@dataclass
class Batch:
    """The step's rollout: N = groups x G sequences laid out group by group."""

    samples: list  # engines.base.Sample per sequence
    seq_rows: list[dict]  # seq_id, prompt_id, sample_idx, prompt_len, reward, advantage
    prompt_ids: list[list[int]]  # per sequence
    rewards: list[float]
    adv: torch.Tensor  # [N]
    adv_metrics: dict
    logp_mu: torch.Tensor  # [N, T] (pad 0)
    mask: torch.Tensor  # [N, T] bool
    rollout_metrics: dict = field(default_factory=dict)
    task_rewards: list[float] | None = None  # the verifier's rewards before shaping (None: = rewards)

    @property
    def responses(self) -> list[list[int]]:
        return [s.token_ids for s in self.samples]


def make_batch(samples, seq_rows, prompt_ids, rewards, *, group_size: int, normalize_std: bool,
               leave_one_out: bool = False, rollout_metrics: dict | None = None) -> Batch:
    """Advantages, μ and the mask of a rollout (pure: no engine, no model)."""
    from mismatch_lab.rl.advantages import group_advantages

    adv, adv_metrics = group_advantages(torch.tensor(rewards), group_size, normalize_std=normalize_std,
                                        leave_one_out=leave_one_out)
    rows = [dict(r, reward=rw, advantage=a) for r, rw, a in zip(seq_rows, rewards, adv.tolist())]
    mu = [[x if math.isfinite(x) else -math.inf for x in s.logps] for s in samples]
    return Batch(samples=list(samples), seq_rows=rows, prompt_ids=list(prompt_ids), rewards=list(rewards), adv=adv,
                 adv_metrics=adv_metrics, logp_mu=pad(mu, 0.0, torch.float32),
                 mask=pad([[True] * len(s.token_ids) for s in samples], False, torch.bool),
                 rollout_metrics=dict(rollout_metrics or {}))


def group_requests(cfg, step: int, group: int, prompt_ids: list[int], *, round_: int = 0):
    """The G requests of one prompt; per-request seeds from (seed, step, group, sample) so a redone step
    samples what the uninterrupted run sampled (round > 0: dynamic sampling's extra rounds)."""
    from mismatch_lab.engines.base import GenRequest
    from mismatch_lab.runtime import sample_seed

    index = (step - 1) * cfg.prompts_per_step + group
    if round_:
        index = f"{index}/round{round_}"
    return [GenRequest(prompt_ids=prompt_ids, seed=sample_seed(cfg.seed, index, s)) for s in range(cfg.samples_per_prompt)]


def seq_row(cfg, step: int, slot: int, s: int, prompt_id: str, prompt_len: int) -> dict:
    """The sequence's row; seq_id from its slot in the step's batch (unique within the run)."""
    seq_id = ((step - 1) * cfg.prompts_per_step + slot) * cfg.samples_per_prompt + s
    return {"seq_id": seq_id, "prompt_id": prompt_id, "sample_idx": s, "prompt_len": prompt_len}


@dataclass
class Group:
    """One prompt's G samples with the task's rewards (before any shaping)."""

    problem: object
    prompt_ids: list[int]
    samples: list
    rewards: list[float]


def sample_groups(cfg, engine, tokenizer, task, step: int, *, top_k: int, round_: int = 0) -> list[Group]:
    """One generation round: the round's problems, G samples each, rewarded by the task's verifier."""
    from mismatch_lab.rl.loop import problems_for_step
    from mismatch_lab.runtime import encode_prompts

    problems = problems_for_step(cfg, step, round_)
    p_ids, _ = encode_prompts(tokenizer, [{"id": p.id, "prompt": p.prompt} for p in problems])
    G = cfg.samples_per_prompt
    reqs = [r for g, ids in enumerate(p_ids) for r in group_requests(cfg, step, g, ids, round_=round_)]
    samples = engine.generate(reqs, max_tokens=cfg.max_tokens, top_k=top_k)
    return [Group(prob, p_ids[g], samples[g * G:(g + 1) * G],
                  [task.reward(s.text, prob.answer) for s in samples[g * G:(g + 1) * G]])
            for g, prob in enumerate(problems)]


def select_groups(cfg, draw) -> tuple[list[Group], dict]:
    """DAPO dynamic sampling: `draw(round)` -> groups; keep informative ones until `prompts_per_step`, at most
    `max_rounds` rounds, then fill with dropped ones. Without dynamic sampling: round 0 as it comes."""
    from mismatch_lab.rl.recipes import informative

    if not cfg.dynamic_sampling:
        return draw(0), {}
    kept, dropped, rounds = [], [], 0
    while len(kept) < cfg.prompts_per_step and rounds < cfg.max_rounds:
        for g in draw(rounds):
            (kept if informative(g.rewards) and len(kept) < cfg.prompts_per_step else dropped).append(g)
        rounds += 1
    refill = cfg.prompts_per_step - len(kept)
    metrics = {"dynamic_sampling/rounds/count": float(rounds),
               "dynamic_sampling/groups_dropped/count": float(sum(not informative(g.rewards) for g in dropped)),
               "dynamic_sampling/groups_refilled/count": float(refill)}
    return kept + dropped[:refill], metrics


def shaped_rewards(cfg, group: Group) -> list[float]:
    """Task rewards plus the soft overlong punishment (off when overlong_cache = 0)."""
    from mismatch_lab.rl.recipes import overlong_penalty

    max_len = cfg.overlong_max or cfg.max_tokens
    return [r + overlong_penalty(len(s.token_ids), max_len, cfg.overlong_cache) for s, r in zip(group.samples, group.rewards)]


def rollout_batch(cfg, engine, tokenizer, task, step: int, *, top_k: int) -> Batch:
    """The step's groups (dynamic sampling if asked) as a Batch: shaped rewards, group advantages, μ, mask."""
    groups, metrics = select_groups(cfg, lambda r: sample_groups(cfg, engine, tokenizer, task, step, top_k=top_k,
                                                                 round_=r))
    G = cfg.samples_per_prompt
    samples = [s for g in groups for s in g.samples]
    rows = [seq_row(cfg, step, slot, s, g.problem.id, len(g.prompt_ids)) for slot, g in enumerate(groups) for s in range(G)]
    rewards = [r for g in groups for r in shaped_rewards(cfg, g)]
    task_rewards = [r for g in groups for r in g.rewards]
    if cfg.overlong_cache:
        metrics["overlong/penalty/mean"] = sum(r - t for r, t in zip(rewards, task_rewards)) / len(rewards)
    batch = make_batch(samples, rows, [g.prompt_ids for g in groups for _ in range(G)], rewards, group_size=G,
                       normalize_std=cfg.normalize_std, leave_one_out=cfg.leave_one_out, rollout_metrics=metrics)
    batch.task_rewards = task_rewards
    return batch


# --------------------------------------------------------------------------------------- score and update
def score_minibatch(model, batch: Batch, sl: slice, *, trainer_dtype: str, topk: bool):
    """(logp [b, T_m] with gradients, entropy [b, T_m], TopK or None) of the sequences in `sl`."""
    from mismatch_lab.rl.loop import response_logps
    from mismatch_lab.rl.losses import TopK

    samples = batch.samples[sl]
    tk_ids = [s.topk_ids for s in samples] if topk else None
    lp, ent, tk_lp, tk_valid = response_logps(model, batch.prompt_ids[sl], [s.token_ids for s in samples], tk_ids,
                                              trainer_dtype=trainer_dtype)
    if not topk:
        return lp, ent, None
    K = tk_lp.shape[-1]
    tk_mu = pad([[row + [0.0] * (K - len(row)) for row in s.topk_logps] for s in samples], [0.0] * K, torch.float32)
    return lp, ent, TopK(anchor_logps=tk_mu.nan_to_num(0.0), logps=tk_lp, valid=tk_valid)


def update(model, optimizer, loss, max_grad_norm: float) -> float:
    """backward -> clip -> optimizer step; returns the gradient norm before clipping."""
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    gn = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    return float(gn)


@dataclass
class Scored:
    """What train_on_batch leaves: π before each mini-batch's update (what the loss saw), entropy, the
    mini-batches' loss metrics and gradient norms."""

    logp_before: torch.Tensor
    entropy: torch.Tensor
    minibatch_metrics: list[dict]
    grad_norms: list[float]


def train_on_batch(model, optimizer, batch: Batch, cfg, loss_cfg, *, topk: bool, times: dict) -> Scored:
    """Score and update once per mini-batch (each its own optimizer step with its own divisor)."""
    from mismatch_lab.rl.losses import policy_loss

    n = len(batch.samples)
    mb = n // cfg.minibatches
    out = Scored(torch.zeros_like(batch.logp_mu), torch.zeros_like(batch.logp_mu), [], [])
    for m in range(cfg.minibatches):
        sl = slice(m * mb, (m + 1) * mb)
        T_m = max((len(r) for r in batch.responses[sl]), default=0)
        with timed(times, "score"):
            lp, ent, tk = score_minibatch(model, batch, sl, trainer_dtype=cfg.trainer_dtype, topk=topk)
            out.logp_before[sl, :T_m] = lp.detach()
            out.entropy[sl, :T_m] = ent
            with timed(times, "loss"):  # policy_loss forward only (inside time/score): the objective's own cost
                loss, lm = policy_loss(cfg.loss, lp, batch.logp_mu[sl, :T_m], batch.adv[sl], batch.mask[sl, :T_m],
                                       cfg=loss_cfg, topk=tk, logp_old=lp.detach() if cfg.anchor == "old" else None)
                if cfg.framework_preset() is not None:  # train --preset <framework>/<name>: its own loss
                    from mismatch_lab.rl.loop import framework_loss

                    loss, lm = framework_loss(cfg.framework_preset(), lp, batch.logp_mu[sl, :T_m], batch.adv[sl],
                                              batch.mask[sl, :T_m], lm)
        with timed(times, "update"):
            out.grad_norms.append(update(model, optimizer, loss, cfg.max_grad_norm))
        lm["sequences/valid/count"] = float(batch.mask[sl].any(-1).sum())
        out.minibatch_metrics.append(lm)
    return out


def rescore(model, batch: Batch, logp_before: torch.Tensor, *, trainer_dtype: str, delta: float) -> dict:
    """No-grad π after the update: bad_update/* against μ, bad_update_vs_pi/* against π before it."""
    from mismatch_lab.rl.loop import response_logps
    from mismatch_lab.rl.losses import bad_update_metrics

    with torch.no_grad():
        lp_after, _, _, _ = response_logps(model, batch.prompt_ids, batch.responses, trainer_dtype=trainer_dtype)
    T = batch.logp_mu.shape[1]
    bad = bad_update_metrics(lp_after[:, :T], batch.logp_mu, batch.adv, batch.mask, delta=delta)
    bad_pi = bad_update_metrics(lp_after[:, :T], logp_before, batch.adv, batch.mask, delta=delta)
    return bad | {k.replace("bad_update/", "bad_update_vs_pi/"): v for k, v in bad_pi.items()}


def weight_rounding_metrics(model, batch: Batch, kind: str, cache: dict | None = None) -> dict[str, float]:
    """mismatch/weight_rounding/abs_dlogp/{mean,max}: |log π_rounded − log π| over the batch's response tokens,
    where π is the (fp32) trainer on its current weights and π_rounded the same weights rounded to `kind`
    (`engines.weights.round_state`: bf16, fp16, fp8) computed in fp32: the weight rounding alone, the scorer
    'hf:fp32-w<kind>' of `collect`. No gradients. `cache` keeps the fp32 copy that receives the rounded
    weights between steps (key 'split_model')."""
    import copy

    from mismatch_lab.engines.weights import round_state
    from mismatch_lab.rl.loop import response_logps

    cache = {} if cache is None else cache
    with torch.no_grad():
        rounded = cache.get("split_model")
        if rounded is None:
            rounded = cache["split_model"] = copy.deepcopy(model).float().eval()
        rounded.load_state_dict(round_state(model.state_dict(), kind))
        lp = response_logps(model, batch.prompt_ids, batch.responses, trainer_dtype="fp32")[0]
        lp_r = response_logps(rounded, batch.prompt_ids, batch.responses, trainer_dtype="fp32")[0]
    T = batch.mask.shape[1]
    d = (lp_r[:, :T] - lp[:, :T]).abs()[batch.mask.bool()]
    return {"mismatch/weight_rounding/abs_dlogp/mean": float(d.mean()) if d.numel() else 0.0,
            "mismatch/weight_rounding/abs_dlogp/max": float(d.max()) if d.numel() else 0.0}


def sync_weights(engine, model, transform=None) -> None:
    """Push the trainer's weights into the rollout engine (through `transform`, e.g. fp8 rounding)."""
    push_state(engine, model.state_dict(), transform)


def push_state(engine, state: dict, transform=None) -> None:
    """Push a state dict (the trainer's, or a kept copy of an earlier update) into the rollout engine."""
    engine.load_state_dict(transform(state) if transform is not None else state)


# ----------------------------------------------------------------------------------------------- metrics
# the count each per-mini-batch mean averages over (anything else ending in /mean or /frac: response tokens)
_OVER_NONZERO_ADV = ("mask/nonzero_adv/frac", "mask/negative_adv/frac", "mask/positive_adv/frac")
_OVER_SEQUENCES = ("correction/seqs_masked/frac",)
# one value per optimizer step (the loss) or not decomposable into sums (ESS): the mean over mini-batches
_PER_MINIBATCH = ("loss/value", "correction/ess", "weight/ess")


def _count_of(name: str) -> str:
    if name in _OVER_NONZERO_ADV:
        return "tokens/nonzero_adv/count"
    if name in _OVER_SEQUENCES:
        return "sequences/valid/count"
    return "tokens/valid/count"


def reduce_minibatches(per_mb: list[dict]) -> dict[str, float]:
    """Mini-batch metrics into one row, exactly: /max -> max, /min -> min, /count -> sum, a mean or share ->
    Σ (mean_i · count_i) / Σ count_i (= total sum / total count), `_PER_MINIBATCH` -> mean over mini-batches."""
    out = {}
    for k in per_mb[0]:
        vals = [m[k] for m in per_mb if k in m]
        if k.endswith("/max"):
            out[k] = max(vals)
        elif k.endswith("/min"):
            out[k] = min(vals)
        elif k.endswith("/count"):
            out[k] = float(sum(vals))
        elif k in _PER_MINIBATCH:
            out[k] = sum(vals) / len(vals)
        else:
            counts = [m[_count_of(k)] for m in per_mb if k in m]
            total = sum(counts)
            out[k] = sum(v * c for v, c in zip(vals, counts) if c) / total if total else 0.0
    return out


def step_metrics(batch: Batch, scored: Scored, bad: dict, times: dict, *, lr: float) -> dict[str, float]:
    """The step's metric row (pure): loss metrics reduced over mini-batches, advantages, rollout, rewards,
    response lengths, entropy, gradient norms, bad updates and times."""
    n = len(batch.samples)
    maskf = batch.mask.float()
    n_tok = float(maskf.sum())
    metrics = reduce_minibatches(scored.minibatch_metrics) | batch.adv_metrics | batch.rollout_metrics
    metrics.update({
        "reward/accuracy/mean": sum(r == 1.0 for r in (batch.task_rewards or batch.rewards)) / n,
        "response/length/mean": n_tok / n,
        "response/length/max": float(max(len(r) for r in batch.responses)),
        "response/truncated/frac": sum(s.finish_reason == "length" for s in batch.samples) / n,
        "entropy/mean": float((scored.entropy * maskf).sum() / max(n_tok, 1.0)),
        "grad/norm/value": sum(scored.grad_norms) / len(scored.grad_norms),
        "grad/norm/max": max(scored.grad_norms),
        "lr/value": lr,
    })
    return metrics | bad | times


def write_step(writer, run_id: str, step: int, batch: Batch, scored: Scored, metrics: dict, *, scorer: str,
               texts, seconds: float, policy_lag: int | None = None) -> None:
    """The step's sequences / tokens / scores (the Recorder's row builder; scorer 'hf:<dtype>' = π before the
    update; `policy_lag` on every sequence when given) and its metrics in ONE write_chunk call with chunk = step:
    in the store entirely or not at all."""
    import numpy as np

    from mismatch_lab.record.tables import step_tables
    from mismatch_lab.rl.loop import step_arrays

    arrays = step_arrays(batch.samples, batch.seq_rows, batch.logp_mu, scored.logp_before, scored.entropy, batch.mask,
                         batch.adv, batch.rewards)
    if policy_lag is not None:
        arrays.sequence_columns["policy_lag"] = [int(policy_lag)] * len(batch.seq_rows)
    tables = step_tables(run_id, step, np.array([r["seq_id"] for r in batch.seq_rows], dtype=np.int64), arrays,
                         scorer, texts=texts)
    writer.write_chunk(run_id, step, sequences=tables["sequences"], tokens=tables["tokens"], scores=tables["scores"],
                       seconds=seconds, metrics=[(step, k, float(v)) for k, v in sorted(metrics.items())])
