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
        """`releases`: (expected end, (machine, GPU count) of what it frees) per running job.
        Grouped by machine, or by block, when first asked for: a cycle usually plans for one
        shape of job and needs only one of the two."""
        self.releases = list(releases)
        self._by_machine: dict[int, list[tuple[float, int]]] | None = None
        self._by_block: dict[str, list[tuple[float, int, int]]] | None = None

    @property
    def by_machine(self) -> dict[int, list[tuple[float, int]]]:
        """Per machine, its (end, GPU count) releases."""
        if self._by_machine is None:
            self._by_machine = {}
            for end, machines in self.releases:
                for i, count in machines:
                    self._by_machine.setdefault(i, []).append((end, count))
        return self._by_machine

    def in_blocks(self, block_of: Sequence[str]) -> dict[str, list[tuple[float, int, int]]]:
        """Per block, its (end, GPU count, machine) releases, soonest first."""
        if self._by_block is None:
            by_block: dict[str, list[tuple[float, int, int]]] = {}
            for end, machines in self.releases:
                for i, count in machines:
                    found = by_block.get(block_of[i])
                    if found is None:
                        by_block[block_of[i]] = [(end, count, i)]
                    else:
                        found.append((end, count, i))
            for entries in by_block.values():
                entries.sort()
            self._by_block = by_block
        return self._by_block


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
        return _soonest_in_a_block(cap, machines, n, book, now, spec.job_id)
    else:
        groups = [machines]
    best: Hold | None = None
    for group in groups:
        hold = _soonest_fit(cap, group, n, book, now, spec.job_id)
        if hold is not None and (best is None or hold.expected_start < best.expected_start):
            best = hold
    return best


def _soonest_in_a_block(
    cap: Capacity, machines: list[int], n: int, book: ReleaseBook, now: float, job_id: str
) -> Hold | None:
    """`plan_hold` for a job that must stay in one block: the block where it fits soonest."""
    by_block: dict[str, list[int]] = {}
    for i in machines:
        by_block.setdefault(cap.block_of[i], []).append(i)
    in_block = book.in_blocks(cap.block_of)
    best: Hold | None = None
    for block, group in by_block.items():
        # The block's releases are put in time order once per book; this group's are among them.
        members = set(group)
        releases = [entry for entry in in_block.get(block, ()) if entry[2] in members]
        hold = _fit_by(cap, group, n, releases, now, job_id)
        if hold is not None and (best is None or hold.expected_start < best.expected_start):
            best = hold
    return best


def _soonest_fit(
    cap: Capacity, group: list[int], n: int, book: ReleaseBook, now: float, job_id: str
) -> Hold | None:
    by_machine = book.by_machine
    releases = sorted((end, count, i) for i in group for end, count in by_machine.get(i, ()))
    return _fit_by(cap, group, n, releases, now, job_id)


def _fit_by(
    cap: Capacity, group: list[int], n: int, releases: list[tuple[float, int, int]], now: float, job_id: str
) -> Hold | None:
    """The group's GPUs free now, then its `releases` (end, count, machine) in time order, until
    n are free: the machines used and when."""
    have = sum(len(cap.free[i]) for i in group)
    used = {i for i in group if cap.free[i]}
    if have >= n:
        return Hold(job_id, frozenset(used), now)
    for end, count, i in releases:
        have += count
        used.add(i)
        if have >= n:
            return Hold(job_id, frozenset(used), end)
    return None
