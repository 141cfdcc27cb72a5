"""remat's manual tool as a drop-in for torch.utils.checkpoint, side by side.

Each case is written once and run with torch's checkpoint and with remat's (the fixtures
parametrize over the implementation), with the same call: any difference in outputs, gradients,
random numbers, recompute behaviour or errors fails. The cases mirror the behaviours that torch's
own checkpoint tests (test_utils.py, test_autograd.py, the selective-checkpoint tests) exercise;
they are written from those behaviours, not copied. Where remat differs on purpose, the test says
so and checks both sides (BatchNorm: see test_checkpoint.py).
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils import checkpoint as tc
from torch.utils.flop_counter import FlopCounterMode

import remat
from remat.manual.checkpoint import MODES, checkpoint_call
from remat.manual.module_form import checkpoint_module

CKPT: dict[str, Callable[..., Any]] = {"torch": tc.checkpoint, "remat": remat.checkpoint}
SEQ: dict[str, Callable[..., Any]] = {"torch": tc.checkpoint_sequential, "remat": remat.checkpoint_sequential}


def _sac_torch(fn: Any, x: Any, policy: Any, allow: bool = False) -> Any:
    ctx = functools.partial(tc.create_selective_checkpoint_contexts, policy, allow_cache_entry_mutation=allow)
    return tc.checkpoint(fn, x, use_reentrant=False, context_fn=ctx)


def _sac_remat(fn: Any, x: Any, policy: Any, allow: bool = False) -> Any:
    return checkpoint_call(fn, (x,), mode="selective", policy=policy, allow_cache_entry_mutation=allow)


SAC: dict[str, Callable[..., Any]] = {"torch": _sac_torch, "remat": _sac_remat}


@pytest.fixture(params=["torch", "remat"])
def ckpt(request: pytest.FixtureRequest) -> Callable[..., Any]:
    return CKPT[request.param]


@pytest.fixture(params=["torch", "remat"])
def sac(request: pytest.FixtureRequest) -> Callable[..., Any]:
    return SAC[request.param]


def _grads(params: Any) -> list[torch.Tensor]:
    return [p.grad.clone() for p in params]


def _model(p: float = 0.0) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(p), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def _both(case: Callable[[Callable[..., Any]], Any], table: dict[str, Callable[..., Any]] = CKPT) -> list[Any]:
    return [case(impl) for impl in table.values()]


def _assert_same(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    else:
        assert a == b


# --- torch's checkpoint behaviours, run on both -------------------------------------------------


def test_sequential_model_grads_match_plain(ckpt: Callable[..., Any]) -> None:  # test_checkpoint
    model, ref = _model(), _model()
    x = torch.randn(4, 8, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    out = ckpt(model, x, use_reentrant=False)
    out.sum().backward()
    ref(x_ref).sum().backward()
    assert torch.equal(out, ref(x_ref))
    _assert_same(_grads(model.parameters()), _grads(ref.parameters()))
    assert torch.equal(x.grad, x_ref.grad)


def test_module_list_loop(ckpt: Callable[..., Any]) -> None:  # test_checkpoint_module_list
    torch.manual_seed(0)
    layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])
    ref = copy.deepcopy(layers)
    x = torch.randn(2, 8, requires_grad=True)
    h, h_ref = x, x.detach().requires_grad_()
    for layer, layer_ref in zip(layers, ref):
        h, h_ref = ckpt(layer, h, use_reentrant=False), layer_ref(h_ref)
    h.sum().backward()
    h_ref.sum().backward()
    _assert_same(_grads(layers.parameters()), _grads(ref.parameters()))


@pytest.mark.parametrize("preserve", [True, False])
def test_rng_state(preserve: bool) -> None:  # test_checkpoint_rng_cpu, ..._not_preserve_rng_state
    def case(impl: Callable[..., Any]) -> list[torch.Tensor]:
        model = _model(p=0.5)
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
        torch.manual_seed(3)
        impl(model, x, use_reentrant=False, preserve_rng_state=preserve).sum().backward()
        return _grads(model.parameters())

    got_torch, got_remat = _both(case)
    _assert_same(got_torch, got_remat)
    if preserve:  # and both equal the plain step
        model = _model(p=0.5)
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
        torch.manual_seed(3)
        model(x).sum().backward()
        _assert_same(got_remat, _grads(model.parameters()))


def test_non_tensor_inputs_and_outputs(ckpt: Callable[..., Any]) -> None:  # test_checkpoint_non_tensor*
    def fn(a: torch.Tensor, none: None, text: str, k: int, b: torch.Tensor) -> tuple[Any, ...]:
        return a * k + b, none, text, k

    a, b = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    out = ckpt(fn, a, None, "s", 3, b, use_reentrant=False)
    assert out[1:] == (None, "s", 3)
    out[0].sum().backward()
    assert torch.equal(a.grad, torch.full((3,), 3.0)) and torch.equal(b.grad, torch.ones(3))


def test_no_tensor_inputs(ckpt: Callable[..., Any]) -> None:  # test_checkpoint_no_tensors
    w = torch.randn(3, requires_grad=True)
    out = ckpt(lambda k: (w * k).sin(), 2.0, use_reentrant=False)
    out.sum().backward()
    assert torch.allclose(w.grad, 2.0 * (w * 2.0).cos())


def test_partial_grad_and_autograd_grad(ckpt: Callable[..., Any]) -> None:  # test_checkpoint_partial_grad
    a = torch.randn(4, requires_grad=True)
    b = torch.randn(4)  # no grad
    out = ckpt(lambda x, y: (x * y).exp(), a, b, use_reentrant=False)
    (ga,) = torch.autograd.grad(out.sum(), a)
    assert torch.allclose(ga, b * (a * b).exp())


def test_dict_inputs_and_outputs(ckpt: Callable[..., Any]) -> None:  # ..._arbitrary_input_output
    lin = nn.Linear(4, 4)
    out = ckpt(lambda d: {"y": lin(d["x"]), "n": 1}, {"x": torch.randn(2, 4)}, use_reentrant=False)
    assert out["n"] == 1
    out["y"].sum().backward()
    assert lin.weight.grad is not None


def test_nested_checkpoints(ckpt: Callable[..., Any]) -> None:  # test_nested_checkpoint*
    model, ref = _model(), _model()
    x = torch.randn(4, 8)

    def outer(h: torch.Tensor) -> torch.Tensor:
        h = ckpt(model[:3], h, use_reentrant=False)
        return ckpt(model[3:], h, use_reentrant=False)

    ckpt(outer, x, use_reentrant=False).sum().backward()
    ref(x).sum().backward()
    _assert_same(_grads(model.parameters()), _grads(ref.parameters()))


def test_backward_twice_with_retain_graph(ckpt: Callable[..., Any]) -> None:
    model, ref = _model(), _model()
    x = torch.randn(4, 8)
    out, out_ref = ckpt(model, x, use_reentrant=False), ref(x)
    for _ in range(2):
        out.sum().backward(retain_graph=True)
        out_ref.sum().backward(retain_graph=True)
    _assert_same(_grads(model.parameters()), _grads(ref.parameters()))


def test_autocast_cpu(ckpt: Callable[..., Any]) -> None:  # test_checkpointing_non_reentrant_autocast_cpu
    model, ref = _model(), _model()
    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, out_ref = ckpt(model, x, use_reentrant=False), ref(x)
    assert out.dtype == torch.bfloat16 and torch.equal(out, out_ref)
    out.float().sum().backward()
    out_ref.float().sum().backward()
    _assert_same(_grads(model.parameters()), _grads(ref.parameters()))


def _recompute_log(impl: Callable[..., Any], **options: Any) -> list[str]:
    log: list[str] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        y = x.sin()
        log.append("mid")
        z = y.cos()  # the last op that saves a tensor
        log.append("end")
        return z * 2

    impl(fn, torch.randn(3, requires_grad=True), use_reentrant=False, **options).sum().backward()
    return log


def test_early_stop(ckpt: Callable[..., Any]) -> None:  # test_checkpoint_early_stop
    assert _recompute_log(ckpt) == ["mid", "end", "mid"]
    assert _recompute_log(ckpt, early_stop=False) == ["mid", "end", "mid", "end"]
    with tc.set_checkpoint_early_stop(False):
        assert _recompute_log(ckpt, early_stop=True) == ["mid", "end", "mid", "end"]


def _null_contexts() -> tuple[Any, Any]:
    return contextlib.nullcontext(), contextlib.nullcontext()


def _nondeterministic(calls: list[int]) -> Callable[[torch.Tensor], torch.Tensor]:
    def fn(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        n = 3 if len(calls) == 1 else 2  # the recompute saves a tensor of another shape
        return x[:n].sin().sum() + x.sum()

    return fn


def test_determinism_check(ckpt: Callable[..., Any]) -> None:  # test_checkpoint_detects_non_determinism
    x = torch.randn(4, requires_grad=True)
    with pytest.raises(tc.CheckpointError, match="different metadata"):
        ckpt(_nondeterministic([]), x, use_reentrant=False).backward()
    with pytest.raises(ValueError, match="determinism_check should be one of"):
        ckpt(torch.sin, x, use_reentrant=False, determinism_check="bogus")


@pytest.fixture
def quiet_logging_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch's debug mode logs each op to the "LoggingTensor" logger with arguments its message does
    # not format, for its own handler to read; pytest's capture handlers, which this logger reaches
    # in a test, would format them and fail. Here its records go to torch's handler only.
    import logging

    from torch.testing._internal.logging_tensor import LoggingTensorHandler

    logger = logging.getLogger("LoggingTensor")

    def handle(record: logging.LogRecord) -> None:
        if logger.filter(record):
            for handler in logger.handlers:
                if isinstance(handler, LoggingTensorHandler):
                    handler.handle(record)

    monkeypatch.setattr(logger, "handle", handle)


@pytest.mark.usefixtures("quiet_logging_tensor")
@pytest.mark.parametrize("switch", ["debug=True", "set_checkpoint_debug_enabled"])
def test_debug_report(ckpt: Callable[..., Any], switch: str) -> None:  # test_checkpoint_debug
    x = torch.randn(4, requires_grad=True)
    on = switch == "debug=True"
    with contextlib.ExitStack() as stack:
        if not on:
            stack.enter_context(tc.set_checkpoint_debug_enabled(True))
        ok = ckpt(lambda t: t.sin().cos(), x, use_reentrant=False, debug=on)
        ok.sum().backward()  # a deterministic call runs as usual
        assert torch.allclose(x.grad, -(x.sin().sin()) * x.cos())
        with pytest.raises(tc.CheckpointError, match="dumping logs of latest computation"):
            ckpt(_nondeterministic([]), x, use_reentrant=False, debug=on).backward()
        with pytest.raises(ValueError, match="debug=True is incompatible with non-default context_fn"):
            ckpt(torch.sin, x, use_reentrant=False, debug=on, context_fn=_null_contexts)


class _Counting:
    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def __enter__(self) -> None:
        self.log.append(self.name)

    def __exit__(self, *exc: Any) -> None:
        pass


def test_context_fn(ckpt: Callable[..., Any]) -> None:  # test_checkpointing_without_reentrant_with_context_fn
    log: list[str] = []
    out = ckpt(torch.sin, torch.randn(3, requires_grad=True), use_reentrant=False,
               context_fn=lambda: (_Counting(log, "fwd"), _Counting(log, "rec")))
    assert log == ["fwd"]
    out.sum().backward()
    assert log == ["fwd", "rec"]


def test_checkpoint_sequential_semantics() -> None:  # test_checkpoint_sequential*
    def case(impl: Callable[..., Any]) -> tuple[list[int], list[torch.Tensor]]:
        torch.manual_seed(0)
        blocks = [nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.3)) for _ in range(7)]
        calls = [0] * 7
        for i, b in enumerate(blocks):
            b.register_forward_pre_hook(lambda m, a, i=i: calls.__setitem__(i, calls[i] + 1))
        torch.manual_seed(1)
        impl(nn.Sequential(*blocks), 3, torch.randn(4, 8), use_reentrant=False, preserve_rng_state=True).sum().backward()
        return calls, [p.grad for b in blocks for p in b.parameters()]

    (calls_t, grads_t), (calls_r, grads_r) = _both(case, SEQ)
    assert calls_t == calls_r == [2, 2, 2, 2, 1, 1, 1]  # segments of 2, 2 and the rest; the last one plain
    _assert_same(grads_t, grads_r)


def test_reentrant_is_refused_with_the_reason() -> None:
    # torch runs its reentrant variant; remat has none and says why, whatever the grad mode.
    x = torch.randn(3, requires_grad=True)
    assert torch.equal(tc.checkpoint(torch.sin, x, use_reentrant=True), x.sin())
    for ctx in (contextlib.nullcontext(), torch.no_grad()):
        with ctx, pytest.raises(ValueError, match="non-reentrant one .* Pass use_reentrant=False"):
            remat.checkpoint(torch.sin, x, use_reentrant=True)
    with pytest.raises(ValueError, match="use_reentrant=False"):
        remat.checkpoint_sequential([torch.sin], 1, x, use_reentrant=True)


# --- selective checkpointing, on both -----------------------------------------------------------


def _mm_chain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.mm(torch.mm(x, w).relu(), w).sin()


def _backward_flops(sac_impl: Callable[..., Any], policy: Any) -> int:
    x, w = torch.randn(16, 16, requires_grad=True), torch.randn(16, 16, requires_grad=True)
    out = sac_impl(lambda t: _mm_chain(t, w), x, policy)
    with FlopCounterMode(display=False) as counter:
        out.sum().backward()
    return counter.get_total_flops()


def test_selective_keeps_the_listed_ops() -> None:  # test_flops_and_mem
    mm = 2 * 16**3
    assert [_backward_flops(s, [torch.ops.aten.mm.default]) for s in SAC.values()] == [4 * mm] * 2
    assert [_backward_flops(s, []) for s in SAC.values()] == [6 * mm] * 2  # both mms re-run


def test_selective_bad_policies(sac: Callable[..., Any]) -> None:  # test_bad_inputs
    # torch's own regexes for each refusal, so a test written against torch passes on remat.
    x = torch.randn(2, 2, requires_grad=True)
    with pytest.raises(ValueError, match="Expected op in `op_list` to be an OpOverload"):
        sac(torch.sin, x, [2])
    with pytest.raises(ValueError, match="update the OpOverloadPacket to a specific OpOverload"):
        sac(torch.sin, x, [torch.ops.aten.sin])  # a packet: its overloads, never it, reach a policy
    with pytest.raises(TypeError, match="function.*list of ops"):
        sac(torch.sin, x, 3)


def test_selective_packet_message_teaches() -> None:
    with pytest.raises(remat.RematError, match=r"overloads \(default, out, .*e\.g\. torch\.ops\.aten\.sin\.default"):
        checkpoint_call(torch.sin, (torch.randn(2, requires_grad=True),), mode="selective", policy=[torch.ops.aten.sin])


def test_selective_grads_and_outputs(sac: Callable[..., Any]) -> None:  # ..._more_than_one_output
    torch.manual_seed(0)
    x, w = torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    out = sac(lambda t: (_mm_chain(t, w), "tag", t.cos()), x, [torch.ops.aten.mm.default])
    assert out[1] == "tag"
    (out[0].sum() + out[2].sum()).backward()
    x_ref, w_ref = x.detach().requires_grad_(), w.detach().requires_grad_()
    (_mm_chain(x_ref, w_ref).sum() + x_ref.cos().sum()).backward()
    assert torch.equal(x.grad, x_ref.grad) and torch.equal(w.grad, w_ref.grad)


def _mutating(t: torch.Tensor) -> torch.Tensor:
    a = t.sin()  # kept
    b = a * 2
    a.add_(1)  # the kept output changes after it was cached
    return b + a.cos()


@pytest.mark.parametrize("allow", [False, True])
def test_selective_cache_entry_mutation(allow: bool) -> None:  # test_version_counter
    def case(sac_impl: Callable[..., Any]) -> Any:
        x = torch.randn(4, generator=torch.Generator().manual_seed(0), requires_grad=True)
        out = sac_impl(_mutating, x, [torch.ops.aten.sin.default], allow)
        try:
            out.sum().backward()
        except RuntimeError as e:
            return str(e)
        return x.grad

    got_torch, got_remat = _both(case, SAC)
    if not allow:
        assert "has been mutated" in got_torch
    _assert_same(got_torch, got_remat)


def test_selective_backward_only_once(sac: Callable[..., Any]) -> None:  # test_can_only_trigger_recompute_once
    x = torch.randn(4, 4, requires_grad=True)
    out = sac(lambda t: torch.mm(t, t).sin(), x, [torch.ops.aten.mm.default])
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward an extra time"):
        out.sum().backward()


# --- one rule in every path: grad on, no_grad, inference_mode, eval, every mode --------------


OPTIONS = [
    {"use_reentrant": False},
    {"preserve_rng_state": False},
    {"determinism_check": "none"},
    {"debug": True},
    {"early_stop": False},
    {"context_fn": tc.noop_context_fn},
    {"context_fn": _null_contexts},
]
CONTEXTS = ["grad", "no_grad", "inference_mode", "eval"]


def _in(context: str, layer: nn.Module) -> contextlib.AbstractContextManager[Any]:
    layer.train(context != "eval")
    if context == "no_grad":
        return torch.no_grad()
    if context == "inference_mode":
        return torch.inference_mode()
    return contextlib.nullcontext()


class Strict(nn.Module):
    """A layer whose forward takes no option keywords: one reaching it is a TypeError."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).tanh()


@pytest.mark.usefixtures("quiet_logging_tensor")
@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("option", OPTIONS, ids=lambda o: next(iter(o)))
@pytest.mark.parametrize("mode", MODES)
def test_each_option_means_the_same_in_every_path(context: str, option: dict[str, Any], mode: str) -> None:
    torch.manual_seed(0)
    layer = Strict()
    x = torch.randn(2, 4)
    with _in(context, layer):
        expected = layer(x)
        via_remat = checkpoint_call(layer, (x,), mode=mode, **option)
        if mode == "recompute":
            via_remat_checkpoint = remat.checkpoint(layer, x, **option)
            via_torch = tc.checkpoint(layer, x, **{"use_reentrant": False, **option})
            assert torch.equal(via_remat_checkpoint, expected) and torch.equal(via_torch, expected)
    assert torch.equal(via_remat, expected)
    if context == "grad":
        via_remat.sum().backward()
        assert layer.lin.weight.grad is not None


@pytest.mark.parametrize("context", CONTEXTS)
def test_bad_options_are_refused_in_every_path(context: str) -> None:
    layer = Strict()
    x = torch.randn(2, 4)
    with _in(context, layer):
        for impl in CKPT.values():
            with pytest.raises(ValueError, match="determinism_check should be one of"):
                impl(layer, x, use_reentrant=False, determinism_check="bogus")
            with pytest.raises(ValueError, match="debug=True is incompatible"):
                impl(layer, x, use_reentrant=False, debug=True, context_fn=_null_contexts)
        with pytest.raises(ValueError, match="Pass use_reentrant=False"):
            remat.checkpoint(layer, x, use_reentrant=True)
        with pytest.raises(TypeError, match="preserve_rng_state must be True or False"):
            remat.checkpoint(layer, x, preserve_rng_state="yes")
        with pytest.raises(ValueError, match="OpOverload"):
            checkpoint_call(layer, (x,), mode="selective", policy=[2])


def _plus(x: torch.Tensor, early_stop: bool = False) -> torch.Tensor:
    return x + 1 + early_stop


@pytest.mark.parametrize("context", CONTEXTS)
def test_a_keyword_of_fn_named_like_a_torch_option(context: str) -> None:
    # The silent wrong value: torch takes early_stop=True for itself, so fn sees False.
    x = torch.zeros(2, requires_grad=context != "inference_mode")
    assert torch.equal(tc.checkpoint(_plus, x, use_reentrant=False, early_stop=True), torch.ones(2))
    layer = Strict()
    with _in(context, layer):
        with pytest.raises(TypeError, match="_plus also has a parameter 'early_stop'.*checkpoint_call"):
            remat.checkpoint(_plus, x, early_stop=True)
        for mode in MODES:
            assert torch.equal(checkpoint_call(_plus, (x,), {"early_stop": True}, mode=mode), torch.full((2,), 2.0))
    # A keyword that is not a torch option goes to fn, and a module's own keywords to its forward.
    assert torch.equal(remat.checkpoint(lambda t, scale: t * scale, torch.ones(2), scale=3.0), torch.full((2,), 3.0))

    class WithOption(nn.Module):
        def forward(self, t: torch.Tensor, early_stop: bool = False) -> torch.Tensor:
            return t + early_stop

    assert torch.equal(checkpoint_module(WithOption())(x, early_stop=True), x + 1)
    with pytest.raises(TypeError, match="WithOption also has a parameter 'early_stop'"):
        remat.checkpoint(WithOption(), x, early_stop=True)


# --- torch's options composed with remat's own modes ----------------------------------------


def test_context_fn_composes_with_remat_selective() -> None:
    log: list[str] = []
    x, w = torch.randn(16, 16, requires_grad=True), torch.randn(16, 16, requires_grad=True)
    out = checkpoint_call(lambda t: _mm_chain(t, w), (x,), mode="selective", policy=[torch.ops.aten.mm.default],
                          context_fn=lambda: (_Counting(log, "fwd"), _Counting(log, "rec")))
    with FlopCounterMode(display=False) as counter:
        out.sum().backward()
    assert log == ["fwd", "rec"]
    assert counter.get_total_flops() == 4 * 2 * 16**3  # the mms kept: nothing of them re-run


@pytest.mark.usefixtures("quiet_logging_tensor")
@pytest.mark.parametrize("mode", ["recompute", "selective", "recompute_offload"])
def test_global_debug_switch_with_every_mode(mode: str) -> None:
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Tanh())
    ref = copy.deepcopy(block)
    checkpoint_module(block, mode=mode)
    x = torch.randn(4, 8)
    with tc.set_checkpoint_debug_enabled(True):
        block(x).sum().backward()
        with pytest.raises(tc.CheckpointError, match="dumping logs of latest computation"):
            checkpoint_call(_nondeterministic([]), (torch.randn(4, requires_grad=True),), mode=mode).backward()
    ref(x).sum().backward()
    _assert_same(_grads(block.parameters()), _grads(ref.parameters()))
    assert int(block[1].num_batches_tracked) == 1
