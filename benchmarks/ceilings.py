"""Framework ceilings on this machine: what the HTTP and gRPC stacks kiln is built on do with no model work.

Each variant is a tiny server in a subprocess (project venv) that answers the mlp request with a fixed, valid
response, driven by the same load generators and concurrency as the other benchmarks:

* ``asgi-raw``:        uvicorn (httptools, uvloop) + a bare ASGI callable that reads the body and answers;
* ``httptools-raw``:   an asyncio protocol on uvloop feeding httptools' parser, joining the body and writing a
                       fixed response (no ASGI, no uvicorn): the floor of any HTTP path in Python on these pieces.
                       After each body chunk it stops reading for a loop turn, as uvicorn does above 64 KB until
                       the app reads; ``httptools-eager`` reads on at once;
* ``starlette``:       uvicorn + Starlette with one ``Route`` (kiln's HTTP stack, without kiln);
* ``starlette-json``:  as above, plus ``json.loads`` of the request and ``json.dumps`` of a 10-float answer;
* ``grpc-aio-bytes``:  ``grpc.aio`` generic handler, no protobuf (bytes in, fixed bytes out);
* ``grpc-aio-bytes-x2``: the same in two processes sharing the port (SO_REUSEPORT), the most any design with
  several gRPC processes could carry;
* ``grpc-aio-pb``:     ``grpc.aio`` with protobuf parse of ModelInferRequest and serialize of the response;
* ``starlette-await``, ``grpc-aio-pb-await``: the ``starlette`` and ``grpc-aio-pb`` servers whose handler waits one
                       loop turn for its answer, as a handler waiting for a batcher on the same loop does;
* ``grpc-sync-pb``:    the synchronous ``grpc.server`` (thread pool) doing the same;
* ``grpc-aio-pb-ort-asyncio``: the same on asyncio's default event loop instead of uvloop;
* ``*-ort``:           the minimal correct server: the above plus decoding the input, one onnxruntime
                       ``session.run`` (1 intra-op thread) on the event loop and encoding the real answer;
* ``granian-rsgi``:    granian (a Rust HTTP server, hyper and tokio; one worker process, uvloop) with an RSGI
                       callable that reads the body and answers: the same work as ``asgi-raw`` with the HTTP
                       protocol and the body's buffering in Rust (needs ``pip install granian``; not in the default
                       list);
* ``granian-starlette``: granian's ASGI interface serving the ``starlette`` variant's app: what swapping uvicorn
                       for granian under kiln's HTTP stack would give, against what an RSGI callable gives.

``--body image`` sends the request of an image model instead of mlp's 256 bytes: one 3x224x224 FP16 tensor with the
binary-data extension (301 KB), as the GPU benchmarks' ResNet-50 requests are (HTTP variants that do not decode the
body: ``asgi-raw``, ``httptools-*``, ``starlette``, ``granian-rsgi``, ``granian-starlette``). Receiving a body that
size costs some HTTP stacks far more than others, most of all at low concurrency.

gRPC calls each get an HTTP/2 connection of their own unless ``--grpc-connections`` says otherwise; ``1`` puts them
all on one, as perf_analyzer and tritonclient do (their concurrent calls share one channel).

The gap between a ceiling and kiln's figure is kiln's own per-request cost; the ceiling itself is the price of
the framework.

    python benchmarks/ceilings.py [--duration 5] [--concurrency 16] [--variants a,b,...] [--output results.json]
    python benchmarks/ceilings.py --body image --variants asgi-raw,granian-rsgi --concurrency 1
    python benchmarks/ceilings.py --variants grpc-aio-pb,grpc-sync-pb,starlette --concurrency 4 --grpc-connections 1
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from _common import describe, header, log_tail, mlp_case, spawned, str_list, table, write_outputs
from _loadgen import GRPC_CONNECTIONS_HELP, LoadResult, require_tools, run_h2load, run_wrk, tool_versions, wait_quiet

from kiln.demo import build_demo_repository
from kiln.serve_process import free_port
from kiln.v2._generated import grpc_service_pb2 as pb

_SERVER = textwrap.dedent('''
    import asyncio, json, sys
    variant, port, response_path, model_path = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    RESPONSE = open(response_path, "rb").read()

    async def next_turn():
        # What a handler waiting for its answer from elsewhere on the loop (kiln's batcher) goes through.
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        loop.call_soon(future.set_result, None)
        await future

    if "-ort" in variant:
        import numpy as np
        import onnxruntime as ort
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        SESSION = ort.InferenceSession(model_path, sess_options=options, providers=["CPUExecutionProvider"])

    if variant.startswith("grpc"):
        import grpc
        from tritonclient.grpc import service_pb2 as pb
        resp_msg = pb.ModelInferResponse.FromString(RESPONSE)
        if variant.startswith("grpc-aio-bytes"):
            async def infer(request, context):
                return RESPONSE
            handler = grpc.unary_unary_rpc_method_handler(infer)
        elif variant in ("grpc-aio-pb", "grpc-aio-pb-await"):
            async def infer(request, context):
                request.raw_input_contents[0]
                if variant.endswith("-await"):
                    await next_turn()
                return resp_msg
            handler = grpc.unary_unary_rpc_method_handler(
                infer, request_deserializer=pb.ModelInferRequest.FromString,
                response_serializer=pb.ModelInferResponse.SerializeToString)
        elif variant.startswith("grpc-aio-pb-ort"):
            async def infer(request, context):
                x = np.frombuffer(request.raw_input_contents[0], dtype=np.float32).reshape(request.inputs[0].shape)
                (y,) = SESSION.run(["OUTPUT0"], {"INPUT0": x})
                resp = pb.ModelInferResponse(model_name="mlp", model_version="1")
                resp.outputs.add(name="OUTPUT0", datatype="FP32", shape=y.shape)
                resp.raw_output_contents.append(y.tobytes())
                return resp
            handler = grpc.unary_unary_rpc_method_handler(
                infer, request_deserializer=pb.ModelInferRequest.FromString,
                response_serializer=pb.ModelInferResponse.SerializeToString)
        else:
            def infer(request, context):
                request.raw_input_contents[0]
                return resp_msg
            handler = grpc.unary_unary_rpc_method_handler(
                infer, request_deserializer=pb.ModelInferRequest.FromString,
                response_serializer=pb.ModelInferResponse.SerializeToString)
        generic = grpc.method_handlers_generic_handler("inference.GRPCInferenceService", {"ModelInfer": handler})
        if variant == "grpc-sync-pb":
            from concurrent.futures import ThreadPoolExecutor
            server = grpc.server(ThreadPoolExecutor(max_workers=16))
            server.add_generic_rpc_handlers((generic,))
            server.add_insecure_port(f"127.0.0.1:{port}")
            server.start()
            print("READY", flush=True)
            server.wait_for_termination()
        else:
            async def main():
                server = grpc.aio.server(options=[("grpc.so_reuseport", 1)])
                server.add_generic_rpc_handlers((generic,))
                server.add_insecure_port(f"127.0.0.1:{port}")
                await server.start()
                print("READY", flush=True)
                await server.wait_for_termination()
            if variant.endswith("-asyncio"):
                asyncio.run(main())
            else:
                import uvloop
                uvloop.run(main())
    elif variant.startswith("httptools-"):
        import httptools, uvloop
        HEAD = (b"HTTP/1.1 200 OK\\r\\ncontent-type: application/json\\r\\ncontent-length: "
                + str(len(RESPONSE)).encode() + b"\\r\\n\\r\\n")

        class Answering(asyncio.Protocol):
            def connection_made(self, transport):
                self.transport = transport
                self.parser = httptools.HttpRequestParser(self)
                self.chunks = []

            def data_received(self, data):
                self.parser.feed_data(data)

            def on_body(self, body):
                self.chunks.append(body)
                if variant == "httptools-raw":  # read on a loop turn later, as uvicorn and kiln's lane do
                    self.transport.pause_reading()
                    asyncio.get_running_loop().call_soon(self.transport.resume_reading)

            def on_message_complete(self):
                body, self.chunks = b"".join(self.chunks), []
                self.transport.writelines([HEAD, RESPONSE])

        async def main():
            server = await asyncio.get_running_loop().create_server(Answering, "127.0.0.1", port)
            async with server:
                await server.serve_forever()
        uvloop.run(main())
    else:
        import uvicorn
        if variant == "asgi-raw":
            async def app(scope, receive, send):
                if scope["type"] != "http":
                    return
                more = True
                while more:
                    message = await receive()
                    more = message.get("more_body", False)
                await send({"type": "http.response.start", "status": 200,
                            "headers": [(b"content-type", b"application/json")]})
                await send({"type": "http.response.body", "body": RESPONSE})
        else:
            from starlette.applications import Starlette
            from starlette.responses import Response
            from starlette.routing import Route
            parse = variant == "starlette-json"
            out = json.loads(RESPONSE) if parse else None
            async def infer(request):
                body = await request.body()
                if variant.endswith("-await"):
                    await next_turn()
                if variant == "starlette-json-ort":
                    doc = json.loads(body)
                    item = doc["inputs"][0]
                    x = np.asarray(item["data"], dtype=np.float32).reshape(item["shape"])
                    (y,) = SESSION.run(["OUTPUT0"], {"INPUT0": x})
                    answer = {"model_name": "mlp", "model_version": "1", "outputs": [
                        {"name": "OUTPUT0", "datatype": "FP32", "shape": list(y.shape), "data": y.ravel().tolist()}]}
                    return Response(json.dumps(answer).encode(), media_type="application/json")
                if parse:
                    json.loads(body)
                    return Response(json.dumps(out).encode(), media_type="application/json")
                return Response(RESPONSE, media_type="application/json")
            app = Starlette(routes=[Route("/v2/models/{model}/infer", infer, methods=["POST"])])
        uvicorn.run(app, host="127.0.0.1", port=port, loop="uvloop", http="httptools", log_level="warning",
                    access_log=False)
''')

# granian's worker process imports the RSGI callable (or the ASGI app) from this module (beside the server script).
_RSGI_MODULE = textwrap.dedent('''
    import os
    RESPONSE = open(os.environ["CEILINGS_RESPONSE"], "rb").read()
    HEADERS = [("content-type", "application/json")]

    async def app(scope, protocol):
        await protocol()
        protocol.response_bytes(200, HEADERS, RESPONSE)

    from starlette.applications import Starlette
    from starlette.responses import Response
    from starlette.routing import Route

    async def infer(request):
        await request.body()
        return Response(RESPONSE, media_type="application/json")

    starlette_app = Starlette(routes=[Route("/v2/models/{model}/infer", infer, methods=["POST"])])
''')

HTTP_VARIANTS = ("asgi-raw", "httptools-raw", "httptools-eager", "starlette", "starlette-await", "starlette-json",
                 "starlette-json-ort")
GRANIAN_VARIANTS = ("granian-rsgi", "granian-starlette")
# the variants that read the body without decoding it
RAW_BODY_VARIANTS = ("asgi-raw", "httptools-raw", "httptools-eager", "starlette", "granian-rsgi", "granian-starlette")
GRPC_VARIANTS = ("grpc-aio-bytes", "grpc-aio-bytes-x2", "grpc-aio-pb", "grpc-aio-pb-await", "grpc-aio-pb-ort",
                 "grpc-aio-pb-ort-asyncio", "grpc-sync-pb")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--variants", default=",".join(HTTP_VARIANTS + GRPC_VARIANTS),
                        help=f"comma-separated; also {', '.join(GRANIAN_VARIANTS)}")
    parser.add_argument("--body", choices=("mlp", "image"), default="mlp",
                        help="image: a 301 KB FP16 image tensor (only with " + ", ".join(RAW_BODY_VARIANTS) + ")")
    parser.add_argument("--grpc-connections", type=int, default=None,
                        help=GRPC_CONNECTIONS_HELP)
    parser.add_argument("--max-wait-quiet", type=float, default=120.0, help="0: don't wait for a quiet machine")
    parser.add_argument("--output", type=Path, default=None, help="JSON results (a .txt beside it gets the text)")
    args = parser.parse_args(argv)
    variants = str_list(args.variants)
    if unknown := set(variants) - set(HTTP_VARIANTS + GRPC_VARIANTS + GRANIAN_VARIANTS):
        parser.error(f"unknown variants {sorted(unknown)}")
    if args.body == "image" and (decoding := set(variants) - set(RAW_BODY_VARIANTS)):
        parser.error(f"--body image: variants {sorted(decoding)} decode mlp's request; use {RAW_BODY_VARIANTS}")
    if set(variants) & set(GRANIAN_VARIANTS) and importlib.util.find_spec("granian") is None:
        parser.error("granian variants need granian in this Python: pip install granian")
    require_tools(*(["wrk"] if set(variants) & set(HTTP_VARIANTS + GRANIAN_VARIANTS) else []),
                  *(["h2load"] if set(variants) & set(GRPC_VARIANTS) else []))
    what = "mlp-sized request" if args.body == "mlp" else "301 KB image request (FP16 3x224x224, binary data)"
    info = describe(f"framework ceilings, {what}, mlp-sized response", tools=tool_versions())
    print(header(info), flush=True)
    results: dict[str, LoadResult] = {}
    with tempfile.TemporaryDirectory(prefix="kiln-ceilings-") as tmp_name:
        tmp = Path(tmp_name)
        build_demo_repository(tmp / "repo")
        model = tmp / "repo" / "mlp" / "1" / "model.onnx"
        case = mlp_case(model)
        script = tmp / "server.py"
        script.write_text(_SERVER)
        (tmp / "rsgi_app.py").write_text(_RSGI_MODULE)
        http_request = case.json_body() if args.body == "mlp" else image_body()
        output = case.expected["OUTPUT0"]
        responses = {"http": (b'{"model_name":"mlp","model_version":"1","outputs":[{"name":"OUTPUT0","datatype":"FP32",'
                              b'"shape":[1,10],"data":' + str(output.reshape(-1).tolist()).encode() + b"}]}"),
                     "grpc": _grpc_response(output.tobytes())}
        for variant in variants:
            results[variant] = _measure(variant, tmp, script, model, http_request, case.grpc_message(),
                                        responses, args)
    rows = [[variant, r.tool, r.rps, r.p50_ms, r.p99_ms, r.errors, f"{r.cpu_server or 0:.2f}",
             f"{r.cpu_loadgen or 0:.2f}", f"{r.cpu_other or 0:.2f}"] for variant, r in results.items()]
    text = header(info) + "\n" + table(["variant", "load", "req/s", "p50 ms", "p99 ms", "errors", "cpu server",
                                         "cpu loadgen", "cpu other"], rows, numeric_from=2)
    print(text[len(header(info)):])
    write_outputs(args.output, {"machine": info, "args": vars(args), "results": results}, text)
    return 0


def _measure(variant: str, tmp: Path, script: Path, model: Path, http_request: tuple[bytes, dict[str, str]],
             grpc_request: bytes, responses: dict[str, bytes], args: argparse.Namespace) -> LoadResult:
    """Start the variant's server (two processes sharing the port for ``-x2``) and drive it for one window."""
    port = free_port()
    is_grpc = variant.startswith("grpc")
    response_file = tmp / f"{variant}.bin"
    response_file.write_bytes(responses["grpc" if is_grpc else "http"])
    cmd = [sys.executable, str(script), variant, str(port), str(response_file), str(model)]
    env = None
    if variant in GRANIAN_VARIANTS:
        asgi = variant == "granian-starlette"
        cmd = [sys.executable, "-m", "granian", "--interface", "asgi" if asgi else "rsgi", "--host", "127.0.0.1",
               "--port", str(port), "--workers", "1", "--loop", "uvloop", "--no-ws", "--log-level", "warning",
               "--working-dir", str(tmp), "rsgi_app:starlette_app" if asgi else "rsgi_app:app"]
        env = {**os.environ, "CEILINGS_RESPONSE": str(response_file)}
    copies = 2 if variant.endswith("-x2") else 1
    with contextlib.ExitStack() as stack:
        pids = []
        for i in range(copies):
            log = tmp / f"{variant}-{i}.log"
            process = stack.enter_context(spawned(cmd, log, env=env))
            _wait_ready(process, log, port, announced=copies > 1)
            pids.append(process.pid)
        wait_quiet(pids, args.max_wait_quiet)
        if is_grpc:
            result = run_h2load(f"http://127.0.0.1:{port}", grpc_request, args.concurrency, args.duration,
                                args.warmup, expected_response_bytes=len(responses["grpc"]), server_pids=pids,
                                connections=args.grpc_connections)
        else:
            url = f"http://127.0.0.1:{port}/v2/models/mlp/infer"
            body, headers = http_request
            result = run_wrk(url, body, headers, args.concurrency, args.duration, args.warmup, server_pids=pids)
    print(f"{variant:24s} {result.line()}", flush=True)
    return result


def image_body() -> tuple[bytes, dict[str, str]]:
    """An infer request of one FP16 3x224x224 image with the binary-data extension, and its headers."""
    image = np.zeros((1, 3, 224, 224), np.float16).tobytes()
    head = json.dumps({"inputs": [{"name": "input", "shape": [1, 3, 224, 224], "datatype": "FP16",
                                   "parameters": {"binary_data_size": len(image)}}]}).encode()
    return head + image, {"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(len(head))}


def _grpc_response(raw: bytes) -> bytes:
    response = pb.ModelInferResponse(model_name="mlp", model_version="1")
    response.outputs.add(name="OUTPUT0", datatype="FP32", shape=[1, 10])
    response.raw_output_contents.append(raw)
    return response.SerializeToString()


def _wait_ready(process: subprocess.Popen[bytes], log: Path, port: int, timeout: float = 60.0,
                announced: bool = False) -> None:
    """Until the port accepts a TCP connection and, with ``announced`` (several processes share the port), this
    process has printed READY."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args!r} exited: {log_tail(log)}")
        if announced and "READY" not in log_tail(log):
            time.sleep(0.05)
            continue
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{process.args!r} not ready: {log_tail(log)}")


if __name__ == "__main__":
    sys.exit(main())
