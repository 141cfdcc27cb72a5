"""Reporting: pictures and tables for people. The only place where bytes become "1.23 GiB".

Everything here is a pure function of records or plain numbers: nothing runs a model. Tables are
``rich.table.Table`` objects (``render_text`` turns one into plain text for logs and golden tests);
the plots are in ``remat.report.plots``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from io import StringIO
from typing import TYPE_CHECKING

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from remat.errors import InvalidValue
from remat.plan.handovers import handed_over, handovers
from remat.plan.head import head_extra_ms
from remat.records import Plan, Profile, Segment
from remat.units import axis_unit, format_bytes
from remat.vocabulary import in_option_order

if TYPE_CHECKING:
    pass

__all__ = [
    "ComparisonRow",
    "comparison_table",
    "markdown_table",
    "plan_table",
    "profile_table",
    "render_text",
]

_OPTION_STYLES = {
    "keep": "green",
    "selective": "cyan",
    "recompute": "yellow",
    "offload": "magenta",
    "recompute_offload": "red",
}


@dataclass(frozen=True, kw_only=True)
class ComparisonRow:
    """One plan checked against plain PyTorch: one row of ``comparison_table``."""

    label: str
    """What the plan is called, e.g. ``"remat 70%"`` or ``"every block"``."""
    method: str
    """The solver or baseline that produced it (``"optimal"`` rows are shown in bold)."""
    budget_bytes: int | None = None
    """The budget it was solved for (None for methods that take no budget)."""
    predicted_peak_bytes: int | None = None
    """The cost model's predicted peak bytes (None when not predicted)."""
    measured_peak_bytes: int
    """Measured peak bytes of the step."""
    overhead: float | None
    """Measured step time over the plain step's, minus one (0.12 = 12% slower); None when the
    timing was withheld (a machine too loaded for it to mean anything)."""
    fits: bool | None = None
    """Whether the measured peak is within the budget (None without a budget)."""
    grads_equal: bool | None = None
    """Whether the gradients equal the plain step's (None when not checked)."""
    plain_ran: bool = True
    """Whether the plain step ran; False: the overhead is against its predicted time and the
    gradients against a reference step that fits (NOTE [ Verifying without the plain step ])."""


# --- tables ------------------------------------------------------------------------------------


def render_text(table: Table, width: int = 100) -> str:
    """``table`` as plain text, no colour, ``width`` columns, no trailing spaces."""
    out = StringIO()
    console = Console(
        file=out, width=width, color_system=None, force_terminal=False, legacy_windows=False
    )
    console.print(table)
    return "\n".join(line.rstrip() for line in out.getvalue().splitlines()) + "\n"


def plan_table(plan: Plan, profile: Profile | None = None) -> Table:
    """One row per block: its option, and with ``profile`` the bytes it keeps and the time it adds.

    The footer holds the plan's prediction (peak and where it falls, budget, step time and
    overhead) and, with a profile, the blocks' total kept bytes and extra milliseconds.
    """
    blocks = {}
    if profile is not None:
        if profile.fingerprint != plan.fingerprint:
            raise InvalidValue(
                f"the plan was made for model {plan.model} (fingerprint {plan.fingerprint}) but the "
                f"profile is of {profile.model} (fingerprint {profile.fingerprint}); pass the "
                "profile the plan was solved from"
            )
        if handovers(profile) and set(plan.choices) == {b.name for b in profile.blocks}:
            profile = handed_over(profile, [plan.choices[b.name] for b in profile.blocks])  # as estimated
        blocks = {b.name: b for b in profile.blocks}
    est = plan.estimate
    budget = "none" if plan.budget_bytes is None else format_bytes(plan.budget_bytes)
    names = ["predicted peak", "peak falls in", "budget", "predicted step"]
    values = [
        format_bytes(est.peak_bytes),
        est.peak_phase,
        budget,
        f"{est.step_ms:.1f} ms ({_percent(est.overhead)})",
    ]
    order = list(plan.choices)
    spans = [(order.index(a), order.index(b), a, b) for a, b in plan.segments if a in order and b in order]
    segs = f", {len(spans)} segments" if spans else ""
    table = Table(
        title=f"plan for {plan.model}: {plan.method}, {len(plan.choices)} blocks{segs}",
        box=box.SIMPLE_HEAD,
        collapse_padding=True,
        show_footer=True,
    )
    rows: list[list[str | Text]] = []
    kept_total, extra_total = 0, 0.0
    for i, (name, option) in enumerate(plan.choices.items()):
        inside = [sp for sp in spans if sp[0] <= i <= sp[1]]
        shown = option
        if inside:  # the innermost segment holding it (a segment recomputes its kept blocks)
            _, _, a, b = min(inside, key=lambda sp: sp[1] - sp[0])
            shown = f"{option} (segment {a}..{b})"
        row: list[str | Text] = [name, Text(shown, style=_OPTION_STYLES.get(option, ""))]
        if profile is not None:
            cost = blocks[name].options.get(option) if name in blocks else None
            if cost is None:
                row += ["—", "—"]
            else:
                kept_total += cost.kept_bytes
                extra_total += cost.extra_ms
                row += [format_bytes(cost.kept_bytes), f"{cost.extra_ms:.2f}"]
        rows.append(row)
    if plan.head != "keep":  # NOTE [ The head's options ] in remat.records
        row = [f"(head) {plan.head_module}", Text(plan.head)]
        if profile is not None:
            seg = profile.head_options.get(plan.head)
            ms = head_extra_ms(profile, plan.head) if seg is not None else 0.0
            extra_total += ms
            row += [format_bytes(seg.kept_bytes), f"{ms:.2f}"] if seg is not None else ["—", "—"]
        rows.append(row)
    for name in plan.tied:  # NOTE [ Every call of a tied module ] in remat.measure.tied: in the profile's steps
        rows.append([f"(tied) {name}", Text("recompute, every call", style=_OPTION_STYLES.get("recompute", "")),
                     *(["—", "—"] if profile is not None else [])])
    if profile is not None:
        names.insert(0, "total")
        values.insert(0, "")
    table.add_column("block", footer="\n".join(names), no_wrap=True)
    table.add_column("option", footer="\n".join(values))
    if profile is not None:
        pad = "\n" * (len(names) - 1)
        table.add_column("kept", justify="right", footer=format_bytes(kept_total) + pad)
        table.add_column("extra ms", justify="right", footer=f"{extra_total:.2f}" + pad)
    for row in rows:
        table.add_row(*row)
    return table


def profile_table(profile: Profile) -> Table:
    """Per block: parameter and input bytes, kept bytes under each option, fwd and bwd ms.

    The blocks' kind is a column when they differ, else part of the title. Bytes share one unit
    (named in the caption) so the columns compare at a glance. The parts before and after the
    blocks are rows of their own; their kept bytes do not depend on the option.
    """
    options = in_option_order({o for b in profile.blocks for o in b.options})
    sizes = [profile.pre.kept_bytes, profile.post.kept_bytes]
    for b in profile.blocks:
        sizes += [b.param_bytes, b.input_bytes, *(c.kept_bytes for c in b.options.values())]
    unit, scale = axis_unit(max(sizes))

    def num(n: int) -> str:
        return f"{n / scale:.2f}"

    shape = "×".join(str(d) for d in profile.batch_shape)
    kinds = {b.kind for b in profile.blocks}
    mixed = len(kinds) > 1  # one kind goes in the title, several get a column
    of_kind = "" if mixed or not kinds else f" of {kinds.pop()}"
    ranks = f" · fsdp × {profile.world_size}" if profile.fsdp else ""
    if not profile.fsdp and profile.world_size > 1:
        ranks = f" · {profile.world_size} ranks"
    table = Table(
        title="\n".join(
            [
                f"{profile.model} · {profile.device} · {profile.mode} · {profile.dtype} · "
                f"batch {shape}{ranks}",
                f"{len(profile.blocks)} blocks{of_kind} · plain step"
                f"{'' if profile.plain_ran else ' (predicted: over the budget, not run)'}: peak "
                f"{format_bytes(profile.plain_peak_bytes)}, {profile.plain_step_ms:.1f} ms",
                f"base {format_bytes(profile.base_bytes)} (params {format_bytes(profile.param_bytes)}"
                f", optimizer {format_bytes(profile.optimizer_bytes)}, batch "
                f"{format_bytes(profile.batch_bytes)})",
            ]
        ),
        caption=f"bytes in {unit} · kept = held from a block's forward to its backward",
        box=box.SIMPLE_HEAD,
        collapse_padding=True,
        min_width=80,
    )
    # numbers and their headers never fold; when space runs out, the kind column gives way first
    table.add_column("block", no_wrap=True)
    if mixed:
        table.add_column("kind", overflow="ellipsis")
    headers = ["params", "input", *("kept\n" + o.replace("_", "\n") for o in options)]
    for header in [*headers, "fwd ms", "bwd ms"]:
        table.add_column(header, justify="right", no_wrap=True)

    def segment_row(name: str, seg: Segment) -> list[str]:
        kept = [num(seg.kept_bytes)] * len(options)
        return [name, *[""] * (2 + mixed), *kept, f"{seg.fwd_ms:.2f}", f"{seg.bwd_ms:.2f}"]

    table.add_row(*segment_row("(before blocks)", profile.pre), end_section=True)
    for b in profile.blocks:
        kept = [num(b.options[o].kept_bytes) if o in b.options else "—" for o in options]
        table.add_row(
            b.name,
            *([b.kind] if mixed else []),
            num(b.param_bytes),
            num(b.input_bytes),
            *kept,
            f"{b.fwd_ms:.2f}",
            f"{b.bwd_ms:.2f}",
            end_section=b is profile.blocks[-1],
        )
    table.add_row(*segment_row("(after blocks)", profile.post))
    for name, seg in profile.head_options.items():  # NOTE [ The head's options ] in remat.records
        table.add_row(*segment_row(f"(after blocks, head {name})", seg))
    return table


def comparison_table(rows: Sequence[ComparisonRow]) -> Table:
    """Plans side by side: budget, predicted and measured peak, error, overhead, fit, gradients."""
    table = Table(box=box.SIMPLE_HEAD, collapse_padding=True)
    table.add_column("plan")
    for header in ("budget", "predicted peak", "measured peak", "error", "overhead"):
        table.add_column(header, justify="right")
    table.add_column("fits", justify="center")
    table.add_column("gradients", justify="center")
    for r in rows:
        if r.predicted_peak_bytes:
            error = _percent(r.measured_peak_bytes / r.predicted_peak_bytes - 1)
        else:
            error = "—"
        table.add_row(
            r.label,
            "—" if r.budget_bytes is None else format_bytes(r.budget_bytes),
            "—" if r.predicted_peak_bytes is None else format_bytes(r.predicted_peak_bytes),
            format_bytes(r.measured_peak_bytes),
            error,
            "—" if r.overhead is None else _percent(r.overhead) + ("" if r.plain_ran else "†"),
            _mark(r.fits, "✓", "✗"),
            _mark(r.grads_equal, "=" if r.plain_ran else "=†", "≠"),
            style="bold" if r.method == "optimal" else None,
        )
    table.caption = "error = measured vs predicted peak · overhead = step time vs the plain step"
    if not all(r.plain_ran for r in rows):
        table.caption += (" · † the plain step does not fit the budget and did not run: overhead vs its "
                          "predicted time, gradients vs a reference step that fits")
    return table


def _percent(ratio: float) -> str:
    return f"{ratio * 100:+.1f}%"


def _mark(value: bool | None, yes: str, no: str) -> Text:
    if value is None:
        return Text("—", style="dim")
    return Text(yes, style="green") if value else Text(no, style="bold red")


def markdown_table(
    headers: Sequence[str], rows: Sequence[Sequence[str]], *, align: Sequence[str] | None = None
) -> str:
    """A GitHub-markdown table, columns padded so the source reads as a table too.

    ``align`` gives one of ``"left"``, ``"right"``, ``"center"`` per column (default all left).
    """
    n = len(headers)
    if n == 0:
        raise InvalidValue("a markdown table needs at least one column; got no headers")
    for i, row in enumerate(rows):
        if len(row) != n:
            raise InvalidValue(
                f"row {i} has {len(row)} cells but there are {n} headers: {list(row)!r}"
            )
    align = ["left"] * n if align is None else list(align)
    bad = [a for a in align if a not in ("left", "right", "center")]
    if len(align) != n or bad:
        raise InvalidValue(
            f"align takes one of 'left', 'right', 'center' per column ({n} columns), got {align!r}"
        )
    cells = [[_md_cell(c) for c in headers], *[[_md_cell(c) for c in row] for row in rows]]
    widths = [max(3, *(len(r[i]) for r in cells)) for i in range(n)]
    rules = {
        "left": lambda w: "-" * w,
        "right": lambda w: "-" * (w - 1) + ":",
        "center": lambda w: ":" + "-" * (w - 2) + ":",
    }

    def line(row: Sequence[str]) -> str:
        padded = [
            c.rjust(w) if a == "right" else c.center(w) if a == "center" else c.ljust(w)
            for c, w, a in zip(row, widths, align)
        ]
        return "| " + " | ".join(padded) + " |"

    rule = "| " + " | ".join(rules[a](w) for a, w in zip(align, widths)) + " |"
    return "\n".join([line(cells[0]), rule, *(line(r) for r in cells[1:])]) + "\n"


def _md_cell(value: object) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


