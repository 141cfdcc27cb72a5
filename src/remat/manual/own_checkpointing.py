"""A model's own gradient checkpointing, off while remat plans and applies its own.

# NOTE [ A model's own checkpointing ]
diffusers' ``enable_gradient_checkpointing()``, open_clip's and timm's ``set_grad_checkpointing()``
set a flag (``gradient_checkpointing``, ``grad_checkpointing``) on the modules that call the blocks,
which then run each block under torch's checkpoint: the block runs again in the model's own
backward, under whatever option remat gave it. remat's plan decides what is recomputed, so while it
profiles, verifies and applies a plan those flags are off (``remat.measure.step.switched_off``), and
``remat.remove`` (or the end of profiling) turns them back on. Before, profiling such a model stopped at "block ... ran twice in one
step" (diffusers' DiT, open_clip's CLIP). transformers' layers are not touched here: remat sets
their own hook (NOTE [ transformers layers ] in ``remat.manual.options``).
"""

from __future__ import annotations

import dataclasses
import logging

from torch import nn

from remat.manual.options import is_hf_layer

__all__ = ["own_checkpointing_off"]

log = logging.getLogger(__name__)

FLAGS = ("gradient_checkpointing", "grad_checkpointing")
"""The attributes by which diffusers, open_clip and timm modules checkpoint their blocks."""


_OFF = "_remat_own_checkpointing_off"
"""On a module: per flag, how many holders (an applied plan, a profile, a verify) want it off."""


@dataclasses.dataclass(frozen=True)
class Flag:
    """One module's own checkpointing flag, held off; ``remove`` lets go, and the last holder to let
    go turns it back on (an applied plan's outlives a ``verify`` that removes and applies it)."""

    module: nn.Module
    name: str

    def remove(self) -> None:
        off = self.module.__dict__.get(_OFF, {})
        off[self.name] = off.get(self.name, 1) - 1
        if off[self.name] <= 0:
            del off[self.name]
            setattr(self.module, self.name, True)
        if not off:
            self.module.__dict__.pop(_OFF, None)


def own_checkpointing_off(model: nn.Module) -> list[Flag]:
    """Turn off every flag of the model's own checkpointing that is on, or hold it off where remat
    turned it off already (NOTE above); the flags, whose ``remove`` lets go."""
    flags = []
    for module in model.modules():
        if is_hf_layer(module):
            continue
        off = module.__dict__.get(_OFF, {})
        for flag in FLAGS:
            if module.__dict__.get(flag) is True or off.get(flag):
                setattr(module, flag, False)
                off[flag] = off.get(flag, 0) + 1
                module.__dict__[_OFF] = off
                flags.append(Flag(module, flag))
    if flags:
        log.info("remat: the model checkpoints its own blocks (%s on %d modules): off while remat plans "
                 "them; remat.remove turns it back on", flags[0].name, len(flags))
    return flags
