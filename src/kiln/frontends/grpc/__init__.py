"""gRPC frontend (Triton-compatible GRPCInferenceService plus grpc.health.v1)."""

from __future__ import annotations

from kiln.frontends.grpc.server import MAX_MESSAGE_BYTES, ReadinessHealth, start_grpc_server
from kiln.frontends.grpc.servicer import GRPCInferenceService

__all__ = ["MAX_MESSAGE_BYTES", "GRPCInferenceService", "ReadinessHealth", "start_grpc_server"]
