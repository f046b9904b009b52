"""schemathesis over kiln's OpenAPI document (kiln.console.openapi, served at /v2/openapi.json) against the fuzz
`kiln serve`: every operation of the HTTP API with requests generated from its schemas, and requests that break
them. The oracle is the other fuzzers' (benchmarks/_fuzz_oracle.py): no 5xx, except a 501 naming a feature this
server was not started with (Triton's UNSUPPORTED), and no hang."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings

schemathesis = pytest.importorskip("schemathesis")

from _fuzz_drivers import WireHttp  # noqa: E402
from _fuzz_oracle import LEGIT_UNSUPPORTED  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402

from kiln.console.openapi import openapi_document  # noqa: E402

EXAMPLES = 15  # per operation and mode: about 1,300 requests, 20-40 s on 2 cores
TIMEOUT_S = 10.0
OPERATIONS = {result.ok().label: result.ok()
              for result in schemathesis.openapi.from_dict(openapi_document()).get_all_operations()}


# Requests that break the schema exist only where it constrains something: a body (paths take any text).
CASES = [(label, GenerationMode.POSITIVE) for label in sorted(OPERATIONS)] + [
    (label, GenerationMode.NEGATIVE) for label, operation in sorted(OPERATIONS.items()) if len(operation.body)]


@pytest.mark.parametrize(("label", "mode"), CASES, ids=[f"{label} {mode.value}" for label, mode in CASES])
def test_no_generated_request_gets_a_server_error(label: str, mode: Any, wire: tuple[WireHttp, Any]) -> None:
    http, _ = wire
    base_url = f"http://{http.server.http_url}"

    @given(case=OPERATIONS[label].as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    def answer(case: Any) -> None:
        response = case.call(base_url=base_url, timeout=TIMEOUT_S)
        status = response.status_code
        assert status < 500 or (status == 501 and LEGIT_UNSUPPORTED.search(response.text)), (
            f"{case.method} {case.formatted_path}: {status} {response.text[:300]}")

    answer()
