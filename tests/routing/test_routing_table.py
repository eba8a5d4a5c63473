"""The optional `routing` table of the data contract: written with a unit of work, exported only when it holds
rows, and read as empty wherever it is absent (a DuckDB store without MoE runs, an export without routing.parquet)."""

from __future__ import annotations

import pyarrow as pa

from mismatch_lab.store.parquet import export
from mismatch_lab.store.reader import open_store
from mismatch_lab.store.writer import StoreWriter, to_arrow


def _unit(writer: StoreWriter, chunk: int, routing: pa.Table | None) -> None:
    empty = {name: to_arrow(name, {}) for name in ("sequences", "tokens", "scores")}
    writer.write_chunk("r", chunk, **empty, seconds=0.0, routing=routing)


def _routing_rows() -> pa.Table:
    return to_arrow("routing", {
        "run_id": ["r", "r"], "seq_id": [0, 0], "pos": [0, 0], "side": ["rollout", "hf:fp32"], "layer": [1, 1],
        "expert_ids": [[3, 1], [1, 3]], "expert_weights": [[0.75, 0.25], None], "margin": [0.125, None]})


def test_routing_rows_written_with_a_unit_come_back_from_the_store_and_its_export(tmp_path):
    writer = StoreWriter(tmp_path / "s.duckdb")
    writer.start_run("r", study="s", kind="collect", model="m", weights_sha256="", engine="vllm", engine_dtype="bf16",
                     device="cpu", versions={}, config={})
    _unit(writer, 0, _routing_rows())
    writer.close()
    export(tmp_path / "s.duckdb", tmp_path / "results")
    for store in (tmp_path / "s.duckdb", tmp_path / "results"):
        con = open_store(store)
        rows = con.execute("SELECT side, layer, expert_ids, expert_weights, margin FROM routing ORDER BY side").fetchall()
        con.close()
        assert rows == [("hf:fp32", 1, [1, 3], None, None), ("rollout", 1, [3, 1], [0.75, 0.25], 0.125)]


def test_a_store_without_routing_exports_no_routing_file_and_reads_it_as_empty(tmp_path):
    writer = StoreWriter(tmp_path / "s.duckdb")
    writer.start_run("r", study="s", kind="collect", model="m", weights_sha256="", engine="vllm", engine_dtype="bf16",
                     device="cpu", versions={}, config={})
    _unit(writer, 0, None)
    writer.close()
    (tmp_path / "results").mkdir()
    export(tmp_path / "s.duckdb", tmp_path / "results")
    assert not (tmp_path / "results" / "routing.parquet").exists()
    con = open_store(tmp_path / "results")
    assert con.execute("SELECT count(*) FROM routing").fetchone()[0] == 0
    con.close()
