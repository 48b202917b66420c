"""Partitions: inference jobs on the inference partition when there is one; training never there."""

from __future__ import annotations

import pytest
from builders import (
    NOW,
    cycle,
    filler,
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

TRAIN, INFER = mid(0, 0, 0), mid(1, 0, 0)


def _cluster(*, train_used=0, infer_used=0, with_inference=True):
    machines = fleet(machines=1)
    run = []
    if with_inference:
        machines += fleet(machines=1, first_block=1, partition="inference")
    if train_used:
        run.append(filler("tfill", TRAIN, range(train_used)))
    if infer_used:
        run.append(filler("ifill", INFER, range(infer_used), team="serving"))
    return machines, run


CASES = [
    ({}, job("inf").inference().gpus(2), {INFER}),
    ({"infer_used": 4}, job("inf").inference().gpus(2), {INFER}),
    ({"infer_used": 8}, job("inf").inference().gpus(2), None),
    ({}, job("train").gpus(2), {TRAIN}),
    ({"train_used": 8}, job("train").gpus(2), None),
    ({"with_inference": False}, job("inf").inference().gpus(2), {TRAIN}),
    ({"infer_used": 7}, job("inf").inference().gpus(2).topology("any"), None),
    ({"train_used": 7}, job("train").gpus(2).topology("any"), None),
    ({"train_used": 4}, job("train").gpus(8).topology("any"), None),
]
IDS = [
    "an inference job goes to the inference partition, not to an equally free training machine",
    "an inference job takes the partly used inference machine",
    "an inference job waits when the inference partition is full, though training GPUs are free",
    "a training job goes to a training machine",
    "a training job waits when training machines are full, though inference GPUs are free",
    "without an inference partition, inference jobs run on training machines",
    "an 'any' inference job does not spill onto training machines",
    "an 'any' training job does not spill onto inference machines",
    "an 8-GPU 'any' training job does not combine training and inference GPUs",
]


@pytest.mark.parametrize("opts,queued,where", CASES, ids=IDS)
def test_partitions(opts, queued, where):
    machines, run = _cluster(**opts)
    result = cycle(snapshot(machines, running=run, queue=[queued.submitted(NOW)]))
    placed = placements(result)
    if where is None:
        assert not placed
        assert queued.job_id in pending(result)
    else:
        assert machines_of(placed[queued.job_id].gpus) == where


def test_no_preemption_across_partitions():
    """A critical training job does not displace a low inference job: it could not use those GPUs."""
    machines, _ = _cluster()
    run = [filler("tfill", mid(0, 0, 0), range(8)),
           running(job("inf-low").inference().gpus(8).priority("low")).on(INFER, range(8))]
    result = cycle(snapshot(machines, running=run, queue=[job("crit").gpus(8).priority("critical").submitted(NOW)]))
    assert not result.preemptions


def test_an_inference_job_preempts_within_its_partition():
    machines, _ = _cluster()
    run = [running(job("train-low").gpus(8).priority("low")).on(TRAIN, range(8)),
           running(job("inf-low").inference().gpus(8).priority("low")).on(INFER, range(8))]
    result = cycle(snapshot(machines, running=run, queue=[job("crit").inference().gpus(8).priority("critical").submitted(NOW)]))
    assert [p.job_id for p in result.preemptions] == ["inf-low"]


@pytest.mark.parametrize(
    "machines",
    [
        unreachable(fleet(machines=1) + fleet(machines=1, first_block=1, partition="inference"), INFER),
        unhealthy(fleet(machines=1) + fleet(machines=1, first_block=1, partition="inference"), INFER, range(8)),
    ],
    ids=[
        "an inference job does not move to training machines while the inference machine is unreachable",
        "an inference job does not move to training machines while every inference GPU is unhealthy",
    ],
)
def test_an_inference_partition_that_is_down_is_still_the_inference_partition(machines):
    result = cycle(snapshot(machines, queue=[job("inf").inference().gpus(2).submitted(NOW)]))
    placed = placements(result)
    assert "inf" not in placed, f"inference job placed on {placed['inf'].gpus}, training machines"
    assert "inf" in pending(result)
