"""Checkpoint commit and garbage collection: S3 holds the bytes, Postgres says which are complete.

S3 has no rename, so the design's "write under a temporary name, then rename" becomes:

1. the job writes checkpoint N under ``checkpoints/<job>/<N:010d>`` with a conditional put
   (``If-None-Match: *``): a key is written once and never overwritten, so a second writer of
   the same N is refused by S3 itself;
2. it reports N through its agent, which adds the attempt's allocation id (the fencing token);
3. here the bytes are verified against the report without reading them (S3's size, its ETag —
   the MD5 S3 computed of a single-part upload — and the SHA-256 the writer stored with them),
   and the checkpoint is committed as complete in Postgres only if that allocation is still the
   job's current one. The commit is the "rename": before it the object does not exist for
   anyone, after it it is what the next attempt resumes from;
4. once two newer checkpoints are complete, older ones (and abandoned writes) are deleted.
"""

from __future__ import annotations

import asyncio
import logging

from activities.store import Store
from workflows.types import CheckpointAck, CheckpointReport

log = logging.getLogger("gpusched.checkpoints")


def checkpoint_prefix(job_id: str) -> str:
    return f"checkpoints/{job_id}/"


def checkpoint_uri(bucket: str, job_id: str) -> str:
    return f"s3://{bucket}/{checkpoint_prefix(job_id)}"


def object_uri(bucket: str, key: str) -> str:
    return f"s3://{bucket}/{key}"


def s3_client(endpoint: str | None, access_key: str | None, secret_key: str | None,
              region: str = "us-east-1"):
    """A boto3 S3 client with path-style addressing (what SeaweedFS and most on-premise stores
    want); a short connect timeout, so an unreachable store fails fast."""
    import boto3
    from botocore.config import Config

    return boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=access_key,
                        aws_secret_access_key=secret_key, region_name=region,
                        config=Config(s3={"addressing_style": "path"}, connect_timeout=2, read_timeout=30,
                                      retries={"max_attempts": 3}))


class CheckpointCommitter:
    def __init__(self, store: Store, s3, bucket: str):
        self.store = store
        self.s3 = s3  # a boto3 client: blocking, so every call runs in a thread
        self.bucket = bucket

    async def commit(self, job_id: str, allocation_id: int, report: CheckpointReport) -> CheckpointAck:
        refusal = await self._verify(job_id, report)
        ack, superseded = await self.store.commit_checkpoint(job_id, allocation_id, report, refusal)
        for seq, key in superseded:
            try:
                await asyncio.to_thread(self.s3.delete_object, Bucket=self.bucket, Key=key)
                await self.store.mark_checkpoint_deleted(job_id, seq)
            except Exception as e:  # stays listed; a later commit tries again
                log.warning("could not delete superseded checkpoint %s: %s", key, e)
        return ack

    async def _verify(self, job_id: str, report: CheckpointReport) -> str | None:
        """Why the reported bytes are not what S3 holds, or None when they are."""
        if not report.key.startswith(checkpoint_prefix(job_id)):
            return f"key {report.key} is outside the job's checkpoints ({checkpoint_prefix(job_id)})"
        try:
            head = await asyncio.to_thread(self.s3.head_object, Bucket=self.bucket, Key=report.key)
        except Exception as e:
            return f"no object {report.key} in bucket {self.bucket}: {e}"
        if head["ContentLength"] != report.size:
            return f"size mismatch: S3 holds {head['ContentLength']} bytes, the report says {report.size}"
        etag = head.get("ETag", "").strip('"')
        if report.md5 and "-" not in etag and etag != report.md5:
            return f"MD5 mismatch: S3 computed {etag}, the report says {report.md5}"
        stored = head.get("Metadata", {}).get("sha256")
        if stored != report.sha256:
            return f"SHA-256 mismatch: the object says {stored}, the report says {report.sha256}"
        return None
