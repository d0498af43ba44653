"""End-to-end test of issue 9's HTTP-level hardening (defect 15), with real clients:
python3-websockets for WebSocket handshakes, http.client and raw sockets for HTTP.

Covers:
- header space: a WebSocket handshake and a page request with a 10 KB cookie are served
  (lws's default 4 KB used to drop them without an answer); with 20 KB, 100 KB of cookie,
  or a 20 KB Authorization header, or three 6 KB headers of names libwebsockets does not
  know (issue 39's ninth round), the answer is HTTP 431 with a body that says why, on
  the WebSocket path as on plain HTTP; `max_header_bytes` in the config moves the bound;
  the gateway keeps serving afterwards;
- a request without an upgrade on /ws, or under the drop-in path, gets 426 Upgrade Required
  with "upgrade: websocket" and a body that says what the path takes (it fell through to
  the pages' 404); the pages and the WebSocket on /ws are served as before;
- the admin listener (--admin-listen) refuses a WebSocket upgrade with an HTTP error
  (no 101), on any path, and still answers its API;
- a request with a body (POST, PUT, PATCH; Content-Length or chunked), on the pages,
  /metrics or the admin API, of either listener, is answered 413 and the gateway keeps
  answering at once (lws 4.1 spun at 100% CPU on such bodies); a POST without one still
  reaches the admin API;
- JWTs (--auth jwt): a long token (8 KB) is accepted, in the header and in the query; a
  token without exp is unauthorized (1008) unless
  jwt.allow_no_exp is true in the config; a signature with non-zero unused bits in its
  last base64url character (the same bytes, another spelling) is unauthorized.
"""

import asyncio
import http.client
import json
import socket
import time

import websockets

import harness
from harness import Client, check, independent, step

JWT_SECRET = "hardening-secret"


def raw_request(port, request, timeout=harness.DEFAULT_TIMEOUT):
    """Sends raw bytes and reads until the gateway closes or stops sending: the answer's
    bytes, b"" when the connection was dropped without one."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(request)
        out = b""
        try:
            while True:
                data = s.recv(65536)
                if not data:
                    break
                out += data
                if b"\r\n\r\n" in out and b"101 Switching" in out:
                    break  # an upgrade answer: nothing more comes
        except (ConnectionResetError, socket.timeout):
            pass
        return out


def upgrade_request(port, path, extra=b""):
    return (f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
            "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
            "Sec-WebSocket-Version: 13\r\n").encode() + extra + b"\r\n"


def http_get(port, path, headers, timeout=harness.DEFAULT_TIMEOUT):
    """GET with http.client: (status, body), or (None, the error) when no answer came."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read().decode(errors="replace")
    except (http.client.HTTPException, OSError) as err:
        return None, f"{type(err).__name__}: {err}"
    finally:
        conn.close()


async def handshake(url, **kwargs):
    """Opens a WebSocket: ("open", ws), ("status", code, body) or ("dropped", why)."""
    kwargs.setdefault("open_timeout", harness.DEFAULT_TIMEOUT)
    try:
        return ("open", await websockets.connect(url, **kwargs))
    except websockets.InvalidStatusCode as err:
        return ("status", err.status_code, b"")
    except (websockets.InvalidMessage, websockets.ConnectionClosed, OSError, asyncio.TimeoutError) as err:
        return ("dropped", f"{type(err).__name__}: {err} ({err.__cause__!r})")


async def expect_431(gw, headers, what):
    got = await handshake(gw.url, extra_headers=headers)
    if got[0] == "open":
        await got[1].close()
    check(got[0] == "status" and got[1] == 431,
          f"{what}: the WebSocket handshake should get HTTP 431, got {got[:2]}")
    status, body = await asyncio.to_thread(http_get, gw.port, "/healthz", headers)
    check(status == 431, f"{what}: GET /healthz should get HTTP 431, got {status} {body[:200]!r}")
    check("header" in body and str(gw_limit(gw)) in body,
          f"{what}: the 431 body should say the headers passed the bound: {body[:200]!r}")


def gw_limit(gw):
    return (gw.config or {}).get("max_header_bytes", 16384) if isinstance(gw.config, dict) else 16384


async def test_header_space():
    config = harness.make_config({"demo": harness.demo_upstream(0)}, "demo")
    async with harness.Gateway([], config, name="gateway-headers") as gw:
        with step("a 10 KB cookie: the WebSocket handshake and a message work, GET /healthz is 200"):
            cookie = {"Cookie": "session=" + "c" * 10000}
            got = await handshake(gw.url, extra_headers=cookie)
            check(got[0] == "open", f"a handshake with a 10 KB cookie should be accepted: {got}")
            client = Client(got[1], None)
            hello = await client.recv()
            check(hello.get("type") == "hello", f"no hello: {harness.brief(hello)}")
            await client.send_raw(json.dumps({"type": "message", "id": "h1", "text": "hello there"}))
            (await client.collect_turn("h1")).expect_done()
            await client.close()
            status, body = await asyncio.to_thread(http_get, gw.port, "/healthz", cookie)
            check(status == 200, f"GET /healthz with a 10 KB cookie: {status} {body[:200]!r}")
        with step("20 KB and 100 KB of cookie, a 20 KB Authorization: HTTP 431 with a reason"):
            await expect_431(gw, {"Cookie": "session=" + "c" * 20000}, "20 KB cookie")
            await expect_431(gw, {"Cookie": "session=" + "c" * 100000}, "100 KB cookie")
            await expect_431(gw, {"Authorization": "Bearer " + "t" * 20000}, "20 KB Authorization")
        with step("three 6 KB headers of names libwebsockets does not know (X-Pad-N): HTTP 431 too (issue 39's "
                  "ninth round: only known headers were counted, and 45 KB of them got 101)"):
            await expect_431(gw, {f"X-Pad-{i}": "p" * 6000 for i in range(3)}, "3 x 6 KB X-Pad")
            await expect_431(gw, {f"X-Pad-{i}": "p" * 15000 for i in range(3)}, "3 x 15 KB X-Pad")
        with step("raw request: the 431 is a whole HTTP/1.1 answer"):
            answer = await asyncio.to_thread(raw_request, gw.port,
                                             upgrade_request(gw.port, "/ws", b"Cookie: " + b"k" * 30000 + b"\r\n"))
            check(answer.startswith(b"HTTP/1.1 431 "), f"raw upgrade with 30 KB cookie: {answer[:200]!r}")
        with step("the refusals are counted in chatgate_refused_connections_total"):
            status, _, body = await asyncio.to_thread(harness.http_get, gw.http_url + "/metrics")
            check(status == 200, f"/metrics answered {status}")
            refused = harness.parse_metrics(body.decode()).value("chatgate_refused_connections_total")
            check(refused >= 7, f"7 requests got 431 (6 above, 1 raw), counted {refused}")
        with step("the gateway goes on: /healthz 200, a new client served"):
            status, body = await asyncio.to_thread(http_get, gw.port, "/healthz", {})
            check(status == 200, f"GET /healthz after the refusals: {status} {body[:200]!r}")
            client = await Client.connect(gw)
            await client.send_raw(json.dumps({"type": "message", "id": "h2", "text": "still here?"}))
            (await client.collect_turn("h2")).expect_done()
            await client.close()
            gw.assert_alive()
    config = dict(config, max_header_bytes=4096)
    async with harness.Gateway([], config, name="gateway-headers-4k") as gw:
        with step("max_header_bytes 4096: a 3 KB cookie served, a 6 KB one gets 431"):
            status, body = await asyncio.to_thread(http_get, gw.port, "/healthz", {"Cookie": "a=" + "b" * 3000})
            check(status == 200, f"3 KB cookie under a 4096 bound: {status} {body[:200]!r}")
            await expect_431(gw, {"Cookie": "a=" + "b" * 6000}, "6 KB cookie, bound 4096")


async def test_admin_listener_upgrade():
    admin_port = harness.free_port()
    env = {"CHATGATE_ADMIN_TOKEN": "admin-secret"}
    args = ["--admin-listen", f"127.0.0.1:{admin_port}"]
    async with harness.Gateway(args, None, env=env, name="gateway-admin") as gw:
        deadline = time.monotonic() + 5
        while True:  # the admin listener comes up with the main one
            try:
                socket.create_connection(("127.0.0.1", admin_port), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    harness.fail("the admin listener did not accept connections")
                await asyncio.sleep(0.05)
        with step("the admin listener refuses WebSocket upgrades (websockets client): no 101"):
            for path in ("/admin/reload", "/admin/dialogs/u/r", "/ws", "/"):
                got = await handshake(f"ws://127.0.0.1:{admin_port}{path}",
                                      extra_headers={"Authorization": "Bearer admin-secret"})
                if got[0] == "open":
                    await got[1].close()
                check(got[0] == "status" and 400 <= got[1] < 500,
                      f"upgrade to {path} on the admin listener: expected an HTTP 4xx refusal, got {got[:2]}")
        with step("raw upgrade request: an HTTP error with a body, never 101"):
            answer = await asyncio.to_thread(raw_request, admin_port, upgrade_request(admin_port, "/admin/reload"))
            status_line = answer.split(b"\r\n", 1)[0]
            check(status_line.startswith(b"HTTP/1.1 4") and b"101" not in status_line,
                  f"raw upgrade on the admin listener: {answer[:200]!r}")
            check(b"WebSocket" in answer, f"the refusal should say why: {answer[:300]!r}")
        with step("the admin API still answers, and oversized headers get 431 there too"):
            status, body = await asyncio.to_thread(http_get, admin_port, "/admin/dialogs/u/r",
                                                   {"Authorization": "Bearer admin-secret"})
            check(status == 200, f"GET /admin/dialogs/u/r: {status} {body[:200]!r}")
            status, body = await asyncio.to_thread(http_get, admin_port, "/admin/dialogs/u/r",
                                                   {"Authorization": "Bearer " + "x" * 20000})
            check(status == 431, f"20 KB Authorization on the admin listener: {status} {body[:200]!r}")
        gw.assert_alive()


def flip_unused_bits(token):
    """The same signature bytes spelled with the last character's unused bits set."""
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    v = alphabet.index(token[-1])
    return token[:-1] + alphabet[(v & ~3) | 1]  # 32 bytes: 43 characters, 2 unused bits


async def test_jwt_policy():
    env = {"CHATGATE_JWT_SECRET": JWT_SECRET}
    now = int(time.time())
    good = harness.make_jwt(JWT_SECRET, {"sub": "jwt-ok", "exp": now + 600})
    no_exp = harness.make_jwt(JWT_SECRET, {"sub": "jwt-forever"})
    async with harness.Gateway(["--auth", "jwt"], None, env=env, name="gateway-jwt") as gw:
        with step("JWT with exp accepted; without exp unauthorized (1008)"):
            c = await Client.connect(gw, expect_user="jwt-ok", extra_headers={"Authorization": f"Bearer {good}"})
            await c.close()
            await harness.expect_unauthorized(gw.url, "JWT without exp",
                                              extra_headers={"Authorization": f"Bearer {no_exp}"})
        with step("a long JWT (8 KB of claims), in the header and in the query: accepted"):
            long_jwt = harness.make_jwt(JWT_SECRET, {"sub": "jwt-long", "exp": now + 600, "roles": ["r" * 60] * 100})
            check(len(long_jwt) > 8000, f"the long JWT is only {len(long_jwt)} bytes")
            c = await Client.connect(gw, expect_user="jwt-long", extra_headers={"Authorization": f"Bearer {long_jwt}"})
            await c.close()
            c = await Client.connect(f"{gw.url}?access_token={long_jwt}", expect_user="jwt-long")
            await c.close()
        with step("a signature with non-zero unused bits (non-canonical base64url): unauthorized"):
            await harness.expect_unauthorized(gw.url, "non-canonical signature",
                                              extra_headers={"Authorization": f"Bearer {flip_unused_bits(good)}"})
            await harness.expect_unauthorized(f"{gw.url}?access_token={flip_unused_bits(good)}",
                                              "non-canonical signature (query)")
    async with harness.Gateway(["--auth", "jwt"], {"jwt": {"allow_no_exp": True}}, env=env,
                               name="gateway-jwt-no-exp") as gw:
        with step("jwt.allow_no_exp true: a token without exp is accepted"):
            c = await Client.connect(gw, expect_user="jwt-forever",
                                     extra_headers={"Authorization": f"Bearer {no_exp}"})
            await c.close()


def raw_plain(port, method, path):
    return (f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\ncontent-length: 0\r\n\r\n").encode()


async def expect_426(gw, method, path, says):
    answer = await asyncio.to_thread(raw_request, gw.port, raw_plain(gw.port, method, path))
    head, _, body = answer.partition(b"\r\n\r\n")
    check(head.startswith(b"HTTP/1.1 426 ") and b"\r\nupgrade: websocket" in head.lower() and says in body,
          f"{method} {path} without an upgrade should get 426 with 'upgrade: websocket' and a body saying "
          f"{says!r}: {answer[:300]!r}")


async def test_plain_http_on_ws_paths():
    config = harness.make_config({"demo": harness.demo_upstream(0)}, "demo")
    async with harness.Gateway([], config, name="gateway-426") as gw:
        with step("GET and POST on /ws without an upgrade: 426 Upgrade Required, upgrade: websocket, a body "
                  "that says what /ws takes (not the pages' 404); the pages and /ws's WebSocket as before"):
            await expect_426(gw, "GET", "/ws", b"WebSocket")
            await expect_426(gw, "POST", "/ws", b"WebSocket")
            for path, want in (("/", 200), ("/healthz", 200), ("/wsx", 404), ("/ws/x", 404)):
                status, body = await asyncio.to_thread(http_get, gw.port, path, {})
                check(status == want, f"GET {path}: {want} expected, got {status} {body[:120]!r}")
            client = await Client.connect(gw)
            await client.send_raw(json.dumps({"type": "message", "id": "p1", "text": "hello"}))
            (await client.collect_turn("p1")).expect_done()
            await client.close()
    config = dict(config, dropin={"path": "/socket.io/", "app": "ws://127.0.0.1:9/socket.io/",
                                  "client": {"chat": {"pointer": "/0", "equals": "chat message"}, "text": "/1"},
                                  "app_frames": {"text": "/1"}})
    async with harness.Gateway([], config, name="gateway-426-dropin") as gw:
        with step("under the drop-in path without an upgrade (Socket.IO's long-polling sent to chatgate): 426, "
                  "a body that says to send those requests to the app"):
            await expect_426(gw, "GET", "/socket.io/?EIO=4&transport=polling", b"to the app")
            await expect_426(gw, "POST", "/socket.io/", b"to the app")
            status, body = await asyncio.to_thread(http_get, gw.port, "/healthz", {})
            check(status == 200, f"GET /healthz with drop-in on: {status} {body[:120]!r}")
            gw.assert_alive()


async def test_request_bodies():
    """A request with a body on any path gets 413 and the gateway stays responsive: lws 4.1
    spun at 100% CPU on a body whose request was not answered inside BODY_COMPLETION (a PUT
    to a page, a POST to /metrics, an admin POST answered later), unauthenticated ones too."""
    admin_port = harness.free_port()
    env = {"CHATGATE_ADMIN_TOKEN": "admin-secret"}
    args = ["--admin-listen", f"127.0.0.1:{admin_port}"]
    async with harness.Gateway(args, None, env=env, name="gateway-bodies") as gw:
        await harness.wait_condition(lambda: _accepts(admin_port), 5, "the admin listener to accept")
        with step("POST, PUT and PATCH with a body, on the pages, /metrics, /ws and the admin API: 413"):
            for port in (gw.port, admin_port):
                for method in ("POST", "PUT", "PATCH"):
                    for path, headers in (("/", ""), ("/metrics", ""), ("/admin/reload", "Authorization: Bearer "
                                                                        "admin-secret\r\n"),
                                          ("/admin/users/u/profile/x?value=1", "")):
                        for body in (b"Content-Length: 7\r\n\r\n{\"a\":1}",
                                     b"Transfer-Encoding: chunked\r\n\r\n7\r\n{\"a\":1}\r\n0\r\n\r\n"):
                            req = (f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{headers}").encode() + body
                            answer = await asyncio.to_thread(raw_request, port, req, 3)
                            check(answer.startswith(b"HTTP/1.1 413"),
                                  f"{method} {path} on port {port} with a body: {answer[:120]!r}")
                            t0 = time.monotonic()
                            status, _ = await asyncio.to_thread(http_get, gw.port, "/healthz", {}, 2)
                            check(status == 200 and time.monotonic() - t0 < 1,
                                  f"after {method} {path}: /healthz {status} in {time.monotonic() - t0:.2f} s")
        with step("a POST without a body still reaches the admin API"):
            status = await asyncio.to_thread(raw_post, admin_port, "/admin/reload")
            check(status == 200, f"POST /admin/reload without a body: {status}")


def _accepts(port):
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False


def raw_post(port, path):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3)
    conn.request("POST", path, headers={"Authorization": "Bearer admin-secret", "Content-Length": "0"})
    status = conn.getresponse().status
    conn.close()
    return status


async def main(args):
    await independent(test_header_space())
    await independent(test_request_bodies())
    await independent(test_plain_http_on_ws_paths())
    await independent(test_admin_listener_upgrade())
    await independent(test_jwt_policy())


if __name__ == "__main__":
    harness.run(main, timeout=100)
