"""kiln on a Ray cluster: ``serve run kiln.cluster:app model_repository=PATH`` (or ``kiln cluster serve``) runs a
Ray Serve application whose replicas each serve the repository with kiln's Triton-compatible HTTP app. Needs the
``ray`` extra (``pip install 'kiln[ray]'``); see docs/cluster.md."""

from kiln.cluster.application import app, build_application
from kiln.cluster.options import ClusterOptions

__all__ = ["ClusterOptions", "app", "build_application"]
