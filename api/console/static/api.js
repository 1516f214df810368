// What every console page shares: the API key (kept for the tab in sessionStorage), calls to /v1/... carrying
// it as the API expects, its errors, and small helpers to build and format the page. No HTML is written from
// data: text goes in as text nodes.

const KEY_STORAGE = "casp.apiKey";
const authRequired = document.body.dataset.auth === "apikey";

export class ApiError extends Error {
  // The API's error shape: {"error": {"code", "message", "param"}}.
  constructor(status, error) {
    super(error.message);
    this.status = status;
    this.code = error.code;
    this.param = error.param;
  }
}

function storedKey() {
  return sessionStorage.getItem(KEY_STORAGE);
}

export async function call(path, options = {}) {
  const headers = new Headers(options.headers);
  if (authRequired) headers.set("Authorization", `Bearer ${storedKey()}`);
  const response = await fetch(path, { ...options, headers });
  if (response.status === 401 && authRequired) {
    sessionStorage.removeItem(KEY_STORAGE);
    askForKey("The server refused the key; enter another.");
  }
  return response;
}

export async function errorOf(response) {
  let body = null;
  try {
    body = await response.json();
  } catch {
    // not the API's JSON (a proxy's page): the status says enough
  }
  return new ApiError(response.status, body?.error ?? { code: String(response.status), message: response.statusText });
}

// The JSON of a call that succeeds; an ApiError otherwise.
export async function api(path, options = {}) {
  const response = await call(path, options);
  if (!response.ok) throw await errorOf(response);
  return response.status === 204 ? null : response.json();
}

function askForKey(message) {
  const form = document.getElementById("key-form");
  document.getElementById("main").hidden = true;
  document.getElementById("forget-key").hidden = true;
  form.hidden = false;
  document.getElementById("key-error").textContent = message ?? "";
  document.getElementById("api-key").focus();
}

// Runs the page once a key is there (or none is needed); a key entered is tried on /v1/usage before it is kept.
export function start(run) {
  const main = document.getElementById("main");
  const show = () => {
    main.hidden = false;
    run().catch(showError);
  };
  if (!authRequired) return show();
  const form = document.getElementById("key-form");
  const forget = document.getElementById("forget-key");
  forget.addEventListener("click", () => {
    sessionStorage.removeItem(KEY_STORAGE);
    location.reload();
  });
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const key = document.getElementById("api-key").value.trim();
    const response = await fetch("/v1/usage", { headers: { Authorization: `Bearer ${key}` } });
    if (!response.ok) {
      document.getElementById("key-error").textContent = (await errorOf(response)).message;
      return;
    }
    sessionStorage.setItem(KEY_STORAGE, key);
    form.hidden = true;
    forget.hidden = false;
    show();
  });
  if (storedKey()) {
    forget.hidden = false;
    show();
  } else {
    askForKey();
  }
}

export function showError(error) {
  if (error instanceof ApiError && error.status === 401) return; // the key form says it
  const paragraph = document.getElementById("page-error");
  paragraph.textContent = error instanceof ApiError ? `${error.code}: ${error.message}` : String(error);
  paragraph.hidden = false;
}

// An element with attributes (`text`: its text) and children (nodes or strings).
export function el(tag, attributes = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes)) {
    if (value === null || value === undefined || value === false) continue;
    if (name === "text") node.textContent = value;
    else node.setAttribute(name, value === true ? "" : value);
  }
  node.append(...children.filter((child) => child !== null && child !== undefined));
  return node;
}

export function formatTime(iso) {
  return iso ? new Date(iso).toLocaleString(undefined, { dateStyle: "short", timeStyle: "medium" }) : "";
}

export function formatDuration(job) {
  if (!job.started_at) return "";
  const end = job.finished_at ? new Date(job.finished_at) : new Date();
  const seconds = Math.max(0, Math.round((end - new Date(job.started_at)) / 1000));
  const minutes = Math.floor(seconds / 60);
  return minutes ? `${minutes} min ${seconds % 60} s` : `${seconds} s`;
}

export function formatBytes(bytes) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let value = bytes;
  let unit = 0;
  while (value >= 1024 && unit < units.length - 1) {
    value /= 1024;
    unit += 1;
  }
  return unit ? `${value.toFixed(1)} ${units[unit]}` : `${bytes} B`;
}

// What a job was asked for: its ratio, or its budget (`max_bytes 6GB gguf`).
export function askedFor(job) {
  const { ratio, target } = job.settings;
  if (target) {
    return Object.entries(target)
      .filter(([, value]) => value !== null)
      .map(([name, value]) => `${name} ${value}`)
      .join(", ");
  }
  return ratio === null || ratio === undefined ? "" : `ratio ${ratio}`;
}

export function isFinished(job) {
  return ["succeeded", "failed", "cancelled"].includes(job.status);
}
