"""Copies off the budget's memory (NOTE [ Copies off the budget's memory ] in remat.measure.copies):
read back bit for bit, in the layout they had, and put back in place by ``preserved``; compared a
piece at a time. What they save in a process that cannot hold the plain step is the capped
``embedding`` case of tests/test_does_not_fit.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from remat.measure.copies import _PIECE, Copies
from remat.measure.preserve import preserved
from remat.verify_steps import compare


def _tensors() -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [
        torch.randn(3, 4), torch.randn(5, 6).t(), torch.tensor(3.0), torch.randn(2, 3).to(torch.bfloat16),
        torch.zeros(0), torch.randn(4, 4)[:, :2], torch.randn(2, 3, 4).permute(2, 0, 1), torch.randint(0, 5, (7,)),
        torch.rand(3) > 0.5, torch.randn(3, dtype=torch.complex64), torch.randn(_PIECE // 4 * 2 + 5),
        torch.randn(3, 4).to_sparse(),  # in memory: the file takes dense strided tensors only
    ]


def test_copies_read_back_bit_for_bit_in_the_layout_they_had() -> None:
    tensors = _tensors()
    copies = Copies(tensors)
    assert copies._file is not None  # the CPU's copies are in the file
    for t, back in zip(tensors, copies):
        assert back.dtype == t.dtype and back.shape == t.shape and back.layout == t.layout
        assert torch.equal(back.to_dense(), t.to_dense())
    permuted = copies[6]
    assert permuted.stride() == tensors[6].stride()  # a permuted layout kept; a gapped one made dense
    assert copies[5].is_contiguous()
    for i, t in enumerate(tensors[:-1]):
        was = t.clone()
        t.copy_(torch.zeros_like(t) if t.dtype != torch.bool else ~t)
        copies.put(i, t)
        assert torch.equal(t, was), i


def test_a_tensor_put_back_counts_a_new_version() -> None:
    p = nn.Parameter(torch.randn(10, 10))
    copies, was = Copies([p]), p.detach().clone()
    with torch.no_grad():
        p.mul_(2)
    version = p._version
    with torch.no_grad():
        copies.put(0, p)
    assert torch.equal(p, was) and p._version > version


def test_preserved_puts_back_weights_gradients_and_adams_state_bit_for_bit() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4))
    model[2].weight = nn.Parameter(torch.randn(16, 4).t())  # not contiguous
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    x = torch.randn(32, 8)
    model(x).square().mean().backward()
    opt.step()
    model(x).square().mean().backward()  # gradients the user left, and Adam's moments
    state = {k: v.clone() for k, v in model.state_dict().items()}
    grads = [p.grad.clone() for p in model.parameters()]
    strides = [p.grad.stride() for p in model.parameters()]
    moments = [{k: v.clone() for k, v in s.items()} for s in opt.state.values()]
    with preserved(model, opt):
        for _ in range(2):
            opt.zero_grad(set_to_none=True)
            model(x * 3).square().mean().backward()
            opt.step()
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
    assert [p.grad.stride() for p in model.parameters()] == strides
    assert all(torch.equal(m[k], s[k]) for m, s in zip(moments, opt.state.values()) for k in m)


@pytest.mark.parametrize("exact", [True, False])
def test_compare_reads_pieces_and_finds_one_difference_anywhere(exact: bool) -> None:
    torch.manual_seed(0)
    big = torch.randn(_PIECE // 4 * 3 + 7)
    plain = Copies([torch.tensor(1.5), big])
    assert compare(plain, Copies([torch.tensor(1.5), big.clone()]), exact=exact) == (0.0, True)
    off = big.clone()
    off[-1] += 1e-3  # in the last piece: within 1% of the largest magnitude, not bit for bit
    diff, equal = compare(plain, Copies([torch.tensor(1.5), off]), exact=exact)
    assert diff == pytest.approx(1e-3, rel=1e-2) and equal is (not exact)
    off[0] += 100.0
    assert compare(plain, Copies([torch.tensor(1.5), off]), exact=exact)[1] is False
    assert compare(plain, Copies([torch.tensor(1.5), big[:-1]]), exact=exact)[1] is False  # another shape
    assert compare(plain, Copies([torch.tensor(1.5)]), exact=exact)[1] is False  # fewer gradients
    nan = big.clone()
    nan[-1] = float("nan")  # a NaN in both: bit for bit it is no equal pair, nor to round-off
    assert compare(Copies([nan]), Copies([nan.clone()]), exact=exact)[1] is False
    sparse = torch.randn(4, 3).to_sparse()  # an embedding's sparse gradient, kept in memory
    assert compare(Copies([sparse]), Copies([sparse.clone()]), exact=exact) == (0.0, True)


def test_copies_stay_in_memory_where_the_file_cannot_be_written(monkeypatch: pytest.MonkeyPatch,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    def full(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("remat.measure.copies.tempfile.TemporaryFile", full)
    tensors = _tensors()
    copies = Copies(tensors)
    assert copies._file is None and "No space left on device" in caplog.text
    assert all(torch.equal(back.to_dense(), t.to_dense()) for t, back in zip(tensors, copies))
