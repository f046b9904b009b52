"""A real `kiln serve`: gRPC ModelInfer / ModelStreamInfer / other RPCs with raw (often mutated) message bytes, HTTP
through uvicorn's parsers, and raw request heads mangled on a socket. The checker runs after every input."""

from __future__ import annotations

import random

import pytest
from _fuzz_cases import GRPC_INFER, GrpcCase, grpc_case, http_case, simple_message
from _fuzz_drivers import LIMIT, Grpc, WireHttp
from hypothesis import example, given, settings
from hypothesis import strategies as st

from .conftest import FUZZ, unexpected

GRPC_SURFACES = {"grpc_infer": 120, "grpc_stream": 40, "grpc_other": 80}


@pytest.mark.parametrize("surface", sorted(GRPC_SURFACES))
def test_grpc_surface(wire: tuple[WireHttp, Grpc], surface: str) -> None:
    _, grpc = wire

    @settings(FUZZ, max_examples=GRPC_SURFACES[surface])
    @given(rng=st.randoms(use_true_random=False), check=st.integers(0, 4))
    def fuzz(rng: random.Random, check: int) -> None:
        findings = grpc.run(grpc_case(rng, surface, grpc.tag), check=check == 0)
        assert not unexpected(findings), unexpected(findings)

    fuzz()


@settings(FUZZ, max_examples=100)
@given(payload=st.binary(max_size=256))
def test_grpc_arbitrary_bytes(wire: tuple[WireHttp, Grpc], payload: bytes) -> None:
    findings = wire[1].run(GrpcCase("grpc_bytes", GRPC_INFER, (payload,)))
    assert not unexpected(findings), unexpected(findings)


@pytest.mark.parametrize("surface", ["http_json", "http_binary", "http_encoding", "shm", "capture", "files"])
def test_http_over_the_wire(wire: tuple[WireHttp, Grpc], surface: str) -> None:
    http, _ = wire

    @settings(FUZZ, max_examples=25)
    @given(rng=st.randoms(use_true_random=False))
    def fuzz(rng: random.Random) -> None:
        findings = http.run(http_case(rng, surface, LIMIT, http.tag), check=True)
        assert not unexpected(findings), unexpected(findings)

    fuzz()


@settings(FUZZ, max_examples=80)
@given(rng=st.randoms(use_true_random=False))
def test_raw_request_heads(wire: tuple[WireHttp, Grpc], rng: random.Random) -> None:
    """uvicorn's parser on mangled request lines and headers; the server must answer the checker afterwards."""
    http, _ = wire
    findings = http.raw(http_case(rng, "http_paths", LIMIT, http.tag), rng)
    assert not unexpected(findings), unexpected(findings)


@settings(FUZZ, max_examples=60)
@given(key=st.sampled_from(["priority", "timeout"]),
       kind=st.sampled_from(["int64_param", "uint64_param", "bool_param", "string_param", "double_param"]),
       number=st.integers(-(2**63), 2**63 - 1))
@example(key="priority", kind="int64_param", number=-5)
@example(key="timeout", kind="int64_param", number=-5)
def test_grpc_request_parameters(wire: tuple[WireHttp, Grpc], key: str, kind: str, number: int) -> None:
    """priority / timeout of every parameter kind on an otherwise correct ModelInfer: served only when valid."""
    request = simple_message(random.Random(0))
    values = {"int64_param": number, "uint64_param": abs(number), "bool_param": number % 2 == 0,
              "string_param": str(number), "double_param": number / 7}
    setattr(request.parameters[key], kind, values[kind])
    findings = wire[1].run(GrpcCase("grpc_infer", GRPC_INFER, (request.SerializeToString(),)))
    assert not unexpected(findings), unexpected(findings)
