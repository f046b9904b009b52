"""The model-download extension: listing with checksums, downloads, every path escape, off by default, API key."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from kiln.frontends.http import build_app
from kiln.frontends.http.files import DownloadOptions
from kiln.server.server import Server, ServerOptions
from kiln.testing.repo import onnx_identity_model, write_model

_CONFIG = ('name: "ident"\nbackend: "onnxruntime"\nmax_batch_size: 4\n'
           'input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
           'output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
           'version_policy: { all: {} }\n')
_FILES = "/v2/kiln/models/ident/versions/1/files"


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("files")
    root = base / "repo"
    folder = write_model(root, "ident", onnx_identity_model(), _CONFIG, versions=(1, 2))
    (folder / "1" / "extra").mkdir()
    (folder / "1" / "extra" / "labels.txt").write_text("a\nb\n")
    (folder / "1" / ".hidden").write_text("not served")
    (folder / ".kiln-staging" / "x" / "1").mkdir(parents=True)
    (folder / ".kiln-staging" / "x" / "1" / "model.onnx").write_bytes(b"staged")
    (base / "secret.txt").write_text("outside the repository")
    (folder / "1" / "escape").symlink_to(base / "secret.txt")
    (folder / "1" / "escape_dir").symlink_to(base, target_is_directory=True)
    (folder / "1" / "staged").symlink_to(folder / ".kiln-staging" / "x" / "1" / "model.onnx")
    return root


@pytest.fixture(scope="module")
def server(repo: Path) -> Iterator[Server]:
    instance = Server(ServerOptions(repositories=[repo]))
    instance.start()
    yield instance
    instance.close()


def _client(server: Server, options: DownloadOptions) -> httpx.AsyncClient:
    app = build_app(server, downloads=options)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://kiln")


@pytest.fixture
async def client(server: Server) -> AsyncIterator[httpx.AsyncClient]:
    async with _client(server, DownloadOptions(enabled=True)) as http:
        yield http


async def test_listing_names_every_visible_file_with_size_and_sha256(client: httpx.AsyncClient, repo: Path) -> None:
    response = await client.get(_FILES)
    assert response.status_code == 200, response.text
    listing = response.json()
    assert [entry["path"] for entry in listing] == ["config.pbtxt", "1/extra/labels.txt", "1/model.onnx"]
    for entry in listing:
        data = (repo / "ident" / entry["path"]).read_bytes()
        assert entry["size"] == len(data)
        assert entry["sha256"] == hashlib.sha256(data).hexdigest()


async def test_download_returns_the_bytes_the_listing_describes(client: httpx.AsyncClient, repo: Path) -> None:
    for path in ("config.pbtxt", "1/model.onnx", "1/extra/labels.txt"):
        response = await client.get(f"{_FILES}/{path}")
        assert response.status_code == 200, response.text
        assert response.content == (repo / "ident" / path).read_bytes()
        assert response.headers["content-length"] == str(len(response.content))


@pytest.mark.parametrize("path", [
    "%2E%2E/%2E%2E/secret.txt",  # parent folders
    "1/%2E%2E/%2E%2E/%2E%2E/secret.txt",
    "/etc/passwd",  # absolute
    "1/escape",  # symlink to a file outside the repository
    "1/escape_dir/secret.txt",  # symlinked folder outside the repository
    "1/staged",  # symlink into a hidden staging folder
    "1/.hidden",  # hidden file
    ".kiln-staging/x/1/model.onnx",  # hidden staging folder
    "2/model.onnx",  # another version's file
    "1",  # a folder
    "1%5C..%5C..%5Csecret.txt",  # backslashes
    "1/missing.onnx",
])
async def test_paths_outside_the_version_are_not_found(client: httpx.AsyncClient, path: str) -> None:
    response = await client.get(f"{_FILES}/{path}")
    assert response.status_code == 404, response.text
    assert "is not a file of this version" in response.json()["error"]


async def test_unknown_model_and_bad_names_are_refused(client: httpx.AsyncClient) -> None:
    assert (await client.get("/v2/kiln/models/nope/versions/1/files")).status_code == 404
    assert (await client.get("/v2/kiln/models/ident/versions/7/files")).status_code == 404
    assert (await client.get("/v2/kiln/models/ident/versions/x/files")).status_code == 400
    assert (await client.get("/v2/kiln/models/.kiln-staging/versions/1/files")).status_code == 400


async def test_disabled_by_default_with_a_message_naming_the_flag(server: Server) -> None:
    async with _client(server, DownloadOptions()) as http:
        for path in (_FILES, _FILES + "/1/model.onnx"):
            response = await http.get(path)
            assert response.status_code == 403
            assert "--allow-model-download" in response.json()["error"]


async def test_api_key_is_required_when_set(server: Server) -> None:
    async with _client(server, DownloadOptions(enabled=True, api_key="s3cret")) as http:
        missing = await http.get(_FILES)
        assert missing.status_code == 401
        assert missing.headers["www-authenticate"] == "Bearer"
        wrong = await http.get(_FILES + "/1/model.onnx", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        assert "API key" in wrong.json()["error"]
        good = await http.get(_FILES, headers={"Authorization": "Bearer s3cret"})
        assert good.status_code == 200
        # The V2 protocol routes stay open: the key guards the download extension only.
        assert (await http.get("/v2/health/ready")).status_code == 200


async def test_the_files_listed_are_those_the_server_loaded_not_those_on_disk(tmp_path: Path) -> None:
    # An explicit load with files serves a version staged outside the model's folder: an edge syncing it must get
    # the staged model, not the one still on disk under the same version number.
    write_model(tmp_path / "repo", "ident", onnx_identity_model(), _CONFIG, versions=(1,))
    staged_model = onnx_identity_model(name="staged").SerializeToString()
    server = Server(ServerOptions(repositories=[tmp_path / "repo"], control_mode="explicit"))
    server.start()
    try:
        server.load_model("ident", config='{"backend": "onnxruntime"}', files={"file:1/model.onnx": staged_model})
        async with _client(server, DownloadOptions(enabled=True)) as http:
            listing = (await http.get(_FILES)).json()
            model = next(entry for entry in listing if entry["path"] == "1/model.onnx")
            assert model["sha256"] == hashlib.sha256(staged_model).hexdigest()
            download = await http.get(_FILES + "/1/model.onnx")
            assert download.content == staged_model
    finally:
        server.close()
