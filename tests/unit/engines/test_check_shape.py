"""check_shape: the one-comparison path for the usual request agrees with the full rule on every edge."""

from __future__ import annotations

import pytest

from kiln.config.parse import parse_config_text
from kiln.config.validate import validate_config
from kiln.engines.checks import check_shape
from kiln.errors import InvalidArgumentError

SPEC = validate_config(parse_config_text('''
name: "m" backend: "onnxruntime" max_batch_size: 8
input [ { name: "fixed" data_type: TYPE_FP32 dims: [ 3, 4 ] },
        { name: "ragged" data_type: TYPE_FP32 dims: [ -1, 4 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 1 ] } ]
'''), "m", "config.pbtxt", None)


@pytest.mark.parametrize(("name", "shape"), [("fixed", (1, 3, 4)), ("fixed", (8, 3, 4)), ("ragged", (2, 5, 4)),
                                             ("ragged", (1, 1, 4))])
def test_shapes_that_fit_pass(name: str, shape: tuple[int, ...]) -> None:
    check_shape(SPEC, SPEC.input(name), shape)


@pytest.mark.parametrize(("name", "shape", "message"), [
    ("fixed", (0, 3, 4), "batch size 0; expected 1..8"),
    ("fixed", (9, 3, 4), "batch size 9; expected 1..8"),
    ("fixed", (-1, 3, 4), "batch size -1; expected 1..8"),
    ("fixed", (1, 3, 5), "has shape [1, 3, 5]"),
    ("fixed", (3, 4), "has shape [3, 4]"),
    ("ragged", (1, -1, 4), "has shape [1, -1, 4]"),
    ("ragged", (1, -2, 4), "has shape [1, -2, 4]"),
])
def test_shapes_that_do_not_fit_name_the_input(name: str, shape: tuple[int, ...], message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message.replace("[", r"\[").replace("]", r"\]")) as caught:
        check_shape(SPEC, SPEC.input(name), shape)
    assert f"input '{name}'" in str(caught.value)
