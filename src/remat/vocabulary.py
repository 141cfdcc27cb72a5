"""What a block does with its activations: the option names and their order. No torch here.

# NOTE [ One option vocabulary ]
What a block does with its activations is an *option*, spelt the same everywhere: in a Profile's
``BlockProfile.options``, a Plan's ``choices``, ``remat.apply``, the per-module
``remat.option_of``, the command line and the docs. The manual API (``remat.checkpoint_call``,
``checkpoint_module``, ``checkpoint_sequential``) takes one as ``mode=``: every option but
``keep`` (which is not checkpointing), ``recompute`` first as its default. ``tiled`` (the block
kept, its MLP run over the sequence in tiles, each recomputed: NOTE [ The tiled MLP ] in
``remat.manual.tiled``) is an option of a block's MLP, not a checkpoint of the block: it is
offered for blocks with an MLP remat can find, and is no ``mode=`` of the manual API; a plan may
still choose it for a block without one, which then runs kept (``STANDS_IN``: so a patch
embedding among transformer layers does not take ``tiled`` from all of them). Neither is
``compiled:<budget>`` (the block compiled at that activation budget: NOTE [ Compiled blocks ] in
``remat.manual.compiled``), measured only when ``remat.profile`` is asked for its budgets.
"""

from __future__ import annotations

from typing import Literal, TypeAlias, get_args

__all__ = ["CHECKPOINT_OPTIONS", "OPTIONS", "STANDS_IN", "CheckpointOption", "Option", "in_option_order"]

#: What a block does with its activations (NOTE [ One option vocabulary ]).
Option: TypeAlias = Literal["keep", "tiled", "selective", "recompute", "offload", "recompute_offload"]
#: Every option a block can take, in order from most memory to least extra time.
OPTIONS: tuple[Option, ...] = get_args(Option)
#: The options a checkpoint runs with: every option but ``keep`` and ``tiled``, the default first.
CheckpointOption: TypeAlias = Literal["recompute", "selective", "offload", "recompute_offload"]
CHECKPOINT_OPTIONS: tuple[CheckpointOption, ...] = get_args(CheckpointOption)
assert set(CHECKPOINT_OPTIONS) == set(OPTIONS) - {"keep", "tiled"}
#: An option a block does not offer -> what the block runs when a plan chooses it for it anyway.
STANDS_IN: dict[str, Option] = {"tiled": "keep"}


def in_option_order(names: set[str]) -> tuple[str, ...]:
    """``names`` in ``OPTIONS`` order, then the others (``compiled:<budget>``) by name, descending."""
    return tuple(o for o in OPTIONS if o in names) + tuple(sorted(names - set(OPTIONS), reverse=True))
