"""Fuzz inputs for kiln's surfaces, drawn from a seeded ``random.Random``: the same seed gives the same inputs.

Each generator starts from a well-formed request for the fuzz repository (``simple``: INT32 [16] + [16], and
``strings``: a BYTES identity) and mutates it at the level its surface parses (JSON values, binary framing, protobuf
fields, pbtxt tokens), then sometimes at the byte level, so both the decoders' checks and the parsers under them
see inputs close to valid ones. The oracle (_fuzz_oracle.py) judges the answers; the drivers (_fuzz_drivers.py) send.
"""

from __future__ import annotations

import gzip
import io
import json
import random
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kiln.v2._generated import grpc_service_pb2 as pb

WIDTH = 16  # simple's tensors: [1, 16] INT32
MODELS = ("simple", "strings", "simple", "nope", "")
SHM_KEY = "/kiln_fuzz_{tag}"  # the fuzzer's own shared-memory object (created by the driver)
SHM_BYTES = 256

INTS = (0, 1, -1, 2, 15, 16, 17, 64, 255, 256, 2**31 - 1, 2**31, -(2**31), 2**32, 2**53 + 1, 2**63 - 1, 2**63,
        2**64 - 1, 2**64, 2**70, -(2**70))
INT64S = tuple(v for v in INTS if -(2**63) <= v < 2**63)
ODD: tuple[Any, ...] = (None, True, False, "", "x", "1", "-1", "\u00e9\u6f22", "\x00", "../..", [], [1], {},
                        {"a": 1}, 1.5, -0.0, 1e308, "A" * 300)
NAMES = ("INPUT0", "INPUT1", "OUTPUT0", "OUTPUT1", "", "input0", "INPUT0\x00", "INPUT2", "\u00e9", "x" * 500)
DATATYPES = ("INT32", "INT32", "BYTES", "FP32", "FP16", "BF16", "BOOL", "INT8", "UINT64", "int32", "", "TYPE_INT32",
             "FP128")
PARAM_KEYS = ("priority", "timeout", "sequence_id", "sequence_start", "sequence_end", "binary_data_output",
              "binary_data_size", "classification", "shared_memory_region", "shared_memory_offset",
              "shared_memory_byte_size", "headers", "x")
ENCODINGS = ("gzip", "deflate", "x-gzip", "identity", "GZIP", " gzip ", "gzip, deflate", "br", "compress", "zstd",
             "", "deflate;q=1")
HEADER_LENGTHS = ("-1", "abc", "", " 12", "+5", "1_0", "99999999999999999999999", "0x10", "\u0661\u0662")


@dataclass(frozen=True)
class HttpCase:
    """One HTTP request. ``steps`` (shm and edge surfaces) are requests sent after it on the same connection."""

    surface: str
    method: str
    path: str
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes = b""
    steps: tuple[HttpCase, ...] = ()


@dataclass(frozen=True)
class GrpcCase:
    """Raw request messages for one RPC: one for a unary call, several for ModelStreamInfer."""

    surface: str
    method: str
    payloads: tuple[bytes, ...]


@dataclass(frozen=True)
class ConfigCase:
    """A config.pbtxt text and a repository layout: ``files`` maps relative paths to contents (None: a folder,
    str starting with '->': a symlink to the rest)."""

    surface: str
    text: str
    files: dict[str, bytes | str | None] = field(default_factory=dict)


# -- byte-level mutation ----------------------------------------------------------------------------------------


def mutate_bytes(rng: random.Random, data: bytes, rounds: int = 0) -> bytes:
    """Flip, insert, delete, duplicate or truncate a few bytes (``rounds`` of them; 1-4 when 0)."""
    buf = bytearray(data)
    for _ in range(rounds or rng.randint(1, 4)):
        op = rng.randrange(6)
        at = rng.randrange(len(buf) + 1)
        if op == 0 and buf:
            buf[min(at, len(buf) - 1)] ^= 1 << rng.randrange(8)
        elif op == 1:
            buf[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        elif op == 2:
            del buf[at:at + rng.randint(1, 16)]
        elif op == 3 and buf:
            start = rng.randrange(len(buf))
            buf[at:at] = buf[start:start + rng.randint(1, 32)]
        elif op == 4:
            del buf[at:]
        else:
            buf[at:at] = rng.choice((b"\x00", b"\xff", b"{", b"}", b"[", b"]", b'"', b",", b":", b"\\", b"\x80",
                                     b"1e999", b"-", b"null", b"\xef\xbb\xbf"))
    return bytes(buf)


def odd_value(rng: random.Random) -> Any:
    return rng.choice(INTS) if rng.random() < 0.4 else rng.choice(ODD)


def _pick_model(rng: random.Random) -> str:
    model = rng.choice(MODELS)
    return model if rng.random() < 0.9 else rng.choice(("sim%70le", "a/b", "..", "\u00e9", "x" * 300, "simple "))


def infer_path(rng: random.Random, model: str) -> str:
    version = rng.choice(("", "", "", "1", "2", "0", "-1", "abc", "99999999999999999999", "1.0"))
    return f"/v2/models/{model}" + (f"/versions/{version}" if version else "") + "/infer"


# -- the well-formed starting points ----------------------------------------------------------------------------


def simple_doc(rng: random.Random) -> dict[str, Any]:
    """A correct JSON inference request for ``simple``."""
    a = [rng.randint(-1000, 1000) for _ in range(WIDTH)]
    b = [rng.randint(-1000, 1000) for _ in range(WIDTH)]
    doc: dict[str, Any] = {"inputs": [
        {"name": "INPUT0", "datatype": "INT32", "shape": [1, WIDTH], "data": a},
        {"name": "INPUT1", "datatype": "INT32", "shape": [1, WIDTH], "data": b}]}
    if rng.random() < 0.5:
        doc["outputs"] = [{"name": "OUTPUT0"}, {"name": "OUTPUT1"}]
    if rng.random() < 0.3:
        doc["id"] = "r" + str(rng.randrange(1000))
    return doc


def strings_doc(rng: random.Random) -> dict[str, Any]:
    items = [rng.choice(("a", "", "\u00e9", "x" * 40)) for _ in range(rng.randint(1, 4))]
    return {"inputs": [{"name": "INPUT0", "datatype": "BYTES", "shape": [1, len(items)], "data": items}]}


def _params(owner: dict[str, Any]) -> dict[str, Any]:
    """``owner``'s parameters object, replacing whatever an earlier mutation left there."""
    if not isinstance(owner.get("parameters"), dict):
        owner["parameters"] = {}
    params: dict[str, Any] = owner["parameters"]
    return params


def _mutate_doc(rng: random.Random, doc: dict[str, Any]) -> None:
    """One JSON-level change: a request parameter, an input field, an output, or the structure."""
    op = rng.randrange(8)
    inputs = doc.get("inputs") or [{}]
    tensor = rng.choice(inputs) if isinstance(inputs, list) and inputs else {}
    if not isinstance(tensor, dict):
        tensor = {}
    if op == 0:
        _params(doc)[rng.choice(PARAM_KEYS)] = odd_value(rng)
    elif op == 1:
        tensor[rng.choice(("name", "datatype", "shape", "data", "parameters"))] = odd_value(rng)
    elif op == 2:
        tensor["shape"] = [rng.choice(INTS) for _ in range(rng.randint(0, 4))]
    elif op == 3:
        tensor["datatype"], tensor["name"] = rng.choice(DATATYPES), rng.choice(NAMES)
    elif op == 4:
        data: list[Any] = tensor["data"] if isinstance(tensor.get("data"), list) else []
        k = rng.randint(0, len(data))
        tensor["data"] = data[:k] + [odd_value(rng) for _ in range(rng.randint(0, 3))] + data[k:]
    elif op == 5:
        _params(tensor)[rng.choice(PARAM_KEYS)] = odd_value(rng)
    elif op == 6:
        outputs = [{"name": rng.choice(NAMES), "parameters": {rng.choice(PARAM_KEYS): odd_value(rng)}}
                   for _ in range(rng.randint(0, 3))]
        doc["outputs"] = outputs if rng.random() < 0.9 else odd_value(rng)
    else:
        key = rng.choice(("inputs", "outputs", "id", "parameters"))
        if rng.random() < 0.5:
            doc.pop(key, None)
        else:
            doc[key] = odd_value(rng)


def _dumps(doc: Any) -> bytes:
    return json.dumps(doc, allow_nan=True).encode()


# -- HTTP surfaces ----------------------------------------------------------------------------------------------


def http_json(rng: random.Random) -> HttpCase:
    model = _pick_model(rng)
    doc = strings_doc(rng) if model == "strings" else simple_doc(rng)
    for _ in range(rng.randint(1, 3)):
        _mutate_doc(rng, doc)
    body = _dumps(doc)
    if rng.random() < 0.25:
        body = mutate_bytes(rng, body)
    headers = (("content-type", "application/json"),) if rng.random() < 0.5 else ()
    return HttpCase("http_json", "POST", infer_path(rng, model), headers, body)


def binary_body(rng: random.Random, doc: dict[str, Any]) -> tuple[bytes, int]:
    """``doc`` with its INT32 inputs moved to the binary tail (binary_data_size, sometimes lying)."""
    tail = b""
    inputs = doc.get("inputs")
    for tensor in inputs if isinstance(inputs, list) else []:
        if isinstance(tensor, dict) and isinstance(tensor.get("data"), list):
            try:
                raw = np.asarray(tensor.pop("data"), dtype=np.int32).tobytes()
            except (TypeError, ValueError, OverflowError):
                raw = b"\x01" * 64
            size = len(raw) if rng.random() < 0.7 else rng.choice(INTS)
            _params(tensor)["binary_data_size"] = size
            tail += raw if rng.random() < 0.8 else mutate_bytes(rng, raw)
    header = _dumps(doc)
    return header + tail, len(header)


def http_binary(rng: random.Random) -> HttpCase:
    model = _pick_model(rng)
    doc = simple_doc(rng)
    if rng.random() < 0.5:
        _mutate_doc(rng, doc)
    if rng.random() < 0.3:
        _params(doc)["binary_data_output"] = rng.choice((True, False, odd_value(rng)))
    body, header_size = binary_body(rng, doc)
    length = str(header_size)
    roll = rng.random()
    if roll < 0.3:
        length = str(max(0, header_size + rng.randint(-40, 40)))
    elif roll < 0.4:
        length = rng.choice(HEADER_LENGTHS)
    elif roll < 0.5:  # a raw request: the whole body is one input's bytes
        length, body = "0", rng.randbytes(rng.choice((0, 1, 63, 64, 128, 129)))
    if rng.random() < 0.2:
        body = mutate_bytes(rng, body)
    return HttpCase("http_binary", "POST", infer_path(rng, model), (("inference-header-content-length", length),),
                    body)


def compress(rng: random.Random, body: bytes) -> tuple[bytes, str]:
    kind = rng.randrange(4)
    if kind == 0:
        return gzip.compress(body, mtime=0), "gzip"
    if kind == 1:
        return zlib.compress(body), "deflate"
    if kind == 2:  # raw deflate without the zlib wrapper, which 'deflate' clients sometimes send
        packer = zlib.compressobj(wbits=-15)
        return packer.compress(body) + packer.flush(), "deflate"
    return body, "identity"


def http_encoding(rng: random.Random, limit: int) -> HttpCase:
    headers: dict[str, str] = {}
    if rng.random() < 0.2:  # a bomb: small compressed, larger than the limit inflated
        body, encoding = compress(rng, b"\x00" * (limit * rng.choice((1, 2, 8)) + rng.randint(-2, 2)))
    else:
        inner = http_json(rng) if rng.random() < 0.6 else http_binary(rng)
        body, encoding = compress(rng, inner.body)
        if rng.random() < 0.5:
            headers.update(inner.headers)
    if rng.random() < 0.3:
        encoding = rng.choice(ENCODINGS)
    if rng.random() < 0.3:
        body = mutate_bytes(rng, body)
    headers["content-encoding"] = encoding
    return HttpCase("http_encoding", "POST", infer_path(rng, rng.choice(MODELS[:2])), tuple(headers.items()), body)


def http_oversize(rng: random.Random, limit: int) -> HttpCase:
    """A body over the limit, to a served model or an unknown one."""
    model = rng.choice(("simple", "nope", "missing_model"))
    return HttpCase("http_oversize", "POST", f"/v2/models/{model}/infer", (), b"{" + b" " * (limit + rng.randint(1,
                    limit)) + b"}")


ROUTES = ("/v2", "/v2/health/live", "/v2/health/ready", "/v2/models/stats", "/v2/models/{m}", "/v2/models/{m}/ready",
          "/v2/models/{m}/config", "/v2/models/{m}/stats", "/v2/models/{m}/versions/{v}",
          "/v2/models/{m}/versions/{v}/config", "/v2/models/{m}/versions/{v}/stats", "/v2/models/{m}/infer",
          "/v2/repository/index", "/v2/repository/{m}/index", "/v2/repository/models/{m}/load",
          "/v2/repository/models/{m}/unload", "/v2/systemsharedmemory/status",
          "/v2/systemsharedmemory/region/{m}/status", "/v2/cudasharedmemory/status",
          "/v2/cudasharedmemory/region/{m}/register", "/v2/cudasharedmemory/region/{m}/unregister",
          "/v2/models/{m}/generate", "/v2/models/{m}/generate_stream", "/v2/repository/models/{m}/kiln/routing",
          "/metrics", "/", "/v2/models", "/v2/models/{m}/versions/{v}/infer")
SEGMENTS = ("simple", "strings", "1", "0", "-1", "%2e%2e", "..", "%00", "%ff", "\u00e9", "a%2Fb", "x" * 2000, " ",
            "%", "simple%20", "!$&'()*+,;=")
METHODS = ("GET", "POST", "GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS")
HEADER_NAMES = ("content-type", "accept", "authorization", "inference-header-content-length", "content-encoding",
                "kiln-routing-key", "x-request-id", "accept-encoding", "transfer-encoding", "expect", "cookie")


def http_paths(rng: random.Random) -> HttpCase:
    """Any route (or none) with odd path segments, methods, query strings, headers and small bodies. Routing
    updates (POST .../kiln/routing) are left out: a valid one legitimately changes what later requests get."""
    template = rng.choice(ROUTES)
    path = template.replace("{m}", rng.choice(SEGMENTS)).replace("{v}", rng.choice(SEGMENTS))
    method = rng.choice(METHODS)
    if path.endswith("/kiln/routing") and method == "POST":
        method = "GET"
    if rng.random() < 0.3:
        path += "?" + rng.choice(("a=1", "ready=%zz", "&&==", "x" * 500, "\u00e9=1", "ready=true"))
    if rng.random() < 0.1:
        path = path.replace("/", rng.choice(("//", "/./", "/%2F")), 1)
    headers = tuple((rng.choice(HEADER_NAMES), str(odd_value(rng))[:200]) for _ in range(rng.randint(0, 3)))
    headers = tuple((k, v) for k, v in headers if k not in ("transfer-encoding", "content-length"))
    body = rng.choice((b"", b"{}", b'{"ready": true}', b'{"parameters": {"config": "{}"}}', b"[", b"null",
                       _dumps({"parameters": {rng.choice(PARAM_KEYS): odd_value(rng)}}), rng.randbytes(16)))
    return HttpCase("http_paths", method, path, headers, body)


def shm_case(rng: random.Random, tag: str) -> HttpCase:
    """Register / use / status / unregister sequences over the fuzzer's shared-memory object and bad keys."""
    names = ("r0", "r1", "", "r0/x", "%2e%2e", "\u00e9", "x" * 300)
    keys = (SHM_KEY.format(tag=tag), SHM_KEY.format(tag=tag), "/kiln_fuzz_absent", "/", "", "..", "/a/b",
            "/dev/shm/x", "\x00", "/" + "k" * 300, SHM_KEY.format(tag=tag) + "\x00x")
    steps: list[HttpCase] = []
    for _ in range(rng.randint(1, 4)):
        name = rng.choice(names)
        op = rng.randrange(4)
        if op == 0:
            fields: dict[str, Any] = {"key": rng.choice(keys), "offset": rng.choice((0, 0, 8, 64, 255, 256, 257)),
                                      "byte_size": rng.choice((64, 128, 256, 1, 0))}
            if rng.random() < 0.4:
                fields[rng.choice(("key", "offset", "byte_size"))] = odd_value(rng)
            if rng.random() < 0.1:
                fields.pop(rng.choice(("key", "offset", "byte_size")))
            body = _dumps(fields) if rng.random() < 0.9 else mutate_bytes(rng, _dumps(fields))
            steps.append(HttpCase("shm", "POST", f"/v2/systemsharedmemory/region/{name}/register", (), body))
        elif op == 1:
            doc = simple_doc(rng)
            tensor = rng.choice(doc["inputs"])
            del tensor["data"]
            tensor["parameters"] = {"shared_memory_region": name, "shared_memory_byte_size":
                                    rng.choice((64, 64, 63, 65, 0, -1, 2**64)), "shared_memory_offset":
                                    rng.choice((0, 0, 64, 192, 256, -1, 2**63))}
            if rng.random() < 0.5:
                doc["outputs"] = [{"name": "OUTPUT0", "parameters": {
                    "shared_memory_region": name, "shared_memory_byte_size": rng.choice((64, 32, 256)),
                    "shared_memory_offset": rng.choice((0, 128, 200, 255))}}]
            other = doc["inputs"][1 - doc["inputs"].index(tensor)]
            other.setdefault("data", [0] * WIDTH)
            steps.append(HttpCase("shm", "POST", "/v2/models/simple/infer", (), _dumps(doc)))
        elif op == 2:
            path = f"/v2/systemsharedmemory/region/{name}/status" if name else "/v2/systemsharedmemory/status"
            steps.append(HttpCase("shm", "GET", path))
        else:
            path = f"/v2/systemsharedmemory/region/{name}/unregister" if name else "/v2/systemsharedmemory/unregister"
            steps.append(HttpCase("shm", "POST", path))
    return HttpCase("shm", steps[0].method, steps[0].path, steps[0].headers, steps[0].body, tuple(steps[1:]))


def npz_bytes(rng: random.Random) -> bytes:
    buffer = io.BytesIO()
    arrays: dict[str, Any] = {f"{part}/INPUT0": np.arange(rng.randint(0, 8), dtype=np.int32)
                              for part in ("input", "local", "cloud")}
    if rng.random() < 0.3:
        arrays[rng.choice(("x", "input/", "../a", "cloud/OUT"))] = np.zeros(2)
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def capture_case(rng: random.Random, limit: int) -> HttpCase:
    model = rng.choice(("simple", "simple", "strings", "nope", "..", "a%2Fb", "\u00e9"))
    version = rng.choice(("1", "1", "2", "0", "-1", "abc", "99999999999999999999", "\u0661"))
    body = npz_bytes(rng)
    roll = rng.random()
    if roll < 0.3:
        body = mutate_bytes(rng, body)
    elif roll < 0.4:
        body = rng.randbytes(rng.randint(0, 64))
    elif roll < 0.45:
        body = b"\x00" * (limit + 1)
    headers: dict[str, str] = {}
    if rng.random() < 0.9:
        headers["kiln-capture-id"] = rng.choice(("s1", "s2", "", "../x", "a/b", "x" * 400, "\u00e9", ".hidden",
                                                 str(rng.randrange(100))))
    for name in ("kiln-capture-reason", "kiln-capture-source", "kiln-edge-id"):
        if rng.random() < 0.4:
            headers[name] = rng.choice(("%ff%fe", "%", "low%20confidence", "x" * 500, "\u00e9", "%00"))
    path = f"/v2/kiln/models/{model}/versions/{version}/capture"
    return HttpCase("capture", "POST", path, tuple(headers.items()), body)


def files_case(rng: random.Random) -> HttpCase:
    model = rng.choice(("simple", "simple", "strings", "nope", "..", "%2e%2e", "simple%00"))
    version = rng.choice(("1", "1", "2", "0", "abc", "99999999999999999999", "\u0661", ".."))
    base = f"/v2/kiln/models/{model}/versions/{version}/files"
    if rng.random() < 0.3:
        return HttpCase("files", "GET", base)
    parts = [rng.choice(("config.pbtxt", "1", "model.onnx", "..", ".", "%2e%2e", "%2F", ".hidden", "2", "1/", "",
                         "%00", "etc", "passwd", "\u00e9", "~", "config.pbtxt%00.onnx", "/", "\\..\\"))
             for _ in range(rng.randint(1, 4))]
    return HttpCase("files", "GET", base + "/" + "/".join(parts))


def http_case(rng: random.Random, surface: str, limit: int, tag: str) -> HttpCase:
    if surface == "http_json":
        return http_json(rng)
    if surface == "http_binary":
        return http_binary(rng)
    if surface == "http_encoding":
        return http_encoding(rng, limit)
    if surface == "http_oversize":
        return http_oversize(rng, limit)
    if surface == "http_paths":
        return http_paths(rng)
    if surface == "shm":
        return shm_case(rng, tag)
    if surface == "capture":
        return capture_case(rng, limit)
    if surface == "files":
        return files_case(rng)
    raise ValueError(f"unknown HTTP surface '{surface}'")


# -- gRPC -------------------------------------------------------------------------------------------------------

GRPC_INFER = "/inference.GRPCInferenceService/ModelInfer"
GRPC_STREAM = "/inference.GRPCInferenceService/ModelStreamInfer"
GRPC_OTHER = ("ModelMetadata", "ModelConfig", "ModelReady", "ModelStatistics", "SystemSharedMemoryRegister",
              "SystemSharedMemoryStatus", "SystemSharedMemoryUnregister", "RepositoryModelLoad", "RepositoryIndex",
              "CudaSharedMemoryRegister", "ServerMetadata", "NoSuchMethod")


def simple_message(rng: random.Random) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="simple")
    for name in ("INPUT0", "INPUT1"):
        tensor = request.inputs.add(name=name, datatype="INT32", shape=[1, WIDTH])
        values = [rng.randint(-1000, 1000) for _ in range(WIDTH)]
        if rng.random() < 0.5:
            request.raw_input_contents.append(np.asarray(values, np.int32).tobytes())
        else:
            tensor.contents.int_contents.extend(values)
    if request.raw_input_contents and len(request.raw_input_contents) < 2:  # raw for all inputs or none
        first = request.inputs[0] if request.inputs[0].contents.int_contents else request.inputs[1]
        request.raw_input_contents.insert(0 if first is request.inputs[0] else 1,
                                          np.asarray(first.contents.int_contents, np.int32).tobytes())
        first.ClearField("contents")
    return request


def _set_param(rng: random.Random, params: Any, key: str) -> None:
    kind = rng.randrange(5)
    if kind == 0:
        params[key].int64_param = rng.choice((-5, -1, 0, 1, 2**63 - 1, -(2**63)))
    elif kind == 1:
        params[key].uint64_param = rng.choice((0, 1, 2**64 - 1))
    elif kind == 2:
        params[key].bool_param = rng.random() < 0.5
    elif kind == 3:
        params[key].string_param = rng.choice(("", "x", "-1", "\u00e9"))
    else:
        params[key].double_param = rng.choice((0.5, -1.0, float("nan"), float("inf")))


def _mutate_message(rng: random.Random, request: pb.ModelInferRequest) -> None:
    op = rng.randrange(9)
    tensor = rng.choice(request.inputs) if request.inputs else request.inputs.add()
    if op == 0:
        _set_param(rng, request.parameters, rng.choice(PARAM_KEYS))
    elif op == 1:
        _set_param(rng, tensor.parameters, rng.choice(PARAM_KEYS))
    elif op == 2:
        del tensor.shape[:]
        tensor.shape.extend(rng.choice(INT64S) if rng.random() < 0.8 else 1 for _ in range(rng.randint(0, 4)))
    elif op == 3:
        tensor.datatype, tensor.name = rng.choice(DATATYPES), rng.choice(NAMES)
    elif op == 4:  # raw contents that lie about their size, or raw and typed at once
        if request.raw_input_contents and rng.random() < 0.5:
            i = rng.randrange(len(request.raw_input_contents))
            request.raw_input_contents[i] = mutate_bytes(rng, request.raw_input_contents[i])
        else:
            request.raw_input_contents.append(rng.randbytes(rng.choice((0, 3, 63, 64, 65))))
    elif op == 5:
        tensor.contents.int_contents.extend(rng.randint(-5, 5) for _ in range(rng.randint(1, 3)))
        if rng.random() < 0.3:
            tensor.contents.bytes_contents.append(b"x")
            tensor.contents.fp32_contents.append(1.0)
    elif op == 6:
        output = request.outputs.add(name=rng.choice(NAMES))
        _set_param(rng, output.parameters, rng.choice(PARAM_KEYS))
    elif op == 7:
        request.model_name = rng.choice(("simple", "strings", "nope", "", "\u00e9", "x" * 300))
        request.model_version = rng.choice(("", "1", "0", "-1", "abc", "99999999999999999999"))
    else:
        del request.inputs[rng.randrange(len(request.inputs))]


def grpc_infer_payload(rng: random.Random) -> bytes:
    if rng.random() < 0.05:
        return rng.randbytes(rng.randint(0, 64))
    request = simple_message(rng)
    for _ in range(rng.randint(0, 3)):
        _mutate_message(rng, request)
    data = request.SerializeToString()
    return mutate_bytes(rng, data) if rng.random() < 0.25 else data


def grpc_case(rng: random.Random, surface: str, tag: str) -> GrpcCase:
    if surface == "grpc_infer":
        return GrpcCase(surface, GRPC_INFER, (grpc_infer_payload(rng),))
    if surface == "grpc_stream":
        return GrpcCase(surface, GRPC_STREAM, tuple(grpc_infer_payload(rng) for _ in range(rng.randint(1, 4))))
    method = rng.choice(GRPC_OTHER)
    return GrpcCase("grpc_other", f"/inference.GRPCInferenceService/{method}", (_other_message(rng, method, tag),))


def _other_message(rng: random.Random, method: str, tag: str) -> bytes:
    name = rng.choice(("simple", "nope", "", "r0", "\u00e9", "x" * 300))
    if method == "SystemSharedMemoryRegister":
        message: Any = pb.SystemSharedMemoryRegisterRequest(
            name=name, key=rng.choice((SHM_KEY.format(tag=tag), "/", "", "..", "/a/b", "/kiln_fuzz_absent")),
            offset=rng.choice((0, 8, 256, 2**64 - 1)), byte_size=rng.choice((0, 64, 256, 2**64 - 1)))
    elif method == "RepositoryModelLoad":
        message = pb.RepositoryModelLoadRequest(model_name=name)
        message.parameters["config"].string_param = rng.choice(("{}", "{", "null", '{"backend": 5}'))
    elif method in ("ModelMetadata", "ModelConfig", "ModelReady", "ModelStatistics"):
        message = pb.ModelMetadataRequest(name=name, version=rng.choice(("", "1", "-1", "abc")))
    else:
        message = pb.SystemSharedMemoryStatusRequest(name=name)
    data: bytes = message.SerializeToString()
    return mutate_bytes(rng, data) if rng.random() < 0.3 else data


# -- config.pbtxt and repository layouts ------------------------------------------------------------------------

CONFIGS = (
    'name: "m"\nbackend: "identity"\nmax_batch_size: 8\n'
    'input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]\n'
    'output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]\n',
    'backend: "identity"\ninput [ { name: "IN" data_type: TYPE_STRING dims: [ 1 ] reshape: { shape: [ ] } } ]\n'
    'output [ { name: "OUT" data_type: TYPE_STRING dims: [ 1 ] label_filename: "labels.txt" } ]\n'
    'version_policy: { specific: { versions: [ 1, 3 ] } }\n',
    'name: "m"\nbackend: "identity"\nmax_batch_size: 4\ndynamic_batching { preferred_batch_size: [ 2, 4 ] '
    'max_queue_delay_microseconds: 100 default_queue_policy { timeout_action: REJECT '
    'default_timeout_microseconds: 10 max_queue_size: 3 } priority_levels: 2 default_priority_level: 1 }\n'
    'instance_group [ { count: 2 kind: KIND_CPU } ]\n'
    'input [ { name: "A" data_type: TYPE_INT32 dims: [ 2, 2 ] } ]\noutput [ { name: "B" data_type: TYPE_INT32 '
    'dims: [ 2, 2 ] } ]\n',
    'name: "m"\nbackend: "identity"\nmax_batch_size: 2\nsequence_batching { max_sequence_idle_microseconds: 5000 '
    'control_input [ { name: "START" control [ { kind: CONTROL_SEQUENCE_START fp32_false_true: [ 0, 1 ] } ] } ] }\n'
    'input [ { name: "INPUT" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
    'output [ { name: "OUTPUT" data_type: TYPE_FP32 dims: [ 1 ] } ]\n',
    'name: "m"\nplatform: "ensemble"\nmax_batch_size: 1\ninput [ { name: "I" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
    'output [ { name: "O" data_type: TYPE_FP32 dims: [ 4 ] } ]\nensemble_scheduling { step [ { model_name: "a" '
    'model_version: -1 input_map { key: "x" value: "I" } output_map { key: "y" value: "O" } } ] }\n',
    'name: "m"\nbackend: "onnxruntime"\ndefault_model_filename: "model.onnx"\n'
    'parameters { key: "intra_op_thread_count" value: { string_value: "1" } }\n'
    'model_transaction_policy { decoupled: false }\nresponse_cache { enable: true }\n',
)
TOKENS = ("-1", "0", "99999999999999999999", "-9223372036854775809", "1.5", '"', '""', "{", "}", "[", "]", ":", ",",
          "TYPE_FP32", "TYPE_BOGUS", "KIND_GPU", "max_batch_size:", "dims: [ -2 ]", "name:", '"\\x00"', "#", "<", ">",
          "nan", "inf", "\u00e9", '"../x"', "input [ ]", "output { }", "0x7fffffff", "'")


def mutate_config(rng: random.Random, text: str) -> str:
    tokens = text.split(" ")
    for _ in range(rng.randint(1, 4)):
        at = rng.randrange(len(tokens))
        op = rng.randrange(4)
        if op == 0:
            tokens[at] = rng.choice(TOKENS)
        elif op == 1:
            tokens.insert(at, rng.choice(TOKENS))
        elif op == 2 and len(tokens) > 1:
            del tokens[at]
        else:
            tokens[at] = tokens[at].replace(rng.choice("0123456789-"), rng.choice(("", "9", "-", "99999999999")))
    out = " ".join(tokens)
    if rng.random() < 0.15:
        out = mutate_bytes(rng, out.encode()).decode("utf-8", "replace")
    return out


def config_case(rng: random.Random) -> ConfigCase:
    text = mutate_config(rng, rng.choice(CONFIGS)) if rng.random() < 0.9 else rng.choice(CONFIGS)
    if rng.random() < 0.8:  # text alone: the parser, thousands a second; layouts touch the file system
        return ConfigCase("config", text)
    files: dict[str, bytes | str | None] = {}
    for _ in range(rng.randint(0, 4)):
        name = rng.choice(("1", "2", "3", "01", "0", "-1", "99999999999999999999", "\u0661", "abc", ".1", "1.0"))
        kind = rng.randrange(4)
        if kind == 0:
            files[name] = None
        elif kind == 1:
            files.setdefault(name, None)
            files[f"{name}/{rng.choice(('model.onnx', 'model.pt', 'x'))}"] = rng.randbytes(rng.randint(0, 32))
        elif kind == 2:
            files[name] = rng.choice(("->1", "->..", "->/nonexistent", "->" + name))
        else:
            files[name] = b"a file where a folder is expected"
    if rng.random() < 0.3:
        files["config.pbtxt"] = rng.choice((None, "->config.pbtxt", b"\xff\xfe", "->/etc/hostname"))
    if rng.random() < 0.2:
        files["labels.txt"] = rng.choice((b"a\nb\n", None, b"\xff"))
    return ConfigCase("layout", text, files)
