"""End-to-end tests of the turn export (issue 38, items 5 and 6; docs/operations.md, "The turn export").

A fake OpenAI-compatible server ("script": "FAIL" in the message -> HTTP 500, "SLOW" -> a slow
reply, else an echo with its usage) behind the gateway.

- Redis stream (export.to redis, a real redis-server): a done, an error and a cancelled turn;
  the stream's records equal, field by field, the ack and the terminal frame each client
  saw (route, service, params, rules; done: text, upstream, usage; error: code; cancelled:
  the text the client got); /metrics counts the records; DELETE /admin/users/{user} says
  what the export keeps;
- file (export.to file): export.mask masks an e-mail address in the message and the reply;
  export.texts false leaves the texts out; SIGHUP reopens the file after the test renamed it;
  export.max_bytes renames it to FILE.1;
- Redis Cluster: the record lands on the master of the stream key's slot;
- a stopped Redis (SIGSTOP) does not slow turns: once the store has gone degraded, turns
  take about what they took before; the records past export.max_queue are dropped and
  counted in /metrics, and the ones held go to the stream once Redis is back.
"""

import asyncio
import json
import os
import signal
import time
import urllib.parse

import harness
from harness import Client, Gateway, check, independent, step

T = harness.DEFAULT_TIMEOUT
ADMIN = "export-admin-token"
EMAIL = "jane.doe@example.com"


def config(fake, store="memory", **export):
    ups = {"llm": harness.openai_upstream(fake, "script")}
    cfg = harness.state_config(ups, "llm", store=store)
    cfg["export"] = export
    return cfg


def text_of(v):
    return v.decode() if isinstance(v, bytes) else v


def stream_records(rs, key="chatgate:export"):
    """The stream's records, oldest first, as dicts."""
    out = []
    for _entry_id, fields in rs.command("XRANGE", key, "-", "+") or []:
        pairs = dict(zip(map(text_of, fields[0::2]), map(text_of, fields[1::2])))
        check("turn" in pairs, f"a stream entry without its 'turn' field: {pairs}")
        out.append(json.loads(pairs["turn"]))
    return out


def file_records(path):
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f.read().splitlines() if line]


async def until(predicate, what, timeout=T):
    """harness.wait_condition, polling a file or Redis every 50 ms."""
    return await harness.wait_condition(predicate, timeout, what, interval=0.05)


async def cancelled_turn(client, text, mid, room):
    """A slow reply the client cancels after its first words: the turn as the client saw it."""
    await client.send_message(text, mid=mid, room=room)
    await client.recv_type("delta", mid)
    await client.cancel(mid)
    turn = await client.collect_turn(mid)
    check(turn.kind == "cancelled", f"expected cancelled: {turn.describe()}")
    return turn


def check_common(rec, turn, user, room, text, gw):
    """What every record says that the client's ack says too, field by field."""
    ack = turn.ack
    check(ack is not None, f"no ack: {turn.describe()}")
    for key in ("id", "room", "route", "service", "params", "rules"):
        check(rec.get(key) == ack.get(key), f"{turn.id}: record {key} {rec.get(key)!r} != ack's {ack.get(key)!r}")
    check(rec["user"] == user and rec["room"] == room, f"{turn.id}: user/room {rec['user']}/{rec['room']}")
    check(rec.get("text") == text, f"{turn.id}: text {rec.get('text')!r}")
    check(rec["gateway"].endswith(f":{gw.pid}"), f"{turn.id}: gateway {rec['gateway']!r}, pid {gw.pid}")
    check(isinstance(rec["total_ms"], (int, float)) and rec["total_ms"] > 0, f"{turn.id}: total_ms {rec['total_ms']}")
    check(isinstance(rec["time"], str) and rec["time"].endswith("Z"), f"{turn.id}: time {rec['time']!r}")


def check_done(rec, turn):
    done = turn.terminal
    check(rec["end"] == "done" and rec["code"] is None, f"{turn.id}: end {rec['end']} code {rec['code']}")
    check(rec["reply"] == done["text"], f"{turn.id}: reply {rec['reply']!r} != done's {done['text']!r}")
    check(rec["upstream"] == done.get("upstream"), f"{turn.id}: upstream {rec['upstream']} vs {done.get('upstream')}")
    check(rec["replica"] == done.get("replica"), f"{turn.id}: replica {rec['replica']} vs {done.get('replica')}")
    check(rec["attempts"] == done.get("attempts", 1), f"{turn.id}: attempts {rec['attempts']}")
    check(rec["fallback_from"] == done.get("fallback_from"), f"{turn.id}: fallback_from {rec['fallback_from']}")
    check(rec["truncated"] == done.get("truncated", False), f"{turn.id}: truncated {rec['truncated']}")
    usage = done.get("usage") or {}
    want = {"tokens_in": usage.get("prompt_tokens"), "tokens_out": usage.get("completion_tokens"), "reported": True}
    check(rec["usage"] == want, f"{turn.id}: usage {rec['usage']} != done's {usage}")
    check(rec["first_byte_ms"] is not None and 0 <= rec["first_byte_ms"] <= rec["total_ms"],
          f"{turn.id}: first_byte_ms {rec['first_byte_ms']} total_ms {rec['total_ms']}")


async def admin_forget(gw, user):
    url = f"{gw.http_url}/admin/users/{urllib.parse.quote(user, safe='')}"
    status, _, body = await asyncio.to_thread(harness.http_request, url, method="DELETE",
                                              headers={"Authorization": f"Bearer {ADMIN}"})
    return status, (json.loads(body) if body else None)


async def part_redis():
    rs = harness.RedisServer()
    await rs.astart()
    async with harness.FakeOpenAI() as fake:
        cfg = config(fake, store=rs.url, to="redis", max_len=1000)
        async with Gateway(config=cfg, env={"CHATGATE_ADMIN_TOKEN": ADMIN}, name="export-redis") as gw:
            client = await Client.connect(gw)
            user = client.hello["user"]
            with step("a done, an error and a cancelled turn: the stream holds one record each, as the client saw them"):
                t_done = await client.message(f"hello, write to {EMAIL}", mid="m1", room="r1")
                t_done.expect_done()
                t_err = await client.message("please FAIL now", mid="m2", room="r1")
                err = t_err.expect_error("upstream_error")
                t_cancel = await cancelled_turn(client, "SLOW please", "m3", "r2")
                recs = await until(lambda: len(stream_records(rs)) >= 3 and stream_records(rs), "three records")
                check(len(recs) == 3, f"records: {recs}")
                by_id = {r["id"]: r for r in recs}
                check_common(by_id["m1"], t_done, user, "r1", f"hello, write to {EMAIL}", gw)
                check_done(by_id["m1"], t_done)
                rec = by_id["m2"]
                check_common(rec, t_err, user, "r1", "please FAIL now", gw)
                check(rec["end"] == "error" and rec["code"] == err["code"], f"m2: end {rec['end']} code {rec['code']}")
                check(rec["upstream"] == t_err.ack["route"] and rec["reply"] == "", f"m2: {rec}")
                rec = by_id["m3"]
                check_common(rec, t_cancel, user, "r2", "SLOW please", gw)
                seen = "".join(d["text"] for d in t_cancel.deltas)
                check(rec["end"] == "cancelled" and rec["code"] is None, f"m3: end {rec['end']}")
                check(rec["reply"] == seen, f"m3: reply {rec['reply']!r} != what the client got {seen!r}")
                check(rec["seq"] == by_id["m2"]["seq"] + 1 == by_id["m1"]["seq"] + 2, f"seqs: {recs}")
            with step("/metrics counts three records, none dropped"):
                m = await harness.wait_metric(gw, "chatgate_export_records_total", lambda v: v == 3, T)
                check(m.value("chatgate_export_dropped_total") == 0, "dropped")
            with step("DELETE /admin/users/{user} says the stream keeps the user's records"):
                status, body = await admin_forget(gw, user)
                check(status == 200 and "stream" in (body or {}).get("export_kept", ""), f"{status} {body}")
            await client.close()


async def part_file(work):
    path = os.path.join(work, "turns.jsonl")
    async with harness.FakeOpenAI() as fake:
        cfg = config(fake, to="file", path=path, mask=True)
        async with Gateway(config=cfg, env={"CHATGATE_ADMIN_TOKEN": ADMIN}, name="export-file") as gw:
            client = await Client.connect(gw)
            with step("export.mask: the e-mail address is masked in the message and the reply"):
                turn = await client.message(f"mail {EMAIL} please", mid="f1", room="r")
                turn.expect_done()
                check(EMAIL in turn.terminal["text"], f"the echo has the address: {turn.terminal}")
                recs = await until(lambda: file_records(path), "a line in the file")
                rec = recs[0]
                check(rec["id"] == "f1" and rec["end"] == "done", f"{rec}")
                check(EMAIL not in json.dumps(rec), f"the address is in the record: {rec}")
                check("[email]" in rec["text"] and "[email]" in rec["reply"], f"not masked: {rec}")
                check(rec["params"] == turn.ack["params"] and rec["rules"] == turn.ack["rules"], f"{rec}")
            with step("SIGHUP reopens the file the operator renamed"):
                os.rename(path, path + ".old")
                gw.send_signal(signal.SIGHUP)
                await until(lambda: os.path.exists(path), "the file opened again")
                (await client.message("after the rename", mid="f2", room="r")).expect_done()
                recs = await until(lambda: file_records(path), "a line in the new file")
                check([r["id"] for r in recs] == ["f2"], f"new file: {recs}")
                check([r["id"] for r in file_records(path + ".old")] == ["f1"], "the renamed file changed")
            status, body = await admin_forget(gw, client.hello["user"])
            with step("DELETE /admin/users/{user} says the file keeps the user's records"):
                check(status == 200 and "file" in (body or {}).get("export_kept", ""), f"{status} {body}")
            await client.close()

        cfg = config(fake, to="file", path=path + ".notext", texts=False)
        async with Gateway(config=cfg, name="export-notext") as gw:
            client = await Client.connect(gw)
            with step("export.texts false: no text and no reply in the record"):
                (await client.message(f"mail {EMAIL}", mid="n1", room="r")).expect_done()
                rec = (await until(lambda: file_records(path + ".notext"), "a line"))[0]
                check("text" not in rec and "reply" not in rec and rec["id"] == "n1", f"{rec}")
                check(EMAIL not in json.dumps(rec), f"{rec}")
            with step("a message cancelled while it waited in the queue has its record too (end cancelled)"):
                await client.send_message("SLOW please", "q1", room="r")
                await client.recv_type("delta", "q1")
                await client.send_message("the waiting one", "q2", room="r")
                await client.cancel("q2")
                turn = await client.collect_turn("q2")
                check([f["type"] for f in turn.frames] == ["cancelled"], f"q2: {turn.describe()}")
                recs = await until(lambda: [r for r in file_records(path + ".notext") if r["id"] == "q2"], "q2's record")
                check(recs[0]["end"] == "cancelled" and recs[0]["service"] is None and recs[0]["route"] is None,
                      f"q2's record: {recs[0]}")
                await client.cancel("q1")
                await client.collect_turn("q1")
            await client.close()

        rot = os.path.join(work, "rot.jsonl")
        cfg = config(fake, to="file", path=rot, max_bytes=100)
        async with Gateway(config=cfg, name="export-rotate") as gw:
            client = await Client.connect(gw)
            with step("export.max_bytes: past it the file is renamed to FILE.1 and a new one started"):
                (await client.message("one", mid="r1", room="r")).expect_done()
                await until(lambda: [r["id"] for r in file_records(rot + ".1")] == ["r1"], "r1 in FILE.1")
                await until(lambda: os.path.exists(rot), "a new FILE")
                (await client.message("two", mid="r2", room="r")).expect_done()
                await until(lambda: [r["id"] for r in file_records(rot + ".1")] == ["r2"], "r2 in FILE.1")
            await client.close()


async def timed_turn(client, mid):
    started = time.monotonic()
    (await client.message("hi", mid=mid, room="t")).expect_done()
    return time.monotonic() - started


async def part_redis_away():
    rs = harness.RedisServer()
    await rs.astart()
    async with harness.FakeOpenAI() as fake:
        cfg = config(fake, store=rs.url, to="redis", max_queue=5)
        async with Gateway(config=cfg, name="export-away") as gw:
            client = await Client.connect(gw)
            with step("Redis up: turns and their records"):
                base = [await timed_turn(client, f"b{i}") for i in range(5)]
                await harness.wait_metric(gw, "chatgate_export_records_total", lambda v: v == 5, T)
            with step("Redis stopped (SIGSTOP): once the store is degraded, turns take what they took before"):
                rs.pause()
                # the first turn meets the stopped Redis (the store's command timeout, not the export's)
                (await client.message("hi", mid="first", room="t")).expect_done()
                await harness.wait_metric(gw, "chatgate_store_degraded", lambda v: v == 1, T)
                away = [await timed_turn(client, f"s{i}") for i in range(12)]
                limit = max(3 * max(base), max(base) + 0.3)
                check(max(away) < limit, f"turns with Redis stopped took up to {max(away):.3f}s, before "
                                         f"{max(base):.3f}s: {[round(x, 3) for x in away]}")
            with step("past export.max_queue (5) the records are dropped and counted"):
                m = await harness.metrics_of(gw)
                check(m.value("chatgate_export_dropped_total") == 8, f"dropped {m.value('chatgate_export_dropped_total')}")
                check(m.value("chatgate_export_queued") == 5, f"queued {m.value('chatgate_export_queued')}")
                check(m.value("chatgate_export_records_total") == 5, "records")
            with step("Redis back: the five held records reach the stream"):
                rs.resume()
                await harness.wait_metric(gw, "chatgate_export_records_total", lambda v: v == 10, 3 * T)
                ids = [r["id"] for r in stream_records(rs)]
                check(ids[:5] == [f"b{i}" for i in range(5)] and sorted(ids[5:]) == ["first"] + [f"s{i}" for i in range(4)],
                      f"stream ids: {ids}")
            await client.close()


async def part_cluster():
    import redis_topo
    cluster = redis_topo.RedisCluster(n_masters=3, replicas_per_master=0)
    await cluster.astart()
    try:
        async with harness.FakeOpenAI() as fake:
            cfg = config(fake, store=cluster.seeds_url(scheme="redis-cluster"), to="redis")
            async with Gateway(config=cfg, name="export-cluster") as gw:
                client = await Client.connect(gw)
                with step("Redis Cluster: the record goes to the master of the stream key's slot"):
                    turn = await client.message("hello cluster", mid="c1", room="r")
                    turn.expect_done()
                    owner = cluster.master_of_slot(cluster.key_slot("chatgate:export"))
                    recs = await until(lambda: stream_records(owner), "the record on the slot's master")
                    check([r["id"] for r in recs] == ["c1"], f"records: {recs}")
                    check_done(recs[0], turn)
                await client.close()
    finally:
        cluster.stop()


async def main(args):
    work = harness.temp_dir("export")
    await independent(part_redis())
    await independent(part_file(work))
    await independent(part_redis_away())
    await independent(part_cluster())


if __name__ == "__main__":
    harness.run(main, timeout=140)
