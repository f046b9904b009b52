"""Many models, many new connections at once: does every model's traffic get served?

`kiln serve` runs --models copies of the demo `simple` model with dynamic batching; one `kiln bench` process per
model opens --concurrency connections at the same moment and keeps that many requests outstanding. Once every
client has run for --settle seconds, the server's statistics are read twice, --seconds apart: the table gives each
model's requests/s in that common window, the p99 its client saw, and the slowest model's share of the fastest's.
With an event loop that accepts one connection per turn, the connections accepted first are served while the
others wait in the kernel's accept queue, and whole models starve (the shape `kiln bench compare` showed with four
models at c=256 on the H200).

    python benchmarks/connection_burst.py --output benchmarks/results/connection_burst-<date>.json

--server-src runs the server from another checkout's src/ (to measure a change against the code before it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _common import SRC, describe, header, pythonpath, table, write_outputs

from kiln.bench.served_counts import served_counts
from kiln.demo import build_demo_repository
from kiln.serve_process import kiln_serve


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=256, help="connections per model")
    parser.add_argument("--seconds", type=float, default=4.0, help="the common window the server's counts cover")
    parser.add_argument("--settle", type=float, default=3.0, help="seconds after the clients start, before it")
    parser.add_argument("--server-src", type=Path, default=SRC, help="the src/ folder the server runs from")
    parser.add_argument("--output", type=Path, default=None, help="JSON results (a .txt table goes beside it)")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="kiln-burst-") as tmp:
        demo, repo = Path(tmp) / "demo", Path(tmp) / "repo"
        build_demo_repository(demo)
        names = [f"simple_{i}" for i in range(args.models)]
        for name in names:
            shutil.copytree(demo / "simple" / "1", repo / name / "1")
            config = (demo / "simple" / "config.pbtxt").read_text().replace('name: "simple"', f'name: "{name}"')
            (repo / name / "config.pbtxt").write_text(config + "\ndynamic_batching { }\n")
        with contextlib.ExitStack() as stack:
            with pythonpath(args.server_src):
                server = stack.enter_context(kiln_serve([repo], log_path=Path(tmp) / "serve.log"))
            rows = _burst(server.http_url, names, args, Path(tmp))
    info = describe(f"A burst of connections: {args.models} models x {args.concurrency} connections",
                    server_src=str(args.server_src))
    rates = [row["requests_per_s"] for row in rows]
    spread = f"{min(rates) / max(rates):.2f}" if max(rates) > 0 else "- (no model's requests were counted)"
    text = (header(info) + "\n" + table(["model", "requests/s", "p99 ms"],
                                        [[r["model"], r["requests_per_s"], r["p99_ms"]] for r in rows])
            + f"\ntotal {sum(rates):,.0f} requests/s; slowest model / fastest: {spread}\n")
    print(text)
    write_outputs(args.output, {"info": info, "server_src": str(args.server_src), "rows": rows}, text)
    return 0


def _burst(url: str, names: list[str], args: argparse.Namespace, tmp: Path) -> list[dict[str, Any]]:
    """One `kiln bench` per model, all started together; each model's requests/s from the server's counts over one
    window common to all, and each client's p99."""
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    clients = []
    client_ms = int((args.settle + args.seconds + 3) * 1000)  # clients measure past the common window
    for name in names:
        command = [sys.executable, "-m", "kiln.cli", "bench", "-m", name, "-u", url, "--concurrency",
                   str(args.concurrency), "-p", str(client_ms), "-r", "1", "--quiet",
                   "--json", str(tmp / f"{name}.json")]
        clients.append(subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    time.sleep(args.settle)
    before, started = served_counts(url), time.monotonic()
    time.sleep(args.seconds)
    after, elapsed = served_counts(url), time.monotonic() - started
    rows = []
    for name, client in zip(names, clients, strict=True):
        _, err = client.communicate(timeout=180)
        if client.returncode != 0:
            raise RuntimeError(f"kiln bench for {name} failed: {err.decode()[-2000:]}")
        level = json.loads((tmp / f"{name}.json").read_text())["results"][0]
        rows.append({"model": name, "requests_per_s": (after[name] - before[name]) / elapsed,
                     "p99_ms": level["latency_ms"]["p99"], "client_requests_per_s": level["throughput_infer_per_s"]})
    return rows


if __name__ == "__main__":
    sys.exit(main())
