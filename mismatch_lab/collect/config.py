"""What a collect run does: `CollectConfig`, read from defaults < study file < flags, and the flags."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from mismatch_lab import DTYPES
from mismatch_lab.errors import UserError
from mismatch_lab.scoring import SCORE_BATCH_TOKENS, SCORE_CHUNK_ROWS
from mismatch_lab.studyfile import apply_study, study_schema

CHUNK_TOKENS = {"cpu": 4096, "cuda": 262144}  # token budget of a chunk by device kind (--chunk-tokens 0)
RUN_LOCAL = ("db", "device", "rollout_dtypes", "gpu_memory_utilization", "memory_plan")
"""Fields that do not determine a run's rows: left out of the run id (adding a rollout dtype to a study
later does not redo the runs already there)."""
IN_RUN_ID_UNLESS_DEFAULT = ("min_tokens", "rollout_weights", "temperature", "top_p", "sample_top_k", "logprobs_mode",
                            "routing")
"""Fields added after studies were stored: hashed only when set, so the run ids of those studies stay."""


@dataclass
class CollectConfig:
    """What a collect run does; the study file and the flags use the same names ('-' or '_')."""

    model: str = "default"  # 'default' (embedded SmolLM2-135M-Instruct), an HF directory, or a hub id
    prompts: str = "data/default_prompts.jsonl"  # JSON Lines {"id", "prompt", optional "answer"}
    samples: int = 4  # sampled responses per prompt
    max_tokens: int = 64  # generated tokens per response at most
    min_tokens: int = 0  # EOS forbidden before this many tokens (long-sequence studies); 0 = off, out of the run id
    engine: str = "vllm"  # rollout engine: vllm | hf
    rollout_dtypes: list = field(default_factory=lambda: ["bf16", "fp16", "fp32"])
    rollout_weights: str = "none"  # fp8 | bf16: the rollout engine gets rounded weights (engines/weights.py)
    scorer_dtypes: list = field(default_factory=lambda: ["bf16", "fp16", "fp32"])  # plus 'vllm:<dtype>'
    top_k: int = 20  # top-K recorded per token (sampled token included); 0 = none
    temperature: float = 1.0  # the rollout's sampling temperature (the scorers' π stays at T=1)
    top_p: float = 1.0  # the rollout's nucleus sampling; 1 = off
    sample_top_k: int = 0  # the rollout's top-k sampling; 0 = off (--top-k is the recorded top-K)
    logprobs_mode: str = "raw"  # raw: μ before temperature/top-k/top-p | processed: after (vLLM processed_logprobs)
    seed: int = 0
    db: str = "mismatch_lab.duckdb"
    study: str = "adhoc"  # name stored in runs.study
    chunk_tokens: int = 0  # tokens (samples x (prompt + max_tokens)) per committed chunk; 0 = by device (CHUNK_TOKENS)
    chunk_prompts: int = 0  # prompts per committed chunk instead of a token budget (fixed batch composition); 0 = off
    gen_batch: int = 0  # requests per engine call; 0 = the whole chunk (batch invariance studies vary it)
    score_chunk_rows: int = SCORE_CHUNK_ROWS  # rows per chunk of the scorer's vocabulary projection
    score_batch_tokens: int = SCORE_BATCH_TOKENS  # padded tokens per scorer forward (trainer-side batch composition)
    max_model_len: int = 2048  # context used by the engines (capped at the model's own)
    device: str = ""  # '' = cuda if available else cpu
    gpu_memory_utilization: float = 0.0  # vLLM's share of each GPU; 0 = from the memory plan
    tensor_parallel_size: int = 1  # vLLM's own tensor parallelism
    data_parallel_size: int = 1  # vLLM's own data parallelism
    memory_plan: str = "check"  # check: refuse a plan that cannot fit | off: print nothing, check nothing
    trust_remote_code: bool = False
    routing: str = ""  # MoE expert routing into the routing table: on | off; '' = on for an MoE checkpoint, else off

    def validate(self) -> None:
        if self.engine not in ("vllm", "hf"):
            raise UserError(f"--engine {self.engine}: use 'vllm' or 'hf'")
        for d in self.rollout_dtypes:
            if d not in DTYPES:
                raise UserError(f"unknown rollout dtype {d!r}; use a subset of bf16,fp16,fp32")
        from mismatch_lab.scoring import parse_scorers

        try:
            parse_scorers(self.scorer_dtypes)
        except ValueError as exc:
            raise UserError(str(exc)) from exc
        for name in ("samples", "max_tokens", "score_chunk_rows", "score_batch_tokens", "max_model_len",
                     "tensor_parallel_size", "data_parallel_size"):
            if int(getattr(self, name)) < 1:
                raise UserError(f"--{name.replace('_', '-')} must be at least 1")
        for name in ("chunk_tokens", "chunk_prompts", "gen_batch"):
            if int(getattr(self, name)) < 0:
                raise UserError(f"--{name.replace('_', '-')} must be 0 (automatic) or more")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise UserError(f"--min-tokens {self.min_tokens} must be between 0 and --max-tokens {self.max_tokens}")
        if not 0.0 <= self.gpu_memory_utilization < 1.0:
            raise UserError("--gpu-memory-utilization must be in (0, 1), or 0 for the memory plan's value")
        if self.routing not in ("", "on", "off"):
            raise UserError(f"--routing {self.routing}: use 'on' or 'off'")
        if self.memory_plan not in ("check", "off"):
            raise UserError("--memory-plan: use 'check' or 'off'")
        if self.top_k < 0 or self.top_k > 20:
            raise UserError("--top-k must be between 0 and 20 (vLLM caps returned logprobs at 20)")
        self._validate_sampling()
        from mismatch_lab.engines.weights import ROUNDINGS

        if self.rollout_weights not in ROUNDINGS:
            raise UserError(f"--rollout-weights {self.rollout_weights}: use one of {', '.join(ROUNDINGS)}")
        if not self.rollout_dtypes:
            raise UserError("--rollout-dtypes is empty; give at least one of bf16,fp16,fp32")

    def _validate_sampling(self) -> None:
        from mismatch_lab.scoring.support import LOGPROBS_MODES

        if not self.temperature > 0:
            raise UserError(f"--temperature {self.temperature} must be above 0 (greedy decoding has no μ to compare)")
        if not 0 < self.top_p <= 1:
            raise UserError(f"--top-p {self.top_p} must be in (0, 1]; 1 = off")
        if self.sample_top_k < 0:
            raise UserError(f"--sample-top-k {self.sample_top_k} must be 0 (off) or more")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise UserError(f"--logprobs-mode {self.logprobs_mode}: use one of {', '.join(LOGPROBS_MODES)}")
        if self.logprobs_mode == "processed" and self.min_tokens:
            raise UserError("--logprobs-mode processed with --min-tokens: the processed log-probs would hold the "
                            "end-of-sequence mask too; pass --logprobs-mode raw or --min-tokens 0")

    def sampling_rule(self):
        """The rollout's `scoring.support.SamplingRule`."""
        from mismatch_lab.scoring.support import SamplingRule

        return SamplingRule(float(self.temperature), float(self.top_p), int(self.sample_top_k), self.logprobs_mode)

    def rollout_label(self, dtype: str) -> str:
        """`runs.engine_dtype` of the run at `dtype`: the weights' label ('bf16-wfp8') and, off the defaults,
        the sampling rule's ('bf16-p0.9-processed'), so runs that sample differently never merge."""
        from mismatch_lab.engines.weights import weights_label

        return weights_label(dtype, self.rollout_weights) + self.sampling_rule().label()

    def chunk_budget(self, device: str) -> int:
        """Tokens per committed chunk on `device` (explicit, or the device kind's default)."""
        return self.chunk_tokens or CHUNK_TOKENS["cuda" if device.startswith("cuda") else "cpu"]


PATH_KEYS = ("prompts", "db")
"""Study-file keys that are paths, relative to the study file."""
STUDY_SCHEMA = study_schema(CollectConfig, PATH_KEYS, examples={"device": '"cuda"', "gpu_memory_utilization": "0.9"})
"""key -> the type its study-file value must have (from the field annotations), checked once when read."""

INTS = ("samples", "max_tokens", "min_tokens", "top_k", "sample_top_k", "seed", "chunk_tokens", "chunk_prompts", "gen_batch", "score_chunk_rows",
        "score_batch_tokens", "max_model_len", "tensor_parallel_size", "data_parallel_size")


FLOATS = ("gpu_memory_utilization", "temperature", "top_p")


def _split_list(v):
    if isinstance(v, str):
        return [x.strip() for x in v.split(",") if x.strip()]
    return list(v)


def load_config(args) -> CollectConfig:
    """Defaults < study file < command-line flags. Relative paths in a study file are relative to it."""
    cfg = CollectConfig()
    names = {f.name for f in fields(CollectConfig)}
    if args.study:
        apply_study(cfg, args.study, "collect", names, path_keys=PATH_KEYS, schema=STUDY_SCHEMA)
    for k in names - {"study"}:  # --study is the study file; the study's name is its folder's (apply_study)
        v = getattr(args, k, None)
        if v is not None:
            setattr(cfg, k, v)
    cfg.rollout_dtypes = _split_list(cfg.rollout_dtypes)
    cfg.scorer_dtypes = _split_list(cfg.scorer_dtypes)
    for k, cast in [(k, int) for k in INTS] + [(k, float) for k in FLOATS]:
        try:
            setattr(cfg, k, cast(getattr(cfg, k)))
        except (TypeError, ValueError) as exc:
            raise UserError(f"{k} must be a number, got {getattr(cfg, k)!r}") from exc
    cfg.validate()
    return cfg


def add_arguments(parser) -> None:
    a = parser.add_argument
    a("--study", help="studies/<name>/study.toml (flags below override its values)")
    a("--model", help="'default' (embedded SmolLM2-135M-Instruct), 'default-bf16grid' (its weights on the bf16 grid), "
                       "an HF checkpoint dir, or a hub id")
    a("--prompts", help="JSON Lines file of {\"id\", \"prompt\", optional \"answer\"}")
    a("--samples", type=int, help="sampled responses per prompt (default 4)")
    a("--max-tokens", dest="max_tokens", type=int, help="max generated tokens per response (default 64)")
    a("--min-tokens", dest="min_tokens", type=int,
      help="forbid the end of sequence before this many tokens (default 0 = off); μ and π stay the raw "
           "distributions, before that mask")
    a("--engine", choices=["vllm", "hf"], help="rollout engine (default vllm)")
    a("--rollout-dtypes", dest="rollout_dtypes", help="comma list of bf16,fp16,fp32")
    a("--rollout-weights", dest="rollout_weights", choices=["none", "fp8", "bf16"],
      help="weights the rollout engine gets: the checkpoint's (none, default), rounded to float8 e4m3 per output "
           "channel (fp8) or to bfloat16 (bf16); the scorers keep the checkpoint's")
    a("--scorer-dtypes", dest="scorer_dtypes",
      help="comma list of bf16,fp16,fp32 (HF trainer), <dtype>-w<rounding> (HF at <dtype> on weights rounded "
           "to bf16|fp16|fp8, e.g. fp32-wbf16), <dtype>-r3 (HF replaying the rollout's MoE routing, R3) and "
           "vllm:<dtype> (vLLM prefill)")
    a("--top-k", dest="top_k", type=int, help="top-K recorded per token, 0..20 (default 20)")
    a("--temperature", type=float, help="the rollout's sampling temperature (default 1); the scorers' π stays at T=1")
    a("--top-p", dest="top_p", type=float, help="the rollout's nucleus sampling, in (0, 1] (default 1 = off)")
    a("--sample-top-k", dest="sample_top_k", type=int,
      help="the rollout's top-k sampling (default 0 = off; --top-k is the number of log-probs recorded)")
    a("--logprobs-mode", dest="logprobs_mode", choices=["raw", "processed"],
      help="μ before temperature/top-k/top-p (raw, default) or after them, renormalised over the kept tokens "
           "(processed, vLLM's processed_logprobs); the HF scorers store log S of that support (log_support)")
    a("--seed", type=int)
    a("--db", help="DuckDB file to write (default: studies/<name>/<name>.duckdb)")
    a("--chunk-tokens", dest="chunk_tokens", type=int,
      help=f"tokens per committed chunk (default {CHUNK_TOKENS['cpu']} on CPU, {CHUNK_TOKENS['cuda']} on GPU)")
    a("--chunk-prompts", dest="chunk_prompts", type=int, help="prompts per committed chunk instead of --chunk-tokens")
    a("--gen-batch", dest="gen_batch", type=int, help="requests per engine call (default: whole chunk)")
    a("--score-chunk-rows", dest="score_chunk_rows", type=int, help=f"scorer rows per vocab chunk ({SCORE_CHUNK_ROWS})")
    a("--score-batch-tokens", dest="score_batch_tokens", type=int,
      help=f"padded tokens per scorer forward ({SCORE_BATCH_TOKENS}; 1 = one sequence per forward)")
    a("--max-model-len", dest="max_model_len", type=int, help="engine context length (default 2048)")
    a("--device", help="cpu | cuda | cuda:N (default: cuda when available)")
    a("--gpu-memory-utilization", dest="gpu_memory_utilization", type=float,
      help="vLLM's share of each GPU (default: computed by the memory plan)")
    a("--tensor-parallel-size", dest="tensor_parallel_size", type=int, help="vLLM tensor parallelism (default 1)")
    a("--data-parallel-size", dest="data_parallel_size", type=int, help="vLLM data parallelism (default 1)")
    a("--memory-plan", dest="memory_plan", choices=["check", "off"], help="check (default) or off")
    a("--routing", choices=["on", "off"],
      help="record the MoE expert routing of the rollout and of every HF scorer (routing table; default: on for an "
           "MoE checkpoint); needed by the R3 scorer hf:<dtype>-r3")
    a("--trust-remote-code", dest="trust_remote_code", action="store_true", default=None)
    a("--verbose", action="store_true", help="show the engines' own logs and loading bars")
    a("--no-progress", dest="no_progress", action="store_true")
