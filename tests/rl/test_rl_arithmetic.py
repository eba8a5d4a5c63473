"""Arithmetic task: seeded generator, last-number parser, 1/0 reward, prompt files."""

from __future__ import annotations

import json
import random
import re

import pytest

from mismatch_lab.rl.tasks import TASKS, arithmetic
from mismatch_lab.rl.tasks.arithmetic import (
    Problem,
    generate,
    parse_answer,
    read_jsonl,
    reward,
    write_jsonl,
)

PROMPT = re.compile(r"What is (\d+) ([+×-]) (\d+)\? Give the final answer as a number at the end\.")


@pytest.mark.parametrize("text, expected", [
    ("7 + 5 = 12.", 12.0),
    ("The answer is 12", 12.0),
    ("-3", -3.0),
    ("x = -3", -3.0),
    ("The result is \u22123.", -3.0),           # Unicode minus sign
    ("**-45**", -45.0),
    ("23 - 57 = -34", -34.0),
    ("10-3 = 7", 7.0),                          # a hyphen glued to a digit is subtraction, not a sign
    ("So 10-3", 3.0),
    ("1,234", 1234.0),
    ("It costs $1,000,000.", 1000000.0),
    ("3, 4, 5", 5.0),                           # a list, not a thousands separator
    ("2.50", 2.5),
    ("answer: 12.", 12.0),                      # sentence period, not a decimal point
    ("5 * 6 = 30\n\nFinal answer: 30", 30.0),
])
def test_parser_takes_the_last_number(text, expected):
    assert parse_answer(text) == expected


@pytest.mark.parametrize("text", ["", "no idea", "twelve", "- -", "..."])
def test_parser_returns_none_without_a_number(text):
    assert parse_answer(text) is None


@pytest.mark.parametrize("text, answer, expected", [
    ("7 + 5 = 12.", 12, 1.0),
    ("7 + 5 = 13.", 12, 0.0),
    ("12 is wrong, it is 13", 12, 0.0),         # the last number decides
    ("twelve", 12, 0.0),                        # no number -> 0
    ("", 12, 0.0),
    ("23 - 57 = -34", -34, 1.0),
    ("23 - 57 = 34", -34, 0.0),
    ("The answer is 1,000.", 1000, 1.0),
    ("12.0", 12, 1.0),
    ("12.5", 12, 0.0),
    ("= 12", "12", 1.0),                        # answers read back from JSON may be strings
])
def test_reward_is_one_exactly_when_the_last_number_equals_the_answer(text, answer, expected):
    assert reward(text, answer) == expected


def test_reward_rejects_an_answer_that_is_not_a_number():
    with pytest.raises(ValueError, match="not a number"):
        reward("12", "twelve")
    with pytest.raises(ValueError, match="finite number"):
        reward("12", None)


def test_same_seed_gives_the_same_problems_and_other_seeds_differ():
    a = generate("sanity", 50, seed=7)
    assert a == generate("sanity", 50, seed=7)
    assert a != generate("sanity", 50, seed=8)
    assert generate("hard", 20, seed=7) == generate("hard", 20, seed=7)


def test_generator_leaves_the_global_random_state_alone():
    random.seed(123)
    expected = random.random()
    random.seed(123)
    generate("hard", 10, seed=0)
    assert random.random() == expected


@pytest.mark.parametrize("split, lo, hi, ops", [("sanity", 1, 9, {"+", "×"}), ("hard", 10, 99, {"+", "-"})])
def test_problems_are_distinct_well_formed_and_answered_correctly(split, lo, hi, ops):
    problems = generate(split, 150, seed=0)
    assert len({p.id for p in problems}) == len({p.prompt for p in problems}) == 150
    seen_ops = set()
    for p in problems:
        m = PROMPT.fullmatch(p.prompt)
        assert m, p.prompt
        a, op, b = int(m[1]), m[2], int(m[3])
        assert lo <= a <= hi and lo <= b <= hi
        assert p.answer == {"+": a + b, "-": a - b, "×": a * b}[op]
        assert p.prompt.endswith(arithmetic.INSTRUCTION)
        seen_ops.add(op)
    assert seen_ops == ops


def test_the_whole_sanity_split_can_be_drawn_and_no_more():
    everything = generate("sanity", 162, seed=0)
    assert len({p.id for p in everything}) == 162
    with pytest.raises(ValueError, match="162 distinct problems"):
        generate("sanity", 163, seed=0)
    with pytest.raises(ValueError, match="unknown split"):
        generate("medium", 10, seed=0)


def test_hard_split_has_negative_answers_the_parser_must_read():
    assert any(p.answer < 0 for p in generate("hard", 100, seed=0))


def test_jsonl_round_trip_in_the_collect_prompt_format(tmp_path):
    problems = generate("hard", 12, seed=3)
    path = tmp_path / "sub" / "arith.jsonl"
    assert write_jsonl(path, problems) == 12
    lines = path.read_text(encoding="utf-8").splitlines()
    rows = [json.loads(line) for line in lines]
    assert all(set(r) == {"id", "prompt", "answer"} and isinstance(r["answer"], int) for r in rows)
    assert read_jsonl(path) == problems


def test_multiplication_sign_is_written_as_utf8_text(tmp_path):
    products = [p for p in generate("sanity", 162, seed=0) if "×" in p.prompt]
    write_jsonl(tmp_path / "mul.jsonl", products)
    assert "×" in (tmp_path / "mul.jsonl").read_text(encoding="utf-8")
    assert read_jsonl(tmp_path / "mul.jsonl") == products


def test_bad_prompt_files_and_duplicate_ids_are_rejected(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "prompt": "What is 1 + 1?"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        read_jsonl(bad)
    p = Problem(id="x", prompt="What is 1 + 1?", answer=2)
    with pytest.raises(ValueError, match="unique"):
        write_jsonl(tmp_path / "dup.jsonl", [p, p])


def test_task_registry_names_the_module():
    assert TASKS["arithmetic"] is arithmetic
