"""How the processes that run the cycle set Python's garbage collector.

A cycle makes and drops hundreds of thousands of short-lived objects, none of them held in
reference cycles, so reference counting frees them all (tests/test_gc_policy.py checks that a
busy cycle leaves nothing for the collector). With the default thresholds the collector still
starts every 700 allocations and walks the young objects each time: a tenth of a cycle's time,
and the cause of most of its slowest cycles. Raising the thresholds is not enough: the counts
carry over from between cycles, so now and then a full collection of the whole heap still falls
inside a cycle. That walks every object of the process: 7 ms at rest in the benchmark's process,
45 ms in one with the control worker's imports (Temporal SDK, asyncpg, boto3), more with a
cycle's objects alive. So one cycle runs with the collector off (`no_collections`): it has
nothing to find there, and whatever the process owes is collected after the cycle, off the path
of the decisions.

The simulator runs thousands of cycles and its own bookkeeping between them in one block, where
switching the collector off would let any cyclic garbage of the engine pile up; it raises the
thresholds instead (`few_collections`), so the collector starts only every 50,000 allocations,
and sets everything loaded so far aside (`freeze`), so no collection walks the trace again.

This is process configuration at the edge (the live planner activity, the simulator, the
benchmarks); the scheduling core itself never touches the collector.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator

YOUNG_THRESHOLD = 50_000


@contextmanager
def no_collections() -> Iterator[None]:
    """One cycle: the collector off, and back as it was afterwards."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@contextmanager
def few_collections(*, freeze: bool = False) -> Iterator[None]:
    """Many cycles (a simulation): the collector rarely, and what is loaded set aside."""
    thresholds = gc.get_threshold()
    if freeze:
        gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, 20, 100)
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        if freeze:
            gc.unfreeze()
