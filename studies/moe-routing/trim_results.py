"""Keep in studies/moe-routing/results/ only the columns the moe-routing claim needs (studies/README.md):

    mismatch-lab export --db studies/moe-routing/moe-routing.duckdb --out /tmp/moe-routing-full
    .venv/bin/python studies/moe-routing/trim_results.py /tmp/moe-routing-full studies/moe-routing/results

tokens and scores lose their text, category and top-K columns (the reader fills absent contract columns with
NULL); every other table is copied whole.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import duckdb

KEEP = {"tokens": "run_id, seq_id, pos, token_id, logp_rollout",
        "scores": "run_id, seq_id, pos, scorer, logp, entropy, tv_exact_vs_ref, kl_exact_vs_ref, nonfinite"}


def main(src: str, out: str) -> None:
    src_dir, out_dir = Path(src), Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    con = duckdb.connect()
    for f in sorted(src_dir.glob("*.parquet")):
        table = f.stem
        if table not in KEEP:
            shutil.copyfile(f, out_dir / f.name)
            continue
        target = str(out_dir / f.name).replace("'", "''")
        con.execute(f"COPY (SELECT {KEEP[table]} FROM read_parquet(?)) TO '{target}' "
                    "(FORMAT parquet, COMPRESSION zstd)", [str(f)])
    con.close()


if __name__ == "__main__":
    main(*sys.argv[1:3])
