"""Inductor's compile-worker pool is stopped once loading is over (kiln/compile_workers.py): run in a fresh
interpreter, so that the pool and its processes are this test's alone."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import sys, time
    from kiln.compile_workers import stop_compile_workers
    assert not stop_compile_workers() and "torch" not in sys.modules  # nothing to stop, torch left unimported

    import psutil, torch
    from torch._inductor.async_compile import AsyncCompile
    AsyncCompile.warm_pool()  # what the first compile of a process does (a 2-core machine compiles without it)
    me = psutil.Process()
    deadline = time.monotonic() + 60
    while not me.children() and time.monotonic() < deadline:  # the pool's sidecar (it starts the workers)
        time.sleep(0.05)
    started = len(me.children(recursive=True))
    assert started >= 1, started
    assert stop_compile_workers()
    assert me.children(recursive=True) == [], me.children(recursive=True)
    compiled = torch.compile(lambda x: (x * 2).relu())  # a later load still compiles: a fresh pool if it needs one
    assert compiled(torch.tensor([-1.0, 3.0])).tolist() == [0.0, 6.0]
    print("ok", started)
""")


def test_the_pool_and_its_processes_are_stopped_and_compiling_still_works() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("ok"), done.stdout
