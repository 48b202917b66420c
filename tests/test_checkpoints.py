"""The checkpoint protocol on real Postgres and real S3: write-once keys, verification, the fence
against zombie writers, resuming only from complete checkpoints, and deleting superseded ones."""

from __future__ import annotations

import asyncio
import hashlib
import itertools

import botocore.exceptions
import pytest

from activities.checkpoints import CheckpointCommitter, CheckpointStoreUnavailable, checkpoint_prefix, s3_client
from activities.store import GpuReport, Store
from scheduler.cycle import run_cycle
from scheduler.models import Machine, Quota
from live.servers import until_blocked_or_done
from workflows.types import CheckpointReport, EndReason, JobRequest, JobState

pytestmark = pytest.mark.live
_jobs = itertools.count()


class Env:
    """A migrated database with one 4-GPU machine, the real S3 bucket, and one job running."""

    def __init__(self, live_servers):
        self.loop = asyncio.new_event_loop()
        self.servers = live_servers
        self.s3 = live_servers.s3_client()
        self.bucket = live_servers.s3_bucket
        self.store = self.run(Store.connect(live_servers.migrated_database("ckpt")))
        self.committer = CheckpointCommitter(self.store, self.s3, self.bucket)
        self.job = f"ckpt-{next(_jobs)}"
        machine = Machine(id="c1/b0/r0/m0", cluster="c1", block="b0", rack="r0", gpus=4, gpu_type="H100")
        self.run(self.store.register_fleet("c1", [machine]))
        self.run(self.store.machine_heartbeat(machine.id, 1, [GpuReport(index=i) for i in range(4)]))
        self.run(self.store.set_quota("t", Quota(guaranteed=4)))
        self.run(self.store.admit(JobRequest(job_id=self.job, team="t", num_gpus=4, command=["true"])))
        self.cycle = 0
        self.allocation = self.start()

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    def start(self) -> int:
        self.cycle += 1
        alloc = self.run(self.store.plan_cycle("c1", self.cycle, run_cycle)).placements[0].signal.allocation_id
        launch, self.resumed = self.run(self.store.start_attempt(self.job, alloc))
        assert launch
        return alloc

    def requeue(self) -> None:
        self.run(self.store.end_attempt(self.job, self.allocation, EndReason.preempted, None, JobState.queued, "test"))

    def write(self, seq: int, data: bytes, sha256: str | None = None) -> CheckpointReport:
        key = f"{checkpoint_prefix(self.job)}{seq:010d}"
        digest = hashlib.sha256(data).hexdigest()
        self.s3.put_object(Bucket=self.bucket, Key=key, Body=data, IfNoneMatch="*",
                           Metadata={"sha256": sha256 or digest})
        return CheckpointReport(seq=seq, key=key, size=len(data), sha256=digest,
                                md5=hashlib.md5(data).hexdigest(), progress=float(seq))

    def write_in_parts(self, seq: int, data: bytes) -> CheckpointReport:
        """Checkpoint ``seq`` written as a job writes it (jobkit), in 5 MiB parts."""
        from jobkit import Checkpointer

        s = self.servers
        writer = Checkpointer(f"s3://{self.bucket}/{checkpoint_prefix(self.job)}", job_id=self.job,
                              allocation_id=str(self.allocation), s3_endpoint=s.s3_endpoint,
                              s3_access_key=s.s3_access_key, s3_secret_key=s.s3_secret_key,
                              s3_region=s.s3_region, s3_part_mb=5)
        writer.next_seq = seq
        saved = writer.save(data)
        assert saved.seq == seq
        return CheckpointReport(seq=seq, key=saved.key, size=saved.size, sha256=saved.sha256, md5=saved.md5)

    def uploads(self) -> list[str]:
        answer = self.s3.list_multipart_uploads(Bucket=self.bucket, Prefix=checkpoint_prefix(self.job))
        return sorted(u["Key"] for u in answer.get("Uploads") or [])

    def commit(self, report: CheckpointReport, allocation: int | None = None):
        """Commit, and wait for the clean-up the commit starts after its answer."""
        ack = self.run(self.committer.commit(self.job, allocation or self.allocation, report))
        self.run(self.committer.settled())
        return ack

    def exists(self, key: str) -> bool:
        try:
            self.s3.head_object(Bucket=self.bucket, Key=key)
            return True
        except botocore.exceptions.ClientError:
            return False

    def close(self):
        self.run(self.store.close())
        self.loop.close()


@pytest.fixture
def env(live_servers):
    e = Env(live_servers)
    yield e
    e.close()


def test_a_resumed_attempt_is_granted_its_checkpoint_and_the_digest_committed_for_it(env):
    from temporalio.testing import ActivityEnvironment

    from activities.jobs import JobActivities
    from workflows.types import StartAttempt

    report = env.write(1, b"step=1")
    assert env.commit(report).committed
    env.requeue()
    env.cycle += 1
    alloc = env.run(env.store.plan_cycle("c1", env.cycle, run_cycle)).placements[0].signal.allocation_id
    start = JobActivities(env.store, client=None, bucket=env.bucket).start_attempt
    for call in ("first", "repeated"):
        grant = env.run(ActivityEnvironment().run(start, StartAttempt(job_id=env.job, allocation_id=alloc)))
        assert (grant.launch, grant.resume_seq, grant.resume_sha256) == (True, 1, report.sha256), call
        assert grant.resume_from == f"s3://{env.bucket}/{report.key}"


def test_a_verified_checkpoint_from_the_current_allocation_is_committed_and_resumed_from(env):
    ack = env.commit(env.write(1, b"step=1"))
    assert ack.committed
    env.requeue()
    env.allocation = env.start()
    assert env.resumed["seq"] == 1
    view = env.run(env.store.job_view(env.job))
    assert view.attempts[1].resumed_from == 1 and view.attempts[0].resumed_from is None
    assert [(c.seq, c.complete, c.size) for c in view.checkpoints] == [(1, True, 6)]


@pytest.mark.parametrize("tamper, words", [
    (lambda r: r.model_copy(update={"size": r.size + 1}), "size mismatch"),
    (lambda r: r.model_copy(update={"md5": "0" * 32}), "MD5 mismatch"),
    (lambda r: r.model_copy(update={"sha256": "0" * 64}), "SHA-256 mismatch"),
    (lambda r: r.model_copy(update={"key": "checkpoints/someone-else/0000000001"}), "outside the job's"),
    (lambda r: r.model_copy(update={"key": r.key + "-copy"}), "is not checkpoint 1's"),
    (lambda r: r.model_copy(update={"seq": 2, "key": r.key[:-1] + "2"}), "no object"),
])
def test_a_report_that_does_not_match_the_bytes_is_refused_and_never_resumed_from(env, tamper, words):
    ack = env.commit(tamper(env.write(1, b"step=1")))
    assert not ack.committed and words in ack.reason
    env.requeue()
    env.allocation = env.start()
    assert env.resumed is None


class HeadOnly:
    """An S3 client that answers HEAD with what an encrypting store says of a single PUT."""

    def __init__(self, **head):
        self.head = head

    def head_object(self, **_):
        return self.head


@pytest.mark.parametrize("encryption, committed", [
    ({}, False),
    ({"ServerSideEncryption": "aws:kms"}, True),
    ({"ServerSideEncryption": "aws:kms:dsse"}, True),
    ({"SSECustomerAlgorithm": "AES256"}, True),
    ({"ServerSideEncryption": "AES256"}, False),
], ids=["no encryption: the ETag is the MD5", "SSE-KMS", "DSSE-KMS", "SSE-C", "SSE-S3: the ETag is still the MD5"])
def test_a_single_put_s_etag_is_taken_for_its_md5_only_where_the_store_makes_it_one(encryption, committed):
    """Under SSE-KMS or SSE-C the ETag is no MD5, and every checkpoint of such a bucket was refused."""
    from activities.checkpoints import verify_object

    data = b"step=1"
    report = CheckpointReport(seq=1, key=f"{checkpoint_prefix('j')}{1:010d}", size=len(data),
                              sha256=hashlib.sha256(data).hexdigest(), md5=hashlib.md5(data).hexdigest())
    s3 = HeadOnly(ContentLength=len(data), ETag='"' + "f" * 32 + '"', Metadata={"sha256": report.sha256}, **encryption)
    why = asyncio.run(verify_object(s3, "b", "j", report))
    assert (why is None) == committed, why


def test_a_zombie_writers_checkpoint_is_refused_once_its_allocation_is_revoked(env):
    zombie = env.allocation
    env.requeue()  # the attempt ended (its machine was declared dead, say); its process lives on
    env.allocation = env.start()
    ack = env.commit(env.write(1, b"from the zombie"), allocation=zombie)
    assert not ack.committed and "no longer the job's current one" in ack.reason
    assert env.commit(env.write(2, b"from the live attempt")).committed
    events = [e["event"] for e in env.run(env.store.audit_trail(env.job))]
    assert "checkpoint_refused" in events and "checkpoint_committed" in events


def test_a_zombie_writers_report_of_a_number_already_committed_is_told_it_is_a_zombie_s(env):
    """It was told the number was another writer's, the fence's word lost."""
    zombie = env.allocation
    env.requeue()
    env.allocation = env.start()
    report = env.write(1, b"from the live attempt")
    assert env.commit(report).committed
    ack = env.commit(report, allocation=zombie)
    assert not ack.committed and "no longer the job's current one" in ack.reason, ack.reason
    refusals = [e["reason"] for e in env.run(env.store.audit_trail(env.job)) if e["event"] == "checkpoint_refused"]
    assert refusals == [ack.reason]


def test_a_commit_and_the_attempt_s_end_at_once_do_not_deadlock(env):
    """The end holds the job, then ends its allocation; the commit used to hold the allocation,
    then wait for the job: Postgres broke the deadlock after a second by failing one of them."""
    from activities import queries as q

    report = env.write(1, b"step=1")

    async def scenario():
        async with env.store.pool.acquire() as ending, ending.transaction():
            await ending.fetchrow(q.JOB_FOR_UPDATE, env.job)
            commit = asyncio.ensure_future(env.committer.commit(env.job, env.allocation, report))
            await until_blocked_or_done(ending, commit)  # the commit takes what it takes first
            ended = await asyncio.wait_for(
                ending.fetchval(q.END_ALLOCATION, env.allocation, EndReason.preempted.value, None), 10)
        return ended, await asyncio.wait_for(commit, 10)

    ended, ack = env.run(scenario())
    env.run(env.committer.settled())
    assert ended == env.job
    assert not ack.committed and "no longer the job's current one" in ack.reason, ack


def test_a_checkpoint_written_but_never_committed_is_never_resumed_from(env):
    assert env.commit(env.write(1, b"one")).committed
    env.write(2, b"two, never reported")
    env.requeue()
    env.allocation = env.start()
    assert env.resumed["seq"] == 1


def test_a_second_writer_to_the_same_sequence_number_is_refused(env):
    report = env.write(1, b"first writer")
    with pytest.raises(botocore.exceptions.ClientError) as refused:
        env.write(1, b"second writer")
    assert refused.value.response["Error"]["Code"] in ("PreconditionFailed", "412")
    assert env.s3.get_object(Bucket=env.bucket, Key=report.key)["Body"].read() == b"first writer"
    assert env.commit(report).committed


def test_the_same_report_twice_gets_the_same_answer(env):
    report = env.write(1, b"once")
    assert env.commit(report).committed
    assert env.commit(report).committed
    assert len(env.run(env.store.checkpoints(env.job))) == 1


def test_older_checkpoints_are_deleted_once_two_newer_ones_are_complete(env):
    reports = [env.write(seq, f"step={seq}".encode()) for seq in (1, 2, 3, 4)]
    for report in reports[:2]:
        assert env.commit(report).committed
    assert all(env.exists(r.key) for r in reports[:2])
    assert env.commit(reports[2]).committed
    assert not env.exists(reports[0].key) and env.exists(reports[1].key)
    assert env.commit(reports[3]).committed
    assert [env.exists(r.key) for r in reports] == [False, False, True, True]
    views = env.run(env.store.checkpoints(env.job))
    assert [(c.seq, c.deleted) for c in views] == [(1, True), (2, True), (3, False), (4, False)]


def test_checkpoints_written_but_never_reported_are_deleted_once_two_newer_ones_are_complete(env):
    """A writer killed between its upload and its report leaves an object no row names."""
    lost = [env.write(seq, f"step={seq}".encode()) for seq in (1, 3)]  # uploaded, never reported
    later = env.write(5, b"step=5")  # uploaded after the newest commit, not reported yet
    assert env.commit(env.write(2, b"step=2")).committed
    assert env.exists(lost[0].key), "one complete checkpoint: nothing goes yet"
    assert env.commit(env.write(4, b"step=4")).committed
    assert [env.exists(r.key) for r in lost] == [False, True]  # 3 is above the older kept one, 2
    assert env.commit(env.write(6, b"step=6")).committed
    assert [env.exists(r.key) for r in lost] == [False, False]
    assert env.exists(later.key), "above the older kept one (4): it may still be reported"


def test_a_clean_up_that_runs_after_a_later_commit_deletes_no_checkpoint_its_row_shows_complete(env):
    """Reports forwarded in a row (after an outage): the clean-up of the commit of 3 (which
    found 1 superseded) ran after 4 was committed, took 2 for an object no report named, below
    the two now kept, and deleted it; 2's row stayed complete, not deleted."""
    reports = [env.write(seq, f"step={seq}".encode()) for seq in (1, 2, 3, 4)]
    for report in reports[:2]:
        assert env.commit(report).committed
    ack, superseded = env.run(env.store.commit_checkpoint(env.job, env.allocation, reports[2], None))
    assert ack.committed and [seq for seq, _ in superseded] == [1]
    assert env.run(env.store.commit_checkpoint(env.job, env.allocation, reports[3], None))[0].committed
    env.run(env.committer._clean_up(env.job, 3, superseded))  # the first clean-up, late
    views = env.run(env.store.checkpoints(env.job))
    shown = [c.seq for c in views if c.complete and not c.deleted]
    assert all(env.exists(reports[seq - 1].key) for seq in shown), (shown, [env.exists(r.key) for r in reports])


def test_a_number_whose_report_was_refused_is_taken_by_a_later_writer_whose_bytes_are_there(env):
    """A report refused because its bytes were not there (a machine writing to another store)
    kept its number: the next attempt's checkpoint under it, verified, was refused as another
    writer's, and a preemption within those numbers sent the job back to its start."""
    data = b"written elsewhere"
    lost = CheckpointReport(seq=2, key=f"{checkpoint_prefix(env.job)}{2:010d}", size=len(data),
                            sha256=hashlib.sha256(data).hexdigest(), md5=hashlib.md5(data).hexdigest())
    assert not env.commit(lost).committed  # no object 2 in this store
    env.requeue()
    env.allocation = env.start()
    ack = env.commit(env.write(2, b"step=2"))
    assert ack.committed, ack.reason
    env.requeue()
    env.allocation = env.start()
    assert env.resumed["seq"] == 2


def _refused_elsewhere(env, seq: int) -> CheckpointReport:
    """A report of bytes this store does not hold (a machine writing to another store)."""
    data = b"written elsewhere"
    return CheckpointReport(seq=seq, key=f"{checkpoint_prefix(env.job)}{seq:010d}", size=len(data),
                            sha256=hashlib.sha256(data).hexdigest(), md5=hashlib.md5(data).hexdigest())


def test_refused_reports_of_higher_numbers_count_for_nothing_in_the_two_newest_kept(env):
    one, two = env.write(1, b"step=1"), env.write(2, b"step=2")
    assert env.commit(one).committed
    for seq in (3, 4):
        assert not env.commit(_refused_elsewhere(env, seq)).committed
    assert env.commit(two).committed  # not refused as "older than its two newest complete ones"
    assert env.exists(one.key) and env.exists(two.key)


def test_the_bytes_of_a_number_above_the_kept_ones_are_not_deleted_before_its_report_comes(env):
    for seq in (1, 2):
        assert env.commit(env.write(seq, f"step={seq}".encode())).committed
    assert not env.commit(_refused_elsewhere(env, 4)).committed
    four = env.write(4, b"step=4")  # a later writer's 4, uploaded, not reported yet
    assert env.commit(env.write(3, b"step=3")).committed
    assert env.exists(four.key)
    assert env.commit(four).committed


def test_a_late_report_of_a_checkpoint_below_the_two_kept_is_never_committed(env):
    """Its object may be gone with the clean-up since (collected, or never reported when the
    clean-up looked): committed, or brought back from collected, it was a complete checkpoint of
    bytes that are not there."""
    first = env.write(1, b"step=1")
    assert env.commit(first).committed
    late = env.write(2, b"step=2")  # its report is slow: its bytes were checked, then 3 and 4 came
    for seq in (3, 4):
        assert env.commit(env.write(seq, f"step={seq}".encode())).committed
    assert not env.exists(first.key)  # collected with 3's commit
    again = env.run(env.store.commit_checkpoint(env.job, env.allocation, first, None))[0]
    assert again.committed  # the same answer as the first time
    ack = env.run(env.store.commit_checkpoint(env.job, env.allocation, late, None))[0]
    assert not ack.committed and "older than its two newest complete ones (3 and 4)" in ack.reason
    views = {c.seq: (c.complete, c.deleted) for c in env.run(env.store.checkpoints(env.job))}
    assert views[1] == (True, True) and views[2][0] is False


def test_a_commit_records_the_work_the_checkpoint_holds_for_the_scheduler(env):
    env.run(asyncio.sleep(0.3))
    assert env.commit(env.write(1, b"x")).committed
    progress = env.run(env.store.pool.fetchval("SELECT progress FROM jobs WHERE id = $1", env.job))
    assert progress >= 0.3
    snapshot = env.run(env.store.snapshot("c1"))
    assert snapshot.running[0].last_checkpoint_at is not None


def test_a_late_report_records_the_work_as_of_its_writing_not_its_arrival(env):
    started = env.run(env.store.pool.fetchval("SELECT started_at FROM allocations WHERE id = $1", env.allocation))
    env.run(asyncio.sleep(0.6))  # the report is sent again and again meanwhile
    assert env.commit(env.write(2, b"y").model_copy(update={"written_at": started + 0.1})).committed
    assert env.commit(env.write(1, b"x").model_copy(update={"written_at": started + 0.05})).committed  # later, older
    work = {r["seq"]: r["work_seconds"] for r in env.run(env.store.pool.fetch(
        "SELECT seq, work_seconds FROM checkpoints WHERE job_id = $1", env.job))}
    assert work[2] == pytest.approx(0.1, abs=0.01) and work[1] == pytest.approx(0.05, abs=0.01)
    last = env.run(env.store.pool.fetchval("SELECT last_checkpoint_at FROM allocations WHERE id = $1", env.allocation))
    assert last == pytest.approx(started + 0.1, abs=0.01)  # not moved back by the older one


def test_the_work_a_resumed_attempts_checkpoint_holds_leaves_out_its_restart(env):
    """An attempt that spent 200 s loading its checkpoint and saved 300 s after its launch has
    done 100 s of work, not 300: the scheduler took a resumed job for further on than it was."""
    assert env.commit(env.write(1, b"x").model_copy(update={"written_at": None})).committed
    env.requeue()
    env.allocation = env.start()
    saved = env.run(env.store.pool.fetchval("SELECT progress FROM jobs WHERE id = $1", env.job))
    started = env.run(env.store.pool.fetchval("SELECT started_at FROM allocations WHERE id = $1", env.allocation))
    env.run(env.store.pool.execute("UPDATE allocations SET restart_s = 200 WHERE id = $1", env.allocation))
    env.run(env.store.pool.execute("UPDATE allocations SET started_at = started_at - 400 WHERE id = $1",
                                   env.allocation))  # launched 400 s ago: the save below is in its past
    assert env.commit(env.write(2, b"y").model_copy(update={"written_at": started - 100})).committed
    work = env.run(env.store.pool.fetchval("SELECT work_seconds FROM checkpoints WHERE job_id = $1 AND seq = 2",
                                           env.job))
    assert work == pytest.approx(saved + 100, abs=0.01)


def test_a_report_the_store_cannot_check_now_is_not_refused_and_commits_when_sent_again(env):
    report = env.write(1, b"step=1")
    unreachable = CheckpointCommitter(env.store, s3_client("http://127.0.0.1:1", "key", "secret"), env.bucket)
    with pytest.raises(CheckpointStoreUnavailable):
        env.run(unreachable.commit(env.job, env.allocation, report))
    assert env.run(env.store.checkpoints(env.job)) == []  # no verdict recorded
    assert env.commit(report).committed


def test_clearing_superseded_checkpoints_deletes_only_the_jobs_own_keys(env):
    theirs = "checkpoints/another-job/0000000001"
    env.s3.put_object(Bucket=env.bucket, Key=theirs, Body=b"another job's state")
    forged = env.write(1, b"step=1").model_copy(update={"key": theirs})
    assert not env.commit(forged).committed
    for seq in (2, 3, 4):
        assert env.commit(env.write(seq, f"step={seq}".encode())).committed
    assert env.exists(theirs)
    assert [(c.seq, c.deleted) for c in env.run(env.store.checkpoints(env.job))] == [
        (1, True), (2, True), (3, False), (4, False)]


def test_a_checkpoint_written_in_parts_commits_and_the_uploads_abandoned_below_it_are_aborted(env):
    prefix = checkpoint_prefix(env.job)
    killed = env.s3.create_multipart_upload(Bucket=env.bucket, Key=f"{prefix}0000000001")  # mid-upload
    env.s3.upload_part(Bucket=env.bucket, Key=f"{prefix}0000000001", UploadId=killed["UploadId"],
                       PartNumber=1, Body=b"x" * 5 * 2**20)
    env.s3.create_multipart_upload(Bucket=env.bucket, Key=f"{prefix}0000000003")  # still being written
    report = env.write_in_parts(2, bytes(range(256)) * (11 * 2**20 // 256))
    assert "-" in env.s3.head_object(Bucket=env.bucket, Key=report.key)["ETag"]
    assert env.uploads() == [f"{prefix}0000000001", f"{prefix}0000000003"]

    assert env.commit(report).committed
    env.run(env.committer.settled())
    assert env.uploads() == [f"{prefix}0000000003"]
    env.requeue()
    env.allocation = env.start()
    assert env.resumed["seq"] == 2


# --- what a job leaves in S3 when it ends ------------------------------------------------------


def _leftovers(env) -> None:
    """Checkpoints 1 and 2 committed, 3 refused as a zombie's, 4 never reported, 5 cut off mid-upload."""
    prefix = checkpoint_prefix(env.job)
    for seq in (1, 2):
        assert env.commit(env.write(seq, f"step={seq}".encode())).committed
    assert not env.commit(env.write(3, b"from a zombie"), allocation=env.allocation + 1000).committed
    env.write(4, b"never reported")
    cut = env.s3.create_multipart_upload(Bucket=env.bucket, Key=f"{prefix}0000000005")
    env.s3.upload_part(Bucket=env.bucket, Key=f"{prefix}0000000005", UploadId=cut["UploadId"],
                       PartNumber=1, Body=b"x" * 5 * 2**20)


class _GoneWorkflows:
    """A Temporal service that knows no workflow: every job's was terminated long ago."""

    async def describe_workflow_execution(self, request):
        from temporalio.service import RPCError, RPCStatusCode

        raise RPCError("gone", RPCStatusCode.NOT_FOUND, b"")


def _end_through_the_activity(env, end: EndReason | None, state: JobState | None) -> None:
    """The attempt's end as its workflow records it, or (``end`` None) as the scheduler loop's
    reconcile records it for a workflow that is gone."""
    from types import SimpleNamespace

    from temporalio.testing import ActivityEnvironment

    from activities.jobs import JobActivities
    from workflows.types import EndAttempt, Reconcile

    client = SimpleNamespace(namespace="default", workflow_service=_GoneWorkflows())
    jobs = JobActivities(env.store, client=client, bucket=env.bucket, s3=env.s3)
    if end is None:
        assert env.run(ActivityEnvironment().run(jobs.reconcile_allocations, Reconcile(cluster="c1"))) == 1
    else:
        env.run(ActivityEnvironment().run(jobs.end_attempt, EndAttempt(
            job_id=env.job, allocation_id=env.allocation, end_reason=end, exit_code=None, next_state=state,
            reason="test")))
    env.run(jobs.settled())


@pytest.mark.parametrize("end, state, swept", [
    (EndReason.completed, JobState.succeeded, True),
    (EndReason.failed, JobState.failed, True),
    (EndReason.cancelled, JobState.cancelled, True),
    (None, None, True),  # its workflow terminated: the reconcile fails the job
    (EndReason.preempted, JobState.queued, False),  # it runs again: a later commit clears below it
], ids=["succeeded", "failed", "cancelled", "workflow gone", "queued again"])
def test_a_job_that_ends_for_good_keeps_only_its_complete_checkpoints_in_the_store(env, end, state, swept):
    prefix = checkpoint_prefix(env.job)
    _leftovers(env)
    _end_through_the_activity(env, end, state)
    assert [env.exists(f"{prefix}{seq:010d}") for seq in (1, 2)] == [True, True]
    assert [env.exists(f"{prefix}{seq:010d}") for seq in (3, 4)] == [not swept, not swept]
    assert env.uploads() == ([] if swept else [f"{prefix}0000000005"])


# --- a resume checkpoint its job found unusable ------------------------------------------------


def _end_unusable(env, seq: int) -> None:
    env.run(env.store.end_attempt(env.job, env.allocation, EndReason.machine_failure, None, JobState.queued,
                                  "requeued: it could not resume", unusable_checkpoint=seq))


def _resumed_twice(env, *seqs: int) -> None:
    """Checkpoints ``seqs`` committed; then an attempt that resumes from the newest."""
    for seq in seqs:
        assert env.commit(env.write(seq, f"step={seq}".encode())).committed
    env.requeue()
    env.allocation = env.start()
    assert env.resumed["seq"] == seqs[-1]


def test_a_checkpoint_its_attempt_could_not_resume_from_is_incomplete_and_the_next_resumes_from_the_one_before(env):
    _resumed_twice(env, 1, 2)
    _end_unusable(env, 2)
    env.allocation = env.start()
    assert env.resumed["seq"] == 1
    views = {c.seq: c for c in env.run(env.store.checkpoints(env.job))}
    assert not views[2].complete and "unusable when allocation" in views[2].reason
    work = env.run(env.store.pool.fetchval("SELECT work_seconds FROM checkpoints WHERE job_id = $1 AND seq = 1",
                                           env.job))
    assert env.run(env.store.pool.fetchval("SELECT progress FROM jobs WHERE id = $1", env.job)) == work
    assert "checkpoint_unusable" in [e["event"] for e in env.run(env.store.audit_trail(env.job))]


def test_with_no_complete_checkpoint_left_the_next_attempt_starts_from_the_beginning(env):
    _resumed_twice(env, 1)
    _end_unusable(env, 1)
    env.allocation = env.start()
    assert env.resumed is None
    assert env.run(env.store.pool.fetchval("SELECT progress FROM jobs WHERE id = $1", env.job)) == 0


def test_only_the_checkpoint_the_attempt_resumed_from_can_be_called_unusable(env):
    _resumed_twice(env, 1, 2)
    _end_unusable(env, 1)  # the attempt resumed from 2: its job has no word on 1
    assert all(c.complete for c in env.run(env.store.checkpoints(env.job)))


def test_a_number_written_again_after_its_object_was_found_gone_replaces_the_unusable_one(env):
    _resumed_twice(env, 1, 2)
    env.s3.delete_object(Bucket=env.bucket, Key=f"{checkpoint_prefix(env.job)}{2:010d}")
    _end_unusable(env, 2)
    env.allocation = env.start()  # resumes from 1, and writes 2 again
    assert env.commit(env.write(2, b"step=2, again")).committed
    [again] = [c for c in env.run(env.store.checkpoints(env.job)) if c.seq == 2]
    assert again.complete and again.allocation_id == env.allocation and again.reason is None


def test_a_job_fallen_back_to_its_start_commits_its_first_numbers_again(env):
    """Its old numbers' rows are unusable or collected: a new write replaces them."""
    _resumed_twice(env, 1, 2, 3)  # 1 is collected once 2 and 3 are complete
    assert [c.deleted for c in env.run(env.store.checkpoints(env.job))] == [True, False, False]
    _end_unusable(env, 3)
    env.allocation = env.start()
    assert env.resumed["seq"] == 2
    _end_unusable(env, 2)
    env.allocation = env.start()
    assert env.resumed is None
    assert env.commit(env.write(1, b"step=1, from the start")).committed
    [first] = [c for c in env.run(env.store.checkpoints(env.job)) if c.seq == 1]
    assert first.complete and not first.deleted and first.allocation_id == env.allocation


def test_a_refused_report_of_an_unusable_number_leaves_it_unusable_and_replaceable(env):
    _resumed_twice(env, 1, 2)
    env.s3.delete_object(Bucket=env.bucket, Key=f"{checkpoint_prefix(env.job)}{2:010d}")
    _end_unusable(env, 2)
    zombie = env.allocation
    env.allocation = env.start()
    assert not env.commit(env.write(2, b"from the zombie"), allocation=zombie).committed
    [row] = env.run(env.store.pool.fetch("SELECT * FROM checkpoints WHERE job_id = $1 AND seq = 2", env.job))
    assert row["unusable_at"] is not None and "unusable when allocation" in row["reason"]


# --- a machine's word that its resume checkpoint is unusable, checked against the store ---------

MACHINE, OTHER_MACHINE = "c1/b0/r0/m0", "c1/b0/r0/m1"
SAID = "checkpoint s3://bucket/key does not exist"


def _doubt(env, seq: int = 2, machine: str | None = MACHINE, s3="env", said: str = SAID) -> str | None:
    """The control plane's answer to the attempt's report (None: believed)."""
    from temporalio.testing import ActivityEnvironment

    from activities.jobs import JobActivities
    from workflows.types import UnusableReport

    acts = JobActivities(env.store, client=None, bucket=env.bucket, s3=env.s3 if s3 == "env" else s3)
    report = UnusableReport(job_id=env.job, allocation_id=env.allocation, seq=seq, machine_id=machine, said=said)
    return env.run(ActivityEnvironment().run(acts.doubt_unusable_checkpoint, report))


def _spoil_metadata(env) -> None:
    key = f"{checkpoint_prefix(env.job)}{2:010d}"
    env.s3.delete_object(Bucket=env.bucket, Key=key)
    env.s3.put_object(Bucket=env.bucket, Key=key, Body=b"step=2", Metadata={"sha256": "0" * 64})


@pytest.mark.parametrize("spoil, s3", [
    (lambda env: env.s3.delete_object(Bucket=env.bucket, Key=f"{checkpoint_prefix(env.job)}{2:010d}"), "env"),
    (_spoil_metadata, "env"),
    (lambda env: None, s3_client("http://127.0.0.1:1", "key", "secret")),
    (lambda env: None, None),
], ids=["an object gone from the store too",
        "an object whose SHA-256 is no longer the one committed",
        "a store the control plane cannot reach",
        "a control plane without a store client"])
def test_the_jobs_word_is_believed_when_the_store_does_not_show_otherwise(env, spoil, s3):
    _resumed_twice(env, 1, 2)
    spoil(env)
    assert _doubt(env, s3=s3) is None
    assert "checkpoint_unusable_doubted" not in [e["event"] for e in env.run(env.store.audit_trail(env.job))]


def test_a_checkpoint_the_store_holds_as_committed_is_kept_and_its_machine_cooled_down(env):
    _resumed_twice(env, 1, 2)
    why = _doubt(env)
    assert why is not None and "holds as committed" in why and MACHINE in why and SAID in why
    assert "S3 settings" in why
    assert _doubt(env) == why  # a retry of the call answers the same, and records nothing more
    events = [e["event"] for e in env.run(env.store.audit_trail(env.job))]
    assert events.count("checkpoint_unusable_doubted") == 1
    assert env.run(env.store.pool.fetchval(
        "SELECT unpicked_until > extract(epoch from now()) FROM machines WHERE id = $1", MACHINE))
    env.run(env.store.end_attempt(env.job, env.allocation, EndReason.machine_failure, None, JobState.queued,
                                  f"requeued: {why}"))
    env.run(env.store.pool.execute("UPDATE machines SET unpicked_until = NULL"))  # the cool-down over
    env.allocation = env.start()
    assert env.resumed["seq"] == 2
    assert all(c.complete for c in env.run(env.store.checkpoints(env.job)))


@pytest.mark.parametrize("second_machine", [MACHINE, OTHER_MACHINE])
def test_a_second_word_on_the_same_checkpoint_is_believed_from_any_machine(env, second_machine):
    """Bytes can rot under metadata that still matches: a job on one machine, or a gang whose
    first rank lands on the same machine again, must still fall back."""
    _resumed_twice(env, 1, 2)
    first = env.allocation
    assert _doubt(env) is not None
    env.run(env.store.end_attempt(env.job, env.allocation, EndReason.machine_failure, None, JobState.queued,
                                  "requeued"))
    env.run(env.store.pool.execute("UPDATE machines SET unpicked_until = NULL"))
    env.allocation = env.start()
    assert env.allocation != first and env.resumed["seq"] == 2
    assert _doubt(env, machine=second_machine) is None


def test_a_number_written_again_after_its_checkpoint_was_given_up_is_doubted_afresh(env):
    _resumed_twice(env, 1, 2)
    assert _doubt(env) is not None
    # The word believed at last (the workflow asks again before it passes it on): 2 is given up.
    env.run(env.store.end_attempt(env.job, env.allocation, EndReason.machine_failure, None, JobState.queued,
                                  "requeued", unusable_checkpoint=2))
    env.run(env.store.pool.execute("UPDATE machines SET unpicked_until = NULL"))
    env.allocation = env.start()
    assert env.resumed["seq"] == 1
    env.s3.delete_object(Bucket=env.bucket, Key=f"{checkpoint_prefix(env.job)}{2:010d}")  # its bytes gone since
    assert env.commit(env.write(2, b"step=2, again")).committed
    env.requeue()
    env.allocation = env.start()
    assert env.resumed["seq"] == 2
    assert _doubt(env) is not None


def test_a_retry_of_a_recorded_doubt_answers_the_same_even_with_the_store_out_of_reach(env):
    _resumed_twice(env, 1, 2)
    why = _doubt(env)
    assert why is not None
    assert _doubt(env, s3=s3_client("http://127.0.0.1:1", "key", "secret")) == why


def test_the_jobs_words_are_recorded_even_with_a_nul_in_them(env):
    _resumed_twice(env, 1, 2)
    why = _doubt(env, machine=None, said="bad\0bytes")
    assert why is not None and "bad\ufffdbytes" in why and "its machine" in why


def test_a_checkpoint_the_attempt_did_not_resume_from_is_not_doubted(env):
    _resumed_twice(env, 1, 2)
    assert _doubt(env, seq=1) is None


class _StoreDown:
    async def kept_checkpoints(self, job_id):
        raise ConnectionRefusedError(111, "Connect call failed ('127.0.0.1', 5432)")


class _StoreWithABug:
    async def kept_checkpoints(self, job_id):
        raise TypeError("unsupported operand")


@pytest.mark.parametrize("store, said, traceback", [
    (_StoreDown(), "could not clear j's superseded checkpoints now (the database does not answer: ", False),
    (_StoreWithABug(), "could not clear j's superseded checkpoints; a later commit tries again", True),
], ids=["Postgres down: one line", "a bug: its traceback, logged by the task itself"])
def test_the_clean_up_after_a_commit_says_what_stopped_it_and_raises_nothing(caplog, store, said, traceback):
    committer = CheckpointCommitter(store, s3=None, bucket="b")
    with caplog.at_level("WARNING", logger="gpusched.checkpoints"):
        asyncio.run(committer._clean_up("j", 3, []))  # would raise, and go unretrieved, before
    [entry] = caplog.records
    assert entry.getMessage().startswith(said) and (entry.exc_info is not None) is traceback


def test_the_s3_client_is_made_at_its_first_use_once_though_threads_race_to_it():
    """The control worker and the API make it so (half a second of CPU at every start before)."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor
    from types import SimpleNamespace

    from activities.checkpoints import S3OnFirstUse

    made, everyone_asks = [], threading.Barrier(8)

    def make():
        time.sleep(0.05)  # long enough for the other threads to ask meanwhile
        made.append(1)
        return SimpleNamespace(head_object=lambda **kw: ("head", kw["Key"]))

    s3 = S3OnFirstUse(make)
    assert made == []

    def ask(i: int):
        everyone_asks.wait()
        return s3.head_object(Bucket="b", Key=str(i))

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(8)))
    assert answers == [("head", str(i)) for i in range(8)] and made == [1]
