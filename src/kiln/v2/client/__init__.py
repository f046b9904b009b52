"""kiln's one client of the KServe V2 / Triton protocols: blocking and asyncio, HTTP and gRPC.

    from kiln.v2.client import HttpClient
    with HttpClient("localhost:8000") as client:
        outputs = client.infer("simple", {"INPUT0": a, "INPUT1": b}).arrays()

The HTTP clients need nothing beyond kiln's core install; the gRPC ones need grpcio (``kiln[server]``) and are
imported from :mod:`kiln.v2.client.grpc`.
"""

from kiln.v2.client.aio import AsyncHttpClient
from kiln.v2.client.calls import Response
from kiln.v2.client.endpoint import Endpoint, endpoint, split_url, tls_context
from kiln.v2.client.http import HttpClient, ServerUnreachableError

__all__ = ["AsyncHttpClient", "Endpoint", "HttpClient", "Response", "ServerUnreachableError", "endpoint",
           "split_url", "tls_context"]
