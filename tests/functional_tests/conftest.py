"""Fixtures of the functional tests."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from golden_values import run_case


@pytest.fixture(scope="session")
def runs() -> Callable[[str], list[dict]]:
    """case name -> the metrics of that golden case's run (``golden_values.run_case``), run once
    per session whichever modules read it: treat the lists as read-only."""
    cache: dict[str, list[dict]] = {}

    def get(name: str) -> list[dict]:
        if name not in cache:
            cache[name] = run_case(name)
        return cache[name]

    return get
