"""benchmarks/soak.py: a short run against a real `kiln serve` (every kind of traffic, versions published, the
toggled model unloaded and loaded, chaos clients) must give the time series, the summary with every criterion,
the plot, and no wrong answer or failed well-formed request; and the failure accounting, on its own."""

from __future__ import annotations

from pathlib import Path

from ._smoke import read_json, run_main

# The tests below import the benchmark's helper modules inside: ._smoke puts benchmarks/ on sys.path first.

# 12 s of traffic (4 windows of 3 s, the first the warm-up) plus the server's and the clients' start and the
# report: about 30 s on a busy 2-core machine.
SHORT_RUN = ("--minutes", "0.2", "--sample-seconds", "3", "--warmup-minutes", "0.05", "--publish-every", "3",
             "--toggle-every", "6", "--toggle-down", "1", "--http-clients", "1", "--grpc-clients", "1",
             "--rate", "30", "--shm-rotate-every", "10", "--slow-chunk-delay-ms", "20", "--report-only")


def test_a_short_soak_run_answers_everything_right(tmp_path: Path) -> None:
    stem = tmp_path / "soak"
    assert run_main("soak", *SHORT_RUN, "--output", str(stem)) == 0
    data = read_json(Path(f"{stem}.json"))
    series, summary = data["series"], data["summary"]

    assert len(series) == 4
    for row in series:
        assert {"t_end_s", "rss_mib", "fds", "threads", "shm_mapped", "shm_entries", "cpu_pct", "requests", "p50_ms",
                "p99_ms", "wrong", "failed", "unavailable_by_design"} <= set(row)
        assert row["rss_mib"] > 0 and row["fds"] > 0 and row["threads"] > 0
    assert all(row["requests"] > 0 and row["p99_ms"] >= row["p50_ms"] > 0 for row in series[:-1])

    assert summary["wrong_answers"] == 0, summary["criteria"]
    assert summary["failed_requests"] == 0, summary["criteria"]
    names = [check["name"] for check in summary["criteria"]]
    assert len(names) == 8 and any("RSS" in n for n in names) and any("p99" in n for n in names)

    # Every kind of traffic was answered, over both protocols.
    assert {"simple json", "simple binary", "simple", "simple shm", "mlp a/b", "ensemble", "simple_string",
            "sequence", "repeat stream", "shm register", "shm unregister"} <= set(summary["operations"])
    chaos = summary["chaos"]
    for event in ("cut mid-headers", "cut mid-body", "cut after request", "stream cancelled", "slow: answered"):
        assert chaos.get(event, 0) > 0, chaos

    # Versions were published and routed to: more than the two mlp versions of the start answered.
    publishes = [e for e in data["events"] if e["action"] == "publish"]
    assert len(publishes) >= 3 and all(e["error"] is None for e in publishes)
    assert len(summary["versions"]) >= 3, summary["versions"]
    assert {e["action"] for e in data["events"]} == {"publish", "unload", "load"}

    text = Path(f"{stem}.txt").read_text()
    assert text.count("PASS  ") + text.count("FAIL  ") == 8
    assert Path(f"{stem}.png").read_bytes().startswith(b"\x89PNG")


def _failure(model: str, start: float, end: float) -> dict[str, object]:
    return {"operation": "x", "model": model, "start": start, "end": end, "message": "unavailable"}


def _event(action: str, start: float, end: float, error: str | None = None) -> dict[str, object]:
    return {"action": action, "model": "simple_string", "start": start, "end": end, "error": error}


def test_only_failures_inside_an_unload_of_the_toggled_model_are_by_design() -> None:
    from _soak_report import Criteria, merge_windows, outages, summarize

    events = [_event("unload", 10.0, 10.1), _event("load", 12.0, 12.5),  # down from 10.0 to 12.5
              _event("unload", 30.0, 30.1), _event("load", 32.0, 32.4, error="load failed"),
              _event("load", 40.0, 40.3)]  # the failed load keeps it down until 40.3
    assert outages(events, "simple_string") == [(10.0, 12.5), (30.0, 40.3)]
    failures = [_failure("simple_string", 9.9, 10.05),  # overlaps the unload call: by design
                _failure("simple_string", 12.4, 12.6),  # ends after the load returned, began before: by design
                _failure("simple_string", 12.6, 12.7),  # after the load returned: a failure
                _failure("simple", 11.0, 11.1),  # another model during the outage: a failure
                _failure("simple_string", 35.0, 35.1)]  # while the failed load keeps it down: by design
    windows = [{"window": 0, "latencies_ms": {"simple": [1.0]}, "ok": {"simple": 1}, "wrong": 0,
                "failed": len(failures), "wrong_answers": [], "failures": failures, "versions": {}, "chaos": {}},
               {"window": 1, "latencies_ms": {"simple": [1.0]}, "ok": {"simple": 1}, "wrong": 0, "failed": 0,
                "wrong_answers": [], "failures": [], "versions": {}, "chaos": {}}]
    samples = [{"window": i, "rss_mib": 100.0, "fds": 30, "threads": 10, "shm_mapped": 2} for i in range(2)]
    series = merge_windows(samples, windows, events, 2, 10.0, "simple_string")
    assert (series[0]["failed"], series[0]["unavailable_by_design"]) == (2, 3)
    summary = summarize(series, windows, events, Criteria(warmup_windows=1, shm_slack=0), "simple_string")
    assert summary["failed_requests"] == 2 and not summary["passed"]
    failed = {check["name"] for check in summary["criteria"] if not check["passed"]}
    assert failed == {"zero failed well-formed requests", "zero failed publish/unload/load actions"}


def test_growth_past_five_percent_after_the_warm_up_fails_the_bar() -> None:
    from _soak_report import Criteria, merge_windows, summarize

    rss = [100.0, 104.0, 106.0]  # the warm-up ends at 100: 106 is 6% more
    windows = [{"window": i, "latencies_ms": {"simple": [1.0, 1.2]}, "ok": {"simple": 2}, "wrong": 0, "failed": 0,
                "wrong_answers": [], "failures": [], "versions": {}, "chaos": {}} for i in range(3)]
    samples = [{"window": i, "rss_mib": value, "fds": 30, "threads": 10, "shm_mapped": 2}
               for i, value in enumerate(rss)]
    series = merge_windows(samples, windows, [], 3, 10.0, "simple_string")
    summary = summarize(series, windows, [], Criteria(warmup_windows=1, shm_slack=0), "simple_string")
    verdicts = {check["name"]: check["passed"] for check in summary["criteria"]}
    assert verdicts["RSS flat within 5%"] is False
    assert verdicts["open descriptors flat within 5%"] is True
    assert summary["passed"] is False


def test_the_answer_checks_catch_a_wrong_answer() -> None:
    import numpy as np
    import pytest
    from _soak_traffic import WrongAnswer, check_class, check_close, check_equal

    want = np.arange(16, dtype=np.int32).reshape(1, 16)
    check_equal("OUTPUT0", want.copy(), want)
    for got in (want + 1, want.reshape(16), None):
        with pytest.raises(WrongAnswer, match="OUTPUT0"):
            check_equal("OUTPUT0", got, want)
    probs = np.array([[0.1, 0.7, 0.2]])
    check_close("PROBS", probs * (1 + 1e-6), probs)
    with pytest.raises(WrongAnswer):
        check_close("PROBS", probs + 1e-3, probs)
    check_class(np.array([[1]], dtype=np.int32), probs)
    with pytest.raises(WrongAnswer, match="CLASS"):
        check_class(np.array([[2]], dtype=np.int32), probs)
