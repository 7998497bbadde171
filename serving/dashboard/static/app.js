// Flywheel ops dashboard: logs in with an ops token, reads GET /v1/dashboard every few seconds,
// draws it with Plotly.js, and calls the admin API's promote and rollback routes.
// All text from the API goes into the DOM through textContent (never innerHTML).
"use strict";

(function () {
  const TOKEN_KEY = "flywheel.token";
  const REFRESH_MS = 3000;
  const STATUS_COLORS = {
    candidate: "#6b7280", deployed: "#15803d", rejected: "#b91c1c", retired: "#a16207", deleted: "#111827",
  };
  const PLOT_CONFIG = { displayModeBar: false, responsive: true };

  let timer = null;
  let inFlight = null;
  let again = false;
  let last = null;

  const $ = (id) => document.getElementById(id);

  // ------------------------------------------------------------------ formatting

  function pct(value, digits = 1) {
    return value === null || value === undefined ? "–" : (100 * value).toFixed(digits) + " %";
  }
  function num(value, digits = 3) {
    return value === null || value === undefined ? "–" : Number(value).toFixed(digits);
  }
  function signed(value, digits = 3) {
    if (value === null || value === undefined) return "–";
    const v = Number(value);
    return (v >= 0 ? "+" : "") + v.toFixed(digits);
  }
  function time(iso) {
    return iso ? new Date(iso).toLocaleString() : "–";
  }
  function seconds(s) {
    if (s === null || s === undefined) return "–";
    if (s < 120) return s.toFixed(0) + " s";
    if (s < 7200) return (s / 60).toFixed(1) + " min";
    return (s / 3600).toFixed(1) + " h";
  }
  function short(id) {
    return id && id.length > 24 ? id.slice(0, 22) + "…" : id || "–";
  }

  function cell(row, text, cls) {
    const td = document.createElement("td");
    td.textContent = text === null || text === undefined ? "–" : String(text);
    if (cls) td.className = cls;
    row.appendChild(td);
    return td;
  }
  function fillTable(tableId, rows, build) {
    const body = $(tableId).querySelector("tbody");
    body.replaceChildren();
    for (const item of rows) {
      const tr = document.createElement("tr");
      build(tr, item);
      body.appendChild(tr);
    }
  }

  // ------------------------------------------------------------------ API

  function token() {
    return sessionStorage.getItem(TOKEN_KEY);
  }

  async function api(method, path, body) {
    const sent = token();
    const headers = { Authorization: "Bearer " + sent, Accept: "application/json" };
    const init = { method, headers, cache: "no-store" };
    if (body !== undefined) {
      headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(body);
    }
    const response = await fetch(path, init);
    let data = null;
    try {
      data = await response.json();
    } catch (err) {
      data = { error: "invalid", reason: "the API answered " + response.status + " without JSON" };
    }
    const current = token() === sent;
    if (response.status === 401 && current) {
      showLogin((data && data.reason) || "unauthorized");
    }
    return { status: response.status, ok: response.ok, data, current };
  }

  // ------------------------------------------------------------------ login

  function showLogin(reason) {
    sessionStorage.removeItem(TOKEN_KEY);
    stopRefresh();
    $("app").hidden = true;
    $("logout").hidden = true;
    $("whoami").textContent = "";
    $("login").hidden = false;
    $("login-error").textContent = reason ? "Not logged in: " + reason : "";
    $("token-input").value = "";
    $("token-input").focus();
  }

  function showApp() {
    $("login").hidden = true;
    $("app").hidden = false;
    $("logout").hidden = false;
  }

  function onLogin(event) {
    event.preventDefault();
    const value = $("token-input").value.trim();
    if (!value) return;
    sessionStorage.setItem(TOKEN_KEY, value);
    $("login-error").textContent = "";
    $("action-result").textContent = "";
    $("action-result").className = "result";
    refresh().then(startRefresh);
  }

  function startRefresh() {
    stopRefresh();
    if (token()) timer = setInterval(refresh, REFRESH_MS);
  }
  function stopRefresh() {
    if (timer !== null) clearInterval(timer);
    timer = null;
  }

  // ------------------------------------------------------------------ refresh

  // One request at a time; a refresh asked for meanwhile runs once the current one is done.
  function refresh() {
    if (!token()) return Promise.resolve();
    if (inFlight) {
      again = true;
      return inFlight;
    }
    inFlight = load().finally(() => {
      inFlight = null;
      if (again) {
        again = false;
        return refresh();
      }
    });
    return inFlight;
  }

  async function load() {
    try {
      const answer = await api("GET", "/v1/dashboard");
      if (!answer.current || answer.status === 401) return; // logged out or in as someone else meanwhile
      if (!answer.ok) {
        showApp();
        $("load-error").textContent = "Dashboard data: " + answer.status + " " + ((answer.data && answer.data.reason) || "");
        return;
      }
      $("load-error").textContent = "";
      last = answer.data;
      showApp();
      render(answer.data);
    } catch (err) {
      $("load-error").textContent = "Dashboard data: " + err;
    }
  }

  function render(d) {
    $("fleet").textContent = "fleet " + d.fleet;
    $("refreshed").textContent = "updated " + time(d.generated_at);
    $("whoami").textContent = d.viewer ? d.viewer.name + " (" + d.viewer.role + ")" : "";
    renderTraffic(d);
    renderCheckpoints(d);
    renderVersions(d);
    renderComparison(d);
    renderLag(d);
    renderEvents(d);
    renderRollbackChoices(d);
    document.body.dataset.rendered = String(Date.now());
  }

  // ------------------------------------------------------------------ panels

  function renderTraffic(d) {
    fillTable("traffic-table", d.traffic, (tr, t) => {
      tr.id = "traffic-" + t.role;
      cell(tr, t.role, "role-" + t.role);
      cell(tr, t.policy_version);
      cell(tr, pct(t.weight)).className = "weight";
      cell(tr, t.status || "active");
    });
    const traces = d.traffic.map((t) => ({
      type: "bar", orientation: "h", name: t.role + " " + short(t.policy_version), x: [100 * t.weight], y: ["traffic"],
      text: [pct(t.weight, 0)], textposition: "inside", hoverinfo: "name+x",
      marker: { color: t.role === "stable" ? "#15803d" : "#d97706" },
    }));
    Plotly.react("traffic-plot", traces, {
      barmode: "stack", margin: { l: 60, r: 10, t: 10, b: 40 }, xaxis: { range: [0, 100], title: { text: "% of new sessions" } },
      legend: { orientation: "h", y: -0.45 }, showlegend: true,
    }, PLOT_CONFIG);
  }

  function depths(checkpoints) {
    const byId = new Map(checkpoints.map((c) => [c.id, c]));
    const memo = new Map();
    const depth = (c, seen) => {
      if (memo.has(c.id)) return memo.get(c.id);
      const parent = c.parent_id ? byId.get(c.parent_id) : null;
      const value = parent && !seen.has(parent.id) ? depth(parent, new Set([...seen, c.id])) + 1 : 0;
      memo.set(c.id, value);
      return value;
    };
    checkpoints.forEach((c) => depth(c, new Set([c.id])));
    return memo;
  }

  function renderCheckpoints(d) {
    const cps = d.checkpoints;
    fillTable("checkpoints-table", cps.slice().reverse(), (tr, c) => {
      tr.dataset.checkpoint = c.id;
      cell(tr, c.policy_version);
      cell(tr, c.parent_id || "(root)");
      cell(tr, c.status, "status-" + c.status);
      cell(tr, c.deployed_as || "", c.deployed_as ? "role-" + c.deployed_as : "");
      cell(tr, pct(c.heldout));
      cell(tr, pct(c.live_success));
      cell(tr, num(c.live_reward));
      cell(tr, c.live_sessions);
      cell(tr, time(c.created_at));
    });
    const depth = depths(cps);
    const byId = new Map(cps.map((c) => [c.id, c]));
    const ex = [], ey = [];
    for (const c of cps) {
      const parent = c.parent_id ? byId.get(c.parent_id) : null;
      if (!parent) continue;
      ex.push(parent.created_at, c.created_at, null);
      ey.push(depth.get(parent.id), depth.get(c.id), null);
    }
    const edges = { type: "scatter", mode: "lines", x: ex, y: ey, hoverinfo: "skip", line: { color: "#94a3b8" }, name: "lineage" };
    const statuses = [...new Set(cps.map((c) => c.status))];
    const nodes = statuses.map((status) => {
      const group = cps.filter((c) => c.status === status);
      return {
        type: "scatter", mode: "markers+text", name: status,
        x: group.map((c) => c.created_at), y: group.map((c) => depth.get(c.id)),
        text: group.map((c) => short(c.policy_version) + (c.deployed_as ? " [" + c.deployed_as + "]" : "")),
        textposition: "top center",
        hovertext: group.map((c) => c.id + "<br>status " + c.status + "<br>held-out " + pct(c.heldout)),
        hoverinfo: "text",
        marker: {
          size: group.map((c) => (c.deployed_as ? 16 : 11)), color: STATUS_COLORS[status] || "#334155",
          line: { width: group.map((c) => (c.deployed_as === "canary" ? 3 : 0)), color: "#d97706" },
        },
      };
    });
    const maxDepth = Math.max(0, ...cps.map((c) => depth.get(c.id)));
    Plotly.react("timeline-plot", [edges, ...nodes], {
      margin: { l: 60, r: 20, t: 20, b: 40 }, xaxis: { title: { text: "created" }, type: "date" },
      yaxis: { title: { text: "generation" }, dtick: 1, range: [-0.5, maxDepth + 0.8] }, legend: { orientation: "h", y: -0.25 },
    }, PLOT_CONFIG);
  }

  function renderVersions(d) {
    const cps = d.checkpoints;
    const x = cps.map((c) => short(c.policy_version));
    const traces = [
      { type: "bar", name: "held-out success", x, y: cps.map((c) => c.heldout), marker: { color: "#1d4ed8" } },
      { type: "bar", name: "live success", x, y: cps.map((c) => c.live_success), marker: { color: "#15803d" } },
      { type: "bar", name: "live reward (mean)", x, y: cps.map((c) => c.live_reward), marker: { color: "#d97706" },
        customdata: cps.map((c) => c.live_sessions), hovertemplate: "%{y:.3f} over %{customdata} sessions" },
    ];
    Plotly.react("versions-plot", traces, {
      barmode: "group", margin: { l: 50, r: 10, t: 10, b: 60 }, yaxis: { title: { text: "rate / reward" } },
      legend: { orientation: "h", y: -0.3 },
    }, PLOT_CONFIG);
  }

  function renderComparison(d) {
    const c = d.canary_comparison;
    const text = $("comparison-text");
    if (!c) {
      text.textContent = d.canary ? "No decision by the canary controller yet." : "No canary deployed.";
      Plotly.purge("comparison-plot");
      Plotly.purge("comparison-history");
      return;
    }
    const scope = c.current ? "current canary" : "last canary (" + (c.target || "") + ", not active)";
    text.textContent =
      scope + " " + (c.canary_version || "") + " vs stable " + (c.stable_version || "") + ": " + (c.metric || "metric") +
      " difference " + signed(c.estimate) + " [" + signed(c.lower) + ", " + signed(c.upper) + "]" +
      " (n canary " + (c.n_canary ?? "–") + ", stable " + (c.n_stable ?? "–") + ", alpha " + (c.alpha ?? "–") + ");" +
      " non-inferiority margin −" + num(c.non_inferiority_margin, 3) + ", margin at this step −" + num(c.margin, 3) +
      ". Decision: " + (c.action || "?") + " — " + (c.reason || "") + (c.error ? " (failed: " + c.error + ")" : "");
    const shapes = [
      vline(0, "#6b7280", "dot"),
      vline(-c.non_inferiority_margin, "#b91c1c", "dash"),
    ];
    if (c.margin !== null && c.margin !== undefined && c.margin !== c.non_inferiority_margin) shapes.push(vline(-c.margin, "#d97706", "dash"));
    if (c.regression_margin) shapes.push(vline(-c.regression_margin, "#7f1d1d", "dot"));
    const has = c.estimate !== null && c.estimate !== undefined;
    const lo = has && c.lower !== null ? c.estimate - c.lower : 0;
    const hi = has && c.upper !== null ? c.upper - c.estimate : 0;
    const bounded = (v) => (v === null || v === undefined ? null : Math.max(-1, Math.min(1, v)));
    const range = [
      Math.min(-c.non_inferiority_margin - 0.05, bounded(c.lower) ?? 0, -(c.margin || 0) - 0.05),
      Math.max(0.05, bounded(c.upper) ?? 0),
    ];
    Plotly.react("comparison-plot", [{
      type: "scatter", mode: "markers", name: "canary − stable", x: has ? [c.estimate] : [], y: ["canary − stable"],
      error_x: { type: "data", symmetric: false, array: [hi], arrayminus: [lo], thickness: 2, width: 8 },
      marker: { size: 12, color: "#1d4ed8" },
    }], {
      margin: { l: 110, r: 10, t: 10, b: 40 }, xaxis: { title: { text: (c.metric || "") + " difference" }, range },
      shapes, showlegend: false,
      annotations: [{ x: -c.non_inferiority_margin, y: 1, yref: "paper", text: "−margin", showarrow: false, font: { color: "#b91c1c" } }],
    }, PLOT_CONFIG);
    const h = (c.history || []).filter((p) => p.estimate !== null && p.estimate !== undefined);
    if (h.length < 2) {
      Plotly.purge("comparison-history");
      return;
    }
    const x = h.map((p) => p.at);
    Plotly.react("comparison-history", [
      { type: "scatter", mode: "lines", x, y: h.map((p) => bounded(p.upper)), line: { width: 0 }, showlegend: false, hoverinfo: "skip" },
      { type: "scatter", mode: "lines", x, y: h.map((p) => bounded(p.lower)), fill: "tonexty", fillcolor: "rgba(29,78,216,0.15)",
        line: { width: 0 }, name: "confidence bounds" },
      { type: "scatter", mode: "lines+markers", x, y: h.map((p) => p.estimate), name: "estimate", line: { color: "#1d4ed8" } },
    ], {
      margin: { l: 50, r: 10, t: 10, b: 40 }, legend: { orientation: "h", y: -0.35 },
      shapes: [hline(0, "#6b7280"), hline(-c.non_inferiority_margin, "#b91c1c")],
    }, PLOT_CONFIG);
  }

  function vline(x, color, dash) {
    return { type: "line", x0: x, x1: x, y0: 0, y1: 1, yref: "paper", line: { color, dash, width: 2 } };
  }
  function hline(y, color) {
    return { type: "line", y0: y, y1: y, x0: 0, x1: 1, xref: "paper", line: { color, dash: "dash", width: 1 } };
  }

  function renderLag(d) {
    const stages = [
      ["kafka", "Kafka (ingest group)", (l) => (l.topic ? l.topic + " / " + l.group : "")],
      ["rewarding", "Rewarding", (l) => "oldest " + seconds(l.oldest_overdue_s) + " past the " + seconds(l.feedback_window_s) + " feedback window"],
      ["trainer", "Trainer", (l) => "since " + short(l.checkpoint_id) + " (age " + seconds(l.checkpoint_age_s) + "), oldest waiting " + seconds(l.oldest_waiting_s)],
    ];
    fillTable("lag-table", stages, (tr, [key, label, detail]) => {
      const lag = d.lag[key] || {};
      tr.id = "lag-" + key;
      cell(tr, label);
      cell(tr, lag.value === null || lag.value === undefined ? "unknown" : lag.value + " " + lag.unit);
      cell(tr, [lag.reason, lag.value === null || lag.value === undefined ? "" : detail(lag)].filter(Boolean).join("; "));
    });
    const n = d.counts;
    $("counts").textContent =
      n.raw_events + " events, " + n.sessions + " sessions, " + n.rewards + " rewards, " + n.samples + " samples; " +
      n.promotions + " promotions, " + n.rollbacks + " rollbacks" +
      (d.paused.trainer.paused ? "; training paused" : "") + (d.paused.canary.paused ? "; canary controller paused" : "");
  }

  function renderEvents(d) {
    fillTable("events-table", d.events, (tr, e) => {
      cell(tr, time(e.at));
      cell(tr, e.actor);
      cell(tr, e.action);
      cell(tr, e.target);
      cell(tr, e.success ? "yes" : "no", e.success ? "" : "error");
      cell(tr, e.reason || "");
    });
  }

  function renderRollbackChoices(d) {
    const select = $("rollback-to");
    const chosen = select.value;
    const wanted = d.checkpoints.filter((c) => c.status !== "rejected" && c.status !== "deleted").map((c) => c.id);
    const current = [...select.options].slice(1).map((o) => o.value);
    if (wanted.join("\n") === current.join("\n")) return;
    while (select.options.length > 1) select.remove(1);
    for (const id of wanted) {
      const option = document.createElement("option");
      option.value = id;
      option.textContent = id;
      select.appendChild(option);
    }
    if (wanted.includes(chosen)) select.value = chosen;
  }

  // ------------------------------------------------------------------ actions

  // The HTTP status a failed operation's error stands for (as the API answers it with ?wait=true).
  const OPERATION_ERROR_STATUS = { not_found: 404, conflict: 409, invalid: 422, failed: 502, internal: 500, abandoned: 502 };
  const POLL_MS = 1000;

  // Promote and roll back answer 202 with an operation at once; read it until it ends and answer
  // as the synchronous API would: 200 with what the action did, or the failure's status and reason.
  async function followOperation(kind, accepted, show) {
    const id = accepted.data.id;
    const started = Date.now();
    let op = accepted.data;
    while (op.state === "queued" || op.state === "running") {
      show(kind + ": operation " + id + " " + op.state + " (" + Math.round((Date.now() - started) / 1000) + " s)");
      await new Promise((resolve) => setTimeout(resolve, POLL_MS));
      const answer = await api("GET", "/v1/operations/" + encodeURIComponent(id));
      if (!answer.ok) return answer;
      op = answer.data;
    }
    if (op.state === "succeeded") return { status: 200, ok: true, data: op.result || {}, current: true };
    return {
      status: OPERATION_ERROR_STATUS[op.error] || 502,
      ok: false,
      data: { error: op.error, reason: "operation " + id + ": " + op.reason },
      current: true,
    };
  }

  function describe(answer) {
    const d = answer.data || {};
    if (!answer.ok) {
      return answer.status + " " + (d.error || "error") + ": " + (d.reason || "") +
        (d.required_role ? " (needs the " + d.required_role + " role)" : "");
    }
    const lines = [answer.status + " " + (d.action || "done") + " by " + (d.actor || "?")];
    if (d.stable) lines.push("stable: " + d.stable.policy_version + " (weight " + pct(d.stable.weight, 0) + ")");
    lines.push("canary: " + (d.canary ? d.canary.policy_version + " (weight " + pct(d.canary.weight, 0) + ")" : "none"));
    for (const e of d.ended || []) lines.push("ended: " + (e.role || "") + " " + (e.checkpoint_id || "") + " → " + (e.status || ""));
    for (const s of d.swaps || []) lines.push("swap " + s.url + ": " + s.from_version + " → " + s.to_version + (s.ok ? " ok" : " FAILED " + (s.reason || "")));
    return lines.join("\n");
  }

  async function act(kind) {
    const reason = $("reason").value.trim() || null;
    let path, body, question;
    if (kind === "promote") {
      const canary = last && last.canary;
      question = "Promote the canary " + (canary ? canary.policy_version : "(none known)") + " to stable on every replica?";
      path = "/v1/promote";
      body = { reason };
    } else {
      const to = $("rollback-to").value || null;
      question = to ? "Roll back: serve checkpoint " + to + " as stable?" : "Roll back: end the canary (or return to the previous stable)?";
      path = "/v1/rollback";
      body = { to_checkpoint_id: to, reason };
    }
    if (!window.confirm(question)) return;
    const result = $("action-result");
    const buttons = [$("promote"), $("rollback")];
    buttons.forEach((b) => (b.disabled = true));
    result.className = "result";
    delete result.dataset.status;
    result.textContent = kind + " … waiting for the API";
    try {
      let answer = await api("POST", path, body);
      if (answer.status === 202) answer = await followOperation(kind, answer, (text) => (result.textContent = text));
      result.textContent = describe(answer);
      result.className = "result " + (answer.ok ? "ok" : "fail");
      result.dataset.status = String(answer.status);
    } catch (err) {
      result.textContent = kind + " failed: " + err;
      result.className = "result fail";
    } finally {
      buttons.forEach((b) => (b.disabled = false));
      await refresh();
    }
  }

  // ------------------------------------------------------------------ start

  document.addEventListener("DOMContentLoaded", () => {
    $("login-form").addEventListener("submit", onLogin);
    $("logout").addEventListener("click", () => showLogin(""));
    $("promote").addEventListener("click", () => act("promote"));
    $("rollback").addEventListener("click", () => act("rollback"));
    if (token()) {
      refresh().then(startRefresh);
    } else {
      showLogin("");
    }
  });
})();
