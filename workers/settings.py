"""Connection settings for every gpusched process, from flags, environment or the embedded stack.

Precedence: an explicit value (a flag) over a ``GPUSCHED_*`` environment variable over the
embedded stack's ``stack.json`` (written by ``gpusched dev up`` into its data directory).

| variable                        | meaning                                          |
|---------------------------------|--------------------------------------------------|
| GPUSCHED_DATA_DIR               | the embedded stack's directory (~/.gpusched)      |
| GPUSCHED_TEMPORAL_ADDRESS       | host:port of the Temporal frontend               |
| GPUSCHED_TEMPORAL_NAMESPACE     | namespace (default)                              |
| GPUSCHED_TEMPORAL_TLS_CERT/KEY  | client certificate and key files (mTLS)          |
| GPUSCHED_TEMPORAL_TLS_CA        | server CA file; set alone for server-only TLS    |
| GPUSCHED_PG_DSN                 | postgresql://user@host:port/db                   |
| GPUSCHED_S3_ENDPOINT            | http(s)://host:port                              |
| GPUSCHED_S3_BUCKET              | bucket for checkpoints                           |
| GPUSCHED_S3_ACCESS_KEY/SECRET_KEY | credentials                                    |
| GPUSCHED_S3_REGION              | region (us-east-1)                               |
| GPUSCHED_API_URL                | http://host:port of the HTTP API                 |
| GPUSCHED_API_TOKEN              | the secret the API asks of callers; an agent's   |
|                                 | own: its machine's token (`machine_token`)       |
| GPUSCHED_TEMPORAL_UI_URL        | the Temporal UI, for links to job histories      |
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import os
import sys
from pathlib import Path
from typing import Awaitable, Callable, TypeVar
from urllib.parse import quote, urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from workflows.types import CONTROL_TASK_QUEUE, agent_task_queue, first_error

T = TypeVar("T")
_log = logging.getLogger("gpusched.connect")

STACK_FILE = "stack.json"


def default_data_dir() -> Path:
    return Path(os.environ.get("GPUSCHED_DATA_DIR") or Path.home() / ".gpusched").expanduser()


class Settings(BaseModel):
    model_config = ConfigDict(extra="ignore")

    temporal_address: str = "127.0.0.1:7233"
    temporal_namespace: str = "default"
    temporal_tls_cert: str | None = None
    temporal_tls_key: str | None = None
    temporal_tls_ca: str | None = None
    pg_dsn: str = "postgresql://postgres@127.0.0.1:5432/gpusched"
    s3_endpoint: str | None = None
    s3_bucket: str = "gpusched-checkpoints"
    s3_access_key: str | None = None
    s3_secret_key: str | None = None
    s3_region: str = "us-east-1"
    api_url: str = "http://127.0.0.1:8080"
    # The API's secret: it answers only requests that carry it (``Authorization: Bearer``), so
    # nobody else on the network can report for a machine or commit a checkpoint. None: no check.
    # An agent's is its machine's token (`machine_token`), which speaks for that machine alone.
    api_token: str | None = None
    temporal_ui_url: str | None = None  # where people read job histories, when there is a UI

    @field_validator("s3_endpoint")
    @classmethod
    def _an_http_url(cls, endpoint: str | None) -> str | None:
        # Said at start: the S3 client is made at its first use (activities.checkpoints.S3OnFirstUse),
        # which would otherwise be the first checkpoint's, long after.
        if endpoint is not None:
            try:
                parts = urlsplit(endpoint)
                parts.port  # noqa: B018  (raises for a port that is not one)
            except ValueError:
                parts = None
            if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"{endpoint!r} is no S3 endpoint: give an http:// or https:// URL with a host, "
                                 "e.g. http://127.0.0.1:8333")
        return endpoint
    # Task queue names are prefixed so that several stacks (parallel test runs) can share one
    # Temporal server; empty in production.
    task_queue_prefix: str = ""

    @property
    def control_task_queue(self) -> str:
        return self.task_queue_prefix + CONTROL_TASK_QUEUE

    def agent_task_queue(self, machine_id: str) -> str:
        return self.task_queue_prefix + agent_task_queue(machine_id)


_ENV = {
    "temporal_address": "GPUSCHED_TEMPORAL_ADDRESS",
    "temporal_namespace": "GPUSCHED_TEMPORAL_NAMESPACE",
    "temporal_tls_cert": "GPUSCHED_TEMPORAL_TLS_CERT",
    "temporal_tls_key": "GPUSCHED_TEMPORAL_TLS_KEY",
    "temporal_tls_ca": "GPUSCHED_TEMPORAL_TLS_CA",
    "pg_dsn": "GPUSCHED_PG_DSN",
    "s3_endpoint": "GPUSCHED_S3_ENDPOINT",
    "s3_bucket": "GPUSCHED_S3_BUCKET",
    "s3_access_key": "GPUSCHED_S3_ACCESS_KEY",
    "s3_secret_key": "GPUSCHED_S3_SECRET_KEY",
    "s3_region": "GPUSCHED_S3_REGION",
    "api_url": "GPUSCHED_API_URL",
    "api_token": "GPUSCHED_API_TOKEN",
    "temporal_ui_url": "GPUSCHED_TEMPORAL_UI_URL",
    "task_queue_prefix": "GPUSCHED_TASK_QUEUE_PREFIX",
}


_TLS_FILES = ("temporal_tls_cert", "temporal_tls_key", "temporal_tls_ca")
# A secret or a TLS file that failed to mount leaves its variable empty: taken for unset, the API
# answered anyone (or took a local stack's token) and Temporal was reached without TLS.
_NEVER_EMPTY = ("api_token", *_TLS_FILES)


def damaged_stack_fix(stack: Path) -> str:
    """What to do about a stack file nothing can read: `dev up` will not write over it, as the
    servers and workers it names may still run."""
    return (f"stop what it started if any of it runs (its processes name the folder: `pgrep -af {stack.parent}`), "
            f"move it aside (`mv {stack} {stack}.damaged`), and `gpusched dev up` starts a new stack there")


def load_settings(data_dir: Path | None = None, **explicit: object) -> Settings:
    """Settings for this process: flags (``explicit``, None meaning unset) over environment over
    the embedded stack's stack.json in ``data_dir`` (or the default data directory)."""
    values: dict[str, object] = {}
    stack = (data_dir or default_data_dir()) / STACK_FILE
    if stack_present(stack):
        try:
            state = json.loads(stack.read_text())
        except (OSError, ValueError) as e:
            raise SettingsError(f"{stack} cannot be read ({e}); {damaged_stack_fix(stack)}, or "
                                "set GPUSCHED_* (see README)") from None
        if not isinstance(state, dict) or not isinstance(state.get("settings", {}), dict):
            raise SettingsError(f"{stack} is not a stack file (a JSON object with its settings); "
                                f"{damaged_stack_fix(stack)}")
        values.update(state.get("settings", {}))
        if state.get("temporal_ui_url"):
            values.setdefault("temporal_ui_url", state["temporal_ui_url"])
    for field, var in _ENV.items():
        if os.environ.get(var) or var in os.environ and field in _NEVER_EMPTY:
            values[field] = os.environ[var]
    values.update({k: v for k, v in explicit.items() if v is not None})
    for field in _TLS_FILES:
        if values.get(field) == "":
            # Taken for unset, the client connected without TLS (or the CA it was told of).
            raise SettingsError(f"{_ENV[field]} is set but empty; give the file, or unset it")
    if isinstance(values.get("api_token"), str):
        values["api_token"] = values["api_token"].strip()  # read from a file, with its newline
        if not values["api_token"]:
            # A secret that failed to mount: taken as "no token", the API would answer anyone
            # and nothing would visibly break.
            raise SettingsError("the API token (GPUSCHED_API_TOKEN or --api-token) is set but blank; give the "
                                "token, or unset it to run the API without one")
    try:
        return Settings(**values)
    except ValidationError as e:
        field, message = first_error(e)
        raise SettingsError(f"{_ENV.get(field, field)}: {message}") from None


class SettingsError(ValueError):
    """A setting given in a way no process can run with; the message names it and the fix."""


class NotReachable(ConnectionError):
    """A server a worker needs at start stayed down for the whole wait: the operator's (or the
    supervisor's restart) to mend, said in one line (exit ``EXIT_NOT_REACHABLE``), not a traceback."""


EXIT_NOT_REACHABLE = 69  # sysexits' EX_UNAVAILABLE: a service the worker needs is not there


def missing_stack(data_dir: Path | None) -> Path | None:
    """The stack folder a command would use (the flag, GPUSCHED_DATA_DIR, or the default
    ~/.gpusched) when it holds no stack and no GPUSCHED_* setting points elsewhere:
    `load_settings` would then fall back to the default local ports, which may be another
    stack's (whose Temporal takes anyone's `cancel`). None when that is not the case."""
    folder = Path(data_dir).expanduser() if data_dir is not None else default_data_dir()
    return None if env_overrides() or stack_present(folder / STACK_FILE) else folder


def stack_present(stack: Path) -> bool:
    """Whether a stack file is there; a folder this user may not look into is said in words
    (Path.exists raises for it instead of answering)."""
    try:
        return stack.exists()
    except OSError as e:
        raise SettingsError(f"cannot look into {stack.parent} ({e.strerror or e}); give a data directory this "
                            "user may read, with --data-dir or GPUSCHED_DATA_DIR") from None


def env_overrides() -> dict[str, str]:
    """The settings that ``GPUSCHED_*`` variables set in this process's environment."""
    return {field: os.environ[var] for field, var in _ENV.items() if os.environ.get(var)}


_PROXIES = ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")


def loopback_without_proxy() -> None:
    """Where a proxy is set (one needed to reach PyPI, say), let this process and its children
    reach 127.0.0.1 without it: the embedded stack, the API and S3 on this host were asked
    through the proxy (httpx, boto3), and `dev up` failed ("Failed to connect to proxy URL")."""
    if not any(os.environ.get(var) for var in _PROXIES):
        return
    # One list in both spellings, the user's hosts kept: Python reads no_proxy first and Go
    # NO_PROXY, so one made of the loopback alone hid the other's hosts from half the tools.
    given = [h.strip() for var in ("NO_PROXY", "no_proxy") for h in os.environ.get(var, "").split(",") if h.strip()]
    os.environ["NO_PROXY"] = os.environ["no_proxy"] = ",".join(dict.fromkeys([*given, "127.0.0.1", "localhost", "::1"]))


def settings_env(settings: Settings) -> dict[str, str]:
    """The environment variables that hand these settings to a child process."""
    env = {}
    for field, var in _ENV.items():
        value = getattr(settings, field)
        if value is not None:
            env[var] = str(value)
    return env


MACHINE_HEADER = "X-Gpusched-Machine"  # the machine an agent speaks for, percent-encoded
MACHINE_TOKEN_PREFIX = "machine-"


def is_machine_token(token: str) -> bool:
    return token.startswith(MACHINE_TOKEN_PREFIX)


def machine_token(secret: str, machine_id: str, generation: int = 0) -> str:
    """The token of one machine's agent, made from the API's own token: it lets the agent speak
    for that machine alone (its heartbeats, its jobs' checkpoint reports), so the API's token need
    not be on every machine, and a machine taken over cannot speak for the rest of the fleet.
    Renewing a machine's token (`gpusched fleet token --renew`) moves it to its next generation,
    and the API takes only the current one's; generation 0 is the token made before renewals
    existed, so agents running then keep theirs."""
    message = machine_id if generation == 0 else f"{machine_id}\0{generation}"  # ids are printable: no NUL
    digest = hmac.new(secret.encode(), message.encode(), hashlib.sha256).hexdigest()
    return MACHINE_TOKEN_PREFIX + digest


def api_headers(settings: Settings, machine_id: str | None = None) -> dict[str, str]:
    """The headers a request to the API carries: the token, when the API has one, and for an
    agent the machine it speaks for (which a machine's token is checked against), as its
    heartbeat's URL names it: without slashes at either end."""
    headers = {"Authorization": f"Bearer {settings.api_token}"} if settings.api_token else {}
    if machine_id is not None:
        headers[MACHINE_HEADER] = quote(machine_id.strip("/"), safe="")
    return headers


async def connect_temporal(settings: Settings):
    """A Temporal client with the pydantic data converter (every payload here is a model)."""
    from temporalio.client import Client
    from temporalio.contrib.pydantic import pydantic_data_converter

    return await Client.connect(
        settings.temporal_address,
        namespace=settings.temporal_namespace,
        tls=temporal_tls(settings),
        data_converter=pydantic_data_converter,
    )


def temporal_tls(settings: Settings):
    """The TLS the Temporal client connects with (False: none); SettingsError for settings no
    connection can use (a workers' start asks first, before it waits for any server)."""
    from temporalio.client import TLSConfig

    tls: TLSConfig | bool = False
    if bool(settings.temporal_tls_cert) != bool(settings.temporal_tls_key):
        raise SettingsError("GPUSCHED_TEMPORAL_TLS_CERT and GPUSCHED_TEMPORAL_TLS_KEY go together (a client "
                            "certificate and its private key): give both, or neither")
    if settings.temporal_tls_ca or settings.temporal_tls_cert:
        def read(field: str) -> bytes | None:
            path = getattr(settings, field)
            if not path:
                return None
            try:
                return Path(path).read_bytes()
            except OSError as e:
                raise SettingsError(f"{_ENV[field]}: cannot read {path} ({e.strerror or e})") from None

        tls = TLSConfig(
            server_root_ca_cert=read("temporal_tls_ca"),
            client_cert=read("temporal_tls_cert"),
            client_private_key=read("temporal_tls_key"),
        )
    return tls


async def keep_connecting(what: str, connect: Callable[[], Awaitable[T]], stop: asyncio.Event, *,
                          within: float, retry_on: tuple[type[BaseException], ...] = (Exception,)) -> T | None:
    """``connect()``, tried again with backoff (0.5 s doubling to 5 s) while it fails with one of
    ``retry_on``, for ``within`` seconds: a server restarting, or started after the worker, is
    waited for instead of ending the worker. None if ``stop`` is set meanwhile, also while a try
    is under way (it is cancelled: a migration waiting minutes for another's lock, for one); once
    the time is up, NotReachable naming ``what``, the wait and the last error."""
    loop = asyncio.get_running_loop()
    deadline, delay = loop.time() + within, 0.5
    while True:
        try:
            return await _unless_stopped(connect(), stop)
        except _Stopped:
            return None
        except SettingsError:
            raise  # a setting no try can mend (a TLS file that cannot be read): not "not reachable"
        except retry_on as err:
            if stop.is_set():
                return None
            if loop.time() + delay > deadline:
                raise NotReachable(f"{what} not reachable for {within:.0f} s: {str(err) or type(err).__name__}; "
                                   "start it, or check the address in the settings") from err
            _log.warning("%s not reachable (%s); retrying", what, str(err) or type(err).__name__)
            try:
                await asyncio.wait_for(stop.wait(), timeout=delay)
            except TimeoutError:
                pass
            delay = min(delay * 2, 5.0)


class _Stopped(Exception):
    """A try given up because the worker was told to stop."""


async def _unless_stopped(attempt: Awaitable[T], stop: asyncio.Event) -> T:
    """``attempt``'s answer, or _Stopped if ``stop`` is set first: the attempt is cancelled and
    waited for while it undoes what it began (a transaction's rollback). One that answers all
    the same (it had just connected) is answered, for the caller to close what it opened."""
    trying = asyncio.ensure_future(attempt)
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait((trying, stopping), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the caller's own wait ended (a timeout, its shutdown)
        await _cancelled(trying)
        raise
    finally:
        stopping.cancel()
    if not trying.done():
        await _cancelled(trying)
        if trying.cancelled() or trying.exception() is not None:
            raise _Stopped
    return trying.result()


async def _cancelled(task: asyncio.Future) -> None:
    """Cancel ``task`` and wait until it has ended; an error it raised as it stopped is of no
    interest now (retrieved, so that it is not reported as never retrieved)."""
    task.cancel()
    try:
        await asyncio.wait((task,))
    finally:
        if task.done() and not task.cancelled():
            task.exception()


def without_password(dsn: str) -> str:
    """The DSN as it may be printed: its password, if any, starred out."""
    url = urlsplit(dsn)
    if url.password is None:
        return dsn
    host = url.netloc.rpartition("@")[2]
    return urlunsplit(url._replace(netloc=f"{url.username or ''}:***@{host}"))


def machine_component(machine_id: str) -> str:
    """The dev stack's name for the agent of a machine: ``c1/b0/r0/m0`` → ``agent-c1-b0-r0-m0``."""
    return "agent-" + machine_id.replace("/", "-")


def agent_log_dir(data_dir: Path, machine_id: str) -> Path:
    """Where the agent of a machine keeps its jobs' logs, reports and pid files."""
    return data_dir / "jobs" / machine_component(machine_id)


def ready_path(data_dir: Path, component: str) -> Path:
    """A worker process writes its pid here once it is connected and serving; the dev stack reads
    it to tell a healthy worker from one that is still starting or has hung at start."""
    return data_dir / "run" / f"{component}.ready"


def mark_ready(data_dir: Path | None, component: str) -> None:
    if data_dir is None:
        return
    path = ready_path(data_dir, component)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(str(os.getpid()))
    tmp.replace(path)


def add_settings_flags(parser) -> None:
    """Flags for every connection setting (``--temporal-address`` …), over the environment."""
    group = parser.add_argument_group("connection settings (default: GPUSCHED_* variables, then the embedded stack)")
    for field in _ENV:
        group.add_argument("--" + field.replace("_", "-"), dest=f"setting_{field}", default=None, metavar="VALUE",
                           help=f"(${_ENV[field]})")


def settings_from_args(args, data_dir: Path | None) -> Settings:
    """A process's settings from its flags; a setting it cannot run with exits 2, in words."""
    explicit = {f: getattr(args, f"setting_{f}", None) for f in _ENV}
    try:
        return load_settings(data_dir, **explicit)
    except SettingsError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
