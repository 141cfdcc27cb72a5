"""The records that stages exchange: ``Profile`` (profile -> solve), ``Plan`` (solve -> apply/verify).

Frozen, keyword-only dataclasses with a docstring per field, units in names, bytes as ints, and a
JSON form that carries ``schema_version``. No torch here: the solver side must import without it.

# NOTE [ How a block's bytes are attributed ]
A chain of blocks passes one boundary tensor from block to block (the hidden state). Its bytes are
charged to the block that *consumes* it: a block that keeps, recomputes or selectively recomputes
keeps its input on the device until its backward; an offloaded block does not. So
``OptionCost.kept_bytes`` = the block's input (when kept on the device) + whatever the block's own
ops keep. The part before the blocks (embeddings) and after them (head, logits, loss) are measured
as fixed segments. The cost model (``remat.plan.costmodel``) replays these numbers through a step.
The other tensors that cross a block boundary are ``remat.crossing.Crossing`` records.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from remat.crossing import Crossing
from remat.errors import RecordError, first_names
from remat.record_json import (
    dump_record,
    load_record_text,
    parse_json,
    read_record_text,
    write_record_text,
)
from remat.vocabulary import OPTIONS, in_option_order

__all__ = [
    "BlockProfile",
    "Estimate",
    "OptionCost",
    "Plan",
    "Profile",
    "RecordError",
    "Segment",
    "load_record",
]

PROFILE_SCHEMA = 12  # 2: side inputs; 3: head options (NOTE [ The head's options ]); 4: where a replay
# stops (BlockProfile.stop_peak_bytes); 5: handovers; 6: both as crossings (NOTE [ Tensors that cross a
# block boundary ]); 7: where a replay starts (BlockProfile.unpack_bytes); 8: BlockProfile.saves, stats_bytes, Profile.layerdrop;
# 9: a skip from a block's output is a side input (NOTE [ A skip from a block's output ] in remat.measure.sides)
# 10: a side input is made by any block that returned it, enters a later block it is the first input of,
# and may be saved by the model's code (NOTE [ A side input the model's code saves ] in remat.plan.sides)
# 11: the modules that ran more than once, and those checkpointed on every call (Profile.repeated, tied, tied_ms)
# 12: the head's backward peak with the side inputs held (Profile.post_bwd_peak_held_bytes)
PLAN_SCHEMA = 3  # 2: the head's option, segments (NOTE [ A segment is one recompute frame over several calls ]);
# 3: the modules checkpointed on every call (Plan.tied; NOTE [ Every call of a tied module ] in remat.measure.tied)

# NOTE [ The head's options ]
# The part after the blocks (final norm, head, loss) is a segment with options too: ``keep`` (as
# the model computes it, ``Profile.post``) and ``chunked:<tokens>`` (the loss head one chunk of
# tokens at a time, its logits recomputed in the backward; ``remat.chunked_cross_entropy``), each
# measured as a whole ``Segment`` in ``Profile.head_options`` in the same run as the blocks. The
# solver solves the blocks once per head option under the same budget and keeps the fastest plan
# that fits (``remat.plan.head``); ``Plan.head`` says which one, ``remat.apply`` applies it.

@dataclass(frozen=True, kw_only=True)
class OptionCost:
    """What one way of keeping a block costs."""

    kept_bytes: int
    """Bytes this block holds on the device from the end of its forward until its backward starts
    (its input when kept on the device, plus what its ops keep). See NOTE [ How a block's bytes are
    attributed ]."""
    fwd_peak_bytes: int
    """Peak bytes above the live level at the start of the block's forward, during that forward."""
    bwd_peak_bytes: int
    """Peak bytes above the live level at the start of the block's backward, during that backward
    (recomputed or reloaded activations, gradient temporaries)."""
    extra_ms: float
    """Extra step time against keeping the block, milliseconds (recompute, copies not hidden)."""


@dataclass(frozen=True, kw_only=True)
class BlockProfile:
    """One block (for example one decoder layer) and the cost of each option for it."""

    name: str
    """The block's qualified module name, e.g. ``"layers.3"``."""
    kind: str
    """The block's class name, e.g. ``"Block"``; blocks of one kind are interchangeable."""
    param_bytes: int
    """Bytes of the block's own parameters (its gradients take as much); per rank when sharded."""
    grad_bytes: int
    """Net bytes that appear during the block's backward besides the freed activations: its
    parameters' gradients plus the change in the gradient flowing through it."""
    input_bytes: int
    """Bytes of the boundary tensor the block consumes."""
    fwd_ms: float
    """Forward time with the block kept, milliseconds (median over repeats)."""
    bwd_ms: float
    """Backward time with the block kept, milliseconds (median over repeats)."""
    options: dict[str, OptionCost]
    """The cost of each option that applies on this device, keyed by name from ``OPTIONS``."""
    stop_peak_bytes: int | None = None
    """Peak bytes above the live level at the start of the block's forward, with the block kept,
    up to the moment it saves its last tensor for the backward: how high a replay that stops there
    goes (a segment's replay stops inside its last block: NOTE [ A segment's costs from per-block
    numbers ] in ``remat.plan.segments``). None when not measured: the kept forward's peak then."""
    unpack_bytes: int = 0
    """Bytes above the live level at the start of the block's backward, with the block kept, when
    that backward first reads a tensor the block saved: a replay it sets off runs on top of them
    (a gradient its reshape copies before the first saved input is read)."""
    stats_bytes: int = 0
    """Bytes of the running statistics of its BatchNorms in training mode: a replay of the block
    snapshots them until it ends (NOTE [ BatchNorm in recompute ] in ``remat.manual.batchnorm``)."""
    saves: bool = True
    """Whether the block's kept forward saves a tensor for the backward. A checkpoint holds the
    block's inputs through what its forward saves (torch's recompute frame lives on the saved
    tensors), so a checkpoint of a block that saves nothing (a positional encoding's add) holds
    none of them: NOTE [ A side input's extra life ] in ``remat.plan.sides``."""


@dataclass(frozen=True, kw_only=True)
class Segment:
    """A fixed part of the step outside the blocks: the part before them or after them."""

    kept_bytes: int
    """Bytes the segment keeps from its forward until its backward; net, so negative when it
    frees more, e.g. the head's forward, where side inputs die (NOTE [ Tensors that cross a block boundary ] in
    ``remat.crossing``)."""
    fwd_peak_bytes: int
    """Peak bytes above the level at the start of its forward, during that forward."""
    bwd_peak_bytes: int
    """Peak bytes above the level at the start of its backward, during that backward."""
    grad_bytes: int
    """Net bytes that appear during its backward besides the freed activations (its gradients)."""
    fwd_ms: float
    """Forward time, milliseconds."""
    bwd_ms: float
    """Backward time, milliseconds."""


@dataclass(frozen=True, kw_only=True)
class Profile:
    """Everything the planner needs to know about one training step of one model on one device."""

    model: str
    """The model's class name."""
    fingerprint: str
    """A hash of the model's structure (module names, classes, parameter shapes and dtypes)."""
    device: str
    """The device the numbers are for: ``"cpu"``, ``"cuda"``, or an estimated spec like ``"h100"``."""
    mode: str
    """``"measured"`` (real steps on the device) or ``"estimated"`` (fake tensors and a roofline)."""
    dtype: str
    """The parameters' dtype (and autocast dtype when one was used), e.g. ``"float32"``."""
    batch_shape: list[int]
    """The shape of the batch's first tensor."""
    world_size: int = 1
    """Ranks the job runs on; with ``fsdp`` the parameter bytes here are per rank."""
    fsdp: bool = False
    """Whether parameters, gradients and optimizer state are sharded over ``world_size`` ranks."""
    layerdrop: list[str] = field(default_factory=list)
    """The blocks that layerdrop may skip in a training step (NOTE [ layerdrop ] in
    ``remat.models.hf``): the profile's steps ran them all, and since a segment's blocks must all
    run, its plans have no segments."""
    base_bytes: int
    """Bytes live when the step starts and through all of it: parameters, optimizer state, batch."""
    param_bytes: int
    """Bytes of all parameters (per rank when sharded)."""
    optimizer_bytes: int
    """Bytes of optimizer state (0 without an optimizer)."""
    batch_bytes: int
    """Bytes of the batch tensors."""
    optimizer_peak_bytes: int
    """Peak bytes above ``base_bytes`` + all gradients during the optimizer step (temporaries)."""
    device_memory_bytes: int | None = None
    """Memory of the device when known (estimated mode or CUDA), for 'does it fit' messages."""
    pre: Segment
    """The part before the blocks (embeddings)."""
    post: Segment
    """The part after the blocks (final norm, head, logits, loss)."""
    blocks: list[BlockProfile]
    """The blocks in forward order."""
    plain_peak_bytes: int
    """Peak bytes of the plain step (every block kept), measured or estimated."""
    plain_step_ms: float
    """Time of the plain step, milliseconds (median)."""
    plain_ran: bool = True
    """Whether the plain step ran while profiling; False when it was predicted over the budget, and
    then its peak and time here are predicted (NOTE [ Planning what does not fit ] in measure.lean)."""
    gather_bytes: int = 0
    """Under FSDP: bytes the cost model adds to every block's forward and backward for gathered
    parameters (the running block's and one all-gather buffer: twice the largest block's
    parameters; blocks' peaks carry the rest). See NOTE [ Per-rank memory under FSDP2 ] in
    ``remat.distributed``."""
    crossings: list[Crossing] = field(default_factory=list)
    """The tensors that cross a block boundary besides the hidden state, each once (NOTE [ Tensors
    that cross a block boundary ])."""
    post_fwd_peak_held_bytes: int = 0
    """The head's forward peak (as ``post.fwd_peak_bytes``) when the side inputs are still held by
    checkpoints, measured with every block recomputed; without side inputs, ``post``'s own."""
    post_bwd_peak_held_bytes: int = 0
    """The head's backward peak (as ``post.bwd_peak_bytes``) with the side inputs held by
    checkpoints, measured with every block recomputed (NOTE [ A side input the model's code saves ]
    in ``remat.plan.sides``); without side inputs, ``post``'s own (0: not measured)."""
    head_module: str = ""
    """The qualified name of the head module the loss goes through (the ``lm_head`` of a
    transformers causal LM, or the module passed to ``remat.chunked_cross_entropy``); "" when
    none was found, and then ``head_options`` is empty."""
    head_causal_lm: bool = False
    """Whether the head is a transformers causal LM's, whose loss remat routes through the chunked
    head (NOTE [ The chunked head of a transformers causal LM ] in ``remat.manual.lm_head``)."""
    head_options: dict[str, Segment] = field(default_factory=dict)
    """The head's options besides ``keep`` (which is ``post``), e.g. ``"chunked:1024"``, each the
    segment after the blocks as measured with that option (NOTE [ The head's options ])."""
    skip_bytes: dict[str, int] = field(default_factory=dict)
    """Per block (when not 0): bytes a segment holding it after its first block would hold that
    the segment cost model does not count: long skips it receives (a UNet's), a first input the
    forward holds for another block too, or a first input that is not the previous block's
    output (computed between blocks). The solver puts no such block after the first of a
    segment (NOTE [ Searching segments ] in ``remat.plan.segment_search``)."""
    repeated: list[str] = field(default_factory=list)
    """Modules that ran more than once in the step (weight-tied layers, ALBERT's shared layer),
    left to the model's code as it wrote them: no block, and kept (rule 6 of NOTE [ Blocks by what
    runs ] in ``remat.manual.settle``). A refusal names them (NOTE [ Every call of a tied module ]
    in ``remat.measure.tied``)."""
    tied: list[str] = field(default_factory=list)
    """Modules that run more than once which remat checkpointed on every call for this profile,
    since no plan fit the budget without (NOTE [ Every call of a tied module ] in
    ``remat.measure.tied``): its steps ran so, and its plans do (``Plan.tied``)."""
    tied_ms: float = 0.0
    """What recomputing every call of ``tied`` adds to a step, milliseconds: in ``plain_step_ms``,
    and not in the step with them kept, which plans' overheads are against (0 where not timed)."""
    schema_version: int = PROFILE_SCHEMA
    """The record's schema version; files of another version are refused."""

    @property
    def options(self) -> tuple[str, ...]:
        """The options every block offers on this device."""
        common: set[str] = set(self.blocks[0].options) if self.blocks else set(OPTIONS)
        for block in self.blocks:
            common &= set(block.options)
        return in_option_order(common)

    def to_json(self) -> str:
        return dump_record(self, "profile")

    @classmethod
    def from_json(cls, text: str) -> Profile:
        profile = load_record_text(cls, text, "profile", PROFILE_SCHEMA)
        for i, crossing in enumerate(profile.crossings):
            if (problem := crossing.misplaced([b.name for b in profile.blocks])) is not None:
                raise RecordError(f"malformed profile record: crossings[{i}]: {problem}; recreate the "
                                  "profile with `remat profile ... --out FILE`")
        return profile

    def save(self, path: str | Path) -> None:
        write_record_text(Path(path), self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        return cls.from_json(read_record_text(Path(path)))


@dataclass(frozen=True, kw_only=True)
class Estimate:
    """What the cost model predicts for one assignment of options to blocks."""

    peak_bytes: int
    """Predicted peak bytes of the whole step."""
    peak_phase: str
    """Where the peak falls, e.g. ``"backward of layers.0"`` or ``"optimizer step"``."""
    step_ms: float
    """Predicted step time, milliseconds."""
    overhead: float
    """Predicted step time over the plain step's, minus one (0.12 = 12% slower)."""


@dataclass(frozen=True, kw_only=True)
class Plan:
    """One option per block, the budget it was solved for, and what it is predicted to cost."""

    choices: dict[str, str]
    """Block name -> option name, in forward order."""
    budget_bytes: int | None
    """The budget the plan was solved for (None for methods that take no budget)."""
    method: str
    """The solver that produced it: ``optimal``, ``none``, ``all``, ``every_k``, ``sqrt``, ``greedy``."""
    estimate: Estimate
    """The cost model's prediction for this plan."""
    model: str
    """The model's class name (from the profile)."""
    fingerprint: str
    """The model structure's fingerprint (from the profile): a plan is not applied elsewhere."""
    device: str
    """The device the profile was for."""
    dtype: str
    """The profile's dtype."""
    batch_shape: list[int]
    """The profile's batch shape."""
    head: str = "keep"
    """The head's option: ``keep`` or ``chunked:<tokens>`` (NOTE [ The head's options ])."""
    head_module: str = ""
    """The head module's qualified name (from the profile), "" for none."""
    head_causal_lm: bool = False
    """Whether the head is routed through a transformers causal LM's loss (from the profile)."""
    plain_ran: bool = True
    """From the profile: False when the plain step was predicted over the budget; ``verify`` then
    does not run it either (NOTE [ Verifying without the plain step ] in ``remat.verifier``)."""
    schema_version: int = PLAN_SCHEMA
    """The record's schema version; files of another version are refused."""
    notes: list[str] = field(default_factory=list)
    """Free-form remarks from the solver (e.g. what dominates the peak)."""
    segments: list[list[str]] = field(default_factory=list)
    """Runs of consecutive blocks recomputed as one unit, ``[first, last]`` block names: only the
    first block's input is kept, the run is replayed once in the backward. Segments nest or are
    disjoint; a segment inside another is replayed from what the outer replay keeps (the
    Revolve / rotor schedules). Blocks inside a segment have the choice ``keep``: kept during
    their segment's replay. See ``remat.manual.segments`` and ``remat.plan.segments``."""

    tied: list[str] = field(default_factory=list)
    """Modules that run more than once per step (weight-tied layers) checkpointed on every call,
    from the profile (``Profile.tied``): ``apply`` checkpoints them and ``remove`` takes that off
    (NOTE [ Every call of a tied module ] in ``remat.measure.tied``)."""

    def summary(self) -> str:
        """``"3 keep, 5 recompute, 2 segments"``: how many blocks take each option (in ``OPTIONS``
        order), the segments, and the modules checkpointed on every call (``tied``)."""
        chosen = list(self.choices.values())
        names = [*OPTIONS, *sorted(set(chosen) - set(OPTIONS))]  # compiled:<budget> after
        parts = [f"{n} {o}" for o in names if (n := chosen.count(o))]
        if self.segments:
            parts.append(f"{len(self.segments)} segments")
        if self.tied:
            parts.append(f"every call of {first_names(self.tied)} checkpointed")
        return ", ".join(parts)

    def to_json(self) -> str:
        return dump_record(self, "plan")

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return load_record_text(cls, text, "plan", PLAN_SCHEMA)

    def save(self, path: str | Path) -> None:
        write_record_text(Path(path), self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        return cls.from_json(read_record_text(Path(path)))


def load_record(path: str | Path) -> Profile | Plan:
    """Read a Profile or a Plan file, whichever it holds."""
    text = read_record_text(Path(path))
    data = parse_json(text, "record")
    kind = data.get("kind") if isinstance(data, dict) else None
    if kind == "profile":
        return Profile.from_json(text)
    if kind == "plan":
        return Plan.from_json(text)
    raise RecordError(f"{path}: expected a remat 'profile' or 'plan' record, found kind={kind!r}")
