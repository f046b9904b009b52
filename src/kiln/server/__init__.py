"""The protocol-free server core: repository, models, schedulers, statistics."""

from kiln.server.server import Server, ServerOptions
from kiln.v2.types import InferRequest, InferResponse, InputTensor, ModelMetadata, OutputTensor, RequestedOutput

__all__ = [
    "InferRequest",
    "InferResponse",
    "InputTensor",
    "ModelMetadata",
    "OutputTensor",
    "RequestedOutput",
    "Server",
    "ServerOptions",
]
