"""Cordon and drain: an operator takes a machine out of service. Nothing new goes to a cordoned
machine and its jobs run on; a drained machine's jobs are also asked to checkpoint and move."""

from __future__ import annotations

import pytest
from builders import (
    NOW,
    cordoned,
    cycle,
    drained,
    fleet,
    job,
    machines_of,
    mid,
    pending,
    placements,
    running,
    snapshot,
    unhealthy,
    unreachable,
)

from scheduler.health import jobs_to_requeue
from scheduler.models import Earmark
from workers.cli_fleet import machine_state, uncordoned_state

M0, M1 = mid(0, 0, 0), mid(0, 0, 1)


def _on(job_id, *where, priority="normal"):
    """A running job on (machine, gpus) pairs, started long ago."""
    n = sum(len(list(g)) for _, g in where)
    b = running(job(job_id).gpus(n).priority(priority)).started(NOW - 5000)
    for machine, gpus in where:
        b = b.on(machine, gpus)
    return b


MOVED_OFF = [
    ("a job on a drained machine is asked to checkpoint and move",
     drained(fleet(machines=2), M0), [_on("j", (M0, range(4)))],
     {"j": (True, f"machine {M0} is being drained")}),
    ("a job on a cordoned machine runs on",
     cordoned(fleet(machines=2), M0), [_on("j", (M0, range(4)))], {}),
    ("a gang with one of its machines drained moves whole",
     drained(fleet(machines=2), M1), [_on("j", (M0, range(8)), (M1, range(8)))],
     {"j": (True, f"machine {M1} is being drained")}),
    ("a job already told to stop is not asked again",
     drained(fleet(machines=2), M0), [_on("j", (M0, range(2))).draining(NOW + 60, "x")], {}),
    ("a drained machine that stops answering takes its jobs with it at once",
     unreachable(drained(fleet(machines=2), M0), M0), [_on("j", (M0, range(2)))],
     {"j": (False, f"machine {M0} is unreachable")}),
    ("a job on a sick GPU of a drained machine is told of the GPU",
     unhealthy(drained(fleet(machines=2), M0), M0, [1]), [_on("j", (M0, range(2)))],
     {"j": (True, f"GPU {M0}/1 is unhealthy")}),
    ("every job of a drained machine moves, and none of the machine beside it",
     drained(fleet(machines=2), M0), [_on("a", (M0, [0])), _on("b", (M0, [1, 2])), _on("c", (M1, range(8)))],
     {"a": (True, f"machine {M0} is being drained"), "b": (True, f"machine {M0} is being drained")}),
]


@pytest.mark.parametrize("machines, run, expected", [c[1:] for c in MOVED_OFF], ids=[c[0] for c in MOVED_OFF])
def test_who_is_moved_off(machines, run, expected):
    result = cycle(snapshot(machines, running=run))
    assert {r.job_id: (r.graceful, r.reason) for r in result.requeues} == expected
    assert not result.preemptions  # a move for maintenance is no preemption: it counts towards no thrash limit


NOTHING_NEW = [
    ("a cordoned machine gets no new job", cordoned),
    ("a drained machine gets no new job", drained),
    ("a drained machine gets no new job even where the store still says it takes work",
     lambda machines, *ids: [m.model_copy(update={"drain": True}) if m.id in ids else m for m in machines]),
]


@pytest.mark.parametrize("out_of_service", [c[1] for c in NOTHING_NEW], ids=[c[0] for c in NOTHING_NEW])
def test_nothing_new_is_placed_on_a_machine_out_of_service(out_of_service):
    """m0 is empty but out of service, m1 is free: the 8-GPU job takes m1, and a second one waits."""
    machines = out_of_service(fleet(machines=2), M0)
    result = cycle(snapshot(machines, queue=[job("one").gpus(8).submitted(NOW), job("two").gpus(8).submitted(NOW + 1)]))
    assert machines_of(placements(result)["one"].gpus) == {M1}
    assert pending(result)["two"].reason == ("needs 8 GPUs on one machine; the largest free is 0; 1 machine it may "
                                             "use takes no work now (cordoned, drained, or its agent owes an answer)")


M2 = mid(0, 0, 2)
OUT_OF_SERVICE = "2 machines it may use take no work now (cordoned, drained, or their agents owe an answer)"


@pytest.mark.parametrize("topology, reason", [
    ("machine", f"needs 4 GPUs on one machine; the largest free is 2; {OUT_OF_SERVICE}"),
    ("block", f"needs 4 GPUs in one block; the most free in a block is 2; {OUT_OF_SERVICE}"),
    ("any", f"needs 4 GPUs; 2 are free; {OUT_OF_SERVICE}"),
], ids=["a one-machine job", "a one-block job", "a job of any machines"])
def test_a_waiting_job_is_told_how_many_machines_it_may_use_take_no_work(topology, reason):
    """m0 is drained and m1 cordoned, both empty; m2 has 2 of its 4 GPUs free."""
    machines = cordoned(drained(fleet(machines=3, gpus=4), M0), M1)
    result = cycle(snapshot(machines, running=[_on("r", (M2, [0, 1]))],
                            queue=[job("w").gpus(4).topology(topology).submitted(NOW)]))
    assert pending(result)["w"].reason == reason


def test_nothing_is_said_of_machines_out_of_service_when_every_machine_takes_work():
    result = cycle(snapshot(fleet(machines=1, gpus=4), running=[_on("r", (M0, [0, 1]))],
                            queue=[job("w").gpus(4).submitted(NOW)]))
    assert pending(result)["w"].reason == "needs 4 GPUs on one machine; the largest free is 2"


def test_gpus_of_a_drained_machine_are_no_reason_to_displace_anyone():
    """Preempting the low job on the drained m0 would free GPUs nobody may use: the critical job
    waits, and the low job moves off by the drain alone."""
    result = cycle(snapshot(drained(fleet(machines=1), M0), running=[_on("low", (M0, range(8)), priority="low")],
                            queue=[job("crit").gpus(8).priority("critical").submitted(NOW)]))
    assert not result.preemptions and not result.placements
    assert [r.job_id for r in result.requeues] == ["low"]


def test_a_job_moved_off_a_drained_machine_keeps_its_gpus_elsewhere_until_it_has_left():
    """A gang on m0 and m1, m1 drained: its GPUs on m0 are not given to a waiting job in its grace."""
    result = cycle(snapshot(drained(fleet(machines=2), M1), running=[_on("gang", (M0, range(8)), (M1, range(8)))],
                            queue=[job("next").gpus(8).submitted(NOW)]))
    assert [r.job_id for r in result.requeues] == ["gang"]
    assert not result.placements


def test_a_machine_back_in_service_is_used_again():
    machines = drained(fleet(machines=1), M0)
    back = [m.model_copy(update={"takes_work": True, "drain": False}) for m in machines]
    result = cycle(snapshot(back, queue=[job("back").gpus(8).submitted(NOW)]))
    assert machines_of(placements(result)["back"].gpus) == {M0}


LISTED = [
    ("a machine in service", {"reachable": True, "takes_work": True, "cordon": None, "allocations": 2}, "up"),
    ("a machine whose agent owes an answer", {"reachable": True, "takes_work": False, "cordon": None, "allocations": 0},
     "up, taking no work (its agent owes an answer or is starting)"),
    ("a cordoned machine", {"reachable": True, "takes_work": False, "cordon": "cordoned", "allocations": 1},
     "cordoned"),
    ("a machine being drained", {"reachable": True, "takes_work": False, "cordon": "draining", "allocations": 2,
                                 "cordon_reason": "PSU swap"}, "draining (PSU swap), 2 job(s) left"),
    ("a drained machine", {"reachable": True, "takes_work": False, "cordon": "draining", "allocations": 0},
     "drained"),
    ("a drained machine switched off for its maintenance", {"reachable": False, "takes_work": False,
                                                            "cordon": "draining", "allocations": 0,
                                                            "cordon_reason": "PSU swap"},
     "unreachable; drained (PSU swap)"),
    ("a machine that died", {"reachable": False, "takes_work": True, "cordon": None, "allocations": 1}, "unreachable"),
]


@pytest.mark.parametrize("row, state", [c[1:] for c in LISTED], ids=[c[0] for c in LISTED])
def test_how_fleet_list_names_a_machine_s_state(row, state):
    assert machine_state(row) == state


@pytest.mark.parametrize("row, said", [
    ({"id": "m", "reachable": True, "takes_work": True}, "back in service; the next cycle may place jobs there"),
    ({"id": "m", "reachable": False, "takes_work": True},
     "uncordoned, but unreachable: it takes work once its agent is heard again"),
    ({"id": "m", "reachable": True, "takes_work": False}, "uncordoned, but taking no work until its agent answers"),
], ids=["a machine whose agent is heard is back in service",
        "one switched off for its maintenance is not, until its agent is heard (before: 'back in service')",
        "nor one whose agent owes an answer"])
def test_what_an_uncordon_says_the_machine_is_now(row, said):
    assert uncordoned_state([{"id": "other", "reachable": True, "takes_work": True}, row], "m") == said


def test_a_gang_across_two_drained_machines_is_told_of_the_first():
    """Named by the first of its machines being drained."""
    machines = [m.model_copy(update={"takes_work": False, "drain": True}) for m in fleet(machines=2)]
    gang = running(job("g").gpus(16)).on(M0, range(8)).on(M1, range(8)).started(NOW - 5000).build()
    [requeue] = jobs_to_requeue(machines, [gang])
    assert (requeue.job_id, requeue.reason, requeue.graceful) == ("g", f"machine {M0} is being drained", True)


def test_a_drained_machine_the_store_says_takes_work_still_has_its_jobs_moved():
    """Every machine reachable, taking work, with no sick GPU: the fast path that says nobody
    moves must still see the drain."""
    machines = [m.model_copy(update={"drain": True}) if m.id == M0 else m for m in fleet(machines=2)]
    j = running(job("j").gpus(4)).on(M0, range(4)).started(NOW - 5000).build()
    assert [(r.job_id, r.reason, r.graceful) for r in jobs_to_requeue(machines, [j])] == \
        [("j", f"machine {M0} is being drained", True)]


def test_machines_taking_no_work_do_not_make_the_reserved_pool_big_enough_for_a_job_only_they_could_host():
    """With m0-m2 cordoned, the pool's one machine
    that can be whole is m3, so `big` (two whole machines) is not served by keeping it and
    `small` starts there. Counted whole, the cordoned machines made the pool keep m3 for `big`."""
    machines = cordoned(fleet(machines=4), M0, M1, M2)
    result = cycle(snapshot(machines, queue=[job("big").gpus(16).topology("block").submitted(0),
                                             job("small").gpus(2).submitted(1)], reserved_pool_fraction=0.5))
    assert machines_of(placements(result)["small"].gpus) == {mid(0, 0, 3)}
    assert "big" in pending(result)


def test_a_claimant_whose_victim_s_machine_is_drained_looks_for_gpus_again():
    """c's victim v checkpoints on m0 when m0 is drained: c's earmark there is dropped (those GPUs
    will not be usable), and c waited for v all the same, told a grace, estimated hours. It now
    displaces someone whose GPUs it can use."""
    v = running(job("v").gpus(2).priority("low").team("x")).on(M0, [0, 1]).started(NOW - 5000).draining(NOW + 36, "c")
    f1 = running(job("f1").gpus(8).priority("low").team("z").expected(20000)).on(M1, range(8)).started(NOW - 5000)
    earmark = Earmark(job_id="c", gpus=((M0, 0), (M0, 1)), expires=NOW + 300)
    result = cycle(snapshot(drained(fleet(machines=2), M0), running=[v, _on("f0", (M0, range(2, 8))), f1],
                            queue=[job("c").gpus(2).priority("critical").submitted(NOW - 100)], earmarks=[earmark]))
    assert [p.job_id for p in result.preemptions] == ["f1"]
    assert [{m for m, _ in e.gpus} for e in result.earmarks] == [{M1}]


@pytest.mark.parametrize("out_of_service", [cordoned, drained], ids=["cordoned", "drained"])
def test_the_reserved_pool_is_a_share_of_the_machines_in_service(out_of_service):
    """Two blocks of two 4-GPU machines, one of each block out of service: no block has 6 GPUs
    for `big`. Counted in the pool's share, the machines out of service made it 2 machines, which
    `big` fits, and the one idle machine was kept whole for it while `small` waited beside it
    (machines that are down were never counted)."""
    machines = out_of_service(fleet(blocks=2, machines=2, gpus=4), mid(0, 0, 1), mid(1, 0, 1))
    result = cycle(snapshot(machines, running=[_on("busy", (M0, range(4)))], reserved_pool_fraction=0.5,
                            queue=[job("big").gpus(6).submitted(NOW - 100), job("small").gpus(1).submitted(NOW - 50)]))
    assert machines_of(placements(result)["small"].gpus) == {mid(1, 0, 0)}


@pytest.mark.parametrize("moving", [False, True], ids=["in the cycle of the drain", "in the next, as it moves"])
def test_a_claimant_waits_for_the_gpus_a_job_moved_off_a_drained_machine_gives_back(moving):
    """Gang g holds m0 (drained) and m1; its 8 GPUs on m1 come back within its grace. In the
    cycle of the drain a critical claimant displaced `low` (its work lost) for GPUs that came back
    no sooner; the next cycle, with g moving, it waited for them."""
    gang = _on("g", (M0, range(8)), (M1, range(8)))
    if moving:
        gang = gang.draining(NOW + 120, None)
    low = running(job("low").gpus(8).priority("low").team("z").expected(20000)).on(M2, range(8)).started(NOW - 5000)
    result = cycle(snapshot(drained(fleet(machines=3), M0), running=[gang, low], reserved_pool_fraction=0.0,
                            queue=[job("c").gpus(8).priority("critical").submitted(NOW - 10)]))
    assert not result.preemptions
    assert pending(result)["c"].reason.startswith("enough GPUs are expected to free up within half the grace")


def test_a_claimant_waits_for_the_healthy_gpus_a_job_on_a_sick_gpu_gives_back():
    """x's GPU 0 turns sick: x moves, and its 3 healthy GPUs come back within its grace; c needs 3."""
    low = running(job("low").gpus(8).priority("low").team("z").expected(20000)).on(M1, range(8)).started(NOW - 5000)
    result = cycle(snapshot(unhealthy(fleet(machines=2), M0, [0]), reserved_pool_fraction=0.0,
                            running=[_on("x", (M0, range(4))), _on("f", (M0, range(4, 8))), low],
                            queue=[job("c").gpus(3).priority("critical").submitted(NOW - 10)]))
    assert [r.job_id for r in result.requeues] == ["x"]
    assert not result.preemptions
