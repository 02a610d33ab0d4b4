// minimax-h3-tp2: say in the web UI which tensor-parallel rank this ComfyUI is. A follower shows a banner that
// links rank 0 (the only queue: prompts queued there run on every rank); rank 0 shows a small badge.
import { app } from "../../scripts/app.js";

app.registerExtension({
  name: "minimax-h3-tp2.rank-banner",
  async setup() {
    let info;
    try {
      const response = await fetch("/tp2/ranks");
      if (!response.ok) return; // the pack is inactive or the front door is off
      info = await response.json();
    } catch {
      return;
    }
    const rank = info.this_rank;
    const front = info.ranks?.[0]?.url;
    const box = document.createElement("div");
    box.id = "tp2-rank-banner";
    box.dataset.rank = String(rank);
    if (rank === 0) {
      box.textContent = `tensor parallel: rank 0 of ${info.tp_size} (queue here; every rank runs it)`;
      Object.assign(box.style, { position: "fixed", bottom: "6px", left: "6px", zIndex: 10000, padding: "2px 8px",
        font: "12px sans-serif", background: "rgba(30,90,50,0.85)", color: "#fff", borderRadius: "4px", pointerEvents: "none" });
    } else {
      box.append(`This ComfyUI is tensor-parallel rank ${rank} of ${info.tp_size}, a follower: it runs what rank 0 queues. ` +
        "Queue, cancel and free memory on rank 0: ");
      const link = document.createElement("a");
      link.href = front;
      link.textContent = front;
      link.style.color = "#fff";
      box.append(link);
      Object.assign(box.style, { position: "fixed", top: "0", left: "0", right: "0", zIndex: 10000, padding: "6px 12px",
        font: "14px sans-serif", background: "#8a4b00", color: "#fff", textAlign: "center" });
    }
    document.body.append(box);
  },
});
