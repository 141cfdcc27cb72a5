"""GradNorm: the step's numbers against plain PyTorch (the paper's literal create_graph=True form),
checkpointed trunks, state round trips, input errors, and the paper's synthetic experiment."""

from __future__ import annotations

import importlib.util
import io
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from remat.gradnorm import GradNorm

_BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "gradnorm_synthetic.py"


def _load_benchmark() -> ModuleType:
    # The test asserts on the very experiment that the benchmark plots, so it imports the script.
    spec = importlib.util.spec_from_file_location("gradnorm_synthetic", _BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while building classes
    spec.loader.exec_module(module)
    return module


bench = _load_benchmark()

# Small dims for the unit tests; the experiment below uses the paper's input size.
DIMS = dict(in_dim=12, out_dim=5, hidden=16)
SIGMAS = (1.0, 4.0, 20.0)


@pytest.fixture
def one_thread() -> Iterator[None]:
    # Tiny ops: on a shared 2-core runner extra threads only add spin-wait overhead.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _task_losses(model: nn.Module, x: Tensor, y: Tensor) -> list[Tensor]:
    return [nn.functional.mse_loss(out, target) for out, target in zip(model(x), y)]


def _make(seed: int = 0, *, checkpoint_trunk: bool = False) -> tuple[Any, Any]:
    torch.manual_seed(seed)
    model = bench.TaskNet(len(SIGMAS), checkpoint_trunk=checkpoint_trunk, **DIMS)
    tasks = bench.SyntheticTasks(SIGMAS, seed=seed, in_dim=DIMS["in_dim"], out_dim=DIMS["out_dim"])
    return model, tasks


def _train(
    model: nn.Module, tasks: Any, gn: GradNorm, steps: int, *, lr: float = 1e-2
) -> list[Tensor]:
    """``steps`` steps of SGD + GradNorm; the weights after each step."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    history = []
    for _ in range(steps):
        x, y = tasks.batch(32)
        gn.backward(_task_losses(model, x, y))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        gn.step()
        history.append(gn.weights)
    return history


def _literal_step(
    weights: Tensor, initial: Tensor, alpha: float, losses: list[Tensor], shared: list[Tensor]
) -> tuple[Tensor, Tensor]:
    """The paper's formulation, written out: G_i = ||grad_W (w_i L_i)|| with create_graph=True
    (a double backward through the trunk), L_grad = sum |G_i - const target_i|, grad wrt w only.
    Returns (L_grad, dL_grad/dw)."""
    w = weights.clone().requires_grad_(True)
    norms = []
    for i, loss in enumerate(losses):
        grads = torch.autograd.grad(w[i] * loss, shared, retain_graph=True, create_graph=True)
        norms.append(torch.sqrt(sum((g * g).sum() for g in grads)))  # type: ignore[arg-type]
    grad_norms = torch.stack(norms)
    ratios = torch.stack(losses).detach() / initial
    target = (grad_norms.mean() * (ratios / ratios.mean()) ** alpha).detach()
    grad_loss = (grad_norms - target).abs().sum()
    (weight_grad,) = torch.autograd.grad(grad_loss, [w])
    return grad_loss.detach(), weight_grad


# --- the step, against plain PyTorch ---------------------------------------------------------


def test_model_grads_are_those_of_the_weighted_sum() -> None:
    model, tasks = _make()
    gn = GradNorm(len(SIGMAS), model.last_shared_weight(), alpha=1.5)
    _train(model, tasks, gn, steps=5)  # weights away from 1
    weights = gn.weights
    assert not torch.allclose(weights, torch.ones_like(weights))
    x, y = tasks.batch(32)

    total = gn.backward(_task_losses(model, x, y))
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    losses = _task_losses(model, x, y)
    expected_total = (weights * torch.stack(losses)).sum()
    expected_total.backward()

    assert not total.requires_grad
    torch.testing.assert_close(total, expected_total.detach())
    assert got.keys() == {n for n, _ in model.named_parameters()}
    for name, param in model.named_parameters():
        torch.testing.assert_close(got[name], param.grad, msg=name)


@pytest.mark.parametrize("checkpoint_trunk", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("shared", ["last_layer", "whole_trunk"])
def test_weight_grad_matches_the_papers_double_backward(
    checkpoint_trunk: bool, shared: str
) -> None:
    model, tasks = _make(checkpoint_trunk=checkpoint_trunk)
    params = (
        [model.last_shared_weight()] if shared == "last_layer" else list(model.trunk.parameters())
    )
    alpha = 0.7
    gn = GradNorm(len(SIGMAS), params, alpha=alpha)
    data_state = tasks._gen.get_state()
    x0, y0 = tasks.batch(32)
    initial = torch.stack(_task_losses(model, x0, y0)).detach()  # L_i(0), by hand
    tasks._gen.set_state(data_state)  # replay the same first batch inside _train
    _train(model, tasks, gn, steps=6)  # unequal weights, and L_i(t) != L_i(0)
    x, y = tasks.batch(32)

    expected_loss, expected_grad = _literal_step(
        gn.weights, initial, alpha, _task_losses(model, x, y), params
    )
    gn.backward(_task_losses(model, x, y))
    got = gn._weights.grad  # private: the one place the weights' gradient is visible

    assert got is not None
    assert (expected_grad != 0).all()
    torch.testing.assert_close(got, expected_grad, rtol=1e-5, atol=1e-6)
    # L_grad itself depends smoothly on alpha and on L_i(0), which the gradient's signs may hide
    torch.testing.assert_close(gn.grad_loss, expected_loss, rtol=1e-5, atol=1e-6)


def test_first_step_by_hand() -> None:
    # Step 0: all ratios are 1, so every target is mean(G); Adam's first step moves each weight by
    # lr * sign(its gradient) = lr * sign(G_i - mean G); then the weights are rescaled to sum to T.
    model, tasks = _make()
    lr = 0.05
    gn = GradNorm(len(SIGMAS), model.last_shared_weight(), alpha=1.5, lr=lr)
    x, y = tasks.batch(32)
    norms = torch.stack(
        [
            torch.autograd.grad(loss, model.last_shared_weight(), retain_graph=True)[0].norm()
            for loss in _task_losses(model, x, y)
        ]
    )
    gn.backward(_task_losses(model, x, y))
    gn.step()

    raw = 1 - lr * torch.sign(norms - norms.mean())
    expected = raw * len(SIGMAS) / raw.sum()
    torch.testing.assert_close(gn.weights, expected)
    # the task with the largest sigma has the largest gradient, so it lost weight
    assert gn.weights.argmin().item() == len(SIGMAS) - 1
    torch.testing.assert_close(gn.initial_losses, torch.stack(_task_losses(model, x, y)).detach())


def test_weights_stay_positive_and_sum_to_num_tasks() -> None:
    model, tasks = _make()
    # A huge learning rate drives the small weights through zero: the floor must catch them.
    gn = GradNorm(len(SIGMAS), model.last_shared_weight(), lr=5.0)
    history = torch.stack(_train(model, tasks, gn, steps=10))
    assert (history > 0).all(), history
    torch.testing.assert_close(history.sum(dim=1), torch.full((10,), float(len(SIGMAS))))
    assert history.min() < 1e-2  # the floor was actually reached, or the test proves nothing


# --- checkpointing ----------------------------------------------------------------------------


@pytest.mark.parametrize("shared", ["last_layer", "whole_trunk"])
def test_checkpointed_trunk_gives_the_same_trajectory(shared: str) -> None:
    runs = []
    for checkpoint_trunk in (False, True):
        model, tasks = _make(seed=3, checkpoint_trunk=checkpoint_trunk)
        params = (
            [model.last_shared_weight()]
            if shared == "last_layer"
            else list(model.trunk.parameters())
        )
        gn = GradNorm(len(SIGMAS), params, alpha=1.5, lr=0.05)
        runs.append((torch.stack(_train(model, tasks, gn, steps=25)), model))
    (plain, plain_model), (ckpt, ckpt_model) = runs

    assert plain.std(dim=1).min() > 0.05  # the weights did move apart
    torch.testing.assert_close(ckpt, plain, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(plain_model.named_parameters(), ckpt_model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=name)


# --- state ------------------------------------------------------------------------------------


def test_state_dict_round_trip() -> None:
    model, tasks = _make()
    gn = GradNorm(len(SIGMAS), model.last_shared_weight(), alpha=0.5)
    _train(model, tasks, gn, steps=4)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "gradnorm": gn.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer)  # weights_only: the state holds tensors and plain values only

    model2, _ = _make(seed=1)
    model2.load_state_dict(saved["model"])
    gn2 = GradNorm(len(SIGMAS), model2.last_shared_weight(), alpha=1.5)
    gn2.load_state_dict(saved["gradnorm"])
    assert gn2.alpha == 0.5
    torch.testing.assert_close(gn2.weights, gn.weights)
    torch.testing.assert_close(gn2.initial_losses, gn.initial_losses)

    # Both continue identically: same data stream, same Adam moments.
    tasks2 = bench.SyntheticTasks(SIGMAS, seed=0, in_dim=DIMS["in_dim"], out_dim=DIMS["out_dim"])
    tasks2._gen.set_state(tasks._gen.get_state())
    after = torch.stack(_train(model, tasks, gn, steps=4))
    after2 = torch.stack(_train(model2, tasks2, gn2, steps=4))
    torch.testing.assert_close(after2, after)
    # a fresh GradNorm (no Adam moments, no L_i(0)) would not follow the same path
    model3, _ = _make(seed=1)
    model3.load_state_dict(saved["model"])
    tasks2._gen.set_state(tasks._gen.get_state())
    fresh = torch.stack(
        _train(model3, tasks2, GradNorm(len(SIGMAS), model3.last_shared_weight()), 4)
    )
    assert not torch.allclose(fresh, after)


# --- errors -----------------------------------------------------------------------------------


def _param() -> nn.Parameter:
    return nn.Parameter(torch.ones(3))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(num_tasks=1), ValueError, r"num_tasks must be an int >= 2.*got 1"),
        (dict(num_tasks=2.0), ValueError, r"num_tasks must be an int >= 2.*got 2.0"),
        (dict(alpha=-0.1), ValueError, r"alpha must be .* >= 0.*got -0.1"),
        (dict(lr=0.0), ValueError, r"lr must be .* > 0.*got 0.0"),
        (dict(shared_params=[]), ValueError, r"shared_params is empty; pass"),
        (
            dict(shared_params=torch.ones(3)),
            ValueError,
            r"shared_params\[0\] \(shape \(3,\)\) does not require grad",
        ),
        (dict(shared_params=["w"]), TypeError, r"shared_params\[0\] must be a tensor, got str"),
    ],
)
def test_constructor_errors(kwargs: dict, error: type[Exception], match: str) -> None:
    args = dict(num_tasks=2, shared_params=_param()) | kwargs
    num_tasks, shared = args.pop("num_tasks"), args.pop("shared_params")
    with pytest.raises(error, match=match):
        GradNorm(num_tasks, shared, **args)


def test_backward_errors() -> None:
    w = _param()
    gn = GradNorm(2, w)
    loss = (w * 2).sum()
    with pytest.raises(ValueError, match=r"expected 2 task losses \(num_tasks=2\), got 3"):
        gn.backward([loss, loss, loss])
    with pytest.raises(TypeError, match=r"sequence .* of 2 scalar tensors, got Tensor"):
        gn.backward(torch.stack([loss, loss]))  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"loss 1 must be a scalar \(0-dim\) tensor, got shape \(3,\); .*mean\(\)"
    ):
        gn.backward([loss, w * 2])
    with pytest.raises(ValueError, match=r"loss 0 does not require grad"):
        gn.backward([loss.detach(), loss])
    other = nn.Parameter(torch.ones(()))
    with pytest.raises(ValueError, match=r"loss 1 does not depend on every shared parameter"):
        gn.backward([loss, other * 3])
    with pytest.raises(ValueError, match=r"L_i\(0\) and must be finite and > 0.*got \[6.0, 0.0\]"):
        gn.backward([loss, (w * 0).sum()])
    with pytest.raises(RuntimeError, match=r"step\(\) called before GradNorm.backward"):
        gn.step()
    # a failed backward changes nothing: L_i(0) is still to be recorded, no weight gradient
    assert gn.initial_losses is None and gn.grad_loss is None and w.grad is None


def test_load_state_dict_errors() -> None:
    state = GradNorm(2, _param()).state_dict()
    with pytest.raises(
        ValueError, match=r"state is for 2 tasks, this GradNorm has 3; .*num_tasks=2"
    ):
        GradNorm(3, _param()).load_state_dict(state)
    with pytest.raises(ValueError, match=r"version 99, this remat reads version 1"):
        GradNorm(2, _param()).load_state_dict(state | {"version": 99})


# --- the paper's synthetic experiment (Section 4) --------------------------------------------

EXPERIMENT = dict(sigmas=bench.default_sigmas(6), steps=500, out_dim=20, seed=0)


@pytest.fixture(scope="module")
def experiment() -> dict[str, object]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {
            "gradnorm": bench.run(method="gradnorm", alpha=0.12, **EXPERIMENT),
            "equal": bench.run(method="equal", **EXPERIMENT),
        }
    finally:
        torch.set_num_threads(before)


def test_weights_are_ordered_inversely_to_sigma(experiment: dict) -> None:
    final = experiment["gradnorm"].weights[-1]
    # sigmas rise, so weights must fall strictly (Spearman = -1); measured ~[3.0 ... 0.05]
    assert (final[1:] < final[:-1]).all(), final
    torch.testing.assert_close(final.sum(), torch.tensor(6.0))
    # ~ 1/sigma: the sigma = 100 task's weight is far below the sigma = 1 task's (measured ~60x)
    assert final[0] / final[-1] > 10, final


def test_normalised_losses_come_together(experiment: dict) -> None:
    last = 50
    gradnorm = bench.normalised_spread(experiment["gradnorm"].normalised_losses, last=last)
    equal = bench.normalised_spread(experiment["equal"].normalised_losses, last=last)
    # measured 0.095 vs 0.215 (ratio 0.44; 0.39-0.52 over seeds 0-3 and alpha 0.12-1.5)
    assert gradnorm < 0.7 * equal, (gradnorm, equal)
    # and the slowest task under equal weights (sigma = 1) is pulled down by GradNorm
    final_gn = experiment["gradnorm"].normalised_losses[-last:].mean(dim=0)
    final_eq = experiment["equal"].normalised_losses[-last:].mean(dim=0)
    assert final_gn[0] < final_eq[0] - 0.1, (final_gn, final_eq)


def test_benchmark_script_writes_the_png(tmp_path: Path, one_thread: None) -> None:
    pytest.importorskip("matplotlib")
    assert bench.main(["--out", str(tmp_path), "--tasks", "3", "--steps", "30"]) == 0
    png = tmp_path / "gradnorm_synthetic.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
