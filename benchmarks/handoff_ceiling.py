"""What the server process can answer for frontend worker processes, measured without HTTP, gRPC or clients.

The server process of `kiln serve --http-workers N` runs every worker's infer requests through one event loop, and
its per-request work is what bounds it once several workers feed it (benchmarks/README.md). This script runs that
server side as it runs there (a real ``kiln.Server`` with the device stand-in of scheduler_ceiling.py, and the HTTP
workers' link, ``CoreLink``, on a Unix socket pair per worker with both shared-memory arenas) and replaces the
workers' HTTP by coroutines that call the worker's ``CoreClient.infer`` in a loop, each in its own process. Both
sides run on uvloop where it is installed, as `kiln serve` and its workers do. Each row runs four times side by
side: requests sent one by one, joined the way workers join the requests of one event-loop turn (kiln.v2.joined,
docs/serving.md "HTTP workers"), joined with the requests held while a model has two calls in flight from the first
request out, and the same once the worker has ``HOLD_FROM`` requests out (the workers' default). It prints the
requests/s the server answered, the server process's CPU per request, and the batch the server formed.

    python benchmarks/handoff_ceiling.py --output benchmarks/results/handoff_ceiling-<machine>-<date>.json

Worker processes are this script run as ``--worker-child``, with the link and arenas passed as descriptors.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
from _common import describe, header, int_list, table, write_outputs
from scheduler_ceiling import BACKEND, DeviceStandIn

from kiln.engines import register_backend
from kiln.frontends.handoff.arena import ARENA_BYTES, Arena, create_arena_file, inherited_arena
from kiln.frontends.handoff.calls import DEFAULT_HOLD, HOLD_FROM
from kiln.frontends.http.core import CoreLink
from kiln.frontends.http.worker_app import CoreClient
from kiln.server import InferRequest, InputTensor, Server, ServerOptions
from kiln.tensor import DataType

MODEL = "resnet50"
CONFIG = """
name: "{model}" backend: "{backend}" max_batch_size: 64
input [ {{ name: "input" data_type: TYPE_FP16 dims: [ 3, 224, 224 ] }} ]
output [ {{ name: "output" data_type: TYPE_FP32 dims: [ 1000 ] }} ]
instance_group [ {{ kind: KIND_CPU count: {instances} }} ]
dynamic_batching {{ preferred_batch_size: [ 8, 32 ] }}
"""
T = TypeVar("T")
MODES = {"one by one": (False, 0, HOLD_FROM), "joined per turn": (True, 0, HOLD_FROM),
         "joined, held at once": (True, DEFAULT_HOLD, 1), "joined, held": (True, DEFAULT_HOLD, HOLD_FROM)}
"""(join, hold, hold_from) as kiln.frontends.handoff.calls.InferCalls takes them: the workers' default is the last;
"held at once" holds from the first request out, as workers did before ``HOLD_FROM``."""


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--worker-child"]:
        return _worker_child(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", default="1,2", help="worker processes, comma-separated: a row each")
    parser.add_argument("--concurrency", default="1,16,64", help="requests in flight over all workers")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--spread-turns", type=int, default=0,
                        help="each client yields 0..N event-loop turns (uniform) before each request: answers that "
                             "came back together lead to requests spread over turns, as requests from the network "
                             "reach a worker (0: the next request leaves in the answer's turn)")
    parser.add_argument("--instances", type=int, default=2)
    parser.add_argument("--base-ms", type=float, default=0.2, help="stand-in device time per batch")
    parser.add_argument("--per-row-us", type=float, default=0.0, help="stand-in device time per image")
    parser.add_argument("--rows-in-place", action="store_true",
                        help="the stand-in reads the rows from the workers' arena where they lie, as a GPU engine "
                             "does (no staging copy on the event loop)")
    parser.add_argument("--output", type=Path, default=None, help="JSON results; a .txt beside it gets the table")
    args = parser.parse_args(argv)
    DeviceStandIn.base_s, DeviceStandIn.per_row_s = args.base_ms / 1000, args.per_row_us / 1e6
    DeviceStandIn.in_place = args.rows_in_place
    register_backend(BACKEND, DeviceStandIn)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kiln-handoff-ceiling-") as tmp:
        repo = Path(tmp)
        (repo / MODEL / "1").mkdir(parents=True)
        (repo / MODEL / "config.pbtxt").write_text(CONFIG.format(model=MODEL, backend=BACKEND,
                                                                 instances=args.instances))
        server = Server(ServerOptions(repositories=[repo]))
        server.start()
        try:
            for workers in int_list(args.workers):
                for concurrency in int_list(args.concurrency):
                    if concurrency < workers:
                        continue
                    for mode, (join, hold, hold_from) in MODES.items():  # side by side: drift falls on each
                        row = _run(_measure(server, workers, concurrency, join, hold, hold_from, args.seconds,
                                            args.spread_turns))
                        rows.append({"workers": workers, "concurrency": concurrency, "mode": mode, **row})
                        print(rows[-1], file=sys.stderr, flush=True)
        finally:
            server.close()
    for row in rows:
        alone = next(r for r in rows if (r["workers"], r["concurrency"], r["mode"]) ==
                     (row["workers"], row["concurrency"], "one by one"))
        row["vs_one_by_one"] = row["requests_per_s"] / alone["requests_per_s"] if alone["requests_per_s"] else 0.0
    info = describe("kiln handoff ceiling: the server process's side of worker processes, against a device stand-in",
                    stand_in=f"{args.base_ms:g} ms per batch + {args.per_row_us:g} us per image, {args.instances} "
                             f"instances, FP16 3x224x224 images, preferred [8, 32], rows "
                             f"{'read in place' if args.rows_in_place else 'staged'}; {args.seconds:g} s per row; "
                             f"requests spread over 0-{args.spread_turns} turns")
    text = header(info) + "\n" + table(
        ["workers", "conc", "requests", "req/s", "vs one by one", "server cpu us/req", "loop cpu us/req",
         "avg batch"],
        [[r["workers"], r["concurrency"], r["mode"], r["requests_per_s"], f"{r['vs_one_by_one']:.2f}x",
          f"{r['server_cpu_us']:.0f}", f"{r['loop_cpu_us']:.0f}", f"{r['average_batch']:.1f}"] for r in rows],
        numeric_from=3)
    text += ("\nserver cpu us/req: the server process's CPU time (all its threads: the event loop, the stand-in's "
             "staging of rows, the batcher) per request answered; loop cpu us/req: the event loop's thread alone\n")
    print(text)
    write_outputs(args.output, {**info, "rows": rows, "settings": vars(args)}, text)
    return 0


async def _measure(server: Server, workers: int, concurrency: int, join: bool, hold: int, hold_from: int,
                   seconds: float, spread_turns: int) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    children: list[subprocess.Popen[bytes]] = []
    links: list[CoreLink] = []
    shares = [concurrency // workers + (1 if i < concurrency % workers else 0) for i in range(workers)]
    before = server.model_statistics(MODEL)[0]
    cpu_before, loop_cpu_before = time.process_time(), time.thread_time()
    started = time.perf_counter()
    for share in shares:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        fds = [create_arena_file(ARENA_BYTES), create_arena_file(ARENA_BYTES)]
        arenas = [None if fd is None else Arena.from_fd(fd) for fd in fds]
        link = CoreLink(server, None, arenas[0], arenas[1], lambda: None)  # type: ignore[arg-type]  # no app: infer only
        await loop.create_unix_connection(lambda link=link: link.protocol, sock=ours)  # type: ignore[misc]
        links.append(link)
        passed = [theirs.fileno(), *(fd for fd in fds if fd is not None)]
        command = [sys.executable, __file__, "--worker-child", str(theirs.fileno()),
                   *(str(-1 if fd is None else fd) for fd in fds), str(share), str(seconds), str(int(join)), str(hold),
                   str(hold_from), str(spread_turns)]
        children.append(subprocess.Popen(command, pass_fds=passed, stdout=subprocess.PIPE))
        theirs.close()
        for fd in fds:
            if fd is not None:
                os.close(fd)
    outputs = await asyncio.gather(*(loop.run_in_executor(None, child.communicate) for child in children))
    elapsed = time.perf_counter() - started
    loop_cpu = time.thread_time() - loop_cpu_before  # read inside the process's reading, so it never exceeds it
    cpu = time.process_time() - cpu_before
    after = server.model_statistics(MODEL)[0]
    for link in links:
        if link.protocol.transport is not None:
            link.protocol.transport.close()
    answered = sum(json.loads(out)["answered"] for out, _ in outputs)
    counted = after.success.count - before.success.count
    if counted != answered:
        raise RuntimeError(f"the server counted {counted} requests, the workers got {answered} answers")
    executions = after.execution_count - before.execution_count
    return {"requests_per_s": answered / seconds, "server_cpu_us": cpu / max(1, answered) * 1e6,
            "loop_cpu_us": loop_cpu / max(1, answered) * 1e6,
            "average_batch": (after.inference_count - before.inference_count) / max(1, executions),
            "wall_s": elapsed}


def _run(main: Coroutine[Any, Any, T]) -> T:
    """On uvloop where it is installed, as `kiln serve` and its workers run."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def _worker_child(argv: list[str]) -> int:
    link_fd, request_fd, response_fd, share, seconds, join, hold, hold_from, spread_turns = argv
    image = np.random.default_rng(0).standard_normal((1, 3, 224, 224)).astype(np.float16)

    async def run() -> int:
        core = CoreClient(inherited_arena(int(request_fd)), inherited_arena(int(response_fd)), join=join == "1",
                          hold=int(hold), hold_from=int(hold_from))
        await asyncio.get_running_loop().create_unix_connection(lambda: core.protocol,
                                                                sock=socket.socket(fileno=int(link_fd)))
        answered = 0
        stop = time.perf_counter() + float(seconds)

        async def client(index: int) -> None:
            nonlocal answered
            request = InferRequest(MODEL, [InputTensor("input", DataType.FP16, image.shape, image)])
            turns = np.random.default_rng(index).integers(0, int(spread_turns) + 1, size=1 << 16)
            sent = 0
            while time.perf_counter() < stop:
                for _ in range(turns[sent % len(turns)]):
                    await asyncio.sleep(0)
                sent += 1
                response, release = await core.infer(request, None)
                if response.outputs[0].shape != (1, 1000):
                    raise RuntimeError(f"unexpected answer shape {response.outputs[0].shape}")
                release()
                answered += 1

        await asyncio.gather(*(client(index) for index in range(int(share))))
        return answered

    answered = _run(run())
    print(json.dumps({"answered": answered}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
