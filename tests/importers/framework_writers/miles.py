"""Write miles `--dump-details DIR` train dumps exactly as miles writes them.

Follows radixark/miles at commit 31f1ca961a94cb860cec3b2dea34ec332bfa8f76:
* `miles/utils/train_dump_utils.py` `save_debug_train_data_for_rank`: per rank,
  `torch.save(dict(rollout_id=, rank=, rollout_data=, cp_rank=, cp_size=, qkv_format=), path)` at
  `DIR/train_data/{rollout_id}_{rank}.pt` (the template `miles/utils/arguments.py` sets for --dump-details);
* `miles/backends/training_utils/data.py` `get_rollout_data`: `rollout_data` is the rank's data-parallel
  share as per-sample lists (`tokens` LongTensor, `loss_masks` IntTensor, `rollout_log_probs` float32
  tensors, `rewards`, `response_lengths`, `total_lengths`, `sample_indices`, batch-global `raw_reward`);
  `log_probs` / `advantages` / `returns` are added by the actor (`compute_log_prob`, on the last pipeline
  stage only); tensor-parallel peers hold copies (`miles/dashboard/dump_reader.py` joins them); with
  context parallelism every per-token field but loss_masks is the rank's `slice_log_prob_with_cp` slice
  (`miles/backends/training_utils/cp_utils.py`, copied below for qkv_format "thd").
The tensors live on the GPU when miles saves them; here on the CPU (the importer loads with
map_location="cpu" either way). miles writes 0.0 into masked rollout log-prob slots.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


def rollout_samples(seed: int, n: int = 6) -> list[dict]:
    """n samples of one rollout: prompt + response tokens, loss mask with a hole (0.0 placeholders in
    rollout_log_probs there), a NaN rollout log-prob, trainer log-probs and advantages."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        P, R = int(rng.integers(2, 6)), int(rng.integers(3, 9))
        mask = np.ones(R, dtype=np.int32)
        mu = np.log(rng.uniform(0.05, 1.0, R)).astype(np.float32)
        if i == 1:
            mask[1] = 0
            mu[1] = 0.0  # miles' placeholder in a masked slot
        if i == 2:
            mu[-1] = np.nan
        pi = np.minimum(mu + rng.normal(0, 0.05, R), 0).astype(np.float32)
        out.append({"sample_index": 10 * seed + i, "tokens": rng.integers(1, 50_000, P + R), "loss_mask": mask,
                    "mu": mu, "pi": pi, "adv": np.full(R, rng.normal(), dtype=np.float32),
                    "reward": float(rng.integers(0, 2)), "P": P, "R": R})
    return out


def _offsets(total_length: int, response_length: int, cp_rank: int, cp_size: int, max_seq_len: int | None = None) -> tuple:
    """miles `get_logits_and_tokens_offset_with_cp`: the two logit ranges of a cp rank (qkv_format "thd" when
    max_seq_len is None, else "bshd")."""
    prompt_length = total_length - response_length
    chunk_size = ((total_length if max_seq_len is None else max_seq_len) + 2 * cp_size - 1) // (2 * cp_size)
    chunk_0 = (cp_rank * chunk_size, (cp_rank + 1) * chunk_size)
    chunk_1 = ((2 * cp_size - cp_rank - 1) * chunk_size, (2 * cp_size - cp_rank) * chunk_size)
    logits_0 = (max(chunk_0[0], prompt_length - 1), min(chunk_0[1], total_length - 1))
    logits_1 = (max(chunk_1[0], prompt_length - 1), min(chunk_1[1], total_length - 1))
    if not logits_0[0] < logits_0[1]:
        logits_0 = (0, 0)
    if not logits_1[0] < logits_1[1]:
        logits_1 = (0, 0)
    return logits_0, logits_1


def slice_log_prob_with_cp(log_prob: torch.Tensor, total_length: int, response_length: int, cp_rank: int,
                           cp_size: int, max_token_len: int | None = None) -> torch.Tensor:
    """miles `slice_log_prob_with_cp` (miles/backends/training_utils/cp_utils.py) for one cp rank."""
    assert len(log_prob) == response_length
    if cp_size == 1:
        return log_prob
    prompt_length = total_length - response_length
    logits_offset = _offsets(total_length, response_length, cp_rank, cp_size, max_token_len)
    chunk_1 = log_prob[logits_offset[0][0] - (prompt_length - 1): logits_offset[0][1] - (prompt_length - 1)]
    chunk_2 = log_prob[logits_offset[1][0] - (prompt_length - 1): logits_offset[1][1] - (prompt_length - 1)]
    return torch.cat([chunk_1, chunk_2], dim=0)


def write_rollout(dump_dir: Path, rollout_id: int, samples: list[dict], *, dp: int = 2, pp: int = 2, tp: int = 1,
                  cp_size: int = 1, qkv_format: str = "thd") -> list[Path]:
    """One file per rank (rank = ((dp_rank * pp + pp_stage) * cp_size + cp_rank) * tp + tp_rank): the dp_rank's
    share of the samples, log_probs / advantages only on the last pipeline stage, per-token fields (all but
    loss_masks) the cp rank's slice. qkv_format "bshd": slices of the padded length `max_seq_lens` (the longest
    sample rounded up to 8, as get_rollout_data pads)."""
    paths = []
    longest = max(s["P"] + s["R"] for s in samples)
    max_seq_len = None if qkv_format == "thd" else (longest + 7) // 8 * 8
    for rank in range(dp * pp * cp_size * tp):
        dp_rank, stage = rank // (pp * cp_size * tp), (rank // (cp_size * tp)) % pp
        cp_rank = (rank // tp) % cp_size
        share = samples[dp_rank::dp]

        def cp(key, share=share, cp_rank=cp_rank):
            return [slice_log_prob_with_cp(torch.tensor(s[key]), s["P"] + s["R"], s["R"], cp_rank, cp_size, max_seq_len)
                    for s in share]

        data = {"tokens": [torch.tensor(s["tokens"], dtype=torch.long) for s in share],
                "loss_masks": [torch.tensor(s["loss_mask"], dtype=torch.int) for s in share],
                "rollout_log_probs": cp("mu"),
                "rewards": [s["reward"] for s in share], "raw_reward": [s["reward"] for s in samples],
                "response_lengths": [s["R"] for s in share], "total_lengths": [s["P"] + s["R"] for s in share],
                "sample_indices": [s["sample_index"] for s in share]}
        if max_seq_len is not None:
            data["max_seq_lens"] = [max_seq_len] * len(share)
        if stage == pp - 1:
            data["log_probs"] = cp("pi")
            data["advantages"] = cp("adv")
            data["returns"] = cp("adv")
        path = dump_dir / "train_data" / f"{rollout_id}_{rank}.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"rollout_id": rollout_id, "rank": rank, "rollout_data": data, "cp_rank": cp_rank,
                    "cp_size": cp_size, "qkv_format": qkv_format}, path)
        paths.append(path)
    return paths


def naive(samples: list[dict], step: int) -> list[dict]:
    """Per stored sample (in sample_index order) by a plain loop over the loss mask."""
    out = []
    for s in sorted(samples, key=lambda s: s["sample_index"]):
        keep = [t for t in range(s["R"]) if s["loss_mask"][t]]
        out.append({"step": step, "pos": [t - keep[0] for t in keep], "prompt_len": s["P"],
                    "token_id": [int(s["tokens"][s["P"] + t]) for t in keep], "reward": s["reward"],
                    "mu": [float(s["mu"][t]) for t in keep], "pi": [float(s["pi"][t]) for t in keep],
                    "adv": [float(s["adv"][t]) for t in keep]})
    return out
