"""Naive references for every objective and rollout correction: explicit loops over sequences and tokens,
Python floats and the math module only. Written from the rule table of docs/corrections.md, independently
of mismatch_lab.corrections."""

from __future__ import annotations

import math

TOKEN_OBJECTIVES_ANCHORED = {"grpo", "cispo", "gspo", "gmpo", "dppo_binary_tv", "dppo_binary_kl", "dppo_topk_tv",
                             "dppo_topk_kl"}


def topk_divergence(kind, anchor_lps, lps, valid):
    p = [math.exp(x) for x, v in zip(anchor_lps, valid) if v]
    q = [math.exp(x) for x, v in zip(lps, valid) if v]
    p.append(max(0.0, 1 - sum(p)))
    q.append(max(0.0, 1 - sum(q)))
    if kind == "tv":
        return 0.5 * sum(abs(a - b) for a, b in zip(p, q))
    return sum(a * math.log(a / b) for a, b in zip(p, q) if a > 0)


def divergence(name, lp, la, topk_row):
    pi, a = math.exp(lp), math.exp(la)
    if name == "dppo_binary_tv":
        return abs(pi - a)
    if name == "dppo_binary_kl":
        tail = 0.0 if a == 1 else (1 - a) * math.log((1 - a) / (1 - pi))
        return a * math.log(a / pi) + tail
    return topk_divergence(name.rsplit("_", 1)[1], *topk_row)


def _sign(a, two_sided):
    """(up, down): which direction rules apply to a token or sequence with advantage a."""
    return (True, True) if two_sided else (a > 0, a < 0)


def objective_token(name, p, lp, lmu, la, A, two_sided, topk_row, seq):
    """(keep, weight, flagged) of one token under a token-level objective, or of a sequence-level one
    given `seq` (the per-sequence values computed by `sequence_values`)."""
    r, rho = math.exp(lp - lmu), math.exp(lp - la)
    up, down = _sign(A, two_sided)
    if name == "pg_is":
        return True, r, False
    if name == "tis":
        return True, min(r, p["tis_cap"]), r > p["tis_cap"]
    if name == "cispo":
        c = min(max(rho, 1 - p["cispo_eps_low"]), 1 + p["cispo_eps_high"])
        return True, c * math.exp(la - lmu), c != rho
    if name == "grpo":
        f = (up and rho > 1 + p["eps_high"]) or (down and rho < 1 - p["eps_low"])
        return not f, r, f
    if name == "gspo":
        return not seq["gspo_drop"], seq["geo_r"], seq["gspo_drop"]
    if name == "gmpo":
        lr = lp - la
        f = (seq["up"] and lr > p["gmpo_eps"]) or (seq["down"] and lr < -p["gmpo_eps"])
        return not f, seq["gmpo_w"], f
    d = divergence(name, lp, la, topk_row)
    f = ((up and rho > 1) or (down and rho < 1)) and d > p["delta"]
    return not f, r, f


def sequence_values(name, p, lps, lmus, las, advs, two_sided):
    """Per-sequence quantities of gspo/gmpo over the sequence's response tokens."""
    n = len(lps)
    seq_a = sum(advs) / n
    up, down = _sign(seq_a, two_sided)
    log_s = sum(lp - la for lp, la in zip(lps, las)) / n
    geo_r = math.exp(sum(lp - lmu for lp, lmu in zip(lps, lmus)) / n)
    drop = (up and log_s > math.log(1 + p.get("gspo_eps_high", 0))) or (
        down and log_s < math.log(1 - p.get("gspo_eps_low", 0)))
    clipped = []
    for lp, lmu, la in zip(lps, lmus, las):
        u, dn = up, down  # GMPO clips in the sequence's advantage direction
        lr = lp - la
        e = p.get("gmpo_eps", 0)
        c = e if (u and lr > e) else (-e if (dn and lr < -e) else lr)
        clipped.append(c + (la - lmu))
    return {"gspo_drop": drop, "geo_r": geo_r, "gmpo_w": math.exp(sum(clipped) / n), "up": up, "down": down}


def correction_sequence(name, p, lrefs, lmus, advs, two_sided):
    """(per-token keep list, per-token u list) of one sequence under a rollout correction."""
    n = len(lrefs)
    log_rc = [lr - lm for lr, lm in zip(lrefs, lmus)]
    rc = [math.exp(x) for x in log_rc]
    seq_a = sum(advs) / n
    keep_all = [True] * n
    drop_all = [False] * n
    if name == "none":
        return keep_all, rc
    if name == "token_tis":
        return keep_all, [min(x, p["cap"]) for x in rc]
    if name == "seq_tis":
        return keep_all, [min(math.exp(sum(log_rc)), p["cap"])] * n
    if name == "token_mis":
        return [not x > p["cap"] for x in rc], rc
    if name == "icepop":
        return [not (x < p["low"] or x > p["high"]) for x in rc], rc
    if name == "prime_rl_mask":
        out = []
        for lr, lm, a in zip(lrefs, lmus, advs):
            up, down = _sign(a, two_sided)
            dp = math.exp(lr) - math.exp(lm)
            out.append(not ((up and dp > p["threshold"]) or (down and dp < -p["threshold"])))
        return out, rc
    if name == "seq_mis":
        drop = math.exp(sum(log_rc)) > p["cap"]
    elif name == "geo_mis":
        g = math.exp(sum(log_rc) / n)
        drop = g < p["low"] or g > p["high"]
    elif name == "k3_rs":
        drop = sum(x - lx - 1 for x, lx in zip(rc, log_rc)) / n > p["threshold"]
    elif name == "veto":
        drop = any(x < p["floor"] for x in rc)
    elif name == "opsm":
        drop = _sign(seq_a, two_sided)[1] and sum(-x for x in log_rc) / n > p["delta"]
    else:
        raise KeyError(name)
    return (drop_all if drop else keep_all), rc


def decisions(obj, corr, po, pc, lp, lmu, adv, mask, *, anchor="rollout", lold=None, topk=None, two_sided=False):
    """Per token [B][T]: (keep, weight before the is_cap, objective flagged), looping over sequences.
    lp, lmu, adv, mask, lold: nested lists [B][T]; topk: dict of nested lists or None."""
    B, T = len(lp), len(lp[0])
    keep = [[False] * T for _ in range(B)]
    weight = [[0.0] * T for _ in range(B)]
    flagged = [[False] * T for _ in range(B)]
    for b in range(B):
        ts = [t for t in range(T) if mask[b][t]]
        if not ts:
            continue
        anchored = obj in TOKEN_OBJECTIVES_ANCHORED and anchor == "old"
        la = [lold[b][t] if anchored else lmu[b][t] for t in ts]
        lref = [lold[b][t] if lold is not None else lp[b][t] for t in ts]
        lps, lmus, advs = [lp[b][t] for t in ts], [lmu[b][t] for t in ts], [adv[b][t] for t in ts]
        seq = sequence_values(obj, po, lps, lmus, la, advs, two_sided)
        c_keep, u = correction_sequence(corr, pc, lref, lmus, advs, two_sided)
        for i, t in enumerate(ts):
            row = None
            if topk is not None:
                row = (topk["anchor_logps"][b][t], topk["logps"][b][t], topk["valid"][b][t])
            k, w, f = objective_token(obj, po, lps[i], lmus[i], la[i], advs[i], two_sided, row, seq)
            rc = math.exp(lref[i] - lmus[i])
            keep[b][t] = k and c_keep[i]
            weight[b][t] = w * (1.0 if u[i] == rc else u[i] / rc)
            flagged[b][t] = f
    return keep, weight, flagged


def loss_and_grad(keep, weight, adv, mask, aggregation="token-mean", constant_norm=None, is_cap=math.inf):
    """(loss, dloss/dlogp [B][T]) of −Σ M·w·A / N with w's gradient through log π only."""
    B, T = len(mask), len(mask[0])
    lengths = [sum(1 for t in range(T) if mask[b][t]) for b in range(B)]
    nseq = sum(1 for n in lengths if n)
    grad = [[0.0] * T for _ in range(B)]
    for b in range(B):
        for t in range(T):
            if not (mask[b][t] and keep[b][t]):
                continue
            coef = -min(weight[b][t], is_cap) * adv[b][t]
            if aggregation == "seq-mean-token-mean":
                grad[b][t] = coef / (lengths[b] * nseq)
            else:
                den = {"token-mean": sum(lengths), "seq-mean-token-sum": nseq,
                       "constant": B * (constant_norm or 1)}[aggregation]
                grad[b][t] = coef / den
    return sum(map(sum, grad)), grad
