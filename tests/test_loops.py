"""Pure-torch loops whose blocks let their input go (the first op saves nothing of it): every plan
of keep, selective and recompute measures at most its prediction, and exactly where the cost
model says it is exact (NOTE [ The last block's input ] in remat.measure.attribution, NOTE [ A
replay's cache holds the block's output ] in remat.measure.sides). Found on these loops: 14 of
27 plans of the first measured up to 240 KiB over their prediction."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from torch import nn

import remat
from remat.measure.step_memory import measure_step


class AddFirst(nn.Module):
    """Adds the side input first (nothing saved of the input), ends with a matmul (which a
    selective replay keeps in its cache)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.sin(x + s))


class LinearFirst(AddFirst):
    """Its matmul first (it saves the input), a sine last."""

    def forward(self, x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return torch.sin(self.lin(x) + s)


class Loop(nn.Module):
    def __init__(self, block: type[nn.Module]) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.randn(64, 64))
        self.layers = nn.ModuleList([block() for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.s * 2  # made in the forward: a side input of every block
        for layer in self.layers:
            x = layer(x, s)
        return x


def _loss(out: torch.Tensor, _: object) -> torch.Tensor:
    return out.square().mean()


@pytest.mark.parametrize("block", [AddFirst, LinearFirst], ids=lambda b: b.__name__)
def test_every_plan_measures_at_most_its_prediction(block: type[nn.Module]) -> None:
    torch.manual_seed(0)
    model, x = Loop(block), torch.randn(8, 64, 64)
    opt = torch.optim.AdamW(model.parameters())
    prof = remat.profile(model, x, loss_fn=_loss, optimizer=opt, repeats=1)
    names = [b.name for b in prof.blocks]
    base = remat.solve(prof, prof.plain_peak_bytes)
    off = {}
    for combo in itertools.product(["keep", "selective", "recompute"], repeat=len(names)):
        choices = dict(zip(names, combo))
        remat.apply(model, dataclasses.replace(base, choices=choices, segments=[]))
        measured = measure_step(model, x, loss_fn=_loss, optimizer=opt).peak_bytes
        remat.remove(model)
        if (d := measured - remat.estimate(prof, choices).peak_bytes) != 0:
            off["".join(o[0] for o in combo)] = d
    assert all(d < 0 for d in off.values()), off  # never under
    if block is LinearFirst:
        assert off == {}
    else:  # over only where a selective block's cached output is counted twice: before a checkpoint
        assert off and all(any(a == "s" and b in "sr" for a, b in itertools.pairwise(k)) for k in off), off
