"""CUDA shared memory on a real GPU: `kiln serve --allow-client-shm` in a subprocess, the official tritonclient
(HTTP and gRPC) registering device memory a client allocated and exported as a CUDA IPC handle, inputs read on
the device (PyTorch backend) or copied to the host (ONNX Runtime), outputs written into the region, bad handles
and offsets, and many concurrent requests on one region.

The client side uses ``tritonclient.utils.cuda_shared_memory`` when its dependency (cuda-python) is installed,
else cupy producing the same raw handle (base64 of the 64-byte ``cudaIpcMemHandle_t``)."""

from __future__ import annotations

import base64
import uuid
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import tritonclient.grpc as grpcclient  # noqa: E402
import tritonclient.http as httpclient  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from kiln.demo import build_demo_repository  # noqa: E402
from kiln.server.cuda_ipc import unavailable_reason  # noqa: E402
from kiln.testing.repo import write_model  # noqa: E402
from kiln.testing.serve import KilnProcess, kiln_serve  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.conformance,
              pytest.mark.skipif(not torch.cuda.is_available() or unavailable_reason() is not None,
                                 reason=f"needs a CUDA device and cuda-python or cupy ({unavailable_reason()})")]

_DOUBLE = """name: "double"
platform: "pytorch_libtorch"
max_batch_size: 8
input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 4 ] } ]
instance_group [ { kind: KIND_GPU count: 1 } ]
"""
# The same model batched and replayed from CUDA graphs: region inputs of several requests are joined on the device.
_DOUBLE_BATCHED = _DOUBLE.replace('name: "double"', 'name: "double_batched"') + """
dynamic_batching { max_queue_delay_microseconds: 20000 }
parameters { key: "cuda_graphs" value { string_value: "true" } }
"""


class _Double(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


class ClientRegion:
    """Device memory a client allocates and exports: tritonclient's utilities, or cupy with the same handle."""

    def __init__(self, byte_size: int) -> None:
        self.name = f"cuda_{uuid.uuid4().hex[:8]}"
        self.byte_size = byte_size
        try:
            import tritonclient.utils.cuda_shared_memory as cudashm
        except (ImportError, RuntimeError):  # RuntimeError: tritonclient's message that cuda-python is missing
            import cupy

            self._cudashm: Any = None
            self._array = cupy.zeros(byte_size, dtype=cupy.uint8)
            self.raw_handle = base64.b64encode(cupy.cuda.runtime.ipcGetMemHandle(self._array.data.ptr))
        else:
            self._cudashm = cudashm
            self._handle = cudashm.create_shared_memory_region(self.name, byte_size, 0)
            self.raw_handle = cudashm.get_raw_handle(self._handle)

    def write(self, offset: int, array: np.ndarray) -> None:
        data = np.ascontiguousarray(array).view(np.uint8).reshape(-1)
        if self._cudashm is None:
            import cupy

            self._array[offset:offset + data.size] = cupy.asarray(data)
            cupy.cuda.runtime.deviceSynchronize()
        else:
            current = self.read(0, np.uint8, (self.byte_size,))
            current[offset:offset + data.size] = data
            self._cudashm.set_shared_memory_region(self._handle, [current])

    def read(self, offset: int, dtype: Any, shape: tuple[int, ...]) -> np.ndarray:
        if self._cudashm is None:
            import cupy

            raw = cupy.asnumpy(self._array)
        else:
            raw = self._cudashm.get_contents_as_numpy(self._handle, np.uint8, [self.byte_size])
        count = int(np.prod(shape)) * np.dtype(dtype).itemsize
        return raw[offset:offset + count].copy().view(dtype).reshape(shape)

    def destroy(self) -> None:
        if self._cudashm is not None:
            self._cudashm.destroy_shared_memory_region(self._handle)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnProcess]:
    repo = tmp_path_factory.mktemp("repo")
    build_demo_repository(repo)
    for name, config in (("double", _DOUBLE), ("double_batched", _DOUBLE_BATCHED)):
        folder = write_model(repo, name, config=config)
        (folder / "1").mkdir(exist_ok=True)
        with warnings.catch_warnings():  # torch deprecates TorchScript, which the backend still serves
            warnings.filterwarnings("ignore", category=DeprecationWarning)
            torch.jit.script(_Double()).save(str(folder / "1" / "model.pt"))
    log = tmp_path_factory.mktemp("log") / "serve.log"
    with kiln_serve([repo], "--allow-client-shm", "true", "--exit-timeout-secs", "5", log_path=log) as process:
        yield process


def _client(protocol: str, server: KilnProcess) -> Any:
    if protocol == "http":
        return httpclient.InferenceServerClient(server.http_url, concurrency=16)
    return grpcclient.InferenceServerClient(server.grpc_url)


def _module(protocol: str) -> Any:
    return httpclient if protocol == "http" else grpcclient


def _status(client: Any) -> dict[str, dict[str, int]]:
    if isinstance(client, httpclient.InferenceServerClient):
        return {r["name"]: {"device_id": r["device_id"], "byte_size": r["byte_size"]}
                for r in client.get_cuda_shared_memory_status()}
    regions = client.get_cuda_shared_memory_status(as_json=True).get("regions", {})
    return {name: {"device_id": int(r.get("device_id", 0)), "byte_size": int(r["byte_size"])}
            for name, r in regions.items()}


@pytest.fixture
def region() -> Iterator[ClientRegion]:
    region = ClientRegion(1024)
    yield region
    region.destroy()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_register_infer_on_device_and_unregister(server: KilnProcess, region: ClientRegion, protocol: str) -> None:
    client, m = _client(protocol, server), _module(protocol)
    assert "cuda_shared_memory" in client.get_server_metadata(**({} if protocol == "http" else {"as_json": True}))[
        "extensions"]
    client.register_cuda_shared_memory(region.name, region.raw_handle, 0, region.byte_size)
    assert _status(client)[region.name] == {"device_id": 0, "byte_size": region.byte_size}
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    region.write(0, x)
    inp = m.InferInput("INPUT__0", [2, 4], "FP32")
    inp.set_shared_memory(region.name, 32)
    out = m.InferRequestedOutput("OUTPUT__0")
    out.set_shared_memory(region.name, 32, offset=64)
    result = client.infer("double", [inp], outputs=[out])
    np.testing.assert_array_equal(region.read(64, np.float32, (2, 4)), x * 2)
    assert result.get_output("OUTPUT__0") is not None  # named in the response, its data in the region

    # ONNX Runtime computes on the host: the server copies the inputs out of the region.
    a, b = np.arange(16, dtype=np.int32).reshape(1, 16), np.full((1, 16), 3, np.int32)
    region.write(128, a)
    region.write(192, b)
    inputs = [m.InferInput("INPUT0", [1, 16], "INT32"), m.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_shared_memory(region.name, 64, offset=128)
    inputs[1].set_shared_memory(region.name, 64, offset=192)
    outputs = [m.InferRequestedOutput("OUTPUT0"), m.InferRequestedOutput("OUTPUT1")]
    outputs[0].set_shared_memory(region.name, 64, offset=256)
    result = client.infer("simple", inputs, outputs=outputs)
    np.testing.assert_array_equal(region.read(256, np.int32, (1, 16)), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
    client.unregister_cuda_shared_memory(region.name)
    assert region.name not in _status(client)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_bad_handles_offsets_and_sizes(server: KilnProcess, region: ClientRegion, protocol: str) -> None:
    client, m = _client(protocol, server), _module(protocol)
    bad_handle = base64.b64encode(bytes(64))
    with pytest.raises(InferenceServerException, match="cannot open the CUDA IPC handle"):
        client.register_cuda_shared_memory("bad", bad_handle, 0, 64)
    with pytest.raises(InferenceServerException, match="device_id 7 is not a CUDA device"):
        client.register_cuda_shared_memory("bad", region.raw_handle, 7, 64)
    with pytest.raises(InferenceServerException, match="exceeds the .* bytes of the device allocation"):
        client.register_cuda_shared_memory("bad", region.raw_handle, 0, 1 << 30)
    client.register_cuda_shared_memory(region.name, region.raw_handle, 0, region.byte_size)
    try:
        with pytest.raises(InferenceServerException, match="already registered"):
            client.register_cuda_shared_memory(region.name, region.raw_handle, 0, region.byte_size)
        inp = m.InferInput("INPUT__0", [2, 4], "FP32")
        inp.set_shared_memory(region.name, 32, offset=1008)
        with pytest.raises(InferenceServerException, match="input 'INPUT__0': shared_memory_offset 1008 \\+ "):
            client.infer("double", [inp])
        inp.set_shared_memory(region.name, 32, offset=2)
        with pytest.raises(InferenceServerException, match="not a multiple of the 4-byte size of FP32"):
            client.infer("double", [inp])
    finally:
        client.unregister_cuda_shared_memory(region.name)


@pytest.mark.parametrize("model", ["double", "double_batched"])
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_many_requests_share_one_region(server: KilnProcess, protocol: str, model: str) -> None:
    count = 48
    region = ClientRegion(count * 64)
    try:
        client = _client(protocol, server)
        client.register_cuda_shared_memory(region.name, region.raw_handle, 0, region.byte_size)
        rows = np.arange(count * 8, dtype=np.float32).reshape(count, 8)
        for i in range(count):
            region.write(i * 64, rows[i])

        def run(i: int) -> None:
            own, m = _client(protocol, server), _module(protocol)
            inp = m.InferInput("INPUT__0", [2, 4], "FP32")
            inp.set_shared_memory(region.name, 32, offset=i * 64)
            out = m.InferRequestedOutput("OUTPUT__0")
            out.set_shared_memory(region.name, 32, offset=i * 64 + 32)
            own.infer(model, [inp], outputs=[out])

        with ThreadPoolExecutor(16) as pool:
            list(pool.map(run, range(count)))
        for i in range(count):
            np.testing.assert_array_equal(region.read(i * 64 + 32, np.float32, (8,)), rows[i] * 2)
        if model == "double_batched":
            stats = httpclient.InferenceServerClient(server.http_url).get_inference_statistics(model)
            sizes = [int(b["batch_size"]) for b in stats["model_stats"][0]["batch_stats"]]
            assert max(sizes) > 2, sizes  # requests of two rows each were batched together
        client.unregister_cuda_shared_memory(region.name)
    finally:
        region.destroy()


def test_direct_engine_takes_and_returns_device_tensors(tmp_path: Path) -> None:
    """DLPack parity on the GPU: torch CUDA tensors (and cupy arrays, where cupy is) in, the same kind out."""
    import kiln

    folder = write_model(tmp_path, "double", config=_DOUBLE)
    (folder / "1").mkdir(exist_ok=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        torch.jit.script(_Double()).save(str(folder / "1" / "model.pt"))
    with kiln.load(folder, kind="gpu") as engine:
        x = torch.arange(8, dtype=torch.float32, device="cuda").reshape(2, 4)
        (out,) = engine.infer({"INPUT__0": x}).values()
        assert isinstance(out, torch.Tensor) and out.is_cuda
        torch.testing.assert_close(out, x * 2)
        try:
            import cupy
        except ImportError:
            return
        y = cupy.arange(8, dtype=cupy.float32).reshape(2, 4)
        (out,) = engine.infer({"INPUT__0": y}).values()
        assert isinstance(out, cupy.ndarray)
        np.testing.assert_array_equal(cupy.asnumpy(out), cupy.asnumpy(y) * 2)
