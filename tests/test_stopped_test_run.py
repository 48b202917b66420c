"""A test run stopped with SIGTERM (a CI timeout, ``kill``) tears down as on Ctrl-C: the servers
its fixtures started (each in a session of its own, out of reach of the signal) are stopped and
their folder removed, in one process and under xdist (tests/conftest.py)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from workers.servers import pid_alive

TESTS = Path(__file__).resolve().parent

CONFTEST = f"""
import importlib.util, sys
sys.path.insert(0, {str(TESTS)!r})
spec = importlib.util.spec_from_file_location("gpusched_tests_conftest", {str(TESTS / "conftest.py")!r})
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
globals().update({{k: v for k, v in vars(module).items() if not k.startswith("__")}})
"""

WAITING_TEST = """
import json, os, time

import pytest

@pytest.fixture
def slow_teardown():
    yield
    time.sleep(float(os.environ["TEARDOWN_S"]))  # a teardown of several stacks on a slow host

def test_waits_on_the_servers(live_servers, slow_teardown):
    servers = (live_servers.postgres, live_servers.temporal, live_servers.s3)
    with open(os.environ["SERVERS_OUT"] + ".part", "w") as f:
        json.dump({"pids": [s.pid for s in servers], "root": str(live_servers.root)}, f)
    os.rename(os.environ["SERVERS_OUT"] + ".part", os.environ["SERVERS_OUT"])
    time.sleep(300)
"""


@pytest.mark.live
@pytest.mark.parametrize("processes, teardown_s", [
    pytest.param("0", 0, id="in one process"),
    # xdist's own shutdown gives a test process 15 s, then ends it where its teardown is.
    pytest.param("2", 17, id="under xdist, the signal sent to its controller only, a teardown of 17 s"),
])
def test_a_run_stopped_with_sigterm_stops_the_servers_it_started(tmp_path, processes, teardown_s):
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_waiting.py").write_text(WAITING_TEST)
    out = tmp_path / "servers.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUSCHED_", "PYTEST_"))}
    env.update(SERVERS_OUT=str(out), TEARDOWN_S=str(teardown_s), PYTHONPATH=os.pathsep.join([str(TESTS.parent), str(TESTS)]))
    run = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-n", processes,
                            "--rootdir", str(tmp_path), str(tmp_path / "test_waiting.py")],
                           cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    started = {"pids": []}
    try:
        deadline = time.monotonic() + 120
        while not out.exists():
            assert run.poll() is None and time.monotonic() < deadline, run.stdout.read() if run.poll() is not None else "no servers"
            time.sleep(0.1)
        started = json.loads(out.read_text())
        run.send_signal(signal.SIGTERM)
        output, _ = run.communicate(timeout=150)
        assert run.returncode == 2, output  # pytest's "interrupted"
        assert "KeyboardInterrupt: SIGTERM" in output, output
        assert [pid for pid in started["pids"] if pid_alive(pid)] == [], output
        assert not Path(started["root"]).exists(), output
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
        for pid in started["pids"]:  # what a failed run left, so that it is not left for good
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        if "root" in started:
            shutil.rmtree(started["root"], ignore_errors=True)
