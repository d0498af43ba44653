"""End-to-end test of dialog state (issue 3; docs/state.md, docs/protocol.md), run twice:
with the in-memory store and with a real redis-server started on a free port.

State comes only from the state app's directives (harness FakeApp /state; no rule files:
`--rules` names an empty directory), so what is checked is the gateway's keeping, merging
and forwarding:
- the flight search's turns (docs/scenarios.md): "Find flights from Nairobi to London on Feb 10" (the app
  sets service travel and from/to/departure_date), "What about returning on Feb 20?" (the
  app adds return_date): the 2nd forwarded frame carries the kept params, the travel
  defaults (cabin_class economy), the first exchange as history, and the 2nd ack the same
  merged params; a later value replaces a kept one (new > cached > defaults); the client's
  done never carries `state`;
- the payment's turns (docs/scenarios.md; amount, currency, recipient; "another 3000 to the same
  person"), and travel and payment params kept apart in one room;
- awaiting: forwarded with the next message, cleared by "awaiting": null, gone after its ttl
  (1 s) and after lifetimes.awaiting_s when the directive names no ttl; soft context
  forwarded while fresh, with its source (the upstream that set it), gone after
  lifetimes.soft_s, or kept for its own ttl when the directive gives one;
- history: FIFO at history_n (12 turns with N = 10; each forwarded history is exactly the
  last N messages before it, user and assistant, with ts);
- params over params_cap: warning too_large, the message still answered, params unchanged;
  params under it kept whole; 200 small params all kept;
- context.get / context.forget / context.clear, and a context.get that waits behind the
  reply in flight;
- messages of one dialog sent back to back each see the previous one's state; one user on
  two connections (a resume token) in one room with turns at the same time loses neither
  update; non-ASCII and structured values round-trip; a U+0000 in a value is kept or
  refused with a warning; the params cap is per dialog (over two services);
- OpenAI upstream: system message (configured prompt), then the history, then the user's
  message; a cancelled reply leaves the user turn and the partial assistant text marked
  cancelled; an upstream error leaves only the user turn; no extra fields in messages.
  With Redis also: a second gateway on the same Redis (auth header, same user) sees params
  the app-side gateway kept, and its system message summarises them.
- Redis only: the key layout of docs/state.md, Redis layout (one hash tag per dialog; since
  issue 39's ninth round a dialog's state is one HASH, `<dialog>:state`: rev, created_at,
  last_activity, and v, the dialog but its history as one JSON object, where the params,
  dialog, awaiting and soft keys were, and none of those is written), values as JSON, ends
  and TTLs (the params end ~ lifetimes.params_s and the dialog's parts ~ dialog_s inside the
  state, whose TTL is the longest of the two and of an awaiting state's or soft context's
  time left; history ~ history_s; awaiting ~ its ttl, soft ~ soft_s, as the state's
  awaiting_expires and soft_expires), the user's rooms set; a store URL with /DB and
  redis.prefix put the keys in that database under that prefix; a Redis with requirepass
  works with the password in the URL, and a wrong one gives store_degraded.
- Memory only: max_dialogs bounds the dialogs held, least recently used first.
"""

import asyncio
import json
import time

import harness
from harness import (ANY, Client, check, check_history_ts, check_turn_done, context_command,
                     history_pairs, independent, step, state_reply_text)

LIFETIMES = {"params_s": 3600, "dialog_s": 7200, "awaiting_s": 1, "soft_s": 2, "history_s": 1800}
SYSTEM_PROMPT = "You are chatgate's test assistant."
FLIGHT = {"from": "Nairobi", "to": "London", "departure_date": "2026-02-10"}
PAYMENT = {"amount": 5000, "currency": "KES", "recipient": "+254712345678"}


class Ctx:
    """What the parts of one run share."""

    def __init__(self, mode, app, fake, gw, redis, rules):
        self.mode = mode
        self.app = app
        self.fake = fake
        self.gw = gw
        self.redis = redis
        self.rules = rules

    def tag(self, name):
        return f"[{self.mode}] {name}"


async def turn(client, app, mid, text, room, state=None, timeout=harness.DEFAULT_TIMEOUT):
    """One message through the state app: (turn, forwarded frame)."""
    if state is not None:
        app.directives[mid] = state
    t = await client.message(text, mid=mid, room=room, timeout=timeout)
    check_turn_done(t)
    check(t.terminal.get("text") == state_reply_text(text), f"reply not relayed: {t.describe()}")
    fwd = await app.wait_message(mid)
    return t, fwd


def check_forwarded(fwd, *, service=ANY, params=ANY, awaiting=ANY, soft=ANY, history=ANY, what=""):
    """The forwarded message frame's state fields; ANY skips one."""
    for key in ("service", "params", "awaiting", "soft_context", "history"):
        check(key in fwd, f"{what}: the forwarded frame has no {key!r}: {harness.brief(fwd)}")
    if service is not ANY:
        check(fwd["service"] == service, f"{what}: forwarded service should be {service!r}, got {fwd['service']!r}")
    if params is not ANY:
        check(fwd["params"] == params,
              f"{what}: forwarded params should be {params}, got {harness.brief(fwd['params'])}")
    if awaiting is not ANY:
        check(fwd["awaiting"] == awaiting, f"{what}: forwarded awaiting should be {awaiting}, got {fwd['awaiting']}")
    if soft is not ANY:
        check(fwd["soft_context"] == soft, f"{what}: forwarded soft_context should be {soft}, got {fwd['soft_context']}")
    if history is not ANY:
        got = history_pairs(fwd["history"])
        check(got == history, f"{what}: forwarded history should be {history}, got {harness.brief(got, 800)}")
        check_history_ts(fwd["history"])


def check_ack_state(ack, service, params, what):
    check(ack.get("service") == service, f"{what}: ack.service should be {service!r}: {harness.brief(ack)}")
    check(ack.get("params") == params, f"{what}: ack.params should be {params}: {harness.brief(ack)}")


def ttl_between(redis, key, low, high, what):
    ttl = redis.ttl(key)
    check(low <= ttl <= high, f"{what}: TTL of {key} should be in [{low}, {high}], got {ttl} "
                              f"(-2: no such key, -1: no expiry); keys: {redis.keys('chatgate:*')[:20]}")
    return ttl


def redis_state(redis, user, room):
    """The dialog's state in Redis (docs/state.md, Redis layout: one HASH of rev, created_at,
    last_activity and v, the dialog but its history as one JSON object), v decoded with the
    hash's other fields (redis.state); {} when there is none."""
    return redis.state(harness.dialog_key(user, room, "state"))


def ends_in(state, name, low, high, what):
    """The state's `name` (a unix time, e.g. awaiting_expires) is within [low, high] s from now."""
    left = state.get(name, 0) - time.time()
    check(low <= left <= high, f"{what}: the state's {name} should end in [{low}, {high}] s, ends in "
                               f"{left:.1f} s ({state.get(name)!r})")
    return left


def redis_json_hash(redis, key):
    raw = redis.params_hash(key)
    out = {}
    for k, v in raw.items():
        try:
            out[k] = json.loads(v)
        except ValueError:
            fail_msg = f"hash {key} field {k} is not JSON: {v!r}"
            harness.fail(fail_msg)
    return out


# --------------------------------------------------------------------------------------


async def part_flight(cx):
    client = await Client.connect(cx.gw)
    user = client.hello["user"]
    room = "trip"
    app = cx.app
    with step(cx.tag("flight search turns: first message, directive applied")):
        t1, f1 = await turn(client, app, "f1", "Find flights from Nairobi to London on Feb 10", room,
                            {"service": "travel", "params": dict(FLIGHT)})
        check_ack_state(t1.ack, None, {}, "first message")
        check(f1.get("user") == user and f1.get("room") == room,
              f"forwarded user/room should be {user!r}/{room!r}: {harness.brief(f1)}")
        check_forwarded(f1, service=None, params={}, awaiting=None, soft=None, history=[], what="f1")
    with step(cx.tag("'What about returning on Feb 20?': kept params, defaults, history, ack")):
        t2, f2 = await turn(client, app, "f2", "What about returning on Feb 20?", room,
                            {"params": {"return_date": "2026-02-20"}})
        merged = dict(FLIGHT, cabin_class="economy")
        check_forwarded(f2, service="travel", params=merged, awaiting=None, soft=None,
                        history=[("user", "Find flights from Nairobi to London on Feb 10"),
                                 ("assistant", t1.terminal["text"])], what="f2")
        check_ack_state(t2.ack, "travel", merged, "f2")
    with step(cx.tag("new > cached > defaults: a kept value over the default, a new one over the kept")):
        t3, f3 = await turn(client, app, "f3", "Make it business class", room,
                            {"params": {"cabin_class": "business"}})
        merged3 = dict(FLIGHT, cabin_class="economy", return_date="2026-02-20")
        check_forwarded(f3, service="travel", params=merged3, what="f3")
        check_ack_state(t3.ack, "travel", merged3, "f3")
        t4, f4 = await turn(client, app, "f4", "Actually from Mombasa", room,
                            {"params": {"from": "Mombasa"}})
        merged4 = dict(merged3, cabin_class="business")
        check_forwarded(f4, service="travel", params=merged4, what="f4")
        t5, f5 = await turn(client, app, "f5", "Show me the cheapest", room)
        merged5 = dict(merged4, **{"from": "Mombasa"})
        check_forwarded(f5, service="travel", params=merged5, what="f5")
        check_ack_state(t5.ack, "travel", merged5, "f5")
        check(len(f5["history"]) == 8, f"f5: forwarded history should hold the 4 exchanges before it, "
                                       f"got {len(f5['history'])}")
    with step(cx.tag("context.get after the flight turns")):
        state = await context_command(client, "context.get", room)
        kept = dict(FLIGHT, **{"from": "Mombasa"}, return_date="2026-02-20", cabin_class="business")
        check(state.get("service") == "travel", f"context service should be travel: {harness.brief(state)}")
        check(state.get("params") == {"travel": kept}, f"context params should be {{'travel': {kept}}}: "
                                                       f"{harness.brief(state.get('params'))}")
        meta = state.get("meta") or {}
        for key in ("created_at", "last_activity", "turn_count", "message_count"):
            check(isinstance(meta.get(key), int), f"context meta.{key} should be an integer: {harness.brief(state)}")
        check(meta["created_at"] <= meta["last_activity"] <= time.time() + 5,
              f"meta times out of order: {meta}")
        check(meta["message_count"] >= 5, f"meta.message_count should count the 5 messages: {meta}")
        hist = history_pairs(state.get("history"))
        check(len(hist) == 10 and hist[-1] == ("assistant", state_reply_text("Show me the cheapest")),
              f"context history should end with the 5th reply (10 entries): {hist}")
    if cx.redis:
        with step(cx.tag("Redis layout: keys with one hash tag, JSON values, TTLs, rooms set")):
            r = cx.redis
            tag = "{" + harness.escape_id(user) + "}:" + room  # the user's hash tag, then the room
            keys = r.keys(f"chatgate:{tag}:*".replace("{", "\\{").replace("}", "\\}"))
            expected = {f"chatgate:{tag}:{p}" for p in ("state", "history")}
            check(expected <= set(keys), f"expected keys {sorted(expected)}, Redis has {keys} "
                                         f"(all: {r.keys('chatgate:*')[:30]})")
            old = {f"chatgate:{tag}:{p}" for p in ("params", "dialog", "awaiting", "soft")} & set(keys)
            check(not old, f"keys of the layout before the state should not be written: {sorted(old)}")
            check(r.type(f"chatgate:{tag}:state") == "hash", "state should be a HASH")
            check(set(r.hgetall(f"chatgate:{tag}:state")) == {"rev", "created_at", "last_activity", "v"},
                  f"the state hash's fields: {sorted(r.hgetall(f'chatgate:{tag}:state'))}")
            params = redis_json_hash(r, f"chatgate:{tag}:state")
            check(params == {f"travel.{k}": v for k, v in kept.items()},
                  f"the state's params should be 'travel' -> <name> -> JSON: {params}")
            state = redis_state(r, user, room)  # fails unless v is a JSON object, with a rev
            # the params lapse after params_s, the rest after dialog_s: inside the one key,
            # which lives the longest of the two
            ends_in(state, "params_until", 3500, 3600, "params")
            ends_in(state, "dialog_until", 7100, 7200, "dialog")
            ttl_between(r, f"chatgate:{tag}:state", 7100, 7200, "state (the longest of params_s and dialog_s)")
            check(state.get("service") == "travel", f"the state's service should be travel: {state}")
            meta = state.get("meta") or {}
            for key in ("created_at", "last_activity", "turn_count", "message_count"):
                check(isinstance(meta.get(key), int), f"the state's meta lacks {key}: {state}")
            check(state.get("created_at") == meta["created_at"] and state.get("last_activity") == meta["last_activity"],
                  f"the state hash's created_at and last_activity should be its meta's: {state}")
            check(r.type(f"chatgate:{tag}:history") == "list", "history should be a LIST")
            entries = [json.loads(e) for e in r.lrange(f"chatgate:{tag}:history")]
            check(len(entries) == 10 and {e.get("role") for e in entries} == {"user", "assistant"},
                  f"history list should hold 10 JSON messages: {entries}")
            ttl_between(r, f"chatgate:{tag}:history", 1700, 1800, "history")
            rooms = harness.rooms_key(user)
            check(r.type(rooms) == "zset" and room in r.zrange(rooms),
                  f"{rooms} should be a ZSET (by last use) holding {room!r}: type {r.type(rooms)}, "
                  f"keys {r.keys('chatgate:*rooms')}")
            check(not r.keys("dialog:*"), "keys of a one-key-per-dialog layout (dialog:*) in Redis")
    await client.close()


async def part_payment(cx):
    client = await Client.connect(cx.gw)
    room = "wallet"
    app = cx.app
    with step(cx.tag("payment turns")):
        await turn(client, app, "p1", "Send 5000 shillings to +254712345678", room,
                   {"service": "payment", "params": dict(PAYMENT)})
        t2, f2 = await turn(client, app, "p2", "Send another 3000 to the same person", room,
                            {"params": {"amount": 3000}})
        check_forwarded(f2, service="payment", params=PAYMENT, what="p2")
        check_ack_state(t2.ack, "payment", PAYMENT, "p2")
        t3, f3 = await turn(client, app, "p3", "Thanks", room)
        paid = dict(PAYMENT, amount=3000)
        check_forwarded(f3, service="payment", params=paid, what="p3")
        check_ack_state(t3.ack, "payment", paid, "p3")
    with step(cx.tag("travel and payment params kept apart in one room")):
        t4, f4 = await turn(client, app, "p4", "Now a flight to Paris", room,
                            {"service": "travel", "params": {"to": "Paris"}})
        t5, f5 = await turn(client, app, "p5", "Back to the payment", room, {"service": "payment"})
        check_forwarded(f5, service="travel", params={"to": "Paris", "cabin_class": "economy"}, what="p5")
        t6, f6 = await turn(client, app, "p6", "Send it again", room)
        check_forwarded(f6, service="payment", params=paid, what="p6")
        state = await context_command(client, "context.get", room)
        check(state.get("params") == {"payment": paid, "travel": {"to": "Paris"}},
              f"context params should keep both services apart: {harness.brief(state.get('params'))}")
    await client.close()


async def part_awaiting_soft(cx):
    client = await Client.connect(cx.gw)
    user = client.hello["user"]
    app = cx.app
    options = [{"name": "KQ100", "price": 650}, {"name": "BA65", "price": 720}]
    awaiting = {"type": "selection", "options": options, "context": {"selection_type": "flight"}}
    soft = {"last_action": "added_venue", "last_item_name": "Shake Shack"}
    with step(cx.tag("awaiting forwarded with the next message, then cleared by null")):
        await turn(client, app, "a1", "Which flight do you want?", "pick",
                   {"service": "travel", "awaiting": dict(awaiting, ttl=30)})
        t2, f2 = await turn(client, app, "a2", "Tell me more about them", "pick", {"awaiting": None})
        fa = f2.get("awaiting")
        check(isinstance(fa, dict) and fa.get("type") == "selection" and fa.get("options") == options
              and fa.get("context") == awaiting["context"],
              f"a2: forwarded awaiting should be the selection set by a1: {harness.brief(f2)}")
        t3, f3 = await turn(client, app, "a3", "ok", "pick")
        check_forwarded(f3, awaiting=None, what="a3 (after awaiting: null)")
        if cx.redis:
            state = redis_state(cx.redis, user, "pick")
            check(state.get("awaiting", "absent") is None and state.get("awaiting_expires") == 0,
                  f"the state's awaiting should be gone after awaiting: null: {state}")
    with step(cx.tag("awaiting ttl 1 s, lifetimes.awaiting_s 1, soft_s 2: expiry")):
        await turn(client, app, "b1", "Pick one", "pick2", {"awaiting": dict(awaiting, ttl=1)})
        await turn(client, app, "c1", "Pick one", "pick3", {"awaiting": awaiting})  # no ttl
        s1_at = int(time.time())
        await turn(client, app, "s1", "Added Shake Shack", "soft", {"soft_context": soft})
        s1_at = (s1_at, int(time.time()))
        await turn(client, app, "t1", "Added Ichiran", "soft-ttl", {"soft_context": dict(soft, ttl=30)})
        d1_at = int(time.time())
        await turn(client, app, "d1", "Pick one", "pick4", {"awaiting": dict(awaiting, ttl=30)})
        d1_at = (d1_at, int(time.time()))
        set_at = time.monotonic()
        t, fs = await turn(client, app, "s2", "What else is there?", "soft")
        check_forwarded(fs, soft=dict(soft, source="app"), what="s2 (soft context fresh, with its source)")
        if cx.redis:
            # each ends inside the state (v's *_expires), whose TTL, the longest of params_s,
            # dialog_s and their time left, covers them
            soft_state = redis_state(cx.redis, user, "soft")
            ends = soft_state.get("soft_expires")
            check(s1_at[0] + 2 <= ends <= s1_at[1] + 2,
                  f"the soft context should end soft_s (2 s) after the turn that set it, in [{s1_at[0] + 2}, "
                  f"{s1_at[1] + 2}]: {ends!r}")
            left = ends - time.time()
            check(soft_state.get("soft_context") == dict(soft, source="app"),
                  f"the state should hold the soft context: {soft_state}")
            ttl = ttl_between(cx.redis, harness.dialog_key(user, "soft", "state"), 7100, 7200, "state of room soft")
            check(ttl >= left, f"the state's TTL {ttl} s should cover the soft context's {left:.1f} s")
            pick4 = redis_state(cx.redis, user, "pick4")
            ends = pick4.get("awaiting_expires")
            check(d1_at[0] + 30 <= ends <= d1_at[1] + 30,
                  f"the awaiting state should end its ttl (30 s) after the turn that set it, in [{d1_at[0] + 30}, "
                  f"{d1_at[1] + 30}]: {ends!r}")
            left = ends - time.time()
            check((pick4.get("awaiting") or {}).get("options") == options,
                  f"the state should hold the awaiting state's JSON: {pick4}")
            ttl = ttl_between(cx.redis, harness.dialog_key(user, "pick4", "state"), 7100, 7200, "state of room pick4")
            check(ttl >= left, f"the state's TTL {ttl} s should cover the awaiting state's {left:.1f} s")
        # the subject: the short lifetimes (awaiting ttl 1 s) lapse
        await asyncio.sleep(max(0.0, 3.2 - (time.monotonic() - set_at)))
        _, fb = await turn(client, app, "b2", "The first one", "pick2")
        check_forwarded(fb, awaiting=None, what="b2 (awaiting ttl 1 s, 3 s later)")
        _, fc = await turn(client, app, "c2", "The first one", "pick3")
        check_forwarded(fc, awaiting=None, what="c2 (awaiting_s 1, 3 s later)")
        _, fs3 = await turn(client, app, "s3", "And now?", "soft")
        check_forwarded(fs3, soft=None, what="s3 (soft_s 2, 3 s later)")
        _, ft = await turn(client, app, "t2", "And now?", "soft-ttl")
        check_forwarded(ft, soft=dict(soft, source="app"), what="t2 (the directive's ttl 30 over soft_s 2)")
        _, fd = await turn(client, app, "d2", "The first one", "pick4")
        check(isinstance(fd.get("awaiting"), dict) and fd["awaiting"].get("options") == options,
              f"d2: awaiting with ttl 30 should still be there after 3 s: {harness.brief(fd)}")
    await client.close()


async def part_history(cx):
    client = await Client.connect(cx.gw)
    user = client.hello["user"]
    app = cx.app
    n = 10
    with step(cx.tag(f"history FIFO at {n}: 12 turns, each forwarded history the last {n} messages")):
        everything = []
        for k in range(1, 13):
            text = f"history turn {k}"
            t, fwd = await turn(client, app, f"h{k}", text, "hist")
            check_forwarded(fwd, history=everything[-n:], what=f"h{k}")
            everything += [("user", text), ("assistant", t.terminal["text"])]
        state = await context_command(client, "context.get", "hist")
        check(history_pairs(state.get("history")) == everything[-n:],
              f"context history should be the last {n} messages: {harness.brief(state.get('history'), 600)}")
        if cx.redis:
            key = harness.dialog_key(user, "hist", "history")
            entries = [json.loads(e) for e in cx.redis.lrange(key)]
            check(len(entries) == n, f"{key} should hold {n} messages, holds {len(entries)}")
            check(sorted(history_pairs(entries)) == sorted(everything[-n:]),
                  f"{key} should hold the last {n} messages: {entries}")
    await client.close()


async def part_params_cap(cx):
    client = await Client.connect(cx.gw)
    user = client.hello["user"]
    app = cx.app
    with step(cx.tag("params over params_cap (10000): warning too_large, answered, nothing changed")):
        await turn(client, app, "k1", "From Nairobi", "cap", {"service": "travel", "params": {"from": "Nairobi"}})
        t2, _ = await turn(client, app, "k2", "Here are my notes", "cap", {"params": {"notes": "x" * 12000}})
        warnings = t2.warnings
        if not warnings:
            # The directive comes with done, so the warning may follow it.
            w = await client.next_matching(lambda f: f.get("type") == "warning" and f.get("id") == "k2",
                                           3.0, "warning too_large for k2")
            warnings = [w]
        check(warnings[0].get("code") == "too_large", f"k2: expected warning too_large, got {warnings}")
        check(isinstance(warnings[0].get("message"), str), f"warning without a message: {warnings[0]}")
        _, f3 = await turn(client, app, "k3", "And now?", "cap", {"params": {"notes": "y" * 5000}})
        check_forwarded(f3, service="travel", params={"from": "Nairobi", "cabin_class": "economy"},
                        what="k3 (after the refused update)")
        check(not [f for f in client.received if f.get("type") == "warning" and f.get("id") == "k3"],
              "k3: a 5000-byte param under the cap should be accepted without a warning")
        _, f4 = await turn(client, app, "k4", "Still there?", "cap",
                           {"service": "payment", "params": {"memo": "z" * 6000}})
        check(f4["params"].get("notes") == "y" * 5000,
              f"k4: the 5000-byte param should be kept whole, got {len(str(f4['params'].get('notes')))} chars")
        w = [f for f in client.received if f.get("type") == "warning" and f.get("id") == "k4"]
        w = w[0] if w else await client.next_matching(
            lambda f: f.get("type") == "warning" and f.get("id") == "k4", 3.0,
            "warning too_large for k4 (5000 + 6000 bytes over two services)")
        check(w.get("code") == "too_large", f"k4: expected too_large, got {w}")
        state = await context_command(client, "context.get", "cap")
        check("payment" not in (state.get("params") or {}),
              f"the cap is per dialog: 6000 bytes of payment params over 5000 of travel should be refused: "
              f"{harness.brief(state.get('params'))}")
        if cx.redis:
            params = redis_json_hash(cx.redis, harness.dialog_key(user, "cap", "state"))
            check(set(params) == {"travel.from", "travel.notes"} and params["travel.notes"] == "y" * 5000,
                  f"Redis params after the cap test: {harness.brief(params)}")
        check(state.get("service") == "travel",
              f"a directive refused as too_large should change nothing, but its service switch to "
              f"{state.get('service')!r} was applied")
    await client.close()


async def part_many_params(cx):
    client = await Client.connect(cx.gw)
    app = cx.app
    with step(cx.tag("200 small params are all kept (none dropped)")):
        many = {f"p{i}": i for i in range(200)}
        await turn(client, app, "m1", "Lots of details", "many", {"service": "travel", "params": many})
        _, f2 = await turn(client, app, "m2", "Got them all?", "many")
        got = {k: v for k, v in f2["params"].items() if k.startswith("p")}
        check(got == many, f"m2: forwarded params should hold the 200 names, got {len(got)}; "
                           f"missing e.g. {sorted(set(many) - set(got))[:5]}")
        state = await context_command(client, "context.get", "many")
        check(len((state.get("params") or {}).get("travel", {})) == 200,
              f"context.get should show 200 travel params, got "
              f"{len((state.get('params') or {}).get('travel', {}))}")
    await client.close()


async def part_context(cx):
    client = await Client.connect(cx.gw)
    user = client.hello["user"]
    app = cx.app
    tool = [{"flight": "KQ100", "price": 650}]
    soft = {"last_action": "searched"}
    with step(cx.tag("context.get: the state of docs/protocol.md")):
        t1, _ = await turn(client, app, "x1", "Flights Nairobi to London", "ctx",
                           {"service": "travel", "params": {"from": "Nairobi", "to": "London"},
                            "soft_context": soft, "last_tool_result": tool})
        await turn(client, app, "y1", "Keep me", "ctx2", {"service": "payment", "params": {"amount": 1}})
        state = await context_command(client, "context.get", "ctx")
        for key in ("service", "params", "awaiting", "soft_context", "history", "meta", "last_tool_result"):
            check(key in state, f"context state lacks {key!r}: {harness.brief(state)}")
        check(state["service"] == "travel" and state["params"] == {"travel": {"from": "Nairobi", "to": "London"}},
              f"context service/params: {harness.brief(state)}")
        check(state["awaiting"] is None and state["soft_context"] == dict(soft, source="app")
              and state["last_tool_result"] == tool,
              f"context awaiting/soft_context/last_tool_result: {harness.brief(state)}")
        check(history_pairs(state["history"]) == [("user", "Flights Nairobi to London"),
                                                  ("assistant", t1.terminal["text"])],
              f"context history: {state['history']}")
        check_history_ts(state["history"])
        empty = await context_command(client, "context.get", "void")
        check(empty.get("params") in ({}, None) and not empty.get("history") and empty.get("service") is None,
              f"context of a room never used should be empty: {harness.brief(empty)}")
    with step(cx.tag("context.forget travel.from")):
        state = await context_command(client, "context.forget", "ctx", keys=["travel.from"])
        check(state.get("params") == {"travel": {"to": "London"}},
              f"after forget, params should be {{'travel': {{'to': 'London'}}}}: {harness.brief(state)}")
        if cx.redis:
            params = redis_json_hash(cx.redis, harness.dialog_key(user, "ctx", "state"))
            check(params == {"travel.to": "London"}, f"Redis params after forget: {params}")
        _, f2 = await turn(client, app, "x2", "Any direct ones?", "ctx")
        check_forwarded(f2, service="travel", params={"to": "London", "cabin_class": "economy"},
                        what="x2 (after forget)")
    with step(cx.tag("context.get waits behind the reply in flight")):
        app.directives["x3"] = {"params": {"from": "Paris"}}
        await client.send_message("From Paris instead [delay=0.6]", "x3", "ctx")
        await client.send({"type": "context.get", "room": "ctx"})
        done = await client.recv_type("done", "x3", timeout=5)
        ctx_frame = await client.recv_type("context", timeout=5)
        check(client.position(done) < client.position(ctx_frame),
              "the context frame came before the done of the message sent before it")
        st = ctx_frame.get("state") or {}
        check((st.get("params") or {}).get("travel", {}).get("from") == "Paris",
              f"the context frame should show x3's directive applied: {harness.brief(st)}")
        check(history_pairs(st.get("history"))[-1] == ("assistant", state_reply_text("From Paris instead")),
              f"the context frame's history should end with x3's reply: {harness.brief(st.get('history'))}")
    with step(cx.tag("context.clear: everything of the room goes, other rooms stay")):
        state = await context_command(client, "context.clear", "ctx")
        check(state.get("params") in ({}, None) and not state.get("history") and state.get("service") is None
              and state.get("awaiting") is None and state.get("soft_context") is None
              and state.get("last_tool_result") is None,
              f"after clear the state should be empty: {harness.brief(state)}")
        if cx.redis:  # the answer does not wait for Redis (docs/protocol.md): the DEL lands soon after
            for part in ("state", "history"):
                key = harness.dialog_key(user, "ctx", part)
                gone = await harness.wait_until(lambda: cx.redis.type(key) == "none", 2.0)
                check(gone, f"{key} should be gone within 2 s of context.clear")
        _, f4 = await turn(client, app, "x4", "Start again", "ctx")
        check_forwarded(f4, service=None, params={}, soft=None, history=[], what="x4 (after clear)")
        other = await context_command(client, "context.get", "ctx2")
        check(other.get("params") == {"payment": {"amount": 1}},
              f"clearing room ctx must not touch room ctx2: {harness.brief(other)}")
    await client.close()


async def part_llm(cx, fake, llm_gw):
    client = await Client.connect(llm_gw)
    with step(cx.tag("OpenAI upstream: system + history + user; history grows on done")):
        n = len(fake.requests)
        t1 = await client.message("Plan a trip to London", mid="l1", room="chat")
        t1.expect_done()
        r1 = await fake.next_request("script", after=n)
        m1 = r1.messages
        check(len(m1) == 2 and m1[0].get("role") == "system" and SYSTEM_PROMPT in m1[0].get("content", "")
              and m1[1] == {"role": "user", "content": "Plan a trip to London"},
              f"1st request messages should be [system with the prompt, user]: {harness.brief(m1, 800)}")
        n = len(fake.requests)
        t2 = await client.message("And hotels there?", mid="l2", room="chat")
        t2.expect_done()
        m2 = (await fake.next_request("script", after=n)).messages
        check([(m.get("role"), m.get("content")) for m in m2[1:]] ==
              [("user", "Plan a trip to London"), ("assistant", t1.terminal["text"]),
               ("user", "And hotels there?")],
              f"2nd request should be system, the 1st exchange, the new message: {harness.brief(m2, 800)}")
        check(m2[0].get("role") == "system", f"2nd request should start with the system message: {m2[0]}")
        for m in m2:
            check(set(m) == {"role", "content"},
                  f"request messages should carry only role and content (strict APIs refuse more): {m}")
    with step(cx.tag("OpenAI upstream: a cancelled reply stays in history, marked cancelled")):
        await client.send_message("Write a SLOW essay", "l3", "chat")
        await client.recv_type("delta", "l3")
        await client.cancel("l3")
        t3 = await client.collect_turn("l3")
        check(t3.kind == "cancelled", f"l3 should be cancelled: {t3.describe()}")
        seen = "".join(d["text"] for d in t3.deltas)
        state = await context_command(client, "context.get", "chat")
        hist = state.get("history") or []
        check(len(hist) >= 2 and hist[-2].get("role") == "user" and hist[-2].get("content") == "Write a SLOW essay",
              f"the cancelled message's user turn should be in history: {harness.brief(hist, 800)}")
        last = hist[-1]
        full = "".join(f"w{i} " for i in range(fake.slow_words))
        check(last.get("role") == "assistant" and last.get("cancelled") is True
              and isinstance(last.get("content"), str) and last["content"]
              and full.startswith(last["content"]),
              f"the partial reply should be in history with cancelled: true: {harness.brief(last)}")
        print(f"   partial reply kept: {last['content']!r}; the client saw {seen!r}")
    with step(cx.tag("OpenAI upstream: an upstream error leaves only the user turn")):
        t4 = await client.message("This will FAIL", mid="l4", room="chat")
        t4.expect_error("upstream_error")
        state = await context_command(client, "context.get", "chat")
        hist = state.get("history") or []
        check(hist and hist[-1].get("role") == "user" and hist[-1].get("content") == "This will FAIL",
              f"after an upstream error history should end with the user's turn: {harness.brief(hist, 800)}")
        n = len(fake.requests)
        t5 = await client.message("Try again", mid="l5", room="chat")
        t5.expect_done()
        m5 = (await fake.next_request("script", after=n)).messages
        check(m5[-1] == {"role": "user", "content": "Try again"} and m5[0].get("role") == "system",
              f"request after an error: {harness.brief(m5, 800)}")
    await client.close()


async def part_llm_summary(cx, fake, app):
    """Redis only: two gateways on one Redis, auth header, one user: params kept through the
    app-side gateway show in the LLM-side gateway's system message."""
    with step(cx.tag("two gateways, one Redis: the LLM's system message summarises the kept params")):
        store = cx.redis.url
        upstreams = {"app": harness.app_upstream(app, "/state"),
                     "llm": dict(harness.openai_upstream(fake, "script"), system_prompt=SYSTEM_PROMPT)}
        config = harness.state_config(upstreams, "app", store=store, lifetimes=LIFETIMES)
        headers = {"X-User-Id": "summary-user"}
        args = ["--rules", cx.rules, "--auth", "header", "--user-header", "X-User-Id"]
        async with harness.Gateway(args, config, name="app-gateway") as gw_app, \
                harness.Gateway(args + ["--default-upstream", "llm"], config, name="llm-gateway") as gw_llm:
            c1 = await Client.connect(gw_app, expect_user="summary-user", extra_headers=headers)
            await turn(c1, app, "s-f1", "Find flights from Nairobi to London on Feb 10", "trip",
                       {"service": "travel", "params": dict(FLIGHT)})
            c2 = await Client.connect(gw_llm, expect_user="summary-user", extra_headers=headers)
            n = len(fake.requests)
            t = await c2.message("What about returning on Feb 20?", mid="s-l1", room="trip")
            t.expect_done()
            check_ack_state(t.ack, "travel", dict(FLIGHT, cabin_class="economy"), "LLM-side ack")
            msgs = (await fake.next_request("script", after=n)).messages
            system = msgs[0].get("content", "") if msgs and msgs[0].get("role") == "system" else ""
            check(SYSTEM_PROMPT in system and "travel" in system and "Nairobi" in system
                  and "London" in system and "2026-02-10" in system,
                  f"the system message should hold the prompt and a summary of service travel and its "
                  f"params: {system!r}")
            check([(m.get("role"), m.get("content")) for m in msgs[1:3]] ==
                  [("user", "Find flights from Nairobi to London on Feb 10"),
                   ("assistant", state_reply_text("Find flights from Nairobi to London on Feb 10"))],
                  f"the history from the other gateway should follow the system message: {harness.brief(msgs, 800)}")
            await c1.close()
            await c2.close()


async def part_pipelined(cx):
    """Messages of one dialog sent back to back: each sees the state the one before left."""
    client = await Client.connect(cx.gw)
    app = cx.app
    with step(cx.tag("5 messages sent at once in one dialog: each forwarded with the previous one's state")):
        for k in range(1, 6):
            app.directives[f"q{k}"] = {"service": "travel", "params": {"n": k}}
            await client.send_message(f"pipelined {k}", f"q{k}", "pipe")
        problems = []
        for k in range(1, 6):
            t = await client.collect_turn(f"q{k}")
            check_turn_done(t)
            fwd = await app.wait_message(f"q{k}")
            want = k - 1 if k > 1 else None
            if fwd["params"].get("n") != want:
                problems.append(f"q{k}: forwarded params.n {fwd['params'].get('n')!r}, expected {want!r}")
            if len(fwd["history"]) != 2 * (k - 1):
                problems.append(f"q{k}: forwarded history has {len(fwd['history'])} messages, expected {2 * (k - 1)}")
        check(not problems, "; ".join(problems))
    await client.close()


async def part_two_tabs(cx):
    """One user on two connections (a resume token), one room, turns at the same time."""
    c1 = await Client.connect(cx.gw)
    c2 = await Client.connect(f"{cx.gw.url}?resume={c1.hello['resume']}", expect_user=c1.hello["user"])
    app = cx.app
    with step(cx.tag("one user, two connections, one room, concurrent turns: neither update is lost")):
        app.directives["tab1"] = {"service": "travel", "params": {"from": "Nairobi"}}
        app.directives["tab2"] = {"service": "travel", "params": {"to": "London"}}
        await c1.send_message("From Nairobi [delay=0.4]", "tab1", "tabs")
        await asyncio.sleep(0.05)  # the scenario: tab1's turn starts first, tab2's during it
        await c2.send_message("To London [delay=0.4]", "tab2", "tabs")
        check_turn_done(await c1.collect_turn("tab1"))
        check_turn_done(await c2.collect_turn("tab2"))
        state = await context_command(c1, "context.get", "tabs")
        params = (state.get("params") or {}).get("travel", {})
        users = [c for r, c in history_pairs(state.get("history")) if r == "user"]
        check(params == {"from": "Nairobi", "to": "London"} and len(users) == 2,
              f"after two concurrent turns of one dialog (two tabs) both should be kept: params {params}, "
              f"user turns in history {users}")
    await c1.close()
    await c2.close()


async def part_unicode(cx):
    client = await Client.connect(cx.gw)
    app = cx.app
    values = {"to": "Zürich 東京", "note": 'emoji 🎉 "quotes" \\ back\\slash\nnewline', "n": 1.5,
              "list": [1, "two", {"three": None}], "flag": False}
    with step(cx.tag("non-ASCII and structured values round-trip (params, history)")):
        text = "Flüge nach Zürich 🎉 — 東京?"
        t1, _ = await turn(client, app, "u1", text, "uni", {"service": "travel", "params": values})
        _, f2 = await turn(client, app, "u2", "and?", "uni")
        check_forwarded(f2, service="travel", params=dict(values, cabin_class="economy"),
                        history=[("user", text), ("assistant", t1.terminal["text"])], what="u2")
    with step(cx.tag("a param value with U+0000 is kept or refused with a warning, never dropped silently")):
        app.directives["u3"] = {"params": {"nul": "a\u0000b"}}
        t3 = await client.message("nul", mid="u3", room="uni")
        check(t3.kind == "done", f"a done whose state holds a U+0000 (valid JSON, RFC 8259) should still "
                                 f"reach the client: {t3.describe()}")
        _, f4 = await turn(client, app, "u4", "and now?", "uni")
        warned = [f for f in client.received if f.get("type") == "warning" and f.get("id") == "u3"]
        kept = f4["params"].get("nul")
        check(kept == "a\u0000b" or warned,
              f"a param value with U+0000: forwarded as {kept!r} and no warning (silently dropped)")
        check(f4["params"].get("to") == "Zürich 東京",
              f"the other params should survive a U+0000 value: {harness.brief(f4['params'])}")
    await client.close()


async def part_redis_password(app, rules):
    """Redis with requirepass: the password in the store URL (percent-decoded, as in any URL);
    a wrong one gives store_degraded (the gateway still answers)."""
    plain = await harness.RedisServer(password="s3cret").astart()
    spaced = await harness.RedisServer(password="s3cret pass/word").astart()
    cases = (("the right password", f"redis://:s3cret@127.0.0.1:{plain.port}", plain, True),
             ("a percent-encoded password (s3cret%20pass%2Fword)",
              f"redis://:s3cret%20pass%2Fword@127.0.0.1:{spaced.port}", spaced, True),
             ("a wrong password", f"redis://:wrong@127.0.0.1:{plain.port}", plain, False))
    try:
        for n, (what, url, redis, ok) in enumerate(cases):
            config = harness.state_config({"app": harness.app_upstream(app, "/state")}, "app", store=url)
            async with harness.Gateway(["--rules", rules], config, name=f"gateway-password-{n}") as gw:
                with step(f"[redis] requirepass, store URL with {what}"):
                    client = await Client.connect(gw)
                    user = client.hello["user"]
                    t1, _ = await turn(client, app, f"pw{n}a", "hello", "trip",
                                       {"service": "travel", "params": {"from": "Nairobi"}})
                    _, f = await turn(client, app, f"pw{n}b", "again", "trip")
                    check(f["params"].get("from") == "Nairobi", f"params kept: {f['params']}")
                    key = harness.dialog_key(user, "trip", "state")
                    if ok:
                        check(not t1.warnings, f"a warning with {what}: {t1.warnings}")
                        check(redis.params_hash(key) == {"travel.from": '"Nairobi"'},
                              f"{key}: {redis.hgetall(key)}")
                    else:
                        check([w.get("code") for w in t1.warnings] == ["store_degraded"],
                              f"a wrong password should give store_degraded: {t1.describe()}")
                        check(redis.type(key) == "none", f"{key} written with a wrong password?")
                    await client.close()
    finally:
        plain.cleanup(keep=True)
        spaced.cleanup(keep=True)


async def part_memory_bound(app, rules):
    """Memory store with max_dialogs 3: the least recently used dialog goes first."""
    config = harness.state_config({"app": harness.app_upstream(app, "/state")}, "app", max_dialogs=3)
    async with harness.Gateway(["--rules", rules], config, name="gateway-max-dialogs") as gw:
        with step("[memory] max_dialogs 3: the least recently used dialog is dropped"):
            client = await Client.connect(gw)
            for room in ("r1", "r2", "r3"):
                await turn(client, app, f"mb-{room}", f"hello {room}", room,
                           {"service": "travel", "params": {"room": room}})
            await turn(client, app, "mb-r1-again", "r1 again", "r1")  # r1 used last: r2 is the oldest
            await turn(client, app, "mb-r4", "hello r4", "r4", {"service": "travel", "params": {"room": "r4"}})
            kept = {}
            for room in ("r1", "r2", "r3", "r4"):
                state = await context_command(client, "context.get", room)
                kept[room] = (state.get("params") or {}).get("travel", {}).get("room")
            check(kept["r2"] is None, f"r2 (least recently used) should have been dropped: {kept}")
            check(kept["r1"] == "r1" and kept["r4"] == "r4", f"r1 (used again) and r4 (new) should be kept: {kept}")
            await client.close()


async def part_redis_db_prefix(app, rules, redis):
    """redis://HOST:PORT/3 and redis.prefix: the keys land in database 3 under the prefix."""
    config = harness.state_config({"app": harness.app_upstream(app, "/state")}, "app",
                                  store=redis.url + "/3", redis={"prefix": "cgtest"})
    async with harness.Gateway(["--rules", rules], config, name="gateway-db3") as gw:
        with step("[redis] store redis://.../3 and prefix cgtest: keys in database 3 under cgtest:"):
            client = await Client.connect(gw)
            user = client.hello["user"]
            await turn(client, app, "db1", "hello", "trip", {"service": "travel", "params": {"from": "Nairobi"}})
            _, f = await turn(client, app, "db2", "again", "trip")
            check(f["params"].get("from") == "Nairobi", f"params with DB 3: {f['params']}")
            key = harness.dialog_key(user, "trip", "state", prefix="cgtest")
            got = redis.command("HGETALL", key, db=3)
            got = dict(zip(got[::2], got[1::2]))
            v = json.loads(got.get("v", "null"))
            check(isinstance(v, dict) and v.get("params") == {"travel": {"from": "Nairobi"}} and "#" in got.get("rev", ""),
                  f"{key} in DB 3 should hold travel.from (and a rev): {got}; "
                  f"DB 3 keys: {redis.command('KEYS', '*', db=3)}")
            check(not redis.keys(f"*{user}*"), f"keys of this user in DB 0: {redis.keys(f'*{user}*')}")
            await client.close()


async def run_mode(mode, app, fake, rules):
    redis = None
    if mode == "redis":
        redis = await harness.RedisServer().astart()
        store = redis.url
        extra = {"history_n": 10, "params_cap": 10000}
    else:
        store = "memory"
        extra = {}
    upstreams = {"app": harness.app_upstream(app, "/state"),
                 "llm": dict(harness.openai_upstream(fake, "script"), system_prompt=SYSTEM_PROMPT)}
    config = harness.state_config(upstreams, "app", store=store, lifetimes=LIFETIMES, **extra)
    try:
        async with harness.Gateway(["--rules", rules], config, name=f"gateway-{mode}") as gw, \
                harness.Gateway(["--rules", rules, "--default-upstream", "llm"], config,
                                name=f"llm-gateway-{mode}") as llm_gw:
            cx = Ctx(mode, app, fake, gw, redis, rules)
            await independent(part_flight(cx))
            await independent(part_payment(cx))
            await independent(part_awaiting_soft(cx))
            await independent(part_history(cx))
            await independent(part_params_cap(cx))
            await independent(part_many_params(cx))
            await independent(part_context(cx))
            await independent(part_llm(cx, fake, llm_gw))
            await independent(part_pipelined(cx))
            await independent(part_two_tabs(cx))
            await independent(part_unicode(cx))
            if redis:
                await independent(part_llm_summary(cx, fake, app))
                await independent(part_redis_db_prefix(app, rules, redis))
                await independent(part_redis_password(app, rules))
            else:
                await independent(part_memory_bound(app, rules))
            gw.assert_alive()
            llm_gw.assert_alive()
    finally:
        if redis:
            redis.cleanup(keep=True)


async def main(args):
    rules = harness.empty_rules_dir()
    async with harness.FakeApp() as app, harness.FakeOpenAI() as fake:
        fake.slow_words = 60
        fake.slow_interval = 0.05
        for mode in ("memory", "redis"):
            await independent(run_mode(mode, app, fake, rules))


if __name__ == "__main__":
    harness.run(main, timeout=100)
