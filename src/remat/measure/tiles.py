"""The ``tiled`` option of each block, measured (NOTE [ The tiled MLP ] in ``remat.manual.tiled``).

For the blocks whose MLP ``find_mlp`` finds, one traced step with those blocks tiled and the
others kept gives each tiled block's kept, forward-peak and backward-peak bytes, read along the
step's schedule as every option's are (``attribute``); steps timed in turns with every block kept
give its extra time: the tiled step's forward and backward of the block minus the kept step's.
Blocks of one kind and size share the median (they do the same work), and an extra time under a
twentieth of the block's forward is taken as that twentieth: a tiled MLP runs its forward twice,
never for free, and timing noise must not make it look so.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import defaultdict
from collections.abc import Sequence

from torch import nn

from remat.manual.tiled import find_mlp
from remat.measure.attribution import attribute
from remat.measure.runner import StepRunner, every_block
from remat.records import OptionCost, Profile

__all__ = ["add_tiles", "measure_tiles"]


def measure_tiles(
    named: Sequence[tuple[str, nn.Module]], runner: StepRunner, keep_times: dict[str, float] | None = None
) -> dict[str, OptionCost]:
    """Block name -> its ``tiled`` cost, for the blocks that offer it (the module's docstring).
    ``keep_times``: in estimated mode, the kept step's roofline times (phase -> ms), which the
    profile already has."""
    offered = [find_mlp(m) is not None for _, m in named]
    if not any(offered):
        return {}
    options = ["tiled" if o else "keep" for o in offered]
    with every_block(named, options):
        trace, hooks, tiled = runner.traced()
    numbers = attribute(trace, hooks, len(named))[2]
    if runner.estimated:  # the roofline's times: the traced step's, and the kept step's
        assert keep_times is not None, "estimated mode passes the kept step's times"
        keep = keep_times
    else:
        keep, tiled = runner.times([lambda: every_block(named, "keep"), lambda: every_block(named, options)])
    extra = {}
    for i, (_, module) in enumerate(named):
        if offered[i]:
            fwd = keep[f"fwd{i}"]
            measured = tiled[f"fwd{i}"] + tiled[f"bwd{i}"] - fwd - keep[f"bwd{i}"]
            extra[i] = (max(measured, fwd / 20), type(module).__name__, sum(p.numel() for p in module.parameters()))
    groups: dict[tuple[str, int], list[float]] = defaultdict(list)
    for ms, kind, size in extra.values():
        groups[(kind, size)].append(ms)
    out = {}
    for i, (_, kind, size) in extra.items():
        n = numbers[i]
        out[named[i][0]] = n.cost(statistics.median(groups[(kind, size)]))
    return out


def add_tiles(profile: Profile, costs: dict[str, OptionCost]) -> Profile:
    """``profile`` with each block's ``tiled`` option from ``costs``."""
    if not costs:
        return profile
    blocks = [
        dataclasses.replace(b, options={**b.options, "tiled": costs[b.name]}) if b.name in costs else b
        for b in profile.blocks
    ]
    return dataclasses.replace(profile, blocks=blocks)
