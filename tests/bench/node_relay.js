// node_relay.js: the Node reference point of tests/bench/compare.sh, a plain WebSocket relay
// on the `ws` package (tests/bench/package.json pins it): one upstream WebSocket per client
// connection, frames relayed both ways as they are (text stays text), either side's close
// closes the other. Client frames sent before the upstream is open wait in a queue.
//
//   node tests/bench/node_relay.js PORT ws://APP_HOST:APP_PORT/PATH
'use strict';
const { WebSocketServer, WebSocket } = require('ws');

const port = Number(process.argv[2]);
const upstream = process.argv[3];
if (!port || !upstream) {
  console.error('usage: node node_relay.js PORT ws://UPSTREAM');
  process.exit(2);
}
const wss = new WebSocketServer({ host: '127.0.0.1', port, perMessageDeflate: false });
wss.on('connection', (client) => {
  const up = new WebSocket(upstream, { perMessageDeflate: false });
  const queue = [];
  client.on('message', (data, isBinary) => {
    if (up.readyState === WebSocket.OPEN) up.send(data, { binary: isBinary });
    else queue.push([data, isBinary]);
  });
  up.on('open', () => {
    for (const [data, isBinary] of queue) up.send(data, { binary: isBinary });
    queue.length = 0;
  });
  up.on('message', (data, isBinary) => client.send(data, { binary: isBinary }));
  client.on('close', () => up.close());
  up.on('close', () => client.close());
  client.on('error', () => up.terminate());
  up.on('error', () => client.terminate());
});
wss.on('listening', () => console.error(`node_relay: listening on 127.0.0.1:${port} -> ${upstream}`));
process.on('SIGTERM', () => process.exit(0));
process.on('SIGINT', () => process.exit(0));
