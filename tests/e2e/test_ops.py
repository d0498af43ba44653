"""End-to-end test of the operations side (issue 5, items 3 to 6; docs/operations.md).

- /healthz: 200 {"status":"ok"}; 200 {"status":"degraded",...} with a Redis that is not there
  (never started, or killed under a running gateway), ok again once it is back; 503
  {"status":"stopping"} from SIGTERM until the exit.
- /metrics, parsed as Prometheus text: after a scripted conversation through the shipped
  rules and the demo upstream (CHATGATE_NOW fixed: a flight search, "What's the weather in
  Tokyo?", "And tomorrow?", a frame that is not JSON, a cancel of an unknown id,
  "nevermind" with no reply running) the exact counts of messages, turns, enrichments,
  cancels, errors by code, frames in and out, routes, cache hits and misses, connections,
  rules fired, and the stage histograms (count = the messages that reached the stage,
  cumulative buckets, +Inf = count); upstream errors per upstream (an upstream on a closed
  port); awaiting resolutions and soft context hits through the state app.
- Admin API (CHATGATE_ADMIN_TOKEN, --auth header with ids like "auth0|abc" and "a:b",
  percent-encoded in paths): view a dialog (the same state as context.get), delete a
  dialog, forget a user (every room, other users untouched), reload rules (200 {"rules":N};
  422 {"error":"file:line: ..."} for a broken set, which stays out); 401 without or with a
  wrong token; 404 everywhere under /admin when no token is configured; --admin-listen puts
  it on its own port only; one POST /admin/reload is one reload (metrics). Ids with "/", "%",
  "+" address exactly their own dialog (a user id with "/" through the query form of docs/operations.md
  /admin/dialogs?user=..&room=..). With Redis: no key of a forgotten user is left, through
  the user's rooms set and without SCAN/KEYS; a delete while Redis is away answers 503.
- Logs also carry an sk- key, a bearer token and an access_token= URL parameter quoted by
  the upstream: masked too.
- Logs: a conversation with a phone number, an e-mail address, JWTs (?access_token= and
  Authorization) and a bad JWT, with upstreams whose errors quote the user's words: the log
  holds none of them, and [phone], [email], [token] instead; --log-format json gives one
  JSON object {ts, level, pid, msg} per line.
- Lifecycle: SIGTERM with a reply in flight (the reply ends with done, new handshakes get
  503, exit 0 within shutdown_timeout_s + 2; with Redis the turn is saved); a reply longer
  than --shutdown-timeout-s is cut and the process still exits 0 in time; a second SIGTERM
  stops at once; pings: a client that answers them (the websockets library does) stays
  connected while idle, a raw client that never answers sees a ping and is dropped after
  idle_timeout_s, and one that never answers but sends a frame every second stays (any
  frame is a sign of life, core/keepalive.h); chatgate_ws_idle_hangups_total counts the one
  dropped.
"""

import asyncio
import base64
import json
import os
import re
import shutil
import signal
import time

import websockets

import harness
from harness import (Client, brief, check, context_command, fail, independent, make_jwt, step)

NOW = "2026-02-03T10:00:00Z"
SHIPPED = harness.REPO_ROOT / "rules"
TOKEN = "admin-secret-token-1234"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
FLIGHTS = "Find me flights from Nairobi to London next week"
FLIGHT_PARAMS = {"from": "Nairobi", "to": "London", "departure_date": "2026-02-10"}
PHONE = "+254712345678"
EMAIL = "jane.doe@example.com"
JWT_SECRET = "jwt-test-secret-for-ops"
SK_KEY = "sk-proj-Q7vX2mZ9kL4pR8tW1yB6nC3dF5gH0jKs"
BEARER = "b7f3c91e4a2d58f06e1b9c7a3d5f2e8c"
OPAQUE = "Zq8rT2mWvX4yB7nKp3LdE6sA"
STAGES = ("store_load", "rules", "first_token", "turn")


def cfg(upstreams, default, **extra):
    extra.setdefault("rate_limit", {"messages_per_second": 1000, "burst": 1000})
    return harness.make_config(upstreams, default, **extra)


async def http(url, method="GET", headers=None, body=None):
    """(status, parsed JSON body or the raw text, headers)."""
    status, hdrs, raw = await asyncio.to_thread(harness.http_request, url, method, headers, body)
    text = raw.decode("utf-8", "replace")
    try:
        parsed = json.loads(text) if text.strip() else None
    except ValueError:
        parsed = text
    return status, parsed, {k.lower(): v for k, v in hdrs.items()}


async def healthz(gw):
    return await http(gw.http_url + "/healthz")


async def metrics(gw):
    status, _, raw = await asyncio.to_thread(harness.http_get, gw.http_url + "/metrics")
    check(status == 200, f"GET /metrics: {status} {raw[:200]!r}")
    m = harness.parse_metrics(raw.decode())
    for (name, _labels) in m.samples:
        check(m.family(name) is not None, f"/metrics: sample {name} has no # TYPE line")
    return m


def expect_value(m, name, want, **labels):
    got = m.value(name, **labels)
    check(got == want, f"{name}{labels or ''} should be {want}, got {got:g}")


def check_histograms(m, counts):
    """chatgate_stage_seconds per stage: buckets cumulative, +Inf == _count == counts[stage]."""
    check(m.types.get("chatgate_stage_seconds") == "histogram",
          f"chatgate_stage_seconds should be TYPE histogram, is {m.types.get('chatgate_stage_seconds')}")
    for stage, want in counts.items():
        buckets, total, count = m.histogram("chatgate_stage_seconds", stage=stage)
        check(len(buckets) >= 2, f"stage {stage}: too few buckets: {buckets}")
        check(buckets[-1][0] == float("inf"), f"stage {stage}: no le=\"+Inf\" bucket: {buckets}")
        for (le1, c1), (le2, c2) in zip(buckets, buckets[1:]):
            check(c2 >= c1, f"stage {stage}: bucket le={le2} ({c2:g}) < le={le1} ({c1:g}): not cumulative")
        check(buckets[-1][1] == count, f"stage {stage}: le=+Inf {buckets[-1][1]:g} != _count {count:g}")
        check(count == want, f"stage {stage}: _count should be {want} (messages that reached it), got {count:g}")
        check(total >= 0, f"stage {stage}: negative _sum {total}")


async def wait_port(port, timeout=10.0):
    def accepts():
        import socket
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return True
        except OSError:
            return False
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(accepts):
        if time.monotonic() > deadline:
            fail(f"nothing accepts connections on port {port} within {timeout}s")
        await asyncio.sleep(0.05)


def esc(ident):
    """Percent-encoding of an id for an admin path (everything but unreserved characters)."""
    from urllib.parse import quote
    return quote(ident, safe="")


def user_keys(redis, user, prefix="chatgate"):
    """Every key of `user`: its dialogs' keys and its rooms set (either case of hex digits)."""
    e = harness.escape_id(user)
    variants = {e, re.sub(r"%[0-9A-F]{2}", lambda x: x.group(0).lower(), e)}
    found = []
    for key in redis.keys(f"{prefix}:*"):
        for v in variants:
            if key.startswith(f"{prefix}:{{{v}}}:"):  # every key of a user has the user's hash tag
                found.append(key)
    return sorted(set(found))


# --------------------------------------------------------------------------------------
# /healthz


async def part_healthz_degraded():
    with step("healthz: a Redis that was never there gives 200 degraded"):
        port = harness.free_port()
        async with harness.Gateway(["--store", f"redis://127.0.0.1:{port}"], cfg({"demo": "demo"}, "demo"),
                                   name="gateway-noredis") as gw:
            status, body = None, None
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                status, body, _ = await healthz(gw)
                if isinstance(body, dict) and body.get("status") == "degraded":
                    break
                await asyncio.sleep(0.1)
            check(status == 200 and isinstance(body, dict) and body.get("status") == "degraded",
                  f"/healthz with no Redis: expected 200 degraded, got {status} {brief(body)}")
            check("store" in body, f"/healthz degraded should say what about the store (docs/architecture.md, Operations): {brief(body)}")
    with step("healthz: ok with Redis, degraded (200) after Redis is killed, ok once it is back"):
        redis = await harness.RedisServer().astart()
        try:
            args = ["--store", redis.url, "--auth", "header"]
            async with harness.Gateway(args, cfg({"demo": "demo"}, "demo"), name="gateway-redis-health") as gw:
                status, body, hdrs = await healthz(gw)
                check(status == 200 and body == {"status": "ok"}, f"/healthz with Redis up: {status} {brief(body)}")
                check(hdrs.get("content-type", "").startswith("application/json"),
                      f"/healthz content type: {hdrs.get('content-type')}")
                redis.kill()
                c = await Client.connect(gw, expect_user="hz", extra_headers={"X-User-Id": "hz"})
                t = await c.message("hello while redis is away", mid="h1", room="r")
                t.expect_done()
                check([w.get("code") for w in t.warnings] == ["store_degraded"],
                      f"a message while Redis is away should get one store_degraded warning: {t.describe()}")
                status, body, _ = await healthz(gw)
                check(status == 200 and isinstance(body, dict) and body.get("status") == "degraded",
                      f"/healthz after Redis was killed: expected 200 degraded, got {status} {brief(body)}")
                m = await metrics(gw)
                expect_value(m, "chatgate_store_degraded", 1)
                await redis.astart()
                deadline = time.monotonic() + 10
                while True:
                    status, body, _ = await healthz(gw)
                    if body == {"status": "ok"} or time.monotonic() > deadline:
                        break
                    await asyncio.sleep(0.1)
                check(status == 200 and body == {"status": "ok"},
                      f"/healthz 10 s after Redis came back: {status} {brief(body)}")
                await c.close()
        finally:
            redis.cleanup(keep=True)


# --------------------------------------------------------------------------------------
# /metrics


async def part_metrics_conversation():
    config = cfg({"demo": harness.demo_upstream(0)}, "demo")
    env = {"CHATGATE_NOW": NOW}
    async with harness.Gateway(["--rules", SHIPPED], config, env=env, name="gateway-metrics") as gw:
        with step("healthz ok, metrics at zero"):
            status, body, _ = await healthz(gw)
            check(status == 200 and body == {"status": "ok"}, f"/healthz: {status} {brief(body)}")
            m0 = await metrics(gw)
            expect_value(m0, "chatgate_messages_total", 0)
            expect_value(m0, "chatgate_connections", 0)
            check_histograms(m0, {s: 0 for s in STAGES})
        with step("metrics: a scripted conversation gives exact counts"):
            c = await Client.connect(gw)
            turns = [await c.message(FLIGHTS, mid="m1", room="trip"),
                     await c.message("What's the weather in Tokyo?", mid="m2", room="weather"),
                     await c.message("And tomorrow?", mid="m3", room="weather")]
            for t in turns:
                t.expect_done()
            check(turns[0].ack.get("params") == FLIGHT_PARAMS, f"flight params: {brief(turns[0].ack)}")
            check(turns[2].ack.get("enriched") == "What's the weather in Tokyo tomorrow?",
                  f"'And tomorrow?' should be enriched: {brief(turns[2].ack)}")
            await c.send_raw("not json")
            await c.expect_error("bad_frame", mid=None)
            await c.cancel("no-such-id")
            await c.expect_error("not_found", mid="no-such-id")
            t4 = await c.message("nevermind", mid="m4", room="trip")
            t4.expect_done()
            check(t4.ack.get("resolution") == {"type": "cancel"}, f"'nevermind' should be a cancel: {brief(t4.ack)}")
            turns.append(t4)
            fired = sum(len(t.ack.get("rules") or []) for t in turns)

            m = await metrics(gw)
            expect_value(m, "chatgate_connections", 1)
            expect_value(m, "chatgate_messages_total", 4)
            expect_value(m, "chatgate_turns_total", 4, end="done")
            expect_value(m, "chatgate_turns_total", 0, end="error")
            expect_value(m, "chatgate_turns_total", 0, end="cancelled")
            expect_value(m, "chatgate_enrichments_total", 1)
            expect_value(m, "chatgate_cancels_total", 1)
            expect_value(m, "chatgate_errors_total", 1, code="bad_frame")
            expect_value(m, "chatgate_errors_total", 1, code="not_found")
            for (labels, v) in m.series("chatgate_errors_total").items():
                if dict(labels).get("code") not in ("bad_frame", "not_found"):
                    check(v == 0, f"chatgate_errors_total{dict(labels)} should be 0, got {v:g}")
            expect_value(m, "chatgate_bad_frames_total", 1)
            expect_value(m, "chatgate_frames_in_total", 6)  # 4 messages, the bad frame, the cancel
            expect_value(m, "chatgate_frames_out_total", len(c.received))  # hello included
            expect_value(m, "chatgate_routed_total", 4, upstream="demo")
            expect_value(m, "chatgate_upstream_errors_total", 0, upstream="demo")
            expect_value(m, "chatgate_cache_total", 2, result="miss")  # trip, weather: new
            expect_value(m, "chatgate_cache_total", 2, result="hit")   # tomorrow, nevermind
            expect_value(m, "chatgate_awaiting_resolutions_total", 0)
            check(m.value("chatgate_rules_fired_total") > 0, "chatgate_rules_fired_total should be > 0")
            expect_value(m, "chatgate_rules_fired_total", fired)  # the rules the acks name
            check(m.value("chatgate_rules_loaded") > 0, "chatgate_rules_loaded should be > 0")
            for name in ("chatgate_messages_total", "chatgate_turns_total", "chatgate_cancels_total",
                         "chatgate_frames_in_total", "chatgate_routed_total", "chatgate_errors_total"):
                check(m.types.get(name) == "counter", f"{name} should be TYPE counter, is {m.types.get(name)}")
            check(m.types.get("chatgate_connections") == "gauge", "chatgate_connections should be a gauge")
            check_histograms(m, {s: 4 for s in STAGES})
            await c.close()
            deadline = time.monotonic() + 5
            while True:
                m = await metrics(gw)
                if m.value("chatgate_connections") == 0 or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.05)
            expect_value(m, "chatgate_connections", 0)


async def part_metrics_upstream_errors():
    dead = f"http://127.0.0.1:{harness.free_port()}/v1"
    upstreams = {"demo": harness.demo_upstream(0),
                 "dead": {"url": dead, "connect_timeout_ms": 2000, "first_byte_timeout_ms": 2000,
                          "idle_timeout_ms": 2000}}
    async with harness.Gateway(["--rules", SHIPPED], cfg(upstreams, "dead"), env={"CHATGATE_NOW": NOW},
                               name="gateway-deadupstream") as gw:
        with step("metrics: an upstream on a closed port counts upstream errors for that upstream"):
            c = await Client.connect(gw)
            t = await c.message("hello there", mid="e1", room="r")
            t.expect_error("upstream_unavailable")
            t = await c.message("hello again", mid="e2", room="r")
            t.expect_error("upstream_unavailable")
            m = await metrics(gw)
            expect_value(m, "chatgate_upstream_errors_total", 2, upstream="dead")
            expect_value(m, "chatgate_upstream_errors_total", 0, upstream="demo")
            expect_value(m, "chatgate_errors_total", 2, code="upstream_unavailable")
            expect_value(m, "chatgate_turns_total", 2, end="error")
            expect_value(m, "chatgate_turns_total", 0, end="done")
            expect_value(m, "chatgate_routed_total", 2, upstream="dead")
            expect_value(m, "chatgate_routed_total", 0, upstream="demo")
            expect_value(m, "chatgate_messages_total", 2)
            check_histograms(m, {"store_load": 2, "rules": 2, "first_token": 0, "turn": 2})
            await c.close()


async def part_metrics_awaiting(app):
    async with harness.Gateway(["--rules", SHIPPED], cfg({"app": harness.app_upstream(app, "/state")}, "app"),
                               env={"CHATGATE_NOW": NOW}, name="gateway-awaiting") as gw:
        with step("metrics: an awaited selection resolved counts an awaiting resolution; soft context hits"):
            c = await Client.connect(gw)
            options = [{"name": "Shake Shack", "district": "Shibuya"}, {"name": "Ichiran", "district": "Shinjuku"}]
            app.directives["a1"] = {"awaiting": {"type": "selection", "options": options,
                                                 "context": {"selection_type": "venue"}, "ttl": 60},
                                    "soft_context": {"last_action": "listed_venues"}}
            t1 = await c.message("Where can I eat in Tokyo?", mid="a1", room="food")
            harness.check_turn_done(t1)
            t2 = await c.message("2", mid="a2", room="food")
            harness.check_turn_done(t2)
            res = t2.ack.get("resolution") or {}
            check(res.get("type") == "selection" and res.get("index") == 2 and res.get("option") == options[1],
                  f"'2' should resolve the awaited selection (index 2): {brief(t2.ack)}")
            t3 = await c.message("Tell me more about it", mid="a3", room="food")
            harness.check_turn_done(t3)
            check(t3.ack.get("resolution") is None, f"a3 resolves nothing: {brief(t3.ack)}")
            fwd = [await app.wait_message(mid) for mid in ("a1", "a2", "a3")]
            check(fwd[1].get("soft_context") and fwd[2].get("soft_context"),
                  f"the fresh soft context should go along with a2 and a3: {brief(fwd[1])} {brief(fwd[2])}")
            # docs/state.md, Soft context: a hit is counted when no awaiting state resolved
            # the message; so a3 is a hit and a2 (a resolution) is not.
            m = await metrics(gw)
            expect_value(m, "chatgate_awaiting_resolutions_total", 1)
            expect_value(m, "chatgate_soft_context_hits_total", 1)
            expect_value(m, "chatgate_routed_total", 3, upstream="app")
            expect_value(m, "chatgate_messages_total", 3)
            expect_value(m, "chatgate_turns_total", 3, end="done")
            check_histograms(m, {s: 3 for s in STAGES})
            await c.close()


# --------------------------------------------------------------------------------------
# Admin API


async def say(client, mid, text, room):
    t = await client.message(text, mid=mid, room=room)
    t.expect_done()
    return t


async def connect_as(gw, user):
    return await Client.connect(gw, expect_user=user, extra_headers={"X-User-Id": user})


async def admin_get(base, user, room, headers=AUTH):
    return await http(f"{base}/admin/dialogs/{esc(user)}/{esc(room)}", "GET", headers)


def check_found(status, body, user, room, found, what):
    check(status == 200 and isinstance(body, dict),
          f"{what}: GET /admin/dialogs/{esc(user)}/{esc(room)} should be 200 JSON, got {status} {brief(body)}")
    check(body.get("user") == user and body.get("room") == room,
          f"{what}: the answer should name user {user!r} room {room!r}: {brief(body)}")
    check(body.get("found") is found, f"{what}: found should be {found}: {brief(body)}")
    check(body.get("degraded") is False, f"{what}: degraded should be false: {brief(body)}")
    check(isinstance(body.get("state"), dict), f"{what}: state should be an object: {brief(body)}")


async def check_unauthorized(base, what):
    cases = [("no Authorization", {}), ("a wrong token", {"Authorization": "Bearer wrong-token"}),
             ("the token without Bearer", {"Authorization": TOKEN}),
             ("a longer token", {"Authorization": f"Bearer {TOKEN}x"}),
             ("a prefix of the token", {"Authorization": f"Bearer {TOKEN[:-1]}"})]
    for label, headers in cases:
        for method, path in (("GET", "/admin/dialogs/auth0%7Cabc/trip"), ("DELETE", "/admin/dialogs/auth0%7Cabc/trip"),
                             ("DELETE", "/admin/users/auth0%7Cabc"), ("POST", "/admin/reload")):
            status, body, _ = await http(base + path, method, headers)
            check(status == 401, f"{what}: {method} {path} with {label} should be 401, got {status} {brief(body)}")


async def part_admin_memory():
    env = {"CHATGATE_NOW": NOW, "CHATGATE_ADMIN_TOKEN": TOKEN}
    args = ["--rules", SHIPPED, "--auth", "header", "--user-header", "X-User-Id"]
    async with harness.Gateway(args, cfg({"demo": harness.demo_upstream(0)}, "demo"), env=env,
                               name="gateway-admin") as gw:
        base = gw.http_url
        odd_room = "x y?#é+&=:"  # ("/" and "%" in ids: part_admin_path_ids)
        with step("admin: dialogs of auth0|abc (two rooms), a:b and auth0|abcd"):
            ca = await connect_as(gw, "auth0|abc")
            await say(ca, "a1", FLIGHTS, "trip")
            await say(ca, "a2", "What's the weather in Tokyo?", odd_room)
            cb = await connect_as(gw, "a:b")
            await say(cb, "b1", FLIGHTS, "trip")
            cd = await connect_as(gw, "auth0|abcd")
            await say(cd, "d1", "Hello", "trip")
        with step("admin: GET /admin/dialogs/{user}/{room} is the dialog's context state"):
            for client, user, room in ((ca, "auth0|abc", "trip"), (ca, "auth0|abc", odd_room),
                                       (cb, "a:b", "trip"), (cd, "auth0|abcd", "trip")):
                state = await context_command(client, "context.get", room)
                status, body, hdrs = await admin_get(base, user, room)
                check_found(status, body, user, room, True, f"view {user}/{room}")
                check(hdrs.get("content-type", "").startswith("application/json"),
                      f"admin content type: {hdrs.get('content-type')}")
                check(body["state"] == state, f"admin view of {user}/{room} differs from context.get:\n"
                      f"  admin:   {brief(body['state'], 600)}\n  context: {brief(state, 600)}")
            check(body["state"].get("history") and body["state"]["history"][0]["content"] == "Hello",
                  f"auth0|abcd's history: {brief(body['state'])}")
            status, body, _ = await admin_get(base, "a:b", "trip")
            check(body["state"].get("service") == "travel"
                  and body["state"].get("params") == {"travel": FLIGHT_PARAMS},
                  f"a:b's trip should hold the travel params: {brief(body)}")
            status, body, _ = await admin_get(base, "nobody", "trip")
            check_found(status, body, "nobody", "trip", False, "view of an unknown dialog")
        with step("admin: 401 without the token or with a wrong one (and nothing deleted)"):
            await check_unauthorized(base, "main listener")
            status, body, _ = await admin_get(base, "auth0|abc", "trip")
            check_found(status, body, "auth0|abc", "trip", True, "after the refused deletes")
        with step("admin: DELETE /admin/dialogs/{user}/{room} deletes that dialog only"):
            status, body, _ = await http(f"{base}/admin/dialogs/{esc('auth0|abc')}/{esc(odd_room)}", "DELETE", AUTH)
            check(status == 200, f"DELETE dialog: {status} {brief(body)}")
            status, body, _ = await admin_get(base, "auth0|abc", odd_room)
            check_found(status, body, "auth0|abc", odd_room, False, "after DELETE of that dialog")
            status, body, _ = await admin_get(base, "auth0|abc", "trip")
            check_found(status, body, "auth0|abc", "trip", True, "the user's other room after DELETE of one")
            state = await context_command(ca, "context.get", odd_room)
            check(not state.get("history") and not state.get("service"),
                  f"context.get after the admin deleted the dialog should be empty: {brief(state)}")
        with step("admin: DELETE /admin/users/{user} forgets every room; other users stay"):
            await say(ca, "a3", "And tomorrow?", "third room")
            status, body, _ = await http(f"{base}/admin/users/{esc('auth0|abc')}", "DELETE", AUTH)
            check(status == 200, f"DELETE user: {status} {brief(body)}")
            for room in ("trip", odd_room, "third room"):
                status, body, _ = await admin_get(base, "auth0|abc", room)
                check_found(status, body, "auth0|abc", room, False, f"room {room!r} after DELETE user")
                state = await context_command(ca, "context.get", room)
                check(not state.get("history") and not state.get("service") and not state.get("params"),
                      f"context.get of {room!r} after the user was forgotten should be empty: {brief(state)}")
            for user in ("a:b", "auth0|abcd"):
                status, body, _ = await admin_get(base, user, "trip")
                check_found(status, body, user, "trip", True, f"{user} after auth0|abc was forgotten")
            status, body, _ = await http(f"{base}/admin/dialogs/{esc('a:b')}/trip", "DELETE", AUTH)
            check(status == 200, f"DELETE a:b/trip: {status} {brief(body)}")
            status, body, _ = await admin_get(base, "a:b", "trip")
            check_found(status, body, "a:b", "trip", False, "a:b/trip after its DELETE")
            status, body, _ = await admin_get(base, "auth0|abcd", "trip")
            check_found(status, body, "auth0|abcd", "trip", True, "auth0|abcd after a:b's delete")
        with step("admin: POST /admin/reload -> 200 {\"rules\": N}"):
            status, body, _ = await http(f"{base}/admin/reload", "POST", AUTH)
            m = await metrics(gw)
            n = m.value("chatgate_rules_loaded")
            check(status == 200 and isinstance(body, dict) and body.get("rules") == n and n > 0,
                  f"POST /admin/reload: expected 200 {{\"rules\": {n:g}}}, got {status} {brief(body)}")
            got = m.value("chatgate_rules_reloads_total", result="ok")
            check(got == 1, f"one POST /admin/reload (urllib: Content-Length: 0) should count one reload, "
                  f"chatgate_rules_reloads_total{{result=\"ok\"}} is {got:g} (see the log's 'reloaded' lines)")
            t = await say(cd, "d2", FLIGHTS, "trip2")
            check(t.ack.get("params") == FLIGHT_PARAMS, f"rules after the reload: {brief(t.ack)}")
        for c in (ca, cb, cd):
            await c.close()


def dialog_path(user, room):
    """The admin path of a dialog: /admin/dialogs/{user}/{room}, or the query form docs/operations.md
    gives for an id holding a "/" (libwebsockets decodes the path before the split, so the
    path form refuses a "/" inside an id rather than guess)."""
    if "/" in user or "/" in room:
        return f"/admin/dialogs?user={esc(user)}&room={esc(room)}"
    return f"/admin/dialogs/{esc(user)}/{esc(room)}"


def user_path(user):
    return f"/admin/users?user={esc(user)}" if "/" in user else f"/admin/users/{esc(user)}"


async def part_admin_path_ids():
    """Ids with "/", "%" and "+" (legal user and room ids), percent-encoded: each request
    must address exactly its own dialog (a user id with "/" through the query form)."""
    env = {"CHATGATE_ADMIN_TOKEN": TOKEN}
    async with harness.Gateway(["--auth", "header"], cfg({"demo": harness.demo_upstream(0)}, "demo"), env=env,
                               name="gateway-admin-ids") as gw:
        dialogs = [("a", "r"), ("a", "b/r"), ("a/b", "r"), ("x%y", "r"), ("p+q", "r"), ("p q", "r"),
                   ("a", "100%"), ("a", "1+1")]
        with step("admin ids: dialogs of users a, a/b, x%y, p+q, p q (rooms with / % +)"):
            clients = {}
            for i, (user, room) in enumerate(dialogs):
                if user not in clients:
                    clients[user] = await connect_as(gw, user)
                await say(clients[user], f"m{i}", f"I am {user} in {room}", room)
        problems = []  # every id is checked, then one failure lists what went wrong
        with step("admin ids: GET /admin/dialogs/{user}/{room} of each addresses exactly that dialog"):
            requests = [(user, room, dialog_path(user, room)) for user, room in dialogs]
            requests.append(("a", "r", "/admin/dialogs?user=a&room=r"))  # the query form for plain ids too
            # the path form with a "/" inside an id is refused, never read as another dialog
            for path in (f"/admin/dialogs/a/{esc('b/r')}", f"/admin/dialogs/{esc('a/b')}/r"):
                status, body, _ = await http(gw.http_url + path, "GET", AUTH)
                if status != 400:
                    problems.append(f"GET {path}: an id with '/' in the path form should be 400, got {status} "
                                    f"{brief(body, 120)}")
            for user, room, path in requests:
                status, body, _ = await http(gw.http_url + path, "GET", AUTH)
                if status != 200 or not isinstance(body, dict):
                    problems.append(f"GET {path}: expected 200, got {status} {brief(body, 120)}")
                    continue
                if body.get("user") != user or body.get("room") != room:
                    problems.append(f"GET {path} answered for user {body.get('user')!r} room {body.get('room')!r} "
                                    f"(found {body.get('found')}) instead of {user!r} {room!r}")
                    continue
                hist = (body.get("state") or {}).get("history") or []
                if body.get("found") is not True or not hist or hist[0].get("content") != f"I am {user} in {room}":
                    problems.append(f"GET {path}: not its own dialog: {brief(body, 200)}")
            print(f"   {len(requests) - len(problems)} of {len(requests)} requests addressed their dialog", flush=True)
        forgotten_so_far = set()
        for forgotten in ("a/b", "x%y"):
            forgotten_so_far.add(forgotten)
            with step(f"admin ids: DELETE {user_path(forgotten)} forgets {forgotten!r} only"):
                status, body, _ = await http(gw.http_url + user_path(forgotten), "DELETE", AUTH)
                if status != 200:
                    problems.append(f"DELETE {user_path(forgotten)}: expected 200, got {status} {brief(body, 120)}")
                for user, room in dialogs:
                    # what the gateway itself says (context.get on the user's own connection)
                    state = await context_command(clients[user], "context.get", room)
                    gone = not state.get("history")
                    if gone != (user in forgotten_so_far):
                        problems.append(f"after DELETE {user_path(forgotten)}: {user!r}/{room!r} is "
                                        f"{'gone' if gone else 'still there'} (context.get)")
        with step("admin ids: DELETE /admin/dialogs of a room with '/' and of a user with '/'"):
            await say(clients["a/b"], "n1", "back again", "r")
            for user, room in (("a", "b/r"), ("a/b", "r")):
                status, body, _ = await http(gw.http_url + dialog_path(user, room), "DELETE", AUTH)
                if status != 200:
                    problems.append(f"DELETE {dialog_path(user, room)}: expected 200, got {status} {brief(body, 120)}")
            for user, room in dialogs:
                state = await context_command(clients[user], "context.get", room)
                gone = not state.get("history")
                if gone != ((user, room) in (("a", "b/r"), ("a/b", "r"), ("x%y", "r"))):
                    problems.append(f"after the two dialog DELETEs: {user!r}/{room!r} is "
                                    f"{'gone' if gone else 'still there'} (context.get)")
        check(not problems, "admin paths with percent-encoded ids:\n  " + "\n  ".join(problems))
        for c in clients.values():
            await c.close()


async def part_admin_absent():
    async with harness.Gateway([], cfg({"demo": "demo"}, "demo"), name="gateway-noadmin") as gw:
        with step("admin: no CHATGATE_ADMIN_TOKEN -> 404 for every /admin path"):
            for headers in ({}, AUTH):
                for method, path in (("GET", "/admin/dialogs/u/r"), ("DELETE", "/admin/dialogs/u/r"),
                                     ("DELETE", "/admin/users/u"), ("POST", "/admin/reload"),
                                     ("GET", "/admin/"), ("GET", "/admin")):
                    status, body, _ = await http(gw.http_url + path, method, headers)
                    check(status == 404, f"{method} {path} (headers {list(headers)}) without a configured "
                          f"token should be 404, got {status} {brief(body)}")
            status, body, _ = await healthz(gw)
            check(status == 200, f"/healthz: {status}")


async def part_admin_listener():
    port2 = harness.free_port()
    env = {"CHATGATE_ADMIN_TOKEN": TOKEN}
    args = ["--admin-listen", f"127.0.0.1:{port2}", "--auth", "header"]
    async with harness.Gateway(args, cfg({"demo": harness.demo_upstream(0)}, "demo"), env=env,
                               name="gateway-adminlisten") as gw:
        with step("admin: --admin-listen serves the API on its own port, 404 on the main one"):
            await wait_port(port2)
            admin = f"http://127.0.0.1:{port2}"
            c = await connect_as(gw, "auth0|abc")
            await say(c, "x1", "hello", "trip")
            status, body, _ = await admin_get(admin, "auth0|abc", "trip")
            check_found(status, body, "auth0|abc", "trip", True, "view on the admin port")
            for method, path in (("GET", "/admin/dialogs/auth0%7Cabc/trip"), ("DELETE", "/admin/dialogs/auth0%7Cabc/trip"),
                                 ("DELETE", "/admin/users/auth0%7Cabc"), ("POST", "/admin/reload")):
                status, body, _ = await http(gw.http_url + path, method, AUTH)
                check(status == 404, f"{method} {path} on the main port with --admin-listen should be 404, "
                      f"got {status} {brief(body)}")
            status, body, _ = await admin_get(admin, "auth0|abc", "trip")
            check_found(status, body, "auth0|abc", "trip", True, "after the main port's refused DELETEs")
            await check_unauthorized(admin, "admin port")
            status, body, _ = await http(f"{admin}/admin/reload", "POST", AUTH)
            check(status == 200 and isinstance(body, dict) and isinstance(body.get("rules"), int),
                  f"POST /admin/reload on the admin port: {status} {brief(body)}")
            status, body, _ = await http(f"{admin}/admin/users/{esc('auth0|abc')}", "DELETE", AUTH)
            check(status == 200, f"DELETE user on the admin port: {status} {brief(body)}")
            status, body, _ = await admin_get(admin, "auth0|abc", "trip")
            check_found(status, body, "auth0|abc", "trip", False, "after DELETE user on the admin port")
            status, body, _ = await healthz(gw)
            check(status == 200, f"/healthz on the main port: {status}")
            await c.close()


async def part_admin_reload_broken():
    rules = harness.temp_dir("chatgate-e2e-ops-rules-")
    for f in SHIPPED.glob("*.rules"):
        shutil.copy(f, rules / f.name)
    env = {"CHATGATE_NOW": NOW, "CHATGATE_ADMIN_TOKEN": TOKEN}
    try:
        async with harness.Gateway(["--rules", rules], cfg({"demo": harness.demo_upstream(0)}, "demo"), env=env,
                                   name="gateway-reload") as gw:
            base = gw.http_url
            with step("admin: a broken rules dir -> 422 file:line, the running set stays"):
                status, body, _ = await http(f"{base}/admin/reload", "POST", AUTH)
                check(status == 200 and isinstance(body, dict) and isinstance(body.get("rules"), int) and body["rules"] > 0,
                      f"POST /admin/reload of the copied rules: {status} {brief(body)}")
                n = body["rules"]
                travel = rules / "50-travel.rules"
                good = travel.read_text()
                lines = good.rstrip("\n").split("\n")
                bad_rule = len(lines) + 2
                travel.write_text(good.rstrip("\n") + "\n\nrule broken_on_purpose\n  match   (unclosed [group\n  do      route demo\n")
                status, body, _ = await http(f"{base}/admin/reload", "POST", AUTH)
                check(status == 422 and isinstance(body, dict) and isinstance(body.get("error"), str),
                      f"POST /admin/reload of a broken set: expected 422 {{\"error\": ...}}, got {status} {brief(body)}")
                where = re.search(r"50-travel\.rules:(\d+)", body["error"])
                check(where and int(where.group(1)) in (bad_rule, bad_rule + 1),
                      f"the 422 error should name 50-travel.rules:{bad_rule + 1} (file:line): {body['error']!r}")
                status, hbody, _ = await healthz(gw)
                check(status == 200 and hbody == {"status": "ok"}, f"/healthz after a refused reload: {status} {brief(hbody)}")
                c = await Client.connect(gw)
                t = await say(c, "r1", FLIGHTS, "trip")
                check(t.ack.get("params") == FLIGHT_PARAMS, f"the running rules should stay: {brief(t.ack)}")
                m = await metrics(gw)
                expect_value(m, "chatgate_rules_loaded", n)
                got = m.value("chatgate_rules_reloads_total", result="refused")
                check(got == 1, f"one refused POST /admin/reload (Content-Length: 0) should count one refused "
                      f"reload, chatgate_rules_reloads_total{{result=\"refused\"}} is {got:g}")
                travel.write_text(good)
                status, body, _ = await http(f"{base}/admin/reload", "POST", AUTH)
                check(status == 200 and isinstance(body, dict) and body.get("rules") == n,
                      f"POST /admin/reload after the fix: {status} {brief(body)}")
                await c.close()
    finally:
        shutil.rmtree(rules, ignore_errors=True)


async def part_admin_redis():
    redis = await harness.RedisServer().astart()
    env = {"CHATGATE_NOW": NOW, "CHATGATE_ADMIN_TOKEN": TOKEN}
    args = ["--rules", SHIPPED, "--auth", "header", "--store", redis.url]
    config = cfg({"demo": harness.demo_upstream(0)}, "demo", redis={"prefix": "chatgate"})
    try:
        async with harness.Gateway(args, config, env=env, name="gateway-admin-redis") as gw:
            base = gw.http_url
            odd_room = "r:{1} *"
            with step("admin+redis: dialogs of auth0|abc (3 rooms), a:b and auth0|abcd"):
                ca = await connect_as(gw, "auth0|abc")
                for i, room in enumerate(("trip", odd_room, "weather")):
                    await say(ca, f"a{i}", FLIGHTS, room)
                cb = await connect_as(gw, "a:b")
                await say(cb, "b1", FLIGHTS, "trip")
                await say(cb, "b2", "hello", odd_room)
                cd = await connect_as(gw, "auth0|abcd")
                await say(cd, "d1", "Hello", "trip")
                # the save follows the done frame: wait for it
                # a dialog's keys are its state and its history; a user's, those and its rooms set
                await harness.wait_until(lambda: len(user_keys(redis, "auth0|abc")) >= 7
                                         and len(user_keys(redis, "a:b")) >= 5
                                         and len(user_keys(redis, "auth0|abcd")) >= 3, 5)
                keys = user_keys(redis, "auth0|abc")
                check(len(keys) >= 7 and any(k.endswith(":rooms") for k in keys)
                      and sum(k.endswith(":state") for k in keys) == 3,
                      f"auth0|abc should have dialog keys (a state each) in 3 rooms and a rooms set: {keys}")
                status, body, _ = await admin_get(base, "auth0|abc", odd_room)
                check_found(status, body, "auth0|abc", odd_room, True, "view with Redis")
                check(body["state"].get("params") == {"travel": FLIGHT_PARAMS}, f"params from Redis: {brief(body)}")
                kept_b, kept_d = user_keys(redis, "a:b"), user_keys(redis, "auth0|abcd")
                check(kept_b and kept_d, f"a:b / auth0|abcd keys: {kept_b} {kept_d}")
            with step("admin+redis: DELETE /admin/users/auth0|abc leaves no key of the user, without SCAN/KEYS"):
                redis.config_resetstat()
                status, body, _ = await http(f"{base}/admin/users/{esc('auth0|abc')}", "DELETE", AUTH)
                check(status == 200, f"DELETE user: {status} {brief(body)}")
                stats = redis.info_commandstats()
                for cmd in ("scan", "keys"):
                    check(cmd not in stats, f"the gateway ran {cmd.upper()} to forget a user: {stats.get(cmd)}")
                check(any(stats.get(c, {}).get("calls", 0) > 0 for c in ("zrange", "smembers", "sscan")),
                      f"the user's rooms set should be read (ZRANGE/SMEMBERS/SSCAN); commands: {sorted(stats)}")
                left = user_keys(redis, "auth0|abc")
                check(not left, f"keys of the forgotten user left in Redis: {left}")
                check(user_keys(redis, "a:b") == kept_b and user_keys(redis, "auth0|abcd") == kept_d,
                      f"other users' keys changed: a:b {user_keys(redis, 'a:b')} (was {kept_b}), "
                      f"auth0|abcd {user_keys(redis, 'auth0|abcd')} (was {kept_d})")
                for room in ("trip", odd_room, "weather"):
                    status, body, _ = await admin_get(base, "auth0|abc", room)
                    check_found(status, body, "auth0|abc", room, False, f"{room!r} after DELETE user (Redis)")
            with step("admin+redis: DELETE /admin/dialogs/a:b/{room} removes that dialog's keys only"):
                status, body, _ = await http(f"{base}/admin/dialogs/{esc('a:b')}/{esc(odd_room)}", "DELETE", AUTH)
                check(status == 200, f"DELETE dialog: {status} {brief(body)}")
                left = user_keys(redis, "a:b")
                e_room = {harness.escape_id(odd_room), harness.escape_id(odd_room).lower()}
                check(not any(any(f"}}:{r}:" in k for r in e_room) for k in left),
                      f"keys of a:b/{odd_room!r} left after its DELETE: {left}")
                check(any(":trip:" in k for k in left), f"a:b/trip should stay: {left}")
                rooms = [k for k in left if k.endswith(":rooms")]
                members = set(redis.zrange(rooms[0])) if rooms else set()
                check(members == {"trip"}, f"a:b's rooms set should hold only trip now: {members}")
                status, body, _ = await admin_get(base, "a:b", "trip")
                check_found(status, body, "a:b", "trip", True, "a:b/trip (Redis)")
            with step("admin+redis: Redis away: DELETE answers 503 (retry), GET says degraded"):
                redis.kill()
                status, body, _ = await http(f"{base}/admin/users/{esc('auth0|abcd')}", "DELETE", AUTH)
                check(status == 503, f"DELETE user while Redis is away should be 503 (docs/state.md, When Redis fails), got {status} {brief(body)}")
                status, body, _ = await http(f"{base}/admin/dialogs/{esc('a:b')}/trip", "DELETE", AUTH)
                check(status == 503, f"DELETE dialog while Redis is away should be 503, got {status} {brief(body)}")
                status, body, _ = await admin_get(base, "auth0|abcd", "trip")
                check(status == 200 and isinstance(body, dict) and body.get("degraded") is True,
                      f"GET while Redis is away: 200 with degraded true expected, got {status} {brief(body)}")
            for c in (ca, cb, cd):
                await c.close()
    finally:
        redis.cleanup(keep=True)


# --------------------------------------------------------------------------------------
# Logs


def check_masked(gw, secrets, what):
    text = gw.log_text()
    for label, value in secrets:
        check(value not in text, f"{what}: the log holds {label} {value!r}:\n" +
              "\n".join("   | " + line for line in text.splitlines() if value in line)[:2000])
    for mark in ("[phone]", "[email]", "[token]"):
        check(mark in text, f"{what}: the log should show {mark} where it masked something; "
              f"{len(text.splitlines())} lines, none with {mark}")
    return text


async def log_conversation(gw, jwt_query, jwt_header, bad_jwt):
    text = f"Call me at {PHONE} or write to {EMAIL} about the trip"
    c = await Client.connect(f"{gw.url}?access_token={jwt_query}", expect_user="u42")
    t = await c.message(text, mid="p1", room="trip")
    err = t.expect_error("upstream_error")
    check(PHONE in err.get("message", "") or EMAIL in err.get("message", ""),
          f"the upstream's error (which quotes the user) should reach the client: {brief(err)}")
    await c.close()
    c = await Client.connect(gw, expect_user="u42", extra_headers={"Authorization": f"Bearer {jwt_header}"})
    t = await c.message(f"my number is {PHONE}, my e-mail {EMAIL}, token {jwt_header}, key {SK_KEY}, "
                        f"header Authorization: Bearer {BEARER}, link https://x.example/cb?access_token={OPAQUE}&x=1",
                        mid="p2", room="trip")
    t.expect_error("upstream_error")
    await c.close()
    await harness.expect_unauthorized(f"{gw.url}?access_token={bad_jwt}", "a bad JWT in ?access_token=")
    await harness.expect_unauthorized(gw.url, "a bad JWT in Authorization",
                                      extra_headers={"Authorization": f"Bearer {bad_jwt}"})


def log_secrets(jwts):
    out = [("the phone number", PHONE), ("the phone number's digits", PHONE[1:]),
           ("the e-mail address", EMAIL), ("the e-mail's local part", "jane.doe@"),
           ("an sk- key", SK_KEY), ("a bearer token", BEARER), ("an access_token parameter", OPAQUE)]
    for j in jwts:
        out.append(("a JWT", j))
        head, payload, sig = j.split(".")
        out.append(("a JWT's payload", payload))
        if sig:
            out.append(("a JWT's signature", sig))
    return out


async def part_logs(app, fake):
    exp = int(time.time()) + 3600
    jwt_q = make_jwt(JWT_SECRET, {"sub": "u42", "exp": exp, "n": 1})
    jwt_h = make_jwt(JWT_SECRET, {"sub": "u42", "exp": exp, "n": 2})
    bad = make_jwt("not-the-secret", {"sub": "u42", "exp": exp, "n": 3})
    env = {"CHATGATE_JWT_SECRET": JWT_SECRET}
    secrets = log_secrets([jwt_q, jwt_h, bad])
    with step("logs (text, debug): an app error quoting the user, JWTs, a bad JWT: all masked"):
        gw = await harness.Gateway(["--auth", "jwt", "--log-level", "debug"],
                                   cfg({"app": harness.app_upstream(app, "/error_echo")}, "app"),
                                   env=env, name="gateway-logs-text").astart()
        await log_conversation(gw, jwt_q, jwt_h, bad)
        code = await gw.astop()
        check(code == 0, f"exit status {code}")
        text = check_masked(gw, secrets, "text log")
        # the build's malloc (CMake's CHATGATE_MIMALLOC, passed by tests/e2e/CMakeLists.txt)
        # is the one in use: a mimalloc linked but not malloc's would say so and fail here
        want = {"mimalloc": "info malloc: mimalloc ", "libc": "info malloc: the C library's"}[
            os.environ.get("CHATGATE_EXPECT_MALLOC", "libc")]
        check(want in text, f"the log should say {want!r}: " +
              repr([line for line in text.splitlines() if "malloc" in line]))
    with step("logs (--log-format json): an OpenAI 500 quoting the user; every line JSON, masked"):
        gw = await harness.Gateway(["--auth", "jwt", "--log-level", "debug", "--log-format", "json"],
                                   cfg({"llm": harness.openai_upstream(fake, "err500echo")}, "llm"),
                                   env=env, name="gateway-logs-json").astart()
        await log_conversation(gw, jwt_q, jwt_h, bad)
        code = await gw.astop()
        check(code == 0, f"exit status {code}")
        text = check_masked(gw, secrets, "JSON log")
        lines = [line for line in text.split("\n") if line != ""]
        check(len(lines) >= 5, f"too few log lines: {lines}")
        for line in lines:
            try:
                obj = json.loads(line)
            except ValueError:
                fail(f"a log line is not JSON: {line!r}")
            check(isinstance(obj, dict), f"a log line is not a JSON object: {line!r}")
            for key in ("ts", "level", "pid", "msg"):
                check(key in obj, f"a JSON log line without {key!r}: {line!r}")
            check(obj["pid"] == gw.pid, f"pid should be {gw.pid}: {line!r}")
            check(obj["level"] in ("error", "warn", "info", "debug"), f"unknown level: {line!r}")
            check(isinstance(obj["msg"], str) and obj["msg"], f"empty msg: {line!r}")
            check(isinstance(obj["ts"], str) and re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d", obj["ts"]),
                  f"ts should be an ISO timestamp: {line!r}")


# --------------------------------------------------------------------------------------
# Lifecycle


def long_text(n):
    return " ".join(f"word{i}" for i in range(n))


async def poll_health_until_exit(gw, seen):
    """Record every /healthz answer until the process exits (refused connections end it)."""
    while gw.proc.poll() is None:
        try:
            status, _, raw = await asyncio.to_thread(harness.http_request, gw.http_url + "/healthz", "GET", None,
                                                     None, 1.0)
            try:
                body = json.loads(raw)
            except ValueError:
                body = raw
            seen.append((status, body))
        except OSError:
            if gw.proc.poll() is not None:
                break
            seen.append(("refused", None))
        await asyncio.sleep(0.05)


async def drain_once(gw, client, mid, text, room, shutdown_s):
    """Send `text`, SIGTERM after its first delta; check /healthz 503 stopping, a handshake
    503, the reply's done and exit 0 in time. Returns the done frame."""
    await client.send_message(text, mid, room)
    await client.recv_type("delta", mid)
    t0 = time.monotonic()
    gw.send_signal(signal.SIGTERM)

    async def not_ok():  # the signal is handled on the gateway's loop, soon after
        got = await healthz(gw)
        return None if got[:2] == (200, {"status": "ok"}) else got
    status, body, _ = await harness.wait_condition(not_ok, 3, "/healthz still says ok after SIGTERM")
    check(status == 503 and body == {"status": "stopping"},
          f"/healthz right after SIGTERM: expected 503 {{\"status\":\"stopping\"}}, got {status} {brief(body)}")
    hs = await harness.handshake_status(gw.url)
    check(hs == 503, f"a WebSocket handshake during the drain should get 503, got {hs}")
    seen = []
    poller = asyncio.create_task(poll_health_until_exit(gw, seen))
    try:
        turn = await client.collect_turn(mid, timeout=shutdown_s + 1)
    finally:
        code = await gw.await_exit(shutdown_s + 2 - (time.monotonic() - t0))
        await poller
    elapsed = time.monotonic() - t0
    check(turn.kind == "done", f"the reply in flight at SIGTERM should finish with done: {turn.describe()}")
    turn.expect_done()
    check(turn.terminal.get("text", "").rstrip().endswith(text.split()[-1] + '".'),
          f"the done text should be the whole reply: {brief(turn.terminal)}")
    check(code == 0, f"after SIGTERM the gateway should exit 0 within {shutdown_s + 2} s; status {code} "
          f"after {elapsed:.1f}s")
    bad = [(s, b) for s, b in seen if s not in (503, "refused") or (s == 503 and b != {"status": "stopping"})]
    check(not bad, f"/healthz during the drain should be 503 stopping until the exit: {bad[:5]}")
    return turn.terminal


async def part_drain_memory(n_words, tag):
    with step(f"SIGTERM with a reply in flight ({tag}): 503 for health and handshakes, the reply finishes, exit 0"):
        gw = await harness.Gateway(["--shutdown-timeout-s", "5"], cfg({"demo": harness.demo_upstream(50)}, "demo"),
                                   name=f"gateway-drain-{tag}").astart()
        c = await Client.connect(gw)
        await drain_once(gw, c, "m1", long_text(n_words), "default", 5)


async def part_drain_redis():
    redis = await harness.RedisServer().astart()
    try:
        with step("SIGTERM with Redis: the turn that finished during the drain is in Redis"):
            args = ["--shutdown-timeout-s", "5", "--store", redis.url, "--auth", "header"]
            gw = await harness.Gateway(args, cfg({"demo": harness.demo_upstream(50)}, "demo"),
                                       name="gateway-drain-redis").astart()
            c = await connect_as(gw, "drain|user")
            await say(c, "m0", "first message", "drain")
            text = long_text(30)
            done = None
            try:
                done = await drain_once(gw, c, "m1", text, "drain", 5)
            finally:
                if gw.alive():
                    await gw.await_exit(5)
                key = redis.find_key(harness.dialog_key("drain|user", "drain", "history"))
                history = [json.loads(x) for x in redis.lrange(key)] if key else []
                pairs = [(h.get("role"), h.get("content")) for h in history]
                check(len(history) == 4 and pairs[2] == ("user", text) and pairs[3][0] == "assistant"
                      and not history[3].get("cancelled"),
                      f"Redis history after the drain should end with the finished turn: {brief(pairs, 800)}")
                if done is not None:
                    check(pairs[3][1] == done.get("text"), f"saved reply != done text: {brief(pairs[3])}")
    finally:
        redis.cleanup(keep=True)


async def part_drain_deadline():
    with step("--shutdown-timeout-s 1 and a longer reply: cut, exit 0 within ~3 s"):
        gw = await harness.Gateway(["--shutdown-timeout-s", "1"], cfg({"demo": harness.demo_upstream(200)}, "demo"),
                                   name="gateway-deadline").astart()
        c = await Client.connect(gw)
        await c.send_message(long_text(60), "m1")
        await c.recv_type("delta", "m1")
        t0 = time.monotonic()
        gw.send_signal(signal.SIGTERM)
        outcome = None
        deadline = t0 + 4
        while outcome is None and time.monotonic() < deadline:
            try:
                raw = await asyncio.wait_for(c.ws.recv(), max(0.01, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                break
            except websockets.ConnectionClosed as err:
                outcome = f"closed (code {err.code})"
                break
            frame = json.loads(raw)
            if frame.get("id") == "m1" and harness.is_terminal(frame):
                outcome = frame.get("type")
        code = await gw.await_exit(max(0.0, t0 + 3.5 - time.monotonic()))
        elapsed = time.monotonic() - t0
        check(outcome is not None and outcome != "done" and not outcome.startswith("error"),
              f"the reply past the deadline should be cut (cancelled or the connection closed), got {outcome!r}")
        check(code == 0, f"should exit 0 within ~3 s of SIGTERM; status {code} after {elapsed:.1f}s")


async def part_second_signal():
    with step("a second SIGTERM during the drain stops at once (exit 0)"):
        gw = await harness.Gateway([], cfg({"demo": harness.demo_upstream(200)}, "demo"),
                                   name="gateway-2ndsig").astart()
        c = await Client.connect(gw)
        await c.send_message(long_text(60), "m1")
        await c.recv_type("delta", "m1")
        gw.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.4)  # the subject: still draining a while after the first SIGTERM
        check(gw.alive(), "the gateway should still be draining 0.4 s after the first SIGTERM (10 s deadline)")
        t0 = time.monotonic()
        gw.send_signal(signal.SIGTERM)
        code = await gw.await_exit(2.0)
        check(code == 0, f"after a second SIGTERM: exit status {code} after {time.monotonic() - t0:.1f}s "
              f"(expected 0 at once)")


def masked_text(text):
    """A client's text frame (RFC 6455: masked), of under 126 bytes."""
    data, mask = text.encode(), os.urandom(4)
    return bytes([0x81, 0x80 | len(data)]) + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(data))


async def raw_ws_watch(port, limit, talk_every=None):
    """A raw client: handshake, then read frames and never answer a ping; with talk_every,
    it sends a context.get every that many seconds. Returns (frames as (seconds since the
    handshake, opcode, payload), seconds until the connection ended or None, how it ended)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    key = base64.b64encode(os.urandom(16)).decode()
    writer.write((f"GET /ws HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
                  f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode())
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    check(head.startswith(b"HTTP/1.1 101"), f"raw handshake: {head[:100]!r}")
    t0 = time.monotonic()
    frames = []
    ended, how = None, "still open"

    async def talk():
        while True:
            await asyncio.sleep(talk_every)
            writer.write(masked_text('{"type":"context.get"}'))
            await writer.drain()
    talker = asyncio.ensure_future(talk()) if talk_every else None
    try:
        while True:
            left = t0 + limit - time.monotonic()
            if left <= 0:
                break
            b0, b1 = await asyncio.wait_for(reader.readexactly(2), left)
            n = b1 & 0x7F
            if n == 126:
                n = int.from_bytes(await reader.readexactly(2), "big")
            elif n == 127:
                n = int.from_bytes(await reader.readexactly(8), "big")
            payload = await reader.readexactly(n) if n else b""
            frames.append((time.monotonic() - t0, b0 & 0x0F, payload))
            if b0 & 0x0F == 0x8:
                ended, how = time.monotonic() - t0, "close frame"
                break
    except asyncio.IncompleteReadError:
        ended, how = time.monotonic() - t0, "EOF"
    except asyncio.TimeoutError:  # before OSError, which it is one of since Python 3.11
        pass
    except (ConnectionError, OSError) as err:
        ended, how = time.monotonic() - t0, repr(err)
    if talker:
        talker.cancel()
    writer.close()
    return frames, ended, how


async def part_pings():
    config = cfg({"demo": harness.demo_upstream(0)}, "demo", ping_interval_s=1, idle_timeout_s=3)
    async with harness.Gateway([], config, name="gateway-pings") as gw:
        with step("pings (interval 1 s, idle 3 s): a client answering pings stays; a raw one is dropped"):
            async def good_client():
                c = await Client.connect(gw, ping_interval=None)  # only the library's pong answers
                await asyncio.sleep(5.0)  # the subject: idle past idle_timeout_s, answering pings
                check(c.open, "a client that answers pings was dropped while idle for 5 s")
                await c.check_alive()
                t = await c.message("still here?", mid="k1")
                t.expect_done()
                await c.close()

            async def raw_client():
                return await raw_ws_watch(gw.port, 8.0)

            async def talking_client():
                return await raw_ws_watch(gw.port, 6.0, talk_every=1.0)

            _, (frames, ended, how), (t_frames, t_ended, t_how) = await asyncio.gather(
                good_client(), raw_client(), talking_client())
            opcodes = [op for _, op, _ in frames]
            pings = [t for t, op, _ in frames if op == 0x9]
            check(frames and frames[0][1] == 0x1 and b'"hello"' in frames[0][2],
                  f"the raw client should get the hello first: {frames[:3]}")
            check(pings, f"the raw client saw no ping frame (opcodes {opcodes}); ended: {how} at {ended}")
            check(ended is not None, f"a client that never answers pings should be dropped after idle_timeout_s 3; "
                  f"still open after 8 s (opcodes {opcodes})")
            check(pings[0] < ended, f"the first ping ({pings[0]:.1f}s) should come before the hang-up ({ended:.1f}s)")
            check(2.5 <= ended <= 6.5, f"the silent client should be dropped about idle_timeout_s (3 s) after "
                  f"connecting; it ended ({how}) after {ended:.1f}s; pings at {[round(p, 1) for p in pings]}")
            # any frame counts, not only a pong: lws's own keepalive counted pongs alone, and
            # dropped this one after 3 s
            answers = [p for _, op, p in t_frames if op == 0x1 and b'"context"' in p]
            check(t_ended is None, f"a client that never answers pings but sends a frame every second should stay "
                  f"open; it ended ({t_how}) after {t_ended:.1f}s" if t_ended is not None else "")
            check(len(answers) >= 4, f"the talking client should have its context answers: {len(answers)}")
        with step("/metrics counts the pings and the one hang-up"):
            m = await metrics(gw)
            hangups, pings = m.value("chatgate_ws_idle_hangups_total"), m.value("chatgate_ws_pings_total")
            check(hangups == 1, f"chatgate_ws_idle_hangups_total should be 1 (the silent client), got {hangups}")
            check(pings >= 2, f"chatgate_ws_pings_total should count the pings of both quiet clients, got {pings}")


async def main(args):
    async with harness.FakeApp() as app, harness.FakeOpenAI() as fake:
        await independent(part_metrics_conversation())
        await independent(part_metrics_upstream_errors())
        await independent(part_metrics_awaiting(app))
        await independent(part_healthz_degraded())
        await independent(part_admin_memory())
        await independent(part_admin_path_ids())
        await independent(part_admin_absent())
        await independent(part_admin_listener())
        await independent(part_admin_reload_broken())
        await independent(part_admin_redis())
        await independent(part_logs(app, fake))
        await independent(part_drain_memory(30, "a"))
        await independent(part_drain_memory(21, "b"))
        await independent(part_drain_redis())
        await independent(part_drain_deadline())
        await independent(part_second_signal())
        await independent(part_pings())


if __name__ == "__main__":
    harness.run(main, timeout=105)
