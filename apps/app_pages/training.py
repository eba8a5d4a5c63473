"""Training: curves per objective from `train_metrics`, the mismatch per step measured from the tokens, and a
step picker that opens a step's sequences."""

import lab_inspect
import lab_ui
import streamlit as st

from mismatch_lab.analysis import definitions

STEP_METRICS = {  # steps.step_series column -> what the chart shows
    "abs_dp_mean": "mean |π − μ| (probability)",
    "kl_k3": "mean k3 = r − log r − 1 (nats)",
    "abs_dlogp_mean": "mean |log π − log μ| (nats)",
    "frac_ratio_outside_clip": f"share of r outside [{definitions.CLIP_LOW:g}, {definitions.CLIP_HIGH:g}]",
}

st.title("Training")
lab_ui.live_store()  # a shard store (a run being recorded) is read per unit (run, step): lab_ui.training
train = lab_ui.training("train_runs")
if train.empty:
    st.info(
        "This study has no training runs (no train run, and no run whose sequences carry a step). Start one "
        "with `mismatch-lab train --study studies/<name>/study.toml --loss dppo_binary_tv`."
    )
    st.stop()

# Label runs by their objective; the run id is added only where two runs share an objective.
dup = train["objective"].duplicated(keep=False)
labels = {r.run_id: f"{r.objective} ({r.run_id})" if d else r.objective for r, d in zip(train.itertuples(), dup)}

# ---- curves -----------------------------------------------------------------------------------------------
st.subheader("Curves per objective")
chosen_runs = st.multiselect("Runs", list(labels), default=list(labels), format_func=labels.get, key="train_runs")
series = lab_ui.training("train_series")
series = series[series["run_id"].isin(chosen_runs)]
if series.empty:
    st.info("The chosen training runs have logged no metrics yet.")
else:
    names = sorted(series["name"].unique())
    preferred = [n for n in ("mismatch/abs_dp/mean", "mask/negative_adv/frac", "reward/mean") if n in names]
    picked = st.multiselect(
        "Metrics (slash paths ending in the reduction)", names, default=preferred or names[:2], key="train_metrics"
    )
    grid = st.columns(2)
    for i, name in enumerate(picked):
        part = series[series["name"] == name].assign(objective=lambda d: d["run_id"].map(labels))
        grid[i % 2].markdown(f"**{name}**")
        lab_ui.line_chart(part, "step", "value", "objective", x_title="step", y_title=name, where=grid[i % 2])

# ---- mismatch per step, from the tokens ------------------------------------------------------------------
st.subheader("Mismatch per step")
st.caption(
    "Measured from the stored tokens, not from logged metrics: per training step and (rollout μ, scorer π) "
    "pair, the mean over the step's finite (token, scorer) rows of |π − μ|, k3 (an unbiased estimate of "
    "KL(μ ‖ π)), |Δlogp| and the share of r = π/μ outside PPO's clip range; non-finite rows are counted "
    "in `n_nonfinite`, never zeroed. Definitions: docs/analysis.md, `steps`."
)
per_step = lab_ui.step_series_of()
per_step = per_step[per_step["run_id"].isin(chosen_runs)]
if per_step.empty:
    st.info("The chosen runs have no scored tokens with a step: the per-step mismatch needs the rollout's and a "
            "scorer's log-probs of the same tokens.")
else:
    shown = st.multiselect("Per-step metrics", list(STEP_METRICS), default=["abs_dp_mean", "kl_k3"],
                           format_func=STEP_METRICS.get, key="train_step_metrics")
    lines = per_step.assign(line=per_step["run_id"].map(labels) + " · " + per_step["rollout"] + " → "
                            + per_step["scorer"])
    grid = st.columns(2)
    for i, metric in enumerate(shown):
        grid[i % 2].markdown(f"**{STEP_METRICS[metric]}**")
        lab_ui.line_chart(lines, "step", metric, "line", x_title="step", y_title=STEP_METRICS[metric],
                          where=grid[i % 2])
    with st.expander("Per-step table"):
        st.dataframe(per_step, hide_index=True)

# ---- one step -------------------------------------------------------------------------------------------
st.subheader("Sequences of a step")
lab_ui.keep_valid("train_step_run", list(labels))
run_id = st.selectbox("Run", list(labels), format_func=labels.get, key="train_step_run")
steps = lab_ui.training("training_steps", run_id)
if steps.empty:
    st.info("This run has stored no sequences yet.")
    st.stop()
step_list = steps["step"].tolist()
step = (
    st.select_slider("Step", step_list, value=step_list[-1], key=f"train_step:{run_id}")
    if len(step_list) > 1
    else step_list[0]
)
row = steps[steps["step"] == step].iloc[0]
c = st.columns(3)
c[0].metric("Sequences", int(row.n_sequences))
c[1].metric("Tokens", int(row.n_tokens))
if row.n_rewarded:
    c[2].metric("Mean reward", f"{row.mean_reward:.3g}", help=f"over the {int(row.n_rewarded)} rewarded sequences")
else:
    c[2].metric("Mean reward", "—", help="no rewards stored for this step")
    st.caption("No rewards were stored for this step.")
st.dataframe(lab_ui.training("list_sequences", run_id, step=int(step)), hide_index=True)

lab_inspect.prefetch(run_id, step=int(step))  # what the inspector shows of the step, computed in the background
st.button(f"Open step {step} in the token inspector", type="primary", on_click=lab_inspect.open_on,
          args=({"insp_mode": lab_inspect.BY_RUN, "insp_run": run_id, "insp_step": int(step)}, ("insp_seq",)))
