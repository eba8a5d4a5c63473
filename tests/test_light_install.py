"""The light install (`pip install mismatch-lab`, no extra): scripts/setup.sh builds it in `.venv-light` (uv venv +
the package without extras). In it, the Recorder, `import jsonl`, `analyze --json` and `doctor` run, and give the
numbers the full install gives on the same input; the heavy packages are absent; the commands needing them say which
extra to install, in one line, exit 2."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIGHT_PYTHON = ROOT / ".venv-light" / "bin" / "python"
HEAVY = ("torch", "transformers", "vllm", "streamlit", "matplotlib")

# Run by each interpreter (light and full) with an output folder: records 3 steps with the Recorder from numpy
# arrays, writes a jsonl file of the same kind of rows, imports it, analyzes both stores to JSON, runs doctor on
# both, lists the runs, exports the recorded store to Parquet and analyzes the export.
WORKLOAD = r'''
import json, subprocess, sys
from pathlib import Path
import numpy as np
from mismatch_lab.record import Recorder

out = Path(sys.argv[1])
cli = [str(Path(sys.executable).parent / "mismatch-lab")]  # the console script of that install
rng = np.random.default_rng(7)
B, T = 6, 40
with Recorder(out / "rec", "light", framework="verl", rollout_engine="vllm", trainer_dtype="bf16", rank=0) as rec:
    for step in range(3):
        mask = np.ones((B, T), bool)
        mask[:, :5] = False
        mu = np.log(rng.uniform(0.02, 1.0, (B, T)))
        pi = np.minimum(mu + rng.normal(-0.01, 0.08, (B, T)), 0.0)
        rec.log_step(step, rng.integers(0, 49152, (B, T)), mask, mu, pi, advantages=rng.normal(size=B),
                     rewards=rng.uniform(size=B))
with open(out / "run.jsonl", "w") as f:
    for step in range(2):
        for i in range(8):
            mu = np.log(rng.uniform(0.02, 1.0, 200))
            pi = np.minimum(mu + rng.normal(-0.01, 0.1, 200), 0.0)
            f.write(json.dumps({"step": step, "token_ids": rng.integers(0, 49152, 200).tolist(),
                                "logp_rollout": mu.tolist(), "logp_trainer": pi.tolist(),
                                "advantage": float(rng.normal()), "reward": 1.0, "prompt_id": f"p{i // 4}"}) + "\n")
subprocess.run(cli + ["import", "jsonl", str(out / "run.jsonl"), "--out", str(out / "imp")], check=True)
for store in ("rec", "imp"):
    subprocess.run(cli + ["analyze", "--db", str(out / store), "--json", str(out / f"{store}.json")], check=True)
    doctor = subprocess.run(cli + ["doctor", "--db", str(out / store)], check=True, capture_output=True, text=True)
    (out / f"{store}-doctor.txt").write_text(doctor.stdout)
runs = subprocess.run(cli + ["runs", "--db", str(out / "imp")], check=True, capture_output=True, text=True)
(out / "runs.txt").write_text(runs.stdout)
subprocess.run(cli + ["export", "--db", str(out / "rec"), "--out", str(out / "export")], check=True)
subprocess.run(cli + ["analyze", "--db", str(out / "export"), "--json", str(out / "export.json")], check=True)
'''


@pytest.fixture(scope="module")
def light_python() -> Path:
    if not LIGHT_PYTHON.exists():
        pytest.fail(f"{LIGHT_PYTHON.parent.parent} is missing: run `bash scripts/setup.sh`, which builds the light "
                    "install there")
    return LIGHT_PYTHON


def _run(python: Path | str, *args: str, check: bool = False, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(python), *args], check=check, capture_output=True, text=True, timeout=600, **kw)


def _numbers_match(a, b, where: str = "") -> list[str]:
    """The places where two analyze JSONs differ: structure and strings exactly, numbers to 1e-12 relative
    (float64 sums of a few thousand terms, possibly in another order under other numpy/duckdb builds)."""
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{where}: keys {sorted(a)} != {sorted(b)}"]
        return [d for k in a for d in _numbers_match(a[k], b[k], f"{where}/{k}")]
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{where}: {len(a)} rows != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _numbers_match(x, y, f"{where}[{i}]")]
    if isinstance(a, float) and isinstance(b, (int, float)) and not isinstance(b, bool):
        ok = (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-300)
        return [] if ok else [f"{where}: {a!r} != {b!r}"]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def test_the_light_install_has_none_of_the_heavy_packages(light_python):
    probe = ("import importlib.util, json; print(json.dumps({m: importlib.util.find_spec(m) is not None "
             f"for m in {HEAVY + ('numpy', 'pyarrow', 'duckdb', 'pandas', 'mismatch_lab')!r}}}))")
    found = json.loads(_run(light_python, "-c", probe, check=True).stdout)
    assert [m for m in HEAVY if found[m]] == []
    assert all(found[m] for m in ("numpy", "pyarrow", "duckdb", "pandas", "mismatch_lab"))


def test_record_import_analyze_doctor_runs_and_export_in_the_light_install_match_the_full_install(light_python, tmp_path):
    script = tmp_path / "workload.py"
    script.write_text(WORKLOAD)
    outs = {}
    for name, python in (("light", light_python), ("full", sys.executable)):
        outs[name] = tmp_path / name
        outs[name].mkdir()
        done = _run(python, str(script), str(outs[name]), cwd=tmp_path)
        assert done.returncode == 0, f"{name}: {done.stderr[-3000:]}"
    for store in ("rec", "imp", "export"):
        light, full = (json.loads((outs[n] / f"{store}.json").read_text()) for n in ("light", "full"))
        assert light["precision"] and light["steps"], f"{store}: analyze wrote no precision or steps rows"
        assert _numbers_match(light, full) == []
    for store in ("rec", "imp"):
        doctor = (outs["light"] / f"{store}-doctor.txt").read_text()
        assert "verdict" in doctor and "what to change" in doctor
    assert (outs["light"] / "runs.txt").read_text() == (outs["full"] / "runs.txt").read_text()
    # the long imported sequences make doctor advise on the product ratio; without torch the shares each
    # correction would drop (`corrections`) are said to be not measured, not guessed
    assert "token_tis not measured" in (outs["light"] / "imp-doctor.txt").read_text()
    assert "token_tis not measured" not in (outs["full"] / "imp-doctor.txt").read_text()


@pytest.mark.parametrize("command, names", [("corrections", "torch"), ("figures", "mismatch-lab[figures]"),
                                            ("app", "mismatch-lab[app]"), ("collect", "mismatch-lab[collect]"),
                                            ("train", "mismatch-lab[train]"), ("layers", "mismatch-lab[collect]"),
                                            ("routing", "vllm")])
def test_a_command_needing_more_than_the_light_install_names_what_to_install_in_one_line(light_python, command,
                                                                                           names, tmp_path):
    done = _run(light_python.parent / "mismatch-lab", command, "--help", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stdout == "" and done.stderr.count("\n") == 1
    assert done.stderr.startswith(f"mismatch-lab {command}: error: needs ") and names in done.stderr


def test_doctors_probe_in_the_light_install_names_the_collect_extra_in_one_line(light_python, tmp_path):
    done = _run(light_python.parent / "mismatch-lab", "doctor", "--model", "default", "--db", str(tmp_path / "p.duckdb"),
                cwd=tmp_path)
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert done.stderr.startswith("mismatch-lab doctor: error: the probe (--model, or no --db) needs torch")
    assert "mismatch-lab[collect]" in done.stderr and not (tmp_path / "p.duckdb").exists()


@pytest.mark.parametrize("fmt, option, names", [("slime", "--trust-pickle", "import slime needs torch"),
                                                 ("skyrl", "--trust-pickle", "import skyrl needs torch"),
                                                 ("jsonl", "--tokenizer=.", "--tokenizer needs transformers")])
def test_an_import_needing_torch_or_a_tokenizer_names_what_to_install_in_one_line(light_python, fmt, option, names,
                                                                                   tmp_path):
    done = _run(light_python.parent / "mismatch-lab", "import", fmt, str(tmp_path), "--out", str(tmp_path / "s"),
                option, cwd=tmp_path)
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert done.stderr.startswith(f"mismatch-lab import: error: {names}") and not (tmp_path / "s").exists()
