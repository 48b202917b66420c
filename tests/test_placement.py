"""Gang placement: all or nothing, topology-aware, best fit, a reserved pool of whole machines."""

from __future__ import annotations

import pytest
from builders import (
    NOW,
    blocks_of,
    cycle,
    filler,
    fleet,
    job,
    machines_of,
    mid,
    pending,
    placements,
    snapshot,
    unhealthy,
    unreachable,
)


def _busy(machine, used, name=None):
    """A critical job holding the first `used` GPUs of a machine (nobody may preempt it)."""
    return filler(name or f"busy-{machine}", machine, range(used))


def _rack_id(machine_id: str) -> str:
    return machine_id.rsplit("/", 1)[0]


# --- where a job goes ---------------------------------------------------------------------------------
# Each case: machines, running fillers, the one queued job, and a check on its GPUs.

WHERE_CASES = [
    (
        fleet(machines=3), [_busy(mid(0, 0, 0), 4), _busy(mid(0, 0, 1), 6)],
        job("j").gpus(2),
        lambda g: machines_of(g) == {mid(0, 0, 1)},
    ),
    (
        fleet(machines=3), [_busy(mid(0, 0, 0), 5), _busy(mid(0, 0, 1), 3)],
        job("j").gpus(3),
        lambda g: machines_of(g) == {mid(0, 0, 0)},
    ),
    (
        fleet(machines=3), [_busy(mid(0, 0, 0), 4)],
        job("j").gpus(4),
        lambda g: machines_of(g) == {mid(0, 0, 0)},
    ),
    (
        fleet(machines=2), [_busy(mid(0, 0, 0), 2)],
        job("j").gpus(6),
        lambda g: machines_of(g) == {mid(0, 0, 0)},
    ),
    (
        fleet(machines=4), [],
        job("j").gpus(8),
        lambda g: len(machines_of(g)) == 1,
    ),
    (
        fleet(blocks=2, racks=2, machines=2), [],
        job("j").gpus(16),
        lambda g: len(machines_of(g)) == 2 and len({_rack_id(m) for m in machines_of(g)}) == 1,
    ),
    (
        fleet(blocks=2, racks=2, machines=2), [_busy(mid(0, 0, 0), 8), _busy(mid(0, 1, 0), 8)],
        job("j").gpus(16),
        lambda g: len(blocks_of(g)) == 1 and len(machines_of(g)) == 2,
    ),
    (
        fleet(blocks=2, racks=1, machines=2),
        [_busy(mid(0, 0, 0), 8), _busy(mid(1, 0, 0), 8), _busy(mid(1, 0, 1), 4)],
        job("j").gpus(12).topology("any"),
        lambda g: len(blocks_of(g)) == 2,
    ),
    (
        fleet(machines=2), [_busy(mid(0, 0, 0), 5), _busy(mid(0, 0, 1), 5)],
        job("j").gpus(6).topology("any"),
        lambda g: machines_of(g) == {mid(0, 0, 0), mid(0, 0, 1)},
    ),
    (
        fleet(machines=3), [_busy(mid(0, 0, 0), 6)],
        job("j").gpus(2).topology("any"),
        lambda g: machines_of(g) == {mid(0, 0, 0)},
    ),
    (
        fleet(blocks=2, machines=2), [_busy(mid(0, 0, 0), 4), _busy(mid(1, 0, 0), 8)],
        job("j").gpus(12).topology("block"),
        lambda g: blocks_of(g) == {"b0"},
    ),
    (
        fleet(machines=4), [_busy(mid(0, 0, 1), 2), _busy(mid(0, 0, 2), 2), _busy(mid(0, 0, 3), 4)],
        job("j").gpus(16),
        lambda g: machines_of(g) == {mid(0, 0, 1), mid(0, 0, 2), mid(0, 0, 3)},
    ),
    (
        fleet(machines=4), [_busy(mid(0, 0, 1), 2), _busy(mid(0, 0, 2), 2)],
        job("j").gpus(12).topology("any"),
        lambda g: machines_of(g) == {mid(0, 0, 1), mid(0, 0, 2)},
    ),
    (
        fleet(machines=5), [_busy(mid(0, 0, 2), 2), _busy(mid(0, 0, 3), 2), _busy(mid(0, 0, 4), 4)],
        job("j").gpus(20),
        lambda g: len(machines_of(g)) == 3 and len(machines_of(g) & {mid(0, 0, 0), mid(0, 0, 1)}) == 1,
    ),
    (
        fleet(racks=3, machines=3),
        [_busy(mid(0, 0, 1), 2), _busy(mid(0, 0, 2), 2), _busy(mid(0, 1, 0), 2), _busy(mid(0, 1, 1), 8),
         _busy(mid(0, 1, 2), 8), _busy(mid(0, 2, 0), 4), _busy(mid(0, 2, 1), 8), _busy(mid(0, 2, 2), 8)],
        job("j").gpus(22),
        lambda g: len({_rack_id(m) for m in machines_of(g)}) == 2 and mid(0, 0, 0) in machines_of(g),
    ),
    (
        fleet(machines=1) + fleet(first_block=1, machines=1, gpus=4), [],
        job("j").gpus(4),
        lambda g: machines_of(g) == {mid(1, 0, 0)},
    ),
    (
        fleet(machines=4) + fleet(first_block=1, racks=2, machines=1), [_busy(mid(0, 0, m), 4) for m in range(4)],
        job("j").gpus(16),
        lambda g: blocks_of(g) == {"b0"},
    ),
]
WHERE_IDS = [
    "a 2-GPU job goes to the fullest machine that fits: 2 free rather than 4 or a whole one",
    "best fit picks the machine with 3 free over the one with 5 free",
    "best fit prefers a half-used machine to a whole one for a 4-GPU job",
    "a 6-GPU job fits exactly on the machine with 6 free and leaves the whole machine whole",
    "an 8-GPU job with no topology goes on one machine",
    "a 16-GPU job with no topology stays in one block and, when a rack can hold it, in one rack",
    "a 16-GPU block job spans racks of one block when no rack alone has room",
    "an 'any' job that no block can hold spans blocks",
    "an 'any' job that fits no single machine spreads over machines",
    "an 'any' job that fits a machine takes the fullest one, like a machine job",
    "a block job goes to the block that can hold it all",
    "a job over several machines takes partly used ones that hold it on as many machines, not a whole one",
    "an 'any' job of 12 takes two machines with 6 free each, not a whole machine and part of another",
    "a job that needs one whole machine among as many machines takes one, not two",
    "a job kept off a whole machine only if that spreads it over no more racks",
    "best fit holds across machines of different sizes: a 4-GPU job takes a whole 4-GPU machine, not half of an 8",
    "fewest racks come before fewest machines: four half-free machines in one rack, not two empty ones in two",
]


@pytest.mark.parametrize("machines,run,queued,check", WHERE_CASES, ids=WHERE_IDS)
def test_where_a_job_goes(machines, run, queued, check):
    result = cycle(snapshot(machines, running=run, queue=[queued.submitted(NOW)]))
    placed = placements(result)
    assert set(placed) == {queued.job_id}, result.pending
    gpus = placed[queued.job_id].gpus
    assert len(gpus) == len(set(gpus)) == queued.spec().num_gpus
    assert check(gpus), gpus


# --- when a job waits ----------------------------------------------------------------------------------

WAIT_CASES = [
    (
        fleet(machines=3), [_busy(mid(0, 0, i), 2) for i in range(3)],
        job("j").gpus(8),
        "needs 8 GPUs on one machine; the largest free is 6",
    ),
    (
        fleet(machines=4), [_busy(mid(0, 0, i), 6) for i in range(4)],
        job("j").gpus(8).topology("machine"),
        "needs 8 GPUs on one machine; the largest free is 2",
    ),
    (
        fleet(machines=2), [_busy(mid(0, 0, 0), 1)],
        job("j").gpus(7).topology("machine"),
        None,
    ),
    (
        fleet(machines=1), [],
        job("j").gpus(12).topology("machine"),
        "needs 12 GPUs on one machine; machines here have 8",
    ),
    (
        fleet(machines=2), [],
        job("j").gpus(12).topology("machine"),
        "needs 12 GPUs on one machine; machines here have 8",
    ),
    (
        fleet(blocks=2, machines=2), [_busy(mid(0, 0, 0), 8), _busy(mid(1, 0, 0), 8)],
        job("j").gpus(16),
        "needs 16 GPUs in one block; the most free in a block is 8",
    ),
    (
        fleet(machines=2), [_busy(mid(0, 0, 0), 5), _busy(mid(0, 0, 1), 5)],
        job("j").gpus(7).topology("any"),
        "needs 7 GPUs; 6 are free",
    ),
    (
        fleet(machines=2), [],
        job("j").gpus(2).gpu_type("B200"),
        "no machine in this cluster matches training jobs, GPU type B200",
    ),
    (
        unreachable(fleet(machines=1) + fleet(first_block=1, machines=1, gpu_type="A100"), mid(1, 0, 0)), [],
        job("j").gpus(2).gpu_type("A100"),
        "every machine that matches training jobs, GPU type A100 is unreachable",
    ),
    (
        unreachable(fleet(machines=1) + fleet(first_block=1, machines=2, gpus=4), mid(0, 0, 0)), [],
        job("j").gpus(8),
        "needs 8 GPUs on one machine; the machines with 8 or more GPUs are unreachable, those that answer have 4",
    ),
]
WAIT_IDS = [
    "a job that needs 8 GPUs waits when only 6 are free on any machine",
    "a machine job waits when 8 GPUs are free in total but at most 2 on any machine",
    "a 7-GPU machine job takes the machine with 7 free (control: not a wait)",
    "a machine job bigger than any machine waits and says machines here have 8",
    "a machine job bigger than any machine is not split, even when two machines together have room",
    "a 16-GPU job waits when two blocks have 8 free each but no block has 16",
    "an 'any' job waits when the whole cluster has fewer free GPUs than it needs",
    "a job asking for a GPU type the cluster lacks waits and says so",
    "a job whose GPU type's machines are all down says they are unreachable, not that the cluster lacks them",
    "an 8-GPU job whose 8-GPU machine is down says so, not that machines here have 4",
]


@pytest.mark.parametrize("machines,run,queued,reason", WAIT_CASES, ids=WAIT_IDS)
def test_when_a_job_waits(machines, run, queued, reason):
    result = cycle(snapshot(machines, running=run, queue=[queued.submitted(NOW)]))
    if reason is None:
        assert set(placements(result)) == {"j"}
        return
    assert not result.placements, "a gang is placed whole or not at all"
    assert not result.preemptions
    assert pending(result)["j"].reason == reason


def test_gpu_type_is_honoured():
    machines = fleet(machines=1, gpu_type="A100") + fleet(machines=1, first_block=1, gpu_type="H100")
    result = cycle(snapshot(machines, queue=[job("h").gpus(8).gpu_type("H100").submitted(NOW)]))
    assert machines_of(placements(result)["h"].gpus) == {mid(1, 0, 0)}


# --- unusable machines and GPUs -----------------------------------------------------------------------

UNUSABLE_CASES = [
    (unreachable(fleet(machines=2), mid(0, 0, 1)), [_busy(mid(0, 0, 0), 6)], job("j").gpus(4), False),
    (unreachable(fleet(machines=2), mid(0, 0, 1)), [_busy(mid(0, 0, 0), 6)], job("j").gpus(2), True),
    (unhealthy(fleet(machines=1), mid(0, 0, 0), [3]), [], job("j").gpus(8), False),
    (unhealthy(fleet(machines=1), mid(0, 0, 0), [3]), [], job("j").gpus(7), True),
    (unhealthy(fleet(machines=2), mid(0, 0, 0), [0, 1]), [_busy(mid(0, 0, 1), 8)], job("j").gpus(6), True),
    (unreachable(fleet(machines=3), mid(0, 0, 0), mid(0, 0, 1)), [_busy(mid(0, 0, 2), 8)], job("j").gpus(1).topology("any"), False),
    (unreachable(fleet(machines=1) + fleet(first_block=1, machines=2, gpus=4), mid(0, 0, 0)), [], job("j").gpus(8), False),
]
UNUSABLE_IDS = [
    "an unreachable machine is never used, even when it is the only one with room",
    "a job that fits the reachable machine goes there",
    "an 8-GPU job does not start on a machine with one unhealthy GPU",
    "a 7-GPU job starts on the 7 healthy GPUs of a machine with one unhealthy GPU",
    "a job never gets an unhealthy GPU even when it needs all the healthy ones",
    "with only unreachable machines free, even a 1-GPU 'any' job waits",
    "an 8-GPU job stays a one-machine job while the only 8-GPU machine is down: not split over two 4-GPU machines",
]


@pytest.mark.parametrize("machines,run,queued,starts", UNUSABLE_CASES, ids=UNUSABLE_IDS)
def test_unusable_machines_and_gpus_are_never_used(machines, run, queued, starts):
    result = cycle(snapshot(machines, running=run, queue=[queued.submitted(NOW)]))
    by_id = {m.id: m for m in machines}
    placed = placements(result)
    assert ("j" in placed) == starts, result.pending
    for p in result.placements:
        for machine_id, gpu in p.gpus:
            assert by_id[machine_id].reachable
            assert gpu not in by_id[machine_id].unhealthy_gpus


# --- the reserved pool of whole machines ----------------------------------------------------------------
# `whole` machines left whole, the rest full; the small job was submitted first, so it is admitted
# before the big job (8 GPUs unless said), which needs whole machines the pool could host.


def _pool_snapshot(small, *, big=8, machines=3, fraction=0.01, whole=1):
    run = [_busy(mid(0, 0, i), 8) for i in range(whole, machines)]
    queue = ([job("big").gpus(big).submitted(NOW)] if big else []) + [small.submitted(NOW - 60)]
    return snapshot(fleet(machines=machines), running=run, queue=queue, reserved_pool_fraction=fraction)


POOL_CASES = [
    (job("small").gpus(2), {}, False, True),
    (job("small").gpus(2), {"big": None}, True, False),
    (job("small").gpus(2).topology("machine"), {}, False, True),
    (job("small").gpus(2).topology("any"), {}, False, True),
    (job("small").gpus(2).topology("block"), {}, False, True),
    (job("small").gpus(2), {"machines": 10, "fraction": 0.15, "big": 16}, False, False),
    (job("small").gpus(2), {"machines": 10, "fraction": 0.15, "big": 16, "whole": 3}, True, True),
    (job("small").gpus(2), {"machines": 10, "fraction": 0.15, "whole": 2}, True, True),
    (job("small").gpus(2), {"fraction": 0.0}, True, False),
]
POOL_IDS = [
    "a 2-GPU job does not break the last whole machine while a job needing whole machines is queued, which then takes it",
    "with no big job queued, the 2-GPU job takes the whole machine",
    "a small machine-topology job leaves the reserved whole machine alone",
    "a small 'any' job leaves the reserved whole machine alone",
    "a small block-topology job leaves the reserved whole machine alone",
    "the reserved pool is the fraction rounded up: 15% of 10 machines keeps 2 whole, enough for a 16-GPU job",
    "beyond the reserved pool, a third whole machine may be broken",
    "once the job the pool is kept for has started, a job kept off it takes what is left in the same cycle",
    "a reserved pool fraction of 0 keeps nothing whole: the small job breaks the last whole machine",
]


@pytest.mark.parametrize("small,opts,starts,big_starts", POOL_CASES, ids=POOL_IDS)
def test_reserved_pool_of_whole_machines(small, opts, starts, big_starts):
    result = cycle(_pool_snapshot(small, **opts))
    assert ("small" in placements(result)) == starts, (result.placements, result.pending)
    assert ("big" in placements(result)) == big_starts, (result.placements, result.pending)
    if not starts and not big_starts:
        assert pending(result)["small"].reason == "the last whole machines are kept for jobs that need a whole machine"


def test_a_job_its_team_maximum_keeps_out_does_not_keep_the_pool_idle():
    """The 8-GPU job's team holds its maximum (m1): it cannot start until that team gives GPUs
    back, so keeping the last whole machine for it would only leave GPUs idle."""
    run = [filler("capped-run", mid(0, 0, 1), range(8), team="capped"), _busy(mid(0, 0, 2), 8)]
    queue = [job("big").gpus(8).team("capped").submitted(NOW), job("small").gpus(2).submitted(NOW)]
    result = cycle(snapshot(fleet(machines=3), running=run, queue=queue,
                            quotas={"capped": {"guaranteed": 0, "max": 8}}))
    assert "small" in placements(result)
    assert pending(result)["big"].reason.startswith("team capped is at its maximum"), pending(result)["big"].reason


def test_machines_with_sick_gpus_do_not_count_towards_the_reserve():
    """Three 2-GPU machines keep a reserve of 2 (fraction 0.5), but two have every GPU sick: only
    one can ever be whole, so a 4-GPU job the nominal reserve could host would never start there,
    and keeping the last whole machine for it would leave the small job waiting for good."""
    machines = unhealthy(unhealthy(fleet(racks=3, machines=1, gpus=2), mid(0, 0, 0), [0, 1]), mid(0, 1, 0), [0, 1])
    queue = [job("small").gpus(1).priority("high").submitted(NOW), job("big").gpus(4).priority("low").submitted(NOW)]
    result = cycle(snapshot(machines, queue=queue, reserved_pool_fraction=0.5))
    assert "small" in placements(result), pending(result)["small"].reason


def test_a_job_bigger_than_the_reserved_pool_does_not_keep_it_idle():
    """A 128-GPU job cannot use the one-machine pool; it waits for its reservation, so small jobs
    may use the last whole machine meanwhile."""
    queue = [job("huge").gpus(128).submitted(NOW), job("small").gpus(2).submitted(NOW)]
    run = [_busy(mid(0, 0, i), 8) for i in range(1, 3)]
    result = cycle(snapshot(fleet(machines=3), running=run, queue=queue))
    assert "small" in placements(result)


def test_the_reserved_pool_does_not_keep_a_big_job_from_a_whole_machine():
    """An 8-GPU job is itself a big job: it may take the last whole machine."""
    result = cycle(_pool_snapshot(job("eight").gpus(8)))
    assert machines_of(placements(result)["eight"].gpus) == {mid(0, 0, 0)}


def test_partly_used_machines_still_take_small_jobs_while_the_pool_is_kept():
    run = [_busy(mid(0, 0, 1), 6), _busy(mid(0, 0, 2), 8)]
    result = cycle(snapshot(fleet(machines=3), running=run, queue=[job("big").gpus(8).submitted(NOW), job("small").gpus(2).submitted(NOW)]))
    assert machines_of(placements(result)["small"].gpus) == {mid(0, 0, 1)}


def _two_pools(big):
    """Machines 0-1 of block 0: training H100s (m0 busy, m1 whole); machine 0 of block 5: busy,
    of another pool (inference, or A100s)."""
    other = (fleet(first_block=5, machines=1, partition="inference") if big.spec().kind.value == "inference"
             else fleet(first_block=5, machines=1, gpu_type="A100"))
    run = [_busy(mid(0, 0, 0), 8), _busy(mid(5, 0, 0), 8)]
    queue = [big, job("small").gpus(2).submitted(NOW + 1)]
    return snapshot(fleet(machines=2) + other, running=run, queue=queue, reserved_pool_fraction=0.01)


@pytest.mark.parametrize("big", [job("big").gpus(8).inference().submitted(NOW),
                                 job("big").gpus(8).gpu_type("A100").submitted(NOW)],
                         ids=["an inference job", "a job for another GPU type"])
def test_a_big_job_that_cannot_run_on_a_pool_keeps_none_of_its_machines_whole(big):
    assert "small" in placements(cycle(_two_pools(big)))


def test_the_reserved_pool_is_sized_per_pool_not_by_the_whole_cluster():
    """Two pools of 150 machines: each keeps ceil(1% of 150) = 2 whole, 16 GPUs; a 24-GPU job
    fits neither pool's reserve, so it waits for a reservation and keeps nothing whole."""
    h100 = fleet(racks=10, machines=15)
    a100 = fleet(first_block=1, racks=10, machines=15, gpu_type="A100")
    whole = {(0, 0, 0), (1, 0, 0), (1, 0, 1)}  # one H100 and two A100 machines are whole
    run = [_busy(m.id, 8) for m in h100 + a100 if (int(m.block[1:]), int(m.rack[1:]), int(m.id.split("/m")[-1])) not in whole]
    queue = [job("big").gpus(24).submitted(NOW), job("small").gpus(2).gpu_type("H100").submitted(NOW + 1)]
    result = cycle(snapshot(h100 + a100, running=run, queue=queue, reserved_pool_fraction=0.01))
    assert "small" in placements(result)


def test_a_one_machine_job_bigger_than_a_pools_machines_keeps_none_of_them_whole():
    """8-GPU `big` (topology machine) can only ever run on the busy 8-GPU machine; the 4-GPU pool
    (half of it reserved) is no use to it, so the 2-GPU job takes a 4-GPU machine instead of
    waiting hours beside two idle ones."""
    run = [_busy(mid(0, 0, 0), 8), _busy(mid(1, 0, 0), 4)]
    queue = [job("big").gpus(8).topology("machine").submitted(NOW), job("small").gpus(2).submitted(NOW + 1)]
    machines = fleet(machines=1) + fleet(first_block=1, machines=3, gpus=4)
    result = cycle(snapshot(machines, running=run, queue=queue, reserved_pool_fraction=0.5))
    assert machines_of(placements(result)["small"].gpus) <= {mid(1, 0, 1), mid(1, 0, 2)}
