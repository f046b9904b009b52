"""Request inputs built from a model's metadata: generated, from .npz and from perf_analyzer's JSON format."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest

from kiln.bench.data import ModelInputs, build_requests
from kiln.config.spec import TensorSpec
from kiln.errors import InvalidArgumentError, UnsupportedError
from kiln.tensor import DataType, encode_bytes

SIMPLE = ModelInputs("simple", tuple(TensorSpec(f"INPUT{i}", DataType.INT32, (16,)) for i in range(2)),
                     max_batch_size=8)
IMAGE = ModelInputs("image", (TensorSpec("IMAGE", DataType.FP32, (3, -1, -1)),), max_batch_size=4)
UNBATCHED = ModelInputs("fixed", (TensorSpec("X", DataType.FP16, (2, 3)),), max_batch_size=0)
TEXT = ModelInputs("text", (TensorSpec("TEXT", DataType.BYTES, (2,)),), max_batch_size=8)


def test_random_data_is_one_request_of_the_batch_shape_and_dtype() -> None:
    requests = build_requests(SIMPLE, "random", 4, {})
    assert len(requests) == 1
    for name in ("INPUT0", "INPUT1"):
        assert requests[0][name].shape == (4, 16)
        assert requests[0][name].dtype == np.int32
    assert requests[0]["INPUT0"].any()
    assert not np.array_equal(requests[0]["INPUT0"][0], requests[0]["INPUT1"][0])  # each input its own draw
    assert np.array_equal(build_requests(SIMPLE, "random", 4, {})[0]["INPUT0"], requests[0]["INPUT0"])  # seeded


def test_zero_data_is_zeros_and_strings_are_zero_digits() -> None:
    assert not build_requests(SIMPLE, "zero", 2, {})[0]["INPUT0"].any()
    text = build_requests(TEXT, "zero", 1, {})[0]["TEXT"]
    assert text.shape == (1, 2) and text.tolist() == [[b"0", b"0"]]


def test_random_strings_are_decimal_numbers() -> None:
    text = build_requests(TEXT, "random", 3, {})[0]["TEXT"]
    assert text.shape == (3, 2)
    assert all(isinstance(v, bytes) and v.isdigit() for v in text.reshape(-1))


def test_a_model_without_batching_sends_its_dims_as_they_are() -> None:
    request = build_requests(UNBATCHED, "random", 1, {})[0]
    assert request["X"].shape == (2, 3) and request["X"].dtype == np.float16


def test_dynamic_dims_come_from_shape() -> None:
    request = build_requests(IMAGE, "zero", 2, {"IMAGE": (3, 8, 6)})[0]
    assert request["IMAGE"].shape == (2, 3, 8, 6)


def test_dynamic_dims_without_shape_say_how_to_give_them() -> None:
    with pytest.raises(InvalidArgumentError, match=r"model 'image': input 'IMAGE' has dynamic dimensions.*"
                                                   r"--shape IMAGE:3,1,1"):
        build_requests(IMAGE, "random", 1, {})


@pytest.mark.parametrize("shape", [(4, 8, 6), (3, 8)])
def test_a_shape_that_contradicts_the_model_is_refused(shape: tuple[int, ...]) -> None:
    with pytest.raises(InvalidArgumentError, match="does not fit the input's dims"):
        build_requests(IMAGE, "random", 1, {"IMAGE": shape})


def test_a_shape_for_an_unknown_input_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="has no input INPUT9"):
        build_requests(SIMPLE, "random", 1, {"INPUT9": (16,)})


def test_batch_size_must_fit_the_model() -> None:
    with pytest.raises(InvalidArgumentError, match="exceeds its max_batch_size 8"):
        build_requests(SIMPLE, "random", 9, {})
    with pytest.raises(InvalidArgumentError, match="does not batch"):
        build_requests(UNBATCHED, "random", 2, {})


def test_npz_samples_are_batched_in_turn_and_wrap_around(tmp_path: Path) -> None:
    path = tmp_path / "data.npz"
    a = np.arange(5 * 16, dtype=np.int64).reshape(5, 16)  # converted to the model's INT32
    np.savez(path, INPUT0=a, INPUT1=-a)
    requests = build_requests(SIMPLE, str(path), 2, {})
    assert len(requests) == 3  # 5 samples in batches of 2: the last takes sample 4 and wraps to sample 0
    assert requests[0]["INPUT0"].dtype == np.int32
    assert requests[1]["INPUT0"].tolist() == a[2:4].tolist()
    assert requests[2]["INPUT1"].tolist() == [(-a[4]).tolist(), (-a[0]).tolist()]


def test_npz_problems_name_the_file_and_the_input(tmp_path: Path) -> None:
    path = tmp_path / "bad.npz"
    np.savez(path, INPUT0=np.zeros((2, 16)))
    with pytest.raises(InvalidArgumentError, match=r"bad.npz: no array for input\(s\) INPUT1"):
        build_requests(SIMPLE, str(path), 1, {})
    np.savez(path, INPUT0=np.zeros((2, 16)), INPUT1=np.zeros((2, 15)))
    with pytest.raises(InvalidArgumentError, match=r"input 'INPUT1' has shape \[2, 15\]; expected \[samples, 16\]"):
        build_requests(SIMPLE, str(path), 1, {})
    np.savez(path, INPUT0=np.zeros((2, 16)), INPUT1=np.zeros((3, 16)))
    with pytest.raises(InvalidArgumentError, match="different sample counts"):
        build_requests(SIMPLE, str(path), 1, {})


def test_perf_analyzer_json_with_lists_b64_and_shapes(tmp_path: Path) -> None:
    path = tmp_path / "data.json"
    raw = np.arange(16, dtype="<i4")
    doc = {"data": [
        {"INPUT0": list(range(16)), "INPUT1": {"b64": base64.b64encode(raw.tobytes()).decode()}},
        {"INPUT0": {"content": [[1] * 8, [2] * 8], "shape": [16]}, "INPUT1": [0] * 16},
    ], "validation_data": [{"OUTPUT0": [0] * 16}]}
    path.write_text(json.dumps(doc))
    requests = build_requests(SIMPLE, str(path), 1, {})
    assert len(requests) == 2
    assert requests[0]["INPUT0"].tolist() == [list(range(16))]
    assert requests[0]["INPUT1"].tolist() == [raw.tolist()]
    assert requests[1]["INPUT0"].tolist() == [[1] * 8 + [2] * 8]


def test_json_content_shape_fills_dynamic_dims_per_sample(tmp_path: Path) -> None:
    path = tmp_path / "images.json"
    doc = {"data": [{"IMAGE": {"content": [0.5] * 12, "shape": [3, 2, 2]}},
                    {"IMAGE": {"content": [0.25] * 24, "shape": [3, 4, 2]}}]}
    path.write_text(json.dumps(doc))
    requests = build_requests(IMAGE, str(path), 1, {})
    assert [r["IMAGE"].shape for r in requests] == [(1, 3, 2, 2), (1, 3, 4, 2)]
    with pytest.raises(InvalidArgumentError, match="have different shapes"):
        build_requests(IMAGE, str(path), 2, {})


def test_json_strings_as_lists_and_as_length_prefixed_b64(tmp_path: Path) -> None:
    path = tmp_path / "text.json"
    prefixed = base64.b64encode(encode_bytes([b"ab", b"c"])).decode()
    path.write_text(json.dumps({"data": [{"TEXT": ["x", "yz"]}, {"TEXT": {"b64": prefixed}}]}))
    requests = build_requests(TEXT, str(path), 1, {})
    assert requests[0]["TEXT"].tolist() == [[b"x", b"yz"]]
    assert requests[1]["TEXT"].tolist() == [[b"ab", b"c"]]


@pytest.mark.parametrize(("doc", "error", "message"), [
    ({"data": [[{"INPUT0": [1] * 16}]]}, UnsupportedError, "sequence data streams"),
    ({"data": [{"INPUT0": [1] * 16}]}, InvalidArgumentError, r"data\[0\] has no value for input 'INPUT1'"),
    ({"data": [{"INPUT0": [1] * 15, "INPUT1": [1] * 16}]}, InvalidArgumentError, "15 values do not fill shape"),
    ({"data": [{"INPUT0": {"b64": "AAAA"}, "INPUT1": [1] * 16}]}, InvalidArgumentError, "3 bytes do not fill"),
    ({"data": []}, InvalidArgumentError, "at least one entry"),
])
def test_json_problems_name_the_entry(tmp_path: Path, doc: object, error: type[Exception], message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(error, match=message):
        build_requests(SIMPLE, str(path), 1, {})


def test_other_input_data_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="expected random, zero, or a .npz or .json file"):
        build_requests(SIMPLE, str(tmp_path / "missing.npz"), 1, {})
    folder_data = tmp_path / "data.bin"
    folder_data.write_bytes(b"\0" * 64)
    with pytest.raises(UnsupportedError, match="reads .npz"):
        build_requests(SIMPLE, str(folder_data), 1, {})
