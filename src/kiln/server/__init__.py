"""The protocol-free server core: repository, models, schedulers, statistics."""

from kiln.server.request import InferRequest, InferResponse, InputTensor, OutputTensor, RequestedOutput
from kiln.server.server import ModelMetadata, Server, ServerOptions

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
