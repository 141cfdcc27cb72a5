"""Every error remat raises on purpose, under one base: ``except remat.RematError``.

# NOTE [ One base, the builtin it always was ]
Each class derives from ``RematError`` *and* from the builtin type remat raised before there was a
base (``ValueError`` for a value it cannot use, ``TypeError`` for an argument of the wrong kind,
``FileNotFoundError`` for a missing file, ...), so a caller's ``except ValueError`` still catches
what it caught. What is *not* a ``RematError`` is not on purpose: a bug in remat, or in the code it
ran (a model, a batch, a loss function). The command line turns a ``RematError`` into one
``Error: ...`` line and exit status 1, and shows anything else as the bug it is (NOTE [ Exit codes
and errors ] in ``remat.cli.common``). Messages teach: what was expected, what was found, and,
for a misspelt name, the name meant (``did_you_mean``).

No torch here: the planning side raises these too.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence

__all__ = [
    "BlockError",
    "CheckpointError",
    "InfeasibleBudget",
    "InvalidState",
    "InvalidType",
    "InvalidValue",
    "MissingDependency",
    "MissingFile",
    "NotAFile",
    "PlanMismatch",
    "ProfileError",
    "RecordError",
    "RematError",
    "UnknownKey",
    "WrappingError",
    "close_matches",
    "did_you_mean",
    "first_names",
    "out_of_memory",
]


class RematError(Exception):
    """The base of every error remat raises on purpose (NOTE [ One base, the builtin it always
    was ])."""


# --- the general ones, by the builtin they also are ---------------------------------------------


class InvalidValue(RematError, ValueError):
    """A value remat cannot use: an unknown name, a number out of range, options that conflict."""


class InvalidType(RematError, TypeError):
    """An argument of a kind remat does not take (a list where a mapping goes, ...)."""


class InvalidState(RematError, RuntimeError):
    """A call made out of order (reading a trace before it ends, ``step`` before ``backward``)."""


class UnknownKey(RematError, KeyError):
    """A key that is not there (a mark a trace does not have)."""


class MissingFile(RematError, FileNotFoundError):
    """A file or folder remat needs is not there."""


class NotAFile(RematError, IsADirectoryError):
    """A folder where remat needs one file."""


class MissingDependency(RematError, ModuleNotFoundError):
    """An optional dependency (matplotlib, transformers) is not installed; the message says how to
    install it."""


# --- the stages' own ----------------------------------------------------------------------------


class RecordError(RematError, ValueError):
    """A record file that cannot be read: wrong kind, wrong schema version, or malformed."""


class BlockError(RematError, ValueError):
    """The blocks of a model cannot be found, or the ones named do not fit together."""


class ProfileError(RematError, ValueError):
    """The model cannot be profiled as given (a block that runs twice, no gradients, ...)."""


class InfeasibleBudget(RematError, ValueError):
    """No plan (of the method asked for) brings the step's peak under the budget."""

    def __init__(self, message: str, *, budget_bytes: int, smallest_bytes: int, dominant: str,
                 estimated: bool = False, repeated: list[str] | None = None, plain_bytes: int | None = None):
        super().__init__(message)
        self.budget_bytes = budget_bytes
        """The budget asked for."""
        self.smallest_bytes = smallest_bytes
        """The lowest peak any plan reaches: the smallest budget that can be met (where ``estimated``,
        a lower bound of it)."""
        self.dominant = dominant
        """What dominates that lowest peak, for people."""
        self.estimated = estimated
        """Whether ``smallest_bytes`` is an estimate, not a floor real steps measured: from the step's
        tensors alone, where no real step fits the budget, or just above the budget, where the floor
        plan's own step ran out of memory (NOTE [ Planning what does not fit ] in remat.measure.lean).
        What no tensor holds (a kernel's scratch space, as a convolution's or a loss's temporary) may put
        the smallest budget that can be met higher."""
        self.repeated = list(repeated or [])
        """Modules that ran more than once in the step and kept their activations (``Profile.repeated``):
        checkpointing every call of them lowers ``smallest_bytes`` (NOTE [ Every call of a tied module ]
        in remat.measure.tied)."""
        self.plain_bytes = plain_bytes
        """The plain step's peak in the profile refused, where one was (measured, or predicted from fake
        tensors): what a budget such as ``"60%"`` is a share of."""


class PlanMismatch(RematError, ValueError):
    """The plan was made for another model."""


class WrappingError(RematError, ValueError):
    """remat was asked to apply a plan to a model that is already sharded: the order is wrong."""


class CheckpointError(RematError, ValueError):
    """A checkpoint that cannot be resumed (unreadable, or of another run), or one that a new run
    would overwrite. The file is left as it is."""


# --- did you mean -------------------------------------------------------------------------------


_CUTOFF = 0.6  # difflib.get_close_matches's


def close_matches(word: str, choices: Iterable[str], *, n: int = 1) -> list[str]:
    """Up to ``n`` of ``choices`` closest to ``word``, best first, compared without case
    (``GPT-tiny`` is ``gpt-tiny``, not ``vit-tiny``); among equals, the one closer in case."""
    word = str(word)
    scored = []
    for choice in dict.fromkeys(c for c in choices if c):
        folded = difflib.SequenceMatcher(None, word.lower(), choice.lower()).ratio()
        if folded >= _CUTOFF:
            exact = difflib.SequenceMatcher(None, word, choice).ratio()
            scored.append((folded, exact, choice))
    scored.sort(key=lambda s: (-s[0], -s[1]))
    return [choice for _, _, choice in scored[:n]]


def first_names(names: Sequence[str]) -> str:
    """Up to four of ``names`` for a message, ``" ..."`` after them when there are more."""
    return f"{list(names[:4])}{' ...' if len(names) > 4 else ''}"


def did_you_mean(word: str, choices: Iterable[str], *, n: int = 1) -> str:
    """``"; did you mean 'gpt-tiny'?"`` (or with ``n`` > 1, several, comma-separated), or ``""``
    when nothing is close: to append to an "unknown ..." message."""
    close = close_matches(word, choices, n=n)
    return f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""


def out_of_memory(e: BaseException) -> bool:
    """Whether ``e`` is the device running out of memory: CUDA's ``OutOfMemoryError``, or the CPU
    allocator's refusal (under an address-space cap), or the host's (``MemoryError``: a C++
    ``std::bad_alloc``, numpy's refusal)."""
    return type(e).__name__ == "OutOfMemoryError" or isinstance(e, MemoryError) or "can't allocate memory" in str(e)
