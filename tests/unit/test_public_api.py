"""The curated public API: ``kiln.__all__`` is pinned; changing it is a deliberate act that updates this test."""

from __future__ import annotations

import importlib

import kiln

PUBLIC = ["DataType", "Engine", "EngineOptions", "ErrorCode", "KilnError", "Server", "ServerOptions", "__version__",
          "build", "errors", "load"]


def test_all_is_pinned() -> None:
    assert kiln.__all__ == PUBLIC


def test_every_name_is_importable() -> None:
    module = importlib.import_module("kiln")
    for name in PUBLIC:
        assert hasattr(module, name), name
    namespace: dict[str, object] = {}
    exec("from kiln import *", namespace)
    assert set(namespace) - {"__builtins__"} == set(PUBLIC)


def test_names_are_the_real_objects() -> None:
    from kiln import direct, engines, errors, tensor

    assert kiln.load is direct.load
    assert kiln.Engine is engines.Engine
    assert kiln.EngineOptions is engines.EngineOptions
    assert kiln.DataType is tensor.DataType
    assert kiln.ErrorCode is errors.ErrorCode
    assert kiln.KilnError is errors.KilnError
    assert kiln.errors is errors
    builder = importlib.import_module("kiln.build.builder")
    assert callable(kiln.build) and kiln.build.BuildOptions is builder.BuildOptions
    assert isinstance(kiln.__version__, str) and kiln.__version__.count(".") == 2


def test_testing_helpers_are_public() -> None:
    import kiln.testing

    helpers = {"make_repo", "onnx_add_sub_model", "onnx_identity_model", "onnx_type", "write_model"}
    assert helpers <= set(kiln.testing.__all__)
    for name in kiln.testing.__all__:
        assert getattr(kiln.testing, name) is not None


def test_server_is_the_core_facade() -> None:
    from kiln.server import server

    assert kiln.Server is server.Server and kiln.ServerOptions is server.ServerOptions
