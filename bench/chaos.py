"""Chaos on the live stack: jobs run while machines, GPUs, gpusched's own workers and the servers
under it are killed and brought back at random; afterwards, check that no GPU ever ran two jobs at
once, that no job was lost, and that no checkpoint was corrupted.

    python bench/chaos.py [--minutes 5] [--seed 1] [--machines 4] [--gpus 4] [--jobs 30]
                          [--faults agent,control,api,gpu,postgres,temporal,s3,freeze]
                          [--cancels N] [--bumps N] [--keep DIR]

1. Starts the embedded stack (fake GPUs, machine timeout 8 s, minimum runtime 5 s, grace 4 s) in a
   temporary folder (``--keep DIR``: there, left up for a look).
2. Submits ``--jobs`` jobs of two teams, of 1, 2, 4 GPUs and gangs of 8 across two machines, in
   all four classes, over the first half of the chaos: each runs the example job
   (``bench/chaos_job.py``: checkpoints every 3 s through jobkit, 20-80 s of steps) and stamps
   the time four times a second while its process lives.
3. For ``--minutes``, about every 6 s (seeded), one fault: an agent killed (SIGKILL, its jobs'
   processes left running, as a machine that loses its agent) and started again after 1-24 s,
   longer than the machine timeout about half the time; the control worker, the API, Postgres,
   Temporal or SeaweedFS killed and started again after 1-10 s; one of them frozen (SIGSTOP, with
   every process under it: a machine's agent and jobs, or Postgres and its backends) and let go
   (SIGCONT) after as long, so it comes back with its connections open; or a GPU given an
   uncorrectable ECC error or thermal slowdown for 5-20 s; or, as an operator does, a machine
   drained (its jobs checkpoint and move) or cordoned for 10-30 s, then put back in service
   (`gpusched fleet drain | cordon | uncordon`, sent again while Postgres cannot take it).
   Meanwhile, as users do, ``--cancels`` jobs are cancelled and ``--bumps`` jobs change class
   (once or twice), each 5-60 s after its submit, so queued, placed, running and draining jobs
   alike; a request the stack cannot take is sent again until it can.
4. Starts whatever is down, clears the GPU faults, waits for every job to end, and audits:
   - no GPU ran two processes at once (from the processes' own stamps: from the process's start,
     read from /proc, to a stamp's interval past its last stamp, or to when its agent logged it
     reaped, if sooner) or was held by two allocations at once (the allocations table, from
     placement to end, recounted);
   - every job ended; each succeeded, but those its user cancelled and those failed by five
     infrastructure failures in a row (by design), which their last five attempts must bear out;
     each that succeeded ended with the state of an uninterrupted run on every machine of its
     last attempt (by the allocations table);
   - every complete checkpoint still stored has the size and SHA-256 committed for it, and none
     was found unusable at a resume;
   - every job whose cancel was taken ended cancelled with the user's reason, unless it ended on
     its own within ``CANCEL_RACE_S`` of the cancel (its last step and the cancel crossed);
   - every job whose class change was taken has the class of its last change; every user
     request was taken, or refused only because its job had ended (within ``CANCEL_RACE_S``)
     before the request was first sent;
   - no component stopped by itself (found not running when its kill came, or by the `up` after
     the chaos).
   Attempts launched with no stamping process on each of their machines are listed (the stamps
   prove nothing about them), and so are the fault kinds asked for that never came up.

The last line printed is one JSON object with the figures; the exit code is 1 if an invariant
broke, a submission or user request was never accepted, or a component did not come back or
stopped by itself: then ``violations`` says which; 0 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import os
import random
import re
import signal
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from activities.checkpoints import s3_client  # noqa: E402
from scheduler.models import Priority, Quota  # noqa: E402
from workers import devices, devstack, servers  # noqa: E402
from workers.client import ENDED, ClientError, GpuschedClient  # noqa: E402
from workers.example_job import final_state  # noqa: E402
from bench.chaos_job import STAMP_EVERY_S  # noqa: E402
from workers.settings import machine_component  # noqa: E402
from workflows.job import MAX_INFRA_FAILURES  # noqa: E402
from workflows.types import EndReason, JobRequest  # noqa: E402

JOB = Path(__file__).resolve().parent / "chaos_job.py"
STEP_SECONDS = 0.5
MACHINE_TIMEOUT_S = 8.0
START_WAIT_S = 5.0  # how long a worker started again is watched for exiting
SERVER_START_S = 60.0  # a server started again answers by then, or its start is a finding
SERVERS = ("postgres", "temporal", "s3")
FAULTS = ("agent", "control", "api", "gpu", *SERVERS, "freeze", "drain")
DRAIN_REASON = "chaos: maintenance"
SHAPES = [(1, 4), (2, 3), (4, 2), (8, 1)]  # GPUs, weight
CLASSES = [("low", 3), ("normal", 3), ("high", 2), ("critical", 1)]
CANCEL_REASON = "chaos: cancelled by its user"
CANCEL_RACE_S = 10.0  # a job may end on its own this long after a cancel: they crossed
USER_RETRY_S = 2.0
INFRA_ENDS = (EndReason.machine_failure.value, EndReason.not_started.value)  # what counts to the limit


def pick(rng: random.Random, weighted: list[tuple]) -> object:
    return rng.choices([v for v, _ in weighted], [w for _, w in weighted])[0]


# --- the workload ----------------------------------------------------------------------------

def workload(rng: random.Random, count: int, spread_s: float, stamps: Path) -> list[tuple[float, JobRequest]]:
    """``count`` jobs with their submit offsets: a third at once, the rest over ``spread_s``."""
    jobs = []
    for i in range(count):
        gpus, steps = pick(rng, SHAPES), rng.randint(40, 160)
        at = 0.0 if i < count // 3 else rng.uniform(0, spread_s)
        jobs.append((at, JobRequest(
            job_id=f"chaos-{i:03d}", team=("vision", "speech")[i % 2], num_gpus=gpus,
            priority=pick(rng, CLASSES), topology="block" if gpus > 4 else None,
            checkpoint_interval=3, expected_duration=steps * STEP_SECONDS + 1,
            command=[sys.executable, str(JOB), str(stamps), "--steps", str(steps),
                     "--step-seconds", str(STEP_SECONDS), "--backend", "python"])))
    return sorted(jobs, key=lambda j: j[0])


async def submit_all(client: GpuschedClient, jobs: list[tuple[float, JobRequest]], began: float,
                     give_up_at: float) -> list[str]:
    """Submit each job at its time, again and again while the stack cannot take it (the same id
    is the same job); returns the ids never accepted."""
    refused = []
    for at, request in jobs:
        await asyncio.sleep(max(0.0, began + at - time.monotonic()))
        while True:
            try:
                await asyncio.wait_for(client.submit(request), 40)
                break
            except Exception as e:  # the stack is partly down: that is the point
                if time.monotonic() > give_up_at:
                    refused.append(f"{request.job_id}: {type(e).__name__}: {e}")
                    break
                await asyncio.sleep(2)
    return refused


# --- the users -------------------------------------------------------------------------------

class Users:
    """What users do while the stack is failing: cancel jobs and change their class. Each job's
    requests go in order, each sent again while the stack cannot take it. Seeded apart from the
    faults and the workload, so asking for users leaves those as they were."""

    def __init__(self, seed: int, jobs: list[tuple[float, JobRequest]], cancels: int, bumps: int):
        rng = random.Random(f"users-{seed}")
        ids = [r.job_id for _, r in jobs]
        chosen = rng.sample(ids, cancels + bumps)
        submitted = {r.job_id: (at, r) for at, r in jobs}
        self.plans: dict[str, list[tuple[float, str]]] = {}  # job -> [(seconds after the start, action)]
        for k, job_id in enumerate(chosen):
            at, request = submitted[job_id]
            when = at + rng.uniform(5, 60)
            if k < cancels:
                self.plans[job_id] = [(when, "cancel")]
                continue
            plan, current = [], request.priority
            for _ in range(rng.randint(1, 2)):
                current = rng.choice([c for c, _ in CLASSES if c != current])
                plan.append((when, current))
                when += rng.uniform(5, 30)
            self.plans[job_id] = plan
        self.cancelled: dict[str, float] = {}  # job -> when its cancel was taken (epoch seconds)
        self.classes: dict[str, str] = {}  # job -> the class of its last change taken
        self.too_late: dict[str, str] = {}  # job -> the request it had ended before
        self.first_sent: dict[str, float] = {}  # job -> since when its too late request was refused (epoch)
        self.never_taken: dict[str, str] = {}  # job -> the request the stack never took, and why
        self.retries = 0

    async def run(self, client: GpuschedClient, began: float, give_up_at: float) -> None:
        await asyncio.gather(*(self._follow(client, job_id, plan, began, give_up_at)
                               for job_id, plan in self.plans.items()))

    async def _follow(self, client: GpuschedClient, job_id: str, plan: list[tuple[float, str]],
                      began: float, give_up_at: float) -> None:
        for at, action in plan:
            await asyncio.sleep(max(0.0, began + at - time.monotonic()))
            refused_from, last_error = None, "never sent"
            while True:
                if time.monotonic() >= give_up_at:  # sent again and again: never taken, though the stack came back
                    self.never_taken[job_id] = f"{action}: {last_error}"
                    return
                tried_at = time.time()
                try:
                    if action == "cancel":
                        await asyncio.wait_for(client.cancel(job_id, CANCEL_REASON), 40)
                        self.cancelled[job_id] = time.time()
                    else:
                        await asyncio.wait_for(client.bump(job_id, Priority(action)), 40)
                        self.classes[job_id] = action
                    break
                except Exception as e:  # refused (not admitted yet, or ended) or the stack is partly down
                    last_error = f"{type(e).__name__}: {e}"[:300]
                    # Refused since when: a request an outage kept from the stack was not refused.
                    refused_from = (refused_from or tried_at) if isinstance(e, ClientError) else None
                    if isinstance(e, ClientError) and await client.ended_state(job_id) is not None:
                        self.too_late[job_id] = action
                        self.first_sent[job_id] = refused_from
                        return
                    self.retries += 1
                    await asyncio.sleep(USER_RETRY_S)

    def audit(self, states: dict[str, dict]) -> dict:
        """``states``: the jobs' rows (state, reason, priority, updated_at: when they ended)."""
        ignored, lost = {}, {}
        for job_id, asked in self.cancelled.items():
            row = states.get(job_id)
            if row is None or row["state"] == "cancelled" and row["reason"] == CANCEL_REASON:
                continue  # a job never ended is counted as lost already
            after = row["updated_at"] - asked
            if row["state"] == "cancelled" or after > CANCEL_RACE_S:
                ignored[job_id] = f"{row['state']} ({row['reason']}) {after:.1f} s after its cancel"
        for job_id, wanted in self.classes.items():
            row = states.get(job_id)
            if row is not None and row["priority"] != wanted:
                lost[job_id] = f"{row['priority']}, not {wanted}"
        # Too late only if the job had ended (give or take the race) before the request first went:
        # refusals that went on while it ran, until it ended, are requests lost.
        refused_running = {job_id: f"{action} refused from {self.first_sent[job_id] - row['updated_at']:+.1f} s "
                                   "after its end (negative: before it)"
                           for job_id, action in self.too_late.items()
                           if (row := states.get(job_id)) is not None
                           and row["updated_at"] > self.first_sent[job_id] + CANCEL_RACE_S}
        return {
            "cancels_taken": len(self.cancelled),
            "cancelled": sum(1 for j in self.cancelled if states.get(j, {}).get("state") == "cancelled"),
            "cancels_ignored": ignored,
            "class_changes_taken": len(self.classes), "class_changes_lost": lost,
            "user_requests_too_late": self.too_late, "user_requests_sent_again": self.retries,
            "user_requests_never_taken": self.never_taken, "user_requests_refused_while_running": refused_running,
        }


# --- the faults ------------------------------------------------------------------------------

class Chaos:
    """Faults at random, each undone after its own outage."""

    def __init__(self, data_dir: Path, rng: random.Random, kinds: list[str]):
        self.data_dir, self.rng, self.kinds = data_dir, rng, kinds
        self.state = devstack.load_state(data_dir)
        self.agents = {machine_component(m.id): m for m in self.state.machines}
        self.down: set[str] = set()
        self.bad_gpus: set[tuple[str, int]] = set()
        self.out_of_service: set[str] = set()  # machines drained or cordoned now
        self.count: Counter = Counter()
        self.log: list[str] = []
        self.errors: list[str] = []

    async def run(self, until: float, client: GpuschedClient) -> None:
        outages = []
        while time.monotonic() < until:
            await asyncio.sleep(self.rng.expovariate(1 / 6))
            kind = self.rng.choice(self.kinds)
            if kind == "gpu":
                outages.append(asyncio.create_task(self.gpu_fault()))
                continue
            if kind == "drain":
                outages.append(asyncio.create_task(self.drain(client)))
                continue
            if kind == "freeze":
                name = self.rng.choice([*sorted(self.agents), "control", "api", *SERVERS])
            elif kind == "agent":
                name = self.rng.choice(sorted(self.agents))
            else:
                name = kind
            if name in self.down:
                continue
            outage = (self.rng.uniform(1, 3 * MACHINE_TIMEOUT_S) if name in self.agents
                      else self.rng.uniform(1, 10))
            fault = self.freeze(name, outage) if kind == "freeze" else self.kill(kind, name, outage)
            outages.append(asyncio.create_task(fault))
        await asyncio.gather(*outages)

    async def freeze(self, name: str, outage: float) -> None:
        """SIGSTOP a component and every process under it, then SIGCONT them: a machine (its
        agent and its jobs) or a server that hangs and comes back with its connections open,
        where a kill would have closed them."""
        component = devstack.load_state(self.data_dir).components[name]
        if not servers.is_running(component.pid, component.cmd):
            return
        self.down.add(name)
        self.count["freeze"] += 1
        pids = process_tree(component.pid)
        self.log.append(f"{time.strftime('%H:%M:%S')} freeze {name} ({len(pids)} processes) for {outage:.1f} s")
        signal_all(pids, signal.SIGSTOP)
        try:
            await asyncio.sleep(outage)
        finally:
            signal_all(pids, signal.SIGCONT)
            self.down.discard(name)

    async def kill(self, kind: str, name: str, outage: float) -> None:
        self.down.add(name)
        self.count[kind] += 1
        self.log.append(f"{time.strftime('%H:%M:%S')} kill {name} for {outage:.1f} s")
        if not await asyncio.to_thread(devstack.stop_component, self.data_dir, name, signal.SIGKILL):
            # Nothing of ours had it down: it stopped by itself, and starting it again would hide that.
            self.errors.append(f"{name} was not running when its kill came: it had stopped by itself")
        await asyncio.sleep(outage)
        try:
            # Not waited for until healthy: the stack's lock is held meanwhile, and a worker that
            # waits for a server killed too would keep that server from being started again.
            await asyncio.to_thread(devstack.start_component, self.data_dir, name,
                                    SERVER_START_S if kind in SERVERS else START_WAIT_S)
        except devstack.StackError as e:
            if "not healthy after" not in str(e):  # still starting is no fault; exiting is
                self.errors.append(f"starting {name} again: {e}")
        except Exception as e:  # brought back by `up` at the end; what went wrong is a finding
            self.errors.append(f"starting {name} again: {type(e).__name__}: {e}")
        self.down.discard(name)

    async def gpu_fault(self) -> None:
        machine = self.rng.choice(self.state.machines)
        gpu = self.rng.randrange(machine.gpus)
        if (machine.id, gpu) in self.bad_gpus:
            return
        fault = self.rng.choice([devices.ECC_UNCORRECTABLE, devices.THERMAL_THROTTLE])
        self.bad_gpus.add((machine.id, gpu))
        self.count["gpu"] += 1
        self.log.append(f"{time.strftime('%H:%M:%S')} {fault} on {machine.id}/{gpu}")
        fault_file = self.data_dir / "faults" / f"{machine_component(machine.id)}.json"
        devices.inject_fault(fault_file, gpu, fault)
        await asyncio.sleep(self.rng.uniform(5, 20))
        devices.clear_faults(fault_file, gpu)
        self.bad_gpus.discard((machine.id, gpu))


    async def drain(self, client: GpuschedClient) -> None:
        """An operator takes a machine out of service (drained: its jobs checkpoint and move; or
        cordoned: they run on) and puts it back 10-30 s later."""
        machine = self.rng.choice(self.state.machines)
        mode = self.rng.choice(["draining", "cordoned"])
        back_after = self.rng.uniform(10, 30)
        if machine.id in self.out_of_service:
            return
        self.out_of_service.add(machine.id)
        self.count["drain"] += 1
        self.log.append(f"{time.strftime('%H:%M:%S')} {mode} {machine.id} for {back_after:.1f} s")
        try:
            if await self.cordon(client, machine.id, mode):
                await asyncio.sleep(back_after)
            await self.cordon(client, machine.id, None)
        finally:
            self.out_of_service.discard(machine.id)

    async def cordon(self, client: GpuschedClient, machine_id: str, mode: str | None) -> bool:
        """Sent again while the store cannot take it (Postgres killed or frozen); whether taken."""
        give_up_at = time.monotonic() + 120
        while True:
            try:
                await asyncio.wait_for(client.store.cordon(machine_id, mode, DRAIN_REASON if mode else None), 20)
                return True
            except Exception as e:  # the stack is partly down
                if time.monotonic() >= give_up_at:
                    self.errors.append(f"{mode or 'uncordon'} {machine_id} never taken: {type(e).__name__}: {e}")
                    return False
                await asyncio.sleep(1)


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process under it, parents first (read from /proc)."""
    children = defaultdict(list)
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])  # the name may hold spaces
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        children[parent].append(int(stat.parent.name))
    tree = [pid]
    for p in tree:  # grows as it is read: breadth first
        tree.extend(children.get(p, ()))
    return tree


def signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


# --- the audit -------------------------------------------------------------------------------

REAPED = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) INFO gpusched\.node: allocation (\d+): job \S+ ended ",
                    re.M)


def reaped_at(logs: Path) -> dict[tuple[str, str], float]:
    """When each machine's agent reaped each attempt's process, by (agent, allocation), from the
    agents' logs (local time, to the millisecond): the process had exited by then."""
    reaped = {}
    for log in logs.glob("agent-*.log"):
        for m in REAPED.finditer(log.read_text(errors="replace")):
            at = time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1000
            reaped[(log.stem, m.group(3))] = at
    return reaped


def read_stamps(stamps: Path, reaped: dict[tuple[str, str], float] | None = None) -> list[dict]:
    """Each process's life as it stamped it: job, attempt, GPUs, from its start to its end: the
    earlier of its agent's reaping of it (``reaped``, when logged) and a stamp's interval past its
    last stamp (it may have lived on that long without stamping again)."""
    reaped = reaped or {}
    lives = []
    for path in sorted(stamps.iterdir()):
        lines = path.read_text().splitlines()
        times = [float(t) for t in lines[1:] if re.fullmatch(r"\d+\.\d+", t)]
        if times:
            head = json.loads(lines[0])
            end = times[-1] + STAMP_EVERY_S
            by_agent = reaped.get((machine_component(head.get("machine") or ""), str(head.get("allocation"))))
            if by_agent is not None and by_agent >= times[-1]:
                end = min(end, by_agent)
            lives.append({**head, "first": min(head.get("started", times[0]), times[0]), "last": end,
                          "file": path.name})
    return lives


# How far a stamped start may read early: a process's start in whole clock ticks since boot,
# against an uptime in hundredths of a second (bench/chaos_job.py), each truncated: within one
# tick either way; two allowed.
STARTS_TO_S = 2 / os.sysconf("SC_CLK_TCK")


def overlaps(lives: list[dict], start: str, end: str, within: float = 0.0) -> list[str]:
    """Pairs of lives that held one GPU at the same time: ``start``/``end`` name their bounds, and
    ``gpus`` their GPUs. Touching ends do not overlap, nor ends closer than ``within`` seconds,
    the resolution of the bounds."""
    by_gpu = defaultdict(list)
    for life in lives:
        for gpu in life["gpus"]:
            by_gpu[gpu].append(life)
    found = []
    for gpu, held in sorted(by_gpu.items()):
        held.sort(key=lambda life: life[start])
        for i, a in enumerate(held):
            for b in held[i + 1:]:
                if b[start] >= a[end] - within:
                    break
                if min(a[end], b[end]) - b[start] <= within:
                    continue
                found.append(f"{gpu}: {a['job']} attempt {a['attempt']} and {b['job']} attempt {b['attempt']} "
                             f"for {min(a[end], b[end]) - b[start]:.2f} s")
    return found


def final_states(data_dir: Path, job_id: str, steps: int, attempt: int, machines: int) -> str | None:
    """None if every process of the job's last attempt (by the allocations table: ``attempt``, on
    ``machines`` machines) ended with the state of an uninterrupted run, else what is wrong."""
    logs = list(data_dir.glob(f"jobs/*/{job_id}/attempt-{attempt}.log"))
    if not logs:
        return f"no log of its attempt {attempt}"
    done = [m.group(1) for p in logs
            for m in re.finditer(r"done, steps=\d+ final_state=([0-9a-f]+)", p.read_text())]
    expected = final_state(steps).hex()
    if len(done) < machines:  # a gang's rank that died while rank 0 finished is no success
        return f"its attempt {attempt} ended with a final state on {len(done)} of its {machines} machines"
    wrong = [d for d in done if d != expected]
    return f"final state {wrong[0][:12]}..., expected {expected[:12]}..." if wrong else None


def machines_of(gpus: list[str]) -> int:
    """How many machines an attempt's GPUs (topology paths) are on."""
    return len({gpu.rsplit("/", 1)[0] for gpu in gpus})


def expected_end(row: dict, ends: list[str], users: "Users") -> bool:
    """Whether a job that did not succeed ended as the run allows: cancelled by its user, or failed
    by the limit of infrastructure failures in a row, which its attempts must bear out."""
    if row["state"] == "cancelled":  # asked, taken or not (a cancel whose answer an outage lost is refused again)
        return row["reason"] == CANCEL_REASON and any(action == "cancel" for _, action in users.plans.get(row["id"], ()))
    limit = MAX_INFRA_FAILURES
    return (row["state"] == "failed" and "infrastructure failures" in (row["reason"] or "")
            and len(ends) >= limit and all(end in INFRA_ENDS for end in ends[-limit:]))


def verify_checkpoints(settings, rows: list) -> list[str]:
    s3 = s3_client(settings.s3_endpoint, settings.s3_access_key, settings.s3_secret_key, settings.s3_region)
    bad = []
    for row in rows:
        try:
            body = s3.get_object(Bucket=settings.s3_bucket, Key=row["key"])["Body"].read()
        except Exception as e:
            bad.append(f"{row['job_id']} seq {row['seq']}: {type(e).__name__}: {e}")
            continue
        if len(body) != row["size"] or hashlib.sha256(body).hexdigest() != row["sha256"]:
            bad.append(f"{row['job_id']} seq {row['seq']}: {len(body)} bytes, not those committed")
    return bad


async def audit(client: GpuschedClient, settings, data_dir: Path, stamps: Path,
                jobs: list[tuple[float, JobRequest]], users: Users) -> dict:
    pool = client.store.pool
    steps = {r.job_id: int(r.command[r.command.index("--steps") + 1]) for _, r in jobs}
    states = {r["id"]: dict(r) for r in await pool.fetch(
        "SELECT id, state, reason, priority, updated_at FROM jobs WHERE id = ANY($1)", list(steps))}
    lost = [j for j in steps if j not in states or states[j]["state"] not in ENDED]
    not_succeeded = {j: f"{r['state']}: {r['reason']}" for j, r in states.items()
                     if r["state"] in ENDED and r["state"] != "succeeded"}
    # From the placement: the database holds a GPU from then (an attempt not launched yet included).
    allocations = [dict(r) for r in await pool.fetch(
        "SELECT job_id AS job, attempt, gpus, started_at, placed_at AS held_from, "
        "COALESCE(ended_at, extract(epoch FROM now())) AS held_to, end_reason "
        "FROM allocations WHERE job_id = ANY($1)", list(steps))]
    ends = defaultdict(list)  # each job's launched attempts' end reasons, in order: a placement taken
    for a in sorted(allocations, key=lambda a: (a["job"], a["attempt"])):  # back unlaunched counts for nothing
        if a["started_at"] is not None:
            ends[a["job"]].append(a["end_reason"])
    unexpected = {j: why for j, why in not_succeeded.items() if not expected_end(states[j], ends[j], users)}
    last_attempt = {a["job"]: a for a in sorted(allocations, key=lambda a: a["attempt"])}
    wrong = {}
    for job_id, row in states.items():
        if row["state"] != "succeeded":
            continue
        last = last_attempt.get(job_id)
        machines = max(1, machines_of(last["gpus"])) if last else 1
        if why := final_states(data_dir, job_id, steps[job_id], last["attempt"] if last else 0, machines):
            wrong[job_id] = why
    rows = await pool.fetch("SELECT job_id, seq, key, size, sha256 FROM checkpoints "
                            "WHERE job_id = ANY($1) AND complete AND deleted_at IS NULL", list(steps))
    # A checkpoint found unusable at a resume: bytes that rotted, or a good one given up under faults.
    unusable = [f"{r['job_id']} seq {r['seq']}: {r['reason']}" for r in await pool.fetch(
        "SELECT job_id, seq, reason FROM checkpoints WHERE job_id = ANY($1) AND unusable_at IS NOT NULL "
        "ORDER BY job_id, seq", list(steps))]
    lives = read_stamps(stamps, reaped_at(data_dir / "logs"))
    # Every attempt launched ran a process that stamped, on each of its machines: else the stamps
    # prove nothing about it (a stamping that broke would show no overlap at all).
    stamped = Counter((life["job"], str(life["attempt"])) for life in lives)
    unstamped = [f"{a['job']} attempt {a['attempt']}" for a in allocations
                 if a["started_at"] is not None and a["end_reason"] != EndReason.not_started.value
                 and stamped[(a["job"], str(a["attempt"]))] < machines_of(a["gpus"])]
    succeeded = [j for j in steps if states.get(j, {}).get("state") == "succeeded"]
    ran = sum(len(re.findall(r"^step \d+/", p.read_text(), re.M)) for j in succeeded  # as needed is counted
              for p in data_dir.glob(f"jobs/*/{j}/attempt-*.log"))
    # A stamped start is good to a clock tick (STARTS_TO_S): a new process started as soon as the
    # one before it was reaped may seem to begin a few milliseconds before that one ended.
    gpu_overlaps = overlaps(lives, "first", "last", within=STARTS_TO_S)
    allocation_overlaps = overlaps(allocations, "held_from", "held_to")
    bad_checkpoints = await asyncio.to_thread(verify_checkpoints, settings, rows)
    gangs = {r.job_id for _, r in jobs if r.num_gpus > 4}  # each machine of a gang runs the steps
    needed = sum(steps[j] * (2 if j in gangs else 1) for j in succeeded)
    # Jobs the cycle moved off a drained machine (`fleet drain`): each is one of the ends above.
    drain_moves = await pool.fetchval("SELECT count(*) FROM audit WHERE event = 'preempt_ordered' "
                                      "AND reason LIKE '%is being drained'")
    return {
        "jobs": len(steps), "succeeded": len(succeeded), "moved_off_drained_machines": drain_moves,
        "not_succeeded": not_succeeded, "ended_unexpectedly": unexpected, "lost": lost, "wrong_final_states": wrong,
        "attempts": len(allocations), "end_reasons": dict(Counter(a["end_reason"] for a in allocations)),
        "processes": len(lives), "attempts_without_stamps": unstamped,
        "gpu_overlaps": gpu_overlaps, "allocation_overlaps": allocation_overlaps,
        "checkpoints_verified": len(rows), "bad_checkpoints": bad_checkpoints, "unusable_checkpoints": unusable,
        "steps_run_per_step_needed": round(ran / needed, 3) if needed else None,
        **users.audit(states),
    }


# --- the run ---------------------------------------------------------------------------------

async def chaos_run(data_dir: Path, args) -> dict:
    rng = random.Random(args.seed)
    stamps = data_dir / "stamps"
    up = await asyncio.to_thread(devstack.up, data_dir, machines=args.machines, gpus_per_machine=args.gpus,
                                 ui=False, fast=True, fake_devices=True)
    jobs = workload(rng, args.jobs, args.minutes * 30, stamps)
    chaos = Chaos(data_dir, rng, args.faults)
    users = Users(args.seed, jobs, args.cancels, args.bumps)
    async with await GpuschedClient.connect(up.settings) as client:
        await client.store.configure_cluster("c1", policy={"min_runtime": 5, "grace_period": 4},
                                             machine_timeout=MACHINE_TIMEOUT_S)
        for team in ("vision", "speech"):
            await client.set_quota(team, Quota(guaranteed=args.machines * args.gpus // 2,
                                               max=args.machines * args.gpus, queue_cap=1000))
        began = time.monotonic()
        until = began + args.minutes * 60
        refused, _, _ = await asyncio.gather(submit_all(client, jobs, began, until + 120), chaos.run(until, client),
                                             users.run(client, began, until + 120))
        chaos_s = time.monotonic() - began
    # Everything back: what a fault left down, then the GPUs' faults cleared.
    try:
        back = await asyncio.to_thread(devstack.up, data_dir, ui=False)
        if back.revived:  # every fault brought its component back: these stopped by themselves
            chaos.errors.append(f"stopped by themselves, found so after the chaos: {', '.join(back.revived)}")
    except devstack.StackError as e:  # the audit still runs: what could not come back shows there
        chaos.errors.append(f"bringing the stack back after the chaos: {e}")
    for machine in chaos.state.machines:
        devices.clear_faults(data_dir / "faults" / f"{machine_component(machine.id)}.json")
    drained = time.monotonic()
    async with await GpuschedClient.connect(up.settings) as client:
        unended = []
        for _, request in jobs:
            try:
                view = await client.wait(request.job_id, timeout=max(1.0, drained + args.drain_minutes * 60 - time.monotonic()))
                if view.state not in ENDED:
                    unended.append(request.job_id)
            except Exception as e:
                unended.append(f"{request.job_id} ({type(e).__name__})")
        drain_s = time.monotonic() - drained
        figures = await audit(client, up.settings, data_dir, stamps, jobs, users)
    violations = [name for name in ("lost", "ended_unexpectedly", "wrong_final_states", "gpu_overlaps", "allocation_overlaps",
                                    "bad_checkpoints", "unusable_checkpoints", "cancels_ignored",
                                    "class_changes_lost", "user_requests_never_taken",
                                    "user_requests_refused_while_running") if figures[name]]
    if refused:
        violations.append("refused")
    if chaos.errors:
        violations.append("fault_errors")
    return {"seed": args.seed, "minutes": args.minutes, "chaos_s": round(chaos_s, 1),
            "drain_s": round(drain_s, 1), "faults": dict(chaos.count),
            "faults_never_injected": [kind for kind in args.faults if not chaos.count[kind]],
            "fault_errors": chaos.errors,
            "refused": refused, "unended_at_drain": unended, **figures, "violations": violations,
            "fault_log": chaos.log}


def quiet_clients() -> None:
    """The bench's own clients retry through the outages it causes: their warnings are noise."""
    from temporalio.runtime import LoggingConfig, Runtime, TelemetryConfig, TelemetryFilter

    Runtime.set_default(Runtime(telemetry=TelemetryConfig(logging=LoggingConfig(
        filter=TelemetryFilter(core_level="ERROR", other_level="ERROR")))), error_if_already_set=False)
    logging.getLogger("asyncpg").setLevel(logging.CRITICAL)


def main() -> None:
    parser = argparse.ArgumentParser(
        description="Chaos on the live stack: kill and restart agents, workers and servers, fail GPUs, "
        "then audit that no GPU ran two jobs, no job was lost and no checkpoint was corrupted.")
    parser.add_argument("--minutes", type=float, default=5.0, help="how long faults are injected (default 5)")
    parser.add_argument("--drain-minutes", type=float, default=10.0,
                        help="how long, after the chaos, the jobs get to end (default 10)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the faults and the jobs (default 1)")
    parser.add_argument("--machines", type=int, default=4, help="machines, each with its own agent (default 4)")
    parser.add_argument("--gpus", type=int, default=4, help="fake GPUs per machine (default 4)")
    parser.add_argument("--jobs", type=int, default=30, help="jobs submitted (default 30)")
    parser.add_argument("--faults", type=lambda s: [f for f in s.split(",") if f], default=list(FAULTS),
                        help=f"kinds of fault, comma-separated (default {','.join(FAULTS)})")
    parser.add_argument("--cancels", type=int, default=0,
                        help="jobs their users cancel, each 5-60 s after its submit (default 0)")
    parser.add_argument("--bumps", type=int, default=0,
                        help="jobs whose users change their class once or twice, from 5-60 s after the submit (default 0)")
    parser.add_argument("--keep", type=Path, default=None, help="run the stack in DIR and leave it up")
    args = parser.parse_args()
    unknown = set(args.faults) - set(FAULTS)
    if unknown:
        parser.error(f"--faults: unknown {', '.join(sorted(unknown))}; choose from {','.join(FAULTS)}")
    if args.cancels < 0 or args.bumps < 0 or args.cancels + args.bumps > args.jobs:
        parser.error(f"--cancels {args.cancels} and --bumps {args.bumps}: each 0 or more, together at most "
                     f"--jobs ({args.jobs}): each job is cancelled or changes class, not both")
    if args.keep is not None and (args.keep / devstack.STACK_FILE).exists():
        parser.error(f"--keep: {args.keep} holds a stack already; give a new folder, or stop and delete that "
                     f"one first (gpusched dev down --purge --data-dir {args.keep})")
    quiet_clients()
    with tempfile.TemporaryDirectory(prefix="gpusched-chaos-") as tmp:
        data_dir = (args.keep or Path(tmp) / "stack").absolute()
        try:
            figures = asyncio.run(chaos_run(data_dir, args))
        finally:
            if args.keep is None:
                devstack.down(data_dir)
    for line in figures.pop("fault_log"):
        print(line, file=sys.stderr)
    for key, value in figures.items():
        print(f"{key:>26}: {value}", file=sys.stderr)
    print(json.dumps(figures))
    sys.exit(1 if figures["violations"] else 0)


if __name__ == "__main__":
    main()
