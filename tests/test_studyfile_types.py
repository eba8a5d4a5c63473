"""Every study.toml value is checked for its type once, when the file is read: a wrong type is one line
naming the file, the key, the value's type, the expected type and an example, exit 2, before any model
loads (no torch import) and before anything is written."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
import tomllib

from mismatch_lab.cli import main
from mismatch_lab.collect.config import STUDY_SCHEMA, CollectConfig
from mismatch_lab.studyfile import TOML_TYPES, check_types, study_schema, toml_value

REPO = Path(__file__).resolve().parents[1]
WRONG = (3, 2.5, "text", True, ["bf16", 4], ["bf16"], {"a": 1})
"""Values of each TOML type (an array of strings and a mixed one); each field is tried with those its Kind refuses."""
CASES = [(key, value) for key, f in STUDY_SCHEMA.items() for value in WRONG if not f.kind.accepts(value)]


def _study(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "my-study" / "study.toml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(body)
    return path


def _collect(path: Path, capsys) -> tuple[int, list[str]]:
    code = main(["collect", "--study", str(path), "--no-progress"])
    return code, capsys.readouterr().err.strip().splitlines()


def test_the_schema_holds_every_collect_field_and_each_field_is_refused_some_wrong_type():
    assert set(STUDY_SCHEMA) == {f.name for f in fields(CollectConfig)}
    assert {key for key, _ in CASES} == set(STUDY_SCHEMA)


@pytest.mark.parametrize("key, value", CASES, ids=[f"{k}={type(v).__name__}:{v!r}" for k, v in CASES])
def test_a_value_of_the_wrong_type_is_one_line_naming_file_key_types_and_an_example(tmp_path, capsys, key, value):
    path = _study(tmp_path, f"[collect]\n{key} = {toml_value(value) or '{a = 1}'}\n")
    assert tomllib.loads(path.read_text())["collect"][key] == value
    code, err = _collect(path, capsys)
    assert code == 2 and len(err) == 1, err
    f = STUDY_SCHEMA[key]
    assert f"{path}: [collect] {key} = " in err[0]
    assert f"is {TOML_TYPES[type(value)]}; expected {f.kind.expected}, e.g. {key} = {f.example}" in err[0], err[0]
    assert sorted(p.name for p in path.parent.iterdir()) == ["study.toml"]  # no store was created


@pytest.mark.parametrize("key", sorted(STUDY_SCHEMA))
def test_the_example_the_error_gives_is_a_value_of_the_right_type(tmp_path, key):
    f = STUDY_SCHEMA[key]
    value = tomllib.loads(f"{key} = {f.example}\n")[key]
    check_types(tmp_path / "study.toml", "", {key: value}, STUDY_SCHEMA)  # raises nothing


@pytest.mark.parametrize("body, needle", [
    ("[collect]\nscorer_dtypes = 32\n",
     ('[collect] scorer_dtypes = 32 is an integer; expected an array of strings (or one comma-separated string), '
      'e.g. scorer_dtypes = ["bf16", "fp16", "fp32"]')),
    ("model = 3\n", 'model = 3 is an integer; expected a string, e.g. model = "default"'),
    ('[collect]\nprompts = ["a.jsonl", "b.jsonl"]\n',
     ('[collect] prompts = ["a.jsonl", "b.jsonl"] is an array; expected a path (a string), '
      'e.g. prompts = "data/default_prompts.jsonl"')),
])
def test_the_reported_cases_exit_2_in_a_fresh_process_without_importing_torch(tmp_path, body, needle):
    path = _study(tmp_path, body)
    code = ("import sys\nfrom mismatch_lab.cli import main\nrc = main(['collect', '--study', sys.argv[1]])\n"
            "print('heavy:', sorted(m for m in ('torch', 'transformers', 'vllm') if m in sys.modules))\nsys.exit(rc)")
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120,
                         check=False)
    assert out.returncode == 2, out
    assert out.stderr.strip().splitlines() == [f"mismatch-lab collect: error: {path}: {needle}"], out.stderr
    assert "heavy: []" in out.stdout


def test_a_comma_separated_string_and_a_toml_integer_for_a_float_are_still_taken(tmp_path):
    import argparse

    from mismatch_lab.collect import add_arguments, load_config

    path = _study(tmp_path, '[collect]\nscorer_dtypes = "bf16,fp32"\ngpu_memory_utilization = 0\ntop_k = 5\n')
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cfg = load_config(parser.parse_args(["--study", str(path)]))
    assert (cfg.scorer_dtypes, cfg.gpu_memory_utilization, cfg.top_k) == (["bf16", "fp32"], 0.0, 5)


@pytest.mark.parametrize("study", sorted(p.parent.name for p in (REPO / "studies").glob("*/study.toml")))
def test_every_stored_study_file_passes_the_type_check(study):
    from mismatch_lab.rl.loop import TrainConfig

    data = tomllib.loads((REPO / "studies" / study / "study.toml").read_text())
    for table, cls, path_keys in (("collect", CollectConfig, ("prompts", "db")), ("train", TrainConfig, ("db", "out"))):
        if table in data:
            check_types(Path(study), f"[{table}] ", data[table], study_schema(cls, path_keys))


def test_train_reads_its_table_with_the_same_check(tmp_path, capsys):
    path = _study(tmp_path, '[train]\nsteps = "ten"\n')
    code = main(["train", "--study", str(path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert f'{path}: [train] steps = "ten" is a string; expected an integer, e.g. steps = 8' in err[0], err[0]
