"""Estimates allow for the more important work expected to arrive (scheduler/forecast.py)."""

from __future__ import annotations

import pytest
from builders import NOW, arrival, cycle, filler, fleet, job, mid, pending, snapshot

from scheduler.forecast import SubmissionLog, expected_arrivals
from scheduler.models import PolicyConfig, Priority

M = [mid(0, 0, i) for i in range(4)]
# Four machines held by a team within its guarantee, released at NOW+1000, +2000, +3000, +4000.
FULL = [filler(f"r{i}", M[i], range(8), team="ops", expected=1100 + 1000 * i, started=NOW - 100) for i in range(4)]
QUOTAS = {"ops": {"guaranteed": 32}, "lab": {"guaranteed": 0}, "owed": {"guaranteed": 8}}


def _waiting(priority="low", team="lab"):
    return job("q").gpus(8).priority(priority).team(team).expected(3600).submitted(NOW)


# (the waiting job, the expected arrivals, forecast_ramp, its estimated start)
CASES = [
    (_waiting(), [], 0, NOW + 1000),
    (_waiting(), [arrival(NOW + 500, "normal", 8, 10_000)], 0, NOW + 2000),
    (_waiting(), [arrival(NOW + 500, "normal", 16, 10_000)], 0, NOW + 3000),
    (_waiting(), [arrival(NOW + 500, "normal", 8, 1000)], 0, NOW + 1500),
    (_waiting(), [arrival(NOW + 500, "normal", 32, 20_000)], 0, NOW + 20_500),
    (_waiting(), [arrival(NOW + 500, "low", 8, 10_000)], 0, NOW + 1000),
    (_waiting("normal"), [arrival(NOW + 500, "normal", 8, 10_000)], 0, NOW + 1000),
    (_waiting("normal"), [arrival(NOW + 500, "high", 8, 10_000)], 0, NOW + 2000),
    (_waiting("critical"), [arrival(NOW + 500, "critical", 8, 10_000)], 0, NOW + 1000),
    (_waiting(team="owed"), [arrival(NOW + 500, "normal", 8, 10_000)], 0, NOW + 1000),
    (_waiting(), [arrival(NOW, "normal", 8, 10_000)], 3600, NOW + 1000),
    (_waiting(), [arrival(NOW + 500, "normal", 16, 10_000)], 1000, NOW + 2000),
    (_waiting(), [arrival(NOW + 500, "normal", 16, 10_000)], 500, NOW + 3000),
    (_waiting(), [arrival(NOW + 100, "normal", 1, 800), arrival(NOW + 400, "normal", 3, 100)], 7200, NOW + 1000),
]
IDS = [
    "with no arrivals expected, the estimate is the walk's",
    "a borrower waits while a more important arrival holds the GPUs it was to get",
    "arrivals are served first: two machines' worth push it back two releases",
    "it starts when the arrival ends, if that comes before the next release",
    "arrivals that outlast every release hold it back until they end",
    "arrivals of its own class go after it",
    "a normal job is not held back by normal arrivals",
    "a normal job is held back by high arrivals",
    "nothing goes before a critical job",
    "a job its team's guarantee covers is not held back",
    "an arrival due now counts for nothing: it starts by preemption",
    "an arrival due halfway through the ramp counts for half its GPUs",
    "an arrival due at the end of the ramp counts in full",
    "arrivals counted in part hold nothing back once they have ended (no rounding residue)",
]


@pytest.mark.parametrize("waiting,arrivals,ramp,start", CASES, ids=IDS)
def test_estimates_allow_for_expected_arrivals(waiting, arrivals, ramp, start):
    snap = snapshot(fleet(machines=4), running=FULL, queue=[waiting], quotas=QUOTAS, arrivals=arrivals,
                    forecast_ramp=ramp)
    result = cycle(snap)
    assert not result.placements and not result.preemptions
    assert pending(result)["q"].estimated_start == start


def test_a_job_that_waits_for_arrivals_does_not_count_its_own_end_as_a_release():
    """Behind 32 GPUs of arrivals it would otherwise start when its own walk run ends (NOW+4600)."""
    snap = snapshot(fleet(machines=4), running=FULL, queue=[_waiting()], quotas=QUOTAS,
                    arrivals=[arrival(NOW + 500, "normal", 32, 20_000)], forecast_ramp=0)
    assert pending(cycle(snap))["q"].estimated_start == NOW + 20_500


def test_a_waiting_jobs_gpus_come_back_an_expected_duration_after_its_real_start():
    """Arrivals hold three machines. q (walk start NOW+1000) really starts when all four are back
    (NOW+4000) and ends at NOW+7600; p (walk start NOW+2000) needs one machine more than the
    arrivals leave: q's, at its real end, not at its end in the walk (NOW+4600)."""
    p = job("p").gpus(8).priority("low").team("lab").expected(3600).submitted(NOW + 1)
    snap = snapshot(fleet(machines=4), running=FULL, queue=[_waiting(), p], quotas=QUOTAS,
                    arrivals=[arrival(NOW + 500, "normal", 24, 20_000)], forecast_ramp=0)
    starts = {k: p.estimated_start for k, p in pending(cycle(snap)).items()}
    assert starts == {"q": NOW + 4000, "p": NOW + 7600}


def test_estimating_only_some_jobs_gives_them_the_estimates_of_a_full_walk_with_arrivals():
    queue = [job(f"q{i}").gpus(8).priority("low").team("lab").expected(3600).submitted(NOW + i) for i in range(5)]
    snap = snapshot(fleet(machines=4), running=FULL, queue=queue, quotas=QUOTAS, forecast_ramp=0,
                    arrivals=[arrival(NOW + 500, "normal", 8, 2500), arrival(NOW + 2500, "high", 8, 4000)])
    full = pending(cycle(snap))
    for job_id in full:
        some = pending(cycle(snap.model_copy(update={"estimate_only": frozenset({job_id})})))
        assert some[job_id].estimated_start == full[job_id].estimated_start


# --- the forecast itself ---------------------------------------------------------------------------

DAY = 86400.0


def test_the_last_days_submissions_are_expected_again_a_day_later():
    log = SubmissionLog()
    for t, p in [(100.0, "low"), (5000.0, "high"), (DAY + 50, "normal"), (DAY + 200, "critical")]:
        log.add(t, Priority(p), 4, 600.0)
    got = log.expected_arrivals(DAY + 150, PolicyConfig())
    assert [(a.at, a.priority.value) for a in got] == [(DAY + 5000, "high"), (2 * DAY + 50, "normal")]


def test_a_zero_window_turns_the_forecast_off():
    log = SubmissionLog()
    log.add(10.0, Priority.high, 8, 60.0)
    assert log.expected_arrivals(20.0, PolicyConfig(forecast_window=0)) == ()


def test_the_live_loops_rows_give_the_same_forecast_in_any_order():
    rows = [(300.0, "high", 2, 60.0), (100.0, "low", 1, 30.0), (200.0, "normal", 8, 90.0)]
    got = expected_arrivals(rows, 400.0, PolicyConfig(forecast_window=1000))
    assert [(a.at, a.priority.value, a.num_gpus, a.expected_duration) for a in got] == [
        (1100.0, "low", 1, 30.0), (1200.0, "normal", 8, 90.0), (1300.0, "high", 2, 60.0)]


def test_submissions_out_of_time_order_are_refused():
    log = SubmissionLog()
    log.add(10.0, Priority.low, 1, 60.0)
    with pytest.raises(ValueError, match="time order"):
        log.add(5.0, Priority.low, 1, 60.0)


def test_a_new_forecast_window_expects_arrivals_one_new_window_later():
    """The forecast kept for the old window was reused under the new one."""
    from builders import config

    log = SubmissionLog()
    log.add(NOW - 100, "normal", 8, 3600.0)
    log.expected_arrivals(NOW, config(forecast_window=86400.0))
    [expected] = log.expected_arrivals(NOW, config(forecast_window=3600.0))
    assert expected.at == NOW - 100 + 3600.0
