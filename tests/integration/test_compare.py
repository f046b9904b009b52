"""kiln bench compare end to end on the demo's `simple` model: every scenario measured with real `kiln serve`
processes and peer load processes, every process gone afterwards (also when the comparison is stopped midway),
and the HTML report rendered by headless Chromium. Windows are short and the stability bar loose so the file
stays well under a minute on 2 cores; nothing here depends on how fast the machine is."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

from kiln.bench.compare import CompareOptions, Comparison, write_repository
from kiln.bench.compare_run import command_line
from kiln.bench.report import PLOTS, write_report
from kiln.cli import make_parser
from kiln.cli.bench import compare_options
from kiln.config.parse import read_config
from kiln.demo import build_demo_repository
from kiln.errors import InvalidArgumentError, UnavailableError

psutil = pytest.importorskip("psutil")

# Debian's package, Ubuntu's older name, Google's build: whichever is on PATH.
CHROMIUM = next((found for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
                 if (found := shutil.which(name))), None)
SHOT_SIZE = (1200, 2600)  # tall enough for every table and the first plots below them
ARGS = ["simple", "--models", "1", "--concurrency", "1,4", "-p", "250", "-r", "3", "-s", "100", "--quiet"]


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("repo")
    build_demo_repository(root)
    return root


def parse(repo: Path, *extra: str) -> argparse.Namespace:
    """`kiln bench compare ARGS --model-repository REPO EXTRA` as parsed."""
    return make_parser().parse_args(["bench", "compare", *ARGS, "--model-repository", str(repo), *extra])


PROGRESS: list[dict[str, Any]] = []


@pytest.fixture(scope="module")
def compared(repo: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], list[int], Path]:
    options = compare_options(parse(repo))
    comparison = Comparison(options)
    doc = comparison.run(on_progress=PROGRESS.append)
    out = tmp_path_factory.mktemp("report")
    write_report(doc, out, command_line(options))
    return doc, comparison.pids, out


def test_every_scenario_is_measured_at_every_level(compared: tuple[dict[str, Any], list[int], Path]) -> None:
    doc = compared[0]
    assert doc["model"] == "simple" and doc["concurrency"] == [1, 4] and doc["protocol"] == "http"
    variants = [(s["name"], s["batching"], s["models_loaded"]) for s in doc["scenarios"]]
    assert variants == [("direct", False, 1), ("served", False, 1), ("served", True, 1),
                        ("served_with_others", False, 2), ("served_with_others", True, 2)]
    for scenario in doc["scenarios"]:
        assert [r["concurrency"] for r in scenario["results"]] == [1, 4]
        for level in scenario["results"]:
            assert level["errors"] == 0 and level["requests"] > 0 and level["throughput_infer_per_s"] > 0
            assert 0 < level["latency_ms"]["p50"] <= level["latency_ms"]["p99"]
            served = scenario["name"] != "direct"
            assert (level["server_us"] is not None) == served  # server phases exist only for served scenarios
        memory = scenario["memory_mb"]
        assert 10 < memory["idle"] <= memory["peak"]
        assert {"gpu_idle", "gpu_peak"} <= set(memory)  # None on a machine without a GPU


def test_served_levels_count_every_model_on_the_server(compared: tuple[dict[str, Any], list[int], Path]) -> None:
    doc = compared[0]
    for scenario in doc["scenarios"][1:]:
        expected = {"simple", *(f"simple_peer{i}" for i in range(1, scenario["models_loaded"]))}
        for level in scenario["results"]:
            rates = level["server_models_per_s"]
            assert set(rates) == expected
            assert all(rate > 0 for rate in rates.values())  # the peers' load reached the server too
            # Both count the same windows: the server's figure for the measured model is the client's.
            assert 0.85 < rates["simple"] / level["throughput_infer_per_s"] < 1.15
            batch = level["server_rows_per_execution"]["simple"]
            # One request per execution without dynamic batching; with it, never less (each request has one row).
            assert (batch >= 0.95) if scenario["batching"] else (0.95 < batch < 1.05), (scenario["name"], batch)
    assert "direct" not in {s["name"] for s in doc["scenarios"] if "server_models_per_s" in s["results"][0]}


def test_progress_reports_each_finished_scenario_as_partial(compared: tuple[dict[str, Any], list[int], Path]) -> None:
    doc = compared[0]
    assert [len(partial["scenarios"]) for partial in PROGRESS] == [1, 2, 3, 4]
    for partial in PROGRESS:
        done = len(partial["scenarios"])
        assert partial["scenarios"] == doc["scenarios"][:done]
        assert f"partial: {done} of 5 scenarios measured so far; the run did not finish" in partial["notes"]
    assert not any(note.startswith("partial") for note in doc["notes"])


def test_memory_figures_pick_the_batching_variant_with_the_higher_peak(
        compared: tuple[dict[str, Any], list[int], Path]) -> None:
    doc = compared[0]
    memory = doc["memory_mb"]
    assert set(memory) == {"direct", "served", "served_with_others"}
    assert memory["direct"] == doc["scenarios"][0]["memory_mb"]
    assert memory["served_with_others"]["models"] == 2
    for name in ("served", "served_with_others"):
        variants = [s for s in doc["scenarios"] if s["name"] == name]
        chosen = max(variants, key=lambda s: s["memory_mb"]["peak"])
        assert memory[name]["batching"] == chosen["batching"]
        assert (memory[name]["idle"], memory[name]["peak"]) == (chosen["memory_mb"]["idle"],
                                                                chosen["memory_mb"]["peak"])
        assert memory[name]["idle"] > 10


def test_no_process_is_left_behind(compared: tuple[dict[str, Any], list[int], Path]) -> None:
    pids = compared[1]
    assert len(pids) == 1 + 2 + 2 * 2  # the direct child; a server per served variant; a peer load per peer server
    assert _still_running(pids) == []
    # Other tests' fixtures may hold children of their own: only compare's kind of process must be gone.
    leftovers = [p for p in psutil.Process().children(recursive=True) if "kiln.bench.compare" in " ".join(_cmdline(p))]
    assert leftovers == []


def _still_running(pids: Iterable[int], timeout_s: float = 10.0) -> list[int]:
    """The pids that still run after up to ``timeout_s``. A zombie does not count: a grandchild whose parent was
    killed with it waits for the init process to reap it, which some containers' init does late."""
    processes = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            processes.append(psutil.Process(pid))
    _, alive = psutil.wait_procs(processes, timeout=timeout_s)
    running = []
    for process in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            if process.status() != psutil.STATUS_ZOMBIE:
                running.append(process.pid)
    return running


def _cmdline(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline()
    except psutil.Error:  # it ended between listing and reading
        return []


def test_stopping_compare_midway_stops_its_servers(repo: Path, tmp_path: Path) -> None:
    """SIGTERM while a `kiln serve` runs: compare unwinds and leaves no process behind."""
    command = [sys.executable, "-m", "kiln.cli", "bench", "compare", "simple", "--model-repository", str(repo),
               "--models", "1", "--concurrency", "1", "--batching", "off", "-p", "250", "-r", "3", "--output",
               str(tmp_path / "out")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    with open(tmp_path / "compare.log", "wb") as log:
        compare = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        seen = _wait_for_server(compare.pid)
        compare.send_signal(signal.SIGTERM)
        compare.wait(timeout=60)
    finally:
        if compare.poll() is None:
            compare.kill()
            compare.wait()
    assert compare.returncode == 128 + signal.SIGTERM, (tmp_path / "compare.log").read_text()
    assert _still_running(seen) == []
    # The direct scenario had finished: its partial report stays.
    partial = (tmp_path / "out" / "compare.md").read_text(encoding="utf-8")
    assert "| direct |" in partial and "partial: 1 of 3 scenarios measured so far" in partial
    assert (tmp_path / "out" / "report.html").exists()


def _wait_for_server(pid: int, timeout_s: float = 60.0) -> set[int]:
    """The pids under ``pid`` once a `kiln serve` runs there."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            children = psutil.Process(pid).children(recursive=True)
            if any("serve" in child.cmdline() for child in children):
                return {child.pid for child in children}
        except psutil.Error:  # a child came and went between listing and reading it
            pass
        time.sleep(0.05)
    raise AssertionError(f"compare started no `kiln serve` within {timeout_s:.0f} s")


@pytest.fixture(scope="module")
def compared_with_workers(repo: Path, tmp_path_factory: pytest.TempPathFactory
                          ) -> tuple[CompareOptions, dict[str, Any], list[int], Path]:
    """One comparison with peers sending from 2 processes each and `kiln serve` given 3 HTTP workers; the sizes of
    the peer load processes' own process pools, seen while it ran."""
    options = compare_options(parse(repo, "--concurrency", "2", "--batching", "on", "--client-processes", "2",
                                    "--serve-args=--http-workers 3"))
    work = tmp_path_factory.mktemp("work")
    comparison = Comparison(dataclasses.replace(options, work_dir=work))
    senders: list[int] = []
    done = threading.Event()

    def watch() -> None:  # the peer load process's own client processes, while it runs
        while not done.is_set():
            for process in psutil.Process().children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    if "peer" in process.cmdline() and "kiln.bench.compare" in " ".join(process.cmdline()):
                        senders.append(len(process.children()))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        doc = comparison.run()
    finally:
        done.set()
        watcher.join()
    return options, doc, senders, work


def test_peers_send_from_as_many_processes_as_the_measured_model(
        compared_with_workers: tuple[CompareOptions, dict[str, Any], list[int], Path]) -> None:
    _, doc, senders, _ = compared_with_workers
    assert max(senders, default=0) >= 2
    peer_rates = [level["server_models_per_s"]["simple_peer1"] for level in doc["scenarios"][-1]["results"]]
    assert peer_rates and all(rate > 0 for rate in peer_rates)


def test_serve_args_reach_every_kiln_serve_the_comparison_starts(
        compared_with_workers: tuple[CompareOptions, dict[str, Any], list[int], Path]) -> None:
    options, doc, _, work = compared_with_workers
    logs = sorted((work / "logs").glob("*/server.log"))
    assert len(logs) == 2  # served, and served beside the peer
    for log in logs:
        assert "(3 worker processes)" in log.read_text(encoding="utf-8"), log
    assert doc["settings"]["serve_args"] == ["--http-workers", "3"]
    assert all(level["cpu"]["children"] > 0 for scenario in doc["scenarios"][1:] for level in scenario["results"])
    line = command_line(options)
    assert "--serve-args=--http-workers 3" in line
    assert compare_options(make_parser().parse_args(line[1:])) == options


def test_statistics_that_cannot_be_read_give_a_clear_error() -> None:
    from kiln.bench.served_counts import served_counts
    from kiln.serve_process import free_port

    with pytest.raises(UnavailableError, match="could not read the server's statistics at 127.0.0.1:"):
        served_counts(f"127.0.0.1:{free_port()}")  # nothing listens there


def test_batching_variants_rewrite_only_the_config(repo: Path, tmp_path: Path) -> None:
    config = read_config(repo / "simple")
    assert config is not None
    root = write_repository(tmp_path / "r", repo / "simple", config, ["simple", "simple_peer1"], batching=True)
    peer = read_config(root / "simple_peer1")
    assert peer is not None and peer.name == "simple_peer1" and peer.HasField("dynamic_batching")
    assert peer.max_batch_size == config.max_batch_size
    assert (root / "simple_peer1" / "1").resolve() == (repo / "simple" / "1").resolve()
    off = write_repository(tmp_path / "off", repo / "mlp", read_config(repo / "mlp") or config, ["mlp"], False)
    unbatched = read_config(off / "mlp")
    assert unbatched is not None and not unbatched.HasField("dynamic_batching") and unbatched.max_batch_size == 32


def test_bad_arguments_fail_before_any_process_starts(repo: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="--models must be >= 1"):
        compare_options(parse(repo, "--models", "0"))
    with pytest.raises(InvalidArgumentError, match="has no folder"):
        CompareOptions(model="nope", model_repository=repo)
    with pytest.raises(InvalidArgumentError, match="--measurement-interval"):
        compare_options(parse(repo, "-p", "0"))
    assert command_line(compare_options(parse(repo)))[:4] == ["kiln", "bench", "compare", "simple"]
    with pytest.raises(InvalidArgumentError, match="--client-processes must be >= 1"):
        compare_options(parse(repo, "--client-processes", "0"))
    line = command_line(compare_options(parse(repo, "--client-processes", "3")))
    assert line[line.index("--client-processes") + 1] == "3"
    assert compare_options(parse(repo, "--client-processes", "3")).client_processes == 3
    with pytest.raises(InvalidArgumentError, match="--serve-args sets --http-port=1, which kiln bench compare sets"):
        compare_options(parse(repo, "--serve-args=--http-workers 2 --http-port=1"))
    with pytest.raises(InvalidArgumentError, match="--serve-args sets --metrics-p, which kiln bench compare sets"):
        compare_options(parse(repo, "--serve-args=--metrics-p 1"))  # argparse would take the abbreviation
    with pytest.raises(InvalidArgumentError, match="--serve-args '--http-wrkers 2': kiln serve would refuse it: "
                                                   "unrecognized arguments: --http-wrkers 2"):
        compare_options(parse(repo, "--serve-args=--http-wrkers 2"))
    with pytest.raises(InvalidArgumentError, match="--http-workers: expected 0 or more, got -1"):
        compare_options(parse(repo, "--serve-args=--http-workers=-1"))
    with pytest.raises(InvalidArgumentError, match="cannot be split into arguments: No closing quotation"):
        compare_options(parse(repo, "--serve-args=--log-verbose 'x"))
    with pytest.raises(InvalidArgumentError, match="'--allow-http false' turns HTTP off; kiln bench compare waits"):
        compare_options(parse(repo, "--serve-args=--allow-http false"))
    with pytest.raises(InvalidArgumentError, match="puts HTTP behind TLS or restricted APIs"):
        compare_options(parse(repo, "--serve-args=--http-restricted-api statistics:k=v"))
    with pytest.raises(InvalidArgumentError, match="turns gRPC off"):
        compare_options(parse(repo, "--protocol", "grpc", "--serve-args=--allow-grpc false"))
    assert compare_options(parse(repo, "--serve-args=--allow-grpc false")).serve_words() == ["--allow-grpc", "false"]


def test_report_renders_in_headless_chromium(compared: tuple[dict[str, Any], list[int], Path]) -> None:
    if CHROMIUM is None:
        pytest.skip("no chromium, chromium-browser or google-chrome on PATH: the report screenshot needs headless "
                    "Chromium")
    image = pytest.importorskip("matplotlib.image", reason="matplotlib (the bench extra) reads the screenshot")
    out = compared[2]
    assert {p.name for p in out.iterdir()} >= {"compare.json", "compare.md", "report.html", *PLOTS}
    with tempfile.TemporaryDirectory(prefix="kiln-chromium-") as profile:
        shot = Path(profile) / "shot.png"
        subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                        "--no-first-run", "--disable-background-networking", "--disable-component-update",
                        "--disable-sync", f"--user-data-dir={profile}/data", f"--screenshot={shot}",
                        f"--window-size={SHOT_SIZE[0]},{SHOT_SIZE[1]}", (out / "report.html").as_uri()],
                       check=True, timeout=90, capture_output=True)
        pixels = (image.imread(shot)[..., :3] * 255).round().astype(int)
    assert pixels.shape[:2] == (SHOT_SIZE[1], SHOT_SIZE[0])
    colors = pixels[..., 0] * 65536 + pixels[..., 1] * 256 + pixels[..., 2]
    table_header = (colors[:700] == 0xEEEEFF).sum()  # the tables' header cells (#eef), near the top
    assert table_header > 1000
    plots = colors[700:]
    for color in (0x1F77B4, 0xFF7F0E, 0x2CA02C):  # the plots' first series colours, below the tables
        assert (plots == color).sum() > 100, f"no #{color:06x} pixels where the plots should be"
    assert (plots != 0xFFFFFF).mean() > 0.05  # the plot area is not blank
