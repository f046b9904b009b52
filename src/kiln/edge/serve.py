"""Serve a model at the edge (what ``kiln edge`` runs): the runner, its V2 HTTP endpoint, and the model-sync and
capture workers the options ask for."""

from __future__ import annotations

import ssl
from pathlib import Path

from kiln.edge.capture import EdgeCapture
from kiln.edge.options import EdgeOptions
from kiln.edge.runner import EdgeRunner
from kiln.edge.sync import HttpSyncSource, ModelSync, SyncOptions
from kiln.edge.tls import client_context, split_url
from kiln.errors import ConfigError


def serve_edge(options: EdgeOptions) -> None:
    """Load the model and answer on ``options.host:port`` until interrupted; then stop the workers."""
    import uvicorn

    from kiln.edge.http import build_edge_app

    policy = options.policy()
    tls = tls_context(options)
    runner = EdgeRunner(options.model, options.cloud_url, policy, cloud_model=options.cloud_model,
                        cloud_version=options.cloud_version, version=options.model_version,
                        cloud_timeout_s=options.cloud_timeout_s, shadow_workers=options.shadow_workers,
                        shadow_queue=options.shadow_queue, cloud_api_key=options.cloud_api_key)
    sync = capture = None
    try:
        if runner.cloud is not None and tls is not None:
            runner.cloud.use_tls(tls)
        sync = start_sync(options, runner, tls)
        capture = start_capture(options, runner)
        cloud = runner.cloud.url if runner.cloud else "none"
        print(f"kiln edge: model '{runner.name}' ({policy.mode}) on http://{options.host}:{options.port}, cloud "
              f"{cloud}", flush=True)
        uvicorn.run(build_edge_app(runner), host=options.host, port=options.port, log_level="warning",
                    access_log=False)
    finally:
        if sync is not None:
            sync.close()
        if capture is not None:
            capture.close()
        runner.close(wait_for_copies=False)


def tls_context(options: EdgeOptions) -> ssl.SSLContext | None:
    """The SSL context --cloud-ca/--cloud-cert/--cloud-key ask for (None without them); they need an https url."""
    if options.cloud_ca is None and options.cloud_cert is None and options.cloud_key is None:
        return None
    if options.cloud_url is None or split_url(options.cloud_url)[0] != "https":
        raise ConfigError(f"--cloud-ca, --cloud-cert and --cloud-key need an https:// --cloud-url, got "
                          f"'{options.cloud_url}'")
    return client_context(options.cloud_ca, options.cloud_cert, options.cloud_key)


def start_sync(options: EdgeOptions, runner: EdgeRunner, tls: ssl.SSLContext | None = None) -> ModelSync | None:
    """The model-sync watcher the options ask for, started (None when --sync-interval-s is 0)."""
    if options.sync_interval_s <= 0:
        return None
    if options.cloud_url is None:
        raise ConfigError("--sync-interval-s needs --cloud-url (the server to take new versions from)")
    model_dir = options.model_dir or options.model
    if not Path(model_dir).is_dir():
        raise ConfigError(f"--sync-interval-s needs a model folder to write versions into; '{model_dir}' is not a "
                          f"folder (give --model-dir)")
    source = HttpSyncSource(options.cloud_url, api_key=options.cloud_api_key,
                            timeout_s=max(options.cloud_timeout_s, 30.0), tls=tls)
    sync = ModelSync(runner, source, Path(model_dir), model=options.cloud_model,
                     options=SyncOptions(options.sync_interval_s, options.probation_requests))
    sync.start()
    return sync


def start_capture(options: EdgeOptions, runner: EdgeRunner) -> EdgeCapture | None:
    """The capture queue and uploader --capture asks for, started (None without the flag)."""
    if not options.capture:
        return None
    if runner.cloud is None:
        raise ConfigError("--capture needs --cloud-url (the server that stores captured samples)")
    model = Path(options.model)
    model_dir = options.model_dir or (model if model.is_dir() else model.parent)
    return EdgeCapture(runner, Path(model_dir), api_key=options.cloud_api_key).start()
