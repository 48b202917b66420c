"""Fixtures shared by the test modules: the real servers (Postgres, Temporal, SeaweedFS) that the
live tests run against, started once per session; see tests/live/servers.py."""

import os
import signal
import threading
import time

from live.jobs import stack  # noqa: F401
from live.servers import live_servers, live_stack  # noqa: F401

_stopped_by_sigterm = threading.Event()


def pytest_configure(config):
    config.addinivalue_line("markers", "live: runs against real servers started by the fixtures")
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        # xdist's controller runs no test: its test processes do, each with a handler of its own.
        controller = not hasattr(config, "workerinput") and bool(getattr(config.option, "numprocesses", None))
        signal.signal(signal.SIGTERM, _stop_as_on_ctrl_c(controller))


def pytest_unconfigure(config):
    if _stopped_by_sigterm.is_set() and hasattr(config, "workerinput"):
        # An xdist test process waits for its controller's word to exit; the controller waits
        # for it to have torn down (below): its teardown is done here, so it ends.
        os._exit(2)


def _stop_as_on_ctrl_c(controller: bool):
    """A run stopped with SIGTERM (a CI timeout, ``kill``) ends as Ctrl-C ends it: the fixtures
    tear down, stopping the servers and stacks they started, which otherwise ran on for good (each
    runs in a session of its own). Under xdist the controller passes the signal on to its test
    processes and waits, up to 2 minutes, for them to tear down and end before it ends."""

    def on_sigterm(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one (sent to the group) must not cut a teardown short
        _stopped_by_sigterm.set()
        if controller:
            workers = _children()
            for pid in workers:
                os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + 120
            while workers and time.monotonic() < deadline:
                time.sleep(0.2)
                workers = [pid for pid in workers if _alive(pid)]
        raise KeyboardInterrupt("SIGTERM")

    return on_sigterm


def _children() -> list[int]:
    me = str(os.getpid())
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit() and _stat(entry)[1:2] == [me]]


def _alive(pid: int) -> bool:
    # Not workers.servers.pid_alive: it reaps a child it finds exited, and these are execnet's.
    return _stat(pid)[:1] not in ([], ["Z"])


def _stat(pid) -> list[str]:
    """/proc/PID/stat's fields after the command (state, ppid, ...); [] for a process gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []
