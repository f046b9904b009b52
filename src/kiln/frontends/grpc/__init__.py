"""gRPC frontend (Triton-compatible GRPCInferenceService)."""
