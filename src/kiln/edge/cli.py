"""``kiln edge`` (serve a model at the edge with routing to the cloud) and ``kiln edge-calibrate`` (write the
calibration statistics the range checks read): flags and runs.

Flags given on the command line override the same fields of a ``--policy`` file.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import ssl
from pathlib import Path
from typing import Any

from kiln.edge.calibration import load_calibration, write_calibration
from kiln.edge.capture import EdgeCapture
from kiln.edge.policy import MODES, SCORES, Policy, load_hook, load_policy
from kiln.edge.runner import EdgeRunner
from kiln.edge.sync import HttpSyncSource, ModelSync, SyncOptions
from kiln.edge.tls import client_context, split_url
from kiln.errors import ConfigError


def add_edge_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", type=Path, help="a model file (.onnx) or model folder (<repository>/<model>)")
    parser.add_argument("--model-version", type=int, default=None, help="version folder to load (default: newest)")
    parser.add_argument("--cloud-url", default=None, metavar="HOST:PORT",
                        help="KServe V2 HTTP address of the cloud kiln server, host:port or http(s)://host:port "
                             "(needed unless --mode local-only)")
    parser.add_argument("--cloud-ca", type=Path, default=None, metavar="CA",
                        help="https cloud url: verify the server against this CA (default: the system's CAs)")
    parser.add_argument("--cloud-cert", type=Path, default=None, metavar="CERT",
                        help="https cloud url: client certificate for mTLS (PEM)")
    parser.add_argument("--cloud-key", type=Path, default=None, metavar="KEY",
                        help="https cloud url: the private key of --cloud-cert (default: inside the cert file)")
    parser.add_argument("--cloud-model", default=None, help="the model's name on the cloud (default: the same)")
    parser.add_argument("--cloud-version", default="", help="the model version to ask on the cloud (default: the "
                                                            "cloud's choice)")
    parser.add_argument("--cloud-timeout-s", type=float, default=5.0,
                        help="socket timeout of cloud requests: connect and each read (default 5 s)")
    parser.add_argument("--policy", type=Path, default=None, metavar="FILE", help="routing policy JSON file")
    parser.add_argument("--mode", choices=MODES, default=None, help="default: cloud-fallback")
    parser.add_argument("--output", default=None, help="classifier output to judge (default: first 2-D float one)")
    parser.add_argument("--scores", choices=SCORES, default=None,
                        help="how to read the classifier output (default auto: softmax unless rows are already "
                             "distributions)")
    parser.add_argument("--max-prob-below", type=float, default=None, help="forward when max probability < P")
    parser.add_argument("--margin-below", type=float, default=None, help="forward when top-1 minus top-2 < M")
    parser.add_argument("--entropy-above", type=float, default=None, help="forward when entropy (nats) > H")
    parser.add_argument("--input-bounds", action="append", default=None, metavar="NAME:MIN,MAX",
                        help="forward when an element of input NAME lies outside [MIN, MAX] (repeatable)")
    parser.add_argument("--calibration", type=Path, default=None, metavar="STATS.npz",
                        help="calibration statistics (kiln edge-calibrate)")
    parser.add_argument("--max-distance", type=float, default=None,
                        help="forward when a row's RMS z-score from the calibration statistics exceeds D")
    parser.add_argument("--calibrated-range", action="store_true", default=None,
                        help="forward when a feature lies outside the calibration samples' min/max")
    parser.add_argument("--hook", default=None, metavar="MODULE:FUNCTION",
                        help="hook(inputs, outputs) returning a reason to forward, or None")
    parser.add_argument("--no-forward-on-error", dest="forward_on_error", action="store_false", default=None,
                        help="let a local engine failure fail the request instead of asking the cloud")
    parser.add_argument("--shadow-workers", type=int, default=2, help="threads sending shadow copies (default 2)")
    parser.add_argument("--shadow-queue", type=int, default=64,
                        help="shadow copies waiting at most; more are dropped and counted (default 64)")
    parser.add_argument("--sync-interval-s", type=float, default=0.0,
                        help="poll the cloud for a newer version of the model every S seconds (0 = off; needs "
                             "kiln serve --allow-model-download on the cloud)")
    parser.add_argument("--cloud-api-key", default=os.environ.get("KILN_API_KEY"), metavar="KEY",
                        help="API key sent to the cloud as a bearer token (default: env KILN_API_KEY)")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="model folder that receives synced versions (default: the model folder given)")
    parser.add_argument("--probation-requests", type=int, default=20,
                        help="a synced version's first N local runs; an engine error among them rolls it back")
    parser.add_argument("--capture", action="store_true",
                        help="keep forwarded requests (inputs, local and cloud outputs, reason) in "
                             "<model-dir>/.kiln-capture-queue and upload them to the cloud's capture store "
                             "(needs kiln serve --capture-dir on the cloud)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")


def policy_from_args(args: argparse.Namespace) -> Policy:
    policy = load_policy(args.policy) if args.policy is not None else Policy()
    changes: dict[str, Any] = {}
    for name in ("mode", "output", "scores", "max_prob_below", "margin_below", "entropy_above", "max_distance",
                 "calibrated_range", "forward_on_error"):
        if getattr(args, name) is not None:
            changes[name] = getattr(args, name)
    if args.input_bounds:
        changes["input_bounds"] = {**policy.input_bounds, **dict(parse_bounds(text) for text in args.input_bounds)}
    if args.calibration is not None:
        changes["calibration"] = load_calibration(args.calibration)
    if args.hook is not None:
        changes["hook"] = load_hook(args.hook)
    return dataclasses.replace(policy, **changes)


def parse_bounds(text: str) -> tuple[str, tuple[float, float]]:
    name, sep, pair = text.rpartition(":")
    parts = pair.split(",")
    try:
        if not sep or not name or len(parts) != 2:
            raise ValueError
        return name, (float(parts[0]), float(parts[1]))
    except ValueError:
        raise ConfigError(f"--input-bounds '{text}' is not of the form NAME:MIN,MAX") from None


def run_edge(args: argparse.Namespace) -> int:
    import uvicorn

    from kiln.edge.http import build_edge_app

    policy = policy_from_args(args)
    tls = tls_from_args(args)
    runner = EdgeRunner(args.model, args.cloud_url, policy, cloud_model=args.cloud_model,
                        cloud_version=args.cloud_version, version=args.model_version,
                        cloud_timeout_s=args.cloud_timeout_s, shadow_workers=args.shadow_workers,
                        shadow_queue=args.shadow_queue, cloud_api_key=args.cloud_api_key)
    sync = capture = None
    try:
        if runner.cloud is not None and tls is not None:
            runner.cloud.use_tls(tls)
        sync = start_sync(args, runner, tls)
        capture = start_capture(args, runner)
        cloud = runner.cloud.url if runner.cloud else "none"
        print(f"kiln edge: model '{runner.name}' ({policy.mode}) on http://{args.host}:{args.port}, cloud {cloud}",
              flush=True)
        uvicorn.run(build_edge_app(runner), host=args.host, port=args.port, log_level="warning", access_log=False)
    finally:
        if sync is not None:
            sync.close()
        if capture is not None:
            capture.close()
        runner.close(wait_for_copies=False)
    return 0


def tls_from_args(args: argparse.Namespace) -> ssl.SSLContext | None:
    """The SSL context --cloud-ca/--cloud-cert/--cloud-key ask for (None without them); they need an https url."""
    if args.cloud_ca is None and args.cloud_cert is None and args.cloud_key is None:
        return None
    if args.cloud_url is None or split_url(args.cloud_url)[0] != "https":
        raise ConfigError(f"--cloud-ca, --cloud-cert and --cloud-key need an https:// --cloud-url, got "
                          f"'{args.cloud_url}'")
    return client_context(args.cloud_ca, args.cloud_cert, args.cloud_key)


def start_sync(args: argparse.Namespace, runner: EdgeRunner, tls: ssl.SSLContext | None = None) -> ModelSync | None:
    """The model-sync watcher the flags ask for, started (None when --sync-interval-s is 0)."""
    if args.sync_interval_s <= 0:
        return None
    if args.cloud_url is None:
        raise ConfigError("--sync-interval-s needs --cloud-url (the server to take new versions from)")
    model_dir = args.model_dir or args.model
    if not Path(model_dir).is_dir():
        raise ConfigError(f"--sync-interval-s needs a model folder to write versions into; '{model_dir}' is not a "
                          f"folder (give --model-dir)")
    source = HttpSyncSource(args.cloud_url, api_key=args.cloud_api_key, timeout_s=max(args.cloud_timeout_s, 30.0),
                            tls=tls)
    sync = ModelSync(runner, source, Path(model_dir), model=args.cloud_model,
                     options=SyncOptions(args.sync_interval_s, args.probation_requests))
    sync.start()
    return sync


def start_capture(args: argparse.Namespace, runner: EdgeRunner) -> EdgeCapture | None:
    """The capture queue and uploader --capture asks for, started (None without the flag)."""
    if not args.capture:
        return None
    if runner.cloud is None:
        raise ConfigError("--capture needs --cloud-url (the server that stores captured samples)")
    model_dir = args.model_dir or (args.model if Path(args.model).is_dir() else Path(args.model).parent)
    return EdgeCapture(runner, Path(model_dir), api_key=args.cloud_api_key).start()


def add_calibrate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("samples", type=Path, help="an .npz of samples: one array per input, samples first")
    parser.add_argument("--output", "-o", type=Path, required=True, metavar="STATS.npz",
                        help="where to write the statistics")


def run_calibrate(args: argparse.Namespace) -> int:
    stats = write_calibration(args.samples, args.output)
    for name, s in stats.inputs.items():
        print(f"{name}: {s.mean.size} features, mean {s.mean.mean():.4g}, std {s.std.mean():.4g}, "
              f"range [{s.minimum.min():.4g}, {s.maximum.max():.4g}]")
    print(f"wrote {args.output}")
    return 0
