// Tooltips for anything carrying data-tip (chart columns, histogram bars) and for tokens; the
// tokens themselves, drawn from #token-data a block at a time (the first blocks at once, the rest
// in the background, or at once up to a minimap click's token); the token overlay switch; the
// minimap; keyboard moves: j / k (or → / ←) follow the page's data-key=next / prev links.
(function () {
  const tip = document.createElement("div");
  tip.id = "tip";
  document.body.appendChild(tip);
  const tokens = document.getElementById("tokens");
  const dataEl = document.getElementById("token-data");
  const valuesEl = document.getElementById("token-values");
  const FIRST_BLOCKS = 4; // drawn before the page shows; the rest in the background
  let data = null, values = null, drawn = 0;
  const ESC = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" };
  function escape(text) { return String(text).replace(/[&<>"]/g, function (c) { return ESC[c]; }); }
  function drawBlock() {
    const n = data.ids.length, size = Number(tokens.dataset.chunk), end = Math.min(drawn + size, n);
    const overlays = [["a", data.levels.logprob], ["b", data.levels.mismatch], ["c", data.levels.entropy]]
      .filter(function (o) { return o[1]; });
    const parts = [];
    for (let k = drawn; k < end; k++) {
      let cls = "tk m" + data.mask[k];
      for (const [prefix, levels] of overlays) {
        const level = levels.charCodeAt(k) - 97;
        if (level) cls += " " + prefix + level;
      }
      let piece = data.html[data.ids[k]];
      if (piece === undefined) piece = data.html[data.ids[k]] = escape(data.text[data.ids[k]]);
      parts.push('<span class="' + cls + '">' + piece + "</span>");
    }
    const block = document.createElement("div");
    block.className = "chunk";
    block.dataset.from = drawn;
    block.innerHTML = parts.join("");
    tokens.appendChild(block);
    drawn = end;
    tokens.dataset.drawn = drawn;
  }
  function drawUpTo(k) { while (drawn <= k && drawn < data.ids.length) drawBlock(); }
  function drawRest() { // blocks for up to ~12 ms, then the page gets its turn (input, paint)
    const start = performance.now();
    while (drawn < data.ids.length && performance.now() - start < 12) drawBlock();
    if (drawn < data.ids.length) setTimeout(drawRest, 0);
  }
  if (tokens && dataEl) {
    data = JSON.parse(dataEl.textContent);
    data.html = {};
    tokens.textContent = "";
    if (data.ids.length > Number(tokens.dataset.chunk)) tokens.classList.add("chunked"); // lays out blocks in view only
    for (let b = 0; b < FIRST_BLOCKS && drawn < data.ids.length; b++) drawBlock();
    setTimeout(drawRest, 0);
  }
  function num(v) { return v === null || v === undefined ? null : Number(v).toFixed(4); }
  function tokenTip(el) {
    if (!values) values = JSON.parse(valuesEl.textContent);
    const chunk = el.parentElement;
    const k = Number(chunk.dataset.from) + Array.prototype.indexOf.call(chunk.children, el);
    let t = "#" + k + " id " + data.ids[k] + " · " + (data.mask[k] === "1" ? "model" : "tool") + " · " + JSON.stringify(el.textContent);
    const lp = values.logprob ? values.logprob[k] : null;
    const tr = values.trainer ? values.trainer[k] : null;
    const en = values.entropy ? values.entropy[k] : null;
    if (lp !== null) t += " · logprob " + num(lp);
    if (tr !== null && data.mask[k] !== "1") t += " · trainer " + num(tr) + " · not counted in |Δ| (not the model's token)";
    else if (tr !== null && lp !== null) t += " · trainer " + num(tr) + " (|Δ| " + num(values.gap[k] !== null ? values.gap[k] : Math.abs(tr - lp)) + ")";
    if (en !== null) t += " · entropy " + num(en);
    return t;
  }
  function place(e) {
    const x = Math.min(e.clientX + 12, window.innerWidth - tip.offsetWidth - 4);
    const y = e.clientY + 16 + tip.offsetHeight > window.innerHeight ? e.clientY - tip.offsetHeight - 8 : e.clientY + 16;
    tip.style.left = x + "px";
    tip.style.top = y + "px";
  }
  document.addEventListener("mouseover", function (e) {
    const t = e.target;
    let text = null;
    if (t.classList && t.classList.contains("tk") && data) text = tokenTip(t);
    else {
      const el = t.closest ? t.closest("[data-tip]") : null;
      if (el) text = el.dataset.tip;
    }
    if (text === null) { tip.style.display = "none"; return; }
    tip.textContent = text;
    tip.style.display = "block";
    place(e);
  });
  document.addEventListener("mousemove", function (e) { if (tip.style.display === "block") place(e); });
  const view = document.getElementById("token-view");
  const sw = document.getElementById("overlay-switch");
  const asked = new URLSearchParams(location.search); // ?ov=OVERLAY&at=TOKEN (the mismatch page's links)
  if (view && sw) {
    const wanted = sw.querySelector("input[value='" + (asked.get("ov") || "").replace(/[^a-z]/g, "") + "']");
    if (wanted && !wanted.disabled) wanted.checked = true;
    const set = function () { const c = sw.querySelector("input:checked"); if (c) view.dataset.ov = c.value; };
    sw.addEventListener("change", set);
    set();
  }
  function tokenAt(k) { // token k, drawn
    drawUpTo(k);
    const chunks = tokens.children;
    let c = chunks.length - 1;
    while (c > 0 && Number(chunks[c].dataset.from) > k) c--;
    return chunks[c].children[k - Number(chunks[c].dataset.from)];
  }
  const minimap = document.getElementById("minimap");
  if (minimap && data) minimap.addEventListener("click", function (e) {
    const at = e.target.dataset ? e.target.dataset.at : undefined;
    if (at === undefined) return;
    tokenAt(Number(at)).scrollIntoView({ block: "center" });
  });
  const at = asked.get("at");
  if (data && at !== null && /^[0-9]+$/.test(at) && Number(at) < data.ids.length) {
    const el = tokenAt(Number(at));
    el.classList.add("at");
    el.scrollIntoView({ block: "center" });
  }
  document.addEventListener("keydown", function (e) {
    if (e.ctrlKey || e.metaKey || e.altKey || /^(INPUT|SELECT|TEXTAREA)$/.test(e.target.tagName)) return;
    const rel = { j: "next", ArrowRight: "next", k: "prev", ArrowLeft: "prev" }[e.key];
    const link = rel && document.querySelector("a[data-key=" + rel + "]");
    if (link) location.href = link.href;
  });
})();
