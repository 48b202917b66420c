"""How the processes that run the cycle set Python's garbage collector.

A cycle makes and drops hundreds of thousands of short-lived objects, none of them held in
reference cycles, so reference counting frees them all. With the default thresholds the
collector still starts every 700 allocations and walks the young objects each time: a tenth of
a cycle's time, and the cause of most of its slowest cycles. Inside `few_collections` it starts
only every 50,000 allocations; what is left is collected after the cycle, off the path of the
decisions. The simulator, which runs thousands of cycles over a trace it loaded first, also
sets everything loaded so far aside (`freeze`), so no collection walks it again.

This is process configuration at the edge (the live planner activity, the simulator, the
benchmark); the scheduling core itself never touches the collector.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator

YOUNG_THRESHOLD = 50_000


@contextmanager
def few_collections(*, freeze: bool = False) -> Iterator[None]:
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
