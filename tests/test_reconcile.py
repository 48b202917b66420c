"""Which job workflows count as ended when the scheduler loop looks for allocations nobody will
ever give back: only the server's word that a workflow is closed or unknown condemns one."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from temporalio.api.enums.v1 import WorkflowExecutionStatus as Status
from temporalio.service import RPCError, RPCStatusCode

from activities.jobs import JobActivities


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
