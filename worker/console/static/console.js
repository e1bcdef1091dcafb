// probeguard console: keyboard shortcuts, claim renewal, auto-refresh.
// Served as a file: the Content-Security-Policy allows no inline script.
"use strict";

(function () {
  const csrf = () => {
    const meta = document.querySelector('meta[name="csrf-token"]');
    return meta ? meta.content : "";
  };
  const page = document.body.dataset.page;

  function typing(target) {
    const tag = target && target.tagName;
    return tag === "INPUT" || tag === "TEXTAREA" || tag === "SELECT" || (target && target.isContentEditable);
  }

  // Review: one key per label; s skips; u undoes; Enter submits a multi-label answer.
  function reviewKeys(event) {
    if (event.ctrlKey || event.metaKey || event.altKey) return;
    const target = event.target;
    if (typing(target) && !(target.type === "checkbox")) return;
    const key = event.key;
    const el = document.querySelector('[data-key="' + CSS.escape(key) + '"]');
    if (!el || el.disabled) return;
    event.preventDefault();
    if (el.type === "checkbox") {
      el.checked = !el.checked;
      return;
    }
    disableAll();
    el.click();
  }

  // One answer per key press: a held key or a double press must not answer twice.
  let sent = false;
  function disableAll() {
    if (sent) return;
    sent = true;
    setTimeout(() => document.querySelectorAll("[data-key]").forEach((b) => { b.dataset.key = ""; }), 0);
  }

  function numbers(data) {
    for (const id of ["depth", "waiting", "claimed", "held", "lag"]) {
      const el = document.getElementById(id);
      if (el && id in data) el.textContent = String(data[id]);
    }
    const rate = document.getElementById("rate");
    if (rate && "rate" in data) rate.textContent = Number(data.rate).toFixed(1);
  }

  // While the page is open, renew the claim (a third of its TTL); a lost claim reloads.
  // A renewal that fails (Redis or the console unreachable) shows the #offline banner and
  // is retried sooner; the first one that succeeds hides it again.
  function heartbeat(item) {
    const ttl = Number(item.dataset.claimTtl || 60);
    const every = Math.max(2000, (ttl * 1000) / 3);
    const banner = document.getElementById("offline");
    const why = document.getElementById("offline-why");
    function trouble(text) {
      if (!banner) return;
      if (why) why.textContent = text;
      banner.hidden = false;
    }
    async function beat() {
      let ok = false;
      const stop = new AbortController();
      const timer = setTimeout(() => stop.abort(), 10000);
      try {
        const r = await fetch("/review/heartbeat", {
          method: "POST",
          headers: { "X-CSRF-Token": csrf(), "Accept": "application/json" },
          credentials: "same-origin",
          signal: stop.signal,
        });
        if (r.status === 401) { location.reload(); return; }
        if (r.ok) {
          const data = await r.json();
          numbers(data);
          if (data.claim_kept === false) { location.reload(); return; }
          ok = true;
        } else {
          trouble(r.status === 503 ? "the console cannot reach Redis" : "the console answered " + r.status);
        }
      } catch (e) {
        trouble("the console does not answer");
      } finally {
        clearTimeout(timer);
      }
      if (ok && banner) banner.hidden = true;
      setTimeout(beat, ok ? every : Math.min(every, 3000));
    }
    setTimeout(beat, every);
  }

  // An error page that can be retried (a Redis outage) tries again by itself.
  const retry = document.getElementById("retry");
  if (retry) {
    const s = Number(retry.dataset.retry || 5);
    setTimeout(() => { location.href = retry.dataset.retryUrl || location.href; }, s * 1000);
  }

  if (page === "review") {
    document.addEventListener("keydown", reviewKeys);
    const item = document.getElementById("item");
    if (item) heartbeat(item);
    const empty = document.getElementById("empty");
    if (empty) {
      const s = Number(empty.dataset.refresh || 5);
      setTimeout(() => location.reload(), s * 1000);
    }
  }

  if (page === "explain") {
    const form = document.getElementById("explain-form");
    if (form) {
      form.addEventListener("keydown", (event) => {
        if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) {
          event.preventDefault();
          form.requestSubmit();
        }
      });
    }
  }
})();
