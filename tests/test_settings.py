"""Connection settings: flags over the environment over the embedded stack's stack.json, and a
clear refusal of a setting no process can run with."""

from __future__ import annotations

import os
from pathlib import Path

import asyncpg
import pytest

from workers.settings import SettingsError, load_settings


@pytest.mark.parametrize("name, env, token", [
    ("a token read from a file keeps no newline", {"GPUSCHED_API_TOKEN": "s3cret\n"}, "s3cret"),
    ("no token set means an API without one", {}, None),
])
def test_the_api_token_is_read_from_the_environment(monkeypatch, tmp_path, name, env, token):
    monkeypatch.delenv("GPUSCHED_API_TOKEN", raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    assert load_settings(tmp_path).api_token == token


@pytest.mark.parametrize("name, env, flag", [
    ("a token variable of only whitespace (a secret that failed to mount)", {"GPUSCHED_API_TOKEN": "\n"}, None),
    ("an empty token variable (it counted as not set: an API open to anyone, or a local stack's token)",
     {"GPUSCHED_API_TOKEN": ""}, None),
    ("a blank token flag", {}, "  "),
])
def test_a_token_given_blank_is_refused_not_taken_for_no_token(monkeypatch, tmp_path, name, env, flag):
    monkeypatch.delenv("GPUSCHED_API_TOKEN", raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    with pytest.raises(SettingsError, match="set but blank"):
        load_settings(tmp_path, api_token=flag)


@pytest.mark.parametrize("var", ["GPUSCHED_TEMPORAL_TLS_CERT", "GPUSCHED_TEMPORAL_TLS_KEY", "GPUSCHED_TEMPORAL_TLS_CA"])
def test_an_empty_tls_variable_is_refused_not_taken_for_no_tls(monkeypatch, tmp_path, var):
    monkeypatch.setenv(var, "")
    with pytest.raises(SettingsError, match=f"{var} is set but empty"):
        load_settings(tmp_path)


def test_a_process_given_a_blank_token_exits_2_in_one_line(monkeypatch, tmp_path, capsys):
    from workers import api

    monkeypatch.setenv("GPUSCHED_API_TOKEN", " \n")
    with pytest.raises(SystemExit) as exited:
        api.main(["--data-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "GPUSCHED_API_TOKEN" in err and "Traceback" not in err


@pytest.mark.parametrize("dsn, shown", [
    ("postgresql://postgres@127.0.0.1:5432/gpusched", "postgresql://postgres@127.0.0.1:5432/gpusched"),
    ("postgresql://app:p%40ss@db.internal:5432/gpusched?sslmode=require",
     "postgresql://app:***@db.internal:5432/gpusched?sslmode=require"),
    ("postgresql:///gpusched", "postgresql:///gpusched"),
])
def test_a_database_address_is_printed_without_its_password(dsn, shown):
    from workers.settings import without_password

    assert without_password(dsn) == shown


@pytest.mark.parametrize("content, words", [
    ("{bad", "cannot be read"),
    ("[1, 2]", "not a stack file"),
    ('{"settings": {"pg_dsn": 5}}', "GPUSCHED_PG_DSN: Input should be a valid string"),
], ids=["a stack file that is not JSON", "a stack file that is not an object",
        "a stack file with a setting of the wrong type, named as its variable"])
def test_a_damaged_stack_file_is_refused_in_words(monkeypatch, tmp_path, content, words):
    for var in ("GPUSCHED_PG_DSN", "GPUSCHED_API_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    (tmp_path / "stack.json").write_text(content)
    with pytest.raises(SettingsError, match=words):
        load_settings(tmp_path)


@pytest.mark.parametrize("endpoint, refused", [
    ("http://127.0.0.1:8333", False),
    ("https://s3.example.com", False),
    ("127.0.0.1:8333", True),
    ("not a url", True),
    ("ftp://store:21", True),
    ("http://:8333", True),
    ("http://store:port", True),
], ids=["an http URL", "an https URL without a port", "an address without a scheme", "no URL at all",
        "another scheme", "no host", "a port that is not a number"])
def test_an_s3_endpoint_no_client_can_use_is_named_at_start(monkeypatch, tmp_path, endpoint, refused):
    """The S3 client is made at its first use, so a worker would otherwise take it at start."""
    monkeypatch.setenv("GPUSCHED_S3_ENDPOINT", endpoint)
    if refused:
        with pytest.raises(SettingsError, match="GPUSCHED_S3_ENDPOINT: .* is no S3 endpoint: give an http"):
            load_settings(tmp_path)
    else:
        assert load_settings(tmp_path).s3_endpoint == endpoint


@pytest.mark.parametrize("env, words", [
    ({"GPUSCHED_TEMPORAL_TLS_CERT": "/etc/hostname"}, "go together"),
    ({"GPUSCHED_TEMPORAL_TLS_KEY": "/etc/hostname"}, "go together"),
    ({"GPUSCHED_TEMPORAL_TLS_CA": "/no/such/ca.pem"}, "GPUSCHED_TEMPORAL_TLS_CA: cannot read /no/such/ca.pem"),
], ids=["a client certificate without its key", "a key without its certificate", "a CA file that is not there"])
def test_temporal_tls_settings_no_client_can_use_are_named(monkeypatch, tmp_path, env, words):
    import asyncio

    from workers.settings import connect_temporal

    for var, value in env.items():
        monkeypatch.setenv(var, value)
    with pytest.raises(SettingsError, match=words):
        asyncio.run(connect_temporal(load_settings(tmp_path)))


@pytest.mark.parametrize("argv, code", [
    (["list"], 2),
    (["dev", "status"], 2),
    (["dev", "down"], 2),
    (["dev", "up"], 2),
], ids=["a job command", "the stack's status", "stopping the stack", "starting the stack"])
def test_a_data_dir_this_user_may_not_look_into_is_said_in_one_line(monkeypatch, tmp_path, capsys, argv, code):
    """Path.exists raises PermissionError for a folder without search permission (root is never
    refused, so the refusal is made here)."""
    from workers.cli import main

    for var in [v for v in os.environ if v.startswith("GPUSCHED_")]:
        monkeypatch.delenv(var)
    locked = tmp_path / "locked"
    locked.mkdir()
    real_exists = Path.exists

    def exists(self, *a, **k):
        if str(self).startswith(f"{locked}/"):
            raise PermissionError(13, "Permission denied", str(self))
        return real_exists(self, *a, **k)

    monkeypatch.setattr(Path, "exists", exists)
    assert main([*argv, "--data-dir", str(locked)]) == code
    err = capsys.readouterr().err
    assert err == (f"error: cannot look into {locked} (Permission denied); give a data directory this user may "
                   "read, with --data-dir or GPUSCHED_DATA_DIR\n")


@pytest.mark.parametrize("name, failures, error, within, stopped, outcome, tries", [
    ("a server back after two refusals is connected to", 2, ConnectionRefusedError, 10, False, "connected", 3),
    ("an error not retried (a wrong password) ends the wait at once", 5, PermissionError, 10, False,
     "PermissionError", 1),
    ("a server that stays down ends the wait as not reachable", 99, ConnectionRefusedError, 0.6, False,
     "NotReachable", 2),
    ("a worker told to stop stops waiting", 99, ConnectionRefusedError, 10, True, None, 1),
])
def test_a_worker_waits_for_a_server_that_is_restarting(name, failures, error, within, stopped, outcome, tries):
    import asyncio

    from workers.settings import keep_connecting

    calls = []

    async def connect():
        calls.append(1)
        if len(calls) <= failures:
            raise error("no")
        return "connected"

    async def scenario():
        stop = asyncio.Event()
        if stopped:
            stop.set()
        try:
            return await keep_connecting("a server", connect, stop, within=within,
                                         retry_on=(ConnectionRefusedError,))
        except Exception as e:  # noqa: BLE001 - the row names what ends the wait
            return type(e).__name__

    assert asyncio.run(scenario()) == outcome
    assert len(calls) == tries


def test_a_worker_told_to_stop_gives_up_a_try_under_way_and_lets_it_undo_its_work():
    """A control worker whose migration waited for another's lock (up to two minutes, retrying)
    went on waiting through SIGTERM: the stop was looked at only between tries."""
    import asyncio

    from workers.settings import keep_connecting

    ended = []

    async def migrate():
        try:
            await asyncio.sleep(60)  # a lock held elsewhere
        finally:
            ended.append("rolled back")

    async def scenario():
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(0.05, stop.set)
        return await asyncio.wait_for(keep_connecting("Postgres, to migrate it,", migrate, stop, within=120), 5)

    assert asyncio.run(scenario()) is None
    assert ended == ["rolled back"]


@pytest.mark.parametrize("ends", ["the worker is told to stop", "the caller's own wait runs out"])
def test_a_try_given_up_is_waited_for_while_it_undoes_its_work(ends, caplog):
    """Given up, a try still rolls back; the worker waits for that, and what the rollback raised
    is not reported as an error never retrieved."""
    import asyncio

    from workers.settings import keep_connecting

    steps = []

    async def migrate():
        try:
            await asyncio.sleep(60)
        finally:
            await asyncio.sleep(0.05)  # the rollback takes a moment
            steps.append("rolled back")
            raise RuntimeError("connection closed while rolling back")

    async def scenario():
        stop = asyncio.Event()
        if ends == "the worker is told to stop":
            asyncio.get_running_loop().call_later(0.05, stop.set)
        try:
            answer = await asyncio.wait_for(keep_connecting("Postgres, to migrate it,", migrate, stop, within=120),
                                            5 if ends == "the worker is told to stop" else 0.05)
        except TimeoutError:
            answer = "timed out"
        steps.append(f"answered {answer}")
        await asyncio.sleep(0.1)  # anything left running would end, and be reported, here

    asyncio.run(scenario())
    expected = "answered None" if ends == "the worker is told to stop" else "answered timed out"
    assert steps == ["rolled back", expected]
    assert "never retrieved" not in caplog.text


def test_a_setting_no_try_can_mend_is_not_waited_for_as_a_server_that_is_down():
    """A Temporal TLS file that cannot be read was retried as "not reachable" for a minute, and
    the worker then ended with a traceback; the workers now say it in one line (exit 2)."""
    import asyncio

    from workers.settings import SettingsError, keep_connecting

    calls = []

    async def connect():
        calls.append(1)
        raise SettingsError("GPUSCHED_TEMPORAL_TLS_CERT: cannot read /nonexistent.pem (No such file or directory)")

    with pytest.raises(SettingsError):
        asyncio.run(keep_connecting("Temporal", connect, asyncio.Event(), within=10))
    assert calls == [1]


@pytest.mark.parametrize("worker", [["workers.agent", "--machine-id", "c1/b0/r0/m0", "--fake-devices"],
                                    ["workers.control"]], ids=["the agent", "the control worker"])
def test_a_worker_given_a_tls_file_it_cannot_read_says_so_in_one_line_and_exits_2(worker, tmp_path):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", *worker, "--data-dir", str(tmp_path),
                           "--temporal-tls-cert", "/nonexistent.pem", "--temporal-tls-key", "/nonexistent.pem"],
                          capture_output=True, text=True, timeout=60, cwd=Path(__file__).parents[1])
    assert done.returncode == 2, done.stderr
    assert "GPUSCHED_TEMPORAL_TLS_CERT: cannot read /nonexistent.pem" in done.stderr
    assert "Traceback" not in done.stderr and "retrying" not in done.stderr


def test_a_server_that_stays_down_is_named_with_the_wait_and_its_last_error():
    import asyncio

    from workers.settings import NotReachable, keep_connecting

    async def connect():
        raise ConnectionRefusedError(111, "Connect call failed ('127.0.0.1', 1)")

    with pytest.raises(NotReachable) as raised:
        asyncio.run(keep_connecting("Postgres at postgresql://127.0.0.1:1/gpusched", connect, asyncio.Event(),
                                    within=0.6, retry_on=(ConnectionRefusedError,)))
    assert str(raised.value) == ("Postgres at postgresql://127.0.0.1:1/gpusched not reachable for 1 s: "
                                 "[Errno 111] Connect call failed ('127.0.0.1', 1); start it, or check the "
                                 "address in the settings")
    assert isinstance(raised.value.__cause__, ConnectionRefusedError)


def _control(argv):
    from workers import control
    control.main(argv)


def _api(argv):
    from workers import api
    api.main(argv)


def _agent(argv):
    from workers import agent
    raise SystemExit(agent.main(["--machine-id", "c1/b0/r0/m0", "--fake-devices", "--gpus", "1", *argv]))


# Before, each ended with a traceback and exit 1 (the API's from inside uvicorn's startup).
@pytest.mark.parametrize("name, start, patched, down", [
    ("the control worker whose Postgres stays down says so in one line", _control, "workers.control",
     "Postgres at postgresql://postgres:***@127.0.0.1:1/gpusched not reachable"),
    ("the API whose Postgres stays down says so in one line", _api, "workers.api",
     "Postgres at postgresql://postgres:***@127.0.0.1:1/gpusched not reachable"),
    ("the agent whose Temporal stays down says so in one line", _agent, "workers.agent",
     "Temporal at 127.0.0.1:1 not reachable"),
])
def test_a_worker_whose_server_stays_down_at_start_exits_69_in_one_line(monkeypatch, caplog, tmp_path, name,
                                                                          start, patched, down):
    import importlib
    import logging

    module = importlib.import_module(patched)
    monkeypatch.setattr(module, "CONNECT_WITHIN", 0.6)
    if patched == "workers.agent":
        monkeypatch.setattr(module, "REGISTER_WITHIN", 0.3)
    caplog.set_level(logging.INFO)
    closed = ["--pg-dsn", "postgresql://postgres:secret@127.0.0.1:1/gpusched", "--temporal-address", "127.0.0.1:1",
              "--api-url", "http://127.0.0.1:1"]
    with pytest.raises(SystemExit) as ended:
        start(["--data-dir", str(tmp_path), *closed])
    assert ended.value.code == 69
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert [down in r.getMessage() for r in errors] == [True], [r.getMessage() for r in errors]
    assert all(r.exc_info is None for r in caplog.records)
    assert "secret" not in caplog.text


class _Clusters:
    """A store whose cluster list fails `failures` times with `error` first."""

    def __init__(self, failures: int, error: BaseException):
        self.failures, self.error, self.asked = failures, error, 0

    async def cluster_names(self):
        self.asked += 1
        if self.asked <= self.failures:
            raise self.error
        return ["c1", "c2"]


@pytest.mark.parametrize("name, store, outcome, configured", [
    ("Postgres refusing just after the worker connected is waited for",
     _Clusters(2, ConnectionRefusedError(111, "Connect call failed")), True, ["c1", "c2"]),
    ("Postgres shutting down just after the worker connected is waited for",
     _Clusters(1, asyncpg.AdminShutdownError("terminating connection")), True, ["c1", "c2"]),
    ("a bug is not waited for", _Clusters(1, TypeError("unsupported operand")), "TypeError", []),
])
def test_the_control_worker_starts_the_clusters_loops_once_postgres_answers_again(monkeypatch, name, store, outcome,
                                                                                  configured):
    """Before, Postgres killed between the worker's connection and its first query ended the
    worker with a traceback, and no control worker ran until it was started again."""
    import asyncio

    from workers import control

    started = []

    async def configure(client, cluster, prefix, loop):
        started.append(cluster)

    monkeypatch.setattr(control, "configure_scheduler", configure)

    async def scenario():
        try:
            return await control.start_scheduler_loops(store, None, "", None, asyncio.Event())
        except Exception as e:  # noqa: BLE001 - the row names what ends the start
            return type(e).__name__

    assert asyncio.run(scenario()) == outcome
    assert started == configured


def test_the_stack_on_this_host_is_reached_without_the_proxy_set_for_the_internet(monkeypatch):
    """A proxy exported to reach PyPI took every request to 127.0.0.1 too (httpx, boto3): `dev up`
    failed with "Failed to connect to proxy URL", and so did every command."""
    import http.server
    import threading
    import urllib.request

    import httpx

    from workers.settings import loopback_without_proxy

    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")  # nothing answers there
    monkeypatch.setenv("NO_PROXY", "corp.example")  # one spelling only, as systemd's docs write it
    monkeypatch.setenv("no_proxy", "")

    class Answers(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Answers)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        loopback_without_proxy()
        assert os.environ["NO_PROXY"] == os.environ["no_proxy"] == "corp.example,127.0.0.1,localhost,::1"
        assert httpx.get(f"http://127.0.0.1:{server.server_port}/", timeout=5).status_code == 204
        # The user's own hosts still go around the proxy, whichever spelling a tool reads first.
        assert urllib.request.proxy_bypass_environment("corp.example")
        loopback_without_proxy()  # a child that does it again adds nothing
        assert os.environ["no_proxy"] == "corp.example,127.0.0.1,localhost,::1"
    finally:
        server.shutdown()
