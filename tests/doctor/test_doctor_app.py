"""The Doctor section of the app's Overview page under Streamlit's AppTest, on planted DuckDB stores."""

from __future__ import annotations

from pathlib import Path

from doctor_stores import Pair
from streamlit.testing.v1 import AppTest

APP = Path(__file__).resolve().parents[2] / "apps" / "streamlit_app.py"
TITLE = "Doctor: verdicts against the frameworks' published bands"


def _overview(monkeypatch, path: str) -> AppTest:
    monkeypatch.setenv("MISMATCH_LAB_STUDY", path)
    monkeypatch.setenv("MISMATCH_LAB_APP_WARMUP", "0")
    at = AppTest.from_file(str(APP), default_timeout=60)
    at.run()
    assert not at.exception, at.exception
    return at


def _verdicts(at):
    """The Doctor section's table: the one dataframe with a verdict column (a dataframe, so bands such as
    '>= 0.3 ok' are shown as written, not as Markdown)."""
    (df,) = [d.value for d in at.dataframe if "verdict" in d.value.columns]
    return df


def test_overview_shows_the_doctor_verdicts_of_the_open_store(monkeypatch, store):
    path = store(Pair(rollout="vllm:bf16", pi=0.52), Pair(rollout="vllm:fp16", pi=0.501))
    at = _overview(monkeypatch, path)
    assert [e.label for e in at.expander] == [TITLE]
    df = _verdicts(at)
    verl = df[df["check"] == "abs_dp_mean"].set_index("pair")["verdict"].to_dict()
    assert verl == {"vllm:bf16/hf:fp32": "fail", "vllm:fp16/hf:fp32": "ok"}
    assert {"pair", "check", "value", "band", "source", "verdict"} <= set(df.columns)
    # fails: verl on bf16, bitwise on both pairs
    assert any(c.value.startswith("ok: ") and c.value.endswith("fail: 3") for c in at.caption)


def test_a_store_without_scores_shows_only_the_store_level_checks(monkeypatch, tmp_path):
    import pandas as pd

    from mismatch_lab.store.synthetic import write_store

    runs = pd.DataFrame([{"run_id": "r", "kind": "collect", "status": "complete", "engine": "vllm", "engine_dtype": "bf16"}])
    path = write_store(tmp_path / "noscores.duckdb", {"runs": runs})
    at = _overview(monkeypatch, str(path))
    assert _verdicts(at)[["pair", "check", "verdict"]].values.tolist() == [["vllm:bf16", "skipped_prompts", "ok"]]
