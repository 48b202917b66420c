"""Which job workflows count as ended when the scheduler loop looks for allocations nobody will
ever give back: only the server's word that a workflow is closed or unknown condemns one."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from temporalio.api.enums.v1 import WorkflowExecutionStatus as Status
from temporalio.service import RPCError, RPCStatusCode

from activities.jobs import JobActivities
from workflows.types import Reconcile


class FakeService:
    """Answers DescribeWorkflowExecution with a status per workflow id, or raises."""

    def __init__(self, answers: dict[str, int | RPCError]):
        self.answers = answers

    async def describe_workflow_execution(self, request):
        answer = self.answers[request.execution.workflow_id]
        if isinstance(answer, RPCError):
            raise answer
        return SimpleNamespace(workflow_execution_info=SimpleNamespace(status=answer))


def ended(answer) -> bool:
    client = SimpleNamespace(namespace="default", workflow_service=FakeService({"job-a": answer}))
    acts = JobActivities(store=None, client=client)
    [verdict] = asyncio.run(acts._workflows_ended([("", "a")]))
    return verdict


@pytest.mark.parametrize("name, answer, gone", [
    ("a running workflow is not ended", Status.WORKFLOW_EXECUTION_STATUS_RUNNING, False),
    ("a paused workflow (a status the SDK's enum does not know) is alive, only held",
     Status.WORKFLOW_EXECUTION_STATUS_PAUSED, False),
    ("a status newer than this code is taken as alive", 99, False),
    ("a terminated workflow has ended", Status.WORKFLOW_EXECUTION_STATUS_TERMINATED, True),
    ("a workflow that timed out has ended", Status.WORKFLOW_EXECUTION_STATUS_TIMED_OUT, True),
    ("a completed workflow has ended", Status.WORKFLOW_EXECUTION_STATUS_COMPLETED, True),
    ("a workflow the server does not know has ended", RPCError("gone", RPCStatusCode.NOT_FOUND, b""), True),
    ("a server that cannot answer now condemns nothing", RPCError("down", RPCStatusCode.UNAVAILABLE, b""), False),
])
def test_whether_a_job_workflow_has_ended(name, answer, gone):
    assert ended(answer) is gone


class FakeStore:
    """A cluster's queue, and the jobs the reconcile ends."""

    def __init__(self, queued: list[str]):
        self.queued, self.ended = queued, {}

    async def live_allocations(self, cluster):
        return []

    async def queued_jobs(self, cluster):
        return list(self.queued)

    async def end_attempt(self, job_id, allocation_id, end, exit_code, next_state, reason, **_):
        self.ended[job_id] = (allocation_id, next_state.value, reason)


class FakeClient:
    """Visibility lists closed job workflows by id (or cannot be asked); the service describes."""

    namespace = "default"

    def __init__(self, closed: list[str] | RPCError, statuses: dict[str, int | RPCError]):
        self.closed, self.workflow_service, self.queries = closed, FakeService(statuses), []

    async def list_workflows(self, query):
        self.queries.append(query)
        if isinstance(self.closed, RPCError):
            raise self.closed
        for workflow_id in self.closed:
            yield SimpleNamespace(id=workflow_id)


TERMINATED = Status.WORKFLOW_EXECUTION_STATUS_TERMINATED
RUNNING = Status.WORKFLOW_EXECUTION_STATUS_RUNNING
UNAVAILABLE = RPCError("down", RPCStatusCode.UNAVAILABLE, b"")


@pytest.mark.parametrize("name, queued, closed, statuses, failed", [
    ("a queued job whose workflow was terminated leaves the queue, failed",
     ["a", "b"], ["p-job-a"], {"p-job-a": TERMINATED}, ["a"]),
    ("a closed workflow whose job is not queued is left alone (its end is the allocations' business)",
     ["a"], ["p-job-b"], {"p-job-b": TERMINATED}, []),
    ("a workflow of another deployment's prefix is not this job's",
     ["a"], ["q-job-a"], {"q-job-a": TERMINATED}, []),
    ("a job whose workflow runs again under the same id (visibility lags) stays queued",
     ["a"], ["p-job-a"], {"p-job-a": RUNNING}, []),
    ("a server that cannot describe the workflow now condemns nothing",
     ["a"], ["p-job-a"], {"p-job-a": UNAVAILABLE}, []),
    ("visibility that cannot be asked now condemns nothing",
     ["a"], UNAVAILABLE, {"p-job-a": TERMINATED}, []),
    ("an empty queue asks visibility nothing", [], ["p-job-a"], {"p-job-a": TERMINATED}, []),
])
def test_which_queued_jobs_the_reconcile_ends(name, queued, closed, statuses, failed):
    store, client = FakeStore(queued), FakeClient(closed, statuses)
    acts = JobActivities(store=store, client=client)
    count = asyncio.run(acts.reconcile_allocations(Reconcile(cluster="c1", workflow_id_prefix="p-")))
    assert sorted(store.ended) == failed and count == len(failed)
    for allocation, state, reason in store.ended.values():
        assert (allocation, state) == (None, "failed") and "ended while the job was queued" in reason
    assert len(client.queries) == (1 if queued else 0)


@pytest.mark.parametrize("name, cluster, narrowed", [
    ("a plain cluster name narrows the visibility query", "gpu-east.1", True),
    ("a name that cannot be quoted safely is left out of it", "it's", False),
])
def test_the_visibility_query_names_the_cluster_only_when_it_can(name, cluster, narrowed):
    client = FakeClient([], {})
    acts = JobActivities(store=FakeStore(["a"]), client=client)
    asyncio.run(acts.reconcile_allocations(Reconcile(cluster=cluster, workflow_id_prefix="")))
    [query] = client.queries
    assert (f"Cluster = '{cluster}' OR Cluster IS NULL" in query) is narrowed
    assert "ExecutionStatus != 'Running'" in query and "'succeeded'" not in query and "'queued'" in query
    # A run that continued as new is closed and queued, but its job lives on in the next run.
    assert "ExecutionStatus != 'ContinuedAsNew'" in query
    # A workflow terminated while its admission ran published neither (before, it was never found).
    assert "OR JobState IS NULL" in query
