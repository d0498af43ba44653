"""Issue 35, defects 1-3: in drop-in mode the app must be able to trust what it reads as a chat
message. A message the gateway refused never reaches it, the chatgate object it reads is always
the gateway's, and a frame the app's own parser reads as a chat message is one the gateway read
as such too (or refused). Each part below, with how it failed on main 63bc085:

- part_user_limit: json codec (test_dropin.config()), limits.messages_per_minute 2, six says:
  exactly the first two reach the app, each with the chatgate object; a typing frame after them
  still passes. Failed: all six reached the app, the four refused ones as the client wrote them.
- part_rate_and_queue: rate_limit 1/s burst 2, eight says at once: at most three reach the app;
  queue_limit 1 and two tabs (one cookie, one conversation): of the second tab's four says sent
  while the first tab's turn holds the dialog, only the one the queue keeps reaches the app;
  every say the app gets carries the object. (Those two refusals come on arrival and were
  already dropped before issue 35: these steps passed on 63bc085 and guard the new drop path.)
  Then rate_limit and messages_per_minute 1 together: one say of eight reaches the app. Failed:
  the say the user's limit refused reached the app without the object.
- part_params_cap: params_cap 80: the flight sentence's params (73 bytes as the store counts
  them) go; the return date would pass the cap: that say never reaches the app, and the next
  say carries the dialog's params unchanged. Failed: the say was forwarded, with "error":
  {"code": "too_large", ...} in its chatgate object.
- part_draining: SIGTERM while a drop-in reply streams (the drain waits for it): a say sent
  during the drain never reaches the app, neither at once nor when the reply in flight ends
  (turn.c, turns_accept: refused on arrival, the frame dropped by the adapter), a typing frame
  after it does, and the refusal is logged; exit 0. Guards the refusal at shutdown of defect
  1's list (it held on 63bc085 too): without it the say would wait behind the reply and go to
  the app at its end.
- part_forged_json: a say carrying its own "chatgate": {"user": "admin", ...} reaches the app
  with the gateway's object (this passed before); a typing frame carrying one reaches the app
  without it. Failed: the typing frame passed with the client's object. Issue 39's eighth
  round: the client's own cancel (halt) carrying one reaches the app without it, and say and
  typing frames carrying a "chatgate_state" (the app's state_key: an app that echoes a
  client's frame would hand it back as the app's directive) reach it without that. Failed:
  the halt and the chatgate_state passed as the client wrote them.
- part_chat_and_cancel: a mapping whose cancel marker ("/cancel" exists) a chat message can
  carry too: such a say is a chat message, and reaches the app with the object. Failed: it
  was taken for a cancel and passed as written, past the rules, limits and lock.
- part_forged_socketio: a fake socket.io app (`SioApp`: socket.io-parser 4.2.4's grammar, in
  Python): 42["chat message","x",{"user":"admin"}] (one argument more than the mapping takes)
  never reaches the app; 42["chat message","x"] reaches it as ["chat message","x",{object}],
  and the ack event 427["chat message","y"] as 427["chat message","y",{object}]. Failed: the app
  got the client's {"user":"admin"} as the argument where it reads chatgate's (and the ack
  event without an object).
- part_socketio_grammar: messages_per_minute 1, one normal chat event, then frames the app's
  parser reads as chat events with an ack id made of whitespace (42 [, 42\t[, 42\n[, 427 [,
  42 1[): every chat event the app gets carries the object, and it gets one in all. Failed:
  42 ["chat message","a"] reached the app's chat handler without the object (so did the others).
- part_socketio_binary_event: a BINARY_EVENT of the chat event (451-[...] and its binary
  attachment) never reaches the app; a non-chat event after it does, and the next chat event
  carries the object. Failed: both frames passed untouched, a chat event without the object.
- part_json_unreadable: json codec, messages_per_minute 1 after one normal say: says with a
  number out of range (1e400, 2^64), NaN, \u0000 or a lone \ud800 in the body, a 200-byte
  msg_id, a 300-byte conversation, and a say in a binary frame: none reaches the app, each is
  counted in chatgate_bad_frames_total, the session goes on (later frames arrive). Failed: they
  all reached the app as the client wrote them. Issue 39's eighth round: a say in a binary
  frame that is not valid UTF-8 (Node's JSON.parse of a Buffer reads the bad byte as U+FFFD)
  is refused too. Failed: it passed untouched, with a chatgate object of the client's.
"""

import asyncio
import json
import re
import signal

import websockets

import harness
from harness import Gateway, check, independent, step
from dropin_app import ChatApp
from test_dropin import (CHATGATE_KEYS, ENV, FLIGHT1, FLIGHT2, chatgate_of, config, connect, login, reply,
                         short, shorts, wait_say)

T = harness.DEFAULT_TIMEOUT
PARAMS1 = {"from": "Nairobi", "to": "London", "departure_date": "2026-02-10"}


def gateway(app, name, **top):
    cfg = config(app.url)
    cfg.update(top)
    return Gateway(config=cfg, env=ENV, name=name)


async def metrics(gw):
    status, _, body = await asyncio.to_thread(harness.http_get, gw.http_url + "/metrics")
    check(status == 200, f"/metrics answered {status}")
    return harness.parse_metrics(body.decode())


def typings(sess):
    return [f for f in sess.frames if isinstance(f, dict) and f.get("kind") == "typing"]


async def marker(client, sess, conversation):
    """Send a typing frame (with conversation as its mark) and wait until the app has it: the
    gateway keeps the client's order, so every frame sent before it has been dealt with."""
    await client.typing(conversation)
    ok = await harness.wait_until(lambda: any(f.get("conversation") == conversation for f in typings(sess)), T)
    check(ok, f"the typing frame {conversation!r} sent after the others never reached the app: {sess.describe()}")


def says_with_object(sess, ids):
    """The says of `ids` the app got: every one must carry the gateway's object."""
    got = [s for s in sess.says if s.get("msg_id") in ids]
    bare = [s for s in got if not isinstance(s.get("chatgate"), dict) or
            any(k not in s["chatgate"] for k in CHATGATE_KEYS)]
    check(not bare, f"{len(bare)} says reached the app without the gateway's chatgate object (refused messages "
                    f"must never be forwarded): {shorts(bare)}")
    return got


# -------------------------------------------------------------------------------------- 1


async def part_user_limit():
    async with ChatApp(chunk_interval=0.01) as app:
        async with gateway(app, "gateway:user-limit", limits={"messages_per_minute": 2}) as gw:
            sid = await login(app)
            client = await connect(gw.ws_url("/socket"), sid)
            sess = await app.next_session(0)
            with step("limits.messages_per_minute 2, six says: exactly the first two reach the app, each with "
                      "the chatgate object; the four refused never do"):
                ids = [f"u{i}" for i in range(6)]
                for mid in ids:
                    await client.say(f"hello number {mid}", mid, "trip")
                await marker(client, sess, "after-says")
                got = says_with_object(sess, ids)
                check([s["msg_id"] for s in got] == ["u0", "u1"],
                      f"the app got the says {[s['msg_id'] for s in got]}, expected ['u0', 'u1']")
                m = await metrics(gw)
                check(m.value("chatgate_limited_total", limit="messages_per_minute") == 4,
                      "chatgate_limited_total{limit=messages_per_minute} should count the four refusals")
            await client.close()
            gw.assert_alive()


async def part_rate_and_queue():
    async with ChatApp(chunk_interval=0.01) as app:
        async with gateway(app, "gateway:rate-only", rate_limit={"messages_per_second": 1, "burst": 2}) as gw:
            sid = await login(app)
            client = await connect(gw.ws_url("/socket"), sid)
            sess = await app.next_session(0)
            with step("rate_limit 1/s burst 2 alone, eight says at once: at most three reach the app, each "
                      "with the object"):
                ids = [f"r{i}" for i in range(8)]
                for mid in ids:
                    await client.say(f"hello {mid}", mid, "trip")
                await marker(client, sess, "after-rate")
                got = says_with_object(sess, ids)
                check(1 <= len(got) <= 3, f"the app got {len(got)} of 8 says: {[s['msg_id'] for s in got]}")
            await client.close()
    async with ChatApp(chunk_interval=0.3) as app:
        async with gateway(app, "gateway:queue", queue_limit=1) as gw:
            sid = await login(app)
            url = gw.ws_url("/socket")
            a = await connect(url, sid)
            b = await connect(url, sid)
            await app.next_session(1)
            sa, sb = app.sessions[0], app.sessions[1]
            with step("queue_limit 1, two tabs: while tab A's turn holds the dialog, of tab B's four says only "
                      "the one the queue keeps reaches the app, with the object"):
                await a.say("Tell me a story", "a1", "trip")
                await wait_say(sa, "a1")
                ids = [f"q{i}" for i in range(4)]
                for mid in ids:
                    await b.say(f"hi {mid}", mid, "trip")
                await reply(a, "a1")
                await marker(b, sb, "after-queue")
                got = says_with_object(sb, ids)
                check([s["msg_id"] for s in got] == ["q0"],
                      f"the app got tab B's says {[s['msg_id'] for s in got]}, expected ['q0']")
            await a.close()
            await b.close()
    async with ChatApp(chunk_interval=0.01) as app:
        async with gateway(app, "gateway:rate", rate_limit={"messages_per_second": 1, "burst": 2},
                           limits={"messages_per_minute": 1}) as gw:
            sid = await login(app)
            client = await connect(gw.ws_url("/socket"), sid)
            sess = await app.next_session(0)
            with step("rate_limit 1/s burst 2 (and messages_per_minute 1), eight says at once: at most one "
                      "reaches the app, with the object"):
                ids = [f"r{i}" for i in range(8)]
                for mid in ids:
                    await client.say(f"hello {mid}", mid, "trip")
                await marker(client, sess, "after-rate")
                got = says_with_object(sess, ids)
                check(len(got) == 1, f"the app got {len(got)} of 8 says: {[s['msg_id'] for s in got]}")
                m = await metrics(gw)
                check(m.value("chatgate_rate_limited_total") >= 5,
                      f"chatgate_rate_limited_total is {m.value('chatgate_rate_limited_total')}")
            await client.close()


async def part_params_cap():
    async with ChatApp(chunk_interval=0.01) as app:
        async with gateway(app, "gateway:params-cap", params_cap=80) as gw:
            sid = await login(app)
            client = await connect(gw.ws_url("/socket"), sid)
            sess = await app.next_session(0)
            with step("params_cap 80: the flight sentence's params (73 bytes as the store counts them) go with the say"):
                await client.say(FLIGHT1, "p1", "trip")
                await reply(client, "p1")
                cg = chatgate_of(await wait_say(sess, "p1"), "p1")
                check(cg["params"] == PARAMS1, f"p1's params should be {PARAMS1}: {short(cg['params'])}")
            with step("the return date would put the params over the cap: that say never reaches the app"):
                await client.say(FLIGHT2, "p2", "trip")
                await marker(client, sess, "after-p2")
                check(sess.say("p2") is None,
                      f"a say refused by the params cap reached the app: {short(sess.say('p2'), 600)}")
            with step("the dialog is unchanged: the next say carries p1's params"):
                await client.say("Any seats left?", "p3", "trip")
                await reply(client, "p3")
                cg = chatgate_of(await wait_say(sess, "p3"), "p3")
                check(cg["params"] == PARAMS1 and "error" not in cg,
                      f"p3's object should have the params {PARAMS1} and no error: {short(cg, 600)}")
            await client.close()
            gw.assert_alive()


async def part_draining():
    async with ChatApp(chunk_interval=0.15) as app:  # the story: 20 chunks, 3 s
        gw = gateway(app, "gateway:draining")
        await gw.astart()
        sid = await login(app)
        client = await connect(gw.ws_url("/socket"), sid)
        sess = await app.next_session(0)
        with step("SIGTERM while a drop-in reply streams: a say sent during the drain never reaches the app "
                  "(refused on arrival, logged), not even once the reply in flight has ended; frames that are "
                  "not chat still pass; the gateway exits 0"):
            await client.say("Tell me a long story", "d0", "trip")
            chatgate_of(await wait_say(sess, "d0"), "d0")  # forwarded: the reply in flight holds the drain
            gw.send_signal(signal.SIGTERM)
            ok = await harness.wait_until(lambda: re.search(r"signal \d+: stopping", gw.log_text()), T)
            check(ok, f"the gateway did not log the drain's start: {gw.log_tail(5)}")
            ended = [f for f in client.frames if isinstance(f, dict) and f.get("reply_to") == "d0"
                     and f.get("kind") == "end"]
            check(not ended, "the reply in flight ended before the say during the drain could be sent")
            await client.say("sent during the drain", "d1", "trip")
            await marker(client, sess, "after-drain-say")
            check(sess.say("d1") is None,
                  f"a say sent while the gateway drains reached the app: {short(sess.say('d1'))}")
            check(re.search(r"refused \(internal: the gateway is shutting down", gw.log_text()),
                  f"no log line says the say was refused for the shutdown: {gw.log_tail(6)}")
            code = await gw.await_exit(15)
            check(code == 0, f"the gateway's exit status after SIGTERM: {code}")
            check(sess.say("d0") and sess.say("d1") is None,
                  f"after the drain the app had the says {[s.get('msg_id') for s in sess.says]}, expected d0 alone "
                  f"(a say queued behind the reply in flight would have gone to the app at its end)")


# -------------------------------------------------------------------------------------- 2


async def part_forged_json():
    async with ChatApp(chunk_interval=0.01) as app:
        async with gateway(app, "gateway:forged-json") as gw:
            sid = await login(app)
            client = await connect(gw.ws_url("/socket"), sid)
            sess = await app.next_session(0)
            forged = {"user": "admin", "route": "app", "params": {"role": "root"}}
            with step("a say carrying its own chatgate member: the app reads the gateway's object"):
                await client.say("hello there", "f1", "trip", chatgate=forged)
                await reply(client, "f1")
                cg = chatgate_of(await wait_say(sess, "f1"), "f1")
                check(cg["user"] != "admin" and cg["params"] != {"role": "root"},
                      f"the app got the client's chatgate object: {short(cg, 600)}")
            with step("a typing frame (not chat) carrying a chatgate member reaches the app without it"):
                await client.send({"kind": "typing", "conversation": "forged", "chatgate": forged})
                await marker(client, sess, "after-forged")
                got = [f for f in typings(sess) if f.get("conversation") == "forged"]
                check(got == [{"kind": "typing", "conversation": "forged"}],
                      f"the app should get the typing frame without the client's chatgate member: {shorts(got)}")
            with step("the client's own cancel (halt) carrying a chatgate member reaches the app without it"):
                await client.send({"kind": "halt", "msg_id": "zz", "chatgate": forged})
                await marker(client, sess, "after-halt")
                got = [f for f in sess.frames if isinstance(f, dict) and f.get("kind") == "halt"
                       and f.get("msg_id") == "zz"]
                check(got == [{"kind": "halt", "msg_id": "zz"}],
                      f"the app should get the halt without the client's chatgate member: {shorts(got)}")
            with step("say and typing frames carrying a chatgate_state (the app's state_key) reach the app "
                      "without it"):
                directive = {"service": "travel", "params": {"to": "Nowhere"}}
                await client.send({"kind": "typing", "conversation": "state", "chatgate_state": directive})
                await client.say("hello again", "f2", "trip", chatgate_state=directive)
                await reply(client, "f2")
                await marker(client, sess, "after-state")
                got = [f for f in typings(sess) if f.get("conversation") == "state"]
                check(got == [{"kind": "typing", "conversation": "state"}],
                      f"the typing frame should reach the app without the chatgate_state: {shorts(got)}")
                say = await wait_say(sess, "f2")
                check("chatgate_state" not in say, f"the say should reach the app without the chatgate_state: "
                                                   f"{short(say, 400)}")
            await client.close()


async def part_chat_and_cancel():
    async with ChatApp(chunk_interval=0.01) as app:
        cfg = config(app.url)
        cfg["dropin"]["client"]["cancel"] = {"pointer": "/cancel", "exists": True}
        async with Gateway(config=cfg, env=ENV, name="gateway:chat-and-cancel") as gw:
            sid = await login(app)
            client = await connect(gw.ws_url("/socket"), sid)
            sess = await app.next_session(0)
            with step("a say that carries the cancel marker too is a chat message: it reaches the app with the "
                      "gateway's object"):
                await client.say("hello", "cc1", "trip", cancel=1, chatgate={"user": "admin"})
                await reply(client, "cc1")
                cg = chatgate_of(await wait_say(sess, "cc1"), "cc1")
                check(cg.get("user") != "admin", f"the app got the client's chatgate object: {short(cg, 400)}")
            await client.close()
            gw.assert_alive()


class SioApp(harness.WsServer):
    """A socket.io app's server as its parser (socket.io-parser 4.2's Decoder, on Engine.IO v4
    messages) reads the frames: `events` are the packets it decoded, a binary event once its
    attachments have come. It answers CONNECT ("40") and nothing else."""

    serve_options = {"max_size": 2 ** 22}

    def __init__(self):
        super().__init__()
        self.frames = []   # every frame received, as it came
        self.events = []   # (frame, {"type", "nsp", "id", "data"}) of every (binary) event decoded

    async def _handler(self, ws, path=None):
        waiting = None  # [packet, attachments still to come]
        try:
            async for frame in ws:
                self.frames.append(frame)
                if isinstance(frame, bytes):
                    if waiting:
                        waiting[1] -= 1
                        if waiting[1] == 0:
                            self.events.append(waiting[0])
                            waiting = None
                    continue
                if frame == "40":
                    await ws.send('40{"sid":"sio1"}')
                    continue
                packet = sio_decode(frame)
                waiting = None  # a text frame while reconstructing: the parser throws, and starts over
                if packet and packet["type"] in (2, 5):
                    n = packet["attachments"]
                    if n == 0:
                        self.events.append((frame, packet))
                    elif n > 0 and float(n).is_integer():
                        waiting = [(frame, packet), int(n)]
        except websockets.ConnectionClosed:
            pass

    def chat_events(self):
        return [(f, p) for f, p in self.events
                if p["nsp"] == "/" and isinstance(p["data"], list) and p["data"][:1] == ["chat message"]]

    def has_event(self, name):
        return any(isinstance(p["data"], list) and p["data"][:1] == [name] for _, p in self.events)


JS_SPACE = "".join([" \t\n\v\f\r\u00a0\u1680\u2028\u2029\u202f\u205f\u3000\ufeff"]
                   + [chr(c) for c in range(0x2000, 0x200b)])
SIO_RESERVED = ("connect", "connect_error", "disconnect", "disconnecting", "newListener", "removeListener")


def js_number(text):
    """JavaScript's Number(text) for a string (NaN when it is not a number)."""
    t = text.strip(JS_SPACE)
    if t == "":
        return 0.0
    for prefix, base in (("0x", 16), ("0o", 8), ("0b", 2)):
        if t[:2].lower() == prefix:
            try:
                return float(int(t[2:], base)) if t[2:].isalnum() else float("nan")
            except ValueError:
                return float("nan")
    if re.fullmatch(r"[+-]?(Infinity|(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?)", t):
        return float(t.replace("Infinity", "inf"))
    return float("nan")


def js_number_char(c):
    """socket.io-parser's `Number(c) == c` for one character: a digit or JavaScript whitespace."""
    return ("0" <= c <= "9") or c in JS_SPACE


def sio_decode(text):
    """An Engine.IO message read as socket.io-parser 4.2.4's Decoder.decodeString reads its
    packet: None when it is not a message or the parser throws. "attachments" is Number() of
    a binary packet's count (0 for others): a binary event is emitted at once when it is 0,
    after that many binary frames when it is a positive integer, never otherwise."""
    if not text.startswith("4") or len(text) < 2 or text[1] not in "0123456":
        return None
    s = text[1:]
    packet = {"type": int(s[0]), "nsp": "/", "id": None, "data": None, "attachments": 0}
    i = 0
    if packet["type"] in (5, 6):
        start = i + 1
        i += 1
        while i < len(s) and s[i] != "-":
            i += 1
        count = js_number(s[start:i])
        if i >= len(s) or count != count:
            return None
        packet["attachments"] = count
    if s[i + 1:i + 2] == "/":
        start = i + 1
        while True:
            i += 1
            if i >= len(s) or s[i] == ",":
                break
        packet["nsp"] = s[start:i]
    nxt = s[i + 1:i + 2]
    if nxt and js_number_char(nxt):
        start = i + 1
        while True:
            i += 1
            if i >= len(s):
                break
            if not js_number_char(s[i]):
                i -= 1
                break
        packet["id"] = js_number(s[start:i + 1])
    i += 1
    if i < len(s):
        try:
            packet["data"] = json.loads(s[i:])
        except ValueError:
            return None
        data = packet["data"]
        if packet["type"] in (2, 5) and not (
                isinstance(data, list) and data and (type(data[0]) in (int, float) or
                                                     (isinstance(data[0], str) and data[0] not in SIO_RESERVED))):
            return None
    return packet


def sio_config(app, **top):
    dropin = {"path": "/socket.io/", "app": app.url("/chat"), "codec": "socket.io", "namespace": "/",
              "reply_gap_ms": 400,
              "client": {"chat": {"pointer": "/0", "equals": "chat message"}, "text": "/1"},
              "app_frames": {"reply": {"pointer": "/0", "equals": "bot message"}, "text": "/1"}}
    cfg = {"upstreams": {"demo": "demo"}, "log_level": "info",
           "rate_limit": {"messages_per_second": 1000, "burst": 1000}, "dropin": dropin}
    cfg.update(top)
    return cfg


async def sio_client(gw):
    ws = await websockets.connect(gw.ws_url("/socket.io/?EIO=4&transport=websocket"))
    await ws.send("40")
    try:
        while not (await asyncio.wait_for(ws.recv(), T)).startswith("40"):
            pass
    except (asyncio.TimeoutError, websockets.ConnectionClosed) as err:
        harness.fail(f"no CONNECT answer through the gateway: {err!r}")
    return ws


async def sio_marker(ws, app, name):
    """A non-chat event after the frames under test: once the app has it, they were dealt with."""
    await ws.send("42" + json.dumps([name, True]))
    ok = await harness.wait_until(lambda: app.has_event(name), T)
    check(ok, f"the non-chat event {name!r} sent after the others never reached the app: "
              f"{[harness.brief(f, 120) for f in app.frames[-8:]]}")


def check_object(frame, packet, at=2):
    data = packet["data"]
    obj = data[at] if len(data) > at else None
    check(isinstance(obj, dict) and all(k in obj for k in CHATGATE_KEYS) and obj.get("user") != "admin",
          f"argument {at} of the chat event the app got should be the gateway's chatgate object: "
          f"{harness.brief(frame, 400)}")
    return obj


async def part_forged_socketio():
    async with SioApp() as app:
        async with Gateway(config=sio_config(app), env=ENV, name="gateway:forged-sio") as gw:
            ws = await sio_client(gw)
            with step('socket.io: 42["chat message","x",{"user":"admin"}] (an argument more than the mapping '
                      'takes) never reaches the app'):
                await ws.send('42["chat message","x",{"user":"admin"}]')
                await sio_marker(ws, app, "after-forged")
                forged = [f for f, _ in app.chat_events() if "admin" in f]
                check(not forged, f"the app got a chat event with the client's object as an argument: {forged}")
            with step('socket.io: 42["chat message","x"] reaches the app as ["chat message","x",{object}]'):
                await ws.send('42["chat message","x"]')
                ok = await harness.wait_until(lambda: app.chat_events(), T)
                check(ok, f"the chat event never reached the app: {app.frames[-6:]}")
                frame, packet = app.chat_events()[-1]
                check(frame.startswith('42["chat message","x",') and len(packet["data"]) == 3 and packet["id"] is None,
                      f"the app got {harness.brief(frame, 400)}")
                check_object(frame, packet)
            with step('socket.io: the ack event 427["chat message","y"] reaches the app as '
                      '427["chat message","y",{object}], its callback after the object'):
                await ws.send('427["chat message","y"]')
                await sio_marker(ws, app, "after-ack")
                acked = [(f, p) for f, p in app.chat_events() if p["id"] == 7]
                check(len(acked) == 1, f"the app should have one chat event with ack id 7: {app.frames[-6:]}")
                frame, packet = acked[0]
                check(frame.startswith('427["chat message","y",') and len(packet["data"]) == 3,
                      f"the ack event at the app: {harness.brief(frame, 400)}")
                check_object(frame, packet)
            await ws.close()


# -------------------------------------------------------------------------------------- 3


SIO_SNEAKY = ['42 ["chat message","a"]', '42\t["chat message","b"]', '42\n["chat message","c"]',
              '427 ["chat message","d"]', '42 1["chat message","e"]']


async def part_socketio_grammar():
    async with SioApp() as app:
        cfg = sio_config(app, limits={"messages_per_minute": 1})
        async with Gateway(config=cfg, env=ENV, name="gateway:sio-grammar") as gw:
            ws = await sio_client(gw)
            with step("socket.io, messages_per_minute 1: one normal chat event reaches the app with the object"):
                await ws.send('42["chat message","hello"]')
                ok = await harness.wait_until(lambda: app.chat_events(), T)
                check(ok, f"the first chat event never reached the app: {app.frames[-6:]}")
                check_object(*app.chat_events()[0])
            with step("frames socket.io-parser reads as chat events (ack ids of whitespace: "
                      + ", ".join(repr(f[:5]) for f in SIO_SNEAKY) + "): none reaches the app without the object; "
                      "the app gets one chat event in all"):
                for frame in SIO_SNEAKY:
                    check(sio_decode(frame)["data"][0] == "chat message", f"the fake's parser misreads {frame!r}")
                    await ws.send(frame)
                await sio_marker(ws, app, "after-sneaky")
                events = app.chat_events()
                for frame, packet in events:
                    check_object(frame, packet)
                check(len(events) == 1, f"the app got {len(events)} chat events, expected only the first (limit 1): "
                                        f"{[harness.brief(f, 120) for f, _ in events]}")
            await ws.close()
            gw.assert_alive()


async def part_socketio_binary_event():
    async with SioApp() as app:
        async with Gateway(config=sio_config(app), env=ENV, name="gateway:sio-binary") as gw:
            ws = await sio_client(gw)
            with step('a BINARY_EVENT of the chat event (451-["chat message",{placeholder}] and its attachment) '
                      'never reaches the app; a non-chat event after it does'):
                n = len(app.frames)
                blob = b"\x89PNG binary attachment"
                await ws.send('451-["chat message",{"_placeholder":true,"num":0}]')
                await ws.send(blob)
                await sio_marker(ws, app, "after-binary")
                late = app.frames[n:]
                check(not any(isinstance(f, str) and f.startswith("451-") for f in late) and blob not in late,
                      f"the binary event or its attachment reached the app: {[harness.brief(f, 120) for f in late]}")
                check(not app.chat_events(), f"the app got a chat event from a binary event: "
                                             f"{[harness.brief(f, 120) for f, _ in app.chat_events()]}")
            with step("the session goes on: a chat event after them reaches the app with the object"):
                await ws.send('42["chat message","after"]')
                ok = await harness.wait_until(lambda: app.chat_events(), T)
                check(ok, f"the chat event never reached the app: {app.frames[-6:]}")
                check_object(*app.chat_events()[-1])
            await ws.close()
            gw.assert_alive()


JSON_BAD = [
    ("n1", '{"kind":"say","msg_id":"n1","conversation":"trip","body":"x","n":1e400}', "a number out of range"),
    ("n2", '{"kind":"say","msg_id":"n2","conversation":"trip","body":"x","n":NaN}', "NaN"),
    ("n3", '{"kind":"say","msg_id":"n3","conversation":"trip","body":"a\\u0000b"}', "\\u0000 in the body"),
    ("n4", '{"kind":"say","msg_id":"n4","conversation":"trip","body":"x\\ud800y"}', "a lone \\ud800 in the body"),
    ("n5", '{"kind":"say","msg_id":"n5","conversation":"trip","body":"x","n": 18446744073709551616}', "2^64"),
    ("n6" + "i" * 198, None, "a 200-byte msg_id"),
    ("n7", '{"kind":"say","msg_id":"n7","conversation":"' + "r" * 300 + '","body":"x"}', "a 300-byte conversation"),
]


async def part_json_unreadable():
    async with ChatApp(chunk_interval=0.01) as app:
        async with gateway(app, "gateway:json-unreadable", limits={"messages_per_minute": 1}) as gw:
            sid = await login(app)
            client = await connect(gw.ws_url("/socket"), sid)
            sess = await app.next_session(0)
            with step("json codec, messages_per_minute 1: one normal say reaches the app"):
                await client.say("hello", "ok1", "trip")
                await reply(client, "ok1")
                chatgate_of(await wait_say(sess, "ok1"), "ok1")
            before = (await metrics(gw)).value("chatgate_bad_frames_total")
            with step("says the app reads but the gateway cannot check (" + ", ".join(w for _, _, w in JSON_BAD)
                      + ", a say in a binary frame): none reaches the app, each is a bad frame; the session goes on"):
                binary_say = json.dumps({"kind": "say", "msg_id": "n8", "conversation": "trip", "body": "x"}).encode()
                # not valid UTF-8: Node's JSON.parse(buffer) reads the byte as U+FFFD, and the say
                bad_utf8 = b'{"kind":"say","msg_id":"n9","conversation":"trip","body":"hi \xff",' \
                           b'"chatgate":{"user":"victim"}}'
                for mid, raw, _ in JSON_BAD:
                    if raw is None:
                        raw = json.dumps({"kind": "say", "msg_id": mid, "conversation": "trip", "body": "x"})
                    await client.send(raw)
                await client.send_binary(binary_say)
                await client.send_binary(bad_utf8)
                await marker(client, sess, "after-bad")
                ids = {mid for mid, _, _ in JSON_BAD} | {"n8", "n9"}
                reached = [f for f in sess.frames if isinstance(f, dict) and f.get("msg_id") in ids]
                check(not reached, f"{len(reached)} of them reached the app: {shorts(reached)}")
                check(binary_say not in sess.raw, "the say in a binary frame reached the app")
                check(bad_utf8 not in sess.raw, "the say in a binary frame that is not UTF-8 reached the app")
                m = await metrics(gw)
                counted = m.value("chatgate_bad_frames_total") - before
                check(counted == len(ids), f"chatgate_bad_frames_total went up by {counted}, expected {len(ids)}")
            with step("the session goes on: the connection is open and non-chat frames pass"):
                await client.presence("online")
                ok = await harness.wait_until(lambda: any(isinstance(f, dict) and f.get("kind") == "presence"
                                                          for f in sess.frames), T)
                check(ok, "the presence frame did not reach the app")
            await client.close()
            gw.assert_alive()


async def main(args):
    await independent(part_user_limit())
    await independent(part_rate_and_queue())
    await independent(part_params_cap())
    await independent(part_draining())
    await independent(part_forged_json())
    await independent(part_chat_and_cancel())
    await independent(part_forged_socketio())
    await independent(part_socketio_grammar())
    await independent(part_socketio_binary_event())
    await independent(part_json_unreadable())


if __name__ == "__main__":
    harness.run(main, timeout=110)
