// loip's dashboard: polls /dashboard.json and /metrics once a second (with the API key
// from local storage when the server asks for one) and draws the devices. A link may carry
// the key as `/#key=KEY` (a fragment never reaches the server): it is stored and taken off
// the address bar.
"use strict";
const $ = (id) => document.getElementById(id);
{
  const m = /^#key=(.+)$/.exec(location.hash);
  if (m) {
    localStorage.setItem("loip-key", decodeURIComponent(m[1]));
    history.replaceState(null, "", location.pathname);
  }
}
let last = null; // {t, tokens, devices: {name: steps}}

function mib(b) {
  if (b == null) return "?";
  if (b >= 1 << 30) return (b / (1 << 30)).toFixed(2) + " GiB";
  return (b / (1 << 20)).toFixed(1) + " MiB";
}

function headers() {
  const k = localStorage.getItem("loip-key");
  return k ? { Authorization: "Bearer " + k } : {};
}

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text != null) e.textContent = text;
  return e;
}

function meter(used, total, cls) {
  const m = el("div", "meter" + (cls ? " " + cls : ""));
  const f = el("div");
  f.style.width = total > 0 ? Math.min(100, (100 * used) / total).toFixed(1) + "%" : "0";
  m.appendChild(f);
  return m;
}

// one value of a series in Prometheus text (no labels)
function series(text, name) {
  const line = text.split("\n").find((l) => l.startsWith(name + " "));
  return line ? parseFloat(line.slice(name.length + 1)) : 0;
}

function device(d, plan, rates) {
  const box = el("div", "device" + (d.alive ? "" : " gone"));
  box.dataset.device = d.name;
  const p = plan && plan.devices.find((x) => x.name === d.name);
  let title = d.name + (d.addr ? " · " + d.addr : "");
  if (p && p.holds_embedding) title += " [E]";
  if (p && p.holds_head) title += " [H]";
  box.appendChild(el("h2", null, title + (d.alive ? "" : " — gone: " + (d.reason || ""))));
  const used = d.memory ? d.memory.resident + d.memory.slot + d.memory.working + (d.kv_used_bytes || 0) : d.planned_bytes;
  const budget = d.memory ? d.memory.budget : d.budget_bytes;
  box.appendChild(el("div", "small", "memory " + mib(used) + " of " + mib(budget) + " (planned " + mib(d.planned_bytes) + ")"));
  box.appendChild(meter(used, budget));
  if (p) {
    let res = 0, off = 0;
    const blocks = el("div", "blocks");
    p.stages.forEach((s, i) => {
      if (i > 0) blocks.appendChild(el("span", "blk sep"));
      s.layers.forEach((l) => {
        for (const [kind, r] of [["attention", l.attn], ["MLP", l.mlp]]) {
          const streamed = r === "offloaded";
          streamed ? off++ : res++;
          const b = el("span", "blk " + (streamed ? "off" : "res"));
          b.title = "layer " + l.layer + " " + kind + (streamed ? ": streamed" : ": resident");
          blocks.appendChild(b);
        }
      });
    });
    const ranges = p.stages.map((s) => s.layers.length ? s.layers[0].layer + "–" + s.layers[s.layers.length - 1].layer : "none");
    box.appendChild(el("div", "small", "stages " + ranges.join(", ") + " · " + res + " resident, " + off + " streamed blocks"));
    box.appendChild(blocks);
  }
  if (d.kv_budget_bytes != null) {
    let kv = "KV " + mib(d.kv_used_bytes) + " of " + mib(d.kv_budget_bytes);
    if (d.adapt) {
      kv += " · threshold " + (d.adapt.threshold ?? "–") + " tokens, crossed " + d.adapt.crossings + "×";
      kv += ", lent " + d.adapt.lent_tokens + " tokens, borrowed " + mib(d.adapt.borrowed_bytes);
    }
    box.appendChild(el("div", "small", kv));
    box.appendChild(meter(d.kv_used_bytes || 0, d.kv_budget_bytes, "kv"));
  }
  const r = rates[d.name];
  const bars = el("div", "bars");
  for (const k of ["compute", "network", "stall", "queued"]) {
    const b = el("div", k);
    b.style.width = r ? (100 * Math.min(1, r[k])).toFixed(1) + "%" : "0";
    bars.appendChild(b);
  }
  box.appendChild(bars);
  if (d.steps) {
    const s = d.steps;
    box.appendChild(el("div", "small totals",
      "totals: compute " + s.compute_s.toFixed(3) + " s, network " + s.network_s.toFixed(3) +
      " s, load stall " + s.stall_s.toFixed(3) + " s, queued " + s.queued_s.toFixed(3) +
      " s, " + s.hops + " hops, " + mib(s.loaded_bytes) + " loaded"));
  }
  return box;
}

async function poll() {
  let data, metrics;
  try {
    const r = await fetch("/dashboard.json", { headers: headers() });
    if (r.status === 401) {
      $("key").hidden = false;
      $("status").textContent = "API key needed";
      $("status").className = "status wait";
      return;
    }
    data = await r.json();
    const m = await fetch("/metrics", { headers: headers() });
    metrics = m.ok ? await m.text() : "";
  } catch (e) {
    $("status").textContent = "server unreachable";
    $("status").className = "status bad";
    return;
  }
  $("key").hidden = true;
  const now = performance.now() / 1000;
  const tokens = series(metrics, "loip_completion_tokens_total");
  const rates = {};
  const devs = {};
  for (const d of data.devices) devs[d.name] = d.steps;
  if (last) {
    const dt = Math.max(1e-3, now - last.t);
    $("throughput").textContent = ((tokens - last.tokens) / dt).toFixed(1);
    for (const d of data.devices) {
      const a = last.devices[d.name], b = d.steps;
      if (a && b) {
        rates[d.name] = {
          compute: (b.compute_s - a.compute_s) / dt, network: (b.network_s - a.network_s) / dt,
          stall: (b.stall_s - a.stall_s) / dt, queued: (b.queued_s - a.queued_s) / dt,
        };
      }
    }
  }
  last = { t: now, tokens, devices: devs };
  $("model").textContent = data.model;
  $("placement").textContent = data.placement;
  const gone = data.devices.some((d) => !d.alive);
  $("status").textContent = data.replanning ? "re-planning" : gone ? "degraded" : "ok";
  $("status").className = "status " + (data.replanning ? "wait" : gone ? "bad" : "ok");
  const s = data.scheduler;
  $("running").textContent = s.running;
  $("queued").textContent = s.queued;
  $("tokens").textContent = tokens;
  $("kv").textContent = mib(s.kv_used_bytes) + " used, " + mib(s.kv_reserved_bytes) + " reserved" +
    (s.kv_budget_bytes != null ? " of " + mib(s.kv_budget_bytes) : "");
  if (data.plan) {
    const p = data.plan, b = p.breakdown;
    $("plan").textContent = "planner " + p.planner + ", " + p.devices.length + " device(s), " +
      p.stages_per_device + " stage(s) each, context " + p.context + " tokens" +
      (data.missing && data.missing.length ? " · missing: " + data.missing.join(", ") : "");
    $("predicted").textContent = "predicted " + p.predicted_ms_per_token.toFixed(1) + " ms/token = compute " +
      b.compute_ms.toFixed(1) + " + communication " + b.comm_ms.toFixed(1) + " + uncovered load " + b.uncovered_load_ms.toFixed(1);
  }
  if (!data.replanning) {
    const box = $("devices");
    box.replaceChildren(...data.devices.map((d) => device(d, data.plan, rates)));
  }
}

$("key-save").onclick = () => {
  localStorage.setItem("loip-key", $("key-input").value.trim());
  poll();
};
poll();
setInterval(poll, 1000);
