"""Token inspector: one sequence token by token, coloured by |Δp|, ratio or mask decision.

Pick a run and a sequence (a training step narrows the list), or jump to the worst sequences by
max |Δp|. Below the coloured response: the detail of one token (its text, μ, π for every scorer,
entropy, top-K) and the sequence's cumulative log-ratio track.
"""

import lab_inspect
import lab_select
import lab_ui
import pandas as pd
import streamlit as st

from mismatch_lab.analysis import browse

BY_RUN, WORST = lab_inspect.BY_RUN, "Worst sequences by max |Δp|"
ANY = "any scorer"
ALL_STEPS = lab_inspect.ALL_STEPS

st.title("Token inspector")
path = lab_ui.live_store()  # (a shard store: no connection on the whole store; its look-ups are per unit)
runs = lab_inspect.runs_of(path)
runs = runs[runs["n_tokens"] > 0]
if runs.empty:
    st.info("This study has no tokens yet: nothing to inspect.")
    st.stop()
run_labels = {r.run_id: f"{r.run_id} · {r.kind} · {r.rollout} · {r.n_sequences} sequences" for r in runs.itertuples()}

# ---- which sequence -----------------------------------------------------------------------------------
mode = st.radio("Pick a sequence", [BY_RUN, WORST], horizontal=True, key="insp_mode", persist_state="session")
if mode == WORST:
    scorers_all = sorted({s for r in runs.itertuples() for s in r.scorers.split(", ") if s})
    left, right = st.columns([1, 3])
    which = left.selectbox("|Δp| under scorer", [ANY] + scorers_all, key="insp_worst_scorer", persist_state="session")
    worst = lab_ui.worst_of(None if which == ANY else which)
    if worst.empty:
        st.info("No scored tokens yet, so there is no |Δp| to rank sequences by.")
        st.stop()
    lab_select.follow("insp_worst_pick", [(r, int(q)) for r, q in zip(worst["run_id"], worst["seq_id"])])
    pick = right.selectbox(
        f"Worst {lab_ui.WORST_N} sequences",
        range(len(worst)),
        format_func=lambda i: (
            f"{worst.run_id[i]} · seq {worst.seq_id[i]} · max |Δp| {worst.max_abs_dp[i]:.4f} "
            f"at pos {worst.worst_pos[i]} ({worst.worst_scorer[i]})"
        ),
        key="insp_worst_pick",
    )
    run_id, seq_id = worst.run_id[pick], int(worst.seq_id[pick])
    seq = lab_inspect.sequences_of(path, run_id, None).set_index("seq_id").loc[seq_id]
else:
    cols = st.columns([2, 1, 2])
    lab_ui.keep_valid("insp_run", list(run_labels))
    run_id = cols[0].selectbox(
        "Run", list(run_labels), format_func=run_labels.get, key="insp_run", persist_state="session"
    )
    step = None
    steps = lab_inspect.steps_of(path, run_id)
    if not steps.empty:
        options = [ALL_STEPS] + steps["step"].tolist()
        lab_ui.keep_valid("insp_step", options)
        chosen = cols[1].selectbox("Training step", options, key="insp_step", persist_state="session")
        step = None if chosen == ALL_STEPS else int(chosen)
    seqs = lab_inspect.sequences_of(path, run_id, step)
    if seqs.empty:
        st.info("This run has no sequences yet.")
        st.stop()
    empty = len(seqs) - len(lab_inspect.listed(seqs))
    if empty:
        seqs = lab_inspect.listed(seqs)
        st.caption(f"{empty:,} sequence(s) without a stored (loss-mask) token are not listed.")
        if seqs.empty:
            st.info("No sequence of this selection has a stored token.")
            st.stop()
    by_id = seqs.set_index("seq_id")
    seq_labels = {  # built once: not three look-ups in the table per option (~0.05 CPU s per 1,000 options)
        s: " · ".join([f"seq {s}"] + ([f"prompt {p}"] if pd.notna(p) else []) + [f"{n} tokens"])
        for s, p, n in zip(by_id.index.tolist(), by_id["prompt_id"].tolist(), by_id["response_len"].tolist())
    }
    lab_ui.keep_valid("insp_seq", list(seq_labels))
    seq_id = int(
        cols[2].selectbox("Sequence", list(seq_labels), key="insp_seq", persist_state="session",
                          format_func=seq_labels.get)
    )
    seq = by_id.loc[seq_id]

tokens = lab_inspect.tokens_of(path, run_id, seq_id)

# ---- the sequence ---------------------------------------------------------------------------------------
st.subheader(f"{run_id} · sequence {seq_id}")
m = st.columns(5)
m[0].metric("Tokens", int(tokens["pos"].nunique()))
m[1].metric("Prompt", lab_ui.shown(seq.prompt_id))
m[2].metric("Finish", lab_ui.shown(seq.finish_reason))
if pd.isna(seq.reward):
    m[3].metric("Reward", "—", help="No reward recorded: collect runs have none.")
else:
    m[3].metric("Reward", f"{seq.reward:.3g}")
# the advantage the masks below read: the stored one, else reward − the group's mean reward (browse docstring)
used = tokens["advantage"].dropna()
advantage = used.iloc[0] if len(used) else seq.advantage  # (a sequence without token rows: the stored one)
derived = pd.isna(seq.advantage) and not pd.isna(advantage)
m[4].metric(
    "Advantage" + (" (derived)" if derived else ""),
    "—" if pd.isna(advantage) else f"{advantage:.3g}",
    help="PPO's clip and DPPO's mask act in the advantage's direction; without one, on either side."
    + (" None is stored for this sequence: this is its reward minus the mean reward of its prompt group "
       "(same step and prompt id), the advantage the masks use." if derived else ""),
)
if pd.isna(seq.reward) and pd.isna(seq.advantage):
    st.caption("This sequence carries no reward or advantage (collect runs have none).")
if tokens.empty:
    st.info("This sequence has no stored (loss-mask) tokens.")
    st.stop()

scorers = lab_inspect.scorers_of(tokens)
if not scorers:
    st.info("No scorer has scored this sequence yet: only the rollout's μ is known.")
    st.dataframe(tokens[["pos", "token_text", "category", "mu"]], hide_index=True)
    st.stop()

c1, c2 = st.columns([1, 2])
lab_ui.keep_valid("insp_scorer", scorers)
scorer = c1.selectbox("Scorer (π)", scorers, key="insp_scorer", persist_state="session")
colour = c2.radio("Colour tokens by", lab_ui.COLOUR_MODES, horizontal=True, key="insp_colour", persist_state="session")
view = tokens[tokens["scorer"] == scorer].reset_index(drop=True)
st.html(lab_ui.token_html(view, colour))
st.caption(lab_ui.colour_legend(colour) + " Hover a token for its numbers.")

n = len(view)
s = st.columns(4)
s[0].metric("max |Δp|", f"{view['abs_dp'].max():.4f}")
s[1].metric(
    "PPO clipped",
    f"{int(view['ppo_clipped'].fillna(False).sum())} / {n}",
    help=f"r = π/μ outside [1 − {browse.EPS_LOW}, 1 + {browse.EPS_HIGH}] (in the advantage's direction "
    f"when there is one), of this sequence's {n} tokens.",
)
s[2].metric(
    "DPPO masked",
    f"{int(view['dppo_masked'].fillna(False).sum())} / {n}",
    help=f"|π − μ| > {browse.DELTA_TV} in the advantage's direction, of {n} tokens.",
)
s[3].metric(
    "Non-finite π",
    f"{int(view['nonfinite'].fillna(False).sum())} / {n}",
    help="Stored as NULL, excluded from the ratio and masks, never replaced by zero.",
)

# ---- one token ------------------------------------------------------------------------------------------
st.subheader("Token detail")
positions = view["pos"].tolist()
focus = st.session_state.pop("insp_focus_pos", None)  # a token another page opens (Corrections: a dropped one)
text_of = {p: lab_ui.token_label(t, i) for p, t, i in zip(view["pos"], view["token_text"], view["token_id"])}
pos = st.selectbox(
    "Token (defaults to the largest |Δp|)",
    positions,
    index=positions.index(lab_inspect.start_pos(view, focus)),
    format_func=lambda p: f"pos {p}: {text_of[p]}",
    key=f"insp_pos:{run_id}:{seq_id}:{scorer}",
)
here = tokens[tokens["pos"] == pos]
first = here.iloc[0]
d = st.columns(4)
d[0].markdown(f"**Text** `{first.token_text!r}`" if isinstance(first.token_text, str) else "**Text** not stored")
d[1].markdown(f"**Token id** {first.token_id} · **category** {first.category}")
d[2].markdown(f"**μ** (rollout) {first.mu:.6g}")
d[3].markdown(f"**log μ** {first.logp_rollout:.6g}")
st.dataframe(
    here[
        [
            "scorer",
            "pi",
            "logp",
            "delta_logp",
            "ratio",
            "abs_dp",
            "entropy",
            "tv_exact_vs_ref",
            "kl_exact_vs_ref",
            "ppo_clipped",
            "dppo_masked",
            "nonfinite",
        ]
    ],
    hide_index=True,
    column_config={
        "pi": st.column_config.NumberColumn("π", format="%.6g"),
        "logp": st.column_config.NumberColumn("log π", format="%.6g"),
        "delta_logp": st.column_config.NumberColumn("Δlogp", format="%.4g"),
        "ratio": st.column_config.NumberColumn("r = π/μ", format="%.4g"),
        "abs_dp": st.column_config.NumberColumn("|Δp|", format="%.4g"),
        "entropy": st.column_config.NumberColumn("entropy (nats)", format="%.4g"),
        "tv_exact_vs_ref": st.column_config.NumberColumn("TV vs hf:fp32 (full vocab)", format="%.4g"),
        "kl_exact_vs_ref": st.column_config.NumberColumn("KL(hf:fp32 ‖ π) nats", format="%.4g"),
    },
)

topk = lab_inspect.topk_of(path, run_id, seq_id, pos)
if topk.empty:
    st.info("No top-K stored for this token: the run was collected, recorded or imported without top-K lists.")
else:
    lists = list(dict.fromkeys(topk["list"]))
    tabs = st.tabs([f"top-K of {name}" for name in lists])
    for tab, name in zip(tabs, lists):
        part = topk[topk["list"] == name]
        table = part.pivot_table(index=["rank", "token_id"], columns="by", values="p", sort=False).reset_index()
        table.insert(2, "text", table["token_id"].map(dict(zip(part["token_id"], part["token_text"]))))
        table = table.rename(columns={"rollout": "μ (rollout)"} | {s: f"π {s}" for s in scorers})
        tab.dataframe(table, hide_index=True)
        if name == "rollout" and len(part["by"].unique()) == 1:
            tab.caption("The scorers' probabilities at the rollout's top-K ids are not stored in this study.")

# ---- the whole sequence ---------------------------------------------------------------------------------
st.subheader("Cumulative log-ratio")
st.caption(
    "Σ over positions ≤ pos of log π − log μ: the log of the sequence-level importance ratio up to pos "
    "(token-level sum; non-finite π skipped)."
)
lab_ui.line_chart(
    tokens.dropna(subset=["scorer"]),
    "pos",
    "cum_log_ratio",
    "scorer",
    x_title="position in the response",
    y_title="Σ log π/μ",
)

with st.expander("All tokens of this sequence"):
    st.dataframe(view.drop(columns=["scorer"]), hide_index=True)
