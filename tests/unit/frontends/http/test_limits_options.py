"""The connection-limit flags of `kiln serve` reach the HTTP protocol, the uvicorn settings and the HTTP workers'
command line; their defaults are those docs/serving.md lists."""

from __future__ import annotations

import argparse

import pytest

from kiln.cli._arguments import add_flags, build
from kiln.frontends.grpc.server import GrpcConnectionLimits
from kiln.frontends.http.limits import HttpLimits, LimitedHttpToolsProtocol
from kiln.frontends.http.server import http_config
from kiln.service_options import ServiceOptions


def _options(*argv: str) -> ServiceOptions:
    parser = argparse.ArgumentParser()
    add_flags(parser, ServiceOptions)
    return build(ServiceOptions, parser.parse_args(list(argv)))


def test_defaults() -> None:
    assert _options().http_limits == HttpLimits(max_header_bytes=65536, max_headers=100, header_timeout_s=30.0,
                                                idle_timeout_s=60.0, body_timeout_s=300.0, max_connections=4096)
    assert dict(GrpcConnectionLimits().options()) == {"grpc.keepalive_time_ms": 7_200_000,
                                                      "grpc.keepalive_timeout_ms": 20_000,
                                                      "grpc.max_connection_idle_ms": 3_600_000}


def test_flags_reach_the_protocol_and_uvicorn() -> None:
    options = _options("--http-max-header-size", "1000", "--http-max-header-count", "7",
                       "--http-header-timeout-secs", "2.5", "--http-idle-timeout-secs", "4",
                       "--http-body-timeout-secs", "9", "--http-max-connections", "11")
    limits = options.http_limits
    assert limits == HttpLimits(1000, 7, 2.5, 4.0, 9.0, 11)
    config = http_config(object(), "127.0.0.1", 0, 1.0, limits=limits)
    protocol = config.http
    assert isinstance(protocol, type) and issubclass(protocol, LimitedHttpToolsProtocol)
    assert protocol.limits == limits and config.timeout_keep_alive == 4.0
    assert HttpLimits.from_json(limits.to_json()) == limits  # as the HTTP workers receive them


def test_grpc_idle_limit_can_be_turned_off() -> None:
    options = dict(GrpcConnectionLimits(keepalive_s=30, max_connection_idle_s=0).options())
    assert options == {"grpc.keepalive_time_ms": 30_000, "grpc.keepalive_timeout_ms": 20_000}


@pytest.mark.parametrize(("flag", "value", "message"), [
    ("--http-header-timeout-secs", "-5", "expected 0 or more seconds, got -5"),
    ("--http-body-timeout-secs", "nan", "expected 0 or more seconds, got nan"),
    ("--grpc-max-connection-idle-secs", "inf", "expected 0 or more seconds, got inf"),
    ("--http-idle-timeout-secs", "0", "expected more than 0 seconds, got 0"),
    ("--grpc-keepalive-secs", "soon", "expected a number of seconds, got 'soon'"),
])
def test_timeouts_that_mean_nothing_are_refused(flag: str, value: str, message: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _options(flag, value)
    assert f"argument {flag}: {message}" in capsys.readouterr().err


def test_zero_turns_the_head_and_body_timeouts_off() -> None:
    limits = _options("--http-header-timeout-secs", "0", "--http-body-timeout-secs", "0").http_limits
    assert (limits.header_timeout_s, limits.body_timeout_s) == (0.0, 0.0)
