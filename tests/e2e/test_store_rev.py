"""End-to-end test of the Redis store's copy of a dialog (issue 12; docs/state.md, "The
gateway's copy"), on a real redis-server started on a free port.

Since issue 39's ninth round a dialog is its state (`<dialog>:state`, one HASH: rev,
created_at, last_activity and v, the dialog but its history as one JSON object) and its
history (`<dialog>:history`, a LIST), where it was five keys (params, dialog, awaiting, soft,
history); the steps below say where a scenario of the old layout has no equivalent any more
and what replaced it.

Every save writes a new rev (the state's "rev" field), and the gateway keeps its copy of the
dialog under it: a turn's load names that rev, and Redis answers "same" instead of the
dialog when its copy is that one; a save whose history is that copy's plus new messages
appends them (RPUSH, LTRIM) instead of rewriting the list. What must hold, through the
state app (harness FakeApp /state, no rules):
- one gateway: each of 14 turns forwards exactly the last 10 messages; from the second turn
  on, every load is answered "same" and every save appends (counted exactly in /metrics);
  three more turns leave the params as they are, and their saves write a new rev into the
  state, whose params stay;
  the Redis list holds the last 10 messages in order; a gateway started afterwards reads the
  same dialog in full;
- two gateways on one Redis, turns alternating on one dialog: each sees the other's params
  and history (a copy of another rev is never used), and the Redis list stays exact;
- Redis's copy changed behind the gateway's back, between turns, as another writer would:
  the state's params rewritten without a rev, or the history list gone (it lapses first):
  the next turn reads Redis's copy;
- the state gone, the history kept (the old layout's "dialog's hash gone, the rev kept"
  cannot happen: the rev is in the state): the next turn reads Redis's copy (no service, no
  params); and the dialog's part lapsed inside the state (v's dialog_until past, what the
  dialog's hash lapsing before the params hash was), read by a gateway with no copy: no
  service or meta, the params kept;
- Redis's copy gone during a turn (its keys deleted), or only its history list (lapsed or
  evicted alone), or only its state (the rev with it; the old layout's "only the params hash
  gone"), so the copy the save would append to is no longer Redis's: the save is refused
  before it writes anything and sent again in full, so the list holds the whole dialog (as
  the gateway's next turn sees it), not the new messages alone; the turn's lease, which the
  refused append kept, is let go once the merged save is answered;
- another gateway's write-back or merge (which hold no lease) landing during a turn, with
  the history at its full length (the list's count unchanged; HSET state rev <its>): the
  turn's save reads the rev under its own lease too, meets the other's and merges, so the
  next turn sees both;
- a save answered with an error (Redis out of memory during the turn): the turn's lease is
  let go at once, and the turn is kept (the next one sees it); a write-back Redis keeps
  refusing (an ACL that denies the scripts) goes again every second, each refusal counted in
  chatgate_store_writeback_failures_total, and lands once Redis takes it.
- lifetimes in Redis (docs/state.md, "Lifetimes in Redis"): the state lives the longest of
  params_s, dialog_s and an awaiting state's or soft context's time left, the history
  history_s; a save within a sixtieth of the shortest lifetime of the last renewal leaves the
  keys' lifetimes as they are; the rooms set gone during such a save is not made; the state
  gone during one (the old layout's "the dialog's hash gone" has no equivalent: the rev goes
  with it) refuses the append, and the rewrite makes the state, the history and the rooms
  set again, each with its lifetime, never without one; a save after that interval renews
  them all; the lock, let go, is deleted.
- an awaiting state (its ttl longer than params_s and dialog_s) and a soft context, set and
  then cleared: the state's v holds each with its end, the state's TTL covers them, the save
  that clears one writes it null and its end 0; a turn answered "same" that appends to a full
  history runs exactly 11 commands in Redis, in order (SLOWLOG, and INFO commandstats):
  SET NX lock, HGET state rev, EXISTS history, HGETALL profile, then the save script's GET
  lock, HGET state rev, RPUSH, HSET state, LTRIM, DEL lock and its EVALSHA (TURN_SEQUENCE);
- the dialog's lock (its lease) holding what chatgate did not write: a value let go ("-",
  "-x w") is taken at once; a value that is no ticket is another's lease until it lapses;
  every turn holds its ticket while it runs and deletes the lock when done; a turn's load is
  plain commands (SET NX, HGET, and EXISTS when the copy has messages), no script, when
  nothing is in its way;
- parts in Redis that chatgate does not write (a state whose v is not a JSON object: the
  state's v holds every param, so no params field can be left out alone any more; a
  history message that is not a JSON object), read by a gateway with no copy: the rest is
  read, one warning counts them and names the first, and the turn's save rewrites the
  dialog without them; and when another gateway's write-back or merge (no lease) lands
  during such a turn (here its load left a history message out), the rewrite meets its rev
  and merges, so its message stays (save mode 4: before, the rewrite under the turn's own
  lease wrote over it), even when the gateway stops right after the turn (the merge runs
  while the store drains).
- the upgrade: a dialog in the layout before the state (params hash with its rev, dialog
  hash, awaiting key, history list; no state), written by hand, read by a gateway with no
  copy: the turn sees its params, service, awaiting state and history; its save writes the
  state (the old params and awaiting with the turn's, meta going on from the old counts) and
  the list (the old messages and the turn's), each with its lifetime; a gateway started
  afterwards reads the state, not the old keys.
Checked by breaking the code (in the layout before the state; for the state, argued from
the scripts, the source not being changed here): without the load's rev check the
two-gateway part fails, without its check that the history list is there the
lapsed-history part, without the save's rev check the state-only mid-turn part (the other
two fail at the RPUSH's count) and, without that check under the turn's own lease, the
foreign-write part; without its count of messages the history-only mid-turn part (the list
holds 2 messages); without the copy the counts do; without the rewrite's rev check (mode 4)
the rewrite-over part, and without the merge's read keeping the rev of a dialog with a part
left out that part too (its merge never lands); renewing at every save fails the first
lifetimes part (and the counts: an EXPIRE a turn), never renewing the third; a state TTL of
params_s or dialog_s alone, not the longest with the awaiting's time left, the awaiting
part; any call more or fewer in a turn the counts; without the load's reading of the layout
before the state (the load script's branch for a dialog with no state but a params or
dialog hash) the upgrade part, whose turn would see the history but none of the params,
service or awaiting state, and whose save would write a state without travel.from.
"""

import asyncio
import json
import time

import harness
from harness import Client, check, context_command, history_pairs, independent, step, state_reply_text

LIFETIMES = {"params_s": 3600, "dialog_s": 7200, "awaiting_s": 60, "soft_s": 60, "history_s": 1800}
HEADER = "X-User-Id"


async def turn(client, app, mid, text, room, state=None):
    """One message through the state app: (turn, forwarded frame)."""
    if state is not None:
        app.directives[mid] = state
    t = await client.message(text, mid=mid, room=room)
    t.expect_done()
    check(t.terminal.get("text") == state_reply_text(text), f"reply not relayed: {t.describe()}")
    return t, await app.wait_message(mid)


def metrics(gw):
    """The gateway's /metrics, parsed."""
    status, _, raw = harness.http_get(gw.http_url + "/metrics")
    check(status == 200, f"GET /metrics: {status}")
    return harness.parse_metrics(raw.decode())


def store_counts(gw):
    """(loads answered "same", saves appended) from the gateway's /metrics."""
    m = metrics(gw)
    return (int(m.value("chatgate_store_loads_cached_total")), int(m.value("chatgate_store_saves_appended_total")))


def redis_history(redis, user, room):
    return history_pairs([json.loads(e) for e in redis.lrange(harness.dialog_key(user, room, "history"))])


def state_key(user, room="r"):
    """The dialog's state (docs/state.md, Redis layout): one HASH of rev, created_at,
    last_activity and v, the dialog but its history as one JSON object."""
    return harness.dialog_key(user, room, "state")


def state_rev(redis, user, room="r"):
    """The rev in the dialog's state hash (None when there is none), read without the checks
    of redis.state (a state tampered with may lack it)."""
    return redis.command("HGET", state_key(user, room), "rev")


def rewrite_v(redis, user, change, room="r"):
    """Rewrites the state's v behind the gateway's back: change(v) edits the decoded JSON."""
    raw = redis.command("HGET", state_key(user, room), "v")
    check(raw is not None, f"no state to rewrite: {redis.keys(harness.dialog_key(user, room, '*'))}")
    v = json.loads(raw)
    change(v)
    redis.command("HSET", state_key(user, room), "v", json.dumps(v))


def config(app, redis):
    return harness.state_config({"app": harness.app_upstream(app, "/state")}, "app", store=redis.url,
                                lifetimes=LIFETIMES, history_n=10)


def args(rules):
    return ["--rules", rules, "--auth", "header", "--user-header", HEADER]


async def connect(gw, user):
    return await Client.connect(gw, expect_user=user, extra_headers={HEADER: user})


async def checked_turns(clients, app, name, ks, everything, with_params=True):
    """Turns ks of dialog `name`, the k-th through clients[(k - 1) % len(clients)]: each must
    forward exactly the last 10 messages of `everything` (which then grows by the turn) and,
    with_params, the params n the turn before set (each sets n = k)."""
    for k in ks:
        i = (k - 1) % len(clients)
        text = f"{name} {k}"
        state = {"service": "travel", "params": {"n": k}} if with_params else None
        t, fwd = await turn(clients[i], app, f"{name}{k}", text, "r", state)
        check(history_pairs(fwd["history"]) == everything[-10:],
              f"turn {k} through client {i}: forwarded history {harness.brief(fwd['history'], 600)}, "
              f"expected {everything[-10:]}")
        if with_params and k > 1:
            check(fwd["params"].get("n") == k - 1, f"turn {k} through client {i}: params {fwd['params']}")
        everything += [("user", text), ("assistant", t.terminal["text"])]


async def part_one_gateway(app, redis, rules):
    with step("one gateway: 14 turns, each forwarding the last 10 messages, 3 more keeping the params; "
              "16 loads answered 'same', 16 saves appended; Redis's list exact; a new gateway reads the same"):
        async with harness.Gateway(args(rules), config(app, redis), name="gw-one") as gw:
            c = await connect(gw, "one")
            everything = []
            await checked_turns([c], app, "one", range(1, 15), everything)
            # three turns that leave the params as they are: each save writes a new rev into
            # Redis's state, whose params must stay (the new gateway below reads them)
            key = state_key("one")
            revs = [redis.state(key).get("rev")]
            check(revs[0] and redis.params_hash(key) == {"travel.n": "14"},
                  f"the state after turn 14 should hold n 14 under a rev: {redis.state(key)}")
            for k in range(15, 18):
                t, _ = await turn(c, app, f"one{k}", f"one {k}", "r")
                everything += [("user", f"one {k}"), ("assistant", t.terminal["text"])]
                # the save may land just after the done
                await harness.wait_until(lambda: state_rev(redis, "one") not in revs, 5)
                got, rev = redis.params_hash(key), redis.state(key).get("rev")
                check(got == {"travel.n": "14"} and rev not in revs,
                      f"turn {k} left the params as they were: Redis's state should keep only n 14 "
                      f"under a new rev, holds {got} under {rev!r} (revs before: {revs})")
                revs.append(rev)
            await c.close()
            cached, appended = store_counts(gw)
            check((cached, appended) == (16, 16),
                  f"loads answered 'same' and saves appended should be 16 and 16, are {cached} and {appended}")
            got = redis_history(redis, "one", "r")
            check(got == everything[-10:], f"Redis's list should be the last 10 messages in order: {got}")
        async with harness.Gateway(args(rules), config(app, redis), name="gw-one-b") as gw:
            c = await connect(gw, "one")
            _, fwd = await turn(c, app, "one18", "one 18", "r")
            check(history_pairs(fwd["history"]) == everything[-10:],
                  f"a new gateway's forwarded history: {harness.brief(fwd['history'], 600)}")
            check(fwd["params"].get("n") == 14, f"a new gateway's params: {fwd['params']}")
            check(store_counts(gw)[0] == 0, f"a new gateway has no copy to be 'same': {store_counts(gw)}")
            await c.close()


async def part_two_gateways(app, redis, rules):
    with step("two gateways, turns alternating on one dialog: each sees the other's params and history"):
        async with harness.Gateway(args(rules), config(app, redis), name="gw-a") as gw_a, \
                harness.Gateway(args(rules), config(app, redis), name="gw-b") as gw_b:
            ca, cb = await connect(gw_a, "two"), await connect(gw_b, "two")
            everything = []
            await checked_turns([ca, cb], app, "two", range(1, 11), everything)  # odd turns on a
            got = redis_history(redis, "two", "r")
            check(got == everything[-10:], f"Redis's list should be the last 10 messages in order: {got}")
            # then on one gateway only: its copy is Redis's again, and used
            before = store_counts(gw_a)[0]
            await checked_turns([ca], app, "two", range(11, 14), everything, with_params=False)
            check(store_counts(gw_a)[0] - before == 2,
                  f"after the first turn back on gateway a, its loads should be answered 'same': "
                  f"{store_counts(gw_a)[0] - before} of 3")
            await ca.close()
            await cb.close()


async def part_behind_the_back(app, redis, rules):
    async with harness.Gateway(args(rules), config(app, redis), name="gw-back") as gw:
        c = await connect(gw, "back")
        with step("the state's params rewritten in Redis without a rev (a writer that writes none): the next "
                  "turn reads them, and its save writes a rev again"):
            await turn(c, app, "bk1", "first", "r", {"service": "travel", "params": {"from": "Nairobi"}})
            await turn(c, app, "bk2", "second", "r")
            key = state_key("back")
            rewrite_v(redis, "back", lambda v: v.setdefault("params", {}).setdefault("travel", {}).update({"from": "Mombasa"}))
            redis.command("HDEL", key, "rev")
            _, fwd = await turn(c, app, "bk3", "third", "r")
            check(fwd["params"].get("from") == "Mombasa", f"params written behind the gateway: {fwd['params']}")
            ok = await harness.wait_until(lambda: state_rev(redis, "back") is not None, 5)
            check(ok and redis.params_hash(key) == {"travel.from": '"Mombasa"'},
                  f"the turn's save should write the state again, with a rev: {redis.hgetall(key)}")
        with step("the history list gone in Redis (it lapses first), the rev kept: the next turn has none"):
            redis.command("DEL", harness.dialog_key("back", "r", "history"))
            _, fwd = await turn(c, app, "bk4", "fourth", "r")
            check(fwd["history"] == [], f"the history should be gone: {harness.brief(fwd['history'], 400)}")
            _, fwd = await turn(c, app, "bk5", "fifth", "r")
            check(history_pairs(fwd["history"]) == [("user", "fourth"), ("assistant", state_reply_text("fourth"))],
                  f"then only the fourth turn: {fwd['history']}")
        with step("the state gone in Redis (one key holds the dialog's hash and the params with their rev now: "
                  "'the dialog's hash gone, the rev kept' cannot happen any more), the history kept: the next "
                  "turn reads Redis's copy (no service, no params, the history)"):
            await turn(c, app, "bk6", "sixth", "r", {"service": "travel"})
            _, fwd = await turn(c, app, "bk7", "seventh", "r")
            check(fwd["service"] == "travel", f"the service should be kept: {fwd['service']}")
            kept = redis_history(redis, "back", "r")
            redis.command("DEL", state_key("back"))
            _, fwd = await turn(c, app, "bk8", "eighth", "r")
            check(fwd["service"] is None and "from" not in fwd["params"],
                  f"the state is gone, so are its service and params: {fwd['service']}, {fwd['params']}")
            check(history_pairs(fwd["history"]) == kept and len(kept) == 8,
                  f"the history list stays (8 messages): {harness.brief(fwd['history'], 600)}")
            await turn(c, app, "bk9", "ninth", "r", {"service": "travel", "params": {"from": "Nairobi"}})
        await c.close()
    with step("the dialog's part lapsed inside the state (v's dialog_until past, params_until not: what was the "
              "dialog's hash lapsing before the params hash), read by a gateway with no copy: no service and "
              "meta (the turn counts from 1 again), the params kept"):
        ok = await harness.wait_until(lambda: redis.params_hash(state_key("back")) == {"travel.from": '"Nairobi"'}, 5)
        check(ok and redis.state(state_key("back")).get("service") == "travel",
              f"the state before: {redis.hgetall(state_key('back'))}")
        rewrite_v(redis, "back", lambda v: v.update(dialog_until=int(time.time()) - 1))
        async with harness.Gateway(args(rules), config(app, redis), name="gw-back-b") as gw:
            c = await connect(gw, "back")
            _, fwd = await turn(c, app, "bk10", "tenth", "r")
            check(fwd["service"] is None, f"the dialog's part lapsed, its service with it: {fwd['service']}")
            state = await context_command(c, "context.get", "r")
            check(state.get("params") == {"travel": {"from": "Nairobi"}},
                  f"the params, whose params_until has not passed, should be kept: {state.get('params')}")
            check((state.get("meta") or {}).get("turn_count") == 1,
                  f"the dialog's meta lapsed (10 turns), so the count starts again: {state.get('meta')}")
            await c.close()


async def mid_turn(app, redis, rules, user, parts):
    """Three turns, then a fourth during which `parts` of the dialog's keys are deleted in
    Redis: Redis's list must end up holding the whole dialog, the 4th save sent again in
    full (2 saves appended), and the next turn must see the same."""
    async with harness.Gateway(args(rules), config(app, redis), name=f"gw-{user}") as gw:
        c = await connect(gw, user)
        everything = []
        for k in range(1, 4):
            t, _ = await turn(c, app, f"{user}{k}", f"mid {k}", "r")
            everything += [("user", f"mid {k}"), ("assistant", t.terminal["text"])]
        text = "mid 4 [delay=1]"  # the app waits 1 s after its first delta
        pending = asyncio.ensure_future(c.message(text, mid=f"{user}4", room="r"))
        await app.wait_message(f"{user}4")
        for part in parts:
            redis.command("DEL", harness.dialog_key(user, "r", part))
        t = await pending
        t.expect_done()
        everything += [("user", text), ("assistant", t.terminal["text"])]
        ok = await harness.wait_until(lambda: redis_history(redis, user, "r") == everything, 5)
        check(ok, f"Redis's list should hold all 8 messages: {redis_history(redis, user, 'r')}")
        lock = harness.dialog_key(user, "r", "lock")  # the 4th turn's lease, kept by the refused append
        let_go = await harness.wait_until(lambda: redis.get(lock) is None, 3)
        check(let_go, f"the lock should be let go once the merged save is answered, not held until it lapses "
                      f"(15 s): {redis.get(lock)!r}")
        _, appended = store_counts(gw)
        check(appended == 2, f"2 saves appended (the 4th was refused, sent again in full): {appended}")
        _, fwd = await turn(c, app, f"{user}5", "mid 5", "r")
        check(history_pairs(fwd["history"]) == everything, f"the next turn's history: {fwd['history']}")
        await c.close()


async def part_mid_turn(app, redis, rules):
    with step("the dialog's keys (state, history) deleted during a turn: the save is sent again in full, the "
              "list holds the whole dialog"):
        await mid_turn(app, redis, rules, "mid", ("state", "history"))
    with step("only the history list gone during a turn (lapsed, or evicted), the rev kept: the same"):
        await mid_turn(app, redis, rules, "midh", ("history",))
    with step("only the state gone during a turn (its rev with it; it holds what were the params and the "
              "dialog's hash), the history kept: the same"):
        await mid_turn(app, redis, rules, "midp", ("state",))


async def part_foreign_write(app, redis, rules):
    with step("another gateway's write-back or merge (they hold no lease) lands during a turn, the history at "
              "its full length, so the list's count cannot show it: the turn's save meets the other rev and "
              "merges; the next turn sees the other's message"):
        user = "foreign"
        async with harness.Gateway(args(rules), config(app, redis), name="gw-foreign") as gw:
            c = await connect(gw, user)
            for k in range(1, 6):  # 10 messages: history_n
                await turn(c, app, f"{user}{k}", f"foreign {k}", "r")
            pending = asyncio.ensure_future(c.message("foreign 6 [delay=1]", mid=f"{user}6", room="r"))
            await app.wait_message(f"{user}6")
            # what a lease-less merge of another gateway leaves: a message more, the oldest gone
            # (the list's length unchanged), and its rev
            hist = harness.dialog_key(user, "r", "history")
            other = dict(json.loads(redis.lrange(hist)[-1]), role="user", content="from the other gateway")
            redis.command("RPUSH", hist, json.dumps(other))
            redis.command("LPOP", hist)
            redis.command("HSET", state_key(user), "rev", "other-gw:1:00000000#1")
            t = await pending
            t.expect_done()
            _, fwd = await turn(c, app, f"{user}7", "foreign 7", "r")
            pairs = history_pairs(fwd["history"])
            check(("user", "from the other gateway") in pairs and ("user", "foreign 6 [delay=1]") in pairs,
                  f"the next turn should see both the other gateway's message and this one's: {pairs}")
            # counted though history_n cuts the merge back to either copy's length (it was not)
            merges = metrics(gw).value("chatgate_store_merges_total")
            check(merges == 1, f"the merge of two copies' turns should be counted once: {merges}")
            await c.close()


async def part_save_error(app, redis, rules):
    with step("a save answered with an error (Redis out of memory: maxmemory reached during the turn, "
              "noeviction): the turn's lease is let go at once, not held until it lapses (15 s)"):
        user = "oom"
        async with harness.Gateway(args(rules), config(app, redis), name="gw-oom") as gw:
            c = await connect(gw, user)
            await turn(c, app, f"{user}1", "oom 1", "r")
            lock = harness.dialog_key(user, "r", "lock")
            pending = asyncio.ensure_future(c.message("oom 2 [delay=1]", mid=f"{user}2", room="r"))
            await app.wait_message(f"{user}2")
            check(redis.get(lock), "the turn should hold the lock while it runs")
            redis.command("CONFIG", "SET", "maxmemory", "1")  # every write that may grow memory is refused
            try:
                t = await pending
                t.expect_done()
                # the save's script stops at its RPUSH (-OOM); DEL is allowed out of memory
                let_go = await harness.wait_until(lambda: redis.get(lock) is None, 3)
                check(let_go, f"the turn's lease should be let go once its save failed: {redis.get(lock)!r}, "
                              f"PTTL {redis.command('PTTL', lock)} ms")
            finally:
                redis.command("CONFIG", "SET", "maxmemory", "0")
            _, fwd = await turn(c, app, f"{user}3", "oom 3", "r")
            check(("user", "oom 2 [delay=1]") in history_pairs(fwd["history"]),
                  f"the turn whose save failed is kept (in memory, written back): {fwd['history']}")
            await c.close()

    with step("a write-back Redis keeps refusing (an ACL that denies the scripts) is sent again every second, "
              "each refusal counted (chatgate_store_writeback_failures_total), and written once Redis takes it"):
        user = "acl"
        async with harness.Gateway(args(rules), config(app, redis), name="gw-acl") as gw:
            c = await connect(gw, user)
            await turn(c, app, f"{user}1", "acl 1", "r")
            failed_before = metrics(gw).value("chatgate_store_writeback_failures_total")
            redis.command("ACL", "SETUSER", "default", "-eval", "-evalsha")
            try:
                # the load is plain commands; the save is a script, refused: kept for the write-back
                await turn(c, app, f"{user}2", "acl 2", "r")
                refused = await harness.wait_until(
                    lambda: metrics(gw).value("chatgate_store_writeback_failures_total") >= failed_before + 2, 5)
                m = metrics(gw)
                check(refused and m.value("chatgate_store_writeback_pending") == 1,
                      "each refused try of the write-back should be counted, the dialog still pending: "
                      f"{m.value('chatgate_store_writeback_failures_total') - failed_before} refusals, "
                      f"{m.value('chatgate_store_writeback_pending')} pending")
            finally:
                redis.command("ACL", "SETUSER", "default", "+@all")
            written = await harness.wait_until(lambda: metrics(gw).value("chatgate_store_writeback_pending") == 0, 5)
            check(written and ("user", "acl 2") in redis_history(redis, user, "r"),
                  f"the write-back should land once Redis takes scripts again: {redis_history(redis, user, 'r')}")
            await c.close()


def ttls(redis, user, parts=("state", "history")):
    """The TTLs of a dialog's keys (room "r") and of the user's rooms set, by part."""
    got = {part: redis.ttl(harness.dialog_key(user, "r", part)) for part in parts}
    got["rooms"] = redis.ttl(harness.rooms_key(user))
    return got


async def part_lifetimes(app, redis, rules):
    with step("lifetimes in Redis: a save within 30 s of the last renewal (the shortest lifetime, "
              "30 min, over 60) leaves them as they are"):
        async with harness.Gateway(args(rules), config(app, redis), name="gw-life") as gw:
            c = await connect(gw, "life")
            for k in range(1, 3):  # the first save renews, as every rewrite does
                await turn(c, app, f"life{k}", f"life {k}", "r", {"service": "travel", "params": {"n": k}})
            for part in ("state", "history"):
                redis.command("EXPIRE", harness.dialog_key("life", "r", part), "100")
            redis.command("EXPIRE", harness.rooms_key("life"), "100")
            await turn(c, app, "life3", "life 3", "r")  # the same params: an append, nothing made
            got = ttls(redis, "life")
            check(all(0 < t <= 100 for t in got.values()),
                  f"a save 30 s within the last renewal keeps the keys' lifetimes (set to 100 s): {got}")
            check(store_counts(gw)[1] == 2, f"the saves after the first appended: {store_counts(gw)}")
            await c.close()
    with step("keys gone during such a save: the rooms set is not made (an appending save within the renewal "
              "adds nothing to it); the state gone (its rev with it: 'the dialog's hash gone alone, the rev kept' "
              "cannot happen any more) refuses the append, and the rewrite makes the state (2 h: the longest of "
              "params_s and dialog_s), the history (30 min) and the rooms set again, each with its lifetime"):
        async with harness.Gateway(args(rules), config(app, redis), name="gw-life-b") as gw:
            c = await connect(gw, "lifeb")
            for k in range(1, 3):
                await turn(c, app, f"lifeb{k}", f"lifeb {k}", "r")
            pending = asyncio.ensure_future(c.message("lifeb 3 [delay=1]", mid="lifeb3", room="r"))
            await app.wait_message("lifeb3")
            redis.command("DEL", harness.rooms_key("lifeb"))
            (await pending).expect_done()
            ok = await harness.wait_until(lambda: len(redis_history(redis, "lifeb", "r")) == 6, 5)
            got = ttls(redis, "lifeb")
            check(ok and got["rooms"] == -2 and 0 < got["state"] <= 7200,
                  f"the rooms set should stay gone until a save renews the lifetimes: {got}")
            check(store_counts(gw)[1] == 2, f"the saves after the first appended: {store_counts(gw)}")
            for part in ("state", "history"):  # lifetimes a rewrite's would not be
                redis.command("EXPIRE", harness.dialog_key("lifeb", "r", part), "100")
            pending = asyncio.ensure_future(c.message("lifeb 4 [delay=1]", mid="lifeb4", room="r"))
            await app.wait_message("lifeb4")
            redis.command("DEL", state_key("lifeb"))
            (await pending).expect_done()
            ok = await harness.wait_until(lambda: len(redis_history(redis, "lifeb", "r")) == 8
                                          and redis.ttl(harness.rooms_key("lifeb")) > 0, 5)
            got = ttls(redis, "lifeb")
            check(ok and 7100 <= got["state"] <= 7200 and 1700 <= got["history"] <= 1800
                  and 7100 <= got["rooms"] <= 7200,
                  f"the state, made again by the save, should live 2 h, the history rewritten 30 min, and the "
                  f"rooms set, made again by the rewrite, 2 h: {got}")
            check(redis.state(state_key("lifeb")).get("meta", {}).get("turn_count") == 4,
                  f"the rewritten state should hold the 4 turns: {redis.state(state_key('lifeb'))}")
            check(store_counts(gw)[1] == 2, f"the 4th save's append was refused (the rev gone): {store_counts(gw)}")
            await c.close()
    short = {"params_s": 120, "dialog_s": 120, "awaiting_s": 60, "soft_s": 60, "history_s": 60}
    with step("a save a second or more after the last renewal (60 s lifetimes) renews them all, and puts the "
              "room back in a rooms set that was deleted; the lock, let go, is deleted"):
        cfg = harness.state_config({"app": harness.app_upstream(app, "/state")}, "app", store=redis.url,
                                   lifetimes=short, history_n=10)
        async with harness.Gateway(args(rules), cfg, name="gw-life-c") as gw:
            c = await connect(gw, "lifec")
            for k in range(1, 3):
                await turn(c, app, f"lifec{k}", f"lifec {k}", "r")
            for part in ("state", "history"):
                redis.command("EXPIRE", harness.dialog_key("lifec", "r", part), "30")
            redis.command("DEL", harness.rooms_key("lifec"))
            await asyncio.sleep(2.1)  # the subject: the renewal of a lifetime over two seconds old
            await turn(c, app, "lifec3", "lifec 3", "r")
            await harness.wait_until(lambda: redis.ttl(harness.rooms_key("lifec")) > 0, 5)  # the save, after the done
            got = ttls(redis, "lifec")
            want = {"state": 120, "history": 60, "rooms": 120}
            check(all(want[p] - 5 <= t <= want[p] for p, t in got.items()),
                  f"renewed to their lifetimes {want}: {got}")
            rooms = redis.zrange(harness.rooms_key("lifec"))
            check(rooms == ["r"], f"the renewing save should put the room back in the rooms set: {rooms}")
            lock = harness.dialog_key("lifec", "r", "lock")
            check(await harness.wait_until(lambda: redis.get(lock) is None, 3),
                  f"the lock, let go, should be deleted: {redis.get(lock)!r}")
            check(store_counts(gw)[1] == 2, f"the saves after the first appended: {store_counts(gw)}")
            await c.close()
    long_history = {"params_s": 120, "dialog_s": 120, "awaiting_s": 60, "soft_s": 60, "history_s": 7200}
    with step("an appending save within the renewal interval sets an awaiting state (ttl 3600) that outlives "
              "the state's lifetime (params_s = dialog_s = 120, history_s 7200): the state's TTL covers it (before "
              "the fix it kept its 120 s, and the awaiting state lapsed an hour early)"):
        cfg = harness.state_config({"app": harness.app_upstream(app, "/state")}, "app", store=redis.url,
                                   lifetimes=long_history, history_n=10)
        async with harness.Gateway(args(rules), cfg, name="gw-life-d") as gw:
            c = await connect(gw, "lifed")
            key = harness.dialog_key("lifed", "r", "state")
            await turn(c, app, "lifed1", "lifed 1", "r")
            await turn(c, app, "lifed2", "lifed 2", "r",
                       {"awaiting": {"type": "selection", "options": [{"name": "KQ100"}], "ttl": 3600}})
            check(await harness.wait_until(lambda: redis.state(key).get("awaiting") is not None, 5),
                  f"the awaiting state never reached the state: {redis.state(key)}")
            left, ttl = redis.state(key)["awaiting_expires"] - time.time(), redis.ttl(key)
            check(ttl >= left - 1, f"the state's TTL ({ttl} s) should cover the awaiting state's {left:.0f} s left")
            check(store_counts(gw)[1] == 1, f"the second save appended: {store_counts(gw)}")
            await c.close()


# What Redis runs for a turn whose load is answered 'same' and whose save appends to a full
# history within the lifetimes' renewal (docs/state.md, "Redis layout", recounted from the
# binary's INFO commandstats and SLOWLOG with the state, issue 39's ninth round): the load's plain
# commands (SET NX of the lock, HGET of the state's rev, EXISTS of the history: the copy has
# messages), and the save script (EVALSHA) with its calls: GET of the lock, HGET of the rev
# (read under the turn's own lease too: a write-back or merge of another gateway holds
# none), RPUSH of the new messages (its answer checks the list's length: no LLEN), one HSET
# of the state (rev, created_at, last_activity, v), LTRIM (the list outgrows the history),
# DEL of the lock. No HSET or HDEL of other hashes, no SET or DEL of awaiting or soft keys,
# no EXPIRE (not due), no ZADD (the room's score is renewed with the lifetimes).
TURN_COMMANDS = {"set": 1, "hget": 2, "exists": 1, "evalsha": 1, "get": 1, "rpush": 1, "hset": 1, "ltrim": 1,
                 "del": 1, "hgetall": 1}
# and the user's profile, read with the load (HGETALL, pipelined with its plain commands):
# 11 commands a turn, 6 of them in the save script. In order, as SLOWLOG shows them (Redis 7
# logs a script's calls before the EVALSHA): the command, the last part of its key, and one
# more argument it must have ("" for none).
TURN_SEQUENCE = [("set", "lock", "NX"), ("hget", "state", "rev"), ("exists", "history", ""),
                 ("hgetall", "profile", ""),
                 ("get", "lock", ""), ("hget", "state", "rev"), ("rpush", "history", ""), ("hset", "state", "v"),
                 ("ltrim", "history", ""), ("del", "lock", ""), ("evalsha", "", "")]


def shown(args):
    """A command SLOWLOG logged, as TURN_SEQUENCE names it: (command, the last part of its
    key, the argument of TURN_SEQUENCE it must have when it has it, else "")."""
    cmd = args[0].lower()
    part = "" if cmd == "evalsha" else args[1].rsplit(":", 1)[-1]
    more = {"set": "NX", "hget": "rev", "hset": "v"}.get(cmd)
    return cmd, part, more if more in args[2:] else ""


async def part_parts_deleted(app, redis, rules):
    with step("an awaiting state (ttl 9000 s, past params_s and dialog_s) and a soft context set, then cleared: "
              "the state's v holds each with its end (*_expires), its TTL covers them, and the save that "
              "clears one writes it null and 0; 5 turns with neither, loads answered 'same' and saves appending "
              "to a full history, make 11 commands each in Redis: SET NX lock, HGET state rev, EXISTS history "
              "(the load: no script), HGETALL profile, EVALSHA and its 6 calls GET lock, HGET state rev, RPUSH, "
              "HSET state, LTRIM, DEL lock (the save: no HSET of a params rev, no HSET/HDEL of a dialog hash, no "
              "SET/DEL of awaiting or soft keys, no LLEN, no EXPIRE, no ZADD)"):
        async with harness.Gateway(args(rules), config(app, redis), name="gw-parts") as gw:
            c = await connect(gw, "parts")
            key = state_key("parts")
            options = [{"name": "KQ100"}]
            awaiting = {"type": "selection", "options": options, "ttl": 9000}
            await turn(c, app, "parts1", "parts 1", "r")
            for part, expires, directive, want_ttl in (
                    ("awaiting", "awaiting_expires", {"awaiting": awaiting}, 9000),
                    ("soft_context", "soft_expires", {"soft_context": {"a": 1}}, 60)):
                before = state_rev(redis, "parts")
                await turn(c, app, f"parts-{part}-set", f"set {part}", "r", directive)
                await harness.wait_until(lambda: state_rev(redis, "parts") != before, 5)
                got, now, ttl = redis.state(key), time.time(), redis.ttl(key)
                value, left = got.get(part) or {}, got.get(expires, 0) - now
                check((value.get("options") == options if part == "awaiting" else value.get("a") == 1)
                      and want_ttl - 5 <= left <= want_ttl + 1,
                      f"the state's v after a turn that set {part} should hold it, ending in {want_ttl} s: "
                      f"{part} {value}, {expires} {left:.1f} s from now")
                # 9000 s: the awaiting state's, longer than params_s and dialog_s (set by the save
                # that made it, and kept by the appending saves after it, the lifetimes not due)
                check(ttl >= left and 9000 - 5 <= ttl <= 9000,
                      f"the state's TTL should cover the {part} ({left:.0f} s left), and be the awaiting "
                      f"state's 9000 s, the longest: {ttl} s")
                before = state_rev(redis, "parts")
                await turn(c, app, f"parts-{part}-clear", f"clear {part}", "r", {part: None})
                await harness.wait_until(lambda: state_rev(redis, "parts") != before, 5)
                got = redis.state(key)
                check(got.get(part, "absent") is None and got.get(expires) == 0,
                      f"the save that cleared {part} should write it null and {expires} 0: "
                      f"{part} {got.get(part, 'absent')!r}, {expires} {got.get(expires)!r}")
            await turn(c, app, "parts-warm", "warm", "r")

            def calls():
                stats = redis.info_commandstats()
                return {cmd: s.get("calls", 0) for cmd, s in stats.items() if cmd.split("|")[0] not in ("info", "config", "slowlog")}  # the test's own
            await harness.wait_until(lambda: redis.get(harness.dialog_key("parts", "r", "lock")) is None, 5)
            cached, before = store_counts(gw)[0], calls()
            redis.command("CONFIG", "SET", "slowlog-log-slower-than", "0")  # every command, with its arguments
            redis.command("SLOWLOG", "RESET")
            try:
                for k in range(5):
                    await turn(c, app, f"parts-n{k}", f"plain {k}", "r")
                # the last save lands after its done: wait for it (a loaded machine may take a while)
                await harness.wait_until(lambda: calls().get("del", 0) - before.get("del", 0) >= 5, 5)
                await asyncio.sleep(0.2)  # anything more would have come by now
                after = calls()
                logged = redis.command("SLOWLOG", "GET", "1000")
            finally:
                redis.command("CONFIG", "SET", "slowlog-log-slower-than", "10000")
            got = [shown(e[3]) for e in reversed(logged) if e[3][0].lower() not in ("info", "slowlog", "config")]
            check(got == TURN_SEQUENCE * 5, f"each of 5 turns should run {TURN_SEQUENCE}, ran {got}")
            made = {cmd: n - before.get(cmd, 0) for cmd, n in after.items() if n != before.get(cmd, 0)}
            want = {cmd: 5 * n for cmd, n in TURN_COMMANDS.items()}
            check(made == want, f"5 turns should make exactly {want} in Redis (a turn: {TURN_COMMANDS}, "
                                f"{sum(TURN_COMMANDS.values())} commands), made {made}")
            check(store_counts(gw)[0] - cached == 5, f"the 5 loads were answered 'same': {store_counts(gw)}")
            check(store_counts(gw)[1] >= 7, f"those saves appended: {store_counts(gw)}")
            await c.close()


async def read_by_new_gateway(app, redis, rules, name, mid, everything, state=None):
    """One turn of dialog unread/r through a gateway with no copy (it reads Redis's in full):
    (forwarded frame, the gateway's warnings of parts left out); everything grows by the turn."""
    async with harness.Gateway(args(rules), config(app, redis), name=name) as gw:
        c = await connect(gw, "unread")
        t, fwd = await turn(c, app, mid, mid, "r", state)
        everything += [("user", mid), ("assistant", t.terminal["text"])]
        await c.close()
        # the save lands after the done: the gateway's stop waits for it
    return fwd, [line for line in gw.log_text().splitlines() if "chatgate does not write" in line]


async def part_unreadable(app, redis, rules):
    key, history = state_key("unread"), harness.dialog_key("unread", "r", "history")
    everything = []
    with step("a state whose v is not a JSON object and a history message that is not one (what chatgate does "
              "not write; the state's v holds every params field now, so a params field cannot be left out "
              "alone), read by a gateway with no copy: the rest (the history) is read, one warning counts the 2 "
              "and names the first (the state's v), and the turn's save rewrites the state and the list "
              "without them"):
        async with harness.Gateway(args(rules), config(app, redis), name="gw-unread-a") as gw:
            c = await connect(gw, "unread")
            for mid, state in (("un1", {"service": "travel", "params": {"from": "Nairobi"}}), ("un2", None)):
                t, _ = await turn(c, app, mid, mid, "r", state)
                everything += [("user", mid), ("assistant", t.terminal["text"])]
            await c.close()
        rev = redis.state(key).get("rev")
        check(rev, f"the state before: {redis.hgetall(key)}")
        redis.command("HSET", key, "v", "{not json")
        redis.command("LINSERT", history, "BEFORE", redis.lrange(history)[1], "garbage")
        expected = list(everything)
        fwd, warnings = await read_by_new_gateway(app, redis, rules, "gw-unread-b", "un3", everything,
                                                  {"service": "travel", "params": {"to": "London"}})
        check(fwd["service"] is None and "from" not in fwd["params"],
              f"nothing of the unreadable v (its service, its params): {fwd['service']}, {fwd['params']}")
        check(history_pairs(fwd["history"]) == expected,
              f"the readable history only: {harness.brief(fwd['history'], 600)}")
        got = redis.state(key)  # fails unless v is a JSON object, with a rev
        check(got.get("params") == {"travel": {"to": "London"}} and got.get("service") == "travel"
              and got.get("rev") != rev,
              f"the save should rewrite the state (a readable v, the turn's params, a new rev): {got}")
        check("garbage" not in redis.lrange(history) and redis_history(redis, "unread", "r") == everything,
              f"the save should rewrite the list without the garbage: {redis.lrange(history)}")
        check(len(warnings) == 1 and "2 part(s)" in warnings[0] and "state field" in warnings[0]
              and "'v'" in warnings[0],
              f"one warning naming the first of the 2 parts left out, the state's v: {warnings}")
    with step("a history message in Redis that is not a JSON object, read by a gateway with no copy: the "
              "rest is forwarded, and the turn's save rewrites the list without it"):
        redis.command("LINSERT", history, "BEFORE", redis.lrange(history)[1], "garbage")
        expected = list(everything)
        fwd, warnings = await read_by_new_gateway(app, redis, rules, "gw-unread-c", "un4", everything)
        check(history_pairs(fwd["history"]) == expected,
              f"the readable history only: {harness.brief(fwd['history'], 600)}")
        check(fwd["params"].get("to") == "London", f"the state read whole: {fwd['params']}")
        check("garbage" not in redis.lrange(history) and redis_history(redis, "unread", "r") == everything,
              f"the save should rewrite the list without the garbage: {redis.lrange(history)}")
        check(len(warnings) == 1 and "1 part(s)" in warnings[0] and "history message" in warnings[0],
              f"one warning naming the history message left out: {warnings}")


async def part_rewrite_over(app, redis, rules):
    key, history = state_key("over"), harness.dialog_key("over", "r", "history")
    with step("a turn whose save rewrites the dialog (its load left a history message out, so the gateway's copy "
              "has no rev) while another gateway's lease-less write lands during it (a message more, and "
              "HSET state rev <its>): the rewrite finds another rev than its load read and merges; Redis keeps "
              "the other's message and the turn's, and the params"):
        async with harness.Gateway(args(rules), config(app, redis), name="gw-over-a") as gw:
            c = await connect(gw, "over")
            await turn(c, app, "ov1", "ov1", "r", {"service": "travel", "params": {"from": "Nairobi"}})
            await c.close()
        redis.command("LINSERT", history, "BEFORE", redis.lrange(history)[1], "garbage")
        async with harness.Gateway(args(rules), config(app, redis), name="gw-over-b") as gw:
            c = await connect(gw, "over")
            pending = asyncio.ensure_future(c.message("ov2 [delay=1]", mid="ov2", room="r"))
            await app.wait_message("ov2")
            other = dict(json.loads(redis.lrange(history)[-1]), role="user", content="from the other gateway")
            redis.command("RPUSH", history, json.dumps(other))
            redis.command("HSET", key, "rev", "other-gw:1:00000000#1")
            (await pending).expect_done()
            # the gateway stops at once: the save's merge runs while the store drains (before,
            # the closing link refused its commands, and the turn was lost at exit)
            await c.close()
        check("garbage" not in redis.lrange(history), f"the merge's list, without the message left out: "
                                                      f"{redis.lrange(history)}")
        said = [content for role, content in redis_history(redis, "over", "r") if role == "user"]
        check(said == ["ov1", "from the other gateway", "ov2 [delay=1]"],
              f"Redis should keep the other gateway's message and the turn's: {said}")
        got = redis.state(key)
        check(redis.params_hash(key) == {"travel.from": '"Nairobi"'} and got.get("rev") != "other-gw:1:00000000#1",
              f"the merge's params, under a rev of its own: {got}")


async def part_lock_values(app, redis, rules):
    """The dialog's lock holding what chatgate did not write (docs/state.md, "The dialog
    lease"): a value that is no ticket is another holder's lease until it lapses; a value
    let go ("-...") is free, marked or not; every turn holds its own ticket, and deletes the
    lock when done."""
    lock = harness.dialog_key("lockv", "r", "lock")
    async with harness.Gateway(args(rules), config(app, redis), name="gw-lockv") as gw:
        c = await connect(gw, "lockv")
        await turn(c, app, "lv1", "lv 1", "r")
        with step("every turn holds the lock with its own ticket (\"<holder>#<n>\", redis.lease_ms) while it "
                  "runs, and deletes it when done"):
            pending = asyncio.ensure_future(c.message("lv 2 [delay=1]", mid="lv2", room="r"))
            await app.wait_message("lv2")
            held, ttl = redis.get(lock), redis.command("PTTL", lock)
            check(held and "#" in held and " " not in held and not held.startswith("-") and 0 < ttl <= 15000,
                  f"the lock during a turn: {held!r}, PTTL {ttl}")
            (await pending).expect_done()
            check(await harness.wait_until(lambda: redis.get(lock) is None, 5),
                  f"the lock after the turn: {redis.get(lock)!r}")
        with step("a lock let go that chatgate did not write (\"-\", \"-x w\", no TTL): the next turn "
                  "takes it at once"):
            for value in ("-", "-x w"):
                redis.command("SET", lock, value)
                started = time.monotonic()
                await turn(c, app, f"lv-{len(value)}", "lv", "r")
                check(time.monotonic() - started < 2, f"a turn after the lock {value!r} should not wait")
                await harness.wait_condition(lambda: redis.get(lock) is None, 5, f"the turn's own lock let go after {value!r}")
        with step("a lock that is no ticket (\"garbage\", PX 1500) is another's lease: the turn waits "
                  "for it to lapse, then runs"):
            redis.command("SET", lock, "garbage", "PX", "1500")
            started = time.monotonic()
            await turn(c, app, "lv-g", "lv", "r")
            waited = time.monotonic() - started
            check(1.2 <= waited < 5, f"the turn should wait for the foreign lock to lapse (1.5 s): {waited:.2f} s")
            print(f"   waited {waited:.2f} s")
        await c.close()
        with step("a new dialog's first save (a rewrite) that finds its lock gone (evicted, lost in a failover) "
                  "and no copy in Redis (no other gateway saved) is written, and not counted as a lost lease"):
            c = await connect(gw, "lockgone")
            pending = asyncio.ensure_future(c.message("first [delay=1]", mid="lg1", room="r"))
            await app.wait_message("lg1")
            redis.command("DEL", harness.dialog_key("lockgone", "r", "lock"))
            (await pending).expect_done()
            ok = await harness.wait_until(lambda: len(redis_history(redis, "lockgone", "r")) == 2, 5)
            check(ok, f"the turn should be written: {redis_history(redis, 'lockgone', 'r')}")
            lost = metrics(gw).value("chatgate_store_lease_lost_total")
            check(int(lost) == 0, f"a lock gone is no lease lost: {lost}")
            await c.close()


async def part_upgrade(app, redis, rules):
    """A dialog written by a chatgate before the state (issue 39's ninth round), in the layout
    of then, by hand: the first load finds no state and reads the old keys, and the save after
    it writes the state and the history with nothing lost."""
    user = "upgrade"

    def old(part):
        return harness.dialog_key(user, "r", part)
    with step("the upgrade: a dialog in the layout before the state (params hash with its rev and travel.from, "
              "dialog hash, awaiting key, history list of 4; no state key), a turn through a gateway with no "
              "copy: the turn sees the old params, service, awaiting and history, and afterwards the state holds "
              "them with the turn's (params, awaiting, meta) and the list the 4 old messages and the turn's; "
              "a gateway started afterwards reads the state, not the old keys"):
        now = int(time.time())
        created = now - 600
        redis.command("HSET", old("params"), "rev", "old-gw:1:00000000#7", "travel.from", json.dumps("Nairobi"))
        redis.command("EXPIRE", old("params"), "3600")
        redis.command("HSET", old("dialog"), "service", "travel", "created_at", str(created),
                      "last_activity", str(now - 60), "turn_count", "2", "message_count", "4")
        redis.command("EXPIRE", old("dialog"), "7200")
        options = [{"name": "KQ100"}, {"name": "BA65"}]
        awaiting = {"type": "selection", "options": options, "context": None, "source": "app"}
        redis.command("SET", old("awaiting"), json.dumps(dict(awaiting, expires_at=now + 600)), "EX", "600")
        before = [("user", "old 1"), ("assistant", "old reply 1"), ("user", "old 2"), ("assistant", "old reply 2")]
        redis.command("RPUSH", old("history"),
                      *[json.dumps({"role": r, "content": c, "ts": created + i}) for i, (r, c) in enumerate(before)])
        redis.command("EXPIRE", old("history"), "1800")
        check(redis.type(old("state")) == "none", "no state before the upgrade")
        async with harness.Gateway(args(rules), config(app, redis), name="gw-upgrade") as gw:
            c = await connect(gw, user)
            t, fwd = await turn(c, app, "up1", "up 1", "r", {"params": {"to": "London"}})
            check(fwd["service"] == "travel" and fwd["params"].get("from") == "Nairobi",
                  f"the turn should see the old service and params: {fwd['service']}, {fwd['params']}")
            check((fwd["awaiting"] or {}).get("options") == options,
                  f"the turn should see the old awaiting state: {fwd['awaiting']}")
            check(history_pairs(fwd["history"]) == before,
                  f"the turn should see the old history: {harness.brief(fwd['history'], 600)}")
            await c.close()
        # the gateway's stop waits for the save
        everything = before + [("user", "up 1"), ("assistant", t.terminal["text"])]
        got = redis.state(old("state"))
        check(got.get("params") == {"travel": {"from": "Nairobi", "to": "London"}} and got.get("service") == "travel",
              f"the state should hold the old params with the turn's: {got}")
        check((got.get("awaiting") or {}).get("options") == options and got.get("awaiting_expires") == now + 600,
              f"the state should hold the old awaiting state, ending when it did: {got}")
        meta = got.get("meta") or {}
        check(meta.get("created_at") == created and got.get("created_at") == created and meta.get("turn_count") == 3
              and meta.get("message_count") == 5 and got.get("rev") != "old-gw:1:00000000#7",
              f"the state's meta should go on from the old dialog hash's (created_at {created}, 2 turns and 4 "
              f"messages, then the turn's), under a new rev: {got}")
        check(redis_history(redis, user, "r") == everything,
              f"the list should hold the old messages and the turn's: {redis.lrange(old('history'))}")
        state_ttl, history_ttl = redis.ttl(old("state")), redis.ttl(old("history"))
        check(7100 <= state_ttl <= 7200 and 1700 <= history_ttl <= 1800,
              f"the state and the history written with their lifetimes: {state_ttl} s, {history_ttl} s")
        async with harness.Gateway(args(rules), config(app, redis), name="gw-upgrade-b") as gw:
            c = await connect(gw, user)
            _, fwd = await turn(c, app, "up2", "up 2", "r")
            check(fwd["params"].get("from") == "Nairobi" and fwd["params"].get("to") == "London"
                  and history_pairs(fwd["history"]) == everything,
                  f"a new gateway should read the state and the list (the old params hash lacks 'to'): "
                  f"{fwd['params']}, {harness.brief(fwd['history'], 600)}")
            await c.close()


async def main(args_):
    rules = harness.empty_rules_dir()
    redis = await harness.RedisServer().astart()
    try:
        async with harness.FakeApp() as app:
            await independent(part_one_gateway(app, redis, rules))
            await independent(part_two_gateways(app, redis, rules))
            await independent(part_behind_the_back(app, redis, rules))
            await independent(part_mid_turn(app, redis, rules))
            await independent(part_foreign_write(app, redis, rules))
            await independent(part_save_error(app, redis, rules))
            await independent(part_lifetimes(app, redis, rules))
            await independent(part_parts_deleted(app, redis, rules))
            await independent(part_unreadable(app, redis, rules))
            await independent(part_rewrite_over(app, redis, rules))
            await independent(part_lock_values(app, redis, rules))
            await independent(part_upgrade(app, redis, rules))
    finally:
        redis.cleanup(keep=True)


if __name__ == "__main__":
    harness.run(main, timeout=100)
