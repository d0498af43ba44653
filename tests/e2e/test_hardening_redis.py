"""End-to-end tests of the Redis store's hardening (issue 9, defects 3, 4, 5, 6, 7 and 11).

Real processes throughout: the gateway binary, Debian's redis-server on a free port, and
Debian's nutcracker (twemproxy) in front of it; the one fake is a TCP server that plays a
Redis still loading its data, since a real one is loading for too short a time to test.

1. Probe failure (defect 3): a "Redis" that answers the first PINGs with -LOADING, then
   +PONG. The gateway must drop such a connection and reconnect with the backoff, degraded
   meanwhile (/healthz degraded, chatgate_store_degraded 1), and become ok once PONG comes.
   A real redis-server with requirepass and a wrong password in the URL: degraded, and a
   message is still answered (with store_degraded), not served silently from memory.
2. Write-back (defect 4): (a) a dialog evicted from the memory copy during an outage is not
   written back blank over Redis's copy; (b) a dialog first loaded during an outage (a new
   gateway, Redis stopped) is not written over the intact Redis copy.
3. Twemproxy (defect 5): a conversation through nutcracker (hash_tag "{}") saves, survives a
   gateway restart, context.clear and DELETE /admin/users work, and the store never goes
   degraded (no MULTI, one hash tag per atomic step).
4. Forget-user with long escaped ids (defect 6): user and rooms of 256 bytes that escape
   to 768; after DELETE /admin/users no key of the user is left in Redis.
5. Host names (defect 7): --store redis://localhost:PORT resolves off the loop and connects
   to the numeric address (the log names it), and the dialog reaches Redis.
6. Write-back bound (defect 11): during an outage the dialogs held for the write-back stay
   within redis.writeback_max_bytes, the least recently written dropped, counted in /metrics.
"""

import asyncio
import json
import shutil
import subprocess
import tempfile
import time
import urllib.parse
from pathlib import Path

import harness
from harness import Client, check, check_turn_done, context_command, independent, step

TOKEN = "hardening-admin-token"
NUTCRACKER = "/usr/sbin/nutcracker"


async def say(client, app, mid, text, room, state=None, timeout=harness.DEFAULT_TIMEOUT):
    if state is not None:
        app.directives[mid] = state
    t = await client.message(text, mid=mid, room=room, timeout=timeout)
    check_turn_done(t)
    return t


async def healthz(gw):
    status, _, body = await asyncio.to_thread(harness.http_get, f"{gw.http_url}/healthz")
    return status, json.loads(body or b"{}")


async def metrics(gw):
    _, _, body = await asyncio.to_thread(harness.http_get, f"{gw.http_url}/metrics")
    return harness.parse_metrics(body.decode())


async def wait_health(gw, want, timeout):
    deadline = time.monotonic() + timeout
    while True:
        _, body = await healthz(gw)
        if body.get("status") == want:
            return True
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)


def user_client(gw, user):
    return Client.connect(gw, expect_user=user, extra_headers={"X-User-Id": user})


def config(app, store, **redis):
    return harness.state_config({"app": harness.app_upstream(app, "/state")}, "app", store=store, redis=redis)


# ---- 1. the probe -------------------------------------------------------------------------

class LoadingRedis:
    """A TCP server speaking just enough RESP: PING is answered -LOADING while `loading`,
    +PONG after; anything else -ERR. Counts connections and PINGs."""

    def __init__(self):
        self.loading = True
        self.connections = 0
        self.pings = 0
        self.server = None
        self.port = None

    async def start(self):
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def stop(self):
        self.server.close()
        await self.server.wait_closed()

    async def _serve(self, reader, writer):
        self.connections += 1
        try:
            while True:
                line = await reader.readline()
                if not line:
                    break
                if not line.startswith(b"*"):
                    continue
                args = []
                for _ in range(int(line[1:])):
                    size = int((await reader.readline())[1:])
                    args.append((await reader.readexactly(size + 2))[:-2])
                if args and args[0].upper() == b"PING":
                    self.pings += 1
                    writer.write(b"-LOADING Redis is loading the dataset in memory\r\n" if self.loading
                                 else b"+PONG\r\n")
                else:
                    writer.write(b"-ERR not a real redis\r\n")
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            pass
        finally:
            writer.close()


async def probe_loading(app, rules):
    fake = await LoadingRedis().start()
    try:
        async with harness.Gateway(["--rules", rules], config(app, f"redis://127.0.0.1:{fake.port}"),
                                   name="gateway-loading") as gw:
            with step("1a. PING answered -LOADING: degraded, the connection dropped and retried"):
                ok = await wait_health(gw, "degraded", 5)
                _, body = await healthz(gw)
                check(ok, f"/healthz should say degraded while Redis answers -LOADING: {body}; "
                          f"{fake.connections} connections, {fake.pings} PINGs")
                m = await metrics(gw)
                check(m.value("chatgate_store_degraded") == 1,
                      f"chatgate_store_degraded should be 1, got {m.value('chatgate_store_degraded')}")
                await harness.wait_until(lambda: fake.connections >= 3, 5)
                check(fake.connections >= 3, f"the gateway should reconnect with the backoff after -LOADING: "
                                             f"{fake.connections} connections in {fake.pings} PINGs")
                c = await Client.connect(gw)
                t = await say(c, app, "l1", "hello while loading", "r")
                check([w.get("code") for w in t.warnings] == ["store_degraded"],
                      f"a message while Redis loads should get store_degraded: {t.describe()}")
                await c.close()
            with step("1b. Redis done loading (+PONG): the gateway is back, healthz ok, gauge 0"):
                fake.loading = False
                ok = await wait_health(gw, "ok", 8)
                check(ok, f"/healthz should be ok once PING is answered: {(await healthz(gw))[1]}")
                m = await metrics(gw)
                check(m.value("chatgate_store_degraded") == 0, "chatgate_store_degraded should be 0 again")
    finally:
        await fake.stop()


async def probe_wrong_password(app, rules):
    redis = await harness.RedisServer(password="right-password").astart()
    try:
        store = f"redis://:wrong%20password@127.0.0.1:{redis.port}"
        async with harness.Gateway(["--rules", rules], config(app, store), name="gateway-wrongpass") as gw:
            with step("1c. a real Redis with requirepass, a wrong password in the URL: degraded, said so"):
                ok = await wait_health(gw, "degraded", 5)
                check(ok, f"/healthz should say degraded with a wrong password: {(await healthz(gw))[1]}")
                m = await metrics(gw)
                check(m.value("chatgate_store_degraded") == 1, "chatgate_store_degraded should be 1")
                c = await Client.connect(gw)
                t = await say(c, app, "w1", "hello", "r")
                check([w.get("code") for w in t.warnings] == ["store_degraded"],
                      f"the message should get store_degraded: {t.describe()}")
                await c.close()
                log = gw.log_text()
                check("wrong password" not in log, "the password appears in the log")
    finally:
        redis.cleanup(keep=True)


# ---- 2. the write-back ------------------------------------------------------------------

def dialog_in_redis(redis, user, room):
    params = redis.hgetall(harness.dialog_key(user, room, "params"))
    history = redis.lrange(harness.dialog_key(user, room, "history"))
    return {k: json.loads(v) for k, v in params.items()}, [json.loads(h)["content"] for h in history]


async def settled(probe, predicate, timeout=5.0):
    """Poll `probe()` (Redis read in a thread) until `predicate` holds; the last value. A save
    reaches Redis just after the turn's done, so tests wait for it rather than race it."""
    deadline = time.monotonic() + timeout
    while True:
        value = await asyncio.to_thread(probe)
        if predicate(value) or time.monotonic() > deadline:
            return value
        await asyncio.sleep(0.05)


async def writeback_evicted(app, rules):
    redis = await harness.RedisServer().astart()
    try:
        cfg = config(app, redis.url, command_timeout_ms=300, connect_timeout_ms=300)
        cfg["max_dialogs"] = 2
        async with harness.Gateway(["--rules", rules, "--auth", "header"], cfg, name="gateway-evict") as gw:
            with step("2a. a dialog evicted from memory during an outage is not written back blank"):
                c = await user_client(gw, "ann")
                await say(c, app, "e1", "first", "keep", {"service": "travel", "params": {"from": "Nairobi"}})
                await say(c, app, "e2", "second", "keep", {"params": {"to": "London"}})
                before = await settled(lambda: dialog_in_redis(redis, "ann", "keep"),
                                       lambda d: d[0].get("travel.to") == "London" and len(d[1]) == 4)
                check(before[0].get("travel.from") == "Nairobi" and len(before[1]) == 4,
                      f"the dialog should be in Redis before the outage: {before}")
                redis.pause()
                await say(c, app, "e3", "during the outage", "keep", {"params": {"to": "Paris"}}, timeout=8)
                for i in range(4):  # max_dialogs 2: "keep" leaves the memory copy
                    await say(c, app, f"x{i}", "other room", f"other{i}", timeout=8)
                redis.resume()
                ok = await wait_health(gw, "ok", 10)
                check(ok, "the gateway should reconnect after SIGCONT")
                await asyncio.sleep(0.5)  # the write-back's replies
                after = dialog_in_redis(redis, "ann", "keep")
                check(after == before, f"Redis's copy of the evicted dialog should be intact: before {before}, "
                                       f"after {after}")
                m = await metrics(gw)
                dropped = (m.value("chatgate_store_writeback_dropped_total", reason="gone") +
                           m.value("chatgate_store_writeback_dropped_total", reason="bound"))
                check(dropped >= 1, f"chatgate_store_writeback_dropped_total should count it: {dropped}")
                await c.close()
    finally:
        redis.cleanup(keep=True)


async def writeback_first_loaded_in_outage(app, rules):
    redis = await harness.RedisServer().astart()
    try:
        cfg = config(app, redis.url, command_timeout_ms=300, connect_timeout_ms=300)
        args = ["--rules", rules, "--auth", "header"]
        async with harness.Gateway(args, cfg, name="gateway-first") as gw:
            c = await user_client(gw, "bob")
            await say(c, app, "b1", "first", "trip", {"service": "travel", "params": {"from": "Nairobi"}})
            await say(c, app, "b2", "second", "trip", {"params": {"to": "London"}})
            await settled(lambda: dialog_in_redis(redis, "bob", "trip"), lambda d: len(d[1]) == 4)
            await c.close()
        before = dialog_in_redis(redis, "bob", "trip")
        with step("2b. a dialog first loaded during an outage (new gateway, Redis stopped) does not overwrite "
                  "Redis's copy when it comes back"):
            check(before[0].get("travel.to") == "London" and len(before[1]) == 4, f"setup: {before}")
            redis.pause()
            async with harness.Gateway(args, cfg, name="gateway-second") as gw:
                c = await user_client(gw, "bob")
                t = await say(c, app, "b3", "during the outage", "trip", {"service": "travel",
                                                                          "params": {"to": "Rome"}}, timeout=8)
                check([w.get("code") for w in t.warnings] == ["store_degraded"], f"setup: {t.describe()}")
                redis.resume()
                ok = await wait_health(gw, "ok", 10)
                check(ok, "the gateway should reconnect after SIGCONT")
                await asyncio.sleep(0.5)
                after = dialog_in_redis(redis, "bob", "trip")
                check(after == before, f"Redis's copy should be intact: before {before}, after {after}")
                state = await context_command(c, "context.get", "trip")
                check((state.get("params") or {}).get("travel", {}).get("to") == "London",
                      f"after the recovery the dialog should be Redis's: {harness.brief(state)}")
                m = await metrics(gw)
                check((m.value("chatgate_store_save_conflicts_total") or 0) >= 1,
                      "chatgate_store_save_conflicts_total should count the refused write-back")
                await c.close()
    finally:
        redis.cleanup(keep=True)


# ---- 3. twemproxy ---------------------------------------------------------------------------

class Nutcracker:
    """Debian's nutcracker (twemproxy) on a free port, hash_tag "{}", in front of one Redis."""

    def __init__(self, redis):
        self.redis = redis
        self.port = harness.free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="chatgate-e2e-nutcracker-"))
        self.proc = None

    def start(self):
        check(shutil.which(NUTCRACKER) or Path(NUTCRACKER).exists(),
              f"{NUTCRACKER} not found (Debian package nutcracker; scripts/deps.sh test)")
        conf = self.dir / "nutcracker.yml"
        conf.write_text(
            "chatgate:\n"
            f"  listen: 127.0.0.1:{self.port}\n"
            "  hash: fnv1a_64\n"
            "  hash_tag: \"{}\"\n"
            "  distribution: ketama\n"
            "  redis: true\n"
            "  auto_eject_hosts: false\n"
            "  timeout: 2000\n"
            "  servers:\n"
            f"   - 127.0.0.1:{self.redis.port}:1\n")
        self.log = self.dir / "nutcracker.log"
        self.proc = subprocess.Popen([NUTCRACKER, "-c", str(conf), "-o", str(self.log), "-s",
                                      str(harness.free_port()), "-v", "5"], stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 5
        while True:
            try:
                with harness.socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return self
            except OSError:
                check(self.proc.poll() is None and time.monotonic() < deadline,
                      f"nutcracker did not start: {self.log.read_text(errors='replace')[-800:] if self.log.exists() else ''}")
                time.sleep(0.05)

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=5)


async def twemproxy(app, rules):
    redis = await harness.RedisServer().astart()
    nut = Nutcracker(redis).start()
    try:
        cfg = config(app, f"redis://127.0.0.1:{nut.port}")
        args = ["--rules", rules, "--auth", "header"]
        env = {"CHATGATE_ADMIN_TOKEN": TOKEN}
        async with harness.Gateway(args, cfg, env=env, name="gateway-nut1") as gw:
            with step("3a. behind nutcracker: a conversation saves, no store_degraded, no flapping"):
                check(await wait_health(gw, "ok", 3), f"/healthz: {(await healthz(gw))[1]}")
                c = await user_client(gw, "auth0|tw")
                t1 = await say(c, app, "n1", "first", "trip", {"service": "travel", "params": {"from": "Nairobi"}})
                t2 = await say(c, app, "n2", "second", "trip", {"params": {"to": "London"}})
                await say(c, app, "n3", "other room", "other", {"service": "travel", "params": {"from": "Lagos"}})
                warned = [w for t in (t1, t2) for w in t.warnings]
                check(not warned, f"no warning expected behind nutcracker: {warned}")
                stored = await settled(lambda: dialog_in_redis(redis, "auth0|tw", "trip"), lambda d: len(d[1]) == 4)
                await settled(lambda: redis.smembers(harness.rooms_key("auth0|tw")), lambda m: len(m) == 2)
                check(stored[0] == {"travel.from": "Nairobi", "travel.to": "London"} and len(stored[1]) == 4,
                      f"the dialog should be in Redis through nutcracker: {stored}")
                check(redis.smembers(harness.rooms_key("auth0|tw")) == {"trip", "other"},
                      f"the rooms set: {redis.smembers(harness.rooms_key('auth0|tw'))}")
                m = await metrics(gw)
                check(m.value("chatgate_store_degraded") == 0 and m.value("chatgate_store_errors_total") == 0,
                      f"no store errors expected: degraded {m.value('chatgate_store_degraded')}, errors "
                      f"{m.value('chatgate_store_errors_total')}")
                check("degraded" not in gw.log_text() and "serving dialogs from memory" not in gw.log_text(),
                      "the store went degraded behind nutcracker")
                await c.close()
        async with harness.Gateway(args, cfg, env=env, name="gateway-nut2") as gw:
            with step("3b. behind nutcracker: the dialog survives a gateway restart; clear and forget work"):
                c = await user_client(gw, "auth0|tw")
                state = await context_command(c, "context.get", "trip")
                check(state.get("params") == {"travel": {"from": "Nairobi", "to": "London"}},
                      f"after the restart: {harness.brief(state)}")
                await context_command(c, "context.clear", "other")
                await asyncio.sleep(0.2)
                check(not redis.keys("chatgate:{auth0|tw:other}:*"), f"context.clear left {redis.keys('chatgate:{auth0|tw:other}:*')}")
                status, _, body = await asyncio.to_thread(
                    harness.http_request, f"{gw.http_url}/admin/users/auth0%7Ctw", "DELETE",
                    {"Authorization": f"Bearer {TOKEN}"})
                check(status == 200, f"DELETE /admin/users through nutcracker: {status} {body[:200]}")
                left = [k for k in redis.keys("chatgate:*") if "auth0|tw" in k]
                check(not left, f"keys of the forgotten user left: {left}")
                check("serving dialogs from memory" not in gw.log_text(), "the store went degraded behind nutcracker")
                await c.close()
    finally:
        nut.stop()
        redis.cleanup(keep=True)


# ---- 4. forget a user with long escaped ids --------------------------------------------------

async def forget_long_ids(app, rules):
    redis = await harness.RedisServer().astart()
    user = "{}" * 128  # 256 bytes, 768 escaped
    rooms = [":" * 250 + f"r{i}" for i in range(3)]  # 252 bytes, 752 escaped
    try:
        env = {"CHATGATE_ADMIN_TOKEN": TOKEN}
        async with harness.Gateway(["--rules", rules, "--auth", "header"], config(app, redis.url), env=env,
                                   name="gateway-forget") as gw:
            with step("4. DELETE /admin/users with a 256-byte user and long rooms (escaped 3x): nothing left"):
                c = await user_client(gw, user)
                for i, room in enumerate(rooms):
                    await say(c, app, f"f{i}", "remember this", room, {"service": "travel", "params": {"i": i}})
                await c.close()
                eu = harness.escape_id(user)
                before = await settled(lambda: [k for k in redis.keys("chatgate:*") if eu in k], lambda k: len(k) >= 9)
                check(len(before) >= 3 * 3, f"setup: the user's keys in Redis: {len(before)}")
                path = "/admin/users/" + urllib.parse.quote(user, safe="")
                status, _, body = await asyncio.to_thread(harness.http_request, gw.http_url + path, "DELETE",
                                                          {"Authorization": f"Bearer {TOKEN}"})
                check(status == 200, f"DELETE {path[:40]}...: {status} {body[:200]}")
                left = [k for k in redis.keys("chatgate:*") if eu in k]
                check(not left, f"{len(left)} keys of the forgotten user left in Redis, e.g. {left[:1]}")
    finally:
        redis.cleanup(keep=True)


# ---- 5. a host name ---------------------------------------------------------------------------

async def host_name(app, rules):
    redis = await harness.RedisServer().astart()
    try:
        async with harness.Gateway(["--rules", rules], config(app, f"redis://localhost:{redis.port}"),
                                   name="gateway-dns") as gw:
            with step("5. redis://localhost:PORT: resolved off the loop, connected to the numeric address"):
                c = await Client.connect(gw)
                t = await say(c, app, "h1", "hello", "r", {"service": "travel", "params": {"from": "Nairobi"}})
                check(not t.warnings, f"no warning expected: {t.describe()}")
                check(await settled(lambda: redis.hgetall(harness.dialog_key(c.hello["user"], "r", "params")), bool),
                      "the dialog should be in Redis")
                check(f"redis localhost:{redis.port}: connecting to 127.0.0.1" in gw.log_text(),
                      "the log should say the host was resolved and which address the connection goes to")
                await c.close()
    finally:
        redis.cleanup(keep=True)


# ---- 6. the write-back bound ------------------------------------------------------------------

async def writeback_bound(app, rules):
    redis = await harness.RedisServer().astart()
    try:
        cfg = config(app, redis.url, command_timeout_ms=300, connect_timeout_ms=300, writeback_max_bytes=8192)
        async with harness.Gateway(["--rules", rules], cfg, name="gateway-bound") as gw:
            with step("6. the dialogs held for the write-back stay within redis.writeback_max_bytes"):
                c = await Client.connect(gw)
                user = c.hello["user"]
                redis.pause()
                big = "x" * 1500
                for i in range(10):  # about 3 KB of history each: over 8 KB after three
                    await say(c, app, f"g{i}", f"{big} {i}", f"room{i}", timeout=8)
                m = await metrics(gw)
                pending = m.value("chatgate_store_writeback_pending_bytes")
                dropped = m.value("chatgate_store_writeback_dropped_total", reason="bound")
                check(pending is not None and 0 < pending <= 8192, f"pending bytes should stay within 8192: {pending}")
                check(dropped and dropped >= 5, f"dialogs over the bound should be counted: {dropped}")
                redis.resume()
                check(await wait_health(gw, "ok", 10), "the gateway should reconnect after SIGCONT")
                await asyncio.sleep(0.5)
                written = [i for i in range(10) if redis.lrange(harness.dialog_key(user, f"room{i}", "history"))]
                check(written and max(written) == 9 and 0 not in written,
                      f"the most recently written dialogs should be written back, the oldest dropped: {written}")
                await c.close()
    finally:
        redis.cleanup(keep=True)


async def main(args):
    rules = harness.empty_rules_dir()
    async with harness.FakeApp() as app:
        await independent(probe_loading(app, rules))
        await independent(probe_wrong_password(app, rules))
        await independent(writeback_evicted(app, rules))
        await independent(writeback_first_loaded_in_outage(app, rules))
        await independent(twemproxy(app, rules))
        await independent(forget_long_ids(app, rules))
        await independent(host_name(app, rules))
        await independent(writeback_bound(app, rules))


if __name__ == "__main__":
    harness.run(main, timeout=150)
