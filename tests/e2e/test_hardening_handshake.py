"""Issue 35 (hardening, round 2): the WebSocket handshake (Origin, RFC 6455), JWT times, and
numbers a peer sends (an upstream, a ws chat app, Redis). Each part says what main 63bc085 did
instead (seen with its plain RelWithDebInfo build, and for E1 and E2 its build with
CHATGATE_SANITIZE too; E3, E4 and B's masked Origin: with the fix's hunks reverted).

Handshakes are written by hand on raw sockets (`raw_handshake`), so that the Host, Origin,
Sec-WebSocket-Version, Sec-WebSocket-Key and request target are exactly what the part says.
The drop-in path is /socket of test_dropin.py's config(), in front of a ChatApp (the drop-in
handshakes carry an app session cookie and the subprotocol chat.v2).

- part_origin_rebinding (A), on /ws and on the drop-in path, without --allow-origin: a page
  from a DNS-rebound name (Host rebind.attacker.example:PORT, Origin
  http://rebind.attacker.example:PORT) gets 403, and so does http://localhost:9999 (a page of
  another local site: another port). Still 101: Origins http://localhost:PORT,
  http://127.0.0.1:PORT (with Host localhost:PORT too: one site), http://[::1]:PORT and
  http://foo.localhost:PORT, each with the Host a browser would send, and no Origin at all.
  Before: the rebound page got 101 (its Origin named the Host).
- part_origin_allow_list (A), on both paths, --allow-origin https://chat.example.com, Host
  chat.example.com: that Origin gets 101, http://chat.example.com 403. Before: 101 for
  http://chat.example.com (it named the Host).
- part_origin_logged (B): Origin null (a page opened from a file) gets 403 without
  --allow-origin and 101 with --allow-origin null; the log line of a refusal names the
  refused Origin: null, and rebind.attacker.example. Before: the line said only "refused a
  connection from another site's page (Origin not allowed; see --allow-origin)", and the
  rebound page got 101, unlogged. An Origin carrying a secret (http://alice@example.com.evil:1,
  an sk- API key, a JWT, ?token=) gets 403 and its line names it masked as src/core/log.c masks
  every line (Origin 'http://[email]:1', 'https://[token].example', ...), the secret nowhere
  in the log: "masked as other values are" (defect 11). Fails without the Origin in the line
  (the masked form is looked for) and if the line bypassed the masks (the secret is).
- part_rfc6455 (C), on both paths: Sec-WebSocket-Version 8, 14, abc or none gets 426 with
  "Sec-WebSocket-Version: 13"; a Sec-WebSocket-Key that is not base64 of exactly 16 bytes
  (abc, 15 bytes, 17 bytes, 24 characters outside base64) or none gets 400; a correct
  handshake gets 101. Before: 101 for all of them (libwebsockets 4.1.6 takes any version and
  key, and collapses dot segments to /ws), but no key, which got no answer at all (the
  connection was closed). A target with dot segments (/../ws, /ws/../ws, /./ws) gets 400: the
  gateway reads the request head itself before lws does (listener.h).
- part_jwt_times (D), --auth jwt: a token with exp 1e300 or 1e19, or nbf -1e300, is refused
  as an expired one is (an error frame unauthorized, close 1008); exp now+3600 is accepted.
  Before: a hello for each of the three.
- part_retry_after (E1): an upstream of two replicas (max_attempts 1, out_ms 200), the
  dialog's own answering HTTP 429 with "Retry-After: 99999999999999999999": the client gets
  an error frame, the gateway stays up, the dialog's next message is answered (by the other
  replica), and the 429 replica stays out for the longest wait the gateway keeps (up to an
  hour) rather than out_ms: a message 0.5 s later is answered and not sent to it. Before:
  the seconds times 1000 overflowed a long (the sanitizer build aborts: "signed integer
  overflow: 9223372036854775807 * 1000"); the plain build wrapped, fell back to out_ms, and
  the message 0.5 s later went to the 429 replica again and got its error.
- part_usage_overflow (E2), limits.tokens_per_day 1000: after a reply whose usage is
  prompt_tokens = completion_tokens = 9223372036854775807, the user's next message is
  rate_limited, limit tokens_per_day. Before: the sum wrapped to -2, nothing was counted,
  the next message was answered (the sanitizer build aborts: "9223372036854775807 +
  9223372036854775807 cannot be represented in type 'long long int'"). completion_tokens 2^64
  (18446744073709551616, past any 64-bit integer) neither crashes the gateway nor counts
  negative: at 600 tokens a turn after it, the user is refused by the third turn (main
  already did: it took the chunk for "not a JSON object", an upstream_error, and estimated).
- part_awaiting_ttl (E3; 5f7b0bf, dialog.c: a backend's awaiting ttl clamped to a year), a ws
  chat app (harness.FakeApp /state) whose done sets awaiting with ttl 2^63-1, 2^62 or 1e30, on
  the memory store and on a redis-server of the test's own: the awaiting state is kept
  (context.get, and the next message reaches the app with it); in Redis its key's TTL and its
  expires_at are at most a year away (1e30 is no integer: lifetimes.awaiting_s). ttl 2^63
  (past int64: the app's frame is refused) leaves the gateway up. Before (seen with 5f7b0bf's
  dialog.c hunk reverted): now + 2^63-1 wrapped into the past, so the awaiting state was gone
  at the next load (memory and Redis; the sanitizer build aborted: "signed integer overflow:
  9223372036854775807 + 1795864520", dialog.c); with 2^62 the Redis save failed ("ERR
  invalid expire time in 'expire' command"), so Redis held no awaiting state.
- part_stored_counts (E4; 5f7b0bf, dialog.c: stored counts clamped; dialog.c and admin.c:
  usage sums saturate), a redis-server of the test's own holding dialogs the gateway has no
  copy of (docs/state.md, Redis layout), their dialog hash written by the test: turn_count
  99999999999999999999 and message_count 2^63-1 are still >= 2^53 and positive after a
  message (context.get, and as written back to Redis); -5 and -7 count from 0 (1 after a
  message); usage in, out and turns of 2^63-1 stay 2^63-1 after a turn, and GET
  /admin/users/{user}/usage totals two such rooms to 2^63-1. Before: the counts wrapped to
  -9223372036854775808 (and -4, -6), the usage to negative numbers, the admin total of two
  rooms to -2; the sanitizer build aborted at the message's count ("signed integer overflow:
  9223372036854775807 + 1", pipeline.c).
"""

import asyncio
import base64
import json
import os
import re
import socket
import time
import urllib.parse

import websockets

import harness
from harness import Client, Gateway, check, context_command, independent, step
from dropin_app import ChatApp
from test_dropin import ENV as DROPIN_ENV, config as dropin_config

JWT_SECRET = "handshake-hardening-secret"
DROPIN_PATH = "/socket"
T = harness.DEFAULT_TIMEOUT


def random_key():
    return base64.b64encode(os.urandom(16)).decode()


def raw_handshake(port, path="/ws", host=None, origin=None, version="13", key="random", extra=()):
    """Sends an upgrade request written by hand and reads the answer's head: (status or None
    when the connection closed without one, {lower-case header: value}, the head's text).
    `host` defaults to 127.0.0.1:PORT; None for `origin`, `version` or `key` leaves that
    header out; `extra` is more (name, value) header pairs."""
    lines = [f"GET {path} HTTP/1.1", f"Host: {host or f'127.0.0.1:{port}'}", "Upgrade: websocket",
             "Connection: Upgrade"]
    if key is not None:
        lines.append(f"Sec-WebSocket-Key: {random_key() if key == 'random' else key}")
    if version is not None:
        lines.append(f"Sec-WebSocket-Version: {version}")
    if origin is not None:
        lines.append(f"Origin: {origin}")
    lines += [f"{k}: {v}" for k, v in extra]
    with socket.create_connection(("127.0.0.1", port), timeout=T) as s:
        s.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        data = b""
        try:
            while b"\r\n\r\n" not in data:
                chunk = s.recv(4096)
                if not chunk:
                    break
                data += chunk
        except (ConnectionResetError, socket.timeout):
            pass
    head = data.split(b"\r\n\r\n", 1)[0].decode("latin-1")
    first, *rest = head.split("\r\n") if head else [""]
    m = re.match(r"HTTP/1\.[01] (\d{3})", first)
    headers = {}
    for line in rest:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return (int(m.group(1)) if m else None), headers, head


def shown(got):
    status, _, head = got
    return f"{status} ({head.splitlines()[0] if head else 'no answer, connection closed'})"


class Where:
    """A WebSocket path of a gateway and what its handshakes carry besides (the drop-in path:
    the app's session cookie and subprotocol)."""

    def __init__(self, gw, path, extra=()):
        self.gw = gw
        self.path = path
        self.extra = tuple(extra)

    async def handshake(self, path=None, **kwargs):
        return await asyncio.to_thread(raw_handshake, self.gw.port, path or self.path,
                                       extra=self.extra, **kwargs)


def paths_of(gw, app):
    return [Where(gw, "/ws"),
            Where(gw, DROPIN_PATH, (("Cookie", f"sid={app.issue_sid()}"), ("Sec-WebSocket-Protocol", "chat.v2")))]


def dropin_gateway(app, name, args=()):
    return Gateway(args, dropin_config(app.url), env=DROPIN_ENV, name=name)


async def statuses(where, cases):
    """Every (label, want, kwargs) of `cases` on `where`: a line for each mismatch."""
    wrong = []
    for label, want, kwargs in cases:
        got = await where.handshake(**kwargs)
        if got[0] != want:
            wrong.append(f"{where.path}, {label}: expected {want}, got {shown(got)}")
    return wrong


# -------------------------------------------------------------------------------------- A


async def part_origin_rebinding():
    async with ChatApp() as app:
        async with dropin_gateway(app, "gateway:origin") as gw:
            p = gw.port
            with step(f"/ws and {DROPIN_PATH}, no --allow-origin: a DNS-rebound page (Origin = Host = "
                      f"rebind.attacker.example:{p}) gets 403; local names, any port, and no Origin get 101"):
                wrong = []
                for where in paths_of(gw, app):
                    wrong += await statuses(where, [
                        ("rebind.attacker.example", 403, dict(host=f"rebind.attacker.example:{p}",
                                                              origin=f"http://rebind.attacker.example:{p}")),
                        ("localhost", 101, dict(host=f"localhost:{p}", origin=f"http://localhost:{p}")),
                        ("127.0.0.1", 101, dict(host=f"127.0.0.1:{p}", origin=f"http://127.0.0.1:{p}")),
                        ("[::1]", 101, dict(host=f"[::1]:{p}", origin=f"http://[::1]:{p}")),
                        ("localhost:9999 (another port)", 403, dict(host=f"localhost:{p}",
                                                                    origin="http://localhost:9999")),
                        ("127.0.0.1 to localhost", 101, dict(host=f"localhost:{p}", origin=f"http://127.0.0.1:{p}")),
                        ("foo.localhost", 101, dict(host=f"foo.localhost:{p}", origin=f"http://foo.localhost:{p}")),
                        ("an Origin of 600 bytes", 403, dict(host=f"localhost:{p}",
                                                             origin="http://" + "a" * 580 + ".example")),
                        ("no Origin", 101, dict()),
                    ])
                check(not wrong, "the Origin check without --allow-origin:\n  " + "\n  ".join(wrong))
            gw.assert_alive()


async def part_origin_allow_list():
    async with ChatApp() as app:
        async with dropin_gateway(app, "gateway:origin-allowed", ["--allow-origin", "https://chat.example.com"]) as gw:
            with step(f"/ws and {DROPIN_PATH}, --allow-origin https://chat.example.com (Host chat.example.com): "
                      f"that Origin gets 101, http://chat.example.com 403"):
                wrong = []
                for where in paths_of(gw, app):
                    wrong += await statuses(where, [
                        ("https://chat.example.com", 101, dict(host="chat.example.com",
                                                               origin="https://chat.example.com")),
                        ("http://chat.example.com", 403, dict(host="chat.example.com",
                                                              origin="http://chat.example.com")),
                    ])
                check(not wrong, "--allow-origin https://chat.example.com:\n  " + "\n  ".join(wrong))
            gw.assert_alive()


# -------------------------------------------------------------------------------------- B


# (Origin, what the log line must name instead, the secret that must not be in the log at all):
# src/core/log.c masks e-mail addresses as [email], API keys, JWTs and token= values as [token]
SECRET_ORIGINS = [
    ("http://alice@example.com.evil:1", "Origin 'http://[email]:1'", "alice@example.com"),
    ("https://sk-live0123456789abcdefghij.example", "Origin 'https://[token].example'", "sk-live0123456789abcdefghij"),
    ("http://eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJib2IifQ.c2lnbmF0dXJl.example", "Origin 'http://[token].example'",
     "eyJzdWIiOiJib2IifQ"),
    ("http://x.example/?token=s3cr3t-origin-value", "Origin 'http://x.example/?[token]", "s3cr3t-origin-value"),
]


async def refusal_logged(gw, origin, pattern, since):
    """None when a log line written after `since` characters is about an Origin and matches
    `pattern` (the refused Origin); else what is wrong."""
    def found():
        new = gw.log_text()[since:]
        return any(re.search(pattern, line) and re.search(r"(?i)origin|refus|403", line)
                   for line in new.splitlines())
    if await harness.wait_until(found, 2):
        return None
    new = gw.log_text()[since:].strip().splitlines()
    return f"no log line names the refused Origin {origin!r} (pattern {pattern!r}); new log lines: {new[-4:]}"


async def part_origin_logged():
    async with Gateway([], harness.make_config({"demo": harness.demo_upstream()}, "demo"),
                       name="gateway:origin-log") as gw:
        p = gw.port
        with step("no --allow-origin: Origin null (a page opened from a file) and the rebound page's Origin "
                  "get 403, and each refusal's log line names the Origin"):
            wrong = []
            for label, host, origin, pattern in (
                    ("Origin null", None, "null", r"\bnull\b"),
                    ("the rebound page", f"rebind.attacker.example:{p}", f"http://rebind.attacker.example:{p}",
                     r"rebind\.attacker\.example")):
                since = len(gw.log_text())
                got = await asyncio.to_thread(raw_handshake, p, host=host, origin=origin)
                if got[0] != 403:
                    wrong.append(f"{label} ({origin}): expected 403, got {shown(got)}")
                why = await refusal_logged(gw, origin, pattern, since)
                if why:
                    wrong.append(why)
            check(not wrong, "\n  ".join(wrong))
        with step("an Origin that carries a secret (an e-mail address, an API key, a JWT, a token in a query): "
                  "403, and the refusal's log line names the Origin masked as every logged value is, the "
                  "secret never in clear"):
            wrong = []
            for origin, masked, secret in SECRET_ORIGINS:
                since = len(gw.log_text())
                got = await asyncio.to_thread(raw_handshake, p, origin=origin)
                if got[0] != 403:
                    wrong.append(f"{origin}: expected 403, got {shown(got)}")
                why = await refusal_logged(gw, origin, re.escape(masked), since)
                if why:
                    wrong.append(why)
                new = gw.log_text()[since:]
                if secret in new:
                    wrong.append(f"{secret!r} is in the log in clear: {[l for l in new.splitlines() if secret in l]}")
            check(not wrong, "\n  ".join(wrong))
    async with Gateway(["--allow-origin", "null"], harness.make_config({"demo": harness.demo_upstream()}, "demo"),
                       name="gateway:origin-null") as gw:
        with step("--allow-origin null: Origin null gets 101"):
            got = await Where(gw, "/ws").handshake(origin="null")
            check(got[0] == 101, f"Origin null with --allow-origin null: expected 101, got {shown(got)}")
            gw.assert_alive()


# -------------------------------------------------------------------------------------- C


def b64(n):
    return base64.b64encode(b"k" * n).decode()


async def part_rfc6455():
    async with ChatApp() as app:
        async with dropin_gateway(app, "gateway:rfc6455") as gw:
            with step(f"/ws and {DROPIN_PATH}: Sec-WebSocket-Version 8, 14, abc or none: 426 with "
                      f"Sec-WebSocket-Version: 13; a Sec-WebSocket-Key not base64 of 16 bytes, or none: 400; a "
                      f"target with dot segments: 400; a correct handshake: 101"):
                wrong = []
                for where in paths_of(gw, app):
                    base = where.path
                    for version in ("8", "14", "abc", None):
                        got = await where.handshake(version=version)
                        if got[0] != 426 or got[1].get("sec-websocket-version") != "13":
                            wrong.append(f"{base}, version {version!r}: expected 426 with Sec-WebSocket-Version: "
                                         f"13, got {shown(got)}, Sec-WebSocket-Version "
                                         f"{got[1].get('sec-websocket-version')!r}")
                    wrong += await statuses(where, [
                        ("key 'abc'", 400, dict(key="abc")),
                        ("key of 15 bytes", 400, dict(key=b64(15))),
                        ("key of 17 bytes", 400, dict(key=b64(17))),
                        ("key of 24 characters outside base64", 400, dict(key="@" * 22 + "==")),
                        ("no key", 400, dict(key=None)),
                        (f"target /..{base}", 400, dict(path=f"/..{base}")),
                        (f"target {base}/..{base}", 400, dict(path=f"{base}/..{base}")),
                        (f"target /.{base}", 400, dict(path=f"/.{base}")),
                        (f"target /%2e%2E{base}", 400, dict(path=f"/%2e%2E{base}")),
                        # slashes as %2F, which lws decodes before it collapses the dots
                        (f"target {base}%2F..%2F{base[1:]}", 400, dict(path=f"{base}%2F..%2F{base[1:]}")),
                        (f"target /x%2f..%2f{base[1:]}", 400, dict(path=f"/x%2f..%2f{base[1:]}")),
                        (f"target /.{base} with a token in its query", 400,
                         dict(path=f"/.{base}?x=1;access%5Ftoken=SECRETVALUE123")),
                        ("a correct handshake", 101, dict()),
                    ])
                check(not wrong, "RFC 6455 handshake checks:\n  " + "\n  ".join(wrong))
            with step("the log of those refusals holds no query (a percent-encoded token the masks do not "
                      "know), and an Origin refused is masked whole (an e-mail in it, past 200 bytes)"):
                got = await asyncio.to_thread(raw_handshake, gw.port, "/ws",
                                              origin="http://" + "a" * 177 + ".alice.smith@example.com")
                check(got[0] == 403, f"the Origin should be refused: {shown(got)}")
                await asyncio.sleep(0.2)  # the log line is written as the refusal goes
                log = gw.log_text()
                check("SECRETVALUE123" not in log, "the log holds the token of a refused target's query")
                check("alice.smith" not in log, "the log holds part of an e-mail address in a refused Origin")
            gw.assert_alive()


# -------------------------------------------------------------------------------------- D


async def refused_as_unauthorized(gw, token, what):
    """None when the gateway refuses `token` as docs/protocol.md, Identity, says (an error frame
    unauthorized, no hello, close 1008); else what it did. A hello fails at once (the
    harness's expect_unauthorized would wait for a close that does not come)."""
    try:
        ws = await websockets.connect(gw.url, extra_headers={"Authorization": f"Bearer {token}"},
                                      open_timeout=T)
    except websockets.InvalidStatusCode as err:
        return f"{what}: the handshake was refused with HTTP {err.status_code}, not an error frame and close 1008"
    frames, code = [], None
    try:
        while True:
            frames.append(json.loads(await asyncio.wait_for(ws.recv(), T)))
            if frames[-1].get("type") == "hello":
                return f"{what}: accepted, the gateway sent a hello: {harness.brief(frames[-1])}"
    except websockets.ConnectionClosed as err:
        code = err.code
    except asyncio.TimeoutError:
        return f"{what}: no close within {T}s; frames {[harness.brief(f, 120) for f in frames]}"
    finally:
        await ws.close()
    codes = [f.get("code") for f in frames if f.get("type") == "error"]
    if codes[:1] != ["unauthorized"] or code != 1008:
        return f"{what}: expected an error frame unauthorized and close 1008, got {frames} and close {code}"
    print(f"   {what}: {harness.brief(frames[0], 200)}")
    return None


async def part_jwt_times():
    env = {"CHATGATE_JWT_SECRET": JWT_SECRET}
    now = int(time.time())
    async with Gateway(["--auth", "jwt"], None, env=env, name="gateway:jwt-times") as gw:
        with step("a token with exp now+3600 is accepted"):
            good = harness.make_jwt(JWT_SECRET, {"sub": "jwt-normal", "exp": now + 3600})
            c = await Client.connect(gw, expect_user="jwt-normal", extra_headers={"Authorization": f"Bearer {good}"})
            await c.close()
        with step("exp 1e300, exp 1e19, nbf -1e300: unauthorized (error frame, close 1008), as an expired token"):
            wrong = []
            for what, payload in (("exp 1e300", '{"sub":"jwt-e300","exp":1e300}'),
                                  ("exp 1e19", '{"sub":"jwt-e19","exp":1e19}'),
                                  ("nbf -1e300", '{"sub":"jwt-nbf","exp":%d,"nbf":-1e300}' % (now + 3600))):
                token = harness.make_jwt(JWT_SECRET, payload, raw_payload=True)
                why = await refused_as_unauthorized(gw, token, what)
                if why:
                    wrong.append(why)
            check(not wrong, "\n  ".join(wrong))
        gw.assert_alive()


# -------------------------------------------------------------------------------------- E


HUGE_RETRY_AFTER = "99999999999999999999"
INT64_MAX = 2**63 - 1
USAGE = {"maxed": (INT64_MAX, INT64_MAX), "wide": (5, 2**64), "small": (1, 1), "normal": (300, 300)}


class NumbersOpenAI(harness.FakeOpenAI):
    """harness.FakeOpenAI, and:
      err429huge  429 with "Retry-After: 99999999999999999999" (the connection kept);
      usage       "echo: <text>" word by word, then a last chunk {"choices":[],"usage":
                  {"prompt_tokens":P,"completion_tokens":C}}, the numbers written out in
                  full, (P, C) = USAGE[the text's first word] (no digits in the user's text:
                  the shipped rules would mask a long number in the reply)."""

    async def _do_err429huge(self, conn, req):
        body = b'{"error":{"message":"rate limited","type":"rate_limit_error"}}'
        head = (f"HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json\r\n"
                f"Retry-After: {HUGE_RETRY_AFTER}\r\nContent-Length: {len(body)}\r\n\r\n").encode()
        if await self._write(conn, req, head + body):
            req.finished_at = time.monotonic()
        return True

    async def _do_usage(self, conn, req):
        text = str(req.last_user_text)
        prompt, completion = USAGE[text.split()[0]]
        words = harness.words_of("echo: " + text)
        req.reply_text = "".join(words)
        if not await self._sse_head(conn, req):
            return False
        for w in words:
            event = harness.sse_event(harness.completion_chunk({"content": w}))
            if not await self._write(conn, req, harness.chunk(event)):
                return False
        last = b'data: {"choices":[],"usage":{"prompt_tokens":%d,"completion_tokens":%d}}\n\n' % (
            prompt, completion)
        ok = (await self._write(conn, req, harness.chunk(harness.sse_event(harness.completion_chunk({}, "stop"))))
              and await self._write(conn, req, harness.chunk(last))
              and await self._write(conn, req, harness.chunk(b"data: [DONE]\n\n"))
              and await self._write(conn, req, b"0\r\n\r\n"))
        if ok:
            req.finished_at = time.monotonic()
        return ok


def no_sanitizer_report(gw):
    report = gw.sanitizer_report()
    check(report is None, f"{gw.name} logged a sanitizer report:\n{report}")


async def part_retry_after():
    OUT_MS = 200
    async with NumbersOpenAI() as fake:
        upstream = {"urls": [fake.url("err429huge"), fake.url("ok")], "model": "m", "max_attempts": 1,
                    "out_ms": OUT_MS, "connect_timeout_ms": 2000, "first_byte_timeout_ms": 2000,
                    "idle_timeout_ms": 2000}
        cfg = harness.make_config({"llm": upstream}, "llm", rate_limit={"messages_per_second": 1000, "burst": 1000})
        async with Gateway([], cfg, name="gateway:retry-after") as gw:
            client = await Client.connect(gw)
            with step(f"a dialog whose replica answers 429 with Retry-After: {HUGE_RETRY_AFTER}: the gateway "
                      f"stays up and the client gets an error frame"):
                room = None
                for i in range(20):  # rooms until one's dialog goes to the 429 replica first
                    before = len(fake.requests_for("err429huge"))
                    turn = await client.message(f"hello {i}", mid=f"m{i}", room=f"room{i}")
                    if len(fake.requests_for("err429huge")) > before:
                        room = f"room{i}"
                        check(turn.kind == "error", f"the 429 should end the message with an error frame "
                                                    f"(max_attempts 1): {turn.describe()}")
                        print(f"   {room}: {harness.brief(turn.terminal, 300)}")
                        break
                    turn.expect_done()
                check(room is not None, "no dialog of 20 went to the 429 replica first")
                gw.assert_alive()
                no_sanitizer_report(gw)
            with step("the dialog's next message is answered (by the other replica)"):
                (await client.message("and now?", mid="next", room=room)).expect_done()
            with step(f"after out_ms ({OUT_MS} ms) the 429 replica is still out (Retry-After, up to an hour): "
                      f"the dialog's message is answered, not sent to it again"):
                await asyncio.sleep(OUT_MS / 1000 + 0.3)  # the subject: past out_ms
                before = len(fake.requests_for("err429huge"))
                turn = await client.message("still there?", mid="later", room=room)
                again = len(fake.requests_for("err429huge")) - before
                check(turn.kind == "done" and again == 0,
                      f"the replica that asked to be left alone for {HUGE_RETRY_AFTER} s was sent the dialog's "
                      f"message again {OUT_MS / 1000 + 0.3:.1f} s later, out_ms being {OUT_MS} ({again} "
                      f"request(s)); the message got "
                      f"{harness.brief(turn.terminal, 300)}")
            await client.check_alive()
            await client.close()
            gw.assert_alive()
            no_sanitizer_report(gw)


def jwt_client(gw, user):
    token = harness.make_jwt(JWT_SECRET, {"sub": user, "exp": 4_000_000_000})
    return Client.connect(gw, expect_user=user, extra_headers={"Authorization": "Bearer " + token})


def is_day_limited(turn):
    t = turn.terminal
    return t.get("type") == "error" and t.get("code") == "rate_limited" and t.get("limit") == "tokens_per_day"


async def part_usage_overflow():
    env = {"CHATGATE_JWT_SECRET": JWT_SECRET, "CHATGATE_NOW": "2026-02-03T10:00:00Z"}
    async with NumbersOpenAI() as fake:
        cfg = harness.state_config({"llm": harness.openai_upstream(fake, "usage")}, "llm", auth="jwt",
                                   limits={"tokens_per_day": 1000})
        async with Gateway(config=cfg, env=env, name="gateway:usage") as gw:
            big = INT64_MAX
            with step(f"usage prompt_tokens = completion_tokens = {big}: the user's next message is "
                      f"rate_limited by tokens_per_day"):
                client = await jwt_client(gw, "max-usage")
                first = await client.message("maxed hello", mid="u1", room="r")
                print(f"   u1: {harness.brief(first.terminal, 200)}")
                gw.assert_alive()
                no_sanitizer_report(gw)
                turn = await client.message("small one more", mid="u2", room="r")
                check(is_day_limited(turn),
                      f"after a turn that reported {big} + {big} tokens (limit 1000 a day) the next message "
                      f"should be rate_limited, limit tokens_per_day: got {harness.brief(turn.terminal, 300)}")
                await client.close()
            with step("completion_tokens 2^64 (18446744073709551616): no crash, not counted negative (with "
                      "600 tokens a turn after it, refused by tokens_per_day by the third message)"):
                client = await jwt_client(gw, "wide-usage")
                first = await client.message("wide hello", mid="w0", room="r")
                print(f"   w0: {harness.brief(first.terminal, 200)}")
                gw.assert_alive()
                no_sanitizer_report(gw)
                turns = []
                for i in range(1, 4):
                    turn = await client.message(f"normal turn {i}", mid=f"w{i}", room="r")
                    turns.append(turn)
                    if turn.kind == "error":
                        break
                    turn.expect_done()
                got = [t.terminal.get("limit") or t.terminal.get("code") if t.kind == "error" else t.kind
                       for t in turns]
                check(is_day_limited(turns[-1]),
                      f"after 2^64 completion tokens, then 600 a turn (limit 1000 a day), the user should be "
                      f"refused by tokens_per_day by the third turn: {got}; last {harness.brief(turns[-1].terminal)}")
                await client.check_alive()
                await client.close()
            gw.assert_alive()
            no_sanitizer_report(gw)


# ---- E3, E4: numbers a ws chat app and Redis hand the gateway


YEAR_S = 366 * 86400  # the longest awaiting ttl the gateway keeps (dialog.c: a backend's ttl, clamped)
AWAITING_S = 60       # lifetimes.awaiting_s: the ttl of an awaiting state whose directive names none
DIALOG_S = 21600      # lifetimes.params_s and dialog_s (their defaults): the state key's TTL at least


def awaiting_says(ttl_json):
    """A message text the state app (harness.FakeApp /state) answers with a directive setting an
    awaiting confirmation whose ttl is `ttl_json`, written as is into the app's JSON frame."""
    return ('confirm it STATE:{"awaiting":{"type":"confirmation","context":{"action":"pay"},"ttl":%s}}'
            % ttl_json)


def redis_awaiting(redis, user, room):
    """The dialog's awaiting state in Redis, in its state (docs/state.md, Redis layout): (the
    awaiting object or None, its awaiting_expires, the state key's TTL in seconds)."""
    key = harness.dialog_key(user, room, "state")
    v = redis.state(key)
    return v.get("awaiting"), v.get("awaiting_expires"), redis.ttl(key)


async def part_awaiting_ttl():
    ttls = [("2^63-1", str(INT64_MAX), YEAR_S), ("2^62", str(2**62), YEAR_S),
            ("1e30 (no integer)", "1e30", AWAITING_S)]
    async with harness.FakeApp() as app, harness.RedisServer() as redis:
        for store in ("memory", "redis"):
            cfg = harness.state_config({"app": harness.app_upstream(app, "/state")}, "app",
                                       store=redis.url if store == "redis" else "memory",
                                       lifetimes={"awaiting_s": AWAITING_S})
            async with Gateway(["--rules", harness.empty_rules_dir()], cfg, name=f"gateway:awaiting-{store}") as gw:
                client = await Client.connect(gw)
                user = client.hello["user"]
                for i, (label, ttl, longest) in enumerate(ttls):
                    room = f"ttl{i}"
                    with step(f"{store} store: a ws chat app's directive sets awaiting with ttl {label}: the "
                              f"awaiting state is kept (context.get, and forwarded with the next message)"
                              + (f", its end at most {longest} s away and the state key's TTL covering it"
                                 if store == "redis" else "")):
                        (await client.message(awaiting_says(ttl), mid=f"set{i}", room=room)).expect_done()
                        gw.assert_alive()
                        no_sanitizer_report(gw)
                        state = await context_command(client, "context.get", room)
                        check((state.get("awaiting") or {}).get("context") == {"action": "pay"},
                              f"ttl {ttl}: the awaiting state the app set is gone at once (now + ttl wrapped "
                              f"into the past?): context.get has awaiting {harness.brief(state.get('awaiting'))}")
                        (await client.message("and then", mid=f"next{i}", room=room)).expect_done()
                        forwarded = (await app.wait_message(f"next{i}")).get("awaiting")
                        check((forwarded or {}).get("context") == {"action": "pay"},
                              f"ttl {ttl}: the next message reached the app without the awaiting state: "
                              f"{harness.brief(forwarded)}")
                        if store == "redis":
                            now = time.time()
                            kept, expires, key_ttl = redis_awaiting(redis, user, room)
                            check((kept or {}).get("context") == {"action": "pay"},
                                  f"ttl {ttl}: Redis's state should hold the awaiting state: {harness.brief(kept)} "
                                  f"(the save may have failed: "
                                  f"{[l for l in gw.log_text().splitlines() if 'save failed' in l][-1:]})")
                            check(isinstance(expires, int) and now < expires <= now + longest + 5,
                                  f"ttl {ttl}: awaiting_expires {expires} should be within {longest} s from now "
                                  f"({now:.0f})")
                            # the state key lives the longest of params_s, dialog_s and the awaiting
                            # state's time left: never past that, never short of the awaiting state
                            check(0 < key_ttl <= max(longest, DIALOG_S) and key_ttl >= expires - now - 2,
                                  f"ttl {ttl}: the state key's TTL {key_ttl} should cover the awaiting state "
                                  f"({expires - now:.0f} s left) and be at most {max(longest, DIALOG_S)} s")
                with step(f"{store} store: ttl 2^63 (past any 64-bit integer): the gateway stays up, the "
                          f"message ends once, and no awaiting state is kept with a wrapped expiry"):
                    turn = await client.message(awaiting_says(str(2**63)), mid="past", room="past")
                    print(f"   ttl 2^63: {harness.brief(turn.terminal, 200)}")
                    check(turn.kind in ("done", "error"), f"ttl 2^63: {turn.describe()}")
                    if turn.kind == "error":  # the app's frame refused: the log says what was wrong, where
                        await harness.wait_log(gw, r"not a chatgate JSON frame: not JSON \(too big integer", 3)
                    gw.assert_alive()
                    no_sanitizer_report(gw)
                    state = await context_command(client, "context.get", "past")
                    if state.get("awaiting") and store == "redis":
                        now = time.time()
                        _, expires, key_ttl = redis_awaiting(redis, user, "past")
                        check(isinstance(expires, int) and now < expires <= now + YEAR_S + 5,
                              f"ttl 2^63: awaiting kept with awaiting_expires {expires} (now {now:.0f})")
                        check(expires - now - 2 <= key_ttl <= YEAR_S,
                              f"ttl 2^63: awaiting kept, the state key's TTL {key_ttl}")
                await client.check_alive()
                await client.close()
                gw.assert_alive()
                no_sanitizer_report(gw)


ADMIN_TOKEN = "handshake-numbers-admin"
MAX_USAGE = {"app": {"in": INT64_MAX, "out": INT64_MAX, "turns": INT64_MAX}}


async def part_stored_counts():
    async with harness.FakeApp() as app, harness.RedisServer() as redis:
        cfg = harness.state_config({"app": harness.app_upstream(app, "/state")}, "app", store=redis.url)
        async with Gateway(["--rules", harness.empty_rules_dir()], cfg, env={"CHATGATE_ADMIN_TOKEN": ADMIN_TOKEN},
                           name="gateway:stored-counts") as gw:
            client = await Client.connect(gw)
            user = client.hello["user"]
            now = int(time.time())

            def state_key(room):
                return harness.dialog_key(user, room, "state")

            # dialogs Redis holds (docs/state.md, Redis layout: the state hash, as a peer's save
            # writes it) with a peer's numbers in their meta: the gateway has no copy of them, so a
            # turn's load reads these
            stored = {"big": (99999999999999999999, INT64_MAX), "neg": (-5, -7)}
            for room, (turns, messages) in stored.items():
                v = {"service": None, "params": {}, "awaiting": None, "awaiting_expires": 0,
                     "soft_context": None, "soft_expires": 0,
                     "meta": {"created_at": now - 100, "last_activity": now - 50,
                              "turn_count": turns, "message_count": messages},
                     "last_tool_result": None, "usage": MAX_USAGE,
                     "params_until": now + 3600, "dialog_until": now + 3600}
                redis.command("HSET", state_key(room), "rev", "peer#7", "created_at", str(now - 100),
                              "last_activity", str(now - 50), "v", json.dumps(v))
            with step("Redis holds turn_count 99999999999999999999 and message_count 2^63-1: after a message, "
                      "both are still 2^53 or more and positive (saturated, not wrapped), in context.get and "
                      "written back to Redis"):
                before = (await context_command(client, "context.get", "big"))["meta"]
                (await client.message("hello big", mid="big1", room="big")).expect_done()
                no_sanitizer_report(gw)
                meta = (await context_command(client, "context.get", "big"))["meta"]
                for name in ("turn_count", "message_count"):
                    check(2**53 <= meta[name] <= INT64_MAX and meta[name] >= before[name],
                          f"{name}: {before[name]} before the message, {meta[name]} after (stored "
                          f"{dict(zip(('turn_count', 'message_count'), stored['big']))[name]}): a count "
                          f"from Redis must saturate, not wrap negative")
                back = redis.state(state_key("big")).get("meta") or {}
                check(all(isinstance(back.get(n), int) and 0 < back[n] <= INT64_MAX
                          for n in ("turn_count", "message_count")),
                      f"the counts written back to Redis (the state's meta): {back}")
            with step("Redis holds turn_count -5 and message_count -7: after a message each is 1"):
                (await client.message("hello neg", mid="neg1", room="neg")).expect_done()
                meta = (await context_command(client, "context.get", "neg"))["meta"]
                check(meta["turn_count"] == 1 and meta["message_count"] == 1,
                      f"negative stored counts should count from 0: {meta}")
            with step(f"Redis holds usage in, out and turns of 2^63-1: after a turn each stays 2^63-1, and "
                      f"GET /admin/users/{{user}}/usage sums two such rooms to 2^63-1, never negative"):
                for room in ("big", "neg"):
                    usage = redis.state(state_key(room)).get("usage")
                    check(usage == MAX_USAGE, f"room {room}: usage after a turn {usage}, expected it saturated "
                                              f"at {MAX_USAGE}")
                url = f"{gw.http_url}/admin/users/{urllib.parse.quote(user, safe='')}/usage"
                status, _, body = await asyncio.to_thread(harness.http_request, url,
                                                          headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
                check(status == 200, f"{url}: {status} {body[:200]!r}")
                total = json.loads(body).get("total")
                check(total == MAX_USAGE, f"the admin API's total of two rooms at {MAX_USAGE['app']} each: {total}")
            await client.check_alive()
            await client.close()
            gw.assert_alive()
            no_sanitizer_report(gw)


async def main(args):
    await independent(part_origin_rebinding())
    await independent(part_origin_allow_list())
    await independent(part_origin_logged())
    await independent(part_rfc6455())
    await independent(part_jwt_times())
    await independent(part_retry_after())
    await independent(part_usage_overflow())
    await independent(part_awaiting_ttl())
    await independent(part_stored_counts())


if __name__ == "__main__":
    harness.run(main, timeout=100)
