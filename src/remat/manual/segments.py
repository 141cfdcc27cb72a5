"""Segments: a run of consecutive blocks recomputed as one unit, applied to the unmodified model.

# NOTE [ A segment is one recompute frame over several calls ]
torch's non-reentrant checkpoint is a frame around one call: saved tensors are packed as
placeholders, and the first unpack in the backward re-runs the call and fills them. A segment is
the same frame spanning the calls of several blocks, opened and closed by the blocks themselves,
so that the user's forward (a loop over a ``ModuleList``, extra arguments, tuples) is untouched:
- the first block's call opens the frame, the last block's call closes it; while a block of the
  segment runs, ``saved_tensors_hooks`` turn what autograd saves into placeholders (between
  blocks, the user's own code saves as usual);
- each call is recorded: its arguments, where every tensor is either an output of an earlier
  call of the frame (found by identity: ``x = block(x)``, ``h = layer(h, mask)[0]``) or a tensor
  from outside, which the frame holds (the segment's input, masks, biases: what a checkpoint
  holds); the RNG states and the autocast state at the call;
- the first unpack in the backward replays the calls once, in order, under each call's RNG and
  autocast state, with the BatchNorm running statistics put back afterwards (NOTE [ BatchNorm in
  recompute ]), and fills the placeholders in the order they were packed; the replay stops as
  soon as the last one is filled, inside the block that saves it (as torch's early stop does:
  the rest of that block would only allocate its output).
Segments nest (the Revolve / rotor class of schedules): a segment inside another is a frame of
its own in the forward too, but what it holds (its input, the tensors from outside it) it holds
through the enclosing frame, as placeholders of that frame. So the original forward keeps only
the outermost segments' inputs; the outer replay fills, besides its own blocks' saved tensors,
the inner segment's input (and runs the inner blocks without keeping anything of them: a frame of
its own again, thrown away); the inner replay runs at the inner segment's own backward.
A block called out of its segment's order (twice, skipped, from outside) is an error that names
the segment and the block expected; the frames open in that thread are dropped with it, so the
next step starts clean.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import get_device_states

from remat.errors import CheckpointError, InvalidType, InvalidValue
from remat.manual.contexts import stop_passes_through, uncached_casts
from remat.manual.frames import Call, Done, Frame, autocast_state, walk

__all__ = ["SegmentForward", "Segments", "apply_segments", "remove_segments", "segments_of"]

_RECORD = "_remat_segment"


class Segments:
    """The segments of one applied plan over ``modules`` (the blocks, in forward order): spans
    ``(first, last)`` of block indices, nested or disjoint, never partly overlapping."""

    def __init__(self, modules: Sequence[nn.Module], spans: Sequence[tuple[int, int]], names: Sequence[str] = ()) -> None:
        self.modules = list(modules)
        self.names = list(names) or [f"#{i}" for i in range(len(self.modules))]
        n = len(self.modules)
        clean = sorted({(int(a), int(b)) for a, b in spans}, key=lambda s: (s[0], -s[1]))
        for a, b in clean:
            if not 0 <= a <= b < n:
                raise InvalidValue(f"segment ({a}, {b}) is not a span of the {n} blocks; expected 0 <= first <= last < {n}")
        for i, (a, b) in enumerate(clean):
            for c, d in clean[i + 1 :]:
                if c <= b < d:
                    raise InvalidValue(
                        f"segments {self.label((a, b))} and {self.label((c, d))} overlap without one "
                        "containing the other; segments must nest or be disjoint"
                    )
        self.spans = clean
        self.starting: dict[int, list[tuple[int, int]]] = {}
        for span in clean:  # outermost first: (first, -last) order
            self.starting.setdefault(span[0], []).append(span)
        self._local = threading.local()

    def label(self, span: tuple[int, int]) -> str:
        a, b = span
        return f"{self.names[a]}..{self.names[b]}" if a != b else self.names[a]

    def parent(self, span: tuple[int, int]) -> tuple[int, int] | None:
        outer = [s for s in self.spans if s != span and s[0] <= span[0] and span[1] <= s[1]]
        return min(outer, key=lambda s: s[1] - s[0]) if outer else None

    def _stack(self) -> list[Frame]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def swap_stack(self, stack: list[Frame]) -> list[Frame]:
        previous = self._stack()
        self._local.stack = stack
        return previous

    def call(self, i: int, inner: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Block ``i``'s call in training: open, record in, and close its segments' frames."""
        stack = self._stack()
        replaying = bool(stack) and stack[0].filling >= 0
        try:
            self._open(i, stack)
            if not stack:
                return inner(*args, **kwargs)
            top = stack[-1]
            if not top.contains(i):
                raise CheckpointError(
                    f"block {self.names[i]} was called while segment {self.label(top.span)} is open "
                    f"and expects block {self.names[top.next]}; the blocks of a segment must run once "
                    "each, in order, with no other block between them"
                )
            recording = [f for f in stack if f.filling < 0]
            for f in recording:
                if f.next != i:
                    raise CheckpointError(
                        f"segment {self.label(f.span)} expected block {self.names[f.next]} next, but "
                        f"block {self.names[i]} was called; the blocks of a segment must run once each, in order"
                    )
            if recording:
                tensors: list[torch.Tensor] = []
                walk((args, kwargs), lambda t, _: tensors.append(t))
                devices, states = get_device_states(*tensors)
                call = Call(i, inner, (), {}, (torch.get_rng_state(), devices, states),
                             autocast_state(), torch.is_autocast_cache_enabled())
                for f in recording:
                    f.record(call, args, kwargs)
                if replaying and stack[0].complete():
                    raise Done  # the replaying frame has all it needs (NOTE above: early stop)
            with (torch.autograd.graph.saved_tensors_hooks(top.pack, top.unpack), stop_passes_through(Done),
                  uncached_casts() if top.filling < 0 else contextlib.nullcontext()):  # NOTE [ Autocast's casts in a checkpoint's forward ]
                out = inner(*args, **kwargs)
            for f in recording:
                f.note_output(out)
            while stack and stack[-1].filling < 0 and stack[-1].span[1] == i:
                stack.pop()
            return out
        except Done:
            raise
        except BaseException:
            if not replaying:
                stack.clear()
            raise

    def _open(self, i: int, stack: list[Frame]) -> None:
        for span in self.starting.get(i, ()):
            top = stack[-1] if stack else None
            if top is not None and top.filling >= 0 and span[0] <= top.span[0] and top.span[1] <= span[1]:
                continue  # the replaying frame itself, or one around it
            expected = self.parent(span)
            if (top.span if top is not None else None) != expected:
                where = f"inside segment {self.label(expected)}" if expected else "outside every segment"
                found = f"segment {self.label(top.span)} is open" if top else "no segment is open"
                raise CheckpointError(
                    f"segment {self.label(span)} starts at block {self.names[i]}, which should run "
                    f"{where}, but {found}; the blocks of a segment must run once each, in order"
                )
            stack.append(Frame(self, span, top))


class SegmentForward:
    """The ``forward`` of a block in a segment: its own forward inside the segment's frame."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def _inner(self) -> Any:
        record: _Role = self.module.__dict__[_RECORD]
        if record.original is not None:
            return record.original
        return type(self.module).forward.__get__(self.module, type(self.module))

    @property
    def __wrapped__(self) -> Any:
        return self._inner()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        record: _Role = self.module.__dict__[_RECORD]
        inner = self._inner()
        if not self.module.training or not torch.is_grad_enabled() or torch.compiler.is_compiling():
            return inner(*args, **kwargs)
        return record.segments.call(record.index, inner, args, kwargs)


@dataclasses.dataclass(frozen=True)
class _Role:
    segments: Segments
    index: int
    original: Any


def apply_segments(
    modules: Sequence[nn.Module], spans: Sequence[tuple[int, int]], names: Sequence[str] = ()
) -> Segments | None:
    """Make the spans of ``modules`` (blocks in forward order) segments, in place; None if none.

    Every block of a span gets a ``SegmentForward`` over whatever ``forward`` it had (its class's,
    or a checkpoint's); ``remove_segments`` puts that back."""
    for m in modules:
        if not isinstance(m, nn.Module):
            raise InvalidType(f"segments are made of nn.Modules, got {type(m).__name__}")
    segments = Segments(modules, spans, names)
    if not segments.spans:
        return None
    covered = sorted({i for a, b in segments.spans for i in range(a, b + 1)})
    for i in covered:
        module = segments.modules[i]
        remove_segments([module])
        role = _Role(segments, i, module.__dict__.get("forward"))
        object.__setattr__(module, _RECORD, role)
        object.__setattr__(module, "forward", SegmentForward(module))
    return segments


def remove_segments(modules: Iterator[nn.Module] | Sequence[nn.Module]) -> None:
    """Undo ``apply_segments`` on ``modules``: each one's forward as before. No-op on others."""
    for module in modules:
        role = module.__dict__.pop(_RECORD, None)
        if role is None:
            continue
        module.__dict__.pop("forward", None)
        if role.original is not None:
            object.__setattr__(module, "forward", role.original)


def segments_of(module: nn.Module) -> Segments | None:
    """The ``Segments`` a block belongs to, or None."""
    role = module.__dict__.get(_RECORD)
    return role.segments if isinstance(role, _Role) else None
