"""A plan's handovers, the crossings that enter no block (shape 2 of NOTE [ Tensors that cross a
block boundary ] in ``remat.records``): the profile's numbers corrected
where they were measured under another saving of a handover than the plan's, for one plan
(``estimate``); the searches carry the same rule as state (``remat.plan.crossings``). Pure numbers.

Each option's numbers come from a step with every block on that option. A handover of block j
that dies in block k's forward phase (freed there when j's option does not save it, and its graph
with it when j's option keeps that: ``held_under``) is in the kept bytes of block k as the run of
k's option had it. Under the plan its death frees what j's own option has it free. So k's kept
bytes move by (held under j's option - held under k's). One that dies in the head's forward (after
the last block) moves the head's kept bytes the same way against the kept run, whose numbers the
head's are, and its forward peak only up: it may be freed after the head's peak, so it counts as
live there (on the safe side: a language model's head peaks at its logits, after the loop let it
go); the level that stays after the head's backward moves with them (its gradient bytes) until
the maker's backward, where every run has let it go (the maker's gradient bytes move back), and the
backward peaks of the maker and the blocks after it, measured over the level their own run's head
left, move back by what that run saved beyond the kept run.
Options not run are judged as the run their numbers come from: ``tiled`` and the offloads as
``keep`` and ``recompute``, but an offloaded graph is on the host. An offloaded maker's numbers
keep nothing on the device, but the model's code still holds the device tensor until it drops it
(the copy is the saved one): that counts as one more transient in the forward phase where it dies
(derived, not measured: no GPU has run it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from remat.crossing import Crossing
from remat.records import Profile

__all__ = ["OFFLOADS", "Placed", "handed_over", "handovers", "held_under", "placed", "saved_under"]

_RUN_OF = {"tiled": "keep", "offload": "keep", "recompute_offload": "recompute"}
#: The options whose block leaves a device copy of what it saves to the host.
OFFLOADS = ("offload", "recompute_offload")


def handed_over(profile: Profile, options: Sequence[str]) -> Profile:
    """``profile`` with its numbers corrected for the handovers under the plan of ``options``
    (one per block); ``profile`` itself when it has none."""
    if not handovers(profile):
        return profile
    return _corrected(profile, lambda h: held_under(h.record, options[h.maker]),
                      lambda h: int(options[h.maker] in OFFLOADS))


def handovers(profile: Profile) -> list[Crossing]:
    """The crossings of ``profile`` that enter no block: its makers hold them."""
    return [c for c in profile.crossings if not c.enters_blocks and c.made_by is not None]


@dataclass(frozen=True, kw_only=True)
class Placed:
    """A handover at block positions (forward order): its maker, the block in whose forward the
    model's code drops it (None: the head's), its bytes, and its record."""

    maker: int
    dies: int | None
    size: int
    record: Crossing


def placed(profile: Profile) -> list[Placed]:
    """The handovers of ``profile`` at block positions, in the profile's order."""
    index = {b.name: i for i, b in enumerate(profile.blocks)}
    return [Placed(maker=index[str(h.made_by)], dies=None if h.dies_after is None else index[h.dies_after],
                   size=h.size_bytes, record=h) for h in handovers(profile)]


def _corrected(profile: Profile, held: Callable[[Placed], int], copied: Callable[[Placed], int]) -> Profile:
    """``profile`` with every option's numbers moved for handovers whose makers hold them past
    their death as ``held`` says (``held_under``: the module's docstring) and offload them as ``copied`` says (their
    numbers count none of it on the device, but the model's code holds the device tensor until it
    drops it: one more transient in the forward where it dies), and no handovers left."""
    kept = [dict.fromkeys(b.options, 0) for b in profile.blocks]
    bwd = [dict.fromkeys(b.options, 0) for b in profile.blocks]
    grad, head, head_peak = [0] * len(profile.blocks), 0, 0
    peak = [0] * len(profile.blocks)
    for p in placed(profile):
        h, j, mine, extra = p.record, p.maker, held(p), p.size * copied(p)
        if p.dies is not None:
            peak[p.dies] += extra
            for o in kept[p.dies]:
                kept[p.dies][o] += mine - held_under(h, o)
            continue
        moved = mine - held_under(h, "keep")
        head += moved
        head_peak += max(0, moved) + extra  # freed in the head, maybe after its peak: live there
        grad[j] -= moved  # from the maker's backward on, every run has let it go
        for b in range(j, len(profile.blocks)):  # backwards up to the maker's: over the levels
            for o in bwd[b]:  # their runs held, which freed it in the head when they saved it not
                bwd[b][o] -= held_under(h, o) - held_under(h, "keep")
    blocks = [dataclasses.replace(b, grad_bytes=b.grad_bytes + grad[i], options={
        o: dataclasses.replace(c, kept_bytes=c.kept_bytes + kept[i][o], fwd_peak_bytes=c.fwd_peak_bytes + peak[i],
                               bwd_peak_bytes=c.bwd_peak_bytes + bwd[i][o])
        for o, c in b.options.items()}) for i, b in enumerate(profile.blocks)]
    post = dataclasses.replace(profile.post, kept_bytes=profile.post.kept_bytes + head,
                               fwd_peak_bytes=profile.post.fwd_peak_bytes + head_peak,
                               grad_bytes=profile.post.grad_bytes + head)
    crossings = [c for c in profile.crossings if c.enters_blocks]
    return dataclasses.replace(profile, blocks=blocks, post=post, crossings=crossings,
                               post_fwd_peak_held_bytes=profile.post_fwd_peak_held_bytes + head_peak)


def held_under(h: Crossing, option: str) -> int:
    """Bytes of ``h`` that its death leaves held when its maker runs ``option``, less those its
    graph frees there: its own when the option saves it, less its graph's when the option keeps
    that on the device (shape 2 of NOTE [ Tensors that cross a block boundary ] in remat.crossing)."""
    graph = h.graph_bytes if _RUN_OF.get(option, option) == "keep" and option not in OFFLOADS else 0
    return h.size_bytes * saved_under(h, option) - graph


def saved_under(h: Crossing, option: str) -> int:
    """1 when a maker on ``option`` saves its handover ``h`` for the backward (judged as the run
    its numbers come from), else 0."""
    return int(h.made_by is not None and _RUN_OF.get(option, option) in h.saved_by.get(h.made_by, ()))
