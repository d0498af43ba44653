"""End-to-end test of drop-in mode with the socket.io codec (issue 13): a real Socket.IO chat
app and its real client, from npm, behind nginx and chatgate, each started by the test.

- the app: tests/e2e/socketio/app.js, the chat of socket.io's own tutorial (`socket.io` 4.x:
  `io.emit('chat message', msg)` for each 'chat message'), plus test additions that only watch
  (it prints every event it receives with its full argument list, and every event it sends)
  or play a bot: after each chat message it streams a reply to that socket as 'bot message'
  events with no id and no end marker (10 parts 100 ms apart for a message with "long" in it,
  else 3), led by a 'typing' event, and stops streaming on a 'cancel' event. Its Engine.IO
  heartbeat is shortened (ping every 1 s) so pings cross the gateway during the test.
- the client: tests/e2e/socketio/client.js, `socket.io-client` 4.x with its DEFAULT transports
  (HTTP long-polling first, then the WebSocket upgrade), sending the Origin a browser page
  served by nginx would send, driven step by step over its standard input.
- nginx: Debian's /usr/sbin/nginx with examples/nginx-socketio.conf as written, but for its
  three addresses: upgrades under /socket.io/ go to chatgate, plain HTTP (polling, the page)
  to the app.
- chatgate: a "dropin" config with codec socket.io (chat: event "chat message", text /1;
  replies: event "bot message", text /1; reply_gap_ms 700), the shipped rules and
  CHATGATE_NOW=2026-02-03T10:00:00Z.

It proves, through nginx with default transports:
- the client ends on the websocket transport; the polling requests went to the app and the
  upgrade to chatgate (nginx's access log); the app's upgrade request carries the client's
  Host (with its port) and Origin;
- the unchanged client gets the events it gets from the app directly (the echo, the bot's
  typing and parts, a binary event), in the order the app sent them, and its acknowledgements;
  the app gets the client's non-chat events ('typing', an event with an ack, a binary event)
  untouched and in order around a chat message, which arrives as written plus the chatgate
  object as its last argument (one sent with an ack reaches it as written, so the ack callback
  stays the handler's argument after the client's);
  Engine.IO pings and pongs cross the gateway (the connection outlives several heartbeats);
- the flight search of docs/scenarios.md: the second turn's chatgate object has service travel
  and params {from Nairobi, to London, departure_date 2026-02-10, return_date 2026-02-20};
- "stop" while a long reply streams: no part of it that the app sent after the stop reaches
  the client (without a cancel_frame), or the app gets the cancel_frame's 'cancel' event and
  stops (with one); either way the session goes on: the next message gets its whole reply.

Skipped (exit 77) when node, npm or nginx is missing, unless CHATGATE_REQUIRE_BROWSER=1 (then
it fails), as tests/browser/run.sh does. The npm packages (tests/e2e/socketio/package-lock.json)
come from tests/e2e/socketio/node_modules when someone ran `npm ci` there, else they are
installed with `npm ci` into socketio-npm/ beside the gateway binary (the build directory).
"""

import asyncio
import base64
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
from harness import Gateway, check, step  # noqa: E402

HERE = Path(__file__).resolve().parent
SIO_DIR = HERE / "socketio"
EXAMPLE = harness.REPO_ROOT / "examples" / "nginx-socketio.conf"
# What the test replaces in examples/nginx-socketio.conf: everything else runs as written.
EXAMPLE_LISTEN = "listen 80;"
EXAMPLE_APP = "server 127.0.0.1:3000;"
EXAMPLE_GATEWAY = "server 127.0.0.1:8080;"
NGINX = shutil.which("nginx") or "/usr/sbin/nginx"
NODE = shutil.which("node")

NOW = "2026-02-03T10:00:00Z"
ENV = {"CHATGATE_NOW": NOW}
FLIGHT1 = "Find me flights from Nairobi to London next week"
FLIGHT2 = "What about returning on Feb 20?"
WANT1 = {"from": "Nairobi", "to": "London", "departure_date": "2026-02-10"}
WANT2 = {"from": "Nairobi", "to": "London", "departure_date": "2026-02-10", "return_date": "2026-02-20"}
CHATGATE_KEYS = ("user", "room", "route", "service", "params", "resolution", "enriched", "soft_context",
                 "last_tool_result",
                 "awaiting", "rules", "annotations")
REPLY_GAP_MS = 700
PART_MS = 100          # the bot's pace (app.js)
LONG_PARTS = 10
T = harness.DEFAULT_TIMEOUT


def config(app_port, cancel_frame=None):
    """The gateway config: the tutorial's chat mapped with the socket.io codec."""
    app_frames = {"reply": {"pointer": "/0", "equals": "bot message"}, "text": "/1"}
    if cancel_frame is not None:
        app_frames["cancel_frame"] = cancel_frame
    dropin = {
        "path": "/socket.io/",
        "app": f"ws://127.0.0.1:{app_port}",
        "codec": "socket.io",
        "client": {"chat": {"pointer": "/0", "equals": "chat message"}, "text": "/1"},
        "app_frames": app_frames,
        "reply_gap_ms": REPLY_GAP_MS,
        "host": "client",  # nginx serves the page and proxies chatgate under one host (docs/dropin.md)
    }
    return {"upstreams": {"demo": "demo"}, "log_level": "info",
            "rate_limit": {"messages_per_second": 1000, "burst": 1000}, "dropin": dropin}


def short(obj, limit=300):
    return harness.brief(obj, limit)


def shorts(items, limit=160):
    return [short(i, limit) for i in items]


def tail(path, lines=25):
    try:
        text = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return f"--- {path}: (none)"
    shown = "\n".join("   | " + line for line in text[-lines:])
    return f"--- last {min(lines, len(text))} of {len(text)} lines of {path}:\n{shown}"


# --------------------------------------------------------------------------------------
# npm packages, node processes, nginx


def skip_or_fail(reason):
    """tests/browser/run.sh's rule: skip (77) unless CHATGATE_REQUIRE_BROWSER=1 (then fail)."""
    if os.environ.get("CHATGATE_REQUIRE_BROWSER") == "1":
        print(f"FAIL: {reason}; CHATGATE_REQUIRE_BROWSER=1 says this test must run", flush=True)
        sys.exit(1)
    print(f"SKIP: {reason}", flush=True)
    sys.exit(77)


def node_modules(gateway):
    """The node_modules with socket.io and socket.io-client: tests/e2e/socketio/node_modules
    when someone ran `npm ci` there, else socketio-npm/node_modules beside the gateway binary,
    installed there from package-lock.json (harness.npm_modules)."""
    return harness.npm_modules(SIO_DIR, Path(gateway).resolve().parent / "socketio-npm",
                               [Path("socket.io") / "package.json", Path("socket.io-client") / "package.json"],
                               "socket.io and socket.io-client", skip_or_fail)


class NodeProc:
    """A node script of tests/e2e/socketio as a subprocess; its stdout is read line by line
    into `lines` (also written to a log file), its stderr goes to that file too."""

    def __init__(self, name, script, args, env, modules, parse):
        self.name = name
        self.script = SIO_DIR / script
        self.args = [str(a) for a in args]
        self.env = dict(env)
        self.modules = modules
        self.parse = parse
        self.dir = harness.temp_dir(f"chatgate-e2e-{name}-")
        self.log_path = self.dir / f"{name}.log"
        self.lines = []          # parsed stdout lines, in order
        self.proc = None
        self._reader = None
        self._changed = asyncio.Event()

    async def start(self):
        env = {k: v for k, v in os.environ.items() if not k.startswith("CHATGATE_")}
        env.update(self.env)
        env["NODE_PATH"] = str(self.modules)
        self._log = open(self.log_path, "w")
        self.proc = await asyncio.create_subprocess_exec(
            NODE, str(self.script), *self.args, env=env, cwd=str(SIO_DIR),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=self._log)
        self._reader = asyncio.create_task(self._read())
        _procs.append(self)
        return self

    async def _read(self):
        while True:
            line = await self.proc.stdout.readline()
            if not line:
                break
            text = line.decode(errors="replace").rstrip("\n")
            self._log.write(text + "\n")
            self._log.flush()
            try:
                item = self.parse(text)
            except ValueError:
                item = None
            if item is not None:
                self.lines.append(item)
                self._changed.set()
        self._changed.set()

    async def wait_for(self, predicate, timeout, what):
        """The first parsed line (from the start) that `predicate` holds for; fails after
        `timeout` naming `what`."""
        deadline = time.monotonic() + timeout
        while True:
            for item in self.lines:
                if predicate(item):
                    return item
            if self.proc.returncode is not None and self._reader.done():
                harness.fail(f"{self.name} exited ({self.proc.returncode}) while waiting for {what}\n"
                             f"{tail(self.log_path)}")
            left = deadline - time.monotonic()
            if left <= 0:
                harness.fail(f"{self.name}: no {what} within {timeout:.1f}s\n{tail(self.log_path)}")
            self._changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(left, 0.2))

    async def stop(self):
        if self.proc is None:
            return
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.terminate()
            try:
                await asyncio.wait_for(self.proc.wait(), 3)
            except asyncio.TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.kill()
                await self.proc.wait()
        if self._reader:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._reader, 2)
        self._log.close()


_procs = []  # every NodeProc and Nginx started, for cleanup


def parse_app_line(text):
    """app.js prints `KIND {json}`: (KIND, dict)."""
    kind, _, rest = text.partition(" ")
    if not kind.isupper() or not rest.startswith("{"):
        return None
    return (kind, json.loads(rest))


class App(NodeProc):
    def __init__(self, modules):
        self.port = harness.free_port()
        super().__init__("socketio-app", "app.js", [self.port],
                         {"PING_INTERVAL_MS": "1000", "PING_TIMEOUT_MS": "1500", "BOT_PART_MS": str(PART_MS)},
                         modules, parse_app_line)

    async def start(self):
        await super().start()
        await self.wait_for(lambda x: x[0] == "LISTENING", 10, "LISTENING line (the app did not start)")
        return self

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"

    def of(self, kind, sid=None):
        return [d for k, d in self.lines if k == kind and (sid is None or d.get("sid") == sid)]

    def received(self, sid, event=None):
        return [d for d in self.of("RECV", sid) if event is None or d["event"] == event]

    def sent_to(self, sid):
        """Every event the app sent that reached (or should have reached) socket `sid`, in order."""
        return [d for k, d in self.lines if k == "SENT" and (d["to"] == sid or sid in d.get("sids", ()))]

    def chat(self, sid, text):
        """The 'chat message' the app got whose first argument is `text` (or None)."""
        return next((d for d in self.received(sid, "chat message") if d["args"] and d["args"][0] == text), None)

    async def wait_chat(self, sid, text, timeout=T):
        """The RECV line (a dict) of that 'chat message', once it came."""
        line = await self.wait_for(lambda x: x[0] == "RECV" and x[1]["sid"] == sid and
                                   x[1]["event"] == "chat message" and x[1]["args"][:1] == [text],
                                   timeout, f"'chat message' {text!r} at the app")
        return line[1]

    def parts_sent(self, sid, text):
        """The bot's parts answering `text`, as the app sent them (with their times)."""
        return [d for d in self.sent_to(sid) if d["event"] == "bot message" and d["args"][0].startswith(f"[{text}]")]


class SioClient(NodeProc):
    """client.js against `url`, driven step by step over its stdin."""

    def __init__(self, modules, url, origin=None, name="socketio-client"):
        scenario = {"steps": []}
        if origin:
            scenario["origin"] = origin
        super().__init__(name, "client.js", [url, json.dumps(scenario)], {}, modules,
                         lambda text: json.loads(text) if text.startswith("{") else None)
        self.steps = 0

    async def do(self, step_, timeout=T):
        """Run one step of client.js (a dict, client.js's step); fail when it fails."""
        index = self.steps
        self.steps += 1
        self.proc.stdin.write((json.dumps(step_) + "\n").encode())
        await self.proc.stdin.drain()
        done = await self.wait_for(lambda x: x.get("kind") == "step" and x.get("index") == index,
                                   timeout + 2, f"the end of step {index} {step_}")
        check(done["ok"], f"{self.name}: step {short(step_)} failed: {done.get('error')}; it got "
                          f"{shorts(self.events()[-8:])}")
        return done

    async def emit(self, event, *args, ack=False):
        return await self.do({"op": "emit", "event": event, "args": list(args), "ack": ack})

    async def wait_event(self, event, contains=None, count=1, timeout=T):
        step_ = {"op": "wait", "event": event, "count": count, "timeout": int(timeout * 1000)}
        if contains is not None:
            step_["contains"] = contains
        return await self.do(step_, timeout=timeout)

    async def close(self):
        if self.proc and self.proc.returncode is None:
            with contextlib.suppress(ConnectionError):
                self.proc.stdin.close()
            await self.wait_for(lambda x: x.get("kind") == "end", 5, "the client's end")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.proc.wait(), 3)

    def of(self, kind):
        return [x for x in self.lines if x.get("kind") == kind]

    def events(self):
        return self.of("event")

    def sent_at(self, event, text):
        return next(x["t"] for x in self.of("sent") if x["event"] == event and x["args"][:1] == [text])

    def parts(self, text):
        return [x for x in self.events() if x["event"] == "bot message" and x["args"][0].startswith(f"[{text}]")]

    @property
    def sid(self):
        connects = self.of("connect")
        check(connects, f"{self.name} never connected: {shorts(self.lines[-6:])}")
        return connects[-1]["id"]


class Nginx:
    """Debian's nginx in the foreground, its own prefix, pid, logs and temp paths, with
    examples/nginx-socketio.conf as written but for its three addresses, included in the http
    block of a main config that only adds an access log saying which upstream served what."""

    def __init__(self, app_port, gateway_port):
        self.port = harness.free_port()
        self.dir = harness.temp_dir("chatgate-e2e-nginx-")
        self.dir.chmod(0o755)  # nginx's workers (nobody, when run as root) use the temp paths
        text = EXAMPLE.read_text()
        for old, new in ((EXAMPLE_LISTEN, f"listen 127.0.0.1:{self.port};"),
                         (EXAMPLE_APP, f"server 127.0.0.1:{app_port};"),
                         (EXAMPLE_GATEWAY, f"server 127.0.0.1:{gateway_port};")):
            check(text.count(old) == 1, f"examples/nginx-socketio.conf should hold {old!r} once (the test "
                                        f"replaces it)")
            text = text.replace(old, new)
        (self.dir / "nginx-socketio.conf").write_text(text)
        self.access_log = self.dir / "access.log"
        self.error_log = self.dir / "error.log"
        temp = "\n".join(f"    {kind}_temp_path {self.dir / kind};" for kind in
                         ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
        self.config = self.dir / "nginx.conf"
        self.config.write_text(f"""\
worker_processes 1;
pid {self.dir / 'nginx.pid'};
error_log {self.error_log} info;
events {{ worker_connections 256; }}
http {{
    log_format upstreams '$request_method $request_uri $status upgrade=$http_upgrade upstream=$upstream_addr';
    access_log {self.access_log} upstreams;
{temp}
    include {self.dir / 'nginx-socketio.conf'};
}}
""")
        self.proc = None

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"

    async def start(self):
        base = [NGINX, "-p", str(self.dir), "-c", str(self.config), "-g", "daemon off;"]
        checked = await asyncio.to_thread(subprocess.run, base + ["-t"], capture_output=True, text=True,
                                          stdin=subprocess.DEVNULL)
        check(checked.returncode == 0, f"nginx -t refused the example config:\n{checked.stdout}{checked.stderr}")
        self._out = open(self.dir / "nginx.out", "wb")
        self.proc = subprocess.Popen(base, stdin=subprocess.DEVNULL, stdout=self._out, stderr=subprocess.STDOUT)
        _procs.append(self)
        await harness.wait_listening(self.port, self.proc, "nginx", self.error_log)
        return self

    def access(self):
        """The access log: [(method, uri, status, upgrade, upstream)]."""
        rows = []
        with contextlib.suppress(OSError):
            for line in self.access_log.read_text().splitlines():
                m = re.match(r"(\S+) (\S+) (\d+) upgrade=(\S*) upstream=(\S*)$", line)
                if m:
                    rows.append(m.groups())
        return rows

    async def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                await asyncio.to_thread(self.proc.wait, 5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc:
            self._out.close()


class Stack:
    """The app, chatgate (config `config(app port, cancel_frame)`) and nginx in front of both."""

    def __init__(self, modules, name, cancel_frame=None):
        self.modules = modules
        self.name = name
        self.cancel_frame = cancel_frame
        self.app = self.gw = self.nginx = None
        self.clients = []

    async def __aenter__(self):
        self.app = await App(self.modules).start()
        self.gw = Gateway(config=config(self.app.port, self.cancel_frame), env=ENV, name=f"gateway:{self.name}")
        await self.gw.astart()
        self.nginx = await Nginx(self.app.port, self.gw.port).start()
        return self

    async def client(self, url=None, origin=True, name="socketio-client"):
        url = url or self.nginx.url
        c = await SioClient(self.modules, url, origin=url if origin else None, name=name).start()
        self.clients.append(c)
        return c

    def logs(self):
        parts = [tail(self.app.log_path) if self.app else ""]
        parts += [tail(c.log_path, 15) for c in self.clients]
        if self.nginx:
            parts += [tail(self.nginx.error_log, 10), tail(self.nginx.access_log, 15)]
        return "\n".join(p for p in parts if p)

    async def __aexit__(self, exc_type, exc, tb):
        if exc_type is not None:
            print(self.logs(), flush=True)
        for c in self.clients:
            await c.stop()
        if self.nginx:
            await self.nginx.stop()
        if self.gw:
            if exc_type is None:
                await self.gw.astop()
            else:
                with contextlib.suppress(Exception):
                    await self.gw.astop()
        if self.app:
            await self.app.stop()
        return False


# --------------------------------------------------------------------------------------


def chatgate_of(recv, what):
    """The chatgate object: the last argument of the 'chat message' event the app got (before
    socket.io's ack callback, which is no argument of the client's event)."""
    args = [a for a in recv["args"] if a != "<ack callback>"]
    check(len(args) == 2 and isinstance(args[-1], dict),
          f"{what}: the app should get 'chat message' with the text and the chatgate object as its last "
          f"argument, it got {len(args)} argument(s): {short(recv['args'], 600)}")
    cg = args[-1]
    missing = [k for k in CHATGATE_KEYS if k not in cg]
    check(not missing, f"{what}: the chatgate object lacks {missing}: {short(cg, 600)}")
    return cg


def event_view(items):
    """(event, args) of events, for comparing what was sent with what arrived."""
    return [(x["event"], x["args"]) for x in items]


async def chat_turn(client, app, text, parts=3):
    """The client says `text` and waits for the whole bot reply; the app's RECV of it."""
    await client.emit("chat message", text)
    await client.wait_event("bot message", contains=f"[{text}] part {parts}/{parts}")
    return await app.wait_chat(client.sid, text)


BLOB = bytes(range(256)) + "é".encode() * 100   # not UTF-8 as a whole
BLOB_ARG = {"$binary": base64.b64encode(BLOB).decode()}


async def unchanged_session(client):
    """The client's script of the first part: non-chat events around a chat message (an event
    with an acknowledgement, a binary event), then a chat message with an acknowledgement."""
    await client.do({"op": "wait_upgrade", "timeout": 10000})
    await client.emit("typing", "t1")
    await client.emit("chat message", "Hello there")
    await client.emit("typing", "t2")
    await client.emit("whoami", ack=True)
    await client.do({"op": "emit", "event": "file", "args": ["photo.bin"], "binary": BLOB_ARG["$binary"]})
    await client.wait_event("file")
    await client.wait_event("bot message", contains="[Hello there] part 3/3")
    await client.emit("chat message", "Hello again", ack=True)
    await client.wait_event("bot message", contains="[Hello again] part 3/3")
    await client.do({"op": "sleep", "ms": 150})  # anything late would arrive now


async def part_main(modules):
    async with Stack(modules, "socketio") as st:
        app, nginx = st.app, st.nginx

        with step("through nginx, the app serves its page and /socket.io/socket.io.js"):
            for path, want in (("/", "<title>Socket.IO chat</title>"), ("/socket.io/socket.io.js", "io")):
                status, _, body = await asyncio.to_thread(harness.http_get, nginx.url + path)
                check(status == 200 and want in body.decode(errors="replace"),
                      f"GET {path} through nginx: {status} {body[:200]!r}")

        with step("the unchanged client directly at the app (default transports), for comparison"):
            direct = await st.client(app.url, name="socketio-client-direct")
            await unchanged_session(direct)
            await direct.close()
            direct_events = event_view(direct.events())
            check(len(direct_events) == 11, f"the app itself should send twice the echo, typing and 3 parts, "
                                            f"and the file: {shorts(direct_events)}")

        client = await st.client()
        with step("through nginx with default transports: polling first (to the app), then the upgrade "
                  "to websocket (through chatgate)"):
            await client.do({"op": "wait_upgrade", "timeout": 10000})
            sid = client.sid
            first = client.of("open")[0]
            check(first["transport"] == "polling", f"the client should start with polling: {short(first)}")
            conn = await app.wait_for(lambda x: x[0] == "CONNECT" and x[1]["sid"] == sid, T, "CONNECT")
            check(conn[1]["transport"] == "polling", f"the app's first transport: {short(conn)}")
            await app.wait_for(lambda x: x[0] == "TRANSPORT" and x[1]["sid"] == sid, T,
                               "the app's Engine.IO transport upgrade")
            eid = first["engine_id"]
            ups = [d for d in app.of("UPGRADE") if "transport=websocket" in d["url"] and f"sid={eid}" in d["url"]]
            check(ups, f"the app got no WebSocket upgrade request: {shorts(app.of('UPGRADE'))}")
            up = ups[-1]
            check(up["url"].startswith("/socket.io/?") and "EIO=4" in up["url"],
                  f"the app's upgrade request should be the client's path and query: {up['url']!r}")
            host = f"127.0.0.1:{nginx.port}"
            check(up["headers"].get("host") == host,
                  f"the app's upgrade request should carry the client's Host {host!r} (with its port): "
                  f"{up['headers'].get('host')!r}")
            check(up["headers"].get("origin") == nginx.url,
                  f"the app's upgrade request should carry the client's Origin {nginx.url!r}: "
                  f"{up['headers'].get('origin')!r}")

        with step("non-chat events pass untouched and in order around a chat message, both ways; the chat "
                  "message reaches the app as written plus the chatgate object as its last argument"):
            await unchanged_session(client)
            got = app.received(sid)
            want = [("typing", ["t1"]), ("chat message", "Hello there"), ("typing", ["t2"]),
                    ("whoami", ["<ack callback>"]), ("file", ["photo.bin", BLOB_ARG]), ("chat message", "Hello again")]
            check([(d["event"], d["args"][0] if d["event"] == "chat message" else d["args"]) for d in got] == want,
                  f"the app should get typing, chat message, typing, whoami (with its ack), file (binary), "
                  f"chat message, in that order and the non-chat ones untouched (no object added):\n"
                  f"  got  {shorts(got)}\n  want {shorts(want)}")
            check(all(d["transport"] == "websocket" for d in got),
                  f"every event should have come over the websocket: {shorts(got)}")
            cg = chatgate_of(got[1], "Hello there")
            check(cg["route"] == "app", f"chatgate.route should be 'app': {short(cg)}")
            check(isinstance(cg["user"], str) and cg["user"], f"chatgate.user should be a non-empty id: {short(cg)}")
            print(f"   note: chatgate object of 'Hello there': {short(cg, 400)}", flush=True)
            # an event sent with an ack gets the chatgate object too, at the same place as one
            # without (right after the arguments the mapping takes), socket.io's ack callback
            # after it: a handler (msg, chatgate, callback) (issue 35, defect 2)
            args = got[5]["args"]
            check(len(args) == 3 and args[0] == "Hello again" and isinstance(args[1], dict) and "params" in args[1]
                  and args[2] == "<ack callback>",
                  f"'Hello again' was sent with an acknowledgement: the app should get it, the chatgate object, "
                  f"then socket.io's ack callback: {short(args)}")
            acks = [(a["event"], a["args"]) for a in client.of("ack")]
            check(len(acks) == 2 and acks[0][0] == "whoami" and acks[0][1][0].get("sid") == sid and
                  acks[1] == ("chat message", ["delivered"]),
                  f"the acknowledgements of 'whoami' and of the chat message should come back (Socket.IO 43 "
                  f"packets): {shorts(acks)}")
            via = event_view(client.events())
            sent = event_view(app.sent_to(sid))
            check(via == sent, f"the client should get what the app sent, in order:\n  got  {shorts(via)}\n"
                               f"  sent {shorts(sent)}")
            key = lambda e: json.dumps(e, sort_keys=True)  # noqa: E731
            check(sorted(via, key=key) == sorted(direct_events, key=key),
                  f"through chatgate the client got {shorts(via)}\ndirectly it got {shorts(direct_events)}")

        with step(f"flight search (docs/scenarios.md), turn 1: {FLIGHT1!r}"):
            recv = await chat_turn(client, app, FLIGHT1)
            cg = chatgate_of(recv, "turn 1")
            check(cg["service"] == "travel" and cg["params"] == WANT1,
                  f"turn 1: chatgate service/params should be travel {WANT1}: {short(cg, 600)}")

        with step(f"turn 2: {FLIGHT2!r}: the chatgate object has service travel and the merged params"):
            recv = await chat_turn(client, app, FLIGHT2)
            check(recv["args"][0] == FLIGHT2, f"the text should be what the user wrote: {short(recv)}")
            cg = chatgate_of(recv, "turn 2")
            check(cg["service"] == "travel", f"chatgate.service should be travel: {short(cg, 600)}")
            check(cg["params"] == WANT2, f"chatgate.params should be {WANT2}, got {short(cg['params'])}")
            check(cg["route"] == "app" and cg["resolution"] is None,
                  f"route app, no resolution expected: {short(cg, 600)}")
            print(f"   note: chatgate.room is {cg['room']!r}", flush=True)

        with step("Engine.IO pings and pongs cross chatgate: pings at the client and pongs at the app over "
                  "the websocket, and no disconnect"):
            ok = await harness.wait_until(
                lambda: len([p for p in client.of("ping") if p["transport"] == "websocket"]) >= 2 and
                len([p for p in app.of("PONG", sid) if p["transport"] == "websocket"]) >= 2, 5)
            pings = [p for p in client.of("ping") if p["transport"] == "websocket"]
            pongs = [p for p in app.of("PONG", sid) if p["transport"] == "websocket"]
            check(ok, f"over the websocket the client saw {len(pings)} pings and the app {len(pongs)} pongs "
                      f"(want 2 or more each, with a ping every 1 s)")
            check(not client.of("disconnect") and not app.of("DISCONNECT", sid),
                  f"the connection dropped: {shorts(client.of('disconnect') + app.of('DISCONNECT', sid))}")

        with step("'stop' while a long reply streams (no cancel_frame): no part of it sent after the stop "
                  "reaches the client"):
            long_text = "Tell me a long story"
            await client.emit("chat message", long_text)
            await client.wait_event("bot message", contains=f"[{long_text}] part 3/{LONG_PARTS}")
            await client.emit("chat message", "stop")
            t_stop = client.sent_at("chat message", "stop")
            last = await app.wait_for(lambda x: x[0] == "SENT" and x[1]["event"] == "bot message" and
                                      x[1]["args"][0].startswith(f"[{long_text}] part {LONG_PARTS}/"),
                                      T, "the app's last part of the long reply (it cannot stop it)")
            # past the reply gap, then the app's answer to "stop" if it got it
            await asyncio.sleep((REPLY_GAP_MS + 300) / 1000)  # the subject: the reply gap ends the held reply
            if app.chat(sid, "stop"):
                await app.wait_for(lambda x: x[0] == "SENT" and x[1]["args"][:1] == ["[stop] part 3/3 "],
                                   T, "the app's answer to 'stop'")
                # until the app's echo of 'stop' (sent before its answer) is at the client; checked below
                await harness.wait_until(lambda: any(x["event"] == "chat message" and x["args"] == ["stop"]
                                                     for x in client.events()), 3)
            got = client.parts(long_text)
            sent = app.parts_sent(sid, long_text)
            late = [p for p in sent if p["t"] > t_stop + 200]
            late_texts = {p["args"][0] for p in late}
            relayed_late = [p for p in got if p["args"][0] in late_texts]
            check(len(got) < LONG_PARTS and not relayed_late,
                  f"the client got {len(got)} of {LONG_PARTS} parts; {len(relayed_late)} of them the app sent "
                  f"more than 200 ms after the client's 'stop': {shorts([p['args'][0] for p in relayed_late])}")
            stop = app.chat(sid, "stop")
            how = "was not forwarded to the app"
            if stop:
                how = "was forwarded to the app"
                if isinstance(stop["args"][-1], dict):
                    how += f" with chatgate.resolution {short(stop['args'][-1].get('resolution'))}"
            print(f"   note: the client got {len(got)} of {LONG_PARTS} parts of the long reply (the app sent "
                  f"{len(sent) - len(late)} before the stop, the last at {last[1]['t'] - t_stop} ms after it); "
                  f"'stop' {how}; the client got {len(client.parts('stop'))} of the parts answering it", flush=True)
            if stop:
                echoes = [x for x in client.events() if x["event"] == "chat message" and x["args"] == ["stop"]]
                check(echoes, "the app's echo of 'stop' (no reply event) did not reach the client")

        with step("the session goes on: the next message gets its echo and its whole reply, and no late "
                  "part of the stopped one comes"):
            n_long = len(client.parts(long_text))
            await chat_turn(client, app, "are you there?")
            await client.do({"op": "sleep", "ms": 200})
            check([x["args"][0] for x in client.parts("are you there?")] ==
                  [f"[are you there?] part {i}/3 " for i in (1, 2, 3)],
                  f"the reply to 'are you there?': {shorts(client.parts('are you there?'))}")
            check(["are you there?"] in [x["args"] for x in client.events() if x["event"] == "chat message"],
                  "the app's echo of 'are you there?' did not reach the client")
            check(len(client.parts(long_text)) == n_long,
                  f"parts of the stopped reply came later: {shorts(client.parts(long_text)[n_long:])}")
            check(client.events()[-1]["transport"] == "websocket" and not client.of("disconnect"),
                  f"the client should still be on the websocket: {short(client.lines[-1])}")

        with step("nginx sent the polling requests to the app and the upgrade to chatgate"):
            await client.close()
            end = client.of("end")[-1]
            check(end["transport"] == "websocket", f"the client ended on {end['transport']!r}, not websocket")
            await app.wait_for(lambda x: x[0] == "DISCONNECT" and x[1]["sid"] == sid, 5,
                               "the app's disconnect of the client's socket")
            app_addr, gw_addr = f"127.0.0.1:{app.port}", f"127.0.0.1:{st.gw.port}"
            ok = await harness.wait_until(
                lambda: any("transport=websocket" in r[1] and f"sid={eid}" in r[1] for r in nginx.access()), 3)
            rows = [r for r in nginx.access() if r[1].startswith("/socket.io/?") and "EIO=4" in r[1]]
            check(ok, f"nginx logged no upgrade request of the client: {rows}")
            polling = [r for r in rows if "transport=polling" in r[1]]
            ws = [r for r in rows if "transport=websocket" in r[1]]
            check(len(polling) >= 2 and all(r[4] == app_addr and r[3] in ("", "-") for r in polling),
                  f"every polling request should go to the app {app_addr}: {polling}")
            check(ws and all(r[4] == gw_addr and r[2] == "101" and r[3].lower() == "websocket" for r in ws),
                  f"the upgrade should go to chatgate {gw_addr} and get 101: {ws}")
            print(f"   note: nginx sent {len(polling)} polling requests to the app, {len(ws)} upgrades to chatgate",
                  flush=True)


async def part_cancel_frame(modules):
    async with Stack(modules, "socketio-cancel", cancel_frame=["cancel"]) as st:
        app = st.app
        client = await st.client()
        await client.do({"op": "wait_upgrade", "timeout": 10000})
        sid = client.sid
        long_text = "Another long one, please"
        with step("cancel_frame [\"cancel\"]: 'stop' while a long reply streams sends the app a 'cancel' "
                  "event, which stops it; the client gets no part after"):
            await client.emit("chat message", long_text)
            await client.wait_event("bot message", contains=f"[{long_text}] part 3/{LONG_PARTS}")
            await client.emit("chat message", "stop")
            cancel = await app.wait_for(lambda x: x[0] == "CANCEL" and x[1]["sid"] == sid, 5,
                                        "a 'cancel' event at the app")
            recv = app.received(sid, "cancel")
            check(recv and recv[0]["args"] == [],
                  f"the app should get the cancel_frame as the event ['cancel'] with no argument: {shorts(recv)}")
            check(cancel[1]["stopped"], "the 'cancel' came when no reply was streaming at the app")
            await asyncio.sleep((REPLY_GAP_MS + 300) / 1000)  # the subject: past the reply gap, nothing late
            sent = app.parts_sent(sid, long_text)
            got = client.parts(long_text)
            check(len(sent) < LONG_PARTS, f"the app sent all {len(sent)} parts anyway")
            check(len(got) <= len(sent), f"the client got {len(got)} parts, the app sent {len(sent)}")
            stop = app.chat(sid, "stop")
            if stop:
                await app.wait_for(lambda x: x[0] == "SENT" and x[1]["args"][:1] == ["[stop] part 3/3 "],
                                   T, "the app's answer to 'stop'")
                await asyncio.sleep(0.3)  # for the note below: the parts answering 'stop' the client gets
            order = [d["event"] for d in app.received(sid) if d["event"] == "cancel" or d["args"][:1] == ["stop"]]
            print(f"   note: the app stopped after {len(sent)} parts ({cancel[1]['t'] - client.sent_at('chat message', 'stop')} "
                  f"ms after the client's 'stop'); the client got {len(got)}; 'stop' "
                  f"{'was' if stop else 'was not'} forwarded to the app (the app got {order}); the client got "
                  f"{len(client.parts('stop'))} of the app's parts answering 'stop'", flush=True)
        with step("the session goes on: the next message gets its whole reply"):
            await chat_turn(client, app, "are you there?")
            await client.do({"op": "sleep", "ms": 200})
            check([x["args"][0] for x in client.parts("are you there?")] ==
                  [f"[are you there?] part {i}/3 " for i in (1, 2, 3)],
                  f"the reply to 'are you there?': {shorts(client.parts('are you there?'))}")
            check(len(app.received(sid, "cancel")) == 1, f"one cancel expected: {shorts(app.received(sid, 'cancel'))}")
        await client.close()


async def main(args):
    modules = await asyncio.to_thread(node_modules, args.gateway)
    try:
        await harness.independent(part_main(modules))
        await harness.independent(part_cancel_frame(modules))
    finally:
        for p in reversed(_procs):
            with contextlib.suppress(Exception):
                await p.stop()
        if harness._failures or args.keep_logs:
            print("--- logs of the app, the clients and nginx: " + " ".join(str(p.dir) for p in _procs), flush=True)
        else:
            for p in _procs:
                shutil.rmtree(p.dir, ignore_errors=True)


if __name__ == "__main__":
    if not NODE:
        skip_or_fail("node not found (Debian: apt-get install nodejs npm)")
    if not os.access(NGINX, os.X_OK):
        skip_or_fail(f"{NGINX} not found (Debian: apt-get install nginx)")
    harness.run(main, timeout=110)
