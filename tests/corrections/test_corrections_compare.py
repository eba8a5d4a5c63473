"""`mismatch-lab corrections` on real DuckDB stores against a per-sequence Python reference built from the
frames the synthetic store wrote (corrections_reference), plus chunking, splits, the CLI and bad input."""

from __future__ import annotations

import json
import math

import corrections_reference as ref
import numpy as np
import pandas as pd
import pytest

from mismatch_lab.cli import main
from mismatch_lab.corrections.compare import compare, variants
from mismatch_lab.store.reader import open_store
from mismatch_lab.store.synthetic import SyntheticSpec, synthetic_store


def _spec(rewards):
    return SyntheticSpec(rollouts=("vllm:bf16", "vllm:fp16"), scorers=("hf:fp32", "hf:bf16"), n_sequences=24,
                         n_one_token=2, n_planted=6, n_nonfinite=2, n_rollout_nonfinite=1, rewards=rewards, topk=3,
                         seed=7)


@pytest.fixture(scope="module", params=["advantage", "reward", None])
def store(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("corr") / "s.duckdb"
    return synthetic_store(path, _spec(request.param))


@pytest.fixture(scope="module")
def one_store(tmp_path_factory):
    return synthetic_store(tmp_path_factory.mktemp("corr1") / "s.duckdb", _spec("reward"))


def _advantages(seqs: pd.DataFrame) -> pd.Series:
    """Per (run_id, seq_id): the stored advantage, else reward minus the prompt group's mean, else NaN."""
    if "advantage" in seqs and seqs["advantage"].notna().any():
        a = seqs["advantage"]
    elif "reward" in seqs:
        a = seqs["reward"] - seqs.groupby(["run_id", "prompt_id"])["reward"].transform("mean")
    else:
        a = pd.Series(np.nan, index=seqs.index)
    return pd.Series(a.to_numpy(), index=pd.MultiIndex.from_frame(seqs[["run_id", "seq_id"]]))


def reference(frames, rollout, scorer):
    """{label: dict of the main-table numbers} for one pair, looping over sequences."""
    runs = frames["runs"].assign(rollout=lambda r: r.engine + ":" + r.engine_dtype)
    run_ids = set(runs.loc[runs.rollout == rollout, "run_id"])
    t = frames["tokens"][frames["tokens"].run_id.isin(run_ids)]
    s = frames["scores"][frames["scores"].scorer == scorer]
    j = t.merge(s, on=["run_id", "seq_id", "pos"]).sort_values(["run_id", "seq_id", "pos"])
    j = j[np.isfinite(j.logp_rollout.astype(float)) & np.isfinite(j.logp.astype(float)) & ~j.nonfinite.fillna(False)]
    adv = _advantages(frames["sequences"])
    out = {}
    for v in variants():
        obj, corr = (v.method.name, "none") if v.method.axis == "objective" else ("pg_is", v.method.name)
        po, pc = (v.params, {}) if v.method.axis == "objective" else ({}, v.params)
        n = masked = changed = seqs = dropped = 0
        ws = []
        for (run, seq), g in j.groupby(["run_id", "seq_id"]):
            a = adv[(run, seq)]
            lp, lmu = [g.logp.tolist()], [g.logp_rollout.tolist()]
            topk = None
            if "topk" in v.method.needs:
                topk = _topk_rows(g)
            keep, weight, _ = ref.decisions(obj, corr, po, pc, lp, lmu, [[0.0 if math.isnan(a) else a] * len(g)],
                                            [[True] * len(g)], topk=topk, two_sided=math.isnan(a))
            r = [math.exp(x - y) for x, y in zip(lp[0], lmu[0])]
            n += len(g)
            seqs += 1
            masked += sum(not k for k in keep[0])
            dropped += not any(keep[0])
            changed += sum(k and not math.isclose(w, x, rel_tol=1e-12) for k, w, x in zip(keep[0], weight[0], r))
            ws += [w for k, w in zip(keep[0], weight[0]) if k]
        out[v.label] = {"n_tokens": n, "n_seqs": seqs, "frac_tokens_masked": masked / n,
                        "frac_seqs_masked": dropped / seqs, "frac_tokens_weight_changed": changed / n,
                        "weight_mean": sum(ws) / len(ws) if ws else math.nan, "weight_max": max(ws, default=math.nan),
                        "ess": sum(ws) ** 2 / (len(ws) * sum(w * w for w in ws)) if ws else math.nan}
    return out


def _topk_rows(g):
    """Slots: the rollout's top-K ids plus the sampled token where it is not among them."""
    a, p, valid = [], [], []
    for row in g.itertuples():
        extra = row.token_id not in list(row.topk_ids_rollout)
        a.append(list(row.topk_logps_rollout) + [row.logp_rollout])
        p.append(list(row.logps_at_rollout_topk) + [row.logp])
        valid.append([True] * len(row.topk_ids_rollout) + [extra])
    return {"anchor_logps": [a], "logps": [p], "valid": [valid]}


def test_every_method_matches_the_per_sequence_reference(store):
    con = open_store(store.path)
    got = compare(con, chunk_tokens=1024)["corrections"]
    assert set(got.method) == {v.label for v in variants()}
    for (rollout, scorer), g in got.groupby(["rollout", "scorer"]):
        want = reference(store.frames, rollout, scorer)
        for row in g.itertuples():
            for key, value in want[row.method].items():
                assert getattr(row, key) == pytest.approx(value, rel=1e-9, abs=1e-12, nan_ok=True), (
                    rollout, scorer, row.method, key)


def test_the_reference_comparison_is_not_vacuous(store):
    """Planted tokens and the tight sequence rules make several methods mask and reweight something."""
    got = compare(open_store(store.path))["corrections"].set_index("method")
    for method in ("grpo", "dppo_binary_tv", "geo_mis", "gspo"):
        assert (got.loc[method, "frac_tokens_masked"] > 0).all(), method
    assert (got.loc["k3_rs", "frac_seqs_masked"] > 0).any()
    assert (got.loc["seq_tis", "frac_tokens_weight_changed"] > 0).all()
    assert (got.loc["pg_is", "frac_tokens_weight_changed"] == 0).all()


def test_chunk_size_and_splits_do_not_change_the_numbers(one_store):
    con = open_store(one_store.path)
    small, big = compare(con, chunk_tokens=64), compare(con, chunk_tokens=1 << 20)
    for name in small:
        pd.testing.assert_frame_equal(small[name].reset_index(drop=True), big[name].reset_index(drop=True),
                                      check_exact=False, rtol=1e-12)
    main_rows = big["corrections"].set_index(["method", "rollout", "scorer"])
    for name, key in (("by_adv_sign", "adv_sign"), ("by_mu_bucket", "mu_bucket"), ("by_category", "category")):
        part = big[name]
        sums = part.groupby(["method", "rollout", "scorer"])["n_tokens"].sum()
        assert (sums == main_rows["n_tokens"].loc[sums.index]).all(), name
        masked = (part.frac_tokens_masked * part.n_tokens).groupby([part.method, part.rollout, part.scorer]).sum()
        expect = (main_rows.frac_tokens_masked * main_rows.n_tokens).loc[masked.index]
        np.testing.assert_allclose(masked, expect, rtol=1e-9, atol=1e-9)


def test_advantage_source_says_where_the_sign_came_from(store):
    got = compare(open_store(store.path))["corrections"]
    expected = {"advantage": "advantage", "reward": "reward minus group mean", None: "none (two-sided)"}
    assert set(got.advantage_source) == {expected[store.spec.rewards]}
    assert (got.n_nonfinite > 0).all()  # the planted non-finite rows are left out and counted


def test_command_writes_json_with_a_corrections_key(one_store, tmp_path, capsys):
    out = tmp_path / "c.json"
    assert main(["corrections", "--db", str(one_store.path), "--json", str(out), "--set", "seq_mis.cap=1.5"]) == 0
    data = json.loads(out.read_text())
    assert set(data) == {"corrections", "by_adv_sign", "by_mu_bucket", "by_category"}
    rows = [r for r in data["corrections"] if r["method"] == "seq_mis"]
    assert rows and all(r["params"] == "cap=1.5" for r in rows)
    assert "TRL: vllm_importance_sampling_mode=sequence_mask" in capsys.readouterr().out


@pytest.mark.parametrize("bad", [["--set", "seq_mis.cap"], ["--set", "nosuch.cap=1"], ["--set", "seq_mis.floor=1"],
                                 ["--set", "icepop.low=9"], ["--chunk-tokens", "3"]])
def test_bad_input_is_one_line_with_exit_2(one_store, bad, capsys):
    assert main(["corrections", "--db", str(one_store.path), *bad]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mismatch-lab corrections: error:")


def test_a_store_without_top_k_reports_those_methods_as_not_computable(tmp_path):
    spec = SyntheticSpec(rollouts=("vllm:bf16",), scorers=("hf:fp32",), n_sequences=8, rewards="reward", topk=0)
    s = synthetic_store(tmp_path / "s.duckdb", spec)
    got = compare(open_store(s.path))["corrections"].set_index("method")
    assert got.loc["dppo_topk_tv", "note"] and math.isnan(got.loc["dppo_topk_tv", "frac_tokens_masked"])
    assert got.loc["dppo_binary_tv", "note"] == "" and got.loc["dppo_binary_tv", "n_tokens"] > 0


def test_a_store_without_pairs_gives_empty_tables(tmp_path, capsys):
    import duckdb

    from mismatch_lab.store.schema import create_schema

    path = tmp_path / "empty.duckdb"
    con = duckdb.connect(str(path))
    create_schema(con)
    con.close()
    got = compare(open_store(path))
    assert all(df.empty for df in got.values()) and "frac_tokens_masked" in got["corrections"].columns
    assert main(["corrections", "--db", str(path)]) == 0
    assert "nothing to compare" in capsys.readouterr().out


def test_a_pair_whose_every_token_is_non_finite_is_listed_with_zero_counts(tmp_path, capsys):
    import duckdb

    spec = SyntheticSpec(rollouts=("vllm:bf16",), scorers=("hf:fp32", "hf:bf16"), n_sequences=6, rewards="reward")
    s = synthetic_store(tmp_path / "s.duckdb", spec)
    with duckdb.connect(str(s.path)) as con:
        con.execute("UPDATE scores SET logp = NULL, nonfinite = true WHERE scorer = 'hf:bf16'")
    got = compare(open_store(s.path))["corrections"]
    dead = got[got.scorer == "hf:bf16"]
    assert (dead.n_tokens == 0).all() and (dead.n_nonfinite > 0).all() and dead.frac_tokens_masked.isna().all()
    live = got[(got.scorer == "hf:fp32") & (got.note == "")]  # top-K methods have a note: this store has none
    assert len(live) and (live.n_tokens > 0).all()
    assert main(["corrections", "--db", str(s.path)]) == 0
    assert "vllm:bf16 vs hf:bf16: 0 tokens" in capsys.readouterr().out
