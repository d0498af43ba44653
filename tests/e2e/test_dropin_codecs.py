"""End-to-end tests of issue 13: drop-in in front of apps whose protocol is not ours, and
upstreams that need their own headers (docs/dropin.md; docs/upstreams.md, "Upstream headers").

The app is `RawApp` below, a WebSocket server of this process that speaks one of three
protocols, chosen per test, each as an app someone else wrote would:
  - "tornado": frames {"body", "_xsrf"} with no type field (Tornado's chat demo); it answers
    each with {"body": "part N"} frames 50 ms apart (10 for a text with "long", else 3), no
    id, no end marker; {"typing": true} is echoed;
  - "socket.io": Engine.IO v4 / Socket.IO v5 packets: its open packet, a ping the client must
    answer, CONNECT, then for each `42["chat message",text]` the bot's `42["bot message",
    "part N"]` events; a `42["cancel",...]` stops the bot;
  - "text": plain text frames both ways, "part N" replies.
It records the handshake's path and headers and every frame as it came.

- handshakes: the client's Origin and Host (with its port) reach the app exactly, as do its
  cookie and dropin.headers (one read from the environment, never in the log); `"host":
  "app"` sends the app's own host:port instead;
- a Tornado-style app: a chat message is marked by `{"pointer": "/body", "exists": true}`; the
  flight search's second turn reaches the app with the merged params in its chatgate object;
  replies without ids or end marker are relayed, and the quiet gap ends each reply for the
  history (the admin API's export has it); non-chat frames pass in order;
- a cancel phrase without a cancel_frame stops relaying that reply, and the hold ends by
  itself: the next message's reply is relayed whole (the client is never muted for good);
- socket.io: pings, open and CONNECT pass untouched; the chat event (marker "in") reaches the
  app with the chatgate object as its last argument and the flight params on the second
  turn; one with an ack id gets the object at the same place, its ack id kept (the callback
  comes after it); another namespace's event and a
  non-chat event pass untouched; the mapping's cancel_frame goes out as a socket.io event;
- text: a plain text frame is the message, forwarded as written; the reply is relayed;
- upstream headers: an OpenAI-compatible upstream gets upstreams.NAME.headers (one from the
  environment), `User-Agent: chatgate/VERSION`, `Host: 127.0.0.1:PORT` and no Origin; a ws
  upstream's handshake gets its headers, Host with the port and no Origin;
- mappings that cannot work and bad headers are refused at start (exit 2) with the reason.
"""

import asyncio
import json
import re

import websockets

import harness
from harness import Client, Gateway, check, independent, step

NOW = "2026-02-03T10:00:00Z"
FLIGHT1 = "Find me flights from Nairobi to London next week"
FLIGHT2 = "What about returning on Feb 20?"
WANT2 = {"from": "Nairobi", "to": "London", "departure_date": "2026-02-10", "return_date": "2026-02-20"}
SECRET = "s3cr3t-app-key-7f1d"
ADMIN = "admin-token-for-test"
T = harness.DEFAULT_TIMEOUT


class RawApp(harness.WsServer):
    """A chat app of someone else's protocol (see the module's docstring)."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.handshakes = []  # (path, {lower-cased header: value})
        self.frames = []      # every frame received, as it came (str or bytes)
        self.pongs = 0

    async def _handler(self, ws, path=None):
        self.handshakes.append((ws.path, {k.lower(): v for k, v in ws.request_headers.raw_items()}))
        streams = {}  # task -> its stop event: a cancel stops every reply streaming when it comes
        try:
            if self.kind == "socket.io":
                await ws.send('0{"sid":"eio1","upgrades":[],"pingInterval":25000,"pingTimeout":20000,'
                              '"maxPayload":1000000}')
                await ws.send("2")  # a ping: the client must answer "3"
            async for frame in ws:
                self.frames.append(frame)
                text = self.message_text(frame)
                if frame == "3":
                    self.pongs += 1
                elif frame == "40":
                    await ws.send('40{"sid":"sio1"}')
                elif self.kind == "socket.io" and frame.startswith('42["cancel"'):
                    for stop in streams.values():
                        stop.set()
                elif isinstance(frame, str) and frame.startswith('{"typing"'):
                    await ws.send(frame)
                elif self.kind == "upstream":  # chatgate's own ws upstream protocol: answered at once
                    msg = json.loads(frame)
                    await ws.send(json.dumps({"type": "done", "id": msg.get("id"), "text": "ok"}))
                    continue
                if text is not None:
                    stop = asyncio.Event()
                    streams[asyncio.create_task(self.stream(ws, text, stop))] = stop
        except websockets.ConnectionClosed:
            pass
        finally:
            for task in streams:
                task.cancel()

    def message_text(self, frame):
        """The chat text of a client frame in this app's protocol, or None."""
        if isinstance(frame, bytes):
            return None
        if self.kind == "text":
            return frame
        if self.kind == "upstream":
            return None
        if self.kind == "socket.io":
            m = re.match(r"42(\d*)(\[.*)$", frame, re.S)
            if not m:
                return None
            event = json.loads(m.group(2))
            return event[1] if event[0] in ("chat message", "ask") else None
        obj = json.loads(frame)
        return obj.get("body") if isinstance(obj, dict) else None

    def reply_frame(self, n):
        if self.kind == "text":
            return f"part {n}"
        if self.kind == "socket.io":
            return "42" + json.dumps(["bot message", f"part {n}"], separators=(",", ":"))
        return json.dumps({"body": f"part {n}"})

    async def stream(self, ws, text, stop):
        for n in range(1, (10 if "long" in text else 3) + 1):
            if stop.is_set():
                return
            await ws.send(self.reply_frame(n))
            await asyncio.sleep(0.05)  # the fake app's pace between reply frames

    def chat_frames(self):
        return [f for f in self.frames if isinstance(f, str) and self.message_text(f) is not None]


def dropin_config(app, path, codec, client=None, app_frames=None, **extra):
    dropin = {"path": path, "app": app.url("/chat"), "codec": codec, "reply_gap_ms": 400}
    if client is not None:
        dropin["client"] = client
    if app_frames is not None:
        dropin["app_frames"] = app_frames
    dropin.update(extra)
    return {"upstreams": {"demo": "demo"}, "log_level": "info",
            "rate_limit": {"messages_per_second": 1000, "burst": 1000}, "dropin": dropin}


# the bot answers in the chat's own frames: one-to-one, so every frame with a body is the
# reply (app_frames.reply; without it a cancel holds nothing back: in a chat between people
# those frames could be anyone's, issue 35)
TORNADO = {"client": {"chat": {"pointer": "/body", "exists": True}, "text": "/body"},
           "app_frames": {"text": "/body", "reply": {"pointer": "/body", "exists": True}}}
SOCKETIO = {"client": {"chat": {"pointer": "/0", "in": ["chat message", "ask"]}, "text": "/1"},
            "app_frames": {"reply": {"pointer": "/0", "equals": "bot message"}, "text": "/1",
                           "cancel_frame": ["cancel", "{id}"]}}


def gateway(cfg, name, **env):
    return Gateway(config=cfg, env={"CHATGATE_NOW": NOW, "CHATGATE_ADMIN_TOKEN": ADMIN, **env}, name=name)


async def recv_until(ws, want, timeout=T, what=""):
    """Frames from ws until one for which want(frame) holds: (that frame, all of them)."""
    got = []
    try:
        while True:
            frame = await asyncio.wait_for(ws.recv(), timeout)
            got.append(frame)
            if want(frame):
                return frame, got
    except (asyncio.TimeoutError, websockets.ConnectionClosed) as err:
        harness.fail(f"{what}: {err!r}; frames so far: {[harness.brief(f, 120) for f in got[-8:]]}")


async def quiet_frames(ws, seconds):
    """Whatever comes on ws within seconds."""
    got = []
    try:
        while True:
            got.append(await asyncio.wait_for(ws.recv(), seconds))
    except asyncio.TimeoutError:
        return got


async def wait_app(cond, what):
    check(await harness.wait_until(cond, T), f"the app never got {what}")


# --------------------------------------------------------------------------------------


async def part_handshake():
    async with RawApp("tornado") as app:
        cfg = dropin_config(app, "/chatsocket", "json", **TORNADO, host="client",
                            forward_headers=["Cookie"],
                            headers={"X-App-Key": {"env": "TEST_APP_KEY"}, "X-Tenant": "acme"})
        async with gateway(cfg, "handshake", TEST_APP_KEY=SECRET) as gw:
            with step('"host": "client": the client\'s Origin and Host (with its port) reach the app exactly, '
                      "with the cookie and dropin.headers"):
                origin = f"http://127.0.0.1:{gw.port}"
                ws = await websockets.connect(gw.ws_url("/chatsocket?room=1"), origin=origin,
                                              extra_headers={"Cookie": "session=abc"})
                await wait_app(lambda: app.handshakes, "a handshake")
                path, headers = app.handshakes[-1]
                check(headers.get("origin") == origin,
                      f"Origin should reach the app as {origin!r}, it got {headers.get('origin')!r}")
                check(headers.get("host") == f"127.0.0.1:{gw.port}",
                      f"Host should be the client's, 127.0.0.1:{gw.port}, the app got {headers.get('host')!r}")
                check(headers.get("cookie") == "session=abc", f"Cookie: {headers.get('cookie')!r}")
                check(headers.get("x-app-key") == SECRET and headers.get("x-tenant") == "acme",
                      f"dropin.headers should reach the app: {headers}")
                check(path == "/chat/chatsocket?room=1", f"path {path!r}")
                await ws.close()
            with step("the configured header's secret value is nowhere in the gateway's log"):
                log = gw.log_path.read_text()
                check(SECRET not in log, "the log holds the header's secret value")
                check("X-App-Key" in log, "the log should name the configured headers (names only)")
    async with RawApp("tornado") as app:
        cfg = dropin_config(app, "/chatsocket", "json", **TORNADO)
        async with gateway(cfg, "host-app") as gw:
            with step('no "host" ("app", the default): the app gets its own host:port as Host; no Origin when the '
                      'client sent none'):
                ws = await websockets.connect(gw.ws_url("/chatsocket"))
                await wait_app(lambda: app.handshakes, "a handshake")
                headers = app.handshakes[-1][1]
                check(headers.get("host") == f"127.0.0.1:{app.port}", f"Host {headers.get('host')!r}")
                check("origin" not in headers, f"no Origin was sent by the client, the app got {headers.get('origin')!r}")
                await ws.close()


async def part_tornado():
    async with RawApp("tornado") as app:
        cfg = dropin_config(app, "/chatsocket", "json", **TORNADO)
        async with gateway(cfg, "tornado") as gw:
            ws = await websockets.connect(gw.ws_url("/chatsocket"), origin=f"http://127.0.0.1:{gw.port}")
            with step("frames without a type field: {\"body\"} marked by \"exists\"; the flight search's second "
                      "turn carries the merged params; replies without id or end are relayed"):
                await ws.send(json.dumps({"body": FLIGHT1, "_xsrf": "x1"}))
                await recv_until(ws, lambda f: json.loads(f).get("body") == "part 3", what="reply 1")
                await ws.send(json.dumps({"typing": True}))
                await ws.send(json.dumps({"body": FLIGHT2, "_xsrf": "x2"}))
                echo, got = await recv_until(ws, lambda f: json.loads(f).get("body") == "part 3", what="reply 2")
                check(json.loads(got[0]) == {"typing": True}, f"the typing frame should come back first: {got}")
                chats = app.chat_frames()
                check(len(chats) == 2, f"the app should have 2 chat frames: {chats}")
                first = json.loads(chats[0])
                check(first.get("_xsrf") == "x1" and first.get("body") == FLIGHT1,
                      f"the app's own fields pass unchanged: {first}")
                cg = json.loads(chats[1]).get("chatgate")
                check(isinstance(cg, dict), f"no chatgate object in {chats[1]}")
                check(cg.get("service") == "travel" and all(cg["params"].get(k) == v for k, v in WANT2.items()),
                      f"the second turn should carry service travel and {WANT2}: {cg}")
                user = cg["user"]
            with step("the quiet gap ended each reply for the history (admin export)"):
                await asyncio.sleep(0.6)  # the subject: the quiet gap (reply_gap_ms) ends each reply
                status, _, body = await asyncio.to_thread(
                    harness.http_request, f"{gw.http_url}/admin/dialogs/{user}/default",
                    headers={"Authorization": f"Bearer {ADMIN}"})
                check(status == 200, f"admin export: {status} {body[:200]!r}")
                history = json.loads(body)["state"].get("history", [])
                replies = [h.get("content") for h in history if h.get("role") == "assistant"]
                check(replies == ["part 1part 2part 3"] * 2,
                      f"each reply should be in the history, ended by the gap: {history}")
            with step("a cancel phrase without a cancel_frame: the rest of that reply is not relayed"):
                await ws.send(json.dumps({"body": "tell me a long story"}))
                await recv_until(ws, lambda f: json.loads(f).get("body") == "part 2", what="long reply")
                await ws.send(json.dumps({"body": "stop"}))
                sent_at = len(app.frames)
                await wait_app(lambda: len(app.frames) > sent_at, "the stop message")
                late = await quiet_frames(ws, 1.0)
                parts = [json.loads(f)["body"] for f in late]
                check(not any(p in ("part 6", "part 7", "part 8", "part 9", "part 10") for p in parts),
                      f"later parts of the cancelled reply reached the client: {parts}")
            with step("... and the hold ends by itself: the next message's reply is relayed whole"):
                await ws.send(json.dumps({"body": "hello again"}))
                _, got = await recv_until(ws, lambda f: json.loads(f).get("body") == "part 3", what="next reply")
                check([json.loads(f)["body"] for f in got][-3:] == ["part 1", "part 2", "part 3"],
                      f"the whole reply should come: {got}")
                check("the cancelled reply is over" in gw.log_path.read_text(),
                      "the end of the hold should be logged")
            await ws.close()


async def part_socketio():
    async with RawApp("socket.io") as app:
        cfg = dropin_config(app, "/socket.io/", "socket.io", **SOCKETIO)
        async with gateway(cfg, "socket.io") as gw:
            ws = await websockets.connect(gw.ws_url("/socket.io/?EIO=4&transport=websocket"))
            with step("socket.io: the open packet and a ping pass untouched; CONNECT and its answer too"):
                opened = await asyncio.wait_for(ws.recv(), T)
                check(opened.startswith('0{"sid":"eio1"'), f"open packet: {opened!r}")
                ping = await asyncio.wait_for(ws.recv(), T)
                check(ping == "2", f"ping: {ping!r}")
                await ws.send("3")
                await ws.send("40")
                await recv_until(ws, lambda f: f.startswith("40{"), what="CONNECT answer")
                check(app.pongs == 1 and "40" in app.frames, f"app frames: {app.frames}")
            with step("socket.io: the chat event reaches the app with the chatgate object as its last argument; "
                      "the second turn carries the flight params; the bot's events are relayed"):
                await ws.send('42["chat message",' + json.dumps(FLIGHT1) + "]")
                await recv_until(ws, lambda f: f == '42["bot message","part 3"]', what="bot reply 1")
                await ws.send('42["typing",true]')
                await ws.send('42/admin,["chat message","not ours"]')
                await ws.send('42["ask",' + json.dumps(FLIGHT2) + "]")
                await recv_until(ws, lambda f: f == '42["bot message","part 3"]', what="bot reply 2")
                await ws.send('427["ask","with an ack"]')
                await recv_until(ws, lambda f: f == '42["bot message","part 3"]', what="bot reply 3")
                chats = app.chat_frames()
                check(len(chats) == 3, f"three chat events: {chats}")
                first = re.match(r"42(\[.*)$", chats[0], re.S)
                event = json.loads(first.group(1))
                check(event[0] == "chat message" and event[1] == FLIGHT1 and isinstance(event[2], dict)
                      and "params" in event[2], f"first chat event at the app: {chats[0][:300]}")
                acked = re.match(r"427(\[.*)$", chats[2], re.S)
                acked = json.loads(acked.group(1)) if acked else None
                check(acked and acked[:2] == ["ask", "with an ack"] and len(acked) == 3 and isinstance(acked[2], dict)
                      and "params" in acked[2],
                      f"an event with an ack id reaches the app with its ack id and the chatgate object after its "
                      f"argument: {chats[2][:120]}")
                cg = json.loads(chats[1][2:])[2]
                check(cg.get("service") == "travel" and all(cg["params"].get(k) == v for k, v in WANT2.items()),
                      f"the second turn should carry {WANT2}: {cg}")
            with step("socket.io: a non-chat event and another namespace's event pass untouched, in order"):
                i = app.frames.index('42["typing",true]')
                check(app.frames[i + 1] == '42/admin,["chat message","not ours"]',
                      f"frames at the app: {app.frames[i:i + 3]}")
            with step("socket.io: a cancel phrase sends the mapping's cancel_frame as an event, and the bot stops"):
                await ws.send('42["chat message","a long answer please"]')
                await recv_until(ws, lambda f: f == '42["bot message","part 2"]', what="long reply")
                await ws.send('42["chat message","stop"]')
                await wait_app(lambda: any(f.startswith('42["cancel"') for f in app.frames), "a cancel event")
                late = await quiet_frames(ws, 0.8)
                check('42["bot message","part 10"]' not in late, f"the reply went on: {late}")
            await ws.close()


async def part_text():
    async with RawApp("text") as app:
        cfg = dropin_config(app, "/text", "text", app_frames={"reply": {"every_text_frame": True}})
        async with gateway(cfg, "text") as gw:
            ws = await websockets.connect(gw.ws_url("/text"))
            with step("text codec: a plain text frame is the message, forwarded as written; the reply is relayed"):
                await ws.send(FLIGHT1)
                await recv_until(ws, lambda f: f == "part 3", what="text reply")
                check(app.frames == [FLIGHT1], f"the app should get the text as written: {app.frames}")
            with step("text codec: a cancel phrase holds the rest of a long reply, then the next reply comes whole"):
                await ws.send("a long one")
                await recv_until(ws, lambda f: f == "part 2", what="long text reply")
                await ws.send("stop")
                late = await quiet_frames(ws, 1.0)
                check("part 10" not in late, f"the cancelled reply was relayed: {late}")
                await ws.send("again")
                await recv_until(ws, lambda f: f == "part 3", what="the next reply")
            with step("text codec: a message sent just after a stopped reply, inside the reply gap, gets its whole "
                      "reply (the hold ends when a later message goes to the app)"):
                await ws.send("another long one")
                await recv_until(ws, lambda f: f == "part 2", what="long text reply")
                await ws.send("stop")
                await asyncio.sleep(0.3)  # the stopped reply still streams; its last frame is within the gap
                await ws.send("and now?")
                got = await quiet_frames(ws, 1.2)
                # the stopped reply's last parts may come too: with no ids, the two cannot be told apart
                check([f for f in got if f in ("part 1", "part 2", "part 3")] == ["part 1", "part 2", "part 3"],
                      f"the reply to the message after the cancel should come whole: {got}")
            await ws.close()


async def part_upstream_headers():
    fake = harness.FakeOpenAI()
    await fake.start()
    try:
        async with RawApp("upstream") as app:
            llm = harness.openai_upstream(fake, "ok")
            llm["headers"] = {"x-portkey-api-key": {"env": "TEST_PORTKEY_KEY"}, "x-portkey-provider": "openai"}
            wsup = {"url": app.url("/app"), "headers": {"X-App-Key": "k1", "Origin": "https://chat.example"}}
            cfg = harness.make_config({"llm": llm, "wsapp": wsup}, "llm")
            async with Gateway(config=cfg, env={"TEST_PORTKEY_KEY": SECRET}, name="upstream-headers") as gw:
                client = await Client.connect(gw)
                with step("an OpenAI-compatible upstream gets its headers, User-Agent chatgate/VERSION, Host with "
                          "the port, no Origin"):
                    n = len(fake.requests)
                    turn = await client.message("hello there", mid="h1")
                    turn.expect_done()
                    req = await fake.next_request("ok", after=n)
                    h = req.headers
                    check(h.get("x-portkey-api-key") == SECRET and h.get("x-portkey-provider") == "openai",
                          f"the configured headers: {h}")
                    check(re.fullmatch(r"chatgate/\d+\.\d+\.\d+", h.get("user-agent", "")),
                          f"User-Agent should be chatgate/VERSION: {h.get('user-agent')!r}")
                    check(h.get("host") == f"127.0.0.1:{fake.port}", f"Host {h.get('host')!r}")
                    check("origin" not in h, f"an API POST must carry no Origin: {h.get('origin')!r}")
                with step("the secret is not in the log"):
                    check(SECRET not in gw.log_path.read_text(), "the log holds the header's secret")
            cfg["default_upstream"] = "wsapp"
            async with Gateway(config=cfg, env={"TEST_PORTKEY_KEY": SECRET}, name="upstream-headers-ws") as gw:
                client = await Client.connect(gw)
                with step("a ws upstream's handshake gets its headers (an Origin only when configured), Host with "
                          "the port"):
                    turn = await client.message("hi app", mid="w1")
                    turn.expect_done()
                    check(app.handshakes, "the app got no handshake")
                    h = app.handshakes[-1][1]
                    check(h.get("x-app-key") == "k1" and h.get("origin") == "https://chat.example",
                          f"configured headers: {h}")
                    check(h.get("host") == f"127.0.0.1:{app.port}", f"Host {h.get('host')!r}")
    finally:
        await fake.stop()


async def part_config():
    cases = [
        ("dropin.app_frames.id", dict(client={"chat": {"pointer": "/body", "exists": True}, "text": "/body"},
                                      app_frames={"id": "/re"}), "no id"),
        ("dropin.client.text", dict(client={"text": "/body"}), "text codec"),
        ("dropin.client.chat", dict(client={"chat": {"pointer": "/k", "equals": 1, "exists": True},
                                            "text": "/t"}), "must be"),
        ("dropin.headers.Host", dict(**TORNADO, headers={"Host": "x"}), "itself"),
        ("dropin.headers.X-Key", dict(**TORNADO, headers={"X-Key": {"env": "CHATGATE_TEST_UNSET_VAR"}}),
         "not set"),
        ("dropin.headers.X-Key", dict(**TORNADO, headers={"X-Key": "a\r\nInjected: 1"}), "one line"),
        ("dropin.state_key", dict(**SOCKETIO, state_key="chatgate_state"), "json codec"),
        ("dropin.headers.X-Key", dict(**TORNADO, headers={"X-Key": ""}), "1 to 4096 bytes"),
        ("dropin.app_frames.cancel_frame", dict(client=SOCKETIO["client"],
                                                app_frames={"text": "/1", "cancel_frame": {"kind": "x"}}),
         "event array"),
    ]
    for where, dropin, why in cases:
        codec = "text" if where == "dropin.client.text" else \
            "socket.io" if "cancel_frame" in where or "state_key" in where else "json"
        with step(f"{where}: refused at start (exit 2) with the reason ({why!r})"):
            cfg = dropin_config(harness.WsServer(), "/x", codec)
            cfg["dropin"]["app"] = "ws://127.0.0.1:9/chat"
            cfg["dropin"].update(dropin)
            await harness.check_refused(cfg, where, why)


async def main(args):
    await independent(part_handshake())
    await independent(part_tornado())
    await independent(part_socketio())
    await independent(part_text())
    await independent(part_upstream_headers())
    await independent(part_config())


if __name__ == "__main__":
    harness.run(main, timeout=100)
