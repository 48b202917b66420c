"""Fakes of the control plane's activities, for job workflows run on the real Temporal server."""

from __future__ import annotations

from temporalio import activity

from workflows.types import Admission, JobRequest, Wake


class Admitting:
    """The store activities a job workflow meets first: every job admitted to cluster c1; the
    scheduler's wake taken and dropped."""

    @activity.defn(name="admit_job")
    async def admit_job(self, request: JobRequest) -> Admission:
        return Admission(accepted=True, job_id=request.job_id, cluster="c1", reason="accepted")

    @activity.defn(name="wake_scheduler")
    async def wake_scheduler(self, wake: Wake) -> None:
        pass
