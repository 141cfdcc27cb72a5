"""The other candidate list of blocks (rule 9 of NOTE [ Blocks by what runs ] in
``remat.manual.settle``): each stage that does work for the backward between its blocks whole.
``remat.measure.warmup.by_floor`` takes whichever list floors lower."""

from __future__ import annotations

from torch import nn

from remat.manual.blocks import inside, param_count
from remat.manual.settle import Calls

__all__ = ["coarser"]


def coarser(model: nn.Module, blocks: list[tuple[str, nn.Module]], calls: Calls) -> list[tuple[str, nn.Module]] | None:
    """``blocks`` with each stage that does work between its blocks whole (rule 9), or None when
    no stage does."""
    names = [n for n, _ in blocks]
    stages: list[str] = []
    for stage, module in model.named_modules():
        if (not stage or calls.count.get(stage) != 1 or not calls.replays(stage)
                or param_count(module) == 0 or any(inside(stage, n) for n in names)):
            continue
        inner = [n for n in names if inside(n, stage)]
        if len(inner) < 2 or 2 * len(inner) > len(names):
            continue
        own = [w for w in calls.work if inside(w, stage) and not any(inside(w, n) for n in inner)]
        if any(calls.start[stage] < at <= calls.end[stage] for w in own for at in calls.work[w]):
            stages.append(stage)
    stages = [s for s in stages if not any(o != s and inside(o, s) for o in stages)]  # the innermost
    if not stages:
        return None
    modules = dict(model.named_modules())
    kept = [(n, m) for n, m in blocks if not any(inside(n, s) for s in stages)] + [(s, modules[s]) for s in stages]
    order = {n: i for i, n in enumerate(modules)}
    return sorted(kept, key=lambda b: order[b[0]])
