"""The trace-driven simulator: what the engine does with a policy's decisions, checked from its output.

Small hand-made fleets (parse_fleet of inline YAML) and traces (TraceJob lists or CSV text) pin the
engine's semantics one at a time: a lone job, a preemption with and without a checkpoint, a machine
failure, FIFO and EASY ordering, checkpoint staggering. A small generated trace then checks the
invariants every run must keep whatever the policy: each job completes, no GPU is double-booked,
a job never runs twice at once nor before it was submitted, and the same inputs give the same run.
"""

from __future__ import annotations

from collections import defaultdict
from functools import lru_cache

import pytest

from scheduler.fleet import Fleet, parse_fleet
from scheduler.models import YEAR, JobSpec, PolicyConfig, Priority
from scheduler.sim import engine
from scheduler.sim.engine import SimSettings, Simulation, simulate
from scheduler.sim.records import AllocationRecord, SimResult
from scheduler.sim.report import summarize
from scheduler.sim.trace import TraceJob, parse_trace
from scheduler.sim.workloads import fleet_for, generate_trace

POLICY_NAMES = ("gpusched", "fifo", "easy")


# --- inputs ----------------------------------------------------------------------------------


def small_fleet(machines: int = 1, gpus: int = 8, quotas: str = '"*": {guaranteed: 0}') -> Fleet:
    """One cluster c1, one block b0, one rack of `machines` machines c1/b0/r0/m0, m1, …"""
    return parse_fleet(
        f"""
clusters:
  - name: c1
    blocks:
      - name: b0
        racks: 1
        machines_per_rack: {machines}
        gpus_per_machine: {gpus}
        gpu_type: H100
quotas:
  {quotas}
""",
        "fleet.yaml",
    )


def tj(job_id: str, submit: float, duration: float, *, gpus: int = 8, priority: str = "normal",
       interval: float | None = None, expected: float | None = None, team: str = "t") -> TraceJob:
    """A trace job; by default it needs a whole 8-GPU machine, estimates perfectly, never checkpoints."""
    spec = JobSpec(job_id=job_id, team=team, num_gpus=gpus, priority=Priority(priority),
                   checkpoint_interval=interval, expected_duration=expected or duration)
    return TraceJob(spec=spec, submit_time=submit, duration=duration)


def csv_trace(rows: str) -> list[TraceJob]:
    header = "job_id,submit_time,duration,num_gpus,team,priority,checkpoint_interval,expected_duration\n"
    return parse_trace(header + rows, "trace.csv")


@lru_cache(maxsize=None)
def busy_inputs() -> tuple[tuple[TraceJob, ...], Fleet]:
    """A busy day on a small fleet: 150 generated jobs offering 1.3× what 64 GPUs can do."""
    trace = generate_trace(jobs=150, days=1, gpus=64, load=1.3, seed=7)
    fleet = parse_fleet(fleet_for(trace, load=1.3, machines_per_rack=4, racks_per_block=4), "busy.yaml")
    assert fleet.total_gpus <= 128
    return tuple(trace), fleet


@lru_cache(maxsize=None)
def busy_run(policy: str, failures_per_day: float = 0.0, seed: int = 0) -> SimResult:
    trace, fleet = busy_inputs()
    return simulate(list(trace), fleet, policy,
                    SimSettings(machine_failures_per_day=failures_per_day, seed=seed))


# --- reading results -------------------------------------------------------------------------


def allocs(result: SimResult, job_id: str) -> list[AllocationRecord]:
    return sorted((a for a in result.allocations if a.job_id == job_id), key=lambda a: a.start)


def job_record(result: SimResult, job_id: str):
    [record] = [j for j in result.jobs if j.job_id == job_id]
    return record


def machine_of(allocation: AllocationRecord) -> set[str]:
    return {g.rsplit("/", 1)[0] for g in allocation.gpus}


def run_time(allocations: list[AllocationRecord]) -> float:
    return sum(a.end - a.start for a in allocations)


def gpu_overlaps(result: SimResult) -> list[str]:
    """Every place where two allocations hold one GPU at once (touching ends are fine)."""
    by_gpu: dict[str, list[tuple[float, float, str]]] = defaultdict(list)
    for a in result.allocations:
        for g in a.gpus:
            by_gpu[g].append((a.start, a.end, a.job_id))
    clashes = []
    for gpu, intervals in by_gpu.items():
        intervals.sort()
        for (s0, e0, j0), (s1, e1, j1) in zip(intervals, intervals[1:]):
            if s1 < e0:
                clashes.append(f"{gpu}: {j0} [{s0}, {e0}) and {j1} [{s1}, {e1})")
    return clashes


def check_run_invariants(result: SimResult, trace: list[TraceJob] | tuple[TraceJob, ...]) -> None:
    """What every run must keep, whatever the policy and the failures."""
    by_id = {j.spec.job_id: j for j in trace}
    not_done = [(j.job_id, j.state, j.reason) for j in result.jobs if j.state != "completed"]
    assert not not_done, f"jobs that did not complete: {not_done[:5]}"
    assert summarize(result)["double_booked_gpus"] == 0
    assert gpu_overlaps(result) == []
    for job_id, job in by_id.items():
        mine = allocs(result, job_id)
        assert mine, f"{job_id} never ran"
        assert mine[0].start >= job.submit_time, f"{job_id} started before it was submitted"
        for before, after in zip(mine, mine[1:]):
            assert after.start >= before.end, f"{job_id} ran twice at once: {before} and {after}"
        assert [a.reason for a in mine].count("completed") == 1 and mine[-1].reason == "completed"
        for a in mine:
            assert len(set(a.gpus)) == len(a.gpus) == job.spec.num_gpus, f"{job_id} held {a.gpus}"
            assert a.end >= a.start
        assert run_time(mine) >= job.duration - 1e-6, f"{job_id} completed with less running than it needs"
        assert job_record(result, job_id).finish == mine[-1].end


# --- one job at a time -------------------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICY_NAMES)
@pytest.mark.parametrize(
    "job",
    [
        tj("whole-machine", 100.0, 3600.0),
        tj("one-gpu", 0.0, 600.0, gpus=1),
        tj("checkpointing", 42.5, 7200.0, gpus=4, interval=1800.0),
    ],
    ids=["a whole-machine job", "a one-GPU job", "a checkpointing job"],
)
def test_a_job_alone_on_an_empty_cluster_runs_from_submit_to_submit_plus_duration(policy, job):
    result = simulate([job], small_fleet(machines=2), policy, SimSettings())
    [a] = result.allocations
    assert (a.job_id, a.start, a.end, a.reason, a.lost_work) == (
        job.spec.job_id, job.submit_time, job.submit_time + job.duration, "completed", 0.0)
    assert len(a.gpus) == job.spec.num_gpus and len(machine_of(a)) == 1
    record = job_record(result, job.spec.job_id)
    assert (record.state, record.first_start, record.finish, record.preemptions) == (
        "completed", job.submit_time, job.submit_time + job.duration, 0)


@pytest.mark.parametrize("policy", POLICY_NAMES)
@pytest.mark.parametrize(
    "quotas, jobs, words",
    [
        ('t: {guaranteed: 8, max: 8}', [tj("big", 0.0, 600.0, gpus=16)],
         "the job asks for 16 GPUs but team 't' may hold at most 8; ask for fewer or raise the team's max (field num_gpus)"),
        ('t: {guaranteed: 8, max: 16, queue_cap: 1}', [tj("first", 0.0, 600.0, gpus=16), tj("next", 1.0, 600.0), tj("big", 2.0, 600.0)],
         "team 't' already has 1 jobs waiting, its queue cap; wait for some to start or raise the cap (field team)"),
        ('t: {guaranteed: 8}\n  u: {guaranteed: 0, queue_cap: 0}', [tj("big", 2.0, 600.0, team="u")],
         "team 'u' has a queue cap of 0: none of its jobs may wait; raise the cap to submit (field team)"),
        ('"*": {guaranteed: 0}', [tj("big", 0.0, 600.0, gpus=32)],
         "can never start on cluster c1: needs 32 GPUs in one block; the largest block has 16 (field num_gpus)"),
    ],
    ids=["a job bigger than its team's maximum, as live admission refuses it",
         "a job over its team's queue cap",
         "a job of a team whose queue cap is 0",
         "a job no machine of the cluster can ever host"],
)
def test_a_job_refused_at_submit_is_rejected_with_its_reason_and_the_others_still_run(policy, quotas, jobs, words):
    result = simulate(jobs + [tj("other", 5000.0, 600.0, gpus=1)], small_fleet(machines=2, quotas=quotas), policy)
    big = job_record(result, "big")
    assert (big.state, big.reason, big.first_start) == ("rejected", words, None)
    assert job_record(result, "other").state == "completed"


def test_a_run_stopped_by_until_ends_its_running_allocations_and_says_which_jobs_were_not_submitted_yet():
    jobs = [tj("ran", 0.0, 600.0), tj("running", 100.0, 5000.0), tj("waiting", 200.0, 600.0, gpus=16),
            tj("later", 9000.0, 600.0)]
    result = simulate(jobs, small_fleet(machines=2), "gpusched", SimSettings(until=1000.0))
    states = {j.job_id: (j.state, j.reason) for j in result.jobs}
    assert states == {
        "ran": ("completed", ""),
        "running": ("running", "still running when the simulation ended (--until)"),
        "waiting": ("queued", "still queued when the simulation ended"),
        "later": ("queued", "not yet submitted when the simulation ended (--until)"),
    }
    [cut] = [a for a in result.allocations if a.job_id == "running"]
    assert (cut.end, cut.reason) == (1000.0, "cancelled")


# --- preemption --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "write_s",
    [30.0, 90.0, 0.0],
    ids=[
        "a checkpoint written in 30 s",
        "a checkpoint written in 90 s",
        "an instant checkpoint",
    ],
)
def test_a_critical_job_preempts_a_low_job_that_checkpoints_and_resumes_from_it(write_s):
    """Low starts at 0 on the only machine; critical arrives at 1,000 (past the minimum runtime)."""
    settings = SimSettings(checkpoint_write_s=write_s)
    trace = [tj("low", 0.0, 7200.0, priority="low", interval=1800.0), tj("crit", 1000.0, 600.0, priority="critical", team="u")]
    result = simulate(trace, small_fleet(machines=1), "gpusched", settings)

    low = allocs(result, "low")
    first = low[0]
    assert (first.reason, first.start, first.end, first.lost_work) == ("preempted", 0.0, 1000.0 + write_s, 0.0)
    assert low[-1].reason == "completed" and len(low) == 2
    assert low[1].start >= first.end  # requeued, started again later
    # It resumed from the checkpoint: its running, less the time spent writing it, is its work.
    assert run_time(low) - write_s == pytest.approx(7200.0)

    record = job_record(result, "low")
    assert (record.state, record.preemptions, record.preemption_times, record.lost_work) == (
        "completed", 1, (1000.0,), 0.0)

    [crit] = allocs(result, "crit")
    assert crit.reason == "completed"
    assert crit.start == first.end, "the critical job should start as soon as its victim released the GPUs"
    assert crit.start - 1000.0 <= settings.policy.grace_period
    assert set(crit.gpus) == set(first.gpus)


@pytest.mark.parametrize("restart_s", [0.0, 300.0], ids=["no restart time", "five minutes to start again"])
def test_a_resumed_job_spends_its_restart_time_before_it_progresses_and_the_summary_counts_it(restart_s):
    """Low is preempted at 1,000 and checkpoints all it has done; its second attempt needs the
    rest of its work plus the restart; its first attempt, a fresh start, pays none."""
    settings = SimSettings(restart_s=restart_s)
    trace = [tj("low", 0.0, 7200.0, priority="low", interval=1800.0), tj("crit", 1000.0, 600.0, priority="critical", team="u")]
    result = simulate(trace, small_fleet(machines=1), "gpusched", settings)

    first, second = allocs(result, "low")
    assert first.restart_work == 0.0 and first.lost_work == 0.0
    assert second.end - second.start == pytest.approx(7200.0 - 1000.0 + restart_s)
    assert second.restart_work == pytest.approx(restart_s * 8)
    summary = summarize(result)
    assert summary["restart_overhead_gpu_hours"] == pytest.approx(restart_s * 8 / 3600.0)
    assert summary["work_lost_fraction"] == 0.0


@pytest.mark.parametrize("settings, expected", [
    (SimSettings(restart_s=300.0, learn_restart=True), 300.0),
    (SimSettings(restart_s=300.0), 0.0),
    (SimSettings(restart_s=300.0, policy=PolicyConfig(expected_restart_s=60.0)), 60.0),
    (SimSettings(learn_restart=True), 0.0),
], ids=[
    "learning, the scheduler expects the restart time it has seen",
    "not learning, it expects what it was told: none",
    "not learning, it keeps what it was told",
    "learning without restart times there is nothing to learn",
])
def test_the_scheduler_learns_how_long_restarts_take_from_the_first_one(settings, expected):
    trace = [tj("low", 0.0, 7200.0, priority="low", interval=1800.0), tj("crit", 1000.0, 600.0, priority="critical", team="u")]
    sim = Simulation(trace, small_fleet(machines=1), "gpusched", settings)
    sim.run()
    assert sim.policy.expected_restart_s == expected


def test_a_job_preempted_while_it_restarts_loses_nothing_and_pays_the_restart_again():
    """Low resumes at 1,630 (grace and crit1's 600 s) and spends 600 s starting again; crit2
    displaces it at 1,700, before it has done anything more: its saved work is what it had."""
    settings = SimSettings(restart_s=600.0, policy=PolicyConfig(min_runtime=0))
    trace = [tj("low", 0.0, 7200.0, priority="low", interval=1800.0),
             tj("crit1", 1000.0, 600.0, priority="critical"), tj("crit2", 1700.0, 600.0, priority="critical")]
    result = simulate(trace, small_fleet(machines=1), "gpusched", settings)

    first, second, third = allocs(result, "low")
    assert second.reason == "preempted" and second.start < 1700.0 < second.end
    assert second.lost_work == 0.0
    assert second.restart_work == pytest.approx((second.end - second.start) * 8)  # all of it restarting
    assert third.end - third.start == pytest.approx(7200.0 - 1000.0 + 600.0)
    # Nothing written while it restarts (before, a whole checkpoint at 1,700 with nothing new in it).
    writes = [w.time for w in result.checkpoint_writes if w.job_id == "low"]
    assert not [t for t in writes if second.start <= t <= second.end or third.start <= t < third.start + 600.0]
    check_run_invariants(result, trace)


def test_the_scheduler_learns_the_restart_time_from_the_first_attempt_that_has_its_state_back():
    """Low's second attempt is preempted before its restart is over: the live loop hears no
    restart time from it. Before, the simulator learned it from that attempt all the same."""
    settings = SimSettings(restart_s=600.0, learn_restart=True, policy=PolicyConfig(min_runtime=0))
    trace = [tj("low", 0.0, 7200.0, priority="low", interval=1800.0),
             tj("crit1", 1000.0, 600.0, priority="critical"), tj("crit2", 1700.0, 600.0, priority="critical")]
    sim = Simulation(trace, small_fleet(machines=1), "gpusched", settings)
    _, second, third = allocs(sim.run(), "low")
    assert second.end < second.start + 600.0
    assert sim.restart_seen_at == third.start + 600.0


def test_reclaim_latency_counts_the_jobs_a_guarantee_covers_not_the_teams_backlog_beyond_it():
    """Team b borrows both machines from 0; team a (guarantee 8) submits two whole-machine jobs at
    1,000. a1 is a reclaim: it preempts b's newest job and starts after the grace. a2 is beyond
    a's guarantee once a1 is counted: it waits for b's other job to end, and is not a reclaim."""
    fleet = small_fleet(machines=2, quotas="a: {guaranteed: 8}\n  b: {guaranteed: 0}")
    trace = [tj("b1", 0.0, 5000.0, team="b", interval=600.0), tj("b2", 10.0, 5000.0, team="b", interval=600.0),
             tj("a1", 1000.0, 600.0, team="a"), tj("a2", 1001.0, 600.0, team="a")]
    result = simulate(trace, fleet, "gpusched")
    a1, a2 = job_record(result, "a1"), job_record(result, "a2")
    assert a1.first_start - 1000.0 <= PolicyConfig().grace_period + 1.0
    assert a2.first_start >= a1.first_start + 600.0  # when a1 ended: no second reclaim
    assert a1.under_guarantee_at_submit and a2.under_guarantee_at_submit
    assert result.reclaim_latencies == [a1.first_start - 1000.0]
    assert summarize(result)["wait_under_guarantee_s"]["count"] == 2


def test_a_checkpoint_that_cannot_finish_within_the_grace_loses_the_work_since_the_last_interval_checkpoint():
    policy = PolicyConfig(stagger_checkpoints=False)  # checkpoints at start + k × 600: 600, 1200, …
    settings = SimSettings(checkpoint_write_s=policy.grace_period + 80.0, policy=policy)
    trace = [tj("low", 0.0, 7200.0, priority="low", interval=600.0), tj("crit", 1000.0, 600.0, priority="critical", team="u")]
    result = simulate(trace, small_fleet(machines=1), "gpusched", settings)
    first, second = allocs(result, "low")
    assert (first.reason, first.end) == ("preempted", 1000.0 + policy.grace_period)
    assert first.lost_work == pytest.approx((1000.0 - 600.0) * 8)
    assert second.reason == "completed"
    assert second.end - second.start == pytest.approx(7200.0 - 600.0)


@pytest.mark.parametrize("exit_s", [5.0, 0.0], ids=["it exits 5 s after SIGTERM", "it exits at once"])
def test_a_preempted_job_that_never_checkpoints_loses_all_its_progress_and_runs_its_full_duration_again(exit_s):
    settings = SimSettings(sigterm_exit_s=exit_s, policy=PolicyConfig(min_runtime=0, max_unsaved_run=YEAR))
    trace = [tj("low", 0.0, 7200.0, priority="low"), tj("crit", 1000.0, 600.0, priority="critical", team="u")]
    result = simulate(trace, small_fleet(machines=1), "gpusched", settings)

    first, second = allocs(result, "low")
    assert (first.reason, first.start, first.end) == ("preempted", 0.0, 1000.0 + exit_s)
    progress = 1000.0  # it had run this long when told to stop; all of it is gone
    assert first.lost_work == pytest.approx(progress * 8)
    assert second.reason == "completed"
    assert second.end - second.start == pytest.approx(7200.0), "it restarted from scratch"
    assert run_time([first, second]) >= 7200.0 + progress
    record = job_record(result, "low")
    assert (record.preemptions, record.lost_work) == (1, pytest.approx(progress * 8))
    [crit] = allocs(result, "crit")
    assert crit.start == first.end, "the critical job should start as soon as its victim left"


# --- machine failure -------------------------------------------------------------------------


def _job_on_a_machine_that_fails(policy: str, repaired_after: float | None):
    """Job a (8 GPUs, checkpoints every 1,800 s) starts at 100 on one of two machines; that
    machine dies at 4,000 and, if `repaired_after` is set, comes back that long after."""
    trace = [tj("a", 100.0, 7200.0, interval=1800.0)]
    settings = SimSettings(policy=PolicyConfig(stagger_checkpoints=False))
    fleet = small_fleet(machines=2)
    [dry] = simulate(trace, fleet, policy, settings).allocations  # where it runs: the same again
    [machine] = machine_of(dry)
    sim = Simulation(trace, fleet, policy, settings)
    sim.push(4000.0, engine.MACHINE_DOWN, ("c1", machine, 0))
    if repaired_after is not None:
        sim.push(4000.0 + repaired_after, engine.MACHINE_UP, ("c1", machine, 0))
    return sim.run(), machine


@pytest.mark.parametrize("policy", POLICY_NAMES)
@pytest.mark.parametrize("repaired_after", [1800.0, None], ids=["repaired after 30 min", "never repaired"])
def test_a_job_on_a_failed_machine_loses_the_work_since_its_last_checkpoint_and_moves(policy, repaired_after):
    result, dead = _job_on_a_machine_that_fails(policy, repaired_after)
    record = job_record(result, "a")
    assert record.state == "completed", f"job a was lost: {record.state} ({record.reason})"
    first, second = allocs(result, "a")
    # Stagger off: the phase is start-relative, so checkpoints fell at 1,900 and 3,700.
    assert Simulation.checkpoint_after(3800.0, 100.0, 1800.0, first.checkpoint_phase) == 5500.0
    assert (first.reason, first.start, first.end) == ("machine_failure", 100.0, 4000.0)
    assert first.lost_work == pytest.approx((4000.0 - 3700.0) * 8)
    assert record.lost_work == pytest.approx((4000.0 - 3700.0) * 8)
    assert record.preemptions == 0
    assert second.reason == "completed"
    assert machine_of(second) != {dead}, "it should move to the healthy machine, not wait for the dead one"
    assert second.start - 4000.0 <= 10.0, "the other machine was free: it should restart at once"
    assert second.end - second.start == pytest.approx(7200.0 - 3600.0), "it resumed from the 3,700 checkpoint"


def test_a_machine_that_fails_while_a_checkpoint_is_still_being_written_loses_the_work_since_the_one_before():
    """The checkpoint begun at 3,700 is written by 3,730: a death at 3,710 resumes from 1,900."""
    trace = [tj("a", 100.0, 7200.0, interval=1800.0)]
    settings = SimSettings(policy=PolicyConfig(stagger_checkpoints=False))
    fleet = small_fleet(machines=2)
    [machine] = machine_of(simulate(trace, fleet, "gpusched", settings).allocations[0])
    sim = Simulation(trace, fleet, "gpusched", settings)
    sim.push(3710.0, engine.MACHINE_DOWN, ("c1", machine, 0))
    first = allocs(sim.run(), "a")[0]
    assert first.lost_work == pytest.approx((3710.0 - 1900.0) * 8)


def test_easy_backfills_a_resuming_job_only_where_its_restart_too_ends_before_the_reservation():
    """Every estimate exact: H (16 GPUs) holds both machines from 1,000; R, backfilled on m1 at
    20, loses m1 at 660 with 300 s of work left, and each restart takes 600 s. Before, EASY left
    the restart out: R came back at 670 "to end at 970", ended at 1,570, and H started then."""
    settings = SimSettings(restart_s=600.0, policy=PolicyConfig(expected_restart_s=600.0))
    trace = [tj("A", 0.0, 1000.0), tj("H", 10.0, 1000.0, gpus=16), tj("R", 20.0, 900.0, interval=100.0)]
    fleet = small_fleet(machines=2)
    [machine] = machine_of(allocs(simulate(trace, fleet, "easy", settings), "R")[0])
    sim = Simulation(trace, fleet, "easy", settings)
    sim.push(660.0, engine.MACHINE_DOWN, ("c1", machine, 0))
    sim.push(670.0, engine.MACHINE_UP, ("c1", machine, 0))
    result = sim.run()
    assert allocs(result, "R")[0].end == 660.0
    assert job_record(result, "H").first_start == 1000.0


def test_the_core_is_told_a_draining_job_leaves_when_its_grace_ends_as_the_live_store_tells_it():
    """The live store writes the order's time plus the grace (ORDER_PREEMPTION); the simulator told
    the core when the job would really be done (its checkpoint written, 30 s), which no live cycle
    knows, and its estimates and reservations were the better for it."""
    trace = [tj("A", 0.0, 10000.0, priority="low", interval=600.0), tj("B", 1000.0, 3000.0, priority="high", team="u"),
             tj("C", 1010.0, 3000.0, priority="high", team="u")]
    sim = Simulation(trace, small_fleet(machines=1), "gpusched", SimSettings())
    told, real = [], sim.cycle

    def watching(snapshot):
        told.extend(r.draining_until for r in snapshot.running if r.spec.job_id == "A" and r.draining_until is not None)
        return real(snapshot)

    sim.cycle = watching
    result = sim.run()
    assert told and set(told) == {1000.0 + SimSettings().policy.grace_period}
    assert allocs(result, "A")[0].end == 1000.0 + SimSettings().checkpoint_write_s  # it leaves when it is done


@pytest.mark.parametrize("start, phase", [(500.0, 60.0), (0.0, None), (1000.0, 990.0), (1000.0, 1000.0),
                                          (1299.0, 0.0), (1301.0, 0.0)])
def test_an_attempts_first_interval_checkpoint_is_the_one_jobkit_takes(start, phase, tmp_path):
    """jobkit saves first at the grid time at least half an interval after its start; the
    simulator took the first grid time after it, and so counted saves no job makes (426 of 1,467
    on a one-day trace with failures), and less work lost."""
    from jobkit import Checkpointer

    ck = Checkpointer(f"{tmp_path}/", interval=600.0, phase=phase, clock=lambda: start, allocation_id="a",
                      attempt="1", job_id="j")
    assert Simulation.first_checkpoint(start, 600.0, phase) == ck.next_due()


def test_thrash_protection_counts_a_preemption_from_when_its_attempt_ended_as_the_live_store_does():
    """REQUEUE_JOB appends the time the preempted attempt ended; the simulator appended the time of
    the order, so its hour of protection ended up to a grace period sooner."""
    trace = [tj("low", 0.0, 7200.0, priority="low", interval=1800.0), tj("crit", 1000.0, 600.0, priority="critical", team="u")]
    sim = Simulation(trace, small_fleet(machines=1), "gpusched", SimSettings(checkpoint_write_s=90.0))
    counted, real = [], sim.cycle

    def watching(snapshot):
        counted.extend(q.preemptions for q in snapshot.queue if q.spec.job_id == "low")
        return real(snapshot)

    sim.cycle = watching
    result = sim.run()
    assert counted[0] == () and set(counted[1:]) == {(1090.0,)}  # queued first at submit, then when requeued
    assert job_record(result, "low").preemption_times == (1000.0,)  # the report counts the order


def test_a_machine_that_fails_during_a_preemptions_grace_loses_the_work_since_the_last_finished_checkpoint():
    """Low checkpoints at 1,800; critical preempts it at 2,500, and its machine dies at 2,510,
    before the grace's checkpoint is written. Low stopped working at 2,500: it loses 700 s."""
    trace = [tj("low", 0.0, 7200.0, priority="low", interval=1800.0), tj("crit", 2500.0, 600.0, priority="critical")]
    sim = Simulation(trace, small_fleet(machines=1), "gpusched",
                     SimSettings(policy=PolicyConfig(stagger_checkpoints=False)))
    sim.push(2510.0, engine.MACHINE_DOWN, ("c1", "c1/b0/r0/m0", 0))
    sim.push(4000.0, engine.MACHINE_UP, ("c1", "c1/b0/r0/m0", 0))
    result = sim.run()
    first = allocs(result, "low")[0]
    assert (first.reason, first.end) == ("machine_failure", 2510.0)
    assert first.lost_work == pytest.approx((2500.0 - 1800.0) * 8)
    assert job_record(result, "low").preemptions == 1
    summary = summarize(result)
    assert (summary["preemptions"], summary["preempted_allocations"]) == (1, 0)


def test_a_machine_that_failed_twice_comes_back_only_once_both_failures_are_repaired():
    trace = [tj("a", 100.0, 7200.0, interval=1800.0)]
    sim = Simulation(trace, small_fleet(machines=1), "gpusched", SimSettings())
    for down, up in ((1000.0, 2800.0), (2000.0, 3800.0)):
        sim.push(down, engine.MACHINE_DOWN, ("c1", "c1/b0/r0/m0", 0))
        sim.push(up, engine.MACHINE_UP, ("c1", "c1/b0/r0/m0", 0))
    first, second = allocs(sim.run(), "a")
    assert (first.end, second.start) == (1000.0, 3800.0)


@pytest.mark.parametrize("until, span", [(None, 1000.0), (50.0, 0.0), (1e8, 1000.0)],
                         ids=["a repair after the last job does not stretch the run",
                              "a run cut before the first submission spans nothing, not a negative time",
                              "an --until after the last job's event ends the run no later than without one"])
def test_the_run_spans_from_the_first_submission_to_the_last_job_event(until, span):
    sim = Simulation([tj("a", 100.0, 1000.0)], small_fleet(machines=1), "gpusched", SimSettings(until=until))
    sim.push(1500.0, engine.GPU_DOWN, ("c1", "c1/b0/r0/m0", 3))
    sim.push(2300.0, engine.GPU_UP, ("c1", "c1/b0/r0/m0", 3))
    summary = summarize(sim.run())
    assert summary["end"] - summary["start"] == span
    if until != 50.0:
        assert summary["utilisation"] == pytest.approx(1.0)


def test_a_run_stopped_by_until_in_a_preemptions_grace_counts_the_preemption_and_its_lost_work():
    """`low` never checkpoints; `crit` displaces it at 1000 s and it exits 5 s later: cut at 1002 s,
    its allocation still ends as preempted, with the 1,000 s of work it loses (it was closed as
    cancelled, losing nothing)."""
    trace = [tj("low", 0.0, 5000.0, priority="low"), tj("crit", 1000.0, 600.0, priority="critical", team="u")]
    settings = SimSettings(until=1002.0, policy=PolicyConfig(min_runtime=0, max_unsaved_run=YEAR))
    result = simulate(trace, small_fleet(machines=1), "gpusched", settings)
    [cut] = allocs(result, "low")
    assert (cut.end, cut.reason, cut.lost_work) == (1002.0, "preempted", 8 * 1000.0)
    summary = summarize(result)
    assert (summary["preemptions"], summary["preempted_allocations"]) == (1, 1)


def test_the_queue_cap_counts_a_teams_waiting_jobs_in_every_cluster():
    """Two one-machine clusters, both full; a queue cap of 1 lets one job of the team wait, in
    either cluster: the second is refused (each cluster counted only its own queue)."""
    fleet = parse_fleet("""
clusters:
  - name: c1
    blocks: [{name: b0, racks: 1, machines_per_rack: 1, gpus_per_machine: 8, gpu_type: H100}]
  - name: c2
    blocks: [{name: b0, racks: 1, machines_per_rack: 1, gpus_per_machine: 8, gpu_type: H100}]
quotas:
  t: {guaranteed: 0, queue_cap: 1}
""", "fleet.yaml")
    trace = [tj("r1", 0.0, 5000.0), tj("r2", 1.0, 5000.0), tj("w1", 10.0, 600.0), tj("w2", 20.0, 600.0)]
    result = simulate(trace, fleet, "gpusched")
    states = {j.job_id: j.state for j in result.jobs}
    assert states == {"r1": "completed", "r2": "completed", "w1": "completed", "w2": "rejected"}


# --- thrash protection and invariants on a busy trace ---------------------------------------------


def test_no_job_is_preempted_more_than_twice_in_any_hour_on_a_busy_trace():
    result = busy_run("gpusched")
    summary = summarize(result)
    assert summary["preemptions"] > 0, "the trace should be busy enough to preempt"
    assert summary["max_preemptions_per_job_in_any_hour"] <= 2
    for job in result.jobs:  # and the same, checked from the record itself
        times = sorted(job.preemption_times)
        for i in range(len(times) - 2):
            assert times[i + 2] - times[i] > 3600.0, f"{job.job_id} preempted 3 times in an hour: {times}"


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_every_policy_completes_every_job_without_double_booking_on_a_busy_trace(policy):
    trace, _ = busy_inputs()
    check_run_invariants(busy_run(policy), trace)


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_injected_machine_failures_requeue_jobs_and_keep_every_invariant(policy):
    trace, _ = busy_inputs()
    result = busy_run(policy, failures_per_day=1.0, seed=3)
    failed = [a for a in result.allocations if a.reason == "machine_failure"]
    assert failed, "failure injection should hit some running job"
    check_run_invariants(result, trace)
    assert summarize(result)["work_lost_gpu_hours"]["machine_failure"] > 0


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_a_failed_gpu_that_a_draining_job_still_holds_counts_as_in_service(policy):
    # Busy GPUs above the healthy ones made utilisation exceed 1 for a moment after a GPU failed.
    trace, fleet = busy_inputs()
    result = simulate(list(trace), fleet, policy,
                      SimSettings(gpu_failures_per_day=2.0, machine_failures_per_day=0.5, seed=3))
    assert any(a.reason == "machine_failure" for a in result.allocations)
    assert all(s.busy_gpus <= s.healthy_gpus for s in result.samples)
    assert summarize(result)["utilisation"] <= 1.0


@pytest.mark.parametrize(
    "policy, failures_per_day",
    [("gpusched", 0.0), ("gpusched", 1.0), ("fifo", 1.0), ("easy", 1.0)],
    ids=["gpusched", "gpusched with failures", "fifo with failures", "easy with failures"],
)
def test_the_same_inputs_give_the_same_run_twice(policy, failures_per_day):
    trace, fleet = busy_inputs()
    settings = SimSettings(machine_failures_per_day=failures_per_day, seed=11)
    one = simulate(list(trace), fleet, policy, settings)
    two = simulate(list(trace), fleet, policy, settings)
    assert one.allocations == two.allocations
    assert one.jobs == two.jobs
    assert one.checkpoint_writes == two.checkpoint_writes


def test_a_different_failure_seed_gives_different_failures():
    trace, fleet = busy_inputs()
    runs = [simulate(list(trace), fleet, "fifo", SimSettings(machine_failures_per_day=1.0, seed=s)) for s in (1, 2)]
    failed = [[(a.job_id, a.end) for a in r.allocations if a.reason == "machine_failure"] for r in runs]
    assert failed[0] != failed[1]


def test_injected_gpu_failures_hit_each_gpu_at_the_same_rate_on_a_mixed_fleet():
    # One 8-GPU machine and eight 1-GPU machines: half the GPUs each. Drawn machine by machine,
    # the small ones would take 8 of every 9 failures.
    fleet = parse_fleet(
        """
clusters:
  - name: c1
    blocks:
      - {name: big, racks: 1, machines_per_rack: 1, gpus_per_machine: 8, gpu_type: H100}
      - {name: small, racks: 1, machines_per_rack: 8, gpus_per_machine: 1, gpu_type: H100}
quotas:
  "*": {guaranteed: 0}
""",
        "mixed.yaml",
    )
    trace = [tj("long", 0.0, 30 * 86400.0, gpus=1)]
    sim = Simulation(trace, fleet, "fifo", SimSettings(gpu_failures_per_day=2.0, seed=5))
    hits = [payload[1] for _, kind, _, payload in sim.events if kind == engine.GPU_DOWN]
    on_big = sum(1 for machine in hits if machine.startswith("c1/big/"))
    assert len(hits) > 400
    assert 0.4 < on_big / len(hits) < 0.6


# --- FIFO and EASY ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "rows",
    [
        "j1,0,1000,8,t,low,,\nj2,10,500,8,t,critical,,\nj3,20,300,8,t,high,,\nj4,30,200,8,t,normal,,\n",
        "j1,0,100,8,t,normal,,\nj2,500,900,8,t,low,,\nj3,510,50,8,t,critical,,\nj4,520,50,8,t,critical,,\n",
        "b,0,300,8,t,normal,,5000\na,0,300,8,t,normal,,10\nc,1,300,8,t,high,,10\n",
    ],
    ids=[
        "later jobs of higher classes wait their turn",
        "a gap in arrivals, then short critical jobs behind a long low one",
        "equal submit times go by job id",
    ],
)
def test_fifo_starts_whole_machine_jobs_in_strict_submit_order(rows):
    trace = csv_trace(rows)
    result = simulate(trace, small_fleet(machines=1), "fifo", SimSettings())
    check_run_invariants(result, trace)
    order = [j.spec.job_id for j in sorted(trace, key=lambda j: (j.submit_time, j.spec.job_id))]
    starts = {j.job_id: j.first_start for j in result.jobs}
    assert sorted(order, key=lambda i: starts[i]) == order
    # One machine, one job at a time: each starts when the one before it finished (or on arrival).
    by_id = {j.spec.job_id: j for j in trace}
    for before, after in zip(order, order[1:]):
        expected = max(by_id[after].submit_time, starts[before] + by_id[before].duration)
        assert starts[after] == expected


@pytest.mark.parametrize("policy, estimates", [("gpusched", True), ("fifo", False), ("easy", False)],
                         ids=["gpusched tells a job that starts at once that it starts now",
                              "fifo estimates nothing, even for a job that starts at once",
                              "easy estimates nothing, even for a job that starts at once"])
def test_only_a_policy_that_estimates_has_predicted_starts(policy, estimates):
    trace = csv_trace("first,0,1000,8,t,normal,,1000\nsecond,10,100,8,t,normal,,100\n")
    result = simulate(trace, small_fleet(machines=1), policy, SimSettings())
    predicted = {j.job_id: j.predicted_start for j in result.jobs}
    assert (predicted["first"] == 0) is estimates and (predicted["first"] is None) is not estimates
    assert (predicted["second"] is not None) is estimates  # it waited: gpusched's walk, nobody else's


# A 4-GPU job holds half the machine until 1,000; the whole-machine job `big` (submitted at 10) is
# blocked and reserved for 1,000; then a 2-GPU job arrives at 20 that would fit now.
EASY_BASE = "first,0,1000,4,t,normal,,1000\nbig,10,1000,8,t,normal,,1000\n"


@pytest.mark.parametrize(
    "small_row, backfills",
    [
        ("small,20,500,2,t,normal,,500\n", True),
        ("small,20,980,2,t,normal,,980\n", True),
        ("small,20,981,2,t,normal,,981\n", False),
        ("small,20,5000,2,t,normal,,5000\n", False),
    ],
    ids=[
        "a short job that ends long before the reservation backfills",
        "a job that ends exactly at the reservation backfills",
        "a job that would end a second after the reservation waits",
        "a long job waits for the big one",
    ],
)
def test_easy_backfills_a_small_job_only_when_it_ends_before_the_blocked_jobs_reserved_start(small_row, backfills):
    trace = csv_trace(EASY_BASE + small_row)
    result = simulate(trace, small_fleet(machines=1), "easy", SimSettings())
    check_run_invariants(result, trace)
    starts = {j.job_id: j.first_start for j in result.jobs}
    assert starts["first"] == 0.0
    assert starts["big"] == 1000.0, "the reserved job must not be delayed by a backfill"
    if backfills:
        assert starts["small"] == 20.0
    else:
        assert starts["small"] >= 2000.0, "it may not run on the reserved machine before the big job"
    fifo = simulate(trace, small_fleet(machines=1), "fifo", SimSettings())
    assert job_record(fifo, "small").first_start >= 2000.0, "strict FIFO never starts it ahead of big"


def test_easy_reserves_for_the_first_blocked_job_counting_the_jobs_started_ahead_of_it_in_the_same_cycle():
    """All three arrive together: A starts, B (both machines) is blocked and reserves where A's
    end frees room, so C, which would hold a machine past it, may not backfill."""
    trace = csv_trace("a,0,100,8,t,normal,,100\nb,0,100,16,t,normal,,100\nc,0,10000,8,t,normal,,10000\n")
    result = simulate(trace, small_fleet(machines=2), "easy", SimSettings())
    check_run_invariants(result, trace)
    starts = {j.job_id: j.first_start for j in result.jobs}
    assert (starts["a"], starts["b"]) == (0.0, 100.0), starts
    assert starts["c"] >= 200.0, starts


# --- checkpoint staggering -----------------------------------------------------------------------


def test_staggering_spreads_the_checkpoint_writes_of_jobs_that_start_together():
    trace = [tj(f"j{i:02d}", 0.0, 4 * 3600.0, gpus=1, interval=1800.0) for i in range(32)]
    fleet = small_fleet(machines=4)
    peak = {}
    for stagger in (True, False):
        settings = SimSettings(policy=PolicyConfig(stagger_checkpoints=stagger))
        result = simulate(trace, fleet, "gpusched", settings)
        check_run_invariants(result, trace)
        writes = summarize(result)["checkpoint_write"]
        assert writes["writes"] >= 32 * 7  # every 1,800 s of each job's 4 h, whatever its phase
        peak[stagger] = writes["peak_to_mean"]
    assert peak[True] < peak[False]
    assert peak[True] * 5 < peak[False], f"staggering should flatten the burst a lot: {peak}"
