"""Ratio clipping against DPPO masks, by category, by mu bucket and by token string."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from analysis_reference import naive_rows, row_of

from mismatch_lab.analysis.clipping import (
    CATEGORY_COLUMNS,
    TOKEN_COLUMNS,
    clipping_by_bucket,
    clipping_by_category,
    top_clipped_tokens,
)
from mismatch_lab.categories import CATEGORIES

LO, HI, DTV, DKL = 0.8, 1.28, 0.15, 0.05


def naive_rules(g: pd.DataFrame, sign: str) -> dict:
    """The shares of module clipping's doc, by a direct reading of the rules."""
    r, btv, bkl, ktv, kkl = (g[c] for c in ("r", "btv", "bkl", "topk_tv", "topk_kl"))
    if sign == "all":
        clip, moved = (r < LO) | (r > HI), pd.Series(True, index=g.index)
    elif sign == "positive":
        clip, moved = r > HI, r > 1
    else:
        clip, moved = r < LO, r < 1
    tv = moved & (btv > DTV)
    has_k = ktv.notna()
    return {
        "n_tokens": len(g),
        "n_ratio_clip": int(clip.sum()),
        "frac_ratio_clip": clip.mean(),
        "frac_tv_mask": tv.mean(),
        "frac_kl_mask": (moved & (bkl > DKL)).mean(),
        "n_topk": int(has_k.sum()),
        "frac_topk_tv_mask": (moved & (ktv > DTV))[has_k].mean() if has_k.any() else np.nan,
        "frac_topk_kl_mask": (moved & (kkl > DKL))[has_k].mean() if has_k.any() else np.nan,
        "frac_clip_not_tv": (clip & ~tv).mean(),
        "frac_tv_not_clip": (tv & ~clip).mean(),
        "mu_mean_clipped": g.loc[clip, "mu"].mean() if clip.any() else np.nan,
        "mu_mean": g["mu"].mean(),
        "entropy_mean": g["entropy"].mean(),
    }


def assert_row(got: pd.Series, expect: dict, where) -> None:
    for k, v in expect.items():
        if pd.isna(v):
            assert pd.isna(got[k]), (where, k)
        else:
            assert got[k] == pytest.approx(v, rel=1e-9, abs=1e-15), (where, k)


def test_shares_by_category_match_the_naive_rules_for_all_and_each_sign(con, full_store):
    ref = naive_rows(full_store)
    ok = ref[ref["finite"]]
    table = clipping_by_category(con)
    assert list(table.columns) == CATEGORY_COLUMNS
    for (rollout, scorer, cat), g in ok.groupby(["rollout", "scorer", "category"]):
        for sign in ("all", "positive", "negative"):
            part = g if sign == "all" else g[g["adv_sign"] == sign]
            if part.empty:
                continue
            got = row_of(table, rollout=rollout, scorer=scorer, category=cat, adv_sign=sign)
            assert_row(got, naive_rules(part, sign), (rollout, scorer, cat, sign))


def test_every_category_is_listed_even_when_empty(con):
    table = clipping_by_category(con)
    for _, g in table.groupby(["rollout", "scorer", "adv_sign"]):
        assert set(CATEGORIES) <= set(g["category"])
    assert (table["n_tokens"] >= 0).all() and table["adv_sign"].isin(["all", "positive", "negative"]).all()


def test_planted_ratios_are_exactly_the_ratio_clipped_and_tv_masked_tokens(con, full_store):
    table = clipping_by_category(con)
    alls = table[table["adv_sign"] == "all"]
    for _, g in alls.groupby(["rollout", "scorer"]):
        assert g["n_ratio_clip"].sum() == full_store.spec.n_planted
        assert (g["frac_tv_mask"] * g["n_tokens"]).sum() == pytest.approx(full_store.spec.n_planted)
        assert (g["frac_clip_not_tv"] * g["n_tokens"]).sum() == pytest.approx(0.0)


def test_shares_by_mu_bucket_match_the_naive_rules(con, full_store):
    ref = naive_rows(full_store)
    ok = ref[ref["finite"]].copy()
    ok["bucket"] = np.minimum(np.floor(ok["mu"] * 10), 9).astype(int)
    table = clipping_by_bucket(con)
    for (rollout, scorer, b), g in ok.groupby(["rollout", "scorer", "bucket"]):
        got = row_of(table, rollout=rollout, scorer=scorer, bucket=b, adv_sign="all")
        assert_row(got, naive_rules(g, "all"), (rollout, scorer, b))
    for _, g in table.groupby(["rollout", "scorer", "adv_sign"]):
        assert set(range(10)) <= set(g["bucket"])  # empty buckets shown


def test_without_advantages_only_the_two_sided_rows_exist(plain_con):
    table = clipping_by_category(plain_con)
    assert set(table["adv_sign"]) == {"all"}
    assert table["n_topk"].eq(0).all() and table["frac_topk_tv_mask"].isna().all()


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_top_clipped_tokens_rank_strings_by_clip_count(con, full_store, n):
    ref = naive_rows(full_store)
    ok = ref[ref["finite"]]
    top = top_clipped_tokens(con, n=n)
    assert list(top.columns) == TOKEN_COLUMNS
    for (rollout, scorer), g in ok.groupby(["rollout", "scorer"]):
        stats = [
            (-int(((t["r"] < LO) | (t["r"] > HI)).sum()), -len(t), text, t)
            for text, t in g.groupby("token_text")
        ]
        expect = sorted((s for s in stats if s[0] < 0), key=lambda s: s[:3])[:n]
        got = top[(top["rollout"] == rollout) & (top["scorer"] == scorer)]
        assert list(got["token_text"]) == [s[2] for s in expect]
        assert list(got["rank"]) == list(range(1, len(expect) + 1))
        for (_, _, text, t), row in zip(expect, got.itertuples()):
            assert_row(pd.Series(row._asdict()), naive_rules(t, "all"), (rollout, scorer, text))


def test_top_clipped_tokens_break_ties_at_the_cut_by_occurrences(con, full_store):
    """The ranking pass reads only clipped rows; a key tied with the n-th on clip count must still be
    ranked by its full occurrence count. The store has such ties: the test checks it does."""
    ok = naive_rows(full_store).query("finite")
    ties = 0
    for (rollout, scorer), g in ok.groupby(["rollout", "scorer"]):
        clip = g.assign(c=(g["r"] < LO) | (g["r"] > HI)).groupby("token_text")
        stats = sorted(((-int(t["c"].sum()), -len(t), text) for text, t in clip if t["c"].any()))
        # cuts where the n-th and the (n+1)-th share the clip count but not the occurrence count
        for n in range(1, len(stats)):
            if stats[n - 1][0] == stats[n][0] and stats[n - 1][1] != stats[n][1]:
                ties += 1
                got = top_clipped_tokens(con, n=n, rollout=rollout, scorer=scorer)
                assert list(got["token_text"]) == [s[2] for s in stats[:n]], (rollout, scorer, n)
    assert ties > 0
