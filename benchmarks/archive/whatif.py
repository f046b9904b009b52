"""What-if experiments for kiln serve's infer path (evidence for optimizations; kiln's sources are not changed).

Each variant runs ``kiln serve`` on the demo repository through a small launcher that may monkeypatch kiln in the
server process before ``kiln.cli.main`` starts, then measures ``mlp`` at one concurrency over HTTP JSON (wrk) and
gRPC (h2load), exactly as mlserver_compare.py does:

* ``demo``:    unchanged (mlp has ``dynamic_batching { }``: each request crosses to the batcher's worker thread
               through a ``threading.Condition`` and comes back through a ``concurrent.futures.Future``);
* ``nobatch``: ``dynamic_batching`` removed from mlp's config: the DirectScheduler (``run_in_executor``);
* ``inline``:  both schedulers' ``submit`` patched to run the model right on the event loop thread (no thread
               hop; fine for sub-millisecond models, it would block the loop for long ones);
* ``2proc``, ``2proc-inline``: two ``kiln serve`` processes sharing the gRPC port (``grpc.so_reuseport`` 1),
               gRPC only: what several frontend processes would give on this machine.

    .venv/bin/python benchmarks/whatif.py [--variants demo,nobatch,inline] [--duration 5] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

from _common import (
    GRPC_INFER_PATH,
    PROJECT_PYTHON,
    ServerProcess,
    build_demo_repo,
    check_outputs,
    command_line,
    ensure_tools,
    format_table,
    free_port,
    grpc_request,
    grpc_unary,
    header_lines,
    http_post,
    json_body,
    machine_info,
    mlp_case,
    parse_grpc_response,
    parse_json_response,
    project_env,
    run_h2load,
    run_wrk,
    wait_quiet,
    write_json,
)

_LAUNCHER = textwrap.dedent('''
    import sys, time
    variant = sys.argv[1]
    if "2proc" in variant:
        # Let a second server process listen on the same gRPC port (the kernel spreads connections over both).
        import grpc

        original = grpc.aio.server

        def server(*args, options=None, **kwargs):
            options = [o for o in (options or []) if o[0] != "grpc.so_reuseport"] + [("grpc.so_reuseport", 1)]
            return original(*args, options=options, **kwargs)

        grpc.aio.server = server
    if "inline" in variant:
        from kiln.batching import dynamic
        from kiln.server.scheduler import direct

        async def submit_direct(self, request, batch_size):
            return self._run(request, batch_size, time.monotonic_ns())

        async def submit_dynamic(self, request, batch_size):
            enqueued = time.monotonic_ns()
            responses, times = self.model.run_batch(self.model.engines[0], [request], [batch_size])
            self.model.stats.record_success(times, [enqueued], time.monotonic_ns())
            return responses[0]

        direct.DirectScheduler.submit = submit_direct
        dynamic.DynamicBatcher.submit = submit_dynamic
    from kiln.cli import main
    sys.exit(main(sys.argv[2:]))
''')

VARIANTS = ("demo", "nobatch", "inline", "2proc", "2proc-inline")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-wait-quiet", type=float, default=120.0)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    ensure_tools()
    info = machine_info()
    info["command"] = command_line()
    for line in header_lines("kiln serve what-if variants (mlp, one row per request)", info):
        print(line, flush=True)

    rows: list[list[Any]] = []
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kiln-whatif-") as tmp_name:
        tmp = Path(tmp_name)
        repo = tmp / "repo"
        build_demo_repo(repo)
        nobatch = tmp / "repo-nobatch"
        shutil.copytree(repo, nobatch)
        config = nobatch / "mlp" / "config.pbtxt"
        config.write_text(config.read_text().replace("dynamic_batching { }\n", ""))
        launcher = tmp / "launch.py"
        launcher.write_text(_LAUNCHER)
        inputs, expected = mlp_case(repo / "mlp" / "1" / "model.onnx")
        body, headers = json_body(inputs), {"Content-Type": "application/json"}
        message = grpc_request("mlp", inputs)
        for variant in [v.strip() for v in args.variants.split(",") if v.strip()]:
            if variant not in VARIANTS:
                parser.error(f"unknown variant {variant}")
            served = nobatch if variant == "nobatch" else repo
            count = 2 if variant.startswith("2proc") else 1
            gp = free_port()
            servers, http_ports = [], []
            for i in range(count):
                hp, mp = free_port(), free_port()
                cmd = [str(PROJECT_PYTHON), str(launcher), variant, "serve", "--model-repository", str(served),
                       "--http-port", str(hp), "--grpc-port", str(gp), "--metrics-port", str(mp)]
                servers.append(ServerProcess(f"{variant}-{i}", cmd, tmp / f"{variant}-{i}.log", env=project_env()))
                http_ports.append(hp)
            try:
                for server, hp in zip(servers, http_ports, strict=True):
                    server.wait_http_ready(hp)
                hp = http_ports[0]
                pgids = [s.proc.pid for s in servers]
                status, _h, resp = http_post(hp, "/v2/models/mlp/infer", body, headers)
                assert status == 200, resp
                check_outputs(parse_json_response(resp), expected, f"{variant} http")
                grpc_resp = grpc_unary(gp, GRPC_INFER_PATH, message)
                check_outputs(parse_grpc_response(grpc_resp), expected, f"{variant} grpc")
                url = f"http://127.0.0.1:{hp}/v2/models/mlp/infer"
                rest = None
                if count == 1:
                    wait_quiet(pgids, args.max_wait_quiet)
                    run_wrk(url, body, headers, args.concurrency, args.warmup)
                    rest = run_wrk(url, body, headers, args.concurrency, args.duration, server_pgid=pgids)
                wait_quiet(pgids, args.max_wait_quiet)
                grpc = run_h2load(f"http://127.0.0.1:{gp}", message, args.concurrency, args.duration, args.warmup,
                                  expected_response_bytes=len(grpc_resp), server_pgid=pgids)
            finally:
                for server in servers:
                    server.stop()
            for proto, r in (("HTTP JSON", rest), ("gRPC", grpc)):
                if r is None:
                    continue
                print(f"{variant:8s} {proto:9s} {r.rps:8,.0f} req/s  p50 {r.p50_ms:.2f} ms  errors {r.errors}  "
                      f"cpu server/loadgen/other {r.cpu_server or 0:.2f}/{r.cpu_loadgen or 0:.2f}/"
                      f"{r.cpu_other or 0:.2f}" + (f"  [{r.notes}]" if r.notes else ""), flush=True)
                rows.append([variant, proto, r.rps, r.p50_ms, r.p99_ms, r.errors, f"{r.cpu_server or 0:.2f}",
                             f"{r.cpu_other or 0:.2f}"])
            results[variant] = {"http_json": rest, "grpc": grpc}
    print()
    for line in format_table(["variant", "protocol", "req/s", "p50 ms", "p99 ms", "errors", "cpu server",
                              "cpu other"], rows):
        print(line)
    if args.output:
        write_json(args.output, {"machine": info, "args": {k: str(v) for k, v in vars(args).items()},
                                 "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
