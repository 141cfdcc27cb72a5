"""The head's options, measured (NOTE [ The head's options ] in ``remat.records``).

``measure_heads`` finds the head of the step's loss path — a transformers causal LM's ``lm_head``
when the model is given labels, or the module a user's loss passes to
``remat.chunked_cross_entropy`` (NOTE [ A planned head ] in ``remat.manual.head``) — and measures
the step with that head chunked at a few chunk sizes, every block kept: the segment after the
blocks of each traced step, read as the profiler reads ``post`` (``attribute``), and its times
from steps timed in turns with the head as written, on the profiler's clock. ``add_heads`` puts
them into the profile: a head option's times are ``post``'s plus the difference measured in those
turns (in estimated mode, the roofline's times themselves).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from torch import nn

from remat.manual.head import noting_heads
from remat.manual.lm_head import (
    HEAD_KEEP,
    causal_lm_head,
    head_option_name,
    head_option_of,
    set_head,
)
from remat.measure.attribution import attribute_head
from remat.measure.runner import StepRunner, every_block
from remat.records import Profile, Segment

__all__ = ["HeadMeasures", "add_heads", "chunk_sizes", "head_option", "measure_heads"]

log = logging.getLogger(__name__)

#: Below this many tokens a head is not worth chunking (and chunks would be tiny).
MIN_TOKENS = 64


@dataclasses.dataclass(frozen=True, kw_only=True)
class HeadMeasures:
    """What ``measure_heads`` found: the head and each chunked option's segment and times."""

    name: str
    """The head module's qualified name."""
    causal_lm: bool
    """Whether it is a transformers causal LM's ``lm_head`` (its loss routed by remat)."""
    segments: dict[str, Segment]
    """Head option -> the segment after the blocks with it, its times as measured."""
    keep_fwd_ms: float | None
    """The head as written, forward, timed in the same turns (None in estimated mode)."""
    keep_bwd_ms: float | None
    """The same, backward."""


def chunk_sizes(tokens: int) -> list[int]:
    """The chunk sizes the profiler measures for a head of ``tokens`` tokens: a half, a quarter and
    an eighth of them, rounded up to a multiple of 8 (none below ``MIN_TOKENS`` tokens)."""
    if tokens < MIN_TOKENS:
        return []
    return sorted({8 * math.ceil(tokens / 2**k / 8) for k in (1, 2, 3)}, reverse=True)


def measure_heads(model: nn.Module, named: Sequence[tuple[str, nn.Module]], runner: StepRunner) -> HeadMeasures | None:
    """Find the head of the loss path and measure its chunked options (the module's docstring)."""
    found = _find(model, runner)
    if found is None:
        return None
    name, causal_lm, tokens = found
    sizes = chunk_sizes(tokens)
    if not sizes:
        return None
    options = [head_option_name(s) for s in sizes]

    def config(option: str) -> Callable[[], contextlib.AbstractContextManager[Any]]:
        return lambda: head_option(model, name, option, causal_lm)

    segments: dict[str, Segment] = {}
    times: list[dict[str, float]] = [{}]  # estimated mode: the traced steps' roofline times
    with every_block(named, "keep"):
        for option in options:
            with head_option(model, name, option, causal_lm):
                trace, hooks, roofline = runner.traced()
            segments[option] = attribute_head(trace, hooks, len(named))
            times.append(roofline)
        if not runner.estimated:
            times = runner.times([config(HEAD_KEEP), *(config(o) for o in options)])
    for option, t in zip(options, times[1:]):
        segments[option] = dataclasses.replace(segments[option], fwd_ms=t["post_fwd"], bwd_ms=t["post_bwd"])
    keep = None if runner.estimated else times[0]
    return HeadMeasures(
        name=name, causal_lm=causal_lm, segments=segments,
        keep_fwd_ms=keep["post_fwd"] if keep else None, keep_bwd_ms=keep["post_bwd"] if keep else None,
    )  # fmt: skip


def add_heads(profile: Profile, heads: HeadMeasures | None) -> Profile:
    """``profile`` with the head and its options (``post`` is the head as written)."""
    if heads is None:
        return profile
    options = {}
    for option, seg in heads.segments.items():
        fwd, bwd = seg.fwd_ms, seg.bwd_ms
        if heads.keep_fwd_ms is not None and heads.keep_bwd_ms is not None:
            fwd = profile.post.fwd_ms + fwd - heads.keep_fwd_ms
            bwd = profile.post.bwd_ms + bwd - heads.keep_bwd_ms
        options[option] = dataclasses.replace(seg, fwd_ms=fwd, bwd_ms=bwd)
    return dataclasses.replace(
        profile, head_module=heads.name, head_causal_lm=heads.causal_lm, head_options=options
    )


def _find(model: nn.Module, runner: StepRunner) -> tuple[str, bool, int] | None:
    """(the head's name, whether it is a causal LM's, its tokens), from one step that notes the
    heads ``chunked_cross_entropy`` receives; None when there is none, or more than one."""
    lm_head = causal_lm_head(model)
    names = {id(m): n for n, m in model.named_modules()}
    with noting_heads() as seen:
        if lm_head is not None:  # one chunk of every token: the call is made when labels are given
            with head_option(model, lm_head, head_option_name(2**40), True):
                runner.marked(lambda _: None)
        else:
            runner.marked(lambda _: None)
    if len(seen) != 1:
        if seen:
            log.info("the loss uses %d heads; remat plans one: no head options", len(seen))
        return None
    head, tokens = seen[0]
    name = names.get(id(head))
    if name is None:
        log.info("the head passed to chunked_cross_entropy is not a submodule of the model: no head options")
        return None
    return name, name == lm_head, tokens


@contextlib.contextmanager
def head_option(model: nn.Module, name: str, option: str, causal_lm: bool) -> Iterator[None]:
    """The head with ``option`` while the block runs; then as it was (a plan applied keeps its)."""
    before, routed = head_option_of(model, name)
    set_head(model, name, option, causal_lm=causal_lm)
    try:
        yield
    finally:
        set_head(model, name, before, causal_lm=routed)  # it clears the head first
