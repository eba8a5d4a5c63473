"""Fixtures of the doctor tests; the store builders live in doctor_stores.py."""

from __future__ import annotations

import pytest
from doctor_stores import Pair, planted


@pytest.fixture
def store(tmp_path):
    """`store(*pairs, **kw)`: a fresh planted store in the test's folder."""
    counter = iter(range(1000))

    def make(*pairs: Pair, **kw) -> str:
        return planted(tmp_path / f"s{next(counter)}.duckdb", *pairs, **kw)

    return make
