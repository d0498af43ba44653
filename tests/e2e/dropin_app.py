"""A small chat app with its own WebSocket protocol, for chatgate's drop-in mode (issue 6).

Its protocol is nothing like chatgate.v1, on purpose: the drop-in tests (test_dropin.py) and
the README demo put chatgate in front of it without changing the app or its client, only the
URL the client connects to.

The app (`ChatApp`), on one port:
- `GET /login` answers `Set-Cookie: sid=<new session id>` (plain HTTP, no WebSocket).
- `ws://HOST:PORT/socket[?query]`, subprotocol `chat.v2` (required: a handshake without it
  gets HTTP 400). The client must send the cookie `sid` it got from /login (or one a test
  registered with `issue_sid()`); a missing or unknown sid: the app accepts the handshake
  and closes at once with 4001 "no session".
- Client -> app, text JSON:
    {"kind":"say","msg_id":"c1","conversation":"trip","body":"Find flights ..."}  a chat message
    {"kind":"typing","conversation":"trip"}        typing indicator (not chat; no answer)
    {"kind":"presence","status":"online"}          presence (not chat; no answer)
    {"kind":"halt","msg_id":"c1"}                  stop the reply to c1 (its own cancel)
  and binary frames, which the app echoes back as they are.
- App -> client: {"kind":"typing"} before a reply, then {"kind":"chunk","reply_to":"c1",
  "body":"..."} every 50 ms (20 chunks when the body has the word "long", else 3), then
  {"kind":"end","reply_to":"c1"}; after a halt, {"kind":"halted","reply_to":"c1"} and no
  more chunks of c1. When the body holds "STATE:" followed by JSON, the end frame carries
  that JSON under "chatgate_state" (a state directive for chatgate; the text before
  "STATE:" is the visible body).

Every connection is a `Session` that records what the app received (raw and parsed, in
order, including the `chatgate` object a gateway adds to say frames), what it sent, the
halts, the handshake's path + query, headers and subprotocol, and when and how it closed.

`ChatClient` is the app's own client logic, the same whether it talks to the app or to a
gateway in front of it: log in, connect with the cookie and subprotocol, send frames, read a
reply until its end.

Standalone (the README demo), with Debian's /usr/bin/python3 and python3-websockets:
    python3 tests/e2e/dropin_app.py --port 9000             # the app; prints what it receives
    python3 tests/e2e/dropin_app.py --login http://127.0.0.1:9000/login \\
        --client ws://127.0.0.1:9000/socket?session=demo "Find me flights ..." "..."
"""

import argparse
import asyncio
import http
import json
import re
import secrets
import sys
import time
import urllib.request

import websockets

SUBPROTOCOL = "chat.v2"
PATH = "/socket"
COOKIE = "sid"


def parse_cookies(header):
    """{name: value} of a Cookie header ("a=1; sid=xyz")."""
    cookies = {}
    for part in (header or "").split(";"):
        name, eq, value = part.strip().partition("=")
        if eq and name:
            cookies.setdefault(name.strip(), value.strip())
    return cookies


def visible_body(body):
    """The body without a "STATE:{...}" directive."""
    return body.partition("STATE:")[0].strip()


def reply_chunks(body, long_chunks=20, short_chunks=3):
    """The chunk bodies the app streams in answer to `body`."""
    n = long_chunks if re.search(r"\blong\b", body, re.IGNORECASE) else short_chunks
    chunks = ["you said: ", visible_body(body)] + [f" w{i}" for i in range(2, n)]
    return chunks[:n]


def state_directive(body):
    """The JSON after "STATE:" in `body`, or None."""
    _, marker, blob = body.partition("STATE:")
    if not marker:
        return None
    return json.loads(blob)


class Session:
    """One WebSocket connection the app accepted."""

    def __init__(self, ws):
        self.ws = ws
        self.path = ws.path  # path and query, as the handshake named them
        self.headers = {k.lower(): v for k, v in ws.request_headers.raw_items()}
        self.subprotocol = ws.subprotocol
        self.sid = parse_cookies(self.headers.get("cookie")).get(COOKIE)
        self.opened_at = time.monotonic()
        self.closed_at = None
        self.closed = asyncio.Event()
        self.close_code = None    # the code the app saw (the peer's, or its own)
        self.close_reason = None
        self.raw = []       # every frame received: str (text) or bytes (binary), in order
        self.frames = []    # the same, parsed: dict/list for JSON text, bytes, or the str if not JSON
        self.received_at = []  # monotonic time of each
        self.sent = []      # every frame sent: str or bytes, in order
        self.sent_at = []
        self.halts = []     # (msg_id, monotonic time) of each halt frame received
        self.tasks = {}     # msg_id -> reply task
        self.rejected = False  # closed with 4001 at once

    @property
    def says(self):
        return [f for f in self.frames if isinstance(f, dict) and f.get("kind") == "say"]

    def say(self, msg_id):
        """The last say frame with that msg_id, or None."""
        found = None
        for f in self.says:
            if f.get("msg_id") == msg_id:
                found = f
        return found

    def sent_frames(self):
        """What the app sent, parsed (bytes as they are)."""
        return [s if isinstance(s, bytes) else json.loads(s) for s in self.sent]

    def sent_about(self, msg_id, kind=None):
        return [f for f in self.sent_frames() if isinstance(f, dict) and f.get("reply_to") == msg_id
                and (kind is None or f.get("kind") == kind)]

    def record(self, raw):
        self.raw.append(raw)
        self.received_at.append(time.monotonic())
        if isinstance(raw, bytes):
            self.frames.append(raw)
            return raw
        try:
            frame = json.loads(raw)
        except ValueError:
            frame = raw
        self.frames.append(frame)
        return frame

    async def send(self, data):
        """Send a frame (a dict as JSON text, str or bytes as is), recording it first."""
        raw = json.dumps(data) if isinstance(data, dict) else data
        self.sent.append(raw)
        self.sent_at.append(time.monotonic())
        await self.ws.send(raw)

    async def close(self, code=1000, reason=""):
        await self.ws.close(code, reason)

    def abort(self):
        """Drop the TCP connection without a close frame."""
        self.ws.transport.abort()

    async def wait_closed(self, timeout):
        try:
            await asyncio.wait_for(self.closed.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    def describe(self):
        return (f"session {self.path} sid={self.sid!r} subprotocol={self.subprotocol!r}: "
                f"received {[_short(f) for f in self.frames][-10:]}, sent {[_short(s) for s in self.sent][-10:]}")


def _short(frame, limit=140):
    if isinstance(frame, bytes):
        return f"<binary {len(frame)} bytes>"
    text = frame if isinstance(frame, str) else json.dumps(frame, ensure_ascii=False)
    return text if len(text) <= limit else text[:limit] + "..."


class ChatApp:
    """The chat app's server, on an asyncio loop (in a test's own loop, or standalone)."""

    def __init__(self, chunk_interval=0.05, long_chunks=20, short_chunks=3, honour_halt=True, verbose=False,
                 tls=None):
        self.tls = tls  # a server ssl.SSLContext: wss (the tests' tls_server())
        self.chunk_interval = chunk_interval
        self.honour_halt = honour_halt  # False: an app that cannot stop a reply (halts are only recorded)
        self.long_chunks = long_chunks
        self.short_chunks = short_chunks
        self.verbose = verbose
        self.valid_sids = set()
        self.sessions = []
        self.server = None
        self.host = "127.0.0.1"
        self.port = None

    def issue_sid(self):
        """A new valid session id (what GET /login hands out as a cookie)."""
        sid = "s" + secrets.token_hex(8)
        self.valid_sids.add(sid)
        return sid

    async def start(self, host="127.0.0.1", port=0):
        self.host = host
        self.server = await websockets.serve(
            self._handler, host, port, subprotocols=[SUBPROTOCOL],
            process_request=self._process_request, max_size=2**22, ssl=self.tls)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def stop(self):
        if self.server:
            self.server.close()
            await self.server.wait_closed()

    async def __aenter__(self):
        return await self.start()

    async def __aexit__(self, *exc):
        await self.stop()

    @property
    def url(self):
        """The app's base URL (what a drop-in config's app URL is)."""
        return f"{'wss' if self.tls else 'ws'}://127.0.0.1:{self.port}"

    @property
    def socket_url(self):
        return f"{self.url}{PATH}"

    @property
    def login_url(self):
        return f"http://127.0.0.1:{self.port}/login"

    async def next_session(self, after=0, timeout=10.0):
        """The session with index `after` (0-based), waiting for it."""
        deadline = time.monotonic() + timeout
        while len(self.sessions) <= after:
            if time.monotonic() > deadline:
                raise AssertionError(f"the chat app got no connection #{after + 1} within {timeout}s "
                                     f"({len(self.sessions)} so far)")
            await asyncio.sleep(0.01)
        return self.sessions[after]

    def _log(self, text):
        if self.verbose:
            print(f"[app] {text}", file=sys.stderr, flush=True)

    async def _process_request(self, path, headers):
        route = path.split("?", 1)[0]
        if route == "/login":
            sid = self.issue_sid()
            self._log(f"GET /login -> sid={sid}")
            return (http.HTTPStatus.OK,
                    [("Set-Cookie", f"{COOKIE}={sid}; Path=/; HttpOnly"), ("Content-Type", "text/plain")],
                    f"logged in as {sid}\n".encode())
        if route != PATH:
            return http.HTTPStatus.NOT_FOUND, [("Content-Type", "text/plain")], b"not found\n"
        offered = [p.strip() for v in headers.get_all("Sec-WebSocket-Protocol") for p in v.split(",")]
        if SUBPROTOCOL not in offered:
            return (http.HTTPStatus.BAD_REQUEST, [("Content-Type", "text/plain")],
                    f"subprotocol {SUBPROTOCOL} required\n".encode())
        return None

    async def _handler(self, ws):
        sess = Session(ws)
        self.sessions.append(sess)
        self._log(f"connection {sess.path} sid={sess.sid} subprotocol={sess.subprotocol}")
        try:
            if sess.sid not in self.valid_sids:
                sess.rejected = True
                await ws.close(4001, "no session")
                return
            async for raw in ws:
                frame = sess.record(raw)
                self._log(f"got {_short(frame, 600)}")
                if isinstance(frame, bytes):
                    await sess.send(frame)  # binary frames echo back
                    continue
                if not isinstance(frame, dict):
                    continue
                kind = frame.get("kind")
                if kind == "say":
                    mid = frame.get("msg_id")
                    old = sess.tasks.get(mid)
                    if old:
                        old.cancel()
                    sess.tasks[mid] = asyncio.create_task(self._reply(sess, frame))
                elif kind == "halt":
                    mid = frame.get("msg_id")
                    sess.halts.append((mid, time.monotonic()))
                    if not self.honour_halt:
                        continue
                    task = sess.tasks.pop(mid, None)
                    if task is not None and not task.done():
                        task.cancel()
                        await sess.send({"kind": "halted", "reply_to": mid})
        except websockets.ConnectionClosed:
            pass
        finally:
            for task in sess.tasks.values():
                task.cancel()
            sess.close_code = ws.close_code
            sess.close_reason = ws.close_reason
            sess.closed_at = time.monotonic()
            sess.closed.set()
            self._log(f"connection {sess.path} closed ({sess.close_code} {sess.close_reason!r})")

    async def _reply(self, sess, frame):
        mid = frame.get("msg_id")
        body = str(frame.get("body") or "")
        try:
            await sess.send({"kind": "typing"})
            for piece in reply_chunks(body, self.long_chunks, self.short_chunks):
                await asyncio.sleep(self.chunk_interval)
                await sess.send({"kind": "chunk", "reply_to": mid, "body": piece})
            end = {"kind": "end", "reply_to": mid}
            try:
                state = state_directive(body)
            except ValueError:
                state = None
            if state is not None:
                end["chatgate_state"] = state
            await sess.send(end)
        except websockets.ConnectionClosed:
            pass
        finally:
            if sess.tasks.get(mid) is asyncio.current_task():
                del sess.tasks[mid]


# --------------------------------------------------------------------------------------
# The app's own client


class Reply:
    """The frames read while waiting for one reply, and what they say about it."""

    def __init__(self, msg_id, frames):
        self.msg_id = msg_id
        self.frames = frames  # every frame read meanwhile, in order (other ids too)

    @property
    def mine(self):
        return [f for f in self.frames if isinstance(f, dict) and f.get("reply_to") == self.msg_id]

    @property
    def chunks(self):
        return [f.get("body") for f in self.mine if f.get("kind") == "chunk"]

    @property
    def text(self):
        return "".join(self.chunks)

    @property
    def last(self):
        return self.mine[-1] if self.mine else None

    @property
    def kind(self):
        """"end" or "halted"."""
        return self.last.get("kind") if self.last else None


class ChatClient:
    """The chat app's client, unchanged behind a gateway: only the URL it connects to differs.

    `login(url)` gets a session cookie from the app; `connect(url, sid)` opens the WebSocket
    with the cookie and the subprotocol; the senders write the app's frames; `recv` reads the
    next frame (dict, bytes, or the str of a text frame that is not JSON); `read_reply` reads
    until a reply's end (or halted). Every frame read is kept in `received` (raw) and `frames`.
    """

    def __init__(self, ws):
        self.ws = ws
        self.received = []
        self.frames = []

    @staticmethod
    def login(login_url, timeout=10.0):
        """GET the app's /login; the sid cookie it sets. (Blocking: use asyncio.to_thread.)"""
        with urllib.request.urlopen(login_url, timeout=timeout) as resp:
            for value in resp.headers.get_all("Set-Cookie") or []:
                sid = parse_cookies(value.split(";", 1)[0]).get(COOKIE)
                if sid:
                    return sid
        raise RuntimeError(f"{login_url} set no {COOKIE} cookie")

    @classmethod
    async def connect(cls, url, sid=None, cookie=None, headers=None, subprotocols=(SUBPROTOCOL,),
                      open_timeout=10.0):
        """Open `url` with the cookie `sid=...` (or the whole `cookie` header) and `headers`."""
        extra = dict(headers or {})
        if cookie is None and sid is not None:
            cookie = f"{COOKIE}={sid}"
        if cookie is not None:
            extra["Cookie"] = cookie
        ws = await websockets.connect(url, subprotocols=list(subprotocols) or None,
                                      extra_headers=extra, open_timeout=open_timeout, max_size=2**22)
        return cls(ws)

    @property
    def subprotocol(self):
        return self.ws.subprotocol

    async def send(self, frame):
        await self.ws.send(json.dumps(frame) if isinstance(frame, dict) else frame)

    async def say(self, body, msg_id, conversation="default", **extra):
        frame = {"kind": "say", "msg_id": msg_id, "conversation": conversation, "body": body}
        frame.update(extra)
        await self.send(frame)
        return frame

    async def typing(self, conversation="default"):
        await self.send({"kind": "typing", "conversation": conversation})

    async def presence(self, status="online"):
        await self.send({"kind": "presence", "status": status})

    async def halt(self, msg_id):
        await self.send({"kind": "halt", "msg_id": msg_id})

    async def send_binary(self, data):
        await self.ws.send(bytes(data))

    async def recv(self, timeout=10.0):
        """The next frame; asyncio.TimeoutError when none comes, ConnectionClosed when closed."""
        raw = await asyncio.wait_for(self.ws.recv(), timeout)
        self.received.append(raw)
        if isinstance(raw, bytes):
            frame = raw
        else:
            try:
                frame = json.loads(raw)
            except ValueError:
                frame = raw
        self.frames.append(frame)
        return frame

    async def read_reply(self, msg_id, timeout=10.0):
        """Read until the end (or halted) frame of `msg_id`; a Reply of every frame read."""
        deadline = time.monotonic() + timeout
        frames = []
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise asyncio.TimeoutError(f"no end of reply {msg_id!r} within {timeout}s; "
                                           f"read {[_short(f) for f in frames][-8:]}")
            frame = await self.recv(left)
            frames.append(frame)
            if (isinstance(frame, dict) and frame.get("reply_to") == msg_id
                    and frame.get("kind") in ("end", "halted")):
                return Reply(msg_id, frames)

    async def read_for(self, seconds):
        """Every frame that arrives within `seconds` (stops early if the connection closes)."""
        deadline = time.monotonic() + seconds
        frames = []
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return frames
            try:
                frames.append(await self.recv(left))
            except asyncio.TimeoutError:
                return frames
            except websockets.ConnectionClosed:
                return frames

    async def wait_closed(self, timeout=10.0):
        """Read until the connection closes: (code, reason, frames read meanwhile); code is
        None when it is still open after `timeout`."""
        deadline = time.monotonic() + timeout
        frames = []
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None, None, frames
            try:
                frames.append(await self.recv(left))
            except asyncio.TimeoutError:
                return None, None, frames
            except websockets.ConnectionClosed as err:
                return err.code, err.reason, frames

    async def close(self):
        await self.ws.close()


# --------------------------------------------------------------------------------------
# Standalone


async def serve_forever(host, port):
    app = ChatApp(verbose=True)
    await app.start(host, port)
    print(f"chat app: ws://{host}:{app.port}{PATH} (subprotocol {SUBPROTOCOL}), "
          f"session cookie from http://{host}:{app.port}/login", flush=True)
    try:
        await asyncio.Future()
    finally:
        await app.stop()


async def run_client(url, login_url, conversation, messages):
    sid = await asyncio.to_thread(ChatClient.login, login_url)
    client = await ChatClient.connect(url, sid)
    print(f"connected to {url} as sid={sid} (subprotocol {client.subprotocol})", flush=True)
    try:
        for i, body in enumerate(messages, 1):
            mid = f"c{i}"
            print(f"> {body}", flush=True)
            await client.say(body, mid, conversation)
            reply = await client.read_reply(mid, timeout=30)
            print(f"< {reply.text}" + ("" if reply.kind == "end" else f" [{reply.kind}]"), flush=True)
    except websockets.ConnectionClosed as err:
        print(f"connection closed: {err.code} {err.reason!r}", flush=True)
        return 1
    finally:
        await client.close()
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1", help="where the app listens (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=9000, help="the app's port (default 9000)")
    parser.add_argument("--client", metavar="URL", help="run the client against this WebSocket URL instead "
                        "(the app's ws://HOST:PORT/socket, or chatgate's)")
    parser.add_argument("--login", metavar="URL", help="with --client: the app's login URL "
                        "(default http://127.0.0.1:PORT/login)")
    parser.add_argument("--conversation", default="trip", help="with --client: the conversation id")
    parser.add_argument("messages", nargs="*", help="with --client: the messages to say, one reply each")
    args = parser.parse_args(argv)
    try:
        if args.client:
            login = args.login or f"http://127.0.0.1:{args.port}/login"
            return asyncio.run(run_client(args.client, login, args.conversation, args.messages))
        asyncio.run(serve_forever(args.host, args.port))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
