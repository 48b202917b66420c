"""A gang whose ranks' run orders together pass what one message to Temporal may carry (gRPC's
4 MiB): each rank's order carries the job's command and env and the gang's machine list, so many
machines, or a large command, make the attempt's orders too big to send in one workflow task.
They are sent a few at a time, each batch in a task of its own, and every rank runs. Orders that
together would outgrow what a job's history can take (Temporal ends it at 50 MiB: a lost job)
fail the job instead, with the reason and the fix; where even the fewest machines the job can
span would make them so, it is refused at submit."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from datetime import timedelta

import pytest
from temporalio import activity
from temporalio.client import Client, WorkflowFailureError
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Worker

from activities.rows import admission_verdict
from live.fakes import Launching
from workflows.job import JobWorkflow
from workflows.types import (
    EndReason,
    GpuGrant,
    HostGrant,
    JobRequest,
    JobState,
    PlacementSignal,
    RunJobInput,
    RunJobResult,
    agent_task_queue,
)


class Ranks(Launching):
    """Each rank's run exits 0 at once, noting which rank it was and what it was told."""

    def __init__(self):
        super().__init__()
        self.ran: list[RunJobInput] = []

    @activity.defn(name="run_job")
    async def run_job(self, run: RunJobInput) -> RunJobResult:
        self.ran.append(run)
        return RunJobResult(exit_code=0, log_path="/dev/null")

    def activities(self) -> list:
        return [self.admit_job, self.wake_scheduler, self.start_attempt, self.run_job, self.end_attempt]


async def run_a_gang(address: str, machines: int, spec_bytes: int, id_chars: int, char: str = "x") -> Ranks:
    """A gang of ``machines`` whose command and env are ``spec_bytes`` each of ``char`` (in
    UTF-8), on machines with ids of ``id_chars`` characters."""
    client = await Client.connect(address, data_converter=pydantic_data_converter)
    tag = uuid.uuid4().hex[:8]
    # Every rank on one machine id (one worker serves them all: the orders are what is tried),
    # of `id_chars` characters, as long as the gang's list of machines makes it.
    queue = f"m-{tag}-".ljust(id_chars, "x")
    fakes = Ranks()
    async with Worker(client, task_queue="gpusched-control-" + queue, workflows=[JobWorkflow],
                      activities=fakes.activities()), \
            Worker(client, task_queue=agent_task_queue(queue), activities=fakes.activities(),
                   max_concurrent_activities=1000):
        request = JobRequest(job_id=f"gang-{tag}", team="vision", num_gpus=machines,
                             command=["train", char * (spec_bytes // len(char.encode()))],
                             env={"BIG": char * (spec_bytes // len(char.encode()))})
        handle = await client.start_workflow("JobWorkflow", request.model_dump(mode="json"), id=request.job_id,
                                             task_queue="gpusched-control-" + queue,
                                             execution_timeout=timedelta(minutes=3))
        await handle.signal(JobWorkflow.placement, PlacementSignal(allocation_id=1, attempt=1, hosts=[
            HostGrant(machine_id=queue, gpus=[GpuGrant(index=0, path=f"{queue}/{i}")]) for i in range(machines)]))
        for _ in range(1200):  # 60 s
            if fakes.ends:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError(f"the attempt never ended ({len(fakes.ran)} ranks ran): {await handle.describe()}")
        with contextlib.suppress(WorkflowFailureError):
            await asyncio.wait_for(handle.result(), 30)
    return fakes


@pytest.mark.live
@pytest.mark.parametrize("name, machines, spec_bytes, id_chars, char", [
    ("twenty machines with the largest command and env the API takes", 20, 128 * 1024 - 100, 12, "x"),
    ("the same in characters of four bytes (orders are measured in bytes, not characters)",
     20, 128 * 1024 - 100, 12, "\U0001F600"),
    ("five hundred machines of 40-character ids with a small command", 500, 100, 40, "x"),
])
def test_every_rank_of_a_gang_too_big_for_one_message_runs(live_servers, name, machines, spec_bytes, id_chars, char):
    fakes = asyncio.run(run_a_gang(live_servers.temporal_address, machines, spec_bytes, id_chars, char))
    assert sorted(int(r.env["GPUSCHED_NODE_RANK"]) for r in fakes.ran) == list(range(machines))
    assert [(e.next_state, e.allocation_id) for e in fakes.ends] == [(JobState.succeeded, 1)]


@pytest.mark.live
def test_a_gang_whose_orders_would_outgrow_its_history_fails_saying_why(live_servers):
    """240 machines with the largest command and env: 60 MiB of orders, where the server ended
    the workflow once its history passed 50 MiB."""
    fakes = asyncio.run(run_a_gang(live_servers.temporal_address, 240, 128 * 1024 - 100, 12))
    assert fakes.ran == []
    [end] = fakes.ends
    assert (end.next_state, end.end_reason) == (JobState.failed, EndReason.failed)
    assert "over 240 machines" in end.reason and "make the command and env smaller" in end.reason


def capacity(machines: int, gpus: int = 8, cluster: str = "c1") -> list[dict]:
    """The admission's rows of a cluster of ``machines`` alike."""
    return [dict(cluster=cluster, block=f"b{i // 128}", id=f"{cluster}/m{i}", gpu_type="H100", gpu_memory_gb=80.0,
                 partition="training", gpus=gpus) for i in range(machines)]


KIB = 1024
# (sentence, GPUs, command bytes, env bytes, the field refused or None when accepted)
AT_SUBMIT = [
    ("a gang whose fewest machines could never be sent the largest command and env is refused at submit",
     200 * 8, 128 * KIB - 100, 40 * KIB, "command"),
    ("the same where the env is the larger names the env", 200 * 8, 40 * KIB, 128 * KIB - 100, "env"),
    ("a gang of 128 machines with the same command and env is accepted (21 MiB of orders)",
     128 * 8, 128 * KIB - 100, 40 * KIB, None),
    ("a whole cluster's gang with a small command is accepted", 640 * 8, 100, 100, None),
]


@pytest.mark.parametrize("sentence, gpus, command, env, field", AT_SUBMIT, ids=[row[0] for row in AT_SUBMIT])
def test_a_gang_whose_orders_could_never_go_out_is_refused_at_submit_naming_the_field(sentence, gpus, command, env, field):
    request = JobRequest(job_id="big", team="vision", num_gpus=gpus, topology="any",
                         command=["train", "x" * (command - 5)],
                         env={"BIG": "y" * (env - 3)})
    quota = dict(guaranteed=0, max_gpus=None, queue_cap=None)
    verdict = admission_verdict(request, quota, capacity(640), waiting=0)
    assert verdict.accepted == (field is None), verdict.reason
    if field is not None:
        assert verdict.field == field
        assert f"the {gpus // 8} machines or more its {gpus} GPUs span" in verdict.reason
        assert "make them smaller" in verdict.reason
