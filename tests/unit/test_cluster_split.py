"""The pieces of a repository split per model that need no Ray cluster (kiln.cluster.split; the cluster test runs
the whole)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

pytest.importorskip("ray.serve", reason="the ray extra is not installed (pip install -e '.[ray]')")

import orjson

from kiln.cluster.split import BelowModelPrefix, ClusterFront, merged_index, model_applications
from kiln.errors import InvalidArgumentError


def test_each_model_is_mounted_at_its_own_v2_path_below_the_clusters_prefix() -> None:
    assert [(a.name, a.route_prefix) for a in model_applications("kiln", "/", ["a", "b"])] == [
        ("kiln-a", "/v2/models/a"), ("kiln-b", "/v2/models/b")]
    assert model_applications("split", "/split", ["a"])[0].route_prefix == "/split/v2/models/a"


@pytest.mark.parametrize(("root", "expected"), [
    ("/split/v2/models/simple", "/split"), ("/v2/models/simple", ""), ("/kiln", "/kiln"), ("", "")])
def test_a_models_application_routes_below_the_clusters_prefix(root: str, expected: str) -> None:
    seen: list[Any] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append(scope)

    asyncio.run(BelowModelPrefix(app)({"type": "http", "root_path": root, "path": "/x"}, None, None))
    assert seen[0]["root_path"] == expected and seen[0]["path"] == "/x"


def test_the_fronts_index_marks_every_version_served_somewhere_ready() -> None:
    own = [{"name": "gone", "version": "", "state": "UNAVAILABLE", "reason": "not loaded"}]
    served = [{"name": "b", "version": "1"}, {"name": "a", "version": "2"}]
    assert merged_index(own, served) == [
        {"name": "a", "version": "2", "state": "READY", "reason": ""},
        {"name": "b", "version": "1", "state": "READY", "reason": ""}, own[0]]


def test_a_model_whose_name_cannot_be_a_route_prefix_is_named() -> None:
    with pytest.raises(InvalidArgumentError, match="model 'a b' cannot have an application of its own"):
        model_applications("kiln", "/", ["ok", "a b"])


async def _answer(front: ClusterFront, method: str, path: str) -> tuple[int, bytes]:
    sent: list[Any] = []

    async def send(message: Any) -> None:
        sent.append(message)

    async def receive() -> Any:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    await front({"type": "http", "method": method, "path": path, "root_path": ""}, receive, send)
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


async def _own(scope: Any, receive: Any, send: Any) -> None:  # a front holding no model: ready, an empty index
    body = b"[]" if scope["path"] == "/v2/repository/index" else b""
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": body})


def test_the_front_is_ready_once_some_replica_serves_every_model() -> None:
    served: list[dict[str, str]] = [{"name": "a", "version": "1"}]

    async def board() -> list[dict[str, str]]:
        return served

    front = ClusterFront(_own, board, {"a", "b"})
    status, body = asyncio.run(_answer(front, "GET", "/v2/health/ready"))
    assert status == 400 and b"no replica serves b yet" in body
    served.append({"name": "b", "version": "3"})
    assert asyncio.run(_answer(front, "GET", "/v2/health/ready"))[0] == 200
    status, body = asyncio.run(_answer(front, "POST", "/v2/repository/index"))
    assert status == 200 and [e["name"] for e in orjson.loads(body)] == ["a", "b"]


def test_with_the_board_unreachable_the_front_answers_for_itself() -> None:
    async def board() -> list[dict[str, str]]:
        raise ConnectionError("board restarting")

    front = ClusterFront(_own, board, {"a"})
    assert asyncio.run(_answer(front, "GET", "/v2/health/ready"))[0] == 200
    assert asyncio.run(_answer(front, "POST", "/v2/repository/index")) == (200, b"[]")
