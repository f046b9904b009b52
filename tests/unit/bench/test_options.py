"""Range, list and shape arguments, option checks, and the command-line arguments."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.bench.options import MAX_SWEEP_LEVELS, BenchOptions, parse_list, parse_range, parse_shape
from kiln.cli import make_parser
from kiln.cli.bench import bench_options
from kiln.errors import InvalidArgumentError


def test_ranges_follow_perf_analyzers_start_end_step() -> None:
    assert parse_range("1:8:2", "--x", integer=True).values() == [1, 3, 5, 7]
    assert parse_range("4", "--x", integer=True).values() == [4]
    assert parse_range("2:4", "--x", integer=True).values() == [2, 3, 4]
    assert parse_range("10:30:10", "--x", integer=False).values() == [10.0, 20.0, 30.0]
    assert parse_range("0.5:1.5:0.5", "--x", integer=False).values() == [0.5, 1.0, 1.5]


def test_a_range_ending_in_zero_is_open_ended() -> None:
    sweep = parse_range("1:0:4", "--x", integer=True)
    assert sweep.open_ended
    assert sweep.values()[:3] == [1, 5, 9] and len(sweep.values()) == MAX_SWEEP_LEVELS


@pytest.mark.parametrize("text", ["", "a:b", "1:2:3:4", "0:4", "4:2", "1:4:0", "1::2", "1.5:2"])
def test_bad_ranges_are_refused(text: str) -> None:
    with pytest.raises(InvalidArgumentError, match="--concurrency-range"):
        parse_range(text, "--concurrency-range", integer=True)


def test_lists_and_shapes() -> None:
    assert parse_list("1,2,8", "--concurrency") == (1, 2, 8)
    assert parse_shape("IMAGE:3,224,224") == ("IMAGE", (3, 224, 224))
    assert parse_shape("ns:name:4") == ("ns:name", (4,))  # the dims follow the last colon
    for bad in ("x", "0,1", "1,a"):
        with pytest.raises(InvalidArgumentError):
            parse_list(bad, "--concurrency")
    for bad in ("IMAGE", "IMAGE:", ":3", "IMAGE:3,x", "IMAGE:-1"):
        with pytest.raises(InvalidArgumentError, match="--shape"):
            parse_shape(bad)


def test_options_default_to_concurrency_one() -> None:
    options = BenchOptions(model="simple")
    assert options.levels() == [1.0] and not options.request_rate_mode
    rates = BenchOptions(model="simple", request_rates=(5.0, 10.0))
    assert rates.levels() == [5.0, 10.0] and rates.request_rate_mode


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"concurrency": (1,), "request_rates": (5.0,)}, "not both"),
    ({"target": "carrier-pigeon"}, "--target"),
    ({"concurrency": (0,)}, ">= 1"),
    ({"request_rates": (0.0,)}, "> 0 requests/s"),
    ({"target": "http"}, "needs -u/--url"),
    ({"target": "inprocess"}, "needs --model-repository"),
    ({"batch_size": 0}, "-b/--batch-size"),
    ({"stability_percentage": 0.0}, "--stability-percentage"),
    ({"latency_threshold_ms": -1.0}, "--latency-threshold"),
    ({"model": ""}, "-m/--model is required"),
    ({"input_memory": "stack"}, "--input-memory"),
    ({"target": "http", "url": "localhost:8000", "input_memory": "shared"}, "direct and inprocess targets"),
])
def test_options_refuse_what_cannot_run(kwargs: dict[str, object], message: str) -> None:
    arguments: dict[str, object] = {"model": "simple", **kwargs}
    with pytest.raises(InvalidArgumentError, match=message):
        BenchOptions(**arguments)  # type: ignore[arg-type]


def parse(*argv: str) -> BenchOptions:
    """The options `kiln bench ARGV` measures with."""
    return bench_options(make_parser().parse_args(["bench", *argv]))


def test_command_line_defaults_mirror_perf_analyzer() -> None:
    options = parse("-m", "simple")
    assert (options.target, options.url) == ("http", "localhost:8000")
    assert options.levels() == [1.0]
    assert (options.batch_size, options.input_data, options.stability_percentage, options.max_trials) == \
        (1, "random", 10.0, 10)
    assert parse("-m", "simple", "--target", "grpc").url == "localhost:8001"
    assert parse("-m", "simple", "--target", "grpc", "--model-repository", "repo").url is None  # kiln bench serves


def test_command_line_sets_every_option(tmp_path: Path) -> None:
    options = parse("-m", "simple", "--target", "inprocess", "--model-repository", str(tmp_path), "-x", "2",
                    "--concurrency-range", "2:6:2", "-p", "300", "-s", "15", "-r", "4", "-b", "2",
                    "--input-data", "zero", "--shape", "A:1,2", "--shape", "B:3", "--seed", "9", "-l", "50")
    assert options.concurrency == (2, 4, 6)
    assert (options.model_version, options.measurement_interval_ms, options.stability_percentage) == ("2", 300, 15.0)
    assert (options.max_trials, options.batch_size, options.input_data, options.seed) == (4, 2, "zero", 9)
    assert options.shapes == {"A": (1, 2), "B": (3,)}
    assert options.latency_threshold_ms == 50.0
    rates = parse("-m", "m", "--target", "direct", "--request-rate-range", "100:300:100",
                  "--request-distribution", "poisson", "--max-outstanding", "8")
    assert rates.request_rates == (100.0, 200.0, 300.0)
    assert (rates.request_distribution, rates.max_outstanding, rates.concurrency) == ("poisson", 8, ())
    assert parse("-m", "m", "--target", "direct", "--concurrency", "1,4,16").concurrency == (1, 4, 16)


def test_command_line_refuses_two_loads_and_an_endless_sweep() -> None:
    with pytest.raises(InvalidArgumentError, match="--concurrency-range and --request-rate-range"):
        parse("-m", "m", "--concurrency-range", "1:2", "--request-rate-range", "5")
    with pytest.raises(InvalidArgumentError, match="--latency-threshold"):
        parse("-m", "m", "--concurrency-range", "1:0:1")
    assert len(parse("-m", "m", "--concurrency-range", "1:0:1", "-l", "10").concurrency) == MAX_SWEEP_LEVELS
