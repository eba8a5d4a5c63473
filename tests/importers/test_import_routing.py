"""Imported MoE routing: SkyRL's `rollout_expert_indices` and miles / slime `rollout_routed_experts`, written as
the frameworks write them, become `routing` rows of the shard store equal to a plain pass over the arrays."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import torch
from framework_writers import miles as miles_writer
from framework_writers.skyrl import naive, save, step_fields
from import_fixtures import slime_payload

from mismatch_lab.store import shards
from mismatch_lab.store.reader import open_store
from mismatch_lab.store.schema import ROUTING_ROLLOUT_SIDE

LAYERS, K, EXPERTS = 3, 2, 8


def _routes(rng, n: int) -> np.ndarray:
    """[n, LAYERS, K] distinct expert ids per row, in a random (rank) order."""
    return np.argsort(rng.random((n, LAYERS, EXPERTS)), axis=-1)[..., :K]


def _skyrl_routing(fields: dict, seed: int, pad_size: int = 2) -> dict:
    """`fields` with rollout_expert_indices and router_padding_mask as SkyRL builds them (NovaSky-AI/SkyRL
    @a9564572): per trajectory vLLM's captured rows (prompt + response - 1: the last token is not forwarded;
    sample 3 captured a shorter prefix, as a multi-turn trajectory whose last observation no turn evaluated),
    `compact_routed_expert_indices` (uint8 below 256 experts), `preprocess.py` placing them from left_pad on
    over `make_replay_padding_indices_np` (arange(k)), `make_router_padding_mask`, then
    `pad_training_input_batch` (arange rows, mask true)."""
    rng = np.random.default_rng(seed)
    attn = fields["attention_mask"].numpy()
    B, T = attn.shape
    n = B - pad_size
    padded = np.empty((n, T, LAYERS, K), dtype=np.uint8)
    padded[...] = np.arange(K, dtype=np.uint8)
    lengths = attn[:n].sum(axis=1)
    captured = lengths - 1
    captured[3] -= 3
    for i in range(n):
        left_pad = T - lengths[i]
        padded[i, left_pad:left_pad + captured[i]] = _routes(rng, captured[i]).astype(np.uint8)
    pos = np.arange(T)[None, :]
    starts = (T - lengths)[:, None]
    mask = ~((pos >= starts) & (pos < starts + captured[:, None]))
    padded = np.concatenate([padded, np.broadcast_to(np.arange(K, dtype=np.uint8), (pad_size, T, LAYERS, K))])
    mask = np.concatenate([mask, np.ones((pad_size, T), dtype=bool)])
    return {**fields, "rollout_expert_indices": torch.from_numpy(padded.copy()),
            "router_padding_mask": torch.from_numpy(mask)}


def _skyrl_expected(fields: dict) -> list[list[tuple]]:
    """Per stored sample (naive's order), by a plain loop: (pos, layer, ids) of each stored response token
    whose predicting forward (column j - 1) has a captured route."""
    loss, resp = fields["loss_mask"].numpy(), fields["response_mask"].numpy()
    routes, pad = fields["rollout_expert_indices"].numpy(), fields["router_padding_mask"].numpy()
    B, R = loss.shape
    T = routes.shape[1]
    out = []
    for i in range(B):
        keep = [c for c in range(R) if loss[i, c] > 0 and resp[i, c] > 0]
        if not keep:
            continue
        rows = []
        for c in keep:
            j = T - R + c
            if j >= 1 and not pad[i, j - 1]:
                rows += [(c - keep[0], layer, [int(x) for x in routes[i, j - 1, layer]]) for layer in range(LAYERS)]
        out.append(rows)
    return out


def _stored_routing(store) -> dict:
    """(step, sample index among the step's stored ones) -> [(pos, layer, ids)] from the store's routing rows."""
    con = open_store(store)
    rows = con.execute("""
        WITH s AS (SELECT run_id, seq_id, step, row_number() OVER (PARTITION BY step ORDER BY seq_id) - 1 AS idx
                   FROM sequences)
        SELECT s.step, s.idx, r.pos, r.layer, r.expert_ids, r.side,
               r.expert_weights IS NULL AND r.margin IS NULL AS no_weights
        FROM routing r JOIN s USING (run_id, seq_id) ORDER BY s.step, r.seq_id, r.pos, r.layer""").fetchall()
    con.close()
    out: dict = {}
    for step, idx, pos, layer, ids, side, no_weights in rows:
        assert side == ROUTING_ROLLOUT_SIDE and no_weights
        out.setdefault((step, idx), []).append((pos, layer, list(ids)))
    return out


def _skyrl_import(cli, tmp_path, steps=(1, 2)) -> tuple[dict, object]:
    dumps = {}
    for s in steps:
        fields, meta = step_fields(s)
        fields = _skyrl_routing(fields, s)
        save(fields, meta, tmp_path / "export" / "dumped_data" / f"global_step_{s}_training_input.pkl")
        dumps[s] = fields
    store = tmp_path / "store"
    code, _, err = cli("import", "skyrl", tmp_path / "export", "--out", store, "--trust-pickle")
    assert code == 0, err
    return dumps, store


def test_skyrl_routing_rows_equal_a_plain_pass_over_rollout_expert_indices(cli, tmp_path):
    dumps, store = _skyrl_import(cli, tmp_path)
    want = {(s, i): rows for s, f in dumps.items() for i, rows in enumerate(_skyrl_expected(f)) if rows}
    got = _stored_routing(store)
    assert got.keys() == want.keys() and got == want
    # the padding rows (arange(k)) are never stored: sample 3 lost its last routes, the pad batch rows all
    assert sum(len(v) for v in want.values()) < sum(len(naive_s["pos"]) for f in dumps.values()
                                                    for naive_s in naive(f, 0)) * LAYERS
    # the routing shard is part of the unit: one per imported step, named like its sequences shard
    names = {p.relative_to(store / "routing").parent.name: p.name for p in (store / "routing").rglob("*.parquet")}
    seqs = {p.relative_to(store / "sequences").parent.name: p.name for p in (store / "sequences").rglob("*.parquet")}
    assert names == seqs and len(names) == len(dumps)


def test_a_damaged_routing_shard_leaves_its_whole_unit_out_and_export_keeps_the_rows(cli, tmp_path):
    dumps, store = _skyrl_import(cli, tmp_path)
    files = shards.committed_files(store)
    assert len(files["routing"]) == len(dumps)
    victim = min((store / "routing").rglob("*.parquet"))
    export = tmp_path / "export-out"
    assert cli("export", "--db", store, "--out", export)[0] == 0
    exported = pq.read_table(export / "routing.parquet") if (export / "routing.parquet").is_file() else \
        pq.read_table(export / "routing")
    con = open_store(store)
    assert exported.num_rows == con.execute("SELECT count(*) FROM routing").fetchone()[0] > 0
    con.close()
    victim.write_bytes(victim.read_bytes()[:-20])  # cut short, as a node dying mid-write leaves it
    damaged: list = []
    left = shards.committed_files(store, damaged=damaged)
    assert [d.table for d in damaged] == ["routing"]
    assert all(len(left[t]) == len(dumps) - 1 for t in ("sequences", "tokens", "scores", "routing"))


def test_a_skyrl_dump_without_routing_writes_no_routing_shard_and_reads_as_empty(cli, tmp_path):
    fields, meta = step_fields(7)
    save(fields, meta, tmp_path / "export" / "dumped_data" / "global_step_7_training_input.pkl")
    store = tmp_path / "store"
    assert cli("import", "skyrl", tmp_path / "export", "--out", store, "--trust-pickle")[0] == 0
    assert not (store / "routing").exists()
    con = open_store(store)
    assert con.execute("SELECT count(*) FROM routing").fetchone()[0] == 0
    con.close()


def test_analyze_of_an_import_with_only_rollout_routing_says_there_is_no_pair_to_compare(cli, tmp_path):
    _, store = _skyrl_import(cli, tmp_path, steps=(1,))
    code, out, err = cli("analyze", "--db", store, "--json", tmp_path / "a.json")
    assert code == 0, err
    # only the rollout side was imported: analysis.routing pairs a rollout with a scorer, so no pair row
    assert json.loads((tmp_path / "a.json").read_text())["routing"] == []
    assert "MoE routing recorded for side(s) rollout only: no rollout/trainer pair to compare" in out


def _response_rows(routes: np.ndarray, T: int, R: int, mask) -> list[tuple]:
    """(pos, layer, ids) of a slime / miles sample by a plain loop: stored response token t (sequence position
    T - R + t) takes routes[T - R + t - 1] where that row exists."""
    keep = [t for t in range(R) if mask[t]]
    out = []
    for t in keep:
        row = T - R + t - 1
        if 0 <= row < len(routes):
            out += [(t - keep[0], layer, [int(x) for x in routes[row, layer]]) for layer in range(LAYERS)]
    return out


def test_slime_routing_rows_equal_a_plain_pass_over_rollout_routed_experts(cli, tmp_path):
    """slime's `_build_dump_payload` puts each per-sample rollout_data column into the sample dicts, so a
    rollout_data holding `rollout_routed_experts` ([len(tokens) - 1, num_layers, topk], `types.py`) dumps it per
    sample; sample 2's routes stop 2 rows short (a partial capture)."""
    rng = np.random.default_rng(5)
    d = tmp_path / "dump" / "train_data"
    d.mkdir(parents=True)
    want = {}
    for step in (0, 1):
        p = slime_payload(step, seed=step + 1)
        for i, smp in enumerate(p["samples"]):
            T = smp["total_lengths"]
            smp["rollout_routed_experts"] = torch.from_numpy(_routes(rng, T - 1 - 2 * (i == 2)).astype(np.int32))
        torch.save(p, d / f"{step}.pt")
        kept = [smp for smp in p["samples"] if int(smp["loss_masks"].sum())]
        for i, smp in enumerate(kept):
            want[(step, i)] = _response_rows(smp["rollout_routed_experts"].numpy(), smp["total_lengths"],
                                             smp["response_lengths"], smp["loss_masks"].tolist())
    store = tmp_path / "store"
    code, _, err = cli("import", "slime", tmp_path / "dump", "--out", store, "--trust-pickle")
    assert code == 0, err
    assert _stored_routing(store) == {k: v for k, v in want.items() if v}


def test_miles_routing_joined_over_rank_files_equals_a_plain_pass(cli, tmp_path):
    """miles keeps `rollout_routed_experts` in rollout_data as per-sample tensors (data.py ~l.117), whole on
    every rank of the sample's data-parallel share (not context-parallel sliced): added to each rank file the
    writer made, as the dump holds it where replay did not consume it."""
    rng = np.random.default_rng(9)
    samples = miles_writer.rollout_samples(3)
    routes = {s["sample_index"]: _routes(rng, s["P"] + s["R"] - 1).astype(np.int32) for s in samples}
    for path in miles_writer.write_rollout(tmp_path / "dump", 4, samples, cp_size=2):
        pack = torch.load(path, weights_only=False)
        data = pack["rollout_data"]
        data["rollout_routed_experts"] = [torch.from_numpy(routes[i]) for i in data["sample_indices"]]
        torch.save(pack, path)
    store = tmp_path / "store"
    code, _, err = cli("import", "miles", tmp_path / "dump", "--out", store, "--trust-pickle")
    assert code == 0, err
    ordered = sorted(samples, key=lambda s: s["sample_index"])
    want = {(4, i): _response_rows(routes[s["sample_index"]], s["P"] + s["R"], s["R"], s["loss_mask"])
            for i, s in enumerate(ordered)}
    assert _stored_routing(store) == want


def test_routing_in_some_samples_only_is_a_one_line_error(cli, tmp_path):
    p = slime_payload(0, seed=1)
    T = p["samples"][0]["total_lengths"]
    p["samples"][0]["rollout_routed_experts"] = torch.zeros((T - 1, LAYERS, K), dtype=torch.int32)
    torch.save(p, tmp_path / "0.pt")
    code, _, err = cli("import", "slime", tmp_path / "0.pt", "--out", tmp_path / "store", "--trust-pickle")
    assert code == 2 and "'rollout_routed_experts' is present in some samples and missing in others" in err


def test_the_routing_page_of_an_import_with_only_rollout_routing_reads_no_whole_store(cli, tmp_path, monkeypatch):
    """The Routing page's table of a shard store (`store.units_routing`) from the sides its units hold: with the
    rollout's routes alone it is the whole-store table (empty: no cell both sides recorded), and a refresh after a
    new step counts that step's rows alone, with no connection on the whole store."""
    from mismatch_lab.analysis import routing
    from mismatch_lab.store import cache, reader, units_merged, units_routing

    _, store = _skyrl_import(cli, tmp_path, steps=(1, 2))
    results = cache.ResultsCache(store)
    con = open_store(store)
    whole = routing.routing_table(con)
    con.close()
    mine = units_routing.routing_table(units_routing.RoutingUnits(store), results)
    assert whole.empty and mine.empty and list(mine.columns) == list(whole.columns)
    sides = units_merged.merged(units_routing.RoutingUnits(store), results, "routing_sides")
    assert set(sides["side"]) == {ROUTING_ROLLOUT_SIDE} and sides["n"].sum() > 0
    opens = []
    opened = reader._open_parquet_dir
    monkeypatch.setattr(reader, "_open_parquet_dir", lambda d, files=None, *a, **k: opens.append(files)
                        or opened(d, files, *a, **k))
    _skyrl_import(cli, tmp_path, steps=(3,))  # (the import adds the new dump: the others are imported)
    assert units_routing.routing_table(units_routing.RoutingUnits(store), results).empty
    assert opens and None not in opens
    read = {p.split("/step-")[1][:8] for files in opens for t, fs in files.items() if t != "runs" for p in fs}
    assert read == {"00000003"}
