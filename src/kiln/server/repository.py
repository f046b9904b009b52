"""Scan one or more repository roots for model folders; report names found in more than one root."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kiln.errors import ConfigError


@dataclass(frozen=True)
class RepositoryScan:
    """Model folders by name. ``duplicates`` maps a name found in several roots to all its folders; such a model
    is not served (Triton makes it unavailable rather than picking one)."""

    models: dict[str, Path] = field(default_factory=dict)
    duplicates: dict[str, list[Path]] = field(default_factory=dict)

    def reason(self, name: str) -> str:
        paths = self.duplicates.get(name, [])
        return f"model '{name}' appears in more than one repository ({', '.join(str(p) for p in paths)})"


def scan_repositories(roots: list[Path]) -> RepositoryScan:
    found: dict[str, list[Path]] = {}
    for root in roots:
        if not root.is_dir():
            raise ConfigError(f"model repository {root} does not exist or is not a folder")
        for child in sorted(root.iterdir()):
            if child.is_dir() and not child.name.startswith("."):
                found.setdefault(child.name, []).append(child)
    models = {name: paths[0] for name, paths in found.items() if len(paths) == 1}
    duplicates = {name: paths for name, paths in found.items() if len(paths) > 1}
    return RepositoryScan(models=models, duplicates=duplicates)
