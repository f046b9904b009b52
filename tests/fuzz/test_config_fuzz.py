"""config.pbtxt text and repository layouts: kiln's parser, repository scan and model-folder reader raise kiln's
typed errors (ConfigError and the rest of the tree) and nothing else."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from _fuzz_cases import ConfigCase, config_case
from _fuzz_drivers import run_config
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.config.parse import parse_config_text
from kiln.errors import ConfigError

from .conftest import FUZZ, unexpected


@settings(FUZZ, max_examples=400)
@given(rng=st.randoms(use_true_random=False))
def test_mutated_configs_and_layouts(tmp_path_factory: pytest.TempPathFactory, rng: random.Random) -> None:
    findings = run_config(config_case(rng), tmp_path_factory.getbasetemp())
    assert not unexpected(findings), unexpected(findings)


@settings(FUZZ, max_examples=300)
@given(text=st.text(alphabet=st.sampled_from(list('{}[]:,"\\ #\n-0123456789.abcdefghijklmnopqrstuvwxyz_\x00\u00e9')),
                    max_size=120))
def test_arbitrary_config_text(text: str) -> None:
    try:
        parse_config_text(text)
    except ConfigError as exc:
        assert "config.pbtxt" in exc.message  # the error names the file


def test_layout_case_runs_the_reader(tmp_path: Path) -> None:
    """A layout case reaches open_model_dir: a config whose only version folder is missing is a ConfigError there,
    and a crash in the reader would be reported."""
    case = ConfigCase("layout", 'backend: "identity"', {"abc": None})
    assert run_config(case, tmp_path) == []


@pytest.mark.parametrize("value", ["99999999999999999999", "-9223372036854775809", "4294967296"])
def test_enum_given_an_out_of_range_integer_is_a_config_error(value: str) -> None:
    """Found by the fuzzer: protobuf's text parser raised a bare ValueError for these."""
    with pytest.raises(ConfigError, match=rf"config.pbtxt: syntax error: Value out of range: {value}"):
        parse_config_text(f'output [ {{ name: "O" data_type: {value} dims: [ 4 ] }} ]')
