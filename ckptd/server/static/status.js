// ckptd status page: fetches server-rendered (already escaped) fragments with the bearer token
// kept in sessionStorage, and refreshes them. The token never goes into a URL.
"use strict";
(function () {
  const KEY = "ckptd-token";
  const content = document.getElementById("content");
  const form = document.getElementById("tokenform");
  const updated = document.getElementById("updated");
  const logout = document.getElementById("logout");
  let focus = { root: null, offset: 0 };
  let refreshMs = 2000;
  let timer = null;

  function headers() {
    // X-Ckptd-Page: verify needs it, and a page of another site cannot send it (no CORS here)
    const h = { Accept: "application/json", "X-Ckptd-Page": "1" };
    const t = sessionStorage.getItem(KEY);
    if (t) h.Authorization = "Bearer " + t;
    return h;
  }

  function askToken(message) {
    form.hidden = false;
    logout.hidden = true;
    content.replaceChildren();
    document.getElementById("tokenerror").textContent = message || "";
    updated.textContent = "token needed";
    document.getElementById("token").focus();
  }

  async function call(path, method) {
    const r = await fetch(path, { method: method || "GET", headers: headers(), cache: "no-store" });
    if (r.status === 401) {
      const had = sessionStorage.getItem(KEY);
      sessionStorage.removeItem(KEY);
      askToken(had ? "The daemon refused that token." : "");
      return null;
    }
    if (!r.ok) throw new Error(path + ": HTTP " + r.status);
    return r.json();
  }

  async function refresh() {
    clearTimeout(timer);
    try {
      const q = new URLSearchParams();
      if (focus.root !== null) { q.set("root", focus.root); q.set("offset", String(focus.offset)); }
      const data = await call("/v1/page?" + q.toString());
      if (data === null) return; // waiting for a token
      form.hidden = true;
      logout.hidden = !sessionStorage.getItem(KEY);
      content.innerHTML = data.html; // rendered and escaped by the daemon
      refreshMs = Math.max(500, 1000 * (data.refresh_s || 2));
      updated.textContent = "updated " + new Date().toLocaleTimeString() + ", every " + refreshMs / 1000 + " s";
      updated.className = "muted";
    } catch (e) {
      updated.textContent = "cannot reach the daemon (" + e.message + "); retrying";
      updated.className = "bad";
    }
    timer = setTimeout(refresh, refreshMs);
  }

  form.addEventListener("submit", function (ev) {
    ev.preventDefault();
    const t = document.getElementById("token").value.trim();
    if (!t) return;
    sessionStorage.setItem(KEY, t);
    document.getElementById("token").value = "";
    refresh();
  });

  logout.addEventListener("click", function () {
    sessionStorage.removeItem(KEY);
    askToken("");
  });

  content.addEventListener("click", async function (ev) {
    const b = ev.target.closest("button[data-action]");
    if (!b) return;
    if (b.dataset.action === "page") {
      focus = { root: b.dataset.root, offset: Number(b.dataset.offset) || 0 };
      refresh();
    } else if (b.dataset.action === "verify") {
      b.disabled = true;
      b.textContent = "verifying...";
      const q = new URLSearchParams({ root: b.dataset.root, step: b.dataset.step });
      try { await call("/v1/page/verify?" + q.toString(), "POST"); } catch (e) { b.textContent = e.message; }
      refresh();
    }
  });

  document.addEventListener("visibilitychange", function () { if (!document.hidden) refresh(); });
  refresh();
})();
