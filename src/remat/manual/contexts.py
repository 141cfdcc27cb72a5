"""The contexts remat enters inside a checkpointed function (NOTE [ remat's contexts inside
torch's ] in ``remat.manual.checkpoint``), besides the BatchNorm restore (``remat.manual.batchnorm``):
autocast's casts uncached in the forward, and the early stop of a recompute let through the
block's own error handling. A segment's blocks run under them too (``remat.manual.segments``)."""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Iterator

import torch
from torch.utils.checkpoint import _StopRecomputationError as _StopRecomputation

__all__ = ["stop_passes_through", "uncached_casts"]


# NOTE [ Autocast's casts in a checkpoint's forward ]
# 1. Under autocast, the low-precision copy of a parameter is cached from its first cast until the
#    outermost autocast region exits: the end of the model's forward, as a user writes it. A
#    checkpointed forward saves none of its casts, but cached they lived to that end all the same
#    (a layer's bf16 weights, 393,216 B in a pure-torch transformer): the profile's recompute run
#    read them as kept to the block's backward, they died in the head instead, and plans mixing
#    options measured up to 398 KiB over their prediction (CoCa under bf16 autocast: 575 KB).
# 2. So a checkpoint's forward (and a segment's, remat.manual.segments) runs without the cache:
#    each cast dies after its last use, as the tensors the checkpoint drops do.
# 3. The recompute runs with the cache as the forward was entered (torch's checkpoint and a
#    segment's call record it outside this), so its casts, its graph and the gradients are the
#    plain step's.
# 4. Left: a kept block's cast that no op saves (a bias's) is still cached to the end of the
#    forward, and dies in the head under every plan the profile's kept run stands for. A plan
#    that recomputes such a block frees it earlier than that run says, and measures it over its
#    prediction (2,304 B per recomputed layer of tests/test_reach.py's autocast model given
#    biases; CoCa's layers have none and are exact).


@contextlib.contextmanager
def uncached_casts() -> Iterator[None]:
    """Autocast without its cast cache while the block runs (NOTE [ Autocast's casts in a
    checkpoint's forward ])."""
    cached = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(cached)


# NOTE [ A recompute stopped early ]
# torch stops a recompute once it holds every tensor the backward needs, by raising its own
# ``_StopRecomputationError`` inside the block's forward, to be caught around it. A library that
# re-raises every error of its calls as its own (einx, which x-transformers calls for masks and
# residuals) hides it, and the backward fails: the same block runs with torch's checkpoint only
# with ``early_stop=False``. A recompute re-raises torch's error wherever it finds it in the chain,
# and a segment's replay its own (``Done``, NOTE [ A segment is one recompute frame over several
# calls ] in remat.manual.segments). The wrapper's frame holds the stop it caught, and the stop's
# traceback holds that frame: a cycle through every frame the recompute ran, with the tensors they
# made, that only the garbage collector frees. So the frames of the chain are cleared as the stop
# passes: x-transformers' masked attention in a segment left 1.78 MB per segment live to the end of
# the step, and a floor plan of 11 segments measured 4.9 MB over its prediction
# (tests/test_segments.py).


@contextlib.contextmanager
def stop_passes_through(stop: type[BaseException] = _StopRecomputation) -> Iterator[None]:
    """Re-raise the early stop of a recompute (torch's, or a segment's replay's ``Done``) that the
    block's code wrapped in its own error (NOTE [ A recompute stopped early ])."""
    try:
        yield
    except Exception as e:
        found = _wrapped_stop(e, stop)
        if found is None:
            raise
        e.__cause__ = e.__context__ = e.__traceback__ = None  # no cycle through the raise below
        try:
            raise found from None
        finally:
            del found, e  # nor through this frame, which the raise adds to the traceback


def _wrapped_stop(e: BaseException, stop: type[BaseException]) -> BaseException | None:
    """The stop in ``e``'s chain, when ``e`` wraps one, with the frames along the chain cleared
    (NOTE [ A recompute stopped early ]: they hold the recompute's tensors); else None."""
    cause: BaseException | None = e
    while cause is not None and not isinstance(cause, stop):
        cause = cause.__cause__ or cause.__context__
    if cause is None or cause is e:
        return None
    link: BaseException | None = e
    while link is not None:
        traceback.clear_frames(link.__traceback__)
        link = None if link is cause else link.__cause__ or link.__context__
    return cause
