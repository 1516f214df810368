// The result's figures side by side: dense against pruned and, after recovery, the recovered model that was
// published (the last column compares it with dense). report.md, below them on the page, has them all.
import { el } from "./api.js";

const count = (value) => value.toLocaleString("en");
const decimals = (value) => value.toFixed(3);

export function summaryRows(result) {
  const models = result.recovery ? ["dense", "pruned", "recovered"] : ["dense", "pruned"];
  const published = models.at(-1);
  const row = (name, figures, format) =>
    el(
      "tr",
      {},
      el("th", { scope: "row", text: name }),
      ...models.map((model) => el("td", { text: format(figures[model]) })),
      el("td", { text: figures.dense ? (figures[published] / figures.dense).toFixed(3) : "-" }),
    );
  const params = result.params;
  // Recovery trains the pruned weights; it keeps their number.
  const rows = [row(`parameters (${params.counted ?? "counted"})`, { ...params, recovered: params.pruned }, count)];
  for (const [dataset, ppl] of Object.entries(result.perplexity ?? {})) {
    const split = ppl.split ? `, ${ppl.split} split` : "";
    rows.push(row(`perplexity ${dataset} (${ppl.seq_len}-token windows${split})`, ppl, decimals));
  }
  for (const [task, accuracy] of Object.entries(result.zero_shot ?? {})) {
    rows.push(row(`accuracy ${task} (${count(accuracy.n_samples)} documents)`, accuracy, decimals));
  }
  const head = el(
    "tr",
    {},
    ...["", ...models, `${published} / dense`].map((text) => el("th", { scope: "col", text })),
  );
  return [head, ...rows];
}
