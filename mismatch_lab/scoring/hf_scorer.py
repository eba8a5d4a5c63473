"""Trainer-side scoring: the HF model re-scores exactly the rollout's token ids by teacher forcing.

For every scorer dtype (bf16 / fp16 / fp32) the same checkpoint is loaded once. A dtype may also read
`<dtype>-w<rounding>` (e.g. 'fp32-wbf16'): compute in `<dtype>` on the checkpoint's weights rounded by
`engines.weights.round_state(..., <rounding>)` (rounded from the checkpoint's own precision, then cast to
`<dtype>`), scored under the label 'hf:fp32-wbf16'. Beside 'hf:fp32' and 'hf:bf16' it splits the pair's
mismatch into weight rounding (fp32 vs fp32-wbf16) and compute precision (fp32-wbf16 vs bf16). A call scores its items in
two phases so that no two dtypes' decoders need to be on the compute device together:

1. each dtype's decoder in turn runs every micro-batch and keeps only the final hidden states of the
   positions that predict response tokens ([tokens x hidden], small next to the model);
2. per micro-batch, `logsoftmax.chunked_row_stats` turns the hidden states and each dtype's lm_head weight
   into π, entropy, top-K and the exact TV/KL against the fp32 scorer, `chunk_rows` vocabulary rows at a time.

The micro-batches and the vocabulary chunks are those of the former lockstep scorer (every dtype resident,
scoring each micro-batch together), so the numbers are the same (tests/collect/lockstep_reference.py).

Placement: `resident` keeps every dtype's model on the compute device (the fast path when they fit);
`in_turn` keeps them in host memory and moves one dtype's model to the device for its turn, the lm_heads
staying on the device; `auto` spreads a model larger than one GPU over the visible GPUs (accelerate's
`device_map="auto"`). The collector's memory plan picks it.

What π means here: log_softmax in fp32 of the logits `h @ W_lm_head.T` computed in the scorer dtype,
where h is the decoder's final hidden state (after the last norm): exactly what the model's own forward
computes, minus the [B, T, V] logits tensor. Outputs are numpy arrays (`ScoredTokens`), never Python lists.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from mismatch_lab.engines.base import TORCH_DTYPES
from mismatch_lab.scoring.positions import response_rows

REF_DTYPE = "fp32"
SCORE_BATCH_TOKENS = 8192  # padded tokens per scorer forward (the default of --score-batch-tokens)
SCORE_CHUNK_ROWS = 1024  # rows per chunk of the vocabulary projection (the default of --score-chunk-rows)
PLACEMENTS = ("resident", "in_turn", "auto")
REPLAY_SUFFIX = "-r3"
"""A scorer dtype ending in it ('fp32-r3') is the R3 replay scorer: its forward takes the rollout's expert ids in
every MoE layer (routing.hf.replayed_batch), weights recomputed by its own router."""


def is_replay(dtype: str) -> bool:
    """Whether scorer dtype `dtype` is an R3 replay scorer ('fp32-r3')."""
    return dtype.endswith(REPLAY_SUFFIX)


def split_dtype(spec: str) -> tuple[str, str]:
    """A scorer dtype -> (compute dtype, weight rounding): 'fp32' -> ('fp32', 'none'),
    'fp32-wbf16' -> ('fp32', 'bf16'). Raises ValueError for an unknown dtype or rounding."""
    from mismatch_lab.engines.weights import ROUNDERS

    compute, sep, rounding = spec.removesuffix(REPLAY_SUFFIX).partition("-w")
    if compute not in TORCH_DTYPES or (sep and rounding not in ROUNDERS):
        raise ValueError(f"unknown scorer dtype {spec!r}; use bf16, fp16 or fp32, or <dtype>-w<rounding> with a "
                         f"rounding of {', '.join(ROUNDERS)} (e.g. fp32-wbf16), each optionally followed by "
                         f"{REPLAY_SUFFIX} (R3 replay of the rollout's MoE routing)")
    return compute, rounding if sep else "none"


@dataclass
class ScoreItem:
    """One sequence to score: prompt ids, response ids, and the rollout's top-K ids per response token."""

    prompt_ids: list[int]
    response_ids: list[int]
    rollout_topk_ids: list[list[int]] | None = None
    rollout_routing: object = None  # routing.compare.Routing of every token (prompt + response): R3 replays it


@dataclass
class Ragged:
    """Per-row lists as a padded matrix: row r holds values[r, :lens[r]]; rows where `valid` is false are NULL."""

    values: np.ndarray  # [N, W]
    lens: np.ndarray  # [N] int64
    valid: np.ndarray | None = None  # [N] bool; None = every row valid

    def row(self, r: int) -> np.ndarray | None:
        return None if (self.valid is not None and not self.valid[r]) else self.values[r, : self.lens[r]]


@dataclass
class ScoredTokens:
    """One scorer's results for S sequences; their N response tokens laid end to end (numpy, float64).

    Sequence s holds rows offsets[s]:offsets[s + 1]. Non-finite values stay as they are (the writer stores
    them as NULL) and `nonfinite` flags a row whose logp, entropy, TV or KL is not finite.
    """

    offsets: np.ndarray  # [S + 1] int64
    logp: np.ndarray  # [N]
    nonfinite: np.ndarray  # [N] bool
    entropy: np.ndarray | None = None
    tv_exact_vs_ref: np.ndarray | None = None
    kl_exact_vs_ref: np.ndarray | None = None
    topk_ids: Ragged | None = None  # the scorer's top-K plus the sampled token (K or K+1 entries)
    topk_logps: Ragged | None = None
    logps_at_rollout_topk: Ragged | None = None
    logps_at_ref_topk: Ragged | None = None
    log_support: np.ndarray | None = None  # log S under this scorer's π for the rollout's sampling rule
    logp_support: np.ndarray | None = None  # log π restricted to that support, renormalised (-inf outside)
    routing: object = None  # routing.compare.Routing of the N response rows (the scorer's own forward), or None

    def rows(self, s: int) -> slice:
        return slice(int(self.offsets[s]), int(self.offsets[s + 1]))


class HFScorer:
    """Teacher-forced HF scoring at several dtypes, one dtype's decoder at a time."""

    def __init__(self, model: str, dtypes: Sequence[str], *, device: str | None = None, top_k: int = 20,
                 chunk_rows: int = SCORE_CHUNK_ROWS, batch_tokens: int = SCORE_BATCH_TOKENS,
                 models: dict | None = None, placement: str = "resident", sampling=None, routing: bool = False):
        import torch

        for d in dtypes:
            split_dtype(d)
        if placement not in PLACEMENTS:
            raise ValueError(f"unknown placement {placement!r}; use one of {', '.join(PLACEMENTS)}")
        self.dtypes = list(dict.fromkeys(dtypes))
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.placement = "resident" if (placement == "in_turn" and self.device == "cpu") else placement
        self.top_k = top_k
        self.chunk_rows = chunk_rows
        self.batch_tokens = batch_tokens
        self.sampling = sampling  # scoring.support.SamplingRule: log S per token where it restricts
        self.routing = routing  # capture each dtype's MoE routing of the response rows (ScoredTokens.routing)
        self.ref = REF_DTYPE if REF_DTYPE in self.dtypes else None
        self.models = {}
        for d in sorted(self.dtypes, key=is_replay):  # a replay scorer shares its dtype's model when there is one
            base = d.removesuffix(REPLAY_SUFFIX)
            self.models[d] = (models or {}).get(d) or self.models.get(base) or self._load(model, base)
        self.models = {d: self.models[d] for d in self.dtypes}
        for m in self.models.values():
            self._check_supported(m)
        self._refresh_heads()

    def _load(self, model: str, dtype: str):
        import torch
        from transformers import AutoModelForCausalLM

        from mismatch_lab.engines.weights import round_state

        compute, rounding = split_dtype(dtype)
        kw = {"device_map": "auto"} if self.placement == "auto" else {}
        if rounding == "none":
            m = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, TORCH_DTYPES[compute]), **kw)
        else:  # rounded from the checkpoint's own precision (loaded as fp32), then cast to the compute dtype
            m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, **kw)
            with torch.no_grad():
                m.load_state_dict(round_state(m.state_dict(), rounding))
            m = m.to(getattr(torch, TORCH_DTYPES[compute]))
        if self.placement == "resident":
            m = m.to(self.device)
        return m.eval()

    def _refresh_heads(self) -> None:
        """Each dtype's lm_head weight on the compute device (a copy only when its model lives elsewhere)."""
        self.heads = {d: m.get_output_embeddings().weight.detach().to(self.device) for d, m in self.models.items()}

    @staticmethod
    def _check_supported(m) -> None:
        head = m.get_output_embeddings()
        if getattr(head, "bias", None) is not None or getattr(m.config, "final_logit_softcapping", None):
            from mismatch_lab.errors import UserError

            raise UserError(f"{type(m).__name__}: lm_head bias / logit soft-capping is not supported by the "
                            "chunked scorer; use a model whose logits are h @ W.T")

    def names(self) -> list[str]:
        return [f"hf:{d}" for d in self.dtypes]

    def config(self) -> dict:
        return {"scorer_dtypes": self.dtypes, "ref": f"hf:{self.ref}" if self.ref else None,
                "chunk_rows": self.chunk_rows, "batch_tokens": self.batch_tokens, "device": self.device,
                "placement": self.placement,
                "support": self.sampling.config() if self._support() else None, "routing": self.routing,
                "pi_definition": "log_softmax in fp32 of (h @ W.T) computed in the scorer dtype"}

    def _support(self) -> bool:
        return self.sampling is not None and self.sampling.restricts

    def load_state_dict(self, state_dict: dict) -> None:
        """Copy new weights into every scorer copy (training: the scorers follow the trained policy; a
        '-w<rounding>' copy gets them rounded); strict: a name that does not match is an error naming it."""
        from mismatch_lab.engines.weights import round_state
        from mismatch_lab.models import load_state_dict_checked

        for d, m in self.models.items():
            load_state_dict_checked(m, round_state(state_dict, split_dtype(d)[1]))
        self._refresh_heads()

    # ------------------------------------------------------------------------------------------------
    def micro_batches(self, items: Sequence[ScoreItem]) -> list[list[int]]:
        """Item indices per forward: sorted by length, packed while padded tokens stay within batch_tokens."""
        order = sorted(range(len(items)), key=lambda i: len(items[i].prompt_ids) + len(items[i].response_ids))
        batches, batch, width = [], [], 0
        for i in order:
            L = len(items[i].prompt_ids) + len(items[i].response_ids)
            if batch and max(width, L) * (len(batch) + 1) > self.batch_tokens:
                batches.append(batch)
                batch, width = [], 0
            batch.append(i)
            width = max(width, L)
        return batches + ([batch] if batch else [])

    def score(self, items: Sequence[ScoreItem]) -> dict[str, ScoredTokens]:
        """Score every item with every dtype; returns scorer name ('hf:<dtype>') -> ScoredTokens (item order)."""
        batches = [b for b in self.micro_batches(items) if any(items[i].response_ids for i in b)]
        routed = {d: [] for d in self.dtypes}  # per dtype, the Routing of each micro-batch's response rows
        hidden = {d: self._hidden_states(d, items, batches, routed[d]) for d in self.dtypes}  # phase 1: in turn
        out = _Assembly(items, self.dtypes)
        for k, idx in enumerate(batches):  # phase 2: the vocabulary projection of each micro-batch
            out.add(idx, self._stats(items, idx, {d: hidden[d][k] for d in self.dtypes}))
        scored = out.finish()
        for d in self.dtypes:
            if routed[d]:
                scored[f"hf:{d}"].routing = out.routing(routed[d])
        for name, st in scored.items():
            check_scored(name, st)
        return scored

    def _hidden_states(self, dtype: str, items, batches, routed: list) -> list:
        """Final hidden states [n_rows, H] of the rows predicting response tokens, per micro-batch, at `dtype`;
        with routing on, each micro-batch's Routing of those rows appended to `routed`."""
        import torch

        keep = "cpu" if self.placement == "in_turn" else self.device
        out = []
        with self._turn(dtype) as model, torch.no_grad(), self._capture(model) as take:
            decoder = model.get_decoder()
            dev = decoder.get_input_embeddings().weight.device
            for idx in batches:
                ids, attn, rb, rt = _padded([items[i] for i in idx])
                with self._replay(dtype, model, [items[i] for i in idx], ids.shape[1]):
                    h = decoder(input_ids=ids.to(dev), attention_mask=attn.to(dev)).last_hidden_state
                out.append(h[rb.to(h.device), rt.to(h.device)].to(keep))
                if take is not None:  # the MoE blocks see the batch as [B * L] rows
                    routed.append(take((rb * ids.shape[1] + rt).numpy()))
        return out

    @contextmanager
    def _capture(self, model):
        """Yields routing.hf.captured_rows' `take` with routing on, else None."""
        if not self.routing:
            yield None
            return
        from mismatch_lab.routing.hf import captured_rows

        with captured_rows(model) as take:
            yield take

    @contextmanager
    def _replay(self, dtype: str, model, seqs: list[ScoreItem], width: int):
        """An R3 scorer's forward with the rollout's expert ids forced (routing.hf.replayed_batch); else as is."""
        if not is_replay(dtype):
            yield
            return
        if any(s.rollout_routing is None for s in seqs):
            raise ValueError(f"scorer hf:{dtype} replays the rollout's routing: every ScoreItem needs rollout_routing")
        from mismatch_lab.routing.hf import replayed_batch

        with replayed_batch(model, [s.rollout_routing for s in seqs], width):
            yield

    @contextmanager
    def _turn(self, dtype: str):
        """The dtype's model on the compute device for the duration of its turn (in_turn: moved there and back)."""
        m = self.models[dtype]
        if self.placement != "in_turn":
            yield m
            return
        m.to(self.device)
        try:
            yield m
        finally:
            m.to("cpu")
            _empty_cache(self.device)

    def _stats(self, items, idx: list[int], hidden: dict) -> dict:
        import torch

        from mismatch_lab.scoring.logsoftmax import chunked_row_stats

        seqs = [items[i] for i in idx]
        tgt = torch.tensor([t for s in seqs for t in s.response_ids], dtype=torch.long, device=self.device)
        gather, lens = {}, None
        if any(s.rollout_topk_ids for s in seqs):
            flat = [row for s in seqs for row in (s.rollout_topk_ids or [[t] for t in s.response_ids])]
            m = max(len(r) for r in flat)
            lens = np.array([len(r) for r in flat], dtype=np.int64)
            gather["rollout"] = torch.tensor([r + [r[0]] * (m - len(r)) for r in flat], dtype=torch.long).to(self.device)
        per_row = {"support": self._support_fn()} if self._support() else None
        with torch.no_grad():
            stats = chunked_row_stats({d: h.to(self.device) for d, h in hidden.items()}, self.heads, tgt,
                                      top_k=self.top_k, ref=self.ref, gather=gather, chunk_rows=self.chunk_rows,
                                      per_row=per_row)
        valid = np.repeat([bool(s.rollout_topk_ids) for s in seqs], [len(s.response_ids) for s in seqs])
        return {"stats": stats, "rollout_lens": lens, "rollout_valid": valid}

    def _support_fn(self):
        from mismatch_lab.scoring.support import support_stats

        def fn(lp, tgt):
            log_s, logp_s = support_stats(lp, self.sampling, tgt)
            return {"log_support": log_s, "logp_support": logp_s}

        return fn

    def close(self) -> None:
        self.models.clear()
        self.heads = {}
        _empty_cache(self.device)


def check_scored(name: str, st: ScoredTokens) -> None:
    """RuntimeError (`engines.base.INTERNAL_FIX`) when a scorer's log pi, top-K log-probs or log pi at the
    rollout's / reference's top-K ids exceeds `record.flat.LOGP_TOLERANCE`: a log-softmax cannot give it."""
    from mismatch_lab.engines.base import INTERNAL_FIX
    from mismatch_lab.record.flat import check_logprobs

    check_logprobs(st.logp, f"scorer {name}: log pi", fix=INTERNAL_FIX, error=RuntimeError)
    for what, r in (("top-K log-probs", st.topk_logps), ("log pi at the rollout's top-K ids", st.logps_at_rollout_topk),
                    ("log pi at the reference's top-K ids", st.logps_at_ref_topk)):
        if r is not None and r.values.ndim == 2:
            inside = np.arange(r.values.shape[1]) < r.lens[:, None]  # the padding is outside every row
            if r.valid is not None:
                inside &= r.valid[:, None]
            check_logprobs(r.values, f"scorer {name}: {what}", inside, fix=INTERNAL_FIX, error=RuntimeError)


def _empty_cache(device: str) -> None:
    if str(device).startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


def _padded(seqs: Sequence[ScoreItem]):
    """Right-padded input ids and mask [B, L] of prompt + response, and the (batch, position) of the rows
    predicting each response token (`positions.response_rows`)."""
    import torch

    full = [list(s.prompt_ids) + list(s.response_ids) for s in seqs]
    width = max(len(f) for f in full)
    ids = torch.zeros((len(seqs), width), dtype=torch.long)
    attn = torch.zeros_like(ids)
    for b, f in enumerate(full):
        ids[b, : len(f)] = torch.tensor(f)
        attn[b, : len(f)] = 1
    rb, rt = response_rows([len(s.prompt_ids) for s in seqs], [len(s.response_ids) for s in seqs])
    return ids, attn, torch.from_numpy(rb), torch.from_numpy(rt)


class _Assembly:
    """Per-micro-batch RowStats -> flat numpy arrays in item order, one ScoredTokens per dtype."""

    def __init__(self, items, dtypes):
        lens = np.array([len(it.response_ids) for it in items], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        self.dtypes = dtypes
        self.parts: list[tuple[np.ndarray, dict]] = []

    def add(self, idx: list[int], res: dict) -> None:
        dest = np.concatenate([np.arange(self.offsets[i], self.offsets[i + 1]) for i in idx])
        self.parts.append((dest, res))

    def routing(self, parts: list):
        """One dtype's per-micro-batch Routing of response rows (the order of `add`) -> one Routing in item order."""
        from mismatch_lab.routing.compare import Routing

        n = int(self.offsets[-1])
        dest = [d for d, _ in self.parts]
        col = lambda get: _scatter_nd(n, [(d, get(r)) for d, r in zip(dest, parts)])
        return Routing(ids=col(lambda r: r.ids), weights=col(lambda r: r.weights), margin=col(lambda r: r.margin))

    def finish(self) -> dict[str, ScoredTokens]:
        return {f"hf:{d}": self._one(d) for d in self.dtypes}

    def _one(self, d: str) -> ScoredTokens:
        n = int(self.offsets[-1])
        first = self.parts[0][1]["stats"] if self.parts else None
        col = lambda get, **kw: _scatter(n, [(dest, get(res)) for dest, res in self.parts], **kw)
        st = lambda res: res["stats"][d]
        out = ScoredTokens(offsets=self.offsets, logp=col(lambda r: st(r).logp), nonfinite=np.zeros(n, dtype=bool),
                           entropy=col(lambda r: st(r).entropy))
        if first is None:
            out.logp = np.zeros(0)
            return out
        if first[d].tv is not None:
            out.tv_exact_vs_ref = col(lambda r: st(r).tv)
            out.kl_exact_vs_ref = col(lambda r: st(r).kl)
        out.nonfinite = ~(np.isfinite(out.logp) & np.isfinite(out.entropy))
        if out.tv_exact_vs_ref is not None:
            out.nonfinite |= ~(np.isfinite(out.tv_exact_vs_ref) & np.isfinite(out.kl_exact_vs_ref))
        if first[d].topk_ids.shape[1]:
            lens = col(lambda r: st(r).topk_len, dtype=np.int64)
            out.topk_ids = Ragged(col(lambda r: st(r).topk_ids, dtype=np.int64), lens)
            out.topk_logps = Ragged(col(lambda r: st(r).topk_logps), lens)
        if "rollout" in first[d].at_ids or any("rollout" in res["stats"][d].at_ids for _, res in self.parts):
            out.logps_at_rollout_topk = self._rollout(d, n)
        for key in ("log_support", "logp_support"):
            if key in first[d].extra:
                setattr(out, key, col(lambda r, key=key: st(r).extra[key]))
        if first[d].at_ref_topk is not None:
            ref = next(k for k in self.dtypes if k == REF_DTYPE)
            out.logps_at_ref_topk = Ragged(col(lambda r: st(r).at_ref_topk),
                                           col(lambda r: r["stats"][ref].topk_len, dtype=np.int64))
        return out

    def _rollout(self, d: str, n: int) -> Ragged:
        parts, lens, valid = [], [], []
        for dest, res in self.parts:
            at = res["stats"][d].at_ids.get("rollout")
            rows = len(dest)
            parts.append((dest, at if at is not None else np.zeros((rows, 0))))
            lens.append((dest, res["rollout_lens"] if res["rollout_lens"] is not None else np.zeros(rows, np.int64)))
            valid.append((dest, res["rollout_valid"] & (at is not None)))
        return Ragged(_scatter(n, parts), _scatter(n, lens, dtype=np.int64), _scatter(n, valid, dtype=bool))


def _scatter(n: int, parts: list, dtype=np.float64) -> np.ndarray:
    """Rows of each part (tensor or array, [rows] or [rows, W]) placed at their destination rows; 2-D parts
    are padded to the widest (the padding is outside every row's length)."""
    arrays = [(dest, v.cpu().numpy() if hasattr(v, "cpu") else np.asarray(v)) for dest, v in parts]
    width = max((a.shape[1] for _, a in arrays if a.ndim == 2), default=None)
    shape = (n,) if width is None else (n, width)
    out = np.zeros(shape, dtype=dtype)
    for dest, a in arrays:
        if a.ndim == 2:
            out[dest, : a.shape[1]] = a
        else:
            out[dest] = a
    return out


def _scatter_nd(n: int, parts: list) -> np.ndarray:
    """Rows of each numpy part [rows, ...] placed at their destination rows of an [n, ...] array."""
    out = np.zeros((n, *parts[0][1].shape[1:]), dtype=parts[0][1].dtype)
    for dest, a in parts:
        out[dest] = a
    return out
