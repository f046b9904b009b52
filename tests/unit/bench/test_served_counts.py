"""Every model's rate on a server over exactly the bench's windows: counts read in the background from a real HTTP
statistics endpoint whose counts grow at known rates, interpolated to the span asked for."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kiln.bench.served_counts import CountSampler
from kiln.errors import UnavailableError

RATES = {"a": 1000.0, "b": 250.0}  # requests/s each model's count grows by
ROWS = {"a": 2, "b": 1}  # rows per request
EXECUTIONS = {"a": 250.0, "b": 250.0}  # batches/s: a runs 8 rows per execution, b 1


class _Stats(BaseHTTPRequestHandler):
    started = time.monotonic()
    broken = False

    def do_GET(self) -> None:  # the name http.server calls
        if self.broken:
            self.send_error(500)
            return
        elapsed = time.monotonic() - self.started
        stats = [{"name": name, "version": "1", "inference_stats": {"success": {"count": int(rate * elapsed)}},
                  "inference_count": int(rate * elapsed) * ROWS[name],
                  "execution_count": int(EXECUTIONS[name] * elapsed)}
                 for name, rate in RATES.items()]
        body = json.dumps({"model_stats": stats}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture()
def stats_url() -> Iterator[str]:
    _Stats.started, _Stats.broken = time.monotonic(), False
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Stats)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join()


def test_rates_over_a_span_inside_the_sampled_time_match_the_growth(stats_url: str) -> None:
    sampler = CountSampler(stats_url, interval_s=0.02)
    sampler.start()
    time.sleep(0.1)
    begin = time.monotonic_ns()
    time.sleep(0.4)
    end = time.monotonic_ns()
    time.sleep(0.1)
    sampler.stop()
    rates = sampler.rates(begin, end)
    assert set(rates) == set(RATES)
    for name, rate in RATES.items():
        assert rate * 0.9 < rates[name] < rate * 1.1
    batches = sampler.rows_per_execution(begin, end)
    assert 7.2 < batches["a"] < 8.8 and 0.9 < batches["b"] < 1.1, batches


def test_a_span_outside_the_sampled_time_is_refused(stats_url: str) -> None:
    before = time.monotonic_ns()
    sampler = CountSampler(stats_url, interval_s=0.02)
    sampler.start()
    time.sleep(0.05)
    sampler.stop()
    with pytest.raises(ValueError, match="not inside the sampled"):
        sampler.rates(before - 1, time.monotonic_ns() - 10**9)
    with pytest.raises(ValueError, match="not inside the sampled"):
        sampler.rates(time.monotonic_ns() - 10**7, time.monotonic_ns() + 10**9)


def test_a_server_that_stops_answering_its_statistics_is_reported(stats_url: str) -> None:
    sampler = CountSampler(stats_url, interval_s=0.02)
    sampler.start()
    _Stats.broken = True
    time.sleep(0.1)
    with pytest.raises(UnavailableError, match=f"could not read the server's statistics at {stats_url}"):
        sampler.stop()
