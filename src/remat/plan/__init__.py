"""The pure planning side: the step's schedule, the cost model, the solvers, per-rank sharding.

Numbers in, numbers out: nothing below this folder imports torch (``tests/test_layout.py`` checks),
so planning for a device this machine does not have needs only the records.
"""
