// Renders /v2/openapi.json as a reference page: operations grouped by tag, then the schemas they name.
"use strict";

function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) el.setAttribute(name, value);
  for (const child of children.flat()) {
    if (child !== null && child !== undefined) el.append(child instanceof Node ? child : String(child));
  }
  return el;
}

function schemaLink(content) {
  return Object.entries(content || {}).map(([media, body]) => {
    const ref = body.schema && body.schema.$ref ? body.schema.$ref.split("/").pop() : "";
    const link = ref ? h("a", { href: `#schema-${ref}` }, ref) : null;
    return media === "application/json" ? h("span", {}, link) : h("span", {}, h("code", {}, media), " ", link);
  });
}

function operation(path, method, op) {
  return h("tr", { id: op.operationId },
    h("td", {}, h("code", {}, method.toUpperCase())), h("td", {}, h("code", {}, path)),
    h("td", { class: "what" }, op.summary, op.security ? h("div", {}, "needs the API key when one is set") : null),
    h("td", {}, op.requestBody ? schemaLink(op.requestBody.content) : "–"),
    h("td", {}, schemaLink(op.responses["200"].content)));
}

async function main() {
  const doc = await (await fetch("/v2/openapi.json")).json();
  document.getElementById("version").textContent = `${doc.info.title} ${doc.info.version} · OpenAPI ${doc.openapi}`;
  document.getElementById("description").textContent = doc.info.description;
  const sections = doc.tags.map((tag) => {
    const rows = [];
    for (const [path, methods] of Object.entries(doc.paths)) {
      for (const [method, op] of Object.entries(methods)) if (op.tags.includes(tag.name)) rows.push(operation(path, method, op));
    }
    return h("section", {}, h("h2", {}, tag.name), h("div", { class: "scroll" }, h("table", {},
      h("thead", {}, h("tr", {}, ["method", "path", "what", "body", "answer"].map((t) => h("th", {}, t)))), h("tbody", {}, rows))));
  });
  document.getElementById("operations").replaceChildren(...sections);
  document.getElementById("schemas").replaceChildren(...Object.entries(doc.components.schemas).map(([name, schema]) =>
    h("details", { id: `schema-${name}` }, h("summary", {}, name), h("pre", {}, JSON.stringify(schema, null, 2)))));
}

main();
