"""The SQL twins of the registry's direction rules (analysis.definitions, used by the token inspector) agree
with the torch rules token by token, for A > 0, A < 0, A = 0 and unknown A; and the train config passes a
correction through to the loss."""

from __future__ import annotations

import duckdb
import numpy as np
import pandas as pd
import pytest
import torch

from mismatch_lab.analysis import definitions as d
from mismatch_lab.corrections.batch import Batch
from mismatch_lab.corrections.registry import OBJECTIVES
from mismatch_lab.rl.loop import TrainConfig


def _tokens(n=4000, seed=0):
    rng = np.random.default_rng(seed)
    lmu = np.log(rng.uniform(1e-4, 1, n))
    lpi = np.minimum(lmu + rng.normal(0, 0.4, n), 0.0)
    adv = rng.choice([1.0, -1.0, 0.0, np.nan], n)
    return lmu, lpi, adv


def _torch_dropped(name: str, params, lmu, lpi, adv) -> np.ndarray:
    """Tokens the registry's rule masks, each token its own sequence; NaN advantage = unknown (two-sided)."""
    out = np.zeros(len(lmu), dtype=bool)
    for known in (True, False):
        sel = ~np.isnan(adv) if known else np.isnan(adv)
        lp, lm = (torch.from_numpy(a[sel])[:, None] for a in (lpi, lmu))
        mask = torch.ones_like(lp, dtype=torch.bool)
        a = torch.from_numpy(adv[sel])[:, None] if known else None
        b = Batch(lp=lp, lmu=lm, la=lm, lref=lp, mask=mask, adv=a)
        out[sel] = (~OBJECTIVES[name].rule(b, params).keep)[:, 0].numpy()
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_sql_and_torch_direction_rules_agree(seed):
    lmu, lpi, adv = _tokens(seed=seed)
    con = duckdb.connect()
    con.register("x", pd.DataFrame({"lmu": lmu, "lpi": lpi, "advantage": pd.array(adv, dtype="Float64")}))
    base = "(SELECT *, exp(lpi - lmu) AS r, exp(lpi) AS pi, exp(lmu) AS mu FROM x)"
    grpo = OBJECTIVES["grpo"].resolve({"eps_high": d.EPS_HIGH, "eps_low": d.EPS_LOW})
    sql_clip = con.execute(f"SELECT {d.ppo_clip_sql('advantage', 'r', d.EPS_LOW, d.EPS_HIGH)} FROM {base}").fetchnumpy()
    sql_tv = con.execute(f"SELECT {d.dppo_tv_sql('advantage', 'pi', 'mu', d.DELTA_TV)} FROM {base}").fetchnumpy()
    clip = np.asarray(next(iter(sql_clip.values())), dtype=bool)
    tv = np.asarray(next(iter(sql_tv.values())), dtype=bool)
    assert (clip == _torch_dropped("grpo", grpo, lmu, lpi, adv)).all()
    tv_torch = _torch_dropped("dppo_binary_tv", OBJECTIVES["dppo_binary_tv"].resolve({"delta": d.DELTA_TV}), lmu, lpi, adv)
    assert (tv == tv_torch).all()
    for a in (1.0, -1.0, 0.0):  # every sign class fires somewhere or, for A = 0, nowhere
        sel = adv == a
        assert clip[sel].any() == (a != 0) and tv[sel].any() == (a != 0)
    assert clip[np.isnan(adv)].any() and tv[np.isnan(adv)].any()


def test_train_config_passes_the_correction_and_its_thresholds_to_the_loss():
    cfg = TrainConfig(loss="grpo", correction="icepop", correction_args="low=0.4, high=4")
    loss_cfg = cfg.loss_config()
    assert loss_cfg.correction == "icepop" and dict(loss_cfg.correction_args) == {"low": 0.4, "high": 4.0}
    assert TrainConfig().run_id() == TrainConfig(correction="none", correction_args="").run_id()
    assert cfg.run_id() != TrainConfig(loss="grpo").run_id()
    from mismatch_lab.errors import UserError

    with pytest.raises(UserError, match="name=value"):
        TrainConfig(correction="icepop", correction_args="low").loss_config()
    with pytest.raises(UserError, match="no parameter 'cap'"):
        TrainConfig(correction="icepop", correction_args="cap=3").loss_config()


@pytest.mark.parametrize("rewards", ["advantage", None])
def test_the_clipping_analysis_counts_what_the_registry_masks(tmp_path, rewards):
    """analysis/clipping.py (sign-split SQL counts) against the registry's grpo (Clip-Higher ε) and
    dppo_binary_tv run by `corrections` on the same store: per pair and advantage sign, or two-sided ('all')
    on a store without advantages."""
    from mismatch_lab.analysis.clipping import clipping_by_category
    from mismatch_lab.corrections.compare import compare
    from mismatch_lab.store.reader import open_store
    from mismatch_lab.store.synthetic import SyntheticSpec, synthetic_store

    spec = SyntheticSpec(rollouts=("vllm:bf16",), scorers=("hf:fp32", "hf:bf16"), n_sequences=24, n_planted=8,
                         rewards=rewards, seed=3)
    con = open_store(synthetic_store(tmp_path / "s.duckdb", spec).path)
    clip = clipping_by_category(con)
    by_sign = compare(con)["by_adv_sign"]
    signs = {"positive": "positive", "negative": "negative"} if rewards else {"all": "unknown"}
    checked = 0
    for sign, reg_sign in signs.items():
        rows = clip[clip.adv_sign == sign]
        for (rollout, scorer), g in rows.groupby(["rollout", "scorer"]):
            reg = by_sign[(by_sign.rollout == rollout) & (by_sign.scorer == scorer) & (by_sign.adv_sign == reg_sign)]
            n_clip = int(g.n_ratio_clip.sum())
            n_tv = round(float((g.frac_tv_mask * g.n_tokens).sum()))
            reg_clip = reg[reg.method == "grpo_clip_higher"]
            reg_tv = reg[reg.method == "dppo_binary_tv"]
            assert int(g.n_tokens.sum()) == int(reg_clip.n_tokens.iloc[0])
            assert n_clip == round(float(reg_clip.frac_tokens_masked.iloc[0] * reg_clip.n_tokens.iloc[0]))
            assert n_tv == round(float(reg_tv.frac_tokens_masked.iloc[0] * reg_tv.n_tokens.iloc[0]))
            checked += n_clip + n_tv
    assert checked > 0  # the planted tokens make both rules fire
