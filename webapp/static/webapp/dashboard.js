// Flywheel dashboard: draws the page's Plotly figures and applies live pushes from
// ws/projects/<slug>/ without a reload (Plotly.extendTraces / Plotly.react).
(function () {
  "use strict";
  const slug = document.body.dataset.project;
  const figEl = document.getElementById("figures");
  const figures = figEl ? JSON.parse(figEl.textContent) : {};
  const config = { responsive: true, displaylogo: false };

  function draw() {
    if (!window.Plotly) return;
    document.querySelectorAll("[data-figure]").forEach(function (el) {
      const fig = figures[el.dataset.figure];
      if (fig) Plotly.newPlot(el, fig.data, fig.layout, config);
    });
  }

  function bump(id, by) {
    const el = document.getElementById(id);
    if (!el || !by) return;
    const n = parseInt(el.dataset.value || "0", 10) + by;
    el.dataset.value = String(n);
    el.textContent = n.toLocaleString("en-US");
  }

  function toast(text) {
    const box = document.getElementById("toasts");
    if (!box) return;
    const div = document.createElement("div");
    div.textContent = text;
    box.appendChild(div);
    setTimeout(function () { div.remove(); }, 6000);
  }

  const handlers = {
    ingest: function (m) {
      bump("live-feedback", m.feedback);
      bump("live-trajectories", m.trajectories);
      bump("live-accepted", m.accepted);
      const vol = document.querySelector('[data-figure="volume"]');
      if (vol && vol.data && m.feedback) {
        Plotly.extendTraces(vol, { x: [[new Date().toISOString()]], y: [[m.feedback]] }, [vol.data.length - 1]);
      }
    },
    training_step: function (m) {
      const bar = document.querySelector('[data-run-progress="' + m.run + '"]');
      if (bar && m.progress !== undefined) {
        bar.style.width = (100 * m.progress).toFixed(1) + "%";
        const label = document.getElementById("run-progress-label");
        if (label) label.textContent = (100 * m.progress).toFixed(1) + "% · step " + m.step;
      }
      document.querySelectorAll('[data-metric][data-run="' + m.run + '"]').forEach(function (el) {
        const v = m[el.dataset.metric];
        const idx = parseInt(el.dataset.trace || "0", 10);
        if (v !== undefined && el.data) Plotly.extendTraces(el, { x: [[m.step]], y: [[v]] }, [idx]);
      });
    },
    promotion: function (m) {
      document.querySelectorAll('[data-version-state="' + m.version + '"]').forEach(function (el) {
        el.textContent = m.state;
        el.className = "badge " + m.state;
      });
      toast("v" + m.version + " → " + m.state + (m.actor ? " (" + m.actor + ")" : ""));
    },
    policy_version: function (m) {
      handlers.promotion({ version: m.version, state: m.after, actor: m.actor });
    },
    gate: function (m) {
      toast("gate v" + m.version + ": " + (m.passed ? "passed" : "failed"));
    },
    training_succeeded: function (m) { toast("run " + m.run + " finished: candidate v" + m.candidate); },
    training_failed: function (m) { toast("run " + m.run + " failed"); },
    deploy_failed: function (m) { toast("deploy failed: " + m.error); },
  };

  function connect(delay) {
    if (!slug) return;
    const proto = location.protocol === "https:" ? "wss://" : "ws://";
    const ws = new WebSocket(proto + location.host + "/ws/projects/" + slug + "/");
    const status = document.getElementById("live-status");
    ws.onopen = function () { delay = 1000; if (status) status.className = "live on"; document.body.dataset.live = "on"; };
    ws.onmessage = function (e) {
      const m = JSON.parse(e.data);
      const h = handlers[m.type];
      if (h) h(m);
    };
    ws.onclose = function () {
      if (status) status.className = "live off";
      document.body.dataset.live = "off";
      setTimeout(function () { connect(Math.min(delay * 2, 30000)); }, delay);
    };
  }

  draw();
  connect(1000);
  document.querySelectorAll("form[data-confirm]").forEach(function (f) {
    f.addEventListener("submit", function (e) { if (!confirm(f.dataset.confirm)) e.preventDefault(); });
  });
})();
