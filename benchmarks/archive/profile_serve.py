"""Where ``kiln serve`` spends its time under load: py-spy on the server while wrk / h2load drive one infer path.

py-spy is not a project dependency: install it into a throwaway venv and pass its path, e.g.

    python3 -m venv /tmp/pyspy-venv && /tmp/pyspy-venv/bin/pip install py-spy
    .venv/bin/python benchmarks/profile_serve.py --py-spy /tmp/pyspy-venv/bin/py-spy \\
        --model mlp --mode http-json --concurrency 16 --duration 10 --out-dir benchmarks/results/profile

For each mode it writes ``<mode>.speedscope.json`` (open in https://www.speedscope.app), ``<mode>.collapsed.txt``
(folded stacks) and prints a summary: samples by layer (uvicorn/httptools, starlette, kiln HTTP/gRPC codecs,
kiln server/scheduler, engine/onnxruntime, asyncio, grpc, threading ...) and the top functions by self and
inclusive samples. ``--gil`` (default on) samples only threads holding the GIL, i.e. it shows what the one
Python core that serves every request is busy with.
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from _common import (
    GRPC_INFER_PATH,
    LoadResult,
    ServerProcess,
    Tensor,
    binary_body,
    build_demo_repo,
    free_port,
    grpc_request,
    grpc_unary,
    json_body,
    kiln_serve_cmd,
    model_case,
    project_env,
    run_h2load,
    run_wrk,
    running,
)

# First match wins; matched against "function (file)" of a frame, most specific first.
LAYERS: list[tuple[str, str]] = [
    ("onnxruntime session.run", r"onnxruntime"),
    ("kiln engine", r"kiln/engines/"),
    ("kiln http frontend", r"kiln/frontends/http/"),
    ("kiln grpc frontend", r"kiln/frontends/grpc/"),
    ("kiln server/scheduler", r"kiln/server/"),
    ("kiln other", r"kiln/"),
    ("uvicorn/httptools", r"uvicorn/|httptools"),
    ("starlette", r"starlette/"),
    ("grpc (aio/cython)", r"grpc/|grpc_|_cython"),
    ("protobuf", r"google/protobuf"),
    ("json", r"json/"),
    ("numpy", r"numpy/"),
    ("asyncio/uvloop", r"asyncio/|uvloop"),
    ("threading/futures", r"threading\.py|concurrent/futures|queue\.py"),
    ("prometheus", r"prometheus_client"),
    ("logging", r"logging/"),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--py-spy", required=True, help="path to the py-spy executable")
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--modes", default="http-json,grpc", help="http-json, http-binary, grpc (comma-separated)")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    parser.add_argument("--gil", action=argparse.BooleanOptionalAction, default=True,
                        help="sample only the thread holding the GIL (default on)")
    parser.add_argument("--native", action="store_true", help="also sample native frames (C/Cython/C++)")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--out-dir", type=Path, default=Path("profile-out"))
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)

    with tempfile.TemporaryDirectory(prefix="kiln-profile-") as tmp_name:
        tmp = Path(tmp_name)
        repo = tmp / "repo"
        build_demo_repo(repo)
        inputs, expected = model_case(repo, args.model)
        http_port, grpc_port, metrics_port = free_port(), free_port(), free_port()
        server = ServerProcess("kiln serve", kiln_serve_cmd(repo, http_port, grpc_port, metrics_port),
                               tmp / "serve.log", env=project_env())
        with running(server):
            server.wait_http_ready(http_port)
            url = f"http://127.0.0.1:{http_port}/v2/models/{args.model}/infer"
            for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
                load = _loader(mode, args, inputs, sorted(expected), url, grpc_port, server.proc.pid)
                load(1.0)  # warm-up
                print(f"== {mode} {args.model} c={args.concurrency}: profiling {args.duration:g} s", flush=True)
                result: dict[str, str] = {}
                loader = threading.Thread(target=_run_into, args=(result, load, args.duration + 1.0))
                loader.start()
                stem = args.out_dir / f"{mode}-{args.model}-c{args.concurrency}"
                collapsed = _record(args, server.proc.pid, stem)
                loader.join()
                print(f"   load during profiling (py-spy attached): {result.get('r')}")
                for line in summarize(collapsed, args.top):
                    print(line)
    return 0


def _run_into(result: dict[str, str], load: Callable[[float], str], duration: float) -> None:
    result["r"] = load(duration)


def _loader(mode: str, args: argparse.Namespace, inputs: list[Tensor], outputs: list[str], url: str,
            grpc_port: int, pgid: int) -> Callable[[float], str]:
    """A function running the load generator for ``d`` seconds and describing what it measured."""

    def describe(r: LoadResult) -> str:
        return (f"{r.rps:,.0f} req/s, p50 {r.p50_ms:.2f} ms, errors {r.errors}, server cores {r.cpu_server or 0:.2f}"
                + (f" [{r.notes}]" if r.notes else ""))

    if mode in ("http-json", "http-binary"):
        if mode == "http-json":
            body, headers = json_body(inputs), {"Content-Type": "application/json"}
        else:
            body, headers = binary_body(inputs, outputs)
        return lambda d: describe(run_wrk(url, body, headers, args.concurrency, d, server_pgid=pgid))
    if mode == "grpc":
        message = grpc_request(args.model, inputs)
        size = len(grpc_unary(grpc_port, GRPC_INFER_PATH, message))
        return lambda d: describe(run_h2load(f"http://127.0.0.1:{grpc_port}", message, args.concurrency, d, 0, size,
                                             server_pgid=pgid))
    raise SystemExit(f"unknown mode {mode} (expected http-json, http-binary or grpc)")


def _record(args: argparse.Namespace, pid: int, stem: Path) -> Path:
    common = [args.py_spy, "record", "--pid", str(pid), "--duration", f"{args.duration:g}", "--rate",
              str(args.rate), "--threads", "--full-filenames"]
    # Native stacks need the process paused while sampling; Python-only sampling does not.
    common += (["--gil"] if args.gil else []) + (["--native"] if args.native else ["--nonblocking"])
    collapsed = stem.with_suffix(".collapsed.txt")
    # Two recorders would double the sampling cost: record raw (folded) stacks, then convert for speedscope.
    proc = subprocess.run([*common, "--format", "raw", "--output", str(collapsed)], capture_output=True, text=True,
                          timeout=args.duration + 60)
    if proc.returncode != 0:
        raise RuntimeError(f"py-spy failed ({proc.returncode}): {proc.stdout[-1500:]} {proc.stderr[-1500:]}")
    _to_speedscope(collapsed, stem.with_suffix(".speedscope.json"))
    return collapsed


def _to_speedscope(collapsed: Path, out: Path) -> None:
    import json

    frames: list[dict[str, str]] = []
    index: dict[str, int] = {}
    samples: list[list[int]] = []
    weights: list[int] = []
    for stack, count in _stacks(collapsed):
        ids = []
        for frame in stack:
            if frame not in index:
                index[frame] = len(frames)
                frames.append({"name": frame})
            ids.append(index[frame])
        samples.append(ids)
        weights.append(count)
    doc = {"$schema": "https://www.speedscope.app/file-format-schema.json", "shared": {"frames": frames},
           "profiles": [{"type": "sampled", "name": collapsed.stem, "unit": "none", "startValue": 0,
                         "endValue": sum(weights), "samples": samples, "weights": weights}]}
    out.write_text(json.dumps(doc))


def _stacks(collapsed: Path) -> list[tuple[list[str], int]]:
    out = []
    for line in collapsed.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            out.append((stack.split(";"), int(count)))
    return out


def _func(frame: str) -> str:
    """'name (path:line)' -> 'name (short path)' without the line number."""
    m = re.match(r"(.*) \((.*?)(?::\d+)?\)$", frame)
    if not m:
        return frame
    path = re.sub(r".*/(site-packages|lib/python3\.\d+|src)/", "", m.group(2))
    return f"{m.group(1)} ({path})"


def _layer(frame: str) -> str:
    for name, pattern in LAYERS:
        if re.search(pattern, frame):
            return name
    return "other"


def summarize(collapsed: Path, top: int) -> list[str]:
    stacks = [(s[1:] if s and s[0].startswith(("thread ", "process ")) else s, c) for s, c in _stacks(collapsed)]
    stacks = [([f for f in s if not f.startswith("thread ")], c) for s, c in stacks]
    total = sum(c for _, c in stacks) or 1
    by_layer: collections.Counter[str] = collections.Counter()
    self_fn: collections.Counter[str] = collections.Counter()
    incl_fn: collections.Counter[str] = collections.Counter()
    for stack, count in stacks:
        if not stack:
            continue
        leaf = stack[-1]
        self_fn[_func(leaf)] += count
        # A sample belongs to the innermost frame that is in a known layer (the leaf may be a stdlib helper).
        layer = next((_layer(f) for f in reversed(stack) if _layer(f) != "other"), "other")
        by_layer[layer] += count
        for fn in {_func(f) for f in stack}:
            incl_fn[fn] += count
    lines = [f"   {total} samples; layers (innermost known layer of each sample):"]
    lines += [f"     {100 * c / total:5.1f}%  {name}" for name, c in by_layer.most_common()]
    lines.append(f"   top {top} self:")
    lines += [f"     {100 * c / total:5.1f}%  {fn}" for fn, c in self_fn.most_common(top)]
    lines.append(f"   top {top} inclusive:")
    lines += [f"     {100 * c / total:5.1f}%  {fn}" for fn, c in incl_fn.most_common(top)]
    return lines


if __name__ == "__main__":
    sys.exit(main())
