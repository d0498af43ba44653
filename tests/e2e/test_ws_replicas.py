"""End-to-end tests of a WebSocket app upstream's replicas, retries and fallback (issue 37,
item 4: one call core for every kind; docs/upstreams.md, "Replicas, retries and fallback").

A ws upstream keeps one connection per client connection; with `urls` the replica is
picked when that connection is opened, by the dialog (user, room) of the message that opens
it, as an OpenAI-compatible upstream's replicas are (test_replicas.py). Fake apps
(harness.FakeApp) are the replicas:
- a replica that refuses connections is skipped: every message is answered by the live
  one, the first that tried the dead one with `attempts` 2, and /metrics counts the retry
  and the replica marked out;
- a replica that closes the connection before the first frame of the reply (/close) is
  retried on the next: the client sees only the other's reply;
- affinity: one dialog's connections, one after the other, all go to one replica; other
  dialogs spread over the three; when the dialog's replica stops, its next connection
  moves to one other replica, invisibly;
- a replica that closes mid-reply (/close_mid, after two deltas) gives the client
  upstream_unavailable after those deltas, and the message is sent to no other replica;
- a ws upstream whose replicas (or whose one URL) cannot be reached falls back to its
  `fallback` upstream: done says `upstream` backup and `fallback_from` primary.
"""

import asyncio

import harness
from harness import Client, Gateway, check, independent, step

AUTH = ["--auth", "header", "--user-header", "X-User-Id"]


def config(upstreams, default):
    return harness.make_config(upstreams, default, rate_limit={"messages_per_second": 1000, "burst": 1000})


def upstream(urls, **extra):
    cfg = {"urls": urls, "connect_timeout_ms": 1000, "first_byte_timeout_ms": 2000, "idle_timeout_ms": 2000,
           "out_ms": 2000}
    cfg.update(extra)
    return cfg


async def one_turn(gw, user, room, mid, text="hello"):
    """A new client connection of `user` (so a new upstream connection) and one turn in
    `room`: its terminal frame (done or error) and the turn."""
    client = await Client.connect(gw, expect_user=user, extra_headers={"X-User-Id": user})
    try:
        turn = await client.message(text, mid=mid, room=room)
    finally:
        await client.close()
    return turn


async def done_turn(gw, user, room, mid, text="hello"):
    turn = await one_turn(gw, user, room, mid, text)
    turn.expect_done()
    return turn.terminal


async def upstream_counts(gw, upstream_name, *names):
    """The /metrics counters `names` of the upstream, as a dict (0 for a line that is not there)."""
    status, _, body = await asyncio.to_thread(harness.http_get, gw.http_url + "/metrics")
    check(status == 200, f"/metrics: {status}")
    m = harness.parse_metrics(body.decode())
    return {n: m.value(n, upstream=upstream_name) if m.has(n, upstream=upstream_name) else 0 for n in names}


def got(app, mid):
    """The paths of the app's connections that received message `mid`."""
    return [c.path for c in app.connections for m in c.messages if m.get("id") == mid]


async def part_dead_replica():
    closed = harness.free_port()
    async with harness.FakeApp() as app:
        cfg = config({"chat": upstream([f"ws://127.0.0.1:{closed}/app", app.url("/app")])}, "chat")
        async with Gateway(AUTH, config=cfg, name="ws-dead") as gw:
            with step("a replica refusing connections is skipped: every dialog is answered by the live one"):
                retried = 0
                for i in range(12):
                    done = await done_turn(gw, "alice", f"room-{i}", f"d{i}", f"hello {i}")
                    check(done.get("upstream") == "chat" and done.get("replica") == 1,
                          f"only replica 1 can answer: {done}")
                    check(done.get("text") == f"app got: hello {i}", f"the reply: {done}")
                    retried += done.get("attempts") == 2
                check(retried >= 1, "no dialog tried the dead replica first: the test proves nothing")
            with step("/metrics counts the retry and the replica marked out"):
                n = await upstream_counts(gw, "chat", "chatgate_upstream_retries_total",
                                          "chatgate_upstream_replica_outs_total")
                check(all(v >= 1 for v in n.values()), f"the retry and the replica marked out should be counted: {n}")


async def part_close_before_reply():
    async with harness.FakeApp() as app:
        cfg = config({"chat": upstream([app.url("/close"), app.url("/app")], out_ms=100)}, "chat")
        async with Gateway(AUTH, config=cfg, name="ws-close") as gw:
            with step("a replica that closes before the first frame of the reply is retried on the next"):
                retried = 0
                for i in range(12):
                    done = await done_turn(gw, "bob", f"room-{i}", f"c{i}", f"hi {i}")
                    check(done.get("replica") == 1 and done.get("text") == f"app got: hi {i}",
                          f"the reply should be replica 1's: {done}")
                    paths = got(app, f"c{i}")
                    if done.get("attempts") == 2:
                        retried += 1
                        check(paths == ["/close", "/app"], f"c{i} went to {paths}, not /close then /app")
                    else:
                        check(paths == ["/app"], f"c{i} went to {paths}, not /app alone")
                check(retried >= 1, "no dialog went to the closing replica first: the test proves nothing")


async def part_affinity():
    apps = [await harness.FakeApp().start() for _ in range(3)]
    try:
        cfg = config({"chat": upstream([a.url("/app") for a in apps])}, "chat")
        async with Gateway(AUTH, config=cfg, name="ws-affinity") as gw:
            with step("affinity: 10 connections of one dialog, one after the other, all reach one replica"):
                before = [a.opened for a in apps]
                replicas = set()
                for i in range(10):
                    done = await done_turn(gw, "carol", "trip", f"a{i}")
                    replicas.add(done.get("replica"))
                used = [i for i, a in enumerate(apps) if a.opened > before[i]]
                check(len(used) == 1 and replicas == set(used),
                      f"one dialog's connections went to apps {used}, done.replica {replicas}")
                home = used[0]
            with step("other dialogs spread over the replicas"):
                before = [a.opened for a in apps]
                for i in range(12):
                    await done_turn(gw, "carol", f"room-{i}", f"r{i}")
                spread = [i for i, a in enumerate(apps) if a.opened > before[i]]
                check(len(spread) >= 2, f"12 dialogs all went to apps {spread}")
            with step("the dialog's replica stops: its next connections move to one other replica, invisibly"):
                await apps[home].stop()
                first = await done_turn(gw, "carol", "trip", "m0")
                check(first.get("attempts") == 2 and first.get("replica") != home,
                      f"the first turn after the stop should be retried on another replica: {first}")
                for i in range(1, 6):
                    done = await done_turn(gw, "carol", "trip", f"m{i}")
                    check(done.get("replica") == first["replica"], f"the dialog moved again: {done} after {first}")
    finally:
        for a in apps:
            await a.stop()


async def part_close_mid_reply():
    async with harness.FakeApp() as app:
        cfg = config({"chat": upstream([app.url("/close_mid"), app.url("/app")])}, "chat")
        async with Gateway(AUTH, config=cfg, name="ws-close-mid") as gw:
            with step("a replica closing mid-reply gives upstream_unavailable after its deltas, never a retry"):
                seen = 0
                for i in range(12):
                    turn = await one_turn(gw, "dave", f"room-{i}", f"x{i}", f"story {i}")
                    if turn.kind != "error":
                        check(got(app, f"x{i}") == ["/app"], f"x{i} went to {got(app, f'x{i}')}")
                        continue
                    seen += 1
                    check(turn.deltas and turn.terminal.get("code") == "upstream_unavailable",
                          f"the cut reply should end in upstream_unavailable after its deltas: {turn.describe()}")
                    check(got(app, f"x{i}") == ["/close_mid"],
                          f"a message cut after its first delta was sent again: {got(app, f'x{i}')}")
                check(seen >= 1, "no dialog went to the closing replica in 12: the test proves nothing")


async def part_fallback():
    closed = harness.free_port()
    async with harness.FakeApp() as app:
        for name, primary in (
                ("replicas", upstream([f"ws://127.0.0.1:{closed}/a", f"ws://127.0.0.1:{closed}/b"],
                                      fallback="backup")),
                ("one url", {"url": f"ws://127.0.0.1:{closed}/app", "connect_timeout_ms": 1000,
                             "fallback": "backup"})):
            cfg = config({"primary": primary, "backup": harness.app_upstream(app, "/app")}, "primary")
            async with Gateway(AUTH, config=cfg, name="ws-fallback") as gw:
                with step(f"a ws upstream ({name}) that cannot be reached falls back to its fallback upstream"):
                    for i in range(3):
                        done = await done_turn(gw, "erin", "trip", f"b{i}")
                        check(done.get("upstream") == "backup" and done.get("fallback_from") == "primary",
                              f"done should say upstream backup, fallback_from primary: {done}")
                        check(done.get("text") == "app got: hello", f"the fallback's reply: {done}")
                    n = await upstream_counts(gw, "primary", "chatgate_upstream_fallbacks_total")
                    check(n["chatgate_upstream_fallbacks_total"] == 3, f"the fallbacks should be counted: {n}")


async def main(args):
    await independent(part_dead_replica())
    await independent(part_close_before_reply())
    await independent(part_affinity())
    await independent(part_close_mid_reply())
    await independent(part_fallback())


if __name__ == "__main__":
    harness.run(main, timeout=110)
