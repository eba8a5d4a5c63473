"""Shared fixtures: models and engines are loaded once per test session.

- `tiny_model`: a 2-layer random Llama with the embedded model's real tokenizer (built in seconds);
  real vLLM and real HF load it fast, so most engine tests use it.
- `embedded_model`: the real SmolLM2-135M-Instruct, for the tests where the numbers matter.
- `vllm_tiny_fp32`: one in-process vLLM CPU engine on the tiny model, shared by every test that needs it.
- `signalled_cli`: starts `mismatch-lab ARGS` in a child process that interrupts itself at a fixed chunk.

The two xdist workers take whole test files (`--dist loadfile`: a module's fixtures are built once), slowest
files first (tests/durations.txt), so that both finish together.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine: 3 s start, no spawn
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# TRL builds its colocated vLLM engine without enforce_eager; on CPU vLLM then compiles the model with inductor
# (~25 s per engine with an empty compile cache). This flag, vLLM's own for its CPU CI, keeps the dynamo trace but
# runs it with the eager backend, as our engines run (enforce_eager). It changes only how fast the engine starts.
os.environ.setdefault("VLLM_CPU_CI_ENV", "1")
# One intra-op thread per xdist worker (and per child process it starts): with two workers on two cores, two
# threads each made every torch op wait on a thread the other worker had descheduled (an HF forward and
# backward pair measured 2.3x slower than with one thread each). Set before torch is first imported; torch
# then keeps it (an in-process vLLM engine turns torch.set_num_threads into a no-op).
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ.setdefault("OMP_NUM_THREADS", "1")

DURATIONS = Path(__file__).with_name("durations.txt")  # seconds per test file, from scripts/test_durations.py


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Slowest files first (a stable sort: the order within a file is kept; files not listed go last, in
    collection order), so that the last file a worker takes is a short one."""
    if not DURATIONS.exists():
        return
    seconds = {}
    for line in DURATIONS.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            value, path = line.split(maxsplit=1)
            seconds[path] = float(value)
    items.sort(key=lambda item: -seconds.get(item.nodeid.split("::")[0], 0.0))


@pytest.fixture(scope="session")
def embedded_model() -> str:
    from mismatch_lab.models import resolve_model

    return resolve_model("default")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, embedded_model) -> str:
    from mismatch_lab.models import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("models") / "tiny", base=embedded_model))


@pytest.fixture(scope="session")
def vllm_tiny_fp32(tiny_model):
    from mismatch_lab.engines.base import make_engine

    engine = make_engine("vllm", tiny_model, "fp32", seed=0, max_model_len=512, kv_cache_bytes=256 << 20)
    yield engine
    engine.close()


# The CLI in a child process that signals itself at a fixed point, so an interruption lands mid-run on a
# machine of any speed (polling the store from outside raced the tiny model, which can finish every chunk
# between two polls). The signals are real: SIGINT goes through the command's own handler; SIGKILL ends
# the process inside an open transaction that already holds the next chunk's sequences.
_SELF_SIGNAL = """
import os, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)  # a shell's background job inherits SIGINT ignored
from mismatch_lab.store.writer import StoreWriter
sig, after, argv = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
original, written = StoreWriter.write_chunk, []

def write_chunk(self, run_id, chunk, **tables):
    if sig == signal.SIGKILL and len(written) == after:
        self.con.execute("BEGIN TRANSACTION")
        self.con.register("_partial", tables["sequences"])
        cols = ", ".join(tables["sequences"].column_names)
        self.con.execute(f"INSERT INTO sequences ({cols}) SELECT {cols} FROM _partial")
        os.kill(os.getpid(), signal.SIGKILL)
    original(self, run_id, chunk, **tables)
    written.append(chunk)
    if sig == signal.SIGINT and len(written) == after:
        os.kill(os.getpid(), signal.SIGINT)

StoreWriter.write_chunk = write_chunk
from mismatch_lab.cli import main
sys.exit(main(argv))
"""


@pytest.fixture
def signalled_cli():
    """`start(args, sig, after_chunks)`: SIGINT right after the process commits `after_chunks` chunks
    (training steps for `train`), or SIGKILL while it writes the next one. Returns the Popen, stdout and
    stderr merged."""

    def start(args: list[str], sig: int, after_chunks: int) -> subprocess.Popen:
        assert sig in (signal.SIGINT, signal.SIGKILL)
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", PYTHONUNBUFFERED="1")
        return subprocess.Popen([sys.executable, "-c", _SELF_SIGNAL, str(int(sig)), str(after_chunks), *args],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)

    return start
