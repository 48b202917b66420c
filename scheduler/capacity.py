"""The cycle's scratch copy of the fleet: which GPUs are free, grouped so a fit is found fast.

Machines are grouped into *pools* of interchangeable machines (same partition, GPU type, memory
and size). Inside a pool, machines sit in buckets by their count of free GPUs, so "the fullest
machine that still has n free GPUs" is a walk over at most a machine's GPU count of buckets
instead of a scan of the fleet. Only machines that are reachable and take work, and GPUs that are
healthy, count.
"""

from __future__ import annotations

from bisect import insort
from dataclasses import dataclass, field
from operator import is_
from types import MappingProxyType
from typing import Mapping, NamedTuple
from typing import Iterable, Sequence

from scheduler.models import INFERENCE_PARTITION, GpuSlot, JobKind, JobSpec, Machine, RunningJob, Topology
from scheduler.since_last_cycle import PerCluster, RunningChanges


class PoolKey(NamedTuple):
    partition: str
    gpu_type: str
    gpu_memory_gb: float
    gpus: int


# The reserved pool: per pool, how many of its whole machines small jobs must leave whole (none
# where no waiting job could use them).
KeepWhole = Mapping[PoolKey, int]
NO_RESERVE: KeepWhole = MappingProxyType({})


def reserve_serves(key: PoolKey, reserve: int, num_gpus: int, topology: Topology) -> bool:
    """Whether a pool's reserve of ``reserve`` whole machines is kept for a job of ``num_gpus``
    (its topology resolved): one that needs whole machines and that the reserve alone could
    host. A one-machine job bigger than the pool's machines never runs on them."""
    most = key.gpus if topology == Topology.machine else reserve * key.gpus
    return key.gpus <= num_gpus <= most


@dataclass(eq=False)  # a pool is itself: compared by identity, fast in `in` tests
class Pool:
    key: PoolKey
    members: list[int] = field(default_factory=list)
    buckets: list[set[int]] = field(default_factory=list)  # buckets[c]: machines with c free GPUs
    free: int = 0  # free GPUs in all its machines, kept in step with the buckets

    @property
    def whole_machines(self) -> int:
        return len(self.buckets[self.key.gpus])

    def largest_free(self) -> int:
        for count in range(self.key.gpus, 0, -1):
            if self.buckets[count]:
                return count
        return 0


@dataclass
class Layout:
    """What does not change between cycles while the machines do not: built once per fleet state."""

    cluster: str
    machines: list[Machine]
    index: dict[str, int]
    healthy: list[tuple[int, ...]]  # sorted
    healthy_mask: list[int]  # the same, as bit masks
    blocks: list[str]  # distinct, in machine order
    pools: dict[PoolKey, list[int]]
    pool_key: list[PoolKey]
    shapes: frozenset[PoolKey]  # of every machine, down or not: what a job's default topology reads
    block_of: list[str]
    rack_of: list[str]
    has_inference_partition: bool
    gpus_per_machine: int
    all_healthy: bool  # every machine reachable, no sick GPU
    out_of_service: dict[PoolKey, int]  # per pool, its machines that answer but take no work or drain


# Per cluster (one process may plan several in turn): the last layout, and what its jobs held.
_last_layout: dict[str, tuple[Sequence[Machine], Layout]] = {}
_held: PerCluster["_Held"] = PerCluster()


def _cluster_of(machines: Sequence[Machine]) -> str:
    return machines[0].cluster if machines else ""


def _layout_of(machines: Sequence[Machine]) -> Layout:
    # The machines are immutable and usually the very same objects cycle after cycle, so the
    # last layout is reused when the caller passes the same machine objects in the same order
    # (identity checks, never a guess: a changed machine is a new object).
    cluster = _cluster_of(machines)
    found = _last_layout.get(cluster)
    if found is not None:
        last = found[0]
        if last is machines or (len(last) == len(machines) and all(map(is_, last, machines))):
            return found[1]
    usable = [m for m in machines if m.reachable]
    healthy = [_usable_gpus(m) for m in usable]
    pools: dict[PoolKey, list[int]] = {}
    pool_key = []
    for i, m in enumerate(usable):
        key = PoolKey(m.partition, m.gpu_type, m.gpu_memory_gb, m.gpus)
        pools.setdefault(key, []).append(i)
        pool_key.append(key)
    layout = Layout(
        cluster=cluster,
        machines=usable,
        index={m.id: i for i, m in enumerate(usable)},
        healthy=healthy,
        healthy_mask=[sum(1 << g for g in gpus) for gpus in healthy],
        blocks=list(dict.fromkeys(m.block for m in usable)),
        pools=pools,
        pool_key=pool_key,
        shapes=frozenset(PoolKey(m.partition, m.gpu_type, m.gpu_memory_gb, m.gpus) for m in machines),
        block_of=[m.block for m in usable],
        rack_of=[m.rack for m in usable],
        # Down or not, an inference partition stays one: its jobs wait for it to come back.
        has_inference_partition=any(m.partition == INFERENCE_PARTITION for m in machines),
        gpus_per_machine=max((m.gpus for m in usable), default=0),
        all_healthy=all(m.reachable and m.takes_work and not m.drain and not m.unhealthy_gpus for m in machines),
        out_of_service={key: n for key, members in pools.items()
                        if (n := sum(1 for i in members if not usable[i].takes_work or usable[i].drain))},
    )
    if len(_last_layout) > 64:
        _last_layout.clear()
    _last_layout[cluster] = (machines, layout)
    return layout


def _usable_gpus(m: Machine) -> tuple[int, ...]:
    """The GPUs of a reachable machine that may be given to a job: its healthy ones, none while
    it takes no work (its jobs keep theirs) or is drained (its jobs leave, health.py)."""
    return tuple(g for g in range(m.gpus) if g not in m.unhealthy_gpus) if m.takes_work and not m.drain else ()


class Grouping(NamedTuple):
    """A running job's GPUs by machine index, in the forms the cycle reads them."""

    job: RunningJob
    layout: Layout
    # (machine, how many of its GPUs would come back when it ends: those the machine can give
    # out again, so none on a sick GPU or on a machine that takes no work)
    counts: list[tuple[int, int]]
    masks: list[tuple[int, int]]  # (machine, its GPUs held, as a bit mask)
    complete: bool  # every GPU is on a usable machine


_job_gpus: dict[int, Grouping] = {}


def grouped(layout: Layout, job: RunningJob) -> Grouping:
    """A running job's GPUs grouped by machine index; remembered per job object and layout.

    Running jobs are immutable and live for many cycles; grouping their GPUs once instead of
    every cycle is most of the cost of building the capacity. Remembered by identity, so a
    changed job (a new object) is always grouped afresh."""
    found = _job_gpus.get(id(job))
    if found is not None and found.job is job and found.layout is layout:
        return found
    grouped: dict[int, list[int]] = {}
    for machine_id, gpu in job.gpus:
        i = layout.index.get(machine_id)
        if i is not None:
            grouped.setdefault(i, []).append(gpu)
    if len(_job_gpus) > 100_000:
        _job_gpus.clear()
    masks = [(i, sum(1 << g for g in set(gpus))) for i, gpus in grouped.items()]
    healthy = layout.healthy_mask
    counts = [(i, n) for i, mask in masks if (n := (mask & healthy[i]).bit_count())]
    entry = Grouping(job, layout, counts, masks, sum(map(len, grouped.values())) == len(job.gpus))
    _job_gpus[id(job)] = entry
    return entry


def all_on_healthy_machines(machines: Sequence[Machine], running: Sequence[RunningJob]) -> bool:
    """True when every machine is up and healthy and every running job is on known machines:
    the common case, answered from what the last cycle's jobs were found to hold."""
    layout = _layout_of(machines)
    if not layout.all_healthy:
        return False
    with _held.lock:
        return _held_by(layout, running).incomplete == 0


class _Held:
    """What the running jobs hold, per machine, and the free GPUs that leaves, before any
    decision: kept from one cycle to the next (scheduler/since_last_cycle.py), so a cycle looks
    only at the jobs that started or ended since the last one and at their machines, instead
    of at every GPU of every job."""

    def __init__(self, layout: Layout, running: Sequence[RunningJob]):
        self.layout = layout
        self.changes = RunningChanges(running)
        self.on: dict[int, dict[int, int]] = {}  # machine -> {id(job): its GPUs there, as a mask}
        self.incomplete = 0  # jobs with a GPU off the usable machines
        for job in running:
            self._add(job)
        self.base = Capacity.__new__(Capacity)
        self.base._fill(layout, {i: _mask_of(on) for i, on in self.on.items()})

    def _add(self, job: RunningJob) -> Iterable[int]:
        grouping = grouped(self.layout, job)
        self.incomplete += not grouping.complete
        key = id(job)
        for i, mask in grouping.masks:
            self.on.setdefault(i, {})[key] = mask
        return (i for i, _ in grouping.masks)

    def _remove(self, job: RunningJob) -> Iterable[int]:
        grouping = grouped(self.layout, job)
        self.incomplete -= not grouping.complete
        key = id(job)
        for i, _ in grouping.masks:
            on = self.on[i]
            del on[key]
            if not on:
                del self.on[i]
        return (i for i, _ in grouping.masks)

    def update(self, running: Sequence[RunningJob]) -> bool:
        """Follow the jobs that started and ended since; False when too many did (build anew)."""
        changes = self.changes.since(running)
        if changes is None:
            return False
        ended, started = changes
        if not ended and not started:
            return True
        touched: set[int] = set()
        for job in ended:
            touched.update(self._remove(job))
        for job in started:
            touched.update(self._add(job))
        base, healthy = self.base, self.layout.healthy_mask
        for i in touched:
            before = len(base.free[i])
            on = self.on.get(i)
            left = healthy[i] & ~_mask_of(on) if on else healthy[i]
            base.free[i] = list(_gpus_in(left))
            base._moved(i, before)
        return True


def _mask_of(on: dict[int, int]) -> int:
    held = 0
    for mask in on.values():
        held |= mask
    return held


def _held_by(layout: Layout, running: Sequence[RunningJob]) -> _Held:
    """The last cycle's `_Held` of this layout brought up to date, or a new one; call it with
    `_held.lock` held."""
    if not isinstance(running, (list, tuple)):
        running = tuple(running)
    return _held.get(layout.cluster, lambda held: held.layout is layout and held.update(running),
                     lambda: _Held(layout, running))


_GPU_LISTS: dict[int, tuple[int, ...]] = {}


def _gpus_in(mask: int) -> tuple[int, ...]:
    """The GPU numbers set in a bit mask, lowest first; remembered (a machine has few masks)."""
    found = _GPU_LISTS.get(mask)
    if found is None:
        found = _GPU_LISTS[mask] = tuple(g for g in range(mask.bit_length()) if mask >> g & 1)
    return found


class Capacity:
    """Free GPUs per usable machine; `take` and `give` keep the buckets in step."""

    def __init__(self, machines: Sequence[Machine], running: Sequence[RunningJob] = ()):
        """The GPUs of `machines` that are healthy and not held by any of `running`."""
        layout = _layout_of(machines)
        with _held.lock:
            self._copy(_held_by(layout, running).base)

    def _fill(self, layout: Layout, held: dict[int, int]) -> None:
        """Build from scratch, given the GPUs held on each machine as a bit mask."""
        self.layout = layout
        self.machines = layout.machines
        self.index = layout.index
        healthy = layout.healthy_mask
        self.free: list[list[int]] = list(map(list, layout.healthy))
        free = self.free
        for i, mask in held.items():
            left = healthy[i] & ~mask
            free[i] = list(_gpus_in(left)) if left else []  # on a busy cluster most machines are full
        sizes = list(map(len, self.free))
        self.pools: dict[tuple, Pool] = {}
        for key, members in layout.pools.items():
            pool = self.pools[key] = Pool(key, members, [set() for _ in range(key.gpus + 1)])
            buckets = pool.buckets
            for i in members:
                buckets[sizes[i]].add(i)
            pool.free = sum(sizes[i] for i in members)
        self.pool_of: list[Pool] = [self.pools[key] for key in layout.pool_key]
        self.block_of = layout.block_of
        self.block_free: dict[str, int] = dict.fromkeys(layout.blocks, 0)
        block_free = self.block_free
        for block, size in zip(self.block_of, sizes):
            block_free[block] += size
        self.has_inference_partition = layout.has_inference_partition
        self.gpus_per_machine = layout.gpus_per_machine
        self._eligible: dict[tuple, list[Pool]] = {}
        self._terms: dict[tuple, tuple] = {}

    # --- reading -----------------------------------------------------------------------------

    def total_free(self, pools: Sequence[Pool]) -> int:
        return sum(p.free for p in pools)

    def fit_terms(self, spec: JobSpec) -> tuple[list[Pool], int, Topology]:
        """(eligible pools, their largest machine, the job's resolved topology), remembered."""
        key = (spec.kind, spec.gpu_type, spec.gpu_memory_gb, spec.num_gpus, spec.topology)
        terms = self._terms.get(key)
        if terms is None:
            pools = self.eligible_pools(spec)
            largest = max((p.key.gpus for p in pools), default=self.gpus_per_machine)
            # The default topology is the job's and the cluster's, as never_fits resolves it: an
            # 8-GPU job is a one-machine job while the 8-GPU machines are down too.
            terms = self._terms[key] = (pools, largest, spec.topology_for(self.largest_machine(spec) or largest))
        return terms

    def largest_machine(self, spec: JobSpec) -> int:
        """GPUs of the largest machine of the cluster that could host the job, down or not (0: none)."""
        return max((k.gpus for k in self.layout.shapes if self._admits(k, spec)), default=0)

    def could_fit(self, spec: JobSpec) -> bool:
        """A quick necessary condition for a fit: enough free GPUs in the right places at all."""
        pools, _, topology = self.fit_terms(spec)
        return self.has_room(pools, topology, spec.num_gpus)

    def has_room(self, pools: Sequence[Pool], topology: Topology, n: int) -> bool:
        """`could_fit` for terms already known (the estimate keeps them per lane of jobs)."""
        # Loops rather than any()/sum() over generators: the estimate asks this thousands of
        # times a cycle, mostly of one pool.
        if topology == Topology.machine:
            for pool in pools:  # a machine with n or more free GPUs
                buckets = pool.buckets
                for count in range(n, pool.key.gpus + 1):
                    if buckets[count]:
                        return True
            return False
        if topology == Topology.block and max(self.block_free.values(), default=0) < n:
            return False
        free = 0
        for pool in pools:
            free += pool.free
        return free >= n

    def eligible_pools(self, spec: JobSpec) -> list[Pool]:
        """The pools a job may run on: partition by kind, then GPU type and memory."""
        key = (spec.kind, spec.gpu_type, spec.gpu_memory_gb)
        pools = self._eligible.get(key)
        if pools is None:
            pools = [p for p in self.pools.values() if self._admits(p.key, spec)]
            self._eligible[key] = pools
        return pools

    def _admits(self, key: PoolKey, spec: JobSpec) -> bool:
        # A dedicated inference partition serves inference alone, so a training backlog never
        # delays it; without one, inference shares the training machines.
        if spec.kind == JobKind.inference and self.has_inference_partition:
            if key.partition != INFERENCE_PARTITION:
                return False
        elif key.partition == INFERENCE_PARTITION:
            return False
        if spec.gpu_type is not None and key.gpu_type != spec.gpu_type:
            return False
        if spec.gpu_memory_gb is not None and key.gpu_memory_gb < spec.gpu_memory_gb:
            return False
        return True

    def domains(self, scope: Topology) -> Sequence:
        """Per machine index, the place a gang of that scope must stay inside: the machine
        itself, its block, or (for `any`) the one cluster."""
        if scope == Topology.machine:
            return range(len(self.machines))
        if scope == Topology.block:
            return self.block_of
        return ("cluster",) * len(self.machines)

    def machines_of(self, job: RunningJob) -> list[tuple[int, int]]:
        """(machine, GPU count) of the GPUs a running job gives back to use when it ends."""
        return grouped(self.layout, job).counts

    def counts_of(self, slots: Iterable[GpuSlot]) -> list[tuple[int, int]]:
        """(machine, GPU count) of those of `slots` that can be given out again when they come
        back, as `grouped` counts a running job's: none on a sick GPU, or on a machine that takes
        no work or that this capacity does not know."""
        counts: dict[int, int] = {}
        healthy = self.layout.healthy_mask
        for machine_id, gpu in slots:
            i = self.index.get(machine_id)
            if i is not None and healthy[i] >> gpu & 1:
                counts[i] = counts.get(i, 0) + 1
        return list(counts.items())

    def slots_on(self, i: int, count: int) -> list[GpuSlot]:
        """The `count` lowest-numbered free GPUs of machine i (neighbours share links)."""
        machine_id = self.machines[i].id
        return [(machine_id, g) for g in self.free[i][:count]]

    # --- changing ----------------------------------------------------------------------------

    def take(self, slots: Iterable[GpuSlot]) -> None:
        before: dict[int, int] = {}
        for machine_id, gpu in slots:
            i = self.index[machine_id]
            free = self.free[i]
            before.setdefault(i, len(free))
            free.remove(gpu)
        for i, count in before.items():
            self._moved(i, count)

    def give(self, slots: Iterable[GpuSlot]) -> None:
        """Return GPUs (a finished or simulated-away job's); unusable ones are ignored."""
        before: dict[int, int] = {}
        for machine_id, gpu in slots:
            i = self.index.get(machine_id)
            if i is None:
                continue
            free = self.free[i]
            if gpu in free or not self.layout.healthy_mask[i] >> gpu & 1:
                continue
            before.setdefault(i, len(free))
            insort(free, gpu)
        for i, count in before.items():
            self._moved(i, count)

    def give_held(self, masks: Sequence[tuple[int, int]]) -> None:
        """`give` for a running job's GPUs as its grouping holds them, (machine, bit mask): the
        healthy ones that are not free already come back, without a lookup per GPU."""
        healthy = self.layout.healthy_mask
        for i, mask in masks:
            free = self.free[i]
            for g in free:
                mask &= ~(1 << g)
            back = mask & healthy[i]
            if back:
                before = len(free)
                free.extend(_gpus_in(back))
                free.sort()
                self._moved(i, before)

    def masks_of(self, job: RunningJob) -> list[tuple[int, int]]:
        """(machine, its GPUs held, as a bit mask) of a running job's usable GPUs."""
        return grouped(self.layout, job).masks

    def take_picks(self, picks: Sequence[tuple[int, int]]) -> list[tuple[int, list[int]]]:
        """Take the lowest free GPUs of each picked machine; returns what was taken, for give_back."""
        taken = []
        for i, count in picks:
            free = self.free[i]
            before = len(free)
            taken.append((i, free[:count]))
            del free[:count]
            self._moved(i, before)
        return taken

    def give_back(self, taken: Sequence[tuple[int, list[int]]]) -> None:
        for i, gpus in taken:
            free = self.free[i]
            before = len(free)
            free.extend(gpus)
            free.sort()
            self._moved(i, before)

    def _moved(self, i: int, before: int) -> None:
        after = len(self.free[i])
        pool = self.pool_of[i]
        buckets = pool.buckets
        buckets[before].discard(i)
        buckets[after].add(i)
        pool.free += after - before
        self.block_free[self.block_of[i]] += after - before

    def clone(self) -> "Capacity":
        twin = object.__new__(Capacity)
        twin._copy(self)
        return twin

    def _copy(self, other: "Capacity") -> None:
        self.layout = other.layout
        self.machines = other.machines
        self.index = other.index
        self.free = list(map(list, other.free))
        self.pools = {}
        for key, pool in other.pools.items():
            self.pools[key] = Pool(key, pool.members, list(map(set, pool.buckets)), pool.free)
        self.pool_of = [self.pools[p.key] for p in other.pool_of]
        self.block_of = other.block_of
        self.block_free = dict(other.block_free)
        self.has_inference_partition = other.has_inference_partition
        self.gpus_per_machine = other.gpus_per_machine
        self._eligible = {}
        self._terms = {}
