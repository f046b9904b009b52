// kiln console: polls the status document once a second and renders it; actions call kiln's own endpoints with
// the key the operator typed (kept in sessionStorage, so it leaves with the tab).
"use strict";

const STATUS = "/v2/kiln/console/status";
const POLL_MS = 1000;
const KEY = "kiln-console-key";
let previous = null;  // the last status document, for rates
let current = null;

function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (name.startsWith("on")) el.addEventListener(name.slice(2), value);
    else if (value !== null && value !== undefined && value !== false) el.setAttribute(name, value);
  }
  for (const child of children.flat()) {
    if (child !== null && child !== undefined) el.append(child instanceof Node ? child : String(child));
  }
  return el;
}

function fmt(value, digits = 1) {
  return value === null || value === undefined || Number.isNaN(value) ? "–" : value.toFixed(digits);
}

function bytes(n) {
  if (n === undefined || n === null) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

function say(text, error = false) {
  const box = document.getElementById("message");
  box.textContent = text;
  box.className = error ? "error" : "";
  box.hidden = false;
}

function headers() {
  const key = sessionStorage.getItem(KEY);
  return key ? { Authorization: `Bearer ${key}` } : {};
}

async function call(method, path, body) {
  const init = { method, headers: headers() };
  if (body !== undefined) {
    init.body = JSON.stringify(body);
    init.headers["Content-Type"] = "application/json";
  }
  const response = await fetch(path, init);
  if (!response.ok) {
    let detail = response.statusText;
    try { detail = (await response.json()).error || detail; } catch (_) { /* not JSON */ }
    throw new Error(`${response.status}: ${detail}`);
  }
  return response;
}

// A confirmation dialog; `extra` (optional) adds inputs. Resolves true on Confirm.
function confirmAction(text, extra) {
  const dialog = document.getElementById("confirm");
  document.getElementById("confirm-text").textContent = text;
  document.getElementById("confirm-extra").replaceChildren(...(extra ? [extra] : []));
  return new Promise((resolve) => {
    dialog.addEventListener("close", () => resolve(dialog.returnValue === "ok"), { once: true });
    dialog.returnValue = "cancel";
    dialog.showModal();
  });
}

async function act(text, work, extra) {
  if (!(await confirmAction(text, extra))) return;
  try {
    const done = await work();
    say(done);
    poll();
  } catch (err) {
    say(`${text.replace(/\?$/, "")} failed: ${err.message}`, true);
  }
}

function loadModel(name) {
  act(`Load model '${name}'?`, async () => {
    await call("POST", `/v2/repository/models/${encodeURIComponent(name)}/load`, {});
    return `Loaded '${name}'.`;
  });
}

function unloadModel(name) {
  act(`Unload model '${name}'? Its requests fail until it is loaded again.`, async () => {
    await call("POST", `/v2/repository/models/${encodeURIComponent(name)}/unload`, {});
    return `Unloaded '${name}'.`;
  });
}

function changeSplit(model) {
  const weights = (model.routing && model.routing.weights) || {};
  const ready = model.versions.filter((v) => v.state === "READY");
  const inputs = ready.map((v) => h("label", {}, `version ${v.version} `,
    h("input", { type: "number", min: "0", step: "any", "data-version": v.version, value: weights[v.version] ?? 0 })));
  const box = h("div", {}, inputs, h("p", { class: "muted" }, "All zero: the newest version serves everything."));
  act(`Change the A/B split of '${model.name}'?`, async () => {
    const chosen = {};
    for (const input of box.querySelectorAll("input")) {
      const weight = Number(input.value);
      if (weight > 0) chosen[input.dataset.version] = weight;
    }
    await call("POST", `/v2/repository/models/${encodeURIComponent(model.name)}/kiln/routing`, { weights: chosen });
    return `New split of '${model.name}': ${JSON.stringify(chosen)}.`;
  }, box);
}

function download(name, version) {
  act(`Download every file of '${name}' version ${version}?`, async () => {
    const base = `/v2/kiln/models/${encodeURIComponent(name)}/versions/${encodeURIComponent(version)}/files`;
    const files = await (await call("GET", base)).json();
    for (const file of files) {
      const blob = await (await call("GET", `${base}/${file.path.split("/").map(encodeURIComponent).join("/")}`)).blob();
      const link = h("a", { href: URL.createObjectURL(blob), download: `${name}-${version}-${file.path.replaceAll("/", "_")}` });
      document.body.append(link);
      link.click();
      link.remove();
      URL.revokeObjectURL(link.href);
    }
    return `Downloaded ${files.length} file(s) of '${name}' version ${version}.`;
  });
}

function rate(model, version, field) {
  if (!previous) return null;
  const before = previous.models.find((m) => m.name === model)?.versions.find((v) => v.version === version.version);
  if (!before || !before.stats || !version.stats) return null;
  const seconds = (current.time_ms - previous.time_ms) / 1000;
  return seconds > 0 ? Math.max(0, version.stats[field] - before.stats[field]) / seconds : null;
}

function histogram(sizes) {
  const entries = Object.entries(sizes || {});
  if (!entries.length) return "–";
  const most = Math.max(...entries.map(([, n]) => n));
  return h("span", { class: "hist", title: entries.map(([size, n]) => `batch ${size}: ${n}`).join("\n") },
    entries.map(([size, n]) => h("span", { style: `height:${Math.max(4, 100 * n / most)}%` })));
}

function actions(model, version, controls) {
  const buttons = [];
  if (controls.model_control === "explicit") {
    if (version.state === "READY") buttons.push(h("button", { type: "button", "data-action": "unload", onclick: () => unloadModel(model.name) }, "Unload"));
    else buttons.push(h("button", { type: "button", "data-action": "load", onclick: () => loadModel(model.name) }, "Load"));
  }
  if (controls.downloads && version.state === "READY") {
    buttons.push(h("button", { type: "button", "data-action": "download", onclick: () => download(model.name, version.version) }, "Download"));
  }
  return buttons;
}

function modelRows(model, controls) {
  const versions = model.versions.length ? model.versions : [{ version: "", state: model.state, reason: model.reason, instances: [] }];
  return versions.map((v) => {
    const stats = v.stats || {};
    const latency = v.latency || {};
    const failures = Object.entries(stats.failures_by_reason || {}).map(([r, n]) => `${r}: ${n}`).join(", ");
    return h("tr", { "data-model": model.name, "data-version": v.version },
      h("td", {}, model.name), h("td", {}, v.version || "–"),
      h("td", {}, h("span", { class: `pill state-${v.state}` }, v.state), v.reason ? h("div", { class: "reason" }, v.reason) : null),
      h("td", {}, v.instances.map((g) => h("div", {}, `${g.count}× ${g.kind}${g.gpus.length ? ` gpu ${g.gpus.join(",")}` : ""}`))),
      h("td", { class: "num", "data-field": "rate" }, fmt(rate(model.name, v, "inference_count"))),
      h("td", { class: "num", "data-field": "p50" }, fmt(latency.p50_ms, 2)),
      h("td", { class: "num", "data-field": "p99" }, fmt(latency.p99_ms, 2)),
      h("td", { class: "num" }, fmt(latency.queue_p50_ms, 2)),
      h("td", {}, histogram(stats.batch_sizes)),
      h("td", { class: "num", title: failures }, stats.fail ?? "–"),
      h("td", {}, actions(model, v, controls)));
  });
}

function renderAb(models) {
  const candidates = models.filter((m) => m.versions.filter((v) => v.state === "READY").length > 1);
  document.getElementById("ab").hidden = !candidates.length;
  document.getElementById("ab-list").replaceChildren(...candidates.map((m) => {
    const r = m.routing || { versions: [], weights: {}, source: "none" };
    const shadow = r.shadow ? h("p", {}, `shadow → version ${r.shadow.version} (${(100 * r.shadow.fraction).toFixed(0)}%): `,
      `${r.shadow.agreed} agreed, ${r.shadow.disagreed} disagreed, ${r.shadow.errors} errors, max |diff| ${fmt(r.shadow.max_abs_diff, 4)}`) : null;
    return h("div", { class: "card", "data-ab": m.name },
      h("strong", {}, m.name), " ", h("span", { class: "muted" }, `weights from ${r.source}`),
      h("table", {}, h("tr", {}, ["version", "weight", "share", "routed", "p50 ms", "p99 ms"].map((t) => h("th", {}, t))),
        r.versions.map((v) => h("tr", {}, h("td", {}, v.version), h("td", { class: "num" }, v.weight),
          h("td", { class: "num" }, `${(100 * v.share).toFixed(0)}%`), h("td", { class: "num" }, v.routed),
          h("td", { class: "num" }, fmt(v.p50_ms, 2)), h("td", { class: "num" }, fmt(v.p99_ms, 2))))),
      shadow, h("button", { type: "button", "data-action": "split", onclick: () => changeSplit(m) }, "Change split"));
  }));
}

function renderGpus(gpus) {
  document.getElementById("gpus").hidden = !(gpus && gpus.length);
  document.getElementById("gpu-list").replaceChildren(...(gpus || []).map((g) => {
    const used = g.memory_total_bytes ? g.memory_used_bytes / g.memory_total_bytes : 0;
    return h("div", { class: "card" }, h("div", { class: "muted" }, g.uuid),
      `memory ${bytes(g.memory_used_bytes)} / ${bytes(g.memory_total_bytes)}`, h("div", { class: "meter" }, h("span", { style: `width:${100 * used}%` })),
      `utilisation ${fmt(100 * (g.utilization ?? NaN), 0)}%`, h("div", { class: "meter" }, h("span", { style: `width:${100 * (g.utilization || 0)}%` })),
      g.power_w !== undefined ? `power ${fmt(g.power_w, 0)} W` : null);
  }));
}

function renderCaptures(captures) {
  document.getElementById("captures").hidden = captures === null;
  document.querySelector("#capture-table tbody").replaceChildren(...(captures || []).map((c) => h("tr", {},
    h("td", {}, c.model), h("td", {}, c.version), h("td", { class: "num" }, c.samples), h("td", {}, c.edges.join(", ") || "–"),
    h("td", {}, Object.entries(c.reasons).map(([r, n]) => `${r}: ${n}`).join(", ")),
    h("td", {}, c.last_time ? new Date(c.last_time * 1000).toLocaleString() : "–"))));
}

function renderReport(report) {
  document.getElementById("report").hidden = !report;
  if (!report) return;
  document.getElementById("report-files").replaceChildren(...report.files.map((f) =>
    h("li", {}, h("a", { href: `/console/report/${encodeURIComponent(f)}`, target: "_blank" }, f))));
}

function render(doc) {
  previous = current;
  current = doc;
  document.getElementById("server").textContent = `${doc.server.name} ${doc.server.version}`;
  const health = document.getElementById("health");
  health.textContent = doc.ready ? `ready · ${doc.inflight} in flight` : "not ready";
  health.className = `pill ${doc.ready ? "ok" : "bad"}`;
  document.getElementById("key-box").hidden = !doc.controls.key_required;
  document.querySelector("#models tbody").replaceChildren(...doc.models.flatMap((m) => modelRows(m, doc.controls)));
  renderAb(doc.models);
  renderGpus(doc.gpus);
  renderCaptures(doc.captures);
  renderReport(doc.report);
  document.getElementById("updated").textContent = `updated ${new Date(doc.time_ms).toLocaleTimeString()}`;
}

let polling = false;
async function poll() {
  if (polling) return;
  polling = true;
  try {
    const response = await fetch(STATUS, { cache: "no-store" });
    if (!response.ok) throw new Error(`status ${response.status}`);
    render(await response.json());
  } catch (err) {
    const health = document.getElementById("health");
    health.textContent = "unreachable";
    health.className = "pill bad";
  } finally {
    polling = false;
  }
}

document.getElementById("key").value = sessionStorage.getItem(KEY) || "";
document.getElementById("key-save").addEventListener("click", () => {
  const key = document.getElementById("key").value.trim();
  if (key) sessionStorage.setItem(KEY, key); else sessionStorage.removeItem(KEY);
  say(key ? "Key kept for this tab." : "Key forgotten.");
});
poll();
setInterval(poll, POLL_MS);
