"""HTTP surfaces in process: JSON and binary bodies, encodings, oversized bodies, paths and headers, system shared
memory, sample capture and model download. The checker runs alongside every tenth input."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from _fuzz_cases import HttpCase, http_case, infer_path
from _fuzz_drivers import LIMIT, InProcessHttp

from .conftest import FUZZ, unexpected

SURFACES = {"http_json": 150, "http_binary": 120, "http_encoding": 80, "http_oversize": 20, "http_paths": 150,
            "shm": 60, "capture": 80, "files": 80}


@pytest.mark.parametrize("surface", sorted(SURFACES))
def test_http_surface(in_process: InProcessHttp, surface: str) -> None:
    @settings(FUZZ, max_examples=SURFACES[surface])
    @given(rng=st.randoms(use_true_random=False), check=st.integers(0, 9))
    def fuzz(rng: random.Random, check: int) -> None:
        findings = in_process.run(http_case(rng, surface, LIMIT, in_process.tag), check=check == 0)
        assert not unexpected(findings), unexpected(findings)

    fuzz()


@settings(FUZZ, max_examples=150)
@given(body=st.binary(max_size=512), rng=st.randoms(use_true_random=False),
       header=st.one_of(st.none(), st.text(max_size=6)))
def test_arbitrary_infer_bodies(in_process: InProcessHttp, body: bytes, rng: random.Random, header: str | None) -> None:
    """Bytes hypothesis shrinks on its own, with and without the binary-extension header."""
    headers = () if header is None else (("inference-header-content-length", header),)
    findings = in_process.run(HttpCase("http_bytes", "POST", infer_path(rng, "simple"), headers, body))
    assert not unexpected(findings), unexpected(findings)


def test_checker_holds_after_fuzzing(in_process: InProcessHttp) -> None:
    """After everything above, a well-formed request still gets simple's answer and no region stays mapped."""
    findings = in_process.run(HttpCase("shm", "GET", "/v2/systemsharedmemory/status"), check=True)
    assert not unexpected(findings), unexpected(findings)
