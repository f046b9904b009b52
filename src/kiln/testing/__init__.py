"""Reusable helpers for kiln's tests and for users testing code that serves models with kiln.

Build tiny ONNX models in code and lay them out as a Triton-style model repository::

    from kiln.testing import make_repo, onnx_add_sub_model

    repo = make_repo(tmp_path, simple=onnx_add_sub_model())
    engine = kiln.load(repo / "simple")
"""

from kiln.testing.repo import (
    BATCH_DIM,
    IR_VERSION,
    OPSET,
    make_repo,
    onnx_add_sub_model,
    onnx_identity_model,
    onnx_type,
    write_model,
)

__all__ = [
    "BATCH_DIM",
    "IR_VERSION",
    "OPSET",
    "make_repo",
    "onnx_add_sub_model",
    "onnx_identity_model",
    "onnx_type",
    "write_model",
]
