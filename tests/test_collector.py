"""NOTE [ One full collection per call ] (remat.measure.collector): one collection, then a freeze
that is undone on return; an outer call's freeze and the process's own are left alone; and the
bytes a profile measures are the same whether remat froze the heap or collected in full."""

from __future__ import annotations

import contextlib
import gc
import weakref

import pytest
import torch
from torch import nn

import remat
from remat.measure import collector
from remat.measure.collector import collected_once


class _Cycle:
    def __init__(self, t: torch.Tensor) -> None:
        self.t, self.me = t, self


def test_garbage_before_is_collected_and_the_freeze_undone() -> None:
    assert gc.get_freeze_count() == 0
    t = torch.zeros(1000)
    seen = weakref.ref(t)
    _Cycle(t)  # cyclic garbage holding the tensor
    del t
    with collected_once():
        assert seen() is None  # collected before, not inside, what runs here
        assert gc.get_freeze_count() > 0
        with collected_once():  # inside another: leaves the outer freeze alone
            pass
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0


def test_the_processes_own_freeze_is_left_alone() -> None:
    gc.collect()
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with collected_once():
            assert gc.get_freeze_count() == frozen
        assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()


def _numbers(p: remat.Profile) -> list[tuple[str, str, int, int, int]]:
    return [(b.name, o, c.kept_bytes, c.fwd_peak_bytes, c.bwd_peak_bytes) for b in p.blocks for o, c in b.options.items()]


def test_a_profile_measures_the_same_bytes_frozen_or_not(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32)) for _ in range(3)])
    batch = torch.randn(16, 32)
    mine = remat.profile(model, batch, loss_fn=lambda out, b: out.square().mean(), repeats=1)
    assert gc.get_freeze_count() == 0
    monkeypatch.setattr(collector, "collected_once", contextlib.nullcontext)  # every collection in full
    full = remat.profile(model, batch, loss_fn=lambda out, b: out.square().mean(), repeats=1)
    assert _numbers(mine) == _numbers(full) and mine.plain_peak_bytes == full.plain_peak_bytes
