"""The run report: hand-computed metrics on tiny runs, and the files a simulate run leaves."""

from __future__ import annotations

import csv
import json
import math

import pytest

from scheduler.models import Priority, Quota
from scheduler.sim.records import AllocationRecord, CheckpointWrite, JobRecord, Sample, SimResult
from scheduler.sim.report import (
    comparison_table,
    fmt_share,
    max_in_window,
    percentile,
    summarize,
    write_allocations_csv,
    write_comparison,
    write_jobs_csv,
    write_plot,
    write_run,
)

# --- builder ---------------------------------------------------------------------------------


def alloc(job_id: str, start: float, end: float, *gpus: str, reason: str = "completed", lost: float = 0.0):
    return AllocationRecord(job_id=job_id, start=start, end=end, reason=reason, gpus=tuple(gpus), lost_work=lost)


def job(
    job_id: str,
    submit: float = 0.0,
    first_start: float | None = None,
    finish: float | None = None,
    *,
    priority: str = "normal",
    team: str = "vision",
    state: str | None = None,
    predicted: float | None = None,
    preemption_times: tuple[float, ...] = (),
    num_gpus: int = 1,
    lost: float = 0.0,
    under_guarantee: bool = False,
    reason: str = "",
):
    if state is None:
        state = "completed" if finish is not None else ("running" if first_start is not None else "queued")
    return JobRecord(
        job_id=job_id, team=team, priority=Priority(priority), num_gpus=num_gpus, kind="training",
        submit=submit, first_start=first_start, finish=finish, state=state, reason=reason,
        preemptions=len(preemption_times), preemption_times=preemption_times, lost_work=lost,
        predicted_start=predicted, duration=100.0, expected_duration=120.0,
        under_guarantee_at_submit=under_guarantee,
    )


def sample(t: float, busy: int, healthy: int = 2, queued: int = 0):
    return Sample(time=t, busy_gpus=busy, healthy_gpus=healthy, queued_jobs=queued, queued_gpus=queued)


def run(
    *,
    allocations=(),
    jobs=(),
    samples=(),
    writes=(),
    cycle_ms=(),
    reclaim=(),
    quotas=None,
    total_gpus: int = 2,
    start: float = 0.0,
    end: float = 100.0,
    policy: str = "gpusched",
) -> SimResult:
    return SimResult(
        policy=policy, allocations=list(allocations), jobs=list(jobs), samples=list(samples),
        checkpoint_writes=list(writes), cycle_ms=list(cycle_ms), quotas=dict(quotas or {}),
        total_gpus=total_gpus, reclaim_latencies=list(reclaim), start=start, end=end,
    )


def write(t: float, nbytes: float = 100.0):
    return CheckpointWrite(time=t, job_id="j", bytes=nbytes)


def dig(d, path: str):
    for key in path.split("."):
        d = d[key]
    return d


# --- scenarios -------------------------------------------------------------------------------

# Two GPUs over [0, 100): g0 holds [0, 50) and [60, 100), g1 holds [25, 100) → 165 GPU-s.
TWO_GPU_ALLOCS = (
    alloc("a", 0, 50, "c/b/r/m/0"),
    alloc("b", 25, 100, "c/b/r/m/1"),
    alloc("c", 60, 100, "c/b/r/m/0"),
)
TWO_GPU = run(allocations=TWO_GPU_ALLOCS)
# One GPU is unhealthy over [50, 60): ∫healthy = 50·2 + 10·1 + 40·2 = 190.
TWO_GPU_SICK = run(
    allocations=TWO_GPU_ALLOCS,
    samples=(sample(0, 1), sample(50, 1, healthy=1), sample(60, 2)),
)
# An allocation that started before the window counts only its part inside it.
CLIPPED = run(allocations=(alloc("a", -50, 50, "g0"),), end=100)

# Queue > 0 over [20, 50) (busy 2 of 2) and [70, 100) (busy 1 of 2): (60 + 30) / (60 + 60).
# Whole run from samples: busy 20·1 + 30·2 + 20·1 + 30·1 = 130 of 200.
WAITING = run(samples=(
    sample(0, 1, queued=0), sample(20, 2, queued=1), sample(50, 1, queued=0), sample(70, 1, queued=3),
))
# Several samples at one time: the last one wins.
SAME_TIME = run(samples=(sample(0, 0, queued=5), sample(0, 2, queued=0)))
# Samples start late: before the first one the cluster counts as idle, every GPU healthy.
LATE_SAMPLES = run(samples=(sample(50, 2, queued=1),))

# g0: [0,10) [15,20) [50,60) → gaps 5 and 30; g1: [0,10) [10,40) → gap 0. Queue only in [12, 14).
IDLE = run(
    allocations=(
        alloc("a", 0, 10, "g0"), alloc("b", 15, 20, "g0"), alloc("c", 50, 60, "g0"),
        alloc("d", 0, 10, "g1"), alloc("e", 10, 40, "g1"),
    ),
    samples=(sample(0, 2), sample(12, 1, queued=1), sample(14, 1)),
)
# The same allocations with a queue in [30, 35): the whole 30-s gap [20, 50) counts.
IDLE_LATE_QUEUE = IDLE.model_copy(update={"samples": [sample(0, 2), sample(30, 1, queued=2), sample(35, 1)]})
# A queue that starts exactly when the gap ends does not make it a gap while waiting.
IDLE_QUEUE_AT_END = IDLE.model_copy(update={"samples": [sample(0, 2), sample(50, 1, queued=2), sample(55, 1)]})
# An empty allocation (placed at the instant --until cuts the run) is no gap, and makes none.
IDLE_EMPTY_AT_CUT = IDLE.model_copy(update={"allocations": (*IDLE.allocations, alloc("f", 60, 60, "g1"))})

# Waits: critical 0, 10, 20, 30, 40; high one 100; low one never started, one rejected.
WAITS = run(jobs=(
    *(job(f"c{i}", submit=100, first_start=100 + w, finish=200 + w, priority="critical")
      for i, w in enumerate((0, 10, 20, 30, 40))),
    job("h", submit=0, first_start=100, finish=400, priority="high"),
    job("l1", submit=0, priority="low"),
    job("l2", submit=0, priority="low", state="rejected", reason="over queue cap"),
))

PREEMPTED = run(jobs=(
    job("x", 0, 0, preemption_times=(0, 1800, 3500, 7000)),
    job("y", 0, 0, preemption_times=(100, 200)),
))

# Lost work: preempted 7200 GPU-s, machine failure 3600 + failed 1800; held 4·3600 + 3600 + 3600 + 3600.
LOST = run(
    allocations=(
        alloc("a", 0, 3600, "g0", "g1", "g2", "g3", reason="preempted", lost=7200),
        alloc("b", 0, 3600, "g4", reason="machine_failure", lost=3600),
        alloc("c", 0, 3600, "g5", reason="failed", lost=1800),
        alloc("d", 0, 3600, "g6", reason="completed"),
    ),
    total_gpus=8, end=3600,
)

# ETA: waits 1000 (err 500, rel .5), 2000 (err 800, rel .4), 4000 (err 0); 100 (rel .5, short);
# a job that did not wait and one without a prediction are left out.
ETA = run(jobs=(
    job("a", 0, 1000, predicted=1500),
    job("b", 0, 2000, predicted=1200),
    job("c", 0, 4000, predicted=4000),
    job("d", 0, 100, predicted=150),
    job("e", 0, 0, predicted=50),
    job("f", 0, 5000),
))

# g0 overlaps; g1 only touches; g2 has two allocations inside a long one; g3 a zero-length one.
DOUBLE = run(allocations=(
    alloc("a", 0, 10, "g0", "g1"), alloc("b", 5, 15, "g0"), alloc("c", 10, 20, "g1"),
    alloc("d", 0, 100, "g2"), alloc("e", 10, 20, "g2"), alloc("f", 30, 40, "g2"),
    alloc("g", 0, 10, "g3"), alloc("h", 5, 5, "g3"),
))
NO_DOUBLE = run(allocations=(alloc("a", 0, 10, "g0"), alloc("b", 10, 20, "g0"), alloc("c", 0, 20, "g1")))

# Writes at 0, 30, 90, 250 s: 60-s bins from 0 to 300 hold 200, 100, 0, 0, 100 → peak 200, mean 80.
CHECKPOINTS = run(writes=(write(0), write(30), write(90), write(250)))
ONE_WRITE = run(writes=(write(10, 5e9),))

# vision (guarantee 2) holds 1 GPU for 100 s and 1 for 50 s → 1.5 GPUs on average; nlp has no quota.
TEAMS = run(
    allocations=(alloc("v1", 0, 100, "g0"), alloc("v2", 50, 100, "g1"), alloc("n1", 0, 25, "g2")),
    jobs=(job("v1", team="vision"), job("v2", team="vision"), job("n1", team="nlp")),
    quotas={"vision": Quota(guaranteed=2, max=4), "idle": Quota(guaranteed=8)},
    total_gpus=4,
)

DEFAULT_QUOTA = run(
    allocations=(alloc("a1", 0, 100, "g0"),),
    jobs=(job("a1", team="audio"),),
    quotas={"vision": Quota(guaranteed=2, max=4), "*": Quota(guaranteed=1, max=3)},
    total_gpus=4,
)

JCT = run(jobs=(
    job("a", 0, 10, 100, priority="high"),
    job("b", 0, 50, 300, priority="high"),
    job("c", 0, 0, 200, priority="low"),
    job("d", 0, 0, None, priority="low"),
))

MISC = run(cycle_ms=(1.0, 2.0, 3.0, 4.0, 5.0), reclaim=(10.0, 20.0, 30.0))

EMPTY = run(end=0.0)


METRIC_CASES = [
    (TWO_GPU, "utilisation", 165 / 200),
    (TWO_GPU_SICK, "utilisation", 165 / 190),
    (TWO_GPU_SICK, "gpu_hours_held", 165 / 3600),
    (CLIPPED, "utilisation", 50 / 200),
    (TWO_GPU, "utilisation_while_waiting", None),
    (WAITING, "utilisation_while_waiting", 90 / 120),
    (WAITING, "utilisation_from_samples", 130 / 200),
    (WAITING, "time_with_queue_s", 60.0),
    (SAME_TIME, "utilisation_from_samples", 1.0),
    (SAME_TIME, "utilisation_while_waiting", None),
    (LATE_SAMPLES, "utilisation_from_samples", 100 / 200),
    (LATE_SAMPLES, "utilisation_while_waiting", 1.0),
    (IDLE, "idle_gap_s.count", 3),
    (IDLE, "idle_gap_s.p50", 5.0),
    (IDLE, "idle_gap_s.p90", 25.0),
    (IDLE, "idle_gap_while_waiting_s.count", 1),
    (IDLE, "idle_gap_while_waiting_s.p50", 5.0),
    (IDLE_LATE_QUEUE, "idle_gap_while_waiting_s.p50", 30.0),
    (IDLE_QUEUE_AT_END, "idle_gap_while_waiting_s.count", 0),
    (IDLE_EMPTY_AT_CUT, "idle_gap_s.count", 3),
    (WAITS, "wait_s.critical.count", 5),
    (WAITS, "wait_s.critical.p50", 20.0),
    (WAITS, "wait_s.critical.p95", 38.0),
    (WAITS, "wait_s.critical.p99", 39.6),
    (WAITS, "wait_s.critical.mean", 20.0),
    (WAITS, "wait_s.high.p99", 100.0),
    (WAITS, "wait_s.normal.count", 0),
    (WAITS, "wait_s.normal.p50", None),
    (WAITS, "wait_s.low.never_started", 1),
    (WAITS, "wait_s.low.rejected", 1),
    (WAITS, "wait_s.all.count", 6),
    (WAITS, "wait_s.all.p50", 25.0),
    (WAITS, "wait_s.all.never_started", 1),
    (WAITS, "jobs.completed", 6),
    (WAITS, "jobs.queued", 1),
    (WAITS, "jobs.rejected", 1),
    (WAITS, "jobs.total", 8),
    (JCT, "jct_s.all.count", 3),
    (JCT, "jct_s.all.mean", 200.0),
    (JCT, "jct_s.high.mean", 200.0),
    (JCT, "jct_s.high.p95", 290.0),
    (JCT, "jct_s.low.count", 1),
    (JCT, "jct_s.critical.mean", None),
    (PREEMPTED, "preemptions", 6),
    (PREEMPTED, "max_preemptions_per_job_in_any_hour", 3),
    (LOST, "work_lost_gpu_hours.preemption", 2.0),
    (LOST, "work_lost_gpu_hours.machine_failure", 1.5),
    (LOST, "work_lost_gpu_hours.total", 3.5),
    (LOST, "work_lost_fraction", 3.5 / 7),
    (LOST, "preempted_allocations", 1),
    (ETA, "eta_error.count", 3),
    (ETA, "eta_error.median_abs_error_s", 500.0),
    (ETA, "eta_error.median_relative_error", 0.4),
    (ETA, "eta_error.count_all_waited", 4),
    (ETA, "eta_error.median_relative_error_all_waited", 0.45),
    (DOUBLE, "double_booked_gpus", 2),
    (DOUBLE, "double_booked_intervals", 3),
    (NO_DOUBLE, "double_booked_gpus", 0),
    (NO_DOUBLE, "double_booked_intervals", 0),
    (CHECKPOINTS, "checkpoint_write.writes", 4),
    (CHECKPOINTS, "checkpoint_write.bytes_total", 400.0),
    (CHECKPOINTS, "checkpoint_write.peak_to_mean", 2.5),
    (ONE_WRITE, "checkpoint_write.peak_to_mean", 1.0),
    (MISC, "checkpoint_write.peak_to_mean", None),
    (TEAMS, "team_share.vision.mean_gpus", 1.5),
    (TEAMS, "team_share.vision.share_of_guarantee", 0.75),
    (TEAMS, "team_share.nlp.guaranteed", 0),
    (TEAMS, "team_share.nlp.share_of_guarantee", None),
    (TEAMS, "team_share.idle.mean_gpus", 0.0),
    (TEAMS, "team_share.idle.share_of_guarantee", 0.0),
    (DEFAULT_QUOTA, "team_share.audio.guaranteed", 1),
    (DEFAULT_QUOTA, "team_share.audio.max", 3),
    (DEFAULT_QUOTA, "team_share.audio.share_of_guarantee", 1.0),
    (MISC, "cycle_ms.count", 5),
    (MISC, "cycle_ms.p50", 3.0),
    (MISC, "cycle_ms.p99", 4.96),
    (MISC, "cycle_ms.max", 5.0),
    (MISC, "reclaim_latency_s.p50", 20.0),
    (MISC, "reclaim_latency_s.p95", 29.0),
    (MISC, "reclaim_latency_s.max", 30.0),
    (EMPTY, "utilisation", None),
    (EMPTY, "reclaim_latency_s.p95", None),
]

METRIC_IDS = [
    "two busy GPUs with no samples are measured against total GPUs times the span",
    "a GPU that is unhealthy for ten seconds leaves the denominator",
    "GPU-hours held sum every allocation's GPUs times its length",
    "an allocation started before the run counts only its part inside the run",
    "utilisation while waiting is null without samples",
    "utilisation while waiting counts only the time the queue is non-empty",
    "utilisation from samples integrates the busy step function",
    "the time with a queue is the length of the queue-non-empty intervals",
    "of two samples at one time the last one wins",
    "a queue that vanished within the same instant never counts as waiting",
    "before the first sample the cluster counts as healthy and idle",
    "after the first sample its queue makes the rest of the run waiting",
    "every gap between consecutive allocations of a GPU is counted, touching ones as zero",
    "the median idle gap is the middle of 0, 5 and 30 seconds",
    "the p90 idle gap interpolates between 5 and 30 seconds",
    "only the gap that overlaps the queue counts as idle while waiting",
    "the idle gap while waiting is that five-second gap",
    "a queue inside a long gap makes the whole gap count",
    "a queue that starts exactly as the gap ends does not count",
    "an empty allocation where --until cuts the run is no gap and makes none",
    "five critical jobs started",
    "the median critical wait is 20 seconds",
    "the p95 critical wait interpolates to 38 seconds",
    "the p99 critical wait interpolates to 39.6 seconds",
    "the mean critical wait is 20 seconds",
    "a single high job's wait is every percentile",
    "a class without jobs has no waits",
    "a class without jobs has null percentiles",
    "a queued low job that never started is counted",
    "a rejected low job is counted apart from never started",
    "all classes together count six started jobs",
    "the median wait of all jobs is between 20 and 30 seconds",
    "never started over all classes leaves the rejected job out",
    "jobs are counted by state: completed",
    "jobs are counted by state: queued",
    "jobs are counted by state: rejected",
    "jobs are counted in total",
    "JCT counts only completed jobs",
    "the mean JCT is finish minus submit averaged",
    "the mean JCT of the high class",
    "the p95 JCT of the high class interpolates",
    "a low job still running has no JCT",
    "a class with no completed job has a null JCT",
    "preemptions sum over all jobs",
    "three of the preemptions at 0, 1800, 3500 and 7000 fall in one hour",
    "lost work of preempted allocations is split out in GPU-hours",
    "machine failures and failed allocations count as machine failure",
    "total lost work is the sum over all allocations",
    "the lost fraction is lost over held GPU-hours",
    "preempted allocations are counted from the allocations",
    "ETA error counts only jobs that waited over ten minutes with a prediction",
    "the median absolute ETA error of the long waits",
    "the median relative ETA error of the long waits",
    "all jobs that waited at all with a prediction are counted in the second ETA median",
    "the median relative ETA error over every job that waited",
    "overlapping allocations and a GPU nested in a long one are double-booked",
    "every allocation starting while its GPU is held counts as a double-booked interval",
    "allocations that only touch are not double-booked",
    "touching allocations add no double-booked interval",
    "every checkpoint write is counted",
    "checkpoint bytes are summed",
    "the peak 60-second bin holds two and a half times the mean bin",
    "a single write is its own mean",
    "no writes have no peak-to-mean",
    "a team's mean GPUs is its GPU-seconds over the span",
    "the share of guarantee is mean GPUs over the guarantee",
    "a team without a quota has no guarantee",
    "a team without a guarantee has no share",
    "a team with a quota but no jobs holds nothing",
    "a team with a guarantee but no jobs has a zero share",
    "a team the fleet does not name has the default quota's guarantee",
    "a team the fleet does not name has the default quota's maximum",
    "a team the fleet does not name is measured against the default guarantee",
    "every cycle is counted",
    "the median cycle time",
    "the p99 cycle time interpolates",
    "the slowest cycle",
    "the median reclaim latency",
    "the p95 reclaim latency interpolates",
    "the slowest reclaim",
    "an empty run has no utilisation",
    "an empty run has no reclaim latency",
]


@pytest.mark.parametrize(("result", "path", "expected"), METRIC_CASES, ids=METRIC_IDS)
def test_summary_metric(result, path, expected):
    got = dig(summarize(result), path)
    if expected is None or isinstance(expected, int):
        assert got == expected
    else:
        assert got == pytest.approx(expected)


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        ([], 50, None),
        ([7.0], 99, 7.0),
        ([1, 2, 3, 4], 50, 2.5),
        ([4, 1, 3, 2], 100, 4.0),
        ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 90, 9.1),
    ],
    ids=[
        "no values have no percentile",
        "one value is every percentile",
        "the median of an even count interpolates",
        "the top percentile is the maximum of unsorted input",
        "the p90 of one to ten interpolates linearly",
    ],
)
def test_percentile(values, q, expected):
    assert percentile(values, q) == (None if expected is None else pytest.approx(expected))


@pytest.mark.parametrize(
    "share, text",
    [
        (None, "—"),
        (0.0, "0.0%"),
        (4.4626e-05, "0.0045%"),
        (0.0018, "0.18%"),
        (0.0099, "0.99%"),
        (0.5, "50.0%"),
        (3e-9, "< 0.0001%"),
    ],
    ids=[
        "a share not measured is a dash",
        "nothing lost reads as zero",
        "a share of a few thousandths of a percent keeps two significant figures",
        "a share under one percent keeps two significant figures",
        "a share just under one percent is not rounded up to it",
        "a share of one percent or more has one decimal",
        "a share too small to print says so instead of reading as zero",
    ],
)
def test_a_small_share_is_not_rounded_to_nothing(share, text):
    assert fmt_share(share) == text


@pytest.mark.parametrize(
    ("times", "expected"),
    [
        ((0, 1800, 3500, 7000), 3),
        ((0, 3600), 2),
        ((0, 3600.5), 1),
        ((7000, 0, 3500, 1800), 3),
        ((), 0),
    ],
    ids=[
        "three preemptions within an hour out of four",
        "a window of exactly an hour includes both ends",
        "just over an hour apart are in different windows",
        "unsorted times are sorted first",
        "no preemptions count zero",
    ],
)
def test_preemptions_in_any_hour(times, expected):
    assert max_in_window(times) == expected


@pytest.mark.parametrize(
    "result",
    [EMPTY, TWO_GPU_SICK, WAITS, ETA, TEAMS, CHECKPOINTS],
    ids=[
        "an empty run",
        "a run with an unhealthy GPU",
        "a run with never-started jobs",
        "a run with ETA errors",
        "a run with team quotas",
        "a run with checkpoint writes",
    ],
)
def test_summary_is_strict_json(result):
    text = json.dumps(summarize(result), allow_nan=False)
    assert json.loads(text)["policy"] == "gpusched"


# --- files -----------------------------------------------------------------------------------

FILE_RUN = run(
    allocations=(
        alloc("a", 0.0, 1.23456, "c1/b0/r0/m0/0", "c1/b0/r0/m0/1", reason="preempted", lost=3600),
        alloc("a", 5.0, 50.0, "c1/b0/r0/m0/0", "c1/b0/r0/m0/1"),
    ),
    jobs=(
        job("a", 0.0, 0.0, 50.0, num_gpus=2, predicted=0.5, preemption_times=(1.23456,), lost=3600),
        job("b, with a comma", 1.0, priority="low", reason="waiting for 16 GPUs"),
    ),
    samples=(sample(0, 2, queued=1), sample(1.3, 0, queued=1), sample(5, 2, queued=0)),
    writes=(write(30.0),),
    cycle_ms=(0.5,),
)


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.reader(f))


@pytest.mark.parametrize(
    ("writer", "header"),
    [
        (write_allocations_csv, "job_id,start,end,reason,gpus"),
        (
            write_jobs_csv,
            "job_id,team,priority,num_gpus,kind,submit,first_start,finish,state,preemptions,"
            "lost_work_gpu_hours,predicted_start,wait,expected_duration,duration,reason",
        ),
    ],
    ids=["allocations.csv has the contract's header", "jobs.csv has the documented header"],
)
def test_csv_header(tmp_path, writer, header):
    path = tmp_path / "out.csv"
    writer(FILE_RUN, path)
    assert path.read_text().splitlines()[0] == header


def test_allocations_csv_rows(tmp_path):
    path = tmp_path / "allocations.csv"
    write_allocations_csv(FILE_RUN, path)
    rows = read_csv(path)[1:]
    assert rows == [
        ["a", "0", "1.235", "preempted", "c1/b0/r0/m0/0 c1/b0/r0/m0/1"],
        ["a", "5", "50", "completed", "c1/b0/r0/m0/0 c1/b0/r0/m0/1"],
    ]


def test_jobs_csv_rows(tmp_path):
    path = tmp_path / "jobs.csv"
    write_jobs_csv(FILE_RUN, path)
    header, *rows = read_csv(path)
    by_id = {r[0]: dict(zip(header, r)) for r in rows}
    a, b = by_id["a"], by_id["b, with a comma"]
    assert (a["num_gpus"], a["state"], a["preemptions"], a["lost_work_gpu_hours"]) == ("2", "completed", "1", "1")
    assert (a["predicted_start"], a["wait"], a["finish"]) == ("0.5", "0", "50")
    assert (b["first_start"], b["finish"], b["predicted_start"], b["wait"]) == ("", "", "", "")
    assert (b["priority"], b["state"], b["reason"]) == ("low", "queued", "waiting for 16 GPUs")


def test_write_run_leaves_four_files(tmp_path):
    out = tmp_path / "nested" / "run"
    summary = write_run(FILE_RUN, out)
    assert sorted(p.name for p in out.iterdir()) == ["allocations.csv", "jobs.csv", "run.png", "summary.json"]
    assert json.loads((out / "summary.json").read_text()) == summary
    png = (out / "run.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 1000


@pytest.mark.parametrize(
    "result",
    [EMPTY, run(jobs=(job("q", 0.0),))],
    ids=["a run without samples still plots", "a run where no job started still plots"],
)
def test_plot_degenerate(tmp_path, result):
    path = tmp_path / "run.png"
    write_plot(result, path)
    assert path.read_bytes().startswith(b"\x89PNG")


def test_plot_of_ten_thousand_samples_is_a_png(tmp_path):
    samples = [sample(t * 30.0, (t * 7) % 3, healthy=2, queued=t % 5) for t in range(10_000)]
    jobs = [job(f"j{i}", 0.0, float(i * 13 % 5000), priority=("critical", "high", "normal", "low")[i % 4])
            for i in range(2000)]
    big = run(samples=samples, jobs=jobs, end=300_000.0)
    write_plot(big, tmp_path / "run.png")
    assert (tmp_path / "run.png").read_bytes().startswith(b"\x89PNG")


# --- comparison ------------------------------------------------------------------------------

SUMMARIES = {
    "gpusched": summarize(LOST.model_copy(update={"policy": "gpusched"})),
    "fifo": summarize(WAITS.model_copy(update={"policy": "fifo"})),
    "drf|v2": summarize(EMPTY),
}


@pytest.mark.parametrize(
    "needle",
    ["| gpusched |", "| fifo |", "drf\\|v2", "Utilisation while jobs wait", "Wait p95, critical",
     "Double-booked GPUs", "Cycle p99", "Checkpoint write peak/mean"],
    ids=[
        "the first policy has a column",
        "the second policy has a column",
        "a policy name with a pipe is escaped",
        "the utilisation while waiting row is there",
        "the critical wait row is there",
        "the double-booking row is there",
        "the cycle time row is there",
        "the checkpoint burst row is there",
    ],
)
def test_comparison_table_contains(needle):
    assert needle in comparison_table(SUMMARIES)


def test_comparison_table_shape():
    lines = comparison_table(SUMMARIES).strip().splitlines()
    assert all(line.startswith("|") and line.endswith("|") for line in lines)
    assert len(lines) == 2 + 16
    assert "50.0%" in lines[[i for i, l in enumerate(lines) if l.startswith("| Work lost")][0]]


def test_write_comparison(tmp_path):
    table = write_comparison(SUMMARIES, tmp_path)
    assert (tmp_path / "comparison.md").read_text() == table
    values = json.loads((tmp_path / "comparison.json").read_text())
    assert set(values) == set(SUMMARIES)
    assert values["gpusched"]["work_lost_fraction"] == pytest.approx(0.5)
    assert values["fifo"]["wait_p95_critical"] == pytest.approx(38.0)
    assert math.isfinite(values["fifo"]["wait_p50_all"])
