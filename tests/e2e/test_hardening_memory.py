"""End-to-end test of the memory store's bounds under hostile ids and big dialogs (issue 9,
defects 2 and 11).

Covers:
- long escaping ids (defect 2): --auth header, a user id of 256 bytes and room ids of 256
  bytes that each escape to three times their length (keys of 1,537 bytes), max_dialogs 1:
  every message is answered, /healthz answers between and after them (the eviction once
  copied the key into 1,024 bytes, missed it and spun for ever), the newest dialog is kept,
  the older ones are gone and counted in chatgate_store_evictions_total{reason="count"};
- a byte bound (defect 11): max_store_bytes 16384 and dialogs of 4 to 5 KB: three fit; one
  read again, then a fourth: the bytes held (chatgate_store_memory_bytes) stay under the
  bound, and so do the dialogs held (chatgate_store_dialogs_held, 3), the least recently used dialog goes, counted in
  chatgate_store_evictions_total{reason="bytes"}, the others keep their history; a
  max_store_bytes under 16384 is refused at start;
- params cap, all or nothing (defect 12): rules that extract params for two services from one
  message, the second over params_cap: the message is refused with too_large and the dialog
  (context.get) is as it was, the first service's params unchanged.
"""

import asyncio

import harness
from harness import Client, check, independent, step

LONG_USER = "~" * 256  # '~' is escaped: 768 bytes in a key


def long_room(n):
    """A 256-byte room id that escapes to 768 bytes; rooms differ in their last byte only,
    past the 1,024 bytes the old eviction kept of a key."""
    return "#" * 255 + "abcdefghij"[n]


def config(**extra):
    cfg = harness.make_config({"demo": harness.demo_upstream(0)}, "demo",
                              rate_limit={"messages_per_second": 100_000, "burst": 100_000})
    cfg.update(extra)
    return cfg


async def healthz(gw, what):
    """/healthz answers 200 within 3 s (the loop is not stuck)."""
    try:
        status, _, body = await asyncio.to_thread(harness.http_get, gw.http_url + "/healthz", 3.0)
    except OSError as err:
        gw.failed = True
        harness.fail(f"/healthz did not answer {what}: {err} (the event loop is stuck)")
    check(status == 200, f"/healthz {what}: HTTP {status} {body!r}")


async def metrics(gw):
    status, _, body = await asyncio.to_thread(harness.http_get, gw.http_url + "/metrics", 3.0)
    check(status == 200, f"/metrics: HTTP {status}")
    return harness.parse_metrics(body.decode())


async def context_state(client, room):
    """The context frame's state for room (context.get)."""
    await client.send({"type": "context.get", "room": room})
    answer = await client.next_matching(lambda f: f.get("type") in ("context", "error") and "id" not in f,
                                        what=f"context of room {room[:12]!r}...")
    check(answer.get("type") == "context", f"context.get got {harness.brief(answer)}")
    return answer["state"]


async def part_long_ids():
    args = ["--auth", "header"]
    async with harness.Gateway(args, config(max_dialogs=1), name="gateway-long-ids") as gw:
        client = await Client.connect(gw, expect_user=LONG_USER, extra_headers={"X-User-Id": LONG_USER})
        with step("--auth header, 256-byte ids escaping to 1,537-byte keys, max_dialogs 1: "
                  "every message answered, /healthz answers"):
            for n in range(4):
                turn = await client.message(f"hello {n}", mid=f"long{n}", room=long_room(n), timeout=5)
                turn.expect_done()
                await healthz(gw, f"after the dialog of room {n} was saved")
        with step("the newest dialog is kept, the older ones were evicted and counted"):
            newest = await context_state(client, long_room(3))
            check(len(newest.get("history") or []) == 2, f"room 3's history: {harness.brief(newest)}")
            oldest = await context_state(client, long_room(0))
            check(not oldest.get("history"), f"room 0 should have been evicted: {harness.brief(oldest)}")
            m = await metrics(gw)
            # rooms 1..3 each pushed out the one before; the context.get of room 0 loaded it
            # afresh (not saved), so nothing more
            check(m.value("chatgate_store_evictions_total", reason="count") >= 3,
                  f"evictions by count: {m.series('chatgate_store_evictions_total')}")
            await healthz(gw, "at the end")
        await client.close()


async def part_byte_bound():
    async with harness.Gateway([], config(max_store_bytes=16384), name="gateway-bytes") as gw:
        client = await Client.connect(gw)
        text = "word " * 400  # 2,000 bytes; the demo's reply repeats it: 4 to 5 KB a dialog
        with step("max_store_bytes 16384: three dialogs of 4 to 5 KB fit, no eviction"):
            for n in range(3):
                (await client.message(text, mid=f"b{n}", room=f"r{n}")).expect_done()
            m = await metrics(gw)
            held = m.value("chatgate_store_memory_bytes")
            check(3 * 4096 < held <= 16384, f"three dialogs held {held} bytes, expected 12 to 16 KB")
            check(m.value("chatgate_store_dialogs_held") == 3,
                  f"chatgate_store_dialogs_held {m.value('chatgate_store_dialogs_held')}, expected 3")
            check(m.value("chatgate_store_evictions_total", reason="bytes") == 0,
                  f"evictions: {m.series('chatgate_store_evictions_total')}")
        with step("r0 read again, then a fourth dialog: r1, the least recently used, goes"):
            await context_state(client, "r0")
            (await client.message(text, mid="b3", room="r3")).expect_done()
            m = await metrics(gw)
            held = m.value("chatgate_store_memory_bytes")
            check(0 < held <= 16384, f"{held} bytes held, over max_store_bytes 16384")
            check(m.value("chatgate_store_dialogs_held") == 3,
                  f"one in, one out: chatgate_store_dialogs_held {m.value('chatgate_store_dialogs_held')}, expected 3")
            check(m.value("chatgate_store_evictions_total", reason="bytes") == 1,
                  f"evictions by bytes: {m.series('chatgate_store_evictions_total')}")
            check(m.value("chatgate_store_evictions_total", reason="count") == 0,
                  f"no eviction by count: {m.series('chatgate_store_evictions_total')}")
            gone = await context_state(client, "r1")
            check(not gone.get("history"), f"r1 (least recently used) should be gone: {harness.brief(gone)}")
            for room in ("r0", "r2", "r3"):
                kept = await context_state(client, room)
                check(len(kept.get("history") or []) == 2, f"{room}'s history: {harness.brief(kept)}")
        await client.close()

    with step("max_store_bytes 1000 (under 16384) is refused at start, naming the key"):
        code, out, _ = await harness.gateway_exit(config(max_store_bytes=1000))
        check(code != 0 and "max_store_bytes" in out, f"status {code}, output {out[-300:]!r}")


TWO_SERVICE_RULES = """rule small_one
  match \\bsmall\\s+(?<x>\\w+)
  do params alpha
rule big_one
  match \\bbig\\s+(?<y>\\w+)
  do params beta
"""


async def part_params_cap():
    rules = harness.temp_dir("chatgate-e2e-rules-")
    (rules / "10-two.rules").write_text(TWO_SERVICE_RULES)
    async with harness.Gateway(["--rules", rules], config(params_cap=64), name="gateway-cap") as gw:
        client = await Client.connect(gw)
        with step("params of two services, the second over params_cap 64: refused, nothing kept"):
            (await client.message("small one", mid="c1", room="cap")).expect_done()
            turn = await client.message("small two big " + "y" * 100, mid="c2", room="cap")
            errors = [f for f in turn.frames if f.get("type") == "error"]
            check(errors and errors[-1].get("code") == "too_large", f"expected too_large: {turn.describe()}")
            state = await context_state(client, "cap")
            check(state.get("params") == {"alpha": {"x": "one"}},
                  f"params after the refused message should be as before: {state.get('params')}")
        await client.close()


async def main(args):
    await independent(part_long_ids())
    await independent(part_byte_bound())
    await independent(part_params_cap())


if __name__ == "__main__":
    harness.run(main, timeout=100)
