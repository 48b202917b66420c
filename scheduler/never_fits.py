"""Why a job could never start on a cluster, even an empty one: in words that name the field of
the request at fault, so the person who asked can fix it. Admission (live) refuses such a job at
submit with this reason, and the simulator rejects it with the same words.

Only the machines' shapes count here (GPU type, memory, partition, GPUs per machine and per
block), never what runs on them: health and load change, shapes do not.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable, Protocol

from scheduler.models import INFERENCE_PARTITION, JobKind, Topology


class MachineShape(Protocol):
    block: str
    gpus: int
    gpu_type: str
    gpu_memory_gb: float
    partition: str


class JobShape(Protocol):
    num_gpus: int
    gpu_type: str | None
    gpu_memory_gb: float | None
    kind: JobKind
    topology: Topology | None


def why_it_never_fits(job: JobShape, machines: Iterable[MachineShape]) -> tuple[str, str] | None:
    """(the job's field at fault, why) when no machine of the cluster can ever host the job;
    None when its shape fits."""
    usable = _usable(job, machines)
    if isinstance(usable, tuple):
        return usable
    largest = max(m.gpus for m in usable)
    blocks: dict[str, int] = defaultdict(int)
    for m in usable:
        blocks[m.block] += m.gpus
    topology = job.topology or (Topology.machine if job.num_gpus <= largest else Topology.block)
    n = job.num_gpus
    if topology == Topology.machine and n > largest:
        return "num_gpus", f"needs {n} GPUs on one machine; the largest has {largest}"
    if topology == Topology.block and n > max(blocks.values()):
        return "num_gpus", f"needs {n} GPUs in one block; the largest block has {max(blocks.values())}"
    if n > sum(blocks.values()):
        return "num_gpus", f"needs {n} GPUs; the cluster has {sum(blocks.values())}"
    return None


def fewest_machines(job: JobShape, machines: Iterable[MachineShape]) -> int | None:
    """The fewest machines the job can span on the cluster (its GPUs over the largest machine it
    may use); None when no machine may host it."""
    usable = _usable(job, machines)
    if isinstance(usable, tuple):
        return None
    return -(-job.num_gpus // max(m.gpus for m in usable))


def _usable(job: JobShape, machines: Iterable[MachineShape]) -> list[MachineShape] | tuple[str, str]:
    """The machines of the job's partition, GPU type and memory; else (the field at fault, why)."""
    machines = list(machines)
    has_inference = any(m.partition == INFERENCE_PARTITION for m in machines)
    wants_inference = job.kind == JobKind.inference and has_inference
    of_kind = [m for m in machines if (m.partition == INFERENCE_PARTITION) == wants_inference]
    if not of_kind:
        return "kind", f"no machine of the {job.kind.value} partition"
    of_type = [m for m in of_kind if job.gpu_type is None or m.gpu_type == job.gpu_type]
    if not of_type:
        types = ", ".join(sorted({m.gpu_type for m in of_kind}))
        return "gpu_type", f"no machine with GPU type {job.gpu_type} (it has {types})"
    usable = [m for m in of_type if job.gpu_memory_gb is None or m.gpu_memory_gb >= job.gpu_memory_gb]
    if not usable:
        most = max(m.gpu_memory_gb for m in of_type)
        return "gpu_memory_gb", f"no GPU with {job.gpu_memory_gb:g} GB (the most is {most:g} GB)"
    return usable
