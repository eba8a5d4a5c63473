"""One documented token classifier, used by every run that writes `tokens.category`.

Categories (checked in this order, on the decoded token text with its leading space kept):

| category         | rule                                                                              |
|------------------|-----------------------------------------------------------------------------------|
| `special`        | the token id is a special token of the tokenizer (e.g. `<|im_end|>`), or the text is empty |
| `whitespace`     | only whitespace / format characters (spaces, newlines, tabs)                        |
| `number`         | after stripping whitespace, only digits with optional `.` or `,` inside (`4`, ` 12`, `3.5`) |
| `math`           | only math operator / relation characters: + - * / = < > ^ % × ÷ ± √ ≤ ≥ ≠ ( ) \\     |
| `connective`     | a reasoning / connective word, case-insensitive: Wait, So, Thus, Therefore, However, Next, Then, But, Since, Because, Hence, First, Finally, Also, Now, Let, Alternatively, Actually, Hmm |
| `punctuation`    | only punctuation characters (Unicode category P*, and `` ` ``, `#`, `*`, `_`, `|` ...) |
| `word`           | everything else (words and word pieces, code identifiers, mixed text)             |

An id the tokenizer does not know (no token for it: a model's embedding rows padded beyond the vocabulary)
has no text and no category (NULL: the analyses count it as uncategorised).

The DPPO paper (Figs. 6-7) reports that PPO clips numbers, math symbols and reasoning words; the
categories are chosen so that claim can be tested directly.
"""

from __future__ import annotations

import unicodedata

CATEGORIES = ("special", "whitespace", "number", "math", "connective", "punctuation", "word")

CONNECTIVES = frozenset(
    w.lower()
    for w in (
        "Wait", "So", "Thus", "Therefore", "However", "Next", "Then", "But", "Since", "Because", "Hence",
        "First", "Finally", "Also", "Now", "Let", "Alternatively", "Actually", "Hmm",
    )
)
MATH_CHARS = frozenset("+-*/=<>^%×÷±√≤≥≠()\\−·")


def _is_number(s: str) -> bool:
    if not s or not (s[0].isdigit() or (s[0] in ".," and len(s) > 1)):
        return False
    return all(c.isdigit() or c in ".," for c in s) and any(c.isdigit() for c in s)


def categorize(text: str, is_special: bool = False) -> str:
    """Category of one decoded token (see the module table). `text` keeps its leading space."""
    if is_special or text == "":
        return "special"
    stripped = text.strip()
    if stripped == "":
        return "whitespace"
    if _is_number(stripped):
        return "number"
    if all(c in MATH_CHARS for c in stripped):
        return "math"
    if stripped.lower().rstrip(",:") in CONNECTIVES:
        return "connective"
    if all(unicodedata.category(c).startswith(("P", "S")) for c in stripped):
        return "punctuation"
    return "word"


class TokenTexts:
    """Decoded text and category of token ids through a tokenizer (cached: the vocabulary is small next
    to a run). `texts(tid)` -> (text, category), (None, None) for an id past the vocabulary (module doc);
    `record.flat.TextLookup` does whole arrays."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.special = set(tokenizer.all_special_ids)
        self.cache: dict[int, tuple[str | None, str | None]] = {}

    def __call__(self, tid: int) -> tuple[str | None, str | None]:
        if tid not in self.cache:
            if not self._known(tid):
                self.cache[tid] = (None, None)
            else:
                text = self.tok.decode([tid])
                self.cache[tid] = (text, categorize(text, is_special=tid in self.special))
        return self.cache[tid]

    def _known(self, tid: int) -> bool:
        """Whether the tokenizer has a token for id `tid` (ids past its vocabulary, or in a gap of it, do not)."""
        try:
            return tid >= 0 and self.tok.convert_ids_to_tokens(int(tid)) is not None
        except (IndexError, KeyError, ValueError, OverflowError):
            return False
