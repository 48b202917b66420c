"""How the processes that run the cycle set Python's garbage collector.

A cycle makes and drops hundreds of thousands of short-lived objects, none of them held in
reference cycles, so reference counting frees them all (tests/test_gc_policy.py checks that a
busy cycle leaves nothing for the collector). With the default thresholds the collector still
starts every 700 allocations and walks the young objects each time: a tenth of a cycle's time,
and the cause of most of its slowest cycles. Raising the thresholds is not enough: the counts
carry over from between cycles, so now and then a full collection of the whole heap still falls
inside a cycle. That walks every object of the process: 7 ms at rest in the benchmark's process,
25–90 ms with the benchmark's snapshots alive, 45 ms in one with the control worker's imports
(Temporal SDK, asyncpg, boto3). So the collector is off while a cycle is planned and committed
(`no_collections`): the cycle has nothing for it to find, and what the process owes it (the
allocations counted meanwhile) is collected once the collector is back on, at the first
allocation after the commit, off the path of the decisions. Where that collection lands is the
caller's choice: the live store's cycle (`Store.plan_cycle`) holds the collector off from its
read, once the cluster's lock is held, until its transaction has committed and its connection
is back in the pool; `bench/cycle.py` times the cycle alone and the collections after it apart,
as a full collection every ~50 cycles walks the process's heap, which is not the cycle's work.
The store's hold lasts as long as its statements: reads that wait for nobody, then the commit's
writes, which wait for a job's row only while another transaction holds it (the server ends one
left idle past `IDLE_IN_TRANSACTION_S`, activities/store.py). Holders may overlap (two clusters'
cycles interleave on one event loop): the collector comes back when the last of them is done.

The simulator runs thousands of cycles and its own bookkeeping between them in one block, where
switching the collector off would let any cyclic garbage of the engine pile up; it raises the
thresholds instead (`few_collections`), so the collector starts only every 50,000 allocations,
and sets everything loaded so far aside (`freeze`), so no collection walks the trace again.

This is process configuration at the edge (the live store's cycle, the simulator, the
benchmarks); the scheduling core itself never touches the collector.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator

YOUNG_THRESHOLD = 50_000


_holders = 0  # no_collections blocks open now
_resume = False  # whether the collector was on when the first of them opened


@contextmanager
def no_collections() -> Iterator[None]:
    """One cycle: the collector off, and back as it was once the last overlapping holder is done."""
    global _holders, _resume
    if _holders == 0:
        _resume = gc.isenabled()
        gc.disable()
    _holders += 1
    try:
        yield
    finally:
        _holders -= 1
        if _holders == 0 and _resume:
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
