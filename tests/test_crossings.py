"""Tensors that cross a block boundary otherwise than as the hidden state from one block to the
next, on pure-torch models in the shapes other libraries have (tests/test_libs_zoo.py has the
libraries' own): a first input that needs no gradient (a frozen embedding, NOTE [ A first input
that needs no gradient ] in remat.measure.marked), a hidden output the model's code consumes and
holds (NOTE [ A hidden output the model's code holds ] in remat.measure.handovers), first inputs
the model's code keeps in a list (NOTE [ A first input the model's code holds ] in
remat.measure.sides) or for a skip that no block saves (NOTE [ A first input the model's code
keeps for a skip ] there), a view of a block's output made between blocks (NOTE [ A first input made
between blocks ] there). Each is recorded as such, every plan that changes one block's option from an
all-kept or all-recomputed step is predicted to the byte, and the plans at 60%, 40% and the floor
measure at or below their prediction with the plain step's gradients.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from _tables import varied_chain
from torch import nn

import remat
from remat.errors import CheckpointError
from remat.measure.notes import StepNotes
from remat.measure.sides import note_output, note_sides, read_side_inputs, with_skips
from remat.measure.step_memory import measure_step
from remat.measure.storages import storage_key
from remat.plan.handovers import handovers
from remat.plan.segment_estimate import estimate_segments
from remat.plan.sides import side_inputs


class Mlp(nn.Module):
    """``affine=False``: its norm has no weight, so it saves nothing of an input that needs no
    gradient (as a frozen RMSNorm: a LoRA model's)."""

    def __init__(self, d: int, affine: bool = True) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(d, elementwise_affine=affine), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Proj(nn.Module):
    """Ends in a matmul: ``selective`` keeps its output in the replay's cache (an upsampler's conv)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm, self.lin = nn.LayerNorm(d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.nn.functional.gelu(self.norm(x)))


class FrozenBase(nn.Module):
    """A frozen embedding; ``hold``: the model's forward holds its output to the end, as
    transformers' ``inputs_embeds`` (peft's LoRA models)."""

    def __init__(self, d: int = 32, depth: int = 4, hold: bool = True) -> None:
        super().__init__()
        self.hold = hold
        self.embed = nn.Embedding(64, d).requires_grad_(False)
        self.layers = nn.ModuleList([Mlp(d, affine=False) for _ in range(depth)])
        self.head = nn.Linear(d, 64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        embeds = self.embed(ids)
        x = embeds
        if not self.hold:
            del embeds
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class Join(nn.Module):
    """The next stage: concatenates the skip in its own forward, then runs its layers."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Mlp(d), Mlp(d)])

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        x = torch.cat([x, skip], dim=1)
        for layer in self.layers:
            x = layer(x)
        return x


class HeldOutput(nn.Module):
    """``up``'s output enters no block: ``join`` concatenates it with a skip, and this forward
    holds it until ``join`` returns (diffusers' upsampler in its UNet)."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, d)
        self.down = nn.ModuleList([Mlp(d), Mlp(d)])
        self.up, self.join = Proj(d), Join(d)
        self.head = nn.Linear(d, 64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        skip = self.down[0](self.embed(ids))
        y = self.up(self.down[1](skip))
        x = self.join(y, skip)
        return self.head(x[:, : ids.shape[1]])


class Viewed(nn.Module):
    """The model's code hands the third layer a view of the second's output (wav2vec2 transposes
    its feature extractor's output before the projection): the same storage, another tensor."""

    def __init__(self, d: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, d)
        self.layers = nn.ModuleList([Mlp(d) for _ in range(depth)])
        self.head = nn.Linear(d, 64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for i, layer in enumerate(self.layers):
            x = layer(x.transpose(0, 1).transpose(0, 1) if i == 2 else x)
        return self.head(x)


class ListedOutputs(nn.Module):
    """The down path's outputs kept in a list for the up path, which concatenates them in the
    model's code (diffusers' down blocks and their ``output_states``)."""

    def __init__(self, d: int = 32, depth: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, d)
        self.down = nn.ModuleList([Mlp(d) for _ in range(depth)])
        self.up = nn.ModuleList([Mlp(d) for _ in range(depth)])
        self.head = nn.Linear(d, 64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        outs = []
        for block in self.down:
            x = block(x)
            outs.append(x)
        for block in self.up:
            x = block(torch.cat([x, outs.pop()], dim=1)[:, : ids.shape[1]] + x)
        return self.head(x)


@dataclasses.dataclass
class State:
    """What each block of ``Stateful`` hands the next: the hidden state and a running aux loss."""

    hidden: torch.Tensor
    aux: torch.Tensor


class _StateBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.mlp = Mlp(d)

    def forward(self, state: State) -> State:
        hidden = self.mlp(state.hidden)
        return State(hidden=hidden, aux=state.aux + 1e-3 * hidden.square().mean())


class Stateful(nn.Module):
    """Blocks that hand each other a ``@dataclass`` (a state object, as some libraries' layers)."""

    def __init__(self, d: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(64, d), nn.Linear(d, 64)
        self.layers = nn.ModuleList(_StateBlock(d) for _ in range(depth))

    def forward(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        state = State(hidden=self.embed(ids), aux=torch.zeros(()))
        for layer in self.layers:
            state = layer(state)
        return {"logits": self.head(state.hidden), "aux": state.aux}


class BandSplit(nn.Module):
    """BS-RoFormer's band split: a norm and a linear map per band, whose outputs (a matmul's, which
    ``selective`` keeps) the model's code keeps until it joins them after the last, all alive together (NOTE [ What crosses a block boundary, as
    state ] in remat.plan.crossings, rule 5): 64 handovers asked the search for 2**64 states, and
    ``solve`` crashed with OverflowError."""

    def __init__(self, d: int = 32, bands: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, d)
        self.bands = nn.ModuleList([nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d)) for _ in range(bands)])
        self.mix, self.head = Mlp(d), nn.Linear(d, 64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        outs = [band(part) for band, part in zip(self.bands, x.chunk(len(self.bands), dim=1))]
        return self.head(self.mix(torch.cat(outs, dim=1)))


def _loss(out: torch.Tensor | dict[str, torch.Tensor], batch: tuple[torch.Tensor]) -> torch.Tensor:
    """Cross-entropy of the logits, plus the output's ``aux`` loss where it has one."""
    logits, aux = (out["logits"], out.get("aux", 0.0)) if isinstance(out, dict) else (out, 0.0)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[0].flatten()) + aux


BATCH = (torch.randint(0, 64, (8, 128), generator=torch.Generator().manual_seed(1)),)
HIDDEN = 8 * 128 * 32 * 4  # bytes of one hidden state


def _measured(model: nn.Module, prof: remat.Profile, choices: dict[str, str],
              segments: list[list[str]] | None = None) -> tuple[int, int]:
    """(predicted, measured) peak of a plan of ``choices`` (and ``segments``)."""
    est = estimate_segments(prof, choices, segments or [])
    plan = remat.Plan(choices=choices, budget_bytes=None, method="manual", estimate=est, model=prof.model,
                      fingerprint=prof.fingerprint, device=prof.device, dtype=prof.dtype,
                      batch_shape=prof.batch_shape, segments=segments or [])
    remat.apply(model, plan)
    try:
        return est.peak_bytes, measure_step(model, BATCH, loss_fn=_loss, repeats=0).peak_bytes
    finally:
        remat.remove(model)


def _profiled(make: Callable[[], nn.Module]) -> tuple[nn.Module, remat.Profile]:
    torch.manual_seed(0)
    model = make()
    return model, remat.profile(model, BATCH, loss_fn=_loss, repeats=1)


def _every_flip_exact(model: nn.Module, prof: remat.Profile) -> None:
    names = [b.name for b in prof.blocks]
    off = []
    for base in ("keep", "recompute"):
        for name in names:
            for option in ("keep", "selective", "recompute"):
                if option == base:
                    continue
                choices = dict.fromkeys(names, base) | {name: option}
                predicted, measured = _measured(model, prof, choices)
                if predicted != measured:
                    off.append((choices, predicted, measured))
    assert not off, off


def _plans_fit(model: nn.Module, prof: remat.Profile) -> list[remat.Plan]:
    """The plans at 60% and 40% of the plain peak and at the floor (those above it) measure at or
    below their prediction, with the plain step's gradients."""
    ref = copy.deepcopy(model)
    with pytest.raises(remat.InfeasibleBudget) as refused:
        remat.solve(prof, 1)
    floor = refused.value.smallest_bytes
    assert floor is not None
    plans = []
    for budget in (round(0.6 * prof.plain_peak_bytes), round(0.4 * prof.plain_peak_bytes), floor):
        if budget < floor:
            continue
        plan = remat.solve(prof, budget)
        assert plan.estimate is not None
        predicted, measured = _measured(model, prof, plan.choices, plan.segments)
        assert predicted == plan.estimate.peak_bytes <= budget
        assert measured <= predicted, (measured, plan.choices, plan.segments)
        plans.append(plan)
    remat.apply(model, plans[-1])
    for m in (model, ref):
        m.zero_grad(set_to_none=True)
        _loss(m(*BATCH), BATCH).backward()
    remat.remove(model)
    exact = "tiled" not in plans[-1].choices.values()  # NOTE [ The tiled MLP ]: its sums in another order
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        if exact or p.grad is None or q.grad is None:
            assert (p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad), n
        else:
            torch.testing.assert_close(p.grad, q.grad, msg=n)
    return plans


@pytest.mark.parametrize("hold", [True, False], ids=["held", "dropped"])
def test_a_frozen_first_input_is_a_side_input(hold: bool) -> None:
    model, prof = _profiled(lambda: FrozenBase(hold=hold))
    assert prof.blocks[0].input_bytes == 0 and prof.blocks[1].input_bytes == HIDDEN
    frozen = [s for s in side_inputs(prof) if s.consumers == ["layers.0"]]
    assert len(frozen) == 1 and frozen[0].size_bytes == HIDDEN and frozen[0].saved_by == {}
    assert frozen[0].dies_after == (None if hold else "layers.0")
    _every_flip_exact(model, prof)
    _plans_fit(model, prof)


def test_a_hidden_output_the_model_holds_is_a_handover() -> None:
    model, prof = _profiled(HeldOutput)
    assert [b.name for b in prof.blocks] == ["down.0", "down.1", "up", "join.layers.0", "join.layers.1"]
    (held,) = handovers(prof)
    assert (held.made_by, held.dies_after, held.saved_by, held.size_bytes) == ("up", None, {"up": ["selective"]}, HIDDEN)
    _every_flip_exact(model, prof)
    assert any(plan.segments for plan in _plans_fit(model, prof))


def test_first_inputs_the_model_keeps_in_a_list_end_segments() -> None:
    model, prof = _profiled(ListedOutputs)
    assert {"down.1", "down.2"} <= set(prof.skip_bytes) and "down.0" not in prof.skip_bytes
    _every_flip_exact(model, prof)
    names = [b.name for b in prof.blocks]
    for plan in _plans_fit(model, prof):
        for first, last in plan.segments:
            after_first = names[names.index(first) + 1 : names.index(last) + 1]
            assert not set(after_first) & set(prof.skip_bytes), plan.segments


def test_a_view_made_between_blocks_ends_segments() -> None:
    # NOTE [ A first input made between blocks ] in remat.measure.sides: a segment's frame holds
    # the view until its replay, which the segment cost model does not count.
    model, prof = _profiled(lambda: Viewed(depth=6))
    assert list(prof.skip_bytes) == ["layers.2"]
    names = [b.name for b in prof.blocks]
    choices = dict.fromkeys(names, "keep") | {"layers.0": "recompute", "layers.3": "recompute"}
    predicted, measured = _measured(model, prof, choices, [["layers.1", "layers.2"]])
    assert measured == predicted + HIDDEN  # what a plan over it would miss: the view, held
    for plan in _plans_fit(model, prof):  # layers.2 after the first block of no segment
        assert not any(names.index(a) < 2 <= names.index(b) for a, b in plan.segments), plan.segments


def test_blocks_that_hand_each_other_a_dataclass_are_planned_to_the_byte() -> None:
    # remat.measure.storages.tensors_in and remat.manual.frames.walk look into a dataclass: before,
    # "no gradient reached the outputs of blocks [...]" (a ProfileError naming the user's blocks=),
    # and once found, a segment's frame held its blocks' states whole (2 * HIDDEN over here).
    model, prof = _profiled(Stateful)
    assert [b.name for b in prof.blocks] == [f"layers.{i}" for i in range(4)]
    _every_flip_exact(model, prof)
    predicted, measured = _measured(model, prof, dict.fromkeys([b.name for b in prof.blocks], "keep"),
                                    [["layers.0", "layers.2"]])
    assert measured == predicted
    assert _plans_fit(model, prof)


def _taking_key(key: int, held: list[torch.Tensor]) -> torch.Tensor:
    """A new storage at ``key``, a dead one's: the allocator hands a freed address on soon."""
    gc.collect()
    while len(held) < 10_000 and storage_key(again := torch.randn(256)) != key:
        held.append(again)
    assert storage_key(again) == key, "no storage took the dead one's key"
    return again


def test_a_side_storage_that_takes_a_dead_ones_key_is_another_side_input() -> None:
    # NOTE [ Storage keys are reused ] in remat.measure.sides: T5's decoder position bias took the
    # key of the encoder's in some runs, and the two were read as one side input of both stacks.
    hooks, held = StepNotes(), []
    x0, x1 = torch.randn(8), torch.randn(8)
    hooks.order.append(0)
    hooks.running.append(0)
    bias = torch.randn(256)
    note_sides(hooks, 0, x0, (x0, bias))
    key = storage_key(bias)
    hooks.running.pop()
    del bias  # dies after block 0 ended
    again = _taking_key(key, held)
    hooks.order.append(1)
    note_sides(hooks, 1, x1, (x1, again))
    records = read_side_inputs(hooks, hooks, {}, ["enc", "dec"])
    assert [(s.consumers, s.dies_after) for s in records] == [(["enc"], "enc"), (["dec"], None)]


def test_a_side_storage_that_takes_a_dead_first_inputs_key_is_no_skip() -> None:
    hooks, held = StepNotes(), []
    x0 = torch.randn(256)
    y0 = torch.randn(8)
    hooks.order.append(0)
    note_sides(hooks, 0, x0, (x0,))
    note_output(hooks, 0, y0)
    key = storage_key(x0)
    del x0
    again = _taking_key(key, held)
    hooks.order.append(1)
    note_sides(hooks, 1, y0, (y0, again))
    prof = with_skips(hooks, varied_chain(2, 0), StepNotes())
    assert prof.skip_bytes == {}
    assert [s.consumers for s in read_side_inputs(hooks, hooks, {}, ["a", "b"])] == [["b"]]


class _Copy(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 1.0  # a fresh tensor: saves nothing of x


class KeepsASkip(nn.Module):
    """A UNet's down path (x-unet's, Karras'): the model's code keeps block 0's output for a skip
    it adds after block 2, and block 1, kept, saves nothing of that input (its first op copies
    it). Checkpointed, block 1 holds it to its backward; kept, it dies at the skip."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(64, d), nn.Linear(d, 64)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(d, d), nn.GELU()),
                                     nn.Sequential(_Copy(), nn.Linear(d, d)),
                                     nn.Sequential(nn.Linear(d, d), nn.GELU()),
                                     nn.Sequential(nn.Linear(d, d), nn.GELU())])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.blocks[0](self.embed(ids))
        skips = [h]
        h = self.blocks[2](self.blocks[1](h))
        h = h + skips.pop() * 0.5  # the skip dies here in the plain step: nothing saves it
        return self.head(self.blocks[3](h))


def test_a_first_input_the_model_keeps_for_a_skip_is_held_by_a_checkpoint() -> None:
    """Before it was a crossing, recomputing block 1 was predicted one hidden state low and
    recomputing block 2 one high (NOTE [ A first input the model's code keeps for a skip ] in
    remat.measure.sides)."""
    model, prof = _profiled(KeepsASkip)
    (held,) = [c for c in prof.crossings if c.consumers == ["blocks.1"]]
    assert held.dies_after == "blocks.2" and held.size_bytes == prof.blocks[1].input_bytes and not held.saved_by
    _every_flip_exact(model, prof)
    _plans_fit(model, prof)


class ResidualAfterLast(nn.Module):
    """diffusers' UNet3D's temporal transformer: the model's code keeps the stage's input for a
    residual it adds after the stage's last block, whose input the code makes (a norm); the
    residual dies there, so that block's checkpoint keeps less than its input."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(64, d), nn.Linear(d, 64)
        self.norm = nn.LayerNorm(d)
        self.blocks = nn.ModuleList([Proj(d), Mlp(d), Proj(d)])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) * 2.0
        h = self.blocks[0](x * 0.5)  # nothing saves x
        h = self.blocks[1](self.norm(h))
        h = h + x
        del x  # the residual dies here
        return self.head(self.blocks[2](h))


def test_a_segment_over_a_block_after_which_the_code_frees_a_residual() -> None:
    """NOTE [ A segment's costs from per-block numbers ] in remat.plan.segments: the free after a
    segment's first block is in its recompute numbers and again in its keep numbers, which the
    replay runs at; counted twice, a one-block segment over UNet3D's was 27,712 B below its
    measure. Every one-block segment over plans of one option measures at most its prediction."""
    model, prof = _profiled(ResidualAfterLast)
    names = [b.name for b in prof.blocks]
    off = []
    for base in ("keep", "recompute"):
        for name in names:
            predicted, measured = _measured(model, prof, dict.fromkeys(names, base) | {name: "keep"}, [[name, name]])
            if measured > predicted:
                off.append((base, name, predicted, measured))
    assert not off, off
    _plans_fit(model, prof)


class _Up(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.cat([x, skip], -1))  # saves the concatenation, nothing of the skip


class SkipFromOutput(nn.Module):
    """MONAI's UNETR: encoder blocks branch off the trunk, the model's code keeps their outputs in
    locals to the end of its forward, and decoder blocks take them as a second input. One encoder
    ends in an in-place activation, which saves its output: kept, it holds the skip to its own
    backward; the other ends in a matmul, whose output ``selective`` caches."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(64, d), nn.Linear(d, 64)
        self.trunk = nn.ModuleList([Mlp(d) for _ in range(3)])
        self.enc = nn.ModuleList([nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.LeakyReLU(inplace=True)),
                                  nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, d))])
        self.dec = nn.ModuleList([_Up(d), _Up(d)])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.trunk[0](self.embed(ids))
        e0 = self.enc[0](h)
        h = self.trunk[1](h)
        e1 = self.enc[1](h)
        h = self.dec[0](self.trunk[2](h), e1)
        return self.head(self.dec[1](h, e0))


def test_a_skip_from_a_blocks_output_is_held_by_its_maker_or_a_checkpoint() -> None:
    """NOTE [ A skip from a block's output ] in remat.measure.sides. Left out of the side inputs
    (judged as charged to the block that made it), a plan that recomputed a decoder was predicted a
    hidden state low, and one that kept it among recomputed blocks one high, on MONAI's UNETR
    131,072 and 786,432 B."""
    model, prof = _profiled(SkipFromOutput)
    skips = {tuple(c.consumers): c for c in side_inputs(prof) if c.made_by is not None}
    assert {k: (c.made_by, c.saved_by, c.size_bytes) for k, c in skips.items()} == {
        ("dec.0",): ("enc.1", {"enc.1": ["selective"]}, HIDDEN), ("dec.1",): ("enc.0", {"enc.0": ["keep"]}, HIDDEN)}
    _every_flip_exact(model, prof)
    _plans_fit(model, prof)


class _ValueAttention(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor, first: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v = self.qkv(x).chunk(3, -1)  # the values: a view of the projection's output
        if first is not None:
            v = 0.5 * (v + first)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(a), v


class ValueResidual(nn.Module):
    """nGPT's value residual (ResFormer): each attention returns its values besides its output,
    and the model's code hands the first attention's to every later one; its layers are pairs of
    blocks iterated by the model's own loop."""

    def __init__(self, d: int = 32, depth: int = 3) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(64, d), nn.Linear(d, 64)
        self.layers = nn.ModuleList(nn.ModuleList([_ValueAttention(d), Mlp(d)]) for _ in range(depth))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x, first = self.embed(ids), None
        for attn, ff in self.layers:
            x, values = attn(x, first)
            first = values if first is None else first
            x = ff(x)
        return self.head(x)


def test_a_side_input_a_block_returns_besides_its_output_is_made_by_it() -> None:
    """NOTE [ A skip from a block's output ] in remat.measure.sides, for a block's second output.
    Read as made by the model's code, the first attention's values (the storage of its projection,
    which its kept and selective runs save) were held by nobody under a plan: recomputing the last
    feed-forward among kept blocks measured 393,216 B over its prediction (nGPT: its 60% plan
    132,096 B over). A plan that recomputes the maker among kept blocks lets the values go in the
    head's forward, which counts them as live at its peak (on the safe side: 131,088 B here)."""
    model, prof = _profiled(ValueResidual)
    (values,) = side_inputs(prof)
    assert (values.made_by, values.consumers, values.saved_by, values.size_bytes) == (
        "layers.0.0", ["layers.1.0", "layers.2.0"], {"layers.0.0": ["keep", "selective"]}, 3 * HIDDEN)
    names = [b.name for b in prof.blocks]
    over, off = [], []
    for base in ("keep", "recompute"):
        for name in names:
            for option in {"keep", "selective", "recompute"} - {base}:
                choices = dict.fromkeys(names, base) | {name: option}
                predicted, measured = _measured(model, prof, choices)
                if measured > predicted:
                    over.append((choices, predicted, measured))
                elif measured < predicted:
                    off.append((name, option, estimate_segments(prof, choices, []).peak_phase))
    assert not over, over
    assert all(phase == "forward of the head" for _, _, phase in off), off
    _plans_fit(model, prof)


class _Shifted(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.mlp = Mlp(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(torch.nn.functional.pad(x, (0, 0, 1, -1)))  # saves nothing of x


class _Merge(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(2 * d, d)

    def forward(self, streams: list[torch.Tensor]) -> torch.Tensor:
        return self.lin(torch.cat(streams, -1))  # saves the concatenation, nothing of either stream


class TwoStreams(nn.Module):
    """simple-hierarchical-transformer's layer loop: a fine stream's block, then a merge that takes
    both streams; the fine stream's output enters the merge besides its hidden input, and then the
    next fine block as its hidden input."""

    def __init__(self, d: int = 32, depth: int = 3, hold: bool = False) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(64, d), nn.Linear(d, 64)
        self.fine = nn.ModuleList(_Shifted(d) for _ in range(depth))
        self.merges = nn.ModuleList(_Merge(d) for _ in range(depth))
        self.hold = hold

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        a = self.embed(ids)
        b = a * 2.0
        for fine, merge in zip(self.fine, self.merges):
            before = b if self.hold else None  # the model's code keeps the fine block's input past the merge
            b = fine(b)
            a = a + merge([a, b])
            if before is not None:
                a = a + 0.5 * before
                del before
        return self.head(a)


@pytest.mark.parametrize("hold", [False, True], ids=["dropped", "held"])
def test_a_side_input_that_becomes_a_later_blocks_first_input_is_held_by_it(hold: bool) -> None:
    """NOTE [ A side input that becomes a first input ] in remat.measure.sides: read as a side input
    of the merge alone, dying in the next fine block's forward, a plan that recomputed that block
    (whose checkpoint holds it) measured a hidden state over (simple-hierarchical-transformer:
    131,072 B, in the plans ``solve`` chose from 95% to 65% of the plain peak). Where the model's
    code keeps it longer, it is one record still, not a second as a first input held."""
    model, prof = _profiled(lambda: TwoStreams(hold=hold))
    (held,) = [c for c in side_inputs(prof) if c.consumers[-1] == "fine.1"]
    assert (held.made_by, held.consumers, held.size_bytes) == ("fine.0", ["merges.0", "fine.1"], HIDDEN)
    assert held.dies_after == ("merges.1" if hold else "fine.1")
    _every_flip_exact(model, prof)
    _plans_fit(model, prof)


class _Predict(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.mlp = Mlp(d)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.mlp(x + 0.0 * target.detach().sum())  # takes the target, saves nothing of it


class HeadSavesASide(nn.Module):
    """simple-hierarchical-transformer's latent dynamics: blocks take the tokens they predict
    besides their hidden input, and the loss after the blocks compares the prediction with them
    (a product: it saves them for its backward)."""

    def __init__(self, d: int = 32, depth: int = 3) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(64, d), nn.Linear(d, 64)
        self.layers = nn.ModuleList(_Predict(d) for _ in range(depth))

    def forward(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        x = self.embed(ids)
        target = x * 0.5
        for layer in self.layers:
            x = layer(x, target)
        return {"logits": self.head(x), "aux": (x * target).mean()}


def test_a_side_input_the_models_code_saves_is_held_to_its_backward_by_every_plan() -> None:
    """NOTE [ A side input the model's code saves ] in remat.plan.sides: read as freed in the head's
    forward, every plan that recomputed a consumer was predicted its bytes high at the head's
    backward."""
    model, prof = _profiled(HeadSavesASide)
    (target,) = side_inputs(prof)
    assert target.saved_after == "layers.2" and target.consumers == ["layers.0", "layers.1", "layers.2"]
    _every_flip_exact(model, prof)
    _plans_fit(model, prof)


class _Attends(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.mlp = Mlp(d)

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        return self.mlp(x + context.sum(1, keepdim=True))  # takes the context, saves nothing of it


class HeadFreesItFirst(nn.Module):
    """CoCa-pytorch: blocks take a slice of a pooled tensor, whose first token the loss saves (a
    view of the same storage); the head's backward frees it before its peak."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.embed, self.pool, self.head = nn.Embedding(64, d), nn.Linear(d, d), nn.Linear(d, 64)
        self.to_latent, self.spread = nn.Linear(d, d), nn.Linear(d, 16 * d)
        self.layers = nn.ModuleList(_Attends(d) for _ in range(2))

    def forward(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        x = self.embed(ids)
        pooled = self.pool(x)
        for layer in self.layers:
            x = layer(x, pooled[:, 1:])
        spread = self.spread(x).square().mean()  # its backward peaks after the latent's, made later, ran
        return {"logits": self.head(x), "aux": spread + self.to_latent(pooled[:, 0]).square().mean()}


def test_a_side_input_the_head_saves_and_frees_before_its_peak_is_held_past_it_by_a_checkpoint() -> None:
    """NOTE [ A side input the model's code saves ]: CoCa's pooled image tokens measured 33,792 B
    over in every plan that recomputed its first cross-attention block."""
    model, prof = _profiled(HeadFreesItFirst)
    (pooled,) = side_inputs(prof)
    assert pooled.saved_after == "layers.1" and prof.post_bwd_peak_held_bytes > prof.post.bwd_peak_bytes
    _every_flip_exact(model, prof)
    _plans_fit(model, prof)


class CodeSavesItBetween(nn.Module):
    """transformers' Funnel with repeated blocks: the first stage's blocks take the attention
    inputs, the code after them saves them (the stage's repeats, not blocks), and a second stage
    of blocks never sees them."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(64, d), nn.Linear(d, 64)
        self.first = nn.ModuleList(_Predict(d) for _ in range(2))
        self.rest = nn.ModuleList(Mlp(d) for _ in range(2))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        target = x * 0.5
        for layer in self.first:
            x = layer(x, target)
        x = x * target  # saves it
        for layer in self.rest:
            x = layer(x)
        return self.head(x)


def test_a_side_input_the_code_saves_before_later_blocks_is_no_extra_at_their_backward() -> None:
    """NOTE [ A side input the model's code saves ]: the runs with every block checkpointed are
    read against the cost model's own level, which holds it from the code that saves it on, as
    the plain step does. Read without that, every plan that recomputed a later block measured the
    side input over its prediction (Funnel: 589,824 B)."""
    model, prof = _profiled(CodeSavesItBetween)
    (target,) = side_inputs(prof)
    assert target.saved_after == "first.1" and target.consumers == ["first.0", "first.1"]
    _every_flip_exact(model, prof)
    _plans_fit(model, prof)


class CodeSavesTheSkip(nn.Module):
    """MONAI's VNet: the code before the next block (its strided convolution; here a sine) saves
    the encoder's output, which a decoder takes later as a skip; the encoder ends in an in-place
    activation, which saves it too."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(64, d), nn.Linear(d, 64)
        self.enc = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.LeakyReLU(inplace=True))
        self.trunk = nn.ModuleList([Mlp(d) for _ in range(3)])
        self.dec = _Up(d)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        e = self.enc(self.embed(ids))
        h = self.trunk[1](self.trunk[0](torch.sin(e)))
        return self.head(self.trunk[2](self.dec(h, e)))


def test_a_skip_the_code_between_blocks_saves_is_no_crossing() -> None:
    """NOTE [ A skip from a block's output ] in remat.measure.sides: every plan holds it as long as
    its consumer would; as a crossing, the plans that recomputed its maker measured a hidden state
    over (MONAI's VNet: 262,144 B)."""
    model, prof = _profiled(CodeSavesTheSkip)
    assert [b.name for b in prof.blocks] == ["enc", "trunk.0", "trunk.1", "dec", "trunk.2"]
    assert not [c for c in prof.crossings if c.made_by == "enc"]
    _every_flip_exact(model, prof)
    _plans_fit(model, prof)


class _Cond(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return x + self.lin(torch.relu(x + c))


class _Wide(nn.Module):
    """A block whose forward peaks high: its replay is the step's peak."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d, 32 * d), nn.Linear(32 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.sin(self.up(x)))


class SideDiesInItsBlock(nn.Module):
    """lucidrains' ddpm Unet's middle: a small tensor the model's code makes enters one block and
    dies as that block's phase ends, off its kept bytes, which then read less than an RNG state."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(64, d), nn.Linear(d, 64)
        self.cond, self.blocks = _Cond(d), nn.ModuleList([Mlp(d), Mlp(d), _Wide(d)])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        h = self.cond(x, x[:, :1] * 2.0)  # 1,024 B, dropped once the block returns
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def test_a_side_input_that_dies_in_its_block_leaves_the_replays_rng_state_whole() -> None:
    """NOTE [ A segment's costs from per-block numbers ] in remat.plan.segments: a replay forks
    the RNG state, the least any checkpoint stashes; read off the kept bytes of the block a side
    input dies in, it was 1,024 B short: here one-block segments were predicted 1,024 B high, and
    on lucidrains' ddpm Unet a replay measured 1,016 B over its prediction."""
    model, prof = _profiled(SideDiesInItsBlock)
    (side,) = [c for c in side_inputs(prof) if c.size_bytes == 1024]
    assert side.consumers == ["cond"] and side.dies_after == "cond"
    names = [b.name for b in prof.blocks]
    off = []
    for base in ("keep", "recompute"):
        for name in names:
            predicted, measured = _measured(model, prof, dict.fromkeys(names, base) | {name: "keep"}, [[name, name]])
            if measured != predicted:
                off.append((base, name, predicted, measured))
    assert not off, off


class Quantizer(nn.Module):
    """diffusers' ``VectorQuantizer``: the nearest code, passed on straight through, and a
    commitment loss; the output's gradient path saves nothing."""

    def __init__(self, d: int, codes: int = 16) -> None:
        super().__init__()
        self.codes = nn.Embedding(codes, d)

    def forward(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        index = torch.cdist(z.flatten(0, 1), self.codes.weight).argmin(1)
        zq = self.codes(index).view_as(z)
        commit = 0.25 * ((zq.detach() - z) ** 2).mean() + ((zq - z.detach()) ** 2).mean()
        return z + (zq - z).detach(), commit, index


class VectorQuantized(nn.Module):
    """diffusers' ``VQModel`` on sequences: its output holds the commitment loss, which the loss
    adds (``aux``) or leaves out."""

    def __init__(self, d: int = 32, commit_in_loss: bool = False) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(64, d), nn.Linear(d, 64)
        self.encoder, self.decoder = nn.ModuleList([Mlp(d), Mlp(d)]), nn.ModuleList([Mlp(d), Mlp(d)])
        self.quantize, self.commit_in_loss = Quantizer(d), commit_in_loss

    def forward(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        x = self.embed(ids)
        for layer in self.encoder:
            x = layer(x)
        q, commit, _ = self.quantize(x)
        for layer in self.decoder:
            q = layer(q)
        return {"logits": self.head(q), "aux" if self.commit_in_loss else "commit": commit}


@pytest.mark.parametrize("commit_in_loss", [False, True], ids=["commit-left-out", "commit-in-loss"])
def test_a_module_whose_backward_reads_nothing_it_saved_is_no_block(commit_in_loss: bool) -> None:
    """Rule 1 of NOTE [ Blocks by what runs ] in remat.manual.settle: with the commitment loss left
    out of the loss, all the quantizer saves is in that loss's graph, which dies with the model's
    output. As a block, its checkpoint's inputs lived to that drop as well, and plans that
    recomputed it measured 117,796 B over their prediction."""
    model, prof = _profiled(lambda: VectorQuantized(commit_in_loss=commit_in_loss))
    names = [b.name for b in prof.blocks]
    assert ("quantize" in names) == commit_in_loss
    assert len(names) == 4 + commit_in_loss
    _every_flip_exact(model, prof)
    _plans_fit(model, prof)


class AddsInPlace(nn.Module):
    """MONAI's SegResNetDS: the model's code adds a skip into a block's output in place
    (``x += skip``) before the next block takes it."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(64, d), nn.Linear(d, 64)
        self.layers = nn.ModuleList([Mlp(d) for _ in range(4)])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        skip = self.embed(ids)
        x = self.layers[1](self.layers[0](skip))
        x += skip
        for layer in self.layers[2:]:
            x = layer(x)
        return self.head(x)


def test_a_block_output_changed_in_place_between_blocks_ends_segments() -> None:
    """NOTE [ A first input made between blocks ] in remat.measure.sides: a segment over
    ``layers.1`` and ``layers.2`` replayed ``layers.2`` on ``layers.1``'s output without the skip,
    and MONAI's SegResNetDS's floor plan had gradients 1e-2 off, with no error."""
    model, prof = _profiled(AddsInPlace)
    names = [b.name for b in prof.blocks]
    assert "layers.2" in prof.skip_bytes
    for plan in _plans_fit(model, prof):  # gradients equal to plain
        assert not any(names.index(a) < 2 <= names.index(b) for a, b in plan.segments), plan.segments
    with pytest.raises(CheckpointError, match=r"changed an output of block layers\.1 in place before block layers\.2"):
        _measured(model, prof, dict.fromkeys(names, "keep"), [["layers.1", "layers.2"]])
    assert remat.applied_plan(model) is None


def test_handovers_past_the_states_bits_read_as_held(tmp_path: Path) -> None:
    model, prof = _profiled(BandSplit)
    assert len(handovers(prof)) >= 64
    _plans_fit(model, prof)
    # numbers over a level the bands' outputs leave below (their unpack bytes): a record read back
    assert min(b.unpack_bytes for b in prof.blocks) < 0
    prof.save(tmp_path / "profile.json")
    assert remat.Profile.load(tmp_path / "profile.json") == prof
