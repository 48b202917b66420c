"""The collector is held back inside a cycle and put back exactly as it was afterwards."""

import gc

import pytest

from scheduler.gc_policy import YOUNG_THRESHOLD, few_collections


@pytest.mark.parametrize("freeze", [False, True], ids=["per cycle", "for a whole simulation"])
def test_thresholds_are_raised_inside_and_restored_after(freeze):
    before = gc.get_threshold()
    with few_collections(freeze=freeze):
        assert gc.get_threshold()[0] == YOUNG_THRESHOLD
    assert gc.get_threshold() == before


def test_thresholds_are_restored_when_the_cycle_fails():
    before = gc.get_threshold()
    with pytest.raises(RuntimeError):
        with few_collections():
            raise RuntimeError("the cycle failed")
    assert gc.get_threshold() == before


def test_what_was_set_aside_for_a_simulation_is_collectable_again_after_it():
    with few_collections(freeze=True):
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0
