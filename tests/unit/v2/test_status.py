"""The one status table, read both ways: a client rebuilds from a status the error a server answered with."""

from __future__ import annotations

import grpc
import pytest

from kiln.errors import ErrorCode, error_for_code
from kiln.v2.status import error_from_grpc, error_from_http, grpc_code, http_status


@pytest.mark.parametrize("code", list(ErrorCode))
def test_grpc_codes_map_back_to_the_same_error_code(code: ErrorCode) -> None:
    sent = grpc_code(error_for_code(code, "m"))
    assert isinstance(sent, grpc.StatusCode)
    assert error_from_grpc(sent.name, "m").code is code


@pytest.mark.parametrize("code", list(ErrorCode))
def test_http_statuses_map_back_to_an_error_with_the_same_status(code: ErrorCode) -> None:
    status = http_status(error_for_code(code, "m"))
    assert http_status(error_from_http(status, "m")) == status


@pytest.mark.parametrize(("status", "code"), [(404, ErrorCode.NOT_FOUND), (503, ErrorCode.UNAVAILABLE),
                                              (501, ErrorCode.UNSUPPORTED), (500, ErrorCode.INTERNAL),
                                              (401, ErrorCode.UNAUTHENTICATED), (403, ErrorCode.PERMISSION_DENIED),
                                              (409, ErrorCode.INVALID_ARG), (502, ErrorCode.INTERNAL)])
def test_statuses_outside_the_table_fall_back_by_class(status: int, code: ErrorCode) -> None:
    assert error_from_http(status, "m").code is code
