"""End-to-end test of --workers N (issue 11, item 4): a master and N worker processes on one
port, with a real redis-server as the shared store.

With --workers 2 --store redis://...:
1. both workers serve: 40 WebSocket clients each get their hello, and the per-worker
   chatgate_connections{worker=...} of /metrics show both workers holding some; each client's
   message gets its done; a resume token of one client gives the same user on 8 new
   connections (which land on either worker: the resume secret is the group's);
2. /metrics sums both: chatgate_messages_total and turns done equal the messages sent, on
   several requests (new connections, so either worker answers);
3. SIGHUP to the master reloads the rules in both (chatgate_rules_reloads_total{result="ok"}
   summed = 2); POST /admin/reload on either reloads both (2 more, not 3);
4. kill -9 of one worker (found as a child of the master in /proc): the master starts a new
   one (a new pid, chatgate_worker_restarts_total 1, both workers up), the counters of the
   group do not go back, and the port still serves;
5. SIGTERM to the master with a reply in flight (the demo upstream with a delay): the reply
   finishes with done, the master exits 0, and no worker is left.
--workers auto runs one worker per CPU the process may run on: as many as the test's own
affinity mask holds, one process (no master) when the gateway is started on one CPU, and one
process with the memory store, each saying so in its log.
And: --workers 2 with the memory store exits 2 with "--workers: 2 workers need a shared
store: --store redis://..."; --workers many or 0 exits 2 naming what it takes; --workers 2 on
a port another process holds exits 1.
"""

import asyncio
import contextlib
import os
import signal
import socket
import time

import harness
from harness import Client, brief, check, fail, independent, step

N_CLIENTS = 40
TOKEN = "workers-admin-token"


def pid_exists(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2:].split()[0] != "Z"


async def metrics(gw):
    status, _, body = await asyncio.to_thread(harness.http_get, gw.http_url + "/metrics")
    check(status == 200, f"/metrics answered {status}")
    return harness.parse_metrics(body.decode())


async def metrics_until(gw, predicate, what, timeout=5.0):
    """/metrics until predicate(m) holds (each worker publishes its figures every 200 ms)."""
    deadline = time.monotonic() + timeout
    while True:
        m = await metrics(gw)
        if predicate(m):
            return m
        if time.monotonic() > deadline:
            fail(f"/metrics: {what} within {timeout:.0f} s; last:\n{brief(m.text, 3000)}")
        await asyncio.sleep(0.1)


def per_worker(m, name):
    return {dict(labels)["worker"]: v for labels, v in m.series(name).items() if "worker" in dict(labels)}


async def wait_workers(gw, n, exclude=(), timeout=10.0):
    """The set of n live worker pids of the master (none of `exclude`)."""
    deadline = time.monotonic() + timeout
    while True:
        kids = harness.children_of(gw.pid)
        if len(kids) == n and not kids & set(exclude):
            return kids
        if time.monotonic() > deadline:
            fail(f"the master (pid {gw.pid}) should have {n} workers (not {sorted(exclude)}); it has {sorted(kids)}")
        await asyncio.sleep(0.05)


async def say(client, mid, text):
    turn = await client.message(text, mid=mid)
    turn.expect_done()
    return turn


async def part_group(redis):
    config = harness.make_config({"demo": harness.demo_upstream(30)}, "demo", store=redis.url,
                                 rate_limit={"messages_per_second": 1000, "burst": 1000})
    gw = await harness.Gateway(["--workers", "2", "--shutdown-timeout-s", "10"], config,
                               env={"CHATGATE_ADMIN_TOKEN": TOKEN}, name="gateway-workers").astart()
    clients = []
    try:
        with step("two workers start under the master"):
            workers = await wait_workers(gw, 2)
            # the port accepts once one worker listens; wait for the second
            deadline = time.monotonic() + 10
            while True:
                status, _, body = await asyncio.to_thread(harness.http_get, gw.http_url + "/healthz")
                if status == 200 and body.strip() == b'{"status":"ok","workers":2,"workers_up":2}':
                    break
                check(time.monotonic() < deadline, f"/healthz should say both workers are up: {status} {body!r}")
                await asyncio.sleep(0.05)

        with step(f"{N_CLIENTS} clients get their hello and spread over both workers"):
            clients = await asyncio.gather(*(Client.connect(gw) for _ in range(N_CLIENTS)))
            m = await metrics_until(gw, lambda m: m.value("chatgate_connections") == N_CLIENTS,
                                    f"chatgate_connections should be {N_CLIENTS}")
            each = per_worker(m, "chatgate_connections")
            check(set(each) == {"0", "1"} and sum(each.values()) == N_CLIENTS,
                  f"chatgate_connections{{worker}} should cover workers 0 and 1 and add up: {each}")
            check(all(v > 0 for v in each.values()),
                  f"both workers should hold connections (SO_REUSEPORT spreads them): {each}")
            print(f"   connections per worker: {each}", flush=True)

        with step("every client's message gets its done"):
            turns = await asyncio.gather(*(say(c, f"m{i}", f"hello number {i}") for i, c in enumerate(clients)))
            check(len(turns) == N_CLIENTS, "a turn is missing")

        with step("/metrics sums both workers, whichever answers"):
            await metrics_until(gw, lambda m: m.value("chatgate_messages_total") == N_CLIENTS
                                and m.value("chatgate_turns_total", end="done") == N_CLIENTS,
                                f"chatgate_messages_total and turns done should be {N_CLIENTS}")
            for _ in range(8):
                m = await metrics(gw)
                check(m.value("chatgate_messages_total") == N_CLIENTS
                      and m.value("chatgate_turns_total", end="done") == N_CLIENTS,
                      f"messages {m.value('chatgate_messages_total')}, done "
                      f"{m.value('chatgate_turns_total', end='done')}: both should be {N_CLIENTS}")
                check(m.value("chatgate_workers") == 2 and m.value("chatgate_worker_restarts_total") == 0,
                      "chatgate_workers 2 and no restart yet")
                _, count = m.histogram("chatgate_stage_seconds", stage="turn")[1:]
                check(count == N_CLIENTS, f"the turn histogram should count {N_CLIENTS}: {count}")

        with step("a resume token works on either worker (one resume secret for the group)"):
            user, token = clients[0].hello["user"], clients[0].hello["resume"]
            check(token, f"no resume token in the hello: {brief(clients[0].hello)}")
            for _ in range(8):
                c = await Client.connect(gw.url + f"?resume={token}", expect_user=user)
                await c.close()

        with step("SIGHUP to the master reloads the rules in both workers"):
            before = (await metrics(gw)).value("chatgate_rules_reloads_total", result="ok")
            os.kill(gw.pid, signal.SIGHUP)
            await metrics_until(gw, lambda m: m.value("chatgate_rules_reloads_total", result="ok") == before + 2,
                                f"chatgate_rules_reloads_total{{result=ok}} should go from {before} to {before + 2}")
            await asyncio.sleep(0.5)  # a silence: a third reload would come now
            m = await metrics(gw)
            check(m.value("chatgate_rules_reloads_total", result="ok") == before + 2,
                  "one SIGHUP should be one reload per worker, no more")
            check(harness.children_of(gw.pid) == workers, "SIGHUP should not restart a worker")

        with step("POST /admin/reload reloads the worker that takes it and, through the master, the other"):
            status, _, body = await asyncio.to_thread(harness.http_request, gw.http_url + "/admin/reload", "POST",
                                                      {"Authorization": f"Bearer {TOKEN}"})
            check(status == 200, f"POST /admin/reload: {status} {body!r}")
            await metrics_until(gw, lambda m: m.value("chatgate_rules_reloads_total", result="ok") == before + 4,
                                f"chatgate_rules_reloads_total{{result=ok}} should be {before + 4}")
            await asyncio.sleep(0.5)  # a silence: a fifth reload would come now
            check((await metrics(gw)).value("chatgate_rules_reloads_total", result="ok") == before + 4,
                  "one POST /admin/reload should be one reload per worker, no more")

        with step("kill -9 of a worker: the master starts a new one; the port still serves"):
            victim = min(workers)
            os.kill(victim, signal.SIGKILL)
            workers = await wait_workers(gw, 2, exclude=[victim])
            m = await metrics_until(gw, lambda m: m.value("chatgate_worker_restarts_total") == 1
                                    and all(v == 1 for v in per_worker(m, "chatgate_worker_up").values()),
                                    "chatgate_worker_restarts_total 1 and both workers up")
            check(m.value("chatgate_messages_total") == N_CLIENTS,
                  f"the group's counters should not go back when a worker dies: "
                  f"messages {m.value('chatgate_messages_total')}")
            # the survivors' clients still talk; new clients are served (either worker)
            alive = [c for c in clients if c.open]
            check(0 < len(alive) < N_CLIENTS, f"the killed worker's clients should be gone, the others' not: "
                  f"{len(alive)} of {N_CLIENTS} open")
            await say(alive[0], "after-kill", "still there?")
            fresh = await asyncio.gather(*(Client.connect(gw) for _ in range(8)))
            await asyncio.gather(*(say(c, "f1", "hello again") for c in fresh))
            m = await metrics_until(gw, lambda m: m.value("chatgate_messages_total") == N_CLIENTS + 9,
                                    f"chatgate_messages_total should be {N_CLIENTS + 9}")
            clients = alive + list(fresh)

        with step("SIGTERM to the master: the reply in flight finishes, exit 0, no worker left"):
            c = clients[-1]
            text = " ".join(f"word{i}" for i in range(40))  # 40 words at 30 ms: over a second
            await c.send_message(text, "long")
            await c.recv_type("delta", "long")
            t0 = time.monotonic()
            gw.send_signal(signal.SIGTERM)
            turn = await c.collect_turn("long", timeout=12)
            turn.expect_done()
            check(turn.terminal.get("text", "").rstrip().endswith('word39".'),
                  f"the done text should be the whole reply: {brief(turn.terminal)}")
            code = await gw.await_exit(15)
            check(code == 0, f"the master should exit 0 after its workers drained; status {code} "
                  f"after {time.monotonic() - t0:.1f} s")
            left = [p for p in workers if pid_exists(p)]
            check(not left, f"workers still running after the master exited: {left}")
    finally:
        for c in clients:
            if c.open:
                await c.close()
        if gw.alive():
            await gw.astop(timeout=15)


async def part_refused():
    with step("--workers 2 with the memory store exits 2 and says why"):
        code, out, _ = await harness.gateway_exit(args=["--workers", "2"])
        check(code == 2 and "--workers: 2 workers need a shared store: --store redis://..." in out,
              f"status {code}, output {out!r}")
        code, out, _ = await harness.gateway_exit(config={"workers": 3})
        check(code == 2 and "workers: 3 workers need a shared store" in out, f"status {code}, output {out!r}")
    with step("--workers with a word other than auto, or 0, exits 2 and names the values it takes"):
        for value in ("many", "0"):
            code, out, _ = await harness.gateway_exit(args=["--workers", value])
            check(code == 2 and f"--workers: '{value}' is not a whole number from 1 to 64, nor auto" in out,
                  f"--workers {value}: status {code}, output {out!r}")
        # in a file, only the word may be a string: a number in quotes is refused, as it is for
        # every other whole-number key
        for value in (True, "2", "AUTO"):
            code, out, _ = await harness.gateway_exit(config={"workers": value, "store": "redis://127.0.0.1:1"})
            check(code == 2 and 'workers: must be a whole number or "auto"' in out,
                  f"workers {value!r}: status {code}, output {out!r}")
    with step("on a port another process holds, one process or --workers 2 exits 1, having closed "
              "what it opened (under ASan: no leak report)"):
        with socket.socket() as held:
            held.bind(("127.0.0.1", 0))
            held.listen()
            port = held.getsockname()[1]
            for args in ([], ["--store", "redis://127.0.0.1:1"], ["--workers", "2", "--store", "redis://127.0.0.1:1"]):
                code, out, _ = await harness.gateway_exit(args=args + ["--listen", f"127.0.0.1:{port}"])
                check(code == 1 and "could not start listening" in out and "Sanitizer" not in out,
                      f"{args}: status {code}, output {out[-2000:]!r}")


@contextlib.asynccontextmanager
async def auto_gateway(args, config, name, cpus=None):
    """A gateway started with `args` while this process may run only on `cpus` (the gateway
    inherits the affinity mask at fork), or on all its own; the mask is restored once it has
    started, and the gateway stopped at the end."""
    mine = os.sched_getaffinity(0)
    if cpus:
        os.sched_setaffinity(0, cpus)
    try:
        gw = await harness.Gateway(args, config, name=name).astart()
    finally:
        os.sched_setaffinity(0, mine)
    try:
        yield gw
    finally:
        await gw.astop(timeout=15)


def one_process(gw, why):
    """gw runs as one process, forked no workers, and its log says why auto gave one."""
    check(not harness.children_of(gw.pid), f"no workers should be forked: {harness.children_of(gw.pid)}")
    check(f"workers auto: 1 ({why})" in gw.log_text(), f"the log should say why there is one process: {gw.log_tail(10)}")


async def one_turn(gw, mid):
    """A client's message gets its done through gw."""
    client = await Client.connect(gw)
    await say(client, mid, "hello")
    await client.close()


async def part_auto(redis):
    config = harness.make_config({"demo": harness.demo_upstream(0)}, "demo", store=redis.url)
    cpus = min(len(os.sched_getaffinity(0)), 64)
    with step(f"--workers auto with Redis: one worker per CPU this process may run on ({cpus})"):
        async with auto_gateway(["--workers", "auto"], config, "gateway-workers-auto") as gw:
            if cpus > 1:
                await wait_workers(gw, cpus)
                check("(auto: one per CPU this process may run on)" in gw.log_text(),
                      f"the master's log should say the count is auto's: {gw.log_tail(10)}")
            else:
                one_process(gw, "this process may run on one CPU")
            await one_turn(gw, "auto-1")
    with step("--workers auto on one CPU (the affinity mask, as taskset leaves it): one process, no master"):
        async with auto_gateway(["--workers", "auto"], config, "gateway-workers-auto-1cpu",
                                cpus={min(os.sched_getaffinity(0))}) as gw:
            one_process(gw, "this process may run on one CPU")
            await one_turn(gw, "auto-2")
    with step("\"workers\": \"auto\" with the memory store: one process, and the log says why"):
        memory = harness.make_config({"demo": harness.demo_upstream(0)}, "demo", workers="auto")
        async with auto_gateway([], memory, "gateway-workers-auto-memory") as gw:
            one_process(gw, "the memory store is one process's")


async def main(args):
    redis = await harness.RedisServer().astart()
    try:
        await independent(part_group(redis))
        await independent(part_auto(redis))
        await independent(part_refused())
    finally:
        redis.cleanup()


if __name__ == "__main__":
    harness.run(main, timeout=85)
