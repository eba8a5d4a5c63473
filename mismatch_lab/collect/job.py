"""The collect job in three parts: prepare (inputs, nothing loaded) -> plan (memory, refused before anything is
written) -> chunks (generate, score, write one committed chunk at a time).

For each rollout dtype: the engine samples every prompt `samples` times at T=1, top_p=1 unless a sampling rule
is given (--temperature, --top-p, --sample-top-k; μ raw or processed by --logprobs-mode; μ and its top-K recorded), then every scorer re-scores exactly those token ids by teacher forcing (π, entropy, top-K, exact
TV/KL vs the fp32 scorer). Work is cut into chunks by a token budget; each chunk is committed in one
transaction, so an interrupted run resumes at its first missing chunk when the same command is re-run.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from mismatch_lab.collect.config import (
    IN_RUN_ID_UNLESS_DEFAULT,
    RUN_LOCAL,
    CollectConfig,
)
from mismatch_lab.collect.prompts import (
    encode_prompts,
    make_chunks,
    read_prompts,
    sample_seed,
)
from mismatch_lab.errors import UserError
from mismatch_lab.runtime import config_key, device_name, load_model_info, run_identity
from mismatch_lab.runtime import load_tokenizer as _load_tokenizer  # noqa: F401  (re-exported)
from mismatch_lab.runtime import versions as runtime_versions


@dataclass
class Job:
    """Everything a collect run needs that is known before any model is loaded."""

    cfg: CollectConfig
    prompts: list[dict]
    model: str
    tokenizer: object
    model_config: dict
    max_len: int
    prompt_ids: list[list[int]]
    skipped: list[tuple[str, str]]
    chunks: list[list[int]]
    hf_dtypes: list[str]
    vllm_dtypes: list[str]
    device: str
    base_cfg: dict = field(default_factory=dict)
    routing: bool = False  # record MoE routing (routing table); R3 scorers need it


@dataclass
class PendingRun:
    dtype: str
    run_id: str
    run_cfg: dict
    todo: list[int]


# ------------------------------------------------------------------------------------------------ prepare
def prepare(cfg: CollectConfig, *, verbose: bool = False, weights: bool = True) -> Job:
    """Validate every input and cut the work into chunks; bad input raises UserError and writes nothing.
    `weights=False`: a checkpoint directory may hold its config only (enough for `memory_plan`)."""
    from mismatch_lab.engines.vllm_engine import _import_vllm
    from mismatch_lab.models import resolve_model
    from mismatch_lab.scoring import parse_scorers

    prompts = read_prompts(cfg.prompts)
    model = resolve_model(cfg.model, weights=weights)
    tokenizer, model_config = load_model_info(model, cfg.trust_remote_code)
    hf_dtypes, vllm_dtypes = parse_scorers(cfg.scorer_dtypes)
    if cfg.engine == "vllm" or vllm_dtypes:
        _import_vllm(verbose)
    ctx = model_config.get("max_position_embeddings")
    max_len = min(cfg.max_model_len, ctx) if ctx else cfg.max_model_len
    prompt_ids, templated = encode_prompts(tokenizer, prompts)
    keep = [i for i, ids in enumerate(prompt_ids) if len(ids) + cfg.max_tokens <= max_len]
    skipped = [(prompts[i]["id"], (f"prompt of {len(prompt_ids[i])} tokens + max_tokens {cfg.max_tokens} exceeds "
                                  f"the context of {max_len}")) for i in sorted(set(range(len(prompts))) - set(keep))]
    device = resolve_device(cfg.device)
    chunks = make_chunks(keep, prompt_ids, samples=cfg.samples, max_tokens=cfg.max_tokens,
                         budget=cfg.chunk_budget(device), chunk_prompts=cfg.chunk_prompts)
    job = Job(cfg, prompts, model, tokenizer, model_config, max_len, prompt_ids, skipped, chunks, hf_dtypes,
              vllm_dtypes, device, routing=routing_on(cfg, model_config, hf_dtypes))
    # the run id hashes what determines a run's rows (RUN_LOCAL fields do not)
    job.base_cfg = run_identity(cfg, leave_out=RUN_LOCAL, unless_default=IN_RUN_ID_UNLESS_DEFAULT)
    job.base_cfg.update(model_resolved=model, prompts_sha256=_file_sha(cfg.prompts), chat_template=templated,
                        max_model_len_used=max_len, chunk_tokens=0 if cfg.chunk_prompts else cfg.chunk_budget(device))
    return job


def routing_on(cfg: CollectConfig, model_config: dict, hf_dtypes: list[str]) -> bool:
    """Whether the run records MoE routing: --routing, default on for an MoE checkpoint; UserError for --routing on
    with a dense model, and for an R3 scorer (hf:<dtype>-r3) on a dense model or with --routing off."""
    from mismatch_lab.routing.record import MOE_CONFIG_KEYS, is_moe
    from mismatch_lab.scoring import is_replay

    moe = is_moe(model_config)
    replay = [f"hf:{d}" for d in hf_dtypes if is_replay(d)]
    if not moe and (cfg.routing == "on" or replay):
        what = "--routing on" if cfg.routing == "on" else f"the R3 scorer {replay[0]}"
        raise UserError(f"{what}: {cfg.model} is not an MoE model (its config has none of {', '.join(MOE_CONFIG_KEYS)}); "
                        "drop it or pass an MoE checkpoint, e.g. `mismatch-lab model tiny-moe --out DIR`")
    if replay and cfg.routing == "off":
        raise UserError(f"the R3 scorer {replay[0]} replays the recorded rollout routing: drop --routing off or the scorer")
    return moe and cfg.routing != "off"


def resolve_device(device: str) -> str:
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {device}: no CUDA device is visible; pass --device cpu")
    if device.split(":")[0] not in ("cpu", "cuda"):
        raise UserError(f"--device {device}: use cpu, cuda or cuda:N")
    return device


def _file_sha(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


# --------------------------------------------------------------------------------------------------- plan
def memory_plan(job: Job):
    """The memory plan of this job on its device (None with --memory-plan off); UserError when it cannot fit."""
    from mismatch_lab.collect.memory import Shapes, Workload, plan_memory

    cfg = job.cfg
    if cfg.memory_plan == "off":
        return None
    longest = max((len(job.prompt_ids[i]) for c in job.chunks for i in c), default=0) + cfg.max_tokens
    chunk_seqs = max((len(c) for c in job.chunks), default=0) * cfg.samples
    w = Workload(engine=cfg.engine, rollout_dtypes=cfg.rollout_dtypes, scorer_dtypes=job.hf_dtypes,
                 prefill_dtypes=job.vllm_dtypes, max_model_len=job.max_len, seq_len=longest,
                 batch_tokens=cfg.score_batch_tokens, chunk_rows=cfg.score_chunk_rows,
                 chunk_tokens=chunk_seqs * cfg.max_tokens, gen_batch=cfg.gen_batch or chunk_seqs,
                 gpu_memory_utilization=cfg.gpu_memory_utilization, tensor_parallel_size=cfg.tensor_parallel_size,
                 data_parallel_size=cfg.data_parallel_size)
    total, gpus = device_capacity(job.device)
    plan = plan_memory(Shapes.from_config(job.model_config), w, job.device, total, gpus=gpus)
    plan.check()
    return plan


def device_capacity(device: str) -> tuple[int, int]:
    """(bytes, visible GPUs): a GPU's total memory, or the RAM available now on a CPU."""
    if device.startswith("cuda"):
        import torch

        return torch.cuda.mem_get_info(torch.device(device))[1], torch.cuda.device_count()
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024, 0
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), 0


# ------------------------------------------------------------------------------------------------ collect
def collect(cfg: CollectConfig, *, progress: bool = True, verbose: bool = False) -> list[str]:
    """Run the collection described by `cfg`; returns the run ids (one per rollout dtype)."""
    from mismatch_lab.collect.quiet import quiet_libraries
    from mismatch_lab.store.writer import check_ours

    check_ours(cfg.db)  # another program's file is refused before any library, model or engine is loaded
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # vLLM's environment is set by _import_vllm
    quiet_libraries(verbose)
    job = prepare(cfg, verbose=verbose)
    plan = memory_plan(job)  # refused here: nothing loaded, nothing written
    from mismatch_lab.collect.summary import fill_rewards, print_summary
    from mismatch_lab.store.writer import StoreWriter

    writer = StoreWriter(cfg.db)
    try:
        run_ids, pending = pending_runs(job, writer)
        if pending and plan is not None:
            print("\n".join(plan.lines()), flush=True)
        if pending:
            run_chunks(job, plan, writer, pending, progress=progress, verbose=verbose)
        fill_rewards(writer.con, run_ids, job.prompts)
        print_summary(writer.con, run_ids, cfg)
    finally:
        writer.close()
    return run_ids


def pending_runs(job: Job, writer) -> tuple[list[str], list[PendingRun]]:
    """Every run id of the job, and the runs with chunks still to do (a complete run is not redone)."""
    from mismatch_lab.models import weights_sha256

    sha = weights_sha256(job.model)
    run_ids, pending = [], []
    for dt in job.cfg.rollout_dtypes:
        run_cfg = dict(job.base_cfg, rollout_dtype=dt, weights_sha256=sha)
        run_id = f"{job.cfg.study}-collect-{job.cfg.engine}-{job.cfg.rollout_label(dt)}-{config_key(run_cfg)}"
        run_ids.append(run_id)
        if writer.run_status(run_id) == "complete":
            print(f"{run_id}: already complete, skipped", file=sys.stderr)
            continue
        done = writer.done_chunks(run_id)
        pending.append(PendingRun(dt, run_id, run_cfg, [c for c in range(len(job.chunks)) if c not in done]))
    return run_ids, pending


def run_chunks(job: Job, plan, writer, pending: list[PendingRun], *, progress: bool, verbose: bool) -> None:
    """Generate, score and write every pending chunk; a run that stops is marked failed (resumable)."""
    from tqdm import tqdm

    from mismatch_lab.record.flat import TextLookup

    cfg = job.cfg
    total = sum(len(job.chunks[c]) * cfg.samples for r in pending for c in r.todo)
    pbar = tqdm(total=total, unit="seq", desc="collect", disable=not progress, file=sys.stderr, mininterval=1.0,
                dynamic_ncols=True)
    work = _Workers(job, plan, verbose)
    texts = TextLookup(job.tokenizer)
    try:
        n_tok, t0 = 0, time.perf_counter()
        for run in pending:
            engine = work.rollout_engine(cfg.engine, run.dtype)
            _start_run(job, writer, run, engine, work)
            pbar.set_description(f"collect {cfg.engine}:{run.dtype}")
            for c in run.todo:
                n_tok += _one_chunk(job, writer, run, c, engine, work, texts)
                pbar.update(len(job.chunks[c]) * cfg.samples)
                pbar.set_postfix_str(f"{n_tok / (time.perf_counter() - t0):.0f} tok/s")
            writer.set_status(run.run_id, "complete")
            work.release_rollout(cfg.engine, run.dtype)
    except BaseException:
        for run in pending:
            if writer.run_status(run.run_id) == "running":
                writer.set_status(run.run_id, "failed")
        raise
    finally:
        pbar.close()
        work.close()


def _start_run(job: Job, writer, run: PendingRun, engine, work) -> None:
    versions = runtime_versions()
    run.run_cfg = dict(run.run_cfg, sampling=engine.sampling_config(), scorer=work.scorer_config(),
                       vllm_scorers=[f"vllm:{d}" for d in job.vllm_dtypes], chunks=len(job.chunks),
                       memory_plan=work.plan.lines() if work.plan else None,
                       rollout_weights=job.cfg.rollout_weights)
    writer.start_run(run.run_id, study=job.cfg.study, kind="collect", model=job.model,
                     weights_sha256=run.run_cfg["weights_sha256"], engine=job.cfg.engine,
                     engine_dtype=job.cfg.rollout_label(run.dtype),
                     device=device_name(job.device), versions=versions, config=run.run_cfg)


def _one_chunk(job: Job, writer, run: PendingRun, c: int, engine, work, texts) -> int:
    """Generate, score and write chunk `c` of `run` in one transaction; returns its response tokens."""
    from mismatch_lab.collect.tables import build_tables, prefill_scores
    from mismatch_lab.engines.base import GenRequest
    from mismatch_lab.scoring import ScoreItem

    cfg, tc = job.cfg, time.perf_counter()
    seq_rows, reqs = [], []
    for pi in job.chunks[c]:
        for s in range(cfg.samples):
            seq_rows.append({"seq_id": pi * cfg.samples + s, "prompt_id": job.prompts[pi]["id"], "sample_idx": s,
                             "prompt_len": len(job.prompt_ids[pi])})
            reqs.append(GenRequest(prompt_ids=job.prompt_ids[pi], seed=sample_seed(cfg.seed, pi, s)))
    step = cfg.gen_batch or len(reqs)
    samples = [smp for b in range(0, len(reqs), step)
               for smp in engine.generate(reqs[b:b + step], max_tokens=cfg.max_tokens, top_k=cfg.top_k,
                                             min_tokens=cfg.min_tokens)]
    items = [ScoreItem(r.prompt_ids, s.token_ids, s.topk_ids) for r, s in zip(reqs, samples)]
    rollout = _rollout_routing(job, engine, items)
    scored = work.scorer.score(items) if work.scorer else {}
    for vd in job.vllm_dtypes:
        scored[f"vllm:{vd}"] = prefill_scores(work.engine("vllm", vd), items, cfg.top_k)
    seqs, toks, scs = build_tables(run.run_id, seq_rows, samples, scored, texts)
    routing = _routing_rows(run.run_id, seq_rows, items, rollout, scored) if job.routing else None
    writer.write_chunk(run.run_id, c, sequences=seqs, tokens=toks, scores=scs, seconds=time.perf_counter() - tc,
                       skipped=job.skipped if c == 0 else (), routing=routing)
    return toks.num_rows


def _rollout_routing(job: Job, engine, items) -> list | None:
    """The rollout engine's routing of every token of each item (routing.record.rollout_routings), set on the items
    for an R3 scorer; None with routing off."""
    if not job.routing:
        return None
    from mismatch_lab.routing.record import rollout_routings

    out = rollout_routings(job.cfg.engine, engine, [list(it.prompt_ids) + list(it.response_ids) for it in items])
    for it, r in zip(items, out):
        it.rollout_routing = r
    return out


def _routing_rows(run_id: str, seq_rows: list[dict], items, rollout: list, scored: dict):
    """The chunk's `routing` rows: the rollout's (its routing of every token, response positions kept) and each
    scorer's that recorded one (its response rows)."""
    import pyarrow as pa

    from mismatch_lab.routing.compare import Routing
    from mismatch_lab.routing.record import routing_table
    from mismatch_lab.scoring.positions import predicting_positions
    from mismatch_lab.store.schema import ROUTING_ROLLOUT_SIDE

    seq_ids = [r["seq_id"] for r in seq_rows]
    lens = [len(it.response_ids) for it in items]
    starts = [int(predicting_positions(len(it.prompt_ids), 1)[0]) for it in items]
    tables = [routing_table(run_id, ROUTING_ROLLOUT_SIDE, seq_ids, rollout, starts, lens)]
    for name, st in scored.items():
        if st.routing is not None:
            r = st.routing
            per_seq = [Routing(r.ids[st.rows(i)], r.weights[st.rows(i)], r.margin[st.rows(i)]) for i in range(len(items))]
            tables.append(routing_table(run_id, name, seq_ids, per_seq, [0] * len(items), lens))
    return pa.concat_tables(tables)


class _Workers:
    """The engines and the scorer of a job, loaded on first use, with the plan's settings."""

    def __init__(self, job: Job, plan, verbose: bool):
        self.job, self.plan, self.verbose = job, plan, verbose
        self.engines: dict[str, object] = {}
        self.scorer = self._make_scorer() if job.hf_dtypes else None

    def _make_scorer(self):
        from mismatch_lab.scoring import HFScorer

        cfg = self.job.cfg
        return HFScorer(self.job.model, self.job.hf_dtypes, device=self.job.device, top_k=cfg.top_k,
                        chunk_rows=cfg.score_chunk_rows, batch_tokens=cfg.score_batch_tokens,
                        placement=self.plan.placement if self.plan else "resident", sampling=cfg.sampling_rule(),
                        routing=self.job.routing)

    def scorer_config(self):
        return self.scorer.config() if self.scorer else None

    def engine(self, name: str, dtype: str):
        key = f"{name}:{dtype}"
        if key not in self.engines:
            self.engines[key] = self._make(name, dtype)
        return self.engines[key]

    def _make(self, name: str, dtype: str, sampling=None):
        from mismatch_lab.engines.base import make_engine

        cfg = self.job.cfg
        kw = {"seed": cfg.seed, "max_model_len": self.job.max_len, "device": self.job.device, "verbose": self.verbose,
              "sampling": sampling}
        if name == "vllm":
            kw.update(max_logprobs=max(20, cfg.top_k), tensor_parallel_size=cfg.tensor_parallel_size,
                      data_parallel_size=cfg.data_parallel_size,
                      gpu_memory_utilization=self.plan.gpu_memory_utilization if self.plan else None)
        return make_engine(name, self.job.model, dtype, **kw)

    def rollout_engine(self, name: str, dtype: str):
        """The rollout engine of a run: the shared engine of (name, dtype) on the checkpoint's weights, or, with
        --rollout-weights or a sampling rule (--temperature, --top-p, --sample-top-k, --logprobs-mode), an engine
        of its own (rounded checkpoint weights pushed into it; the rule's sampling): a vLLM prefill scorer of the
        same dtype keeps the checkpoint's weights and raw log-probs."""
        cfg = self.job.cfg
        label = cfg.rollout_label(dtype)
        if label == dtype:
            return self.engine(name, dtype)
        from mismatch_lab.engines.weights import round_state

        key = f"{name}:{label}"
        if key not in self.engines:
            engine = self._make(name, dtype, sampling=cfg.sampling_rule())
            self.engines[key] = engine
            if cfg.rollout_weights != "none":
                engine.load_state_dict(round_state(checkpoint_state(self.job.model, cfg.trust_remote_code),
                                                   cfg.rollout_weights))
        return self.engines[key]

    def release_rollout(self, name: str, dtype: str) -> None:
        """Free a rollout engine after its run, unless it also serves as a vLLM prefill scorer."""
        label = self.job.cfg.rollout_label(dtype)
        if label != dtype or name != "vllm" or dtype not in self.job.vllm_dtypes:
            self.engines.pop(f"{name}:{label}").close()

    def close(self) -> None:
        for e in self.engines.values():
            e.close()
        self.engines.clear()
        if self.scorer is not None:
            self.scorer.close()


def checkpoint_state(model: str, trust_remote_code: bool = False) -> dict:
    """The checkpoint's parameters at fp32 (exact for fp32, bf16 and fp16 checkpoints), by their HF names: what
    `--rollout-weights` rounds before the push into the rollout engine (the state dict `train` pushes too)."""
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, trust_remote_code=trust_remote_code)
    return {k: v.detach() for k, v in m.state_dict().items()}
