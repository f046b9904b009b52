"""Shape ranges: the --shapes parser (every error it gives) and the optimization profile a network gets."""

from __future__ import annotations

import pytest

from kiln.build.shapes import ShapeRange, format_shape, parse_shapes, resolve_shapes
from kiln.errors import InvalidArgumentError

FORM = "NAME:MIN/OPT/MAX, e.g. input:1x3x224x224/8x3x224x224/32x3x224x224 (inputs separated by commas)"


def test_one_input_min_opt_max() -> None:
    ranges = parse_shapes("input:1x3x224x224/8x3x224x224/32x3x224x224")
    assert ranges == {"input": ShapeRange((1, 3, 224, 224), (8, 3, 224, 224), (32, 3, 224, 224))}


def test_several_inputs_spaces_and_a_fixed_shape() -> None:
    ranges = parse_shapes(" ids:1x16/4x128/8x512 , mask:2x7 ")
    assert list(ranges) == ["ids", "mask"]
    assert ranges["ids"] == ShapeRange((1, 16), (4, 128), (8, 512))
    assert ranges["mask"] == ShapeRange.fixed((2, 7))


def test_input_names_may_contain_colons() -> None:
    assert parse_shapes("serving_default:input:0:1x4/2x4/3x4") == {
        "serving_default:input:0": ShapeRange((1, 4), (2, 4), (3, 4))}


@pytest.mark.parametrize(("text", "message"), [
    ("", f"--shapes is empty; expected {FORM}"),
    ("  ", f"--shapes is empty; expected {FORM}"),
    ("a:1x2,,b:3", f"--shapes 'a:1x2,,b:3' has an empty entry (two commas in a row or a trailing comma); "
                   f"expected {FORM}"),
    ("a:1x2,", f"--shapes 'a:1x2,' has an empty entry (two commas in a row or a trailing comma); expected {FORM}"),
    ("1x3x224x224", f"--shapes entry '1x3x224x224' has no ':'; expected {FORM}"),
    (":1x2", f"--shapes entry ':1x2' has no input name before ':'; expected {FORM}"),
    ("x:1x2/4x2", "--shapes entry 'x:1x2/4x2' has 2 shapes; expected one (a fixed shape) or three (MIN/OPT/MAX) "
                  "separated by '/'"),
    ("x:1/2/3/4", "--shapes entry 'x:1/2/3/4' has 4 shapes; expected one (a fixed shape) or three (MIN/OPT/MAX) "
                  "separated by '/'"),
    ("x:", "--shapes entry 'x:' has an empty shape; expected dimensions joined by 'x', e.g. 8x3x224x224"),
    ("x:1x2//3x2", "--shapes entry 'x:1x2//3x2' has an empty shape; expected dimensions joined by 'x', "
                   "e.g. 8x3x224x224"),
    ("x:1xAx3", "--shapes entry 'x:1xAx3': dimension 'A' in '1xAx3' is not a positive integer; expected "
                "dimensions joined by 'x', e.g. 8x3x224x224"),
    ("x:0x4", "--shapes entry 'x:0x4': dimension '0' in '0x4' is not a positive integer; expected dimensions "
              "joined by 'x', e.g. 8x3x224x224"),
    ("x:-1x4", "--shapes entry 'x:-1x4': dimension '-1' in '-1x4' is not a positive integer; expected "
               "dimensions joined by 'x', e.g. 8x3x224x224"),
    ("x:1x4/2x4x1/3x4", "--shapes entry 'x:1x4/2x4x1/3x4': min, opt and max have different ranks (2, 3, 2); "
                        "every shape of one input needs the same number of dimensions"),
    ("x:8x4/4x4/16x4", "--shapes entry 'x:8x4/4x4/16x4': dimension 0 is 8/4/16; expected min <= opt <= max"),
    ("x:1x4/1x8/1x6", "--shapes entry 'x:1x4/1x8/1x6': dimension 1 is 4/8/6; expected min <= opt <= max"),
    ("x:1x4,x:2x4", "--shapes gives input 'x' twice; give each input one entry"),
])
def test_parse_errors(text: str, message: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        parse_shapes(text)
    assert str(info.value) == message


def test_errors_name_the_option_they_came_from() -> None:
    with pytest.raises(InvalidArgumentError, match=r"^--calibration-shapes entry 'x' has no ':'"):
        parse_shapes("x", option="--calibration-shapes")


def test_shape_range_checks_itself() -> None:
    with pytest.raises(InvalidArgumentError) as info:
        ShapeRange((4,), (2,), (8,))
    assert str(info.value) == "shape range 4/2/8: dimension 0 is 4/2/8; expected min <= opt <= max"
    with pytest.raises(InvalidArgumentError, match=r"different ranks \(1, 2, 1\)"):
        ShapeRange((1,), (1, 2), (1,))
    with pytest.raises(InvalidArgumentError, match="every dimension must be a positive integer"):
        ShapeRange.fixed((0, 3))


def test_contains_and_format() -> None:
    shape_range = ShapeRange((1, 3), (4, 3), (8, 3))
    assert shape_range.contains((8, 3)) and shape_range.contains((1, 3))
    assert not shape_range.contains((9, 3)) and not shape_range.contains((2,)) and not shape_range.contains((2, 4))
    assert shape_range.format() == "1x3/4x3/8x3"
    assert format_shape(()) == "scalar" and format_shape((-1, 3)) == "-1x3"


def test_profile_from_max_batch_size_for_a_dynamic_batch() -> None:
    inputs = {"x": (-1, 3, 8, 8), "static": (2, 2)}
    assert resolve_shapes(inputs, None, max_batch_size=16) == {
        "x": ShapeRange((1, 3, 8, 8), (16, 3, 8, 8), (16, 3, 8, 8))}


def test_profile_uses_given_ranges_and_leaves_out_static_inputs() -> None:
    inputs = {"ids": (-1, -1), "static": (2, 2)}
    given = parse_shapes("ids:1x1/4x64/8x128,static:2x2")
    assert resolve_shapes(inputs, given) == {"ids": ShapeRange((1, 1), (4, 64), (8, 128))}
    assert resolve_shapes({"static": (2, 2)}) == {}


@pytest.mark.parametrize(("inputs", "shapes", "batch", "message"), [
    ({"x": (-1, 4)}, "y:1x4", None, "shapes name input 'y', which the model does not have (inputs: x)"),
    ({"x": (-1, 4)}, "x:1/2/3", None, "input 'x' has 2 dimensions (-1x4), but its shape range 1/2/3 has 1"),
    ({"x": (-1, 4)}, "x:1x4/2x5/3x5", None,
     "input 'x' dimension 1 is fixed at 4 (-1x4), but its shape range 1x4/2x5/3x5 gives 4/5/5"),
    ({"x": (2, 4)}, "x:1x4/2x4/2x4", None,
     "input 'x' dimension 0 is fixed at 2 (2x4), but its shape range 1x4/2x4/2x4 gives 1/2/2"),
    ({"x": (-1, 4)}, "x:1x4/4x4/8x4", 16,
     "input 'x' shape range 1x4/4x4/8x4 allows batch sizes up to 8, below max_batch_size 16"),
    ({"x": (-1, -1)}, None, 8,
     "input 'x' has dynamic dimensions (-1x-1); give its range in shapes (CLI: --shapes x:MIN/OPT/MAX)"),
    ({"x": (-1, 4)}, None, None,
     "input 'x' has dynamic dimensions (-1x4); give its range in shapes (CLI: --shapes x:MIN/OPT/MAX) or set "
     "max_batch_size (CLI: --max-batch-size)"),
    ({"x": (-1, 4)}, None, 0, "max_batch_size is 0; expected a positive integer"),
])
def test_profile_errors(inputs: dict[str, tuple[int, ...]], shapes: str | None, batch: int | None,
                        message: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        resolve_shapes(inputs, parse_shapes(shapes) if shapes else None, batch)
    assert str(info.value) == message
