"""The collector is off inside a cycle (held back for a simulation) and put back exactly as it
was afterwards; a cycle leaves nothing that only the collector could free."""

import gc

import pytest
from builders import cycle, filler, fleet, job, mid, running, snapshot

from scheduler.gc_policy import YOUNG_THRESHOLD, few_collections, no_collections


@pytest.mark.parametrize("freeze", [False, True], ids=["held back", "held back for a whole simulation"])
def test_thresholds_are_raised_inside_and_restored_after(freeze):
    before = gc.get_threshold()
    with few_collections(freeze=freeze):
        assert gc.get_threshold()[0] == YOUNG_THRESHOLD
    assert gc.get_threshold() == before


@pytest.mark.parametrize("hold", [few_collections, no_collections], ids=["held back", "off for one cycle"])
def test_the_collector_is_restored_when_the_cycle_fails(hold):
    before = gc.get_threshold(), gc.isenabled()
    with pytest.raises(RuntimeError):
        with hold():
            raise RuntimeError("the cycle failed")
    assert (gc.get_threshold(), gc.isenabled()) == before


@pytest.mark.parametrize("enabled", [True, False], ids=["on before: on again after", "off before: still off after"])
def test_the_collector_is_off_inside_one_cycle_and_as_it_was_after(enabled):
    (gc.enable if enabled else gc.disable)()
    try:
        with no_collections():
            assert not gc.isenabled()
        assert gc.isenabled() is enabled
    finally:
        gc.enable()


def test_what_was_set_aside_for_a_simulation_is_collectable_again_after_it():
    with few_collections(freeze=True):
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0


def _busy_snapshot():
    """Two full machines, a queue that preempts, reserves and waits: most of the cycle's paths."""
    m = [mid(0, 0, i) for i in range(2)]
    run = [running(job("low").gpus(8).priority("low")).on(m[0], range(8)).started(-5000.0),
           filler("f1", m[1], range(6))]
    queue = [job("crit").gpus(8).priority("critical"), job("big").gpus(16).submitted(-90000.0)]
    queue += [job(f"q{i}").gpus(1 + i % 4).submitted(float(i)) for i in range(30)]
    return snapshot(fleet(machines=2), running=run, queue=queue)


def test_a_cycle_leaves_no_reference_cycles_for_the_collector():
    """Why switching the collector off for a cycle is safe: reference counting frees all it made."""
    snap = _busy_snapshot()
    cycle(snap)  # first uses (lazily built validators, caches) are not the cycle's own garbage
    gc.collect()
    with no_collections():
        result = cycle(snap)
        assert result.preemptions and result.pending  # the paths that make the most objects ran
        del result
    assert gc.collect() == 0


@pytest.mark.parametrize("enabled", [True, False], ids=["on before: on again after the last", "off before: still off after"])
def test_overlapping_holders_keep_the_collector_off_until_the_last_is_done(enabled):
    """Two clusters' cycles interleave on one event loop: the first done must not turn it on
    under the second, nor the last turn on a collector that was off before the first."""
    (gc.enable if enabled else gc.disable)()
    first, second = no_collections(), no_collections()
    try:
        first.__enter__()
        second.__enter__()
        first.__exit__(None, None, None)
        assert not gc.isenabled()
    finally:
        second.__exit__(None, None, None)
    try:
        assert gc.isenabled() is enabled
    finally:
        gc.enable()
