"""Write SkyRL `global_step_<N>_training_input.pkl` dumps exactly as SkyRL writes them.

Follows NovaSky-AI/SkyRL at commit a9564572eb8e91076be43c1bd5e4615e3de17265:
* `skyrl/backends/skyrl_train/training_batch.py`: `_serialize_tensor` (numpy bytes, or `torch.save` bytes for
  bfloat16), `TensorBatch.__reduce__` -> `(_rebuild_tensor_batch, (type(self), self.__getstate__()))`,
  `__getstate__` -> {"batch_dict", "batch_size", "device", "metadata"}, `TensorBatch.save` = `pickle.dump`;
  `pad_training_input_batch`: `pad_size` copies of row 0, loss_mask rows zero, metadata["pad_size"];
  the legacy form (before c7348d079, 2026-03-24) without `__reduce__`: the dict subclass pickled with its
  items (the tensors) and the same state;
* `skyrl/train/dataset/preprocess.py` `convert_prompts_responses_to_batch_tensors`: sequences left padded
  as one block, response-level tensors right aligned in [B, max_response];
* `skyrl/train/trainer.py` `dump_data`: `{export_path}/dumped_data/{file_name}.pkl` after `rewards` and the
  metadata's `uids` were popped.
SkyRL is not installed here: its module `skyrl.backends.skyrl_train.training_batch` is stood in for while
pickling (the pickle then names SkyRL's own classes, as a real dump does) and removed afterwards.
"""

from __future__ import annotations

import io
import pickle
import sys
import types
from pathlib import Path

import numpy as np
import torch

MODULE = "skyrl.backends.skyrl_train.training_batch"


def _serialize_tensor(value: torch.Tensor) -> dict:
    try:
        arr = value.numpy()
        return {"format": "numpy", "data": arr.tobytes(), "shape": arr.shape, "dtype": str(arr.dtype)}
    except TypeError:
        buffer = io.BytesIO()
        torch.save(value, buffer)
        return {"format": "torch", "data": buffer.getvalue()}


def _module(legacy: bool) -> types.ModuleType:
    mod = types.ModuleType(MODULE)

    def _rebuild_tensor_batch(cls, state):
        raise AssertionError("only for pickling")

    class TensorBatch(dict):
        metadata = None

        def __getstate__(self):
            batch_dict = {k: None if v is None else _serialize_tensor(v.contiguous()) for k, v in self.items()}
            return {"batch_dict": batch_dict, "batch_size": self._batch_size, "device": self._device,
                    "metadata": self.metadata}

        if not legacy:
            def __reduce__(self):
                return (_rebuild_tensor_batch, (type(self), self.__getstate__()))

    class TrainingInputBatch(TensorBatch):
        pass

    for obj in (_rebuild_tensor_batch, TensorBatch, TrainingInputBatch):
        obj.__module__ = MODULE
        obj.__qualname__ = obj.__name__
        setattr(mod, obj.__name__, obj)
    return mod


def save(fields: dict, metadata: dict, path: Path, legacy: bool = False) -> Path:
    """pickle.dump of a TrainingInputBatch holding `fields` (tensors or None) and `metadata`."""
    names = ["skyrl", "skyrl.backends", "skyrl.backends.skyrl_train", MODULE]
    saved = {n: sys.modules.get(n) for n in names}
    try:
        for n in names[:-1]:
            sys.modules[n] = types.ModuleType(n)
        mod = sys.modules[MODULE] = _module(legacy)
        batch = mod.TrainingInputBatch(fields)
        batch._batch_size, batch._device = len(fields["sequences"]), torch.device("cpu")
        batch.metadata = metadata
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            pickle.dump(batch, f)
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m
    return path


def step_fields(seed: int, n: int = 5, pad_size: int = 2, *, pad_id: int = 0, bf16_pi: bool = False) -> tuple[dict, dict]:
    """One step's TrainingInputBatch fields (as convert_prompts_responses_to_batch_tensors lays them out, then
    the forward passes and advantages, then pad_training_input_batch) and its metadata. Edge cases: a
    tool-output hole in one loss mask, a NaN rollout log-prob, a -inf trainer log-prob."""
    rng = np.random.default_rng(seed)
    P, R = rng.integers(2, 7, size=n), rng.integers(2, 9, size=n)
    max_total, max_resp = int((P + R).max()), int(R.max())
    seqs = np.full((n, max_total), pad_id, dtype=np.int64)
    attn = np.zeros((n, max_total), dtype=np.int64)
    resp = np.zeros((n, max_resp), dtype=np.int64)
    loss = np.zeros((n, max_resp), dtype=np.float32)
    mu = np.zeros((n, max_resp), dtype=np.float32)
    pi = np.zeros((n, max_resp), dtype=np.float32)
    adv = np.zeros((n, max_resp), dtype=np.float32)
    for i in range(n):
        start = max_total - P[i] - R[i]
        seqs[i, start:] = rng.integers(1, 50_000, size=P[i] + R[i])
        attn[i, start:] = 1
        resp[i, max_resp - R[i]:] = 1
        loss[i, max_resp - R[i]:] = 1
        mu[i, max_resp - R[i]:] = np.log(rng.uniform(0.05, 1.0, size=R[i]))
        pi[i] = np.where(resp[i] > 0, np.minimum(mu[i] + rng.normal(0, 0.05, size=max_resp), 0), 0)
        adv[i] = np.where(resp[i] > 0, rng.normal(), 0)
    loss[1, max_resp - R[1] + 1] = 0  # tool output inside the response
    mu[0, -1] = np.nan
    pi[2, -1] = -np.inf
    fields = {"sequences": seqs, "attention_mask": attn, "response_mask": resp, "loss_mask": loss,
              "rollout_logprobs": mu, "action_log_probs": pi, "base_action_log_probs": pi.copy(), "values": None,
              "advantages": adv, "returns": adv.copy(), "rollout_expert_indices": None}
    if pad_size:  # pad_training_input_batch: copies of row 0, loss_mask zero
        fields = {k: None if v is None else np.concatenate([v, np.zeros_like(v[:pad_size]) if k == "loss_mask"
                                                            else np.repeat(v[:1], pad_size, axis=0)])
                  for k, v in fields.items()}
    tensors = {k: None if v is None else torch.from_numpy(v) for k, v in fields.items()}
    if bf16_pi:
        tensors["action_log_probs"] = tensors["action_log_probs"].to(torch.bfloat16)
    meta = {"response_length": max_resp, "avg_response_length": float(R.mean()), "pad_size": pad_size}
    return tensors, meta


def naive(fields: dict, step: int) -> list[dict]:
    """Per stored sample by a plain loop: loss_mask > 0 and response_mask > 0 over the response columns."""
    seqs = fields["sequences"].numpy()
    loss, resp = fields["loss_mask"].numpy(), fields["response_mask"].numpy()
    mu = fields["rollout_logprobs"].double().numpy()
    pi = fields["action_log_probs"].double().numpy()
    adv = fields["advantages"].double().numpy()
    B, R = loss.shape
    out = []
    for i in range(B):
        keep = [c for c in range(R) if loss[i, c] > 0 and resp[i, c] > 0]
        if not keep:
            continue
        out.append({"step": step, "pos": [c - keep[0] for c in keep],
                    "token_id": [int(seqs[i, seqs.shape[1] - R + c]) for c in keep],
                    "prompt_len": int(fields["attention_mask"][i].sum() - resp[i].sum()),
                    "mu": [float(mu[i, c]) for c in keep], "pi": [float(pi[i, c]) for c in keep],
                    "adv": [float(adv[i, c]) for c in keep]})
    return out
