"""kiln bench end to end on the demo's `simple` model: direct, inprocess, and a real `kiln serve` process over
HTTP and gRPC. Windows are short (200 ms) and the stability bar loose, so the whole file stays quick on 2 cores;
the assertions are about what was measured, never about how fast this machine is."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from kiln.bench import BenchOptions, BenchResult, LevelResult, run
from kiln.bench.targets import RequestFailedError
from kiln.bench.targets.remote import listening_pid, split_url
from kiln.cli import main
from kiln.demo import build_demo_repository
from kiln.errors import InvalidArgumentError, NotFoundError
from kiln.testing.serve import KilnProcess, kiln_serve
from kiln.v2.client.aio import Connection

QUICK = {"measurement_interval_ms": 200, "max_trials": 3, "stability_percentage": 100.0}


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("repo")
    build_demo_repository(root)
    return root


@pytest.fixture(scope="module")
def server(repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnProcess]:
    log_path = tmp_path_factory.mktemp("log") / "kiln.log"
    with kiln_serve([repo], "--model-control-mode", "explicit", "--load-model", "simple", "--exit-timeout-secs", "5",
                    log_path=log_path) as process:
        yield process


def check_level(level: LevelResult, batch_size: int = 1) -> None:
    """What every measured level must show, whatever the target."""
    assert level.errors == 0
    assert 1 <= level.windows <= QUICK["max_trials"]
    assert level.requests > 0 and level.duration_s > 0
    assert level.throughput_infer_per_s == pytest.approx(level.requests / level.duration_s)
    assert level.throughput_items_per_s == pytest.approx(level.throughput_infer_per_s * batch_size)
    latency = level.latency_ms
    assert 0 < latency.p50 <= latency.p90 <= latency.p95 <= latency.p99
    assert latency.avg > 0
    memory = level.memory_mb
    assert memory.rss_idle is not None and memory.rss_peak is not None
    assert 10 < memory.rss_idle <= memory.rss_peak


def check_server(level: LevelResult) -> None:
    assert level.server_us is not None
    assert level.server_us.compute_infer > 0
    assert level.server_us.total < level.latency_ms.avg * 1000  # the server's part fits in the client's latency


def test_direct_bench_sweeps_concurrency(repo: Path) -> None:
    result = run(BenchOptions(model="simple", target="direct", model_repository=repo, concurrency=(1, 2), **QUICK))
    assert (result.model, result.target, result.url, result.batch_size) == ("simple", "direct", None, 1)
    assert [level.concurrency for level in result.results] == [1, 2]
    for level in result.results:
        check_level(level)
        assert level.client_ms is None and level.server_us is None and level.sends is None
    assert result.machine["cpu_count"] >= 1


def test_direct_bench_with_asyncio_calls_awaits_one_shared_engine(repo: Path) -> None:
    result = run(BenchOptions(model="simple", target="direct", model_repository=repo, concurrency=(1, 4),
                              direct_calls="asyncio", **QUICK))
    assert [level.concurrency for level in result.results] == [1, 4]
    for level in result.results:
        check_level(level)
    with pytest.raises(InvalidArgumentError, match="--direct-calls"):
        BenchOptions(model="simple", target="direct", model_repository=repo, direct_calls="fibers")


def test_a_latency_threshold_stops_the_sweep_after_the_first_level_over_it(repo: Path) -> None:
    stopped = run(BenchOptions(model="simple", target="direct", model_repository=repo, concurrency=(1, 2, 4),
                               latency_threshold_ms=1e-6, **QUICK))  # every level is slower than a nanosecond
    assert [level.concurrency for level in stopped.results] == [1]
    kept = run(BenchOptions(model="simple", target="direct", model_repository=repo, concurrency=(1, 2, 4),
                            latency_threshold_ms=60_000.0, **QUICK))
    assert [level.concurrency for level in kept.results] == [1, 2, 4]


def test_direct_bench_at_a_request_rate_keeps_its_schedule(repo: Path) -> None:
    result = run(BenchOptions(model="simple", target="direct", model_repository=repo, request_rates=(200.0,),
                              batch_size=4, **QUICK))
    level = result.results[0]
    check_level(level, batch_size=4)
    assert level.request_rate == 200.0 and level.concurrency is None
    assert level.sends is not None and level.sends.dropped == 0
    assert _on_schedule(level, 200.0)  # the clock's, not the CPU's
    assert 0 < level.throughput_infer_per_s <= 200.0 * 1.25, "never faster than the schedule"


def _on_schedule(level: LevelResult, rate: float) -> bool:
    """The sends due at ``rate`` over the level: at least over its merged windows (less 25%), and at most over
    them plus a second, since the schedule runs from the load's start to its stop, around the windows (on a busy
    machine starting and stopping the load takes a while)."""
    assert level.sends is not None
    return 0.75 * rate * level.duration_s <= level.sends.scheduled <= rate * (level.duration_s + 1.0)


def test_sends_due_while_every_slot_is_busy_are_dropped(repo: Path) -> None:
    # one slot cannot keep up with 200000 requests/s: the schedule carries on and the extra sends are dropped
    result = run(BenchOptions(model="simple", target="direct", model_repository=repo, request_rates=(200000.0,),
                              max_outstanding=1, **QUICK))
    level = result.results[0]
    assert level.sends is not None
    assert _on_schedule(level, 200000.0)
    assert level.sends.dropped > level.sends.scheduled // 2
    assert level.requests <= level.sends.scheduled - level.sends.dropped


def test_inprocess_bench_reports_the_server_breakdown(repo: Path) -> None:
    result = run(BenchOptions(model="simple", target="inprocess", model_repository=repo, concurrency=(2,), **QUICK))
    level = result.results[0]
    check_level(level)
    check_server(level)
    assert level.client_ms is None


@pytest.mark.parametrize("target", ["inprocess", "direct"])
def test_a_bench_with_its_inputs_in_shared_memory(repo: Path, target: str) -> None:
    result = run(BenchOptions(model="simple", target=target, model_repository=repo, concurrency=(2,),
                              input_memory="shared", **QUICK))
    check_level(result.results[0])
    assert result.options["input_memory"] == "shared"


def test_http_bench_against_kiln_serve(server: KilnProcess) -> None:
    host, port = split_url(server.http_url, 8000)
    assert listening_pid(host, port) == server.process.pid  # memory is the server's, found from its port
    result = run(BenchOptions(model="simple", target="http", url=server.http_url, concurrency=(1, 2), **QUICK))
    assert result.url == server.http_url
    for level in result.results:
        check_level(level)
        check_server(level)
        assert level.client_ms is not None and level.client_ms.send > 0 and level.client_ms.recv > 0
        assert level.cpu is not None and level.cpu.process > 0 and level.cpu.busiest_thread > 0  # the server's


def test_a_server_with_workers_shows_their_cpu_apart(repo: Path, tmp_path: Path) -> None:
    with kiln_serve([repo], "--model-control-mode", "explicit", "--load-model", "simple", "--http-workers", "2",
                    log_path=tmp_path / "kiln.log") as served:
        result = run(BenchOptions(model="simple", target="http", url=served.http_url, concurrency=(2,),
                                  server_pid=served.process.pid, **QUICK))
    level = result.results[0]
    check_level(level)
    # The worker processes parsed and answered every HTTP request; the server process ran the model.
    assert level.cpu is not None and level.cpu.children > 0.05 and level.cpu.process > 0.05, level.cpu


def test_http_bench_with_json_tensors_and_a_data_file(server: KilnProcess, tmp_path: Path) -> None:
    data = tmp_path / "data.json"
    data.write_text(json.dumps({"data": [{"INPUT0": list(range(16)), "INPUT1": [1] * 16},
                                         {"INPUT0": [2] * 16, "INPUT1": list(range(16))}]}))
    result = run(BenchOptions(model="simple", target="http", url=f"http://{server.http_url}", concurrency=(1,),
                              input_data=str(data), batch_size=2, input_tensor_format="json",
                              output_tensor_format="json", server_pid=server.process.pid, **QUICK))
    level = result.results[0]
    check_level(level, batch_size=2)
    check_server(level)


def test_grpc_bench_against_kiln_serve(server: KilnProcess) -> None:
    result = run(BenchOptions(model="simple", target="grpc", url=server.grpc_url, concurrency=(2,),
                              server_pid=server.process.pid, **QUICK))
    level = result.results[0]
    check_level(level)
    check_server(level)
    assert level.client_ms is not None and level.client_ms.send > 0


@pytest.mark.parametrize("target", ["http", "grpc"])
def test_several_client_processes_share_each_level_and_every_record_counts(server: KilnProcess,
                                                                          target: str) -> None:
    from kiln.bench.measure import Settings, measure_level
    from kiln.bench.records import Level
    from kiln.bench.resources import MemorySampler
    from kiln.bench.targets import create_target
    from kiln.bench.targets.processes import ProcessesTarget

    url = server.http_url if target == "http" else server.grpc_url
    options = BenchOptions(model="simple", target=target, url=url, concurrency=(3,), client_processes=2, **QUICK)
    before = server_successes(server)
    with create_target(options) as bench_target:
        assert isinstance(bench_target, ProcessesTarget)
        model = bench_target.open()
        from kiln.bench.data import build_requests

        bench_target.prepare(build_requests(model, "random", 1, {}, 0))
        settings = Settings(interval_ns=200_000_000, stability_percentage=100.0, max_trials=2)
        measured = measure_level(bench_target, Level(concurrency=3), settings, MemorySampler(None, None))
        counts = list(bench_target.records_per_process)
    assert all(count > 0 for count in counts), f"each process sent requests: {counts}"
    assert 0 < measured.requests <= sum(counts) and measured.errors == 0
    # Every request the workers recorded reached the server, plus one check request per process and the parent's.
    assert server_successes(server) - before == sum(counts) + 3


def test_bench_with_client_processes_through_run(server: KilnProcess) -> None:
    result = run(BenchOptions(model="simple", target="http", url=server.http_url, concurrency=(1, 4),
                              client_processes=2, server_pid=server.process.pid, **QUICK))
    for level in result.results:
        check_level(level)
        check_server(level)
    assert result.options["client_processes"] == 2  # the JSON result says how the load was sent


@pytest.mark.parametrize(("fields", "message"), [
    ({"target": "direct", "client_processes": 2}, "applies to the http and grpc targets"),
    ({"target": "http", "url": "localhost:1", "client_processes": 2, "request_rates": (10.0,)},
     "drives concurrency levels"),
    ({"target": "http", "url": "localhost:1", "client_processes": 0}, "--client-processes must be >= 1"),
])
def test_client_process_options_are_checked(fields: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        BenchOptions(model="simple", **fields)  # type: ignore[arg-type]


def server_successes(server: KilnProcess) -> int:
    import urllib.request

    with urllib.request.urlopen(f"http://{server.http_url}/v2/models/simple/stats", timeout=10) as answer:
        stats = json.load(answer)["model_stats"]
    return sum(int(entry["inference_stats"]["success"]["count"]) for entry in stats)


def test_grpc_bench_at_a_poisson_rate(server: KilnProcess) -> None:
    result = run(BenchOptions(model="simple", target="grpc", url=server.grpc_url, request_rates=(100.0,),
                              request_distribution="poisson", server_pid=server.process.pid, **QUICK))
    level = result.results[0]
    check_level(level)
    assert level.sends is not None and level.sends.dropped == 0
    assert level.sends.scheduled == pytest.approx(100 * 0.2 * level.windows, rel=0.5)


def test_grpc_sends_beyond_max_outstanding_are_dropped(server: KilnProcess) -> None:
    result = run(BenchOptions(model="simple", target="grpc", url=server.grpc_url, request_rates=(5000.0,),
                              max_outstanding=1, server_pid=server.process.pid, **QUICK))
    level = result.results[0]
    check_level(level)
    assert level.sends is not None and level.sends.dropped > 0
    assert level.requests <= level.sends.scheduled - level.sends.dropped


def test_an_unknown_model_fails_before_measuring(server: KilnProcess) -> None:
    with pytest.raises(NotFoundError, match="answered 404"):
        run(BenchOptions(model="nope", target="http", url=server.http_url, **QUICK))


def test_a_request_the_model_refuses_fails_the_check(repo: Path, tmp_path: Path) -> None:
    data = tmp_path / "words.json"  # simple_string adds integers written as strings: "x" is refused
    data.write_text(json.dumps({"data": [{"INPUT0": ["x"] * 16, "INPUT1": ["1"] * 16}]}))
    with pytest.raises(RequestFailedError, match="check request to model 'simple_string' failed.*not an integer"):
        run(BenchOptions(model="simple_string", target="direct", model_repository=repo, input_data=str(data),
                         **QUICK))


def test_direct_bench_of_a_python_model_with_string_tensors(repo: Path) -> None:
    # Python models run one request at a time per engine: two slots get two engines
    result = run(BenchOptions(model="simple_string", target="direct", model_repository=repo, concurrency=(2,),
                              **QUICK))
    check_level(result.results[0])


def test_bench_starts_kiln_serve_itself_and_the_cli_writes_json_and_csv(
        repo: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_json, out_csv = tmp_path / "bench.json", tmp_path / "bench.csv"
    assert main(["bench", "-m", "simple", "--target", "http", "--model-repository", str(repo), "--concurrency", "2",
                 "-p", "200", "-r", "3", "-s", "100", "--json", str(out_json), "--csv", str(out_csv),
                 "--quiet"]) == 0
    stdout, stderr = capsys.readouterr()
    assert "Request concurrency: 2" in stdout and "Summary" in stdout
    assert "kiln bench: concurrency" not in stderr  # --quiet
    result = BenchResult.from_json(out_json.read_text())
    assert result.url is not None and result.url.startswith("127.0.0.1:")  # the server kiln bench started
    check_level(result.results[0])
    check_server(result.results[0])
    lines = out_csv.read_text().splitlines()
    assert lines[0].startswith("Concurrency,Inferences/Second,Client Send,") and lines[1].startswith("2,")


async def test_http_connection_reopens_what_the_server_closed_after_keep_alive() -> None:
    connections = 0

    async def answer_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        writer.close()  # as a keep-alive timeout does: no "Connection: close" announced

    server = await asyncio.start_server(answer_once, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    connection = Connection("127.0.0.1", port, timeout_s=5)
    try:
        for _ in range(3):
            response = await connection.request("GET", "/v2/health/ready")
            assert (response.status, response.body) == (200, b"ok")
            await asyncio.sleep(0.01)
    finally:
        await connection.close()
        server.close()
        await server.wait_closed()
    assert connections == 3
