"""End-to-end test of scale-out on Redis (issue 11): many gateways, one dialog at a time.

Real processes only: redis-server (x2 behind Debian's nutcracker, x1 direct, x1 in cluster
mode, x3 as a Redis Cluster), the gateway binary (x2 at once), and a counting chat app in this
process. Covers (docs/state.md, "Redis layout" and "The dialog lease"):
- two gateways behind twemproxy in front of two Redis shards: 2,000 turns of 20 dialogs sent
  through both at once: every message gets exactly one terminal frame, the app never sees
  two requests of one dialog at the same time (it counts), and every param a done
  acknowledged is in Redis at the end (no lost update);
- commands and round trips per turn on a direct Redis: one EVALSHA to load, one to save;
- kill -9 of the gateway holding a dialog mid-reply: the next message of that dialog, on the
  other gateway, is answered within 20 s (the default lease of 15 s runs out);
- a holder stopped (SIGSTOP) past its lease: the other gateway takes the dialog; when the
  stopped one resumes, its save is refused, logged and counted, and Redis keeps the other's;
- Redis in cluster mode: one node owning every slot, then a 3-master cluster
  (redis-cli --cluster create) with a gateway in front of the node owning each user's slot:
  every script runs on its node with 0 CROSSSLOT (and 0 MOVED) errors.
"""
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
from harness import Client, check, step  # noqa: E402

import websockets  # noqa: E402

REDIS_CLI = shutil.which("redis-cli") or "/usr/bin/redis-cli"


class CountingApp(harness.WsServer):
    """A chat app (the gateway's ws:// upstream) that counts, per dialog (user, room), the
    requests it is answering at the same time; each answer takes `delay` seconds and its done
    carries a state directive adding the param p_<id> of service "count", and setting its
    param "last" to the message's id."""

    def __init__(self, delay=0.01):
        super().__init__()
        self.delay = delay
        self.inflight = {}
        self.max_inflight = {}
        self.seen = 0
        self.slow = {}  # message id -> seconds to wait before answering
        self.cancels = {}  # message id -> time.monotonic() of the gateway's cancel frame
        self.tasks = {}

    def url(self, path="/count"):
        return super().url(path)

    async def _handler(self, ws, path=None):
        try:
            async for raw in ws:
                frame = json.loads(raw)
                if frame.get("type") == "message":
                    self.tasks[frame.get("id")] = asyncio.ensure_future(self.answer(ws, frame))
                elif frame.get("type") == "cancel":
                    self.cancels[frame.get("id")] = time.monotonic()
                    task = self.tasks.pop(frame.get("id"), None)
                    if task:
                        task.cancel()
        except websockets.ConnectionClosed:
            pass

    async def answer(self, ws, frame):
        key = (frame.get("user"), frame.get("room"))
        mid = frame.get("id")
        self.seen += 1
        self.inflight[key] = self.inflight.get(key, 0) + 1
        self.max_inflight[key] = max(self.max_inflight.get(key, 0), self.inflight[key])
        try:
            await asyncio.sleep(self.slow.pop(mid, self.delay))  # the fake app's reply time (the scenario's)
            done = {"type": "done", "id": mid, "text": f"ok {mid}",
                    "state": {"service": "count", "params": {f"p_{mid}": 1, "last": mid}}}
            await ws.send(json.dumps(done))
        except (websockets.ConnectionClosed, asyncio.CancelledError):
            pass
        finally:
            self.inflight[key] -= 1


def cluster_port():
    """A free port under 55536 whose cluster bus port (+10000) is free too."""
    import random
    import socket
    for _ in range(200):
        port = random.randint(20000, 45000)
        try:
            for p in (port, port + 10000):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", p))
            return port
        except OSError:
            continue
    harness.fail("no free port pair for a Redis Cluster node")


class ClusterRedis(harness.RedisServer):
    """A redis-server in cluster mode (its port under 55536: the bus is on port + 10000)."""

    def __init__(self):
        super().__init__(port=cluster_port())

    def command_line(self):
        return super().command_line() + ["--cluster-enabled", "yes", "--cluster-config-file",
                                         str(self.dir / "nodes.conf"), "--cluster-node-timeout", "2000"]


async def metrics(gw):
    status, _, body = await asyncio.to_thread(harness.http_get, gw.http_url + "/metrics")
    check(status == 200, f"/metrics of {gw.name}: HTTP {status}")
    return harness.parse_metrics(body.decode())


def header_args(rules):
    return ["--rules", rules, "--auth", "header", "--user-header", "X-User-Id"]


def config_for(app, url, **redis):
    cfg = harness.state_config({"app": {"url": app.url(), "connect_timeout_ms": 2000,
                                        "first_byte_timeout_ms": 30000, "idle_timeout_ms": 30000}},
                               "app", store=url, redis=redis)
    cfg["params_cap"] = 100000  # 100 params of a dialog, about 12 bytes each
    return cfg


async def connect_as(gw, user):
    return await Client.connect(gw, expect_user=user, extra_headers={"X-User-Id": user})


def params_of(redis_servers, user, room):
    """The dialog's params as Redis holds them, on whichever server has the key."""
    for r in redis_servers:
        key = r.find_key(harness.dialog_key(user, room, "state"))
        if key:
            return {k: json.loads(v) for k, v in r.params_hash(key).items()}
    return {}


def error_stats(redis):
    """INFO errorstats as {error prefix: count}, but NOSCRIPT: the first EVALSHA of each script
    on a new server is answered so by design, then sent as EVAL."""
    text = redis.command("INFO", "errorstats")
    out = {}
    for line in (text or "").splitlines():
        if line.startswith("errorstat_"):
            name, _, rest = line.partition(":")
            if name != "errorstat_NOSCRIPT":
                out[name[len("errorstat_"):]] = int(rest.split("=")[1])
    return out


def commands_total(redis, skip=("ping", "info", "config", "select", "auth", "client", "hello", "command")):
    return {name: s["calls"] for name, s in redis.info_commandstats().items() if name not in skip}


# ---- two gateways behind twemproxy ------------------------------------------------------

async def part_two_gateways(rules):
    shards = [await harness.RedisServer().astart(), await harness.RedisServer().astart()]
    twem = await harness.Nutcracker([s.port for s in shards]).start()
    users = [f"user{u}" for u in range(10)]  # ten hash tags: both shards get some
    rooms = [f"room{r}" for r in range(2)]
    per_conn = 50  # 20 dialogs x 2 gateways x 50 = 2,000 turns
    try:
        async with CountingApp() as app:
            cfg = config_for(app, f"redis://127.0.0.1:{twem.port}")
            async with harness.Gateway(header_args(rules), cfg, name="gateway-a") as ga, \
                    harness.Gateway(header_args(rules), cfg, name="gateway-b") as gb:
                with step("2,000 turns of 20 dialogs through two gateways at once (twemproxy, two Redis): "
                          "one terminal frame each, one request of a dialog at a time, nothing lost"):
                    acked = {}
                    problems = []

                    async def converse(gw, tag, user, room):
                        c = await connect_as(gw, user)
                        for n in range(per_conn):
                            mid = f"{tag}{n}"
                            turn = await c.message(f"turn {mid}", mid=mid, room=room, timeout=30)
                            if turn.terminal.get("type") != "done":
                                problems.append(f"{user}/{room} {mid}: {harness.brief(turn.terminal)}")
                                continue
                            acked.setdefault((user, room), set()).add(f"p_{mid}")
                        await c.close()

                    started = time.monotonic()
                    await asyncio.gather(*[converse(gw, f"{tag}{u}{r}", users[u], rooms[r])
                                           for u in range(len(users)) for r in range(len(rooms))
                                           for gw, tag in ((ga, "a"), (gb, "b"))])
                    took = time.monotonic() - started
                    check(not problems, f"{len(problems)} turns did not end in done: {problems[:5]}")
                    check(sum(len(v) for v in acked.values()) == 2000,
                          f"done frames: {sum(len(v) for v in acked.values())} of 2000")
                    worst = max(app.max_inflight.values())
                    check(worst == 1, f"the app saw {worst} requests of one dialog at once: "
                                      f"{ {k: v for k, v in app.max_inflight.items() if v > 1} }")
                    lost = {}
                    for (user, room), names in acked.items():
                        kept = params_of(shards, user, room)
                        missing = {n for n in names if kept.get(f"count.{n}") != 1}
                        if missing:
                            lost[(user, room)] = sorted(missing)[:5]
                    check(not lost, f"params acknowledged by a done but not in Redis: {lost}")
                    ms = [await metrics(gw) for gw in (ga, gb)]
                    waits = sum(m.value("chatgate_store_lease_waits_total") for m in ms)
                    lost_leases = sum(m.value("chatgate_store_lease_lost_total") for m in ms)
                    check(lost_leases == 0, f"saves refused for a lost lease: {lost_leases}")
                    on_shard = [len(s.keys("chatgate:*")) for s in shards]
                    check(all(n > 0 for n in on_shard), f"keys per shard: {on_shard} (both shards should hold dialogs)")
                    print(f"   2000 turns in {took:.1f} s; turns that waited for a lease: {waits:.0f}; "
                          f"keys per shard {on_shard}")
    finally:
        twem.stop()
        for s in shards:
            s.cleanup(keep=True)


# ---- commands per turn ------------------------------------------------------------------

async def settled(redis, quiet=0.3, timeout=5.0):
    """The command counts once nothing has changed for `quiet` seconds (saves land after done)."""
    deadline = time.monotonic() + timeout
    last = commands_total(redis)
    while time.monotonic() < deadline:
        await asyncio.sleep(quiet)  # a silence: the command counts stop changing
        now = commands_total(redis)
        if now == last:
            return now
        last = now
    return last

async def part_commands(rules):
    redis = await harness.RedisServer().astart()
    try:
        async with CountingApp(delay=0) as app:
            async with harness.Gateway(header_args(rules), config_for(app, redis.url), name="gateway-cmds") as gw:
                with step("commands per turn on a direct Redis: the load's three plain commands (SET NX, HGET, "
                          "EXISTS, pipelined), the save's EVALSHA, nothing else"):
                    c = await connect_as(gw, "cmd|user")
                    await c.message("warm up", mid="w0", room="r")  # the first turn loads the scripts (EVAL)
                    await settled(redis)  # its save lands after its done
                    before = commands_total(redis)
                    turns = 20
                    for n in range(turns):
                        turn = await c.message(f"turn {n}", mid=f"c{n}", room="r")
                        turn.expect_done()
                    after = await settled(redis)  # the last save lands after done
                    used = {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) != before.get(k, 0)}
                    # commandstats counts the scripts' own calls too: one script a turn (the save's),
                    # and the load's plain commands at least once a turn; nothing else a client sends
                    # (no EVAL, MULTI, SADD outside a script)
                    check(used.get("evalsha") == turns and not {"eval", "multi", "exec", "smembers"} & set(used) and
                          all(used.get(k, 0) >= turns for k in ("set", "hget", "exists")),
                          f"commands for {turns} turns: {used} (expected evalsha x {turns}, and set, hget and "
                          f"exists at least x {turns})")
                    inner = sum(v for k, v in used.items() if k != "evalsha") - 4 * turns
                    print(f"   per turn: 5 commands sent (SET, HGET, EXISTS and the profile's HGETALL, pipelined, "
                          f"on the way in; EVALSHA to save), 2 round trips; {inner / turns:.1f} calls inside the "
                          f"save's script")
                    await c.close()
    finally:
        redis.cleanup(keep=True)


# ---- a holder killed, a holder stopped ---------------------------------------------------

async def part_kill_holder(rules):
    redis = await harness.RedisServer().astart()
    try:
        async with CountingApp() as app:
            cfg = config_for(app, redis.url)
            ga = await harness.Gateway(header_args(rules), cfg, name="gateway-killed").astart()
            async with harness.Gateway(header_args(rules), cfg, name="gateway-survivor") as gb:
                with step("kill -9 of the gateway holding a dialog mid-reply: the other gateway answers "
                          "the next message of that dialog within 20 s"):
                    app.slow["k1"] = 60
                    ca = await connect_as(ga, "kill|user")
                    await ca.send_message("a long one", "k1", "trip")
                    deadline = time.monotonic() + 5
                    while app.inflight.get(("kill|user", "trip"), 0) == 0:
                        check(time.monotonic() < deadline, "the app never got k1")
                        await asyncio.sleep(0.02)
                    lock = redis.find_key(harness.dialog_key("kill|user", "trip", "lock"))
                    check(lock is not None and not (redis.get(lock) or "-").startswith("-"),
                          f"no lease in the dialog's lock while a turn runs: {lock and redis.get(lock)}")
                    os.kill(ga.pid, signal.SIGKILL)
                    ga.returncode = ga.proc.wait()
                    ga.stopped = True  # stopped by the test, not a crash: nothing to stop later
                    started = time.monotonic()
                    cb = await connect_as(gb, "kill|user")
                    turn = await cb.message("are you there?", mid="k2", room="trip", timeout=25)
                    took = time.monotonic() - started
                    turn.expect_done()
                    check(took < 20, f"the next message took {took:.1f} s")
                    m = await metrics(gb)
                    check(m.value("chatgate_store_lease_waits_total") >= 1, "the survivor never waited for the lease")
                    print(f"   answered after {took:.1f} s (lease 15 s)")
                    await cb.close()
    finally:
        redis.cleanup(keep=True)


async def part_stopped_holder(rules):
    redis = await harness.RedisServer().astart()
    try:
        async with CountingApp() as app:
            cfg = config_for(app, redis.url, lease_ms=2000)
            async with harness.Gateway(header_args(rules), cfg, name="gateway-stopped") as ga, \
                    harness.Gateway(header_args(rules), cfg, name="gateway-other") as gb:
                with step("a holder stopped (SIGSTOP) past its lease: the other takes the dialog; the stopped "
                          "one's save finds the lease gone (logged, counted) and is merged: both answered turns "
                          "kept, in order"):
                    app.slow["s1"] = 1.0
                    ca = await connect_as(ga, "stop|user")
                    await ca.send_message("slow one", "s1", "trip")
                    deadline = time.monotonic() + 5
                    while app.inflight.get(("stop|user", "trip"), 0) == 0:
                        check(time.monotonic() < deadline, "the app never got s1")
                        await asyncio.sleep(0.02)
                    os.kill(ga.pid, signal.SIGSTOP)
                    try:
                        await asyncio.sleep(3.0)  # past the 2 s lease
                        cb = await connect_as(gb, "stop|user")
                        turn = await cb.message("my turn", mid="s2", room="trip", timeout=10)
                        turn.expect_done()
                        await cb.close()
                        await asyncio.sleep(1.1)  # the stopped one saves a second later (whole seconds)
                    finally:
                        os.kill(ga.pid, signal.SIGCONT)
                    turn = await ca.collect_turn("s1", 10)
                    turn.expect_done()
                    hist = harness.dialog_key("stop|user", "trip", "history")

                    def users_in_history():
                        key = redis.find_key(hist)
                        return [m.get("content") for m in map(json.loads, redis.lrange(key) if key else [])
                                if m.get("role") == "user"]
                    # the stopped gateway's save finds the lease lost, merges, and writes the merge:
                    # until both turns are in Redis's history (the checks below say what is wrong)
                    await harness.wait_until(lambda: len(users_in_history()) >= 2, 5)
                    m = await metrics(ga)
                    check(m.value("chatgate_store_lease_lost_total") == 1,
                          f"lease_lost on the stopped gateway: {m.value('chatgate_store_lease_lost_total')}")
                    check("lease passed to another gateway" in ga.log_text(), "the lease lost was not logged")
                    kept = params_of([redis], "stop|user", "trip")
                    check(kept.get("count.p_s2") == 1 and kept.get("count.p_s1") == 1,
                          f"Redis should keep both gateways' params (merged): {kept}")
                    # the stopped turn began first: where both set a param, the later turn's wins,
                    # though the stopped one saved last
                    check(kept.get("count.last") == "s2", f"the later turn's param should win: {kept}")
                    users = users_in_history()
                    check(users == ["slow one", "my turn"],
                          f"both answered turns in the history, the stopped one's first: {users}")
                    check(m.value("chatgate_store_merges_total") == 1, "the merge was not counted")
                    await ca.close()
    finally:
        redis.cleanup(keep=True)


# ---- cancel across gateways -------------------------------------------------------------

async def wait_inflight(app, user, room):
    deadline = time.monotonic() + 5
    while app.inflight.get((user, room), 0) == 0:
        check(time.monotonic() < deadline, f"the app never got the slow message of {user}/{room}")
        await asyncio.sleep(0.01)


async def cross_cancel(app, ga, gb, user, mid, how, within, redis=None):
    """A slow reply of `user` streams through gateway A; `how` ("phrase" or "clear") arrives on
    gateway B: A's client gets cancelled, and the app A's cancel frame, within `within` s.
    ("behind": B's own message first waits in the dialog's line in `redis`.)"""
    app.slow[mid] = 30
    ca = await connect_as(ga, user)
    await ca.send_message("a slow one", mid, "trip")
    await wait_inflight(app, user, "trip")
    cb = await connect_as(gb, user)
    if how == "behind":  # B's own message of the dialog waits for A's lease first
        await cb.send_message("me too", f"{mid}w", "trip")
        line = harness.dialog_key(user, "trip", "line")  # B's ticket: "<holder>#<n>" beside "#"

        def waiting():
            key = redis.find_key(line)
            return key and any(f != "#" for f in redis.hgetall(key))
        await harness.wait_condition(waiting, 5, f"B's message in the dialog's line ({line})")
    sent = time.monotonic()
    if how in ("phrase", "behind"):
        await cb.send_message("stop", f"{mid}b", "trip")
    else:
        await cb.ws.send(json.dumps({"type": "context.clear", "room": "trip"}))
    turn = await ca.collect_turn(mid, 10)
    stopped = time.monotonic() - sent
    check(turn.terminal.get("type") == "cancelled", f"A's reply should be cancelled: {harness.brief(turn.terminal)}")
    deadline = time.monotonic() + 5
    while mid not in app.cancels:
        check(time.monotonic() < deadline, "the app never got A's cancel frame")
        await asyncio.sleep(0.005)
    closed = app.cancels[mid] - sent
    check(stopped < within and closed < within,
          f"{how} on B: A's cancelled after {stopped * 1000:.0f} ms, the app's cancel after {closed * 1000:.0f} ms "
          f"(at most {within * 1000:.0f} ms)")
    if how == "behind":  # the phrase stops B's waiting message too
        waited = await cb.collect_turn(f"{mid}w", 10)
        check(waited.terminal.get("type") == "cancelled", f"B's waiting message: {harness.brief(waited.terminal)}")
    if how in ("phrase", "behind"):  # B's own message goes on once A's turn has saved and let go
        (await cb.collect_turn(f"{mid}b", 10)).expect_done()
    await ca.close()
    await cb.close()
    return stopped, closed


async def part_cross_cancel(rules):
    redis = await harness.RedisServer().astart()
    try:
        async with CountingApp() as app:
            shipped = ["--rules", str(harness.REPO_ROOT / "rules"), "--auth", "header", "--user-header", "X-User-Id"]
            cfg = config_for(app, redis.url)
            async with harness.Gateway(shipped, cfg, name="gateway-a") as ga, \
                    harness.Gateway(shipped, cfg, name="gateway-b") as gb:
                with step("a cancel phrase on gateway B stops the reply streaming on gateway A within 100 ms "
                          "(the bus), and the app is told"):
                    s, c = await cross_cancel(app, ga, gb, "cc|user", "x1", "phrase", 0.1)
                    print(f"   A's cancelled after {s * 1000:.1f} ms, the app's cancel frame after {c * 1000:.1f} ms")
                with step("a context.clear on gateway B stops the reply streaming on gateway A within 100 ms"):
                    s, c = await cross_cancel(app, ga, gb, "cc2|user", "x2", "clear", 0.1)
                    print(f"   A's cancelled after {s * 1000:.1f} ms, the app's cancel frame after {c * 1000:.1f} ms")
                with step("a cancel phrase on gateway B while B's own message waits for A's lease: A's reply "
                          "stops too, within 100 ms"):
                    s, c = await cross_cancel(app, ga, gb, "cc4|user", "x4", "behind", 0.1, redis)
                    print(f"   A's cancelled after {s * 1000:.1f} ms, the app's cancel frame after {c * 1000:.1f} ms")
                    m = await metrics(ga)
                    check(m.value("chatgate_store_remote_cancels_total") == 3,
                          f"A's remote cancels: {m.value('chatgate_store_remote_cancels_total')}")
            dead_bus = dict(cfg)
            dead_bus["redis"] = dict(cfg["redis"], bus=f"redis://127.0.0.1:{harness.free_port()}", lease_ms=3000)
            async with harness.Gateway(shipped, dead_bus, name="gateway-nobus") as ga, \
                    harness.Gateway(shipped, cfg, name="gateway-b2") as gb:
                with step("gateway A's bus is down: the cancel flag reaches it with its lease renewal "
                          "(a third of redis.lease_ms, 1 s here)"):
                    s, c = await cross_cancel(app, ga, gb, "cc3|user", "x3", "phrase", 2.5)
                    print(f"   A's cancelled after {s * 1000:.0f} ms (renewal every 1,000 ms)")
                with step("a cancel flag left by an earlier turn (its lease) stops no later turn: a reply of "
                          "2.5 s, over two renewals, ends done"):
                    user = "cc5|user"
                    c = await connect_as(ga, user)
                    lock = harness.dialog_key(user, "trip", "lock")
                    app.slow["x5a"] = 0.5
                    first = asyncio.ensure_future(c.message("first", mid="x5a", room="trip"))
                    await harness.wait_condition(lambda: not (redis.get(lock) or "-").startswith("-"), 5,
                                                 f"the first turn's lease ({lock})")
                    ended = redis.get(lock).split()[0]  # "<its ticket>": the flag of the turn that ends
                    (await first).expect_done()
                    await harness.wait_condition(lambda: redis.get(lock) is None, 5,
                                                 f"the first turn's lock let go ({lock})")
                    redis.command("SET", harness.dialog_key(user, "trip", "cancel"), ended, "PX", "60000")
                    app.slow["x5b"] = 2.5
                    turn = await c.message("a slow one", mid="x5b", room="trip", timeout=10)
                    check(turn.terminal.get("type") == "done",
                          f"the turn after a stale flag should end done: {harness.brief(turn.terminal)}")
                    await c.close()
    finally:
        redis.cleanup(keep=True)


# ---- Redis Cluster's slot rules ----------------------------------------------------------

async def cluster_turns(gw, user):
    c = await connect_as(gw, user)
    for n, room in enumerate(("a", "b", "c")):
        (await c.message(f"hello {n}", mid=f"x{n}", room=room)).expect_done()
    await harness.context_command(c, "context.clear", "b")
    await c.close()


async def part_cluster(rules):
    single = ClusterRedis()
    await single.astart()
    nodes = []
    try:
        async with CountingApp(delay=0) as app:
            with step("Redis in cluster mode, one node owning every slot: turns, a clear and a forget run "
                      "with 0 CROSSSLOT errors"):
                single.command("CLUSTER", "ADDSLOTSRANGE", "0", "16383")
                deadline = time.monotonic() + 10
                while "cluster_state:ok" not in (single.command("CLUSTER", "INFO") or ""):
                    check(time.monotonic() < deadline, "the one-node cluster never became ok")
                    await asyncio.sleep(0.1)
                async with harness.Gateway(header_args(rules), config_for(app, single.url),
                                           env={"CHATGATE_ADMIN_TOKEN": "t0ken"}, name="gateway-cluster1") as gw:
                    await cluster_turns(gw, "slot|user")
                    status, _, body = await asyncio.to_thread(
                        harness.http_request, gw.http_url + "/admin/users/slot%7Cuser", "DELETE",
                        {"Authorization": "Bearer t0ken"})
                    check(status == 200, f"DELETE /admin/users on a cluster node: HTTP {status} {body!r}")
                    check(not single.keys("chatgate:*"), f"keys left after the forget: {single.keys('chatgate:*')}")
                    m = await metrics(gw)
                    check(m.value("chatgate_store_errors_total") == 0, "store errors on a cluster node")
                errors = error_stats(single)
                check("CROSSSLOT" not in errors and not errors, f"errors on the cluster node: {errors}")
            with step("a 3-master Redis Cluster (redis-cli --cluster create): a gateway in front of the node "
                      "owning each user's slot; 0 CROSSSLOT and 0 MOVED on every node"):
                nodes = [ClusterRedis() for _ in range(3)]
                for n in nodes:
                    await n.astart()
                out = subprocess.run([REDIS_CLI, "--cluster", "create"] + [f"127.0.0.1:{n.port}" for n in nodes]
                                     + ["--cluster-replicas", "0", "--cluster-yes"],
                                     capture_output=True, text=True, timeout=30)
                check(out.returncode == 0, f"redis-cli --cluster create failed: {out.stdout[-500:]} {out.stderr[-500:]}")
                deadline = time.monotonic() + 15
                while not all("cluster_state:ok" in (n.command("CLUSTER", "INFO") or "") for n in nodes):
                    check(time.monotonic() < deadline, "the cluster never became ok")
                    await asyncio.sleep(0.2)
                ranges = [(int(e[0]), int(e[1]), int(e[2][1])) for e in nodes[0].command("CLUSTER", "SLOTS")]
                by_port = {n.port: n for n in nodes}
                served = set()
                for u in range(40):
                    user = f"cl{u}|user"
                    slot = int(nodes[0].command("CLUSTER", "KEYSLOT", "{" + harness.escape_id(user) + "}"))
                    owner = by_port[next(port for lo, hi, port in ranges if lo <= slot <= hi)]
                    if owner.port in served:
                        continue
                    served.add(owner.port)
                    async with harness.Gateway(header_args(rules), config_for(app, owner.url),
                                               name=f"gateway-node{owner.port}") as gw:
                        await cluster_turns(gw, user)
                        m = await metrics(gw)
                        check(m.value("chatgate_store_errors_total") == 0, f"store errors on node {owner.port}")
                    if len(served) == 3:
                        break
                check(len(served) == 3, f"users on {len(served)} of 3 nodes")
                for n in nodes:
                    errors = error_stats(n)
                    check(not errors, f"errors on node {n.port}: {errors}")
                print("   a gateway on each of the 3 masters: turns, clear, 0 errors")
    finally:
        single.cleanup(keep=True)
        for n in nodes:
            n.cleanup(keep=True)


async def main(args):
    rules = harness.empty_rules_dir()
    parts = [part_commands, part_two_gateways, part_stopped_holder, part_cluster, part_cross_cancel, part_kill_holder]
    only = os.environ.get("CG_E2E_PARTS")
    for n, part in enumerate(parts):
        if not only or str(n) in only.split(","):
            await harness.independent(part(rules))


if __name__ == "__main__":
    harness.run(main, timeout=170)
