"""``kiln cluster serve``: run a model repository as a Ray Serve application on a Ray cluster (docs/cluster.md)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING

from kiln.errors import InvalidArgumentError, UnsupportedError

if TYPE_CHECKING:
    from kiln.cli._arguments import Commands

SERVE_HELP = "serve a model repository from the replicas of a Ray cluster, Triton's HTTP protocol at its door"


def add_command(commands: Commands) -> None:
    cluster = commands.add_parser("cluster", help="run kiln on a Ray cluster (needs kiln[ray])")
    subcommands = cluster.add_subparsers(dest="cluster_command", metavar="{serve}", required=True)
    serve = subcommands.add_parser("serve", help=SERVE_HELP, description=SERVE_HELP)
    serve.add_argument("--address", default="local",
                       help="the Ray cluster (HOST:PORT of its head, or 'auto'); 'local' starts a one-node cluster "
                            "in this process (default)")
    serve.add_argument("--model-repository", type=Path, required=True, help="the model repository, at the same path "
                                                                           "on every node (a shared volume)")
    serve.add_argument("--replicas", type=int, default=1, help="replicas, each holding every model (default 1; the "
                                                              "starting count when autoscaling)")
    serve.add_argument("--min-replicas", type=int, default=None, help="autoscaling: fewest replicas (default 1)")
    serve.add_argument("--max-replicas", type=int, default=None,
                       help="autoscaling on ongoing requests up to this many replicas (default: no autoscaling)")
    serve.add_argument("--target-ongoing-requests", type=float, default=2.0,
                       help="autoscaling: ongoing requests per replica to aim for (default 2)")
    serve.add_argument("--upscale-delay-s", type=float, default=None,
                       help="autoscaling: seconds of load above target before adding a replica (default: Ray's, 30)")
    serve.add_argument("--num-cpus", type=float, default=1.0, help="CPUs each replica asks Ray for (default 1)")
    serve.add_argument("--num-gpus", type=float, default=None,
                       help="GPUs each replica asks Ray for (default: as the repository's KIND_GPU groups ask)")
    serve.add_argument("--repository-poll-secs", type=float, default=None,
                       help="every replica applies repository changes this often, rolling new versions over "
                            "(default: models load once, at start)")
    serve.add_argument("--allow-model-download", action="store_true",
                       help="serve model files to syncing edges (kiln serve's --allow-model-download)")
    serve.add_argument("--capture-dir", type=Path, default=None, metavar="DIR",
                       help="accept samples from edges (kiln serve's --capture-dir): a folder every node shares; each "
                            "replica stores into replica-<id>/ below it, `kiln capture export` merges them")
    serve.add_argument("--capture-max-mb", type=int, default=1024, metavar="MB",
                       help="the most each replica's capture store keeps, oldest samples going first (default 1024)")
    serve.add_argument("--api-key", default=os.environ.get("KILN_API_KEY") or None, metavar="KEY",
                       help="bearer token the model-download and capture routes require, as kiln serve's --api-key "
                            "(default: env KILN_API_KEY); set in the replicas' environment, where a cluster's nodes "
                            "may set KILN_API_KEY themselves instead")
    serve.add_argument("--deployment-per-model", action="store_true",
                       help="one application per model, each replica holding one model (and its ensemble's steps) "
                            "with that model's GPUs, for repositories larger than one replica should hold; a front "
                            "application answers the server-wide routes (docs/cluster.md)")
    serve.add_argument("--name", default="kiln", help="the Ray Serve application's name (default kiln)")
    serve.add_argument("--route-prefix", default="/",
                       help="the path the application answers below (default /); tritonclient takes it in its URL")
    serve.add_argument("--http-host", default="0.0.0.0", help="where Serve's HTTP proxies listen (default 0.0.0.0)")
    serve.add_argument("--http-port", type=int, default=8000, help="the proxies' HTTP port (default 8000)")
    serve.add_argument("--grpc-port", type=int, default=None,
                       help="Triton's gRPC protocol at Serve's gRPC proxies on this port (default: no gRPC)")
    serve.add_argument("--ingress", choices=("haproxy", "proxy"), default="haproxy",  # kiln.cluster.ingress
                       help="haproxy: Ray Serve's HAProxy on every node, straight to the replicas' own HTTP servers "
                            "(default); proxy: Serve's Python proxy actors (docs/cluster.md)")
    serve.set_defaults(run=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    from kiln.cli.serve import configure_logging

    try:
        from kiln.cluster import ClusterOptions
        from kiln.cluster.run import ProxyOptions, serve_cluster
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.partition(".")[0] != "ray":
            raise
        raise UnsupportedError("kiln cluster needs Ray Serve: pip install 'kiln[ray]'") from None

    configure_logging(0, "")
    if args.deployment_per_model and args.grpc_port is not None:
        raise InvalidArgumentError("--grpc-port is not available with --deployment-per-model: Serve's gRPC proxy "
                                   "picks an application by metadata that tritonclient does not send (use HTTP)")
    options = ClusterOptions(args.model_repository, num_replicas=args.replicas, min_replicas=args.min_replicas,
                             max_replicas=args.max_replicas, target_ongoing_requests=args.target_ongoing_requests,
                             upscale_delay_s=args.upscale_delay_s,
                             num_cpus=args.num_cpus, num_gpus=args.num_gpus, name=args.name,
                             repository_poll_secs=args.repository_poll_secs,
                             allow_model_download=args.allow_model_download, capture_dir=args.capture_dir,
                             capture_max_mb=args.capture_max_mb, api_key=args.api_key,
                             route_prefix=args.route_prefix, per_model=args.deployment_per_model)
    return serve_cluster(args.address, options, ProxyOptions(args.http_host, args.http_port, args.grpc_port,
                                                                    args.ingress))
