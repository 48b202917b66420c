"""A test's own stack on the shared live servers, and a client on it with the helpers the live
tests share: ``stack(machines=2, gpus=4, control_args=[...])`` returns a ``Stack``."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import pytest

from scheduler.models import Quota
from workers import devstack
from workers.client import GpuschedClient
from workflows.types import JobRequest

# Prints when it ran and where, so the tests can check pinning and overlap from the processes' side.
REPORT = ("import os, sys, time; print('RAN', time.time(), os.environ['CUDA_VISIBLE_DEVICES'], "
          "os.environ['GPUSCHED_GPUS'], flush=True); time.sleep(float(sys.argv[1])); "
          "print('DONE', time.time(), flush=True)")


def sleeper(seconds: float) -> list[str]:
    return [sys.executable, "-c", REPORT, str(seconds)]


def example_job(steps: int, step_seconds: float) -> list[str]:
    """The bundled example job (checkpoints through jobkit), waiting out its steps: their work
    only took the CPU from the stack under test (tests/test_example_job.py runs the work)."""
    return [sys.executable, "-m", "workers.example_job", "--steps", str(steps),
            "--step-seconds", str(step_seconds), "--backend", "idle"]


class Stack:
    """One test's stack and a client on it, with the helpers the tests share."""

    def __init__(self, up: devstack.UpResult):
        self.up = up
        self.data_dir = Path(up.data_dir)
        self.loop = asyncio.new_event_loop()
        self.client = self.run(GpuschedClient.connect(up.settings))
        self.run(self.client.set_quota("vision", Quota(guaranteed=8, max=64)))

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    def submit(self, job_id: str, gpus: int, command: list[str], team: str = "vision", **kw) -> None:
        self.run(self.client.submit(JobRequest(job_id=job_id, team=team, num_gpus=gpus, command=command, **kw)))

    def wait(self, job_id: str, timeout: float = 60):
        return self.run(self.client.wait(job_id, timeout))

    def status(self, job_id: str):
        return self.run(self.client.status(job_id))

    def until(self, what, timeout: float = 30, every: float = 0.1):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = what()
            if value:
                return value
            time.sleep(every)
        raise AssertionError(f"not within {timeout} s: {what.__doc__ or what}")

    def log(self, job_id: str, attempt: int = 1) -> str:
        logs = sorted(self.data_dir.glob(f"jobs/*/{job_id}/attempt-{attempt}.log"))
        return "".join(p.read_text() for p in logs)

    def sql(self, query: str, *args):
        return self.run(self.client.store.pool.fetch(query, *args))

    def close(self) -> None:
        self.run(self.client.close())
        self.loop.close()


@pytest.fixture
def stack(live_stack):
    made = []

    def start(machines: int = 2, gpus: int = 4, control_args: list[str] | None = None,
              policy: dict | None = None, machine_timeout: float | None = None) -> Stack:
        made.append(Stack(live_stack(machines=machines, gpus_per_machine=gpus, ui=False,
                                     control_args=["--tick", "0.5", *(control_args or [])])))
        if policy is not None or machine_timeout is not None:
            made[-1].run(made[-1].client.store.configure_cluster("c1", policy=policy,
                                                                 machine_timeout=machine_timeout))
        return made[-1]

    yield start
    for s in made:
        s.close()
