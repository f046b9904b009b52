"""Handing requests between frontend worker processes and the server process: shared-memory arenas for tensor
bytes, a framed Unix-socket link, tensor descriptors, the server process's answer to a decoded infer request, and
the supervisor that keeps the workers running.

``kiln serve --http-workers N`` uses all of it (frontends/http/workers.py), ``--grpc-workers N`` all of it for
ModelInfer (frontends/grpc/workers.py, with its own link header); nothing here knows HTTP or gRPC.
"""
