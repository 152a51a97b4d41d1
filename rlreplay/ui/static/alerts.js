// The front page's alerts: a server-rendered fragment (already escaped), loaded at once and
// again whenever live.js sees the run change (it updates the body's data-current).
(function () {
  const box = document.getElementById("alerts");
  if (!box || !box.dataset.alertsUrl) return;
  async function load() {
    try {
      const r = await fetch(box.dataset.alertsUrl, { cache: "no-store" });
      if (r.ok) {
        box.innerHTML = await r.text();
        box.dataset.loaded = String(Number(box.dataset.loaded || 0) + 1);
      } else {
        const p = document.createElement("p");
        p.className = "warn";
        p.textContent = "The alerts could not be computed (HTTP " + r.status + "): see the findings page.";
        box.replaceChildren(p);
      }
    } catch (e) {
      // server gone or busy: the next change tries again
    }
  }
  load();
  new MutationObserver(load).observe(document.body, { attributes: true, attributeFilter: ["data-current"] });
})();
