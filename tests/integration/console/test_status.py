"""The console's routes and status document over an in-process server (httpx on the ASGI app)."""

from __future__ import annotations

import io
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from kiln.console import OPENAPI_PATH, STATUS_PATH, ConsoleOptions
from kiln.console.status import WINDOW_S, LatencyWindow
from kiln.errors import InvalidArgumentError
from kiln.frontends.http import build_app
from kiln.server.capture import CaptureStore, Sample
from kiln.server.server import Server, ServerOptions
from kiln.server.stats import RequestTimes
from kiln.service import Service
from kiln.service_options import ServiceOptions

IDENTITY = """backend: "identity"
max_batch_size: 8
{extra}
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
instance_group [ {{ kind: KIND_CPU count: 2 }} ]
"""
AB = 'version_policy { all {} }\nparameters { key: "kiln.ab.weights" value { string_value: "1:80,2:20" } }'
BODY = {"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    repo = tmp_path_factory.mktemp("repo")
    for name, extra, versions in (("echo", "", ("1",)), ("ab", AB, ("1", "2"))):
        for version in versions:
            (repo / name / version).mkdir(parents=True)
        (repo / name / "config.pbtxt").write_text(IDENTITY.format(extra=extra))
    (repo / "broken").mkdir()
    (repo / "broken" / "config.pbtxt").write_text("this is not a config")
    server = Server(ServerOptions(repositories=[repo]))
    server.start()
    yield server
    server.close()


@pytest.fixture
async def http(server: Server, tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    (tmp_path / "report").mkdir()
    (tmp_path / "report" / "compare.md").write_text("# compare\n")
    store = CaptureStore(tmp_path / "captures", 2**20)
    store.add("echo", "1", Sample("s-1", "uncertain", "edge", "edge-7"), _npz())
    app = build_app(server, console=ConsoleOptions(report=tmp_path / "report", captures=store))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://kiln") as client:
        yield client


def _npz() -> bytes:
    out = io.BytesIO()
    np.savez(out, **{"input/INPUT0": np.ones((1, 4), np.float32)})
    return out.getvalue()


async def test_status_shows_every_model_version_with_state_instances_and_figures(
        http: httpx.AsyncClient, schema_validator: Callable[[str], Any]) -> None:
    await http.get(STATUS_PATH)  # the first look attaches the latency window
    for _ in range(3):
        assert (await http.post("/v2/models/echo/infer", json=BODY)).status_code == 200
    doc = (await http.get(STATUS_PATH)).json()
    models = {m["name"]: m for m in doc["models"]}
    assert set(models) == {"echo", "ab", "broken"}
    echo = models["echo"]["versions"][0]
    assert echo["state"] == "READY"
    assert echo["instances"] == [{"name": "echo_0", "kind": "CPU", "count": 2, "gpus": []}]
    assert echo["stats"]["inference_count"] >= 3 and echo["stats"]["batch_sizes"]
    assert echo["latency"]["samples"] >= 3 and echo["latency"]["p99_ms"] >= echo["latency"]["p50_ms"] > 0
    broken = models["broken"]
    assert broken.get("state", broken["versions"][0]["state"] if broken["versions"] else None) == "UNAVAILABLE"
    assert [v["version"] for v in models["ab"]["versions"]] == ["1", "2"]
    assert models["ab"]["routing"]["weights"] == {"1": 80.0, "2": 20.0}
    assert doc["controls"] == {"model_control": "none", "downloads": False, "key_required": False, "report": True}
    assert doc["report"]["files"] == ["compare.md"]
    [capture] = doc["captures"]
    assert (capture["model"], capture["samples"], capture["edges"]) == ("echo", 1, ["edge-7"])
    schema_validator("ConsoleStatus").validate(doc)
    schema_validator("RoutingStatus").validate((await http.get("/v2/repository/models/ab/kiln/routing")).json())
    schema_validator("RepositoryIndex").validate((await http.post("/v2/repository/index")).json())
    schema_validator("ServerMetadata").validate((await http.get("/v2")).json())
    schema_validator("InferResponse").validate((await http.post("/v2/models/echo/infer", json=BODY)).json())
    schema_validator("Error").validate((await http.get("/v2/models/nope")).json())


async def test_pages_files_and_report_are_served_and_nothing_outside_them(http: httpx.AsyncClient) -> None:
    page = await http.get("/console")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "/console/static/console.js" in page.text
    for name, media in (("console.js", "text/javascript"), ("console.css", "text/css"), ("api.js", "text/javascript")):
        answer = await http.get(f"/console/static/{name}")
        assert answer.status_code == 200 and answer.headers["content-type"].startswith(media), name
    assert (await http.get("/console/api")).status_code == 200
    assert (await http.get("/console/report/compare.md")).text == "# compare\n"
    for path in ("/console/static/..%2Froutes.py", "/console/static/missing.js", "/console/report/..%2Freport",
                 "/console/static/.hidden"):
        answer = await http.get(path)
        assert answer.status_code == 404 and "not found" in answer.json()["error"].lower(), path


async def test_console_off_leaves_only_the_openapi_document(server: Server) -> None:
    app = build_app(server, console=ConsoleOptions(enabled=False))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://kiln") as client:
        assert (await client.get("/console")).status_code == 404
        assert (await client.get(STATUS_PATH)).status_code == 404
        assert (await client.get(OPENAPI_PATH)).json()["openapi"] == "3.1.0"


def test_latency_window_gives_nearest_rank_percentiles_of_recent_requests_only() -> None:
    now = [0]
    window = LatencyWindow(clock=lambda: now[0])
    window.observe(RequestTimes("m", "1", 999_000_000, 0, 0, 0, 0))  # 999 ms, soon outside the window
    now[0] = int(WINDOW_S * 1e9) + 1
    for ms in range(1, 101):
        window.observe(RequestTimes("m", "1", ms * 1_000_000, ms * 10_000, 0, 0, 0))
    assert window.percentiles("m", "1") == {"samples": 100, "p50_ms": 50.0, "p99_ms": 99.0, "queue_p50_ms": 0.5}
    assert window.percentiles("m", "2") == {"samples": 0, "p50_ms": None, "p99_ms": None, "queue_p50_ms": None}


def test_a_console_report_that_does_not_exist_is_refused_before_anything_starts(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match=r"--console-report '.*missing' does not exist; expected the "
                                                   r"output folder of `kiln bench compare` \(or a file in it\)"):
        ServiceOptions(console_report=tmp_path / "missing")


def test_a_file_of_the_report_stands_for_its_folder(tmp_path: Path) -> None:
    (tmp_path / "report.html").write_text("<html></html>")
    for given in (tmp_path, tmp_path / "report.html"):
        console = Service(ServiceOptions(console_report=given))._console_options(None)
        assert console.report == tmp_path and console.enabled and not console.key_required
