"""Shared memory on a GPU server: requests/s of batch-1 ResNet-50 FP16 (PyTorch backend, CUDA graphs) over HTTP
and gRPC, with the input and output in the request body, in system shared memory, and in CUDA shared memory, next
to the direct engine (numpy in, and a torch CUDA tensor in).

Every client thread owns its tritonclient client and, for the shared-memory rows, its own input and output
regions (written once, registered once); each request names them. The threads are spread over
--client-processes processes, since one Python client process is slower than the server it measures.
`kiln serve --allow-client-shm` runs in a subprocess on the same host. The direct rows call `engine.infer()` from
the same number of threads.

    python benchmarks/shm_gpu.py [--repo REPO] [--io-dtype fp16] [--concurrency 16,64] [--tensors 'system shm']
        [--client-processes 8] [--serve-args '--grpc-workers 4'] --output benchmarks/results/shm_gpu-<date>.json

Without --repo the demo ResNet-50 is built here for the GPU (torch backend, FP16, CUDA graphs). The served rows
with the request body or system shared memory need no GPU of their own: --repo may hold any model named resnet50
with one input and one output (--no-direct, --tensors 'request body,system shm').
"""

from __future__ import annotations

import argparse
import base64
import functools
import multiprocessing
import queue
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from _common import Array, describe, header, str_list, table, write_outputs

import kiln
from kiln.build import BuildOptions, build
from kiln.config.parse import read_config
from kiln.demo.resnet import build_resnet50
from kiln.testing.serve import kiln_serve
from kiln.v2._generated import model_config_pb2 as pb

MODEL = "resnet50"
TENSORS = ("request body", "system shm", "cuda shm")
Record = Callable[[dict[str, Any]], None]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", default="16,64")
    parser.add_argument("--seconds", type=float, default=5.0, help="timed window per row")
    parser.add_argument("--dynamic-batching", action="store_true",
                        help="add dynamic_batching to a config without it (a GPU build already has it)")
    parser.add_argument("--repo", type=Path, default=None, help="a repository with resnet50 built (else built here)")
    parser.add_argument("--io-dtype", choices=["model", "fp16"], default="model",
                        help="build with FP16 inputs and outputs (301 KB requests) instead of FP32")
    parser.add_argument("--tensors", default=",".join(TENSORS), help="served rows to run (default: all)")
    parser.add_argument("--client-processes", type=int, default=4,
                        help="processes the served rows' client threads are spread over (default 4)")
    parser.add_argument("--protocols", default="http,grpc", help="served rows' protocols (default: both)")
    parser.add_argument("--no-direct", action="store_true", help="skip the direct engine rows")
    parser.add_argument("--serve-args", default="",
                        help="more `kiln serve` arguments for the served rows, e.g. '--grpc-workers 4'")
    parser.add_argument("--output", type=Path, default=None,
                        help="JSON results, rewritten after every row; a .txt beside it gets the table")
    args = parser.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    tensors = str_list(args.tensors)
    if unknown := set(tensors) - set(TENSORS):
        parser.error(f"--tensors: unknown {sorted(unknown)}; expected some of {', '.join(TENSORS)}")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kiln-bench-shm-") as tmp:
        repo = args.repo or _build(Path(tmp), args.io_dtype)
        config = repo / MODEL / "config.pbtxt"
        if args.dynamic_batching and "dynamic_batching" not in config.read_text():
            config.write_text(config.read_text() + "\ndynamic_batching { max_queue_delay_microseconds: 500 }\n")
        info = describe("Shared memory on a GPU server: ResNet-50 FP16, batch-1 requests",
                        config=_config_summary(config))

        def record(row: dict[str, Any]) -> None:
            """Keep each row as soon as it is measured: a later row that crashes the process loses only itself."""
            rows.append(row)
            print(row, flush=True)
            write_outputs(args.output, {**info, "rows": rows}, _text(info, rows))

        if not args.no_direct:
            _direct_rows(repo, levels, args.seconds, record)
        _served_rows(repo, levels, args.seconds, tensors, args.client_processes, args.serve_args.split(),
                     str_list(args.protocols), record)
    print(_text(info, rows))
    return 0


def _text(info: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    return header(info) + "\n" + table(["path", "tensors", "concurrency", "requests/s"],
                                       [[r["path"], r["tensors"], r["concurrency"], r["requests_per_s"]]
                                        for r in rows], numeric_from=2)


def _config_summary(path: Path) -> str:
    """What decides the served rows: instances, dynamic batching and its preferred sizes, the inputs' dtype."""
    config = read_config(path.parent)
    assert config is not None
    instances = sum(group.count or 1 for group in config.instance_group) or 1
    batching = (f"dynamic batching, preferred {list(config.dynamic_batching.preferred_batch_size) or '-'}, delay "
                f"{config.dynamic_batching.max_queue_delay_microseconds} us"
                if config.HasField("dynamic_batching") else "no dynamic batching")
    dtypes = sorted({pb.DataType.Name(tensor.data_type) for tensor in config.input})
    return f"{instances} instance(s), {batching}, inputs {', '.join(dtypes)}"


def _build(root: Path, io_dtype: str) -> Path:
    source = root / "resnet50.onnx"
    onnx.save(build_resnet50(0), str(source))
    repo = root / "repo"
    build(source, repo / MODEL, BuildOptions(backend="torch", device="cuda", precision="fp16", channels_last=True,
                                             max_batch_size=64, samples=16, io_dtype=io_dtype))
    return repo


Call = Callable[[], object]


def _nothing() -> None:
    pass


def _rate(concurrency: int, seconds: float, make: Callable[[int], tuple[Call, Call]],
          before_start: Callable[[], object] = _nothing) -> float:
    """Requests/s of ``concurrency`` threads each calling its own request function for ``seconds``. ``make`` gives
    a thread its request function and what undoes its set-up; both run in that thread (tritonclient.http's gevent
    client must stay in the thread that made it). ``before_start`` runs once every thread is ready (client
    processes wait there for each other)."""
    counts = [0] * concurrency
    stop = threading.Event()
    ready = threading.Barrier(concurrency + 1)
    failures: list[BaseException] = []

    def loop(i: int) -> None:
        undo: Call = _nothing
        try:
            call, undo = make(i)
            call()  # warm
        except BaseException as exc:
            failures.append(exc)
            ready.abort()
            undo()
            return
        try:
            ready.wait()
            while not stop.is_set():
                call()
                counts[i] += 1
        except BaseException as exc:
            failures.append(exc)
        finally:
            undo()

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(concurrency)]
    for thread in threads:
        thread.start()
    try:
        ready.wait()
    except threading.BrokenBarrierError:
        pass
    if not failures:
        before_start()
    started = time.perf_counter()
    time.sleep(seconds if not failures else 0)
    stop.set()
    for thread in threads:
        thread.join()
    if failures:
        raise failures[0]
    return sum(counts) / (time.perf_counter() - started)


def _served_rows(repo: Path, levels: list[int], seconds: float, tensors: list[str], processes: int,
                 serve_args: list[str], protocols: list[str], record: Record) -> None:
    import tritonclient.http as httpclient

    with kiln_serve([repo], "--allow-client-shm", "true", *serve_args, ready_timeout_s=300) as server:
        meta = httpclient.InferenceServerClient(server.http_url).get_model_metadata(MODEL)
        (inp,), (out,) = meta["inputs"], meta["outputs"]
        image = np.random.default_rng(0).standard_normal([1, *inp["shape"][1:]]).astype(np.float32)
        image = image.astype({"FP32": np.float32, "FP16": np.float16}[inp["datatype"]])
        out_bytes = int(np.prod(out["shape"][1:])) * 4
        for protocol, url in (("http", server.http_url), ("grpc", server.grpc_url)):
            if protocol not in protocols:
                continue
            for kind in tensors:
                for concurrency in levels:
                    work = ClientWork(protocol, url, kind, inp, out, image, out_bytes, seconds)
                    rate = served_rate(work, concurrency, processes)
                    path = f"kiln serve, {protocol}" + (f" ({' '.join(serve_args)})" if serve_args else "")
                    record({"path": path, "tensors": kind, "concurrency": concurrency,
                            "client_processes": min(processes, concurrency), "requests_per_s": rate})


@dataclass(frozen=True)
class ClientWork:
    """What each client process runs: its share of the threads, against one server, for one row."""

    protocol: str
    url: str
    tensors: str
    inp: dict[str, Any]
    out: dict[str, Any]
    image: Array
    out_bytes: int
    seconds: float


def served_rate(work: ClientWork, concurrency: int, processes: int) -> float:
    """Requests/s of ``concurrency`` client threads spread over up to ``processes`` processes (one Python
    client process cannot keep a GPU server busy: tritonclient's own work per request is the limit)."""
    shares = [concurrency // processes + (1 if i < concurrency % processes else 0) for i in range(processes)]
    shares = [share for share in shares if share]
    context = multiprocessing.get_context("spawn")  # no fork: the parent may hold a CUDA context
    start = context.Barrier(len(shares))
    results = context.Queue()
    children = [context.Process(target=_client_process, args=(work, share, start, results)) for share in shares]
    for child in children:
        child.start()
    answers: list[float | str] = []
    deadline = time.monotonic() + work.seconds + 300
    try:
        while len(answers) < len(children):
            try:
                answers.append(results.get(timeout=1.0))
            except queue.Empty:
                if time.monotonic() > deadline or not any(child.is_alive() for child in children):
                    codes = [child.exitcode for child in children]
                    raise RuntimeError(f"client processes ended without answering (exit codes {codes})") from None
    finally:
        for child in children:
            child.join(timeout=30)
            if child.is_alive():
                child.kill()
    failures = [a for a in answers if isinstance(a, str)]
    if failures:
        raise RuntimeError(f"a client process failed: {failures[0]}")
    return sum(a for a in answers if isinstance(a, float))


def _client_process(work: ClientWork, share: int, start: Any, results: Any) -> None:
    """One client process: ``share`` threads, its own CUDA regions (allocated here, in its main thread)."""
    try:
        import tritonclient.grpc as grpcclient
        import tritonclient.http as httpclient

        module = httpclient if work.protocol == "http" else grpcclient
        regions = [_CudaRegion(work.image.nbytes + work.out_bytes, work.image) for _ in range(share)] \
            if work.tensors == "cuda shm" else []
        try:
            make = functools.partial(_client_request, module, work.url, work.tensors, work.inp, work.out,
                                     work.image, work.out_bytes, regions)
            results.put(_rate(share, work.seconds, make, before_start=start.wait))
        finally:
            for region in regions:
                region.destroy()
    except BaseException as exc:  # reported to the parent, which raises it
        start.abort()
        results.put(f"{type(exc).__name__}: {exc}")


def _client_request(module: Any, url: str, tensors: str, inp: dict[str, Any], out: dict[str, Any],
                    image: Array, out_bytes: int, cuda_regions: list[_CudaRegion],
                    index: int) -> tuple[Call, Call]:
    """One client thread's request function, with its own client and regions, and what releases them."""
    client = module.InferenceServerClient(url)
    cleanup: list[Call] = []

    def undo() -> None:
        for step in cleanup:
            step()
        client.close()

    try:
        cuda_region = cuda_regions[index] if cuda_regions else None
        return _request(client, module, tensors, inp, out, image, out_bytes, cuda_region, cleanup), undo
    except BaseException:
        undo()
        raise


def _request(client: Any, module: Any, tensors: str, inp: dict[str, Any], out: dict[str, Any], image: Array,
             out_bytes: int, cuda_region: _CudaRegion | None, cleanup: list[Call]) -> Call:
    infer_input = module.InferInput(inp["name"], list(image.shape), inp["datatype"])
    requested = module.InferRequestedOutput(out["name"], **({"binary_data": True} if module.__name__.endswith(
        "http") else {}))
    name = f"b{uuid.uuid4().hex[:10]}"
    if tensors == "request body":
        infer_input.set_data_from_numpy(image)
    elif tensors == "system shm":
        import tritonclient.utils.shared_memory as shm

        handle = shm.create_shared_memory_region(name, f"/{name}", image.nbytes + out_bytes)
        shm.set_shared_memory_region(handle, [image])
        client.register_system_shared_memory(name, f"/{name}", image.nbytes + out_bytes)
        cleanup.append(lambda: client.unregister_system_shared_memory(name))
        cleanup.append(lambda: shm.destroy_shared_memory_region(handle))
    else:
        assert cuda_region is not None
        client.register_cuda_shared_memory(name, cuda_region.raw_handle, 0, image.nbytes + out_bytes)
        cleanup.append(lambda: client.unregister_cuda_shared_memory(name))
    if tensors != "request body":
        infer_input.set_shared_memory(name, image.nbytes)
        requested.set_shared_memory(name, out_bytes, offset=image.nbytes)
    return lambda: client.infer(MODEL, [infer_input], outputs=[requested])


class _CudaRegion:
    """Client device memory holding ``image``: tritonclient's CUDA utilities, or cupy where cuda-python is absent."""

    def __init__(self, byte_size: int, image: Array) -> None:
        try:
            import tritonclient.utils.cuda_shared_memory as cudashm
        except (ImportError, RuntimeError):
            import cupy

            self._keep: Any = cupy.zeros(byte_size, dtype=cupy.uint8)
            self._keep[:image.nbytes] = cupy.asarray(image.reshape(-1).view(np.uint8))
            self.raw_handle = base64.b64encode(cupy.cuda.runtime.ipcGetMemHandle(self._keep.data.ptr))
            self.destroy: Callable[[], None] = lambda: None
        else:
            self._keep = cudashm.create_shared_memory_region(uuid.uuid4().hex, byte_size, 0)
            cudashm.set_shared_memory_region(self._keep, [image])
            self.raw_handle = cudashm.get_raw_handle(self._keep)
            self.destroy = lambda: cudashm.destroy_shared_memory_region(self._keep)


def _direct_call(engine: Any, feed: dict[str, Any], index: int) -> tuple[Call, Call]:
    return functools.partial(engine.infer, feed), _nothing


def _direct_rows(repo: Path, levels: list[int], seconds: float, record: Record) -> None:
    import torch

    with kiln.load(repo / MODEL, kind="gpu") as engine:
        spec = engine.inputs[0]
        image = np.random.default_rng(0).standard_normal((1, *spec.dims)).astype(spec.datatype.numpy_dtype)
        feeds: dict[str, dict[str, Any]] = {"numpy": {spec.name: image},
                                            "torch CUDA tensor": {spec.name: torch.from_numpy(image).cuda()}}
        for tensors, feed in feeds.items():
            for concurrency in levels:
                rate = _rate(concurrency, seconds, functools.partial(_direct_call, engine, feed))
                record({"path": "direct engine.infer()", "tensors": tensors, "concurrency": concurrency,
                        "requests_per_s": rate})


if __name__ == "__main__":
    sys.exit(main())
