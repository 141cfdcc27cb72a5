"""Which modules are the blocks: found in the model, or named by the user.

Found automatically: the container (``nn.ModuleList`` / ``nn.Sequential``) of repeated blocks that
holds the most parameters — the decoder layers of a transformer — or, when there is none, the
children of a top-level ``nn.Sequential``. Named: glob patterns over module names
(``["model.layers.*"]``) or the modules themselves.
"""

from __future__ import annotations

import fnmatch
import hashlib
from collections import Counter
from collections.abc import Sequence

from torch import nn

from remat.errors import did_you_mean

__all__ = ["BlockError", "find_blocks", "fingerprint"]


class BlockError(ValueError):
    """No blocks could be found, or the ones named do not fit."""


def _param_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _candidates(model: nn.Module) -> list[tuple[str, nn.Module, int]]:
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
            found.append((name, module, _param_count(module)))
    return found


def find_blocks(
    model: nn.Module, blocks: Sequence[str] | Sequence[nn.Module] | None = None
) -> list[tuple[str, nn.Module]]:
    """The blocks of ``model`` as (qualified name, module), in definition order."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected an nn.Module, got {type(model).__name__}")
    names = {id(m): n for n, m in model.named_modules()}
    if blocks is None:
        found = _auto(model)
    elif isinstance(blocks, str):
        raise TypeError(f"blocks= takes a list of patterns, e.g. [{blocks!r}], not a string")
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
        raise TypeError("blocks= takes a list of glob patterns (str) or a list of modules, not a mix")
    _check_disjoint(found)
    return found


def _auto(model: nn.Module) -> list[tuple[str, nn.Module]]:
    candidates = [c for c in _candidates(model) if c[0] != "" or isinstance(model, nn.Sequential)]
    if candidates:
        name, container, _ = max(candidates, key=lambda c: (c[2], -c[0].count(".")))
        prefix = f"{name}." if name else ""
        return [(prefix + child_name, child) for child_name, child in container.named_children()]
    if isinstance(model, nn.Sequential) and len(model) >= 2:
        return list(model.named_children())
    seen = [f"{n or '<root>'} ({type(m).__name__}, {len(list(m.children()))} children)"
            for n, m in model.named_modules() if len(list(m.children())) >= 2][:8]
    raise BlockError(
        f"found no repeated blocks in {type(model).__name__}: no nn.ModuleList/nn.Sequential holds "
        f"two or more modules of one class. Containers seen: {', '.join(seen) or 'none'}. "
        "Name the blocks yourself, e.g. blocks=['encoder.layer.*'] (glob patterns over module "
        "names) or blocks=[model.part1, model.part2]."
    )


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
