"""`mismatch-lab corrections --preset / --framework / --list-presets` on a stored study and on a store the
Recorder wrote, checked against per-sequence references computed from the store's own tables (DuckDB) or from
the arrays the test recorded: verl's Geo-RS keeps a sequence iff the mean of log μ − log π over its tokens lies
in [log 0.999, log 1.001], and a token-mean metric averaged over the layout's batches by tokens is the mean
over all tokens."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from mismatch_lab.analysis import definitions as d
from mismatch_lab.cli import main
from mismatch_lab.corrections import frameworks
from mismatch_lab.store.reader import open_store

STUDY = Path(__file__).resolve().parents[2] / "studies" / "batch-invariance"
GEO_LOW, GEO_HIGH = math.log(0.999), math.log(1.001)


def per_sequence(store) -> list[tuple]:
    """(rollout, scorer, n tokens, mean(log μ − log π)) of every sequence of every pair, finite tokens only."""
    con = open_store(store)
    return con.execute(f"""
        SELECT {d.ROLLOUT_LABEL_SQL} AS rollout, s.scorer, t.run_id, t.seq_id, count(*) AS n,
               avg(t.logp_rollout - s.logp) AS k1
        FROM tokens t JOIN scores s ON s.run_id = t.run_id AND s.seq_id = t.seq_id AND s.pos = t.pos
        JOIN runs ON runs.run_id = t.run_id
        WHERE {d.finite_sql('t.logp_rollout', 's.logp', None)}
        GROUP BY ALL""").fetchall()


def geo_shares(rows: list[tuple]) -> dict[tuple[str, str], tuple[float, float]]:
    """(rollout, scorer) -> (kept token share, kept sequence share) under verl's default Geo-RS band."""
    out: dict[tuple[str, str], list[int]] = {}
    for rollout, scorer, _run, _seq, n, k1 in rows:
        c = out.setdefault((rollout, scorer), [0, 0, 0, 0])
        kept = GEO_LOW <= k1 <= GEO_HIGH
        c[0] += n * kept
        c[1] += n
        c[2] += kept
        c[3] += 1
    return {k: (c[0] / c[1], c[2] / c[3]) for k, c in out.items()}


def run_json(tmp_path, *args) -> list[dict]:
    out = tmp_path / "p.json"
    assert main(["corrections", *args, "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert set(data) == {"presets"}
    return data["presets"]


def test_framework_verl_on_a_stored_study_runs_every_preset_default_first_with_geo_rs_as_the_reference(
        tmp_path, capsys):
    rows = run_json(tmp_path, "--db", str(STUDY), "--framework", "verl")
    names = [p.name for p in frameworks.of_framework("verl")]
    expected = geo_shares(per_sequence(STUDY))
    assert [r["preset"] for r in rows] == [n for n in names for _ in expected]
    assert rows[0]["preset"] == "verl/default" and rows[0]["default"] is True
    geo = {(r["rollout"], r["scorer"]): r for r in rows if r["preset"] == "verl/decoupled_geo_rs"}
    assert set(geo) == set(expected)
    for pair, (tokens, seqs) in expected.items():
        assert geo[pair]["kept_token_share"] == pytest.approx(tokens, rel=1e-12)
        assert geo[pair]["kept_seq_share"] == pytest.approx(seqs, rel=1e-12)
    assert min(t for t, _ in expected.values()) < 0.5  # the band rejects on this study: the check bites
    for r in rows:
        assert 0 <= r["kept_token_share"] <= 1 and r["metrics"], r["preset"]
    out = capsys.readouterr().out
    assert "verl/decoupled_geo_rs  vllm:bf16 × hf:fp32: kept tokens" in out
    assert "rollout_corr/rollout_rs_seq_mean_k1_masked_fraction = " in out


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """A Recorder store: 2 steps × 16 sequences of lengths 1..12; even sequences have log π = log μ − 1e-5
    (Geo-RS keeps them), odd ones log π = log μ − 0.05 (rejected). Returns (path, lengths, kept flags)."""
    from mismatch_lab.record import Recorder

    rng = np.random.default_rng(3)
    path = tmp_path_factory.mktemp("rec") / "store"
    lengths, kept = [], []
    with Recorder(path, "r", framework="verl", rollout_engine="vllm", trainer_dtype="fp32",
                  rollout_dtype="bf16") as rec:
        for step in range(2):
            lens = rng.integers(1, 13, 16)
            mask = np.arange(12)[None, :] < lens[:, None]
            lmu = -rng.exponential(1.0, (16, 12)) - 0.1
            gap = np.where(np.arange(16) % 2 == 0, 1e-5, 0.05)[:, None]
            adv = np.linspace(-1.0, 1.0, 16)
            rec.log_step(step, rng.integers(0, 50, (16, 12)), mask, lmu, lmu - gap, advantages=adv)
            lengths += lens.tolist()
            kept += (np.arange(16) % 2 == 0).tolist()
    return path, np.array(lengths), np.array(kept)


def test_presets_on_a_recorded_store_keep_what_the_recorded_gaps_decide(recorded, tmp_path):
    path, lengths, kept = recorded
    rows = run_json(tmp_path, "--db", str(path), "--preset", "verl/decoupled_geo_rs", "--preset", "verl/default")
    assert [r["preset"] for r in rows] == ["verl/decoupled_geo_rs", "verl/default"]
    geo, default = rows
    assert geo["n_tokens"] == lengths.sum() and geo["n_seqs"] == len(lengths)
    assert geo["kept_token_share"] == lengths[kept].sum() / lengths.sum()
    assert geo["kept_seq_share"] == kept.mean()
    assert default["kept_token_share"] == 1.0 and default["advantage_source"] == "advantage"
    mean_gap = open_store(path).execute(
        "SELECT avg(t.logp_rollout - s.logp) FROM tokens t JOIN scores s USING (run_id, seq_id, pos)").fetchone()[0]
    assert default["metrics"]["rollout_corr/kl"] == pytest.approx(mean_gap, rel=1e-9)
    assert default["metrics"]["actor/pg_clipfrac"] == 0.0  # π_old = π in a store: the PPO ratio is 1


def test_list_presets_names_every_preset_its_framework_default_and_source_without_a_store(capsys):
    assert main(["corrections", "--list-presets"]) == 0
    out = capsys.readouterr().out
    for p in frameworks.presets().values():
        assert f"{p.name}  [framework {p.framework}{', default' if p.default else ''}]" in out
        assert p.source in out
    assert "verl/default  [framework verl, default]" in out


@pytest.mark.parametrize("bad, says", [
    (["--preset", "verl/nonsense"], "--list-presets"),
    (["--framework", "nonsense"], "choose one of"),
    (["--framework", "nemo-rl"], "no presets for nemo-rl yet"),
    (["--preset", "verl/default", "--set", "seq_mis.cap=2"], "drop --set"),
])
def test_bad_preset_arguments_exit_2_with_one_line_naming_the_fix(bad, says, capsys):
    assert main(["corrections", "--db", str(STUDY), *bad]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err


def test_corrections_without_a_store_asks_for_one(capsys):
    assert main(["corrections", "--preset", "verl/default"]) == 2
    assert "pass --db STORE" in capsys.readouterr().err
