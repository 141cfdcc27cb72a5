"""What remat says when a name is not one it knows: ``did_you_mean``, one helper for every
"unknown X" message (zoo models, devices, methods, options, blocks, attributes).

No torch here: the pure planner uses it too.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["close_matches", "did_you_mean"]

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


def did_you_mean(word: str, choices: Iterable[str], *, n: int = 1) -> str:
    """``"; did you mean 'gpt-tiny'?"`` (or with ``n`` > 1, several, comma-separated), or ``""``
    when nothing is close: to append to an "unknown ..." message."""
    close = close_matches(word, choices, n=n)
    return f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
