"""`mismatch-lab doctor`: a verdict on each rollout/trainer pair, what to change, and a gate for CI.

    mismatch-lab doctor --db studies/precision-sweep --gate verl --json doctor.json
    mismatch-lab doctor --model default --rollout-dtype bf16 --trainer-dtype fp32     # probe, then verdicts
    mismatch-lab doctor                                                              # probes the embedded model

Exit status: 0 when every check of the chosen gate passes (or no gate was chosen), 1 when one fails, 2 on
bad input (cli.py prints the UserError). docs/doctor.md lists every check, band and source.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from mismatch_lab.cli import json_output
from mismatch_lab.doctor.checks import CHECKS, GATES
from mismatch_lab.errors import UserError
from mismatch_lab.store.run_option import add_run_id_argument, asked_runs, open_runs

PROBE_DEFAULTS = {"engine": "vllm", "rollout_dtype": "bf16", "trainer_dtype": "fp32"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--db", metavar="PATH", help="the store (a .duckdb file, Parquet folder, study directory or shard store); "
                                   f"with --model the DuckDB file the probe writes (default {_default_db()})")
    add_run_id_argument(parser)
    a("--model", help="probe this model first ('default' = the embedded SmolLM2-135M-Instruct, an HF directory or "
                      "hub id); without --model and --db the embedded model is probed")
    a("--rollout-dtype", dest="rollout_dtype", help="probe: rollout dtype(s), comma list of bf16,fp16,fp32 (default bf16)")
    a("--trainer-dtype", dest="trainer_dtype",
      help="probe: trainer scorer dtype(s), comma list of bf16,fp16,fp32 or vllm:<dtype> (default fp32)")
    a("--engine", choices=["vllm", "hf"], help="probe: rollout engine (default vllm)")
    a("--gate", choices=GATES, help="exit 1 when a check of this gate fails: " + "; ".join(
        f"{g}: {', '.join(c.name for c in CHECKS if g in c.gates)}" for g in GATES))
    a("--json", metavar="FILE", help="also write the checks and recommendations to FILE as JSON")
    a("--no-progress", dest="no_progress", action="store_true", help="probe: no progress bar")


def _default_db() -> str:
    from mismatch_lab.doctor.probe import DEFAULT_DB

    return DEFAULT_DB


def _probe_store(args) -> str:
    """Run the probe when asked for (or when no store is given) and return the store to diagnose."""
    probe_flags = [f"--{k.replace('_', '-')}" for k in PROBE_DEFAULTS if getattr(args, k, None) is not None]
    if args.db and not args.model:
        if probe_flags:
            raise UserError(f"{', '.join(probe_flags)} configure the probe: add --model M (or drop them to judge --db)")
        return args.db
    from mismatch_lab.extras import missing_line

    if line := missing_line("collect"):  # the probe collects: a light install judges stores only
        raise UserError(f"the probe (--model, or no --db) {line}")
    from mismatch_lab.doctor import probe

    opt = {k: getattr(args, k, None) or v for k, v in PROBE_DEFAULTS.items()}
    path = probe.run_probe(args.model or "default", args.db, engine=opt["engine"],
                           rollout_dtypes=_split(opt["rollout_dtype"]), trainer_dtypes=_split(opt["trainer_dtype"]),
                           progress=not args.no_progress)
    return str(path)


def _split(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def run(args: argparse.Namespace) -> int:
    from mismatch_lab.doctor.report import diagnose, text_report, write_json

    json_path = json_output(args.json, "doctor.json")
    run_ids = asked_runs(args)
    if run_ids and (args.model or not args.db):
        raise UserError("--run-id picks runs of the store --db names; the probe (--model, or no --db) is judged "
                        "whole: drop --run-id, or pass --db without --model")
    store = _probe_store(args)
    con = open_runs(store, run_ids)  # only these runs' rows are measured
    try:
        dx = replace(diagnose(con, store, args.gate), run_ids=run_ids or None)
    finally:
        con.close()
    if args.gate and not any(args.gate in r["gates"] for r in [*dx.checks, *dx.failed]):
        raise UserError(f"--gate {args.gate}: {store} holds nothing its checks measure (no scored tokens); "
                        "pass a store with rollout and scorer log-probs, or probe one with --model")
    print(text_report(dx))
    if json_path is not None:
        write_json(dx, json_path)
        print(f"wrote {json_path}")
    return dx.exit_code
