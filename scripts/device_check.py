"""The GPU check: proves the NVML path against a real GPU and runs a real CUDA job through the
agent's node activity, pinned to its GPU, checkpointing on a stop and resuming.

    python3 scripts/device_check.py --out DIR            # on a machine with an NVIDIA GPU
    python3 scripts/device_check.py --out DIR --no-gpu   # here: fake devices, CPU, to check the script

Steps (each prints a line and lands in DIR/device-check.json):
  1. NVML: inventory and three health readings of every GPU (workers.devices.NvmlDevices).
  2. Pinning: a command run through NodeActivities.run_job on GPU 0 sees exactly one CUDA device,
     the one NVML names first.
  3. Checkpoint and resume: the example job (torch on cuda:0) runs through run_job; the activity
     is cancelled mid-way (SIGTERM, grace), the job checkpoints and exits; the report goes
     through the agent's forwarding to a stand-in control plane that commits it; a second attempt
     resumes from that checkpoint and finishes with the same final state as the same steps
     computed without interruption.
Needs no servers: checkpoints go to a local file:// prefix, and the control plane's commit is
stood in for by a function that accepts every report (the real commit is tested elsewhere).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from temporalio.testing import ActivityEnvironment  # noqa: E402

from activities.node import NodeActivities  # noqa: E402
from workers.devices import FakeDevices, NvmlDevices  # noqa: E402
from workflows.types import GpuGrant, RunJobInput  # noqa: E402

MACHINE = "dev/b0/r0/m0"
PIN_PROBE = ("import os\n"
             "try:\n"
             "    import torch\n"
             "    n = torch.cuda.device_count()\n"
             "    name = torch.cuda.get_device_name(0) if n else 'cpu'\n"
             "except ImportError:\n"
             "    n, name = 0, 'no torch'\n"
             "print('PIN', os.environ['CUDA_VISIBLE_DEVICES'], n, name, flush=True)\n")


def nvml_step(no_gpu: bool) -> dict:
    devices = FakeDevices(1) if no_gpu else NvmlDevices()
    inventory = [g.model_dump() for g in devices.inventory()]
    health = []
    for _ in range(3):
        health.append([h.model_dump() for h in devices.health()])
        time.sleep(0.5)
    devices.close()
    print(f"1. NVML ({devices.kind}): {len(inventory)} GPU(s): {inventory}; health: {health[-1]}")
    assert inventory, "no GPU found"
    return {"kind": devices.kind, "inventory": inventory, "health": health}


async def run(node: NodeActivities, req: RunJobInput, cancel_after: float | None = None):
    env = ActivityEnvironment()
    task = asyncio.create_task(env.run(node.run_job, req))
    if cancel_after is not None:
        await asyncio.sleep(cancel_after)
        env.cancel()
    try:
        return await task
    except asyncio.CancelledError:
        return None


def request(job: str, alloc: int, attempt: int, command: list[str], ckpt: Path, gpu: GpuGrant,
            resume: tuple[str, int] | None = None) -> RunJobInput:
    return RunJobInput(job_id=job, allocation_id=alloc, attempt=attempt, command=command, gpus=[gpu],
                       grace_period=30, checkpoint_uri=f"file://{ckpt}/", checkpoint_interval=3600,
                       resume_from=resume[0] if resume else None, resume_seq=resume[1] if resume else None)


async def agent_steps(out: Path, no_gpu: bool, gpu_name: str) -> dict:
    committed: list[dict] = []

    async def control_plane(job_id: str, allocation_id: int, report: dict) -> dict:
        committed.append({"job_id": job_id, "allocation_id": allocation_id, **report})
        return {"committed": True, "reason": "committed (stand-in control plane)"}

    node = NodeActivities(MACHINE, out / "jobs", report_sink=control_plane)
    gpu = GpuGrant(index=0, path=f"{MACHINE}/0")
    ckpt = out / "checkpoints"
    results: dict = {}

    # 2. Pinning.
    pin = await run(node, request("pin", 1, 1, [sys.executable, "-c", PIN_PROBE], ckpt, gpu))
    line = next((ln for ln in pin.last_log_lines if ln.startswith("PIN")), "")
    print(f"2. pinning: exit {pin.exit_code}: {line}")
    _, visible, count, name = line.split(" ", 3) if line else ("", "", "0", "")
    results["pinning"] = {"exit_code": pin.exit_code, "visible": visible, "device_count": int(count or 0),
                          "device_name": name}
    assert pin.exit_code == 0 and visible == "0" and int(count) == (0 if no_gpu else 1), line
    assert no_gpu or gpu_name.split()[-1] in name, (gpu_name, name)

    # 3. Checkpoint on a stop, resume, same final state.
    steps, step_seconds = 40, 0.25
    job = [sys.executable, "-m", "workers.example_job", "--steps", str(steps), "--step-seconds", str(step_seconds),
           "--backend", "python" if no_gpu else "torch"]
    began = time.monotonic()
    first = await run(node, request("train", 2, 1, job, ckpt, gpu), cancel_after=4.0)
    log1 = (out / "jobs" / "train" / "attempt-1.log").read_text()
    assert first is None and committed, f"no checkpoint committed on the stop:\n{log1}"
    last = committed[-1]
    print(f"3. stopped after {time.monotonic() - began:.1f} s; checkpoint seq {last['seq']} "
          f"({last['size']} bytes) at step {last['progress']} committed")
    second = await run(node, request("train", 3, 2, job, ckpt, gpu, resume=(f"file:///{last['key']}", last["seq"])))
    log2 = (out / "jobs" / "train" / "attempt-2.log").read_text()
    resumed = re.search(r"starting at step (\d+) \(resumed from seq (\d+)\)", log2)
    final = re.search(r"final_state=([0-9a-f]+)", log2)
    backend = re.search(r"example-job: backend (.*)", log1)
    print(f"   resumed: {resumed.group(0) if resumed else log2[-2000:]}; exit {second.exit_code}; "
          f"backend: {backend.group(1) if backend else '?'}")
    assert second.exit_code == 0 and resumed and int(resumed.group(2)) == last["seq"] and final, log2
    reference = _uninterrupted_state(steps)
    assert final.group(1) == reference, (final.group(1), reference)
    print(f"   final state {final.group(1)[:16]}… equals an uninterrupted run's")
    results["checkpoint_resume"] = {
        "stopped_checkpoint_seq": last["seq"], "stopped_at_step": last["progress"], "checkpoint_bytes": last["size"],
        "resumed_at_step": int(resumed.group(1)), "backend": backend.group(1) if backend else None,
        "final_state_matches": True, "seconds": round(time.monotonic() - began, 1)}
    return results


def _uninterrupted_state(steps: int) -> str:
    from workers.example_job import final_state  # the job's state transition, without timing work

    return final_state(steps).hex()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--no-gpu", action="store_true", help="fake devices and the CPU (to check the script)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"nvml": nvml_step(args.no_gpu)}
    gpu_name = report["nvml"]["inventory"][0]["gpu_type"]
    report.update(asyncio.run(agent_steps(args.out, args.no_gpu, gpu_name)))
    (args.out / "device-check.json").write_text(json.dumps(report, indent=2))
    print("device check passed")


if __name__ == "__main__":
    main()
