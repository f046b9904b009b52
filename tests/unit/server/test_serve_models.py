"""A server over part of a repository (ServerOptions.serve_models): what a cluster replica of one model's
application holds. It loads, indexes and polls only those models and the models their ensemble steps call."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from kiln.config.repository import restrict, scan_repositories
from kiln.demo import build_demo_repository
from kiln.errors import ModelNotFoundError
from kiln.server import Server, ServerOptions

PIPELINE_STEPS = {"mlp_preprocess", "mlp", "mlp_postprocess"}


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "repository"
    build_demo_repository(root)
    return root


@contextmanager
def _server(repo: Path, **options: object) -> Iterator[Server]:
    server = Server(ServerOptions(repositories=[repo], **options))  # type: ignore[arg-type]
    try:
        yield server
    finally:
        server.close()


def test_an_ensemble_brings_the_models_its_steps_call(repo: Path) -> None:
    assert set(restrict(scan_repositories([repo]), ("mlp_pipeline",)).models) == {"mlp_pipeline", *PIPELINE_STEPS}
    assert set(restrict(scan_repositories([repo]), ("simple", "absent")).models) == {"simple"}
    assert restrict(scan_repositories([repo]), ()).models == {}


def test_a_broken_config_is_kept_for_its_load_to_report(repo: Path) -> None:
    (repo / "simple" / "config.pbtxt").write_text("not a config {")
    assert set(restrict(scan_repositories([repo]), ("simple",)).models) == {"simple"}


def test_a_server_over_part_of_a_repository_loads_and_indexes_only_that_part(repo: Path) -> None:
    with _server(repo, serve_models=("simple",)) as server:
        assert server.start() == []
        assert [e.name for e in server.repository_index()] == ["simple"]
        assert server.model_ready("simple")
        with pytest.raises(ModelNotFoundError):
            server.model_config("mlp")


def test_polling_keeps_to_the_part(repo: Path) -> None:
    with _server(repo, control_mode="poll", serve_models=("simple",)) as server:
        server.start()
        shutil.copytree(repo / "simple", repo / "simple_copy")
        shutil.copytree(repo / "simple" / "1", repo / "simple" / "2")
        assert server.poll() == ["simple"]  # its new version; the new folder is another model's
        assert [e.name for e in server.repository_index()] == ["simple"] * 2


def test_no_model_at_all_is_a_server_with_nothing_loaded(repo: Path) -> None:
    with _server(repo, serve_models=()) as server:
        assert server.start() == []
        assert server.repository_index() == []
        assert server.ready()


def test_a_broken_ensemble_config_published_keeps_its_steps_loaded(repo: Path) -> None:
    """The served ensemble keeps serving past a broken new config (as in kiln serve), so its steps must stay."""
    with _server(repo, control_mode="poll", serve_models=("mlp_pipeline",)) as server:
        assert server.start() == []
        (repo / "mlp_pipeline" / "config.pbtxt").write_text("not a config {")
        server.poll()
        assert all(server.model_ready(name) for name in ("mlp_pipeline", *PIPELINE_STEPS))


def test_explicit_loads_keep_to_the_part(repo: Path) -> None:
    with _server(repo, control_mode="explicit", serve_models=("simple",)) as server:
        server.start()
        server.load_model("simple")
        with pytest.raises(ModelNotFoundError, match="not among the models this server serves"):
            server.load_model("mlp")
