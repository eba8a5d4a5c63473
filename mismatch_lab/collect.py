"""`mismatch-lab collect`: one checkpoint through the rollout engine and the trainer scorer, into DuckDB.

    mismatch-lab collect --study studies/default/study.toml
    mismatch-lab collect --model default --prompts data/default_prompts.jsonl --samples 4 \
        --max-tokens 64 --rollout-dtypes bf16,fp32 --scorer-dtypes bf16,fp16,fp32,vllm:bf16 --db out.duckdb

For each rollout dtype: the engine samples every prompt `samples` times at T=1, top_p=1 (μ and its
top-K recorded), then every scorer re-scores exactly those token ids by teacher forcing (π, entropy,
top-K, exact TV/KL vs the fp32 scorer). Work is cut into chunks of prompts; each chunk is committed in
one transaction, so an interrupted run resumes where it stopped when the same command is re-run.
"""

from __future__ import annotations

import hashlib
import json
import math
import platform
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from mismatch_lab import DTYPES
from mismatch_lab.categories import TokenTexts
from mismatch_lab.errors import UserError
from mismatch_lab.studyfile import apply_study


@dataclass
class CollectConfig:
    """What a collect run does; the study file and the flags use the same names ('-' or '_')."""

    model: str = "default"  # 'default' (embedded SmolLM2-135M-Instruct), an HF directory, or a hub id
    prompts: str = "data/default_prompts.jsonl"  # JSON Lines {"id", "prompt", optional "answer"}
    samples: int = 4  # sampled responses per prompt
    max_tokens: int = 64  # generated tokens per response at most
    engine: str = "vllm"  # rollout engine: vllm | hf
    rollout_dtypes: list = field(default_factory=lambda: ["bf16", "fp16", "fp32"])
    scorer_dtypes: list = field(default_factory=lambda: ["bf16", "fp16", "fp32"])  # plus 'vllm:<dtype>'
    top_k: int = 20  # top-K recorded per token (sampled token included); 0 = none
    seed: int = 0
    db: str = "mismatch_lab.duckdb"
    study: str = "adhoc"  # name stored in runs.study
    chunk_prompts: int = 8  # prompts per committed unit of work
    gen_batch: int = 0  # requests per engine call; 0 = the whole chunk (batch invariance studies vary it)
    score_chunk_rows: int = 1024  # rows per chunk of the scorer's vocabulary projection
    score_batch_tokens: int = 8192  # padded tokens per scorer forward (batch composition of the trainer side)
    max_model_len: int = 2048  # context used by the engines (capped at the model's own)
    device: str = ""  # '' = cuda if available else cpu
    trust_remote_code: bool = False

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
        for name in ("samples", "max_tokens", "chunk_prompts", "score_chunk_rows", "score_batch_tokens", "max_model_len"):
            if int(getattr(self, name)) < 1:
                raise UserError(f"--{name.replace('_', '-')} must be at least 1")
        if self.top_k < 0 or self.top_k > 20:
            raise UserError("--top-k must be between 0 and 20 (vLLM caps returned logprobs at 20)")
        if not self.rollout_dtypes:
            raise UserError("--rollout-dtypes is empty; give at least one of bf16,fp16,fp32")


def _split_list(v):
    if isinstance(v, str):
        return [x.strip() for x in v.split(",") if x.strip()]
    return list(v)


def load_config(args) -> CollectConfig:
    """Defaults < study file < command-line flags. Relative paths in a study file are relative to it."""
    cfg = CollectConfig()
    names = {f.name for f in fields(CollectConfig)}
    if args.study:
        apply_study(cfg, args.study, "collect", names, path_keys=("prompts", "db"))
    for k in names - {"study"}:  # --study is the study file; the study's name is its folder's (apply_study)
        v = getattr(args, k, None)
        if v is not None:
            setattr(cfg, k, v)
    cfg.rollout_dtypes = _split_list(cfg.rollout_dtypes)
    cfg.scorer_dtypes = _split_list(cfg.scorer_dtypes)
    for k in ("samples", "max_tokens", "top_k", "seed", "chunk_prompts", "gen_batch", "score_chunk_rows",
              "score_batch_tokens", "max_model_len"):
        try:
            setattr(cfg, k, int(getattr(cfg, k)))
        except (TypeError, ValueError) as exc:
            raise UserError(f"{k} must be an integer, got {getattr(cfg, k)!r}") from exc
    cfg.validate()
    return cfg


def read_prompts(path: str) -> list[dict]:
    """Parse a JSON Lines prompt file; every mistake is a UserError naming the line."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"--prompts {path}: no such file; pass a JSON Lines file of {{\"id\", \"prompt\"}} objects")
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"--prompts {path}: unreadable ({exc}); pass a UTF-8 JSON Lines file") from exc
    out, seen = [], set()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}:{n}: not valid JSON ({exc.msg}); each line must be one JSON object") from exc
        if not isinstance(obj, dict) or "id" not in obj or not isinstance(obj.get("prompt"), str) or not obj["prompt"].strip():
            raise UserError(f"{path}:{n}: each line needs an \"id\" and a non-empty string \"prompt\"")
        pid = str(obj["id"])
        if pid in seen:
            raise UserError(f"{path}:{n}: duplicate id {pid!r}; ids must be unique")
        seen.add(pid)
        out.append({"id": pid, "prompt": obj["prompt"], "answer": obj.get("answer")})
    if not out:
        raise UserError(f"--prompts {path}: the file holds no prompts")
    return out


def _file_sha(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        import torch

        return f"cuda ({torch.cuda.get_device_name(0)})"
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import os

    return f"cpu ({cpu}, {os.cpu_count()} cores)"


def encode_prompts(tokenizer, prompts: list[dict]) -> tuple[list[list[int]], bool]:
    """Token ids of each prompt with the model's chat template (raw text when it has none)."""
    has_template = bool(getattr(tokenizer, "chat_template", None))
    ids = []
    for p in prompts:
        if has_template:
            text = tokenizer.apply_chat_template([{"role": "user", "content": p["prompt"]}], tokenize=False,
                                                 add_generation_prompt=True)
        else:
            text = p["prompt"]
        ids.append(tokenizer(text, add_special_tokens=not has_template)["input_ids"])
    return ids, has_template


def sample_seed(seed: int, prompt_index: int, sample_idx: int) -> int:
    """A per-sample seed independent of batching, so resumed runs regenerate the same samples."""
    h = hashlib.sha256(f"{seed}/{prompt_index}/{sample_idx}".encode()).digest()
    return int.from_bytes(h[:4], "little") & 0x7FFFFFFF


def _num(x):
    return x if (x is not None and math.isfinite(x)) else None


def build_tables(run_id, seq_rows, samples, scored, texts: TokenTexts, *, step=None):
    """Arrow tables (sequences, tokens, scores) for one chunk.

    seq_rows: dicts with seq_id, prompt_id, sample_idx, prompt_len (and optional reward, advantage)
    samples:  engine Samples aligned with seq_rows;  scored: scorer name -> list[SeqScores] aligned too.
    """
    from mismatch_lab.store.writer import to_arrow

    S = {k: [] for k in ("run_id", "seq_id", "prompt_id", "sample_idx", "step", "response_text", "response_len",
                         "finish_reason", "reward", "advantage", "prompt_len")}
    T = {k: [] for k in ("run_id", "seq_id", "pos", "token_id", "token_text", "category", "logp_rollout",
                         "topk_ids_rollout", "topk_logps_rollout")}
    C = {k: [] for k in ("run_id", "seq_id", "pos", "scorer", "logp", "entropy", "topk_ids", "topk_logps",
                         "tv_exact_vs_ref", "kl_exact_vs_ref", "nonfinite", "logps_at_rollout_topk", "logps_at_ref_topk")}
    for i, (row, smp) in enumerate(zip(seq_rows, samples)):
        n = len(smp.token_ids)
        for k, v in (("run_id", run_id), ("seq_id", row["seq_id"]), ("prompt_id", row["prompt_id"]),
                     ("sample_idx", row["sample_idx"]), ("step", step), ("response_text", smp.text),
                     ("response_len", n), ("finish_reason", smp.finish_reason), ("reward", row.get("reward")),
                     ("advantage", row.get("advantage")), ("prompt_len", row["prompt_len"])):
            S[k].append(v)
        for pos, tid in enumerate(smp.token_ids):
            text, cat = texts(tid)
            T["run_id"].append(run_id)
            T["seq_id"].append(row["seq_id"])
            T["pos"].append(pos)
            T["token_id"].append(tid)
            T["token_text"].append(text)
            T["category"].append(cat)
            T["logp_rollout"].append(_num(smp.logps[pos]))
            T["topk_ids_rollout"].append(smp.topk_ids[pos] if smp.topk_ids else None)
            T["topk_logps_rollout"].append([_num(x) for x in smp.topk_logps[pos]] if smp.topk_logps else None)
        for name, per_seq in scored.items():
            sc = per_seq[i]
            C["run_id"].extend([run_id] * n)
            C["seq_id"].extend([row["seq_id"]] * n)
            C["pos"].extend(range(n))
            C["scorer"].extend([name] * n)
            C["logp"].extend(sc.logp)
            C["entropy"].extend(sc.entropy if sc.entropy else [None] * n)
            C["nonfinite"].extend(sc.nonfinite)
            for col, attr in (("topk_ids", "topk_ids"), ("topk_logps", "topk_logps"), ("tv_exact_vs_ref", "tv_exact_vs_ref"),
                              ("kl_exact_vs_ref", "kl_exact_vs_ref"), ("logps_at_rollout_topk", "logps_at_rollout_topk"),
                              ("logps_at_ref_topk", "logps_at_ref_topk")):
                vals = getattr(sc, attr)
                C[col].extend(vals if vals is not None else [None] * n)
    return to_arrow("sequences", S), to_arrow("tokens", T), to_arrow("scores", C)


def prefill_scores(engine, items, top_k: int):
    """SeqScores from vLLM prefill (the `vllm:<dtype>` scorer): π, top-K; no entropy or exact divergences."""
    from mismatch_lab.scoring import SeqScores

    res = engine.prefill_logprobs([(it.prompt_ids, it.response_ids) for it in items], top_k=top_k)
    out = []
    for logps, tk_ids, tk_lps in res:
        out.append(SeqScores(
            logp=[_num(x) for x in logps], entropy=None, nonfinite=[_num(x) is None for x in logps],
            topk_ids=tk_ids, topk_logps=[[_num(x) for x in row] for row in tk_lps] if tk_lps else None,
        ))
    return out


# ------------------------------------------------------------------------------------------------------
def collect(cfg: CollectConfig, *, progress: bool = True) -> list[str]:
    """Run the collection described by `cfg`; returns the run ids (one per rollout dtype)."""
    import os

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # vLLM's environment is set by _import_vllm
    from mismatch_lab.engines.vllm_engine import _import_vllm
    from mismatch_lab.models import resolve_model, weights_sha256
    from mismatch_lab.scoring import parse_scorers

    # -- validate everything before the database is touched: bad input writes nothing ---------------
    prompts = read_prompts(cfg.prompts)
    model = resolve_model(cfg.model)
    tokenizer, model_ctx = _load_tokenizer(model, cfg.trust_remote_code)
    hf_dtypes, vllm_dtypes = parse_scorers(cfg.scorer_dtypes)
    if cfg.engine == "vllm" or vllm_dtypes:
        _import_vllm()
    max_len = min(cfg.max_model_len, model_ctx) if model_ctx else cfg.max_model_len
    prompt_ids, templated = encode_prompts(tokenizer, prompts)
    keep = [i for i, ids in enumerate(prompt_ids) if len(ids) + cfg.max_tokens <= max_len]
    kept = set(keep)
    skipped = [(prompts[i]["id"], (f"prompt of {len(prompt_ids[i])} tokens + max_tokens {cfg.max_tokens} exceeds "
                                   f"the context of {max_len}")) for i in range(len(prompts)) if i not in kept]
    sha = weights_sha256(model)

    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    device = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
    versions = {"python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__}
    try:  # recorded whenever vLLM is installed, also for an HF-only run
        versions["vllm"] = _import_vllm().__version__
    except UserError:
        pass
    import duckdb

    versions["duckdb"] = duckdb.__version__
    # the run id hashes what determines a run's rows; the other rollout dtypes in the list do not, so
    # adding a dtype to a study later does not redo the runs already there
    base_cfg = {k: v for k, v in asdict(cfg).items() if k not in ("db", "device", "rollout_dtypes")}
    base_cfg.update(model_resolved=model, prompts_sha256=_file_sha(cfg.prompts), chat_template=templated,
                    max_model_len_used=max_len)

    from mismatch_lab.store.writer import StoreWriter

    writer = StoreWriter(cfg.db)
    n_chunks = math.ceil(len(keep) / cfg.chunk_prompts)
    chunks = [keep[c * cfg.chunk_prompts:(c + 1) * cfg.chunk_prompts] for c in range(n_chunks)]
    texts = TokenTexts(tokenizer)
    scorer = None
    engines: dict[str, object] = {}
    run_ids = []
    pbar = None
    try:
        plan = []
        for dt in cfg.rollout_dtypes:
            run_cfg = dict(base_cfg, rollout_dtype=dt, weights_sha256=sha)
            key = hashlib.sha256(json.dumps(run_cfg, sort_keys=True, default=str).encode()).hexdigest()[:10]
            run_id = f"{cfg.study}-collect-{cfg.engine}-{dt}-{key}"
            run_ids.append(run_id)
            if writer.run_status(run_id) == "complete":
                print(f"{run_id}: already complete, skipped", file=sys.stderr)
                continue
            todo = [c for c in range(n_chunks) if c not in writer.done_chunks(run_id)]
            plan.append((dt, run_id, run_cfg, todo))
        total = sum(len(chunks[c]) * cfg.samples for _, _, _, todo in plan for c in todo)
        if plan:
            from tqdm import tqdm

            pbar = tqdm(total=total, unit="seq", desc="collect", disable=not progress, file=sys.stderr,
                        mininterval=1.0, dynamic_ncols=True)
            scorer = _make_scorer(model, hf_dtypes, device, cfg) if hf_dtypes else None
        n_tok, t0 = 0, time.perf_counter()
        for dt, run_id, run_cfg, todo in plan:
            engine = _engine(engines, cfg.engine, model, dt, cfg, max_len, device)
            sampling = engine.sampling_config()
            run_cfg = dict(run_cfg, sampling=sampling, scorer=scorer.config() if scorer else None,
                           vllm_scorers=[f"vllm:{d}" for d in vllm_dtypes])
            writer.start_run(run_id, study=cfg.study, kind="collect", model=model, weights_sha256=sha,
                             engine=cfg.engine, engine_dtype=dt, device=_device_name(device),
                             versions=versions, config=run_cfg)
            pbar.set_description(f"collect {cfg.engine}:{dt}")
            for c in todo:
                tc = time.perf_counter()
                seq_rows, reqs = [], []
                from mismatch_lab.engines.base import GenRequest

                for pi in chunks[c]:
                    for s in range(cfg.samples):
                        seq_rows.append({"seq_id": pi * cfg.samples + s, "prompt_id": prompts[pi]["id"],
                                         "sample_idx": s, "prompt_len": len(prompt_ids[pi])})
                        reqs.append(GenRequest(prompt_ids=prompt_ids[pi], seed=sample_seed(cfg.seed, pi, s)))
                step = cfg.gen_batch or len(reqs)
                samples = []
                for b in range(0, len(reqs), step):
                    samples.extend(engine.generate(reqs[b:b + step], max_tokens=cfg.max_tokens, top_k=cfg.top_k))
                from mismatch_lab.scoring import ScoreItem

                items = [ScoreItem(r.prompt_ids, s.token_ids, s.topk_ids) for r, s in zip(reqs, samples)]
                scored = scorer.score(items) if scorer else {}
                for vd in vllm_dtypes:
                    eng = _engine(engines, "vllm", model, vd, cfg, max_len, device)
                    scored[f"vllm:{vd}"] = prefill_scores(eng, items, cfg.top_k)
                seqs, toks, scs = build_tables(run_id, seq_rows, samples, scored, texts)
                writer.write_chunk(run_id, c, sequences=seqs, tokens=toks, scores=scs,
                                   seconds=time.perf_counter() - tc, skipped=skipped if c == 0 else ())
                n_tok += toks.num_rows
                pbar.update(len(seq_rows))
                pbar.set_postfix_str(f"{n_tok / (time.perf_counter() - t0):.0f} tok/s")
            writer.set_status(run_id, "complete")
            if cfg.engine != "vllm" or dt not in vllm_dtypes:
                engines.pop(f"{cfg.engine}:{dt}").close()  # free it unless it also serves as a prefill scorer
    except BaseException:
        for rid in run_ids:
            if writer.run_status(rid) == "running":
                writer.set_status(rid, "failed")
        raise
    finally:
        if pbar is not None:
            pbar.close()
        for e in engines.values():
            e.close()
        if scorer is not None:
            scorer.close()
    fill_rewards(writer.con, run_ids, prompts)
    print_summary(writer.con, run_ids, cfg)
    writer.close()
    return run_ids


def fill_rewards(con, run_ids: list[str], prompts: list[dict]) -> int:
    """Set `sequences.reward` (1/0, last number in the reply vs the prompt's numeric "answer") where unset.

    Prompts without an answer keep reward NULL. Idempotent: runs again on resume and on complete runs.
    Advantages stay NULL for collect runs; the analyses use reward minus the prompt group's mean.
    """
    import pyarrow as pa

    from mismatch_lab.rl.tasks.arithmetic import parse_answer, reward

    answers = {p["id"]: p["answer"] for p in prompts if p.get("answer") is not None
               and parse_answer(str(p["answer"])) is not None}
    if not answers or not run_ids:
        return 0
    marks = ",".join("?" * len(run_ids))
    rows = con.execute(f"SELECT run_id, seq_id, prompt_id, response_text FROM sequences WHERE reward IS NULL "
                       f"AND run_id IN ({marks})", run_ids).fetchall()
    upd = [(r, s, reward(t or "", str(answers[p]))) for r, s, p, t in rows if p in answers]
    if upd:
        tbl = pa.table({"run_id": [u[0] for u in upd], "seq_id": [u[1] for u in upd], "reward": [u[2] for u in upd]})
        con.register("_rewards", tbl)
        con.execute("UPDATE sequences SET reward = _rewards.reward FROM _rewards "
                    "WHERE sequences.run_id = _rewards.run_id AND sequences.seq_id = _rewards.seq_id")
        con.unregister("_rewards")
    return len(upd)


def _load_tokenizer(model: str, trust_remote_code: bool):
    from transformers import AutoConfig, AutoTokenizer

    try:
        conf = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
        tok = AutoTokenizer.from_pretrained(model, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise UserError(f"--model {model}: cannot load config/tokenizer ({str(exc).splitlines()[0]}); "
                        "pass a complete HF checkpoint directory, 'default', or a hub id with network access") from exc
    return tok, getattr(conf, "max_position_embeddings", None)


def _make_scorer(model, dtypes, device, cfg):
    from mismatch_lab.scoring import HFScorer

    return HFScorer(model, dtypes, device=device, top_k=cfg.top_k, chunk_rows=cfg.score_chunk_rows,
                    batch_tokens=cfg.score_batch_tokens)


def _engine(cache: dict, name: str, model: str, dtype: str, cfg: CollectConfig, max_len: int, device: str):
    from mismatch_lab.engines.base import make_engine

    key = f"{name}:{dtype}"
    if key not in cache:
        kw = {"seed": cfg.seed, "max_model_len": max_len, "device": device}
        if name == "vllm":
            kw["max_logprobs"] = max(20, cfg.top_k)
        cache[key] = make_engine(name, model, dtype, **kw)
    return cache[key]


def print_summary(con, run_ids: list[str], cfg: CollectConfig) -> None:
    """The one-screen summary: per (rollout, scorer) pair the precision figures of these runs."""
    from mismatch_lab.analysis.precision import precision_table

    df = precision_table(con, run_ids=run_ids)
    cols = {"rollout": "rollout", "scorer": "scorer", "n_tokens": "tokens", "abs_dp_mean": "mean|Δp|",
            "abs_dp_max": "max|Δp|", "abs_dlogp_mean": "mean|Δlogp|", "kl_k3": "KL k3",
            "frac_ratio_outside_clip": "r∉[0.8,1.28]", "n_nonfinite": "non-finite"}
    show = df[[c for c in cols if c in df.columns]].rename(columns=cols)
    n_seq, n_tok = con.execute(
        f"SELECT count(*), coalesce(sum(response_len), 0) FROM sequences WHERE run_id IN ({','.join('?' * len(run_ids))})",
        run_ids).fetchone()
    n_skip = con.execute(
        f"SELECT count(*) FROM skipped_prompts WHERE run_id IN ({','.join('?' * len(run_ids))})", run_ids).fetchone()[0]
    print()
    print(f"study {cfg.study}: {len(run_ids)} run(s), {n_seq} sequences, {n_tok} generated tokens -> {cfg.db}")
    print("per token, sampled token only; Δp = π − μ in probability space, Δlogp = log π − log μ, r = π/μ,")
    print("KL k3 = mean(r − log r − 1) (estimates KL(μ‖π) from samples of μ); non-finite rows counted, excluded from means")
    with _pd_options():
        print(show.to_string(index=False, float_format=lambda x: f"{x:.3g}"))
    if n_skip:
        print(f"skipped prompts (longer than the context): {n_skip} (listed in table skipped_prompts)")
    print(f"next: mismatch-lab analyze --db {cfg.db}   |   mismatch-lab app --study {Path(cfg.db).parent}")


def _pd_options():
    import pandas as pd

    return pd.option_context("display.width", 200, "display.max_columns", 20)


def add_arguments(parser) -> None:
    parser.add_argument("--study", help="studies/<name>/study.toml (flags below override its values)")
    parser.add_argument("--model", help="'default' (embedded SmolLM2-135M-Instruct), an HF checkpoint dir, or a hub id")
    parser.add_argument("--prompts", help="JSON Lines file of {\"id\", \"prompt\", optional \"answer\"}")
    parser.add_argument("--samples", type=int, help="sampled responses per prompt (default 4)")
    parser.add_argument("--max-tokens", dest="max_tokens", type=int, help="max generated tokens per response (default 64)")
    parser.add_argument("--engine", choices=["vllm", "hf"], help="rollout engine (default vllm)")
    parser.add_argument("--rollout-dtypes", dest="rollout_dtypes", help="comma list of bf16,fp16,fp32")
    parser.add_argument("--scorer-dtypes", dest="scorer_dtypes",
                        help="comma list of bf16,fp16,fp32 (HF trainer) and vllm:<dtype> (vLLM prefill)")
    parser.add_argument("--top-k", dest="top_k", type=int, help="top-K recorded per token, 0..20 (default 20)")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--db", help="DuckDB file to write (default: studies/<name>/<name>.duckdb)")
    parser.add_argument("--chunk-prompts", dest="chunk_prompts", type=int, help="prompts per committed chunk (default 8)")
    parser.add_argument("--gen-batch", dest="gen_batch", type=int, help="requests per engine call (default: whole chunk)")
    parser.add_argument("--score-chunk-rows", dest="score_chunk_rows", type=int, help="scorer rows per vocab chunk (1024)")
    parser.add_argument("--score-batch-tokens", dest="score_batch_tokens", type=int,
                        help="padded tokens per scorer forward (8192; 1 = one sequence per forward)")
    parser.add_argument("--max-model-len", dest="max_model_len", type=int, help="engine context length (default 2048)")
    parser.add_argument("--device", help="cpu | cuda (default: cuda when available)")
    parser.add_argument("--trust-remote-code", dest="trust_remote_code", action="store_true", default=None)
    parser.add_argument("--no-progress", dest="no_progress", action="store_true")


def run(args) -> int:
    cfg = load_config(args)
    collect(cfg, progress=not getattr(args, "no_progress", False))
    return 0
