"""Checkpoint commit and garbage collection: S3 holds the bytes, Postgres says which are complete.

S3 has no rename, so the design's "write under a temporary name, then rename" becomes:

1. the job writes checkpoint N under ``checkpoints/<job>/<N:010d>`` with a conditional put
   (``If-None-Match: *``): a key is written once and never overwritten, so a second writer of
   the same N is refused by S3 itself;
2. it reports N through its agent, which adds the attempt's allocation id (the fencing token);
3. here the bytes are verified against the report without reading them (S3's size, its ETag —
   the MD5 S3 computed of a single-part upload; a multipart upload's ETag is no MD5 of the
   object, and each of its parts was checked by S3 against the MD5 the writer sent with it —
   and the SHA-256 the writer stored with them),
   and the checkpoint is committed as complete in Postgres only if that allocation is still the
   job's current one. The commit is the "rename": before it the object does not exist for
   anyone, after it it is what the next attempt resumes from;
4. once two newer checkpoints are complete, older ones (and abandoned writes, reported or not)
   are deleted, and unfinished multipart uploads of numbers below a committed one (a writer
   killed mid-upload) are aborted; both after the job has its answer;
5. once the job has ended for good, whatever of it is no complete checkpoint is deleted, and
   its unfinished uploads aborted (`sweep_ended_job`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Collection

from activities.outages import in_words
from activities.store import Store
from workflows.types import CheckpointAck, CheckpointReport

log = logging.getLogger("gpusched.checkpoints")


class CheckpointStoreUnavailable(Exception):
    """The checkpoint store could not be asked (unreachable, refusing our credentials, failing):
    no verdict on the report, which is to be sent again."""


def checkpoint_prefix(job_id: str) -> str:
    return f"checkpoints/{job_id}/"


def checkpoint_key(job_id: str, seq: int) -> str:
    """Where checkpoint ``seq`` of a job is written (jobkit's ``seq_key``)."""
    return f"{checkpoint_prefix(job_id)}{seq:010d}"


def checkpoint_uri(bucket: str, job_id: str) -> str:
    return f"s3://{bucket}/{checkpoint_prefix(job_id)}"


def object_uri(bucket: str, key: str) -> str:
    return f"s3://{bucket}/{key}"


def s3_client(endpoint: str | None, access_key: str | None, secret_key: str | None,
              region: str = "us-east-1", read_timeout: float = 30, retries: int = 3):
    """A boto3 S3 client with path-style addressing (what SeaweedFS and most on-premise stores
    want); a short connect timeout, so an unreachable store fails fast."""
    import boto3
    from botocore.config import Config

    return boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=access_key,
                        aws_secret_access_key=secret_key, region_name=region,
                        config=Config(s3={"addressing_style": "path"}, connect_timeout=2, read_timeout=read_timeout,
                                      retries={"max_attempts": retries}))  # botocore: retries after the first try


class S3OnFirstUse:
    """Stands for ``s3_client(**settings)``, made when first used and shared from then on: making
    one costs about half a second of CPU (boto3's import and its S3 model), which the control
    worker and the API paid at every start, whether or not a checkpoint ever came. Calls run in
    threads, so two first uses make one client."""

    def __init__(self, make: Callable[[], object] | None = None, **settings) -> None:
        self._make = make or (lambda: s3_client(**settings))
        self._client = None
        self._lock = threading.Lock()

    def __getattr__(self, name: str):  # only for names the proxy does not have: the client's
        if self._client is None:
            with self._lock:
                if self._client is None:
                    self._client = self._make()
        return getattr(self._client, name)


class CheckpointCommitter:
    def __init__(self, store: Store, s3, bucket: str):
        self.store = store
        self.s3 = s3  # a boto3 client: blocking, so every call runs in a thread
        self.bucket = bucket
        self._cleanups: set[asyncio.Task] = set()  # references, so the tasks are not collected

    async def commit(self, job_id: str, allocation_id: int, report: CheckpointReport) -> CheckpointAck:
        """Raises ``CheckpointStoreUnavailable`` when S3 cannot say whether the bytes are there:
        nothing is recorded then, so the report can be sent again."""
        refusal = await verify_object(self.s3, self.bucket, job_id, report)
        # The row names the key checkpoint `seq` has, whatever the report said: clearing
        # superseded checkpoints deletes that key, and only ever one of the job's own.
        report = report.model_copy(update={"key": checkpoint_key(job_id, report.seq)})
        ack, superseded = await self.store.commit_checkpoint(job_id, allocation_id, report, refusal)
        if ack.committed:
            # After the answer, not before: a slow store must not make the job wait for its ack
            # (past the agent's timeout it would be told nothing of a commit that took).
            task = asyncio.create_task(self._clean_up(job_id, report.seq, superseded))
            self._cleanups.add(task)
            task.add_done_callback(self._cleanups.discard)
        return ack

    async def _clean_up(self, job_id: str, committed_seq: int, superseded: list[tuple[int, str]]) -> None:
        """Best effort, in the background: what stays, a later commit clears. Nobody awaits this
        task, so it says itself what stopped it (before, asyncio's "Task exception was never
        retrieved" and a traceback for every commit while Postgres restarted)."""
        try:
            await self._delete_superseded(job_id, superseded)
            await self._abort_abandoned_uploads(job_id, committed_seq)
        except Exception as e:
            outage = in_words(e)
            if outage is not None:
                log.warning("could not clear %s's superseded checkpoints now (%s); a later commit tries again",
                            job_id, outage)
            else:
                log.exception("could not clear %s's superseded checkpoints; a later commit tries again", job_id)

    async def _delete_superseded(self, job_id: str, superseded: list[tuple[int, str]]) -> None:
        """Delete the checkpoints below the two newest complete ones: those reported (their rows
        are marked deleted), and the objects no report ever named (a writer killed between its
        upload and its report, a report the agent gave up forwarding): nothing else would ever
        delete those, each a whole checkpoint. Below the two kept, nothing is written any more
        (a writer's numbers only grow). Best effort: what stays, a later commit tries again."""
        for seq, key in superseded:
            try:
                await asyncio.to_thread(self.s3.delete_object, Bucket=self.bucket, Key=key)
                await self.store.mark_checkpoint_deleted(job_id, seq)
            except Exception as e:  # stays listed; a later commit tries again
                log.warning("could not delete superseded checkpoint %s: %s", key, e)
        kept = await self.store.kept_checkpoints(job_id)
        if len(kept) < 2:
            return
        # Every number with a row, not only those this commit found superseded: a later commit
        # may have moved the two kept on meanwhile (reports forwarded in a row after an outage),
        # and a reported checkpoint's object deleted here would leave its row showing it complete.
        named = await self.store.reported_checkpoints(job_id)
        await self._each_below(
            job_id, "list_objects_v2", "Contents", min(kept),
            lambda entry, seq: None if seq in named else self.s3.delete_object(Bucket=self.bucket, Key=entry["Key"]),
            "deleted %d checkpoint(s) of %s that were never reported")

    async def settled(self) -> None:
        """Wait for the clean-ups that commits started (for tests, and before closing)."""
        while self._cleanups:
            await asyncio.gather(*self._cleanups, return_exceptions=True)

    async def _abort_abandoned_uploads(self, job_id: str, committed_seq: int) -> None:
        """Abort the job's unfinished multipart uploads of numbers below the one just committed:
        their writers were killed mid-upload or have moved on, and S3 keeps (and bills) the parts
        of an upload until it is aborted. Later numbers may still be being written. Best effort."""
        await self._each_below(
            job_id, "list_multipart_uploads", "Uploads", committed_seq,
            lambda entry, seq: self.s3.abort_multipart_upload(Bucket=self.bucket, Key=entry["Key"],
                                                              UploadId=entry["UploadId"]),
            "aborted %d abandoned checkpoint upload(s) of %s")

    async def _each_below(self, job_id: str, listing: str, entries: str, below: int,
                          act: Callable[[dict, int], object], done: str) -> None:
        """``_each_entry`` of the entries numbered below ``below``."""
        await _each_entry(self.s3, self.bucket, job_id, listing, entries,
                          lambda entry, seq: act(entry, seq) if seq < below else None, done)


async def sweep_ended_job(s3, bucket: str, job_id: str, complete: Collection[int]) -> None:
    """Once a job has ended for good, delete every object of it that is no complete checkpoint
    and abort its unfinished uploads. Nothing of it can be committed any more (its last
    allocation has ended, and the fence refuses a later report), so these are writes nobody will
    ever resume from: refused as a zombie's, never reported, or cut off mid-upload (a job
    cancelled while it saved). Before, they stayed for good, each a whole checkpoint, the
    uploads' parts billed though unreadable. The complete checkpoints stay: the newest is a
    finished job's last state. Best effort, logged."""
    kept = frozenset(complete)
    await _each_entry(
        s3, bucket, job_id, "list_objects_v2", "Contents",
        lambda entry, seq: None if seq in kept else s3.delete_object(Bucket=bucket, Key=entry["Key"]),
        "deleted %d checkpoint(s) of %s that were never committed, as it ended")
    await _each_entry(
        s3, bucket, job_id, "list_multipart_uploads", "Uploads",
        lambda entry, seq: s3.abort_multipart_upload(Bucket=bucket, Key=entry["Key"], UploadId=entry["UploadId"]),
        "aborted %d unfinished checkpoint upload(s) of %s, as it ended")


async def _each_entry(s3, bucket: str, job_id: str, listing: str, entries: str,
                      act: Callable[[dict, int], object], done: str) -> None:
    """Run ``act`` on each entry of an S3 listing of the job's checkpoints (``act`` answers None
    when it leaves one alone), in a thread; logs how many ``done`` says. Names that are no
    checkpoint number are left alone. Best effort: a failure is logged, and a later commit tries
    again."""
    prefix = checkpoint_prefix(job_id)

    def walk() -> int:
        count = 0
        for page in s3.get_paginator(listing).paginate(Bucket=bucket, Prefix=prefix):
            for entry in page.get(entries) or []:
                name = entry["Key"][len(prefix):]
                if name.isascii() and name.isdigit() and act(entry, int(name)) is not None:
                    count += 1
        return count

    try:
        count = await asyncio.to_thread(walk)
    except Exception as e:
        log.warning("could not clean up checkpoints under %s (%s): %s", prefix, listing, e)
        return
    if count:
        log.info(done, count, job_id)


async def verify_object(s3, bucket: str, job_id: str, report: CheckpointReport) -> str | None:
    """Why the reported bytes are not what S3 holds, or None when they are. Raises
    ``CheckpointStoreUnavailable`` when S3 cannot say."""
    if not report.key.startswith(checkpoint_prefix(job_id)):
        return f"key {report.key} is outside the job's checkpoints ({checkpoint_prefix(job_id)})"
    if report.key != checkpoint_key(job_id, report.seq):
        return f"key {report.key} is not checkpoint {report.seq}'s ({checkpoint_key(job_id, report.seq)})"
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        head = await asyncio.to_thread(s3.head_object, Bucket=bucket, Key=report.key)
    except ClientError as e:
        if _missing(e):
            return f"no object {report.key} in bucket {bucket}"
        raise CheckpointStoreUnavailable(f"checkpoint store: {e}") from e
    except BotoCoreError as e:
        raise CheckpointStoreUnavailable(f"checkpoint store unreachable: {e}") from e
    if head["ContentLength"] != report.size:
        return f"size mismatch: S3 holds {head['ContentLength']} bytes, the report says {report.size}"
    etag = head.get("ETag", "").strip('"')
    # A single PUT's ETag is its MD5, but not under SSE-KMS or SSE-C (AWS: "not an MD5 digest"),
    # where every checkpoint was refused; the upload's Content-MD5 was checked by S3 all the same.
    encrypted = head.get("ServerSideEncryption", "").startswith("aws:kms") or head.get("SSECustomerAlgorithm")
    if report.md5 and "-" not in etag and not encrypted and etag != report.md5:
        return f"MD5 mismatch: S3 computed {etag}, the report says {report.md5}"
    stored = head.get("Metadata", {}).get("sha256")
    if stored != report.sha256:
        return f"SHA-256 mismatch: the object says {stored}, the report says {report.sha256}"
    return None


def _missing(error) -> bool:
    """Whether S3's answer is that the object does not exist (a HEAD's 404 has no body)."""
    code = str(error.response.get("Error", {}).get("Code", ""))
    status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return code in ("404", "NoSuchKey", "NotFound") or status == 404
