"""A Python model in its own process (KILN_EXECUTION_ISOLATION process) dies: the batch inside fails with the
cause, the server and the other models keep answering, a new process serves the next requests, and after too
many deaths the version is UNAVAILABLE with the reason."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

import kiln
from kiln.engines.python import IsolatedPythonEngine
from kiln.errors import ConfigError, KilnError
from kiln.testing.serve import KilnProcess, kiln_serve

from ._models import CRASHING_CONFIG, CRASHING_MODEL, write_identity_model, write_python_model

MAX_RESTARTS = 3


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnProcess]:
    repo = tmp_path_factory.mktemp("repo")
    write_python_model(repo, "crashy", CRASHING_CONFIG % MAX_RESTARTS, CRASHING_MODEL)
    write_identity_model(repo)
    with kiln_serve([repo], "--model-control-mode", "explicit", "--load-model", "*",
                    log_path=tmp_path_factory.mktemp("log") / "kiln.log") as process:
        yield process


def infer(client: httpclient.InferenceServerClient, model: str, value: int) -> dict[str, np.ndarray]:
    x = httpclient.InferInput("X", [1, 1], "INT64")
    x.set_data_from_numpy(np.array([[value]], np.int64))
    result = client.infer(model, [x])
    response = result.get_response()
    return {output["name"]: result.as_numpy(output["name"]) for output in response["outputs"]}


def failure(client: httpclient.InferenceServerClient, value: int) -> str:
    with pytest.raises(InferenceServerException) as caught:
        infer(client, "crashy", value)
    assert caught.value.status() == "503", caught.value
    return str(caught.value.message())


def crashy_reason(client: httpclient.InferenceServerClient) -> tuple[str, str]:
    rows = [row for row in client.get_model_repository_index() if row["name"] == "crashy"]
    assert len(rows) == 1, rows
    return rows[0]["state"], rows[0].get("reason", "")


def test_deaths_fail_their_batch_and_a_new_process_serves(server: KilnProcess) -> None:
    client = httpclient.InferenceServerClient(server.http_url)
    first_pid = int(infer(client, "crashy", 1)["PID"][0, 0])
    pids = {first_pid}
    for value, how in ((3, "exited with code 3"), (9, "killed by signal SIGKILL"), (11, "killed by signal SIGSEGV")):
        message = failure(client, value)
        assert "model 'crashy'" in message and how in message, message
        assert (infer(client, "steady", 5)["Y"] == 5).all()  # the other model answers meanwhile
        state, reason = crashy_reason(client)
        assert state == "READY" and how in reason, (state, reason)
        answer = infer(client, "crashy", 4)  # a new process, after the backoff
        assert (answer["Y"] == 8).all()
        pids.add(int(answer["PID"][0, 0]))
    assert len(pids) == 4  # the first process and one new one after each death
    assert server.process.poll() is None
    assert client.is_server_live()


def test_too_many_deaths_make_the_version_unavailable(server: KilnProcess) -> None:
    client = httpclient.InferenceServerClient(server.http_url)
    for _ in range(MAX_RESTARTS):
        failure(client, 3)
    message = failure(client, 3)
    assert "not restarted" in message and "KILN_MAX_RESTARTS" in message, message
    state, reason = crashy_reason(client)
    assert state == "UNAVAILABLE" and "exited with code 3" in reason and "not restarted" in reason, (state, reason)
    assert "not restarted" in failure(client, 1)  # no more processes, even for good input
    assert not client.is_model_ready("crashy")
    assert (infer(client, "steady", 7)["Y"] == 7).all()
    assert server.process.poll() is None

    client.load_model("crashy")  # loading it again starts over
    assert crashy_reason(client) == ("READY", "")
    assert (infer(client, "crashy", 4)["Y"] == 8).all()


def isolated_model(tmp_path: Path, extra_config: str = "", source: str = CRASHING_MODEL) -> Path:
    config = (CRASHING_CONFIG % MAX_RESTARTS) + extra_config
    write_python_model(tmp_path, "crashy", config, source)
    return tmp_path / "crashy"


def test_the_direct_path_runs_an_isolated_model_in_another_process(tmp_path: Path) -> None:
    with kiln.load(isolated_model(tmp_path)) as engine:
        assert isinstance(engine, IsolatedPythonEngine)
        out = engine.infer({"X": np.array([[2], [5]], np.int64)})
        assert out["Y"].tolist() == [[4], [10]]
        assert int(out["PID"][0, 0]) == engine.pid != os.getpid()


def test_decoupled_and_unknown_isolation_are_refused(tmp_path: Path) -> None:
    decoupled = isolated_model(tmp_path / "a", "model_transaction_policy { decoupled: true }")
    with pytest.raises(ConfigError, match="model 'crashy': a decoupled model cannot run with "
                                          "KILN_EXECUTION_ISOLATION process"):
        kiln.load(decoupled)
    config = CRASHING_CONFIG.replace('string_value: "process"', 'string_value: "thread"') % MAX_RESTARTS
    write_python_model(tmp_path / "b", "crashy", config, CRASHING_MODEL)
    with pytest.raises(ConfigError, match="KILN_EXECUTION_ISOLATION is 'thread'; expected one of none, process"):
        kiln.load(tmp_path / "b" / "crashy")


BLS_MODEL = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        call = pb_utils.InferenceRequest(model_name="other", requested_output_names=["Y"],
                                         inputs=[pb_utils.get_input_tensor_by_name(requests[0], "X")])
        answer = call.exec()
        raise pb_utils.TritonModelException(answer.error().message())
'''


def test_bls_from_an_isolated_model_says_why_it_is_unavailable(tmp_path: Path) -> None:
    with kiln.load(isolated_model(tmp_path, source=BLS_MODEL)) as engine, \
            pytest.raises(KilnError, match="runs in its own process .* calling model 'other' \\(BLS\\) is not"):
        engine.infer({"X": np.array([[1]], np.int64)})
