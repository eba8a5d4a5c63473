"""Verifiable arithmetic: seeded problems, a last-number answer parser and a 1/0 reward.

    from mismatch_lab.rl.tasks import arithmetic
    problems = arithmetic.generate("sanity", 64, seed=0)
    arithmetic.write_jsonl("data/arith-sanity.jsonl", problems)   # feeds `mismatch-lab collect --prompts`
    arithmetic.reward("7 + 5 = 12.", problems[0].answer)          # 1.0 or 0.0

Splits, sized from what the embedded SmolLM2-135M-Instruct solves at T=1 (docs/environment.md: vLLM bf16, chat
template, this prompt suffix, last number parsed, 32 problems x 4 samples):
    sanity  single-digit a + b and a × b, a, b in 1..9 (162 distinct problems): ~27 % / ~32 % solved,
            a small learnable set in the spirit of the DPPO/FP16 papers' sanity test
    hard    two-digit a + b and a − b, a, b in 10..99 (16,200 distinct problems): ~4 % / ~2 % solved
Problems within one call are distinct; the same seed gives the same problems in the same order. Ids are
derived from the problem itself ('sanity-mul-7-8'), so a problem keeps its id across seeds and files.

Standard library only: writing a prompt file must not import torch.
"""

from __future__ import annotations

import json
import math
import random
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

SPLITS = ("sanity", "hard")
INSTRUCTION = "Give the final answer as a number at the end."

# split -> (operand range, operations); the operations' symbols are the ones written in the prompt
_SPLITS = {
    "sanity": (range(1, 10), ("add", "mul")),
    "hard": (range(10, 100), ("add", "sub")),
}
_OPS = {
    "add": ("+", lambda a, b: a + b),
    "sub": ("-", lambda a, b: a - b),
    "mul": ("×", lambda a, b: a * b),
}


@dataclass(frozen=True)
class Problem:
    """One task instance: `prompt` is the user message (the chat template is applied by the engine)."""

    id: str
    prompt: str
    answer: int


def make_problem(split: str, op: str, a: int, b: int) -> Problem:
    """The problem `a op b` of `split`, with its canonical id and prompt."""
    symbol, fn = _OPS[op]
    return Problem(id=f"{split}-{op}-{a}-{b}", prompt=f"What is {a} {symbol} {b}? {INSTRUCTION}", answer=fn(a, b))


def generate(split: str, n: int, *, seed: int) -> list[Problem]:
    """`n` distinct problems of `split`, drawn uniformly without replacement by a seeded RNG.

    The RNG is private (random.Random(seed)): the global random state is neither used nor changed.
    """
    if split not in _SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")
    operands, ops = _SPLITS[split]
    size = len(ops) * len(operands) ** 2
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= size:
        raise ValueError(f"n={n!r}: split {split!r} has {size} distinct problems; ask for 1..{size} "
                         "(repeat problems across steps in the training loop, not here)")
    rng = random.Random(f"arithmetic/{split}/{seed}")
    out = []
    for index in rng.sample(range(size), n):
        op_index, rest = divmod(index, len(operands) ** 2)
        i, j = divmod(rest, len(operands))
        out.append(make_problem(split, ops[op_index], operands[i], operands[j]))
    return out


# A number: optional sign (ASCII hyphen or the Unicode minus U+2212) unless glued to a preceding word or digit, as
# in "10-3" (a subtraction, not -3); digits with optional thousands commas ("1,234"); optional decimals.
# A trailing sentence period ("is 12.") is not a decimal point.
_NUMBER = re.compile(r"(?:(?<![\w.])[-\u2212])?(?<!\d)(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?")


def parse_answer(text: str) -> float | None:
    """The last number in `text`, or None when there is none.

    "7 + 5 = 12."  -> 12.0     "-3" / "−3" -> -3.0     "1,234" -> 1234.0     "10-3 = 7" -> 7.0
    "2.50" -> 2.5              "no idea" -> None
    """
    if not isinstance(text, str):
        raise ValueError(f"text must be a str, not {type(text).__name__}")  # noqa: TRY004 - one error type for bad input
    matches = _NUMBER.findall(text)
    if not matches:
        return None
    token = matches[-1].replace(",", "").replace("\u2212", "-")
    return float(token)


def reward(text: str, answer: float | str) -> float:
    """1.0 when the last number of `text` equals `answer`, else 0.0 (also when `text` holds no number)."""
    if isinstance(answer, str):
        parsed_answer = parse_answer(answer)
        if parsed_answer is None:
            raise ValueError(f"answer {answer!r} is not a number")
        answer = parsed_answer
    if isinstance(answer, bool) or not isinstance(answer, (int, float)) or not math.isfinite(answer):
        raise ValueError(f"answer must be a finite number, not {answer!r}")
    got = parse_answer(text)
    # integers here; the tolerance only absorbs float round-off of decimal answers like 2.50
    return 1.0 if got is not None and math.isclose(got, answer, rel_tol=0.0, abs_tol=1e-9) else 0.0


def write_jsonl(path: str | Path, problems: Iterable[Problem]) -> int:
    """Write one `{"id", "prompt", "answer"}` object per line (the `collect --prompts` format); return the count."""
    path = Path(path)
    problems = list(problems)
    ids = [p.id for p in problems]
    if len(set(ids)) != len(ids):
        raise ValueError("problem ids must be unique within a file; generate them in one call")
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as fh:
        for p in problems:
            fh.write(json.dumps(asdict(p), ensure_ascii=False) + "\n")
    return len(problems)


def read_jsonl(path: str | Path) -> list[Problem]:
    """Problems back from a file written by `write_jsonl` (every line needs id, prompt and an integer answer)."""
    path = Path(path)
    problems = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                problems.append(Problem(id=str(row["id"]), prompt=str(row["prompt"]), answer=int(row["answer"])))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{path}:{lineno}: expected {{\"id\", \"prompt\", \"answer\"}} with an integer "
                                 f"answer ({exc})") from exc
    return problems
