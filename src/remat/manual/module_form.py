"""The module form: ``checkpoint_module(block)`` makes every call of ``block`` checkpointed.

# NOTE [ The module form is data ]
The option is a record on the module (``_remat_checkpoint``), and its ``forward`` an instance of
``CheckpointedForward`` that holds the module and nothing else; at each call it reads the record
and the class's ``forward``. No closure: ``copy.deepcopy`` copies the record and rebinds the
forward to the copy (a closure would be shared, and the copy would compute with the original's
weights), and ``pickle`` / ``torch.save(model)`` store both as plain data. Parameter names,
``state_dict`` keys and values, ``named_modules``, hooks and ``train()/eval()`` are the module's own.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable
from typing import Any

from torch import nn

from remat.errors import InvalidType
from remat.manual.checkpoint import check_mode, run
from remat.manual.torch_options import TorchOptions, torch_options
from remat.vocabulary import CheckpointOption

__all__ = [
    "CheckpointedForward",
    "ModuleCheckpoint",
    "checkpoint_module",
    "checkpoint_record",
    "expect_module",
    "is_checkpointed",
    "recheckpoint",
    "uncheckpoint_module",
]

_RECORD = "_remat_checkpoint"


def expect_module(value: Any, verb: str, what: str = "the model") -> nn.Module:
    """``value``, if it is an ``nn.Module``: the first check of every public verb that takes a model
    (``what``) or a block (``what=""``); otherwise an ``InvalidType`` that says what to pass."""
    if isinstance(value, nn.Module):
        return value
    if isinstance(value, type) and issubclass(value, nn.Module):
        got = f"the class {value.__name__} itself; pass an instance of it ({value.__name__}(...))"
    elif isinstance(value, (str, bytes, os.PathLike)):
        got = f"{type(value).__name__} {value!r}; a name or a path is not a module: pass the module object itself"
    else:
        got = f"{type(value).__name__}; pass the module object itself"
    raise InvalidType(f"{verb} expects {what + ', ' if what else ''}an nn.Module; got {got}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModuleCheckpoint:
    """How a module is checkpointed (see ``checkpoint_call`` for each option)."""

    mode: str
    """One of ``MODES``."""
    policy: Callable[..., Any] | None
    """The selective policy function (validated), None for the other modes."""
    allow_cache_entry_mutation: bool
    """Selective mode: allow in-place changes of a kept output."""
    options: TorchOptions
    """torch's checkpoint options."""
    original: Any
    """An instance-level ``forward`` the module had before (rare), else None: the class's."""


class CheckpointedForward:
    """The ``forward`` of a checkpointed module (NOTE [ The module form is data ])."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def _original(self) -> Any:
        record: ModuleCheckpoint = self.module.__dict__[_RECORD]
        if record.original is not None:
            return record.original
        return type(self.module).forward.__get__(self.module, type(self.module))

    @property
    def __wrapped__(self) -> Any:  # inspect.signature(module.forward) shows the module's own
        return self._original()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module
        record: ModuleCheckpoint = module.__dict__[_RECORD]
        original = self._original()
        if not module.training:
            return original(*args, **kwargs)
        return run(
            original, args, kwargs, record.mode, record.policy, record.allow_cache_entry_mutation, record.options
        )


def checkpoint_module(
    module: nn.Module,
    *,
    mode: CheckpointOption = "recompute",
    policy: Callable[..., Any] | Iterable[Any] | None = None,
    allow_cache_entry_mutation: bool = False,
    preserve_rng_state: bool = True,
    determinism_check: str = "default",
    debug: bool = False,
    early_stop: bool = True,
    context_fn: Callable[[], tuple[Any, Any]] | None = None,
) -> nn.Module:
    """Make every call of ``module`` checkpointed, in place; returns the same module.

    Nothing about the module changes but its ``forward``: parameter names, ``state_dict`` keys,
    ``named_modules``, hooks and ``train()/eval()`` are those of the original, and a
    ``copy.deepcopy``, ``pickle`` or ``torch.save`` of it is an independent, checkpointed module.
    In ``eval()`` or under ``no_grad`` it runs plainly. ``uncheckpoint_module`` undoes it. Calling
    it again replaces the options. The options are ``checkpoint_call``'s; every keyword the module
    is called with goes to its ``forward``.
    """
    expect_module(module, "checkpoint_module", "")
    options = torch_options(
        preserve_rng_state=preserve_rng_state,
        determinism_check=determinism_check,
        debug=debug,
        early_stop=early_stop,
        context_fn=context_fn,
    )
    policy_fn = check_mode(mode, policy, allow_cache_entry_mutation)
    uncheckpoint_module(module)
    record = ModuleCheckpoint(
        mode=mode,
        policy=policy_fn,
        allow_cache_entry_mutation=allow_cache_entry_mutation,
        options=options,
        original=module.__dict__.get("forward"),
    )
    object.__setattr__(module, _RECORD, record)
    object.__setattr__(module, "forward", CheckpointedForward(module))
    return module


def uncheckpoint_module(module: nn.Module) -> nn.Module:
    """Undo ``checkpoint_module``: the module's own ``forward`` again. A no-op on a plain module."""
    expect_module(module, "uncheckpoint_module", "")
    record = module.__dict__.pop(_RECORD, None)
    if record is not None:
        module.__dict__.pop("forward", None)
        if record.original is not None:  # an instance-level forward from before remat, put back
            object.__setattr__(module, "forward", record.original)
    return module


def checkpoint_record(module: nn.Module) -> ModuleCheckpoint | None:
    """How ``module`` is checkpointed (``checkpoint_module``'s record), or None."""
    record = module.__dict__.get(_RECORD)
    return record if isinstance(record, ModuleCheckpoint) else None


def recheckpoint(module: nn.Module, record: ModuleCheckpoint) -> None:
    """Checkpoint ``module`` as ``record`` says (one ``checkpoint_record`` read), in place."""
    uncheckpoint_module(module)
    object.__setattr__(module, _RECORD, record)
    object.__setattr__(module, "forward", CheckpointedForward(module))


def is_checkpointed(module: nn.Module) -> str | None:
    """The mode ``module`` is checkpointed with, or None."""
    record = module.__dict__.get(_RECORD)
    return record.mode if isinstance(record, ModuleCheckpoint) else None
