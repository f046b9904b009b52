"""Fuzz kiln's surfaces for minutes: HTTP bodies (JSON, binary framing, gzip/deflate), paths and headers, system
shared memory, sample capture and model download, gRPC messages (unary and streams, raw and mutated protobuf bytes),
raw HTTP request heads, and config.pbtxt text with repository layouts.

Each of ``--processes`` worker processes serves the HTTP app in process (most inputs: no sockets, so many per
second) and starts its own `kiln serve` for the wire share (gRPC, HTTP through uvicorn, raw request heads), so a
crash in one leaves the others running. Inputs come from benchmarks/_fuzz_cases.py with the worker's seed; the
oracle (benchmarks/_fuzz_oracle.py) wants a client error or a correct result for every one of them: no 5xx /
INTERNAL / UNKNOWN, no hang (``TIMEOUT_S`` a request), no crash, no region left mapped, and the checker (a
well-formed ``simple`` request between and alongside the inputs) keeps its answer. Findings in KNOWN_FINDINGS are
counted apart.

The corpus keeps the first input of each distinct answer class (surface, status, message shape) and of each
finding, bodies cut to 2 KiB, under ``--corpus`` (JSON lines per surface, at most ~1.5 MB in all).

    python benchmarks/fuzz.py --minutes 9 --processes 16 --output benchmarks/results/fuzz-<machine>-<date>.json
"""

from __future__ import annotations

import argparse
import base64
import json
import multiprocessing
import os
import random
import re
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _common import describe, header, table, write_outputs  # first: puts this checkout's src/ on the path
from _fuzz_cases import ConfigCase, GrpcCase, HttpCase, config_case, grpc_case, http_case
from _fuzz_drivers import LIMIT, Grpc, InProcessHttp, WireHttp, config_outcome, fuzz_server, run_config
from _fuzz_oracle import Answer, Finding

# (surface, where, weight): the share of inputs each gets. In-process HTTP is the bulk (fastest); the wire share
# exists for what only a real server parses (uvicorn's HTTP, gRPC's framing).
PLAN = (
    ("http_json", "app", 14), ("http_binary", "app", 10), ("http_encoding", "app", 6), ("http_oversize", "app", 1),
    ("http_paths", "app", 12), ("shm", "app", 3), ("capture", "app", 4), ("files", "app", 6),
    ("grpc_infer", "grpc", 12), ("grpc_stream", "grpc", 3), ("grpc_other", "grpc", 6),
    ("http_json", "wire", 2), ("http_binary", "wire", 1), ("http_paths", "wire", 2), ("shm", "wire", 1),
    ("http_raw", "wire", 2), ("config", "config", 6),
)
CHECK_EVERY = 25  # the checker runs alongside one input in this many
CORE_EFFICIENCY = 0.8  # what a core gives of its single-process rate with all 16 busy (shared caches, memory)
CORPUS_BODY = 2048
CORPUS_PER_SURFACE = 150  # per worker
CORPUS_FILE_BYTES = 110_000


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=1.0, help="how long to fuzz (default 1)")
    parser.add_argument("--processes", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument("--seed", type=int, default=0, help="worker i fuzzes with seed + i (default 0)")
    parser.add_argument("--output", type=Path, default=None, help="JSON results (a .txt beside it gets the text)")
    parser.add_argument("--corpus", type=Path, default=None,
                        help="folder for the corpus (default: fuzz-corpus/ beside --output; none without it)")
    args = parser.parse_args(argv)

    info = describe("kiln fuzzing", minutes=args.minutes, processes=args.processes, seed=args.seed)
    print(header(info), flush=True)
    deadline_s = args.minutes * 60
    started = time.monotonic()
    context = multiprocessing.get_context("spawn")  # grpc and onnxruntime threads do not survive fork
    with context.Pool(args.processes) as pool:
        results = pool.starmap(worker, [(args.seed + i, deadline_s) for i in range(args.processes)])
    elapsed = time.monotonic() - started
    data = merge(results, elapsed, info)
    text = header(info) + "\n" + report(data)
    print(report(data), flush=True)
    corpus = args.corpus or (args.output.parent / "fuzz-corpus" if args.output else None)
    if corpus is not None:
        write_corpus(corpus, [e for r in results for e in r["corpus"]])
    write_outputs(args.output, data, text)
    return 1 if data["unknown_findings"] or data["checker_failures"] else 0


# -- one worker -------------------------------------------------------------------------------------------------


def worker(seed: int, deadline_s: float) -> dict[str, Any]:
    """Fuzz until the deadline; counts, findings and corpus entries."""
    # A numpy warning on client input (an overflowing cast) becomes the exception it is under pytest: a 500 here.
    warnings.simplefilter("error", RuntimeWarning)
    rng = random.Random(seed)
    tag = f"w{seed}p{os.getpid()}"  # shared-memory object names: one per worker, also beside other runs
    state = _State()
    with tempfile.TemporaryDirectory(prefix=f"kiln-fuzz-{tag}-") as tmp:
        work = Path(tmp)
        app = InProcessHttp(work / "app", tag + "a")
        try:
            with fuzz_server(work / "wire", tag + "b") as server:
                wire, grpc = WireHttp(server, work / "wire" / "repo", tag + "b"), Grpc(server, tag + "b")
                surfaces = [(s, where) for s, where, weight in PLAN for _ in range(weight)]
                end = time.monotonic() + deadline_s - 5  # leave the pool time to collect
                startup = time.monotonic()
                while time.monotonic() < end:
                    surface, where = rng.choice(surfaces)
                    check = rng.randrange(CHECK_EVERY) == 0
                    try:
                        _one(rng, surface, where, check, app, wire, grpc, work, state, tag + "b")
                    except Exception:  # the fuzzer's own bug: count it, keep going
                        state.errors[traceback.format_exc(limit=3)[-400:]] += 1
                    if server.process.poll() is not None:
                        state.add_finding(Finding("server", "crash", f"kiln serve exited with "
                                                                     f"{server.process.returncode}"), None)
                        break
                state.busy_s = time.monotonic() - startup
                state.cpu_s = time.process_time() + _cpu_s(server.process.pid)
                wire.close()
                grpc.close()
        finally:
            app.close()
    return state.result()


def _one(rng: random.Random, surface: str, where: str, check: bool, app: InProcessHttp, wire: WireHttp,
         grpc: Grpc, work: Path, state: _State, wire_tag: str) -> None:
    key = f"{surface}@{where}"
    if where == "config":
        config = config_case(rng)
        findings = run_config(config, work)
        state.count(key, findings, config, [(config.surface, config_outcome(config.text))])
    elif where == "grpc":
        message = grpc_case(rng, surface, wire_tag)
        findings = grpc.run(message, check)
        state.count(key, findings, message, [_answer_class(message.surface, grpc.last)])
    elif surface == "http_raw":
        findings = wire.raw(http_case(rng, "http_paths", LIMIT, wire_tag), rng, check)
        state.count(key, findings, wire.answers[0][0], [(s.surface, a.body.decode()) for s, a in wire.answers])
    else:
        driver: InProcessHttp | WireHttp = app if where == "app" else wire
        request = http_case(rng, surface, LIMIT, app.tag if where == "app" else wire_tag)
        findings = driver.run(request, check)
        state.count(key, findings, request, [_answer_class(s.surface, a) for s, a in driver.answers])


def _cpu_s(pid: int) -> float:
    """CPU seconds a process (the worker's kiln serve) has used, threads and children included."""
    import psutil

    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system + times.children_user + times.children_system)


def _answer_class(surface: str, answer: Answer) -> tuple[str, str]:
    status = answer.grpc_code or str(answer.status) if answer.failure is None else answer.failure[:40]
    shape = re.sub(r"'[^']*'|\d+", "_", answer.message())[:60]
    return surface, f"{status} {shape}"


class _State:
    def __init__(self) -> None:
        self.inputs: Counter[str] = Counter()
        self.kinds: Counter[tuple[str, str]] = Counter()
        self.findings: dict[str, dict[str, Any]] = {}
        self.classes: set[tuple[str, str]] = set()
        self.corpus: list[dict[str, Any]] = []
        self.errors: Counter[str] = Counter()
        self.busy_s = 0.0
        self.cpu_s = 0.0

    def count(self, key: str, findings: list[Finding], case: HttpCase | GrpcCase | ConfigCase,
              classes: list[tuple[str, str]]) -> None:
        """One input, or one per request for an HTTP case of several steps (shm)."""
        self.inputs[key] += 1 + len(case.steps) if isinstance(case, HttpCase) else 1
        for finding in findings:
            self.add_finding(finding, case)
            self.kinds[(key, finding.kind)] += 1
        for answer_class in classes:
            per_surface = sum(1 for e in self.corpus if e["surface"] == answer_class[0])
            if answer_class not in self.classes and per_surface < CORPUS_PER_SURFACE:
                self.classes.add(answer_class)
                self.corpus.append({"surface": answer_class[0], "answer": answer_class[1], "case": encode_case(case)})

    def add_finding(self, finding: Finding, case: HttpCase | GrpcCase | ConfigCase | None) -> None:
        entry = self.findings.setdefault(finding.signature(), {
            "surface": finding.surface, "kind": finding.kind, "known": finding.known, "detail": finding.detail[:400],
            "count": 0, "example": encode_case(case) if case is not None else None})
        entry["count"] += 1
        if entry["count"] == 1 and case is not None:
            self.corpus.append({"surface": finding.surface, "finding": finding.signature(),
                                "known": finding.known, "case": encode_case(case)})

    def result(self) -> dict[str, Any]:
        return {"inputs": dict(self.inputs), "kinds": [[k, kind, n] for (k, kind), n in self.kinds.items()],
                "findings": self.findings, "corpus": self.corpus, "fuzzer_errors": dict(self.errors),
                "busy_s": self.busy_s, "cpu_s": self.cpu_s}


def encode_case(case: HttpCase | GrpcCase | ConfigCase) -> dict[str, Any]:
    """A case as JSON, bytes in base64 and cut to CORPUS_BODY."""
    def b64(data: bytes) -> str:
        return base64.b64encode(data[:CORPUS_BODY]).decode()

    if isinstance(case, HttpCase):
        return {"method": case.method, "path": case.path[:CORPUS_BODY], "headers": [list(h) for h in case.headers],
                "body_b64": b64(case.body), "body_bytes": len(case.body),
                "steps": [encode_case(s) for s in case.steps]}
    if isinstance(case, GrpcCase):
        return {"method": case.method, "payloads_b64": [b64(p) for p in case.payloads]}
    files = {k: (v if isinstance(v, str) or v is None else {"b64": b64(v)}) for k, v in case.files.items()}
    return {"config": case.text[:CORPUS_BODY], "files": files}


# -- merging and reporting --------------------------------------------------------------------------------------


def merge(results: list[dict[str, Any]], elapsed: float, info: dict[str, Any]) -> dict[str, Any]:
    inputs: Counter[str] = Counter()
    kinds: Counter[tuple[str, str]] = Counter()
    findings: dict[str, dict[str, Any]] = {}
    errors: Counter[str] = Counter()
    for result in results:
        inputs.update(result["inputs"])
        kinds.update({(k, kind): n for k, kind, n in result["kinds"]})
        errors.update(result["fuzzer_errors"])
        for signature, entry in result["findings"].items():
            if signature in findings:
                findings[signature]["count"] += entry["count"]
            else:
                findings[signature] = dict(entry)
    total = sum(inputs.values())
    cpu_s = sum(r["cpu_s"] for r in results)
    per_cpu_s = total / cpu_s if cpu_s else 0.0
    per_surface = {key: {"inputs": n, **{kind: kinds[(key, kind)] for kind in
                                         ("5xx", "internal", "crash", "hang", "accepted-invalid", "wrong-error",
                                          "file-leak", "shm-leak", "checker") if kinds[(key, kind)]}}
                   for key, n in sorted(inputs.items())}
    unknown = [f for f in findings.values() if f["known"] is None]
    return {**info, "elapsed_s": round(elapsed, 1), "inputs_total": total,
            "inputs_per_s": round(total / elapsed, 1) if elapsed else 0.0,
            "minutes_for_1m_inputs": round(1e6 / (total / elapsed) / 60, 1) if total else None,
            # Workers and their servers are CPU-bound and share nothing: inputs per CPU second times the cores.
            "cpu_s": round(cpu_s, 1), "inputs_per_cpu_s": round(per_cpu_s, 1),
            "estimate_16_cores_9_min": round(per_cpu_s * 16 * 540 * CORE_EFFICIENCY),
            "per_surface": per_surface, "known_classes_hit": sorted({f["known"] for f in findings.values()
                                                                     if f["known"]}),
            "unknown_findings": len(unknown), "checker_failures": sum(f["count"] for f in findings.values()
                                                                      if f["kind"] == "checker"),
            "findings": sorted(findings.values(), key=lambda f: (f["known"] is not None, -f["count"])),
            "fuzzer_errors": dict(errors)}


def report(data: dict[str, Any]) -> str:
    rows = [[key, s["inputs"], sum(v for k, v in s.items() if k != "inputs")] for key, s in data["per_surface"].items()]
    lines = [table(["surface@where", "inputs", "findings"], rows),
             f"\n{data['inputs_total']:,} inputs in {data['elapsed_s']} s: {data['inputs_per_s']:,} inputs/s "
             f"(1,000,000 inputs would take {data['minutes_for_1m_inputs']} min at this rate)",
             f"{data['inputs_per_cpu_s']:,} inputs per CPU second (workers and their servers, {data['cpu_s']} CPU s): "
             f"about {data['estimate_16_cores_9_min']:,} inputs in 9 minutes on 16 cores "
             f"(x{CORE_EFFICIENCY} for cores sharing caches and memory)",
             f"known classes hit: {', '.join(data['known_classes_hit']) or 'none'}",
             f"unknown findings: {data['unknown_findings']}, checker failures: {data['checker_failures']}"]
    for finding in data["findings"]:
        label = f"known: {finding['known']}" if finding["known"] else "NEW"
        lines.append(f"- [{label}] {finding['kind']} on {finding['surface']} x{finding['count']}: "
                     f"{finding['detail'][:240]}")
    if data["fuzzer_errors"]:
        lines.append(f"fuzzer errors (bugs in the fuzzer, not kiln): {sum(data['fuzzer_errors'].values())}")
    return "\n".join(lines) + "\n"


def write_corpus(folder: Path, entries: list[dict[str, Any]]) -> None:
    """One JSON-lines file per surface: the first entry of each finding, then of each answer class, across workers,
    at most CORPUS_FILE_BYTES a file (the corpus stays under ~2 MB)."""
    folder.mkdir(parents=True, exist_ok=True)
    seen: set[str] = set()
    by_surface: dict[str, list[str]] = {}
    for entry in sorted(entries, key=lambda e: "finding" not in e):
        key = f"{entry['surface']}|{entry.get('answer') or entry.get('finding')}"
        lines = by_surface.setdefault(entry["surface"], [])
        line = json.dumps(entry, ensure_ascii=True)
        if key not in seen and sum(map(len, lines)) + len(line) < CORPUS_FILE_BYTES:
            seen.add(key)
            lines.append(line)
    for surface, lines in by_surface.items():
        (folder / f"{surface}.jsonl").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
