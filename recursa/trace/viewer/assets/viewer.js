// recursa trace viewer: a virtualised call tree, a canvas timeline, search, and lazy details.
// Data comes embedded (standalone HTML) or from ./trace.json (recursa view --port), polled while
// the run is still going. Only the rows in view are in the DOM, so 10,000+ nodes stay responsive.
"use strict";
(function () {
  const ROW_H = 22;
  const FOLD_CHARS = 2000;
  const KIND_LABEL = { run: "run", turn: "turn", call: "call", sub: "sub", exec: "repl", tool: "tool", compact: "compact" };
  const $ = (id) => document.getElementById(id);
  const t0 = performance.now();

  let embedded = false;  // data inside the page (no server to poll)
  let V = null;          // the view: {summary, nodes, details, roots, rows, warnings, ...}
  let N = [];            // nodes
  let depthOf = null;    // Int32Array: tree depth per node
  let expanded = new Set();
  let visible = [];      // node ids in display order
  let selected = -1;
  let parsed = new Map();  // node id -> parsed details
  let lower = null;      // lowercase search text per node, built on the first search
  let query = "";
  let matches = [];      // node ids matching the query, in id order
  let matchSet = null;   // Set of matches, or null without a query
  let keep = null;       // matches and their ancestors, or null without a query
  let tl = { start: 0, end: 1, rowH: 12, byRow: [] };  // timeline viewport and hit-test index

  // A trace is anyone's file: every value from it reaches the page through esc() (text and quoted
  // attributes), cls() (class names) or a number helper below (numbers only, whatever it was given).
  const esc = (s) => String(s).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
  const cls = (s) => String(s).replace(/[^A-Za-z0-9_-]/g, "");
  const num = (x) => { const v = Number(x); return Number.isFinite(v) ? v : 0; };
  const int = (n) => num(n).toLocaleString("en-US");
  const usd = (x) => { x = num(x); return x ? "$" + (x < 0.01 ? x.toFixed(5) : x.toFixed(4)) : "$0"; };
  const list = (x) => (Array.isArray(x) ? x : []);
  function secs(s) {
    if (s == null || isNaN(Number(s))) return "–";
    s = Number(s);
    if (s < 1) return (s * 1000).toFixed(s < 0.01 ? 2 : 0) + " ms";
    if (s < 120) return s.toFixed(2) + " s";
    return (s / 60).toFixed(1) + " min";
  }
  function detail(i) {
    let d = parsed.get(i);
    if (!d) { try { d = JSON.parse(V.details[i]); } catch (e) { d = {}; } parsed.set(i, d); }
    return d;
  }

  // ---- loading ----------------------------------------------------------------------------
  function start() {
    const el = $("trace-data");
    const raw = el ? el.textContent.trim() : "";
    if (raw) { embedded = true; init(JSON.parse(raw), false); return; }
    fetchView(true);
  }
  function fetchView(first) {
    fetch("trace.json", { cache: "no-store" }).then((r) => {
      if (!r.ok) return r.text().then((t) => { throw new Error(t || r.statusText); });
      return r.json();
    }).then((view) => init(view, !first)).catch((e) => {
      $("detail").innerHTML = '<p class="warn">Could not load the trace: ' + esc(e.message) + "</p>";
    });
  }

  function init(view, keepState) {
    V = view; N = view.nodes; parsed = new Map(); lower = null;
    depthOf = new Int32Array(N.length);
    for (const n of N) depthOf[n.i] = n.p >= 0 ? depthOf[n.p] + 1 : 0;
    if (!keepState) {
      expanded = new Set();
      for (const n of N) if (n.k === "run" && depthOf[n.i] === 0) expanded.add(n.i);
      for (const n of N) if (n.k === "turn" && n.p >= 0 && depthOf[n.p] === 0) expanded.add(n.i);
    }
    renderHeader();
    if (query) runSearch(query); else flatten();
    layoutTimeline(!keepState);
    renderTree();
    drawTimeline();
    if (!keepState && N.length) select(0, false);
    else if (selected >= 0 && selected < N.length) renderDetail(selected);
    const running = V.summary.stop_reason === "running";
    $("live").hidden = !running;
    if (running && !embedded) {
      setTimeout(() => fetchView(false), 2000);
    }
    window.__recursaViewer = { ready: true, loadMs: performance.now() - t0, sinceNavigationMs: performance.now(),
      nodes: N.length, visibleRows: visible.length };
    document.body.dataset.ready = "1";
  }

  function renderHeader() {
    const s = V.summary;
    $("file").textContent = V.file || "";
    const stats = [
      ["answer", s.answer == null ? "–" : String(s.answer).slice(0, 160)],
      ["runs", int(s.runs)], ["LM calls", int(s.llm_calls)], ["code executions", int(s.execs)],
      ["tokens", int(s.input_tokens) + " in / " + int(s.output_tokens) + " out"],
      ["cost", usd(s.cost_usd)], ["duration", secs(s.duration_s)], ["model", (s.model || "") + (s.sub_model ? " → " + s.sub_model : "")],
    ];
    $("summary").innerHTML =
      '<div class="q" title="click to unfold">' + '<span class="badge s-' + cls(s.stop_reason) + '">' + esc(s.stop_reason) + "</span> " +
      esc(s.question || "") + "</div>" +
      stats.map(([k, v]) => '<span class="stat"><span class="muted">' + k + "</span> <b>" + esc(v) + "</b></span>").join("");
    $("summary").querySelector(".q").onclick = (e) => e.currentTarget.classList.toggle("open");
    $("warnings").innerHTML = list(V.warnings).map((w) => '<div class="warn">⚠ ' + esc(w) + "</div>").join("");
  }

  // ---- the tree ---------------------------------------------------------------------------
  function flatten() {
    const out = [];
    const stack = V.roots.slice().reverse();
    while (stack.length) {
      const i = stack.pop();
      if (keep && !keep.has(i)) continue;
      out.push(i);
      const open = keep ? true : expanded.has(i);
      if (open) { const ch = N[i].ch; for (let j = ch.length - 1; j >= 0; j--) stack.push(ch[j]); }
    }
    visible = out;
    $("tree-spacer").style.height = visible.length * ROW_H + "px";
  }

  function metrics(n) {
    const bits = [];
    if (n.ti || n.to) bits.push(int(n.ti + n.to) + " tok");
    if (n.c) bits.push(usd(n.c));
    bits.push(secs(n.b - n.a));
    return bits.join(" · ");
  }

  function renderTree() {
    const tree = $("tree");
    const first = Math.max(0, Math.floor(tree.scrollTop / ROW_H) - 10);
    const last = Math.min(visible.length, Math.ceil((tree.scrollTop + tree.clientHeight) / ROW_H) + 10);
    const html = [];
    for (let r = first; r < last; r++) {
      const i = visible[r], n = N[i];
      const hasKids = n.ch.length > 0;
      const open = keep ? true : expanded.has(i);
      const classes = "row k-" + cls(n.k) + " s-" + cls(n.s) + (i === selected ? " sel" : "") + (matchSet && matchSet.has(i) ? " match" : "");
      const count = hasKids && !open ? ' <span class="muted">(' + int(n.ch.length) + ")</span>" : "";
      html.push('<div class="' + classes + '" data-i="' + num(i) + '" role="treeitem" style="padding-left:' + (4 + depthOf[i] * 16) + 'px">' +
        '<span class="tog">' + (hasKids ? (open ? "▾" : "▸") : "") + "</span>" +
        '<span class="kind">' + esc(KIND_LABEL[n.k] || n.k) + "</span>" +
        '<span class="lbl">' + esc(n.l) + count + "</span>" +
        '<span class="met">' + metrics(n) + "</span></div>");
    }
    const rows = $("tree-rows");
    rows.style.top = first * ROW_H + "px";
    rows.innerHTML = html.join("");
  }

  function toggle(i) {
    if (keep) return;
    if (expanded.has(i)) expanded.delete(i); else expanded.add(i);
    flatten(); renderTree();
  }

  function revealAndScroll(i) {
    for (let p = N[i].p; p >= 0; p = N[p].p) expanded.add(p);
    flatten();
    const r = visible.indexOf(i);
    const tree = $("tree");
    if (r >= 0) {
      const y = r * ROW_H;
      if (y < tree.scrollTop || y > tree.scrollTop + tree.clientHeight - ROW_H) tree.scrollTop = y - tree.clientHeight / 3;
    }
    renderTree();
  }

  function select(i, scroll) {
    if (i < 0 || i >= N.length) return;
    selected = i;
    if (scroll !== false) revealAndScroll(i); else renderTree();
    renderDetail(i);
    $("detail-pane").scrollTop = 0;
    drawTimeline();
  }

  // ---- details ----------------------------------------------------------------------------
  function fold(text, cls) {
    if (text == null || text === "") return '<pre class="' + (cls || "") + '"><span class="muted">(empty)</span></pre>';
    text = String(text);
    if (text.length <= FOLD_CHARS) return '<pre class="' + (cls || "") + '">' + esc(text) + "</pre>";
    const id = "f" + Math.random().toString(36).slice(2);
    fold.store[id] = text;
    return '<pre class="' + (cls || "") + '" id="' + id + '">' + esc(text.slice(0, FOLD_CHARS)) +
      '</pre><div class="more"><button data-unfold="' + id + '">show all ' + int(text.length) + " characters</button></div>";
  }
  fold.store = {};

  function messagesHtml(msgs) {
    return list(msgs).map((m) => (m && typeof m === "object" ? m : { role: "?", content: m }))
      .map((m) => '<div class="msg"><div class="role">' + esc(m.role) + "</div>" + fold(m.content) + "</div>").join("");
  }

  function fullPrompt(i) {
    // A root call stores only the messages new since the previous call; the whole prompt is
    // every earlier call's new messages and reply, then this call's new messages.
    const run = N[i].u, all = [];
    for (const n of N) {
      if (n.u !== run || n.k !== "call" || n.i > i) continue;
      const d = detail(n.i);
      all.push(...list(d.new_messages));
      if (n.i !== i && d.response != null) all.push({ role: "assistant", content: d.response });
    }
    return all;
  }

  function renderDetail(i) {
    const n = N[i], d = detail(i), h = [];
    fold.store = {};
    h.push('<h2><span class="badge s-' + cls(n.s) + '">' + esc(n.s) + "</span> " + esc(n.l) + "</h2>");
    const m = [["kind", n.k], ["start", "+" + secs(n.a)], [n.k === "call" || n.k === "sub" ? "latency" : "duration", secs(n.b - n.a)]];
    if (d.model) m.push(["model", d.model]);
    if (n.ti || n.to) { m.push(["input tokens", int(n.ti)], ["output tokens", int(n.to)]); }
    if (n.ca) m.push(["cached tokens", int(n.ca)]);
    if (n.ti || n.to || n.c) m.push(["cost", usd(n.c)]);
    if (d.call_id) m.push(["call id", d.call_id]);
    if (d.run_id) m.push(["run id", d.run_id]);
    if (num(d.attempts) > 1) m.push(["attempts", d.attempts]);
    if (d.finish_reason) m.push(["finish", d.finish_reason]);
    if (d.iterations != null) m.push(["turns", d.iterations]);
    if (d.answer_protocol) m.push(["answered with", d.answer_protocol]);
    if (n.ch.length) m.push(["children", int(n.ch.length)]);
    h.push('<div class="metrics">' + m.map(([k, v]) => "<div><span>" + esc(k) + "</span><b>" + esc(v) + "</b></div>").join("") + "</div>");
    if (d.error) h.push("<h3>Error</h3>" + fold(d.error, "err"));
    if (n.k === "run") {
      h.push("<h3>Question</h3>" + fold(d.question));
      h.push("<h3>Answer</h3>" + fold(d.answer));
      if (d.context) h.push("<h3>Context</h3>" + fold(JSON.stringify(d.context, null, 1)));
      if (d.config) h.push("<h3>Settings</h3>" + fold(JSON.stringify(d.config, null, 1)));
      if (d.isolation) h.push("<h3>Sandbox</h3>" + fold(JSON.stringify(d.isolation, null, 1)));
    } else if (n.k === "call") {
      h.push("<h3>Prompt (new messages)</h3>" + messagesHtml(d.new_messages));
      h.push('<div class="more"><button data-full="' + num(i) + '">show the whole prompt</button></div><div id="full-prompt"></div>');
      h.push("<h3>Reply</h3>" + fold(d.response, "code"));
    } else if (n.k === "sub") {
      h.push("<h3>Prompt" + (d.prompt_chars ? " (" + int(d.prompt_chars) + " characters)" : "") + "</h3>" + fold(d.prompt));
      h.push("<h3>Answer</h3>" + fold(d.response));
    } else if (n.k === "exec") {
      h.push("<h3>Code</h3>" + fold(d.code, "code"));
      h.push("<h3>Output</h3>" + fold(d.stdout));
      if (d.stderr) h.push("<h3>Errors</h3>" + fold(d.stderr, "err"));
      if (d.omitted_chars) h.push('<p class="muted">' + int(d.omitted_chars) + " characters of output were not shown to the model.</p>");
      if (d.notes && d.notes.length) h.push("<h3>Notes</h3>" + fold(Array.isArray(d.notes) ? d.notes.join("\n") : d.notes));
      if (d.final && typeof d.final === "object") h.push("<h3>Final answer (" + esc(d.final.protocol) + ")</h3>" + fold(d.final.text));
    }
    if (n.ch.length && n.k !== "turn") {
      const kids = n.ch.slice(0, 400).map((c) => '<a data-go="' + num(c) + '">' + esc(N[c].l) + "</a>").join("");
      h.push("<h3>Children</h3><div class=\"kids\">" + kids + (n.ch.length > 400 ? '<span class="muted">… ' + int(n.ch.length - 400) + " more</span>" : "") + "</div>");
    }
    $("detail").innerHTML = h.join("");
  }

  $("detail").addEventListener("click", (e) => {
    const t = e.target;
    if (t.dataset.unfold) { const pre = $(t.dataset.unfold); pre.textContent = fold.store[t.dataset.unfold]; t.parentNode.remove(); }
    else if (t.dataset.full) { $("full-prompt").innerHTML = messagesHtml(fullPrompt(+t.dataset.full)); t.parentNode.remove(); }
    else if (t.dataset.go) select(+t.dataset.go, true);
  });

  // ---- search -----------------------------------------------------------------------------
  function runSearch(q) {
    query = q.trim().toLowerCase();
    if (!query) { matches = []; matchSet = null; keep = null; $("search-count").textContent = ""; flatten(); renderTree(); drawTimeline(); return; }
    if (!lower) { lower = new Array(N.length); for (let i = 0; i < N.length; i++) lower[i] = (N[i].l + "\n" + V.details[i]).toLowerCase(); }
    matches = [];
    for (let i = 0; i < N.length; i++) if (lower[i].includes(query)) matches.push(i);
    matchSet = new Set(matches);
    keep = new Set();
    for (const i of matches) for (let p = i; p >= 0 && !keep.has(p); p = N[p].p) keep.add(p);
    $("search-count").textContent = matches.length ? int(matches.length) + " found" : "no match";
    $("tree").scrollTop = 0;
    flatten(); renderTree(); drawTimeline();
  }
  function step(dir) {
    if (!matches.length) return;
    let k = matches.findIndex((i) => (dir > 0 ? i > selected : i >= selected));
    if (dir > 0) k = k < 0 ? 0 : k; else k = (k < 0 ? matches.length : k) - 1;
    if (k < 0) k = matches.length - 1;
    select(matches[k], true);
    $("search-count").textContent = int(k + 1) + " of " + int(matches.length);
  }
  let searchTimer = 0;
  $("search").addEventListener("input", (e) => { clearTimeout(searchTimer); searchTimer = setTimeout(() => runSearch(e.target.value), 150); });
  $("search").addEventListener("keydown", (e) => {
    if (e.key === "Enter") { clearTimeout(searchTimer); if ((e.target.value.trim().toLowerCase()) !== query) runSearch(e.target.value); step(e.shiftKey ? -1 : 1); }
  });
  $("next").onclick = () => step(1);
  $("prev").onclick = () => step(-1);
  $("expand-all").onclick = () => { for (const n of N) if (n.ch.length) expanded.add(n.i); flatten(); renderTree(); };
  $("collapse-all").onclick = () => { expanded = new Set(V.roots); flatten(); renderTree(); };

  // ---- tree interaction -------------------------------------------------------------------
  let scrollQueued = false;
  $("tree").addEventListener("scroll", () => {
    if (scrollQueued) return;
    scrollQueued = true;
    requestAnimationFrame(() => { scrollQueued = false; renderTree(); });
  });
  $("tree").addEventListener("click", (e) => {
    const row = e.target.closest(".row");
    if (!row) return;
    const i = +row.dataset.i;
    if (e.target.classList.contains("tog")) toggle(i); else select(i, false);
  });
  $("tree").addEventListener("dblclick", (e) => { const row = e.target.closest(".row"); if (row) toggle(+row.dataset.i); });
  $("tree").addEventListener("keydown", (e) => {
    const r = visible.indexOf(selected);
    if (e.key === "ArrowDown" && r < visible.length - 1) select(visible[r + 1], true);
    else if (e.key === "ArrowUp" && r > 0) select(visible[r - 1], true);
    else if (e.key === "ArrowRight" && selected >= 0 && !expanded.has(selected)) toggle(selected);
    else if (e.key === "ArrowLeft" && selected >= 0) { if (expanded.has(selected)) toggle(selected); else if (N[selected].p >= 0) select(N[selected].p, true); }
    else return;
    e.preventDefault();
  });
  window.addEventListener("resize", () => { renderTree(); drawTimeline(); });

  // ---- the timeline -----------------------------------------------------------------------
  const COLORS = () => {
    const cs = getComputedStyle(document.documentElement);
    const v = (k) => cs.getPropertyValue(k).trim();
    return { call: v("--call"), exec: v("--exec"), sub: v("--sub"), run: v("--run"), err: v("--err"), refused: v("--refused"), ink: v("--ink"), muted: v("--muted"), line: v("--line") };
  };
  function layoutTimeline(fit) {
    const rows = Math.max(1, V.rows || 1);
    tl.rowH = rows > 400 ? Math.max(2, Math.floor(12000 / rows)) : rows > 60 ? 5 : rows > 20 ? 9 : 14;
    tl.byRow = Array.from({ length: rows }, () => []);
    let end = 0;
    for (const n of N) {
      if (n.k === "turn") continue;
      if (n.r < rows) tl.byRow[n.r].push(n.i);
      end = Math.max(end, n.b);
    }
    if (fit) { tl.start = 0; tl.end = Math.max(end, 1e-3) * 1.01; }
  }
  function drawTimeline() {
    const canvas = $("timeline"), axis = $("axis"), dpr = window.devicePixelRatio || 1;
    const w = canvas.clientWidth || canvas.parentNode.clientWidth;
    const h = Math.max(1, (V.rows || 1) * tl.rowH);
    canvas.style.height = h + "px";
    if (canvas.width !== Math.round(w * dpr) || canvas.height !== Math.round(h * dpr)) { canvas.width = Math.round(w * dpr); canvas.height = Math.round(h * dpr); }
    const ctx = canvas.getContext("2d"), C = COLORS();
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, w, h);
    const scale = w / (tl.end - tl.start);
    const x = (t) => (t - tl.start) * scale;
    const gap = tl.rowH > 4 ? 1 : 0;
    for (const n of N) {
      if (n.k === "turn") continue;
      const x0 = x(n.a), x1 = x(n.b);
      if (x1 < 0 || x0 > w) continue;
      let color = n.s === "error" || n.s === "cancelled" ? C.err : n.s === "refused" ? C.refused : C[n.k] || C.muted;
      ctx.globalAlpha = matchSet && !matchSet.has(n.i) ? 0.15 : n.k === "run" ? 0.35 : 0.9;
      ctx.fillStyle = color;
      const y = n.r * tl.rowH;
      ctx.fillRect(x0, y + gap, Math.max(1, x1 - x0), Math.max(1, tl.rowH - 2 * gap));
    }
    ctx.globalAlpha = 1;
    if (selected >= 0) {
      const n = N[selected];
      ctx.strokeStyle = C.ink; ctx.lineWidth = 2;
      ctx.strokeRect(x(n.a) - 1, n.r * tl.rowH, Math.max(3, x(n.b) - x(n.a) + 2), Math.max(3, tl.rowH));
    }
    // the time axis
    const aw = axis.clientWidth || w;
    axis.width = Math.round(aw * dpr); axis.height = Math.round(18 * dpr);
    const a = axis.getContext("2d");
    a.setTransform(dpr, 0, 0, dpr, 0, 0);
    a.clearRect(0, 0, aw, 18);
    a.fillStyle = C.muted; a.strokeStyle = C.line; a.font = "10px system-ui, sans-serif";
    const span = tl.end - tl.start, target = span / 8;
    const pow = Math.pow(10, Math.floor(Math.log10(target)));
    const tick = [1, 2, 5, 10].map((k) => k * pow).find((k) => k >= target) || pow * 10;
    for (let t = Math.ceil(tl.start / tick) * tick; t <= tl.end; t += tick) {
      const px = x(t);
      a.fillRect(px, 12, 1, 6);
      a.fillText(secs(t), px + 3, 10);
    }
  }
  function hit(ev) {
    const canvas = $("timeline"), rect = canvas.getBoundingClientRect();
    const px = ev.clientX - rect.left, py = ev.clientY - rect.top;
    const row = Math.floor(py / tl.rowH);
    const t = tl.start + (px / rect.width) * (tl.end - tl.start);
    const slack = (4 / rect.width) * (tl.end - tl.start);
    const ids = tl.byRow[row] || [];
    let best = -1;
    for (const i of ids) { const n = N[i]; if (n.a - slack <= t && t <= n.b + slack) { if (best < 0 || n.b - n.a < N[best].b - N[best].a) best = i; } }
    return best;
  }
  const canvas = $("timeline");
  let drag = null;
  canvas.addEventListener("mousedown", (e) => { drag = { x: e.clientX, start: tl.start, end: tl.end, moved: false }; });
  window.addEventListener("mouseup", (e) => {
    if (drag && !drag.moved && e.target === canvas) { const i = hit(e); if (i >= 0) select(i, true); }
    drag = null;
  });
  canvas.addEventListener("mousemove", (e) => {
    const tip = $("tooltip");
    if (drag) {
      const dx = e.clientX - drag.x;
      if (Math.abs(dx) > 2) drag.moved = true;
      const dt = (dx / canvas.clientWidth) * (drag.end - drag.start);
      tl.start = drag.start - dt; tl.end = drag.end - dt;
      drawTimeline();
      return;
    }
    const i = hit(e);
    if (i < 0) { tip.hidden = true; return; }
    const n = N[i];
    tip.textContent = n.l + "\n" + secs(n.a) + " → " + secs(n.b) + " (" + secs(n.b - n.a) + ")" + (n.ti || n.to ? "\n" + int(n.ti) + " in / " + int(n.to) + " out tokens · " + usd(n.c) : "");
    const pane = $("timeline-pane").getBoundingClientRect();
    tip.style.left = Math.min(e.clientX - pane.left + 12, pane.width - 300) + "px";
    tip.style.top = e.clientY - pane.top + 14 + "px";
    tip.hidden = false;
  });
  canvas.addEventListener("mouseleave", () => { $("tooltip").hidden = true; });
  canvas.addEventListener("wheel", (e) => {
    const sc = $("timeline-scroll");
    // On a timeline taller than its pane a plain wheel scrolls the rows; Ctrl/⌘/Alt+wheel zooms.
    if (sc.scrollHeight > sc.clientHeight && !(e.ctrlKey || e.metaKey || e.altKey)) return;
    e.preventDefault();
    const rect = canvas.getBoundingClientRect();
    const at = tl.start + ((e.clientX - rect.left) / rect.width) * (tl.end - tl.start);
    const f = Math.exp(e.deltaY * 0.0015);
    tl.start = at - (at - tl.start) * f; tl.end = at + (tl.end - at) * f;
    drawTimeline();
  }, { passive: false });
  canvas.addEventListener("dblclick", () => { layoutTimeline(true); drawTimeline(); });

  start();
})();
