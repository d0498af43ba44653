"""End-to-end test of resuming a reply after the client's connection went away (docs/protocol.md,
"Resuming a reply").

A client (auth none: it comes back with its hello's resume token) sends a message whose reply
streams word by word from the demo upstream, reads a few deltas, and loses its connection
(an abrupt TCP close, as a phone changing network does). It reconnects and sends
{"type":"resume","id":ID,"after":SEQ} with the seq of the last delta it kept:
- on the same gateway: the rest of the reply comes (what was kept as one delta, then live),
  then one done; the text it had plus what came equals the done's text, byte for byte (a
  reply with non-ASCII text: seq counts bytes), with no gap and no repeat; no second ack;
- a reply that finished while nobody listened: the rest and the done;
- resume after resume.grace_ms: the reply was cancelled at the grace, a resume gets
  not_found, and the history holds the reply marked cancelled;
- another user's resume of the same id: not_found, none of the text;
- a cancel after a resume: cancelled, no more deltas;
- a second tab resuming the same reply takes it over: the first gets its one terminal frame
  (not_found), and a tab that already had the reply's done gets nothing more; a resume that
  comes while the old connection still looks open (half-open TCP) takes its reply over and
  closes it with 4000;
- resume frames are charged to the rate limit: 60 at once, past the burst of 40, get
  rate_limited;
- a cancel phrase ("stop") in a new message while the reply is kept ends the kept reply first;
- a client that closes with 1000 (it is done) stops its reply as before; one that closes with
  1001 (going away: a tab put to sleep) keeps it;
- resume.grace_ms 0: the reply stops at the disconnect, as before resume existed;
- an ended reply resumed and dropped every 0.6 s (grace 1 s) is gone twice the grace after
  its end: each drop restarts the grace, but not past that;
- a gateway that drains with the memory store stops the replies it keeps at once (nobody could
  resume them), instead of waiting for them;
- 100 clients dropping at random points of their replies and coming back: every reply
  complete, once.
Across gateways sharing a Redis store (one redis-server, then a Redis Cluster made with
redis-cli --cluster create), the client comes back through the other gateway:
- the rest of the reply comes from the first gateway's stream in Redis, then its done, the
  text whole once; the holder published only once its client was gone (no XADD while the
  client stayed, counted in INFO commandstats), and the Redis commands and bytes of one
  resumed reply are printed;
- the holder's grace passes while the other gateway serves the resume: the reply is not
  cancelled;
- a cancel sent to the other gateway stops the reply on the holder (cancelled comes back), and
  so does a cancel phrase ("stop") in a new message there;
- 30 clients of each gateway moving to the other at random points: every reply whole, once.
"""

import asyncio
import random

import harness
import redis_topo
from harness import Client, check, independent, step

WORDS_MS = 20  # the demo upstream's pace: a reply of ~30 words takes ~0.6 s


def config(grace_ms=None, delay_ms=WORDS_MS, **extra):
    cfg = harness.make_config({"demo": harness.demo_upstream(delay_ms)}, "demo", **extra)
    if grace_ms is not None:
        cfg["resume"] = {"grace_ms": grace_ms}
    return cfg


def utf8_len(text):
    return len(text.encode("utf-8"))


async def start_reply(gw, text, mid, deltas):
    """A client that sends `text` as `mid` and reads `deltas` deltas: (client, token, text so
    far, seq of the last delta)."""
    client = await Client.connect(gw)
    token = client.hello["resume"]
    await client.send_message(text, mid)
    await client.recv_type("ack", mid)
    got, seq = "", 0
    for _ in range(deltas):
        d = await client.recv_type("delta", mid)
        check(isinstance(d.get("seq"), int), f"a delta without an integer seq: {d}")
        got += d["text"]
        check(d["seq"] == utf8_len(got), f"seq {d['seq']} is not the bytes relayed so far ({utf8_len(got)})")
        seq = d["seq"]
    return client, token, got, seq


async def drop(client):
    """The connection is lost, not closed: the TCP socket goes without a close frame."""
    client.ws.transport.abort()
    await asyncio.sleep(0)


async def resume(gw, token, mid, after):
    """A new connection of the same user that resumes `mid` after `after`."""
    client = await Client.connect(f"{gw.url}?resume={token}", expect_user=token.split(".")[0])
    await client.send({"type": "resume", "id": mid, "after": after})
    return client


async def rest_of(client, mid, got, seq):
    """Reads the resumed reply to its terminal frame; checks seq, no gap, no repeat, no ack."""
    turn = await client.collect_turn(mid)
    check(not turn.of_type("ack"), f"a resume got an ack again: {turn.describe()}")
    for d in turn.deltas:
        got += d["text"]
        check(d.get("seq") == utf8_len(got), f"seq {d.get('seq')} after a resume is not {utf8_len(got)}: "
                                             f"{turn.describe()}")
    return turn, got


async def same_gateway():
    async with harness.Gateway(config=config()) as gw:
        with step("resume on the same gateway, mid-reply: the rest, then one done; no gap, no repeat"):
            client, token, got, seq = await start_reply(gw, "héllo wörld, naïve ✓ café", "m1", 3)
            await drop(client)
            again = await resume(gw, token, "m1", seq)
            turn, got = await rest_of(again, "m1", got, seq)
            check(turn.kind == "done", f"expected done: {turn.describe()}")
            done = turn.terminal
            check(done["text"] == got, f"the text before and after the resume is not the done's:\n"
                                       f"{got!r}\n{done['text']!r}")
            check("You said" in got, f"not the demo's reply: {got!r}")
            await again.check_alive()
            await again.close()

        with step("a reply that finished while nobody listened: the rest and the done"):
            client, token, got, seq = await start_reply(gw, "finish without me", "m2", 1)
            await drop(client)
            await harness.wait_metric(gw, "chatgate_turns_total", lambda v: v is not None and v >= 2, 5,
                                      "the reply's end", end="done")
            again = await resume(gw, token, "m2", seq)
            turn, got = await rest_of(again, "m2", got, seq)
            check(turn.kind == "done" and turn.terminal["text"] == got,
                  f"the finished reply's rest does not complete it: {turn.describe()}")
            await again.close()

        with step("another user resuming the same id: not_found, none of the text"):
            client, token, got, seq = await start_reply(gw, "mine alone", "m3", 1)
            await drop(client)
            other = await Client.connect(gw)
            await other.send({"type": "resume", "id": "m3", "after": 0})
            await other.expect_error("not_found", "m3")
            check(not [f for f in other.received if f.get("type") == "delta"], "another user got deltas")
            again = await resume(gw, token, "m3", seq)
            await rest_of(again, "m3", got, seq)
            await other.close()
            await again.close()

        with step("a cancel after a resume: cancelled, and no delta after it"):
            client, token, got, seq = await start_reply(gw, "stop me after I come back " * 4, "m4", 1)
            await drop(client)
            again = await resume(gw, token, "m4", seq)
            await again.recv_type("delta", "m4")
            await again.cancel("m4")
            turn = await again.collect_turn("m4")
            check(turn.kind == "cancelled", f"expected cancelled after the resumed cancel: {turn.describe()}")
            await again.check_alive()  # a marker: nothing about m4 came before its answer
            check(not [f for f in again.pending if f.get("id") == "m4"], "a frame of m4 after cancelled")
            await again.close()

        with step("a cancel phrase in a new message while the reply is kept ends the kept reply first"):
            client, token, got, seq = await start_reply(gw, "a reply to be stopped by a phrase " * 4, "p1", 1)
            await drop(client)
            again = await Client.connect(f"{gw.url}?resume={token}", expect_user=token.split(".")[0])
            turn = await again.message("stop", "p2")
            check(turn.ack and turn.ack.get("resolution") == {"type": "cancel"}, f"not a cancel: {turn.describe()}")
            await again.send({"type": "resume", "id": "p1", "after": seq})
            kept, got = await rest_of(again, "p1", got, seq)
            check(kept.kind == "cancelled", f"the kept reply was not stopped by the phrase: {kept.describe()}")
            await again.close()

        with step("a second tab resumes the same reply: the first gets its one terminal frame, not_found"):
            client, token, got, seq = await start_reply(gw, "two tabs want it " * 6, "t1", 1)
            await drop(client)
            tab1 = await resume(gw, token, "t1", seq)
            await tab1.recv_type("delta", "t1")
            tab2 = await resume(gw, token, "t1", seq)
            end1 = await tab1.expect_error("not_found", "t1")
            check("another connection" in end1["message"], f"the displaced tab's end: {end1}")
            turn2, got2 = await rest_of(tab2, "t1", got, seq)
            check(turn2.kind == "done" and turn2.terminal["text"] == got2, f"tab 2: {turn2.describe()}")
            await tab1.close()
            await tab2.close()

        with step("a second tab resumes a reply the first already got to its end: the second gets the kept "
                  "reply and its done, the first nothing more (its one terminal frame was the done)"):
            client, token, got, seq = await start_reply(gw, "one end per tab " * 4, "e1", 1)
            await drop(client)
            tab1 = await resume(gw, token, "e1", seq)
            turn1, got1 = await rest_of(tab1, "e1", got, seq)
            check(turn1.kind == "done", f"tab 1: {turn1.describe()}")
            tab2 = await resume(gw, token, "e1", seq)
            turn2, got2 = await rest_of(tab2, "e1", got, seq)
            check(turn2.kind == "done" and got2 == got1, f"tab 2: {turn2.describe()}")
            await tab1.expect_silence(0.5, lambda f: f.get("id") == "e1", "frame about e1 after its done")
            await tab1.close()
            await tab2.close()

        with step("a resume before the gateway saw the old connection go (it still looks open): taken over"):
            client, token, got, seq = await start_reply(gw, "my old connection is half open " * 4, "h1", 1)
            again = await resume(gw, token, "h1", seq)  # the old one was never closed
            turn, got = await rest_of(again, "h1", got, seq)
            check(turn.kind == "done" and turn.terminal["text"] == got, f"not taken over: {turn.describe()}")
            try:
                await asyncio.wait_for(client.ws.wait_closed(), 5)
            except asyncio.TimeoutError:
                pass
            check(client.ws.close_code == 4000, f"the old connection was not closed with 4000: {client.ws.close_code}")
            await again.close()

        with step("bad resume frames: bad_frame naming the field"):
            c = await Client.connect(gw)
            await c.send({"type": "resume", "after": 3})
            await c.expect_error("bad_frame")
            await c.send({"type": "resume", "id": "x", "after": -1})
            err = await c.expect_error("bad_frame", "x")
            check("'after'" in err["message"], f"the error does not name 'after': {err}")
            await c.send({"type": "resume", "id": "never", "after": 0})
            await c.expect_error("not_found", "never")
            await c.close()

        with step("resume frames are charged to the rate limit as messages are (each costs the store "
                  "reads, and a reader of another gateway's reply a parked slot): past the burst, "
                  "rate_limited"):
            c = await Client.connect(gw)
            for i in range(60):  # the default burst is 40, at 20 a second
                await c.send({"type": "resume", "id": f"flood{i}", "after": 0})
            codes = {}
            for i in range(60):
                err = await c.next_matching(lambda f: f.get("type") == "error" and f.get("id") == f"flood{i}", 5,
                                            f"the answer to resume flood{i}")
                codes[err["code"]] = codes.get(err["code"], 0) + 1
            check(codes.get("rate_limited", 0) >= 10 and codes.get("not_found", 0) >= 30,
                  f"60 resumes at once: {codes} (rate_limited past the burst of 40)")
            await asyncio.sleep(1.0)
            await c.send({"type": "resume", "id": "again", "after": 0})
            await c.expect_error("not_found", "again")  # the bucket refilled
            await c.close()


async def after_grace():
    async with harness.Gateway(config=config(grace_ms=300, delay_ms=100)) as gw:
        with step("resume after resume.grace_ms: cancelled at the grace, not_found, history says cancelled"):
            client, token, got, seq = await start_reply(gw, "a slow reply nobody comes back for " * 3, "g1", 1)
            room_user = client.hello["user"]
            await drop(client)
            await harness.wait_log(gw, r"nobody resumed it within 300 ms", 5)
            await harness.wait_log(gw, r"message g1: cancelled|g1.*cancel", 5)
            await asyncio.sleep(0.6)  # the subject: the kept record's own lifetime (the grace) passes
            again = await resume(gw, token, "g1", seq)
            await again.expect_error("not_found", "g1")
            state = await harness.context_command(again, "context.get", "default")
            history = state.get("history", [])
            check(any(h.get("role") == "assistant" and h.get("cancelled") for h in history),
                  f"the history of {room_user} has no cancelled reply: {history}")
            await again.close()
    async with harness.Gateway(config=config(grace_ms=1000, delay_ms=20)) as gw:
        with step("an ended reply resumed and dropped again and again is kept at most twice the grace after "
                  "its end, not for ever"):
            client, token, got, seq = await start_reply(gw, "kept for late resumes", "k1", 1)
            await drop(client)
            await asyncio.sleep(0.5)  # the short reply ends while nobody listens
            ended = asyncio.get_running_loop().time()
            def end_of_k1(f):
                return f.get("id") == "k1" and f.get("type") in ("done", "error", "cancelled")
            answers = []
            for _ in range(6):  # a resume and a drop every 0.6 s, each restarting the grace before
                again = await resume(gw, token, "k1", seq)
                end = await again.next_matching(end_of_k1, 10, "the resume's end")
                answers.append(end.get("code") or end["type"])
                await drop(again)
                if end["type"] != "done":
                    break
                await asyncio.sleep(0.6)
            await asyncio.sleep(max(0.0, ended + 2.0 + 0.5 - asyncio.get_running_loop().time()))
            again = await resume(gw, token, "k1", seq)
            last = await again.next_matching(end_of_k1, 10, "the last resume's end")
            check(answers[0] == "done" and last.get("code") == "not_found",
                  f"resumes every 0.6 s: {answers}; then, past twice the grace after the end: {last}")
            await again.close()


async def closed_normally():
    async with harness.Gateway(config=config(delay_ms=100)) as gw:
        with step("a client that closes with 1000 (it is done) stops its reply, as before; 1001 keeps it"):
            client, token, got, seq = await start_reply(gw, "closing on purpose " * 5, "n1", 1)
            await client.ws.close(1000)
            await harness.wait_log(gw, r"closed \(0 connected\)", 5)
            again = await resume(gw, token, "n1", seq)
            await again.expect_error("not_found", "n1")
            await again.close()
            client, token, got, seq = await start_reply(gw, "a tab put to sleep " * 5, "n2", 1)
            await client.ws.close(1001)
            again = await resume(gw, token, "n2", seq)
            turn, got = await rest_of(again, "n2", got, seq)
            check(turn.kind == "done" and turn.terminal["text"] == got, f"1001 did not keep it: {turn.describe()}")
            await again.close()


async def drain():
    gw = await harness.Gateway(config=config(delay_ms=200)).astart()
    with step("SIGTERM with a reply kept for a resume (memory store): it stops at once, not after the reply"):
        client, token, got, seq = await start_reply(gw, "a reply of several seconds " * 4, "s1", 1)
        await drop(client)
        await harness.wait_log(gw, r"message s1 goes on", 5)
        started = asyncio.get_running_loop().time()
        gw.send_signal()
        code = await gw.await_exit(3)
        took = asyncio.get_running_loop().time() - started
        check(code == 0, f"the gateway did not stop within 3 s (status {code}): the kept reply held the drain")
        print(f"   stopped {took:.2f} s after SIGTERM (the reply had ~4 s to go)", flush=True)


async def grace_off():
    async with harness.Gateway(config=config(grace_ms=0, delay_ms=100)) as gw:
        with step("resume.grace_ms 0: a disconnect stops the reply, as before; a resume gets not_found"):
            client, token, got, seq = await start_reply(gw, "cut me off " * 5, "z1", 1)
            await drop(client)
            again = await resume(gw, token, "z1", seq)
            await again.expect_error("not_found", "z1")
            await again.close()


async def many_drops():
    async with harness.Gateway(config=config(delay_ms=5), env={}) as gw:
        with step("100 clients drop at random points of their replies and come back: every reply complete, once"):
            rng = random.Random(38)

            async def one(i):
                mid = f"r{i}"
                client, token, got, seq = await start_reply(gw, f"client {i} says ünïcode {i}", mid,
                                                            rng.randrange(0, 6))
                await asyncio.sleep(rng.random() * 0.05)
                await drop(client)
                await asyncio.sleep(rng.random() * 0.3)
                again = await resume(gw, token, mid, seq)
                turn, got = await rest_of(again, mid, got, seq)
                check(turn.kind == "done" and turn.terminal["text"] == got,
                      f"{mid}: the reply is not whole once: {turn.describe()}")
                await again.close()

            await asyncio.gather(*(one(i) for i in range(100)))


SECRET = {"CHATGATE_RESUME_SECRET": "one secret for both gateways"}


def net_bytes(redis):
    """Redis's total_net_input_bytes and total_net_output_bytes."""
    info = dict(line.split(":", 1) for line in redis.command("INFO", "stats").splitlines() if ":" in line)
    return int(info["total_net_input_bytes"]), int(info["total_net_output_bytes"])


def xadds(redis):
    return redis.info_commandstats().get("xadd", {}).get("calls", 0)


async def across(store_url, what, redis=None):
    cfg = config(grace_ms=1500, delay_ms=30, store=store_url,
                 redis={"command_timeout_ms": 1000, "connect_timeout_ms": 1000})
    async with harness.Gateway(config=cfg, env=SECRET, name=f"{what}-a") as ga, \
            harness.Gateway(config=cfg, env=SECRET, name=f"{what}-b") as gb:
        with step(f"{what}: a client that stays costs no Redis command per delta"):
            if redis:
                before = xadds(redis)
                c = await Client.connect(ga)
                turn = await c.message("stay with me to the end", "s1")
                check(turn.kind == "done", turn.describe())
                check(xadds(redis) == before, f"XADD while the client stayed: {xadds(redis) - before}")
                await c.close()

        with step(f"{what}: the client comes back through the other gateway: the rest, then done, once"):
            if redis:
                redis.config_resetstat()
                net_before = net_bytes(redis)
            client, token, got, seq = await start_reply(ga, "héllo from A, going to B " * 2, "x1", 3)
            await drop(client)
            again = await resume(gb, token, "x1", seq)
            turn, got = await rest_of(again, "x1", got, seq)
            check(turn.kind == "done" and turn.terminal["text"] == got,
                  f"not whole once through the other gateway:\n{got!r}\n{turn.describe()}")
            if redis:
                stats = redis.info_commandstats()
                used = {k: v["calls"] for k, v in stats.items() if k in ("xadd", "xrange", "pexpire", "set", "exists")}
                net = net_bytes(redis)
                print(f"   one resumed reply: {used}; Redis read {net[0] - net_before[0]} and wrote "
                      f"{net[1] - net_before[1]} bytes (with the turn's own scripts); {utf8_len(got)} bytes of reply",
                      flush=True)
            await again.close()

        with step(f"{what}: the holder's grace passes while the other gateway serves the resume: not cancelled"):
            client, token, got, seq = await start_reply(ga, "a long one " * 30, "x2", 1)
            await drop(client)
            again = await resume(gb, token, "x2", seq)
            turn, got = await rest_of(again, "x2", got, seq)  # ~2.7 s of reply, past the 1.5 s grace
            check(turn.kind == "done" and turn.terminal["text"] == got, f"cut at the grace: {turn.describe()}")
            await again.close()

        with step(f"{what}: a cancel sent to the other gateway stops the reply on its holder"):
            client, token, got, seq = await start_reply(ga, "cancel me from B " * 20, "x3", 1)
            await drop(client)
            again = await resume(gb, token, "x3", seq)
            await again.recv_type("delta", "x3")
            await again.cancel("x3")
            turn = await again.collect_turn("x3")
            check(turn.kind == "cancelled", f"expected cancelled through the other gateway: {turn.describe()}")
            await harness.wait_metric(ga, "chatgate_turns_total", lambda v: v is not None and v >= 1, 5,
                                      "the holder's cancelled turn", end="cancelled")
            await again.close()

        with step(f"{what}: a cancel phrase through the other gateway ends the kept reply on its holder"):
            client, token, got, seq = await start_reply(ga, "stopped by a phrase at B " * 20, "x4", 1)
            await drop(client)
            again = await Client.connect(f"{gb.url}?resume={token}", expect_user=token.split(".")[0])
            turn = await again.message("stop", "x5")
            check(turn.ack and turn.ack.get("resolution") == {"type": "cancel"}, f"not a cancel: {turn.describe()}")
            await again.send({"type": "resume", "id": "x4", "after": seq})
            kept, got = await rest_of(again, "x4", got, seq)
            check(kept.kind == "cancelled", f"the kept reply was not stopped through the bus: {kept.describe()}")
            await again.close()

        with step(f"{what}: 30 clients of each gateway move to the other at random points: every reply whole, once"):
            rng = random.Random(7)

            async def one(i):
                src, dst = (ga, gb) if i % 2 else (gb, ga)
                mid = f"y{i}"
                client, token, got, seq = await start_reply(src, f"mover {i} ✓", mid, rng.randrange(0, 5))
                await drop(client)
                await asyncio.sleep(rng.random() * 0.5)
                again = await resume(dst, token, mid, seq)
                turn, got = await rest_of(again, mid, got, seq)
                check(turn.kind == "done" and turn.terminal["text"] == got,
                      f"{mid}: not whole once: {turn.describe()}")
                await again.close()

            await asyncio.gather(*(one(i) for i in range(60)))


async def across_one_redis():
    async with harness.RedisServer() as redis:
        await across(redis.url, "one redis", redis)


async def across_cluster():
    cluster = redis_topo.RedisCluster(n_masters=3, replicas_per_master=0)
    await cluster.astart()
    try:
        await across(cluster.seeds_url(scheme="redis-cluster"), "cluster")
    finally:
        cluster.stop()


async def main(_options):
    await independent(same_gateway())
    await independent(after_grace())
    await independent(closed_normally())
    await independent(grace_off())
    await independent(drain())
    await independent(many_drops())
    await independent(across_one_redis())
    await independent(across_cluster())


if __name__ == "__main__":
    harness.run(main, timeout=120)
