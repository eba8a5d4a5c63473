"""Synthetic stores that follow the data contract, for tests (planted answers) and the benchmark.

Two generators:

* `synthetic_store(path, SyntheticSpec(...))` -- small and exact. Every position gets real full-vocabulary
  distributions over a tiny vocabulary: base logits z, the rollout engine's softmax(z + e_r), each
  scorer's softmax(z + e_s), with |e| <= the dtype's noise bound b. The sampled token is drawn from the
  rollout distribution; top-K lists, entropies and exact TV/KL against the 'hf:fp32' scorer are computed
  from the same distributions, so every stored number is consistent with every other.
  Planted answers (the generator returns them with the frames it wrote):
    - unplanted tokens have |log r| <= 2 (b_rollout + b_scorer), so with the default bounds no
      unplanted token leaves [0.8, 1.28] or has |pi - mu| > 0.15;
    - `n_planted` tokens per run get mu in (0.36, 0.59) and pi = f * mu in every scorer, f = 0.5 or 1.5
      alternately: ratio-clipped and outside the TV region (|dp| = 0.5 mu > 0.18), by construction;
    - `n_nonfinite` score rows per (run, scorer) stored as NULL with nonfinite = true;
      `n_rollout_nonfinite` tokens per run with logp_rollout NULL; neither falls on a planted token,
      and the two never share a token, so the non-finite count of a pair is their sum exactly;
    - `n_one_token` one-token sequences; rewards/advantages, top-K, exact TV, train_metrics on request.
  Build time ~0.1 s for a few thousand tokens.

* `build_benchmark_store(path, n_tokens=10_000_000)` -- large and fast, built by DuckDB SQL from hashed
  counters (no Python loop over tokens; deterministic for a seed). Two collect runs (vllm:bf16 and
  vllm:fp16, half the tokens each) scored as three (rollout, scorer) pairs (vllm:bf16 by hf:fp32 and
  hf:bf16, vllm:fp16 by hf:fp32), rewards without stored advantages, top-K of size `topk`, exact TV on
  the hf:bf16 rows, and a training run's metric series. Its numbers are plausible, not consistent
  distributions: it measures speed and memory, not correctness.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import duckdb
import numpy as np
import pandas as pd
import pyarrow as pa

from mismatch_lab.categories import categorize
from mismatch_lab.store.schema import COLUMNS, REFERENCE_SCORER, create_schema
from mismatch_lab.store.writer import TABLE_TYPES

# A small vocabulary touching every token category; id = index. '<|im_end|>' is the special token.
VOCAB = (
    "<|im_end|>", "\n", " ", " 1", " 4", "12", " 3.5", " +", " =", "-", " *", " Wait", " So", " Thus",
    " However", " Next", ".", ",", ":", "?", " the", " answer", " is", " of", " we", " number", " sum",
    "ing", " problem", " first", " add", " total", " two", " and", " to", " a", " apples", " step",
    " result", " then",
)  # fmt: skip
SPECIAL_IDS = frozenset({0})

DEFAULT_NOISE = {"bf16": 0.02, "fp16": 0.004, "fp32": 1e-5}
"""Bound b on the log-space perturbation of each dtype's logits; fp32 engines agree to ~1e-5 (measured)."""


@dataclass
class SyntheticSpec:
    """What `synthetic_store` writes. Counts are per collect run unless stated."""

    rollouts: tuple[str, ...] = ("vllm:bf16",)  # one collect run per '<engine>:<dtype>'
    scorers: tuple[str, ...] = ("hf:fp32",)  # every run is scored by each
    n_sequences: int = 16
    max_len: int = 40  # response lengths are uniform on [2, max_len] (one-token ones are extra)
    n_one_token: int = 0  # sequences of exactly one token, added to n_sequences
    noise: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_NOISE))
    n_planted: int = 0  # tokens with a planted ratio (module doc)
    n_nonfinite: int = 0  # per (run, scorer)
    n_rollout_nonfinite: int = 0  # tokens with logp_rollout NULL
    rewards: str | None = None  # None | 'advantage' (reward and advantage stored) | 'reward' (reward only)
    group_size: int = 4  # samples per prompt (the GRPO group)
    topk: int = 0  # K of the recorded top-K lists (0 = none)
    exact_tv: bool = False  # store tv/kl_exact_vs_ref (needs 'hf:fp32' among the scorers)
    train_steps: int = 0  # >0 adds a training run with this many steps of train_metrics
    seed: int = 0

    def __post_init__(self):
        if self.exact_tv and REFERENCE_SCORER not in self.scorers:
            raise ValueError(f"exact_tv needs the reference scorer {REFERENCE_SCORER!r} in scorers")
        if self.rewards not in (None, "advantage", "reward"):
            raise ValueError("rewards must be None, 'advantage' or 'reward'")
        if self.topk >= len(VOCAB):
            raise ValueError(f"topk must be below the vocabulary size {len(VOCAB)}")


@dataclass
class SyntheticStore:
    path: Path
    spec: SyntheticSpec
    frames: dict[str, pd.DataFrame]  # runs, sequences, tokens, scores, train_metrics as written
    planted: pd.DataFrame  # run_id, seq_id, pos, factor (pi = factor * mu)


def write_store(path: str | Path, frames: dict[str, pd.DataFrame]) -> Path:
    """Create a contract store at `path` and insert the given frames by column name (contract columns
    a frame lacks are NULL). Fails if the file exists, so no test ever appends to an old store."""
    path = Path(path)
    if path.exists():
        raise FileExistsError(f"{path} exists; pass a fresh path")
    con = duckdb.connect(str(path))
    try:
        create_schema(con)
        for table, df in frames.items():
            if df is None or df.empty:
                continue
            data = _to_arrow(table, df)
            con.register("_frame", data)
            con.execute(f"INSERT INTO {table} BY NAME SELECT * FROM _frame")
            con.unregister("_frame")
    finally:
        con.close()
    return path


def _to_arrow(table: str, df: pd.DataFrame) -> pa.Table | pd.DataFrame:
    types = TABLE_TYPES.get(table)
    if types is None:
        return df
    # pd.NA -> NULL; a float NaN stays NaN, so tests can store what a faulty writer would
    return pa.table({c: pa.array([None if v is pd.NA else v for v in df[c].tolist()], type=types[c]) for c in df.columns})


def _softmax_log(logits: np.ndarray) -> np.ndarray:
    m = logits.max(axis=1, keepdims=True)
    return logits - m - np.log(np.exp(logits - m).sum(axis=1, keepdims=True))


def synthetic_store(path: str | Path, spec: SyntheticSpec | None = None) -> SyntheticStore:
    """Write a small consistent store (module doc) and return it with the frames and planted answers."""
    spec = spec or SyntheticSpec()
    rng = np.random.default_rng(spec.seed)
    V = len(VOCAB)
    texts = np.array(VOCAB, dtype=object)
    cats = np.array([categorize(t, i in SPECIAL_IDS) for i, t in enumerate(VOCAB)], dtype=object)
    runs, seqs, toks, scores, planted = [], [], [], [], []
    for ri, rollout in enumerate(spec.rollouts):
        engine, dtype = rollout.split(":")
        run_id = f"synthetic-{ri}-{engine}-{dtype}"
        runs.append({"run_id": run_id, "study": "synthetic", "kind": "collect", "status": "complete",
                         "created_at": pd.Timestamp("2026-01-01") + pd.Timedelta(minutes=ri), "model": "synthetic",
                         "weights_sha256": "0" * 64, "engine": engine, "engine_dtype": dtype, "device": "cpu",
                         "versions": "{}", "config": "{}"})  # fmt: skip
        lengths = np.concatenate(
            [rng.integers(2, spec.max_len + 1, size=spec.n_sequences), np.ones(spec.n_one_token, dtype=int)]
        )
        rng.shuffle(lengths)
        n = int(lengths.sum())
        seq_id = np.repeat(np.arange(len(lengths)), lengths)
        pos = np.concatenate([np.arange(k) for k in lengths])

        z = rng.normal(size=(n, V)) * rng.uniform(0.5, 5.0, size=(n, 1))
        lp_mu = _softmax_log(z + rng.uniform(-1, 1, size=(n, V)) * spec.noise[dtype])
        mu_all = np.exp(lp_mu)
        tok = np.array([rng.choice(V, p=p / p.sum()) for p in mu_all])
        lp_s = {}
        for s in spec.scorers:
            b = spec.noise[s.split(":")[1]]
            lp_s[s] = _softmax_log(z + rng.uniform(-1, 1, size=(n, V)) * b)

        # planted ratios: the rollout distribution gets mu* on the sampled token, every scorer f * mu*
        idx = rng.choice(n, size=spec.n_planted, replace=False) if spec.n_planted else np.array([], int)
        for j, i in enumerate(idx):
            f = 0.5 if j % 2 == 0 else 1.5
            m = rng.uniform(0.36, 0.59)
            lp_mu[i] = _plant(lp_mu[i], tok[i], m)
            for s in spec.scorers:
                lp_s[s][i] = _plant(lp_mu[i], tok[i], f * m)
            planted.append({"run_id": run_id, "seq_id": int(seq_id[i]), "pos": int(pos[i]), "factor": f})
        rows = np.arange(n)
        logp_rollout = lp_mu[rows, tok].astype(float)
        free = np.setdiff1d(rows, idx)  # non-finite rows never fall on planted tokens or on each other
        bad_mu = rng.choice(free, size=spec.n_rollout_nonfinite, replace=False)
        free = np.setdiff1d(free, bad_mu)
        logp_rollout_stored = pd.array(logp_rollout, dtype="Float64")
        logp_rollout_stored[bad_mu] = pd.NA

        tokens = pd.DataFrame({"run_id": run_id, "seq_id": seq_id, "pos": pos, "token_id": tok, "token_text": texts[tok],
                                   "category": cats[tok], "logp_rollout": logp_rollout_stored})  # fmt: skip
        if spec.topk:
            top = np.argsort(-lp_mu, axis=1, kind="stable")[:, : spec.topk]
            tokens["topk_ids_rollout"] = list(top)
            tokens["topk_logps_rollout"] = list(np.take_along_axis(lp_mu, top, axis=1))
        toks.append(tokens)

        ref_top = None
        if spec.topk and REFERENCE_SCORER in lp_s:
            ref_top = np.argsort(-lp_s[REFERENCE_SCORER], axis=1, kind="stable")[:, : spec.topk]
        for s in spec.scorers:
            lp = lp_s[s]
            sc = pd.DataFrame({"run_id": run_id, "seq_id": seq_id, "pos": pos, "scorer": s,
                                   "logp": pd.array(lp[rows, tok], dtype="Float64"),
                                   "entropy": pd.array(-(np.exp(lp) * lp).sum(axis=1), dtype="Float64"),
                                   "nonfinite": False})  # fmt: skip
            if spec.topk:
                own = np.argsort(-lp, axis=1, kind="stable")[:, : spec.topk]
                sc["topk_ids"] = list(own)
                sc["topk_logps"] = list(np.take_along_axis(lp, own, axis=1))
                sc["logps_at_rollout_topk"] = list(np.take_along_axis(lp, top, axis=1))
                if ref_top is not None:
                    sc["logps_at_ref_topk"] = list(np.take_along_axis(lp, ref_top, axis=1))
            if spec.exact_tv:
                p, p_ref = np.exp(lp), np.exp(lp_s[REFERENCE_SCORER])
                sc["tv_exact_vs_ref"] = pd.array(0.5 * np.abs(p - p_ref).sum(axis=1), dtype="Float64")
                sc["kl_exact_vs_ref"] = pd.array((p_ref * (lp_s[REFERENCE_SCORER] - lp)).sum(axis=1), dtype="Float64")
            bad = rng.choice(free, size=spec.n_nonfinite, replace=False)
            sc["nonfinite"] = sc.index.isin(bad)
            for c in ("logp", "entropy", "tv_exact_vs_ref", "kl_exact_vs_ref"):
                if c in sc:
                    sc.loc[bad, c] = pd.NA
            for c in ("topk_ids", "topk_logps", "logps_at_rollout_topk", "logps_at_ref_topk"):
                if c in sc:
                    sc[c] = [None if b else v for v, b in zip(sc[c], sc["nonfinite"])]
            scores.append(sc)

        n_seq = len(lengths)
        q = pd.DataFrame({"run_id": run_id, "seq_id": np.arange(n_seq), "prompt_id": [f"p{i // spec.group_size}" for i in range(n_seq)],
                              "sample_idx": np.arange(n_seq) % spec.group_size, "response_len": lengths,
                              "response_text": ["".join(texts[tok[seq_id == i]]) for i in range(n_seq)],
                              "finish_reason": "stop", "prompt_len": 16})  # fmt: skip
        if spec.rewards:
            reward = rng.integers(0, 2, size=n_seq).astype(float)
            q["reward"] = reward
            if spec.rewards == "advantage":
                q["advantage"] = reward - q.assign(r=reward).groupby("prompt_id")["r"].transform("mean").to_numpy()
        seqs.append(q)

    metrics = pd.DataFrame(columns=["run_id", "step", "name", "value"])
    if spec.train_steps:
        runs.append({"run_id": "synthetic-train", "study": "synthetic", "kind": "train", "status": "complete",
                         "created_at": pd.Timestamp("2026-01-02"), "model": "synthetic", "weights_sha256": "0" * 64,
                         "engine": "vllm", "engine_dtype": "bf16", "device": "cpu", "versions": "{}", "config": "{}"})  # fmt: skip
        steps = np.arange(spec.train_steps)
        metrics = pd.concat(
            [
                pd.DataFrame({"run_id": "synthetic-train", "step": steps, "name": name, "value": fn(steps)})
                for name, fn in TRAIN_SERIES.items()
            ],
            ignore_index=True,
        )
    frames = {
        "runs": pd.DataFrame(runs),
        "sequences": pd.concat(seqs, ignore_index=True),
        "tokens": pd.concat(toks, ignore_index=True),
        "scores": pd.concat(scores, ignore_index=True),
        "train_metrics": metrics,
    }
    write_store(path, frames)
    return SyntheticStore(Path(path), spec, frames, pd.DataFrame(planted, columns=["run_id", "seq_id", "pos", "factor"]))


TRAIN_SERIES = {
    "mismatch/abs_dp/mean": lambda s: 0.004 + 1e-4 * s,
    "mask/negative_adv/frac": lambda s: 0.001 * (s % 5),
    "actor/pg_clipfrac": lambda s: 0.01 + 0.0 * s,
}
"""The synthetic training run's series: value = fn(step), known exactly."""


def _plant(lp_row: np.ndarray, tok: int, target: float) -> np.ndarray:
    """The log-distribution with probability `target` on `tok` and the rest rescaled to 1 - target."""
    p = np.exp(lp_row)
    rest = 1.0 - p[tok]
    out = p * ((1.0 - target) / rest)
    out[tok] = target
    return np.log(out)


# -- the benchmark store ----------------------------------------------------------------------------------
BENCH_PAIRS = (
    # (run_id, engine, dtype, scorer, log-ratio scale sigma)
    ("bench-vllm-bf16", "vllm", "bf16", "hf:fp32", 0.05),
    ("bench-vllm-bf16", "vllm", "bf16", "hf:bf16", 0.07),
    ("bench-vllm-fp16", "vllm", "fp16", "hf:fp32", 0.006),
)
BENCH_VOCAB = 256
BENCH_TRAIN_STEPS = 2000


def build_benchmark_store(
    path: str | Path, n_tokens: int = 10_000_000, *, topk: int = 5, seed: int = 0, threads: int | None = None
) -> Path:
    """Write the benchmark store (module doc) at `path` (must not exist) with SQL only. Tokens have long-tailed
    mu (log mu = -12 u^3), sequence lengths uniform on [1, 1023], log-ratio noise sigma * z * (1 - mu) *
    (1 + sqrt(-log mu)) (spread grows as mu -> 0, vanishes as mu -> 1, as in DPPO Fig. 2), one score row
    in 1e5 non-finite."""
    path = Path(path)
    if path.exists():
        raise FileExistsError(f"{path} exists; pass a fresh path")
    con = duckdb.connect(str(path))
    try:
        con.execute("SET enable_progress_bar = false")
        if threads:
            con.execute(f"SET threads = {int(threads)}")
        con.execute("SET preserve_insertion_order = false")
        create_schema(con)
        # u(i, k): a uniform [0, 1) from a hash of (counter, stream, seed); nz: a standard normal (Box-Muller)
        con.execute(f"CREATE TEMP MACRO u(i, k) AS ((hash(i, k, {int(seed)}) >> 11)::DOUBLE / 9007199254740992.0)")
        con.execute("CREATE TEMP MACRO nz(i, k) AS sqrt(-2.0 * ln(1.0 - u(i, k))) * cos(2.0 * pi() * u(i, k + 1000))")
        words = [f" w{i}" for i in range(BENCH_VOCAB - len(VOCAB))]
        vocab = pd.DataFrame({"token_id": range(BENCH_VOCAB), "token_text": [*VOCAB, *words]})
        vocab["category"] = [categorize(t, i in SPECIAL_IDS) for i, t in enumerate(vocab["token_text"])]
        con.register("_vocab", vocab)
        con.execute("CREATE TEMP TABLE vocab AS SELECT token_id::INTEGER AS token_id, token_text, category FROM _vocab")

        runs = sorted({(r, e, dt) for r, e, dt, _, _ in BENCH_PAIRS})
        halves = [n_tokens // len(runs) + (1 if i < n_tokens % len(runs) else 0) for i in range(len(runs))]
        for i, ((run_id, engine, dtype), n_run) in enumerate(zip(runs, halves)):
            _bench_run(con, run_id, engine, dtype, n_run, offset=i * 10 * n_tokens, topk=topk,
                       pairs=[(s, sig) for r, _, _, s, sig in BENCH_PAIRS if r == run_id])  # fmt: skip
        con.execute(
            "INSERT INTO runs (run_id, study, kind, created_at, status, model, engine, engine_dtype, device) "
            "VALUES ('bench-train', 'benchmark', 'train', TIMESTAMP '2026-01-02', 'complete', 'synthetic', "
            "'vllm', 'bf16', 'cpu')"
        )
        names = ", ".join(f"('{name}', {i})" for i, name in enumerate(TRAIN_SERIES))
        con.execute(
            f"""INSERT INTO train_metrics
                SELECT 'bench-train', s, n.name, 0.004 + 1e-5 * s * (1 + n.i) + 1e-4 * u(s, 50 + n.i)
                FROM range({BENCH_TRAIN_STEPS}) t(s), (VALUES {names}) n(name, i)"""
        )
        con.execute("CHECKPOINT")
    finally:
        con.close()
    return path


SCORE_COLUMNS = ", ".join(c[0] for c in COLUMNS["scores"][:13])
"""The scores columns _bench_run fills, in contract order (the optional columns added later stay NULL)."""


def _bench_run(con, run_id: str, engine: str, dtype: str, n_run: int, *, offset: int, topk: int, pairs) -> None:
    con.execute(
        "INSERT INTO runs (run_id, study, kind, created_at, status, model, weights_sha256, engine, engine_dtype, "
        "device, versions, config) VALUES (?, 'benchmark', 'collect', TIMESTAMP '2026-01-01', 'complete', "
        "'synthetic', '', ?, ?, 'cpu', '{}', '{}')",
        [run_id, engine, dtype],
    )
    n_cand = n_run // 400 + 10  # mean length 512: enough candidates to cover n_run tokens
    con.execute(
        f"""CREATE OR REPLACE TEMP TABLE seqs AS
            WITH c AS (SELECT k AS seq_id, 1 + floor(u(k + {offset}, 1) * 1023)::INTEGER AS len FROM range({n_cand}) t(k)),
                 s AS (SELECT seq_id, len, sum(len) OVER (ORDER BY seq_id) - len AS start FROM c)
            SELECT seq_id, start, least(len, {n_run} - start)::INTEGER AS len FROM s WHERE start < {n_run}"""
    )
    covered = con.execute("SELECT sum(len) FROM seqs").fetchone()[0]
    assert covered == n_run, f"sequence lengths cover {covered} of {n_run} tokens"
    con.execute(
        f"""INSERT INTO sequences (run_id, seq_id, prompt_id, sample_idx, response_len, finish_reason, reward, prompt_len)
            SELECT '{run_id}', seq_id, 'p' || (seq_id // 8), (seq_id % 8)::INTEGER, len,
                   CASE WHEN len = 1023 THEN 'length' ELSE 'stop' END,
                   (u(seq_id + {offset}, 2) < 0.4)::DOUBLE, 64
            FROM seqs"""
    )
    # One staging row per token: its global counter g, mu, and the top-K (mu's ids skip the sampled one).
    k = int(topk)
    top_ids = f"list_transform(range({k}), lambda j: ((token_id + 1 + j) % {BENCH_VOCAB})::INTEGER)"
    top_lps = f"list_transform(range({k}), lambda j: ln(greatest(1.0 - exp(lmu), 1e-12)) - (j + 1) * ln(2.0))"
    con.execute(
        f"""CREATE OR REPLACE TEMP TABLE stage AS
            SELECT seq_id, pos, g, token_id, lmu, {top_ids if k else 'NULL::INTEGER[]'} AS k_ids,
                   {top_lps if k else 'NULL::DOUBLE[]'} AS k_lps
            FROM (SELECT seq_id, pos, {offset} + start + pos AS g,
                         floor(u({offset} + start + pos, 3) * {BENCH_VOCAB})::INTEGER AS token_id,
                         -12.0 * pow(u({offset} + start + pos, 4), 3) AS lmu
                  FROM (SELECT seq_id, start, unnest(range(len)) AS pos FROM seqs))"""
    )
    con.execute(
        f"""INSERT INTO tokens
            SELECT '{run_id}', seq_id, pos::INTEGER, s.token_id, v.token_text, v.category, lmu, k_ids, k_lps
            FROM stage s JOIN vocab v USING (token_id)"""
    )
    spread = "(1.0 - exp(lmu)) * (1.0 + sqrt(-lmu))"
    # hf:fp32 noise is stream 10; every other scorer adds its own noise on top of it (stream 20 + i),
    # so the exact TV of a scorer against hf:fp32 can be formed from the two.
    fp32_sigma = {s: sig for s, sig in pairs}.get(REFERENCE_SCORER, 0.0)
    lp_ref = f"least(lmu + {fp32_sigma!r} * nz(g, 10) * {spread}, 0.0)"
    for i, (scorer, sigma) in enumerate(pairs):
        is_ref = scorer == REFERENCE_SCORER
        extra = math.sqrt(max(sigma**2 - fp32_sigma**2, 0.0))
        lp = lp_ref if is_ref else f"least({lp_ref} + {extra!r} * nz(g, {20 + 2 * i}) * {spread}, 0.0)"
        at_topk = f"list_transform(k_lps, lambda x, j: x + {sigma!r} * 0.5 * nz(g * 64 + j, {30 + 2 * i}))"
        ref_k = f"list_transform(k_lps, lambda x, j: x + {fp32_sigma!r} * 0.5 * nz(g * 64 + j, 30))"
        exact = f"abs(exp({lp}) - exp({lp_ref})) + 0.02 * u(g, {40 + i}) * {spread}"
        con.execute(
            f"""INSERT INTO scores ({SCORE_COLUMNS})
                SELECT '{run_id}', seq_id, pos::INTEGER, '{scorer}',
                       CASE WHEN NOT bad THEN logp END, CASE WHEN NOT bad THEN 3.0 * (1.0 - exp(lmu)) + 0.1 * u(g, 60) END,
                       {'k_ids' if is_ref and k else 'NULL'}, {ref_k if is_ref and k else 'NULL'},
                       {'NULL' if is_ref else f'CASE WHEN NOT bad THEN {exact} END'},
                       {'NULL' if is_ref else f'CASE WHEN NOT bad THEN 2.0 * ({exact}) * ({exact}) END'},
                       bad,
                       {f'CASE WHEN NOT bad THEN {at_topk} END' if k else 'NULL'},
                       {f'CASE WHEN NOT bad THEN {at_topk} END' if k and not is_ref else 'NULL'}
                FROM (SELECT *, {lp} AS logp, u(g, 70 + {i}) < 1e-5 AS bad FROM stage)"""
        )
    con.execute("DROP TABLE stage")


# -- runs over steps and stores holding only some optional columns ---------------------------------------
# Runs recorded in, or imported from, a user's RL framework hold only the data contract's required columns
# (REQUIRED_COLUMNS) and whichever optional groups the framework could give (OPTIONAL_GROUPS). The helpers
# below turn a synthetic store into one: `stepped_frames` spreads runs over training steps (and relabels
# them as such a run would be), `subset_store` writes a copy holding only the required columns plus the
# optional groups asked for, as a Parquet directory or as a DuckDB file whose tables lack the others.

REQUIRED_COLUMNS: dict[str, tuple[str, ...] | None] = {
    "runs": None,  # every column
    "sequences": ("run_id", "seq_id", "step", "response_len"),
    "tokens": ("run_id", "seq_id", "pos", "token_id", "logp_rollout"),
    "scores": ("run_id", "seq_id", "pos", "scorer", "logp", "nonfinite"),
    "train_metrics": None,
}
"""table -> the columns every store holds (None: all of the table's columns)."""

OPTIONAL_GROUPS: dict[str, dict[str, tuple[str, ...]]] = {
    "topk": {"tokens": ("topk_ids_rollout", "topk_logps_rollout"),
             "scores": ("topk_ids", "topk_logps", "logps_at_rollout_topk", "logps_at_ref_topk")},
    "entropy": {"scores": ("entropy",)},
    "exact": {"scores": ("tv_exact_vs_ref", "kl_exact_vs_ref")},
    "text": {"tokens": ("token_text", "category")},
    "rewards": {"sequences": ("reward", "advantage")},
    "prompts": {"sequences": ("prompt_id", "sample_idx", "response_text", "finish_reason", "prompt_len")},
}  # fmt: skip
"""group -> table -> the optional columns that come together (a tokenizer gives text and category, ...)."""


def stepped_frames(
    frames: dict[str, pd.DataFrame],
    steps: int,
    *,
    run_ids: list[str] | None = None,
    kind: str = "record",
    engine_dtype: str | None = None,
    scorers: dict[str, str] | None = None,
    drift: float = 0.0,
) -> dict[str, pd.DataFrame]:
    """A copy of synthetic frames in which the runs `run_ids` (default: every run holding sequences) are runs
    over `steps` training steps: kind `kind` (one of schema.RUN_KINDS), engine_dtype `engine_dtype` (None =
    unknown, so the rollout label is the engine alone), scorers renamed by `scorers` (e.g. {'hf:fp32':
    'trl:fp32'}), and their sequences spread over the steps in contiguous blocks of prompt groups (sequence
    i of n gets step floor(group(i) * steps / n_groups)), so a GRPO group never spans two steps. drift > 0
    plants a mismatch that grows with the step: every score row of step s gets log pi lowered by drift * s
    (pi shrinks, so it stays a probability), i.e. dlogp moves by exactly -drift * s against the unshifted
    store."""
    out = {k: v.copy() for k, v in frames.items()}
    seqs = out["sequences"]
    ids = list(dict.fromkeys(seqs["run_id"])) if run_ids is None else list(run_ids)
    runs = out["runs"]
    chosen = runs["run_id"].isin(ids)
    runs.loc[chosen, "kind"] = kind
    runs["engine_dtype"] = runs["engine_dtype"].astype(object)
    runs.loc[chosen, "engine_dtype"] = engine_dtype
    step = pd.array([pd.NA] * len(seqs), dtype="Int64") if "step" not in seqs else seqs["step"].astype("Int64")
    for run_id in ids:
        mine = (seqs["run_id"] == run_id).to_numpy()
        part = seqs.loc[mine]
        # prompt groups in order of first appearance (the frames are ordered by seq_id)
        group = pd.factorize(part["prompt_id"] if "prompt_id" in part else part["seq_id"])[0]
        n_groups = int(group.max()) + 1 if len(group) else 1
        step[mine] = (group * steps) // n_groups
    seqs["step"] = step
    out["sequences"] = seqs
    sc = out["scores"]
    mine = sc["run_id"].isin(ids)
    if drift:
        step_of = seqs.set_index(["run_id", "seq_id"])["step"]
        s = step_of.reindex(pd.MultiIndex.from_frame(sc[["run_id", "seq_id"]])).to_numpy(dtype=float, na_value=0.0)
        sc["logp"] = sc["logp"].astype("Float64") - np.where(mine, drift * s, 0.0)
    if scorers:
        sc.loc[mine, "scorer"] = sc.loc[mine, "scorer"].map(lambda x: scorers.get(x, x))
    out["scores"] = sc
    return out


def subset_store(src: str | Path, out: str | Path, groups=(), *, form: str = "parquet") -> Path:
    """Copy the store at `src` (a DuckDB file) to `out` holding only REQUIRED_COLUMNS plus the columns of
    the OPTIONAL_GROUPS named in `groups`. form='parquet': `out/<table>.parquet` for runs, sequences,
    tokens, scores and train_metrics (the reader then fills the absent contract columns with NULLs);
    form='duckdb': a DuckDB file at `out` whose tables physically lack the other columns (and which has no
    bookkeeping tables but `meta`, whose schema_version makes the file a store of ours). `out` must not exist."""
    src, out = Path(src), Path(out)
    unknown = set(groups) - set(OPTIONAL_GROUPS)
    if unknown:
        raise ValueError(f"unknown optional groups {sorted(unknown)}; known: {sorted(OPTIONAL_GROUPS)}")
    if form not in ("parquet", "duckdb"):
        raise ValueError("form must be 'parquet' or 'duckdb'")
    if out.exists():
        raise FileExistsError(f"{out} exists; pass a fresh path")
    con = duckdb.connect()
    try:
        con.execute(f"ATTACH '{src}' AS src (READ_ONLY)")
        if form == "duckdb":
            con.execute(f"ATTACH '{out}' AS dst")
        else:
            out.mkdir(parents=True)
        for table, required in REQUIRED_COLUMNS.items():
            have = [r[0] for r in con.execute(f"DESCRIBE src.{table}").fetchall()]
            keep = set(have) if required is None else set(required)
            for g in groups:
                keep |= set(OPTIONAL_GROUPS[g].get(table, ()))
            select = ", ".join(c for c in have if c in keep)
            if form == "duckdb":
                con.execute(f"CREATE TABLE dst.{table} AS SELECT {select} FROM src.{table}")
            else:
                con.execute(f"COPY (SELECT {select} FROM src.{table}) TO '{out / (table + '.parquet')}' (FORMAT parquet)")
        if form == "duckdb":
            con.execute("CREATE TABLE dst.meta AS SELECT * FROM src.meta")
    finally:
        con.close()
    return out
