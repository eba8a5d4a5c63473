"""SkyRL's training-batch dumps (`trainer.dump_data_batch=true`):
`{trainer.export_path}/dumped_data/global_step_<N>_training_input.pkl`.

Source of the format (NovaSky-AI/SkyRL, commit a9564572eb8e91076be43c1bd5e4615e3de17265):
* `skyrl/train/trainer.py` `RayPPOTrainer.train` / `dump_data`: after the forward passes and the advantages,
  `TrainingInputBatch.save(path)` = `pickle.dump(batch)` (also `skyrl/train/fully_async_trainer.py`);
  `rewards` and the metadata's `uids` are popped just before;
* `skyrl/backends/skyrl_train/training_batch.py`: `TensorBatch.__reduce__` pickles
  `(_rebuild_tensor_batch, (TrainingInputBatch, state))` with state = {"batch_dict": {key: {"format":
  "numpy", "data": bytes, "shape", "dtype"} or {"format": "torch", "data": torch.save bytes} (bfloat16)
  or None}, "batch_size", "device", "metadata"}; before 2026-03-24 (c7348d079) the dict subclass was
  pickled with its items (tensors) and the same state;
* `skyrl/train/dataset/preprocess.py` `convert_prompts_responses_to_batch_tensors`: `sequences`
  [B, max_total] (prompt + response, left padded), response-level tensors [B, max_response] right
  aligned, so response column c is `sequences[:, -max_response:][:, c]`; `response_mask` marks the
  response, `loss_mask` the trained positions; `pad_training_input_batch` appends copies of row 0 with
  loss_mask 0 (not stored).

The pickle names SkyRL's classes; they are not imported (SkyRL need not be installed): the unpickler
maps `_rebuild_tensor_batch` and the batch classes of `*.training_batch` to stand-ins that keep the
state (`_SkyRLUnpickler`). Loading a pickle can still run any code it names: --trust-pickle is required.

What is read -> where it goes:
    sequences[:, -max_response:]          tokens.token_id
    loss_mask > 0 (and response_mask)      the stored positions
    rollout_logprobs                      tokens.logp_rollout (log mu; the inference engine's)
    action_log_probs                      scores.logp (log pi: the policy's forward before the update,
                                          at the weights that generated the batch), scorer 'skyrl:<dtype>'
    advantages                            tokens.advantage and sequences.advantage (mean)
    attention_mask.sum - response_mask.sum  sequences.prompt_len
    metadata["uids"] (when kept)           sequences.prompt_id
    N of the file name                    sequences.step
    rollout_expert_indices [B, T, layers, k] at column j - 1, where router_padding_mask is false
                                          routing rows of the response token at column j (side 'rollout';
                                          layer = the dump's layer axis; ids as dumped; weights, margin NULL)
Dropped: attention_mask, base_action_log_probs, values, returns, kl, pixel_values, image_grid_thw.

Routing (MoE router replay, `rollout_expert_indices`): `preprocess.py` writes a sample's captured route rows
from its left-pad column on, row j the route of the token at column j (its forward, whose output gives token
j + 1); the columns without a captured route (left padding, the last token, a synthetic EOS) hold
`make_replay_padding_indices_np` rows (arange(k)) and `make_router_padding_mask` marks them true. Those are left
out. The layer axis is vLLM's: every transformer layer, dense ones included (`replay_utils.py`
`patch_topk_router_layer_number`), so `routing.layer` of a SkyRL import is the transformer layer index.
"""

from __future__ import annotations

import io
import pickle
import re
from pathlib import Path

import numpy as np

from mismatch_lab.errors import UserError
from mismatch_lab.extras import TORCH_HINT, missing
from mismatch_lab.importers.base import Discovery, Source
from mismatch_lab.record.arrow import bad_token_ids, describe_bad_ids
from mismatch_lab.record.flat import (
    PROBABILITIES_FIX,
    FlatBatch,
    describe_excess,
    logp_excess,
)

FRAMEWORK = "skyrl"
HELP = "SkyRL trainer.dump_data_batch pickles: <export_path>/dumped_data/global_step_N_training_input.pkl (needs --trust-pickle)"
EXPECTED = ("the pickles of trainer.dump_data_batch: <export_path>/dumped_data/global_step_<N>_training_input.pkl, "
            "given as the export path, its dumped_data folder, or a file")
STEP_FILE = re.compile(r"^global_step_(\d+)_training_input\.pkl$")
BATCH_CLASSES = ("TrainingInputBatch", "TensorBatch", "TrainingOutputBatch")


def add_arguments(parser) -> None:
    parser.add_argument("--trust-pickle", action="store_true",
                        help="load the dumps: they are Python pickles, and loading a pickle can run any code it "
                             "contains; pass this only for files you trust")


def _step(p: Path) -> int:
    return int(STEP_FILE.match(p.name).group(1))


def discover(path: Path, args) -> Discovery:
    if not getattr(args, "trust_pickle", False):
        raise UserError("SkyRL dumps are Python pickles and loading a pickle can run any code it contains: "
                        f"pass --trust-pickle to load the files under {path} if you trust them")
    if missing(("torch",)):  # the light install: the pickles hold torch objects
        raise UserError(f"SkyRL dumps hold torch objects and loading them needs torch, which this install lacks: "
                        f"{TORCH_HINT}")
    if path.is_file():
        if not STEP_FILE.match(path.name):
            raise UserError(f"{path} is not a SkyRL training-batch dump: expected global_step_<N>_training_input.pkl")
        files, folder = [path], path.parent
    else:
        folder = path / "dumped_data" if (path / "dumped_data").is_dir() else path
        files = sorted((p for p in folder.iterdir() if STEP_FILE.match(p.name)), key=_step)
    run_name = folder.parent.name if folder.name == "dumped_data" else folder.name
    return Discovery(sources=[Source(p, step=_step(p)) for p in files], run_name=run_name)


class _Batch(dict):
    """Stand-in for SkyRL's TensorBatch classes: keeps the dict items and the pickled state."""

    def __setstate__(self, state):
        self.state = state


def _rebuild_tensor_batch(cls, state):
    batch = _Batch()
    batch.state = state
    return batch


class _SkyRLUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module.split(".")[0] in ("skyrl", "skyrl_train") and module.endswith("training_batch"):
            if name == "_rebuild_tensor_batch":
                return _rebuild_tensor_batch
            if name in BATCH_CLASSES:
                return _Batch
        return super().find_class(module, name)


def _tensor(value) -> np.ndarray | None:
    """A serialized tensor (SkyRL's `_serialize_tensor` dict) or a tensor, as numpy (floats as float64)."""
    if value is None:
        return None
    if isinstance(value, dict):
        if value.get("format") == "torch":
            import torch

            value = torch.load(io.BytesIO(value["data"]), weights_only=True)
        else:
            return np.frombuffer(value["data"], dtype=np.dtype(value["dtype"])).reshape(value["shape"])
    if hasattr(value, "detach"):
        value = value.detach().cpu()
        value = (value.double() if value.is_floating_point() else value).numpy()
    return np.asarray(value)


def _load(path: Path) -> tuple[dict[str, np.ndarray | None], dict]:
    """(field -> array, metadata) of one dump."""
    try:
        with open(path, "rb") as fh:
            obj = _SkyRLUnpickler(fh).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, ModuleNotFoundError, TypeError,
            ValueError, IndexError, KeyError) as exc:
        raise UserError(f"{path}: cannot be unpickled as a SkyRL training batch ({type(exc).__name__}: {exc})") from exc
    if not isinstance(obj, _Batch):
        raise UserError(f"{path}: not a SkyRL TrainingInputBatch (found {type(obj).__name__})")
    state = getattr(obj, "state", None) or {}
    fields = dict(obj.items())
    fields.update(state.get("batch_dict") or {})
    return {k: _tensor(v) if not (isinstance(v, dict) and v.get("format") == "tensor_list") else None
            for k, v in fields.items()}, state.get("metadata") or {}


def _field(path: Path, f: dict, name: str, shape: tuple[int, int] | None, why: str = "") -> np.ndarray:
    a = f.get(name)
    if a is None:
        raise UserError(f"{path}: field {name!r} is missing{why}")
    if a.ndim != 2 or (shape is not None and a.shape != shape):
        raise UserError(f"{path}: field {name!r} has shape {list(a.shape)}, expected {list(shape) if shape else '[B, T]'} "
                        "(misaligned)")
    return a


def read(src: Source, args):
    path = src.path
    f, meta = _load(path)
    mask = _field(path, f, "loss_mask", None)
    B, R = mask.shape
    mu = _field(path, f, "rollout_logprobs", (B, R),
                " (SkyRL keeps the rollout log-probs when the inference engine returns them: "
                "generator.sampling_params.logprobs; without them there is no log mu to compare)")
    pi = _field(path, f, "action_log_probs", (B, R),
                " (SkyRL skips the policy's forward for losses that use only the rollout log-probs; "
                "without it there is no trainer log pi to compare)")
    seqs = _field(path, f, "sequences", None)
    if seqs.shape[0] != B or seqs.shape[1] < R:
        raise UserError(f"{path}: field 'sequences' has shape {list(seqs.shape)}, expected [{B}, >= {R}] (misaligned)")
    ids = seqs[:, seqs.shape[1] - R:]
    stored = mask > 0
    if f.get("response_mask") is not None:
        stored &= _field(path, f, "response_mask", (B, R)) > 0
    bad = bad_token_ids(ids) & stored
    if bad.any():
        raise UserError(f"{path}: field 'sequences' must hold token ids at loss-mask positions; got "
                        f"{describe_bad_ids(ids, bad)}")
    for name, values in (("rollout_logprobs", mu), ("action_log_probs", pi)):
        excess = logp_excess(values, stored)
        if excess.any():
            raise UserError(f"{path}: field {name!r} has {describe_excess(values, excess)} at loss-mask positions, "
                            f"the first in sample {int(np.argmax(excess.any(axis=1)))}: {PROBABILITIES_FIX}")
    adv = f.get("advantages")
    if adv is not None:
        adv = _field(path, f, "advantages", (B, R))
    prompt_len = None
    if f.get("attention_mask") is not None and f.get("response_mask") is not None:
        prompt_len = f["attention_mask"].sum(axis=1) - f["response_mask"].sum(axis=1)
    routing, routing_mask = _routing(path, f, B, seqs.shape[1], R)
    uids = meta.get("uids")
    yield FlatBatch(
        step=src.step, rank=0, offsets=np.arange(B + 1, dtype=np.int64) * R,
        token_ids=ids.reshape(-1).astype(np.int64), mask=stored.reshape(-1),
        logp_rollout=mu.reshape(-1).astype(np.float64), logp_trainer=pi.reshape(-1).astype(np.float64),
        advantage=None if adv is None else adv.reshape(-1).astype(np.float64),
        prompt_len=prompt_len,
        prompt_id=np.array([str(u) for u in uids], dtype=object) if isinstance(uids, list) and len(uids) == B else None,
        routing=routing, routing_mask=routing_mask,
    )  # fmt: skip


def _routing(path: Path, f: dict, B: int, T: int, R: int) -> tuple[np.ndarray | None, np.ndarray | None]:
    """([B * R, layers, k] routes, [B * R] captured) of the response columns, or (None, None) without
    `rollout_expert_indices`: response column c (sequence column j = T - R + c) takes the route at column j - 1,
    captured where `router_padding_mask` is false there (module docstring)."""
    routes = f.get("rollout_expert_indices")
    if routes is None:
        return None, None
    if routes.ndim != 4 or routes.shape[:2] != (B, T) or routes.dtype.kind not in "iu":
        raise UserError(f"{path}: field 'rollout_expert_indices' has shape {list(routes.shape)} of {routes.dtype}, "
                        f"expected integer [{B}, {T}, layers, k] like 'sequences' (misaligned)")
    padding = f.get("router_padding_mask")
    if padding is None:
        raise UserError(f"{path}: field 'router_padding_mask' is missing beside 'rollout_expert_indices' (SkyRL "
                        "writes both; without it padding routes cannot be told from captured ones)")
    padding = _field(path, f, "router_padding_mask", (B, T))
    cols = np.arange(T - R - 1, T - 1)
    src = np.maximum(cols, 0)
    captured = ~padding.astype(bool)[:, src] & (cols >= 0)
    return routes[:, src].reshape(B * R, *routes.shape[2:]), captured.reshape(-1)
