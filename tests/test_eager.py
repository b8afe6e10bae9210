"""eager.py: the claim's and the settlement's own tasks, started eagerly where Python can, and waited for through a
cancellation of the request that leaves them running (``outlasting``)."""

from __future__ import annotations

import asyncio
import gc
import sys

import pytest

from idempotency_mw.eager import outlasting, start_eagerly


async def test_a_settlement_that_never_waits_is_done_at_once_where_tasks_start_eagerly() -> None:
    ran: list[str] = []

    async def settle() -> None:
        ran.append("settled")

    settling = start_eagerly(settle(), "settle")
    if sys.version_info >= (3, 12):
        assert ran == ["settled"]  # run in the caller's turn, before anything else could
        assert settling.done()
    await settling
    assert ran == ["settled"]


async def test_a_settlement_that_waits_goes_on_in_a_task_of_its_own_through_a_cancellation() -> None:
    gate, steps = asyncio.Event(), []

    async def settle() -> None:
        steps.append("sent")
        await gate.wait()
        await asyncio.sleep(0)
        steps.append("written")

    async def request() -> None:
        await outlasting(start_eagerly(settle(), "settle"))

    task = asyncio.create_task(request())
    for _ in range(3):
        await asyncio.sleep(0)
    assert steps == ["sent"]
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    gate.set()
    for _ in range(10):
        await asyncio.sleep(0)
    assert steps == ["sent", "written"]


async def test_a_timeout_inside_the_task_cancels_the_task_not_the_request() -> None:
    """asyncio.timeout captures the current task. An earlier 3.11 emulation of eager start drove the coroutine by
    hand in the request's task up to its first wait, so a timeout entered before that wait (the store's pool,
    waiting for a connection) later cancelled the request instead: a busy pool gave a CancelledError, not a 503."""

    async def claim() -> str:
        try:
            async with asyncio.timeout(0.05):
                await asyncio.Event().wait()
        except TimeoutError:
            return "timed out"
        return "never"

    async def request() -> str:
        result = await outlasting(start_eagerly(claim(), "claim"))
        await asyncio.sleep(0.1)  # the request goes on: nothing cancels it
        return result

    assert await asyncio.wait_for(request(), 5) == "timed out"


async def test_an_eager_task_passes_on_errors_and_its_own_cancellation() -> None:
    async def fails_after_a_wait() -> None:
        await asyncio.sleep(0)
        raise RuntimeError("the store refused")

    with pytest.raises(RuntimeError, match="the store refused"):
        await start_eagerly(fails_after_a_wait(), "fails")

    cleaned_up: list[bool] = []

    async def waits_forever() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            cleaned_up.append(True)

    settling = start_eagerly(waits_forever(), "waits")
    await asyncio.sleep(0)
    settling.cancel()  # the settlement itself cancelled (the loop closing): it sees the cancellation
    with pytest.raises(asyncio.CancelledError):
        await settling
    assert cleaned_up == [True]


async def test_outlasting_passes_on_what_the_task_ends_with() -> None:
    async def answers() -> str:
        await asyncio.sleep(0)
        return "claimed"

    async def fails() -> None:
        await asyncio.sleep(0)
        raise RuntimeError("the store refused")

    async def is_cancelled() -> None:
        asyncio.current_task().cancel()  # type: ignore[union-attr]
        await asyncio.sleep(0)

    assert await outlasting(start_eagerly(answers(), "answers")) == "claimed"
    with pytest.raises(RuntimeError, match="the store refused"):
        await outlasting(start_eagerly(fails(), "fails"))
    with pytest.raises(asyncio.CancelledError):
        await outlasting(start_eagerly(is_cancelled(), "cancelled"))
    done = start_eagerly(answers(), "done")
    await done
    assert outlasting(done) is done  # nothing left to wait for: no follower, no callback


async def test_a_cancelled_wait_leaves_the_task_running_and_its_error_to_its_owner(
    caplog: pytest.LogCaptureFixture,
) -> None:
    gate = asyncio.Event()

    async def store_call() -> None:
        await gate.wait()
        raise RuntimeError("the store refused")

    task = start_eagerly(store_call(), "store call")
    waiting = asyncio.ensure_future(outlasting(task))
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert not task.done()  # the request's cancellation did not reach the task
    gate.set()
    for _ in range(5):
        await asyncio.sleep(0)
    assert task.done()
    with pytest.raises(RuntimeError, match="the store refused"):
        task.result()  # the owner still reads it (IdempotentRequest._abandon does)

    # An owner that does not read it: the error is its to handle, and asyncio does not log it as lost.
    unread = start_eagerly(store_call(), "unread")
    waiting = asyncio.ensure_future(outlasting(unread))
    await asyncio.sleep(0)
    waiting.cancel()
    for _ in range(5):
        await asyncio.sleep(0)
    assert unread.done()
    assert waiting.cancelled()
    del unread, waiting
    gc.collect()
    assert "never retrieved" not in caplog.text
