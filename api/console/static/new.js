// The new-job form, made from the OpenAPI document's schema of POST /v1/jobs: a field per property (a fieldset
// per nested settings object), each with its description, default and range. The fields most jobs need come
// first (the model, a ratio or a budget, alpha, the exports); every other one folds under "Advanced", a group a
// stage, and a field this file does not name lands there too, in "Other". Presets fill fields; the model is checked
// by the API when it loses focus. Only the fields filled in are sent (of the ratio and the budget, the one chosen);
// the API's 422 names the field at fault, and its message goes beside that field. The Idempotency-Key is kept
// while the form is unchanged, so a double click (or a retry) makes one job.
import { api, call, el, errorOf, showError, start } from "./api.js";
import { inline } from "./markdown.js";

let spec;
const fieldsById = new Map(); // dotted path -> {input, choices, kind, path, aim}

// Where POST /v1/jobs's top-level fields go: the model, then the ratio or the budget (whichever is chosen shows),
// then the main fields; under Advanced a group a stage. A field named nowhere here goes to Advanced's "Other".
const AIMS = { ratio: ["ratio"], budget: ["target", "ratios", "gguf_types", "quantizations", "keep"] };
const MAIN = ["alpha", "export", "gguf_type", "quantization"];
const STAGES = [
  ["calibration", "Calibration", ["calibration"]],
  ["solver", "Solver and allocation", ["solver", "allocation", "shape", "r_max", "round_to"]],
  ["compensation", "Compensation", ["compensation", "compensation_damping"]],
  ["evaluation", "Evaluation", ["evaluation", "efficiency"]],
  ["recovery", "Recovery", ["recovery"]],
  ["experts", "Experts", ["moe"]],
  ["device", "Device", ["device", "dtype", "placement", "max_device_memory"]],
  ["job", "The job", ["revision", "metadata", "retention_seconds", "webhook_url", "webhook_events"]],
];

// What each preset fills (an empty value: back to the default); the fields it does not name stay as they are.
const PRESETS = [
  {
    name: "Quick check",
    about:
      "a first look in minutes: 16 calibration windows of 256 tokens from WikiText-2's validation split, " +
      "perplexity on 8 windows of WikiText-2, and for a budget two ratios",
    values: {
      "calibration.dataset": "wikitext2:validation",
      "calibration.n_samples": "16",
      "calibration.seq_len": "256",
      "evaluation.perplexity": "wikitext2",
      "evaluation.zero_shot": "",
      "evaluation.limit": "8",
      ratios: "0.2, 0.4",
    },
  },
  {
    name: "The paper's settings",
    about:
      "128 calibration windows of 2048 tokens from WikiText-2's train split, alpha 1, the greedy solver, the " +
      "gradient allocation and no compensation; perplexity on WikiText-2 and PTB in full and the seven zero-shot tasks",
    values: {
      alpha: "1",
      solver: "greedy",
      allocation: "gradient",
      compensation: "none",
      "calibration.dataset": "wikitext2",
      "calibration.n_samples": "128",
      "calibration.seq_len": "2048",
      "calibration.seed": "0",
      "calibration.mode": "sequential",
      "evaluation.perplexity": "wikitext2, ptb",
      "evaluation.zero_shot": "boolq, piqa, hellaswag, winogrande, arc_easy, arc_challenge, openbookqa",
      "evaluation.limit": "",
    },
  },
  {
    name: "For llama.cpp within a size",
    about:
      "a budget: each ratio in each GGUF type, and the file of lowest perplexity within the size you give " +
      "(the dense model's files among them)",
    aim: "budget",
    values: {
      "target.format": "gguf",
      "target.max_params": "",
      "target.max_perplexity_increase": "",
      "target.candidates": "",
      gguf_types: "",
    },
    focus: "target.max_bytes",
  },
];

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

function field(path, schema, required, aim) {
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
  fieldsById.set(id, { input, choices, kind, path, aim });
  return el(
    "div",
    { class: "field", "data-field": id },
    el("label", { for: id, text: required ? `${path.at(-1)} (required)` : path.at(-1) }),
    input,
    el("p", { class: "hint", id: hintId }, ...description, hint.join("; ")),
    el("p", { class: "field-error", id: errorId }),
  );
}

// A settings object (`calibration`, `target`) as a fieldset of its own.
function group(path, schema, aim) {
  const object = resolve(choicesOf(schema)[0]);
  const name = path.join(".");
  const description = schema.description ?? object.description;
  return el(
    "fieldset",
    { class: "group", "data-group": name },
    el("legend", {}, el("code", { text: name }), ...(description ? [": ", ...inline(description)] : [])),
    ...fields(path, object, Object.keys(object.properties), aim),
  );
}

// The fields `names` of `object` (those it has): what must be given first, then the rest in the order given.
function fields(prefix, object, names, aim) {
  const required = new Set(object.required ?? []);
  return names
    .filter((name) => name in object.properties)
    .sort((a, b) => required.has(b) - required.has(a))
    .map((name) => {
      const schema = object.properties[name];
      const choices = choicesOf(schema);
      const path = [...prefix, name];
      const nested = choices.length === 1 && choices[0].properties;
      return nested ? group(path, schema, aim) : field(path, schema, required.has(name), aim);
    });
}

function layout(request) {
  const placed = new Set(["model", ...Object.values(AIMS).flat(), ...MAIN, ...STAGES.flatMap(([, , names]) => names)]);
  const other = Object.keys(request.properties).filter((name) => !placed.has(name));
  document.getElementById("model-field").replaceChildren(...fields([], request, ["model"]));
  for (const [aim, names] of Object.entries(AIMS))
    document.getElementById(`${aim}-fields`).replaceChildren(...fields([], request, names, aim));
  document.getElementById("main-fields").replaceChildren(...fields([], request, MAIN));
  const stages = [...STAGES, ["other", "Other", other]]
    .map(([id, title, names]) => [id, title, fields([], request, names)])
    .filter(([, , nodes]) => nodes.length);
  document
    .getElementById("advanced-fields")
    .replaceChildren(
      ...stages.map(([id, title, nodes]) =>
        el("fieldset", { class: "stage", "data-stage": id }, el("legend", { text: title }), ...nodes),
      ),
    );
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

function currentAim() {
  return document.getElementById("job-form").elements.aim.value;
}

function setAim(aim) {
  document.querySelector(`input[name="aim"][value="${aim}"]`).checked = true;
  for (const section of document.querySelectorAll("[data-aim]")) section.hidden = section.dataset.aim !== aim;
}

function body() {
  const aim = currentAim();
  // A budget with none of its fields filled is still a budget: the API then says what it lacks.
  const request = aim === "budget" ? { target: {} } : {};
  for (const entry of fieldsById.values()) {
    if (entry.aim && entry.aim !== aim) continue;
    const value = valueOf(entry);
    if (value === undefined) continue;
    let node = request;
    for (const part of entry.path.slice(0, -1)) node = node[part] ??= {};
    node[entry.path.at(-1)] = value;
  }
  return request;
}

function clearError({ input }) {
  input.removeAttribute("aria-invalid");
  document.getElementById(`error-${input.id}`).textContent = "";
}

function clearErrors() {
  document.getElementById("form-error").textContent = "";
  for (const entry of fieldsById.values()) clearError(entry);
}

// A 422's message is "field: reason; field: reason": each reason beside its field (Advanced opened for it), the
// rest (and a field not shown: the ratio while a budget is chosen) above the button. Returns the first field.
function showErrors(error) {
  const parts = [];
  for (const part of error.message.split("; ")) {
    const named = /^([\w.]+): ([\s\S]*)$/.exec(part);
    if (named && fieldsById.has(named[1])) parts.push({ field: named[1], reason: named[2] });
    else if (parts.length) parts.at(-1).reason += `; ${part}`;
    else parts.push({ field: error.param, reason: named?.[1] === error.param ? named[2] : part });
  }
  let first = null;
  for (const { field, reason } of parts) {
    const entry = fieldsById.get(field);
    if (!entry || entry.input.closest("[hidden]")) {
      document.getElementById("form-error").textContent = `${error.code}: ${field ? `${field}: ` : ""}${reason}`;
      continue;
    }
    entry.input.setAttribute("aria-invalid", "true");
    document.getElementById(`error-${field}`).textContent = reason;
    entry.input.closest("details")?.setAttribute("open", "");
    first ??= entry.input;
  }
  return first;
}

// What POST /v1/jobs would say about the model, beside it: the model as a job would store it, or the 422.
async function checkModel() {
  const entry = fieldsById.get("model");
  const status = document.getElementById("check-model");
  const model = entry.input.value.trim();
  clearError(entry);
  status.textContent = "";
  if (!model) return;
  const answer = await call("/v1/models/check", {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ model }),
  });
  if (entry.input.value.trim() !== model) return; // changed since: its own check follows
  if (answer.ok) {
    status.textContent = `A job takes it: ${(await answer.json()).model}`;
    return;
  }
  const error = await errorOf(answer);
  if (error.status === 422) showErrors(error);
  else if (error.status !== 401) status.textContent = `${error.code}: ${error.message}`;
}

// The models this key can pick, as the model field's suggestions (it still takes any text), checked on blur.
async function offerModels() {
  const entry = fieldsById.get("model");
  entry.input.closest(".field").append(el("p", { class: "check", id: "check-model", role: "status" }));
  entry.input.addEventListener("blur", () => checkModel().catch(showError));
  const { data } = await api("/v1/models/choices");
  document
    .getElementById("model-choices")
    .replaceChildren(
      ...data.map((choice) =>
        el("option", { value: choice.model, label: `${choice.name} (${choice.source}, ${choice.format})` }),
      ),
    );
  entry.input.setAttribute("list", "model-choices");
}

function applyPreset({ name, about, aim, values, focus }) {
  if (aim) setAim(aim);
  for (const [path, value] of Object.entries(values)) {
    const entry = fieldsById.get(path);
    if (!entry) throw new Error(`the preset "${name}" fills ${path}, which POST /v1/jobs no longer has`);
    entry.input.value = value;
  }
  const filled = Object.entries(values).map(([path, value]) => `${path} ${value || "(default)"}`);
  document.getElementById("preset-note").textContent = `${name}: ${about}. Filled: ${filled.join(", ")}.`;
  document.getElementById("job-form").dispatchEvent(new Event("input")); // another request: another key
  if (focus) document.getElementById(focus).focus();
}

function newIdempotencyKey() {
  const bytes = crypto.getRandomValues(new Uint8Array(16));
  return Array.from(bytes, (byte) => byte.toString(16).padStart(2, "0")).join("");
}

start(async () => {
  const response = await fetch("/openapi.json");
  spec = await response.json();
  layout(resolve(spec.paths["/v1/jobs"].post.requestBody.content["application/json"].schema));
  document.getElementById("preset-buttons").replaceChildren(
    ...PRESETS.map((preset) => {
      const button = el("button", { type: "button", text: preset.name });
      button.addEventListener("click", () => applyPreset(preset));
      return button;
    }),
  );
  for (const radio of document.querySelectorAll('input[name="aim"]'))
    radio.addEventListener("change", () => setAim(radio.value));

  const form = document.getElementById("job-form");
  let idempotencyKey = newIdempotencyKey();
  let leaving = false;
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
      // A double click's second answer names the same job: navigating again would abort the first navigation.
      if (leaving) return;
      leaving = true;
      location.assign(`/console/jobs/${(await answer.json()).id}`);
      return;
    }
    const error = await errorOf(answer);
    if (error.status === 422) showErrors(error)?.focus();
    else if (error.status !== 401)
      document.getElementById("form-error").textContent = `${error.code}: ${error.message}`;
  });
  fieldsById.get("model").input.focus();
  await offerModels();
});
