"""The process pool torch.compile (Inductor) starts to compile kernels, stopped once loading is over.

Inductor starts its pool on the first compile of the process, a compile whose every graph comes from the version's
compile cache included: one sidecar process and, on a 16-core host, 16 workers of about 380 MB resident each, which
it lets go only after 60 idle seconds, keeping the sidecar (about 650 MB) for the life of the server. Once `kiln
serve` has loaded its models nothing compiles until the next load, and a later compile starts a fresh pool.
"""

from __future__ import annotations

import logging
import sys

log = logging.getLogger("kiln.engines")

_ASYNC_COMPILE = "torch._inductor.async_compile"


def stop_compile_workers() -> bool:
    """Stop Inductor's compile-worker pool, where this process started one; True if there was a pool to stop. Call
    it only while nothing compiles (no model is loading). A process that never imported Inductor is left alone
    (torch is not imported here)."""
    module = sys.modules.get(_ASYNC_COMPILE)
    if module is None or not getattr(module, "_pool_set", None):
        return False
    try:
        module.shutdown_compile_workers()
    except Exception:  # a private API of torch: its absence must not stop the server from starting
        log.debug("could not stop torch.compile's compile workers", exc_info=True)
        return False
    return True
