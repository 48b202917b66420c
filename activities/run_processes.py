"""The processes of one run of a job: its process group, and every process carrying its token.

The agent starts a job's command as the leader of a new process group and stops the group. A
launcher may put its workers in sessions of their own (torchrun starts each with
``start_new_session=True``), out of the group's reach: killing the group kills the launcher and
leaves its workers on the GPUs, which the next job is then given. So every run's environment
carries ``GPUSCHED_RUN_TOKEN``, a random value its descendants inherit wherever they go, and a
stop reaches the processes that carry it too (read from ``/proc/<pid>/environ``: Linux).

A process that clears its environment before exec, or one of another user, is beyond this; a
container or cgroup per job is the complete answer where jobs cannot be trusted.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import signal
import time
from pathlib import Path

from jobkit import STOP_ORDER

log = logging.getLogger("gpusched.node")

RUN_TOKEN = "GPUSCHED_RUN_TOKEN"
POLL = 0.05  # how often a stop looks whether the group is gone
LOOK_EVERY = 0.5  # how often it reads every process's environment: a scan of the machine
KILL_WAIT = 10.0  # how long SIGKILLed processes may take to disappear before we stop waiting


def new_token() -> str:
    return secrets.token_hex(12)


class RunProcesses:
    """A run's processes: the group led by ``pgid`` (None: not to be signalled, its id being
    another process's now), and those carrying ``token`` (None: an earlier agent's run recorded
    without one)."""

    def __init__(self, pgid: int | None, token: str | None):
        self.pgid, self.token = pgid, token
        self._escaped: list[int] = []
        self._looked_at: float | None = None

    def signal(self, sig: int) -> None:
        if self.pgid is not None:
            signal_group(self.pgid, sig)
        for pid in self.escaped(fresh=True):
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def escaped(self, fresh: bool = False) -> list[int]:
        """The live processes carrying the token outside the group; read again at most every
        LOOK_EVERY seconds unless ``fresh``."""
        if self.token is None:
            return []
        now = time.monotonic()
        if fresh or self._looked_at is None or now - self._looked_at >= LOOK_EVERY:
            self._escaped = [pid for pid in marked(self.token) if _group_of(pid) != self.pgid]
            self._looked_at = now
        return self._escaped

    def alive(self) -> bool:
        return (self.pgid is not None and group_alive(self.pgid)) or bool(self.escaped())

    async def gone(self) -> None:
        """Wait (a while) for SIGKILLed processes to disappear. Dying takes a moment
        (uninterruptible I/O, GPU memory being released): a run ends only once they are gone,
        so its GPUs are free when the result says so."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + KILL_WAIT
        while self.alive() and loop.time() < deadline:
            await asyncio.sleep(POLL)


def tell_stop_order(report_dir: Path, grace: float) -> None:
    """Tell a job the grace its stop really gives (jobkit's stop.json), before SIGTERM: its
    GPUSCHED_GRACE_PERIOD is the launch's, and jobkit plans its save by the one it is told.
    Whole or not at all, as the job may read it any time. Raises OSError."""
    report_dir.mkdir(parents=True, exist_ok=True)
    tmp = report_dir / f".{STOP_ORDER}.tmp"
    tmp.write_text(json.dumps({"grace_period": grace, "deadline": time.time() + grace}))
    os.replace(tmp, report_dir / STOP_ORDER)


def tell_grace(report_dir: str | Path | None, grace: float, allocation_id: int) -> None:
    """`tell_stop_order`, where the run has a report folder; a folder that cannot be written is
    said in a warning, and the run is stopped all the same."""
    if report_dir:
        try:
            tell_stop_order(Path(report_dir), grace)
        except OSError as err:
            log.warning("allocation %d: cannot tell the job its grace: %s", allocation_id, err)


def stop_left_runs(pid_dir: Path, grace: float) -> list[int]:
    """Stop, all at once, the runs whose pid files are in ``pid_dir`` and whose processes still
    run with no agent to stop them (it was killed): SIGTERM, ``grace`` for them to checkpoint
    and exit, then SIGKILL. Their pid files stay, for the machine's next agent to forward what
    they reported. Returns the allocations stopped. For `gpusched dev down`, which has no event
    loop; an agent reaps its machine's at its start (NodeActivities.reap_leftovers)."""
    left = {}
    for pid_file in sorted(pid_dir.glob("*.json")) if pid_dir.is_dir() else ():
        try:
            info = json.loads(pid_file.read_text())
            alloc = int(info["allocation_id"])
            run = RunProcesses(group_to_signal(info), info.get("token"))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue  # the next agent says so, and removes it
        if run.alive():
            left[alloc] = run
            tell_grace(info.get("report_dir"), grace, alloc)
    for run in left.values():
        run.signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    while any(run.alive() for run in left.values()) and time.monotonic() < deadline:
        time.sleep(POLL)
    for run in left.values():
        run.signal(signal.SIGKILL)
    deadline = time.monotonic() + KILL_WAIT
    while any(run.alive() for run in left.values()) and time.monotonic() < deadline:
        time.sleep(POLL)
    return sorted(left)


def marked(token: str) -> list[int]:
    """Pids of the live processes whose environment carries ``RUN_TOKEN=token`` (a zombie's
    environment reads empty)."""
    mark = f"{RUN_TOKEN}={token}\0".encode()
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if mark in environ.read_bytes():
                found.append(int(environ.parent.name))
        except (OSError, ValueError):
            continue  # it exited while we looked, or is another user's
    return found


def signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone (or the pid now belongs to someone else's group)


def group_alive(pgid: int) -> bool:
    """Whether a process of the group still runs. Zombies do not count: where nothing reaps
    orphans (a container whose PID 1 does not), they would hold every stop for its full grace."""
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    proc = Path("/proc")
    if not proc.is_dir():
        return True
    for stat in proc.glob("[0-9]*/stat"):
        fields = _stat_fields(stat)
        if fields is not None and fields[2] == str(pgid) and fields[0] != "Z":  # state, ppid, pgrp, ...
            return True
    return False


def start_ticks(pid: int | None) -> int | None:
    """The process's start time in clock ticks since boot (Linux), which tells a live process
    from a later one that reused its pid; None where /proc is missing."""
    if pid is None:
        return None
    fields = _stat_fields(Path(f"/proc/{pid}/stat"))
    try:
        return int(fields[19]) if fields is not None else None
    except (ValueError, IndexError):
        return None


def group_to_signal(info: dict) -> int | None:
    """The process group to signal for the run a pid file describes, or None where signalling
    it could reach someone else's processes (the run's token still finds its own)."""
    recorded_boot = info.get("boot_id")
    if recorded_boot is not None and recorded_boot != boot_id():
        return None  # a run of an earlier boot: none of it runs now, and its numbers are anyone's
    pgid = int(info["pid"])
    return pgid if same_leader(pgid, info.get("start_ticks"), info.get("token")) else None


def same_leader(pgid: int, ticks: int | None, token: str | None = None) -> bool:
    """Whether signalling group ``pgid`` reaches the group a pid file describes. If a process
    has the leader's pid, it must be the leader that was recorded. If none does, the group may
    be the old job's, its leader gone, or another's whose leader has exited (a daemon's, its
    number reused): with a token recorded, the group is the job's only if a member carries it."""
    try:
        os.kill(pgid, 0)
    except ProcessLookupError:
        return token is None or any(_group_of(pid) == pgid for pid in marked(token))
    except PermissionError:
        return False
    now = start_ticks(pgid)
    return now is not None and now == ticks


def boot_id(path: Path = Path("/proc/sys/kernel/random/boot_id")) -> str | None:
    """This boot's id (Linux), or None where there is none to read."""
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def _group_of(pid: int) -> int | None:
    fields = _stat_fields(Path(f"/proc/{pid}/stat"))
    try:
        return int(fields[2]) if fields is not None else None
    except (ValueError, IndexError):
        return None


def _stat_fields(stat: Path) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (state, ppid, pgrp, ...)."""
    try:
        return stat.read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None  # it exited while we looked
