"""End-to-end test of Redis faults (issue 3, item 7; docs/state.md, When Redis fails).

50 dialogs (50 connections, auth none, one room each) talk through the state app with a
real redis-server (redis.command_timeout_ms 1000, connect_timeout_ms 1000):
1. Redis up: two messages each; the dialogs are in Redis; no warning.
2. Redis killed (SIGKILL) while a reply of each dialog is in flight (its state is saved
   after Redis died), then three more messages each. Every message is answered with done;
   each dialog gets exactly one warning store_degraded in this outage, about one of its
   messages and before that message's ack (the in-flight one's may follow its ack); the
   conversation keeps its context meanwhile (the params of the earlier turns are forwarded).
3. Redis restarted (empty, same port): within the reconnect backoff (<= 5 s) the gateway
   writes back what it held: every dialog's params (with the outage's last value) and
   history show up in Redis; the next message of each gets no warning.
4. Redis stopped (SIGSTOP: the socket stays open, nothing answers): every message still
   answered, each within command_timeout + 2 s; a store_degraded warning again (a new
   outage), once per dialog; meanwhile another connection's cancel probe and a new
   connection's hello are answered at once (the loop is not blocked). SIGCONT: the writes
   made during the stop reach Redis; the next messages get no warning.
5. Redis absent when the gateway starts: the gateway starts and answers (one warning),
   and when a redis-server comes up on that port the dialog is written there.
"""

import asyncio
import json
import time

import harness
from harness import Client, check, check_turn_done, independent, step

DIALOGS = 50
COMMAND_TIMEOUT = 1.0
MARGIN = 2.0


class Dialog:
    def __init__(self, i, client):
        self.i = i
        self.client = client
        self.user = client.hello["user"]
        self.room = f"r{i}"
        self.n = 0
        self.warnings = []  # (phase, frame)
        self.turns = []  # (phase, turn, seconds)

    async def say(self, app, params=None, phase="", delay=None, late_warning_ok=False):
        """One message; returns (turn, forwarded frame, seconds to done). `late_warning_ok`:
        the store may fail while the reply is in flight, so a warning may follow the ack."""
        self.n += 1
        mid = f"d{self.i}-{self.n}"
        if params is not None:
            app.directives[mid] = {"service": "travel", "params": params}
        started = time.monotonic()
        text = f"message {self.n} of dialog {self.i}" + (f" [delay={delay}]" if delay else "")
        t = await self.client.message(text, mid=mid, room=self.room, timeout=COMMAND_TIMEOUT + MARGIN + 5)
        elapsed = time.monotonic() - started
        self.turns.append((phase, t, elapsed))
        check_turn_done(t)
        for w in t.warnings:
            check(w.get("code") == "store_degraded", f"dialog {self.i}: unexpected warning {w}")
            ack_at = self.client.position(t.ack)
            check(late_warning_ok or self.client.position(w) < ack_at,
                  f"dialog {self.i}: the store_degraded warning came after the ack of {mid}: {t.describe()}")
            self.warnings.append((phase, w))
        fwd = await app.wait_message(mid)
        return t, fwd, elapsed


def phase_detail(d, phase):
    """The turns of dialog `d` in `phase`, for a failure message."""
    return "; ".join(f"{t.id} after {sec:.2f}s: {[f.get('type') + ('/' + f['code'] if 'code' in f else '') for f in t.frames]}"
                     for p, t, sec in d.turns if p == phase)


def stray_warnings(dialogs):
    """Warning frames not about any message of the dialog's turns (id null or unknown)."""
    out = []
    for d in dialogs:
        ids = {f"d{d.i}-{k}" for k in range(1, d.n + 1)}
        out += [f for f in d.client.received if f.get("type") == "warning" and f.get("id") not in ids]
    return out


async def all_dialogs(dialogs, fn):
    results = await asyncio.gather(*(fn(d) for d in dialogs), return_exceptions=True)
    failed = [(d.i, r) for d, r in zip(dialogs, results) if isinstance(r, BaseException)]
    if failed:
        for i, err in failed[:3]:
            print(f"   dialog {i} failed: {type(err).__name__}: {err}")
        harness.fail(f"{len(failed)} of {len(dialogs)} dialogs failed; the first: dialog {failed[0][0]}: "
                     f"{failed[0][1]}")
    return results


async def wait_written(redis, dialogs, name, value, timeout=10.0):
    """Poll until every dialog's params hash holds travel.<name> == value; returns seconds."""
    started = time.monotonic()
    missing = dialogs
    while True:
        missing = []
        for d in dialogs:
            try:
                got = redis.param(harness.dialog_key(d.user, d.room, "state"), f"travel.{name}")
            except (OSError, harness.RedisError):
                got = None
            if got is None or json.loads(got) != value:
                missing.append(d)
        if not missing:
            return time.monotonic() - started
        if time.monotonic() - started > timeout:
            harness.fail(f"{len(missing)} of {len(dialogs)} dialogs not written back to Redis within "
                         f"{timeout:.0f} s (travel.{name} == {value!r}); e.g. dialog {missing[0].i}: "
                         f"{redis.params_hash(harness.dialog_key(missing[0].user, missing[0].room, 'state'))}; "
                         f"{len(redis.keys('chatgate:*'))} chatgate keys in Redis")
        await asyncio.sleep(0.2)


async def fifty_dialogs(app, rules):
    redis = await harness.RedisServer().astart()
    config = harness.state_config({"app": harness.app_upstream(app, "/state")}, "app", store=redis.url,
                                  redis={"command_timeout_ms": int(COMMAND_TIMEOUT * 1000),
                                         "connect_timeout_ms": 1000})
    try:
        async with harness.Gateway(["--rules", rules, "--max-connections", 1000], config,
                                   name="gateway-faults") as gw:
            deferred = []  # failures reported at the end, so that the later phases still run
            clients = await asyncio.gather(*(Client.connect(gw) for _ in range(DIALOGS)))
            dialogs = [Dialog(i, c) for i, c in enumerate(clients)]

            with step(f"1. Redis up: {DIALOGS} dialogs x 2 messages, all in Redis, no warning"):
                async def up(d):
                    await d.say(app, {"from": "Nairobi", "i": d.i}, "up")
                    _, fwd, _ = await d.say(app, {"to": "London"}, "up")
                    check(fwd["params"].get("i") == d.i, f"dialog {d.i}: params not kept: {fwd['params']}")
                await all_dialogs(dialogs, up)
                warned = [d.i for d in dialogs if d.warnings]
                check(not warned, f"store_degraded with Redis up, dialogs {warned[:10]}")
                await wait_written(redis, dialogs, "to", "London", timeout=3)

            with step("2. Redis killed with replies in flight, then 3 more messages each: every message "
                      "answered, one store_degraded per dialog, context kept"):
                latencies = []

                async def killer():
                    await asyncio.sleep(0.15)  # the subject: kill -9 of Redis with replies in flight
                    redis.kill()

                async def down(d):
                    _, _, elapsed = await d.say(app, {"inflight": 1}, "killed", delay=0.4, late_warning_ok=True)
                    latencies.append(elapsed)
                    for k in range(3):
                        _, fwd, elapsed = await d.say(app, {"down": k}, "killed")
                        latencies.append(elapsed)
                        check(fwd["params"].get("i") == d.i and fwd["params"].get("to") == "London",
                              f"dialog {d.i}: the outage lost the dialog's params: {fwd['params']}")
                        if k:
                            check(fwd["params"].get("down") == k - 1,
                                  f"dialog {d.i}: a directive applied during the outage was lost: {fwd['params']}")
                await asyncio.gather(all_dialogs(dialogs, down), killer())
                counts = {d.i: sum(1 for p, _ in d.warnings if p == "killed") for d in dialogs}
                none = [i for i, n in counts.items() if n == 0]
                many = [i for i, n in counts.items() if n > 1]
                if many:
                    deferred.append(f"dialogs with more than one store_degraded in one outage: "
                                    f"{[(i, counts[i]) for i in many[:10]]}")
                if none:
                    deferred.append(f"{len(none)} dialogs got no store_degraded warning while Redis was dead: {none[:10]} "
                                f"(warning frames of any id on all connections: "
                                f"{sum(1 for d in dialogs for f in d.client.received if f.get('type') == 'warning')}); "
                                f"dialog {none[0] if none else 0}'s turns: "
                                    f"{phase_detail(dialogs[none[0] if none else 0], 'killed')}")
                if deferred:
                    print("   deferred (reported at the end): " + "; ".join(x[:150] for x in deferred))
                print(f"   {len(latencies)} messages, slowest {max(latencies):.2f}s")

            with step("3. Redis restarted: the gateway reconnects and writes back what it held"):
                await redis.astart()
                took = await wait_written(redis, dialogs, "down", 2, timeout=10)
                print(f"   all {DIALOGS} dialogs back in Redis {took:.1f}s after the restart")
                d0 = dialogs[0]
                hist = redis.lrange(harness.dialog_key(d0.user, d0.room, "history"))
                check(len(hist) == 10, f"dialog 0's history should be back (10 messages), got {len(hist)}")
                params0 = redis.params_hash(harness.dialog_key(d0.user, d0.room, "state"))
                check(json.loads(params0.get("travel.from", "null")) == "Nairobi",
                      f"dialog 0's params from before the outage should be written back too: {params0}")
                await wait_written(redis, dialogs, "inflight", 1, timeout=2)

                async def after(d):
                    _, fwd, _ = await d.say(app, None, "after-kill")
                    check(fwd["params"].get("down") == 2, f"dialog {d.i}: {fwd['params']}")
                await all_dialogs(dialogs, after)
                warned = [d.i for d in dialogs if any(p == "after-kill" for p, _ in d.warnings)]
                check(not warned, f"store_degraded after Redis came back: dialogs {warned[:10]}")

            with step("4. Redis stopped (SIGSTOP): answered within command_timeout + margin, loop not blocked"):
                probe = await Client.connect(gw)
                redis.pause()
                latencies = []

                async def stopped(d):
                    for k in range(2):
                        _, _, elapsed = await d.say(app, {"stopped": k}, "stopped")
                        latencies.append(elapsed)
                        check(elapsed <= COMMAND_TIMEOUT + MARGIN,
                              f"dialog {d.i}: a message took {elapsed:.2f}s with Redis stopped "
                              f"(command_timeout {COMMAND_TIMEOUT}s + {MARGIN}s)")

                async def others():
                    await asyncio.sleep(0.2)  # the scenario: a probe while Redis is away
                    started = time.monotonic()
                    await probe.check_alive()
                    t1 = time.monotonic() - started
                    started = time.monotonic()
                    c = await Client.connect(gw)
                    t2 = time.monotonic() - started
                    await c.close()
                    check(t1 < 0.5 and t2 < 0.5, f"with Redis stopped, a cancel probe took {t1:.2f}s and a new "
                                                 f"connection's hello {t2:.2f}s (the loop must not wait for Redis)")
                    return t1, t2

                results = await asyncio.gather(all_dialogs(dialogs, stopped), others())
                print(f"   probe {results[1][0]:.3f}s, hello {results[1][1]:.3f}s; messages: slowest "
                      f"{max(latencies):.2f}s, median {sorted(latencies)[len(latencies) // 2]:.2f}s")
                counts = {d.i: sum(1 for p, _ in d.warnings if p == "stopped") for d in dialogs}
                many = [i for i, n in counts.items() if n > 1]
                none = [i for i, n in counts.items() if n == 0]
                check(not many, f"more than one store_degraded per dialog in this outage: {many[:10]}")
                check(not none, f"{len(none)} dialogs got no store_degraded with Redis stopped: {none[:10]}; "
                                f"dialog {none[0] if none else 0}'s turns: "
                                f"{phase_detail(dialogs[none[0] if none else 0], 'stopped')}")

            with step("4b. SIGCONT: the writes made during the stop reach Redis; no more warnings"):
                redis.resume()
                took = await wait_written(redis, dialogs, "stopped", 1, timeout=10)
                print(f"   written back {took:.1f}s after SIGCONT")

                async def resumed(d):
                    _, fwd, _ = await d.say(app, None, "resumed")
                    check(fwd["params"].get("stopped") == 1, f"dialog {d.i}: {fwd['params']}")
                await all_dialogs(dialogs, resumed)
                warned = [d.i for d in dialogs if any(p == "resumed" for p, _ in d.warnings)]
                check(not warned, f"store_degraded after SIGCONT: dialogs {warned[:10]}")
                stray = stray_warnings(dialogs)
                check(not stray, f"warnings not about a message: {[harness.brief(f) for f in stray[:5]]}")
                await probe.close()
            for d in dialogs:
                await d.client.close()
            gw.assert_alive()
            with step("2 (deferred). store_degraded once per dialog in the SIGKILL outage"):
                check(not deferred, "\n".join(deferred))
    finally:
        redis.cleanup(keep=True)


async def absent_at_start(app, rules):
    port = harness.free_port()
    redis = harness.RedisServer(port=port)
    config = harness.state_config({"app": harness.app_upstream(app, "/state")}, "app", store=redis.url,
                                  redis={"command_timeout_ms": 1000, "connect_timeout_ms": 1000})
    try:
        async with harness.Gateway(["--rules", rules], config, name="gateway-no-redis") as gw:
            with step("5. Redis absent at start: the gateway starts and answers, one warning"):
                c = await Client.connect(gw)
                d = Dialog(0, c)
                for k in range(3):
                    _, fwd, elapsed = await d.say(app, {"k": k}, "absent")
                    check(elapsed <= COMMAND_TIMEOUT + MARGIN, f"message {k} took {elapsed:.2f}s without Redis")
                    if k:
                        check(fwd["params"].get("k") == k - 1, f"context lost without Redis: {fwd['params']}")
                check(len(d.warnings) == 1, f"expected one store_degraded, got {[harness.brief(w) for _, w in d.warnings]}")
            with step("5b. Redis comes up: the dialog is written there"):
                await redis.astart()
                took = await wait_written(redis, [d], "k", 2, timeout=10)
                print(f"   written {took:.1f}s after Redis started")
                _, fwd, _ = await d.say(app, None, "up")
                check(fwd["params"].get("k") == 2, f"{fwd['params']}")
                check(not [w for p, w in d.warnings if p == "up"], "store_degraded with Redis up")
                await c.close()
            gw.assert_alive()
    finally:
        redis.cleanup(keep=True)


async def main(args):
    rules = harness.empty_rules_dir()
    async with harness.FakeApp() as app:
        await independent(fifty_dialogs(app, rules))
        await independent(absent_at_start(app, rules))


if __name__ == "__main__":
    harness.run(main, timeout=100)
