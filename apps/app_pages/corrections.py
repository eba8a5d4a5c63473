"""Corrections: what every objective and rollout correction of the registry does to the same tokens.

Methods × shares (tokens masked, sequences dropped whole, weights changed, ESS) for one (rollout, scorer)
pair, from `mismatch_lab.corrections.compare.compare` (cached per store and overrides; a store over
`lab_corrections.CORRECTIONS_SAMPLE_TOKENS` tokens first on a stated sample of its prompt groups, one pair at a time,
until the comparison of every token is cached: `lab_corrections.corrections_pairs`); filters by token category, μ bucket or advantage sign from its split tables; each
method's framework option and parameters; optional threshold overrides; the sequences a method drops,
each one click away from the token inspector.
"""

import json

import lab_corrections
import lab_inspect
import lab_select
import lab_ui
import numpy as np
import pandas as pd
import streamlit as st

from mismatch_lab.analysis import definitions
from mismatch_lab.corrections.command import parse_overrides
from mismatch_lab.corrections.dropped import dropped_sequences
from mismatch_lab.corrections.report import TOKEN_SUMS, rates
from mismatch_lab.errors import UserError

SHARES = {
    "frac_tokens_masked": "tokens masked",
    "frac_seqs_masked": "sequences dropped",
    "frac_tokens_weight_changed": "weights changed",
}
SPLITS = {  # filter -> (split table, its key column, label)
    "all": (None, None, "all tokens of the pair"),
    "category": ("by_category", "category", "token categories"),
    "mu_bucket": ("by_mu_bucket", "mu_bucket", "μ buckets"),
    "adv_sign": ("by_adv_sign", "adv_sign", "advantage sign"),
}
DESCRIBED = ["method", "axis", "level", "framework", "params", "source", "note", "advantage_source"]


def mu_bucket_label(i) -> str:
    edges = definitions.bucket_edges("linear")
    if pd.isna(i) or not 0 <= int(i) < len(edges):
        return "μ not finite"
    lo, hi = edges[int(i)]
    return f"μ ∈ {definitions.bucket_label(lo, hi, int(i) == len(edges) - 1)}"


def combine(split: pd.DataFrame, key: str, chosen: list) -> pd.DataFrame:
    """The numbers of each method over the chosen values of one split, rebuilt exactly from the split's rates:
    masked = frac·n, kept = n − masked, Σw = mean·kept, Σw² = (Σw)²/(kept·ESS); then the same rates as
    report.py. Sequences only for the advantage-sign split (the only split that counts them)."""
    part = split[split[key].isin(chosen)].copy()
    # back to the additive sums the comparison counted (report.TOKEN_SUMS), summed, then report.rates
    n = part["n_tokens"].astype(float)
    part["n_masked"] = np.round(part["frac_tokens_masked"] * n)
    part["n_changed"] = np.round(part["frac_tokens_weight_changed"] * n)
    kept = n - part["n_masked"]
    part["s_w"] = (part["weight_mean"] * kept).fillna(0.0)
    part["s_w2"] = (part["s_w"] ** 2 / (kept * part["ess"])).where(part["ess"] > 0, 0.0).fillna(0.0)
    part["x_w"] = part["weight_max"]
    sums = dict(TOKEN_SUMS)
    if "n_seqs" in part:
        part["n_seqs_masked"] = np.round(part["frac_seqs_masked"] * part["n_seqs"])
        sums |= {"n_seqs": "sum", "n_seqs_masked": "sum"}
    out = rates(part.groupby("method", sort=False).agg(sums).reset_index())
    if "n_seqs" not in out:
        out["n_seqs"], out["frac_seqs_masked"] = np.nan, np.nan
    return out.drop(columns=[c for c in (*TOKEN_SUMS, "n_seqs_masked") if c not in ("n_tokens",) and c in out])


def shares_spec(bars: pd.DataFrame, ess: pd.DataFrame, order: list) -> dict:
    """The methods × shares chart as a Vega-Lite spec: bars per method and share beside each method's ESS as a
    point, one y scale (each dot on its row of bars). A spec, not Altair: importing Altair and building the chart
    took ~0.25 s of a fresh server's first load and ~0.1 s of every run of the page."""
    def values(df: pd.DataFrame) -> dict:
        return {"values": json.loads(df.to_json(orient="records"))}  # (NaN as null)

    def field(name: str, kind: str, **more) -> dict:
        return {"field": name, "type": kind, **more}

    y = field("method", "nominal", sort=order, title="method", scale={"domain": order})
    names = list(SHARES.values())
    height = max(len(order), 1) * len(SHARES) * 14
    shares = {"mark": {"type": "bar"}, "data": values(bars[["method", "axis", "share", "value"]]),
              "height": height, "width": 520, "encoding": {
                  "y": y, "yOffset": field("share", "nominal", sort=names),
                  "x": field("value", "quantitative", title="share", axis={"format": "%"}),
                  "color": field("share", "nominal", sort=names, title=None, legend={"orient": "bottom"}),
                  "tooltip": [field("method", "nominal"), field("axis", "nominal"), field("share", "nominal"),
                              field("value", "quantitative", format=".3%")]}}
    points = {"mark": {"type": "point", "filled": True, "color": "black"},
              "data": values(ess[["method", "ess", "weight_mean"]]), "height": height, "width": 160, "encoding": {
                  "y": y, "x": field("ess", "quantitative", title="ESS of kept weights", scale={"zero": False}),
                  "tooltip": [field("method", "nominal"), field("ess", "quantitative", format=".4f"),
                              field("weight_mean", "quantitative", format=".4f")]}}
    return {"hconcat": [shares, points], "resolve": {"scale": {"y": "shared"}}}


st.title("Corrections")
st.caption(
    "Every base objective and rollout correction of the registry (mismatch_lab/corrections/registry.py) run "
    "on the same stored tokens, at its published defaults. r = π/μ per token. **tokens masked**: tokens the "
    "method drops (M = 0), over the pair's finite tokens; **sequences dropped**: sequences every token of which "
    "is dropped, over the pair's sequences; **weights changed**: tokens kept with a weight w ≠ r, over the "
    "finite tokens; **ESS** = (Σw)² / (n Σw²) over the n kept tokens (1: all weights equal). A store holds no "
    "π_old: π_old = π, i.e. what each method does at the first mini-batch of the step that produced the tokens. "
    "Sign-dependent rules use the stored advantage, else reward minus the prompt group's mean, else fire for "
    "either sign (two-sided)."
)
lab_ui.live_store()  # (a shard store: no connection on the whole store; the look-ups below read per unit)

# ---- threshold overrides ----------------------------------------------------------------------------------
overrides: dict = {}
with st.expander("Threshold overrides"):
    with st.form("corr_overrides_form"):
        text = st.text_input(
            "Overrides (METHOD.PARAM=VALUE, comma-separated)",
            key="corr_overrides",
            placeholder="seq_mis.cap=2, geo_mis.low=0.99",
            help="the same as `mismatch-lab corrections --set`; empty: the published defaults",
        )
        st.form_submit_button("Apply")
    st.dataframe(lab_corrections.method_defaults(), hide_index=True)
items = [s for s in (text or "").replace(";", ",").split(",") if s.strip()]
if items:
    # imported here, not at the top: it imports torch (its rules), which only checking overrides needs
    from mismatch_lab.corrections.compare import variants

    try:
        overrides = parse_overrides([s.strip().replace(" ", "") for s in items])
        variants(overrides)  # unknown method or parameter, bad threshold: say so before computing
    except (UserError, ValueError) as exc:
        st.error(f"Overrides not applied: {exc}")
        overrides = {}
    else:
        st.caption("Overrides applied: " + ", ".join(f"{m}.{k}={x:g}" for m, p in overrides.items() for k, x in p.items()))

exact = st.toggle("Every token", key="corr_exact",
                  help="compare the methods on every token of the store (a large store opens on a sample of its "
                  "prompt groups until that comparison is cached: the app's warm-up computes it in the background)")
pairs, sample = lab_corrections.corrections_pairs(overrides, exact)  # (warmed)
if sample is not None:
    st.info(
        f"Computed on a sample: {sample['tokens']:,} of the store's {sample['store_tokens']:,} tokens "
        f"({sample['sequences']:,} of {sample['store_sequences']:,} sequences), the prompt groups whose hash falls in "
        f"1 of {sample['every']} (groups kept whole, so derived advantages are unchanged). Every number below is "
        "of the sample, compared one pair at a time. "
        + ("The comparison of every token is computed in the background and replaces it at the next interaction "
           "once done; switch on *Every token* to wait for it." if sample["background"] else
           "Switch on *Every token* to compare the methods on every token (computed now, then cached).")
    )
if pairs.empty:  # (compare() needs at least one pair)
    st.info("No scored tokens yet: the comparison needs a rollout and at least one scorer.")
    st.stop()

# ---- pair and filters -----------------------------------------------------------------------------------
labels = [f"{r.rollout} → {r.scorer}" for r in pairs.itertuples()]
c = st.columns([2, 2, 3])
lab_ui.keep_valid("corr_pair", list(range(len(labels))))
pick = c[0].selectbox("Pair (rollout μ → scorer π)", range(len(labels)), format_func=labels.__getitem__, key="corr_pair")
rollout, scorer = pairs.rollout[pick], pairs.scorer[pick]
tables = lab_corrections.corrections_tables(overrides, rollout, scorer, sample)  # a sample: this pair only
main = tables["corrections"]
here = main[(main["rollout"] == rollout) & (main["scorer"] == scorer)].reset_index(drop=True)
split = c[1].radio("Tokens", list(SPLITS), format_func=lambda s: SPLITS[s][2], key="corr_split")
view = here
if split != "all":
    name, key, _ = SPLITS[split]
    table = tables[name]
    table = table[(table["rollout"] == rollout) & (table["scorer"] == scorer)]
    values = list(dict.fromkeys(table[key].sort_values()))
    fmt = mu_bucket_label if key == "mu_bucket" else str
    chosen = c[2].multiselect(SPLITS[split][2].capitalize(), values, default=values, format_func=fmt, key=f"corr_{key}")
    if not chosen:
        st.info("Choose at least one value to filter by.")
        st.stop()
    numbers = combine(table, key, chosen)
    view = here[DESCRIBED].merge(numbers, on="method", how="left")
    if split != "adv_sign":
        st.caption("Sequences are counted per pair and advantage sign only: the share of sequences dropped is not "
                   "split by category or μ bucket.")

n_tokens = int(here["n_tokens"].max()) if here["n_tokens"].notna().any() else 0
n_seqs = int(here["n_seqs"].max()) if here["n_seqs"].notna().any() else 0
m = st.columns(4)
m[0].metric("Finite tokens", f"{n_tokens:,}", help="the denominator of every token share (the whole pair)")
m[1].metric("Sequences", f"{n_seqs:,}", help="the denominator of the share of sequences dropped")
m[2].metric("Non-finite tokens", f"{int(here['n_nonfinite'].max()):,}", help="left out of every rule, never zeroed")
SOURCES = {"advantage": "stored", "reward minus group mean": "derived"}  # else as named: none (two-sided)
source = here["advantage_source"].iloc[0]
m[3].metric("Advantage", " + ".join(SOURCES.get(s, s) for s in source.split(" + ")),
            help=f"where the rules' advantage comes from ({source}): stored = sequences.advantage; derived = the "
                 "reward minus the mean reward of the prompt group (same run, step and prompt id), for sequences "
                 "without a stored one; none (two-sided) = neither, the rules then act on both sides.")

# ---- methods × shares -------------------------------------------------------------------------------------
st.subheader("What each method does to these tokens")
skipped = view[view["note"] != ""]
if not skipped.empty:
    st.caption(f"Not computed for this pair ({skipped['note'].iloc[0]}): {', '.join(skipped['method'])}.")
drawn = view[view["note"] == ""]
order = drawn["method"].tolist()
bars = drawn.melt(id_vars=["method", "axis"], value_vars=list(SHARES), var_name="share", value_name="value")
bars["share"] = bars["share"].map(SHARES)
st.vega_lite_chart(shares_spec(bars.dropna(subset=["value"]), drawn.dropna(subset=["ess"]), order))
shown = view[["method", "axis", "level", *SHARES, "ess", "weight_mean", "weight_max", "n_tokens", "n_seqs",
              "framework", "params", "source", "note"]]  # fmt: skip
pct = {k: st.column_config.NumberColumn(v, format="percent") for k, v in SHARES.items()}
st.dataframe(
    shown,
    hide_index=True,
    column_config=pct
    | {
        "ess": st.column_config.NumberColumn("ESS", format="%.4f"),
        "weight_mean": st.column_config.NumberColumn("w mean", format="%.4f"),
        "weight_max": st.column_config.NumberColumn("w max", format="%.4g"),
        "framework": st.column_config.TextColumn("framework option"),
    },
)

# ---- the tokens one method drops ---------------------------------------------------------------------------
st.subheader("Tokens a method drops")
droppers = here[(here["note"] == "") & (here["frac_tokens_masked"] > 0)]["method"].tolist()
if not droppers:
    st.info("No method drops a token of this pair.")
    st.stop()
lab_ui.keep_valid("corr_method", droppers)
method = st.selectbox("Method", droppers, key="corr_method",
                      help="the methods that drop at least one token of this pair (whole pair, no filter)")
tokens = lab_corrections.dropped_tokens_of(method, rollout, scorer, overrides, sample)
seqs = dropped_sequences(tokens)
st.caption(
    f"{method} drops {len(tokens):,} of {n_tokens:,} tokens in {len(seqs):,} sequences "
    f"({int(seqs['seq_dropped'].sum()):,} dropped whole). Sequences dropped whole first, then by tokens dropped."
)
lab_select.follow("corr_seq", [(r, int(q)) for r, q in zip(seqs["run_id"], seqs["seq_id"])])  # (its list changes)
lab_ui.keep_valid("corr_seq", list(range(len(seqs))))
seq_labels = [  # built once (a format_func reading the frame per option took ~0.25 s per 1,000 sequences a run)
    f"{r} · seq {q} · {n} dropped" + (" (whole sequence)" if whole else f", first at pos {first}")
    for r, q, n, whole, first in zip(*(seqs[c].tolist() for c in ("run_id", "seq_id", "n_dropped", "seq_dropped",
                                                                   "first_pos")))
]
i = st.selectbox("Sequence", range(len(seqs)), key="corr_seq", format_func=seq_labels.__getitem__)
run_id, seq_id, first_pos = seqs.run_id[i], int(seqs.seq_id[i]), int(seqs.first_pos[i])
positions = tokens[(tokens["run_id"] == run_id) & (tokens["seq_id"] == seq_id)]
st.dataframe(
    positions[["pos", "log_ratio"]].assign(ratio=np.exp(positions["log_ratio"])),
    hide_index=True,
    column_config={"log_ratio": st.column_config.NumberColumn("log r", format="%.4g"),
                   "ratio": st.column_config.NumberColumn("r = π/μ", format="%.4g")},
)
lab_inspect.prefetch(run_id, seq_id=seq_id, scorer=scorer, focus=first_pos)  # (computed in the background)
st.button(f"Open sequence {seq_id} of {run_id} in the token inspector", type="primary", on_click=lab_inspect.open_on,
          args=({"insp_mode": lab_inspect.BY_RUN, "insp_run": run_id, "insp_step": lab_inspect.ALL_STEPS, "insp_seq": seq_id,
                 "insp_scorer": scorer, "insp_focus_pos": first_pos},))
