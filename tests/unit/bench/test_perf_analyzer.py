"""perf_analyzer as kiln bench's load generator, without the binary: the command line built for a level, its CSV
turned into a LevelResult, the windows read from its output, finding the binary, the options checked, and runs
stopped or killed for their memory (a stand-in process in the binary's place)."""

from __future__ import annotations

import dataclasses
import os
import stat
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kiln.bench import BenchOptions, BenchResult
from kiln.bench.compare import CompareOptions
from kiln.bench.perf_analyzer import (
    MemoryStopped,
    Output,
    PerfAnalyzerError,
    PerfAnalyzerLoad,
    command,
    find_binary,
    level_result,
    read_row,
)
from kiln.bench.progress import Progress
from kiln.bench.records import Level
from kiln.bench.resources import MemoryFigures
from kiln.bench.result import CSV_COLUMNS
from kiln.demo import build_demo_repository
from kiln.errors import InvalidArgumentError

# What perf_analyzer 2.60 wrote with -f and --verbose-csv for `-m mlp -i grpc -b 2 --concurrency-range 1:1`.
VERBOSE_CSV = (
    "Concurrency,Inferences/Second,Client Send,Network+Server Send/Recv,Server Queue,Server Compute Input,"
    "Server Compute Infer,Server Compute Output,Client Recv,p50 latency,p90 latency,p95 latency,p99 latency,"
    "Avg latency,request/response,response wait\n"
    "1,2231.52,3,799,13,4,51,15,1,788,969,1315,3214,888,4,877\n")
MEMORY = MemoryFigures(rss_idle=100.0, rss_peak=101.5, gpu_idle=None, gpu_peak=None)


def options(**fields: object) -> BenchOptions:
    settings: dict[str, object] = {"model": "mlp", "target": "grpc", "url": "127.0.0.1:8001",
                                   "load_generator": "perf_analyzer", "measurement_interval_ms": 300,
                                   "stability_percentage": 25.0, "max_trials": 6}
    settings.update(fields)
    return BenchOptions(**settings)  # type: ignore[arg-type]


def flag_value(words: list[str], name: str) -> str:
    return words[words.index(name) + 1]


def test_a_concurrency_level_over_grpc_in_the_request_body() -> None:
    words = command("/opt/pa", options(), "127.0.0.1:8001", Level(concurrency=4), Path("/tmp/x.csv"))
    assert words[0] == "/opt/pa"
    assert [flag_value(words, f) for f in ("-m", "-u", "-i", "-b")] == ["mlp", "127.0.0.1:8001", "grpc", "1"]
    assert flag_value(words, "--concurrency-range") == "4:4"
    assert flag_value(words, "--measurement-interval") == "300"
    assert flag_value(words, "--stability-percentage") == "25"
    assert flag_value(words, "--max-trials") == "6"
    assert flag_value(words, "-f") == "/tmp/x.csv" and "--verbose-csv" in words and "-v" in words
    assert "--shared-memory" not in words and "--request-rate-range" not in words
    assert "--input-tensor-format" not in words  # an http flag
    assert "-x" not in words


def test_system_shared_memory_over_http_with_every_input_setting() -> None:
    chosen = options(target="http", shared_memory="system", output_shared_memory_size=4096, batch_size=2,
                     model_version="1", shapes={"INPUT0": (3, 4)}, input_data="zero", output_tensor_format="json")
    words = command("pa", chosen, "localhost:8000", Level(concurrency=2), Path("o.csv"))
    assert flag_value(words, "-i") == "http" and flag_value(words, "-b") == "2" and flag_value(words, "-x") == "1"
    assert flag_value(words, "--shared-memory") == "system"
    assert flag_value(words, "--output-shared-memory-size") == "4096"
    assert flag_value(words, "--shape") == "INPUT0:3,4"
    assert flag_value(words, "--input-data") == "zero"
    assert flag_value(words, "--input-tensor-format") == "binary"
    assert flag_value(words, "--output-tensor-format") == "json"


def test_a_request_rate_level_and_the_relaxed_rerun() -> None:
    level = Level(request_rate=250.0, distribution="poisson")
    words = command("pa", options(), "h:1", level, Path("o.csv"), stability_percentage=999, max_trials=3)
    assert flag_value(words, "--request-rate-range") == "250:250"
    assert flag_value(words, "--request-distribution") == "poisson"
    assert "--concurrency-range" not in words
    assert flag_value(words, "--stability-percentage") == "999" and flag_value(words, "--max-trials") == "3"


def test_the_csv_row_becomes_the_fields_kiln_fills(tmp_path: Path) -> None:
    path = tmp_path / "level.csv"
    path.write_text(VERBOSE_CSV)
    level = level_result(read_row(path), Level(concurrency=1), 2, requests=817, windows=4, stable=True,
                         memory=MEMORY, span_ns=(10, 20))
    assert level.load_generator == "perf_analyzer"
    assert level.concurrency == 1 and level.request_rate is None
    assert level.throughput_items_per_s == pytest.approx(2231.52)  # perf_analyzer's Inferences/Second: batch items
    assert level.throughput_infer_per_s == pytest.approx(2231.52 / 2)
    assert dataclasses.astuple(level.latency_ms) == pytest.approx((0.888, 0.788, 0.969, 1.315, 3.214))
    assert level.client_ms is not None and (level.client_ms.send, level.client_ms.recv) == pytest.approx((0.003, 0.001))
    assert level.server_us is not None
    assert dataclasses.astuple(level.server_us) == pytest.approx((13.0, 4.0, 51.0, 15.0))
    assert (level.requests, level.windows, level.stable, level.errors) == (817, 4, True, 0)
    assert level.duration_s == pytest.approx(817 / (2231.52 / 2))
    assert level.window_span_ns == (10, 20) and level.memory_mb == MEMORY
    assert level.sends is None


def test_the_row_round_trips_through_json_and_csv_with_its_load_generator(tmp_path: Path) -> None:
    path = tmp_path / "level.csv"
    path.write_text(VERBOSE_CSV)
    level = level_result(read_row(path), Level(concurrency=1), 1, requests=100, windows=3, stable=False,
                         memory=MEMORY, span_ns=None)
    result = BenchResult(model="mlp", target="grpc", url="h:1", batch_size=1, machine={}, results=[level])
    assert BenchResult.from_json(result.to_json()).results == [level]
    header, row = result.to_csv().splitlines()
    assert header.split(",")[-1] == CSV_COLUMNS[-1] == "Load Generator"
    assert row.split(",")[-1] == "perf_analyzer"
    assert row.split(",")[:2] == ["1", "2231.52"]
    old = result.to_dict()
    del old["results"][0]["load_generator"]  # a file written before the field existed
    assert BenchResult.from_dict(old).results[0].load_generator == "kiln"


def test_a_csv_without_a_row_or_a_column_is_a_clear_error(tmp_path: Path) -> None:
    empty = tmp_path / "empty.csv"
    empty.write_text(VERBOSE_CSV.splitlines()[0] + "\n")
    with pytest.raises(PerfAnalyzerError, match="no result row"):
        read_row(empty)
    short = tmp_path / "short.csv"  # written without --verbose-csv: no Avg latency
    short.write_text("Concurrency,Inferences/Second,p50 latency\n1,10,5\n")
    with pytest.raises(PerfAnalyzerError, match="no 'Avg latency' column.*--verbose-csv"):
        level_result(read_row(short), Level(concurrency=1), 1, requests=1, windows=1, stable=True, memory=MEMORY,
                     span_ns=None)


def test_the_merged_windows_span_the_last_three_passes() -> None:
    output = Output(lines=["Request concurrency: 2", "  Pass [1] throughput: 1 infer/sec.", "  Client: ",
                           "    Request count: 2871", "    Throughput: 2459.47 infer/sec"],
                    pass_ns=[100, 200, 300, 400, 500], started_ns=50)
    assert output.span_ns() == (200, 500)
    assert output.request_count() == 2871
    assert Output(pass_ns=[100, 200], started_ns=50).span_ns() == (50, 200)
    assert Output(started_ns=50).span_ns() is None and Output().request_count() == 0


def test_the_binary_is_the_flag_else_the_environment_else_path(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    binary = tmp_path / "perf_analyzer"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(binary.stat().st_mode | stat.S_IEXEC)
    monkeypatch.delenv("KILN_PERF_ANALYZER", raising=False)
    assert find_binary(str(binary)) == str(binary)
    monkeypatch.setenv("KILN_PERF_ANALYZER", str(binary))
    assert find_binary(None) == str(binary)
    monkeypatch.delenv("KILN_PERF_ANALYZER")
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}")
    assert find_binary(None) == str(binary)
    with pytest.raises(PerfAnalyzerError, match=r"--perf-analyzer PATH.*pip install perf-analyzer.*glibc >= 2.38"):
        find_binary(str(tmp_path / "missing"))


@pytest.mark.parametrize(("fields", "message"), [
    ({"target": "direct", "url": None, "model_repository": Path("r")}, "drives the http and grpc targets"),
    ({"client_processes": 2}, "one C\\+\\+ process"),
    ({"input_data": "samples.npz"}, "not .npz"),
    ({"load_generator": "kiln", "shared_memory": "system"}, "needs --load-generator perf_analyzer"),
    ({"shared_memory": "cuda"}, "--shared-memory is 'cuda'"),
    ({"load_generator": "locust"}, "--load-generator is 'locust'"),
    ({"output_shared_memory_size": 0}, "--shared-memory-output-size must be >= 1"),
])
def test_load_generator_options_are_checked(fields: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        options(**fields)


def test_compare_checks_the_served_load_generator_before_running(tmp_path: Path) -> None:
    build_demo_repository(tmp_path)
    with pytest.raises(InvalidArgumentError, match="needs --load-generator perf_analyzer"):
        CompareOptions(model="simple", model_repository=tmp_path, shared_memory="system")
    chosen = CompareOptions(model="simple", model_repository=tmp_path, load_generator="perf_analyzer",
                            protocol="grpc", shared_memory="system", client_processes=3)
    served = chosen.served_options("127.0.0.1:9", 8, 1234)
    assert (served.target, served.load_generator, served.shared_memory) == ("grpc", "perf_analyzer", "system")
    assert served.concurrency == (8,) and served.server_pid == 1234
    assert served.client_processes == 1  # perf_analyzer is one process; the peers keep 3


class _NoMemory:
    def start_level(self) -> None:
        pass

    def sample(self) -> None:
        pass

    def stop_level(self) -> MemoryFigures:
        return MEMORY


def _stand_in(tmp_path: Path, body: str) -> str:
    """An executable in perf_analyzer's place that runs ``body`` (Python) whatever its arguments."""
    binary = tmp_path / "perf_analyzer"
    binary.write_text(f"#!{sys.executable}\n{body}\n")
    binary.chmod(binary.stat().st_mode | stat.S_IEXEC)
    return str(binary)


def test_a_run_whose_memory_keeps_growing_is_stopped_with_the_reason(tmp_path: Path) -> None:
    binary = _stand_in(tmp_path, "import time\nheld = []\nwhile True:\n"
                                 "    held.append(bytearray(16 * 2**20))\n    time.sleep(0.02)")
    load = PerfAnalyzerLoad(binary, options(), "127.0.0.1:8001", memory_limit_bytes=200 * 2**20)
    started = time.monotonic()
    with pytest.raises(PerfAnalyzerError, match=r"stopped holding [\d.]+ GiB of memory, more than the 0\.2 GiB "
                                                r"allowed, on model 'mlp': .*memory grows with every request"):
        load.measure(Level(concurrency=1), _NoMemory(), Progress(enabled=False))
    assert time.monotonic() - started < 30  # stopped by the guard, not by the level's time limit


def test_a_run_killed_with_sigkill_points_at_the_oom_killer(tmp_path: Path) -> None:
    binary = _stand_in(tmp_path, "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)")
    load = PerfAnalyzerLoad(binary, options(), "127.0.0.1:8001")
    with pytest.raises(PerfAnalyzerError, match=r"exit status -9\) on model 'mlp' at .*killed \(SIGKILL\), most "
                                                r"likely by the kernel's OOM killer"):
        load.measure(Level(concurrency=1), _NoMemory(), Progress(enabled=False))



def _outgrows_the_guard_first(tmp_path: Path, runs: Path, stopped_runs: int) -> str:
    """A stand-in whose first ``stopped_runs`` runs keep taking memory; later ones write a result. Each run's
    arguments are appended to ``runs``."""
    return _stand_in(tmp_path, textwrap.dedent(f"""
        import pathlib, sys, time
        runs = pathlib.Path({str(runs)!r})
        tries = len(runs.read_text().splitlines()) if runs.exists() else 0
        with runs.open("a") as f:
            f.write(" ".join(sys.argv[1:]) + "\\n")
        if tries < {stopped_runs}:
            held = []
            while True:
                held.append(bytearray(16 * 2**20))
                time.sleep(0.02)
        pathlib.Path(sys.argv[sys.argv.index("-f") + 1]).write_text({VERBOSE_CSV!r})
        for n in (1, 2, 3):
            print(f"  Pass [{{n}}] throughput: 2231.52 infer/sec.", flush=True)
        print("  Request count: 6700")
    """))


def test_a_level_stopped_for_its_memory_is_measured_again_over_shorter_windows(tmp_path: Path) -> None:
    """The first run outgrows the guard; the rerun (three windows half as long, no stability rule) writes its CSV
    and the level is reported unstable from it."""
    runs = tmp_path / "runs"
    load = PerfAnalyzerLoad(_outgrows_the_guard_first(tmp_path, runs, 1), options(measurement_interval_ms=2000),
                            "127.0.0.1:8001", memory_limit_bytes=200 * 2**20)
    result = load.measure(Level(concurrency=64), _NoMemory(), Progress(enabled=False))
    assert result.throughput_infer_per_s == pytest.approx(2231.52) and not result.stable and result.windows == 3
    first, rerun = runs.read_text().splitlines()
    assert "--measurement-interval 2000 --stability-percentage 25 --max-trials 6" in first
    assert "--measurement-interval 1000 --stability-percentage 999 --max-trials 3" in rerun


def test_a_level_stopped_again_is_measured_over_windows_halved_again(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    load = PerfAnalyzerLoad(_outgrows_the_guard_first(tmp_path, runs, 2), options(measurement_interval_ms=2000),
                            "127.0.0.1:8001", memory_limit_bytes=200 * 2**20)
    result = load.measure(Level(concurrency=64), _NoMemory(), Progress(enabled=False))
    assert result.throughput_infer_per_s == pytest.approx(2231.52) and not result.stable
    first, second, third = runs.read_text().splitlines()
    assert "--measurement-interval 2000 " in first and "--measurement-interval 1000 " in second
    assert "--measurement-interval 500 --stability-percentage 999 --max-trials 3" in third


def test_a_level_stopped_at_the_shortest_windows_is_an_error(tmp_path: Path) -> None:
    binary = _stand_in(tmp_path, "import time\nheld = []\nwhile True:\n"
                                 "    held.append(bytearray(16 * 2**20))\n    time.sleep(0.02)")
    load = PerfAnalyzerLoad(binary, options(), "127.0.0.1:8001", memory_limit_bytes=200 * 2**20)
    with pytest.raises(MemoryStopped, match="--measurement-interval 250 "):  # 300 ms halved, but not below 250
        load.measure(Level(concurrency=1), _NoMemory(), Progress(enabled=False))
