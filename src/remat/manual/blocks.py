"""Which modules are the blocks: found in the model and in what runs, or named by the user.

Found automatically: every stack of repeated blocks (NOTE [ Every stack ]), or, when there is
none, the children of a top-level ``nn.Sequential``; then the module calls of a real or fake
forward settle them (NOTE [ Blocks by what runs ] in ``remat.manual.settle``). Named: glob patterns over module
names (``["model.layers.*"]``) or the modules themselves.

# NOTE [ Every stack ]
A stack is a container (``nn.ModuleList`` / ``nn.Sequential``) of >= 2 children in which one class
repeats. The one holding the most parameters is always a stack (the decoder layers of a
transformer; a top-level ``nn.Sequential``); every other that is neither inside nor around a stack
already taken, and whose repeated children are modules with parameters of their own (not bare
``nn.Linear``s of a head), is one too: a T5's, BART's or Whisper's encoder and decoder, CLIP's and
SigLIP's two towers, a UNet's down and up paths, a ResNet's stages. They are returned in the order
the model defines them; the profiler orders them as they run (a CLIP runs its vision tower first)
and leaves out a whole stack that does not run in the training step.
"""

from __future__ import annotations

import fnmatch
import hashlib
from collections import Counter
from collections.abc import Sequence

from torch import nn

from remat.errors import BlockError, InvalidType, did_you_mean

__all__ = ["CONTAINERS", "BlockError", "find_blocks", "fingerprint", "inside", "is_block_stack", "param_count",
           "stack_candidates"]


def param_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def stack_candidates(model: nn.Module) -> list[tuple[str, nn.Module, int]]:
    """Containers of >= 2 children where one class repeats, with how many params they hold."""
    found: list[tuple[str, nn.Module, int]] = []
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(module.children())
        if len(children) < 2:
            continue
        _, repeats = Counter(type(c) for c in children).most_common(1)[0]
        if repeats >= 2:
            found.append((name, module, param_count(module)))
    return found


def find_blocks(
    model: nn.Module, blocks: Sequence[str] | Sequence[nn.Module] | None = None, *, required: bool = True
) -> list[tuple[str, nn.Module]]:
    """The blocks of ``model`` as (qualified name, module), in definition order: by the model's
    containers alone (``by_calls`` settles them by what runs). ``required=False``: no blocks found
    is an empty list, not an error."""
    if not isinstance(model, nn.Module):
        raise InvalidType(f"expected an nn.Module, got {type(model).__name__}")
    names = {id(m): n for n, m in model.named_modules()}
    if blocks is None:
        found = _auto(model, required=required)
        if not found:
            return found
    elif isinstance(blocks, str):
        raise InvalidType(f"blocks= takes a list of patterns, e.g. [{blocks!r}], not a string")
    elif all(isinstance(b, str) for b in blocks):
        found = _by_pattern(model, [str(b) for b in blocks])
    elif all(isinstance(b, nn.Module) for b in blocks):
        found = []
        for b in blocks:
            assert isinstance(b, nn.Module)
            if id(b) not in names:
                raise BlockError(f"a {type(b).__name__} passed in blocks= is not a submodule of the model")
            found.append((names[id(b)], b))
    else:
        raise InvalidType("blocks= takes a list of glob patterns (str) or a list of modules, not a mix")
    _check_disjoint(found)
    return found


def inside(name: str, container: str) -> bool:
    """Whether module ``name`` is ``container`` or one of its modules (``""``: the model)."""
    return container == "" or name == container or name.startswith(container + ".")


def is_block_stack(container: nn.Module) -> bool:
    """Whether the repeated children of ``container`` are blocks: modules with parameters and
    submodules of their own, not the bare layers of a small head."""
    kind, _ = Counter(type(c) for c in container.children()).most_common(1)[0]
    repeated = [c for c in container.children() if type(c) is kind]
    return all(any(True for _ in c.children()) and param_count(c) > 0 for c in repeated)


def _holds(outer: nn.Module, inner: nn.Module) -> bool:
    """Whether ``inner`` is ``outer`` or one of its modules, under whatever names (rule 5 of NOTE
    [ Blocks by what runs ] in remat.manual.settle)."""
    return any(m is inner for m in outer.modules())


def _stacks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The stacks of ``model`` in definition order (NOTE [ Every stack ])."""
    candidates = [c for c in stack_candidates(model) if c[0] != "" or isinstance(model, nn.Sequential)]
    if not candidates:
        return []
    by_size = sorted(candidates, key=lambda c: (-c[2], c[0].count(".")))
    taken = [by_size[0][:2]]
    for name, container, params in by_size[1:]:
        if params == 0 or not is_block_stack(container):
            continue
        if any(inside(name, t) or inside(t, name) or _holds(c, container) or _holds(container, c) for t, c in taken):
            continue
        taken.append((name, container))
    order = {n: i for i, (n, _) in enumerate(model.named_modules())}
    return sorted(taken, key=lambda t: order[t[0]])


def _auto(model: nn.Module, *, required: bool = True) -> list[tuple[str, nn.Module]]:
    # A module held under two names is named by its first (NOTE [ Blocks by what runs ] in
    # remat.manual.settle, rule 5): enformer-pytorch holds its stem, tower and transformer as
    # attributes and again in the Sequential its forward runs, whose children named by position
    # were no module's name (KeyError).
    canonical = {id(m): n for n, m in model.named_modules()}
    stacks = _stacks(model)
    if stacks:
        return [(canonical[id(child)], child) for _, container in stacks for child in container.children()]
    if isinstance(model, nn.Sequential) and len(model) >= 2:
        return [(canonical[id(child)], child) for child in model.children()]
    if not required:
        return []
    raise no_blocks(model)


def no_blocks(model: nn.Module) -> BlockError:
    seen = [f"{n or '<root>'} ({type(m).__name__}, {len(list(m.children()))} children)"
            for n, m in model.named_modules() if len(list(m.children())) >= 2][:8]
    return BlockError(
        f"found no repeated blocks in {type(model).__name__}: no nn.ModuleList/nn.Sequential holds "
        f"two or more modules of one class. Containers seen: {', '.join(seen) or 'none'}. "
        "Name the blocks yourself, e.g. blocks=['encoder.layer.*'] (glob patterns over module "
        "names) or blocks=[model.part1, model.part2]."
    )


CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def _by_pattern(model: nn.Module, patterns: list[str]) -> list[tuple[str, nn.Module]]:
    modules = [(n, m) for n, m in model.named_modules() if n]
    found: list[tuple[str, nn.Module]] = []
    for pattern in patterns:
        hits = [(n, m) for n, m in modules if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            hint = did_you_mean(pattern, [n for n, _ in modules], n=3)
            raise BlockError(f"the pattern {pattern!r} matches no module of {type(model).__name__}{hint}")
        found.extend(h for h in hits if h not in found)
    # A pattern like "layers.*" also matches "layers.0.attn": keep the outermost matches only.
    outer = [(n, m) for n, m in found if not any(n.startswith(o + ".") for o, _ in found)]
    order = {n: i for i, (n, _) in enumerate(modules)}
    return sorted(outer, key=lambda nm: order[nm[0]])


def _check_disjoint(found: list[tuple[str, nn.Module]]) -> None:
    if not found:
        raise BlockError("no blocks: pass at least one module or pattern in blocks=")
    names = [n for n, _ in found]
    for n in names:
        for o in names:
            if n != o and n.startswith(o + "."):
                raise BlockError(f"blocks must not nest: {n!r} is inside {o!r}; name one or the other")


def fingerprint(model: nn.Module) -> str:
    """A short hash of the model's structure: module names and classes, parameter shapes, dtypes."""
    h = hashlib.sha256()
    for name, module in model.named_modules():
        h.update(f"{name}:{type(module).__name__};".encode())
    for name, p in model.named_parameters():
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype};".encode())
    return h.hexdigest()[:16]
