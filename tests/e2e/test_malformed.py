"""End-to-end test: a flood of malformed frames on one connection.

Covers (docs/protocol.md, Errors: "answers bad input with an error frame and keeps the
connection"): 10,000 malformed frames in a row (text that is not JSON, arrays, scalars,
unknown types, missing or wrong-typed fields, binary frames), written as fast as the socket
takes them while a reader task collects the replies concurrently. Every one of them gets an
error frame with code bad_frame (the rate limit is raised in the config so that the gateway's
message rate limit does not come into it) and nothing else; afterwards a normal message still
gets its reply on the same connection, the gateway is still running, and its RSS before and
after is printed.
"""

import asyncio
import collections
import json
import time

import harness
from harness import Client, check, step

COUNT = 10_000


def malformed(i):
    """The i-th malformed frame: str for a text frame, bytes for a binary one."""
    kind = i % 10
    if kind == 0:
        return f"not json {i}"
    if kind == 1:
        return f"[{i}, {i + 1}]"
    if kind == 2:
        return json.dumps({"type": f"bogus-{i % 7}", "id": f"u{i}"})
    if kind == 3:
        return json.dumps({"type": "message", "id": f"t{i}", "text": i})
    if kind == 4:
        return f"binary {i}".encode()
    if kind == 5:
        return json.dumps({"type": "message", "id": f"x{i}"})
    if kind == 6:
        return json.dumps({"type": "message", "id": i, "text": "hi"})
    if kind == 7:
        return json.dumps({"type": "message", "id": f"r{i}", "room": {"n": i}, "text": "hi"})
    if kind == 8:
        return '{"type": "message", "text": "unterminated'
    return json.dumps(i)


async def main(args):
    config = harness.make_config(
        {"demo": harness.demo_upstream(0)}, "demo",
        rate_limit={"messages_per_second": 1_000_000, "burst": 1_000_000})
    async with harness.Gateway([], config) as gw:
        client = await Client.connect(gw)
        rss_before = gw.rss_kb()

        with step(f"{COUNT} malformed frames in a row, replies read concurrently"):
            codes = collections.Counter()
            others = []

            async def reader():
                errors = 0
                while errors < COUNT:
                    frame = await client.recv(timeout=30)
                    if frame.get("type") == "error":
                        errors += 1
                        codes[frame.get("code")] += 1
                    else:
                        others.append(frame)

            started = time.monotonic()
            read_task = asyncio.create_task(reader())
            for i in range(COUNT):
                await client.send_raw(malformed(i))
                if read_task.done():
                    break  # the reader failed: report that
            await read_task
            elapsed = time.monotonic() - started
            print(f"   {COUNT} error replies in {elapsed:.2f}s ({COUNT / elapsed:.0f}/s); codes {dict(codes)}")
            check(codes == {"bad_frame": COUNT}, f"every malformed frame should get bad_frame, got {dict(codes)}")
            check(not others, f"frames other than errors: {[harness.brief(f, 100) for f in others[:5]]}")

        with step("after the flood: nothing more arrives, a normal message works"):
            # a marker: the gateway answers a connection's frames in order, so anything the flood
            # still caused comes before the answer to this cancel of an unknown id
            await client.check_alive()
            await client.expect_silence(0, what="frame after the last error")
            turn = await client.message("hello after the flood", mid="after")
            turn.expect_done()
            gw.assert_alive()
            rss_after = gw.rss_kb()
            print(f"malformed: gateway RSS before {rss_before} kB, after {rss_after} kB "
                  f"({rss_after - rss_before:+d} kB)")
        await client.close()


if __name__ == "__main__":
    harness.run(main, timeout=100)
