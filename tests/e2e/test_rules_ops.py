"""End-to-end test of the rules' operations side: per-rule metrics, GET /admin/rules and the
shadow rule set (--shadow-rules DIR, config key shadow_rules).

Upstream: the harness's state app (FakeApp /state: "app got: TEXT", its done carries the
state directive a test scripted, every forwarded frame is recorded), and the demo upstream
for a route rule of the shadow set. CHATGATE_NOW=2026-02-03T10:00:00Z, so the dates the
rules read are fixed. The conversation (CONVO), through the shipped rules/ (docs/scenarios.md):
"Find me flights from Nairobi to London next week", "What about returning on Feb 20?",
"And tomorrow?", "stop" (room trip), "Flights to London on Feb 10" (trip2), "Send 5000
shillings to jane.doe@example.com" (the app then awaits a confirmation), "yes", "hello there"
(wallet), "Find a romantic restaurant in Paris" (food): each ack names exactly the rules
docs/scenarios.md says fire.

- /metrics before any message: `chatgate_rule_hits_total{file,rule}` and
  `chatgate_rule_limited_total{file,rule}` for exactly the rules of the set (parsed from the
  rule files: base name of the file, rule name), all 0; `chatgate_rule_file_seconds{file}`
  per rule file, count 0; the shadow counters 0. After the conversation: each rule's hits =
  the times the acks named it (departure_date twice), every other rule 0, none limited;
  each file's histogram count = the 9 chat messages (cumulative buckets, +Inf = count).
- GET /admin/rules: every rule in file order with its file, the line of its `rule` line,
  hits and limited as in /metrics; never_fired = exactly the rules with 0 hits; shadow
  {same 0, different 0}; 401 without the token or with a wrong one.
- POST /admin/reload starts the counts again: every rule 0, file counts 0, never_fired = all;
  one message after it counts alone. SIGHUP does the same.
- A rule cut off by the match limit (a runaway pattern in an extra rule file of a copy of
  rules/): chatgate_rule_limited_total and /admin/rules `limited` 1 for it, 0 hits; the same
  rule fires on a short text: 1 hit.
- The shadow set, a copy of rules/ whose `cancel` rule no longer matches "stop": the
  conversation counts 8 messages "same" and 1 "different" (fields rules, resolution, cancel
  1 each, the others 0), in /metrics and /admin/rules; one info log line names the session,
  the message id, the fields and both rule lists, not the message's words; the live counts
  are those of a gateway without a shadow set (the shadow set is not counted); and nothing
  the client or the app sees differs from that gateway (acks, frames, done texts, the
  forwarded frames, context.get). A broken shadow file and POST /admin/reload: 422 naming
  "shadow rules" and the file, both sets stay (counts kept); the shadow fixed (= rules/) and
  SIGHUP: reloaded with the live set (counts started again), "stop" is now "same".
- The config key shadow_rules, with a shadow set where return_date keeps the date as written
  (no `type date`) and vibe_word routes to the demo upstream: 7 same, 2 different (params 1,
  route 1); the route's log line names both upstreams; the client sees the same.
- Refused at start (exit 2): a shadow dir with a broken rule file (the message names "shadow
  rules" and the file), --shadow-rules naming a file, the config key naming no directory.
- A message accepted before a reload and evaluated after it (queued behind a reply) is
  counted under the rules its ack names, or not at all, never under other rules' names.
- A rule file whose name holds `"` and `\\`: /metrics stays valid Prometheus text (the label
  value escaped).
- --workers 2 on a redis-server: /metrics and /admin/rules give the group's hits; every worker
  killed (kill -9) and replaced by the master, then SIGHUP: the group's hits start again at 0
  (none of the dead workers' hits are left in the sums).
"""

import asyncio
import json
import os
import re
import shutil
import signal
import time
from pathlib import Path

import harness
from harness import Client, check, context_command, fail, independent, step

NOW = "2026-02-03T10:00:00Z"
TOKEN = "rules-ops-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ENV = {"CHATGATE_NOW": NOW, "CHATGATE_ADMIN_TOKEN": TOKEN}
SHIPPED = harness.REPO_ROOT / "rules"
CONFIRMATION = {"awaiting": {"type": "confirmation", "context": {"action": "send_payment"}, "ttl": 60}}

# (room, id, text, the rules its ack names (docs/scenarios.md), a state directive for the app's done)
CONVO = [
    ("trip", "t1", "Find me flights from Nairobi to London next week", ["flight_route", "departure_date"], None),
    ("trip", "t2", "What about returning on Feb 20?", ["return_date"], None),
    ("trip", "t3", "And tomorrow?", ["departure_date_short", "followup_when"], None),
    ("trip", "t4", "stop", ["cancel"], None),
    ("trip2", "u1", "Flights to London on Feb 10", ["destination", "departure_date"], None),
    ("wallet", "w1", "Send 5000 shillings to jane.doe@example.com", ["payment_amount", "payment_recipient"], CONFIRMATION),
    ("wallet", "w2", "yes", ["confirm_yes"], None),
    ("wallet", "w3", "hello there", [], None),
    ("food", "f1", "Find a romantic restaurant in Paris", ["vibe_word"], None),
]
ROOMS = ("trip", "trip2", "wallet", "food")


def rule_set(directory):
    """[(name, file base name, line of its `rule` line)] of a rules dir, in load order."""
    out = []
    for path in sorted(Path(directory).glob("*.rules"), key=lambda p: p.name.encode()):
        for n, line in enumerate(path.read_text().split("\n"), 1):
            m = re.match(r"rule\s+(\S+)\s*$", line)
            if m:
                out.append((m.group(1), path.name, n))
    check(out, f"no rules found in {directory}")
    return out


def copy_rules(prefix):
    path = harness.temp_dir(f"chatgate-e2e-{prefix}-")
    for f in SHIPPED.glob("*.rules"):
        shutil.copy(f, path / f.name)
    return path


def edit(path, old, new, count=1):
    text = path.read_text()
    check(text.count(old) == count, f"test setup: {old!r} should occur {count}x in {path}, occurs {text.count(old)}x")
    path.write_text(text.replace(old, new))


def shadow_without_stop(path):
    """The cancel rule of `path` no longer matches "stop" (its expects follow)."""
    cancel = path / "10-cancel.rules"
    edit(cancel, r"|stop(?:\s+(?:it|that|please))?", "")
    for line in ('  expect  "stop"\n', '  expect  "STOP!"\n', '  expect  "  ok, stop please  "\n'):
        edit(cancel, line, "")
    edit(cancel, '  reject  "no"\n', '  reject  "no"\n  reject  "stop"\n')


def tally(convo=CONVO):
    hits = {}
    for *_, rules, _ in convo:
        for r in rules:
            hits[r] = hits.get(r, 0) + 1
    return hits


def config(app, **extra):
    ups = {"app": harness.app_upstream(app, "/state"), "demo": harness.demo_upstream(0)}
    return harness.make_config(ups, "app", rate_limit={"messages_per_second": 1000, "burst": 1000}, **extra)


async def http(url, method="GET", headers=None, body=None):
    status, _, raw = await asyncio.to_thread(harness.http_request, url, method, headers, body)
    text = raw.decode("utf-8", "replace")
    try:
        return status, json.loads(text) if text.strip() else None
    except ValueError:
        return status, text


async def metrics(gw):
    status, _, raw = await asyncio.to_thread(harness.http_get, gw.http_url + "/metrics")
    check(status == 200, f"GET /metrics: {status} {raw[:200]!r}")
    m = harness.parse_metrics(raw.decode())
    for (name, _labels) in m.samples:
        check(m.family(name) is not None, f"/metrics: sample {name} has no # TYPE line")
    return m


async def admin_rules(gw, headers=AUTH):
    return await http(gw.http_url + "/admin/rules", headers=headers)


def check_rule_metrics(m, rules, hits, messages, limited=None):
    """The per-rule families for exactly `rules`: hits and limited as given (others 0), each
    file's histogram counting `messages`."""
    limited = limited or {}
    check(m.types.get("chatgate_rule_hits_total") == "counter", "chatgate_rule_hits_total should be TYPE counter")
    check(m.types.get("chatgate_rule_limited_total") == "counter", "chatgate_rule_limited_total should be TYPE counter")
    check(m.types.get("chatgate_rule_file_seconds") == "histogram", "chatgate_rule_file_seconds should be TYPE histogram")
    want_labels = {(("file", f), ("rule", n)) for n, f, _ in rules}
    for family, want in (("chatgate_rule_hits_total", hits), ("chatgate_rule_limited_total", limited)):
        series = m.series(family)
        got_labels = set(series)
        check(got_labels == want_labels,
              f"{family}: the series should be exactly the set's {len(want_labels)} rules; missing "
              f"{sorted(dict(l)['rule'] for l in want_labels - got_labels)}, extra {sorted(got_labels - want_labels)}")
        wrong = {n: (series[(("file", f), ("rule", n))], want.get(n, 0)) for n, f, _ in rules
                 if series[(("file", f), ("rule", n))] != want.get(n, 0)}
        check(not wrong, f"{family}: rule: (got, expected): {wrong}")
    files = sorted({f for _, f, _ in rules})
    got_files = sorted({dict(l)["file"] for l in m.series("chatgate_rule_file_seconds_count")})
    check(got_files == files, f"chatgate_rule_file_seconds: files {got_files}, expected {files}")
    for f in files:
        buckets, total, count = m.histogram("chatgate_rule_file_seconds", file=f)
        check(len(buckets) >= 2 and buckets[-1][0] == float("inf"), f"file {f}: buckets {buckets}")
        for (le1, c1), (le2, c2) in zip(buckets, buckets[1:]):
            check(c2 >= c1, f"file {f}: bucket le={le2} ({c2:g}) < le={le1} ({c1:g}): not cumulative")
        check(buckets[-1][1] == count, f"file {f}: le=+Inf {buckets[-1][1]:g} != _count {count:g}")
        check(count == messages, f"chatgate_rule_file_seconds_count{{file=\"{f}\"}} should be {messages} "
              f"(the chat messages evaluated), got {count:g}")
        check(total >= 0 and (messages or total == 0), f"file {f}: _sum {total} with {messages} messages")


def check_shadow_metrics(m, same, different, fields=None):
    fields = fields or {}
    got = {o: m.value("chatgate_shadow_rules_total", outcome=o) for o in ("same", "different")}
    check(got == {"same": same, "different": different},
          f"chatgate_shadow_rules_total: {got}, expected same {same}, different {different}")
    names = ("rules", "params", "resolution", "route", "enriched", "annotations", "error")
    got = {f: m.value("chatgate_shadow_rules_differences_total", field=f) for f in names}
    want = {f: fields.get(f, 0) for f in names}
    check(got == want, f"chatgate_shadow_rules_differences_total by field: {got}, expected {want}")
    check(len(m.series("chatgate_shadow_rules_differences_total")) == len(names),
          f"chatgate_shadow_rules_differences_total: exactly the fields {names}: "
          f"{sorted(m.series('chatgate_shadow_rules_differences_total'))}")
    for fam in ("chatgate_shadow_rules_total", "chatgate_shadow_rules_differences_total"):
        check(m.types.get(fam) == "counter", f"{fam} should be TYPE counter, is {m.types.get(fam)}")


def check_admin(body, rules, rules_dir, hits, limited=None, shadow=(0, 0)):
    limited = limited or {}
    check(isinstance(body, dict) and set(body) >= {"rules", "never_fired", "shadow"},
          f"GET /admin/rules should be {{rules, never_fired, shadow}}: {harness.brief(body)}")
    got = body["rules"]
    check(isinstance(got, list) and [r.get("name") for r in got] == [n for n, _, _ in rules],
          f"/admin/rules: the rules in file order {[n for n, _, _ in rules]}, got "
          f"{[r.get('name') for r in got] if isinstance(got, list) else got}")
    for r, (name, base, line) in zip(got, rules):
        f = r.get("file")
        check(isinstance(f, str) and (f == base or f == str(Path(rules_dir) / base)),
              f"/admin/rules {name}: file {f!r}, expected {base} (or {Path(rules_dir) / base})")
        check(r.get("line") == line, f"/admin/rules {name}: line {r.get('line')!r}, the rule line is {line}")
        check(r.get("hits") == hits.get(name, 0) and r.get("limited") == limited.get(name, 0),
              f"/admin/rules {name}: hits {r.get('hits')!r} limited {r.get('limited')!r}, expected "
              f"{hits.get(name, 0)} and {limited.get(name, 0)}")
    never = body["never_fired"]
    want = [n for n, _, _ in rules if not hits.get(n)]
    check(isinstance(never, list) and len(never) == len(set(never)) and sorted(never) == sorted(want),
          f"/admin/rules never_fired: {never}, expected exactly {want}")
    check(body["shadow"] == {"same": shadow[0], "different": shadow[1]},
          f"/admin/rules shadow: {body['shadow']}, expected same {shadow[0]}, different {shadow[1]}")


async def converse(gw, app, convo=CONVO):
    """Plays `convo` on one connection; what the client and the app saw, per message, for
    comparisons: (ack, frame types, done text, forwarded frame without its user id); then
    context.get of each room."""
    c = await Client.connect(gw)
    seen = {}
    for room, mid, text, fired, directive in convo:
        if directive is not None:
            app.directives[mid] = directive
        t = await c.message(text, mid=mid, room=room)
        harness.check_turn_done(t)
        check(t.ack.get("rules") == fired, f"{mid} {text!r}: ack.rules should be {fired} (docs/scenarios.md): "
              f"{harness.brief(t.ack)}")
        check("reply_rules" not in t.terminal, f"test setup: a reply rule (on reply) acted on {mid}'s reply, whose "
              f"hits the tally from the acks leaves out: {harness.brief(t.terminal)}")
        fwd = dict(await app.wait_message(mid))
        fwd.pop("user", None)
        # how the reply is cut into deltas depends on timing: the kinds, a run of deltas as one
        kinds = [k for i, k in enumerate(f.get("type") for f in t.frames) if k != "delta" or t.frames[i - 1].get("type") != "delta"]
        seen[mid] = (t.ack, kinds, "".join(d.get("text", "") for d in t.deltas), t.terminal.get("text"), fwd)
    for room in ROOMS:
        seen[f"context:{room}"] = await context_command(c, "context.get", room)
    await c.close()
    return seen


def without_clock(v):
    """v without the clock's marks (history ts, meta's created_at and last_activity): the
    gateways compared run one after the other, and their clocks (CHATGATE_NOW, running on)
    may be a second apart. Tuples too: what converse() records per message is one, and a
    history's ts inside it a second off failed the comparison on a loaded machine."""
    if isinstance(v, dict):
        return {k: without_clock(x) for k, x in v.items() if k not in ("ts", "created_at", "last_activity")}
    if isinstance(v, (list, tuple)):
        return [without_clock(x) for x in v]
    return v


def check_same_as(seen, baseline, what):
    check(list(seen) == list(baseline), f"{what}: other messages than the baseline: {list(seen)}")
    for key, got in seen.items():
        check(without_clock(got) == without_clock(baseline[key]), f"{what}: {key} differs from the gateway without a shadow set:\n"
              f"  with:    {harness.brief(got, 600)}\n  without: {harness.brief(baseline[key], 600)}")


def shadow_lines(gw):
    return [l for l in gw.log_text().splitlines() if "shadow rules: session" in l]


async def wait_log(gw, needle, start, timeout=5.0):
    if not await harness.wait_until(lambda: needle in gw.log_text()[start:], timeout):
        fail(f"{gw.name}: no log line with {needle!r} within {timeout}s")


async def sighup(gw):
    mark = len(gw.log_text())
    gw.send_signal(signal.SIGHUP)
    await wait_log(gw, "rules: reloaded", mark)


# --------------------------------------------------------------------------------------


async def part_counts(baseline):
    rules = rule_set(SHIPPED)
    async with harness.FakeApp() as app:
        async with harness.Gateway(["--rules", SHIPPED], config(app), env=ENV, name="rules-live") as gw:
            with step(f"/metrics at the start: the {len(rules)} rules of rules/ as series, all 0; file histograms 0"):
                m = await metrics(gw)
                check_rule_metrics(m, rules, {}, 0)
                check_shadow_metrics(m, 0, 0)
                status, body = await admin_rules(gw)
                check(status == 200, f"GET /admin/rules: {status} {harness.brief(body)}")
                check_admin(body, rules, SHIPPED, {})
            with step("a scripted conversation: each rule's hits = the times the acks named it; 9 per file"):
                baseline.update(await converse(gw, app))
                hits = tally()
                check(hits["departure_date"] == 2 and len(hits) == 11, f"test setup: {hits}")
                m = await metrics(gw)
                check_rule_metrics(m, rules, hits, len(CONVO))
                check(m.value("chatgate_rules_fired_total") == sum(hits.values()),
                      f"chatgate_rules_fired_total {m.value('chatgate_rules_fired_total'):g}, the acks named "
                      f"{sum(hits.values())}")
                check_shadow_metrics(m, 0, 0)
                check(not shadow_lines(gw), f"a gateway without a shadow set logs shadow lines: {shadow_lines(gw)}")
            with step("GET /admin/rules: hits, lines and files, never_fired exactly the rules with 0 hits; 401 without the token"):
                status, body = await admin_rules(gw)
                check(status == 200, f"GET /admin/rules: {status} {harness.brief(body)}")
                check_admin(body, rules, SHIPPED, hits)
                status, body = await admin_rules(gw, headers={})
                check(status == 401, f"GET /admin/rules without a token: {status} {harness.brief(body)}")
                status, body = await admin_rules(gw, headers={"Authorization": "Bearer wrong-token"})
                check(status == 401, f"GET /admin/rules with a wrong token: {status} {harness.brief(body)}")
                status, body = await http(gw.http_url + "/admin/rules", "POST", AUTH)
                check(status != 200, f"POST /admin/rules should not be answered as GET: {status} {harness.brief(body)}")
            with step("POST /admin/reload starts the counts again: all 0, never_fired = every rule"):
                status, body = await http(gw.http_url + "/admin/reload", "POST", AUTH)
                check(status == 200 and body == {"rules": len(rules)}, f"POST /admin/reload: {status} {harness.brief(body)}")
                m = await metrics(gw)
                check_rule_metrics(m, rules, {}, 0)
                status, body = await admin_rules(gw)
                check_admin(body, rules, SHIPPED, {})
            with step("after the reload, one message counts alone; SIGHUP starts the counts again too"):
                c = await Client.connect(gw)
                t = await c.message("Flights to London on Feb 10", mid="r1", room="again")
                harness.check_turn_done(t)
                check(t.ack.get("rules") == ["destination", "departure_date"], f"r1: {harness.brief(t.ack)}")
                m = await metrics(gw)
                check_rule_metrics(m, rules, {"destination": 1, "departure_date": 1}, 1)
                status, body = await admin_rules(gw)
                check_admin(body, rules, SHIPPED, {"destination": 1, "departure_date": 1})
                await sighup(gw)
                m = await metrics(gw)
                check_rule_metrics(m, rules, {}, 0)
                await c.close()


async def part_limited():
    live = copy_rules("rules-limit")
    (live / "95-runaway.rules").write_text(
        "# test only: backtracks without end on a long run of a's that does not end in one\n"
        "rule runaway\n  match   ^(?:a|aa)+$\n  do      route app\n")
    rules = rule_set(live)
    try:
        async with harness.FakeApp() as app:
            async with harness.Gateway(["--rules", live], config(app), env=ENV, name="rules-limited") as gw:
                with step("a rule cut off by the match limit: limited 1 (/metrics and /admin/rules), 0 hits; 1 hit on a short text"):
                    c = await Client.connect(gw)
                    t = await c.message("a" * 60 + "b", mid="l1", room="r")
                    harness.check_turn_done(t)
                    check(t.ack.get("rules") == [], f"l1: {harness.brief(t.ack)}")
                    m = await metrics(gw)
                    check_rule_metrics(m, rules, {}, 1, limited={"runaway": 1})
                    check(m.value("chatgate_rules_limited_total") == 1, "chatgate_rules_limited_total should be 1")
                    status, body = await admin_rules(gw)
                    check_admin(body, rules, live, {}, limited={"runaway": 1})
                    t = await c.message("aaaa", mid="l2", room="r")
                    harness.check_turn_done(t)
                    check(t.ack.get("rules") == ["runaway"], f"l2: {harness.brief(t.ack)}")
                    m = await metrics(gw)
                    check_rule_metrics(m, rules, {"runaway": 1}, 2, limited={"runaway": 1})
                    status, body = await admin_rules(gw)
                    check_admin(body, rules, live, {"runaway": 1}, limited={"runaway": 1})
                    await c.close()
    finally:
        shutil.rmtree(live, ignore_errors=True)


async def part_shadow_cancel(baseline):
    rules = rule_set(SHIPPED)
    shadow = copy_rules("shadow-stop")
    shadow_without_stop(shadow)
    try:
        async with harness.FakeApp() as app:
            async with harness.Gateway(["--rules", SHIPPED, "--shadow-rules", shadow], config(app), env=ENV,
                                       name="rules-shadow") as gw:
                with step("shadow (cancel without \"stop\"): the conversation is 8 same, 1 different (rules, resolution, cancel)"):
                    seen = await converse(gw, app)
                    m = await metrics(gw)
                    check_shadow_metrics(m, 8, 1, {"rules": 1, "resolution": 1})
                    status, body = await admin_rules(gw)
                    check(status == 200, f"GET /admin/rules: {status} {harness.brief(body)}")
                    check_admin(body, rules, SHIPPED, tally(), shadow=(8, 1))
                with step("shadow: the live counts are those without a shadow set (the shadow set is not counted)"):
                    check_rule_metrics(m, rules, tally(), len(CONVO))
                with step("shadow: one info line names the session, message t4, the fields and both rule lists, not the words"):
                    lines = shadow_lines(gw)
                    check(len(lines) == 1, f"one shadow log line expected, got {len(lines)}: {lines}")
                    pat = (r" info shadow rules: session (\S+) message t4: the shadow set differs in rules, resolution; "
                           r'rules live \["cancel"\], shadow \[\]$')
                    check(re.search(pat, lines[0]), f"the shadow log line {lines[0]!r} should match {pat!r}")
                with step("shadow: nothing the client or the app sees differs from the gateway without it"):
                    if not baseline:
                        fail("no baseline: the gateway without a shadow set failed before")
                    check_same_as(seen, baseline, "with --shadow-rules")
                with step("a broken shadow file and POST /admin/reload: 422 naming 'shadow rules' and the file; both sets stay"):
                    cancel = shadow / "10-cancel.rules"
                    cancel.write_text(cancel.read_text() + "\nrule broken_on_purpose\n  match   (unclosed [group\n  do      cancel\n")
                    status, body = await http(gw.http_url + "/admin/reload", "POST", AUTH)
                    check(status == 422 and isinstance(body, dict) and "shadow rules" in str(body.get("error"))
                          and "10-cancel.rules" in str(body.get("error")),
                          f"POST /admin/reload with a broken shadow file: expected 422 naming 'shadow rules' and "
                          f"10-cancel.rules, got {status} {harness.brief(body)}")
                    m = await metrics(gw)
                    check_rule_metrics(m, rules, tally(), len(CONVO))  # refused: nothing started again
                    check(m.value("chatgate_rules_reloads_total", result="refused") == 1, "one refused reload")
                    c = await Client.connect(gw)
                    t = await c.message("stop", mid="s1", room="again")
                    harness.check_turn_done(t)
                    check(t.ack.get("rules") == ["cancel"], f"s1 (live set kept): {harness.brief(t.ack)}")
                    m = await metrics(gw)
                    check_shadow_metrics(m, 8, 2, {"rules": 2, "resolution": 2})  # shadow set kept
                with step("the shadow fixed (= rules/) and SIGHUP: reloaded with the live set; \"stop\" is now the same"):
                    for f in SHIPPED.glob("*.rules"):
                        shutil.copy(f, shadow / f.name)
                    mark = len(gw.log_text())
                    await sighup(gw)
                    check("and the shadow set from" in gw.log_text()[mark:],
                          f"the reload line should name the shadow set: {gw.log_text()[mark:]!r}")
                    m = await metrics(gw)
                    check_rule_metrics(m, rules, {}, 0)
                    t = await c.message("stop", mid="s2", room="again")
                    harness.check_turn_done(t)
                    m = await metrics(gw)
                    check_shadow_metrics(m, 9, 2, {"rules": 2, "resolution": 2})
                    check_rule_metrics(m, rules, {"cancel": 1}, 1)
                    status, body = await admin_rules(gw)
                    check_admin(body, rules, SHIPPED, {"cancel": 1}, shadow=(9, 2))
                    check(len(shadow_lines(gw)) == 2, f"two shadow log lines by now: {shadow_lines(gw)}")
                    await c.close()
    finally:
        shutil.rmtree(shadow, ignore_errors=True)


async def part_shadow_config(baseline):
    shadow = copy_rules("shadow-params")
    # return_date keeps the date as written; vibe_word routes to the demo upstream
    edit(shadow / "50-travel.rules", "  do      params travel\n  type    return_date date\n", "  do      params travel\n")
    edit(shadow / "30-metadata.rules", "  do      metadata vibe\n  expect  \"Find a romantic", "  do      route demo\n  expect  \"Find a romantic")
    try:
        async with harness.FakeApp() as app:
            cfg = config(app, rules=str(SHIPPED), shadow_rules=str(shadow))
            async with harness.Gateway([], cfg, env=ENV, name="rules-shadow-config") as gw:
                with step("config key shadow_rules: return_date as written, vibe_word routed: 7 same, 2 different (params; route and annotations)"):
                    seen = await converse(gw, app)
                    m = await metrics(gw)
                    check_shadow_metrics(m, 7, 2, {"params": 1, "route": 1, "annotations": 1})
                    check_rule_metrics(m, rule_set(SHIPPED), tally(), len(CONVO))
                    lines = shadow_lines(gw)
                    check(len(lines) == 2, f"two shadow log lines expected: {lines}")
                    check(re.search(r"message t2: the shadow set differs in params; "
                                    r'rules live \["return_date"\], shadow \["return_date"\]$', lines[0]),
                          f"the params line: {lines[0]!r}")
                    check(re.search(r"message f1: the shadow set differs in route, annotations; rules live \[\"vibe_word\"\], "
                                    r'shadow \["vibe_word"\]; route live app, shadow demo$', lines[1]),
                          f"the route line: {lines[1]!r}")
                    for line in lines:
                        check("Feb 20" not in line and "romantic" not in line, f"the message's words are logged: {line!r}")
                with step("config key shadow_rules: nothing the client or the app sees differs"):
                    if not baseline:
                        fail("no baseline: the gateway without a shadow set failed before")
                    check_same_as(seen, baseline, "with shadow_rules")
    finally:
        shutil.rmtree(shadow, ignore_errors=True)


async def part_refused():
    broken = copy_rules("shadow-broken")
    try:
        with step("a shadow dir with a broken rule file: exit 2 naming 'shadow rules' and the file"):
            cancel = broken / "10-cancel.rules"
            cancel.write_text(cancel.read_text() + "\nrule broken_on_purpose\n  match   (unclosed [group\n  do      cancel\n")
            code, out, _ = await harness.gateway_exit(config=demo_config(), args=["--rules", SHIPPED, "--shadow-rules", broken])
            check(code == 2 and "shadow rules" in out and "10-cancel.rules" in out,
                  f"exit {code}, expected 2 naming 'shadow rules' and 10-cancel.rules: {out}")
        with step("--shadow-rules naming a file, the config key naming no directory: exit 2 naming it"):
            a_file = broken / "10-cancel.rules"
            code, out, _ = await harness.gateway_exit(config=demo_config(), args=["--shadow-rules", a_file])
            check(code == 2 and "shadow-rules" in out and str(a_file) in out and "not a directory" in out,
                  f"exit {code}, expected 2 naming --shadow-rules and {a_file}: {out}")
            await harness.check_refused(demo_config(shadow_rules=str(broken / "nowhere")), "shadow_rules",
                                        "not a directory")
    finally:
        shutil.rmtree(broken, ignore_errors=True)


def demo_config(**extra):
    return harness.make_config({"demo": harness.demo_upstream(0)}, "demo", **extra)


async def part_reload_queued():
    live = copy_rules("rules-queued")
    try:
        async with harness.FakeApp() as app:
            async with harness.Gateway(["--rules", live], config(app), env=ENV, name="rules-queued") as gw:
                with step("a message queued across a reload is counted under the rules its ack names, or not at all"):
                    c = await Client.connect(gw)
                    await c.send_message("hold on [delay=1.5]", "q1", "trip")
                    await app.wait_message("q1")  # (a reply rule may hold its deltas back)
                    await c.send_message("Find me flights from Nairobi to London next week", "q2", "trip")
                    await c.check_alive()  # a marker: answered once the gateway has read q2
                    await c.expect_silence(0, lambda f: f.get("id") == "q2" or f.get("id") == "q1" and f.get("type") == "done",
                                           "frame before the reload (test setup: q1 should still run, q2 wait)")
                    # a new first file: every rule's index moves by one
                    (live / "05-first.rules").write_text("rule zzz_first\n  match   ^zzzz$\n  do      route app\n")
                    status, body = await http(gw.http_url + "/admin/reload", "POST", AUTH)
                    check(status == 200, f"POST /admin/reload: {status} {harness.brief(body)}")
                    harness.check_turn_done(await c.collect_turn("q1"))
                    t = await c.collect_turn("q2")
                    harness.check_turn_done(t)
                    named = t.ack.get("rules")
                    check(named == ["flight_route", "departure_date"], f"q2: {harness.brief(t.ack)}")
                    m = await metrics(gw)
                    counted = {dict(l)["rule"]: v for l, v in m.series("chatgate_rule_hits_total").items() if v}
                    check(set(counted) <= set(named) and all(v == 1 for v in counted.values()),
                          f"q2 (ack rules {named}) is counted as {counted}: hits under rules that did not fire")
                    files = {dict(l)["file"]: v for l, v in m.series("chatgate_rule_file_seconds_count").items()}
                    check(files.get("05-first.rules") == 0 and
                          len({v for f, v in files.items() if f != "05-first.rules"}) == 1,
                          f"q2 was evaluated by the old set (no 05-first.rules): file counts {files}")
                    await c.close()
    finally:
        shutil.rmtree(live, ignore_errors=True)


async def part_label_escaping():
    odd = harness.temp_dir("chatgate-e2e-rules-odd-")
    name = '90-say "hi" \\ there.rules'
    (odd / name).write_text("rule odd_one\n  match   ^odd$\n  do      route app\n")
    try:
        async with harness.FakeApp() as app:
            async with harness.Gateway(["--rules", odd], config(app), env=ENV, name="rules-odd-name") as gw:
                with step("a rule file named with \" and \\: /metrics is valid Prometheus text, the label escaped"):
                    c = await Client.connect(gw)
                    harness.check_turn_done(await c.message("odd", mid="o1", room="r"))
                    m = await metrics(gw)  # fails on an unescaped quote
                    check(m.value("chatgate_rule_hits_total", file=name, rule="odd_one") == 1,
                          f"the hit of odd_one under file={name!r}")
                    check(m.value("chatgate_rule_file_seconds_count", file=name) == 1, "its file's count")
                    await c.close()
    finally:
        shutil.rmtree(odd, ignore_errors=True)


async def metrics_until(gw, predicate, what, timeout=5.0):
    """/metrics until predicate(m) holds (with --workers each worker publishes every 200 ms)."""
    deadline = time.monotonic() + timeout
    m = None
    while True:
        try:
            m = await metrics(gw)
        except OSError:  # no worker listens for a moment (both were killed)
            m = None
        if m is not None and predicate(m):
            return m
        if time.monotonic() > deadline:
            fail(f"/metrics: {what} within {timeout:.0f} s; the rule hits: {hits_of(m) if m else 'no answer'}")
        await asyncio.sleep(0.1)


def hits_of(m):
    return {dict(l)["rule"]: v for l, v in m.series("chatgate_rule_hits_total").items() if v}


async def part_workers():
    redis = await harness.RedisServer().astart()
    try:
        cfg = demo_config(rate_limit={"messages_per_second": 1000, "burst": 1000})
        async with harness.Gateway(["--rules", SHIPPED, "--workers", "2", "--store", redis.url], cfg, env=ENV,
                                   name="rules-workers") as gw:
            with step("--workers 2: the group's hits; every worker killed and replaced, then SIGHUP: all 0 again"):
                # both listen before any is killed (a worker that dies before it listens stops the master)
                await metrics_until(gw, lambda m: len(m.series("chatgate_worker_up")) == 2
                                    and all(v == 1 for v in m.series("chatgate_worker_up").values()), "both workers up",
                                    timeout=15)
                for i in range(4):
                    c = await Client.connect(gw)
                    harness.check_turn_done(await c.message(CONVO[0][2], mid=f"k{i}", room=f"r{i}"))
                    await c.close()
                want = {"flight_route": 4, "departure_date": 4}
                await metrics_until(gw, lambda m: hits_of(m) == want, f"the group's hits {want}")
                status, body = await admin_rules(gw)
                check(status == 200, f"GET /admin/rules: {status}")
                check_admin(body, rule_set(SHIPPED), SHIPPED, want)
                workers = harness.children_of(gw.pid)
                check(len(workers) == 2, f"two workers expected: {workers}")
                for pid in workers:  # the gateway's own children
                    os.kill(pid, signal.SIGKILL)
                deadline = time.monotonic() + 10
                while len(harness.children_of(gw.pid) - workers) < 2:
                    check(time.monotonic() < deadline, f"the master did not start 2 new workers: {harness.children_of(gw.pid)}")
                    await asyncio.sleep(0.05)
                await metrics_until(gw, lambda m: m.value("chatgate_worker_restarts_total") == 2
                                    and all(v == 1 for v in m.series("chatgate_worker_up").values()), "both workers up again")
                m = await metrics(gw)
                check(hits_of(m) == want, f"the dead workers' hits stay in the group's until a reload: {hits_of(m)}")
                mark = len(gw.log_text())
                gw.send_signal(signal.SIGHUP)
                await harness.wait_until(lambda: gw.log_text()[mark:].count("rules: reloaded") >= 2, 5)
                m = await metrics_until(gw, lambda m: m.value("chatgate_rules_reloads_total", result="ok") == 2,
                                        "one reload in each worker")
                # until both workers have published their figures since the reload (every 200 ms)
                m = await metrics_until(gw, lambda m: not hits_of(m), "the group's rule hits back at 0 after the reload")
                check(not hits_of(m), f"after the reload of every worker the group's rule hits should start again "
                      f"at 0, got {hits_of(m)} (the dead workers' figures, kept in the master's retired sums)")
                status, body = await admin_rules(gw)
                check(status == 200 and all(r.get("hits") == 0 for r in body["rules"]),
                      f"/admin/rules after the reload: {[(r['name'], r['hits']) for r in body['rules'] if r.get('hits')]}")
    finally:
        redis.stop()


async def main(args):
    baseline = {}
    await independent(part_counts(baseline))
    await independent(part_limited())
    await independent(part_shadow_cancel(baseline))
    await independent(part_shadow_config(baseline))
    await independent(part_refused())
    await independent(part_reload_queued())
    await independent(part_label_escaping())
    await independent(part_workers())


if __name__ == "__main__":
    harness.run(main, timeout=80)
