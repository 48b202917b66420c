"""Reservations: a big job that has waited too long stops being overtaken forever.

Greedy placement lets small jobs flow around a big blocked job indefinitely. Once a large gang
job (a whole machine or more) has waited past the starvation threshold, it reserves the place
where it would fit soonest (by when GPUs come back: scheduler/coming_back.py). Other jobs may
still use free GPUs there, but only if they are expected to finish before the reservation
starts — that is backfill that never delays it.
"""

from __future__ import annotations

import math
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
    """When each machine's GPUs come back to use."""

    def __init__(self, releases: Iterable[tuple[float, Sequence[tuple[int, int]]]]):
        """`releases`: (when, (machine, GPU count) of the GPUs usable again then) per return.
        Grouped by machine, or put in time order, when first asked for: a cycle usually plans
        for one shape of job and needs only one of the two."""
        self.releases = list(releases)
        self._by_machine: dict[int, list[tuple[float, int]]] | None = None
        self._in_time_order: list[tuple[float, int, int]] | None = None

    @property
    def by_machine(self) -> dict[int, list[tuple[float, int]]]:
        """Per machine, its (end, GPU count) releases, soonest first."""
        if self._by_machine is None:
            by_machine: dict[int, list[tuple[float, int]]] = {}
            for end, machines in self.releases:
                for i, count in machines:
                    found = by_machine.get(i)
                    if found is None:
                        by_machine[i] = [(end, count)]
                    else:
                        found.append((end, count))
            for entries in by_machine.values():
                entries.sort()
            self._by_machine = by_machine
        return self._by_machine

    @property
    def in_time_order(self) -> list[tuple[float, int, int]]:
        """Every (end, GPU count, machine) release, soonest first."""
        if self._in_time_order is None:
            entries = [(end, count, i) for end, machines in self.releases for i, count in machines]
            entries.sort()
            self._in_time_order = entries
        return self._in_time_order


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
        return _soonest_machine(cap, machines, n, book, now, spec.job_id)
    if topology == Topology.block:
        return _soonest_in_a_block(cap, machines, n, book, now, spec.job_id)
    return _soonest_anywhere(cap, machines, n, book, now, spec.job_id)


def _soonest_machine(
    cap: Capacity, machines: list[int], n: int, book: ReleaseBook, now: float, job_id: str
) -> Hold | None:
    """`plan_hold` for a job on one machine: the machine where it fits soonest, the first of
    `machines` among equals."""
    free, by_machine = cap.free, book.by_machine
    best_at, best = math.inf, None
    for i in machines:
        have = len(free[i])
        if have >= n:
            at = now
        else:
            at = None
            for end, count in by_machine.get(i, ()):
                if best is not None and end >= best_at:
                    break  # it could only tie with a machine met before it, which wins ties
                have += count
                if have >= n:
                    at = end
                    break
            if at is None:
                continue
        if best is None or at < best_at:
            best_at, best = at, i
    return None if best is None else Hold(job_id, frozenset((best,)), best_at)


def _soonest_in_a_block(
    cap: Capacity, machines: list[int], n: int, book: ReleaseBook, now: float, job_id: str
) -> Hold | None:
    """`plan_hold` for a job that must stay in one block: the block where it fits soonest, the
    first met in `machines` among equals. One pass over the releases in time order serves every
    block, and stops once no block could fit sooner than the best found."""
    free, block_of = cap.free, cap.block_of
    have: dict[str, int] = {}
    used: dict[str, list[int]] = {}  # per block, its machines the hold would take, in order
    for i in machines:
        block = block_of[i]
        if block not in have:
            have[block], used[block] = 0, []
        if free[i]:
            have[block] += len(free[i])
            used[block].append(i)
    place = {block: k for k, block in enumerate(have)}
    best_at, best = math.inf, None
    for block, count in have.items():
        if count >= n:
            best_at, best = now, block
            break
    eligible = set(machines)
    for end, count, i in book.in_time_order:
        if best is not None and end > best_at:
            break
        if i not in eligible:
            continue
        block = block_of[i]
        before = have[block]
        if before >= n:
            continue  # this block fitted already, at an earlier release
        have[block] = before + count
        used[block].append(i)
        if before + count >= n and (best is None or end < best_at or place[block] < place[best]):
            best_at, best = end, block
    if best is None:
        return None
    return Hold(job_id, frozenset(used[best]), best_at)


def _soonest_anywhere(
    cap: Capacity, machines: list[int], n: int, book: ReleaseBook, now: float, job_id: str
) -> Hold | None:
    """`plan_hold` for a job that may spread over the cluster: the soonest time enough GPUs of
    `machines` are free, and the machines that free them."""
    free = cap.free
    have = sum(len(free[i]) for i in machines)
    used = {i for i in machines if free[i]}
    if have >= n:
        return Hold(job_id, frozenset(used), now)
    eligible = set(machines)
    for end, count, i in book.in_time_order:
        if i in eligible:
            have += count
            used.add(i)
            if have >= n:
                return Hold(job_id, frozenset(used), end)
    return None
