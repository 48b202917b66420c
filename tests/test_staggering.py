"""Checkpoint staggering: each checkpointing job gets a phase, and jobs started together get different ones."""

from __future__ import annotations

import pytest
from builders import NOW, cycle, fleet, job, mid, placements, running, snapshot

from scheduler.staggering import WritePlan, plan_period, running_plan


def _start_all(queue, **kw):
    result = cycle(snapshot(fleet(machines=8), queue=[q.submitted(NOW) for q in queue], **kw))
    placed = placements(result)
    assert set(placed) == {q.job_id for q in queue}, result.pending
    return placed


PHASE_CASES = [
    ([job("a").checkpoint(1800)], True),
    ([job("a").checkpoint(1800)], False),
    ([job("a").checkpoint(45)], True),
    ([job("a").checkpoint(7200)], True),
    ([job("a").checkpoint(1000)], False),
    ([job(f"j{i}").checkpoint(600 * (i + 1)) for i in range(6)], True),
]
PHASE_IDS = [
    "a checkpointing job gets a phase within its interval",
    "without staggering the phase is still within the interval",
    "an interval shorter than a stagger slot still gets a phase within it",
    "an interval longer than the planning hour gets a phase within it",
    "without staggering an interval that does not divide now gets now modulo the interval",
    "jobs with different intervals each get a phase within their own interval",
]


@pytest.mark.parametrize("queue,stagger", PHASE_CASES, ids=PHASE_IDS)
def test_phase_is_within_the_interval(queue, stagger):
    placed = _start_all(queue, stagger_checkpoints=stagger)
    for q in queue:
        interval = q.spec().checkpoint_interval
        phase = placed[q.job_id].checkpoint_phase
        assert phase is not None and 0 <= phase < interval, (q.job_id, phase, interval)


@pytest.mark.parametrize("interval", [None, 0], ids=["a job with no checkpoint interval gets no phase",
                                                     "a job with a zero checkpoint interval gets no phase"])
def test_a_job_that_never_checkpoints_gets_no_phase(interval):
    placed = _start_all([job("a").checkpoint(interval)])
    assert placed["a"].checkpoint_phase is None


@pytest.mark.parametrize(
    "count,interval",
    [(2, 1800), (5, 1800), (8, 3600), (4, 600)],
    ids=[
        "two jobs started together with a 30-minute interval get different phases",
        "five jobs started together with a 30-minute interval get five different phases",
        "eight jobs started together with an hourly interval get eight different phases",
        "four jobs started together with a 10-minute interval get four different phases",
    ],
)
def test_jobs_started_together_get_different_phases(count, interval):
    queue = [job(f"j{i}").checkpoint(interval) for i in range(count)]
    placed = _start_all(queue)
    phases = [placed[q.job_id].checkpoint_phase for q in queue]
    assert len(set(phases)) == count, phases


def test_without_staggering_jobs_started_together_share_a_phase():
    queue = [job(f"j{i}").checkpoint(1800) for i in range(3)]
    placed = _start_all(queue, stagger_checkpoints=False)
    assert {placed[q.job_id].checkpoint_phase for q in queue} == {NOW % 1800}


def test_a_new_job_avoids_the_phase_of_a_running_job():
    run = [running(job("r").gpus(8).checkpoint(1800)).on(mid(0, 0, 7), range(8)).started(0).phase(0.0)]
    result = cycle(snapshot(fleet(machines=8), running=run, queue=[job("new").checkpoint(1800).submitted(NOW)]))
    phase = placements(result)["new"].checkpoint_phase
    assert phase % 1800 != 0.0


def test_a_running_job_without_a_recorded_phase_counts_at_its_start_time():
    run = [running(job("r").gpus(8).checkpoint(1800)).on(mid(0, 0, 7), range(8)).started(120)]
    result = cycle(snapshot(fleet(machines=8), running=run, queue=[job("new").checkpoint(1800).submitted(NOW)]))
    assert placements(result)["new"].checkpoint_phase not in (120.0, 120.0 + 1800)


# --- the running jobs' load, carried from one cycle to the next -----------------------------------
# Each case is a run of cycles, each naming its running jobs (the same objects from cycle to cycle,
# as the simulator and the live store pass them) and the intervals of the jobs being placed; the
# carried plan must equal one made from nothing.


def _writer(job_id, interval, phase=None, gpus=2, started=0.0):
    b = running(job(job_id).gpus(gpus).checkpoint(interval)).on(mid(0, 0, 0), range(gpus)).started(started)
    return b.phase(phase).build()


WRITERS = {
    "a": _writer("a", 1800, phase=0),
    "b": _writer("b", 1800, phase=600, gpus=4),
    "c": _writer("c", 3600, phase=120),
    "d": _writer("d", 900, started=300.0),  # no recorded phase: counts at its start
    "long": _writer("long", 14_400, phase=60),  # a longer period while it runs
    "never": running(job("never").gpus(1)).on(mid(0, 0, 1), [0]).build(),
    **{f"x{k}": _writer(f"x{k}", 1200, phase=60 * k) for k in range(4)},  # jobs that stay
}
STAYING = [f"x{k}" for k in range(4)]


def _fresh_plan(jobs, placing):
    writers = [(j.spec.checkpoint_interval, j.checkpoint_phase if j.checkpoint_phase is not None else j.started_at,
                j.spec.num_gpus) for j in jobs if j.spec.checkpoint_interval]
    plan = WritePlan(60.0, plan_period([w[0] for w in writers] + placing))
    for w in writers:
        plan.add(*w)
    return plan


CARRY_CASES = [
    ("a job that ends takes its writes out", [(["a", "b", "c"], [1800]), (["a", "c"], [1800])]),
    ("a job that starts adds its writes", [(["a"], [1800]), (["a", "b"], [900]), (["a", "b", "d"], [3600])]),
    ("a longer interval, running or being placed, plans over a longer period",
     [(["a", "b"], [1800]), (["a", "b", "long"], [1800]), (["a", "b"], [1800]), (["a"], [28_800]), (["a"], [600])]),
    ("a job that never checkpoints adds nothing", [(["a", "never"], [1800]), (["never"], [1800]), (["a"], [1800])]),
    ("a decision on one cycle's plan does not carry into the next", [(["a", "b"], [1800]), (["a", "b"], [1800])]),
]


@pytest.mark.parametrize("steps", [s for _, s in CARRY_CASES], ids=[n for n, _ in CARRY_CASES])
@pytest.mark.parametrize("others", [[], STAYING], ids=["alone", "among jobs that stay"])
def test_the_carried_running_load_equals_one_made_from_nothing(steps, others):
    for names, placing in steps:
        jobs = [WRITERS[n] for n in others + names]
        plan = running_plan("carry-test", jobs, 60.0, placing)
        fresh = _fresh_plan(jobs, placing)
        assert (plan.period, plan.load) == (fresh.period, fresh.load)
        plan.choose(placing[0], 8)  # what a cycle does with it: must not reach the next cycle's


def test_a_job_that_saves_once_in_ages_keeps_the_plan_a_day_long():
    """A trace may give one job a checkpoint interval of years: the plan stays a day of slots."""
    from scheduler.staggering import LONGEST_PERIOD, WritePlan, plan_period

    period = plan_period([1800.0, 3.0e8])
    assert period == LONGEST_PERIOD
    plan = WritePlan(60.0, period)
    assert len(plan.load) == LONGEST_PERIOD / 60.0
    assert 0 <= plan.choose(3.0e8, 8) < LONGEST_PERIOD


def test_of_phases_equally_loaded_the_lowest_is_chosen():
    assert WritePlan(60.0, 3600.0).choose(1800.0, 1) == 0.0


def test_the_phase_with_the_lowest_peak_is_chosen_not_the_lowest_total():
    plan = WritePlan(60.0, 3600.0)
    plan.load = [1.0] * 60
    plan.load[0], plan.load[30] = 2.0, 0.0  # phase 0: peak 2, total 2; phase 60: peak 1, total 2
    assert plan.choose(1800.0, 1) == 60.0


def test_a_job_that_saves_once_in_years_is_offered_only_one_periods_phases(monkeypatch):
    """Each phase of its interval was tried: 5 million for an interval of 3e8 s."""
    calls = []
    real = WritePlan._times
    monkeypatch.setattr(WritePlan, "_times", lambda self, i, p: calls.append(p) or real(self, i, p))
    WritePlan(60.0, plan_period([3.0e8])).choose(3.0e8, 8)
    assert len(calls) <= 86400 / 60


def test_a_new_checkpoint_slot_is_used_at_once():
    jobs = [running(job("a").gpus(2).checkpoint(1800)).on(mid(0, 0, 0), [0, 1]).phase(0.0).build()]
    running_plan("slot-test", jobs, 60.0, [1800.0])
    assert running_plan("slot-test", jobs, 300.0, [1800.0]).slot == 300.0
