"""`kiln serve --http-workers 2` as a subprocess, against the same repository served by one process: the same
answers byte for byte (infer JSON and binary, gzip, raw bodies, classification, errors, metadata, API keys),
tritonclient end to end with system shared memory, many concurrent requests, a worker killed and replaced, and
workers that fail to start."""

from __future__ import annotations

import asyncio
import gzip
import json
import shutil
import ssl
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil
import pytest
import tritonclient.http as th
import tritonclient.utils.shared_memory as shm
from prometheus_client.parser import text_string_to_metric_families

from kiln.demo import build_demo_repository
from kiln.engines import register_backend
from kiln.frontends.http.listener import MAX_DEFER_S
from kiln.server import ServerOptions
from kiln.service import Service, ServiceOptions
from kiln.testing.gated import ENTERED, GATE, GatedEngine
from kiln.testing.serve import KilnProcess, kiln_serve

WORKER_MODULE = "kiln.frontends.http.worker"
KEY = "s3cret"
LIMIT = 1 << 20
MIXED = """name: "mixed"
backend: "identity"
max_batch_size: 4
input [ { name: "B" data_type: TYPE_BOOL dims: [ 2 ] }, { name: "H" data_type: TYPE_BF16 dims: [ 2 ] },
        { name: "U" data_type: TYPE_UINT8 dims: [ 2 ] }, { name: "S" data_type: TYPE_STRING dims: [ 2 ] } ]
output [ { name: "B_OUT" data_type: TYPE_BOOL dims: [ 2 ] }, { name: "H_OUT" data_type: TYPE_BF16 dims: [ 2 ] },
         { name: "U_OUT" data_type: TYPE_UINT8 dims: [ 2 ] }, { name: "S_OUT" data_type: TYPE_STRING dims: [ 2 ] } ]
"""
LABELED = """name: "labeled"
backend: "identity"
max_batch_size: 4
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] label_filename: "labels.txt" } ]
"""
BLOB = """name: "blob"
backend: "identity"
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
"""


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("repo")
    build_demo_repository(root)
    for name, config in (("mixed", MIXED), ("labeled", LABELED), ("blob", BLOB)):
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(config)
    (root / "labeled" / "labels.txt").write_text("cat\ndog\nbird\nfish\n")
    return root


def _serve(repo: Path, workers: int, log: Path) -> Any:
    return kiln_serve([repo], "--http-workers", str(workers), "--allow-client-shm", "--allow-model-download",
                      "--api-key", KEY, "--http-max-input-size", str(LIMIT), "--allow-grpc", "false",
                      log_path=log)


@pytest.fixture(scope="module")
def served(repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnProcess]:
    with _serve(repo, 2, tmp_path_factory.mktemp("log") / "workers.log") as process:
        yield process


@pytest.fixture(scope="module")
def single(repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnProcess]:
    with _serve(repo, 1, tmp_path_factory.mktemp("log") / "single.log") as process:
        yield process


def _workers(process: KilnProcess) -> list[psutil.Process]:
    children = psutil.Process(process.process.pid).children()
    return [child for child in children if WORKER_MODULE in " ".join(child.cmdline())]


def _json(doc: Any) -> bytes:
    return json.dumps(doc).encode()


def _binary(doc: dict[str, Any], *blobs: bytes) -> tuple[dict[str, str], bytes]:
    header = _json(doc)
    return {"Inference-Header-Content-Length": str(len(header))}, header + b"".join(blobs)


_SIMPLE = {"inputs": [{"name": f"INPUT{i}", "shape": [1, 16], "datatype": "INT32", "data": list(range(16))}
                      for i in range(2)], "id": "r-1"}
_A = np.arange(16, dtype=np.int32).tobytes()
_MIXED_DOC = {"inputs": [{"name": "B", "shape": [1, 2], "datatype": "BOOL", "data": [True, False]},
                         {"name": "H", "shape": [1, 2], "datatype": "BF16", "data": [1.5, -2.25]},
                         {"name": "U", "shape": [1, 2], "datatype": "UINT8", "data": [0, 255]},
                         {"name": "S", "shape": [1, 2], "datatype": "BYTES", "data": ["h\u00e9", ""]}]}
_MLP = {"inputs": [{"name": "INPUT0", "shape": [2, 64], "datatype": "FP32",
                    "data": np.linspace(-1, 1, 128).round(3).tolist()}]}
# (method, path, headers, body): every answer must be the same bytes from the workers as from one process.
REQUESTS: list[tuple[str, str, dict[str, str], bytes]] = [
    ("POST", "/v2/models/simple/infer", {}, _json(_SIMPLE)),
    ("POST", "/v2/models/simple/versions/1/infer", *_binary(
        {"inputs": [{"name": f"INPUT{i}", "shape": [1, 16], "datatype": "INT32",
                     "parameters": {"binary_data_size": 64}} for i in range(2)],
         "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}, {"name": "OUTPUT1"}]}, _A, _A)),
    ("POST", "/v2/models/simple/infer", {"Content-Encoding": "gzip"}, gzip.compress(_json(_SIMPLE))),
    ("POST", "/v2/models/mlp/infer", {}, _json(_MLP)),
    ("POST", "/v2/models/mixed/infer", {}, _json(_MIXED_DOC)),
    ("POST", "/v2/models/mixed/infer", {}, _json({**_MIXED_DOC, "parameters": {"binary_data_output": True}})),
    ("POST", "/v2/models/labeled/infer", {}, _json({
        "inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [0.1, 0.7, 0.2, 0.0]}],
        "outputs": [{"name": "OUTPUT0", "parameters": {"classification": 2}}]})),
    ("POST", "/v2/models/blob/infer", {"Inference-Header-Content-Length": "0"},
     np.arange(5, dtype=np.float32).tobytes()),
    ("POST", "/v2/models/simple/infer", {"Kiln-Routing-Key": "user-7"}, _json(_SIMPLE)),
    # errors, decoded in the worker and in the server process
    ("POST", "/v2/models/simple/infer", {}, _json({"inputs": [{**_SIMPLE["inputs"][0], "shape": [1, 15],  # type: ignore[dict-item]
                                                              "data": list(range(15))}, _SIMPLE["inputs"][1]]})),
    ("POST", "/v2/models/nope/infer", {}, _json(_SIMPLE)),
    ("POST", "/v2/models/simple/infer", {}, b'{"inputs": [}'),
    ("POST", "/v2/models/simple/infer", {"Inference-Header-Content-Length": "x"}, b"{}"),
    ("POST", "/v2/models/simple/infer", {}, b"[" * 10 + b" " * LIMIT),
    ("POST", "/v2/models/simple/infer", {"Content-Encoding": "br"}, b"abc"),
    # every other route, forwarded
    ("GET", "/v2/health/ready", {}, b""),
    ("GET", "/v2/models/simple", {}, b""),
    ("GET", "/v2/models/mlp/versions/1/config", {}, b""),
    ("GET", "/v2/models/nope/config", {}, b""),
    ("POST", "/v2/repository/index", {}, b""),
    ("POST", "/v2/repository/index", {}, b'{"ready": 1}'),
    ("GET", "/v2/models/simple/infer", {}, b""),
    ("GET", "/v2/no/such/route?x=1", {}, b""),
    ("GET", "/v2/systemsharedmemory/status", {}, b""),
    ("GET", "/v2/kiln/models/simple/versions/1/files", {}, b""),
    ("GET", "/v2/kiln/models/simple/versions/1/files", {"Authorization": "Bearer wrong"}, b""),
    ("GET", "/v2/kiln/models/simple/versions/1/files", {"Authorization": f"Bearer {KEY}"}, b""),
    ("GET", "/v2/kiln/models/simple/versions/1/files/config.pbtxt", {"Authorization": f"Bearer {KEY}"}, b""),
]
COMPARED_HEADERS = ("content-type", "content-length", "inference-header-content-length", "www-authenticate")


@pytest.mark.parametrize("index", range(len(REQUESTS)))
def test_answers_are_the_bytes_one_process_gives(served: KilnProcess, single: KilnProcess, index: int) -> None:
    method, path, headers, body = REQUESTS[index]
    answers = [httpx.request(method, f"http://{p.http_url}{path}", headers=headers, content=body, timeout=30)
               for p in (served, single)]
    workers, one = answers
    assert workers.status_code == one.status_code, (workers.text, one.text)
    assert workers.content == one.content
    assert [workers.headers.get(h) for h in COMPARED_HEADERS] == [one.headers.get(h) for h in COMPARED_HEADERS]


def _simple_inputs(value: int, binary: bool) -> tuple[list[th.InferInput], np.ndarray[Any, Any]]:
    a = np.full((1, 16), value, dtype=np.int32)
    b = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = [th.InferInput("INPUT0", [1, 16], "INT32"), th.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_data_from_numpy(a, binary_data=binary)
    inputs[1].set_data_from_numpy(b, binary_data=binary)
    return inputs, a + b


@pytest.mark.parametrize("binary", [False, True])
def test_tritonclient_infers_through_the_workers(served: KilnProcess, single: KilnProcess, binary: bool) -> None:
    client, reference = th.InferenceServerClient(served.http_url), th.InferenceServerClient(single.http_url)
    inputs, expected = _simple_inputs(5, binary)
    outputs = [th.InferRequestedOutput(n, binary_data=binary) for n in ("OUTPUT0", "OUTPUT1")]
    result = client.infer("simple", inputs, outputs=outputs)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), expected)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), np.full((1, 16), 5) - np.arange(16))
    x = np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32)
    mlp = th.InferInput("INPUT0", [3, 64], "FP32")
    mlp.set_data_from_numpy(x, binary_data=binary)
    got = client.infer("mlp", [mlp]).as_numpy("OUTPUT0")
    want = reference.infer("mlp", [mlp]).as_numpy("OUTPUT0")
    assert got is not None and got.shape == (3, 10)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    strings = np.array([[str(i).encode() for i in range(16)]], dtype=object)  # the model adds integers
    text = [th.InferInput("INPUT0", [1, 16], "BYTES"), th.InferInput("INPUT1", [1, 16], "BYTES")]
    for tensor in text:
        tensor.set_data_from_numpy(strings, binary_data=binary)
    answer = client.infer("simple_string", text)
    assert answer.as_numpy("OUTPUT0").tolist() == reference.infer("simple_string", text).as_numpy("OUTPUT0").tolist()
    identity = th.InferInput("INPUT0", [1, 2], "BYTES")
    element = b"\x00\xffraw" if binary else "t\u00e9xt".encode()  # JSON carries UTF-8 text only
    identity.set_data_from_numpy(np.array([[element, b""]], dtype=object), binary_data=binary)
    assert client.infer("simple_identity", [identity]).as_numpy("OUTPUT0").tolist() == [[element, b""]]


def test_metadata_statistics_and_index_through_the_workers(served: KilnProcess) -> None:
    client = th.InferenceServerClient(served.http_url)
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("simple")
    assert client.get_model_metadata("mlp")["inputs"][0] == {"name": "INPUT0", "datatype": "FP32", "shape": [-1, 64]}
    assert client.get_model_config("simple")["max_batch_size"] == 8
    assert {"name": "simple", "version": "1", "state": "READY", "reason": ""} in client.get_model_repository_index()
    before = client.get_inference_statistics("simple")["model_stats"][0]["inference_stats"]["success"]["count"]
    for value in range(3):
        client.infer("simple", _simple_inputs(value, True)[0])
    after = client.get_inference_statistics("simple")["model_stats"][0]["inference_stats"]["success"]["count"]
    assert after - before == 3  # counted once, in the one server process


def test_system_shared_memory_inputs_and_outputs(served: KilnProcess) -> None:
    client = th.InferenceServerClient(served.http_url)
    key = f"/kiln-workers-test-{time.monotonic_ns()}"
    handle = shm.create_shared_memory_region("io", key, 256)
    try:
        a = np.arange(16, dtype=np.int32).reshape(1, 16)
        shm.set_shared_memory_region(handle, [a, a * 3])
        client.register_system_shared_memory("io", key, 256)
        inputs = [th.InferInput("INPUT0", [1, 16], "INT32"), th.InferInput("INPUT1", [1, 16], "INT32")]
        inputs[0].set_shared_memory("io", 64)
        inputs[1].set_shared_memory("io", 64, offset=64)
        outputs = [th.InferRequestedOutput("OUTPUT0"), th.InferRequestedOutput("OUTPUT1", binary_data=True)]
        outputs[0].set_shared_memory("io", 64, offset=128)
        result = client.infer("simple", inputs, outputs=outputs)
        assert "data" not in result.get_output("OUTPUT0")  # its data went into the region
        np.testing.assert_array_equal(shm.get_contents_as_numpy(handle, np.int32, [1, 16], offset=128), a * 4)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - a * 3)
        client.unregister_system_shared_memory("io")
    finally:
        shm.destroy_shared_memory_region(handle)


def test_many_concurrent_requests_get_their_own_answers(served: KilnProcess) -> None:
    failures: list[str] = []

    def run(thread: int) -> None:
        client = th.InferenceServerClient(served.http_url)
        for round_ in range(15):
            value = thread * 100 + round_
            binary = (thread + round_) % 2 == 0
            inputs, expected = _simple_inputs(value, binary)
            outputs = [th.InferRequestedOutput("OUTPUT0", binary_data=binary)]
            got = client.infer("simple", inputs, outputs=outputs).as_numpy("OUTPUT0")
            x = np.full((1 + round_ % 3, 64), value, np.float32)
            mlp = th.InferInput("INPUT0", list(x.shape), "FP32")
            mlp.set_data_from_numpy(x, binary_data=binary)
            scores = client.infer("mlp", [mlp]).as_numpy("OUTPUT0")
            if got is None or not np.array_equal(got, expected) or scores is None or scores.shape != (len(x), 10) \
                    or not np.allclose(scores, scores[0]):  # identical rows give identical scores
                failures.append(f"thread {thread} round {round_}: {got}")
        client.close()

    threads = [threading.Thread(target=run, args=(t,)) for t in range(8)]  # a connection each: both workers
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert failures == []
    for worker in _workers(served):  # the tensors went through the arenas the server process made
        assert Path(f"/proc/{worker.pid}/maps").read_text().count("memfd:kiln-arena") == 2


def _cpu_metrics(process: KilnProcess) -> dict[tuple[str, str], float]:
    text = urllib.request.urlopen(f"http://{process.metrics_url}/metrics", timeout=10).read().decode()
    return {(family.name, sample.labels["process"]): sample.value for family in text_string_to_metric_families(text)
            if family.name in ("kiln_process_cpu_seconds", "kiln_event_loop_cpu_seconds")
            for sample in family.samples}


def test_the_metrics_give_each_process_and_its_event_loop_their_cpu_time(served: KilnProcess) -> None:
    before = _cpu_metrics(served)
    processes = {"server", "http_worker_0", "http_worker_1"}
    assert set(before) == {(name, label) for name in ("kiln_process_cpu_seconds", "kiln_event_loop_cpu_seconds")
                           for label in processes}

    def run() -> None:
        client = th.InferenceServerClient(served.http_url)
        for value in range(40):
            inputs, _ = _simple_inputs(value, binary=False)  # JSON: parsing it costs the worker's loop
            client.infer("simple", inputs)
        client.close()

    threads = [threading.Thread(target=run) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    after = _cpu_metrics(served)
    for label in processes:
        assert before[("kiln_event_loop_cpu_seconds", label)] <= after[("kiln_event_loop_cpu_seconds", label)] \
            <= after[("kiln_process_cpu_seconds", label)]
    assert after[("kiln_event_loop_cpu_seconds", "server")] > before[("kiln_event_loop_cpu_seconds", "server")]
    assert sum(after[("kiln_event_loop_cpu_seconds", w)] - before[("kiln_event_loop_cpu_seconds", w)]
               for w in ("http_worker_0", "http_worker_1")) > 0


@pytest.mark.parametrize("apart_s", [0.0, 2 * MAX_DEFER_S], ids=["back-to-back", "apart"])
def test_keep_alive_connections_are_spread_evenly_over_the_workers(served: KilnProcess, apart_s: float) -> None:
    """A client opening its pool connection by connection, back to back or further apart than a worker waits for
    another to take its turn, gets them spread by count, not by the kernel's hash: each of 2 workers holds half of
    12, give or take one."""
    port = int(served.http_url.rsplit(":", 1)[1])
    clients = [httpx.Client(base_url=f"http://{served.http_url}", timeout=10) for _ in range(12)]
    try:
        for client in clients:
            assert client.get("/v2/health/live").status_code == 200  # accepted, and kept alive
            time.sleep(apart_s)
        held = [sum(1 for c in worker.net_connections("tcp")
                    if c.status == psutil.CONN_ESTABLISHED and c.laddr.port == port)
                for worker in _workers(served)]
        text = urllib.request.urlopen(f"http://{served.metrics_url}/metrics", timeout=10).read().decode()
        gauge = {sample.labels["process"]: sample.value for family in text_string_to_metric_families(text)
                 if family.name == "kiln_http_worker_connections" for sample in family.samples}
    finally:
        for client in clients:
            client.close()
    assert sum(held) == 12 and max(held) - min(held) <= 2, held
    assert sorted(gauge) == ["http_worker_0", "http_worker_1"] and sum(gauge.values()) == 12, gauge


def test_a_worker_killed_is_replaced_and_requests_keep_succeeding(served: KilnProcess) -> None:
    assert len(_workers(served)) == 2
    victim = _workers(served)[0]
    victim.kill()
    victim.wait(timeout=10)
    deadline = time.monotonic() + 20
    alive: list[psutil.Process] = []
    while time.monotonic() < deadline:
        alive = [w for w in _workers(served) if w.pid != victim.pid and w.is_running()]
        if len(alive) == 2:
            break
        time.sleep(0.1)
    assert len(alive) == 2, "no replacement worker was started"
    for value in range(12):  # new connections go to either worker, the replacement included
        client = th.InferenceServerClient(served.http_url)
        inputs, expected = _simple_inputs(value, value % 2 == 0)
        np.testing.assert_array_equal(client.infer("simple", inputs).as_numpy("OUTPUT0"), expected)
        client.close()


SLOW = """
backend: "slow_for_http_workers_test" max_batch_size: 4
input [ { name: "x" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 2 ] } ]
"""


async def test_sigterm_drains_a_request_in_flight_in_a_worker(tmp_path: Path) -> None:
    register_backend("slow_for_http_workers_test", GatedEngine)
    (tmp_path / "slow" / "1").mkdir(parents=True)
    (tmp_path / "slow" / "config.pbtxt").write_text(SLOW)
    service = Service(ServiceOptions(ServerOptions(repositories=[tmp_path]), http_port=0, metrics_port=0,
                                     allow_grpc=False, http_workers=2, exit_timeout_s=20))
    GATE.clear()
    ENTERED.clear()
    run = asyncio.create_task(service.run())
    while "http" not in service.bound:
        await asyncio.sleep(0.01)
    url = f"http://127.0.0.1:{service.bound['http']}"
    body = {"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}]}
    async with httpx.AsyncClient(timeout=30) as client:
        in_flight = asyncio.create_task(client.post(f"{url}/v2/models/slow/infer", json=body))
        await asyncio.to_thread(ENTERED.wait, 10)
        workers = [p for p in psutil.Process().children() if WORKER_MODULE in " ".join(p.cmdline())]
        assert len(workers) == 2
        service.request_stop()
        await asyncio.sleep(0.3)
        assert not run.done()  # still draining
        GATE.set()
        response = await in_flight
    assert response.status_code == 200
    assert response.json()["outputs"][0]["data"] == [2.0, 3.0]
    assert await asyncio.wait_for(run, 20) == 0
    _, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive, "workers outlived the server"
    with pytest.raises(httpx.ConnectError):  # nothing listens any more
        httpx.get(f"{url}/v2/health/live")


def _self_signed(folder: Path, name: str) -> tuple[Path, Path]:
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "1", "-subj", f"/CN={name}",
                    "-addext", "subjectAltName=IP:127.0.0.1"], cwd=folder, check=True, capture_output=True)
    return folder / f"{name}.pem", folder / f"{name}.key"


@pytest.mark.skipif(shutil.which("openssl") is None, reason="the openssl command line makes the certificates")
def test_workers_terminate_tls_and_require_client_certificates(repo: Path, tmp_path: Path) -> None:
    cert, key = _self_signed(tmp_path, "server")
    client_cert, client_key = _self_signed(tmp_path, "client")
    context = ssl.create_default_context(cafile=str(cert))
    context.load_cert_chain(client_cert, client_key)
    with kiln_serve([repo], "--http-workers", "2", "--allow-grpc", "false", "--https-certfile", str(cert),
                    "--https-keyfile", str(key), "--https-client-ca", str(client_cert), context=context) as served:
        url = f"https://{served.http_url}/v2/models/simple/infer"
        answer = httpx.post(url, content=_json(_SIMPLE), verify=context, timeout=30)
        assert answer.status_code == 200
        assert answer.json()["outputs"][0]["data"] == [2 * i for i in range(16)]
        with pytest.raises(httpx.HTTPError):  # no client certificate: the handshake fails in the worker
            httpx.get(f"https://{served.http_url}/v2/health/ready",
                      verify=ssl.create_default_context(cafile=str(cert)), timeout=10)


def test_generate_stream_events_come_through_the_workers_one_by_one(served: KilnProcess) -> None:
    # A decoupled model's server-sent events are forwarded from the server process as they are produced.
    body = json.dumps({"IN": [4, 5, 6], "DELAY": [1, 1, 1], "WAIT": 1}).encode()
    with urllib.request.urlopen(urllib.request.Request(
            f"http://{served.http_url}/v2/models/repeat_int32/generate_stream", data=body, method="POST"),
            timeout=30) as answer:
        assert answer.headers["Content-Type"].startswith("text/event-stream")
        events = [json.loads(line[len(b"data: "):]) for line in answer.read().splitlines() if line]
    assert [(e["OUT"], e["IDX"]) for e in events] == [(4, 0), (5, 1), (6, 2)]


def test_the_server_is_ready_only_once_every_worker_listens(repo: Path, tmp_path: Path) -> None:
    """A load generator starts at the first ready answer and opens all its connections at once: had one worker
    answered ready while the others were still starting, it would have taken every connection for the whole run."""
    with kiln_serve([repo], "--http-workers", "4", "--allow-grpc", "false", log_path=tmp_path / "serve.log") as served:
        text = urllib.request.urlopen(f"http://{served.metrics_url}/metrics", timeout=10).read().decode()
    listening = sorted(sample.labels["process"] for family in text_string_to_metric_families(text)
                       if family.name == "kiln_http_worker_connections" for sample in family.samples)
    assert listening == [f"http_worker_{index}" for index in range(4)]


def test_workers_that_fail_to_start_stop_the_server_with_the_reason(repo: Path, tmp_path: Path) -> None:
    # The workers load the certificate: each exits before it listens, and the server says why it stops.
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    log = tmp_path / "serve.log"
    with pytest.raises(RuntimeError, match="exited with status 1"):
        with kiln_serve([repo], "--http-workers", "2", "--allow-grpc", "false", "--https-certfile", str(junk),
                        "--https-keyfile", str(junk), log_path=log, ready_timeout_s=30.0):
            pass
    assert "HTTP workers did not start listening" in log.read_text(), log.read_text()
