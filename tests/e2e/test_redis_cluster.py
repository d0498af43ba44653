"""End-to-end test of the Redis store on a whole Redis Cluster (issue 36): two gateways with
--store redis-cluster://SEEDS in front of a 6-node cluster (3 masters, 3 replicas, made by
redis_topo.RedisCluster from Debian's redis-server 7.0), users u0..u49 spread over both.

1. Routing: 50 clients send a few messages each: every message gets exactly one terminal
   frame, done; each user's keys are on the master that owns the user's slot (CLUSTER KEYSLOT
   of the hash tag), all three masters hold some; 0 store errors; no CROSSSLOT in the gateway
   logs nor in any master's INFO errorstats.
2. Master failover under traffic: the 50 clients keep sending (one message at a time each);
   kill -9 of the master holding most users, its replica promoted; more traffic after. The
   replicas are stopped and their links to the master cut 0.4 s before the kill, and a quiet
   dialog on that master has one turn then and none after: the promoted replica never got
   it, and only the gateways' rewrite of what they saved lately brings it back. Per
   message: answered once (done or error, counted apart), lost (no terminal frame), duplicated.
   Once both gateways settled (store_degraded 0, writeback_pending 0), each dialog's history
   in the cluster: every answered user message exactly once and in the order sent. A turn may
   be missing only if Redis's asynchronous replication lost it: its done came in the last
   second before the kill and its dialog was on the killed master (counted, printed); any
   other missing turn, one answered after the failover included, fails the test. One
   master's outage is its slots' alone: no gateway is degraded as a whole (store_degraded
   polled every 50 ms stays 0). Run twice: with Redis's default cluster-require-full-coverage
   yes (every master refuses, CLUSTERDOWN, from the cluster's verdict to the promotion), and
   near the end with no, where no user whose slot is on another master is told
   store_degraded.
3. Reshard during traffic: ~2000 slots move from one master to another (redis-cli --cluster
   reshard) while the clients send: MOVED met and followed (chatgate_store_cluster_redirects_total
   {kind="moved"} > 0), every message done once, no history missing. Then ASK made on purpose:
   a user's slot put in MIGRATING/IMPORTING by hand (CLUSTER SETSLOT) with its keys MIGRATEd,
   a message of that user sent (ASK > 0 counted), the migration finished: the message ends
   done and its dialog is whole on the new owner.
4. Cancel across gateways: a reply streaming on gateway A, the same user's cancel phrase on
   gateway B: A's client gets cancelled within 1 s (sharded pub/sub: each gateway's channel
   SSUBSCRIBEd at its slot's master, after the failover and the reshard above), counted in A's
   chatgate_store_remote_cancels_total.
5. One turn of a dialog at a time: two tabs of one user, one on each gateway, send back to back
   into one room: the upstream never has two requests of that dialog at once, and the gateways
   counted lease waits (the slowest wait is printed: a waiting gateway polls the lease).
6. Cancel across gateways with the bus message lost (every SSUBSCRIBE connection killed just
   before the phrase; redis.lease_ms 3000 on a third and fourth gateway): the holder's lease
   renewal takes the cancel flag and stops the reply within a third of redis.lease_ms.
7. Gateway A's bus channel's slot moved to another master by hand (no traffic meanwhile): A
   SSUBSCRIBEs again at the new owner within 5 s, and a cancel phrase on B still stops A's reply.
8. The failover of 2 again, another master, with cluster-require-full-coverage no on every
   node: the same checks, and no user whose slot is on another master is told store_degraded.
9. Commands parked on TRYAGAIN (a slot MIGRATING by hand, its keys moved) when the cluster
   router closes (CLIENT KILL of the gateways' connections on the masters): the gateway
   survives, the message is answered, the dialog is written back once the slot has moved.
10. The failover of 2 once more, the last master with a replica stopped (SIGSTOP: its
   connections open, nothing answered) instead of killed, cluster-require-full-coverage no:
   the command timeout drops that master alone; the same checks as 8.
11. The user's profile (issue 40): "call me Zed" on one gateway (the shipped rules' remember,
   the update script routed to the user's slot), read with profile.get on the other; its key
   is on the master of the user's slot alone.

Every client frame goes through harness.FrameTracker (ack first, one terminal frame, done.text
the deltas). Run: python3 tests/e2e/test_redis_cluster.py --gateway build/chatgate (about 45 s);
CG_E2E_PARTS=0,1 runs parts 1 and 2 only (numbered from 0).
"""

import asyncio
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
import redis_topo  # noqa: E402
from harness import Client, check, independent, step  # noqa: E402

import websockets  # noqa: E402

N_USERS = 50
RESHARD_SLOTS = 2000
REPLICATION_WINDOW = 1.0  # s before the kill: a turn saved then may be lost with the master


# ---- the upstream -----------------------------------------------------------------------

class Upstream(harness.FakeOpenAI):
    """FakeOpenAI with behaviour "cl": by the last user message, "SLOW" streams 100 words 100 ms
    apart (cancel), "PACE" 5 words 30 ms apart, else the echo at once. A message's second word
    is its dialog's tag ("user/room"): requests in flight are counted by tag, and each one's
    span (received, answered or closed) kept."""

    def __init__(self):
        super().__init__()
        self.inflight = {}
        self.max_inflight = {}
        self.spans = {}  # tag -> [(start, end, text)]

    def requests_with(self, needle):
        return [r for r in self.requests if needle in str(r.last_user_text)]

    async def _do_cl(self, conn, req):
        text = str(req.last_user_text)
        words = text.split()
        tag = words[1] if len(words) > 1 and "/" in words[1] else None
        start = time.monotonic()
        if tag:
            self.inflight[tag] = self.inflight.get(tag, 0) + 1
            self.max_inflight[tag] = max(self.max_inflight.get(tag, 0), self.inflight[tag])
        try:
            if "SLOW" in text:
                return await self._stream_words(conn, req, 100, 0.1)
            if "PACE" in text:
                return await self._stream_words(conn, req, 5, 0.03)
            return await self._do_script(conn, req)
        finally:
            if tag:
                self.inflight[tag] -= 1
                self.spans.setdefault(tag, []).append((start, time.monotonic(), text))


# ---- clients ----------------------------------------------------------------------------

class Sent:
    """One message sent: who, where, when, and the terminal frames it got."""

    def __init__(self, tab, mid, room, text):
        self.tab = tab
        self.user = tab.user
        self.gw = tab.gw.name
        self.mid = mid
        self.room = room
        self.text = text
        self.sent_at = time.time()
        self.answered_at = None  # time.time() of its first terminal frame

    @property
    def terminals(self):
        return [f for _, f in self.tab.terminals.get(self.mid, [])]

    @property
    def kind(self):
        t = self.terminals
        return t[0].get("type") if t else None

    def __repr__(self):
        return f"{self.mid}({self.user}/{self.room} on {self.gw}: {self.kind})"


class Tab:
    """A client connection of one user on one gateway (header auth). A task of its own reads
    every frame, so each terminal frame of each id is counted (a second one is a duplicate)
    and nothing waits on another message's frames."""

    def __init__(self, client, gw, user):
        self.client = client
        self.ws = client.ws
        self.gw = gw
        self.user = user
        self.terminals = {}  # id -> [(time.time(), frame)]
        self.events = {}
        self.warnings = []
        self.closed = None
        self.sent = []
        self.tracker = harness.FrameTracker()
        self.violations = []  # what the tracker refused (it raises; the reader goes on)
        self.task = asyncio.create_task(self._read())

    @classmethod
    async def open(cls, gw, user):
        client = await Client.connect(gw, expect_user=user, extra_headers={"X-User-Id": user})
        return cls(client, gw, user)

    async def _read(self):
        try:
            async for raw in self.ws:
                frame = json.loads(raw)
                try:
                    self.tracker.feed(frame)
                except harness.TestFailure as err:
                    self.violations.append(f"{self.user} on {self.gw.name}: {err}")
                mid = frame.get("id")
                if harness.is_terminal(frame) and mid is not None:
                    self.terminals.setdefault(mid, []).append((time.time(), frame))
                    if mid in self.events:
                        self.events[mid].set()
                elif frame.get("type") == "warning":
                    self.warnings.append(frame)
        except websockets.ConnectionClosed as err:
            self.closed = err

    async def ask(self, text, mid, room, timeout=20.0):
        """Send a message and wait for its first terminal frame (up to `timeout`): its Sent."""
        s = Sent(self, mid, room, text)
        self.sent.append(s)
        self.events[mid] = asyncio.Event()
        await self.client.send_message(text, mid, room)
        try:
            await asyncio.wait_for(self.events[mid].wait(), timeout)
            s.answered_at = self.terminals[mid][0][0]
        except asyncio.TimeoutError:
            pass
        return s

    async def close(self):
        await self.ws.close()
        await self.task


def tally(sents, tabs, prefix=None):
    """Counts of a load: answered once with done / with error / lost / duplicated, and ids
    never sent (starting with `prefix`, this load's) that got frames."""
    out = {"sent": len(sents), "done": 0, "error": 0, "cancelled": 0, "lost": [], "dup": [], "errors": []}
    for s in sents:
        t = s.terminals
        if not t:
            out["lost"].append(s)
            continue
        if len(t) > 1:
            out["dup"].append(s)
        out[t[0].get("type")] += 1
        if t[0].get("type") == "error":
            out["errors"].append((s.mid, t[0].get("code"), t[0].get("message")))
    ids = {s.mid for s in sents}
    out["violations"] = [v for tab in tabs for v in tab.violations]
    out["unknown"] = [m for tab in tabs for m in tab.terminals
                      if m not in ids and (prefix is None or m.startswith(prefix))]
    return out


def tally_line(t):
    return (f"{t['sent']} messages: {t['done']} done, {t['error']} error, {t['cancelled']} cancelled, "
            f"{len(t['lost'])} lost, {len(t['dup'])} duplicated"
            + (f", protocol violations {t['violations'][:3]}" if t["violations"] else ""))


async def load(tabs, tag, stop, pause=0.02, until_n=None, rooms=4, who=""):
    """Each tab sends, one message at a time, into rooms <tag>0 to <tag><rooms-1> in turn until
    `stop` is set (or `until_n` messages each). `who` tells a user's second tab's messages
    (texts and ids) from its first's, in the same rooms. The Sent of every message."""
    sents = []

    async def one(tab):
        n = 0
        while not stop.is_set() and (until_n is None or n < until_n):
            room = f"{tag}{n % rooms}"
            s = await tab.ask(f"msg {tab.user}{who}/{room} {n}", f"{tag}{who}-{tab.user}-{n}", room)
            sents.append(s)
            n += 1
            await asyncio.sleep(pause)  # the load's pace
    await asyncio.gather(*[one(t) for t in tabs])
    return sents


# ---- gateways, Redis --------------------------------------------------------------------

async def metrics(gw):
    status, _, body = await asyncio.to_thread(harness.http_get, gw.http_url + "/metrics")
    check(status == 200, f"/metrics of {gw.name}: HTTP {status}")
    return harness.parse_metrics(body.decode())


def redirects(m):
    return {k: m.value("chatgate_store_cluster_redirects_total", kind=k)
            for k in ("moved", "ask", "tryagain", "clusterdown")}


STORE_COUNTERS = ["chatgate_store_degraded_seconds_total", "chatgate_store_reconnects_total",
                  "chatgate_store_written_back_total", "chatgate_store_merges_total",
                  "chatgate_store_merged_messages_total", "chatgate_store_save_conflicts_total",
                  "chatgate_store_errors_total", "chatgate_store_lease_waits_total",
                  "chatgate_store_lease_lost_total", "chatgate_store_remote_cancels_total",
                  "chatgate_store_cluster_map_reads_total", "chatgate_store_writeback_dropped_total",
                  "chatgate_store_primary_switches_total"]


async def counters(gws):
    """{gateway name: {counter: value}} of the store's counters and the redirects."""
    out = {}
    for gw in gws:
        m = await metrics(gw)
        c = {}
        for name in STORE_COUNTERS:
            c[name] = sum(m.series(name).values())
        for k, v in redirects(m).items():
            c[f"redirect_{k}"] = v
        out[gw.name] = c
    return out


def delta(after, before):
    return {gw: {k: round(v - before[gw].get(k, 0), 3) for k, v in c.items() if v != before[gw].get(k, 0)}
            for gw, c in after.items()}


def log_problems(gws, marks=None):
    """Every warn/error line each gateway logged since `marks` (log lengths), for reports."""
    out = {}
    for gw in gws:
        text = gw.log_text()[(marks or {}).get(gw.name, 0):]
        # (not the listener's "could not take a new connection": the /metrics polls' noise)
        out[gw.name] = [line for line in text.splitlines()
                        if (" warn " in line or " error " in line) and " listener: " not in line]
    return out


def log_marks(gws):
    return {gw.name: len(gw.log_text()) for gw in gws}


def print_log_problems(problems, limit=6):
    for name, lines in problems.items():
        if lines:
            print(f"   {name}: {len(lines)} warn/error log lines, e.g.:", flush=True)
            for line in lines[:limit]:
                print(f"     | {line[:220]}", flush=True)


def check_no_crossslot(cluster, gws):
    for gw in gws:
        check("CROSSSLOT" not in gw.log_text(), f"{gw.name} logged a CROSSSLOT error")
    for n in cluster.live():
        if n.role() != "master":
            continue
        stats = n.command("INFO", "errorstats")
        check("CROSSSLOT" not in stats, f"master {n.port} answered CROSSSLOT: {stats}")


def errorstats(cluster):
    out = {}
    for n in cluster.live():
        for line in n.command("INFO", "errorstats").splitlines():
            if line.startswith("errorstat_"):
                name, _, rest = line.partition(":")
                kind = name[len("errorstat_"):]
                out[kind] = out.get(kind, 0) + int(rest.split("=")[1].split(",")[0])
    return out


async def settled(gws, timeout=25.0):
    """Until every gateway says store_degraded 0 and writeback_pending 0 (and nothing waits)."""
    deadline = time.monotonic() + timeout
    while True:
        ms = [await metrics(gw) for gw in gws]
        state = {gw.name: (m.value("chatgate_store_degraded"), m.value("chatgate_store_writeback_pending"))
                 for gw, m in zip(gws, ms)}
        if all(v == (0, 0) for v in state.values()):
            return
        check(time.monotonic() < deadline, f"the gateways did not settle within {timeout:.0f} s "
                                           f"(degraded, writeback pending): {state}")
        await asyncio.sleep(0.1)


async def saved(node, user, room, what):
    """Until `node` holds the dialog's history and a lock no turn holds: the turn's save, one
    script that lets the lock go last ("-<ticket>"), has landed (it lands after done)."""
    def landed():
        lock = node.find_key(harness.dialog_key(user, room, "lock"))
        return node.find_key(harness.dialog_key(user, room, "history")) and \
            (not lock or (node.get(lock) or "").startswith("-"))
    await harness.wait_condition(lambda: asyncio.to_thread(landed), 5,
                                 f"{what}: the save of {user}/{room} on {node.port} (its history, no lease)")


def user_slot(cluster, user):
    return cluster.key_slot("{" + harness.escape_id(user) + "}")


def history(cluster, owners, user, room):
    """The dialog's history list (parsed) on the master owning the user's slot."""
    node = owners[user]
    key = harness.dialog_key(user, room, "history")
    return [json.loads(m) for m in node.lrange(key)]


def owners_of(cluster, users):
    """{user: the master owning its slot now}."""
    slots = {u: user_slot(cluster, u) for u in users}
    by_slot = {}
    for s in set(slots.values()):
        by_slot[s] = cluster.master_of_slot(s)
    return {u: by_slot[slots[u]] for u in users}


def check_histories(cluster, sents, excuse=None, one_writer=True):
    """Every done turn's user message is in its dialog's history exactly once, each tab's in
    the order it sent them (a tab's texts share their words but the last), and (`one_writer`:
    each dialog written by one tab, one message at a time) the history's ts never go back. `excuse(sent)`: True when a missing turn may be missing.
    Returns (missing and excused, missing not excused, other problems)."""
    by_dialog = {}
    for s in sents:
        by_dialog.setdefault((s.user, s.room), []).append(s)
    owners = owners_of(cluster, {u for u, _ in by_dialog})
    excused, missing, problems = [], [], []
    shown = 0
    for (user, room), turns in sorted(by_dialog.items()):
        hist = history(cluster, owners, user, room)
        ts = [m.get("ts") for m in hist]
        if one_writer and any(b < a for a, b in zip(ts, ts[1:])):
            problems.append(f"{user}/{room}: history ts go back: {ts}")
        users_said = [m.get("content") for m in hist if m.get("role") == "user"]
        counts = {}
        for c in users_said:
            counts[c] = counts.get(c, 0) + 1
        twice = [c for c, n in counts.items() if n > 1]
        if twice:
            problems.append(f"{user}/{room}: user messages twice in history: {twice[:3]}")
        writers = {}
        for s in turns:
            writers.setdefault(s.text.rsplit(" ", 1)[0], []).append(s.text)
        for ours in writers.values():
            order = [c for c in users_said if c in set(ours)]
            expected = [t for t in ours if t in set(order)]
            if order != expected:
                problems.append(f"{user}/{room}: history order {order} is not the order sent {expected}")
        lacking = [s for s in turns if s.kind == "done" and counts.get(s.text, 0) == 0]
        for s in lacking:
            (excused if excuse and excuse(s) else missing).append(s)
        if lacking and shown < 3:  # what a dialog short of turns holds, for the report
            shown += 1
            sent_n = [t.text.rsplit(" ", 1)[-1] for t in turns]
            held = [c.rsplit(" ", 1)[-1] for c in users_said]
            print(f"   {user}/{room} on {owners[user].port}: sent (n) {sent_n}; its history holds {held}",
                  flush=True)
    return excused, missing, problems


# ---- the parts ---------------------------------------------------------------------------

class World:
    """What the parts share: the cluster, the upstream, the two gateways, the 50 tabs."""

    def __init__(self, cluster, upstream, ga, gb, tabs, config, args):
        self.cluster = cluster
        self.upstream = upstream
        self.ga = ga
        self.gb = gb
        self.gws = [ga, gb]
        self.tabs = tabs
        self.config = config  # for more gateways of the same kind
        self.args = args


async def part_routing(w):
    with step(f"routing: {N_USERS} users over two gateways, 3 messages each: one done per message, each "
              "user's keys on the master of its slot, keys on all three masters, 0 errors, no CROSSSLOT"):
        before = await counters(w.gws)
        stop = asyncio.Event()
        sents = await load(w.tabs, "rt", stop, pause=0, until_n=3)
        t = tally(sents, w.tabs, "rt-")
        print(f"   {tally_line(t)}", flush=True)
        check(t["done"] == len(sents) == 3 * N_USERS and not t["lost"] and not t["dup"] and not t["unknown"]
              and not t["violations"],
              f"{tally_line(t)}; errors {t['errors'][:5]}, lost {t['lost'][:5]}, dup {t['dup'][:5]}")

        def placement():
            masters = w.cluster.masters()
            wrong, per_master = [], {m.port: 0 for m in masters}
            for u in [tab.user for tab in w.tabs]:
                slot = user_slot(w.cluster, u)
                owner = w.cluster.master_of_slot(slot)
                pattern = "chatgate:{" + harness.escape_id(u) + "}:*"
                here = owner.keys(pattern)
                if not here:
                    wrong.append(f"{u} (slot {slot}): no keys on its master {owner.port}")
                for m in masters:
                    if m is not owner and m.keys(pattern):
                        wrong.append(f"{u} (slot {slot}, master {owner.port}): keys on {m.port} too")
                per_master[owner.port] += 1
            return wrong, per_master
        wrong, per_master = await asyncio.to_thread(placement)
        check(not wrong, f"keys not where their slot is: {wrong[:5]}")
        check(len(per_master) == 3 and all(per_master.values()), f"users per master: {per_master}")
        excused, missing, problems = await asyncio.to_thread(check_histories, w.cluster, sents)
        check(not missing and not problems, f"history: missing {missing[:5]}; {problems[:3]}")
        after = await counters(w.gws)
        d = delta(after, before)
        for gw in w.gws:
            check(after[gw.name]["chatgate_store_errors_total"] == 0, f"{gw.name}: store errors {after[gw.name]}")
            check(after[gw.name]["chatgate_store_cluster_map_reads_total"] >= 1, f"{gw.name}: no slot map read")
        await asyncio.to_thread(check_no_crossslot, w.cluster, w.gws)
        print(f"   users per master {per_master}; counters moved: {d}; Redis errorstats "
              f"{await asyncio.to_thread(errorstats, w.cluster)}", flush=True)


async def watch_degraded(gws, stop, seen):
    """Poll store_degraded every 50 ms: seen[gw name] = [(time.time(), value) at each change]."""
    last = {}
    while not stop.is_set():
        for gw in gws:
            try:
                v = (await metrics(gw)).value("chatgate_store_degraded")
            except Exception:  # noqa: BLE001 (a poll lost under load is retried)
                continue
            if last.get(gw.name) != v:
                seen.setdefault(gw.name, []).append((time.time(), v))
                last[gw.name] = v
        await asyncio.sleep(0.05)


async def part_failover(w):
    await failover_round(w, full_coverage=True)


async def part_failover_partial(w):
    await failover_round(w, full_coverage=False)


async def part_failover_stopped(w):
    await failover_round(w, full_coverage=False, pause=True)


async def failover_round(w, full_coverage, pause=False):
    """One master killed (or stopped: SIGSTOP, its connections open and silent) under traffic.
    full_coverage: Redis's default cluster-require-full-coverage yes, with which every master
    refuses (CLUSTERDOWN) from the moment the cluster marks the master failed until its
    replica is promoted; with no, the other masters go on, and so must their users' dialogs."""
    cluster = w.cluster
    setting = "yes" if full_coverage else "no"
    how = "SIGSTOP" if pause else "kill -9"
    with step(f"failover (cluster-require-full-coverage {setting}): {how} of a master while {N_USERS} clients "
              "send (the master's users from a second tab on the other gateway too); every message answered once; history complete (what the killed master took last is written again to its promoted replica); "
              "no gateway degraded as a whole" + ("" if full_coverage else
                                                  "; the other masters' users never told store_degraded")):
        for node in cluster.live():
            out = await asyncio.to_thread(cluster.cli, "CONFIG", "SET", "cluster-require-full-coverage", setting,
                                          node=node)
            check(redis_topo.replies(out) == ["OK"], f"CONFIG SET on {node.port}: {out.stdout}{out.stderr}")
        users = [tab.user for tab in w.tabs]
        owners = await asyncio.to_thread(owners_of, cluster, users)
        counts = {}
        for u, m in owners.items():
            counts[m.port] = counts.get(m.port, 0) + 1
        # a master with a replica to fail over to (an earlier round's promoted one has none)
        victim = max([m for m in cluster.masters() if cluster.replicas_of(m)], key=lambda m: counts.get(m.port, 0))
        victim_users = {u for u, m in owners.items() if m.port == victim.port}
        quiet_user = None
        for i in range(2000):  # a user of its own whose slot is the victim's
            u = f"quiet-{'s' if pause else 'k'}{setting}-{i}"
            if (await asyncio.to_thread(owners_of, cluster, [u]))[u].port == victim.port:
                quiet_user = u
                break
        check(quiet_user, f"no user name found for master {victim.port}'s slots")
        seed_ports = [n.client_port for n in cluster.nodes[:3]]
        print(f"   victim {victim.port} (a seed: {victim.client_port in seed_ports}) holds {len(victim_users)} "
              f"users' slots; replicas {[r.port for r in cluster.replicas_of(victim)]}", flush=True)
        before = await counters(w.gws)
        marks = log_marks(w.gws)
        warned_before = {id(tab): len(tab.warnings) for tab in w.tabs}
        stop, watch_stop = asyncio.Event(), asyncio.Event()
        seen = {}
        watcher = asyncio.create_task(watch_degraded(w.gws, watch_stop, seen))
        tag = "fs" if pause else "fo" if full_coverage else "fp"  # message ids of their own
        # the victim's users also write from a second tab, on the other gateway: two gateways
        # on one dialog through the failover, whose copies must merge (docs/state.md)
        seconds = [await Tab.open(w.gb if tab.gw is w.ga else w.ga, tab.user) for tab in w.tabs
                   if tab.user in victim_users]
        loader = asyncio.create_task(load(w.tabs, tag, stop))
        loader2 = asyncio.create_task(load(seconds, tag, stop, who="+2"))
        try:
            await asyncio.sleep(1.5)  # the scenario: traffic for a while before the master goes
            # replication is asynchronous: the replicas miss the master's last 0.4 s (stopped,
            # their links to it cut, so that nothing waits in their sockets either), which only
            # the gateways' rewrite can bring back
            lagging = [] if pause else cluster.replicas_of(victim)
            for r in lagging:
                r.pause()
            if lagging:
                out = await asyncio.to_thread(cluster.cli, "CLIENT", "KILL", "TYPE", "replica", node=victim)
                check(redis_topo.replies(out) and int(redis_topo.replies(out)[0]) >= 1,
                      f"CLIENT KILL TYPE replica on {victim.port}: {out.stdout}{out.stderr}")
                # a quiet dialog on the victim: one turn now, then none through the failover,
                # so no turn in degraded mode writes it back: only the rewrite of what was
                # saved lately can (the loaders' dialogs all have turns meanwhile)
                quiet = await Tab.open(w.ga, quiet_user)
                quiet_turn = await quiet.ask("remember me through the failover", f"{tag}-quiet", "quiet")
                check(quiet_turn.kind == "done", f"the quiet dialog's turn: {quiet_turn}")
                await asyncio.sleep(0.4)
            await asyncio.to_thread(cluster.pause_master if pause else cluster.kill_master, victim)
            killed_at = time.time()
            for r in lagging:
                r.resume()
            new = await cluster.await_failover(victim, timeout=20)
            failed_over_at = time.time()
            print(f"   replica {new.port} promoted {failed_over_at - killed_at:.2f} s after the kill "
                  f"(redis_topo: {cluster.timings['failover']:.2f} s)", flush=True)
            await asyncio.sleep(3.0)  # the scenario: traffic for a while on the promoted replica
        finally:
            stop.set()
            sents = await loader
            sents += await loader2
        settle_started = time.time()
        await settled(w.gws)
        settled_at = time.time()
        watch_stop.set()
        await watcher
        await asyncio.sleep(0.3)  # a duplicate would come now
        t = tally(sents, w.tabs + seconds, tag)
        for tab in seconds:
            await tab.close()
        after = await counters(w.gws)
        d = delta(after, before)
        print(f"   {tally_line(t)}; errors: {t['errors'][:3]}", flush=True)
        for name, changes in seen.items():
            ups = [(round(ts - killed_at, 2), v) for ts, v in changes]
            print(f"   {name}: store_degraded changes (s after the kill, value): {ups}; "
                  f"degraded_seconds_total +{d[name].get('chatgate_store_degraded_seconds_total', 0)}", flush=True)
        print(f"   settled (degraded 0, writeback pending 0) {settled_at - killed_at:.2f} s after the kill "
              f"({settled_at - settle_started:.2f} s after the traffic stopped)", flush=True)
        print(f"   counters moved: {d}", flush=True)
        print_log_problems(log_problems(w.gws, marks))

        window = [s for s in sents if s.user in victim_users and s.kind == "done"
                  and killed_at - REPLICATION_WINDOW <= s.answered_at <= killed_at]

        def may_be_lost(s):
            # Lost with the master: its save was answered by the killed master before the kill
            # (killed_at is taken once kill_master has returned), so its done, which precedes
            # the save, came at most REPLICATION_WINDOW before; 0.5 s after it for the test's
            # own loop, which reads 50 clients' frames.
            return s.user in victim_users and killed_at - REPLICATION_WINDOW <= s.answered_at <= killed_at + 0.5
        excused, missing, problems = await asyncio.to_thread(check_histories, cluster, sents, may_be_lost, False)
        after_fo = [s for s in missing if s.answered_at and s.answered_at >= failed_over_at]
        print(f"   history: {len(excused)} turn(s) missing within the replication window (of {len(window)} "
              f"answered on the killed master's dialogs in the last {REPLICATION_WINDOW:.0f} s before the kill): "
              f"{[(s.mid, round(s.answered_at - killed_at, 3)) for s in excused][:10]}", flush=True)
        if missing:
            print(f"   history: {len(missing)} turn(s) missing outside it: "
                  f"{[(s.mid, s.gw, round(s.answered_at - killed_at, 3)) for s in missing][:10]}", flush=True)
        # One master's outage is its slots' alone: no gateway is degraded as a whole, and
        # unless Redis itself refuses every slot (full coverage), the other masters' dialogs
        # go on at Redis, never told store_degraded.
        others_warned = sorted({tab.user for tab in w.tabs if tab.user not in victim_users and any(
            f.get("code") == "store_degraded" for f in tab.warnings[warned_before[id(tab)]:])})
        victims_warned = sorted({tab.user for tab in w.tabs if tab.user in victim_users and any(
            f.get("code") == "store_degraded" for f in tab.warnings[warned_before[id(tab)]:])})
        print(f"   told store_degraded: {len(victims_warned)} of {len(victim_users)} users on the killed master, "
              f"{len(others_warned)} of {len(set(users) - victim_users)} on the others", flush=True)
        if not full_coverage:
            check(not others_warned, f"users whose slots were on masters that stayed up were told "
                                     f"store_degraded: {others_warned[:5]}")
        whole = {name: [v for _, v in changes if v] for name, changes in seen.items()}
        check(not any(whole.values()), f"a gateway was degraded as a whole by one master's failover: {whole}")
        check(t["sent"] > 200, f"only {t['sent']} messages were sent")
        check(not t["lost"] and not t["dup"] and not t["unknown"] and not t["violations"],
              f"{tally_line(t)}: lost {t['lost'][:5]}, duplicated {t['dup'][:5]}, unknown ids {t['unknown'][:5]}")
        check(not problems, f"history problems: {problems[:5]}")
        check(not after_fo, f"{len(after_fo)} turn(s) answered after the failover completed are missing from "
                            f"history: {after_fo[:5]}")
        check(not missing, f"{len(missing)} turn(s) missing from history outside the replication window: "
                           f"{missing[:5]}")
        # A dialog's turns come at least 4 x 20 ms apart (a user's rooms take turns), far more
        # than loopback replication lags: Redis can lose at most a dialog's last turn.
        per_dialog = {}
        for s in excused:
            per_dialog[(s.user, s.room)] = per_dialog.get((s.user, s.room), 0) + 1
        check(all(n == 1 for n in per_dialog.values()),
              f"more than one turn of a dialog lost with the master: {per_dialog}")
        # Not even those: once the map names the promoted replica, each gateway writes the
        # dialogs it saved in those slots in the last 30 s again, merged with the replica's
        # copy (docs/state.md, Redis Cluster), so what replication had not carried comes back.
        check(sum(c.get("chatgate_store_primary_switches_total", 0) for c in d.values()) >= 1,
              f"no gateway counted the failover (chatgate_store_primary_switches_total): {d}")
        check(not excused, f"{len(excused)} turn(s) answered on the killed master were not written again to its "
                           f"promoted replica: {[(s.mid, round(s.answered_at - killed_at, 3)) for s in excused][:5]}")
        if not pause:
            kept = await asyncio.to_thread(history, cluster, await asyncio.to_thread(owners_of, cluster, [quiet_user]),
                                           quiet_user, "quiet")
            await quiet.close()
            check([m.get("content") for m in kept][:1] == ["remember me through the failover"],
                  f"the quiet dialog's turn, answered by the master before it died and never replicated, should "
                  f"have been written again to the promoted replica: its history there is {kept}")
        await asyncio.to_thread(check_no_crossslot, cluster, w.gws)
        if pause:  # SIGCONT: it comes back as a replica of the promoted one
            victim.resume()


async def part_reshard(w):
    cluster = w.cluster
    with step(f"reshard of {RESHARD_SLOTS} slots while {N_USERS} clients send: MOVED followed, every message "
              "done once, no history missing"):
        await cluster.await_stable()
        users = [tab.user for tab in w.tabs]
        slots = {u: await asyncio.to_thread(user_slot, cluster, u) for u in users}
        masters = cluster.masters()

        def first_slots(m):  # redis-cli takes a source's slots from its lowest up
            out = []
            for a, b in sorted(cluster.slots_of(m)):
                out += list(range(a, b + 1))
            return set(out[:RESHARD_SLOTS])
        pairs = []
        for src in masters:
            moving = first_slots(src)
            n_users = sum(1 for u in users if slots[u] in moving)
            for dst in masters:
                if dst is not src:
                    pairs.append((n_users, src, dst, moving))
        n_users, src, dst, moving = max(pairs, key=lambda p: p[0])
        movers = sorted(u for u in users if slots[u] in moving)
        print(f"   {src.port} -> {dst.port}: the slots of {n_users} users move ({movers[:8]}...)", flush=True)
        before = await counters(w.gws)
        marks = log_marks(w.gws)
        stop = asyncio.Event()
        loader = asyncio.create_task(load(w.tabs, "rs", stop))
        try:
            await asyncio.sleep(0.5)  # the scenario: traffic before the reshard starts
            run = cluster.reshard(src, dst, RESHARD_SLOTS, pipeline=20)
            await run.ajoin(timeout=60)
            print(f"   reshard took {run.elapsed:.2f} s", flush=True)
            await asyncio.sleep(1.0)  # the scenario: traffic after the slots have moved
        finally:
            stop.set()
            sents = await loader
        await settled(w.gws)
        await asyncio.sleep(0.3)  # a silence: a duplicate would come now
        t = tally(sents, w.tabs, "rs-")
        after = await counters(w.gws)
        d = delta(after, before)
        moved = sum(d[g.name].get("redirect_moved", 0) for g in w.gws)
        ask = sum(d[g.name].get("redirect_ask", 0) for g in w.gws)
        tryagain = sum(d[g.name].get("redirect_tryagain", 0) for g in w.gws)
        movers_after = sum(1 for s in sents if s.user in set(movers) and s.answered_at)
        print(f"   {tally_line(t)}; errors {t['errors'][:3]}", flush=True)
        print(f"   redirects: moved {moved:.0f}, ask {ask:.0f}, tryagain {tryagain:.0f}; counters moved: {d}",
              flush=True)
        print_log_problems(log_problems(w.gws, marks))
        on_dst = await asyncio.to_thread(
            lambda: {u for u in movers if cluster.master_of_slot(slots[u]).port == dst.port})
        check(on_dst == set(movers), f"users whose slot should be on {dst.port} now: {sorted(set(movers) - on_dst)}")
        check(t["done"] == t["sent"] and not t["lost"] and not t["dup"] and not t["unknown"] and not t["violations"],
              f"{tally_line(t)}: errors {t['errors'][:5]}, lost {t['lost'][:5]}, dup {t['dup'][:5]}")
        check(movers_after > 0, "no message of a user whose slot moved")
        check(moved > 0, f"no MOVED counted with {n_users} users' slots moved under traffic: {d}")
        excused, missing, problems = await asyncio.to_thread(check_histories, cluster, sents)
        check(not missing and not problems, f"history after the reshard: missing {missing[:5]}; {problems[:3]}")
        await asyncio.to_thread(check_no_crossslot, cluster, w.gws)

    with step("ASK on purpose: a user's slot MIGRATING/IMPORTING by hand, its keys moved: the gateway "
              "follows ASK (counted), and the message ends done once the migration is finished"):
        await cluster.await_stable()
        user = "ask|user"
        tab = await Tab.open(w.ga, user)
        first = await tab.ask(f"msg {user}/a 0", "ask-0", "a")
        check(first.kind == "done", f"the first message: {first.terminals}")
        slot = await asyncio.to_thread(user_slot, cluster, user)
        src = await asyncio.to_thread(cluster.master_of_slot, slot)
        dst = next(m for m in cluster.masters() if m.port != src.port)
        await saved(src, user, "a", "the first message")
        keys = src.command("CLUSTER", "GETKEYSINSLOT", slot, 100)
        check(keys, f"no keys of {user} in slot {slot} on {src.port}")
        before = await counters(w.gws)
        check(dst.command("CLUSTER", "SETSLOT", slot, "IMPORTING", src.node_id) == "OK", "SETSLOT IMPORTING")
        check(src.command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst.node_id) == "OK", "SETSLOT MIGRATING")
        reply = src.command("MIGRATE", "127.0.0.1", dst.port, "", 0, 5000, "KEYS", *keys)
        check(reply == "OK", f"MIGRATE of {keys}: {reply}")
        started = time.monotonic()
        pending = asyncio.create_task(tab.ask(f"msg {user}/a 1", "ask-1", "a"))
        deadline = time.monotonic() + 3
        asks = 0
        while time.monotonic() < deadline and not pending.done():
            now = [(await metrics(g)).value("chatgate_store_cluster_redirects_total", kind="ask") for g in w.gws]
            asks = sum(now) - sum(before[g.name]["redirect_ask"] for g in w.gws)
            if asks > 0:
                break
            await asyncio.sleep(0.01)
        met = time.monotonic() - started
        for n in [dst, src] + [m for m in cluster.masters() if m.port not in (src.port, dst.port)]:
            check(n.command("CLUSTER", "SETSLOT", slot, "NODE", dst.node_id) == "OK", f"SETSLOT NODE on {n.port}")
        second = await pending
        took = time.monotonic() - started
        after = await counters(w.gws)
        d = delta(after, before)
        print(f"   ASK met {met * 1000:.0f} ms after the message; it ended {second.kind} after {took * 1000:.0f} ms; "
              f"counters moved: {d}", flush=True)
        # the message may end (its ASKs followed) before a poll above saw them: the counters at
        # the end count them too
        asks = max(asks, sum(v.get("redirect_ask", 0) for v in d.values()))
        check(asks > 0, f"no ASK counted while slot {slot} was MIGRATING with its keys gone: {d}")
        check(second.kind == "done" and len(second.terminals) == 1,
              f"the message during the migration: {second.terminals}")
        want = [f"msg {user}/a 0", f"echo: msg {user}/a 0", f"msg {user}/a 1", f"echo: msg {user}/a 1"]
        history = harness.dialog_key(user, "a", "history")
        def hist():
            return [json.loads(m).get("content") for m in dst.lrange(history)]
        await harness.wait_until(lambda: hist() == want, 5)  # the save lands after done
        check(hist() == want, f"the dialog on {dst.port} after the migration: {hist()}")
        await tab.close()


def channel_of(chans, gw):
    """The bus channel of gateway `gw` among `chans` ("<prefix>:bus:<host>:<pid>:<random>"), or None."""
    return next((ch for ch in chans if ch.split(":")[-2] == str(gw.pid)), None)


def bus_channels(cluster):
    """{channel: port of the master it is SSUBSCRIBEd on} (PUBSUB SHARDCHANNELS on each master)."""
    out = {}
    for m in cluster.masters():
        for ch in m.command("PUBSUB", "SHARDCHANNELS", "chatgate:bus:*"):
            out.setdefault(ch, []).append(m.port)
    return out


async def part_cancel(w):
    cluster = w.cluster
    with step("cancel across gateways: a cancel phrase on gateway B stops the reply streaming on gateway A "
              "within 1 s (sharded pub/sub, after the failover and the reshard)"):
        def bus_ok():
            chans = bus_channels(cluster)
            right = {ch: cluster.master_of_slot(cluster.key_slot(ch)).port for ch in chans}
            ours = [channel_of(chans, gw) for gw in w.gws]
            ok = all(ours) and all(chans[ch] == [right[ch]] for ch in ours)
            return ok, chans, right
        deadline = time.monotonic() + 8
        while True:
            ok, chans, right = await asyncio.to_thread(bus_ok)
            if ok or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        print(f"   bus channels (channel: subscribed at, owner of its slot): "
              f"{ {ch: (p, right[ch]) for ch, p in chans.items()} }", flush=True)
        check(ok, f"each gateway's channel should be SSUBSCRIBEd at its slot's master (gateway pids "
                  f"{[gw.pid for gw in w.gws]}): {chans}, owners {right}")
        user = "cx|user"
        before = await counters(w.gws)
        a, b, long = await cross_cancel(w, w.ga, w.gb, user)
        sent = time.monotonic()
        phrase = asyncio.create_task(b.ask("stop", f"{user}-1", "c"))
        first = await long
        stopped = time.monotonic() - sent
        second = await phrase
        after = await counters(w.gws)
        d = delta(after, before)
        print(f"   A's reply {first.kind} {stopped * 1000:.1f} ms after the phrase on B; B's phrase {second.kind}; "
              f"counters moved: {d}", flush=True)
        check(first.kind == "cancelled", f"A's reply should be cancelled: {harness.brief(first.terminals)}")
        check(stopped < 1.0, f"A's reply stopped {stopped * 1000:.0f} ms after the phrase (at most 1,000 ms)")
        check(d[w.ga.name].get("chatgate_store_remote_cancels_total") == 1,
              f"A's remote cancels: {d[w.ga.name]}")
        check(second.kind == "done", f"B's phrase: {second.terminals}")
        await a.close()
        await b.close()


async def cross_cancel(w, ga, gb, user):
    """A tab of `user` on gateway `ga` whose slow reply (room "c") is streaming, and a tab of the
    same user on `gb`, for the caller's cancel phrase: (tab A, tab B, the task of A's reply)."""
    a = await Tab.open(ga, user)
    b = await Tab.open(gb, user)
    long = asyncio.create_task(a.ask(f"SLOW {user}/c 0", f"{user}-0", "c", timeout=15))
    deadline = time.monotonic() + 5
    while not w.upstream.requests_with(f"SLOW {user}/c 0"):
        check(time.monotonic() < deadline, "the upstream never got the slow message")
        await asyncio.sleep(0.01)
    mid = f"{user}-0"  # a few words streamed to A
    await harness.wait_condition(lambda: len(a.tracker.state.get(mid, {}).get("deltas", ())) >= 2, 5,
                                 f"two deltas of {mid} at A")
    return a, b, long


async def part_cancel_fallback(w):
    cluster = w.cluster
    with step("cancel across gateways with the bus message lost (the subscriptions just killed): the "
              "lease renewal's cancel flag stops A's reply within a third of redis.lease_ms (3 s here)"):
        cfg = json.loads(json.dumps(w.config))
        cfg["redis"]["lease_ms"] = 3000
        async with harness.Gateway(w.args, cfg, name="gateway-c") as gc, \
                harness.Gateway(w.args, cfg, name="gateway-d") as gd:
            def subscribed():
                chans = bus_channels(cluster)
                return channel_of(chans, gc) and channel_of(chans, gd)
            deadline = time.monotonic() + 8
            while not await asyncio.to_thread(subscribed):
                check(time.monotonic() < deadline, f"the new gateways' bus channels: {bus_channels(cluster)}")
                await asyncio.sleep(0.1)
            user = "fb|user"
            before = await counters([gc, gd])
            a, b, long = await cross_cancel(w, gc, gd, user)
            killed = 0
            for m in cluster.masters():  # every subscription goes (each resubscribes after 1 s)
                killed += m.command("CLIENT", "KILL", "TYPE", "pubsub")
            sent = time.monotonic()
            phrase = asyncio.create_task(b.ask("stop", f"{user}-1", "c"))
            first = await long
            stopped = time.monotonic() - sent
            second = await phrase
            d = delta(await counters([gc, gd]), before)
            print(f"   {killed} subscriptions killed; A's reply {first.kind} {stopped * 1000:.0f} ms after the phrase "
                  f"(renewal every 1,000 ms); B's phrase {second.kind}; counters moved: {d}", flush=True)
            check(first.kind == "cancelled", f"A's reply should be cancelled by the renewal's flag: "
                                             f"{harness.brief(first.terminals)}")
            check(stopped < 1.5, f"A's reply stopped {stopped * 1000:.0f} ms after the phrase (at most 1,500 ms)")
            check(d[gc.name].get("chatgate_store_remote_cancels_total") == 1, f"C's remote cancels: {d[gc.name]}")
            await a.close()
            await b.close()


def move_slot(cluster, slot, dst):
    """Move `slot` (and its keys) to master `dst` by hand: IMPORTING, MIGRATING, MIGRATE of its
    keys, then SETSLOT NODE on every master. The master it came from."""
    src = cluster.master_of_slot(slot)
    check(src.port != dst.port, f"slot {slot} is on {dst.port} already")
    check(dst.command("CLUSTER", "SETSLOT", slot, "IMPORTING", src.node_id) == "OK", "SETSLOT IMPORTING")
    check(src.command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst.node_id) == "OK", "SETSLOT MIGRATING")
    while True:
        keys = src.command("CLUSTER", "GETKEYSINSLOT", slot, 100)
        if not keys:
            break
        check(src.command("MIGRATE", "127.0.0.1", dst.port, "", 0, 5000, "KEYS", *keys) == "OK", "MIGRATE")
    for n in [dst, src] + [m for m in cluster.masters() if m.port not in (src.port, dst.port)]:
        check(n.command("CLUSTER", "SETSLOT", slot, "NODE", dst.node_id) == "OK", f"SETSLOT NODE on {n.port}")
    return src


async def part_bus_slot_moved(w):
    cluster = w.cluster
    with step("gateway A's bus channel's slot moved by hand, no traffic meanwhile: A subscribes again at the "
              "slot's new master, and a cancel phrase on B still stops A's reply within 1 s"):
        chans = await asyncio.to_thread(bus_channels, cluster)
        channel = channel_of(chans, w.ga)
        check(channel, f"{w.ga.name} (pid {w.ga.pid}) has no bus subscription before the move: {chans}")
        slot = await asyncio.to_thread(cluster.key_slot, channel)
        owner = await asyncio.to_thread(cluster.master_of_slot, slot)
        dst = next(m for m in cluster.masters() if m.port != owner.port)
        marks = log_marks([w.ga])
        await asyncio.to_thread(move_slot, cluster, slot, dst)
        moved_at = time.monotonic()
        deadline = moved_at + 5
        while True:
            where = (await asyncio.to_thread(bus_channels, cluster)).get(channel)
            if where == [dst.port] or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        print(f"   {channel} (slot {slot}) moved {owner.port} -> {dst.port}: subscribed at {where} "
              f"{time.monotonic() - moved_at:.2f} s later; A logged: "
              f"{[line.split(' ', 3)[-1][:120] for line in log_problems([w.ga], marks)[w.ga.name]]}", flush=True)
        check(where == [dst.port], f"{w.ga.name}'s channel {channel} should be subscribed at {dst.port} "
                                   f"within 5 s of its slot's move; subscribed at: {where}")
        before = await counters(w.gws)
        a, b, long = await cross_cancel(w, w.ga, w.gb, "mv|user")
        sent = time.monotonic()
        phrase = asyncio.create_task(b.ask("stop", "mv|user-1", "c"))
        first = await long
        stopped = time.monotonic() - sent
        await phrase
        d = delta(await counters(w.gws), before)
        print(f"   A's reply {first.kind} {stopped * 1000:.1f} ms after the phrase on B", flush=True)
        check(first.kind == "cancelled" and stopped < 1.0,
              f"A's reply: {harness.brief(first.terminals)} after {stopped * 1000:.0f} ms")
        check(d[w.ga.name].get("chatgate_store_remote_cancels_total") == 1, f"A's remote cancels: {d[w.ga.name]}")
        await a.close()
        await b.close()


async def part_parked_at_close(w):
    cluster = w.cluster
    with step("commands parked on TRYAGAIN when the router closes (a node connection lost): the gateway "
              "survives, the message is answered, the dialog written back once the slot has moved"):
        async with harness.Gateway(w.args, w.config, name="gateway-e") as ge:
            user = "park|user"
            tab = await Tab.open(ge, user)
            first = await tab.ask(f"msg {user}/r 0", "park-0", "r")
            check(first.kind == "done", f"the first message: {first.terminals}")
            slot = await asyncio.to_thread(user_slot, cluster, user)
            src = await asyncio.to_thread(cluster.master_of_slot, slot)
            await saved(src, user, "r", "the first message")
            dst = next(m for m in cluster.masters() if m.port != src.port)
            keys = src.command("CLUSTER", "GETKEYSINSLOT", slot, 100)
            check(dst.command("CLUSTER", "SETSLOT", slot, "IMPORTING", src.node_id) == "OK", "SETSLOT IMPORTING")
            check(src.command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst.node_id) == "OK", "SETSLOT MIGRATING")
            check(src.command("MIGRATE", "127.0.0.1", dst.port, "", 0, 5000, "KEYS", *keys) == "OK", "MIGRATE")
            # the phrase's cancel script and its load meet ASK then TRYAGAIN: parked, 80 ms and more
            tryagain = (await metrics(ge)).value("chatgate_store_cluster_redirects_total", kind="tryagain")
            pending = asyncio.create_task(tab.ask("stop", "park-1", "r"))
            await harness.wait_metric(ge, "chatgate_store_cluster_redirects_total", lambda v: v > tryagain, 5,
                                      "a command parked on TRYAGAIN", kind="tryagain")
            killed = sum(m.command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes") for m in cluster.masters())
            await asyncio.sleep(0.5)  # the subject: a crash on the router's close would come now
            alive = ge.alive()
            for n in [dst, src] + [m for m in cluster.masters() if m.port not in (src.port, dst.port)]:
                n.command("CLUSTER", "SETSLOT", slot, "NODE", dst.node_id)
            if not alive:
                ge.failed = True
                tail = "\n".join(ge.log_text().splitlines()[-12:])
                harness.fail(f"gateway-e died (status {ge.proc.poll()}) when its router closed with commands "
                             f"parked ({killed} client connections killed on the masters):\n{tail}")
            second = await pending
            print(f"   {killed} client connections killed; the phrase ended {second.kind}", flush=True)
            check(second.kind is not None, "the phrase got no terminal frame")
            await settled([ge] + w.gws)
            hist = [json.loads(m).get("content") for m in dst.lrange(harness.dialog_key(user, "r", "history"))]
            check(f"msg {user}/r 0" in hist and "stop" in hist, f"the dialog on {dst.port}: {hist}")
            await tab.close()


async def part_one_turn(w):
    with step("one turn of a dialog at a time: two tabs of one user on the two gateways send back to back "
              "into one room: the upstream never has two of its requests at once"):
        user = "tw|user"
        before = await counters(w.gws)
        tabs = [await Tab.open(w.ga, user), await Tab.open(w.gb, user)]
        per_tab = 10
        sents = []

        async def tab_run(i, tab):
            for n in range(per_tab):
                sents.append(await tab.ask(f"PACE {user}/t {i}-{n}", f"tw{i}-{n}", "t"))
        started = time.monotonic()
        await asyncio.gather(*[tab_run(i, t) for i, t in enumerate(tabs)])
        took = time.monotonic() - started
        await asyncio.sleep(0.3)  # a silence: a duplicate would come now
        t = tally(sents, tabs)
        after = await counters(w.gws)
        d = delta(after, before)
        tag = f"{user}/t"
        spans = sorted(w.upstream.spans.get(tag, []))
        overlaps = [(x[2], y[2]) for x, y in zip(spans, spans[1:]) if y[0] < x[1]]
        waits = sum(d[g.name].get("chatgate_store_lease_waits_total", 0) for g in w.gws)
        print(f"   {tally_line(t)} in {took:.2f} s; upstream requests of the dialog {len(spans)}, at most "
              f"{w.upstream.max_inflight.get(tag)} at once, overlaps {len(overlaps)}; lease waits {waits:.0f}",
              flush=True)
        check(t["done"] == 2 * per_tab and not t["lost"] and not t["dup"] and not t["violations"],
              f"{tally_line(t)}: {t['errors'][:3]}")
        check(len(spans) == 2 * per_tab,
              f"the upstream got {len(spans)} requests of the dialog, expected {2 * per_tab}")
        check(w.upstream.max_inflight.get(tag) == 1 and not overlaps,
              f"two turns of one dialog at once: {overlaps[:3]}")
        check(waits > 0, f"no lease wait counted with two gateways on one dialog: {d}")
        excused, missing, problems = await asyncio.to_thread(check_histories, w.cluster, sents, None, False)
        check(not missing and not problems, f"history: missing {missing[:5]}; {problems[:3]}")
        owners = await asyncio.to_thread(owners_of, w.cluster, [user])
        hist = await asyncio.to_thread(history, w.cluster, owners, user, "t")
        said = [m.get("content") for m in hist if m.get("role") == "user"]
        for i in range(len(tabs)):
            mine = [c for c in said if c.startswith(f"PACE {tag} {i}-")]
            check(mine == [f"PACE {tag} {i}-{n}" for n in range(per_tab)], f"tab {i}'s messages in history: {mine}")
        ts = [m.get("ts") for m in hist]
        back = max([a - b for a, b in zip(ts, ts[1:])] + [0])
        waited = sorted(((s.answered_at - s.sent_at), s.mid) for s in sents)[-3:]
        print(f"   slowest answers (s, id): {[(round(x, 2), m) for x, m in waited]}; history ts go back by up to "
              f"{back} s (a message's ts is when it arrived, its place when its turn ran)", flush=True)
        for tab in tabs:
            await tab.close()
        worst = {k: v for k, v in w.upstream.max_inflight.items() if v > 1}
        check(not worst, f"dialogs the upstream had two requests of at once, over the whole test: {worst}")


async def part_profile(w):
    """The user's profile on the cluster: one hash under the user's hash tag, on the master of
    the user's slot alone; written through one gateway (the shipped rules' remember), read
    through the other."""
    with step("profile: 'call me Zed' on gateway A, read on gateway B; the key on its slot's master only"):
        tab = w.tabs[0]  # u0, on gateway A
        s = await tab.ask("call me Zed", "pf-1", "pf")
        check(s.kind == "done", f"the message should be answered: {s.kind}")
        other = w.gb if tab.gw is w.ga else w.ga
        c = await Client.connect(other, expect_user=tab.user, extra_headers={"X-User-Id": tab.user})
        await c.send({"type": "profile.get"})
        frame = await c.next_matching(lambda f: f.get("type") == "profile", 10, "the profile frame")
        check(frame["profile"] == {"name": "Zed"}, f"{tab.user}'s profile through {other.name}: {frame}")
        await c.close()

        def placement():
            key = "chatgate:{" + harness.escape_id(tab.user) + "}:profile"
            owner = w.cluster.master_of_slot(user_slot(w.cluster, tab.user))
            held = [m.port for m in w.cluster.masters() if m.keys(key)]
            return owner.port, held
        owner, held = await asyncio.to_thread(placement)
        check(held == [owner], f"the profile key should be on its slot's master {owner} alone: {held}")


async def part_hostnames(w):
    """A cluster that names its nodes by host name (cluster-announce-hostname with
    cluster-preferred-endpoint-type hostname: what managed clusters may answer): the map
    holds "localhost", not addresses; two new gateways look the names up, serve their users
    at Redis (never degraded), and a cancel on one stops a reply streaming on the other
    (sharded pub/sub at the name's master). They could not connect before."""
    cluster = w.cluster
    with step("host names in the map: two new gateways connect through 'localhost' names, answer at Redis, "
              "and cancel across each other"):
        def endpoints(kind):
            for n in cluster.live():  # the nodes killed by the failover parts stay down
                n.command("CONFIG", "SET", "cluster-announce-hostname", "localhost")
                n.command("CONFIG", "SET", "cluster-preferred-endpoint-type", kind)
        await asyncio.to_thread(endpoints, "hostname")
        try:
            await cluster.await_stable()

            def names():  # the names spread by the cluster bus: each master's answer, once all know
                return sorted({entry[2][0] for m in cluster.masters() for entry in m.command("CLUSTER", "SLOTS")})
            await harness.wait_condition(lambda: names() == ["localhost"], 10,
                                         lambda: f"the cluster should name its masters 'localhost': {names()}")
            print(f"   CLUSTER SLOTS names the masters {names()}", flush=True)
            async with harness.Gateway(w.args, w.config, name="gateway-c") as gc, \
                    harness.Gateway(w.args, w.config, name="gateway-d") as gd:
                users = [f"hn{i}|user" for i in range(6)]
                sents = []
                for i, user in enumerate(users):
                    tab = await Tab.open(gc if i % 2 == 0 else gd, user)
                    sents.append(await tab.ask(f"hello {user}", f"{user}-h", "h"))
                    await tab.close()
                check(all(s.kind == "done" for s in sents), f"{[(s.mid, s.kind) for s in sents]}")
                for gw in (gc, gd):
                    m = await metrics(gw)
                    check(m.value("chatgate_store_degraded") == 0, f"{gw.name} is degraded")
                    check(sum(m.series("chatgate_store_errors_total").values()) == 0,
                          f"{gw.name} counted store errors")
                await saved_all(cluster, users, "h")
                user = "hx|user"
                a, b, long = await cross_cancel(w, gc, gd, user)
                phrase = asyncio.create_task(b.ask("stop", f"{user}-1", "c"))
                first = await long
                second = await phrase
                check(first.kind == "cancelled", f"C's reply should be cancelled by D's phrase: {first.kind}")
                check(second.kind == "done", f"D's phrase: {second.kind}")
                await a.close()
                await b.close()
        finally:
            await asyncio.to_thread(endpoints, "ip")


async def saved_all(cluster, users, room):
    """Each user's dialog history is on the master of its slot (the save reached Redis)."""
    def found():
        owners = owners_of(cluster, users)
        return all(history(cluster, owners, u, room) for u in users)
    await harness.wait_condition(found, 5, "every user's dialog in Redis")


async def main(args):
    started = time.monotonic()
    cluster = redis_topo.RedisCluster(n_masters=3, replicas_per_master=1)
    await cluster.astart()
    for n in cluster.nodes:  # errorstats from here on are the gateways' (create leaves an ERR on replicas)
        n.config_resetstat()
    print(f"   cluster of 6 made in {cluster.timings['create']:.2f} s; seeds {cluster.seeds_url()}", flush=True)
    try:
        async with Upstream() as upstream:
            cfg = harness.state_config({"llm": harness.openai_upstream(upstream, "cl", first_byte_timeout_ms=10000,
                                                                       idle_timeout_ms=10000)},
                                       "llm", store=cluster.seeds_url(scheme="redis-cluster"), history_n=200)
            gw_args = ["--rules", str(harness.REPO_ROOT / "rules"), "--auth", "header", "--user-header", "X-User-Id"]
            async with harness.Gateway(gw_args, cfg, name="gateway-a") as ga, \
                    harness.Gateway(gw_args, cfg, name="gateway-b") as gb:
                tabs = [await Tab.open(ga if i % 2 == 0 else gb, f"u{i}") for i in range(N_USERS)]
                w = World(cluster, upstream, ga, gb, tabs, cfg, gw_args)
                parts = (part_routing, part_failover, part_reshard, part_cancel, part_one_turn,
                         part_cancel_fallback, part_bus_slot_moved, part_failover_partial, part_parked_at_close,
                         part_failover_stopped, part_profile, part_hostnames)
                only = os.environ.get("CG_E2E_PARTS")  # e.g. "1,3": those parts only (0 is routing)
                for n, part in enumerate(parts):
                    if not only or str(n) in only.split(","):
                        await independent(part(w))
                for tab in tabs:
                    check(tab.closed is None, f"{tab.user}'s connection closed: {tab.closed}")
                    await tab.close()
                with step("the gateways after it all"):
                    ga.assert_alive()
                    gb.assert_alive()
                    print(f"   Redis errorstats over the test: {await asyncio.to_thread(errorstats, cluster)}; "
                          f"total {time.monotonic() - started:.1f} s", flush=True)
    finally:
        cluster.stop()


if __name__ == "__main__":
    harness.run(main, timeout=170)
