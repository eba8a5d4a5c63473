"""Helpers for the importer tests: dumps written the way each framework writes them, naive readers.

prime-rl: `TokenExporter._write` writes `json.dumps(record, separators=(",", ":"), allow_nan=False)`, one
line per exported slice, keys in the exporter's order, non-finite floats as null (its `_json_float`),
prompt positions with loss_mask false and inference_logprobs 0.0 (its `prepare_sample`), `losses` as one
{loss name: {"advantage", "mask"}} dict per position. A step folder gets `STABLE` once every rank flushed.
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import numpy as np


def _jf(x):
    """prime-rl's _json_float: None for None and non-finite values."""
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def prime_sample(rng, prompt_len: int, response_len: int, *, reward: float, adv: float, env: str = "gsm8k",
                 nan_mu: tuple = (), nan_pi: tuple = (), ce_only: tuple = ()) -> dict:
    """One sample's per-position columns (prompt then response). nan_mu / nan_pi: response indices whose
    log mu / log pi is not finite (written as null); ce_only: response indices trained only by a "ce"
    channel (loss_mask true, rl mask false)."""
    T = prompt_len + response_len
    mask = [False] * prompt_len + [True] * response_len
    mu = [0.0] * prompt_len + [float(-rng.exponential(0.7)) for _ in range(response_len)]
    pi = [0.0 if i < prompt_len else min(mu[i] + float(rng.normal(0, 0.05)), 0.0) for i in range(T)]  # log pi <= 0
    for i in nan_mu:
        mu[prompt_len + i] = float("nan")
    for i in nan_pi:
        pi[prompt_len + i] = float("inf")
    rl_mask = list(mask)
    ce_mask = [False] * T
    for i in ce_only:
        rl_mask[prompt_len + i] = False
        ce_mask[prompt_len + i] = True
    advs = [adv] * T
    return {
        "token_ids": [int(t) for t in rng.integers(5, 40000, T)],
        "position_ids": list(range(T)),
        "loss_mask": mask,
        "advantages": advs,
        # the "ce" channel only where this sample uses it (files without it take the importer's rl-only path)
        "losses": [({"ce": {"advantage": 0.0, "mask": c}} if ce_only else {}) | {"rl": {"advantage": a, "mask": m}}
                   for a, m, c in zip(advs, rl_mask, ce_mask)],
        "rewards": [reward] * T,
        "inference_logprobs": mu,
        "trainer_logprobs": pi,
        "entropy": [float(rng.exponential(1.0)) for _ in range(T)],
        "env_names": [env] * T,
    }


def _derived(f, pi: list, mu: list) -> list:
    """A column the exporter derives from log pi and log mu (null where either is not finite)."""
    return [_jf(f(a, b)) if math.isfinite(a) and math.isfinite(b) else None for a, b in zip(pi, mu)]


def prime_line(samples: list[dict], *, step: int, rank: int, micro_step: int = 0, idx: int = 0) -> str:
    """One exported line holding `samples` packed one after another (position_ids restart at 0)."""
    cols = {k: [v for s in samples for v in s[k]] for k in samples[0]}
    T = len(cols["token_ids"])
    mu, pi = cols["inference_logprobs"], cols["trainer_logprobs"]
    record = {
        "schema_version": 1, "step": step, "export_step": step, "rank": rank, "micro_step": micro_step,
        "micro_sequence_idx": 0, "export_sequence_idx": idx, "run_id": None,
        "env_name": next((e for e in cols["env_names"] if e), None),
        "token_ids": cols["token_ids"], "position_ids": cols["position_ids"], "loss_mask": cols["loss_mask"],
        "advantages": [_jf(x) for x in cols["advantages"]], "losses": cols["losses"],
        "rewards": [_jf(x) for x in cols["rewards"]],
        "inference_logprobs": [_jf(x) for x in mu], "trainer_logprobs": [_jf(x) for x in pi],
        "entropy": [_jf(x) for x in cols["entropy"]],
        "mismatch_kl": _derived(lambda a, b: math.exp(b - a) - (b - a) - 1, pi, mu),
        "log_importance_ratio": _derived(lambda a, b: a - b, pi, mu),
        "importance_ratio": _derived(lambda a, b: math.exp(a - b), pi, mu),
        "prob_delta": _derived(lambda a, b: math.exp(a) - math.exp(b), pi, mu),
        "is_masked": [False] * T, "is_masked_high": [False] * T, "is_masked_low": [False] * T,
    }  # fmt: skip
    return json.dumps(record, separators=(",", ":"), allow_nan=False)


def write_prime_export(output_dir: Path, seed: int = 0, run_id: str | None = None) -> Path:
    """A small export: step 0 (STABLE) and step 1 (no STABLE), ranks 0 and 1, packed lines with two
    samples, prompt tokens, null log-probs and a ce-only position. Returns the token_exports folder."""
    rng = np.random.default_rng(seed)
    base = output_dir / run_id if run_id else output_dir
    exports = base / "token_exports"
    for step in (0, 1):
        d = exports / f"step_{step}"
        d.mkdir(parents=True)
        for rank in (0, 1):
            lines = [
                prime_line([prime_sample(rng, 4, 6, reward=1.0, adv=0.5, nan_mu=(2,) if rank == 0 else ()),
                            prime_sample(rng, 3, 5, reward=0.0, adv=-0.5, nan_pi=(0,) if rank == 1 else (),
                                         env="math")], step=step, rank=rank, idx=0),
                prime_line([prime_sample(rng, 5, 7, reward=0.5, adv=0.25, ce_only=(6,) if rank == 0 else ())],
                           step=step, rank=rank, micro_step=1, idx=1),
            ]
            (d / f"rank_{rank}.jsonl").write_text("\n".join(lines) + "\n")
        if step == 0:
            (d / "STABLE").touch()
    return exports


def naive_prime(files: list[Path]) -> dict:
    """Expected stored rows from a plain json.loads reading: (step, rank, sample index) -> dict with the
    stored positions' tokens, mu, pi, advantage, entropy, reward, env_name. Samples split at position 0;
    stored = loss_mask and the rl channel's mask."""
    out = {}
    for f in files:
        step = int(f.parent.name.split("_")[1])
        rank = int(f.stem.split("_")[1])
        index = 0
        for line in f.read_text().splitlines():
            if not line.strip():
                continue
            rec = json.loads(line)
            starts = [i for i, p in enumerate(rec["position_ids"]) if p == 0] + [len(rec["token_ids"])]
            for a, b in itertools.pairwise(starts):
                keep = [i for i in range(a, b) if rec["loss_mask"][i] and rec["losses"][i].get("rl", {}).get("mask")]
                if not keep:
                    continue
                first = keep[0]
                out[(step, rank, index)] = {
                    "pos": [i - first for i in keep],
                    "token_id": [rec["token_ids"][i] for i in keep],
                    "mu": [rec["inference_logprobs"][i] for i in keep],
                    "pi": [rec["trainer_logprobs"][i] for i in keep],
                    "adv": [rec["advantages"][i] for i in keep],
                    "entropy": [rec["entropy"][i] for i in keep],
                    "reward": rec["rewards"][first], "env_name": rec["env_name"], "prompt_len": first - a,
                }
                index += 1
    return out


def _dicts(cursor) -> list[dict]:
    names = [d[0] for d in cursor.description]
    return [dict(zip(names, row)) for row in cursor.fetchall()]


def stored(store: Path, run_id: str) -> dict:
    """(step, rank, sample index) -> the stored rows of that sequence, read back through open_store."""
    from mismatch_lab.record.arrow import INDEX_BITS
    from mismatch_lab.store.reader import open_store

    con = open_store(store)
    seqs = _dicts(con.execute("SELECT * FROM sequences WHERE run_id = ? ORDER BY seq_id", [run_id]))
    toks = _dicts(con.execute(
        """SELECT t.*, s.logp, s.entropy, s.nonfinite
           FROM tokens t JOIN scores s USING (run_id, seq_id, pos) WHERE t.run_id = ? ORDER BY t.seq_id, t.pos""",
        [run_id]))
    con.close()
    by_seq: dict[int, list] = {}
    for t in toks:
        by_seq.setdefault(t["seq_id"], []).append(t)
    out = {}
    for s in seqs:
        sid = s["seq_id"]
        key = (sid >> 32, (sid >> INDEX_BITS) & 0xFFF, sid & ((1 << INDEX_BITS) - 1))
        out[key] = {"seq": s, "tokens": by_seq.get(sid, [])}
    return out


def same(a, b) -> bool:
    """Equal floats, None for None (a null stored value)."""
    if a is None or b is None:
        return a is None and b is None
    return math.isclose(a, b, rel_tol=0, abs_tol=1e-12)


def store_files(store: Path) -> list[str]:
    """Every file under the store except the marker, relative, sorted."""
    return sorted(str(p.relative_to(store)) for p in store.rglob("*") if p.is_file() and p.name != "mismatch-lab-store.json")


def counts(store: Path) -> dict[str, int]:
    from mismatch_lab.store.reader import open_store

    con = open_store(store)
    out = {t: con.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in ("runs", "sequences", "tokens", "scores")}
    con.close()
    return out


def slime_payload(rollout_id: int, rank: int = 0, seed: int = 0, *, topk: int = 0, n: int = 4,
                  placeholder: bool = True) -> dict:
    """A train-data dump as slime's `_build_dump_payload` builds it (format_version 2): samples sorted
    by rollout_position, per-sample tensors on CPU, `raw_reward` stored once at the top. With
    `placeholder`, sample 1 has masked response slots whose rollout log-prob is miles' 0.0 placeholder."""
    import torch

    rng = np.random.default_rng(seed)
    samples = []
    order = list(rng.permutation(n))  # sample_index differs from rollout_position
    for pos in range(n):
        P, R = int(rng.integers(3, 7)), int(rng.integers(4, 9))
        mask = np.ones(R, dtype=np.int64)
        if placeholder and pos == 1:
            mask[1:3] = 0  # e.g. tool output inside a multi-turn reply
        mu = -rng.exponential(0.6, R)
        mu[mask == 0] = 0.0  # miles' placeholder in masked slots
        s = {
            "data_parallel_rank": pos % 2, "sample_index": int(order[pos]) + 100, "rollout_position": pos,
            "tokens": torch.tensor(rng.integers(5, 30000, P + R), dtype=torch.long),
            "response_lengths": R, "total_lengths": P + R, "rewards": float(rng.normal()), "truncated": 0,
            "loss_masks": torch.tensor(mask, dtype=torch.int),
            "rollout_log_probs": torch.tensor(mu, dtype=torch.float32),
            "log_probs": torch.tensor(np.minimum(mu + rng.normal(0, 0.03, R), 0.0), dtype=torch.float32),
            "advantages": torch.tensor(np.full(R, rng.normal()), dtype=torch.float32),
            "returns": torch.tensor(np.zeros(R), dtype=torch.float32),
            "entropy": torch.tensor(rng.exponential(1.0, R), dtype=torch.float32),
        }  # fmt: skip
        if topk:
            s["rollout_topk_token_ids"] = torch.tensor(rng.integers(0, 30000, (R, topk)), dtype=torch.long)
            s["rollout_topk_log_probs"] = torch.tensor(-rng.exponential(2.0, (R, topk)), dtype=torch.float32)
        samples.append(s)
    return {"format_version": 2, "rollout_id": rollout_id, "rank": rank, "samples": samples,
            "dp_shards": [{"rank": rank, "data_parallel_rank": d, "sample_indices": None, "partition": None,
                           "micro_batch_indices": [[0, 1]], "num_microbatches": [1]} for d in (0, 1)],
            "raw_reward": [float(rng.integers(0, 2)) for _ in range(n)]}


def naive_slime(payload: dict) -> dict:
    """(step, rank, index) -> expected stored rows of a slime payload, read with plain Python."""
    out, index = {}, 0
    for s in payload["samples"]:
        R, T = s["response_lengths"], s["total_lengths"]
        mask = [int(x) for x in s["loss_masks"].tolist()]
        keep = [i for i in range(R) if mask[i]]
        if not keep:
            continue
        tokens = s["tokens"].tolist()[T - R:]
        mu, pi = s["rollout_log_probs"].tolist(), s["log_probs"].tolist()
        adv, ent = s["advantages"].tolist(), s["entropy"].tolist()
        out[(payload["rollout_id"], payload["rank"], index)] = {
            "pos": [i - keep[0] for i in keep], "token_id": [tokens[i] for i in keep],
            "mu": [_jf(mu[i]) for i in keep], "pi": [_jf(pi[i]) for i in keep], "adv": [adv[i] for i in keep],
            "entropy": [ent[i] for i in keep], "reward": payload["raw_reward"][s["rollout_position"]],
            "prompt_len": T - R,
            "topk": None if "rollout_topk_token_ids" not in s else
            [(s["rollout_topk_token_ids"][i].tolist(), s["rollout_topk_log_probs"][i].tolist()) for i in keep],
        }  # fmt: skip
        index += 1
    return out


def jsonl_lines(seed: int = 0, n: int = 6, *, adv_form: str = "list") -> list[dict]:
    """Sequences in mismatch-lab's JSON-lines format: steps 0 and 1 interleaved, two ranks, a prompt
    masked out on some lines, advantage per token ("list") or per sequence ("number")."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        T = int(rng.integers(3, 9))
        mu = [float(-rng.exponential(0.5)) for _ in range(T)]
        rec = {"step": i % 2, "rank": (i // 2) % 2, "token_ids": [int(t) for t in rng.integers(0, 50000, T)],
               "logp_rollout": mu, "logp_trainer": [min(m + float(rng.normal(0, 0.02)), 0.0) for m in mu],
               "reward": float(rng.integers(0, 2)), "prompt_id": f"p{i // 3}",
               "entropy": [float(rng.exponential(1.0)) for _ in range(T)]}
        if i % 3 == 1:
            rec["mask"] = [False, False] + [True] * (T - 2)
        rec["advantage"] = [float(rng.normal())] * T if adv_form == "list" else float(rng.normal())
        if i % 2 == 0:
            K = 3
            rec["rollout_topk_ids"] = [[int(x) for x in rng.integers(0, 50000, K)] for _ in range(T)]
            rec["rollout_topk_logps"] = [[float(-rng.exponential(2.0)) for _ in range(K)] for _ in range(T)]
        out.append(rec)
    return out


def naive_jsonl(records: list[dict], start: dict | None = None) -> dict:
    """(step, rank, index) -> expected stored rows; indices per (step, rank) in line order."""
    nxt = dict(start or {})
    out = {}
    for rec in records:
        T = len(rec["token_ids"])
        mask = [bool(x) for x in rec.get("mask") or [True] * T]
        keep = [i for i in range(T) if mask[i]]
        if not keep:
            continue
        key = (rec["step"], rec.get("rank", 0))
        index = nxt.get(key, 0)
        nxt[key] = index + 1
        adv = rec.get("advantage")
        out[(*key, index)] = {
            "pos": [i - keep[0] for i in keep], "token_id": [rec["token_ids"][i] for i in keep],
            "mu": [_jf(rec["logp_rollout"][i]) for i in keep], "pi": [_jf(rec["logp_trainer"][i]) for i in keep],
            "adv_tok": [adv[i] for i in keep] if isinstance(adv, list) else None,
            "adv_seq": None if adv is None else (sum(adv[i] for i in keep) / len(keep) if isinstance(adv, list) else adv),
            "reward": rec.get("reward"), "prompt_id": None if rec.get("prompt_id") is None else str(rec["prompt_id"]),
            "entropy": [rec["entropy"][i] for i in keep] if rec.get("entropy") else None,
            "topk": [(rec["rollout_topk_ids"][i], rec["rollout_topk_logps"][i]) for i in keep]
            if rec.get("rollout_topk_ids") else None,
        }  # fmt: skip
    return out


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path
