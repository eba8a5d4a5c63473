"""The routing analysis on the stored study studies/moe-routing (a real `collect` on the tiny MoE: vLLM rollouts at
bf16, fp16 and fp32, HF scorers hf:fp32 and hf:fp32-r3, routing recorded by both engines), against
routing.compare on the same rows read back with numpy; and doctor's routing check and figure 11 on it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mismatch_lab.analysis.routing import routing_table
from mismatch_lab.doctor.report import diagnose
from mismatch_lab.figures.routing import fig11_routing
from mismatch_lab.routing.compare import Routing, compare
from mismatch_lab.store.reader import open_store

STUDY = str(Path(__file__).resolve().parents[2] / "studies" / "moe-routing")


@pytest.fixture(scope="module")
def con():
    c = open_store(STUDY)
    yield c
    c.close()


def _routing(con, run_id: str, side: str) -> Routing:
    """One side's routing of a run as numpy arrays [N, L, k], tokens in (seq_id, pos) order."""
    df = con.execute("SELECT seq_id, pos, layer, expert_ids, margin FROM routing WHERE run_id = ? AND side = ? "
                     "ORDER BY seq_id, pos, layer", [run_id, side]).df()
    layers = df["layer"].nunique()
    ids = np.stack(df["expert_ids"].map(np.asarray).to_list()).reshape(-1, layers, len(df["expert_ids"][0]))
    margin = df["margin"].to_numpy(dtype=float, na_value=np.nan).reshape(-1, layers)
    return Routing(ids, np.zeros(ids.shape), margin)


def test_the_stored_moe_study_gives_compares_numbers_for_every_pair(con):
    table = routing_table(con)
    pairs = table[table["view"] == "pair"]
    runs = con.execute("SELECT run_id, engine_dtype FROM runs ORDER BY run_id").fetchall()
    assert len(pairs) == 2 * len(runs) == 6
    for run_id, dtype in runs:
        ro = _routing(con, run_id, "rollout")
        for scorer in ("hf:fp32", "hf:fp32-r3"):
            want = compare(ro, _routing(con, run_id, scorer))
            got = pairs[(pairs["rollout"] == f"vllm:{dtype}") & (pairs["scorer"] == scorer)].iloc[0]
            assert (got["tokens"], got["layers"], got["k"], got["flips"]) == (
                want["tokens"], want["layers"], want["k"], want["flips"]), (dtype, scorer)
            assert got["any_layer_differs"] == pytest.approx(want["any_layer_differs"], rel=1e-12)
            assert got["flip_rate_per_layer"] == pytest.approx(want["flip_rate_per_layer"], rel=1e-12)
            assert [(b["cells"], b["flips"]) for b in got["flips_by_margin"]] == [
                (b["cells"], b["flips"]) for b in want["flips_by_margin"]]
    bf16 = pairs[(pairs["rollout"] == "vllm:bf16") & (pairs["scorer"] == "hf:fp32")].iloc[0]
    assert bf16["flips"] > 0 and bf16["r3_scorer"] == "hf:fp32-r3" and 0 < bf16["r3_share"] < 1
    assert (pairs.loc[pairs["scorer"] == "hf:fp32-r3", "flips"] == 0).all()  # replay routes as the rollout did


def test_doctor_judges_each_pair_of_the_stored_moe_study_and_figure_11_draws_it(con):
    rows = {r["pair"]: r for r in diagnose(con, STUDY).checks if r["check"] == "routing"}
    assert len(rows) == 6 and rows["vllm:bf16/hf:fp32"]["verdict"] == "warn"
    assert rows["vllm:bf16/hf:fp32-r3"]["verdict"] == "ok"
    ((stem, fig),) = fig11_routing(con)
    assert stem == "fig11_routing" and len(fig.axes[0].get_lines()) == 6
