"""Drop-in mode in front of Tornado's WebSocket chat demo, configured from the README and
docs/dropin.md alone, as a new user would.

The app is tests/e2e/tornado_chat.py (a small copy of Tornado's demos/websocket/chatdemo.py,
run as its own process with Debian's python3-tornado): a page at `/`, a WebSocketHandler at
`/chatsocket` taking `{"body": "..."}` and writing `{"id": uuid, "body", "html"}` to every
open connection (the sender too), and Tornado's own `check_origin`, which refuses (HTTP 403) a
handshake whose Origin's host:port is not its `Host` header. The clients are `websockets`
clients sending the Origin a browser on the app's page sends, `http://127.0.0.1:APPPORT`;
they connect to `ws://127.0.0.1:GWPORT/chatsocket`, the one URL a user changes.

The config: what README.md's "Put chatgate in front of your chat app" says, read from the
README when the test runs (`readme_config`):
- its first example, the ```json block after "With `examples/dropin.json`:" (its annotations
  cut off; examples/dropin.json itself if the block no longer parses), every key kept as it is
  but those naming the example app: `path` becomes `/chatsocket` and `app`
  `ws://127.0.0.1:APPPORT` ("The one change: ... In production, point ... `dropin.app` at the
  app's internal address"); the example app's `subprotocols` (`chat.v2`) and `user_cookie`
  (`sid`) go, since Tornado's demo has neither; the top-level `listen` goes (the harness gives
  `--listen`);
- the mapping for this app's frames, from docs/dropin.md's "Apps someone else wrote": `client.chat`
  `{"pointer": "/body", "exists": true}` ("Tornado's chat demo sends {"body", "_xsrf"} with
  no type field"), `client.text` `/body`; `app_frames.text` `/body` (the broadcast's text);
  no ids, end or cancelled marker, or cancel_frame: the demo has none of them (and
  `app_frames.id` without `client.id` is refused at start);
- `allow_origin: ["http://127.0.0.1:APPPORT"]`, from docs/dropin.md's "The one change": "A browser page served from another origin
  than chatgate's needs that origin in `allow_origin` ..., or the handshake gets 403; the
  browser's Origin is passed on to the app, so the app's own check still works";
- `CHATGATE_NOW=2026-02-03T10:00:00Z` as in the README's command; the shipped rules.
Nothing else is added: `dropin.host` is left to its default ("app", the app's own
host:port, which Tornado's check_origin compares with the page's Origin).

Parts:
- a. the app alone behaves as Tornado's demo (page, 101 for its own origin, 403 for
  another); through the gateway, a client with the app page's Origin gets 101, stays open,
  and chats: `{"body": "hello"}` comes back as the app's broadcast, which a client connected
  to the app directly gets too (one chat room);
- b. group chat and the cancel hold: users A and B (no cookies: two users) through the
  gateway; A sends "stop" (a cancel phrase of rules/10-cancel.rules) with nothing streaming,
  and again right after a message of its own (whose reply, the broadcast, has no end marker:
  the gateway's reply is still "in flight" for the 2 s reply gap); B sends a message 0.3 s
  after each "stop". A's "stop", B's message (and A's own message) must reach both A and B
  within SLOW_S of being sent, as they reach a client connected to the app directly;
On main 63bc085 (`dropin.host` "client" by default): a. the gateway answers 101, opens the
app connection with `Host: 127.0.0.1:GWPORT`, Tornado answers 403, and the client is closed
with 1008 "the app refused the connection with HTTP 403" (without allow_origin the gateway
itself refuses the app page's Origin with 403); b. "stop" with nothing streaming passes, but
"stop" 0.2 s after A's own line starts a hold on A's connection (no cancel_frame, id-less
frames): A's echoed "stop" and B's line are never relayed to A (dropped, not delayed: the log
says "2 frames of it were not relayed" once the app is quiet for 2 s; a line every second
keeps the hold up to turn_timeout_ms, 60 s); B gets all.

The handshake order (issue 35, item 9): the gateway answers the client's handshake only once
the app has answered its own, so a client connecting right after another is one of the app's
waiters before the other's first message (part_handshake_order: 20 rounds, none missed;
before, 6 to 18 of 20 were missed through the gateway, 0 direct).
"""

import asyncio
import json
import re
import sys
import time
from pathlib import Path

import websockets

import harness
from harness import Gateway, check, independent, step

NOW = "2026-02-03T10:00:00Z"
T = harness.DEFAULT_TIMEOUT
SLOW_S = 1.0   # a chat line through the gateway must reach every client within this
LATE_S = 2.5   # how long part b watches for lines that did not come in time (to report them)
HERE = Path(__file__).resolve().parent


# -------------------------------------------------------------------------------- the app


class TornadoChat:
    """tornado_chat.py as a subprocess on a free port of 127.0.0.1; its log in a file."""

    def __init__(self, name="tornado"):
        self.name = name
        self.dir = harness.temp_dir("chatgate-e2e-tornado-")
        self.log_path = self.dir / "app.log"
        self.proc = None
        self.port = None

    async def __aenter__(self):
        self._log = open(self.log_path, "wb")
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, str(HERE / "tornado_chat.py"), "--port", "0",
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=self._log)
        try:
            line = await asyncio.wait_for(self.proc.stdout.readline(), T)
        except asyncio.TimeoutError:
            line = b""
        m = re.match(rb"listening on 127\.0\.0\.1:(\d+)", line)
        if not m:
            await self.__aexit__()
            harness.fail(f"tornado_chat.py did not start (stdout {line!r}); {self.log_tail()}")
        self.port = int(m.group(1))
        return self

    async def __aexit__(self, *exc):
        if self.proc and self.proc.returncode is None:
            self.proc.terminate()
            try:
                await asyncio.wait_for(self.proc.wait(), 5)
            except asyncio.TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        self._log.close()
        return False

    @property
    def origin(self):
        """The Origin a browser on the app's own page sends."""
        return f"http://127.0.0.1:{self.port}"

    def ws_url(self, path="/chatsocket"):
        return f"ws://127.0.0.1:{self.port}{path}"

    def log_tail(self, lines=8):
        text = self.log_path.read_text(errors="replace").splitlines() if self.log_path.exists() else []
        return f"the app's log ({self.log_path}), last lines:\n" + "\n".join("   | " + x for x in text[-lines:])


# ------------------------------------------------------------------------ the README's config


def readme_example():
    """The README's first drop-in example as a config dict, and where it was read from."""
    readme = (harness.REPO_ROOT / "README.md").read_text()
    section = readme.split("## Put chatgate in front of your chat app", 1)
    block = re.search(r"```json\n(.*?)```", section[1], re.S) if len(section) == 2 else None
    if block:
        # annotations follow a value after two or more spaces: "path": "/socket",    the app's ...
        body = "\n".join(re.sub(r'(?<=[,{}\[\]"0-9el])\s{2,}\S.*$', "", line)
                         for line in block.group(1).splitlines())
        for text in (body, "{" + body + "}"):
            try:
                cfg = json.loads(text)
            except ValueError:
                continue
            if isinstance(cfg, dict) and isinstance(cfg.get("dropin"), dict):
                return cfg, "README.md's first ```json block of the drop-in section"
    print("   note: the README's first drop-in example did not parse; using examples/dropin.json")
    return json.loads((harness.REPO_ROOT / "examples" / "dropin.json").read_text()), "examples/dropin.json"


def readme_config(app):
    """What a new user writes for Tornado's chat demo from the README (the module's docstring)."""
    example, source = readme_example()
    cfg = {k: v for k, v in example.items() if k != "listen"}
    dropin = {k: v for k, v in cfg["dropin"].items() if k not in ("subprotocols", "user_cookie")}
    dropin["path"] = "/chatsocket"
    dropin["app"] = f"ws://127.0.0.1:{app.port}"
    dropin["client"] = {"chat": {"pointer": "/body", "exists": True}, "text": "/body"}
    dropin["app_frames"] = {"text": "/body"}
    cfg["dropin"] = dropin
    origins = cfg.get("allow_origin", [])
    cfg["allow_origin"] = (origins if isinstance(origins, list) else [origins]) + [app.origin]
    return cfg, source


def gateway(app, name, allow_origin=()):
    """The gateway with readme_config; allow_origin: more origins the gateway lets through."""
    cfg, source = readme_config(app)
    cfg["allow_origin"] = cfg.get("allow_origin", []) + list(allow_origin)
    print(f"   config ({source}, adapted): {json.dumps(cfg, separators=(',', ':'))}")
    return Gateway(config=cfg, env={"CHATGATE_NOW": NOW}, name=name)


# ---------------------------------------------------------------------------- the clients


class Chatter:
    """A WebSocket client of the chat (through the gateway or direct): every frame it gets,
    with the time it came, read by a task of its own."""

    def __init__(self, who, ws):
        self.who = who
        self.ws = ws
        self.got = []  # (monotonic time, frame as parsed, or as it came when not JSON)
        self.closed = None  # (code, reason) once the connection closed
        self.task = asyncio.create_task(self._read())

    @classmethod
    async def open(cls, who, url, origin):
        try:
            ws = await websockets.connect(url, origin=origin, open_timeout=T)
        except websockets.InvalidStatusCode as err:
            harness.fail(f"{who}: the handshake to {url} (Origin {origin}) was refused with HTTP {err.status_code}")
        except (OSError, asyncio.TimeoutError, websockets.InvalidHandshake) as err:
            harness.fail(f"{who}: could not connect to {url}: {err!r}")
        return cls(who, ws)

    async def _read(self):
        try:
            async for frame in self.ws:
                try:
                    obj = json.loads(frame)
                except (TypeError, ValueError):
                    obj = frame
                self.got.append((time.monotonic(), obj))
        except websockets.ConnectionClosed:
            pass
        self.closed = (self.ws.close_code, self.ws.close_reason)

    async def say(self, body):
        try:
            await self.ws.send(json.dumps({"body": body}))
        except websockets.ConnectionClosed:
            harness.fail(f"{self.who} could not send {body!r}: the connection was closed with "
                         f"{self.ws.close_code} {self.ws.close_reason!r}; it got {self.bodies()}")
        return time.monotonic()

    def bodies(self):
        return [f.get("body") if isinstance(f, dict) else f for _, f in self.got]

    def when(self, body):
        """When the broadcast of `body` came, or None."""
        return next((t for t, f in self.got if isinstance(f, dict) and f.get("body") == body), None)

    async def wait_body(self, body, timeout=T):
        ok = await harness.wait_until(lambda: self.when(body) is not None or self.closed, timeout)
        if self.when(body) is None:
            why = (f"the connection was closed with {self.closed[0]} {self.closed[1]!r}" if self.closed
                   else f"nothing within {timeout:.1f} s")
            harness.fail(f"{self.who} never got the broadcast of {body!r}: {why}; it got {self.bodies()}")
        return ok

    async def close(self):
        await self.ws.close()
        await asyncio.wait_for(self.task, T)


# -------------------------------------------------------------------------------------- a


async def part_origin():
    async with TornadoChat() as app:
        with step("the app alone is Tornado's demo: a page at / with the form; /chatsocket answers 101 "
                  "to its own page's Origin and 403 to another's; {\"body\"} comes back as {id, body, html}"):
            status, _, page = await asyncio.to_thread(harness.http_get, f"{app.origin}/")
            check(status == 200 and b'id="messageform"' in page and b'name="body"' in page,
                  f"GET / answered {status} {page[:200]!r}")
            try:
                await websockets.connect(app.ws_url(), origin="http://evil.example", open_timeout=T)
                harness.fail("the app accepted a handshake with Origin http://evil.example")
            except websockets.InvalidStatusCode as err:
                check(err.status_code == 403, f"Origin http://evil.example: HTTP {err.status_code}, expected 403")
            direct = await Chatter.open("direct client", app.ws_url(), app.origin)
            await direct.say("ping")
            await direct.wait_body("ping")
            frame = next(f for _, f in direct.got if isinstance(f, dict) and f.get("body") == "ping")
            check(set(frame) == {"id", "body", "html"} and f'id="m{frame["id"]}"' in frame["html"],
                  f"the broadcast is {frame}")
        async with gateway(app, "gateway:origin") as gw:
            url = gw.ws_url("/chatsocket")
            with step(f"through the gateway, with the README's config: the app page's Origin ({app.origin}) "
                      f"gets 101 at {url} and the connection stays open"):
                client = await Chatter.open("the gateway's client", url, app.origin)
                await asyncio.sleep(0.5)  # a silence: a close after the 101 would come now
                if client.closed:
                    harness.fail(f"the gateway answered 101, then closed the connection with {client.closed[0]} "
                                 f"{client.closed[1]!r} before anything was sent (the app's handshake failed); "
                                 + app.log_tail(4))
            with step('it chats: {"body": "hello"} comes back as the app\'s broadcast, which a client '
                      "connected to the app directly gets too"):
                await client.say("hello")
                await client.wait_body("hello")
                await direct.wait_body("hello")
                frame = next(f for _, f in client.got if isinstance(f, dict) and f.get("body") == "hello")
                check(set(frame) == {"id", "body", "html"}, f"the client got {frame}, not the app's broadcast")
                await direct.say("hi from the app's own page")
                await client.wait_body("hi from the app's own page")
            await client.close()
            await direct.close()
            gw.assert_alive()


# -------------------------------------------------------------------------------------- b


async def lines_reach_everyone(sent, clients, direct):
    """Every line of `sent` ({body: when sent}) must reach every client within SLOW_S; watch
    LATE_S more for the missing ones, then fail naming what came late or never."""
    def late():
        out = []
        for c in clients:
            for body, t0 in sent.items():
                t = c.when(body)
                if t is None or t - t0 > SLOW_S:
                    out.append((c, body, None if t is None else t - t0))
        return out

    last = max(sent.values())
    await harness.wait_until(lambda: not late(), max(0.0, last + SLOW_S - time.monotonic()))
    if late():
        await harness.wait_until(lambda: not [x for x in late() if x[2] is None], LATE_S)
    problems = late()
    for body in sent:
        check(direct.when(body) is not None, f"the app itself never broadcast {body!r} (a client connected "
                                              f"directly got {direct.bodies()})")
    if problems:
        harness.fail("; ".join(
            f"{c.who} got {body!r} " + ("never" if d is None else f"only {d:.2f} s after it was sent")
            for c, body, d in problems)
            + ". What each got: " + "; ".join(f"{c.who}: {c.bodies()}" for c in clients)
            + f"; a client connected to the app directly got {direct.bodies()}")


async def close_all(chatters):
    """Close every client (even after a failure: a client left in a held turn would keep the
    gateway's SIGTERM waiting for that turn)."""
    await asyncio.gather(*(c.close() for c in chatters), return_exceptions=True)


async def part_group_cancel():
    async with TornadoChat() as app:
        async with gateway(app, "gateway:group") as gw:
            url = gw.ws_url("/chatsocket")
            opened = []

            async def chatter(who, where=url):
                c = await Chatter.open(who, where, app.origin)
                opened.append(c)
                return c

            try:
                direct = await chatter("a client connected to the app directly", app.ws_url())
                with step("users A and B through the gateway, nothing streaming: A sends \"stop\", B a line 0.3 s "
                          f"later; both lines reach A and B within {SLOW_S} s"):
                    a, b = await chatter("A"), await chatter("B")
                    await asyncio.sleep(0.2)  # both in the app's waiters
                    sent = {"stop": await a.say("stop")}
                    await asyncio.sleep(0.3)  # the scenario: B's line 0.3 s after A's stop
                    sent["B: are we still on for lunch?"] = await b.say("B: are we still on for lunch?")
                    await lines_reach_everyone(sent, [a, b], direct)
                with step("users A2 and B2: A2's \"stop\" 0.2 s after A2's own line came back (that broadcast is "
                          "A2's reply, still in flight for the gateway: no end marker), B2's line 0.3 s later: all "
                          f"three reach A2 and B2 within {SLOW_S} s"):
                    a, b = await chatter("A2"), await chatter("B2")
                    await asyncio.sleep(0.2)  # both in the app's waiters
                    line = "A: tell me about the trains to Mombasa"
                    sent = {line: await a.say(line)}
                    await a.wait_body(line, 2)
                    await asyncio.sleep(0.2)  # the scenario: A2's stop 0.2 s after its line came back
                    sent["stop"] = await a.say("stop")
                    await asyncio.sleep(0.3)  # the scenario: B2's line 0.3 s after the stop
                    sent["B: the 9:00 one"] = await b.say("B: the 9:00 one")
                    await lines_reach_everyone(sent, [a, b], direct)
            finally:
                await close_all(opened)
            gw.assert_alive()


# -------------------------------------------------------------------------------------- c


async def part_handshake_order():
    """Issue 35, item 9: the gateway answers a client's handshake only once the app has
    answered its own, and passes on what the app answered."""
    async with TornadoChat() as app:
        # another origin the gateway lets through, so that the app's refusal is the one seen
        async with gateway(app, "gateway:order", allow_origin=["http://other.example"]) as gw:
            url = gw.ws_url("/chatsocket")
            with step("20 rounds: client 2 connects right after client 1, and client 1 sends once both handshakes "
                      "have returned: client 2 gets the line every time (the app knows a client when its 101 "
                      "comes; before: 6 to 18 misses in 20, 0 direct)"):
                missed = []
                for i in range(20):
                    c1 = await Chatter.open("client 1", url, app.origin)
                    c2 = await Chatter.open("client 2", url, app.origin)
                    first, probe = f"first {i}", f"probe {i}"
                    await c1.say(first)
                    await c1.wait_body(first)
                    await c2.say(probe)
                    await c2.wait_body(probe)
                    if c2.when(first) is None:
                        missed.append(i)
                    await close_all([c1, c2])
                check(not missed, f"client 2 missed client 1's first line in rounds {missed}")
            with step("the app's 101 sets a cookie (Set-Cookie: chat_seen=1): the client's 101 carries it"):
                ws = await websockets.connect(url, origin=app.origin, open_timeout=T)
                cookies = ws.response_headers.get_all("Set-Cookie")
                await ws.close()
                check(any(c.startswith("chat_seen=1") for c in cookies), f"the client's 101 had Set-Cookie {cookies}")
            with step("a page of another origin (allowed by the gateway, not by the app): the app answers its "
                      "handshake 403, and so the gateway answers the client's (before: 101, then a close 1008)"):
                try:
                    ws = await websockets.connect(url, origin="http://other.example", open_timeout=T)
                    await ws.close()
                    harness.fail("the client's handshake got 101 although the app refused its own with 403")
                except websockets.InvalidStatusCode as err:
                    check(err.status_code == 403, f"the client's handshake was answered {err.status_code}, expected 403")
            gw.assert_alive()


async def main(args):
    started = time.monotonic()
    await independent(part_origin())
    await independent(part_group_cancel())
    await independent(part_handshake_order())
    print(f"-- all parts in {time.monotonic() - started:.1f} s")


if __name__ == "__main__":
    harness.run(main, timeout=80)
