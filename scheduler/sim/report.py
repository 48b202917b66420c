"""Turn a simulation run (a ``SimResult``) into metrics and files.

Two layers, kept apart on purpose:

* pure metric functions (``summarize`` and the ``_``-prefixed helpers it calls, plus ``percentile``
  and ``comparison_rows``): a ``SimResult`` in, plain JSON-ready values out, no I/O, no clock;
* writers (``write_allocations_csv``, ``write_jobs_csv``, ``write_plot``, ``write_run``,
  ``write_comparison``) that put those values into files.

Every key of ``summary.json`` is defined in docs/metrics.md; keep the two in step.

The ``samples`` of a run are read as a step function: a sample holds from its time until the next
sample's time (the last one until ``result.end``). Of several samples at one time the last wins
(the cluster after the last cycle at that instant). Before the first sample the cluster is taken to
be as it was at the start: every GPU healthy, none busy, nothing queued.
"""

from __future__ import annotations

import csv
import json
import math
from bisect import bisect_right
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from scheduler import in_words
from scheduler.models import Priority
from scheduler.quotas import quota_of
from scheduler.sim.records import AllocationRecord, JobRecord, SimResult

CLASSES: tuple[str, ...] = tuple(p.value for p in Priority)  # critical, high, normal, low
ETA_MIN_WAIT_S = 600.0  # eta_error only judges jobs that waited longer than this
CHECKPOINT_BIN_S = 60.0
PREEMPTION_WINDOW_S = 3600.0
PREEMPTED_REASONS = frozenset({"preempted"})
FAILURE_REASONS = frozenset({"machine_failure", "failed"})
KNOWN_STATES = ("completed", "queued", "running", "rejected")

# --- small pure helpers ------------------------------------------------------------------------


def percentile(values: Iterable[float], q: float) -> float | None:
    """The q-th percentile (0 ≤ q ≤ 100) by linear interpolation between closest ranks.

    The same as numpy's default (``method="linear"``): with the n values sorted, rank
    ``r = q/100 · (n-1)`` and the result interpolates between the values at ``floor(r)`` and
    ``ceil(r)``. ``None`` for no values.
    """
    xs = sorted(float(v) for v in values)
    if not xs:
        return None
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile {q} is outside [0, 100]")
    rank = q / 100.0 * (len(xs) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(xs) - 1)
    frac = rank - lo
    return xs[lo] + (xs[hi] - xs[lo]) * frac


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def _clean(value: Any) -> Any:
    """Make a value strict-JSON-safe: NaN and infinities become None, tuples become lists."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def _clip(a: float, b: float, lo: float, hi: float) -> float:
    """Length of [a, b] ∩ [lo, hi]."""
    return max(0.0, min(b, hi) - max(a, lo))


# --- the samples step function -------------------------------------------------------------------

Segment = tuple[float, float, int, int, int]  # t0, t1, busy, healthy, queued


def sample_segments(result: SimResult) -> list[Segment]:
    """The samples as constant pieces covering [start, end]; empty when there are no samples."""
    start, end = result.start, result.end
    if not result.samples or end <= start:
        return []
    samples = sorted(result.samples, key=lambda s: s.time)  # stable: the last of equal times wins
    dedup = []
    for s in samples:
        if dedup and dedup[-1].time == s.time:
            dedup[-1] = s
        else:
            dedup.append(s)
    segments: list[Segment] = []
    if dedup[0].time > start:
        segments.append((start, min(dedup[0].time, end), 0, result.total_gpus, 0))
    for i, s in enumerate(dedup):
        t0 = max(s.time, start)
        t1 = min(dedup[i + 1].time if i + 1 < len(dedup) else end, end)
        if t1 > t0:
            segments.append((t0, t1, s.busy_gpus, s.healthy_gpus, s.queued_jobs))
    return segments


def waiting_intervals(segments: Sequence[Segment]) -> list[tuple[float, float]]:
    """The merged, sorted intervals [t0, t1) during which queued_jobs > 0."""
    out: list[tuple[float, float]] = []
    for t0, t1, _busy, _healthy, queued in segments:
        if queued <= 0:
            continue
        if out and out[-1][1] >= t0:
            out[-1] = (out[-1][0], max(out[-1][1], t1))
        else:
            out.append((t0, t1))
    return out


def _overlaps_any(a: float, b: float, intervals: Sequence[tuple[float, float]], starts: Sequence[float]) -> bool:
    """Whether [a, b] meets one of the merged intervals [s, e) (for a == b: the instant a)."""
    i = bisect_right(starts, a) - 1  # the last interval starting at or before a
    if i >= 0 and intervals[i][1] > a:
        return True
    j = i + 1  # the first interval starting after a
    return j < len(intervals) and intervals[j][0] < b


# --- metrics ---------------------------------------------------------------------------------


def _utilisation(result: SimResult, segments: Sequence[Segment]) -> dict[str, Any]:
    start, end = result.start, result.end
    held = sum(len(a.gpus) * _clip(a.start, a.end, start, end) for a in result.allocations)
    if segments:
        healthy = sum((t1 - t0) * h for t0, t1, _b, h, _q in segments)
        busy = sum((t1 - t0) * b for t0, t1, b, _h, _q in segments)
        healthy_w = sum((t1 - t0) * h for t0, t1, _b, h, q in segments if q > 0)
        busy_w = sum((t1 - t0) * b for t0, t1, b, _h, q in segments if q > 0)
        waiting_s = sum(t1 - t0 for t0, t1, _b, _h, q in segments if q > 0)
        from_samples = _ratio(busy, healthy)
        while_waiting = _ratio(busy_w, healthy_w)
    else:
        healthy = result.total_gpus * max(0.0, end - start)
        from_samples = while_waiting = None
        waiting_s = None
    return {
        "utilisation": _ratio(held, healthy),
        "utilisation_while_waiting": while_waiting,
        "utilisation_from_samples": from_samples,
        "gpu_hours_held": held / 3600.0,
        "healthy_gpu_hours": healthy / 3600.0,
        "time_with_queue_s": waiting_s,
    }


def _per_gpu(allocations: Iterable[AllocationRecord]) -> dict[str, list[tuple[float, float]]]:
    by_gpu: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for a in allocations:
        for g in a.gpus:
            by_gpu[g].append((a.start, a.end))
    for ivs in by_gpu.values():
        ivs.sort()
    return by_gpu


def _idle_gaps(
    by_gpu: Mapping[str, list[tuple[float, float]]], waiting: Sequence[tuple[float, float]]
) -> tuple[list[float], list[float]]:
    """All gaps between consecutive allocations of each GPU, and those overlapping a queue."""
    starts = [s for s, _e in waiting]
    gaps: list[float] = []
    gaps_waiting: list[float] = []
    for ivs in by_gpu.values():
        held_until: float | None = None
        for s, e in ivs:
            if e <= s:
                continue  # empty (placed as --until cuts the run): it holds nothing
            if held_until is not None and s >= held_until:
                gap = s - held_until
                gaps.append(gap)
                if waiting and _overlaps_any(held_until, s, waiting, starts):
                    gaps_waiting.append(gap)
            held_until = e if held_until is None else max(held_until, e)
    return gaps, gaps_waiting


def _double_booking(by_gpu: Mapping[str, list[tuple[float, float]]]) -> tuple[int, int]:
    """(GPUs with overlapping allocations, allocations that start while another holds the GPU).

    A sweep per GPU over its allocations sorted by start: an allocation [s, e) overlaps an earlier
    one exactly when s is before the latest end seen so far. Touching ends (s == end) are fine and
    empty allocations (e <= s) hold nothing.
    """
    gpus = 0
    intervals = 0
    for ivs in by_gpu.values():
        held_until = -math.inf
        clashes = 0
        for s, e in ivs:
            if e <= s:
                continue
            if s < held_until:
                clashes += 1
            held_until = max(held_until, e)
        if clashes:
            gpus += 1
            intervals += clashes
    return gpus, intervals


def _dist(values: Sequence[float], qs: Sequence[int]) -> dict[str, Any]:
    out: dict[str, Any] = {"count": len(values)}
    for q in qs:
        out[f"p{q}"] = percentile(values, q)
    return out


def _wait(job: JobRecord) -> float | None:
    return None if job.first_start is None else job.first_start - job.submit


def _waits(jobs: Sequence[JobRecord]) -> dict[str, Any]:
    groups: dict[str, list[JobRecord]] = {c: [] for c in CLASSES}
    for j in jobs:
        groups.setdefault(j.priority.value, []).append(j)
    groups["all"] = list(jobs)
    out: dict[str, Any] = {}
    for cls, js in groups.items():
        waits = [w for w in map(_wait, js) if w is not None]
        d = _dist(waits, (50, 95, 99))
        d["mean"] = _mean(waits)
        d["max"] = max(waits) if waits else None
        d["never_started"] = sum(1 for j in js if j.first_start is None and j.state != "rejected")
        d["rejected"] = sum(1 for j in js if j.state == "rejected")
        out[cls] = d
    return out


def _jct(jobs: Sequence[JobRecord]) -> dict[str, Any]:
    groups: dict[str, list[float]] = {c: [] for c in CLASSES}
    groups["all"] = []
    for j in jobs:
        if j.state == "completed" and j.finish is not None:
            t = j.finish - j.submit
            groups.setdefault(j.priority.value, []).append(t)
            groups["all"].append(t)
    return {
        cls: {"count": len(ts), "mean": _mean(ts), "p50": percentile(ts, 50), "p95": percentile(ts, 95)}
        for cls, ts in groups.items()
    }


def max_in_window(times: Iterable[float], window: float = PREEMPTION_WINDOW_S) -> int:
    """The most of ``times`` inside any closed window [t, t + window]."""
    ts = sorted(times)
    best = 0
    lo = 0
    for hi, t in enumerate(ts):
        while t - ts[lo] > window:
            lo += 1
        best = max(best, hi - lo + 1)
    return best


def _preemptions(result: SimResult) -> dict[str, Any]:
    per_job = [max_in_window(j.preemption_times) for j in result.jobs]
    return {
        "preemptions": sum(j.preemptions for j in result.jobs),
        "preempted_allocations": sum(1 for a in result.allocations if a.reason in PREEMPTED_REASONS),
        "jobs_preempted": sum(1 for j in result.jobs if j.preemptions > 0),
        "max_preemptions_per_job": max((j.preemptions for j in result.jobs), default=0),
        "max_preemptions_per_job_in_any_hour": max(per_job, default=0),
    }


def _work_lost(result: SimResult) -> dict[str, Any]:
    pre = sum(a.lost_work for a in result.allocations if a.reason in PREEMPTED_REASONS)
    fail = sum(a.lost_work for a in result.allocations if a.reason in FAILURE_REASONS)
    other = sum(a.lost_work for a in result.allocations
                if a.reason not in PREEMPTED_REASONS and a.reason not in FAILURE_REASONS)
    total = pre + fail + other  # each part summed alone: their difference left float noise (-6e-14)
    held = sum(len(a.gpus) * max(0.0, a.end - a.start) for a in result.allocations)
    # Beyond the work lost: the time attempts after a job's first spend starting again
    # (SimSettings.restart_s; zero unless the run asked for it).
    restarting = sum(a.restart_work for a in result.allocations)
    return {
        "work_lost_gpu_hours": {
            "preemption": pre / 3600.0,
            "machine_failure": fail / 3600.0,
            "other": other / 3600.0,
            "total": total / 3600.0,
        },
        "work_lost_fraction": _ratio(total, held),
        "restart_overhead_gpu_hours": restarting / 3600.0,
        "restart_overhead_fraction": _ratio(restarting, held),
    }


def _eta_error(jobs: Sequence[JobRecord]) -> dict[str, Any]:
    abs_long: list[float] = []
    rel_long: list[float] = []
    rel_all: list[float] = []
    for j in jobs:
        wait = _wait(j)
        if wait is None or j.predicted_start is None or wait <= 0:
            continue
        err = abs(j.predicted_start - j.first_start)  # type: ignore[operator]
        rel_all.append(err / wait)
        if wait > ETA_MIN_WAIT_S:
            abs_long.append(err)
            rel_long.append(err / wait)
    return {
        "count": len(abs_long),
        "median_abs_error_s": percentile(abs_long, 50),
        "median_relative_error": percentile(rel_long, 50),
        "p90_relative_error": percentile(rel_long, 90),
        "count_all_waited": len(rel_all),
        "median_relative_error_all_waited": percentile(rel_all, 50),
    }


def _team_share(result: SimResult) -> dict[str, Any]:
    team_of = {j.job_id: j.team for j in result.jobs}
    span = result.end - result.start
    held: dict[str, float] = defaultdict(float)
    for a in result.allocations:
        team = team_of.get(a.job_id, "(unknown)")
        held[team] += len(a.gpus) * _clip(a.start, a.end, result.start, result.end)
    # "*" is the default quota of every team the fleet does not name, not a team of its own.
    teams = sorted((set(result.quotas) - {"*"}) | set(team_of.values()) | set(held))
    out: dict[str, Any] = {}
    for team in teams:
        quota = quota_of(result.quotas, team)
        guaranteed = quota.guaranteed if quota is not None else 0
        mean_gpus = held[team] / span if span > 0 else None
        out[team] = {
            "guaranteed": guaranteed,
            "max": quota.max if quota is not None else None,
            "mean_gpus": mean_gpus,
            "share_of_guarantee": (mean_gpus / guaranteed) if (guaranteed and mean_gpus is not None) else None,
        }
    return out


def _checkpoint_write(result: SimResult) -> dict[str, Any]:
    writes = result.checkpoint_writes
    total = sum(w.bytes for w in writes)
    out: dict[str, Any] = {
        "writes": len(writes),
        "bytes_total": total,
        "bin_s": CHECKPOINT_BIN_S,
        "peak_bin_bytes": None,
        "mean_bin_bytes": None,
        "peak_to_mean": None,
    }
    if not writes:
        return out
    t0 = min(w.time for w in writes)
    t1 = max(w.time for w in writes)
    nbins = int((t1 - t0) // CHECKPOINT_BIN_S) + 1
    bins: Counter[int] = Counter()
    for w in writes:
        bins[min(int((w.time - t0) // CHECKPOINT_BIN_S), nbins - 1)] += w.bytes
    mean = total / nbins
    out["peak_bin_bytes"] = max(bins.values())
    out["mean_bin_bytes"] = mean
    out["peak_to_mean"] = _ratio(max(bins.values()), mean)
    return out


def summarize(result: SimResult) -> dict[str, Any]:
    """The metrics of one run: the contents of summary.json (see docs/metrics.md)."""
    segments = sample_segments(result)
    waiting = waiting_intervals(segments)
    by_gpu = _per_gpu(result.allocations)
    gaps, gaps_waiting = _idle_gaps(by_gpu, waiting)
    double_gpus, double_intervals = _double_booking(by_gpu)

    states = Counter(j.state for j in result.jobs)
    jobs = {s: states.get(s, 0) for s in KNOWN_STATES}
    jobs.update({s: n for s, n in sorted(states.items()) if s not in jobs})
    jobs["total"] = len(result.jobs)

    under = [w for j in result.jobs if j.under_guarantee_at_submit for w in [_wait(j)] if w is not None]

    summary: dict[str, Any] = {
        "policy": result.policy,
        "jobs": jobs,
        "start": result.start,
        "end": result.end,
        "span_s": result.end - result.start,
        "gpus": result.total_gpus,
        **_utilisation(result, segments),
        "idle_gap_s": {**_dist(gaps, (50, 90))},
        "idle_gap_while_waiting_s": {**_dist(gaps_waiting, (50, 90))},
        "wait_s": _waits(result.jobs),
        "wait_under_guarantee_s": {**_dist(under, (50, 95)), "max": max(under) if under else None},
        "jct_s": _jct(result.jobs),
        **_preemptions(result),
        **_work_lost(result),
        "eta_error": _eta_error(result.jobs),
        "team_share": _team_share(result),
        "reclaim_latency_s": {
            **_dist(result.reclaim_latencies, (50, 95)),
            "max": max(result.reclaim_latencies) if result.reclaim_latencies else None,
        },
        "checkpoint_write": _checkpoint_write(result),
        "cycle_ms": {
            **_dist(result.cycle_ms, (50, 99)),
            "max": max(result.cycle_ms) if result.cycle_ms else None,
        },
        "double_booked_gpus": double_gpus,
        "double_booked_intervals": double_intervals,
    }
    return _clean(summary)


# --- comparison ------------------------------------------------------------------------------


def _get(summary: Mapping[str, Any], *path: str) -> Any:
    cur: Any = summary
    for key in path:
        if not isinstance(cur, Mapping) or key not in cur:
            return None
        cur = cur[key]
    return cur


def fmt_duration(seconds: float | None) -> str:
    """Seconds as a person reads them (in_words.duration), or a dash for none."""
    return "—" if seconds is None else in_words.duration(seconds)


def _fmt_pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.1f}%"


def fmt_share(x: float | None) -> str:
    """A share that is small when things go well (work lost): two significant figures below 1%,
    so that 0.0045% does not read as nothing lost."""
    if x is None:
        return "—"
    percent = 100 * x
    if x == 0 or percent >= 1:
        return _fmt_pct(x)
    if percent < 0.0001:
        return "< 0.0001%"
    return f"{percent:.{1 - math.floor(math.log10(percent))}f}%"


def _fmt_num(x: float | None) -> str:
    if x is None:
        return "—"
    return f"{x:.0f}" if float(x) == int(x) else f"{x:.2f}"


def _fmt_times(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}×"


def _fmt_ms(x: float | None) -> str:
    return "—" if x is None else f"{x:.1f} ms"


# (key in comparison.json, row label, path in summary.json, formatter)
COMPARISON_ROWS: tuple[tuple[str, str, tuple[str, ...], Callable[[Any], str]], ...] = (
    ("utilisation", "Utilisation", ("utilisation",), _fmt_pct),
    ("utilisation_while_waiting", "Utilisation while jobs wait", ("utilisation_while_waiting",), _fmt_pct),
    ("wait_p95_critical", "Wait p95, critical", ("wait_s", "critical", "p95"), fmt_duration),
    ("wait_p95_high", "Wait p95, high", ("wait_s", "high", "p95"), fmt_duration),
    ("wait_p95_normal", "Wait p95, normal", ("wait_s", "normal", "p95"), fmt_duration),
    ("wait_p95_low", "Wait p95, low", ("wait_s", "low", "p95"), fmt_duration),
    ("wait_p50_all", "Wait p50, all", ("wait_s", "all", "p50"), fmt_duration),
    ("jct_mean_s", "Mean JCT", ("jct_s", "all", "mean"), fmt_duration),
    ("preemptions", "Preemptions", ("preemptions",), _fmt_num),
    ("work_lost_fraction", "Work lost", ("work_lost_fraction",), fmt_share),
    ("eta_median_relative_error", "Median ETA error (relative, wait > 10 min)",
     ("eta_error", "median_relative_error"), _fmt_pct),
    ("reclaim_latency_p95_s", "Reclaim latency p95", ("reclaim_latency_s", "p95"), fmt_duration),
    ("idle_gap_p50_s", "Idle gap p50", ("idle_gap_s", "p50"), fmt_duration),
    ("checkpoint_peak_to_mean", "Checkpoint write peak/mean", ("checkpoint_write", "peak_to_mean"), _fmt_times),
    ("cycle_p99_ms", "Cycle p99", ("cycle_ms", "p99"), _fmt_ms),
    ("double_booked_gpus", "Double-booked GPUs", ("double_booked_gpus",), _fmt_num),
)


def comparison_values(summaries: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """The headline values of each policy's summary, raw (seconds, fractions): comparison.json."""
    return _clean({
        name: {key: _get(s, *path) for key, _label, path, _fmt in COMPARISON_ROWS}
        for name, s in summaries.items()
    })


def comparison_table(summaries: Mapping[str, Mapping[str, Any]]) -> str:
    """A Markdown table of the headline metrics, one column per policy."""
    names = list(summaries)

    def cell(text: str) -> str:
        return str(text).replace("|", "\\|")

    lines = [
        "| Metric | " + " | ".join(cell(n) for n in names) + " |",
        "|---|" + "---:|" * len(names),
    ]
    for _key, label, path, fmt in COMPARISON_ROWS:
        row = [cell(fmt(_get(summaries[n], *path))) for n in names]
        lines.append(f"| {label} | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


# --- writers ---------------------------------------------------------------------------------


def _fmt_float(x: float | None, decimals: int = 3) -> str:
    """A number with at most ``decimals`` decimals and no trailing zeros; '' for None."""
    if x is None:
        return ""
    x = float(x)
    if not math.isfinite(x):
        return ""
    text = f"{x:.{decimals}f}"
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text


ALLOCATION_COLUMNS = ("job_id", "start", "end", "reason", "gpus")
JOB_COLUMNS = (
    "job_id", "team", "priority", "num_gpus", "kind", "submit", "first_start", "finish", "state",
    "preemptions", "lost_work_gpu_hours", "predicted_start", "wait", "expected_duration", "duration",
    "reason",
)


def write_allocations_csv(result: SimResult, path: str | Path) -> None:
    """allocations.csv: one row per time a job held GPUs, in start order."""
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(ALLOCATION_COLUMNS)
        for a in sorted(result.allocations, key=lambda a: (a.start, a.job_id)):
            w.writerow([a.job_id, _fmt_float(a.start), _fmt_float(a.end), a.reason, " ".join(a.gpus)])


def write_jobs_csv(result: SimResult, path: str | Path) -> None:
    """jobs.csv: one row per job, in submit order; empty cells for unknowns."""
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(JOB_COLUMNS)
        for j in sorted(result.jobs, key=lambda j: (j.submit, j.job_id)):
            w.writerow([
                j.job_id, j.team, j.priority.value, j.num_gpus, j.kind,
                _fmt_float(j.submit), _fmt_float(j.first_start), _fmt_float(j.finish), j.state,
                j.preemptions, _fmt_float(j.lost_work / 3600.0, 6), _fmt_float(j.predicted_start),
                _fmt_float(_wait(j)), _fmt_float(j.expected_duration), _fmt_float(j.duration), j.reason,
            ])


def _binned_series(result: SimResult, bins: int = 1500):
    """Time-averaged utilisation and queue length on a regular grid (exact for a step function)."""
    import numpy as np

    segments = sample_segments(result)
    if not segments:
        return None
    t0 = np.array([s[0] for s in segments])
    t1 = np.array([s[1] for s in segments])
    dt = t1 - t0
    busy = np.array([s[2] for s in segments], dtype=float)
    healthy = np.array([s[3] for s in segments], dtype=float)
    queued = np.array([s[4] for s in segments], dtype=float)
    knots = np.concatenate([t0[:1], t1])
    cum = {k: np.concatenate([[0.0], np.cumsum(v * dt)]) for k, v in
           (("busy", busy), ("healthy", healthy), ("queued", queued))}
    n = max(1, min(bins, len(segments)))
    edges = np.linspace(knots[0], knots[-1], n + 1)
    at = {k: np.interp(edges, knots, v) for k, v in cum.items()}
    d = {k: np.diff(v) for k, v in at.items()}
    with np.errstate(invalid="ignore", divide="ignore"):
        util = np.where(d["healthy"] > 0, d["busy"] / d["healthy"], np.nan)
    queue = d["queued"] / np.diff(edges)
    return edges, util, queue


def write_plot(result: SimResult, path: str | Path) -> None:
    """run.png: utilisation and queue over time, and the wait distribution per priority class."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (ax_u, ax_w) = plt.subplots(2, 1, figsize=(11, 8.5), gridspec_kw={"height_ratios": [1, 1]})
    try:
        fig.suptitle(f"gpusched simulation — policy: {result.policy}")
        series = _binned_series(result)
        if series is not None:
            edges, util, queue = series
            hours = (edges - result.start) / 3600.0
            ax_u.stairs(util * 100.0, hours, color="tab:blue", label="GPU utilisation (busy/healthy)", baseline=None)
            ax_q = ax_u.twinx()
            ax_q.stairs(queue, hours, color="tab:orange", alpha=0.8, label="queued jobs", baseline=None)
            ax_q.set_ylabel("queued jobs", color="tab:orange")
            ax_q.set_ylim(bottom=0)
            lines = ax_u.get_legend_handles_labels()
            more = ax_q.get_legend_handles_labels()
            ax_u.legend(lines[0] + more[0], lines[1] + more[1], loc="lower right", fontsize="small")
        else:
            ax_u.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax_u.transAxes)
        ax_u.set_ylim(0, 105)
        ax_u.set_xlabel("time since start (hours)")
        ax_u.set_ylabel("GPU utilisation (%)", color="tab:blue")
        ax_u.set_title("Utilisation and queue")

        colours = {"critical": "tab:red", "high": "tab:orange", "normal": "tab:blue", "low": "tab:gray"}
        plotted = False
        for cls in CLASSES:
            waits = sorted(w for j in result.jobs if j.priority.value == cls for w in [_wait(j)] if w is not None)
            if not waits:
                continue
            x = np.maximum(np.array(waits) / 60.0, 1.0 / 60.0)  # minutes; 0 s shown at 1 s
            y = np.arange(1, len(x) + 1) / len(x)
            ax_w.step(x, y, where="post", color=colours[cls], label=f"{cls} (n={len(x)})")
            plotted = True
        if plotted:
            ax_w.set_xscale("log")
            ax_w.legend(loc="lower right", fontsize="small")
        else:
            ax_w.text(0.5, 0.5, "no job started", ha="center", va="center", transform=ax_w.transAxes)
        ax_w.set_ylim(0, 1.02)
        ax_w.set_xlabel("wait before first start (minutes, log; waits under 1 s shown at 1 s)")
        ax_w.set_ylabel("fraction of started jobs")
        ax_w.set_title("Wait time by priority class (empirical CDF)")
        ax_w.grid(True, which="both", alpha=0.3)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)


def write_json(data: Any, path: Path) -> None:
    path.write_text(json.dumps(data, indent=2, allow_nan=False) + "\n", encoding="utf-8")


# The files a run writes into its folder, and a comparison beside them.
RUN_FILES = ALLOCATIONS_CSV, JOBS_CSV, SUMMARY_JSON, PLOT_PNG = ("allocations.csv", "jobs.csv", "summary.json", "run.png")
COMPARISON_FILES = COMPARISON_MD, COMPARISON_JSON = ("comparison.md", "comparison.json")


def write_run(result: SimResult, out_dir: str | Path) -> dict[str, Any]:
    """Write allocations.csv, jobs.csv, summary.json and run.png into out_dir; return the summary."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(result)
    write_allocations_csv(result, out / ALLOCATIONS_CSV)
    write_jobs_csv(result, out / JOBS_CSV)
    write_json(summary, out / SUMMARY_JSON)
    write_plot(result, out / PLOT_PNG)
    return summary


def write_comparison(summaries: Mapping[str, Mapping[str, Any]], out_dir: str | Path) -> str:
    """Write comparison.md (the table) and comparison.json (raw headline values); return the table."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    table = comparison_table(summaries)
    (out / COMPARISON_MD).write_text(table, encoding="utf-8")
    write_json(comparison_values(summaries), out / COMPARISON_JSON)
    return table
