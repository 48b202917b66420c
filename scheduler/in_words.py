"""Numbers as a person reads them, for pending reasons and reports.

Reasons are read long after the cycle that wrote them only by tools that also show the cycle's
time, so a time in a reason is said relative to the cycle's `now` ("in 12.5 min"): an epoch
second means nothing to the person waiting, and a simulation's clock has no calendar date.
"""

from __future__ import annotations


def duration(seconds: float) -> str:
    """45 s, 12.5 min, 3.2 h, 2.1 d."""
    s = float(seconds)
    if abs(s) < 120:
        return f"{s:.0f} s" if abs(s) >= 10 or s == int(s) else f"{s:.1f} s"
    if abs(s) < 2 * 3600:
        return f"{s / 60:.1f} min"
    if abs(s) < 72 * 3600:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} d"


def from_now(at: float, now: float) -> str:
    """When `at` comes, seen from `now`: "in 45 s", or "now" once it has come."""
    return "now" if at <= now else f"in {duration(at - now)}"


def gpus(n: int) -> str:
    """1 GPU, 8 GPUs."""
    return f"{n} GPU" if n == 1 else f"{n} GPUs"
