"""ClusterSchedulerWorkflow: the scheduling loop of one cluster, and its leader.

Its workflow id is fixed per cluster, so Temporal runs at most one: failover is another control
worker picking up the next workflow task. Heavy state lives in Postgres, never in this history.

Algorithm overview
  1. Run one cycle as one activity: lock the cluster's cycle counter, read a consistent snapshot,
     run the pure core, commit the decisions with the counter's check (a stale or repeated cycle
     commits nothing), and return the orders to send: this cycle's, and older ones not yet acted
     on whose re-send is due (3 s after the first send, then twice as long each time, a minute
     apart at most).
  2. Signal each order to its job workflow (placements, preemptions). Jobs take duplicates
     idempotently, so a re-sent order is harmless.
  3. Sleep until a job event wakes it (wakes arriving meanwhile are coalesced into one), the
     short tick passes, or the core's next wake-up time comes.
  4. After ``cycles_per_run`` cycles, or when Temporal suggests it, continue as new with the
     cycle counter, so the history never grows large.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy

with workflow.unsafe.imports_passed_through():
    from workflows.types import (Abandoned, CycleInput, CycleOutcome, LoopSettings, Reconcile, SchedulerInput,
                                 job_workflow_id)

# A cycle takes well under a second; a control worker killed in the middle of one is noticed
# only at this timeout, and until then the cluster gets no decisions.
CYCLE_CALL = dict(start_to_close_timeout=timedelta(seconds=20),
                  retry_policy=RetryPolicy(initial_interval=timedelta(milliseconds=100),
                                           maximum_interval=timedelta(seconds=5)))

# Orders signalled at once: Temporal refuses a workflow task that leaves over 2,000 signals in flight.
ORDERS_AT_ONCE = 500


@workflow.defn(name="ClusterSchedulerWorkflow")
class ClusterSchedulerWorkflow:
    def __init__(self) -> None:
        self.woken = False
        self.cycle_seq = 0
        self.cycles = 0
        self.reconciled_at = None
        self.last_outcome: CycleOutcome | None = None
        self.settings: LoopSettings | None = None  # a control worker's, sent since this run began
        self._inp: SchedulerInput | None = None

    @workflow.signal
    def wake(self, reason: str = "") -> None:
        self.woken = True

    @workflow.signal
    def configure(self, settings: LoopSettings) -> None:
        """A control worker that starts sends its flags: they hold from the next sleep on, and
        are carried on by continue-as-new (the input of the first run would be kept for good)."""
        self.settings = settings
        self.woken = True  # a control worker that starts has a cycle run, as its wake did

    @workflow.query
    def status(self) -> dict:
        inp = self.inp
        return {"cycle_seq": self.cycle_seq, "cycles_this_run": self.cycles,
                "tick_seconds": inp.tick_seconds if inp else None, "cycles_per_run": inp.cycles_per_run if inp else None}

    @property
    def inp(self) -> SchedulerInput | None:
        """The run's input with the settings a control worker sent since."""
        if self._inp is None or self.settings is None:
            return self._inp
        return self._inp.model_copy(update=self.settings.model_dump())

    @workflow.run
    async def run(self, inp: SchedulerInput) -> None:
        self._inp = inp
        self.cycle_seq = inp.cycle_seq
        prefix = inp.workflow_id_prefix
        while True:
            inp = self.inp  # a control worker's settings, sent meanwhile, hold from here on
            self.woken = False
            # 1. One cycle.
            outcome: CycleOutcome = await workflow.execute_activity(
                "plan_cycle", CycleInput(cluster=inp.cluster, cycle_seq=self.cycle_seq + 1),
                result_type=CycleOutcome, **CYCLE_CALL)
            # Not committed: another run got ahead (or this one repeated); carry on from its number.
            self.cycle_seq = outcome.cycle_seq
            self.cycles += 1
            # 2. Send the orders.
            sends = [self._signal(prefix + job_workflow_id(o.job_id), "placement", o.signal)
                     for o in outcome.placements]
            sends += [self._signal(prefix + job_workflow_id(o.job_id), "preempt", o.signal)
                      for o in outcome.preemptions]
            if workflow.patched("orders-in-chunks"):
                # Temporal takes at most 2,000 signals in flight from one workflow: a cycle of more
                # orders failed its task on every retry, and the cluster's scheduling stopped.
                delivered = []
                for at in range(0, len(sends), ORDERS_AT_ONCE):
                    delivered += await asyncio.gather(*sends[at:at + ORDERS_AT_ONCE])
            else:
                delivered = await asyncio.gather(*sends)
            # A job whose workflow is gone (terminated by hand, say) can never take its GPUs up:
            # give them back and end the job with the reason, rather than hold them forever.
            gone = [Abandoned(job_id=o.job_id, allocation_id=o.signal.allocation_id, workflow_id_prefix=prefix)
                    for o, ok in zip(outcome.placements, delivered) if not ok]
            if workflow.patched("abandon-unreachable-stops"):
                # The same for a stop order: nothing would ever end that attempt and free its GPUs
                # (its agent stops the process once the server forgets the attempt).
                stops = delivered[len(outcome.placements):]
                gone += [Abandoned(job_id=o.job_id, allocation_id=o.signal.allocation_id, started=True,
                                   workflow_id_prefix=prefix)
                         for o, ok in zip(outcome.preemptions, stops) if not ok]
            if workflow.patched("reconcile-abandoned-allocations") and self._reconcile_due(inp):
                # Allocations whose job workflow ended without ending them (terminated while it
                # ran, with no stop order to find out): nothing else would free their GPUs.
                await workflow.execute_activity(
                    "reconcile_allocations", Reconcile(cluster=inp.cluster, workflow_id_prefix=prefix),
                    result_type=int, **CYCLE_CALL)
            if gone:
                await workflow.execute_activity("abandon_allocations", gone, **CYCLE_CALL)
            # 4. Continue as new before the history grows large.
            if self.cycles >= inp.cycles_per_run or workflow.info().is_continue_as_new_suggested():
                await workflow.wait_condition(workflow.all_handlers_finished)
                # The settings as they are now, not as the iteration began: a control worker's,
                # sent during the cycle, would be dropped until another worker started.
                workflow.continue_as_new(self.inp.model_copy(update={"cycle_seq": self.cycle_seq,
                                                                     "reconciled_at": self.reconciled_at}))
            # 3. Sleep until woken, the tick, or the core's next wake-up.
            sleep = inp.tick_seconds
            if outcome.next_wake_in is not None:
                sleep = max(0.05, min(sleep, outcome.next_wake_in))
            if not self.woken:
                try:
                    await workflow.wait_condition(lambda: self.woken, timeout=timedelta(seconds=sleep))
                except asyncio.TimeoutError:
                    pass

    def _reconcile_due(self, inp: SchedulerInput) -> bool:
        # Counted across runs: a busy loop continues as new sooner than the interval passes.
        now = workflow.now().timestamp()
        if self.reconciled_at is None:
            self.reconciled_at = inp.reconciled_at if inp.reconciled_at is not None else now
        if now - self.reconciled_at < inp.reconcile_seconds:
            return False
        self.reconciled_at = now
        return True

    async def _signal(self, workflow_id: str, name: str, payload) -> bool:
        """Whether the signal reached the job's workflow (False: it has ended or never existed)."""
        try:
            await workflow.get_external_workflow_handle(workflow_id).signal(name, payload)
            return True
        except Exception as e:
            workflow.logger.info("could not signal %s to %s: %s", name, workflow_id, e)
            return False
