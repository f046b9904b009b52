"""Scan one or more model repository roots for model folders; report names found in more than one root."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kiln.config.parse import read_config
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


def restrict(scan: RepositoryScan, names: tuple[str, ...]) -> RepositoryScan:
    """The part of ``scan`` a server holding only ``names`` sees: those models and, for an ensemble, the models its
    steps call (transitively), as Triton loads an ensemble's steps with it. Names not in the scan are left out."""
    wanted: set[str] = set()
    pending = [n for n in names if n in scan.models or n in scan.duplicates]
    while pending:
        name = pending.pop()
        if name in wanted:
            continue
        wanted.add(name)
        try:
            config = read_config(scan.models[name]) if name in scan.models else None
        except ConfigError:  # the model's load reports it; its steps are unknown
            config = None
        if config is not None:
            pending.extend(s.model_name for s in config.ensemble_scheduling.step
                           if s.model_name in scan.models or s.model_name in scan.duplicates)
    return RepositoryScan(models={n: p for n, p in scan.models.items() if n in wanted},
                          duplicates={n: p for n, p in scan.duplicates.items() if n in wanted})
