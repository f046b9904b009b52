"""``python -m kiln.build.load_probe MODEL_DIR VERSION KIND``: load a built version as a fresh server process
would, and print one JSON line: the seconds ``kiln.load`` took, what became of the version's compile cache, and
how many compiled graphs torch found in its caches or compiled anew. ``kiln build`` runs it with an empty
Inductor cache, so the figures are those of a machine that never compiled the model."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence

from kiln.direct import load


def main(argv: Sequence[str] | None = None) -> int:
    model_dir, version, kind = argv if argv is not None else sys.argv[1:]
    started = time.perf_counter()
    engine = load(model_dir, version=int(version), kind=kind, batching=False)
    answer: dict[str, object] = {"load_s": round(time.perf_counter() - started, 2)}
    cache = getattr(engine, "compile_cache", None)
    counts = getattr(engine, "compile_counts", None)
    if cache is not None:
        answer["cache"] = cache.status if not cache.detail else f"{cache.status}: {cache.detail}"
        answer["cache_entries"] = cache.entries
    if counts is not None:
        answer["fx_graph_hits"] = counts.hits
        answer["fx_graph_misses"] = counts.misses
    engine.close()
    print(json.dumps(answer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
