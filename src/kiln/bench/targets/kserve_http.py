"""The http target: KServe V2 over HTTP/1.1 against kiln or any V2 server; one keep-alive connection per request
slot. Inputs go with the binary tensor data extension by default (``--input-tensor-format json`` sends JSON), and
outputs come back binary unless ``--output-tensor-format json``.

Client send is building the body plus writing it; client recv is reading the body after the response head plus
decoding the outputs into arrays; what remains of the latency is the response wait (network and server).
"""

from __future__ import annotations

import json
import time
from typing import Any
from urllib.parse import quote

from kiln.bench.data import ModelInputs, Request
from kiln.bench.options import BenchOptions
from kiln.bench.records import ClientTimes
from kiln.bench.server_stats import ServerCounters, counters_from_doc
from kiln.bench.targets.base import REQUEST_TIMEOUT_S
from kiln.bench.targets.http11 import HttpConnection, HttpResponse
from kiln.bench.targets.remote import RemoteTarget
from kiln.bench.targets.wire import HEADER_LENGTH, decode_http_response, http_body
from kiln.config.spec import TensorSpec
from kiln.errors import InvalidArgumentError, UnavailableError
from kiln.tensor import DataType


class HttpStatusError(UnavailableError):
    """The server answered with a status other than 200."""


class HttpTarget(RemoteTarget):
    kind = "http"
    default_port = 8000

    def __init__(self, options: BenchOptions) -> None:
        super().__init__(options)
        self._binary_input = options.input_tensor_format == "binary"
        self._binary_output = options.output_tensor_format == "binary"
        self._connections: dict[int, HttpConnection] = {}
        self._control: HttpConnection | None = None
        self._datatypes: dict[str, DataType] = {}
        self._model_path = ""

    async def aopen(self) -> ModelInputs:
        self._control = HttpConnection(self.host, self.port, REQUEST_TIMEOUT_S)
        self._model_path = f"/v2/models/{quote(self.model, safe='')}"
        if self.version:
            self._model_path += f"/versions/{quote(self.version, safe='')}"
        metadata = await self._get_json(self._model_path)
        try:
            config = await self._get_json(self._model_path + "/config")
            max_batch_size = int(config.get("max_batch_size", 0))
        except (HttpStatusError, ValueError):  # a V2 server without Triton's configuration extension
            max_batch_size = 0
        inputs = tuple(_tensor(self.model, item, max_batch_size > 0) for item in metadata.get("inputs", []))
        self._datatypes = {t.name: t.datatype for t in inputs}
        return ModelInputs(self.model, inputs, max_batch_size)

    async def ainfer(self, slot: int, request: Request) -> ClientTimes | None:
        connection = self._connections.get(slot)
        if connection is None:
            connection = self._connections[slot] = HttpConnection(self.host, self.port, REQUEST_TIMEOUT_S)
        start = time.monotonic_ns()
        body, headers = http_body(request, self._datatypes, self._binary_input, self._binary_output)
        response = await connection.request("POST", self._model_path + "/infer", body, headers)
        _check(response)
        length = response.headers.get(HEADER_LENGTH.lower())
        decode_http_response(response.body, int(length) if length is not None else None)
        return ClientTimes(response.sent_ns - start, time.monotonic_ns() - response.head_ns)

    async def astats(self) -> ServerCounters | None:
        try:
            doc = await self._get_json(self._model_path + "/stats")
        except HttpStatusError:  # a server without the statistics extension: no breakdown
            return None
        return counters_from_doc(doc, self.model)

    async def aclose(self) -> None:
        connections = [*self._connections.values(), *([self._control] if self._control else [])]
        self._connections, self._control = {}, None
        for connection in connections:
            await connection.close()

    async def _get_json(self, path: str) -> dict[str, Any]:
        assert self._control is not None
        response = await self._control.request("GET", path)
        _check(response)
        doc = json.loads(response.body)
        if not isinstance(doc, dict):
            raise ValueError(f"GET {path}: expected a JSON object")
        return doc


def _check(response: HttpResponse) -> None:
    if response.status == 200:
        return
    try:
        message = json.loads(response.body).get("error", "")
    except (ValueError, AttributeError):
        message = response.body[:200].decode("utf-8", "replace")
    raise HttpStatusError(f"HTTP {response.status}: {message}")


def _tensor(model: str, item: dict[str, Any], batching: bool) -> TensorSpec:
    """A metadata entry as a TensorSpec; a batching model's shape starts with its batch dimension, left out here."""
    shape = [int(d) for d in item.get("shape", [])]
    if batching:
        if not shape:
            raise InvalidArgumentError(f"model '{model}': input '{item.get('name')}' has an empty shape although "
                                       f"the model batches")
        shape = shape[1:]
    return TensorSpec(name=str(item["name"]), datatype=DataType.from_wire(str(item["datatype"])), dims=tuple(shape))
