"""Fixtures shared by the scheduler tests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest


@pytest.fixture
async def hand_offs() -> AsyncIterator[list[object]]:
    """The callbacks other threads hand to the running loop (``loop.call_soon_threadsafe``), recorded in order."""
    loop = asyncio.get_running_loop()
    seen: list[object] = []
    call_soon_threadsafe = loop.call_soon_threadsafe

    def counting(callback: object, *args: object) -> object:
        seen.append(callback)
        return call_soon_threadsafe(callback, *args)  # type: ignore[arg-type]

    loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
    yield seen
    del loop.call_soon_threadsafe
