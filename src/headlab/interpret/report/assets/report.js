// headlab analyze: the interactive page. No network, no libraries: the data sits inline in
// <script id="headlab-data">; maps are base64 little-endian uint16 (weight = value / 65535),
// row-major (query, key), one per drawn "layer.head".
(function () {
  "use strict";
  var errors = [];
  function recordError(msg) {
    errors.push(String(msg));
    var pre = document.createElement("pre");
    pre.className = "selftest-error";
    pre.textContent = "error: " + msg;
    (document.body || document.documentElement).appendChild(pre);
  }
  window.addEventListener("error", function (e) { recordError(e.message + " @" + (e.lineno || "?")); });
  var consoleError = console.error;
  console.error = function () {
    recordError(Array.prototype.join.call(arguments, " "));
    consoleError.apply(console, arguments);
  };

  var D = JSON.parse(document.getElementById("headlab-data").textContent);
  var tokens = D.tokens, n = tokens.length;
  var records = {};
  D.records.forEach(function (r) { records[r.layer + "." + r.head] = r; });
  var cache = {};
  var state = { layer: D.initial[0], head: D.initial[1], focus: -1 };

  function decode(key) {
    if (!(key in D.maps)) return null;
    if (!cache[key]) {
      var bin = atob(D.maps[key]);
      var bytes = new Uint8Array(bin.length);
      for (var i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
      var u16 = new Uint16Array(bytes.buffer);
      var w = new Float32Array(u16.length);
      for (var j = 0; j < u16.length; j++) w[j] = u16[j] / 65535;
      cache[key] = w;
    }
    return cache[key];
  }
  function current() { return decode(state.layer + "." + state.head); }
  function weight(P, q, k) { return P[q * n + k]; }

  // ---- heatmap on a canvas: labels on the left (queries) and top (keys)
  var canvas = document.getElementById("heatmap");
  var ctx = canvas.getContext("2d", { willReadFrequently: true });  // the self-test reads pixels back
  var cell = Math.max(1, Math.min(26, Math.floor(720 / n)));
  var labelEvery = Math.max(1, Math.ceil(9 / cell));
  var margin = cell >= 5 ? 96 : 8;
  var size = margin + cell * n + 2;
  canvas.width = size; canvas.height = size;

  function color(w) {  // viridis-like ramp, 0 -> dark purple, 1 -> yellow
    var stops = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];
    var x = Math.max(0, Math.min(1, w)) * (stops.length - 1), i = Math.min(stops.length - 2, Math.floor(x)), f = x - i;
    var a = stops[i], b = stops[i + 1];
    return "rgb(" + Math.round(a[0] + f * (b[0] - a[0])) + "," + Math.round(a[1] + f * (b[1] - a[1])) + "," +
      Math.round(a[2] + f * (b[2] - a[2])) + ")";
  }
  function short(t) { return t.length > 12 ? t.slice(0, 11) + "\u2026" : t; }

  function drawHeatmap() {
    ctx.clearRect(0, 0, size, size);
    ctx.fillStyle = "#ffffff"; ctx.fillRect(0, 0, size, size);
    var P = current();
    var note = document.getElementById("heatmap-note");
    if (!P) {
      ctx.fillStyle = "#5b6475"; ctx.font = "13px sans-serif";
      ctx.fillText("map not drawn for this head", 12, 24);
      note.textContent = D.undrawn_note;
      return;
    }
    note.textContent = "";
    for (var q = 0; q < n; q++)
      for (var k = 0; k < n; k++) {
        ctx.fillStyle = color(weight(P, q, k));
        ctx.fillRect(margin + k * cell, margin + q * cell, cell, cell);
      }
    if (margin > 8) {
      ctx.fillStyle = "#1d2330";
      ctx.font = Math.min(12, Math.max(8, cell - 2)) + "px sans-serif";
      ctx.textBaseline = "middle";
      for (var i = 0; i < n; i += labelEvery) {
        ctx.textAlign = "right";
        ctx.fillText(short(tokens[i]), margin - 4, margin + (i + 0.5) * cell);
        ctx.save();
        ctx.translate(margin + (i + 0.5) * cell, margin - 4);
        ctx.rotate(-Math.PI / 2);
        ctx.textAlign = "left";
        ctx.fillText(short(tokens[i]), 0, 0);
        ctx.restore();
      }
    }
    if (state.focus >= 0) {
      ctx.lineWidth = 2;
      ctx.strokeStyle = "rgb(25,113,194)";
      ctx.strokeRect(margin, margin + state.focus * cell, n * cell, cell);
      ctx.strokeStyle = "rgb(232,89,12)";
      ctx.strokeRect(margin + state.focus * cell, margin, cell, n * cell);
    }
  }

  canvas.addEventListener("mousemove", function (e) {
    var r = canvas.getBoundingClientRect();
    var x = (e.clientX - r.left) * canvas.width / r.width - margin, y = (e.clientY - r.top) * canvas.height / r.height - margin;
    var k = Math.floor(x / cell), q = Math.floor(y / cell), P = current();
    var out = document.getElementById("cell-readout");
    if (!P || k < 0 || q < 0 || k >= n || q >= n) { return; }
    out.textContent = "query " + q + " '" + tokens[q] + "' \u2192 key " + k + " '" + tokens[k] + "': " + weight(P, q, k).toFixed(4);
    setFocus(q);
  });

  // ---- token strips
  function buildStrip(id) {
    var el = document.getElementById(id);
    el.textContent = "";
    for (var i = 0; i < n; i++) {
      var s = document.createElement("span");
      s.className = "tok"; s.textContent = tokens[i]; s.dataset.index = String(i);
      s.title = i + ": " + tokens[i];
      s.addEventListener("mouseover", function (e) { setFocus(Number(e.currentTarget.dataset.index)); });
      el.appendChild(s);
      el.appendChild(document.createTextNode(" "));
    }
    return el.querySelectorAll("span.tok");
  }
  var stripA = buildStrip("strip-attends"), stripB = buildStrip("strip-attended");

  function paintStrips() {
    var P = current(), f = state.focus;
    var best = [-1, -1, -1, -1];  // attends-to (k, w), attended-by (q, w)
    for (var i = 0; i < n; i++) {
      var wa = (P && f >= 0) ? weight(P, f, i) : 0, wb = (P && f >= 0) ? weight(P, i, f) : 0;
      stripA[i].style.backgroundColor = "rgba(25,113,194," + wa.toFixed(3) + ")";
      stripB[i].style.backgroundColor = "rgba(232,89,12," + wb.toFixed(3) + ")";
      stripA[i].style.color = wa > 0.55 ? "#fff" : "";
      stripB[i].style.color = wb > 0.55 ? "#fff" : "";
      stripA[i].dataset.weight = wa.toFixed(4); stripB[i].dataset.weight = wb.toFixed(4);
      stripA[i].classList.toggle("focus", i === f); stripB[i].classList.toggle("focus", i === f);
      if (wa > best[1]) { best[0] = i; best[1] = wa; }
      if (wb > best[3]) { best[2] = i; best[3] = wb; }
    }
    var label = f >= 0 ? "'" + tokens[f] + "'" : "\u2026";
    document.getElementById("focus-a").textContent = label;
    document.getElementById("focus-b").textContent = label;
    var out = document.getElementById("token-readout");
    if (f < 0) out.textContent = "";
    else if (!P) out.textContent = "no map for this head (see the note under the heatmap)";
    else out.textContent = "'" + tokens[f] + "' attends most to '" + tokens[best[0]] + "' (" + best[1].toFixed(2) +
      "); the token attending most to it is '" + tokens[best[2]] + "' (" + best[3].toFixed(2) + ")";
  }

  function setFocus(i) {
    if (i === state.focus) return;
    state.focus = i;
    document.body.dataset.focusToken = String(i);
    paintStrips();
    drawHeatmap();
  }

  // ---- head info, picker, selects, table
  function fmt(x, d) { return (x === null || x === undefined) ? "\u2013" : Number(x).toFixed(d); }
  function showInfo() {
    var r = records[state.layer + "." + state.head];
    var el = document.getElementById("head-info");
    var rows = [
      ["labels", r.labels.length ? r.labels.join(", ") : "none"],
      ["entropy", fmt(r.entropy, 3) + " nats (normalised " + fmt(r.norm_entropy, 2) + ")"],
      ["mean distance", fmt(r.mean_distance, 2) + " tokens"],
      ["confidence", fmt(r.confidence, 3) + " (mean max weight)"],
      [D.first_label, fmt(r.mass_first, 3)],
      ["mass on [SEP]", fmt(r.mass_sep, 3)],
      ["most attended", "'" + r.top_token + "' #" + r.top_token_pos + " (" + fmt(r.top_token_share, 2) + " per row)"],
      ["argmax at -1 / +1 / 0", fmt(r.prev_share, 2) + " / " + fmt(r.next_share, 2) + " / " + fmt(r.self_share, 2)]
    ];
    if (r.notes && r.notes.length) rows.push(["other studies", r.notes.join("; ")]);
    el.textContent = "";
    var dl = document.createElement("dl");
    rows.forEach(function (p) {
      var dt = document.createElement("dt"), dd = document.createElement("dd");
      dt.textContent = p[0]; dd.textContent = p[1]; dl.appendChild(dt); dl.appendChild(dd);
    });
    el.appendChild(dl);
    if (r.evidence.length) {
      var ul = document.createElement("ul");
      r.evidence.forEach(function (e) { var li = document.createElement("li"); li.textContent = e; ul.appendChild(li); });
      el.appendChild(ul);
    }
  }

  var layerSel = document.getElementById("layer-select"), headSel = document.getElementById("head-select");
  function select(layer, head) {
    state.layer = layer; state.head = head;
    layerSel.value = String(layer); headSel.value = String(head);
    document.querySelectorAll("[data-layer][data-head]").forEach(function (b) {
      b.classList.toggle("selected", Number(b.dataset.layer) === layer && Number(b.dataset.head) === head);
    });
    document.getElementById("selection-label").textContent = "layer " + layer + ", head " + head +
      (current() ? "" : " (statistics only)");
    document.body.dataset.selected = layer + "." + head;
    showInfo(); paintStrips(); drawHeatmap();
  }
  layerSel.addEventListener("change", function () { select(Number(layerSel.value), state.head); });
  headSel.addEventListener("change", function () { select(state.layer, Number(headSel.value)); });
  document.querySelectorAll("[data-layer][data-head]").forEach(function (b) {
    b.addEventListener("click", function () { select(Number(b.dataset.layer), Number(b.dataset.head)); });
  });

  select(state.layer, state.head);
  setFocus(Math.min(1, n - 1));

  // ---- self test (#selftest): every drawn head paints, a hover reaches both strips and the heatmap
  function inkAt(x, y) { return ctx.getImageData(x, y, 1, 1).data; }
  function selftest() {
    var problems = [];
    var keys = Object.keys(D.maps);
    setFocus(-1);
    if (!keys.length) problems.push("no maps embedded");
    keys.forEach(function (key) {
      var lh = key.split(".").map(Number);
      select(lh[0], lh[1]);
      var P = current(), argq = 0, argk = 0;
      for (var i = 0; i < n * n; i++) if (P[i] > P[argq * n + argk]) { argq = Math.floor(i / n); argk = i % n; }
      var px = inkAt(margin + argk * cell + Math.floor(cell / 2), margin + argq * cell + Math.floor(cell / 2));
      var want = color(P[argq * n + argk]).match(/\d+/g).map(Number);
      if (Math.abs(px[0] - want[0]) + Math.abs(px[1] - want[1]) + Math.abs(px[2] - want[2]) > 12)
        problems.push(key + ": heatmap pixel " + Array.prototype.slice.call(px, 0, 3) + " != " + want);
    });
    var undrawn = D.records.filter(function (r) { return !((r.layer + "." + r.head) in D.maps); })[0];
    if (undrawn) {  // a head with statistics only: its info shows and the page says why there is no map
      select(undrawn.layer, undrawn.head);
      if (document.getElementById("heatmap-note").textContent !== D.undrawn_note) problems.push("no note for an undrawn head");
      if (document.getElementById("head-info").textContent.indexOf("entropy") < 0) problems.push("no info for an undrawn head");
    }
    var first = keys[0].split(".").map(Number);
    select(first[0], first[1]);
    var target = n > 2 ? 2 : 0;
    setFocus(-1);
    stripA[target].dispatchEvent(new MouseEvent("mouseover", { bubbles: true }));
    if (document.body.dataset.focusToken !== String(target)) problems.push("hover did not move the focus");
    var P = current(), sumA = 0, sumB = 0, colB = 0;
    for (var i = 0; i < n; i++) {
      sumA += Number(stripA[i].dataset.weight); sumB += Number(stripB[i].dataset.weight); colB += weight(P, i, target);
    }
    if (Math.abs(sumA - 1) > 0.01) problems.push("row weights in the 'attends' strip sum to " + sumA);
    if (Math.abs(sumB - colB) > 0.01) problems.push("'attended' strip " + sumB + " != column sum " + colB);
    if (!stripA[target].classList.contains("focus")) problems.push("hovered token not marked");
    if (document.getElementById("token-readout").textContent.indexOf(tokens[target]) < 0) problems.push("no readout");
    var edge = inkAt(margin + Math.floor(cell / 2), margin + target * cell);  // the row outline drawn in blue
    if (!(edge[2] > edge[0] && edge[2] > 150)) problems.push("focused row not outlined: " + Array.prototype.slice.call(edge, 0, 3));
    var r = canvas.getBoundingClientRect();
    var scale = r.width / canvas.width;
    canvas.dispatchEvent(new MouseEvent("mousemove", {
      bubbles: true, clientX: r.left + (margin + 0.5 * cell) * scale, clientY: r.top + (margin + (n - 1 + 0.5) * cell) * scale
    }));
    if (document.body.dataset.focusToken !== String(n - 1)) problems.push("heatmap hover did not move the focus");
    if (document.getElementById("cell-readout").textContent.indexOf("key 0") < 0) problems.push("no cell readout");
    problems = problems.concat(errors);
    var out = document.createElement("pre");
    out.id = "selftest-result";
    out.dataset.status = problems.length ? "fail" : "pass";
    out.dataset.checkedHeads = String(keys.length);
    out.textContent = problems.length ? problems.join("\n") : "selftest pass: " + keys.length + " heads drawn, hover ok";
    document.body.appendChild(out);
  }
  if (location.hash === "#selftest") {
    try { selftest(); } catch (e) { recordError("selftest threw: " + e); var o = document.createElement("pre");
      o.id = "selftest-result"; o.dataset.status = "fail"; o.textContent = String(e); document.body.appendChild(o); }
  }
})();
