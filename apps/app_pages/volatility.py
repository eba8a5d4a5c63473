"""Volatility: the ratio r = π/μ and the binary TV |π − μ| against μ, per (rollout, scorer) pair (DPPO Fig. 2)."""

import altair as alt
import lab_ui
import numpy as np
import pandas as pd
import streamlit as st

from mismatch_lab.analysis import definitions

st.title("Volatility")
st.caption(
    "At identical parameters r should be 1. As μ → 0 a tiny move of probability mass is a large move "
    "in r, so a ratio clip reacts to noise there; the TV |π − μ| does not. Statistics per μ bucket over "
    "finite tokens (denominator `n_tokens`); non-finite ones are counted in `n_nonfinite`."
)
lab_ui.live_store()  # (a shard store: no connection on the whole store; its look-ups are per unit)
pairs = lab_ui.pairs_of()
if pairs.empty:
    st.info("No scored tokens yet: volatility needs a rollout and at least one scorer.")
    st.stop()

labels = [f"{r.rollout} → {r.scorer}" for r in pairs.itertuples()]
pick = st.selectbox("Pair (rollout μ → scorer π)", range(len(labels)), format_func=labels.__getitem__, key="vol_pair")
# One recomputation per change of the bucketing, not one per widget: each costs a pass over the tokens.
with st.form("vol_controls", border=False):
    c = st.columns([1, 2, 1, 1, 1], vertical_alignment="bottom")
    scale = c[0].radio("μ buckets", ["linear", "log"], horizontal=True, key="vol_scale")
    n_buckets = c[1].select_slider(
        "Buckets",
        ["default", 4, 5, 6, 8, 10, 12, 16, 20, 24, 30, 40],
        key="vol_n",
        help=f"default: {definitions.N_LINEAR_BUCKETS} linear buckets on [0, 1], or one below "
        f"{definitions.LOG_BUCKET_FLOOR:g} then {definitions.N_LOG_BUCKETS} log-spaced ones up to 1",
    )
    eps_low = c[2].number_input("ε low", 0.01, 0.99, definitions.EPS_LOW, 0.01, key="vol_eps_low")
    eps_high = c[3].number_input("ε high", 0.01, 5.0, definitions.EPS_HIGH, 0.01, key="vol_eps_high")
    c[4].form_submit_button("Apply")

rollout, scorer = pairs.rollout[pick], pairs.scorer[pick]
table = lab_ui.volatility_of(rollout, scorer, scale, None if n_buckets == "default" else n_buckets, eps_low, eps_high)
table = table[table["bucket"] >= 0]
filled = table[table["n_tokens"] > 0].copy()
if filled.empty:
    st.info(f"No finite tokens for {labels[pick]}.")
    st.stop()
# bucket centre on the scale of the axis: arithmetic for linear buckets, geometric for log ones
lo = filled["mu_lo"].clip(lower=definitions.LOG_BUCKET_FLOOR / 10)
filled["mu_centre"] = (filled["mu_lo"] + filled["mu_hi"]) / 2 if scale == "linear" else np.sqrt(lo * filled["mu_hi"])
x = alt.X("mu_centre:Q", title="μ (bucket centre)", scale=alt.Scale(type="linear" if scale == "linear" else "log"))


def long(cols: dict[str, str]):
    keep = [k for k in cols if filled[k].notna().any()]
    out = filled.melt(id_vars=["mu_centre", "bucket_label", "n_tokens"], value_vars=keep, var_name="statistic")
    return out.assign(statistic=out["statistic"].map(cols))


left, right = st.columns(2)
left.markdown("**Ratio r = π/μ** — quantiles per μ bucket")
ratio = long({"r_p01": "p1", "r_p05": "p5", "r_p50": "median", "r_p95": "p95", "r_p99": "p99"})
band = (
    alt.Chart(ratio)
    .mark_line(point=True)
    .encode(
        x=x,
        y=alt.Y("value:Q", title="r"),
        color=alt.Color("statistic:N", sort=["p1", "p5", "median", "p95", "p99"]),
        tooltip=["bucket_label", "statistic", alt.Tooltip("value:Q", format=".4g"), "n_tokens"],
    )
)
clip_lines = alt.Chart(pd.DataFrame({"y": [1 - eps_low, 1 + eps_high]})).mark_rule(strokeDash=[4, 4]).encode(y="y:Q")
left.altair_chart(band + clip_lines, width="stretch")
left.caption(f"Dashed: PPO's clip range [1 − {eps_low:g}, 1 + {eps_high:g}].")

right.markdown("**Binary TV |π − μ|** per μ bucket")
tv = long(
    {
        "binary_tv_mean": "binary TV mean",
        "binary_tv_p99": "binary TV p99",
        "topk_tv_mean": "top-K TV mean",
        "tv_exact_vs_ref_mean": f"exact TV vs {definitions.REFERENCE_SCORER} mean",
    }
)
right.altair_chart(
    alt.Chart(tv)
    .mark_line(point=True)
    .encode(
        x=x,
        y=alt.Y("value:Q", title="TV"),
        color="statistic:N",
        tooltip=["bucket_label", "statistic", alt.Tooltip("value:Q", format=".4g"), "n_tokens"],
    ),
    width="stretch",
)
if filled["n_topk"].sum() == 0:
    right.caption("No top-K stored for this pair: top-K TV is not shown.")

st.markdown(f"**Share of tokens with r outside [1 − {eps_low:g}, 1 + {eps_high:g}]** per μ bucket")
st.altair_chart(
    alt.Chart(filled)
    .mark_bar()
    .encode(
        x=alt.X("bucket_label:N", sort=None, title="μ bucket"),
        y=alt.Y("frac_r_outside_eps:Q", title="share of tokens"),
        tooltip=["bucket_label", alt.Tooltip("frac_r_outside_eps:Q", format=".3%"), "n_tokens"],
    ),
    width="stretch",
)

st.subheader("Table")
st.dataframe(table.drop(columns=["rollout", "scorer", "scale"]), hide_index=True)
