"""Issue 9 (hardening), drop-in mode and close frames: defects 1, 8, 10 and the close-frame
item of 15, each with the behaviour that failed on main 1b36468.

- defect 1: a say whose msg_id is over 128 bytes (and would be cut inside a UTF-8 character)
  followed by a cancel phrase took the gateway down. Now such a frame is refused (issue 35:
  the app would read it as a chat message that passed no limit or rule): it never reaches
  the app, it is counted in chatgate_bad_frames_total, the gateway stays up and the session
  goes on; a 128-byte id of 2-byte characters is a chat message, and "stop" sends the app a
  halt with that whole id;
- defect 8: two tabs (one cookie, one conversation) whose turns overlap: the second waits for
  the first's reply to end (the dialog lock chatgate.v1 has), so the dialog keeps both turns'
  params; a drop-in client sending says past rate_limit has them refused (not forwarded,
  counted in chatgate_rate_limited_total), and says waiting for their dialog are bounded by
  queue_limit;
- defect 10: a drop-in client refused by --auth gets a close frame 1008 (not 1006), counted in
  chatgate_unauthorized_total;
- issue 39's ninth round: drop-in clients waiting for their app's handshake count toward
  max_connections (three held, max_connections 3: a fourth client gets 503);
- 15 (close frames, RFC 6455 7.4): a close frame with a 1-byte payload, a code over 4999 or a
  reserved one, from a chatgate.v1 client or a drop-in client (raw socket frames), is answered
  with 1002; a valid one is echoed; the app closing with an invalid code closes the client with
  1011 (not the invalid code).
"""

import asyncio
import base64
import hashlib
import os
import socket
import struct
import time

import websockets

import harness
from harness import Gateway, check, independent, step
from dropin_app import ChatApp, ChatClient
from test_dropin import (FLIGHT1, FLIGHT2, WANT2, ENV, chatgate_of, config, connect, login, reply, short,
                         shorts, wait_say)


def gateway(app, name, **top):
    cfg = config(app.url)
    cfg.update(top)
    return Gateway(config=cfg, env=ENV, name=name)


async def metrics(gw):
    status, _, body = await asyncio.to_thread(harness.http_get, gw.http_url + "/metrics")
    check(status == 200, f"/metrics answered {status}")
    return harness.parse_metrics(body.decode())


# -------------------------------------------------------------------------------------- 1


async def part_long_id():
    async with ChatApp(chunk_interval=0.1) as app:
        async with gateway(app, "gateway:long-id") as gw:
            sid = await login(app)
            client = await connect(gw.ws_url("/socket"), sid)
            sess = await app.next_session(0)
            long_id = "a" + "é" * 100  # 201 bytes; the first 128 end inside an é
            with step("a say with a 201-byte msg_id, then 'stop': the gateway stays up, the say never "
                      "reaches the app (refused: it cannot be checked), the 'stop' does"):
                await client.say("Tell me a long story", long_id, "trip")
                await client.say("stop", "s1", "trip")
                await wait_say(sess, "s1")
                gw.assert_alive()
                check(sess.say(long_id) is None,
                      f"a say with an over-long id reached the app: {short(sess.say(long_id))}")
                check(not [h for h in sess.halts if h[0] == long_id],
                      "the gateway sent a halt for a message it did not take as a chat message")
            with step("the session goes on: the next say is a chat message"):
                await client.say("hello", "c1", "trip")
                r = await reply(client, "c1")
                check(r.kind == "end", f"reply {shorts(r.frames)}")
                chatgate_of(await wait_say(sess, "c1"), "c1")
            with step("a 128-byte id of 2-byte characters is a chat message; 'stop' halts it by that whole id"):
                id128 = "é" * 64
                await client.say("Tell me a long story", id128, "trip")
                await wait_say(sess, id128)
                chatgate_of(sess.say(id128), "id128")
                await client.say("stop", "s2", "trip")
                ok = await harness.wait_until(lambda: any(h[0] == id128 for h in sess.halts), 5)
                check(ok, f"the app got no halt for the 128-byte id: halts {sess.halts}")
            with step("an id that is neither a string nor an integer: refused, counted as a bad frame; the "
                      "typing frame after it passes"):
                await client.send({"kind": "say", "msg_id": True, "conversation": "trip", "body": "hi"})
                await client.typing("trip")
                ok = await harness.wait_until(lambda: any(isinstance(f, dict) and f.get("kind") == "typing"
                                                          for f in sess.frames), 5)
                check(ok, "the typing frame after the refused say did not reach the app")
                check(not any(isinstance(f, dict) and f.get("msg_id") is True for f in sess.frames),
                      "the say with a boolean id reached the app")
                m = await metrics(gw)
                check(m.value("chatgate_bad_frames_total") >= 2, "chatgate_bad_frames_total should count both")
            await client.close()
            gw.assert_alive()


# -------------------------------------------------------------------------------------- 8


async def two_tabs(app, gw):
    """Two clients of one app session (the same sid cookie): (a, b, a's app side, b's)."""
    sid = await login(app)
    url = gw.ws_url("/socket")
    a = await connect(url, sid)
    b = await connect(url, sid)
    await app.next_session(1)
    return a, b, app.sessions[0], app.sessions[1]


async def part_two_tabs():
    async with ChatApp(chunk_interval=0.3) as app:
        async with gateway(app, "gateway:two-tabs") as gw:
            a, b, sa, sb = await two_tabs(app, gw)
            with step("tab A says the flight, tab B the return date while A's reply streams: "
                      "B waits for A's turn, so its params hold both"):
                await a.say(FLIGHT1, "a1", "trip")
                await wait_say(sa, "a1")
                await b.say(FLIGHT2, "b1", "trip")
                ra, rb = await asyncio.gather(reply(a, "a1"), reply(b, "b1"))
                check(ra.kind == "end" and rb.kind == "end", f"replies {shorts(ra.frames)} {shorts(rb.frames)}")
                cg_b = chatgate_of(sb.say("b1"), "b1")
                check(cg_b["params"] == WANT2, f"B's say should carry {WANT2}: {short(cg_b['params'])}")
                t_a_end = sa.sent_at[[i for i, f in enumerate(sa.sent_frames())
                                      if isinstance(f, dict) and f.get("kind") == "end"][0]]
                t_b_say = sb.received_at[[i for i, f in enumerate(sb.frames)
                                          if isinstance(f, dict) and f.get("msg_id") == "b1"][0]]
                check(t_b_say >= t_a_end, "B's say reached the app before A's reply ended")
            with step("the dialog kept both turns: the next say carries all four params"):
                await a.say("Any seats left?", "a2", "trip")
                await reply(a, "a2")
                cg = chatgate_of(await wait_say(sa, "a2"), "a2")
                check(cg["params"] == WANT2, f"params {short(cg['params'])}, expected {WANT2}")
            await a.close()
            await b.close()


async def part_rate_limit():
    async with ChatApp(chunk_interval=0.01) as app:
        async with gateway(app, "gateway:rate", rate_limit={"messages_per_second": 1, "burst": 3}) as gw:
            sid = await login(app)
            client = await connect(gw.ws_url("/socket"), sid)
            sess = await app.next_session(0)
            with step("10 says at once with rate_limit 1/s burst 3: at most 4 reach the app, the rest "
                      "are counted in chatgate_rate_limited_total; typing frames still pass"):
                for i in range(10):
                    await client.say(f"hello {i}", f"r{i}", "trip")
                await client.typing("trip")
                ok = await harness.wait_until(lambda: any(isinstance(f, dict) and f.get("kind") == "typing"
                                                          for f in sess.frames), 5)
                check(ok, "the typing frame after the says did not reach the app")
                await asyncio.sleep(0.3)  # a silence: a say forwarded past the limit would come now
                n = len(sess.says)
                check(1 <= n <= 4, f"the app got {n} says of 10 (rate 1/s, burst 3)")
                m = await metrics(gw)
                check(m.value("chatgate_rate_limited_total") >= 6,
                      f"chatgate_rate_limited_total is {m.value('chatgate_rate_limited_total')}")
                gw.assert_alive()
            with step("after a pause the client's says are forwarded again"):
                await asyncio.sleep(1.2)  # the subject: the rate limit's window (rate 1/s) refills
                await client.say("hello again", "r10", "trip")
                r = await reply(client, "r10")
                check(r.kind == "end", f"reply {shorts(r.frames)}")
            await client.close()


async def part_queue_bound():
    async with ChatApp(chunk_interval=0.3) as app:
        async with gateway(app, "gateway:queue", queue_limit=2) as gw:
            a, b, sa, sb = await two_tabs(app, gw)
            with step("while tab A's turn holds the dialog, tab B's says wait for it: queue_limit 2 of 5 "
                      "are kept, the others refused"):
                await a.say("Tell me a story", "a1", "trip")
                await wait_say(sa, "a1")
                for i in range(5):
                    await b.say(f"hi {i}", f"q{i}", "trip")
                await reply(a, "a1")
                await asyncio.sleep(1.0)  # a silence: a third say of B's would come now
                got = [s.get("msg_id") for s in sb.says]
                check(got == ["q0", "q1"], f"the app got B's says {got}, expected ['q0', 'q1']")
                m = await metrics(gw)
                check(m.value("chatgate_rate_limited_total") >= 3, "the refused says should be counted")
            await a.close()
            await b.close()


# ------------------------------------------------------------------------------------- 10


async def part_refused():
    async with ChatApp() as app:
        async with gateway(app, "gateway:refused", auth="header") as gw:
            with step("--auth header, no X-User-Id: the drop-in client is closed with 1008 'unauthorized'"):
                client = await connect(gw.ws_url("/socket"), "whatever")
                code, reason, frames = await client.wait_closed(5)
                check(code == 1008, f"expected close 1008, got {code} {reason!r} (frames {shorts(frames)})")
                check(not app.sessions, "a refused client must not get an app connection")
                m = await metrics(gw)
                check(m.value("chatgate_unauthorized_total") == 1, "chatgate_unauthorized_total should be 1")
            with step("with the header the same client is served"):
                client = await connect(gw.ws_url("/socket"), await login(app), headers={"X-User-Id": "u1"})
                await client.say("hello", "c2")
                r = await reply(client, "c2")
                check(r.kind == "end", f"reply {shorts(r.frames)}")
                await client.close()


# ------------------------------------------------------------------------------------- 15


def raw_close(port, path, payload, headers=()):
    """Opens a WebSocket by hand, sends one close frame with `payload`, and returns the close
    code the gateway answers with (None: no close frame; bytes: a payload under 2 bytes)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    try:
        key = base64.b64encode(os.urandom(16)).decode()
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers)
        s.sendall((f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
                   f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n"
                   f"{extra}\r\n").encode())
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = s.recv(4096)
            if not chunk:
                return "no handshake"
            data += chunk
        head, data = data.split(b"\r\n\r\n", 1)
        status = head.split(b"\r\n")[0]
        if b" 101 " not in status:
            return f"handshake: {status!r}"
        time.sleep(0.2)  # past the gateway's first frames (a hello on /ws)
        mask = os.urandom(4)
        s.sendall(bytes([0x88, 0x80 | len(payload)]) + mask +
                  bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            try:
                chunk = s.recv(65536)
            except socket.timeout:
                break
            if not chunk:
                break
            data += chunk
        while len(data) >= 2:
            op, n, off = data[0] & 0x0F, data[1] & 0x7F, 2
            if n == 126:
                n, off = struct.unpack(">H", data[2:4])[0], 4
            elif n == 127:
                n, off = struct.unpack(">Q", data[2:10])[0], 10
            body, data = data[off:off + n], data[off + n:]
            if op == 8:
                return struct.unpack(">H", body[:2])[0] if len(body) >= 2 else body
        return None
    finally:
        s.close()


CLOSE_CASES = [("a 1-byte payload", b"\x03", 1002), ("code 5000", struct.pack(">H", 5000), 1002),
               ("code 65535", struct.pack(">H", 65535), 1002), ("code 1005", struct.pack(">H", 1005), 1002),
               ("code 2999", struct.pack(">H", 2999), 1002), ("code 999", struct.pack(">H", 999), 1002),
               ("code 4999 'bye'", struct.pack(">H", 4999) + b"bye", 4999),
               ("code 1000", struct.pack(">H", 1000), 1000)]


async def part_close_frames():
    async with ChatApp() as app:
        async with gateway(app, "gateway:close") as gw:
            sid = await login(app)
            where = [("a chatgate.v1 client", "/ws", ()),
                     ("a drop-in client", "/socket", (("Cookie", f"sid={sid}"),
                                                      ("Sec-WebSocket-Protocol", "chat.v2")))]
            for who, path, headers in where:
                with step(f"{who} sends close frames (each on its own connection): "
                          + ", ".join(f"{what} -> {want}" for what, _, want in CLOSE_CASES)):
                    wrong = []
                    for what, payload, want in CLOSE_CASES:
                        got = await asyncio.to_thread(raw_close, gw.port, path, payload, headers)
                        if got != want:
                            wrong.append(f"{what}: answered with {got!r}, expected {want}")
                    check(not wrong, "; ".join(wrong))
            gw.assert_alive()
            with step("the app closes with code 5000 (invalid): the client gets 1011, not 5000"):
                client = await connect(gw.ws_url("/socket"), sid)
                await client.say("hi", "c1")
                await reply(client, "c1")
                sess = app.sessions[-1]
                sess.ws.transport.write(b"\x88\x02" + struct.pack(">H", 5000))
                code, reason, frames = await client.wait_closed(5)
                check(code == 1011, f"expected close 1011, got {code} {reason!r}")
            gw.assert_alive()


async def part_big_cookie():
    """Big cookies are common (analytics, SSO): the app must get the client's whole Cookie
    header and the gateway must find its session cookie in it, not drop both past 4 KiB."""
    async with ChatApp() as app:
        async with gateway(app, "gateway:big-cookie") as gw:
            sid = await login(app)
            with step("a 4,100-byte Cookie header with the sid last (over the 4,096 the gateway once copied; "
                      "as long as the app, on python-websockets' legacy server, takes): the app sees it whole"):
                tail = f"; sid={sid}"
                cookie = "prefs=" + "p" * (4100 - len("prefs=") - len(tail)) + tail
                client = await connect(gw.ws_url("/socket"), cookie=cookie)
                await client.say("hi", "bc1")
                await reply(client, "bc1")
                sess = app.sessions[-1]
                got = sess.headers.get("cookie") or ""
                check(got == cookie, f"the app got a Cookie of {len(got)} bytes, expected {len(cookie)}")
                check(sess.sid == sid, f"the app found sid {sess.sid!r}, expected {sid!r}")
                await client.close()
            with step("a query argument of 2,000 bytes (over the 1 KiB the gateway once copied) reaches the app whole"):
                query = "q=" + "x" * 2000 + "&session=demo"
                client = await connect(gw.ws_url("/socket") + "?" + query, sid)
                await client.say("hi", "bq1")
                await reply(client, "bq1")
                sess = app.sessions[-1]
                check(sess.path == "/socket?" + query,
                      f"the app's path is {len(sess.path)} bytes: {sess.path[:40]!r}...{sess.path[-30:]!r}")
                await client.close()
            gw.assert_alive()


async def part_silent_app():
    """A mapping without an end marker (or an app that never ends a reply) must not hold the
    dialog's lock for ever: the turn ends after dropin.turn_timeout_ms of silence."""
    async with ChatApp(chunk_interval=0.01) as app:
        cfg = config(app.url)
        cfg["dropin"]["app_frames"] = {"text": "/body", "id": "/reply_to"}  # no end, no cancelled
        cfg["dropin"]["turn_timeout_ms"] = 500
        async with Gateway(config=cfg, env=ENV, name="gateway:silent-app") as gw:
            a, b, sa, sb = await two_tabs(app, gw)
            with step("tab A's turn never sees an end marker; tab B's say in the same room still reaches "
                      "the app once A's reply has been quiet for turn_timeout_ms (500)"):
                await a.say(FLIGHT1, "s1", "trip")
                await wait_say(sa, "s1")
                await reply(a, "s1")  # the app's end frame is relayed, but the mapping does not know it
                await b.say(FLIGHT2, "s2", "trip")
                cg_b = chatgate_of(await wait_say(sb, "s2", 5), "s2")
                check(cg_b["params"] == WANT2, f"B's say should carry A's turn too: {short(cg_b['params'])}")
            await a.close()
            await b.close()
            gw.assert_alive()


async def part_app_still_answering():
    """A reply with no end marker ends after a silence, not a time from its start: frames
    100 ms apart for 2 s keep a turn of turn_timeout_ms and reply_gap_ms 400 alive (each
    frame moves the bound on without restarting the timer; the timer, firing early, waits out
    the rest)."""
    async with ChatApp(chunk_interval=0.1) as app:
        cfg = config(app.url)
        cfg["dropin"]["app_frames"] = {"text": "/body", "id": "/reply_to"}  # no end: the silence ends it
        cfg["dropin"]["turn_timeout_ms"] = 400
        cfg["dropin"]["reply_gap_ms"] = 400
        async with Gateway(config=cfg, env=ENV, name="gateway:still-answering") as gw:
            a, b, sa, sb = await two_tabs(app, gw)
            with step("tab A's reply streams 20 frames 100 ms apart: tab B's say in the same room waits for "
                      "it all, reaching the app 2 s to 3.5 s after A's"):
                await a.say("Tell me a long story about trains", "l1", "trip")
                await wait_say(sa, "l1")
                started = time.monotonic()
                await b.say(FLIGHT2, "l2", "trip")
                await wait_say(sb, "l2", 6)
                waited = time.monotonic() - started
                check(1.9 <= waited <= 3.5, f"B's say reached the app {waited:.2f} s after A's: A's turn should "
                                            "last its 2 s of frames plus a 400 ms silence")
                print(f"   B's say reached the app {waited:.2f} s after A's")
            await a.close()
            await b.close()
            gw.assert_alive()


async def part_path_encoded():
    """Issue 35, defect 7: lws hands the client's path decoded; the gateway forwarded it so
    (`/socket/a%20b` reached the app as `GET /socket/a b HTTP/1.1`, %09 a raw TAB, %3F the
    start of a query). The app must get the path as the client meant it, encoded again."""
    lines = []

    async def first_line(reader, writer):
        lines.append((await reader.readline()).decode("latin-1").rstrip("\r\n"))
        writer.close()

    server = await asyncio.start_server(first_line, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        cfg = config(f"ws://127.0.0.1:{port}")
        async with Gateway(config=cfg, env=ENV, name="gateway:path") as gw:
            with step("a client at /socket/a%20b%09c%3Fd%25e?x=1: the app's request line is "
                      "GET /socket/a%20b%09c%3Fd%25e?x=1 HTTP/1.1"):
                # the app here reads the request line and hangs up: the client's handshake is
                # answered 502 (it waits for the app's), which is not what is checked
                try:
                    client = await ChatClient.connect(gw.ws_url("/socket/a%20b%09c%3Fd%25e") + "?x=1", "s1")
                    await client.close()
                except websockets.InvalidStatusCode:
                    pass
                ok = await harness.wait_until(lambda: lines, 5)
                check(ok, "the app got no request")
                check(lines[0] == "GET /socket/a%20b%09c%3Fd%25e?x=1 HTTP/1.1", f"the app's request line: {lines[0]!r}")
            gw.assert_alive()
    finally:
        server.close()


async def read_upgrade_key(reader):
    """A raw app's side: reads a WebSocket upgrade's head; its Sec-WebSocket-Key, or None when
    the connection ended first."""
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = await reader.read(4096)
        if not chunk:
            return None
        head += chunk
    return next(l.split(b":", 1)[1].strip() for l in head.split(b"\r\n") if l.lower().startswith(b"sec-websocket-key:"))


def switching(key):
    """A raw app's 101 to the upgrade with `key`, taking the subprotocol chat.v2."""
    accept = base64.b64encode(hashlib.sha1(key + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest())
    return (b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            b"Sec-WebSocket-Protocol: chat.v2\r\nSec-WebSocket-Accept: " + accept + b"\r\n\r\n")


async def part_client_leaves_during_hold():
    """Issue 35, item 9: the client's handshake waits for the app's. A client that leaves
    while the app is slow to answer must not leave the app's connection behind: once the app
    answers, the gateway finds the client gone and closes the app's connection."""
    events = []

    async def slow_app(reader, writer):
        key = await read_upgrade_key(reader)
        if key is None:
            return
        events.append(("request", time.monotonic()))
        await asyncio.sleep(1.0)  # the client leaves meanwhile
        writer.write(switching(key))
        await writer.drain()
        events.append(("101", time.monotonic()))
        rest = await reader.read(4096)  # a close frame (masked, opcode 8), or EOF
        events.append(("closed" if not rest or rest[0] & 0x0F == 8 else "frame", time.monotonic()))
        writer.close()

    server = await asyncio.start_server(slow_app, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with Gateway(config=config(f"ws://127.0.0.1:{port}"), env=ENV, name="gateway:hold-leave") as gw:
            with step("the app answers its handshake 1 s late; the client gives up after 0.3 s: once the app has "
                      "answered, its connection is closed (a close frame or EOF) within 2 s"):
                s = socket.create_connection(("127.0.0.1", gw.port), timeout=5)
                key = base64.b64encode(os.urandom(16)).decode()
                s.sendall((f"GET /socket HTTP/1.1\r\nHost: 127.0.0.1:{gw.port}\r\nUpgrade: websocket\r\n"
                           f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n"
                           f"Sec-WebSocket-Protocol: chat.v2\r\nCookie: sid=x\r\n\r\n").encode())
                ok = await harness.wait_until(lambda: events, 5)
                check(ok, "the app got no handshake while the client waited")
                await asyncio.sleep(0.3)  # the scenario: the client leaves while the app's handshake waits
                s.close()
                ok = await harness.wait_until(lambda: any(e == "closed" for e, _ in events), 4)
                check(ok, f"the app's connection was not closed after the client left: {events}")
                t101 = next(t for e, t in events if e == "101")
                tclosed = next(t for e, t in events if e == "closed")
                check(tclosed - t101 < 2, f"closed {tclosed - t101:.2f} s after the app's 101")
            gw.assert_alive()
    finally:
        server.close()


def raw_upgrade(port, key, tail_apart=False, length=None):
    """A drop-in handshake written by hand on a new socket; with tail_apart the head's last
    byte goes 0.3 s after the rest; `length`: the head padded (its cookie) to that many bytes.
    Returns (the answer's status line, when it came)."""
    def head_of(cookie):
        return (f"GET /socket HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
                f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n"
                f"Sec-WebSocket-Protocol: chat.v2\r\nCookie: sid={cookie}\r\n\r\n").encode()
    head = head_of("x")
    if length:
        head = head_of("x" * (1 + length - len(head)))
    s = socket.create_connection(("127.0.0.1", port), timeout=8)
    try:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if tail_apart:
            s.sendall(head[:-1])
            time.sleep(0.3)  # the scenario: the head's last byte comes in a segment of its own
            s.sendall(head[-1:])
        else:
            s.sendall(head)
        data = s.recv(4096)
        return data.split(b"\r\n")[0], time.monotonic()
    finally:
        s.close()


async def part_app_answers():
    """Issue 35, item 9: the client is answered once the app has answered, with what the app
    answered. a. a head whose last byte comes apart from the rest is held too (the gateway
    took the "\r\n\r" out of the socket before, and so answered 101 before the app had);
    b. the app's refusal reaches the client with the app's status (404, 429, 500, 503), as a
    proxy passes it on (it was 502 for all but 401 and 403)."""
    answers = {"status": 101}
    events = []

    async def app(reader, writer):
        key = await read_upgrade_key(reader)
        if key is None:
            return
        await asyncio.sleep(0.5)  # an app slow to answer: the client must not be answered before it
        # the time of the answer is taken before it is written: once written, the gateway may
        # pass it on, and the client's thread see it, before this coroutine runs again
        events.append(time.monotonic())
        if answers["status"] == 101:
            writer.write(switching(key))
        else:
            writer.write(b"HTTP/1.1 %d Whatever\r\ncontent-length: 2\r\nconnection: close\r\n\r\nno" % answers["status"])
        await writer.drain()
        await reader.read(4096)
        writer.close()

    server = await asyncio.start_server(app, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with Gateway(config=config(f"ws://127.0.0.1:{port}"), env=ENV, name="gateway:app-answers") as gw:
            # 2049 bytes: its "\r\n\r" ends exactly where the listener's first buffer (2 KiB) does
            for apart, length in ((False, None), (True, None), (True, 2049)):
                with step(f"a. head {'with its last byte apart' if apart else 'in one write'}"
                          f"{f' ({length} bytes)' if length else ''}: 101 after the app's"):
                    events.clear()
                    key = base64.b64encode(os.urandom(16)).decode()
                    first, t = await asyncio.to_thread(raw_upgrade, gw.port, key, apart, length)
                    check(first.startswith(b"HTTP/1.1 101"), f"the client's handshake got {first!r}")
                    check(events and t >= events[0], "the client was answered before the app had answered")
            for status in (404, 429, 500, 503):
                with step(f"b. the app answers {status}: the client gets {status}"):
                    answers["status"] = status
                    key = base64.b64encode(os.urandom(16)).decode()
                    first, _ = await asyncio.to_thread(raw_upgrade, gw.port, key)
                    check(first.startswith(b"HTTP/1.1 %d " % status), f"the client's handshake got {first!r}")
            gw.assert_alive()
    finally:
        server.close()


async def part_held_count():
    """Issue 39's ninth round: drop-in clients held while their app is slow to answer its
    handshake (up to 40 s) hold two sockets each, but max_connections counted only open
    sessions: a flood of them got past it. They count now: with max_connections 3 and three
    clients held, a fourth client (drop-in or /ws) is answered 503."""
    apps = []

    async def silent_app(reader, writer):
        apps.append(writer)
        await read_upgrade_key(reader)  # and never answers
        await reader.read()

    server = await asyncio.start_server(silent_app, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    held = []
    try:
        async with Gateway(config={**config(f"ws://127.0.0.1:{port}"), "max_connections": 3}, env=ENV,
                           name="gateway:held-count") as gw:
            with step("three drop-in clients wait for a silent app's handshake; a fourth drop-in client, and a /ws "
                      "client, are answered 503 at once"):
                for _ in range(3):
                    s = socket.create_connection(("127.0.0.1", gw.port), timeout=5)
                    key = base64.b64encode(os.urandom(16)).decode()
                    s.sendall((f"GET /socket HTTP/1.1\r\nHost: 127.0.0.1:{gw.port}\r\nUpgrade: websocket\r\n"
                               f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n"
                               f"Sec-WebSocket-Protocol: chat.v2\r\nCookie: sid=x\r\n\r\n").encode())
                    held.append(s)
                ok = await harness.wait_until(lambda: len(apps) == 3, 5)
                check(ok, f"the app got {len(apps)} of the 3 held clients' connections")
                key = base64.b64encode(os.urandom(16)).decode()
                try:
                    first, _ = await asyncio.wait_for(asyncio.to_thread(raw_upgrade, gw.port, key), 3)
                except (asyncio.TimeoutError, socket.timeout):
                    first = b"(no answer within 3 s: held like the others)"
                check(first.startswith(b"HTTP/1.1 503"), f"a fourth drop-in client got {first!r}, expected 503")
                status = await harness.handshake_status(gw.ws_url("/ws"), open_timeout=3)
                check(status == 503, f"a /ws client got {status}, expected 503")
                await harness.wait_log(gw, r"0 connected and 3 drop-in clients waiting for the app's handshake", 3)
            gw.assert_alive()
    finally:
        for s in held:
            s.close()
        for w in apps:
            w.close()
        server.close()


async def main(args):
    await independent(part_held_count())
    await independent(part_client_leaves_during_hold())
    await independent(part_app_answers())
    await independent(part_path_encoded())
    await independent(part_long_id())
    await independent(part_two_tabs())
    await independent(part_rate_limit())
    await independent(part_queue_bound())
    await independent(part_refused())
    await independent(part_close_frames())
    await independent(part_big_cookie())
    await independent(part_silent_app())
    await independent(part_app_still_answering())


if __name__ == "__main__":
    harness.run(main, timeout=110)
