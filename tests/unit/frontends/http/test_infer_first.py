"""Inference paths are recognised before Starlette sees them, exactly where the route table would match them."""

from __future__ import annotations

import pytest
from starlette.routing import Match, Route

from kiln.frontends.http.app import _infer_params

ROUTES = [Route("/v2/models/{model}/infer", lambda request: None, methods=["POST"]),
          Route("/v2/models/{model}/versions/{version}/infer", lambda request: None, methods=["POST"])]

PATHS = ["/v2/models/simple/infer", "/v2/models/simple/versions/3/infer", "/v2/models/a.b-c_d/infer",
         "/v2/models/m/versions/latest/infer", "/v2/models/simple/infer/", "/v2/models//infer",
         "/v2/models/simple/versions//infer", "/v2/models/simple/ready", "/v2/models/simple", "/v2/models/infer",
         "/v2/models/a/b/infer", "/v1/models/simple/infer", "v2/models/simple/infer", "/v2/models/simple/versions/3",
         "/v2/models/stats", "/v2/models/sim ple/infer", "/v2/models/\u00e9/infer"]


def _starlette_params(path: str) -> dict[str, str] | None:
    scope = {"type": "http", "method": "POST", "path": path, "root_path": ""}
    for route in ROUTES:
        match, child = route.matches(scope)
        if match is Match.FULL:
            return dict(child["path_params"])
    return None


@pytest.mark.parametrize("path", PATHS)
def test_infer_paths_match_the_route_table(path: str) -> None:
    assert _infer_params({"path": path}) == _starlette_params(path)


def test_the_model_and_version_come_from_the_path() -> None:
    assert _infer_params({"path": "/v2/models/simple/versions/3/infer"}) == {"model": "simple", "version": "3"}
    assert _infer_params({"path": "/v2/models/simple/infer"}) == {"model": "simple"}
