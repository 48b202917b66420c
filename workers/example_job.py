"""`gpusched example-job`: a bundled job that works, checkpoints through jobkit, and resumes.

    gpusched example-job --steps N [--step-seconds S] [--state-mb M] [--fail-at-step K]
                         [--backend auto|python|torch|idle]
    python -m workers.example_job ...      (the same, without the CLI)

Each step does real work for about S seconds: a matmul loop on the GPU when torch and CUDA are
there (``cuda:0``, i.e. the first GPU of ``CUDA_VISIBLE_DEVICES``), on the CPU with torch alone,
otherwise a pure-Python hash chain; ``idle`` waits the step out instead (the live tests' jobs: on
a 2-core machine their work only starved the scheduler under test). The job's *state* depends only on the step count, never on
the backend or on timing: ``state_k = H(state_{k-1}, k)`` where H is 2,000 chained SHA-256 rounds.
So a run stopped and resumed any number of times ends with the state of an uninterrupted run.

Checkpoints (through :mod:`jobkit`, so ``GPUSCHED_*`` decides where and when): one JSON line
``{"format": "gpusched-example-job/1", "step": k, "steps": N, "state": "<hex>", "padding": P}``,
then P bytes of padding (``--state-mb``, to exercise big checkpoints). Saved when jobkit says one
is due and on SIGTERM, by rank 0 alone in a gang of several machines (every machine's state is the
same); on start each resumes from ``GPUSCHED_RESUME_FROM`` and continues counting.

Output (stdout, one line each, flushed)::

    example-job: backend python (pure-Python hash chain)
    example-job: starting at step 5 (resumed from seq 3)      # or "(fresh)"; K = steps done
    step 6/20 state=3f2a9c0b1d4e... (resumed from checkpoint 3 at step 5)
    example-job: checkpoint seq 4 at step 8: 142 bytes, committed=True (ok)
    example-job: stopped at step 9 after checkpoint seq 5 (committed=True)
    example-job: done, steps=20 final_state=<hex>

Exit codes: 0 done; 143 stopped on SIGTERM after its checkpoint (jobkit.EXIT_STOPPED); 3
``--fail-at-step`` was reached (step K is not completed); 1 the checkpoint on SIGTERM failed, or
the resume checkpoint is unusable (gone or corrupted: jobkit has reported it, and gpusched queues
the job again to resume from the checkpoint before); 75 the checkpoint store is unreachable at
resume (jobkit.EXIT_RETRY_LATER: gpusched queues the job again); 2 bad arguments.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
from typing import Callable, Optional

from jobkit import EXIT_RETRY_LATER, EXIT_STOPPED, CheckpointError, Checkpointer, CheckpointRetryLater

FORMAT = "gpusched-example-job/1"
INITIAL_STATE = hashlib.sha256(b"gpusched example-job").digest()
ROUNDS = 2000
EXIT_FAILED_AT_STEP = 3
EXIT_CHECKPOINT_FAILED = 1
EXIT_BAD_ARGUMENTS = 2  # as argparse exits


def advance(state: bytes, step: int) -> bytes:
    """The state after step ``step``: 2,000 chained SHA-256 rounds over the state and the step."""
    h = hashlib.sha256(state + step.to_bytes(8, "big")).digest()
    for _ in range(ROUNDS):
        h = hashlib.sha256(h).digest()
    return h


def final_state(steps: int) -> bytes:
    """What an uninterrupted run of ``steps`` steps ends with."""
    state = INITIAL_STATE
    for k in range(1, steps + 1):
        state = advance(state, k)
    return state


# --- the work that takes the time ------------------------------------------------------------


class Burner:
    """Busy work until a deadline; its results never feed the state (GPU math is not bit-exact)."""

    name = "python (pure-Python hash chain)"

    def __init__(self) -> None:
        self._h = b"burn"

    def work(self) -> None:
        h = self._h
        for _ in range(500):
            h = hashlib.sha256(h).digest()
        self._h = h

    def burn(self, until: float, stop: Callable[[], bool]) -> bool:
        """Work until the monotonic time ``until``; False if ``stop()`` turned true first."""
        while time.monotonic() < until:
            if stop():
                return False
            self.work()
        return True


class IdleBurner(Burner):
    """Waits each step out: the job's state, checkpoints and stops are the same, without the work."""

    name = "idle (waits out each step)"

    def burn(self, until: float, stop: Callable[[], bool]) -> bool:
        while (left := until - time.monotonic()) > 0:
            if stop():
                return False
            time.sleep(min(left, 0.02))  # a stop is seen within 20 ms, as a burner sees it between rounds
        return True


class TorchBurner(Burner):
    def __init__(self, torch, device: str) -> None:
        super().__init__()
        self._torch = torch
        self._device = device
        n = 4096 if device.startswith("cuda") else 256
        gen = torch.Generator(device="cpu").manual_seed(0)
        self._x = (torch.rand(n, n, generator=gen) / n).to(device)
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        where = f"GPU {visible.split(',')[0]} of CUDA_VISIBLE_DEVICES={visible}" if visible else "GPU 0"
        self.name = f"torch on {device} ({where})" if device.startswith("cuda") else "torch on cpu"

    def work(self) -> None:
        y = self._x @ self._x
        if self._device.startswith("cuda"):
            self._torch.cuda.synchronize()
        del y


def pick_burner(backend: str) -> Burner:
    if backend == "idle":
        return IdleBurner()
    if backend in ("auto", "torch"):
        try:
            import torch  # noqa: PLC0415  (optional; never a dependency)
        except ImportError:
            if backend == "torch":
                raise SystemExit("example-job: --backend torch, but torch is not installed") from None
        else:
            return TorchBurner(torch, "cuda:0" if torch.cuda.is_available() else "cpu")
    return Burner()


# --- checkpoints ---------------------------------------------------------------------------


def encode(step: int, steps: int, state: bytes, padding: int) -> bytes:
    header = json.dumps({"format": FORMAT, "step": step, "steps": steps, "state": state.hex(),
                         "padding": padding}).encode()
    pad = b""
    if padding:
        block = hashlib.sha256(state + b"pad").digest() * 32768  # 1 MiB
        pad = block * (padding // len(block)) + block[: padding % len(block)]
    return header + b"\n" + pad


def decode(raw: bytes) -> tuple[int, bytes]:
    header, _, pad = raw.partition(b"\n")
    try:
        doc = json.loads(header)
        if doc.get("format") != FORMAT:
            raise ValueError(f"format {doc.get('format')!r}, expected {FORMAT!r}")
        if len(pad) != int(doc.get("padding", 0)):
            raise ValueError(f"{len(pad)} padding bytes, the header says {doc.get('padding')}")
        return int(doc["step"]), bytes.fromhex(doc["state"])
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"not an example-job checkpoint: {e}") from None


# --- the job -------------------------------------------------------------------------------


def say(line: str) -> None:
    print(line, flush=True)


def run(args: argparse.Namespace) -> int:
    try:
        ck = Checkpointer.from_env()
    except CheckpointError as e:  # a GPUSCHED_* setting of the job's that no checkpoint can use
        print(f"example-job: {e}", file=sys.stderr, flush=True)
        return EXIT_BAD_ARGUMENTS
    ck.handle_sigterm()
    burner = pick_burner(args.backend)
    padding = int(args.state_mb * 1024 * 1024)
    say(f"example-job: backend {burner.name}")

    step, state, resumed = 0, INITIAL_STATE, ""
    try:
        raw = ck.restore()
        if raw is not None:
            step, state = decode(raw)
    except CheckpointError as e:
        print(f"example-job: cannot resume from {ck.resume_from}: {e}", file=sys.stderr, flush=True)
        # An unreachable store is no fault of the job's: queued again, it resumes once the store is back.
        return EXIT_RETRY_LATER if isinstance(e, CheckpointRetryLater) else EXIT_CHECKPOINT_FAILED
    if raw is None:
        say(f"example-job: starting at step {step} (fresh)")
    else:
        say(f"example-job: starting at step {step} (resumed from seq {ck.resume_seq})")
        resumed = f" (resumed from checkpoint {ck.resume_seq} at step {step})"

    def checkpoint(why: str) -> Optional[int]:
        if not ck.saves:  # a gang's other machines: their state is rank 0's, which saves it
            say(f"example-job: no checkpoint at step {step} ({why}): rank {ck.rank}, rank 0 saves")
            return None
        result = ck.save(encode(step, args.steps, state, padding), progress=step)
        if result is None:
            say(f"example-job: no checkpoint at step {step} ({why}): GPUSCHED_CHECKPOINT_URI is unset")
            return None
        note = f", refused numbers {list(result.refused)}" if result.refused else ""
        say(f"example-job: checkpoint seq {result.seq} at step {step} ({why}): {result.size} bytes, "
            f"committed={result.committed} ({result.reason}){note}")
        return result.seq

    while step < args.steps and not ck.stop_requested:
        began = time.monotonic()
        if args.fail_at_step is not None and step + 1 == args.fail_at_step:
            say(f"example-job: failing at step {step + 1} (--fail-at-step)")
            return EXIT_FAILED_AT_STEP
        if not burner.burn(began + args.step_seconds, lambda: ck.stop_requested):
            break  # stopped mid-step: the step is abandoned, the checkpoint holds the one before
        state = advance(state, step + 1)
        step += 1
        say(f"step {step}/{args.steps} state={state.hex()[:12]}...{resumed}")
        if step < args.steps and ck.due() and not ck.stop_requested:
            try:
                checkpoint("scheduled")
            except CheckpointError as e:  # storage trouble: keep working, try again when next due
                print(f"example-job: scheduled checkpoint failed: {e}", file=sys.stderr, flush=True)

    if step < args.steps:  # asked to stop
        try:
            seq = checkpoint("stopping")
        except CheckpointError as e:
            print(f"example-job: checkpoint on stop failed: {e}", file=sys.stderr, flush=True)
            return EXIT_CHECKPOINT_FAILED
        last = ck.last_save
        after = f"after checkpoint seq {seq} (committed={last.committed})" if last and seq else "without a checkpoint"
        left = ck.seconds_left()
        grace = f", {left:.1f} s of grace left" if left != float("inf") else ""
        say(f"example-job: stopped at step {step} {after}{grace}")
        return EXIT_STOPPED
    say(f"example-job: done, steps={step} final_state={state.hex()}")
    return 0


# --- command line ----------------------------------------------------------------------------


def _nonneg(kind, most: float = math.inf, least: float = 0):
    def parse(text: str):
        value = kind(text)
        if not least <= value < math.inf:  # NaN fails both
            raise argparse.ArgumentTypeError(f"must be a finite number >= {least:g}, got {text}")
        if value > most:
            raise argparse.ArgumentTypeError(f"must be at most {most:g}, got {text}")
        return value
    return parse


MAX_STATE_MB = 16384  # the padding is held in memory: past this the job dies of MemoryError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=_nonneg(int), required=True, help="steps to run in all")
    parser.add_argument("--step-seconds", type=_nonneg(float), default=1.0,
                        help="seconds of work per step (default 1)")
    parser.add_argument("--state-mb", type=_nonneg(float, MAX_STATE_MB), default=0.0,
                        help=f"pad each checkpoint to about this many MiB, at most {MAX_STATE_MB} (default 0)")
    parser.add_argument("--fail-at-step", type=_nonneg(int, least=1), default=None, metavar="K",
                        help="exit 3 when step K (1 or more) would run (for tests)")
    parser.add_argument("--backend", choices=("auto", "python", "torch", "idle"), default="auto",
                        help="where the work runs: auto (torch+CUDA, torch, else python); idle waits instead")


def add_example_job_command(subparsers) -> None:
    """Add ``example-job`` to a top-level argparse subparsers object."""
    job = subparsers.add_parser(
        "example-job", help="a bundled job that works, checkpoints via jobkit, and resumes"
    )
    add_arguments(job)
    job.set_defaults(func=run)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="example-job", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
