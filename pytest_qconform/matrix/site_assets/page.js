// The page's script: decode the embedded merged matrix, then filter, sort and display it.
// It computes no verdict, summary, floor or trend: pytest_qconform/matrix/site_data.py serialises
// those from the merged model, so the page says what reports/MATRIX.md says. Every text from a
// report is set with textContent (never parsed as HTML); links are followed only when http(s).
"use strict";

const FILTERS = ["arch", "backend", "operation", "format", "dtype", "version", "state"];
const ALL = "";
let DATA = null;
let SELECTED = null; // "rowIndex@arch"

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (name === "class") node.className = value;
    else if (name === "style") Object.assign(node.style, value);
    else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else node.setAttribute(name, value === true ? "" : String(value));
  }
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function safeLink(href, text) {
  return /^https?:\/\//.test(href || "") ? el("a", { href, rel: "noopener noreferrer", target: "_blank" }, text) : text;
}

async function decode() {
  const b64 = document.getElementById("qconform-data").textContent.trim();
  const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
  const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("gzip"));
  return JSON.parse(await new Response(stream).text());
}

// ------------------------------------------------------------------ states and colours

function color(state) {
  return DATA.legend.colors[state] || DATA.legend.colors.other;
}
function isDark(state) {
  return ["pass", "fail", "crashed", "timeout", "disagree"].includes(state);
}
function word(state) {
  return DATA.legend.words[state] || state;
}
function shortWord(state) {
  return DATA.legend.short[state] || state;
}
function rank(state) {
  const i = DATA.legend.order.indexOf(state);
  return i < 0 ? DATA.legend.order.length : i;
}
function swatch(state) {
  return el("span", { class: "swatch", style: { background: color(state) } });
}
function chip(state, text) {
  return el("span", { class: "chip", title: DATA.legend.meaning[state] || state }, swatch(state), text);
}

// ------------------------------------------------------------------ filters and the URL

function filterValues() {
  const out = {};
  for (const name of [...FILTERS, "sort"]) out[name] = document.getElementById("f-" + name).value;
  return out;
}

function formatMatches(format, wanted) {
  return wanted === ALL || format === wanted || (wanted !== "-" && format.startsWith(wanted + "-"));
}

// The state a cell shows: the merged (newest version's) state, or, with a backend version
// chosen, what that version said (null: that version did not cover the cell).
function shownState(entry, version) {
  if (version === ALL) return entry.state;
  const [backend, v] = version.split(" ");
  if (DATA.rows[entry.row][0] !== backend) return null;
  const found = entry.by_version.find((pair) => pair[0] === v);
  return found ? found[1] : null;
}

function shownMultiple(entry, version) {
  if (version === ALL) return entry.multiple_text;
  const v = version.split(" ")[1];
  const texts = entry.history.filter((h) => h[0] === v && h[3] !== "-").map((h) => h[3]);
  return texts.length ? texts[0] : "";
}

function readHash() {
  const params = new URLSearchParams(location.hash.replace(/^#/, ""));
  for (const name of [...FILTERS, "sort"]) {
    const select = document.getElementById("f-" + name);
    const value = params.get(name);
    if (value !== null && [...select.options].some((o) => o.value === value)) select.value = value;
  }
  const cell = params.get("cell");
  if (cell) {
    const at = cell.lastIndexOf("@");
    const key = cell.slice(0, at);
    const row = DATA.rows.findIndex((r) => r.join("|") === key);
    if (row >= 0) SELECTED = row + "@" + cell.slice(at + 1);
  }
}

function writeHash() {
  const params = new URLSearchParams();
  const values = filterValues();
  for (const name of FILTERS) if (values[name] !== ALL) params.set(name, values[name]);
  if (values.sort !== "worst") params.set("sort", values.sort);
  if (SELECTED) {
    const [row, arch] = SELECTED.split("@");
    params.set("cell", DATA.rows[+row].join("|") + "@" + arch);
  }
  const hash = params.toString();
  history.replaceState(null, "", hash ? "#" + hash : location.pathname + location.search);
}

function fillSelect(name, values, label) {
  const select = document.getElementById("f-" + name);
  select.replaceChildren(el("option", { value: ALL }, "all"));
  for (const value of values) select.append(el("option", { value }, label ? label(value) : value));
}

// ------------------------------------------------------------------ the matrix

function visibleCells() {
  const f = filterValues();
  const archs = DATA.columns.filter((a) => f.arch === ALL || a === f.arch);
  const rows = new Map();
  for (const entry of DATA.entries) {
    if (!archs.includes(entry.arch)) continue;
    const [backend, operation, format, dtype] = DATA.rows[entry.row];
    if (f.backend !== ALL && backend !== f.backend) continue;
    if (f.operation !== ALL && operation !== f.operation) continue;
    if (!formatMatches(format, f.format)) continue;
    if (f.dtype !== ALL && dtype !== f.dtype) continue;
    const state = shownState(entry, f.version);
    if (state === null) continue;
    if (f.state !== ALL && state !== f.state) continue;
    if (!rows.has(entry.row)) rows.set(entry.row, new Map());
    rows.get(entry.row).set(entry.arch, { entry, state, multiple: shownMultiple(entry, f.version) });
  }
  const order = [...rows.keys()];
  const worst = (row) => Math.min(...[...rows.get(row).values()].map((c) => rank(c.state)));
  if (f.sort === "worst") order.sort((a, b) => worst(a) - worst(b) || a - b);
  else order.sort((a, b) => a - b);
  return { archs, rows, order };
}

function renderGrid() {
  const { archs, rows, order } = visibleCells();
  const grid = document.getElementById("grid");
  grid.tHead.replaceChildren(
    el("tr", {}, ["backend", "operation", "format", "dtype"].map((h) => el("th", {}, h)), archs.map((a) => el("th", {}, a))),
  );
  const body = document.createDocumentFragment();
  let cells = 0;
  for (const row of order) {
    const [backend, operation, format, dtype] = DATA.rows[row];
    const here = rows.get(row);
    const failing = [...here.values()].some((c) => DATA.legend.failing.includes(c.state));
    const tr = el("tr", { class: failing ? "failing" : null, "data-row": row },
      [backend, operation, format, dtype].map((text) => el("td", { class: "key" }, text)));
    for (const arch of archs) {
      const found = here.get(arch);
      if (!found) {
        tr.append(el("td", { class: "empty", title: "no run on " + arch + " covered this cell" }, "·"));
        continue;
      }
      cells += 1;
      const id = row + "@" + arch;
      const text = found.state === "pass" || found.state === "fail"
        ? found.multiple || shortWord(found.state)
        : shortWord(found.state) + (found.multiple ? " " + found.multiple : "");
      tr.append(el("td", {
        class: "cell" + (isDark(found.state) ? " dark" : "") + (id === SELECTED ? " selected" : ""),
        style: { background: color(found.state) },
        title: word(found.state) + (found.multiple ? ", worst " + found.multiple + " × bound" : ""),
        "data-key": DATA.rows[row].join("|"),
        "data-arch": arch,
        "data-state": found.state,
        onclick: () => select(id),
      }, text));
    }
    body.append(tr);
  }
  const arch = filterValues().arch;
  if (arch !== ALL && !DATA.columns.includes(arch)) {
    const known = DATA.sections.flatMap((s) => s.archs.filter((a) => a.arch === arch).map((a) => `${s.backend}: ${a.status} (${s.source})`));
    body.append(el("tr", {}, el("td", { colspan: 5, class: "not-run", id: "grid-not-run" },
      `No report from ${arch}: nothing was computed there, so no cell has a verdict.` +
      (known.length ? ` ${known.join("; ")}; every other backend: not run.` : ""))));
  }
  grid.tBodies[0].replaceChildren(body);
  document.getElementById("shown").textContent =
    `${cells} cells in ${order.length} rows shown of ${DATA.entries.length} cells` +
    (filterValues().sort === "worst" ? "; the worst verdict first" : "; by name");
}

function select(id) {
  SELECTED = id;
  for (const td of document.querySelectorAll("#grid td.selected")) td.classList.remove("selected");
  const [row, arch] = id.split("@");
  const td = document.querySelector(`#grid td.cell[data-arch="${CSS.escape(arch)}"][data-key="${CSS.escape(DATA.rows[+row].join("|"))}"]`);
  if (td) td.classList.add("selected");
  renderDetail();
  writeHash();
}

// ------------------------------------------------------------------ a cell's detail

const REPRO_WORDS = {
  failure: "Reproduce the first failing case (the command the report stored):",
  "known-failure": "Reproduce the known failure (its entry's repro in known_failures.toml):",
  rerun: "Re-run this cell's checks (the narrowest the options allow: it also runs the other operations of this backend, format family and dtype; reports store a test-level repro for failing cells only):",
};

function cellOf(run, key) {
  if (!run._cells) run._cells = new Map(run.report.cells.map((c) => [[c.backend, c.operation, c.format, c.dtype].join("|"), c]));
  return run._cells.get(key);
}

function renderDetail() {
  const aside = document.getElementById("detail");
  if (!SELECTED) return;
  const [rowText, arch] = SELECTED.split("@");
  const row = +rowText;
  const entry = DATA.entries.find((e) => e.row === row && e.arch === arch);
  if (!entry) return;
  const key = DATA.rows[row].join("|");
  const current = new Set(entry.runs.map((r) => r[0]));
  const counted = entry.runs.map(([run]) => cellOf(DATA.runs[run], key));
  const cases = counted.reduce((n, c) => n + (c ? c.cases : 0), 0);
  const parts = [
    el("h3", {}, DATA.rows[row].join(" · "), " on ", arch),
    el("span", { class: "state", style: { background: color(entry.state), color: isDark(entry.state) ? "#fff" : "#000" } }, word(entry.state)),
  ];
  const facts = el("dl", {},
    el("dt", {}, "cases"), el("dd", { id: "detail-cases" }, String(cases) + (entry.runs.length > 1 ? ` (in ${entry.runs.length} runs)` : "")),
    el("dt", {}, "worst error"),
    el("dd", { id: "detail-multiple" }, entry.multiple_text ? `${entry.multiple_text} × its bound (≤ 1 is within bound)` : "none judged"),
    entry.by_version.length > 1 ? el("dt", {}, "by version") : null,
    entry.by_version.length > 1
      ? el("dd", { id: "detail-versions" }, DATA.rows[row][0] + " " + entry.by_version.map(([v, verdict]) => `${v} ${word(verdict)}`).join(" → "))
      : null,
    el("dt", {}, "from"),
    el("dd", {}, entry.runs.map(([run, verdict], i) => [i ? "; " : "", DATA.runs[run].label, ` (${verdict}, `,
      DATA.rows[row][0], " ", DATA.runs[run].backends[DATA.rows[row][0]] || "?", ")"])));
  parts.push(facts);
  if (entry.known) {
    const k = entry.known;
    parts.push(el("h3", {}, "Known failure"), el("p", { id: "detail-known" }, k.what),
      el("p", {}, "Source: ", safeLink(k.link, k.link_text || k.link), k.entry ? ` · entry ${k.entry}` : "",
        k.not_run ? " · not run: it ends the process" : ""));
  }
  const reasons = counted.filter((c) => c && c.reason && c.verdict !== "known-failure").map((c) => c.reason);
  if (reasons.length) parts.push(el("h3", {}, "Reason"), el("p", {}, [...new Set(reasons)].join("; ")));
  const failure = counted.find((c) => c && c.first_failure);
  if (failure) parts.push(el("h3", {}, "First failure"), el("pre", { class: "command" }, failure.first_failure.message));
  parts.push(el("h3", {}, "Repro"));
  entry.repros.forEach((repro, i) => {
    parts.push(el("p", { class: "muted" }, REPRO_WORDS[repro.kind] || repro.kind, repro.source ? ` From ${repro.source}.` : ""),
      el("pre", { class: "command", id: i === 0 ? "detail-repro" : null, "data-kind": repro.kind }, repro.command));
  });
  parts.push(el("h3", {}, "Reports and versions"));
  parts.push(el("div", { id: "detail-history" }, entry.history.map(([version, verdict, run, multiple]) => {
    const r = DATA.runs[run];
    const c = cellOf(r, key);
    return el("div", { class: "evidence" },
      el("div", {}, swatch(verdict), " ", el("b", {}, `${DATA.rows[row][0]} ${version || "(version unknown)"}`), `: ${word(verdict)}`,
        c ? `, ${c.cases} case${c.cases === 1 ? "" : "s"}` : "", multiple !== "-" ? `, worst ${multiple}` : "",
        current.has(run) ? " (counted: the newest version)" : " (an older version)"),
      el("div", { class: "muted" }, `${r.label}: ${r.device}, torch ${r.torch}, triton ${r.triton}, ${r.accelerator}; ${r.suite}; created ${r.created}`));
  })));
  parts.push(el("p", { class: "muted" }, "Link to this cell: the page's address now ends with its filters and the cell."));
  aside.replaceChildren(...parts);
}

// ------------------------------------------------------------------ the other sections

function table(header, rows, attrs) {
  return el("table", Object.assign({ class: "plain" }, attrs || {}),
    el("tr", {}, header.map((h) => el("th", {}, h))),
    rows.map((r) => el("tr", {}, r.map((v) => el("td", {}, v)))));
}

function showCells(filters) {
  for (const name of FILTERS) document.getElementById("f-" + name).value = filters[name] || ALL;
  SELECTED = null;
  refresh();
  document.getElementById("matrix").scrollIntoView();
}

function renderOverview() {
  const backends = DATA.options.backend;
  const panels = backends.map((backend) => {
    const boxes = DATA.overview.filter((o) => o.backend === backend);
    const operations = [...new Set(boxes.map((o) => o.operation))];
    const archs = DATA.columns.filter((a) => boxes.some((o) => o.arch === a));
    return el("div", { class: "panel" }, el("h3", {}, backend),
      el("table", { class: "heat" }, el("thead", {}, el("tr", {}, el("th"), archs.map((a) => el("th", {}, a)))),
        operations.map((op) => el("tr", {}, el("th", {}, op), archs.map((arch) => {
          const o = boxes.find((b) => b.operation === op && b.arch === arch);
          if (!o) return el("td", { class: "none" });
          const counts = o.counts.map(([name, n]) => `${n} ${shortWord(name)}`).join(" · ");
          return el("td", {
            class: (isDark(o.state) ? "dark" : "") + (o.regressed ? " regressed" : ""),
            style: { background: color(o.state) },
            title: "show these cells in the matrix",
            onclick: () => showCells({ backend, operation: op, arch }),
          }, counts, o.worst_text ? el("br") : null, o.worst_text ? "worst " + o.worst_text : null,
          o.versions ? el("br") : null, o.versions || null);
        })))));
  });
  document.getElementById("overview-panels").replaceChildren(el("div", { class: "panels" }, panels));
}

function cellLink(row, arch, text) {
  return el("a", { class: "cell-link", onclick: () => { showCells({ arch, backend: DATA.rows[row][0] }); select(row + "@" + arch); } },
    text || DATA.rows[row].join(" · "));
}

function renderVersions() {
  const body = document.getElementById("versions-body");
  const intro = el("p", { class: "muted" }, "Per arch and backend tested with several of its versions: the matrix shows the newest " +
    "version's verdicts; a floor is the version from which every cell that passes now passed; a regression is a cell that " +
    "passed in a version and fails in a later one. Choose a backend version above to see what that version said.");
  if (!DATA.versions.length) {
    body.replaceChildren(intro, el("p", {}, "Every arch and backend was tested with one version of it: no floor or regression to read."));
    return;
  }
  body.replaceChildren(intro, table(
    ["arch", "backend", "versions tested", "works from", "regressions", "cells failing in the newest", "other versions that differ"],
    DATA.versions.map((v) => [v.arch, v.backend, v.versions.join(", "), v.works_from,
      v.regressed_cells.length
        ? el("details", {}, el("summary", {}, v.regressions), v.regressed_cells.map(([row, good, bad, verdict]) =>
          el("div", {}, cellLink(row, v.arch), ` (${good} pass → ${bad} ${verdict})`)))
        : v.regressions,
      `${v.failing_newest} (${v.known_newest} known failures)`, v.other_differences.join("; ") || "-"]),
    { id: "versions-table" }));
}

function renderTrend() {
  const body = document.getElementById("trend-body");
  const intro = el("p", { class: "muted" }, "Per backend and arch tested with several of its versions: each version's cells by " +
    "verdict, and the cells whose verdict changed between versions (a cell only one version covered is counted, not listed).");
  if (!DATA.trend.length) {
    body.replaceChildren(intro, el("p", {}, "No backend was tested with more than one version on an arch: no trend yet."));
    return;
  }
  body.replaceChildren(intro, ...DATA.trend.map((t) => el("div", { class: "trend" },
    el("h3", {}, `${t.backend} on ${t.arch}`),
    t.other_differences.length ? el("p", { class: "muted" }, "Between these runs also differ: " + t.other_differences.join("; ") +
      " (a change may be theirs).") : null,
    t.versions.map((version, i) => {
      const total = t.counts[i].reduce((n, c) => n + c[1], 0);
      return el("div", { style: { display: "flex", gap: "8px", alignItems: "center", margin: "3px 0" } },
        el("span", { style: { width: "120px" } }, version),
        el("span", { class: "bar" }, t.counts[i].map(([state, n]) => el("span", {
          style: { width: (100 * n / total) + "%", background: color(state) }, title: `${n} ${word(state)}` }))),
        el("span", {}, t.counts[i].map(([state, n]) => `${n} ${word(state)}`).join(" · ")));
    }),
    t.transitions.map(([transition, n, cells]) => el("details", {},
      el("summary", {}, `${n} cell${n > 1 ? "s" : ""}: ${transition.join(" → ")}`),
      cells.map(([row, said]) => el("div", {}, cellLink(row, t.arch), " ", said.map(([v, verdict]) => `${v} ${verdict}`).join(" → "))))))));
}

function renderRuns() {
  const backends = [...new Set(DATA.runs.flatMap((r) => Object.keys(r.backends)))].sort();
  document.getElementById("runs-body").replaceChildren(table(
    ["target", "host", "device", "torch", "triton", "cuda/hip", ...backends, "suite", "created", "report"],
    DATA.runs.map((r) => [r.arch, r.host, r.device, r.torch, r.triton, r.accelerator, ...backends.map((b) => r.backends[b] || "-"),
      r.suite, r.created + (r.stale ? " (stale)" : ""), r.label])));
}

function renderSections() {
  const body = document.getElementById("sections-body");
  const arch = filterValues().arch;
  if (!DATA.sections.length) {
    body.replaceChildren(el("p", { class: "muted" }, "No section was merged (a backend's tool writes one into reports/, e.g. nox -s compile-check)."));
    return;
  }
  body.replaceChildren(...DATA.sections.flatMap((s) => (s.archs.length
    ? [el("h3", {}, `${s.title} (${s.backend})`),
      el("p", { class: "muted" }, `Archs without a run report: ${s.explanation}. Every other backend: not run.`),
      table(["arch", "kind", "family", "wave", s.backend, "other backends"],
        s.archs.map((a) => [a.arch, a.kind, a.family, String(a.wave), a.status, "not run"]), { id: `section-${s.backend}` })]
    : [el("p", { class: "muted" }, `${s.title} (${s.backend}, ${s.source}): every arch it covers has a run report.`)])));
  if (arch !== ALL) for (const tr of body.querySelectorAll("tr")) if (tr.cells[0].tagName === "TD" && tr.cells[0].textContent !== arch) tr.hidden = true;
}

function renderNotes() {
  const n = DATA.notes;
  const parts = [];
  if (n.not_run_yet.length) parts.push(el("p", {}, el("b", {}, "Not run yet"), " (archs the project knows with no report): " + n.not_run_yet.join(", ")));
  if (n.contract_revisions.length) parts.push(el("p", {}, el("b", {}, "Different contract revisions"),
    " (a verdict that differs between them may come from the contract, not the library): ",
    n.contract_revisions.map(([rev, labels]) => `${rev === null ? "no revision" : "revision " + rev}: ${labels.join(", ")}`).join("; ")));
  if (n.stale.length) parts.push(el("p", {}, el("b", {}, "Stale reports"), ` (created more than ${n.max_age_days} days before the merge; counted): `,
    n.stale.map(([label, arch, created]) => `${label} (${arch}, ${created})`).join("; ")));
  if (n.empty.length) parts.push(el("p", {}, el("b", {}, "Empty reports"), " (no judged cell; not merged): ",
    n.empty.map(([label, arch, created, benchmarks]) => `${label} (${arch}, ${created}${benchmarks ? ", " + benchmarks + " benchmarks only" : ""})`).join("; ")));
  if (n.superseded.length) parts.push(el("p", {}, el("b", {}, "Superseded reports"), ": ",
    n.superseded.map(([old, created, by]) => `${old} (${created}), superseded by ${by}`).join("; ")));
  if (n.simulated.length) parts.push(el("p", {}, el("b", {}, "Excluded simulated reports"), " (nothing was computed): ",
    n.simulated.map(([label, arch]) => `${label} (${arch})`).join("; ")));
  document.getElementById("notes-body").replaceChildren(...(parts.length ? parts : [el("p", { class: "muted" }, "Nothing to note.")]));
}

function renderHeader() {
  const runs = DATA.runs.length;
  document.getElementById("about").textContent = runs
    ? `Merged from ${runs} run report${runs > 1 ? "s" : ""} (${DATA.runs.map((r) => r.label).join(", ")}) by ${DATA.generator}; ` +
      `each cell shows the newest backend version's verdict and its worst error as a multiple of the derived bound.`
    : "No run reports merged yet: run pytest --qconform on a runner, commit its report under reports/, then nox -s matrix.";
  const counts = new Map();
  for (const e of DATA.entries) counts.set(e.state, (counts.get(e.state) || 0) + 1);
  document.getElementById("totals").replaceChildren(...DATA.legend.order.filter((s) => counts.has(s)).map((s) => chip(s, `${counts.get(s)} ${word(s)}`)));
  document.getElementById("legend").replaceChildren("Colours: ", ...DATA.legend.order.map((s) => chip(s, word(s))),
    el("span", { class: "muted" }, "· blank: no run on that arch covered the cell"));
}

function refresh() {
  renderGrid();
  renderSections();
  if (SELECTED) renderDetail();
  writeHash();
}

async function main() {
  try {
    DATA = await decode();
  } catch (error) {
    document.getElementById("about").textContent = "This browser could not decode the embedded matrix (" + error + "); read reports/MATRIX.md instead.";
    document.body.dataset.ready = "error";
    return;
  }
  const o = DATA.options;
  // Archs without a run are choices too: choosing one says what the sections know there.
  const unrun = [...new Set(DATA.sections.flatMap((s) => s.archs.map((a) => a.arch)))].filter((a) => !o.arch.includes(a));
  fillSelect("arch", [...o.arch, ...unrun], (a) => (o.arch.includes(a) ? a : a + " (not run)"));
  fillSelect("backend", o.backend);
  fillSelect("operation", o.operation);
  fillSelect("format", o.format, (f) => (f.includes("-") || f === "-" ? f : f + " (every blocksize)"));
  fillSelect("dtype", o.dtype);
  fillSelect("version", o.version);
  document.querySelector("#f-version option").textContent = "newest (merged)";
  fillSelect("state", o.state, word);
  readHash();
  for (const name of [...FILTERS, "sort"]) {
    document.getElementById("f-" + name).addEventListener("change", () => {
      if (name === "version" && filterValues().version !== ALL) document.getElementById("f-backend").value = filterValues().version.split(" ")[0];
      refresh();
    });
  }
  document.getElementById("f-reset").addEventListener("click", () => showCells({}));
  renderHeader();
  renderOverview();
  renderVersions();
  renderTrend();
  renderRuns();
  renderNotes();
  refresh();
  if (SELECTED) select(SELECTED);
  document.body.dataset.ready = "1";
}

main();
