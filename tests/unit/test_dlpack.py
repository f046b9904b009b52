"""Engine.infer with DLPack objects on the host: CPU tensors become numpy without a copy, torch tensors reach an
engine that takes them as they are, outputs stay numpy, and unreadable inputs get a clear error. The device half
(CUDA tensors and cupy arrays in, the same kind out) runs in tests/integration/test_cuda_shm_gpu.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import kiln  # noqa: E402
from kiln.engines.dlpack import DeviceInputs, outputs_like, prepare_inputs  # noqa: E402
from kiln.errors import InvalidArgumentError  # noqa: E402
from kiln.testing.repo import onnx_identity_model, write_model  # noqa: E402


class _HostDLPack:
    """A DLPack producer that is neither numpy nor torch (as a JAX CPU array would be)."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.array.__dlpack_device__()


@pytest.fixture
def identity(tmp_path: Path) -> Any:
    folder = write_model(tmp_path, "ident", onnx_identity_model())
    with kiln.load(folder) as engine:
        yield engine


def test_cpu_dlpack_inputs_become_numpy_views(identity: Any) -> None:
    source = np.arange(8, dtype=np.float32).reshape(2, 4)
    prepared, device = prepare_inputs("m", {"a": _HostDLPack(source), "b": torch.from_numpy(source)},
                                      keep_torch=False)
    assert device is None
    for value in prepared.values():
        assert isinstance(value, np.ndarray) and np.shares_memory(value, source)
    (name,) = [t.name for t in identity.inputs]
    out = identity.infer({name: _HostDLPack(source)})
    (result,) = out.values()
    assert isinstance(result, np.ndarray)
    np.testing.assert_array_equal(result, source)


def test_torch_tensors_stay_tensors_for_engines_that_take_them() -> None:
    tensor = torch.ones(2, 4)
    prepared, device = prepare_inputs("m", {"x": tensor}, keep_torch=True)
    assert prepared["x"] is tensor and device is None  # a CPU tensor is host data: outputs stay numpy


def test_unreadable_dlpack_input_names_model_and_input() -> None:
    with pytest.raises(InvalidArgumentError, match="model 'm': input 'x' \\(Tensor\\) cannot be read through DLPack"):
        prepare_inputs("m", {"x": torch.ones(2, requires_grad=True)}, keep_torch=False)


def test_outputs_follow_the_device_inputs_kind() -> None:
    like = torch.zeros(1)
    outputs = outputs_like({"y": np.arange(3, dtype=np.float32), "s": np.array([b"a"], dtype=object)},
                           DeviceInputs(like, like.device))
    assert isinstance(outputs["y"], torch.Tensor) and outputs["y"].tolist() == [0.0, 1.0, 2.0]
    assert isinstance(outputs["s"], np.ndarray)  # BYTES has no device form
    plain = {"y": np.zeros(2)}
    assert outputs_like(plain, None) == plain
