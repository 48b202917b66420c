"""The machine agent: one process per machine that runs the jobs placed there.

    python -m workers.agent --machine-id c1/b0/r0/m0 [--data-dir DIR] [--gpus 8]
        [--gpu-type H100] [--fake-devices | --nvml] [--heartbeat-interval 2.0]
        [--grace-period 120] [--orphan-grace 5] [--max-log-mb 2048]

What it does, in order:
1. Reads the settings (flags over ``GPUSCHED_*`` over ``DIR/stack.json``) and finds the GPUs:
   NVML, or fake GPUs when the machine has no NVIDIA GPU or ``--fake-devices`` is given (their
   faults are injected through ``DIR/faults/agent-<machine>.json``). A machine with NVIDIA GPUs
   whose NVML fails does not start: it would offer GPUs it cannot watch.
2. Stops job processes an earlier agent of this machine left behind (it died without stopping
   them).
3. Registers the machine: heartbeats the HTTP API until it answers (about 30 s at most), so the
   machine is in the fleet before the worker takes work.
4. Serves ``run_job``, ``attach_job`` and ``stop_job`` on the machine's task queue
   (``NodeActivities``; logs under ``DIR/jobs``), and writes its ready file once the worker polls.
5. Heartbeats every interval: ``POST {api}/machines/{machine_id}/heartbeat`` with the body of
   ``heartbeat_payload``. The answer's ``live_allocations``, when present, lists the
   allocations the scheduler holds here; a local process of any other is an orphan and is
   stopped (it is confirmed over two heartbeats first, so one odd answer kills nothing). Each
   says whether the machine takes work (``accepting_work``): not before the worker polls, not
   while Temporal does not answer its health check (every ``TEMPORAL_CHECK_EVERY`` s), and not
   from a shutdown on; the scheduler places nothing on it meanwhile.
6. On SIGTERM/SIGINT: says at once that it takes no more work, then shuts the worker down, which
   stops each job with its grace (capped by ``--grace-period``) and fails its attempt with
   ``AgentShutdown``; heartbeats continue until the jobs are gone. A second signal kills the
   jobs at once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
from datetime import timedelta
from pathlib import Path
from typing import Callable, TypeVar

import httpx

from activities.node import NodeActivities, pid_dir
from activities.run_processes import stop_left_runs
from workers.arg_types import gpu_type
from workers.devices import NVML_ERROR, DeviceBackend, GpuHealth, GpuInfo, detect_devices, kills_processes
from workers.settings import (
    EXIT_NOT_REACHABLE,
    NotReachable,
    Settings,
    SettingsError,
    agent_log_dir,
    api_headers,
    connect_temporal,
    keep_connecting,
    loopback_without_proxy,
    default_data_dir,
    add_settings_flags,
    settings_from_args,
    machine_component,
    mark_ready,
    ready_path,
    temporal_tls,
)

log = logging.getLogger("gpusched.agent")

REGISTER_WITHIN = 30.0  # seconds to wait for the API before serving anyway
HEARTBEAT_THROTTLE = 2.0  # seconds between activity heartbeats sent to Temporal, at most: a stop
# (preemption, cancel) reaches the job with the next one, so this bounds how late it learns of it
CONNECT_WITHIN = 60.0  # seconds to wait for Temporal before giving up (the supervisor restarts us)
DESCRIBE_WITHIN = 5.0  # seconds: whether a watch's workflow still runs, asked when the server gave up on the watch
TEMPORAL_CHECK_EVERY = 15.0  # seconds between health checks of Temporal (one RPC; cheap fleet-wide)
TEMPORAL_CHECK_TIMEOUT = 5.0


def heartbeat_payload(pid: int, inventory: list[GpuInfo], health: list[GpuHealth],
                      running_allocations: list[int], accepting_work: bool = True) -> dict:
    """The body of a machine heartbeat: each GPU as it is and how it is, the allocations with a
    live process here, and whether the agent takes new work."""
    by_index = {h.index: h for h in health}
    gpus = []
    for info in inventory:
        h = by_index.get(info.index, GpuHealth(index=info.index, healthy=True, faults=[]))
        gpus.append({"index": info.index, "gpu_type": info.gpu_type, "memory_gb": info.memory_gb,
                     "healthy": h.healthy, "faults": list(h.faults)})
    return {"pid": pid, "gpus": gpus, "running_allocations": sorted(running_allocations),
            "accepting_work": accepting_work}


LINGERING = "lingering"  # the fault of a GPU that an ended job's unkillable processes still hold


def with_lingering(health: list[GpuHealth], lingering: set[int]) -> list[GpuHealth]:
    """The GPUs' health with those that ended jobs' surviving processes hold reported sick."""
    if not lingering:
        return health
    return [GpuHealth(index=h.index, healthy=False, faults=[*h.faults, LINGERING]) if h.index in lingering else h
            for h in health]


def checkpoint_env(settings: Settings) -> dict[str, str]:
    """What a job needs to write its checkpoints: the store's endpoint and credentials (and
    nothing else of the agent's settings)."""
    values = {"GPUSCHED_S3_ENDPOINT": settings.s3_endpoint, "GPUSCHED_S3_ACCESS_KEY": settings.s3_access_key,
              "GPUSCHED_S3_SECRET_KEY": settings.s3_secret_key, "GPUSCHED_S3_REGION": settings.s3_region}
    return {k: v for k, v in values.items() if v}


async def forward_checkpoint(http: httpx.AsyncClient, api_url: str, job_id: str, allocation_id: int,
                             report: dict) -> dict:
    """Hand a job's checkpoint report to the control plane with the attempt's allocation id.
    Connection errors raise (the report is tried again); a refusal is an answer."""
    response = await http.post(f"{api_url.rstrip('/')}/jobs/{job_id}/checkpoints",
                               json={"allocation_id": allocation_id, "report": report})
    _raise_unless_answered(response)
    if not response.is_success:
        return {"committed": False, "reason": f"HTTP {response.status_code}: {response.text[:300]}"}
    return response.json()


async def forward_restart(http: httpx.AsyncClient, api_url: str, job_id: str, allocation_id: int,
                          report: dict) -> dict:
    """Hand a resumed job's restart time to the control plane. Connection errors and server
    errors raise (tried again); a refusal (an allocation not the job's) is an answer."""
    response = await http.post(f"{api_url.rstrip('/')}/jobs/{job_id}/restarts",
                               json={"allocation_id": allocation_id, "seconds": float(report["seconds"])})
    _raise_unless_answered(response)
    return {"recorded": response.is_success}


def _raise_unless_answered(response: httpx.Response) -> None:
    """Raise (the report is sent again) unless the control plane judged the report: a server
    error, or a request it did not take from us (a wrong or missing token, while tokens are being
    rolled out), is no verdict on the report."""
    if response.status_code >= 500 or response.status_code in (401, 403):
        response.raise_for_status()


def heartbeat_url(api_url: str, machine_id: str) -> str:
    # The machine id's slashes stay path segments: the API routes /machines/{id:path}/heartbeat.
    return f"{api_url.rstrip('/')}/machines/{machine_id.strip('/')}/heartbeat"


class OrphanWatch:
    """Which local allocations the scheduler no longer holds. An allocation is an orphan once
    ``confirm`` consecutive answers leave it out while it was in the heartbeat they answered."""

    def __init__(self, confirm: int = 2):
        self.confirm = confirm
        self.misses: dict[int, int] = {}

    def update(self, sent_running: list[int], live: list[int] | None) -> list[int]:
        if live is None:
            return []  # an API that does not say which are live condemns nothing
        live_set = set(live)
        misses = {a: self.misses.get(a, 0) + 1 for a in sent_running if a not in live_set}
        self.misses = misses
        return sorted(a for a, n in misses.items() if n >= self.confirm)


T = TypeVar("T")


def on_a_thread_of_its_own(call: Callable[[], T]) -> asyncio.Future[T]:
    """``call()`` on a daemon thread of its own, its answer in the future returned. Not
    asyncio.to_thread: asyncio.run waits for the default executor's threads at its end, and the
    interpreter for them at exit, so one NVML call that never returns kept a stopped agent from
    ever exiting (its jobs stopped, the process alive until SIGKILL)."""
    loop = asyncio.get_running_loop()
    answer: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if answer.done():
            return
        if error is not None:
            answer.set_exception(error)
        else:
            answer.set_result(result)

    def run() -> None:
        try:
            result, error = call(), None
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting side
            result, error = None, e
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name=getattr(call, "__name__", "call"), daemon=True).start()
    return answer


class HealthReader:
    """Reads the GPUs' health for each heartbeat without letting a hung NVML call stop the
    heartbeats (a machine that stops heartbeating has every job on it requeued): one call at a
    time, each waited for at most ``timeout`` seconds. While one hangs, the last reading stands
    for up to ``stale_for`` seconds; after that every GPU is reported unhealthy (``nvml_error``),
    so its jobs checkpoint and move, while the machine itself stays reachable."""

    def __init__(self, devices: DeviceBackend, timeout: float, stale_for: float = 60.0):
        self.devices = devices
        self.timeout = timeout
        self.stale_for = stale_for
        self._call: asyncio.Future | None = None
        self._asked_at = 0.0
        self._last: list[GpuHealth] | None = None
        self._indices = [g.index for g in devices.inventory()]  # asked once: NVML may hang later

    async def read(self) -> list[GpuHealth]:
        loop = asyncio.get_running_loop()
        call, _ = self._the_call()
        try:
            readings = await self._answer(call)
        except TimeoutError:  # still running: the next heartbeat waits for the same call
            hung = loop.time() - self._asked_at
            if self._last is not None and hung < self.stale_for:
                log.warning("GPU health check has not answered for %.0f s; reporting the last reading", hung)
                return self._last
            log.error("GPU health check has not answered for %.0f s; reporting every GPU unhealthy", hung)
            return self._all_unhealthy()
        except Exception:
            log.exception("GPU health check failed; reporting every GPU unhealthy")
            return self._all_unhealthy()
        return readings

    async def read_fresh(self) -> list[GpuHealth] | None:
        """A reading asked for now, not one asked before (a job that just died may have died of a
        fault an earlier reading had not seen): the call in flight first, if any, then a new one.
        None when NVML does not answer within ``timeout``, or fails: as a GPU falling off the bus
        often makes it."""
        since = asyncio.get_running_loop().time()
        while True:
            call, asked_at = self._the_call()
            try:
                readings = await self._answer(call)
            except Exception:  # a timeout included
                return None
            if asked_at >= since:
                return readings

    def _the_call(self) -> tuple[asyncio.Future, float]:
        """The health call in flight, or a new one; and when it was asked."""
        if self._call is None:
            self._call = on_a_thread_of_its_own(self.devices.health)  # NVML calls block
            self._asked_at = asyncio.get_running_loop().time()
        return self._call, self._asked_at

    async def _answer(self, call: asyncio.Future) -> list[GpuHealth]:
        """The call's readings, waited for at most ``timeout`` (TimeoutError: it runs on, and is
        waited for again next time); the next reading is a new call."""
        try:
            readings = await asyncio.wait_for(asyncio.shield(call), self.timeout)
        except TimeoutError:
            raise
        except Exception:
            if self._call is call:
                self._call = None
            raise
        if self._call is call:  # another reader may have asked a new one since
            self._call = None
        self._last = readings
        return readings

    def _all_unhealthy(self) -> list[GpuHealth]:
        return [GpuHealth(index=i, healthy=False, faults=[NVML_ERROR]) for i in self._indices]


class Agent:
    """The agent's own duties around the worker: heartbeats, registration, orphans."""

    def __init__(self, machine_id: str, settings: Settings, devices: DeviceBackend,
                 node: NodeActivities, interval: float, orphan_grace: float):
        self.machine_id = machine_id
        self.settings = settings
        self.devices = devices
        self.node = node
        self.interval = interval
        self.orphan_grace = orphan_grace
        self.inventory = devices.inventory()
        self.health_reader = HealthReader(devices, timeout=max(1.0, interval))
        self.orphans = OrphanWatch()
        self.url = heartbeat_url(settings.api_url, machine_id)
        self.http = httpx.AsyncClient(timeout=max(2.0, interval * 2), headers=api_headers(settings, machine_id))
        self._api_state_was: str | None = None  # "answers", "unreachable" or "refused <status>"
        self._tasks: set[asyncio.Task] = set()  # references, so the tasks are not collected
        self._killing: set[int] = set()
        self.serving = False  # the worker polls, and no shutdown has begun
        self.temporal_ok = True  # Temporal answered the last health check

    @property
    def accepting_work(self) -> bool:
        return self.serving and self.temporal_ok

    # -- heartbeats -------------------------------------------------------------------------

    async def health(self) -> list[GpuHealth]:
        return await self.health_reader.read()

    async def failing_gpus(self, indices: list[int]) -> list[str]:
        """The faults that could kill a process that these GPUs show now ("GPU 3: xid:79"),
        asked when a job fails. Any, and a heartbeat goes out at once: the scheduler must know the
        GPU is sick before the job, requeued, comes up in its next cycle."""
        wanted = set(indices)
        readings = await self.health_reader.read_fresh()
        if readings is None:
            faults = [f"GPU {i}: {NVML_ERROR} (its health check did not answer as the job died)"
                      for i in sorted(wanted)]
        else:
            faults = [f"GPU {r.index}: {fault}" for r in sorted(readings, key=lambda r: r.index)
                      if r.index in wanted for fault in r.faults if kills_processes(fault)]
        if faults:
            try:
                await self.heartbeat(reap=False)  # orphans are confirmed over the regular beats
            except Exception:
                log.exception("could not report the failing GPUs at once; the next heartbeat will")
        return faults

    async def heartbeat(self, reap: bool = True) -> httpx.Response | None:
        """One heartbeat; the response, or None when the API could not be reached. ``reap``:
        count the allocations the answer does not hold toward stopping them as orphans."""
        running = self.node.live_allocations()
        health = with_lingering(await self.health(), self.node.lingering_gpus())
        payload = heartbeat_payload(os.getpid(), self.inventory, health, running, self.accepting_work)
        try:
            response = await self.http.post(self.url, json=payload)
        except httpx.HTTPError as err:
            self._api_state("unreachable", f"API unreachable at {self.url}: {err!r}")
            return None
        if response.is_success:
            self._api_state("answers", "API answers heartbeats")
            if reap:
                self._reap_orphans(running, response)
        else:
            self._api_state(f"refused {response.status_code}", f"heartbeat refused: HTTP {response.status_code} "
                                   f"{response.text[:200]}")
        return response

    def _api_state(self, state: str, message: str) -> None:
        # Log changes, not every beat: a down API would otherwise fill the log every interval. A
        # change from unreachable to refused is one: the agent started before its API, which then
        # refused every heartbeat (a wrong token, a heartbeat it cannot take), was silent before.
        if state != self._api_state_was:
            (log.info if state == "answers" else log.warning)(message)
        self._api_state_was = state

    def _reap_orphans(self, sent: list[int], response: httpx.Response) -> None:
        try:
            body = response.json()
        except ValueError:
            return
        live = body.get("live_allocations") if isinstance(body, dict) else None
        for alloc in self.orphans.update(sent, live if isinstance(live, list) else None):
            if alloc in self.node.processes and alloc not in self._killing:
                self._killing.add(alloc)
                self._in_background(self._kill_orphan(alloc))

    async def _kill_orphan(self, alloc: int) -> None:
        log.warning("allocation %d is no longer held by the scheduler: stopping its process "
                    "(%gs grace)", alloc, self.orphan_grace)
        try:
            result = await self.node.kill_allocation(alloc, self.orphan_grace)
            log.warning("orphan allocation %d stopped: %s", alloc, result)
        finally:
            self._killing.discard(alloc)

    async def register(self, stop: asyncio.Event) -> bool:
        """Heartbeat until the API answers (a 5xx is not an answer), backing off, for at most
        ``REGISTER_WITHIN`` seconds. Serving without it works once the API is back."""
        loop = asyncio.get_running_loop()
        deadline, delay = loop.time() + REGISTER_WITHIN, 0.25
        while not stop.is_set():
            response = await self.heartbeat()
            if response is not None and response.status_code < 500:
                return response.is_success
            if loop.time() + delay > deadline:
                log.warning("API did not answer within %gs; serving anyway", REGISTER_WITHIN)
                return False
            await _sleep_or_stop(stop, delay)
            delay = min(delay * 2, 4.0)
        return False

    async def heartbeat_forever(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            try:
                await self.heartbeat()
            except Exception:
                log.exception("heartbeat failed")
            await asyncio.sleep(max(0.0, self.interval - (loop.time() - started)))

    def stop_taking_work(self) -> None:
        """From now on every heartbeat says the machine takes no work, the first at once."""
        self.serving = False
        self.beat_now()

    def beat_now(self) -> None:
        """A heartbeat now, beside the regular ones: a change of whether it takes work."""
        self._in_background(self.heartbeat(reap=False))

    def _in_background(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def watch_temporal(self, client, stop: asyncio.Event) -> None:
        """Ask Temporal's health every TEMPORAL_CHECK_EVERY s: an agent that reaches the API but
        not Temporal must not take work its worker cannot pick up."""
        while not stop.is_set():
            try:
                ok = await asyncio.wait_for(client.service_client.check_health(), TEMPORAL_CHECK_TIMEOUT)
            except Exception as err:  # unreachable, timed out, refused: all the same here
                ok, why = False, repr(err)
            else:
                why = "it answered not serving"
            if ok != self.temporal_ok:
                if ok:
                    log.info("Temporal answers again: taking work")
                else:
                    log.warning("Temporal does not answer its health check (%s): taking no work", why)
                self.temporal_ok = ok
                self.beat_now()
            await _sleep_or_stop(stop, TEMPORAL_CHECK_EVERY)

    async def close(self) -> None:
        await self.http.aclose()
        self.devices.close()


PRUNE_EVERY = 3600.0  # seconds between looks for old attempt logs


async def prune_forever(node: NodeActivities, older_than: float, stop: asyncio.Event) -> None:
    """Delete old attempt logs now and every hour (in a thread: a big directory takes a while)."""
    while not stop.is_set():
        try:
            pruned = await asyncio.to_thread(node.prune_logs, older_than, node.live_job_dirs())
            if pruned:
                log.info("deleted %d attempt log(s) and report folder(s) older than %.0f days",
                         pruned, older_than / 86400)
        except Exception:
            log.exception("pruning old attempt logs failed; trying again in an hour")
        await _sleep_or_stop(stop, PRUNE_EVERY)


async def _sleep_or_stop(stop: asyncio.Event, seconds: float) -> None:
    try:
        await asyncio.wait_for(stop.wait(), timeout=seconds)
    except TimeoutError:
        pass


async def connect(settings: Settings, stop: asyncio.Event):
    # The SDK raises RuntimeError for a refused connection.
    return await keep_connecting(f"Temporal at {settings.temporal_address}", lambda: connect_temporal(settings),
                                 stop, within=CONNECT_WITHIN)


async def workflow_running(client, workflow_id: str) -> bool | None:
    """Whether the workflow runs (False: it ended, or the server knows none of that id; None:
    the server cannot say now)."""
    from temporalio.client import WorkflowExecutionStatus
    from temporalio.service import RPCError, RPCStatusCode

    try:
        described = await asyncio.wait_for(client.get_workflow_handle(workflow_id).describe(), DESCRIBE_WITHIN)
    except RPCError as err:
        return False if err.status == RPCStatusCode.NOT_FOUND else None
    except Exception:  # unreachable, or no answer in time
        return None
    return described.status == WorkflowExecutionStatus.RUNNING


async def serve(args: argparse.Namespace) -> int:
    from temporalio.worker import Worker

    data_dir = Path(args.data_dir).expanduser()
    component = machine_component(args.machine_id)
    settings = settings_from_args(args, data_dir)

    async def cannot_start(why: str) -> int:
        log.error("%s", why)
        # Jobs an earlier agent of this machine left running (it was killed) run on whatever NVML
        # says now (a driver upgraded under them), while the scheduler, hearing no agent, starts
        # them elsewhere: two copies writing one checkpoint prefix. Stop them, as an agent that
        # starts would; their pid files stay for the next agent to forward what they saved.
        left = pid_dir(agent_log_dir(data_dir, args.machine_id), args.machine_id)
        for alloc in await asyncio.to_thread(stop_left_runs, left, args.orphan_grace):
            log.warning("stopped allocation %d, left running by an earlier agent", alloc)
        return 2

    try:
        temporal_tls(settings)  # a TLS file that cannot be read: no wait for Temporal mends it
    except SettingsError as err:
        return await cannot_start(str(err))
    fake = True if args.fake_devices else (False if args.nvml else None)
    try:
        devices = detect_devices(fake, args.gpus, args.gpu_type,
                                 fault_file=data_dir / "faults" / f"{component}.json",
                                 xid_file=data_dir / "faults" / f"{component}-xids.json")
    except Exception as err:  # NVML missing or failing where it is required or GPUs are present
        return await cannot_start(f"no GPUs: {err}")
    # One log folder per machine: the parts of a multi-machine gang would otherwise share a file.
    reports = httpx.AsyncClient(timeout=30.0, headers=api_headers(settings, args.machine_id))
    node = NodeActivities(args.machine_id, agent_log_dir(data_dir, args.machine_id),
                          shutdown_grace=args.grace_period,
                          report_sink=lambda job, alloc, report: forward_checkpoint(reports, settings.api_url,
                                                                                    job, alloc, report),
                          checkpoint_env=checkpoint_env(settings),
                          restart_sink=lambda job, alloc, report: forward_restart(reports, settings.api_url,
                                                                                  job, alloc, report),
                          max_log_bytes=int(args.max_log_mb * 2**20) if args.max_log_mb else None)
    agent = Agent(args.machine_id, settings, devices, node, args.heartbeat_interval,
                  args.orphan_grace)
    node.gpu_faults = agent.failing_gpus
    log.info("agent of %s: %d %s GPUs (%s), API %s, Temporal %s, queue %s", args.machine_id,
             len(agent.inventory), ",".join(sorted({g.gpu_type for g in agent.inventory})),
             devices.kind, settings.api_url, settings.temporal_address,
             settings.agent_task_queue(args.machine_id))

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal(signum: int) -> None:
        if stop.is_set():
            log.warning("second %s: killing every job now", signal.Signals(signum).name)
            node.kill_all_now()
            os._exit(1)
        log.info("%s: shutting down (jobs get their grace)", signal.Signals(signum).name)
        agent.stop_taking_work()
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)

    beats: asyncio.Task | None = None
    pruning: asyncio.Task | None = None
    watching: asyncio.Task | None = None
    worker_task: asyncio.Task | None = None
    code = 0
    try:
        for alloc in await node.reap_leftovers(grace=args.orphan_grace):
            log.warning("stopped allocation %d, left running by an earlier agent", alloc)
        await agent.register(stop)
        if stop.is_set():
            return 0
        beats = asyncio.create_task(agent.heartbeat_forever())
        if args.keep_logs_days:
            pruning = asyncio.create_task(prune_forever(node, args.keep_logs_days * 86400, stop))
        client = await connect(settings, stop)
        if client is None:
            return 0
        node.workflow_running = lambda workflow_id: workflow_running(client, workflow_id)
        worker = Worker(
            client,
            task_queue=settings.agent_task_queue(args.machine_id),
            activities=[node.run_job, node.attach_job, node.stop_job],
            max_concurrent_activities=64,
            # A cancel reaches a job only with a heartbeat's answer, and the SDK sends them at
            # most every 0.8 x heartbeat timeout (30 s without one): cap it so a preemption's
            # SIGTERM goes out within seconds, at ~1 heartbeat RPC per job per 5 s.
            max_heartbeat_throttle_interval=timedelta(seconds=HEARTBEAT_THROTTLE),
            default_heartbeat_throttle_interval=timedelta(seconds=HEARTBEAT_THROTTLE),
            # Jobs stop on the shutdown event with at most --grace-period; a margin for SIGKILL.
            graceful_shutdown_timeout=timedelta(seconds=args.grace_period + 10),
        )
        worker_task = asyncio.create_task(worker.run())
        while not worker.is_running and not worker_task.done():
            await asyncio.sleep(0.05)
        if worker.is_running and not stop.is_set():
            agent.serving = True
            agent.beat_now()
            watching = asyncio.create_task(agent.watch_temporal(client, stop))
            mark_ready(data_dir, component)
            log.info("serving %s", settings.agent_task_queue(args.machine_id))
        stop_wait = asyncio.create_task(stop.wait())
        await asyncio.wait((worker_task, stop_wait), return_when=asyncio.FIRST_COMPLETED)
        stop_wait.cancel()
        if worker_task.done():
            worker_task.result()  # the worker failed: raise it here
        await worker.shutdown()
        await worker_task
    except NotReachable as err:  # Temporal down for the whole wait at start: one line
        log.error("%s", err)
        code = EXIT_NOT_REACHABLE
    except Exception:
        log.exception("agent failed")
        code = 1
    finally:
        # Processes no activity watches any more (a forgotten attempt) go too.
        await node.stop_all(args.orphan_grace)
        node.kill_all_now()
        if beats is not None:
            beats.cancel()
        if pruning is not None:
            pruning.cancel()
        if watching is not None:
            watching.cancel()
        ready_path(data_dir, component).unlink(missing_ok=True)
        await agent.close()
        log.info("agent of %s stopped", args.machine_id)
    return code


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m workers.agent",
                                description="The gpusched machine agent: runs the jobs placed "
                                            "on this machine, pinned to their GPUs.")
    p.add_argument("--machine-id", required=True, help="topology path, e.g. c1/b0/r0/m0")
    p.add_argument("--data-dir", default=str(default_data_dir()),
                   help="stack directory: stack.json, job logs (jobs/), fake faults (faults/)")
    p.add_argument("--gpus", type=int, default=8,
                   help="number of fake GPUs (NVML counts the real ones)")
    p.add_argument("--gpu-type", type=gpu_type, default=None,
                   help="GPU type to report (fake: H100 by default; NVML: overrides the "
                        "detected type)")
    devices = p.add_mutually_exclusive_group()
    devices.add_argument("--fake-devices", action="store_true", help="use fake GPUs, never NVML")
    devices.add_argument("--nvml", action="store_true", help="require NVML (no fake fallback)")
    p.add_argument("--heartbeat-interval", type=float, default=2.0, help="seconds (2.0)")
    p.add_argument("--grace-period", type=float, default=120.0,
                   help="the most grace a job gets when the agent shuts down (120 s)")
    p.add_argument("--orphan-grace", type=float, default=5.0,
                   help="grace of a process whose allocation is gone (5 s)")
    p.add_argument("--max-log-mb", type=float, default=2048.0,
                   help="an attempt's log past this is cut back to its end (2048 MiB; 0: no limit)")
    p.add_argument("--keep-logs-days", type=float, default=14.0,
                   help="attempt logs and reports untouched this long, of jobs not running here, "
                        "are deleted (14 days; 0: kept for ever)")
    add_settings_flags(p)
    args = p.parse_args(argv)
    if args.gpus < 1:
        p.error("--gpus must be at least 1")
    if args.heartbeat_interval <= 0:
        p.error("--heartbeat-interval must be positive")
    if not 0 <= args.max_log_mb < float("inf"):
        p.error("--max-log-mb must be 0 (no limit) or a positive number of MiB")
    if not 0 <= args.keep_logs_days < float("inf"):
        p.error("--keep-logs-days must be 0 (keep for ever) or a positive number of days")
    return args


def main(argv: list[str] | None = None) -> int:
    loopback_without_proxy()
    args = parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per heartbeat otherwise
    return asyncio.run(serve(args))


if __name__ == "__main__":
    sys.exit(main())
