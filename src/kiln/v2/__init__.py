"""The KServe V2 / Triton protocols, whole and in one place: request and response types (:mod:`.types`), the raw
tensor layout (:mod:`.layout`), the HTTP and gRPC infer codecs in both directions (:mod:`.http_codec`,
:mod:`.grpc_codec`), the generated protobuf modules (``_generated``), the one status table (:mod:`.status`) and
kiln's client (:mod:`.client`). The server, its frontends, the edge, bench and the CLI all speak through it."""
