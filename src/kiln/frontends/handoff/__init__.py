"""Handing requests between frontend worker processes and the server process: shared-memory arenas for tensor
bytes, a framed Unix-socket link, tensor descriptors, and the supervisor that keeps the workers running.

``kiln serve --http-workers N`` uses all of it (frontends/http/workers.py); nothing here knows HTTP.
"""
