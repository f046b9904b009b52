"""A/B routing end to end: a `kiln serve` process, the official tritonclient, raw HTTP and `kiln ab report`.

Version v of the model multiplies its input by v, so every answer shows which version gave it.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import onnx
import pytest
import tritonclient.http as httpclient
from onnx import TensorProto, helper

from kiln.server.capture import CaptureStore, Sample
from kiln.testing import IR_VERSION, OPSET, write_model
from kiln.testing.serve import KilnProcess, kiln_serve

CONFIG = """name: "ab"
backend: "onnxruntime"
max_batch_size: 8
version_policy { all {} }
parameters { key: "kiln.ab.weights" value { string_value: "1:50,2:50" } }
parameters { key: "kiln.shadow.version" value { string_value: "3" } }
parameters { key: "kiln.shadow.fraction" value { string_value: "1" } }
"""
KEYS = [f"user-{i}" for i in range(24)]


def scale_model(scale: float) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, ["batch", 4])
    y = helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, ["batch", 4])
    k = helper.make_tensor("k", TensorProto.FLOAT, [], [scale])
    graph = helper.make_graph([helper.make_node("Mul", ["INPUT0", "k"], ["OUTPUT0"])], "scale", [x], [y], [k])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = IR_VERSION
    return model


@pytest.fixture(scope="module")
def kiln_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnProcess]:
    repo = tmp_path_factory.mktemp("repo")
    for version, scale in ((1, 1.0), (2, 2.0), (3, 1.0)):
        write_model(repo, "ab", scale_model(scale), CONFIG, versions=(version,))
    log_path = tmp_path_factory.mktemp("log") / "kiln.log"
    with kiln_serve([repo], "--exit-timeout-secs", "5", log_path=log_path) as server:
        yield server


@pytest.fixture
def client(kiln_server: KilnProcess) -> Iterator[httpclient.InferenceServerClient]:
    client = httpclient.InferenceServerClient(kiln_server.http_url)
    yield client
    client.close()


@pytest.fixture
def config_routing(kiln_server: KilnProcess) -> Iterator[None]:
    """Tests that change the routing put the config's weights and shadow back afterwards."""
    yield
    body = {"weights": {"1": 50, "2": 50}, "shadow": {"version": "3", "fraction": 1}}
    httpx.post(f"http://{kiln_server.http_url}/v2/repository/models/ab/kiln/routing", json=body).raise_for_status()


def triton_infer(client: httpclient.InferenceServerClient, **kwargs: object) -> str:
    x = np.ones((1, 4), dtype=np.float32)
    tensor = httpclient.InferInput("INPUT0", [1, 4], "FP32")
    tensor.set_data_from_numpy(x)
    result = client.infer("ab", [tensor], **kwargs)  # type: ignore[arg-type]
    version = result.get_response()["model_version"]
    np.testing.assert_allclose(result.as_numpy("OUTPUT0"), x * float(version))
    return str(version)


def raw_infer(server: KilnProcess, headers: dict[str, str], parameters: dict[str, str] | None = None) -> str:
    body: dict[str, object] = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 4],
                                           "data": [1, 1, 1, 1]}]}
    if parameters:
        body["parameters"] = parameters
    response = httpx.post(f"http://{server.http_url}/v2/models/ab/infer", json=body, headers=headers)
    response.raise_for_status()
    doc = response.json()
    assert doc["outputs"][0]["data"] == [float(doc["model_version"])] * 4
    return str(doc["model_version"])


def routing_url(server: KilnProcess) -> str:
    return f"http://{server.http_url}/v2/repository/models/ab/kiln/routing"


def test_tritonclient_routing_key_parameter_is_sticky(client: httpclient.InferenceServerClient) -> None:
    first = {key: triton_infer(client, parameters={"routing_key": key}) for key in KEYS}
    assert {key: triton_infer(client, parameters={"routing_key": key}) for key in KEYS} == first
    assert set(first.values()) == {"1", "2"}
    assert triton_infer(client, model_version="2", parameters={"routing_key": KEYS[0]}) == "2"


def test_the_http_header_is_the_routing_key(kiln_server: KilnProcess,
                                            client: httpclient.InferenceServerClient) -> None:
    by_parameter = {key: triton_infer(client, parameters={"routing_key": key}) for key in KEYS}
    by_header = {key: raw_infer(kiln_server, {"Kiln-Routing-Key": key}) for key in KEYS}
    assert by_header == by_parameter
    assert {key: triton_infer(client, headers={"kiln-routing-key": key}) for key in KEYS} == by_parameter
    # A parameter in the body wins over the header.
    one, two = (next(k for k in KEYS if by_parameter[k] == v) for v in ("1", "2"))
    assert raw_infer(kiln_server, {"Kiln-Routing-Key": one}, {"routing_key": two}) == "2"


@pytest.mark.usefixtures("config_routing")
def test_weights_change_over_http_without_a_reload(kiln_server: KilnProcess,
                                                   client: httpclient.InferenceServerClient) -> None:
    response = httpx.post(routing_url(kiln_server), json={"weights": {"2": 1}, "shadow": None})
    assert response.status_code == 200, response.text
    status = response.json()
    assert (status["source"], status["weights"], status["shadow"]) == ("runtime", {"2": 1.0}, None)
    assert {triton_infer(client, parameters={"routing_key": key}) for key in KEYS} == {"2"}
    assert httpx.get(routing_url(kiln_server)).json()["weights"] == {"2": 1.0}


@pytest.mark.parametrize(("body", "message"), [
    ({"weights": {"1": "lots"}}, "field 'weights' is {'1': 'lots'}; expected an object of version to weight"),
    ({"weights": {"one": 1}}, "routing weights has version 'one'; expected a positive version number"),
    ({"shadow": {"version": "3", "fraction": 2}}, "shadow fraction is '2.0'; expected a fraction in [0, 1]"),
    ({"weight": {}}, "unknown field 'weight'"),
])
def test_bad_routing_bodies_get_400(kiln_server: KilnProcess, body: dict[str, object], message: str) -> None:
    response = httpx.post(routing_url(kiln_server), json=body)
    assert response.status_code == 400
    assert message in response.json()["error"]


def test_routing_of_an_unknown_model_is_404(kiln_server: KilnProcess) -> None:
    response = httpx.get(f"http://{kiln_server.http_url}/v2/repository/models/nope/kiln/routing")
    assert response.status_code == 404 and "nope" in response.json()["error"]


def ab_report(server: KilnProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kiln.cli", "ab", "report", "ab", "-u", server.http_url, *args],
                          capture_output=True, text=True, timeout=60)


def test_ab_report_shows_counts_latencies_and_shadow_agreement(kiln_server: KilnProcess,
                                                               client: httpclient.InferenceServerClient) -> None:
    for key in KEYS:
        triton_infer(client, parameters={"routing_key": key})
    done = ab_report(kiln_server, "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    versions = {v["version"]: v for v in report["routing"]["versions"]}
    assert versions["1"]["routed"] > 0 and versions["2"]["routed"] > 0
    assert versions["3"]["routed"] == 0 and versions["3"]["requests_success"] > 0  # the shadow's own requests
    assert versions["1"]["p99_ms"] >= versions["1"]["p50_ms"] > 0
    shadow = report["routing"]["shadow"]  # version 3 agrees with version 1's answers, not with version 2's
    assert shadow["version"] == "3" and shadow["agreed"] > 0 and shadow["disagreed"] > 0
    text = ab_report(kiln_server)
    assert text.returncode == 0, text.stderr
    assert "sticky key parameter 'routing_key'" in text.stdout and "p99 ms" in text.stdout
    assert "shadow traffic to version 3 (fraction 1" in text.stdout


def capture(store: CaptureStore, version: str, sample_id: str, x: np.ndarray, local: np.ndarray | None,
            cloud: np.ndarray | None) -> None:
    arrays = {"input/INPUT0": x}
    if local is not None:
        arrays["local/OUTPUT0"] = local
    if cloud is not None:
        arrays["cloud/OUTPUT0"] = cloud
    payload = io.BytesIO()
    np.savez(payload, **arrays)  # type: ignore[arg-type]
    store.add("ab", version, Sample(sample_id), payload.getvalue())


def test_ab_report_compares_captured_answers(kiln_server: KilnProcess, tmp_path: Path) -> None:
    store = CaptureStore(tmp_path, 2**24)
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    capture(store, "1", "a", x, x, x)  # agrees with its reference answer
    capture(store, "2", "b", x, 2 * x, x)  # does not
    capture(store, "2", "c", x + 1, 2 * (x + 1), None)  # no reference: counted, not compared
    done = ab_report(kiln_server, "--capture-dir", str(tmp_path), "--json")
    assert done.returncode == 0, done.stderr
    captures = json.loads(done.stdout)["captures"]
    assert captures["samples"] == {"1": 1, "2": 2}
    assert captures["against_reference"]["1"]["agreed"] == 1
    assert (captures["against_reference"]["2"]["compared"], captures["against_reference"]["2"]["agreed"]) == (1, 0)
    between = captures["between_versions"]["1:2"]  # input x was captured for both versions
    assert (between["compared"], between["agreed"], between["max_abs_diff"]) == (1, 0, 7.0)
    assert captures["note"] == ""
    text = ab_report(kiln_server, "--capture-dir", str(tmp_path))
    assert "version 1 against the reference answers: 1 of 1 samples agree (100.0%)" in text.stdout
    assert "version 1 against version 2 on the same inputs: 0 of 1 samples agree" in text.stdout


def test_ab_report_says_when_captures_give_nothing_to_compare(kiln_server: KilnProcess, tmp_path: Path) -> None:
    store = CaptureStore(tmp_path, 2**24)
    x = np.ones((1, 4), dtype=np.float32)
    capture(store, "1", "a", x, x, None)
    capture(store, "2", "b", x + 1, x, None)
    text = ab_report(kiln_server, "--capture-dir", str(tmp_path))
    assert text.returncode == 0, text.stderr
    assert "nothing to compare: the captured samples of model 'ab' carry no reference answers" in text.stdout


def test_ab_report_names_an_unreachable_server(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "kiln.cli", "ab", "report", "ab", "-u", "127.0.0.1:9"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "cannot reach http://127.0.0.1:9/" in done.stderr and "kiln serve" in done.stderr
