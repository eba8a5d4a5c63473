"""Write NeMo-RL `train_data_step{N}.jsonl` files exactly as NeMo-RL writes them.

Follows NVIDIA-NeMo/RL at commit 7ea279abfbeb698b092856d0dab61e7cf39bc909:
* `nemo_rl/algorithms/grpo.py` ("Log training data"): `log_data` holds `content`, `rewards`,
  `input_lengths`, `token_ids`, `token_loss_mask`, `sample_loss_mask`, `advantages`,
  `generation_logprobs`, `prev_logprobs`, each a `.tolist()` of a [B] or [B, T_pad] tensor (right padded
  to the batch's longest sample; padding: token id `pad_id`, mask 0, log-probs 0.0); the old form
  (commits 0fae6bc24 .. f11f99c79^) holds `content`, `rewards`, `generation_logprobs`, `prev_logprobs`, `input_lengths`.
* `nemo_rl/utils/logger.py` `Logger.log_batched_dict_as_jsonl`: one line per `make_microbatch_iterator(1)`
  slice, i.e. every value `v[i:i + 1]`, `json.dumps({**sample, "idx": i}, default=str)` (non-finite floats
  as NaN / Infinity), written into the log dir (here an `exp_NNN` folder, `get_next_experiment_dir`).
Values are float32 (the tensors' dtype), written as Python floats.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

NEW_FIELDS = ("token_ids", "token_loss_mask", "sample_loss_mask", "advantages", "generation_logprobs", "prev_logprobs")


def step_batch(seed: int, n: int = 6, *, prompt=(3, 9), response=(2, 12), pad_id: int = 0, edge: bool = True) -> dict:
    """One step's `log_data` (new form) as NeMo-RL builds it, as Python lists. With `edge`: NaN and
    Infinity log-probs at response positions, a response token of log mu exactly 0.0, and a sample whose
    sample_loss_mask is 0."""
    rng = np.random.default_rng(seed)
    P = rng.integers(*prompt, size=n)
    R = rng.integers(*response, size=n)
    L = P + R
    T = int(L.max())
    ids = np.full((n, T), pad_id, dtype=np.int64)
    tmask = np.zeros((n, T), dtype=np.int64)  # token_loss_mask: torch.ones_like(token_ids)
    mu = np.zeros((n, T), dtype=np.float32)
    pi = np.zeros((n, T), dtype=np.float32)
    adv = np.zeros((n, T), dtype=np.float32)
    rewards = rng.integers(0, 2, size=n).astype(np.float32)
    for i in range(n):
        ids[i, : L[i]] = rng.integers(1, 50_000, size=L[i])
        tmask[i, P[i]: L[i]] = 1
        lp = np.log(rng.uniform(0.02, 1.0, size=R[i])).astype(np.float32)
        mu[i, P[i]: L[i]] = lp
        pi[i, 1: L[i]] = np.log(rng.uniform(0.02, 1.0, size=L[i] - 1)).astype(np.float32)  # trainer scores the prompt too
        pi[i, P[i]: L[i]] = (lp + rng.normal(0, 0.05, size=R[i])).clip(max=0).astype(np.float32)
        adv[i, : L[i]] = np.float32(rewards[i] - rewards.mean())
    smask = np.ones(n, dtype=np.float32)
    if edge:
        mu[0, P[0]] = np.nan
        pi[1, P[1] + 1] = -np.inf
        mu[2, P[2]] = 0.0  # a token of probability 1
        pi[2, P[2]] = 0.0
        smask[3] = 0.0
    return {"content": [[f"prompt {i}", f"response {i}"] for i in range(n)], "rewards": rewards.tolist(),
            "input_lengths": L.tolist(), "token_ids": ids.tolist(), "token_loss_mask": tmask.tolist(),
            "sample_loss_mask": smask.tolist(), "advantages": adv.tolist(), "generation_logprobs": mu.tolist(),
            "prev_logprobs": pi.tolist()}


def old_form(batch: dict) -> dict:
    """The same step as the old writer logged it (commit 0fae6bc24): content, rewards, generation_logprobs,
    prev_logprobs, input_lengths."""
    return {k: batch[k] for k in ("content", "rewards", "generation_logprobs", "prev_logprobs", "input_lengths")}


def log_batched_dict_as_jsonl(to_log: dict, filepath: Path) -> Path:
    """NeMo-RL's Logger.log_batched_dict_as_jsonl on a dict of lists: one line per batch-of-one slice."""
    filepath.parent.mkdir(parents=True, exist_ok=True)
    size = len(next(iter(to_log.values())))
    with open(filepath, "w") as f:
        for i in range(size):
            sample = {k: v[i: i + 1] for k, v in to_log.items()}
            f.write(json.dumps({**sample, "idx": i}, default=str) + "\n")
    return filepath


def write_log_dir(log_dir: Path, steps: dict[str, list[int]], seed: int = 0, old: bool = False) -> dict[Path, dict]:
    """`steps`: exp folder name -> its steps. Writes LOG_DIR/<exp>/train_data_step<N>.jsonl; returns
    file -> the log_data written (new form; `old`: the old form's fields only)."""
    out = {}
    for k, (exp, numbers) in enumerate(sorted(steps.items())):
        for n in numbers:
            batch = step_batch(seed + 100 * k + n)
            data = old_form(batch) if old else batch
            out[log_batched_dict_as_jsonl(data, log_dir / exp / f"train_data_step{n}.jsonl")] = data
    return out


def naive(data: dict, step: int, old: bool = False) -> list[dict]:
    """Per stored sample, by a plain loop over the written arrays: positions, ids, log mu, log pi, advantages.
    New form: token_loss_mask * sample_loss_mask, position 0 never. Old form: from the first non-zero
    generation log-prob to input_lengths."""
    out = []
    for i in range(len(data["input_lengths"])):
        mu, pi, n = data["generation_logprobs"][i], data["prev_logprobs"][i], data["input_lengths"][i]
        if old:
            first = next((t for t in range(1, n) if mu[t] != 0.0), None)
            keep = [] if first is None else list(range(first, n))
        else:
            keep = [t for t in range(1, n) if data["token_loss_mask"][i][t] and data["sample_loss_mask"][i]]
        if not keep:
            continue
        out.append({"step": step, "pos": [t - keep[0] for t in keep], "prompt_len": keep[0],
                    "token_id": None if old else [data["token_ids"][i][t] for t in keep],
                    "mu": [mu[t] for t in keep], "pi": [pi[t] for t in keep], "reward": data["rewards"][i],
                    "adv": None if old else [data["advantages"][i][t] for t in keep]})
    return out
