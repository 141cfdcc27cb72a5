"""The recompute frame behind ``remat.manual.segments`` (NOTE [ A segment is one recompute frame
over several calls ] there): placeholders for saved tensors, the records of each call, the
replay that fills them."""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.checkpoint import set_device_states

from remat.errors import CheckpointError
from remat.manual.batchnorm import RestoreRunningStats

__all__ = ["Call", "Done", "Frame", "Held", "Out", "Slot", "autocast_state", "walk"]


class Done(Exception):
    """Raised inside a replay once every placeholder of the frame is filled (early stop)."""


class Slot:
    """A placeholder for one saved tensor of a frame."""

    __slots__ = ("__weakref__", "frame")

    def __init__(self, frame: Frame) -> None:
        self.frame = frame


@dataclasses.dataclass(frozen=True)
class Held:
    """A tensor from outside the frame, held by it: itself, or a placeholder of the parent."""

    value: Any
    requires_grad: bool


@dataclasses.dataclass(frozen=True)
class Out:
    """An output of an earlier call of the same frame, at ``path`` inside it."""

    call: int
    path: tuple[Any, ...]


@dataclasses.dataclass(frozen=True)
class Call:
    index: int
    inner: Callable[..., Any]
    args: Any
    kwargs: Any
    rng: tuple[torch.Tensor, list[int], list[torch.Tensor]]
    autocast: tuple[tuple[str, bool, torch.dtype], ...]
    autocast_cache: bool


@dataclasses.dataclass(frozen=True)
class Field:
    """A step of a path into a dataclass (a dict's key is a plain step)."""

    name: str


def is_data(obj: Any) -> bool:
    """Whether ``obj`` is a dataclass instance: data wherever it is met, as a tuple is (a block may
    hand the next a ``@dataclass`` state; ``remat.measure.storages.tensors_in`` walks it too)."""
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def _rebuilt(obj: Any, value: Callable[[Any, Field], Any]) -> Any:
    """A dataclass instance again, each init field given to its ``__init__`` as ``value(its
    value, its path step)``."""
    return dataclasses.replace(obj, **{f.name: value(getattr(obj, f.name), Field(f.name))
                                       for f in dataclasses.fields(obj) if f.init})


def walk(obj: Any, fn: Callable[[torch.Tensor, tuple[Any, ...]], Any], path: tuple[Any, ...] = ()) -> Any:
    """``obj`` with every tensor inside (tuples, lists, dicts, dataclasses) replaced by ``fn(tensor,
    path)``."""
    if isinstance(obj, torch.Tensor):
        return fn(obj, path)
    if is_data(obj):
        return _rebuilt(obj, lambda v, step: walk(v, fn, (*path, step)))
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(walk(v, fn, (*path, i)) for i, v in enumerate(obj))
    if isinstance(obj, list):
        return [walk(v, fn, (*path, i)) for i, v in enumerate(obj)]
    if isinstance(obj, dict) and type(obj) is dict:
        return {k: walk(v, fn, (*path, k)) for k, v in obj.items()}
    return obj


def resolve(obj: Any, parent: Frame | None, outs: list[Any], memo: dict[int, torch.Tensor]) -> Any:
    """A recorded argument for the replay: outputs of the replayed calls, held tensors unpacked,
    each held tensor once per replay (``memo``: NOTE [ A tensor held once ])."""
    if isinstance(obj, Out):
        return at(outs[obj.call], obj.path)
    if isinstance(obj, Held):
        if id(obj) not in memo:
            value = (obj.value if parent is None else parent.unpack(obj.value)).detach()
            memo[id(obj)] = value.requires_grad_(True) if obj.requires_grad else value
        return memo[id(obj)]
    if is_data(obj):
        return _rebuilt(obj, lambda v, _: resolve(v, parent, outs, memo))
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(resolve(v, parent, outs, memo) for v in obj)
    if isinstance(obj, list):
        return [resolve(v, parent, outs, memo) for v in obj]
    if isinstance(obj, dict) and type(obj) is dict:
        return {k: resolve(v, parent, outs, memo) for k, v in obj.items()}
    return obj


def last_uses(calls: Sequence[Call]) -> dict[int, list[int]]:
    """[k]: the calls whose outputs call k reads last."""
    last: dict[int, int] = {}
    for k, call in enumerate(calls):
        for ref in refs((call.args, call.kwargs)):
            last[ref.call] = k
    by_reader: dict[int, list[int]] = {}
    for j, k in last.items():
        by_reader.setdefault(k, []).append(j)
    return by_reader


def refs(obj: Any) -> Iterator[Out]:
    if isinstance(obj, Out):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for v in obj:
            yield from refs(v)
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from refs(v)


def at(obj: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        obj = getattr(obj, key.name) if isinstance(key, Field) else obj[key]
    return obj


# NOTE [ A tensor held once ]
# Blocks are often passed the same tensor from outside (rotary tables, a mask, a position bias:
# one object, every block). A frame holds each such tensor once, by identity, however many of its
# calls read it, and its replay hands every call the same unpacked tensor. For a nested segment
# this is what keeps the enclosing replay short: the inner frame holds what it reads from outside
# as placeholders of the enclosing frame, one per tensor rather than one per call, so those are
# all filled at the inner segment's first call and the enclosing replay stops there, without
# running the inner blocks (as the cost model counts: NOTE [ A segment's costs from per-block
# numbers ] in remat.plan.segments). Held per call, the enclosing replay would run the inner
# segment up to its last call to fill the placeholders of that call's side inputs.


class Frame:
    """One segment's recompute frame (NOTE [ A segment is one recompute frame over several calls ])."""

    def __init__(self, owner: Any, span: tuple[int, int], parent: Frame | None) -> None:
        self.owner, self.span, self.parent = owner, span, parent
        self.next = span[0]
        self.slots: list[weakref.ref[Slot]] = []
        self.values: weakref.WeakKeyDictionary[Slot, torch.Tensor] = weakref.WeakKeyDictionary()
        self.calls: list[Call] = []
        self.held: dict[int, tuple[weakref.ref[torch.Tensor], Held]] = {}
        self.outputs: dict[int, tuple[weakref.ref[torch.Tensor], int, tuple[Any, ...], int]] = {}
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
                raise Done  # the rest of the block would only make its output: stop (as torch)
            return None
        slot = Slot(self)
        self.slots.append(weakref.ref(slot))
        return slot

    def unpack(self, slot: Any) -> torch.Tensor:
        if slot is None:  # a tensor saved by the replay itself, which nothing backpropagates
            raise CheckpointError("remat segments: the replay's own graph cannot be backpropagated")
        frame: Frame = slot.frame
        if not frame.replayed:
            frame.replay()
        try:
            return frame.values[slot]
        except KeyError:
            raise CheckpointError(
                f"remat segment {frame.owner.label(frame.span)}: a saved tensor was not recomputed "
                "(was its backward run twice without retain_graph=True?)"
            ) from None

    def hold(self, tensor: torch.Tensor) -> Held:
        known = self.held.get(id(tensor))
        if known is not None and known[0]() is tensor:
            return known[1]  # NOTE [ A tensor held once ]
        value = tensor if self.parent is None else self.parent.pack(tensor)
        held = Held(value, tensor.requires_grad)
        self.held[id(tensor)] = (weakref.ref(tensor), held)
        return held

    def record(self, call: Call, args: Any, kwargs: Any) -> None:
        """Record a call of block ``call.index``; its tensors as outputs of earlier calls or held."""

        def ref(t: torch.Tensor, path: tuple[Any, ...]) -> Any:
            known = self.outputs.get(id(t))
            if known is not None and known[0]() is t:
                if t._version != known[3]:  # NOTE [ A first input made between blocks ] in remat.measure.sides
                    names = self.owner.names
                    raise CheckpointError(
                        f"remat segment {self.owner.label(self.span)}: the model's code changed an output of block "
                        f"{names[self.calls[known[1]].index]} in place before block {names[call.index]} took it "
                        "(as `x += skip`), which the segment's replay cannot redo; end the segment before "
                        f"block {names[call.index]} (remat.solve does, where the profile saw the change)")
                return Out(known[1], known[2])
            return self.hold(t)

        self.calls.append(dataclasses.replace(call, args=walk(args, ref), kwargs=walk(kwargs, ref)))
        self.next = call.index + 1

    def note_output(self, out: Any) -> None:
        k = len(self.calls) - 1

        def note(t: torch.Tensor, path: tuple[Any, ...]) -> None:
            self.outputs[id(t)] = (weakref.ref(t), k, path, t._version)

        walk(out, note)

    # --- the backward: the replay ----------------------------------------------------------------

    def complete(self) -> bool:
        return self.filling >= len(self.slots)

    def replay(self) -> None:
        owner = self.owner
        previous = owner.swap_stack([self])
        self.filling = 0
        outs: list[Any] = []
        memo: dict[int, torch.Tensor] = {}
        try:
            with torch.enable_grad(), RestoreRunningStats(tuple(owner.modules[self.span[0] : self.span[1] + 1])):
                last_use = last_uses(self.calls)
                for k, call in enumerate(self.calls):
                    args, kwargs = self._inputs(call, outs, memo)
                    for j in last_use.pop(k, ()):
                        outs[j] = None  # no later call reads it: let it go as the forward did
                    outs.append(self._run(call, args, kwargs))
                    if self.complete():
                        break
        except Done:
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
        self.held.clear()

    def _inputs(self, call: Call, outs: list[Any], memo: dict[int, torch.Tensor]) -> tuple[Any, Any]:
        # Module-level helpers, no nested closures: a recursive closure is a reference cycle that
        # would keep the replay's outputs alive until the garbage collector runs.
        return resolve(call.args, self.parent, outs, memo), resolve(call.kwargs, self.parent, outs, memo)

    def _run(self, call: Call, args: Any, kwargs: Any) -> Any:
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


def autocast_state() -> tuple[tuple[str, bool, torch.dtype], ...]:
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    return tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in devices)
