"""``kiln bench --load-generator perf_analyzer`` and ``kiln bench compare --load-generator perf_analyzer`` against
real `kiln serve` processes on the demo's `simple` and `mlp`: HTTP and gRPC, tensors in the request body and in
system shared memory. perf_analyzer reads the server's metadata, config and statistics itself, so these runs also
show it works against `kiln serve` unchanged.

perf_analyzer is not a Python dependency: the tests run where the binary is found (``$KILN_PERF_ANALYZER`` or
``perf_analyzer`` on PATH; the perf-analyzer wheel ships it and it needs glibc >= 2.38) and skip elsewhere.
Windows are short and the stability bar loose; nothing asserted depends on how fast the machine is."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from kiln.bench import BenchOptions, LevelResult, run
from kiln.bench.compare import CompareOptions, Comparison
from kiln.bench.perf_analyzer import PerfAnalyzerError
from kiln.bench.report import scenario_label
from kiln.cli import main
from kiln.demo import build_demo_repository
from kiln.testing.serve import KilnProcess, kiln_serve

BINARY = os.environ.get("KILN_PERF_ANALYZER") or shutil.which("perf_analyzer")
pytestmark = pytest.mark.skipif(BINARY is None, reason="perf_analyzer not found: set KILN_PERF_ANALYZER or put it "
                                                       "on PATH (pip install perf-analyzer, glibc >= 2.38)")

QUICK = {"measurement_interval_ms": 250, "max_trials": 4, "stability_percentage": 100.0}


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("repo")
    build_demo_repository(root)
    return root


@pytest.fixture(scope="module")
def server(repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnProcess]:
    log_path = tmp_path_factory.mktemp("log") / "kiln.log"
    with kiln_serve([repo], "--model-control-mode", "explicit", "--load-model", "simple", "--load-model", "mlp",
                    "--allow-client-shm", "--exit-timeout-secs", "5", log_path=log_path) as process:
        yield process


def check_level(level: LevelResult, batch_size: int = 1) -> None:
    """The fields kiln's own generator fills, here from perf_analyzer."""
    assert level.load_generator == "perf_analyzer"
    assert level.errors == 0 and level.sends is None
    assert 1 <= level.windows <= QUICK["max_trials"]
    assert level.requests > 0 and level.duration_s > 0
    assert level.throughput_infer_per_s == pytest.approx(level.requests / level.duration_s)
    assert level.throughput_items_per_s == pytest.approx(level.throughput_infer_per_s * batch_size)
    latency = level.latency_ms
    assert 0 < latency.p50 <= latency.p90 <= latency.p95 <= latency.p99 and latency.avg > 0
    assert level.client_ms is not None and level.client_ms.send >= 0 and level.client_ms.recv >= 0
    assert level.server_us is not None and level.server_us.compute_infer > 0
    assert level.server_us.total < latency.avg * 1000  # the server's part fits in the client's latency
    assert level.window_span_ns is not None and level.window_span_ns[0] < level.window_span_ns[1]
    memory = level.memory_mb  # the server's, found from the port it listens on
    assert memory.rss_idle is not None and memory.rss_peak is not None and 10 < memory.rss_idle <= memory.rss_peak


@pytest.mark.parametrize(("model", "target", "shared_memory"), [
    ("simple", "http", "none"), ("simple", "grpc", "none"), ("mlp", "http", "system"), ("simple", "grpc", "system"),
])
def test_perf_analyzer_measures_kiln_serve(server: KilnProcess, model: str, target: str, shared_memory: str) -> None:
    url = server.http_url if target == "http" else server.grpc_url
    result = run(BenchOptions(model=model, target=target, url=url, concurrency=(2,), load_generator="perf_analyzer",
                              shared_memory=shared_memory, **QUICK))
    assert result.options["load_generator"] == "perf_analyzer"
    assert result.options["shared_memory"] == shared_memory
    assert [level.concurrency for level in result.results] == [2]
    check_level(result.results[0])


def test_perf_analyzer_at_a_request_rate(server: KilnProcess) -> None:
    result = run(BenchOptions(model="simple", target="grpc", url=server.grpc_url, request_rates=(150.0,),
                              request_distribution="poisson", load_generator="perf_analyzer", **QUICK))
    level = result.results[0]
    check_level(level)
    assert level.request_rate == 150.0 and level.concurrency is None
    assert level.throughput_infer_per_s <= 150.0 * 1.5, "perf_analyzer keeps the schedule"


def test_the_cli_starts_kiln_serve_with_shared_memory_and_writes_json_and_csv(
        repo: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_json, out_csv = tmp_path / "r.json", tmp_path / "r.csv"
    assert main(["bench", "-m", "mlp", "--target", "grpc", "--model-repository", str(repo), "--concurrency", "1",
                 "-b", "2", "-p", "250", "-r", "4", "-s", "100", "--load-generator", "perf_analyzer",
                 "--perf-analyzer", str(BINARY), "--shared-memory", "system", "--json", str(out_json),
                 "--csv", str(out_csv), "--quiet"]) == 0
    assert "Load generator: perf_analyzer" in capsys.readouterr().out
    doc = json.loads(out_json.read_text())
    level = LevelResult.from_dict(doc["results"][0])
    check_level(level, batch_size=2)
    assert out_csv.read_text().splitlines()[1].endswith(",perf_analyzer")


def test_an_unstable_level_is_reported_as_such(server: KilnProcess) -> None:
    # No machine keeps three windows within 0.0001 %: perf_analyzer gives up, kiln reports the level unstable
    # with the figures of three windows measured without the rule.
    result = run(BenchOptions(model="simple", target="http", url=server.http_url, concurrency=(1,),
                              load_generator="perf_analyzer", measurement_interval_ms=200, max_trials=3,
                              stability_percentage=0.0001))
    level = result.results[0]
    assert level.stable is False and level.windows == 3
    assert level.requests > 0 and 0 < level.latency_ms.p50 <= level.latency_ms.p99


def test_a_failing_run_is_a_clear_error(repo: Path, tmp_path: Path) -> None:
    with kiln_serve([repo], "--model-control-mode", "explicit", "--load-model", "simple", "--exit-timeout-secs", "5",
                    log_path=tmp_path / "kiln.log") as plain:  # no --allow-client-shm: regions are refused
        options = BenchOptions(model="simple", target="http", url=plain.http_url, concurrency=(1,),
                               load_generator="perf_analyzer", shared_memory="system", **QUICK)
        with pytest.raises(PerfAnalyzerError, match=r"perf_analyzer failed \(exit status \d+\) on model 'simple'"):
            run(options)


def test_compare_drives_its_served_rows_with_perf_analyzer(repo: Path) -> None:
    options = CompareOptions(model="mlp", model_repository=repo, concurrency=(2,), models=1, batching="off",
                             protocol="grpc", load_generator="perf_analyzer", perf_analyzer=BINARY,
                             shared_memory="system", measurement_interval_ms=250, max_trials=4,
                             stability_percentage=100.0)
    doc = Comparison(options).run()
    assert [s["name"] for s in doc["scenarios"]] == ["direct", "served", "served_with_others"]
    assert doc["settings"]["load_generator"] == "perf_analyzer"
    assert any("perf_analyzer" in note for note in doc["notes"])
    direct, *served = doc["scenarios"]
    assert direct["results"][0]["load_generator"] == "kiln"
    assert scenario_label(direct) == "direct"
    for scenario in served:
        assert scenario_label(scenario).endswith("(perf_analyzer)")  # the table's and the plots' label
        level = LevelResult.from_dict(scenario["results"][0])
        check_level(level)
        counted = scenario["results"][0]["server_models_per_s"]
        assert counted["mlp"] > 0
        if scenario["name"] == "served_with_others":
            assert counted["mlp_peer1"] > 0  # the peer's kiln load ran beside perf_analyzer's
