"""What the Ray Serve application is built from: ``serve run kiln.cluster:app key=value ...`` passes its arguments
as strings, ``kiln cluster serve`` as typed values; both end up in one ClusterOptions."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.config.parse import read_config
from kiln.config.repository import restrict, scan_repositories
from kiln.errors import InvalidArgumentError
from kiln.v2._generated import model_config_pb2 as pb

_KNOWN = ("model_repository", "num_replicas", "min_replicas", "max_replicas", "target_ongoing_requests",
          "num_cpus", "num_gpus", "name", "route_prefix", "repository_poll_secs", "upscale_delay_s",
          "allow_model_download", "capture_dir", "capture_max_mb", "models", "stats_app")
API_KEY_VARIABLE = "KILN_API_KEY"  # as `kiln serve`'s --api-key default
_EXPECTED = {int: "a whole number", float: "a number", str: "text", bool: "true or false"}
_BOOLEANS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


@dataclass(frozen=True)
class ClusterOptions:
    model_repository: Path
    num_replicas: int = 1
    # Autoscaling on ongoing requests (Ray Serve's autoscaler) when max_replicas is set; num_replicas is then the
    # starting count.
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float = 2.0
    upscale_delay_s: float | None = None  # None: Ray Serve's default (30 s of sustained load before adding one)
    num_cpus: float = 1.0
    num_gpus: float | None = None  # None: derived from the repository's instance groups (replica_gpus)
    name: str = "kiln"
    route_prefix: str = "/"
    # Every replica applies repository changes this often (kiln serve's --model-control-mode=poll): a new version
    # published into the shared repository rolls over on every replica. None: models load once, at start.
    repository_poll_secs: float | None = None
    # kiln serve's --allow-model-download: the /v2/kiln/models/.../files routes an edge syncs its model from.
    allow_model_download: bool = False
    # kiln serve's --capture-dir: samples edges upload; each replica keeps its own store (replica-<id>/) below this
    # shared folder, at most capture_max_mb each; `kiln capture export` merges them.
    capture_dir: Path | None = None
    capture_max_mb: int = 1024
    # kiln serve's --api-key for the download and capture routes, set as KILN_API_KEY in the replicas' environment
    # (ray_actor_options). Not a builder argument: `serve run` shows those; clusters set KILN_API_KEY on their
    # nodes instead (a Kubernetes Secret in deploy/kubernetes/rayservice.yaml), and replicas read it from there.
    api_key: str | None = None
    # One application per model (split.py) instead of one for the whole repository; `kiln cluster serve` only, as
    # a builder makes one application.
    per_model: bool = False
    # The models this application's replicas hold (and those their ensembles' steps call); None: all. Set for each
    # application of a split repository; a config file for `serve deploy` sets it per application.
    models: tuple[str, ...] | None = None
    # The application whose statistics board this one reports to (the front of a split repository): its sums and
    # metrics then cover every application. None: a board of its own.
    stats_app: str | None = None

    def __post_init__(self) -> None:
        if not self.model_repository.is_dir():
            raise InvalidArgumentError(f"model_repository '{self.model_repository}' is not a folder")
        if self.num_replicas < 1:
            raise InvalidArgumentError(f"num_replicas must be at least 1, got {self.num_replicas}")
        if self.capture_max_mb < 1:
            raise InvalidArgumentError(f"capture_max_mb must be at least 1, got {self.capture_max_mb}")
        if self.repository_poll_secs is not None and self.repository_poll_secs <= 0:
            raise InvalidArgumentError(f"repository_poll_secs must be positive, got {self.repository_poll_secs}")
        if self.max_replicas is not None and self.max_replicas < max(1, self.min_replicas or 0):
            raise InvalidArgumentError(f"max_replicas ({self.max_replicas}) must be at least 1 and at least "
                                       f"min_replicas ({self.min_replicas})")
        if self.per_model and self.models is not None:
            raise InvalidArgumentError("per_model splits the whole repository; it does not take models")
        if self.per_model and (self.allow_model_download or self.capture_dir is not None):
            raise InvalidArgumentError("allow_model_download and capture_dir are not available with per_model: "
                                       "the front that answers those routes holds no model version")
        if self.models:
            known = set(scan_repositories([self.model_repository]).models)
            unknown = sorted(set(self.models) - known)
            if unknown:
                raise InvalidArgumentError(f"models {', '.join(unknown)} not in the model repository "
                                           f"{self.model_repository} (it has {', '.join(sorted(known)) or 'none'})")

    @classmethod
    def from_args(cls, args: Mapping[str, Any]) -> ClusterOptions:
        """From the builder's arguments (strings from ``serve run``, or typed values); unknown keys are errors."""
        unknown = sorted(set(args) - set(_KNOWN))
        if unknown:
            raise InvalidArgumentError(f"unknown kiln.cluster argument(s) {', '.join(unknown)}; expected some of "
                                       f"{', '.join(_KNOWN)}")
        if "model_repository" not in args:
            raise InvalidArgumentError("kiln.cluster needs model_repository=PATH (a model repository folder)")
        values: dict[str, Any] = {"model_repository": Path(str(args["model_repository"]))}
        if args.get("capture_dir") is not None:
            values["capture_dir"] = Path(str(args["capture_dir"]))
        if args.get("models") is not None:
            values["models"] = _model_names(args["models"])
        for key, kind in (("num_replicas", int), ("min_replicas", int), ("max_replicas", int),
                          ("target_ongoing_requests", float), ("upscale_delay_s", float), ("num_cpus", float),
                          ("num_gpus", float), ("name", str), ("route_prefix", str), ("repository_poll_secs", float),
                          ("allow_model_download", bool), ("capture_max_mb", int), ("stats_app", str)):
            if args.get(key) is not None:
                values[key] = _convert(key, args[key], kind)
        return cls(**values)

    def autoscaling_config(self) -> dict[str, Any] | None:
        if self.max_replicas is None:
            return None
        config: dict[str, Any] = {"min_replicas": self.min_replicas if self.min_replicas is not None else 1,
                                  "initial_replicas": self.num_replicas, "max_replicas": self.max_replicas,
                                  "target_ongoing_requests": self.target_ongoing_requests}
        if self.upscale_delay_s is not None:
            config["upscale_delay_s"] = self.upscale_delay_s
        return config

    def ray_actor_options(self) -> dict[str, Any]:
        gpus = self.num_gpus if self.num_gpus is not None else replica_gpus(self.model_repository, self.models)
        options: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": gpus}
        if self.api_key:
            options["runtime_env"] = {"env_vars": {API_KEY_VARIABLE: self.api_key}}
        return options


def _model_names(value: Any) -> tuple[str, ...]:
    """``models``: "a,b" from `serve run`, or a list from a config file; empty: no model (a split's front)."""
    names = value.split(",") if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise InvalidArgumentError(f"kiln.cluster argument models={value!r} is not model names (\"a,b\" or a list)")
    return tuple(n.strip() for n in names if n.strip())


def _convert(key: str, value: Any, kind: type) -> Any:
    if kind is bool:
        flag = value if isinstance(value, bool) else _BOOLEANS.get(str(value).lower())
        if flag is None:
            raise InvalidArgumentError(f"kiln.cluster argument {key}={value!r} is not {_EXPECTED[kind]}")
        return flag
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"kiln.cluster argument {key}={value!r} is not {_EXPECTED[kind]}") from None


def replica_gpus(repository: Path, models: tuple[str, ...] | None = None) -> float:
    """GPUs one replica asks Ray for: a replica holds every model (or ``models`` and their ensembles' steps), so it
    needs as many devices as the model asking for the most (a KIND_GPU group without ``gpus`` means one device;
    ``gpus: [0, 1]`` means two). KIND_AUTO asks for none: under Ray a process sees only the GPUs it asked for, so
    AUTO falls back to CPU unless num_gpus is given."""
    most = 0
    scan = scan_repositories([repository])
    for folder in (scan if models is None else restrict(scan, models)).models.values():
        config = read_config(folder)
        if config is None:
            continue
        for group in config.instance_group:
            if group.kind == pb.ModelInstanceGroup.KIND_GPU:
                most = max(most, len(set(group.gpus)) or 1)
    return float(most)
