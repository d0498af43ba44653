// chatgate demo page: a chat client for the chatgate.v1 protocol (docs/protocol.md)
// with a live view of the dialog state the gateway keeps for each room.
//
// One WebSocket to /ws of the gateway that served this page. Each message we send gets an
// `ack` (route, service, params, rules that fired, enriched text), zero or more `delta`s
// and exactly one terminal frame (`done`, `cancelled` or `error`). After every terminal
// frame we send `context.get` for that message's room; the gateway handles frames of one
// connection in order, so the `context` answer shows the state the reply left behind.
//
// A lost connection (a network change, a laptop waking up) does not lose the reply in
// flight: the page reconnects by itself (with a growing, jittered delay) and sends
// {"type":"resume","id":ID,"after":SEQ}, SEQ being the `seq` of the last delta it showed;
// the gateway answers with the rest of the reply (from right after SEQ), then the terminal
// frame. The page never closes its socket with 1000 (which would stop the reply): when it
// is left, the browser's own close (1001, going away) keeps the reply for a while too.
//
// No framework, no build step, no request anywhere but this gateway. The page never sets
// inline styles (the gateway's Content-Security-Policy forbids them): it toggles classes
// and data-* attributes, which style.css styles. The ids and data-* attributes are also
// what tests/browser/demo.test.js uses.
"use strict";

(function () {
  // ---- small helpers ----------------------------------------------------------------

  const $ = (id) => document.getElementById(id);

  // el("div", {class: "x", "data-id": "m1"}, child, "text", ...)
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "class") node.className = v;
      else if (k === "text") node.textContent = v;
      else node.setAttribute(k, v === true ? "" : String(v));
    }
    for (const c of children) {
      if (c === null || c === undefined || c === false) continue;
      node.appendChild(typeof c === "string" ? document.createTextNode(c) : c);
    }
    return node;
  }

  // sessionStorage, but a page with storage blocked still works (it just forgets on reload).
  const store = {
    get(key) {
      try { return sessionStorage.getItem("chatgate." + key); } catch (e) { return null; }
    },
    set(key, value) {
      try {
        if (value === null || value === undefined) sessionStorage.removeItem("chatgate." + key);
        else sessionStorage.setItem("chatgate." + key, value);
      } catch (e) { /* storage unavailable */ }
    },
  };

  // A param value as text: strings as they are, anything else as JSON.
  function show(value) {
    return typeof value === "string" ? value : JSON.stringify(value);
  }

  function shorten(text, max) {
    text = String(text).replace(/\s+/g, " ").trim();
    return text.length > max ? text.slice(0, max - 1) + "…" : text;
  }

  function formatTime(ts) {
    if (typeof ts !== "number") return "";
    const d = new Date(ts * 1000);
    return d.toLocaleString([], { month: "short", day: "numeric", hour: "2-digit", minute: "2-digit", second: "2-digit" });
  }

  // ---- page elements ----------------------------------------------------------------

  const ui = {
    app: $("app"),
    status: $("status"),
    statusText: $("status-text"),
    roomSelect: $("room"),
    roomForm: $("room-form"),
    roomNew: $("room-new"),
    log: $("log"),
    suggestions: $("suggestions"),
    composer: $("composer"),
    text: $("text"),
    send: $("send"),
    stop: $("stop"),
    ctxToggle: $("ctx-toggle"),
    ctxBadge: $("ctx-badge"),
    ctxRoom: $("ctx-room"),
    ctxClear: $("ctx-clear"),
    ctxService: $("ctx-service"),
    ctxParams: $("ctx-params"),
    ctxAwaiting: $("ctx-awaiting"),
    ctxSoft: $("ctx-soft"),
    ctxProfile: $("ctx-profile"),
    ctxHistory: $("ctx-history"),
    ctxHistoryCount: $("ctx-history-count"),
    ctxMeta: $("ctx-meta"),
  };

  // ---- state ------------------------------------------------------------------------

  const ROOM_RE = /^[^\s]{1,64}$/; // the gateway takes 1 to 256 bytes; keep names short and spaceless

  let ws = null;               // the WebSocket, or null between attempts
  let ready = false;           // true once the gateway's hello arrived
  let retryMs = 500;           // next reconnect delay (doubles up to 10 s, ±20 %)
  let retryTimer = null;
  // message ids: m1, m2, ... (not a delta's seq: that is turn.seq), counted on across a
  // reload: the reply of the page before may still be kept for a resume under its id
  let seq = Number(store.get("seq")) || 0;
  const pending = [];          // ids without a terminal frame yet, in send order (kept across a lost connection)
  const turns = new Map();     // id -> turn (see addTurn)
  const transcripts = new Map(); // room -> element holding that room's turns
  const contexts = new Map();  // room -> last state the gateway sent
  const fromProfile = new Map(); // room -> {name: value} of params the user's profile gave (the last ack)
  let profile = null;            // the user's profile (profile frames), shared by every room
  const restored = new Set();  // rooms whose history was already shown after a reload

  let rooms = [];
  try { rooms = JSON.parse(store.get("rooms") || "[]").filter((r) => typeof r === "string" && ROOM_RE.test(r)); } catch (e) { rooms = []; }
  for (const r of ["default", "trip", "weather", "payments"]) if (!rooms.includes(r)) rooms.push(r);
  let room = store.get("room");
  if (!room || !ROOM_RE.test(room)) room = "default";
  if (!rooms.includes(room)) rooms.push(room);

  // ---- connection -------------------------------------------------------------------

  function setStatus(state, text, title) {
    ui.status.dataset.state = state;
    ui.statusText.textContent = text;
    ui.status.title = title || text;
    document.body.dataset.conn = state;
    const open = state === "open";
    ui.send.disabled = !open;
    ui.ctxClear.disabled = !open;
    updateStop();
  }

  function wsUrl() {
    const params = new URLSearchParams();
    const token = store.get("resume");
    if (token) params.set("resume", token); // keeps our user id (and so our dialogs)
    // With --auth jwt, open the page as /?access_token=JWT and it is passed along.
    const jwt = new URLSearchParams(location.search).get("access_token");
    if (jwt) params.set("access_token", jwt);
    const q = params.toString();
    return (location.protocol === "https:" ? "wss://" : "ws://") + location.host + "/ws" + (q ? "?" + q : "");
  }

  function connect() {
    clearTimeout(retryTimer);
    retryTimer = null;
    if (ws) return;
    setStatus("connecting", "connecting…");
    let sock;
    try {
      sock = new WebSocket(wsUrl(), "chatgate.v1");
    } catch (e) {
      scheduleReconnect("could not connect");
      return;
    }
    ws = sock;
    sock.onmessage = (ev) => {
      let frame;
      try { frame = JSON.parse(ev.data); } catch (e) { console.warn("chatgate: not JSON", ev.data); return; }
      if (frame && typeof frame === "object") onFrame(frame);
    };
    sock.onclose = (ev) => {
      if (ws !== sock) return;
      ws = null;
      ready = false;
      if (ev.code === 1008) {
        // Refused credentials: start afresh, as a new user; what was in flight is lost.
        store.set("resume", null);
        for (const id of pending.splice(0)) endTurn(id, "lost", "connection lost");
      } else {
        // The gateway keeps the reply in flight for a while (resume.grace_ms): each reply
        // without its terminal frame waits for the next connection, which resumes it.
        for (const id of pending) waitResume(turns.get(id));
      }
      scheduleReconnect(ev.code === 1008 ? "refused (" + (ev.reason || "unauthorized") + ")" : "disconnected");
    };
  }

  // ---- resuming replies after a lost connection -------------------------------------

  // The connection went mid-reply: the turn waits for the next one.
  function waitResume(turn) {
    if (!turn || turn.ended) return;
    turn.resume = true;       // to resume on the next connection
    turn.resumeSent = false;  // a resume went out on this connection, nothing came back yet
    turn.reply.dataset.state = "resuming";
    turn.replyStatus.textContent = "connection lost; resuming…";
  }

  // After the hello of a new connection: ask for the rest of each reply that was cut, in
  // the order they were sent. The gateway kept the one in flight; the ones queued behind
  // it went with the connection (they get not_found and are marked interrupted). A Stop
  // pressed before the drop may not have arrived: it is sent again (if it had, the resume
  // gets the `cancelled`, and the second cancel's not_found is ignored).
  function resumeReplies() {
    for (const id of pending.slice()) {
      const turn = turns.get(id);
      if (!turn || turn.ended || !turn.resume) continue;
      turn.resume = false;
      turn.resumeSent = true;
      turn.resumes = (turn.resumes || 0) + 1;
      turn.replyStatus.textContent = turn.cancelSent ? "stopping…" : "reconnected; resuming…";
      sendFrame({ type: "resume", id, after: turn.seq });
      if (turn.cancelSent) sendFrame({ type: "cancel", id });
    }
  }

  // UTF-8 bytes: a delta's seq counts the reply's bytes, not its characters.
  const utf8 = { enc: new TextEncoder(), dec: new TextDecoder() };

  function scheduleReconnect(why) {
    const delay = Math.round(retryMs * (0.8 + Math.random() * 0.4));
    retryMs = Math.min(retryMs * 2, 10000);
    setStatus("closed", why + "; retrying in " + Math.max(1, Math.round(delay / 1000)) + " s", "click to retry now");
    retryTimer = setTimeout(connect, delay);
  }

  function sendFrame(frame) {
    if (!ws || !ready || ws.readyState !== WebSocket.OPEN) return false;
    ws.send(JSON.stringify(frame));
    return true;
  }

  // ---- frames from the gateway ------------------------------------------------------

  function onFrame(f) {
    const turn = typeof f.id === "string" ? turns.get(f.id) : undefined;
    switch (f.type) {
      case "hello": onHello(f); break;
      case "ack": if (turn) onAck(turn, f); break;
      case "delta": if (turn) onDelta(turn, f); break;
      case "done":
        if (!turn) break;
        // A truncated done holds only the first max_reply_bytes: keep what streamed.
        if (typeof f.text === "string" && !f.truncated) setReplyText(turn, f.text);
        showReplyRules(turn, f.reply_rules);
        endTurn(f.id, "done", f.truncated ? "truncated" : "");
        break;
      case "cancelled": if (turn) endTurn(f.id, "stopped", "stopped"); break;
      case "error": onError(turn, f); break;
      case "warning":
        if (turn) addNote(turn, "warning", f.code + ": " + (f.message || ""));
        else systemNote(room, "warning", (f.code || "warning") + ": " + (f.message || ""));
        if (f.code === "store_degraded") ui.status.title = "store degraded: " + (f.message || "");
        break;
      case "context": onContext(f); break;
      case "profile": onProfile(f); break;
      default: console.info("chatgate: unhandled frame", f);
    }
  }

  function onHello(f) {
    const before = store.get("user");
    ready = true;
    retryMs = 500;
    if (f.resume) store.set("resume", f.resume);
    if (f.user) store.set("user", f.user);
    if (before && f.user && before !== f.user) {
      systemNote(room, "info", "The gateway did not take the saved session (it may have restarted): " +
        "you are a new user, " + f.user + ", with empty rooms.");
      contexts.clear();
    }
    setStatus("open", "connected", "user " + f.user + ", session " + f.session + ", protocol " + f.protocol);
    ui.status.dataset.user = f.user || "";
    resumeReplies();
    requestContext(room);
  }

  // What rules on replies did to a reply (done's or a blocked error's reply_rules): a chip
  // per rule under the reply, "mask ×2", "stop", "tag refund".
  function showReplyRules(turn, acted) {
    if (!turn || !Array.isArray(acted) || !acted.length) return;
    const box = el("div", { class: "reply-rules", "data-reply-rules": String(acted.length) },
      el("span", { class: "ack-label", text: "reply rules" }));
    for (const a of acted) {
      const what = a.action === "tag" ? "tag " + a.tag : a.action + (a.count > 1 ? " \u00d7" + a.count : "");
      box.appendChild(el("span", { class: "rule reply-rule", "data-rule": a.rule, "data-action": a.action,
        text: a.rule + ": " + what }));
    }
    turn.node.appendChild(box);
  }

  function onError(turn, f) {
    const text = (f.code || "error") + (f.message ? ": " + f.message : "");
    showReplyRules(turn, f.reply_rules);
    if (turn && !turn.ended && turn.resumeSent && f.code === "not_found") {
      // The gateway no longer has the reply we asked to resume (it ended or was stopped
      // more than resume.grace_ms ago, the gateway restarted, or it was only queued).
      if (turn.cancelSent) endTurn(f.id, "stopped", "stopped");
      else endTurn(f.id, "interrupted", "interrupted: the connection was lost and the gateway no longer has the rest of this reply");
    } else if (turn && !turn.ended) {
      endTurn(f.id, "error", text);
    } else if (turn && f.code === "not_found") {
      // The answer to a Stop that arrived just after the reply finished: nothing to show.
    } else {
      systemNote(room, "error", text);
    }
  }

  // ---- turns (one user message and its reply) -------------------------------------

  function transcript(r) {
    let t = transcripts.get(r);
    if (!t) {
      t = el("div", { class: "transcript", "data-room": r });
      t.appendChild(el("p", { class: "transcript-empty", text: "Room “" + r + "”: nothing said here yet. " +
        "Each room is its own dialog with the gateway." }));
      transcripts.set(r, t);
      ui.log.appendChild(t);
    }
    return t;
  }

  // Follow the conversation while the reader is at the bottom; leave them alone when they
  // scrolled up to read. `pinned` is kept across resizes (phone rotation, keyboard).
  let pinned = true;
  function nearBottom() {
    return pinned;
  }
  ui.log.addEventListener("scroll", () => {
    pinned = ui.log.scrollHeight - ui.log.scrollTop - ui.log.clientHeight < 80;
  }, { passive: true });
  if (window.ResizeObserver) {
    new ResizeObserver(() => { if (pinned) ui.log.scrollTop = ui.log.scrollHeight; }).observe(ui.log);
  }

  function append(r, node) {
    const stick = nearBottom();
    const t = transcript(r);
    t.classList.add("has-turns");
    t.appendChild(node);
    if (stick && r === room) ui.log.scrollTop = ui.log.scrollHeight;
  }

  function addTurn(id, r, text) {
    const userText = el("div", { class: "msg-text", text });
    const ack = el("div", { class: "ack", "data-ack": "pending" }, el("span", { class: "ack-wait", text: "waiting for the gateway…" }));
    const replyText = el("div", { class: "msg-text" });
    const replyStatus = el("div", { class: "msg-status" });
    const reply = el("div", { class: "msg msg-assistant", "data-role": "assistant", "data-state": "queued" }, replyText, replyStatus);
    const node = el("article", { class: "turn", "data-id": id, "data-room": r },
      el("div", { class: "msg msg-user", "data-role": "user" }, userText),
      ack,
      reply);
    // seq: the bytes of the reply shown so far (the last delta's seq); what a resume asks after
    const turn = { id, room: r, node, ack, reply, replyText, replyStatus, text: "", seq: 0, ended: false };
    turns.set(id, turn);
    append(r, node);
    return turn;
  }

  function onAck(turn, f) {
    // params the user's profile gave (ack.from_profile): shown in the panel beside the kept ones
    const given = {};
    for (const name of Array.isArray(f.from_profile) ? f.from_profile : []) {
      if (f.params && f.params[name] !== undefined) given[name] = f.params[name];
    }
    fromProfile.set(f.room || room, { service: f.service || "", params: given });
    const a = turn.ack;
    a.textContent = "";
    a.dataset.ack = "ok";
    a.dataset.route = f.route || "";
    const item = (label, value, cls) =>
      el("span", { class: "ack-item " + (cls || "") }, el("span", { class: "ack-label", text: label }), value);
    a.appendChild(item("route", el("code", { class: "ack-route", text: f.route || "?" })));
    if (f.service) a.appendChild(item("service", el("code", { class: "ack-service", text: f.service })));
    const rules = el("span", { class: "ack-rules" });
    if (Array.isArray(f.rules) && f.rules.length) {
      for (const r of f.rules) rules.appendChild(el("span", { class: "rule", "data-rule": r, text: r }));
    } else {
      rules.appendChild(el("span", { class: "none", text: "none fired" }));
    }
    a.appendChild(item("rules", rules));
    if (f.resolution) {
      const r = f.resolution;
      let desc = r.type;
      if (r.type === "selection") desc += " #" + r.index + (r.option ? " " + shorten(optionLabel(r.option), 40) : "");
      else if (r.type === "confirmation") desc += r.confirmed ? " yes" : " no";
      else if (r.type === "metadata") desc += " " + r.metadata_type + ": " + r.content;
      else if (r.type === "input") desc += ": " + r.content;
      a.appendChild(item("resolution", el("span", { class: "ack-resolution", text: desc })));
    }
    if (f.enriched) {
      a.appendChild(item("enriched", el("q", { class: "ack-enriched", text: f.enriched }), "ack-wide"));
    }
  }

  // A delta's text ends at byte f.seq of the reply. After a resume the first delta starts
  // right after the seq we sent; should a delta ever overlap what is shown, only its new
  // bytes are added, so that no text shows twice.
  function onDelta(turn, f) {
    let text = f.text;
    if (turn.ended || typeof text !== "string") return;
    if (typeof f.seq === "number") {
      if (f.seq <= turn.seq) return; // shown already
      const bytes = utf8.enc.encode(text);
      const start = f.seq - bytes.length;
      if (start < turn.seq) text = utf8.dec.decode(bytes.subarray(turn.seq - start));
      turn.seq = f.seq;
    } else {
      turn.seq += utf8.enc.encode(text).length; // a gateway without seq: count the bytes ourselves
    }
    const state = turn.reply.dataset.state;
    if (state === "queued" || state === "resuming") turn.reply.dataset.state = "streaming";
    if (turn.resumeSent) {
      turn.resumeSent = false; // the gateway had it: the rest streams
      if (!turn.cancelSent) turn.replyStatus.textContent = "";
    }
    setReplyText(turn, turn.text + text);
  }

  function setReplyText(turn, text) {
    const stick = nearBottom();
    turn.text = text;
    turn.replyText.textContent = text;
    if (stick && turn.room === room) ui.log.scrollTop = ui.log.scrollHeight;
  }

  // state: done | stopped | error | lost | interrupted
  function endTurn(id, state, note) {
    const turn = turns.get(id);
    const i = pending.indexOf(id);
    if (i >= 0) pending.splice(i, 1);
    if (turn && !turn.ended) {
      turn.ended = true;
      turn.reply.dataset.state = state;
      if (turn.resumes) turn.reply.dataset.resumed = String(turn.resumes);
      if (!note && state === "done" && turn.resumes) note = "resumed after a lost connection";
      turn.replyStatus.textContent = note || "";
      if (turn.ack.dataset.ack === "pending") turn.ack.textContent = "";
      if (state !== "lost") requestContext(turn.room); // the panel follows every turn
    }
    updateStop();
  }

  function addNote(turn, kind, text) {
    turn.node.insertBefore(el("div", { class: "note note-" + kind, text }), turn.reply);
  }

  function systemNote(r, kind, text) {
    append(r, el("div", { class: "note note-" + kind, role: kind === "error" ? "alert" : null, text }));
  }

  // ---- sending ----------------------------------------------------------------------

  function sendMessage(text, r) {
    text = text.trim();
    if (!text) return false;
    const id = "m" + ++seq;
    store.set("seq", String(seq));
    if (!sendFrame({ type: "message", id, room: r, text })) {
      flashStatus();
      return false;
    }
    addTurn(id, r, text);
    pending.push(id);
    updateStop();
    return true;
  }

  // Stop cancels the oldest reply without a terminal frame: the gateway answers one
  // message of a connection at a time, in order, so that is the one streaming.
  function stopCurrent() {
    const id = pending[0];
    if (!id) return;
    const turn = turns.get(id);
    if (turn && !turn.cancelSent) {
      turn.cancelSent = true;
      turn.replyStatus.textContent = "stopping…";
      sendFrame({ type: "cancel", id });
    }
  }

  function updateStop() {
    const id = pending[0];
    ui.stop.disabled = !id || !ready;
    ui.stop.dataset.target = id || "";
  }

  function requestContext(r) {
    sendFrame({ type: "context.get", room: r });
    sendFrame({ type: "profile.get" });
  }

  function flashStatus() {
    ui.status.classList.remove("flash");
    void ui.status.offsetWidth; // restart the animation
    ui.status.classList.add("flash");
  }

  // ---- rooms ------------------------------------------------------------------------

  const NEW_ROOM = "+ new"; // the select's last option (no room name has a space): opens the new-room form

  function renderRooms() {
    ui.roomSelect.textContent = "";
    for (const r of rooms) ui.roomSelect.appendChild(el("option", { value: r, text: r, selected: r === room }));
    ui.roomSelect.appendChild(el("option", { value: NEW_ROOM, text: "+ new room…" }));
    ui.roomSelect.value = room;
  }

  function showRoomForm(open) {
    ui.app.classList.toggle("adding-room", open);
    if (open) ui.roomNew.focus();
  }

  function switchRoom(r) {
    if (!ROOM_RE.test(r)) return;
    if (!rooms.includes(r)) {
      rooms.push(r);
      store.set("rooms", JSON.stringify(rooms));
    }
    room = r;
    store.set("room", r);
    renderRooms();
    for (const [name, t] of transcripts) t.hidden = name !== r;
    transcript(r).hidden = false;
    ui.log.scrollTop = ui.log.scrollHeight;
    ui.ctxRoom.textContent = r;
    document.title = "chatgate demo · " + r;
    renderContext(contexts.get(r) || null, true);
    requestContext(r);
  }

  // ---- the context panel ------------------------------------------------------------

  function onContext(f) {
    if (typeof f.room !== "string" || !f.state) return;
    contexts.set(f.room, f.state);
    // After a reload (resume keeps the user), show the room's remembered history once.
    if (!restored.has(f.room)) {
      restored.add(f.room);
      const t = transcript(f.room);
      if (!t.classList.contains("has-turns") && Array.isArray(f.state.history) && f.state.history.length) {
        append(f.room, el("div", { class: "note note-info", text: "Earlier in this room (the gateway's history):" }));
        for (const m of f.state.history) {
          append(f.room, el("div", { class: "msg msg-" + (m.role === "user" ? "user" : "assistant") + " msg-restored",
            "data-role": m.role, "data-state": m.cancelled ? "stopped" : "done" },
          el("div", { class: "msg-text", text: String(m.content) }),
          el("div", { class: "msg-status", text: m.cancelled ? "stopped" : "" })));
        }
      }
    }
    if (f.room === room) renderContext(f.state, false);
  }

  function onProfile(f) {
    profile = f.profile && typeof f.profile === "object" ? f.profile : {};
    renderProfile();
  }

  // The user's profile: each attribute with a forget button (profile.forget).
  function renderProfile() {
    const names = profile ? Object.keys(profile) : [];
    section(ui.ctxProfile, names.length ? null : "none");
    for (const name of names) {
      ui.ctxProfile.appendChild(el("div", { class: "param", "data-profile": name },
        el("span", { class: "param-name", text: name }),
        el("span", { class: "param-value", "data-value": show(profile[name]), text: show(profile[name]) }),
        el("button", { type: "button", class: "btn-forget", "data-profile-forget": name, title: "Forget " + name,
          "aria-label": "Forget " + name, text: "×" })));
    }
  }

  function section(node, emptyText) {
    node.textContent = "";
    if (emptyText) node.appendChild(el("p", { class: "empty", text: emptyText }));
  }

  function kvList(obj, cls) {
    const dl = el("dl", { class: cls });
    for (const [k, v] of Object.entries(obj)) {
      dl.appendChild(el("dt", { text: k }));
      dl.appendChild(el("dd", { text: show(v) }));
    }
    return dl;
  }

  // An option of an awaited selection, as a short label: its name-like field, then the
  // other short string fields ("Shake Shack · Shibuya").
  function optionLabel(opt) {
    if (opt === null || typeof opt !== "object") return show(opt);
    const first = ["name", "title", "label", "text", "id"].find((k) => typeof opt[k] === "string" || typeof opt[k] === "number");
    const parts = first ? [String(opt[first])] : [];
    for (const [k, v] of Object.entries(opt)) {
      if (k !== first && (typeof v === "string" || typeof v === "number") && String(v).length <= 40) parts.push(String(v));
      if (parts.length >= 3) break;
    }
    return parts.length ? parts.join(" · ") : JSON.stringify(opt);
  }

  function renderContext(st, loading) {
    const s = st || {};
    $("context").dataset.state = st ? "ok" : loading ? "loading" : "empty";
    $("context").dataset.room = room;

    // Active service
    ui.ctxService.textContent = s.service || (st ? "none" : "…");
    ui.ctxService.dataset.service = s.service || "";
    ui.ctxService.classList.toggle("is-none", !s.service);

    // Params, per service, the active service first; each with a forget button.
    const params = s.params && typeof s.params === "object" ? s.params : {};
    const services = Object.keys(params).filter((k) => params[k] && Object.keys(params[k]).length);
    services.sort((a, b) => (a === s.service ? -1 : b === s.service ? 1 : a.localeCompare(b)));
    let count = 0;
    const given = fromProfile.get(room) || { service: "", params: {} };
    if (given.service && Object.keys(given.params).length && !services.includes(given.service)) services.unshift(given.service);
    section(ui.ctxParams, services.length ? null : "none");
    for (const svc of services) {
      const group = el("div", { class: "param-group" + (svc === s.service ? " active" : ""), "data-service": svc },
        el("div", { class: "param-service", text: svc + (svc === s.service ? " (active)" : "") }));
      for (const [name, value] of Object.entries(params[svc] || {})) {
        const key = svc + "." + name;
        count++;
        group.appendChild(el("div", { class: "param", "data-param": key },
          el("span", { class: "param-name", text: name }),
          el("span", { class: "param-value", "data-value": show(value), text: show(value) }),
          el("button", { type: "button", class: "btn-forget", "data-forget": key, title: "Forget " + key,
            "aria-label": "Forget " + key, text: "×" })));
      }
      // what the profile gave this service's last message (not kept in the room: forget it
      // in the profile)
      for (const [name, value] of svc === given.service ? Object.entries(given.params) : []) {
        if (params[svc] && params[svc][name] !== undefined) continue;
        group.appendChild(el("div", { class: "param from-profile", "data-param": svc + "." + name, "data-from": "profile",
          title: "from your profile" },
          el("span", { class: "param-name", text: name }),
          el("span", { class: "param-value", "data-value": show(value), text: show(value) }),
          el("span", { class: "param-source", text: "profile" })));
      }
      ui.ctxParams.appendChild(group);
    }
    ui.ctxBadge.textContent = String(count);
    ui.ctxBadge.dataset.count = String(count);

    // Awaiting: what the gateway waits for; a selection's options are clickable.
    const aw = s.awaiting;
    ui.ctxAwaiting.dataset.type = aw && aw.type ? aw.type : "";
    section(ui.ctxAwaiting, aw ? null : "nothing");
    if (aw) {
      ui.ctxAwaiting.appendChild(el("p", { class: "await-head" },
        el("span", { class: "await-type", text: aw.type || "?" }),
        aw.source ? " from " : null, aw.source ? el("code", { text: aw.source }) : null));
      if (Array.isArray(aw.options) && aw.options.length) {
        const list = el("ol", { class: "await-options" });
        aw.options.forEach((opt, i) => {
          list.appendChild(el("li", {}, el("button", { type: "button", class: "option", "data-option": i + 1,
            title: "Sends “" + (i + 1) + "”", text: optionLabel(opt) })));
        });
        ui.ctxAwaiting.appendChild(list);
      } else if (aw.type === "confirmation") {
        ui.ctxAwaiting.appendChild(el("p", { class: "await-options" },
          el("button", { type: "button", class: "option", "data-reply": "yes", text: "Yes" }), " ",
          el("button", { type: "button", class: "option", "data-reply": "no", text: "No" })));
      } else {
        ui.ctxAwaiting.appendChild(el("p", { class: "hint", text: "Answer in the message box." }));
      }
      if (aw.context !== undefined && aw.context !== null) {
        ui.ctxAwaiting.appendChild(kvList(typeof aw.context === "object" ? aw.context : { context: aw.context }, "kv"));
      }
    }

    // Soft context
    const soft = s.soft_context;
    section(ui.ctxSoft, soft ? null : "none");
    if (soft) ui.ctxSoft.appendChild(kvList(typeof soft === "object" ? soft : { value: soft }, "kv"));

    // History, compact: one line each, the whole text on hover.
    const hist = Array.isArray(s.history) ? s.history : [];
    ui.ctxHistory.textContent = "";
    ui.ctxHistoryCount.textContent = hist.length ? "(" + hist.length + ")" : "";
    if (!hist.length) ui.ctxHistory.appendChild(el("li", { class: "empty", text: "empty" }));
    for (const m of hist) {
      ui.ctxHistory.appendChild(el("li", { "data-role": m.role, title: String(m.content) },
        el("span", { class: "h-role", text: m.role === "user" ? "you" : m.role === "assistant" ? "bot" : String(m.role) }),
        el("span", { class: "h-text", text: shorten(m.content, 90) }),
        m.cancelled ? el("span", { class: "h-flag", text: "(stopped)" }) : null));
    }

    // Dialog meta and the last tool result
    ui.ctxMeta.textContent = "";
    const meta = s.meta || {};
    const rows = [
      ["turns", meta.turn_count], ["messages", meta.message_count],
      ["started", formatTime(meta.created_at)], ["last activity", formatTime(meta.last_activity)],
    ];
    for (const [k, v] of rows) {
      if (v === undefined || v === "" || v === null) continue;
      ui.ctxMeta.appendChild(el("dt", { text: k }));
      ui.ctxMeta.appendChild(el("dd", { text: String(v) }));
    }
    if (s.last_tool_result !== undefined && s.last_tool_result !== null) {
      ui.ctxMeta.appendChild(el("dt", { text: "last tool result" }));
      ui.ctxMeta.appendChild(el("dd", {}, el("code", { class: "json", text: shorten(JSON.stringify(s.last_tool_result), 300) })));
    }
  }

  // ---- events -----------------------------------------------------------------------

  ui.composer.addEventListener("submit", (e) => {
    e.preventDefault();
    if (sendMessage(ui.text.value, room)) ui.text.value = "";
  });

  ui.text.addEventListener("keydown", (e) => {
    if (e.key === "Escape") { e.preventDefault(); stopCurrent(); }
  });

  ui.stop.addEventListener("click", stopCurrent);

  ui.roomSelect.addEventListener("change", () => {
    if (ui.roomSelect.value === NEW_ROOM) {
      ui.roomSelect.value = room;
      showRoomForm(true);
    } else {
      switchRoom(ui.roomSelect.value);
    }
  });

  ui.roomForm.addEventListener("submit", (e) => {
    e.preventDefault();
    const r = ui.roomNew.value.trim();
    if (!ROOM_RE.test(r)) { ui.roomNew.setCustomValidity("1 to 64 characters, no spaces"); ui.roomNew.reportValidity(); return; }
    ui.roomNew.setCustomValidity("");
    ui.roomNew.value = "";
    showRoomForm(false);
    switchRoom(r);
  });
  ui.roomNew.addEventListener("input", () => ui.roomNew.setCustomValidity(""));
  $("room-cancel").addEventListener("click", () => { ui.roomNew.value = ""; showRoomForm(false); });
  ui.roomNew.addEventListener("keydown", (e) => {
    if (e.key === "Escape") { ui.roomNew.value = ""; showRoomForm(false); }
  });

  ui.ctxClear.addEventListener("click", () => {
    if (sendFrame({ type: "context.clear", room })) systemNote(room, "info", "Context of room “" + room + "” cleared.");
    else flashStatus();
  });

  // Forget buttons and awaiting options are re-rendered with each context frame, so
  // their clicks are handled here, on the panel.
  $("context").addEventListener("click", (e) => {
    const btn = e.target.closest("button");
    if (!btn) return;
    if (btn.dataset.profileForget) {
      if (!sendFrame({ type: "profile.forget", keys: [btn.dataset.profileForget] })) flashStatus();
    } else if (btn.dataset.forget) {
      if (!sendFrame({ type: "context.forget", room, keys: [btn.dataset.forget] })) flashStatus();
    } else if (btn.dataset.option) {
      sendMessage(String(btn.dataset.option), room); // the gateway resolves "2" to the 2nd option
    } else if (btn.dataset.reply) {
      sendMessage(btn.dataset.reply, room);
    }
  });

  ui.suggestions.addEventListener("click", (e) => {
    const chip = e.target.closest("[data-suggest]");
    if (!chip) return;
    ui.text.value = chip.dataset.suggest;
    ui.text.focus();
  });

  // Narrow screens: the context panel is toggled instead of shown beside the chat.
  ui.ctxToggle.addEventListener("click", () => {
    const open = !ui.app.classList.contains("show-context");
    ui.app.classList.toggle("show-context", open);
    ui.ctxToggle.setAttribute("aria-expanded", String(open));
  });

  ui.status.addEventListener("click", () => { if (!ws) connect(); });
  window.addEventListener("online", () => { if (!ws) { retryMs = 500; connect(); } });
  // No pagehide/beforeunload handler on purpose: closing with 1000 there would stop the
  // reply in flight; the browser's own close when the page goes keeps it for a resume.

  // ---- start ------------------------------------------------------------------------

  store.set("rooms", JSON.stringify(rooms));
  renderRooms();
  switchRoom(room);
  connect();
})();
