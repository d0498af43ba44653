"""End-to-end test of the write-back at shutdown (docs/state.md, When Redis fails): a
dialog marked for the write-back is written to Redis before the gateway exits, when Redis
is there to take it. Its turns were answered; until the shutdown write-back they were
dropped with a warning ("stopping with N dialogs not yet written back") when SIGTERM came
first (parts 1 and 2 fail on that binary: every dialog lacks its last turns). Parts 4 and 5
fail on a1060c0, the first shutdown write-back: it counted a Redis in the reconnect backoff
as away, and decided what to wait for before the saves in flight were answered.

1. An outage, then SIGTERM as soon as Redis is back: Redis is LATENCY s away (harness.RedisFront, a
   relay in the test that passes Redis's answers on that late), so that a write-back (two
   round trips) and the newer version behind it take longer than the link's second at
   close. DIALOGS dialogs (a connection and a room each, the state app) talk once with Redis
   up; Redis is killed (SIGKILL) and each talks twice more, served from memory and marked
   for the write-back; Redis is started again on its port (empty). The moment the gateway's
   log says it reconnected (the write-backs in flight), each dialog talks once more (a newer
   version, waiting behind the one in flight), then the gateway gets SIGTERM. It exits 0,
   and every dialog's history in Redis holds all four turns.
2. Marked while Redis is up, then SIGTERM: Redis refuses writes (min-replicas-to-write 1 and
   no replica: -NOREPLICAS, as when a primary's replicas lag) while DIALOGS dialogs talk, so
   each save is kept in memory and marked, and the store's tick sends them again once a
   second (each refused, counted in chatgate_store_writeback_failures_total). Right after
   one such round Redis takes writes again and the gateway gets SIGTERM, well before the
   tick's next round: the shutdown itself must send them. Every dialog's history in Redis
   holds its turn.
3. Redis away at shutdown: nothing waits for it (the gateway exits within the drain), and
   the log says how many dialogs, and profile updates (each turn carries one), were not
   written back.
4. SIGTERM while the gateway waits out its reconnect backoff, Redis back already (a deploy
   right after a Redis restart): DIALOGS dialogs talk once, Redis is killed, each talks twice
   more (marked); the test waits for the link's fifth try since the outage (counted at a
   relay in front of Redis: the next waits 5 s, redis_link.c), starts Redis again and sends
   SIGTERM before the gateway reconnected (no new connection at the relay). Until the
   shutdown connect, the close saw Redis away and dropped every dialog (all of them lacked
   their turns). Every dialog's history in Redis holds its three turns.
5. A turn's save in flight at shutdown, then refused: Redis is SAVE_LATENCY s away; DIALOGS
   dialogs talk once, then Redis refuses writes (-NOREPLICAS) and each talks again (its
   lease and its save refused); SIGTERM as soon as every client has its answer (each save
   on its way, its refusal SAVE_LATENCY s away), and Redis takes writes again 0.2 s later.
   Until the close waited for the saves in flight, nothing was marked when it decided, and
   the refusals marked the dialogs after it: every dialog lost its second turn. Every
   dialog's history in Redis holds both turns.
6. Profile updates made in an outage, SIGTERM in the reconnect backoff, Redis back (part 4's
   shape; docs/state.md, The user's profile): PROFILES users' profiles are changed while
   Redis is away, kept in the gateway's copy and waiting for the write-back; Redis is started
   again (empty) and SIGTERM comes before the gateway reconnected. a: by the state app's
   directives on turns (the dialogs are marked too: the close connects for them); b: through
   the admin API only (nothing else for the close to wait for). Until the close waited for
   the profiles, every update was lost (a: the link's coming up at close skipped them; b: the
   close saw nothing to do). Every user's profile hash in Redis holds the update.
"""

import asyncio
import json
import re
import signal
import time
import urllib.parse

import harness
from harness import Client, check, check_turn_done, independent, step

DIALOGS = 120
PROFILES = 40
ADMIN_TOKEN = "shutdown-admin-token"
AWAY_DIALOGS = 10
LATENCY = 0.5  # s: each answer of Redis's, in part 1 (harness.RedisFront's delay)
SAVE_LATENCY = 0.7  # s: in part 5, longer than the drain's 0.3 s, so every save is in flight at close
BACKOFF_TRIES = 5  # redis_link.c's tries after an outage's first 0.1+0.2+0.5+1+2 s: the next waits 5 s
EXIT_TIMEOUT = 10.0  # the drain (nothing in flight: 0.3 s) and the store's close (at most 5 s)


async def metrics(gw):
    status, _, body = await asyncio.to_thread(harness.http_get, gw.http_url + "/metrics", 3.0)
    check(status == 200, f"/metrics: HTTP {status}")
    return harness.parse_metrics(body.decode())


async def wait_metric(gw, name, predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while True:
        m = await metrics(gw)
        value = m.value(name) if m.has(name) else None
        if value is not None and predicate(value):
            return value
        if time.monotonic() > deadline:
            gw.failed = True
            harness.fail(f"{what}: {name} is {value} after {timeout:.0f} s")
        await asyncio.sleep(0.05)


async def wait_log(gw, pattern, count, timeout, what):
    """Wait until the gateway's log holds `count` lines matching `pattern` (polled every 5 ms:
    the test acts on the moment it appears)."""
    deadline = time.monotonic() + timeout
    regex = re.compile(pattern, re.MULTILINE)
    while len(regex.findall(gw.log_text())) < count:
        if time.monotonic() > deadline:
            gw.failed = True
            harness.fail(f"{what}: the log did not say /{pattern}/ {count} times within {timeout:.0f} s")
        await asyncio.sleep(0.005)


async def say(client, app, room, mid, text, directive=None):
    if directive is not None:
        app.directives[mid] = directive
    turn = await client.message(text, mid=mid, room=room, timeout=10)
    check_turn_done(turn)
    return turn


async def stop_in_backoff(gw, redis, relay, clients, killed):
    """Redis started again (empty) while the gateway's link waits out its backoff, and
    SIGTERM before it reconnected (checked: no connection at the relay, one "connected" in the
    log); waits for the exit."""
    tries = relay.accepted
    await redis.astart()
    for c in clients:
        await c.close()
    check(relay.accepted == tries and len(re.findall(r"redis \S+: connected", gw.log_text())) == 1,
          "the gateway reconnected before SIGTERM: the test came too late")
    print(f"   SIGTERM {time.monotonic() - killed:.2f}s after the kill, the link still in its backoff")
    took = await stop_now(gw)
    print(f"   exited {took:.2f}s after SIGTERM; {relay.accepted - tries} connection(s) at shutdown")


async def gateway_behind(app, rules, link, latency, name):
    """A gateway started on Redis behind link, latency s away (its commands' timeout four
    round trips), for DIALOGS clients."""
    gw = harness.Gateway(["--rules", rules, "--max-connections", 1000],
                         config_for(app, link, command_timeout_ms=int(latency * 1000) * 4), name=name)
    await gw.astart()
    return gw


async def open_dialogs(app, gw, room, mid):
    """DIALOGS clients of gw, a dialog each (rooms "<room><i>"): the clients, the dialogs as
    (user, room, the texts said), and talk(i, k), which sends dialog i's message k (its params
    {"k": k}) and notes its text once answered."""
    clients = await asyncio.gather(*(Client.connect(gw) for _ in range(DIALOGS)))
    dialogs = [(c.hello["user"], f"{room}{i}", []) for i, c in enumerate(clients)]

    async def talk(i, k):
        user, room_i, texts = dialogs[i]
        text = f"message {k} of dialog {i}"
        await say(clients[i], app, room_i, f"{mid}{i}-{k}", text, {"service": "travel", "params": {"k": k}})
        texts.append(text)
    return clients, dialogs, talk


async def all_of(coros):
    results = await asyncio.gather(*coros, return_exceptions=True)
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        harness.fail(f"{len(failed)} of {len(results)} dialogs failed; the first: {type(failed[0]).__name__}: "
                     f"{failed[0]}")


def said_in_redis(redis, user, room):
    """The user's messages of the dialog's history in Redis, in order."""
    key = harness.dialog_key(user, room, "history")
    return [m["content"] for m in (json.loads(x) for x in redis.lrange(key)) if m.get("role") == "user"]


def check_all_written(redis, dialogs, gw, what):
    """Every dialog (user, room, [its texts]) holds its texts in Redis's history, in order."""
    missing = []
    for user, room, texts in dialogs:
        got = said_in_redis(redis, user, room)
        if got != texts:
            missing.append((room, got, texts))
    left = re.findall(r"stopping with (\d+) dialogs not yet written back|(\d+) dialogs not written back are lost",
                      gw.log_text())
    print(f"   {len(dialogs) - len(missing)} of {len(dialogs)} dialogs whole in Redis after the exit; "
          f"the log's count of dialogs left: {[a or b for a, b in left] or 'none'}")
    if missing:
        gw.failed = True
        room, got, want = missing[0]
        harness.fail(f"{what}: {len(missing)} of {len(dialogs)} dialogs lack turns in Redis after the gateway "
                     f"exited (their clients were answered); e.g. room {room}: Redis holds {got}, expected {want}")


async def stop_now(gw):
    gw.send_signal(signal.SIGTERM)
    started = time.monotonic()
    code = await gw.await_exit(EXIT_TIMEOUT)
    took = time.monotonic() - started
    check(code == 0, f"the gateway should exit 0 after SIGTERM within {EXIT_TIMEOUT:.0f} s, got {code}")
    return took


def config_for(app, redis, command_timeout_ms=1000):
    return harness.state_config({"app": harness.app_upstream(app, "/state")}, "app", store=redis.url,
                                redis={"command_timeout_ms": command_timeout_ms, "connect_timeout_ms": 1000})


async def part_after_outage(app, rules):
    redis = await harness.RedisServer().astart()
    link = await harness.RedisFront(redis.port, LATENCY).start()
    try:
        gw = await gateway_behind(app, rules, link, LATENCY, "gateway-outage")
        clients, dialogs, talk = await open_dialogs(app, gw, "r", "d")

        with step(f"1. Redis {LATENCY:.1f} s away: {DIALOGS} dialogs talk once; Redis is killed, and each talks "
                  "twice more (served from memory, marked for the write-back)"):
            await wait_log(gw, r"redis \S+: connected", 1, 5, "the first connection")
            await all_of(talk(i, 1) for i in range(DIALOGS))
            redis.kill()
            await wait_metric(gw, "chatgate_store_degraded", lambda v: v == 1, 5, "the outage")
            for k in (2, 3):
                await all_of(talk(i, k) for i in range(DIALOGS))
            pending = await wait_metric(gw, "chatgate_store_writeback_pending", lambda v: v == DIALOGS, 3,
                                        "the outage's dialogs marked for the write-back")
            print(f"   {pending:.0f} dialogs marked for the write-back")

        with step("1b. Redis back: the moment the gateway reconnects (its write-backs in flight) each dialog talks "
                  "once more (a newer version behind the one in flight), then SIGTERM: the gateway exits 0 and "
                  "every dialog's turns are in Redis"):
            await redis.astart()
            await wait_log(gw, r"redis \S+: connected", 2, 10, "the reconnect")
            reconnected = time.monotonic()
            await all_of(talk(i, 4) for i in range(DIALOGS))
            for c in clients:
                await c.close()
            print(f"   SIGTERM {time.monotonic() - reconnected:.2f}s after the reconnect")
            took = await stop_now(gw)
            print(f"   exited {took:.2f}s after SIGTERM")
            check_all_written(redis, dialogs, gw, "SIGTERM right after the reconnect")
    finally:
        await link.close()
        redis.cleanup(keep=True)


async def part_refused_while_up(app, rules):
    redis = await harness.RedisServer().astart()
    try:
        gw = harness.Gateway(["--rules", rules, "--max-connections", 1000], config_for(app, redis),
                             name="gateway-refused")
        await gw.astart()
        clients = await asyncio.gather(*(Client.connect(gw) for _ in range(DIALOGS)))
        dialogs = [(c.hello["user"], f"o{i}", [f"the only message of dialog {i}"]) for i, c in enumerate(clients)]

        with step(f"2. Redis refuses writes (-NOREPLICAS) while {DIALOGS} dialogs talk: each save is kept in memory, "
                  "marked, and sent again by the tick, refused"):
            await wait_log(gw, r"redis \S+: connected", 1, 5, "the first connection")
            redis.command("CONFIG", "SET", "min-replicas-to-write", "1")
            await all_of(say(clients[i], app, room, f"o{i}", texts[0], {"service": "travel", "params": {"i": i}})
                         for i, (_, room, texts) in enumerate(dialogs))
            await wait_metric(gw, "chatgate_store_writeback_pending", lambda v: v == DIALOGS, 3,
                              "the refused saves marked for the write-back")
            before = (await metrics(gw)).value("chatgate_store_writeback_failures_total")
            await wait_metric(gw, "chatgate_store_writeback_failures_total", lambda v: v >= before + DIALOGS, 5,
                              "a round of the tick's write-backs, refused")
            round_at = time.monotonic()

        with step("2b. Redis takes writes again; SIGTERM at once (before the tick's next round): it exits 0, "
                  "and every dialog's turn is in Redis"):
            redis.command("CONFIG", "SET", "min-replicas-to-write", "0")
            for c in clients:
                await c.close()
            print(f"   SIGTERM {time.monotonic() - round_at:.2f}s after the tick's refused round")
            took = await stop_now(gw)
            print(f"   exited {took:.2f}s after SIGTERM")
            check_all_written(redis, dialogs, gw, "SIGTERM with write-backs waiting for the tick")
    finally:
        redis.cleanup(keep=True)


async def part_away_at_shutdown(app, rules):
    redis = await harness.RedisServer().astart()
    try:
        gw = harness.Gateway(["--rules", rules], config_for(app, redis), name="gateway-away")
        await gw.astart()
        clients = await asyncio.gather(*(Client.connect(gw) for _ in range(AWAY_DIALOGS)))
        with step(f"3. Redis away at shutdown: {AWAY_DIALOGS} dialogs marked in an outage; SIGTERM: the gateway "
                  "exits 0 without waiting for Redis, and says how many dialogs and profile updates were not "
                  "written back"):
            await wait_log(gw, r"redis \S+: connected", 1, 5, "the first connection")
            redis.kill()
            await wait_metric(gw, "chatgate_store_degraded", lambda v: v == 1, 5, "the outage")
            await all_of(say(c, app, f"a{i}", f"a{i}", f"message of dialog {i} in the outage",
                             {"profile": {"home_city": f"city {i}"}}) for i, c in enumerate(clients))
            for c in clients:
                await c.close()
            took = await stop_now(gw)
            print(f"   exited {took:.2f}s after SIGTERM")
            check(took < 1.5, f"with Redis away the gateway should not wait for it at shutdown: {took:.2f}s")
            check(f"stopping with {AWAY_DIALOGS} dialogs not yet written back" in gw.log_text(),
                  "the log should say how many dialogs were not written back")
            check(f"stopping with {AWAY_DIALOGS} profile update(s) not yet written back" in gw.log_text(),
                  "the log should say how many profile updates were not written back")
    finally:
        redis.cleanup(keep=True)


async def wait_until(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            harness.fail(f"{what}: not within {timeout:.0f} s")
        await asyncio.sleep(0.01)


async def part_in_backoff(app, rules):
    redis = await harness.RedisServer().astart()
    relay = await harness.RedisFront(redis.port).start()  # no delay: it counts the link's tries
    try:
        # the bus straight to Redis: only the link's connections go through the relay
        cfg = config_for(app, relay)
        cfg["redis"]["bus"] = redis.url
        gw = harness.Gateway(["--rules", rules, "--max-connections", 1000], cfg, name="gateway-backoff")
        await gw.astart()
        clients, dialogs, talk = await open_dialogs(app, gw, "b", "b")

        with step(f"4. {DIALOGS} dialogs talk once; Redis is killed, and each talks twice more (marked); the link "
                  f"tries {BACKOFF_TRIES} times (its next try 5 s on)"):
            await wait_log(gw, r"redis \S+: connected", 1, 5, "the first connection")
            await all_of(talk(i, 1) for i in range(DIALOGS))
            before = relay.accepted
            killed = time.monotonic()
            redis.kill()
            await wait_metric(gw, "chatgate_store_degraded", lambda v: v == 1, 5, "the outage")
            for k in (2, 3):
                await all_of(talk(i, k) for i in range(DIALOGS))
            await wait_metric(gw, "chatgate_store_writeback_pending", lambda v: v == DIALOGS, 3,
                              "the outage's dialogs marked for the write-back")
            await wait_until(lambda: relay.accepted >= before + BACKOFF_TRIES, 10, "the link's tries")
            print(f"   the link's try {relay.accepted - before} came {time.monotonic() - killed:.2f}s after "
                  "the kill")

        with step("4b. Redis started again (empty); SIGTERM before the gateway reconnected: it exits 0, and every "
                  "dialog's turns are in Redis"):
            await stop_in_backoff(gw, redis, relay, clients, killed)
            check_all_written(redis, dialogs, gw, "SIGTERM in the reconnect backoff, Redis back")
    finally:
        await relay.close()
        redis.cleanup(keep=True)


def noreplicas_refusals(redis):
    info = redis.command("INFO", "errorstats")
    text = info.decode() if isinstance(info, bytes) else str(info)
    found = re.search(r"errorstat_NOREPLICAS:count=(\d+)", text)
    return int(found.group(1)) if found else 0


async def part_save_refused_at_close(app, rules):
    redis = await harness.RedisServer().astart()
    link = await harness.RedisFront(redis.port, SAVE_LATENCY).start()
    try:
        gw = await gateway_behind(app, rules, link, SAVE_LATENCY, "gateway-in-flight")
        clients, dialogs, talk = await open_dialogs(app, gw, "s", "s")

        with step(f"5. Redis {SAVE_LATENCY:.1f} s away: {DIALOGS} dialogs talk once (Redis has the scripts then: "
                  "no NOSCRIPT round later), then Redis refuses writes (-NOREPLICAS) and each talks again; SIGTERM "
                  "as soon as every client has its answer (every save in flight), and Redis takes writes again "
                  "0.2 s later: the gateway exits 0, and every dialog's turns are in Redis"):
            await wait_log(gw, r"redis \S+: connected", 1, 5, "the first connection")
            await all_of(talk(i, 1) for i in range(DIALOGS))
            await wait_until(lambda: all(said_in_redis(redis, u, r) == t for u, r, t in dialogs), 10,
                             "the first turns' saves")
            redis.command("CONFIG", "SET", "min-replicas-to-write", "1")
            await all_of(talk(i, 2) for i in range(DIALOGS))
            answered = time.monotonic()
            pending = (await metrics(gw)).value("chatgate_store_writeback_pending")
            for c in clients:
                await c.close()
            print(f"   SIGTERM {time.monotonic() - answered:.2f}s after the last answer; {pending:.0f} dialogs marked "
                  "then (their saves' refusals not back yet)")
            gw.send_signal(signal.SIGTERM)
            started = time.monotonic()
            await asyncio.sleep(0.2)
            refused = noreplicas_refusals(redis)
            redis.command("CONFIG", "SET", "min-replicas-to-write", "0")
            code = await gw.await_exit(EXIT_TIMEOUT)
            took = time.monotonic() - started
            check(code == 0, f"the gateway should exit 0 after SIGTERM within {EXIT_TIMEOUT:.0f} s, got {code}")
            print(f"   exited {took:.2f}s after SIGTERM; Redis had refused {refused} writes")
            check(refused >= 2 * DIALOGS, f"Redis should have refused each second turn's lease and save "
                                          f"({2 * DIALOGS} writes) before it took writes again: {refused}")
            check_all_written(redis, dialogs, gw, "SIGTERM with saves in flight, refused")
    finally:
        await link.close()
        redis.cleanup(keep=True)


def profile_in_redis(redis, user):
    return redis.hgetall("chatgate:{" + harness.escape_id(user) + "}:profile")


async def admin_put_profile(gw, user, name, value):
    url = (f"{gw.http_url}/admin/users/{urllib.parse.quote(user, safe='')}/profile/{name}?value="
           + urllib.parse.quote(json.dumps(value), safe=""))
    status, _, body = await asyncio.to_thread(harness.http_request, url, "PUT",
                                              {"Authorization": f"Bearer {ADMIN_TOKEN}"}, None)
    # Redis away: 503, the gateway's copy answered (and holds the change for the write-back)
    check(status == 503 and b"copy answered" in body, f"admin PUT in the outage: {status} {body[:200]!r}")


async def part_profiles_in_backoff(app, rules, via):
    redis = await harness.RedisServer().astart()
    relay = await harness.RedisFront(redis.port).start()  # no delay: it counts the link's tries
    try:
        cfg = config_for(app, relay)
        cfg["redis"]["bus"] = redis.url  # only the link's connections go through the relay
        gw = harness.Gateway(["--rules", rules, "--max-connections", 1000], cfg,
                             env={"CHATGATE_ADMIN_TOKEN": ADMIN_TOKEN}, name=f"gateway-profiles-{via}")
        await gw.astart()
        clients = await asyncio.gather(*(Client.connect(gw) for _ in range(PROFILES)))
        users = [c.hello["user"] for c in clients]
        how = "by directives on turns" if via == "a" else "by the admin API only"
        with step(f"6{via}. Redis killed; {PROFILES} users' profiles changed ({how}), kept in memory; the link "
                  f"tries {BACKOFF_TRIES} times"):
            await wait_log(gw, r"redis \S+: connected", 1, 5, "the first connection")
            before = relay.accepted
            killed = time.monotonic()
            redis.kill()
            await wait_metric(gw, "chatgate_store_degraded", lambda v: v == 1, 5, "the outage")
            if via == "a":
                await all_of(say(c, app, f"p{i}", f"p{i}", f"I live in city {i}",
                                 {"profile": {"home_city": f"city {i}"}}) for i, c in enumerate(clients))
            else:
                for i, user in enumerate(users):
                    await admin_put_profile(gw, user, "home_city", f"city {i}")
            await wait_until(lambda: relay.accepted >= before + BACKOFF_TRIES, 10, "the link's tries")
        with step(f"6{via}, shutdown: Redis started again (empty); SIGTERM before the gateway reconnected: it exits 0, and "
                  "every user's profile in Redis holds the update"):
            await stop_in_backoff(gw, redis, relay, clients, killed)
            check_profiles_written(redis, users, gw)
    finally:
        await relay.close()
        redis.cleanup(keep=True)


def check_profiles_written(redis, users, gw):
    """Every user i's profile in Redis holds home_city "city i"."""
    missing = [(i, got) for i, got in ((i, profile_in_redis(redis, u)) for i, u in enumerate(users))
               if got.get("home_city") != json.dumps(f"city {i}")]
    left = re.findall(r"(\d+) profile update\(s\) not (?:yet )?written back", gw.log_text())
    print(f"   {len(users) - len(missing)} of {len(users)} profiles in Redis after the exit; the log's count left: "
          f"{left or 'none'}")
    if missing:
        gw.failed = True
        i, got = missing[0]
        harness.fail(f"{len(missing)} of {len(users)} profile updates made in the outage are not in Redis after the "
                     f"gateway exited; e.g. user {i}: Redis holds {got}")


async def main(args):
    rules = harness.empty_rules_dir()
    async with harness.FakeApp() as app:
        await independent(part_after_outage(app, rules))
        await independent(part_refused_while_up(app, rules))
        await independent(part_away_at_shutdown(app, rules))
        await independent(part_in_backoff(app, rules))
        await independent(part_save_refused_at_close(app, rules))
        await independent(part_profiles_in_backoff(app, rules, "a"))
        await independent(part_profiles_in_backoff(app, rules, "b"))


if __name__ == "__main__":
    harness.run(main, timeout=110)
