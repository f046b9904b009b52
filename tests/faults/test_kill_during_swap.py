"""`kiln serve` SIGKILLed while it loads, swaps in or retires a version still serves after a restart: the newest
good version, or the one the repository held before. kiln writes nothing into a repository it polls; an explicit
load that brings its own files writes them into a hidden staging folder, which a restart ignores.

The models are Python models whose initialize and finalize write a marker file and then wait, so the test knows
the server is inside that step when it kills it.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from kiln.testing.serve import kiln_serve

MODEL = '''
import os
import time

import triton_python_backend_utils as pb_utils

MARKERS = {markers!r}


def mark(what):
    with open(os.path.join(MARKERS, what), "w") as f:
        f.write(str(os.getpid()))


def hold(step):
    """Wait while the test holds this step (at most 30 s)."""
    deadline = time.monotonic() + 30
    while os.path.exists(os.path.join(MARKERS, "hold-" + step)) and time.monotonic() < deadline:
        time.sleep(0.02)


class TritonPythonModel:
    def initialize(self, args):
        mark("init-" + args["model_version"])
        hold("init-" + args["model_version"])

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x + {add})]))
        return responses

    def finalize(self):
        mark("fin-" + str({add}))
        hold("fin-" + str({add}))
'''

CONFIG = '''
backend: "python"
max_batch_size: 4
input [ { name: "X" data_type: TYPE_INT64 dims: [ 1 ] } ]
output [ { name: "Y" data_type: TYPE_INT64 dims: [ 1 ] } ]
'''



def model_source(markers: Path, version: int) -> str:
    return MODEL.format(markers=str(markers), add=version)


def publish(repo: Path, version: int, source: str) -> None:
    """A version written into a hidden folder and renamed in, as a careful publisher does."""
    hidden = repo / "adder" / f".publish-{version}"
    hidden.mkdir(parents=True)
    (hidden / "model.py").write_text(source)
    hidden.rename(repo / "adder" / str(version))


def snapshot(repo: Path) -> dict[str, str]:
    return {str(p.relative_to(repo)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(repo.rglob("*")) if p.is_file()}


def answer(http_url: str) -> int:
    client = httpclient.InferenceServerClient(http_url)
    x = httpclient.InferInput("X", [1, 1], "INT64")
    x.set_data_from_numpy(np.array([[100]], np.int64))
    value = int(client.infer("adder", [x]).as_numpy("Y")[0, 0])
    client.close()
    return value - 100


def wait_for(condition: Callable[[], bool], timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s} s"
        time.sleep(0.02)


def load_files(http_url: str, files: dict[str, bytes]) -> None:
    """An explicit load with files; the server is killed before it answers."""
    client = httpclient.InferenceServerClient(http_url, network_timeout=60)
    with contextlib.suppress(Exception):
        client.load_model("adder", files=files)
    client.close()


def repository(tmp_path: Path, markers: Path) -> Path:
    repo = tmp_path / "repo"
    (repo / "adder").mkdir(parents=True)
    (repo / "adder" / "config.pbtxt").write_text(CONFIG)
    publish(repo, 1, model_source(markers, 1))
    return repo


@pytest.mark.parametrize("point", ["published", "loading", "retiring"])
def test_poll_mode_serves_after_a_kill_during_the_swap(tmp_path: Path, point: str) -> None:
    markers = tmp_path / "markers"
    markers.mkdir()
    held = markers / ("hold-init-2" if point == "loading" else "hold-fin-1")
    held.touch()  # the server stays inside that step until the file is gone
    repo = repository(tmp_path, markers)
    poll = ("--model-control-mode", "poll", "--repository-poll-secs", "0.1", "--exit-timeout-secs", "1")
    with kiln_serve([repo], *poll, log_path=tmp_path / "first.log") as server:
        assert answer(server.http_url) == 1
        publish(repo, 2, model_source(markers, 2))
        if point == "loading":
            wait_for(lambda: (markers / "init-2").exists())
        elif point == "retiring":
            wait_for(lambda: (markers / "fin-1").exists())
            assert answer(server.http_url) == 2  # swapped in; the old version is still being released
        before = snapshot(repo)
        server.process.kill()
        server.process.wait()
    assert snapshot(repo) == before  # the server wrote nothing into the repository
    held.unlink()
    with kiln_serve([repo], *poll, log_path=tmp_path / "second.log") as server:
        assert answer(server.http_url) == 2


def test_explicit_load_with_files_killed_midway_leaves_the_repository_served(tmp_path: Path) -> None:
    markers = tmp_path / "markers"
    markers.mkdir()
    (markers / "hold-init-2").touch()
    repo = repository(tmp_path, markers)
    explicit = ("--model-control-mode", "explicit", "--load-model", "adder", "--exit-timeout-secs", "1")
    with kiln_serve([repo], *explicit, log_path=tmp_path / "first.log") as server:
        assert answer(server.http_url) == 1
        source = model_source(markers, 2).encode()
        loading = threading.Thread(target=load_files, args=(server.http_url, {"file:2/model.py": source}))
        loading.start()
        wait_for(lambda: (markers / "init-2").exists())
        server.process.kill()
        server.process.wait()
        loading.join()
    (markers / "hold-init-2").unlink()
    staged = list((repo / "adder" / ".kiln-staging").rglob("model.py"))
    assert staged, "the files of the load were staged inside the model folder"
    with kiln_serve([repo], *explicit, log_path=tmp_path / "second.log") as server:
        assert answer(server.http_url) == 1  # the repository's version; the staged copy is ignored
        index = httpclient.InferenceServerClient(server.http_url).get_model_repository_index()
        assert [(row["name"], row.get("version"), row.get("state")) for row in index] == [("adder", "1", "READY")]
