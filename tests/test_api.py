"""The HTTP API on a live stack: health, agents' heartbeats, reads of jobs, machines and quotas,
and clear status codes for what it refuses."""

from __future__ import annotations

import asyncio
import json
import time

import asyncpg
import httpx
import pytest

from live.jobs import sleeper
from workers import devstack
from workers.cli import main
from workers.settings import MACHINE_HEADER, api_headers, machine_component, machine_token
from workers.token_generations import FRESH_FOR_S

pytestmark = pytest.mark.live


def test_the_api_answers_reads_and_heartbeats_and_refuses_with_clear_codes(stack):
    s = stack(machines=2, gpus=4)
    api = httpx.Client(base_url=s.up.settings.api_url, timeout=10, headers=api_headers(s.up.settings))
    assert api.get("/healthz").json() == {"ok": True}
    machines = api.get("/machines").json()
    assert [m["id"] for m in machines] == ["c1/b0/r0/m0", "c1/b0/r0/m1"]
    assert all(m["silent_for"] is not None and m["silent_for"] < 10 for m in machines)
    assert api.get("/quotas").json()["vision"]["guaranteed"] == 8

    s.submit("seen", 1, sleeper(0))
    s.wait("seen")
    assert api.get("/jobs/seen").json()["state"] == "succeeded"
    assert [j["job_id"] for j in api.get("/jobs", params={"state": "succeeded"}).json()] == ["seen"]
    assert api.get("/jobs/nope").status_code == 404
    for params, field in (({"state": "bogus"}, "state"), ({"limit": -1}, "limit"),
                          ({"limit": 10**6}, "limit")):  # not a 500, nor [], nor the whole table at once
        refused = api.get("/jobs", params=params)
        assert refused.status_code == 422 and refused.json()["detail"][0]["loc"][-1] == field

    beat = api.post("/machines/c1/b0/r0/m0/heartbeat",
                    json={"pid": 1, "gpus": [{"index": i} for i in range(4)], "running_allocations": []})
    assert beat.status_code == 200 and beat.json() == {"live_allocations": []}
    assert api.post("/machines/not-a-path/heartbeat", json={"gpus": [{"index": 0}]}).status_code == 422
    assert api.post("/machines/c1/b0/r0/m0/heartbeat", json={"gpus": [{"index": "x"}]}).status_code == 422
    assert api.post("/machines/c1/b0/r0/m0/heartbeat", json={"gpus": [{"index": -1}]}).status_code == 422
    assert api.post("/machines/c1/b0/r0/m0/heartbeat",
                    json={"gpus": [{"index": 0}, {"index": 0}]}).status_code == 422
    assert api.post("/machines/c1/b9/r0/m0/heartbeat", json={"gpus": []}).status_code == 422
    for joining in ("%20/b0/r0/m0", "c1/b0/r0/" + "x" * 3000):  # a blank cluster; one too long for an index
        refused = api.post(f"/machines/{joining}/heartbeat", json={"gpus": [{"index": 0}]})
        assert refused.status_code == 422 and "is not a name" in refused.json()["detail"], refused.text
    report = {"seq": 1, "key": "checkpoints/nope/0000000001", "size": 1, "sha256": "0" * 64}
    assert api.post("/jobs/nope/checkpoints", json={"allocation_id": 1, "report": report}).status_code == 404
    refused = api.post("/jobs/seen/checkpoints",
                       json={"allocation_id": 1, "report": {**report, "key": "checkpoints/seen/0000000001"}})
    assert refused.status_code == 200 and refused.json()["committed"] is False
    seen_alloc = api.get("/jobs/seen").json()["attempts"][0]["allocation_id"]
    assert api.post("/jobs/nope/restarts", json={"allocation_id": seen_alloc, "seconds": 3}).status_code == 404
    assert api.post("/jobs/seen/restarts", json={"allocation_id": seen_alloc, "seconds": -1}).status_code == 422
    # A fresh start has no restart to record.
    assert api.post("/jobs/seen/restarts", json={"allocation_id": seen_alloc, "seconds": 3}).status_code == 409


def test_the_api_answers_only_those_who_have_its_token(stack):
    s = stack(machines=1, gpus=4)
    assert s.up.settings.api_token  # the dev stack makes one
    api = httpx.Client(base_url=s.up.settings.api_url, timeout=10)
    beat = {"pid": 1, "gpus": [{"index": i, "healthy": False} for i in range(4)], "running_allocations": []}
    for headers in ({}, {"Authorization": "Bearer guessed"}, {"Authorization": s.up.settings.api_token}):
        for method, path, body in (("post", "/machines/c1/b0/r0/m0/heartbeat", beat), ("get", "/jobs", None),
                                   ("get", "/machines", None)):
            refused = api.request(method, path, json=body, headers=headers)
            assert refused.status_code == 401, (headers, path)
            assert "GPUSCHED_API_TOKEN" in refused.json()["detail"]
    assert api.get("/healthz").status_code == 200  # for load balancers and supervisors
    assert api.get("/machines", headers=api_headers(s.up.settings)).status_code == 200
    assert api.get("/jobs", headers={"Authorization": f"bearer {s.up.settings.api_token}"}).status_code == 200
    assert s.sql("SELECT count(*) AS n FROM gpus WHERE NOT healthy")[0]["n"] == 0  # no forged report took


def test_a_machines_token_speaks_for_that_machine_alone(stack):
    """Each agent of the stack carries its machine's token (an HMAC of the machine under the API's
    token), not the API's: a machine taken over can report for itself, and for nothing else."""
    s = stack(machines=2, gpus=4)
    settings = s.up.settings
    m0, m1 = "c1/b0/r0/m0", "c1/b0/r0/m1"
    as_m0 = httpx.Client(base_url=settings.api_url, timeout=10,
                         headers=api_headers(settings.model_copy(update={"api_token": machine_token(settings.api_token, m0)}), m0))
    beat = {"pid": 1, "gpus": [{"index": i} for i in range(4)], "running_allocations": []}
    assert as_m0.post(f"/machines/{m0}/heartbeat", json=beat).status_code == 200
    sick = {"pid": 1, "gpus": [{"index": i, "healthy": False} for i in range(4)], "running_allocations": []}
    other = as_m0.post(f"/machines/{m1}/heartbeat", json=sick)
    assert other.status_code == 403 and m1 in other.json()["detail"], other.text
    for path in ("/jobs", "/jobs/any", "/machines", "/quotas", "/openapi.json", "/docs"):
        assert as_m0.get(path).status_code == 403, path
    report = {"seq": 1, "key": "checkpoints/nope/0000000001", "size": 1, "sha256": "0" * 64}
    assert as_m0.post("/jobs/nope/checkpoints", json={"allocation_id": 1, "report": report}).status_code == 403
    s.submit("running", 1, sleeper(60))
    s.until(lambda: s.status("running").state == "running")  # its agent, with its own token, started it
    [row] = s.sql("SELECT id, gpus FROM allocations WHERE job_id = 'running'")
    alloc = row["id"]
    speaker = m0 if row["gpus"][0].startswith(m1 + "/") else m1  # a machine the job does not run on
    as_other = httpx.Client(base_url=settings.api_url, timeout=10,
                            headers=api_headers(settings.model_copy(update={"api_token": machine_token(settings.api_token, speaker)}), speaker))
    report = {"seq": 1, "key": "checkpoints/running/0000000001", "size": 1, "sha256": "0" * 64}
    refused = as_other.post("/jobs/running/checkpoints", json={"allocation_id": alloc, "report": report})
    assert refused.status_code == 403 and "holds no GPU" in refused.json()["detail"], refused.text
    assert as_other.post("/jobs/running/restarts", json={"allocation_id": alloc, "seconds": 3}).status_code == 403
    here = m1 if speaker == m0 else m0
    as_here = httpx.Client(base_url=settings.api_url, timeout=10,
                           headers=api_headers(settings.model_copy(update={"api_token": machine_token(settings.api_token, here)}), here))
    taken = as_here.post("/jobs/running/checkpoints", json={"allocation_id": alloc, "report": report})
    assert taken.status_code == 200, taken.text  # judged (the object is not there: refused), not forbidden
    # A token names its machine: another machine's token, or the header changed, is no token at all.
    forged = httpx.Client(base_url=settings.api_url, timeout=10, headers={
        "Authorization": f"Bearer {machine_token(settings.api_token, m0)}", MACHINE_HEADER: m1.replace("/", "%2F")})
    assert forged.post(f"/machines/{m1}/heartbeat", json=sick).status_code == 401
    assert s.sql("SELECT count(*) AS n FROM gpus WHERE NOT healthy")[0]["n"] == 0  # no report for m1 took
    # The stack's agents run with their machines' tokens, and the stack works: the job ran.
    assert all(m["silent_for"] is not None and m["silent_for"] < 10
               for m in httpx.get(f"{settings.api_url}/machines", headers=api_headers(settings)).json())


def test_a_renewed_machine_token_is_taken_at_once_the_old_one_refused_within_seconds_and_a_restarted_agent_given_it(
        stack, capsys):
    """`gpusched fleet token MACHINE --renew`: a machine taken over or retired is cut off alone."""
    s = stack(machines=2, gpus=4)
    settings, d = s.up.settings, ["--data-dir", str(s.data_dir)]
    m0, m1 = "c1/b0/r0/m0", "c1/b0/r0/m1"
    beat = {"pid": 1, "gpus": [{"index": i} for i in range(4)], "running_allocations": []}

    def beats(token: str, machine: str) -> int:
        return httpx.post(f"{settings.api_url}/machines/{machine}/heartbeat", json=beat, timeout=10,
                          headers=api_headers(settings.model_copy(update={"api_token": token}), machine)).status_code

    def silent_for(machine: str) -> float:
        seen = httpx.get(f"{settings.api_url}/machines", headers=api_headers(settings), timeout=10).json()
        return next(m["silent_for"] for m in seen if m["id"] == machine)

    assert main(["fleet", "token", m0, *d]) == 0
    old = capsys.readouterr().out.strip()
    assert old == machine_token(settings.api_token, m0)  # never renewed: the token made before renewals
    assert beats(old, m0) == 200
    assert main(["fleet", "token", m0, "--renew", *d]) == 0
    said = capsys.readouterr()
    new = said.out.strip()
    assert new != old and "renewed (generation 1)" in said.err
    assert beats(new, m0) == 200  # at once, though the API's view of the generations was fresh
    renewed = time.monotonic()
    s.until(lambda: beats(old, m0) == 401, timeout=FRESH_FOR_S + 5)
    assert time.monotonic() - renewed <= FRESH_FOR_S + 2
    assert main(["fleet", "token", m0, *d]) == 0 and capsys.readouterr().out.strip() == new
    assert beats(machine_token(settings.api_token, m1), m1) == 200  # the other machine's token stands
    # The stack's agent of m0 still carries the old token: it is not heard any more. `dev up` starts
    # it again with the new one (before, it found it running and left it deaf), and it is heard.
    s.until(lambda: silent_for(m0) > 3, timeout=15)
    assert silent_for(m1) < 3
    again = devstack.up(s.data_dir)
    assert again.restarted == [machine_component(m0)]
    s.until(lambda: silent_for(m0) < 2, timeout=20)


def test_a_request_body_over_a_mebibyte_is_refused_before_it_is_read_whole(stack):
    s = stack(machines=1, gpus=4)
    api = httpx.Client(base_url=s.up.settings.api_url, timeout=30, headers=api_headers(s.up.settings))
    faults = ["x" * 1000] * 1100  # a heartbeat of over a MiB, in one piece and in chunks
    beat = json.dumps({"gpus": [{"index": 0, "healthy": False, "faults": faults}]}).encode()
    path = "/machines/c1/b0/r0/m0/heartbeat"
    whole = api.post(path, content=beat, headers={"content-type": "application/json"})
    chunked = api.post(path, content=(beat[i:i + 65536] for i in range(0, len(beat), 65536)),
                       headers={"content-type": "application/json"})
    assert (whole.status_code, chunked.status_code) == (413, 413)
    assert s.sql("SELECT count(*) AS n FROM gpus WHERE NOT healthy")[0]["n"] == 0  # neither took
    small = api.post(path, json={"gpus": [{"index": i, "faults": ["x" * 200] * 64} for i in range(4)]})
    assert small.status_code == 200  # as many faults as a GPU may report, each as long: taken


UNSTORABLE = [  # (what, method, path, body: JSON, or text for what json.dumps would not write)
    ("an allocation id past 64 bits", "post", "/jobs/seen/restarts", {"allocation_id": 2**63, "seconds": 3}),
    ("an infinite restart time", "post", "/jobs/seen/restarts", '{"allocation_id": 1, "seconds": Infinity}'),
    ("a checkpoint number past the column", "post", "/jobs/seen/checkpoints",
     {"allocation_id": 1, "report": {"seq": 2**31, "key": "k", "size": 1, "sha256": "0" * 64}}),
    ("a NaN in a heartbeat", "post", "/machines/c1/b0/r0/m0/heartbeat", '{"gpus": [{"index": 0, "memory_gb": NaN}]}'),
    ("negative GPU memory", "post", "/machines/c1/b0/r0/m0/heartbeat", {"gpus": [{"index": 0, "memory_gb": -5}]}),
    ("a process id past the column", "post", "/machines/c1/b0/r0/m0/heartbeat", {"pid": 2**40, "gpus": []}),
    ("a checkpoint size past 64 bits", "post", "/jobs/seen/checkpoints",
     {"allocation_id": 1, "report": {"seq": 1, "key": "k", "size": 2**70, "sha256": "0" * 64}}),
    ("a NUL character in a job id", "get", "/jobs/a%00b", None),
    ("a NUL character in a team", "get", "/jobs?team=a%00b", None),
    # Past their bounds: each costs the API or the database in proportion (a job writes the reports).
    ("a heartbeat of more GPUs than a machine holds", "post", "/machines/c1/b0/r0/m0/heartbeat",
     {"gpus": [{"index": 999}] * 1025}),
    ("a fault of a page's length", "post", "/machines/c1/b0/r0/m0/heartbeat", {"gpus": [{"index": 0, "faults": ["x" * 201]}]}),
    ("a GPU of more faults than there are kinds", "post", "/machines/c1/b0/r0/m0/heartbeat",
     {"gpus": [{"index": 0, "faults": ["xid:79"] * 65}]}),
    ("a checkpoint key of a mebibyte's order", "post", "/jobs/seen/checkpoints",
     {"allocation_id": 1, "report": {"seq": 1, "key": "k" * 1025, "size": 1, "sha256": "0" * 64}}),
    ("a SHA-256 that is not one", "post", "/jobs/seen/checkpoints",
     {"allocation_id": 1, "report": {"seq": 1, "key": "k", "size": 1, "sha256": "zz"}}),
    ("an MD5 that is not one", "post", "/jobs/seen/checkpoints",
     {"allocation_id": 1, "report": {"seq": 1, "key": "k", "size": 1, "sha256": "0" * 64, "md5": "0" * 5000}}),
]


def test_values_postgres_cannot_hold_or_past_their_bounds_are_refused_as_bad_requests_not_server_errors(stack):
    s = stack(machines=1, gpus=4)
    api = httpx.Client(base_url=s.up.settings.api_url, timeout=10, headers=api_headers(s.up.settings))
    answers = {}
    for what, method, path, body in UNSTORABLE:
        if isinstance(body, str):
            answer = api.request(method, path, content=body, headers={"content-type": "application/json"})
        else:
            answer = api.request(method, path, json=body)
        answers[what] = answer.status_code
    assert answers == {what: 422 for what, *_ in UNSTORABLE}


def test_a_fault_injected_on_the_command_line_reaches_the_inventory_and_can_be_cleared(stack, capsys):
    from workers.cli import main

    s = stack(machines=1, gpus=4)
    d = ["--data-dir", str(s.data_dir)]
    assert main(["dev", "fault", "gpu", "c1/b0/r0/m0", "2", "--ecc", *d]) == 0
    assert "ecc_uncorrectable injected" in capsys.readouterr().out

    def unhealthy() -> set[int]:
        return set(s.run(s.client.store.snapshot("c1")).machines[0].unhealthy_gpus)

    s.until(lambda: unhealthy() == {2}, timeout=15)
    assert main(["dev", "fault", "gpu", "c1/b0/r0/m0", "2", "--clear", *d]) == 0
    s.until(lambda: unhealthy() == set(), timeout=15)
    assert main(["dev", "fault", "gpu", "c1/b0/r0/m9", "0", "--ecc", *d]) == 2
    assert main(["dev", "fault", "gpu", "c1/b0/r0/m0", "7", "--ecc", *d]) == 2
    assert "GPUs 0-3" in capsys.readouterr().err


@pytest.mark.filterwarnings("ignore:Using `httpx` with `starlette.testclient`")
def test_health_is_503_not_500_while_the_database_does_not_answer(live_servers, monkeypatch):
    from fastapi.testclient import TestClient

    from activities.store import Store
    from workers.api import create_app
    from workers.settings import Settings

    settings = Settings(pg_dsn=live_servers.new_database("api_health"))
    with TestClient(create_app(settings)) as api:
        # Only the control worker migrates: until one has, the API says so, not a 500.
        answer = api.get("/healthz")
        assert answer.status_code == 503 and "0001_" in answer.json()["detail"]
        assert "control worker" in answer.json()["detail"]
        listing = api.get("/jobs")
        assert listing.status_code == 503 and "control worker" in listing.json()["detail"]

        async def migrate():
            store = await Store.connect(settings.pg_dsn)
            await store.migrate()
            await store.close()

        asyncio.run(migrate())
        assert api.get("/healthz").status_code == 200

        async def down(self):
            raise ConnectionRefusedError(111, "Connection refused")

        monkeypatch.setattr(Store, "unmigrated", down)
        answer = api.get("/healthz")
        assert answer.status_code == 503 and answer.json()["ok"] is False
        assert "does not answer" in answer.json()["detail"]



def refused():
    raise ConnectionRefusedError(111, "Connect call failed ('127.0.0.1', 5432)")


def died_mid_transaction():
    """What asyncpg raises when Postgres is killed inside a transaction (seen in a chaos run)."""
    try:
        raise asyncpg.InternalClientError("cannot switch to state 15; another operation (2) is in progress")
    except asyncpg.InternalClientError:
        raise asyncpg.InterfaceError("cannot call Transaction.__aexit__(): the underlying connection is closed")


def shut_down_under_a_query():
    """What asyncpg raises when Postgres shuts down while a pooled connection is idle, at its next
    query outside a transaction (seen in a chaos run): the protocol still consumes the
    server's farewell error (state 2)."""
    raise asyncpg.InternalClientError("cannot switch to state 12; another operation (2) is in progress")


def busy():
    raise asyncpg.InternalClientError("cannot switch to state 12; another operation (11) is in progress")


def misused():
    raise asyncpg.InterfaceError("cannot perform operation: another operation is in progress")


class DownStore:
    """A store whose database fails every query: refuses it (restarting), by default."""

    def __init__(self, fail=refused):
        self.connects, self.fail = 0, fail

    async def listened(self, *args, **kwargs):
        self.fail()

    machine_heartbeat = unmigrated = job_view = token_generations = listened

    async def close(self):
        pass


@pytest.mark.parametrize("refusals", [0, 2], ids=["Postgres up at the start", "Postgres still restarting at the start"])
def test_an_api_whose_database_is_down_answers_503_in_words_and_waits_for_it_at_start(monkeypatch, refusals):
    """Before, the API exited (code 3) when started while Postgres restarted, and answered every
    heartbeat of the fleet with a 500 and a traceback while it was down."""
    from fastapi.testclient import TestClient

    from workers import api as api_module
    from workers.settings import Settings

    store = DownStore()

    async def connect(dsn, *args, **kwargs):
        store.connects += 1
        if store.connects <= refusals:
            raise ConnectionRefusedError(111, "Connect call failed")
        return store

    monkeypatch.setattr(api_module.Store, "connect", connect)
    app = api_module.create_app(Settings(pg_dsn="postgresql://postgres:secret@127.0.0.1:1/gpusched"))
    with TestClient(app, raise_server_exceptions=False) as client:
        beat = client.post("/machines/c1/b0/r0/m0/heartbeat", json={"gpus": [{"index": 0}]})
        job = client.get("/jobs/a")
        health = client.get("/healthz")
    assert store.connects == refusals + 1
    assert (beat.status_code, job.status_code, health.status_code) == (503, 503, 503)
    assert "the database does not answer now" in beat.json()["detail"] and "try again" in beat.json()["detail"]


@pytest.mark.parametrize("fail, status", [(died_mid_transaction, 503), (shut_down_under_a_query, 503),
                                           (misused, 500), (busy, 500)],
                         ids=["the database killed mid-transaction is an outage: 503",
                              "the database shut down under an idle connection is an outage: 503",
                              "any other interface error is a bug: 500",
                              "a protocol busy with another query is a bug: 500"])
def test_a_connection_closed_under_a_transaction_is_a_503_not_a_500(monkeypatch, fail, status):
    from fastapi.testclient import TestClient

    from workers import api as api_module
    from workers.settings import Settings

    store = DownStore(fail)

    async def connect(dsn, *args, **kwargs):
        return store

    monkeypatch.setattr(api_module.Store, "connect", connect)
    app = api_module.create_app(Settings(pg_dsn="postgresql://postgres:secret@127.0.0.1:1/gpusched"))
    with TestClient(app, raise_server_exceptions=False) as client:
        job = client.get("/jobs/a")
    assert job.status_code == status
    if status == 503:
        assert "the database does not answer now" in job.json()["detail"]


def without_the_machine_tokens_table():
    raise asyncpg.UndefinedTableError('relation "machine_tokens" does not exist')


@pytest.mark.parametrize("fail, words", [(refused, "the database does not answer now"),
                                          (died_mid_transaction, "the database does not answer now"),
                                          (without_the_machine_tokens_table, "control worker")],
                         ids=["the database down", "the database killed under the read",
                              "a database not migrated to machine tokens' generations"])
def test_a_machine_token_that_cannot_be_checked_is_answered_503_in_words_not_taken_or_500(monkeypatch, fail, words):
    """A machine's token is checked against its generation in the store (a renewed one's old
    token is refused): while that cannot be read, the agent is told to try again."""
    from fastapi.testclient import TestClient

    from workers import api as api_module
    from workers.settings import Settings

    store = DownStore(fail)

    async def heard(*args, **kwargs):
        raise AssertionError("a heartbeat taken with its token unchecked")

    store.machine_heartbeat = heard

    async def connect(dsn, *args, **kwargs):
        return store

    monkeypatch.setattr(api_module.Store, "connect", connect)
    settings = Settings(pg_dsn="postgresql://postgres:secret@127.0.0.1:1/gpusched", api_token="s3cret")
    machine = "c1/b0/r0/m0"
    agent = settings.model_copy(update={"api_token": machine_token("s3cret", machine)})
    with TestClient(api_module.create_app(settings), raise_server_exceptions=False) as client:
        beat = client.post(f"/machines/{machine}/heartbeat", json={"gpus": [{"index": 0}]},
                           headers=api_headers(agent, machine))
    assert beat.status_code == 503 and words in beat.json()["detail"], beat.text


class RecordingStore:
    """A store that answers every read with nothing and keeps what it was asked."""

    def __init__(self):
        self.asked: list[tuple] = []

    async def list_jobs(self, team=None, state=None, limit=1000):
        self.asked.append(("list_jobs", team, state, limit))
        return []

    async def machine_heartbeat(self, machine_id, pid, gpus, accepting_work=True):
        self.asked.append(("heartbeat", machine_id, pid, len(gpus), accepting_work))
        return []

    async def token_generations(self):
        return {}

    async def listened(self, *args, **kwargs):
        pass

    async def close(self):
        pass


def recorded_api(monkeypatch, api_token: str | None = None):
    """A TestClient of the API over a RecordingStore; (client, store)."""
    from fastapi.testclient import TestClient

    from workers import api as api_module
    from workers.settings import Settings

    store = RecordingStore()

    async def connect(dsn, *args, **kwargs):
        return store

    monkeypatch.setattr(api_module.Store, "connect", connect)
    settings = Settings(pg_dsn="postgresql://postgres:secret@127.0.0.1:1/gpusched", api_token=api_token)
    return TestClient(api_module.create_app(settings), raise_server_exceptions=False), store


# (sentence, query, status, what the store is asked: team, state, limit)
LISTINGS = [
    ("no limit given lists the newest thousand", {}, 200, (None, None, 1000)),
    ("a limit of ten thousand is taken", {"limit": 10_000}, 200, (None, None, 10_000)),
    ("a limit past ten thousand is refused", {"limit": 10_001}, 422, None),
    ("a limit of none is refused, not answered []", {"limit": 0}, 422, None),
    ("the team and state asked for reach the store", {"team": "vision", "state": "queued", "limit": 5}, 200,
     ("vision", "queued", 5)),
]


@pytest.mark.parametrize("sentence, query, status, asked", LISTINGS, ids=[row[0] for row in LISTINGS])
def test_a_listing_of_jobs_takes_one_to_ten_thousand_and_passes_its_filters_on(monkeypatch, sentence, query,
                                                                              status, asked):
    client, store = recorded_api(monkeypatch)
    with client:
        answer = client.get("/jobs", params=query)
    assert answer.status_code == status, answer.text
    assert store.asked == ([] if asked is None else [("list_jobs", *asked)])


# (sentence, Authorization header, status of GET /jobs)
AUTHORIZATIONS = [
    ("the API's token as a bearer token is taken", "Bearer s3cret", 200),
    ("the scheme's case does not matter", "bearer s3cret", 200),
    ("the API's token under another scheme is refused", "Basic s3cret", 401),
    ("the API's token without a scheme is refused", "s3cret", 401),
]


@pytest.mark.parametrize("sentence, authorization, status", AUTHORIZATIONS, ids=[row[0] for row in AUTHORIZATIONS])
def test_the_api_s_token_is_taken_only_as_a_bearer_token(monkeypatch, sentence, authorization, status):
    client, _ = recorded_api(monkeypatch, api_token="s3cret")
    with client:
        answer = client.get("/jobs", headers={"Authorization": authorization})
    assert answer.status_code == status, answer.text
    if status == 401:
        assert answer.headers["WWW-Authenticate"] == "Bearer"


@pytest.mark.parametrize("said, recorded", [({"accepting_work": False}, False), ({}, True)],
                         ids=["an agent that says it takes no work is recorded so",
                              "an agent from before, which says nothing, takes work"])
def test_a_heartbeat_reaches_the_store_with_whether_its_agent_takes_work(monkeypatch, said, recorded):
    machine = "c1/b0/r0/m0"
    client, store = recorded_api(monkeypatch, api_token="s3cret")
    from workers.settings import Settings

    agent = Settings(api_token=machine_token("s3cret", machine))  # an agent speaks with its machine's token
    with client:
        beat = client.post(f"/machines/{machine}/heartbeat", headers=api_headers(agent, machine),
                           json={"pid": 9, "gpus": [{"index": 0}, {"index": 1}], **said})
    assert beat.status_code == 200 and beat.json() == {"live_allocations": []}
    assert store.asked == [("heartbeat", machine, 9, 2, recorded)]
