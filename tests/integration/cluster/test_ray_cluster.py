"""kiln on a real two-node Ray cluster started on this machine (a head and a worker node, one CPU each), the
application run by `kiln cluster serve` with two replicas (one lands on each node), driven by the official
tritonclient. The cluster starts once for the module; `ray stop` always runs at the end."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil
import pytest

import kiln

ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install -e '.[ray]')")
serve = pytest.importorskip("ray.serve", reason="the ray extra is not installed (pip install -e '.[ray]')")
tritonhttp = pytest.importorskip("tritonclient.http")
tritongrpc = pytest.importorskip("tritonclient.grpc")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from kiln import Server, ServerOptions  # noqa: E402
from kiln.capture import export_samples  # noqa: E402
from kiln.cluster import build_application  # noqa: E402
from kiln.cluster.application import build_applications, start_with_fallback  # noqa: E402
from kiln.cluster.ingress import ingress_environment  # noqa: E402
from kiln.cluster.metrics import merge_expositions, with_label  # noqa: E402
from kiln.cluster.options import ClusterOptions, replica_gpus  # noqa: E402
from kiln.cluster.stats import PUBLISH_INTERVAL_S, sum_documents  # noqa: E402
from kiln.demo import build_demo_repository  # noqa: E402
from kiln.demo.models import build_mlp  # noqa: E402
from kiln.edge import EdgeRunner, Policy  # noqa: E402
from kiln.edge.capture import EdgeCapture  # noqa: E402
from kiln.edge.sync import HttpSyncSource, ModelSync, SyncOptions  # noqa: E402
from kiln.errors import InvalidArgumentError  # noqa: E402
from kiln.serve_process import KilnProcess, kiln_serve, wait_ready  # noqa: E402

SRC = Path(__file__).resolve().parents[3] / "src"
APP = "kiln"
REPLICA_PREFIX = f"SERVE_REPLICA::{APP}#{APP}#"
CAPTURES = "captures"  # the cluster's --capture-dir, beside its repository
API_KEY = "cluster-s3cret"  # the cluster's --api-key


@dataclass(frozen=True)
class RayCluster:
    address: str  # the head's GCS, HOST:PORT
    http_url: str  # Serve's proxy, as tritonclient takes it
    grpc_url: str  # Serve's gRPC proxy
    repository: Path
    process: subprocess.Popen[bytes]  # kiln cluster serve


def _haproxies() -> set[int]:
    return {p.pid for p in psutil.process_iter(["name"]) if p.info["name"] == "haproxy"}


def _quiet_ports(count: int) -> list[int]:
    """Free ports the kernel does not hand out on its own: below its ephemeral range and above Ray's worker ports
    (10002-19999). Between picking the cluster's ports and Serve binding them, `ray start` runs for half a minute,
    and Ray's processes bind and connect from ephemeral ports meanwhile: one took HAProxy's gRPC port once."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
            ephemeral_low = int(ports.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    free = []
    for port in random.sample(range(20000, max(ephemeral_low, 20000 + 4 * count)), 4 * count):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        free.append(port)
        if len(free) == count:
            return free
    raise RuntimeError(f"fewer than {count} free ports between 20000 and {ephemeral_low}")


def _ray(*args: str, env: dict[str, str]) -> None:
    ray_cli = Path(sys.executable).parent / "ray"
    subprocess.run([str(ray_cli), *args], env=env, check=True, capture_output=True, timeout=120)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayCluster]:
    repository = tmp_path_factory.mktemp("cluster") / "repository"
    build_demo_repository(repository)
    # Ray's socket paths must stay under the OS's limit: a short folder of its own, not pytest's deep one.
    temp = tempfile.mkdtemp(prefix="kr", dir="/tmp")
    head_port, http_port, grpc_port, haproxy_metrics_port, stats_port = _quiet_ports(5)
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0",
           "PYTHONPATH": os.pathsep.join([str(SRC), *filter(None, [os.environ.get("PYTHONPATH")])]),
           # HAProxy's own metrics and stats ports, away from those of any other Serve on this machine.
           "RAY_SERVE_HAPROXY_METRICS_PORT": str(haproxy_metrics_port), "RAY_SERVE_HAPROXY_STATS_PORT": str(stats_port),
           # As docs/cluster.md says to start a cluster: every Serve process, whoever deploys to it, with them.
           **ingress_environment("haproxy"),
           # Replicas report their load for autoscaling each second, not every 10 s, so the scale-up test is quick.
           "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "1"}
    haproxies_before = _haproxies()
    address = f"127.0.0.1:{head_port}"
    process = None
    try:
        _ray("start", "--head", "--port", str(head_port), "--num-cpus", "1", "--resources", '{"head": 1}',
             "--temp-dir", temp, "--include-dashboard", "false", "--disable-usage-stats", env=env)
        _ray("start", "--address", address, "--num-cpus", "1", "--resources", '{"worker": 1}',
             "--disable-usage-stats", env=env)
        process = subprocess.Popen(
            [sys.executable, "-m", "kiln.cli", "cluster", "serve", "--address", address, "--model-repository",
             str(repository), "--replicas", "2", "--http-host", "127.0.0.1", "--http-port", str(http_port),
             "--grpc-port", str(grpc_port), "--repository-poll-secs", "0.5", "--allow-model-download",
             "--capture-dir", str(repository.parent / CAPTURES), "--api-key", API_KEY],
            env=env)
        wait_ready(f"127.0.0.1:{http_port}", process, timeout_s=180)
        ray.init(address=address, logging_level="WARNING", log_to_driver=False)
        yield RayCluster(address, f"127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}", repository, process)
    finally:
        if process is not None:
            process.terminate()
            try:
                process.wait(timeout=60)  # the replicas drain a few seconds before the application is gone
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=30)
        ray.shutdown()
        subprocess.run([str(Path(sys.executable).parent / "ray"), "stop", "--force"], env=env, capture_output=True,
                       timeout=120)
        for orphan in _haproxies() - haproxies_before:  # `ray stop` leaves the HAProxy that Serve started running
            with contextlib.suppress(psutil.NoSuchProcess):
                psutil.Process(orphan).kill()
        shutil.rmtree(temp, ignore_errors=True)
    # SIGTERM is how a process manager stops it: it deletes its application and exits cleanly (a kill leaves -9).
    assert process is None or process.returncode == 0, f"kiln cluster serve exited {process.returncode} on SIGTERM"


@pytest.fixture(scope="module")
def reference(cluster: RayCluster) -> Iterator[KilnProcess]:
    """`kiln serve` over the same repository: what the cluster must answer alike."""
    with kiln_serve([cluster.repository]) as process:
        yield process


@pytest.fixture
def client(cluster: RayCluster) -> Iterator[Any]:
    client = tritonhttp.InferenceServerClient(cluster.http_url, network_timeout=30)
    yield client
    client.close()


def _simple_inputs(binary: bool) -> tuple[list[Any], np.ndarray, np.ndarray]:
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    b = np.ones((1, 16), dtype=np.int32)
    inputs = [tritonhttp.InferInput("INPUT0", [1, 16], "INT32"), tritonhttp.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_data_from_numpy(a, binary_data=binary)
    inputs[1].set_data_from_numpy(b, binary_data=binary)
    return inputs, a + b, a - b


def _infer_simple(client: Any, binary: bool = True) -> None:
    inputs, total, difference = _simple_inputs(binary)
    outputs = [tritonhttp.InferRequestedOutput(name, binary_data=binary) for name in ("OUTPUT0", "OUTPUT1")]
    result = client.infer("simple", inputs, outputs=outputs)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), total)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), difference)


def _infer_simple_once(url: str) -> None:
    own = tritonhttp.InferenceServerClient(url)  # one per thread: a client is not thread-safe
    try:
        _infer_simple(own)
    finally:
        own.close()


def test_two_nodes_each_run_a_replica(cluster: RayCluster) -> None:
    assert len([n for n in ray.nodes() if n["Alive"]]) == 2
    replicas = [name for name in ray.util.list_named_actors(all_namespaces=True) if
                name["name"].startswith(REPLICA_PREFIX)]
    assert len(replicas) == 2
    # Each replica takes one CPU and each node has one: both nodes hold a replica.
    assert ray.available_resources().get("CPU", 0) == 0


def test_health_metadata_and_config_as_kiln_serve(client: Any, reference: KilnProcess) -> None:
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("simple")
    expected = tritonhttp.InferenceServerClient(reference.http_url)
    try:
        assert client.get_server_metadata() == expected.get_server_metadata()
        assert client.get_model_metadata("simple") == expected.get_model_metadata("simple")
        assert client.get_model_config("simple") == expected.get_model_config("simple")
        assert client.get_model_repository_index() == expected.get_model_repository_index()
    finally:
        expected.close()


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_infer_simple(client: Any, binary: bool) -> None:
    _infer_simple(client, binary)


def test_grpc_through_serves_grpc_proxy_as_kiln_serve(cluster: RayCluster, reference: KilnProcess) -> None:
    """tritonclient.grpc against Ray Serve's gRPC proxy (no `application` metadata: one application runs)."""
    client = tritongrpc.InferenceServerClient(cluster.grpc_url)
    expected = tritongrpc.InferenceServerClient(reference.grpc_url)
    try:
        assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("simple")
        assert client.get_model_metadata("simple") == expected.get_model_metadata("simple")
        assert client.get_model_config("simple") == expected.get_model_config("simple")
        a = np.arange(16, dtype=np.int32).reshape(1, 16)
        inputs = [tritongrpc.InferInput("INPUT0", [1, 16], "INT32"), tritongrpc.InferInput("INPUT1", [1, 16], "INT32")]
        inputs[0].set_data_from_numpy(a)
        inputs[1].set_data_from_numpy(a)
        result = client.infer("simple", inputs)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + a)
        errors = []
        for server in (client, expected):
            with pytest.raises(tritongrpc.InferenceServerException) as raised:
                server.infer("nope", inputs)
            errors.append((raised.value.status(), raised.value.message()))
        assert errors[0] == errors[1], errors
    finally:
        client.close()
        expected.close()


@pytest.mark.parametrize("path, body", [
    ("/v2/models/nope/infer", {"inputs": []}),
    ("/v2/models/simple/infer", {"inputs": [{"name": "INPUT0", "shape": [1, 3], "datatype": "INT32",
                                             "data": [1, 2, 3]}]}),
    ("/v2/models/simple/infer", {"inputs": "not a list"}),
    ("/v2/models/simple/versions/7/stats", None),
], ids=["unknown-model", "wrong-shape", "malformed", "unknown-version-stats"])
def test_errors_are_those_of_kiln_serve(cluster: RayCluster, reference: KilnProcess, path: str,
                                        body: dict[str, Any] | None) -> None:
    def ask(url: str) -> httpx.Response:
        if body is None:
            return httpx.get(f"http://{url}{path}", timeout=30)
        return httpx.post(f"http://{url}{path}", json=body, timeout=30)

    got, expected = ask(cluster.http_url), ask(reference.http_url)
    assert got.status_code == expected.status_code >= 400
    assert got.json() == expected.json()


def test_statistics_sum_across_replicas(cluster: RayCluster, client: Any) -> None:
    def count() -> int:
        return int(client.get_inference_statistics("simple")["model_stats"][0]["inference_count"])

    def settled_count() -> int:
        # Every replica's counts published since the earlier tests' requests: reads a publish interval apart agree.
        previous, current = -1, count()
        while current != previous:
            time.sleep(PUBLISH_INTERVAL_S + 0.3)
            previous, current = current, count()
        return current

    before = settled_count()
    # Concurrent requests spread over both replicas (Serve routes to the less loaded of two).
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(_infer_simple_once, [cluster.http_url] * 80))
    deadline = time.monotonic() + 5  # the other replica publishes its counts every second
    while count() != before + 80 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert count() == before + 80
    # gRPC's statistics are the same sums.
    grpc_client = tritongrpc.InferenceServerClient(cluster.grpc_url)
    try:
        for _ in range(4):  # whichever replica answers
            answer = grpc_client.get_inference_statistics("simple", as_json=True)["model_stats"][0]
            assert int(answer["inference_count"]) == before + 80
    finally:
        grpc_client.close()
    # The sum is over both replicas: each served some of them.
    board = serve.get_deployment_handle(f"{APP}-stats", app_name=APP)
    served = board.inferences_by_replica.remote().result(timeout_s=30)
    assert len(served) == 2 and all(count > 0 for count in served.values()), served


def test_metrics_of_every_replica_at_the_proxy_labelled_by_replica(cluster: RayCluster) -> None:
    """Once both replicas served `simple`: one scrape at the cluster's door has every replica's nv_* series, told
    apart by a replica label naming its Ray actor; the exposition parses as Prometheus text. (HAProxy sends a
    request to the replica with the fewest open requests, so bursts of concurrent ones reach both.)"""
    replica_ids = {name[len(REPLICA_PREFIX):] for name in _replicas()}

    deadline = time.monotonic() + 30  # every replica publishes its metrics each second
    while True:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            list(pool.map(_infer_simple_once, [cluster.http_url] * 40))
        response = httpx.get(f"http://{cluster.http_url}/metrics", timeout=30)
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
        families = {f.name: f for f in text_string_to_metric_families(response.text)}
        success = {s.labels["replica"]: s.value for s in families["nv_inference_request_success"].samples
                   if s.labels["model"] == "simple"}
        if (set(success) == replica_ids and all(count > 0 for count in success.values())) or \
                time.monotonic() > deadline:
            break
        time.sleep(1.3)
    assert set(success) == replica_ids and len(replica_ids) == 2, (success, replica_ids)
    assert all(count > 0 for count in success.values()), success
    assert families["nv_inference_request_success"].type == "counter"


def test_merged_metrics_keep_one_header_per_family_and_label_every_sample() -> None:
    one = '# HELP c Requests\n# TYPE c counter\nc{model="m"} 1.0\n# HELP g A gauge\n# TYPE g gauge\ng 2.0\n'
    two = '# HELP c Requests\n# TYPE c counter\nc{model="m"} 3.0\n'
    assert merge_expositions({"r2": two, "r1": one}).splitlines() == [
        "# HELP c Requests", "# TYPE c counter", 'c{replica="r1",model="m"} 1.0', 'c{replica="r2",model="m"} 3.0',
        "# HELP g A gauge", "# TYPE g gauge", 'g{replica="r1"} 2.0']
    assert with_label('x{} 1', "replica", 'a"b') == 'x{replica="a\\"b"} 1'


def test_sum_documents_adds_counts_and_merges_batch_sizes() -> None:
    def entry(count: int, last: int, sizes: list[int]) -> dict[str, Any]:
        return {"name": "m", "version": "1", "last_inference": last, "inference_count": count,
                "inference_stats": {"success": {"count": count, "ns": 10 * count}},
                "batch_stats": [{"batch_size": s, "compute_infer": {"count": 1, "ns": 5}} for s in sizes]}

    (total,) = sum_documents([[entry(2, 100, [1])], [entry(3, 50, [1, 4])]])
    assert total["inference_count"] == 5 and total["last_inference"] == 100
    assert total["inference_stats"]["success"] == {"count": 5, "ns": 50}
    assert total["batch_stats"] == [{"batch_size": 1, "compute_infer": {"count": 2, "ns": 10}},
                                    {"batch_size": 4, "compute_infer": {"count": 1, "ns": 5}}]


class _Load:
    """Clients sending `simple` requests back to back from threads, counting answers and failures."""

    def __init__(self, url: str, threads: int) -> None:
        self.ok = self.failed = 0
        self.failed_at: list[float] = []  # time.monotonic() of each failure
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(url,)) for _ in range(threads)]
        for thread in self._threads:
            thread.start()

    def _run(self, url: str) -> None:
        client = tritonhttp.InferenceServerClient(url, network_timeout=30)
        try:
            while not self._stop.is_set():
                try:
                    _infer_simple(client)
                    self.ok += 1
                except Exception:
                    self.failed += 1
                    self.failed_at.append(time.monotonic())
        finally:
            client.close()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()


def _replicas() -> dict[str, str]:
    return {n["name"]: n["namespace"] for n in ray.util.list_named_actors(all_namespaces=True)
            if n["name"].startswith(REPLICA_PREFIX)}


def test_a_killed_replica_under_load_fails_only_the_requests_in_flight(cluster: RayCluster) -> None:
    """Through the HAProxy ingress a killed replica fails at most the requests inside it (HAProxy resends those the
    replica dropped before answering; docs/cluster.md has the measurements); after 5 s the other replica answers
    everything."""
    threads = 2  # at most this many requests are in flight at once
    load = _Load(cluster.http_url, threads)
    try:
        time.sleep(1)
        victim, namespace = next(iter(_replicas().items()))
        ray.kill(ray.get_actor(victim, namespace=namespace), no_restart=True)
        killed, ok_at_kill = time.monotonic(), load.ok
        while load.ok == ok_at_kill and time.monotonic() - killed < 10:
            time.sleep(0.05)
        answering_after_s = time.monotonic() - killed
        time.sleep(max(0.0, 10 - answering_after_s))
    finally:
        load.stop()  # a request that was inside the killed replica may still be waiting for its timeout here
    print(f"killed replica: {load.failed} failed, answering again after {answering_after_s:.2f} s, "
          f"{load.ok - ok_at_kill} answered since")
    assert load.ok > ok_at_kill and answering_after_s < 10, "the cluster did not answer again within 10 s"
    late = [round(t - killed, 2) for t in load.failed_at if t - killed > 5]
    assert not late, f"requests failed {late} s after the kill; the dead replica should be out of rotation by then"
    assert load.failed <= threads, f"{load.failed} requests failed around the kill, more than were in flight"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # Serve starts a new replica in the dead one's place
        replicas = _replicas()
        if len(replicas) == 2 and victim not in replicas:
            return
        time.sleep(0.5)
    pytest.fail(f"no replica replaced {victim} within 60 s")


def _delete_in_background(names: list[str]) -> None:
    """Delete applications without waiting for them to go: each waits out its replicas' graceful shutdown (about
    7 s on a 2-core machine) while later tests run, and the module's `ray stop` ends whatever is left."""
    for name in names:
        serve.delete(name, _blocking=False)


def test_replicas_scale_up_under_load(cluster: RayCluster) -> None:
    """A second application on the same cluster, autoscaling 1..2 replicas on ongoing requests (its replicas ask
    for no CPU: the first application's hold both)."""
    options = ClusterOptions(cluster.repository, name="scaled", route_prefix="/scaled", num_cpus=0, num_replicas=1,
                             min_replicas=1, max_replicas=2, target_ongoing_requests=1, upscale_delay_s=0)
    serve.run(build_application(options), name="scaled", route_prefix="/scaled")
    prefix = "SERVE_REPLICA::scaled#scaled#"

    def replicas() -> int:
        return sum(1 for n in ray.util.list_named_actors(all_namespaces=True) if n["name"].startswith(prefix))

    try:
        assert replicas() == 1
        load, started = _Load(f"{cluster.http_url}/scaled", 4), time.monotonic()
        try:
            deadline = time.monotonic() + 60
            while replicas() < 2:
                assert time.monotonic() < deadline, "no second replica within 60 s of load"
                time.sleep(0.5)
        finally:
            load.stop()
        print(f"scaled to 2 replicas {time.monotonic() - started:.1f} s into the load: {load.ok} answered, "
              f"{load.failed} failed")
        assert load.failed == 0 and load.ok > 0
    finally:
        _delete_in_background(["scaled"])


def _served_versions(client: Any, answers: int) -> set[tuple[str, ...]]:
    """The `simple` versions in ``answers`` metadata answers (each from whichever replica Serve picked)."""
    return {tuple(client.get_model_metadata("simple")["versions"]) for _ in range(answers)}


ROLLING_REQUESTS = 1_000  # at least this many answered across the roll, none failed


def _running_replicas() -> int:
    """The kiln deployment's replicas that Serve counts as running: started, their repository loaded. One that is
    listed but still starting may have read the repository before a version the test publishes next."""
    application = serve.status().applications.get(APP)
    deployment = application.deployments.get(APP) if application is not None else None
    return 0 if deployment is None else int(deployment.replica_states.get("RUNNING", 0))


def test_a_published_version_rolls_over_every_replica_under_load(cluster: RayCluster, client: Any) -> None:
    # After the kill test: wait for both replicas (the replacement one included) to be serving.
    deadline = time.monotonic() + 60
    while _running_replicas() < 2 and time.monotonic() < deadline:
        time.sleep(0.5)
    model = cluster.repository / "simple"
    load = _Load(cluster.http_url, 4)
    try:
        while load.ok < ROLLING_REQUESTS // 4 and not load.failed:  # the roll starts well inside the load
            time.sleep(0.05)
        staging = cluster.repository / ".staging-2"
        shutil.copytree(model / "1", staging)
        staging.rename(model / "2")  # appears whole: a replica's poll never sees half a version
        deadline = time.monotonic() + 30
        while _served_versions(client, 20) != {("2",)}:  # 20 answers: both replicas, but for 1 time in 2**19
            assert time.monotonic() < deadline, "version 2 did not replace version 1 on every replica within 30 s"
            time.sleep(0.2)
        rolled_at = load.ok
        # A corrupt version 3: every replica keeps serving version 2.
        (model / "3").mkdir()
        (model / "3" / "model.onnx").write_bytes(b"not an onnx model")
        time.sleep(3)  # several polls
        assert _served_versions(client, 20) == {("2",)}
        deadline = time.monotonic() + 60
        while load.ok < ROLLING_REQUESTS and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        load.stop()
    print(f"rolled to version 2 (after {rolled_at} answers) and past a corrupt version 3: {load.ok} answered, "
          f"{load.failed} failed")
    assert load.failed == 0 and load.ok >= ROLLING_REQUESTS


def test_a_replica_starting_after_a_corrupt_version_serves_the_newest_that_loads(cluster: RayCluster) -> None:
    """After the rolling test (version 3 corrupt, version 2 served): a replica starting now (as a replacement or a
    scale-up would) serves version 2, as the running replicas do, instead of failing to start."""
    assert (cluster.repository / "simple" / "3").is_dir(), "runs after the rolling test"
    options = ClusterOptions(cluster.repository, name="late", route_prefix="/late", num_cpus=0)
    serve.run(build_application(options), name="late", route_prefix="/late")
    client = tritonhttp.InferenceServerClient(f"{cluster.http_url}/late", network_timeout=30)
    try:
        assert client.is_model_ready("simple")
        assert client.get_model_metadata("simple")["versions"] == ["2"]
        _infer_simple(client)
    finally:
        client.close()
        _delete_in_background(["late"])


def test_an_edge_forwards_to_the_cluster_and_syncs_a_version_published_there(cluster: RayCluster,
                                                                           tmp_path: Path) -> None:
    """`kiln edge`'s runner with the cluster as its cloud: forwarded requests are answered by the replicas, and
    a version of `mlp` published into the cluster's repository (rolled over by the replicas' polls) reaches the
    edge through the model-file routes (--allow-model-download), any replica answering each download."""
    edge_dir = tmp_path / "edge" / "mlp"
    shutil.copytree(cluster.repository / "mlp", edge_dir)
    x = {"INPUT0": np.random.default_rng(0).standard_normal((1, 64), dtype=np.float32)}
    with EdgeRunner(edge_dir, cluster.http_url, Policy(max_prob_below=1.0)) as edge:  # every request forwarded
        forwarded = [edge.infer(x) for _ in range(4)]
        assert {r.source for r in forwarded} == {"cloud"}, [r.cloud_error for r in forwarded]
        np.testing.assert_allclose(forwarded[0].outputs["OUTPUT0"], forwarded[0].local_outputs["OUTPUT0"],
                                   rtol=1e-4, atol=1e-5)
        staging = cluster.repository / "mlp" / ".publish-2"
        staging.mkdir()
        (staging / "model.onnx").write_bytes(build_mlp(1).SerializeToString())
        staging.rename(cluster.repository / "mlp" / "2")
        source = HttpSyncSource(cluster.http_url, api_key=API_KEY)
        deadline = time.monotonic() + 30
        while {tuple(source.ready_versions("mlp")) for _ in range(6)} != {(2,)}:  # both replicas rolled over
            assert time.monotonic() < deadline, "version 2 of mlp not served by every replica within 30 s"
            time.sleep(0.3)
        sync = ModelSync(edge, source, edge_dir, options=SyncOptions(interval_s=0.5))
        sync.start()
        try:
            deadline = time.monotonic() + 30
            while edge.version != "2":
                assert time.monotonic() < deadline, f"the edge still runs version {edge.version} after 30 s"
                time.sleep(0.2)
        finally:
            sync.close()
        v2 = kiln.load(cluster.repository / "mlp", 2).infer(x)["OUTPUT0"]
        np.testing.assert_allclose(edge.infer(x).local_outputs["OUTPUT0"], v2, rtol=1e-5, atol=1e-6)


def test_an_edge_uploads_its_captured_samples_to_the_cluster(cluster: RayCluster, tmp_path: Path) -> None:
    """`kiln edge --capture`'s uploader with the cluster as its cloud: every sample lands in a replica's own store
    under the shared --capture-dir, and `kiln capture export` over that folder gives each sample once."""
    edge_dir = tmp_path / "edge" / "mlp"
    shutil.copytree(cluster.repository / "mlp", edge_dir)
    rows = np.random.default_rng(1).standard_normal((6, 64), dtype=np.float32)
    runner = EdgeRunner(edge_dir, cluster.http_url, Policy(max_prob_below=1.0))  # every request forwarded
    capture = EdgeCapture(runner, tmp_path / "edge", api_key=API_KEY, edge_id="edge-c", min_backoff_s=0.05,
                          max_backoff_s=0.2).start()
    try:
        assert {runner.infer({"INPUT0": rows[i:i + 1]}).source for i in range(len(rows))} == {"cloud"}
        deadline = time.monotonic() + 30
        while capture.queue.pending():
            assert time.monotonic() < deadline, f"{len(capture.queue.pending())} samples not uploaded in 30 s"
            time.sleep(0.1)
    finally:
        capture.close()
        runner.close()
    assert capture.queue.stats.snapshot()["uploaded"] == len(rows)
    captures = cluster.repository.parent / CAPTURES
    stores = {p.name for p in captures.iterdir()}
    assert stores and all(name.startswith("replica-") for name in stores), stores
    index = export_samples(captures, "mlp", None, tmp_path / "export.npz")
    mine = [s for s in index if s["edge"] == "edge-c"]
    assert len(mine) == len(rows) and len({s["id"] for s in mine}) == len(rows)
    with np.load(tmp_path / "export.npz") as exported:
        inputs = exported["input/INPUT0"][[s["rows"]["input/INPUT0"][0] for s in mine]]
    np.testing.assert_array_equal(inputs[np.argsort(inputs[:, 0])], rows[np.argsort(rows[:, 0])])


def _status(url: str, method: str = "GET", key: str | None = None, data: bytes | None = None,
            headers: dict[str, str] | None = None) -> int:
    request = urllib.request.Request(url, data=data, method=method, headers={
        **(headers or {}), **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code


def test_every_replica_asks_for_the_api_key_on_the_download_and_capture_routes(cluster: RayCluster) -> None:
    """`kiln cluster serve --api-key` reaches every replica (through their environment): the model-file and capture
    routes refuse a request without the key or with another, whichever replica answers, and take one with it."""
    with urllib.request.urlopen(f"http://{cluster.http_url}/v2/models/mlp", timeout=30) as response:
        version = max(json.load(response)["versions"], key=int)  # other tests publish versions
    files = f"http://{cluster.http_url}/v2/kiln/models/mlp/versions/{version}/files"
    capture = f"http://{cluster.http_url}/v2/kiln/models/mlp/versions/{version}/capture"
    for _ in range(6):  # requests spread over both replicas
        assert _status(files) == 401 and _status(files, key="wrong") == 401
        assert _status(files, key=API_KEY) == 200
        assert _status(capture, "POST", data=b"x", headers={"Kiln-Capture-Id": "k"}) == 401
        # With the key the route takes the request and judges the body (not an npz: 400, not 401).
        assert _status(capture, "POST", API_KEY, b"x", {"Kiln-Capture-Id": "k"}) == 400
    assert ClusterOptions(cluster.repository, num_gpus=0, api_key="k").ray_actor_options()["runtime_env"] == {
        "env_vars": {"KILN_API_KEY": "k"}}


SPLIT_MODELS = ("simple", "mlp_pipeline", "mlp_preprocess", "mlp", "mlp_postprocess")


def test_a_repository_split_per_model_places_each_model_on_replicas_of_its_own(cluster: RayCluster,
                                                                              tmp_path: Path) -> None:
    """`--deployment-per-model` on the same cluster (below /split; replicas asking for no CPU, the first
    application's hold both): each model's application answers its V2 routes from replicas holding only that model
    (the ensemble's with its steps), the front answers the server-wide ones with the whole cluster's view."""
    repository = tmp_path / "repository"
    build_demo_repository(repository)
    for folder in repository.iterdir():
        if folder.name not in SPLIT_MODELS:
            shutil.rmtree(folder)
    options = ClusterOptions(repository, name="split", route_prefix="/split", num_cpus=0, per_model=True)
    front, *per_model = build_applications(options)
    assert [(a.name, a.route_prefix) for a in per_model] == [
        (f"split-{m}", f"/split/v2/models/{m}") for m in sorted(SPLIT_MODELS)]
    serve.run(front.application, name=front.name, route_prefix=front.route_prefix)
    serve.run_many([serve.RunTarget(a.application, a.name, a.route_prefix) for a in per_model])
    url = f"{cluster.http_url}/split"
    client = tritonhttp.InferenceServerClient(url, network_timeout=30)
    try:
        raw = np.arange(64, dtype=np.int32).reshape(1, 64)
        for _ in range(3):
            _infer_simple(client)
            request = tritonhttp.InferInput("RAW", [1, 64], "INT32")
            request.set_data_from_numpy(raw)
            assert client.infer("mlp_pipeline", [request]).as_numpy("PROBS").shape == (1, 10)
        assert client.get_model_config("simple")["name"] == "simple" and client.is_model_ready("mlp")
        assert client.get_model_metadata("simple", "1")["versions"] == ["1"]  # the model's exact path, versions
        assert client.get_model_metadata("mlp_pipeline")["name"] == "mlp_pipeline"
        # The front is ready once every model's replicas reported (each second); a busy 2-core machine starting six
        # replicas has taken more than 10 s.
        deadline = time.monotonic() + 30
        while not client.is_server_ready():
            assert time.monotonic() < deadline, "the front did not hear of every model's replicas within 30 s"
            time.sleep(0.2)
        with pytest.raises(tritonhttp.InferenceServerException, match="nope"):
            client.get_model_metadata("nope")  # the front holds no model: kiln serve's error for an unknown one
        index = {(e["name"], e["state"]) for e in client.get_model_repository_index()}
        assert index == {(m, "READY") for m in SPLIT_MODELS}
        assert client.get_inference_statistics("simple")["model_stats"][0]["inference_stats"]["success"][
            "count"] == 3
        assert {e["name"] for e in client.get_inference_statistics()["model_stats"]} == set(SPLIT_MODELS)

        expected = sorted([["mlp", "mlp_pipeline", "mlp_postprocess", "mlp_preprocess"], ["mlp"], ["mlp_postprocess"],
                           ["mlp_preprocess"], ["simple"]])
        # Each replica publishes its metrics on its own second, apart from the statistics that made the front
        # ready: one that has not published yet is missing from the merge for a moment.
        deadline = time.monotonic() + 30
        models_by_replica = _models_by_replica(f"http://{url}/metrics")
        while sorted(map(sorted, models_by_replica.values())) != expected and time.monotonic() < deadline:
            time.sleep(0.5)
            models_by_replica = _models_by_replica(f"http://{url}/metrics")
        assert sorted(map(sorted, models_by_replica.values())) == expected, models_by_replica
    finally:
        client.close()
        _delete_in_background([application.name for application in [*per_model, front]])


def _models_by_replica(metrics_url: str) -> dict[str, set[str]]:
    """The models each replica reports a success counter for in the cluster's merged ``/metrics``."""
    models_by_replica: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(httpx.get(metrics_url, timeout=30).text):
        if family.name == "nv_inference_request_success":
            for sample in family.samples:
                models_by_replica.setdefault(sample.labels["replica"], set()).add(sample.labels["model"])
    return models_by_replica


_PY_CONFIG = """name: "py"
backend: "python"
max_batch_size: 0
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
"""
_PY_GOOD = ("class KilnModel:\n    def execute(self, requests):\n"
            "        return [{'OUTPUT0': r.inputs['INPUT0']} for r in requests]\n")
_PY_BROKEN = ("class KilnModel:\n    def initialize(self, args):\n        raise RuntimeError('broken weights')\n\n"
              "    def execute(self, requests):\n        return []\n")


def _py_version(model: Path, version: int, source: str) -> None:
    staging = model / f".publish-{version}"
    staging.mkdir(parents=True)
    (staging / "model.py").write_text(source)
    staging.rename(model / str(version))


def test_a_version_that_fails_in_its_engine_neither_takes_the_model_down_nor_stops_a_replica(tmp_path: Path) -> None:
    """What a replica does, on a real kiln.Server (no Ray needed): a published version whose engine fails to load
    (the config reads fine, initialize() raises) leaves the served one in place; a server starting on that
    repository serves the served one too (start_with_fallback); a good newer version then replaces it."""
    model = tmp_path / "repository" / "py"
    model.mkdir(parents=True)
    (model / "config.pbtxt").write_text(_PY_CONFIG)
    _py_version(model, 1, _PY_GOOD)
    x = np.arange(4, dtype=np.float32)

    def served(server: Server) -> list[str]:
        return server.model_metadata("py").versions

    running = Server(ServerOptions(repositories=[model.parent], control_mode="poll"))
    try:
        assert running.start() == []
        _py_version(model, 2, _PY_BROKEN)
        assert running.poll() == ["py"]
        assert served(running) == ["1"] and running.model_ready("py")
        states = {(e.version, e.state): e.reason for e in running.repository_index()}
        assert ("1", "READY") in states and "broken weights" in states[("2", "UNAVAILABLE")], states
        starting = Server(ServerOptions(repositories=[model.parent], control_mode="poll"))
        try:
            assert start_with_fallback(starting) == []
            assert served(starting) == ["1"]
            np.testing.assert_array_equal(kiln.load(model, 1).infer({"INPUT0": x})["OUTPUT0"], x)
            _py_version(model, 3, _PY_GOOD)
            for server in (running, starting):
                assert server.poll() == ["py"]
                assert served(server) == ["3"]
        finally:
            starting.close()
    finally:
        running.close()
    only_broken = tmp_path / "broken" / "py"  # no version loads: the replica still refuses to start
    only_broken.mkdir(parents=True)
    (only_broken / "config.pbtxt").write_text(_PY_CONFIG)
    _py_version(only_broken, 1, _PY_BROKEN)
    server = Server(ServerOptions(repositories=[only_broken.parent]))
    try:
        assert start_with_fallback(server) == ["py"]
    finally:
        server.close()


def test_builder_arguments_arrive_as_strings_from_serve_run(tmp_path: Path) -> None:
    options = ClusterOptions.from_args({"model_repository": str(tmp_path), "num_replicas": "2", "max_replicas": "4",
                                        "target_ongoing_requests": "8"})
    assert (options.num_replicas, options.max_replicas) == (2, 4)
    assert options.autoscaling_config() == {"min_replicas": 1, "initial_replicas": 2, "max_replicas": 4,
                                            "target_ongoing_requests": 8.0}
    delayed = ClusterOptions.from_args({"model_repository": str(tmp_path), "max_replicas": "2", "upscale_delay_s": "0"})
    assert delayed.autoscaling_config() == {"min_replicas": 1, "initial_replicas": 1, "max_replicas": 2,
                                            "target_ongoing_requests": 2.0, "upscale_delay_s": 0.0}
    assert ClusterOptions.from_args({"model_repository": str(tmp_path)}).autoscaling_config() is None


@pytest.mark.parametrize("args, message", [
    ({"model_repository": "/no/such/folder"}, "model_repository '/no/such/folder' is not a folder"),
    ({}, "kiln.cluster needs model_repository=PATH"),
    ({"model_repository": ".", "replicas": "2"}, "unknown kiln.cluster argument(s) replicas"),
    ({"model_repository": ".", "num_replicas": "two"}, "num_replicas='two' is not a whole number"),
    ({"model_repository": ".", "num_replicas": "0"}, "num_replicas must be at least 1, got 0"),
    ({"model_repository": "tests", "models": "unit, nope,integration"}, "models nope not in the model repository"),
    ({"model_repository": "tests", "models": 5}, "models=5 is not model names"),
], ids=["missing-folder", "no-repository", "unknown-key", "not-a-number", "no-replicas", "unknown-model",
        "models-not-names"])
def test_bad_builder_arguments_are_named(args: dict[str, str], message: str) -> None:
    with pytest.raises(InvalidArgumentError) as raised:
        ClusterOptions.from_args(args)
    assert message in str(raised.value)


def test_replicas_ask_for_the_gpus_of_the_most_demanding_model(tmp_path: Path) -> None:
    def model(name: str, groups: str) -> None:
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.pbtxt").write_text(f'name: "{name}"\nbackend: "onnxruntime"\n{groups}')

    model("cpu", "instance_group [{ kind: KIND_CPU count: 2 }]")
    assert replica_gpus(tmp_path) == 0.0
    model("one", "instance_group [{ kind: KIND_GPU count: 2 }]")
    assert replica_gpus(tmp_path) == 1.0
    model("two", "instance_group [{ kind: KIND_GPU gpus: [0, 1] }, { kind: KIND_CPU }]")
    assert replica_gpus(tmp_path) == 2.0
    # A replica of one model's application (--deployment-per-model) asks for that model's GPUs only.
    assert [replica_gpus(tmp_path, (m,)) for m in ("cpu", "one", "two")] == [0.0, 1.0, 2.0]
    assert ClusterOptions(tmp_path, models=("cpu",)).ray_actor_options()["num_gpus"] == 0.0
    with pytest.raises(InvalidArgumentError, match="does not take models"):
        ClusterOptions(tmp_path, per_model=True, models=("cpu",))
    with pytest.raises(InvalidArgumentError, match="not available with per_model"):
        ClusterOptions(tmp_path, per_model=True, allow_model_download=True)
    assert ClusterOptions.from_args({"model_repository": str(tmp_path), "models": " one , two"}).models == (
        "one", "two")
    assert ClusterOptions(tmp_path, num_gpus=0.5).ray_actor_options() == {"num_cpus": 1.0, "num_gpus": 0.5}


def test_the_haproxy_ingress_settings_fit_the_descriptor_limit_and_keep_the_users_own(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import resource

    from kiln.cluster.ingress import ingress_environment

    monkeypatch.delenv("RAY_SERVE_HAPROXY_MAXCONN", raising=False)
    monkeypatch.setenv("RAY_SERVE_THROUGHPUT_OPTIMIZED", "0")  # the user's own value wins
    monkeypatch.setattr(resource, "getrlimit", lambda which: (1024, 20_000))
    settings = ingress_environment("haproxy")
    assert settings["RAY_SERVE_ENABLE_HA_PROXY"] == "1" and settings["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "0"
    assert int(settings["RAY_SERVE_HAPROXY_MAXCONN"]) * 2.5 + 100 <= 20_000  # HAProxy refused to start at 20,000
    monkeypatch.setattr(resource, "getrlimit", lambda which: (1024, resource.RLIM_INFINITY))
    assert ingress_environment("haproxy")["RAY_SERVE_HAPROXY_MAXCONN"] == "20000"
    assert ingress_environment("proxy") == {"RAY_SERVE_ENABLE_HA_PROXY": "0"}
    with pytest.raises(ValueError, match="haproxy, proxy"):
        ingress_environment("nginx")
