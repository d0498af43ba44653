"""End-to-end test of the Redis store over TLS and with ACL users (issue 36; redis_topo.py's
real servers: Debian's redis-server 7.0 with TLS, certificates made by the openssl CLI, one
CertFactory for the whole run).

Every gateway runs the demo upstream with --store rediss://..., rediss-sentinel://... or
rediss-cluster://... (or redis:// with USER:PASSWORD@) and the redis.tls_* config keys. What
is in Redis is read through each server's plain inspection port, never through the gateway.
1. rediss:// to a TLS Redis trusting the test CA (redis.tls_ca_file): two messages of one
   dialog get done, the second sees the first exchange ("History: 2 earlier messages"), the
   dialog's history list is in that Redis; /healthz ok, chatgate_store_degraded 0.
2. Refused certificates, one gateway each: the wrong CA in tls_ca_file, no tls_ca_file at
   all (the system's CAs do not know the test CA), an expired certificate, a certificate for
   another name (URL host localhost: hostname mismatch; URL host 127.0.0.1: IP address
   mismatch), and tls_server_name naming another host than the good certificate's. Each:
   one warning naming the reason (expired / unable to get local issuer / hostname mismatch /
   IP address mismatch, with its hint), the store degraded (/healthz and the metric),
   messages still answered from memory with a store_degraded warning and their context, and
   nothing written to that Redis.
2b. Accepted: the wrong-name certificate with tls_server_name "wrong.example", the wrong CA
   with tls_verify false, and rediss://127.0.0.1 (the certificate's IP address): connected,
   the dialog written.
3. Mutual TLS (tls-auth-clients yes): without redis.tls_cert_file the handshake is refused,
   over TLS 1.3 (Redis's default: the refusal comes as an alert after the client's side of
   the handshake) and over TLS 1.2: degraded, "TLS handshake failed: <OpenSSL's text>"; a
   client certificate of the wrong CA is refused too (degraded; the reason is not pinned:
   Redis may reset the connection before its alert is read); with tls_cert_file and
   tls_key_file it works.
4. ACL users: redis://USER:PASSWORD@ to a plain Redis: connected as that user (CLIENT LIST
   says user=USER), the dialog written; a wrong password, to a Redis whose default user needs
   a password (PING answered -NOAUTH) and to one whose default user is open (the failed AUTH
   must not leave the gateway writing as the default user): degraded, AUTH's -WRONGPASS
   logged, nothing written, the password never logged; the ACL user over TLS
   (rediss://USER:PASSWORD@localhost:TLSPORT) works.
5. rediss-sentinel://: a TLS primary and three TLS Sentinels, asked over TLS: messages done,
   the dialog on the primary, the gateway subscribed to +switch-master.
6. rediss-cluster:// (3 masters, 3 replicas, TLS on clients, bus and replication): twelve
   users' messages done, each dialog on the master of its user's slot, and the dialogs spread
   over more than one master.
7. The store and redis.bus each with their own scheme: a plain store with a rediss:// bus,
   and a rediss:// store with a plain bus (one server, its plain and TLS ports): the dialog
   written, and the bus subscribed on the port of its own scheme (CLIENT LIST's laddr). The
   TLS of one used to be the other's too: the plain one then spoke TLS to a plain port.

The Sentinel topology and the cluster start in the background at the beginning (they take
seconds), while steps 1-4 run.
"""

import asyncio
import contextlib
import json
import re
import time

import harness
from harness import Client, check, independent, step
from redis_topo import CertFactory, RedisCluster, TLSRedisServer, TLSSentinel, acl_user, sentinel_url, wait_for

USER, PASSWORD = "gwuser", "s3cret-acl"
DEGRADED_LINE = r"redis (\S+): (.*); serving dialogs from memory until it is back"
CONNECTED_LINE = r"redis (\S+): connected"
NO_CA_HINT = "(no CA of redis.tls_ca_file, or of the system's, signed it)"
NAME_HINT = "(it is not for the host of the URL, or redis.tls_server_name)"


# --------------------------------------------------------------------------------------
# helpers


def store_config(store, **redis):
    """The demo upstream (its reply counts the history it was given) and `store`, with the
    redis.* keys `redis` (tls_ca_file...)."""
    return harness.state_config({"demo": harness.demo_upstream()}, "demo", store=store, redis=redis)


async def all_of(*parts):
    """Run the parts (coroutines) at once; fail naming every one that failed."""
    results = await asyncio.gather(*parts, return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    for err in errors:
        if not isinstance(err, harness.TestFailure):
            raise err
    if errors:
        harness.fail(f"{len(errors)} of {len(parts)} failed:\n" + "\n".join(f"* {e}" for e in errors))
    return results


async def poll(what, predicate, timeout, state=None):
    """redis_topo.wait_for off the event loop (its predicate may ask Redis): until predicate()
    is true, its value; fails after `timeout` s naming `what` and state() if given."""
    return await asyncio.to_thread(wait_for, what, predicate, timeout, state)


async def wait_log(gw, pattern, timeout=8.0):
    """The first match of `pattern` in gw's log, waiting up to `timeout` s."""
    rx = re.compile(pattern)
    deadline = time.monotonic() + timeout
    while True:
        m = rx.search(gw.log_text())
        if m:
            return m
        gw.assert_alive()
        if time.monotonic() > deadline:
            harness.fail(f"{gw.name}: no log line matching {pattern!r} within {timeout:.0f} s")
        await asyncio.sleep(0.05)


def metrics_now(gw):
    status, _, body = harness.http_get(gw.http_url + "/metrics")
    check(status == 200, f"{gw.name}: /metrics answered {status}")
    return harness.parse_metrics(body.decode())


def healthz_now(gw):
    status, _, body = harness.http_get(gw.http_url + "/healthz")
    check(status == 200, f"{gw.name}: /healthz answered {status}: {body[:200]!r}")
    return json.loads(body)


async def store_health(gw):
    """(chatgate_store_degraded, /healthz status)."""
    m = await asyncio.to_thread(metrics_now, gw)
    h = await asyncio.to_thread(healthz_now, gw)
    return m.value("chatgate_store_degraded"), h.get("status")


def history_of(redis, user, room):
    """The dialog's history list in `redis` (the inspection client), [] if absent."""
    key = redis.find_key(harness.dialog_key(user, room, "history"))
    return redis.lrange(key) if key else []


def chatgate_keys(redis):
    return redis.keys("chatgate:*")


async def conversation(gw, room="tls", degraded=False):
    """Two messages of one dialog on a new connection: both done, the second given the first
    exchange as history. With `degraded`, the dialog gets exactly one store_degraded warning
    (one per dialog and outage); without, none. The user's id."""
    c = await Client.connect(gw)
    try:
        first = (await c.message("first message", mid="m1", room=room)).expect_done()
        second = (await c.message("second message", mid="m2", room=room)).expect_done()
    finally:
        await c.close()
    t1, t2 = first.terminal.get("text", ""), second.terminal.get("text", "")
    check("History: 0 earlier messages" in t1, f"{gw.name}: the first reply: {t1!r}")
    check("History: 2 earlier messages" in t2,
          f"{gw.name}: the second message of the dialog did not get the first exchange: {t2!r}")
    codes = [w.get("code") for t in (first, second) for w in t.warnings]
    if degraded:
        check(codes == ["store_degraded"],
              f"{gw.name}: expected one store_degraded warning with the store degraded, got {codes}")
    else:
        check(not codes, f"{gw.name}: warnings with Redis up: {codes}")
    return c.hello["user"]


async def expect_connected(gw, redis, room="tls"):
    """gw reaches `redis`: connected in its log, not degraded (metric and /healthz), a dialog
    of two exchanges written there (its history list, read through the plain port). The
    user's id."""
    await wait_log(gw, CONNECTED_LINE)
    degraded = re.search(DEGRADED_LINE, gw.log_text())
    check(not degraded, f"{gw.name}: degraded before it connected: {degraded and degraded.group(0)}")
    check(await store_health(gw) == (0, "ok"), f"{gw.name}: (store_degraded, /healthz) = {await store_health(gw)}")
    user = await conversation(gw, room)
    await poll(f"{gw.name}: the dialog's history (4 messages) is in Redis",
               lambda: len(history_of(redis, user, room)) == 4, 5, lambda: history_of(redis, user, room))
    texts = [json.loads(m).get("content") for m in history_of(redis, user, room)]
    check(texts[0] == "first message" and texts[2] == "second message",
          f"{gw.name}: the history in Redis: {texts}")
    return user


async def expect_refused(gw, redis, wants):
    """gw refused `redis`: one warning naming every text of `wants` (the reason), degraded
    (metric and /healthz), messages answered from memory with their context, nothing in
    Redis, never "connected". The warning's reason."""
    m = await wait_log(gw, DEGRADED_LINE)
    # the first reason may be another (a slow start under a sanitizer times the connect out):
    # each new reason is logged once ("still away: ..."), so wait for the one that names it
    deadline = time.monotonic() + 8
    while True:
        reasons = [x.group(2) for x in re.finditer(DEGRADED_LINE, gw.log_text())] + \
                  re.findall(r"redis \S+: still away: (.*)", gw.log_text())
        named = [r for r in reasons if all(w in r for w in wants)]
        if named or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
    check(named, f"{gw.name}: no warning says {wants}: {reasons}")
    reason = named[0]
    check(await store_health(gw) == (1, "degraded"),
          f"{gw.name}: (store_degraded, /healthz) = {await store_health(gw)}, expected (1, 'degraded')")
    await conversation(gw, "refused", degraded=True)
    check(await store_health(gw) == (1, "degraded"), f"{gw.name}: no longer degraded: {await store_health(gw)}")
    keys = await asyncio.to_thread(chatgate_keys, redis)
    check(not keys, f"{gw.name}: keys written to the Redis it refused: {keys}")
    connected = re.search(CONNECTED_LINE, gw.log_text())
    check(not connected, f"{gw.name}: it connected anyway: {connected and connected.group(0)}")
    return reason


async def gateway(rules, store, name, **redis):
    return await harness.Gateway(["--rules", rules], store_config(store, **redis), name=name).astart()


async def with_gateway(rules, store, name, redis_cfg, body):
    """Start a gateway, run `body(gw)`, stop it; a failure gets the end of its log (and
    harness.run stops it)."""
    gw = await gateway(rules, store, name, **redis_cfg)
    try:
        result = await body(gw)
    except harness.TestFailure as err:
        gw.failed = True
        raise harness.TestFailure(f"{err}\n{gw.log_tail(10)}") from None
    await gw.astop()
    return result


def tls_url(server, host="localhost", auth=""):
    return f"rediss://{auth}{host}:{server.tls_port}"


# --------------------------------------------------------------------------------------
# parts


async def tls_basic(certs, rules):
    with step("1. rediss:// with redis.tls_ca_file: done, history seen, the dialog in that Redis"):
        redis = await TLSRedisServer(certs).astart()
        user = await with_gateway(rules, tls_url(redis), "gw-tls", {"tls_ca_file": certs.ca},
                                  lambda gw: expect_connected(gw, redis))
        keys = chatgate_keys(redis)
        mine = [k for k in keys if k.startswith(f"chatgate:{{{harness.escape_id(user)}}}:")]
        check(mine and mine == keys, f"the keys in Redis are not all of user {user}: {keys}")
        print(f"   keys in Redis: {keys}", flush=True)


async def refusals(certs, rules):
    with step("2. refused certificates (wrong CA, no CA, expired, wrong name, wrong IP, wrong "
              "tls_server_name): degraded, answered from memory, nothing written, the reason logged"):
        good = TLSRedisServer(certs)
        no_ca = TLSRedisServer(certs)
        expired = TLSRedisServer(certs, cert="expired")
        wrong_name = TLSRedisServer(certs, cert="wrong_name")
        wrong_ip = TLSRedisServer(certs, cert="wrong_name")
        other_name = TLSRedisServer(certs)
        servers = [good, no_ca, expired, wrong_name, wrong_ip, other_name]
        await all_of(*(s.astart() for s in servers))
        issuer = ("unable to get local issuer certificate", "self-signed certificate in certificate chain")

        async def refused(server, name, cfg, wants, url=None, alternatives=()):
            async def body(gw):
                reason = await expect_refused(gw, server, wants)
                if alternatives:
                    check(any(a in reason for a in alternatives),
                          f"{gw.name}: the reason says none of {alternatives}: {reason}")
                return name, reason
            return await with_gateway(rules, url or tls_url(server), name, cfg, body)

        reasons = await all_of(
            refused(good, "gw-wrong-ca", {"tls_ca_file": certs.wrong_ca}, [NO_CA_HINT], alternatives=issuer),
            refused(no_ca, "gw-no-ca", {}, [NO_CA_HINT], alternatives=issuer),
            refused(expired, "gw-expired", {"tls_ca_file": certs.ca},
                    ["its TLS certificate was refused: certificate has expired"]),
            refused(wrong_name, "gw-wrong-name", {"tls_ca_file": certs.ca},
                    ["its TLS certificate was refused: hostname mismatch", NAME_HINT]),
            refused(wrong_ip, "gw-wrong-ip", {"tls_ca_file": certs.ca},
                    ["its TLS certificate was refused: IP address mismatch", NAME_HINT],
                    url=tls_url(wrong_ip, "127.0.0.1")),
            refused(other_name, "gw-other-server-name", {"tls_ca_file": certs.ca, "tls_server_name": "other.example"},
                    ["its TLS certificate was refused: hostname mismatch", NAME_HINT]))
        for name, reason in reasons:
            print(f"   {name}: {reason}", flush=True)

    with step("2b. accepted: wrong-name certificate with tls_server_name wrong.example; "
              "the wrong CA with tls_verify false; rediss://127.0.0.1 (the IP in the certificate)"):
        named = TLSRedisServer(certs, cert="wrong_name")
        unverified = TLSRedisServer(certs)
        by_ip = TLSRedisServer(certs)
        await all_of(named.astart(), unverified.astart(), by_ip.astart())
        await all_of(
            with_gateway(rules, tls_url(by_ip, "127.0.0.1"), "gw-by-ip", {"tls_ca_file": certs.ca},
                         lambda gw: expect_connected(gw, by_ip)),
            with_gateway(rules, tls_url(named), "gw-server-name",
                         {"tls_ca_file": certs.ca, "tls_server_name": "wrong.example"},
                         lambda gw: expect_connected(gw, named)),
            with_gateway(rules, tls_url(unverified), "gw-no-verify",
                         {"tls_ca_file": certs.wrong_ca, "tls_verify": False},
                         lambda gw: expect_connected(gw, unverified)))


class TLS12RedisServer(TLSRedisServer):
    """A TLSRedisServer that speaks TLS 1.2 only: a client certificate is asked for, and
    refused, inside the handshake (in TLS 1.3 the client's handshake is over before the
    server has looked at its certificate)."""

    def command_line(self):
        return super().command_line() + ["--tls-protocols", "TLSv1.2"]


async def mutual_tls(certs, rules):
    with step("3. mutual TLS: no client certificate (TLS 1.3 and 1.2), or the wrong CA's, refused; "
              "with tls_cert_file and tls_key_file it works"):
        bare = TLSRedisServer(certs, tls_auth_clients="yes")
        bare12 = TLS12RedisServer(certs, tls_auth_clients="yes")
        foreign = TLSRedisServer(certs, tls_auth_clients="yes")
        mutual = TLSRedisServer(certs, tls_auth_clients="yes")
        await all_of(*(s.astart() for s in (bare, bare12, foreign, mutual)))
        ca = {"tls_ca_file": certs.ca}

        async def refused(gw, server, wants):
            return await expect_refused(gw, server, wants)

        reasons = await all_of(
            with_gateway(rules, tls_url(bare), "gw-no-client-cert", ca,
                         lambda gw: refused(gw, bare, ["TLS handshake failed: "])),
            with_gateway(rules, tls_url(bare12), "gw-no-client-cert-tls12", ca,
                         lambda gw: refused(gw, bare12, ["TLS handshake failed: "])),
            # Redis may reset the connection before its alert is read: the reason is not pinned.
            with_gateway(rules, tls_url(foreign), "gw-wrong-client-cert",
                         dict(ca, tls_cert_file=certs.wrong_client_cert, tls_key_file=certs.wrong_client_key),
                         lambda gw: refused(gw, foreign, [])),
            with_gateway(rules, tls_url(mutual), "gw-client-cert",
                         dict(ca, tls_cert_file=certs.client_cert, tls_key_file=certs.client_key),
                         lambda gw: expect_connected(gw, mutual)))
        for what, reason in zip(("TLS 1.3, no client certificate", "TLS 1.2, no client certificate",
                                 "the wrong CA's client certificate"), reasons):
            print(f"   {what}: {reason}", flush=True)


def clients_of(redis, user):
    """The connections CLIENT LIST shows for ACL user `user`."""
    return [line for line in redis.command("CLIENT", "LIST").splitlines() if f" user={user} " in line]


async def acl_users(certs, rules):
    with step("4. ACL user redis://USER:PASSWORD@: works as that user; wrong passwords degrade "
              "(NOAUTH, and an open default user); ACL user over rediss://"):
        plain = harness.RedisServer()
        locked = harness.RedisServer(password="admin-pw")  # the default user needs a password
        open_default = harness.RedisServer()  # the default user is open (nopass)
        tls = TLSRedisServer(certs)
        servers = [plain, locked, open_default, tls]
        await all_of(*(s.astart() for s in servers))
        for s in servers:
            acl_user(s, USER, PASSWORD)

        async def as_user(gw, server):
            await expect_connected(gw, server)
            used = await asyncio.to_thread(clients_of, server, USER)
            check(used, f"{gw.name}: no connection of user {USER} in CLIENT LIST: "
                        f"{server.command('CLIENT', 'LIST')}")
            check(PASSWORD not in gw.log_text(), f"{gw.name}: the password is in the log")

        async def wrong(gw, server, wants):
            reason = await expect_refused(gw, server, wants)
            auth = re.search(r"AUTH failed: (.*)", gw.log_text())
            check(auth and "WRONGPASS" in auth.group(1), f"{gw.name}: AUTH's -WRONGPASS not logged")
            check("wrong-pw" not in gw.log_text(), f"{gw.name}: the password is in the log")
            return reason

        reasons = await all_of(
            with_gateway(rules, f"redis://{USER}:{PASSWORD}@127.0.0.1:{plain.port}", "gw-acl", {},
                         lambda gw: as_user(gw, plain)),
            with_gateway(rules, f"redis://{USER}:wrong-pw@127.0.0.1:{locked.port}", "gw-acl-wrong", {},
                         lambda gw: wrong(gw, locked, ["the connection's PING was answered 'NOAUTH"])),
            with_gateway(rules, f"redis://{USER}:wrong-pw@127.0.0.1:{open_default.port}", "gw-acl-wrong-open",
                         {}, lambda gw: wrong(gw, open_default, [])),
            with_gateway(rules, tls_url(tls, auth=f"{USER}:{PASSWORD}@"), "gw-acl-tls",
                         {"tls_ca_file": certs.ca}, lambda gw: as_user(gw, tls)))
        print(f"   wrong password: {reasons[1]}", flush=True)
        print(f"   wrong password, open default user: {reasons[2]}", flush=True)


async def start_sentinels(certs):
    """A TLS primary and three TLS Sentinels monitoring it (started in a thread)."""
    primary = TLSRedisServer(certs)
    sentinels = [TLSSentinel(primary, certs) for _ in range(3)]

    def start():
        primary.start()
        for s in sentinels:
            s.start()
    await asyncio.to_thread(start)
    return primary, sentinels


async def tls_sentinel(topology, certs, rules):
    with step("5. rediss-sentinel://: the TLS Sentinels name the TLS primary; done, written there"):
        primary, sentinels = await topology
        url = sentinel_url(sentinels)

        async def body(gw):
            await expect_connected(gw, primary)
            await wait_log(gw, r"redis sentinel \S+: following failovers of 'mymaster'")
            check(f"the primary of 'mymaster' is 127.0.0.1:{primary.tls_port}" in gw.log_text(),
                  f"{gw.name}: no Sentinel named the primary's TLS port {primary.tls_port}")
        await with_gateway(rules, url, "gw-sentinel", {"tls_ca_file": certs.ca}, body)


async def tls_cluster(cluster, started, certs, rules, users=12):
    with step(f"6. rediss-cluster://: {users} users' dialogs done, each on its slot's master, "
              "spread over the masters"):
        await started
        print(f"   cluster of {len(cluster.nodes)} nodes created in {cluster.timings['create']:.2f} s", flush=True)

        async def body(gw):
            await wait_log(gw, CONNECTED_LINE)
            clients = await all_of(*(Client.connect(gw) for _ in range(users)))
            try:
                async def talk(c):
                    t = (await c.message("hello cluster", mid="c1", room="cl")).expect_done()
                    check(not t.warnings, f"{gw.name}: warnings with the cluster up: {t.warnings}")
                    return c.hello["user"]
                ids = await all_of(*(talk(c) for c in clients))
            finally:
                for c in clients:
                    await c.close()

            def placement():
                where = {}
                for u in ids:
                    key = harness.dialog_key(u, "cl", "history")
                    owner = cluster.master_of_slot(cluster.key_slot(key))
                    if len(owner.lrange(key)) != 2:
                        return None
                    where[u] = owner.port
                return where
            where = await poll(f"{gw.name}: every dialog on the master of its slot",
                               placement, 5, lambda: {m.port: len(chatgate_keys(m)) for m in cluster.masters()})
            per_master = {m.port: len(m.keys("chatgate:*:history")) for m in cluster.masters()}
            check(sum(per_master.values()) == users, f"{gw.name}: history keys per master: {per_master}")
            check(sum(1 for n in per_master.values() if n) > 1,
                  f"{gw.name}: every dialog on one master: {per_master} ({where})")
            m = await asyncio.to_thread(metrics_now, gw)
            check(m.value("chatgate_store_degraded") == 0, f"{gw.name}: store degraded with the cluster up")
            print(f"   history keys per master (plain port: count): {per_master}", flush=True)
        try:
            await with_gateway(rules, cluster.seeds_url(), "gw-cluster", {"tls_ca_file": certs.ca}, body)
        finally:
            cluster.stop()


def subscribers_on(redis, port):
    """The connections CLIENT LIST shows subscribed (sub=N>0) through local port `port`."""
    return [line for line in redis.command("CLIENT", "LIST").splitlines()
            if f" laddr=127.0.0.1:{port} " in f" {line} " and not re.search(r" sub=0 ", f" {line} ")
            and " sub=" in line]


async def mixed_schemes(certs, rules):
    with step("7. a plain store with a rediss:// redis.bus, and a rediss:// store with a plain bus: each "
              "connection speaks its own URL's scheme"):
        redis = await TLSRedisServer(certs).astart()
        for store, bus, bus_port in ((redis.plain_url, tls_url(redis), redis.tls_port),
                                     (tls_url(redis), redis.plain_url, redis.port)):
            name = "gw-plain-store" if store == redis.plain_url else "gw-tls-store"

            async def body(gw):
                await expect_connected(gw, redis, room=name)
                subs = await poll(f"{gw.name}: the bus subscribed on port {bus_port}",
                                  lambda: subscribers_on(redis, bus_port), 5,
                                  lambda: redis.command("CLIENT", "LIST"))
                print(f"   {gw.name}: bus subscribed through port {bus_port}: {len(subs)} connection(s)", flush=True)
            await with_gateway(rules, store, name, {"tls_ca_file": certs.ca, "bus": bus}, body)
            redis.command("FLUSHALL")


async def main(args):
    rules = harness.empty_rules_dir()
    started = time.monotonic()
    certs = CertFactory()
    print(f"certificates made in {time.monotonic() - started:.2f} s ({certs.dir})", flush=True)
    # The slow topologies start now, in threads, while steps 1-4 run.
    cluster = RedisCluster(tls=certs)
    cluster_started = asyncio.create_task(cluster.astart())
    sentinels = asyncio.create_task(start_sentinels(certs))
    try:
        await independent(tls_basic(certs, rules))
        await independent(refusals(certs, rules))
        await independent(mutual_tls(certs, rules))
        await independent(acl_users(certs, rules))
        await independent(tls_sentinel(sentinels, certs, rules))
        await independent(tls_cluster(cluster, cluster_started, certs, rules))
        await independent(mixed_schemes(certs, rules))
    finally:
        for task in (cluster_started, sentinels):
            if not task.done():
                task.cancel()
            # what a background start raised, its step reported already
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await task
        cluster.stop()


if __name__ == "__main__":
    harness.run(main, timeout=60)
