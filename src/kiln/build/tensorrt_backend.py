"""The TensorRT build path inside ``kiln build``: pre-flight through TensorRT's own parser, then ``build_plan``."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from kiln.build.calibration import Samples, sample_count
from kiln.build.preflight import UnsupportedNode, raise_if_unsupported
from kiln.build.shapes import ShapeRange, resolve_shapes
from kiln.build.sources import ModuleSource, OnnxSource
from kiln.engines.base import Array
from kiln.errors import UnsupportedError

if TYPE_CHECKING:
    from kiln.build.backends import BuildContext, BuildResult
    from kiln.build.builder import BuildOptions


class TensorRTBuilder:
    def preflight(self, source: OnnxSource | ModuleSource, options: BuildOptions) -> None:
        from kiln.build.backends import onnx_path
        from kiln.build.tensorrt import check_build_options, unsupported_nodes

        path = onnx_path(source, "tensorrt")
        if options.device != "cuda":
            raise UnsupportedError("--backend tensorrt builds plans for the GPU: use --device cuda")
        check_build_options(options.precision, options.calibration_method, 1 << 30, 3)
        found = unsupported_nodes(path)  # UnavailableError with the install hint when TensorRT is missing
        raise_if_unsupported("tensorrt", path, [UnsupportedNode(n.op_type, n.node_name, "", n.reason)
                                                  for n in found])

    def build(self, context: BuildContext) -> BuildResult:
        from kiln.build.backends import BuildResult, onnx_path
        from kiln.build.tensorrt import build_plan

        options = context.options
        max_batch = context.max_batch_size or None
        ranges = resolve_shapes({t.name: t.dims for t in context.file_io.inputs}, options.shapes, max_batch)
        batches = list(opt_batches(context.samples, ranges)) if options.precision == "int8" else None
        with context.progress.step("tensorrt", f"building a TensorRT plan ({options.precision})"):
            info = build_plan(onnx_path(context.source, "tensorrt"), context.version_dir / "model.plan",
                              precision=options.precision, shapes=options.shapes or None, max_batch_size=max_batch,
                              calibration_batches=batches, calibration_method=options.calibration_method)
        context.report.steps.append(f"TensorRT {info.tensorrt_version} plan, flags {', '.join(info.builder_flags)}"
                                    f"{', strongly typed (Q/DQ)' if info.strongly_typed else ''}")
        details = dataclasses.asdict(info)
        details["profile"] = {name: r.format() for name, r in info.profile.items()}
        context.report.details["tensorrt"] = {k: str(v) if isinstance(v, Path) else v for k, v in details.items()}
        return BuildResult(backend="tensorrt", platform="tensorrt_plan", file_io=context.file_io,
                           max_batch_size=context.max_batch_size, gpu=True)


def opt_batches(samples: Samples, ranges: Mapping[str, ShapeRange]) -> Iterator[dict[str, Array]]:
    """TensorRT calibrates at the profile's opt shape, so samples are regrouped into batches of exactly its
    batch size (samples repeat when there are fewer than one batch; a short last batch is dropped)."""
    count = sample_count(samples)
    batch = max((r.opt[0] for r in ranges.values() if r.opt), default=1)
    total = max(batch, count - count % batch)
    for start in range(0, total, batch):
        rows = np.arange(start, start + batch) % count
        yield {name: array[rows] for name, array in samples.items()}
