"""What recording costs: the Recorder's write rate, and its overhead inside a real TRL GRPO step.

    .venv/bin/python benchmarks/bench_record.py                       # both parts, embedded model for (2)
    .venv/bin/python benchmarks/bench_record.py --skip trl            # (1) only, a few seconds
    .venv/bin/python benchmarks/bench_record.py --skip write --model /tmp/tiny --steps 6

(1) write: `Recorder.log_step` from CPU torch tensors into a temporary shard store, per batch shape
    B x T: float32 log-probs, int64 ids, a loss mask whose rows keep a random 50-100 % of T (the stored
    tokens), advantages and rewards [B]. Without and with the tokenizer (token_text / category columns,
    what `attach` writes by default). Median seconds of `--repeat` calls after one warm-up call, reported
    as stored tokens per second; and the median time of reading `Recorder.last_metrics` after the last
    call (the live metrics of its stored tokens, record/live.py), computed at each read.
(2) trl: `trl.GRPOTrainer` runs of `--steps` optimizer steps with the same seed and config, colocated
    vLLM on CPU (`use_cpu_weight_sync`), alternately without and with `attach` (`--rounds` pairs); median
    wall time of an optimizer step over each run's steps 2.. (step 1 pays warm-up), measured by a
    TrainerCallback from on_step_begin to on_step_end (generation, scoring, recording, backward and
    optimizer step), printed as a ratio; and the time spent inside `log_step` itself, the direct cost,
    which the step-to-step noise of a shared machine cannot hide; likewise the time inside attach's live
    metrics (`_Hook._log_live`: `last_metrics`, handing them to TRL's log, the band checks) per step, as a
    share of the same run's median recorded step. The runs follow each other in one
    process: one vLLM engine at a time. The load average is printed at the start and the end.
Prints the CPU model and whether it has AVX-512 BF16 / AMX (bf16 matmuls are emulated without them).
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

SHAPES = ((64, 1024), (256, 256), (16, 4096))
PROMPTS = ["What is 7 + 7?", "Name a prime number larger than 20.", "What is the capital of France?",
           "Write one sentence about the sea.", "What is 12 times 3?", "Give a synonym of quick.",
           "How many legs has a spider?", "What colour is the sky at noon?"]


def cpu_info() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown CPU"
    name = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), "unknown")
    words = set(text.split())
    flags = {f: f in words for f in ("avx512f", "avx512_bf16", "amx_bf16", "amx_tile")}
    return f"{name}; {os.cpu_count()} cores; " + ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in flags.items())


# -- (1) write rate ---------------------------------------------------------------------------------------
def bench_write(shapes, repeat: int, tokenizer) -> list[dict]:
    import torch

    from mismatch_lab.record import Recorder

    rows = []
    for with_tok in (False, True):
        for B, T in shapes:
            g = torch.Generator().manual_seed(0)
            ids = torch.randint(0, 49152, (B, T), generator=g)
            keep = torch.randint(T // 2, T + 1, (B, 1), generator=g)
            mask = torch.arange(T).unsqueeze(0) < keep
            mu = -torch.rand(B, T, generator=g) * 5
            pi = (mu + torch.randn(B, T, generator=g) * 0.01).clamp(max=0.0)  # a log-prob is <= 0
            adv, rew = torch.randn(B, generator=g), torch.rand(B, generator=g)
            root = Path(tempfile.mkdtemp(prefix="bench-record-"))
            try:
                rec = Recorder(root / "store", "bench", framework="bench", rollout_engine="vllm", trainer_dtype="fp32",
                               tokenizer=tokenizer if with_tok else None)
                rec.log_step(0, ids, mask, mu, pi, adv, rew)  # warm-up (imports, first file of the store)
                times = []
                for step in range(1, repeat + 1):
                    t0 = time.perf_counter()
                    n = rec.log_step(step, ids, mask, mu, pi, adv, rew)
                    times.append(time.perf_counter() - t0)
                live = []
                for _ in range(repeat):
                    t0 = time.perf_counter()
                    rec.last_metrics  # noqa: B018 - computed when read: that is what is timed
                    live.append(time.perf_counter() - t0)
                rec.close()
                size = sum(f.stat().st_size for f in (root / "store").rglob("*.parquet")) / (repeat + 1)
            finally:
                shutil.rmtree(root, ignore_errors=True)
            med = statistics.median(times)
            rows.append({"B": B, "T": T, "tokenizer": with_tok, "tokens": n, "seconds": med, "tok_s": n / med,
                         "bytes_per_token": size / n, "live_s": statistics.median(live)})
    return rows


def print_write(rows) -> None:
    print("\n(1) Recorder.log_step from CPU tensors (median of the timed calls)")
    print(f"{'B x T':>10s} {'texts':>5s} {'stored tokens':>13s} {'s/call':>8s} {'tokens/s':>11s} {'bytes/token':>11s} "
          f"{'last_metrics ms':>15s}")
    for r in rows:
        print(f"{r['B']:>4d} x {r['T']:<4d} {'yes' if r['tokenizer'] else 'no':>5s} {r['tokens']:13,d} "
              f"{r['seconds']:8.3f} {r['tok_s']:11,.0f} {r['bytes_per_token']:11.1f} {r['live_s'] * 1000:15.2f}")


# -- (2) overhead in a TRL step ---------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_trl(model: str, out: Path, *, steps: int, completions: int, max_tokens: int, record: bool, seed: int) -> dict:
    from datasets import Dataset
    from transformers import TrainerCallback
    from transformers.trainer_callback import PrinterCallback, ProgressCallback
    from trl import GRPOConfig, GRPOTrainer

    from mismatch_lab.integrations.trl import attach, use_cpu_weight_sync

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.t0, self.times = None, []

        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.times.append(time.perf_counter() - self.t0)

    def reward_len(completions, **kw):
        return [len(c) / 10.0 for c in completions]

    args = GRPOConfig(output_dir=str(out / ("with" if record else "without")), use_vllm=True, vllm_mode="colocate",
                      use_cpu=True, bf16=False, vllm_gpu_memory_utilization=0.35, vllm_max_model_length=512,
                      per_device_train_batch_size=completions, num_generations=completions,
                      max_completion_length=max_tokens, max_steps=steps, logging_steps=1, save_strategy="no",
                      report_to=[], seed=seed)  # fmt: skip
    dataset = Dataset.from_list([{"prompt": p} for p in PROMPTS])
    trainer = GRPOTrainer(model=model, reward_funcs=reward_len, args=args, train_dataset=dataset)
    for quiet in (PrinterCallback, ProgressCallback):  # no per-step log dicts or progress bars in the report
        trainer.remove_callback(quiet)
    use_cpu_weight_sync(trainer)
    timer = StepTimer()
    trainer.add_callback(timer)
    log_seconds, tokens, live_seconds = [], [], []
    if record:
        rec = attach(trainer, out / "store")
        hook = trainer._mismatch_lab_hook
        log_live = hook._log_live

        def timed_log_live(step):
            t0 = time.perf_counter()
            log_live(step)
            live_seconds.append(time.perf_counter() - t0)

        hook._log_live = timed_log_live
        log_step = rec.log_step

        def timed_log_step(*a, **kw):
            t0 = time.perf_counter()
            n = log_step(*a, **kw)
            log_seconds.append(time.perf_counter() - t0)
            tokens.append(n)
            return n

        rec.log_step = timed_log_step
    trainer.train()
    result = {"step_times": timer.times, "log_seconds": log_seconds, "tokens": tokens, "live_seconds": live_seconds,
              "trl_step_time": [h["step_time"] for h in trainer.state.log_history if "step_time" in h]}
    del trainer.vllm_generation.llm
    trainer = None
    gc.collect()
    return result


def bench_trl(model: str, *, steps: int, completions: int, max_tokens: int, seed: int, rounds: int) -> dict:
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port())}
    for k, v in env.items():
        os.environ.setdefault(k, v)
    out = Path(tempfile.mkdtemp(prefix="bench-record-trl-"))
    try:
        runs = {False: [], True: []}
        for _ in range(rounds):  # alternate, so a slow drift of the machine's load hits both sides
            for flag in (False, True):
                runs[flag].append(_run_trl(model, out / f"r{len(runs[flag])}", steps=steps, completions=completions,
                                           max_tokens=max_tokens, record=flag, seed=seed))
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return runs


def print_trl(runs: dict, model: str, completions: int, max_tokens: int) -> None:
    def pooled(flag, key):  # every run's values after its first step (step 1 pays warm-up)
        return [x for run in runs[flag] for x in (run[key][1:] if len(run[key]) > 1 else run[key])]

    without, with_ = statistics.median(pooled(False, "step_times")), statistics.median(pooled(True, "step_times"))
    logs = pooled(True, "log_seconds")
    log_med = statistics.median(logs) if logs else float("nan")
    toks = [n for run in runs[True] for n in run["tokens"]]
    print(f"\n(2) TRL GRPO step, {model}, {completions} completions x <= {max_tokens} tokens per step, "
          f"{len(runs[True])} run(s) per side of {len(runs[False][0]['step_times'])} steps (median over steps 2..)")
    for flag, name in ((False, "without attach"), (True, "with attach")):
        times = " | ".join(", ".join(f"{t:.2f}" for t in run["step_times"]) for run in runs[flag])
        print(f"  {name:15s} median {statistics.median(pooled(flag, 'step_times')):.3f} s   steps: {times}")
    print(f"  ratio with / without: {with_ / without:.3f}")
    quiet = min(pooled(False, "step_times"))
    print(f"  inside log_step: median {log_med * 1000:.1f} ms per step for {statistics.mean(toks):.0f} tokens "
          f"= {log_med / with_ * 100:.2f} % of the median recorded step, {log_med / quiet * 100:.2f} % of the "
          f"fastest step without attach ({quiet:.2f} s, the least disturbed by other jobs)")
    live = pooled(True, "live_seconds")
    if live:
        live_med = statistics.median(live)
        print(f"  inside the live metrics (last_metrics, TRL's log, band checks): median {live_med * 1000:.2f} ms per "
              f"step = {live_med / with_ * 100:.2g} % of the median recorded step of the same run(s)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--skip", nargs="*", default=[], choices=["write", "trl"])
    ap.add_argument("--repeat", type=int, default=5, help="timed log_step calls per shape")
    ap.add_argument("--model", default="default", help="'default' (embedded SmolLM2-135M-Instruct) or a model directory")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--completions", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=1, help="pairs of runs (without, with), alternating")
    a = ap.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from mismatch_lab.models import resolve_model

    model = resolve_model(a.model)
    print(f"bench_record  {date.today().isoformat()}  CPU: {cpu_info()}")
    print(f"load average at the start (1/5/15 min): {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    if "write" not in a.skip:
        from transformers import AutoTokenizer

        print_write(bench_write(SHAPES, a.repeat, AutoTokenizer.from_pretrained(model)))
    if "trl" not in a.skip:
        runs = bench_trl(model, steps=a.steps, completions=a.completions, max_tokens=a.max_tokens, seed=a.seed,
                         rounds=a.rounds)
        print_trl(runs, Path(model).name, a.completions, a.max_tokens)
    print(f"\nload average at the end (1/5/15 min): {' '.join(f'{x:.1f}' for x in os.getloadavg())} "
          f"on {os.cpu_count()} cores (other users' jobs included)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
