"""The http target: KServe V2 over HTTP/1.1 against kiln or any V2 server; one keep-alive connection per request
slot. Inputs go with the binary tensor data extension by default (``--input-tensor-format json`` sends JSON), and
outputs come back binary unless ``--output-tensor-format json``.

Client send is building the body plus writing it; client recv is reading the body after the response head plus
decoding the outputs into arrays; what remains of the latency is the response wait (network and server).
"""

from __future__ import annotations

import time
from typing import Any

from kiln.bench.data import ModelInputs, Request
from kiln.bench.options import BenchOptions
from kiln.bench.records import ClientTimes
from kiln.bench.server_stats import ServerCounters, counters_from_doc
from kiln.bench.targets.base import REQUEST_TIMEOUT_S
from kiln.bench.targets.remote import RemoteTarget
from kiln.config.spec import TensorSpec
from kiln.errors import InvalidArgumentError, KilnError
from kiln.tensor import DataType
from kiln.v2.client import AsyncHttpClient, ServerUnreachableError
from kiln.v2.client.calls import decode_infer, model_path
from kiln.v2.http_codec import encode_request


class HttpTarget(RemoteTarget):
    kind = "http"
    default_port = 8000

    def __init__(self, options: BenchOptions) -> None:
        super().__init__(options)
        self._binary_input = options.input_tensor_format == "binary"
        self._binary_output = options.output_tensor_format == "binary"
        # One client (so one connection) per request slot: concurrency N is N connections, as perf_analyzer has it.
        self._clients: dict[int, AsyncHttpClient] = {}
        self._control: AsyncHttpClient | None = None
        self._datatypes: dict[str, DataType] = {}
        self._model_path = ""

    def _client(self) -> AsyncHttpClient:
        return AsyncHttpClient(f"{self.host}:{self.port}", timeout_s=REQUEST_TIMEOUT_S)

    async def aopen(self) -> ModelInputs:
        self._control = control = self._client()
        self._model_path = model_path(self.model, self.version)
        metadata = await control.model_metadata(self.model, self.version)
        try:
            config = await control.model_config(self.model, self.version)
            max_batch_size = int(config.get("max_batch_size", 0))
        except ServerUnreachableError:
            raise
        except (KilnError, ValueError, AttributeError):  # a V2 server without Triton's configuration extension
            max_batch_size = 0
        inputs = tuple(_tensor(self.model, item, max_batch_size > 0) for item in metadata.get("inputs", []))
        self._datatypes = {t.name: t.datatype for t in inputs}
        return ModelInputs(self.model, inputs, max_batch_size)

    async def ainfer(self, slot: int, request: Request) -> ClientTimes | None:
        client = self._clients.get(slot)
        if client is None:
            client = self._clients[slot] = self._client()
        start = time.monotonic_ns()
        body, headers = encode_request(request, datatypes=self._datatypes, binary_input=self._binary_input,
                                       binary_output=self._binary_output)
        response = await client.request("POST", self._model_path + "/infer", body, headers)
        decode_infer(response)
        return ClientTimes(response.sent_ns - start, time.monotonic_ns() - response.head_ns)

    async def astats(self) -> ServerCounters | None:
        assert self._control is not None
        try:
            doc = await self._control.statistics(self.model, self.version)
        except ServerUnreachableError:
            raise
        except KilnError:  # a server without the statistics extension: no breakdown
            return None
        return counters_from_doc(doc, self.model)

    async def aclose(self) -> None:
        clients = [*self._clients.values(), *([self._control] if self._control else [])]
        self._clients, self._control = {}, None
        for client in clients:
            await client.close()


def _tensor(model: str, item: dict[str, Any], batching: bool) -> TensorSpec:
    """A metadata entry as a TensorSpec; a batching model's shape starts with its batch dimension, left out here."""
    shape = [int(d) for d in item.get("shape", [])]
    if batching:
        if not shape:
            raise InvalidArgumentError(f"model '{model}': input '{item.get('name')}' has an empty shape although "
                                       f"the model batches")
        shape = shape[1:]
    return TensorSpec(name=str(item["name"]), datatype=DataType.from_wire(str(item["datatype"])), dims=tuple(shape))
