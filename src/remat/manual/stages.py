"""The other candidate lists of blocks (rule 9 of NOTE [ Blocks by what runs ] in
``remat.manual.settle``): each stage that does work for the backward between its blocks whole.
``remat.measure.warmup.by_floor`` takes whichever list floors lowest."""

from __future__ import annotations

from torch import nn

from remat.manual.blocks import inside, param_count
from remat.manual.settle import Calls

__all__ = ["coarser"]


def coarser(model: nn.Module, blocks: list[tuple[str, nn.Module]], calls: Calls) -> list[list[tuple[str, nn.Module]]]:
    """The other candidate lists (rule 9): ``blocks`` with each stage that does work between its
    blocks whole, the innermost where such stages nest, and then the outermost (demucs' encoder
    layer, a convolution and a ``DConv`` stack between its own activations: the stack whole floored
    9% above the layer whole); none when no stage does."""
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
    innermost = [s for s in stages if not any(o != s and inside(o, s) for o in stages)]
    outermost = [s for s in stages if not any(o != s and inside(s, o) for o in stages)]
    modules = dict(model.named_modules())
    order = {n: i for i, n in enumerate(modules)}

    def whole(chosen: list[str]) -> list[tuple[str, nn.Module]]:
        kept = [(n, m) for n, m in blocks if not any(inside(n, s) for s in chosen)] + [(s, modules[s]) for s in chosen]
        return sorted(kept, key=lambda b: order[b[0]])

    levels = [innermost] if outermost == innermost else [innermost, outermost]
    return [whole(chosen) for chosen in levels if chosen]
