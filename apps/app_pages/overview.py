"""Overview: the doctor's verdict per pair and what to change first, then the studies the app can open, the
runs of the open one, its precision table and every check of the doctor. On a shard store (a run being
recorded or imported) each is merged from per-step parts (`lab_ui.overview`): a refresh computes the new steps."""

import lab_ui
import streamlit as st

from mismatch_lab.doctor.report import VERDICT_KEY

BOX = {"ok": st.success, "warn": st.warning, "fail": st.error}  # a pair's verdict, in the box of its colour

st.title("Overview")

doctor = lab_ui.overview("doctor_view")
if doctor.verdicts:
    for v in doctor.verdicts:
        BOX[v["verdict"]](f"**{v['pair']}**: {v['verdict']} · {v['detail']}".replace("|", "\\|"))
    st.caption(f"The doctor (`mismatch-lab doctor`), per (rollout μ, scorer π) pair: {VERDICT_KEY}. "
               "Every check, band and source: the Doctor section below and docs/doctor.md.")
else:
    st.info("No verdict yet: the doctor needs a rollout and at least one scorer of its tokens.")
if doctor.recommendations:
    st.markdown("**What to change**\n\n" + "\n".join(
        f"- **{a['advice']}**: {a['because']}".replace("|", "\\|") for a in doctor.recommendations))

st.subheader("Studies")
st.dataframe(
    lab_ui.studies_table(), hide_index=True, column_config={"open": st.column_config.CheckboxColumn("open now")}
)
st.caption("Pick another study in the sidebar.")

runs = lab_ui.overview("list_runs")
st.subheader("Runs")
if runs.empty:
    st.info("This study has no runs yet. Collect one with `mismatch-lab collect --study studies/<name>/study.toml`, "
            "or bring a training run in with `mismatch-lab import` or the Recorder.")
    st.stop()

m = st.columns(4)
m[0].metric("Runs", len(runs), help="every run of the store: collect, train, recorded and imported")
m[1].metric("Sequences", f"{int(runs['n_sequences'].sum()):,}")
m[2].metric("Tokens", f"{int(runs['n_tokens'].sum()):,}", help="generated tokens (one per response position)")
m[3].metric(
    "Non-finite scores",
    f"{int(runs['n_nonfinite'].sum()):,}",
    help=f"of {int(runs['n_scores'].sum()):,} token × scorer rows; stored as NULL, never zeroed",
)
st.dataframe(
    runs.drop(columns=["engine", "engine_dtype"]),
    hide_index=True,
    column_config={
        "weights_sha256": st.column_config.TextColumn("weights sha256", help="hash of the checkpoint both sides load"),
        "rollout": st.column_config.TextColumn("rollout (μ)", help="'<engine>:<dtype>' of the sampling engine; the engine alone where the run does not say its dtype"),
        "scorers": st.column_config.TextColumn("scorers (π)", help="trainer-side scorers '<engine>:<dtype>'"),
        "n_scores": st.column_config.NumberColumn("token × scorer rows"),
        "n_rewarded": st.column_config.NumberColumn("rewarded sequences"),
        "steps": st.column_config.NumberColumn("training steps"),
    },
)
if runs["status"].eq("running").any():
    st.caption("Some runs are still running: refresh the page (or use any control) to see what they wrote since; "
               "what was computed of finished data is kept and reused.")

st.subheader("Precision table")
st.caption(
    "One row per (rollout μ, scorer π) pair. Token-level columns average over finite tokens "
    "(`n_finite`; non-finite ones counted in `n_nonfinite`), sequence-level `seq_*` columns over sequences "
    "without a non-finite token (`seq_n`). |dp| is in probability space, dlogp = log π − log μ in nats; "
    "kl_k1/k2/k3 are Schulman's estimators of KL(μ ‖ π) from the sampled token; "
    "definitions in `mismatch_lab/analysis/definitions.py`."
)
table = lab_ui.overview("precision_table")
if table.empty:
    st.info("No scored tokens yet: the precision table needs a rollout and at least one scorer.")
else:
    st.dataframe(table, hide_index=True)

with st.expander("Doctor: verdicts against the frameworks' published bands", expanded=True):
    st.caption(
        "One row per (check, pair), as `mismatch-lab doctor`: the measured value, the band it is judged by and "
        "where the band comes from (verl's FAQ, prime-rl's acceptance band, slime's CI, bitwise on-policy, verl's "
        "illustrative weight-health levels); verdict ok / warn / fail. Every check, band and definition: docs/doctor.md."
    )
    verdicts = doctor.table
    if verdicts.empty:
        st.info("No check could be measured: the doctor needs a rollout and at least one scorer.")
    else:
        counts = verdicts["verdict"].value_counts()
        st.caption(" · ".join(f"{v}: {int(counts.get(v, 0))}" for v in ("ok", "warn", "fail")))
        # a dataframe, not st.table: that renders cells as Markdown, and a band ">= 0.3 ok" became a quote
        st.dataframe(verdicts.assign(value=verdicts["value"].map(lambda v: f"{v:.3g}")), hide_index=True)
