"""Fakes of the control plane's activities, for job workflows run on the real Temporal server."""

from __future__ import annotations

from temporalio import activity

from workflows.types import Admission, AttemptGrant, EndAttempt, JobRequest, JobStateChange, StartAttempt, Wake


class Admitting:
    """The store activities a job workflow meets first: every job admitted to cluster c1; the
    scheduler's wake taken and dropped."""

    @activity.defn(name="admit_job")
    async def admit_job(self, request: JobRequest) -> Admission:
        return Admission(accepted=True, job_id=request.job_id, cluster="c1", reason="accepted")

    @activity.defn(name="wake_scheduler")
    async def wake_scheduler(self, wake: Wake) -> None:
        pass


class Launching(Admitting):
    """And the store activities of its attempts: every placement launched (from scratch), the
    checkpointing state taken, each attempt's end recorded in ``ends``."""

    def __init__(self):
        self.ends: list[EndAttempt] = []

    @activity.defn(name="start_attempt")
    async def start_attempt(self, start: StartAttempt) -> AttemptGrant:
        return AttemptGrant(launch=True)

    @activity.defn(name="set_job_state")
    async def set_job_state(self, change: JobStateChange) -> None:
        pass

    @activity.defn(name="end_attempt")
    async def end_attempt(self, end: EndAttempt) -> None:
        self.ends.append(end)
