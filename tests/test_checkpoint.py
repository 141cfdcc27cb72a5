"""The manual tool against plain PyTorch: every output and gradient compared, bit for bit on CPU."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import remat
from remat.errors import BlockError
from remat.manual.checkpoint import checkpoint_call
from remat.manual.module_form import checkpoint_module, is_checkpointed, uncheckpoint_module


def _grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def _assert_same_grads(a: nn.Module, b: nn.Module) -> None:
    ga, gb = _grads(a), _grads(b)
    assert ga.keys() == gb.keys() and ga
    for name in ga:
        assert torch.equal(ga[name], gb[name]), name


class Layer(nn.Module):
    def __init__(self, d: int = 16, p: float = 0.0) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        return self.drop(torch.tanh(self.lin(x))) * scale


def test_pseudocode_from_the_seed_runs_as_written() -> None:
    torch.manual_seed(0)
    layers = nn.ModuleList([Layer(p=0.1) for _ in range(5)])
    plain = copy.deepcopy(layers)
    x = torch.randn(4, 16)

    def run(ls: nn.ModuleList, ckpt: bool) -> torch.Tensor:
        x1 = ls[0](x)
        x2 = ls[1](x1)
        x3 = remat.checkpoint(ls[2], x2) if ckpt else ls[2](x2)
        x4 = ls[3](x3)
        return ls[4](x4).square().mean()

    torch.manual_seed(1)
    loss_a = run(layers, True)
    loss_a.backward()
    torch.manual_seed(1)
    loss_b = run(plain, False)
    loss_b.backward()
    assert torch.equal(loss_a, loss_b)
    _assert_same_grads(layers, plain)


def test_dropout_recompute_sees_the_same_random_numbers() -> None:
    torch.manual_seed(0)
    layer = Layer(p=0.5)
    ref = copy.deepcopy(layer)
    x = torch.randn(32, 16, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    torch.manual_seed(7)
    remat.checkpoint(layer, x).sum().backward()
    torch.manual_seed(7)
    ref(x_ref).sum().backward()
    assert torch.equal(x.grad, x_ref.grad)
    _assert_same_grads(layer, ref)


def test_batchnorm_running_stats_updated_once() -> None:
    torch.manual_seed(0)
    block = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
    ref = copy.deepcopy(block)
    x = torch.randn(8, 3, 6, 6)
    for _ in range(3):
        remat.checkpoint(block, x).sum().backward()
        ref(x).sum().backward()
    bn, bn_ref = block[1], ref[1]
    assert int(bn.num_batches_tracked) == int(bn_ref.num_batches_tracked) == 3
    assert torch.equal(bn.running_mean, bn_ref.running_mean)
    assert torch.equal(bn.running_var, bn_ref.running_var)
    _assert_same_grads(block, ref)
    # and the flag is back on after the recompute
    assert bn.track_running_stats


def test_plain_torch_checkpoint_updates_batchnorm_twice() -> None:
    # The bug remat fixes (pytorch issue 96136): if torch ever fixes it, this test tells us.
    bn = nn.BatchNorm1d(4)
    x = torch.randn(8, 4)
    torch_checkpoint(bn, x, use_reentrant=False).sum().backward()
    assert int(bn.num_batches_tracked) == 2



# --- a buffer the forward writes (NOTE [ A buffer the forward writes ] in remat.manual.buffer_writes) --


class EmaCodebook(nn.Module):
    """vector-quantize-pytorch's EMA codebook, reduced: the forward quantizes with the codebook and
    then moves it towards the batch (a write every call)."""

    def __init__(self, d: int = 16, k: int = 8) -> None:
        super().__init__()
        self.proj = nn.Linear(d, d)
        self.register_buffer("embed", torch.randn(k, d))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        z = self.proj(z)
        idx = torch.cdist(z, self.embed).argmin(-1)
        q = self.embed[idx]
        if self.training:
            with torch.no_grad():
                self.embed.mul_(0.9).index_add_(0, idx, 0.1 * z.detach() / z.shape[0])
        return z + (q - z).detach() + (q - z).pow(2).mean()


class FilledOnce(nn.Module):
    """rotary-embedding-torch's table, reduced: the first call fills a cache the later ones read."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.register_buffer("cached", torch.zeros(d))
        self.register_buffer("filled", torch.tensor(False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.filled:
            self.cached.copy_(torch.linspace(0, 1, self.cached.numel()))
            self.filled.fill_(True)
        return torch.tanh(self.lin(x)) * self.cached


@pytest.mark.parametrize("form", ["module", "call"])
def test_a_forward_that_writes_a_buffer_every_call_stops_the_backward(form: str) -> None:
    torch.manual_seed(0)
    ema = EmaCodebook()
    plain = copy.deepcopy(ema)
    x = torch.randn(32, 16)
    plain(x)  # the buffer after one forward, as the plain step leaves it
    if form == "module":
        checkpoint_module(ema)
        out = ema(x)
    else:
        out = remat.checkpoint(ema, x)
    with pytest.raises(BlockError, match=r"EmaCodebook changed the buffer EmaCodebook.embed in place in "
                                               r"its forward and again in its recompute.*Checkpoint the modules around it"):
        out.sum().backward()
    assert torch.equal(ema.embed, plain.embed)  # moved once, as by the plain forward


def test_a_forward_that_fills_a_cache_once_is_replayed_as_the_plain_step_runs() -> None:
    torch.manual_seed(0)
    block = FilledOnce()
    plain = copy.deepcopy(block)
    checkpoint_module(block)
    x = torch.randn(8, 16)
    for _ in range(2):  # the first call fills the cache inside the checkpoint, the second reads it
        block(x).sum().backward()
        plain(x).sum().backward()
    _assert_same_grads(block, plain)
    assert torch.equal(block.cached, plain.cached) and bool(block.filled)


def test_plain_torch_checkpoint_replays_an_ema_on_its_changed_values() -> None:
    # The trap remat stops on: if torch ever refuses or fixes it, this test tells us.
    torch.manual_seed(0)
    ema = EmaCodebook()
    plain = copy.deepcopy(ema)
    x = torch.randn(32, 16)
    torch_checkpoint(ema, x, use_reentrant=False).sum().backward()
    plain(x).sum().backward()
    assert not torch.equal(ema.embed, plain.embed)  # moved twice
    assert not torch.equal(ema.proj.weight.grad, plain.proj.weight.grad)

def test_autocast_bf16() -> None:
    torch.manual_seed(0)
    layer = Layer()
    ref = copy.deepcopy(layer)
    x = torch.randn(8, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = remat.checkpoint(layer, x)
        out_ref = ref(x)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, out_ref)
    out.float().sum().backward()
    out_ref.float().sum().backward()
    _assert_same_grads(layer, ref)


def test_bf16_parameters() -> None:
    torch.manual_seed(0)
    layer = Layer().to(torch.bfloat16)
    ref = copy.deepcopy(layer)
    x = torch.randn(8, 16, dtype=torch.bfloat16)
    remat.checkpoint(layer, x).float().sum().backward()
    ref(x).float().sum().backward()
    _assert_same_grads(layer, ref)


def test_keyword_arguments_reach_the_function() -> None:
    torch.manual_seed(0)
    layer = Layer()
    ref = copy.deepcopy(layer)
    x = torch.randn(4, 16)
    out = remat.checkpoint(layer, x, scale=3.0)
    assert torch.equal(out, ref(x, scale=3.0))
    out.sum().backward()
    ref(x, scale=3.0).sum().backward()
    _assert_same_grads(layer, ref)


def test_nested_and_non_tensor_arguments_and_outputs() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)
    ref = copy.deepcopy(lin)

    def fn(m: nn.Module, inputs: dict, pair: tuple, tag: str, k: int) -> dict:
        h = m(inputs["x"]) + pair[0] * k
        return {"h": h, "parts": (h.sum(), tag), "count": k}

    x, y = torch.randn(3, 8), torch.randn(3, 8, requires_grad=True)
    y_ref = y.detach().clone().requires_grad_()
    out = remat.checkpoint(fn, lin, {"x": x}, (y, None), "tag", 2)
    out_ref = fn(ref, {"x": x}, (y_ref, None), "tag", 2)
    assert out["parts"][1] == "tag" and out["count"] == 2
    assert torch.equal(out["h"], out_ref["h"])
    (out["h"].square().sum() + out["parts"][0]).backward()
    (out_ref["h"].square().sum() + out_ref["parts"][0]).backward()
    assert torch.equal(y.grad, y_ref.grad)
    _assert_same_grads(lin, ref)


def test_frozen_input_trainable_parameters() -> None:
    # LoRA-style: the input comes from a frozen embedding (no grad), the layer's weights train.
    torch.manual_seed(0)
    emb = nn.Embedding(10, 16).requires_grad_(False)
    layer = Layer()
    ref = copy.deepcopy(layer)
    ids = torch.randint(0, 10, (4, 5))
    h = emb(ids)
    assert not h.requires_grad
    out = remat.checkpoint(layer, h)
    assert out.requires_grad
    out.sum().backward()
    ref(h).sum().backward()
    _assert_same_grads(layer, ref)


def test_double_backward() -> None:
    torch.manual_seed(0)
    layer = Layer()
    ref = copy.deepcopy(layer)
    x = torch.randn(4, 16, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    (g,) = torch.autograd.grad(remat.checkpoint(layer, x).sum(), x, create_graph=True)
    (g_ref,) = torch.autograd.grad(ref(x_ref).sum(), x_ref, create_graph=True)
    assert torch.equal(g, g_ref)
    g.square().sum().backward()
    g_ref.square().sum().backward()
    assert torch.equal(x.grad, x_ref.grad)
    _assert_same_grads(layer, ref)


@pytest.mark.parametrize("context", ["no_grad", "inference_mode", "eval"])
def test_no_grad_inference_and_eval_run_plainly(context: str, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    import remat.manual.checkpoint as ck

    monkeypatch.setattr(ck, "_torch_checkpoint", lambda *a, **k: calls.append(1))
    layer = Layer()
    x = torch.randn(2, 16)
    if context == "no_grad":
        with torch.no_grad():
            out = remat.checkpoint(layer, x)
    elif context == "inference_mode":
        with torch.inference_mode():
            out = remat.checkpoint(layer, x)
    else:
        layer.eval()
        out = remat.checkpoint(layer, x)
    assert calls == []
    assert torch.equal(out, layer(x))
    layer.train()
    remat.checkpoint(layer, x)
    assert calls == [1]


def test_selective_mode_keeps_matmul_outputs_and_matches() -> None:
    torch.manual_seed(0)
    layer = Layer(p=0.2)
    ref = copy.deepcopy(layer)
    x = torch.randn(8, 16, requires_grad=True)
    torch.manual_seed(3)
    checkpoint_call(layer, (x,), mode="selective").sum().backward()
    torch.manual_seed(3)
    x_ref = x.detach().clone().requires_grad_()
    ref(x_ref).sum().backward()
    assert torch.equal(x.grad, x_ref.grad)
    _assert_same_grads(layer, ref)


def test_offload_modes_match_on_cpu() -> None:
    torch.manual_seed(0)
    for mode in ("offload", "recompute_offload"):
        layer = Layer()
        ref = copy.deepcopy(layer)
        x = torch.randn(8, 16)
        checkpoint_call(layer, (x,), mode=mode).sum().backward()
        ref(x).sum().backward()
        _assert_same_grads(layer, ref)


def test_checkpoint_sequential_matches_and_checks_segments() -> None:
    torch.manual_seed(0)
    seq = nn.Sequential(*[Layer(p=0.1) for _ in range(6)])
    ref = copy.deepcopy(seq)
    x = torch.randn(4, 16)
    for checkpoint_last in (False, True):
        seq.zero_grad()
        ref.zero_grad()
        torch.manual_seed(5)
        remat.checkpoint_sequential(seq, 3, x, checkpoint_last=checkpoint_last).sum().backward()
        torch.manual_seed(5)
        ref(x).sum().backward()
        _assert_same_grads(seq, ref)
    with pytest.raises(ValueError, match="between 1 and the number of blocks \\(6\\), got 7"):
        remat.checkpoint_sequential(seq, 7, x)
    with pytest.raises(ValueError, match="got 0"):
        remat.checkpoint_sequential(seq, 0, x)
    with pytest.raises(ValueError, match="no blocks"):
        remat.checkpoint_sequential([], 1, x)


def test_checkpoint_sequential_keeps_only_segment_inputs() -> None:
    from remat.measure.step_memory import measure_step

    torch.manual_seed(0)
    seq = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(8)])
    x = torch.randn(32, 64)

    class Wrap(nn.Module):
        def __init__(self, segments: int | None) -> None:
            super().__init__()
            self.seq, self.segments = seq, segments

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.segments is None:
                return self.seq(x)
            return remat.checkpoint_sequential(self.seq, self.segments, x, checkpoint_last=True)

    act = 32 * 64 * 4
    plain = measure_step(Wrap(None), x, loss_fn=lambda o, b: o.sum(), repeats=0)
    seg = measure_step(Wrap(2), x, loss_fn=lambda o, b: o.sum(), repeats=0)
    assert plain.kept_bytes == 8 * act + 4  # each ReLU output, plus the loss
    # two segments: the second one's input, the RNG states stashed for replay, and the loss
    rng = torch.get_rng_state().numel()
    assert seg.kept_bytes == act + 2 * rng + 4


def test_misuse_errors() -> None:
    with pytest.raises(TypeError, match="not remat.checkpoint\\(x, layer\\)"):
        remat.checkpoint(torch.randn(2), Layer())
    with pytest.raises(ValueError, match="expected one of recompute, selective"):
        checkpoint_call(Layer(), (torch.randn(2, 16),), mode="fast")
    with pytest.raises(ValueError, match="policy= applies to mode='selective' only"):
        checkpoint_call(Layer(), (torch.randn(2, 16),), policy=[])
    with pytest.raises(TypeError, match="expects an nn.Module"):
        checkpoint_module(lambda x: x)  # type: ignore[arg-type]


def test_module_form_keeps_names_and_round_trips() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(Layer(p=0.1), nn.BatchNorm1d(16), Layer())
    ref = copy.deepcopy(model)
    keys = list(model.state_dict())
    names = [n for n, _ in model.named_modules()]
    for m in model:
        checkpoint_module(m)
    assert list(model.state_dict()) == keys
    assert [n for n, _ in model.named_modules()] == names
    assert is_checkpointed(model[0]) == "recompute"
    x = torch.randn(8, 16)
    for _ in range(2):
        torch.manual_seed(2)
        model(x).sum().backward()
        torch.manual_seed(2)
        ref(x).sum().backward()
    _assert_same_grads(model, ref)
    assert torch.equal(model[1].running_mean, ref[1].running_mean)
    assert int(model[1].num_batches_tracked) == 2
    for m in model:
        uncheckpoint_module(m)
        assert is_checkpointed(m) is None
        assert "forward" not in m.__dict__


def test_every_block_checkpointing_on_the_builtin_gpt() -> None:
    # Measured here: kept 32.8 MB -> 2.4 MB (-92.7%), peak 37.2 MB -> 15.6 MB (-58.1%).
    from remat import models
    from remat.measure.step_memory import measure_step

    torch.manual_seed(0)
    cfg = models.GPTConfig(n_layer=4, n_embd=128, n_head=4, block_size=128, vocab_size=256, dropout=0.1)
    model = models.build_model(cfg)
    batch = models.make_batch(model, batch_size=4, seq_len=128)
    loss_fn = models.loss_fn_for(model)
    plain = measure_step(model, batch, loss_fn=loss_fn, repeats=0)
    for block in model.blocks:
        checkpoint_module(block)
    ckpt = measure_step(model, batch, loss_fn=loss_fn, repeats=0)
    assert ckpt.kept_bytes <= 0.15 * plain.kept_bytes  # >= 85% less (the bar: 70%)
    assert ckpt.peak_bytes <= 0.50 * plain.peak_bytes  # >= 50% less (the bar: 40%)


# --- copies, pickling and threads (issue 16) ---------------------------------------------------


def test_deepcopy_of_a_checkpointed_model_computes_with_its_own_weights() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
    checkpoint_module(m[0])
    keys = {k: v.clone() for k, v in m.state_dict().items()}
    c = copy.deepcopy(m)
    with torch.no_grad():
        c[0].weight.mul_(2)  # the copy differs: its output must show it
    x = torch.randn(4, 8)
    out = c(x)
    out.sum().backward()
    assert c[0].weight.grad is not None and m[0].weight.grad is None
    assert is_checkpointed(c[0]) == "recompute" and c[0].forward.module is c[0]
    ref = copy.deepcopy(c)
    uncheckpoint_module(ref[0])
    assert torch.equal(out, ref(x))
    assert m.state_dict().keys() == keys.keys()
    assert all(torch.equal(v, keys[k]) for k, v in m.state_dict().items())


@pytest.mark.parametrize("how", ["pickle", "torch.save"])
def test_a_checkpointed_model_pickles(how: str) -> None:
    import io
    import pickle

    torch.manual_seed(0)
    m = nn.Sequential(Layer(), Layer(), nn.BatchNorm1d(16))
    checkpoint_module(m[0])
    checkpoint_module(m[1], mode="selective", policy=[torch.ops.aten.addmm.default])
    if how == "pickle":
        c = pickle.loads(pickle.dumps(m))
    else:
        buf = io.BytesIO()
        torch.save(m, buf)
        buf.seek(0)
        c = torch.load(buf, weights_only=False)
    assert [is_checkpointed(b) for b in c] == ["recompute", "selective", None]
    assert list(c.state_dict()) == list(m.state_dict())
    x = torch.randn(4, 16)
    c(x).sum().backward()
    m(x).sum().backward()
    assert m[0].lin.weight.grad is not None
    _assert_same_grads(c, m)
    assert c[0].forward.module is c[0]


def _train_bn(model: nn.Module, steps: int, errors: list[BaseException]) -> None:
    try:
        x = torch.randn(8, 4, 5, 5)
        for _ in range(steps):
            model(x).sum().backward()
    except BaseException as e:  # reported by the test
        errors.append(e)


def test_batchnorm_fix_is_thread_safe_and_scoped() -> None:
    import threading

    steps = 60

    def bn_model() -> nn.Sequential:
        return nn.Sequential(*[nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)) for _ in range(3)])

    checkpointed = [bn_model(), bn_model()]
    for model in checkpointed:
        for block in model:
            checkpoint_module(block)
    plain = bn_model()
    errors: list[BaseException] = []
    threads = [threading.Thread(target=_train_bn, args=(m, steps, errors)) for m in [*checkpointed, plain]]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for model in [*checkpointed, plain]:
        assert [int(block[1].num_batches_tracked) for block in model] == [steps] * 3


_GLOBAL_BN = nn.BatchNorm1d(4)


def _through_global(x: torch.Tensor) -> torch.Tensor:
    return _GLOBAL_BN(x).tanh()


def test_batchnorm_found_through_closures_partials_globals_and_arguments() -> None:
    import functools

    bns = [nn.BatchNorm1d(4) for _ in range(4)]
    x = torch.randn(8, 4, requires_grad=True)
    remat.checkpoint(lambda t: bns[0](t).tanh(), x).sum().backward()  # a closure
    remat.checkpoint(functools.partial(lambda m, t: m(t).tanh(), bns[1]), x).sum().backward()
    remat.checkpoint(lambda m, t: m(t).tanh(), bns[2], x).sum().backward()  # an argument
    checkpoint_call(lambda t: bns[3](t).tanh(), (x,), mode="recompute_offload").sum().backward()
    remat.checkpoint(_through_global, x).sum().backward()
    assert [int(bn.num_batches_tracked) for bn in [*bns, _GLOBAL_BN]] == [1] * 5


@pytest.mark.parametrize("mode", ["recompute", "selective"])
def test_one_tensor_passed_twice_under_a_saved_tensor_hook(mode: str) -> None:
    """NOTE [ One tensor, passed twice ]: ``mha(q, x, x)`` under a caller's saved-tensor hook
    recomputes with ``key is value`` as its forward had (torch's own checkpoint raises here)."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(32, 4, batch_first=True)
    q, x = torch.randn(2, 1, 32, requires_grad=True), torch.randn(2, 8, 32, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        with pytest.raises(torch.utils.checkpoint.CheckpointError, match="different metadata"):
            torch.utils.checkpoint.checkpoint(mha, q, x, x, use_reentrant=False)[0].sum().backward()
        got = remat.checkpoint_module(mha, mode=mode)(q, x, x)[0]
        got.sum().backward()
    remat.uncheckpoint_module(mha)
    grads = (q.grad.clone(), x.grad.clone())
    q.grad = x.grad = None
    mha(q, x, x)[0].sum().backward()
    assert torch.equal(grads[0], q.grad) and torch.equal(grads[1], x.grad)


class WrapsItsErrors(nn.Module):
    """A block that re-raises every error of its ops as its own, as einx does (x-transformers);
    tests/test_segments.py uses it too."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        try:
            return self.b(torch.tanh(self.a(x))) * 2
        except Exception as e:
            raise RuntimeError("the library's own error") from e


@pytest.mark.parametrize("mode", ["recompute", "selective", "tiled"])
def test_a_block_that_wraps_errors_recomputes(mode: str) -> None:
    """NOTE [ A recompute stopped early ]: torch's early stop passes through the block's own
    error; torch's checkpoint fails there (the control)."""
    torch.manual_seed(0)
    block = WrapsItsErrors()
    x = torch.randn(2, 8, 16, requires_grad=True)
    with pytest.raises(RuntimeError, match="the library's own error"):
        torch_checkpoint(block, x, use_reentrant=False).sum().backward()
    block.zero_grad()
    x.grad = None
    block(x).sum().backward()
    plain = [p.grad.clone() for p in [x, *block.parameters()]]
    block.zero_grad()
    x.grad = None
    if mode == "tiled":
        from remat.manual.tiled import _tile_forward

        out = torch.cat([torch_checkpoint(_tile_forward, block, x[:, i:i + 4], use_reentrant=False)
                         for i in (0, 4)], dim=1)
    else:
        out = checkpoint_call(block, (x,), mode=mode)
    out.sum().backward()
    for got, want in zip([x, *block.parameters()], plain):
        assert torch.allclose(got.grad, want)
