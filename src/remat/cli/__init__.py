"""The ``remat`` command: ``remat demo | profile | plan | verify | train``."""

from remat.cli.main import main

__all__ = ["main"]
