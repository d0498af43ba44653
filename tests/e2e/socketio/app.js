// The Socket.IO chat app of socket.io's own tutorial (https://socket.io/docs/v4/tutorial/),
// without express: an http server serving the page, `new Server(server)`, and the one
// handler `socket.on('chat message', (msg) => io.emit('chat message', msg))`. It is the app
// that tests/e2e/test_dropin_socketio.py puts behind chatgate (socket.io codec) and nginx
// (examples/nginx-socketio.conf), unchanged but for the TEST ADDITIONS marked below, which
// only watch (they print what the app receives and sends) or play a bot that streams replies.
//
//   node app.js [PORT]            (or PORT=3000 node app.js; default 3000)
//   NODE_PATH=.../node_modules    (socket.io 4.x, pinned in package-lock.json beside this file)
//
// Output, one line each, for the test to read:
//   LISTENING {"port"}
//   UPGRADE {"url","headers"}            an HTTP Upgrade request reached the app
//   CONNECT {"sid","engine_id","transport"}  a Socket.IO connection (its first transport)
//   TRANSPORT {"sid","transport"}        its Engine.IO transport was upgraded
//   RECV {"sid","event","args","t","transport"}  every event, with its FULL argument list
//                                        (chatgate appends its object as an extra last one;
//                                        an ack callback shows as "<ack callback>", bytes
//                                        as {"$binary": BASE64})
//   SENT {"to","sid"|"sids","event","args","t"}  every event the app sent (to: its sid,
//                                        or "all" with the sids of a broadcast)
//   PONG {"sid","transport","t"}         an Engine.IO pong (the answer to the app's ping)
//   CANCEL {"sid","stopped","t"}         a 'cancel' event; stopped: whether a reply streamed
//   DISCONNECT {"sid","reason"}
'use strict';

const { createServer } = require('node:http');
const { Server } = require('socket.io');

const port = Number(process.argv[2] || process.env.PORT || 3000);

// The tutorial's index.html (step 3/4), served at /.
const INDEX_HTML = `<!DOCTYPE html>
<html>
  <head>
    <meta name="viewport" content="width=device-width,initial-scale=1.0">
    <title>Socket.IO chat</title>
    <style>
      body { margin: 0; padding-bottom: 3rem; font-family: -apple-system, BlinkMacSystemFont, "Segoe UI", Roboto, Helvetica, Arial, sans-serif; }
      #form { background: rgba(0, 0, 0, 0.15); padding: 0.25rem; position: fixed; bottom: 0; left: 0; right: 0; display: flex; height: 3rem; box-sizing: border-box; backdrop-filter: blur(10px); }
      #input { border: none; padding: 0 1rem; flex-grow: 1; border-radius: 2rem; margin: 0.25rem; }
      #input:focus { outline: none; }
      #form > button { background: #333; border: none; padding: 0 1rem; margin: 0.25rem; border-radius: 3px; outline: none; color: #fff; }
      #messages { list-style-type: none; margin: 0; padding: 0; }
      #messages > li { padding: 0.5rem 1rem; }
      #messages > li:nth-child(odd) { background: #efefef; }
    </style>
  </head>
  <body>
    <ul id="messages"></ul>
    <form id="form" action="">
      <input id="input" autocomplete="off" /><button>Send</button>
    </form>
    <script src="/socket.io/socket.io.js"></script>
    <script>
      const socket = io();

      const form = document.getElementById('form');
      const input = document.getElementById('input');
      const messages = document.getElementById('messages');

      form.addEventListener('submit', (e) => {
        e.preventDefault();
        if (input.value) {
          socket.emit('chat message', input.value);
          input.value = '';
        }
      });

      socket.on('chat message', (msg) => {
        const item = document.createElement('li');
        item.textContent = msg;
        messages.appendChild(item);
        window.scrollTo(0, document.body.scrollHeight);
      });
    </script>
  </body>
</html>
`;

const server = createServer((req, res) => {
  if (req.method === 'GET' && (req.url === '/' || req.url === '/index.html')) {
    res.writeHead(200, { 'Content-Type': 'text/html; charset=utf-8' });
    res.end(INDEX_HTML);
    return;
  }
  res.writeHead(404, { 'Content-Type': 'text/plain' });
  res.end('not found\n');
});

// TEST ADDITION: short Engine.IO heartbeats (the defaults are 25 s / 20 s), so that pings
// and pongs cross the gateway during a short test, and a gateway that lost them would get
// the connection closed ("ping timeout") within PING_INTERVAL + PING_TIMEOUT.
const serverOptions = {};
if (process.env.PING_INTERVAL_MS) serverOptions.pingInterval = Number(process.env.PING_INTERVAL_MS);
if (process.env.PING_TIMEOUT_MS) serverOptions.pingTimeout = Number(process.env.PING_TIMEOUT_MS);

const io = new Server(server, serverOptions);

// ---- TEST ADDITION: what the app sees and sends, one JSON line each on stdout.
function out(kind, obj) {
  process.stdout.write(kind + ' ' + JSON.stringify(obj) + '\n');
}
// Arguments as printed: an ack callback as "<ack callback>", bytes as {"$binary": BASE64}.
function show(args) {
  return args.map((a) => {
    if (typeof a === 'function') return '<ack callback>';
    if (Buffer.isBuffer(a)) return { $binary: a.toString('base64') };
    return a;
  });
}
// Every event sent, logged at the moment it is handed to socket.io.
// to: the socket's id, or "all" for a broadcast (sids: the sockets it went to).
function logSent(to, event, args) {
  const shown = show(args);
  if (to === 'all') out('SENT', { to: 'all', sids: [...io.sockets.sockets.keys()], event, args: shown, t: Date.now() });
  else out('SENT', { sid: to.id, to: to.id, event, args: shown, t: Date.now() });
}
server.on('upgrade', (req) => {
  out('UPGRADE', { url: req.url, headers: req.headers });
});

// ---- TEST ADDITION: the bot. After each 'chat message' it streams a reply to that socket as
// several 'bot message' events, with no id and no end marker (10 parts, one every 100 ms, for
// a message containing "long", else 3), led by a 'typing' event; a 'cancel' event stops the
// reply streaming on that socket. Each part names the message it answers, for the test.
const PART_MS = Number(process.env.BOT_PART_MS || 100);
function startBot(socket, msg) {
  const text = typeof msg === 'string' ? msg : JSON.stringify(msg);
  const total = /long/i.test(text) ? 10 : 3;
  const stream = { n: 0, total, timer: null };
  if (!socket.data.streams) socket.data.streams = new Set();
  socket.data.streams.add(stream);
  const emit = (event, ...args) => {
    logSent(socket, event, args);
    socket.emit(event, ...args);
  };
  emit('typing', 'bot');
  const next = () => {
    stream.n += 1;
    emit('bot message', `[${text}] part ${stream.n}/${total} `);
    if (stream.n < total) {
      stream.timer = setTimeout(next, PART_MS);
    } else {
      stream.timer = null;
      socket.data.streams.delete(stream);
    }
  };
  stream.timer = setTimeout(next, PART_MS);
}
function stopBot(socket) {
  const streams = socket.data.streams || new Set();
  const stopped = streams.size > 0;
  for (const s of streams) clearTimeout(s.timer);
  streams.clear();
  return stopped;
}

io.on('connection', (socket) => {
  // ---- TEST ADDITIONS, up to the tutorial's handler: watching (CONNECT ... DISCONNECT
  // lines), the bot's 'cancel', and two non-chat events the test sends through the gateway.
  out('CONNECT', { sid: socket.id, engine_id: socket.conn.id, transport: socket.conn.transport.name });
  socket.conn.on('upgrade', (transport) => out('TRANSPORT', { sid: socket.id, transport: transport.name }));
  socket.conn.on('packet', (packet) => {
    if (packet.type === 'pong') out('PONG', { sid: socket.id, transport: socket.conn.transport.name, t: Date.now() });
  });
  socket.onAny((event, ...args) => {
    out('RECV', { sid: socket.id, event, args: show(args), t: Date.now(), transport: socket.conn.transport.name });
  });
  socket.on('disconnect', (reason) => out('DISCONNECT', { sid: socket.id, reason }));
  socket.on('cancel', () => { // stops the bot's reply streaming on this socket
    out('CANCEL', { sid: socket.id, stopped: stopBot(socket), t: Date.now() });
  });
  // An event with an acknowledgement (Socket.IO's 43 packet back): answers who it is.
  socket.on('whoami', (...args) => {
    const callback = args[args.length - 1];
    if (typeof callback === 'function') callback({ sid: socket.id, transport: socket.conn.transport.name });
  });
  // A 'file' event (binary attachment) is sent back to its sender, as it came.
  socket.on('file', (...args) => {
    const data = args.filter((a) => typeof a !== 'function');
    logSent(socket, 'file', data);
    socket.emit('file', ...data);
  });
  socket.on('disconnect', () => stopBot(socket));

  // ---- The tutorial's handler, as it is written there.
  socket.on('chat message', (msg) => {
    logSent('all', 'chat message', [msg]); // TEST ADDITION (watching only)
    io.emit('chat message', msg);
  });

  // TEST ADDITION: the bot answers every chat message; a chat message sent with an
  // acknowledgement gets one ("delivered"), its callback taken as socket.io passes it: last.
  socket.on('chat message', (...args) => {
    const callback = args[args.length - 1];
    if (typeof callback === 'function') callback('delivered');
    startBot(socket, args[0]);
  });
});

server.listen(port, '127.0.0.1', () => {
  out('LISTENING', { port: server.address().port });
});

process.on('SIGTERM', () => {
  io.close();
  process.exit(0);
});
