"""``python -m remat``: the ``remat`` command."""

from remat.cli import main

if __name__ == "__main__":
    main(prog_name="remat")
