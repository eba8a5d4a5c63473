"""A store's tokens as the rules' [B, T] batches: per (rollout, scorer) pair, in chunks of whole sequences,
padded per response-length bucket so that padding stays under 2x the tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import pandas as pd
import pyarrow as pa

from mismatch_lab.analysis import definitions as d
from mismatch_lab.analysis.relations import col, table_columns

SIGN_CODES = {"positive": 0, "negative": 1, "zero": 2, "unknown": 3}
"""The advantage-sign group of a sequence, as `Chunk.seq_sign` codes it (report.py names them back)."""


def ragged(lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(row, col) of every element of ragged rows of lengths `lens` [R], row-major: both [Σ lens]."""
    rows = np.repeat(np.arange(len(lens)), lens)
    return rows, np.arange(lens.sum()) - np.repeat(np.cumsum(lens) - lens, lens)


def _joined(con, topk: bool) -> str:
    """SQL: one row per (token, scorer): rollout, scorer, run/seq/pos, lmu, lpi, finite, category, mu_bucket,
    adv (NULL when unknown), adv_source; with topk the rollout's top-K ids / log-probs and the scorer's
    log-probs at those ids."""
    tc, sc, qc = table_columns(con, "tokens"), table_columns(con, "scores"), table_columns(con, "sequences")
    adv, rew = col(qc, "q", "advantage", "DOUBLE"), col(qc, "q", "reward", "DOUBLE")
    group = f"q.run_id, {col(qc, 'q', 'step', 'INTEGER')}, {col(qc, 'q', 'prompt_id', 'VARCHAR')}"
    extra = ""
    if topk:
        extra = (f", {col(tc, 't', 'token_id', 'INTEGER')} AS token_id, "
                 f"{col(tc, 't', 'topk_ids_rollout', 'INTEGER[]')} AS k_ids, "
                 f"{col(tc, 't', 'topk_logps_rollout', 'DOUBLE[]')} AS k_mu, "
                 f"{col(sc, 's', 'logps_at_rollout_topk', 'DOUBLE[]')} AS k_pi")
    return f"""
        SELECT {d.ROLLOUT_LABEL_SQL} AS rollout, s.scorer, t.run_id, t.seq_id, t.pos,
               t.logp_rollout AS lmu, s.logp AS lpi,
               {d.finite_sql('t.logp_rollout', 's.logp', col(sc, 's', 'nonfinite', 'BOOLEAN'))} AS finite,
               coalesce({col(tc, 't', 'category', 'VARCHAR')}, 'uncategorized') AS category,
               {d.bucket_sql('linear', lmu='t.logp_rollout')} AS mu_bucket, a.adv, a.adv_source {extra}
        FROM tokens t
        JOIN scores s ON s.run_id = t.run_id AND s.seq_id = t.seq_id AND s.pos = t.pos
        JOIN runs ON runs.run_id = t.run_id
        LEFT JOIN (SELECT q.run_id, q.seq_id, {d.group_advantage_sql(adv, rew, group)} AS adv,
                          CASE WHEN {adv} IS NOT NULL THEN 'advantage'
                               WHEN {rew} IS NOT NULL THEN 'reward minus group mean' END AS adv_source
                   FROM sequences q) a ON a.run_id = t.run_id AND a.seq_id = t.seq_id"""


def pair_info(con, pair: tuple[str, str] | None = None) -> pd.DataFrame:
    """One row per (rollout, scorer): n_tokens (finite), n_nonfinite, has_topk (every finite token carries
    equal-length top-K lists on both sides), advantage_source ('advantage', 'reward minus group mean',
    'none (two-sided)', or several joined by ' + '). `pair` (rollout, scorer): that pair's row only (none if
    the store lacks it), read without scanning the other pairs."""
    topk = {"topk_ids_rollout", "topk_logps_rollout"} <= table_columns(con, "tokens") and (
        "logps_at_rollout_topk" in table_columns(con, "scores"))
    # the sampled token's id decides whether it joins the slots: without it the top-K sums are not defined
    ok = ("coalesce(token_id IS NOT NULL AND len(k_ids) > 0 AND len(k_mu) = len(k_ids) AND len(k_pi) = len(k_ids) "
          "AND list_count(k_mu) = len(k_ids) AND list_count(k_pi) = len(k_ids), false)") if topk else "false"
    where, params = ("WHERE rollout = $r AND scorer = $s", {"r": pair[0], "s": pair[1]}) if pair else ("", {})
    return con.execute(f"""
        SELECT rollout, scorer, count(*) FILTER (WHERE finite) AS n_tokens,
               count(*) FILTER (WHERE NOT finite) AS n_nonfinite,
               coalesce(bool_and({ok}) FILTER (WHERE finite), false) AS has_topk,
               string_agg(DISTINCT coalesce(adv_source, 'none (two-sided)'), ' + '
                          ORDER BY coalesce(adv_source, 'none (two-sided)')) AS advantage_source
        FROM ({_joined(con, topk)}) {where} GROUP BY rollout, scorer ORDER BY rollout, scorer""", params).df()


@dataclass
class Part:
    """One padded batch of a chunk: `batch` [B, T]; `gid` [B·T] the token group of each cell (padding: the
    extra group n_groups), `sid` [B] the sequence group of each row; `index` the chunk's flat position of each
    response cell, in the order `batch.mask` selects them (row-major)."""

    batch: object
    gid: object  # torch.LongTensor [B * T]
    sid: object  # torch.LongTensor [B]
    index: np.ndarray | None = None  # [Σ lengths] int64


@dataclass
class Chunk:
    """Whole sequences of one pair, flat in (run_id, seq_id, pos) order: n tokens, seq_start [S] offsets."""

    pair: int
    lmu: np.ndarray
    lpi: np.ndarray
    adv: np.ndarray  # per token, NaN where unknown
    category: np.ndarray
    mu_bucket: np.ndarray
    seq_start: np.ndarray
    topk: tuple | None  # (anchor [N, K], pi [N, K], valid [N, K]) or None
    rows: pa.RecordBatch | None = None  # the chunk's rows as read (columns of `_joined`)

    @property
    def n(self) -> int:
        return len(self.lmu)

    @property
    def lengths(self) -> np.ndarray:
        """[S] response tokens of each sequence."""
        return np.diff(np.append(self.seq_start, self.n))

    def seq_sign(self) -> np.ndarray:
        a = self.adv[self.seq_start] if self.n else np.zeros(0)
        c = SIGN_CODES
        return np.select([np.isnan(a), a > 0, a < 0], [c["unknown"], c["positive"], c["negative"]], c["zero"])

    def token_keys(self) -> pd.DataFrame:
        return pd.DataFrame({"pair": self.pair, "adv_sign": np.repeat(self.seq_sign(), self.lengths),
                             "mu_bucket": self.mu_bucket, "category": self.category})

    def seq_keys(self) -> pd.DataFrame:
        return pd.DataFrame({"pair": self.pair, "adv_sign": self.seq_sign()})

    def parts(self, gid: np.ndarray, n_groups: int, sid: np.ndarray) -> Iterator[Part]:
        """[B, T] batches: sequences grouped by ceil(log2 length) and by whether the advantage is known.
        gid [n]: each token's group (padding cells get n_groups); sid [S]: each sequence's group."""
        lengths = self.lengths
        known = ~np.isnan(self.adv[self.seq_start])
        group = np.ceil(np.log2(lengths)).astype(np.int64) * 2 + known
        for g in np.unique(group):
            seqs = np.flatnonzero(group == g)
            yield self._part(seqs, lengths, bool(g % 2), gid, n_groups, sid[seqs])

    def _part(self, seqs, lengths, known: bool, gid, n_groups: int, sid) -> Part:
        import torch

        from mismatch_lab.corrections.batch import Batch
        from mismatch_lab.corrections.divergences import TopK

        lens, starts = lengths[seqs], self.seq_start[seqs]
        rows, cols = ragged(lens)
        index = np.repeat(starts, lens) + cols
        shape = (len(seqs), int(lens.max()))

        def grid(values: np.ndarray, fill=0.0) -> torch.Tensor:
            dtype = {np.dtype(bool): torch.bool, np.dtype(np.int64): torch.int64}.get(values.dtype, torch.float64)
            out = torch.full((*shape, *values.shape[1:]), fill, dtype=dtype)
            out[rows, cols] = torch.from_numpy(values[index])
            return out

        lp, lmu = grid(self.lpi), grid(self.lmu)
        mask = grid(np.ones(self.n, dtype=bool), False)
        topk = TopK(*(grid(a) for a in self.topk)) if self.topk is not None else None
        adv = grid(np.nan_to_num(self.adv)) if known else None
        batch = Batch(lp=lp, lmu=lmu, la=lmu, lref=lp, mask=mask, adv=adv, topk=topk)
        return Part(batch, grid(gid.astype(np.int64), n_groups).reshape(-1), torch.from_numpy(sid.astype(np.int64)),
                    index)


def _topk_arrays(batch: pa.RecordBatch) -> tuple:
    """Top-K slots [N, K+1]: the rollout's K ids (μ's and π's log-probs there) plus the sampled token as
    one more slot where it is not among them; `valid` marks real slots (padding otherwise)."""
    ids, k_mu, k_pi = (batch.column(c) for c in ("k_ids", "k_mu", "k_pi"))
    lens = ids.value_lengths().to_numpy(zero_copy_only=False)
    k = int(lens.max()) if len(lens) else 0
    n = len(lens)
    rows, cols = ragged(lens)

    def pad(arr, fill, dtype):
        out = np.full((n, k + 1), fill, dtype=dtype)
        out[rows, cols] = arr.flatten().to_numpy(zero_copy_only=False)
        return out

    id_grid = pad(ids, -1, np.int64)
    tok = batch.column("token_id").to_numpy(zero_copy_only=False)
    extra = ~(id_grid[:, :k] == tok[:, None]).any(1)
    mu, pi = pad(k_mu, 0.0, np.float64), pad(k_pi, 0.0, np.float64)
    valid = np.zeros((n, k + 1), dtype=bool)
    valid[rows, cols] = True
    mu[:, k] = batch.column("lmu").to_numpy(zero_copy_only=False)
    pi[:, k] = batch.column("lpi").to_numpy(zero_copy_only=False)
    valid[:, k] = extra
    return mu, pi, valid


def chunks(con, info: pd.DataFrame, *, chunk_tokens: int,
           progress: Callable[[int, int], None] | None = None) -> Iterator[Chunk]:
    """Chunks of about `chunk_tokens` finite tokens, whole sequences each, pair by pair (info's order)."""
    total, done = int(info["n_tokens"].sum()), 0
    for i, row in enumerate(info.itertuples()):
        topk = bool(row.has_topk)
        sql = (f"SELECT * FROM ({_joined(con, topk)}) WHERE finite AND rollout = $r AND scorer = $s "
               "ORDER BY run_id, seq_id, pos")
        reader = con.sql(sql, params={"r": row.rollout, "s": row.scorer}).to_arrow_reader(chunk_tokens)
        carry = None
        for batch in reader:
            tbl = pa.Table.from_batches([batch])
            tbl = tbl if carry is None else pa.concat_tables([carry, tbl])
            run, seq = tbl.column("run_id").to_numpy(), tbl.column("seq_id").to_numpy()
            last = int(np.flatnonzero((run == run[-1]) & (seq == seq[-1]))[0])  # the last sequence may go on
            if last:
                yield _chunk(i, tbl.slice(0, last), topk)
                done += last
                if progress is not None:
                    progress(done, total)
            carry = tbl.slice(last)
        if carry is not None and carry.num_rows:
            yield _chunk(i, carry, topk)
            done += carry.num_rows
            if progress is not None:
                progress(done, total)


def _chunk(pair: int, tbl: pa.Table, topk: bool) -> Chunk:
    """A Chunk of a non-empty table of whole sequences (columns of `_joined`)."""
    b = tbl.combine_chunks().to_batches()[0]

    def arr(name):
        return b.column(name).to_numpy(zero_copy_only=False)

    run, seq = arr("run_id"), arr("seq_id")
    new = np.ones(len(seq), dtype=bool)
    new[1:] = (seq[1:] != seq[:-1]) | (run[1:] != run[:-1])
    adv = b.column("adv").fill_null(np.nan).to_numpy(zero_copy_only=False).astype(np.float64)
    bucket = b.column("mu_bucket").fill_null(-1).to_numpy(zero_copy_only=False)
    return Chunk(pair, arr("lmu"), arr("lpi"), adv, arr("category"), bucket, np.flatnonzero(new),
                 _topk_arrays(b) if topk else None, b)
