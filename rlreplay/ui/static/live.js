// Live updates: poll the run's version; when files change, re-fetch this page and swap
// the parts marked data-live (server-rendered, already escaped).
(function () {
  const body = document.body;
  const url = body.dataset.versionUrl;
  if (!url) return;
  const every = Number(body.dataset.pollMs) || 1500;
  async function tick() {
    try {
      const r = await fetch(url, { cache: "no-store" });
      const v = (await r.json()).version;
      if (v !== body.dataset.current) {
        const page = await fetch(location.href, { cache: "no-store" });
        const doc = new DOMParser().parseFromString(await page.text(), "text/html");
        document.querySelectorAll("[data-live][id]").forEach(function (el) {
          const fresh = doc.getElementById(el.id);
          if (fresh) el.replaceWith(document.importNode(fresh, true));
        });
        body.dataset.current = v;
        body.dataset.updates = String(Number(body.dataset.updates || 0) + 1);
      }
    } catch (e) {
      // server gone or busy: try again later
    }
    setTimeout(tick, every);
  }
  setTimeout(tick, every);
})();
