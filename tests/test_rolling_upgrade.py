"""Rolling upgrades: workers of two versions run side by side for a while, and each refuses a
field it does not know. A field newer than some workers is left out of a payload while it holds
its default, so an older worker still takes what a newer one sends, through Temporal's converter."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError, create_model
from temporalio.contrib.pydantic import pydantic_data_converter

from workflows.types import EndAttempt, EndReason, JobRequest, JobState, Model, RunJobResult


def older(model: type[Model]) -> type[Model]:
    """The model as a worker from before its new fields knows it: strict, and without them."""
    fields = {name: (info.annotation, info) for name, info in model.model_fields.items()
              if name not in model.NEW_FIELDS}
    return create_model(f"Older{model.__name__}", __base__=Model, **fields)


def sent(value: Model) -> bytes:
    [payload] = asyncio.run(pydantic_data_converter.encode([value]))
    return payload.data


@pytest.mark.parametrize("name, value", [
    ("a run that ended without GPU faults", RunJobResult(exit_code=1, log_path="a.log")),
    ("a job that asks for no retries", JobRequest(job_id="a", team="t", num_gpus=1, command=["x"])),
    ("an attempt that ended with no machine at fault",
     EndAttempt(job_id="a", allocation_id=1, end_reason=EndReason.completed, next_state=JobState.succeeded,
                reason="completed")),
])
def test_a_new_field_at_its_default_is_taken_by_a_worker_that_does_not_know_it(name, value):
    older(type(value)).model_validate_json(sent(value))
    assert type(value).model_validate_json(sent(value)) == value, name


@pytest.mark.parametrize("name, value", [
    ("a run that died on a failing GPU", RunJobResult(exit_code=1, log_path="a.log", gpu_faults=["GPU 1: xid:79"])),
    ("a job that asks for retries", JobRequest(job_id="a", team="t", num_gpus=1, command=["x"], max_retries=2)),
])
def test_a_new_field_that_is_used_is_sent_and_read_back(name, value):
    assert type(value).model_validate_json(sent(value)) == value, name
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        older(type(value)).model_validate_json(sent(value))  # what only a new worker can act on
