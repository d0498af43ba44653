"""End-to-end test of the chatgate.v1 client protocol (docs/protocol.md).

Covers:
- HTTP: GET / serves web/index.html (200, text/html), GET /nope is 404;
- hello: first frame, protocol "chatgate.v1", user u_..., session s_..., resume present,
  distinct per connection; the "chatgate.v1" subprotocol is accepted when asked for;
- message -> ack (exact shape: route, service null, params {}, ...), deltas, done whose text
  is the concatenation of the deltas, with the demo upstream (delay 0) and with the fake
  OpenAI upstream (/ok: the reply is "echo: <text>", usage passed through);
- an id is assigned when the message has none (the ack carries it, every frame uses it);
  room defaults to "default";
- cancel of an unknown id -> error not_found;
- bad input answered with error bad_frame and the connection keeps working (a normal message
  after each): not JSON, empty frame, JSON that is not an object, deeply nested JSON, unknown
  or missing type, missing or wrong-typed text/id/room, cancel without id, binary frames,
  invalid UTF-8 (the gateway may instead close with 1007, which RFC 6455 allows; that is
  reported, not failed);
- a frame over --max-frame (1024) -> too_large, and the connection keeps working; a frame just
  under the limit is served.
"""

import asyncio
import itertools
import json

import websockets

import harness
from harness import Client, check, check_ack, independent, step

MAX_FRAME = 1024

# (label, frame to send, ids the error may carry). A str is sent as a text frame, bytes as a
# binary frame.
BAD_FRAMES = [
    ("not JSON", "hello {", [None]),
    ("empty text frame", "", [None]),
    ("truncated JSON object", '{"type":"message","text":"hi"', [None]),
    ("JSON array", "[1,2,3]", [None]),
    ("JSON string", '"message"', [None]),
    ("JSON number", "42", [None]),
    ("JSON null", "null", [None]),
    ("deeply nested JSON", "[" * 500 + "]" * 500, [None]),
    ("unknown type", json.dumps({"type": "bogus", "id": "bad-1"}), [None, "bad-1"]),
    ("missing type", json.dumps({"id": "bad-2", "text": "hi"}), [None, "bad-2"]),
    ("type not a string", json.dumps({"type": 5, "id": "bad-3", "text": "hi"}), [None, "bad-3"]),
    ("message without text", json.dumps({"type": "message", "id": "bad-4"}), [None, "bad-4"]),
    ("text not a string", json.dumps({"type": "message", "id": "bad-5", "text": 5}), [None, "bad-5"]),
    ("text is null", json.dumps({"type": "message", "id": "bad-6", "text": None}), [None, "bad-6"]),
    ("id not a string", json.dumps({"type": "message", "id": 7, "text": "hi"}), [None, 7]),
    ("id is an object", json.dumps({"type": "message", "id": {"a": 1}, "text": "hi"}), [None]),
    ("room not a string", json.dumps({"type": "message", "id": "bad-7", "room": ["x"], "text": "hi"}),
     [None, "bad-7"]),
    ("cancel without id", json.dumps({"type": "cancel"}), [None]),
    ("cancel with a numeric id", json.dumps({"type": "cancel", "id": 3}), [None, 3]),
    ("binary frame (junk)", b"\x00\x01\x02\xff", [None]),
    ("binary frame holding a valid message", json.dumps({"type": "message", "id": "bad-8", "text": "hi"}).encode(),
     [None, "bad-8"]),
]


_ok_ids = itertools.count(1)


async def expect_works(client, label):
    """A normal message on `client` still gets ack, deltas and done."""
    n = next(_ok_ids)
    turn = await client.message(f"hello again number {n}", mid=f"ok-{n}")
    if turn.kind != "done":
        harness.fail(f"after {label}: a normal message did not work: {turn.describe()}")
    turn.expect_done()


async def test_http(gw):
    with step("GET / serves the demo page, GET /nope is 404"):
        status, headers, body = await asyncio.to_thread(harness.http_get, gw.http_url + "/")
        check(status == 200, f"GET / returned {status}")
        ctype = {k.lower(): v for k, v in headers.items()}.get("content-type", "")
        check(ctype.startswith("text/html"), f"GET / content-type is {ctype!r}")
        index = (harness.REPO_ROOT / "web" / "index.html")
        if index.exists():
            check(body == index.read_bytes(), "GET / does not serve web/index.html byte for byte")
        status, _, _ = await asyncio.to_thread(harness.http_get, gw.http_url + "/nope")
        check(status == 404, f"GET /nope returned {status}")


async def test_hello(gw):
    with step("hello on connect; distinct user and session per connection; subprotocol"):
        a = await Client.connect(gw)
        b = await Client.connect(gw, subprotocols=[harness.PROTOCOL])
        check(b.ws.subprotocol == harness.PROTOCOL,
              f"asked for subprotocol {harness.PROTOCOL}, got {b.ws.subprotocol!r}")
        check(a.hello["user"] != b.hello["user"], f"two connections share a user: {a.hello} {b.hello}")
        check(a.hello["session"] != b.hello["session"], f"two connections share a session: {a.hello} {b.hello}")
        print(f"   hello: {harness.brief(a.hello)}")
        await a.close()
        await b.close()


async def test_demo_turns(gw):
    client = await Client.connect(gw)
    with step("demo: message -> ack, deltas, done (text = concatenation of deltas)"):
        turn = await client.message("hello there gateway", mid="m1", room="trip")
        turn.expect_done()
        check_ack(turn.ack, "m1", "trip", "demo")
        check(len(turn.deltas) >= 1, f"the demo reply had no delta: {turn.describe()}")
        check(turn.terminal["text"], f"the demo reply is empty: {turn.describe()}")
        print(f"   demo reply: {harness.brief(turn.terminal['text'], 120)}")

    with step("id assigned when absent; room defaults to 'default'"):
        turn = await client.message("hello without an id")
        turn.expect_done()
        mid = turn.ack["id"]
        check_ack(turn.ack, mid, "default", "demo")
        check(all(f.get("id") == mid for f in turn.frames), f"frames disagree on the id: {turn.describe()}")
        turn2 = await client.message("and another one")
        check(turn2.ack["id"] != mid, f"two messages without id got the same id {mid!r}")

    with step("cancel of an unknown id -> not_found; of a finished id -> not_found"):
        await client.cancel("no-such-id")
        err = await client.expect_error("not_found", mid="no-such-id")
        print(f"   {harness.brief(err)}")
        await client.cancel("m1")
        await client.expect_error("not_found", mid="m1")
        await expect_works(client, "not_found")
    await client.close()


async def test_openai_turn(gw, fake):
    client = await Client.connect(gw)
    with step("fake OpenAI /ok: ack route llm, reply 'echo: <text>', usage passed through"):
        text = "please repeat these words"
        turn = await client.message(text, mid="o1", room="r1")
        turn.expect_done()
        check_ack(turn.ack, "o1", "r1", "llm")
        req = fake.requests_for("ok")[-1]
        check(req.last_user_text == text, f"upstream got a different last user message: {req.describe()}")
        check(turn.terminal["text"] == "echo: " + text,
              f"done.text should be {'echo: ' + text!r}, got {turn.terminal['text']!r}")
        usage = turn.terminal.get("usage")
        check(isinstance(usage, dict) and usage.get("prompt_tokens") == req.usage["prompt_tokens"]
              and usage.get("completion_tokens") == req.usage["completion_tokens"],
              f"done.usage should carry the upstream's {req.usage}, got {usage}")
    await client.close()


async def test_bad_frames(gw):
    client = await Client.connect(gw)
    for label, frame, ids in BAD_FRAMES:
        with step(f"bad input: {label} -> bad_frame, then a normal message works"):
            await client.send_raw(frame)
            err = await client.expect_error("bad_frame")
            check(err.get("id") in ids, f"error id should be one of {ids}, got {harness.brief(err)}")
            await expect_works(client, label)

    with step("bad input: invalid UTF-8 in a text frame -> bad_frame (or close 1007)"):
        await client.ws.write_frame(True, 0x1, b"\xff\xfe")
        try:
            raw = await asyncio.wait_for(client.ws.recv(), harness.DEFAULT_TIMEOUT)
        except websockets.ConnectionClosed as closed:
            check(closed.code == 1007, f"closed with {closed.code} {closed.reason!r}, expected an error "
                                       f"frame or close 1007")
            print("   note: the gateway closed the connection with 1007 (allowed by RFC 6455)")
            client = await Client.connect(gw)
        else:
            err = json.loads(raw)
            check(err.get("type") == "error" and err.get("code") == "bad_frame" and err.get("id") is None,
                  f"expected error bad_frame with id null, got {harness.brief(err)}")
        await expect_works(client, "invalid UTF-8")

    with step(f"frame over --max-frame {MAX_FRAME} -> too_large, connection keeps working"):
        big = json.dumps({"type": "message", "id": "big-1", "text": "x" * (2 * MAX_FRAME)})
        await client.send_raw(big)
        err = await client.expect_error("too_large")
        check(err.get("id") in (None, "big-1"), f"too_large error id: {harness.brief(err)}")
        await client.send_raw(json.dumps({"type": "message", "id": "big-2", "text": "y" * (20 * MAX_FRAME)}))
        await client.expect_error("too_large")
        await expect_works(client, "too_large")
        await client.check_alive()

    with step("a frame just under --max-frame is served"):
        text = "z " * ((MAX_FRAME - 100) // 2)
        frame = json.dumps({"type": "message", "id": "near-limit", "text": text})
        check(len(frame) < MAX_FRAME, "test bug: frame too big")
        await client.send_raw(frame)
        (await client.collect_turn("near-limit")).expect_done()
    await client.close()


async def main(args):
    async with harness.FakeOpenAI() as fake:
        config = harness.make_config(
            {"demo": harness.demo_upstream(0), "llm": harness.openai_upstream(fake, "ok")}, "demo")
        async with harness.Gateway(["--max-frame", MAX_FRAME], config) as gw:
            await independent(test_http(gw))
            await independent(test_hello(gw))
            await independent(test_demo_turns(gw))
            await independent(test_bad_frames(gw))
            gw.assert_alive()
        async with harness.Gateway(["--default-upstream", "llm"], config) as gw:
            await independent(test_openai_turn(gw, fake))


if __name__ == "__main__":
    harness.run(main, timeout=100)
