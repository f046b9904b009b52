"""How requests enter the cluster, chosen when Serve starts on it.

``haproxy`` (the default): Ray Serve's HAProxy ingress on every node, with each replica taking HTTP on a port of
its own (Serve's "throughput optimized" mode, Ray 2.56 and later). A request crosses HAProxy (C, a few tens of
microseconds) into the replica's own server, as it would reach `kiln serve`. ``proxy``: Serve's Python proxy
actor, which hands every request to the replica over Ray calls; on the 2-core machine that added 9 ms at c=1 where
HAProxy adds 0.5 ms (benchmarks/cluster.py).

Serve reads these settings from the environment of its controller, proxies and replicas when they start, so they
are set here before Ray starts a local cluster and sent along as the job's runtime environment to a running one;
a cluster started with ``ray start`` should get the same variables (docs/cluster.md), and a variable already set by
the user is left as it is."""

from __future__ import annotations

import os
import resource

INGRESS_KINDS = ("haproxy", "proxy")
HAPROXY_MAXCONN = 20_000  # Serve's default
# How long a stopping replica keeps answering while HAProxy learns it is gone (Serve's default: 30 s, which a
# Ctrl-C of `kiln cluster serve` would wait out); HAProxy picks up a change within a second.
DRAINING_S = 5
# Also resend a request when its replica closed the connection without answering (a pooled connection to a replica
# that just died): Serve's default, conn-failure only, fails those. A replica that closes without an answer has
# died, and with it any sequence state the request could have changed, so the resent request cannot apply twice.
RETRY_ON = "conn-failure empty-response"
# HAProxy needs about 2.5 descriptors per connection it may hold, plus a few of its own; it refuses to start when
# the process may not open that many, so the connection limit follows the descriptor limit.
_FDS_PER_CONNECTION = 2.5
_FDS_SPARE = 100


def ingress_environment(kind: str) -> dict[str, str]:
    """The Serve settings for ``kind``, with the user's own values of any of them kept."""
    if kind not in INGRESS_KINDS:
        raise ValueError(f"ingress '{kind}' is not one of {', '.join(INGRESS_KINDS)}")
    if kind == "proxy":
        wanted = {"RAY_SERVE_ENABLE_HA_PROXY": "0"}
    else:
        wanted = {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
                  "RAY_SERVE_HAPROXY_MAXCONN": str(haproxy_maxconn()),
                  "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": str(DRAINING_S),
                  "RAY_SERVE_HAPROXY_RETRY_ON": RETRY_ON}
    return {name: os.environ.get(name, value) for name, value in wanted.items()}


def haproxy_maxconn() -> int:
    """Serve's default connection limit, lowered to what this process's descriptor limit lets HAProxy hold."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        return HAPROXY_MAXCONN
    return max(256, min(HAPROXY_MAXCONN, int((hard - _FDS_SPARE) / _FDS_PER_CONNECTION)))
