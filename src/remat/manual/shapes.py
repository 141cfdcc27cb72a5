"""What a module's parameters and containers say of its shape, whatever runs: one layer, one weight,
a stack of layers of its own (rules 4, 7 and 8 of NOTE [ Blocks by what runs ] in
``remat.manual.settle``)."""

from __future__ import annotations

from torch import nn

from remat.manual.blocks import CONTAINERS, is_block_stack, param_count, stack_candidates

__all__ = ["bare_layer", "keeps_a_stack", "one_weight", "wraps_a_stack"]


def bare_layer(module: nn.Module) -> bool:
    """Whether ``module`` is one layer, bare or wrapped: at most one of its modules holds
    parameters of its own (an ``nn.Conv2d``, a ``Sequential`` around one; rule 4)."""
    return _holding(module, dims=1) <= 1


def one_weight(module: nn.Module) -> bool:
    """Whether at most one of ``module``'s modules holds a weight (a parameter of two or more
    dimensions; norms and activations hold vectors): a layer of a chain, as MONAI's ``Convolution``
    with its PReLU (rule 8)."""
    return _holding(module, dims=2) <= 1


def _holding(module: nn.Module, dims: int) -> int:
    """How many of ``module``'s modules hold a parameter of their own of ``dims`` or more dimensions."""
    return sum(1 for m in module.modules() if any(p.dim() >= dims for p in m.parameters(recurse=False)))


def keeps_a_stack(stage: nn.Module) -> bool:
    """Whether ``stage`` keeps a stack of layers of its own: held in containers, or in a module that
    holds nothing else (SwinIR's residual group), not inside one of its modules (an MoE's experts
    are its MoE's, beside its router; rule 7)."""
    modules = dict(stage.named_modules())

    def own(name: str, stack: nn.Module) -> bool:
        path = name.split(".")
        return all(isinstance(m := modules[".".join(path[:k])], CONTAINERS) or param_count(m) == param_count(stack)
                   for k in range(1, len(path)))

    return any((not n or own(n, c)) and is_block_stack(c) and not all(one_weight(m) for m in c.children())
               for n, c, _ in stack_candidates(stage))


def wraps_a_stack(module: nn.Module) -> bool:
    """Whether ``module`` holds a stack of layers and nothing else: a stage's part that is its
    stack's wrapper, whose layers are the parts (rule 7)."""
    return any(n and param_count(c) == param_count(module) for n, c, _ in stack_candidates(module)) and keeps_a_stack(module)
