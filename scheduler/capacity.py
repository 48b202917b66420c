"""The cycle's scratch copy of the fleet: which GPUs are free, grouped so a fit is found fast.

Machines are grouped into *pools* of interchangeable machines (same partition, GPU type, memory
and size). Inside a pool, machines sit in buckets by their count of free GPUs, so "the fullest
machine that still has n free GPUs" is a walk over at most a machine's GPU count of buckets
instead of a scan of the fleet. Only machines that are reachable and GPUs that are healthy count.
"""

from __future__ import annotations

from bisect import insort
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from scheduler.models import INFERENCE_PARTITION, GpuSlot, JobKind, JobSpec, Machine


@dataclass(frozen=True)
class PoolKey:
    partition: str
    gpu_type: str
    gpu_memory_gb: float
    gpus: int


@dataclass
class Pool:
    key: PoolKey
    members: list[int] = field(default_factory=list)
    buckets: list[set[int]] = field(default_factory=list)  # buckets[c]: machines with c free GPUs

    @property
    def whole_machines(self) -> int:
        return len(self.buckets[self.key.gpus])

    def largest_free(self) -> int:
        for count in range(self.key.gpus, 0, -1):
            if self.buckets[count]:
                return count
        return 0


class Capacity:
    """Free GPUs per usable machine; `take` and `give` keep the buckets in step."""

    def __init__(self, machines: Sequence[Machine], held: Iterable[GpuSlot] = ()):
        self.machines: list[Machine] = [m for m in machines if m.reachable]
        self.index: dict[str, int] = {m.id: i for i, m in enumerate(self.machines)}
        healthy = [set(range(m.gpus)) - m.unhealthy_gpus for m in self.machines]
        for machine_id, gpu in held:
            i = self.index.get(machine_id)
            if i is not None:
                healthy[i].discard(gpu)
        self.free: list[list[int]] = [sorted(s) for s in healthy]
        self.pools: dict[PoolKey, Pool] = {}
        self.pool_of: list[Pool] = []
        for i, m in enumerate(self.machines):
            key = PoolKey(m.partition, m.gpu_type, m.gpu_memory_gb, m.gpus)
            pool = self.pools.get(key)
            if pool is None:
                pool = self.pools[key] = Pool(key, buckets=[set() for _ in range(m.gpus + 1)])
            pool.members.append(i)
            pool.buckets[len(self.free[i])].add(i)
            self.pool_of.append(pool)
        self.has_inference_partition = any(k.partition == INFERENCE_PARTITION for k in self.pools)
        self.gpus_per_machine = max((m.gpus for m in self.machines), default=0)
        self._eligible: dict[tuple, list[Pool]] = {}

    # --- reading -----------------------------------------------------------------------------

    def free_count(self, i: int) -> int:
        return len(self.free[i])

    def total_free(self, pools: Sequence[Pool]) -> int:
        return sum(c * len(p.buckets[c]) for p in pools for c in range(1, p.key.gpus + 1))

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

    def slots_on(self, i: int, count: int) -> list[GpuSlot]:
        """The `count` lowest-numbered free GPUs of machine i (neighbours share links)."""
        machine_id = self.machines[i].id
        return [(machine_id, g) for g in self.free[i][:count]]

    # --- changing ----------------------------------------------------------------------------

    def take(self, slots: Iterable[GpuSlot]) -> None:
        for machine_id, gpu in slots:
            i = self.index[machine_id]
            before = len(self.free[i])
            self.free[i].remove(gpu)
            self._moved(i, before)

    def give(self, slots: Iterable[GpuSlot]) -> None:
        """Return GPUs (a finished or simulated-away job's); unusable ones are ignored."""
        for machine_id, gpu in slots:
            i = self.index.get(machine_id)
            if i is None or gpu in self.machines[i].unhealthy_gpus or gpu in self.free[i]:
                continue
            before = len(self.free[i])
            insort(self.free[i], gpu)
            self._moved(i, before)

    def _moved(self, i: int, before: int) -> None:
        buckets = self.pool_of[i].buckets
        buckets[before].discard(i)
        buckets[len(self.free[i])].add(i)

    def clone(self) -> "Capacity":
        twin = object.__new__(Capacity)
        twin.machines = self.machines
        twin.index = self.index
        twin.free = [list(f) for f in self.free]
        twin.pools = {}
        twin.pool_of = []
        for key, pool in self.pools.items():
            twin.pools[key] = Pool(key, pool.members, [set(b) for b in pool.buckets])
        twin.pool_of = [twin.pools[p.key] for p in self.pool_of]
        twin.has_inference_partition = self.has_inference_partition
        twin.gpus_per_machine = self.gpus_per_machine
        twin._eligible = {}
        return twin
