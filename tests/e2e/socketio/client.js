// The real Socket.IO client (npm socket.io-client 4.x) with its DEFAULT transports: it opens
// with HTTP long-polling, then upgrades to WebSocket. tests/e2e/test_dropin_socketio.py runs
// it against nginx (examples/nginx-socketio.conf), which sends the polling requests to the
// app and the WebSocket upgrade to chatgate.
//
//   node client.js URL [SCENARIO_JSON]
//
// URL: the page's origin, e.g. http://127.0.0.1:8080 (the client uses /socket.io/ under it).
// SCENARIO_JSON: an array of steps, or {"steps": [...], "origin": "http://...", "query": {...}}
// (origin: an Origin header sent on every request, as a browser page would). After the steps
// of argv, each line of standard input is one more step (a JSON object); at the end of
// standard input the client closes and exits. Steps, run one after the other:
//   {"op": "wait_upgrade", "timeout": ms}     until the transport is "websocket"
//   {"op": "emit", "event": E, "args": [...], "ack": true?, "binary": BASE64?}
//        (ack: wait for the acknowledgement too; binary: one more argument, those bytes)
//   {"op": "wait", "event": E, "contains": S, "count": N, "timeout": ms}
//        until N events named E whose JSON args contain S were received (since the start)
//   {"op": "sleep", "ms": ms}
//   {"op": "close"}
// Output, one JSON object a line, each with "t" (Date.now()) and "transport" (the Engine.IO
// transport at that moment, socket.io.engine.transport.name); binary arguments are shown as
// {"$binary": BASE64}:
//   {"kind": "open", "engine_id"}                  the Engine.IO session opened (over polling)
//   {"kind": "connect", "id", "engine_id"}         the Socket.IO and Engine.IO session ids
//   {"kind": "upgrade"}                            the transport is now "websocket"
//   {"kind": "event", "event", "args"}             every event received
//   {"kind": "sent", "event", "args", "ack"?}      every event sent
//   {"kind": "ack", "event", "args"}               the acknowledgement of an event sent
//   {"kind": "ping"}                               an Engine.IO ping from the server
//   {"kind": "disconnect", "reason"}, {"kind": "connect_error", "message"}
//   {"kind": "step", "index", "op", "ok", "error"?}  a step ended
//   {"kind": "end"}                                last, before closing: its "transport" is
//                                                  the one the client ended on
'use strict';

const { io } = require('socket.io-client');
const readline = require('node:readline');

const url = process.argv[2];
if (!url) {
  process.stderr.write('usage: node client.js URL [SCENARIO_JSON]\n');
  process.exit(2);
}
let scenario = process.argv[3] ? JSON.parse(process.argv[3]) : [];
if (Array.isArray(scenario)) scenario = { steps: scenario };

const options = {}; // the defaults: transports ["polling", "websocket"], upgrade on
if (scenario.origin) options.extraHeaders = { Origin: scenario.origin };
if (scenario.query) options.query = scenario.query;
const socket = io(url, options);

function transport() {
  const engine = socket.io.engine;
  return engine && engine.transport ? engine.transport.name : null;
}
// Binary arguments (Buffer, ArrayBuffer) are shown as {"$binary": BASE64}.
function show(args) {
  return args.map((a) => {
    if (Buffer.isBuffer(a)) return { $binary: a.toString('base64') };
    if (a instanceof ArrayBuffer) return { $binary: Buffer.from(a).toString('base64') };
    return a;
  });
}
function out(obj) {
  process.stdout.write(JSON.stringify({ ...obj, t: Date.now(), transport: transport() }) + '\n');
}

const received = []; // {event, args}
const waiters = new Set();
function poke() {
  for (const w of [...waiters]) w();
}

socket.on('connect', () => {
  out({ kind: 'connect', id: socket.id, engine_id: socket.io.engine.id });
  poke();
});
socket.on('disconnect', (reason) => {
  out({ kind: 'disconnect', reason });
  poke();
});
socket.on('connect_error', (err) => out({ kind: 'connect_error', message: String(err && err.message) }));
socket.onAny((event, ...raw) => {
  const args = show(raw);
  received.push({ event, args });
  out({ kind: 'event', event, args });
  poke();
});
socket.io.on('open', () => {
  const engine = socket.io.engine;
  out({ kind: 'open', engine_id: engine.id }); // the Engine.IO session is open (its first transport)
  engine.on('upgrade', () => {
    out({ kind: 'upgrade' });
    poke();
  });
  engine.on('ping', () => out({ kind: 'ping' }));
});

function until(predicate, timeout, what) {
  return new Promise((resolve, reject) => {
    if (predicate()) return resolve();
    const timer = setTimeout(() => {
      waiters.delete(check);
      reject(new Error(`timed out after ${timeout} ms waiting for ${what}`));
    }, timeout);
    const check = () => {
      if (predicate()) {
        clearTimeout(timer);
        waiters.delete(check);
        resolve();
      }
    };
    waiters.add(check);
  });
}

async function runStep(step) {
  switch (step.op) {
    case 'wait_upgrade':
      return until(() => socket.connected && transport() === 'websocket', step.timeout || 10000,
        'the websocket upgrade');
    case 'emit': {
      const args = [...(step.args || [])];
      if (step.binary !== undefined) args.push(Buffer.from(step.binary, 'base64')); // a binary event (45)
      if (!step.ack) {
        socket.emit(step.event, ...args);
        out({ kind: 'sent', event: step.event, args: show(args) });
        return undefined;
      }
      const answer = socket.timeout(step.timeout || 10000).emitWithAck(step.event, ...args);
      out({ kind: 'sent', event: step.event, args: show(args), ack: true });
      let reply;
      try {
        reply = await answer;
      } catch (err) {
        throw new Error(`no acknowledgement of ${step.event}: ${err.message}`);
      }
      out({ kind: 'ack', event: step.event, args: show([reply]) });
      return undefined;
    }
    case 'wait': {
      const count = step.count || 1;
      const matches = () => received.filter((r) => r.event === step.event &&
        (step.contains === undefined || JSON.stringify(r.args).includes(step.contains))).length;
      return until(() => matches() >= count, step.timeout || 10000,
        `${count} '${step.event}' event(s)${step.contains !== undefined ? ' containing ' + JSON.stringify(step.contains) : ''}`);
    }
    case 'sleep':
      return new Promise((resolve) => setTimeout(resolve, step.ms || 0));
    case 'close':
      socket.close();
      return undefined;
    default:
      throw new Error(`unknown step ${JSON.stringify(step)}`);
  }
}

let index = 0;
let chain = Promise.resolve();
function enqueue(step) {
  const i = index++;
  chain = chain.then(async () => {
    try {
      await runStep(step);
      out({ kind: 'step', index: i, op: step.op, ok: true });
    } catch (err) {
      out({ kind: 'step', index: i, op: step.op, ok: false, error: String(err && err.message) });
    }
  });
}

for (const step of scenario.steps || []) enqueue(step);

const lines = readline.createInterface({ input: process.stdin });
lines.on('line', (line) => {
  if (!line.trim()) return;
  let step;
  try {
    step = JSON.parse(line);
  } catch (err) {
    out({ kind: 'step', index: index++, op: null, ok: false, error: `not JSON: ${line}` });
    return;
  }
  enqueue(step);
});
lines.on('close', () => {
  chain.then(() => {
    out({ kind: 'end' }); // its "transport": the one the client ended on
    socket.close();
    setTimeout(() => process.exit(0), 50);
  });
});
