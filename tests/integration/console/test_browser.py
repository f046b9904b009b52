"""The console in headless Chromium (the system's, driven by Playwright; no browser download) against a real
`kiln serve` on the demo repository in explicit model-control mode with an API key.

Set KILN_CONSOLE_SCREENSHOT=PATH to write the page's screenshot there (docs/console.png comes from this test).
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kiln.demo import build_demo_repository
from kiln.testing.serve import KilnProcess, kiln_serve

CHROMIUM = next((found for name in ("chromium", "chromium-browser", "google-chrome")
                 if (found := shutil.which(name))), None)
if CHROMIUM is None:
    pytest.skip("no chromium on PATH: the console's browser tests need headless Chromium (CI installs Debian's)",
                allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright (the dev extra) drives Chromium")
httpclient = pytest.importorskip("tritonclient.http")

KEY = "console-test-key"
DEMO = ("simple", "mlp", "simple_string", "mlp_pipeline")
AB = 'version_policy { all {} }\nparameters { key: "kiln.ab.weights" value { string_value: "1:50,2:50" } }\n'


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnProcess]:
    repo = tmp_path_factory.mktemp("demo")
    build_demo_repository(repo)
    ab = repo / "simple_ab"  # the demo's simple model twice, as versions 1 and 2 under A/B routing
    shutil.copytree(repo / "simple", ab)
    shutil.copytree(ab / "1", ab / "2")
    config = (ab / "config.pbtxt").read_text().replace('name: "simple"', 'name: "simple_ab"')
    (ab / "config.pbtxt").write_text(config + AB)
    with kiln_serve([repo], "--model-control-mode", "explicit", "--load-model", "*", "--api-key", KEY,
                    "--allow-model-download", "--exit-timeout-secs", "5", "--http-workers", "1") as server:
        yield server


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        yield browser
        browser.close()


@pytest.fixture
def page(browser: Any, served: KilnProcess) -> Iterator[Any]:
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    problems: list[str] = []
    page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.goto(f"http://{served.http_url}/console")
    page.problems = problems
    yield page
    page.close()


def _row(page: Any, model: str) -> Any:
    return page.locator(f'#models tr[data-model="{model}"]').first


def test_page_loads_without_errors_and_shows_the_demo_models(page: Any) -> None:
    for model in DEMO:
        sync_api.expect(_row(page, model)).to_contain_text("READY", timeout=5000)
    sync_api.expect(page.locator("#health")).to_contain_text("ready")
    assert page.problems == []


def test_a_tritonclient_request_shows_on_the_page_within_two_seconds(page: Any, served: KilnProcess) -> None:
    sync_api.expect(_row(page, "simple")).to_contain_text("READY", timeout=5000)
    client = httpclient.InferenceServerClient(served.http_url)
    inputs = [httpclient.InferInput(name, [1, 16], "INT32") for name in ("INPUT0", "INPUT1")]
    for tensor in inputs:
        tensor.set_data_from_numpy(np.arange(16, dtype=np.int32).reshape(1, 16))
    for _ in range(5):
        client.infer("simple", inputs)
    p50 = _row(page, "simple").locator('[data-field="p50"]')
    sync_api.expect(p50).not_to_have_text("–", timeout=2000)
    assert float(p50.inner_text()) > 0
    assert page.problems == []
    shot = os.environ.get("KILN_CONSOLE_SCREENSHOT")
    if shot:  # with requests flowing, so the rate column shows them
        stop = threading.Event()

        def traffic() -> None:  # plain HTTP: tritonclient's gevent client stays in the thread that made it
            body = json.dumps({"inputs": [{"name": name, "shape": [1, 16], "datatype": "INT32", "data": list(range(16))}
                                          for name in ("INPUT0", "INPUT1")]}).encode()
            while not stop.is_set():
                urllib.request.urlopen(f"http://{served.http_url}/v2/models/simple/infer", body).read()

        sender = threading.Thread(target=traffic)
        sender.start()
        try:
            page.set_viewport_size({"width": 1100, "height": 620})
            page.wait_for_timeout(2500)
            page.screenshot(path=str(Path(shot)), full_page=False)
        finally:
            stop.set()
            sender.join()


def test_unload_and_load_round_trip_through_the_page(page: Any, served: KilnProcess) -> None:
    row = _row(page, "mlp")
    sync_api.expect(row).to_contain_text("READY", timeout=5000)
    page.fill("#key", KEY)
    page.click("#key-save")
    row.locator('[data-action="unload"]').click()
    sync_api.expect(page.locator("#confirm")).to_be_visible()
    page.click("#confirm-ok")
    sync_api.expect(page.locator("#message")).to_contain_text("Unloaded 'mlp'", timeout=5000)
    sync_api.expect(row).to_contain_text("UNAVAILABLE", timeout=5000)
    assert not httpclient.InferenceServerClient(served.http_url).is_model_ready("mlp")
    row.locator('[data-action="load"]').click()
    page.click("#confirm-ok")
    sync_api.expect(page.locator("#message")).to_contain_text("Loaded 'mlp'", timeout=10000)
    sync_api.expect(row).to_contain_text("READY", timeout=5000)
    assert httpclient.InferenceServerClient(served.http_url).is_model_ready("mlp")
    assert page.problems == []


def test_changing_the_ab_split_through_the_page(page: Any, served: KilnProcess) -> None:
    card = page.locator('[data-ab="simple_ab"]')
    sync_api.expect(card).to_contain_text("config", timeout=5000)
    card.locator('[data-action="split"]').click()
    page.fill('#confirm-extra input[data-version="1"]', "10")
    page.fill('#confirm-extra input[data-version="2"]', "90")
    page.click("#confirm-ok")
    sync_api.expect(page.locator("#message")).to_contain_text("New split of 'simple_ab'", timeout=5000)
    sync_api.expect(card).to_contain_text("runtime", timeout=5000)
    with urllib.request.urlopen(f"http://{served.http_url}/v2/repository/models/simple_ab/kiln/routing") as answer:
        assert json.load(answer)["weights"] == {"1": 10.0, "2": 90.0}
    assert page.problems == []


def test_actions_without_the_key_are_refused_by_the_server(page: Any, served: KilnProcess) -> None:
    """Load/unload have no key check of their own today; the download extension has: the page shows its answer."""
    row = _row(page, "simple")
    sync_api.expect(row).to_contain_text("READY", timeout=5000)
    page.evaluate("sessionStorage.clear()")
    row.locator('[data-action="download"]').click()
    page.click("#confirm-ok")
    sync_api.expect(page.locator("#message")).to_contain_text("401", timeout=5000)


def test_the_api_reference_page_renders_the_document(page: Any, served: KilnProcess) -> None:
    page.goto(f"http://{served.http_url}/console/api")
    sync_api.expect(page.locator("#operations")).to_contain_text("/v2/models/{model}/infer", timeout=5000)
    sync_api.expect(page.locator("#schemas details")).not_to_have_count(0)
    assert page.problems == []
