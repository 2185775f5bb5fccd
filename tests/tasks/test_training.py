"""The training task's own parts, with the Prefect test server: the wait for an accelerator
slot (launch.concurrency_limit) is measured, for the ledger's queueing."""

import logging
import threading
import time
import uuid

import pytest


@pytest.mark.e2e
def test_the_wait_for_an_accelerator_slot_is_measured_and_no_limit_is_no_wait(prefect_server):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.concurrency.sync import concurrency

    from stoker.tasks.training import accelerator_slot

    log = logging.getLogger("test")
    name = "svc-slot-" + uuid.uuid4().hex[:6]
    with accelerator_slot("", log) as waited:  # no limit named: nothing to hold
        assert waited == 0.0
    with accelerator_slot(name, log) as waited:  # not on the server: nothing to hold
        assert waited == 0.0
    with get_client(sync_client=True) as client:
        client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))
    held, release = threading.Event(), threading.Event()

    def other_run():  # another launch holds the one slot for a while
        with concurrency(name, occupy=1, strict=True):
            held.set()
            release.wait(30)

    other = threading.Thread(target=other_run)
    other.start()
    assert held.wait(30)
    threading.Timer(2.0, release.set).start()
    t0 = time.time()
    with accelerator_slot(name, log) as waited:
        assert time.time() - t0 >= waited >= 1.5  # it could not have the slot before the release
    other.join(30)
