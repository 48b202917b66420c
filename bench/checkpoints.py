"""Benchmark the checkpoint commit on the embedded servers: what a checkpoint costs beyond
writing its bytes.

    python bench/checkpoints.py [--count 20] [--sizes-mb 1,16,64]

For each size, ``--count`` checkpoints of one running job are written to SeaweedFS with a
conditional put (the job's cost) and then committed (the control plane's: a HEAD to verify size,
MD5 and SHA-256, and one Postgres transaction with the fence, plus deleting superseded ones).
The last line printed is one JSON object: per size, the write and commit times (p50/p95).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from activities.checkpoints import CheckpointCommitter, checkpoint_prefix, s3_client  # noqa: E402
from activities.store import GpuReport, Store  # noqa: E402
from scheduler.sim.report import percentile  # noqa: E402
from scheduler.cycle import run_cycle  # noqa: E402
from scheduler.models import Machine, Quota  # noqa: E402
from workers import devstack  # noqa: E402
from workflows.types import CheckpointReport, EndReason, JobRequest, JobState  # noqa: E402


async def measure(settings, sizes_mb: list[int], count: int) -> dict:
    store = await Store.connect(settings.pg_dsn)
    s3 = s3_client(settings.s3_endpoint, settings.s3_access_key, settings.s3_secret_key, settings.s3_region)
    committer = CheckpointCommitter(store, s3, settings.s3_bucket)
    machine = Machine(id="c1/b0/r0/m0", cluster="c1", block="b0", rack="r0", gpus=1, gpu_type="H100")
    await store.register_fleet("c1", [machine])
    await store.set_quota("bench", Quota(guaranteed=0))
    figures = {}
    for n, size_mb in enumerate(sizes_mb):
        job = f"bench-ckpt-{size_mb}mb"
        await store.machine_heartbeat(machine.id, 1, [GpuReport(index=0)])
        await store.admit(JobRequest(job_id=job, team="bench", num_gpus=1, command=["true"]))
        alloc = (await store.plan_cycle("c1", n + 1, run_cycle)).placements[0].signal.allocation_id
        await store.start_attempt(job, alloc)
        writes, commits = [], []
        for seq in range(1, count + 1):
            data = os.urandom(size_mb * 1024 * 1024)
            key = f"{checkpoint_prefix(job)}{seq:010d}"
            began = time.perf_counter()
            sha256, md5 = hashlib.sha256(data).hexdigest(), hashlib.md5(data).hexdigest()
            await asyncio.to_thread(s3.put_object, Bucket=settings.s3_bucket, Key=key, Body=data,
                                    IfNoneMatch="*", Metadata={"sha256": sha256})
            written = time.perf_counter()
            ack = await committer.commit(job, alloc, CheckpointReport(seq=seq, key=key, size=len(data),
                                                                      sha256=sha256, md5=md5))
            committed = time.perf_counter()
            assert ack.committed, ack.reason
            writes.append(written - began)
            commits.append(committed - written)
        figures[f"{size_mb}mb"] = {
            "write_p50_ms": round(percentile(writes, 50) * 1000, 1),
            "write_p95_ms": round(percentile(writes, 95) * 1000, 1),
            "commit_p50_ms": round(percentile(commits, 50) * 1000, 1),
            "commit_p95_ms": round(percentile(commits, 95) * 1000, 1),
        }
        await store.end_attempt(job, alloc, EndReason.completed, 0, JobState.succeeded, "done")
    await store.close()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=20)
    parser.add_argument("--sizes-mb", default="1,16,64")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes_mb.split(",")]
    with tempfile.TemporaryDirectory(prefix="gpusched-bench-") as tmp:
        try:
            up = devstack.up(Path(tmp) / "stack", machines=0, workers=False, ui=False, fast=True)
            figures = asyncio.run(measure(up.settings, sizes, args.count))
        finally:
            devstack.down(Path(tmp) / "stack")
    for size, f in figures.items():
        print(f"{size:>6}: write p50 {f['write_p50_ms']} ms p95 {f['write_p95_ms']} ms; "
              f"commit p50 {f['commit_p50_ms']} ms p95 {f['commit_p95_ms']} ms", file=sys.stderr)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
