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

  function decodeMap(b64) {
    var bin = atob(b64);
    var bytes = new Uint8Array(bin.length);
    for (var i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
    var u16 = new Uint16Array(bytes.buffer);
    var w = new Float32Array(u16.length);
    for (var j = 0; j < u16.length; j++) w[j] = u16[j] / 65535;
    return w;
  }
  function decode(key) {
    if (!(key in D.maps)) return null;
    if (!cache[key]) cache[key] = decodeMap(D.maps[key]);
    return cache[key];
  }
  function current() { return decode(state.layer + "." + state.head); }
  function weight(P, q, k) { return P[q * n + k]; }

  // ---- norm maps: ||a_ij f_h(x_j)|| = a_ij ||f_h(x_j)||, the weight map times one value norm per key
  var F = D.flow, vnorms = F ? F.value_norms : {}, normCache = {};
  function normOf(key) {
    if (!(key in vnorms) || !decode(key)) return null;
    if (!normCache[key]) {
      var P = decode(key), v = vnorms[key], raw = new Float32Array(n * n), share = new Float32Array(n * n);
      for (var q = 0; q < n; q++) {
        var s = 0;
        for (var k = 0; k < n; k++) { raw[q * n + k] = P[q * n + k] * v[k]; s += raw[q * n + k]; }
        for (var k2 = 0; k2 < n; k2++) share[q * n + k2] = s > 0 ? raw[q * n + k2] / s : 0;
      }
      normCache[key] = { raw: raw, share: share };
    }
    return normCache[key];
  }
  function currentNorm() { return normOf(state.layer + "." + state.head); }

  // ---- the rollout: a full map (shown divided by its largest value) or chosen rows
  var R = F ? F.rollout : null, rollRaw = null, rollShown = null, rollMax = 0;
  if (R && R.map) {
    rollRaw = decodeMap(R.map);
    for (var ri = 0; ri < rollRaw.length; ri++) rollMax = Math.max(rollMax, rollRaw[ri]);
    rollShown = new Float32Array(rollRaw.length);
    for (var rj = 0; rj < rollRaw.length; rj++) rollShown[rj] = rollMax > 0 ? rollRaw[rj] / rollMax : 0;
  }

  // ---- heatmaps on canvases: labels on the left (queries) and top (keys); each painted once into an
  // offscreen canvas, then copied and outlined on every focus change
  function color(w) {  // viridis-like ramp, 0 -> dark purple, 1 -> yellow
    var stops = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];
    var x = Math.max(0, Math.min(1, w)) * (stops.length - 1), i = Math.min(stops.length - 2, Math.floor(x)), f = x - i;
    var a = stops[i], b = stops[i + 1];
    return "rgb(" + Math.round(a[0] + f * (b[0] - a[0])) + "," + Math.round(a[1] + f * (b[1] - a[1])) + "," +
      Math.round(a[2] + f * (b[2] - a[2])) + ")";
  }
  function short(t) { return t.length > 12 ? t.slice(0, 11) + "\u2026" : t; }

  function Panel(id, budget) {
    this.canvas = document.getElementById(id);
    this.ctx = this.canvas.getContext("2d", { willReadFrequently: true });  // the self-test reads pixels back
    this.cell = Math.max(1, Math.min(26, Math.floor(budget / n)));
    this.labelEvery = Math.max(1, Math.ceil(9 / this.cell));
    this.margin = this.cell >= 5 ? 96 : 8;
    this.size = this.margin + this.cell * n + 2;
    this.canvas.width = this.size; this.canvas.height = this.size;
    this.base = document.createElement("canvas");
    this.base.width = this.size; this.base.height = this.size;
    this.key = null; this.filled = false;
  }
  Panel.prototype.paintBase = function (M, empty) {
    var g = this.base.getContext("2d"), size = this.size, m = this.margin, c = this.cell;
    g.fillStyle = "#ffffff"; g.fillRect(0, 0, size, size);
    if (!M) {
      g.fillStyle = "#5b6475"; g.font = "13px sans-serif";
      g.fillText(empty, 12, 24);
      return false;
    }
    for (var q = 0; q < n; q++)
      for (var k = 0; k < n; k++) {
        g.fillStyle = color(M[q * n + k]);
        g.fillRect(m + k * c, m + q * c, c, c);
      }
    if (m > 8) {
      g.fillStyle = "#1d2330";
      g.font = Math.min(12, Math.max(8, c - 2)) + "px sans-serif";
      g.textBaseline = "middle";
      for (var i = 0; i < n; i += this.labelEvery) {
        g.textAlign = "right";
        g.fillText(short(tokens[i]), m - 4, m + (i + 0.5) * c);
        g.save();
        g.translate(m + (i + 0.5) * c, m - 4);
        g.rotate(-Math.PI / 2);
        g.textAlign = "left";
        g.fillText(short(tokens[i]), 0, 0);
        g.restore();
      }
    }
    return true;
  };
  Panel.prototype.show = function (M, key, empty) {
    if (this.key !== key) { this.filled = this.paintBase(M, empty); this.key = key; }
    var ctx = this.ctx, m = this.margin, c = this.cell;
    ctx.imageSmoothingEnabled = false;
    ctx.clearRect(0, 0, this.size, this.size);
    ctx.drawImage(this.base, 0, 0);
    if (this.filled && state.focus >= 0) {
      ctx.lineWidth = 2;
      ctx.strokeStyle = "rgb(25,113,194)";
      ctx.strokeRect(m, m + state.focus * c, n * c, c);
      ctx.strokeStyle = "rgb(232,89,12)";
      ctx.strokeRect(m + state.focus * c, m, c, n * c);
    }
  };
  Panel.prototype.hover = function (readout) {  // readout(q, k) -> text, or null off the map
    var self = this;
    this.canvas.addEventListener("mousemove", function (e) {
      var r = self.canvas.getBoundingClientRect();
      var x = (e.clientX - r.left) * self.canvas.width / r.width - self.margin;
      var y = (e.clientY - r.top) * self.canvas.height / r.height - self.margin;
      var k = Math.floor(x / self.cell), q = Math.floor(y / self.cell);
      if (k < 0 || q < 0 || k >= n || q >= n) return;
      var text = readout(q, k);
      if (text === null) return;
      setFocus(q);
    });
  };

  var heat = new Panel("heatmap", F ? 460 : 720), canvas = heat.canvas, ctx = heat.ctx;
  var cell = heat.cell, margin = heat.margin;
  var normPanel = null, rollPanel = null;
  if (F) {
    document.getElementById("normmap-box").hidden = false;
    normPanel = new Panel("normmap", 460);
    document.getElementById("rollout-section").hidden = false;
    document.getElementById("rollout-layer").textContent = String(R.layer);
    document.getElementById("rollout-note").textContent = R.note +
      (rollRaw ? " (colour: the value divided by the largest, " + rollMax.toFixed(3) + ")" : "");
    if (rollRaw) { document.getElementById("rolloutmap").hidden = false; rollPanel = new Panel("rolloutmap", 560); }
  }

  function drawHeatmap() {
    var key = state.layer + "." + state.head, P = current();
    document.getElementById("heatmap-note").textContent = P ? "" : D.undrawn_note;
    heat.show(P, P ? "w" + key : "none", "map not drawn for this head");
    if (normPanel) {
      var N = currentNorm();
      normPanel.show(N ? N.share : null, N ? "n" + key : "none", "no norm map for this head");
    }
    if (rollPanel) rollPanel.show(rollShown, "rollout", "");
  }

  heat.hover(function (q, k) {
    var P = current();
    if (!P) return null;
    document.getElementById("cell-readout").textContent = "query " + q + " '" + tokens[q] + "' \u2192 key " + k +
      " '" + tokens[k] + "': " + weight(P, q, k).toFixed(4);
    return "";
  });
  if (normPanel) normPanel.hover(function (q, k) {
    var N = currentNorm(), P = current();
    if (!N) return null;
    document.getElementById("norm-readout").textContent = "query " + q + " '" + tokens[q] + "' \u2190 key " + k +
      " '" + tokens[k] + "': norm " + N.raw[q * n + k].toPrecision(4) + " (" + (100 * N.share[q * n + k]).toFixed(1) +
      "% of the row; weight " + weight(P, q, k).toFixed(4) + ")";
    return "";
  });
  if (rollPanel) rollPanel.hover(function (q, k) {
    document.getElementById("rollout-readout").textContent = "token " + q + " '" + tokens[q] + "' at layer " + R.layer +
      " \u2190 input token " + k + " '" + tokens[k] + "': " + rollRaw[q * n + k].toFixed(4);
    return "";
  });

  // ---- rollout rows: the focused token's row (full map) or the rows computed (past the full-map length)
  var rollStrips = [];
  function rolloutStrip(title, values) {
    var box = document.getElementById("rollout-rows");
    var p = document.createElement("p"); p.className = "strip-title"; p.textContent = title; box.appendChild(p);
    var el = document.createElement("div"); el.className = "strip rollout-row"; box.appendChild(el);
    var spans = [];
    for (var i = 0; i < n; i++) {
      var s = document.createElement("span");
      s.className = "tok"; s.textContent = tokens[i]; s.dataset.index = String(i);
      el.appendChild(s); el.appendChild(document.createTextNode(" ")); spans.push(s);
    }
    var strip = { title: p, spans: spans, values: values };
    rollStrips.push(strip);
    paintRolloutStrip(strip, values);
    return strip;
  }
  function paintRolloutStrip(strip, values) {
    strip.values = values;
    var mx = 0;
    for (var i = 0; i < n; i++) mx = Math.max(mx, values ? values[i] : 0);
    for (var j = 0; j < n; j++) {
      var v = values ? values[j] : 0, a = mx > 0 ? v / mx : 0;
      strip.spans[j].style.backgroundColor = "rgba(47,158,68," + a.toFixed(3) + ")";
      strip.spans[j].style.color = a > 0.55 ? "#fff" : "";
      strip.spans[j].dataset.value = v.toPrecision(6);
      strip.spans[j].title = j + ": " + tokens[j] + " " + v.toFixed(4);
    }
  }
  var focusStrip = null;
  if (R) {
    var readout = document.createElement("p");
    readout.id = "rollout-readout"; readout.className = "readout";
    if (rollRaw) {
      focusStrip = rolloutStrip("how much of each input token reaches the hovered token (its rollout row)", null);
    } else {
      Object.keys(R.rows).forEach(function (pos) {
        rolloutStrip("rollout row of token " + pos + " '" + tokens[Number(pos)] + "' (what reaches it from each input token)",
                     R.rows[pos]);
      });
    }
    document.getElementById("rollout-rows").appendChild(readout);
  }
  function paintRollout() {
    if (!focusStrip) return;
    var f = state.focus;
    focusStrip.title.textContent = f >= 0 ? "rollout row of '" + tokens[f] + "': how much of each input token reaches it"
      : "how much of each input token reaches the hovered token (its rollout row)";
    paintRolloutStrip(focusStrip, f >= 0 ? rollRaw.subarray(f * n, (f + 1) * n) : null);
  }

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
    paintRollout();
    drawHeatmap();
  }

  // ---- head info, picker, selects, table
  function fmt(x, d) { return (x === null || x === undefined) ? "\u2013" : Number(x).toFixed(d); }
  function showInfo() {
    var r = records[state.layer + "." + state.head];
    var el = document.getElementById("head-info");
    var rows = [
      ["pattern labels", r.labels.length ? r.labels.join(", ") : "none"],
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
    var nh = D.layer_heads ? D.layer_heads[layer] : D.n_heads;  // a pruned layer may have fewer heads
    if (head >= nh) head = nh - 1;
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

  // ---- self test (#selftest): every drawn head paints its weight and norm maps, a hover reaches both
  // strips and the heatmap, the rollout paints (its map or its rows)
  function inkAt(x, y, c) { return (c || ctx).getImageData(x, y, 1, 1).data; }
  function checkPixel(panel, M, what, problems) {  // the largest cell of M has M's colour on the panel
    var arg = 0;
    for (var i = 0; i < n * n; i++) if (M[i] > M[arg]) arg = i;
    var q = Math.floor(arg / n), k = arg % n, c = panel.cell, m = panel.margin;
    var px = inkAt(m + k * c + Math.floor(c / 2), m + q * c + Math.floor(c / 2), panel.ctx);
    var want = color(M[arg]).match(/\d+/g).map(Number);
    if (Math.abs(px[0] - want[0]) + Math.abs(px[1] - want[1]) + Math.abs(px[2] - want[2]) > 12)
      problems.push(what + " pixel " + Array.prototype.slice.call(px, 0, 3) + " != " + want);
  }
  function checkRows(M, what, problems) {  // every row that has any mass sums to 1
    for (var q = 0; q < n; q++) {
      var s = 0;
      for (var k = 0; k < n; k++) s += M[q * n + k];
      if (s > 0 && Math.abs(s - 1) > 0.01) { problems.push(what + " row " + q + " sums to " + s); return; }
    }
  }
  function selftest() {
    var problems = [], norms = 0;
    var keys = Object.keys(D.maps);
    setFocus(-1);
    if (!keys.length && !D.undrawn_note) problems.push("no maps embedded");  // a long input may embed none, and says so
    keys.forEach(function (key) {
      var lh = key.split(".").map(Number);
      select(lh[0], lh[1]);
      checkPixel(heat, current(), key + ": heatmap", problems);
      var N = currentNorm();
      if (N) {
        norms += 1;
        checkPixel(normPanel, N.share, key + ": norm map", problems);
        checkRows(N.share, key + ": norm map", problems);
      } else if (F) problems.push(key + ": no norm map");
    });
    if (rollPanel) {
      checkPixel(rollPanel, rollShown, "rollout map", problems);
      checkRows(rollRaw, "rollout map", problems);
    }
    rollStrips.forEach(function (st, i) {
      if (!st.values) return;
      var s = 0;
      st.spans.forEach(function (sp) { s += Number(sp.dataset.value); });
      if (Math.abs(s - 1) > 0.01) problems.push("rollout row " + i + " sums to " + s);
    });
    var undrawn = D.records.filter(function (r) { return !((r.layer + "." + r.head) in D.maps); })[0];
    if (undrawn) {  // a head with statistics only: its info shows and the page says why there is no map
      select(undrawn.layer, undrawn.head);
      if (document.getElementById("heatmap-note").textContent !== D.undrawn_note) problems.push("no note for an undrawn head");
      if (document.getElementById("head-info").textContent.indexOf("entropy") < 0) problems.push("no info for an undrawn head");
    }
    if (keys.length) {  // the hover checks need a drawn map (a very long input may embed none)
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
      if (focusStrip && Math.abs(Number(focusStrip.spans[0].dataset.value) - rollRaw[(n - 1) * n]) > 1e-4)
        problems.push("the rollout strip does not show the hovered token's row");
    }
    problems = problems.concat(errors);
    var out = document.createElement("pre");
    out.id = "selftest-result";
    out.dataset.status = problems.length ? "fail" : "pass";
    out.dataset.checkedHeads = String(keys.length);
    out.dataset.checkedNorms = String(norms);
    out.dataset.rollout = rollPanel ? "map" : (rollStrips.length ? "rows-" + rollStrips.length : "none");
    out.textContent = problems.length ? problems.join("\n") : "selftest pass: " + keys.length + " heads drawn, " +
      norms + " norm maps, rollout " + out.dataset.rollout + (keys.length ? ", hover ok" : ", no map to hover");
    document.body.appendChild(out);
  }
  if (location.hash === "#selftest") {
    try { selftest(); } catch (e) { recordError("selftest threw: " + e); var o = document.createElement("pre");
      o.id = "selftest-result"; o.dataset.status = "fail"; o.textContent = String(e); document.body.appendChild(o); }
  }
})();
