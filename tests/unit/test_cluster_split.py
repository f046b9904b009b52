"""The pieces of a repository split per model that need no Ray cluster (kiln.cluster.split; the cluster test runs
the whole)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

pytest.importorskip("ray.serve", reason="the ray extra is not installed (pip install -e '.[ray]')")

from kiln.cluster.split import BelowModelPrefix, merged_index, model_applications


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
