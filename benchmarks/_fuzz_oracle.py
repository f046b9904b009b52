"""What a fuzz input may get back, and the findings that break it.

Every input must get a client-error answer (HTTP 4xx, gRPC INVALID_ARGUMENT / NOT_FOUND / ALREADY_EXISTS /
UNAUTHENTICATED / PERMISSION_DENIED) or a correct result. Never: a 5xx, gRPC INTERNAL / UNKNOWN, no answer in time
(a hang), a dead server or an exception out of the app (a crash), a request the protocol says must be refused
being served (``accepted-invalid``), a file outside the model version served for download, a shared-memory region
still mapped after everything was unregistered, or a well-formed request sent alongside getting another answer.
The one legitimate 501 / UNIMPLEMENTED is a feature this server was not started with (LEGIT_UNSUPPORTED).

KNOWN_FINDINGS lists classes already reported and not fixed yet (a name and a matcher each); the short test run
lets exactly those through. Remove an entry as its fix lands: the tests then hold the server to the whole oracle
for it.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable
from dataclasses import dataclass

from _fuzz_cases import GrpcCase, HttpCase
from google.protobuf.message import DecodeError

from kiln.v2._generated import grpc_service_pb2 as pb

LEGIT_UNSUPPORTED = re.compile(
    r"explicit model control is not enabled|polling needs --model-control-mode|CUDA shared memory is (disabled|not "
    r"supported)|doesn't support models with decoupled transaction policy|'repository_name' specification is not "
    r"supported|Method not found|trace settings are not supported|log settings are not supported")
GRPC_CLIENT_CODES = frozenset({"OK", "INVALID_ARGUMENT", "NOT_FOUND", "ALREADY_EXISTS", "UNAUTHENTICATED",
                               "PERMISSION_DENIED", "CANCELLED", "UNIMPLEMENTED"})
U64 = 2**64


@dataclass(frozen=True)
class Answer:
    """What came back: an HTTP status (None for none), or a gRPC code name; the body or details; and for a
    stream the error messages of its replies. ``failure`` says why there is no answer: 'hang' or 'crash: ...'."""

    status: int | None = None
    body: bytes = b""
    grpc_code: str | None = None
    stream_errors: tuple[str, ...] = ()
    failure: str | None = None

    def message(self) -> str:
        if self.grpc_code is not None:
            return self.body.decode("utf-8", "replace")
        try:
            doc = json.loads(self.body)
        except ValueError:
            return self.body[:200].decode("utf-8", "replace")
        return str(doc.get("error", "")) if isinstance(doc, dict) else ""


@dataclass(frozen=True)
class Finding:
    surface: str
    kind: str  # 5xx, internal, hang, crash, accepted-invalid, wrong-error, file-leak, shm-leak, checker
    detail: str
    known: str | None = None  # the KNOWN_FINDINGS class it belongs to
    shape: str = ""  # what makes it this class (status and message, parameter types); the detail when empty

    def signature(self) -> str:
        """One line per distinct class: digits and quoted values folded, so one bug counts once."""
        text = re.sub(r"'[^']*'", "'_'", self.shape or self.detail)
        return f"{self.surface}:{self.kind}:{re.sub(r'[0-9]+', 'N', text)[:160]}"


# -- what the protocol says must be refused --------------------------------------------------------------------


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def http_parameter_violations(doc: object) -> list[str]:
    """Request-level parameters of a JSON inference request that Triton refuses: priority and timeout are
    unsigned 64-bit integers, sequence_id one of those or a string, sequence_start / sequence_end booleans."""
    params = doc.get("parameters") if isinstance(doc, dict) else None
    if not isinstance(params, dict):
        return []
    found = []
    for key in ("priority", "timeout"):
        if key in params and not (_is_int(params[key]) and 0 <= params[key] < U64):
            found.append(f"{key}={params[key]!r}")
    if "sequence_id" in params:
        value = params["sequence_id"]
        if not (isinstance(value, str) or (_is_int(value) and 0 <= value < U64)):
            found.append(f"sequence_id={value!r}")
    for key in ("sequence_start", "sequence_end"):
        if key in params and not isinstance(params[key], bool):
            found.append(f"{key}={params[key]!r}")
    return found


def grpc_parameter_violations(request: pb.ModelInferRequest) -> list[str]:
    """priority and timeout must be integers and not negative (Triton reads int64_param or uint64_param)."""
    found = []
    for key in ("priority", "timeout"):
        if key in request.parameters:
            param = request.parameters[key]
            kind = param.WhichOneof("parameter_choice")
            if kind not in ("int64_param", "uint64_param") or (kind == "int64_param" and param.int64_param < 0):
                found.append(f"{key}={kind}:{getattr(param, kind) if kind else None}")
    return found


def _infer_json(case: HttpCase) -> object:
    """The JSON document of an uncompressed infer request (its header part for the binary extension)."""
    headers = dict(case.headers)
    if case.method != "POST" or not case.path.endswith("/infer") or "content-encoding" in headers:
        return None
    size = headers.get("inference-header-content-length")
    header = case.body[:int(size)] if size is not None and size.isdecimal() else case.body
    try:
        return json.loads(header)
    except ValueError:
        return None


# -- judging ---------------------------------------------------------------------------------------------------


def judge_http(case: HttpCase, answer: Answer, served_files: frozenset[bytes] = frozenset()) -> Finding | None:
    """The finding this answer is, or None when the oracle holds. ``served_files``: the contents a download may
    return (the version's files and config.pbtxt)."""
    finding = _judge_http(case, answer, served_files)
    return None if finding is None else _with_known(finding, case)


def _judge_http(case: HttpCase, answer: Answer, served_files: frozenset[bytes]) -> Finding | None:
    where = f"{case.method} {case.path[:120]}"
    if answer.failure is not None:
        kind = "hang" if answer.failure == "hang" else "crash"
        return Finding(case.surface, kind, f"{where}: {answer.failure}")
    status = answer.status or 0
    if status >= 500 and not (status == 501 and LEGIT_UNSUPPORTED.search(answer.message())):
        return Finding(case.surface, "5xx", f"{where}: {status} {answer.message()[:200]}",
                       shape=f"{status} {answer.message()[:100]}")
    if status == 200:
        violations = http_parameter_violations(_infer_json(case))
        if violations:
            return Finding(case.surface, "accepted-invalid", f"{where}: served with {', '.join(violations)}",
                           shape=_kinds(violations))
        if "/files/" in _without_dot_segments(case.path) and case.method == "GET" \
                and answer.body not in served_files and not _is_listing(answer.body):
            return Finding(case.surface, "file-leak", f"{where}: 200 with {len(answer.body)} bytes that are no "
                                                      f"file of the version")
    if case.surface == "http_oversize" and "/models/simple/" not in case.path and status != 404:
        return Finding(case.surface, "wrong-error", f"{where}: {status} '{answer.message()[:120]}' for an unknown "
                                                    f"model, expected 404", shape=f"{status} {answer.message()[:60]}")
    return None


def _kinds(violations: list[str]) -> str:
    """'priority=-5, timeout='x'' as 'priority=negative int, timeout=str': the class, not the values."""
    def kind(violation: str) -> str:
        key, _, value = violation.partition("=")
        if ":" in value and value.split(":", 1)[0].endswith("_param"):  # gRPC: kind:value
            param, number = value.split(":", 1)
            return f"{key}={param}" + ("<0" if number.startswith("-") else "")
        if re.fullmatch(r"-\d+", value):
            return f"{key}=negative int"
        if re.fullmatch(r"\d+", value):
            return f"{key}=int" + (" >= 2**64" if int(value) >= U64 else "")
        return f"{key}={type(eval_literal(value)).__name__}"
    return ", ".join(sorted(kind(v) for v in violations))


def eval_literal(text: str) -> object:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def _without_dot_segments(path: str) -> str:
    """The path the server sees from a client that folds '.' and '..' segments (httpx does): '/v2/kiln/models/../
    versions/../files/../..' asks for '/v2', which answers the server's metadata, no file."""
    kept: list[str] = []
    for segment in path.split("?", 1)[0].split("/"):
        if segment == "..":
            if len(kept) > 1:
                kept.pop()
        elif segment != ".":
            kept.append(segment)
    return "/".join(kept)


def _is_listing(body: bytes) -> bool:
    """A file listing: what a client that folds dot segments ('files/1/..' is 'files/') legitimately gets."""
    try:
        return isinstance(json.loads(body), list)
    except ValueError:
        return False


def judge_grpc(case: GrpcCase, answer: Answer) -> Finding | None:
    finding = _judge_grpc(case, answer)
    return None if finding is None else _with_known(finding, case)


def _judge_grpc(case: GrpcCase, answer: Answer) -> Finding | None:
    method = case.method.rsplit("/", 1)[-1]
    if answer.failure is not None:
        kind = "hang" if answer.failure == "hang" else "crash"
        return Finding(case.surface, kind, f"{method}: {answer.failure}")
    code = answer.grpc_code or "?"
    message = answer.message()
    if code not in GRPC_CLIENT_CODES or (code == "UNIMPLEMENTED" and not LEGIT_UNSUPPORTED.search(message)):
        return Finding(case.surface, "internal", f"{method}: {code} {message[:200]}", shape=f"{code} {message[:60]}")
    for error in answer.stream_errors:
        if error.startswith("internal error"):
            return Finding(case.surface, "internal", f"{method} stream reply: {error[:200]}")
    if method == "ModelInfer" and code == "OK":
        violations = grpc_parameter_violations(_parse(case.payloads[0]) or pb.ModelInferRequest())
        if violations:
            return Finding(case.surface, "accepted-invalid", f"{method}: served with {', '.join(violations)}",
                           shape=_kinds(violations))
    return None


def _parse(payload: bytes) -> pb.ModelInferRequest | None:
    request = pb.ModelInferRequest()
    try:
        request.ParseFromString(payload)
    except DecodeError:
        return None
    return request


# -- the classes already reported, not fixed yet; the short run lets these through ----------------------------------

Case = HttpCase | GrpcCase


KNOWN_FINDINGS: dict[str, Callable[[Finding, Case], bool]] = {
    # None open: every class found so far is fixed and held to the whole oracle.
}


def _with_known(finding: Finding, case: Case) -> Finding:
    for name, matches in KNOWN_FINDINGS.items():
        if matches(finding, case):
            return Finding(finding.surface, finding.kind, finding.detail, name)
    return finding
