"""End-to-end tests of limits per user (issue 14, item 3; docs/configuration.md, "Limits per user").

Users come from HS256 JWTs (auth jwt); the plan from the token's `plan` claim
(limits.plan_claim) or from limits.users. The clock starts at a minute's start
(CHATGATE_NOW), so every count below falls in one minute's window.

- memory store, two connections of one user: messages_per_minute 10 lets exactly 10 of 15
  messages through, the others get `rate_limited` with `limit` and `retry_after_ms` (the
  ms to the next minute); another user is untouched; a token's plan "pro" gets its 20; a
  user the config's limits.users names gets that plan whatever the token says; an unknown
  plan is the default one (and logged); /metrics chatgate_limited_total counts them;
- turns_at_once 1 across two connections of one user: a message while the other
  connection's reply streams is refused (limit turns_at_once, retry 1000 ms); once that
  reply is done the next goes;
- tokens_per_minute from the usage the upstream reports: refused from the turn after the
  sum reached the limit, and never before; tokens_per_day: retry_after_ms is the time to
  the next UTC day;
- Redis store, two gateways: one user's messages spread over two connections on each
  gateway, sent at once: exactly messages_per_minute go (the limit holds within 1%: here
  exactly); a turn at once on one gateway refuses the user's message on the other; tokens
  spent through one gateway count at the other; a turn whose client left while Redis
  counted it frees its place (else the user would wait 5 minutes); with Redis away each
  gateway still refuses, from its own memory.
"""

import asyncio

import harness
from harness import Client, Gateway, check, independent, step

T = harness.DEFAULT_TIMEOUT
SECRET = "user-limits-jwt-secret"
NOW = "2026-02-03T10:00:00Z"  # a minute's start: 14 h to the next UTC day


def token(user, plan=None):
    claims = {"sub": user, "exp": 4_000_000_000}
    if plan:
        claims["plan"] = plan
    return harness.make_jwt(SECRET, claims)


async def connect(gw, user, plan=None):
    return await Client.connect(gw, expect_user=user,
                                extra_headers={"Authorization": "Bearer " + token(user, plan)})


def config(fake, behaviour, limits, store="memory"):
    """One upstream, served with `behaviour` (script: "SLOW" in the text streams slowly)."""
    ups = {"llm": harness.openai_upstream(fake, behaviour)}
    return harness.state_config(ups, "llm", store=store, auth="jwt", limits=limits)


ADMIN_TOKEN = "limits-admin-token-0123456789"
ENV = {"CHATGATE_JWT_SECRET": SECRET, "CHATGATE_NOW": NOW, "CHATGATE_ADMIN_TOKEN": ADMIN_TOKEN}


def check_limited(turn, limit, low, high):
    """turn ended rate_limited by `limit`, with low <= retry_after_ms <= high."""
    term = turn.terminal
    check(term.get("type") == "error" and term.get("code") == "rate_limited",
          f"{turn.id} should be rate_limited: {turn.describe()}")
    check(term.get("limit") == limit, f"{turn.id}: limit should be {limit}: {term}")
    retry = term.get("retry_after_ms")
    check(isinstance(retry, int) and low <= retry <= high,
          f"{turn.id}: retry_after_ms should be within [{low}, {high}]: {term}")


async def send_many(client, n, prefix, room="r"):
    """n messages one after another on one connection: the ends, in order."""
    ends = []
    for i in range(n):
        turn = await client.message(f"hello number {i}", mid=f"{prefix}{i}", room=room)
        ends.append(turn)
    return ends


def kinds(turns):
    return [t.terminal.get("code") if t.kind == "error" else t.kind for t in turns]


async def spend_until_refused(clients, fake, prefix, limit):
    """Turns, taking the clients in turn, until one is refused by tokens_per_minute `limit`:
    every turn that went must have started under the limit by what the upstream reported,
    and the refusal must come once the sum reached it."""
    spent, turns = 0, []
    for i in range(30):
        since = len(fake.requests)
        turn = await clients[i % len(clients)].message("what is the weather in Nairobi today", mid=f"{prefix}{i}")
        turns.append(turn)
        if turn.kind == "error":
            break
        turn.expect_done()
        check(spent < limit, f"{prefix}{i} went though {spent} tokens had been spent (limit {limit})")
        spent += sum(r.usage["prompt_tokens"] + r.usage["completion_tokens"]
                     for r in fake.requests[since:] if getattr(r, "usage", None))
    check(turns[-1].kind == "error" and spent >= limit and len(turns) >= 3,
          f"refused after {spent} tokens (limit {limit}), after a few turns: {kinds(turns)}")
    check_limited(turns[-1], "tokens_per_minute", 1000, 60000)


async def part_messages():
    limits = {"messages_per_minute": 10, "plan_claim": "plan",
              "plans": {"pro": {"messages_per_minute": 20}}, "users": {"ops-bot": "pro"}}
    async with harness.FakeOpenAI() as fake:
        async with Gateway(config=config(fake, "script", limits), env=ENV, name="limits-messages") as gw:
            a1 = await connect(gw, "alice")
            a2 = await connect(gw, "alice")
            with step("messages_per_minute 10 over two connections of one user: exactly 10 of 15 go"):
                turns = []
                for i in range(15):
                    client = a1 if i % 2 == 0 else a2
                    turns.append(await client.message(f"hi {i}", mid=f"m{i}", room=f"room{i % 3}"))
                got = kinds(turns)
                check(got.count("done") == 10 and got[:10] == ["done"] * 10,
                      f"the first 10 should be done, the rest refused: {got}")
                for t in turns[10:]:
                    check_limited(t, "messages_per_minute", 1000, 60000)
                check(len(fake.requests_for("script")) == 10,
                      f"the refused messages must not reach the upstream: {len(fake.requests_for('script'))}")
            with step("another user is untouched; a token's plan pro gets 20; limits.users' plan wins"):
                bob = await connect(gw, "bob")
                got = kinds(await send_many(bob, 11, "b"))
                check(got == ["done"] * 10 + ["rate_limited"], f"bob (default plan): {got}")
                carol = await connect(gw, "carol", plan="pro")
                got = kinds(await send_many(carol, 21, "c"))
                check(got == ["done"] * 20 + ["rate_limited"], f"carol (plan pro): {got}")
                bot = await connect(gw, "ops-bot")  # no plan in its token: the config's users map
                got = kinds(await send_many(bot, 21, "o"))
                check(got == ["done"] * 20 + ["rate_limited"], f"ops-bot (limits.users: pro): {got}")
            with step("an unknown plan is the default one, and the log says so"):
                dave = await connect(gw, "dave", plan="platinum")
                got = kinds(await send_many(dave, 11, "d"))
                check(got == ["done"] * 10 + ["rate_limited"], f"dave (unknown plan): {got}")
                check("'platinum'" in gw.log_text() and "not in limits.plans" in gw.log_text(),
                      "the log should name the unknown plan")
            with step("/metrics: chatgate_limited_total{limit=messages_per_minute} counts the refusals"):
                _, _, text = await asyncio.to_thread(harness.http_get, gw.http_url + "/metrics")
                m = harness.parse_metrics(text.decode())
                got = m.value("chatgate_limited_total", limit="messages_per_minute")
                check(got == 5 + 1 + 1 + 1 + 1, f"chatgate_limited_total: {got}")
                check(m.value("chatgate_limited_total", limit="turns_at_once") == 0, "no turns_at_once refusal yet")
            with step("DELETE /admin/users/bob (memory store) forgets his counts: his next message goes "
                      "(issue 35: they stayed until the minute's end)"):
                status, _, body = await asyncio.to_thread(
                    harness.http_request, gw.http_url + "/admin/users/bob", "DELETE",
                    {"Authorization": f"Bearer {ADMIN_TOKEN}"})
                check(status == 200, f"DELETE /admin/users/bob: HTTP {status} {body!r}")
                got = kinds(await send_many(bob, 1, "after-forget"))
                check(got == ["done"], f"bob after being forgotten: {got}")


async def part_turns():
    limits = {"turns_at_once": 1}
    async with harness.FakeOpenAI() as fake:
        fake.slow_words = 15  # 1.5 s: long enough to overlap, short for the suite
        async with Gateway(config=config(fake, "script", limits), env=ENV, name="limits-turns") as gw:
            a1 = await connect(gw, "alice")
            a2 = await connect(gw, "alice")
            other = await connect(gw, "zoe")
            with step("turns_at_once 1: while one connection's reply streams, the other's message is refused"):
                await a1.send_message("tell me a SLOW story", "long", "story")
                await a1.recv_type("delta", "long")
                refused = await a2.message("and me?", mid="second", room="other")
                check_limited(refused, "turns_at_once", 1000, 1000)
                fine = await other.message("someone else", mid="z1")
                fine.expect_done()
                first = await a1.collect_turn("long")
                first.expect_done()
            with step("once that reply is done, the user's next message goes"):
                again = await a2.message("and me now?", mid="third", room="other")
                again.expect_done()


async def part_tokens():
    limits = {"tokens_per_minute": 60, "plan_claim": "plan", "plans": {"daily": {"tokens_per_minute": 0,
                                                                                  "tokens_per_day": 40}}}
    async with harness.FakeOpenAI() as fake:
        async with Gateway(config=config(fake, "script", limits), env=ENV, name="limits-tokens") as gw:
            client = await connect(gw, "tina")
            with step("tokens_per_minute 60: refused from the turn after the reported sum reached 60, never before"):
                await spend_until_refused([client], fake, "t", 60)
            with step("tokens_per_day: retry_after_ms is the time to the next UTC day (14 h from 10:00)"):
                day = await connect(gw, "dora", plan="daily")
                turns = []
                for i in range(30):
                    turn = await day.message("please tell me about the weather in Nairobi today", mid=f"d{i}")
                    turns.append(turn)
                    if turn.kind == "error":
                        break
                check(turns[-1].kind == "error", f"tokens_per_day 40 never refused: {kinds(turns)}")
                check_limited(turns[-1], "tokens_per_day", 14 * 3600_000 - 120_000, 14 * 3600_000)


async def part_redis():
    redis = await harness.RedisServer().astart()
    try:
        async with harness.FakeOpenAI() as fake:
            fake.slow_words = 15
            limits = {"messages_per_minute": 100, "turns_at_once": 8}
            cfg = config(fake, "script", limits, store=redis.url)
            async with Gateway(config=cfg, env=ENV, name="limits-redis-1") as gw1, \
                    Gateway(config=cfg, env=ENV, name="limits-redis-2") as gw2:
                clients = [await connect(gw, "ruth") for gw in (gw1, gw1, gw2, gw2)]
                with step("two gateways on one Redis, four connections of one user at once: exactly 100 of 160 go"):
                    results = await asyncio.gather(*(send_many(c, 40, f"g{i}-", room=f"room{i}")
                                                     for i, c in enumerate(clients)))
                    got = [k for turns in results for k in kinds(turns)]
                    done = got.count("done")
                    check(done == 100 and got.count("rate_limited") == 60,
                          f"{done} done and {got.count('rate_limited')} refused of {len(got)} (want 100 and 60)")
                    check(len(fake.requests_for("script")) == 100, f"upstream saw {len(fake.requests_for('script'))}")
                    for turns in results:
                        for t in turns:
                            if t.kind == "error":
                                check_limited(t, "messages_per_minute", 1000, 60000)
                with step("DELETE /admin/users/ruth forgets her limit counts too, not only her dialogs "
                          "(issue 35: they stayed for up to a day)"):
                    esc = harness.escape_id("ruth")
                    limit_keys = [k for k in redis.keys("chatgate:*") if esc in k and ":limit:" in k]
                    check(limit_keys, f"no limit keys of ruth's before: {redis.keys('chatgate:*')}")
                    status, _, body = await asyncio.to_thread(
                        harness.http_request, gw1.http_url + "/admin/users/ruth", "DELETE",
                        {"Authorization": f"Bearer {ADMIN_TOKEN}"})
                    check(status == 200, f"DELETE /admin/users/ruth: HTTP {status} {body!r}")
                    left = [k for k in redis.keys("chatgate:*") if esc in k]
                    check(not left, f"ruth's keys left: {left}")
                with step("a turn at once on one gateway refuses the user's message on the other"):
                    cfg1 = config(fake, "script", {"turns_at_once": 1, "messages_per_minute": 3, "plan_claim": "plan",
                                                   "plans": {"tok": {"turns_at_once": 0, "messages_per_minute": 0,
                                                                     "tokens_per_minute": 60}}}, store=redis.url)
                    async with Gateway(config=cfg1, env=ENV, name="limits-redis-3") as g3, \
                            Gateway(config=cfg1, env=ENV, name="limits-redis-4") as g4:
                        x = await connect(g3, "sam")
                        y = await connect(g4, "sam")
                        await x.send_message("a SLOW story please", "long", "story")
                        await x.recv_type("delta", "long")
                        check_limited(await y.message("me too", mid="y1", room="other"), "turns_at_once", 1000, 1000)
                        (await x.collect_turn("long")).expect_done()
                        (await y.message("me now", mid="y2", room="other")).expect_done()
                        with step("tokens spent through one gateway count at the other"):
                            sides = [await connect(g, "tom", plan="tok") for g in (g3, g4)]
                            await spend_until_refused(sides, fake, "k", 60)
                        with step("a turn whose client left while Redis counted it frees its place"):
                            abe = await connect(g3, "abe")
                            redis.pause()  # the limit script's answer waits (under command_timeout_ms)
                            try:
                                await abe.send_message("hello", "gone", "r")
                                # the scenario: the message is at the gateway, its limit script waits on the paused Redis
                                await asyncio.sleep(0.2)
                                await abe.close()
                                await asyncio.sleep(0.1)  # the scenario: the close reaches the gateway before Redis answers
                            finally:
                                redis.resume()
                            await asyncio.sleep(0.3)  # the limit script's answer (after resume) lands and frees the place
                            again = await connect(g4, "abe")
                            (await again.message("hello again", mid="back", room="r")).expect_done()
                        with step("Redis away: each gateway counts in its own memory, and still refuses"):
                            redis.stop()
                            una = await connect(g4, "una")
                            got = kinds(await send_many(una, 4, "u"))
                            check(got == ["done"] * 3 + ["rate_limited"], f"una with Redis away: {got}")
    finally:
        redis.stop()


async def part_auth_none_warning():
    """Issue 35: with --auth none every connection is a new user, so per-user limits reset on
    reconnect; the gateway says so at start, naming the keys (before: nothing said)."""
    cfg = harness.make_config({"demo": harness.demo_upstream()}, "demo",
                              limits={"messages_per_minute": 5, "tokens_per_day": 1000})
    async with Gateway(["--auth", "none"], cfg, name="limits-auth-none") as gw:
        with step("--auth none with limits: a warning at start names limits.messages_per_minute and "
                  "limits.tokens_per_day and says why"):
            ok = await harness.wait_until(lambda: "--auth none" in gw.log_text(), 5)
            line = next((l for l in gw.log_text().splitlines() if "--auth none" in l), "")
            check(ok and "warn" in line and "limits.messages_per_minute" in line and "limits.tokens_per_day" in line
                  and "reconnect" in line, f"the start's warning: {line or gw.log_tail()}")


async def main(args):
    await independent(part_auth_none_warning())
    await independent(part_messages())
    await independent(part_turns())
    await independent(part_tokens())
    await independent(part_redis())


if __name__ == "__main__":
    harness.run(main, timeout=100)
