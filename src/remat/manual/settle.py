"""The blocks found by containers (``remat.manual.blocks``), settled by the module calls of one
forward with gradients (NOTE [ Blocks by what runs ]): which run, once, with a backward, and
what of the trunk no stack covers. ``remat.measure.warmup`` runs that forward, and
``remat.measure.calls_seen`` watches it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from torch import nn

from remat.errors import ProfileError
from remat.manual.blocks import CONTAINERS, inside, param_count
from remat.manual.shapes import bare_layer, keeps_a_stack, one_weight, wraps_a_stack

__all__ = ["RANDOM_SKIPS", "Calls", "by_calls"]

RANDOM_SKIPS = ("step: turn off layerdrop, stochastic depth or other random layer skips while remat profiles (a "
                "plan made with every layer holds when layers are skipped after), or name blocks that run in every "
                "step with blocks=")
"""What to do about blocks that a step skips at random (rule 2)."""

# NOTE [ Blocks by what runs ]
# Containers say what repeats; only a forward says what runs. ``by_calls`` takes the module calls of
# one forward with gradients (``Calls``) and settles the blocks:
# 1. A found block that ran, holds parameters and returned what a gradient reaches in the backward
#    is a block; one whose output no gradient reaches (DETR's frozen backbone, T2T-ViT's unfolding
#    of the image, encodec's encoder where the model quantizes its output to integer codes) has no
#    backward to replay in, nor has one whose backward reads nothing its forward saved (diffusers'
#    ``VectorQuantizer`` where the loss leaves out its commitment loss: all it saves is in that
#    loss's graph, which dies with the model's output; as a block, every plan that recomputed it
#    measured 5,184 B over its prediction, ``Calls.idle``), nor one whose forward changes its
#    buffers in place (vector-quantize-pytorch's EMA codebook: a replay updated it twice and
#    quantized with the updated codebook, and the encoder's gradients differed, ``Calls.mutates``;
#    a named one is refused; a write in the first step alone fills a cache, which a replay
#    leaves as it is: rotary-embedding-torch's table of frequencies, filled by the first layer
#    that runs, so that the first layer of a bs-roformer was no block and its stack was refused as
#    one that skips layers), and one without parameters (T2T-ViT's reshapes and ``Identity``, in a
#    ``Sequential`` where they repeat) is the model's code. One that never runs but whose modules
#    do (a ``ModuleList`` of ``ModuleList``s that the model iterates in its own loop, ``for attn,
#    ff in self.layers``) gives way to its outermost modules that run, hold parameters and return
#    what a gradient reaches; those without parameters (a residual wrapper) are the model's code
#    between blocks.
# 2. A found stack of which nothing runs is left out (a T5's decoder in an encoder-only step); one
#    of which some blocks run and others do not skips layers at random, and is refused.
# 3. What no block covers is the trunk's too: from the root, through the blocks' ancestors and
#    containers that are never called, every module that runs once, holds parameters, has modules
#    of its own, and takes what requires grad, or a tensor of the batch (a stem: UNETR's
#    ``encoder1``, DynUNet's ``input_block``, a ViT's patch embedding), and returns what a gradient
#    reaches is a block (a UNet's down path of different classes, its lone middle block). Where
#    that gives no block at all, one fed what the model made without a gradient is one too:
#    encodec's decoder fed its codebook's entries (a buffer), with its encoder cut off by rule 1,
#    was none, and remat refused the model. Not otherwise: a diffusion UNet's time embedding of
#    its timesteps' sinusoids, as a block, raised diffusers' UNet2D floor by 1.8%. Left to
#    the code before the blocks, a stem was kept at every budget: UNETR floored at 24.16 MiB where
#    torch's checkpoint on its stem, encoders and decoders reaches 16.96 (16.32 now), DynUNet at
#    4.81 for 3.70 (3.69). What runs after the last block the stacks and the rules before gave is
#    the head's (its own options), unless it holds as many parameters as the smallest of those
#    blocks: a UNet's up path after a down path that stacks gave (MONAI's), a codec's decoder
#    after its encoder; left to the head, MONAI's UNet floored at 2.564 MiB where torch's
#    checkpoint on its units and up modules reaches 2.052, encodec's at 6.017 for 4.104. A
#    classifier, a pooler, a final norm hold fewer. A bare layer (an embedding, a norm) holds
#    little; a frozen embedding has no backward to replay in; an embedding of token ids takes no
#    floating-point tensor.
# 4. Such a module with two or more such modules inside gives way to them (a UNet stage's resnets,
#    attentions and downsampler, the granularity diffusers' own checkpointing takes): a block's
#    backward holds its whole forward again, so the floor falls with the largest block. Not where
#    each of them is one layer, bare or wrapped (MONAI's residual units: single convolutions with
#    norms and activations between, which split off would be kept at every budget). Each of them
#    is whole, not split in turn: a diffusers SVD UNet's spatio-temporal resnets and attentions,
#    split down to their attentions and feed-forwards, floored 4% above torch's checkpoint on them
#    whole, the code between kept at every budget. But one that is the module's only one is its
#    body, and gives way to its own: diffusers' UNet3D's ``transformer_in`` (one transformer layer)
#    whole floored 17% higher. A list among them is no part; its items are (a codec's decoder).
#    Whole, MONAI UNETR's decoders take an encoder's output besides their hidden input (NOTE [ A
#    skip from a block's output ] in remat.measure.sides).
# 5. A block inside another by object is left to it: a module held under two names (reformer's
#    reversible and plain paths share their layers; enformer-pytorch's stem, tower and transformer,
#    attributes and again the items of the ``Sequential`` its forward runs) is counted under its
#    first name only, in a stack found under its second name too. That name may be in a path
#    that never runs as a whole (a shared layer's name under the reversible blocks, while the
#    plain blocks that hold it run). A module that holds blocks under other
#    names (DynUNet's recursive ``skip_layers``, fed the batch) is no block itself; one that shares
#    a part with blocks is judged as any other (video-diffusion-pytorch's lone temporal attentions,
#    which share one rotary embedding with the stacks', floored 24% higher left out).
# 6. A module that runs more than once (a weight-tied layer the model calls in every iteration of its
#    loop: perceiver-pytorch's ``weight_tie_layers``, ALBERT's shared layer) is no block, nor is
#    anything in it: remat's cost model replays each block once. Its calls are the model's code
#    between blocks, and the profiler says so (``repeated``, in a stack or in the trunk). Where no
#    plan fits a budget with it kept, the profile is made again with every call of it checkpointed
#    (NOTE [ Every call of a tied module ] in remat.measure.tied); a ``remat.checkpoint_module`` of
#    the user's on it is left in place (NOTE [ A module's own checkpointing ] in remat.manual.options).
#    neuraloperator's FNO calls one module per layer with the layer's index (``fno_blocks(x, i)``),
#    which runs once each of its per-layer lists: taken as blocks, the tied step replayed them and
#    failed, and the floor was 45% above torch's checkpoint on every call of that module. Only
#    where nothing else is a block are they blocks, and the module that holds them is not tied.
# 7. A found block that keeps layers of its own in a stack (a UNet stage of several resnets and
#    attentions, a Swin stage of several layers; not a stack inside one of its modules, an MoE's
#    experts), or is one (enformer's tower and transformer, ``Sequential``s of layers in the ``Sequential``
#    its forward runs: whole, they floored 4% above torch's checkpoint on their layers), is a
#    stage, not a layer: it gives way to its outermost modules that pass rule 3's
#    test, each whole (a layer's attention and MLP stay together: split, the code between them is
#    kept at every budget), bare layers included (SegFormer's closing norm, ConvNeXt's downsampler,
#    which left to the model's code are kept at every budget) and a stem fed the batch (the first
#    stage's patch embedding, rule 3), where those hold all its parameters. Measured: a diffusers UNet2DCondition of three stages of two layers had its floor
#    at torch's every-block peak, 2.3 MiB above diffusers' own checkpointing
#    (``test_libs_zoo``'s ``diffusers-cond-unet-stages``); Swin, Hiera and FocalNet stages split
#    down to attention and MLP had floors above their whole layers', and plans over their
#    prediction; SegFormer's stages whole floored at 0.732 MiB, above transformers' own
#    checkpointing (0.594), and at 0.588 split (``transformers-segformer``). On the CPU a segment
#    holds an RNG state per call (5,056 B; on a GPU that state is in host memory), so a segment
#    over a stage's parts costs more than the stage as one checkpoint: ConvNeXt's floor rose 0.5%.
#    A module that keeps a stack of found blocks in a container of its own is a stage too, whose
#    bare layers with parameters, embeddings aside, are blocks as well (``_Trunk.stages``; not the
#    model's own, such as its closing norm): MONAI's VNet stages, a strided convolution and its
#    norm before a ``Sequential`` of convolution layers, floored 0.2% above torch's checkpoint on
#    the whole stages while the model's code kept those two at every budget (``test_libs_zoo``'s
#    ``monai-vnet``). A stack held in a module that holds nothing else (SwinIR's residual group,
#    beside the closing convolution of its stage) is the stage's own, and its layers are the parts:
#    whole, SwinIR's stages floored at 9.83 MB where torch's checkpoint on every layer reaches 7.68
#    and its own ``use_checkpoint`` 8.07 (7.27 now). Not an MoE's experts, held beside its router.
# 8. A found stack of layers of one weight each in a module that holds parameters beside it and makes
#    its output in its own code (``Calls.made``: MONAI's residual unit, two convolutions in a
#    ``Sequential`` and a residual convolution it adds to them) is that unit's chain of layers, not
#    a stack of blocks: the unit is the block where it passes rule 3's test, and rule 7 leaves it
#    whole. Split, the residual path was the model's code between blocks, and segments cannot span
#    it: MONAI's UNet floored at 3.84 MiB where torch's checkpoint on its whole units reaches 3.68
#    (3.65 now; ``test_libs_zoo``'s ``monai-unet``). Parameters beside it are beside every found
#    stack in the unit: kornia DISK's U-Net keeps its down path and its up path, each a stack of
#    blocks of one convolution, and nothing else; each path was the other's parameters beside,
#    and the whole U-Net one block (its floor 15.58 MB, torch's checkpoint on its 9 blocks 13.25).
# 9. A stage whose own code does work for the backward (``Calls.work``: it saves a tensor, or makes
#    the input of one of its modules: MONAI BasicUNet's max pooling before its convolutions, whose
#    indices and output its split plan kept at every budget, and the concatenation of its up path's
#    skip, whose output ended segments) is one block in the other candidate lists (``coarser``:
#    each such stage whole, one holding at most half of the blocks; where they nest, the
#    innermost in one list and the outermost in another; ``remat.manual.stages``). The profiler
#    takes the list with the lowest floor, from the steps on fake tensors, the finer one when they
#    tie within 1% (a diffusers UNet's up stages whole floored 1 KiB lower, where split ones are
#    planned per part above the floor) or cannot run there (``remat.measure.warmup.by_floor``).
#    BasicUNet floored at 47.63 MB split, 37.80 as stages, torch's checkpoint on its stages
#    (``test_libs_zoo``'s ``monai-basicunet``); demucs' encoder layers, each a convolution and a
#    ``DConv`` stack between activations of its own, at 8.76 MB with the stack whole, 8.01 with
#    the layer whole (torch's checkpoint on the layers: 7.96).
# So every block remat chooses has run once in that forward: a block that does not run is never the
# user's error. One that runs with gradients only after the forward (in the model's own backward: a
# reversible network) has nothing to checkpoint, and is refused with that reason.



HiddenInput = Literal["grad", "batch", "made"]
"""A call's hidden input: one that requires grad, a tensor of the batch (a stem), or one the model
made without a gradient (a codebook's entries, a time embedding's sinusoids; rule 3)."""


@dataclass(frozen=True)
class Calls:
    """The module calls of one forward with gradients, by qualified name."""

    count: dict[str, int]
    """How many times each module that ran was called."""
    start: dict[str, int]
    """The position of each module's first call among all calls' starts and ends."""
    end: dict[str, int]
    """The position where that first call ended."""
    grads: set[str]
    """The modules whose first call returned a tensor that a gradient reached in the step's
    backward (a backward runs through it)."""
    inputs: dict[str, HiddenInput]
    """What each module's first call took as its hidden input (first floating-point tensor), for
    those that took one (rule 3)."""
    made: set[str]
    """The modules whose first call returned a tensor that none of their own modules returned: their
    own code made it (a residual unit's sum, rule 8)."""
    idle: set[str] = field(default_factory=set)
    """The modules whose first call saved tensors for the backward, none of which the backward read
    (rule 1)."""
    mutates: dict[str, str] = field(default_factory=dict)
    """The modules whose first call changed a buffer's values in place, in the first step and again
    in the next, and the first such buffer by name (rule 1; a training norm's running statistics are
    not counted: a replay puts them back)."""
    work: dict[str, list[int]] = field(default_factory=dict)
    """The modules holding parameters whose own code (or a module of theirs without parameters) saved
    a tensor for the backward or made the first input of one of their modules, each time at the
    position of the calls' starts and ends that follows it (rule 9)."""

    def replays(self, name: str) -> bool:
        """Whether the first call of ``name`` has a backward that reads what it saved and a replay
        that would run it as the step did (rule 1)."""
        return name in self.grads and name not in self.idle and name not in self.mutates


def by_calls(model: nn.Module, found: list[tuple[str, nn.Module]], calls: Calls, *, around: bool = True
             ) -> tuple[list[tuple[str, nn.Module]], list[str]]:
    """The blocks found by containers, settled by what ran (NOTE [ Blocks by what runs ]), and the
    modules left out because they ran more than once (rule 6); with ``around`` False, not those
    in them (rule 6, where nothing else is a block)."""
    blocks: list[tuple[str, nn.Module]] = []
    stacks: dict[str, list[bool]] = {}
    repeated: list[str] = []  # rule 6
    canonical = {id(m): n for n, m in model.named_modules()}  # rule 5
    held = False  # a found block in a module that ran more than once
    for name, module in _units(model, found, calls):
        outer = _repeated_around(name, calls) if around else (name if calls.count.get(name, 0) > 1 else None)
        if outer is not None:
            repeated.append(outer)
            held |= outer != name
            continue
        if name in calls.count and (not calls.replays(name) or param_count(module) == 0):
            continue  # rule 1: no backward, or the model's code
        tied = len(repeated)
        if name not in calls.count:
            within = _running_within(name, module, calls, canonical, repeated)
        elif len(parts := _stage_parts(name, module, calls)) >= 2:
            within = parts  # rule 7
        else:
            within = [(name, module)]
        ran = bool(within) or len(repeated) > tied or any(n.startswith(name + ".") for n in calls.count)
        stacks.setdefault(name.rpartition(".")[0], []).append(ran)  # rule 2: its modules ran, blocks or not
        blocks += within
    if skipped := [stack for stack, ran in stacks.items() if any(ran) and not all(ran)]:
        missing = [n for n, _ in found if n.rpartition(".")[0] in skipped and not any(
            b == n or b.startswith(n + ".") for b, _ in blocks)]
        raise ProfileError(f"blocks {missing} did not run in the training step while others of their stack did; "
                           f"remat plans blocks that run in every {RANDOM_SKIPS}")
    modules = dict(model.named_modules())
    stages = {c.rpartition(".")[0] for c, ran in stacks.items() if any(ran) and "." in c
              and isinstance(modules[c], CONTAINERS)}  # rule 7: a stack's stage, not the model
    trunk = _Trunk(calls, last_end=max((calls.end[n] for n, _ in blocks), default=None),
                   least=min((param_count(m) for _, m in blocks), default=0),
                   blocks=frozenset(id(b) for _, b in blocks), stages=frozenset(stages))
    taken = {n for n, _ in blocks}
    above = {".".join(n.split(".")[:k]) for n in taken for k in range(n.count(".") + 1)}  # with the root, ""
    blocks += _uncovered(model, "", taken, above, trunk)
    if not blocks:  # rule 3's last resort
        blocks = _uncovered(model, "", taken, above, dataclasses.replace(trunk, last_resort=True))
    if not blocks and held:  # rule 6: nothing else is a block
        return by_calls(model, found, calls, around=False)
    covered = {id(m) for _, b in blocks for m in b.modules()}
    for name, module in model.named_modules():  # rule 6 in the trunk: ALBERT's shared layer
        if (calls.count.get(name, 0) > 1 and calls.replays(name) and trunk.takes(name) and param_count(module) > 0
                and any(True for _ in module.children()) and id(module) not in covered
                and not any(inside(name, r) for r in repeated) and not any(inside(b, name) for b, _ in blocks)):
            repeated.append(name)
    order = {n: i for i, (n, _) in enumerate(model.named_modules())}
    return sorted(_outermost(blocks), key=lambda b: order[b[0]]), list(dict.fromkeys(repeated))


def _repeated_around(name: str, calls: Calls) -> str | None:
    """The outermost of ``name`` and the modules it is in that ran more than once (rule 6), or None:
    neuraloperator's FNO calls one module per layer with the layer's index, which runs once each
    of that module's per-layer lists of convolutions."""
    path = name.split(".")
    return next((p for k in range(1, len(path) + 1) if calls.count.get(p := ".".join(path[:k]), 0) > 1), None)


def _outermost(blocks: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """The blocks inside no other, by object (rule 5): a module the model holds under two names
    is one module, named once (``named_modules`` gives the first name)."""
    inner = {id(m) for _, block in blocks for m in block.modules() if m is not block}
    return list({id(b): (n, b) for n, b in blocks if id(b) not in inner}.values())


def _running_within(name: str, module: nn.Module, calls: Calls, canonical: dict[int, str],
                    repeated: list[str]) -> list[tuple[str, nn.Module]]:
    """The outermost modules inside ``module`` that ran once and hold parameters (rule 1), each by
    its first name (``canonical``); those that ran more than once are added to ``repeated`` (rule
    6)."""
    found: list[tuple[str, nn.Module]] = []
    for child in module.children():
        full = canonical[id(child)]
        if full not in calls.count:
            found += _running_within(full, child, calls, canonical, repeated)
        elif calls.count[full] > 1:
            repeated.append(full)
        elif param_count(child) > 0 and calls.replays(full):
            found.append((full, child))
    return found


def _units(model: nn.Module, found: list[tuple[str, nn.Module]], calls: Calls) -> list[tuple[str, nn.Module]]:
    """``found`` with each stack of single layers in a residual unit given way to the unit (rule 8)."""
    modules = dict(model.named_modules())
    members: dict[str, list[str]] = {}  # a unit's found stacks' layers: every stack in it, one chain or not
    for name, _ in found:
        unit = name.rpartition(".")[0]
        while unit and isinstance(modules[unit], CONTAINERS):
            unit = unit.rpartition(".")[0]
        members.setdefault(unit, []).append(name)
    unit_of: dict[str, str] = {}
    for unit, names in members.items():
        if (unit and unit in calls.made and all(one_weight(modules[n]) for n in names)
                and param_count(modules[unit]) > sum(param_count(modules[n]) for n in names)
                and _Trunk(calls).holds(unit, modules[unit])):
            unit_of |= dict.fromkeys(names, unit)
    return list({unit_of.get(n, n): (unit_of.get(n, n), modules[unit_of.get(n, n)]) for n, _ in found}.values())


@dataclass(frozen=True)
class _Trunk:
    """What rule 3 judges a module of the trunk by: the module calls, and how the blocks found so
    far end the trunk (``last_end``: what runs after them is the head's unless it holds ``least``
    parameters, as many as the smallest of them)."""

    calls: Calls
    last_end: int | None = None
    least: int = 0
    blocks: frozenset[int] = frozenset()
    """The blocks found so far, by object: a module that holds one under another name (DynUNet's
    recursive ``skip_layers``, fed the batch) is no block (rule 5); one that only shares a part
    with them (video-diffusion-pytorch's rotary embedding, one for every temporal attention) may be."""
    stages: frozenset[str] = frozenset()
    """The modules that keep a stack of found blocks in a container of their own (rule 7)."""
    last_resort: bool = False
    """Whether a module fed what the model made without a gradient may be a block (rule 3: where
    no other is)."""

    def takes(self, name: str) -> bool:
        """Whether the hidden input of ``name``'s first call is one a block of the trunk takes (rule 3)."""
        taken = self.calls.inputs.get(name)
        return taken in ("grad", "batch") or (self.last_resort and taken == "made")

    def holds(self, name: str, module: nn.Module, bare: bool = False) -> bool:
        """Whether ``module``, which no block covers, is a block of the trunk (rule 3); with
        ``bare``, a layer without modules of its own may be one (a stage's part, rule 7)."""
        calls, params = self.calls, param_count(module)
        if calls.count.get(name) != 1 or not calls.replays(name) or not self.takes(name):
            return False
        before_last = self.last_end is None or calls.start[name] < self.last_end
        if params == 0 or not (before_last or params >= self.least) or any(id(m) in self.blocks for m in module.modules()):
            return False
        return bare or any(True for _ in module.children())


def _uncovered(model: nn.Module, prefix: str, taken: set[str], above: set[str], trunk: _Trunk,
               stage: bool = False, whole: bool = False) -> list[tuple[str, nn.Module]]:
    """The modules of the trunk that no block covers (rule 3), each split into its parts (rule 4);
    with ``whole``, a module's parts; with ``stage``, a stage's parts (rule 7). A list among them is
    no part, its items are."""
    found: list[tuple[str, nn.Module]] = []
    for child_name, child in model.named_children():
        full = f"{prefix}.{child_name}" if prefix else child_name
        if full in taken:
            continue
        if (full in above or (isinstance(child, CONTAINERS) and (whole or full not in trunk.calls.count))
                or (stage and wraps_a_stack(child))):
            found += _uncovered(child, full, taken, above, trunk, stage, whole)
        elif trunk.holds(full, child, bare=stage or (prefix in trunk.stages and not isinstance(child, nn.Embedding))):
            bare = not any(True for _ in child.children())  # a stack's stage's own layer (rule 7)
            found += [(full, child)] if stage or whole or bare else _split(full, child, taken, above, trunk)
    return found


def _split(name: str, module: nn.Module, taken: set[str], above: set[str], trunk: _Trunk
           ) -> list[tuple[str, nn.Module]]:
    """``module``'s parts, each whole, where it has two or more, not all single layers (rule 4);
    a part that is its only one is its body, whose parts are its own."""
    parts = _uncovered(module, name, taken, above, trunk, whole=True)
    while len(parts) == 1:
        parts = _uncovered(parts[0][1], parts[0][0], taken, above, trunk, whole=True)
    return parts if len(parts) >= 2 and not all(bare_layer(m) for _, m in parts) else [(name, module)]


def _stage_parts(name: str, module: nn.Module, calls: Calls) -> list[tuple[str, nn.Module]]:
    """The parts of a found block that keeps a stack of layers of its own (rule 7), or none."""
    if not keeps_a_stack(module):
        return []
    parts = _uncovered(module, name, set(), set(), _Trunk(calls), stage=True)
    return parts if sum(param_count(m) for _, m in parts) == param_count(module) else []
