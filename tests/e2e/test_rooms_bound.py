"""max_rooms_per_user (issue 35): one user can no longer fill the store with rooms. Past the
bound, a new room makes the user's least recently used one go (its dialog forgotten),
counted in chatgate_store_evictions_total{reason="rooms"}; other users are untouched.

- memory: max_rooms_per_user 3, rooms r1, r2, r3, then r1 again (used), then r4: r2 is
  forgotten (GET /admin/dialogs says not found), r1, r3 and r4 and another user's room stay;
  the metric counts 1. Before: every room stayed (only max_dialogs, for all users, bounded
  them).
- Redis, lifetimes under a minute (every save renews them): the same; r2's keys are gone from
  Redis, the user's rooms set (a ZSET by last use) holds the three others. Before: all four
  stayed.
- Redis, the default lifetimes: a room's score is renewed with its keys' lifetimes (a sixtieth
  of the shortest, 30 s), not at every save, so rooms used within 30 s of each other are in no
  set order: r1 again within it leaves r1's score, and r1 goes. Before issue 39's eighth round
  every save wrote the score (a call of the turn's 12 in Redis), and r2 went.
- Redis, an older layout: a rooms SET written by an earlier version (a room "old") is made a
  ZSET at the user's next save, and keeps "old"; DELETE /admin/users still forgets every key.
"""

import asyncio
import json
import urllib.parse

import harness
from harness import Client, Gateway, check, independent, step

ADMIN_TOKEN = "rooms-admin-token-0123456789"
ENV = {"CHATGATE_ADMIN_TOKEN": ADMIN_TOKEN}
AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


# lifetimes under a minute: every save renews them, and with them the room's score
SHORT = {"params_s": 50, "dialog_s": 50, "history_s": 50}


def gateway(store, name, lifetimes=None):
    extra = {"lifetimes": lifetimes} if lifetimes else {}
    cfg = harness.state_config({"demo": harness.demo_upstream()}, "demo", store=store, max_rooms_per_user=3, **extra)
    return Gateway(["--auth", "header", "--user-header", "X-User-Id"], cfg, env=ENV, name=name)


async def connect_as(gw, user):
    return await Client.connect(gw, expect_user=user, extra_headers={"X-User-Id": user})


async def found(gw, user, room):
    path = f"/admin/dialogs/{urllib.parse.quote(user, safe='')}/{urllib.parse.quote(room, safe='')}"
    status, _, body = await asyncio.to_thread(harness.http_request, gw.http_url + path, "GET", AUTH)
    check(status == 200, f"GET {path}: {status} {body[:200]!r}")
    return json.loads(body)["found"]


async def evictions(gw):
    status, _, body = await asyncio.to_thread(harness.http_get, gw.http_url + "/metrics")
    check(status == 200, f"/metrics: {status}")
    return harness.parse_metrics(body.decode()).value("chatgate_store_evictions_total", reason="rooms")


async def fill(gw, user="ann"):
    """user talks in r1, r2, r3, r1 again, then r4; bob in one room."""
    ann, bob = await connect_as(gw, user), await connect_as(gw, "bob")
    for i, room in enumerate(["r1", "r2", "r3", "r1", "r4"]):
        (await ann.message(f"hello {i}", mid=f"a{i}", room=room)).expect_done()
        await asyncio.sleep(0.01)  # each room's last use its own millisecond
    (await bob.message("hi", mid=f"b1-{user}", room="x")).expect_done()
    await ann.close()
    await bob.close()


async def check_bound(gw, user="ann", gone="r2"):
    await fill(gw, user)
    got = {room: await found(gw, user, room) for room in ("r1", "r2", "r3", "r4")}
    want = {room: room != gone for room in got}
    check(got == want, f"{user}'s rooms after r4 (bound 3, {gone} should have gone): {got}")
    check(await found(gw, "bob", "x"), "bob's room should stay")
    n = await evictions(gw)
    check(n == 1, f'chatgate_store_evictions_total{{reason="rooms"}} is {n}, expected 1')


async def part_memory():
    async with gateway("memory", "rooms-memory") as gw:
        with step("memory, max_rooms_per_user 3: r1 r2 r3, r1 again, r4: r2 goes, counted; bob's room stays"):
            await check_bound(gw)


async def part_redis():
    redis = await harness.RedisServer().astart()
    try:
        async with gateway(redis.url, "rooms-redis-default") as gw:
            with step("Redis, the default lifetimes: r1's save within 30 s of its first leaves its score, so "
                      "r1 goes, not r2 (a room's score is renewed with the lifetimes)"):
                await check_bound(gw, "dan", gone="r1")
                rooms = redis.zrange("chatgate:{dan}:rooms")
                check(sorted(rooms) == ["r2", "r3", "r4"], f"dan's rooms set: {rooms}")
            gw.assert_alive()
        async with gateway(redis.url, "rooms-redis", SHORT) as gw:
            with step("Redis, max_rooms_per_user 3, lifetimes under a minute: the same as memory; r2's keys are "
                      "gone, the rooms ZSET holds r1 r3 r4"):
                await check_bound(gw)
                keys = redis.keys("chatgate:{ann}:*")
                check(not [k for k in keys if ":r2:" in k], f"r2's keys left in Redis: {keys}")
                check([k for k in keys if ":r1:" in k] and [k for k in keys if ":r4:" in k], f"keys: {keys}")
                rooms = redis.zrange("chatgate:{ann}:rooms")
                check(sorted(rooms) == ["r1", "r3", "r4"], f"ann's rooms set: {rooms}")
            with step("a rooms SET of an earlier version is made a ZSET at the user's next save, its rooms kept; "
                      "DELETE /admin/users forgets every key"):
                redis.command("SADD", "chatgate:{cy}:rooms", "old")
                cy = await connect_as(gw, "cy")
                (await cy.message("hello", mid="c1", room="new")).expect_done()
                await cy.close()
                ok = await harness.wait_until(lambda: redis.type("chatgate:{cy}:rooms") == "zset", 5)
                check(ok, f"the rooms key is a {redis.type('chatgate:{cy}:rooms')}")
                rooms = redis.zrange("chatgate:{cy}:rooms")
                check(sorted(rooms) == ["new", "old"], f"cy's rooms: {rooms}")
                status, _, body = await asyncio.to_thread(harness.http_request, gw.http_url + "/admin/users/cy",
                                                          "DELETE", AUTH)
                check(status == 200, f"DELETE /admin/users/cy: {status} {body!r}")
                left = redis.keys("chatgate:{cy}:*")
                check(not left, f"cy's keys left: {left}")
            gw.assert_alive()
    finally:
        redis.stop()


async def main(args):
    await independent(part_memory())
    await independent(part_redis())


if __name__ == "__main__":
    harness.run(main, timeout=80)
