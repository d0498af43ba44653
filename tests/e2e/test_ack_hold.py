"""End-to-end test of the ack's hold (issue 12; docs/configuration.md, `ack_hold_ms`; docs/protocol.md).

An ack that finds the client's queue empty waits up to `ack_hold_ms` for the reply's first
frames and goes out in the same write, so that a quick upstream's turn costs the client one
receive instead of two. What must hold, with the demo upstream (its first word comes
`delay_ms` after the message):
- coalesced: with a hold longer than the upstream's first word (100 ms against 40 ms), the
  ack and the first delta arrive in one read of the socket; with `ack_hold_ms` 0 the first
  read holds the ack alone (40 ms before the delta), so the probe can tell the two apart;
- bounded: with the default hold (5 ms) and an upstream slow to start (1 s), the ack comes
  at once, long before the first delta, which is not waited for, and comes first.
Whether two frames came in one write is below what a WebSocket library shows, so the probe
is a plain socket speaking RFC 6455 (handshake, one masked text frame, unmasked frames
read); the order and the timing are checked through the websockets package as everywhere.
"""

import asyncio
import base64
import json
import os
import socket
import struct
import time

import harness
from harness import Client, Gateway, check, independent, step


def config(delay_ms, **extra):
    return harness.make_config({"demo": harness.demo_upstream(delay_ms)}, "demo",
                               rate_limit={"messages_per_second": 1000, "burst": 1000}, **extra)


def frames_in(data):
    """The text frames (parsed JSON) wholly inside data, a server's unmasked frames."""
    out, i = [], 0
    while i + 2 <= len(data):
        n, head = data[i + 1] & 0x7F, 2
        if n == 126:
            if i + 4 > len(data):
                break
            n, head = struct.unpack(">H", data[i + 2:i + 4])[0], 4
        elif n == 127:
            if i + 10 > len(data):
                break
            n, head = struct.unpack(">Q", data[i + 2:i + 10])[0], 10
        if i + head + n > len(data):
            break
        if data[i] & 0x0F == 1:
            out.append(json.loads(data[i + head:i + head + n]))
        i += head + n
    return out


def masked_text(obj):
    payload = json.dumps(obj).encode()
    key = os.urandom(4)
    n = len(payload)
    head = bytes([0x81, 0x80 | n]) if n < 126 else bytes([0x81, 0x80 | 126]) + struct.pack(">H", n)
    return head + key + bytes(b ^ key[i % 4] for i, b in enumerate(payload))


def first_read_after_message(port, text):
    """Connects with a plain socket, reads the hello, sends a message and returns the frames
    of the first read that follows (what one write of the gateway's brought)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        key = base64.b64encode(os.urandom(16)).decode()
        s.sendall((f"GET /ws HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
                   f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode())
        data = b""
        while b"\r\n\r\n" not in data:
            data += s.recv(65536)
        status, _, rest = data.partition(b"\r\n\r\n")
        check(status.startswith(b"HTTP/1.1 101"), f"the handshake was answered {status[:40]!r}")
        while not frames_in(rest):  # the hello
            rest += s.recv(65536)
        check(frames_in(rest)[0].get("type") == "hello", f"no hello first: {frames_in(rest)}")
        s.sendall(masked_text({"type": "message", "id": "m1", "text": text}))
        got = frames_in(s.recv(65536))
        return [f.get("type") for f in got]


async def part_coalesced():
    with step("a 100 ms hold, the upstream's first word after 40 ms: the ack and the first delta "
              "come in one read"):
        async with Gateway(config=config(40, ack_hold_ms=100), name="ack-hold") as gw:
            kinds = await asyncio.to_thread(first_read_after_message, gw.port, "hello there")
            check(kinds[:2] == ["ack", "delta"], f"the first read brought {kinds}, not the ack and a delta")
    with step("ack_hold_ms 0: the first read holds the ack alone, 40 ms before the delta"):
        async with Gateway(config=config(40, ack_hold_ms=0), name="ack-now") as gw:
            kinds = await asyncio.to_thread(first_read_after_message, gw.port, "hello there")
            check(kinds == ["ack"], f"the first read brought {kinds}, not the ack alone")


async def part_bounded():
    with step("the default hold, an upstream 1 s slow to start: the ack at once, first, and the "
              "first delta a second later"):
        async with Gateway(config=config(1000), name="ack-slow") as gw:
            c = await Client.connect(gw)
            sent = time.monotonic()
            await c.send_message("hello there", mid="s1")
            ack = await c.recv(timeout=5)
            acked = time.monotonic() - sent
            check(ack.get("type") == "ack" and ack.get("id") == "s1", f"the first frame is not the ack: {ack}")
            check(acked < 1.0, f"the ack came {acked:.3f} s after the message: it waited for the reply")
            delta = await c.recv(timeout=5)
            check(delta.get("type") == "delta" and delta.get("id") == "s1" and time.monotonic() - sent > 0.9,
                  f"then the first delta, after the upstream's 1 s: {delta}")
            await c.close()


async def main(args):
    await independent(part_coalesced())
    await independent(part_bounded())


if __name__ == "__main__":
    harness.run(main, timeout=60)
