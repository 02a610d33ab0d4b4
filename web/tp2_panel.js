// minimax-h3-tp2: the TP panel (a sidebar tab on rank 0), the TP2 Status node's text on the canvas, nodes' warnings as toasts.
//
// The panel polls rank 0's GET /tp2/cluster (nodes/status_api.py: every rank's /tp2/status, fetched by rank 0,
// with a health verdict): the ranks, their health, the process group, the last agreement, each rank's progress
// (ComfyUI's own progress registry on that rank) and the pack's settings. Every 3 s while open, every 0.5 s
// while a prompt runs. ComfyUI's frontend renders a node's "text" output only for its own PreviewAny/SaveText
// nodes, so the status node gets a read-only DOM widget here that shows its last output.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const FAST_MS = 500;
const SLOW_MS = 3000;
const STATUS_NODE = "TP2Status";

const panel = { root: null, data: null, busy: false, inFlight: false, timer: null };

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "style") Object.assign(node.style, v);
    else if (k.startsWith("data-")) node.setAttribute(k, v);
    else node[k] = v;
  }
  node.append(...children.filter((c) => c !== null && c !== undefined));
  return node;
}

function progressText(status) {
  const p = status?.progress;
  if (!p || !p.node) return status?.prompt?.prompt_id ? "starting" : "idle";
  const step = `${p.class_type ?? "node " + p.node} ${p.value}/${p.max}`;
  return status.prompt?.prompt_id ? `${step} (running)` : `last prompt: ${step} (${p.state})`;
}

function groupText(status) {
  const g = status?.group;
  if (!g) return "";
  if (g.formed) return `formed, generation ${g.generation} (${g.backend})`;
  return g.generation ? `given up after generation ${g.generation}; re-forms at the next sampler` : "not formed yet (forms at the first sampler)";
}

// the link the group measured as it formed (tp2/link.py), with the speed-up predicted from it
function linkText(status) {
  const l = status?.group?.link;
  return l ? `${l.bus_gbps} GB/s (${l.kind}); ${l.prediction}` : "not measured yet (at the first sampler, as the group forms)";
}

const HEALTH_COLOURS = { healthy: "#2e7d32", starting: "#9a7d0a", waiting: "#9a7d0a", stopping: "#b35900", silent: "#b71c1c", wrong: "#b71c1c", restarting: "#b35900", unreachable: "#b71c1c" };

function line(label, value, className) {
  return el("div", { className, style: { margin: "1px 0" } }, el("span", { style: { opacity: 0.7 } }, `${label}: `), value);
}

function rankCard(r) {
  const s = r.status;
  const p = s?.progress;
  const health = el("span", { title: r.why, style: { color: HEALTH_COLOURS[r.health] ?? "inherit", fontWeight: "bold" } }, r.health);
  const link = r.url ? el("a", { href: r.url, target: "_blank", textContent: r.url.replace(/^https?:\/\//, ""), style: { color: "inherit" } }) : "?";
  return el("div", { className: "tp2-rank", "data-rank": String(r.tp_rank), "data-health": r.health, "data-prompt": p?.prompt_id ?? "",
                     "data-value": String(p?.value ?? ""), "data-max": String(p?.max ?? ""), "data-running": String(!!s?.prompt?.prompt_id),
                     style: { border: "1px solid var(--border-color, #444)", borderRadius: "4px", padding: "4px 6px", margin: "0 0 6px" } },
    el("div", { style: { marginBottom: "2px" } }, el("b", {}, `rank ${r.tp_rank} `), link, " ", health, el("span", { style: { opacity: 0.7 } }, ` (${r.why})`)),
    line("process group", groupText(s), "tp2-group"),
    line("link", linkText(s), "tp2-link"),
    line("progress", s ? progressText(s) : r.why, "tp2-progress"),
    line("last agreement", s?.last_agreement ?? "", "tp2-agreement"));
}

// a rank's setting that differs from this rank's is marked; the numerics check by its verdict only (it names its time)
const comparable = (k, v) => (k === "numerics check" ? String(v).split(" ")[0] : v);

function settingsList(ranks) {
  const mine = ranks.find((r) => r.tp_rank === panel.data.this_rank)?.status?.settings ?? {};
  const list = el("dl", { id: "tp2-settings", style: { margin: 0 } });
  for (const [k, v] of Object.entries(mine)) {
    const others = ranks.filter((r) => r.status?.settings && comparable(k, r.status.settings[k]) !== comparable(k, v))
      .map((r) => `rank ${r.tp_rank}: ${r.status.settings[k]}`);
    list.append(el("dt", { style: { fontWeight: "bold", marginTop: "4px" } }, k),
      el("dd", { style: { margin: "0 0 0 10px", wordBreak: "break-word" } }, String(v),
        others.length ? el("span", { style: { color: "#e08a00" } }, ` (differs: ${others.join("; ")})`) : null));
  }
  return list;
}

function render() {
  const root = panel.root;
  if (!root || !panel.data) return;
  const d = panel.data;
  const summary = el("div", { id: "tp2-summary", style: { fontWeight: "bold", margin: "4px 0 8px" } },
    `${d.healthy} of ${d.tp_size} ranks healthy` + (d.error ? ` (${d.error})` : ""));
  root.replaceChildren(
    el("h3", { style: { margin: "0 0 4px" } }, `Tensor parallel: ${d.tp_size} ranks, split ${d.split}`),
    summary, el("div", { id: "tp2-ranks" }, ...d.ranks.map(rankCard)),
    el("h4", { style: { margin: "12px 0 4px" } }, "Settings (this rank; other ranks' differences marked)"),
    settingsList(d.ranks),
    el("div", { style: { marginTop: "8px", opacity: 0.7, fontSize: "11px" } }, `updated ${new Date().toLocaleTimeString()}`));
}

async function refresh() {
  if (panel.inFlight || !panel.root?.isConnected) return;
  panel.inFlight = true;
  try {
    const response = await api.fetchApi("/tp2/cluster", { cache: "no-store" });
    if (response.ok) {
      panel.data = await response.json();
      panel.busy = panel.data.ranks.some((r) => r.status?.prompt?.prompt_id); // events wake it again (wake())
    } else if (panel.data) {
      panel.data.error = `rank 0 answered ${response.status}`;
    }
  } catch (e) {
    if (panel.data) panel.data.error = `rank 0 did not answer: ${e}`;
  } finally {
    panel.inFlight = false;
  }
  render();
}

function schedule() {
  clearTimeout(panel.timer);
  panel.timer = setTimeout(async () => {
    await refresh();
    schedule();
  }, panel.busy ? FAST_MS : SLOW_MS);
}

function wake() {
  panel.busy = true;
  refresh();
  schedule();
}

function registerPanel() {
  app.extensionManager.registerSidebarTab({
    id: "tp2",
    icon: "pi pi-server",
    title: "TP",
    tooltip: "Tensor parallel: ranks, health, progress, settings (minimax-h3-tp2)",
    type: "custom",
    render: (element) => {
      panel.root = el("div", { id: "tp2-panel", style: { padding: "8px", fontSize: "13px", overflow: "auto", height: "100%" } }, "asking the ranks ...");
      element.replaceChildren(panel.root);
      refresh();
      schedule();
    },
  });
  for (const event of ["execution_start", "progress", "executing"]) api.addEventListener(event, wake);
  api.addEventListener("status", (e) => {
    if (e.detail?.exec_info?.queue_remaining > 0) wake();
  });
}

function addStatusWidget(node) {
  const text = el("pre", { className: "tp2-status-text", style: { margin: 0, padding: "4px", whiteSpace: "pre-wrap", overflow: "auto",
    font: "11px monospace", color: "var(--input-text, #ddd)", background: "var(--comfy-input-bg, #222)", height: "100%", boxSizing: "border-box" } },
  "runs with the prompt: this rank's TP state");
  node.addDOMWidget("tp2_status_text", "tp2_status_text", text, { serialize: false, hideOnZoom: false, getMinHeight: () => 120 });
  node.tp2StatusText = text;
  node.setSize?.([Math.max(node.size?.[0] ?? 0, 420), Math.max(node.size?.[1] ?? 0, 240)]);
}

function showStatus(node, output) {
  const value = output?.text;
  if (node?.tp2StatusText && value !== undefined) node.tp2StatusText.textContent = Array.isArray(value) ? value.join("\n") : String(value);
}

// a node's warning to the user (nodes/lora.py tell_node), sent to this tab as its prompt ends: a toast, kept until
// closed, so a run that "succeeded" without doing what was asked does not pass unseen
function toastWarnings(event) {
  for (const w of event.detail?.warnings ?? []) {
    const node = app.graph?.getNodeById?.(w.node_id) ?? app.graph?.getNodeById?.(Number(w.node_id));
    app.extensionManager?.toast?.add({ severity: "warn", summary: `minimax-h3-tp2: ${node?.title ?? "node " + w.node_id}`, detail: w.text });
  }
}

app.registerExtension({
  name: "minimax-h3-tp2.panel",
  async setup() {
    api.addEventListener("tp2_warnings", toastWarnings);
    let info;
    try {
      const response = await api.fetchApi("/tp2/ranks");
      if (!response.ok) return; // the pack is inactive or the front door is off
      info = await response.json();
    } catch {
      return;
    }
    if (info.this_rank === 0) registerPanel(); // a follower's UI says where rank 0 is instead (tp2_rank_banner.js)
  },
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (nodeData.name !== STATUS_NODE) return;
    const created = nodeType.prototype.onNodeCreated;
    nodeType.prototype.onNodeCreated = function () {
      const r = created?.apply(this, arguments);
      addStatusWidget(this);
      return r;
    };
    const executed = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (output) {
      executed?.apply(this, arguments);
      showStatus(this, output);
    };
  },
});
