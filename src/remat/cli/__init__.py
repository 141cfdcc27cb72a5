"""The ``remat`` command: ``remat demo | profile | plan | verify | train``."""

from remat.cli.commands import main

__all__ = ["main"]
