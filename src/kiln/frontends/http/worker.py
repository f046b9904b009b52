"""One HTTP worker process: uvicorn on listening sockets the server process bound, serving worker_app.py.

Started by :mod:`kiln.frontends.http.workers` as ``python -m kiln.frontends.http.worker`` with the descriptors
it inherits: the link to the server process (one end of a socket pair), the listening sockets every worker shares,
the connection shares (shares.py) and the two arenas.
SIGTERM stops accepting and lets requests in flight finish for ``--grace`` seconds; losing the link ends the
process, since no request could be answered any more.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import sys
from pathlib import Path

from kiln.frontends.handoff import frames
from kiln.frontends.handoff.arena import inherited_arena
from kiln.frontends.handoff.calls import join_hold, joining_enabled
from kiln.frontends.http.infer_lane import InferLane, lane_enabled
from kiln.frontends.http.limits import HttpLimits
from kiln.frontends.http.server import HttpServer, http_config
from kiln.frontends.http.shares import ConnectionShares
from kiln.frontends.http.worker_app import CoreClient, WorkerApp
from kiln.heap import keep_freed_heap


async def run(args: argparse.Namespace) -> int:
    loop = asyncio.get_running_loop()
    core = CoreClient(inherited_arena(args.request_arena_fd), inherited_arena(args.response_arena_fd),
                      join=joining_enabled(), hold=join_hold())
    await loop.create_unix_connection(lambda: core.protocol, sock=socket.socket(fileno=args.link_fd))
    sockets = [socket.socket(fileno=int(fd)) for fd in args.listen_fds.split(",")]
    for sock in sockets:
        sock.setblocking(False)
    app = WorkerApp(core, args.max_input_size)
    config = http_config(app, "", 0, args.grace, certfile=args.certfile, keyfile=args.keyfile,
                         client_ca=args.client_ca, limits=HttpLimits.from_json(args.limits),
                         lane=InferLane.of_worker(app) if lane_enabled() else None)
    shares = None if args.shares_fd < 0 else ConnectionShares.inherited(args.shares_fd, args.shares_index)
    server = HttpServer(config, sockets, shares)
    loop.add_signal_handler(signal.SIGTERM, lambda: setattr(server, "should_exit", True))

    def lost(_: object) -> None:
        server.should_exit = server.force_exit = True

    core.protocol.closed.add_done_callback(lost)
    serving = asyncio.create_task(server.serve())
    while not server.started and not serving.done():
        await asyncio.sleep(0.01)
    if server.started:
        core.send(0, frames.HELLO)
    await serving
    return 1 if core.protocol.closed.done() else 0


def main() -> int:
    parser = argparse.ArgumentParser(description="kiln HTTP worker (started by kiln serve --http-workers)")
    parser.add_argument("--link-fd", type=int, required=True, help="the socket to the server process")
    parser.add_argument("--listen-fds", required=True, help="listening sockets, comma-separated")
    parser.add_argument("--shares-fd", type=int, default=-1, help="the workers' connection counts (shares.py)")
    parser.add_argument("--shares-index", type=int, default=0, help="this worker's slot in them")
    parser.add_argument("--request-arena-fd", type=int, default=-1)
    parser.add_argument("--response-arena-fd", type=int, default=-1)
    parser.add_argument("--max-input-size", type=int, required=True)
    parser.add_argument("--grace", type=float, default=30.0, help="seconds in-flight requests get after SIGTERM")
    parser.add_argument("--certfile", type=Path)
    parser.add_argument("--keyfile", type=Path)
    parser.add_argument("--client-ca", type=Path)
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--limits", default=HttpLimits().to_json(), help="connection limits and timeouts (JSON)")
    args = parser.parse_args()
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname).1s %(name)s] %(message)s",
                        datefmt="%H:%M:%S")
    # A Ctrl-C reaches the whole process group; the server process answers it by stopping the workers in order.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    keep_freed_heap()  # request bodies are freed every request: their pages stay (kiln/heap.py)
    try:
        import uvloop
    except ImportError:
        return asyncio.run(run(args))
    return uvloop.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
