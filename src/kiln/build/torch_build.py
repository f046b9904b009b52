"""The PyTorch build path: ONNX -> a torch module (kiln's converter) -> TorchScript, torch.export or AOTInductor.

Precision, memory layout, CUDA graphs and torch.compile are applied by the PyTorch engine at load time from the
config parameters the build writes, so the saved file stays FP32 and one file serves CPU and GPU instances; only
an AOTInductor package is compiled for its device and precision up front. Whether to compile (``--compile-mode
auto``) and what a compiled build keeps is torch_compile.py's part.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import warnings
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import onnx

from kiln.build.calibration import Samples
from kiln.build.output import io_as
from kiln.build.preflight import UnsupportedNode, raise_if_unsupported
from kiln.build.sources import ModuleSource, OnnxSource
from kiln.build.torch_compile import AUTO, choose, decided_without_measuring, record_decision
from kiln.errors import InvalidArgumentError, UnavailableError, UnsupportedError

if TYPE_CHECKING:
    import torch

    from kiln.build.backends import BuildContext, BuildResult
    from kiln.build.builder import BuildOptions

FORMATS = {"torchscript": ("model.pt", "pytorch_libtorch"), "export": ("model.pt2", "torch_aoti"),
           "aoti": ("model.pt2", "torch_aoti")}
EXAMPLE_BATCH = 2  # not 1: a size-1 example lets tracing and export specialise the batch dimension


class TorchBuilder:
    def preflight(self, source: OnnxSource | ModuleSource, options: BuildOptions) -> None:
        if importlib.util.find_spec("torch") is None:
            raise UnavailableError("the torch backend needs PyTorch: pip install 'kiln[torch]'")
        import torch

        if options.precision == "int8":
            raise UnsupportedError("--precision int8 is not available for the torch backend (INT8 with calibration "
                                   "is built by the onnxruntime and tensorrt backends); use fp32, fp16 or bf16")
        if options.precision == "fp16" and options.device == "cpu":
            raise UnsupportedError("--precision fp16 with the torch backend needs --device cuda (PyTorch's CPU "
                                   "kernels for fp16 are missing or slow); use bf16 or fp32 on the CPU")
        if options.device == "cuda" and not torch.cuda.is_available():
            raise UnavailableError("--device cuda: PyTorch sees no CUDA device on this machine")
        if options.torch_format not in FORMATS:
            raise InvalidArgumentError(f"--torch-format is '{options.torch_format}'; expected one of "
                                       f"{', '.join(FORMATS)}")
        if options.cuda_graphs and options.device != "cuda":
            raise UnsupportedError("--cuda-graphs needs --device cuda")
        _check_format_options(options)
        if not isinstance(source, OnnxSource):
            return  # a module is already PyTorch
        from kiln.build.torch_convert import unsupported_nodes

        found = unsupported_nodes(onnx.load(str(source.path), load_external_data=True))
        listed = [UnsupportedNode(n.op_type, n.name or f"#{n.index}", n.domain, n.reason) for n in found]
        raise_if_unsupported("torch", source.path, listed)

    def build(self, context: BuildContext) -> BuildResult:
        import torch

        from kiln.build.backends import BuildResult
        from kiln.build.torch_convert import convert

        options = context.options
        filename, platform = FORMATS[options.torch_format]
        target = context.version_dir / filename
        source = context.source
        module: torch.nn.Module
        if isinstance(source, OnnxSource):
            with context.progress.step("convert", "converting the ONNX graph to PyTorch"):
                module = convert(onnx.load(str(source.path))).eval()
            origin = "ONNX -> PyTorch (kiln converter)"
        else:
            module, origin = source.module, "torch module"
        # The first dimension stays dynamic whenever the model file leaves it open (also without batching, where
        # the config then shows -1); the example has 2 rows so neither tracing nor export specialises it to 1.
        dynamic_first = all(t.dims and t.dims[0] == -1 for t in context.file_io.inputs)
        batch = EXAMPLE_BATCH if dynamic_first else None
        example = _example(context.samples, [t.name for t in context.file_io.inputs], batch)
        with torch.inference_mode(False), torch.no_grad(), _torch_deprecations_silenced():
            if options.torch_format == "torchscript":
                with context.progress.step("trace", "tracing to TorchScript"):
                    traced = torch.jit.trace(module, example, check_trace=False)  # type: ignore[no-untyped-call]
                    traced.save(str(target))
                context.report.steps.append(f"{origin} -> TorchScript (torch.jit.trace)")
                context.report.warnings.append("TorchScript is deprecated in PyTorch; it is kept for Triton's "
                                               "PyTorch backend, prefer --torch-format export for kiln")
            else:
                self._export(context, module, example, dynamic_first, target, origin)
        result = BuildResult(backend="pytorch", platform=platform, file_io=io_as(context.file_io, options.io_dtype),
                             max_batch_size=context.max_batch_size, gpu=options.device == "cuda",
                             parameters=_engine_parameters(options, context.max_batch_size))
        mode = _compile_mode(context, target, result)
        if mode != "none":
            result = replace(result, parameters={**result.parameters, "compile_mode": mode})
        context.report.details["torch"] = {"format": options.torch_format, "torch_version": torch.__version__,
                                           "parameters": result.parameters}
        return result

    def _export(self, context: BuildContext, module: torch.nn.Module, example: tuple[torch.Tensor, ...],
                dynamic_batch: bool, target: Path, origin: str) -> None:
        import torch

        options = context.options
        if options.torch_format == "aoti":
            module, example = _for_device(copy.deepcopy(module), example, options)  # never the caller's module
        dynamic: Any = None
        if dynamic_batch:
            # Without batching the config allows any first dimension, so the program must too.
            limit = max(context.max_batch_size, EXAMPLE_BATCH) if context.max_batch_size else None
            batch_dim = torch.export.Dim("batch", min=1, max=limit) if limit else torch.export.Dim("batch", min=1)
            dynamic = tuple({0: batch_dim} for _ in example)
        with context.progress.step("export", "exporting with torch.export"):
            program = torch.export.export(module, example, dynamic_shapes=dynamic)
        if options.torch_format == "export":
            torch.export.save(program, str(target))
            context.report.steps.append(f"{origin} -> torch.export program (model.pt2)")
            return
        with context.progress.step("compile", f"compiling with AOTInductor for {options.device}"):
            torch._inductor.aoti_compile_and_package(program, package_path=str(target))
        context.report.steps.append(f"{origin} -> torch.export -> AOTInductor package for "
                                    f"{options.device}, {options.precision}")


def _compile_mode(context: BuildContext, model_file: Path, eager: BuildResult) -> str:
    """The compile mode the config gets: the one asked for, or what ``auto`` stands for (torch_compile.py)."""
    options = context.options
    if options.compile_mode != AUTO:
        return options.compile_mode
    decided = decided_without_measuring(options, context.existing_parameters)
    if decided is not None:
        record_decision(context.report, *decided)
        return decided[0]
    return choose(context, model_file, eager)


def _check_format_options(options: BuildOptions) -> None:
    """What the PyTorch engine would refuse at load time, refused before a (possibly long) build."""
    from kiln.engines.torch.options import COMPILE_MODES, GRAPH_CAPTURING_MODES

    if options.compile_mode not in (AUTO, *COMPILE_MODES):
        raise InvalidArgumentError(f"--compile-mode is '{options.compile_mode}'; expected one of "
                                   f"{', '.join((AUTO, *COMPILE_MODES))}")
    compiles = options.compile_mode not in ("none", AUTO)  # auto stands for none where compiling cannot apply
    if options.torch_format == "aoti" and (compiles or options.channels_last):
        raise UnsupportedError("--torch-format aoti compiles the model ahead of time: --compile-mode and "
                               "--channels-last do not apply to it; use --torch-format export for them")
    if options.torch_format == "torchscript" and compiles:
        raise UnsupportedError("torch.compile does not take TorchScript: use --torch-format export with "
                               "--compile-mode")
    graphs = options.cuda_graphs if options.cuda_graphs is not None else options.device == "cuda"
    if graphs and options.compile_mode in GRAPH_CAPTURING_MODES:
        raise UnsupportedError(f"--compile-mode {options.compile_mode} records CUDA graphs itself: add "
                               f"--no-cuda-graphs, or use --compile-mode default or max-autotune-no-cudagraphs")


@contextlib.contextmanager
def _torch_deprecations_silenced() -> Iterator[None]:
    """PyTorch warns on every TorchScript entry point (also those Inductor imports; the build says it once) and
    about its own internal pytree use while compiling; neither is something a kiln user can act on."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`torch\.jit\.\w+` is deprecated", category=DeprecationWarning)
        warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                                category=FutureWarning)
        yield


def _example(samples: Samples, names: list[str], batch: int | None) -> tuple[torch.Tensor, ...]:
    import numpy as np
    import torch

    count = len(samples[names[0]])
    rows = np.arange(batch or 1) % count
    return tuple(torch.from_numpy(np.ascontiguousarray(samples[name][rows] if batch else samples[name][:1]))
                 for name in names)


def _for_device(module: torch.nn.Module, example: tuple[torch.Tensor, ...],
                options: BuildOptions) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    """An AOTInductor package is compiled for one device, dtype and layout: apply them before export."""
    import torch

    device = torch.device("cuda" if options.device == "cuda" else "cpu")
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(options.precision)
    module = module.to(device)
    if dtype is not None:
        module = module.to(dtype)
    moved = []
    for tensor in example:
        tensor = tensor.to(device)
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        moved.append(tensor)
    return module, tuple(moved)


GRAPHS_AT_LOAD = 64  # batch sizes up to this are captured when the model loads; larger ones on first use


def _engine_parameters(options: BuildOptions, max_batch_size: int) -> dict[str, str]:
    """Config parameters for kiln's PyTorch engine (docs/pytorch-backend.md), but the compile mode
    (_compile_mode adds it). With CUDA graphs and batching, every
    batch size the dynamic batcher may form (up to GRAPHS_AT_LOAD) is captured at load, so that no request waits
    behind a capture while the model serves."""
    parameters: dict[str, str] = {}
    if options.precision != "fp32":
        parameters["precision"] = options.precision
    if options.channels_last:
        parameters["channels_last"] = "true"
    cuda_graphs = options.cuda_graphs if options.cuda_graphs is not None else options.device == "cuda"
    if cuda_graphs:
        parameters["cuda_graphs"] = "true"
        if max_batch_size > 0:
            parameters["cuda_graph_batch_sizes"] = f"1-{min(max_batch_size, GRAPHS_AT_LOAD)}"
    return parameters
