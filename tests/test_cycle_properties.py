"""Properties of every cycle, on random clusters, running jobs, queues, quotas and configs.

Each example runs two cycles: the random snapshot, then the snapshot the live loop would build
from its result (placements started, preemption victims gone or draining, earmarks passed back),
so that the earmark path is exercised too. Every invariant is checked on both.
"""

from __future__ import annotations

import math

from builders import after_preemption, cycle, examples
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from scheduler.models import (
    ExpectedArrival,
    INFERENCE_PARTITION,
    CycleResult,
    JobKind,
    JobSpec,
    Machine,
    PolicyConfig,
    Priority,
    QueuedJob,
    Quota,
    RunningJob,
    Snapshot,
    Topology,
)

NOW = 100_000.0
TEAMS = ["a", "b", "c", "d"]
PRIORITIES = list(Priority)
MIN_RUN = 60.0  # a queued job's remaining work is at least this (eta.MIN_RUN)


# --- strategies ----------------------------------------------------------------------------------
# Plain integer draws and one model per job: much faster to generate and to shrink than st.builds.

RUNNING_PRIORITIES = [Priority.low, Priority.low, Priority.normal, Priority.normal, Priority.high, Priority.critical]
QUEUED_PRIORITIES = [Priority.critical, Priority.high, Priority.high, Priority.normal, Priority.low]
TOPOLOGIES = [None, None, Topology.machine, Topology.block, Topology.any]
INTERVALS = [None, 0.0, 300.0, 1800.0, 3600.0, 7200.0]
KINDS = [JobKind.training, JobKind.training, JobKind.inference]


@st.composite
def fleets(draw) -> list[Machine]:
    """1-3 blocks of 1-3 racks of 1-4 machines of 4 or 8 GPUs; some unreachable, some taking no
    work, some drained, some sick GPUs."""
    machines = []
    for b in range(draw(st.integers(1, 3))):
        racks = draw(st.integers(1, 3))
        per_rack = draw(st.integers(1, 4))
        gpus = draw(st.sampled_from([4, 8]))
        partition = draw(st.sampled_from(["training", "training", "training", INFERENCE_PARTITION]))
        for r in range(racks):
            for m in range(per_rack):
                reachable = draw(st.integers(0, 9)) > 0
                takes_work = draw(st.integers(0, 9)) > 0
                drain = draw(st.integers(0, 11)) == 0  # an operator drains it (the store says no work too, or not)
                sick = frozenset()
                if draw(st.integers(0, 5)) == 0:
                    sick = frozenset(draw(st.lists(st.integers(0, gpus - 1), min_size=1, max_size=2)))
                machines.append(Machine(id=f"c1/b{b}/r{r}/m{m}", cluster="c1", block=f"b{b}", rack=f"r{r}", gpus=gpus,
                                        gpu_type="H100", partition=partition, reachable=reachable, unhealthy_gpus=sick,
                                        takes_work=takes_work, drain=drain))
    return machines


def draw_spec(draw, job_id: str, num_gpus: int, priorities) -> JobSpec:
    deadline = draw(st.integers(-1, 50_000))
    return JobSpec(
        job_id=job_id,
        team=draw(st.sampled_from(TEAMS)),
        num_gpus=num_gpus,
        topology=draw(st.sampled_from(TOPOLOGIES)),
        priority=draw(st.sampled_from(priorities)),
        deadline=None if deadline < 0 else NOW - 1000 + deadline,
        checkpoint_interval=draw(st.sampled_from(INTERVALS)),
        expected_duration=float(draw(st.integers(30, 50_000))),
        kind=draw(st.sampled_from(KINDS)),
    )


@st.composite
def running_jobs(draw, machines: list[Machine]) -> list[RunningJob]:
    """Jobs placed consistently: every GPU held by at most one job (health may change later).
    Machines are mostly full, so that preemption, reservation and backfill come into play."""
    chunks: list[list[tuple[str, int]]] = []
    for m in machines:
        used = draw(st.sampled_from([0, m.gpus // 2, m.gpus, m.gpus, m.gpus]))
        offset = draw(st.integers(0, m.gpus - 1))
        order = [(offset + i) % m.gpus for i in range(used)]
        while order:
            k = draw(st.integers(1, len(order)))
            chunks.append([(m.id, g) for g in sorted(order[:k])])
            order = order[k:]
    gangs: list[list[tuple[str, int]]] = []
    for chunk in chunks:
        if gangs and gangs[-1][0][0] != chunk[0][0] and draw(st.integers(0, 4)) == 0:
            gangs[-1] = gangs[-1] + chunk  # a gang across two machines
        else:
            gangs.append(chunk)
    out = []
    for k, gpus in enumerate(gangs):
        spec = draw_spec(draw, f"r{k}", len(gpus), RUNNING_PRIORITIES)
        started = NOW - draw(st.integers(0, 20_000))
        preemptions = tuple(sorted(NOW - t for t in draw(st.lists(st.integers(0, 7200), max_size=3))))
        ckpt = draw(st.integers(-1, int(NOW - started)))
        draining = draw(st.integers(0, 7)) == 0
        out.append(RunningJob(
            spec=spec, submit_time=started - 10, gpus=tuple(gpus), started_at=started,
            progress_at_start=float(draw(st.integers(0, 5000))),
            last_checkpoint_at=None if ckpt < 0 else started + ckpt,
            preemptions=preemptions,
            checkpoint_phase=draw(st.sampled_from([None, 0.0, 60.0, 300.0, 900.0])),
            draining_until=NOW + draw(st.integers(-100, 300)) if draining else None,
            preempted_for=draw(st.sampled_from([None, "q0", "q1"])) if draining else None,
        ))
    return out


@st.composite
def queues(draw) -> list[QueuedJob]:
    out = []
    for k in range(draw(st.integers(0, 10))):
        n = draw(st.one_of(st.integers(1, 8), st.integers(1, 64)))
        spec = draw_spec(draw, f"q{k}", n, QUEUED_PRIORITIES)
        submit = NOW - draw(st.integers(0, 6000))
        since = submit + draw(st.integers(0, int(NOW - submit)))
        out.append(QueuedJob(spec=spec, submit_time=submit, queued_since=since,
                             progress=float(draw(st.integers(0, 2000))),
                             preemptions=(since,) if since > submit and draw(st.booleans()) else ()))
    return out


@st.composite
def quota_maps(draw) -> dict[str, Quota]:
    quotas = {}
    for team in TEAMS:
        if draw(st.integers(0, 3)) == 0:
            continue
        guaranteed = draw(st.integers(0, 32))
        maximum = draw(st.one_of(st.none(), st.integers(guaranteed, guaranteed + 48)))
        quotas[team] = Quota(guaranteed=guaranteed, max=maximum)
    return quotas


configs = st.builds(
    PolicyConfig,
    grace_period=st.sampled_from([0.0, 60.0, 120.0, 300.0]),
    min_runtime=st.sampled_from([0.0, 300.0, 600.0, 1200.0]),
    thrash_window=st.sampled_from([600.0, 3600.0, 7200.0]),
    thrash_max_preemptions=st.integers(1, 3),
    starvation_threshold=st.sampled_from([0.0, 600.0, 1800.0, 3600.0]),
    max_reservations=st.integers(0, 4),
    reserved_pool_fraction=st.sampled_from([0.0, 0.01, 0.1, 0.3, 0.5]),
    stagger_checkpoints=st.booleans(),
    checkpoint_slot=st.sampled_from([30.0, 60.0, 120.0]),
    max_unsaved_run=st.sampled_from([0.0, 900.0, 1800.0, 3600.0]),
    max_preemption_searches=st.integers(0, 8),
    consolidation_wait=st.sampled_from([0.0, 300.0, 1800.0]),
    max_consolidations=st.integers(0, 3),
    forecast_ramp=st.sampled_from([0.0, 600.0, 7200.0]),
    expected_restart_s=st.sampled_from([0.0, 0.0, 120.0, 900.0]),
)

# What the estimates' forecast expects to arrive: soon or later, of every class.
expected_arrivals = st.lists(st.builds(
    ExpectedArrival,
    at=st.integers(0, 20_000).map(lambda s: NOW + s),
    priority=st.sampled_from(list(Priority)),
    num_gpus=st.sampled_from([1, 2, 4, 8, 16]),
    expected_duration=st.sampled_from([60.0, 600.0, 3600.0, 20_000.0]),
), max_size=6)


@st.composite
def snapshots(draw) -> Snapshot:
    machines = draw(fleets())
    return Snapshot(
        cluster="c1", now=NOW, machines=tuple(machines), running=tuple(draw(running_jobs(machines))),
        queue=tuple(draw(queues())), quotas=draw(quota_maps()), config=draw(configs),
        expected_arrivals=tuple(draw(expected_arrivals)),
    )


# --- the next snapshot, as the live loop builds it ---------------------------------------------------------


def next_snapshot(snap: Snapshot, result: CycleResult, victims_gone: bool, later: float) -> Snapshot:
    return after_preemption(snap, result, now=snap.now + later, victims_gone=victims_gone)


# --- the invariants ------------------------------------------------------------------------------------


def remaining(q: QueuedJob, config: PolicyConfig) -> float:
    """How long its next attempt should hold its GPUs, a resumed one's expected restart included."""
    restart = config.expected_restart_s if q.progress > 0 or q.preemptions else 0.0
    return max(MIN_RUN, q.spec.expected_duration - q.progress) + restart


def check_cycle(snap: Snapshot, result: CycleResult) -> None:
    now, config = snap.now, snap.config
    machines = {m.id: m for m in snap.machines}
    reachable = {m.id: m for m in snap.machines if m.reachable}
    queued = {q.spec.job_id: q for q in snap.queue}
    running = {r.spec.job_id: r for r in snap.running}

    def usable(slot) -> bool:
        m = reachable.get(slot[0])
        return (m is not None and m.takes_work and not m.drain and 0 <= slot[1] < m.gpus
                and slot[1] not in m.unhealthy_gpus)

    # Health: who must leave, and how.
    expected_requeues = {}
    for r in snap.running:
        if any(s[0] not in reachable for s in r.gpus):
            expected_requeues[r.spec.job_id] = False
        elif any(s[1] in reachable[s[0]].unhealthy_gpus or reachable[s[0]].drain for s in r.gpus) and not r.draining:
            expected_requeues[r.spec.job_id] = True
    assert {q.job_id: q.graceful for q in result.requeues} == expected_requeues
    assert len(result.requeues) == len(expected_requeues)
    lost = {j for j, graceful in expected_requeues.items() if not graceful}
    staying = [r for r in snap.running if r.spec.job_id not in lost]
    # A lost job's GPUs on machines that answer stay held until its allocation ends (live, its
    # workflow ends the attempt): nothing may be placed there in this cycle.
    held_by = {s: r.spec.job_id for r in snap.running for s in r.gpus}
    team_held: dict[str, int] = {}
    for r in staying:
        team_held[r.spec.team] = team_held.get(r.spec.team, 0) + r.spec.num_gpus

    def guaranteed(team):
        return snap.quotas[team].guaranteed if team in snap.quotas else 0

    # A team's borrowed jobs (policy.md, Quotas): the most recently started first, those that can
    # be given back now and fit in what is left of its overage before the rest, until it is covered.
    def protected_from_reclaim(r):
        recent = [t for t in r.preemptions if now - t <= config.thrash_window]
        unsaved = not r.spec.checkpoints and now - r.started_at > config.max_unsaved_run
        return now - r.started_at < config.min_runtime or len(recent) >= config.thrash_max_preemptions or unsaved

    borrowed = set()
    for team, held in team_held.items():
        over = held - guaranteed(team)
        newest_first = sorted((r for r in staying if r.spec.team == team), key=lambda r: (-r.started_at, r.spec.job_id))
        rest = []
        for r in newest_first:
            if over > 0 and r.spec.num_gpus <= over and not protected_from_reclaim(r):
                borrowed.add(r.spec.job_id)
                over -= r.spec.num_gpus
            else:
                rest.append(r)
        for r in rest:
            if over <= 0:
                break
            borrowed.add(r.spec.job_id)
            over -= r.spec.num_gpus

    # The queue order, by the stated policy (not by the core's own function).
    def share(team):
        g = guaranteed(team)
        return math.inf if g == 0 else team_held.get(team, 0) / g

    def key(q: QueuedJob):
        s = q.spec
        return (s.priority.rank, share(s.team), math.inf if s.deadline is None else s.deadline, q.submit_time, s.job_id)

    in_queue_order = sorted(snap.queue, key=key)

    # The cluster has an inference partition if any of its machines is in one, down or not.
    has_inference = any(m.partition == INFERENCE_PARTITION for m in snap.machines)

    def eligible(spec: JobSpec, among=None) -> list[Machine]:
        out = []
        for m in reachable.values() if among is None else among:
            if spec.kind == JobKind.inference and has_inference:
                if m.partition != INFERENCE_PARTITION:
                    continue
            elif m.partition == INFERENCE_PARTITION:
                continue
            out.append(m)
        return out

    def fits_shape(spec: JobSpec, gpus) -> None:
        assert len(gpus) == spec.num_gpus == len(set(gpus)), f"{spec.job_id}: a partial or repeated gang {gpus}"
        where = [machines[m] for m, _ in gpus]
        ok = eligible(spec)
        assert all(m in ok for m in where), f"{spec.job_id} ({spec.kind.value}) on a machine of the wrong partition"
        # The default topology is read off every machine that could host the job, down or not.
        shaped = [m for m in eligible(spec, snap.machines)
                  if (spec.gpu_type is None or m.gpu_type == spec.gpu_type)
                  and (spec.gpu_memory_gb is None or m.gpu_memory_gb >= spec.gpu_memory_gb)]
        largest = max((m.gpus for m in shaped), default=0)
        topology = spec.topology or (Topology.machine if spec.num_gpus <= largest else Topology.block)
        if topology == Topology.machine:
            assert len({m.id for m in where}) == 1, f"{spec.job_id}: machine topology across machines {gpus}"
        if topology == Topology.block:
            assert len({m.block for m in where}) == 1, f"{spec.job_id}: block topology across blocks {gpus}"

    # Earmarks passed in that still hold: their GPUs belong to their claimant.
    # A job being moved keeps the GPUs it restarts on while it drains, and when its old machine
    # is lost meanwhile: it takes them up once requeued.
    moving = {r.spec.job_id for r in snap.running if r.draining}
    live_in = {}
    for e in snap.earmarks:
        if e.expires > now and (e.job_id in queued or e.job_id in moving) and all(usable(s) for s in e.gpus):
            live_in[e.job_id] = e

    # Admission takes first the jobs their team's guarantee still covers when their turn comes
    # (counting GPUs promised to the team's waiting jobs, and what that pass has placed or
    # promised), and the large jobs that may hold a reservation; then the rest. Reservations bind
    # the jobs after theirs.
    machine_size = max((m.gpus for m in reachable.values()), default=0)

    def starving(q: QueuedJob) -> bool:
        # A whole machine of those it may use (its partition's), whatever bigger ones the cluster has.
        largest = max((m.gpus for m in eligible(q.spec)), default=machine_size)
        return q.spec.num_gpus >= largest and now - q.queued_since >= config.starvation_threshold

    placed_ids = {p.job_id for p in result.placements}
    claimants = {pre.for_job for pre in result.preemptions}
    covered, rest, held_now = [], [], dict(team_held)
    for j in live_in.keys() & queued.keys():
        held_now[queued[j].spec.team] = held_now.get(queued[j].spec.team, 0) + queued[j].spec.num_gpus
    for q in in_queue_order:
        s = q.spec
        if held_now.get(s.team, 0) + s.num_gpus <= guaranteed(s.team) or starving(q):
            covered.append(q)
            if s.job_id in placed_ids | claimants and s.job_id not in live_in:
                held_now[s.team] = held_now.get(s.team, 0) + s.num_gpus
        else:
            rest.append(q)
    order = {q.spec.job_id: i for i, q in enumerate(covered + rest)}

    # Placements.
    taken: dict = {}
    placed_gpus: dict[str, int] = {}
    for p in result.placements:
        assert p.job_id in queued, f"placed {p.job_id}, which is not queued"
        q = queued[p.job_id]
        fits_shape(q.spec, p.gpus)
        for s in p.gpus:
            assert s not in taken, f"GPU {s} placed twice: {taken[s]} and {p.job_id}"
            taken[s] = p.job_id
            assert usable(s), f"{p.job_id} placed on unusable GPU {s}"
            assert s not in held_by, f"{p.job_id} placed on {s}, held by running job {held_by[s]}"
            for e in live_in.values():
                assert e.job_id == p.job_id or s not in e.gpus, f"{p.job_id} placed on {s}, earmarked for {e.job_id}"
        if p.job_id in live_in:
            assert p.gpus == live_in[p.job_id].gpus, f"{p.job_id} not placed on exactly its earmark"
        placed_gpus[q.spec.team] = placed_gpus.get(q.spec.team, 0) + q.spec.num_gpus
        if q.spec.checkpoints:
            assert p.checkpoint_phase is not None and 0 <= p.checkpoint_phase < q.spec.checkpoint_interval
        else:
            assert p.checkpoint_phase is None
    assert len({p.job_id for p in result.placements}) == len(result.placements)

    for team, n in placed_gpus.items():
        quota = snap.quotas.get(team)
        if quota is not None and quota.max is not None:
            assert team_held.get(team, 0) + n <= quota.max, f"team {team} over its maximum"

    # Reservations, and who may use the reserved machines.
    holders = [r.job_id for r in result.reservations]
    assert len(holders) == len(set(holders))
    assert len(holders) <= config.max_reservations
    reserved_machines = [m for r in result.reservations for m in r.machines]
    assert len(reserved_machines) == len(set(reserved_machines)), "two reservations share a machine"
    for r in result.reservations:
        assert r.job_id in queued and r.job_id not in {p.job_id for p in result.placements}
        assert r.expected_start >= now
        assert now - queued[r.job_id].queued_since >= config.starvation_threshold, f"{r.job_id} is not starving"
        assert all(m in reachable for m in r.machines)
    for p in result.placements:
        if p.job_id in live_in:
            continue
        ends = now + remaining(queued[p.job_id], config)
        machines_p = {m for m, _ in p.gpus}
        for r in result.reservations:
            if order[r.job_id] < order[p.job_id] and machines_p & set(r.machines):
                assert ends <= r.expected_start, f"{p.job_id} runs past the reservation of {r.job_id}"
                assert p.backfilled, f"{p.job_id} is on {r.job_id}'s reserved machines but not marked backfilled"
        if p.backfilled:
            assert any(machines_p & set(r.machines) for r in result.reservations)

    # Preemptions and the earmarks they create.
    victims_of: dict[str, set[str]] = {}
    def committed_before(job_id):
        """GPUs the job's team holds, is promised, or was given or promised ahead of the job."""
        team = queued[job_id].spec.team
        total = team_held.get(team, 0)
        total += sum(queued[j].spec.num_gpus for j in live_in if j in queued and queued[j].spec.team == team)
        for j in (placed_ids | claimants) - live_in.keys():
            if queued[j].spec.team == team and order[j] < order[job_id]:
                total += queued[j].spec.num_gpus
        return total

    for pre in result.preemptions:
        assert pre.job_id in running, f"preempted {pre.job_id}, which is not running"
        v = running[pre.job_id]
        assert not v.draining and pre.job_id not in expected_requeues
        assert pre.grace_period == config.grace_period
        assert pre.for_job in queued and pre.for_job not in {p.job_id for p in result.placements}
        c = queued[pre.for_job].spec
        if pre.moved_to:  # a move: any class, if it can checkpoint and restarts at once elsewhere
            assert v.spec.checkpoints, f"{pre.job_id} is moved but cannot checkpoint"
            fits_shape(v.spec, pre.moved_to)
            for s in pre.moved_to:
                assert usable(s) and s not in held_by and s not in taken, f"{pre.job_id} moved onto busy GPU {s}"
            assert not {m for m, _ in pre.moved_to} & {m for m, _ in v.gpus}, f"{pre.job_id} moved onto its own machine"
        elif v.spec.priority.rank <= c.priority.rank:  # not a lower class: only a reclaim may take it
            assert v.spec.team != c.team, f"{pre.job_id} is no valid victim"
            assert committed_before(pre.for_job) + c.num_gpus <= guaranteed(c.team), (
                f"{pre.for_job} reclaims {pre.job_id} though its team would exceed its guarantee")
            assert pre.job_id in borrowed, f"{pre.job_id} is taken by a reclaim but is not borrowed"
        elif committed_before(pre.for_job) + c.num_gpus > guaranteed(c.team):  # a claimant that would borrow
            assert v.spec.team == c.team or pre.job_id in borrowed, (
                f"{pre.for_job} would borrow, yet takes {pre.job_id} from team {v.spec.team}'s guarantee")
        assert now - v.started_at >= config.min_runtime, f"{pre.job_id} preempted before its minimum runtime"
        recent = [t for t in v.preemptions if now - t <= config.thrash_window]
        assert len(recent) < config.thrash_max_preemptions, f"{pre.job_id} is thrash-protected"
        assert v.spec.checkpoints or now - v.started_at <= config.max_unsaved_run, f"{pre.job_id} cannot checkpoint"
        victims_of.setdefault(pre.for_job, set()).add(pre.job_id)
    assert len({p.job_id for p in result.preemptions}) == len(result.preemptions), "a victim preempted twice"

    earmarks = {e.job_id: e for e in result.earmarks}
    assert len(earmarks) == len(result.earmarks)
    all_earmarked = [s for e in result.earmarks for s in e.gpus]
    assert len(all_earmarked) == len(set(all_earmarked)), "two earmarks share a GPU"
    for s in all_earmarked:
        assert s not in taken, f"{s} is earmarked and placed"
    for claimant, victims in victims_of.items():
        assert claimant in earmarks, f"{claimant} preempted {victims} but has no earmark"
        e = earmarks[claimant]
        spec = queued[claimant].spec
        fits_shape(spec, e.gpus)
        for s in e.gpus:
            assert usable(s), f"{claimant} earmarked unusable GPU {s}"
            assert held_by.get(s) in victims | {None}, f"{claimant} earmarked {s}, held by {held_by.get(s)}"
        for v in victims:
            assert set(running[v].gpus) & set(e.gpus), f"{v} preempted for {claimant}, who will use none of its GPUs"
        ends = now + remaining(queued[claimant], config)
        for r in result.reservations:
            if order[r.job_id] < order[claimant] and {m for m, _ in e.gpus} & set(r.machines):
                assert ends <= r.expected_start, f"{claimant} earmarked GPUs on {r.job_id}'s reserved machines"
    moved = {pre.job_id: pre.moved_to for pre in result.preemptions if pre.moved_to}
    for job_id, to in moved.items():
        assert job_id in earmarks and earmarks[job_id].gpus == to, f"{job_id} is moved without its GPUs earmarked"
    for e in result.earmarks:
        if e.job_id in moved or e.job_id in moving:
            continue
        assert e.job_id in queued and e.job_id not in {p.job_id for p in result.placements}
        assert e.expires > now

    # Every queued job that did not start is told why, once, in queue order.
    placed_ids = {p.job_id for p in result.placements}
    pend = [p.job_id for p in result.pending]
    assert sorted(pend) == sorted(set(queued) - placed_ids)
    assert sorted(p.position for p in result.pending) == list(range(1, len(pend) + 1))
    by_position = [p.job_id for p in sorted(result.pending, key=lambda p: p.position)]
    assert by_position == [q.spec.job_id for q in in_queue_order if q.spec.job_id not in placed_ids]
    for p in result.pending:
        assert p.estimated_start is None or p.estimated_start >= now
        assert (p.misses_deadline is None) == (queued[p.job_id].spec.deadline is None)
        assert p.reason
        spec = queued[p.job_id].spec
        quota = snap.quotas.get(spec.team)
        if quota is not None and quota.max is not None and team_held.get(spec.team, 0) + spec.num_gpus > quota.max:
            assert "maximum" in p.reason, p.reason
    assert result.next_wake is None or result.next_wake > now


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(snap=snapshots(), victims_gone=st.booleans(), later=st.integers(0, 400).map(float))
def test_every_cycle_keeps_the_invariants(snap, victims_gone, later):
    result = cycle(snap)
    check_cycle(snap, result)
    snap2 = next_snapshot(snap, result, victims_gone, later)
    result2 = cycle(snap2)
    check_cycle(snap2, result2)
    _describe(result, result2)


@settings(max_examples=examples(50), deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(snap=snapshots(), steps=st.lists(st.tuples(st.booleans(), st.integers(0, 400).map(float)), min_size=3, max_size=8))
def test_cycles_played_forward_keep_the_invariants(snap, steps):
    """Each cycle's decisions taken up (placed jobs run, victims leave or drain, lost jobs go) and
    the clock moved on, several times: faults that need a cycle's leftovers (earmarks, draining
    victims, reservations) show up only on a later cycle."""
    for victims_gone, later in steps:
        result = cycle(snap)
        check_cycle(snap, result)
        snap = next_snapshot(snap, result, victims_gone, later)


@settings(max_examples=examples(100), deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(snap=snapshots(), data=st.data())
def test_estimating_some_jobs_gives_them_the_estimates_of_a_full_walk(snap, data):
    """The simulator asks only for the jobs that just arrived; the walk stops early for them."""
    ids = sorted(q.spec.job_id for q in snap.queue)
    wanted = frozenset(data.draw(st.lists(st.sampled_from(ids), unique=True), label="wanted")) if ids else frozenset()
    full = cycle(snap)
    some = cycle(snap.model_copy(update={"estimate_only": wanted}))
    assert some.placements == full.placements and some.preemptions == full.preemptions
    whole = {p.job_id: p for p in full.pending}
    for p in some.pending:
        assert p.position == whole[p.job_id].position and p.reason == whole[p.job_id].reason
        if p.job_id in wanted:
            assert p.estimated_start == whole[p.job_id].estimated_start
            assert p.misses_deadline == whole[p.job_id].misses_deadline


def _describe(result: CycleResult, result2: CycleResult) -> None:
    """What the example exercised (pytest --hypothesis-show-statistics)."""
    for label, r in (("cycle 1", result), ("cycle 2", result2)):
        event(f"{label}: placements {min(len(r.placements), 3)}{'+' if len(r.placements) >= 3 else ''}")
        for what, present in (("preemptions", r.preemptions), ("reservations", r.reservations),
                              ("requeues", r.requeues), ("earmarks", r.earmarks),
                              ("backfills", [p for p in r.placements if p.backfilled]),
                              ("moves", [p for p in r.preemptions if p.moved_to])):
            if present:
                event(f"{label}: has {what}")
    placed_on_earmark = {e.job_id for e in result.earmarks} & {p.job_id for p in result2.placements}
    if placed_on_earmark:
        event("cycle 2: a claimant starts on its earmark")
