"""End-to-end load test: many concurrent connections, each with a window of messages.

200 WebSocket connections at once (demo upstream, delay_ms 0, --max-connections 1000, the
message rate limit raised in the config), each sending 20 messages with ids c<i>-<j>,
keeping at most 4 unanswered at a time (below the queue bound of 8).

Covers: every id gets an ack and exactly one terminal frame, which is done; done.text is the
concatenation of the deltas (FrameTracker); per connection, acks and dones come in the order
the messages were sent; no frame is lost, duplicated or delivered to the wrong connection;
the gateway is still running afterwards. Prints the throughput and the gateway's RSS.
"""

import asyncio
import time

import harness
from harness import Client, check, is_terminal, step

CONNECTIONS = 200
MESSAGES = 20
WINDOW = 4


async def converse(gw, i):
    """One client's whole conversation; returns the number of frames it received."""
    client = await Client.connect(gw)
    tracker = client.track()
    ids = [f"c{i}-{j}" for j in range(MESSAGES)]
    window = asyncio.Semaphore(WINDOW)

    async def sender():
        for j, mid in enumerate(ids):
            await window.acquire()
            await client.send_message(f"load test message {j} of client {i}", mid, room=f"load{i % 7}")

    send_task = asyncio.create_task(sender())
    try:
        answered = 0
        while answered < MESSAGES:
            frame = await client.recv(timeout=60)
            if is_terminal(frame):
                answered += 1
                window.release()
        await send_task
    finally:
        send_task.cancel()
    await client.expect_silence(0.05, what="frame after the last reply")
    tracker.assert_one_terminal_each(ids)
    kinds = {tracker.terminal(mid)["type"] for mid in ids}
    check(kinds == {"done"}, f"client {i}: terminal frames other than done: "
                             f"{[harness.brief(tracker.terminal(m)) for m in ids if tracker.terminal(m)['type'] != 'done']}")
    acks = [mid for kind, mid in tracker.order if kind == "ack"]
    ends = [mid for kind, mid in tracker.order if kind == "terminal"]
    check(acks == ids, f"client {i}: acks out of send order: {acks}")
    check(ends == ids, f"client {i}: dones out of send order: {ends}")
    await client.close()
    return len(client.received)


async def main(args):
    config = harness.make_config(
        {"demo": harness.demo_upstream(0)}, "demo",
        rate_limit={"messages_per_second": 100_000, "burst": 100_000})
    async with harness.Gateway(["--max-connections", 1000], config) as gw:
        rss_before = gw.rss_kb()
        with step(f"{CONNECTIONS} connections x {MESSAGES} messages, window {WINDOW}"):
            started = time.monotonic()
            results = await asyncio.gather(*(converse(gw, i) for i in range(CONNECTIONS)),
                                           return_exceptions=True)
            elapsed = time.monotonic() - started
            failures = [(i, r) for i, r in enumerate(results) if isinstance(r, BaseException)]
            for i, err in failures[:5]:
                print(f"   client {i} failed: {type(err).__name__}: {err}")
            check(not failures, f"{len(failures)} of {CONNECTIONS} clients failed; the first: "
                                f"client {failures[0][0]}: {failures[0][1]}" if failures else "")
            frames = sum(results)
            total = CONNECTIONS * MESSAGES
            print(f"load: {total} messages on {CONNECTIONS} connections in {elapsed:.2f}s "
                  f"({total / elapsed:.0f} messages/s, {frames} frames); gateway RSS "
                  f"{rss_before} kB before, {gw.rss_kb()} kB after")
        gw.assert_alive()


if __name__ == "__main__":
    harness.run(main, timeout=110)
