"""A budgeted profile of a step the plain step does not fit (NOTE [ Planning what does not fit ]).

Bytes come from the step on fake tensors plus what the lean steps measure that no tensor holds;
times from real steps predicted within the budget. Checked here against real steps: every plan of
a lean profile measures its prediction to the byte, no real step it ran was predicted over the
budget (and none is the plain step), and a budget below the floor runs no real step at all.
"""

from __future__ import annotations

import dataclasses
import functools
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.utils.checkpoint

import remat
from remat import models
from remat.errors import InfeasibleBudget, InvalidValue
from remat.manual.options import option_of
from remat.manual.segments import segments_of
from remat.measure import marked
from remat.measure.profiler import profile
from remat.measure.step_memory import measure_step
from remat.plan.head import estimate_with_head
from remat.plan.solver import smallest_any, solve
from remat.units import parse_budget


def _gpt() -> tuple[Any, Any, Any]:
    torch.manual_seed(0)
    model = models.build_model(models.GPTConfig(n_layer=4, n_embd=64, n_head=2, block_size=64, vocab_size=256))
    return model, models.make_batch(model, batch_size=2, seq_len=64), models.loss_fn_for(model)


def _unet() -> tuple[Any, Any, Any]:
    # convolutions: their backward allocates scratch no tensor holds (NOTE [ What no tensor holds ])
    torch.manual_seed(0)
    model = models.build_model(models.UNetConfig(image_size=32, channels=16))
    return model, models.make_batch(model, batch_size=4), models.loss_fn_for(model)


class _Steps:
    """The real steps the profiler's marked step runs: each block's option and the head's."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.real: list[dict[str, str]] = []
        inner = marked.marked_step

        def spy(model: Any, named: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
            from torch._subclasses.fake_tensor import FakeTensor

            if not any(isinstance(p, FakeTensor) for p in model.parameters()):  # the batch is real in both
                segmented = any(segments_of(m) is not None for _, m in named)
                self.real.append({name: option_of(m) or "keep" for name, m in named} | ({"": "segments"} if segmented else {}))
            return inner(model, named, batch, *args, **kwargs)

        for module in ("remat.measure.lean", "remat.measure.marked", "remat.measure.profiler"):
            monkeypatch.setattr(f"{module}.marked_step", spy, raising=False)


@pytest.mark.parametrize(("build", "shares"), [pytest.param(_gpt, (0.7, 0.85), id="gpt"),
                                               pytest.param(_unet, (0.42, 0.7), id="unet", marks=pytest.mark.slow)])
def test_a_lean_profile_predicts_its_plans_to_the_byte(build: Any, shares: tuple[float, ...],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    model, batch, loss_fn = build()
    plain = measure_step(model, batch, loss_fn=loss_fn, repeats=0).peak_bytes
    for share in shares:
        budget = int(share * plain)
        steps = _Steps(monkeypatch)
        prof = profile(model, batch, loss_fn=loss_fn, repeats=1, budget=budget)
        assert not prof.plain_ran and prof.plain_peak_bytes == plain
        assert steps.real and all(set(s.values()) != {"keep"} for s in steps.real), "the plain step ran"
        # the first steps run the floor plan (nested segments: the lowest predicted peak); every
        # step after them was predicted within the budget
        first = [s for s in steps.real if "" in s]
        assert first and steps.real[: len(first)] == first, steps.real
        for s in steps.real[len(first):]:
            assert estimate_with_head(prof, s).peak_bytes <= budget, s
        for segments in (True, False):
            try:
                plan = solve(prof, budget, segments=segments)
            except InfeasibleBudget:
                continue
            remat.apply(model, plan)
            measured = measure_step(model, batch, loss_fn=loss_fn, repeats=0).peak_bytes
            remat.remove(model)
            assert measured == plan.estimate.peak_bytes, (share, segments, plan.choices, plan.segments)



def test_each_kernels_scratch_from_one_step_predicts_a_step_no_real_step_ran() -> None:
    """NOTE [ What each kernel allocates ] in remat.measure.tracer: the scratch a step with every
    block recomputed measured, by op and the bytes it made, predicts the plain step on fake tensors
    to the byte (without it: 9,886,232 B for 10,187,480, the convolutions' scratch)."""
    from remat.measure import step as _step
    from remat.measure.estimated import plain_peak
    from remat.measure.lean import lean_spec
    from remat.measure.tracer import MemoryTracer, sized

    model, batch, loss_fn = _unet()
    plain = measure_step(model, batch, loss_fn=loss_fn, repeats=0).peak_bytes
    remat.apply(model, solve(profile(model, batch, loss_fn=loss_fn, repeats=1), method="all"))
    try:
        with sized("cpu"):
            _step.train_step(model, batch, loss_fn)
        with MemoryTracer("cpu", kernels=True) as tracer:
            _step.train_step(model, batch, loss_fn)
    finally:
        remat.remove(model)
    spec = lean_spec(torch.device("cpu"))
    assert plain_peak(model, batch, loss_fn, None, spec) < plain  # the tensors alone
    scratch = tracer.trace.kernel_scratch
    assert plain_peak(model, batch, loss_fn, None, dataclasses.replace(spec, kernel_scratch=scratch)) == plain

def test_a_budget_below_the_floor_runs_no_real_step(monkeypatch: pytest.MonkeyPatch) -> None:
    model, batch, loss_fn = _unet()
    steps = _Steps(monkeypatch)
    with pytest.raises(InfeasibleBudget) as caught:
        remat.auto(model, batch, 1_000_000, loss_fn=loss_fn, repeats=1)
    assert steps.real == []
    assert caught.value.smallest_bytes is not None and caught.value.smallest_bytes > 1_000_000
    # a floor from the tensors alone: what no tensor holds (the convolutions' scratch) may raise it
    assert caught.value.estimated and "smallest feasible from the step tensors alone" in str(caught.value)
    assert remat.applied_plan(model) is None
    # at that floor, the floor plan's real step measures the scratch, and the floor it names says so
    with pytest.raises(InfeasibleBudget) as again:
        remat.auto(model, batch, caught.value.smallest_bytes, loss_fn=loss_fn, repeats=1)
    assert not again.value.estimated and again.value.smallest_bytes > caught.value.smallest_bytes
    assert ("what no tensor holds included (a kernel's scratch space, as a convolution's or a loss's temporary), "
            "measured by a real step within this budget") in str(again.value)


def test_auto_verifies_without_the_plain_step() -> None:
    from remat.cli.common import report_row
    from remat.report import comparison_table, render_text

    model, batch, loss_fn = _gpt()
    plain = measure_step(model, batch, loss_fn=loss_fn, repeats=0).peak_bytes
    plan, report = remat.auto(model, batch, int(0.7 * plain), loss_fn=loss_fn, repeats=1, verify=True)
    remat.remove(model)
    assert not plan.plain_ran and not report.plain_ran
    assert report.reference == "every block recomputed" and report.grads_equal and report.max_grad_diff == 0
    assert report.plain_peak_bytes == plain  # predicted, to the byte
    assert report.fits and report.measured_peak_bytes == plan.estimate.peak_bytes
    assert '"plain_ran": false' in report.to_json() and '"reference": "every block recomputed"' in report.to_json()
    text = render_text(comparison_table([report_row("remat 70%", plan, report)]))
    assert "†" in text and "did not run" in text


def test_a_profile_within_the_budget_runs_the_plain_step_as_before() -> None:
    model, batch, loss_fn = _gpt()
    plain = measure_step(model, batch, loss_fn=loss_fn, repeats=0).peak_bytes
    prof = profile(model, batch, loss_fn=loss_fn, repeats=1, budget=plain)
    assert prof.plain_ran and prof.plain_peak_bytes == plain and prof.mode == "measured"


def test_the_device_budget() -> None:
    assert parse_budget("device", device_memory_bytes=10 * 2**30) == 8 * 2**30
    with pytest.raises(InvalidValue, match="give the budget in bytes"):
        parse_budget("device")
    model, batch, loss_fn = _gpt()
    with pytest.raises(InvalidValue, match="only on a CUDA device"):
        remat.auto(model, batch, "device", loss_fn=loss_fn, repeats=1)


def test_a_reference_is_judged_against_the_plans_own_fake_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [ Verifying without the plain step ]: fake peaks miss the kernels' scratch (a
    diffusers UNet's reference step, predicted 50.14 MB under a 50.25 MB budget, measured 55.57 MB).
    Here every fake peak is made to miss 1 MiB: a reference whose fake peak is above the plan's,
    with the plan at its budget, is not run."""
    from remat import verifier

    model, batch, loss_fn = _gpt()
    plain = measure_step(model, batch, loss_fn=loss_fn, repeats=0).peak_bytes
    prof = profile(model, batch, loss_fn=loss_fn, repeats=1)
    with pytest.raises(InfeasibleBudget) as refused:
        solve(prof, 1)
    assert refused.value.smallest_bytes is not None
    plan = solve(prof, refused.value.smallest_bytes)  # segments: below every block recomputed
    recomputed = estimate_with_head(prof, dict.fromkeys(plan.choices, "recompute")).peak_bytes
    assert plan.estimate.peak_bytes < recomputed < plain
    fake = verifier.plain_peak
    monkeypatch.setattr(verifier, "plain_peak", lambda *a, **k: fake(*a, **k) - 2**20)
    lean = verifier._lean(model, batch, loss_fn, None, [plan], recomputed - 2**19)
    assert lean is not None and lean.reference is None, lean


class _KeepsATensor(torch.nn.Module):
    """MONAI's attention: a plain tensor attribute (``att_mat = torch.Tensor()``), no buffer; its
    DynUNet: a list of tensors (``heads``)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin, self.att_mat, self.heads = torch.nn.Linear(d, d), torch.Tensor(), [torch.rand(1)] * 2
        self.act = staticmethod(torch.relu)  # rotary-embedding-torch's xpos: no copy.deepcopy takes it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.lin(x))


def test_a_model_that_keeps_plain_tensors_is_planned_where_the_plain_step_does_not_fit() -> None:
    """Its fake copy failed (a real tensor's copy under the fake mode takes no storage; a
    ``staticmethod`` object held on an instance cannot be deep-copied), and ``auto`` below the plain
    step told the user to make the model copyable (MONAI's UNETR, DynUNet; rotary-embedding-torch's
    ``RotaryEmbedding(use_xpos=True)`` in simple-hierarchical-transformer)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[_KeepsATensor(32) for _ in range(4)], torch.nn.Linear(32, 4))
    batch = (torch.randn(64, 128, 32),)

    def loss_fn(out: torch.Tensor, b: Any) -> torch.Tensor:
        return out.square().mean()

    plain = measure_step(model, batch, loss_fn=loss_fn, repeats=0).peak_bytes
    plan, report = remat.auto(model, batch, int(0.7 * plain), loss_fn=loss_fn, repeats=1, verify=True)
    remat.remove(model)
    assert not plan.plain_ran and report.plain_peak_bytes == plain
    assert report.fits and report.grads_equal


def _within_prediction(model: Any, batch: Any, loss_fn: Any, plan: Any) -> None:
    """The plan's step, applied, measures its prediction or less."""
    remat.apply(model, plan)
    try:
        assert measure_step(model, batch, loss_fn=loss_fn, repeats=0).peak_bytes <= plan.estimate.peak_bytes
    finally:
        remat.remove(model)


class _ReadsItsBatch(torch.nn.Module):
    """ESM-2's shape: the padding mask dropped when no token is padding (``if not pad.any()``), a
    count of tokens from the batch, and noise drawn like the batch (a diffusion loss's)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(33, 32)
        self.layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.LayerNorm(32), torch.nn.Linear(32, 128),
                                                              torch.nn.GELU(), torch.nn.Linear(128, 32))
                                          for _ in range(4))
        self.out = torch.nn.Linear(32, 33)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pad: torch.Tensor | None = ids.eq(0)
        if not pad.any():  # reads the batch's values
            pad = None
        x = self.emb(ids) if pad is None else self.emb(ids) * (~pad)[..., None]
        x = x + torch.randn_like(ids, dtype=x.dtype)[..., None] / int(ids.ne(0).sum())
        for layer in self.layers:
            x = x + layer(x)
        return self.out(x)


def _every_token(out: torch.Tensor, b: Any) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out.transpose(1, 2), b[0])


def _masked_tokens(out: torch.Tensor, b: Any) -> torch.Tensor:
    mask = b[0] % 7 == 0  # a masked language model's loss: the shape of ``out[mask]`` is the batch's
    return torch.nn.functional.cross_entropy(out[mask], b[0][mask])


@pytest.mark.parametrize("loss_fn", [_every_token, _masked_tokens], ids=["every-token", "masked-tokens"])
def test_a_model_that_reads_its_batch_is_planned_without_its_plain_step(monkeypatch: pytest.MonkeyPatch,
                                                                          loss_fn: Any) -> None:
    """NOTE [ The batch's values ]: on a fake batch the plain step could not be predicted, and the
    profile below it ran the plain step (out of memory where it does not fit): ESM-2's padding mask,
    its masked language model's loss."""
    torch.manual_seed(0)
    model, ids = _ReadsItsBatch(), torch.randint(1, 33, (8, 128))
    batch, before = (ids,), ids.clone()

    plain = measure_step(model, batch, loss_fn=loss_fn, repeats=0).peak_bytes
    steps = _Steps(monkeypatch)
    rng = torch.get_rng_state()
    prof = profile(model, batch, loss_fn=loss_fn, repeats=1, budget=int(0.6 * plain))
    assert not prof.plain_ran and prof.plain_peak_bytes == plain  # predicted from fake tensors, to the byte
    assert {"": "segments"} not in steps.real and all(set(s.values()) != {"keep"} for s in steps.real)
    assert torch.equal(ids, before) and torch.equal(torch.get_rng_state(), rng)
    _within_prediction(model, batch, loss_fn, solve(prof, int(0.6 * plain)))


class _GuardsOverflow(torch.nn.Module):
    """DETR's layer (``if not torch.isfinite(x).all()``) and BART's float16 guard (``isinf(x).any()
    or isnan(x).any()``): a training forward that reads what its weights made."""

    def __init__(self, bart: bool) -> None:
        super().__init__()
        self.bart = bart
        self.layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(),
                                                              torch.nn.Linear(128, 32)) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
            overflowed = bool(torch.isinf(x).any() or torch.isnan(x).any()) if self.bart else not torch.isfinite(x).all()
            if overflowed:
                x = torch.clamp(x, min=-1e4, max=1e4)
        return x


def _planned_from_fake_steps(model: torch.nn.Module, batch: Any, loss_fn: Any) -> None:
    """A profile at 60% of the plain step runs no real step, predicts that step to the byte, and
    its plan measures within its prediction."""
    plain = measure_step(model, batch, loss_fn=loss_fn, repeats=0).peak_bytes
    prof = profile(model, batch, loss_fn=loss_fn, repeats=1, budget=int(0.6 * plain))
    assert not prof.plain_ran and prof.plain_peak_bytes == plain
    _within_prediction(model, batch, loss_fn, solve(prof, int(0.6 * plain)))


@pytest.mark.parametrize("bart", [False, True], ids=["isfinite-all", "isinf-or-isnan"])
def test_a_forward_that_guards_against_overflow_is_predicted_as_finite(bart: bool) -> None:
    """NOTE [ Every value finite ] in remat.measure.fake_steps: transformers' DETR ran no step on
    fake tensors, and a profile below its plain step ran that step."""
    torch.manual_seed(0)
    model, batch = _GuardsOverflow(bart), (torch.randn(16, 256, 32),)

    _planned_from_fake_steps(model, batch, lambda out, b: out.square().mean())


class _PadsLabels(torch.nn.Module):
    """segment-anything's prompt encoder: pads the batch's point labels with ``-torch.ones`` and
    writes and adds into the points' embeddings by the labels' masks."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.not_a_point, self.kinds = torch.nn.Linear(2, 32), torch.nn.Embedding(1, 32), torch.nn.Embedding(2, 32)
        self.layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(),
                                                              torch.nn.Linear(128, 32)) for _ in range(4))

    def forward(self, points: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        points = torch.cat([points, torch.zeros(points.shape[0], 1, 2)], dim=1)
        labels = torch.cat([labels, -torch.ones(labels.shape[0], 1)], dim=1)
        x = self.embed(points)
        x[labels == -1] = 0.0
        x[labels == -1] += self.not_a_point.weight
        x[labels == 1] += self.kinds.weight[1]
        for layer in self.layers:
            x = x + layer(x)
        return x


def test_a_forward_that_pads_the_batch_with_a_constant_and_writes_by_its_mask_is_predicted() -> None:
    """NOTE [ The batch's values ] in remat.measure.fake_steps: a small constant made from nothing
    is real in the fake steps. Fake, its mask raised (``nonzero``), and a profile below the plain
    step ran that step (segment-anything's, helper 36)."""
    torch.manual_seed(0)
    model = _PadsLabels()
    batch = (torch.randn(16, 255, 2), torch.randint(0, 2, (16, 255)).float())

    _planned_from_fake_steps(model, batch, lambda out, b: out.square().mean())


class _Spectrogram(torch.nn.Module):
    """demucs' spectrogram branch: ``stft`` of the batch's audio and ``istft`` of what the layers
    made, each with a ``hann_window`` made in the forward."""

    def __init__(self, n_fft: int = 62) -> None:
        super().__init__()
        self.n_fft, bins = n_fft, n_fft // 2 + 1
        self.layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(2 * bins, 128), torch.nn.GELU(),
                                                              torch.nn.Linear(128, 2 * bins)) for _ in range(4))

    def forward(self, audio: torch.Tensor) -> torch.Tensor:
        z = torch.stft(audio, self.n_fft, window=torch.hann_window(self.n_fft), return_complex=True)
        x = torch.view_as_real(z).transpose(1, 2).flatten(2)  # [B, frames, 2 * bins]
        for layer in self.layers:
            x = x + layer(x)
        z = torch.view_as_complex(x.unflatten(2, (-1, 2)).transpose(1, 2).contiguous())
        return torch.istft(z, self.n_fft, window=torch.hann_window(self.n_fft).to(z.real), length=audio.shape[-1])


def test_a_forward_with_a_spectrogram_is_predicted() -> None:
    """NOTE [ The batch's values ] in remat.measure.fake_steps: ``istft`` reads its window's
    envelope, and ``stft`` transposes in place what a real op made; on a fake window and with no
    write into a real tensor, the fake step raised, and a profile below the plain step ran that
    step (demucs' HTDemucs, helper 36)."""
    torch.manual_seed(0)
    model, batch = _Spectrogram(), (torch.randn(8, 4096),)

    _planned_from_fake_steps(model, batch, lambda out, b: (out - b[0]).square().mean())


class _Constant(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.register_buffer("w3j", torch.randn(d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w3j


class _PicklesItsKernel(torch.nn.Module):
    """e3nn's ``CodeGenMixin``: copied, it pickles its generated kernel, a submodule with buffers."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.lin, self.kernel, self.out = torch.nn.Linear(d, 4 * d), _Constant(4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(torch.tanh(self.kernel(self.lin(x))))

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_modules"] = dict(state["_modules"])
        state["kernel_pickled"] = pickle.dumps(state["_modules"].pop("kernel"))
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        kernel = pickle.loads(state.pop("kernel_pickled"))
        self.__dict__.update(state)
        self.kernel = kernel


def test_a_module_that_copies_itself_through_pickle_is_predicted() -> None:
    """remat.measure.estimated.fake_copy: a kernel's buffers, rebuilt by ``pickle.loads`` in the
    fake mode, came back on the meta device; the fake step failed, and a profile below the plain
    step ran that step (e3nn, helper 37)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(_PicklesItsKernel() for _ in range(4)), torch.nn.Linear(32, 1))
    _planned_from_fake_steps(model, (torch.randn(4096, 32),), lambda out, b: out.square().mean())


class _Contrastive(torch.nn.Module):
    """x-clip's loss: the diagonal of the similarities by ``masked_select`` with an ``arange ==
    arange`` mask (its ``matrix_diag``)."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(),
                                                              torch.nn.Linear(4 * d, d)) for _ in range(4))

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            a = a + layer(a)
        sim = a.mean(1) @ b.mean(1).t()
        i = torch.arange(sim.shape[0])
        return (sim.logsumexp(-1) - sim.masked_select(i[:, None] == i[None, :])).mean()


def test_a_loss_that_masked_selects_by_a_real_mask_is_predicted() -> None:
    """NOTE [ The batch's values ] in remat.measure.fake_steps: fake tensors cannot size
    ``masked_select``; a real mask gives way to its positions, as ``x[mask]`` does. Before, a
    profile below the plain step ran that step (x-clip, helper 37)."""
    torch.manual_seed(0)
    _planned_from_fake_steps(_Contrastive(), (torch.randn(8, 256, 64), torch.randn(8, 256, 64)), lambda out, b: out)


def test_a_fake_step_that_runs_out_of_host_memory_runs_no_real_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fake step that runs out of the host's memory is no forward that reads tensor values: the
    profile once fell back to running the plain step for real (19 real steps before refusing, in a
    capped process where that step cannot fit), and then reached the user as the allocator's raw
    ``RuntimeError`` (helper 41's Conformer, capped at 26 MiB of headroom): now the error that says
    what ran out and what to do."""
    model, batch, loss_fn = _gpt()

    def out_of_host_memory(*args: Any, **kwargs: Any) -> int:
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr("remat.measure.lean.plain_peak", out_of_host_memory)
    steps = _Steps(monkeypatch)
    with pytest.raises(remat.errors.ProfileError, match="ran out of host memory planning on fake tensors"):
        profile(model, batch, loss_fn=loss_fn, repeats=1, budget=1_000_000)
    assert steps.real == []


def test_a_plain_step_predicted_to_fit_that_runs_out_is_profiled_lean(monkeypatch: pytest.MonkeyPatch,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    """NOTE [ Planning what does not fit ], rule 6: what no tensor holds (a MONAI 3-D UNet's
    convolutions take 50 MB of scratch on the CPU beside a plain step of 73 MB on fake tensors) can
    make the plain step run out where fake tensors said it fits. That was the user's error before."""
    import remat.measure.profiler as profiler

    model, batch, loss_fn = _gpt()
    plain = measure_step(model, batch, loss_fn=loss_fn, repeats=0).peak_bytes
    before = {k: v.clone() for k, v in model.state_dict().items()}

    def runs_out(*args: Any, **kwargs: Any) -> Any:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(profiler, "_measured", runs_out)
    with caplog.at_level("WARNING", logger="remat"):
        prof = profile(model, batch, loss_fn=loss_fn, repeats=1, budget=plain)
    assert not prof.plain_ran and prof.plain_peak_bytes == plain
    assert "ran out of memory" in caplog.text and "profiling it as a step that does not fit" in caplog.text
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    plan = solve(prof, int(0.7 * plain))
    remat.apply(model, plan)
    assert measure_step(model, batch, loss_fn=loss_fn, repeats=0).peak_bytes == plan.estimate.peak_bytes
    remat.remove(model)


def test_a_lean_step_that_runs_out_refuses_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [ Planning what does not fit ], rule 7: in a process capped below a MONAI 3-D UNet's
    plain step, the floor plan's step (91 MiB with its head's scratch) ran out, and the user was
    told it was remat's bug or a device smaller than the budget."""
    import remat.measure.lean_steps as lean_steps

    model, batch, loss_fn = _gpt()
    plain = measure_step(model, batch, loss_fn=loss_fn, repeats=0).peak_bytes
    before = {k: v.clone() for k, v in model.state_dict().items()}

    def runs_out(self: Any) -> Any:
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
                           "memory: you tried to allocate 33554432 bytes. Error code 12 (Cannot allocate memory)")

    monkeypatch.setattr(lean_steps.LeanSteps, "run_steps", runs_out)
    budget = int(0.7 * plain)
    with pytest.raises(InfeasibleBudget, match="ran out of memory.*scratch space") as refused:
        remat.auto(model, batch, budget, loss_fn=loss_fn, repeats=1)
    assert refused.value.estimated and refused.value.smallest_bytes > budget == refused.value.budget_bytes
    assert "remat's profiling shares that memory" in str(refused.value)  # the CPU's (helper 26: 92 MB)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert remat.applied_plan(model) is None


class _MseNet(torch.nn.Module):
    """Convolutions whose loss is the mean squared error against the batch (a VAE's)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Conv2d(3 if i == 0 else 8, 8, 3, padding=1),
                                                               torch.nn.SiLU()) for i in range(4)])
        self.out = torch.nn.Conv2d(8, 3, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def test_what_the_heads_backward_leaves_on_real_tensors_is_measured() -> None:
    """NOTE [ What no tensor holds ] in remat.measure.scratch: an MSE head's backward leaves more on
    real tensors than on fake ones (here 98,300 B); a lean plan measured that much over its
    prediction (384 KiB on a diffusers AutoencoderTiny, where auto then refused a budget it meets)."""
    torch.manual_seed(0)
    model, batch = _MseNet().train(), (torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1)),)

    def loss_fn(out: torch.Tensor, b: Any) -> torch.Tensor:
        return torch.nn.functional.mse_loss(out, b[0])

    measured = profile(model, batch, loss_fn=loss_fn, repeats=1)
    budget = int(0.6 * measured.plain_peak_bytes)
    prof = profile(model, batch, loss_fn=loss_fn, repeats=1, budget=budget)
    assert not prof.plain_ran and prof.post.grad_bytes == measured.post.grad_bytes
    plan = solve(prof, budget)
    remat.apply(model, plan)
    assert measure_step(model, batch, loss_fn=loss_fn, repeats=0).peak_bytes <= plan.estimate.peak_bytes
    remat.remove(model)


class _LazyTable(torch.nn.Module):
    """CoCa's attention: a rotary table made (by an einsum) on its first forward, sliced from then on."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm, self.up, self.down = torch.nn.LayerNorm(d), torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d))
        self.table: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        if self.table is not None and self.table.shape[-2] >= n:
            pos = self.table[:n]
        else:
            freqs = torch.einsum("i , j -> i j", torch.arange(n, dtype=torch.float32), self.inv_freq)
            pos = self.table = torch.cat((freqs, freqs), dim=-1)
        h = self.norm(x)
        h = h * pos.cos() + h.roll(1, -1) * pos.sin()
        return x + self.down(torch.nn.functional.gelu(self.up(h)))


class _LazyNet(torch.nn.Module):
    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(64, d), torch.nn.Linear(d, 64)
        self.layers = torch.nn.ModuleList([_LazyTable(d) for _ in range(4)])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_the_lean_warm_up_step_makes_lazy_state_without_selective_replays(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a fresh CoCa, ``auto`` below the plain step raised torch's "aten.slice.Tensor encountered during
    backward but not found in storage": the lean profile's first step (a warm-up for lazy state) ran the
    floor plan, whose selective blocks replayed a slice of the table their forward had made instead."""
    from remat.measure import lean_steps

    floor_plan = lean_steps.solve

    def selective(prof: Any, budget: int) -> Any:  # the floor plan as CoCa's had it: selective blocks
        plan = floor_plan(prof, budget)
        return dataclasses.replace(plan, choices={n: "selective" for n in plan.choices}, segments=[])

    monkeypatch.setattr(lean_steps, "solve", selective)
    torch.manual_seed(0)
    model, ids = _LazyNet(), torch.randint(0, 64, (8, 128), generator=torch.Generator().manual_seed(1))
    loss = lambda out, b: torch.nn.functional.cross_entropy(out.flatten(0, 1), b[0].flatten())  # noqa: E731
    prof = profile(model, (ids,), loss_fn=loss, repeats=1, budget="60%")
    assert not prof.plain_ran  # the table it made is gone again: NOTE [ A module's state is its buffers and its attributes ]
    assert all(layer.table is None for layer in model.layers)


class _Scaled(torch.nn.Module):
    """An attention's ``sim * self.scale``: autograd keeps the Python number for the backward."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(d, d), torch.nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.tanh(self.a(x) * 0.5) / 3)


def test_fake_tensors_count_the_python_numbers_autograd_keeps() -> None:
    from remat.measure.estimated import plain_peak
    from remat.measure.lean import lean_spec

    model, x = torch.nn.Sequential(*[_Scaled() for _ in range(4)]), torch.randn(32, 64)
    loss = lambda out, b: out.square().mean()  # noqa: E731
    real = measure_step(model, (x,), loss_fn=loss, repeats=0).peak_bytes
    assert plain_peak(model, (x,), loss, None, lean_spec(torch.device("cpu"))) == real  # 16 B short before


class _Gathers(torch.nn.Module):
    """A graph convolution as torch_geometric's GIN runs it: each node gathers its neighbours
    (``index_select``, summed back by ``index_add``) beside ``(1 + eps) * x``."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, d), torch.nn.ReLU(), torch.nn.Linear(d, d))
        self.eps = torch.nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
        messages = x.index_select(0, edges[0])
        summed = messages.new_zeros(x.shape).scatter_add_(0, edges[1].view(-1, 1).expand_as(messages), messages)
        return self.mlp(summed + (1 + self.eps) * x).relu()


class _Stack(torch.nn.Module):
    """Four layers, each called with what the last returned and the batch's second tensor (a
    graph's edges, the positions)."""

    def __init__(self, layer: Callable[[], torch.nn.Module]) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(layer() for _ in range(4))

    def forward(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, other)
        return x


class _Graph(_Stack):
    def __init__(self) -> None:
        super().__init__(_Gathers)


def _graph_batch(requires_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return torch.randn(1000, 64, requires_grad=requires_grad), torch.randint(0, 1000, (2, 8000))


def _graph() -> torch.nn.Module:
    torch.manual_seed(0)
    return _Graph()


def test_gradients_the_real_step_sums_in_place_are_summed_in_place_on_fake_tensors() -> None:
    """NOTE [ Gradients summed in place ] in remat.measure.fake: on fake tensors the kept backward
    of each block after the first peaked one gradient of its input (256,000 B) above the real
    step's; on torch_geometric's GIN, auto below the plain step refused torch's every-block peak."""
    batch = _graph_batch(requires_grad=False)
    loss = lambda out, b: out.square().mean()  # noqa: E731
    measured = profile(_graph(), batch, loss_fn=loss, repeats=1)
    estimated = profile(_graph, batch, loss_fn=loss, device="cpu")
    assert estimated.mode == "estimated" and estimated.plain_peak_bytes == measured.plain_peak_bytes
    for e, m in zip(estimated.blocks, measured.blocks, strict=True):
        for option in ("keep", "recompute"):
            assert e.options[option].bwd_peak_bytes == m.options[option].bwd_peak_bytes, (e.name, option)


def test_a_batch_that_requires_grad_is_profiled_and_left_as_it_was() -> None:
    """A physics-informed loss's coordinates: the profiler's hook on the first block's input stayed
    on the user's tensor and marked the next step's trace (IndexError); the fake steps left a fake
    tensor in its ``.grad``; a step's gradient of it, accumulated into the last one's, put each
    measured step 256,000 B off the next."""
    model, batch = _graph(), _graph_batch(requires_grad=True)
    user_grad = torch.ones_like(batch[0])
    batch[0].grad = user_grad
    loss = lambda out, b: out.square().mean()  # noqa: E731
    real = measure_step(model, batch, loss_fn=loss, repeats=0).peak_bytes
    measured = profile(model, batch, loss_fn=loss, repeats=1)
    estimated = profile(_graph, batch, loss_fn=loss, device="cpu")
    assert measured.plain_peak_bytes == estimated.plain_peak_bytes == real
    lean = profile(model, batch, loss_fn=loss, repeats=1, budget=smallest_any(measured)[0])
    assert not lean.plain_ran
    _within_prediction(model, batch, loss, solve(lean, smallest_any(measured)[0]))
    assert batch[0].grad is user_grad and bool((user_grad == 1).all())
    assert not batch[0]._backward_hooks

class _Data:
    """torch_geometric's ``Data``: the graph's tensors as attributes, and callable (``data(*keys)``
    yields its items)."""

    def __init__(self, x: torch.Tensor, edge_index: torch.Tensor) -> None:
        self.x, self.edge_index = x, edge_index

    def __call__(self, *keys: str) -> Any:
        return ((k, v) for k, v in vars(self).items() if not keys or k in keys)


class _GraphOfData(_Graph):
    def forward(self, data: _Data) -> torch.Tensor:  # type: ignore[override]
        return super().forward(data.x, data.edge_index)


def test_a_batch_that_is_callable_is_the_batch_not_a_factory_of_it() -> None:
    """torch_geometric's ``Data`` is callable: the fake steps called it as estimated mode's batch
    factory, and the model's forward got a generator (``AttributeError: 'generator' object has no
    attribute 'x'``) at every budget below the plain step. Its tensors are the batch's, on the
    device through the step: every peak left their 384,000 B out."""
    torch.manual_seed(0)
    model, data = _GraphOfData(), _Data(*_graph_batch(requires_grad=False))
    loss = lambda out, b: out.square().mean()  # noqa: E731
    measured = profile(model, data, loss_fn=loss, repeats=1)
    as_tuple = profile(_graph(), _graph_batch(requires_grad=False), loss_fn=loss, repeats=1)
    assert measured.batch_bytes == as_tuple.batch_bytes == 384_000
    assert measured.plain_peak_bytes == as_tuple.plain_peak_bytes
    plan = remat.auto(model, data, smallest_any(measured)[0], loss_fn=loss, repeats=1)
    assert not plan.plain_ran
    remat.remove(model)
    _within_prediction(model, data, loss, plan)
    estimated = profile(_GraphOfData, lambda: _Data(*_graph_batch(requires_grad=False)), loss_fn=loss, device="cpu")
    assert estimated.plain_peak_bytes == measured.plain_peak_bytes


class _LongestSeen(torch.nn.Module):
    """transformers' dynamic RoPE: the longest length seen, an int until a step sees a longer one
    (from the batch's positions) and a tensor from then on, compared with every call's."""

    def __init__(self, c: int = 32) -> None:
        super().__init__()
        self.conv = torch.nn.Conv1d(c, c, 5, padding=2)
        self.longest: int | torch.Tensor = 8

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        n = positions.max() + 1
        if n > self.longest:
            self.longest = n
        return x + torch.tanh(self.conv(x)) / self.longest


def test_a_fake_copy_made_after_a_real_step_is_a_copy_of_the_model_as_given() -> None:
    """Llama with dynamic RoPE, below its plain step: once a real step measured the kernels'
    scratch, the fake profile made again copied the length the real step had left on the model,
    a tensor, faked it, and its comparison raised ``DataDependentOutputException``."""
    torch.manual_seed(0)
    model = _Stack(_LongestSeen)
    batch = (torch.randn(16, 32, 512), torch.arange(512))
    loss = lambda out, b: out.square().mean()  # noqa: E731
    budget = smallest_any(profile(model, batch, loss_fn=loss, repeats=1))[0]
    prof = profile(model, batch, loss_fn=loss, repeats=1, budget=budget)
    assert not prof.plain_ran
    assert [layer.longest for layer in model.layers] == [8] * 4  # as given
    _within_prediction(model, batch, loss, solve(prof, budget))


def test_blocks_in_the_floor_plans_segments_are_charged_what_they_measured_there() -> None:
    """NOTE [ What no tensor holds ]: transformers' SegFormer (its floor plan segments its first
    stages; its upsampling's scratch, the largest, is no block's inside them). Charged that
    scratch, the blocks inside the segments put the lean floor at 931,912 bytes, and a budget at
    the measured profile's floor (854,168) was refused."""
    import _libs_zoo

    try:
        model, batch, loss_fn = _libs_zoo.LIBS["transformers-segformer"]()
    except ImportError as e:
        pytest.skip(f"transformers does not import here ({e})")
    floor = smallest_any(profile(model, batch, loss_fn=loss_fn, repeats=1))[0]
    lean = profile(model, batch, loss_fn=loss_fn, repeats=1, budget=floor)
    assert not lean.plain_ran
    plan = solve(lean, floor)
    assert plan.segments and plan.estimate is not None
    remat.apply(model, plan)
    measured = measure_step(model, batch, loss_fn=loss_fn, repeats=0).peak_bytes
    remat.remove(model)
    assert measured <= plan.estimate.peak_bytes <= floor


class _Recurrent(torch.nn.Module):
    """A block around ``nn.LSTM`` (encodec's SLSTM): oneDNN's LSTM layer keeps a workspace for its
    backward, whose size only the real kernel knows (NOTE [ Outputs only the kernel sizes ])."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = torch.nn.LSTM(32, 32, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = self.lstm(x)
        return x + y


def test_a_kept_lstm_is_planned_with_the_workspace_its_kernel_keeps() -> None:
    torch.manual_seed(0)
    model, x = torch.nn.Sequential(*[_Recurrent() for _ in range(4)]), torch.randn(128, 4, 32)
    loss = lambda out, b: out.square().mean()  # noqa: E731
    plain = measure_step(model, (x,), loss_fn=loss, repeats=0).peak_bytes
    # Before, the fake plain step had no workspace and was predicted within 60% of itself: it ran.
    for share in (0.6, 0.4):
        plan = remat.auto(model, (x,), round(plain * share), loss_fn=loss, repeats=1)
        assert not plan.plain_ran and "keep" in plan.choices.values(), plan.choices
        _within_prediction(model, (x,), loss, plan)


class _SparseBuffer(torch.nn.Module):
    """openai-whisper's shape: a sparse buffer (its ``alignment_heads``) the training step never
    reads; a sparse tensor has no storage of its own (``remat.measure.storages.strided_parts``)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                                                torch.nn.Linear(256, 64)) for _ in range(4)))
        self.register_buffer("heads", torch.eye(16, dtype=torch.bool).to_sparse(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


def test_a_model_with_a_sparse_buffer_is_profiled_and_planned() -> None:
    torch.manual_seed(0)
    model, x = _SparseBuffer(), torch.randn(256, 64)
    loss = lambda out, b: out.square().mean()  # noqa: E731
    plain = measure_step(model, (x,), loss_fn=loss, repeats=0).peak_bytes
    prof = profile(model, (x,), loss_fn=loss, repeats=1)  # raised: cannot access storage of SparseTensorImpl
    assert prof.plain_peak_bytes == plain
    with pytest.raises(InfeasibleBudget) as refused:
        remat.auto(model, (x,), 1, loss_fn=loss, repeats=1)
    for budget in (round(plain * 0.6), refused.value.smallest_bytes):  # the fake copy's bytes: 272 B short before
        plan = remat.auto(model, (x,), budget, loss_fn=loss, repeats=1)
        assert not plan.plain_ran
        _within_prediction(model, (x,), loss, plan)


class _Selects(torch.nn.Module):
    """native-sparse-attention's fine selection: each query gathers keys from an expanded [B, T, T, d]
    view, whose gradient torch's ``gather_backward`` makes in zeros of that size
    (NOTE [ In place where the real kernel is ])."""

    def __init__(self, d: int = 32, picked: int = 32) -> None:
        super().__init__()
        self.kv, self.out, self.picked = torch.nn.Linear(d, d), torch.nn.Linear(d, d), picked

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        every = self.kv(x)[:, None].expand(b, t, t, d)
        index = (torch.arange(t)[:, None] + torch.arange(self.picked)) % t
        picked = torch.gather(every, 2, index[None, :, :, None].expand(b, t, self.picked, d))
        return x + self.out(picked.mean(2))


def test_a_gather_backward_is_predicted_in_place_as_the_real_kernel_runs_it() -> None:
    torch.manual_seed(0)
    model, x = torch.nn.Sequential(*[_Selects() for _ in range(4)]), torch.randn(2, 128, 32)
    loss = lambda out, b: out.square().mean()  # noqa: E731
    plain = measure_step(model, (x,), loss_fn=loss, repeats=0).peak_bytes
    forwards = [block.forward for block in model]
    for block, forward in zip(model, forwards):
        block.forward = functools.partial(torch.utils.checkpoint.checkpoint, forward, use_reentrant=False)
    try:
        every = measure_step(model, (x,), loss_fn=loss, repeats=0).peak_bytes
    finally:
        for block in model:
            del block.forward
    assert every < plain
    plan = remat.auto(model, (x,), every, loss_fn=loss, repeats=1)  # refused before: a floor above the plain step
    assert not plan.plain_ran and plan.estimate.peak_bytes <= every
    _within_prediction(model, (x,), loss, plan)


def test_an_output_only_the_kernel_sizes_is_left_to_the_meta_where_running_it_takes_too_much(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """NOTE [ Outputs only the kernel sizes ]: a model planned for a device this machine is not."""
    from remat.measure import fake_steps
    from remat.measure.estimated import plain_peak
    from remat.measure.lean import lean_spec

    torch.manual_seed(0)
    model, x = torch.nn.Sequential(*[_Recurrent() for _ in range(2)]), torch.randn(64, 4, 32)
    loss = lambda out, b: out.square().mean()  # noqa: E731
    real = measure_step(model, (x,), loss_fn=loss, repeats=0).peak_bytes
    spec = lean_spec(torch.device("cpu"))
    assert plain_peak(model, (x,), loss, None, spec) > 0.9 * real
    monkeypatch.setattr(fake_steps, "_REAL_RUN_BYTES", 0)
    monkeypatch.setattr(fake_steps, "_LEFT_OUT", set())
    assert plain_peak(model, (x,), loss, None, spec) < 0.9 * real  # without the workspace
    assert "mkldnn_rnn_layer.default's outputs are sized as its meta function sizes them" in caplog.text


class _KeepsItsLatents(torch.nn.Module):
    """vit-pytorch's ``Extractor`` (CoCa's image encoder): the encoder keeps its output on itself,
    not detached, until the next step replaces it."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.LayerNorm(d), torch.nn.Linear(d, 4 * d),
                                                              torch.nn.GELU(), torch.nn.Linear(4 * d, d)) for _ in range(3))
        self.head = torch.nn.Linear(d, d)
        self.latents: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        self.latents = x
        return self.head(x)


@pytest.mark.filterwarnings("ignore:the model keeps tensors of each training step")
def test_a_tensor_the_model_carries_into_the_next_step_is_predicted_from_fake_steps() -> None:
    """Rule 4 of NOTE [ A tensor carried from one step into the next ] in remat.measure.marked: the
    fake steps counted the carried latents twice, once as the step's and once as the last's, and
    the floor was named that much above torch's checkpoint on every layer (CoCa's, 131,072 B)."""
    torch.manual_seed(0)
    model, batch = _KeepsItsLatents(), torch.randn(8, 256, 64)

    def loss_fn(out: torch.Tensor, b: Any) -> torch.Tensor:
        return out.square().mean()

    for layer in model.layers:
        layer.forward = functools.partial(torch.utils.checkpoint.checkpoint, layer.forward, use_reentrant=False)
    every = measure_step(model, batch, loss_fn=loss_fn, repeats=0).peak_bytes
    for layer in model.layers:
        del layer.forward
    with pytest.raises(InfeasibleBudget) as refused:
        profile(model, batch, loss_fn=loss_fn, repeats=1, budget=1)
    assert refused.value.smallest_bytes <= every
    for budget in (every, refused.value.smallest_bytes):
        prof = profile(model, batch, loss_fn=loss_fn, repeats=1, budget=budget)
        assert not prof.plain_ran
        plan = solve(prof, budget)
        remat.apply(model, plan)
        try:
            assert measure_step(model, batch, loss_fn=loss_fn, repeats=0).peak_bytes == plan.estimate.peak_bytes
        finally:
            remat.remove(model)


def test_running_out_of_host_memory_on_fake_tensors_is_no_refusal_of_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """A capped process ran out of memory in the fake steps, before any real step (BS-RoFormer's,
    with 46 MiB of headroom), and remat refused the budget of 1 B as below a floor of 2 B: the floor
    plan's step, it said, had run out."""
    import remat.measure.lean

    def bad_alloc(*args: Any, **kwargs: Any) -> Any:
        raise MemoryError("std::bad_alloc")

    torch.manual_seed(0)
    model = models.build_model(models.GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=32, vocab_size=64))
    batch = models.make_batch(model, batch_size=2, seq_len=32)
    monkeypatch.setattr(remat.measure.lean, "fake_run", bad_alloc)
    with pytest.raises(remat.errors.ProfileError, match=r"ran out of host memory planning on fake tensors, before "
                       r"any real step \(MemoryError: std::bad_alloc\).*Give the process more memory"):
        profile(model, batch, loss_fn=models.loss_fn_for(model), repeats=1, budget=1)


def test_every_real_step_of_a_lean_profile_measures_within_what_gated_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [ What each kernel allocates ] in remat.measure.tracer: a head chunked by rows no traced
    step ran is charged its kernels' most scratch per byte. Before, the first step (chunked by 64)
    measured no scratch for chunks of 128 and 256 rows, and their lean steps measured 1,885,048 and
    5,948,792 B over the predictions that let them run below a budget."""
    transformers = pytest.importorskip("transformers")
    from remat.measure import lean_steps, runner

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=8000, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 8000, (2, 256))
    batch = {"input_ids": ids, "labels": ids}
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    traced, measure = runner.StepRunner.traced, lean_steps.LeanSteps._measure
    real: list[int] = []
    steps: list[tuple[str, int, int]] = []

    def spy_traced(self: Any, kernels: bool = False) -> Any:
        out = traced(self, kernels)
        if self.spec is None:  # the real step, not its fake twin
            real.append(out[0].peak_bytes + params)
        return out

    def spy_measure(self: Any, options: Any, head: str, segments: Any = (), kernels: bool = False) -> Any:
        predicted = self.peak(options, head)
        out = measure(self, options, head, segments, kernels)
        steps.append((head, predicted, real[-1]))
        return out

    monkeypatch.setattr(runner.StepRunner, "traced", spy_traced)
    monkeypatch.setattr(lean_steps.LeanSteps, "_measure", spy_measure)
    plain = measure_step(model, batch, repeats=0).peak_bytes
    profile(model, batch, repeats=1, budget=int(plain * 0.9))
    heads = {head for head, _, _ in steps}
    assert {"chunked:128", "chunked:256"} <= heads, steps
    assert all(measured <= predicted for _, predicted, measured in steps), steps


class _Counted(torch.nn.Module):
    """performer-pytorch's ``ProjectionUpdater``: a buffer counts the calls, and the forward reads it
    (``if calls >= interval``) to redraw a projection."""

    def __init__(self, d: int = 128) -> None:
        super().__init__()
        self.register_buffer("calls", torch.tensor(0))
        self.proj = torch.nn.Parameter(torch.randn(d, d) / d**0.5)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.LayerNorm(d), torch.nn.Linear(d, 4 * d),
                                                              torch.nn.GELU(), torch.nn.Linear(4 * d, d)) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.calls >= 1000:
            with torch.no_grad():
                self.proj.normal_()
                self.calls.zero_()
        self.calls += 1
        x = x @ self.proj
        for block in self.blocks:
            x = x + block(x)
        return x


def test_a_forward_that_reads_a_counter_buffer_is_planned_without_its_plain_step() -> None:
    """``remat.measure.estimated.fake_copy``: a fake copy keeps a buffer of a few integers real, so the
    forward's read of it runs. Before, the fake step raised (``DataDependentOutputException``) and a
    budget at 75% of the plain step ran the plain step (55.3 MiB at a 41.5 MiB budget, helper 40's
    repro)."""
    torch.manual_seed(0)
    model, x = _Counted(), torch.randn(4, 256, 128)
    model.calls.fill_(7)

    def loss_fn(out: torch.Tensor, batch: Any) -> torch.Tensor:
        return out.square().mean()

    plan, report = remat.auto(model, x, "75%", loss_fn=loss_fn, repeats=1, verify=True)
    try:
        assert not report.plain_ran and report.measured_peak_bytes <= plan.budget_bytes, report
        assert report.measured_peak_bytes <= report.predicted_peak_bytes and report.grads_equal, report
        assert int(model.calls) == 7  # the user's count, as it was
    finally:
        remat.remove(model)
