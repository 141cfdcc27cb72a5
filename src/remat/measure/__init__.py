"""Measuring a step: the step's calling convention, the memory tracer, the fake-tensor meter, and
the profiler that turns traces into a ``Profile``."""
