"""End-to-end tests of usage accounting (issue 14, item 4; docs/configuration.md, "Usage").

A fake OpenAI-compatible server (harness.FakeOpenAI) reports each reply's usage
(prompt_tokens: the words of the request's messages; completion_tokens: the reply's words).

- memory store: turns in two rooms of one user; `GET /admin/users/{user}/usage` gives, by
  room and upstream, exactly the sums of what the server reported (in, out, turns), and the
  total; /metrics `chatgate_tokens_total{upstream,service,direction}` adds up to the same,
  the travel service's turns under service="travel";
- a reply cancelled mid-stream counts what streamed: out is the streamed text's estimate
  (4 bytes a token), never zero, and the turn is counted;
- Redis store: the usage is kept with the dialog: after a restart of the gateway on the same
  redis-server, the admin API still gives the same sums; another user's usage is apart;
- the admin API: a user with no dialogs has empty usage; no token: 401.
"""

import asyncio
import json
import urllib.parse

import harness
from harness import Client, Gateway, check, independent, step

T = harness.DEFAULT_TIMEOUT
ADMIN = "usage-admin-token"
FLIGHT1 = "Find me flights from Nairobi to London next week"
FLIGHT2 = "What about returning on Feb 20?"


def config(fake, store="memory", default="llm"):
    ups = {"llm": harness.openai_upstream(fake, "ok"), "slow": harness.openai_upstream(fake, "slow")}
    return harness.state_config(ups, default, store=store)


async def admin_usage(gw, user, token=ADMIN):
    url = f"{gw.http_url}/admin/users/{urllib.parse.quote(user, safe='')}/usage"
    status, _, body = await asyncio.to_thread(harness.http_request, url,
                                              headers={"Authorization": f"Bearer {token}"})
    return status, (json.loads(body) if body else None)


def reported(fake, since=0):
    """What the fake reported for its ok requests from index `since`: (in, out, turns)."""
    reqs = [r for r in fake.requests[since:] if r.behaviour == "ok" and getattr(r, "usage", None)]
    return (sum(r.usage["prompt_tokens"] for r in reqs), sum(r.usage["completion_tokens"] for r in reqs), len(reqs))


async def converse(client, fake, room, texts, prefix):
    since = len(fake.requests)
    for i, text in enumerate(texts):
        turn = await client.message(text, mid=f"{prefix}{i}", room=room)
        turn.expect_done()
    return reported(fake, since)


def as_tuple(u):
    return (u.get("in"), u.get("out"), u.get("turns")) if isinstance(u, dict) else None


def metric_sum(text, direction, service=None):
    total = 0
    for line in text.splitlines():
        if line.startswith("chatgate_tokens_total{") and f'direction="{direction}"' in line and \
                'upstream="llm"' in line and (service is None or f'service="{service}"' in line):
            total += int(line.rsplit(" ", 1)[1])
    return total


async def part_memory():
    async with harness.FakeOpenAI() as fake:
        async with Gateway(config=config(fake), env={"CHATGATE_ADMIN_TOKEN": ADMIN, "CHATGATE_NOW":
                                                     "2026-02-03T10:00:00Z"}, name="usage-memory") as gw:
            client = await Client.connect(gw)
            user = client.hello["user"]
            with step("turns in two rooms: the admin API gives exactly what the server reported, by room and in all"):
                a = await converse(client, fake, "trip", [FLIGHT1, FLIGHT2, "and a hotel?"], "a")
                b = await converse(client, fake, "chat", ["hello there", "how are you today?"], "b")
                status, body = await admin_usage(gw, user)
                check(status == 200, f"usage: {status} {body}")
                got_a = as_tuple(body["rooms"].get("trip", {}).get("llm"))
                got_b = as_tuple(body["rooms"].get("chat", {}).get("llm"))
                check(got_a == a and got_b == b, f"by room: trip {got_a} (reported {a}), chat {got_b} (reported {b})")
                total = tuple(x + y for x, y in zip(a, b))
                check(as_tuple(body["total"].get("llm")) == total, f"total {body['total']} (reported {total})")
            with step("/metrics: chatgate_tokens_total adds up to the same, the flight turns under service travel"):
                status, _, text = await asyncio.to_thread(harness.http_get, gw.http_url + "/metrics")
                text = text.decode()
                check(metric_sum(text, "in") == total[0] and metric_sum(text, "out") == total[1],
                      "chatgate_tokens_total should add up to the reported tokens:\n" +
                      "\n".join(l for l in text.splitlines() if l.startswith("chatgate_tokens_total")))
                check(metric_sum(text, "in", "travel") > 0, "the travel turns should be under service=\"travel\"")
            with step("a user with no dialogs: empty usage; no token: 401"):
                status, body = await admin_usage(gw, "nobody-here")
                check(status == 200 and body["rooms"] == {} and body["total"] == {}, f"{status} {body}")
                status, _ = await admin_usage(gw, user, token="wrong")
                check(status == 401, f"without the token: {status}")


async def part_cancelled():
    async with harness.FakeOpenAI() as fake:
        async with Gateway(config=config(fake, default="slow"), env={"CHATGATE_ADMIN_TOKEN": ADMIN},
                           name="usage-cancel") as gw:
            client = await Client.connect(gw)
            with step("a reply cancelled mid-stream counts what streamed (estimated: no usage came)"):
                await client.send_message("tell me a long story", "s1", "story")
                for _ in range(4):  # a few words streamed (the fake's are 0.1 s apart), then the cancel
                    await client.recv_type("delta", "s1")
                await client.cancel("s1")
                turn = await client.collect_turn("s1")
                check(turn.kind == "cancelled", f"s1 should be cancelled: {turn.describe()}")
                streamed = sum(len(d.get("text", "").encode()) for d in turn.deltas)
                status, body = await admin_usage(gw, client.hello["user"])
                story = as_tuple(body["rooms"].get("story", {}).get("slow")) if status == 200 else None
                check(story is not None and story[2] == 1 and story[1] == (streamed + 3) // 4 and story[0] > 0,
                      f"the cancelled turn: {story} ({status} {body}), {streamed} bytes streamed "
                      f"(out should be {(streamed + 3) // 4})")


async def part_redis():
    redis = await harness.RedisServer().astart()
    try:
        async with harness.FakeOpenAI() as fake:
            cfg = config(fake, store=redis.url)
            env = {"CHATGATE_ADMIN_TOKEN": ADMIN, "CHATGATE_RESUME_SECRET": "usage-secret"}
            async with Gateway(config=cfg, env=env, name="usage-redis-1") as gw:
                client = await Client.connect(gw)
                user = client.hello["user"]
                other = await Client.connect(gw)
                with step("Redis: two users' turns; each one's usage is its own"):
                    mine = await converse(client, fake, "trip", ["hello", "one more", "and another"], "m")
                    theirs = await converse(other, fake, "trip", ["hi"], "o")
                    status, body = await admin_usage(gw, user)
                    check(status == 200 and as_tuple(body["total"].get("llm")) == mine, f"{status} {body} ({mine})")
                    status, body = await admin_usage(gw, other.hello["user"])
                    check(as_tuple(body["total"].get("llm")) == theirs, f"the other user: {body} ({theirs})")
            async with Gateway(config=cfg, env=env, name="usage-redis-2") as gw:
                with step("after a restart on the same Redis, the usage is still there (kept with the dialog)"):
                    status, body = await admin_usage(gw, user)
                    check(status == 200 and as_tuple(body["rooms"].get("trip", {}).get("llm")) == mine and
                          not body.get("degraded"), f"after the restart: {status} {body} ({mine})")
    finally:
        redis.stop()


async def main(args):
    await independent(part_memory())
    await independent(part_cancelled())
    await independent(part_redis())


if __name__ == "__main__":
    harness.run(main, timeout=100)
