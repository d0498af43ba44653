"""End-to-end test of the OpenAI-compatible upstream's kept-alive connections (issue 12,
item 3; docs/configuration.md, "Per upstream": max_idle_connections, idle_keepalive_ms).

A real HTTP/1.1 server in this process (PoolServer, asyncio streams) counts the TCP
connections it accepts and sees close; it answers each POST .../chat/completions with a
chunked text/event-stream (words, a finish_reason, [DONE]) and keeps the connection, or,
when made with close=True, says `Connection: close` and closes. A message whose text holds
SLOW gets 60 words 100 ms apart. Covers, each on a gateway of its own:
- 20 messages one after the other on one client: 1 TCP connection; /metrics shows
  opened 1, reused 19, idle 1 for that upstream;
- 6 clients at once on an upstream with max_idle_connections 2: 6 connections, and when all
  are answered only 2 stay open (the server sees the others close), idle 2 in /metrics;
- more replies at once than max_idle_connections (2): while 3 slow replies stream, a 4th
  client's 5 messages one after the other reuse one connection (4 connections in all).
  max_idle_connections bounds the idle connections, not all of them: libcurl's
  CURLMOPT_MAXCONNECTS counts the busy ones too, and set to 2 it closed each reply's
  connection as it ended, so every message opened a new one (8 connections);
- a cancel mid-reply: the server sees that connection close within 1 s; the next message
  is answered on a connection of its own (never the cancelled one);
- a server answering `Connection: close`: a new connection for each of 5 messages, reused 0;
- idle_keepalive_ms 1000: the idle connection is closed by the gateway within 3 s, and
  idle 0 in /metrics;
- replies_per_handle 2 (libcurl handles of 2 replies each): 6 slow replies at once run in 3
  handles, each answered whole; each handle keeps its own 2 idle connections (6 stay open,
  where one handle kept 2), the next 6 messages at once reuse them (no new connection), and
  idle_keepalive_ms closes every handle's.
"""

import asyncio
import json
import time

import harness
from harness import Client, check, step


class PoolServer:
    def __init__(self, close=False):
        self.close = close
        self.accepted = 0
        self.open = 0
        self.closed_at = []  # monotonic times of connections the client closed or we closed
        self.requests = 0
        self.server = None
        self.port = None

    async def __aenter__(self):
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc):
        self.server.close()

    def url(self):
        return f"http://127.0.0.1:{self.port}/v1"

    async def _handle(self, reader, writer):
        self.accepted += 1
        self.open += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                headers = {k.strip().lower(): v.strip() for k, v in
                           (line.split(":", 1) for line in lines[1:] if ":" in line)}
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                self.requests += 1
                text = json.loads(body)["messages"][-1]["content"]
                slow = "SLOW" in text
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                             b"Transfer-Encoding: chunked\r\n" +
                             (b"Connection: close\r\n" if self.close else b"") + b"\r\n")
                words = [f"w{i} " for i in range(60)] if slow else ["echo: ", text]
                for word in words:
                    writer.write(chunk(event({"choices": [{"index": 0, "delta": {"content": word}}]})))
                    await writer.drain()
                    if slow:
                        await asyncio.sleep(0.1)
                writer.write(chunk(event({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})))
                writer.write(chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
                await writer.drain()
                if self.close:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.open -= 1
            self.closed_at.append(time.monotonic())
            writer.close()


def event(obj):
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def chunk(data):
    return b"%x\r\n%s\r\n" % (len(data), data)


def gateway(server, **pool):
    upstream = {"url": server.url(), "model": "m", "connect_timeout_ms": 2000, "first_byte_timeout_ms": 5000,
                "idle_timeout_ms": 5000}
    upstream.update(pool)
    return harness.Gateway([], harness.make_config({"llm": upstream}, "llm"))


async def metrics(gw):
    status, _, raw = await asyncio.to_thread(harness.http_get, gw.http_url + "/metrics")
    check(status == 200, f"GET /metrics: {status}")
    m = harness.parse_metrics(raw.decode() if isinstance(raw, bytes) else raw)
    return {k: m.value(f"chatgate_upstream_connections_{k}", upstream="llm")
            for k in ("opened_total", "reused_total", "idle")}


async def sequential():
    async with PoolServer() as server, gateway(server) as gw:
        client = await Client.connect(gw)
        with step("20 messages one after the other -> 1 upstream TCP connection"):
            for i in range(20):
                turn = await client.message(f"hello {i}", mid=f"m{i}")
                turn.expect_done()
            check(server.requests == 20, f"the server should have 20 requests, got {server.requests}")
            check(server.accepted == 1, f"the server should have accepted 1 connection, got {server.accepted}")
        with step("/metrics: opened 1, reused 19, idle 1"):
            m = await metrics(gw)
            check(m == {"opened_total": 1, "reused_total": 19, "idle": 1}, f"pool metrics: {m}")
        await client.close()


async def concurrent():
    async with PoolServer() as server, gateway(server, max_idle_connections=2) as gw:
        clients = [await Client.connect(gw) for _ in range(6)]
        with step("6 slow replies at once -> 6 connections; afterwards at most 2 kept"):
            turns = await asyncio.gather(*(c.message("SLOW please", mid=f"c{i}", timeout=20)
                                           for i, c in enumerate(clients)))
            for t in turns:
                t.expect_done()
            check(server.accepted == 6, f"6 replies at once should need 6 connections, got {server.accepted}")
            ok = await harness.wait_until(lambda: server.open == 2, 3.0)
            check(ok, f"2 connections should stay open (max_idle_connections), the server has {server.open}")
            m = await metrics(gw)
            check(m["idle"] == 2 and m["opened_total"] == 6, f"pool metrics: {m}")
        with step("the next 2 messages reuse the kept connections"):
            turns = await asyncio.gather(*(clients[i].message("again", mid=f"d{i}") for i in range(2)))
            for t in turns:
                t.expect_done()
            check(server.accepted == 6, f"no new connection expected, the server accepted {server.accepted}")
        for c in clients:
            await c.close()


async def busier_than_idle():
    async with PoolServer() as server, gateway(server, max_idle_connections=2) as gw:
        slow = [await Client.connect(gw) for _ in range(3)]
        quick = await Client.connect(gw)
        with step("3 slow replies streaming; a 4th client's 5 messages reuse one connection"):
            for i, c in enumerate(slow):
                await c.send_message("SLOW please", mid=f"s{i}")
            for i, c in enumerate(slow):
                await c.recv_type("delta", f"s{i}")
            check(server.accepted == 3, f"3 connections for the slow replies, got {server.accepted}")
            for i in range(5):
                (await quick.message(f"quick {i}", mid=f"q{i}")).expect_done()
            check(server.accepted == 4,
                  f"the 5 quick messages should share one kept connection (4 in all), the server accepted "
                  f"{server.accepted}")
            m = await metrics(gw)
            check(m["reused_total"] == 4, f"pool metrics: {m}")
        with step("the slow replies end whole; afterwards 2 connections kept"):
            for i, c in enumerate(slow):
                (await c.collect_turn(f"s{i}", timeout=20)).expect_done()
            ok = await harness.wait_until(lambda: server.open == 2, 3.0)
            check(ok, f"2 connections should stay open (max_idle_connections), the server has {server.open}")
        for c in slow + [quick]:
            await c.close()


async def cancel():
    async with PoolServer() as server, gateway(server) as gw:
        client = await Client.connect(gw)
        with step("a kept connection, then a cancel mid-reply closes it within 1 s"):
            (await client.message("warm up", mid="w")).expect_done()
            check(server.accepted == 1 and server.open == 1, f"one kept connection: {server.accepted}/{server.open}")
            await client.send_message("SLOW reply", mid="s")
            for _ in range(3):
                await client.recv_type("delta", "s")
            cancelled_at = time.monotonic()
            await client.cancel("s")
            turn = await client.collect_turn("s")
            check(turn.kind == "cancelled", f"expected cancelled: {turn.describe()}")
            ok = await harness.wait_until(lambda: server.open == 0, 1.0)
            check(ok, "the server should see the cancelled reply's connection close within 1 s")
            print(f"   closed {server.closed_at[-1] - cancelled_at:.3f}s after the cancel")
        with step("the next message gets a connection of its own"):
            (await client.message("after cancel", mid="a")).expect_done()
            check(server.accepted == 2, f"a new connection expected after the cancel, got {server.accepted}")
            m = await metrics(gw)
            check(m["opened_total"] == 2 and m["reused_total"] == 1, f"pool metrics: {m}")
        await client.close()


async def connection_close():
    async with PoolServer(close=True) as server, gateway(server) as gw:
        client = await Client.connect(gw)
        with step("a server saying Connection: close -> a new connection each time"):
            for i in range(5):
                (await client.message(f"hi {i}", mid=f"k{i}")).expect_done()
            check(server.accepted == 5, f"5 connections expected, got {server.accepted}")
            m = await metrics(gw)
            check(m == {"opened_total": 5, "reused_total": 0, "idle": 0}, f"pool metrics: {m}")
        await client.close()


async def idle_timeout():
    async with PoolServer() as server, gateway(server, idle_keepalive_ms=1000) as gw:
        client = await Client.connect(gw)
        with step("idle_keepalive_ms 1000: the idle connection is closed by the gateway"):
            (await client.message("one", mid="i1")).expect_done()
            check(server.open == 1, f"one kept connection expected, the server has {server.open}")
            started = time.monotonic()
            ok = await harness.wait_until(lambda: server.open == 0, 3.0)
            check(ok, "the idle connection should be closed within 3 s (idle_keepalive_ms 1000)")
            print(f"   closed after {time.monotonic() - started:.2f}s idle")
            m = await metrics(gw)
            check(m["idle"] == 0, f"pool metrics: {m}")
        with step("the next message opens a new one"):
            (await client.message("two", mid="i2")).expect_done()
            check(server.accepted == 2, f"2 connections expected, got {server.accepted}")
        await client.close()


async def lanes():
    async with PoolServer() as server, gateway(server, max_idle_connections=2, replies_per_handle=2,
                                               idle_keepalive_ms=1000) as gw:
        clients = [await Client.connect(gw) for _ in range(6)]
        with step("replies_per_handle 2: 6 slow replies at once run in 3 handles, each whole; "
                  "each handle keeps its 2 idle connections"):
            turns = await asyncio.gather(*(c.message("SLOW please", mid=f"l{i}", timeout=20)
                                           for i, c in enumerate(clients)))
            for t in turns:
                t.expect_done()
                check(len(t.terminal.get("text", "")) > 100, f"a slow reply should come whole: {t.describe()}")
            check(server.accepted == 6, f"6 replies at once should need 6 connections, got {server.accepted}")
            m = await metrics(gw)
            check(server.open == 6 and m["idle"] == 6,
                  f"each of the 3 handles should keep its 2 connections (6), the server has {server.open} open; {m}")
        with step("the next 6 messages at once reuse them: no new connection"):
            turns = await asyncio.gather(*(c.message("again", mid=f"a{i}") for i, c in enumerate(clients)))
            for t in turns:
                t.expect_done()
            m = await metrics(gw)
            check(server.accepted == 6 and m["reused_total"] == 6,
                  f"no new connection expected: the server accepted {server.accepted}; {m}")
        with step("idle_keepalive_ms 1000 closes every handle's connections"):
            ok = await harness.wait_until(lambda: server.open == 0, 4.0)
            m = await metrics(gw)
            check(ok and m["idle"] == 0, f"every idle connection should close, the server has {server.open}; {m}")
        for c in clients:
            await c.close()


async def main(args):
    await sequential()
    await concurrent()
    await busier_than_idle()
    await cancel()
    await connection_close()
    await idle_timeout()
    await lanes()


if __name__ == "__main__":
    harness.run(main, timeout=80)
