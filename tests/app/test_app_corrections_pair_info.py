"""`layout.pair_info` of one pair (what `dropped.dropped_tokens` reads) against every pair's info."""

from __future__ import annotations

import pandas as pd

from mismatch_lab.corrections.layout import pair_info
from mismatch_lab.store.reader import open_store


def test_the_info_of_one_pair_is_that_pairs_row_of_every_pairs_info_and_empty_for_a_pair_the_store_lacks(
        duckdb_store):
    con = open_store(duckdb_store)
    try:
        every = pair_info(con)
        assert len(every) > 1
        for r in every.itertuples():
            one = pair_info(con, (r.rollout, r.scorer))
            expected = every[(every["rollout"] == r.rollout) & (every["scorer"] == r.scorer)].reset_index(drop=True)
            pd.testing.assert_frame_equal(one, expected, check_exact=True)
        assert pair_info(con, (every["rollout"].iloc[0], "no-such-scorer")).empty
    finally:
        con.close()
