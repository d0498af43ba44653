"""End-to-end test of the user's profile (issue 40, item 1; docs/state.md, "The user's profile").

What a user says about themselves belongs to the user, not the room: a backend keeps it with
a state directive's "profile", and every upstream turn of that user, in any room, gets it.
Run with the memory store, and with a real redis-server behind two gateways (one user, --auth
header), checking:
- said in room A (the chat app's directive), used in room B: the app's message frame carries
  `profile`; an OpenAI-compatible upstream gets it in its system message (`user_profile`);
  with Redis, through the other gateway too;
- the client: profile.get answers a profile frame; profile.forget of names, and of everything;
  the next turn's frame has what is left;
- the admin API: GET; PUT of names (?set={...}) and of one name (?value=JSON); 413 past
  profile_cap, 400 for a value that is not JSON, a set that is no object or a bad name;
  DELETE of one name and of all; DELETE /admin/users/{user}
  leaves no key of the user in Redis, the profile's included;
- bounds: a directive whose profile would pass profile_cap, or names a bad attribute, is
  refused whole (a warning; nothing of it kept: not the profile, not its soft context);
- with Redis stopped, a profile update is kept in the gateway's copy, and written to Redis
  (restarted empty) when it is back;
- another user can neither read nor change this user's profile; a profile lapses
  lifetimes.profile_s after its last use (memory), and Redis's key has that lifetime;
- logs never show a profile's values;
- the shipped rules/15-profile.rules remember name, home city, currency and language, and a
  travel search without an origin goes from the home city, marked in the ack (`from_profile`);
  an origin said in the message wins.
"""

import asyncio
import json
import urllib.parse

import harness
from harness import Client, check, independent, step

TOKEN = "profile-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
USER = "auth0|sam"
SAM = {"name": "Sam", "home_city": "Nairobi"}


async def http(url, method="GET"):
    status, _, raw = await asyncio.to_thread(harness.http_request, url, method, AUTH, None)
    try:
        return status, json.loads(raw.decode() or "null")
    except ValueError:
        return status, raw.decode("utf-8", "replace")


def profile_url(gw, user=USER):
    return f"{gw.http_url}/admin/users/{urllib.parse.quote(user, safe='')}/profile"


def name_url(gw, name, value=None, raw=False):
    """PUT .../profile/{name}?value=JSON (value given; raw: as it is, not JSON-encoded), or the
    name's URL for a DELETE."""
    url = f"{profile_url(gw)}/{urllib.parse.quote(name, safe='')}"
    if value is None:
        return url
    return url + "?value=" + urllib.parse.quote(value if raw else json.dumps(value), safe="")


async def connect_as(gw, user=USER):
    return await Client.connect(gw, expect_user=user, extra_headers={"X-User-Id": user})


async def profile_command(client, kind, **extra):
    await client.send(dict({"type": kind}, **extra))
    frame = await client.next_matching(lambda f: f.get("type") in ("profile", "error"), harness.DEFAULT_TIMEOUT,
                                       f"the answer to {kind}")
    check(frame.get("type") == "profile", f"{kind} should be answered with a profile frame: {frame}")
    return frame["profile"]


async def turn(client, app, mid, room, text, state=None):
    if state is not None:
        app.directives[mid] = state
    t = await client.message(text, mid=mid, room=room)
    return t, await app.wait_message(mid)


def config(app, fake, store, **extra):
    upstreams = {"app": harness.app_upstream(app, "/state"), "llm": harness.openai_upstream(fake, "script")}
    cfg = harness.state_config(upstreams, "app", store=store, profile_cap=256, **extra)
    return cfg


ARGS = ["--auth", "header", "--user-header", "X-User-Id"]


async def part_profile(mode):
    tag = f"[{mode}]"
    redis = await harness.RedisServer().astart() if mode == "redis" else None
    store = redis.url if redis else "memory"
    env = {"CHATGATE_ADMIN_TOKEN": TOKEN}
    try:
        async with harness.FakeApp() as app, harness.FakeOpenAI() as fake:
            cfg = config(app, fake, store)
            async with harness.Gateway(ARGS, cfg, env=env, name=f"gw1:{mode}") as gw, \
                    harness.Gateway(ARGS + ["--default-upstream", "llm"], cfg, env=env, name=f"gw2:{mode}") as gw_llm:
                c = await connect_as(gw)
                with step(f"{tag} said in room A (the app's directive), carried in room B's frame"):
                    t, fwd = await turn(c, app, "a1", "A", "here is who I am", {"profile": SAM})
                    t.expect_done()
                    check(fwd["profile"] == {}, f"the first frame has no profile yet: {fwd.get('profile')}")
                    t, fwd = await turn(c, app, "b1", "B", "flights to London")
                    t.expect_done()
                    check(fwd["profile"] == SAM, f"room B's frame should carry the profile: {fwd.get('profile')}")
                with step(f"{tag} an LLM upstream (another gateway when on Redis) gets it in its system message"):
                    llm = await connect_as(gw_llm) if redis else None
                    client = llm or c
                    n = len(fake.requests)
                    if redis:
                        t = await client.message("what is my name?", mid="c1", room="C")
                    else:  # one gateway: the app is the default there; the LLM gateway shares no memory
                        t = None
                    if t:
                        t.expect_done()
                        msgs = (await fake.next_request("script", after=n)).messages
                        system = msgs[0]["content"] if msgs and msgs[0].get("role") == "system" else ""
                        check('"user_profile":{"name":"Sam","home_city":"Nairobi"}' in system,
                              f"the system message should hold the profile: {system!r}")
                with step(f"{tag} profile.get, profile.forget of a name, the next frame"):
                    check(await profile_command(c, "profile.get") == SAM, "profile.get")
                    left = await profile_command(c, "profile.forget", keys=["home_city"])
                    check(left == {"name": "Sam"}, f"after forgetting home_city: {left}")
                    t, fwd = await turn(c, app, "b2", "B", "and hotels?")
                    check(fwd["profile"] == {"name": "Sam"}, f"frame after the forget: {fwd['profile']}")
                with step(f"{tag} a directive past profile_cap, or with a bad name, is refused whole"):
                    big = {"profile": {"bio": "x" * 300}, "soft_context": {"last_action": "bio"}}
                    t, _ = await turn(c, app, "x1", "B", "here is my life story", big)
                    check([w.get("code") for w in t.warnings] == ["too_large"]
                          and "profile_cap" in t.warnings[0].get("message", ""), f"{t.describe()}")
                    bad = {"profile": {"home city": "Nairobi"}, "soft_context": {"last_action": "bad"}}
                    t, _ = await turn(c, app, "x2", "B", "a bad name", bad)
                    check([w.get("code") for w in t.warnings] == ["bad_frame"], f"{t.describe()}")
                    t, fwd = await turn(c, app, "x3", "B", "still there?")
                    check(fwd["profile"] == {"name": "Sam"} and fwd["soft_context"] is None,
                          f"nothing of the refused directives kept: {fwd['profile']}, {fwd['soft_context']}")
                with step(f"{tag} another user reads none of it and changes none of it"):
                    other = await connect_as(gw, "auth0|eve")
                    check(await profile_command(other, "profile.get") == {}, "eve's own profile is empty")
                    await profile_command(other, "profile.forget")
                    await other.send({"type": "profile.forget", "keys": ["../name", 5]})
                    err = await other.next_matching(lambda f: f.get("type") == "error", 5, "an error")
                    check(err.get("code") == "bad_frame", f"bad keys: {err}")
                    check(await profile_command(c, "profile.get") == {"name": "Sam"}, "sam's profile untouched")
                    await other.close()
                with step(f"{tag} admin: GET; PUT and DELETE of one name (413 past the cap); DELETE of all"):
                    status, body = await http(profile_url(gw))
                    check(status == 200 and body == {"user": USER, "profile": {"name": "Sam"}}, f"{status} {body}")
                    status, body = await http(name_url(gw, "currency", "EUR"), "PUT")
                    check(status == 200 and body["profile"] == {"name": "Sam", "currency": "EUR"}, f"{status} {body}")
                    status, body = await http(name_url(gw, "name"), "DELETE")
                    check(status == 200 and body["profile"] == {"currency": "EUR"}, f"{status} {body}")
                    status, body = await http(name_url(gw, "bio", "y" * 400), "PUT")
                    check(status == 413, f"past the cap: {status} {body}")
                    status, body = await http(name_url(gw, "bio", "{not json", raw=True), "PUT")
                    check(status == 400, f"a value that is not JSON: {status} {body}")
                    status, body = await http(name_url(gw, "home city", "x"), "PUT")
                    check(status == 400, f"a bad name: {status} {body}")
                    check(await profile_command(c, "profile.get") == {"currency": "EUR"}, "after the admin's PUT")
                    status, body = await http(profile_url(gw) + "?set=" + urllib.parse.quote(
                        json.dumps({"language": "french", "currency": None}), safe=""), "PUT")
                    check(status == 200 and body["profile"] == {"language": "french"}, f"PUT ?set=: {status} {body}")
                    status, body = await http(profile_url(gw) + "?set=%5B1%5D", "PUT")
                    check(status == 400, f"PUT ?set= of an array: {status} {body}")
                    status, body = await http(profile_url(gw), "DELETE")
                    check(status == 200 and body["profile"] == {}, f"{status} {body}")
                    check(await profile_command(c, "profile.get") == {}, "after the admin's DELETE")
                    status, body = await http(profile_url(gw) + "?set=" + urllib.parse.quote('{"bio":"' + "z" * 300 + '"}',
                                                                                         safe=""), "PUT")
                    check(status == 413, f"PUT ?set= past the cap: {status} {body}")
                with step(f"{tag} profile.forget of everything"):
                    await turn(c, app, "f1", "A", "remember me", {"profile": SAM})
                    check(await profile_command(c, "profile.forget") == {}, "forget all")
                if redis:
                    with step(f"{tag} Redis: one hash under the user's tag, its lifetime; forget-user leaves no key"):
                        await turn(c, app, "f2", "A", "again", {"profile": SAM})
                        keys = [k for k in redis.keys("*") if k.endswith(":profile")]
                        check(keys == ["chatgate:{auth0|sam}:profile"], f"profile keys: {keys}")
                        ttl = redis.command("PTTL", keys[0])
                        check(30 * 86400 * 1000 - 60000 < ttl <= 30 * 86400 * 1000, f"PTTL {ttl}")
                        status, _ = await http(f"{gw.http_url}/admin/users/{urllib.parse.quote(USER, safe='')}",
                                               "DELETE")
                        check(status == 200, f"forget user: {status}")
                        left = [k for k in redis.keys("*") if "sam" in k]
                        check(left == [], f"keys of the user left: {left}")
                if redis:
                    with step(f"{tag} Redis away: a profile update is kept, and written back when Redis is back"):
                        redis.stop()
                        t, _ = await turn(c, app, "w1", "A", "while Redis is down", {"profile": {"currency": "KES"}})
                        t.expect_done()
                        check(await profile_command(c, "profile.get") == {"currency": "KES"},
                              "the gateway's copy answers while Redis is away")
                        await redis.arestart()  # empty: only the write-back can put the profile there
                        key = "chatgate:{" + harness.escape_id(USER) + "}:profile"
                        await harness.wait_condition(lambda: redis.command("HGET", key, "currency") == '"KES"', 10,
                                                     "the profile update made while Redis was away, in Redis")
                with step(f"{tag} logs never show a profile's values"):
                    for g in (gw, gw_llm):
                        log = g.log_text()
                        check("Nairobi" not in log and "EUR" not in log, f"{g.name} logged a value")
                await c.close()
                if llm:
                    await llm.close()
    finally:
        if redis:
            redis.stop()


async def part_lifetime():
    async with harness.FakeApp() as app, harness.FakeOpenAI() as fake:
        cfg = config(app, fake, "memory", lifetimes={"profile_s": 1})
        async with harness.Gateway(ARGS, cfg, name="gw:lifetime") as gw:
            c = await connect_as(gw)
            with step("a profile lapses lifetimes.profile_s after its last use"):
                await turn(c, app, "l1", "A", "hi", {"profile": SAM})
                check(await profile_command(c, "profile.get") == SAM, "there at first")

                async def gone():
                    return await profile_command(c, "profile.get") == {}
                await harness.wait_condition(gone, 5, "the profile should lapse after profile_s (1 s)", interval=0.3)
            await c.close()


async def part_rules():
    """The shipped rules/15-profile.rules remember what the user says; the travel service's
    origin defaults to the home city, marked in the ack."""
    root = __import__("os").path.dirname(__import__("os").path.dirname(__import__("os").path.dirname(
        __import__("os").path.abspath(__file__))))
    cfg = harness.make_config({"demo": harness.demo_upstream(0)}, "demo",
                              rate_limit={"messages_per_second": 1000, "burst": 1000})
    async with harness.Gateway(ARGS + ["--rules", root + "/rules"], cfg, name="gw:rules") as gw:
        c = await connect_as(gw)
        with step("'I live in Nairobi, call me Sam' is remembered by the shipped rules"):
            t = await c.message("I live in Nairobi, call me sam", mid="r1", room="A")
            t.expect_done()
            check({"profile_home_city", "profile_name"} <= set(t.ack.get("rules", [])), f"ack {t.ack}")
            check(await profile_command(c, "profile.get") == {"home_city": "Nairobi", "name": "Sam"}, "profile")
        with step("'Find flights to London' in another room: from Nairobi, from the profile (ack from_profile)"):
            t = await c.message("Find flights to London", mid="r2", room="B")
            t.expect_done()
            check(t.ack.get("params", {}).get("from") == "Nairobi" and t.ack["params"].get("to") == "London"
                  and t.ack.get("from_profile") == ["from"], f"ack {t.ack}")
        with step("a from said in the message wins over the profile, and the ack marks nothing"):
            t = await c.message("Find flights from Mombasa to London", mid="r3", room="C")
            t.expect_done()
            check(t.ack["params"].get("from") == "Mombasa" and "from_profile" not in t.ack, f"ack {t.ack}")
        with step("'prices in euros' and 'reply in French' join the profile"):
            await c.message("prices in euros please", mid="r4", room="A")
            await c.message("please reply in French", mid="r5", room="A")
            check(await profile_command(c, "profile.get") == {"home_city": "Nairobi", "name": "Sam",
                                                              "currency": "EUR", "language": "french"}, "profile")
        await c.close()


async def main(args):
    await independent(part_rules())
    await independent(part_profile("memory"))
    await independent(part_profile("redis"))
    await independent(part_lifetime())


if __name__ == "__main__":
    harness.run(main, timeout=90)
