"""What a marked step's hooks note (``StepNotes``), and what attribution reads off its trace per
part (``PartNumbers``): the measurement state, declared here.

The profiler's hooks (``remat.measure.marked.Hooks``) fill a ``StepNotes`` as the step runs: the
order the blocks ran in, their boundary bytes, the storages that cross block boundaries (side
inputs, first inputs and outputs, what blocks return besides their output) and where each dies.
``remat.measure.sides`` and ``remat.measure.handovers`` read them into ``Crossing`` records;
``remat.measure.attribution`` reads the boundaries. A storage is noted by its number in the step,
not its key: a key is an address, another storage's once it dies (NOTE [ Storage keys are reused ]
in ``remat.measure.sides``). A death point is ``(position, ended)``: the forward position of the
last block started when the storage was freed, and whether that block had ended (NOTE [ Where a
side input dies ] in ``remat.plan.sides``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from remat.records import OptionCost

__all__ = ["DeathPoint", "PartNumbers", "Side", "StepNotes"]

DeathPoint = tuple[int, bool]


class Side(NamedTuple):
    """A storage that entered a block besides its first input."""

    key: int
    """Its storage key when it entered (an address, valid while it lives)."""
    number: int
    """Its storage number in the step (``remat.measure.sides.storage_number``)."""
    nbytes: int


@dataclass(eq=False)
class StepNotes:
    """What one marked step's hooks saw (blocks by their index in the list of blocks)."""

    order: list[int] = field(default_factory=list)
    """The blocks in the order they ran."""
    in_bytes: dict[int, int] = field(default_factory=dict)
    """[block]: bytes of its first input (0 for one that lived before the step, or needs no
    gradient: a side input then, NOTE [ A first input that needs no gradient ])."""
    out_bytes: dict[int, int] = field(default_factory=dict)
    """[block]: bytes of its first output."""
    base_keys: set[int] = field(default_factory=set)
    """Storages live before the step: parameters, buffers, optimizer state, the batch."""
    running: list[int] = field(default_factory=list)
    """The blocks whose forward has started and not ended, innermost last."""
    forward_done: bool = False
    """Whether the model's forward has returned (deaths after it are not noted)."""
    # --- the storages noted: first inputs, outputs, side inputs ---
    live_numbers: dict[int, int] = field(default_factory=dict)
    """Storage key -> the number of the noted storage that has it, while that storage lives
    (NOTE [ Storage keys are reused ] in ``remat.measure.sides``)."""
    numbered: int = 0
    """How many storages have been numbered so far."""
    deaths: dict[int, DeathPoint] = field(default_factory=dict)
    """Storage number -> where it died, when before the model's forward returned."""
    kept_past_step: set[int] = field(default_factory=set)
    """The numbers of the noted storages still alive when the step ended: the model's own state
    holds them (NOTE [ A side input the model keeps past the step ] in ``remat.measure.sides``)."""
    # --- side inputs (shape 1 of NOTE [ Tensors that cross a block boundary ] in remat.crossing) ---
    sides: dict[int, list[Side]] = field(default_factory=dict)
    """[block]: each storage entering it besides its first input."""
    skips_in: set[tuple[int, int]] = field(default_factory=set)
    """(block, storage number): a side storage that was another block's first input or output
    when it arrived (a skip)."""
    side_makers: dict[int, int] = field(default_factory=dict)
    """Storage number -> the block that returned that side storage, as any of its outputs (nGPT's
    first attention returns its values, which every later one takes: NOTE [ A skip from a block's
    output ] in ``remat.measure.sides``)."""
    # --- first inputs and outputs ---
    firsts: set[int] = field(default_factory=set)
    """The numbers of the storages that were some block's first input or output."""
    first_numbers: dict[int, int] = field(default_factory=dict)
    """[block]: the storage number of its first input."""
    output_numbers: dict[int, int] = field(default_factory=dict)
    """[block]: the storage number of its first output."""
    first_of: dict[int, int] = field(default_factory=dict)
    """[block]: the block whose output its first input is, the same storage (-1: none)."""
    output_refs: dict[int, Any] = field(default_factory=dict)
    """[block]: a weak reference to its first output, the tensor itself, and its version then."""
    handed_on: dict[int, int] = field(default_factory=dict)
    """[block]: the block whose first output, the very tensor and not changed in place since, its
    first input is (NOTE [ A first input made between blocks ] in ``remat.measure.sides``)."""
    began: set[int] = field(default_factory=set)
    """The blocks whose backward has begun."""
    # --- handovers (shape 2 of NOTE [ Tensors that cross a block boundary ] in remat.crossing) ---
    returned: dict[int, list[int]] = field(default_factory=dict)
    """[block]: bytes of each storage it returned besides its inputs."""
    returned_hidden: set[tuple[int, int]] = field(default_factory=set)
    """(block, n): returned storage n of that block is its hidden output (NOTE [ A hidden output
    the model's code holds ] in remat.measure.handovers)."""
    returned_alive: dict[int, tuple[int, int]] = field(default_factory=dict)
    """Storage key -> (block, n): returned storage n of that block, while it lives."""
    returned_deaths: dict[tuple[int, int], DeathPoint] = field(default_factory=dict)
    """(block, n) -> where it died, when in the forward."""
    returned_outlived: set[tuple[int, int]] = field(default_factory=set)
    """(block, n) that outlived the start of that block's backward: a replay's cache held it (NOTE
    [ A replay's cache holds the block's output ] in ``remat.measure.saved``)."""
    returned_used: set[tuple[int, int]] = field(default_factory=set)
    """(block, n) that entered a later block (a side input there, not a handover)."""
    input_keys: dict[int, list[int]] = field(default_factory=dict)
    """[block]: the storage keys of all its inputs."""
    saved_alive: dict[int, object | None] = field(default_factory=dict)
    """Storage key -> the token of the finalizer that notes its death, for a storage a block's
    forward saved, while it lives; None once a block returned it (it is no graph's alone: NOTE
    [ A handover's graph ] in ``remat.measure.handovers``)."""
    graph_deaths: dict[tuple[int, DeathPoint], int] = field(default_factory=dict)
    """(block, death point) -> bytes that block's forward saved and that died there, in the
    forward: a graph branch the model's code let go."""


@dataclass(kw_only=True)
class PartNumbers:
    """One part's bytes in one traced step (a block with every block on one option, or the part
    before or after them), as attribution reads them off the trace (NOTE [ From a trace to a
    Profile ] in remat.measure.attribution), which then restates some of them."""

    kept: int = 0
    """Bytes kept from the part's forward until its backward: its input charged to it, its output
    to its consumer."""
    fwd_peak: int = 0
    """Peak during its forward above the cost model's live level there."""
    bwd_peak: int = 0
    """Peak during its backward above the live level there (the run's own level, until restated)."""
    bwd_level: int = 0
    """The live level its backward peak was read against."""
    grad: int = 0
    """Net bytes its backward leaves besides the freed activations (its gradients)."""
    stop_peak: int | None = None
    """Peak of its kept forward up to its last save (``BlockProfile.stop_peak_bytes``); None when
    it saved nothing."""
    unpack: int = 0
    """Bytes its kept backward holds above its start when it first reads a saved tensor
    (``BlockProfile.unpack_bytes``)."""

    @property
    def saves(self) -> bool:
        """Whether its forward saved a tensor (``BlockProfile.saves``; the kept run marks every save)."""
        return self.stop_peak is not None

    def cost(self, extra_ms: float) -> OptionCost:
        """These numbers as an option's cost, with its extra time."""
        return OptionCost(kept_bytes=self.kept, fwd_peak_bytes=self.fwd_peak, bwd_peak_bytes=self.bwd_peak,
                          extra_ms=extra_ms)

    def minus(self, other: PartNumbers) -> PartNumbers:
        """These numbers less ``other``'s, phase by phase (a real step's over its fake twin's)."""
        stop = None if self.stop_peak is None or other.stop_peak is None else self.stop_peak - other.stop_peak
        return PartNumbers(kept=self.kept - other.kept, fwd_peak=self.fwd_peak - other.fwd_peak,
                           bwd_peak=self.bwd_peak - other.bwd_peak, bwd_level=self.bwd_level - other.bwd_level,
                           grad=self.grad - other.grad, stop_peak=stop, unpack=self.unpack - other.unpack)
