"""Live mismatch metrics of one training step, for the loop's own logger (W&B, TensorBoard, MLflow, ...).

    from mismatch_lab.record.live import step_metrics

    logs = step_metrics(logp_rollout, logp_trainer, mask)       # [B, T] arrays -> {name: float}
    wandb.log(logs, step=step)

Pure numpy (torch tensors are read through `numpy()`; no torch import here). `Recorder.last_metrics` is
the same dict for the tokens its last `log_step` call stored, and the TRL integration logs it through
TRL's own `log` (docs/record.md, "Live metrics").

Rows: the stored positions (`mask` true) whose log μ and log π are both finite and whose r = π/μ does not
overflow a double -- the finite rows of `analysis.definitions` (`finite_sql`), so a step's numbers equal
what `analyze` reports for the step's tokens. Non-finite rows are counted, never zeroed. With no finite
row, only the counts are returned (no mean of nothing, no verdict).

Our names (slash paths ending in the reduction, as `train_metrics`):
    mismatch/tokens/count          finite stored tokens (the denominator of every token mean)
    mismatch/nonfinite/count       stored tokens left out as non-finite
    mismatch/abs_dp/mean           mean |π − μ| (probability space)
    mismatch/abs_dlogp/mean        mean |log π − log μ| (nats)
    mismatch/k3/mean               mean k3 = r − log r − 1 (token estimate of KL(μ || π), nats)
    mismatch/seq_abs_dlogp/mean    mean over sequences of each sequence's mean |log π − log μ|
    mismatch/verdict/<check>       the doctor's verdict of that step against a published band
                                   (LIVE_CHECKS), coded VERDICT_CODES: 0 ok, 1 warn, 2 fail

The frameworks' own metrics beside them, under `<framework>/<the name it logs>`, with ITS definition
(each read in the framework's source at the commit named; the finite-row rule above applies to all):
    verl/training/rollout_probs_diff_mean   mean |π − μ| over the response-mask tokens: torch.mean of
        masked_select(|exp(old_log_probs) − exp(rollout_log_probs)|) (volcengine/verl @123d7444,
        verl/utils/debug/metrics.py calculate_debug_metrics). Equals mismatch/abs_dp/mean.
    prime-rl/mismatch_kl/all/mean           mean over the trainable tokens (loss_mask) of k3 = r − log r − 1
        with log r = trainer − inference log-prob, the tokens of the step concatenated (PrimeIntellect-ai/
        prime-rl @559b4477, src/prime_rl/trainer/rl/loss.py compute_importance_ratio_and_mismatch_kl,
        src/prime_rl/trainer/rl/train.py `tensors["mismatch_kl/all"]`). Equals mismatch/k3/mean.
    nemo-rl/token_mult_prob_error           masked mean of exp(|log μ − log π|) over the tokens (token_mask ×
        sample_mask), ≥ 1 (NVIDIA-NeMo/RL @7ea279ab, nemo_rl/algorithms/loss/loss_functions.py: lp_error =
        |generation_logprobs − prev_logprobs|; masked_mean(exp(lp_error * mask), mask); logged as
        train/token_mult_prob_error).
    slime/train_rollout_logprob_abs_diff    per sample the mean |log π_old − log μ| over its loss-mask
        tokens, averaged over the samples; a sample with no token adds 0 to the sum and 1 to the count
        (THUDM/slime @624b824a, slime/backends/megatron_utils/loss.py: sum_of_sample_mean(|old_log_probs −
        rollout_log_probs|), cp_utils.py get_sum_of_sample_mean: Σ_i (x_i·m_i).sum() / max(m_i.sum(), 1);
        logged as train/train_rollout_logprob_abs_diff). Here a sample without a finite token adds 0 and
        counts; ours (mismatch/seq_abs_dlogp/mean) averages the sequences that hold a finite token only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mismatch_lab.doctor import bands as B
from mismatch_lab.doctor.bands import Band
from mismatch_lab.doctor.verdicts import VERDICTS, judge
from mismatch_lab.store.schema import MAX_LOG_RATIO

VERDICT_CODES = {v: i for i, v in enumerate(VERDICTS)}
"""How a verdict is logged as a number: ok 0, warn 1, fail 2 (a logger takes numbers only)."""


@dataclass(frozen=True)
class LiveCheck:
    """One per-step verdict: the metric judged and the doctor's band (doctor/bands.py, one definition)."""

    name: str
    metric: str
    band: Band


LIVE_CHECKS = (
    LiveCheck("abs_dp", "mismatch/abs_dp/mean", B.ABS_DP),
    LiveCheck("k3", "mismatch/k3/mean", B.K3_KL),
    LiveCheck("seq_abs_dlogp", "mismatch/seq_abs_dlogp/mean", B.SEQ_ABS_DLOGP),
)
"""The bands judged each step. prime-rl's k3 level is an acceptance criterion over 20 steps and slime's a CI
bound on each step's value; judged here on one step's tokens, a single crossing is a signal to look, not a
verdict on the run (`mismatch-lab doctor` judges the whole run)."""


def verdict_name(check: LiveCheck) -> str:
    return f"mismatch/verdict/{check.name}"


def _numpy(x) -> np.ndarray:
    """A torch tensor (any device) or an array-like as a numpy array, without importing torch."""
    if hasattr(x, "detach") and hasattr(x, "cpu"):
        x = x.detach().cpu()
        if x.dtype.is_floating_point and x.dtype.itemsize < 4:  # bf16 / fp16: numpy has no bf16
            x = x.float()
        return x.numpy()
    return np.asarray(x)


def step_metrics(logp_rollout, logp_trainer, mask) -> dict[str, float]:
    """The live metrics (module docstring) of one step's [B, T] log μ, log π and mask (bool or 0/1)."""
    mask = _numpy(mask).astype(bool)
    if mask.ndim != 2:
        raise ValueError(f"mask must be [B, T], got shape {mask.shape}")
    rows = np.nonzero(mask)[0]
    lmu = _numpy(logp_rollout)[mask]
    lpi = _numpy(logp_trainer)[mask]
    return flat_metrics(lmu, lpi, rows, mask.shape[0])


def flat_metrics(lmu: np.ndarray, lpi: np.ndarray, rows: np.ndarray, n_seqs: int) -> dict[str, float]:
    """`step_metrics` of the stored tokens laid flat: log μ, log π and the sequence (0..n_seqs-1) of each."""
    lmu = np.asarray(lmu, dtype=np.float64)
    lpi = np.asarray(lpi, dtype=np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        dlogp = lpi - lmu
        finite = np.isfinite(lmu) & np.isfinite(lpi) & (dlogp < MAX_LOG_RATIO)
    n = int(finite.sum())
    out = {"mismatch/tokens/count": float(n), "mismatch/nonfinite/count": float(finite.size - n)}
    if n == 0:
        return out
    lmu, lpi, dlogp, rows = lmu[finite], lpi[finite], dlogp[finite], np.asarray(rows)[finite]
    abs_dp = np.abs(np.exp(lpi) - np.exp(lmu))
    abs_dlogp = np.abs(dlogp)
    k3 = np.exp(dlogp) - dlogp - 1.0
    per_seq_n = np.bincount(rows, minlength=n_seqs)
    per_seq_sum = np.bincount(rows, weights=abs_dlogp, minlength=n_seqs)
    has = per_seq_n > 0
    seq_means = per_seq_sum[has] / per_seq_n[has]
    out |= {
        "mismatch/abs_dp/mean": float(abs_dp.mean()),
        "mismatch/abs_dlogp/mean": float(abs_dlogp.mean()),
        "mismatch/k3/mean": float(k3.mean()),
        "mismatch/seq_abs_dlogp/mean": float(seq_means.mean()),
        "verl/training/rollout_probs_diff_mean": float(abs_dp.mean()),
        "prime-rl/mismatch_kl/all/mean": float(k3.mean()),
        "nemo-rl/token_mult_prob_error": float(np.exp(abs_dlogp).mean()),
        "slime/train_rollout_logprob_abs_diff": float(seq_means.sum() / max(n_seqs, 1)),
    }
    for check in LIVE_CHECKS:
        out[verdict_name(check)] = float(VERDICT_CODES[judge(out[check.metric], check.band)])
    return out


def crossed(metrics: dict[str, float]) -> list[tuple[LiveCheck, str, float]]:
    """The checks of `metrics` (a `step_metrics` dict) whose verdict is not ok: (check, verdict, value)."""
    out = []
    for check in LIVE_CHECKS:
        code = metrics.get(verdict_name(check))
        if code:
            out.append((check, VERDICTS[int(code)], metrics[check.metric]))
    return out


def crossing_message(step: int, check: LiveCheck, verdict: str, value: float) -> str:
    """One line naming the step, the metric, its value, the band and where the band comes from."""
    theirs = f" ({check.band.metric} in their logs)" if check.band.metric else ""
    return (f"mismatch_lab: step {step}: {check.metric} = {value:.4g}{theirs} is '{verdict}' against "
            f"{check.band.text} [{check.band.source}]; `mismatch-lab doctor --db STORE` judges the whole run")
