// chatgate demo page: speaks chatgate.v1 to the gateway that served it.
// One WebSocket to /ws; each message gets an ack, deltas and one terminal frame
// (done, cancelled or error). Reconnects with a growing delay when the connection drops.
"use strict";

const log = document.getElementById("log");
const statusEl = document.getElementById("status");
const form = document.getElementById("send");
const input = document.getElementById("text");
const stopBtn = document.getElementById("stop");
const roomInput = document.getElementById("room");

let ws = null;
let retry = 500;
let seq = 0;
let current = null; // id of the reply streaming now
const bubbles = new Map(); // id -> {el, meta}

function add(cls, text) {
  const el = document.createElement("div");
  el.className = "turn " + cls;
  el.textContent = text;
  log.appendChild(el);
  log.scrollTop = log.scrollHeight;
  return el;
}

function meta(el, text) {
  const m = document.createElement("div");
  m.className = "meta";
  m.textContent = text;
  el.after(m);
}

function setStatus(text, up) {
  statusEl.textContent = text;
  statusEl.classList.toggle("up", up);
}

function connect() {
  const url = (location.protocol === "https:" ? "wss://" : "ws://") + location.host + "/ws";
  ws = new WebSocket(url, "chatgate.v1");
  ws.onopen = () => { retry = 500; setStatus("connected", true); };
  ws.onclose = () => {
    setStatus("disconnected; retrying…", false);
    current = null;
    stopBtn.disabled = true;
    setTimeout(connect, retry);
    retry = Math.min(retry * 2, 10000);
  };
  ws.onmessage = (ev) => onFrame(JSON.parse(ev.data));
}

function onFrame(f) {
  const b = f.id ? bubbles.get(f.id) : null;
  switch (f.type) {
    case "hello":
      setStatus("connected as " + f.user, true);
      break;
    case "ack":
      if (b) meta(b.user, "route: " + f.route);
      break;
    case "delta":
      if (b) b.el.textContent += f.text;
      break;
    case "done":
      if (b) b.el.textContent = f.text;
      finish(f.id);
      break;
    case "cancelled":
      if (b) b.el.textContent += " [stopped]";
      finish(f.id);
      break;
    case "error":
      if (b) {
        b.el.classList.add("error");
        b.el.textContent = f.code + ": " + f.message;
        finish(f.id);
      } else {
        add("bot error", f.code + ": " + f.message);
      }
      break;
  }
}

function finish(id) {
  bubbles.delete(id);
  if (current === id) {
    current = null;
    stopBtn.disabled = true;
  }
  const next = bubbles.keys().next();
  if (!next.done) {
    current = next.value;
    stopBtn.disabled = false;
  }
}

form.addEventListener("submit", (e) => {
  e.preventDefault();
  const text = input.value.trim();
  if (!text || !ws || ws.readyState !== WebSocket.OPEN) return;
  const id = "w" + (++seq);
  const user = add("user", text);
  bubbles.set(id, { user, el: add("bot", "") });
  ws.send(JSON.stringify({ type: "message", id, room: roomInput.value || "default", text }));
  if (!current) current = id;
  stopBtn.disabled = false;
  input.value = "";
});

stopBtn.addEventListener("click", () => {
  if (current && ws) ws.send(JSON.stringify({ type: "cancel", id: current }));
});

connect();
