"""kiln's private protobuf descriptor pool.

kiln's ``.proto`` files use Triton's package (``inference``) and message
names (``inference.ModelConfig``, ``inference.ModelInferRequest``, ...) so
that they are wire- and text-format-compatible with Triton.  The official
``tritonclient`` package registers those very same fully-qualified names in
protobuf's *default* descriptor pool.  Registering kiln's generated modules
in the default pool as well would make importing both in one process fail
with "duplicate symbol" / "duplicate file name" errors (or silently pick up
whichever definition was registered first).

The generated modules under ``kiln/**/_generated/`` are therefore rewritten by
``tools/gen_protos.py`` to register into :data:`POOL` instead, so kiln and
tritonclient can be imported side by side.  Messages from the two pools are
distinct Python classes but share the wire format: convert between them with
``SerializeToString()`` / ``ParseFromString()``.
"""

from __future__ import annotations

from google.protobuf import descriptor_pool

__all__ = ["POOL"]

POOL: descriptor_pool.DescriptorPool = descriptor_pool.DescriptorPool()
"""The descriptor pool holding every ``inference.*`` type defined by kiln."""
