"""The embedded dev stack behind ``gpusched dev up|status|down``: every gpusched process on one
machine, in one data directory.

``DATA_DIR/stack.json`` records the connection settings (what ``load_settings`` reads, so every
gpusched command finds the stack) and each component's pid, ports and command line; logs go to
``DATA_DIR/logs/<component>.log``. Servers (Postgres, Temporal, SeaweedFS S3) are started only
where the settings do not point at external ones; workers are the control worker, the HTTP API
and one agent per machine. Every operation is idempotent and acts on recorded pids only.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import json
import os
import secrets
import shlex
import shutil
import signal
import socket
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Annotated, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, Field, ValidationError

from scheduler.fleet import Fleet
from scheduler.models import Machine
from workers import servers
from workers.settings import (
    STACK_FILE,
    Settings,
    SettingsError,
    agent_log_dir,
    damaged_stack_fix,
    default_data_dir,
    env_overrides,
    machine_component,
    machine_token,
    ready_path,
    settings_env,
    stack_present,
    without_password,
)
from workflows.types import first_error

SERVERS = ("postgres", "temporal", "s3")
# The setting that, given from outside, means "use that server, do not start ours".
SERVER_SETTING = {"postgres": "pg_dsn", "temporal": "temporal_address", "s3": "s3_endpoint"}
# Ports `gpusched dev up` takes when free, so the stack is where people expect it.
STANDARD_PORTS = {"postgres": {"port": 5432}, "temporal": {"port": 7233, "ui": 8233},
                  "s3": {"s3": 8333, "master": 9333, "volume": 9340, "filer": 8888},
                  "api": {"port": 8080}}
PROJECT_ROOT = Path(__file__).resolve().parents[1]
# How many times `up` starts again a worker that a signal killed while it started.
WORKER_RESTARTS = 2


class StackError(Exception):
    """The stack could not be brought to the asked state; the message says which component and
    ends with the tail of its log."""


class NotForThisHost(StackError):
    """What was asked cannot run on this host; nothing was started."""


class DataDirError(StackError):
    """The data directory given cannot hold a stack (a file, a folder this user may not read):
    nothing was started or stopped."""


# stack.json is ours but a person may edit it: a value no process could have is refused when it
# is read, in words, not met later as a traceback (or, for pid -1, a signal to every process).
Port = Annotated[int, Field(ge=1, le=65535)]


class Component(BaseModel):
    kind: Literal["server", "worker"]
    pid: int | None = Field(default=None, ge=1)
    port: Port | None = None
    ports: dict[str, Port] = Field(default_factory=dict)
    machine_id: str | None = None
    cmd: list[str] = Field(default_factory=list)
    log: str = ""
    stop_signal: int = Field(default=signal.SIGTERM, ge=1, le=signal.SIGRTMAX)
    stop_grace: float = Field(default=10.0, ge=0, le=3600, allow_inf_nan=False)
    # A worker's: a digest of the settings it was started with (None: started by an older build).
    settings_digest: str | None = None
    # An agent's: the generation of its machine's token it was last started with, for a start
    # while the database does not answer.
    token_generation: int = Field(default=0, ge=0)

    def running(self) -> bool:
        return servers.is_running(self.pid, self.cmd)


class StackState(BaseModel):
    settings: dict = Field(default_factory=dict)
    components: dict[str, Component] = Field(default_factory=dict)
    cluster: str = "c1"
    machines: list[Machine] = Field(default_factory=list)
    # The count last asked for: 0 (no agents: a real fleet's join) is kept as it is, where an
    # empty list of machines alone reads as a stack never given any.
    machines_asked: int | None = None
    gpus_per_machine: int = 8
    gpu_type: str = "H100"
    external: list[Literal[SERVERS]] = Field(default_factory=list)  # servers we use but did not start
    temporal_ui_url: str | None = None
    fast: bool = False  # Postgres without fsync (tests)
    fake_devices: bool = False  # agents use fake GPUs even where NVML finds real ones (the demo)
    worker_args: dict[str, list[str]] = Field(default_factory=dict)  # extra argv by role


class ComponentStatus(BaseModel):
    name: str
    kind: Literal["server", "worker", "external"]
    pid: int | None
    port: int | None
    healthy: bool
    machine_id: str | None = None


class UpResult(BaseModel):
    data_dir: str
    settings: Settings
    temporal_ui_url: str | None
    components: list[ComponentStatus]
    restarted: list[str] = Field(default_factory=list)  # running workers started again with new settings
    revived: list[str] = Field(default_factory=list)  # components of the stack that had stopped, started again


# Each machine of the embedded stack is an agent process on this one: a fleet file of more is for
# the simulator, or for `gpusched fleet apply` against real machines.
MAX_MACHINES = 64
TOKEN_READ_TIMEOUT_S = 5.0  # a database that does not answer (stopped, frozen) keeps no agent from starting


def fleet_machines(cluster: str, count: int, gpus: int, gpu_type: str) -> list[Machine]:
    """The dev fleet: one block, racks of 16 machines."""
    return [Machine(id=f"{cluster}/b0/r{i // 16}/m{i % 16}", cluster=cluster, block="b0",
                    rack=f"r{i // 16}", gpus=gpus, gpu_type=gpu_type) for i in range(count)]


# --- state ---------------------------------------------------------------------------------

def resolve_data_dir(data_dir: Path | str | None) -> Path:
    return Path(data_dir or default_data_dir()).expanduser().absolute()


def has_stack_file(path: Path) -> bool:
    """Whether the stack file is there; a data directory this user may not look into is a
    DataDirError."""
    try:
        return stack_present(path)
    except SettingsError as e:
        raise DataDirError(str(e)) from None


def load_state(data_dir: Path | str | None = None) -> StackState | None:
    path = resolve_data_dir(data_dir) / STACK_FILE
    if not has_stack_file(path):
        return None
    try:
        state = StackState.model_validate_json(path.read_text())
        Settings(**state.settings)  # every command builds them: one of the wrong type fails here, in words
        return state
    except ValidationError as e:
        field, message = first_error(e)
        why = message if field == "request" else f"{field}: {message}"  # "request": the file as a whole
    except (OSError, ValueError) as e:
        why = getattr(e, "strerror", None) or str(e)
    raise DataDirError(f"{path} is not a gpusched stack file ({why}); {damaged_stack_fix(path)}")


def _save(data_dir: Path, state: StackState) -> None:
    servers.write_private(data_dir / STACK_FILE, state.model_dump_json(indent=2))  # S3 keys, the API token


@contextmanager
def _locked(data_dir: Path) -> Iterator[None]:
    """One stack operation at a time per data directory (two `up`s would start everything twice)."""
    _refuse_a_file(data_dir)  # mkdir would say only "File exists"
    data_dir.mkdir(parents=True, exist_ok=True)
    with open(data_dir / "stack.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _refuse_a_file(data_dir: Path) -> None:
    if data_dir.exists() and not data_dir.is_dir():
        raise DataDirError(f"{data_dir} is a file, not a data directory; give --data-dir a folder "
                           "(a new one, or the one a stack was started in)")


def _log(data_dir: Path, name: str) -> Path:
    return data_dir / "logs" / f"{name}.log"


# --- up -------------------------------------------------------------------------------------

def up(data_dir: Path | str | None = None, *, machines: int | None = None,
       gpus_per_machine: int | None = None, cluster: str | None = None,
       gpu_type: str | None = None, settings: dict[str, object] | None = None,
       agent_args: list[str] | None = None, control_args: list[str] | None = None,
       api_args: list[str] | None = None, fast: bool | None = None, ui: bool = True,
       standard_ports: bool = False, workers: bool = True, timeout: float = 60.0,
       fake_devices: bool | None = None, fleet: Fleet | None = None, out: IO[str] | None = None) -> UpResult:
    """Start whatever of the stack is not running, wait until all of it is healthy, and say where
    it is. ``settings`` (Settings fields) and ``GPUSCHED_*`` variables naming a Postgres DSN,
    Temporal address or S3 endpoint make the stack use that server instead of starting one;
    tests use this to share servers and give each test its own database and
    ``task_queue_prefix``. ``fleet`` (a fleet file's) gives the machines, one agent each, with
    their places, GPU types and partitions, and sets its quotas; without it the machines are
    ``machines`` alike. Arguments left None keep what the stack had (or the defaults)."""
    data_dir = resolve_data_dir(data_dir)
    with _locked(data_dir):
        state = load_state(data_dir) or StackState()
        # Named in the summary: a killed agent or worker that comes back is news to whoever ran `up`.
        stopped = [name for name, comp in state.components.items() if comp.kind != "external" and not comp.running()]
        state.cluster = cluster or state.cluster
        state.fast = state.fast if fast is None else fast
        state.fake_devices = state.fake_devices if fake_devices is None else fake_devices
        if not state.machines and gpus_per_machine is None and gpu_type is None and fleet is None:
            # A new stack on a host with NVIDIA GPUs is a machine of those GPUs: its count and type
            # as NVML reports them, not 8 H100s (an L40S host's jobs asking for L40S were refused,
            # and a 1-GPU host's 4-GPU job was admitted to wait for 7 GPUs that are not there).
            gpus_per_machine, gpu_type = _host_gpus(state.fake_devices)
        state.gpus_per_machine = gpus_per_machine or state.gpus_per_machine
        state.gpu_type = gpu_type or state.gpu_type
        # Whether this `up` says what the machines are: then they are written as it says; otherwise
        # the database keeps what `fleet apply` has set since (a partition, say).
        declared = (fleet is not None or not state.machines
                    or any(v is not None for v in (machines, gpus_per_machine, cluster, gpu_type)))
        if fleet is not None:
            state.machines = [m for c in fleet.clusters for m in c.machines]
            state.cluster = fleet.clusters[0].name
        elif declared:
            # A stack of a fleet file keeps its machines until asked for others.
            if machines is not None:
                state.machines_asked = machines
            count = machines if machines is not None else (
                len(state.machines) or (state.machines_asked if state.machines_asked is not None
                                        else _default_machines(state)))
            state.machines = fleet_machines(state.cluster, count, state.gpus_per_machine, state.gpu_type)
        for role, extra in (("agent", agent_args), ("control", control_args), ("api", api_args)):
            if extra is not None:
                state.worker_args[role] = list(extra)

        if len(state.machines) > 1 and not state.fake_devices and _real_gpus_here():
            raise NotForThisHost(
                f"this host has NVIDIA GPUs: each of the stack's {len(state.machines)} machines would offer "
                f"the same ones, and two jobs would share a GPU; run one machine (--machines 1), whose agent "
                f"watches them, or --fake-devices for several simulated machines")
        explicit = {**env_overrides(), **{k: v for k, v in (settings or {}).items() if v is not None}}
        before = Settings(**state.settings)
        _start_servers(data_dir, state, explicit, ui=ui, standard_ports=standard_ports, timeout=timeout)
        state.settings = {**state.settings, **explicit}
        settings_now = Settings(**state.settings)
        _save(data_dir, state)
        _prepare_database(settings_now, state, fleet, declared)
        restarted = _start_workers(data_dir, state, before, standard_ports=standard_ports,
                                   timeout=timeout) if workers else []
        result = UpResult(data_dir=str(data_dir), settings=Settings(**state.settings),
                          temporal_ui_url=state.temporal_ui_url, components=_statuses(data_dir, state),
                          restarted=restarted,
                          revived=[name for name in stopped if name in state.components and state.components[name].running()])
    if out is not None:
        _print_summary(result, out)
    return result


def _start_servers(data_dir: Path, state: StackState, explicit: dict, *, ui: bool,
                   standard_ports: bool, timeout: float, only: tuple[str, ...] = SERVERS) -> None:
    todo = []
    for name in only:
        field = SERVER_SETTING[name]
        ours = state.components.get(name)
        if field in explicit:
            # A value equal to what our own server had is ours (e.g. the shell exported the
            # lines `dev up` printed), not an external server.
            external = ours is None or state.settings.get(field) != explicit[field]
            if not external:
                # Ours: where it starts now (another port, if its own is taken) wins over the
                # old address the shell still has.
                del explicit[field]
        else:
            external = name in state.external
        if external:
            state.external = sorted(set(state.external) | {name})
            if ours is not None and not ours.running():
                del state.components[name]
            continue
        state.external = [n for n in state.external if n != name]
        if ours is None or not ours.running():
            todo.append(name)

    def start(name: str) -> servers.ServerProcess:
        ours = state.components.get(name)
        prefer = dict(ours.ports) if ours else (STANDARD_PORTS[name] if standard_ports else {})
        if ours:
            servers.wait_ports_free(prefer, paired=name == "s3")
        log = _log(data_dir, name)
        if name == "postgres":
            return servers.start_postgres(data_dir / "postgres", port=prefer.get("port"),
                                          fast=state.fast, log_path=log, timeout=timeout)
        if name == "temporal":
            return servers.start_temporal(data_dir / "temporal", port=prefer.get("port"),
                                          ui_port=prefer.get("ui"), ui=ui, log_path=log, timeout=timeout)
        bucket = str(explicit.get("s3_bucket") or state.settings.get("s3_bucket") or servers.BUCKET)
        return servers.start_s3(data_dir / "s3", ports=prefer or None, bucket=bucket, log_path=log,
                                timeout=timeout)

    # Each start's server (or error) is kept by the thread that started it: a ^C may come
    # between any two steps here, and what was started must be found all the same.
    ended: dict[str, object] = {}
    starting: set[str] = set()

    def start_and_keep(name: str) -> None:
        starting.add(name)
        try:
            ended[name] = start(name)
        except Exception as e:
            ended[name] = e

    pool = ThreadPoolExecutor(max(1, len(todo)))  # together: ~2.5 s instead of ~4
    asked: list[str] = []
    try:
        for name in todo:
            asked.append(name)  # before the start: one asked is waited for below
            pool.submit(start_and_keep, name)
        pool.shutdown(wait=True)
    except BaseException:
        # Interrupted (^C): the servers being started come up all the same, their threads run
        # on. Recorded once up, `down` stops them; unrecorded, the next `up` started a second
        # Temporal or SeaweedFS on the same data, or found Postgres's data taken. Waited for by
        # their results, not by joining their threads again (a join a ^C cut short may not
        # wait a second time).
        began = time.monotonic()
        with contextlib.suppress(BaseException):  # a second ^C: record what has started by then
            while not set(asked) <= ended.keys() and time.monotonic() < began + timeout + 10.0:
                # One asked but not begun a second on (the ^C came before its thread) never will.
                if starting <= ended.keys() and time.monotonic() > began + 1.0:
                    break
                time.sleep(0.05)
        _record_servers(state, dict(ended))
        _save(data_dir, state)
        raise
    errors = _record_servers(state, ended)
    if "temporal" in state.external:
        state.temporal_ui_url = None
    if errors:
        _save(data_dir, state)  # what did start stays recorded, so `down` can stop it
        raise StackError("\n".join(errors))


def _record_servers(state: StackState, ended: dict[str, object]) -> list[str]:
    """Record in ``state`` the servers started (by name: the server, or the start's error);
    returns the errors of those that failed."""
    errors = []
    for name, server in ended.items():
        if isinstance(server, servers.ServerError):
            errors.append(str(server))
            continue
        if isinstance(server, Exception):  # a full disk, a failing useradd: the others' servers are still recorded
            errors.append(f"{name} did not start: {type(server).__name__}: {server}")
            continue
        state.components[name] = Component(
            kind="server", pid=server.pid, port=server.port, ports=server.ports, cmd=server.cmd,
            log=server.log_path, stop_signal=server.stop_signal, stop_grace=server.stop_grace)
        if isinstance(server, servers.PostgresServer):
            state.settings["pg_dsn"] = server.dsn
        elif isinstance(server, servers.TemporalServer):
            state.settings["temporal_address"] = server.address
            state.temporal_ui_url = server.ui_url
        elif isinstance(server, servers.S3Server):
            state.settings.update(s3_endpoint=server.endpoint, s3_access_key=server.access_key,
                                  s3_secret_key=server.secret_key, s3_bucket=server.bucket,
                                  s3_region=server.region)
    return errors


def _prepare_database(settings: Settings, state: StackState, fleet: Fleet | None, declared: bool) -> None:
    """Apply the migrations and register the fleet: both idempotent, so done on every `up`; a
    fleet file's quotas are set at the `up` that is given it only (`quota set` may change them),
    and the machines are written over only by an `up` that declares them (`declared`): one that
    brings a killed agent back put back the partitions `fleet apply` had set."""
    from activities.store import Store

    async def prepare() -> None:
        store = await Store.connect(settings.pg_dsn)
        try:
            await store.migrate()
            await store.register_fleet(state.cluster, state.machines, overwrite=declared)  # a fleet file's among them
            for team, quota in (fleet.every_quota if fleet is not None else {}).items():
                await store.set_quota(team, quota)
        finally:
            await store.close()

    try:
        asyncio.run(prepare())
    except Exception as e:  # a boundary: the CLI prints one line, not a traceback
        raise StackError(f"migrating and registering the fleet in {without_password(settings.pg_dsn)} failed: "
                         f"{type(e).__name__}: {e}") from e


def _worker_commands(data_dir: Path, state: StackState,
                     api_port: int) -> dict[str, tuple[list[str], str | None]]:
    """Each worker's argv and machine id, by component name."""
    base = [sys.executable, "-m"]
    d = str(data_dir)
    cmds: dict[str, tuple[list[str], str | None]] = {
        "control": (base + ["workers.control", "--data-dir", d] + state.worker_args.get("control", []), None),
        "api": (base + ["workers.api", "--data-dir", d, "--port", str(api_port)]
                + state.worker_args.get("api", []), None),
    }
    # Where the host has NVIDIA GPUs the agent watches them through NVML, or refuses to start
    # when NVML fails: fake, healthy GPUs in place of real ones nobody watches would hide that.
    fake = ["--fake-devices"] if state.fake_devices or not _real_gpus_here() else []
    for m in state.machines:
        cmds[machine_component(m.id)] = (
            base + ["workers.agent", "--data-dir", d, "--machine-id", m.id, "--gpus", str(m.gpus),
                    "--gpu-type", m.gpu_type] + fake + state.worker_args.get("agent", []),
            m.id,
        )
    return cmds


def _default_machines(state: StackState) -> int:
    """A new stack's machines: two, or one on a host with NVIDIA GPUs (its agent watches them;
    several would each offer the same GPUs) unless its GPUs are faked."""
    return 1 if not state.fake_devices and _real_gpus_here() else 2


def _real_gpus_here() -> bool:
    from workers.devices import nvidia_gpus_present

    return nvidia_gpus_present() or _nvml_gpu_count() > 0


def _host_gpus(fake_devices: bool) -> tuple[int | None, str | None]:
    """(count, type) of this host's NVIDIA GPUs as its agent will report them, or (None, None)
    where its GPUs are faked or NVML cannot tell (the defaults then hold)."""
    if fake_devices:
        return None, None
    found = _nvml_inventory()
    return (len(found), found[0].gpu_type) if found else (None, None)


def _nvml_inventory() -> list:
    try:
        from workers.devices import NvmlDevices

        devices = NvmlDevices()
        try:
            return devices.inventory()
        finally:
            devices.close()
    except Exception:  # no driver or library: the agent says why when it starts
        return []


def _nvml_gpu_count() -> int:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return pynvml.nvmlDeviceGetCount()
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no pynvml, no driver, no GPU: the agents fake their devices
        return 0


def _start_workers(data_dir: Path, state: StackState, before: Settings, *, standard_ports: bool,
                   timeout: float) -> list[str]:
    """Start the workers that do not run, and those that run with other settings or arguments
    than they would be given now; returns the names of the latter. ``before``: the stack's
    settings before this `up`, taken for those of a worker that recorded none (started by an
    older build)."""
    api = state.components.get("api")
    if api is not None and api.running():
        api_port = api.port
    else:
        prefer = (api.ports if api else None) or (STANDARD_PORTS["api"] if standard_ports else {})
        api_port = servers.choose_ports(["port"], prefer)["port"]
    state.settings["api_url"] = f"http://{servers.HOST}:{api_port}"
    # The API's secret, made once and kept with the stack (a token given in the environment or
    # as a setting wins); each agent is given its machine's token made from it (_launch_worker).
    state.settings.setdefault("api_token", None)
    if not state.settings["api_token"]:
        state.settings["api_token"] = secrets.token_urlsafe(32)
    wanted = _worker_commands(data_dir, state, api_port)
    # Agents of machines no longer in the fleet go, and so do the jobs one that died left running:
    # its record gone, nothing else would stop them (`down` looks through the recorded agents).
    gone = [name for name, comp in state.components.items() if comp.kind == "worker" and name not in wanted]
    for name in gone:
        _stop(data_dir, name, state.components[name])
    _stop_left_jobs(data_dir, state, gone)
    for name in gone:
        del state.components[name]
    _save(data_dir, state)  # the workers read their settings from here
    now = Settings(**state.settings)
    env = _worker_env(data_dir, now)
    wanted = {name: ([str(c) for c in cmd], machine_id) for name, (cmd, machine_id) in wanted.items()}
    # A server it uses came back on another port (its own was taken), or it was asked for other
    # arguments: left running, a worker would go on with the old ones, and one that cannot reach
    # Temporal or Postgres strands its work while looking alive. Stopped together: each may take
    # its whole grace, its servers gone.
    # An agent whose machine's token was renewed (`fleet token --renew`) since it started has the
    # old one, which the API refuses within seconds: it is started again with the new one.
    renewed = _token_generations(env.get("GPUSCHED_PG_DSN")) if env.get("GPUSCHED_API_TOKEN") else {}
    restarted = [name for name, (cmd, machine_id) in wanted.items()
                 if (comp := state.components.get(name)) is not None and comp.running()
                 and ((comp.settings_digest or _settings_digest(before, machine_id)) != _settings_digest(now, machine_id)
                      or comp.cmd != cmd
                      or (machine_id is not None and renewed.get(machine_id, comp.token_generation)
                          != comp.token_generation))]
    with ThreadPoolExecutor(max(1, len(restarted))) as pool:
        list(pool.map(lambda name: _stop(data_dir, name, state.components[name]), restarted))
    for name, (cmd, machine_id) in wanted.items():
        comp = state.components.get(name)
        if comp is not None and comp.running():
            continue
        state.components[name] = Component(
            kind="worker", port=api_port if name == "api" else None,
            ports={"port": api_port} if name == "api" else {}, machine_id=machine_id,
            cmd=cmd, log=str(_log(data_dir, name)), stop_grace=_stop_grace(cmd),
            settings_digest=_settings_digest(now, machine_id))
        try:
            _launch_worker(data_dir, name, state.components[name], env)
        finally:
            # Each as it starts (an agent's start waits for Postgres, up to 5 s): a ^C between
            # two left the ones started unrecorded, and `dev down` did not stop them.
            _save(data_dir, state)
    # All of them, not only those just started: one that runs but hangs is reported too.
    ours = [n for n, c in state.components.items() if c.kind == "server"]
    _wait_healthy(data_dir, state, ours + list(wanted), timeout, env)
    return restarted


# Workers started by an older build that cannot work beside this one's: changed, it restarts every
# worker of a running stack at its next `up`. ("machine-tokens": an older API refuses the agents'
# own tokens, and older agents carry the API's.)
WORKERS_SPEAK = "machine-tokens"


def _settings_digest(settings: Settings, machine_id: str | None) -> str:
    """What tells the settings a worker reads from others, without keeping secrets twice. An
    agent (a worker with a machine) never reads the database's: a new DSN must not stop its jobs."""
    env = settings_env(settings.model_copy(update={"pg_dsn": None}) if machine_id is not None else settings)
    env["speaks"] = WORKERS_SPEAK
    return hashlib.sha256(json.dumps(env, sort_keys=True).encode()).hexdigest()[:16]


def _stop_grace(cmd: list[str]) -> float:
    """How long `down` waits for a worker after SIGTERM before SIGKILL: an agent gives its jobs
    their grace (its own --grace-period) to checkpoint, and SIGKILLed before that it would leave
    them running (they run in sessions of their own) with nobody to stop them."""
    return 10.0 if "workers.agent" not in cmd else _agent_grace(cmd) + 15.0


def _agent_grace(cmd: list[str]) -> float:
    """The grace an agent started with ``cmd`` gives the jobs it stops (its --grace-period)."""
    from workers.agent import parse_args

    return parse_args(cmd[cmd.index("workers.agent") + 1:]).grace_period


def _launch_worker(data_dir: Path, name: str, comp: Component, env: dict[str, str]) -> None:
    ready_path(data_dir, name).unlink(missing_ok=True)
    if comp.machine_id is not None and env.get("GPUSCHED_API_TOKEN"):
        # An agent carries its machine's token, not the API's: it speaks for its machine alone.
        dsn = env.get("GPUSCHED_PG_DSN")
        try:
            comp.token_generation = _token_generation(dsn, comp.machine_id) if dsn else 0
        except Exception as e:  # noqa: BLE001 - an agent needs the API, not the database: it starts
            Path(comp.log).parent.mkdir(parents=True, exist_ok=True)
            with open(comp.log, "a") as log:
                log.write(f"--- cannot read the generation of {comp.machine_id}'s token ({type(e).__name__}: {e}); "
                          f"started with generation {comp.token_generation}, as last time\n")
        env = {**env, "GPUSCHED_API_TOKEN": machine_token(env["GPUSCHED_API_TOKEN"], comp.machine_id,
                                                          comp.token_generation)}
    comp.pid = servers.spawn(comp.cmd, Path(comp.log), env=env, cwd=PROJECT_ROOT).pid


def _token_generation(dsn: str, machine_id: str) -> int:
    """The generation of the machine's token now: one renewed (`gpusched fleet token --renew`)
    is started with its new token, or the API would not hear it."""
    return _read_token_generations(dsn).get(machine_id, 0)


def _token_generations(dsn: str | None) -> dict[str, int]:
    """Every renewed machine's token generation now, or none where the database does not answer
    (the agents are then left as they are)."""
    try:
        return _read_token_generations(dsn) if dsn else {}
    except Exception:  # noqa: BLE001 - the agents keep running; the next `up` looks again
        return {}


def _read_token_generations(dsn: str) -> dict[str, int]:
    """The generation of every machine token renewed at least once (the others are at 0)."""
    from activities.store import Store

    async def read() -> dict[str, int]:
        store = await Store.connect(dsn, timeout=TOKEN_READ_TIMEOUT_S)
        try:
            return await store.token_generations()
        finally:
            await store.close()

    return asyncio.run(asyncio.wait_for(read(), TOKEN_READ_TIMEOUT_S))


def _worker_env(data_dir: Path, settings: Settings) -> dict[str, str]:
    # Variables of another stack in our own environment must not leak into this one's workers.
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUSCHED_")}
    env.update(settings_env(settings))
    env["GPUSCHED_DATA_DIR"] = str(data_dir)
    # Run this checkout's code, whatever the current directory or the installed copy.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PROJECT_ROOT), env.get("PYTHONPATH")) if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    # A worker that crashes in native code (a segfault, an abort) leaves its threads' Python
    # stacks in its log instead of nothing.
    env.setdefault("PYTHONFAULTHANDLER", "1")
    return env


def _wait_healthy(data_dir: Path, state: StackState, names: list[str], timeout: float,
                  env: dict[str, str]) -> None:
    """Wait until every named component is healthy. A worker killed by a signal while it starts
    (a native crash in a library, the OOM killer) is started again, up to ``WORKER_RESTARTS``
    times: what a supervisor would do. One that exits with a code refused to run (bad
    configuration, no GPUs) and is reported at once, as is one that does not get healthy."""
    deadline = time.monotonic() + timeout
    pending = set(names)
    failed: dict[str, str] = {}
    restarts: dict[str, int] = {}
    while pending and time.monotonic() < deadline:
        for name in sorted(pending):
            comp = state.components[name]
            if not comp.running():
                code = servers.exit_code(comp.pid)
                if (comp.kind == "worker" and code is not None and code < 0
                        and restarts.get(name, 0) < WORKER_RESTARTS):
                    restarts[name] = restarts.get(name, 0) + 1
                    with open(comp.log, "a") as log:
                        log.write(f"--- {name} was {servers.describe_exit(code)} while starting; "
                                  "starting it again\n")
                    _launch_worker(data_dir, name, comp, env)
                    _save(data_dir, state)
                    continue
                failed[name] = "exited" if code is None else f"exited ({servers.describe_exit(code)})"
                pending.discard(name)
            elif _healthy(data_dir, name, comp):
                pending.discard(name)
        if pending:
            time.sleep(0.1)
    failed.update({name: f"not healthy after {timeout:.0f} s" for name in pending})
    if failed:
        raise StackError("\n".join(
            f"{name} {why}; log {state.components[name].log}:\n{servers.log_tail(state.components[name].log)}"
            for name, why in sorted(failed.items())))


def _healthy(data_dir: Path, name: str, comp: Component) -> bool:
    if not comp.running():
        return False
    if comp.kind == "server":
        return _port_open(servers.HOST, comp.port)
    try:
        ready = ready_path(data_dir, name).read_text().strip() == str(comp.pid)
    except OSError:
        ready = False
    if not ready or name != "api":
        return ready
    import httpx

    try:
        return httpx.get(f"http://{servers.HOST}:{comp.port}/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _port_open(host: str, port: int | None) -> bool:
    if not port:
        return False
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except (OSError, OverflowError):  # OverflowError: a port past 65535 in a hand-edited address
        return False


def _print_summary(result: UpResult, out: IO[str]) -> None:
    s = result.settings
    names = [c.name + (" (external)" if c.kind == "external" else "")
             for c in result.components if not c.machine_id]
    agents = sum(1 for c in result.components if c.machine_id)
    print(f"gpusched dev stack is up in {result.data_dir}: {', '.join(names)}, {agents} agent(s)",
          file=out)
    if result.revived:
        print(f"  started again (they were not running): {', '.join(result.revived)}", file=out)
    if result.restarted:
        print(f"  started again with the stack's new settings: {', '.join(result.restarted)}", file=out)
    if result.temporal_ui_url:
        print(f"  Temporal UI: {result.temporal_ui_url}", file=out)
    print(f"  HTTP API:    {s.api_url}", file=out)
    print(f"  Temporal:    {s.temporal_address}, namespace {s.temporal_namespace}", file=out)
    print(f"  logs:        {Path(result.data_dir) / 'logs'}", file=out)
    # Only the folder: the stack's other settings exported (they were printed as exports) win over
    # any --data-dir after them, and a command meant for another stack went to this one.
    print(f"Its settings are in {Path(result.data_dir) / STACK_FILE}; gpusched commands find them with "
          f"--data-dir, or with:", file=out)
    print(f"export GPUSCHED_DATA_DIR={shlex.quote(str(result.data_dir))}", file=out)


# --- status, down, single components --------------------------------------------------------

def status(data_dir: Path | str | None = None) -> list[ComponentStatus]:
    data_dir = resolve_data_dir(data_dir)
    _refuse_a_file(data_dir)  # not "no stack": up and down refuse it too
    state = load_state(data_dir)
    return [] if state is None else _statuses(data_dir, state)


def _statuses(data_dir: Path, state: StackState) -> list[ComponentStatus]:
    result = []
    settings = Settings(**state.settings)
    for name in state.external:
        host, port = _address_of(name, settings)
        result.append(ComponentStatus(name=name, kind="external", pid=None, port=port,
                                      healthy=_port_open(host, port)))
    for name, comp in sorted(state.components.items(), key=lambda kv: _order(kv[0], kv[1])):
        result.append(ComponentStatus(
            name=name, kind=comp.kind, pid=comp.pid if comp.running() else None, port=comp.port,
            healthy=_healthy(data_dir, name, comp), machine_id=comp.machine_id))
    return result


def _order(name: str, comp: Component) -> tuple:
    """Servers first (in start order), then control, api, agents."""
    if comp.kind == "server":
        return (0, SERVERS.index(name) if name in SERVERS else 9, name)
    return (1, {"control": 0, "api": 1}.get(name, 2), name)


def _address_of(name: str, settings: Settings) -> tuple[str, int | None]:
    if name == "temporal":
        host, _, port = settings.temporal_address.rpartition(":")
        return host, int(port) if port.isascii() and port.isdigit() else None
    url = urlsplit(settings.pg_dsn if name == "postgres" else settings.s3_endpoint or "")
    default = {"postgres": 5432, "s3": 443 if url.scheme == "https" else 80}[name]
    try:
        return url.hostname or "", url.port or default
    except ValueError:  # a port no address has: the status says unhealthy, the connection says why
        return url.hostname or "", None


def down(data_dir: Path | str | None = None, *, purge: bool = False) -> list[str]:
    """Stop the workers (agents, then the API, then the control worker), then our servers, by
    recorded pid; returns the names stopped. The data stays (a later `up` resumes on it) unless
    ``purge``, which deletes the data directory."""
    data_dir = resolve_data_dir(data_dir)
    if not data_dir.exists():
        return []
    stopped = []
    # Under the lock before anything is read: an `up` under way (its first, say, before it has
    # written stack.json) is waited for, then stopped, instead of "nothing to stop".
    with _locked(data_dir):
        if not (data_dir / STACK_FILE).exists():
            if purge and any(p.name != "stack.lock" for p in data_dir.iterdir()):
                raise StackError(f"{data_dir} has no {STACK_FILE}: not a gpusched stack, not deleting it")
            if purge:
                shutil.rmtree(data_dir, ignore_errors=True)
            return []
        state = load_state(data_dir)
        names = sorted(state.components, key=lambda n: _order(n, state.components[n]))
        agents = [n for n in names if state.components[n].machine_id]
        groups = [agents, ["api"], ["control"], [n for n in names if state.components[n].kind == "server"]]
        for k, group in enumerate(groups):
            group = [n for n in group if n in state.components]
            with ThreadPoolExecutor(max(1, len(group))) as pool:
                done = list(pool.map(lambda n: _stop(data_dir, n, state.components[n]), group))
            stopped += [n for n, was in zip(group, done, strict=True) if was]
            if k == 0:
                _stop_left_jobs(data_dir, state, agents)
        _save(data_dir, state)
    if purge:
        shutil.rmtree(data_dir)
    return stopped


def _stop_left_jobs(data_dir: Path, state: StackState, agents: list[str]) -> None:
    """Stop the jobs of agents that died without stopping them (killed, as a machine's death is
    played): they run in sessions of their own, and only the machine's next agent would stop
    them. Each gets its agent's grace; their pid files stay for that next agent's reports."""
    from activities.node import pid_dir
    from activities.run_processes import stop_left_runs

    def stop(name: str) -> None:
        comp = state.components[name]
        try:
            stop_left_runs(pid_dir(agent_log_dir(data_dir, comp.machine_id), comp.machine_id),
                           _agent_grace(comp.cmd))
        except (Exception, SystemExit) as e:  # `down` goes on: the rest of the stack is stopped still
            print(f"warning: cannot stop the jobs {name} left running: {e}", file=sys.stderr)

    with ThreadPoolExecutor(max(1, len(agents))) as pool:
        list(pool.map(stop, [n for n in agents if "workers.agent" in state.components[n].cmd]))


def _stop(data_dir: Path, name: str, comp: Component, sig: int | None = None) -> bool:
    sig = comp.stop_signal if sig is None else sig
    was = servers.stop(comp.pid, comp.cmd, sig, comp.stop_grace)
    if was and name == "s3" and comp.kind == "server":
        servers.remove_weed_sockets(comp.ports)
    comp.pid = comp.pid if comp.running() else None
    ready_path(data_dir, name).unlink(missing_ok=True)
    return was


def stop_component(data_dir: Path | str | None, name: str, sig: int | None = None) -> bool:
    """Stop one component, by default as `down` stops it (its own signal: SIGINT for Postgres,
    whose SIGTERM waits for every client to leave; ``sig`` SIGKILL: kill it at once, as a crash
    would); returns whether it was running. Its record stays, so `start_component` or `up`
    brings it back."""
    data_dir = resolve_data_dir(data_dir)
    with _locked(data_dir):
        state = _require(data_dir, name)
        was = _stop(data_dir, name, state.components[name], sig)
        _save(data_dir, state)
    return was


def start_component(data_dir: Path | str | None, name: str, timeout: float = 60.0) -> ComponentStatus:
    """Start one recorded component again (a no-op if it runs) and wait until it is healthy."""
    data_dir = resolve_data_dir(data_dir)
    with _locked(data_dir):
        state = _require(data_dir, name)
        comp = state.components[name]
        if comp.kind == "server":
            _start_servers(data_dir, state, {}, ui=bool(state.temporal_ui_url), standard_ports=False,
                           timeout=timeout, only=(name,))
        elif not comp.running():
            env = _worker_env(data_dir, Settings(**state.settings))
            comp.settings_digest = _settings_digest(Settings(**state.settings), comp.machine_id)
            _launch_worker(data_dir, name, comp, env)
            _save(data_dir, state)
            _wait_healthy(data_dir, state, [name], timeout, env)
        _save(data_dir, state)
        return next(s for s in _statuses(data_dir, state) if s.name == name)


def _require(data_dir: Path, name: str) -> StackState:
    state = load_state(data_dir)
    if state is None:
        raise StackError(f"no stack in {data_dir} (run `gpusched dev up` first)")
    if name not in state.components:
        known = ", ".join(sorted(state.components)) or "none"
        raise StackError(f"no component '{name}' in the stack in {data_dir} (components: {known})")
    return state


def status_json(statuses: list[ComponentStatus]) -> str:
    return json.dumps([s.model_dump() for s in statuses], indent=2)
