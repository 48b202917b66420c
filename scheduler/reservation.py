"""Reservations: a big job that has waited too long stops being overtaken forever.

Greedy placement lets small jobs flow around a big blocked job indefinitely. Once a large gang
job (a whole machine or more) has waited past the starvation threshold, it reserves the place
where it would fit soonest (by the
running jobs' expected ends). Other jobs may still use free GPUs there, but only if they are
expected to finish before the reservation starts — that is backfill that never delays it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from scheduler.capacity import Capacity
from scheduler.models import JobSpec, Topology
from scheduler.placement import resolved_topology


@dataclass(frozen=True)
class Hold:
    job_id: str
    machines: frozenset[int]
    expected_start: float


class ReleaseBook:
    """When each machine's GPUs come back, by the running jobs' expected ends."""

    def __init__(self, releases: Iterable[tuple[float, Sequence[tuple[int, int]]]]):
        """`releases`: (expected end, (machine, GPU count) of what it frees) per running job."""
        self.by_machine: dict[int, list[tuple[float, int]]] = {}
        for end, machines in releases:
            for i, count in machines:
                self.by_machine.setdefault(i, []).append((end, count))


def plan_hold(
    cap: Capacity, spec: JobSpec, book: ReleaseBook, now: float, held: frozenset[int]
) -> Hold | None:
    """The machines where `spec` would start soonest, outside machines already held."""
    pools = cap.eligible_pools(spec)
    if not pools:
        return None
    n = spec.num_gpus
    machines = [i for p in pools for i in p.members if i not in held]
    topology = resolved_topology(cap, spec)
    largest = max(p.key.gpus for p in pools)
    if topology == Topology.machine or (topology == Topology.any and n <= largest):
        groups = [[i] for i in machines]
    elif topology == Topology.block:
        by_block: dict[str, list[int]] = {}
        for i in machines:
            by_block.setdefault(cap.machines[i].block, []).append(i)
        groups = list(by_block.values())
    else:
        groups = [machines]
    best: Hold | None = None
    for group in groups:
        hold = _soonest_fit(cap, group, n, book, now, spec.job_id)
        if hold is not None and (best is None or hold.expected_start < best.expected_start):
            best = hold
    return best


def _soonest_fit(
    cap: Capacity, group: list[int], n: int, book: ReleaseBook, now: float, job_id: str
) -> Hold | None:
    have = sum(len(cap.free[i]) for i in group)
    used = {i for i in group if cap.free[i]}
    if have >= n:
        return Hold(job_id, frozenset(used), now)
    releases = sorted((end, count, i) for i in group for end, count in book.by_machine.get(i, ()))
    for end, count, i in releases:
        have += count
        used.add(i)
        if have >= n:
            return Hold(job_id, frozenset(used), end)
    return None
