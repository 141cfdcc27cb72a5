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
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import get_device_states, set_device_states

from remat.errors import CheckpointError, InvalidType, InvalidValue
from remat.manual.batchnorm import RestoreRunningStats

__all__ = ["SegmentForward", "Segments", "apply_segments", "remove_segments", "segments_of"]

_RECORD = "_remat_segment"


class _Done(Exception):
    """Raised inside a replay once every placeholder of the frame is filled (early stop)."""


class _Slot:
    """A placeholder for one saved tensor of a frame."""

    __slots__ = ("__weakref__", "frame")

    def __init__(self, frame: _Frame) -> None:
        self.frame = frame


@dataclasses.dataclass(frozen=True)
class _Held:
    """A tensor from outside the frame, held by it: itself, or a placeholder of the parent."""

    value: Any
    requires_grad: bool


@dataclasses.dataclass(frozen=True)
class _Out:
    """An output of an earlier call of the same frame, at ``path`` inside it."""

    call: int
    path: tuple[Any, ...]


@dataclasses.dataclass(frozen=True)
class _Call:
    index: int
    inner: Callable[..., Any]
    args: Any
    kwargs: Any
    rng: tuple[torch.Tensor, list[int], list[torch.Tensor]]
    autocast: tuple[tuple[str, bool, torch.dtype], ...]
    autocast_cache: bool


def _walk(obj: Any, fn: Callable[[torch.Tensor, tuple[Any, ...]], Any], path: tuple[Any, ...] = ()) -> Any:
    """``obj`` with every tensor inside (tuples, lists, dicts) replaced by ``fn(tensor, path)``."""
    if isinstance(obj, torch.Tensor):
        return fn(obj, path)
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_walk(v, fn, (*path, i)) for i, v in enumerate(obj))
    if isinstance(obj, list):
        return [_walk(v, fn, (*path, i)) for i, v in enumerate(obj)]
    if isinstance(obj, dict) and type(obj) is dict:
        return {k: _walk(v, fn, (*path, k)) for k, v in obj.items()}
    return obj


def _resolve(obj: Any, parent: _Frame | None, outs: list[Any]) -> Any:
    """A recorded argument for the replay: outputs of the replayed calls, held tensors unpacked."""
    if isinstance(obj, _Out):
        return _at(outs[obj.call], obj.path)
    if isinstance(obj, _Held):
        value = (obj.value if parent is None else parent.unpack(obj.value)).detach()
        return value.requires_grad_(True) if obj.requires_grad else value
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_resolve(v, parent, outs) for v in obj)
    if isinstance(obj, list):
        return [_resolve(v, parent, outs) for v in obj]
    if isinstance(obj, dict) and type(obj) is dict:
        return {k: _resolve(v, parent, outs) for k, v in obj.items()}
    return obj


def _last_uses(calls: Sequence[_Call]) -> dict[int, list[int]]:
    """[k]: the calls whose outputs call k reads last."""
    last: dict[int, int] = {}
    for k, call in enumerate(calls):
        for ref in _refs((call.args, call.kwargs)):
            last[ref.call] = k
    by_reader: dict[int, list[int]] = {}
    for j, k in last.items():
        by_reader.setdefault(k, []).append(j)
    return by_reader


def _refs(obj: Any) -> Iterator[_Out]:
    if isinstance(obj, _Out):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for v in obj:
            yield from _refs(v)
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _refs(v)


def _at(obj: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        obj = obj[key]
    return obj


class _Frame:
    """One segment's recompute frame (NOTE [ A segment is one recompute frame over several calls ])."""

    def __init__(self, owner: Segments, span: tuple[int, int], parent: _Frame | None) -> None:
        self.owner, self.span, self.parent = owner, span, parent
        self.next = span[0]
        self.slots: list[weakref.ref[_Slot]] = []
        self.values: weakref.WeakKeyDictionary[_Slot, torch.Tensor] = weakref.WeakKeyDictionary()
        self.calls: list[_Call] = []
        self.outputs: dict[int, tuple[weakref.ref[torch.Tensor], int, tuple[Any, ...]]] = {}
        self.filling = -1  # during the replay: the index of the next placeholder to fill
        self.replayed = False

    def contains(self, i: int) -> bool:
        return self.span[0] <= i <= self.span[1]

    # --- the forward: placeholders and records -------------------------------------------------

    def pack(self, tensor: torch.Tensor) -> Any:
        if self.filling >= 0:  # replaying: the placeholder packed at this point gets the tensor
            slot = self.slots[self.filling]() if self.filling < len(self.slots) else None
            self.filling += 1
            if slot is not None:
                self.values[slot] = tensor.detach()
            if self.complete():
                raise _Done  # the rest of the block would only make its output: stop (as torch)
            return None
        slot = _Slot(self)
        self.slots.append(weakref.ref(slot))
        return slot

    def unpack(self, slot: Any) -> torch.Tensor:
        if slot is None:  # a tensor saved by the replay itself, which nothing backpropagates
            raise CheckpointError("remat segments: the replay's own graph cannot be backpropagated")
        frame: _Frame = slot.frame
        if not frame.replayed:
            frame.replay()
        try:
            return frame.values[slot]
        except KeyError:
            raise CheckpointError(
                f"remat segment {frame.owner.label(frame.span)}: a saved tensor was not recomputed "
                "(was its backward run twice without retain_graph=True?)"
            ) from None

    def hold(self, tensor: torch.Tensor) -> _Held:
        value = tensor if self.parent is None else self.parent.pack(tensor)
        return _Held(value, tensor.requires_grad)

    def record(self, call: _Call, args: Any, kwargs: Any) -> None:
        """Record a call of block ``call.index``; its tensors as outputs of earlier calls or held."""

        def ref(t: torch.Tensor, path: tuple[Any, ...]) -> Any:
            known = self.outputs.get(id(t))
            if known is not None and known[0]() is t:
                return _Out(known[1], known[2])
            return self.hold(t)

        self.calls.append(dataclasses.replace(call, args=_walk(args, ref), kwargs=_walk(kwargs, ref)))
        self.next = call.index + 1

    def note_output(self, out: Any) -> None:
        k = len(self.calls) - 1

        def note(t: torch.Tensor, path: tuple[Any, ...]) -> None:
            self.outputs[id(t)] = (weakref.ref(t), k, path)

        _walk(out, note)

    # --- the backward: the replay ----------------------------------------------------------------

    def complete(self) -> bool:
        return self.filling >= len(self.slots)

    def replay(self) -> None:
        owner = self.owner
        previous = owner.swap_stack([self])
        self.filling = 0
        outs: list[Any] = []
        try:
            with torch.enable_grad(), RestoreRunningStats(tuple(owner.modules[self.span[0] : self.span[1] + 1])):
                last_use = _last_uses(self.calls)
                for k, call in enumerate(self.calls):
                    args, kwargs = self._inputs(call, outs)
                    for j in last_use.pop(k, ()):
                        outs[j] = None  # no later call reads it: let it go as the forward did
                    outs.append(self._run(call, args, kwargs))
                    if self.complete():
                        break
        except _Done:
            pass
        finally:
            owner.swap_stack(previous)
            filled, self.filling = self.filling, -1
        self.replayed = True
        if filled < len(self.slots):
            raise CheckpointError(
                f"remat segment {owner.label(self.span)}: its forward saved {len(self.slots)} "
                f"tensors, its replay only {filled}; a segment's blocks must compute the same "
                "way every time they run (no branches on global state or on timing)"
            )
        self.calls.clear()  # the inputs are no longer needed: the placeholders are filled

    def _inputs(self, call: _Call, outs: list[Any]) -> tuple[Any, Any]:
        # Module-level helpers, no nested closures: a recursive closure is a reference cycle that
        # would keep the replay's outputs alive until the garbage collector runs.
        return _resolve(call.args, self.parent, outs), _resolve(call.kwargs, self.parent, outs)

    def _run(self, call: _Call, args: Any, kwargs: Any) -> Any:
        cpu, devices, states = call.rng
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.random.fork_rng(devices=devices))
            torch.set_rng_state(cpu)
            if devices:
                set_device_states(devices, states)
            for device, enabled, dtype in call.autocast:
                stack.enter_context(
                    torch.autocast(device_type=device, dtype=dtype, enabled=enabled, cache_enabled=call.autocast_cache)
                )
            return self.owner.call(call.index, call.inner, args, kwargs)


def _autocast_state() -> tuple[tuple[str, bool, torch.dtype], ...]:
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    return tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in devices)


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

    def _stack(self) -> list[_Frame]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def swap_stack(self, stack: list[_Frame]) -> list[_Frame]:
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
                _walk((args, kwargs), lambda t, _: tensors.append(t))
                devices, states = get_device_states(*tensors)
                call = _Call(i, inner, (), {}, (torch.get_rng_state(), devices, states),
                             _autocast_state(), torch.is_autocast_cache_enabled())
                for f in recording:
                    f.record(call, args, kwargs)
                if replaying and stack[0].complete():
                    raise _Done  # the replaying frame has all it needs (NOTE above: early stop)
            with torch.autograd.graph.saved_tensors_hooks(top.pack, top.unpack):
                out = inner(*args, **kwargs)
            for f in recording:
                f.note_output(out)
            while stack and stack[-1].filling < 0 and stack[-1].span[1] == i:
                stack.pop()
            return out
        except _Done:
            raise
        except BaseException:
            if not replaying:
                stack.clear()
            raise

    def _open(self, i: int, stack: list[_Frame]) -> None:
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
            stack.append(_Frame(self, span, top))


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
