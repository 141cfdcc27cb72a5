"""Pictures for people: the budget/overhead frontier and a step's memory timeline.

Plots need the optional ``matplotlib`` (``pip install 'remat[plot]'``), imported on first use.

# NOTE [ Plots without pyplot ]
The plots build a ``matplotlib.figure.Figure`` and attach an Agg canvas to it by hand instead of
going through ``pyplot``: no global figure registry to leak, no backend switch for the caller's
process, safe to call from a worker thread. The figure size and dpi are fixed and the layout is
"constrained" (not ``bbox_inches="tight"``), so a picture's pixel size is known in advance.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from remat.errors import InvalidValue, MissingDependency, MissingFile
from remat.files import atomic_write
from remat.units import axis_unit, format_bytes

if TYPE_CHECKING:
    from remat.measure.step_memory import StepMemory

__all__ = ["DPI", "FIGSIZE_IN", "FrontierPoint", "plot_frontier", "plot_timeline"]

#: Every plot is this size: 8 x 5 inches at 150 dpi = 1200 x 750 pixels.
FIGSIZE_IN = (8.0, 5.0)
DPI = 150

_BASELINE_MARKERS = ("s", "^", "D", "v", "P", "X", "*", "h")
_PHASE_COLORS = {"forward": "#4C72B0", "backward": "#DD8452", "optimizer": "#55A868"}


@dataclass(frozen=True, kw_only=True)
class FrontierPoint:
    """One measured plan on the memory / time plane."""

    label: str
    """What the point is called on the plot, e.g. ``"remat 70%"`` or ``"every block"``."""
    method: str
    """``"optimal"`` for remat's plans (drawn as one curve); anything else is a baseline or a peer
    (``"none"``, ``"all"``, ``"every_k"``, ``"torch.compile 0.5"``), drawn as its own point."""
    peak_bytes: int
    """Measured peak bytes of the step."""
    overhead: float
    """Measured step time over the plain step's, minus one (0.12 = 12% slower)."""
    predicted_peak_bytes: int | None = None
    """The cost model's predicted peak bytes, when there is one."""


def plot_frontier(
    points: Sequence[FrontierPoint],
    *,
    path: str | Path,
    title: str | None = None,
    budget_bytes: int | None = None,
) -> Path:
    """Peak memory against step-time overhead: remat's plans as a curve, baselines as points.

    Predicted peaks, where given, are drawn as hollow markers joined to the measured ones. Writes a
    1200 x 750 PNG to ``path`` and returns it.
    """
    if not points:
        raise InvalidValue("plot_frontier needs at least one FrontierPoint; got none")
    fig, ax = _figure()
    every = [p.peak_bytes for p in points] + [p.predicted_peak_bytes or 0 for p in points]
    unit, scale = axis_unit(max([*every, budget_bytes or 0]))
    optimal = sorted((p for p in points if p.method == "optimal"), key=lambda p: p.peak_bytes)
    others = [p for p in points if p.method != "optimal"]
    texts = []
    if optimal:
        ax.plot(
            [p.overhead * 100 for p in optimal],
            [p.peak_bytes / scale for p in optimal],
            "-o", color="C0", lw=2, ms=6, zorder=3, label="remat (optimal plans)",
        )  # fmt: skip
        every_nth = -(-len(optimal) // 10)  # at most ~10 labels on the curve, ends included
        for i, p in enumerate(optimal):
            if i % every_nth == 0 or i == len(optimal) - 1:
                x, y = p.overhead * 100, p.peak_bytes / scale
                texts.append(_label(ax, p.label, x, y, "C0", small=True))
    for i, p in enumerate(others):
        color = f"C{i % 9 + 1}"
        x, y = p.overhead * 100, p.peak_bytes / scale
        ax.plot([x], [y], ls="none", marker=_BASELINE_MARKERS[i % len(_BASELINE_MARKERS)],
                ms=9, color=color, zorder=4, label=p.label)  # fmt: skip
        texts.append(_label(ax, p.label, x, y, color, small=False))
    predicted = [p for p in points if p.predicted_peak_bytes is not None]
    for p in predicted:
        x, measured, pred = (
            p.overhead * 100,
            p.peak_bytes / scale,
            (p.predicted_peak_bytes or 0) / scale,
        )
        ax.plot([x, x], [measured, pred], ":", color="0.55", lw=1, zorder=2)
        ax.plot([x], [pred], ls="none", marker="o", ms=7, mfc="none", mec="0.35", zorder=2)
    if predicted:
        ax.plot([], [], ls="none", marker="o", ms=7, mfc="none", mec="0.35", label="predicted peak")
    if budget_bytes is not None:
        ax.axhline(budget_bytes / scale, ls="--", color="crimson", lw=1.3, zorder=1,
                   label=f"budget {format_bytes(budget_bytes)}")  # fmt: skip
    ax.set_xlabel("step-time overhead vs. the plain step (%)")
    ax.set_ylabel(f"measured peak memory ({unit})")
    ax.set_title(title or "Peak memory against step time")
    ax.set_ylim(bottom=0, top=ax.get_ylim()[1] * 1.08)
    ax.margins(x=0.1)
    ax.legend(loc="upper right", fontsize=8, framealpha=0.9)
    _declutter(fig, texts)
    return _save(fig, path)


def plot_timeline(
    series: Sequence[tuple[str, StepMemory]],
    *,
    path: str | Path,
    budget_bytes: int | None = None,
    title: str | None = None,
) -> Path:
    """Live bytes through one training step for each series, on a 0..1 time axis.

    Time is normalised to each step's length because profiled time (on CPU especially) is slower
    and uneven; the phases (forward, backward, optimizer) of the first series are shaded. Each
    series' peak is marked with its value. Writes a 1200 x 750 PNG to ``path`` and returns it.
    """
    if not series:
        raise InvalidValue("plot_timeline needs at least one (name, StepMemory) pair; got none")
    empty = [name for name, mem in series if not mem.timeline]
    if empty:
        raise InvalidValue(
            f"series {empty} have no timeline; measure them with remat.measure_step, which records one"
        )
    fig, ax = _figure()
    top = max(max(pt.live_bytes for pt in mem.timeline) for _, mem in series)
    unit, scale = axis_unit(max(top, budget_bytes or 0))
    _shade_phases(ax, series[0][1])
    texts = []
    for i, (name, mem) in enumerate(series):
        t0, t1 = mem.timeline[0].t_ms, mem.timeline[-1].t_ms
        span = (t1 - t0) or 1.0
        xs = [(pt.t_ms - t0) / span for pt in mem.timeline]
        ys = [pt.live_bytes / scale for pt in mem.timeline]
        color = f"C{i}"
        ax.plot(xs, ys, drawstyle="steps-post", color=color, lw=1.6, label=name, zorder=3)
        k = max(range(len(ys)), key=ys.__getitem__)
        ax.plot([xs[k]], [ys[k]], "o", color=color, ms=6, zorder=4)
        peak = format_bytes(mem.timeline[k].live_bytes)
        texts.append(_label(ax, f"{name}: peak {peak}", xs[k], ys[k], color, small=False))
    fixed = []
    if budget_bytes is not None:
        y = budget_bytes / scale
        ax.axhline(y, ls="--", color="crimson", lw=1.3, zorder=2)
        budget_text = ax.annotate(
            f"budget {format_bytes(budget_bytes)}", (1.0, y), xycoords=("axes fraction", "data"),
            xytext=(-4, 3), textcoords="offset points", ha="right", va="bottom", color="crimson",
            fontsize=9,
        )  # fmt: skip
        fixed.append(budget_text)
    ax.set_xlim(0, 1)
    ax.set_ylim(bottom=0, top=max(top, budget_bytes or 0) / scale * 1.15)
    ax.set_xlabel("progress through the step (0 = start, 1 = end; profiled time, normalised)")
    ax.set_ylabel(f"live memory ({unit})")
    ax.set_title(title or "Memory through one training step")
    ax.legend(loc="upper left", fontsize=9, framealpha=0.9)
    _declutter(fig, texts, fixed=fixed)
    return _save(fig, path)


def _shade_phases(ax: Any, mem: StepMemory) -> None:
    t0, t1 = mem.timeline[0].t_ms, mem.timeline[-1].t_ms
    span = (t1 - t0) or 1.0
    runs: list[tuple[str, float, float]] = []
    for pt in mem.timeline:
        x = (pt.t_ms - t0) / span
        if runs and runs[-1][0] == pt.phase:
            runs[-1] = (pt.phase, runs[-1][1], x)
        else:
            if runs:  # the previous phase ends where this one starts
                runs[-1] = (runs[-1][0], runs[-1][1], x)
            runs.append((pt.phase, x, x))
    for phase, start, stop in runs:
        ax.axvspan(start, stop, color=_PHASE_COLORS.get(phase, "0.7"), alpha=0.08, lw=0, zorder=0)
        if stop - start > 0.04:
            ax.text((start + stop) / 2, 0.02, phase, transform=ax.get_xaxis_transform(),
                    ha="center", va="bottom", fontsize=9, color="0.3", zorder=1)  # fmt: skip


def _label(ax: Any, text: str, x: float, y: float, color: str, *, small: bool) -> Any:
    return ax.annotate(
        text, (x, y), xytext=(7, 6), textcoords="offset points", ha="left", va="bottom",
        fontsize=7.5 if small else 9, color=color, zorder=5,
        bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.75},
    )  # fmt: skip


# where a label may sit around its point, best first: offset in points, alignment
_PLACES = (
    (7, 4, "left", "bottom"), (7, -4, "left", "top"), (-7, 4, "right", "bottom"),
    (-7, -4, "right", "top"), (0, 9, "center", "bottom"), (0, -9, "center", "top"),
    (12, 16, "left", "bottom"), (12, -16, "left", "top"), (-12, 16, "right", "bottom"),
    (-12, -16, "right", "top"), (0, 24, "center", "bottom"), (0, -24, "center", "top"),
)  # fmt: skip


def _declutter(fig: Any, texts: list[Any], *, fixed: Sequence[Any] = ()) -> None:
    """Place each annotation where it covers no line, marker, legend or earlier label.

    Greedy: labels in order, each at the first of ``_PLACES`` that is free, else the least bad one.
    ``fixed`` are other artists (texts) that stay where they are and must not be covered.
    """
    if not texts:
        return
    import numpy as np
    from matplotlib.cbook import pts_to_poststep

    fig.draw_without_rendering()  # runs the layout, so that extents are final
    renderer = fig.canvas.get_renderer()
    ax = texts[0].axes
    frame = ax.get_window_extent(renderer)
    samples = [np.zeros((0, 2))]
    for line in ax.lines:  # every line and marker, as a point every ~3 pixels along it
        xy = line.get_transform().transform(np.asarray(line.get_xydata(), dtype=float))
        if len(xy) == 0:
            continue
        if line.get_drawstyle() == "steps-post" and len(xy) > 1:
            xy = np.asarray(pts_to_poststep(xy[:, 0], xy[:, 1])).T
        along = np.concatenate([[0.0], np.cumsum(np.hypot(*np.diff(xy, axis=0).T))])
        at = np.arange(0.0, along[-1] + 3.0, 3.0)
        samples.append(
            np.column_stack([np.interp(at, along, xy[:, 0]), np.interp(at, along, xy[:, 1])])
        )
    points = np.concatenate(samples)
    legend = ax.get_legend()
    placed = [a.get_window_extent(renderer) for a in [legend, *fixed] if a is not None]
    for text in texts:
        best: tuple[float, tuple[int, int, str, str]] | None = None
        for place in _PLACES:
            dx, dy, ha, va = place
            text.set_position((dx, dy))
            text.set_ha(ha)
            text.set_va(va)
            bb = text.get_window_extent(renderer).padded(3)
            out = bb.x0 < frame.x0 or bb.x1 > frame.x1 or bb.y0 < frame.y0 or bb.y1 > frame.y1
            hits = np.count_nonzero(
                (points[:, 0] > bb.x0) & (points[:, 0] < bb.x1)
                & (points[:, 1] > bb.y0) & (points[:, 1] < bb.y1)
            )  # fmt: skip
            cost = 1000.0 * out + 100.0 * sum(bb.overlaps(p) for p in placed) + hits
            if best is None or cost < best[0]:
                best = (cost, place)
            if cost == 0:
                break
        assert best is not None
        dx, dy, ha, va = best[1]
        text.set_position((dx, dy))
        text.set_ha(ha)
        text.set_va(va)
        placed.append(text.get_window_extent(renderer).padded(2))


def _figure() -> tuple[Any, Any]:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise MissingDependency(
            f"remat's plots need matplotlib, which is not installed ({e}); "
            "install it with: pip install 'remat[plot]'"
        ) from None
    fig = Figure(figsize=FIGSIZE_IN, dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)  # see NOTE [ Plots without pyplot ]
    ax = fig.add_subplot()
    ax.grid(True, color="0.88", lw=0.8, zorder=0)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    return fig, ax


def _save(fig: Any, path: str | Path) -> Path:
    path = Path(path)
    if not path.parent.is_dir():
        raise MissingFile(f"cannot write {path}: the folder {path.parent} does not exist")
    atomic_write(path, lambda f: fig.savefig(f, dpi=DPI, format=path.suffix.lstrip(".") or "png"))
    return path
