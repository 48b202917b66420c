"""Why a job can never start on a cluster, in words naming the field at fault: what live admission
refuses a job with, and what the simulator rejects it with. Only machine shapes count."""

from __future__ import annotations

import pytest
from builders import fleet, job

from scheduler.never_fits import why_it_never_fits

TWO_BLOCKS = fleet(blocks=2, racks=1, machines=2, gpus=8)  # 16 GPUs per block, 8 per machine
WITH_INFERENCE = TWO_BLOCKS + fleet(blocks=1, first_block=9, machines=1, gpus=4, partition="inference")


@pytest.mark.parametrize("name, spec, machines, verdict", [
    ("a job that fits has no reason", job("a").gpus(8).spec(), TWO_BLOCKS, None),
    ("a GPU type the cluster lacks names the types it has", job("a").gpu_type("A100").spec(), TWO_BLOCKS,
     ("gpu_type", "no machine with GPU type A100 (it has H100)")),
    ("more memory than any GPU has names the most there is", job("a")._set(gpu_memory_gb=500).spec(), TWO_BLOCKS,
     ("gpu_memory_gb", "no GPU with 500 GB (the most is 80 GB)")),
    ("a machine-bound job larger than any machine", job("a").gpus(12).topology("machine").spec(), TWO_BLOCKS,
     ("num_gpus", "needs 12 GPUs on one machine; the largest has 8")),
    ("a job larger than any block", job("a").gpus(24).spec(), TWO_BLOCKS,
     ("num_gpus", "needs 24 GPUs in one block; the largest block has 16")),
    ("an inference job fits only the inference partition's machines", job("a").inference().gpus(8).spec(),
     WITH_INFERENCE, ("num_gpus", "needs 8 GPUs in one block; the largest block has 4")),
    ("a training job on a fleet of inference machines only", job("a").spec(),
     fleet(partition="inference"), ("kind", "no machine of the training partition")),
    ("an inference job fits a cluster without an inference partition", job("a").inference().gpus(8).spec(),
     TWO_BLOCKS, None),
    ("a job asking exactly its GPUs' memory fits", job("a")._set(gpu_memory_gb=80.0).spec(), TWO_BLOCKS, None),
])
def test_a_job_that_can_never_start_is_told_which_field_to_change(name, spec, machines, verdict):
    assert why_it_never_fits(spec, machines) == verdict, name
