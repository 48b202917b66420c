"""Workloads for the simulator: a synthetic generator, a Philly converter, and a fleet to fit them.

Everything here is pure and deterministic: randomness comes only from ``random.Random`` seeded by
the caller, and text goes in and out without touching files.

The synthetic mix (``generate_trace``), chosen to look like a shared training fleet of the design's
scale (one cluster of ~5,000 GPUs) rather than like any one published trace:

- Teams: vision 25%, language 30%, speech 10%, video 15%, research 12%, platform 8% of jobs.
- Priority: critical 3%, high 15%, normal 52%, low 30%.
- GPUs per job: 1 → 34%, 2 → 14%, 4 → 17%, 8 → 23%, 16 → 7%, 32 → 4%, 64 → 1%; so a third of
  jobs use one GPU and 12% span machines (more than 8 GPUs), while most GPU-hours go to big jobs.
- Arrivals: a Poisson process over ``days`` whose rate swings ±50% over the day (peak 14:00,
  trough 02:00, with the trace starting at midnight). Given the job count, such arrival times are
  independent draws from the rate's shape, which is how they are sampled.
- Durations: log-normal (σ = 1.4) clamped to [10 min, 3 days]; the scale is then found by
  bisection so that the total work is ``load × gpus × days × 86400`` GPU-seconds. One scale for
  every training job keeps the shape; the clamp is applied inside the search, so it cannot push
  the total off target.
- Checkpoints: 85% of training jobs longer than an hour checkpoint every 1,800 s or 3,600 s (half
  each); shorter jobs and the other 15% never do, so preempting them loses all their work.
- Estimates: ``expected_duration = duration × e^N(0, 0.35)``: about a third of estimates are off
  by more than 40%, both ways.
- Deadlines: 10% of jobs carry a hint of ``submit + expected × U(2, 4)``.
- Inference (``inference_fraction`` of jobs): 1/2/4/8 GPUs (40/30/20/10%), priority high, no
  checkpoints, durations log-normal around 30 min clamped to [10 min, 4 h], not rescaled.
"""

from __future__ import annotations

import bisect
import csv
import io
import itertools
import json
import math
import random
import re
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime

import yaml

from scheduler.errors import InputError
from scheduler.fleet import MAX_GPUS_PER_FLEET
from scheduler.models import JobKind, JobSpec, Priority, Topology
from scheduler.sim.trace import DECIMAL, MOST_TRACE_JOBS, TraceJob

DAY = 86400.0
HOUR = 3600.0

DEFAULT_TEAMS = {
    "vision": 0.25,
    "language": 0.30,
    "speech": 0.10,
    "video": 0.15,
    "research": 0.12,
    "platform": 0.08,
}
PRIORITY_MIX = {Priority.critical: 0.03, Priority.high: 0.15, Priority.normal: 0.52, Priority.low: 0.30}
GPU_COUNT_MIX = {1: 0.34, 2: 0.14, 4: 0.17, 8: 0.23, 16: 0.07, 32: 0.04, 64: 0.01}
INFERENCE_GPU_COUNT_MIX = {1: 0.40, 2: 0.30, 4: 0.20, 8: 0.10}

MIN_DURATION = 600.0
MAX_DURATION = 3 * DAY
DURATION_SIGMA = 1.4
DURATION_MEDIAN_BEFORE_SCALING = 2 * HOUR
INFERENCE_MEDIAN = 1800.0
INFERENCE_SIGMA = 0.8
INFERENCE_MAX_DURATION = 4 * HOUR

DIURNAL_SWING = 0.5  # the arrival rate goes from 0.5× to 1.5× its mean over a day
DIURNAL_PEAK_HOUR = 14.0

CHECKPOINTING_SHARE = 0.85
CHECKPOINT_INTERVALS = (1800.0, 3600.0)
ESTIMATE_SIGMA = 0.35
DEADLINE_SHARE = 0.10
DEADLINE_SLACK = (2.0, 4.0)

PHILLY_BUSIEST_WEEK = "2017-10-16 00:00:00"
PHILLY_TIMESTAMP = re.compile(r"\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}")
PHILLY_CHECKPOINT_INTERVAL = 1800.0


# --- The synthetic generator ------------------------------------------------------------------


def generate_trace(
    *,
    jobs: int = 3000,
    days: float = 3.0,
    gpus: int = 5120,
    load: float = 1.2,
    seed: int = 1,
    teams: dict[str, float] | None = None,
    inference_fraction: float = 0.0,
) -> list[TraceJob]:
    """A synthetic trace whose work is ``load`` times what ``gpus`` GPUs can do in ``days``.

    The mix is the module docstring's. The same arguments always give the same trace.
    """
    teams = dict(DEFAULT_TEAMS if teams is None else teams)
    _check_generator_arguments(jobs, days, gpus, load, teams, inference_fraction)
    rng = random.Random(seed)
    span = days * DAY

    # 1. When jobs arrive, and which of them are inference.
    arrivals = _diurnal_arrivals(rng, jobs, span)
    inference = set(rng.sample(range(jobs), round(inference_fraction * jobs)))

    # 2. Everything else about each job, drawn before the durations are scaled so that the scale
    #    never changes what any other draw produced.
    drafts = [_draft_job(rng, i in inference, teams) for i in range(jobs)]

    # 3. Scale training durations so the offered work hits the target.
    target = load * gpus * span
    inference_work = sum(d.work for d in drafts if d.kind is JobKind.inference)
    training = [d for d in drafts if d.kind is JobKind.training]
    scaled = _scale_to_work(
        [d.duration for d in training], [d.num_gpus for d in training], target - inference_work
    )
    for draft, duration in zip(training, scaled, strict=True):
        draft.duration = duration

    # 4. The user-visible fields that depend on the final duration.
    return [
        _finish_job(f"gen-{i + 1:06d}", round(t), d)
        for i, (t, d) in enumerate(zip(arrivals, drafts, strict=True))
    ]


MAX_GENERATED_JOBS = MOST_TRACE_JOBS  # what a trace may hold: simulate reads no more
MAX_GENERATED_DAYS = 3660  # ten years
MAX_GENERATED_GPUS = 10_000_000
# Offered load: a sized fleet (from-philly) or a generated trace beyond these is no workload to study.
MIN_LOAD, MAX_LOAD = 0.01, 100.0


def _check_generator_arguments(jobs, days, gpus, load, teams, inference_fraction) -> None:
    def bad(field: str, message: str) -> InputError:
        return InputError("trace generate", None, field, message)

    if not 1 <= jobs <= MAX_GENERATED_JOBS:
        raise bad("jobs", f"must be between 1 and {MAX_GENERATED_JOBS:,}, got {jobs}")
    if not 0 < days <= MAX_GENERATED_DAYS:
        raise bad("days", f"must be above 0 and at most {MAX_GENERATED_DAYS}, got {days}")
    if not 1 <= gpus <= MAX_GENERATED_GPUS:
        raise bad("gpus", f"must be between 1 and {MAX_GENERATED_GPUS:,}, got {gpus}")
    if not 0 < load <= MAX_LOAD:
        raise bad("load", f"must be above 0 and at most {MAX_LOAD:g}, got {load}")
    if not 0 <= inference_fraction < 1:  # at 1 no training job is left to carry the load
        raise bad("inference_fraction", f"must be 0 or more and below 1, got {inference_fraction}")
    if not teams or any(not w > 0 for w in teams.values()):
        raise bad("teams", "must name at least one team, each with a weight above 0")


def _diurnal_arrivals(rng: random.Random, count: int, span: float) -> list[float]:
    """``count`` arrival times in [0, span), sorted, with density following the daily rate."""
    peak = 1 + DIURNAL_SWING
    times = []
    while len(times) < count:
        t = rng.uniform(0, span)
        hour = (t / HOUR) % 24
        rate = 1 + DIURNAL_SWING * math.sin(2 * math.pi * (hour - DIURNAL_PEAK_HOUR + 6) / 24)
        if rng.uniform(0, peak) < rate:  # thinning: keep a time in proportion to the rate then
            times.append(t)
    return sorted(times)


@dataclass
class _Draft:
    """One job's draws before its duration is scaled; ``duration`` is the only field that changes."""

    team: str
    kind: JobKind
    priority: Priority
    num_gpus: int
    duration: float
    estimate_error: float  # expected_duration / duration
    checkpoints: bool  # if it runs long enough to bother
    interval: float
    has_deadline: bool
    slack: float  # deadline = submit + expected × slack

    @property
    def work(self) -> float:
        return self.duration * self.num_gpus


def _draft_job(rng: random.Random, is_inference: bool, teams: dict[str, float]) -> _Draft:
    team = _pick(rng, teams)
    if is_inference:
        kind, priority = JobKind.inference, Priority.high
        num_gpus = _pick(rng, INFERENCE_GPU_COUNT_MIX)
        raw = rng.lognormvariate(math.log(INFERENCE_MEDIAN), INFERENCE_SIGMA)
        duration = float(round(_clamp(raw, MIN_DURATION, INFERENCE_MAX_DURATION)))
    else:
        kind, priority = JobKind.training, _pick(rng, PRIORITY_MIX)
        num_gpus = _pick(rng, GPU_COUNT_MIX)
        duration = rng.lognormvariate(math.log(DURATION_MEDIAN_BEFORE_SCALING), DURATION_SIGMA)
    return _Draft(
        team=team,
        kind=kind,
        priority=priority,
        num_gpus=num_gpus,
        duration=duration,
        estimate_error=rng.lognormvariate(0.0, ESTIMATE_SIGMA),
        checkpoints=rng.random() < CHECKPOINTING_SHARE,
        interval=rng.choice(CHECKPOINT_INTERVALS),
        has_deadline=rng.random() < DEADLINE_SHARE,
        slack=rng.uniform(*DEADLINE_SLACK),
    )


def _scale_to_work(durations: list[float], gpus: list[int], target: float) -> list[float]:
    """Durations × one factor, clamped to [MIN_DURATION, MAX_DURATION] and rounded to seconds,
    whose GPU-seconds total ``target``.

    The total is monotone in the factor, so bisection on its logarithm finds it; the clamp is part
    of the function being solved, which is what keeps the result on target when the clamp bites.
    """

    if not durations:
        raise InputError(
            "trace generate",
            None,
            "inference_fraction",
            "leaves no training jobs to carry the offered load; lower it",
        )

    def work(factor: float) -> float:
        return sum(
            _clamp(d * factor, MIN_DURATION, MAX_DURATION) * g
            for d, g in zip(durations, gpus, strict=True)
        )

    low, high = MIN_DURATION / max(durations), MAX_DURATION / min(durations)
    if not work(low) <= target <= work(high):
        fewest, most = work(low), work(high)
        raise InputError(
            "trace generate",
            None,
            "load",
            f"cannot be reached: with these jobs the work must lie between {fewest:.3g} and {most:.3g} "
            f"GPU-seconds (each job runs 10 min to 3 days) but the target is {target:.3g}; "
            "change --jobs, --gpus, --days or --load",
        )
    for _ in range(100):
        middle = math.sqrt(low * high)
        if work(middle) < target:
            low = middle
        else:
            high = middle
        if high / low < 1 + 1e-9:
            break
    return [round(_clamp(d * high, MIN_DURATION, MAX_DURATION)) for d in durations]


def _finish_job(job_id: str, submit: float, draft: _Draft) -> TraceJob:
    duration = float(draft.duration)
    expected = max(1.0, round(duration * draft.estimate_error))
    checkpoints = draft.kind is JobKind.training and duration > HOUR and draft.checkpoints
    spec = JobSpec(
        job_id=job_id,
        team=draft.team,
        num_gpus=draft.num_gpus,
        priority=draft.priority,
        kind=draft.kind,
        checkpoint_interval=draft.interval if checkpoints else None,
        expected_duration=expected,
        deadline=round(submit + expected * draft.slack) if draft.has_deadline else None,
    )
    return TraceJob(spec=spec, submit_time=submit, duration=duration)


def _pick(rng: random.Random, weights: dict):
    return rng.choices(list(weights), weights=list(weights.values()))[0]


def _clamp(value: float, low: float, high: float) -> float:
    return min(high, max(low, value))


# --- The Philly converter ---------------------------------------------------------------------


MAX_PHILLY_GPUS = 100_000  # more than any one job of any cluster asks
MAX_PHILLY_CLUSTER_CHARS = 100  # Philly's are six hex digits; with `vc-`, within a live team name's 128


def from_philly(
    text: str,
    source: str,
    *,
    start: str | None = None,
    days: float = 7.0,
    seed: int = 1,
    max_duration: float = MAX_DURATION,
) -> list[TraceJob]:
    """Convert the Microsoft Philly trace CSV (``timestamp,duration,num_gpus,gpu_time,cluster``).

    Rules, so a converted trace can be reproduced and explained:

    - Window: rows submitted in ``[start, start + days)``; ``start`` defaults to 2017-10-16
      00:00:00, the busiest week. ``submit_time`` is seconds since ``start``.
    - Skipped: rows with ``duration ≤ 0`` or ``num_gpus < 1`` (nothing ran).
    - ``team`` is ``"vc-" + cluster`` (Philly's virtual cluster); ``job_id`` is ``philly-N`` where
      N is the row's line in the source file (header = line 1), so ``sed -n Np`` finds it.
    - ``duration`` is the recorded run time clamped to [1 s, ``max_duration``].
    - Per row, ``Random(f"philly/{seed}/{N}")`` draws, in order: the priority (critical 3%,
      high 15%, normal 52%, low 30%) and the estimate error ``e^N(0, 0.35)`` with
      ``expected_duration = duration × error``. A row's draws depend only on the seed and its line,
      so changing the window never changes a job.
    - Jobs longer than an hour checkpoint every 1,800 s; shorter ones never. Topology is left to
      the core, kind is training, and there are no deadlines.

    Every row is checked, inside the window or not; a malformed one raises ``InputError``.
    """
    window_start = _philly_start(start or PHILLY_BUSIEST_WEEK, source)
    if not days > 0:
        raise InputError(source, None, "days", f"must be above 0, got {days}")
    window = days * DAY
    reader = csv.reader(io.StringIO(text.lstrip("\ufeff"), newline=""))
    try:
        return _read_philly(reader, source, window_start, window, seed, max_duration)
    except csv.Error as e:  # a lone carriage return in a cell, a cell over the csv module's limit
        raise InputError(source, max(1, reader.line_num), None, f"is not valid CSV ({e})") from None


def _read_philly(reader, source: str, window_start, window: float, seed: int, max_duration) -> list[TraceJob]:
    header = [cell.strip().lower() for cell in next(reader, [])]
    missing = [c for c in ("timestamp", "duration", "num_gpus", "cluster") if c not in header]
    if missing:
        raise InputError(
            source,
            1,
            ",".join(missing),
            "is missing from the header; a Philly trace has timestamp,duration,num_gpus,gpu_time,cluster",
        )
    twice = sorted({name for name in header if name and header.count(name) > 1})
    if twice:
        raise InputError(source, 1, ",".join(twice), "appears twice in the header; keep one column of each name")
    column = {name: header.index(name) for name in ("timestamp", "duration", "num_gpus", "cluster")}

    jobs = []
    ended = reader.line_num
    for row in reader:
        began, ended = ended + 1, reader.line_num
        if not row or all(not cell.strip() for cell in row):
            continue
        line = reader.line_num
        if began != ended or any("\n" in cell or "\r" in cell for cell in row):
            raise InputError(source, began, None, f"a quoted value runs on to line {ended}; a Philly row is one line")
        if len(row) != len(header):  # a shifted row would be read from the wrong columns
            raise InputError(
                source, line, None, f"has {len(row)} fields but the header has {len(header)}"
            )
        cells = {name: row[i].strip() for name, i in column.items()}
        submitted = _philly_timestamp(cells["timestamp"], source, line)
        duration = _philly_number(cells["duration"], "duration", source, line)
        num_gpus = _philly_number(cells["num_gpus"], "num_gpus", source, line)
        if not num_gpus.is_integer() or num_gpus > MAX_PHILLY_GPUS:
            raise InputError(
                source, line, "num_gpus",
                f"must be a whole number of GPUs, at most {MAX_PHILLY_GPUS:,}, got {cells['num_gpus']!r}"
            )
        if not cells["cluster"]:
            raise InputError(
                source, line, "cluster", "is empty; every Philly row names its virtual cluster"
            )
        if not cells["cluster"].isprintable():  # it becomes a team name, shown in tables and logs
            raise InputError(
                source, line, "cluster",
                f"holds a control character ({cells['cluster']!r}); a virtual cluster is a plain name like 6214e9"
            )
        if len(cells["cluster"]) > MAX_PHILLY_CLUSTER_CHARS:  # a team name, and a key of the fleet file made
            raise InputError(
                source, line, "cluster",
                f"is {len(cells['cluster']):,} characters long; a virtual cluster is a short name like 6214e9 "
                f"(at most {MAX_PHILLY_CLUSTER_CHARS})"
            )
        offset = (submitted - window_start).total_seconds()
        if duration <= 0 or num_gpus < 1 or not 0 <= offset < window:
            continue
        jobs.append(
            _philly_job(line, offset, duration, int(num_gpus), cells["cluster"], seed, max_duration)
        )
    jobs.sort(key=lambda j: (j.submit_time, j.spec.job_id))
    return jobs


def _philly_job(
    line: int,
    submit: float,
    duration: float,
    num_gpus: int,
    cluster: str,
    seed: int,
    max_duration: float,
) -> TraceJob:
    rng = random.Random(f"philly/{seed}/{line}")
    priority = _pick_by_threshold(rng.random(), PRIORITY_MIX)
    duration = _clamp(duration, 1.0, max_duration)
    expected = max(1.0, round(duration * rng.lognormvariate(0.0, ESTIMATE_SIGMA)))
    spec = JobSpec(
        job_id=f"philly-{line}",
        team=f"vc-{cluster}",
        num_gpus=num_gpus,
        priority=priority,
        checkpoint_interval=PHILLY_CHECKPOINT_INTERVAL if duration > HOUR else None,
        expected_duration=expected,
    )
    return TraceJob(spec=spec, submit_time=submit, duration=duration)


def _pick_by_threshold(u: float, weights: dict):
    """The entry whose cumulative weight first exceeds ``u``; one uniform draw per choice."""
    cumulative = list(itertools.accumulate(weights.values()))
    index = min(bisect.bisect_right(cumulative, u * cumulative[-1]), len(cumulative) - 1)
    return list(weights)[index]


def _philly_start(start: str, source: str) -> datetime:
    if not PHILLY_TIMESTAMP.fullmatch(start.strip()):
        raise InputError(source, None, "start", f"must look like 'YYYY-mm-dd HH:MM:SS', got {start!r}")
    try:
        return datetime.fromisoformat(start.strip())
    except ValueError:
        raise InputError(source, None, "start", f"is not a real date and time, got {start!r}") from None


def _philly_timestamp(value: str, source: str, line: int) -> datetime:
    if PHILLY_TIMESTAMP.fullmatch(value):
        try:
            return datetime.fromisoformat(value)
        except ValueError:
            pass
    raise InputError(
        source, line, "timestamp", f"must be a date and time 'YYYY-mm-dd HH:MM:SS', got {value!r}"
    )


def _philly_number(value: str, column: str, source: str, line: int) -> float:
    # Plain decimals, as in a trace: float() also reads `1_0` and digits of other scripts.
    number = float(value) if DECIMAL.fullmatch(value) else math.nan
    if not math.isfinite(number):
        raise InputError(source, line, column, f"must be a number, got {value!r}")
    return number


# --- Sizing a fleet for a trace ---------------------------------------------------------------


def offered_gpu_seconds(jobs: list[TraceJob]) -> float:
    """The work a trace brings: GPU-seconds of true duration."""
    return sum(j.duration * j.spec.num_gpus for j in jobs)


def trace_span(jobs: list[TraceJob]) -> float:
    """The window work arrives in: the last submit time rounded up to a whole hour (at least one)."""
    last = max((j.submit_time for j in jobs), default=0.0)
    return max(HOUR, math.ceil(last / HOUR) * HOUR)


def offered_load(jobs: list[TraceJob], gpus: int, span: float | None = None) -> float:
    """Work offered per GPU-second of capacity over the span: above 1, the queue must grow."""
    return offered_gpu_seconds(jobs) / (gpus * (span or trace_span(jobs)))


def fleet_for(
    jobs: list[TraceJob],
    *,
    load: float,
    gpus_per_machine: int = 8,
    machines_per_rack: int = 16,
    racks_per_block: int = 8,
    gpu_type: str = "H100",
    cluster: str = "c1",
    span: float | None = None,
    guarantee_share: float = 0.9,
    queue_cap: int = 2000,
    comment: str | None = None,
) -> str:
    """Fleet YAML sized so the trace offers about ``load`` on it, with a quota for every team.

    - Training capacity is whole racks of ``machines_per_rack`` machines, the rack count rounded
      to the nearest that gives ``load`` (never fewer than the largest job needs), laid out in
      blocks ``b0, b1, …`` of up to ``racks_per_block`` racks (more, where a job kept to one block
      needs more).
    - Inference jobs, if any, get a block ``inf`` with ``partition: inference`` sized the same
      way but in whole machines, in racks of at most ``machines_per_rack`` alike (so a few more
      machines where the count does not divide evenly).
    - Each team's guarantee is its share of the trace's GPU-seconds × ``guarantee_share`` of the
      fleet, rounded down, so guarantees sum to at most that share; every team may use the whole
      fleet (``max``) and queue ``queue_cap`` jobs. A ``"*"`` entry covers teams not in the trace.
    - ``span`` defaults to ``trace_span(jobs)``; the header comment states the resulting load.
    """
    if not jobs:
        raise ValueError("fleet_for needs at least one job")
    if not MIN_LOAD <= load <= MAX_LOAD:
        raise ValueError(f"load must be between {MIN_LOAD:g} and {MAX_LOAD:g}, got {load}")
    span = span or trace_span(jobs)
    rack_gpus = machines_per_rack * gpus_per_machine

    def sized(kind: JobKind, unit_gpus: int) -> int:
        of_kind = [j for j in jobs if j.spec.kind is kind]
        if not of_kind:
            return 0
        wanted = offered_gpu_seconds(of_kind) / (load * span * unit_gpus)
        fits_largest = math.ceil(max(j.spec.num_gpus for j in of_kind) / unit_gpus)
        rounded = math.ceil(wanted) if kind is JobKind.inference else round(wanted)
        return max(1, rounded, fits_largest)

    training_racks = sized(JobKind.training, rack_gpus)
    # A training job kept to one block (its default beyond one machine) must fit one block.
    in_one_block = max((j.spec.num_gpus for j in jobs if j.spec.kind is JobKind.training
                        and j.spec.topology in (None, Topology.block)), default=0)
    racks_per_block = max(racks_per_block, math.ceil(in_one_block / rack_gpus))
    inference_machines = sized(JobKind.inference, gpus_per_machine)
    # A block's racks are alike: more machines than a rack holds go in racks of equal size, and
    # the count is what they hold (a few more, never a whole rack more), which the load and
    # quotas below are worked out on.
    inference_racks = math.ceil(inference_machines / machines_per_rack)
    inference_per_rack = math.ceil(inference_machines / inference_racks) if inference_machines else 0
    inference_machines = inference_racks * inference_per_rack
    total_gpus = training_racks * rack_gpus + inference_machines * gpus_per_machine
    if total_gpus > MAX_GPUS_PER_FLEET:  # before its racks are laid out: a long job in a short window asks billions
        raise InputError("generated fleet", None, None, f"would have {total_gpus:,} GPUs; a fleet file holds at most "
                                                        f"{MAX_GPUS_PER_FLEET:,}")

    blocks = []
    for b, first in enumerate(range(0, training_racks, racks_per_block)):
        racks = min(racks_per_block, training_racks - first)
        blocks.append((f"b{b}", racks, machines_per_rack, None))
    if inference_machines:
        blocks.append(("inf", inference_racks, inference_per_rack, "inference"))

    work_by_team: dict[str, float] = defaultdict(float)
    for job in jobs:
        work_by_team[job.spec.team] += job.duration * job.spec.num_gpus
    total_work = sum(work_by_team.values())
    actual_load = total_work / (total_gpus * span)

    lines = [f"# {line}" for line in (comment or "").splitlines()]
    lines += [
        f"# Sized by fleet_for: {len(jobs)} jobs, {total_work:,.0f} GPU-seconds over {span / DAY:.2f} days",
        f"# = offered load {actual_load:.3f} on {total_gpus} GPUs (asked for {load}).",
        "clusters:",
        f"  - name: {_yaml_name(cluster)}",
        "    blocks:",
    ]
    for name, racks, per_rack, partition in blocks:
        lines += [
            f"      - name: {name}",
            f"        racks: {racks}",
            f"        machines_per_rack: {per_rack}",
            f"        gpus_per_machine: {gpus_per_machine}",
            f"        gpu_type: {_yaml_name(gpu_type)}",
        ]
        if partition:
            lines.append(f"        partition: {partition}")
    lines.append("quotas:")
    for team, work in sorted(work_by_team.items(), key=lambda kv: (-kv[1], kv[0])):
        guaranteed = math.floor(guarantee_share * total_gpus * work / total_work)
        lines.append(
            f"  {_yaml_name(team)}: {{guaranteed: {guaranteed}, max: {total_gpus}, queue_cap: {queue_cap}}}"
        )
    lines.append(f'  "*": {{guaranteed: 0, max: {total_gpus}, queue_cap: {queue_cap}}}')
    return "\n".join(lines) + "\n"


def _yaml_name(name: str) -> str:
    """The name as a YAML scalar: bare when YAML reads it back as the same string, else quoted."""
    if re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", name) and yaml.safe_load(name) == name:
        return name
    # A JSON string is a valid double-quoted YAML scalar; not ASCII-escaped, as YAML reads a
    # character past U+FFFF escaped as JSON does (a surrogate pair) as two lone surrogates.
    return json.dumps(name, ensure_ascii=False)
