"""End-to-end tests of drop-in mode (issue 6; docs/protocol.md, Drop-in mode): chatgate in front of a chat
app with its own protocol, which runs unchanged behind it, and whose unchanged client only
connects to another URL.

The app is tests/e2e/dropin_app.py (`ChatApp`, in this process): path /socket, subprotocol
chat.v2, a session cookie `sid` it checks (4001 "no session" otherwise), frames
{"kind":"say"|"typing"|"presence"|"halt",...} and binary frames (echoed) from the client,
{"kind":"typing"|"chunk"|"end"|"halted",...} back, a chunk every 50 ms (20 for a "long" one,
else 3), "STATE:{json}" in a body puts that JSON under "chatgate_state" in the reply's end. Its
client is `ChatClient`, the same code for the app and for the gateway. The gateway runs with
the shipped rules and CHATGATE_NOW=2026-02-03T10:00:00Z, and a "dropin" config (`config()`)
that maps that protocol.

- the unchanged client gets, through the gateway, exactly the frames (byte for byte) it gets
  from the app directly; the app sees the same path + query, subprotocol, Cookie and
  Authorization (and no header that is not listed), and the say frame as the client wrote it
  plus the `chatgate` object; /ws still speaks chatgate.v1 next to it;
- the cookie-checked session works; no cookie or an unknown one: the client is closed with
  the app's 4001 "no session"; the same cookie is the same user (dialogs kept across
  connections; chatgate.user is not the cookie), another cookie another user;
- non-chat frames (typing, presence, binary up to 200 kB with max_frame 1 MiB, a text frame
  that is not JSON, a JSON array) pass untouched and in order both ways, interleaved with a
  chat frame; two clients at once each get their own app connection and only its frames; a
  client frame over max_frame, or an app frame over the gateway's limit, is not dropped
  silently (delivered, or close 1009);
- the flight search of docs/scenarios.md: the second say carries chatgate.service travel and params
  {from Nairobi, to London, departure_date 2026-02-10, return_date 2026-02-20};
- cancel: "stop" while a long reply streams sends the app {"kind":"halt","msg_id":<id>}, the
  client sees halted and no more chunks of it; the client's own halt frame reaches the app
  once (no second copy from the gateway) and works; without a cancel_frame in the mapping (and
  an app that cannot stop a reply) "stop", the client's own halt, or "nevermind" followed at
  once by another say: no chunk of that reply the app sent after it got the cancelling frame
  reaches the client, non-chat frames still pass meanwhile, and the session goes on; the
  client's own halt naming another message (client.cancel_id) stops nothing (issue 39's
  eighth round: it stopped relaying the reply in flight, whatever its id); a message whose id
  is an integer is halted with that integer (`"{id}"` in the cancel_frame);
- a state directive (chatgate_state in the app's end frame) is removed from what the client
  sees and applied: the next say carries its params;
- failure: app unreachable -> the client's handshake is answered 502 (issue 35: the client
  is answered only once the app has answered; it used to get 101, then a close 1014); the
  app closes with 4002 "bye" -> the
  client gets 4002 "bye"; the app drops the TCP connection -> 1011; the client goes away
  (closing, or dropping TCP, mid-reply too) -> the app's connection closes within 1 s, with a
  close frame; a presence frame the client sent behind a chat message that waits for its
  dialog (another tab's reply runs), then its close: the presence reaches the app, then the
  close (1001);
- config mistakes: a mapping pointer that is not a JSON pointer, a non-ws app URL: exit 2 with
  "FILE:LINE:COL: dropin.KEY: ..." on stderr, LINE that key's line;
- SIGTERM while a drop-in reply streams: the client gets a close frame (not 1006), the app's
  connection closes, exit 0.
"""

import asyncio
import json
import re
import time

import websockets
import websockets.frames

import harness
from harness import Client, Gateway, check, independent, step
from dropin_app import ChatApp, ChatClient

NOW = "2026-02-03T10:00:00Z"
ENV = {"CHATGATE_NOW": NOW}
FLIGHT1 = "Find me flights from Nairobi to London next week"
FLIGHT2 = "What about returning on Feb 20?"
WANT2 = {"from": "Nairobi", "to": "London", "departure_date": "2026-02-10", "return_date": "2026-02-20"}
CHATGATE_KEYS = ("user", "room", "route", "service", "params", "resolution", "enriched", "soft_context",
                 "last_tool_result",
                 "awaiting", "rules", "annotations")
T = harness.DEFAULT_TIMEOUT


def config(app_url, cancel_frame=True, **dropin_extra):
    """The gateway config of the brief: the chat app's protocol mapped, shipped rules."""
    app_frames = {"text": "/body", "id": "/reply_to",
                  "end": {"pointer": "/kind", "equals": "end"},
                  "cancelled": {"pointer": "/kind", "equals": "halted"}}
    if cancel_frame:
        app_frames["cancel_frame"] = {"kind": "halt", "msg_id": "{id}"}
    dropin = {
        "path": "/socket",
        "app": app_url,
        "subprotocols": ["chat.v2"],
        "forward_headers": ["Cookie", "Authorization"],
        "user_cookie": "sid",
        "client": {"chat": {"pointer": "/kind", "equals": "say"}, "text": "/body", "room": "/conversation",
                   "id": "/msg_id", "cancel": {"pointer": "/kind", "equals": "halt"}, "cancel_id": "/msg_id"},
        "app_frames": app_frames,
        "object_key": "chatgate",
        "state_key": "chatgate_state",
    }
    dropin.update(dropin_extra)
    return {"upstreams": {"demo": "demo"}, "log_level": "info",
            "rate_limit": {"messages_per_second": 1000, "burst": 1000}, "dropin": dropin}


def gateway(app, name, cancel_frame=True, app_url=None, **top):
    cfg = config(app_url or app.url, cancel_frame)
    cfg.update(top)
    return Gateway(config=cfg, env=ENV, name=name)


def short(obj, limit=300):
    if isinstance(obj, bytes):
        return f"<binary {len(obj)} bytes {obj[:16]!r}...>"
    return harness.brief(obj, limit)


def shorts(frames, limit=160):
    return [short(f, limit) for f in frames]


async def connect(url, sid=None, **kwargs):
    """ChatClient.connect, failing (not raising) on a refused handshake."""
    try:
        return await ChatClient.connect(url, sid, **kwargs)
    except websockets.InvalidStatusCode as err:
        harness.fail(f"the WebSocket handshake to {url} was refused with HTTP {err.status_code}")
    except (OSError, asyncio.TimeoutError, websockets.InvalidHandshake) as err:
        harness.fail(f"could not connect to {url}: {err!r}")


async def reply(client, msg_id, what="", timeout=T):
    try:
        return await client.read_reply(msg_id, timeout)
    except asyncio.TimeoutError as err:
        harness.fail(f"{what or msg_id}: {err}; frames so far: {shorts(client.frames[-8:])}")
    except websockets.ConnectionClosed as err:
        harness.fail(f"{what or msg_id}: the connection was closed ({err.code} {err.reason!r}) before "
                     f"the reply ended; frames so far: {shorts(client.frames[-8:])}")


async def wait_say(sess, msg_id, timeout=T):
    ok = await harness.wait_until(lambda: sess.say(msg_id) is not None, timeout)
    check(ok, f"the app got no say frame {msg_id!r} within {timeout}s: {sess.describe()}")
    return sess.say(msg_id)


def chatgate_of(say, msg_id):
    cg = say.get("chatgate")
    check(isinstance(cg, dict), f"{msg_id}: the say frame the app got has no chatgate object: {short(say, 600)}")
    missing = [k for k in CHATGATE_KEYS if k not in cg]
    check(not missing, f"{msg_id}: the chatgate object lacks {missing}: {short(cg, 600)}")
    return cg


def without_chatgate(frame):
    return {k: v for k, v in frame.items() if k != "chatgate"} if isinstance(frame, dict) else frame


async def login(app):
    return await asyncio.to_thread(ChatClient.login, app.login_url)


# --------------------------------------------------------------------------------------


async def part_unchanged_client():
    async with ChatApp() as app:
        gw = gateway(app, "gateway:unchanged")
        async with gw:
            sid = await login(app)
            query = "/socket?session=abc&lang=en%20GB"
            headers = {"Authorization": "Bearer t0k3n-of-the-app", "X-Not-Forwarded": "secret"}
            cookie = f"theme=dark; sid={sid}"
            script = [("Hello there, how are you? 👋", "c1", {"client_ts": 1700000000123,
                                                            "meta": {"emoji": "🎉", "list": [1, 2.5, None]}}),
                      ("Tell me a long story about trains", "c2", {})]

            async def session(url):
                client = await connect(url, cookie=cookie, headers=headers)
                replies = []
                for body, mid, extra in script:
                    await client.say(body, mid, "lobby", **extra)
                    replies.append(await reply(client, mid, f"{mid} via {url}"))
                await client.close()
                return client, replies

            with step("the unchanged client, directly to the app"):
                direct, direct_replies = await session(app.url + query)
                check([r.kind for r in direct_replies] == ["end", "end"], "the app itself did not answer")
            with step("the same client through the gateway: the same frames, byte for byte, and no others"):
                via, via_replies = await session(gw.ws_url(query))
                check(via.subprotocol == "chat.v2",
                      f"the gateway's handshake answered subprotocol {via.subprotocol!r}, the client asked chat.v2")
                for d, v in zip(direct_replies, via_replies):
                    check(v.frames == d.frames,
                          f"{d.msg_id}: through the gateway the client got {shorts(v.frames)}\n"
                          f"directly it got {shorts(d.frames)}")
                check(via.received == direct.received,
                      f"the raw frames differ (the app's frames should come back untouched):\n"
                      f"  via gateway: {shorts(via.received[:6])}\n  direct:      {shorts(direct.received[:6])}")
            with step("the app saw the same session: path + query, subprotocol, Cookie, Authorization"):
                check(len(app.sessions) == 2, f"the app should have 2 connections, has {len(app.sessions)}")
                d, v = app.sessions
                check(v.path == query, f"the app's upstream path is {v.path!r}, the client's was {query!r}")
                check(v.subprotocol == "chat.v2", f"the upstream subprotocol is {v.subprotocol!r}")
                check(v.headers.get("cookie") == cookie,
                      f"Cookie at the app {v.headers.get('cookie')!r}, the client sent {cookie!r}")
                check(v.headers.get("authorization") == headers["Authorization"],
                      f"Authorization at the app {v.headers.get('authorization')!r}")
                check("x-not-forwarded" not in v.headers,
                      f"a header not in forward_headers reached the app: X-Not-Forwarded: "
                      f"{v.headers.get('x-not-forwarded')!r}")
            with step("the app got each say as the client wrote it, plus only the chatgate object"):
                d, v = app.sessions
                check(len(v.says) == 2, f"the app should have 2 says via the gateway: {v.describe()}")
                for ds, vs in zip(d.says, v.says):
                    mid = ds["msg_id"]
                    check(without_chatgate(vs) == ds,
                          f"{mid}: forwarded {short(without_chatgate(vs), 400)}\n  written {short(ds, 400)}")
                    cg = chatgate_of(vs, mid)
                    check(cg["room"] == "lobby", f"{mid}: chatgate.room should be the conversation 'lobby': {short(cg)}")
                    check(cg["route"] == "app", f"{mid}: chatgate.route should be 'app': {short(cg)}")
                    check(isinstance(cg["user"], str) and cg["user"] and sid not in cg["user"],
                          f"{mid}: chatgate.user should be a non-empty id that is not the cookie: {cg['user']!r}")
                    for k in ("type", "id", "text"):
                        check(k not in cg, f"{mid}: chatgate.{k} should not be there (docs/protocol.md, Drop-in mode): {short(cg)}")
                non_say = [f for f in v.frames if not (isinstance(f, dict) and f.get("kind") == "say")]
                check(not non_say, f"the app got frames the client never sent: {shorts(non_say)}")
            with step("/ws still speaks chatgate.v1 next to the drop-in path"):
                client = await Client.connect(gw)
                turn = await client.message("hello", mid="m1", room="r")
                check(turn.kind == "done", f"/ws message: {turn.describe()}")
                await client.close()
                check(len(app.sessions) == 2, "a /ws connection opened a connection to the drop-in app")


async def part_cookie():
    async with ChatApp() as app:
        gw = gateway(app, "gateway:cookie")
        async with gw:
            url = gw.ws_url("/socket")
            for what, kwargs in (("no cookie", {}), ("an unknown sid", {"sid": "forged"}),
                                 ("another cookie but no sid", {"cookie": "theme=dark"})):
                with step(f"{what}: the app's close 4001 'no session' reaches the client"):
                    n = len(app.sessions)
                    client = await connect(url, **kwargs)
                    code, reason, frames = await client.wait_closed(5)
                    check(code == 4001 and reason == "no session",
                          f"expected close 4001 'no session', got {code} {reason!r} (frames {shorts(frames)}); "
                          f"the app's connections: {len(app.sessions) - n} new")
                    check(len(app.sessions) == n + 1 and app.sessions[-1].rejected,
                          "the app should have got (and refused) one connection for it")
            with step("with its cookie the session works through the gateway"):
                sid_a = await login(app)
                a1 = await connect(url, sid_a)
                await a1.say(FLIGHT1, "a1", "trip")
                r = await reply(a1, "a1")
                check(r.kind == "end" and r.chunks == ["you said: ", FLIGHT1, " w2"], f"reply: {shorts(r.frames)}")
                user_a = chatgate_of(await wait_say(app.sessions[-1], "a1"), "a1")["user"]
                await a1.close()
            with step("the same cookie on a new connection is the same user: its dialog goes on"):
                a2 = await connect(url, sid_a)
                await a2.say(FLIGHT2, "a2", "trip")
                await reply(a2, "a2")
                cg = chatgate_of(await wait_say(app.sessions[-1], "a2"), "a2")
                check(cg["user"] == user_a, f"same sid, chatgate.user {cg['user']!r} then {user_a!r}")
                check(cg["params"] == WANT2, f"the second connection's params should be the merged {WANT2}, "
                                             f"got {short(cg['params'])}")
                await a2.close()
            with step("another cookie is another user, with its own dialogs"):
                sid_b = await login(app)
                b = await connect(url, cookie=f"lang=en; sid={sid_b}; theme=dark")
                await b.say(FLIGHT2, "b1", "trip")
                await reply(b, "b1")
                cg = chatgate_of(await wait_say(app.sessions[-1], "b1"), "b1")
                check(cg["user"] != user_a, f"two different sids have the same chatgate.user {user_a!r}")
                check(sid_b not in cg["user"], f"chatgate.user holds the cookie: {cg['user']!r}")
                check(cg["params"].get("from") is None,
                      f"another user's dialog leaked into this one: params {short(cg['params'])}")
                await b.close()


async def part_passthrough():
    async with ChatApp() as app:
        gw = gateway(app, "gateway:passthrough", max_frame=1 << 20)
        async with gw:
            sid = await login(app)
            client = await connect(gw.ws_url("/socket"), sid)
            sess = await app.next_session(0)
            blob1 = bytes(range(256)) * 4          # not UTF-8
            blob2 = b"\x89PNG\r\n\x1a\n" + bytes(200_000)
            typing_raw = '{ "kind" : "typing",   "conversation":"trip" ,"x":[1,2 ,3]}'
            presence_raw = '{"status":"online","kind":"presence","since":1.50}'
            with step("client -> app: typing, binary, say, presence, binary (200 kB), in order and untouched"):
                await client.send(typing_raw)
                await client.send_binary(blob1)
                say = await client.say("Hi, just checking in", "c1", "trip")
                await client.send(presence_raw)
                await client.send_binary(blob2)
                r = await reply(client, "c1")
                ok = await harness.wait_until(lambda: len(sess.raw) >= 5, T)
                check(ok, f"the app got {len(sess.raw)} of 5 frames: {sess.describe()}")
                got = sess.raw
                check(len(got) == 5, f"the app got {len(got)} frames, expected 5: {shorts(got)}")
                check(got[0] == typing_raw, f"frame 1 (typing) changed on its way: {short(got[0])}")
                check(got[1] == blob1, f"frame 2 (binary 1) changed or moved: {short(got[1])}")
                check(isinstance(got[2], str) and without_chatgate(json.loads(got[2])) == say,
                      f"frame 3 should be the say: {short(got[2], 500)}")
                check(got[3] == presence_raw, f"frame 4 (presence) changed or moved: {short(got[3])}")
                check(got[4] == blob2, f"frame 5 (binary 2, 200 kB) changed or moved: {short(got[4])}")
            with step("app -> client: binary echoes, typing, chunks, end: what the app sent, in order, untouched"):
                ok = await harness.wait_until(lambda: len(sess.sent) >= 7, T)
                check(ok, f"the app sent only {len(sess.sent)} frames")
                more = await client.read_for(0.3) if len(client.received) < len(sess.sent) else []
                check(client.received == sess.sent,
                      f"the client got {shorts(client.received)}\nthe app sent {shorts(sess.sent)}"
                      f"{' (read after the end: ' + str(shorts(more)) + ')' if more else ''}")
                check(r.kind == "end", f"reply {shorts(r.frames)}")
            with step("a text frame that is not JSON, and a JSON array, pass untouched too"):
                n = len(sess.raw)
                await client.send("hello, this is not { JSON")
                await client.send('[1, "two", {"kind": "say"}]')
                await client.typing("trip")
                ok = await harness.wait_until(lambda: len(sess.raw) >= n + 3, T)
                check(ok, f"the app got {len(sess.raw) - n} of 3 frames: {shorts(sess.raw[n:])}")
                check(sess.raw[n:n + 2] == ["hello, this is not { JSON", '[1, "two", {"kind": "say"}]'],
                      f"the app got {shorts(sess.raw[n:])}")
            with step("the session goes on: another say is answered"):
                await client.say("still there?", "c2", "trip")
                r = await reply(client, "c2")
                check(r.kind == "end" and r.text == "you said: still there? w2", f"reply {shorts(r.frames)}")
            await client.close()


async def part_two_clients():
    async with ChatApp() as app:
        gw = gateway(app, "gateway:two-clients")
        async with gw:
            with step("two clients at once, long replies in the same conversation id: each has its own "
                      "app connection and gets exactly what its connection was sent"):
                sid1, sid2 = await login(app), await login(app)
                c1 = await connect(gw.ws_url("/socket?who=one"), sid1)
                c2 = await connect(gw.ws_url("/socket?who=two"), sid2)
                await asyncio.gather(c1.say("a long one for one", "m1", "trip"), c2.say("a long one for two", "m1", "trip"))
                await asyncio.gather(c1.typing("trip"), c2.send_binary(b"two's picture"))
                r1, r2 = await asyncio.gather(reply(c1, "m1"), reply(c2, "m1"))
                check(len(app.sessions) == 2, f"the app should have 2 connections, has {len(app.sessions)}")
                by_path = {sess.path: sess for sess in app.sessions}
                s1, s2 = by_path.get("/socket?who=one"), by_path.get("/socket?who=two")
                check(s1 and s2, f"the app's connections: {list(by_path)}")
                await asyncio.gather(c1.read_for(0.2), c2.read_for(0.2))
                check(c1.received == s1.sent, f"client one got {shorts(c1.received[:5])}..., its app connection "
                                              f"sent {shorts(s1.sent[:5])}...")
                check(c2.received == s2.sent, f"client two got {shorts(c2.received[:5])}..., its app connection "
                                              f"sent {shorts(s2.sent[:5])}...")
                check(r1.chunks[1] == "a long one for one" and r2.chunks[1] == "a long one for two",
                      f"replies crossed: {r1.chunks[:2]} / {r2.chunks[:2]}")
                await c1.close()
                await c2.close()


async def part_shutdown():
    async with ChatApp() as app:
        gw = gateway(app, "gateway:shutdown")
        await gw.astart()
        with step("SIGTERM while a drop-in reply streams: the client gets a close frame (not a dropped "
                  "TCP connection), the app's connection closes, exit 0"):
            sid = await login(app)
            client = await connect(gw.ws_url("/socket"), sid)
            await client.say("Tell me a long story", "L1")
            await wait_chunks(client, "L1", 2)
            sess = app.sessions[-1]
            stopping = asyncio.create_task(gw.astop(timeout=15))
            code, reason, frames = await client.wait_closed(13)
            status = await stopping
            n = len(chunks_of(client.frames, "L1"))
            check(code is not None, "the client's connection was still open 13 s after SIGTERM")
            check(code != 1006, f"the client's connection was dropped without a close frame (1006) after {n} of 20 "
                                f"chunks; a graceful shutdown closes it (1001 going away, after the reply or not)")
            check(await sess.wait_closed(1), "the app's connection stayed open after the gateway exited")
            check(status == 0, f"exit status {status} after SIGTERM")


async def part_over_max_frame():
    async with ChatApp() as app:
        gw = gateway(app, "gateway:max-frame", max_frame=65536)
        async with gw:
            sid = await login(app)
            client = await connect(gw.ws_url("/socket"), sid)
            sess = await app.next_session(0)
            with step("a binary frame over max_frame (100 kB > 64 KiB): delivered, or the client closed "
                      "with 1009; never dropped silently"):
                await client.typing("trip")
                await client.send_binary(bytes(100_000))
                await client.presence("away")
                code, reason, frames = await client.wait_closed(1.5)
                kinds = [short(f, 60) for f in sess.raw]
                if code is None:
                    check(len(sess.raw) == 3 and sess.raw[1] == bytes(100_000),
                          f"the client's connection stayed open, yet the app got only {kinds} (the 100 kB binary "
                          f"frame was dropped without telling anyone: no close 1009, nothing to the app)")
                else:
                    check(code == 1009, f"the client was closed with {code} {reason!r}; a frame too big is 1009")
            await client.close()
            with step("an app frame over the gateway's limit for app frames (2 MiB): delivered, or the client "
                      "closed with 1009; never dropped silently"):
                client = await connect(gw.ws_url("/socket"), sid)
                sess = await app.next_session(1)
                await asyncio.sleep(0.1)
                big = '{"kind":"big","body":"' + "x" * (2 << 20) + '"}'
                await sess.send(big)
                await sess.send('{"kind":"after"}')
                code, reason, frames = await client.wait_closed(1.5)
                if code is None:
                    check(big in client.received,
                          f"the client's connection stayed open, yet the app's 2 MiB frame never reached it (it got "
                          f"{shorts(client.frames)}): dropped without telling anyone")
                else:
                    check(code == 1009, f"the client was closed with {code} {reason!r}; a frame too big is 1009")
                await client.close()


async def part_flights():
    async with ChatApp() as app:
        gw = gateway(app, "gateway:flights")
        async with gw:
            sid = await login(app)
            client = await connect(gw.ws_url("/socket?session=flights"), sid)
            sess = await app.next_session(0)
            with step(f"flight search (docs/scenarios.md), turn 1: {FLIGHT1!r}"):
                await client.say(FLIGHT1, "f1", "trip")
                r = await reply(client, "f1")
                check(r.kind == "end", f"reply {shorts(r.frames)}")
                cg = chatgate_of(await wait_say(sess, "f1"), "f1")
                want = {"from": "Nairobi", "to": "London", "departure_date": "2026-02-10"}
                check(cg["service"] == "travel" and cg["params"] == want,
                      f"f1: chatgate service/params should be travel {want}: {short(cg, 600)}")
            with step(f"turn 2: {FLIGHT2!r}: chatgate.params merged, service travel"):
                await client.say(FLIGHT2, "f2", "trip")
                r = await reply(client, "f2")
                check(r.kind == "end", f"reply {shorts(r.frames)}")
                say = await wait_say(sess, "f2")
                check(say["body"] == FLIGHT2, f"the body should be what the user wrote: {short(say)}")
                cg = chatgate_of(say, "f2")
                check(cg["service"] == "travel", f"chatgate.service should be travel: {short(cg, 600)}")
                check(cg["params"] == WANT2, f"chatgate.params should be {WANT2}, got {short(cg['params'])}")
                check(cg["room"] == "trip" and cg["route"] == "app" and cg["enriched"] is None,
                      f"room trip, route app, enriched null expected: {short(cg, 600)}")
                check(cg["resolution"] is None, f"no resolution expected: {short(cg, 600)}")
                check(cg["last_tool_result"] is None, f"no tool result yet: {short(cg, 600)}")
            tool = {"type": "flights", "offers": [{"flight": "KQ100", "price": 180000}]}
            with step("a tool result the app keeps (its end frame's state) goes back in the next chatgate object"):
                await client.say("Here are two offers STATE:" + json.dumps({"last_tool_result": tool}), "f3", "trip")
                r = await reply(client, "f3")
                check(r.kind == "end", f"reply {shorts(r.frames)}")
                await client.say("the cheaper one", "f4", "trip")
                r = await reply(client, "f4")
                check(r.kind == "end", f"reply {shorts(r.frames)}")
                cg = chatgate_of(await wait_say(sess, "f4"), "f4")
                check(cg["last_tool_result"] == tool, f"chatgate.last_tool_result should be {tool}: {short(cg, 600)}")
            await client.close()


def chunks_of(frames, mid):
    return [f for f in frames if isinstance(f, dict) and f.get("reply_to") == mid and f.get("kind") == "chunk"]


async def wait_chunks(client, mid, n, timeout=T):
    """Read until `n` chunks of `mid` came."""
    deadline = time.monotonic() + timeout
    while len(chunks_of(client.frames, mid)) < n:
        left = deadline - time.monotonic()
        check(left > 0, f"no {n} chunks of {mid} within {timeout}s: {shorts(client.frames[-6:])}")
        try:
            await client.recv(left)
        except asyncio.TimeoutError:
            pass


def after(frames, frame):
    i = next(k for k, f in enumerate(frames) if f is frame)
    return frames[i + 1:]


async def part_cancel():
    async with ChatApp() as app:
        gw = gateway(app, "gateway:cancel")
        async with gw:
            sid = await login(app)
            client = await connect(gw.ws_url("/socket"), sid)
            sess = await app.next_session(0)
            with step("'stop' while a long reply streams: the app gets the halt frame, the client halted"):
                await client.say("Tell me a long story", "L1", "trip")
                await wait_chunks(client, "L1", 3)
                await client.say("stop", "s1", "trip")
                r = await reply(client, "L1", "L1 after stop")
                check(r.kind == "halted",
                      f"L1 should end with halted, got {short(r.last)} after {len(r.chunks)} chunks")
                halts = [f for f in sess.frames if isinstance(f, dict) and f.get("kind") == "halt"]
                check(halts == [{"kind": "halt", "msg_id": "L1"}],
                      f"the app should have got exactly {{'kind':'halt','msg_id':'L1'}}, got {shorts(halts)}")
                check(len(sess.sent_about("L1", "chunk")) < 20, "the app sent the whole reply anyway")
            with step("no chunk of the halted reply after halted; 'stop' itself is handled"):
                frames = client.frames + await client.read_for(0.5)
                halted = next(f for f in frames if isinstance(f, dict) and f.get("kind") == "halted")
                late = chunks_of(after(frames, halted), "L1")
                check(not late, f"{len(late)} chunks of L1 came after halted: {shorts(late)}")
                stop_say = sess.say("s1")
                print(f"   note: 'stop' {'was forwarded to the app with chatgate.resolution ' + short(stop_say.get('chatgate', {}).get('resolution')) if stop_say else 'was not forwarded to the app'}",
                      flush=True)
            with step("the client's own halt frame: reaches the app once, the reply stops"):
                n_halts = len(sess.halts)
                await client.say("Another long one, please", "L2", "trip")
                await wait_chunks(client, "L2", 3)
                await client.halt("L2")
                r = await reply(client, "L2", "L2 after the client's halt")
                check(r.kind == "halted", f"L2 should end with halted, got {short(r.last)}")
                frames = await client.read_for(0.4)
                late = chunks_of(frames, "L2")
                check(not late, f"{len(late)} chunks of L2 came after halted: {shorts(late)}")
                got = [m for m, _ in sess.halts[n_halts:]]
            with step("a message whose id is an integer: 'stop' sends the app a halt with that integer, which the "
                      "app's reply keyed by number honours (issue 39's ninth round: it got \"7\" and went on)"):
                await client.say("Yet another long one", 7, "trip")
                await wait_chunks(client, 7, 3)
                await client.say("stop", 8, "trip")
                r = await reply(client, 7, "7 after stop")
                check(r.kind == "halted", f"7 should end with halted, got {short(r.last)} after {len(r.chunks)} chunks")
                halts = [f for f in sess.frames if isinstance(f, dict) and f.get("kind") == "halt"]
                check(halts[-1] == {"kind": "halt", "msg_id": 7}, f"the app's last halt: {shorts(halts[-1:])}")
            with step("the session goes on: the next say gets its whole reply"):
                await client.say("are you there?", "c3", "trip")
                r = await reply(client, "c3")
                check(r.kind == "end" and r.text == "you said: are you there? w2", f"reply {shorts(r.frames)}")
            with step("the app got the client's halt once (not also a copy from the gateway)"):
                check(got == ["L2"], f"the app should have got one halt for L2, got halts for {got}: "
                                     f"{shorts([f for f in sess.frames if isinstance(f, dict) and f.get('kind') == 'halt'])}")
            await client.close()


def check_relay_stopped(client, sess, mid, trigger):
    """No chunk of `mid` the app sent after it had received the frame `trigger` (a say's
    msg_id or "halt") reached the client: those were sent after the gateway had the cancel."""
    def is_trigger(f):
        return isinstance(f, dict) and (f.get("kind") == "halt" if trigger == "halt" else f.get("msg_id") == trigger)
    at = next((t for f, t in zip(sess.frames, sess.received_at) if is_trigger(f)), None)
    check(at is not None, f"the app never got the {trigger!r} frame: {sess.describe()}")
    sent_before = sum(1 for raw, t in zip(sess.sent, sess.sent_at)
                      if t < at and isinstance(raw, str) and f'"reply_to": "{mid}"' in raw and '"chunk"' in raw)
    got = chunks_of(client.frames, mid)
    check(len(got) <= sent_before,
          f"the client got {len(got)} chunks of {mid}; the app had sent {sent_before} of "
          f"{len(sess.sent_about(mid, 'chunk'))} when the {trigger!r} frame reached it: the rest of the cancelled "
          f"reply was relayed")
    ends = [f for f in client.frames if isinstance(f, dict) and f.get("reply_to") == mid and f.get("kind") != "chunk"]
    print(f"   note: the client got {len(got)} of 20 chunks of {mid}, and of its end frame: {shorts(ends)}", flush=True)


async def part_cancel_relay(scenario):
    """A mapping without cancel_frame, and an app that cannot stop a reply (it records halts
    and goes on): the gateway stops relaying the rest of the cancelled reply."""
    async with ChatApp(honour_halt=False) as app:
        gw = gateway(app, f"gateway:cancel-noframe-{scenario}", cancel_frame=False)
        async with gw:
            sid = await login(app)
            client = await connect(gw.ws_url("/socket"), sid)
            sess = await app.next_session(0)
            if scenario == "phrase":
                with step("no cancel_frame: 'stop' while a long reply streams stops relaying it; no halt sent"):
                    await client.say("Tell me a long story", "L1", "trip")
                    await wait_chunks(client, "L1", 3)
                    await client.say("stop", "s1", "trip")
                    ok = await harness.wait_until(lambda: sess.sent_about("L1", "end"), 5)
                    check(ok, f"the app should stream L1 to its end (nobody halts it): {sess.describe()}")
                    await client.read_for(0.4)
                    check(not sess.halts, f"the app got a halt though the mapping has no cancel_frame: {sess.halts}")
                    check_relay_stopped(client, sess, "L1", "s1")
            elif scenario == "halt":
                with step("no cancel_frame: the client's own halt frame goes to the app as it is and stops "
                          "the relaying; non-chat frames (a binary echo) still pass meanwhile"):
                    await client.say("Tell me a long story", "L1", "trip")
                    await wait_chunks(client, "L1", 3)
                    await client.halt("L1")
                    # the binary goes once the halt has reached the app (the reply's tail is held back then)
                    ok = await harness.wait_until(lambda: any(isinstance(f, dict) and f.get("kind") == "halt"
                                                              for f in sess.frames), 5)
                    check(ok, f"the client's halt frame never reached the app: {sess.describe()}")
                    blob = b"\x00image-bytes\xff" * 10
                    await client.send_binary(blob)
                    ok = await harness.wait_until(lambda: sess.sent_about("L1", "end"), 5)
                    check(ok, f"the app should stream L1 to its end (it ignores halts): {sess.describe()}")
                    await client.read_for(0.4)
                    halts = [f for f in sess.frames if isinstance(f, dict) and f.get("kind") == "halt"]
                    check(halts == [{"kind": "halt", "msg_id": "L1"}],
                          f"the app should have got the client's halt frame once: {shorts(halts)}")
                    check(blob in sess.raw, "the app never got the binary frame")
                    check(blob in client.received,
                          f"the app's binary echo, sent while the cancelled reply's tail was held back, never "
                          f"reached the client (non-chat frames must pass); the client got {shorts(client.frames[-6:])}")
                    check_relay_stopped(client, sess, "L1", "halt")
            elif scenario == "halt_other":
                with step("no cancel_frame: the client's own halt naming another message (client.cancel_id) "
                          "stops nothing: the reply in flight reaches the client to its end"):
                    await client.say("Tell me a long story", "L9", "trip")
                    await wait_chunks(client, "L9", 3)
                    await client.halt("someone-else")
                    r = await reply(client, "L9", "L9 after a halt of another message")
                    sent, got = len(sess.sent_about("L9", "chunk")), len(chunks_of(client.frames, "L9"))
                    check(r.kind == "end" and got == sent,
                          f"L9 should reach the client whole: {got} of the {sent} chunks the app sent, "
                          f"then {short(r.last)}")
            elif scenario == "say_after":
                with step("no cancel_frame: 'nevermind' then at once another say, while the stopped reply "
                          "still streams at the app: that say is answered, the stopped reply stays stopped"):
                    await client.say("One more long story", "L2", "trip")
                    await wait_chunks(client, "L2", 2)
                    await client.say("nevermind", "s2", "trip")
                    await client.say("hello again", "c4", "trip")
                    r = await reply(client, "c4")
                    check(r.kind == "end" and r.text == "you said: hello again w2", f"reply {shorts(r.frames)}")
                    ok = await harness.wait_until(lambda: sess.sent_about("L2", "end"), 5)
                    check(ok, "the app should stream L2 to its end")
                    await client.read_for(0.3)
                    check_relay_stopped(client, sess, "L2", "s2")
            with step("the session goes on: the next say gets its whole reply"):
                await client.say("are you there?", "c3", "trip")
                r = await reply(client, "c3")
                check(r.kind == "end" and r.text == "you said: are you there? w2", f"reply {shorts(r.frames)}")
            await client.close()


async def part_state():
    async with ChatApp() as app:
        gw = gateway(app, "gateway:state")
        async with gw:
            sid = await login(app)
            client = await connect(gw.ws_url("/socket"), sid)
            sess = await app.next_session(0)
            directive = {"service": "travel", "params": {"cabin_class": "business"}}
            with step("an end frame with chatgate_state reaches the client without it"):
                await client.say("Plan my trip STATE:" + json.dumps(directive), "c1", "st")
                r = await reply(client, "c1")
                sent_end = sess.sent_about("c1", "end")
                check(sent_end and sent_end[0].get("chatgate_state") == directive,
                      f"the app's end frame should carry the directive: {shorts(sent_end)}")
                check(r.last == {"kind": "end", "reply_to": "c1"},
                      f"the client's end frame should be {{'kind':'end','reply_to':'c1'}}: {short(r.last)}")
                check(r.chunks == ["you said: ", "Plan my trip", " w2"], f"chunks {r.chunks}")
            with step("the next say carries the directive's params"):
                await client.say("Any seats left?", "c2", "st")
                await reply(client, "c2")
                cg = chatgate_of(await wait_say(sess, "c2"), "c2")
                check(cg["service"] == "travel", f"chatgate.service should be travel: {short(cg, 600)}")
                check(cg["params"].get("cabin_class") == "business",
                      f"chatgate.params should have cabin_class business: {short(cg['params'])}")
            with step("... and merges with the rules' params on the turn after"):
                await client.say(FLIGHT1, "c3", "st")
                await reply(client, "c3")
                cg = chatgate_of(await wait_say(sess, "c3"), "c3")
                want = {"from": "Nairobi", "to": "London", "departure_date": "2026-02-10", "cabin_class": "business"}
                check(cg["params"] == want, f"chatgate.params should be {want}: {short(cg['params'])}")
            await client.close()


async def part_failure():
    async with ChatApp() as app:
        with step("app unreachable (nothing listens): the client's handshake is answered 502"):
            dead = f"ws://127.0.0.1:{harness.free_port()}"
            async with gateway(app, "gateway:unreachable", app_url=dead) as gw:
                try:
                    client = await ChatClient.connect(gw.ws_url("/socket"), "whatever")
                    harness.fail("the handshake got 101 although the app could not be reached")
                except websockets.InvalidStatusCode as err:
                    check(err.status_code == 502, f"the handshake was answered {err.status_code}, expected 502")
                # and the gateway is fine
                client = await Client.connect(gw)
                await client.close()

        gw = gateway(app, "gateway:failure")
        async with gw:
            url = gw.ws_url("/socket")
            sid = await login(app)
            with step("the app closes with 4002 'bye' mid-session: the client gets 4002 'bye'"):
                client = await connect(url, sid)
                await client.say("hi", "c1")
                await reply(client, "c1")
                sess = app.sessions[-1]
                await sess.close(4002, "bye")
                code, reason, frames = await client.wait_closed(3)
                check((code, reason) == (4002, "bye"), f"expected close 4002 'bye', got {code} {reason!r}")
            with step("the app closes with 4002 'bye' while a reply streams: the same"):
                client = await connect(url, sid)
                await client.say("Tell me a long story", "L1")
                await wait_chunks(client, "L1", 2)
                await app.sessions[-1].close(4002, "bye")
                code, reason, frames = await client.wait_closed(3)
                check((code, reason) == (4002, "bye"), f"expected close 4002 'bye', got {code} {reason!r}")
            with step("the app closes with an empty close frame (no status: 1005, which may not be sent on): "
                      "the client gets 1000, a normal closure, not the 1011 of an app gone"):
                client = await connect(url, sid)
                await client.say("hi", "c2")
                await reply(client, "c2")
                sess = app.sessions[-1]
                await sess.ws.write_close_frame(websockets.frames.Close(1005, ""), b"")
                code, reason, frames = await client.wait_closed(3)
                check(code == 1000, f"expected close 1000, got {code} {reason!r}")
            with step("the app drops the TCP connection (no close frame): the client gets 1011"):
                client = await connect(url, sid)
                await client.say("Tell me a long story", "L2")
                await wait_chunks(client, "L2", 2)
                app.sessions[-1].abort()
                code, reason, frames = await client.wait_closed(3)
                check(code == 1011, f"expected close 1011, got {code} {reason!r}")
            with step("the client closes: the app's connection closes within 1 s"):
                client = await connect(url, sid)
                await client.say("hi", "c2")
                await reply(client, "c2")
                sess = app.sessions[-1]
                await client.close()
                check(await sess.wait_closed(1.0), "the app's connection was still open 1 s after the client closed")
                check(sess.close_code not in (None, 1005, 1006),
                      f"the gateway should close the app's connection with a close frame (1000/1001), the app saw "
                      f"{sess.close_code} {sess.close_reason!r}")
            with step("the client sends a chat message that waits for its dialog (another tab's reply runs), "
                      "a presence frame behind it, and closes: the app gets the presence, then the close (issue 39's "
                      "ninth round: the app's queue was dropped at the client's close)"):
                tab1 = await connect(url, sid)
                await tab1.say("Tell me a long story", "L9", "shared")
                await wait_chunks(tab1, "L9", 2)
                tab2 = await connect(url, sid)  # the same cookie: the same user, so the same dialog
                sess2 = app.sessions[-1]
                await tab2.say("and one more thing", "w9", "shared")  # waits for L9's turn
                await tab2.presence("leaving")
                await tab2.ws.close()
                check(await sess2.wait_closed(3.0), "the app's connection was still open 3 s after the client closed")
                got = [f for f in sess2.frames if isinstance(f, dict)]
                check({"kind": "presence", "status": "leaving"} in got,
                      f"the presence frame the client sent before its close never reached the app: it got "
                      f"{shorts(got)}, then close {sess2.close_code}")
                check(sess2.close_code == 1001, f"the app's connection should close with 1001, "
                                                f"the app saw {sess2.close_code} {sess2.close_reason!r}")
                await reply(tab1, "L9")
                await tab1.close()
            with step("the client closes mid-reply: the app's connection closes within 1 s"):
                client = await connect(url, sid)
                await client.say("Tell me a long story", "L3")
                await wait_chunks(client, "L3", 2)
                sess = app.sessions[-1]
                await client.close()
                check(await sess.wait_closed(1.0), "the app's connection was still open 1 s after the client closed")
            with step("the client drops TCP mid-reply: the app's connection closes within 1 s"):
                client = await connect(url, sid)
                await client.say("Tell me a long story", "L4")
                await wait_chunks(client, "L4", 2)
                sess = app.sessions[-1]
                client.ws.transport.abort()
                check(await sess.wait_closed(1.0), "the app's connection was still open 1 s after the client dropped")
            with step("the gateway still serves after all that"):
                client = await connect(url, sid)
                await client.say("hi", "c5")
                r = await reply(client, "c5")
                check(r.kind == "end", f"reply {shorts(r.frames)}")
                await client.close()
                gw.assert_alive()


async def part_config():
    """A wrong value in the mapping: exit 2, "FILE:LINE:COL: dropin.KEY: message" (issue 6 item 1),
    LINE being the line of that key in the file."""
    for where, mutate, key_text in (
            ("dropin.client.text", lambda d: d["client"].__setitem__("text", "body"), '"text": "body"'),
            ("dropin.app", lambda d: d.__setitem__("app", "http://127.0.0.1:9/"), '"app": "http://127.0.0.1:9/"')):
        with step(f"{where} wrong: exit 2 with 'FILE:LINE:COL: {where}: ...' naming its line"):
            cfg = config("ws://127.0.0.1:9")
            mutate(cfg["dropin"])
            code, out, path = await harness.gateway_exit(cfg)
            check(code == 2, f"exit status {code}, expected 2:\n{out}")
            match = re.search(re.escape(str(path)) + r":(\d+):(\d+): " + re.escape(where) + r": \S", out)
            check(match, f"stderr should say '{path}:LINE:COL: {where}: ...':\n{out}")
            lines = path.read_text().splitlines()
            line = int(match.group(1))
            check(1 <= line <= len(lines) and key_text in lines[line - 1],
                  f"line {line} of the config should be the one with {key_text}; it is "
                  f"{lines[line - 1] if 1 <= line <= len(lines) else '(none)'!r}")


async def main(args):
    await independent(part_unchanged_client())
    await independent(part_cookie())
    await independent(part_passthrough())
    await independent(part_two_clients())
    await independent(part_over_max_frame())
    await independent(part_flights())
    await independent(part_cancel())
    for scenario in ("phrase", "halt", "halt_other", "say_after"):
        await independent(part_cancel_relay(scenario))
    await independent(part_state())
    await independent(part_failure())
    await independent(part_config())
    await independent(part_shutdown())


if __name__ == "__main__":
    harness.run(main, timeout=110)
