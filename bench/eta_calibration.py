#!/usr/bin/env python3
"""Offline study: can ETAs be corrected by what the scheduler has already observed?

    python bench/eta_calibration.py out/seed-prof/jobs.csv out/philly-eta/jobs.csv [--sweep]

The estimated start a user sees at submit (``predicted_start`` in a simulator's jobs.csv) is an
honest forward simulation that assumes no more important work arrives; in an overloaded cluster it
comes in early. A *calibration* rescales that raw estimate by how earlier estimates turned out:
for the jobs that have already started, compare the wait predicted at their submit with the wait
they had. Calibration only changes the reported ETA, never a scheduling decision, so it can be
evaluated exactly from jobs.csv without re-running the simulator.

Causality: the estimate of a job submitted at t may only use jobs that *started before t* (their
outcome is known then), and, for the censored variants, what is known at t about jobs still
waiting (they have waited at least t - submit so far). Estimates are made at submit: the
simulator's first cycle for a job runs at its submit time, so predicted wait = predicted_start -
submit.

Calibration applies to every job that was queued at its first cycle (not placed at once): we
cannot know at submit which will wait more than 10 minutes. A job placed in its first cycle shows
``predicted_start == first_start == submit`` and is left alone. Jobs without an estimate (empty
``predicted_start``: not within the horizon) stay without one, as in report.py.

Printed per scheme and per file: ``long`` = the report's eta_error.median_relative_error (jobs that
waited > 10 min), ``p90``, and the side effect on jobs that waited 0 < wait ≤ 10 min: their median
relative and median absolute (seconds) error. The first row reproduces report.py from the raw
predictions. ORACLE rows are not causal: bounds fitted with hindsight on the judged jobs.

Findings (seed-prof and the Philly busiest week; full table: run with --sweep): no causal scheme
reaches a 30 % median on either trace (best ≈ 61–64 % on seed, ≈ 36–38 % on Philly), and even the
hindsight oracle of the same shape (one factor per class × predicted-wait bucket) only reaches
46 % / 30 %. The long waits are too dispersed around any factor known at submit.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from bisect import bisect_left
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from scheduler.sim.report import ETA_MIN_WAIT_S, percentile  # noqa: E402

HOUR = 3600.0


# --- the data --------------------------------------------------------------------------------


@dataclass
class Jobs:
    """jobs.csv as arrays; ``p`` is the raw predicted wait (nan: no estimate), ``a`` the actual
    wait (nan: never started), ``F`` the first start (inf: never started)."""

    cls: np.ndarray
    gpus: np.ndarray
    s: np.ndarray
    p: np.ndarray
    a: np.ndarray
    F: np.ndarray
    pending: np.ndarray  # queued at its first cycle, so its estimate is a real forecast
    classes: tuple[str, ...] = ()
    by_class: dict = field(default_factory=dict)  # class -> indices of started, estimated, queued jobs sorted by F


def load(path: str) -> Jobs:
    rows = list(csv.DictReader(open(path, encoding="utf-8")))
    f = lambda v: float(v) if v != "" else math.nan  # noqa: E731
    s = np.array([f(r["submit"]) for r in rows])
    P = np.array([f(r["predicted_start"]) for r in rows])
    F = np.array([f(r["first_start"]) for r in rows])
    cls = np.array([r["priority"] for r in rows])
    gpus = np.array([int(r["num_gpus"]) for r in rows])
    a = F - s
    p = P - s
    pending = ~(a == 0)  # a NaN (never started) counts as pending
    F = np.where(np.isnan(F), np.inf, F)
    jobs = Jobs(cls, gpus, s, p, a, F, pending)
    jobs.classes = tuple(sorted(set(cls)))
    for c in jobs.classes:
        idx = np.where((cls == c) & np.isfinite(F) & ~np.isnan(p) & pending)[0]
        jobs.by_class[c] = idx[np.argsort(F[idx], kind="stable")]
    return jobs


# --- the metric (report.py's _eta_error, on a calibrated predicted wait) ------------------------


def metric(jobs: Jobs, pred_wait: np.ndarray) -> dict[str, float | int | None]:
    long_rel, short_rel, short_abs, all_rel = [], [], [], []
    for pw, a in zip(pred_wait, jobs.a):
        if math.isnan(a) or math.isnan(pw) or a <= 0:
            continue
        err = abs(pw - a)  # |predicted_start - first_start|: the submit cancels
        all_rel.append(err / a)
        if a > ETA_MIN_WAIT_S:
            long_rel.append(err / a)
        else:
            short_rel.append(err / a)
            short_abs.append(err)
    return {
        "n_long": len(long_rel),
        "long": percentile(long_rel, 50),
        "p90": percentile(long_rel, 90),
        "short_rel": percentile(short_rel, 50),
        "short_abs": percentile(short_abs, 50),
        "all": percentile(all_rel, 50),
    }


# --- what is known at time t ------------------------------------------------------------------


def started_before(jobs: Jobs, c: str, t: float, *, last: int | None = None, hours: float | None = None) -> np.ndarray:
    """Indices of class-c queued jobs that started before t: the last `last` of them, or those
    that started in the last `hours`."""
    idx = jobs.by_class.get(c)
    if idx is None or len(idx) == 0:
        return np.empty(0, dtype=int)
    Fs = jobs.F[idx]
    k = bisect_left(Fs, t)
    lo = 0
    if last is not None:
        lo = max(0, k - last)
    if hours is not None:
        lo = max(lo, bisect_left(Fs, t - hours * HOUR))
    return idx[lo:k]


def waiting_at(jobs: Jobs, c: str, t: float) -> np.ndarray:
    """Indices of class-c jobs with an estimate, submitted before t and not started by t."""
    m = (jobs.cls == c) & (jobs.s < t) & (jobs.F >= t) & ~np.isnan(jobs.p) & jobs.pending
    return np.where(m)[0]


# --- schemes -----------------------------------------------------------------------------------

# A scheme maps (jobs, index of the job being estimated) to a calibrated predicted wait; `apply`
# calls it only for jobs that were shown an estimate while pending.
Scheme = Callable[[Jobs, int], float]

P_MIN = 60.0  # a ratio from a predicted wait under a minute is noise (the cycle's own granularity)


def _shrink(f: float, n: int, k0: float) -> float:
    """Pull a factor toward 1 (in log space) when it rests on few samples: weight n / (n + k0)."""
    if k0 <= 0 or n == 0:
        return f if n else 1.0
    return math.exp(math.log(f) * n / (n + k0))


def ratio_scheme(
    *, last: int | None = None, hours: float | None = None, q: float = 50.0, k0: float = 0.0,
    min_n: int = 5, p_bucket: tuple[float, ...] | None = None, g_bucket: tuple[int, ...] | None = None,
    censored: bool = False, long_only: bool = False, pooled: bool = False, cap: tuple[float, float] = (0.2, 20.0),
) -> Scheme:
    """calibrated = raw × factor; factor = q-th percentile of actual/predicted wait over recent
    observations of the class (optionally only those in the same predicted-wait or GPU bucket,
    falling back to the whole class when fewer than min_n)."""

    def bucket_of(edges: tuple, x: float) -> int:
        return bisect_left(edges, x)

    def factor_from(obs_p: np.ndarray, obs_a: np.ndarray) -> tuple[float, int]:
        keep = obs_p >= P_MIN
        if long_only:
            keep &= obs_a > ETA_MIN_WAIT_S
        r = obs_a[keep] / obs_p[keep]
        if len(r) < min_n:
            return 1.0, 0
        return float(np.clip(np.percentile(r, q), *cap)), len(r)

    def run(jobs: Jobs, j: int) -> float:
        p = jobs.p[j]
        t = jobs.s[j]
        classes = jobs.classes if pooled else (jobs.cls[j],)
        idx = np.concatenate([started_before(jobs, c, t, last=last, hours=hours) for c in classes])
        obs_p, obs_a = jobs.p[idx], jobs.a[idx]
        if censored:
            w = np.concatenate([waiting_at(jobs, c, t) for c in classes])
            so_far = t - jobs.s[w]
            overdue = so_far > jobs.p[w]  # only a wait already longer than predicted is news
            obs_p = np.concatenate([obs_p, jobs.p[w][overdue]])
            obs_a = np.concatenate([obs_a, so_far[overdue]])
        f, n = factor_from(obs_p, obs_a)
        for edges, values, mine in ((p_bucket, obs_p, p), (g_bucket, None, jobs.gpus[j])):
            if edges is None:
                continue
            if values is None:  # GPU bucket: only started observations carry a GPU count here
                gp = jobs.gpus[idx]
                same = np.array([bucket_of(edges, x) == bucket_of(edges, mine) for x in gp], dtype=bool)
                same = np.concatenate([same, np.zeros(len(obs_p) - len(idx), dtype=bool)])
            else:
                same = np.array([bucket_of(edges, x) == bucket_of(edges, mine) for x in values], dtype=bool)
            fb, nb = factor_from(obs_p[same], obs_a[same])
            if nb:
                f, n = fb, nb
        return p * _shrink(f, n, k0)

    return run


def _best_factor(grid: np.ndarray, predicted_over_actual: np.ndarray, q: float) -> float:
    """The factor on the grid whose q-th percentile of relative error |f·p/a − 1| is lowest."""
    errs = np.percentile(np.abs(grid[:, None] * predicted_over_actual[None, :] - 1.0), q, axis=1)
    return float(grid[int(np.argmin(errs))])


def erm_scheme(*, last: int | None = None, hours: float | None = None, min_n: int = 5) -> Scheme:
    """factor = the one that would have minimised the metric itself (median relative error over
    recent observations that waited > 10 min)."""
    grid = np.geomspace(0.25, 10.0, 161)

    def run(jobs: Jobs, j: int) -> float:
        p = jobs.p[j]
        idx = started_before(jobs, jobs.cls[j], jobs.s[j], last=last, hours=hours)
        keep = (jobs.a[idx] > ETA_MIN_WAIT_S) & (jobs.p[idx] >= P_MIN)
        x = jobs.p[idx][keep] / jobs.a[idx][keep]
        if len(x) < min_n:
            return p
        return p * _best_factor(grid, x, 50.0)

    return run


def erm_bucket_scheme(*, last: int | None = None, hours: float | None = None, edges: tuple[float, ...] = (),
                      min_n: int = 10, q: float = 50.0) -> Scheme:
    """Per predicted-wait bucket, the factor that would have minimised the q-th percentile of the
    relative error over *all* recent observations in the bucket (short waits included, since the
    factor is applied to every queued job)."""
    grid = np.geomspace(0.1, 10.0, 121)

    def run(jobs: Jobs, j: int) -> float:
        p = jobs.p[j]
        idx = started_before(jobs, jobs.cls[j], jobs.s[j], last=last, hours=hours)
        op, oa = jobs.p[idx], jobs.a[idx]
        keep = (oa > 0) & (op >= P_MIN)
        same = np.array([bisect_left(edges, v) == bisect_left(edges, p) for v in op], dtype=bool)
        for m in (keep & same, keep):
            if m.sum() >= min_n:
                return p * _best_factor(grid, op[m] / oa[m], q)
        return p

    return run


def oracle(jobs: Jobs, *, edges: tuple[float, ...] = (), around_h: float | None = None) -> np.ndarray:
    """NOT causal, a bound: for each (class, predicted-wait bucket) the single factor that
    minimises the metric over exactly the jobs the metric judges (waited > 10 min), fitted with
    hindsight; with around_h, refitted per job on same-class jobs submitted within ±around_h.
    If even this misses the target, no causal raw × factor scheme of that shape can hit it."""
    grid = np.geomspace(0.1, 20.0, 301)

    def best(x: np.ndarray) -> float:
        return float(grid[int(np.argmin(np.median(np.abs(grid[:, None] * x[None, :] - 1.0), axis=1)))])

    out = jobs.p.copy()
    judged = np.where(jobs.pending & ~np.isnan(jobs.p) & ~np.isnan(jobs.a) & (jobs.a > ETA_MIN_WAIT_S))[0]
    bucket = np.array([bisect_left(edges, v) for v in jobs.p[judged]])
    x = jobs.p[judged] / jobs.a[judged]
    for k, j in enumerate(judged):
        m = (jobs.cls[judged] == jobs.cls[j]) & (bucket == bucket[k])
        if around_h is not None:
            m &= np.abs(jobs.s[judged] - jobs.s[j]) <= around_h * HOUR
        out[j] = jobs.p[j] * best(x[m])
    return out


def additive_scheme(*, last: int | None = None, hours: float | None = None, min_n: int = 5) -> Scheme:
    """calibrated = raw + median(actual - predicted) over recent observations (never below 0)."""

    def run(jobs: Jobs, j: int) -> float:
        p = jobs.p[j]
        idx = started_before(jobs, jobs.cls[j], jobs.s[j], last=last, hours=hours)
        if len(idx) < min_n:
            return p
        return max(0.0, p + float(np.median(jobs.a[idx] - jobs.p[idx])))

    return run


def recent_wait_scheme(*, last: int | None = None, hours: float | None = None, blend: float = 1.0,
                       ratio_last: int = 100, min_n: int = 5) -> Scheme:
    """calibrated = the class's recent median actual wait (blend = 1), or a geometric blend of it
    with the ratio-calibrated estimate (blend = weight of the recent wait)."""
    ratio = ratio_scheme(last=ratio_last)

    def run(jobs: Jobs, j: int) -> float:
        p = jobs.p[j]
        idx = started_before(jobs, jobs.cls[j], jobs.s[j], last=last, hours=hours)
        if len(idx) < min_n:
            return p
        w = float(np.median(jobs.a[idx]))
        if blend >= 1.0:
            return w
        r = ratio(jobs, j)
        return math.exp(blend * math.log(max(w, 1.0)) + (1 - blend) * math.log(max(r, 1.0)))

    return run


def loglinear_scheme(*, last: int | None = None, hours: float | None = None, min_n: int = 20, c: float = 60.0) -> Scheme:
    """log(actual + c) = α + β·log(predicted + c), least squares over recent observations."""

    def run(jobs: Jobs, j: int) -> float:
        p = jobs.p[j]
        idx = started_before(jobs, jobs.cls[j], jobs.s[j], last=last, hours=hours)
        if len(idx) < min_n:
            return p
        x = np.log(jobs.p[idx] + c)
        y = np.log(jobs.a[idx] + c)
        if np.ptp(x) == 0:
            return p
        beta, alpha = np.polyfit(x, y, 1)
        return max(0.0, math.exp(alpha + beta * math.log(p + c)) - c)

    return run


def apply(jobs: Jobs, scheme: Scheme | dict | None) -> np.ndarray:
    if scheme is None:
        return jobs.p.copy()
    if isinstance(scheme, dict):  # an oracle's keyword arguments
        return oracle(jobs, **scheme)
    # Only an estimate shown to a waiting job is calibrated; the rest keep the raw value.
    return np.array([scheme(jobs, j) if jobs.pending[j] and not math.isnan(jobs.p[j]) else jobs.p[j]
                     for j in range(len(jobs.p))])


# --- the table ----------------------------------------------------------------------------------

P_EDGES = (600.0, 3600.0, 4 * HOUR)  # predicted wait: <10 min, 10 min–1 h, 1–4 h, > 4 h
G_EDGES = (1, 4, 8)  # GPUs: 1, 2–4, 5–8, > 8


def schemes(sweep: bool) -> list[tuple[str, Scheme | dict | None]]:
    out: list[tuple[str, Scheme | dict | None]] = [("raw (report.py)", None)]
    lasts = (20, 50, 100, 200, 500) if sweep else (50, 200)
    for n in lasts:
        out.append((f"ratio median, last {n}", ratio_scheme(last=n)))
    for h in ((6, 12, 24, 48, 96) if sweep else (24,)):
        out.append((f"ratio median, last {h} h", ratio_scheme(hours=h)))
    for q in ((40, 60, 70) if sweep else (60,)):
        out.append((f"ratio q{q}, last 200", ratio_scheme(last=200, q=q)))
    for k0 in ((10, 50) if sweep else (20,)):
        out.append((f"ratio median, last 200, shrink k0={k0}", ratio_scheme(last=200, k0=k0)))
    out += [
        ("ratio median, last 200, pooled classes", ratio_scheme(last=200, pooled=True)),
        ("ratio median, last 200, only obs waited>10m", ratio_scheme(last=200, long_only=True)),
        ("ratio median, last 200, by predicted-wait bucket", ratio_scheme(last=200, p_bucket=P_EDGES, min_n=10)),
        ("ratio median, last 500, by predicted-wait bucket", ratio_scheme(last=500, p_bucket=P_EDGES, min_n=10)),
        ("ratio median, last 24 h, by predicted-wait bucket", ratio_scheme(hours=24, p_bucket=P_EDGES, min_n=10)),
        ("ratio median, last 200, by GPU bucket", ratio_scheme(last=200, g_bucket=G_EDGES, min_n=10)),
        ("ratio median, last 200, + censored waiting", ratio_scheme(last=200, censored=True)),
        ("ratio median, last 200, bucket + censored", ratio_scheme(last=200, p_bucket=P_EDGES, min_n=10, censored=True)),
        ("min median-error factor (ERM), last 100", erm_scheme(last=100)),
        ("min median-error factor (ERM), last 24 h", erm_scheme(hours=24)),
        ("ERM all obs by predicted-wait bucket, last 300", erm_bucket_scheme(last=300, edges=P_EDGES)),
        ("ratio q60, last 300, by predicted-wait bucket", ratio_scheme(last=300, q=60, p_bucket=P_EDGES, min_n=10)),
        ("additive median(a-p), last 200", additive_scheme(last=200)),
        ("class recent median wait, last 50", recent_wait_scheme(last=50)),
        ("blend 0.5 recent wait × ratio", recent_wait_scheme(last=50, blend=0.5)),
        ("log-linear fit, last 200", loglinear_scheme(last=200)),
        ("log-linear fit, last 500", loglinear_scheme(last=500)),
    ]
    out += [
        ("ORACLE (hindsight) one factor per class", {}),
        ("ORACLE (hindsight) per class × predicted-wait bucket", {"edges": P_EDGES}),
        ("ORACLE (hindsight) per class, jobs within ±1 h", {"around_h": 1.0}),
        ("ORACLE (hindsight) per class, jobs within ±3 h", {"around_h": 3.0}),
    ]
    if sweep:
        for n in (100, 200, 300, 500, 1000):
            for m in (5, 10, 30):
                out.append((f"bucket sweep: last {n}, min_n {m}",
                            ratio_scheme(last=n, p_bucket=P_EDGES, min_n=m)))
        for n in (200, 300, 500):
            for q in (50, 55, 60, 65, 70):
                out.append((f"bucket q sweep: q{q}, last {n}", ratio_scheme(last=n, q=q, p_bucket=P_EDGES, min_n=10)))
        for n in (50, 100, 200, 500):
            out.append((f"additive sweep: last {n}", additive_scheme(last=n)))
        for edges in ((600.0, 3600.0), (600.0, 1800.0, 2 * HOUR, 8 * HOUR), (300.0, 1200.0, 3600.0, 3 * HOUR, 9 * HOUR)):
            out.append((f"bucket sweep: edges {tuple(int(e) for e in edges)}, last 300",
                        ratio_scheme(last=300, p_bucket=edges, min_n=10)))
    return out


def fmt(v: float | None, pct: bool = True) -> str:
    if v is None:
        return "—"
    return f"{100 * v:5.0f}%" if pct else f"{v:6.0f}s"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("jobs_csv", nargs="+")
    ap.add_argument("--sweep", action="store_true", help="also sweep the parameters")
    ap.add_argument("--only", help="only schemes whose name contains this text")
    args = ap.parse_args()
    data = [(Path(p).parent.name, load(p)) for p in args.jobs_csv]
    head = "| scheme | " + " | ".join(f"{n}: long | p90 | ≤10m rel | ≤10m abs" for n, _ in data) + " |"
    print(head)
    print("|" + "---|" * (1 + 4 * len(data)))
    # The best causal scheme per file (the hindsight ORACLE rows are bounds, not candidates).
    best: dict[str, tuple[float, str]] = {}
    for name, scheme in schemes(args.sweep):
        if args.only and args.only not in name and scheme is not None:
            continue
        cells = []
        for label, jobs in data:
            m = metric(jobs, apply(jobs, scheme))
            cells += [fmt(m["long"]), fmt(m["p90"]), fmt(m["short_rel"]), fmt(m["short_abs"], pct=False)]
            if not name.startswith("ORACLE") and not math.isnan(m["long"]):
                if label not in best or m["long"] < best[label][0]:
                    best[label] = (m["long"], name)
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    summary = {}
    for label, jobs in data:
        m = metric(jobs, jobs.p)
        print(f"{label}: {m['n_long']} jobs waited > {ETA_MIN_WAIT_S:.0f} s")
        summary[label] = {"jobs_judged": m["n_long"], "raw_median_error": m["long"],
                          "best_causal_median_error": best.get(label, (None,))[0],
                          "best_causal_scheme": best.get(label, (None, None))[1]}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
