"""A real `kiln serve`: gRPC ModelInfer / ModelStreamInfer / other RPCs with raw (often mutated) message bytes, HTTP
through uvicorn's parsers, and raw request heads mangled on a socket. The checker runs after every input."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from _fuzz_cases import GRPC_INFER, GrpcCase, grpc_case, http_case
from _fuzz_drivers import LIMIT, Grpc, WireHttp

from .conftest import FUZZ, unexpected

GRPC_SURFACES = {"grpc_infer": 120, "grpc_stream": 40, "grpc_other": 80}


@pytest.mark.parametrize("surface", sorted(GRPC_SURFACES))
def test_grpc_surface(wire: tuple[WireHttp, Grpc], surface: str) -> None:
    _, grpc = wire

    @settings(FUZZ, max_examples=GRPC_SURFACES[surface])
    @given(rng=st.randoms(use_true_random=False), check=st.integers(0, 4))
    def fuzz(rng: random.Random, check: int) -> None:
        findings = grpc.run(grpc_case(rng, surface, "wire"), check=check == 0)
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
        findings = http.run(http_case(rng, surface, LIMIT, "wire"), check=True)
        assert not unexpected(findings), unexpected(findings)

    fuzz()


@settings(FUZZ, max_examples=80)
@given(rng=st.randoms(use_true_random=False))
def test_raw_request_heads(wire: tuple[WireHttp, Grpc], rng: random.Random) -> None:
    """uvicorn's parser on mangled request lines and headers; the server must answer the checker afterwards."""
    http, _ = wire
    findings = http.raw(http_case(rng, "http_paths", LIMIT, "wire"), rng)
    assert not unexpected(findings), unexpected(findings)
