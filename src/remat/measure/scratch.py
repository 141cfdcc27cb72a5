"""What no tensor holds: the scratch space kernels allocate, measured by real steps against their
fake twins (NOTE [ What no tensor holds ]), and added to a profile's bytes from fake tensors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from remat.measure.notes import PartNumbers
from remat.records import Profile

__all__ = ["Scratch"]


@dataclasses.dataclass(kw_only=True)
class Scratch:
    """What the real steps peaked above their fake twins, phase by phase (NOTE [ What no tensor
    holds ]), as far as they have run."""

    blocks: dict[str, dict[str, PartNumbers]] = dataclasses.field(default_factory=dict)
    """Option -> block name -> by phase (``fwd_peak``, ``bwd_peak``, ``stop_peak``; ``kept``)."""
    parts: dict[str, int] = dataclasses.field(default_factory=dict)
    """The same for the parts around the blocks, with the head as written (``pre_fwd``,
    ``pre_bwd``, ``post_fwd``, ``post_bwd``, ``optimizer``)."""
    heads: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    """The same for each chunked head option."""
    kinds: list[list[str]] = dataclasses.field(default_factory=list)
    """Blocks of one kind and size: what one of them measured under an option stands for all."""
    margin: int = 0
    """The most any block's phase of the first step peaked above its fake twin: what a block's
    option no step ran is charged (the parts around the blocks are measured in every step)."""

    def add(self, option: str, names: Sequence[str], numbers: Sequence[PartNumbers]) -> None:
        self.blocks.setdefault(option, {}).update(zip(names, numbers))

    def onto(self, prof: Profile) -> Profile:
        """``prof`` (bytes from fake tensors) with this scratch added to every phase peak.

        # NOTE [ What no tensor holds ]
        A kernel's scratch space is no tensor, so fake tensors never see it: on the CPU a
        convolution's backward allocates its own buffers (the pure-torch UNet's down.0: 271,296
        bytes in every option's backward, 9,088 in its forward), and the plans of a lean profile
        measured up to 24 KiB over their prediction. The real steps measure it: each runs once
        more under the memory tracer and once on fake tensors, and the difference, phase by phase,
        is what no tensor holds. The first is the floor plan's step (the lowest predicted peak,
        so the most room for what it cannot predict); then every block recomputed, each option of
        a kind in the step that ran it, each head option in its own. A phase's scratch is the same
        whatever runs around it, so it is added to the profile's peaks (and a block of one kind
        and size stands for the others). A block's option no step ran is charged the largest scratch of any block's phase in the first step (over, never
        under: a kept up.4 of that UNet is 267,072 bytes in its backward, its recompute 0; a
        transformer's blocks have none, and lose nothing; on the CPU, where the fake steps run
        again with each kernel's scratch from the first step, NOTE [ What each kernel allocates ]
        in remat.measure.tracer, the margin is what remains beyond it), and every real step after the first
        runs only when this corrected profile predicts it within the budget. A block inside one
        of the floor plan's segments ran its forward without gradients, then its replay and its
        backward: those phases stand for its kept ones, and for its recomputed ones (whose
        backward runs the replay's kernels too); charged the margin instead, transformers'
        SegFormer was refused at its floor, 9% below the smallest the lean profile named. What the head keeps
        is corrected too: a storage dies when its last Python reference goes, which is not always
        the same op on fake and real tensors, and the last block's input (NOTE [ The last block's
        input ]) died in the head of a real UNet step and not of its fake twin (48 KiB); so is what
        the head's backward leaves (its gradient bytes: a diffusers AutoencoderTiny's MSE head left
        384 KiB more on real tensors, and a plan measured that much over its prediction).
        """
        unmeasured = PartNumbers(fwd_peak=self.margin, bwd_peak=self.margin, stop_peak=self.margin)
        own = {"offload": "keep", "recompute_offload": "recompute"}

        def peaks(cost: Any, d: PartNumbers) -> Any:
            return dataclasses.replace(cost, kept_bytes=cost.kept_bytes + d.kept,
                                       fwd_peak_bytes=cost.fwd_peak_bytes + d.fwd_peak,
                                       bwd_peak_bytes=cost.bwd_peak_bytes + d.bwd_peak)

        kind = {name: k for k in self.kinds for name in k}

        def measured(option: str, name: str) -> PartNumbers:
            seen = self.blocks.get(own.get(option, option), {})
            return next((seen[n] for n in [name, *kind.get(name, [])] if n in seen), unmeasured)

        blocks = []
        for b in prof.blocks:
            found = {o: measured(o, b.name) for o in b.options}
            stop = b.stop_peak_bytes
            if stop is not None:  # a replay runs the forward's kernels up to the last save
                stop += max(found["keep"].stop_peak or 0, found["keep"].fwd_peak)
            blocks.append(dataclasses.replace(
                b, options={o: peaks(c, found[o]) for o, c in b.options.items()}, stop_peak_bytes=stop))
        parts = self.parts or dict.fromkeys(("pre_fwd", "pre_bwd", "post_fwd", "post_bwd", "optimizer"), self.margin)

        def part(seg: Any, d: dict[str, int], name: str) -> Any:
            return dataclasses.replace(
                peaks(seg, PartNumbers(kept=d.get(f"{name}_kept", 0), fwd_peak=d[f"{name}_fwd"], bwd_peak=d[f"{name}_bwd"])),
                grad_bytes=seg.grad_bytes + d.get(f"{name}_grad", 0))

        return dataclasses.replace(
            prof, blocks=blocks, pre=part(prof.pre, parts, "pre"), post=part(prof.post, parts, "post"),
            post_fwd_peak_held_bytes=prof.post_fwd_peak_held_bytes + parts["post_fwd"],
            post_bwd_peak_held_bytes=prof.post_bwd_peak_held_bytes + parts["post_bwd"],
            optimizer_peak_bytes=prof.optimizer_peak_bytes + parts["optimizer"],
            head_options={h: part(seg, self.heads.get(h, parts), "post") for h, seg in prof.head_options.items()},
        )  # fmt: skip
