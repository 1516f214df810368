// The caller's usage against its limits: GET /v1/usage.
import { api, el, formatBytes, start } from "./api.js";

start(async () => {
  const usage = await api("/v1/usage");
  const facts = [
    ["Key", usage.key_name ?? "none (the server runs without keys)"],
    [
      "Jobs queued or running",
      usage.limits ? `${usage.active_jobs} of ${usage.limits.max_active_jobs}` : usage.active_jobs,
    ],
    [
      "Jobs submitted in the last minute",
      usage.limits
        ? `${usage.submissions_last_minute} of ${usage.limits.max_submissions_per_minute}`
        : usage.submissions_last_minute,
    ],
    ["Artifacts kept", `${usage.artifact_files} files, ${formatBytes(usage.storage_bytes)}`],
  ];
  document
    .getElementById("usage")
    .replaceChildren(
      ...facts.flatMap(([name, value]) => [el("dt", { text: name }), el("dd", { text: String(value) })]),
    );
});
