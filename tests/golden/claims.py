"""Every number the claims table of studies/README.md quotes, tied to the golden numbers it comes from.

`quotes(g)` lists one `Quote` per fragment of a claim row: the fragment as the table writes it, with each
checked number in braces, and for each brace the golden value(s) behind it (a fraction where the table
writes `%`: it is multiplied by 100). A quoted number must be the value rounded to the digits it is written
with: "0.100" holds for 0.09950 … 0.10050, "2.3e-3" for 2.25e-3 … 2.35e-3, "14,116" only for 14116; where a
brace stands for several values (a range's end, "each", "for all"), every one of them must round to it.
An explicit `unit` widens that to the stated rounding step ("2,100" with unit=100).
`CONTEXT` lists the numbers of the table that are not data of the stored results (thresholds, study sizes,
the papers' values) with the reason; tests/test_golden.py requires every number of the table to be in one
of the two lists, checks each quote against tests/golden/<study>.json, and those files against the
committed Parquet.

The golden values are read with `Golden`: `g.one(study, table, **where)` is the single row of the analyze
table matching `where`; `g.col(study, table, column, **where)` the column over every matching row;
`g.train(loss, name)` a dppo-sanity training run's metric by step ({step: value}, `analyze` key
violations, source train_metrics), its run found by the objective in the run id.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass
from itertools import pairwise

NUMBER = re.compile(r"(?<![\w.])(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:e[−-]?\d+)?")
SIGNED = re.compile(r"[−+-]?" + NUMBER.pattern.replace("(?<![\\w.])", ""))
BRACED = re.compile(r"\{([^{}]*)\}")


def _spans(text: str) -> list[tuple[int, int]]:
    """(start, end) in the unbraced fragment of every braced part."""
    out, removed = [], 0
    for m in BRACED.finditer(text):
        start = m.start() - removed
        out.append((start, start + len(m.group(1))))
        removed += 2
    return out


@dataclass(frozen=True)
class Quote:
    claim: int
    text: str  # the fragment of the claim row, each checked number in {}
    values: tuple  # one per brace: a number or a list of numbers (each must round to the quote)
    unit: float | None = None  # rounding step, if coarser than the digits written
    holds: bool | None = None  # a statement of the fragment in words ("none", "identical"), evaluated on the data

    @property
    def fragment(self) -> str:
        return BRACED.sub(r"\1", self.text)

    def locate(self, row: str) -> re.Match | None:
        """The fragment in the row, whatever numbers stand in its braces (so a changed number is reported as
        wrong, not as a missing fragment)."""
        parts = BRACED.split(self.text)  # literal, braced, literal, ...
        pattern = "".join(re.escape(p) if i % 2 == 0 else f"({SIGNED.pattern})" for i, p in enumerate(parts))
        return re.search(pattern, row)

    def problems(self, found: re.Match) -> list[str]:
        braces = found.groups()
        if len(braces) != len(self.values):
            return [f"{len(braces)} braced numbers but {len(self.values)} values"]
        out = [] if self.holds is not False else ["the statement does not hold on the data"]
        for i, (quoted, value) in enumerate(zip(braces, self.values), start=1):
            percent = found.string[found.end(i):].lstrip().startswith("%")
            q, unit = parse(quoted)
            unit = max(unit, self.unit or 0.0)
            for v in value if isinstance(value, (list, tuple)) else [value]:
                if v is None:
                    out.append(f"{quoted}: the golden value is null")
                    continue
                shown = v * 100 if percent else v
                if abs(shown - q) > unit / 2 * (1 + 1e-9):
                    out.append(f"{quoted}{' %' if percent else ''} quoted, the data give {shown:.6g}")
        return out


@dataclass(frozen=True)
class Context:
    claim: int
    text: str  # fragment with the numbers it explains in {}
    reason: str

    @property
    def fragment(self) -> str:
        return BRACED.sub(r"\1", self.text)

    def spans(self) -> list[tuple[int, int]]:
        return _spans(self.text)


def parse(quoted: str) -> tuple[float, float]:
    """The number written and its last digit's unit: '0.100' -> (0.1, 0.001), '2.3e-3' -> (0.0023, 1e-4)."""
    s = quoted.replace("−", "-").replace(",", "").replace("+", "")
    mantissa, _, exp = s.partition("e")
    decimals = len(mantissa.split(".")[1]) if "." in mantissa else 0
    return float(s), 10.0 ** ((int(exp) if exp else 0) - decimals)


class Golden:
    def __init__(self, docs: dict[str, dict]):
        self.docs = docs
        self._index: dict[tuple, dict[tuple, list[dict]]] = {}  # (study, table, columns) -> values -> rows

    def rows(self, study: str, table: str, **where) -> list[dict]:
        """The rows of `table` whose columns equal `where`, in stored order (an index per set of columns: the
        claims look up thousands of rows many times)."""
        columns = tuple(sorted(where))
        key = (study, table, columns)
        if key not in self._index:
            index: dict[tuple, list[dict]] = {}
            for r in self.docs[study]["analyze"][table]["rows"]:
                index.setdefault(tuple(r.get(c) for c in columns), []).append(r)
            self._index[key] = index
        return list(self._index[key].get(tuple(where[c] for c in columns), []))

    def one(self, study: str, table: str, **where) -> dict:
        found = self.rows(study, table, **where)
        if len(found) != 1:
            raise LookupError(f"{study} {table} {where}: {len(found)} rows, expected one")
        return found[0]

    def col(self, study: str, table: str, column: str, **where) -> list:
        found = self.rows(study, table, **where)
        if not found:
            raise LookupError(f"{study} {table} {where}: no rows")
        return [r.get(column) for r in found]

    def correction(self, study: str, **where) -> dict:
        """The single row of the `corrections` result kind matching `where`."""
        found = [r for r in self.docs[study]["corrections"]["corrections"]["rows"]
                 if all(r.get(c) == v for c, v in where.items())]
        if len(found) != 1:
            raise LookupError(f"{study} corrections {where}: {len(found)} rows, expected one")
        return found[0]

    def check(self, study: str, check: str, pair: str) -> dict:
        """The single row of the `doctor` result kind's checks of `check` on `pair` ('rollout/scorer')."""
        found = [r for r in self.docs[study]["doctor"]["checks"]["rows"] if r["check"] == check and r["pair"] == pair]
        if len(found) != 1:
            raise LookupError(f"{study} doctor {check} {pair}: {len(found)} rows, expected one")
        return found[0]

    def train(self, loss: str, name: str) -> dict[int, float]:
        out = {r["step"]: r.get("value") for r in self.rows("dppo-sanity", "violations", source="train_metrics", name=name)
               if r["run_id"].startswith(f"dppo-sanity-train-{loss}-")}
        if not out:
            raise LookupError(f"no train_metrics {name} for {loss}")
        return out

    def run_metric(self, study: str, run_id: str, name: str) -> dict[int, float]:
        """A training run's logged metric by step ({step: value}) from the study's train_metrics."""
        out = {r["step"]: r.get("value") for r in self.rows(study, "violations", source="train_metrics", name=name,
                                                             run_id=run_id)}
        if not out:
            raise LookupError(f"{study}: no train_metrics {name} for {run_id}")
        return out

    def run_steps(self, study: str, run_id: str, column: str) -> dict[int, float]:
        """A run's per-step series measured from its stored tokens (analyze key steps, scorer of the run)."""
        out = {r["step"]: r.get(column) for r in self.rows(study, "steps", run_id=run_id)}
        if not out:
            raise LookupError(f"{study}: no steps rows for {run_id}")
        return out


# studies/stability: its eleven commands' run ids (TrainConfig.run_id() of each command of its study.toml)
STABILITY_RUNS = {
    "pg_is": "stability-train-pg_is-ac1d09b65f",
    "dppo_binary_tv": "stability-train-dppo_binary_tv-18403fe7c6",
    "pg_is fp8": "stability-train-pg_is-8f08d42417",
    "dppo_binary_tv fp8": "stability-train-dppo_binary_tv-4c1b6b815a",
    "pg_is tie-grid": "stability-train-pg_is-baf7ed95e7",
    "dppo_topk_tv": "stability-train-dppo_topk_tv-6b712c8cc2",
    "dppo_binary_tv seed 1": "stability-train-dppo_binary_tv-0cc3d9073e",
    "dppo_topk_tv seed 1": "stability-train-dppo_topk_tv-f97975c412",
    "pg_is seed 1": "stability-train-pg_is-478b332efc",
    "pg_is fp8 seed 1": "stability-train-pg_is-07a55b501f",
    "dppo_binary_tv fp8 seed 1": "stability-train-dppo_binary_tv-c9dd7ad425",
}
ACC, LEN = "reward/accuracy/mean", "response/length/mean"
LOSSES = ("dppo_binary_tv", "dppo_binary_kl", "dppo_topk_tv", "grpo", "pg_is", "cispo")
PS = "precision-sweep"


def quotes(g: Golden) -> list[Quote]:
    def corr(rollout, method, scorer="hf:fp32"):  # a row of `mismatch-lab corrections` on precision-sweep
        return g.correction(PS, method=method, rollout=rollout, scorer=scorer)

    def pair(rollout, scorer, **kw):  # precision row of a (rollout, scorer) pair
        return g.one(PS, "precision", comparison="rollout_vs_scorer", rollout=rollout, scorer=scorer, **kw)

    def lpair(rollout):  # precision row of a long-sequences rollout against the hf:fp32 trainer
        return g.one("long-sequences", "precision", comparison="rollout_vs_scorer", rollout=rollout, scorer="hf:fp32")

    def floor(rollout, scorer):  # scorer vs the hf:fp32 reference on a rollout's tokens
        return g.one(PS, "precision", comparison="scorer_vs_reference", rollout=rollout, scorer=scorer)

    def vol(rollout, scorer, bucket):
        return g.one(PS, "volatility", scale="linear", rollout=rollout, scorer=scorer, bucket=bucket)

    def cat(category, rollout="vllm:bf16", scorer="hf:bf16"):
        return g.one(PS, "clipping", view="category", rollout=rollout, scorer=scorer, adv_sign="all", category=category)

    def approx(rollout, scorer):
        return g.one(PS, "approximation", rollout=rollout, scorer=scorer, reference="hf:fp32")

    def mean_of(loss, name, steps=None):
        series = g.train(loss, name)
        return statistics.fmean(v for s, v in series.items() if steps is None or s in steps)

    def st_metric(run, name):  # a stability run's logged metric by step
        return g.run_metric("stability", STABILITY_RUNS[run], name)

    def st_mean(run, name):
        return statistics.fmean(st_metric(run, name).values())

    def st_range(run, name, first, last):  # mean over steps first..last
        series = st_metric(run, name)
        return statistics.fmean(v for s, v in series.items() if first <= s <= last)

    def st_growth(run):  # mean |π − μ| per step from the tokens: OLS slope and 95 % t-interval, per 100 steps
        from mismatch_lab.analysis.stats import slope_ci

        series = g.run_steps("stability", STABILITY_RUNS[run], "abs_dp_mean")
        fit = slope_ci(sorted(series), [series[s] for s in sorted(series)])
        return 100 * fit.slope, 100 * fit.ci_low, 100 * fit.ci_high

    second_half = tuple(st_range(r, ACC, 51, 100) for r in ("dppo_topk_tv", "dppo_topk_tv seed 1",
                                                             "dppo_binary_tv", "dppo_binary_tv seed 1"))
    # binary-TV DPPO behind the bf16 rollout: seed 0 peak and end, seed 1 peak, low and end (claims 4 and 6)
    binary_fall = (st_range("dppo_binary_tv", ACC, 21, 30), st_range("dppo_binary_tv", ACC, 91, 100),
                   *(st_range("dppo_binary_tv seed 1", ACC, *w) for w in ((21, 30), (61, 70), (91, 100))))
    f8 = g.one("fp8-rollout", "approximation", rollout="vllm:bf16-wfp8", scorer="hf:fp32-wfp8", reference="hf:fp32")
    rollouts = ("vllm:bf16", "vllm:fp16", "vllm:fp32")
    bb = pair("vllm:bf16", "hf:bf16")
    ff = pair("vllm:fp16", "hf:fp16")
    same_pairs = [pair(r, r.replace("vllm", "hf")) for r in rollouts]
    b_buckets = [vol("vllm:bf16", "hf:bf16", b) for b in range(10)]

    def falls(rollout, scorer):  # r's std decreases from every μ bucket to the next
        stds = [vol(rollout, scorer, b)["r_std"] for b in range(10)]
        return all(a > b for a, b in pairwise(stds))
    cats = g.rows(PS, "clipping", view="category", rollout="vllm:bf16", scorer="hf:bf16", adv_sign="all")
    n_clip = sum(r["n_ratio_clip"] for r in cats)
    n_all = sum(r["n_tokens"] for r in cats)
    n_tv = sum(round(r["frac_tv_mask"] * r["n_tokens"]) for r in cats)
    n_kl = sum(round(r["frac_kl_mask"] * r["n_tokens"]) for r in cats)
    clip_by_bucket = [g.one(PS, "clipping", view="mu_bucket", rollout="vllm:bf16", scorer="hf:bf16", adv_sign="all",
                            scale="linear", bucket=b)["n_ratio_clip"] for b in range(10)]
    top = {r["rank"]: r for r in g.rows(PS, "clipping", view="top_token", rollout="vllm:bf16", scorer="hf:bf16")}

    def same_dtype_clips(d):
        return sum(g.col(PS, "clipping", "n_ratio_clip", view="category", rollout=f"vllm:{d}", scorer=f"hf:{d}", adv_sign="all"))

    acc = {loss: (mean_of(loss, "reward/accuracy/mean", range(1, 6)), mean_of(loss, "reward/accuracy/mean", range(6, 11)))
           for loss in LOSSES}
    masked = {loss: mean_of(loss, "mask/nonzero_adv/frac") for loss in LOSSES}
    bad_mean = {loss: mean_of(loss, "bad_update/all/frac") for loss in LOSSES}
    bad_count = {loss: sum(g.train(loss, "bad_update/all/count").values()) for loss in LOSSES}
    bad_tv = g.train("dppo_binary_tv", "bad_update/all/frac")
    abs_dp = [v for loss in LOSSES for v in g.train(loss, "mismatch/abs_dp/mean").values()]
    entropy = {loss: g.train(loss, "entropy/mean") for loss in LOSSES}
    tokens = [sum(g.train(loss, "tokens/valid/count").values()) for loss in LOSSES]

    return [
        # -- 1: r volatile for rare tokens, binary TV small (precision-sweep volatility, linear buckets)
        Quote(1, "vllm:bf16/hf:bf16, n = {14,116}", (bb["n_finite"],)),
        Quote(1, "std of r is {0.100} for μ < 0.1 (1–99 % range {0.77}–{1.27}, {2.8} % outside [0.8, 1.28]; n = {4,139})",
              (b_buckets[0]["r_std"], b_buckets[0]["r_p01"], b_buckets[0]["r_p99"], b_buckets[0]["frac_r_outside_eps"],
               b_buckets[0]["n_tokens"])),
        Quote(1, "falls steadily to {0.0050} for μ ≥ 0.9 ({0.982}–{1.016}, n = {3,276})",
              (b_buckets[9]["r_std"], b_buckets[9]["r_p01"], b_buckets[9]["r_p99"], b_buckets[9]["n_tokens"]),
              holds=falls("vllm:bf16", "hf:bf16")),
        Quote(1, "bucket means {0.0019} (μ < 0.1) to {0.020} (μ 0.5–0.6), {0.0024} at μ ≥ 0.9",
              (b_buckets[0]["binary_tv_mean"], b_buckets[5]["binary_tv_mean"], b_buckets[9]["binary_tv_mean"]),
              holds=min(b_buckets, key=lambda r: r["binary_tv_mean"]) is b_buckets[0]
              and max(b_buckets, key=lambda r: r["binary_tv_mean"]) is b_buckets[5]),
        Quote(1, "99th percentiles {0.014}–{0.086}",
              (min(r["binary_tv_p99"] for r in b_buckets), max(r["binary_tv_p99"] for r in b_buckets))),
        Quote(1, "one token of {14,116} exceeds δ_TV = 0.15 (max {0.16})", (bb["n_finite"], bb["abs_dp_max"]), holds=n_tv == 1),
        Quote(1, "(r std {0.079} → {0.0037})", (vol("vllm:bf16", "hf:fp32", 0)["r_std"], vol("vllm:bf16", "hf:fp32", 9)["r_std"]),
              holds=falls("vllm:bf16", "hf:fp32")),
        Quote(1, "({0.011} → {0.00056})", (vol("vllm:fp16", "hf:fp16", 0)["r_std"], vol("vllm:fp16", "hf:fp16", 9)["r_std"]),
              holds=falls("vllm:fp16", "hf:fp16")),
        # -- 2: FP16 vs BF16 (precision-sweep precision)
        Quote(2, "n = {14,116}–{14,130} each",
              (min(p["n_finite"] for p in same_pairs), max(p["n_finite"] for p in same_pairs))),
        Quote(2, "vllm:bf16/hf:bf16 mean \\|Δp\\| {0.0083}, k3 KL {2.3e-3}, {1.1} % outside [0.8, 1.28]",
              (bb["abs_dp_mean"], bb["kl_k3"], bb["frac_ratio_outside_clip"])),
        Quote(2, "vllm:fp16/hf:fp16 {0.00098}, {3.1e-5}, {0} %", (ff["abs_dp_mean"], ff["kl_k3"], ff["frac_ratio_outside_clip"])),
        Quote(2, "FP16 is {8.5}× below BF16 in \\|Δp\\| and {75}× in k3",
              (bb["abs_dp_mean"] / ff["abs_dp_mean"], bb["kl_k3"] / ff["kl_k3"])),
        *[Quote(2, text, (p["abs_dp_mean"], p["kl_k3"], p["frac_ratio_outside_clip"]))
          for text, p in (("vllm:bf16 {0.0066} / {1.4e-3} / {0.43} %", pair("vllm:bf16", "hf:fp32")),
                          ("vllm:fp16 {0.00081} / {2.1e-5} / {0} %", pair("vllm:fp16", "hf:fp32")),
                          ("vllm:fp32/hf:fp16 {0.00082} / {2.1e-5} / {0} %", pair("vllm:fp32", "hf:fp16")),
                          ("vllm:fp32/hf:bf16 {0.0064} / {1.3e-3} / {0.40} %", pair("vllm:fp32", "hf:bf16")))],
        Quote(2, "vllm:fp32 {1e-6} / {3e-11}", (pair("vllm:fp32", "hf:fp32")["abs_dp_mean"], pair("vllm:fp32", "hf:fp32")["kl_k3"])),
        Quote(2, "hf:bf16 {0.0063}–{0.0064}, hf:fp16 {0.00082}",
              (min(floor(r, "hf:bf16")["abs_dp_mean"] for r in rollouts), max(floor(r, "hf:bf16")["abs_dp_mean"] for r in rollouts),
               [floor(r, "hf:fp16")["abs_dp_mean"] for r in rollouts])),
        Quote(2, "(mean {27.6})", ([pair(r, "hf:fp32")["seq_len_mean"] for r in rollouts],)),
        Quote(2, "(vllm:bf16/hf:fp32 {+1.8}, vllm:fp16/hf:fp32 {−0.10} nats per 1K tokens, n = {512} sequences)",
              (pair("vllm:bf16", "hf:fp32")["seq_logratio_slope_per_1k"], pair("vllm:fp16", "hf:fp32")["seq_logratio_slope_per_1k"],
               [pair(r, "hf:fp32")["seq_n"] for r in ("vllm:bf16", "vllm:fp16")])),
        Quote(2, "mean sequence KL k1 is {0.042} vs {0.0021}",
              (pair("vllm:bf16", "hf:fp32")["seq_kl_k1_mean"], pair("vllm:fp16", "hf:fp32")["seq_kl_k1_mean"])),
        # -- 2, long responses (long-sequences precision, scorer hf:fp32)
        Quote(2, "{64} sequences per rollout of 512 to 1,024 tokens, mean {979} (bf16) and {988} (fp16)",
              ([lpair(r)["seq_n"] for r in ("vllm:bf16", "vllm:fp16")], lpair("vllm:bf16")["seq_len_mean"],
               lpair("vllm:fp16")["seq_len_mean"])),
        Quote(2, "drifts by {−0.91} nats per 1K tokens (95 % t-interval {−1.27} to {−0.55}) behind the bf16 rollout and by "
                 "{−0.039} ({−0.087} to {+0.009}) behind fp16",
              tuple(lpair(r)[f"seq_logratio_rate{k}_per_1k"] for r in ("vllm:bf16", "vllm:fp16") for k in ("", "_ci_low", "_ci_high"))),
        Quote(2, "({−1.7}, interval {−4.5} to {+1.2}; {+0.10}, {−0.29} to {+0.49})",
              tuple(lpair(r)[f"seq_logratio_slope{k}_per_1k"] for r in ("vllm:bf16", "vllm:fp16") for k in ("", "_ci_low", "_ci_high"))),
        Quote(2, "mean \\|Δp\\| is {0.0035} vs {0.00044} ({7.9}×) and mean sequence KL k3 {1.02} vs {0.016} nats",
              (lpair("vllm:bf16")["abs_dp_mean"], lpair("vllm:fp16")["abs_dp_mean"],
               lpair("vllm:bf16")["abs_dp_mean"] / lpair("vllm:fp16")["abs_dp_mean"],
               lpair("vllm:bf16")["seq_kl_k3_mean"], lpair("vllm:fp16")["seq_kl_k3_mean"])),
        Quote(2, "bf16 {−0.91} per 1K (paper −1.0), fp16 {−0.039}, an interval that holds the paper's −0.07",
              (lpair("vllm:bf16")["seq_logratio_rate_per_1k"], lpair("vllm:fp16")["seq_logratio_rate_per_1k"]),
              holds=lpair("vllm:fp16")["seq_logratio_rate_ci_low_per_1k"] < -0.07 < lpair("vllm:fp16")["seq_logratio_rate_ci_high_per_1k"]),
        # -- 3: what ratio clipping drops (precision-sweep clipping, vllm:bf16/hf:bf16, adv_sign all)
        Quote(3, "{158} of {14,116} tokens ({1.1} %) ratio-clipped, {117} of them ({74} %) with μ < 0.1 and none with μ ≥ 0.5",
              (n_clip, n_all, n_clip / n_all, clip_by_bucket[0], clip_by_bucket[0] / n_clip),
              holds=sum(clip_by_bucket[5:]) == 0),
        Quote(3, "masks drop {1} token ({0.007} %)", ([n_tv, n_kl], [n_tv / n_all, n_kl / n_all])),
        Quote(3, "math {1.5} % (n = {724})", (cat("math")["frac_ratio_clip"], cat("math")["n_tokens"])),
        Quote(3, "number {1.2} % ({1,167})", (cat("number")["frac_ratio_clip"], cat("number")["n_tokens"])),
        Quote(3, "punctuation {1.4} % ({1,724})", (cat("punctuation")["frac_ratio_clip"], cat("punctuation")["n_tokens"])),
        Quote(3, "word {1.06} % ({9,160})", (cat("word")["frac_ratio_clip"], cat("word")["n_tokens"])),
        Quote(3, "connective {0.8} % ({123})", (cat("connective")["frac_ratio_clip"], cat("connective")["n_tokens"])),
        Quote(3, "whitespace {0.56} %", (cat("whitespace")["frac_ratio_clip"],)),
        Quote(3, "special {3.6} % ({137}, mostly `<\\|im_end\\|>`)", (cat("special")["frac_ratio_clip"], cat("special")["n_tokens"])),
        Quote(3, "vllm:fp16/hf:fp16 and vllm:fp32/hf:fp32 clip nothing", (),
              holds=same_dtype_clips("fp16") == 0 and same_dtype_clips("fp32") == 0),
        Quote(3, "({8.9} % and {7.0} % of them vs {8.3} % and {5.1} % of all tokens)",
              (cat("number")["n_ratio_clip"] / n_clip, cat("math")["n_ratio_clip"] / n_clip,
               cat("number")["n_tokens"] / n_all, cat("math")["n_tokens"] / n_all)),
        Quote(3, "words are {61} % ({65} % of all)", (cat("word")["n_ratio_clip"] / n_clip, cat("word")["n_tokens"] / n_all)),
        Quote(3, "Most clipped strings: \".\" and `<\\|im_end\\|>` ({5} each), \"\\\\n\" and \"0\" ({4}), \"2\" and \":\" ({3})",
              ([top[1]["n_ratio_clip"], top[2]["n_ratio_clip"]], [top[3]["n_ratio_clip"], top[4]["n_ratio_clip"]],
               [top[5]["n_ratio_clip"], top[6]["n_ratio_clip"]])),
        Quote(3, "({123} connective tokens in short responses)", (cat("connective")["n_tokens"],)),
        # -- 4: binary vs top-K TV against the exact TV (precision-sweep approximation)
        Quote(4, "(n = {14,116}–{14,130} per rollout",
              (min(approx(r, "hf:bf16")["n_exact"] for r in rollouts), max(approx(r, "hf:bf16")["n_exact"] for r in rollouts))),
        Quote(4, "hf:bf16 vs hf:fp32 exact TV mean {0.016}, hf:fp16 vs hf:fp32 {0.0021}",
              (approx("vllm:bf16", "hf:bf16")["exact_tv_mean"], approx("vllm:bf16", "hf:fp16")["exact_tv_mean"])),
        Quote(4, "no token's exact TV exceeds δ_TV = 0.15", (),
              holds=all(approx(r, s)["frac_exact_gt_delta"] == 0 for r in rollouts for s in ("hf:bf16", "hf:fp16"))),
        Quote(4, "agree with the exact mask decision on {100} % of tokens",
              ([approx(r, s)[c] for r in rollouts for s in ("hf:bf16", "hf:fp16") for c in ("binary_tv_agree", "topk_tv_agree")],)),
        Quote(4, "Pearson r {0.97} vs {0.53} for binary TV ({0.53}–{0.54} over the three rollouts)",
              ([approx("vllm:bf16", s)["topk_tv_corr"] for s in ("hf:bf16", "hf:fp16")],
               [approx("vllm:bf16", s)["binary_tv_corr"] for s in ("hf:bf16", "hf:fp16")],
               min(approx(r, s)["binary_tv_corr"] for r in rollouts for s in ("hf:bf16", "hf:fp16")),
               max(approx(r, s)["binary_tv_corr"] for r in rollouts for s in ("hf:bf16", "hf:fp16")))),
        Quote(4, "mean absolute error {0.0016} vs {0.0097} (bf16) and {0.00021} vs {0.0012} (fp16)",
              (approx("vllm:bf16", "hf:bf16")["topk_tv_mae"], approx("vllm:bf16", "hf:bf16")["binary_tv_mae"],
               approx("vllm:bf16", "hf:fp16")["topk_tv_mae"], approx("vllm:bf16", "hf:fp16")["binary_tv_mae"])),
        Quote(4, "binary TV masks {0.36} % of tokens with A ≠ 0 and top-K TV {1.4} %",
              (masked["dppo_binary_tv"], masked["dppo_topk_tv"])),
        # -- 4, fp8 weights (fp8-rollout approximation: the fp8-weight scorer against the reference)
        Quote(4, "on the fp8 rollout's n = {15,289} tokens) the exact TV averages {0.092} and {17} % of tokens exceed δ_TV",
              (f8["n_exact"], f8["exact_tv_mean"], f8["frac_exact_gt_delta"])),
        Quote(4, "binary TV gives the exact mask decision on {87} % of tokens and misses {78} % of those above δ, top-K TV "
                 "agrees on {95} % and misses {32} % (Pearson r {0.97} vs {0.52}, mean absolute error {0.011} vs {0.058})",
              (f8["binary_tv_agree"], f8["binary_tv_miss"], f8["topk_tv_agree"], f8["topk_tv_miss"], f8["topk_tv_corr"],
               f8["binary_tv_corr"], f8["topk_tv_mae"], f8["binary_tv_mae"])),
        Quote(4, "binary TV lets through {78} % of the tokens the exact TV would mask, top-K {32} %",
              (f8["binary_tv_miss"], f8["topk_tv_miss"])),
        # -- 4 in training: studies/stability, dppo_topk_tv against dppo_binary_tv, seeds 0 and 1
        Quote(4, "top-K TV objective masked {2.7} % and {3.3} % of tokens with A ≠ 0 (binary TV {2.0} % and {2.4} %)",
              tuple(st_mean(r, "mask/nonzero_adv/frac") for r in ("dppo_topk_tv", "dppo_topk_tv seed 1",
                                                                   "dppo_binary_tv", "dppo_binary_tv seed 1"))),
        Quote(4, "steps 51–100: top-K {0.71} and {0.59}, binary {0.33} and {0.36}", second_half),
        Quote(4, "(seed 0: {0.77} over steps 21–30, {0.19} over 91–100; seed 1: {0.84} over steps 21–30, {0.26} over "
                 "61–70, {0.49} over 91–100)", binary_fall),
        Quote(4, "top-K held in seed 0 ({0.93} over steps 31–40, {0.73} over 91–100) and fell late in seed 1 ({0.80} over "
                 "steps 31–40, {0.36} over 91–100)",
              tuple(st_range(r, ACC, *w) for r in ("dppo_topk_tv", "dppo_topk_tv seed 1") for w in ((31, 40), (91, 100)))),
        Quote(4, "Bad-update tokens: {22} and {34} (top-K), {35} and {44} (binary)",
              tuple(sum(st_metric(r, "bad_update/all/count").values())
                    for r in ("dppo_topk_tv", "dppo_topk_tv seed 1", "dppo_binary_tv", "dppo_binary_tv seed 1"))),
        Quote(4, "(−{0.023} and −{0.010} per 100 steps, 95 % t-intervals −{0.032} to −{0.015} and −{0.020} to −{0.001})",
              (-st_growth("dppo_topk_tv")[0], -st_growth("dppo_topk_tv seed 1")[0], -st_growth("dppo_topk_tv")[1],
               -st_growth("dppo_topk_tv")[2], -st_growth("dppo_topk_tv seed 1")[1], -st_growth("dppo_topk_tv seed 1")[2]),
              holds=all(st_growth(r)[2] < 0 for r in ("dppo_topk_tv", "dppo_topk_tv seed 1"))),
        Quote(4, "over steps 51–100 in both seeds ({0.71} and {0.59} vs {0.33} and {0.36})", second_half,
              holds=min(second_half[:2]) > max(second_half[2:])),
        # -- 5: bad updates (dppo-sanity train_metrics, means over the 10 steps)
        Quote(5, "({2,100}–{3,300} response tokens each)", (min(tokens), max(tokens)), unit=100),
        Quote(5, "averages {0}–{0.33} % per objective (max in any step {1.6} %, dppo_binary_tv step {10})",
              (min(bad_mean.values()), max(bad_mean.values()), max(bad_tv.values()), max(bad_tv, key=bad_tv.get))),
        Quote(5, "{0}–{7} such tokens per objective", (min(bad_count.values()), max(bad_count.values()))),
        Quote(5, "dppo_binary_kl had none, dppo_binary_tv the most ({7})", (bad_count["dppo_binary_tv"],),
              holds=bad_count["dppo_binary_kl"] == 0 and bad_count["dppo_binary_tv"] == max(bad_count.values())),
        Quote(5, "small share confirmed in 10 steps (mean ≤ {0.33} %)", (max(bad_mean.values()),)),
        # -- 6: stability (dppo-sanity train_metrics)
        *[Quote(6, f"{text} {{{a}}} → {{{b}}}", acc[loss])
          for loss, text, a, b in (("dppo_binary_tv", "dppo_binary_tv", "0.51", "0.66"),
                                   ("dppo_binary_kl", "dppo_binary_kl", "0.46", "0.75"),
                                   ("dppo_topk_tv", "dppo_topk_tv", "0.41", "0.71"),
                                   ("grpo", "grpo (ε_high 0.28)", "0.48", "0.54"),
                                   ("pg_is", "pg_is", "0.39", "0.83"))],
        Quote(6, "cispo identical to pg_is", (),
              holds=all(g.train("cispo", n) == g.train("pg_is", n)
                        for n in ("reward/accuracy/mean", "mismatch/abs_dp/mean", "entropy/mean", "loss/value"))),
        Quote(6, "stays between {0.007} and {0.028} per step for all", (min(abs_dp), max(abs_dp))),
        Quote(6, "entropy falls {1.7} → {0.2}–{0.4} nats for all",
              ([e[1] for e in entropy.values()], min(e[10] for e in entropy.values()), max(e[10] for e in entropy.values()))),
        Quote(6, "grpo clips {3.3} % of tokens with A ≠ 0, DPPO masks {0.36} % (binary TV), {0.75} % (binary KL), {1.4} % (top-K TV)",
              (masked["grpo"], masked["dppo_binary_tv"], masked["dppo_binary_kl"], masked["dppo_topk_tv"])),
        # -- 5 and 6 over 100 steps: studies/stability (its train_metrics, and mean |π − μ| per step from its tokens)
        Quote(5, "the share averages {0.26} % (pg_is) vs {0.15} % (dppo_binary_tv) behind the bf16 rollout and {0.18} % vs "
                 "{0.012} % behind the fp8-weights rollout: {159} vs {35} and {48} vs {21} such tokens, fewer with DPPO in both",
              (*(st_mean(r, "bad_update/all/frac") for r in ("pg_is", "dppo_binary_tv", "pg_is fp8", "dppo_binary_tv fp8")),
               *(sum(st_metric(r, "bad_update/all/count").values())
                 for r in ("pg_is", "dppo_binary_tv", "pg_is fp8", "dppo_binary_tv fp8"))),
              holds=all(sum(st_metric(f"dppo_binary_tv{x}", "bad_update/all/count").values())
                        < sum(st_metric(f"pg_is{x}", "bad_update/all/count").values()) for x in ("", " fp8"))),
        Quote(5, "With seed 1 behind the bf16 rollout: {0.42} % (pg_is, the highest of the study, while its responses "
                 "averaged {128} tokens, the cap, over steps 61–100) vs {0.25} % (dppo_binary_tv), {192} vs {44} such tokens",
              (st_mean("pg_is seed 1", "bad_update/all/frac"), st_range("pg_is seed 1", LEN, 61, 100),
               st_mean("dppo_binary_tv seed 1", "bad_update/all/frac"),
               *(sum(st_metric(r, "bad_update/all/count").values()) for r in ("pg_is seed 1", "dppo_binary_tv seed 1"))),
              holds=st_mean("pg_is seed 1", "bad_update/all/frac")
              == max(st_mean(r, "bad_update/all/frac") for r in STABILITY_RUNS)),
        Quote(5, "over 100 steps (≤ {0.42} %)", (max(st_mean(r, "bad_update/all/frac") for r in STABILITY_RUNS),)),
        Quote(6, "A second seed of PG-IS behind the bf16 rollout collapsed: {0.84} over steps 11–20, then {0.03} over steps "
                 "61–100, its responses running from {29} tokens (steps 1–10) to the 128-token cap (mean {128} over "
                 "steps 61–100) with entropy {0.16} → {0.52} nats (steps 21–30 → 91–100); its per-step mean \\|π − μ\\| rose from "
                 "{0.039} (steps 1–10) to {0.087} (steps 31–40) while it still scored {0.70}, and fell during the collapse "
                 "({−0.015} per 100 steps, {−0.027} to {−0.002})",
              (st_range("pg_is seed 1", ACC, 11, 20), st_range("pg_is seed 1", ACC, 61, 100),
               st_range("pg_is seed 1", LEN, 1, 10), st_range("pg_is seed 1", LEN, 61, 100),
               st_range("pg_is seed 1", "entropy/mean", 21, 30), st_range("pg_is seed 1", "entropy/mean", 91, 100),
               st_range("pg_is seed 1", "mismatch/abs_dp/mean", 1, 10), st_range("pg_is seed 1", "mismatch/abs_dp/mean", 31, 40),
               st_range("pg_is seed 1", ACC, 31, 40), *st_growth("pg_is seed 1"))),
        Quote(6, "PG-IS went {0.50} → {0.58}, after a trough of {0.24} over steps 31–50 while its responses grew from {36} to "
                 "{87} tokens",
              (st_range("pg_is", ACC, 1, 10), st_range("pg_is", ACC, 91, 100), st_range("pg_is", ACC, 31, 50),
               st_range("pg_is", LEN, 1, 10), st_range("pg_is", LEN, 41, 50))),
        Quote(6, "DPPO (binary TV, masking {2.0} % of tokens with A ≠ 0) rose to {0.77} (steps 21–30) and then collapsed to "
                 "{0.19}, its responses shrinking to {10} tokens and its entropy to {0.19} nats while it masked almost nothing "
                 "({0.11} % of tokens",
              (st_mean("dppo_binary_tv", "mask/nonzero_adv/frac"), st_range("dppo_binary_tv", ACC, 21, 30),
               st_range("dppo_binary_tv", ACC, 91, 100), st_range("dppo_binary_tv", LEN, 91, 100),
               st_range("dppo_binary_tv", "entropy/mean", 91, 100),
               st_range("dppo_binary_tv", "mask/nonzero_adv/frac", 61, 70))),
        Quote(6, "both learned (PG-IS {0.34} → {0.65}, DPPO {0.24} → {0.83})",
              tuple(st_range(r, ACC, *w) for r in ("pg_is fp8", "dppo_binary_tv fp8") for w in ((1, 10), (91, 100)))),
        Quote(6, "a second PG-IS seed there learned too ({0.38} → {0.48}, {0.72} over steps 51–60; mean \\|π − μ\\| "
                 "{−0.028} per 100 steps, {−0.032} to {−0.023})",
              (*(st_range("pg_is fp8 seed 1", ACC, *w) for w in ((1, 10), (91, 100), (51, 60))),
               *st_growth("pg_is fp8 seed 1"))),
        Quote(5, "(second seeds behind the fp8-weights rollout: {0.32} % vs {0.017} %, {97} vs {34} tokens)",
              (*(st_mean(r, "bad_update/all/frac") for r in ("pg_is fp8 seed 1", "dppo_binary_tv fp8 seed 1")),
               *(sum(st_metric(r, "bad_update/all/count").values()) for r in ("pg_is fp8 seed 1", "dppo_binary_tv fp8 seed 1")))),
        Quote(6, "the second DPPO seed there peaked at {0.575} (steps 41–50) and fell back to {0.325} over steps 91–100 "
                 "({0.24} over steps 1–10), its responses at the 128-token cap from step 11 on (mean {127.7} over steps "
                 "11–100) and its entropy falling from {2.13} to {0.11} nats (steps 1–10 → 91–100); its mean \\|π − μ\\| "
                 "fell too ({−0.021} per 100 steps, {−0.024} to {−0.018})",
              (*(st_range("dppo_binary_tv fp8 seed 1", ACC, *w) for w in ((41, 50), (91, 100), (1, 10))),
               st_range("dppo_binary_tv fp8 seed 1", LEN, 11, 100),
               *(st_range("dppo_binary_tv fp8 seed 1", "entropy/mean", *w) for w in ((1, 10), (91, 100))),
               *st_growth("dppo_binary_tv fp8 seed 1"))),
        Quote(6, "grew significantly in no run (per 100 steps: PG-IS {−0.033}, 95 % t-interval {−0.041} to {−0.024}; DPPO "
                 "{+0.009}, {−0.006} to {+0.024}; the fp8-weights runs {−0.023} and {−0.035}; PG-IS from the tie-grid "
                 "checkpoint {+0.003}, {−0.002} to {+0.008})",
              (*st_growth("pg_is"), *st_growth("dppo_binary_tv"), st_growth("pg_is fp8")[0],
               st_growth("dppo_binary_tv fp8")[0], *st_growth("pg_is tie-grid")),
              holds=all(st_growth(r)[1] < 0 for r in STABILITY_RUNS)),
        Quote(6, "DPPO with binary TV collapsed in seed 0 ({0.77} → {0.19}) and fell in seed 1 ({0.84} → {0.26}, "
                 "recovering to {0.49}), PG-IS recovered in seed 0 and collapsed in seed 1 ({0.84} → {0.03}",
              (*binary_fall, *(st_range("pg_is seed 1", ACC, *w) for w in ((11, 20), (61, 100))))),
        Quote(6, "moves log π by {0.034} nats on average, of a total mean \\|Δ log p\\| of {0.053} against the rollout",
              (st_mean("pg_is tie-grid", "mismatch/weight_rounding/abs_dlogp/mean"),
               st_mean("pg_is tie-grid", "mismatch/abs_dlogp/mean"))),
        # -- 7: only the precision-sweep comparison is analyze output
        Quote(7, "(precision-sweep: {0.033})", (pair("vllm:bf16", "hf:fp32")["abs_dlogp_mean"],)),
        # -- 8: mismatch-lab corrections on precision-sweep, trainer hf:fp32
        Quote(8, "{512} sequences of ≤ 32 tokens per rollout",
              ([corr(r, "seq_mis")["n_seqs"] for r in ("vllm:bf16", "vllm:fp16", "vllm:fp32")],)),
        Quote(8, "the product rule drops {0.20} % of the sequences behind the bf16 rollout and {0.00} % behind fp16",
              (corr("vllm:bf16", "seq_mis")["frac_seqs_masked"], corr("vllm:fp16", "seq_mis")["frac_seqs_masked"])),
        Quote(8, "the geometric-mean rule drops {92.6} % (bf16) and {41.8} % (fp16)",
              (corr("vllm:bf16", "geo_mis")["frac_seqs_masked"], corr("vllm:fp16", "geo_mis")["frac_seqs_masked"])),
        Quote(8, "drops {68.4} % and {50.4} %",
              (corr("vllm:bf16", "gspo")["frac_seqs_masked"], corr("vllm:fp16", "gspo")["frac_seqs_masked"])),
    ] + support_quotes(g) + support_factor_quotes(g) + routing_quotes(g)


SS = "sampling-support"
SS_PROC, SS_RAW, SS_PROC_BF16 = "vllm:fp32-p0.9-processed", "vllm:fp32-p0.9", "vllm:bf16-p0.9-processed"
SS_COMBINED = "vllm:fp32-t0.7-k50-p0.9-processed"
SS_T07, SS_K50 = "vllm:fp32-t0.7-processed", "vllm:fp32-k50-processed"
SS_RAW_BF16, SS_COMBINED_BF16 = "vllm:bf16-p0.9", "vllm:bf16-t0.7-k50-p0.9-processed"


def support_quotes(g: Golden) -> list[Quote]:
    """Claim 9: analyze key `support` and doctor's support_bias check on studies/sampling-support."""

    def sup(rollout, scorer="hf:fp32"):  # the pair row of the support table
        return g.one(SS, "support", view="pair", rollout=rollout, scorer=scorer)

    def bias(rollout, scorer="hf:fp32"):  # doctor's support_bias row of the pair
        return g.check(SS, "support_bias", f"{rollout}/{scorer}")

    p, r, b, t = sup(SS_PROC), sup(SS_RAW), sup(SS_PROC_BF16), sup(SS_COMBINED)
    rel = abs(p["dlogp_mean"] - p["log_s_mean"]) / abs(p["log_s_mean"])
    worst = max(abs(v) for v in g.col(SS, "support", "residual_mean", view="mu_bucket", rollout=SS_PROC, scorer="hf:fp32"))
    raw_rows = [c for c in g.docs[SS]["doctor"]["checks"]["rows"]
                if c["check"] == "support_bias" and c["pair"].startswith(SS_RAW + "/")]
    return [
        Quote(9, "vllm:fp32-p0.9-processed/hf:fp32 (n = {3,423}): mean log S {−0.07284}, mean log r {−0.07284}",
              (p["n_tokens"], p["log_s_mean"], p["dlogp_mean"])),
        Quote(9, "relative difference {0.003} %", (rel,)),
        Quote(9, "is {2e-6} nats over the pair and at most {3e-5} in absolute value in any μ bucket",
              (p["residual_mean"], worst)),
        Quote(9, "doctor's support_bias warns (the share of mean \\|log r\\| that π on the sampling rule removes = {1.000}", (bias(SS_PROC)["value"],),
              holds=bias(SS_PROC)["verdict"] == "warn"),
        Quote(9, "(n = {3,398}): mean log S {−0.0726}, mean log r {−0.0719}, residual {0.0008} nats",
              (b["n_tokens"], b["log_s_mean"], b["dlogp_mean"], b["residual_mean"])),
        Quote(9, "against hf:bf16 mean log r {−0.0732} (support_bias {0.58} and {0.64}, both warn)",
              (sup(SS_PROC_BF16, "hf:bf16")["dlogp_mean"], bias(SS_PROC_BF16, "hf:bf16")["value"],
               bias(SS_PROC_BF16)["value"]),
              holds=bias(SS_PROC_BF16, "hf:bf16")["verdict"] == bias(SS_PROC_BF16)["verdict"] == "warn"),
        Quote(9, "(vllm:fp32-p0.9/hf:fp32, n = {1,730}): mean log S {−0.07241} but mean log r {−5.8e-8}",
              (r["n_tokens"], r["log_s_mean"], r["dlogp_mean"])),
        Quote(9, "support_bias has no row for raw μ ({0} rows)", (len(raw_rows),), holds=not raw_rows),
        Quote(9, "within {0.003} % against the issue's bar", (rel,)),
        Quote(9, "(processed, vllm:fp32-t0.7-k50-p0.9-processed/hf:fp32, n = {1,636}) mean log r is {−0.203} "
                 "against mean log S {−0.0515}", (t["n_tokens"], t["dlogp_mean"], t["log_s_mean"])),
        Quote(9, "(tempered, then renormalised to the support) is {−1.0e-7} nats", (t["residual_mean"],)),
        Quote(9, "doctor's support_bias reads {1.000} there and warns", (bias(SS_COMBINED)["value"],),
              holds=bias(SS_COMBINED)["verdict"] == "warn"),
    ]


def support_factor_quotes(g: Golden) -> list[Quote]:
    """Claim 9, second half: T 0.7 and top-k 50 alone (fp32), and the bf16 rollouts against the hf:fp32 trainer."""

    def sup(rollout):  # the pair row of the support table, trainer hf:fp32
        return g.one(SS, "support", view="pair", rollout=rollout, scorer="hf:fp32")

    def abs_logr(rollout):  # mean |log r| of the pair (analyze precision)
        return g.one(SS, "precision", comparison="rollout_vs_scorer", rollout=rollout, scorer="hf:fp32")["abs_dlogp_mean"]

    t, k, rb, cb = sup(SS_T07), sup(SS_K50), sup(SS_RAW_BF16), sup(SS_COMBINED_BF16)
    k_rel = abs(k["dlogp_mean"] - k["log_s_mean"]) / abs(k["log_s_mean"])
    k_bias = g.check(SS, "support_bias", f"{SS_K50}/hf:fp32")
    bias_over_noise = abs(sup(SS_PROC_BF16)["log_s_mean"]) / abs_logr(SS_RAW_BF16)
    return [
        Quote(9, "(vllm:fp32-t0.7-processed, n = {1,692}) cuts nothing (mean log S {0}) yet gives mean log r {−0.101} "
                 "and mean \\|log r\\| {0.218}", (t["n_tokens"], t["log_s_mean"], t["dlogp_mean"], abs_logr(SS_T07))),
        Quote(9, "with a residual against the tempered π of {−1.0e-6} nats", (t["residual_mean"],)),
        Quote(9, "(vllm:fp32-k50-processed, n = {1,815}): mean log S {−0.05441}, mean log r {−0.05441} (relative "
                 "difference {0.0002} %), residual {9e-8} nats, support_bias {1.000} (warns)",
              (k["n_tokens"], k["log_s_mean"], k["dlogp_mean"], k_rel, k["residual_mean"], k_bias["value"]),
              holds=k_bias["verdict"] == "warn"),
        Quote(9, "(vllm:bf16-p0.9, n = {1,731}) carries the numerical mismatch alone: mean log r {4.5e-4}, mean "
                 "\\|log r\\| {0.0271} (plain rule, vllm:bf16: {0.0318})",
              (rb["n_tokens"], rb["dlogp_mean"], abs_logr(SS_RAW_BF16), abs_logr("vllm:bf16"))),
        Quote(9, "\\|log r\\| is {0.0747}, against {0.0728} for the fp32 rollout", (abs_logr(SS_PROC_BF16), abs_logr(SS_PROC))),
        Quote(9, "is {2.7}× its size, and bf16 adds only {0.002} nats", (bias_over_noise,
              abs_logr(SS_PROC_BF16) - abs_logr(SS_PROC))),
        Quote(9, "(vllm:bf16-t0.7-k50-p0.9-processed/hf:fp32, n = {1,658}) gives mean log r {−0.198} (fp32 rollout: "
                 "{−0.203}), residual {−2.6e-4} nats and mean \\|log r\\| {0.226}, as at fp32 ({0.227}): the rule's "
                 "bias is about {8}× the bf16 mismatch",
              (cb["n_tokens"], cb["dlogp_mean"], sup(SS_COMBINED)["dlogp_mean"], cb["residual_mean"],
               abs_logr(SS_COMBINED_BF16), abs_logr(SS_COMBINED), abs_logr(SS_COMBINED) / abs_logr(SS_RAW_BF16))),
        Quote(9, "top-k alone biases as top-p does (within {0.0002} %); at bf16 the support bias adds to the numerical "
                 "mismatch, {2.7}× its size", (k_rel, bias_over_noise)),
    ]


MR = "moe-routing"


def routing_quotes(g: Golden) -> list[Quote]:
    """Claim 10: analyze key `routing` on studies/moe-routing (views 'pair', 'layer', 'margin')."""

    def pair(rollout, scorer="hf:fp32"):  # the pair row of the routing table
        return g.one(MR, "routing", view="pair", rollout=rollout, scorer=scorer)

    def margin(lo, rollout="vllm:bf16"):  # the margin-bucket row starting at lo
        return g.one(MR, "routing", view="margin", rollout=rollout, scorer="hf:fp32", margin_lo=lo)

    b, b3, h, f = pair("vllm:bf16"), pair("vllm:bf16", "hf:fp32-r3"), pair("vllm:fp16"), pair("vllm:fp32")
    per_layer = [g.one(MR, "routing", view="layer", rollout="vllm:bf16", scorer="hf:fp32", layer=i)["flip_rate"]
                 for i in range(b["layers"])]
    low, high = margin(0.0), margin(1.0)
    return [
        Quote(10, "vllm:bf16: {125} of {2,048} tokens ({6.1} %, `any_layer_differs` {0.06104})",
              (b["tokens_flip"], b["tokens"], b["any_layer_differs"], b["any_layer_differs"])),
        Quote(10, "({165} of {8,192} (token, layer) cells; per layer {0.3} %, {0.7} %, {2.4} %, {4.6} % from input to output",
              (b["flips"], b["cells"], *per_layer)),
        Quote(10, "{20} of the {29} cells with rollout margin < 1e-3 flip, {8} of the {1,876} above 1)",
              (low["flips"], low["cells"], high["flips"], high["cells"]),
              holds=low["margin_hi"] == 1e-3 and "margin_hi" not in high),
        Quote(10, "Mean \\|Δp\\| {0.02523} against hf:fp32, {0.0136} against hf:fp32-r3 (same tokens, no flip left)",
              (b["abs_dp_mean"], b["abs_dp_mean_r3"]),
              holds=b3["flips"] == 0 and b3["tokens"] == b["tokens"] and b3["abs_dp_mean"] == b["abs_dp_mean_r3"]),
        Quote(10, "R3 removes **{46} %** (`r3_share` {0.4609})", (b["r3_share"], b["r3_share"])),
        Quote(10, "tokens with a flip have mean \\|Δp\\| {0.1725}, those without {0.01566}",
              (b["abs_dp_mean_flip"], b["abs_dp_mean_no_flip"])),
        Quote(10, "vllm:fp16: {21} tokens ({1.0} %), {0.004348} → {0.001838} ({58} %)",
              (h["tokens_flip"], h["any_layer_differs"], h["abs_dp_mean"], h["abs_dp_mean_r3"], h["r3_share"])),
        Quote(10, "vllm:fp32: no flip, {1.94e-06} with or without R3", ([f["abs_dp_mean"], f["abs_dp_mean_r3"]],),
              holds=f["flips"] == 0),
        Quote(10, "here about half of the bf16 mismatch is routing", (), holds=0.4 <= b["r3_share"] <= 0.6),
    ]


CONTEXT = [
    Context(1, "[{0.8}, {1.28}]", "the ratio clip range [1 − ε_low, 1 + ε_high] (definitions.py)"),
    Context(1, "δ_TV = {0.15}", "DPPO's threshold (definitions.py)"),
    Context(1, "μ < {0.1}", "a linear μ bucket's bounds"),
    Context(1, "for μ < {0.1} ({1}–{99} % range", "a μ bucket and the quantiles shown"),
    Context(1, "for μ ≥ {0.9}", "a μ bucket"),
    Context(1, "to 0.020 (μ {0.5}–{0.6}), 0.0024 at μ ≥ {0.9}", "μ buckets"),
    Context(1, "(μ < {0.1})", "a μ bucket"),
    Context(1, "{99}th percentiles", "the quantile shown"),
    Context(1, "({135}M model, short responses)", "the model's size"),
    Context(2, "[{0.8}, {1.28}]", "the ratio clip range"),
    Context(2, "(paper: {8}×, ~{100}×)", "the paper's values (docs/papers.md)"),
    Context(2, "responses are ≤ {32} tokens", "the study's max_tokens (study.toml)"),
    Context(2, "do not test −{1.0} vs −{0.07}", "the paper's values"),
    Context(2, "nats per {1}K tokens", "the unit"),
    Context(2, "64 sequences per rollout of {512} to {1,024} tokens", "the study's min_tokens and max_tokens (study.toml)"),
    Context(2, "reach the {1,024}-token cap", "the study's max_tokens"),
    Context(2, "bf16 −0.91 per {1}K (paper −{1.0})", "the unit; the paper's value"),
    Context(2, "drifts by −0.91 nats per {1}K tokens", "the unit"),
    Context(2, "an interval that holds the paper's −{0.07}", "the paper's value"),
    Context(2, "({95} % t-interval", "the interval's level"),
    Context(3, "with μ < {0.1}", "a μ bucket"),
    Context(3, "none with μ ≥ {0.5}", "a μ bucket bound"),
    Context(3, "μ < {0.1} and none", "a μ bucket bound"),
    Context(3, "\"\\\\n\" and \"{0}\"", "a token string"),
    Context(3, "\"{2}\" and \":\"", "a token string"),
    Context(4, "δ_TV = {0.15}", "DPPO's threshold"),
    Context(4, "A ≠ {0}", "the advantage's sign"),
    Context(4, "(K = {20})", "the study's top_k (study.toml)"),
    Context(4, "of tokens with A ≠ {0} (binary TV", "the advantage's sign"),
    Context(4, "In {100} training steps", "the stability study's length (study.toml)"),
    Context(4, "behind the bf16 rollout, seeds {0} and {1}, the recipe", "the seeds (the train commands)"),
    Context(4, "Mean accuracy over steps {51}–{100}: top-K", "the step range averaged"),
    Context(4, "(seed {0}: 0.77 over steps {21}–{30}, 0.19 over {91}–{100}; seed {1}: 0.84 over steps {21}–{30}, 0.26 "
               "over {61}–{70}, 0.49 over {91}–{100})", "the seeds; the step ranges averaged"),
    Context(4, "top-K held in seed {0} (0.93 over steps {31}–{40}, 0.73 over {91}–{100}) and fell late in seed {1} "
               "(0.80 over steps {31}–{40}, 0.36 over {91}–{100})", "the seeds; the step ranges averaged"),
    Context(4, "per {100} steps, {95} % t-intervals", "the slope's unit; the interval's level"),
    Context(4, "higher accuracy over steps {51}–{100} in both seeds", "the step range averaged"),
    Context(4, "curves over {10} steps", "the study's steps (study.toml)"),
    Context(5, "{10} steps × {16} responses per objective", "the study's size (study.toml)"),
    Context(5, "A < {0}", "the advantage's sign"),
    Context(5, "fell by ≥ {0.5} below μ", "the bad-update threshold δ (rl loop)"),
    Context(5, "in {10} steps", "the study's steps"),
    Context(6, "accuracy steps {1}–{5} → {6}–{10}", "the step ranges averaged"),
    Context(6, "grpo (ε_high {0.28})", "GRPO-Clip-Higher's ε_high (the train command)"),
    Context(6, "r > {3} clip", "CISPO's upper bound 1 + 2 (the train command)"),
    Context(6, "A ≠ {0}", "the advantage's sign"),
    Context(6, "in {10} steps", "the study's steps"),
    Context(5, "Over {100} steps of responses up to {128} tokens", "the stability study's steps and max_tokens"),
    Context(5, "(stability, seed {0})", "the seed (the train command)"),
    Context(5, "With seed {1} behind", "the seed (the train command)"),
    Context(5, "over steps {61}–{100}) vs", "the step range averaged"),
    Context(5, "confirmed in {10} steps", "the dppo-sanity study's steps"),
    Context(5, "and over {100} steps (≤", "the stability study's steps"),
    Context(5, "fewer with DPPO in every {100}-step pair", "the stability study's steps"),
    Context(6, "(seed {0} unless stated, {100} steps × {16} responses of up to {128} tokens",
            "the stability study's seed and size (study.toml)"),
    Context(6, "collapsed: 0.84 over steps {11}–{20}, then 0.03 over steps {61}–{100}, its responses running from 29 "
               "tokens (steps {1}–{10}) to the {128}-token cap (mean 128 over steps {61}–{100}) with entropy 0.16 → 0.52 "
               "nats (steps {21}–{30} → {91}–{100})", "the step ranges averaged; max_tokens (study.toml)"),
    Context(6, "rose from 0.039 (steps {1}–{10}) to 0.087 (steps {31}–{40})", "the step ranges averaged"),
    Context(6, "(−0.015 per {100} steps", "the slope's unit"),
    Context(6, "over steps {51}–{60}; mean \\|π − μ\\| −0.028 per {100} steps", "the step range averaged; the slope's unit"),
    Context(6, "0.575 (steps {41}–{50}) and fell back to 0.325 over steps {91}–{100} (0.24 over steps {1}–{10}), its "
               "responses at the {128}-token cap from step {11} on (mean 127.7 over steps {11}–{100}) and its entropy "
               "falling from 2.13 to 0.11 nats (steps {1}–{10} → {91}–{100}); its mean \\|π − μ\\| fell too (−0.021 per "
               "{100} steps", "the step ranges averaged; max_tokens (study.toml); the slope's unit"),
    Context(6, "collapsed in seed {0} (0.77", "the seed"),
    Context(6, "fell in seed {1} (0.84", "the seed"),
    Context(6, "PG-IS recovered in seed {0} and collapsed in seed {1}", "the seeds"),
    Context(6, "grew over its {100} steps (PG-IS seed {1}'s peaked", "the study's steps; the seed"),
    Context(6, "over steps {1}–{10} → {91}–{100}", "the step ranges averaged"),
    Context(6, "over steps {31}–{50}", "the step range averaged"),
    Context(6, "(means of steps {1}–{10} and {41}–{50})", "the step ranges averaged"),
    Context(6, "(steps {21}–{30})", "the step range averaged"),
    Context(6, "A ≠ {0} over steps {61}–{70}", "the advantage's sign; the step range averaged"),
    Context(6, "(per {100} steps:", "the slope's unit"),
    Context(6, "with A ≠ {0})", "the advantage's sign"),
    Context(6, "{95} % t-interval", "the interval's level"),
    Context(6, "to {bf16} alone", "a dtype name"),
    Context(6, "held longer (claim {4})", "a claim's number"),
    Context(7, "{32} prompts × {1} sample × ≤ {32} tokens", "the study's size (study.toml)"),
    Context(8, "fp{32}", "a dtype name"),
    Context(8, "of ≤ {32} tokens", "the study's max_tokens (study.toml)"),
    Context(8, "({3e-4} / {4e-4}", "GSPO's clip range (corrections/defaults.py)"),
    Context(8, "ratios near {1} multiply to near {1}", "the neutral ratio"),
    Context(8, "±{0.1} %", "Geo-RS's band as a share"),
    Context(8, "bf{16} or fp{16}", "dtype names"),
    Context(7, "generated {1}, {8} or {32} requests per vLLM call", "the study's batch sizes (study.toml)"),
    Context(9, "{64} prompts, ≤ {32} tokens, top-p {0.9}", "the study's size and sampling rule (study.toml)"),
    Context(9, "the issue's bar of {1} %", "issue 37's acceptance bar"),
    Context(9, "above {0.5}", "the support_bias band (doctor/bands.py)"),
    Context(9, "With T {0.7}, top-k {50} and top-p {0.9} together", "the sampling rule (study.toml)"),
    Context(9, "at T ≠ {1} log r", "the neutral temperature"),
    Context(9, "confirmed at T = {1}:", "the neutral temperature"),
    Context(9, "T {0.7} alone (vllm", "the sampling rule (study.toml)"),
    Context(9, "top-k {50} alone (vllm", "the sampling rule (study.toml)"),
    Context(9, "At top-p {0.9} with raw μ", "the sampling rule (study.toml)"),
    Context(9, "Under T {0.7} + top-k {50} + top-p {0.9} the", "the sampling rule (study.toml)"),
    Context(9, "× its size at top-p {0.9}", "the sampling rule (study.toml)"),
    *[Context(7, text, "figure 7 (fig7_batch_invariance, its caption): not analyze output, so not golden")
      for text in ("only {59} % (batch {8}) and {56} % (batch {32}) of the {32} responses",
                   "to the batch-{1} run", "mean \\|Δ log μ\\| is {0.030} nats (n = {679} / {677} tokens)",
                   "vllm:fp32: {100} % identical, \\|Δ log μ\\| {3.8e-6} (n = {905})",
                   "re-scoring the batch-{32} bf16 responses one sequence per forward instead of {8,192} padded tokens",
                   "leaves {43} % of hf:bf16's log π bit-identical, mean \\|Δ log π\\| {0.019}, max {0.24} nats (n = {934})",
                   "hf:fp32 moves by {2.8e-6} ({15} % bit-identical)",
                   "({64} vs {1,024} rows) changes nothing ({100} % bit-identical",
                   "fp32 does not, to {1e-5}")],
    Context(10, "cells with rollout margin < {1e-3} flip", "a margin bucket's bound (routing/compare.py MARGIN_EDGES)"),
    Context(10, "of the 1,876 above {1})", "a margin bucket's bound"),
    Context(10, "a synthetic {4}-layer model on CPU", "the model's size (mismatch-lab model tiny-moe)"),
]
