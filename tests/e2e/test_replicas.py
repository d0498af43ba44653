"""End-to-end tests of an upstream's replicas, retries and fallback (issue 14, items 1, 2 and
5; docs/configuration.md, "Replicas, retries and fallback").

Three fake OpenAI-compatible servers (harness.FakeOpenAI, each on its own port) are the
replicas of one upstream `llm` (`urls`), balanced by dialog:
- affinity: 50 turns of one dialog all reach one replica; other dialogs spread over the
  three; when the dialog's replica dies (its server stops: connections refused), its next
  turns move, invisibly to the client (done, `attempts` 2 on the first), to one other
  replica, and stay there;
- a replica answering 503/500 and one refusing connections are retried on the next
  replica: every message is answered, the client sees no error, and /metrics counts the
  retries and the replicas marked out;
- a replica that takes the request and never answers is retried once on the next replica
  after `first_byte_timeout_ms`: the next gets the message once, and one retry is counted
  (the stopped transfer's end, heard at once, was taken for a second failure: the message
  went twice to the next replica, one of them unread);
- a 429 with `Retry-After: 30` keeps its replica out for 30 s, not `out_ms`;
- a failure after the first delta (the stream cut) is reported, never retried: the error
  reaches the client and no other replica got that message;
- least_busy: eight messages at once go four to each of two replicas;
- an upstream whose replicas are all gone falls back to its `fallback` upstream: done says
  `upstream` backup and `fallback_from` primary, counted in
  chatgate_upstream_fallbacks_total;
- `urls` with a ws:// URL and a `fallback` naming no upstream are refused at start.
"""

import asyncio
import re

import harness
from harness import Client, Gateway, check, independent, step

T = harness.DEFAULT_TIMEOUT


def config(upstreams, default):
    return harness.make_config(upstreams, default, rate_limit={"messages_per_second": 1000, "burst": 1000})


def upstream(urls, **extra):
    cfg = {"urls": urls, "model": "m", "connect_timeout_ms": 1000, "first_byte_timeout_ms": 2000,
           "idle_timeout_ms": 2000, "out_ms": 2000}
    cfg.update(extra)
    return cfg


def served_by(fakes, before):
    """Which fakes got requests since `before` (their request counts): a list of indexes."""
    return [i for i, f in enumerate(fakes) if len(f.requests) > before[i]]


def counts(fakes):
    return [len(f.requests) for f in fakes]


async def turn_on(client, text, mid, room):
    turn = await client.message(text, mid=mid, room=room)
    turn.expect_done()
    return turn.terminal


def metric(text, name, upstream_name):
    m = re.search(rf'^{name}{{upstream="{upstream_name}"}} (\d+)$', text, re.M)
    return int(m.group(1)) if m else None


async def metrics_text(gw):
    status, _, body = await asyncio.to_thread(harness.http_get, gw.http_url + "/metrics")
    check(status == 200, f"/metrics: {status}")
    return body.decode()


async def part_affinity():
    fakes = [await harness.FakeOpenAI().start() for _ in range(3)]
    try:
        cfg = config({"llm": upstream([f.url("ok") for f in fakes])}, "llm")
        async with Gateway(config=cfg, name="affinity") as gw:
            client = await Client.connect(gw)
            with step("affinity: 50 turns of one dialog all reach one replica"):
                before = counts(fakes)
                for i in range(50):
                    done = await turn_on(client, f"turn {i}", f"a{i}", "trip")
                    check(done.get("upstream") == "llm" and isinstance(done.get("replica"), int),
                          f"done should say upstream llm and its replica: {done}")
                used = served_by(fakes, before)
                check(len(used) == 1, f"one dialog's turns went to replicas {used}: {counts(fakes)}")
                home = used[0]
                check(done["replica"] == home, f"done.replica {done['replica']} is not the one served ({home})")
            with step("other dialogs spread over the replicas"):
                before = counts(fakes)
                for i in range(12):
                    await turn_on(client, "hello", f"r{i}", f"room-{i}")
                check(len(served_by(fakes, before)) >= 2,
                      f"12 dialogs all went to one replica: {counts(fakes)} (before {before})")
            with step("the dialog's replica dies: its next turns move to one other replica, invisibly"):
                await fakes[home].stop()
                before = counts(fakes)
                first = await turn_on(client, "after the death", "d0", "trip")
                check(first.get("attempts") == 2 and first.get("replica") != home,
                      f"the first turn after the death should be retried on another replica: {first}")
                for i in range(1, 10):
                    done = await turn_on(client, f"after {i}", f"d{i}", "trip")
                    check(done["replica"] == first["replica"], f"the dialog moved again: {done} after {first}")
                moved = [i for i in served_by(fakes, before) if i != home]
                check(len(moved) == 1, f"after the death the dialog's turns went to {moved}: {counts(fakes)}")
            with step("/metrics counts the retry and the replica marked out"):
                text = await metrics_text(gw)
                check((metric(text, "chatgate_upstream_retries_total", "llm") or 0) >= 1 and
                      (metric(text, "chatgate_upstream_replica_outs_total", "llm") or 0) >= 1,
                      "chatgate_upstream_retries_total / replica_outs_total should count it:\n" +
                      "\n".join(l for l in text.splitlines() if "replica" in l or "retries" in l))
    finally:
        for f in fakes:
            await f.stop()


async def part_failures():
    fake = await harness.FakeOpenAI().start()
    closed = harness.free_port()
    try:
        urls = [fake.url("err500"), f"http://127.0.0.1:{closed}/v1", fake.url("ok")]
        cfg = config({"llm": upstream(urls, out_ms=100)}, "llm")
        async with Gateway(config=cfg, name="failures") as gw:
            client = await Client.connect(gw)
            with step("a replica answering 500 and one refusing connections are retried: every message is "
                      "answered, no error reaches the client"):
                retried = 0
                for i in range(15):
                    done = await turn_on(client, f"hello {i}", f"f{i}", f"room-{i}")
                    check(done.get("replica") == 2, f"only replica 2 can answer: {done}")
                    retried += done.get("attempts", 1) > 1
                    await asyncio.sleep(0.15)  # past out_ms: the failed replicas are tried again
                check(retried >= 5 and fake.requests_for("err500"),
                      f"the failing replicas should have been tried first for some dialogs: {retried} retried, "
                      f"{len(fake.requests_for('err500'))} requests got 500")
        fake.requests.clear()
        urls = [fake.url("hang"), fake.url("ok")]
        cfg = config({"llm": upstream(urls, first_byte_timeout_ms=300, out_ms=100)}, "llm")
        async with Gateway(config=cfg, name="hang") as gw:
            client = await Client.connect(gw)
            with step("a replica that takes the request and never answers is retried once on the next: the "
                      "next gets the message once, and one retry is counted (the stopped transfer's end is "
                      "not a second failure)"):
                retried = 0
                for i in range(10):
                    before = len(fake.requests_for("ok"))
                    done = await turn_on(client, f"wait {i}", f"h{i}", f"room-{i}")
                    await asyncio.sleep(0.3)  # a second request, if any, would be sent by now
                    got = len(fake.requests_for("ok")) - before
                    check(got == 1, f"message {i} reached the answering replica {got} times: {done}")
                    check(done.get("attempts", 1) <= 2, f"one retry at most with two replicas: {done}")
                    retried += done.get("attempts", 1) == 2
                    await asyncio.sleep(0.15)  # past out_ms: the silent replica is tried again
                text = await metrics_text(gw)
                check(retried >= 2, f"too few dialogs went to the silent replica first ({retried} of 10): the "
                      "test proves nothing")
                check(metric(text, "chatgate_upstream_retries_total", "llm") == retried,
                      f"{retried} messages were retried, /metrics says "
                      f"{metric(text, 'chatgate_upstream_retries_total', 'llm')}")
        fake.requests.clear()
        urls = [fake.url("err429"), fake.url("ok")]
        cfg = config({"llm": upstream(urls, out_ms=100)}, "llm")
        async with Gateway(config=cfg, name="429") as gw:
            client = await Client.connect(gw)
            with step("a 429 with Retry-After: 30 keeps its replica out for 30 s, not out_ms (100 ms)"):
                for i in range(12):
                    await turn_on(client, f"hi {i}", f"q{i}", f"room-{i}")
                    await asyncio.sleep(0.05)
                check(len(fake.requests_for("err429")) == 1,
                      f"after its 429 the replica should stay out: it got {len(fake.requests_for('err429'))} "
                      "requests")
        urls = [fake.url("cutoff"), fake.url("ok")]
        cfg = config({"llm": upstream(urls)}, "llm")
        async with Gateway(config=cfg, name="cutoff") as gw:
            client = await Client.connect(gw)
            with step("a failure after the first delta is reported, never retried"):
                seen = 0
                for i in range(20):
                    before = len(fake.requests_for("ok"))
                    turn = await client.message(f"story {i}", mid=f"c{i}", room=f"room-{i}")
                    if turn.kind != "error":
                        continue
                    seen += 1
                    check(turn.deltas and turn.terminal.get("code") == "upstream_unavailable",
                          f"the cut reply should end in upstream_unavailable after its deltas: {turn.describe()}")
                    check(len(fake.requests_for("ok")) == before,
                          "a message cut after its first delta was sent again to another replica")
                check(seen >= 1, "no dialog went to the cutting replica in 20: the test proves nothing")
    finally:
        await fake.stop()


async def part_fallback():
    fake = await harness.FakeOpenAI().start()
    closed = harness.free_port()
    try:
        primary = upstream([f"http://127.0.0.1:{closed}/v1", f"http://127.0.0.1:{closed}/v2"], fallback="backup")
        cfg = config({"primary": primary, "backup": harness.openai_upstream(fake, "ok")}, "primary")
        async with Gateway(config=cfg, name="fallback") as gw:
            client = await Client.connect(gw)
            with step("every replica refuses: the message goes to the fallback upstream, invisibly"):
                done = await turn_on(client, "hello", "b1", "trip")
                check(done.get("upstream") == "backup" and done.get("fallback_from") == "primary",
                      f"done should say upstream backup, fallback_from primary: {done}")
                check(done.get("text") == "echo: hello", f"the fallback's reply: {done}")
                text = await metrics_text(gw)
                check(metric(text, "chatgate_upstream_fallbacks_total", "primary") == 1,
                      "chatgate_upstream_fallbacks_total{upstream=\"primary\"} should be 1:\n" +
                      "\n".join(l for l in text.splitlines() if "fallbacks" in l))
    finally:
        await fake.stop()


async def part_least_busy():
    fakes = [await harness.FakeOpenAI().start() for _ in range(2)]
    try:
        cfg = config({"llm": upstream([f.url("quick") for f in fakes], balance="least_busy")}, "llm")
        async with Gateway(config=cfg, name="least-busy") as gw:
            clients = [await Client.connect(gw) for _ in range(8)]
            with step("least_busy: eight messages at once go four to each replica, whatever their dialogs, "
                      "three times (by dialog, an even split each time would be a 2% chance)"):
                for rnd in range(3):
                    before = counts(fakes)
                    turns = await asyncio.gather(*(c.message("hello", mid=f"l{rnd}-{i}", room=f"room-{rnd}-{i}")
                                                   for i, c in enumerate(clients)))
                    for t in turns:
                        t.expect_done()
                    split = [n - b for n, b in zip(counts(fakes), before)]
                    check(split == [4, 4], f"round {rnd}: the requests per replica: {split}")
    finally:
        for f in fakes:
            await f.stop()


async def part_config():
    for where, up, why in (
            ("upstreams.llm.urls", {"urls": ["http://127.0.0.1:9/v1", "ws://127.0.0.1:9/app"]}, "OpenAI-compatible"),
            ("upstreams.llm.fallback", {"url": "http://127.0.0.1:9/v1", "fallback": "nope"}, "no other upstream"),
            ("upstreams.llm.balance", {"url": "http://127.0.0.1:9/v1", "balance": "random"}, "least_busy")):
        with step(f"{where}: refused at start ({why!r})"):
            await harness.check_refused(config({"llm": up}, "llm"), where, why)


async def main(args):
    await independent(part_affinity())
    await independent(part_failures())
    await independent(part_fallback())
    await independent(part_least_busy())
    await independent(part_config())


if __name__ == "__main__":
    harness.run(main, timeout=110)
