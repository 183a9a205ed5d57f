"""A LoRA load or unload whose admin client went away still completes, and its failure is
logged (before: the shielded fan-out's error was never retrieved, so nobody heard of it
but asyncio's 'exception was never retrieved' at garbage collection)."""
from __future__ import annotations

import asyncio
import logging

import pytest

from router.http.errors import APIError
from router.http.lora_admin import _to_the_end


def test_a_change_whose_client_left_completes_and_its_failure_is_logged(caplog) -> None:
    done = []

    async def change() -> None:
        await asyncio.sleep(0.05)
        done.append(True)
        raise APIError(400, "lora_path: worker-2 cannot read /x", param="lora_path")

    async def body() -> None:
        waiter = asyncio.ensure_future(_to_the_end(change(), "loading LoRA 'a'"))
        await asyncio.sleep(0.01)
        waiter.cancel()  # the admin client disconnects
        with pytest.raises(asyncio.CancelledError):
            await waiter
        await asyncio.sleep(0.2)

    with caplog.at_level(logging.WARNING, logger="router.http.lora_admin"):
        asyncio.run(body())
    assert done == [True]
    assert ("loading LoRA 'a' failed after its admin client went away: "
            "lora_path: worker-2 cannot read /x") in caplog.text
