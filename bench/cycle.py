#!/usr/bin/env python3
"""Benchmark: how long one scheduling cycle takes on a full seed-scale cluster.

    python bench/cycle.py [--cycles N] [--seed S] [--step SECONDS] [--no-estimate] [--no-forecast]
                          [--default-gc | --held-gc] [--profile]

The snapshot is the design's seed-scale cluster at its worst: 640 machines × 8 H100 GPUs in 5
blocks (examples/fleet-seed.yaml), every GPU held by one of ~600 running jobs, and 2,000 jobs
queued. Nothing fits on free GPUs, so each queued job goes down the expensive paths of the cycle:
placement fails, critical/high jobs and teams under their guarantee search for victims, big jobs
that have starved take reservations, and every waiting job gets a reason and an estimated start,
allowing for a day of expected arrivals (the forecast the live loop makes from the last day's
~1,000 submissions, scheduler/forecast.py).

Each timed cycle runs on the same cluster with ``now`` a few seconds later than the last one, so
no call sees the same snapshot twice. Three warm-up calls come first. Each cycle runs as the live
planner runs it (activities/store.py, `Store.plan_cycle`): with the garbage collector off for
the cycle, and what the cycle owes it collected after the clock stops, as the live store
collects it after its commit (scheduler/gc_policy.py); `--default-gc` leaves it at Python's
defaults, `--held-gc` only raises its thresholds, as the simulator does (and the live planner did before commit 973e126). This is a
benchmark, not a test: it prints a short summary and, as its last line, one JSON object with the timings.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import math
import platform
import pstats
import random
import sys
import time
from collections import Counter
from contextlib import nullcontext
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from scheduler.cycle import run_cycle
from scheduler.gc_policy import few_collections, no_collections
from scheduler.fleet import parse_fleet
from scheduler.models import (
    Earmark,
    ExpectedArrival,
    JobSpec,
    Machine,
    Priority,
    QueuedJob,
    RunningJob,
    Snapshot,
    Topology,
)
from scheduler.sim.report import percentile

FLEET = ROOT / "examples" / "fleet-seed.yaml"
NOW = 1_700_000_000.0  # an epoch second, as the live system would use
DAY = 86400.0
HOUR = 3600.0
WARMUP = 3

TEAMS = ("vision", "language", "speech", "video", "research", "platform")
# Who holds the running cluster: skewed on purpose, so vision and research borrow well past their
# guarantees while speech and platform sit under theirs and have reclaim rights.
RUNNING_TEAMS = {"vision": 0.30, "language": 0.27, "speech": 0.05, "video": 0.12, "research": 0.21, "platform": 0.05}
QUEUED_TEAMS = {"vision": 0.25, "language": 0.30, "speech": 0.10, "video": 0.15, "research": 0.12, "platform": 0.08}
RUNNING_PRIORITIES = {Priority.critical: 0.03, Priority.high: 0.15, Priority.normal: 0.52, Priority.low: 0.30}
# A snapshot's queue holds fewer critical jobs than arrive: most of them start at once.
QUEUED_PRIORITIES = {Priority.critical: 0.02, Priority.high: 0.10, Priority.normal: 0.53, Priority.low: 0.35}
QUEUED_SIZES = {1: 0.34, 2: 0.14, 4: 0.17, 8: 0.23, 16: 0.07, 32: 0.04, 64: 0.01}
# Running jobs are laid out a rack at a time: a draw is a gang of whole machines (8, 16 or 32 GPUs)
# or one machine shared by small jobs (1, 2 and 4 GPUs).
RUNNING_UNITS = {32: 0.15, 16: 0.18, 8: 0.52, "small": 0.165}
SMALL_SIZES = {1: 0.45, 2: 0.30, 4: 0.25}
CHECKPOINT_INTERVALS = (1800.0, 3600.0)
DRAINING = 4  # running jobs already preempted, with earmarks for the jobs they make room for
QUEUED = 2000  # including the jobs the draining ones make room for
STARVING_BIG = 8  # 32/64-GPU queued jobs that have waited hours
ARRIVALS_PER_DAY = 1000  # the seed trace's rate: 3,000 jobs in 3 days


def pick(rng: random.Random, weights: dict):
    return rng.choices(list(weights), weights=list(weights.values()))[0]


def expected_duration(rng: random.Random) -> float:
    return float(round(min(3 * DAY, max(600.0, rng.lognormvariate(math.log(6 * HOUR), 1.2)))))


def load_fleet() -> tuple[list[Machine], dict]:
    fleet = parse_fleet(FLEET.read_text(), str(FLEET.relative_to(ROOT)))
    cluster = fleet.clusters[0]
    return list(cluster.machines), fleet.every_quota


def last_checkpoint(started: float, interval: float, phase: float, now: float) -> float | None:
    """The latest t ≤ now with t ≡ phase (mod interval) after the start, if any."""
    t = now - ((now - phase) % interval)
    return t if t > started else None


def running_jobs(rng: random.Random, machines: list[Machine], now: float) -> list[RunningJob]:
    """Every GPU of every machine held by exactly one job, gangs kept inside one rack."""
    racks: dict[tuple[str, str], list[Machine]] = {}
    for m in machines:
        racks.setdefault((m.block, m.rack), []).append(m)
    layouts: list[tuple[int, list[tuple[str, int]]]] = []
    for rack in racks.values():
        i = 0
        while i < len(rack):
            unit = pick(rng, RUNNING_UNITS)
            if unit != "small":
                k = unit // rack[i].gpus
                while k > len(rack) - i:
                    k //= 2
                layouts.append((k * rack[i].gpus, [(m.id, g) for m in rack[i:i + k] for g in range(m.gpus)]))
                i += k
                continue
            free = rack[i].gpus
            while free:
                n = pick(rng, {s: w for s, w in SMALL_SIZES.items() if s <= free})
                first = rack[i].gpus - free
                layouts.append((n, [(rack[i].id, g) for g in range(first, first + n)]))
                free -= n
            i += 1

    jobs = []
    for j, (n, gpus) in enumerate(layouts):
        team = pick(rng, RUNNING_TEAMS)
        priority = pick(rng, RUNNING_PRIORITIES)
        expected = expected_duration(rng)
        checkpoints = rng.random() < 0.8 and expected > HOUR
        interval = rng.choice(CHECKPOINT_INTERVALS) if checkpoints else None
        resumed = rng.random() < 0.15
        progress = round(rng.uniform(0.1, 0.6) * expected) if resumed and checkpoints else 0.0
        # Elapsed time: a few just started (inside the minimum runtime), a few past their estimate.
        r = rng.random()
        if r < 0.05:
            elapsed = rng.uniform(30, 600)
        elif r < 0.12:
            elapsed = (expected - progress) * rng.uniform(1.0, 1.5) + 60
        else:
            elapsed = max(60.0, (expected - progress) * rng.uniform(0.02, 0.98))
        started = round(now - elapsed)
        submit = round(started - rng.uniform(0, 6 * HOUR))
        preemptions: tuple[float, ...] = ()
        if resumed:
            count = rng.choice((1, 1, 1, 2, 3))
            recent = rng.random() < 0.3  # some still inside the thrash window
            earliest = min(started, max(submit, started - 3000) if recent else submit)
            preemptions = tuple(sorted(round(rng.uniform(earliest, started)) for _ in range(count)))
        phase = None
        last = None
        if interval:
            phase = float(rng.randrange(0, int(interval), 60)) if rng.random() < 0.6 else None
            last = last_checkpoint(started, interval, phase if phase is not None else started, now)
        spec = JobSpec(
            job_id=f"run-{j + 1:04d}",
            team=team,
            num_gpus=n,
            topology=None if n <= 8 or rng.random() < 0.8 else Topology.block,
            priority=priority,
            checkpoint_interval=interval,
            expected_duration=expected,
        )
        jobs.append(RunningJob(
            spec=spec, submit_time=submit, gpus=tuple(gpus), started_at=started,
            progress_at_start=progress, last_checkpoint_at=last, preemptions=preemptions,
            checkpoint_phase=phase,
        ))
    return jobs


def queued_jobs(rng: random.Random, now: float) -> list[QueuedJob]:
    jobs = []
    for j in range(QUEUED - DRAINING):
        n = pick(rng, QUEUED_SIZES)
        priority = pick(rng, QUEUED_PRIORITIES)
        submit = round(now - rng.uniform(0, DAY))
        if j < STARVING_BIG:  # big jobs well past the starvation threshold: reservations happen
            n = rng.choice((32, 32, 64))
            priority = rng.choice((Priority.normal, Priority.high))
            submit = round(now - rng.uniform(2 * HOUR, 10 * HOUR))
        expected = expected_duration(rng)
        checkpoints = rng.random() < 0.8 and expected > HOUR
        interval = rng.choice(CHECKPOINT_INTERVALS) if checkpoints else None
        r = rng.random()
        if r < 0.65:
            topology = None
        elif r < 0.80:
            topology = Topology.machine if n <= 8 else Topology.block
        elif r < 0.90:
            topology = Topology.block
        else:
            topology = Topology.any
        queued_since, progress, preemptions = submit, 0.0, ()
        if rng.random() < 0.10 and now - submit > 1200:  # requeued after a preemption
            queued_since = round(rng.uniform(submit + 600, now))
            progress = round(rng.uniform(0.0, 0.5) * expected) if checkpoints else 0.0
            preemptions = (queued_since,)
        spec = JobSpec(
            job_id=f"q-{j + 1:05d}",
            team=pick(rng, QUEUED_TEAMS),
            num_gpus=n,
            gpu_type="H100" if rng.random() < 0.2 else None,
            gpu_memory_gb=80.0 if rng.random() < 0.1 else None,
            topology=topology,
            priority=priority,
            deadline=round(submit + expected * rng.uniform(1.5, 4.0)) if rng.random() < 0.10 else None,
            checkpoint_interval=interval,
            expected_duration=expected,
        )
        jobs.append(QueuedJob(spec=spec, submit_time=submit, queued_since=queued_since,
                              progress=progress, preemptions=preemptions))
    return jobs


def drain_some(rng: random.Random, running: list[RunningJob], queue: list[QueuedJob], now: float,
               expires: float) -> tuple[list[RunningJob], list[QueuedJob], list[Earmark]]:
    """A previous cycle preempted a few low jobs for high ones: they drain, their GPUs are earmarked."""
    earmarks = []
    victims = [i for i, r in enumerate(running) if r.spec.priority is Priority.low and r.spec.num_gpus == 8]
    for k, i in enumerate(rng.sample(victims, min(DRAINING, len(victims)))):
        victim = running[i]
        claimant = QueuedJob(
            spec=JobSpec(job_id=f"claim-{k + 1}", team=rng.choice(TEAMS), num_gpus=8,
                         priority=Priority.high, checkpoint_interval=1800.0,
                         expected_duration=expected_duration(rng)),
            submit_time=now - 60, queued_since=now - 60,
        )
        running[i] = victim.model_copy(update={
            "draining_until": now + 60, "preempted_for": claimant.spec.job_id,
            "preemptions": victim.preemptions + (now - 60,),
        })
        queue.append(claimant)
        earmarks.append(Earmark(job_id=claimant.spec.job_id, gpus=victim.gpus, expires=expires))
    return running, queue, earmarks


def expected_arrivals(rng: random.Random, now: float) -> list[ExpectedArrival]:
    """The forecast: yesterday's submissions, expected again over the next day."""
    return sorted((ExpectedArrival(at=round(now + rng.uniform(0, DAY)), priority=pick(rng, RUNNING_PRIORITIES),
                                   num_gpus=pick(rng, QUEUED_SIZES), expected_duration=expected_duration(rng))
                   for _ in range(ARRIVALS_PER_DAY)), key=lambda a: a.at)


def build_snapshot(seed: int, span: float, estimate: bool = True, forecast: bool = True) -> Snapshot:
    rng = random.Random(seed)
    machines, quotas = load_fleet()
    running = running_jobs(rng, machines, NOW)
    queue = queued_jobs(rng, NOW)
    running, queue, earmarks = drain_some(rng, running, queue, NOW, expires=NOW + span + 300)
    held = [slot for job in running for slot in job.gpus]
    assert len(held) == len(set(held)) == sum(m.gpus for m in machines), "the cluster is not exactly full"
    # Their own generator, so that the rest of the snapshot is the one earlier builds measured.
    arrivals = expected_arrivals(random.Random(seed + 1), NOW) if forecast else []
    # The live loop estimates start times every cycle; --no-estimate shows the cost without them.
    return Snapshot(cluster=machines[0].cluster, now=NOW, machines=tuple(machines), running=tuple(running),
                    queue=tuple(queue), quotas=quotas, earmarks=tuple(earmarks), estimate=estimate,
                    expected_arrivals=tuple(arrivals))


def describe(snapshot: Snapshot) -> str:
    held = Counter()
    for job in snapshot.running:
        held[job.spec.team] += job.spec.num_gpus
    sizes = Counter(j.spec.num_gpus for j in snapshot.running)
    qsizes = Counter(j.spec.num_gpus for j in snapshot.queue)
    qprio = Counter(j.spec.priority.value for j in snapshot.queue)
    starving = sum(1 for j in snapshot.queue if snapshot.now - j.queued_since >= snapshot.config.starvation_threshold)
    teams = ", ".join(
        f"{t} {held[t]}/{snapshot.quotas[t].guaranteed if t in snapshot.quotas else 0}" for t in TEAMS
    )
    return "\n".join([
        (f"cluster: {len(snapshot.machines)} machines, {sum(m.gpus for m in snapshot.machines)} GPUs, "
         f"{len(snapshot.running)} running jobs holding every GPU, {len(snapshot.queue)} queued"),
        f"  running sizes: {dict(sorted(sizes.items()))}",
        f"  held/guaranteed: {teams}",
        (f"  queued sizes: {dict(sorted(qsizes.items()))}; classes: {dict(sorted(qprio.items()))}; "
         f"past the starvation threshold: {starving}"),
        f"  expected arrivals (the forecast): {len(snapshot.expected_arrivals)}",
    ])


class CollectorTimes:
    """The collector's runs (a `gc.callbacks` observer), split by whether a cycle was being timed."""

    def __init__(self) -> None:
        self.timing = False
        self.inside_ms: list[float] = []
        self.outside: list[tuple[int, float]] = []  # (generation, ms)
        self._began = 0.0

    def observe(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
            return
        ms = (time.perf_counter() - self._began) * 1000.0
        if self.timing:
            self.inside_ms.append(ms)
        else:
            self.outside.append((info["generation"], ms))


def span_of(values: list[int]) -> str:
    lo, hi = min(values), max(values)
    return f"{lo}" if lo == hi else f"{lo}–{hi} (mean {sum(values) / len(values):.1f})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=50, help="timed cycles (default 50)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the synthetic cluster (default 1)")
    parser.add_argument("--step", type=float, default=3.0, help="seconds `now` advances per cycle (default 3)")
    parser.add_argument("--no-estimate", action="store_true",
                        help="skip step 7 (estimated starts), as the simulator does on cycles without arrivals")
    parser.add_argument("--no-forecast", action="store_true",
                        help="no expected arrivals: estimates from the walk alone")
    parser.add_argument("--default-gc", action="store_true",
                        help="leave the garbage collector at Python's defaults instead of switching it off "
                             "for each cycle, as the live planner does (scheduler/gc_policy.py)")
    parser.add_argument("--held-gc", action="store_true",
                        help="only raise the collector's thresholds for each cycle (gc_policy.few_collections), "
                             "as the simulator does")
    parser.add_argument("--profile", action="store_true",
                        help="run the timed cycles under cProfile and print the top 25 cumulative entries")
    args = parser.parse_args(argv)
    if args.cycles < 1:
        parser.error("--cycles must be at least 1")
    if args.default_gc and args.held_gc:
        parser.error("--default-gc and --held-gc are two different settings: give one")
    if args.no_estimate and "estimate" not in Snapshot.model_fields:
        parser.error("--no-estimate: this version of Snapshot has no `estimate` field")

    total = WARMUP + args.cycles
    began = time.perf_counter()
    base = build_snapshot(args.seed, span=total * args.step, estimate=not args.no_estimate,
                          forecast=not args.no_forecast)
    build_s = time.perf_counter() - began
    print(describe(base))
    snapshots = [base.model_copy(update={"now": NOW + k * args.step}) for k in range(total)]

    for snap in snapshots[:WARMUP]:
        run_cycle(snap)

    profiler = cProfile.Profile() if args.profile else None
    times_ms: list[float] = []
    # What the collector takes outside the timed cycles: with the collector off for a cycle, the
    # collection its allocations owe runs as soon as it is back on, after the decisions, as in
    # the live store after its commit (Store.plan_cycle). Timed apart: a full collection walks
    # the whole heap of the process (its imports, the snapshots here), every ~50 cycles.
    collections = CollectorTimes()
    gc.callbacks.append(collections.observe)
    collector_setting = nullcontext if args.default_gc else few_collections if args.held_gc else no_collections
    # Only counts are kept, as the live loop keeps nothing of a cycle once it is committed:
    # holding 50 results (100,000 objects) alive would time the allocator, not the cycle.
    placements, preemptions, pending, reservations, estimated = [], [], [], [], []
    for snap in snapshots[WARMUP:]:
        if profiler is not None:
            profiler.enable()
        with collector_setting():
            collections.timing, t0 = True, time.perf_counter()
            result = run_cycle(snap)
            elapsed, collections.timing = time.perf_counter() - t0, False
        if profiler is not None:
            profiler.disable()
        times_ms.append(elapsed * 1000.0)
        placements.append(len(result.placements))
        preemptions.append(len(result.preemptions))
        pending.append(len(result.pending))
        reservations.append(len(result.reservations))
        estimated.append(sum(1 for p in result.pending if p.estimated_start is not None))
        del result

    print(f"per cycle: placements {span_of(placements)}, preemptions {span_of(preemptions)}, "
          f"pending {span_of(pending)} ({span_of(estimated)} with an estimated start), "
          f"reservations {span_of(reservations)}")
    p50, p99 = percentile(times_ms, 50), percentile(times_ms, 99)
    print(f"cycle time over {len(times_ms)} cycles: p50 {p50:.1f} ms, p99 {p99:.1f} ms, "
          f"max {max(times_ms):.1f} ms" + (" (under cProfile: inflated)" if profiler else ""))
    gc.callbacks.remove(collections.observe)
    full = [ms for generation, ms in collections.outside if generation == 2]
    young = [ms for generation, ms in collections.outside if generation < 2]
    print(f"the collector inside the timed cycles: {len(collections.inside_ms)} runs, "
          f"{sum(collections.inside_ms):.1f} ms in all; after them (off the decisions' path): "
          f"{len(young)} young-generation runs (p50 {percentile(young, 50) if young else 0:.1f} ms), "
          f"{len(full)} of the whole heap (max {max(full, default=0):.1f} ms)")

    if profiler is not None:
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(25)
        print(out.getvalue().rstrip())

    print(json.dumps({
        "p50_ms": round(p50, 3),
        "p99_ms": round(p99, 3),
        "max_ms": round(max(times_ms), 3),
        "mean_ms": round(sum(times_ms) / len(times_ms), 3),
        "min_ms": round(min(times_ms), 3),
        "cycles": len(times_ms),
        "warmup": WARMUP,
        "seed": args.seed,
        "step_s": args.step,
        "machines": len(base.machines),
        "gpus": sum(m.gpus for m in base.machines),
        "running": len(base.running),
        "queued": len(base.queue),
        "expected_arrivals": len(base.expected_arrivals),
        "placements_per_cycle": round(sum(placements) / len(placements), 2),
        "preemptions_per_cycle": round(sum(preemptions) / len(preemptions), 2),
        "pending_per_cycle": round(sum(pending) / len(pending), 2),
        "reservations_per_cycle": round(sum(reservations) / len(reservations), 2),
        "estimate": not args.no_estimate,
        "default_gc": args.default_gc,
        "held_gc": args.held_gc,
        "profiled": bool(profiler),
        "collector_inside_ms": round(sum(collections.inside_ms), 3),
        "collector_after_young_runs": len(young),
        "collector_after_full_runs": len(full),
        "collector_after_full_max_ms": round(max(full, default=0.0), 3),
        "build_s": round(build_s, 3),
        "python": platform.python_version(),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
