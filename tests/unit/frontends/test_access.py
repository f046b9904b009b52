"""The endpoint table (kiln/frontends/access.py) against the real HTTP route table and gRPC service descriptors,
the restriction flags' parsing, the policy's check, and docs/security.md naming every endpoint."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2  # type: ignore[import-untyped]  # no type info
from starlette.routing import Route

from kiln.errors import InvalidArgumentError, PermissionDeniedError
from kiln.frontends import access
from kiln.frontends.access import AccessPolicy, grpc_policy, http_group, http_policy
from kiln.frontends.http.app import InferFirst, build_app
from kiln.server.server import Server, ServerOptions
from kiln.service_options import ServiceOptions
from kiln.v2._generated import grpc_service_pb2

DOCS = Path(__file__).resolve().parents[3] / "docs" / "security.md"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    instance = Server(ServerOptions(repositories=[tmp_path_factory.mktemp("empty")]))
    yield instance
    instance.close()


def _served_routes(server: Server) -> set[tuple[str, str]]:
    app = build_app(server)
    assert isinstance(app, InferFirst)  # no restriction: no middleware in front
    routes = set()
    for route in app.app.routes:
        assert isinstance(route, Route), route
        for method in route.methods or ():
            if method != "HEAD":  # Starlette adds HEAD to every GET route
                routes.add((method, route.path))
    return routes


def test_every_http_route_is_in_the_table_and_nothing_else(server: Server) -> None:
    table = {(method, path) for method, path, _ in access.HTTP_ROUTES}
    served = _served_routes(server)
    assert served - table == set(), "routes without an API group: add them to access.HTTP_ROUTES"
    assert table - served == set(), "access.HTTP_ROUTES names routes the app does not serve"
    assert len(table) == len(access.HTTP_ROUTES)


def test_every_grpc_method_is_in_the_table_and_nothing_else() -> None:
    served = {f"/{service.full_name}/{method.name}"
              for descriptor in (grpc_service_pb2.DESCRIPTOR, health_pb2.DESCRIPTOR)
              for service in descriptor.services_by_name.values() for method in service.methods}
    assert served == set(access.GRPC_METHODS)


def test_every_group_in_the_tables_is_one_the_flags_accept() -> None:
    assert {group for _, _, group in access.HTTP_ROUTES} <= set(access.HTTP_GROUPS)
    assert set(access.GRPC_METHODS.values()) <= set(access.GRPC_GROUPS)


@pytest.mark.parametrize(("method", "path", "group"), [
    ("GET", "/v2/models/stats", "statistics"),
    ("GET", "/v2/models/stats/ready", "health"),
    ("GET", "/v2/models/simple", "metadata"),
    ("HEAD", "/v2/models/simple/versions/1/config", "model-config"),
    ("POST", "/v2/models/simple/versions/1/infer", "inference"),
    ("POST", "/v2/models/simple/generate_stream", "inference"),
    ("GET", "/v2/kiln/models/m/versions/1/files/sub/dir/model.onnx", "model-download"),
    ("POST", "/v2/repository/models/m/unload", "model-repository"),
    ("POST", "/v2/cudasharedmemory/region/r/register", "shared-memory"),
    ("GET", "/v2/models/simple/infer", None),  # 405 from the router
    ("GET", "/v2/nothing", None),
    ("GET", "/v2/models//ready", None),  # an empty segment matches no route
])
def test_http_group_matches_as_the_router_does(method: str, path: str, group: str | None) -> None:
    assert http_group(method, path) == group


def test_a_restriction_asks_its_header_with_its_value() -> None:
    policy = http_policy(["model-repository,statistics:Admin-Key=s3cret", "inference:infer-key=go"])
    policy.check("metadata", {})
    policy.check("statistics", {"admin-key": "s3cret"})
    policy.check("inference", {"infer-key": "go"})
    for headers in ({}, {"admin-key": "wrong"}, {"infer-key": "s3cret"}, {"admin-key": "s3cret "}):
        with pytest.raises(PermissionDeniedError) as caught:
            policy.check("model-repository", headers)
        assert "'model-repository'" in caught.value.message and "'admin-key'" in caught.value.message


def test_grpc_reads_the_triton_prefixed_metadata_key() -> None:
    policy = grpc_policy(["health:k=v"])
    assert policy.header("health") == "triton-grpc-protocol-k"
    policy.check("health", {"triton-grpc-protocol-k": "v"})
    with pytest.raises(PermissionDeniedError, match="triton-grpc-protocol-k"):
        policy.check("health", {"k": "v"})


@pytest.mark.parametrize(("texts", "expected"), [
    (["inference"], "expected <group>"),
    (["inference:key"], "expected <group>"),
    ([":key=value"], "expected <group>"),
    (["inference:=value"], "expected <group>"),
    (["inferense:k=v"], "unknown API group 'inferense'"),
    (["health,metadata:k1=v1", "metadata:k2=v2"], "'metadata' is given in more than one restriction"),
])
def test_bad_restrictions_name_the_flag_and_the_mistake(texts: list[str], expected: str) -> None:
    with pytest.raises(InvalidArgumentError, match=expected) as caught:
        http_policy(texts)
    assert "--http-restricted-api" in caught.value.message


def test_kiln_groups_are_http_only() -> None:
    http_policy(["model-download,capture,routing:k=v"])
    with pytest.raises(InvalidArgumentError, match="--grpc-restricted-protocol.*unknown API group 'capture'"):
        grpc_policy(["capture:k=v"])


def test_a_value_may_hold_colons_and_equals_signs() -> None:
    policy = http_policy(["inference:authorization=Bearer a:b=c"])
    policy.check("inference", {"authorization": "Bearer a:b=c"})


def test_the_policy_survives_the_trip_to_a_worker() -> None:
    policy = grpc_policy(["health,inference:k=v", "trace:x=y"])
    again = AccessPolicy.from_json(policy.to_json())
    assert again.restrictions == policy.restrictions and again.header("trace") == "triton-grpc-protocol-x"
    assert not AccessPolicy() and not AccessPolicy.from_json(AccessPolicy().to_json())


def test_a_worker_gets_the_policy_in_its_environment_and_no_stray_one(monkeypatch: pytest.MonkeyPatch) -> None:
    policy = http_policy(["inference:k=v"])
    monkeypatch.setenv(access.WORKER_ENVIRONMENT, policy.to_json())
    assert access.WORKER_ENVIRONMENT not in access.worker_environment(None)
    assert access.WORKER_ENVIRONMENT not in access.worker_environment(AccessPolicy())
    monkeypatch.setenv(access.WORKER_ENVIRONMENT, access.worker_environment(policy)[access.WORKER_ENVIRONMENT])
    found = access.policy_from_environment()
    assert found is not None and found.restrictions == policy.restrictions
    monkeypatch.delenv(access.WORKER_ENVIRONMENT)
    assert access.policy_from_environment() is None


def test_the_description_names_groups_and_headers_never_values() -> None:
    described = grpc_policy(["statistics,health:k=s3cret"]).describe()
    assert described == "health,statistics need header 'triton-grpc-protocol-k'"


def test_service_options_check_restrictions_and_grpc_tls(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="unknown API group"):
        ServiceOptions(grpc_restricted_protocol=("everything:k=v",))
    with pytest.raises(InvalidArgumentError, match="--grpc-use-ssl needs --grpc-server-cert and --grpc-server-key"):
        ServiceOptions(grpc_use_ssl=True)
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.write_text("x")
    key.write_text("x")
    with pytest.raises(InvalidArgumentError, match="--grpc-use-ssl-mutual needs --grpc-root-cert"):
        ServiceOptions(grpc_use_ssl_mutual=True, grpc_server_cert=cert, grpc_server_key=key)
    with pytest.raises(InvalidArgumentError, match="take effect with --grpc-use-ssl"):
        ServiceOptions(grpc_server_cert=cert, grpc_server_key=key)
    with pytest.raises(InvalidArgumentError, match="--grpc-root-cert '.*' is not a file"):
        ServiceOptions(grpc_use_ssl=True, grpc_server_cert=cert, grpc_server_key=key, grpc_root_cert=tmp_path)
    with pytest.raises(InvalidArgumentError, match="--grpc-server-cert '.*cert.pem' with --grpc-server-key '.*': "
                                                   "expected a PEM certificate chain"):
        ServiceOptions(grpc_use_ssl=True, grpc_server_cert=cert, grpc_server_key=key).grpc_tls  # noqa: B018
    assert ServiceOptions().grpc_tls is None


def _doc_rows() -> set[tuple[str, str, str]]:
    """(method or 'gRPC', path or method name, group) of every table row of docs/security.md."""
    rows = set()
    for line in DOCS.read_text().splitlines():
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and re.fullmatch(r"GET|POST|gRPC", cells[0]):
            rows.add((cells[0], cells[1], cells[2]))
    return rows


def test_the_security_doc_lists_every_endpoint_with_its_group() -> None:
    documented = _doc_rows()
    table = {(m, p, g) for m, p, g in access.HTTP_ROUTES}
    table |= {("gRPC", method, group) for method, group in access.GRPC_METHODS.items()}
    assert table - documented == set(), "docs/security.md misses these endpoints (or names another group)"
    assert documented - table == set(), "docs/security.md lists endpoints kiln does not serve"
