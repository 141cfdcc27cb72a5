"""Reporting: tables against golden text, plots as PNGs of the promised size, errors that teach.

Golden files live in tests/golden/ and change only on purpose: rerun with REMAT_UPDATE_GOLDEN=1 to
rewrite them, then read the diff.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import pytest

from remat.measure.step_memory import StepMemory, TimelinePoint
from remat.records import BlockProfile, Estimate, OptionCost, Plan, Profile, Segment
from remat.report import (
    ComparisonRow,
    FrontierPoint,
    comparison_table,
    markdown_table,
    plan_table,
    plot_frontier,
    plot_timeline,
    profile_table,
    render_text,
)
from remat.units import axis_unit as _unit

GOLDEN = Path(__file__).parent / "golden"
MiB = 2**20
GiB = 2**30


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("REMAT_UPDATE_GOLDEN") == "1":
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
        return
    if not path.exists():
        pytest.fail(f"no golden file {path}; create it with REMAT_UPDATE_GOLDEN=1 and review it")
    assert text == path.read_text(), (
        f"{name} changed; if on purpose, rerun with REMAT_UPDATE_GOLDEN=1"
    )


# --- hand-made records --------------------------------------------------------------------------


def _cost(kept_mib: float, extra_ms: float) -> OptionCost:
    kept = int(kept_mib * MiB)
    return OptionCost(
        kept_bytes=kept, fwd_peak_bytes=kept // 4, bwd_peak_bytes=kept // 2, extra_ms=extra_ms
    )


def make_profile(*, kinds: tuple[str, ...] = ("Block",) * 4, offload: bool = False) -> Profile:
    blocks = []
    for i, kind in enumerate(kinds):
        options = {
            "keep": _cost(48, 0.0),
            "selective": _cost(20, 1.1),
            "recompute": _cost(4, 3.21 + i),
        }
        if offload:
            options |= {"offload": _cost(0.5, 0.8), "recompute_offload": _cost(0.25, 4.0)}
        blocks.append(
            BlockProfile(
                name=f"layers.{i}",
                kind=kind,
                param_bytes=7 * MiB,
                grad_bytes=7 * MiB,
                input_bytes=4 * MiB,
                fwd_ms=3.21 + i,
                bwd_ms=6.4 + 2 * i,
                options=options,
            )
        )
    pre = Segment(
        kept_bytes=12 * MiB,
        fwd_peak_bytes=MiB,
        bwd_peak_bytes=MiB,
        grad_bytes=MiB,
        fwd_ms=0.5,
        bwd_ms=0.8,
    )
    post = dataclasses.replace(pre, kept_bytes=96 * MiB, fwd_ms=4.0, bwd_ms=7.5)
    return Profile(
        model="GPT",
        fingerprint="f00d",
        device="cpu",
        mode="measured",
        dtype="float32",
        batch_shape=[8, 512],
        base_bytes=180 * MiB,
        param_bytes=60 * MiB,
        optimizer_bytes=120 * MiB,
        batch_bytes=32 * 1024,
        optimizer_peak_bytes=10 * MiB,
        pre=pre,
        post=post,
        blocks=blocks,
        plain_peak_bytes=600 * MiB,
        plain_step_ms=123.4,
    )


def make_plan(*, budget_bytes: int | None = 400 * MiB) -> Plan:
    return Plan(
        choices={
            "layers.0": "recompute",
            "layers.1": "selective",
            "layers.2": "keep",
            "layers.3": "keep",
        },
        budget_bytes=budget_bytes,
        method="optimal",
        estimate=Estimate(
            peak_bytes=390 * MiB, peak_phase="backward of layers.3", step_ms=135.2, overhead=0.0956
        ),
        model="GPT",
        fingerprint="f00d",
        device="cpu",
        dtype="float32",
        batch_shape=[8, 512],
    )


COMPARISON = [
    ComparisonRow(
        label="none", method="none", measured_peak_bytes=600 * MiB, overhead=0.0, grads_equal=True
    ),
    ComparisonRow(
        label="remat 60%",
        method="optimal",
        budget_bytes=400 * MiB,
        predicted_peak_bytes=390 * MiB,
        measured_peak_bytes=395 * MiB,
        overhead=0.101,
        fits=True,
        grads_equal=True,
    ),
    ComparisonRow(
        label="remat 40%",
        method="optimal",
        budget_bytes=240 * MiB,
        predicted_peak_bytes=238 * MiB,
        measured_peak_bytes=246 * MiB,
        overhead=0.287,
        fits=False,
        grads_equal=True,
    ),
    ComparisonRow(
        label="every 2nd",
        method="every_k",
        predicted_peak_bytes=410 * MiB,
        measured_peak_bytes=420 * MiB,
        overhead=0.17,
        grads_equal=False,
    ),
]


def frontier_points(scale: int = MiB) -> list[FrontierPoint]:
    """A realistic frontier: 600 MiB plain down to 250 MiB for 0..35% more step time."""
    optimal = [(100, 600, 0.0, 590), (85, 515, 0.03, 505), (70, 425, 0.08, 415), (60, 365, 0.13, 350),
               (50, 305, 0.19, 295), (45, 275, 0.26, 270), (42, 250, 0.35, 248)]  # fmt: skip
    points = [
        FrontierPoint(label=f"remat {share}%", method="optimal", peak_bytes=peak * scale,
                      overhead=over, predicted_peak_bytes=pred * scale)
        for share, peak, over, pred in optimal
    ]  # fmt: skip
    return [
        *points,
        FrontierPoint(label="none", method="none", peak_bytes=600 * scale, overhead=0.0),
        FrontierPoint(
            label="every block",
            method="all",
            peak_bytes=260 * scale,
            overhead=0.33,
            predicted_peak_bytes=255 * scale,
        ),
        FrontierPoint(label="every 2nd", method="every_k", peak_bytes=420 * scale, overhead=0.17),
        FrontierPoint(
            label="torch.compile 0.5",
            method="torch.compile 0.5",
            peak_bytes=330 * scale,
            overhead=0.12,
        ),
    ]


def step_memory(
    *, base: int, rise: int, bwd_extra: int, grads: int, n: int = 900, ms: float = 0.7
) -> StepMemory:
    """A made-up step: the forward climbs in small saw teeth, the backward releases, the optimizer
    briefly holds temporaries."""
    points = []
    n_fwd, n_bwd = int(n * 0.4), int(n * 0.5)
    for i in range(n):
        if i < n_fwd:
            tooth = (i % 30) / 30 * 0.05 * rise
            live, phase = base + rise * i / n_fwd + tooth, "forward"
        elif i < n_fwd + n_bwd:
            j = (i - n_fwd) / n_bwd
            live, phase = base + rise * (1 - j) + bwd_extra * (1 - j) ** 0.5 + grads * j, "backward"
        else:
            live, phase = base + grads + (grads // 2 if i < n - 30 else 0), "optimizer"
        points.append(TimelinePoint(t_ms=i * ms, live_bytes=int(live), phase=phase))
    peak = max(p.live_bytes for p in points)
    return StepMemory(
        device="cpu",
        peak_bytes=peak,
        kept_bytes=rise,
        base_bytes=base,
        param_bytes=base // 3,
        grad_bytes=grads,
        optimizer_bytes=base // 3,
        batch_bytes=MiB,
        forward_peak_bytes=peak,
        backward_peak_bytes=peak,
        optimizer_peak_bytes=base + grads + grads // 2,
        step_ms=100.0,
        timeline=points,
    )


# --- tables -------------------------------------------------------------------------------------


def test_profile_table_golden() -> None:
    check_golden("profile_table.txt", render_text(profile_table(make_profile())))


def test_profile_table_mixed_kinds_and_offload_golden() -> None:
    profile = make_profile(kinds=("Block", "Block", "MoEBlock", "Block"), offload=True)
    profile = dataclasses.replace(profile, device="cuda", fsdp=True, world_size=8)
    check_golden("profile_table_offload.txt", render_text(profile_table(profile), width=120))


def test_plan_table_with_profile_golden() -> None:
    check_golden("plan_table.txt", render_text(plan_table(make_plan(), make_profile())))


def test_plan_table_without_profile_golden() -> None:
    check_golden("plan_table_plain.txt", render_text(plan_table(make_plan(budget_bytes=None))))


def test_comparison_table_golden() -> None:
    check_golden("comparison_table.txt", render_text(comparison_table(COMPARISON)))


def test_render_text_has_no_colour_and_no_trailing_spaces() -> None:
    text = render_text(comparison_table(COMPARISON), width=100)
    assert "\x1b[" not in text
    assert all(line == line.rstrip() for line in text.splitlines())
    assert max(len(line) for line in text.splitlines()) <= 100


def test_plan_table_totals() -> None:
    text = render_text(plan_table(make_plan(), make_profile()))
    total = next(line for line in text.splitlines() if line.strip().startswith("total"))
    # recompute 4 + selective 20 + keep 48 + keep 48 MiB; extra 3.21 + 1.10 ms
    assert "120.00 MiB" in total and "4.31" in total


def test_plan_table_refuses_another_models_profile() -> None:
    other = dataclasses.replace(make_profile(), fingerprint="beef", model="Llama")
    with pytest.raises(ValueError, match=r"fingerprint f00d.*Llama.*fingerprint beef"):
        plan_table(make_plan(), other)


def test_comparison_error_is_measured_against_predicted() -> None:
    row = dataclasses.replace(
        COMPARISON[1], predicted_peak_bytes=400 * MiB, measured_peak_bytes=420 * MiB
    )
    assert "+5.0%" in render_text(comparison_table([row]))
    row = dataclasses.replace(row, measured_peak_bytes=380 * MiB)
    assert "-5.0%" in render_text(comparison_table([row]))


# --- markdown -----------------------------------------------------------------------------------


def test_markdown_table_golden() -> None:
    rows = [
        ["remat 60%", "395.00 MiB", "+10.1%", "✓"],
        ["every 2nd", "420.00 MiB", "+17.0%", "✗"],
        ["a | b", "1 B", "+0.0%", "—"],
    ]
    text = markdown_table(
        ["plan", "peak", "overhead", "fits"], rows, align=["left", "right", "right", "center"]
    )
    check_golden("markdown_table.md", text)


def test_markdown_table_shape() -> None:
    text = markdown_table(["a", "b"], [["1", "2"]])
    assert text == "| a   | b   |\n| --- | --- |\n| 1   | 2   |\n"


@pytest.mark.parametrize(
    ("headers", "rows", "align", "match"),
    [
        ([], [], None, "at least one column"),
        (["a", "b"], [["1"]], None, "row 0 has 1 cells but there are 2 headers"),
        (["a"], [["1"]], ["middle"], "one of 'left', 'right', 'center'"),
        (["a", "b"], [["1", "2"]], ["left"], "per column"),
    ],
)
def test_markdown_table_errors(
    headers: list[str], rows: list[list[str]], align: list[str] | None, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        markdown_table(headers, rows, align=align)


# --- plots --------------------------------------------------------------------------------------


def _png_shape(path: Path) -> tuple[int, ...]:
    from matplotlib.image import imread

    assert path.stat().st_size > 10_000  # a real picture, not an empty canvas
    return tuple(imread(str(path)).shape)


def test_plot_frontier_writes_a_1200x750_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = plot_frontier(frontier_points(), path=tmp_path / "frontier.png", budget_bytes=400 * MiB,
                        title="GPT, batch 8×512, CPU")  # fmt: skip
    assert out == tmp_path / "frontier.png"
    assert _png_shape(out) == (750, 1200, 4)


@pytest.mark.parametrize("which", ["optimal only", "baselines only", "one point", "GiB"])
def test_plot_frontier_variants(tmp_path: Path, which: str) -> None:
    pytest.importorskip("matplotlib")
    points = frontier_points()
    if which == "optimal only":
        points = [p for p in points if p.method == "optimal"]
    elif which == "baselines only":
        points = [p for p in points if p.method != "optimal"]
    elif which == "one point":
        points = points[:1]
    else:
        points = frontier_points(scale=40 * MiB)  # 24 GiB down to 10 GiB
    out = plot_frontier(points, path=str(tmp_path / "f.png"))
    assert _png_shape(out) == (750, 1200, 4)


def test_plot_timeline_writes_a_1200x750_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    plain = step_memory(base=180 * MiB, rise=380 * MiB, bwd_extra=30 * MiB, grads=60 * MiB)
    plan = step_memory(base=180 * MiB, rise=150 * MiB, bwd_extra=60 * MiB, grads=60 * MiB, ms=0.95)
    out = plot_timeline(
        [("plain", plain), ("remat 60%", plan)], path=tmp_path / "t.png", budget_bytes=400 * MiB
    )
    assert _png_shape(out) == (750, 1200, 4)


def test_plot_timeline_single_series_in_gib(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    mem = step_memory(base=20 * GiB, rise=30 * GiB, bwd_extra=2 * GiB, grads=6 * GiB, n=40)
    out = plot_timeline([("plain", mem)], path=tmp_path / "t.png", title="one step")
    assert _png_shape(out) == (750, 1200, 4)


def test_plot_errors_teach(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    with pytest.raises(ValueError, match="at least one FrontierPoint"):
        plot_frontier([], path=tmp_path / "f.png")
    with pytest.raises(ValueError, match="at least one"):
        plot_timeline([], path=tmp_path / "t.png")
    empty = dataclasses.replace(
        step_memory(base=MiB, rise=MiB, bwd_extra=0, grads=MiB), timeline=[]
    )
    with pytest.raises(ValueError, match=r"\['plain'\] have no timeline"):
        plot_timeline([("plain", empty)], path=tmp_path / "t.png")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        plot_frontier(frontier_points(), path=tmp_path / "missing" / "f.png")


def test_plots_without_matplotlib_say_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"pip install 'remat\[plot\]'"):
        plot_frontier(frontier_points(), path=tmp_path / "f.png")


def test_axis_unit_follows_magnitude() -> None:
    assert _unit(600 * MiB) == ("MiB", MiB)
    assert _unit(3 * GiB) == ("GiB", GiB)
    assert _unit(512 * 1024) == ("KiB", 1024)
