"""End-to-end test of many machines (issue 11): HAProxy in front of two gateways on one Redis.

Real processes only: Debian's haproxy (2.6), run with examples/haproxy.cfg as written but for
the addresses and the stats socket's path (docs/deployment.md shows the same file: checked here), two
gateway binaries (--auth header) on one redis-server, and two state apps (harness.FakeApp
/state, one per gateway, so the test knows which gateway served a message). Covers docs/deployment.md,
"Many machines":
- a chatgate.v1 client through HAProxy gets its hello (the subprotocol passes) and done;
- ten users through HAProxy: both gateways serve, and a user's connections land on one
  gateway (balance hdr(X-User-Id), hash-type consistent);
- SIGTERM of the gateway a user is on: its /healthz answers 503 while a reply of another
  user still drains there, HAProxy's check marks it down before its port closes, the
  draining reply still ends in done; the user's message on the old connection is refused
  (internal, "reconnect"), the user reconnects through HAProxy at once (the draining
  gateway's 503 is retried on the other: retry-on 503, option redispatch) and lands on the
  other gateway with its dialog intact (params set by a state directive, read back with
  context.get and forwarded to the other gateway's app), since the dialog is in Redis;
- the stopped gateway exits 0, and HAProxy keeps it down (its port is closed now).
"""
import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
from harness import Client, check, step  # noqa: E402

HAPROXY = shutil.which("haproxy") or "/usr/sbin/haproxy"
EXAMPLE = harness.REPO_ROOT / "examples" / "haproxy.cfg"
README = harness.REPO_ROOT / "docs" / "deployment.md"  # the HAProxy example lives there
# What the test replaces in examples/haproxy.cfg: everything else runs as written.
EXAMPLE_BIND = "bind :80"
EXAMPLE_SOCKET = "/run/haproxy/admin.sock"
EXAMPLE_SERVERS = ("10.0.0.11:8080", "10.0.0.12:8080")


def example_body():
    """examples/haproxy.cfg without its leading comment: the text docs/deployment.md shows."""
    lines = EXAMPLE.read_text().splitlines(keepends=True)
    while lines and lines[0].startswith("#"):
        lines.pop(0)
    return "".join(lines)


class HAProxy:
    """Debian's haproxy in the foreground (-db) with the example config on a free port."""

    def __init__(self, gateway_ports):
        self.port = harness.free_port()
        self.dir = harness.temp_dir("chatgate-e2e-haproxy-")
        self.socket = self.dir / "admin.sock"
        text = EXAMPLE.read_text()
        for old, new in ((EXAMPLE_BIND, f"bind 127.0.0.1:{self.port}"), (EXAMPLE_SOCKET, str(self.socket))) + \
                tuple((s, f"127.0.0.1:{p}") for s, p in zip(EXAMPLE_SERVERS, gateway_ports)):
            check(text.count(old) == 1, f"examples/haproxy.cfg should hold {old!r} once (the test replaces it)")
            text = text.replace(old, new)
        self.config = self.dir / "haproxy.cfg"
        self.config.write_text(text)
        self.log_path = self.dir / "haproxy.log"
        self.proc = None

    @property
    def url(self):
        return f"ws://127.0.0.1:{self.port}/ws"

    async def start(self):
        if not os.path.exists(HAPROXY):
            harness.fail("haproxy not found (Debian package haproxy; scripts/deps.sh test)")
        checked = subprocess.run([HAPROXY, "-c", "-f", str(self.config)], capture_output=True, text=True)
        check(checked.returncode == 0, f"haproxy -c refused the example config: {checked.stdout} {checked.stderr}")
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen([HAPROXY, "-db", "-f", str(self.config)], stdin=subprocess.DEVNULL,
                                     stdout=self.log, stderr=subprocess.STDOUT)
        await harness.wait_listening(self.port, self.proc, "haproxy", self.log_path)
        return self

    def log_text(self):
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def _ask(self, command):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(2)
            s.connect(str(self.socket))
            s.sendall(command.encode() + b"\n")
            out = b""
            while chunk := s.recv(65536):
                out += chunk
        return out.decode()

    async def stats(self):
        """`show stat` of the chatgate backend: {svname: row} (BACKEND included)."""
        text = await asyncio.to_thread(self._ask, "show stat")
        lines = text.strip().splitlines()
        header = lines[0].lstrip("# ").split(",")
        rows = (dict(zip(header, line.split(","))) for line in lines[1:])
        return {row["svname"]: row for row in rows if row.get("pxname") == "chatgate"}

    async def servers(self):
        """{server name: (status, last check)} of the chatgate backend. The last check's
        status as HAProxy gives it, less the "* " it puts first while the next check runs."""
        return {name: (row.get("status"), (row.get("check_status") or "").removeprefix("* "))
                for name, row in (await self.stats()).items() if name not in ("BACKEND", "FRONTEND")}

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc:
            self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


async def metrics(gw):
    status, _, body = await asyncio.to_thread(harness.http_get, gw.http_url + "/metrics")
    check(status == 200, f"/metrics of {gw.name}: HTTP {status}")
    return harness.parse_metrics(body.decode())


async def connect(proxy, user):
    """A chatgate.v1 client through HAProxy, as user (the header a login in front would set)."""
    c = await Client.connect(proxy.url, expect_user=user, subprotocols=["chatgate.v1"],
                             extra_headers={"X-User-Id": user})
    check(c.ws.subprotocol == "chatgate.v1", f"subprotocol through HAProxy: {c.ws.subprotocol!r}")
    return c


def served_by(apps, mid):
    """The index of the app (so of the gateway) that got message mid, or None."""
    found = [i for i, app in enumerate(apps) if app.message_frame(mid) is not None]
    check(len(found) <= 1, f"message {mid} reached both gateways' apps")
    return found[0] if found else None


async def wait_status(proxy, server, want, timeout):
    deadline = time.monotonic() + timeout
    while True:
        states = await proxy.servers()
        if states.get(server, ("?",))[0].startswith(want):
            return states[server]
        check(time.monotonic() < deadline, f"HAProxy never showed {server} {want} within {timeout} s: {states}")
        await asyncio.sleep(0.1)


async def part_readme_shows_example(rules):
    with step("docs/deployment.md shows examples/haproxy.cfg as it is (the tested config)"):
        check(example_body() in README.read_text(), "docs/deployment.md's HAProxy block differs from examples/haproxy.cfg "
                                                    "(copy the file without its leading comment)")


async def part_haproxy(rules):
    redis = await harness.RedisServer().astart()
    apps = [await harness.FakeApp().start(), await harness.FakeApp().start()]
    proxy = None
    try:
        args = ["--rules", rules, "--auth", "header", "--user-header", "X-User-Id"]
        cfgs = [harness.state_config({"app": harness.app_upstream(app, "/state", idle_timeout_ms=10000)}, "app", store=redis.url)
                for app in apps]
        async with harness.Gateway(args, cfgs[0], name="gateway-1") as g1, \
                harness.Gateway(args, cfgs[1], name="gateway-2") as g2:
            gws = [g1, g2]
            names = ["gw1", "gw2"]
            proxy = await HAProxy([g1.port, g2.port]).start()
            await wait_status(proxy, "gw1", "UP", 10)
            await wait_status(proxy, "gw2", "UP", 10)

            with step("a chatgate.v1 client through HAProxy: hello (subprotocol chatgate.v1), then done"):
                c = await connect(proxy, "first|user")
                turn = await c.message("hello through haproxy", mid="h1", room="r")
                turn.expect_done()
                check(turn.terminal.get("text") == harness.state_reply_text("hello through haproxy"),
                      f"done text: {harness.brief(turn.terminal)}")
                await c.close()

            with step("ten users through HAProxy: both gateways serve; a user's connections stay on one gateway"):
                users = [f"user{n}@example.com" for n in range(10)]
                home = {}
                for n, user in enumerate(users):
                    for k in range(2):  # two connections of the user, one after the other
                        c = await connect(proxy, user)
                        mid = f"u{n}c{k}"
                        (await c.message(f"hi from {user}", mid=mid, room="trip")).expect_done()
                        where = served_by(apps, mid)
                        check(where is not None, f"no app got {mid}")
                        check(home.setdefault(user, where) == where,
                              f"{user}'s second connection went to {names[where]}, its first to {names[home[user]]}")
                        await c.close()
                ms = [await metrics(gw) for gw in gws]
                counts = [m.value("chatgate_messages_total") for m in ms]
                check(all(n > 0 for n in counts), f"chatgate_messages_total per gateway: {counts}")
                per_gw = [sorted(u for u, w in home.items() if w == i) for i in range(2)]
                print(f"   users per gateway: {[len(p) for p in per_gw]}; messages per gateway {counts}")

            with step("SIGTERM of a user's gateway: /healthz 503 while a reply drains, HAProxy marks it down; "
                      "the user reconnects through HAProxy at once, lands on the other gateway, dialog intact"):
                x = 0 if len(per_gw[0]) >= 2 else 1
                check(len(per_gw[x]) >= 2, f"users per gateway {per_gw}: need two on one gateway")
                other = 1 - x
                user, busy_user = per_gw[x][0], per_gw[x][1]
                cu = await connect(proxy, user)
                directive = '{"service":"travel","params":{"to":"Lisbon","pax":2}}'
                (await cu.message(f"book it STATE:{directive}", mid="p1", room="trip")).expect_done()
                check(served_by(apps, "p1") == x, "the user's connection moved before the test stopped its gateway")
                cb = await connect(proxy, busy_user)
                await cb.send_message("a long one [delay=5]", "long1", "trip")
                await apps[x].wait_message("long1", timeout=5)  # in flight on gateway x: it will drain

                gws[x].send_signal(signal.SIGTERM)
                stopped_at = time.monotonic()
                deadline = time.monotonic() + 3  # the signal is handled on the gateway's loop, soon after
                while True:
                    status, _, body = await asyncio.to_thread(harness.http_get, gws[x].http_url + "/healthz")
                    if status == 503 or time.monotonic() > deadline:
                        break
                    await asyncio.sleep(0.02)
                check(status == 503, f"/healthz of the draining gateway: HTTP {status} {body!r}")

                # The old connection refuses new messages while draining: the client reconnects.
                await cu.send_message("and a hotel", "p2", "trip")
                err = await cu.expect_error("internal", mid="p2")
                check("reconnect" in (err.get("message") or ""), f"the refusal should say reconnect: {harness.brief(err)}")
                await cu.close()
                states = await proxy.servers()
                cu = await connect(proxy, user)  # at once: HAProxy may still think gateway x is up
                state = await harness.context_command(cu, "context.get", "trip")
                check(state.get("params", {}).get("travel") == {"to": "Lisbon", "pax": 2},
                      f"the dialog's params on the other gateway: {harness.brief(state.get('params'))}")
                said = [m.get("content") for m in state.get("history") or [] if m.get("role") == "user"]
                check(any(c and c.startswith("book it") for c in said),
                      f"the dialog's history on the other gateway: {harness.brief(state.get('history'))}")
                (await cu.message("and a hotel", mid="p3", room="trip")).expect_done()
                check(served_by(apps, "p3") == other, f"p3 went to {names[served_by(apps, 'p3')]}")
                redispatched = int((await proxy.stats())["BACKEND"].get("wredis") or 0)
                if states.get(names[x], ("",))[0] == "UP":  # sent to the draining gateway first
                    check(redispatched >= 1, f"HAProxy redispatched nothing (wredis {redispatched}), yet "
                                             f"{names[x]} was UP when the user reconnected")
                forwarded = apps[other].message_frame("p3")
                check((forwarded.get("params") or {}).get("to") == "Lisbon",
                      f"the other gateway forwarded params {harness.brief(forwarded.get('params'))}")
                print(f"   reconnected {time.monotonic() - stopped_at:.2f} s after SIGTERM "
                      f"(HAProxy then: {names[x]} {states.get(names[x])}), served by {names[other]}; "
                      f"requests redispatched: {redispatched}")

                down = await wait_status(proxy, names[x], "DOWN", 6)
                down_after = time.monotonic() - stopped_at
                check(gws[x].alive(), f"{names[x]} exited before HAProxy's check saw its 503 (after {down_after:.1f} s)")
                check("503" in (down[1] or "") or down[1] in ("L7STS",),
                      f"HAProxy's check status for {names[x]}: {down}")
                turn = await cb.collect_turn("long1", 10)
                turn.expect_done()
                code = await gws[x].await_exit(12)
                check(code == 0, f"{names[x]} exit status after SIGTERM: {code}")
                async def checked_closed():  # a check against the closed port: a layer-4 failure
                    row = (await proxy.servers())[names[x]]
                    return row if (row[1] or "").startswith("L4") else None
                gone = await harness.wait_condition(checked_closed, 6, f"no HAProxy check of {names[x]} "
                                                    "met its closed port")
                check(gone[0].startswith("DOWN"), f"HAProxy after the gateway exited: {gone}")
                check((await proxy.servers())[names[other]][0] == "UP", "the other gateway should stay UP")
                print(f"   {names[x]} marked DOWN {down_after:.1f} s after SIGTERM ({down[1]}) while draining; "
                      f"after exit: {gone[1]}")
                await cu.close()
                await cb.close()
    finally:
        if proxy:
            if harness._failures:
                print(f"--- haproxy log ({proxy.log_path}):\n{proxy.log_text()[-2000:]}")
            proxy.stop()
        for app in apps:
            await app.stop()
        redis.cleanup(keep=True)


async def main(args):
    rules = harness.empty_rules_dir()
    for part in (part_readme_shows_example, part_haproxy):
        await harness.independent(part(rules))


if __name__ == "__main__":
    harness.run(main, timeout=85)
