"""Where a build writes: a version folder in a Triton-layout model folder, and the config.pbtxt beside it."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import cast

from kiln._files import write_atomic
from kiln.config.model_dir import version_folders
from kiln.config.onnx_io import FileIO, FileTensor
from kiln.config.parse import CONFIG_FILENAME
from kiln.errors import AlreadyExistsError, InvalidArgumentError, UnsupportedError
from kiln.tensor import DataType
from kiln.v2._generated import model_config_pb2 as pb


def choose_version(model_dir: Path, version: int | None) -> int:
    existing = version_folders(model_dir) if model_dir.is_dir() else {}
    if version is None:
        return max(existing, default=0) + 1
    if version < 1:
        raise InvalidArgumentError(f"--version is {version}; expected a version number >= 1")
    if version in existing:
        raise AlreadyExistsError(f"{existing[version]} already exists; choose another --version or remove it")
    return version


# A GPU build gets two instances: while one batch's rows are staged, copied and answered on the host, the other's
# kernels keep the GPU busy. Preferred batch sizes of an eighth and a half of the largest batch split what is
# waiting into batches that overlap on the GPU instead of one batch taking everything while the GPU idles between
# batches (measured on an H200, ResNet-50 FP16: 16 callers as two batches of 8 gave 1.4x one batch of 16;
# docs/scheduling.md).
GPU_INSTANCES = 2


def make_config(name: str, backend: str, platform: str, file_io: FileIO, max_batch_size: int, *,
                gpu: bool, parameters: dict[str, str]) -> pb.ModelConfig:
    """A complete config: tensors from the model file (batch dimension left out when batching), dynamic batching
    when batches are allowed, one CPU instance or two GPU instances of the kind the engine was built for."""
    config = pb.ModelConfig(name=name, backend=backend, platform=platform, max_batch_size=max_batch_size)
    skip = 1 if max_batch_size > 0 else 0
    for tensor in file_io.inputs:
        config.input.add(name=tensor.name, data_type=cast("pb.DataType", tensor.datatype.config_number),
                         dims=tensor.dims[skip:])
    for tensor in file_io.outputs:
        config.output.add(name=tensor.name, data_type=cast("pb.DataType", tensor.datatype.config_number),
                          dims=tensor.dims[skip:])
    if max_batch_size > 1:
        config.dynamic_batching.SetInParent()
        if gpu and max_batch_size >= 16:  # below that, an eighth of a batch is a single row
            config.dynamic_batching.preferred_batch_size.extend(gpu_preferred_batch_sizes(max_batch_size))
    config.instance_group.add(kind=pb.ModelInstanceGroup.KIND_GPU if gpu else pb.ModelInstanceGroup.KIND_CPU,
                              count=GPU_INSTANCES if gpu else 1)
    for key, value in parameters.items():
        config.parameters[key].string_value = value
    return config


IO_DTYPES = {"model": None, "fp16": DataType.FP16, "bf16": DataType.BF16}


def check_io_dtype(io_dtype: str, precision: str, backend: str) -> None:
    """--io-dtype declares the model's FP32 tensors in the precision the torch engine computes in: it then casts
    inside its graph, and requests carry half the bytes."""
    if io_dtype not in IO_DTYPES:
        raise InvalidArgumentError(f"--io-dtype is '{io_dtype}'; expected one of {', '.join(IO_DTYPES)}")
    if io_dtype == "model":
        return
    if backend != "torch":
        raise UnsupportedError(f"--io-dtype {io_dtype} is available for the torch backend only, not '{backend}'; "
                               f"keep --io-dtype model (FP32 inputs and outputs)")
    if precision != io_dtype:
        raise InvalidArgumentError(f"--io-dtype {io_dtype} needs --precision {io_dtype} (the engine computes in "
                                   f"the type its inputs arrive in), not --precision {precision}")


def io_as(file_io: FileIO, io_dtype: str) -> FileIO:
    """``file_io`` with every FP32 input and output declared as ``io_dtype`` (unchanged for "model")."""
    datatype = IO_DTYPES[io_dtype]
    if datatype is None:
        return file_io

    def converted(tensors: tuple[FileTensor, ...]) -> tuple[FileTensor, ...]:
        return tuple(replace(t, datatype=datatype) if t.datatype is DataType.FP32 else t for t in tensors)

    return FileIO(inputs=converted(file_io.inputs), outputs=converted(file_io.outputs))


def gpu_preferred_batch_sizes(max_batch_size: int) -> list[int]:
    """An eighth and a half of the largest batch (whole numbers, at least 1, no duplicates)."""
    return sorted({max(1, max_batch_size // 8), max(1, max_batch_size // 2)})


def write_config_atomic(model_dir: Path, text: str) -> None:
    """A polling server never reads half a config: write beside it, then rename over."""
    model_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(model_dir / CONFIG_FILENAME, text.encode())


def config_mismatch(existing: pb.ModelConfig, generated: pb.ModelConfig) -> str:
    """What an existing config asks differently from what a build made ("" when it fits)."""
    problems = []
    for field in ("backend", "platform"):
        if getattr(existing, field) != getattr(generated, field):
            problems.append(f"{field} is '{getattr(existing, field)}', the build made '{getattr(generated, field)}'")
    have = {k: v.string_value for k, v in existing.parameters.items()}
    want = {k: v.string_value for k, v in generated.parameters.items()}
    if have != want:
        problems.append(f"parameters are {have or '{}'}, the build needs {want or '{}'}")
    kinds = {g.kind for g in existing.instance_group} or {pb.ModelInstanceGroup.KIND_AUTO}
    gpu = generated.instance_group[0].kind == pb.ModelInstanceGroup.KIND_GPU
    if gpu != (pb.ModelInstanceGroup.KIND_GPU in kinds):
        problems.append(f"its instances run on the {'CPU' if gpu else 'GPU'}, the build is for the "
                        f"{'GPU' if gpu else 'CPU'}")
    return "; ".join(problems)


def publish(staging_version: Path, model_dir: Path, version: int) -> Path:
    """Move a verified version folder into place (one rename: a polling server never sees half of it). The
    staging folder sits next to the model folder, so this is a rename within one filesystem."""
    target = model_dir / str(version)
    model_dir.mkdir(parents=True, exist_ok=True)
    try:
        target.mkdir()  # claims the number: a concurrent build that chose it too fails here, not by nesting
    except FileExistsError:
        raise AlreadyExistsError(f"{target} appeared while building; nothing was replaced") from None
    os.replace(staging_version, target)  # replaces the empty folder just made
    return target
