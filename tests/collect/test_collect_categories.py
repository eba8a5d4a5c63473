"""The one token classifier: each documented rule on real token texts of the embedded tokenizer."""

import pytest

from mismatch_lab.categories import CATEGORIES, categorize


@pytest.mark.parametrize(
    "text, special, want",
    [
        ("<|im_end|>", True, "special"), ("", False, "special"),
        ("\n\n", False, "whitespace"), ("   ", False, "whitespace"),
        ("4", False, "number"), (" 12", False, "number"), ("3.5", False, "number"), ("1,000", False, "number"),
        (" +", False, "math"), ("=", False, "math"), (" ×", False, "math"), ("−", False, "math"),
        (" Wait", False, "connective"), ("Therefore", False, "connective"), (" so", False, "connective"),
        (" However,", False, "connective"),
        (".", False, "punctuation"), ("```", False, "punctuation"), (" #", False, "punctuation"),
        (" cat", False, "word"), ("ing", False, "word"), (" x1", False, "word"), (" Waiting", False, "word"),
    ],
)
def test_each_rule_of_the_documented_table_classifies_its_examples(text, special, want):
    assert categorize(text, is_special=special) == want


def test_every_token_of_the_real_vocabulary_gets_a_documented_category(embedded_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(embedded_model)
    special = set(tok.all_special_ids)
    seen = {categorize(tok.decode([i]), is_special=i in special) for i in range(0, tok.vocab_size, 7)}
    assert seen <= set(CATEGORIES)
    assert {"number", "math", "connective", "punctuation", "word", "whitespace"} <= seen
