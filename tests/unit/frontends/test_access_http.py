"""The HTTP restriction middleware in front of the real app (no network): the groups the route table gives,
HEAD as GET, kiln's extension groups, unknown paths and open groups untouched, the 403 body."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import httpx
import pytest

from kiln.frontends.access import http_policy
from kiln.frontends.http.app import build_app
from kiln.server.server import Server, ServerOptions
from kiln.testing.repo import make_repo, onnx_add_sub_model


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    instance = Server(ServerOptions(repositories=[make_repo(tmp_path_factory.mktemp("repo"),
                                                            add_sub=onnx_add_sub_model())]))
    instance.start()
    yield instance
    instance.close()


@pytest.fixture
async def client(server: Server) -> AsyncIterator[httpx.AsyncClient]:
    policy = http_policy(["model-config,routing:admin-key=s3cret", "health:probe=yes"])
    app = build_app(server, access=policy)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://kiln") as http:
        yield http


@pytest.mark.parametrize(("method", "path", "group"), [
    ("GET", "/v2/models/add_sub/config", "model-config"),
    ("HEAD", "/v2/models/add_sub/versions/1/config", "model-config"),
    ("GET", "/v2/repository/models/add_sub/kiln/routing", "routing"),
    ("POST", "/v2/repository/models/add_sub/kiln/routing", "routing"),
])
async def test_a_restricted_route_without_the_header_is_403(client: httpx.AsyncClient, method: str, path: str,
                                                           group: str) -> None:
    for headers in ({}, {"admin-key": "S3CRET"}):
        answer = await client.request(method, path, headers=headers)
        assert answer.status_code == 403
        if method != "HEAD":
            assert answer.json()["error"] == (f"the '{group}' API is restricted on this server: send the header "
                                              f"'admin-key' with the value the server was started with")


async def test_with_the_header_the_route_answers(client: httpx.AsyncClient) -> None:
    answer = await client.get("/v2/models/add_sub/config", headers={"Admin-Key": "s3cret"})
    assert answer.status_code == 200 and answer.json()["name"] == "add_sub"
    assert (await client.get("/v2/health/ready", headers={"probe": "yes"})).status_code == 200
    assert (await client.get("/v2/health/ready")).status_code == 403


async def test_open_groups_and_unknown_paths_are_untouched(client: httpx.AsyncClient) -> None:
    assert (await client.get("/v2/models/add_sub")).status_code == 200
    assert (await client.get("/v2/no/such/route")).status_code == 404
    assert (await client.post("/v2/models/add_sub/config")).status_code == 405
