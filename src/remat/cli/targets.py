"""What a command runs on: a zoo name or a ``module:function`` factory, turned into a model, a batch,
a loss and an optimizer factory (or, for estimated mode, factories that build them inside
``FakeTensorMode``). Used by the CLI; no printing here.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import click

from remat.errors import InvalidType, InvalidValue, did_you_mean
from remat.units import format_bytes

if TYPE_CHECKING:
    from torch import nn

__all__ = [
    "ModelArgs", "Target", "call_factory", "cwd_on_path", "import_factory", "load_target",
    "optimizer_factory",
]

DTYPES = ("float32", "bfloat16", "float16")


def measured_device(device: str | None) -> bool:
    """Whether ``device`` means measuring real steps (cpu, cuda[:N]) rather than estimating."""
    return device is None or device == "cpu" or device.split(":")[0] == "cuda"


@dataclass
class Target:
    """What one training step needs. In estimated mode ``model`` and ``batch`` are factories,
    called inside ``FakeTensorMode`` by the profiler."""

    name: str
    model: Any
    batch: Any
    loss_fn: Callable[[Any, Any], Any] | None
    optimizer: Callable[[Any], Any] | None


@dataclass(frozen=True)
class ModelArgs:
    model: str
    batch: int | None
    seq: int | None
    dtype: str | None
    optimizer: str
    blocks: tuple[str, ...]


def optimizer_factory(name: str) -> Callable[[Any], Any] | None:
    import torch

    if name == "adamw":
        return lambda params: torch.optim.AdamW(params, lr=1e-3)
    if name == "sgd":
        return lambda params: torch.optim.SGD(params, lr=1e-2)
    return None


def load_target(args: ModelArgs, *, device: str | None) -> Target:
    """The model, batch and loss of ``--model``: measured (real tensors on ``device``, a
    ``cpu``/``cuda`` string or None) or estimated (factories; ``device`` is a spec name)."""
    measured = measured_device(device)
    optimizer = optimizer_factory(args.optimizer)
    if ":" not in args.model:
        return _zoo_target(args, device=device or "cpu", measured=measured, optimizer=optimizer)
    if args.dtype is not None:
        raise click.UsageError("--dtype applies to zoo models; a factory sets its own dtype")
    if measured and device not in (None, "cpu"):
        raise click.UsageError(
            f"--device {device} puts a zoo model on the GPU; a factory puts its model and batch "
            "where it wants them, and remat measures there (leave --device out)"
        )
    factory = import_factory(args.model)
    if measured:
        model, batch, loss_fn = _call_factory(factory, args)
        return Target(name=args.model, model=model, batch=batch, loss_fn=loss_fn,
                       optimizer=optimizer)  # fmt: skip
    built: dict[str, Any] = {}

    def make_model() -> Any:  # called by the profiler inside FakeTensorMode, before make_batch
        built["model"], built["batch"], built["loss_fn"] = _call_factory(factory, args)
        return built["model"]

    def deferred_loss(output: Any, batch: Any) -> Any:
        from remat.measure.step import default_loss

        return (built["loss_fn"] or default_loss)(output, batch)

    return Target(name=args.model, model=make_model, batch=lambda: built["batch"],
                   loss_fn=deferred_loss, optimizer=optimizer)  # fmt: skip


def _zoo_target(
    args: ModelArgs, *, device: str, measured: bool, optimizer: Callable[[Any], Any] | None
) -> Target:
    import torch

    from remat.models import zoo

    dtype = getattr(torch, args.dtype or "float32")
    spec = zoo.spec(
        args.model, batch_size=args.batch, seq_len=args.seq, dtype=dtype,
        device=device if measured else "cpu",
    )  # fmt: skip
    if not measured:
        return Target(name=args.model, model=spec.make_model, batch=spec.make_batch,
                       loss_fn=spec.loss_fn, optimizer=optimizer)  # fmt: skip
    if device == "cpu":
        _check_host_memory(args, dtype.itemsize)
    elif not torch.cuda.is_available():
        raise InvalidValue(
            f"--device {device}: CUDA is not available here (torch {torch.__version__}); measure "
            "on cpu, or estimate for a GPU by name (--device h100, rtx4090, ...)"
        )
    return Target(name=args.model, model=spec.make_model(), batch=spec.make_batch(),
                   loss_fn=spec.loss_fn, optimizer=optimizer)  # fmt: skip


def _check_host_memory(args: ModelArgs, itemsize: int) -> None:
    """Refuse to build a model on the CPU whose weights, gradients and optimizer state alone would
    take most of this machine's memory: the user meant to estimate it."""
    from remat.models import zoo

    params = zoo.ZOO[args.model].nominal_params
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return
    copies = 2 + {"adamw": 2, "sgd": 0, "none": 0}[args.optimizer]
    need = (params or 0) * itemsize * copies
    if need > ram // 2:
        raise InvalidValue(
            f"{args.model} needs about {format_bytes(need)} for its parameters, gradients and "
            f"optimizer state alone, too much to measure in this machine's {format_bytes(ram)}; "
            f"estimate it for a device instead, e.g. --device h100"
        )


def import_factory(ref: str) -> Callable[[], Any]:
    """The function ``module:function`` names, imported with the current folder on the path."""
    module_name, _, attr = ref.partition(":")
    if not module_name or not attr:
        raise InvalidValue(
            f"--model {ref!r}: expected a zoo name or module:function (e.g. mypkg.models:make)"
        )
    try:
        with cwd_on_path():
            obj: Any = importlib.import_module(module_name)
    except (Exception, SystemExit) as e:  # a user's module may fail in any way; say which and why
        raise InvalidValue(
            f"cannot import module {module_name!r} for --model {ref}: {type(e).__name__}: {e}"
        ) from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = [n for n in dir(obj) if not n.startswith("_")]
            hint = did_you_mean(part, names)
            raise InvalidValue(f"module {module_name!r} has no attribute {attr!r}{hint}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise InvalidType(f"--model {ref}: {attr} is a {type(obj).__name__}, not a function")
    return obj  # type: ignore[no-any-return]


@contextlib.contextmanager
def cwd_on_path() -> Iterator[None]:
    """The current folder first on ``sys.path`` while a module the user named on the command
    line is imported, as ``python -m`` does, and only then: nothing else is ever imported from
    it (a folder holding its own ``pydoc_data`` must not shadow the standard library's)."""
    cwd = os.getcwd()
    if cwd in sys.path:
        yield
        return
    sys.path.insert(0, cwd)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(cwd)


def call_factory(factory: Callable[[], Any], name: str) -> Any:
    """``factory()``, whose failure (any exception, or ``SystemExit``, which would end the command
    quietly with its code) is a ``ValueError`` that names it (NOTE [ Exit codes and errors ])."""
    try:
        with cwd_on_path():  # the user named it: its own lazy imports of its neighbours work
            return factory()
    except (Exception, SystemExit) as e:
        raise InvalidValue(f"the factory {name} raised {type(e).__name__}: {e}") from e


def _call_factory(factory: Callable[[], Any], args: ModelArgs) -> tuple[nn.Module, Any, Any]:
    """(model, batch, loss_fn) from a factory (NOTE [ Exit codes and errors ]: its failure is 1)."""
    from torch import nn

    result = call_factory(factory, args.model)
    if isinstance(result, nn.Module):
        from remat.models import loss_fn_for, make_batch

        try:
            loss_fn = loss_fn_for(result)
        except TypeError:
            raise InvalidType(
                f"the factory {args.model} returned a {type(result).__name__} alone; remat can make "
                "a batch only for its own models (remat.models), so return (model, batch, loss_fn)"
            ) from None
        param = next(result.parameters(), None)
        if param is None:
            raise InvalidValue(f"the factory {args.model} returned a {type(result).__name__} with no "
                             "parameters: there is nothing to train")  # fmt: skip
        batch = make_batch(result, batch_size=args.batch or 1, seq_len=args.seq,
                           dtype=param.dtype, device=param.device)  # fmt: skip
        return result, batch, loss_fn
    if (
        isinstance(result, tuple)
        and len(result) in (2, 3)
        and isinstance(result[0], nn.Module)
        and (len(result) == 2 or result[2] is None or callable(result[2]))
    ):
        if args.batch is not None or args.seq is not None:
            raise InvalidValue(
                f"the factory {args.model} makes its own batch; --batch and --seq apply to zoo "
                "models and to factories that return a remat.models model alone"
            )
        return result[0], result[1], result[2] if len(result) == 3 else None
    raise InvalidType(
        f"the factory {args.model} returned {type(result).__name__}; expected (model, batch, "
        "loss_fn) with model an nn.Module, or a remat.models model alone"
    )
