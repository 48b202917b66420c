"""The control worker: runs JobWorkflow and ClusterSchedulerWorkflow and the control-side
activities (the Postgres store, the plan cycle, waking schedulers).

    python -m workers.control [--data-dir DIR] [--tick SECONDS] [--cycles-per-run N] [--reconcile-every SECONDS]

Any number may run: Temporal hands each workflow task to one of them, and each cluster's
scheduler is one workflow, so killing a control worker loses nothing; another carries on.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from pathlib import Path

import asyncpg

from temporalio.api.operatorservice.v1 import ListSearchAttributesRequest
from temporalio.service import RPCError
from temporalio.worker import Worker

from activities.checkpoints import S3OnFirstUse
from activities.jobs import JobActivities, configure_scheduler
from activities.outages import DATABASE_DOWN
from activities.planning import PlanningActivities
from activities.store import MigrationBlocked, Store
from workers.arg_types import positive_float, positive_int
from workers.servers import SEARCH_ATTRIBUTES, ServerError, register_search_attributes
from workers.settings import (EXIT_NOT_REACHABLE, NotReachable, Settings, SettingsError, add_settings_flags,
                              connect_temporal, keep_connecting,
                              loopback_without_proxy, mark_ready,
                              settings_from_args, temporal_tls, without_password)
from workflows.cluster import ClusterSchedulerWorkflow
from workflows.job import JobWorkflow
from workflows.types import SchedulerInput

SWEEPS_AT_EXIT_S = 10.0  # how long a stopping worker waits for ended jobs' sweeps
CONNECT_WITHIN = 60.0  # seconds to wait for Postgres and Temporal at start (then the supervisor restarts us)

log = logging.getLogger("gpusched.control")


async def ensure_search_attributes(client) -> None:
    """Register gpusched's search attributes where they are missing, as the store is migrated:
    a job workflow that publishes one the namespace lacks fails every workflow task, so its job
    would stall. A server that lets us list but not add them (Temporal Cloud) stops the worker
    with the command to run; one that lets us do neither is warned about and trusted."""
    try:
        added = await register_search_attributes(client)
    except RPCError as e:
        try:
            listed = await client.operator_service.list_search_attributes(
                ListSearchAttributesRequest(namespace=client.namespace))
        except RPCError:
            log.warning("cannot list the search attributes of namespace %s (%s); make sure %s exist",
                        client.namespace, e.message, ", ".join(f"{k} ({v})" for k, v in SEARCH_ATTRIBUTES.items()))
            return
        missing = [k for k in SEARCH_ATTRIBUTES if k not in listed.custom_attributes]
        if not missing:
            return
        # The CLI pairs each --name with the --type at its position: one of each per attribute.
        commands = (f"`temporal operator search-attribute create --namespace {client.namespace} "
                    + " ".join(f"--name {k} --type {SEARCH_ATTRIBUTES[k]}" for k in missing) + "`")
        raise ServerError(f"namespace {client.namespace} lacks the search attributes {', '.join(missing)} and "
                          f"they could not be added from here ({e.message}); add them with {commands} "
                          "(or in your Temporal Cloud console) and start the worker again") from None
    if added:
        log.info("registered the search attributes %s on namespace %s", ", ".join(added), client.namespace)


async def start_scheduler_loops(store, client, prefix: str, loop: SchedulerInput, stop: asyncio.Event) -> bool:
    """Each cluster's loop runs even before the first job event (and after a restart). Its flags
    reach a loop that runs already (started by another worker, or before a restart with other
    flags), not only one it starts. Postgres or Temporal going down just after the worker
    connected is waited for, as at the connection (before, the worker died with a traceback and
    no control worker ran until it was started again: a cancel waited 90 s in a chaos run).
    False if asked to stop meanwhile."""

    async def configure_each() -> bool:
        for cluster in await store.cluster_names():
            await configure_scheduler(client, cluster, prefix, loop)
        return True

    started = await keep_connecting("Postgres and Temporal, to start the clusters' scheduler loops,", configure_each,
                                    stop, within=CONNECT_WITHIN, retry_on=(*DATABASE_DOWN, RPCError))
    return bool(started)


async def serve(settings: Settings, data_dir: Path | None, loop: SchedulerInput, stop: asyncio.Event) -> None:
    # Postgres or Temporal restarting as the worker starts is waited for (a refused connection,
    # or "the database system is starting up"); a wrong password or DSN fails at once.
    store = await keep_connecting(f"Postgres at {without_password(settings.pg_dsn)}",
                                  lambda: Store.connect(settings.pg_dsn), stop, within=CONNECT_WITHIN,
                                  retry_on=(OSError, asyncpg.CannotConnectNowError))
    if store is None:
        return
    try:
        async def migrate() -> bool:
            await store.migrate()
            return True

        if not await keep_connecting(f"Postgres at {without_password(settings.pg_dsn)}, to migrate it,", migrate,
                                     stop, within=CONNECT_WITHIN, retry_on=DATABASE_DOWN):
            return
        client = await keep_connecting(f"Temporal at {settings.temporal_address}",
                                       lambda: connect_temporal(settings), stop, within=CONNECT_WITHIN)
        if client is None:
            return
        await ensure_search_attributes(client)
        # A HEAD that must end within STORE_LOOK_S (its thread is not stopped at the timeout):
        # (2 s + 5 s) for each of at most two tries; also the sweep of an ended job's leftovers.
        s3 = S3OnFirstUse(endpoint=settings.s3_endpoint, access_key=settings.s3_access_key,
                          secret_key=settings.s3_secret_key, region=settings.s3_region, read_timeout=5, retries=1)
        jobs = JobActivities(store, client, settings.task_queue_prefix, loop, settings.s3_bucket, s3)
        planning = PlanningActivities(store)
        worker = Worker(
            client,
            task_queue=settings.control_task_queue,
            workflows=[JobWorkflow, ClusterSchedulerWorkflow],
            activities=[jobs.admit_job, jobs.start_attempt, jobs.end_attempt, jobs.doubt_unusable_checkpoint,
                        jobs.machines_silent_for, jobs.machines_heard,
                        jobs.set_job_state, jobs.mark_attempt_stopping, jobs.set_priority, jobs.wake_scheduler,
                        jobs.abandon_allocations, jobs.reconcile_allocations,
                        planning.plan_cycle],
            max_concurrent_activities=64,
        )
        async with worker:
            if not await start_scheduler_loops(store, client, settings.task_queue_prefix, loop, stop):
                return
            mark_ready(data_dir, "control")
            log.info("control worker serving %s", settings.control_task_queue)
            await stop.wait()
            log.info("shutting down")
        try:  # the sweeps of jobs that just ended run after their end was answered
            await asyncio.wait_for(jobs.settled(), SWEEPS_AT_EXIT_S)
        except TimeoutError:
            log.warning("left the sweep of some ended jobs' checkpoints unfinished (%.0f s)", SWEEPS_AT_EXIT_S)
    finally:
        await store.close()


def main(argv: list[str] | None = None) -> None:
    loopback_without_proxy()
    parser = argparse.ArgumentParser(prog="python -m workers.control", description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, default=None, help="the embedded stack's directory")
    # Checked here: a loop's settings that its model refuses failed the worker with a traceback
    # after it had migrated the database.
    parser.add_argument("--tick", type=positive_float, default=2.0, help="seconds between scheduling cycles when idle")
    parser.add_argument("--cycles-per-run", type=positive_int, default=500,
                        help="the scheduler loop continues as new after this many cycles")
    parser.add_argument("--reconcile-every", type=positive_float, default=60.0, metavar="SECONDS",
                        help="how often the scheduler loop looks for allocations whose job workflow has ended")
    add_settings_flags(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    settings = settings_from_args(args, args.data_dir)
    try:
        temporal_tls(settings)  # before any server is waited for: no wait mends these
    except SettingsError as e:
        log.error("%s", e)
        raise SystemExit(2) from None

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        loop_settings = SchedulerInput(cluster="", tick_seconds=args.tick, cycles_per_run=args.cycles_per_run,
                                       reconcile_seconds=args.reconcile_every)
        await serve(settings, args.data_dir, loop_settings, stop)

    try:
        asyncio.run(run())
    except ServerError as e:  # the operator's to fix: one line, not a traceback
        log.error("%s", e)
        raise SystemExit(2) from None
    except (NotReachable, MigrationBlocked) as e:  # a supervisor starts it again later
        log.error("%s", e)
        raise SystemExit(EXIT_NOT_REACHABLE) from None


if __name__ == "__main__":
    main()
