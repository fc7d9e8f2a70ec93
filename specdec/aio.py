"""asyncio helpers for cleanup paths that must neither hide the request's real error nor hang.

A gRPC call cancelled locally (for example a speculative draft call cancelled because the
target failed) raises `asyncio.CancelledError` from its later reads, although nobody asked
the *running task* to stop. Cleanup code that lets that CancelledError escape replaces the
request's real error with a cancellation, and the RPC ends with no status at all. These
helpers tell the two apart with `Task.cancelling()`.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable

log = logging.getLogger(__name__)


def cancelled_by_caller() -> bool:
    """True when the running task itself has been asked to stop."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


async def quietly(aw: Awaitable[Any], what: str = "cleanup") -> None:
    """Await cleanup work; its failures (a CancelledError from a call cancelled locally included)
    are logged and dropped. Only a cancellation of the running task itself propagates."""
    try:
        await aw
    except asyncio.CancelledError:
        if cancelled_by_caller():
            raise
        log.debug("%s: a cancelled call ended", what)
    except Exception as e:  # noqa: BLE001 - cleanup must not fail the request
        log.debug("%s failed: %s", what, e)


async def cancel_and_wait(task: asyncio.Future | None) -> None:
    """Cancel a task and wait until it has ended, whatever it raises."""
    if task is None:
        return
    task.cancel()
    await quietly(asyncio.wait([task]), "cancelled task")
    if task.done() and not task.cancelled():
        task.exception()  # retrieved: no "exception was never retrieved" warning
