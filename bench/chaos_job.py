"""The job `bench/chaos.py` runs: the bundled example job (checkpoints through jobkit, resumes, ends
with the state of an uninterrupted run) that sleeps instead of burning a CPU, so that a dozen of
them fit beside the stack on a two-core machine, and that stamps the time into a file of its own
four times a second while it lives, so that the bench can tell from the processes' side whether
two of them ever ran on one GPU at once.

    python bench/chaos_job.py STAMPS_DIR --steps N --step-seconds S ...   (example-job's arguments)

The stamp file is ``STAMPS_DIR/<job>.<attempt>.<pid>``: a JSON line (job, attempt, allocation,
machine, GPUs, the process's start time from /proc) and then one epoch time per line. The start
and the last stamp (plus one stamp's interval, which the process may have lived past it) bound
the process's life from inside, so an overlap seen in them is most likely one that happened.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workers import example_job  # noqa: E402

STAMP_EVERY_S = 0.25


def started_at() -> float:
    """When this process began, as an epoch time (to 10 ms): its first stamp comes only after the
    interpreter has started and imported, a blind spot of a few tenths of a second."""
    ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


def stamp_forever(path: Path) -> None:
    env = os.environ
    head = {"job": env.get("GPUSCHED_JOB_ID"), "attempt": env.get("GPUSCHED_ATTEMPT"),
            "allocation": env.get("GPUSCHED_ALLOCATION_ID"), "machine": env.get("GPUSCHED_MACHINE_ID"),
            "gpus": env.get("GPUSCHED_GPUS", "").split(), "started": round(started_at(), 3)}
    with open(path, "a", buffering=1) as out:
        out.write(json.dumps(head) + "\n")
        while True:
            out.write(f"{time.time():.3f}\n")
            time.sleep(STAMP_EVERY_S)


def main(argv: list[str]) -> int:
    stamps = Path(argv[0])
    stamps.mkdir(parents=True, exist_ok=True)
    name = f"{os.environ.get('GPUSCHED_JOB_ID', 'job')}.{os.environ.get('GPUSCHED_ATTEMPT', '0')}.{os.getpid()}"
    threading.Thread(target=stamp_forever, args=(stamps / name,), daemon=True).start()
    # Sleep through a step's work instead of hashing: the state still advances by the same
    # SHA-256 chain at each step, so the final state proves the resumes as the example job's does.
    example_job.Burner.work = lambda self: time.sleep(0.05)
    return example_job.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
