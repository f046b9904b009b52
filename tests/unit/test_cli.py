"""The `kiln` command's wiring: every command is reachable, `bench compare` is a real subcommand, every `kiln serve`
flag reaches the options the service runs with, and errors become `kiln: error: ...` with status 1."""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import types
import typing
from pathlib import Path
from typing import Any

import pytest

from kiln._flags import Flag, command_words
from kiln.bench.compare import CompareOptions
from kiln.bench.compare_run import command_line
from kiln.cli import bench as cli_bench
from kiln.cli import main, make_parser
from kiln.cli._arguments import declared_fields
from kiln.server.server import ServerOptions
from kiln.service import Service, ServiceOptions

COMMANDS = ["demo-repo", "config", "serve", "build", "bench", "edge", "capture", "ab", "advise"]


@pytest.mark.parametrize("command", [["demo-repo"], ["config"], ["serve"], ["build"], ["bench"], ["bench-compare"],
                                     ["bench", "compare"], ["advise"], ["edge"], ["edge", "calibrate"],
                                     ["edge-calibrate"], ["capture"], ["capture", "export"], ["ab"],
                                     ["ab", "report"]])
def test_every_command_has_help(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main([*command, "--help"])
    assert done.value.code == 0
    assert f"usage: kiln {' '.join(command).replace('-compare', ' compare').replace('-calibrate', ' calibrate')}" \
        in capsys.readouterr().out


def test_python_m_kiln_cli_runs_the_command() -> None:
    """How kiln starts `kiln serve` as a child process (kiln/serve_process.py)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-m", "kiln.cli", "--help"], capture_output=True, text=True, env=env,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: kiln ")
    assert all(command in done.stdout for command in COMMANDS)
    serve = subprocess.run([sys.executable, "-m", "kiln.cli", "serve", "--grpc-workers", "-1"], capture_output=True,
                           text=True, env=env, timeout=60)
    assert serve.returncode == 2 and "argument --grpc-workers: expected 0 or more, got -1" in serve.stderr


def test_the_parser_needs_no_server_extra() -> None:
    """`kiln edge` runs on a core install: building the parser (serve's flags included) imports no server-only
    package."""
    code = ("import sys; from kiln.cli import make_parser; make_parser(); "
            "print(sorted(m for m in ('prometheus_client', 'starlette', 'uvicorn', 'grpc') if m in sys.modules))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert (done.returncode, done.stdout) == (0, "[]\n"), done.stderr


# -- bench compare: a subcommand of bench ------------------------------------------------------------------------


def test_bench_compare_is_a_subcommand_with_its_own_flags(tmp_path: Path) -> None:
    (tmp_path / "simple").mkdir()
    argv = ["simple", "--model-repository", str(tmp_path), "--concurrency", "2,4", "-p", "300", "--batching", "off",
            "--device", "cpu", "--output", str(tmp_path / "out")]
    args = make_parser().parse_args(["bench", "compare", *argv])
    assert args.run is cli_bench.run_compare and args.output == tmp_path / "out"
    options = cli_bench.compare_options(args)
    assert options == CompareOptions(model="simple", model_repository=tmp_path, concurrency=(2, 4),
                                     measurement_interval_ms=300, batching="off", device="cpu")
    # The spelling from before it was a subcommand gives the same options.
    assert cli_bench.compare_options(make_parser().parse_args(["bench-compare", *argv])) == options


def test_bench_without_compare_still_measures_one_model() -> None:
    args = make_parser().parse_args(["bench", "-m", "simple", "--concurrency", "1,2"])
    assert args.run is not cli_bench.run_compare and args.bench_command is None
    options = cli_bench.bench_options(args)
    assert (options.model, options.target, options.concurrency) == ("simple", "http", (1, 2))


def test_bench_still_requires_a_model(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["bench", "--concurrency", "1"])
    assert done.value.code == 2
    assert "the following arguments are required: -m/--model" in capsys.readouterr().err


def test_compare_flags_are_the_compare_parsers(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["bench", "compare", "simple"])  # --model-repository is compare's, and required
    assert done.value.code == 2
    assert "usage: kiln bench compare" in capsys.readouterr().err


def test_a_comparison_written_out_as_flags_parses_back_to_itself(tmp_path: Path) -> None:
    """The report's command line (every setting spelled out) repeats the same comparison."""
    (tmp_path / "simple").mkdir()
    options = CompareOptions(model="simple", model_repository=tmp_path, concurrency=(3, 5), models=2,
                             protocol="grpc", batching="on", measurement_interval_ms=700, max_trials=4,
                             stability_percentage=12.5, device="gpu", client_processes=2, seed=7)
    line = command_line(options)
    assert line[:4] == ["kiln", "bench", "compare", "simple"] and "--measurement-interval" in line
    assert cli_bench.compare_options(make_parser().parse_args(line[1:])) == options


def test_bench_compare_reports_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nowhere"
    assert main(["bench", "compare", "simple", "--model-repository", str(missing)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kiln: error: ") and str(missing) in err


# -- kiln serve: every declared flag reaches the service -----------------------------------------------------------


def _non_default(field: dataclasses.Field[Any], declared: Flag, hint: Any, tmp_path: Path) -> tuple[list[str], Any]:
    """Command-line words setting ``field`` to a value other than its default, and the value expected."""
    default = field.default if field.default is not dataclasses.MISSING else field.default_factory()  # type: ignore[misc]
    name = declared.names[0]
    if declared.form in ("switch", "optional_value"):  # the flag alone turns it on
        assert default is False
        return [name], True
    base = typing.get_args(hint)[0] if typing.get_origin(hint) in (typing.Union, types.UnionType) else hint
    if typing.get_origin(base) in (list, tuple):  # repeated: two uses
        item = typing.get_args(base)[0]
        texts = [str(tmp_path / f"{field.name}{i}") if item is Path else f"{field.name}-{i}" for i in (1, 2)]
        values = [Path(t) if item is Path else t for t in texts]
        return [word for text in texts for word in (name, text)], values if typing.get_origin(base) is list \
            else tuple(values)
    if declared.choices is not None:
        choice = next(c for c in declared.choices if c != default)
        return [name, choice], choice
    if base is bool:
        return [name, "false" if default else "true"], not default
    if base is int:
        value = (default or 0) + 3
        return [name, str(value)], value
    if base is float:
        value = (default or 0.0) + 1.5
        return [name, str(value)], value
    if base is Path:
        path = tmp_path / f"{field.name}.pem"
        path.write_text("")
        return [name, str(path)], path
    if base is str:
        return [name, f"{field.name}-value"], f"{field.name}-value"
    raise AssertionError(f"add a test value for the flag of '{field.name}' ({hint})")


# Values that must be consistent with each other; every other flag gets a generated one.
SERVE_VALUES: dict[str, tuple[list[str], Any]] = {
    "control_mode": (["--model-control-mode", "explicit"], "explicit"),  # --load-model needs it
    "metrics_config": (["--metrics-config", "summary_latencies=true", "--metrics-config", "counter_latencies=false"],
                       ("summary_latencies=true", "counter_latencies=false")),
    "http_restricted_api": (["--http-restricted-api", "inference:k=v", "--http-restricted-api", "capture:k2=v2"],
                            ("inference:k=v", "capture:k2=v2")),
    "grpc_restricted_protocol": (["--grpc-restricted-protocol", "health,trace:k=v"], ("health,trace:k=v",)),
}


def test_every_serve_flag_reaches_the_options_the_service_runs_with(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    argv: list[str] = []
    expected: dict[str, Any] = {}
    for field, declared, hint in declared_fields(ServiceOptions):
        words, value = SERVE_VALUES.get(field.name) or _non_default(field, declared, hint, tmp_path)
        argv += words
        expected[field.name] = value
    assert {"repositories", "strict_readiness", "http_port", "log_format"} <= set(expected)  # nested ones too
    received: list[ServiceOptions] = []
    monkeypatch.setattr("kiln.service.run_service", lambda options: received.append(options) or 0)
    interval = sys.getswitchinterval()
    try:
        assert main(["serve", *argv]) == 0
    finally:
        sys.setswitchinterval(interval)
    (options,) = received
    for name, value in expected.items():
        owner = options if name in {f.name for f in dataclasses.fields(ServiceOptions)} else options.server
        assert getattr(owner, name) == value, name
    assert options.metrics.summary_latencies and not options.metrics.counter_latencies
    assert not options.metrics.cpu_metrics and not options.metrics.gpu_metrics
    # One object all the way down: the service's Server runs with the parsed ServerOptions, its manager too.
    service = Service(options)
    assert service.server.options is options.server
    assert service.server._catalog.manager.options is options.server


def test_serve_options_written_out_as_flags_parse_back_to_themselves(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "cert.pem").write_text("")
    options = ServiceOptions(ServerOptions(repositories=[tmp_path / "a", tmp_path / "b"], control_mode="explicit",
                                           load_models=("x", "y"), cpu_threads=2, allow_client_shm=True),
                             http_port=9000, allow_grpc=False, exit_timeout_s=2.5,
                             metrics_config=("counter_latencies=false", "summary_latencies=true"),
                             allow_model_download=True, api_key="key", https_certfile=tmp_path / "cert.pem",
                             log_format="ISO8601")
    received: list[ServiceOptions] = []
    monkeypatch.setattr("kiln.service.run_service", lambda options: received.append(options) or 0)
    assert main(["serve", *command_words(options)]) == 0
    assert received == [options]


def test_every_serve_argument_is_declared_on_the_options() -> None:
    """A flag added to the parser by hand would not reach the service; every one comes from a declaration."""
    commands = next(a for a in make_parser()._actions if isinstance(a, argparse._SubParsersAction))
    serve = commands.choices["serve"]
    dests = {action.dest for action in serve._actions if not isinstance(action, argparse._HelpAction)}
    assert dests == {field.name for field, _, _ in declared_fields(ServiceOptions)}


def test_serve_defaults_are_the_options_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KILN_API_KEY", raising=False)
    received: list[ServiceOptions] = []
    monkeypatch.setattr("kiln.service.run_service", lambda options: received.append(options) or 0)
    assert main(["serve", "--model-store", "repo"]) == 0  # the alias of --model-repository
    assert received == [ServiceOptions(ServerOptions(repositories=[Path("repo")]))]


def test_serve_api_key_defaults_to_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    received: list[ServiceOptions] = []
    monkeypatch.setattr("kiln.service.run_service", lambda options: received.append(options) or 0)
    monkeypatch.setenv("KILN_API_KEY", "secret")
    assert main(["serve", "--model-repository", "repo"]) == 0
    monkeypatch.setenv("KILN_API_KEY", "")
    assert main(["serve", "--model-repository", "repo"]) == 0
    assert [options.api_key for options in received] == ["secret", None]


@pytest.mark.parametrize(("argv", "message"), [
    (["--load-model", "a"], "--load-model needs --model-control-mode=explicit"),
    (["--model-control-mode", "explicit", "--load-model", "*", "--load-model", "a"], "must be the only --load-model"),
    (["--https-keyfile", "key.pem"], "need --https-certfile"),
    (["--https-certfile", "absent.pem"], "--https-certfile 'absent.pem' is not a file"),
    (["--metrics-config", "nonsense"], "metrics"),
    (["--gil-switch-interval-us", "0"], "--gil-switch-interval-us must be a positive number"),
])
def test_bad_serve_flags_are_reported(argv: list[str], message: str, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("kiln.service.run_service", lambda options: pytest.fail("the service must not start"))
    assert main(["serve", "--model-repository", "repo", *argv]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kiln: error: ") and message in err


def test_gil_switch_interval_is_set_and_checked() -> None:
    from kiln.cli.serve import set_switch_interval
    from kiln.errors import InvalidArgumentError

    before = sys.getswitchinterval()
    try:
        set_switch_interval(500)
        assert sys.getswitchinterval() == pytest.approx(0.0005)
        with pytest.raises(InvalidArgumentError, match="--gil-switch-interval-us must be a positive number of "
                                                       "microseconds, got 0"):
            set_switch_interval(0)
    finally:
        sys.setswitchinterval(before)
