"""End-to-end tests of rules on replies (issue 15, item 4; rules/README.md, "Rules on replies").

The rules are the shipped ones plus examples/reply-rules/ (phone, e-mail, stop, tag), in a
temporary directory. The upstream is harness.FakeOpenAI's "ok" behaviour: it streams
"echo: <the message>" one word an event, each in its own TCP writes a few ms apart, so a
number in the message reaches the gateway split across several deltas.

- a phone number split across four deltas ("+254 ", "712 ", "345 ", "678 ") is masked in
  what the client sees (no delta carries any of its digits), in the done frame, and in the
  history (context.get); the done frame's reply_rules says what acted; the text before
  the number was not held back (it came in its own deltas);
- the shipped card rule masks a card number, and an e-mail address is masked, in one reply;
- a stop rule ends the reply with error `blocked`, naming the rule; nothing of the key
  reaches the client; the next message is served as usual;
- a tag rule annotates the done frame without changing the text;
- a reply that nothing matches has no reply_rules and streams as it came;
- /metrics counts the reply rules' hits (once per reply) beside the message rules'.
"""

import asyncio
import os
import shutil

import harness
from harness import Client, Gateway, check, independent, step

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def rules_dir():
    d = str(harness.temp_dir("chatgate-reply-rules-"))
    for src in (os.path.join(ROOT, "rules"), os.path.join(ROOT, "examples", "reply-rules")):
        for name in os.listdir(src):
            if name.endswith(".rules"):
                shutil.copy(os.path.join(src, name), d)
    return d


def text_of(turn):
    return "".join(d.get("text", "") for d in turn.deltas)


def acted(frame):
    return {a["rule"]: a for a in frame.get("reply_rules") or []}


async def part_rules():
    rdir = rules_dir()
    try:
        async with harness.FakeOpenAI() as fake:
            cfg = harness.make_config({"llm": harness.openai_upstream(fake, "ok")}, "llm", rules=rdir)
            async with Gateway(config=cfg, name="reply-rules") as gw:
                client = await Client.connect(gw)
                with step("a phone number split across four deltas is masked in the deltas, the done and the history"):
                    turn = await client.message("call me on +254 712 345 678 please", mid="p1", room="r")
                    turn.expect_done()
                    want = "echo: call me on [phone number] please"
                    streamed = text_of(turn)
                    check(streamed == want, f"the client saw {streamed!r}, want {want!r}")
                    check(turn.terminal["text"] == want, f"done text {turn.terminal['text']!r}")
                    for d in turn.deltas:
                        check(not any(n in d["text"] for n in ("254", "712", "345", "678")),
                              f"a delta carries digits of the number: {d}")
                    got = acted(turn.terminal)
                    check(list(got) == ["reply_phone_number"] and got["reply_phone_number"]["action"] == "mask" and
                          got["reply_phone_number"]["count"] == 1, f"reply_rules: {turn.terminal.get('reply_rules')}")
                    words = [d["text"] for d in turn.deltas]
                    check(len(words) >= 3 and words[0].startswith("echo: ") and "[phone number]" not in words[0],
                          f"the text before the number should not wait for it: {words}")
                    await client.send({"type": "context.get", "room": "r"})
                    ctx = await client.recv_type("context")
                    history = ctx["state"].get("history") or []
                    replies = [m.get("content") for m in history if m.get("role") == "assistant"]
                    check(replies == [want], f"the history's reply should be masked: {replies}")
                    check(fake.requests[-1].reply_text == "echo: call me on +254 712 345 678 please",
                          "the upstream said the number: the gateway masked it")
                with step("the shipped card rule and the e-mail rule in one reply"):
                    turn = await client.message("card 4111 1111 1111 1111 and mail jane.doe@example.com ok",
                                                mid="c1", room="r2")
                    turn.expect_done()
                    want = "echo: card [card number] and mail [e-mail] ok"
                    check(text_of(turn) == want and turn.terminal["text"] == want, f"{text_of(turn)!r}")
                    check(set(acted(turn.terminal)) == {"reply_card_number", "reply_email"},
                          f"reply_rules: {turn.terminal.get('reply_rules')}")
                with step("a stop rule ends the reply with blocked; nothing of the key reaches the client"):
                    turn = await client.message("my key is sk-abcdefghijklmnopqrstuvwxyz thanks", mid="s1", room="r3")
                    term = turn.terminal
                    check(term.get("type") == "error" and term.get("code") == "blocked",
                          f"s1 should end blocked: {turn.describe()}")
                    check(acted(term).get("reply_secret_key", {}).get("action") == "stop",
                          f"the error should name the rule: {term}")
                    check("sk-" not in text_of(turn) and "abcdefgh" not in text_of(turn),
                          f"the key reached the client: {text_of(turn)!r}")
                    check(text_of(turn) == "echo: my key is ", f"the text before the key: {text_of(turn)!r}")
                    after = await client.message("hello again", mid="s2", room="r3")
                    after.expect_done()
                    check(text_of(after) == "echo: hello again", f"{text_of(after)!r}")
                with step("a tag rule annotates the done frame, the text as it came"):
                    turn = await client.message("where is my refund", mid="t1", room="r4")
                    turn.expect_done()
                    check(text_of(turn) == "echo: where is my refund", f"{text_of(turn)!r}")
                    tag = acted(turn.terminal).get("reply_mentions_refund")
                    check(tag == {"rule": "reply_mentions_refund", "action": "tag", "tag": "refund"},
                          f"reply_rules: {turn.terminal.get('reply_rules')}")
                with step("a reply nothing matches: no reply_rules, streamed as it came (not held to its end)"):
                    turn = await client.message("just some words here", mid="n1", room="r5")
                    turn.expect_done()
                    check("reply_rules" not in turn.terminal, f"{turn.terminal}")
                    check(text_of(turn) == "echo: just some words here" and len(turn.deltas) >= 3,
                          f"deltas: {[d['text'] for d in turn.deltas]}")
                with step("/metrics counts each reply rule once per reply it acted on"):
                    _, _, body = await asyncio.to_thread(harness.http_get, gw.http_url + "/metrics")
                    m = harness.parse_metrics(body.decode())
                    for rule, n in (("reply_phone_number", 1), ("reply_card_number", 1), ("reply_email", 1),
                                    ("reply_secret_key", 1), ("reply_mentions_refund", 1)):
                        got = m.value("chatgate_rule_hits_total", rule=rule, file="91-contacts.rules"
                                      if rule != "reply_card_number" else "90-replies.rules")
                        check(got == n, f"chatgate_rule_hits_total{{rule={rule}}} = {got}, want {n}")
                    check(m.value("chatgate_errors_total", code="blocked") == 1, "one blocked error")
                    check(m.value("chatgate_turns_total", end="blocked") == 1 and
                          m.value("chatgate_turns_total", end="error") == 0,
                          "the stopped reply is a blocked turn, not an error one")
    finally:
        shutil.rmtree(rdir, ignore_errors=True)


async def main(args):
    await independent(part_rules())


if __name__ == "__main__":
    harness.run(main, timeout=80)
