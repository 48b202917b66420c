"""jobkit, the checkpoint library for job code: sequence numbers, write-once refusals, reports and
acks, verified restores, the checkpoint schedule and SIGTERM. Local ``file://`` checkpoints in a
temporary folder, and (marked live) real S3 on the session's SeaweedFS."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import signal
import threading
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import random
import re
import subprocess
import sys
import textwrap

import pytest

import jobkit
from jobkit import EXIT_STOPPED, Checkpointer, CheckpointError, CheckpointStoreUnreachable, seq_key

MIB = 1024 * 1024


def md5(data: bytes) -> str:
    return hashlib.md5(data).hexdigest()


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def noise(size: int, seed: int = 1) -> bytes:
    return random.Random(seed).getrandbits(8 * size).to_bytes(size, "little")


def local(tmp_path: Path, **kw) -> Checkpointer:
    kw.setdefault("allocation_id", "alloc-1")
    kw.setdefault("attempt", "1")
    kw.setdefault("job_id", "job-1")
    return Checkpointer(f"file://{tmp_path}/ck/", **kw)


class FakeAgent:
    """Plays the agent: answers each checkpoint report in ``report_dir`` with an ack."""

    def __init__(self, report_dir: Path, committed: bool = True, delay: float = 0.05):
        self.report_dir, self.committed, self.delay = report_dir, committed, delay
        self.reports: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "FakeAgent":
        self.report_dir.mkdir(parents=True, exist_ok=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        seen = set()
        while not self._stop.is_set():
            for path in sorted(self.report_dir.glob("checkpoint-*.json")):
                if path.name.endswith(".ack.json") or path.name in seen:
                    continue
                seen.add(path.name)
                report = json.loads(path.read_text())
                self.reports.append(report)
                time.sleep(self.delay)
                ack = path.with_name(path.name[: -len(".json")] + ".ack.json")
                tmp = ack.with_name(ack.name + ".tmp")
                tmp.write_text(json.dumps({"committed": self.committed,
                                           "reason": "ok" if self.committed else "stale allocation"}))
                os.replace(tmp, ack)
            time.sleep(0.01)


# --- sequence numbers and write-once keys -------------------------------------------------------


def test_sequence_numbers_start_after_the_resume_point(tmp_path):
    ck = local(tmp_path)
    assert ck.resume_seq == 0 and ck.restore() is None
    first, second = ck.save(b"one", progress=1), ck.save(b"two", progress=2)
    assert (first.seq, second.seq) == (1, 2)
    assert first.key == f"{str(tmp_path).lstrip('/')}/ck/0000000001"
    assert first.uri == f"file://{tmp_path}/ck/0000000001"
    assert (tmp_path / "ck" / "0000000002").read_bytes() == b"two"
    assert first.committed is None and "no GPUSCHED_REPORT_DIR" in first.reason
    assert (first.size, first.md5, first.sha256) == (3, md5(b"one"), sha(b"one"))

    resumed = local(tmp_path, resume_from=second.uri, resume_seq=2)
    assert resumed.restore() == b"two"
    assert resumed.save(b"three").seq == 3
    # Without GPUSCHED_RESUME_SEQ the number comes from the URI.
    assert local(tmp_path, resume_from=second.uri).resume_seq == 2
    assert seq_key("checkpoints/job-1/", 4) == "checkpoints/job-1/0000000004"
    assert seq_key("", 4) == "0000000004"


def test_metadata_and_object_are_written_once(tmp_path):
    ck = local(tmp_path)
    ck.save(b"payload")
    meta = json.loads((tmp_path / "ck" / "0000000001.meta.json").read_text())
    assert meta == {"sha256": sha(b"payload"), "allocation-id": "alloc-1", "attempt": "1", "job-id": "job-1"}
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["0000000001", "0000000001.meta.json"]


def test_a_taken_number_refuses_the_writer_which_takes_the_next(tmp_path, caplog):
    # An earlier attempt wrote 4 (never committed); the new attempt resumes from committed 3.
    old = local(tmp_path, allocation_id="alloc-old", resume_from=f"file://{tmp_path}/ck/0000000003", resume_seq=3)
    assert old.save(b"zombie").seq == 4
    ck = local(tmp_path, allocation_id="alloc-new", attempt="2",
               resume_from=f"file://{tmp_path}/ck/0000000003", resume_seq=3)
    with caplog.at_level("WARNING", logger="jobkit"):
        result = ck.save(b"fresh bytes")
    assert (result.seq, result.refused) == (5, (4,))
    assert "taken" in caplog.text
    assert (tmp_path / "ck" / "0000000004").read_bytes() == b"zombie"  # never overwritten
    assert ck.save(b"next").seq == 6


class Counting:
    """A store that counts the writes asked of it, by key."""

    def __init__(self, inner):
        self.inner, self.writes = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def put_new(self, bucket, key, *args):
        self.writes.append(key.rsplit("/", 1)[1])
        return self.inner.put_new(bucket, key, *args)


@pytest.mark.parametrize("size, written", [
    (1000, ["0000000004", "0000000005"]),
    (jobkit.LOOK_FIRST_BYTES + 1, ["0000000005"]),
], ids=["a small checkpoint tries the taken number and is refused",
        "a big one looks the number up first and uploads nothing under it"])
def test_a_taken_number_costs_a_big_checkpoint_no_upload(tmp_path, size, written):
    three = f"file://{tmp_path}/ck/0000000003"
    local(tmp_path, allocation_id="alloc-old", resume_from=three, resume_seq=3).save(b"unusable, or uncommitted")
    ck = local(tmp_path, allocation_id="alloc-new", attempt="2", resume_from=three, resume_seq=3)
    store = ck._stores["file"] = Counting(ck._store("file"))
    result = ck.save(b"x" * size)
    assert (result.seq, result.refused, store.writes) == (5, (4,), written)
    assert (tmp_path / "ck" / "0000000005").stat().st_size == size


def test_a_big_checkpoint_whose_upload_answer_was_lost_is_looked_up_not_uploaded_again(tmp_path):
    """The store made the object but the answer never came (a timeout): asked again, the writer
    finds its own object. Before, it sent every byte again (twice the upload in the grace)."""
    class AnswerLost(Counting):
        def put_new(self, bucket, key, *args):
            made = super().put_new(bucket, key, *args)
            if len(self.writes) == 1:
                raise CheckpointStoreUnreachable("writing: read timeout")
            return made

    ck = local(tmp_path, grace_period=60, sleep=lambda s: None)
    store = ck._stores["file"] = AnswerLost(ck._store("file"))
    ck.request_stop()
    result = ck.save(b"x" * (jobkit.LOOK_FIRST_BYTES + 1))
    assert (result.seq, result.refused, store.writes) == (1, (), ["0000000001"])


def test_a_writer_without_ids_whose_answer_was_lost_finds_its_own_write_where_the_store_drops_empty_values(tmp_path):
    """S3 and SeaweedFS keep no metadata entry whose value is empty: a local run's writer (no
    allocation, attempt or job id) took its own write for another's and wrote it again under the
    next number."""
    class LikeS3(Counting):
        def put_new(self, bucket, key, *args):
            made = super().put_new(bucket, key, *args)
            if len(self.writes) == 1:
                raise CheckpointStoreUnreachable("writing: read timeout")  # made, its answer lost
            return made

        def head(self, bucket, key):
            kept = self.inner.head(bucket, key)
            return None if kept is None else {k: v for k, v in kept.items() if v != ""}

    ck = Checkpointer(f"file://{tmp_path}/ck/", grace_period=60, sleep=lambda s: None)
    store = ck._stores["file"] = LikeS3(ck._store("file"))
    ck.request_stop()
    result = ck.save(b"state")
    assert (result.seq, result.refused, set(store.writes)) == (1, (), {"0000000001"})  # asked again, refused, looked up
    assert not (tmp_path / "ck" / "0000000002").exists()


def test_a_save_s_copy_left_by_a_killed_process_is_removed_by_the_next_save_and_no_other(tmp_path):
    """A file:// save killed in its grace (SIGKILL) left its hidden full-size copy for good."""
    folder = tmp_path / "ck"
    folder.mkdir()
    gone = subprocess.Popen(["true"])
    gone.wait()
    host = jobkit._host()
    left = {
        "a killed save's": (folder / f".0000000003.{host}.{gone.pid}.k1ll3d.tmp", False),
        "a running save's": (folder / f".0000000004.{host}.{os.getpid()}.l1ve00.tmp", True),
        "another host's": (folder / f".0000000004.other-host-1.{gone.pid}.0th3r0.tmp", True),
    }
    for path, _ in left.values():
        path.write_bytes(b"x" * 100)
    assert local(tmp_path).save(b"next").seq == 1
    assert {what: path.exists() for what, (path, _) in left.items()} == {what: kept for what, (_, kept) in left.items()}
    assert sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp")) == sorted(
        path.name for path, kept in left.values() if kept)  # the save's own copy is gone too


def test_after_a_refusal_the_writer_jumps_past_every_taken_number(tmp_path):
    other = local(tmp_path, allocation_id="alloc-other")
    for i in range(30):  # more than the 20 tries one by one would allow
        other.save(b"x%d" % i)
    ck = local(tmp_path, allocation_id="alloc-mine")
    result = ck.save(b"mine")
    assert (result.seq, result.refused) == (31, (1,))


def test_the_writers_own_earlier_write_counts_as_written(tmp_path):
    # An HTTP retry after a lost response finds its own object: same bytes, same allocation.
    local(tmp_path).save(b"same")
    again = local(tmp_path).save(b"same")
    assert (again.seq, again.refused) == (1, ())


def test_the_number_of_tries_is_bounded(tmp_path):
    class Full:
        def part_size_for(self, size):
            return None

        def put_new(self, *a):
            return False

        def head(self, *a):
            return None

        def max_seq(self, *a):
            return None

    ck = local(tmp_path)
    ck._stores["file"] = Full()
    with pytest.raises(CheckpointError, match="no free checkpoint number after 20 tries"):
        ck.save(b"data")


def test_save_without_a_checkpoint_uri_does_nothing(tmp_path):
    ck = Checkpointer.from_env({})
    assert not ck.enabled and ck.restore() is None and not ck.due()
    assert ck.save(b"data") is None


@pytest.mark.parametrize("env, refused", [
    ({}, None),
    ({"RANK": "0"}, None),
    ({"GPUSCHED_NODE_RANK": "0", "GPUSCHED_NUM_NODES": "2"}, None),
    ({"RANK": "0", "GPUSCHED_NODE_RANK": "1"}, None),
    ({"RANK": "3"}, "rank 3 (RANK=3)"),
    ({"GPUSCHED_NODE_RANK": "1", "GPUSCHED_NUM_NODES": "2"}, "rank 1 (GPUSCHED_NODE_RANK=1)"),
    ({"RANK": "2", "GPUSCHED_NODE_RANK": "0"}, "rank 2 (RANK=2)"),
    ({"OMPI_COMM_WORLD_RANK": "0", "GPUSCHED_NODE_RANK": "1"}, None),
    ({"OMPI_COMM_WORLD_RANK": "2", "GPUSCHED_NODE_RANK": "0"}, "rank 2 (OMPI_COMM_WORLD_RANK=2)"),
    ({"PMI_RANK": "1"}, "rank 1 (PMI_RANK=1)"),
    ({"LOCAL_RANK": "0", "GPUSCHED_NODE_RANK": "0"}, None),
    ({"LOCAL_RANK": "1", "GPUSCHED_NODE_RANK": "0"}, "rank 1 (LOCAL_RANK=1)"),
    ({"OMPI_COMM_WORLD_LOCAL_RANK": "3"}, "rank 3 (OMPI_COMM_WORLD_LOCAL_RANK=3)"),
    ({"LOCAL_RANK": "0", "GPUSCHED_NODE_RANK": "1"}, "rank 1 (GPUSCHED_NODE_RANK=1)"),
], ids=["a job of one process", "the launcher's rank 0", "a gang's first machine",
        "the launcher's rank 0 on a gang's second machine (its rank is the process's own)",
        "another of the launcher's ranks", "a gang's second machine", "a local rank on a gang's first machine",
        "Open MPI's rank 0 on a gang's second machine", "another of Open MPI's ranks", "another of MPICH's ranks",
        "the first local process of a gang's first machine, no global rank",
        "another local process of a gang's first machine, no global rank",
        "another of Open MPI's local processes, no global rank",
        "the first local process of a gang's second machine, no global rank"])
@pytest.mark.parametrize("checkpoints", [True, False], ids=["checkpoints on", "checkpoints off"])
def test_only_rank_0_saves_and_any_other_rank_is_refused_before_it_writes(tmp_path, env, refused, checkpoints):
    uri = {"GPUSCHED_CHECKPOINT_URI": f"file://{tmp_path}/ck/"} if checkpoints else {}
    ck = Checkpointer.from_env({**env, **uri})
    assert ck.saves is (refused is None)
    if refused is None:
        result = ck.save(b"state")
        assert (result.seq if checkpoints else result) == (1 if checkpoints else None)
        return
    with pytest.raises(CheckpointError, match=rf"{re.escape(refused)}: .* rank 0 alone saves"):
        ck.save(b"state")
    assert not (tmp_path / "ck").exists()


@pytest.mark.parametrize("rank", [-1, 1.5, True, "0"])
def test_a_rank_given_in_code_that_is_no_whole_number_is_refused(tmp_path, rank):
    with pytest.raises(CheckpointError, match="rank must be a whole number >= 0"):
        local(tmp_path, rank=rank)


def test_a_file_can_be_saved_and_restored_as_a_file(tmp_path):
    src = tmp_path / "model.bin"
    src.write_bytes(os.urandom(3 * 1024 * 1024 + 7))
    saved = local(tmp_path).save(src)
    assert (saved.size, saved.sha256) == (src.stat().st_size, sha(src.read_bytes()))
    dest = local(tmp_path, resume_from=saved.uri).restore_to(tmp_path / "restored.bin")
    assert dest.read_bytes() == src.read_bytes()
    assert local(tmp_path).restore_to(tmp_path / "nothing.bin") is None
    assert not (tmp_path / "nothing.bin").exists()


@pytest.mark.parametrize("progress", [math.nan, math.inf, -math.inf])
def test_a_progress_that_is_no_finite_number_is_refused_before_anything_is_written(tmp_path, progress):
    """JSON and the control plane take no NaN: such a report could never be sent."""
    ck = local(tmp_path)
    with pytest.raises(CheckpointError, match="finite"):
        ck.save(b"data", progress=progress)
    assert not list((tmp_path / "ck").glob("0*"))


@pytest.mark.parametrize("data, progress, words", [
    ({"step": 3}, None, "takes the checkpoint as bytes .* not dict: serialize it first"),
    (None, None, "not NoneType"),
    ([1, 2], None, "not list"),
    (b"data", "x", "progress must be a finite number"),
    (b"data", [3], "progress must be a finite number"),
])
def test_a_save_of_what_is_no_checkpoint_is_a_checkpoint_error_not_a_traceback(tmp_path, data, progress, words):
    """A job that catches CheckpointError around its saves (as the bundled example does) must not
    die of a TypeError from deep inside the write."""
    with pytest.raises(CheckpointError, match=words):
        local(tmp_path).save(data, progress=progress)
    assert not list((tmp_path / "ck").glob("0*"))


@pytest.mark.parametrize("setting, value", [("interval", "abc"), ("interval", -5), ("grace_period", -1),
                                            ("phase", "noon")])
def test_settings_given_in_code_that_are_no_number_of_seconds_are_named(tmp_path, setting, value):
    with pytest.raises(CheckpointError, match=f"{setting} must be a number of seconds"):
        local(tmp_path, **{setting: value})


@pytest.mark.parametrize("restored, warned", [(False, True), (True, False)],
                         ids=["a save before the restore of a resumed attempt is warned of", "after it, not"])
def test_a_resumed_attempt_that_saves_without_restoring_is_warned_once(tmp_path, caplog, restored, warned):
    local(tmp_path).save(b"step 40")
    ck = local(tmp_path, resume_from=f"file://{tmp_path}/ck/0000000001", resume_seq=1)
    if restored:
        assert ck.restore() == b"step 40"
    ck.save(b"step 0")
    ck.save(b"step 1")
    said = [r for r in caplog.records if "has not restored it" in r.getMessage()]
    assert len(said) == (1 if warned else 0)


def test_a_full_local_disk_is_a_checkpoint_error_to_retry_later_not_a_raw_os_error(tmp_path, monkeypatch):
    import errno as errnos

    saved = local(tmp_path).save(b"weights")

    def full(*args, **kwargs):
        raise OSError(errnos.ENOSPC, "No space left on device")

    monkeypatch.setattr(jobkit.tempfile, "mkstemp", full)
    with pytest.raises(jobkit.CheckpointRetryLater, match="No space left"):
        local(tmp_path, resume_from=saved.uri).restore_to(tmp_path / "restored.bin")


def test_ranks_restoring_to_one_path_at_once_each_leave_whole_verified_bytes(tmp_path):
    """Local ranks of one job (torchrun's) restore to the same file together: each writes its own
    copy under a name of its own and renames it whole; no rank's bytes land in another's."""
    import threading

    data = os.urandom(2 * 1024 * 1024)
    saved = local(tmp_path).save(data)
    dest, errors = tmp_path / "state.bin", []

    def rank():
        try:
            assert local(tmp_path, resume_from=saved.uri).restore_to(dest) == dest
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    ranks = [threading.Thread(target=rank) for _ in range(4)]
    for t in ranks:
        t.start()
    for t in ranks:
        t.join()
    assert errors == [] and dest.read_bytes() == data
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("state.bin")) == ["state.bin"]


def test_ranks_writing_their_restart_report_at_once_leave_one_whole_report(tmp_path):
    """Every local rank writes restored.json as it gets its state back. Before, all wrote through
    one temporary name: one rank truncated the file another had just put in place, and the
    agent, unable to read it, lost the restart time (220 broken of 300 such rounds)."""
    import threading

    report = tmp_path / "restored.json"
    for round_ in range(40):
        start = threading.Barrier(8)

        def rank(k: int) -> None:
            start.wait()
            jobkit._write_json_atomic(report, {"seq": round_, "seconds": 10.0 ** k, "size": 1234})

        ranks = [threading.Thread(target=rank, args=(k,)) for k in range(8)]
        for t in ranks:
            t.start()
        for t in ranks:
            t.join()
        assert json.loads(report.read_text())["seq"] == round_
    assert [p.name for p in tmp_path.iterdir()] == ["restored.json"]


def test_a_restore_removes_the_copies_restores_killed_in_their_grace_left_and_no_other(tmp_path):
    """SIGKILL skips a restore's clean-up: each such copy is a whole checkpoint, and repeated
    preemptions during restores filled the disk. A live rank's copy under way is left alone, and
    so is another host's (a folder shared over the network: its pids are not this host's)."""
    saved = local(tmp_path).save(b"state")
    gone = subprocess.Popen(["true"])
    gone.wait()
    killed = tmp_path / f"state.bin.{jobkit._host()}.{gone.pid}.k1ll3d.partial"
    under_way = tmp_path / f"state.bin.{jobkit._host()}.{os.getpid()}.l1v3.partial"
    elsewhere = tmp_path / f"state.bin.another-host.{gone.pid}.sh4r3d.partial"  # a shared folder's
    for partial in (killed, under_way, elsewhere):
        partial.write_bytes(b"half a checkpoint")
    assert local(tmp_path, resume_from=saved.uri).restore_to(tmp_path / "state.bin").read_bytes() == b"state"
    assert not killed.exists() and under_way.exists() and elsewhere.exists()


@pytest.mark.parametrize("restore, launched, reported", [
    ("bytes", 990.0, {"seq": 1, "seconds": 10.0, "size": 5}),
    ("file", 990.0, {"seq": 1, "seconds": 10.0, "size": 5}),
    ("bytes", None, None),
    ("bytes", 1005.0, {"seq": 1, "seconds": 0.0, "size": 5}),
], ids=[
    "a restore reports the seconds from the launch to the state back",
    "a restore into a file reports them too",
    "without the launch time nothing is reported",
    "a launch time ahead of the job's clock reports no negative time",
])
def test_a_restore_reports_how_long_the_restart_took(tmp_path, restore, launched, reported):
    saved = local(tmp_path).save(b"state")
    ck = local(tmp_path, resume_from=saved.uri, report_dir=tmp_path / "r", launched_at=launched,
               clock=Clock(1000.0))
    ck.restore() if restore == "bytes" else ck.restore_to(tmp_path / "state.bin")
    report = tmp_path / "r" / "restored.json"
    assert (json.loads(report.read_text()) if report.exists() else None) == reported
    assert ck.restart_seconds == (None if reported is None else reported["seconds"])


def test_a_fresh_start_reports_no_restart(tmp_path):
    ck = local(tmp_path, report_dir=tmp_path / "r", launched_at=990.0)
    assert ck.restore() is None and not (tmp_path / "r" / "restored.json").exists()


# --- reports and acks --------------------------------------------------------------------------


def test_report_is_written_and_the_ack_awaited(tmp_path):
    reports = tmp_path / "reports"
    ck = local(tmp_path, report_dir=reports)
    with FakeAgent(reports) as agent:
        before = time.time()
        result = ck.save(b"weights", progress=17)
    assert (result.committed, result.reason) == (True, "ok")
    report = json.loads((reports / "checkpoint-0000000001.json").read_text())
    assert set(report) == {"seq", "key", "uri", "size", "md5", "sha256", "progress", "written_at"}
    assert report["seq"] == 1 and report["key"] == result.key and report["uri"] == result.uri
    assert (report["size"], report["md5"], report["sha256"]) == (7, md5(b"weights"), sha(b"weights"))
    assert report["progress"] == 17.0 and before <= report["written_at"] <= time.time()
    assert agent.reports == [report]
    assert not list(reports.glob("*.tmp"))


def test_a_report_says_when_the_save_was_asked_not_when_its_upload_ended(tmp_path, monkeypatch):
    """The control plane counts the work a checkpoint holds up to `written_at`: the upload's end
    counted its minutes (tens of GiB) as work done."""
    now = [1000.0]
    real_digest = jobkit._digest_of

    def slow_upload(*args, **kwargs):  # the bytes take 120 s to go up
        now[0] += 120.0
        return real_digest(*args, **kwargs)

    monkeypatch.setattr(jobkit, "_digest_of", slow_upload)
    reports = tmp_path / "reports"
    ck = local(tmp_path, report_dir=reports, clock=lambda: now[0])
    now[0] = 1500.0
    with FakeAgent(reports):
        ck.save(b"weights")
    assert json.loads((reports / "checkpoint-0000000001.json").read_text())["written_at"] == 1500.0


def test_a_refused_commit_is_returned(tmp_path):
    reports = tmp_path / "reports"
    ck = local(tmp_path, report_dir=reports)
    with FakeAgent(reports, committed=False):
        result = ck.save(b"weights")
    assert (result.committed, result.reason) == (False, "stale allocation")


def test_no_ack_in_time_is_unknown(tmp_path):
    ck = local(tmp_path, report_dir=tmp_path / "reports", ack_timeout=0.3)
    began = time.monotonic()
    result = ck.save(b"weights")
    assert 0.3 <= time.monotonic() - began < 2
    assert result.committed is None and "no ack" in result.reason


def test_the_ack_wait_never_outlasts_the_grace_period(tmp_path):
    # 2 s: the exit reserve is a tenth of the grace, and a tenth of a second was too little room
    # for a busy machine's scheduling (the suite runs in two processes on two cores).
    ck = local(tmp_path, report_dir=tmp_path / "reports", grace_period=2.0, ack_timeout=30)
    ck.request_stop()
    began = time.monotonic()
    result = ck.save(b"weights")
    waited = time.monotonic() - began
    assert result.committed is None and 1.5 <= waited < 2.0  # grace less the exit reserve (0.2 s)


# --- restoring ---------------------------------------------------------------------------------


def _tamper(tmp_path: Path, saved) -> dict:
    obj = tmp_path / "ck" / "0000000001"
    obj.chmod(0o644)
    obj.write_bytes(b"bad bytes!")
    return {}


def _strip_metadata(tmp_path: Path, saved) -> dict:
    (tmp_path / "ck" / "0000000001.meta.json").unlink()
    return {}


def _lose(tmp_path: Path, saved) -> dict:
    (tmp_path / "ck" / "0000000001").unlink()
    return {}


def _replace(tmp_path: Path, saved) -> dict:
    return {"resume_sha256": sha(b"another state")}  # the commit names other bytes than these


@pytest.mark.parametrize("spoil, words", [
    (_tamper, "is corrupted"),
    (_strip_metadata, "no sha256 metadata"),
    (_lose, "does not exist"),
    (_replace, "not the one committed"),
], ids=["bytes that do not match their sha256 are unusable",
        "an object without its sha256 cannot be verified, so it is unusable",
        "an object that is gone is unusable",
        "bytes that are not the ones committed are unusable"])
def test_an_unusable_resume_checkpoint_is_refused_and_reported_so_the_next_attempt_falls_back(tmp_path, spoil,
                                                                                             words):
    saved = local(tmp_path).save(b"good bytes")
    kw = spoil(tmp_path, saved)
    ck = local(tmp_path, resume_from=saved.uri, resume_seq=1, report_dir=tmp_path / "r", **kw)
    with pytest.raises(jobkit.CheckpointUnusable, match=words):
        ck.restore()
    report = json.loads((tmp_path / "r" / jobkit.UNUSABLE_REPORT).read_text())
    assert report["seq"] == 1 and words in report["reason"]


def test_metadata_that_cannot_be_read_now_does_not_make_the_checkpoint_unusable(tmp_path, monkeypatch):
    """An I/O error (EIO, a stale NFS handle) is the disk's, not the checkpoint's."""
    import errno

    saved = local(tmp_path).save(b"good bytes")
    read_text = Path.read_text

    def failing(path, *args, **kwargs):
        if path.name.endswith(".meta.json"):
            raise OSError(errno.EIO, "Input/output error")
        return read_text(path, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", failing)
    ck = local(tmp_path, resume_from=saved.uri, resume_seq=1, report_dir=tmp_path / "r")
    with pytest.raises(jobkit.CheckpointRetryLater):
        ck.restore()
    assert not (tmp_path / "r" / jobkit.UNUSABLE_REPORT).exists()


def test_restore_takes_the_committed_checkpoint(tmp_path):
    saved = Checkpointer(f"file://{tmp_path}/ck/").save(b"committed state")
    assert local(tmp_path, resume_from=saved.uri, resume_sha256=saved.sha256).restore() == b"committed state"


def test_bad_settings_are_named():
    with pytest.raises(CheckpointError, match="GPUSCHED_CHECKPOINT_INTERVAL"):
        Checkpointer.from_env({"GPUSCHED_CHECKPOINT_INTERVAL": "soon"})
    with pytest.raises(CheckpointError, match="GPUSCHED_RESUME_SEQ"):
        Checkpointer.from_env({"GPUSCHED_RESUME_SEQ": "three"})
    with pytest.raises(CheckpointError, match="only s3:// and file://"):
        Checkpointer.from_env({"GPUSCHED_CHECKPOINT_URI": "gs://bucket/x/"})
    with pytest.raises(CheckpointError, match="GPUSCHED_S3_PART_MB='4' must be a whole number >= 5"):
        Checkpointer.from_env({"GPUSCHED_S3_PART_MB": "4"})
    for threads in ("0", "many", "²"):  # '²'.isdigit() is true, and int('²') fails
        with pytest.raises(CheckpointError, match="GPUSCHED_S3_UPLOAD_THREADS"):
            Checkpointer.from_env({"GPUSCHED_S3_UPLOAD_THREADS": threads})
    with pytest.raises(CheckpointError, match="GPUSCHED_RESUME_SEQ"):
        Checkpointer.from_env({"GPUSCHED_RESUME_SEQ": "³"})
    for name in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "GPUSCHED_NODE_RANK", "LOCAL_RANK"):
        with pytest.raises(CheckpointError, match=f"{name}='-1' must be a whole number >= 0"):
            Checkpointer.from_env({name: "-1"})


def test_a_checkpoint_file_that_cannot_be_read_is_a_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError, match="cannot read the checkpoint file"):
        local(tmp_path).save(str(tmp_path / "missing.bin"))


@pytest.mark.parametrize("name, size, part", [
    ("an object of exactly two parts", 2 * 5 * MIB, 5 * MIB),
    ("an object one byte over a part", 5 * MIB + 1, 5 * MIB),
    ("parts that straddle the chunks the file is read in", 3 * 7 * MIB + 5, 7 * MIB),
])
def test_the_digest_hashes_each_part_as_s3_checks_it(tmp_path, name, size, part):
    data = noise(size)
    path = tmp_path / "state.bin"
    path.write_bytes(data)
    for source in (path, data):
        digest = jobkit._digest_of(source, part)
        assert digest.parts == [md5(data[i:i + part]) for i in range(0, size, part)], name
        assert (digest.size, digest.md5, digest.sha256) == (size, md5(data), sha(data)), name


@pytest.mark.parametrize("name, size, expected", [
    ("up to one part is a single PUT", 64 * MIB, None),
    ("a bigger object goes up in parts of the configured size", 64 * MIB + 1, 64 * MIB),
    ("past 10,000 parts the parts grow, in whole MiB", 1024**4, 105 * MIB),
])
def test_the_part_size_keeps_any_object_within_s3s_limits(name, size, expected):
    store = jobkit._S3Store(None, "key", "secret", None, part_mb=64)
    assert store.part_size_for(size) == expected, name
    if expected is not None:
        assert math.ceil(size / expected) <= 10_000, name


@pytest.mark.parametrize("name, env, error, words", [
    ("a store nobody listens at", {"GPUSCHED_S3_ENDPOINT": "http://127.0.0.1:1"}, CheckpointStoreUnreachable,
     "up and reachable"),
    ("an endpoint that is no URL", {"GPUSCHED_S3_ENDPOINT": "not a url"}, CheckpointError, "is not usable"),
])
def test_storage_trouble_is_a_checkpoint_error_naming_the_setting(name, env, error, words):
    ck = Checkpointer.from_env({"GPUSCHED_CHECKPOINT_URI": "s3://bucket/checkpoints/job-1/",
                                "GPUSCHED_S3_ACCESS_KEY": "key", "GPUSCHED_S3_SECRET_KEY": "secret", **env})
    with pytest.raises(error, match=words):
        ck.save(b"state")  # a scheduled save: it does not wait for the store


class Flaky:
    """A store that is unreachable for its first ``outages`` calls of each operation."""

    def __init__(self, inner, outages: int):
        self.inner, self.outages, self.calls = inner, outages, []

    def __getattr__(self, name):
        operation = getattr(self.inner, name)
        if name == "part_size_for":
            return operation

        def call(*args):
            self.calls.append(name)
            if self.calls.count(name) <= self.outages:
                raise CheckpointStoreUnreachable(f"{name}: connection refused")
            return operation(*args)

        return call


@pytest.mark.parametrize("name, stopping, outages, retry_for, outcome, pauses", [
    ("a restore waits out an outage", None, 2, 300, "restored", [1.0, 2.0]),
    ("a restore gives up once its patience is spent", None, 9, 10, "unreachable", [1.0, 2.0, 4.0]),
    ("a save after SIGTERM waits out an outage", 60, 2, 300, "saved", [1.0, 2.0]),
    ("a save after SIGTERM never waits past the grace", 2.5, 9, 300, "unreachable", [1.0]),
    ("a scheduled save does not wait", None, 1, 300, "unreachable", []),
    ("a restore that SIGTERM interrupts never waits past the grace", 2.5, 9, 300, "unreachable", [1.0]),
])
def test_an_unreachable_store_is_asked_again_where_waiting_is_worth_it(tmp_path, name, stopping, outages,
                                                                        retry_for, outcome, pauses):
    clock = [0.0]
    slept = []

    def sleep(seconds):
        if not slept and "SIGTERM interrupts" in name:
            ck.request_stop()  # the stop comes while the restore waits for the store
        slept.append(seconds)
        clock[0] += seconds

    kw = dict(monotonic=lambda: clock[0], sleep=sleep, s3_retry_for=retry_for)
    if name.startswith("a restore"):
        local(tmp_path).save(b"state")
        ck = local(tmp_path, resume_from=f"file://{tmp_path}/ck/0000000001", resume_seq=1, grace_period=stopping,
                   report_dir=tmp_path / "r", **kw)
        ck._stores["file"] = Flaky(ck._store("file"), outages)
        act = ck.restore
    else:
        ck = local(tmp_path, grace_period=stopping, **kw)
        ck._stores["file"] = Flaky(ck._store("file"), outages)
        if stopping is not None:
            ck.request_stop()
        act = lambda: ck.save(b"next")  # noqa: E731
    if outcome == "unreachable":
        with pytest.raises(CheckpointStoreUnreachable) as raised:
            act()
        # It says what it did: asked again for so long, or (a scheduled save) not at all.
        said = "not asked again" if not pauses else f"after asking again for {sum(pauses):.0f} s"
        assert said in str(raised.value), str(raised.value)
        # The store's fault, not the checkpoint's: it is not reported unusable.
        assert not (tmp_path / "r" / jobkit.UNUSABLE_REPORT).exists()
    else:
        assert act() is not None
    # A restore's pauses are slept a second at a time: a stop meanwhile may bring its deadline forward.
    assert slept == ([1.0] * round(sum(pauses)) if name.startswith("a restore") else pauses), (name, slept)


def test_from_env_reads_the_agents_variables(tmp_path):
    ck = Checkpointer.from_env({
        "GPUSCHED_JOB_ID": "j", "GPUSCHED_ALLOCATION_ID": "42", "GPUSCHED_ATTEMPT": "3",
        "GPUSCHED_GRACE_PERIOD": "30", "GPUSCHED_CHECKPOINT_URI": f"file://{tmp_path}/ck/",
        "GPUSCHED_RESUME_FROM": f"file://{tmp_path}/ck/0000000007", "GPUSCHED_RESUME_SEQ": "7",
        "GPUSCHED_CHECKPOINT_INTERVAL": "600", "GPUSCHED_CHECKPOINT_PHASE": "120",
        "GPUSCHED_REPORT_DIR": str(tmp_path / "r"), "GPUSCHED_LAUNCHED_AT": "1700000000.25",
    })
    assert (ck.job_id, ck.allocation_id, ck.attempt, ck.grace_period) == ("j", "42", "3", 30.0)
    assert ck.launched_at == 1700000000.25
    assert (ck.resume_seq, ck.next_seq, ck.interval, ck.phase) == (7, 8, 600.0, 120.0)
    assert ck.report_dir == tmp_path / "r" and ck.resuming


# --- the schedule --------------------------------------------------------------------------------


class Clock:
    def __init__(self, t: float):
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_due_follows_the_phase_on_the_wall_clock(tmp_path):
    clock = Clock(1000.0)
    ck = local(tmp_path, interval=10, phase=3, clock=clock)
    # Times t = 3 (mod 10); the first at least half an interval after the start (1000 + 5).
    assert ck.next_due() == 1013
    clock.t = 1012.9
    assert not ck.due()
    clock.t = 1013.0
    assert ck.due()
    clock.t = 1013.4
    ck.save(b"a")
    assert not ck.due() and ck.next_due() == 1023
    clock.t = 1029.0  # late (a long step): the save at 1029 puts the next at 1043, not 1033
    assert ck.due()
    ck.save(b"b")
    assert ck.next_due() == 1043


def test_due_without_a_phase_counts_from_the_start(tmp_path):
    clock = Clock(1001.5)
    ck = local(tmp_path, interval=10, clock=clock)
    assert ck.next_due() == 1011.5
    clock.t = 1011.4
    assert not ck.due()
    clock.t = 1011.5
    assert ck.due()


def test_a_rank_that_does_not_save_is_due_at_the_times_rank_0_is_not_at_every_step_after_the_first(tmp_path):
    """Before, no save moved its reference on: after the first scheduled time it was due at every
    step, and a gather under `if ck.due()` fell out of step with rank 0's (a hang in the collective)."""
    clock = Clock(1000.0)
    first, other = (local(tmp_path, interval=60, phase=0, clock=clock, rank=rank) for rank in (0, 1))
    seen = {0: [], 1: []}
    for t in range(1000, 1200, 10):
        clock.t = float(t)
        for ck, said in ((first, seen[0]), (other, seen[1])):
            if ck.due():
                said.append(t)
                if ck.saves:
                    ck.save(b"state")
    assert seen[0] == seen[1] == [1080, 1140]


def test_never_due_without_an_interval(tmp_path):
    clock = Clock(1000.0)
    ck = local(tmp_path, interval=0, clock=clock)
    clock.t = 1e9
    assert ck.next_due() is None and not ck.due()


# --- SIGTERM -------------------------------------------------------------------------------------


def test_sigterm_sets_stop_requested_and_starts_the_grace_clock(tmp_path):
    ck = local(tmp_path, grace_period=30)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        ck.handle_sigterm()
        assert not ck.stop_requested and ck.seconds_left() == math.inf
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 2
        while not ck.stop_requested and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ck.stop_requested
        assert 29 < ck.seconds_left() <= 30
        os.kill(os.getpid(), signal.SIGTERM)  # a second SIGTERM does not restart the clock
        time.sleep(0.05)
        assert ck.seconds_left() < 30
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert EXIT_STOPPED == 143  # 128 + SIGTERM: never 0, which says the job is done


@pytest.mark.parametrize("order, left", [
    (None, 30),
    ({"grace_period": 300, "deadline": 1300.0}, 300),
    ({"grace_period": 5, "deadline": 1005.0}, 5),
    ({"grace_period": "soon"}, 30),
], ids=["without a stop order the launch's grace stands", "an order's longer grace is followed",
        "an order's shorter grace is followed", "a stop order that cannot be read is ignored"])
def test_after_sigterm_the_grace_follows_the_agents_stop_order(tmp_path, order, left):
    clock, ticks = Clock(1000.0), Clock(50.0)
    ck = local(tmp_path, grace_period=30, report_dir=tmp_path / "r", clock=clock, monotonic=ticks)
    (tmp_path / "r").mkdir()
    if order is not None:
        (tmp_path / "r" / jobkit.STOP_ORDER).write_text(json.dumps(order))
    assert ck.seconds_left() == math.inf  # no stop asked yet: the order is not looked at
    ck.request_stop()
    assert ck.seconds_left() == left


# --- real S3 ---------------------------------------------------------------------------------


def s3_env(servers, prefix: str, **extra: str) -> dict:
    return {
        "GPUSCHED_CHECKPOINT_URI": f"s3://{servers.s3_bucket}/{prefix}/",
        "GPUSCHED_S3_ENDPOINT": servers.s3_endpoint, "GPUSCHED_S3_ACCESS_KEY": servers.s3_access_key,
        "GPUSCHED_S3_SECRET_KEY": servers.s3_secret_key, "GPUSCHED_S3_REGION": servers.s3_region,
        "GPUSCHED_JOB_ID": "job-live", **extra,
    }


@pytest.mark.live
def test_s3_conditional_writes_metadata_and_restore(live_servers):
    prefix = f"checkpoints/jobkit-{uuid.uuid4().hex[:8]}"
    s3 = live_servers.s3_client()
    bucket = live_servers.s3_bucket

    first = Checkpointer.from_env(s3_env(live_servers, prefix, GPUSCHED_ALLOCATION_ID="11", GPUSCHED_ATTEMPT="1"))
    saved = first.save(b"state one", progress=1)
    assert (saved.seq, saved.key) == (1, f"{prefix}/0000000001")
    assert saved.uri == f"s3://{bucket}/{prefix}/0000000001"
    head = s3.head_object(Bucket=bucket, Key=saved.key)
    assert head["ETag"].strip('"') == md5(b"state one") == saved.md5
    assert head["ContentLength"] == 9
    assert head["Metadata"] == {"sha256": sha(b"state one"), "allocation-id": "11", "attempt": "1",
                                "job-id": "job-live"}

    # A second writer (another allocation) is refused number 1 and takes 2; 1 is untouched.
    second = Checkpointer.from_env(s3_env(live_servers, prefix, GPUSCHED_ALLOCATION_ID="12", GPUSCHED_ATTEMPT="2"))
    other = second.save(b"state two")
    assert (other.seq, other.refused) == (2, (1,))
    assert s3.get_object(Bucket=bucket, Key=saved.key)["Body"].read() == b"state one"

    resumed = Checkpointer.from_env(s3_env(live_servers, prefix, GPUSCHED_RESUME_FROM=other.uri,
                                           GPUSCHED_RESUME_SEQ="2"))
    assert resumed.restore() == b"state two"
    assert resumed.save(b"state three").seq == 3

    # An object whose bytes do not match its sha256 metadata is refused.
    bad_key = f"{prefix}/0000000009"
    s3.put_object(Bucket=bucket, Key=bad_key, Body=b"tampered", Metadata={"sha256": sha(b"original")})
    with pytest.raises(jobkit.CheckpointUnusable, match="corrupted"):
        Checkpointer.from_env(s3_env(live_servers, prefix, GPUSCHED_RESUME_FROM=f"s3://{bucket}/{bad_key}")).restore()
    # One that is gone is unusable too; a bucket that is not there, or credentials the store does
    # not take, say nothing of the checkpoint: the machine is refused, at once, and says so.
    with pytest.raises(jobkit.CheckpointUnusable, match="does not exist"):
        Checkpointer.from_env(s3_env(live_servers, prefix,
                                     GPUSCHED_RESUME_FROM=f"s3://{bucket}/{prefix}/0000000042")).restore()
    for wrong in (dict(GPUSCHED_RESUME_FROM=f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/k/0000000001"),
                  dict(GPUSCHED_RESUME_FROM=other.uri, GPUSCHED_S3_SECRET_KEY="not-the-secret")):
        began = time.monotonic()
        with pytest.raises(jobkit.CheckpointStoreRefused, match="check this machine's GPUSCHED_S3_ENDPOINT"):
            Checkpointer.from_env(s3_env(live_servers, prefix, **wrong)).restore()
        assert time.monotonic() - began < 10, wrong  # not asked again for GPUSCHED_S3_RETRY_S


@pytest.mark.live
def test_a_checkpoint_bigger_than_a_part_goes_up_in_parts_and_is_still_written_once(live_servers, tmp_path):
    prefix = f"checkpoints/jobkit-{uuid.uuid4().hex[:8]}"
    s3, bucket = live_servers.s3_client(), live_servers.s3_bucket
    data = noise(12 * MIB + 3)
    source = tmp_path / "state.bin"
    source.write_bytes(data)
    parts = dict(GPUSCHED_S3_PART_MB="5", GPUSCHED_S3_UPLOAD_THREADS="2")

    saved = Checkpointer.from_env(s3_env(live_servers, prefix, GPUSCHED_ALLOCATION_ID="11", **parts)).save(str(source))
    head = s3.head_object(Bucket=bucket, Key=saved.key)
    assert head["ETag"].strip('"').endswith("-3")  # three parts: 5, 5 and 2 MiB
    assert (head["ContentLength"], head["Metadata"]["sha256"]) == (len(data), sha(data))

    # The completion is the conditional write: a second writer is refused number 1 and takes 2.
    other = Checkpointer.from_env(s3_env(live_servers, prefix, GPUSCHED_ALLOCATION_ID="12", **parts)).save(data[::-1])
    assert (other.seq, other.refused) == (2, (1,))
    assert s3.head_object(Bucket=bucket, Key=saved.key)["Metadata"]["sha256"] == sha(data)
    assert s3.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads") is None

    back = Checkpointer.from_env(s3_env(live_servers, prefix, GPUSCHED_RESUME_FROM=saved.uri,
                                        GPUSCHED_RESUME_SHA256=saved.sha256))
    assert back.restore_to(tmp_path / "back.bin").read_bytes() == data


@pytest.mark.live
def test_a_multipart_save_whose_completion_answer_was_lost_finds_its_own_object(live_servers):
    """The store made the object, the answer was lost, and the resent completion was told the
    upload is gone (NoSuchUpload: a store that forgets completed uploads). Before, the save
    failed, though its checkpoint was written: the last one in a grace, lost."""
    from botocore.exceptions import ClientError

    prefix = f"checkpoints/jobkit-{uuid.uuid4().hex[:8]}"
    ck = Checkpointer.from_env(s3_env(live_servers, prefix, GPUSCHED_ALLOCATION_ID="11", GPUSCHED_S3_PART_MB="5"))

    def answer_lost(**kwargs):
        raise ClientError({"Error": {"Code": "NoSuchUpload", "Message": "The specified upload does not exist"},
                           "ResponseMetadata": {"HTTPStatusCode": 404}}, "CompleteMultipartUpload")

    ck._store("s3")._client.meta.events.register("after-call.s3.CompleteMultipartUpload", answer_lost)
    saved = ck.save(noise(11 * MIB))
    assert (saved.seq, saved.refused) == (1, ())
    head = live_servers.s3_client().head_object(Bucket=live_servers.s3_bucket, Key=saved.key)
    assert head["Metadata"]["sha256"] == saved.sha256


class BrokenBody:
    """A GET's body that fails mid-stream as a TLS connection does (urllib3's own error, which
    botocore does not wrap)."""

    def read(self, size):
        from urllib3.exceptions import SSLError

        raise SSLError("decryption failed or bad record mac")


def test_a_restore_cut_by_a_tls_error_mid_stream_is_an_unreachable_store_not_a_traceback(tmp_path):
    ck = Checkpointer("s3://bucket/ck/", allocation_id="a", attempt="2", job_id="j", resume_from="s3://bucket/ck/0000000001",
                      resume_seq=1, s3_endpoint="http://127.0.0.1:1", s3_retry_for=0)
    store = ck._store("s3")
    store._client = SimpleNamespace(get_object=lambda **kw: {"Body": BrokenBody(), "ContentLength": 5})
    with pytest.raises(CheckpointStoreUnreachable, match="decryption failed"):
        ck.restore()


@pytest.mark.parametrize("env, words", [
    ({"GPUSCHED_S3_ACCESS_KEY": "key-only"}, "give both GPUSCHED_S3_ACCESS_KEY and GPUSCHED_S3_SECRET_KEY"),
    ({"GPUSCHED_S3_PART_MB": "6000"}, "at most 5120 MiB"),
], ids=["a key without its secret", "parts bigger than S3 takes"])
def test_an_s3_setting_no_store_can_use_is_a_checkpoint_error_naming_it(env, words):
    """Before: botocore's own error escaped (not a CheckpointError), or every big save failed."""
    with pytest.raises(CheckpointError, match=words):
        Checkpointer.from_env({"GPUSCHED_CHECKPOINT_URI": "s3://bucket/ck/", "GPUSCHED_S3_ENDPOINT": "http://127.0.0.1:1",
                               **env}).save(b"state")


def test_a_file_that_changes_while_it_is_saved_to_a_folder_is_refused_and_nothing_kept(tmp_path, monkeypatch):
    """As the S3 store refuses it (below). Before, the folder kept the new bytes under the old
    hash, and the restore found the checkpoint corrupted."""
    source = tmp_path / "state.bin"
    source.write_bytes(noise(3 * MIB))
    hashed = jobkit._digest_of

    def then_changed(src, part_size=None):
        digest = hashed(src, part_size)
        with open(source, "r+b") as f:
            f.seek(2 * MIB)
            f.write(b"later bytes")
        return digest

    monkeypatch.setattr(jobkit, "_digest_of", then_changed)
    with pytest.raises(CheckpointError, match="changed while it was saved"):
        local(tmp_path).save(str(source))
    assert os.listdir(tmp_path / "ck") == []


@pytest.mark.live
def test_a_file_that_changes_while_it_is_saved_is_refused_and_its_upload_aborted(live_servers, tmp_path,
                                                                                 monkeypatch):
    prefix = f"checkpoints/jobkit-{uuid.uuid4().hex[:8]}"
    s3, bucket = live_servers.s3_client(), live_servers.s3_bucket
    source = tmp_path / "state.bin"
    source.write_bytes(noise(11 * MIB))
    hashed = jobkit._digest_of

    def then_changed(src, part_size=None):
        digest = hashed(src, part_size)
        with open(source, "r+b") as f:  # the training loop writes on after the hash was taken
            f.seek(7 * MIB)
            f.write(b"later bytes")
        return digest

    monkeypatch.setattr(jobkit, "_digest_of", then_changed)
    ck = Checkpointer.from_env(s3_env(live_servers, prefix, GPUSCHED_S3_PART_MB="5"))
    with pytest.raises(CheckpointError, match="BadDigest"):
        ck.save(str(source))
    assert s3.list_objects_v2(Bucket=bucket, Prefix=prefix).get("KeyCount") == 0
    assert s3.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads") is None


class Forwarder:
    """A TCP port that forwards to ``target`` once ``opened``: a store that comes back."""

    def __init__(self, target: int):
        import socket
        import socketserver

        class Pipe(socketserver.BaseRequestHandler):
            def handle(self):
                upstream = socket.create_connection(("127.0.0.1", target))

                def pump(a, b):
                    try:
                        while data := a.recv(65536):
                            b.sendall(data)
                    except OSError:
                        pass
                    finally:
                        b.close()

                back = threading.Thread(target=pump, args=(upstream, self.request), daemon=True)
                back.start()
                pump(self.request, upstream)
                back.join(5)

        from workers.servers import free_port

        self.port = free_port()
        self._make = lambda: socketserver.ThreadingTCPServer(("127.0.0.1", self.port), Pipe)
        self.server = None

    def open(self) -> None:
        self.server = self._make()
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()


@pytest.mark.live
def test_a_restore_rides_out_a_checkpoint_store_that_is_down_for_a_while(live_servers):
    from urllib.parse import urlparse

    prefix = f"checkpoints/jobkit-{uuid.uuid4().hex[:8]}"
    saved = Checkpointer.from_env(s3_env(live_servers, prefix)).save(b"state before the outage")
    store = Forwarder(urlparse(live_servers.s3_endpoint).port)
    back = threading.Timer(3.0, store.open)
    began = time.monotonic()
    back.start()
    try:
        resumed = Checkpointer.from_env(s3_env(live_servers, prefix, GPUSCHED_RESUME_FROM=saved.uri,
                                               GPUSCHED_S3_ENDPOINT=f"http://127.0.0.1:{store.port}"))
        assert resumed.restore() == b"state before the outage"
        assert time.monotonic() - began >= 3.0
    finally:
        back.cancel()
        store.close()


@pytest.mark.parametrize("name, error, unreachable", [
    ("no connection", "EndpointConnectionError(endpoint_url='http://s3')", True),
    ("a read timeout", "ReadTimeoutError(endpoint_url='http://s3')", True),
    ("a response cut off", "ResponseStreamingError(error='reset')", True),
    ("a bad certificate", "SSLError(endpoint_url='https://s3', error='certificate verify failed')", False),
    ("a parameter this boto3 does not know", "ParamValidationError(report='Unknown parameter IfNoneMatch')", False),
    ("no credentials", "NoCredentialsError()", False),
])
def test_only_errors_that_may_pass_are_taken_for_an_unreachable_store(name, error, unreachable):
    from botocore import exceptions

    store = jobkit._S3Store(None, "key", "secret", None)
    failure = store._failure("writing x", eval(error, vars(exceptions)))
    assert isinstance(failure, CheckpointStoreUnreachable) == unreachable, name
    assert ("up and reachable" in str(failure)) == unreachable, name


@pytest.mark.parametrize("status, code, taken_for", [
    (503, "SlowDown", "unreachable"), (500, "InternalError", "unreachable"), (502, "BadGateway", "unreachable"),
    (501, "NotImplemented", "an error"), (400, "InvalidRequest", "an error"),
    (403, "AccessDenied", "refused"), (403, "InvalidAccessKeyId", "refused"), (403, "SignatureDoesNotMatch", "refused"),
    (404, "NoSuchBucket", "refused"), (400, "ExpiredToken", "refused"),
])
def test_only_server_answers_that_may_pass_are_taken_for_an_unreachable_store(status, code, taken_for):
    """And those that refuse the machine (its credentials, its bucket) are neither the job's fault
    nor worth asking again: refused (queued again elsewhere), where the job failed as its own."""
    from botocore.exceptions import ClientError

    store = jobkit._S3Store(None, "key", "secret", None)
    error = ClientError({"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")
    failure = store._failure("writing x", error)
    kind = {CheckpointStoreUnreachable: "unreachable", jobkit.CheckpointStoreRefused: "refused"}.get(type(failure))
    assert (kind or "an error") == taken_for
    assert ("GPUSCHED_S3_ACCESS_KEY" in str(failure)) == (taken_for == "refused")


def test_a_memoryview_of_wider_items_goes_up_in_parts_by_byte():
    import array

    data = array.array("f", range(3 * 1024 * 1024))  # 12 MiB of 4-byte items
    view = memoryview(data)
    digest = jobkit._digest_of(view, 5 * MIB)
    raw = data.tobytes()
    parts = [jobkit._read_part(view, offset, min(5 * MIB, len(raw) - offset)) for offset in range(0, len(raw), 5 * MIB)]
    assert b"".join(parts) == raw and [md5(p) for p in parts] == digest.parts


def test_bytes_in_memory_are_hashed_and_cut_in_parts_without_a_copy_of_the_whole():
    """A checkpoint of tens of GiB in a bytearray or an array must not be held twice."""
    import array

    for buffer in (bytearray(b"abcd" * 1024), array.array("f", range(1024))):
        given = buffer if isinstance(buffer, bytearray) else memoryview(buffer)
        view = jobkit._by_byte(given)
        assert view.obj is buffer and view.nbytes == memoryview(buffer).nbytes  # a view of it, by byte
    data = bytearray(os.urandom(3 * MIB + 5))
    digest = jobkit._digest_of(data, MIB)
    assert (digest.size, digest.sha256) == (len(data), sha(bytes(data)))


@pytest.mark.parametrize("folder", ["run#1", "a?b", "x%2Fy", "plain"])
def test_a_plain_path_is_a_path_and_the_uri_a_save_reports_leads_back_to_it(tmp_path, folder):
    """Two jobs in run#1/ and run#2/ once both wrote into run/: the path was parsed as a URL."""
    where = tmp_path / folder / "ck"
    saved = Checkpointer(f"{where}/", allocation_id="a", attempt="1", job_id="j").save(b"weights")
    assert sorted(p.name for p in where.iterdir() if not p.name.startswith(".")) == ["0000000001", "0000000001.meta.json"]
    again = Checkpointer(f"{where}/", allocation_id="a", attempt="2", job_id="j", resume_from=saved.uri)
    assert again.restore() == b"weights"


@pytest.mark.parametrize("uri", ["file:///tmp/run#1/ck/", "file:///tmp/a?b/ck/"])
def test_a_file_uri_with_a_query_or_fragment_is_refused(uri):
    with pytest.raises(CheckpointError, match="percent-encode"):
        Checkpointer(uri, allocation_id="a", attempt="1", job_id="j")


@pytest.fixture
def silent_store():
    """A checkpoint store's address that takes connections and never answers: a hung gateway, a
    stopped server. Yields its endpoint; closes what it took."""
    import socket

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    taken = []

    def take():
        with contextlib.suppress(OSError):
            while True:
                taken.append(server.accept()[0])

    threading.Thread(target=take, daemon=True).start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    server.close()
    for conn in taken:
        conn.close()


# (sentence, what the job does, when its stop comes: None before the call, else seconds into it)
HUNG_CALLS = [
    ("a save after SIGTERM", "save", None),
    ("a scheduled save when SIGTERM comes during it", "save", 0.5),
    ("a restore when SIGTERM comes during it", "restore", 0.5),
]


@pytest.mark.parametrize("sentence, does, stop_after", HUNG_CALLS, ids=[row[0] for row in HUNG_CALLS])
def test_a_store_that_never_answers_is_given_up_before_the_grace_period_ends(silent_store, sentence, does, stop_after):
    """Before, the grace deadline was looked at between store calls only, and one call waited out
    botocore's timeouts and retries: 12 minutes, past SIGKILL, with nothing saved or said."""
    grace = 2.0
    settings = dict(grace_period=grace, s3_endpoint=silent_store, s3_access_key="a", s3_secret_key="b",
                    allocation_id="1", attempt="1", job_id="j")
    if does == "restore":
        ck = Checkpointer("s3://b/ck/", resume_from="s3://b/ck/0000000001", resume_seq=1, **settings)
        act = ck.restore
    else:
        ck = Checkpointer("s3://b/ck/", **settings)
        act = lambda: ck.save(b"state")  # noqa: E731
    if stop_after is None:
        ck.request_stop()
    else:
        threading.Timer(stop_after, ck.request_stop).start()  # as SIGTERM's handler would
    began = time.monotonic()
    with pytest.raises(CheckpointStoreUnreachable, match="had not answered when the grace period ran out"):
        act()
    took = time.monotonic() - began
    assert took <= (stop_after or 0) + grace, took  # the grace's reserve for exiting is left over


@pytest.fixture
def store_that_hangs_on_parts():
    """An S3 endpoint that starts multipart uploads and then never answers a part. Yields it."""
    import http.server

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # CreateMultipartUpload (and an abort's or completion's POST: never reached)
            body = (b'<?xml version="1.0" encoding="UTF-8"?><InitiateMultipartUploadResult>'
                    b"<Bucket>b</Bucket><Key>k</Key><UploadId>u1</UploadId></InitiateMultipartUploadResult>")
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_PUT(self):  # UploadPart: the body is taken, no answer comes
            time.sleep(60)

        do_DELETE = do_PUT

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_job_whose_save_in_parts_is_given_up_at_the_end_of_its_grace_can_still_exit(store_that_hangs_on_parts):
    """The parts went up on an executor's threads, which Python joins at exit: the job called
    sys.exit(143) after the save was given up, and lived on until SIGKILL, its shutdown skipped."""
    job = textwrap.dedent(f"""
        import sys
        from jobkit import Checkpointer, CheckpointStoreUnreachable
        ck = Checkpointer("s3://b/ck/", s3_endpoint={store_that_hangs_on_parts!r}, s3_access_key="a",
                          s3_secret_key="b", allocation_id="1", attempt="1", job_id="j", grace_period=2,
                          s3_part_mb=5)
        ck.request_stop()
        try:
            ck.save(bytes(12 * 1024 * 1024))
        except CheckpointStoreUnreachable as e:
            print("given up:", e, flush=True)
        sys.exit(143)
    """)
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-c", job], capture_output=True, text=True, timeout=30)
    assert done.returncode == 143 and "given up" in done.stdout, (done.stdout, done.stderr[-2000:])
    assert time.monotonic() - began < 15
