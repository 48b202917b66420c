"""Gang placement: all of a job's GPUs at once, or none, with as little spread as possible.

Algorithm overview
  1. Resolve the topology: `machine` if the job fits one machine, else `block` (unless given).
  2. machine: best fit — the machine with the *fewest* free GPUs that still holds the job, so
     partly used machines fill up first and whole machines stay whole for big jobs (the
     bin-packing bias). Small jobs may not break the last whole machines of the reserved pool.
  3. block: inside one block, prefer one rack; take the machines with the most free GPUs first
     (fewest machines), and best-fit the last piece so no whole machine is broken needlessly.
     Among blocks, fewest racks, then fewest machines, then the tightest fit.
  4. any: a machine if one fits, else a block, else the whole cluster greedily.
Machines in `avoid` (reserved for a starving job) are skipped; the caller decides who may
backfill onto them.
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

from scheduler import in_words
from scheduler.capacity import NO_RESERVE, Capacity, KeepWhole, Pool
from scheduler.models import GpuSlot, JobSpec, Topology

NO_AVOID: frozenset[int] = frozenset()


def resolved_topology(cap: Capacity, spec: JobSpec) -> Topology:
    return cap.fit_terms(spec)[2]


def find_gpus(
    cap: Capacity,
    spec: JobSpec,
    *,
    avoid: frozenset[int] = NO_AVOID,
    keep_whole: KeepWhole = NO_RESERVE,
) -> tuple[GpuSlot, ...] | None:
    """The GPUs this job should get now, or None if it cannot start. Does not take them."""
    picks = find_picks(cap, spec, avoid=avoid, keep_whole=keep_whole)
    if picks is None:
        return None
    return tuple(slot for i, count in picks for slot in cap.slots_on(i, count))


def find_picks(
    cap: Capacity,
    spec: JobSpec,
    *,
    avoid: frozenset[int] = NO_AVOID,
    keep_whole: KeepWhole = NO_RESERVE,
) -> list[tuple[int, int]] | None:
    """Where the job should go, as (machine, GPU count) picks, or None if it cannot start."""
    return picks_for(cap, cap.fit_terms(spec), spec.num_gpus, avoid, keep_whole)


def picks_for(
    cap: Capacity,
    terms: tuple[list[Pool], int, Topology],
    n: int,
    avoid: frozenset[int] = NO_AVOID,
    keep_whole: KeepWhole = NO_RESERVE,
) -> list[tuple[int, int]] | None:
    """`find_picks` for a job of n GPUs whose fit terms (`Capacity.fit_terms`) are known: the
    estimate keeps them per shape of job and asks thousands of times a cycle."""
    pools, largest, topology = terms
    if not pools:
        return None
    if n <= largest:  # one machine satisfies every topology
        i = best_machine(cap, pools, n, avoid, keep_whole)
        if i is not None:
            return [(i, n)]
        if topology == Topology.machine:
            return None
        if keep_whole:
            avoid = avoid | _reserved_whole(pools, n, keep_whole)
    elif topology == Topology.machine:
        return None
    usable = _usable(cap, pools, avoid)
    free = cap.free
    if sum(len(free[i]) for i in usable) < n:
        return None  # too few free GPUs outside `avoid` for any block, or the cluster
    picks = best_block(cap, usable, n)
    if picks is None and topology == Topology.any:
        picks = greedy_fill(cap, usable, n)
    return picks


def best_machine(
    cap: Capacity, pools: Sequence[Pool], n: int, avoid: frozenset[int], keep_whole: KeepWhole
) -> int | None:
    """`keep_whole`: how many whole machines of each pool small jobs must leave whole."""
    best: tuple[int, int] | None = None
    for pool in pools:
        size = pool.key.gpus
        reserve = keep_whole.get(pool.key, 0) if keep_whole else 0
        for count in range(n, size + 1):
            bucket = pool.buckets[count]
            if not bucket:
                continue
            if count == size and n < size and pool.whole_machines <= reserve:
                continue  # the reserved pool of whole machines waits for a big job
            candidates = bucket - avoid if avoid else bucket
            if candidates:
                found = (count, min(candidates))
                if best is None or found < best:
                    best = found
                break
    return None if best is None else best[1]


def _reserved_whole(pools: Sequence[Pool], n: int, keep_whole: KeepWhole) -> frozenset[int]:
    """Whole machines a small job may not break into, pool by pool."""
    kept: set[int] = set()
    for pool in pools:
        if n < pool.key.gpus and pool.whole_machines <= keep_whole.get(pool.key, 0):
            kept |= pool.buckets[pool.key.gpus]
    return frozenset(kept)


def _usable(cap: Capacity, pools: Sequence[Pool], avoid: frozenset[int]) -> list[int]:
    """Machines with a free GPU (the buckets skip the full ones quickly), in no set order."""
    return [i for p in pools for bucket in p.buckets[1:] for i in bucket if i not in avoid]


def best_block(cap: Capacity, usable: Iterable[int], n: int) -> list[tuple[int, int]] | None:
    """(machine, GPU count) picks inside the one block that hosts n GPUs with least spread, of
    the `usable` machines (those with a free GPU that the job may use)."""
    free, block_of, rack_of = cap.free, cap.block_of, cap.layout.rack_of
    # One pass: per block its free GPUs and, per rack, its free GPUs and (-free, machine) pairs,
    # the order greedy filling takes them in once sorted.
    blocks: dict[str, list] = {}  # block -> [free GPUs, {rack: [free GPUs, pairs]}]
    for i in usable:
        size = len(free[i])
        block = blocks.get(block_of[i])
        if block is None:
            block = blocks[block_of[i]] = [0, {}]
        block[0] += size
        rack = block[1].get(rack_of[i])
        if rack is None:
            block[1][rack_of[i]] = [size, [(-size, i)]]
        else:
            rack[0] += size
            rack[1].append((-size, i))
    best: tuple[tuple, list[tuple[int, int]]] | None = None
    for block_free, racks in blocks.values():
        if block_free < n:
            continue
        # A rack with too few free GPUs cannot host the job alone: no need to try it.
        options = [(1, _fill_keeping_whole(cap, sorted(pairs), n)) for rack_free, pairs in racks.values()
                   if rack_free >= n]
        if not options:
            picks = _fill_keeping_whole(cap, sorted(pair for _, pairs in racks.values() for pair in pairs), n)
            options = [(len({rack_of[i] for i, _ in picks}), picks)]
        for spread, picks in options:
            score = (spread, len(picks), block_free - n, picks[0][0])
            if best is None or score < best[0]:
                best = (score, picks)
    return None if best is None else best[1]


def greedy_fill(cap: Capacity, machines: Iterable[int], n: int) -> list[tuple[int, int]] | None:
    """Fewest machines: the freest first, then best-fit the remainder onto the tightest one."""
    free = cap.free
    ordered = sorted([(-len(free[i]), i) for i in machines])  # freest first, then machine order
    if -sum(size for size, _ in ordered) < n:
        return None
    return _fill_keeping_whole(cap, ordered, n)


def _fill_keeping_whole(cap: Capacity, ordered: list[tuple[int, int]], n: int) -> list[tuple[int, int]]:
    """`_fill`, taking as few whole machines as the same number of machines and racks allows:
    freest first took a whole machine where partly used ones add up to the job just as well (free
    8, 6, 6, 4 and 16 asked: 8 + 6 + 2, where 6 + 6 + 4 leaves the 8 for a job that needs a
    machine)."""
    picks = _fill(ordered, n)
    pool_of, free = cap.pool_of, cap.free
    whole_taken = sum(1 for i, _ in picks if len(free[i]) == pool_of[i].key.gpus)
    if not whole_taken:
        return picks
    whole = [pair for pair in ordered if len(free[pair[1]]) == pool_of[pair[1]].key.gpus]
    partly_used = [pair for pair in ordered if len(free[pair[1]]) < pool_of[pair[1]].key.gpus]
    # Room with the first `keep` whole machines allowed, and so the fewest that can hold the job.
    room = [-sum(size for size, _ in partly_used)]
    for size, _ in whole[:whole_taken]:
        room.append(room[-1] - size)
    # More whole machines allowed never needs more machines: the fewest that keep the count is
    # found by halving (a fill each), not by a fill for every count (20-45 times slower for a
    # gang of a thousand GPUs on a fragmented fleet).
    lo, hi, best = 0, whole_taken, None
    while lo < hi:
        keep = (lo + hi) // 2
        fewer = _fill(sorted(partly_used + whole[:keep]), n) if room[keep] >= n else None
        if fewer is not None and len(fewer) == len(picks):
            best, hi = fewer, keep
        else:
            lo = keep + 1
    if best is None:
        return picks
    rack_of = cap.layout.rack_of
    if len({rack_of[i] for i, _ in best}) > len({rack_of[i] for i, _ in picks}):
        return picks  # spread over more racks: the network costs more than the whole machine saves
    return best


def _fill(ordered: list[tuple[int, int]], n: int) -> list[tuple[int, int]]:
    """`greedy_fill` over (-free GPUs, machine) pairs already sorted, holding n GPUs in all."""
    picks: list[tuple[int, int]] = []
    remaining = n
    for pos, (size, i) in enumerate(ordered):
        if -size >= remaining:
            _, tight = min((-size, j) for size, j in ordered[pos:] if -size >= remaining)
            picks.append((tight, remaining))
            return picks
        picks.append((i, -size))
        remaining += size
    raise ValueError("fewer free GPUs than asked for")  # callers check the total first


def explain_no_fit(cap: Capacity, spec: JobSpec) -> str:
    """Why the job cannot start on the free GPUs, in words a user can act on."""
    pools = cap.eligible_pools(spec)
    n = spec.num_gpus
    if not pools:
        if cap.largest_machine(spec):
            return f"every machine that matches {_wants(spec)} is unreachable"
        return f"no machine in this cluster matches {_wants(spec)}"
    topology = resolved_topology(cap, spec)
    if topology == Topology.machine:
        largest = max(p.largest_free() for p in pools)
        size = max(p.key.gpus for p in pools)
        if n > size:
            if cap.largest_machine(spec) >= n:
                return (f"needs {in_words.gpus(n)} on one machine; the machines with {n} or more GPUs are unreachable, "
                        f"those that answer have {size}")
            return f"needs {in_words.gpus(n)} on one machine; machines here have {size}"
        return f"needs {in_words.gpus(n)} on one machine; the largest free is {largest}{_out_of_service(cap, pools)}"
    if topology == Topology.block:
        by_block: dict[str, int] = {}
        for i in _usable(cap, pools, NO_AVOID):
            block = cap.machines[i].block
            by_block[block] = by_block.get(block, 0) + len(cap.free[i])
        best = max(by_block.values(), default=0)
        return f"needs {in_words.gpus(n)} in one block; the most free in a block is {best}{_out_of_service(cap, pools)}"
    return f"needs {in_words.gpus(n)}; {cap.total_free(pools)} are free{_out_of_service(cap, pools)}"


def _out_of_service(cap: Capacity, pools) -> str:
    """The machines the job may use that answer but take no work (an operator cordoned or drains
    them, or their agent owes an answer): an operator reading the reason knows where GPUs went."""
    counts = cap.layout.out_of_service
    out = sum(counts.get(pool.key, 0) for pool in pools)
    if not out:
        return ""
    if out == 1:
        return "; 1 machine it may use takes no work now (cordoned, drained, or its agent owes an answer)"
    return f"; {out} machines it may use take no work now (cordoned, drained, or their agents owe an answer)"


def _wants(spec: JobSpec) -> str:
    parts = [f"{spec.kind.value} jobs"]
    if spec.gpu_type:
        parts.append(f"GPU type {spec.gpu_type}")
    if spec.gpu_memory_gb:
        parts.append(f"{spec.gpu_memory_gb:g} GB of GPU memory")
    return ", ".join(parts)
