"""End-to-end test of the gateway's limits (docs/protocol.md, Errors; docs/architecture.md, Back-pressure and bounds).

Covers:
- --max-connections 3: three clients connect, the fourth handshake is refused with HTTP 503,
  the three keep working, and after one closes a new client connects;
- max_connections in the config file (2): the third handshake gets 503;
- message rate: rate_limit {messages_per_second 2, burst 2} and a burst of 6 messages -> at
  least one rate_limited, every message exactly one terminal frame, the others done; after
  a pause the tokens are back and a message is served;
- queue bound from the config: queue_limit 2, one reply in flight (OpenAI /quick) + 2 queued
  + 1 -> the last is rate_limited, the three others finish;
- max_frame from the config file (2048): a bigger frame -> too_large, a smaller one served.
"""

import asyncio
import json
import socket
import time

import websockets

import harness
from harness import Client, check, independent, step


def raw_handshake_status(gw):
    """The status line the gateway answers a WebSocket handshake with (for diagnostics)."""
    with socket.create_connection(("127.0.0.1", gw.port), timeout=5) as s:
        s.sendall((f"GET /ws HTTP/1.1\r\nHost: 127.0.0.1:{gw.port}\r\nUpgrade: websocket\r\n"
                   "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                   "Sec-WebSocket-Version: 13\r\n\r\n").encode())
        return s.recv(4096).split(b"\r\n")[0].decode(errors="replace")


async def expect_refused(gw, status=503):
    """The next handshake is refused with HTTP `status`, as websockets reports it."""
    try:
        ws = await websockets.connect(gw.url, open_timeout=harness.DEFAULT_TIMEOUT)
    except websockets.InvalidStatusCode as err:
        check(err.status_code == status, f"handshake refused with {err.status_code}, expected {status}")
        return
    except websockets.InvalidMessage as err:
        line = await asyncio.to_thread(raw_handshake_status, gw)
        harness.fail(f"a handshake over the limit got a response websockets cannot read "
                     f"({err}: {err.__cause__}); the gateway answers {line!r}, expected "
                     f"'HTTP/1.1 {status} ...'")
    await ws.close()
    harness.fail(f"a connection over the limit was accepted (expected HTTP {status})")


async def connect_soon(gw, within=2.0):
    """Connect, retrying on 503 for a moment (the gateway may count a close a bit later)."""
    deadline = time.monotonic() + within
    while True:
        try:
            return await Client.connect(gw)
        except websockets.InvalidStatusCode as err:
            if err.status_code != 503 or time.monotonic() > deadline:
                harness.fail(f"no connection {within}s after a slot was freed: HTTP {err.status_code}")
            await asyncio.sleep(0.05)


async def test_max_connections(config):
    async with harness.Gateway(["--max-connections", 3], config) as gw:
        with step("--max-connections 3: three connect, the fourth gets 503"):
            clients = [await Client.connect(gw) for _ in range(3)]
            await expect_refused(gw)
        with step("the three connected clients keep working"):
            for n, c in enumerate(clients):
                (await c.message(f"still here {n}", mid=f"s{n}")).expect_done()
        with step("after one closes, a new client connects (and the limit holds again)"):
            await clients[0].close()
            clients[0] = await connect_soon(gw)
            (await clients[0].message("the newcomer", mid="n1")).expect_done()
            await expect_refused(gw)
        for c in clients:
            await c.close()

    config = dict(config, max_connections=2)
    async with harness.Gateway([], config) as gw:
        with step("max_connections 2 in the config: the third gets 503"):
            clients = [await Client.connect(gw) for _ in range(2)]
            await expect_refused(gw)
            for c in clients:
                await c.close()


async def test_rate_limit(config):
    config = dict(config, rate_limit={"messages_per_second": 2, "burst": 2})
    async with harness.Gateway([], config) as gw:
        client = await Client.connect(gw)
        tracker = client.track()
        ids = [f"r{i}" for i in range(6)]
        with step("rate 2/s burst 2: a burst of 6 messages -> at least one rate_limited"):
            for mid in ids:
                await client.send_message(f"burst message {mid}", mid)
            turns = [await client.collect_turn(mid) for mid in ids]
            tracker.assert_one_terminal_each(ids)
            limited = [t.id for t in turns if t.kind == "error" and t.terminal.get("code") == "rate_limited"]
            print(f"   rate_limited: {limited}")
            check(limited, "no message of the burst was rate_limited: "
                           + "; ".join(harness.brief(t.terminal, 80) for t in turns))
            for t in turns:
                if t.id not in limited:
                    t.expect_done()
            check(len(limited) <= 4, f"the burst of 2 was not honoured: {limited} rate limited")
        with step("after a pause the rate limit lets messages through again"):
            await asyncio.sleep(1.2)  # the subject: the rate limit's window refills
            (await client.message("after the pause", mid="later")).expect_done()
        await client.close()


async def test_queue_limit(fake):
    config = harness.make_config({"quick": harness.openai_upstream(fake, "quick")}, "quick", queue_limit=2)
    async with harness.Gateway([], config) as gw:
        client = await Client.connect(gw)
        tracker = client.track()
        with step("queue_limit 2: 1 in flight + 2 queued + 1 -> the last is rate_limited"):
            await client.send_message("number 0", "k0")
            await client.recv_type("ack", "k0")
            for i in (1, 2, 3):
                await client.send_message(f"number {i}", f"k{i}")
            await client.expect_error("rate_limited", mid="k3")
            for mid in ("k0", "k1", "k2"):
                (await client.collect_turn(mid)).expect_done()
            tracker.assert_one_terminal_each(["k0", "k1", "k2", "k3"])
        await client.close()


async def test_max_frame_config(config):
    config = dict(config, max_frame=2048)
    async with harness.Gateway([], config) as gw:
        client = await Client.connect(gw)
        with step("max_frame 2048 in the config: 3000 bytes -> too_large, 1500 bytes served"):
            await client.send_raw(json.dumps({"type": "message", "id": "f1", "text": "x" * 3000}))
            await client.expect_error("too_large")
            await client.send_raw(json.dumps({"type": "message", "id": "f2", "text": "y " * 700}))
            (await client.collect_turn("f2")).expect_done()
        await client.close()


async def main(args):
    config = harness.make_config({"demo": harness.demo_upstream(0)}, "demo")
    await independent(test_max_connections(config))
    await independent(test_rate_limit(config))
    await independent(test_max_frame_config(config))
    async with harness.FakeOpenAI() as fake:
        await independent(test_queue_limit(fake))


if __name__ == "__main__":
    harness.run(main, timeout=100)
