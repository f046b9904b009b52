"""Triton's simple_string example, a Triton Python-backend model, through `kiln serve` and the real tritonclient."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from kiln.testing.serve import KilnProcess

pytestmark = pytest.mark.conformance


@pytest.fixture(params=["http", "grpc"])
def client(request: pytest.FixtureRequest, kiln_server: KilnProcess) -> Iterator[tuple[Any, Any]]:
    if request.param == "http":
        raw: Any = httpclient.InferenceServerClient(kiln_server.http_url)
        yield raw, httpclient
    else:
        raw = grpcclient.InferenceServerClient(kiln_server.grpc_url)
        yield raw, grpcclient
    raw.close()


def strings(values: np.ndarray) -> np.ndarray:
    """As Triton's simple_string clients build them: each integer as UTF-8 bytes in an object array."""
    return np.array([str(v).encode("utf-8") for v in values.reshape(-1)], dtype=np.object_).reshape(values.shape)


def infer(raw: Any, module: Any, a: np.ndarray, b: np.ndarray) -> Any:
    inputs = []
    for name, data in (("INPUT0", strings(a)), ("INPUT1", strings(b))):
        tensor = module.InferInput(name, list(data.shape), "BYTES")
        tensor.set_data_from_numpy(data)
        inputs.append(tensor)
    outputs = [module.InferRequestedOutput("OUTPUT0"), module.InferRequestedOutput("OUTPUT1")]
    return raw.infer("simple_string", inputs, outputs=outputs)


def test_sums_and_differences(client: tuple[Any, Any]) -> None:
    raw, module = client
    assert raw.is_model_ready("simple_string")
    a = np.arange(32, dtype=np.int32).reshape(2, 16)
    b = np.full((2, 16), 1, dtype=np.int32)
    result = infer(raw, module, a, b)
    out0, out1 = result.as_numpy("OUTPUT0"), result.as_numpy("OUTPUT1")
    assert out0.shape == out1.shape == (2, 16)
    assert [[int(v) for v in row] for row in out0] == (a + b).tolist()
    assert [[int(v) for v in row] for row in out1] == (a - b).tolist()


def test_metadata_shows_bytes_tensors(client: tuple[Any, Any]) -> None:
    raw, module = client
    metadata = raw.get_model_metadata("simple_string", **({"as_json": True} if module is grpcclient else {}))
    assert [(t["name"], t["datatype"], [int(d) for d in t["shape"]]) for t in metadata["inputs"]] == [
        ("INPUT0", "BYTES", [-1, 16]), ("INPUT1", "BYTES", [-1, 16])]
    assert [t["name"] for t in metadata["outputs"]] == ["OUTPUT0", "OUTPUT1"]


def test_a_non_integer_is_rejected_with_invalid_argument(client: tuple[Any, Any]) -> None:
    raw, module = client
    a = np.arange(16, dtype=np.int32).reshape(1, 16).astype(object)
    a[0, 5] = "five"
    with pytest.raises(InferenceServerException, match="holds b'five', which is not an integer") as raised:
        infer(raw, module, a, np.zeros((1, 16), dtype=np.int32))
    status = raised.value.status()
    assert status in ("400", "StatusCode.INVALID_ARGUMENT")
    assert infer(raw, module, np.ones((1, 16), np.int32), np.ones((1, 16), np.int32)).as_numpy("OUTPUT1")[0, 0] == b"0"
