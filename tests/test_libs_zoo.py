"""Models from other libraries (``tests/_libs_zoo.py``): remat finds their blocks by what runs and
every plan it makes with ``verify=False`` fits.

Per model: the blocks cover the step (remat's smallest feasible peak is at or below torch's
checkpoint on every one of them, below the library's own gradient checkpointing where it has one,
and below torch's checkpoint on the modules a user would name, ``SENSIBLE``); plans at 60%, 40%
and the smallest feasible budget, applied without verifying, measure at or below their
prediction, with the plain step's gradients; ``remove`` gives the model back as it was (but for
what the model's own step changes: performer's call counter).
"""

from __future__ import annotations

import contextlib
import copy
import functools
from typing import Any

import _libs_zoo
import pytest
import torch
from _tiers import breadth
from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

import remat
from remat.measure.step import forward_loss, resolve_loss_fn
from remat.measure.step_memory import measure_step

# The libraries' own deprecations (torch.jit.script in litgpt, diffusers' is_gradient_checkpointing).
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")

def _build(name: str) -> Any:
    try:
        return _libs_zoo.LIBS[name]()
    except ImportError as e:
        pytest.skip(f"{name}: its library does not import here ({e})")


def _grads(model: nn.Module, batch: Any, loss_fn: Any) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    loss = forward_loss(model, batch, resolve_loss_fn(loss_fn))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return float(loss.detach()), grads


def _peak(model: nn.Module, batch: Any, loss_fn: Any) -> int:
    return measure_step(model, batch, loss_fn=loss_fn, repeats=0).peak_bytes


def _torch_every_block(model: nn.Module, names: list[str], batch: Any, loss_fn: Any) -> int:
    """The peak with torch's own checkpoint on each of ``names`` (the instance's forward)."""
    modules = dict(model.named_modules())
    for name in names:
        block = modules[name]
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    try:
        try:
            return _peak(model, batch, loss_fn)
        except Exception as e:  # a block that wraps torch's early stop in its own error (einx)
            if "_StopRecomputationError" not in str(e):
                raise
            with set_checkpoint_early_stop(False):  # where torch's checkpoint runs at all there
                return _peak(model, batch, loss_fn)
    finally:
        for name in names:
            del modules[name].forward


def _library_checkpointing(model: nn.Module, batch: Any, loss_fn: Any) -> int | None:
    """The peak with the library's own gradient checkpointing, where it has one, on a copy: turning
    it off does not undo all it did (transformers leaves a hook that makes a frozen embedding's
    output require grad, so the first layer's input would then need a gradient)."""
    twin = copy.deepcopy(model)
    enable = getattr(twin, "enable_gradient_checkpointing", None) or getattr(twin, "gradient_checkpointing_enable", None)
    if enable is None or not all(getattr(twin, flag, True) for flag in (
            "supports_gradient_checkpointing", "_supports_gradient_checkpointing")):  # transformers' PVT, diffusers' VQModel
        return None
    enable()
    return _peak(twin, batch, loss_fn)


_SLOW = ["diffusers-cond-unet-stages", "diffusers-svd-unet", "diffusers-cond-unet", "x-unet"]  # 15-30 s each


@pytest.fixture(scope="module", params=breadth(_libs_zoo.LIBS, quick=[n for n in _libs_zoo.LIBS if n not in _SLOW]))
def case(request: pytest.FixtureRequest) -> dict[str, Any]:
    """A model, its profile, and the peaks of plain PyTorch, torch's checkpoint on remat's blocks
    and the library's own checkpointing."""
    name = request.param
    model, batch, loss_fn = _build(name)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plain_grads = _grads(model, batch, loss_fn)
    moving = {k for k, v in model.state_dict().items() if not torch.equal(v, before[k])}  # the model's own counters
    plain = _peak(model, batch, loss_fn)
    warns = _libs_zoo.WARNS.get(name)
    with pytest.warns(UserWarning, match=warns) if warns else contextlib.nullcontext():
        prof = remat.profile(model, batch, loss_fn=loss_fn, repeats=1)
    names = [b.name for b in prof.blocks]
    with pytest.raises(remat.InfeasibleBudget) as refused:
        remat.solve(prof, 1)
    return {"name": name, "model": model, "batch": batch, "loss_fn": loss_fn, "grads": plain_grads, "moving": moving,
            "plain": plain, "profile": prof, "smallest": refused.value.smallest_bytes,
            "torch": _torch_every_block(model, names, batch, loss_fn),
            "sensible": _torch_every_block(model, _libs_zoo.SENSIBLE[name], batch, loss_fn) if name in _libs_zoo.SENSIBLE else None,
            "library": _library_checkpointing(model, batch, loss_fn)}


def test_blocks_cover_the_step(case: dict[str, Any]) -> None:
    modules = dict(case["model"].named_modules())
    assert all(b.name in modules for b in case["profile"].blocks)
    assert case["smallest"] is not None and case["smallest"] <= case["torch"] < case["plain"], case
    if case["library"] is not None:
        assert case["smallest"] <= case["library"], case
    if case["sensible"] is not None:  # torch's checkpoint on modules a user would name
        assert case["smallest"] <= case["sensible"], case


@pytest.mark.parametrize("budget", ["60%", "40%", "smallest"])
def test_every_plan_fits_without_verifying(case: dict[str, Any], budget: str) -> None:
    model, batch, loss_fn = case["model"], case["batch"], case["loss_fn"]
    target = case["smallest"] if budget == "smallest" else round(case["plain"] * int(budget[:-1]) / 100)
    if target < case["smallest"]:
        pytest.skip(f"{budget} of the plain peak is below the floor ({target} < {case['smallest']} bytes)")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    plan = remat.solve(case["profile"], target)
    remat.apply(model, plan)
    try:
        measured = _peak(model, batch, loss_fn)
        loss, grads = _grads(model, batch, loss_fn)
    finally:
        remat.remove(model)
    assert plan.estimate is not None
    assert measured <= plan.estimate.peak_bytes and plan.estimate.peak_bytes <= target, (
        measured, plan.estimate.peak_bytes, plan.choices)
    plain_loss, plain_grads = case["grads"]
    assert loss == plain_loss and grads.keys() == plain_grads.keys()
    exact = plan.head == "keep" and "tiled" not in plan.choices.values()
    for n, g in grads.items():
        if exact:
            assert torch.equal(g, plain_grads[n]), n
        else:
            torch.testing.assert_close(g, plain_grads[n], rtol=1e-4, atol=1e-6)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items() if k not in case["moving"])


@pytest.mark.parametrize(("name", "near"), [("fair-esm2", "floor"), ("peft-lora-llama", "floor"),
                                            pytest.param("diffusers-unet", "torch", marks=pytest.mark.slow),  # 20-25 s
                                            pytest.param("perceiver-tied", "tied", marks=pytest.mark.slow)])
def test_auto_below_the_plain_step_plans_near_the_measured_floor(name: str, near: str) -> None:
    """The user's situation: ``auto`` below the plain step, 2% above the floor the measured profile
    names or at the peak of torch's checkpoint on every block, plans from fake tensors without
    running it (NOTE [ The batch's values ] in remat.measure.fake_steps: ESM-2 reads its batch and
    takes ``logits[mask]``, which fake tensors could not, so the plain step ran; transformers'
    Llama built its causal mask on a fake ``arange``, and the lean floor of the LoRA Llama was named
    11% high, refusing this budget; NOTE [ What each kernel allocates ] in remat.measure.tracer:
    diffusers' UNet2D, whose options no real step ran were charged the largest scratch any phase
    showed, was refused torch's every-block peak, 7,325,808 B, naming 7,443,544; NOTE [ Every call of
    a tied module ] in remat.measure.tied: perceiver's tied layers, kept, floored at 9,016,808 B, where
    torch's checkpoint on them besides remat's blocks peaks at 4,719,360, which the plan now meets)."""
    model, batch, loss_fn = _build(name)
    warns = _libs_zoo.WARNS.get(name)
    with pytest.warns(UserWarning, match=warns) if warns else contextlib.nullcontext():
        prof = remat.profile(model, batch, loss_fn=loss_fn, repeats=1)
    with pytest.raises(remat.InfeasibleBudget) as refused:
        remat.solve(prof, 1)
    tied = prof.repeated if near == "tied" else []
    budget = (round(1.02 * refused.value.smallest_bytes) if near == "floor"
              else _torch_every_block(model, [b.name for b in prof.blocks] + tied, batch, loss_fn))
    assert budget < prof.plain_peak_bytes
    with pytest.warns(UserWarning, match=warns) if warns else contextlib.nullcontext():
        plan = remat.auto(model, batch, budget, loss_fn=loss_fn, repeats=1)
    try:
        measured = _peak(model, batch, loss_fn)
    finally:
        remat.remove(model)
    assert not plan.plain_ran and plan.estimate.peak_bytes <= budget and plan.tied == tied
    assert measured <= plan.estimate.peak_bytes, (measured, plan.estimate.peak_bytes, plan.choices)
