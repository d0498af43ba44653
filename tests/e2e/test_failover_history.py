"""End-to-end test: a failover loses no answered turn, and turns across gateways wait in order
(issue 36, items 5 and 6; docs/state.md, "The dialog lease" and "When Redis fails").

Real processes on free ports: redis-server (a primary and a replica), three redis-sentinel,
two gateways on the one store.
1. Waiters in order. One tab on gateway A sends back to back, another tab of the same dialog
   on gateway B sends once while A's first turn runs: B's turn goes next (it took a place in
   the dialog's line of waiters), before A's second, so it waits no longer than the turn
   ahead of it. Before the line, A's next turn took the lease the moment A's save freed it,
   and B's poll lost every race: it waited for all of A's turns. And B's turn starts (its
   ack) within 60 ms of A's first done: A, asked on the bus, wakes B when its save has let
   the lease go (chatgate_store_lease_wakes_total); B's polls alone, 25 ms doubling to 250,
   left it idle 100 ms or more.
2. A Sentinel failover under traffic: 10 dialogs, each with a tab on each gateway sending
   back to back; the primary is killed (SIGKILL) mid-traffic and the replica promoted. Every
   message gets exactly one terminal frame, each done; afterwards every answered turn is in
   its dialog's history on the new primary exactly once, in order of time (0 missing: what
   the old primary took and never replicated, each gateway holds in memory and writes back;
   two copies of one dialog, written by the two gateways while the store switched, merge);
   the merges are counted (chatgate_store_merges_total).
"""
import asyncio
import time

import harness
from harness import Client, check, independent, step
from test_sentinel import MASTER, Replica, metrics, start_sentinels, wait_for

TABS_DIALOGS = 10


def header_args(rules):
    return ["--rules", rules, "--auth", "header", "--user-header", "X-User-Id"]


async def connect_as(gw, user):
    return await Client.connect(gw, expect_user=user, extra_headers={"X-User-Id": user})


def history_of(redis, user, room):
    """The dialog's history as `redis` holds it: [message, ...], oldest first."""
    key = redis.find_key(harness.dialog_key(user, room, "history"))
    return [harness.json.loads(m) for m in redis.lrange(key)] if key else []


async def lease_order(rules):
    redis = await harness.RedisServer().astart()
    try:
        # each reply takes about 0.4 s: 20 chunks 20 ms apart
        config = harness.state_config({"demo": harness.demo_upstream(delay_ms=20)}, "demo", store=redis.url,
                                      history_n=200)
        async with harness.Gateway(header_args(rules), config, name="gateway-a") as ga, \
                harness.Gateway(header_args(rules), config, name="gateway-b") as gb:
            with step("a tab on gateway B sends while A's tab sends back to back: B's turn goes next, "
                      "before A's second"):
                a, b = await connect_as(ga, "orderly"), await connect_as(gb, "orderly")
                done_at = {}
                a_started = asyncio.Event()

                async def tab_a():
                    for n in range(5):
                        if n == 0:
                            asyncio.get_running_loop().call_later(0.15, a_started.set)
                        t = await a.message(f"a{n} " + "word " * 20, mid=f"a{n}", room="r", timeout=20)
                        check(t.kind == "done", f"a{n}: {harness.brief(t.terminal)}")
                        done_at[f"a{n}"] = time.monotonic()

                async def tab_b():
                    await a_started.wait()  # A's first turn runs (its reply takes about 0.4 s)
                    sent = time.monotonic()
                    await b.send({"type": "message", "id": "b0", "text": "b0 " + "word " * 20, "room": "r"})
                    await b.next_matching(lambda f: f.get("type") == "ack" and f.get("id") == "b0", 20,
                                          "b0's ack (its dialog loaded, the lease taken)")
                    done_at["b0 acked"] = time.monotonic()
                    t = await b.collect_turn("b0", 20)
                    check(t.kind == "done", f"b0: {harness.brief(t.terminal)}")
                    done_at["b0"] = time.monotonic()
                    done_at["b0 sent"] = sent

                await asyncio.gather(tab_a(), tab_b())
                order = sorted((k for k in done_at if k not in ("b0 sent", "b0 acked")), key=done_at.get)
                waited = done_at["b0"] - done_at["b0 sent"]
                a0 = done_at["a0"] - done_at["b0 sent"]
                print(f"   order of done: {order}; B's turn took {waited:.2f} s (A's first ended {a0:.2f} s "
                      f"after B sent)")
                check(order.index("b0") < order.index("a1"),
                      f"B's turn should come right after A's first: done in the order {order}")
                m = await metrics(gb)
                check(m.value("chatgate_store_lease_waits_total") >= 1, "B never waited for the lease")
                idle = done_at["b0 acked"] - done_at["a0"]
                print(f"   B's turn began {idle * 1000:.0f} ms after A's first done")
                check(m.value("chatgate_store_lease_wakes_total") >= 1, "B was never woken by A's release")
                check(idle < 0.06, f"B's turn began {idle * 1000:.0f} ms after A's first done (at most 60 ms)")
                said = [h["content"].split()[0] for h in history_of(redis, "orderly", "r") if h["role"] == "user"]
                check(said[:2] == ["a0", "b0"] and sorted(said) == ["a0", "a1", "a2", "a3", "a4", "b0"],
                      f"the history should hold every turn once, b0 second: {said}")
                await a.close()
                await b.close()
    finally:
        redis.cleanup(keep=True)


async def sentinel_failover(rules):
    primary = await harness.RedisServer().astart()
    replica = Replica(primary)
    sentinels = []
    try:
        await start_sentinels(primary, replica, sentinels)
        url = "redis-sentinel://" + ",".join(f"127.0.0.1:{s.port}" for s in sentinels) + f"/{MASTER}"
        config = harness.state_config({"demo": harness.demo_upstream(delay_ms=2)}, "demo", store=url,
                                      history_n=200)
        async with harness.Gateway(header_args(rules), config, name="gateway-1") as g1, \
                harness.Gateway(header_args(rules), config, name="gateway-2") as g2:
            with step(f"{TABS_DIALOGS} dialogs, a tab on each gateway sending back to back; the primary is "
                      "killed (SIGKILL) mid-traffic: every message answered once, with done"):
                stop = asyncio.Event()
                answered = {}  # (user, text) -> times answered with done
                problems = []

                async def tab(gw, user, tag):
                    c = await connect_as(gw, user)
                    n = 0
                    while not stop.is_set():
                        n += 1
                        text = f"{tag}{n}"
                        t = await c.message(text, mid=text, room="r", timeout=30)
                        if t.kind != "done":
                            problems.append(f"{user} {text}: {harness.brief(t.terminal)}")
                        else:
                            answered[(user, text)] = answered.get((user, text), 0) + 1
                        await asyncio.sleep(0.05)  # the tabs' pace
                    await c.close()

                users = [f"fo{u}" for u in range(TABS_DIALOGS)]
                tasks = [asyncio.create_task(tab(gw, u, tag)) for u in users for gw, tag in ((g1, "one-"), (g2, "two-"))]
                await asyncio.sleep(1.5)  # the scenario: traffic for a while before the kill
                before = len(answered)
                primary.kill()
                killed = time.monotonic()
                await wait_for("the replica promoted", lambda: harness.RedisServer.command(
                    replica, "ROLE", timeout=1.0)[0] == "master", 20)
                promoted = time.monotonic() - killed
                await asyncio.sleep(2.5)  # the scenario: traffic for a while on the promoted replica
                stop.set()
                await asyncio.gather(*tasks)
                check(not problems, f"{len(problems)} messages not answered with done: {problems[:5]}")
                dup = {k: v for k, v in answered.items() if v != 1}
                check(not dup, f"messages answered more than once: {dup}")
                print(f"   {len(answered)} turns answered ({before} before the kill); the replica was promoted "
                      f"{promoted:.1f} s after it")

            with step("afterwards every answered turn is in its dialog's history on the new primary, once, "
                      "whole and in each tab's order; the merges are counted"):
                async def settled():
                    for gw in (g1, g2):
                        m = await metrics(gw)
                        if m.value("chatgate_store_degraded") != 0 or m.value("chatgate_store_writeback_pending") != 0:
                            return False
                    return True

                deadline = time.monotonic() + 20
                while not await settled():
                    check(time.monotonic() < deadline, "the gateways did not settle (degraded, or write-backs pending)")
                    await asyncio.sleep(0.1)
                missing, twice, unordered = [], [], []
                for u in users:
                    hist = history_of(replica, u, "r")
                    said = [h["content"] for h in hist if h["role"] == "user"]
                    # each tab's turns in the order it sent them, each whole (its answer next)
                    for tag in ("one-", "two-"):
                        mine = [int(t[len(tag):]) for t in said if t.startswith(tag)]
                        if mine != sorted(mine):
                            unordered.append(f"{u} {tag}: {mine}")
                    for k, h in enumerate(hist):
                        if h["role"] == "user" and (k + 1 == len(hist) or hist[k + 1]["role"] != "assistant"):
                            unordered.append(f"{u}: {h['content']} has no answer after it")
                    for (user, text), _ in answered.items():
                        if user != u:
                            continue
                        k = said.count(text)
                        if k == 0:
                            missing.append(f"{user} {text}")
                        elif k > 1:
                            twice.append(f"{user} {text}")
                ms = [await metrics(gw) for gw in (g1, g2)]
                merges = sum(m.value("chatgate_store_merges_total") for m in ms)
                merged = sum(m.value("chatgate_store_merged_messages_total") for m in ms)
                degraded = max(m.value("chatgate_store_degraded_seconds_total") for m in ms)
                print(f"   missing from history {len(missing)} of {len(answered)}, twice {len(twice)}; merges "
                      f"{merges:.0f} ({merged:.0f} messages); degraded {degraded:.2f} s at most")
                if missing:
                    u0 = missing[0].split()[0]
                    print(f"   the user messages in {u0}'s history:",
                          [h["content"] for h in history_of(replica, u0, "r") if h["role"] == "user"])
                check(not missing, f"{len(missing)} answered turns missing from history: {missing[:8]}")
                check(not twice, f"turns in history twice: {twice[:8]}")
                check(not unordered, f"histories out of order: {unordered[:5]}")
    finally:
        for s in sentinels:
            s.cleanup(keep=True)
        replica.cleanup(keep=True)
        primary.cleanup(keep=True)


async def main(args):
    rules = harness.empty_rules_dir()
    await independent(lease_order(rules))
    await independent(sentinel_failover(rules))


if __name__ == "__main__":
    harness.run(main, timeout=120)
