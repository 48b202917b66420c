#!/usr/bin/env python3
"""Diagnosis: where do GPUs sit idle while jobs wait?

    python bench/idle_while_waiting.py --trace T.csv --fleet F.yaml [--policy gpusched|fifo|easy]

"Utilisation while any job waits" (summary.json) says how much is idle, not why. This replays a
trace with the simulator and, after every cycle that changed something, sorts each idle healthy
GPU of a cluster with a non-empty queue into one cause:
  - earmarked: promised to a job whose preemption victims are still leaving;
  - too few on its machine: its machine has fewer free GPUs than the smallest waiting job needs,
    so no waiting job could use it without a multi-machine placement (fragmentation);
  - other: a waiting job of that size exists, yet the policy left the GPU idle (a reservation,
    the reserved pool of whole machines, a topology or GPU-type constraint, a team maximum).
Each is integrated over time and printed as a share of all GPU-time while jobs waited; the
three add up to 1 − utilisation while waiting. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from scheduler.sim.engine import POLICIES, SimSettings, Simulation  # noqa: E402
from workers.cli import load_inputs  # noqa: E402

CAUSES = ("earmarked", "too_few_on_its_machine", "other")


class IdleCensus(Simulation):
    """The simulator, counting idle GPUs by cause at each sample."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # (time, healthy GPUs of the clusters with a queue, idle GPUs by cause)
        self.census: list[tuple[float, int, dict[str, int]]] = []

    def sample(self, now: float) -> None:
        super().sample(now)
        counts = dict.fromkeys(CAUSES, 0)
        healthy = 0
        for cluster in self.clusters.values():
            if not cluster.queue:
                continue
            healthy += cluster.healthy_gpus
            held = {slot for job in cluster.running.values() for slot in job.gpus}
            earmarked = {slot for earmark in cluster.earmarks for slot in earmark.gpus}
            smallest = min(job.spec.num_gpus for job in cluster.queue.values())
            for machine in cluster.machine_tuple:
                if not machine.reachable:
                    continue
                free = [(machine.id, g) for g in range(machine.gpus)
                        if (machine.id, g) not in held and g not in machine.unhealthy_gpus]
                for slot in free:
                    if slot in earmarked:
                        counts["earmarked"] += 1
                    elif len(free) < smallest:
                        counts["too_few_on_its_machine"] += 1
                    else:
                        counts["other"] += 1
        self.census.append((now, healthy, counts))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", required=True)
    parser.add_argument("--fleet", required=True)
    parser.add_argument("--policy", default="gpusched", choices=sorted(POLICIES))
    args = parser.parse_args(argv)

    trace, fleet = load_inputs(args.trace, args.fleet)
    began = time.perf_counter()
    sim = IdleCensus(trace, fleet, args.policy, SimSettings())
    sim.run()

    # Each sample holds until the next one: the state only changes at cycles.
    waiting_gpu_s = 0.0
    idle = dict.fromkeys(CAUSES, 0.0)
    for (t, healthy, counts), (following, _, _) in zip(sim.census, sim.census[1:]):
        span = following - t
        waiting_gpu_s += healthy * span
        for cause in CAUSES:
            idle[cause] += counts[cause] * span
    shares = {cause: idle[cause] / waiting_gpu_s if waiting_gpu_s else 0.0 for cause in CAUSES}
    print(f"{args.policy}: idle GPU-time while jobs waited, by cause (share of all GPU-time while waiting)")
    for cause in CAUSES:
        print(f"  {cause.replace('_', ' '):24s} {100 * shares[cause]:6.3f}%")
    print(f"  {'total':24s} {100 * sum(shares.values()):6.3f}%")
    print(json.dumps({"policy": args.policy, "trace": args.trace, "idle_share": shares,
                      "idle_total": sum(shares.values()), "wall_s": round(time.perf_counter() - began, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
