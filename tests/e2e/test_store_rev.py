"""End-to-end test of the Redis store's copy of a dialog (issue 12; docs/state.md, "The
gateway's copy"), on a real redis-server started on a free port.

Every save writes a new rev (the params hash's "rev" field), and the gateway keeps its copy
of the dialog under it: a turn's load names that rev, and Redis answers "same" instead of
the dialog when its copy is that one; a save whose history is that copy's plus new messages
appends them (RPUSH, LTRIM) instead of rewriting the list. What must hold, through the
state app (harness FakeApp /state, no rules):
- one gateway: each of 14 turns forwards exactly the last 10 messages; from the second turn
  on, every load is answered "same" and every save appends (counted exactly in /metrics);
  three more turns leave the params as they are, and their saves write only a new rev into
  the params hash, whose params stay;
  the Redis list holds the last 10 messages in order; a gateway started afterwards reads the
  same dialog in full;
- two gateways on one Redis, turns alternating on one dialog: each sees the other's params
  and history (a copy of another rev is never used), and the Redis list stays exact;
- Redis's copy changed behind the gateway's back, between turns, as another writer would:
  the params hash rewritten without a rev (a chatgate from before this change), or the
  history list gone (it lapses before the dialog's hash): the next turn reads Redis's copy;
- the dialog's hash gone (its lifetime can be shorter than the params'), the rev kept: the
  next turn reads Redis's copy (no service);
- Redis's copy gone during a turn (its keys deleted), or only its history list (lapsed or
  evicted alone), so the copy the save would append to is no longer Redis's: the save is
  refused before it writes anything and sent again in full, so the list holds the whole
  dialog (as the gateway's next turn sees it), not the new messages alone; the turn's lease,
  which the refused append kept, is let go once the merged save is answered;
- another gateway's write-back or merge (which hold no lease) landing during a turn, with
  the history at its full length (the list's count unchanged): the turn's save reads the rev
  under its own lease too, meets the other's and merges, so the next turn sees both;
- a save answered with an error (Redis out of memory during the turn): the turn's lease is
  let go at once, and the turn is kept (the next one sees it); a write-back Redis keeps
  refusing (an ACL that denies the scripts) goes again every second, each refusal counted in
  chatgate_store_writeback_failures_total, and lands once Redis takes it.
- lifetimes in Redis (docs/state.md, "Lifetimes in Redis"): a save within a sixtieth of the
  shortest lifetime of the last renewal leaves the keys' lifetimes as they are; a key gone
  during such a save (the dialog's hash, the rooms set) is made again with its lifetime, never
  without one; a save after that interval renews them all; the lock, let go, is deleted.
- an awaiting state and soft context cleared by an appending save are deleted in Redis, and
  a save appending to a copy that had neither does not delete them again.
- the dialog's lock (its lease) holding what chatgate did not write: a value let go ("-",
  "-x w") is taken at once; a value that is no ticket is another's lease until it lapses;
  every turn holds its ticket while it runs and deletes the lock when done; a turn's load is
  three plain commands (SET NX, HGET, EXISTS), no script, when nothing is in its way;
- parts in Redis that chatgate does not write (a params field whose value is not JSON or
  whose name has no service, a history message that is not a JSON object), read by a
  gateway with no copy: the rest is read, one warning names the first, and the turn's save
  rewrites the dialog without them; and when another gateway's write-back or merge (no
  lease) lands during that turn, the rewrite meets its rev and merges, so its message stays
  (save mode 4: before, the rewrite under the turn's own lease wrote over it), even when the
  gateway stops right after the turn (the merge runs while the store drains).
Checked by breaking the code: without the load's rev check the two-gateway part fails,
without its check that the history list is there the lapsed-history part, without its check of the
dialog's hash the hash part, without the save's rev check the first mid-turn part (and,
without that check under the turn's own lease, the foreign-write part) and
without its count of messages the second (the list holds 2 messages); without the copy the
counts do; without the rewrite's rev check (mode 4) the rewrite-over part, and without the
merge's read keeping the rev of a dialog with a part left out that part too (its merge never
lands); renewing at every save fails the first lifetimes part, renewing the dialog's hash
only when due the second, never renewing the third; never deleting an awaiting state
that was cleared, or always deleting one that was not there, the last part.
"""

import asyncio
import json
import time

import harness
from harness import Client, check, history_pairs, independent, step, state_reply_text

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
            # three turns that leave the params as they are: each save writes only a new rev
            # into Redis's params hash, whose params must stay (the new gateway below reads them)
            key = harness.dialog_key("one", "r", "params")
            revs = [redis.hgetall(key).get("rev")]
            for k in range(15, 18):
                t, _ = await turn(c, app, f"one{k}", f"one {k}", "r")
                everything += [("user", f"one {k}"), ("assistant", t.terminal["text"])]
                got = redis.hgetall(key)
                check(got.get("travel.n") == "14" and len(got) == 2 and got.get("rev") not in revs,
                      f"turn {k} left the params as they were: Redis's params hash should keep n 14 "
                      f"under a new rev, is {got} (revs before: {revs})")
                revs.append(got.get("rev"))
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
        with step("params rewritten in Redis without a rev (an older chatgate's save): the next turn reads them"):
            await turn(c, app, "bk1", "first", "r", {"service": "travel", "params": {"from": "Nairobi"}})
            await turn(c, app, "bk2", "second", "r")
            key = harness.dialog_key("back", "r", "params")
            redis.command("DEL", key)
            redis.command("HSET", key, "travel.from", json.dumps("Mombasa"))
            _, fwd = await turn(c, app, "bk3", "third", "r")
            check(fwd["params"].get("from") == "Mombasa", f"params written behind the gateway: {fwd['params']}")
        with step("the history list gone in Redis (it lapses first), the rev kept: the next turn has none"):
            redis.command("DEL", harness.dialog_key("back", "r", "history"))
            _, fwd = await turn(c, app, "bk4", "fourth", "r")
            check(fwd["history"] == [], f"the history should be gone: {harness.brief(fwd['history'], 400)}")
            _, fwd = await turn(c, app, "bk5", "fifth", "r")
            check(history_pairs(fwd["history"]) == [("user", "fourth"), ("assistant", state_reply_text("fourth"))],
                  f"then only the fourth turn: {fwd['history']}")
        with step("the dialog's hash gone in Redis (a lifetime shorter than the params'), the rev kept: "
                  "the next turn reads Redis's copy"):
            await turn(c, app, "bk6", "sixth", "r", {"service": "travel"})
            _, fwd = await turn(c, app, "bk7", "seventh", "r")
            check(fwd["service"] == "travel", f"the service should be kept: {fwd['service']}")
            redis.command("DEL", harness.dialog_key("back", "r", "dialog"))
            _, fwd = await turn(c, app, "bk8", "eighth", "r")
            check(fwd["service"] is None, f"the dialog's hash is gone, so is its service: {fwd['service']}")
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
    with step("the dialog's keys deleted during a turn: the save is sent again in full, the list holds "
              "the whole dialog"):
        await mid_turn(app, redis, rules, "mid", ("params", "dialog", "history"))
    with step("only the history list gone during a turn (lapsed, or evicted), the rev kept: the same"):
        await mid_turn(app, redis, rules, "midh", ("history",))
    with step("only the params hash gone during a turn (its rev with it): the same"):
        await mid_turn(app, redis, rules, "midp", ("params",))


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
            redis.command("HSET", harness.dialog_key(user, "r", "params"), "rev", "other-gw:1:00000000#1")
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


def ttls(redis, user, parts=("params", "dialog", "history")):
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
            for part in ("params", "dialog", "history"):
                redis.command("EXPIRE", harness.dialog_key("life", "r", part), "100")
            redis.command("EXPIRE", harness.rooms_key("life"), "100")
            await turn(c, app, "life3", "life 3", "r")  # the same params: an append, nothing made
            got = ttls(redis, "life")
            check(all(0 < t <= 100 for t in got.values()),
                  f"a save 30 s within the last renewal keeps the keys' lifetimes (set to 100 s): {got}")
            check(store_counts(gw)[1] == 2, f"the saves after the first appended: {store_counts(gw)}")
            await c.close()
    with step("keys gone during such a save are made with their lifetime (the dialog's hash), or not made "
              "(the rooms set: an appending save within the renewal adds nothing to it)"):
        async with harness.Gateway(args(rules), config(app, redis), name="gw-life-b") as gw:
            c = await connect(gw, "lifeb")
            for k in range(1, 3):
                await turn(c, app, f"lifeb{k}", f"lifeb {k}", "r")
            pending = asyncio.ensure_future(c.message("lifeb 3 [delay=1]", mid="lifeb3", room="r"))
            await app.wait_message("lifeb3")
            redis.command("DEL", harness.dialog_key("lifeb", "r", "dialog"), harness.rooms_key("lifeb"))
            (await pending).expect_done()
            ok = await harness.wait_until(lambda: redis.ttl(harness.dialog_key("lifeb", "r", "dialog")) > 0, 5)
            got = ttls(redis, "lifeb", ("dialog",))
            check(ok and 7100 <= got["dialog"] <= 7200 and got["rooms"] == -2,
                  f"the dialog's hash, made again by the save, should live 2 h, and the rooms set stay gone "
                  f"until a save renews the lifetimes: {got}")
            check(store_counts(gw)[1] == 2, f"the saves after the first appended: {store_counts(gw)}")
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
            for part in ("params", "dialog", "history"):
                redis.command("EXPIRE", harness.dialog_key("lifec", "r", part), "30")
            redis.command("DEL", harness.rooms_key("lifec"))
            await asyncio.sleep(2.1)  # the subject: the renewal of a lifetime over two seconds old
            await turn(c, app, "lifec3", "lifec 3", "r")
            got = ttls(redis, "lifec", ("params", "dialog", "history"))
            want = {"params": 120, "dialog": 120, "history": 60, "rooms": 120}
            check(all(want[p] - 5 <= t <= want[p] for p, t in got.items()),
                  f"renewed to their lifetimes {want}: {got}")
            rooms = redis.zrange(harness.rooms_key("lifec"))
            check(rooms == ["r"], f"the renewing save should put the room back in the rooms set: {rooms}")
            lock = harness.dialog_key("lifec", "r", "lock")
            check(await harness.wait_until(lambda: redis.get(lock) is None, 3),
                  f"the lock, let go, should be deleted: {redis.get(lock)!r}")
            check(store_counts(gw)[1] == 2, f"the saves after the first appended: {store_counts(gw)}")
            await c.close()


async def part_parts_deleted(app, redis, rules):
    with step("an awaiting state and soft context set, then cleared: Redis's keys go with them, "
              "and turns with neither delete nothing but the lock they let go; "
              "their loads, answered 'same', are three plain commands (SET NX, HGET, EXISTS: no script) and "
              "count nothing (no HLEN; no LLEN: an appending save checks the "
              "list's length by its RPUSH's answer; two HGETs of the rev: the load's, and the save's, which reads "
              "it under its own lease too, since a write-back or merge of another gateway holds none)"):
        async with harness.Gateway(args(rules), config(app, redis), name="gw-parts") as gw:
            c = await connect(gw, "parts")
            awaiting = {"type": "selection", "options": [{"name": "KQ100"}], "ttl": 60}
            await turn(c, app, "parts1", "parts 1", "r")
            for part, directive in (("awaiting", {"awaiting": awaiting}), ("soft", {"soft_context": {"a": 1}})):
                key = harness.dialog_key("parts", "r", part)
                await turn(c, app, f"parts-{part}-set", f"set {part}", "r", directive)
                check(redis.command("EXISTS", key) == 1, f"the {part} key after a turn that set it")
                await turn(c, app, f"parts-{part}-clear", f"clear {part}", "r",
                           {"awaiting" if part == "awaiting" else "soft_context": None})
                ok = await harness.wait_until(lambda: redis.command("EXISTS", key) == 0, 3)
                check(ok, f"the {part} key should be deleted by the save that cleared it")
            await turn(c, app, "parts-warm", "warm", "r")
            def calls():
                stats = redis.info_commandstats()
                return {cmd: stats.get(cmd, {}).get("calls", 0)
                        for cmd in ("del", "hlen", "llen", "hget", "rpush", "exists", "incr", "get", "set",
                                    "evalsha", "eval", "zadd")}
            cached, before = store_counts(gw)[0], calls()
            for k in range(5):
                await turn(c, app, f"parts-n{k}", f"plain {k}", "r")
            # the last save lands after its done: wait for it (a loaded machine may take a while)
            await harness.wait_until(lambda: calls()["rpush"] - before["rpush"] >= 5, 5)
            await asyncio.sleep(0.2)  # anything more would have come by now
            made = {cmd: n - before[cmd] for cmd, n in calls().items()}
            check(made["del"] == 5, f"5 turns with neither should delete nothing but the lock each lets go (a cancel "
                                    f"flag names its lease, and none is deleted), made {made['del']}")
            # a load: SET NX of the lock, HGET of the rev, EXISTS of the parts, as plain commands (no
            # script: one EVALSHA a turn, the save's); a save: GET of the lock, DEL to let it go
            check(made["evalsha"] == 5 and made["eval"] == 0,
                  f"5 turns should run 5 scripts (the saves; a load that finds the lock free is no script): {made}")
            check(made["get"] == 5 and made["set"] == 5 and made["incr"] == 0 and made["exists"] == 5,
                  f"5 turns should SET the lock once (the load's NX) and GET it once (the save's), with no INCR "
                  f"and one EXISTS a load (the dialog's, not the line's): {made}")
            check(made["hget"] == 10, f"5 turns should read the rev 10 times (the loads' and the saves': a save "
                                      f"under its own lease reads it too), read it {made['hget']} times")
            check(store_counts(gw)[0] - cached == 5, f"the 5 loads were answered 'same': {store_counts(gw)}")
            check(made["hlen"] == 0 and made["llen"] == 0 and made["rpush"] == 5,
                  f"5 loads answered 'same' should count nothing in Redis (no HLEN), and their 5 appending "
                  f"saves check the list's length by their RPUSH's answer (5 RPUSHes, no LLEN): {made}")
            check(made["zadd"] == 0, f"5 appending saves within the lifetimes' renewal should leave the rooms set "
                                     f"as it is (its room's score is renewed with the lifetimes): {made}")
            check(store_counts(gw)[1] >= 7, f"those saves appended: {store_counts(gw)}")
            await c.close()


async def read_by_new_gateway(app, redis, rules, name, mid, everything):
    """One turn of dialog unread/r through a gateway with no copy (it reads Redis's in full):
    (forwarded frame, the gateway's warnings of parts left out); everything grows by the turn."""
    async with harness.Gateway(args(rules), config(app, redis), name=name) as gw:
        c = await connect(gw, "unread")
        t, fwd = await turn(c, app, mid, mid, "r")
        everything += [("user", mid), ("assistant", t.terminal["text"])]
        await c.close()
        # the save lands after the done: the gateway's stop waits for it
    return fwd, [line for line in gw.log_text().splitlines() if "chatgate does not write" in line]


async def part_unreadable(app, redis, rules):
    params, history = harness.dialog_key("unread", "r", "params"), harness.dialog_key("unread", "r", "history")
    everything = []
    with step("params fields in Redis that chatgate does not write (a value not JSON, a name with no "
              "service), read by a gateway with no copy: the rest is read, one warning names the first, "
              "and the turn's save rewrites the params without them"):
        async with harness.Gateway(args(rules), config(app, redis), name="gw-unread-a") as gw:
            c = await connect(gw, "unread")
            for mid, state in (("un1", {"service": "travel", "params": {"from": "Nairobi"}}), ("un2", None)):
                t, _ = await turn(c, app, mid, mid, "r", state)
                everything += [("user", mid), ("assistant", t.terminal["text"])]
            await c.close()
        redis.command("HSET", params, "travel.bad", "{not json", "nodot", json.dumps("x"))
        fwd, warnings = await read_by_new_gateway(app, redis, rules, "gw-unread-b", "un3", everything)
        check(fwd["params"].get("from") == "Nairobi" and "bad" not in fwd["params"],
              f"the readable params only (and the service's defaults): {fwd['params']}")
        got = redis.hgetall(params)
        check("travel.bad" not in got and "nodot" not in got and json.loads(got.get("travel.from", "null")) == "Nairobi"
              and "rev" in got, f"the save should rewrite the params hash without what was left out: {got}")
        check(len(warnings) == 1 and "2 part(s)" in warnings[0] and "'travel.bad'" in warnings[0],
              f"one warning naming the first of the 2 params fields left out: {warnings}")
    with step("a history message in Redis that is not a JSON object, read by a gateway with no copy: the "
              "rest is forwarded, and the turn's save rewrites the list without it"):
        redis.command("LINSERT", history, "BEFORE", redis.lrange(history)[1], "garbage")
        expected = list(everything)
        fwd, warnings = await read_by_new_gateway(app, redis, rules, "gw-unread-c", "un4", everything)
        check(history_pairs(fwd["history"]) == expected,
              f"the readable history only: {harness.brief(fwd['history'], 600)}")
        check(redis_history(redis, "unread", "r") == everything,
              f"the save should rewrite the list without the garbage: {redis.lrange(history)}")
        check(len(warnings) == 1 and "history message" in warnings[0],
              f"one warning naming the history message left out: {warnings}")


async def part_rewrite_over(app, redis, rules):
    params, history = harness.dialog_key("over", "r", "params"), harness.dialog_key("over", "r", "history")
    with step("a turn whose save rewrites the dialog (its load left a params field out, so the gateway's copy "
              "has no rev) while another gateway's lease-less write lands during it: the rewrite finds "
              "another rev than its load read and merges; Redis keeps the other's message and the turn's"):
        async with harness.Gateway(args(rules), config(app, redis), name="gw-over-a") as gw:
            c = await connect(gw, "over")
            await turn(c, app, "ov1", "ov1", "r", {"service": "travel", "params": {"from": "Nairobi"}})
            await c.close()
        redis.command("HSET", params, "travel.bad", "{not json")
        async with harness.Gateway(args(rules), config(app, redis), name="gw-over-b") as gw:
            c = await connect(gw, "over")
            pending = asyncio.ensure_future(c.message("ov2 [delay=1]", mid="ov2", room="r"))
            await app.wait_message("ov2")
            other = dict(json.loads(redis.lrange(history)[-1]), role="user", content="from the other gateway")
            redis.command("RPUSH", history, json.dumps(other))
            redis.command("HSET", params, "rev", "other-gw:1:00000000#1")
            (await pending).expect_done()
            # the gateway stops at once: the save's merge runs while the store drains (before,
            # the closing link refused its commands, and the turn was lost at exit)
            await c.close()
        said = [content for role, content in redis_history(redis, "over", "r") if role == "user"]
        check(said == ["ov1", "from the other gateway", "ov2 [delay=1]"],
              f"Redis should keep the other gateway's message and the turn's: {said}")
        got = redis.hgetall(params)
        check("travel.bad" not in got and json.loads(got.get("travel.from", "null")) == "Nairobi",
              f"the merge's params, without the field left out: {got}")


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
    finally:
        redis.cleanup(keep=True)


if __name__ == "__main__":
    harness.run(main, timeout=100)
