"""Framework ceilings on this machine: what the HTTP and gRPC stacks kiln is built on do with no model work.

Each variant is a tiny server in a subprocess (project venv) that answers the mlp request with a fixed, valid
response, driven by the same load generators and concurrency as the other benchmarks:

* ``asgi-raw``:        uvicorn (httptools, uvloop) + a bare ASGI callable that reads the body and answers;
* ``starlette``:       uvicorn + Starlette with one ``Route`` (kiln's HTTP stack, without kiln);
* ``starlette-json``:  as above, plus ``json.loads`` of the request and ``json.dumps`` of a 10-float answer;
* ``grpc-aio-bytes``:  ``grpc.aio`` generic handler, no protobuf (bytes in, fixed bytes out);
* ``grpc-aio-bytes-x2``: the same in two processes sharing the port (SO_REUSEPORT), the most any design with
  several gRPC processes could carry;
* ``grpc-aio-pb``:     ``grpc.aio`` with protobuf parse of ModelInferRequest and serialize of the response;
* ``grpc-sync-pb``:    the synchronous ``grpc.server`` (thread pool) doing the same;
* ``grpc-aio-pb-ort-asyncio``: the same on asyncio's default event loop instead of uvloop;
* ``*-ort``:           the minimal correct server: the above plus decoding the input, one onnxruntime
                       ``session.run`` (1 intra-op thread) on the event loop and encoding the real answer.

The gap between a ceiling and kiln's figure is kiln's own per-request cost; the ceiling itself is the price of
the framework. Usage: ``.venv/bin/python benchmarks/ceilings.py [--duration 5] [--concurrency 16]``.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import textwrap
from pathlib import Path

from _common import (
    PROJECT_PYTHON,
    ServerProcess,
    build_demo_repo,
    command_line,
    ensure_tools,
    format_table,
    free_port,
    grpc_request,
    header_lines,
    json_body,
    machine_info,
    mlp_case,
    project_env,
    run_h2load,
    run_wrk,
    running,
    wait_quiet,
    write_json,
)

_SERVER = textwrap.dedent('''
    import asyncio, json, sys
    variant, port, response_path, model_path = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    RESPONSE = open(response_path, "rb").read()
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
        elif variant == "grpc-aio-pb":
            async def infer(request, context):
                request.raw_input_contents[0]
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

HTTP_VARIANTS = ("asgi-raw", "starlette", "starlette-json", "starlette-json-ort")
GRPC_VARIANTS = ("grpc-aio-bytes", "grpc-aio-bytes-x2", "grpc-aio-pb", "grpc-aio-pb-ort", "grpc-aio-pb-ort-asyncio",
                 "grpc-sync-pb")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--variants", default=",".join(HTTP_VARIANTS + GRPC_VARIANTS))
    parser.add_argument("--max-wait-quiet", type=float, default=120.0)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    ensure_tools()
    info = machine_info()
    info["command"] = command_line()
    for line in header_lines("framework ceilings, mlp-sized request and response", info):
        print(line, flush=True)

    rows = []
    results = {}
    with tempfile.TemporaryDirectory(prefix="kiln-ceilings-") as tmp_name:
        tmp = Path(tmp_name)
        build_demo_repo(tmp / "repo")
        inputs, expected = mlp_case(tmp / "repo" / "mlp" / "1" / "model.onnx")
        script = tmp / "server.py"
        script.write_text(_SERVER)
        json_response = (b'{"model_name":"mlp","model_version":"1","outputs":[{"name":"OUTPUT0","datatype":"FP32",'
                         b'"shape":[1,10],"data":' + str(expected["OUTPUT0"].reshape(-1).tolist()).encode() + b"}]}")
        grpc_response = _grpc_response(expected["OUTPUT0"].tobytes())
        body = json_body(inputs)
        message = grpc_request("mlp", inputs)
        for variant in [v.strip() for v in args.variants.split(",") if v.strip()]:
            port = free_port()
            is_grpc = variant.startswith("grpc")
            response_file = tmp / f"{variant}.bin"
            response_file.write_bytes(grpc_response if is_grpc else json_response)
            cmd = [str(PROJECT_PYTHON), str(script), variant, str(port), str(response_file),
                   str(tmp / "repo" / "mlp" / "1" / "model.onnx")]
            copies = 2 if variant.endswith("-x2") else 1
            servers = [ServerProcess(variant, cmd, tmp / f"{variant}-{i}.log", env=project_env())
                       for i in range(copies)]
            server = servers[0]
            with contextlib.ExitStack() as stack:
                for each in servers:
                    stack.enter_context(running(each))
                    _wait_ready(each, port, announced=copies > 1)
                wait_quiet(server.proc.pid, args.max_wait_quiet)
                if is_grpc:
                    r = run_h2load(f"http://127.0.0.1:{port}", message, args.concurrency, args.duration, args.warmup,
                                   expected_response_bytes=len(grpc_response),
                                   server_pgid=[each.proc.pid for each in servers])
                else:
                    url = f"http://127.0.0.1:{port}/v2/models/mlp/infer"
                    headers = {"Content-Type": "application/json"}
                    run_wrk(url, body, headers, args.concurrency, args.warmup)
                    r = run_wrk(url, body, headers, args.concurrency, args.duration, server_pgid=server.proc.pid)
            print(f"{variant:16s} {r.rps:9,.0f} req/s  p50 {r.p50_ms:.2f} ms  errors {r.errors}  "
                  f"cpu server/loadgen/other {r.cpu_server or 0:.2f}/{r.cpu_loadgen or 0:.2f}/{r.cpu_other or 0:.2f}"
                  + (f"  [{r.notes}]" if r.notes else ""), flush=True)
            rows.append([variant, "wrk" if not is_grpc else "h2load", r.rps, r.p50_ms, r.p99_ms, r.errors,
                         f"{r.cpu_server or 0:.2f}", f"{r.cpu_loadgen or 0:.2f}", f"{r.cpu_other or 0:.2f}"])
            results[variant] = r
    print()
    for line in format_table(["variant", "load", "req/s", "p50 ms", "p99 ms", "errors", "cpu server", "cpu loadgen",
                              "cpu other"], rows):
        print(line)
    if args.output:
        write_json(args.output, {"machine": info, "args": {k: str(v) for k, v in vars(args).items()},
                                 "results": results})
    return 0


def _grpc_response(raw: bytes) -> bytes:
    from tritonclient.grpc import service_pb2 as pb

    resp = pb.ModelInferResponse(model_name="mlp", model_version="1")
    resp.outputs.add(name="OUTPUT0", datatype="FP32", shape=[1, 10])
    resp.raw_output_contents.append(raw)
    data: bytes = resp.SerializeToString()
    return data


def _wait_ready(server: ServerProcess, port: int, timeout: float = 60.0, announced: bool = False) -> None:
    """Until the port accepts a TCP connection and, with ``announced`` (several processes share the port), this
    process has printed READY."""
    import socket
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"{server.name} exited: {server.log_tail()}")
        if announced and "READY" not in server.log_tail():
            time.sleep(0.05)
            continue
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{server.name} not ready: {server.log_tail()}")


if __name__ == "__main__":
    sys.exit(main())
