"""Smoke tests of the serving benchmarks: each script's real code path (a real `kiln serve`, real requests checked
against their reference answers) with the smallest settings. The ones driven by wrk and h2load skip where those
Debian tools are missing."""

from __future__ import annotations

import importlib.util
import os
import shutil
import time
from pathlib import Path

import pytest

from ._smoke import SRC, needs_tools, read_json, run_main

# wrk measures whole seconds, so served windows take 1 s; no warm-up.
QUICK = ("--duration", "0.2", "--warmup", "0", "--max-wait-quiet", "0")


def test_overhead_direct(tmp_path: Path) -> None:
    output = tmp_path / "overhead.json"
    assert run_main("overhead", *QUICK, "--concurrency", "1", "--models", "simple", "--modes", "direct",
                    "--output", str(output)) == 0
    (row,) = read_json(output)["results"]
    assert (row["model"], row["mode"]) == ("simple", "direct")
    assert row["result"]["rps"] > 0 and row["result"]["ok"] > 0 and row["result"]["errors"] == 0
    assert "| simple | direct | 1 |" in output.with_suffix(".txt").read_text()


@needs_tools("wrk", "h2load")
def test_overhead_served(tmp_path: Path) -> None:
    output = tmp_path / "overhead.json"
    assert run_main("overhead", *QUICK, "--concurrency", "1", "--models", "mlp", "--modes",
                    "http-json,http-binary,grpc", "--output", str(output)) == 0
    rows = read_json(output)["results"]
    assert [row["mode"] for row in rows] == ["http-json", "http-binary", "grpc"]
    for row in rows:
        assert row["result"]["rps"] > 0 and row["result"]["errors"] == 0, row
        assert row["result"]["cpu_server"] > 0, row


@needs_tools("wrk", "h2load")
def test_batching(tmp_path: Path) -> None:
    output = tmp_path / "batching.json"
    assert run_main("batching", *QUICK, "--models", "mlp", "--concurrency", "1", "--protocols", "grpc,http",
                    "--output", str(output)) == 0
    rows = read_json(output)["results"]
    assert {(r["protocol"], r["batching"]) for r in rows} == {(p, b) for p in ("grpc", "http") for b in (True, False)}
    assert all(r["result"]["rps"] > 0 and r["result"]["errors"] == 0 for r in rows), rows


@needs_tools("wrk", "h2load")
def test_mlserver_compare_kiln_side(tmp_path: Path) -> None:
    output = tmp_path / "compare.json"
    assert run_main("mlserver_compare", *QUICK, "--workers", "", "--kiln-variants", "demo", "--rounds", "1",
                    "--concurrency", "1", "--output", str(output)) == 0
    (row,) = read_json(output)["rows"]
    assert row["name"] == "kiln serve (demo)"
    for protocol in ("rest", "grpc"):
        assert row[protocol]["rps"] > 0 and row[protocol]["errors"] == 0, row


@needs_tools("wrk", "h2load")
def test_ceilings(tmp_path: Path) -> None:
    output = tmp_path / "ceilings.json"
    assert run_main("ceilings", *QUICK, "--concurrency", "1", "--variants", "starlette-json-ort,grpc-aio-pb-ort",
                    "--output", str(output)) == 0
    results = read_json(output)["results"]
    assert set(results) == {"starlette-json-ort", "grpc-aio-pb-ort"}
    assert all(r["rps"] > 0 and r["errors"] == 0 for r in results.values()), results


@needs_tools("wrk", "h2load")
def test_ceilings_grpc_calls_on_one_connection_and_handlers_that_wait(tmp_path: Path) -> None:
    output = tmp_path / "ceilings.json"
    variants = {"grpc-aio-pb", "grpc-aio-pb-await", "starlette-await"}
    assert run_main("ceilings", *QUICK, "--concurrency", "4", "--grpc-connections", "1", "--variants",
                    ",".join(sorted(variants)), "--output", str(output)) == 0
    result = read_json(output)
    assert result["args"]["grpc_connections"] == 1
    assert set(result["results"]) == variants
    assert all(r["rps"] > 0 and r["errors"] == 0 for r in result["results"].values()), result["results"]


def test_h2load_spreads_the_calls_in_flight_over_the_connections() -> None:
    loadgen = importlib.import_module("_loadgen")
    assert loadgen._streams(4, None) == (4, 1)  # a connection per call in flight
    assert loadgen._streams(4, 1) == (1, 4)  # perf_analyzer's and tritonclient's one shared channel
    assert loadgen._streams(8, 2) == (2, 4)
    with pytest.raises(ValueError, match="cannot be spread evenly over 3 connections"):
        loadgen._streams(4, 3)


@needs_tools("wrk")
def test_ceilings_image_body(tmp_path: Path) -> None:
    output = tmp_path / "ceilings.json"
    granian = importlib.util.find_spec("granian") is not None  # an optional variant: only where it is installed
    variants = "asgi-raw,httptools-raw,httptools-eager" + (",granian-rsgi,granian-starlette" if granian else "")
    assert run_main("ceilings", *QUICK, "--concurrency", "1", "--body", "image", "--variants", variants,
                    "--output", str(output)) == 0
    results = read_json(output)["results"]
    assert set(results) == set(variants.split(","))
    assert all(r["rps"] > 0 and r["errors"] == 0 for r in results.values()), results
    assert "301 KB image request" in output.with_suffix(".txt").read_text()


def test_ceilings_refuses_an_image_body_for_decoding_variants() -> None:
    with pytest.raises(SystemExit) as refused:
        run_main("ceilings", "--body", "image", "--variants", "starlette-json")
    assert refused.value.code == 2


def test_cold_start(tmp_path: Path) -> None:
    output = tmp_path / "cold.json"
    assert run_main("cold_start", "--runs", "1", "--max-wait-quiet", "0", "--output", str(output)) == 0
    result = read_json(output)
    (run,) = result["runs"]
    assert 0 < run["http_s"] <= run["ready_s"] and 0 < run["grpc_s"] <= run["ready_s"]
    assert result["median"]["ready_s"] == run["ready_s"]
    assert "| median |" in output.with_suffix(".txt").read_text()


def test_before_after(tmp_path: Path) -> None:
    output = tmp_path / "before_after.json"
    assert run_main("before_after", "--before", str(SRC), "--models", "simple", "--rounds", "1", "--seconds", "0.2",
                    "--concurrency", "1", "--output", str(output)) == 0
    (row,) = read_json(output)["rows"]
    assert row["before"] > 0 and row["after"] > 0 and row["ratio"] > 0
    assert "simple: median after / before" in output.with_suffix(".txt").read_text()


def _perf_analyzer() -> str:
    binary = os.environ.get("KILN_PERF_ANALYZER") or shutil.which("perf_analyzer")
    if binary is None:
        pytest.skip("perf_analyzer not found: set KILN_PERF_ANALYZER or put it on PATH (pip install perf-analyzer; "
                    "it needs glibc >= 2.38)")
    return binary


def test_before_after_perf_analyzer(tmp_path: Path) -> None:
    binary = _perf_analyzer()
    output = tmp_path / "pa.json"
    assert run_main("before_after_perf_analyzer", "--before", str(SRC), "--before-env", "KILN_HTTP_INFER_LANE=0",
                    "--perf-analyzer", binary, "--models", "simple", "--protocols", "http,grpc", "--concurrency", "1",
                    "--rounds", "1", "--window-ms", "500", "--stability", "50", "--shared-memory", "system",
                    "--input-data", "zero", "--serve-args", "--http-workers 2 --grpc-workers 2",
                    "--output", str(output)) == 0
    rows = read_json(output)["rows"]
    assert {(r["tree"], r["protocol"]) for r in rows} == {(t, p) for t in ("before", "after") for p in ("http", "grpc")}
    assert all(r["throughput"] > 0 and r["p50_us"] > 0 for r in rows)
    # a request at c=1 costs the server process and the workers at least a few microseconds, and not a second
    assert all(1 < r["server_cpu_us"] < 1e6 and 1 < r["workers_cpu_us"] < 1e6 for r in rows), rows
    assert "before: " + str(SRC) + " KILN_HTTP_INFER_LANE=0;" in output.with_suffix(".txt").read_text()
    assert all(r["rows_per_execution"] == 1.0 for r in rows), rows  # `simple` has no dynamic batching
    assert all(r["window_ms"] == 500 for r in rows), rows
    assert "median after/before, grpc" in output.with_suffix(".txt").read_text()


def test_before_after_measures_a_run_stopped_for_memory_again_over_shorter_windows(tmp_path: Path,
                                                                                   capfd: pytest.CaptureFixture[str]
                                                                                   ) -> None:
    """A limit perf_analyzer passes at once: every run is stopped, the windows halve down to 250 ms, and the cell is
    recorded as unstable instead of ending the run."""
    binary = _perf_analyzer()
    output = tmp_path / "pa.json"
    assert run_main("before_after_perf_analyzer", "--after-env", "KILN_HTTP_INFER_LANE=1", "--perf-analyzer", binary,
                    "--models", "simple", "--protocols", "http", "--concurrency", "1", "--rounds", "1",
                    "--window-ms", "1000", "--memory-limit-mb", "1", "--output", str(output)) == 0
    rows = read_json(output)["rows"]
    assert [(r["tree"], r["throughput"], r["window_ms"]) for r in rows] == [("before", None, None),
                                                                           ("after", None, None)]
    err = capfd.readouterr().err
    assert err.count("over 1000 ms windows: again over 500 ms") == 2, err
    assert err.count("over 250 ms windows: recorded as unstable") == 2, err


def test_before_after_halves_the_windows_down_to_250_ms() -> None:
    import importlib

    script = importlib.import_module("before_after_perf_analyzer")
    windows = [2000]
    while (shorter := script.shorter_window(windows[-1])) is not None:
        windows.append(shorter)
    assert windows == [2000, 1000, 500, 250]
    assert script.shorter_window(300) == 250


def test_before_after_serves_each_side_in_its_own_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """server_from sets the side's variables in the `kiln serve` process and its workers, and puts this process's
    environment back; a run whose two sides are the same is refused."""
    import importlib

    import psutil

    from kiln.demo import build_demo_repository

    script = importlib.import_module("before_after_perf_analyzer")
    repo = tmp_path / "repo"
    build_demo_repository(repo)
    monkeypatch.delenv("KILN_HTTP_INFER_LANE", raising=False)
    with script.server_from(SRC, repo, ["simple"], tmp_path / "serve.log", ["--http-workers", "2"],
                            {"KILN_HTTP_INFER_LANE": "0"}) as server:
        processes = [psutil.Process(server.process.pid), *psutil.Process(server.process.pid).children()]
        assert len(processes) >= 3  # the server process and its two HTTP workers
        assert {p.environ().get("KILN_HTTP_INFER_LANE") for p in processes} == {"0"}
        assert processes[0].environ()["PYTHONPATH"].split(os.pathsep)[0] == str(SRC.resolve())
    assert "KILN_HTTP_INFER_LANE" not in os.environ
    with pytest.raises(SystemExit):
        script.main(["--models", "simple"])
    assert "before and after are the same" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--after-env takes NAME=VALUE, got 'LANE'"):
        script.main(["--after-env", "LANE"])


def test_before_after_reads_how_the_http_workers_hold_the_connections(tmp_path: Path) -> None:
    """ConnectionSpread against a real `kiln serve` with 2 HTTP workers and 6 keep-alive clients: the reading with
    the most connections, busiest worker first; none from a server with one HTTP process."""
    import importlib

    import httpx

    from kiln.demo import build_demo_repository
    from kiln.serve_process import kiln_serve

    script = importlib.import_module("before_after_perf_analyzer")
    repo = tmp_path / "repo"
    build_demo_repository(repo)
    with kiln_serve([repo], "--http-workers", "2", "--allow-grpc", "false") as server:
        script.wait_workers_listening(server)
        with script.ConnectionSpread(server) as spread:
            clients = [httpx.Client(base_url=f"http://{server.http_url}", timeout=10) for _ in range(6)]
            try:
                for client in clients:
                    assert client.get("/v2/health/live").status_code == 200
                held = spread.read()
                time.sleep(2 * script.SPREAD_EVERY_S)  # the thread reads them too
            finally:
                for client in clients:
                    client.close()
        assert held == [3, 3] and spread.counts == [3, 3], (held, spread.counts)
    with kiln_serve([repo], "--http-workers", "1", "--allow-grpc", "false") as server:
        assert script.ConnectionSpread(server).read() is None


def test_before_after_writes_what_it_has_measured_so_far(tmp_path: Path) -> None:
    import argparse
    import importlib

    script = importlib.import_module("before_after_perf_analyzer")
    output = tmp_path / "pa.json"
    args = argparse.Namespace(before=Path("/before/src"), after=Path("/after/src"), output=output)
    cell = {"model": "resnet50", "protocol": "http", "concurrency": 16, "round": 1}
    rows = [{**cell, "tree": "before", "throughput": 4095.2, "p50_us": 3510.0, "rows_per_execution": 5.0}]
    script.write(args, ["--before", "/before/src"], rows)
    assert read_json(output)["rows"] == rows
    assert "| resnet50 | http | 16 | 1 | 4,095 | not yet |" in output.with_suffix(".txt").read_text()
    rows.append({**cell, "tree": "after", "throughput": 4316.5, "p50_us": 3396.0, "rows_per_execution": 5.2,
                 "server_cpu_us": 113.4, "workers_cpu_us": 1250.6, "http_connections": [4, 4, 4, 4]})
    script.write(args, ["--before", "/before/src"], rows)
    table = output.with_suffix(".txt").read_text()
    assert "| resnet50 | http | 16 | 1 | 4,095 | 4,316 | 1.05 |" in table
    # before: a cell measured without the CPU and the connections
    assert "| 5.0 | 5.2 | - | 113 + 1,251 | - | 4/4/4/4 |" in table
    assert "median after/before, http: 1.05 over 1 cells" in table


def test_served_replicas(tmp_path: Path) -> None:
    binary = _perf_analyzer()
    output = tmp_path / "replicas.json"
    assert run_main("served_replicas", "--perf-analyzer", binary, "--servers", "1,2", "--concurrency", "2",
                    "--workers", "2", "--window-ms", "500", "--stability", "50", "--output", str(output)) == 0
    rows = read_json(output)["rows"]
    assert [(r["servers"], len(r["per_server"])) for r in rows] == [(1, 1), (2, 2)]
    assert all(r["throughput"] > 0 for r in rows), rows
    assert all(cell["rows_per_execution"] == 1.0 for r in rows for cell in r["per_server"])  # `simple`: no batching
    assert "| 2 | 2 |" in output.with_suffix(".txt").read_text()


def test_connection_burst(tmp_path: Path) -> None:
    output = tmp_path / "burst.json"
    assert run_main("connection_burst", "--models", "2", "--concurrency", "2", "--seconds", "0.5", "--settle", "1",
                    "--output", str(output)) == 0
    rows = read_json(output)["rows"]
    assert [row["model"] for row in rows] == ["simple_0", "simple_1"]
    assert all(row["requests_per_s"] > 0 and row["p99_ms"] > 0 for row in rows), rows


def test_edge_figures(tmp_path: Path) -> None:
    output = tmp_path / "edge.json"
    assert run_main("edge_figures", "--requests", "20", "--warmup", "2", "--samples", "50", "--thresholds",
                    "0.3,0.5", "--check", "0.5", "--output", str(output)) == 0
    result = read_json(output)
    assert set(result["latency"]) == {"direct", "local", "forwarded"}
    assert all(s["n"] == 20 and s["p50_ms"] > 0 for s in result["latency"].values())
    checked = [row for row in result["sweep"]["rows"] if row["checked"] is not None]
    assert [(row["threshold"], row["checked"]) for row in checked] == [(0.5, True)]
