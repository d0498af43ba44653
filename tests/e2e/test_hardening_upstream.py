"""End-to-end test of issue 9's upstream defects 9 and 14.

Defect 9, a paused upstream must not time out. A client that reads slowly fills its send
queue; the gateway pauses the upstream (stops reading from it) until the client drains.
Each kind is given a short idle timeout (1 s) and a long reply sent as fast as the socket
takes it, and the client stops reading for 3 s:
- OpenAI-compatible (harness.FakeOpenAI's /huge: 12 MB of content in 16 KiB events);
- a WebSocket app (LongApp below: 12 MB in 16 KiB delta frames, then done); the app must
  also get no cancel frame.
After the client reads again the reply must end with done and the deltas must add up to
the whole text. Before the fix the idle timer kept running while paused: upstream_timeout
(and a cancel sent to the app).

Defect 14, upstream errors say what happened. Fake OpenAI servers (ErrorsOpenAI below):
- 401 {"error":{"type":"invalid_request_error","code":"invalid_api_key"}},
  404 {"error":{"code":"model_not_found"}}, 500 {"error":{"type":"server_error","code":null}}
  and a 500 whose body has only a message: upstream_error with "status" (the HTTP status),
  "upstream_type" and "upstream_code" (only those the body gave) and the server's message;
- a stream cut (TCP reset) after three deltas: upstream_unavailable, "mid-reply";
- a stream cut after the 200 and a role-only chunk, before any text: upstream_unavailable,
  "before any reply text", never "mid-reply";
- a connection closed after the request, before any byte of answer: upstream_unavailable,
  no status;
- an error event after deltas: upstream_error, "mid-reply", its type; an error event before
  any text: upstream_error, not "mid-reply";
- data lines that are not JSON: upstream_error, status 200;
- a closed port: upstream_unavailable, "could not be reached", no status;
- a WebSocket app's error frame with a "code": upstream_error with that upstream_code; the
  app closing before any delta / after two: upstream_unavailable, "mid-reply" only after.
- an upstream whose TLS certificate is not trusted (self-signed), over https (libcurl) and
  wss (libwebsockets): upstream_unavailable, and the message says the certificate was
  refused and why ("self-signed certificate"); libwebsockets' own text said
  "connect SSL err 1: error:00000001:lib(0)::reason(1)".
After each error the client connection stays up.
"""

import asyncio
import json
import ssl
import subprocess
import tempfile

import websockets

import harness
from harness import Client, check, independent, step
from test_slow_client import small_socket

EVENT = 16 * 1024
LONG_TOTAL = 12 * 1024 * 1024
PAUSE = 3.0
IDLE_MS = 1000
PATTERN = "abcdefghijklmnopqrstuvwxyz0123456789"
PIECE = (PATTERN * (EVENT // len(PATTERN) + 1))[:EVENT]


class ErrorsOpenAI(harness.FakeOpenAI):
    """harness.FakeOpenAI with the behaviours this test needs (see the module docstring)."""

    async def _do_key401(self, conn, req):
        return await self._json_response(conn, req, 401, "Unauthorized", {"error": {
            "message": "Incorrect API key provided: sk-te****. You can find your API key at ...",
            "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}})

    async def _do_model404(self, conn, req):
        return await self._json_response(conn, req, 404, "Not Found", {"error": {
            "message": "The model `no-such-model` does not exist or you do not have access to it.",
            "type": "invalid_request_error", "param": None, "code": "model_not_found"}})

    async def _do_fault500(self, conn, req):
        return await self._json_response(conn, req, 500, "Internal Server Error", {"error": {
            "message": "The server had an error while processing your request.",
            "type": "server_error", "param": None, "code": None}})

    async def _do_cutmid(self, conn, req):
        if not await self._sse_head(conn, req):
            return False
        for w in ("partial ", "reply ", "then "):
            if not await self._write(conn, req, harness.chunk(harness.sse_event(
                    harness.completion_chunk({"content": w})))):
                return False
        await asyncio.sleep(0.05)
        conn.writer.transport.abort()  # reset: no [DONE], no last chunk
        return False

    async def _do_cutfirst(self, conn, req):
        if not await self._sse_head(conn, req):
            return False
        role = harness.completion_chunk({"role": "assistant", "content": ""})
        if not await self._write(conn, req, harness.chunk(harness.sse_event(role))):
            return False
        await asyncio.sleep(0.05)
        conn.writer.transport.abort()
        return False

    async def _do_cutnohead(self, conn, req):
        await asyncio.sleep(0.05)
        conn.writer.transport.abort()  # the request was read; not a byte of answer
        return False

    async def _do_errfirst(self, conn, req):
        if not await self._sse_head(conn, req):
            return False
        error = {"error": {"message": "prompt rejected by the content filter",
                           "type": "invalid_request_error", "code": "content_filter"}}
        await self._write(conn, req, harness.chunk(harness.sse_event(error)) + b"0\r\n\r\n")
        return False


class LongApp(harness.WsServer):
    """A WebSocket app answering every message with LONG_TOTAL bytes in EVENT-byte deltas,
    as fast as the connection takes them (websockets' send waits for the socket to drain),
    then done. Cancel frames it gets are kept in `cancels`."""

    serve_options = {"max_size": 2**22, "write_limit": 64 * 1024}

    def __init__(self):
        super().__init__()
        self.cancels = []
        self.sent = 0

    def url(self, path="/long"):
        return super().url(path)

    async def _handler(self, ws):
        tasks = []
        try:
            async for raw in ws:
                frame = json.loads(raw)
                if frame.get("type") == "cancel":
                    self.cancels.append(frame.get("id"))
                elif frame.get("type") == "message":
                    tasks.append(asyncio.create_task(self._reply(ws, frame["id"])))
        except websockets.ConnectionClosed:
            pass
        finally:
            for t in tasks:
                t.cancel()

    async def _reply(self, ws, mid):
        try:
            for _ in range(LONG_TOTAL // EVENT):
                await ws.send(json.dumps({"type": "delta", "id": mid, "text": PIECE}))
                self.sent += EVENT
            await ws.send(json.dumps({"type": "done", "id": mid}))
        except websockets.ConnectionClosed:
            pass


async def slow_reader_gets_whole_reply(label, upstream_cfg, app=None):
    config = harness.make_config({"up": upstream_cfg}, "up", send_buffer=16 * 1024)
    async with harness.Gateway([], config) as gw:
        sock = await small_socket(gw.port)
        client = await Client.connect(gw, sock=sock, max_queue=1, read_limit=2**16, max_size=2**26)
        with step(f"{label}: the client stops reading for {PAUSE:.0f}s, idle_timeout_ms is {IDLE_MS}"):
            await client.send_message("a long one please", "L1")
            await client.recv_type("ack", "L1")
            await client.recv_type("delta", "L1")
            await asyncio.sleep(PAUSE)
        with step(f"{label}: after reading again the reply ends with done, whole"):
            turn = await client.collect_turn("L1", timeout=60)
            check(turn.kind == "done",
                  f"expected done once the client read again, got {harness.brief(turn.terminal)} "
                  f"(the paused upstream's idle timer kept running?)")
            text = "".join(f["text"] for f in client.received
                           if f.get("type") == "delta" and f.get("id") == "L1")
            check(len(text) == LONG_TOTAL and text == PIECE * (LONG_TOTAL // EVENT),
                  f"the deltas carry {len(text)} characters, the upstream sent {LONG_TOTAL}, "
                  f"or their content was altered")
            print(f"   done after the pause; {len(text)} characters of deltas")
            if app is not None:
                check(not app.cancels, f"the app was sent a cancel for {app.cancels}")
        await client.check_alive()
        await client.close()


async def test_pause(fake):
    await independent(slow_reader_gets_whole_reply(
        "OpenAI", harness.openai_upstream(fake, "huge", idle_timeout_ms=IDLE_MS, first_byte_timeout_ms=IDLE_MS)))
    async with LongApp() as app:
        cfg = {"url": app.url(), "connect_timeout_ms": 2000, "first_byte_timeout_ms": IDLE_MS,
               "idle_timeout_ms": IDLE_MS}
        await independent(slow_reader_gets_whole_reply("WS app", cfg, app))


# upstream -> (code, HTTP status or None, upstream_type, upstream_code, must contain, must not contain,
#              the reply text relayed before the error)
CASES = {
    "key401": ("upstream_error", 401, "invalid_request_error", "invalid_api_key",
               ["HTTP 401", "Incorrect API key"], [], ""),
    "model404": ("upstream_error", 404, "invalid_request_error", "model_not_found",
                 ["HTTP 404", "does not exist"], [], ""),
    "fault500": ("upstream_error", 500, "server_error", None, ["HTTP 500", "server had an error"], [], ""),
    "err500": ("upstream_error", 500, None, None, ["HTTP 500", "model overloaded"], [], ""),
    "cutmid": ("upstream_unavailable", 200, None, None, ["mid-reply"], ["before any"], "partial reply then "),
    "cutfirst": ("upstream_unavailable", 200, None, None, ["before any reply text"], ["mid-reply"], ""),
    "cutnohead": ("upstream_unavailable", None, None, None, ["sent no HTTP answer"], ["mid-reply"], ""),
    "midfail": ("upstream_error", 200, "invalid_request_error", None, ["mid-reply", "context length exceeded"],
                [], "partial reply then "),
    "errfirst": ("upstream_error", 200, "invalid_request_error", "content_filter",
                 ["before any reply text", "content filter"], ["mid-reply"], ""),
    "garbage": ("upstream_error", 200, None, None, ["not a JSON object"], ["mid-reply"], ""),
    "refused": ("upstream_unavailable", None, None, None, ["could not be reached"], ["mid-reply"], ""),
}


# The same for a WebSocket app (CodedApp): the app's error "code" becomes upstream_code; its
# closing says "mid-reply" only when reply text had come.
APP_CASES = {
    "/coded": ("upstream_error", None, None, "quota_exceeded", ["monthly quota exceeded"], ["mid-reply"], ""),
    "/close": ("upstream_unavailable", None, None, None, ["before any reply text"], ["mid-reply"], ""),
    "/close_mid": ("upstream_unavailable", None, None, None, ["mid-reply"], ["before any"], "partial reply "),
}


class CodedApp(harness.FakeApp):
    """harness.FakeApp, and /coded: an error frame with a code of the app's own."""

    async def _reply(self, ws, conn, frame):
        if ws.path != "/coded":
            return await super()._reply(ws, conn, frame)
        await ws.send(json.dumps({"type": "error", "id": frame.get("id"), "code": "quota_exceeded",
                                  "message": "monthly quota exceeded"}))


async def error_case(fake, app, name):
    code, status, utype, ucode, contains, excludes, relayed = CASES.get(name) or APP_CASES[name]
    if name == "refused":
        upstream = {"url": f"http://127.0.0.1:{harness.free_port()}/v1", "model": "m", "connect_timeout_ms": 2000}
    elif name in APP_CASES:
        upstream = harness.app_upstream(app, name)
        name = "app" + name.replace("/", "_")
    else:
        upstream = harness.openai_upstream(fake, name)
    async with harness.Gateway([], harness.make_config({name: upstream}, name)) as gw:
        client = await Client.connect(gw)
        with step(f"{name} -> {code}, status {status}, upstream_type {utype}, upstream_code {ucode}"):
            turn = await client.message("hello", mid="e1")
            err = turn.expect_error(code)
            print(f"   {harness.brief(err, 400)}")
            message = err.get("message", "")
            for key, want in (("status", status), ("upstream_type", utype), ("upstream_code", ucode)):
                if want is None:
                    check(key not in err, f"{key} should be absent (nothing to say): {harness.brief(err)}")
                else:
                    check(err.get(key) == want, f"{key} should be {want!r}: {harness.brief(err)}")
            for part in contains:
                check(part in message, f"the message should say {part!r}: {message!r}")
            for part in excludes:
                check(part not in message, f"the message should not say {part!r}: {message!r}")
            text = "".join(d.get("text", "") for d in turn.deltas)
            check(text == relayed, f"the deltas before the error should be {relayed!r}, got {text!r}")
        with step(f"{name}: the connection stays up"):
            await client.check_alive()
        await client.close()


async def tls_refused():
    """A TLS server with a self-signed certificate (made by Debian's openssl): the handshake
    is all it needs, since the gateway gives up at the certificate."""
    where = tempfile.mkdtemp(prefix="chatgate-e2e-tls-")
    cert, key = f"{where}/cert.pem", f"{where}/key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert,
                    "-days", "2", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)

    async def hold(reader, writer):
        try:
            await reader.read()
        except (ConnectionError, ssl.SSLError):
            pass
        writer.close()

    server = await asyncio.start_server(hold, "127.0.0.1", 0, ssl=ctx)
    port = server.sockets[0].getsockname()[1]
    cases = (("https", {"url": f"https://127.0.0.1:{port}/v1", "model": "m"}, "SSL certificate problem"),
             ("wss", {"url": f"wss://127.0.0.1:{port}/app"}, "its TLS certificate was refused"))
    try:
        for kind, upstream, says in cases:
            async with harness.Gateway([], harness.make_config({"tls": upstream}, "tls"), name=f"gw-{kind}") as gw:
                client = await Client.connect(gw)
                with step(f"{kind} upstream with a self-signed certificate: upstream_unavailable saying so"):
                    err = (await client.message("hello", mid="t1")).expect_error("upstream_unavailable")
                    message = err.get("message", "")
                    check(says in message and "self-signed certificate" in message,
                          f"the message should say {says!r} and why (self-signed certificate): {message!r}")
                with step(f"{kind}: the connection stays up"):
                    await client.check_alive()
                await client.close()
    finally:
        server.close()
        await server.wait_closed()


async def main(args):
    await independent(tls_refused())
    async with ErrorsOpenAI() as fake, CodedApp() as app:
        for name in list(CASES) + list(APP_CASES):
            await independent(error_case(fake, app, name))
        fake.huge_total, fake.huge_event = LONG_TOTAL, EVENT  # /huge: PIECE after PIECE
        await test_pause(fake)


if __name__ == "__main__":
    harness.run(main, timeout=170)
