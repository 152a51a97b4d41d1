// Tooltips for anything carrying data-tip (chart columns, histogram bars, tokens), and keyboard
// moves: j / k (or ← / →) follow the page's rel=prev / rel=next links.
(function () {
  const tip = document.createElement("div");
  tip.id = "tip";
  document.body.appendChild(tip);
  function place(e) {
    const x = Math.min(e.clientX + 12, window.innerWidth - tip.offsetWidth - 4);
    const y = e.clientY + 16 + tip.offsetHeight > window.innerHeight ? e.clientY - tip.offsetHeight - 8 : e.clientY + 16;
    tip.style.left = x + "px";
    tip.style.top = y + "px";
  }
  document.addEventListener("mouseover", function (e) {
    const el = e.target.closest ? e.target.closest("[data-tip]") : null;
    if (!el) { tip.style.display = "none"; return; }
    tip.textContent = el.dataset.tip;
    tip.style.display = "block";
    place(e);
  });
  document.addEventListener("mousemove", function (e) { if (tip.style.display === "block") place(e); });
  document.addEventListener("keydown", function (e) {
    if (e.ctrlKey || e.metaKey || e.altKey || /^(INPUT|SELECT|TEXTAREA)$/.test(e.target.tagName)) return;
    const rel = { j: "next", ArrowRight: "next", k: "prev", ArrowLeft: "prev" }[e.key];
    const link = rel && document.querySelector("a[data-key=" + rel + "]");
    if (link) location.href = link.href;
  });
})();
