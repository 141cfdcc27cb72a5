"""When the garbage collector runs while remat measures: once per call, not once per step."""

from __future__ import annotations

import contextlib
import functools
import gc
from collections.abc import Callable, Iterator
from typing import ParamSpec, TypeVar

__all__ = ["collected_once", "collecting_once"]

# NOTE [ One full collection per call ]
# 1. A step is measured with the garbage collector off, right after a collection, so that no
#    garbage of earlier work is freed inside it and taken for the step's own (``MemoryTracer``).
# 2. A full collection walks every object the process holds, and one profile or verify collects
#    dozens of times. So ``profile``, ``verify``, ``measure_step`` and ``auto`` collect once and
#    freeze what is left (``gc.freeze``): their later collections walk only the objects made since
#    (benchmarks/profile_cost.py measures what that saves).
# 3. The freeze is undone when they return. A call inside another leaves the outer one's freeze
#    alone, and so is a process's own freeze (``gc.get_freeze_count()`` above 0 on entry).

P = ParamSpec("P")
R = TypeVar("R")


@contextlib.contextmanager
def collected_once() -> Iterator[None]:
    """One full collection, and what is left frozen until the block ends (NOTE [ One full
    collection per call ])."""
    if gc.get_freeze_count():  # an outer call's freeze, or the process's own: left alone
        yield
        return
    gc.collect()
    try:
        gc.freeze()
        yield
    finally:
        gc.unfreeze()  # every frozen object: another thread's freeze meanwhile too (a rare race)


def collecting_once(fn: Callable[P, R]) -> Callable[P, R]:
    """``fn`` run inside ``collected_once``."""

    @functools.wraps(fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        with collected_once():
            return fn(*args, **kwargs)

    return run
