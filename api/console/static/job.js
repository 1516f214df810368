// One job: its state (GET /v1/jobs/{id}), its stages and events as the event stream sends them (read with
// fetch, since EventSource cannot send the key), and once it has succeeded the result, the signed artifact links,
// report.md with its tables and plots, and the model card. Cancel and delete call the API's own routes.
import {
  api,
  askedFor,
  call,
  el,
  errorOf,
  formatBytes,
  formatDuration,
  formatTime,
  isFinished,
  showError,
  start,
} from "./api.js";
import { renderFront } from "./frontier.js";
import { renderMarkdown } from "./markdown.js";
import { summaryRows } from "./summary.js";

const jobId = document.body.dataset.jobId;
const POLL_MS = 2000; // when the server refuses another stream (429), or between reconnections
const DURATION_TICK_MS = 1000; // a running job's duration counts on between its events
const stageItems = new Map();
let job = null;
let lastEventId = null;
let resultsShown = false;

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

function showJob(next) {
  job = next;
  const facts = [
    ["Status", el("span", { class: `status ${job.status}`, id: "status", text: job.status })],
    ["Model", job.model],
    ["Asked for", askedFor(job)],
    ["Achieved ratio", job.result?.achieved_ratio?.toFixed(4)],
    ["Device", job.device],
    ["Created", formatTime(job.created_at)],
    ["Started", formatTime(job.started_at)],
    ["Finished", formatTime(job.finished_at)],
    ["Duration", job.started_at && el("span", { id: "duration", text: formatDuration(job) })],
    ["Attempts", String(job.attempts)],
    [
      "Metadata",
      Object.entries(job.metadata)
        .map(([key, value]) => `${key}=${value}`)
        .join(", "),
    ],
  ].filter(([, value]) => value);
  document
    .getElementById("facts")
    .replaceChildren(...facts.flatMap(([name, value]) => [el("dt", { text: name }), el("dd", {}, value)]));
  const progress = document.getElementById("progress");
  progress.value = job.progress;
  progress.textContent = `${job.progress} %`;
  const cancel = document.getElementById("cancel");
  cancel.hidden = isFinished(job);
  cancel.disabled = job.cancel_requested;
  cancel.textContent = job.cancel_requested ? "Cancel requested" : "Cancel the job";
  document.getElementById("delete").hidden = !isFinished(job);
  const error = document.getElementById("job-error");
  error.hidden = !job.error;
  error.textContent = job.error ? `${job.error.code}: ${job.error.message}` : "";
  document.getElementById("job").hidden = false;
  // Succeeded: every stage done; failed or cancelled: the stage it was in marked as where it stopped.
  for (const item of isFinished(job) ? stageItems.values() : []) {
    if (job.status === "succeeded") item.dataset.state = "done";
    else if (item.dataset.state === "running") item.dataset.state = job.status;
  }
  if (job.status === "succeeded" && !resultsShown) {
    resultsShown = true;
    showResults().catch(showError);
  }
}

function showStage(event) {
  let item = stageItems.get(event.stage);
  if (!item) {
    item = el(
      "li",
      { "data-stage": event.stage },
      el("span", { class: "stage-name", text: event.stage }),
      " ",
      el("span", { class: "stage-message" }),
    );
    stageItems.set(event.stage, item);
    document.getElementById("stages").append(item);
  }
  for (const other of stageItems.values()) if (other.dataset.state === "running") other.dataset.state = "done";
  item.dataset.state = "running";
  item.querySelector(".stage-message").textContent = event.message;
}

function addEvent(event) {
  lastEventId = event.id;
  const row = el(
    "tr",
    { "data-kind": event.kind },
    el("td", { text: formatTime(event.created_at) }),
    el("td", { text: event.kind }),
    el("td", { text: event.stage ?? "" }),
    el("td", { text: `${event.progress} %` }),
    el("td", { text: event.message }),
  );
  document.querySelector("#events tbody").append(row);
  if (event.kind === "progress" && event.stage) showStage(event);
  if (event.kind === "status") api(`/v1/jobs/${jobId}`).then(showJob, showError);
  else if (job && !isFinished(job)) document.getElementById("progress").value = event.progress;
}

// Server-Sent Events from a fetch body: `data:` lines up to a blank line make one event.
async function readStream(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let pending = "";
  let data = [];
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    pending += value;
    // A chunk may end between the \r and \n of one line ending: that \r waits for the next chunk.
    const complete = pending.endsWith("\r") ? pending.length - 1 : pending.length;
    const lines = pending.slice(0, complete).split(/\r\n|\r|\n/);
    pending = lines.pop() + pending.slice(complete);
    for (const line of lines) {
      if (line === "") {
        if (data.length) addEvent(JSON.parse(data.join("\n")));
        data = [];
      } else if (line.startsWith("data:")) {
        data.push(line.slice(5).replace(/^ /, ""));
      }
    }
  }
}

async function readPages() {
  for (;;) {
    const query = new URLSearchParams({ limit: 100 });
    if (lastEventId !== null) query.set("after", lastEventId);
    const page = await api(`/v1/jobs/${jobId}/events?${query}`);
    page.data.forEach(addEvent);
    if (!page.has_more) return;
  }
}

// Follows the job until it has finished: the stream while the server gives one, polling when it refuses (429).
async function follow() {
  let streaming = true;
  for (;;) {
    if (streaming) {
      const query = new URLSearchParams({ stream: "true" });
      if (lastEventId !== null) query.set("after", lastEventId);
      const response = await call(`/v1/jobs/${jobId}/events?${query}`);
      if (response.ok) await readStream(response.body);
      else if (response.status === 429) streaming = false;
      else throw await errorOf(response);
    } else {
      await readPages();
    }
    showJob(await api(`/v1/jobs/${jobId}`));
    if (isFinished(job)) return readPages(); // what came between the stream's end and this read
    await sleep(POLL_MS);
  }
}

async function markdownOf(artifact) {
  const response = await fetch(artifact.url);
  if (!response.ok) throw await errorOf(response);
  return response.text();
}

async function showResults() {
  document.getElementById("results").hidden = false;
  document.querySelector("#summary tbody").replaceChildren(...summaryRows(job.result));
  if (job.result.frontier) {
    const front = document.getElementById("front");
    front.append(...renderFront(job.result.frontier));
    front.hidden = false;
  }
  const note = document.getElementById("artifacts-note");
  let artifacts;
  try {
    artifacts = (await api(`/v1/jobs/${jobId}/artifacts`)).data;
  } catch (error) {
    note.textContent = error.message; // 410: expired or deleted
    return;
  }
  const total = formatBytes(artifacts.reduce((sum, artifact) => sum + artifact.size, 0));
  note.textContent = `${artifacts.length} files, ${total}; kept until ${formatTime(job.expires_at)}.`;
  document
    .querySelector("#artifacts tbody")
    .replaceChildren(
      ...artifacts.map((artifact) =>
        el(
          "tr",
          { "data-artifact": artifact.name },
          el("td", {}, el("a", { href: artifact.url, download: artifact.name.split("/").pop(), text: artifact.name })),
          el("td", { text: formatBytes(artifact.size) }),
          el("td", {}, el("code", { class: "sha256", text: artifact.sha256 })),
          el("td", { text: formatTime(artifact.expires_at) }),
        ),
      ),
    );
  const byName = new Map(artifacts.map((artifact) => [artifact.name, artifact]));
  const resolve = (target) => byName.get(target.replace(/^\.\//, ""))?.url ?? null;
  for (const [name, target] of [
    ["report.md", "report"],
    ["README.md", "model-card"],
  ]) {
    const artifact = byName.get(name);
    if (artifact)
      document.getElementById(target).replaceChildren(...renderMarkdown(await markdownOf(artifact), resolve));
  }
}

async function cancel() {
  try {
    showJob(await api(`/v1/jobs/${jobId}/cancel`, { method: "POST" }));
  } catch (error) {
    showError(error);
  }
}

async function deleteArtifacts() {
  if (!confirm("Delete this job's artifacts? Their links stop working.")) return;
  try {
    await api(`/v1/jobs/${jobId}`, { method: "DELETE" });
    document.querySelector("#artifacts tbody").replaceChildren();
    for (const id of ["report", "model-card"]) document.getElementById(id).replaceChildren();
    document.getElementById("artifacts-note").textContent = "The artifacts were deleted.";
  } catch (error) {
    showError(error);
  }
}

start(async () => {
  document.getElementById("cancel").addEventListener("click", cancel);
  document.getElementById("delete").addEventListener("click", deleteArtifacts);
  showJob(await api(`/v1/jobs/${jobId}`));
  setInterval(() => {
    const duration = document.getElementById("duration");
    if (duration && !isFinished(job)) duration.textContent = formatDuration(job);
  }, DURATION_TICK_MS);
  await follow();
});
