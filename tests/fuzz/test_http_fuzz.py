"""HTTP surfaces in process: JSON and binary bodies, encodings, oversized bodies, paths and headers, system shared
memory, sample capture and model download. The checker runs alongside every tenth input."""

from __future__ import annotations

import json
import random

import pytest
from _fuzz_cases import HttpCase, http_case, infer_path, simple_doc
from _fuzz_drivers import LIMIT, InProcessHttp
from hypothesis import example, given, settings
from hypothesis import strategies as st

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


PARAMETER_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False),
                             st.text(max_size=3), st.lists(st.integers(0, 3), max_size=1))


@settings(FUZZ, max_examples=120)
@given(key=st.sampled_from(["priority", "timeout", "sequence_id", "sequence_start", "sequence_end"]),
       value=PARAMETER_VALUES)
@example(key="priority", value=True)
@example(key="priority", value=-1)
@example(key="timeout", value=-5)
@example(key="sequence_id", value=2**70)
def test_request_parameters(in_process: InProcessHttp, key: str, value: object) -> None:
    """Request-level parameters of any JSON type on an otherwise correct request: served only when Triton would."""
    doc = simple_doc(random.Random(0))
    doc["parameters"] = {key: value}
    findings = in_process.run(HttpCase("http_json", "POST", "/v2/models/simple/infer", (), json.dumps(doc).encode()))
    assert not unexpected(findings), unexpected(findings)
