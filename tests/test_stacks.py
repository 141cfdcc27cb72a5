"""Blocks from several stacks (NOTE [ Every stack ] in remat.manual.blocks): found in every stack,
profiled in the order they run, with phases that tile the step (NOTE [ Blocks of several stacks ]
in remat.measure.attribution), so that the cost model reproduces the measured peaks."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat.errors import ProfileError
from remat.manual.blocks import find_blocks
from remat.manual.module_form import checkpoint_module, uncheckpoint_module
from remat.measure.step_memory import measure_step


class Conv(nn.Module):
    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, padding=1)
        self.norm = nn.GroupNorm(2, c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(self.norm(self.conv(x)))


class UNet(nn.Module):
    """Down path, a middle, an up path with long skips (each up block takes a down block's output)."""

    def __init__(self, c: int = 8, depth: int = 3) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.down = nn.ModuleList([Conv(c, c) for _ in range(depth)])
        self.mid = Conv(c, c)
        self.up = nn.ModuleList([Conv(2 * c, c) for _ in range(depth)])
        self.head = nn.Sequential(nn.Conv2d(c, c, 1), nn.SiLU(), nn.Conv2d(c, 3, 1))  # not a stack

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        skips = []
        for block in self.down:
            h = block(h)
            skips.append(h)
            h = F.avg_pool2d(h, 2)
        h = self.mid(h)
        for block in self.up:
            h = F.interpolate(h, scale_factor=2.0)
            h = block(torch.cat([h, skips.pop()], dim=1))
        return self.head(h)


class Mlp(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


class TwoTowers(nn.Module):
    """Text tower defined first, image tower run first; an unused stack that never runs."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.text_embed = nn.Embedding(50, d)
        self.text = nn.ModuleList([Mlp(d) for _ in range(3)])
        self.image_embed = nn.Linear(12, d)
        self.image = nn.ModuleList([Mlp(d) for _ in range(2)])
        self.unused = nn.ModuleList([Mlp(4) for _ in range(2)])

    def forward(self, ids: torch.Tensor, patches: torch.Tensor) -> torch.Tensor:
        v = self.image_embed(patches)
        for block in self.image:
            v = block(v)
        t = self.text_embed(ids)
        for block in self.text:
            t = block(t)
        return (t.mean(1) @ v.mean(1).t()).logsumexp(-1).mean()


def _unet() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return UNet(), torch.randn(4, 3, 32, 32)


def _towers() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return TwoTowers(), (torch.randint(0, 50, (8, 64), generator=g), torch.randn(8, 48, 12, generator=g))


def _unet_loss(out: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, batch)


def _sum_loss(out: torch.Tensor, batch: object) -> torch.Tensor:
    return out


def test_every_stack_is_found_and_bare_layers_are_not() -> None:
    unet, _ = _unet()
    assert [n for n, _ in find_blocks(unet)] == [f"down.{i}" for i in range(3)] + [f"up.{i}" for i in range(3)]
    towers, _ = _towers()
    assert [n for n, _ in find_blocks(towers)] == [
        "text.0", "text.1", "text.2", "image.0", "image.1", "unused.0", "unused.1"]
    # named blocks are still the user's choice
    assert [n for n, _ in find_blocks(unet, ["up.*"])] == ["up.0", "up.1", "up.2"]
    assert [n for n, _ in find_blocks(towers, [towers.image[1], towers.text[0]])] == ["image.1", "text.0"]


def test_profile_orders_blocks_as_they_run_and_leaves_out_an_idle_stack() -> None:
    model, batch = _towers()
    prof = remat.profile(model, batch, loss_fn=_sum_loss, repeats=1)
    assert [b.name for b in prof.blocks] == ["image.0", "image.1", "text.0", "text.1", "text.2"]
    estimated = remat.profile(TwoTowers, batch, loss_fn=_sum_loss, device="cpu")  # from a factory
    assert [b.name for b in estimated.blocks] == [b.name for b in prof.blocks]
    with pytest.raises(ProfileError, match=r"\['unused.0', 'unused.1'\] did not run"):
        remat.profile(model, batch, loss_fn=_sum_loss, blocks=["unused.*", "text.*"], repeats=1)


@pytest.mark.parametrize("build", [_unet, _towers], ids=["unet", "two-towers"])
def test_peaks_of_blocks_from_several_stacks(build: object) -> None:
    """The phases tile the step: every block kept gives the plain peak exactly, and every block
    recomputed what a step with every block checkpointed measures."""
    model, batch = build()  # type: ignore[operator]
    loss_fn = _unet_loss if isinstance(model, UNet) else _sum_loss
    prof = remat.profile(model, batch, loss_fn=loss_fn, repeats=1)
    keep = remat.estimate(prof, dict.fromkeys((b.name for b in prof.blocks), "keep")).peak_bytes
    assert keep == prof.plain_peak_bytes == measure_step(model, batch, loss_fn=loss_fn, repeats=0).peak_bytes
    blocks = dict(model.named_modules())
    for b in prof.blocks:
        checkpoint_module(blocks[b.name], mode="recompute")
    measured = measure_step(model, batch, loss_fn=loss_fn, repeats=0).peak_bytes
    for b in prof.blocks:
        uncheckpoint_module(blocks[b.name])
    predicted = remat.estimate(prof, dict.fromkeys((b.name for b in prof.blocks), "recompute")).peak_bytes
    assert predicted == measured, (predicted, measured)


def test_a_verified_plan_over_both_paths_of_a_unet() -> None:
    # 85%: its long skips are held whatever the plan, and keep the smallest feasible near 80%
    model, batch = _unet()
    plan, report = remat.auto(model, batch, "85%", loss_fn=_unet_loss, verify=True, repeats=1)
    # the middle block, a lone attribute, is a block by what runs (NOTE [ Blocks by what runs ])
    assert set(plan.choices) == {f"down.{i}" for i in range(3)} | {"mid"} | {f"up.{i}" for i in range(3)}
    assert report.fits and report.grads_equal, report


class Skipping(nn.Module):
    """Its second block runs in the first step only, as a layer under layerdrop may."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Mlp(8) for _ in range(3)])
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        for i, block in enumerate(self.blocks):
            if i != 1 or self.calls == 1:
                x = block(x)
        return x.sum()


def test_a_block_that_stops_running_is_an_error_that_says_so() -> None:
    with pytest.raises(ProfileError, match=r"blocks \[.blocks.1.\] did not run in this step.*stochastic depth.*holds when"):
        remat.profile(Skipping(), torch.randn(4, 8), loss_fn=_sum_loss, repeats=1)


class Cross(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.q, self.kv, self.mlp = nn.Linear(d, d), nn.Linear(d, d), Mlp(d)

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        attn = torch.softmax(self.q(x) @ self.kv(memory).transpose(1, 2), dim=-1)
        return self.mlp(x + attn @ memory)


class EncoderDecoder(nn.Module):
    """An encoder, then work between the stacks that keeps bytes for the backward (a wide bridge,
    the decoder's embedding), then a decoder whose every block reads the encoder's output."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, d)
        self.encoder = nn.ModuleList([Mlp(d) for _ in range(2)])
        self.bridge = nn.Sequential(nn.Linear(d, 8 * d), nn.GELU(), nn.Linear(8 * d, d))
        self.decoder = nn.ModuleList([Cross(d) for _ in range(3)])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.encoder:
            h = block(h)
        memory = self.bridge(h)
        x = self.embed(ids.flip(1))
        for block in self.decoder:
            x = block(x, memory)
        return x.pow(2).mean()


@pytest.mark.slow  # 25 s
def test_every_mixed_plan_of_an_encoder_decoder_is_predicted_exactly() -> None:
    """Work between the stacks (a bridge, a block by what runs: NOTE [ Blocks by what runs ]), and
    every block of the decoder reads the encoder's output: all 64 plans of keep and recompute are
    predicted to the byte."""
    torch.manual_seed(0)
    model = EncoderDecoder()
    batch = torch.randint(0, 50, (8, 64), generator=torch.Generator().manual_seed(1))
    prof = remat.profile(model, batch, loss_fn=_sum_loss, repeats=1)
    names = [b.name for b in prof.blocks]
    assert names == ["encoder.0", "encoder.1", "bridge", "decoder.0", "decoder.1", "decoder.2"]  # what runs
    modules = dict(model.named_modules())
    for choice in itertools.product(("keep", "recompute"), repeat=len(names)):
        for name, option in zip(names, choice):
            if option != "keep":
                checkpoint_module(modules[name], mode=option)
        measured = measure_step(model, batch, loss_fn=_sum_loss, repeats=0).peak_bytes
        for name in names:
            uncheckpoint_module(modules[name])
        assert remat.estimate(prof, dict(zip(names, choice))).peak_bytes == measured, choice
