"""The PyTorch engine on the CPU: results against the eager module, naming conventions, dtypes, layouts, threads,
through kiln.load and through kiln.Server."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch

import kiln
from kiln.engines.torch import TorchEngine
from kiln.errors import ConfigError, InternalError, UnavailableError
from kiln.server import InferRequest, InputTensor, RequestedOutput, Server, ServerOptions
from kiln.tensor import DataType

from ._models import TWO_HEADS_IO, ConvNet, DictHeads, TwoHeads, X, Y, config, write_model_folder

RNG = np.random.default_rng(7)
PLATFORMS = {"script": "pytorch_libtorch", "trace": "pytorch_libtorch", "export": "torch_aoti"}


def eager_two_heads(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    with torch.inference_mode():
        first, second = TwoHeads().eval()(torch.from_numpy(x), torch.from_numpy(y))
    return first.numpy(), second.numpy()


def load(tmp_path: Path, source: Path, config_text: str, name: str = "m", **options: object) -> TorchEngine:
    engine = kiln.load(write_model_folder(tmp_path, name, config_text, source), **options)
    assert isinstance(engine, TorchEngine)
    return engine


@pytest.mark.parametrize("kind", ["script", "trace", "export"])
def test_results_match_the_eager_module(tmp_path: Path, files: dict[str, Path], kind: str) -> None:
    engine = load(tmp_path, files[kind], config(PLATFORMS[kind], *TWO_HEADS_IO))
    out = engine.infer({"x": X, "y": Y})
    first, second = eager_two_heads(X, Y)
    assert list(out) == ["OUTPUT__0", "OUTPUT__1"]
    np.testing.assert_allclose(out["OUTPUT__0"], first, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(out["OUTPUT__1"], second, rtol=1e-6, atol=1e-6)
    assert out["OUTPUT__0"].dtype == np.float32 and out["OUTPUT__0"].shape == (3, 3)
    assert engine.format.value == ("exported_program" if kind == "export" else "torchscript")
    assert engine.device == torch.device("cpu") and engine.thread_safe


@pytest.mark.parametrize("kind", ["script", "export"])
def test_inputs_named_after_forward_arguments_in_any_config_order(tmp_path: Path, files: dict[str, Path],
                                                                  kind: str) -> None:
    inputs = [("y", "TYPE_FP32", [3]), ("x", "TYPE_FP32", [4])]
    engine = load(tmp_path, files[kind], config(PLATFORMS[kind], inputs, TWO_HEADS_IO[1]))
    np.testing.assert_allclose(engine.infer({"x": X, "y": Y})["OUTPUT__0"], eager_two_heads(X, Y)[0], rtol=1e-6)


def test_named_index_convention_for_inputs_and_outputs(tmp_path: Path, files: dict[str, Path]) -> None:
    inputs = [("B__1", "TYPE_FP32", [3]), ("A__0", "TYPE_FP32", [4])]
    outputs = [("RELU__1", "TYPE_FP32", [3]), ("SUM__0", "TYPE_FP32", [3])]
    engine = load(tmp_path, files["script"], config("pytorch_libtorch", inputs, outputs))
    out = engine.infer({"A__0": X, "B__1": Y})
    first, second = eager_two_heads(X, Y)
    np.testing.assert_allclose(out["SUM__0"], first, rtol=1e-6)
    np.testing.assert_allclose(out["RELU__1"], second, rtol=1e-6)


def test_config_order_when_names_follow_no_convention(tmp_path: Path, files: dict[str, Path]) -> None:
    inputs = [("first", "TYPE_FP32", [4]), ("second", "TYPE_FP32", [3])]
    outputs = [("total", "TYPE_FP32", [3]), ("rectified", "TYPE_FP32", [3])]
    engine = load(tmp_path, files["trace"], config("pytorch_libtorch", inputs, outputs))
    out = engine.infer({"first": X, "second": Y}, outputs=["rectified"])
    assert list(out) == ["rectified"]
    np.testing.assert_allclose(out["rectified"], eager_two_heads(X, Y)[1], rtol=1e-6)


@pytest.mark.parametrize("kind", ["dict_script", "dict_export"])
def test_dict_results_are_matched_by_key(tmp_path: Path, files: dict[str, Path], kind: str) -> None:
    outputs = [("doubled", "TYPE_FP32", [4]), ("scores", "TYPE_FP32", [2])]
    platform = "torch_aoti" if kind == "dict_export" else "pytorch_libtorch"
    engine = load(tmp_path, files[kind], config(platform, [("x", "TYPE_FP32", [4])], outputs))
    out = engine.infer({"x": X})
    with torch.inference_mode():
        expected = DictHeads().eval()(torch.from_numpy(X))
    np.testing.assert_allclose(out["scores"], expected["scores"].numpy(), rtol=1e-6)
    np.testing.assert_array_equal(out["doubled"], X * 2)


def test_dict_result_without_a_declared_key(tmp_path: Path, files: dict[str, Path]) -> None:
    outputs = [("scores", "TYPE_FP32", [2]), ("logits", "TYPE_FP32", [2])]
    engine = load(tmp_path, files["dict_script"], config("pytorch_libtorch", [("x", "TYPE_FP32", [4])], outputs))
    with pytest.raises(InternalError) as info:
        engine.infer({"x": X})
    assert str(info.value) == ("model 'm': the model returned a dict without key 'logits' (its keys: scores, "
                               "doubled); dict results are matched to outputs by name")
    assert list(engine.infer({"x": X}, outputs=["scores"])) == ["scores"]


def test_one_dict_argument_gets_the_inputs_by_name(tmp_path: Path, files: dict[str, Path]) -> None:
    inputs = [("b", "TYPE_FP32", [3]), ("a", "TYPE_FP32", [3])]
    engine = load(tmp_path, files["difference"], config("pytorch_libtorch", inputs, [("d", "TYPE_FP32", [3])]))
    np.testing.assert_array_equal(engine.infer({"a": Y, "b": Y * 3})["d"], Y - Y * 3)


def test_input_count_must_fit_forward(tmp_path: Path, files: dict[str, Path]) -> None:
    with pytest.raises(ConfigError) as info:
        load(tmp_path, files["script"], config("pytorch_libtorch", [("x", "TYPE_FP32", [4])], TWO_HEADS_IO[1]))
    assert str(info.value) == ("model 'm': forward() takes 2 tensor arguments (x, y; 2 required), but the config "
                               "declares 1 inputs")


def test_repeated_input_index_is_refused(tmp_path: Path, files: dict[str, Path]) -> None:
    inputs = [("A__0", "TYPE_FP32", [4]), ("B__0", "TYPE_FP32", [3])]
    with pytest.raises(ConfigError) as info:
        load(tmp_path, files["script"], config("pytorch_libtorch", inputs, TWO_HEADS_IO[1]))
    assert str(info.value) == ("model 'm': the inputs map to argument positions A__0 -> 0, B__0 -> 0; positions "
                               "must be 0..1 with none repeated (name inputs <name>__<index> or after forward()'s "
                               "arguments)")


def test_output_index_beyond_the_result(tmp_path: Path, files: dict[str, Path]) -> None:
    outputs = [("OUT__0", "TYPE_FP32", [3]), ("OUT__5", "TYPE_FP32", [3])]
    engine = load(tmp_path, files["script"], config("pytorch_libtorch", TWO_HEADS_IO[0], outputs))
    with pytest.raises(InternalError, match=r"output 'OUT__5' is result 5, but the model returned 2 value\(s\)"):
        engine.infer({"x": X, "y": Y})


def test_integer_and_bool_tensors(tmp_path: Path, files: dict[str, Path]) -> None:
    outputs = [("next", "TYPE_INT64", [5]), ("big", "TYPE_BOOL", [5])]
    engine = load(tmp_path, files["counter"], config("pytorch_libtorch", [("x", "TYPE_INT64", [5])], outputs))
    x = np.arange(10, dtype=np.int64).reshape(2, 5)
    out = engine.infer({"x": x})
    np.testing.assert_array_equal(out["next"], x + 1)
    np.testing.assert_array_equal(out["big"], x > 2)
    assert out["next"].dtype == np.int64 and out["big"].dtype == np.bool_


def test_an_output_dtype_the_model_does_not_return(tmp_path: Path, files: dict[str, Path]) -> None:
    outputs = [("next", "TYPE_INT32", [5]), ("big", "TYPE_BOOL", [5])]
    engine = load(tmp_path, files["counter"], config("pytorch_libtorch", [("x", "TYPE_INT64", [5])], outputs))
    with pytest.raises(InternalError) as info:
        engine.infer({"x": np.zeros((1, 5), np.int64)})
    assert str(info.value) == ("model 'm': output 'next' has dtype torch.int64, but the config declares TYPE_INT32; "
                               "make the config's data_type match what the model returns")


@pytest.mark.parametrize("kind", ["script", "export"])
def test_bf16_precision_on_the_cpu(tmp_path: Path, files: dict[str, Path], kind: str) -> None:
    engine = load(tmp_path, files[kind], config(PLATFORMS[kind], *TWO_HEADS_IO, parameters={"precision": "bf16"}))
    out = engine.infer({"x": X, "y": Y})
    assert out["OUTPUT__0"].dtype == np.float32  # computed in bf16, returned in the config's type
    np.testing.assert_allclose(out["OUTPUT__0"], eager_two_heads(X, Y)[0], rtol=3e-2, atol=3e-2)
    assert engine.settings.precision == "bf16"


def test_bf16_tensors_in_and_out(tmp_path: Path, files: dict[str, Path]) -> None:
    inputs = [("x", "TYPE_BF16", [4]), ("y", "TYPE_BF16", [3])]
    outputs = [("OUTPUT__0", "TYPE_BF16", [3]), ("OUTPUT__1", "TYPE_BF16", [3])]
    engine = load(tmp_path, files["bf16"], config("pytorch_libtorch", inputs, outputs))
    x, y = X.astype(ml_dtypes.bfloat16), Y.astype(ml_dtypes.bfloat16)
    out = engine.infer({"x": x, "y": y})
    with torch.inference_mode():
        expected = TwoHeads().to(torch.bfloat16).eval()(torch.from_numpy(X).bfloat16(), torch.from_numpy(Y).bfloat16())
    assert out["OUTPUT__0"].dtype == np.dtype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(out["OUTPUT__0"].astype(np.float32), expected[0].float().numpy())


@pytest.mark.parametrize("kind", ["conv_script", "conv_export"])
def test_channels_last_on_the_cpu(tmp_path: Path, files: dict[str, Path], kind: str) -> None:
    platform = "torch_aoti" if kind == "conv_export" else "pytorch_libtorch"
    text = config(platform, [("image", "TYPE_FP32", [3, 8, 8])], [("logits", "TYPE_FP32", [5])],
                  parameters={"channels_last": "true"})
    engine = load(tmp_path, files[kind], text)
    image = RNG.standard_normal((2, 3, 8, 8)).astype(np.float32)
    with torch.inference_mode():
        expected = ConvNet().eval()(torch.from_numpy(image)).numpy()
    np.testing.assert_allclose(engine.infer({"image": image})["logits"], expected, rtol=1e-4, atol=1e-5)


def test_reshape_in_and_out(tmp_path: Path, files: dict[str, Path]) -> None:
    extra = ""
    text = config("pytorch_libtorch", [("pixels", "TYPE_FP32", [192])], [("logits", "TYPE_FP32", [5, 1])], extra=extra)
    text = text.replace("dims: [ 192 ] }", "dims: [ 192 ] reshape: { shape: [ 3, 8, 8 ] } }")
    text = text.replace("dims: [ 5, 1 ] }", "dims: [ 5, 1 ] reshape: { shape: [ 5 ] } }")
    engine = load(tmp_path, files["conv_script"], text)
    image = RNG.standard_normal((2, 3, 8, 8)).astype(np.float32)
    out = engine.infer({"pixels": image.reshape(2, 192)})
    with torch.inference_mode():
        expected = ConvNet().eval()(torch.from_numpy(image)).numpy()
    assert out["logits"].shape == (2, 5, 1)
    np.testing.assert_allclose(out["logits"][:, :, 0], expected, rtol=1e-5, atol=1e-6)


def test_read_only_inputs_are_copied_not_touched(tmp_path: Path, files: dict[str, Path]) -> None:
    engine = load(tmp_path, files["script"], config("pytorch_libtorch", *TWO_HEADS_IO))
    raw = X.tobytes()
    x = np.frombuffer(raw, dtype=np.float32).reshape(3, 4)  # what the HTTP and gRPC codecs hand over
    out = engine.infer({"x": x, "y": Y})
    np.testing.assert_allclose(out["OUTPUT__0"], eager_two_heads(X, Y)[0], rtol=1e-6)
    assert raw == X.tobytes()


def test_closed_engine_refuses_work(tmp_path: Path, files: dict[str, Path]) -> None:
    engine = load(tmp_path, files["script"], config("pytorch_libtorch", *TWO_HEADS_IO))
    engine.close()
    engine.close()
    with pytest.raises(UnavailableError, match="model 'm': the engine is closed"):
        engine.infer({"x": X, "y": Y})


@pytest.mark.usefixtures("restore_threads")
def test_thread_count_from_the_config_or_the_caller(tmp_path: Path, files: dict[str, Path]) -> None:
    load(tmp_path, files["script"], config("pytorch_libtorch", *TWO_HEADS_IO, parameters={"num_threads": "1"}))
    assert torch.get_num_threads() == 1
    load(tmp_path, files["script"], config("pytorch_libtorch", *TWO_HEADS_IO, parameters={"num_threads": "1"}),
         name="n", intra_op_threads=2)
    assert torch.get_num_threads() == 2  # the caller's intra_op_threads wins over the config


@pytest.mark.usefixtures("restore_threads")  # the server gives each of the two models a share of the cores
def test_served_by_kiln_server(tmp_path: Path, files: dict[str, Path]) -> None:
    batching = "dynamic_batching { }"
    write_model_folder(tmp_path, "scripted", config("pytorch_libtorch", *TWO_HEADS_IO, extra=batching),
                       files["script"])
    write_model_folder(tmp_path, "exported", config("torch_aoti", *TWO_HEADS_IO, extra=batching), files["export"])
    server = Server(ServerOptions(repositories=[tmp_path]))
    try:
        assert server.start() == []  # no model failed to load
        for name in ("scripted", "exported"):
            request = InferRequest(name, [InputTensor("x", DataType.FP32, X.shape, X),
                                          InputTensor("y", DataType.FP32, Y.shape, Y)],
                                   outputs=[RequestedOutput("OUTPUT__1")])
            assert server.model_ready(name)
            response = server.infer_sync(request)
            assert [o.name for o in response.outputs] == ["OUTPUT__1"]
            np.testing.assert_allclose(response.outputs[0].data, eager_two_heads(X, Y)[1], rtol=1e-6)
    finally:
        server.close()


def test_infer_takes_torch_tensors_as_they_are(tmp_path: Path) -> None:
    import torch

    import kiln
    from kiln.errors import InvalidArgumentError

    class Double(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2

    folder = tmp_path / "double"
    (folder / "1").mkdir(parents=True)
    program = torch.export.export(Double(), (torch.ones(2, 3),),
                                  dynamic_shapes=({0: torch.export.Dim("batch", min=1, max=8)},))
    torch.export.save(program, str(folder / "1" / "model.pt2"))
    (folder / "config.pbtxt").write_text(
        'platform: "torch_aoti"\nmax_batch_size: 8\n'
        'input [{ name: "x" data_type: TYPE_FP32 dims: [3] }]\n'
        'output [{ name: "output__0" data_type: TYPE_FP32 dims: [3] }]\n')
    with kiln.load(folder) as engine:
        got = engine.infer({"x": torch.arange(6, dtype=torch.float32).reshape(2, 3)})["output__0"]
        np.testing.assert_array_equal(got, np.arange(6, dtype=np.float32).reshape(2, 3) * 2)
        with pytest.raises(InvalidArgumentError, match="torch tensor of dtype torch.float64; expected FP32"):
            engine.infer({"x": torch.zeros(2, 3, dtype=torch.float64)})
        with pytest.raises(InvalidArgumentError, match=r"has shape \[2, 4\]"):
            engine.infer({"x": torch.zeros(2, 4)})
