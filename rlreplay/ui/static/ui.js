// Tooltips for anything carrying data-tip (chart columns, histogram bars) and for tokens (their
// values come once, as JSON in #token-data); the token overlay switch; the minimap; keyboard
// moves: j / k (or → / ←) follow the page's data-key=next / prev links.
(function () {
  const tip = document.createElement("div");
  tip.id = "tip";
  document.body.appendChild(tip);
  const tokens = document.getElementById("tokens");
  const dataEl = document.getElementById("token-data");
  let data = null;
  function num(v) { return v === null || v === undefined ? null : Number(v).toFixed(4); }
  function tokenTip(el) {
    if (!data) data = JSON.parse(dataEl.textContent);
    const chunk = el.parentElement;
    const k = Number(chunk.dataset.from) + Array.prototype.indexOf.call(chunk.children, el);
    let t = "#" + k + " id " + data.ids[k] + " · " + (data.mask[k] ? "model" : "tool") + " · " + JSON.stringify(el.textContent);
    const lp = data.logprob ? data.logprob[k] : null;
    const tr = data.trainer ? data.trainer[k] : null;
    const en = data.entropy ? data.entropy[k] : null;
    if (lp !== null) t += " · logprob " + num(lp);
    if (tr !== null && lp !== null) t += " · trainer " + num(tr) + " (|Δ| " + num(Math.abs(tr - lp)) + ")";
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
    if (t.classList && t.classList.contains("tk") && tokens && dataEl) text = tokenTip(t);
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
  if (view && sw) {
    const set = function () { const c = sw.querySelector("input:checked"); if (c) view.dataset.ov = c.value; };
    sw.addEventListener("change", set);
    set();
  }
  const minimap = document.getElementById("minimap");
  if (minimap && tokens) minimap.addEventListener("click", function (e) {
    const at = e.target.dataset ? e.target.dataset.at : undefined;
    if (at === undefined) return;
    const chunks = tokens.children;
    let c = chunks.length - 1;
    while (c > 0 && Number(chunks[c].dataset.from) > Number(at)) c--;
    chunks[c].children[Number(at) - Number(chunks[c].dataset.from)].scrollIntoView({ block: "center" });
  });
  document.addEventListener("keydown", function (e) {
    if (e.ctrlKey || e.metaKey || e.altKey || /^(INPUT|SELECT|TEXTAREA)$/.test(e.target.tagName)) return;
    const rel = { j: "next", ArrowRight: "next", k: "prev", ArrowLeft: "prev" }[e.key];
    const link = rel && document.querySelector("a[data-key=" + rel + "]");
    if (link) location.href = link.href;
  });
})();
