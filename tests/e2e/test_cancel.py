"""End-to-end test of cancel, client disconnect, ordering and the per-connection queue.

Covers (docs/architecture.md, Data path; docs/protocol.md, Ordering):
- cancel of a reply streaming from the OpenAI upstream (/slow, a word every 100 ms): the
  client gets cancelled and no more delta for that id for 0.5 s, and the gateway closed the
  upstream request within 1 s of the cancel;
- the same with the WebSocket app (/slow): the app receives {"type":"cancel","id"};
- the client disconnecting mid-reply (clean close and abrupt TCP close): the upstream request
  is closed within 1 s (OpenAI) and the app's upstream connection within 1 s (WebSocket);
- order: m2 sent right after m1 is acked only after m1's terminal frame;
- cancel of a queued message: cancelled, never acked, never forwarded upstream, while the
  reply in flight goes on;
- queue bound: with one reply in flight, 8 more messages wait and the next one gets
  rate_limited; the 9 others all finish, in order, each acked only after the previous one
  ended (OpenAI /quick, 6 words 50 ms apart);
- every message gets exactly one terminal frame (FrameTracker on every connection).
"""

import time

import harness
from harness import Client, check, independent, step

QUEUE_LIMIT = 8


async def wait_deltas(client, mid, n):
    for _ in range(n):
        await client.recv_type("delta", mid)


async def cancel_and_expect(client, mid):
    """Cancel `mid`, expect cancelled (after at most a few in-flight deltas), then silence."""
    sent_at = time.monotonic()
    await client.cancel(mid)
    turn = await client.collect_turn(mid)
    check(turn.kind == "cancelled", f"expected cancelled for {mid}: {turn.describe()}")
    # a silence: a leak would be the upstream's next chunk, which comes on its own clock (a marker
    # sent to the gateway cannot come after it)
    await client.expect_silence(0.5, lambda f: f.get("id") == mid, f"frame for {mid} after cancelled")
    return sent_at


async def test_openai_cancel(fake, gw):
    client = await Client.connect(gw)
    tracker = client.track()
    with step("OpenAI /slow: cancel mid-reply -> cancelled, nothing more, upstream request closed < 1 s"):
        n = len(fake.requests)
        await client.send_message("tell me a long story", "m1")
        await client.recv_type("ack", "m1")
        await wait_deltas(client, "m1", 2)
        req = await fake.next_request("slow", after=n)
        sent_at = await cancel_and_expect(client, "m1")
        closed = await req.wait_closed(max(0.0, sent_at + 1.0 - time.monotonic()))
        check(closed, "the gateway did not close the upstream request within 1 s of the cancel")
        delay = req.closed_at - sent_at
        print(f"   upstream request closed {delay * 1000:.0f} ms after the cancel was sent")
        check(delay < 1.0, f"upstream request closed {delay:.2f}s after the cancel (limit 1 s)")
        await client.check_alive()

    with step("order: m2 sent right after m1 is acked only after m1's terminal frame"):
        await client.send_message("first long one", "o1")
        await client.send_message("second one", "o2")
        await client.recv_type("ack", "o1")
        await wait_deltas(client, "o1", 2)
        check(not [f for f in client.received if f.get("id") == "o2"],
              "a frame about o2 arrived while o1 was streaming")
        await client.cancel("o1")
        await client.collect_turn("o1")
        ack2 = await client.recv_type("ack", "o2")
        end1 = tracker.terminal("o1")
        check(client.position(ack2) > client.position(end1), "o2 acked before o1 ended")
        await wait_deltas(client, "o2", 1)
        await cancel_and_expect(client, "o2")

    with step("cancel of a queued message: cancelled, never acked nor forwarded; m1 goes on"):
        n = len(fake.requests)
        await client.send_message("the one in flight", "q1")
        await client.recv_type("ack", "q1")
        await client.send_message("the queued one", "q2")
        await wait_deltas(client, "q1", 1)
        await client.cancel("q2")
        turn = await client.collect_turn("q2")
        check([f["type"] for f in turn.frames] == ["cancelled"], f"queued q2: {turn.describe()}")
        await wait_deltas(client, "q1", 2)  # the reply in flight was not disturbed
        await cancel_and_expect(client, "q1")
        # q2 would have started once q1 ended: cancel_and_expect's 0.5 s after that kept any frame
        # about q2 pending; checked here
        await client.expect_silence(0, lambda f: f.get("id") == "q2", "frame for the cancelled queued q2")
        texts = [r.last_user_text for r in fake.requests[n:]]
        check("the queued one" not in texts, f"the cancelled queued message was forwarded: {texts}")

    tracker.assert_one_terminal_each(["m1", "o1", "o2", "q1", "q2"])
    await client.close()

    for how in ("close", "abort"):
        with step(f"OpenAI /slow: client goes away mid-reply ({how}) -> upstream request closed < 1 s"):
            c = await Client.connect(gw)
            n = len(fake.requests)
            await c.send_message("a story to abandon", "d1")
            await wait_deltas(c, "d1", 2)
            req = await fake.next_request("slow", after=n)
            gone_at = time.monotonic()
            if how == "close":
                await c.close()
            else:
                c.ws.transport.abort()
            closed = await req.wait_closed(1.0)
            check(closed, "the gateway kept the upstream request open 1 s after the client went away")
            print(f"   upstream request closed {(req.closed_at - gone_at) * 1000:.0f} ms after the client left")
    gw.assert_alive()


async def test_app_cancel(app, gw):
    client = await Client.connect(gw)
    tracker = client.track()
    with step("WS app /slow: cancel mid-reply -> cancelled, nothing more, app gets cancel frame"):
        await client.send_message("a long answer please", "w1")
        await client.recv_type("ack", "w1")
        await wait_deltas(client, "w1", 2)
        conn = app.connections[-1]
        sent_at = await cancel_and_expect(client, "w1")
        await harness.wait_until(lambda: conn.cancels, max(0.0, sent_at + 1.0 - time.monotonic()))
        check(conn.cancels, "the app got no cancel frame within 1 s; it got "
                            f"{[harness.brief(f, 80) for f in conn.frames]}")
        cid, at = conn.cancels[0]
        check(cid == "w1", f"the app got a cancel for {cid!r}, expected w1")
        check(at - sent_at < 1.0, f"the cancel reached the app {at - sent_at:.2f}s after it was sent")
        await client.check_alive()
    with step("WS app /slow: the next message after a cancel is answered on the same connection"):
        await client.send_message("another one", "w2")
        await wait_deltas(client, "w2", 1)
        await cancel_and_expect(client, "w2")
    tracker.assert_one_terminal_each(["w1", "w2"])
    await client.close()

    for how in ("close", "abort"):
        with step(f"WS app /slow: client goes away mid-reply ({how}) -> app connection closed < 1 s"):
            c = await Client.connect(gw)
            n = app.opened
            await c.send_message("an answer to abandon", "d1")
            await wait_deltas(c, "d1", 2)
            conn = await app.next_connection(after=n)
            gone_at = time.monotonic()
            if how == "close":
                await c.close()
            else:
                c.ws.transport.abort()
            check(await conn.wait_closed(1.0), "the upstream app connection outlived its client by 1 s")
            print(f"   app connection closed {(conn.closed_at - gone_at) * 1000:.0f} ms after the client left")
    gw.assert_alive()


async def test_queue(fake, gw):
    client = await Client.connect(gw)
    tracker = client.track()
    ids = [f"k{i}" for i in range(QUEUE_LIMIT + 2)]
    with step(f"queue bound: 1 in flight + {QUEUE_LIMIT} queued + 1 -> the last is rate_limited"):
        await client.send_message("message number 0", ids[0])
        await client.recv_type("ack", ids[0])
        for i, mid in enumerate(ids[1:], 1):
            await client.send_message(f"message number {i}", mid)
        err = await client.expect_error("rate_limited", mid=ids[-1])
        print(f"   {harness.brief(err)}")
        turns = [await client.collect_turn(mid, timeout=20) for mid in ids[:-1]]
        for turn in turns:
            turn.expect_done()
        tracker.assert_one_terminal_each(ids)
        rate_limited = [f for f in client.received if f.get("id") == ids[-1]]
        check([f["type"] for f in rate_limited] == ["error"], f"{ids[-1]} got {rate_limited}")

    with step("queued messages are acked in order, each after the previous one ended"):
        order = [(kind, mid) for kind, mid in tracker.order if mid != ids[-1]]
        expected = [(kind, mid) for mid in ids[:-1] for kind in ("ack", "terminal")]
        check(order == expected, f"acks and terminal frames out of order: {order}")
        texts = [r.last_user_text for r in fake.requests_for("quick")[-(QUEUE_LIMIT + 1):]]
        check(texts == [f"message number {i}" for i in range(QUEUE_LIMIT + 1)],
              f"upstream got the messages in this order: {texts}")
    await client.close()


async def main(args):
    async with harness.FakeOpenAI() as fake, harness.FakeApp() as app:
        config = harness.make_config(
            {"slow": harness.openai_upstream(fake, "slow"),
             "quick": harness.openai_upstream(fake, "quick"),
             "app_slow": harness.app_upstream(app, "/slow")},
            "slow", queue_limit=QUEUE_LIMIT,
            resume={"grace_ms": 0})  # a lost connection stops its reply at once (test_resume: kept)
        async with harness.Gateway([], config) as gw:
            await independent(test_openai_cancel(fake, gw))
        async with harness.Gateway(["--default-upstream", "app_slow"], config) as gw:
            await independent(test_app_cancel(app, gw))
        async with harness.Gateway(["--default-upstream", "quick"], config) as gw:
            await independent(test_queue(fake, gw))


if __name__ == "__main__":
    harness.run(main, timeout=110)
