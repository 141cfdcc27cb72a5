"""The phases of one training step, described once.

# NOTE [ The step's schedule ]
A step is: the forward of the part before the blocks (``pre``: embeddings), the forward of each
block in order, the forward of the part after them (``post``: head, logits, loss), the backward of
``post``, the backward of each block in reverse order, the backward of ``pre``, and the optimizer
step. Each part holds, between its forward and its backward, what it keeps; its backward frees
that and leaves its gradients. ``step_phases`` is that sequence; everything that walks a step
walks it:
- the cost model replays it with a profile's numbers (``remat.plan.costmodel._phases``), and its
  prefix-sum form (``chain_constraints``) is that replay written per block;
- the profiler reads a traced step along it: each phase starts and ends at a mark of the step
  (``remat.measure.attribution``), which gives each part's kept, peak, gradient bytes and times;
- per-rank sharding adds to each phase the parameters FSDP2 holds gathered during it
  (``remat.plan.sharding``), phase by phase as this lists them.
Pure: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, TypeAlias

if TYPE_CHECKING:
    from remat.records import OptionCost, Profile

__all__ = ["Part", "Phase", "Stage", "phase_bytes", "step_phases"]

#: Which part of the model a phase runs.
Part: TypeAlias = Literal["pre", "block", "post", "optimizer"]
#: Which stage of the step a phase belongs to.
Stage: TypeAlias = Literal["forward", "backward", "optimizer"]

_WHAT = {"pre": "the embeddings", "post": "the head"}
_WORKING = {
    ("forward", "pre"): "the embeddings' forward working memory",
    ("forward", "post"): "the head's forward working memory (logits, loss)",
    ("backward", "post"): "the head's backward working memory",
    ("backward", "pre"): "the embeddings' backward working memory",
    ("optimizer", "optimizer"): "the optimizer step's working memory",
}


@dataclass(frozen=True, kw_only=True)
class Phase:
    """One phase of the step: one part's forward or backward, or the optimizer step."""

    stage: Stage
    part: Part
    block: int | None = None
    """The block's position in forward order, for ``part == "block"``; else None."""

    def title(self, block_names: list[str]) -> str:
        """For people: ``"forward of layers.3"``, ``"backward of the head"``, ``"optimizer step"``."""
        if self.part == "optimizer":
            return "optimizer step"
        return f"{self.stage} of {self._what(block_names)}"

    def working_memory(self, block_names: list[str]) -> str:
        """What the phase's own transient bytes are, for people."""
        if self.part == "block":
            return f"block {self._what(block_names)}'s {self.stage} working memory"
        return _WORKING[(self.stage, self.part)]

    def _what(self, block_names: list[str]) -> str:
        return block_names[self.block] if self.block is not None else _WHAT[self.part]


def step_phases(n_blocks: int) -> list[Phase]:
    """The ``2 * n_blocks + 5`` phases of one step, in the order they run (NOTE [ The step's
    schedule ])."""
    blocks = range(n_blocks)
    return [
        Phase(stage="forward", part="pre"),
        *(Phase(stage="forward", part="block", block=i) for i in blocks),
        Phase(stage="forward", part="post"),
        Phase(stage="backward", part="post"),
        *(Phase(stage="backward", part="block", block=i) for i in reversed(blocks)),
        Phase(stage="backward", part="pre"),
        Phase(stage="optimizer", part="optimizer"),
    ]


def phase_bytes(profile: Profile, costs: Sequence[OptionCost], phase: Phase) -> tuple[int, int, int]:
    """(kept, transient, gradient) bytes of the part ``phase`` runs, in that phase, with ``costs``
    the chosen option of each block (the profile's numbers, as the cost model replays them)."""
    if phase.part == "optimizer":
        return 0, profile.optimizer_peak_bytes, 0
    if phase.block is not None:
        cost, gather = costs[phase.block], profile.gather_bytes
        peak = cost.fwd_peak_bytes if phase.stage == "forward" else cost.bwd_peak_bytes
        return cost.kept_bytes, peak + gather, profile.blocks[phase.block].grad_bytes
    seg = profile.pre if phase.part == "pre" else profile.post
    peak = seg.fwd_peak_bytes if phase.stage == "forward" else seg.bwd_peak_bytes
    return seg.kept_bytes, peak, seg.grad_bytes
