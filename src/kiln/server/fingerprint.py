"""Cheap fingerprints of model folders, so polling can tell what changed without loading anything."""

from __future__ import annotations

import hashlib
from pathlib import Path

from kiln.config.parse import CONFIG_FILENAME


def _stat_line(path: Path, root: Path) -> str:
    stat = path.stat()
    return f"{path.relative_to(root)}|{stat.st_size}|{stat.st_mtime_ns}"


def folder_fingerprint(folder: Path) -> str:
    """Names, sizes and modification times of every file below ``folder`` (a version folder)."""
    digest = hashlib.sha256()
    if folder.is_dir():
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            digest.update(_stat_line(path, folder).encode())
    return digest.hexdigest()


def model_fingerprint(model_path: Path) -> str:
    """config.pbtxt's bytes, the top-level files (labels), and every numeric version folder's fingerprint."""
    digest = hashlib.sha256()
    config = model_path / CONFIG_FILENAME
    if config.is_file():
        digest.update(config.read_bytes())
    if not model_path.is_dir():
        return "missing"
    for child in sorted(model_path.iterdir()):
        if child.name.startswith("."):
            continue
        if child.is_file() and child.name != CONFIG_FILENAME:
            digest.update(_stat_line(child, model_path).encode())
        elif child.is_dir():
            digest.update(f"{child.name}:{folder_fingerprint(child)}".encode())
    return digest.hexdigest()
