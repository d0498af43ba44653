"""End-to-end test of the upstream kinds and their failures (docs/protocol.md, Upstreams).

Covers, each with a gateway whose default upstream is the one under test:
- OpenAI-compatible, ok: the request the fake received (POST {base}/chat/completions, JSON
  body with "stream": true, the configured model, messages ending with the user's text,
  "Authorization: Bearer sk-test" from CHATGATE_UPSTREAM_API_KEY); the reply is relayed
  ("echo: <text>"); without the variable no Authorization header is sent;
- OpenAI failures: 500 -> upstream_error carrying "model overloaded" (also when the message
  is long non-ASCII text, which the gateway must cut on a character boundary if it cuts it),
  401 -> upstream_error carrying "invalid api key", an error event mid-stream -> upstream_error
  carrying its message (after the deltas so far, and no done), the connection reset mid-reply
  -> upstream_unavailable (not a done that passes a partial reply as whole; docs/protocol.md's code
  for a closed upstream), a stream of non-JSON data lines -> upstream_error, no answer ->
  upstream_timeout after first_byte_timeout_ms (500) with the request then closed, a closed
  port -> upstream_unavailable;
- WebSocket app, ok: the app gets the message frame of section 6 (id, user from the hello,
  room, text, route, and the null/empty fields), the reply is relayed; the upstream
  connection is opened on the first message, reused for the next ones of the same client,
  one per client, and closed when the client goes;
- WebSocket app failures: error frame -> upstream_error carrying "backend exploded", a frame
  that is not JSON -> upstream_error (both also with long non-ASCII text; and a short one
  after a long reply, whose error must quote that frame only, nothing left from the
  previous one), the app closing (on the message, or mid-reply after two deltas) ->
  upstream_unavailable, a closed port -> upstream_unavailable;
- WebSocket app deadlines: deltas 100 ms apart for 1.5 s under idle_timeout_ms 300 are no
  timeout (each frame moves the deadline on), a reply quiet for 5 s after its first delta
  ends in upstream_timeout after idle_timeout_ms 600, and the next message is answered.
(test_hardening_upstream.py checks each failure's wording and the error frame's status,
upstream_type and upstream_code.)
After every failure the same client connection stays open: a cancel of an unknown id still
gets not_found, a second message gets the same kind of error (the queue is not stuck), and
the gateway is still running.
"""

import asyncio
import time

import harness
from harness import Client, check, check_ack, independent, step

API_KEY = "sk-test"


def build_config(fake, app):
    closed = harness.free_port()
    upstreams = {
        "llm": harness.openai_upstream(fake, "ok", model="test-model"),
        "err500": harness.openai_upstream(fake, "err500"),
        "err401": harness.openai_upstream(fake, "err401"),
        "err500utf8": harness.openai_upstream(fake, "err500utf8"),
        "garbage": harness.openai_upstream(fake, "garbage"),
        "midfail": harness.openai_upstream(fake, "midfail"),
        "cutoff": harness.openai_upstream(fake, "cutoff"),
        "hang": harness.openai_upstream(fake, "hang", first_byte_timeout_ms=500),
        "refused": {"url": f"http://127.0.0.1:{closed}/v1", "model": "m", "connect_timeout_ms": 2000},
        "app": harness.app_upstream(app, "/app"),
        "app_error": harness.app_upstream(app, "/error"),
        "app_garbage": harness.app_upstream(app, "/garbage"),
        "app_error_utf8": harness.app_upstream(app, "/error_utf8"),
        "app_reply_then_garbage": harness.app_upstream(app, "/reply_then_garbage"),
        "app_garbage_utf8": harness.app_upstream(app, "/garbage_utf8"),
        "app_close": harness.app_upstream(app, "/close"),
        "app_close_mid": harness.app_upstream(app, "/close_mid"),
        "app_slow_idle": harness.app_upstream(app, "/slow", idle_timeout_ms=300),
        "app_quiet": harness.app_upstream(app, "/state", idle_timeout_ms=600, first_byte_timeout_ms=4000),
        "app_refused": {"url": f"ws://127.0.0.1:{closed}/app", "connect_timeout_ms": 2000},
    }
    return harness.make_config(upstreams, "llm")


async def test_openai_ok(fake, config):
    async with harness.Gateway(["--default-upstream", "llm"], config,
                               env={"CHATGATE_UPSTREAM_API_KEY": API_KEY}) as gw:
        client = await Client.connect(gw)
        with step("OpenAI ok: request shape, Authorization from the environment, reply relayed"):
            n = len(fake.requests)
            text = "tell me something nice"
            turn = await client.message(text, mid="q1", room="trip")
            turn.expect_done()
            check_ack(turn.ack, "q1", "trip", "llm")
            check(turn.terminal["text"] == "echo: " + text, f"reply not relayed: {turn.describe()}")
            req = await fake.next_request("ok", after=n)
            print(f"   upstream request: {req.describe()}")
            check(req.method == "POST" and req.path == "/ok/v1/chat/completions",
                  f"expected POST /ok/v1/chat/completions, got {req.method} {req.path}")
            check(req.headers.get("authorization") == f"Bearer {API_KEY}",
                  f"Authorization should be 'Bearer {API_KEY}', got {req.headers.get('authorization')!r}")
            check(req.headers.get("content-type", "").startswith("application/json"),
                  f"Content-Type should be application/json, got {req.headers.get('content-type')!r}")
            body = req.json
            check(isinstance(body, dict), f"request body is not a JSON object: {req.raw_body[:200]!r}")
            check(body.get("stream") is True, f"request body lacks \"stream\": true: {harness.brief(body)}")
            check(body.get("model") == "test-model", f"model should be test-model: {harness.brief(body)}")
            msgs = body.get("messages")
            check(isinstance(msgs, list) and msgs, f"no messages: {harness.brief(body)}")
            check(msgs[-1].get("role") == "user" and msgs[-1].get("content") == text,
                  f"last message should be the user's text: {harness.brief(msgs[-1])}")
            check(all(isinstance(m, dict) and m.get("role") in ("system", "user", "assistant")
                      and isinstance(m.get("content"), str) for m in msgs),
                  f"malformed messages: {harness.brief(msgs)}")

        with step("OpenAI ok: a second message on the same connection"):
            n = len(fake.requests)
            turn = await client.message("and one more thing", mid="q2", room="trip")
            turn.expect_done()
            check(turn.terminal["text"] == "echo: and one more thing", turn.describe())
            req = await fake.next_request("ok", after=n)
            check(req.messages[-1].get("content") == "and one more thing", req.describe())
        await client.close()


async def failing_case(fake, app, config, upstream, codes, contains=None, label=None,
                       check_request=None):
    """One gateway whose default upstream fails: the error, then the connection is fine."""
    label = label or upstream
    async with harness.Gateway(["--default-upstream", upstream], config) as gw:
        client = await Client.connect(gw)
        with step(f"{label} -> {'/'.join(codes)}"):
            started = time.monotonic()
            turn = await client.message("hello failing upstream", mid="f1")
            err = turn.expect_error(*codes)
            elapsed = time.monotonic() - started
            print(f"   after {elapsed:.2f}s: {harness.brief(err)}")
            if turn.ack is not None:
                check(turn.ack.get("route") == upstream, f"ack.route should be {upstream}: {turn.describe()}")
            if contains:
                check(contains in err.get("message", ""),
                      f"the error message should carry the upstream's {contains!r}: {harness.brief(err)}")
            if check_request:
                await check_request(elapsed)
        with step(f"{label}: the connection stays up and the next message is processed"):
            await client.check_alive()
            turn = await client.message("second try", mid="f2")
            turn.expect_error(*codes)
            await client.check_alive()
            gw.assert_alive()
        await client.close()


async def test_openai_failures(fake, app, config):
    async def no_auth(_elapsed):
        req = fake.requests_for("err500")[-1]
        check("authorization" not in req.headers,
              f"Authorization sent without CHATGATE_UPSTREAM_API_KEY: {req.headers.get('authorization')!r}")

    await independent(failing_case(fake, app, config, "err500", ["upstream_error"], "model overloaded",
                                   "OpenAI 500", no_auth))
    await independent(failing_case(fake, app, config, "err401", ["upstream_error"], "invalid api key",
                                   "OpenAI 401"))
    await independent(failing_case(fake, app, config, "err500utf8", ["upstream_error"], "model overloaded",
                                   "OpenAI 500 with a long non-ASCII message"))
    await independent(failing_case(fake, app, config, "garbage", ["upstream_error"], None,
                                   "OpenAI non-JSON stream"))
    await independent(failing_case(fake, app, config, "midfail", ["upstream_error"], "context length exceeded",
                                   "OpenAI error event mid-reply"))
    await independent(failing_case(fake, app, config, "cutoff", ["upstream_unavailable"],
                                   None, "OpenAI connection lost mid-reply (no [DONE])"))

    async def timed_out(elapsed):
        check(0.3 <= elapsed <= 5.0, f"upstream_timeout after {elapsed:.2f}s, first_byte_timeout_ms is 500")
        req = fake.requests_for("hang")[-1]
        check(await req.wait_closed(1.0), "the gateway did not close the timed-out request within 1 s")

    await independent(failing_case(fake, app, config, "hang", ["upstream_timeout"], None,
                                   "OpenAI no answer", timed_out))
    await independent(failing_case(fake, app, config, "refused", ["upstream_unavailable"], None,
                                   "OpenAI closed port"))


async def test_app_ok(app, config):
    async with harness.Gateway(["--default-upstream", "app"], config) as gw:
        with step("WS app: no upstream connection before the first message"):
            before = app.opened
            client = await Client.connect(gw)
            await asyncio.sleep(0.3)
            check(app.opened == before, "the gateway opened an upstream connection before any message")

        with step("WS app ok: the app gets the message frame of docs/protocol.md, Upstreams; reply relayed"):
            text = "hello app backend"
            turn = await client.message(text, mid="a1", room="trip")
            turn.expect_done()
            check_ack(turn.ack, "a1", "trip", "app")
            check(turn.terminal["text"] == "app got: " + text, f"reply not relayed: {turn.describe()}")
            check(app.opened == before + 1, f"expected one upstream connection, the app saw {app.opened - before}")
            conn = app.connections[-1]
            check(conn.path == "/app", f"upstream connection went to {conn.path}")
            check(len(conn.messages) == 1, f"app got {len(conn.messages)} messages: {conn.frames}")
            frame = conn.messages[0]
            print(f"   app got: {harness.brief(frame)}")
            expected = {"type": "message", "id": "a1", "user": client.hello["user"], "room": "trip",
                        "text": text, "enriched": None, "route": "app", "service": None, "params": {},
                        "awaiting": None, "resolution": None, "soft_context": None, "history": [],
                        "rules": [], "annotations": {}}
            for key, value in expected.items():
                check(key in frame and frame[key] == value,
                      f"upstream frame .{key} should be {value!r}, got {frame.get(key, '<missing>')!r}")

        with step("WS app: the next message reuses the client's upstream connection"):
            turn = await client.message("second message", mid="a2", room="trip")
            turn.expect_done()
            check(app.opened == before + 1, "a second upstream connection was opened for the same client")
            check([m.get("id") for m in conn.messages] == ["a1", "a2"],
                  f"app got {[m.get('id') for m in conn.messages]}")

        with step("WS app: one upstream connection per client, closed with the client"):
            other = await Client.connect(gw)
            (await other.message("from another client", mid="b1")).expect_done()
            check(app.opened == before + 2, f"expected a second upstream connection, got {app.opened - before}")
            other_conn = app.connections[-1]
            check(other_conn.messages[0]["user"] == other.hello["user"], "wrong user on the second connection")
            await other.close()
            check(await other_conn.wait_closed(1.0), "the upstream connection outlived its client by 1 s")
            check(conn.closed_at is None, "closing one client closed another client's upstream connection")
            await client.close()
            check(await conn.wait_closed(1.0), "the upstream connection outlived its client by 1 s")


async def test_app_failures(fake, app, config):
    cases = [
        ("app_error", ["upstream_error"], "backend exploded", "WS app error frame"),
        ("app_garbage", ["upstream_error"], None, "WS app non-JSON frame"),
        ("app_error_utf8", ["upstream_error"], "backend exploded", "WS app error with a long non-ASCII message"),
        ("app_garbage_utf8", ["upstream_error"], None, "WS app long non-ASCII non-JSON frame"),
        ("app_close", ["upstream_unavailable"], None, "WS app closes the connection"),
        ("app_close_mid", ["upstream_unavailable"], None, "WS app closes mid-reply"),
        ("app_refused", ["upstream_unavailable"], None, "WS app closed port"),
    ]
    for upstream, codes, contains, label in cases:
        await independent(failing_case(fake, app, config, upstream, codes, contains, label))
    await independent(test_app_garbage_after_reply(config))


async def test_app_deadlines(app, config):
    """The WS app's idle deadline moves with every frame (the timer is not moved with it:
    ws.c arm) and still ends a reply that goes quiet."""
    async with harness.Gateway(["--default-upstream", "app_slow_idle"], config) as gw:
        client = await Client.connect(gw)
        with step("WS app: deltas 100 ms apart for 1.5 s, idle_timeout_ms 300: no timeout; then cancelled"):
            await client.send_message("stream for a while", "s1")
            await client.recv_type("ack", "s1")
            start = time.monotonic()
            deltas = 0
            while time.monotonic() - start < 1.5:
                frame = await client.recv(timeout=2)
                check(frame.get("type") == "delta",
                      f"expected deltas while the app streams, got {harness.brief(frame)} after "
                      f"{time.monotonic() - start:.2f} s")
                deltas += 1
            await client.send({"type": "cancel", "id": "s1"})
            turn = await client.collect_turn("s1", timeout=5)
            check(turn.kind == "cancelled", f"expected cancelled, got {harness.brief(turn.terminal)}")
            check(deltas >= 10, f"only {deltas} deltas in 1.5 s")
            await client.check_alive()
        await client.close()
    async with harness.Gateway(["--default-upstream", "app_quiet"], config) as gw:
        client = await Client.connect(gw)
        with step("WS app: quiet for 5 s after its first delta, idle_timeout_ms 600 (first byte 4000): upstream_timeout"):
            await client.send_message("then quiet [delay=5]", "q1")
            await client.recv_type("ack", "q1")
            await client.recv_type("delta", "q1")
            start = time.monotonic()
            turn = await client.collect_turn("q1", timeout=8)
            elapsed = time.monotonic() - start
            err = turn.expect_error("upstream_timeout")
            check("went quiet for 600 ms" in err.get("message", ""), f"the error's wording: {harness.brief(err)}")
            check(0.4 <= elapsed <= 1.6, f"upstream_timeout {elapsed:.2f} s after the first delta, idle 600 ms")
            (await client.message("again", mid="q2")).expect_done()
        await client.close()


async def test_app_garbage_after_reply(config):
    async with harness.Gateway(["--default-upstream", "app_reply_then_garbage"], config) as gw:
        client = await Client.connect(gw)
        with step("WS app: a short non-JSON frame after a long reply; the error quotes only that frame"):
            long_text = "a rather long message so that the app's reply frame is long " * 3
            (await client.message(long_text, mid="g1")).expect_done()
            err = (await client.message("now break", mid="g2")).expect_error("upstream_error")
            message = err.get("message", "")
            print(f"   {harness.brief(err)}")
            check("oops{" in message, f"the error should quote the app's frame 'oops{{': {message!r}")
            tail = message.split("oops{", 1)[1]
            check(not any(s in tail for s in ('"type"', "done", "app got", "rather long")),
                  f"the error quotes bytes after the app's 5-byte frame (left over from the previous "
                  f"frame?): {message!r}")
            await client.check_alive()
        await client.close()


async def main(args):
    async with harness.FakeOpenAI() as fake, harness.FakeApp() as app:
        config = build_config(fake, app)
        await independent(test_openai_ok(fake, config))
        await test_openai_failures(fake, app, config)
        await independent(test_app_ok(app, config))
        await test_app_failures(fake, app, config)
        await independent(test_app_deadlines(app, config))


if __name__ == "__main__":
    harness.run(main, timeout=110)
