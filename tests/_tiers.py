"""The suite's two tiers: ``make test`` runs every test not marked ``slow``, ``make test-slow`` the
slow ones, and CI runs both.

A test is slow when it takes more than about 20 s on a 2-core CPU, or when it is the breadth of a
check that the quick tier already makes on some of its cases (the transformers zoo's other
families, the capped process's other models): the quick tier runs each check at least once, the
slow tier runs it everywhere.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest


def breadth(values: Iterable[Any], quick: Iterable[Any]) -> list[Any]:
    """``values`` as parameters, each one not in ``quick`` marked slow."""
    quick = set(quick)
    return [v if v in quick else pytest.param(v, marks=pytest.mark.slow) for v in values]
