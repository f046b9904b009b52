"""A kiln extension for edges that sync models: the files of a served model version, listed with their sha256
checksums and downloadable one by one.

``GET /v2/kiln/models/{name}/versions/{version}/files`` answers ``[{"path", "size", "sha256"}, ...]`` and
``GET /v2/kiln/models/{name}/versions/{version}/files/{path}`` the bytes of one of them (streamed). Paths are
relative to the model folder: ``config.pbtxt`` and ``<version>/...``. Only a version that is READY is served.

The endpoints are off unless the server was started with ``--allow-model-download`` (403 otherwise). With an API
key set, they answer 401 to a request without ``Authorization: Bearer <key>``. A path is served only when it names
a regular file inside the version folder (or the model's config.pbtxt): never ``..``, an absolute path, a hidden
file or folder (staging folders start with a dot), or a symlink whose target leaves the repository.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from kiln.config.parse import CONFIG_FILENAME
from kiln.errors import InvalidArgumentError, ModelNotFoundError, PermissionDeniedError
from kiln.frontends.http.auth import require_key
from kiln.server.server import Server
from kiln.server.staging import check_model_name
from kiln.v2 import http_codec as codec

CHUNK_BYTES = 1 << 20
DISABLED = ("model download is disabled on this server: start it with 'kiln serve --allow-model-download' to let "
            "edges fetch model files")


@dataclass(frozen=True)
class DownloadOptions:
    """``enabled``: serve model files at all; ``api_key``: the bearer token the endpoints require (None: none)."""

    enabled: bool = False
    api_key: str | None = None


@dataclass(frozen=True)
class FileEntry:
    path: str  # relative to the model folder, with '/'
    size: int
    sha256: str


class FileEndpoints:
    def __init__(self, server: Server, options: DownloadOptions) -> None:
        self.server = server
        self.options = options

    async def list_files(self, request: Request) -> Response:
        self._check_access(request)
        model, version = self._version(request)
        entries = await asyncio.to_thread(list_version_files, model, version)
        doc = [{"path": e.path, "size": e.size, "sha256": e.sha256} for e in entries]
        return Response(codec.encode_json(doc), media_type=codec.JSON_TYPE)

    async def download(self, request: Request) -> Response:
        self._check_access(request)
        model, version = self._version(request)
        path = resolve_file(model, version, request.path_params["path"])
        return StreamingResponse(_chunks(path), media_type="application/octet-stream",
                                 headers={"Content-Length": str(path.stat().st_size)})

    def _check_access(self, request: Request) -> None:
        if not self.options.enabled:
            raise PermissionDeniedError(DISABLED)
        require_key(request.headers, self.options.api_key, "model download")

    def _version(self, request: Request) -> tuple[Path, str]:
        """The model folder and version of a READY version, from the path parameters."""
        name, version = request.path_params["model"], request.path_params["version"]
        check_model_name(name)
        if not version.isdigit():
            raise InvalidArgumentError(f"model '{name}': version '{version}' is not a number")
        folder = self.server.model_folder(name, version)  # NotFound / NotReady unless this version serves
        if not (folder / version).is_dir():
            raise ModelNotFoundError(f"model '{name}' version {version}: its version folder is gone from {folder}")
        return folder, version


def list_version_files(model: Path, version: str) -> list[FileEntry]:
    """config.pbtxt (when present) and every servable file under ``<model>/<version>/``, sorted by path."""
    candidates = [model / CONFIG_FILENAME] if (model / CONFIG_FILENAME).is_file() else []
    candidates += sorted(_walk(model / version))
    entries: list[FileEntry] = []
    for path in candidates:
        relative = path.relative_to(model).as_posix()
        if _servable(model, version, relative) is not None:
            entries.append(FileEntry(relative, path.stat().st_size, _sha256(path)))
    return entries


def _walk(folder: Path) -> list[Path]:
    """Files under ``folder``, not descending into symlinked folders (a link may loop or leave the repository)."""
    found: list[Path] = []
    for top, _, names in os.walk(folder, followlinks=False):
        found += [Path(top) / name for name in names if (Path(top) / name).is_file()]
    return found


def resolve_file(model: Path, version: str, relative: str) -> Path:
    """The file ``relative`` names, or NotFound for anything outside what the listing serves."""
    path = _servable(model, version, relative)
    if path is None:
        raise ModelNotFoundError(f"model '{model.name}' version {version}: '{relative}' is not a file of this "
                                 f"version (paths are config.pbtxt or {version}/...)")
    return path


def _servable(model: Path, version: str, relative: str) -> Path | None:
    """The resolved file when ``relative`` is config.pbtxt or a plain path under the version folder whose every
    component is visible and whose target stays inside the repository; None otherwise."""
    pure = PurePosixPath(relative)
    parts = pure.parts
    if pure.is_absolute() or "\\" in relative or "\0" in relative or not parts:
        return None
    if any(part in (".", "..") or part.startswith(".") for part in parts):
        return None
    if relative != CONFIG_FILENAME and (len(parts) < 2 or parts[0] != version):
        return None
    repository = model.resolve().parent
    target = (model / relative).resolve()
    if not target.is_file() or not target.is_relative_to(repository):
        return None
    if relative != CONFIG_FILENAME and not target.is_relative_to(model.resolve() / version) \
            and not _inside_other_visible(repository, target):
        return None
    return target


def _inside_other_visible(repository: Path, target: Path) -> bool:
    """A symlink may point at a shared file elsewhere in the repository, never into a hidden folder."""
    return not any(part.startswith(".") for part in target.relative_to(repository).parts)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(CHUNK_BYTES):
            digest.update(block)
    return digest.hexdigest()


def _chunks(path: Path) -> Iterator[bytes]:
    with path.open("rb") as f:
        while block := f.read(CHUNK_BYTES):
            yield block
