"""The HTTP API: agents' heartbeats, and read access to jobs, machines and quotas.

    python -m workers.api [--data-dir DIR] [--host 127.0.0.1] [--port 8080]

| method and path                        | what                                              |
|----------------------------------------|---------------------------------------------------|
| GET  /healthz                          | 200 when Postgres answers with every migration    |
| POST /machines/{machine_id}/heartbeat  | an agent reports; answers the allocations live on |
|                                        | the machine (anything else it runs is an orphan)  |
| GET  /machines                         | the fleet with last heartbeats and GPU health     |
| GET  /jobs?team=&state=&limit=         | the newest `limit` (≤ 10,000) jobs; 422 if bad    |
| GET  /jobs/{job_id}                    | one job (JobView), 404 when unknown               |
| GET  /quotas                           | team quotas                                       |
| POST /jobs/{job_id}/checkpoints        | an agent forwards a job's checkpoint report with  |
|                                        | its allocation id; answers committed or refused   |
| POST /jobs/{job_id}/restarts           | an agent forwards how long a resumed attempt took |
|                                        | to restore its state; 409 when not such an attempt|

Machine ids are topology paths (``c1/b0/r0/m0``) and stay slash-separated in the URL.

With a token (``GPUSCHED_API_TOKEN``; ``gpusched dev up`` makes one), every request but
``/healthz`` must carry ``Authorization: Bearer <token>``, or is answered 401: a heartbeat decides
which GPUs jobs go to and a checkpoint report which state a job resumes from, so only agents (and
operators) may send them. An agent carries its machine's own token instead
(``workers.settings.machine_token``, ``gpusched fleet token``) and names its machine in the
``X-Gpusched-Machine`` header: it may send that machine's heartbeats and the reports of
allocations with a GPU there, and nothing else (403: no reads, no schema), so a machine taken
over cannot speak for the rest of the fleet. Without a token, the API warns at start that it answers anyone. A request
body over 1 MiB is refused with 413.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import logging
import re
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated
from urllib.parse import unquote

import asyncpg
import uvicorn
from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from activities.checkpoints import CheckpointCommitter, CheckpointStoreUnavailable, S3OnFirstUse
from activities.outages import DATABASE_DOWN, database_down
from activities.store import LISTEN_EVERY, UNMIGRATED_FIX, GpuReport, Store
from scheduler.fleet import MAX_GPUS_PER_MACHINE
from workers.token_generations import TokenGenerations
from workers.settings import (EXIT_NOT_REACHABLE, MACHINE_HEADER, NotReachable, Settings, add_settings_flags,
                              is_machine_token, keep_connecting, loopback_without_proxy,
                              machine_token, mark_ready, settings_from_args, without_password)
from workflows.types import CheckpointAck, CheckpointReport, JobState, JobView


log = logging.getLogger("gpusched.api")

# What a machine's token may ask: its heartbeats, its jobs' checkpoint and restart reports.
_FOR_A_MACHINE = re.compile(r"/machines/.+/heartbeat|/jobs/[^/]+/(checkpoints|restarts)")

CONNECT_WITHIN = 60.0  # seconds to wait for Postgres at start (then the supervisor restarts us)
WARN_EVERY_S = 10.0  # at most one line per this while the database does not answer

# What Postgres can hold: an id past this, or a NaN or infinite time, is a bad request (422),
# not a database error (500).
AllocationId = Annotated[int, Field(ge=1, le=2**63 - 1)]
_FINITE = ConfigDict(allow_inf_nan=False)


class Heartbeat(BaseModel):
    model_config = _FINITE
    pid: int | None = Field(default=None, ge=1, le=2**31 - 1)  # the agent's process id (an integer column)
    # As many as a machine may hold: a longer list is no machine's, and its checks cost.
    gpus: list[GpuReport] = Field(default_factory=list, max_length=MAX_GPUS_PER_MACHINE)
    running_allocations: list[AllocationId] = Field(default_factory=list, max_length=4 * MAX_GPUS_PER_MACHINE)
    # False while the agent cannot take attempts up: starting, shutting down, or cut off from
    # Temporal. Agents from before it send nothing: they take work.
    accepting_work: bool = True


class HeartbeatReply(BaseModel):
    live_allocations: list[int]


class CheckpointSubmission(BaseModel):
    model_config = _FINITE
    allocation_id: AllocationId  # the fencing token: the attempt the agent ran the job for
    report: CheckpointReport


class RestartReport(BaseModel):
    model_config = _FINITE
    allocation_id: AllocationId  # the resumed attempt the agent ran the job for
    seconds: float = Field(ge=0)  # from its launch to its state restored (jobkit's restored.json); at most the attempt's time


# The largest request body taken: a heartbeat of 1,024 GPUs with their faults is a few dozen
# kB. FastAPI answers a larger one 413 without reading it whole, so no caller can fill the API's
# memory.
MAX_BODY = 1 << 20


async def _listen(store: Store) -> None:
    """Say, every second, that this API hears heartbeats: while nobody says it (every API down,
    or the database), machines are not taken for dead for being silent."""
    ok = True
    while True:
        try:
            await store.listened()
            if not ok:
                log.info("the database answers again: hearing heartbeats")
            ok = True
        except Exception as e:  # the database is down: heartbeats are not heard either
            if ok:
                log.warning("cannot record that the API hears heartbeats: %s", e)
            ok = False
        await asyncio.sleep(LISTEN_EVERY)


async def connect_store(settings: Settings) -> Store:
    # Postgres restarting as the API starts is waited for; before, the API exited (code 3).
    return await keep_connecting(f"Postgres at {without_password(settings.pg_dsn)}",
                                 lambda: Store.connect(settings.pg_dsn), asyncio.Event(),
                                 within=CONNECT_WITHIN, retry_on=(OSError, asyncpg.CannotConnectNowError))


def create_app(settings: Settings, store: Store | None = None) -> FastAPI:
    """The API; it connects to Postgres as it starts unless given ``store``, which it then owns."""
    ctx: dict = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        ctx["store"] = store if store is not None else await connect_store(settings)
        s3 = S3OnFirstUse(endpoint=settings.s3_endpoint, access_key=settings.s3_access_key,
                          secret_key=settings.s3_secret_key, region=settings.s3_region)
        ctx["checkpoints"] = CheckpointCommitter(ctx["store"], s3, settings.s3_bucket)
        listening = asyncio.create_task(_listen(ctx["store"]))
        yield
        listening.cancel()
        await asyncio.gather(listening, return_exceptions=True)
        await ctx["checkpoints"].settled()
        await ctx["store"].close()

    app = FastAPI(title="gpusched", lifespan=lifespan, max_body_size=MAX_BODY)
    expected = settings.api_token.encode() if settings.api_token else None
    if expected is None:
        log.warning("the API has no token (GPUSCHED_API_TOKEN): it answers anyone who can reach it")

    @app.middleware("http")
    async def authorized(request: Request, call_next):
        request.state.machine = None  # the whole API's token, or none asked: every request
        if expected is None or request.url.path == "/healthz":
            return await call_next(request)
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        bearer, given = scheme.lower() == "bearer", given.strip()
        if bearer and hmac.compare_digest(given.encode(), expected):
            return await call_next(request)
        machine = unquote(request.headers.get(MACHINE_HEADER, ""))
        try:
            spoken_for = bearer and is_machine_token(given) and machine and await machines_token(machine, given)
        except asyncpg.UndefinedTableError as e:
            return await unmigrated(request, e)
        except Exception as e:  # noqa: BLE001 - the database's failures are answered as everywhere else
            if not isinstance(e, DATABASE_DOWN) and database_down(e) is None:
                raise
            return await unreachable(request, e)
        if spoken_for:
            if request.method != "POST" or not _FOR_A_MACHINE.fullmatch(request.url.path):
                # Whatever else the API answers now or later (reads, its schema) is for operators.
                return JSONResponse(status_code=403, content={
                    "detail": f"the token of machine '{machine}' sends its heartbeats and its jobs' reports only; "
                              "anything else needs the API's token"})
            request.state.machine = machine
            return await call_next(request)
        return JSONResponse(status_code=401, headers={"WWW-Authenticate": "Bearer"}, content={
            "detail": "missing or wrong API token: send the API's GPUSCHED_API_TOKEN, or an agent its machine's "
                      f"token with the machine in {MACHINE_HEADER}, as 'Authorization: Bearer <token>'"})

    generations = TokenGenerations(lambda: ctx["store"].token_generations())

    async def machines_token(machine: str, given: str) -> bool:
        """Whether `given` is the machine's token of its current generation (a renewed one's old
        token is refused within generations' freshness)."""
        for again in (False, True):
            generation = await generations.of(machine, again=again)
            if hmac.compare_digest(given.encode(), machine_token(settings.api_token, machine, generation).encode()):
                return True
        return False

    def machine_of(request: Request) -> str | None:
        """The machine a request's token speaks for, or None for the API's own token."""
        return request.state.machine

    async def for_an_allocation_here(job_id: str, allocation_id: int, machine: str | None) -> None:
        if machine is not None and not await ctx["store"].allocation_on_machine(job_id, allocation_id, machine):
            raise HTTPException(status_code=403, detail=f"allocation {allocation_id} of job '{job_id}' holds no GPU "
                                                        f"of machine '{machine}', whose token this is")

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        # FastAPI's own answer repeats the input, which cannot be written as JSON when it is a
        # NaN or an infinity (a 500): where and what is enough.
        detail = [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in error.errors()]
        return JSONResponse(status_code=422, content={"detail": detail})

    @app.exception_handler(asyncpg.DataError)  # Postgres refused the value
    @app.exception_handler(asyncpg.exceptions._base.DataError)  # asyncpg could not encode it
    @app.exception_handler(asyncpg.ProgramLimitExceededError)  # too long for an index
    async def unstorable(request: Request, error: Exception) -> JSONResponse:
        # A value Postgres cannot take (a NUL character, a number out of range): the caller's.
        return JSONResponse(status_code=422, content={"detail": f"a value in the request cannot be stored: {error}"})

    unreachable_said = [0.0]

    async def unreachable(request: Request, error: Exception) -> JSONResponse:
        # The caller's to try again (agents do): a 503 in words, not a 500 with a traceback for
        # every heartbeat of the fleet while Postgres restarts. Logged once per WARN_EVERY_S.
        now = time.monotonic()
        if now - unreachable_said[0] >= WARN_EVERY_S:
            unreachable_said[0] = now
            log.warning("answering 503: the database does not answer (%s: %s)", type(error).__name__, error)
        return JSONResponse(status_code=503, content={"detail": f"the database does not answer now ({error}); "
                                                                "try again"})

    for error in DATABASE_DOWN:  # OSError too: S3 refusing or resetting is the same to the caller
        app.add_exception_handler(error, unreachable)

    @app.exception_handler(asyncpg.InterfaceError)
    @app.exception_handler(asyncpg.InternalClientError)
    async def closed_under_it(request: Request, error: Exception) -> JSONResponse:
        # The database died mid-transaction (the transaction finds its connection closed) or shut
        # down under an idle connection (its protocol left broken). Any other interface or
        # client error is a bug of ours, and a 500.
        if database_down(error) is None:
            raise error
        return await unreachable(request, error)

    @app.exception_handler(asyncpg.UndefinedTableError)
    @app.exception_handler(asyncpg.UndefinedColumnError)
    async def unmigrated(request: Request, error: Exception) -> JSONResponse:
        return JSONResponse(status_code=503, content={
            "detail": f"the database has no gpusched schema, or an older one ({error}); {UNMIGRATED_FIX}"})

    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        try:
            missing = await ctx["store"].unmigrated()
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as e:  # a probe's answer, not a 500
            return JSONResponse(status_code=503, content={"ok": False, "detail": f"the database does not answer: {e}"})
        if missing:
            return JSONResponse(status_code=503, content={
                "ok": False, "detail": f"the database lacks migrations {', '.join(missing)}; {UNMIGRATED_FIX}"})
        return JSONResponse(content={"ok": True})

    @app.post("/machines/{machine_id:path}/heartbeat")
    async def heartbeat(machine_id: str, beat: Heartbeat, machine: str | None = Depends(machine_of)) -> HeartbeatReply:
        if machine is not None and machine != machine_id:
            raise HTTPException(status_code=403, detail=f"the token of machine '{machine}' cannot report for "
                                                        f"machine '{machine_id}'")
        try:
            live = await ctx["store"].machine_heartbeat(machine_id, beat.pid, beat.gpus, beat.accepting_work)
        except ValueError as e:
            raise HTTPException(status_code=422, detail=str(e)) from None
        return HeartbeatReply(live_allocations=live)

    @app.get("/machines")
    async def machines(cluster: str | None = None) -> list[dict]:
        return await ctx["store"].list_machines(cluster)

    @app.get("/jobs")
    async def jobs(team: str | None = None, state: JobState | None = None,
                   limit: Annotated[int, Query(ge=1, le=10_000)] = 1000) -> list[JobView]:
        return await ctx["store"].list_jobs(team=team, state=state.value if state else None, limit=limit)

    @app.get("/jobs/{job_id}")
    async def job(job_id: str) -> JobView:
        view = await ctx["store"].job_view(job_id)
        if view is None:
            raise HTTPException(status_code=404, detail=f"no job '{job_id}'")
        return view

    @app.post("/jobs/{job_id}/checkpoints")
    async def checkpoint(job_id: str, submission: CheckpointSubmission,
                         machine: str | None = Depends(machine_of)) -> CheckpointAck:
        await for_an_allocation_here(job_id, submission.allocation_id, machine)  # before: says no job to a machine
        if await ctx["store"].request_of(job_id) is None:
            raise HTTPException(status_code=404, detail=f"no job '{job_id}'")
        try:
            return await ctx["checkpoints"].commit(job_id, submission.allocation_id, submission.report)
        except CheckpointStoreUnavailable as e:  # no verdict: the agent sends the report again
            raise HTTPException(status_code=503, detail=f"cannot check the checkpoint now: {e}") from e

    @app.post("/jobs/{job_id}/restarts")
    async def restart(job_id: str, report: RestartReport, machine: str | None = Depends(machine_of)) -> dict:
        await for_an_allocation_here(job_id, report.allocation_id, machine)
        if await ctx["store"].record_restart(job_id, report.allocation_id, report.seconds):
            return {"recorded": True}
        if await ctx["store"].request_of(job_id) is None:  # only a refusal asks why
            raise HTTPException(status_code=404, detail=f"no job '{job_id}'")
        raise HTTPException(status_code=409, detail=f"allocation {report.allocation_id} is not a resumed "
                                                     f"attempt of job '{job_id}', or its restart is recorded")

    @app.get("/quotas")
    async def quotas() -> dict:
        return {t: q.model_dump() for t, q in (await ctx["store"].list_quotas()).items()}

    return app


def main(argv: list[str] | None = None) -> None:
    loopback_without_proxy()
    parser = argparse.ArgumentParser(prog="python -m workers.api", description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, default=None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    add_settings_flags(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    settings = settings_from_args(args, args.data_dir)

    async def run() -> int:
        # Connected before uvicorn starts: a database down for the whole wait is one line and
        # exit 69 here, where in the app's startup uvicorn printed it as a traceback.
        try:
            store = await connect_store(settings)
        except NotReachable as e:
            log.error("%s", e)
            return EXIT_NOT_REACHABLE
        server = uvicorn.Server(uvicorn.Config(create_app(settings, store), host=args.host, port=args.port,
                                               log_level="warning", access_log=False))
        serving = asyncio.create_task(server.serve())
        while not server.started and not serving.done():
            await asyncio.sleep(0.05)
        if server.started:
            mark_ready(args.data_dir, "api")
        await serving
        return 0

    if code := asyncio.run(run()):
        raise SystemExit(code)


if __name__ == "__main__":
    main()
