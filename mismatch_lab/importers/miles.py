"""miles' per-rank train-data dumps (`--dump-details DIR`): DIR/train_data/<rollout_id>_<rank>.pt.

Source of the format (radixark/miles, commit 31f1ca961a94cb860cec3b2dea34ec332bfa8f76):
* `miles/utils/arguments.py`: `--dump-details DIR` sets `save_debug_train_data` to
  `DIR/train_data/{rollout_id}_{rank}.pt`;
* `miles/utils/train_dump_utils.py` `save_debug_train_data_for_rank`: every rank (data, tensor, pipeline
  and context parallel) writes `torch.save({"rollout_id", "rank", "rollout_data", "cp_rank", "cp_size",
  "qkv_format"})` after training on the rollout (`miles/backends/megatron_utils/actor.py`,
  `fsdp_utils/actor.py`);
* `miles/backends/training_utils/data.py` `get_rollout_data`: `rollout_data` holds the rank's
  data-parallel share as per-sample lists: `tokens` (prompt + response), `loss_masks` (response length),
  `rollout_log_probs` (mu), `log_probs` (pi: the actor's forward before the update, `compute_log_prob`,
  on the last pipeline stage only), `advantages`, `returns`, `rewards`, `response_lengths`,
  `total_lengths`, `sample_indices`, ...; the per-token fields other than loss_masks are the rank's
  context-parallel slice (`slice_log_prob_with_cp`);
* `miles/dashboard/dump_reader.py` (`_build_train_row`, `_resolve_per_token_fields`): miles' own reader
  joins a sample's rows across the rank files (tensor-parallel peers hold copies, pipeline stages other
  fields) by `sample_indices`, as this importer does.
The other dumps of --dump-details carry no log pi per token: `dashboard_columns/rollout_*.parquet`
(tokens, loss_mask, rollout_log_probs) and `rollout_data/` lack it, and `policy_loss_debug/*.pt` (per
loss call: train/old/rollout log-probs) lacks token ids and the rollout id.

One Source per rollout: the file of its lowest rank, the other ranks' files read with it (`Source.facts`);
the dedup digest is that first file's. With context parallelism (cp_size > 1) each rank holds its zigzag
slice of the per-token fields (loss_masks stay whole): they are put back together (`_assemble`, the
inverse of `slice_log_prob_with_cp`, as miles' `assemble_log_prob_from_cp` does). miles writes 0.0
placeholders into masked rollout log-prob slots: only loss-mask positions are stored.

What is read -> where it goes (per sample, through `slime._batch`):
    rollout_id                                   sequences.step
    tokens[total - response:]                    tokens.token_id
    loss_masks                                   the stored positions
    rollout_log_probs / log_probs                tokens.logp_rollout / scores.logp (scorer 'miles:<dtype>')
    entropy                                      scores.entropy
    advantages                                   tokens.advantage and sequences.advantage (mean)
    rewards                                      sequences.reward (raw_reward is batch-global in rollout order:
                                                 placing it needs the rollout dump; not read)
    total_lengths - response_lengths             sequences.prompt_len
    rollout_routed_experts (where held)          routing rows (side 'rollout'), as `slime` reads them
Routing: `rollout_routed_experts` is a per-sample int32 [len(tokens) - 1, num_layers, topk] array
(`miles/rollout/generate_utils/generate_endpoint_utils.py` ~l.108, `miles/ray/rollout/train_data_conversion.py`)
kept whole in rollout_data (`miles/backends/training_utils/data.py` ~l.117). miles asks SGLang for it with
--use-rollout-routing-replay, and `fill_replay_data` (`miles/backends/training_utils/replay_data.py` ~l.131)
deletes it from rollout_data before training (Megatron and FSDP actors), hence before the dump: a dump of that
commit holds it only where a custom rollout function set `sample.rollout_routed_experts` without that replay
(e.g. `examples/infra_features/random_async/random_async_rollout.py`) or another version kept it.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from mismatch_lab.errors import UserError
from mismatch_lab.extras import TORCH_HINT, missing
from mismatch_lab.importers import slime
from mismatch_lab.importers.base import Discovery, Source

FRAMEWORK = "miles"
HELP = "miles --dump-details train dumps: DIR/train_data/<rollout_id>_<rank>.pt (torch.save; needs --trust-pickle)"
EXPECTED = "the per-rank train dumps of --dump-details: DIR/train_data/<rollout_id>_<rank>.pt, given as DIR or its train_data folder"
RANK_FILE = re.compile(r"^(\d+)_(\d+)\.pt$")
PER_SAMPLE = ("tokens", "response_lengths", "total_lengths", "loss_masks", "rewards", "rollout_routed_experts")
"""Fields every holder of a sample carries in full."""
PER_TOKEN = ("rollout_log_probs", "log_probs", "advantages", "entropy")
"""Fields taken from the first rank (in rank order) holding them: pipeline stages differ in what they hold."""
add_arguments = slime.add_arguments


def discover(path: Path, args) -> Discovery:
    if not getattr(args, "trust_pickle", False):
        raise UserError("miles dumps are Python pickles (torch.save) and loading a pickle can run any code it "
                        f"contains: pass --trust-pickle to load the files under {path} if you trust them")
    if missing(("torch",)):  # the light install: the pickles hold torch objects
        raise UserError(f"miles dumps hold torch objects and loading them needs torch, which this install lacks: "
                        f"{TORCH_HINT}")
    if path.is_file():
        raise UserError(f"{path}: pass the --dump-details folder or its train_data folder (a rollout's samples are "
                        "spread over the files of every rank)")
    folder = path / "train_data" if (path / "train_data").is_dir() else path
    rollouts: dict[int, list[tuple[int, Path]]] = {}
    for p in folder.iterdir():
        m = RANK_FILE.match(p.name)
        if m:
            rollouts.setdefault(int(m.group(1)), []).append((int(m.group(2)), p))
    sources = []
    for rid, files in sorted(rollouts.items()):
        files.sort()
        sources.append(Source(files[0][1], step=rid, facts={"files": [p for _, p in files]}))
    run_name = folder.parent.name if folder.name == "train_data" else folder.name
    return Discovery(sources=sources, run_name=run_name)


def _load(path: Path, step: int) -> dict:
    """The dict one rank saved (its `rollout_data` checked to be a dict)."""
    import torch  # only the pickle importers need torch

    try:
        pack = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # a truncated or foreign file: torch/pickle raise many kinds
        raise UserError(f"{path}: cannot be loaded with torch.load ({type(exc).__name__}: {exc})") from exc
    if not isinstance(pack, dict) or not isinstance(pack.get("rollout_data"), dict):
        raise UserError(f"{path}: not a miles train dump (no 'rollout_data' dict; a slime format_version 2 dump "
                        "is read by `mismatch-lab import slime`)")
    if pack.get("rollout_id") is not None and slime._whole(pack["rollout_id"], str(path), "rollout_id") != step:
        raise UserError(f"{path}: rollout_id {pack['rollout_id']} differs from the file name's {step}")
    return pack


def _samples(files: list[Path], step: int) -> list[dict]:
    """One dict per sample_index (in index order), joined over the rank files; context-parallel slices of
    the per-token fields put back together (`_assemble`)."""
    joined: dict[int, dict] = {}
    for path in files:
        pack = _load(path, step)
        data, cp_size = pack["rollout_data"], int(pack.get("cp_size") or 1)
        cp = (cp_size, int(pack.get("cp_rank") or 0), str(pack.get("qkv_format") or "thd"))
        indices = data.get("sample_indices")
        if indices is None:
            raise UserError(f"{path}: field 'sample_indices' is missing")
        for key in (*PER_SAMPLE, *PER_TOKEN, "max_seq_lens"):
            if data.get(key) is not None and len(data[key]) != len(indices):
                raise UserError(f"{path}: field {key!r} has {len(data[key])} rows, sample_indices {len(indices)}")
        for row, index in enumerate(indices):
            sample = joined.setdefault(int(slime._scalar(index)), {"_where": f"{path}: row {row}", "_cp": {}})
            for key in PER_SAMPLE:
                if data.get(key) is not None and sample.get(key) is None:
                    sample[key] = data[key][row]
            if data.get("max_seq_lens") is not None:
                sample["_max_seq_len"] = int(slime._scalar(data["max_seq_lens"][row]))
            for key in PER_TOKEN:
                if data.get(key) is not None:  # the first holder of each context-parallel rank
                    sample["_cp"].setdefault(key, {}).setdefault(cp, data[key][row])
    samples = [joined[i] for i in sorted(joined)]
    for s in samples:
        for key, chunks in s.pop("_cp").items():
            s[key] = _assemble(s, key, chunks)
    return samples


def _assemble(s: dict, key: str, chunks: dict[tuple[int, int, str], object]):
    """The full-response values of a per-token field from its slices {(cp_size, cp_rank, qkv_format): values}
    (one slice, the whole field, when cp_size is 1): the inverse of miles' `slice_log_prob_with_cp`."""
    sizes = {c[0] for c in chunks}
    if len(sizes) != 1:
        raise UserError(f"{s['_where']}: field {key!r} comes from dumps of different cp_size {sorted(sizes)}")
    cp_size = sizes.pop()
    if cp_size == 1:
        return next(iter(chunks.values()))
    missing = sorted(set(range(cp_size)) - {c[1] for c in chunks})
    if missing:
        raise UserError(f"{s['_where']}: field {key!r} lacks the slices of context-parallel ranks {missing} "
                        f"(cp_size {cp_size}): import the files of every rank")
    T = slime._whole(s["total_lengths"], s["_where"], "total_lengths")
    R = slime._whole(s["response_lengths"], s["_where"], "response_lengths")
    out = np.full(R, np.nan)
    for (_, cp_rank, fmt), values in chunks.items():
        v = slime._floats(values, s["_where"], key).reshape(-1)
        taken = 0
        for a, b in _cp_ranges(T, R, fmt, s.get("_max_seq_len"), cp_rank, cp_size):
            out[a:b] = v[taken: taken + b - a]
            taken += b - a
        if taken != len(v):
            raise UserError(f"{s['_where']}: field {key!r} of context-parallel rank {cp_rank} has {len(v)} values, "
                            f"its slice of the {R}-token response {taken} (misaligned)")
    return out


def _cp_ranges(T: int, R: int, fmt: str, max_seq_len: int | None, cp_rank: int, cp_size: int) -> list[tuple[int, int]]:
    """The response positions [a, b) rank `cp_rank` holds, in order: its two zigzag chunks of the sequence
    (miles `get_logits_and_tokens_offset_with_cp`), a log-prob's index shifted by one (logit t - 1 scores
    token t)."""
    if fmt != "thd" and max_seq_len is None:
        raise UserError("a context-parallel bshd dump without 'max_seq_lens': the slices cannot be placed")
    size = ((T if fmt == "thd" else max_seq_len) + 2 * cp_size - 1) // (2 * cp_size)
    P = T - R
    out = []
    for c in (cp_rank, 2 * cp_size - cp_rank - 1):
        lo, hi = max(c * size, P - 1), min((c + 1) * size, T - 1)
        if lo < hi:
            out.append((lo - (P - 1), hi - (P - 1)))
    return out


def read(src: Source, args):
    samples = _samples(src.facts["files"], src.step)
    if not samples:
        return
    for s in samples:
        if s.get("log_probs") is None:
            raise UserError(f"{s['_where']}: field 'log_probs' is missing in every rank's file (miles computes the "
                            "actor's log-probs unless --skip-actor-forward-only, or --use-rollout-logprobs without "
                            "--get-mismatch-metrics; without them there is no trainer log pi to compare)")
    yield slime._batch(src.path, samples, src.step, 0, None)
