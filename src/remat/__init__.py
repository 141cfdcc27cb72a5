"""remat: make PyTorch training fit a memory budget with the least slowdown."""

from __future__ import annotations

__version__ = "0.1.0"
