"""A model that raises for one input value in a dynamic batch fails exactly that batch's requests; the requests
of the other batches succeed and the model keeps serving."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from kiln.testing.serve import KilnProcess, kiln_serve

from ._models import RAISING_CONFIG, RAISING_MODEL, write_python_model

BATCH = 4  # the model's preferred batch size; its queue waits up to 3 s to fill one
BATCHES = 3


@pytest.fixture
def server(tmp_path: Path) -> Iterator[KilnProcess]:
    write_python_model(tmp_path / "repo", "raising", RAISING_CONFIG, RAISING_MODEL)
    with kiln_serve([tmp_path / "repo"], log_path=tmp_path / "kiln.log") as process:
        yield process


def send(client: httpclient.InferenceServerClient, value: int) -> httpclient.InferAsyncRequest:
    x = httpclient.InferInput("X", [1, 1], "INT64")
    x.set_data_from_numpy(np.array([[value]], np.int64))
    return client.async_infer("raising", [x])


def test_a_raising_batch_fails_only_its_own_requests(server: KilnProcess) -> None:
    total = BATCH * BATCHES
    client = httpclient.InferenceServerClient(server.http_url, concurrency=total)
    values = list(range(1, total + 1))
    values[5] = -1  # the poisoned request
    pending = [send(client, value) for value in values]
    answers: dict[int, np.ndarray] = {}
    errors: dict[int, str] = {}
    for value, request in zip(values, pending, strict=True):
        try:
            result = request.get_result()
        except InferenceServerException as exc:
            errors[value] = str(exc.message())
            continue
        assert result.as_numpy("Y")[0, 0] == value
        answers[value] = result.as_numpy("ROWS")
    assert -1 in errors and all("negative input" in message for message in errors.values()), errors
    assert len(errors) == BATCH  # the poisoned request and the others of its batch
    assert all((rows == BATCH).all() for rows in answers.values())  # every success came in a full batch
    assert len(answers) == total - BATCH

    stats = client.get_inference_statistics("raising")["model_stats"][0]
    assert int(stats["inference_stats"]["fail"]["count"]) == BATCH
    assert int(stats["inference_stats"]["success"]["count"]) == total - BATCH

    after = [send(client, value) for value in range(40, 40 + BATCH)]  # the model keeps serving
    assert [int(r.get_result().as_numpy("Y")[0, 0]) for r in after] == list(range(40, 40 + BATCH))
    client.close()
