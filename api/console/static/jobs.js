// The jobs list: GET /v1/jobs, filtered by status, a page at a time (`after`: the last id of the page before).
import { api, askedFor, el, formatDuration, formatTime, isFinished, start } from "./api.js";

// Jobs a page: ?limit= in the address, as the API's own query (1 to 100).
const PAGE_SIZE = new URLSearchParams(location.search).get("limit") ?? 20;
const rows = document.querySelector("#jobs tbody");
const statusSelect = document.getElementById("status");
const previous = document.getElementById("previous");
const next = document.getElementById("next");
// While a job on the page is queued or running, the page is read again this often.
const REFRESH_MS = 5000;
// The `after` of each page shown so far: the last is this page's.
let cursors = [null];
let refresh = null;

function row(job) {
  const link = el("a", { href: `/console/jobs/${job.id}`, text: job.id.slice(0, 8) });
  const achieved = job.result?.achieved_ratio;
  return el(
    "tr",
    { "data-job-id": job.id },
    el("td", {}, link),
    el("td", {}, el("span", { class: `status ${job.status}`, text: job.status })),
    el("td", { class: "model", text: job.model.split("/").slice(-2).join("/"), title: job.model }),
    el("td", { text: askedFor(job) }),
    el("td", { text: achieved === undefined ? "" : achieved.toFixed(4) }),
    el("td", { text: formatTime(job.created_at) }),
    el("td", { text: formatDuration(job) }),
  );
}

async function show() {
  const query = new URLSearchParams({ limit: PAGE_SIZE });
  const after = cursors.at(-1);
  if (after) query.set("after", after);
  if (statusSelect.value) query.set("status", statusSelect.value);
  const page = await api(`/v1/jobs?${query}`);
  rows.replaceChildren(...page.data.map(row));
  document.getElementById("no-jobs").hidden = page.data.length > 0;
  previous.disabled = cursors.length === 1;
  next.disabled = !page.has_more;
  next.dataset.after = page.data.at(-1)?.id ?? "";
  clearTimeout(refresh);
  if (page.data.some((job) => !isFinished(job))) refresh = setTimeout(show, REFRESH_MS);
}

start(async () => {
  statusSelect.value = new URLSearchParams(location.search).get("status") ?? "";
  statusSelect.addEventListener("change", () => {
    const url = new URL(location.href);
    if (statusSelect.value) url.searchParams.set("status", statusSelect.value);
    else url.searchParams.delete("status");
    history.replaceState(null, "", url);
    cursors = [null];
    show();
  });
  next.addEventListener("click", () => {
    cursors.push(next.dataset.after);
    show();
  });
  previous.addEventListener("click", () => {
    cursors.pop();
    show();
  });
  await show();
});
