"""The control worker makes sure gpusched's search attributes exist before it serves: a job
workflow that publishes one its namespace lacks fails every workflow task, and its job stalls."""

from __future__ import annotations

import asyncio
import uuid
from datetime import timedelta

import pytest
from temporalio.api.enums.v1 import IndexedValueType
from temporalio.api.operatorservice.v1 import ListSearchAttributesRequest
from temporalio.api.workflowservice.v1 import RegisterNamespaceRequest
from temporalio.client import Client
from temporalio.service import RPCError, RPCStatusCode

from workers.control import ensure_search_attributes
from workers.servers import SEARCH_ATTRIBUTES, ServerError


def _listing(names):
    kinds = {k: IndexedValueType.Value(f"INDEXED_VALUE_TYPE_{v.upper()}") for k, v in SEARCH_ATTRIBUTES.items()}
    return type("Listed", (), {"system_attributes": {}, "custom_attributes": {k: kinds[k] for k in names}})()


class FakeOperator:
    """An operator service that holds `present`, and refuses adding (or listing too)."""

    def __init__(self, present, may_list: bool):
        self.present, self.may_list = present, may_list

    async def list_search_attributes(self, request):
        if not self.may_list:
            raise RPCError("listing is not allowed", RPCStatusCode.PERMISSION_DENIED, b"")
        return _listing(self.present)

    async def add_search_attributes(self, request):
        raise RPCError("adding is not allowed", RPCStatusCode.PERMISSION_DENIED, b"")


def fake_client(present, may_list=True):
    return type("Client", (), {"namespace": "prod", "operator_service": FakeOperator(present, may_list)})()


ALL = list(SEARCH_ATTRIBUTES)


@pytest.mark.parametrize("present, may_list, refused_with", [
    (ALL, True, None),
    (["Team", "Cluster"], True, ["JobState, PriorityClass, GpuCount",
                                  "--namespace prod --name JobState --type Keyword --name PriorityClass "
                                  "--type Keyword --name GpuCount --type Int`"]),
    ([], False, None),
], ids=["a namespace that has them all, where adding is not allowed, serves",
        "a namespace that lacks some and refuses adding stops the worker with the commands to add them",
        "a namespace that lets us neither list nor add is trusted (with a warning)"])
def test_what_the_worker_does_where_it_may_not_add_search_attributes(present, may_list, refused_with):
    client = fake_client(present, may_list)
    if refused_with is None:
        asyncio.run(ensure_search_attributes(client))
        return
    with pytest.raises(ServerError) as raised:
        asyncio.run(ensure_search_attributes(client))
    for words in refused_with:
        assert words in str(raised.value), str(raised.value)


@pytest.mark.live
def test_a_namespace_without_them_gets_them_registered(live_servers):
    namespace = f"fresh-{uuid.uuid4().hex[:8]}"

    async def scenario():
        client = await Client.connect(live_servers.temporal_address)
        await client.workflow_service.register_namespace(RegisterNamespaceRequest(
            namespace=namespace, workflow_execution_retention_period=timedelta(days=1)))
        fresh = await Client.connect(live_servers.temporal_address, namespace=namespace)
        for _ in range(50):  # a new namespace takes a moment to be served
            try:
                before = await fresh.operator_service.list_search_attributes(
                    ListSearchAttributesRequest(namespace=namespace))
                break
            except RPCError:
                await asyncio.sleep(0.1)
        await ensure_search_attributes(fresh)
        after = await fresh.operator_service.list_search_attributes(ListSearchAttributesRequest(namespace=namespace))
        return set(before.custom_attributes), set(after.custom_attributes)

    before, after = asyncio.run(scenario())
    assert not set(SEARCH_ATTRIBUTES) & before
    assert set(SEARCH_ATTRIBUTES) <= after
