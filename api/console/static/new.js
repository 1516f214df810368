// The new-job form, made from the OpenAPI document's schema of POST /v1/jobs: a field per property (a fieldset
// per nested settings object), each with its description, default and range. Only the fields filled in are sent;
// the API's 422 names the field at fault, and its message goes beside that field. The Idempotency-Key is kept
// while the form is unchanged, so a double click (or a retry) makes one job.
import { call, el, errorOf, start } from "./api.js";
import { inline } from "./markdown.js";

let spec;
const fieldsById = new Map(); // dotted path -> {input, choices, kind}

function resolve(schema) {
  let resolved = schema;
  while (resolved?.$ref) resolved = spec.components.schemas[resolved.$ref.split("/").pop()];
  return resolved;
}

// The forms a value may take, `null` left out: `ratio` is a number or null, `alpha` a number or "auto".
function choicesOf(schema) {
  return (schema.anyOf ?? [schema]).map(resolve).filter((choice) => choice.type !== "null");
}

function bounds(choice) {
  const parts = [];
  if (choice.exclusiveMinimum !== undefined) parts.push(`> ${choice.exclusiveMinimum}`);
  if (choice.minimum !== undefined) parts.push(`≥ ${choice.minimum}`);
  if (choice.exclusiveMaximum !== undefined) parts.push(`< ${choice.exclusiveMaximum}`);
  if (choice.maximum !== undefined) parts.push(`≤ ${choice.maximum}`);
  return parts.join(" and ");
}

function describe(choice) {
  if (choice.const !== undefined) return JSON.stringify(choice.const);
  if (choice.enum) return `one of ${choice.enum.join(", ")}`;
  if (choice.type === "integer" || choice.type === "number") {
    const range = bounds(choice);
    return `${choice.type === "integer" ? "an integer" : "a number"}${range ? ` ${range}` : ""}`;
  }
  if (choice.type === "array") {
    const count =
      choice.minItems !== undefined || choice.maxItems !== undefined
        ? ` (${choice.minItems ?? 0} to ${choice.maxItems ?? "any number of"} items)`
        : "";
    return `a comma-separated list of ${choicesOf(choice.items).map(describe).join(" or ")}${count}`;
  }
  if (choice.type === "object") return "one key=value a line";
  if (choice.type === "boolean") return "true or false";
  if (choice.maxLength !== undefined) return `text of ${choice.minLength ?? 0} to ${choice.maxLength} characters`;
  return "text";
}

function kindOf(choices) {
  if (choices.length === 1 && choices[0].type === "boolean") return "boolean";
  if (choices.length === 1 && choices[0].enum) return "enum";
  if (choices.length === 1 && choices[0].type === "array") return "array";
  if (choices.length === 1 && choices[0].type === "object") return "mapping";
  return "text";
}

function control(id, kind, choices, defaultValue, describedBy) {
  const common = { id, name: id, "aria-describedby": describedBy };
  if (kind === "boolean" || kind === "enum") {
    const values = kind === "boolean" ? [true, false] : choices[0].enum;
    const defaultLabel = defaultValue === undefined ? "(not set)" : `(default: ${defaultValue})`;
    return el(
      "select",
      common,
      el("option", { value: "", text: defaultLabel }),
      ...values.map((value) => el("option", { value: String(value), text: String(value) })),
    );
  }
  if (kind === "mapping") return el("textarea", { ...common, rows: 2 });
  // Text even for numbers: the browser's own checks would hide the API's message for an out-of-range value.
  const numeric = choices.every((choice) => choice.type === "number" || choice.type === "integer");
  return el("input", { ...common, type: "text", inputmode: numeric ? "decimal" : null, autocomplete: "off" });
}

function field(path, schema, required) {
  const id = path.join(".");
  const choices = choicesOf(schema);
  const kind = kindOf(choices);
  const hint = [
    choices.map(describe).join(", or "),
    schema.default !== undefined ? `default ${JSON.stringify(schema.default)}` : null,
  ].filter(Boolean);
  const description = schema.description ? [...inline(schema.description), "; "] : [];
  const hintId = `hint-${id}`;
  const errorId = `error-${id}`;
  const input = control(id, kind, choices, schema.default, `${hintId} ${errorId}`);
  if (required) input.setAttribute("aria-required", "true");
  fieldsById.set(id, { input, choices, kind, path });
  return el(
    "div",
    { class: "field", "data-field": id },
    el("label", { for: id, text: required ? `${path.at(-1)} (required)` : path.at(-1) }),
    input,
    el("p", { class: "hint", id: hintId }, ...description, hint.join("; ")),
    el("p", { class: "field-error", id: errorId }),
  );
}

// A settings object (`calibration`, `target`) as a fieldset of its own, folded until opened.
function group(path, schema) {
  const object = resolve(choicesOf(schema)[0]);
  const legend = path.join(".");
  const description = schema.description ?? object.description;
  return el(
    "details",
    { "data-group": legend },
    el("summary", {}, legend, ...(description ? [": ", ...inline(description)] : [])),
    el("fieldset", {}, el("legend", { class: "visually-hidden", text: legend }), ...fields(path, object)),
  );
}

function fields(prefix, object) {
  const required = new Set(object.required ?? []);
  // What must be given first, then the rest in the schema's order.
  const names = Object.keys(object.properties).sort((a, b) => required.has(b) - required.has(a));
  return names.map((name) => {
    const schema = object.properties[name];
    const choices = choicesOf(schema);
    const nested = choices.length === 1 && choices[0].properties;
    return nested ? group([...prefix, name], schema) : field([...prefix, name], schema, required.has(name));
  });
}

function parseOne(text, choices) {
  const numeric = choices.some((choice) => choice.type === "number" || choice.type === "integer");
  if (numeric && text !== "" && !Number.isNaN(Number(text))) return Number(text);
  return text; // a string, or what the API refuses with its own message
}

function valueOf({ input, choices, kind }) {
  const text = input.value.trim();
  if (text === "") return undefined;
  if (kind === "boolean") return text === "true";
  if (kind === "array") {
    const items = choicesOf(choices[0].items);
    return text
      .split(",")
      .map((item) => item.trim())
      .filter(Boolean)
      .map((item) => parseOne(item, items));
  }
  if (kind === "mapping") {
    const lines = text.split("\n").filter((line) => line.trim());
    return Object.fromEntries(lines.map((line) => line.split("=", 2).map((part) => part.trim())));
  }
  return parseOne(text, choices);
}

function body() {
  const request = {};
  for (const entry of fieldsById.values()) {
    const value = valueOf(entry);
    if (value === undefined) continue;
    let node = request;
    for (const part of entry.path.slice(0, -1)) node = node[part] ??= {};
    node[entry.path.at(-1)] = value;
  }
  return request;
}

function clearErrors() {
  document.getElementById("form-error").textContent = "";
  for (const { input } of fieldsById.values()) {
    input.removeAttribute("aria-invalid");
    document.getElementById(`error-${input.id}`).textContent = "";
  }
}

// A 422's message is "field: reason; field: reason": each reason beside its field, the rest above the button.
function showErrors(error) {
  const parts = [];
  for (const part of error.message.split("; ")) {
    const named = /^([\w.]+): ([\s\S]*)$/.exec(part);
    if (named && fieldsById.has(named[1])) parts.push({ field: named[1], reason: named[2] });
    else if (parts.length) parts.at(-1).reason += `; ${part}`;
    else parts.push({ field: error.param, reason: part });
  }
  let first = null;
  for (const { field, reason } of parts) {
    const entry = fieldsById.get(field);
    if (!entry) {
      document.getElementById("form-error").textContent = `${error.code}: ${field ? `${field}: ` : ""}${reason}`;
      continue;
    }
    entry.input.setAttribute("aria-invalid", "true");
    document.getElementById(`error-${field}`).textContent = reason;
    entry.input.closest("details")?.setAttribute("open", "");
    first ??= entry.input;
  }
  first?.focus();
}

function newIdempotencyKey() {
  const bytes = crypto.getRandomValues(new Uint8Array(16));
  return Array.from(bytes, (byte) => byte.toString(16).padStart(2, "0")).join("");
}

start(async () => {
  const response = await fetch("/openapi.json");
  spec = await response.json();
  const request = spec.paths["/v1/jobs"].post.requestBody.content["application/json"].schema;
  document.getElementById("fields").replaceChildren(...fields([], resolve(request)));

  const form = document.getElementById("job-form");
  let idempotencyKey = newIdempotencyKey();
  form.addEventListener("input", () => {
    idempotencyKey = newIdempotencyKey(); // another request: another job
  });
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    clearErrors();
    const answer = await call("/v1/jobs", {
      method: "POST",
      headers: { "Content-Type": "application/json", "Idempotency-Key": idempotencyKey },
      body: JSON.stringify(body()),
    });
    if (answer.ok) {
      const job = await answer.json();
      location.assign(`/console/jobs/${job.id}`);
      return;
    }
    const error = await errorOf(answer);
    if (error.status === 422) showErrors(error);
    else if (error.status !== 401)
      document.getElementById("form-error").textContent = `${error.code}: ${error.message}`;
  });
  document.getElementById(fieldsById.keys().next().value)?.focus();
});
