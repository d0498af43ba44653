#!/usr/bin/env node
// origin_app.js: a small chat app someone else could have written, for origin.test.js
// (issue 13 item 6: "a browser page served by an app that checks the Origin").
//
// Modelled on Tornado's chat demo, on npm `ws` (nothing of chatgate in it):
// - GET / serves one HTML page. Its script opens `new WebSocket(URL)`, URL from the page's
//   own query string `?ws=...`, else the app's own ws://<the page's host>/chat. That URL is
//   the one change a user makes to put chatgate in front.
// - The WebSocket server on /chat checks the Origin exactly as Tornado's
//   WebSocketHandler.check_origin does: the Origin's host[:port] (lower-cased) must equal the
//   request's Host header, else HTTP 403 "Cross origin websockets not allowed". A request
//   without Origin (not a browser) passes, as in Tornado.
// - Protocol (JSON text frames, no type field, like Tornado's chat demo):
//     client -> app  {"body": "...", "_xsrf": "..."}   a chat message (_xsrf: the page's token)
//     app -> client  {"body": "part 1/3 of the reply to: ..."}, parts streamed 100 ms apart:
//                    3 of them, 30 when the message contains "long"; no id, no end marker
//     anything else (e.g. {"typing": true, "n": 4}) is echoed back at once, as it is.
// - Every event is printed on stdout as one JSON line, for the test to read:
//     {"event":"listening","port":P}
//     {"event":"open","conn":N,"path":...,"origin":...,"host":...,"headers":{...},"t":ms}
//     {"event":"refused","status":403,"path":...,"origin":...,"host":...,"t":ms}
//     {"event":"frame","conn":N,"frame":<the parsed frame, or {"raw":text}>,"t":ms}
//     {"event":"sent","conn":N,"frame":{...},"t":ms}
//     {"event":"reply_done","conn":N,"to":"...","parts":K,"t":ms}
//     {"event":"close","conn":N,"code":C,"t":ms}
//
// Usage: node origin_app.js [--port N] [--host ADDR]   (port 0, the default: any free port)
"use strict";

const crypto = require("crypto");
const http = require("http");
const { WebSocketServer } = require("ws");

const args = process.argv.slice(2);
const opt = (name, dflt) => {
  const i = args.indexOf(name);
  return i >= 0 && i + 1 < args.length ? args[i + 1] : dflt;
};
const PORT = Number(opt("--port", "0"));
const HOST = opt("--host", "127.0.0.1");
const PART_MS = Number(opt("--part-ms", "100"));

const emit = (obj) => process.stdout.write(JSON.stringify({ ...obj, t: Date.now() }) + "\n");

const xsrfTokens = new Set();

// The page: kept as a plain chat page would be; it knows nothing of chatgate.
function page(xsrf) {
  return `<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>Chat</title>
<style>
  body { font: 15px/1.4 sans-serif; margin: 2em; max-width: 40em; }
  #log { list-style: none; padding: 0; min-height: 10em; border: 1px solid #ccc; }
  #log li { padding: .2em .5em; border-bottom: 1px solid #eee; }
  #typing { color: #888; font-size: 12px; height: 1.2em; }
</style>
</head>
<body>
<h1>Chat</h1>
<p id="status" data-state="connecting">connecting…</p>
<ul id="log"></ul>
<div id="typing"></div>
<form id="form">
  <input id="text" autocomplete="off" size="50">
  <input type="hidden" name="_xsrf" id="xsrf" value="${xsrf}">
  <button id="send" type="submit">Send</button>
</form>
<script>
(function () {
  var params = new URLSearchParams(location.search);
  var url = params.get("ws") || ("ws://" + location.host + "/chat");
  var status = document.getElementById("status");
  var log = document.getElementById("log");
  var text = document.getElementById("text");
  var typing = document.getElementById("typing");
  var xsrf = document.getElementById("xsrf").value;
  var typingNow = false, typingCount = 0;
  var socket = new WebSocket(url);

  function setState(state, note) {
    status.dataset.state = state;
    status.textContent = state + (note ? " (" + note + ")" : "");
  }
  function setTyping(on) {
    if (on === typingNow || socket.readyState !== 1) return;
    typingNow = on;
    socket.send(JSON.stringify({ typing: on, n: ++typingCount }));
  }
  socket.onopen = function () { setState("open"); };
  socket.onerror = function () { status.dataset.error = "1"; };
  socket.onclose = function (ev) {
    status.dataset.code = String(ev.code);
    setState("closed", "code " + ev.code);
  };
  socket.onmessage = function (ev) {
    var msg;
    try { msg = JSON.parse(ev.data); } catch (e) { return; }
    if (typeof msg.body === "string") {
      var li = document.createElement("li");
      li.className = "msg";
      li.textContent = msg.body;
      log.appendChild(li);
    } else if ("typing" in msg) {
      typing.textContent = msg.typing ? "someone is typing…" : "";
    }
  };
  text.addEventListener("input", function () { setTyping(text.value !== ""); });
  document.getElementById("form").addEventListener("submit", function (ev) {
    ev.preventDefault();
    if (!text.value || socket.readyState !== 1) return;
    socket.send(JSON.stringify({ body: text.value, _xsrf: xsrf }));
    var li = document.createElement("li");
    li.className = "mine";
    li.textContent = text.value;
    log.appendChild(li);
    text.value = "";
    setTyping(false);
  });
})();
</script>
</body>
</html>
`;
}

const server = http.createServer((req, res) => {
  const url = new URL(req.url, "http://x");
  if (req.method === "GET" && url.pathname === "/") {
    const xsrf = crypto.randomBytes(12).toString("hex");
    xsrfTokens.add(xsrf);
    res.writeHead(200, { "Content-Type": "text/html; charset=utf-8", "Cache-Control": "no-store" });
    res.end(page(xsrf));
    return;
  }
  if (url.pathname === "/favicon.ico") {
    res.writeHead(204);
    res.end();
    return;
  }
  res.writeHead(404, { "Content-Type": "text/plain" });
  res.end("not found\n");
});

// Tornado, websocket.py: check_origin(origin): parsed_origin = urlparse(origin);
// origin = parsed_origin.netloc.lower(); host = self.request.headers.get("Host");
// return origin == host. (urlparse("null").netloc is "": a "null" Origin is refused.)
function checkOrigin(origin, host) {
  const m = /^[A-Za-z][A-Za-z0-9+.-]*:\/\/([^/?#]*)/.exec(origin);
  const netloc = (m ? m[1] : "").toLowerCase();
  return netloc === host;
}

const wss = new WebSocketServer({ noServer: true });
let nconn = 0;

server.on("upgrade", (req, socket, head) => {
  const path = req.url;
  const origin = req.headers.origin !== undefined ? req.headers.origin : req.headers["sec-websocket-origin"];
  const host = req.headers.host;
  if (!path.startsWith("/chat") || (path.length > 5 && !"/?".includes(path[5]))) {
    socket.end("HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
    emit({ event: "refused", status: 404, path, origin: origin === undefined ? null : origin, host: host || null });
    return;
  }
  if (origin !== undefined && !checkOrigin(origin, host)) {
    const msg = "Cross origin websockets not allowed";
    socket.end(`HTTP/1.1 403 Forbidden\r\nContent-Type: text/plain\r\nContent-Length: ${msg.length}\r\nConnection: close\r\n\r\n${msg}`);
    emit({ event: "refused", status: 403, path, origin, host: host || null });
    return;
  }
  wss.handleUpgrade(req, socket, head, (ws) => onConnection(ws, req));
});

function onConnection(ws, req) {
  const conn = ++nconn;
  const origin = req.headers.origin;
  emit({ event: "open", conn, path: req.url, origin: origin === undefined ? null : origin,
    host: req.headers.host || null, headers: req.headers });
  const timers = new Set();
  const send = (frame) => {
    if (ws.readyState !== ws.OPEN) return false;
    ws.send(JSON.stringify(frame));
    emit({ event: "sent", conn, frame });
    return true;
  };

  ws.on("message", (data, isBinary) => {
    if (isBinary) {
      emit({ event: "frame", conn, frame: { binary: data.length } });
      ws.send(data, { binary: true });
      return;
    }
    const text = data.toString();
    let frame;
    try {
      frame = JSON.parse(text);
    } catch (e) {
      emit({ event: "frame", conn, frame: { raw: text } });
      return;
    }
    emit({ event: "frame", conn, frame });
    if (!frame || typeof frame !== "object" || Array.isArray(frame) || typeof frame.body !== "string") {
      send(frame); // not a chat message: echoed back as it is (typing notices and the like)
      return;
    }
    if (!xsrfTokens.has(frame._xsrf)) {
      send({ body: "refused: '_xsrf' argument missing or wrong" });
      return;
    }
    const n = /long/i.test(frame.body) ? 30 : 3;
    let i = 0;
    const tick = () => {
      i += 1;
      if (!send({ body: `part ${i}/${n} of the reply to: ${frame.body}` })) return;
      if (i < n) {
        const t = setTimeout(() => { timers.delete(t); tick(); }, PART_MS);
        timers.add(t);
      } else {
        emit({ event: "reply_done", conn, to: frame.body, parts: n });
      }
    };
    const t = setTimeout(() => { timers.delete(t); tick(); }, PART_MS);
    timers.add(t);
  });
  ws.on("close", (code) => {
    for (const t of timers) clearTimeout(t);
    emit({ event: "close", conn, code });
  });
}

server.listen(PORT, HOST, () => emit({ event: "listening", port: server.address().port }));
for (const sig of ["SIGTERM", "SIGINT"]) process.on(sig, () => process.exit(0));
