"""Decoupled models (zero to many responses per request) against `kiln serve`, with the real tritonclient: gRPC
streams (Triton's repeat_int32 and its custom-repeat client flow, the final-response flag, errors mid-stream,
interleaving), the refusal of one-response calls, HTTP generate and generate_stream, response statistics, and BLS
calls with decoupled=True."""

from __future__ import annotations

import json
import queue
import shutil
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
from tritonclient.utils import InferenceServerException

from kiln.demo import build_demo_repository
from kiln.testing.serve import KilnProcess, kiln_serve

pytestmark = pytest.mark.conformance

TIMEOUT_S = 20

# Sends COUNT responses OUT = 0..COUNT-1, an error response at index FAIL_AT (when >= 0), then the final flag;
# COUNT < 0 makes execute raise.
ERRORS_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            count = int(pb_utils.get_input_tensor_by_name(request, "COUNT").as_numpy()[0])
            fail_at = int(pb_utils.get_input_tensor_by_name(request, "FAIL_AT").as_numpy()[0])
            if count < 0:
                raise pb_utils.TritonModelException("COUNT must be >= 0")
            sender = request.get_response_sender()
            for i in range(count):
                if i == fail_at:
                    sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError("index " + str(i) + " failed")))
                else:
                    sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([i], np.int32))]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""
ERRORS_CONFIG = """
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "COUNT" data_type: TYPE_INT32 dims: [ 1 ] }, { name: "FAIL_AT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""

# Calls repeat_int32 with exec(decoupled=True) (async_exec when ASYNC is true) and answers the OUT values it got
# and how many responses carried no outputs.
BLS_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils

def request_for(values):
    n = len(values)
    return pb_utils.InferenceRequest(model_name="repeat_int32", requested_output_names=["OUT"], inputs=[
        pb_utils.Tensor("IN", values.astype(np.int32)), pb_utils.Tensor("DELAY", np.ones(n, np.uint32)),
        pb_utils.Tensor("WAIT", np.zeros(1, np.uint32))])

def answer(responses):
    outs, empty = [], 0
    for response in responses:
        if response.has_error():
            raise pb_utils.TritonModelException(response.error().message())
        tensor = pb_utils.get_output_tensor_by_name(response, "OUT")
        if tensor is None:
            empty += 1
        else:
            outs.append(int(tensor.as_numpy()[0]))
    return pb_utils.InferenceResponse([pb_utils.Tensor("OUTS", np.array(outs, np.int32)),
                                       pb_utils.Tensor("EMPTY", np.array([empty], np.int32))])

class TritonPythonModel:
    async def execute(self, requests):
        replies = []
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "VALUES").as_numpy()
            use_async = bool(pb_utils.get_input_tensor_by_name(request, "ASYNC").as_numpy()[0])
            if use_async:
                responses = [r async for r in await request_for(values).async_exec(decoupled=True)]
            else:
                responses = list(request_for(values).exec(decoupled=True))
            replies.append(answer(responses))
        return replies
"""
BLS_CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "VALUES" data_type: TYPE_INT32 dims: [ -1 ] }, { name: "ASYNC" data_type: TYPE_BOOL dims: [ 1 ] } ]
output [ { name: "OUTS" data_type: TYPE_INT32 dims: [ -1 ] }, { name: "EMPTY" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""


def _python_model(root: Path, name: str, source: str, config: str) -> None:
    (root / name / "1").mkdir(parents=True)
    (root / name / "1" / "model.py").write_text(textwrap.dedent(source))
    (root / name / "config.pbtxt").write_text(config)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnProcess]:
    root = tmp_path_factory.mktemp("repo")
    build_demo_repository(root)
    stats = root / "repeat_stats"  # repeat_int32 under another name, called by the statistics test alone
    shutil.copytree(root / "repeat_int32", stats)
    (stats / "config.pbtxt").write_text((stats / "config.pbtxt").read_text().replace('"repeat_int32"',
                                                                                       '"repeat_stats"'))
    _python_model(root, "decoupled_errors", ERRORS_MODEL, ERRORS_CONFIG)
    _python_model(root, "bls_decoupled", BLS_MODEL, BLS_CONFIG)
    with kiln_serve([root], "--exit-timeout-secs", "5") as process:
        yield process


def _repeat_inputs(values: list[int], delay_ms: int = 1, wait_ms: int = 0) -> list[grpcclient.InferInput]:
    n = len(values)
    inputs = [grpcclient.InferInput("IN", [n], "INT32"), grpcclient.InferInput("DELAY", [n], "UINT32"),
              grpcclient.InferInput("WAIT", [1], "UINT32")]
    inputs[0].set_data_from_numpy(np.array(values, dtype=np.int32))
    inputs[1].set_data_from_numpy(np.full(n, delay_ms, dtype=np.uint32))
    inputs[2].set_data_from_numpy(np.array([wait_ms], dtype=np.uint32))
    return inputs


class Stream:
    """A tritonclient gRPC stream whose callback results land in a queue."""

    def __init__(self, server: KilnProcess) -> None:
        self.client = grpcclient.InferenceServerClient(server.grpc_url)
        self.results: queue.Queue[tuple[Any, Any]] = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.results.put((result, error)))

    def next(self) -> tuple[Any, Any]:
        return self.results.get(timeout=TIMEOUT_S)

    def until_final(self) -> list[tuple[Any, Any]]:
        """Results up to the one whose triton_final_response is true (requests sent with the flag)."""
        got = []
        while True:
            result, error = self.next()
            got.append((result, error))
            response = result.get_response() if result is not None else None
            if response is not None and response.parameters["triton_final_response"].bool_param:
                return got

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()


@pytest.fixture
def stream(server: KilnProcess) -> Iterator[Stream]:
    opened = Stream(server)
    yield opened
    opened.close()


# -- gRPC streams ------------------------------------------------------------------------------------------------


def test_repeat_int32_sends_one_response_per_element_then_an_empty_final(stream: Stream) -> None:
    stream.client.async_stream_infer("repeat_int32", _repeat_inputs([10, 11, 12, 13]), request_id="r1",
                                     enable_empty_final_response=True)
    got = stream.until_final()
    assert all(error is None for _, error in got)
    responses = [result.get_response() for result, _ in got]
    assert [r.id for r in responses] == ["r1"] * 5
    assert [r.parameters["triton_final_response"].bool_param for r in responses] == [False] * 4 + [True]
    assert [int(result.as_numpy("IDX")[0]) for result, _ in got[:4]] == [0, 1, 2, 3]
    assert [int(result.as_numpy("OUT")[0]) for result, _ in got[:4]] == [10, 11, 12, 13]
    final = responses[-1]
    assert (len(final.outputs), final.model_name, final.model_version) == (0, "repeat_int32", "1")


def test_without_the_flag_no_empty_response_is_sent(stream: Stream) -> None:
    stream.client.async_stream_infer("repeat_int32", _repeat_inputs([1, 2]), request_id="a")
    got = [stream.next()[0].get_response() for _ in range(2)]
    assert [r.id for r in got] == ["a", "a"] and "triton_final_response" not in got[0].parameters
    stream.client.async_stream_infer("repeat_int32", _repeat_inputs([]), request_id="none",
                                     enable_empty_final_response=True)
    final = stream.next()[0].get_response()  # a request with no response still gets its final flag
    assert (final.id, len(final.outputs), final.parameters["triton_final_response"].bool_param) == ("none", 0, True)
    assert stream.results.empty()  # nothing came for "a"'s final flag


def test_the_custom_repeat_client_flow(stream: Stream) -> None:
    """simple_grpc_custom_repeat.py: ten responses of OUT only (IDX not requested), values 100..109."""
    values = list(range(100, 110))
    stream.client.async_stream_infer(model_name="repeat_int32", inputs=_repeat_inputs(values, delay_ms=2, wait_ms=5),
                                     outputs=[grpcclient.InferRequestedOutput("OUT")])
    got = [stream.next() for _ in values]
    assert [error for _, error in got] == [None] * 10
    assert [result.as_numpy("OUT").tolist() for result, _ in got] == [[v] for v in values]
    assert all(result.as_numpy("IDX") is None for result, _ in got)


def test_requests_on_one_stream_interleave(stream: Stream) -> None:
    """One instance: execute returns after WAIT, so the second request runs while the first still sends."""
    stream.client.async_stream_infer("repeat_int32", _repeat_inputs([1, 2, 3], delay_ms=150), request_id="slow")
    stream.client.async_stream_infer("repeat_int32", _repeat_inputs([7], delay_ms=1), request_id="fast")
    ids = [stream.next()[0].get_response().id for _ in range(4)]
    assert ids[0] == "fast" and ids.count("slow") == 3


def _errors_inputs(count: int, fail_at: int) -> list[grpcclient.InferInput]:
    inputs = [grpcclient.InferInput("COUNT", [1], "INT32"), grpcclient.InferInput("FAIL_AT", [1], "INT32")]
    inputs[0].set_data_from_numpy(np.array([count], np.int32))
    inputs[1].set_data_from_numpy(np.array([fail_at], np.int32))
    return inputs


def test_an_error_mid_stream_does_not_end_it(stream: Stream) -> None:
    stream.client.async_stream_infer("decoupled_errors", _errors_inputs(4, 1), request_id="e",
                                     enable_empty_final_response=True)
    got = stream.until_final()
    assert len(got) == 5
    assert int(got[0][0].as_numpy("OUT")[0]) == 0
    assert got[1][0] is None and "model 'decoupled_errors': index 1 failed" in str(got[1][1])
    assert [int(result.as_numpy("OUT")[0]) for result, _ in got[2:4]] == [2, 3]
    stream.client.async_stream_infer("repeat_int32", _repeat_inputs([5]), request_id="after")
    assert stream.next()[0].get_response().id == "after"  # the stream still serves


def test_a_failed_execute_ends_its_request_with_the_error(stream: Stream) -> None:
    stream.client.async_stream_infer("decoupled_errors", _errors_inputs(-1, -1), request_id="boom")
    result, error = stream.next()
    assert result is None and "COUNT must be >= 0" in str(error)
    stream.client.async_stream_infer("decoupled_errors", _errors_inputs(1, -1), request_id="ok")
    assert int(stream.next()[0].as_numpy("OUT")[0]) == 0


async def test_the_aio_client_streams_too(server: KilnProcess) -> None:
    async with grpcaio.InferenceServerClient(server.grpc_url) as client:
        async def requests() -> Any:
            # the aio client cannot ask for the final flag (it refuses triton_* parameters); the stream ends when
            # every request sent has ended
            yield {"model_name": "repeat_int32", "inputs": _repeat_inputs([3, 4]), "request_id": "aio"}

        seen = []
        async for result, error in client.stream_infer(requests()):
            assert error is None and result.get_response().id == "aio"
            seen.append(int(result.as_numpy("OUT")[0]))
    assert seen == [3, 4]


# -- one-response calls ------------------------------------------------------------------------------------------


def test_unary_grpc_infer_is_refused_as_triton_does(server: KilnProcess) -> None:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    with pytest.raises(InferenceServerException) as raised:
        client.infer("repeat_int32", _repeat_inputs([1]))
    assert raised.value.status() == "StatusCode.UNIMPLEMENTED"
    assert raised.value.message() == "ModelInfer RPC doesn't support models with decoupled transaction policy"


def test_unary_http_infer_is_refused_as_triton_does(server: KilnProcess) -> None:
    for body in ({"inputs": [{"name": "WAIT", "shape": [1], "datatype": "UINT32", "data": [0]}]},  # also invalid
                 {"inputs": [{"name": "IN", "shape": [1], "datatype": "INT32", "data": [1]},
                             {"name": "DELAY", "shape": [1], "datatype": "UINT32", "data": [1]},
                             {"name": "WAIT", "shape": [1], "datatype": "UINT32", "data": [0]}]}):
        reply = httpx.post(f"http://{server.http_url}/v2/models/repeat_int32/infer", json=body)
        assert reply.status_code == 501
        assert reply.json() == {"error": "HTTP end point doesn't support models with decoupled transaction policy"}


# -- HTTP generate -----------------------------------------------------------------------------------------------


def _events(body: str) -> list[dict[str, Any]]:
    chunks = body.split("\n\n")
    assert chunks[-1] == ""  # every event ends with a blank line
    assert all(chunk.startswith("data: ") for chunk in chunks[:-1])
    return [json.loads(chunk[len("data: "):]) for chunk in chunks[:-1]]


def test_generate_stream_sends_each_response_as_an_event(server: KilnProcess) -> None:
    url = f"http://{server.http_url}/v2/models/repeat_int32/generate_stream"
    with httpx.stream("POST", url, json={"IN": [4, 5, 6], "DELAY": [1, 1, 1], "WAIT": 0}) as reply:
        assert reply.status_code == 200
        assert reply.headers["content-type"] == "text/event-stream; charset=utf-8"
        body = reply.read().decode()
    events = _events(body)
    assert [(e["OUT"], e["IDX"]) for e in events] == [(4, 0), (5, 1), (6, 2)]
    assert all(e["model_name"] == "repeat_int32" and e["model_version"] == "1" for e in events)


def test_generate_stream_carries_errors_as_events(server: KilnProcess) -> None:
    url = f"http://{server.http_url}/v2/models/decoupled_errors/generate_stream"
    reply = httpx.post(url, json={"COUNT": 3, "FAIL_AT": 1})
    assert reply.status_code == 200
    assert _events(reply.text) == [
        {"model_name": "decoupled_errors", "model_version": "1", "OUT": 0},
        {"error": "model 'decoupled_errors': index 1 failed"},
        {"model_name": "decoupled_errors", "model_version": "1", "OUT": 2}]
    first_fails = httpx.post(url, json={"COUNT": 1, "FAIL_AT": 0})
    assert first_fails.status_code == 500  # TritonError's default code, INTERNAL, set by the first response
    assert _events(first_fails.text) == [{"error": "model 'decoupled_errors': index 0 failed"}]


def test_generate_stream_refuses_a_bad_request_with_a_json_error(server: KilnProcess) -> None:
    reply = httpx.post(f"http://{server.http_url}/v2/models/repeat_int32/generate_stream", json={"IN": [1]})
    assert reply.status_code == 400 and reply.headers["content-type"] == "application/json"
    assert "missing input(s) DELAY, WAIT" in reply.json()["error"]


def test_generate_needs_exactly_one_response(server: KilnProcess) -> None:
    url = f"http://{server.http_url}/v2/models/repeat_int32/generate"
    one = httpx.post(url, json={"IN": 9, "DELAY": 1, "WAIT": [0]})  # scalars are tensors of one element
    assert one.status_code == 200
    assert one.json() == {"model_name": "repeat_int32", "model_version": "1", "OUT": 9, "IDX": 0}
    for values in ([], [1, 2]):
        reply = httpx.post(url, json={"IN": values, "DELAY": [1] * len(values), "WAIT": 0})
        assert reply.status_code == 400
        assert reply.json()["error"].startswith("generate expects model to produce exactly 1 response")


def test_generate_on_a_model_that_is_not_decoupled(server: KilnProcess) -> None:
    """simple_string batches: the batch dimension 1 comes first; strings in, strings out."""
    numbers = [str(i) for i in range(16)]
    reply = httpx.post(f"http://{server.http_url}/v2/models/simple_string/versions/1/generate",
                       json={"INPUT0": numbers, "INPUT1": ["1"] * 16, "parameters": {"temperature": 0.5}})
    assert reply.status_code == 200, reply.text
    doc = reply.json()
    assert doc["OUTPUT0"] == [str(i + 1) for i in range(16)] and doc["OUTPUT1"] == [str(i - 1) for i in range(16)]


@pytest.mark.parametrize(("body", "message"), [
    ({"INPUT0": 5}, "input 'INPUT0' (BYTES) takes strings"),
    ({"INPUT0": ["a"], "extra": {"nested": 1}}, "parameter 'extra' has invalid type"),
    ({"INPUT0": ["a"], "parameters": 3}, "'parameters' must be an object"),
    ([1, 2], "the body must be a JSON object"),
])
def test_generate_refuses_what_it_cannot_map(server: KilnProcess, body: Any, message: str) -> None:
    reply = httpx.post(f"http://{server.http_url}/v2/models/simple_identity/generate", json=body)
    assert reply.status_code == 400 and message in reply.json()["error"]


# -- statistics --------------------------------------------------------------------------------------------------


def test_response_statistics(server: KilnProcess, stream: Stream) -> None:
    stream.client.async_stream_infer("repeat_stats", _repeat_inputs([1, 2, 3]), enable_empty_final_response=True)
    stream.until_final()
    http_stats = httpx.get(f"http://{server.http_url}/v2/models/repeat_stats/stats").json()["model_stats"][0]
    assert http_stats["inference_stats"]["success"]["count"] == 1
    assert (http_stats["inference_count"], http_stats["execution_count"]) == (1, 1)
    by_index = http_stats["response_stats"]
    assert list(by_index) == ["0", "1", "2", "3"]
    for key in ("0", "1", "2"):
        entry = by_index[key]
        assert (entry["success"]["count"], entry["fail"]["count"], entry["empty_response"]["count"]) == (1, 0, 0)
        assert entry["compute_infer"]["count"] == entry["compute_output"]["count"] == 1
        assert entry["success"]["ns"] == entry["compute_infer"]["ns"] + entry["compute_output"]["ns"]
        assert entry["compute_infer"]["ns"] >= 1_000_000  # each response waited its DELAY of 1 ms
    assert by_index["3"]["empty_response"]["count"] == 1 and by_index["3"]["success"]["count"] == 0
    grpc_stats = stream.client.get_inference_statistics("repeat_stats").model_stats[0].response_stats
    assert sorted(grpc_stats) == ["0", "1", "2", "3"]
    assert grpc_stats["1"].success.count == 1 and grpc_stats["1"].success.ns == by_index["1"]["success"]["ns"]
    assert grpc_stats["3"].empty_response.count == 1


def test_failed_responses_count_in_response_statistics(server: KilnProcess, stream: Stream) -> None:
    stream.client.async_stream_infer("decoupled_errors", _errors_inputs(2, 0), enable_empty_final_response=True)
    stream.until_final()
    stats = stream.client.get_inference_statistics("decoupled_errors").model_stats[0].response_stats
    assert stats["0"].fail.count >= 1 and stats["0"].fail.ns > 0  # other tests call the model too: at least
    assert stats["1"].success.count >= 1 and stats["2"].empty_response.count >= 1


# -- BLS ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("use_async", [False, True])
def test_bls_calls_a_decoupled_model_with_decoupled_true(server: KilnProcess, use_async: bool) -> None:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    inputs = [grpcclient.InferInput("VALUES", [3], "INT32"), grpcclient.InferInput("ASYNC", [1], "BOOL")]
    inputs[0].set_data_from_numpy(np.array([5, 6, 7], np.int32))
    inputs[1].set_data_from_numpy(np.array([use_async]))
    result = client.infer("bls_decoupled", inputs)
    assert result.as_numpy("OUTS").tolist() == [5, 6, 7]
    assert result.as_numpy("EMPTY").tolist() == [1]  # repeat_int32 ends with the final flag alone
