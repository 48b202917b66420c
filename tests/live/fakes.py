"""Fakes of the control plane's activities, for job workflows run on the real Temporal server;
and of a machine's GPUs whose NVML hangs, for its agent."""

from __future__ import annotations

import threading

from temporalio import activity

from workers.devices import FakeDevices

from workflows.types import (Admission, AttemptGrant, AttemptStopping, EndAttempt, JobRequest, JobStateChange,
                             StartAttempt, Wake)


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
    states set (checkpointing) recorded in ``states``, a cancel's mark of its attempt in ``marks``,
    each attempt's end in ``ends``."""

    def __init__(self):
        self.ends: list[EndAttempt] = []
        self.marks: list[AttemptStopping] = []
        self.states: list[str] = []

    @activity.defn(name="start_attempt")
    async def start_attempt(self, start: StartAttempt) -> AttemptGrant:
        return AttemptGrant(launch=True)

    @activity.defn(name="set_job_state")
    async def set_job_state(self, change: JobStateChange) -> None:
        self.states.append(change.state.value)

    @activity.defn(name="mark_attempt_stopping")
    async def mark_attempt_stopping(self, stopping: AttemptStopping) -> None:
        self.marks.append(stopping)

    @activity.defn(name="end_attempt")
    async def end_attempt(self, end: EndAttempt) -> None:
        self.ends.append(end)


class HangingDevices(FakeDevices):
    """Fake GPUs whose health call hangs, from its second call on, until released."""

    def __init__(self, count: int = 2):
        super().__init__(count)
        self.calls, self.release = 0, threading.Event()

    def health(self):
        self.calls += 1
        if self.calls > 1:
            self.release.wait(10)
        return super().health()
