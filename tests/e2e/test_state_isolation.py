"""End-to-end test of identity and isolation (issue 3; docs/protocol.md, Identity; docs/state.md, Keys).

- Two users in one room see nothing of each other (context.get, context.forget/clear, the
  forwarded params, awaiting, soft context and history), with the memory and the Redis
  store; a `user` field in a client frame changes nothing (the user id never comes from a
  frame); the same with two auth-none connections (two fresh users).
- Hostile ids (auth header, Redis store): users `a:b`, `a}:{b`, `*`, `auth0|abc`,
  `ünï cødé`, `a`, `%41` and `A`; user `a` room `b:c` and user `a:b` room `c` do not collide;
  each user's state stays its own, every key has one intact hash tag with the ids
  percent-encoded outside [A-Za-z0-9_.@|-]; hello.user is the header's id; a 256-byte id
  is accepted, a 300-byte one, an empty one or a missing header is unauthorized (error
  frame with id null, close 1008); a room over 256 bytes is bad_frame.
- Resume tokens (auth none): ?resume=TOKEN gives the same user and its dialog; a bad, a
  tampered, a re-targeted token and one signed with another secret give a fresh user and a
  working connection.
- JWT (HS256, CHATGATE_JWT_SECRET): a good token in the Authorization header or in
  ?access_token= gives hello.user = sub; forged (payload changed), alg none, wrong secret,
  expired, nbf in the future, malformed, without sub, sub over 256 bytes, missing, and a
  resume token instead are all unauthorized + close 1008.
- Origin: absent or equal to http://HOST accepted, another one refused with 403;
  --allow-origin adds origins (repeatable), `*` allows all.
"""

import json
import time

import harness
from harness import (Client, check, check_turn_done, context_command, history_pairs,
                     independent, step)

JWT_SECRET = "jwt-secret-for-the-e2e-tests"


async def say(client, app, mid, text, room, state=None, **extra):
    if state is not None:
        app.directives[mid] = state
    t = await client.message(text, mid=mid, room=room, **extra)
    check_turn_done(t)
    return t, await app.wait_message(mid)


async def refused(problems, url, what, **kwargs):
    """expect_unauthorized, collecting the failure in `problems` instead of raising."""
    try:
        await harness.expect_unauthorized(url, what, **kwargs)
    except harness.TestFailure as err:
        problems.append(str(err))


def header_client(gw, user):
    return Client.connect(gw, expect_user=user, extra_headers={"X-User-Id": user})


# --------------------------------------------------------------------------------------


async def two_users_same_room(app, rules, store_kind):
    redis = await harness.RedisServer().astart() if store_kind == "redis" else None
    store = redis.url if redis else "memory"
    config = harness.state_config({"app": harness.app_upstream(app, "/state")}, "app", store=store)
    args = ["--rules", rules, "--auth", "header", "--user-header", "X-User-Id"]
    try:
        async with harness.Gateway(args, config, name=f"gateway-header-{store_kind}") as gw:
            alice = await header_client(gw, "alice")
            bob = await header_client(gw, "bob")
            with step(f"[{store_kind}] alice and bob in room 'shared': nothing crosses"):
                await say(alice, app, "al1", "Find flights from Nairobi", "shared",
                          {"service": "travel", "params": {"from": "Nairobi"},
                           "awaiting": {"type": "confirmation", "options": [], "context": {"q": "book?"}, "ttl": 60},
                           "soft_context": {"last_action": "searched"}, "last_tool_result": [1, 2]})
                state = await context_command(bob, "context.get", "shared")
                check(state.get("params") in ({}, None) and not state.get("history") and state.get("service") is None
                      and state.get("awaiting") is None and state.get("soft_context") is None
                      and state.get("last_tool_result") is None,
                      f"bob's context.get of room 'shared' shows alice's state: {harness.brief(state)}")
                _, fb = await say(bob, app, "bo1", "Flights from Lagos", "shared",
                                  {"service": "travel", "params": {"from": "Lagos"}})
                check(fb.get("user") == "bob" and fb.get("params") == {} and fb.get("service") is None
                      and fb.get("history") == [] and fb.get("awaiting") is None and fb.get("soft_context") is None,
                      f"bob's forwarded frame carries alice's state: {harness.brief(fb)}")
                _, fa = await say(alice, app, "al2", "And the return?", "shared")
                check(fa.get("user") == "alice" and fa.get("params") == {"from": "Nairobi", "cabin_class": "economy"},
                      f"alice's params should be her own: {harness.brief(fa)}")
                check([c for _, c in history_pairs(fa.get("history"))][0::2] == ["Find flights from Nairobi"],
                      f"alice's history should hold only her own messages: {harness.brief(fa.get('history'))}")
            with step(f"[{store_kind}] a 'user' field in a frame is ignored"):
                _, fb2 = await say(bob, app, "bo2", "Who am I?", "shared", user="alice")
                check(fb2.get("user") == "bob" and fb2.get("params", {}).get("from") == "Lagos",
                      f"a message with \"user\":\"alice\" from bob's connection reached alice's dialog: "
                      f"{harness.brief(fb2)}")
                await bob.send({"type": "context.get", "room": "shared", "user": "alice"})
                frame = await bob.recv_type("context")
                params = (frame.get("state") or {}).get("params") or {}
                check(params.get("travel", {}).get("from") != "Nairobi",
                      f"context.get with \"user\":\"alice\" showed alice's state to bob: {harness.brief(frame)}")
            with step(f"[{store_kind}] bob's forget and clear touch only bob's dialog"):
                await context_command(bob, "context.forget", "shared", keys=["travel.from"])
                await context_command(bob, "context.clear", "shared")
                state = await context_command(alice, "context.get", "shared")
                check(state.get("params") == {"travel": {"from": "Nairobi"}} and len(state.get("history") or []) == 4,
                      f"alice's dialog changed by bob's forget/clear: {harness.brief(state)}")
            if redis:
                with step("[redis] the two dialogs have keys of their own"):
                    pa = redis.params_hash(harness.dialog_key("alice", "shared", "state"))
                    check(pa == {"travel.from": '"Nairobi"'}, f"alice's params (in her state): {pa}")
                    check(redis.type(harness.dialog_key("bob", "shared", "state")) == "none",
                          "bob's state hash should be gone after his clear")
            await alice.close()
            await bob.close()
    finally:
        if redis:
            redis.cleanup(keep=True)


async def two_anonymous_users(app, rules):
    config = harness.state_config({"app": harness.app_upstream(app, "/state")}, "app")
    async with harness.Gateway(["--rules", rules], config, name="gateway-none") as gw:
        with step("auth none: two connections are two users; nothing crosses in one room"):
            c1 = await Client.connect(gw)
            c2 = await Client.connect(gw)
            check(c1.hello["user"] != c2.hello["user"], f"two connections got the same user: {c1.hello} {c2.hello}")
            await say(c1, app, "n1", "Send 5000 to +254712345678", "lobby",
                      {"service": "payment", "params": {"amount": 5000}})
            _, f = await say(c2, app, "n2", "Send it", "lobby")
            check(f.get("params") == {} and f.get("history") == [] and f.get("user") == c2.hello["user"],
                  f"the second user sees the first one's dialog: {harness.brief(f)}")
            state = await context_command(c2, "context.get", "lobby")
            check(state.get("params") in ({}, None), f"context.get shows another user's params: {harness.brief(state)}")
            await c1.close()
            await c2.close()


HOSTILE = [("a:b", "c"), ("a", "b:c"), ("a}:{b", "room"), ("*", "room"), ("auth0|abc", "room"),
           ("ünï cødé", "room"), ("%41", "room"), ("A", "room"), ("plain", "x}y{z:*"),
           ("plain", "ünï cødé")]


def find_key(redis, user, room, part):
    """The dialog key, with upper- or lower-case percent escapes; None when absent."""
    return redis.find_key(harness.dialog_key(user, room, part))


async def hostile_ids(app, rules):
    redis = await harness.RedisServer().astart()
    config = harness.state_config({"app": harness.app_upstream(app, "/state")}, "app", store=redis.url)
    args = ["--rules", rules, "--auth", "header", "--user-header", "X-User-Id"]
    try:
        async with harness.Gateway(args, config, name="gateway-hostile") as gw:
            with step("hostile user and room ids: each dialog stays its own"):
                clients = {}
                for i, (user, room) in enumerate(HOSTILE):
                    if user not in clients:
                        clients[user] = await header_client(gw, user)
                    who = f"{user}|{room}"
                    await say(clients[user], app, f"h{i}", f"I am {who}", room,
                              {"service": "travel", "params": {"who": who}})
                problems = []
                for i, (user, room) in enumerate(HOSTILE):
                    who = f"{user}|{room}"
                    _, f = await say(clients[user], app, f"h{i}b", "again", room)
                    if f.get("user") != user or f.get("room") != room:
                        problems.append(f"forwarded user/room should be {user!r}/{room!r}: {harness.brief(f)}")
                    hist = [c for r, c in history_pairs(f.get("history")) if r == "user"]
                    if hist != [f"I am {who}"]:
                        problems.append(f"user {user!r} room {room!r}: forwarded history {hist}")
                    if f.get("params", {}).get("who") != who:
                        problems.append(f"user {user!r} room {room!r}: forwarded params {f.get('params')}")
                    state = await context_command(clients[user], "context.get", room)
                    if state.get("params") != {"travel": {"who": who}}:
                        problems.append(f"user {user!r} room {room!r}: context.get params "
                                        f"{harness.brief(state.get('params'))}")
                print(f"   {len(problems)} problem(s), reported after the Redis checks")
                isolation_problems = problems
            with step("hostile ids in Redis: escaped, one intact hash tag per key"):
                keys = redis.keys("chatgate:*")
                for key in keys:
                    check(key.count("{") == 1 and key.count("}") == 1 and key.index("{") < key.index("}"),
                          f"key with a broken hash tag: {key!r}")
                    inside = key[key.index("{") + 1:key.index("}")]
                    check(all(ch.isascii() and (ch.isalnum() or ch in "_.@|-%:") for ch in inside),
                          f"key with an unescaped byte in its hash tag: {key!r}")
                    check(":" not in inside,
                          f"a key whose tag holds more than the user (an unescaped ':'): {key!r}")
                for user, room in HOSTILE:
                    key = find_key(redis, user, room, "state")
                    check(key is not None, f"no state key for user {user!r} room {room!r} "
                                           f"(expected {harness.dialog_key(user, room, 'state')}); keys: {keys}")
                    got = redis.params_hash(key)
                    check({k: json.loads(v) for k, v in got.items()} == {"travel.who": f"{user}|{room}"},
                          f"{key} holds {got}")
                    hist = redis.lrange(redis.find_key(harness.dialog_key(user, room, "history")) or "none")
                    check(len(hist) == 4 and json.loads(hist[0]).get("content") == f"I am {user}|{room}",
                          f"history of user {user!r} room {room!r} in Redis: {hist}")
                    rooms = redis.find_key(harness.rooms_key(user))
                    check(rooms and redis.type(rooms) == "zset",
                          f"no rooms set {harness.rooms_key(user)} for user {user!r}; keys: {keys}")
                print(f"   {len(keys)} keys, e.g. {[k for k in keys if 'a%3A' in k or 'a%3a' in k][:3]}")
                for c in clients.values():
                    await c.close()
            with step("hostile ids: each user saw only its own state (forwarded frames, context.get)"):
                check(not isolation_problems, f"{len(isolation_problems)} problem(s):\n  " +
                      "\n  ".join(isolation_problems))
            with step("id lengths: a 256-byte user accepted; 300 bytes, empty, missing refused"):
                ok_user = "u" * 256
                c = await header_client(gw, ok_user)
                await say(c, app, "len1", "hello", "room")
                await c.close()
                problems = []
                await refused(problems, gw.url, "a 300-byte user id", extra_headers={"X-User-Id": "v" * 300})
                await refused(problems, gw.url, "a 257-byte user id (two-byte chars)",
                              extra_headers={"X-User-Id": "ü" * 128 + "x"})
                await refused(problems, gw.url, "no X-User-Id header")
                await refused(problems, gw.url, "an empty X-User-Id header", extra_headers={"X-User-Id": ""})
                check(not problems, f"{len(problems)} of 4 refusals wrong:\n  " + "\n  ".join(problems))
            with step("a room over 256 bytes is bad_frame (message and context.get); the connection stays"):
                c = await header_client(gw, "roomy")
                await c.send_message("hi", "long-room", "r" * 300)
                err = await c.expect_error("bad_frame")
                check(err.get("id") in ("long-room", None), f"bad_frame about the long room: {err}")
                await c.send({"type": "context.get", "room": "r" * 300})
                await c.expect_error("bad_frame")
                await say(c, app, "room256", "fine", "r" * 256)
                await c.check_alive()
                await c.close()
            gw.assert_alive()
    finally:
        redis.cleanup(keep=True)


async def resume_tokens(app, rules):
    config = harness.state_config({"app": harness.app_upstream(app, "/state")}, "app")
    env = {"CHATGATE_RESUME_SECRET": "resume-secret-one"}
    async with harness.Gateway(["--rules", rules], config, env=env, name="gateway-resume") as gw, \
            harness.Gateway(["--rules", rules], config, env={"CHATGATE_RESUME_SECRET": "another-secret"},
                            name="gateway-other-secret") as other:
        with step("resume token: same user and dialog on reconnect"):
            c1 = await Client.connect(gw)
            user, token = c1.hello["user"], c1.hello["resume"]
            check(isinstance(token, str) and len(token) >= 16, f"hello.resume should be a token: {c1.hello}")
            await say(c1, app, "rs1", "Flights from Nairobi", "trip",
                      {"service": "travel", "params": {"from": "Nairobi"}})
            await c1.close()
            c2 = await Client.connect(f"{gw.url}?resume={token}", expect_user=user)
            state = await context_command(c2, "context.get", "trip")
            check(state.get("params") == {"travel": {"from": "Nairobi"}},
                  f"the resumed user's dialog should be there: {harness.brief(state)}")
            _, f = await say(c2, app, "rs2", "and back?", "trip")
            check(f.get("user") == user and f.get("params", {}).get("from") == "Nairobi", harness.brief(f))
            token2 = c2.hello.get("resume")
            await c2.close()
            c3 = await Client.connect(f"{gw.url}?resume={token2}", expect_user=user)
            await c3.close()
        with step("bad resume tokens give a fresh user and a working connection"):
            body, _, sig = token.rpartition(".")
            # (Flip the first character: the last one of 43 carries 2 unused bits.)
            flipped = ("A" if sig[0] != "A" else "B") + sig[1:]
            bad = {"garbage": "not-a-token", "empty": "", "tampered signature": f"{body}.{flipped}",
                   "another user, same signature": f"u_victim.{sig}"}
            if user in token:
                bad["user changed"] = token.replace(user, user + "x", 1)
            for what, t in bad.items():
                c = await Client.connect(f"{gw.url}?resume={t}")
                check(c.hello["user"] != user, f"resume with a {what} token gave the original user")
                st = await context_command(c, "context.get", "trip")
                check(st.get("params") in ({}, None), f"{what} token: the fresh user sees the dialog: {st}")
                await c.check_alive()
                await c.close()
            c = await Client.connect(f"{other.url}?resume={token}")
            check(c.hello["user"] != user, "a token signed with another secret was accepted")
            await c.close()


def jwt_claims(sub="jwt-alice", **extra):
    now = int(time.time())
    claims = {"sub": sub, "iat": now, "exp": now + 600}
    claims.update(extra)
    return claims


async def jwt_mode(app, rules):
    config = harness.state_config({"app": harness.app_upstream(app, "/state")}, "app")
    env = {"CHATGATE_JWT_SECRET": JWT_SECRET}
    async with harness.Gateway(["--rules", rules, "--auth", "jwt"], config, env=env, name="gateway-jwt") as gw:
        good = harness.make_jwt(JWT_SECRET, jwt_claims())
        with step("JWT: good token in the Authorization header and in ?access_token="):
            c = await Client.connect(gw, expect_user="jwt-alice", extra_headers={"Authorization": f"Bearer {good}"})
            await say(c, app, "j1", "From Nairobi", "trip", {"service": "travel", "params": {"from": "Nairobi"}})
            await c.close()
            c = await Client.connect(f"{gw.url}?access_token={good}", expect_user="jwt-alice")
            _, f = await say(c, app, "j2", "again", "trip")
            check(f.get("user") == "jwt-alice" and f.get("params", {}).get("from") == "Nairobi",
                  f"the same sub should reach the same dialog: {harness.brief(f)}")
            await c.close()
        with step("JWT: forged, alg none, wrong secret, expired, nbf, malformed, no sub, missing: unauthorized + 1008"):
            now = int(time.time())
            head, payload, sig = good.split(".")
            forged_payload = harness.b64url(json.dumps(jwt_claims(sub="jwt-mallory")))
            bad = {
                "forged (payload changed, signature kept)": f"{head}.{forged_payload}.{sig}",
                "alg none": harness.make_jwt(JWT_SECRET, jwt_claims(), header={"alg": "none", "typ": "JWT"}, sign=False),
                "alg none with the signature": harness.make_jwt(JWT_SECRET, jwt_claims(), header={"alg": "none"}),
                "wrong secret": harness.make_jwt("not-the-secret", jwt_claims()),
                "expired": harness.make_jwt(JWT_SECRET, jwt_claims(exp=now - 3600, iat=now - 7200)),
                "nbf an hour ahead": harness.make_jwt(JWT_SECRET, jwt_claims(nbf=now + 3600)),
                "malformed (no dots)": "not-a-jwt",
                "malformed (two parts)": f"{head}.{payload}",
                "malformed (bad base64)": "!!!.@@@.###",
                "malformed (payload JSON not an object)": harness.make_jwt(JWT_SECRET, [1, 2, 3]),
                "malformed (payload not JSON)": harness.make_jwt(JWT_SECRET, "not json {", raw_payload=True),
                "no sub": harness.make_jwt(JWT_SECRET, {"exp": now + 600}),
                "sub over 256 bytes": harness.make_jwt(JWT_SECRET, jwt_claims(sub="s" * 300)),
                "signature truncated": good[:-4],
            }
            problems = []
            for what, token in bad.items():
                await refused(problems, gw.url, f"JWT {what} (header)",
                              extra_headers={"Authorization": f"Bearer {token}"})
            for what in ("forged (payload changed, signature kept)", "expired", "wrong secret"):
                await refused(problems, f"{gw.url}?access_token={bad[what]}", f"JWT {what} (query)")
            await refused(problems, gw.url, "no token at all")
            await refused(problems, gw.url, "Authorization without Bearer", extra_headers={"Authorization": good})
            check(not problems, f"{len(problems)} of {len(bad) + 5} refusals wrong:\n  " + "\n  ".join(problems))
        with step("JWT mode: a resume token is no way in"):
            async with harness.Gateway(["--rules", rules], config, name="gateway-none-for-token") as g2:
                c = await Client.connect(g2)
                token = c.hello["resume"]
                await c.close()
            problems = []
            await refused(problems, f"{gw.url}?resume={token}", "a resume token in jwt mode")
            check(not problems, problems[0] if problems else "")
        gw.assert_alive()


async def origin_check(rules):
    config = harness.make_config({"demo": harness.demo_upstream(0)}, "demo")
    async with harness.Gateway(["--rules", rules], config, name="gateway-origin") as gw:
        with step("Origin: absent or the gateway's own host accepted, others 403"):
            own = f"http://127.0.0.1:{gw.port}"
            cases = [(None, 101), (own, 101), ("http://evil.example", 403), ("null", 403),
                     (f"http://127.0.0.1:{gw.port + 1}", 403), (f"http://127.0.0.1:{gw.port}.evil.example", 403)]
            for origin, want in cases:
                got = await harness.handshake_status(gw.url, origin=origin)
                check(got == want, f"Origin {origin!r}: expected {want}, got {got}")
    async with harness.Gateway(["--rules", rules, "--allow-origin", "https://app.example",
                                "--allow-origin", "https://two.example"], config, name="gateway-origin-allow") as gw:
        with step("--allow-origin (twice): those and the own host accepted, others 403"):
            for origin, want in [("https://app.example", 101), ("https://two.example", 101),
                                 (f"http://127.0.0.1:{gw.port}", 101), ("https://evil.example", 403),
                                 ("https://app.example.evil.example", 403)]:
                got = await harness.handshake_status(gw.url, origin=origin)
                check(got == want, f"Origin {origin!r}: expected {want}, got {got}")
    async with harness.Gateway(["--rules", rules, "--allow-origin", "*"], config, name="gateway-origin-any") as gw:
        with step("--allow-origin '*': any origin accepted"):
            got = await harness.handshake_status(gw.url, origin="https://evil.example")
            check(got == 101, f"with --allow-origin '*' Origin https://evil.example got {got}")


async def main(args):
    rules = harness.empty_rules_dir()
    async with harness.FakeApp() as app:
        await independent(two_users_same_room(app, rules, "memory"))
        await independent(two_users_same_room(app, rules, "redis"))
        await independent(two_anonymous_users(app, rules))
        await independent(hostile_ids(app, rules))
        await independent(resume_tokens(app, rules))
        await independent(jwt_mode(app, rules))
        await independent(origin_check(rules))


if __name__ == "__main__":
    harness.run(main, timeout=100)
