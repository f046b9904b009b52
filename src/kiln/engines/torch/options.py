"""The PyTorch backend's config parameters (``parameters { key: ... value: { string_value: ... } }``), validated once.

Keys: ``precision`` (fp32 | fp16 | bf16), ``channels_last`` (true | false), ``cuda_graphs`` (true | false),
``cuda_graph_batch_sizes`` ("1,2,4,8" or "1-16,32": captured at load), ``cuda_streams`` (how many threads replay
the graphs at once, each on its own CUDA stream with its own graphs; default 8), ``cuda_shared_stream_from_batch``
(batches of this many rows or more replay their graph on one CUDA stream shared by the model's instances on a GPU,
in launch order; default 32, or off), ``compile_mode`` (none | default | reduce-overhead | max-autotune |
max-autotune-no-cudagraphs) and ``num_threads`` (CPU intra-op threads).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.config.spec import ModelSpec
from kiln.engines.base import EngineOptions
from kiln.errors import ConfigError

PRECISION = "precision"
CHANNELS_LAST = "channels_last"
CUDA_GRAPHS = "cuda_graphs"
CUDA_GRAPH_BATCH_SIZES = "cuda_graph_batch_sizes"
CUDA_STREAMS = "cuda_streams"
DEFAULT_CUDA_STREAMS = 8  # concurrent callers of one engine; each stream made costs one set of graph memory
CUDA_SHARED_STREAM_FROM_BATCH = "cuda_shared_stream_from_batch"
# A batch this large already fills the GPU with one graph (ResNet-50 FP16 on an H200: 13,300 images/s from one
# stream or two); run side by side, two such graphs each take twice as long and both finish late, so the instance
# that could have answered and staged its next batch meanwhile waits. Smaller batches gain from overlapping.
DEFAULT_SHARED_STREAM_FROM_BATCH = 32
COMPILE_MODE = "compile_mode"
NUM_THREADS = "num_threads"

PRECISIONS: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
COMPILE_MODES = ("none", "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# Inductor records CUDA graphs itself in these modes; a second, manual capture around them is refused.
GRAPH_CAPTURING_MODES = ("reduce-overhead", "max-autotune")
_BOOLEANS = {"true": True, "false": False}


@dataclass(frozen=True)
class TorchSettings:
    """What a model's parameters ask of the PyTorch engine; the defaults run the module as it was saved."""

    precision: str = "fp32"
    channels_last: bool = False
    cuda_graphs: bool = False
    cuda_graph_batch_sizes: tuple[int, ...] = ()
    cuda_streams: int = DEFAULT_CUDA_STREAMS
    cuda_shared_stream_from_batch: int | None = DEFAULT_SHARED_STREAM_FROM_BATCH  # None: every batch on its lane
    compile_mode: str = "none"
    num_threads: int | None = None

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """The floating dtype inputs and weights are cast to, or None to leave them as they are (fp32)."""
        return None if self.precision == "fp32" else PRECISIONS[self.precision]


def read_settings(spec: ModelSpec, options: EngineOptions) -> TorchSettings:
    """Parse and cross-check the parameters; raise ConfigError naming the model, key, value and what is accepted."""
    precision = _choice(spec, PRECISION, tuple(PRECISIONS), "fp32")
    compile_mode = _choice(spec, COMPILE_MODE, COMPILE_MODES, "none")
    settings = TorchSettings(
        precision=precision,
        channels_last=_boolean(spec, CHANNELS_LAST),
        cuda_graphs=_boolean(spec, CUDA_GRAPHS),
        cuda_graph_batch_sizes=_batch_sizes(spec),
        cuda_streams=_positive_int(spec, CUDA_STREAMS) or DEFAULT_CUDA_STREAMS,
        cuda_shared_stream_from_batch=_shared_stream_from(spec),
        compile_mode=compile_mode,
        num_threads=_positive_int(spec, NUM_THREADS),
    )
    _check_combinations(spec, settings, options)
    return settings


def _check_combinations(spec: ModelSpec, settings: TorchSettings, options: EngineOptions) -> None:
    name = spec.name
    on_cpu = options.kind != "gpu"
    if on_cpu and settings.precision == "fp16":
        raise ConfigError(f"model '{name}': parameter '{PRECISION}' is 'fp16', but this instance runs on the CPU, "
                          f"where fp16 kernels are missing or slow; use bf16 or fp32 on the CPU, or a KIND_GPU "
                          f"instance for fp16")
    if on_cpu and settings.cuda_graphs:
        raise ConfigError(f"model '{name}': parameter '{CUDA_GRAPHS}' is 'true', but this instance runs on the "
                          f"CPU; CUDA graphs need a KIND_GPU instance (set it to false for CPU instances)")
    if settings.cuda_graph_batch_sizes and not settings.cuda_graphs:
        raise ConfigError(f"model '{name}': parameter '{CUDA_GRAPH_BATCH_SIZES}' is set, but '{CUDA_GRAPHS}' is "
                          f"not 'true'; set {CUDA_GRAPHS}: true or remove {CUDA_GRAPH_BATCH_SIZES}")
    if _raw(spec, CUDA_STREAMS) is not None and not settings.cuda_graphs:
        raise ConfigError(f"model '{name}': parameter '{CUDA_STREAMS}' is set, but '{CUDA_GRAPHS}' is not 'true'; "
                          f"the streams replay CUDA graphs, so set {CUDA_GRAPHS}: true or remove {CUDA_STREAMS}")
    shared_from = _raw(spec, CUDA_SHARED_STREAM_FROM_BATCH)
    if shared_from is not None and not settings.cuda_graphs:
        raise ConfigError(f"model '{name}': parameter '{CUDA_SHARED_STREAM_FROM_BATCH}' is set, but '{CUDA_GRAPHS}' "
                          f"is not 'true'; the shared stream replays CUDA graphs, so set {CUDA_GRAPHS}: true or "
                          f"remove {CUDA_SHARED_STREAM_FROM_BATCH}")
    if shared_from is not None and not spec.batching:
        raise ConfigError(f"model '{name}': parameter '{CUDA_SHARED_STREAM_FROM_BATCH}' is '{shared_from}', but the "
                          f"model has no batch dimension (max_batch_size: 0), so its one graph always replays on its "
                          f"lane's stream; remove the parameter")
    if settings.cuda_graphs and settings.compile_mode in GRAPH_CAPTURING_MODES:
        raise ConfigError(f"model '{name}': parameter '{COMPILE_MODE}' is '{settings.compile_mode}', which records "
                          f"CUDA graphs itself, and '{CUDA_GRAPHS}' is 'true'; use one of the two (for example "
                          f"{COMPILE_MODE}: max-autotune-no-cudagraphs with {CUDA_GRAPHS}: true)")


def _raw(spec: ModelSpec, key: str) -> str | None:
    value = spec.parameters.get(key)
    return None if value is None or value.strip() == "" else value.strip()


def _choice(spec: ModelSpec, key: str, accepted: tuple[str, ...], default: str) -> str:
    value = _raw(spec, key)
    if value is None:
        return default
    if value.lower() not in accepted:
        raise ConfigError(f"model '{spec.name}': parameter '{key}' is '{value}'; expected one of: "
                          f"{', '.join(accepted)}")
    return value.lower()


def _boolean(spec: ModelSpec, key: str) -> bool:
    value = _raw(spec, key)
    if value is None:
        return False
    if value.lower() not in _BOOLEANS:
        raise ConfigError(f"model '{spec.name}': parameter '{key}' is '{value}'; expected true or false")
    return _BOOLEANS[value.lower()]


def _positive_int(spec: ModelSpec, key: str) -> int | None:
    value = _raw(spec, key)
    if value is None:
        return None
    if not (value.isascii() and value.isdigit()) or int(value) < 1:
        raise ConfigError(f"model '{spec.name}': parameter '{key}' is '{value}'; expected a whole number of "
                          f"1 or more")
    return int(value)


def _shared_stream_from(spec: ModelSpec) -> int | None:
    value = _raw(spec, CUDA_SHARED_STREAM_FROM_BATCH)
    if value is None:
        return DEFAULT_SHARED_STREAM_FROM_BATCH
    if value.lower() == "off":
        return None
    if not (value.isascii() and value.isdigit()) or int(value) < 1:
        raise ConfigError(f"model '{spec.name}': parameter '{CUDA_SHARED_STREAM_FROM_BATCH}' is '{value}'; expected "
                          f"a batch size of 1 or more, or off")
    return int(value)


def _batch_sizes(spec: ModelSpec) -> tuple[int, ...]:
    value = _raw(spec, CUDA_GRAPH_BATCH_SIZES)
    if value is None:
        return ()
    if not spec.batching:
        raise ConfigError(f"model '{spec.name}': parameter '{CUDA_GRAPH_BATCH_SIZES}' is '{value}', but the model "
                          f"has no batch dimension (max_batch_size: 0); its one CUDA graph is captured at load, so "
                          f"remove the parameter")
    sizes: list[int] = []
    for part in value.split(","):
        first, _, last = part.strip().partition("-")
        ends = [first.strip(), last.strip() or first.strip()]
        if not all(e.isascii() and e.isdigit() and 1 <= int(e) <= spec.max_batch_size for e in ends) \
                or int(ends[0]) > int(ends[1]):
            raise ConfigError(f"model '{spec.name}': parameter '{CUDA_GRAPH_BATCH_SIZES}' is '{value}'; expected "
                              f"comma-separated batch sizes or ranges from 1 to {spec.max_batch_size} "
                              f"(max_batch_size), e.g. \"1,2,4,8\" or \"1-16,32\"")
        sizes.extend(range(int(ends[0]), int(ends[1]) + 1))
    return tuple(sorted(set(sizes)))
