"""Routing: on an MoE model, how often each scorer sends a token to other experts than the rollout did, per layer
and by the rollout router's margin, what those tokens cost, and what R3 (replaying the rollout's routing) removes."""

import altair as alt
import lab_ui
import pandas as pd
import streamlit as st

EMPTY = ("No routing recorded in this store: run `mismatch-lab collect` on an MoE model (see docs/moe.md).")

st.title("Routing")
st.caption(
    "A (token, MoE layer) cell flips when the scorer's expert set differs from the rollout's (order within the "
    "top-k ignored). `any_layer_differs`: share of tokens with a flip in at least one layer. The margin is the "
    "rollout router's k-th minus (k+1)-th logit. A `-r3` scorer replays the rollout's expert ids; R3 share = "
    "1 − mean|Δp|(r3) / mean|Δp|. Definitions: docs/analysis.md (routing)."
)
lab_ui.live_store()  # (a shard store: no connection on the whole store where only the rollout's routes are stored)
table = lab_ui.per_unit("routing", "routing_table")
if table.empty:
    st.info(EMPTY)
    st.stop()

pairs = table[table["view"] == "pair"].reset_index(drop=True)
shown = pairs[["rollout", "scorer", "tokens", "layers", "k", "any_layer_differs", "flip_rate", "abs_dp_mean_flip",
               "abs_dp_mean_no_flip", "tokens_flip", "tokens_no_flip", "r3_scorer", "r3_share"]]
st.dataframe(shown, hide_index=True, width="stretch", column_config={
    "any_layer_differs": st.column_config.NumberColumn("tokens differing in ≥ 1 layer", format="percent"),
    "flip_rate": st.column_config.NumberColumn("flip rate (cells)", format="percent"),
    "abs_dp_mean_flip": st.column_config.NumberColumn("mean |Δp| with a flip", format="%.3g"),
    "abs_dp_mean_no_flip": st.column_config.NumberColumn("mean |Δp| without", format="%.3g"),
    "r3_share": st.column_config.NumberColumn("R3 share", format="percent"),
})


def pair_of(df: pd.DataFrame) -> pd.DataFrame:
    return df.assign(pair=df["rollout"] + " → " + df["scorer"])


left, right = st.columns(2)
layers = pair_of(table[table["view"] == "layer"])
left.markdown("**Flip rate per MoE layer**")
left.altair_chart(alt.Chart(layers).mark_line(point=True).encode(
    x=alt.X("layer:O", title="MoE layer (input → output)"),
    y=alt.Y("flip_rate:Q", title="flip rate (share of tokens)"),
    color=alt.Color("pair:N", title="pair"), tooltip=["pair", "layer", "cells", "flips", "flip_rate"]),
    width="stretch")
margins = pair_of(table[table["view"] == "margin"])
margins["bucket"] = [f"[{lo:g}, {hi:g})" if pd.notna(hi) else f"≥ {lo:g}"
                     for lo, hi in zip(margins["margin_lo"], margins["margin_hi"])]
right.markdown("**Flip rate by the rollout router's margin**")
right.altair_chart(alt.Chart(margins).mark_line(point=True).encode(
    x=alt.X("bucket:N", sort=None, title="rollout margin (logits)"),
    y=alt.Y("flip_rate:Q", title="flip rate (share of cells)"),
    color=alt.Color("pair:N", title="pair"), tooltip=["pair", "bucket", "cells", "flips", "flip_rate"]),
    width="stretch")
