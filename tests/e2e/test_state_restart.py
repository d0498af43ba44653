"""End-to-end test: with Redis, a dialog survives a restart of the gateway (issue 3, item 8).

- auth none with CHATGATE_RESUME_SECRET: the flight search's turns, a third message
  still being answered when the gateway gets SIGTERM (it exits 0); a new gateway on the same
  Redis and secret; the client reconnects with ?resume=TOKEN and is the same user; its
  dialog is there (context.get: service, params, the history of the first two exchanges,
  meta) and the next message is forwarded with the kept params and history.
- auth header with a fixed user id: the same across a restart, and the new gateway's
  next message adds to the history and the Redis keys.
- Without CHATGATE_RESUME_SECRET the secret is random per process: a token of the old
  gateway gives a fresh user on the new one (as docs/protocol.md, Identity, says).
"""

import contextlib

import harness
from harness import (Client, check, check_turn_done, context_command, history_pairs,
                     independent, state_reply_text, step)

FLIGHT = {"from": "Nairobi", "to": "London", "departure_date": "2026-02-10"}
T1 = "Find flights from Nairobi to London on Feb 10"
T2 = "What about returning on Feb 20?"


async def say(client, app, mid, text, room, state=None):
    if state is not None:
        app.directives[mid] = state
    t = await client.message(text, mid=mid, room=room)
    check_turn_done(t)
    return t, await app.wait_message(mid)


def config_for(app, redis):
    return harness.state_config({"app": harness.app_upstream(app, "/state")}, "app", store=redis.url)


async def resume_across_restart(app, rules):
    redis = await harness.RedisServer().astart()
    env = {"CHATGATE_RESUME_SECRET": "restart-secret"}
    config = config_for(app, redis)
    try:
        gw1 = await harness.Gateway(["--rules", rules], config, env=env, name="gateway-1").astart()
        with step("converse on gateway 1 (flight turns), SIGTERM it with a reply in flight"):
            c = await Client.connect(gw1)
            user, token = c.hello["user"], c.hello["resume"]
            await say(c, app, "f1", T1, "trip", {"service": "travel", "params": dict(FLIGHT)})
            await say(c, app, "f2", T2, "trip", {"params": {"return_date": "2026-02-20"}})
            await c.send_message("Any cheaper ones? [delay=1.5]", "f3", "trip")
            await c.recv_type("ack", "f3")
            code = await gw1.astop()
            check(code == 0, f"gateway 1 should exit 0 on SIGTERM, got {code}")
            with contextlib.suppress(Exception):
                await c.close()
        gw2 = await harness.Gateway(["--rules", rules], config, env=env, name="gateway-2").astart()
        with step("gateway 2, same Redis and secret: ?resume=TOKEN gives the same user and dialog"):
            c = await Client.connect(f"{gw2.url}?resume={token}", expect_user=user)
            state = await context_command(c, "context.get", "trip")
            kept = dict(FLIGHT, return_date="2026-02-20")
            check(state.get("service") == "travel" and state.get("params") == {"travel": kept},
                  f"after the restart the dialog's service/params should be there: {harness.brief(state)}")
            hist = history_pairs(state.get("history"))
            first = [("user", T1), ("assistant", state_reply_text(T1)), ("user", T2), ("assistant", state_reply_text(T2))]
            check(hist[:4] == first, f"after the restart the history should start with the two exchanges: {hist}")
            meta = state.get("meta") or {}
            check(isinstance(meta.get("message_count"), int) and meta["message_count"] >= 2,
                  f"meta should survive too: {meta}")
            t4, f4 = await say(c, app, "f4", "Book the first one", "trip")
            check(f4.get("user") == user and f4.get("params") == dict(kept, cabin_class="economy"),
                  f"forwarded params after the restart: {harness.brief(f4)}")
            check(history_pairs(f4.get("history"))[:4] == first,
                  f"forwarded history after the restart: {harness.brief(f4.get('history'), 600)}")
            check(t4.ack.get("params") == dict(kept, cabin_class="economy"), f"ack after the restart: {t4.ack}")
            await c.close()
        await gw2.astop()
    finally:
        redis.cleanup(keep=True)


async def header_user_across_restart(app, rules):
    redis = await harness.RedisServer().astart()
    config = config_for(app, redis)
    args = ["--rules", rules, "--auth", "header", "--user-header", "X-User-Id"]
    headers = {"X-User-Id": "auth0|restart"}
    try:
        async with harness.Gateway(args, config, name="gateway-h1") as gw:
            with step("auth header: converse as a fixed user"):
                c = await Client.connect(gw, expect_user="auth0|restart", extra_headers=headers)
                await say(c, app, "p1", "Send 5000 shillings to +254712345678", "wallet",
                          {"service": "payment", "params": {"amount": 5000, "currency": "KES",
                                                            "recipient": "+254712345678"}})
                await c.close()
        async with harness.Gateway(args, config, name="gateway-h2") as gw:
            with step("auth header: after the restart the payment params are there"):
                c = await Client.connect(gw, expect_user="auth0|restart", extra_headers=headers)
                t, f = await say(c, app, "p2", "Send another 3000 to the same person", "wallet",
                                 {"params": {"amount": 3000}})
                want = {"amount": 5000, "currency": "KES", "recipient": "+254712345678"}
                check(f.get("params") == want and t.ack.get("params") == want,
                      f"params after the restart: forwarded {f.get('params')}, ack {t.ack.get('params')}")
                check(len(f.get("history") or []) == 2, f"history after the restart: {f.get('history')}")
                await c.close()
            key = redis.find_key(harness.dialog_key("auth0|restart", "wallet", "history"))
            check(key and len(redis.lrange(key)) == 4, f"Redis history after the restart: {redis.keys('chatgate:*')}")
    finally:
        redis.cleanup(keep=True)


async def random_secret(app, rules):
    redis = await harness.RedisServer().astart()
    config = config_for(app, redis)
    try:
        with step("no CHATGATE_RESUME_SECRET: an old token gives a fresh user after a restart"):
            async with harness.Gateway(["--rules", rules], config, name="gateway-r1") as gw:
                c = await Client.connect(gw)
                user, token = c.hello["user"], c.hello["resume"]
                await c.close()
            async with harness.Gateway(["--rules", rules], config, name="gateway-r2") as gw:
                c = await Client.connect(f"{gw.url}?resume={token}")
                check(c.hello["user"] != user, "a token of a gateway with a random secret worked on another one")
                await c.close()
    finally:
        redis.cleanup(keep=True)


async def main(args):
    rules = harness.empty_rules_dir()
    async with harness.FakeApp() as app:
        await independent(resume_across_restart(app, rules))
        await independent(header_user_across_restart(app, rules))
        await independent(random_secret(app, rules))


if __name__ == "__main__":
    harness.run(main, timeout=60)
