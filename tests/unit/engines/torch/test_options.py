"""Every config parameter of the PyTorch engine, and every way of getting one wrong."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
import torch

import kiln
from kiln.config import open_model_dir
from kiln.config.spec import ModelSpec
from kiln.engines import EngineOptions
from kiln.engines.torch.options import TorchSettings, read_settings
from kiln.errors import ConfigError, UnavailableError, UnsupportedError

from ._models import TWO_HEADS_IO, config, write_model_folder


def load_error(tmp_path: Path, source: Path, parameters: dict[str, str], error: type[Exception] = ConfigError,
               kind: str = "KIND_CPU", max_batch_size: int = 8) -> str:
    text = config("torch_aoti" if source.suffix == ".pt2" else "pytorch_libtorch", *TWO_HEADS_IO,
                  parameters=parameters, kind=kind, max_batch_size=max_batch_size)
    folder = write_model_folder(tmp_path, "m", text, source)
    with pytest.raises(error) as info:
        kiln.load(folder, kind="gpu" if kind == "KIND_GPU" else "cpu")
    return str(info.value)


def gpu_spec(tmp_path: Path, source: Path, parameters: dict[str, str], max_batch_size: int = 8) -> ModelSpec:
    """The spec of an exported program on a KIND_GPU instance with these parameters (nothing is loaded)."""
    text = config("torch_aoti", *TWO_HEADS_IO, kind="KIND_GPU", parameters=parameters, max_batch_size=max_batch_size)
    return open_model_dir(write_model_folder(tmp_path, "m", text, source)).spec


def fake_aoti_package(path: Path) -> Path:
    """The listing of an AOTInductor package (no kernels): enough for the checks made before anything loads."""
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("model/archive_format", b"pt2")
        archive.writestr("model/data/aotinductor/model/wrapper.so", b"")
    return path


@pytest.mark.parametrize(("parameters", "message"), [
    ({"precision": "fp8"}, "parameter 'precision' is 'fp8'; expected one of: fp32, fp16, bf16"),
    ({"precision": "fp16"}, "parameter 'precision' is 'fp16', but this instance runs on the CPU, where fp16 kernels "
                            "are missing or slow; use bf16 or fp32 on the CPU, or a KIND_GPU instance for fp16"),
    ({"channels_last": "yes"}, "parameter 'channels_last' is 'yes'; expected true or false"),
    ({"cuda_graphs": "on"}, "parameter 'cuda_graphs' is 'on'; expected true or false"),
    ({"cuda_graphs": "true"}, "parameter 'cuda_graphs' is 'true', but this instance runs on the CPU; CUDA graphs "
                              "need a KIND_GPU instance (set it to false for CPU instances)"),
    ({"cuda_graph_batch_sizes": "1,2"}, "parameter 'cuda_graph_batch_sizes' is set, but 'cuda_graphs' is not "
                                        "'true'; set cuda_graphs: true or remove cuda_graph_batch_sizes"),
    ({"cuda_graphs": "true", "cuda_graph_batch_sizes": "1,x"},
     "parameter 'cuda_graph_batch_sizes' is '1,x'; expected comma-separated batch sizes or ranges from 1 to 8 "
     "(max_batch_size), e.g. \"1,2,4,8\" or \"1-16,32\""),
    ({"cuda_graphs": "true", "cuda_graph_batch_sizes": "4,16"},
     "parameter 'cuda_graph_batch_sizes' is '4,16'; expected comma-separated batch sizes or ranges from 1 to 8 "
     "(max_batch_size), e.g. \"1,2,4,8\" or \"1-16,32\""),
    ({"cuda_graphs": "true", "cuda_graph_batch_sizes": "4-2"},
     "parameter 'cuda_graph_batch_sizes' is '4-2'; expected comma-separated batch sizes or ranges from 1 to 8 "
     "(max_batch_size), e.g. \"1,2,4,8\" or \"1-16,32\""),
    ({"cuda_streams": "4"}, "parameter 'cuda_streams' is set, but 'cuda_graphs' is not 'true'; the streams replay "
                            "CUDA graphs, so set cuda_graphs: true or remove cuda_streams"),
    ({"cuda_streams": "0"}, "parameter 'cuda_streams' is '0'; expected a whole number of 1 or more"),
    ({"cuda_shared_stream_from_batch": "16"},
     "parameter 'cuda_shared_stream_from_batch' is set, but 'cuda_graphs' is not 'true'; the shared stream replays "
     "CUDA graphs, so set cuda_graphs: true or remove cuda_shared_stream_from_batch"),
    ({"cuda_shared_stream_from_batch": "0"},
     "parameter 'cuda_shared_stream_from_batch' is '0'; expected a batch size of 1 or more, or off"),
    ({"cuda_shared_stream_from_batch": "never"},
     "parameter 'cuda_shared_stream_from_batch' is 'never'; expected a batch size of 1 or more, or off"),
    ({"compile_mode": "fast"}, "parameter 'compile_mode' is 'fast'; expected one of: none, default, reduce-overhead, "
                               "max-autotune, max-autotune-no-cudagraphs"),
    ({"compile_mode": "default"}, "parameter 'compile_mode' is 'default', but torch.compile cannot compile "
                                  "TorchScript; export the model with torch.export.save (model.pt2, platform "
                                  "torch_aoti), or set compile_mode: none"),
    ({"num_threads": "0"}, "parameter 'num_threads' is '0'; expected a whole number of 1 or more"),
    ({"num_threads": "two"}, "parameter 'num_threads' is 'two'; expected a whole number of 1 or more"),
])
def test_parameter_errors(tmp_path: Path, files: dict[str, Path], parameters: dict[str, str], message: str) -> None:
    assert load_error(tmp_path, files["script"], parameters) == f"model 'm': {message}"


def test_batch_sizes_need_a_batch_dimension(tmp_path: Path, files: dict[str, Path]) -> None:
    parameters = {"cuda_graphs": "true", "cuda_graph_batch_sizes": "1"}
    assert load_error(tmp_path, files["script"], parameters, max_batch_size=0) == (
        "model 'm': parameter 'cuda_graph_batch_sizes' is '1', but the model has no batch dimension "
        "(max_batch_size: 0); its one CUDA graph is captured at load, so remove the parameter")


def test_the_shared_stream_needs_a_batch_dimension(tmp_path: Path, files: dict[str, Path]) -> None:
    spec = gpu_spec(tmp_path, files["export"], {"cuda_graphs": "true", "cuda_shared_stream_from_batch": "8"},
                    max_batch_size=0)
    with pytest.raises(ConfigError) as info:
        read_settings(spec, EngineOptions(kind="gpu"))
    assert str(info.value) == (
        "model 'm': parameter 'cuda_shared_stream_from_batch' is '8', but the model has no batch dimension "
        "(max_batch_size: 0), so its one graph always replays on its lane's stream; remove the parameter")


@pytest.mark.parametrize(("value", "expected"), [(None, 32), ("8", 8), (" OFF ", None)])
def test_shared_stream_from_batch_defaults_to_32(tmp_path: Path, files: dict[str, Path], value: str | None,
                                                 expected: int | None) -> None:
    parameters = {"cuda_graphs": "true"} | ({} if value is None else {"cuda_shared_stream_from_batch": value})
    spec = gpu_spec(tmp_path, files["export"], parameters)
    assert read_settings(spec, EngineOptions(kind="gpu")).cuda_shared_stream_from_batch == expected


def test_cuda_graphs_conflict_with_compile_modes_that_record_graphs(tmp_path: Path, files: dict[str, Path]) -> None:
    spec = gpu_spec(tmp_path, files["export"], {"cuda_graphs": "true", "compile_mode": "reduce-overhead"})
    with pytest.raises(ConfigError) as info:
        read_settings(spec, EngineOptions(kind="gpu"))
    assert str(info.value) == (
        "model 'm': parameter 'compile_mode' is 'reduce-overhead', which records CUDA graphs itself, and "
        "'cuda_graphs' is 'true'; use one of the two (for example compile_mode: max-autotune-no-cudagraphs with "
        "cuda_graphs: true)")


def test_settings_parse_every_parameter(tmp_path: Path, files: dict[str, Path]) -> None:
    parameters = {"precision": " FP16 ", "channels_last": "True", "cuda_graphs": "true",
                  "cuda_graph_batch_sizes": "8, 2,2 ,1, 4-5", "cuda_streams": "3",
                  "cuda_shared_stream_from_batch": "6", "compile_mode": "max-autotune-no-cudagraphs",
                  "num_threads": "3"}
    spec = gpu_spec(tmp_path, files["export"], parameters)
    assert read_settings(spec, EngineOptions(kind="gpu")) == TorchSettings(
        precision="fp16", channels_last=True, cuda_graphs=True, cuda_graph_batch_sizes=(1, 2, 4, 5, 8),
        cuda_streams=3, cuda_shared_stream_from_batch=6, compile_mode="max-autotune-no-cudagraphs", num_threads=3)
    assert read_settings(spec, EngineOptions(kind="gpu")).compute_dtype == torch.float16
    assert TorchSettings().compute_dtype is None  # fp32 leaves the module and its inputs as they are


@pytest.mark.parametrize(("parameters", "message"), [
    ({"compile_mode": "default"}, "parameter 'compile_mode' is 'default', but the model is an AOTInductor package, "
                                  "compiled ahead of time already; set compile_mode: none"),
    ({"channels_last": "true"}, "parameter 'channels_last' is 'true', but an AOTInductor package's memory layouts "
                                "are fixed when it is compiled; compile it from a channels_last module and inputs "
                                "instead, and set channels_last: false"),
])
def test_options_an_aoti_package_cannot_take(tmp_path: Path, parameters: dict[str, str], message: str) -> None:
    package = fake_aoti_package(tmp_path / "model.pt2")
    assert load_error(tmp_path / "repo", package, parameters) == f"model 'm': {message}"


@pytest.mark.parametrize(("extra_config", "message"), [
    ("", "input 'x' has variable dims [-1], but 'cuda_graphs' is 'true'; a CUDA graph has fixed shapes, so every "
         "dim but the batch dimension must be fixed"),
    ("optional", "input 'x' is optional, but 'cuda_graphs' is 'true'; a CUDA graph needs every input on every run "
                 "(make it required or turn CUDA graphs off)"),
])
def test_cuda_graphs_need_fixed_shapes_and_required_inputs(tmp_path: Path, files: dict[str, Path],
                                                           extra_config: str, message: str) -> None:
    """Reported before the device is looked at, so also on machines without a GPU."""
    text = config("pytorch_libtorch", *TWO_HEADS_IO, kind="KIND_GPU", parameters={"cuda_graphs": "true"})
    if extra_config == "optional":
        text = text.replace('name: "x" data_type: TYPE_FP32', 'name: "x" data_type: TYPE_FP32 optional: true')
    else:
        text = text.replace('name: "x" data_type: TYPE_FP32 dims: [ 4 ]', 'name: "x" data_type: TYPE_FP32 dims: [ -1 ]')
    folder = write_model_folder(tmp_path, "m", text, files["script"])
    with pytest.raises(ConfigError) as info:
        kiln.load(folder, kind="gpu")
    assert str(info.value) == f"model 'm': {message}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_gpu_instance_without_cuda(tmp_path: Path, files: dict[str, Path]) -> None:
    message = load_error(tmp_path, files["script"], {}, UnavailableError, kind="KIND_GPU")
    assert message == (f"model 'm': a GPU instance was requested, but this PyTorch ({torch.__version__}) sees no "
                       f"CUDA device; install a CUDA build of torch on a machine with a GPU, or use KIND_CPU")


def test_string_tensors_are_unsupported(tmp_path: Path, files: dict[str, Path]) -> None:
    text = config("pytorch_libtorch", [("x", "TYPE_STRING", [4]), ("y", "TYPE_FP32", [3])], TWO_HEADS_IO[1])
    folder = write_model_folder(tmp_path, "m", text, files["script"])
    with pytest.raises(UnsupportedError) as info:
        kiln.load(folder)
    assert str(info.value) == (
        "model 'm': input 'x' is TYPE_STRING, which kiln's PyTorch backend does not support (PyTorch has no string "
        "tensors); use a numeric type, or serve the model through the python or onnxruntime backend")
