// A budget job's front (`result.frontier`: the points no other point beats in both size and perplexity, and the
// pick) as perplexity against bytes with the pick marked, and as a table; above them, when the sweep handed back
// the dense model, the sentence that says why.
import { el, formatBytes } from "./api.js";

const SVG = "http://www.w3.org/2000/svg";
const WIDTH = 640;
const HEIGHT = 300;
const MARGIN = { left: 64, right: 24, top: 16, bottom: 44 };

function svg(tag, attributes = {}, ...children) {
  const node = document.createElementNS(SVG, tag);
  for (const [name, value] of Object.entries(attributes)) {
    if (name === "text") node.textContent = value;
    else node.setAttribute(name, value);
  }
  node.append(...children);
  return node;
}

const firstPerplexity = (point) => Object.values(point.perplexity)[0];
const samePoint = (a, b) => a.ratio === b.ratio && a.format === b.format && a.variant === b.variant;
export const pointName = (point) => `${point.dense ? "dense" : `ratio ${point.ratio}`}, ${point.variant}`;

// A linear scale from [low, high] onto [from, to]; a single value lands in the middle.
function scale(low, high, from, to) {
  return (value) => (high === low ? (from + to) / 2 : from + ((value - low) / (high - low)) * (to - from));
}

// A five-pointed star around (x, y): the pick, as frontier.png marks it.
function star(x, y, radius, label) {
  const corners = Array.from({ length: 10 }, (_, index) => {
    const angle = -Math.PI / 2 + (index * Math.PI) / 5;
    const r = index % 2 ? radius / 2.5 : radius;
    return `${(x + r * Math.cos(angle)).toFixed(1)},${(y + r * Math.sin(angle)).toFixed(1)}`;
  });
  return svg("polygon", { class: "pick", points: corners.join(" ") }, svg("title", { text: label }));
}

function plot(points, pick, target, text) {
  const budget = target.max_bytes ?? null;
  const sizes = [...points.map((point) => point.bytes), ...(budget === null ? [] : [budget])];
  const perplexities = points.map(firstPerplexity);
  const x = scale(Math.min(...sizes), Math.max(...sizes), MARGIN.left, WIDTH - MARGIN.right);
  const y = scale(Math.min(...perplexities), Math.max(...perplexities), HEIGHT - MARGIN.bottom, MARGIN.top);
  const front = points.filter((point) => point.on_front !== false);
  const chart = svg(
    "svg",
    { viewBox: `0 0 ${WIDTH} ${HEIGHT}`, role: "img", "aria-label": `perplexity (${text}) against bytes` },
    svg("line", { class: "axis", x1: MARGIN.left, y1: HEIGHT - MARGIN.bottom, x2: WIDTH - MARGIN.right, y2: HEIGHT - MARGIN.bottom }),
    svg("line", { class: "axis", x1: MARGIN.left, y1: MARGIN.top, x2: MARGIN.left, y2: HEIGHT - MARGIN.bottom }),
    svg("text", { x: WIDTH / 2, y: HEIGHT - 8, "text-anchor": "middle", text: "bytes" }),
    svg("text", { x: 12, y: HEIGHT / 2, transform: `rotate(-90 12 ${HEIGHT / 2})`, "text-anchor": "middle", text: `perplexity, ${text}` }),
    svg("polyline", {
      class: "front",
      points: front.map((point) => `${x(point.bytes).toFixed(1)},${y(firstPerplexity(point)).toFixed(1)}`).join(" "),
    }),
  );
  for (const [value, anchor] of [
    [Math.min(...sizes), "start"],
    [Math.max(...sizes), "end"],
  ])
    chart.append(svg("text", { x: x(value), y: HEIGHT - MARGIN.bottom + 16, "text-anchor": anchor, text: formatBytes(value) }));
  for (const value of new Set([Math.min(...perplexities), Math.max(...perplexities)]))
    chart.append(svg("text", { x: MARGIN.left - 6, y: y(value) + 4, "text-anchor": "end", text: value.toFixed(1) }));
  if (budget !== null)
    chart.append(
      svg(
        "line",
        { class: "budget", x1: x(budget), y1: MARGIN.top, x2: x(budget), y2: HEIGHT - MARGIN.bottom },
        svg("title", { text: `budget: ${budget.toLocaleString("en")} bytes` }),
      ),
    );
  for (const point of points) {
    const cx = x(point.bytes);
    const cy = y(firstPerplexity(point));
    chart.append(
      samePoint(point, pick)
        ? star(cx, cy, 11, `pick: ${pointName(point)}`)
        : svg("circle", { class: point.dense ? "point dense" : "point", cx, cy, r: 4 }, svg("title", { text: pointName(point) })),
    );
  }
  return chart;
}

function table(points, pick, text) {
  const head = ["point", "bytes", "parameters", `perplexity (${text})`, "within target"];
  return el(
    "table",
    { id: "front-table" },
    el("caption", { text: "The front: no other point is both smaller and lower in perplexity" }),
    el("thead", {}, el("tr", {}, ...head.map((name) => el("th", { scope: "col", text: name })))),
    el(
      "tbody",
      {},
      ...points.map((point) =>
        el(
          "tr",
          { class: samePoint(point, pick) ? "pick" : null },
          el("th", { scope: "row", text: `${pointName(point)}${samePoint(point, pick) ? " (pick)" : ""}` }),
          el("td", { text: point.bytes.toLocaleString("en") }),
          el("td", { text: point.params.toLocaleString("en") }),
          el("td", { text: firstPerplexity(point)?.toFixed(3) ?? "-" }),
          el("td", { text: point.within_target ? "yes" : "no" }),
        ),
      ),
    ),
  );
}

// The elements that show `frontier` (a job result's): the dense pick's reason, the plot, the table. The pick is
// drawn even where it is not on the front (target.candidates "pruned" with a better dense point).
export function renderFront(frontier) {
  const pick = frontier.pick;
  const points = [...frontier.front];
  if (!points.some((point) => samePoint(point, pick))) points.push({ ...pick, on_front: false });
  points.sort((a, b) => a.bytes - b.bytes);
  const text = Object.keys(pick.perplexity)[0];
  return [
    ...(frontier.dense_pick ? [el("p", { id: "dense-pick", text: `Why the dense model: ${frontier.dense_pick}.` })] : []),
    plot(points, pick, frontier.target, text),
    el("div", { class: "scroll" }, table(points, pick, text)),
  ];
}
