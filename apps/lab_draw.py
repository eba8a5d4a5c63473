"""Drawing helpers of the app's pages: stored values as text, line charts, the inspector's token colours."""

from __future__ import annotations

import html
import math

import pandas as pd
import streamlit as st

from mismatch_lab.analysis import browse


def shown(value) -> str:
    """A stored value as text; '—' where the store holds none (a recorded or imported run keeps only the
    required columns)."""
    return "—" if value is None or (not isinstance(value, str) and pd.isna(value)) else str(value)


token_label = browse.token_label  # a token for a picker or a table: its quoted string, else its id


def keep_valid(key: str, options: list) -> None:
    """Drop a remembered widget value that is no longer among its options (another run, study or step)."""
    if key in st.session_state and st.session_state[key] not in options:
        del st.session_state[key]


def line_chart(data: pd.DataFrame, x: str, y: str, color: str, *, x_title: str, y_title: str, where=st) -> None:
    """A line chart of long-format data over an integer x (step, position), one line per value of `color`.

    Altair directly, not `st.line_chart`: labels such as 'hf:fp32' would be read as Altair shorthand
    once pivoted into column names. Altair is imported here: ~0.25 s of a fresh server's first page, which the
    pages without a chart do not need.
    """
    import altair as alt

    chart = (
        alt.Chart(data[[x, y, color]])
        .mark_line(point=len(data) <= 60)
        .encode(
            x=alt.X(f"{x}:Q", title=x_title, axis=alt.Axis(format="d", tickMinStep=1)),  # steps and positions
            y=alt.Y(f"{y}:Q", title=y_title),
            # past ten lines the default ten-colour scheme repeats: twenty colours (the stability study has 11 runs)
            color=alt.Color(f"{color}:N", title=color,
                            scale=alt.Scale(scheme="tableau20" if data[color].nunique() > 10 else "tableau10"),
                            legend=alt.Legend(labelLimit=0)),  # whole labels: pairs may differ only at the end
            tooltip=[alt.Tooltip(f"{x}:Q"), alt.Tooltip(f"{y}:Q", format=".4g"), alt.Tooltip(f"{color}:N")],
        )
    )
    where.altair_chart(chart, width="stretch")


# --- token colours for the inspector ------------------------------------------------------------------

COLOUR_MODES = ("|Δp|", "ratio", "mask decision")
MASK_COLOURS = {  # key -> (legend, colour name, rgb)
    "kept": ("kept by both", "no colour", None),
    "ppo": ("PPO clips only", "orange", (245, 158, 11)),
    "dppo": ("DPPO masks only", "purple", (139, 92, 246)),
    "both": ("PPO clips and DPPO masks", "red", (220, 38, 38)),
}


def _mask_key(row) -> str:
    ppo, dppo = bool(row.ppo_clipped), bool(row.dppo_masked)
    return "both" if ppo and dppo else "ppo" if ppo else "dppo" if dppo else "kept"


def _background(row, mode: str) -> str:
    if row.nonfinite or pd.isna(row.logp):
        return "background: repeating-linear-gradient(45deg,#ddd,#ddd 3px,#fff 3px,#fff 6px);"
    if mode == "|Δp|":
        # saturates at DPPO's δ so colours compare across sequences; sqrt makes small bf16 noise visible
        a = math.sqrt(min(row.abs_dp / browse.DELTA_TV, 1.0))
        return f"background: rgba(220,38,38,{a:.3f});"
    if mode == "ratio":
        lr = row.delta_logp
        a = min(abs(lr) / math.log(1 + browse.EPS_HIGH), 1.0)  # saturates at the clip-higher bound
        rgb = "220,38,38" if lr > 0 else "37,99,235"
        return f"background: rgba({rgb},{a:.3f});"
    rgb = MASK_COLOURS[_mask_key(row)][2]
    return f"background: rgb{rgb};color:white;" if rgb else ""


def token_html(tokens: pd.DataFrame, mode: str) -> str:
    """The response as HTML spans coloured by |Δp|, ratio or mask decision, each with a tooltip of its numbers."""
    spans = []
    for row in tokens.itertuples(index=False):
        if isinstance(row.token_text, str) and row.token_text:
            text = html.escape(row.token_text).replace("\n", "↵<br>")
        else:  # stored without text (no tokenizer): the id, in brackets
            text = html.escape(f"⟨{row.token_id}⟩" if pd.notna(row.token_id) else "∅")
        tip = f"pos {row.pos} · {token_label(row.token_text, row.token_id)} · μ={row.mu:.4g}" + (
            "  π=non-finite" if pd.isna(row.logp) else f" · π={row.pi:.4g} · r={row.ratio:.4g} · |Δp|={row.abs_dp:.3g}"
        )
        spans.append(
            f'<span title="{html.escape(tip)}" style="{_background(row, mode)}'
            f'border-radius:3px;padding:0 1px;">{text}</span>'
        )
    return (
        '<div style="font-family:ui-monospace,monospace;white-space:pre-wrap;line-height:1.9;'
        'border:1px solid #ddd;border-radius:6px;padding:10px;">' + "".join(spans) + "</div>"
    )


def colour_legend(mode: str) -> str:
    if mode == "|Δp|":
        return (
            f"Red intensity = √(|π − μ| / {browse.DELTA_TV}), saturating at DPPO's δ = {browse.DELTA_TV}. "
            "Hatched grey: non-finite π."
        )
    if mode == "ratio":
        return (
            f"Red: r = π/μ > 1, blue: r < 1; full colour at |log r| ≥ log(1 + {browse.EPS_HIGH}). "
            "Hatched grey: non-finite π."
        )
    parts = [f"{name} = {label}" for label, name, _ in MASK_COLOURS.values()]
    return (
        f"PPO clips r = π/μ outside [1 − {browse.EPS_LOW}, 1 + {browse.EPS_HIGH}], DPPO masks "
        f"|π − μ| > {browse.DELTA_TV}; both only in the advantage's direction when the sequence has one. "
        + "Colours: "
        + "; ".join(parts)
        + "; hatched grey = non-finite π."
    )
