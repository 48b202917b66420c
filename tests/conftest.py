"""Fixtures shared by the test modules: the real servers (Postgres, Temporal, SeaweedFS) that the
live tests run against, started once per session; see tests/live/servers.py."""

from live.jobs import stack  # noqa: F401
from live.servers import live_servers, live_stack  # noqa: F401


def pytest_configure(config):
    config.addinivalue_line("markers", "live: runs against real servers started by the fixtures")
