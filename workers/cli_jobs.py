"""`gpusched submit|status|list|cancel|bump|wait` and `gpusched quota set|list`: the client on the
command line. Connection settings come from GPUSCHED_* variables or the embedded stack
(``gpusched dev up``); see workers/settings.py.

Exit codes: 0 success; 1 the job did not succeed (``wait``) or the stack is unreachable; 2 a
refused request (bad spec, unknown team, over quota or queue cap, unknown job).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from datetime import datetime
from pathlib import Path

import asyncpg
from pydantic import ValidationError
from temporalio.client import WorkflowUpdateRPCTimeoutOrCancelledError
from temporalio.service import RPCError

from activities.outages import database_down
from activities.store import UNMIGRATED_FIX
from scheduler import in_words
from scheduler.models import DAY, JobKind, PolicyConfig, Priority, Quota, Topology
from workers.arg_types import deadline, finite, limit, positive_float, positive_int, utf8_name
from workers.client import ENDED, ClientError, GpuschedClient, NotYetAdmitted, new_job_id
from workers.settings import SettingsError, load_settings, missing_stack
from workflows.types import JobRequest, JobState, JobView, first_error, flag_for, request_problem, team_problem

EXIT_REFUSED = 2
# Seconds: over an agent's 2 s heartbeat interval plus the 4 s a deaf stretch of the control plane
# takes to show (docs/live.md, Failures), or an API outage takes machines for dead.
MIN_MACHINE_TIMEOUT = 7.0
EXIT_UNREACHABLE = 1
# `wait`: the job ended, but not succeeded (failed or cancelled); or it had not ended in time (as
# timeout(1) exits). Apart from 1, so that a script tells a failed job from a slow one or a stack
# that does not answer.
EXIT_JOB_DID_NOT_SUCCEED = 3
EXIT_WAIT_TIMED_OUT = 124


def add_job_commands(subparsers) -> None:
    def common(p: argparse.ArgumentParser, json_flag: bool = True) -> None:
        p.add_argument("--data-dir", type=Path, default=None, help="the embedded stack's directory")
        if json_flag:
            p.add_argument("--json", action="store_true", help="print JSON")

    submit = subparsers.add_parser("submit", help="submit a job: gpusched submit --team T --gpus N -- CMD ARGS...")
    submit.add_argument("--team", required=True)
    submit.add_argument("--gpus", type=int, required=True, help="number of GPUs (a gang: all or nothing)")
    submit.add_argument("--gpu-type", default=None)
    submit.add_argument("--priority", default="normal", choices=[p.value for p in Priority])
    submit.add_argument("--topology", default=None, choices=[t.value for t in Topology])
    submit.add_argument("--checkpoint-interval", type=finite, default=None, help="seconds")
    submit.add_argument("--expected-duration", type=finite, default=3600.0, help="seconds (default 3600)")
    submit.add_argument("--max-retries", type=int, default=0,
                        help="times a failed command is run again, from its newest checkpoint (default 0)")
    submit.add_argument("--cluster", default=None)
    submit.add_argument("--kind", default="training", choices=[k.value for k in JobKind])
    submit.add_argument("--deadline", type=deadline, default=None, metavar="WHEN",
                        help="a hint: when it should be done, as a date and time (2026-12-08T09:00, local time "
                             "unless it names a zone) or a time from now (+90m, +6h, +2d); `status` says whether "
                             "its estimated start and expected duration miss it")
    submit.add_argument("--job-id", default=None, help="default: a new unique id")
    submit.add_argument("--workdir", default=None, metavar="DIR",
                        help="the directory the command runs in, on its machines (default: the current one; "
                             "none: the agent's own, for a submit from outside the fleet)")
    submit.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="extra environment for the command (repeatable)")
    submit.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the command and its arguments")
    common(submit)
    submit.set_defaults(func=cmd_submit)

    status = subparsers.add_parser("status", help="a job's state, reason and attempts")
    status.add_argument("job_id", type=utf8_name)
    common(status)
    status.set_defaults(func=cmd_status)

    lst = subparsers.add_parser("list", help="list jobs")
    lst.add_argument("--team", type=utf8_name, default=None)
    lst.add_argument("--state", default=None, choices=[s.value for s in JobState])
    lst.add_argument("--limit", type=limit, default=1000, help="the newest N jobs that match (default 1000)")
    common(lst)
    lst.set_defaults(func=cmd_list)

    logs = subparsers.add_parser("logs", help="a job's output, per attempt (agents on this machine)")
    logs.add_argument("job_id", type=utf8_name)
    logs.add_argument("--attempt", type=positive_int, default=None, help="1 for the first (default: the last attempt)")
    logs.add_argument("--data-dir", type=Path, default=None, help="the embedded stack's directory")
    logs.set_defaults(func=cmd_logs)

    cancel = subparsers.add_parser("cancel", help="cancel a job (a running one is stopped with its grace period)")
    cancel.add_argument("job_id", type=utf8_name)
    common(cancel, json_flag=False)
    cancel.set_defaults(func=cmd_cancel)

    bump = subparsers.add_parser("bump", help="change a waiting or running job's priority class")
    bump.add_argument("job_id", type=utf8_name)
    bump.add_argument("--priority", required=True, choices=[p.value for p in Priority])
    common(bump, json_flag=False)
    bump.set_defaults(func=cmd_bump)

    wait = subparsers.add_parser("wait", help="wait for a job to end; exit 0 if it succeeded, 3 if it failed or was "
                                              "cancelled, 124 if it had not ended within --timeout")
    wait.add_argument("job_id", type=utf8_name)
    wait.add_argument("--timeout", type=positive_float, default=None, help="seconds (default: no limit)")
    common(wait)
    wait.set_defaults(func=cmd_wait)

    quota = subparsers.add_parser("quota", help="team quotas")
    qcmd = quota.add_subparsers(dest="quota_command", required=True, metavar="{set,list}")
    qset = qcmd.add_parser("set", help="set a team's guaranteed and maximum GPUs and its queue cap")
    qset.add_argument("team", type=utf8_name, help="the team; '*' sets the default of every team without its own")
    qset.add_argument("--guaranteed", type=int, required=True)
    qset.add_argument("--max", type=int, default=None, help="default: no maximum")
    qset.add_argument("--queue-cap", type=int, default=None, help="default: no cap")
    common(qset, json_flag=False)
    qset.set_defaults(func=cmd_quota_set)
    qlist = qcmd.add_parser("list", help="list quotas")
    common(qlist)
    qlist.set_defaults(func=cmd_quota_list)

    cluster = subparsers.add_parser("cluster", help="a cluster's policy settings and machine timeout")
    ccmd = cluster.add_subparsers(dest="cluster_command", required=True, metavar="{set,list}")
    cset = ccmd.add_parser("set", help="change a cluster's settings (the next cycle uses them)")
    cset.add_argument("cluster", type=utf8_name)
    cset.add_argument("--machine-timeout", type=finite, default=None,
                      help="seconds without a heartbeat before a machine is unreachable (default 120)")
    cset.add_argument("--policy", action="extend", nargs="+", default=[], metavar="KNOB=VALUE",
                      help="policy knobs of docs/policy.md, e.g. --policy grace_period=300 min_runtime=600")
    common(cset, json_flag=False)
    cset.set_defaults(func=cmd_cluster_set)
    clist = ccmd.add_parser("list", help="list clusters with their settings")
    common(clist)
    clist.set_defaults(func=cmd_cluster_list)


def run_with_client(args, body) -> int:
    """Connect, run ``body(client)``, and turn refusals and unreachable servers into one line."""

    try:
        missing = missing_stack(args.data_dir)
    except SettingsError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_REFUSED
    if missing is not None:  # say so instead of answering for a stack on the default ports
        named = args.data_dir is not None or os.environ.get("GPUSCHED_DATA_DIR")
        start = f"gpusched dev up --data-dir {missing}" if named else "gpusched dev up"
        print(f"error: no gpusched stack in {missing}; start one with `{start}`, give the folder of the one "
              "that runs with --data-dir (scripts/demo's is out/stack in its checkout), or set GPUSCHED_* "
              "(see README)", file=sys.stderr)
        return EXIT_UNREACHABLE

    async def go() -> int:
        try:
            settings = load_settings(args.data_dir)
        except SettingsError as e:
            print(f"error: {e}", file=sys.stderr)
            return EXIT_REFUSED
        try:
            client = await GpuschedClient.connect(settings)
        except (OSError, ConnectionError, RuntimeError, TimeoutError) as e:
            why = str(e) or "no answer in time"
            print(f"error: cannot reach the gpusched stack ({why}); start it with `gpusched dev up` "
                  "or set GPUSCHED_* (see README)", file=sys.stderr)
            return EXIT_UNREACHABLE
        except SettingsError as e:
            print(f"error: {e}", file=sys.stderr)
            return EXIT_REFUSED
        except asyncpg.PostgresError as e:  # it answered, and refused: a wrong database or role
            print(f"error: the database (GPUSCHED_PG_DSN) refused the connection: {e}", file=sys.stderr)
            return EXIT_UNREACHABLE
        except (ValueError, OverflowError) as e:  # a DSN or address no client can use
            print(f"error: GPUSCHED_PG_DSN or GPUSCHED_TEMPORAL_ADDRESS cannot be used: {e}", file=sys.stderr)
            return EXIT_REFUSED
        async with client:
            try:
                return await body(client)
            except NotYetAdmitted as e:  # not refused, and not unknown: nothing has admitted it yet
                print(f"error: {e}", file=sys.stderr)
                return EXIT_UNREACHABLE
            except ClientError as e:
                field = f"{e.field}: " if e.field else ""
                print(f"error: {field}{e}", file=sys.stderr)
                return EXIT_REFUSED
            except RPCError as e:  # Temporal could not do it now (unavailable, timed out)
                print(f"error: Temporal did not answer ({e.status.name if e.status else 'error'}: {e.message}); "
                      "is the stack up? `gpusched dev status` shows it", file=sys.stderr)
                return EXIT_UNREACHABLE
            except WorkflowUpdateRPCTimeoutOrCancelledError:  # no control worker took the change
                print("error: no control worker answered in time; is one running? `gpusched dev status` "
                      "shows it", file=sys.stderr)
                return EXIT_UNREACHABLE
            except (asyncpg.UndefinedTableError, asyncpg.UndefinedColumnError) as e:
                print(f"error: the database has no gpusched schema, or an older one ({e}); {UNMIGRATED_FIX}",
                      file=sys.stderr)
                return EXIT_UNREACHABLE
            except (asyncpg.DataError, asyncpg.ProgramLimitExceededError) as e:  # a value the database cannot store
                print(f"error: the database cannot store a value of this request ({e}); give a smaller "
                      "or plainer one", file=sys.stderr)
                return EXIT_REFUSED
            except BrokenPipeError:  # our reader went away (`gpusched list | head`): main stops quietly
                raise
            except Exception as e:
                # Also a database shutting down or starting up (a restart during a submit's wait
                # for its admission), and a pooled connection it left broken: the API's 503s.
                if not (isinstance(e, (asyncpg.PostgresConnectionError, asyncpg.InterfaceError, OSError))
                        or database_down(e)):
                    raise
                print(f"error: the database did not answer ({e}); is the stack up? `gpusched dev status` "
                      "shows it", file=sys.stderr)
                return EXIT_UNREACHABLE

    return asyncio.run(go())


def _request(args) -> JobRequest:
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        raise ClientError(f"no command to run; give it after --, e.g. `gpusched submit --team {args.team} "
                          f"--gpus {args.gpus} -- python train.py`", "command")
    env = {}
    for item in args.env:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ClientError(f"--env '{item}' is not NAME=VALUE", "env")
        env[name] = value
    names = {"num_gpus": "--gpus", "job_id": "--job-id", "working_dir": "--workdir"}
    try:
        request = JobRequest(
            job_id=args.job_id or new_job_id(), team=args.team, num_gpus=args.gpus, command=cmd,
            gpu_type=args.gpu_type, topology=args.topology, priority=args.priority,
            checkpoint_interval=args.checkpoint_interval, expected_duration=args.expected_duration,
            kind=args.kind, cluster=args.cluster, env=env, max_retries=args.max_retries,
            working_dir=_working_dir(args.workdir), deadline=args.deadline,
        )
    except ValidationError as e:
        field, message = first_error(e)
        raise ClientError(f"{message} (give {names.get(field, flag_for(field))} a valid value)",
                          field) from None
    problem = request_problem(request)
    if problem is not None:
        field, message = problem
        flag = "the command after --" if field == "command" else names.get(field, flag_for(field))
        raise ClientError(f"{message} ({flag})", field)
    return request


def _working_dir(given: str | None) -> str | None:
    """--workdir made absolute, or the directory submit runs in; `none`: the agent's own (a submit
    from a host outside the fleet, whose directories its machines do not have)."""
    if given == "none":
        return None
    try:
        return os.path.abspath(given or os.curdir)
    except FileNotFoundError:  # the current directory, deleted under the shell
        raise ClientError("the current directory no longer exists; give --workdir an absolute path",
                          "working_dir") from None


def cmd_submit(args) -> int:
    try:
        request = _request(args)
    except ClientError as e:
        print(f"error: {e.field}: {e}", file=sys.stderr)
        return EXIT_REFUSED

    async def body(client: GpuschedClient) -> int:
        try:
            sub = await client.submit(request)
        except NotYetAdmitted as e:  # not refused: submitting again would make a second job
            print(f"error: {e}", file=sys.stderr)
            return EXIT_UNREACHABLE
        except (ClientError, asyncpg.DataError):
            raise  # refused: nothing was submitted
        except BaseException:
            # Cut short (Temporal or the database gone while it waited for the admission, ^C):
            # the job may be in, under an id its user has not seen; a second submit without it
            # would be a second job.
            if args.job_id is None:
                print(f"note: this submit's job id is {request.job_id}, and the job may have been submitted: "
                      f"`gpusched status {request.job_id}` says whether; to send it again, give "
                      f"--job-id {request.job_id} (the same submit under its id is that job, not a second)",
                      file=sys.stderr)
            raise
        if sub.priority is not None and sub.priority != request.priority.value:
            # The same job sent again: its class is the store's (a bump's), not this submit's.
            print(f"note: {sub.job_id} already exists with priority {sub.priority}, not {request.priority.value}; "
                  f"`gpusched bump {sub.job_id} --priority {request.priority.value}` changes it", file=sys.stderr)
        if args.json:
            print(json.dumps({"job_id": sub.job_id, "position": sub.position, "estimated_start": sub.estimated_start,
                              "cluster": sub.cluster, "state": sub.state, "priority": sub.priority}))
        elif sub.state in ENDED:
            # The same submit sent again, for a job that has ended: it is that job, not a new run.
            print(f"{sub.job_id}: already {sub.state} on {sub.cluster} (this submit was sent before; "
                  f"`gpusched status {sub.job_id}` shows how it ran; run it again under a new --job-id)")
        elif sub.state not in ("queued", "placed"):
            # The same submit sent again, for a job under way: it started, nothing is estimated.
            since = f" since {sub.estimated_start}" if sub.estimated_start else ""
            print(f"{sub.job_id}: already {sub.state} on {sub.cluster}{since} (this submit was sent before)")
        else:
            where = ("placed" if sub.position == 0 else f"position {sub.position} in the queue"
                     if sub.position is not None else "queued, held back after infrastructure failures in a row,")
            print(f"{sub.job_id}: {where} on {sub.cluster}; estimated start {_when(sub.estimated_start, time.time())}")
            if client.history_url(sub.job_id):
                print(f"  history: {client.history_url(sub.job_id)}")
        return 0

    return run_with_client(args, body)


def _print_view(view: JobView) -> None:
    print(f"{view.job_id}  {view.state}  team={view.team}  priority={view.priority}  gpus={view.num_gpus}")
    now = time.time()
    if view.position is not None:
        print(f"  queue position {view.position}, estimated start {_when(view.estimated_start, now)}")
    elif view.state == "queued" and view.estimated_start is not None:
        # Held back after infrastructure failures in a row: out of the queue until then.
        print(f"  held back, starts {_when(view.estimated_start, now)} at the earliest")
    if view.deadline is not None:
        verdict = {True: "; expected to miss it", False: "; expected to make it"}.get(view.misses_deadline, "")
        print(f"  deadline hint {_when(view.deadline, now)}{verdict}")
    if view.preemptions:
        print(f"  preempted {view.preemptions} time{'s' if view.preemptions > 1 else ''}")
    if view.pending_reason:
        print("  waiting: " + view.pending_reason)
    if view.reason and view.reason != view.pending_reason:
        # Only an ended job's reason is about its state; before that it is why the job last went
        # back to the queue.
        state = JobState(view.state)
        label = "reason" if state.terminal else "back in the queue" if state is JobState.queued else "last requeued"
        reason = view.reason if state.terminal else view.reason.removeprefix("requeued: ")
        print(f"  {label}: " + reason.replace("\n", "\n    "))
    if view.exit_code is not None:
        print(f"  exit code: {view.exit_code}")
    for a in view.attempts:
        resumed = f", resumed from checkpoint {a.resumed_from}" if a.resumed_from is not None else ""
        if a.restart_s is not None:
            resumed += f" (restored in {a.restart_s:.1f} s)"
        print(f"  attempt {a.attempt}: {a.started_at or 'not started'} → {a.ended_at or '…'} "
              f"{a.end_reason or ''} on {' '.join(a.gpus)}{resumed}")
        if a.stopping:
            grace = f" (its grace ends {_when(a.stop_by, now)})" if a.stop_by else ""
            print(f"    stopping: {a.stopping}{grace}")
    complete = [c for c in view.checkpoints if c.complete]
    if view.checkpoints:
        last = complete[-1] if complete else None
        print(f"  checkpoints: {len(complete)} complete of {len(view.checkpoints)} reported"
              + (f"; newest complete: {last.seq} ({last.size} bytes, {last.created_at})" if last else ""))
    for c in view.checkpoints:
        if not c.complete:
            print(f"    checkpoint {c.seq} refused: {c.reason}")


def cmd_status(args) -> int:
    async def body(client: GpuschedClient) -> int:
        view = await client.status(args.job_id)
        if args.json:
            print(view.model_dump_json(indent=2))
        else:
            _print_view(view)
            if client.history_url(view.job_id):
                print(f"  history: {client.history_url(view.job_id)}")
        return 0

    return run_with_client(args, body)


def _from_now(iso: str, now: float) -> str:
    return in_words.from_now(datetime.fromisoformat(iso).timestamp(), now)


def _when(iso: str | None, now: float) -> str:
    """An estimated start as a date and as a time from now: 2026-12-01T18:39:12.183+00:00 (in 4.0 min)."""
    return "unknown" if iso is None else f"{iso} ({_from_now(iso, now)})"


def list_table(views: list[JobView], now: float) -> str:
    """One line per job under a header, columns as wide as their widest cell; a queued job's
    place in the queue and when it should start, seen from `now`."""
    rows = [("JOB", "STATE", "TEAM", "PRIORITY", "GPUS", "QUEUED")]
    for v in views:
        queued = ""
        if v.position is not None:
            queued = f"#{v.position}"
            if v.estimated_start is not None:
                queued += f", starts {_from_now(v.estimated_start, now)}"
            if v.misses_deadline:
                queued += ", misses its deadline"
        elif v.state == "queued" and v.estimated_start is not None:
            # Held back after infrastructure failures in a row: out of the queue until then.
            queued = f"held back, starts {_from_now(v.estimated_start, now)} at the earliest"
        rows.append((v.job_id, v.state, v.team, v.priority, str(v.num_gpus), queued))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [cell.rjust(w) if i == 4 else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def cmd_list(args) -> int:
    async def body(client: GpuschedClient) -> int:
        views = await client.list(team=args.team, state=args.state, limit=args.limit)
        if args.json:
            print(json.dumps([v.model_dump(mode="json") for v in views], indent=2))
        else:
            print(list_table(views, time.time()))
        return 0

    return run_with_client(args, body)


def cmd_cancel(args) -> int:
    async def body(client: GpuschedClient) -> int:
        if await client.cancel(args.job_id) is None:
            print(f"{args.job_id}: cancel requested; the job is not admitted yet (no control worker has taken it "
                  "up), and ends cancelled as soon as one admits it, without running")
        else:
            print(f"{args.job_id}: cancel requested")
        return 0

    return run_with_client(args, body)


def cmd_bump(args) -> int:
    async def body(client: GpuschedClient) -> int:
        outcome = await client.bump(args.job_id, Priority(args.priority))
        print(f"{args.job_id}: priority {outcome.priority.value}")
        return 0

    return run_with_client(args, body)


def cmd_wait(args) -> int:
    async def body(client: GpuschedClient) -> int:
        try:
            view = await client.wait(args.job_id, args.timeout)
        except asyncio.TimeoutError:
            print(f"error: {args.job_id} had not ended after {args.timeout:g} s", file=sys.stderr)
            if args.json:  # a script reading stdout gets the job as it is now (null: not admitted yet)
                try:
                    print((await client.status(args.job_id)).model_dump_json(indent=2))
                except NotYetAdmitted:
                    print("null")
            return EXIT_WAIT_TIMED_OUT
        print(view.model_dump_json(indent=2)) if args.json else _print_view(view)
        return 0 if view.state == "succeeded" else EXIT_JOB_DID_NOT_SUCCEED

    return run_with_client(args, body)


def cmd_quota_set(args) -> int:
    try:
        quota = Quota(guaranteed=args.guaranteed, max=args.max, queue_cap=args.queue_cap)
    except ValidationError as e:
        field, message = first_error(e)
        if field == "request":  # the only check across fields: the maximum against the guarantee
            print(f"error: max: {message}; give --max at least --guaranteed", file=sys.stderr)
        else:
            print(f"error: {field}: {message} (give {flag_for(field)} a valid value)", file=sys.stderr)
        return EXIT_REFUSED
    if (problem := team_problem(args.team)) is not None:  # before connecting: no stack needed to say so
        print(f"error: team: {problem}", file=sys.stderr)
        return EXIT_REFUSED

    async def body(client: GpuschedClient) -> int:
        await client.set_quota(args.team, quota)
        print(f"{args.team}: guaranteed {quota.guaranteed}, max {quota.max if quota.max is not None else '-'}, "
              f"queue cap {quota.queue_cap if quota.queue_cap is not None else '-'}")
        return 0

    return run_with_client(args, body)


def cmd_quota_list(args) -> int:
    async def body(client: GpuschedClient) -> int:
        quotas = await client.quotas()
        if args.json:
            print(json.dumps({t: q.model_dump() for t, q in quotas.items()}, indent=2))
        else:
            for team, q in quotas.items():
                print(f"{team:<16} guaranteed {q.guaranteed:>5}  max {q.max if q.max is not None else '-':>5}  "
                      f"queue cap {q.queue_cap if q.queue_cap is not None else '-'}")
        return 0

    return run_with_client(args, body)


def cmd_cluster_set(args) -> int:
    knobs = {}
    for item in args.policy:
        name, sep, value = item.partition("=")
        if not sep or name not in PolicyConfig.model_fields:
            print(f"error: policy: '{item}' is not KNOB=VALUE with a knob of "
                  f"{', '.join(PolicyConfig.model_fields)}", file=sys.stderr)
            return EXIT_REFUSED
        knobs[name] = value
    try:  # each value on its own, before the stack is asked; the cluster's other knobs are checked with them there
        PolicyConfig(**knobs)
    except ValidationError as e:
        field, message = first_error(e)
        if field in knobs:
            print(f"error: policy: {field}={knobs[field]}: {message}", file=sys.stderr)
            return EXIT_REFUSED
    if args.machine_timeout is not None and not MIN_MACHINE_TIMEOUT <= args.machine_timeout <= DAY:
        print(f"error: machine_timeout: give --machine-timeout {MIN_MACHINE_TIMEOUT:g} to {DAY:g} seconds: agents "
              "heartbeat every 2 s, and a shorter timeout takes machines for lost between two beats, or while "
              "the API restarts",
              file=sys.stderr)
        return EXIT_REFUSED

    async def body(client: GpuschedClient) -> int:
        try:
            overrides = await client.store.set_cluster_policy(args.cluster, knobs, args.machine_timeout)
        except ValidationError as e:
            field, message = first_error(e)
            raise ClientError(message, field) from None
        if overrides is None:
            known = await client.store.cluster_names()
            raise ClientError(f"unknown cluster '{args.cluster}' (known: {', '.join(known) or 'none'})", "cluster")
        print(f"{args.cluster}: {json.dumps(overrides)}"
              + (f", machine timeout {args.machine_timeout:g} s" if args.machine_timeout else ""))
        return 0

    return run_with_client(args, body)


def cmd_cluster_list(args) -> int:
    async def body(client: GpuschedClient) -> int:
        clusters = await client.store.clusters()
        if args.json:
            print(json.dumps(clusters, indent=2))
        else:
            for c in clusters:
                print(f"{c['name']:<10} machine timeout {c['machine_timeout']:g} s  cycle {c['cycle_seq']}  "
                      f"policy overrides {json.dumps(c['policy'])}")
        return 0

    return run_with_client(args, body)


def cmd_logs(args) -> int:
    """Print an attempt's log. Agents write them on their own machines, under
    ``<data dir>/jobs/<agent>/<job>/attempt-<n>.log``: here that is every agent of the embedded
    stack; on a real fleet, run this on the machine (or read the file there)."""
    from workers.settings import default_data_dir

    async def body(client: GpuschedClient) -> int:
        view = await client.status(args.job_id)
        if not view.attempts:
            raise ClientError(f"job {args.job_id} has not run yet ({view.state})")
        attempt = args.attempt if args.attempt is not None else view.attempts[-1].attempt
        if attempt not in [a.attempt for a in view.attempts]:
            raise ClientError(f"job {args.job_id} has attempts {', '.join(str(a.attempt) for a in view.attempts)}",
                              "attempt")
        root = args.data_dir or default_data_dir()
        logs = sorted(Path(root).glob(f"jobs/*/{args.job_id}/attempt-{attempt}.log"))
        if not logs:
            raise ClientError(f"no log of attempt {attempt} under {root}/jobs: it is on the machine that ran it "
                              f"({', '.join(view.attempts[attempt - 1].gpus)})")
        for log in logs:  # one per machine of a gang
            if len(logs) > 1:
                print(f"==> {log} <==")
            sys.stdout.write(log.read_text(errors="replace"))
        return 0

    return run_with_client(args, body)
