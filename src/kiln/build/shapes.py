"""Shape ranges for engine builders: min/opt/max per input, the CLI's ``--shapes`` form, and profile resolution.

``--shapes input:1x3x224x224/8x3x224x224/32x3x224x224`` gives one input's smallest, tuned-for and largest shape;
several inputs are separated by commas, and a single shape (``input:1x3x224x224``) fixes the input to it. Input
names may contain ``:`` (``input:0``): the last ``:`` of an entry starts its shapes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kiln.errors import InvalidArgumentError

SHAPES_FORM = "NAME:MIN/OPT/MAX, e.g. input:1x3x224x224/8x3x224x224/32x3x224x224 (inputs separated by commas)"


def format_shape(shape: Sequence[int]) -> str:
    """``(1, 3, -1)`` -> ``"1x3x-1"``; a scalar is ``"scalar"``."""
    return "x".join(str(d) for d in shape) if len(shape) else "scalar"


@dataclass(frozen=True)
class ShapeRange:
    """The shapes one input may take: ``min <= opt <= max`` in every dimension. Builders tune for ``opt``."""

    min: tuple[int, ...]
    opt: tuple[int, ...]
    max: tuple[int, ...]

    def __post_init__(self) -> None:
        problem = _range_problem(self.min, self.opt, self.max)
        if problem:
            raise InvalidArgumentError(f"shape range {self.format()}: {problem}")

    @classmethod
    def fixed(cls, shape: Sequence[int]) -> ShapeRange:
        return cls(tuple(shape), tuple(shape), tuple(shape))

    def contains(self, shape: Sequence[int]) -> bool:
        return len(shape) == len(self.min) and all(
            lo <= d <= hi for lo, d, hi in zip(self.min, shape, self.max, strict=True))

    def format(self) -> str:
        return "/".join(format_shape(s) for s in (self.min, self.opt, self.max))


def _range_problem(low: tuple[int, ...], opt: tuple[int, ...], high: tuple[int, ...]) -> str:
    ranks = (len(low), len(opt), len(high))
    if len(set(ranks)) != 1:
        return (f"min, opt and max have different ranks {ranks}; every shape of one input needs the same number "
                f"of dimensions")
    for index, (lo, mid, hi) in enumerate(zip(low, opt, high, strict=True)):
        if min(lo, mid, hi) < 1:
            return f"dimension {index} is {lo}/{mid}/{hi}; every dimension must be a positive integer"
        if not lo <= mid <= hi:
            return f"dimension {index} is {lo}/{mid}/{hi}; expected min <= opt <= max"
    return ""


def parse_shapes(text: str, option: str = "--shapes") -> dict[str, ShapeRange]:
    """Parse ``NAME:MIN/OPT/MAX[,NAME:...]``; errors name ``option``, the entry and what was expected."""
    if not text.strip():
        raise InvalidArgumentError(f"{option} is empty; expected {SHAPES_FORM}")
    ranges: dict[str, ShapeRange] = {}
    for entry in (part.strip() for part in text.split(",")):
        if not entry:
            raise InvalidArgumentError(f"{option} '{text}' has an empty entry (two commas in a row or a trailing "
                                       f"comma); expected {SHAPES_FORM}")
        name, shape_range = _parse_entry(entry, option)
        if name in ranges:
            raise InvalidArgumentError(f"{option} gives input '{name}' twice; give each input one entry")
        ranges[name] = shape_range
    return ranges


def _parse_entry(entry: str, option: str) -> tuple[str, ShapeRange]:
    name, colon, shapes_text = entry.rpartition(":")
    if not colon:
        raise InvalidArgumentError(f"{option} entry '{entry}' has no ':'; expected {SHAPES_FORM}")
    name = name.strip()
    if not name:
        raise InvalidArgumentError(f"{option} entry '{entry}' has no input name before ':'; expected {SHAPES_FORM}")
    parts = shapes_text.split("/")
    if len(parts) not in (1, 3):
        raise InvalidArgumentError(f"{option} entry '{entry}' has {len(parts)} shapes; expected one (a fixed "
                                   f"shape) or three (MIN/OPT/MAX) separated by '/'")
    shapes = [_parse_shape(part.strip(), entry, option) for part in parts]
    low, opt, high = (shapes[0], shapes[0], shapes[0]) if len(shapes) == 1 else shapes
    problem = _range_problem(low, opt, high)
    if problem:
        raise InvalidArgumentError(f"{option} entry '{entry}': {problem}")
    return name, ShapeRange(low, opt, high)


def _parse_shape(text: str, entry: str, option: str) -> tuple[int, ...]:
    if not text:
        raise InvalidArgumentError(f"{option} entry '{entry}' has an empty shape; expected dimensions joined by "
                                   f"'x', e.g. 8x3x224x224")
    dims: list[int] = []
    for dim in text.split("x"):
        if not (dim.isascii() and dim.isdigit()) or int(dim) < 1:
            raise InvalidArgumentError(f"{option} entry '{entry}': dimension '{dim}' in '{text}' is not a positive "
                                       f"integer; expected dimensions joined by 'x', e.g. 8x3x224x224")
        dims.append(int(dim))
    return tuple(dims)


def resolve_shapes(inputs: Mapping[str, Sequence[int]], shapes: Mapping[str, ShapeRange] | None = None,
                   max_batch_size: int | None = None) -> dict[str, ShapeRange]:
    """The optimization profile for a network whose ``inputs`` map names to dims (-1 = dynamic).

    Every input with a dynamic dimension gets a range: the one in ``shapes``, or, when only its first (batch)
    dimension is dynamic and ``max_batch_size`` is given, ``1 / max_batch_size / max_batch_size`` (tuned for full
    batches, which a dynamic batcher aims for). Ranges for static inputs must equal their shape and are left out.
    """
    shapes = dict(shapes or {})
    unknown = [name for name in shapes if name not in inputs]
    if unknown:
        raise InvalidArgumentError(f"shapes name input '{unknown[0]}', which the model does not have "
                                   f"(inputs: {', '.join(inputs) or 'none'})")
    if max_batch_size is not None and max_batch_size < 1:
        raise InvalidArgumentError(f"max_batch_size is {max_batch_size}; expected a positive integer")
    profile: dict[str, ShapeRange] = {}
    for name, dims in inputs.items():
        dims = tuple(dims)
        given = shapes.get(name)
        if given is not None:
            _check_against_dims(name, dims, given, max_batch_size)
        elif -1 in dims:
            given = _default_range(name, dims, max_batch_size)
        if given is not None and -1 in dims:
            profile[name] = given
    return profile


def _check_against_dims(name: str, dims: tuple[int, ...], given: ShapeRange, max_batch_size: int | None) -> None:
    if len(given.min) != len(dims):
        raise InvalidArgumentError(f"input '{name}' has {len(dims)} dimensions ({format_shape(dims)}), but its shape "
                                   f"range {given.format()} has {len(given.min)}")
    for index, dim in enumerate(dims):
        if dim != -1 and not given.min[index] == given.opt[index] == given.max[index] == dim:
            raise InvalidArgumentError(
                f"input '{name}' dimension {index} is fixed at {dim} ({format_shape(dims)}), but its shape range "
                f"{given.format()} gives {given.min[index]}/{given.opt[index]}/{given.max[index]}")
    if max_batch_size is not None and dims and dims[0] == -1 and given.max[0] < max_batch_size:
        raise InvalidArgumentError(f"input '{name}' shape range {given.format()} allows batch sizes up to "
                                   f"{given.max[0]}, below max_batch_size {max_batch_size}")


def _default_range(name: str, dims: tuple[int, ...], max_batch_size: int | None) -> ShapeRange:
    if dims[0] == -1 and -1 not in dims[1:] and max_batch_size is not None:
        rest = dims[1:]
        return ShapeRange((1, *rest), (max_batch_size, *rest), (max_batch_size, *rest))
    hint = " or set max_batch_size (CLI: --max-batch-size)" if dims[0] == -1 and -1 not in dims[1:] else ""
    raise InvalidArgumentError(f"input '{name}' has dynamic dimensions ({format_shape(dims)}); give its range in "
                               f"shapes (CLI: --shapes {name}:MIN/OPT/MAX){hint}")
