// The Markdown that casp writes (report.md, the model card): front matter, headings, paragraphs, lists, tables,
// fenced code, and inline code, bold, links and images. Built as DOM nodes, so no text is ever read as HTML.
// `resolve` turns a relative link (`plots/layer_ratio.png`) into the artifact's signed URL, or null; an image
// that resolves to nothing is shown as its text, so the page never loads anything from elsewhere.
import { el } from "./api.js";

const INLINE = /(`[^`]+`)|(\*\*[^*]+\*\*)|(!?\[[^\]]*\]\([^)\s]+\))/g;

// Inline Markdown (code, bold, links, images) as nodes; with no `resolve`, links and images are their text.
export function inline(text, resolve = () => null) {
  const nodes = [];
  let last = 0;
  for (const match of text.matchAll(INLINE)) {
    nodes.push(text.slice(last, match.index));
    const [token] = match;
    if (match[1]) nodes.push(el("code", { text: token.slice(1, -1) }));
    else if (match[2]) nodes.push(el("strong", { text: token.slice(2, -2) }));
    else {
      const image = token.startsWith("!");
      const [, label, target] = /^!?\[([^\]]*)\]\(([^)]+)\)$/.exec(token);
      const url = resolve(target);
      if (image) nodes.push(url ? el("img", { src: url, alt: label || target }) : label);
      else nodes.push(url ? el("a", { href: url, text: label }) : label);
    }
    last = match.index + token.length;
  }
  nodes.push(text.slice(last));
  return nodes.filter((node) => node !== "");
}

function cells(line) {
  return line
    .replace(/^\|/, "")
    .replace(/\|$/, "")
    .split("|")
    .map((cell) => cell.trim());
}

export function renderMarkdown(text, resolve) {
  const lines = text.replace(/\r\n?/g, "\n").split("\n");
  const blocks = [];
  let i = 0;
  if (lines[0] === "---") {
    const end = lines.indexOf("---", 1);
    if (end > 0) {
      blocks.push(
        el("details", {}, el("summary", { text: "metadata" }), el("pre", { text: lines.slice(1, end).join("\n") })),
      );
      i = end + 1;
    }
  }
  while (i < lines.length) {
    const line = lines[i];
    if (!line.trim()) {
      i += 1;
    } else if (line.startsWith("```")) {
      const end = lines.findIndex((candidate, at) => at > i && candidate.startsWith("```"));
      const stop = end < 0 ? lines.length : end;
      blocks.push(el("pre", {}, el("code", { text: lines.slice(i + 1, stop).join("\n") })));
      i = stop + 1;
    } else if (/^#{1,6} /.test(line)) {
      const level = Math.min(6, line.indexOf(" ") + 2); // the page's own headings are h1 and h2
      blocks.push(el(`h${level}`, {}, ...inline(line.slice(line.indexOf(" ") + 1), resolve)));
      i += 1;
    } else if (line.startsWith("|") && /^\|[\s|:-]+\|$/.test(lines[i + 1] ?? "")) {
      const head = el("tr", {}, ...cells(line).map((cell) => el("th", { scope: "col" }, ...inline(cell, resolve))));
      const body = [];
      for (i += 2; i < lines.length && lines[i].startsWith("|"); i += 1) {
        body.push(el("tr", {}, ...cells(lines[i]).map((cell) => el("td", {}, ...inline(cell, resolve)))));
      }
      blocks.push(el("div", { class: "scroll" }, el("table", {}, el("thead", {}, head), el("tbody", {}, ...body))));
    } else if (/^[-*] /.test(line)) {
      const items = [];
      for (; i < lines.length && /^[-*] /.test(lines[i]); i += 1)
        items.push(el("li", {}, ...inline(lines[i].slice(2), resolve)));
      blocks.push(el("ul", {}, ...items));
    } else {
      const paragraph = [];
      for (; i < lines.length && lines[i].trim() && !/^(#{1,6} |```|\||[-*] )/.test(lines[i]); i += 1)
        paragraph.push(lines[i]);
      if (!paragraph.length) paragraph.push(lines[i++]); // a line no other block takes
      blocks.push(el("p", {}, ...inline(paragraph.join(" "), resolve)));
    }
  }
  return blocks;
}
