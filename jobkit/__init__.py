"""jobkit: checkpoints for job code run by gpusched (and anywhere else).

A job that gpusched may stop (preemption, a sick GPU, a cancel) gets SIGTERM, then
``GPUSCHED_GRACE_PERIOD`` seconds, then SIGKILL. With this module it saves its state when that
happens, and on schedule, and resumes from its last *committed* checkpoint when started again::

    import sys
    from jobkit import Checkpointer, CheckpointRetryLater, EXIT_RETRY_LATER, EXIT_STOPPED

    ck = Checkpointer.from_env()          # reads GPUSCHED_* (all optional)
    ck.handle_sigterm()                   # SIGTERM sets ck.stop_requested; nothing else
    try:
        state = ck.restore()              # bytes of the checkpoint to resume from, or None
    except CheckpointRetryLater:          # the store is down: gpusched queues the job again
        sys.exit(EXIT_RETRY_LATER)
    step = 0 if state is None else decode(state)["step"]
    while step < total:
        step = train_one_step(step)
        if ck.due() or ck.stop_requested:
            try:
                result = ck.save(encode(step), progress=step)  # SaveResult, or None (no checkpoints)
            except CheckpointRetryLater:  # the store is down: a scheduled save does not wait
                pass
        if ck.stop_requested:
            sys.exit(EXIT_STOPPED)        # 143: stopped after its checkpoint

It needs only the standard library; boto3 is imported only for ``s3://`` checkpoints. Nothing else
of gpusched is imported, so a job's environment may install just this package (or copy this file).
Python 3.9+.

Environment (set by the gpusched agent; all may be absent, and then the job runs locally)
------------------------------------------------------------------------------------------
======================================  ==========================================================
``GPUSCHED_JOB_ID``                     the job; written into each object's metadata
``GPUSCHED_ALLOCATION_ID``              the allocation (the commit's fencing token); metadata
``GPUSCHED_ATTEMPT``                    1, 2, ...; metadata
``GPUSCHED_GRACE_PERIOD``               seconds from SIGTERM to SIGKILL (unset: no deadline known)
``GPUSCHED_CHECKPOINT_URI``             ``s3://<bucket>/checkpoints/<job_id>/`` (a prefix), or a
                                        local ``file:///abs/dir/`` (or a plain absolute path).
                                        Unset: checkpointing is off (``save`` returns None).
``GPUSCHED_RESUME_FROM``                the full URI of the object to resume from, e.g.
                                        ``s3://b/checkpoints/job-1/0000000003``; unset: fresh start
``GPUSCHED_RESUME_SEQ``                 its sequence number (unset: parsed from the URI's last part)
``GPUSCHED_RESUME_SHA256``              the digest the control plane committed for it: a restore whose
                                        bytes hash otherwise fails (unset: only its metadata is checked)
``GPUSCHED_CHECKPOINT_INTERVAL``        seconds between scheduled checkpoints; unset or 0: the job
                                        checkpoints only when asked to stop (``due()`` is False)
``GPUSCHED_CHECKPOINT_PHASE``           scheduled checkpoints fall at epoch times t with
                                        t = phase (mod interval). Unset: the phase of the job's
                                        start, i.e. at start + k * interval.
``GPUSCHED_S3_ENDPOINT``, ``..._REGION`` the S3 endpoint (path-style addressing) and region
``GPUSCHED_S3_ACCESS_KEY``, ``..._SECRET_KEY`` S3 credentials (unset: boto3's default chain)
``GPUSCHED_S3_PART_MB``                 the part size of uploads in MiB (default 64, 5 to 5120); an
                                        object larger than one part is a multipart upload
``GPUSCHED_S3_UPLOAD_THREADS``          parts uploaded at once (default 8; memory: one part each)
``GPUSCHED_S3_RETRY_S``                 how long a restore, and a save after SIGTERM, keep asking a
                                        store that does not answer (or answers 5xx) before raising
                                        :class:`CheckpointStoreUnreachable` (default 300; a save
                                        never past the grace deadline; a scheduled save does not
                                        wait: it raises at once, and the job saves when next due;
                                        a store that takes the connection and never answers holds
                                        any call for botocore's timeouts, about 12 minutes).
                                        Once a stop is asked, no one call to the store outlasts the
                                        grace deadline either: it is given up, and raises
``GPUSCHED_REPORT_DIR``                 where checkpoints are reported to the agent (unset: no
                                        reports, nothing is committed: a local run)
``GPUSCHED_LAUNCHED_AT``                the epoch time the agent started this process; a restore
                                        reports how long the job took from there to have its
                                        state back (``restored.json``), which the scheduler learns
                                        restart times from
``GPUSCHED_NODE_RANK``                  this machine's place in the job's gang (0, 1, ...); with
                                        a launcher's rank (``RANK``, set by torchrun and most
                                        Python launchers, ``OMPI_COMM_WORLD_RANK``, ``PMI_RANK``:
                                        read first) or, without one, a local rank (``LOCAL_RANK``,
                                        ``OMPI_COMM_WORLD_LOCAL_RANK``, ``MPI_LOCALRANKID``), which
                                        process saves: rank 0 only
======================================  ==========================================================

Protocol (S3 has no rename: write-once keys, then a commit in the control plane's database)
------------------------------------------------------------------------------------------
1. Checkpoint N's bytes go to ``<prefix>/<N:010d>`` (``checkpoints/job-1/0000000004``) with a
   conditional write that never overwrites: up to one part (``GPUSCHED_S3_PART_MB``, 64 MiB), one
   ``put_object(IfNoneMatch="*")``, whose ETag is the MD5 of the bytes; a bigger object is a
   multipart upload (parts sent ``GPUSCHED_S3_UPLOAD_THREADS`` at a time, each with its own
   Content-MD5, so S3 refuses a part that is not the bytes hashed) finished by
   ``complete_multipart_upload(IfNoneMatch="*")``, and aborted if anything fails. (S3 takes at
   most 5 GiB in one PUT and 10,000 parts: past 625 GiB the parts grow.) Metadata: ``sha256``,
   ``allocation-id``, ``attempt``, ``job-id``. A 412 PreconditionFailed (or 409 ConditionalRequestConflict) means the number is
   taken (an earlier attempt's uncommitted write, or another writer): this writer is refused, logs
   it, and takes the next free number (at most 20 tries; after the first refusal it lists the
   prefix to jump past every taken number, when listing is allowed). A refusal of what is in fact
   this writer's own earlier write (an HTTP retry after a lost response: same sha256, allocation
   and attempt in the metadata) counts as written. A checkpoint over 8 MiB looks its number up
   first (``LOOK_FIRST_BYTES``), so a number already taken costs it no upload.
   Local ``file://`` checkpoints do the same with ``os.link`` (atomic, never overwrites) and a
   ``<N:010d>.meta.json`` file beside the object for the metadata.
2. The first N is ``GPUSCHED_RESUME_SEQ + 1`` (1 on a fresh start); each save takes the next.
3. Then it is reported: ``$GPUSCHED_REPORT_DIR/checkpoint-<N:010d>.json`` is written atomically
   (``.json.tmp``, then ``os.replace``)::

       {"seq": 4, "key": "checkpoints/job-1/0000000004", "uri": "s3://b/checkpoints/job-1/0000000004",
        "size": 1234, "md5": "<hex>", "sha256": "<hex>", "progress": 17.0, "written_at": 1700000000.5}

   (``key`` is the object key without the bucket; for ``file://`` it is the absolute path without
   its leading ``/``; ``progress`` is what the job passed, or null; ``written_at`` is when
   ``save`` was called, as of which the bytes hold the job's state.) The agent forwards it to the
   control plane with its own allocation id (the fencing token) and answers with
   ``checkpoint-<N:010d>.ack.json`` = ``{"committed": true|false, "reason": "..."}``. ``save()``
   waits for the ack up to ``ack_timeout`` (30 s) and, once SIGTERM arrived, never past the grace
   deadline less a small reserve for exiting (``min(1 s, grace / 10)``). No ack in time:
   ``committed=None``. No report dir: ``save()`` returns at once with ``committed=None``.
4. Only committed checkpoints are resumed from: the control plane picks ``GPUSCHED_RESUME_FROM``.
   ``restore()`` downloads that object and checks its bytes against its ``sha256`` metadata,
   raising :class:`CheckpointUnusable` (a :class:`CheckpointError`) when they differ, the
   metadata is missing or the object is gone (an S3 read cut short of the object's size is a
   plain :class:`CheckpointError`: the store's fault, not the checkpoint's). It first writes
   ``$GPUSCHED_REPORT_DIR/unusable.json`` = ``{"seq": 3, "reason": "..."}``: the agent hands it to
   gpusched with the attempt's end, which takes checkpoint 3 for incomplete and queues the job
   again, to resume from the newest complete checkpoint before it (or from the start).
5. The grace of a stop is the preemption's, which may differ from ``GPUSCHED_GRACE_PERIOD`` (the
   cluster's grace changed since the launch; a gang that lost a machine gets none), or the
   agent's (shutting down, it gives at most its own; an orphan gets a few seconds): the agent
   writes ``$GPUSCHED_REPORT_DIR/stop.json`` = ``{"grace_period": 20, "deadline": <epoch>}`` as
   the stop is ordered, and once SIGTERM arrived the deadlines above follow it.
6. Once restored, with ``GPUSCHED_LAUNCHED_AT`` set, it writes ``$GPUSCHED_REPORT_DIR/restored.json``
   = ``{"seq": 3, "seconds": 41.2, "size": 1234}``: how long the restart took, from the agent
   launching the process to the state being back (``restart_seconds``). The agent forwards it;
   the control plane keeps it on the allocation and learns from it how long restarts take.

Scheduling (``due()``): with interval I and phase P, scheduled times are the epoch times
t = P (mod I). ``due()`` is True once a scheduled time has passed that is at least I/2 after the
reference, the reference being when the last ``save()`` began (or, before any, when the
Checkpointer was made). So saves follow the staggered grid, and a job does not save again moments
after it started or after an unscheduled save. ``next_due()`` gives that time.

A gang (several machines, ``GPUSCHED_NUM_NODES`` > 1), or a machine running several processes of
the job (torchrun's local ranks), shares one checkpoint prefix: one process saves, rank 0 (the
launcher's rank where it sets one, else the first local process of node rank 0), and every rank
restores. A ``save()`` on any other rank raises :class:`CheckpointError` before it writes anything: each save
would take its own sequence number and be reported, and a restore, which returns the newest only,
would give every rank the bytes of whichever saved last (sharded state would not be kept
together). Gather the state on rank 0 and save it there; ``ck.saves`` says whether this process
is the one. Every rank may ask ``due()``: on the others it is True once per scheduled time, at
the time rank 0's is as long as rank 0 saves only when ``due()`` says so (a save of its own
choosing, at an epoch's end say, moves its schedule and not theirs; then, or on machines whose
clocks differ by more than a step, broadcast rank 0's answer instead).

Exit codes: this module calls no ``sys.exit``. The conventions for gpusched jobs:
``EXIT_STOPPED`` (143, 128 + SIGTERM, as a shell reports a command SIGTERM ended) after saving
on SIGTERM: the agent treats any exit after its own SIGTERM as "stopped", and a job stopped so
by a SIGTERM that stops its agent too (its machine shutting down) is queued again, where an exit
0 would have been taken for the job finished; ``EXIT_RETRY_LATER`` (75, sysexits' EX_TEMPFAIL)
when what the job needs is not there now (``CheckpointRetryLater`` at ``restore()``, say): the job
is queued again as an infrastructure failure (five in a row fail it), not failed as its own.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import glob
import hashlib
import json
import logging
import math
import os
import re
import shutil
import signal
import socket
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Callable, Dict, List, Mapping, Optional, Tuple, Union
from urllib.parse import quote, unquote, urlparse

__all__ = ["Checkpointer", "SaveResult", "CheckpointError", "CheckpointRetryLater", "CheckpointStoreRefused",
           "CheckpointStoreUnreachable", "CheckpointUnusable", "EXIT_STOPPED", "EXIT_RETRY_LATER", "seq_key"]

log = logging.getLogger("jobkit")

EXIT_STOPPED = 143
"""Exit code of a job that saved its checkpoint after SIGTERM and stopped (128 + SIGTERM): never
0, which says the job is done (workflows.types.EXIT_STOPPED)."""
EXIT_RETRY_LATER = 75
"""Exit code of a job that cannot run for now for want of the infrastructure (its checkpoint
store unreachable): gpusched queues it again (workflows.types.EXIT_RETRY_LATER)."""

MAX_WRITE_TRIES = 20
CHUNK = 8 * 1024 * 1024
MIB = 1024 * 1024
PART_MB = 64  # objects over one part go up in parts (GPUSCHED_S3_PART_MB)
MIN_PART_MB = 5  # S3's smallest part, the last excepted
MAX_PART_MB = 5 * 1024  # S3's largest part, and largest single PUT
MAX_PARTS = 10_000  # S3's most parts in one upload
UPLOAD_THREADS = 8  # parts sent at once (GPUSCHED_S3_UPLOAD_THREADS)
S3_RETRY_FOR = 300.0  # seconds a save or restore keeps asking an unreachable store (GPUSCHED_S3_RETRY_S)
LOOK_FIRST_BYTES = 8 * MIB  # a checkpoint bigger than this looks its number up before the upload
GRACE_WATCH_S = 0.25  # how often a store call looks whether the grace has run out
RESTORED_REPORT = "restored.json"  # in the report directory: how long the restart took
UNUSABLE_REPORT = "unusable.json"  # in the report directory: the resume checkpoint cannot be used
STOP_ORDER = "stop.json"  # in the report directory, from the agent: the grace the stop really gives

Source = Union[bytes, bytearray, memoryview, str, "os.PathLike[str]"]


class CheckpointError(Exception):
    """A checkpoint could not be written, reported or restored; the message says why."""


class CheckpointRetryLater(CheckpointError):
    """Nothing is known to be wrong with the job or its checkpoint, only with where it runs now
    (a store that does not answer, a full local disk): a job may exit ``EXIT_RETRY_LATER``."""


def _local_io(method):
    """A local file system's errors (a full disk, a read-only mount) as checkpoint errors, so a
    job written to catch ``CheckpointError`` does not die of them with a traceback."""
    @functools.wraps(method)
    def wrapped(*args, **kwargs):
        try:
            return method(*args, **kwargs)
        except CheckpointError:
            raise
        except OSError as e:
            kind = CheckpointRetryLater if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EIO) else CheckpointError
            raise kind(f"{method.__name__}: local I/O failed: {e}") from e
    return wrapped


class CheckpointUnusable(CheckpointError):
    """The checkpoint to resume from cannot be used: its object is gone, its bytes do not match
    its SHA-256, it has none, or it is not the object committed. ``restore`` reports it
    (``unusable.json``) before raising; gpusched then takes it for no complete checkpoint, and
    the job's next attempt resumes from the newest complete one before it (or from the start)."""


class CheckpointStoreRefused(CheckpointRetryLater):
    """The checkpoint store refused this machine: its credentials (403: access denied, a key it
    does not know, a signature that does not match), or a bucket it does not have. Nothing is
    known to be wrong with the job or its checkpoint, only with the machine's S3 settings:
    gpusched queues the job again (exit ``EXIT_RETRY_LATER``), and five in a row fail it, where
    the job failed at once as if by its own fault. Asking again from here changes nothing, so it
    is raised at once. Where the credentials may not list the bucket (no ``s3:ListBucket`` on
    AWS), a missing object is answered 403 too: allow listing, so that one is told apart (it is
    unusable, and the job falls back to the checkpoint before)."""


class CheckpointStoreUnreachable(CheckpointRetryLater):
    """The checkpoint store gave no answer (no connection, a timeout) or a server-side error
    (5xx, SlowDown): nothing is known to be wrong with the checkpoint, and asking again later may
    work. ``restore``, and ``save`` once a stop was asked, keep asking for ``GPUSCHED_S3_RETRY_S``
    before raising it."""


@dataclass(frozen=True)
class SaveResult:
    """What ``save()`` did. ``committed``: True/False as the control plane answered, None when
    nobody answered (no report dir, or no ack within the timeout); ``reason`` says which."""

    seq: int
    key: str
    uri: str
    size: int
    md5: str
    sha256: str
    committed: Optional[bool]
    reason: str
    refused: Tuple[int, ...] = ()  # sequence numbers found taken before this one


def seq_key(prefix: str, seq: int) -> str:
    """The object key of checkpoint ``seq`` under ``prefix``: ``checkpoints/job-1/0000000004``."""
    prefix = prefix.strip("/")
    return f"{prefix}/{seq:010d}" if prefix else f"{seq:010d}"


# --- storage ---------------------------------------------------------------------------------


class _Digest:
    """Size, MD5 and SHA-256 of a checkpoint's bytes; with ``part_size``, also the MD5 of each
    part of that size (the last part shorter), which a multipart upload sends with each part."""

    def __init__(self, part_size: Optional[int] = None) -> None:
        self.size = 0
        self.part_size = part_size
        self._md5 = _new_md5()
        self._sha = hashlib.sha256()
        self.parts: list = []  # MD5 hex of each finished part
        self._part = _new_md5()
        self._part_fill = 0

    def update(self, chunk: bytes) -> None:
        self.size += len(chunk)
        self._md5.update(chunk)
        self._sha.update(chunk)
        if self.part_size is None:
            return
        view = memoryview(chunk)
        while len(view):
            take = min(len(view), self.part_size - self._part_fill)
            self._part.update(view[:take])
            self._part_fill += take
            view = view[take:]
            if self._part_fill == self.part_size:
                self.parts.append(self._part.hexdigest())
                self._part, self._part_fill = _new_md5(), 0

    def finish(self) -> "_Digest":
        if self.part_size is not None and self._part_fill:
            self.parts.append(self._part.hexdigest())
            self._part, self._part_fill = _new_md5(), 0
        return self

    @property
    def md5(self) -> str:
        return self._md5.hexdigest()

    @property
    def sha256(self) -> str:
        return self._sha.hexdigest()


def _new_md5():
    try:
        return hashlib.md5(usedforsecurity=False)
    except TypeError:  # pragma: no cover - builds without the keyword
        return hashlib.md5()


def _number(value: Any) -> float:
    """A number a job passes (an int, a float, a numpy or torch scalar) as a float; NaN for what
    is none, so that the caller refuses it."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _size_of(source: Source) -> int:
    if isinstance(source, (bytes, bytearray, memoryview)):
        return memoryview(source).nbytes
    try:
        return os.stat(source).st_size
    except OSError as e:
        raise CheckpointError(f"cannot read the checkpoint file {source}: {e}") from e


def _by_byte(source: Source) -> Source:
    """In-memory bytes as a flat view by byte, without a copy where the buffer allows (a
    bytearray or a contiguous array of any item type): a checkpoint of tens of GiB must not be
    held twice. A path stays a path."""
    if not isinstance(source, (bytes, bytearray, memoryview)):
        return source
    view = memoryview(source)
    return view.cast("B") if view.c_contiguous else memoryview(view.tobytes())


def _digest_of(source: Source, part_size: Optional[int] = None) -> _Digest:
    d = _Digest(part_size)
    if isinstance(source, (bytes, bytearray, memoryview)):
        d.update(_by_byte(source))
    else:
        try:
            with open(source, "rb") as f:
                for chunk in iter(lambda: f.read(CHUNK), b""):
                    d.update(chunk)
        except OSError as e:
            raise CheckpointError(f"cannot read the checkpoint file {source}: {e}") from e
    return d.finish()


class _Location:
    """A parsed checkpoint URI: scheme ``s3`` or ``file``, bucket (``""`` for files), key."""

    def __init__(self, uri: str):
        self.uri = uri
        if uri.startswith("/"):  # a plain path is a path: '#', '?' and '%' are its own characters
            self.scheme, self.bucket, self.key = "file", "", uri.lstrip("/")
            return
        parsed = urlparse(uri)
        self.scheme = parsed.scheme
        if self.scheme == "s3":
            if not parsed.netloc:
                raise CheckpointError(f"checkpoint URI {self.uri!r} names no bucket (s3://<bucket>/<prefix>/)")
            self.bucket = parsed.netloc
            self.key = parsed.path.lstrip("/")
        elif self.scheme == "file":
            if parsed.netloc not in ("", "localhost"):
                raise CheckpointError(f"checkpoint URI {self.uri!r}: file URIs are local (file:///abs/dir/)")
            if parsed.query or parsed.fragment or uri.endswith(("?", "#")):
                # Read as a URL, they would end the path there, and two jobs would share a folder.
                raise CheckpointError(f"checkpoint URI {self.uri!r} holds '?' or '#'; percent-encode them "
                                      "(%3F, %23) or give the folder as a plain path")
            self.bucket = ""
            self.key = unquote(parsed.path).lstrip("/")
        else:
            raise CheckpointError(f"checkpoint URI {self.uri!r}: only s3:// and file:// are supported")

    def child(self, key: str) -> str:
        if self.scheme == "s3":
            return f"s3://{self.bucket}/{key}"
        return "file:///" + quote(key)  # read back with unquote: a '%' or '#' in a name survives


class _FileStore:
    """Checkpoints in a local directory: ``os.link`` claims a name atomically, never overwriting."""

    def part_size_for(self, size: int) -> Optional[int]:  # noqa: ARG002 - one piece, always
        return None

    def put_new(self, bucket: str, key: str, source: Source, digest: _Digest, metadata: Dict[str, str]) -> bool:
        path = Path("/" + key)
        path.parent.mkdir(parents=True, exist_ok=True)
        host = _host()
        _remove_saves_of_the_gone(path.parent, host)
        # Named for its host and process: a save killed in its grace leaves its copy, which the
        # next save here removes once that process is gone.
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{host}.{os.getpid()}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                if isinstance(source, (bytes, bytearray, memoryview)):
                    f.write(source)
                else:
                    # Checked as copied, as the S3 store's Content-MD5 checks it: a file the job
                    # writes on after it was hashed would be kept under the old hash, and found
                    # corrupted only by the restore.
                    copied, size = hashlib.sha256(), 0
                    with open(source, "rb") as src:
                        for chunk in iter(lambda: src.read(CHUNK), b""):
                            copied.update(chunk)
                            size += len(chunk)
                            f.write(chunk)
                    if (size, copied.hexdigest()) != (digest.size, digest.sha256):
                        raise CheckpointError(f"the checkpoint file {source} changed while it was saved (its "
                                              "bytes are not those hashed before the copy): save a file nothing "
                                              "writes to meanwhile")
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, path)
            except FileExistsError:
                return False
            _write_json_atomic(path.with_name(path.name + ".meta.json"), metadata)
            return True
        finally:
            os.unlink(tmp)

    def head(self, bucket: str, key: str) -> Optional[Dict[str, str]]:
        try:
            return json.loads(Path("/" + key + ".meta.json").read_text())
        except (OSError, ValueError):
            return None

    def max_seq(self, bucket: str, prefix: str) -> Optional[int]:
        try:
            names = os.listdir("/" + prefix.strip("/"))
        except OSError:
            return None
        seqs = [int(n) for n in names if re.fullmatch(r"\d{10}", n)]
        return max(seqs) if seqs else None

    def get(self, bucket: str, key: str, out: IO[bytes]) -> Tuple[_Digest, Optional[Dict[str, str]]]:
        path = Path("/" + key)
        d = _Digest()
        try:
            with open(path, "rb") as f:
                for chunk in iter(lambda: f.read(CHUNK), b""):
                    d.update(chunk)
                    out.write(chunk)
        except FileNotFoundError:
            raise CheckpointUnusable(f"checkpoint {path} does not exist") from None
        try:
            metadata = json.loads(Path("/" + key + ".meta.json").read_text())
        except (FileNotFoundError, ValueError):  # none, or damaged (it is written atomically)
            metadata = None
        # Any other error (EIO, a stale NFS handle) says nothing of the checkpoint: it goes up
        # as such (a local I/O failure), and the checkpoint is not reported unusable.
        return d, metadata if isinstance(metadata, dict) else None


class _S3Store:
    """Checkpoints in S3. An object of up to one part is one conditional ``put_object``; a bigger
    one is a multipart upload whose parts go up ``threads`` at a time, each with its MD5, and whose
    completion is the conditional write (S3 refuses a single PUT over 5 GiB; and botocore's own
    retries send a failed part again alone, though once they give up the upload is aborted and a
    retry of the save starts it over)."""

    def __init__(self, endpoint: Optional[str], access_key: Optional[str], secret_key: Optional[str],
                 region: Optional[str], part_mb: int = PART_MB, threads: int = UPLOAD_THREADS):
        import boto3
        from botocore.config import Config

        self.part_size = int(part_mb) * MIB
        self.threads = max(1, int(threads))
        settings = dict(s3={"addressing_style": "path"}, connect_timeout=10, read_timeout=120,
                        retries={"max_attempts": 5, "mode": "standard"}, max_pool_connections=max(10, self.threads))
        try:
            # The bytes are checked against their SHA-256 as they are read: rotten ones then make
            # the checkpoint unusable (the attempt falls back to the one before), where
            # botocore's own CRC check raised an error nobody took for that.
            config = Config(**settings, response_checksum_validation="when_required")
        except TypeError:  # botocore before 1.36, which checks responses only when asked to
            config = Config(**settings)
        self._client = boto3.client(
            "s3", endpoint_url=endpoint or None, aws_access_key_id=access_key or None,
            aws_secret_access_key=secret_key or None, region_name=region or "us-east-1", config=config,
        )

    def part_size_for(self, size: int) -> Optional[int]:
        """The part size of an object of ``size`` bytes: None for a single PUT; otherwise the
        configured size, or bigger (whole MiB) where S3's 10,000 parts would not hold it."""
        if size <= self.part_size:
            return None
        return max(self.part_size, -(-size // (MAX_PARTS * MIB)) * MIB)

    @staticmethod
    def _code(e: Exception) -> Tuple[str, int]:
        response = getattr(e, "response", None) or {}
        code = str(response.get("Error", {}).get("Code", ""))
        status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        return code, status

    def put_new(self, bucket: str, key: str, source: Source, digest: _Digest, metadata: Dict[str, str]) -> bool:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            if digest.part_size is not None:
                return self._put_parts(bucket, key, source, digest, metadata)
            kwargs = dict(Bucket=bucket, Key=key, IfNoneMatch="*", Metadata=metadata,
                          ContentMD5=_b64(digest.md5), ContentLength=digest.size,
                          ContentType="application/octet-stream")
            if isinstance(source, (bytes, bytearray, memoryview)):
                self._client.put_object(Body=bytes(source), **kwargs)
            else:
                with open(source, "rb") as f:
                    self._client.put_object(Body=f, **kwargs)
        except ClientError as e:
            if self._taken(e):
                return False
            raise self._failure(f"writing s3://{bucket}/{key}", e) from e
        except BotoCoreError as e:
            raise self._failure(f"writing s3://{bucket}/{key}", e) from e
        except OSError as e:
            raise CheckpointError(f"writing s3://{bucket}/{key} failed: cannot read {source}: {e}") from e
        return True

    def _failure(self, what: str, e: Exception) -> CheckpointError:
        """The error to raise for a botocore error: ``CheckpointStoreUnreachable`` when S3 gave no
        answer (no connection, a timeout, a cut-off response) or a passing server-side one
        (500, 502, 503, 504, SlowDown), worth asking again; ``CheckpointStoreRefused`` when it
        refused this machine's credentials or bucket; else ``CheckpointError`` (a refusal of the
        request, a bad certificate, a parameter this boto3 does not know: asking again changes
        nothing)."""
        from botocore import exceptions as b

        if isinstance(e, b.ClientError):
            code, status = self._code(e)
            if status in (500, 502, 503, 504) or code in ("SlowDown", "ServiceUnavailable", "InternalError",
                                                          "RequestTimeout"):
                return CheckpointStoreUnreachable(f"{what} failed: {e}")
            if status == 403 or code in _REFUSALS:
                return CheckpointStoreRefused(f"{what} failed: {e}; {_CHECK_SETTINGS}")
            return CheckpointError(f"{what} failed: {e}")
        if isinstance(e, (b.ConnectionError, b.HTTPClientError, b.IncompleteReadError)) and not isinstance(e, b.SSLError):
            return CheckpointStoreUnreachable(f"{what} failed: {_unreachable(e)}")
        if isinstance(e, (b.NoCredentialsError, b.PartialCredentialsError)):
            return CheckpointStoreRefused(f"{what} failed: {_unreachable(e)}")
        return CheckpointError(f"{what} failed: {e}")

    def _taken(self, e: Exception) -> bool:
        """Whether S3 refused a conditional write because the key exists (or is being written)."""
        code, status = self._code(e)
        return status in (412, 409) or code in ("PreconditionFailed", "ConditionalRequestConflict")

    def _put_parts(self, bucket: str, key: str, source: Source, digest: _Digest, metadata: Dict[str, str]) -> bool:
        """A multipart upload that completes only if ``key`` does not exist. Whatever goes wrong,
        the upload is aborted, so no half-written parts stay billed in the bucket."""
        from botocore.exceptions import ClientError

        upload_id = self._client.create_multipart_upload(
            Bucket=bucket, Key=key, Metadata=metadata, ContentType="application/octet-stream")["UploadId"]
        size, step = digest.size, digest.part_size
        assert step is not None

        def send(number: int) -> Dict[str, Any]:
            offset = (number - 1) * step
            body = _read_part(source, offset, min(step, size - offset))
            answer = self._client.upload_part(
                Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=body,
                ContentMD5=_b64(digest.parts[number - 1]), ContentLength=len(body))
            return {"PartNumber": number, "ETag": answer["ETag"]}

        completing = False
        try:
            parts = _on_daemon_threads(send, list(range(1, len(digest.parts) + 1)), self.threads, "jobkit-upload")
            completing = True
            self._client.complete_multipart_upload(
                Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts},
                IfNoneMatch="*")
        except ClientError as e:
            self._abort(bucket, key, upload_id)
            # NoSuchUpload on the completion: a resend of a completion that was made (its answer
            # lost), by a store that forgets a completed upload. Taken as a refusal, the key is
            # looked up and found this writer's own, instead of failing a save that was made.
            if self._taken(e) or (completing and self._code(e)[0] == "NoSuchUpload"):
                return False
            raise
        except BaseException:
            self._abort(bucket, key, upload_id)
            raise
        return True

    def _abort(self, bucket: str, key: str, upload_id: str) -> None:
        try:
            self._client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id)
        except Exception as e:  # the control plane aborts what is left once a later one commits
            log.warning("jobkit: could not abort the upload of s3://%s/%s: %s", bucket, key, e)

    def head(self, bucket: str, key: str) -> Optional[Dict[str, str]]:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return dict(self._client.head_object(Bucket=bucket, Key=key).get("Metadata") or {})
        except ClientError as e:
            failure = self._failure(f"looking up s3://{bucket}/{key}", e)
            if isinstance(failure, CheckpointStoreUnreachable):
                raise failure from e
            return None
        except BotoCoreError as e:
            raise self._failure(f"looking up s3://{bucket}/{key}", e) from e

    def max_seq(self, bucket: str, prefix: str) -> Optional[int]:
        from botocore.exceptions import BotoCoreError, ClientError

        prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        best = None
        try:
            for page in self._client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
                for obj in page.get("Contents", []):
                    name = obj["Key"][len(prefix):]
                    if re.fullmatch(r"\d{10}", name):
                        best = max(best or 0, int(name))
        except (ClientError, BotoCoreError) as e:
            log.info("jobkit: cannot list s3://%s/%s (%s); trying numbers one by one", bucket, prefix, e)
            return None
        return best

    def get(self, bucket: str, key: str, out: IO[bytes]) -> Tuple[_Digest, Optional[Dict[str, str]]]:
        from botocore.exceptions import BotoCoreError, ClientError
        from urllib3.exceptions import HTTPError as Urllib3Error

        d = _Digest()
        try:
            response = self._client.get_object(Bucket=bucket, Key=key)
            body = response["Body"]
            try:
                for chunk in iter(lambda: body.read(CHUNK), b""):
                    d.update(chunk)
                    out.write(chunk)
            except Urllib3Error as e:  # botocore wraps only some of the body's errors (not TLS's)
                raise CheckpointStoreUnreachable(f"reading s3://{bucket}/{key} failed: {e}") from e
        except ClientError as e:
            if self._code(e)[0] == "NoSuchKey":  # the bucket is there, and answers: the object is not
                raise CheckpointUnusable(f"checkpoint s3://{bucket}/{key} does not exist") from e
            raise self._failure(f"reading s3://{bucket}/{key}", e) from e
        except BotoCoreError as e:
            raise self._failure(f"reading s3://{bucket}/{key}", e) from e
        length = response.get("ContentLength")
        if length is not None and int(length) != d.size:
            raise CheckpointError(f"s3://{bucket}/{key}: read {d.size} bytes, the object has {length}")
        return d, dict(response.get("Metadata") or {})


# S3's answers that refuse the machine, not the request: its credentials or its bucket.
_REFUSALS = ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "NoSuchBucket", "AllAccessDisabled",
             "InvalidToken", "ExpiredToken")
_CHECK_SETTINGS = ("check this machine's GPUSCHED_S3_ENDPOINT, GPUSCHED_S3_ACCESS_KEY and GPUSCHED_S3_SECRET_KEY, "
                   "and that the bucket exists")


def _b64(md5_hex: str) -> str:
    """An MD5 as S3's Content-MD5 header wants it."""
    import base64

    return base64.b64encode(bytes.fromhex(md5_hex)).decode()


def _on_daemon_threads(fn: Callable[[Any], Any], items: List[Any], threads: int, name: str) -> List[Any]:
    """``[fn(item) for item in items]``, ``threads`` at a time; the first error is raised once the
    calls under way have ended, and no further one starts. Daemon threads, not an executor's: a
    save given up at the end of the grace period runs on, abandoned, on a thread of its own, and
    Python joins an executor's threads at exit, so the job could not exit until every part of a
    checkpoint nobody would complete was sent (and was SIGKILLed instead, its own shutdown skipped)."""
    results: List[Any] = [None] * len(items)
    errors: List[BaseException] = []
    queue = iter(enumerate(items))
    lock = threading.Lock()

    def work() -> None:
        while True:
            with lock:
                taken = None if errors else next(queue, None)
            if taken is None:
                return
            index, item = taken
            try:
                results[index] = fn(item)
            except BaseException as e:  # noqa: BLE001 - raised again in the caller's thread
                with lock:
                    errors.append(e)

    workers = [threading.Thread(target=work, name=name, daemon=True) for _ in range(max(1, min(threads, len(items))))]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    if errors:
        raise errors[0]
    return results


def _read_part(source: Source, offset: int, length: int) -> bytes:
    if isinstance(source, (bytes, bytearray, memoryview)):
        return bytes(_by_byte(source)[offset:offset + length])
    with open(source, "rb") as f:
        f.seek(offset)
        body = f.read(length)
    if len(body) != length:
        # Shorter than when it was hashed: the file changed while being saved.
        raise CheckpointError(f"{source} changed while it was being written (read {len(body)} bytes "
                              f"at {offset}, expected {length})")
    return body


def _unreachable(e: Exception) -> str:
    """A botocore error that is no answer from S3, in words that point at the likely cause."""
    name = type(e).__name__
    if name in ("NoCredentialsError", "PartialCredentialsError"):
        return f"{e} (set GPUSCHED_S3_ACCESS_KEY and GPUSCHED_S3_SECRET_KEY)"
    return f"{e} (is the checkpoint store at GPUSCHED_S3_ENDPOINT up and reachable?)"


def _write_json_atomic(path: Path, payload: Mapping[str, Any]) -> None:
    # A temporary name of its own: a job's local ranks all write restored.json at once, and on a
    # shared name one truncated the file another had just put in place.
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _remove_partials_of_the_gone(path: Path, host: str) -> None:
    """Remove the copies restores to ``path`` on ``host`` (this one) left when their processes
    were killed."""
    try:
        left = list(path.parent.glob(f"{glob.escape(path.name)}.{glob.escape(host)}.*.partial"))
    except OSError:
        return
    for partial in left:
        pid = partial.name[len(path.name) + len(host) + 2:].split(".", 1)[0]
        if pid.isdigit() and not _process_alive(int(pid)):
            with contextlib.suppress(OSError):
                partial.unlink()


def _remove_saves_of_the_gone(folder: Path, host: str) -> None:
    """Remove the copies saves into ``folder`` on ``host`` (this one) left when their processes
    were killed (``.<name>.<host>.<pid>.<random>.tmp``)."""
    try:
        left = list(folder.glob(f".*.{glob.escape(host)}.*.tmp"))
    except OSError:
        return
    for copy in left:
        parts = copy.name[1:].split(".")
        if len(parts) == 5 and parts[1] == host and parts[2].isdigit() and not _process_alive(int(parts[2])):
            with contextlib.suppress(OSError):
                copy.unlink()


def _host() -> str:
    """This host's name and its pid namespace's (containers sharing a host name have their own
    pids), as a file name's part (no dots: they separate the parts)."""
    try:
        namespace = f"-{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        namespace = ""
    return (re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname()) or "host") + namespace


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def _looking_before_a_resend(store: Any, bucket: str, key: str, data: Source, digest: Any,
                             metadata: Mapping[str, str]) -> Callable[[], bool]:
    """The store's ``put_new`` for a caller that asks again while the store is unreachable. An
    upload whose answer was lost may have been made: a big one is looked up before it is sent
    again (tens of GiB twice could outlast the grace), and what is there is judged as any number
    found taken (this writer's own, or another's)."""
    sent = False

    def put() -> bool:
        nonlocal sent
        if sent and digest.size > LOOK_FIRST_BYTES and store.head(bucket, key) is not None:
            return False
        sent = True
        return store.put_new(bucket, key, data, digest, metadata)

    return put


# --- the checkpointer ------------------------------------------------------------------------


def _float_env(env: Mapping[str, str], name: str) -> Optional[float]:
    raw = (env.get(name) or "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise CheckpointError(f"{name}={raw!r} is not a number of seconds") from None
    if not math.isfinite(value) or value < 0:
        raise CheckpointError(f"{name}={raw!r} must be a finite number >= 0")
    return value


def _whole(text: str) -> bool:
    """Digits int() reads: str.isdigit() also says yes to '²', which int() refuses."""
    return text.isascii() and text.isdigit()


# Where a process's rank is read. A launcher's global rank is the process's own (torchrun and
# most Python launchers: RANK; Open MPI; MPICH and Intel MPI). Without one, the process is rank 0
# only if its machine is the gang's first and it is its machine's first process (torchrun-style
# LOCAL_RANK, Open MPI's, Intel MPI's): several local processes must not each save.
_GLOBAL_RANKS = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
_MACHINE_AND_LOCAL_RANKS = ("GPUSCHED_NODE_RANK", "LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID")


def _rank_source(env: Mapping[str, str]) -> Optional[str]:
    """The variable this process's rank is read from; None for a job of one process. Of the
    machine and local ranks, the first that is not 0 (the process is not rank 0), else the first
    set."""
    def given(name: str) -> str:
        return (env.get(name) or "").strip()
    found = next((name for name in _GLOBAL_RANKS if given(name)), None)
    if found is not None:
        return found
    parts = [name for name in _MACHINE_AND_LOCAL_RANKS if given(name)]
    return next((name for name in parts if given(name).lstrip("0")), parts[0] if parts else None)


def _int_env(env: Mapping[str, str], name: str, least: int) -> Optional[int]:
    raw = (env.get(name) or "").strip()
    if not raw:
        return None
    if not _whole(raw) or int(raw) < least:
        raise CheckpointError(f"{name}={raw!r} must be a whole number >= {least}")
    return int(raw)


class Checkpointer:
    """Saves and restores one job's checkpoints; see the module docstring for the protocol.

    Attributes: ``stop_requested`` (set by SIGTERM once :meth:`handle_sigterm` ran, or by
    :meth:`request_stop`), ``resume_seq`` (the sequence number resumed from, 0 on a fresh start),
    ``next_seq`` (the number the next save tries first), ``last_save`` (the last SaveResult),
    ``rank`` (this process's rank among the job's processes, None for a job of one: only rank 0
    saves).
    """

    def __init__(
        self,
        checkpoint_uri: Optional[str] = None,
        *,
        resume_from: Optional[str] = None,
        resume_seq: Optional[int] = None,
        resume_sha256: Optional[str] = None,
        interval: Optional[float] = None,
        phase: Optional[float] = None,
        grace_period: Optional[float] = None,
        report_dir: Optional[Union[str, "os.PathLike[str]"]] = None,
        launched_at: Optional[float] = None,
        job_id: str = "",
        allocation_id: str = "",
        attempt: str = "",
        s3_endpoint: Optional[str] = None,
        s3_access_key: Optional[str] = None,
        s3_secret_key: Optional[str] = None,
        s3_region: Optional[str] = None,
        s3_part_mb: int = PART_MB,
        s3_upload_threads: int = UPLOAD_THREADS,
        s3_retry_for: float = S3_RETRY_FOR,
        ack_timeout: float = 30.0,
        rank: Optional[int] = None,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ):
        self.checkpoint_uri = checkpoint_uri or None
        self._location = _Location(self.checkpoint_uri) if self.checkpoint_uri else None
        self.resume_from = resume_from or None
        if self.resume_from is not None:
            _Location(self.resume_from)  # fail early on a bad URI
        if resume_seq is None and self.resume_from is not None:
            last = self.resume_from.rstrip("/").rsplit("/", 1)[-1]
            resume_seq = int(last) if _whole(last) else 0
        self.resume_seq = int(resume_seq or 0) if self.resume_from is not None else 0
        self.resume_sha256 = resume_sha256 if self.resume_from is not None else None
        self.next_seq = self.resume_seq + 1
        for name, value, least in (("interval", interval, 0.0), ("phase", phase, -math.inf),
                                   ("grace_period", grace_period, 0.0)):
            # A job that constructs its own Checkpointer and catches CheckpointError gets one here too.
            seconds = None if value is None else _number(value)
            if seconds is not None and not (math.isfinite(seconds) and seconds >= least):
                raise CheckpointError(f"{name} must be a number of seconds{', 0 or more' if least == 0 else ''}, "
                                      f"not {value!r}")
        self.interval = float(interval) if interval else 0.0
        self.phase = None if phase is None else float(phase)
        self.grace_period = None if grace_period is None else float(grace_period)
        self.report_dir = Path(report_dir) if report_dir else None
        self.launched_at = None if launched_at is None else float(launched_at)
        self.restart_seconds: Optional[float] = None  # launch to state restored, once restored
        self.job_id, self.allocation_id, self.attempt = str(job_id), str(allocation_id), str(attempt)
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 0):
            raise CheckpointError(f"rank must be a whole number >= 0 (this process's place among the job's "
                                  f"processes), not {rank!r}")
        self.rank = rank
        self._rank_from = "rank"  # where the rank was read: named when a save is refused
        if int(s3_part_mb) < MIN_PART_MB:
            raise CheckpointError(f"s3_part_mb={s3_part_mb}: S3's parts are at least {MIN_PART_MB} MiB")
        if int(s3_part_mb) > MAX_PART_MB:
            raise CheckpointError(f"s3_part_mb={s3_part_mb}: S3's parts, and its single uploads, are at most "
                                  f"{MAX_PART_MB} MiB (5 GiB)")
        self._s3 = (s3_endpoint, s3_access_key, s3_secret_key, s3_region, int(s3_part_mb),
                    max(1, int(s3_upload_threads)))
        self._stores: Dict[str, Any] = {}
        self.s3_retry_for = float(s3_retry_for)
        # Whether this attempt took its resume checkpoint back (or said nothing of it yet): a
        # save before it would commit a state without that progress as the newest.
        self._restore_pending = self.resume_from is not None
        self.ack_timeout = float(ack_timeout)
        self._clock, self._monotonic, self._sleep = clock, monotonic, sleep
        self.started_at = clock()
        self._reference = self.started_at  # when the last save began (or the start)
        self.stop_requested = False
        self._stop_deadline: Optional[float] = None  # monotonic
        self.last_save: Optional[SaveResult] = None
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None, **overrides: Any) -> "Checkpointer":
        """A Checkpointer configured from ``GPUSCHED_*`` (``environ`` defaults to ``os.environ``);
        keyword arguments override what the environment says."""
        env = os.environ if environ is None else environ
        seq = (env.get("GPUSCHED_RESUME_SEQ") or "").strip()
        if seq and not _whole(seq):
            raise CheckpointError(f"GPUSCHED_RESUME_SEQ={seq!r} is not a sequence number")
        kwargs: Dict[str, Any] = dict(
            checkpoint_uri=env.get("GPUSCHED_CHECKPOINT_URI") or None,
            resume_from=env.get("GPUSCHED_RESUME_FROM") or None,
            resume_seq=int(seq) if seq else None,
            resume_sha256=env.get("GPUSCHED_RESUME_SHA256") or None,
            interval=_float_env(env, "GPUSCHED_CHECKPOINT_INTERVAL"),
            phase=_float_env(env, "GPUSCHED_CHECKPOINT_PHASE"),
            grace_period=_float_env(env, "GPUSCHED_GRACE_PERIOD"),
            report_dir=env.get("GPUSCHED_REPORT_DIR") or None,
            launched_at=_float_env(env, "GPUSCHED_LAUNCHED_AT"),
            job_id=env.get("GPUSCHED_JOB_ID", ""),
            allocation_id=env.get("GPUSCHED_ALLOCATION_ID", ""),
            attempt=env.get("GPUSCHED_ATTEMPT", ""),
            s3_endpoint=env.get("GPUSCHED_S3_ENDPOINT") or None,
            s3_access_key=env.get("GPUSCHED_S3_ACCESS_KEY") or None,
            s3_secret_key=env.get("GPUSCHED_S3_SECRET_KEY") or None,
            s3_region=env.get("GPUSCHED_S3_REGION") or None,
        )
        rank_from = _rank_source(env)
        if rank_from is not None:
            kwargs["rank"] = _int_env(env, rank_from, 0)
        retry_for = _float_env(env, "GPUSCHED_S3_RETRY_S")
        if retry_for is not None:
            kwargs["s3_retry_for"] = retry_for
        for name, key, least in (("GPUSCHED_S3_PART_MB", "s3_part_mb", MIN_PART_MB),
                                 ("GPUSCHED_S3_UPLOAD_THREADS", "s3_upload_threads", 1)):
            value = _int_env(env, name, least)
            if value is not None:
                kwargs[key] = value
        kwargs.update(overrides)
        ck = cls(**kwargs)
        if rank_from is not None and "rank" not in overrides:
            ck._rank_from = rank_from
        return ck

    # -- state ---------------------------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        """Whether checkpoints can be saved (a checkpoint URI is set)."""
        return self._location is not None

    @property
    def saves(self) -> bool:
        """Whether this process may save: it is the job's only process, or its rank 0."""
        return not self.rank

    @property
    def resuming(self) -> bool:
        return self.resume_from is not None

    def _store(self, scheme: str):
        if scheme not in self._stores:
            try:
                self._stores[scheme] = _S3Store(*self._s3) if scheme == "s3" else _FileStore()
            except ImportError as e:
                raise CheckpointError(f"s3:// checkpoints need boto3 ({e}): pip install boto3") from e
            except ValueError as e:  # botocore's word for an endpoint URL it cannot use
                raise CheckpointError(f"the checkpoint store's endpoint {self._s3[0]!r} is not usable: {e}") from e
            except Exception as e:
                from botocore.exceptions import BotoCoreError

                if not isinstance(e, BotoCoreError):
                    raise
                # A key without its secret (or the other way round), a profile that does not exist.
                raise CheckpointError(f"the checkpoint store's client cannot be made: {e} (give both "
                                      "GPUSCHED_S3_ACCESS_KEY and GPUSCHED_S3_SECRET_KEY, or neither)") from e
        return self._stores[scheme]

    # -- stopping ------------------------------------------------------------------------------

    def handle_sigterm(self, signals: Tuple[int, ...] = (signal.SIGTERM,)) -> None:
        """Install a handler (main thread only) that calls :meth:`request_stop` on SIGTERM. It does
        nothing else: the job saves and exits at its next safe point."""

        def handler(signum, frame):  # noqa: ARG001
            self.request_stop()

        for sig in signals:
            signal.signal(sig, handler)

    def request_stop(self) -> None:
        """Mark the job as asked to stop; the grace deadline starts now (the first call counts)."""
        if not self.stop_requested:
            if self.grace_period is not None:
                self._stop_deadline = self._monotonic() + self.grace_period
            self.stop_requested = True

    def _follow_stop_order(self) -> None:
        """Once a stop was asked, take the grace deadline from the agent's stop order, when it
        wrote one (``stop.json``): that is when SIGKILL comes."""
        if not self.stop_requested or self.report_dir is None:
            return
        try:
            order = json.loads((self.report_dir / STOP_ORDER).read_text())
            deadline, grace = float(order["deadline"]), float(order["grace_period"])
        except (OSError, ValueError, TypeError, KeyError):
            return  # none (the launch's grace stands), or not yet whole
        if math.isfinite(deadline) and math.isfinite(grace) and grace >= 0:
            self._stop_deadline = self._monotonic() + (deadline - self._clock())
            self.grace_period = grace

    def seconds_left(self) -> float:
        """Seconds left of the grace period since SIGTERM (never below 0); ``math.inf`` before a
        stop was requested, or when the grace period is unknown."""
        self._follow_stop_order()
        if self._stop_deadline is None:
            return math.inf
        return max(0.0, self._stop_deadline - self._monotonic())

    # -- scheduling ----------------------------------------------------------------------------

    def next_due(self) -> Optional[float]:
        """The epoch time of the next scheduled checkpoint, or None (no interval, or no URI)."""
        if not self.enabled or self.interval <= 0:
            return None
        interval = self.interval
        phase = (self.started_at if self.phase is None else self.phase) % interval
        earliest = self._reference + interval / 2
        k = math.ceil((earliest - phase) / interval)
        return phase + k * interval

    def due(self) -> bool:
        """Whether a scheduled checkpoint time has come (see the module docstring). On a rank
        that does not save, True once per scheduled time: no save of its own moves its
        reference on, so the time is taken as rank 0's save takes it, and its ``if ck.due()``
        (a gather, say) comes at the steps rank 0's does while rank 0 saves only when due."""
        nxt = self.next_due()
        if nxt is None or self._clock() < nxt:
            return False
        if not self.saves:
            with self._lock:
                self._reference = self._clock()
        return True

    # -- saving --------------------------------------------------------------------------------

    @_local_io
    def save(self, data: Source, progress: Optional[float] = None) -> Optional[SaveResult]:
        """Write ``data`` (bytes, or the path of a file to upload) as the next checkpoint, report
        it and wait for the ack. Returns None when checkpointing is off (no checkpoint URI).
        Raises :class:`CheckpointError` when the bytes cannot be written, or when this process is
        a rank other than 0 (see :attr:`saves`)."""
        # Refused even with checkpoints off: a local run shows the mistake before a real one does.
        if not self.saves:
            raise CheckpointError(f"this process is rank {self.rank} ({self._rank_from}={self.rank}): a job's "
                                  "processes share one checkpoint stream, which rank 0 alone saves (gather the "
                                  "state on rank 0 and save it there; every rank restores the newest)")
        if self._location is None:
            log.info("jobkit: checkpointing is off (GPUSCHED_CHECKPOINT_URI unset); nothing saved")
            return None
        if not isinstance(data, (bytes, bytearray, memoryview, str, os.PathLike)):
            raise CheckpointError(f"save() takes the checkpoint as bytes (or the path of a file holding it), "
                                  f"not {type(data).__name__}: serialize it first (pickle.dumps, torch.save "
                                  "to a file)")
        if progress is not None and not math.isfinite(_number(progress)):
            # JSON and the control plane take no NaN or infinity: the report could never be sent.
            raise CheckpointError(f"progress must be a finite number (the work done: steps or seconds), "
                                  f"not {progress!r}")
        if self._restore_pending:
            self._restore_pending = False  # said once
            log.warning("jobkit: this attempt resumes from checkpoint %d but has not restored it: this save "
                        "becomes the newest checkpoint without that progress (call restore() first)",
                        self.resume_seq)
        data = _by_byte(data)
        with self._lock:
            # The state the bytes hold is as of now: the report says so, not when the upload ended
            # (minutes for tens of GiB), which the control plane counted as work done.
            asked = self._reference = self._clock()
            location = self._location
            store = self._store(location.scheme)
            digest = _digest_of(data, store.part_size_for(_size_of(data)))
            metadata = {"sha256": digest.sha256, "allocation-id": self.allocation_id,
                        "attempt": self.attempt, "job-id": self.job_id}
            seq, refused = self.next_seq, []
            patiently = self._patiently(self._save_deadline())
            for _ in range(MAX_WRITE_TRIES):
                key = seq_key(location.key, seq)
                theirs = None
                if digest.size > LOOK_FIRST_BYTES:
                    # A number already taken (the unusable checkpoint an attempt fell back from,
                    # an earlier attempt's uncommitted write) then costs a lookup, not the upload
                    # of tens of GiB, perhaps in the grace. The conditional write still decides.
                    theirs = patiently(f"looking up checkpoint {seq}", store.head, location.bucket, key)
                if theirs is None:
                    put = _looking_before_a_resend(store, location.bucket, key, data, digest, metadata)
                    if patiently(f"writing checkpoint {seq}", put):
                        break
                    theirs = patiently(f"looking up checkpoint {seq}", store.head, location.bucket, key)
                # An empty value is not kept by S3 (nor SeaweedFS): a writer run without ids (a
                # local run) must find its own write with those missing, not take it for another's.
                if theirs is not None and all(theirs.get(k, "") == v for k, v in metadata.items()):
                    log.info("jobkit: checkpoint %d was already written by this allocation", seq)
                    break
                refused.append(seq)
                log.warning("jobkit: checkpoint number %d is taken (an earlier attempt's write or "
                            "another writer); this writer is refused and tries the next", seq)
                nxt = seq + 1
                if len(refused) == 1:
                    top = patiently("listing checkpoints", store.max_seq, location.bucket, location.key)
                    if top is not None:
                        nxt = max(nxt, top + 1)
                seq = nxt
            else:
                raise CheckpointError(f"no free checkpoint number after {MAX_WRITE_TRIES} tries "
                                      f"(refused: {refused}) under {location.uri}")
            self.next_seq = seq + 1
            uri = location.child(key)
            report = {"seq": seq, "key": key, "uri": uri, "size": digest.size, "md5": digest.md5,
                      "sha256": digest.sha256, "progress": None if progress is None else float(progress),
                      "written_at": asked}
            committed, reason = self._report(seq, report)
            result = SaveResult(seq=seq, key=key, uri=uri, size=digest.size, md5=digest.md5,
                                sha256=digest.sha256, committed=committed, reason=reason,
                                refused=tuple(refused))
            self.last_save = result
            return result

    def _save_deadline(self) -> float:
        """Until when (monotonic) a save keeps asking an unreachable store. A scheduled save does
        not wait: the job trains on and saves when next due. A save after a stop was asked is the
        last one, so it keeps asking, up to the grace deadline less the reserve for exiting."""
        now = self._monotonic()
        if not self.stop_requested:
            return now
        return self._within_grace(now + self.s3_retry_for)

    def _within_grace(self, deadline: float) -> float:
        """``deadline``, or the grace deadline less the reserve for exiting once a stop was asked."""
        self._follow_stop_order()
        if self._stop_deadline is None:
            return deadline
        return min(deadline, self._stop_deadline - min(1.0, (self.grace_period or 0.0) / 10))

    def _patiently(self, deadline: Union[float, Callable[[], float]]) -> Callable[..., Any]:
        """A caller of store operations that, while the store is unreachable, asks again with
        backoff (1, 2, 4 ... 30 s) until ``deadline`` (monotonic; a function is asked again before
        each retry, so a stop that comes meanwhile can bring it forward), then raises the last error."""

        def call(what: str, operation: Callable[..., Any], *args: Any) -> Any:
            pause = 1.0
            began, again = self._monotonic(), False
            while True:
                try:
                    return self._before_the_grace_ends(what, operation, args)
                except CheckpointStoreUnreachable as e:
                    left = (deadline() if callable(deadline) else deadline) - self._monotonic()
                    if left <= pause:
                        asked = self._monotonic() - began
                        # Say what was done: a scheduled save does not wait, and a save in the
                        # grace waits only as long as the grace leaves.
                        if again:
                            why = (f"still unreachable after asking again for {asked:.0f} s "
                                   f"(GPUSCHED_S3_RETRY_S: {self.s3_retry_for:g} s at most)")
                        elif self.stop_requested:
                            why = "not asked again: the grace period has run out"
                        else:
                            why = ("not asked again: no time left to wait (a scheduled save does not wait: the "
                                   "job saves when next due)")
                        raise CheckpointStoreUnreachable(f"{e} ({why})") from e
                    log.warning("jobkit: %s: the checkpoint store is unreachable (%s); asking again in "
                                "%.0f s", what, e, pause)
                    if callable(deadline):
                        # A stop during the pause may bring the deadline forward: look again each second.
                        end = self._monotonic() + pause
                        while (now := self._monotonic()) < end and deadline() > now:
                            self._sleep(min(1.0, end - now))
                    else:
                        self._sleep(pause)
                    pause, again = min(pause * 2, 30.0), True

        return call

    def _before_the_grace_ends(self, what: str, operation: Callable[..., Any], args: Tuple[Any, ...]) -> Any:
        """``operation(*args)`` on a thread of its own, given up (``CheckpointStoreUnreachable``)
        once the grace deadline less the reserve for exiting has passed, when a stop was asked. A
        store that takes the connection and never answers held a save after SIGTERM for botocore's
        timeouts and retries (12 minutes), past SIGKILL; the deadline was looked at only between
        calls. The call given up runs on until the process exits: a write it completes is one
        nobody reported, which the next attempt's conditional write steps over."""
        outcome: Dict[str, Any] = {}
        done = threading.Event()

        def run() -> None:
            try:
                outcome["value"] = operation(*args)
            except BaseException as e:  # noqa: BLE001 - raised again in the caller's thread
                outcome["error"] = e
            finally:
                done.set()

        threading.Thread(target=run, name="jobkit-store", daemon=True).start()
        # Looked at often: SIGTERM may come during the call, and bring the deadline in.
        while True:
            left = self._within_grace(math.inf) - self._monotonic()
            if left <= 0:
                raise CheckpointStoreUnreachable(
                    f"{what}: the checkpoint store had not answered when the grace period ran out; given up "
                    "so that the job can exit before it is killed")
            if done.wait(min(GRACE_WATCH_S, left)):
                break
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]

    def _ack_deadline(self, began: float) -> float:
        deadline = began + self.ack_timeout
        self._follow_stop_order()
        if self._stop_deadline is not None:
            reserve = min(1.0, (self.grace_period or 0.0) / 10)
            deadline = min(deadline, self._stop_deadline - reserve)
        return deadline

    def _report(self, seq: int, report: Dict[str, Any]) -> Tuple[Optional[bool], str]:
        if self.report_dir is None:
            return None, "not reported: no GPUSCHED_REPORT_DIR (a local run)"
        name = f"checkpoint-{seq:010d}"
        ack = self.report_dir / f"{name}.ack.json"
        try:
            self.report_dir.mkdir(parents=True, exist_ok=True)
            if ack.exists():  # not reported yet, so an ack there is stale (a reused directory)
                ack.unlink()
            _write_json_atomic(self.report_dir / f"{name}.json", report)
        except OSError as e:
            raise CheckpointError(f"cannot write the report {self.report_dir / name}.json: {e}") from e
        began = self._monotonic()
        pause = 0.02
        while True:
            try:
                answer = json.loads(ack.read_text())
                committed = answer.get("committed")
                return (None if committed is None else bool(committed)), str(answer.get("reason", ""))
            except (OSError, ValueError, AttributeError):
                pass  # not there yet (or being written)
            left = self._ack_deadline(began) - self._monotonic()
            if left <= 0:
                waited = self._monotonic() - began
                return None, f"no ack within {waited:.1f} s"
            time.sleep(min(pause, left))
            pause = min(pause * 1.5, 0.25)

    # -- restoring -----------------------------------------------------------------------------

    @_local_io
    def restore(self) -> Optional[bytes]:
        """The bytes of ``GPUSCHED_RESUME_FROM``, verified against its sha256 metadata; None on a
        fresh start. Raises :class:`CheckpointError` on a missing, corrupted or unverifiable object."""
        if self.resume_from is None:
            return None
        import io

        buf = io.BytesIO()
        self._download(buf)
        self._restored(buf.tell())
        return buf.getvalue()

    @_local_io
    def restore_to(self, path: Union[str, "os.PathLike[str]"]) -> Optional[Path]:
        """Like :meth:`restore`, but streams the checkpoint into the file ``path`` (for big ones);
        returns the path, or None on a fresh start (then nothing is written)."""
        if self.resume_from is None:
            return None
        path = Path(path)
        # A name of its own (several local ranks may restore to the same path at once: each
        # writes and verifies its own copy, and the last rename wins with whole, verified bytes),
        # on disk before the rename (a crash must not leave a whole name over half the data).
        # Readable by its owner only, as the job's own state. Named with the host and pid, so
        # that the copies of restores killed in their grace (SIGKILL skips the clean-up below),
        # whole checkpoints each, are found and removed by the next restore on that host instead
        # of filling the disk (a shared folder's copies of other hosts are theirs to remove).
        host = _host()
        _remove_partials_of_the_gone(path, host)
        fd, name = tempfile.mkstemp(prefix=f"{path.name}.{host}.{os.getpid()}.", suffix=".partial",
                                    dir=path.parent)
        tmp = Path(name)
        try:
            with os.fdopen(fd, "wb") as f:
                self._download(f)
                size = f.tell()
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            if tmp.exists():
                tmp.unlink()
        self._restored(size)
        return path

    def _restored(self, size: int) -> None:
        """Tell the agent how long this restart took, launch to state back: the scheduler expects
        resumed jobs to take about as long (its ``expected_restart_s``). Best effort: a report that
        cannot be written loses a measurement, not the job."""
        self._restore_pending = False
        if self.launched_at is None:
            return
        self.restart_seconds = max(0.0, self._clock() - self.launched_at)
        if self.report_dir is None:
            return
        try:
            self.report_dir.mkdir(parents=True, exist_ok=True)
            _write_json_atomic(self.report_dir / RESTORED_REPORT,
                               {"seq": self.resume_seq, "seconds": self.restart_seconds, "size": size})
        except OSError as e:
            log.warning("cannot report the restore to the agent: %s", e)

    def _unusable(self, reason: str) -> CheckpointUnusable:
        """Report that the resume checkpoint cannot be used (``unusable.json``), so the next
        attempt is not sent back to it; the error to raise. Best effort: unreported, the next
        attempt tries it again and fails the same way."""
        if self.report_dir is not None:
            try:
                self.report_dir.mkdir(parents=True, exist_ok=True)
                _write_json_atomic(self.report_dir / UNUSABLE_REPORT, {"seq": self.resume_seq, "reason": reason})
            except OSError as e:
                log.warning("cannot report the unusable checkpoint to the agent: %s", e)
        return CheckpointUnusable(reason)

    def _download(self, out: IO[bytes]) -> None:
        assert self.resume_from is not None
        location = _Location(self.resume_from)
        store = self._store(location.scheme)

        def get() -> Tuple[_Digest, Optional[Dict[str, str]]]:
            out.seek(0)  # a retry starts the object again
            out.truncate()
            return store.get(location.bucket, location.key, out)

        give_up = self._monotonic() + self.s3_retry_for
        # A stop during the restore leaves the job its grace to exit, not the whole retry time.
        try:
            digest, metadata = self._patiently(lambda: self._within_grace(give_up))(
                f"restoring {self.resume_from}", get)
        except CheckpointUnusable as e:
            raise self._unusable(str(e)) from e
        expected = (metadata or {}).get("sha256")
        if not expected:
            raise self._unusable(f"checkpoint {self.resume_from} has no sha256 metadata; "
                                 "it cannot be verified, so it is not used")
        if expected.lower() != digest.sha256:
            raise self._unusable(f"checkpoint {self.resume_from} is corrupted: its bytes hash to "
                                 f"sha256 {digest.sha256}, its metadata says {expected}")
        if self.resume_sha256 is not None and self.resume_sha256.lower() != digest.sha256:
            # Bytes and metadata agree with each other but not with the commit: the object was
            # replaced after it was committed (a store that ignores If-None-Match, a stray writer).
            raise self._unusable(f"checkpoint {self.resume_from} is not the one committed: its bytes hash "
                                 f"to sha256 {digest.sha256}, the commit says {self.resume_sha256}")
