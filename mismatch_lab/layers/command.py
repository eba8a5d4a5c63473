"""`mismatch-lab layers`: per-layer relative error of the `--dtype` model against the fp32 model on the
same tokens, TV / KL at the logits, and the layer where the error grows fastest.

    mismatch-lab layers                                   # embedded model, bf16 vs fp32, built-in prompts
    mismatch-lab layers --model M --prompts P.jsonl --dtype fp16 --json layers.json --figure layers.png

docs/layers.md states every definition.
"""

from __future__ import annotations

import argparse
import json
import math

from mismatch_lab.cli import json_output
from mismatch_lab.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from mismatch_lab.layers.measure import DEFAULT_CONTINUATION, DTYPES

    a = parser.add_argument
    a("--model", default="default", help="'default' (the embedded SmolLM2-135M-Instruct), an HF directory or hub id")
    a("--prompts", help="JSON Lines file of {\"id\", \"prompt\"} as collect reads (default: the doctor probe's 12 prompts)")
    a("--dtype", default="bf16", help=f"the dtype compared against fp32: {', '.join(DTYPES)} (default bf16; "
                                      "fp32 is the null check)")
    a("--engine", default="hf", help="the engine running --dtype: hf (default) or vllm (in-process engine); the "
                                     "fp32 reference is always HF")
    a("--continuation", type=int, default=DEFAULT_CONTINUATION,
      help=f"greedy tokens the fp32 model appends to each prompt (default {DEFAULT_CONTINUATION}; 0 = prompts alone)")
    a("--device", help="torch device (default cuda when available, else cpu)")
    a("--json", metavar="FILE", help="also write the rows to FILE as JSON")
    a("--figure", metavar="FILE.png", help="also draw rel_err per layer into FILE.png")


def _prompts(path: str | None) -> list[dict]:
    if path:
        from mismatch_lab.collect.prompts import read_prompts

        return read_prompts(path)
    from mismatch_lab.doctor.probe import PROBE_PROMPTS

    return [{"id": i, "prompt": p, "answer": a} for i, p, a in PROBE_PROMPTS]


def _check(args) -> None:
    from mismatch_lab.layers.measure import SIDES, check_dtype

    check_dtype(args.dtype)
    if args.engine not in SIDES:
        raise UserError(f"--engine {args.engine}: use one of {', '.join(SIDES)}")
    if args.continuation < 0:
        raise UserError(f"--continuation {args.continuation}: pass 0 or more tokens")
    if args.figure and not args.figure.endswith(".png"):
        raise UserError(f"--figure {args.figure}: pass a .png path")


def report(model: str, args, layers, acc) -> dict:
    """The JSON document: the setting, the rows (measure.rows) and the fastest-growing layer."""
    from mismatch_lab.layers import metrics
    from mismatch_lab.layers.measure import REFERENCE, rows

    out = rows(layers, acc)
    fastest = metrics.fastest_growth([r["rel_err"] for r in out])
    return {"model": model, "engine": args.engine, "dtype": args.dtype, "reference": f"hf:{REFERENCE}",
            "continuation": args.continuation, "sequences": acc.sequences, "tokens": acc.tokens,
            "rel_err": "||h_dtype - h_fp32||_F / ||h_fp32||_F over every position of every sequence",
            "fastest_growth": None if fastest is None else {"layer": out[fastest]["layer"],
                                                            "ratio": out[fastest]["growth"]},
            "rows": out}


def _fmt(x) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3e}"


def table(doc: dict) -> str:
    """One screen: embed, one line per block (attn and MLP rel_err), norm, logits; then TV, KL, fastest growth."""
    by = {r["layer"]: r for r in doc["rows"]}
    fast = (doc["fastest_growth"] or {}).get("layer")

    def mark(name: str) -> str:
        return " <" if name == fast else "  "

    head = (f"{doc['engine']}:{doc['dtype']} vs {doc['reference']}  {doc['model']}  "
            f"({doc['sequences']} sequences, {doc['tokens']} tokens)")
    lines = [head, f"{'layer':<8}{'attn':>12}  {'mlp':>12}"]
    lines.append(f"{'embed':<8}{_fmt(by['embed']['rel_err']):>12}{mark('embed')}")
    blocks = sorted({r["index"] for r in doc["rows"] if r["index"] is not None})
    for i in blocks:
        a, m = f"attn.{i}", f"mlp.{i}"
        lines.append(f"{i:<8}{_fmt(by[a]['rel_err']):>12}{mark(a)}{_fmt(by[m]['rel_err']):>12}{mark(m)}")
    for name in ("norm", "logits"):
        lines.append(f"{name:<8}{_fmt(by[name]['rel_err']):>12}{mark(name)}")
    lg = by["logits"]
    lines.append(f"logits: TV {_fmt(lg['tv_mean'])}  KL(fp32||{doc['dtype']}) {_fmt(lg['kl_mean'])} (means over tokens)")
    g = doc["fastest_growth"]
    lines.append(f"fastest growth: {g['layer']} (x{g['ratio']:.2f} over the layer before)" if g else
                 "fastest growth: none (no nonzero error to grow from)")
    return "\n".join(lines)


def figure(doc: dict, path: str) -> None:
    """rel_err per layer (log scale) in input-to-output order, one colour per kind; the fastest growth marked."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(max(6.0, 0.12 * len(doc["rows"])), 3.5), layout="constrained")
    ax = fig.add_subplot()
    for kind in ("embed", "attn", "mlp", "norm", "logits"):
        pts = [(i, r["rel_err"]) for i, r in enumerate(doc["rows"]) if r["kind"] == kind and r["rel_err"] > 0]
        if pts:
            ax.scatter(*zip(*pts), label=kind, s=14)
    ax.plot(range(len(doc["rows"])), [r["rel_err"] or math.nan for r in doc["rows"]], color="0.7", lw=0.8, zorder=0)
    if doc["fastest_growth"]:
        i = next(i for i, r in enumerate(doc["rows"]) if r["layer"] == doc["fastest_growth"]["layer"])
        ax.axvline(i, color="red", lw=0.8, ls="--", label=f"fastest growth: {doc['rows'][i]['layer']}")
    if any(r["rel_err"] > 0 for r in doc["rows"]):
        ax.set_yscale("log")
    if len(doc["rows"]) <= 24:
        ax.set_xticks(range(len(doc["rows"])), [r["layer"] for r in doc["rows"]], rotation=45, fontsize=7)
    ax.set_xlabel("layer (input to output)")
    ax.set_ylabel("rel_err vs fp32")
    ax.set_title(f"{doc['engine']}:{doc['dtype']} vs {doc['reference']}", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.savefig(path, dpi=120)


def run(args: argparse.Namespace) -> int:
    from mismatch_lab.layers.measure import measure
    from mismatch_lab.models import resolve_model

    _check(args)
    json_path = json_output(args.json, "layers.json")
    prompts = _prompts(args.prompts)
    model = resolve_model(args.model)
    layers, acc = measure(model, args.dtype, prompts, args.continuation, engine=args.engine, device=args.device)
    doc = report(model, args, layers, acc)
    print(table(doc))
    if json_path is not None:
        json_path.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {json_path}")
    if args.figure:
        figure(doc, args.figure)
        print(f"wrote {args.figure}")
    return 0
