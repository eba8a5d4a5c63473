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
    (["--preset", "verl/default", "--set", "seq_mis.cap=2"], "drop --set"),
])
def test_bad_preset_arguments_exit_2_with_one_line_naming_the_fix(bad, says, capsys):
    assert main(["corrections", "--db", str(STUDY), *bad]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err


def test_corrections_without_a_store_asks_for_one(capsys):
    assert main(["corrections", "--preset", "verl/default"]) == 2
    assert "pass --db STORE" in capsys.readouterr().err


def _train_batch():
    """A step's rollout of 4 sequences in 2 groups (rewards 1/0: advantages ±), as the loop builds it."""
    import torch

    from mismatch_lab.engines.base import Sample
    from mismatch_lab.rl import step as parts

    lengths = [3, 5, 2, 4]
    samples = [Sample(token_ids=list(range(3, 3 + n)), logps=[-1.0] * n, text="", finish_reason="stop")
               for n in lengths]
    rows = [{"seq_id": i, "prompt_id": f"p{i // 2}", "sample_idx": i % 2, "prompt_len": 3} for i in range(4)]
    batch = parts.make_batch(samples, rows, [[1, 2, 4]] * 4, [1.0, 0.0, 0.0, 1.0], group_size=2, normalize_std=True)
    return batch, torch, parts


def _model(tiny_model):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)


def test_train_preset_trains_with_the_frameworks_own_loss_and_logs_its_metrics(tiny_model):
    """`train --preset verl/...`: the mini-batch's loss is the preset's on (π, π_old = π, μ, A); a bypass
    Geo-RS preset whose band every sequence misses leaves the model untouched, verl's default moves it."""
    from mismatch_lab.corrections.frameworks import Tokens, get
    from mismatch_lab.rl.loop import TrainConfig, response_logps

    batch, torch, parts = _train_batch()
    model, _ = _model(tiny_model)
    with torch.no_grad():
        lp, _, _, _ = response_logps(model, batch.prompt_ids, batch.responses, trainer_dtype="fp32")
    T = lp.shape[1]
    batch.logp_mu[:, :T] = torch.where(batch.mask[:, :T], lp - 0.5, 0.0)  # μ 0.5 nats below π on every token
    for name, moves in (("verl/bypass_pg_geo_rs", False), ("verl/default", True)):
        model, opt = _model(tiny_model)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        cfg = TrainConfig(loss="grpo", preset=name)
        cfg.validate()
        scored = parts.train_on_batch(model, opt, batch, cfg, cfg.loss_config(), topk=False, times={})
        m = scored.minibatch_metrics[0]
        mask = batch.mask[:, :T]
        adv = torch.where(mask, batch.adv[:, None], 0.0)
        lp_b = scored.logp_before[:, :T]
        expected = get(name)(Tokens(lp_b, lp_b, batch.logp_mu[:, :T], adv, mask))
        assert m["loss/value"] == pytest.approx(float(expected.loss), rel=1e-6, abs=1e-12)
        assert {f"framework/{k}" for k in expected.metrics} <= set(m)
        changed = any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
        assert changed is moves, name
        if not moves:
            assert m["framework/rollout_corr/rollout_rs_masked_fraction"] == 1.0 and m["mask/all/frac"] == 1.0


def test_train_preset_refuses_an_unknown_framework_preset_and_several_minibatches():
    from mismatch_lab.errors import UserError
    from mismatch_lab.rl.loop import TrainConfig

    with pytest.raises(UserError, match="--list-presets"):
        TrainConfig(preset="verl/nonsense").validate()
    with pytest.raises(UserError, match="--minibatches 1"):
        TrainConfig(preset="verl/default", minibatches=2).validate()
    assert TrainConfig(preset="verl/default").run_id() != TrainConfig().run_id()
