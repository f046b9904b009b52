"""Backend and platform names kiln understands, with their default model file names (Triton's spellings)."""

from __future__ import annotations

from dataclasses import dataclass

from kiln.errors import ConfigError


@dataclass(frozen=True)
class BackendInfo:
    name: str
    platforms: tuple[str, ...]
    default_filename: str


BACKENDS: dict[str, BackendInfo] = {
    "onnxruntime": BackendInfo("onnxruntime", ("onnxruntime_onnx",), "model.onnx"),
    "pytorch": BackendInfo("pytorch", ("pytorch_libtorch", "libtorch", "torch_aoti"), "model.pt"),
    "tensorrt": BackendInfo("tensorrt", ("tensorrt_plan",), "model.plan"),
    "python": BackendInfo("python", (), "model.py"),
    # kiln's own: returns its inputs as outputs, needs no model file (tests, overhead benchmarks).
    "identity": BackendInfo("identity", (), ""),
    "ensemble": BackendInfo("ensemble", ("ensemble",), ""),
}

# torch.export / AOTInductor packages default to model.pt2 rather than model.pt.
PLATFORM_FILENAMES = {"torch_aoti": "model.pt2"}

# Which backend a file found in a version folder implies, when the config names none (Triton's order).
FILE_BACKENDS: tuple[tuple[str, str, str], ...] = (
    ("model.plan", "tensorrt", "tensorrt_plan"),
    ("model.onnx", "onnxruntime", "onnxruntime_onnx"),
    ("model.pt", "pytorch", "pytorch_libtorch"),
    ("model.pt2", "pytorch", "torch_aoti"),
    ("model.py", "python", ""),
)


def register_backend_name(name: str, default_filename: str = "") -> None:
    """Let configs name a backend that was registered at run time (see kiln.engines.register_backend)."""
    if name not in BACKENDS:
        BACKENDS[name] = BackendInfo(name, (), default_filename)


def backend_for_platform(platform: str) -> str | None:
    for info in BACKENDS.values():
        if platform in info.platforms:
            return info.name
    return None


def resolve_backend(backend: str, platform: str, source: str) -> tuple[str, str]:
    """Check ``backend``/``platform`` against each other and return both, filled in where one implies the other."""
    if platform and backend_for_platform(platform) is None:
        known = ", ".join(p for info in BACKENDS.values() for p in info.platforms)
        raise ConfigError(f"{source}: platform '{platform}' is not supported; expected one of: {known}")
    if backend and backend not in BACKENDS:
        known = ", ".join(BACKENDS)
        raise ConfigError(f"{source}: backend '{backend}' is not supported; expected one of: {known}")
    if platform:
        implied = backend_for_platform(platform)
        if backend and backend != implied:
            raise ConfigError(
                f"{source}: platform '{platform}' belongs to backend '{implied}', but backend is '{backend}'; "
                f"remove one of the two or make them agree"
            )
        return implied or backend, platform
    if backend:
        platforms = BACKENDS[backend].platforms
        return backend, platforms[0] if platforms else ""
    return "", ""


def default_filename(backend: str, platform: str) -> str:
    return PLATFORM_FILENAMES.get(platform, BACKENDS[backend].default_filename if backend in BACKENDS else "")
