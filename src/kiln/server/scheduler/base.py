"""What every scheduler offers the Server."""

from __future__ import annotations

from typing import Protocol

from kiln.v2.types import InferRequest, InferResponse


class Scheduler(Protocol):
    @property
    def inflight(self) -> int:
        """Requests accepted and not yet answered."""

    async def submit(self, request: InferRequest, batch_size: int) -> InferResponse: ...

    def submit_sync(self, request: InferRequest, batch_size: int) -> InferResponse: ...

    def close(self) -> None:
        """Stop taking requests, finish the accepted ones, release the engines."""
