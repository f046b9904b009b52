"""A/B routing over a real Server with real onnxruntime versions that answer differently (version v scales by v)."""

from __future__ import annotations

import asyncio
import math
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from kiln.config.spec import ModelSpec
from kiln.errors import InvalidArgumentError, ModelNotFoundError, ModelNotReadyError
from kiln.server import InferRequest, InputTensor, Server, ServerOptions
from kiln.server.registry import UNLOADED_REMEMBERED
from kiln.server.routing import parse_routing_config, parse_weights, rendezvous
from kiln.tensor import DataType
from kiln.testing import IR_VERSION, OPSET, write_model
from kiln.v2._generated import model_config_pb2 as pb


def scale_model(scale: float) -> onnx.ModelProto:
    """``OUTPUT0 = INPUT0 * scale`` over FP32 [batch, 4]."""
    x = helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, ["batch", 4])
    y = helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, ["batch", 4])
    k = helper.make_tensor("k", TensorProto.FLOAT, [], [scale])
    graph = helper.make_graph([helper.make_node("Mul", ["INPUT0", "k"], ["OUTPUT0"])], "scale", [x], [y], [k])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = IR_VERSION
    return model


def ab_config(**parameters: str) -> str:
    lines = [f'parameters {{ key: "{k}" value {{ string_value: "{v}" }} }}' for k, v in parameters.items()]
    return "\n".join(['name: "ab"', 'backend: "onnxruntime"', "max_batch_size: 8", "version_policy { all {} }",
                      *lines]) + "\n"


def write_ab(repo: Path, config: str, versions: tuple[int, ...] = (1, 2)) -> None:
    for version in versions:
        write_model(repo, "ab", scale_model(float(version)), config, versions=(version,))


def request(version: str = "", **parameters: str) -> InferRequest:
    x = np.ones((1, 4), dtype=np.float32)
    return InferRequest("ab", [InputTensor("INPUT0", DataType.FP32, x.shape, x)], model_version=version,
                        parameters=parameters)


def served(server: Server, req: InferRequest) -> str:
    """The version that answered, checked against the answer itself (version v multiplies by v)."""
    response = server.infer_sync(req)
    np.testing.assert_allclose(response.outputs[0].data, np.full((1, 4), float(response.model_version)))
    return response.model_version


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    write_ab(tmp_path, ab_config(**{"kiln.ab.weights": "1:70,2:30"}))
    return tmp_path


@pytest.fixture
def server(repo: Path) -> Iterator[Server]:
    server = Server(ServerOptions(repositories=[repo], control_mode="poll"))
    assert server.start() == []
    yield server
    server.close()


def test_weighted_split_over_2000_requests_is_within_five_sigma(server: Server) -> None:
    counts = Counter(served(server, request()) for _ in range(2000))
    n, p = 2000, 0.3
    assert abs(counts["2"] - n * p) <= 5 * math.sqrt(n * p * (1 - p)), counts
    status = server.routing("ab")
    assert {v.version: v.routed for v in status.versions} == {"1": counts["1"], "2": counts["2"]}
    assert status.source == "config" and status.weights == {"1": 70.0, "2": 30.0}
    assert [v.share for v in status.versions] == pytest.approx([0.7, 0.3])
    assert all(v.p50_ms is not None and v.p50_ms <= v.p90_ms <= v.p99_ms for v in status.versions)  # type: ignore


def test_async_infer_routes_too(server: Server) -> None:
    async def many() -> Counter[str]:
        responses = await asyncio.gather(*(server.infer(request()) for _ in range(200)))
        return Counter(r.model_version for r in responses)

    counts = asyncio.run(many())
    assert set(counts) == {"1", "2"} and counts["1"] > counts["2"]


def test_a_routing_key_always_meets_the_same_version(server: Server) -> None:
    first = {f"user-{i}": served(server, request(routing_key=f"user-{i}")) for i in range(60)}
    for _ in range(3):
        assert {key: served(server, request(routing_key=key)) for key in first} == first
    assert set(first.values()) == {"1", "2"}  # the keys still spread over both versions


def test_an_explicit_version_wins_over_the_weights(server: Server) -> None:
    assert {served(server, request("2", routing_key="k")) for _ in range(20)} == {"2"}
    explicit = {v.version: v.explicit for v in server.routing("ab").versions}
    assert explicit == {"1": 0, "2": 20}


def test_weights_change_at_run_time_without_a_reload(server: Server) -> None:
    status = server.set_routing("ab", weights={"2": 1})
    assert status.source == "runtime" and status.weights == {"2": 1.0}
    assert {served(server, request()) for _ in range(50)} == {"2"}
    server.set_routing("ab", weights={})
    assert {served(server, request()) for _ in range(20)} == {"2"}  # no weights: the newest version
    server.set_routing("ab", weights={1: 5, 2: 0})
    assert {served(server, request(routing_key=f"u{i}")) for i in range(50)} == {"1"}


def test_runtime_settings_survive_a_reload_with_the_same_parameters_only(server: Server, repo: Path) -> None:
    server.set_routing("ab", weights={"1": 1})
    (repo / "ab" / "2" / "extra.txt").write_text("changes the version folder, not the kiln.* parameters")
    assert server.poll() == ["ab"]
    assert server.routing("ab").source == "runtime"
    assert {served(server, request()) for _ in range(20)} == {"1"}
    (repo / "ab" / "config.pbtxt").write_text(ab_config(**{"kiln.ab.weights": "2:1"}))
    assert server.poll() == ["ab"]
    assert server.routing("ab").source == "config"
    assert {served(server, request()) for _ in range(20)} == {"2"}


def test_a_listed_version_that_is_not_loaded_is_skipped(tmp_path: Path) -> None:
    write_ab(tmp_path, ab_config(**{"kiln.ab.weights": "1:50,7:50"}))
    server = Server(ServerOptions(repositories=[tmp_path]))
    server.start()
    try:
        assert {served(server, request()) for _ in range(40)} == {"1"}
        shares = {v.version: (v.ready, v.share) for v in server.routing("ab").versions}
        assert shares == {"1": (True, 1.0), "2": (True, 0.0), "7": (False, 0.0)}
        server.set_routing("ab", weights={"7": 1})  # none of the listed versions loaded: the newest serves
        assert {served(server, request()) for _ in range(10)} == {"2"}
    finally:
        server.close()


def test_without_weights_the_newest_version_serves(tmp_path: Path) -> None:
    write_ab(tmp_path, ab_config())
    server = Server(ServerOptions(repositories=[tmp_path]))
    server.start()
    try:
        assert {served(server, request(routing_key="x")) for _ in range(20)} == {"2"}
        assert server.routing("ab").source == "none"
    finally:
        server.close()


def test_bad_config_parameters_fail_the_load(tmp_path: Path) -> None:
    write_ab(tmp_path, ab_config(**{"kiln.ab.weights": "1:70,2:lots"}))
    server = Server(ServerOptions(repositories=[tmp_path]))
    try:
        assert server.start() == ["ab"]
        [entry] = server.repository_index()
        assert entry.state == "UNAVAILABLE"
        assert re.search(r"model 'ab'.*kiln\.ab\.weights.*'lots'.*number >= 0", entry.reason)
        with pytest.raises(ModelNotReadyError, match=r"kiln\.ab\.weights"):
            server.infer_sync(request("1"))
    finally:
        server.close()


@pytest.mark.parametrize(("weights", "shadow", "fraction", "message"), [
    ({"x": 1}, None, None, r"model 'ab': routing weights has version 'x'; expected a positive version number"),
    ({"1": -1}, None, None, r"gives version 1 the weight '-1'; expected a number >= 0"),
    ({"1": 0}, None, None, r"expected at least one weight above 0"),
    (None, "2", 1.5, r"shadow fraction is '1.5'; expected a fraction in \[0, 1\]"),
    (None, "2", None, r"shadow version 2 was given without a fraction"),
    (None, None, 0.5, r"a shadow fraction was given without a shadow version"),
])
def test_set_routing_refuses_bad_values(server: Server, weights: dict[str, float] | None, shadow: str | None,
                                        fraction: float | None, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        server.set_routing("ab", weights=weights, shadow_version=shadow, shadow_fraction=fraction)


def test_routing_of_an_unknown_model_is_not_found(server: Server) -> None:
    with pytest.raises(ModelNotFoundError):
        server.routing("nope")


# -- config parsing and hashing, without a server -------------------------------------------------------------------


def spec(sequence: bool = False, **parameters: str) -> ModelSpec:
    config = pb.ModelConfig(name="m")
    if sequence:
        config.sequence_batching.SetInParent()
    return ModelSpec("m", "onnxruntime", "", 8, (), (), config, parameters)


def test_config_parameters_parse() -> None:
    config = parse_routing_config(spec(**{"kiln.ab.weights": " 1:90, 2:10 ", "kiln.ab.key": "user",
                                          "kiln.shadow.version": "3", "kiln.shadow.fraction": "0.25",
                                          "kiln.shadow.atol": "0.01"}))
    assert dict(config.weights) == {1: 90.0, 2: 10.0} and config.key_parameter == "user"
    assert (config.shadow_version, config.shadow_fraction, config.atol, config.rtol) == (3, 0.25, 0.01, 1e-3)
    assert parse_routing_config(spec(other="x")).weights == {}


@pytest.mark.parametrize(("parameters", "message"), [
    ({"kiln.ab.weights": "1=90"}, r"model 'm': parameter 'kiln.ab.weights' is '1=90'; expected comma-separated"),
    ({"kiln.ab.weights": "1:5,1:6"}, r"names version 1 twice"),
    ({"kiln.ab.weights": "0:5"}, r"kiln.ab.weights has version '0'; expected a positive version number"),
    ({"kiln.ab.weights": "1:nan"}, r"the weight 'nan'; expected a number >= 0"),
    ({"kiln.ab.weight": "1:1"}, r"unknown config parameter 'kiln.ab.weight'; the routing parameters are"),
    ({"kiln.ab.key": " "}, r"parameter 'kiln.ab.key' is empty"),
    ({"kiln.shadow.version": "2"}, r"'kiln.shadow.version' is set without 'kiln.shadow.fraction'"),
    ({"kiln.shadow.fraction": "0.5"}, r"'kiln.shadow.fraction' is set without 'kiln.shadow.version'"),
    ({"kiln.shadow.version": "2", "kiln.shadow.fraction": "2"}, r"kiln.shadow.fraction is '2'; expected a fraction"),
    ({"kiln.shadow.version": "2", "kiln.shadow.fraction": "1", "kiln.shadow.rtol": "-1"},
     r"parameter 'kiln.shadow.rtol' is '-1'; expected a number >= 0"),
])
def test_bad_config_parameters_are_named(parameters: dict[str, str], message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        parse_routing_config(spec(**parameters))


def test_sequence_models_refuse_routing() -> None:
    with pytest.raises(InvalidArgumentError, match=r"model 'm'.*needs a stateless model.*sequence_batching"):
        parse_routing_config(spec(sequence=True, **{"kiln.ab.weights": "1:1"}))


def test_rendezvous_shares_follow_the_weights() -> None:
    counts = Counter(rendezvous(f"key-{i}", {1: 3.0, 2: 1.0}) for i in range(8000))
    n, p = 8000, 0.25
    assert abs(counts[2] - n * p) <= 5 * math.sqrt(n * p * (1 - p))


def test_a_weight_change_moves_only_the_keys_it_must() -> None:
    keys = [f"key-{i}" for i in range(4000)]
    before = {k: rendezvous(k, parse_weights("m", "1:90,2:10")) for k in keys}
    after = {k: rendezvous(k, parse_weights("m", "1:50,2:50")) for k in keys}
    assert all(after[k] == 2 for k in keys if before[k] == 2)  # version 2 only gains keys
    moved = sum(before[k] != after[k] for k in keys)
    assert 0.3 * len(keys) < moved < 0.5 * len(keys)  # about 40% (90 -> 50 of the share) move, not all
    added = {k: rendezvous(k, {1: 90.0, 2: 10.0, 3: 10.0}) for k in keys}
    assert all(added[k] in (before[k], 3) for k in keys)  # a new version takes keys, never reshuffles the rest


def test_a_model_published_again_and_again_keeps_state_for_its_current_versions_only(tmp_path: Path) -> None:
    """A long-running server whose model gets a new version every few seconds: the routing status and the index
    must not grow with every version ever served (each kept a latency reservoir)."""
    config = ab_config().replace("version_policy { all {} }", "version_policy { latest { num_versions: 2 } }")
    write_ab(tmp_path, config, versions=(1,))
    server = Server(ServerOptions(repositories=[tmp_path], control_mode="explicit", load_models=("ab",)))
    assert server.start() == []
    try:
        published = 60
        for version in range(2, published + 1):
            write_ab(tmp_path, config, versions=(version,))
            server.load_model("ab")
            assert served(server, request()) == str(version)
            assert served(server, request(str(version - 1))) == str(version - 1)
        listed = [v.version for v in server.routing("ab").versions]
        assert listed == [str(published - 1), str(published)]
        assert all(v.routed + v.explicit >= 1 for v in server.routing("ab").versions)
        index = [e for e in server.repository_index() if e.name == "ab"]
        assert len(index) <= 2 + UNLOADED_REMEMBERED
        assert {e.version for e in index} >= {str(published), str(published - 2)}  # the newest unloaded is named
        with pytest.raises(ModelNotReadyError, match="version 50 is not available"):
            server.infer_sync(request("50"))
    finally:
        server.close()
