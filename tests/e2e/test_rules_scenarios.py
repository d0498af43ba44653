"""End-to-end scenarios of the rules engine with the shipped rules/ (issue 4; the scenarios
of docs/scenarios.md, with docs/protocol.md and docs/state.md).

The gateway runs with `--rules <repo>/rules` (or a temporary copy of it) and
CHATGATE_NOW=2026-02-03T10:00:00Z, so "next week" is 2026-02-10 and "Feb 20" 2026-02-20.
Upstreams: the harness's state app (FakeApp /state: records every forwarded frame, its done
carries the state directive a test scripted) and a fake OpenAI server (/ok echoes the last
user message). Each turn checks the client's `ack` and the frame the upstream received.

- the flight search: "Find me flights from Nairobi to London next week", "What about
  returning on Feb 20?" (not enriched: a param, not a follow-up), "Show me business class
  options", "Flights from Mombasa (not Nairobi) to London": ack.service travel, ack.params and
  the forwarded params merged turn by turn; "Business class please" gives cabin_class
  "business" (lowercase, as the scenario's values);
- the payment: "Send 5000 shillings to +254712345678" (amount 5000, currency KES, recipient),
  "Send another 3000 to the same person" (amount 3000, recipient and currency kept);
- params expiry: lifetimes.params_s 2: "Flights to London on Feb 10", "Business class please"
  (kept), 2.6 s later "Return date Feb 20" gives only return_date;
- the selection of a listed option, with a gateway whose default upstream is the LLM and a route rule
  that sends "add ..." to the app: the app sets awaiting selection (3 Shake Shacks); "in
  Shibuya" -> resolution selection index 1 with the option, sent to the app that asked (not
  the default); "2", "the second one", "the Shinjuku one" -> index 2 (each in its own room);
  then awaiting metadata: "get the shroom burger" -> resolution metadata must_try
  "shroom burger", annotations too; after that, a message goes to the default again;
- the weather follow-up: "What's the weather in Tokyo?" then "And tomorrow?": ack.enriched is "What's the
  weather in Tokyo tomorrow?", the LLM's last user message is that text, the app's frame
  carries it in `enriched` with the original `text`;
- the cancel phrases: awaiting selection, "nevermind": ack.resolution cancel, forwarded (to the default
  upstream, not the app that asked), awaiting cleared (context.get); "stop" while a reply
  streams: that reply gets `cancelled` at once (the app gets a cancel frame), "stop" itself
  gets ack and done; the same with a slow LLM reply (its HTTP request is closed);
- "forget my origin" drops travel.from, "forget the dates" both dates; awaiting
  confirmation: "yes" and "👍" -> confirmed true, "👎" -> false, "nope" cancels (cancel
  wins); awaiting input: "nevermind" cancels, other text is the input; "yes" with nothing
  awaited resolves nothing; a vibe word outside awaiting is only an annotation;
- `chatgate rules check rules/` exits 0, `rules explain` prints JSON; a broken set (bad regex, unknown keyword, failing
  expect) exits non-zero naming file:line (and PCRE2's error and offset for the regex);
  the gateway started with a broken --rules exits 2 naming file:line;
- SIGHUP reload: a new rule file (`cancel absorb` of "hush") fires after the signal; a
  broken file then is refused (logged with file:line) and the running set stays.
"""

import asyncio
import json
import os
import shutil
import signal
import subprocess
import time

import harness
from harness import Client, check, context_command, independent, step

NOW = "2026-02-03T10:00:00Z"
ENV = {"CHATGATE_NOW": NOW}
SHIPPED = harness.REPO_ROOT / "rules"
TURN_TIMEOUT = harness.DEFAULT_TIMEOUT

OPTIONS = [{"name": "Shake Shack", "district": "Shibuya"},
           {"name": "Shake Shack", "district": "Shinjuku"},
           {"name": "Shake Shack", "district": "Harajuku"}]
SELECTION = {"type": "selection", "options": OPTIONS, "context": {"selection_type": "venue"}, "ttl": 60}
METADATA = {"type": "metadata", "context": {"target_item_name": "Shake Shack Shibuya"}, "ttl": 60}
CONFIRMATION = {"type": "confirmation", "context": {"action": "delete_all_venues"}, "ttl": 60}
INPUT = {"type": "input", "context": {"field": "trip_name"}, "ttl": 60}

# A route rule of the tests' own, next to the shipped ones: "add ..." goes to the app.
ROUTE_RULE = """# test only: "add shake shack" goes to the trip planner app
rule to_app
  match   ^\\s*add\\s
  do      route app
  expect  "add shake shack"
  reject  "what should I add?"

# test only: a long story comes from the slow LLM (a word every 100 ms)
rule to_slow
  match   ^\\s*tell me a long story
  do      route slow
  expect  "tell me a long story"
"""


def rules_config(upstreams, default, **extra):
    """A gateway config: memory store, no service defaults, no rate limit in the way."""
    cfg = harness.make_config(upstreams, default, store="memory",
                              rate_limit={"messages_per_second": 100_000, "burst": 100_000})
    cfg.update(extra)
    return cfg


def rules_copy(extra=None):
    """A temporary copy of the shipped rules/, plus `extra` {file name: text}."""
    path = harness.temp_dir("chatgate-e2e-rules-")
    for f in SHIPPED.glob("*.rules"):
        shutil.copy(f, path / f.name)
    for name, text in (extra or {}).items():
        (path / name).write_text(text)
    return path


def check_ack(t, mid, room, route, service=harness.ANY, params=harness.ANY, resolution=harness.ANY,
              enriched=harness.ANY, fired=(), not_fired=()):
    """The ack of turn t: the fields of docs/protocol.md, Server frames, and the ones given."""
    ack = t.ack
    check(ack is not None, f"no ack for {mid}: {t.describe()}")
    for key in ("type", "id", "room", "route", "service", "params", "enriched", "resolution", "rules"):
        check(key in ack, f"{mid}: ack has no {key!r}: {harness.brief(ack)}")
    check(ack["id"] == mid and ack["room"] == room, f"{mid}: ack id/room: {harness.brief(ack)}")
    check(ack["route"] == route, f"{mid}: ack.route should be {route!r}, got {ack['route']!r}")
    for key, want in (("service", service), ("params", params), ("resolution", resolution),
                      ("enriched", enriched)):
        if want is not harness.ANY:
            check(ack[key] == want, f"{mid}: ack.{key} should be {harness.brief(want)}, got "
                                    f"{harness.brief(ack[key])}\nack: {harness.brief(ack, 600)}")
    rules = ack["rules"]
    check(isinstance(rules, list), f"{mid}: ack.rules should be a list: {harness.brief(ack)}")
    for name in fired:
        check(name in rules, f"{mid}: rule {name!r} should have fired; ack.rules = {rules}")
    for name in not_fired:
        check(name not in rules, f"{mid}: rule {name!r} should not have fired; ack.rules = {rules}")
    return ack


def check_fwd(fwd, mid, text, service=harness.ANY, params=harness.ANY, resolution=harness.ANY,
              enriched=harness.ANY, route=harness.ANY, annotations=harness.ANY):
    """The message frame the app received for mid (docs/protocol.md, Upstreams)."""
    for key in ("type", "id", "user", "room", "text", "enriched", "route", "service", "params", "awaiting",
                "resolution", "soft_context", "history", "rules", "annotations"):
        check(key in fwd, f"{mid}: the forwarded frame has no {key!r}: {harness.brief(fwd, 600)}")
    check(fwd["type"] == "message" and fwd["id"] == mid, f"{mid}: forwarded frame: {harness.brief(fwd)}")
    check(fwd["text"] == text, f"{mid}: forwarded text should be what the user wrote, {text!r}: {fwd['text']!r}")
    for key, want in (("service", service), ("params", params), ("resolution", resolution),
                      ("enriched", enriched), ("route", route), ("annotations", annotations)):
        if want is not harness.ANY:
            check(fwd[key] == want, f"{mid}: forwarded {key} should be {harness.brief(want)}, got "
                                    f"{harness.brief(fwd[key])}")


async def app_turn(client, app, mid, text, room, state=None):
    """A message answered by the state app: (turn, forwarded frame)."""
    if state is not None:
        app.directives[mid] = state
    t = await client.message(text, mid=mid, room=room, timeout=TURN_TIMEOUT)
    harness.check_turn_done(t)
    check(t.terminal.get("text") == harness.state_reply_text(text), f"{mid}: reply not the app's: {t.describe()}")
    return t, await app.wait_message(mid)


async def llm_turn(client, fake, mid, text, room):
    """A message answered by the fake LLM (/ok): (turn, request)."""
    n = len(fake.requests)
    t = await client.message(text, mid=mid, room=room, timeout=TURN_TIMEOUT)
    harness.check_turn_done(t)
    req = await fake.next_request("ok", after=n)
    return t, req


def not_forwarded_to_app(app, mid):
    check(app.message_frame(mid) is None, f"{mid} should not have reached the app: {harness.brief(app.message_frame(mid))}")


# --------------------------------------------------------------------------------------
# The flight search and the payment (docs/scenarios.md)


FLIGHT = {"from": "Nairobi", "to": "London", "departure_date": "2026-02-10"}


async def part_flights(gw, app):
    client = await Client.connect(gw)
    client.track()
    room = "flights"
    with step("flight search, turn 1: 'Find me flights from Nairobi to London next week'"):
        text = "Find me flights from Nairobi to London next week"
        t, f = await app_turn(client, app, "fl1", text, room)
        check_ack(t, "fl1", room, "app", service="travel", params=FLIGHT, resolution=None, enriched=None,
                  fired=("flight_route", "departure_date"))
        check_fwd(f, "fl1", text, service="travel", params=FLIGHT, resolution=None, enriched=None, route="app")
    with step("turn 2: 'What about returning on Feb 20?' adds return_date, keeps the rest, no enrichment"):
        text = "What about returning on Feb 20?"
        t, f = await app_turn(client, app, "fl2", text, room)
        want = dict(FLIGHT, return_date="2026-02-20")
        check_ack(t, "fl2", room, "app", service="travel", params=want, enriched=None, resolution=None,
                  fired=("return_date",), not_fired=("departure_date", "departure_date_short", "followup_when"))
        check_fwd(f, "fl2", text, service="travel", params=want, enriched=None)
    with step("turn 3: 'Show me business class options' adds cabin_class business"):
        text = "Show me business class options"
        t, f = await app_turn(client, app, "fl3", text, room)
        want = dict(FLIGHT, return_date="2026-02-20", cabin_class="business")
        check_ack(t, "fl3", room, "app", service="travel", params=want, fired=("cabin_class",))
        check_fwd(f, "fl3", text, service="travel", params=want)
    with step("'Flights from Mombasa (not Nairobi) to London' overrides the kept origin"):
        text = "Flights from Mombasa (not Nairobi) to London"
        t, f = await app_turn(client, app, "fl4", text, room)
        want = dict(FLIGHT, return_date="2026-02-20", cabin_class="business", **{"from": "Mombasa"})
        check_ack(t, "fl4", room, "app", service="travel", params=want, fired=("flight_route",))
        check_fwd(f, "fl4", text, params=want)
    with step("'for two adults' adds passenger_count 2 (a number); context.get shows the params"):
        t, f = await app_turn(client, app, "fl5", "for two adults", room)
        want = dict(FLIGHT, return_date="2026-02-20", cabin_class="business", passenger_count=2,
                    **{"from": "Mombasa"})
        check_ack(t, "fl5", room, "app", service="travel", params=want, fired=("passenger_count",))
        state = await context_command(client, "context.get", room)
        check(state.get("service") == "travel" and state.get("params") == {"travel": want},
              f"context.get after the flight turns: {harness.brief(state, 600)}")
    await client.close()


async def part_cabin_case(gw, app):
    client = await Client.connect(gw)
    with step("'Business class please' gives cabin_class 'business' (values: economy|business|first)"):
        t, f = await app_turn(client, app, "cc1", "Business class please", "cabin")
        ack = check_ack(t, "cc1", "cabin", "app", service="travel", fired=("cabin_class",))
        check(ack["params"].get("cabin_class") == "business",
              f"cabin_class should be the lowercase value 'business', got {ack['params'].get('cabin_class')!r} "
              f"(the rule format has no way to lowercase a captured value)")
    await client.close()


PAYMENT = {"amount": 5000, "currency": "KES", "recipient": "+254712345678"}


async def part_payment(gw, app):
    client = await Client.connect(gw)
    client.track()
    room = "wallet"
    with step("payment, turn 1: 'Send 5000 shillings to +254712345678'"):
        text = "Send 5000 shillings to +254712345678"
        t, f = await app_turn(client, app, "pay1", text, room)
        check_ack(t, "pay1", room, "app", service="payment", params=PAYMENT,
                  fired=("payment_amount", "payment_recipient"), not_fired=("destination", "flight_route"))
        check_fwd(f, "pay1", text, service="payment", params=PAYMENT)
        check(isinstance(t.ack["params"]["amount"], int), f"amount should be a JSON number: {t.ack['params']}")
    with step("turn 2: 'Send another 3000 to the same person' keeps recipient and currency"):
        text = "Send another 3000 to the same person"
        t, f = await app_turn(client, app, "pay2", text, room)
        want = dict(PAYMENT, amount=3000)
        check_ack(t, "pay2", room, "app", service="payment", params=want, fired=("payment_amount",),
                  not_fired=("payment_recipient",))
        check_fwd(f, "pay2", text, service="payment", params=want)
    with step("'Pay $20 to jane@example.com' in another room: amount 20, USD, an e-mail recipient"):
        t, f = await app_turn(client, app, "pay3", "Pay $20 to jane@example.com", "wallet2")
        check_ack(t, "pay3", "wallet2", "app", service="payment",
                  params={"amount": 20, "currency": "USD", "recipient": "jane@example.com"})
    await client.close()


async def part_expiry(app):
    config = rules_config({"app": harness.app_upstream(app, "/state")}, "app",
                          lifetimes={"params_s": 2, "dialog_s": 3600, "history_s": 3600})
    async with harness.Gateway(["--rules", str(SHIPPED)], config, env=ENV, name="gateway-ttl") as gw:
        client = await Client.connect(gw)
        room = "expiry"
        with step("params expiry (params_s 2): 'Flights to London on Feb 10', 'Business class please' kept"):
            t, f = await app_turn(client, app, "ex1", "Flights to London on Feb 10", room)
            first = {"to": "London", "departure_date": "2026-02-10"}
            check_ack(t, "ex1", room, "app", service="travel", params=first, fired=("destination", "departure_date"))
            t, f = await app_turn(client, app, "ex2", "Business class please", room)
            ack = check_ack(t, "ex2", room, "app", service="travel", fired=("cabin_class",))
            got = dict(ack["params"])
            check(str(got.pop("cabin_class", "")).lower() == "business" and got == first,
                  f"ex2: params should be {first} and cabin_class business: {ack['params']}")
            check_fwd(f, "ex2", "Business class please", params=ack["params"])
            written = time.monotonic()
        with step("after the 2 s lifetime: 'Return date Feb 20' has only return_date"):
            await asyncio.sleep(max(0.0, 2.6 - (time.monotonic() - written)))  # the subject: the 2 s lifetime
            t, f = await app_turn(client, app, "ex3", "Return date Feb 20", room)
            check_ack(t, "ex3", room, "app", service="travel", params={"return_date": "2026-02-20"},
                      fired=("return_date",))
            check_fwd(f, "ex3", "Return date Feb 20", params={"return_date": "2026-02-20"})
        await client.close()


# --------------------------------------------------------------------------------------
# Selection, follow-up and cancel (docs/scenarios.md)


async def set_selection(client, app, room, mid):
    """'add shake shack' routed to the app by the test's route rule; the app sets awaiting."""
    t, f = await app_turn(client, app, mid, "add shake shack", room, {"awaiting": SELECTION})
    check_ack(t, mid, room, "app", resolution=None, fired=("to_app",))
    return t, f


async def part_flow1(gw, app, fake):
    client = await Client.connect(gw)
    client.track()
    room = "trip"
    with step("selection: the app sets awaiting selection; 'in Shibuya' -> option 1, to the app that asked"):
        await set_selection(client, app, room, "s1")
        state = await context_command(client, "context.get", room)
        aw = state.get("awaiting")
        check(isinstance(aw, dict) and aw.get("type") == "selection" and aw.get("options") == OPTIONS,
              f"context.get should show the awaited selection: {harness.brief(state, 600)}")
        want = {"type": "selection", "index": 1, "option": OPTIONS[0]}
        t, f = await app_turn(client, app, "s2", "in Shibuya", room, {"awaiting": METADATA})
        check_ack(t, "s2", room, "app", resolution=want, enriched=None)
        check_fwd(f, "s2", "in Shibuya", resolution=want, route="app")
        check(isinstance(f["awaiting"], dict) and f["awaiting"].get("type") == "selection",
              f"s2: the forwarded awaiting should be the selection it resolves: {harness.brief(f['awaiting'])}")
    with step("then awaiting metadata: 'get the shroom burger' -> must_try 'shroom burger', to the app"):
        want = {"type": "metadata", "metadata_type": "must_try", "content": "shroom burger"}
        t, f = await app_turn(client, app, "s3", "get the shroom burger", room)
        check_ack(t, "s3", room, "app", resolution=want, fired=("must_try",))
        check_fwd(f, "s3", "get the shroom burger", resolution=want,
                  annotations={"metadata": {"must_try": "shroom burger"}})
    with step("awaiting cleared: the next message goes to the default upstream (the LLM)"):
        state = await context_command(client, "context.get", room)
        check(state.get("awaiting") is None, f"awaiting should be cleared: {harness.brief(state.get('awaiting'))}")
        t, req = await llm_turn(client, fake, "s4", "get the fries too", room)
        check_ack(t, "s4", room, "llm", resolution=None, not_fired=("must_try",))
    for k, (text, index) in enumerate((("2", 2), ("the second one", 2), ("#3", 3), ("the Shinjuku one", 2),
                                       ("number 1", 1))):
        with step(f"selection {text!r} in its own room -> index {index}"):
            room_k = f"pick{k}"
            await set_selection(client, app, room_k, f"p{k}a")
            want = {"type": "selection", "index": index, "option": OPTIONS[index - 1]}
            t, f = await app_turn(client, app, f"p{k}b", text, room_k)
            check_ack(t, f"p{k}b", room_k, "app", resolution=want)
            check_fwd(f, f"p{k}b", text, resolution=want)
    with step("an unresolved message ('what time is it?') goes on normally; the selection stays"):
        room_u = "pick-unresolved"
        await set_selection(client, app, room_u, "u1")
        t, req = await llm_turn(client, fake, "u2", "what time is it?", room_u)
        check_ack(t, "u2", room_u, "llm", resolution=None)
        state = await context_command(client, "context.get", room_u)
        check((state.get("awaiting") or {}).get("type") == "selection",
              f"an unresolved message should leave the selection: {harness.brief(state.get('awaiting'))}")
    await client.close()


async def part_flow2_llm(gw, fake):
    client = await Client.connect(gw)
    client.track()
    room = "weather"
    with step("weather follow-up (LLM): 'What's the weather in Tokyo?' then 'And tomorrow?' -> enriched"):
        t, req = await llm_turn(client, fake, "w1", "What's the weather in Tokyo?", room)
        check_ack(t, "w1", room, "llm", enriched=None, service=None, params={})
        check(req.last_user_text == "What's the weather in Tokyo?", f"w1 request: {req.describe()}")
        enriched = "What's the weather in Tokyo tomorrow?"
        t, req = await llm_turn(client, fake, "w2", "And tomorrow?", room)
        check_ack(t, "w2", room, "llm", enriched=enriched, resolution=None, service=None, params={},
                  fired=("followup_when",))
        check(req.last_user_text == enriched,
              f"the LLM's last user message should be the enriched text {enriched!r}: {req.describe()}")
    await client.close()


async def part_flow2_app(gw, app):
    client = await Client.connect(gw)
    room = "weather-app"
    with step("weather follow-up (app): the forwarded frame has text 'And tomorrow?' and the enriched text"):
        await app_turn(client, app, "wa1", "What's the weather in Tokyo?", room)
        enriched = "What's the weather in Tokyo tomorrow?"
        t, f = await app_turn(client, app, "wa2", "And tomorrow?", room)
        check_ack(t, "wa2", room, "app", enriched=enriched)
        check_fwd(f, "wa2", "And tomorrow?", enriched=enriched)
    with step("'and in Osaka?' after 'What's the weather in Tokyo?' is enriched with the place"):
        await app_turn(client, app, "wa3", "What's the weather in Tokyo?", "weather-osaka")
        t, f = await app_turn(client, app, "wa4", "and in Osaka?", "weather-osaka")
        check_ack(t, "wa4", "weather-osaka", "app", enriched="What's the weather in Tokyo, and in Osaka?")
    with step("a vibe word outside any awaiting is an annotation only: 'Find a romantic restaurant in Paris'"):
        t, f = await app_turn(client, app, "wa6", "Find a romantic restaurant in Paris", "annotations")
        check_ack(t, "wa6", "annotations", "app", resolution=None, enriched=None, fired=("vibe_word",))
        check_fwd(f, "wa6", "Find a romantic restaurant in Paris", annotations={"metadata": {"vibe": "romantic"}})
    with step("a first message is never enriched ('And tomorrow?' with no history)"):
        t, f = await app_turn(client, app, "wa5", "And tomorrow?", "weather-fresh")
        check_ack(t, "wa5", "weather-fresh", "app", enriched=None, not_fired=("followup_when",))
    await client.close()


async def part_flow3_cancel(gw, app):
    client = await Client.connect(gw)
    client.track()
    room = "flow3"
    with step("cancel: awaiting selection, 'nevermind' -> resolution cancel, forwarded, awaiting cleared"):
        await app_turn(client, app, "c1", "add shake shack", room, {"awaiting": SELECTION})
        t, f = await app_turn(client, app, "c2", "nevermind", room)
        check_ack(t, "c2", room, "app", resolution={"type": "cancel"}, fired=("cancel",))
        check_fwd(f, "c2", "nevermind", resolution={"type": "cancel"})
        state = await context_command(client, "context.get", room)
        check(state.get("awaiting") is None, f"awaiting should be cleared by the cancel: {harness.brief(state)}")
    with step("'stop' while a reply streams: that reply is cancelled at once; 'stop' gets ack and done"):
        await client.send_message("tell me a long story [delay=5]", "c3", room)
        await client.recv_type("ack", "c3")
        await client.recv_type("delta", "c3")
        started = time.monotonic()
        await client.send_message("stop", "c4", room)
        first = await client.collect_turn("c3", timeout=4.0)
        took = time.monotonic() - started
        check(first.kind == "cancelled", f"c3 should be cancelled by 'stop': {first.describe()}")
        check(took < 1.5, f"c3 was cancelled {took:.2f}s after 'stop' (its reply had 5 s to go): not at once")
        print(f"   the streaming reply was cancelled {took * 1000:.0f} ms after 'stop'")
        t = await client.collect_turn("c4", timeout=TURN_TIMEOUT)
        harness.check_turn_done(t)
        check_ack(t, "c4", room, "app", resolution={"type": "cancel"}, fired=("cancel",))
        conn_cancels = [c for conn in app.connections for c in conn.cancels if c[0] == "c3"]
        check(conn_cancels, "the app got no cancel frame for c3")
        f = await app.wait_message("c4")
        check_fwd(f, "c4", "stop", resolution={"type": "cancel"})
    with step("'stop the car at the bridge' is no cancel"):
        t, f = await app_turn(client, app, "c5", "stop the car at the bridge", room)
        check_ack(t, "c5", room, "app", resolution=None, not_fired=("cancel",))
    await client.close()


async def part_flow3_default_route(gw, app, fake):
    client = await Client.connect(gw)
    room = "flow3-route"
    with step("cancel of an app's selection goes to the default upstream (LLM), not the app that asked"):
        await set_selection(client, app, room, "r1")
        t, req = await llm_turn(client, fake, "r2", "never mind", room)
        check_ack(t, "r2", room, "llm", resolution={"type": "cancel"}, fired=("cancel",))
        not_forwarded_to_app(app, "r2")
        check(req.last_user_text == "never mind", f"r2 request: {req.describe()}")
        state = await context_command(client, "context.get", room)
        check(state.get("awaiting") is None, f"awaiting should be cleared: {harness.brief(state)}")
    await client.close()


async def part_stop_llm(gw, fake):
    client = await Client.connect(gw)
    client.track()
    room = "stop-llm"
    with step("'stop' while the LLM streams: cancelled at once, the upstream request closed; 'stop' answered"):
        n = len(fake.requests)
        await client.send_message("tell me a long story", "sl1", room)
        ack = await client.recv_type("ack", "sl1")
        check(ack.get("route") == "slow" and "to_slow" in ack.get("rules", []),
              f"sl1 should be routed to 'slow' by the test's route rule: {harness.brief(ack)}")
        await client.recv_type("delta", "sl1")
        req = await fake.next_request("slow", after=n)
        started = time.monotonic()
        await client.send_message("stop", "sl2", room)
        first = await client.collect_turn("sl1", timeout=4.0)
        check(first.kind == "cancelled" and time.monotonic() - started < 1.5,
              f"sl1 should be cancelled at once by 'stop': {first.describe()}")
        closed = await req.wait_closed(max(0.0, started + 1.5 - time.monotonic()))
        check(closed, "the gateway did not close the slow upstream request within 1.5 s of 'stop'")
        t = await client.collect_turn("sl2", timeout=TURN_TIMEOUT)
        harness.check_turn_done(t)
        check_ack(t, "sl2", room, "llm", resolution={"type": "cancel"}, fired=("cancel",))
        check(t.terminal.get("text") == "echo: stop", f"sl2 should be answered by the LLM: {t.describe()}")
    await client.close()


# --------------------------------------------------------------------------------------
# forget, confirmation


async def part_forget(gw, app):
    client = await Client.connect(gw)
    room = "forget"
    with step("'forget my origin' drops travel.from; 'forget the dates' both dates"):
        await app_turn(client, app, "fg1", "Find me flights from Nairobi to London next week", room)
        await app_turn(client, app, "fg2", "What about returning on Feb 20?", room)
        t, f = await app_turn(client, app, "fg3", "forget my origin", room)
        want = {"to": "London", "departure_date": "2026-02-10", "return_date": "2026-02-20"}
        check_ack(t, "fg3", room, "app", service="travel", params=want, fired=("forget_origin",),
                  not_fired=("cancel",))
        check_fwd(f, "fg3", "forget my origin", params=want)
        state = await context_command(client, "context.get", room)
        check(state.get("params") == {"travel": want}, f"context after forget: {harness.brief(state.get('params'))}")
        t, f = await app_turn(client, app, "fg4", "forget the dates", room)
        check_ack(t, "fg4", room, "app", params={"to": "London"},
                  fired=("forget_departure_date", "forget_return_date"))
        state = await context_command(client, "context.get", room)
        check(state.get("params") == {"travel": {"to": "London"}},
              f"context after forgetting the dates: {harness.brief(state.get('params'))}")
    await client.close()


async def part_confirm(gw, app):
    client = await Client.connect(gw)
    client.track()
    cases = (("yes", True, "confirm_yes"), ("👍", True, "confirm_yes"), ("Yes, do it", True, "confirm_yes"),
             ("👎", False, "confirm_no"), ("no", False, "confirm_no"))
    for k, (text, confirmed, rule) in enumerate(cases):
        with step(f"awaiting confirmation, {text!r} -> confirmed {confirmed}, to the app"):
            room = f"confirm{k}"
            await app_turn(client, app, f"y{k}a", "delete all venues", room, {"awaiting": CONFIRMATION})
            want = {"type": "confirmation", "confirmed": confirmed}
            t, f = await app_turn(client, app, f"y{k}b", text, room)
            check_ack(t, f"y{k}b", room, "app", resolution=want, fired=(rule,))
            check_fwd(f, f"y{k}b", text, resolution=want)
            state = await context_command(client, "context.get", room)
            check(state.get("awaiting") is None, f"awaiting should be cleared: {harness.brief(state)}")
    with step("awaiting confirmation, 'nope' cancels (cancel rules win over confirm rules)"):
        await app_turn(client, app, "yn1", "delete all venues", "confirm-nope", {"awaiting": CONFIRMATION})
        t, f = await app_turn(client, app, "yn2", "nope", "confirm-nope")
        check_ack(t, "yn2", "confirm-nope", "app", resolution={"type": "cancel"}, fired=("cancel",))
    with step("awaiting input: 'nevermind' cancels (cancel before input); any other text is the input"):
        await app_turn(client, app, "in1", "name the trip", "input", {"awaiting": INPUT})
        t, f = await app_turn(client, app, "in2", "nevermind", "input")
        check_ack(t, "in2", "input", "app", resolution={"type": "cancel"}, fired=("cancel",))
        await app_turn(client, app, "in3", "name the trip", "input", {"awaiting": INPUT})
        want = {"type": "input", "content": "Tokyo Trip 2024"}
        t, f = await app_turn(client, app, "in4", "Tokyo Trip 2024", "input")
        check_ack(t, "in4", "input", "app", resolution=want)
        check_fwd(f, "in4", "Tokyo Trip 2024", resolution=want)
    with step("'yes' with nothing awaited resolves nothing and fires no confirm rule"):
        t, f = await app_turn(client, app, "yz", "yes", "confirm-none")
        check_ack(t, "yz", "confirm-none", "app", resolution=None, not_fired=("confirm_yes",))
    await client.close()


# --------------------------------------------------------------------------------------
# rules check, broken sets, reload


def run_cli(*args, timeout=20):
    proc = subprocess.run([harness._options.gateway, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)
    return proc.returncode, proc.stdout + proc.stderr


BROKEN = {
    "regex": ("bad.rules", "# a rule whose pattern does not compile\nrule bad_regex\n  match   (?<from>unclosed\n"
                           "  do      params travel\n", 3, ("missing closing parenthesis", "offset")),
    "keyword": ("bad.rules", "rule fine\n  match   hello\n  do      cancel\n  frobnicate yes\n", 4, ("frobnicate",)),
    "expect": ("bad.rules", "rule hello\n  match   ^hello$\n  do      cancel\n  expect  \"hello\"\n"
                            "  expect  \"goodbye\"\n", 5, ("goodbye",)),
    "do": ("bad.rules", "rule hello\n  match   ^hello$\n  do      explode\n", 3, ("explode",)),
}


def broken_dir(kind, with_shipped=False):
    name, text, _, _ = BROKEN[kind]
    path = rules_copy() if with_shipped else harness.temp_dir("chatgate-e2e-badrules-")
    (path / name).write_text(text)
    return path


async def part_check_cli():
    with step("`chatgate rules check rules/` passes on the shipped rules (exit 0)"):
        code, out = await asyncio.to_thread(run_cli, "rules", "check", SHIPPED)
        check(code == 0, f"rules check on the shipped rules exited {code}:\n{out}")
        print("   " + out.strip().splitlines()[-1])
    with step("`chatgate rules explain` prints what fires as JSON"):
        code, out = await asyncio.to_thread(run_cli, "rules", "explain", SHIPPED,
                                            "Find me flights from Nairobi to London next week")
        check(code == 0, f"rules explain exited {code}:\n{out}")
        try:
            explained = json.loads(out)
        except ValueError:
            harness.fail(f"rules explain did not print JSON:\n{out}")
        check(explained.get("fired") == ["flight_route", "departure_date"] and explained.get("limited") == []
              and (explained.get("state") or {}).get("params") == {"travel": FLIGHT},
              f"rules explain: {harness.brief(explained, 600)}")
    for kind, (name, _, line, needles) in BROKEN.items():
        with step(f"rules check on a broken set ({kind}): non-zero, names {name}:{line}"):
            path = broken_dir(kind, with_shipped=(kind == "regex"))
            code, out = await asyncio.to_thread(run_cli, "rules", "check", path)
            check(code != 0, f"rules check of a broken set ({kind}) exited 0:\n{out}")
            check(f"{name}:{line}:" in out, f"the output should name {name}:{line}:\n{out}")
            for needle in needles:
                check(needle in out, f"the output should mention {needle!r}:\n{out}")
    with step("the gateway started with a broken --rules exits 2 naming file:line"):
        path = broken_dir("regex", with_shipped=True)
        port = harness.free_port()

        def start():
            env = {k: v for k, v in os.environ.items() if not k.startswith("CHATGATE_")}
            return subprocess.run([harness._options.gateway, "--listen", f"127.0.0.1:{port}", "--rules", str(path)],
                                  capture_output=True, text=True, timeout=10, stdin=subprocess.DEVNULL,
                                  env=env, cwd=harness.REPO_ROOT)
        try:
            proc = await asyncio.to_thread(start)
        except subprocess.TimeoutExpired:
            harness.fail("the gateway with a broken rule set was still running after 10 s (it should exit 2)")
        out = proc.stdout + proc.stderr
        check(proc.returncode == 2, f"exit status {proc.returncode}, expected 2"
                                    f"{' (a sanitizer report changed it)' if 'Sanitizer' in out else ''}:\n{out}")
        check("bad.rules:3:" in out, f"the error should name bad.rules:3:\n{out}")


async def wait_log(gw, needle, timeout=5.0, start=0):
    ok = await harness.wait_until(lambda: needle in gw.log_text()[start:], timeout)
    check(ok, f"the gateway log should mention {needle!r} within {timeout}s:\n{gw.log_tail(15)}")


RELOAD_RULE = """rule hush
  match   ^\\s*hush\\s*[.!]*\\s*$
  do      cancel absorb
  expect  "hush"
  reject  "hush little baby"
"""


async def part_reload(app):
    path = rules_copy()
    config = rules_config({"app": harness.app_upstream(app, "/state")}, "app")
    async with harness.Gateway(["--rules", str(path)], config, env=ENV, name="gateway-reload") as gw:
        client = await Client.connect(gw)
        client.track()
        room = "reload"
        with step("before the reload 'hush' is an ordinary message"):
            t, f = await app_turn(client, app, "h1", "hush", room)
            check_ack(t, "h1", room, "app", resolution=None, not_fired=("hush",))
        with step("a new rule file and SIGHUP: 'hush' is absorbed (cancel absorb: ack, empty done, not forwarded)"):
            (path / "95-reload.rules").write_text(RELOAD_RULE)
            mark = len(gw.log_text())
            gw.proc.send_signal(signal.SIGHUP)
            await wait_log(gw, "reloaded", start=mark)
            t = await client.message("hush", mid="h2", room=room, timeout=TURN_TIMEOUT)
            harness.check_turn_done(t)
            check_ack(t, "h2", room, "app", resolution={"type": "cancel"}, fired=("hush",))
            check(t.terminal.get("text") == "" and not t.deltas,
                  f"an absorbed message gets an empty done and no delta: {t.describe()}")
            await asyncio.sleep(0.2)  # a silence: a forward to the app would come now
            not_forwarded_to_app(app, "h2")
        with step("an absorbed cancel stops a streaming reply at once"):
            await client.send_message("a long one [delay=5]", "h3", room)
            await client.recv_type("delta", "h3")
            started = time.monotonic()
            await client.send_message("hush", "h4", room)
            first = await client.collect_turn("h3", timeout=4.0)
            check(first.kind == "cancelled" and time.monotonic() - started < 1.5,
                  f"h3 should be cancelled at once by 'hush': {first.describe()}")
            t = await client.collect_turn("h4")
            harness.check_turn_done(t)
            check(t.terminal.get("text") == "", f"h4 should be absorbed: {t.describe()}")
        with step("a broken file and SIGHUP: refused, logged with file:line, the running set stays"):
            (path / "96-broken.rules").write_text(BROKEN["regex"][1])
            mark = len(gw.log_text())
            gw.proc.send_signal(signal.SIGHUP)
            await wait_log(gw, "96-broken.rules:3:", start=mark)
            gw.assert_alive()
            t = await client.message("hush", mid="h5", room=room, timeout=TURN_TIMEOUT)
            harness.check_turn_done(t)
            check_ack(t, "h5", room, "app", resolution={"type": "cancel"}, fired=("hush",))
            t, f = await app_turn(client, app, "h6", "Find me flights from Nairobi to London next week", room)
            check_ack(t, "h6", room, "app", service="travel", params=FLIGHT)
        await client.close()


# --------------------------------------------------------------------------------------


async def main(args):
    await scenarios()


async def scenarios():
    async with harness.FakeApp() as app, harness.FakeOpenAI() as fake:
        await independent(part_check_cli())
        upstreams = {"app": harness.app_upstream(app, "/state"), "llm": harness.openai_upstream(fake, "ok"),
                     "slow": harness.openai_upstream(fake, "slow")}
        async with harness.Gateway(["--rules", str(SHIPPED)], rules_config(upstreams, "app"), env=ENV,
                                   name="gateway-app") as gw:
            await independent(part_flights(gw, app))
            await independent(part_cabin_case(gw, app))
            await independent(part_payment(gw, app))
            await independent(part_flow2_app(gw, app))
            await independent(part_flow3_cancel(gw, app))
            await independent(part_forget(gw, app))
            await independent(part_confirm(gw, app))
            gw.assert_alive()
        route_rules = rules_copy({"90-test-route.rules": ROUTE_RULE})
        async with harness.Gateway(["--rules", str(route_rules)], rules_config(upstreams, "llm"), env=ENV,
                                   name="gateway-llm") as gw:
            await independent(part_flow1(gw, app, fake))
            await independent(part_flow2_llm(gw, fake))
            await independent(part_flow3_default_route(gw, app, fake))
            await independent(part_stop_llm(gw, fake))
            gw.assert_alive()
        await independent(part_expiry(app))
        await independent(part_reload(app))


if __name__ == "__main__":
    harness.run(main, timeout=110)
