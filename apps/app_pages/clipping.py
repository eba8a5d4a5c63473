"""Clipping: which tokens PPO's ratio clip drops and which DPPO's TV mask drops, by category and token."""

import altair as alt
import lab_ui
import streamlit as st

from mismatch_lab.analysis import definitions

SIGNS = {"all": "all tokens (two-sided)", "positive": "positive advantage", "negative": "negative advantage"}

st.title("Clipping")
st.caption(
    f"Before any update π_θ = π_old: for collect runs and on-policy training every drop below is numerical "
    f"disagreement alone (an asynchronous or off-policy run's μ may also come from an older policy). "
    f"PPO clip: r = π/μ outside [1 − {definitions.EPS_LOW}, 1 + {definitions.EPS_HIGH}]; DPPO mask: "
    f"binary TV |π − μ| > {definitions.DELTA_TV}. With an advantage sign, only a move in the "
    f"advantage's direction counts, as in the losses. Shares are over finite tokens of each group."
)
lab_ui.live_store()  # (a shard store: no connection on the whole store; its look-ups are per unit)
pairs = lab_ui.pairs_of()
if pairs.empty:
    st.info("No scored tokens yet: clipping needs a rollout and at least one scorer.")
    st.stop()

labels = [f"{r.rollout} → {r.scorer}" for r in pairs.itertuples()]
c = st.columns([2, 3])
pick = c[0].selectbox(
    "Pair (rollout μ → scorer π)", range(len(labels)), format_func=labels.__getitem__, key="clip_pair"
)
categories = lab_ui.categories_of()
chosen = c[1].multiselect(
    "Token categories",
    categories,
    default=categories,
    key="clip_categories",
    help="see mismatch_lab/categories.py for the rules",
)
rollout, scorer = pairs.rollout[pick], pairs.scorer[pick]

by_cat = lab_ui.clipping_of(rollout, scorer)
signs = [s for s in SIGNS if s in set(by_cat["adv_sign"])]
if signs == ["all"]:
    st.caption("No rewards or advantages stored for this pair: only the two-sided view is available.")
sign = st.radio("Tokens", signs, format_func=SIGNS.get, horizontal=True, key="clip_sign") if len(signs) > 1 else "all"
view = by_cat[(by_cat["adv_sign"] == sign) & by_cat["category"].isin(chosen) & (by_cat["n_tokens"] > 0)]

st.subheader("By category: PPO clip vs DPPO mask")
if view.empty:
    st.info("No finite tokens in the chosen categories.")
else:
    rules = {
        "frac_ratio_clip": "PPO ratio clip",
        "frac_tv_mask": "DPPO binary-TV mask",
        "frac_topk_tv_mask": "DPPO top-K TV mask",
    }
    if view["n_topk"].sum() == 0:
        rules.pop("frac_topk_tv_mask")
        st.caption("No top-K stored for this pair: the top-K TV mask is not shown.")
    bars = view.melt(id_vars=["category", "n_tokens"], value_vars=list(rules), var_name="rule", value_name="share")
    bars["rule"] = bars["rule"].map(rules)
    st.altair_chart(
        alt.Chart(bars)
        .mark_bar()
        .encode(
            x=alt.X("category:N", title="token category"),
            xOffset="rule:N",
            y=alt.Y("share:Q", title="share of tokens dropped", axis=alt.Axis(format="%")),
            color=alt.Color("rule:N", title="rule"),
            tooltip=["category", "rule", alt.Tooltip("share:Q", format=".3%"), "n_tokens"],
        ),
        width="stretch",
    )
    st.dataframe(view.drop(columns=["rollout", "scorer", "adv_sign"]), hide_index=True)

st.subheader("Top clipped tokens")
n = st.slider("How many token strings", 5, lab_ui.TOP_CLIPPED_MAX, definitions.TOP_N_TOKENS, key="clip_top_n")
# One query for the longest list the slider allows; the slider and the category filter only cut it.
top = lab_ui.top_clipped_of(rollout, scorer)
top = top[top["category"].isin(chosen)].head(n)
two_sided = by_cat[(by_cat["adv_sign"] == "all") & by_cat["category"].isin(chosen)]
clipped = int(two_sided["n_ratio_clip"].sum())
if top.empty and clipped:  # clipped tokens, none of them ranked: their ids were not stored
    st.info(f"{clipped:,} tokens of the chosen categories leave PPO's clip range, but this pair's tokens are "
            "stored without token ids or texts (recorded where the ids were not at hand, e.g. from a loss "
            "function): there is no per-token ranking.")
elif top.empty:
    st.info("No token of the chosen categories leaves PPO's clip range for this pair.")
else:
    st.caption(
        "Token strings ranked by how often PPO's ratio clip (two-sided) drops them; shares are over all "
        "finite occurrences of the string."
    )
    st.dataframe(  # quoted strings: a space, a newline or an indentation token is visible
        top.drop(columns=["rollout", "scorer"]).assign(
            token_text=[lab_ui.token_label(t, i) for t, i in zip(top["token_text"], top["token_id"])]),
        hide_index=True,
        column_config={
            "token_text": st.column_config.TextColumn("token", help="the token's string, quoted; its id where "
                                                      "the store holds no text"),
            "frac_ratio_clip": st.column_config.NumberColumn("PPO clip share", format="%.3f"),
            "frac_tv_mask": st.column_config.NumberColumn("DPPO mask share", format="%.3f"),
        },
    )
