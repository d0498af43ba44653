"""End-to-end test of tool results handed back (issue 40, item 2; docs/state.md, "The state
directive"; rules/README.md, "Conditions").

The third reference scenario: "Show me my transactions", then "filter for food". A bank app
(a WebSocket chat app of this test, written as that scenario's orchestrator) answers the
first with the transactions and keeps them as the dialog's last tool result (its done's state
directive); the follow-up is read by a rule that fires only while the last tool result is a
transactions list (`when tool.type transactions`), and the app filters the list it gets back
in the message frame, keeping the filtered list as the new tool result. Checked, with the
memory store and with a real redis-server:
- the message frame of every turn carries `last_tool_result` (null before any); the rule's
  param reaches the app; the app's filtered list comes back in the next turn;
- "filter for food" in another room (no tool result) fires no rule and carries null;
- `when soft.KEY VALUE`: a rule fires on the soft context the app set;
- a directive whose tool result is over `tool_result_cap` is refused whole (warning
  too_large, the kept tool result unchanged);
- an OpenAI-compatible upstream gets the tool result in its system message (a rule routes
  "llm: ..." to it in the same room);
- at --log-level debug, one line a turn names its rules and params (never their values),
  what the store's load found, the upstream and the times (issue 40, item 4);
- the history keeps the rules that fired on a user's message and the upstream that answered;
  upstreams.NAME.history_n 2 gives the LLM two of the dialog's messages (issue 40, item 4).
"""

import json
import os
import re
import shutil

import harness
from harness import Client, check, independent, step

TRANSACTIONS = [
    {"id": "t1", "category": "food", "amount": 12},
    {"id": "t2", "category": "travel", "amount": 300},
    {"id": "t3", "category": "food", "amount": 7},
]
RULES = r"""
rule filter_transactions
  match ^\s*(?:filter|show\s+only)\s+(?:for\s+)?(?<category>\p{L}+)
  do params transactions
  type category lower
  when tool.type transactions
  expect "filter for food" category=food

rule that_venue
  match ^\s*that\s+one\s*$
  do params venues
  when soft.last_action added_venue

rule to_llm
  match ^llm:
  do route llm
"""
CAP = 2048


class BankApp(harness.WsServer):
    """The reference's orchestrator as a chat app: the transactions, a filter of the list it
    gets back, soft context on request; records every message frame."""

    def __init__(self):
        super().__init__()
        self.frames = {}

    async def _handler(self, ws):
        async for raw in ws:
            frame = json.loads(raw)
            if frame.get("type") != "message":
                continue
            self.frames[frame["id"]] = frame
            text, state = frame["text"], None
            tool = frame.get("last_tool_result")
            category = frame.get("params", {}).get("category")
            if text == "Show me my transactions":
                reply, state = "Here are your last 3 transactions", {
                    "last_tool_result": {"type": "transactions", "items": TRANSACTIONS}}
            elif text == "add the venue":
                reply, state = "Added", {"soft_context": {"last_action": "added_venue"}}
            elif text == "a huge result":
                reply, state = "Too much", {"soft_context": {"last_action": "huge"},
                                            "last_tool_result": {"type": "huge", "blob": "x" * CAP}}
            elif category and isinstance(tool, dict) and tool.get("type") == "transactions":
                kept = [t for t in tool["items"] if t["category"] == category]
                reply, state = f"I have filtered your results: {json.dumps(kept)}", {
                    "last_tool_result": {"type": "transactions", "items": kept}}
            else:
                reply = f"app got: {text}"
            await ws.send(json.dumps({"type": "delta", "id": frame["id"], "text": reply}))
            done = {"type": "done", "id": frame["id"], "text": reply}
            if state:
                done["state"] = state
            await ws.send(json.dumps(done))


def rules_dir():
    d = str(harness.temp_dir("chatgate-tool-rules-"))
    with open(os.path.join(d, "50-bank.rules"), "w") as f:
        f.write(RULES)
    return d


async def part_tool_results(store, redis=None):
    tag = f"[{store}]"
    rdir = rules_dir()
    try:
        async with BankApp() as app, harness.FakeOpenAI() as fake:
            upstreams = {"app": {"url": app.url("/bank")},
                         "llm": dict(harness.openai_upstream(fake, "script"), history_n=2)}
            config = harness.state_config(upstreams, "app", store=redis.url if redis else "memory",
                                          tool_result_cap=CAP)
            async with harness.Gateway(["--rules", rdir, "--log-level", "debug"], config, name=f"gateway:{store}") as gw:
                client = await Client.connect(gw)
                with step(f"{tag} 'Show me my transactions': no tool result yet; the app keeps the list"):
                    t = await client.message("Show me my transactions", mid="b1", room="bank")
                    t.expect_done()
                    check("last_tool_result" in app.frames["b1"] and app.frames["b1"]["last_tool_result"] is None,
                          f"the first frame should carry last_tool_result null: {harness.brief(app.frames['b1'])}")
                with step(f"{tag} 'filter for food': the rule fires on the tool result, the app filters it"):
                    t = await client.message("filter for food", mid="b2", room="bank")
                    t.expect_done()
                    check(t.ack.get("rules") == ["filter_transactions"] and t.ack.get("service") == "transactions",
                          f"the ack should name filter_transactions and service transactions: {t.ack}")
                    fwd = app.frames["b2"]
                    check(fwd["last_tool_result"] == {"type": "transactions", "items": TRANSACTIONS},
                          f"the app should get the kept transactions back: {harness.brief(fwd, 600)}")
                    check(fwd["params"] == {"category": "food"}, f"params {fwd['params']}")
                    food = [x for x in TRANSACTIONS if x["category"] == "food"]
                    check(t.terminal.get("text") == f"I have filtered your results: {json.dumps(food)}",
                          f"reply {t.terminal.get('text')!r}")
                with step(f"{tag} --log-level debug: one line for the turn, rule and param names, no values"):
                    line = await harness.wait_condition(
                        lambda: next((l for l in gw.log_text().splitlines() if "debug turn b2:" in l), None),
                        5, "the debug line of turn b2")
                    check(re.search(r"turn b2: dialog #[0-9a-f]{8}, rules filter_transactions, service transactions "
                                    r"params category, store found the dialog in [0-9.]+ ms, upstream app \(replica -1, "
                                    r"1 attempt\(s\)\), first text at [0-9.]+ ms, [0-9.]+ ms in all, done$", line)
                          and "food" not in line, f"the trace line: {line!r}")
                with step(f"{tag} the filtered list is the tool result the next turn gets"):
                    t = await client.message("show only travel", mid="b3", room="bank")
                    t.expect_done()
                    check(app.frames["b3"]["last_tool_result"] == {"type": "transactions", "items": food},
                          f"the next turn should get the filtered list: {harness.brief(app.frames['b3'], 600)}")
                    check(t.terminal.get("text") == "I have filtered your results: []", f"{t.terminal}")
                    hist = app.frames["b3"]["history"]
                    check(hist[-2].get("rules") == ["filter_transactions"] and hist[-2].get("role") == "user"
                          and hist[-1].get("upstream") == "app" and "rules" not in hist[0],
                          f"history keeps the rules that fired and who answered: {harness.brief(hist, 800)}")
                with step(f"{tag} the same words in another room (no tool result): no rule, null"):
                    t = await client.message("filter for food", mid="o1", room="other")
                    t.expect_done()
                    check(t.ack.get("rules") == [] and app.frames["o1"]["last_tool_result"] is None,
                          f"ack {t.ack}, frame {harness.brief(app.frames['o1'])}")
                with step(f"{tag} `when soft.last_action added_venue`: fires only once the app set it"):
                    t = await client.message("that one", mid="v0", room="venues")
                    check(t.ack.get("rules") == [], f"no soft context yet: {t.ack}")
                    (await client.message("add the venue", mid="v1", room="venues")).expect_done()
                    t = await client.message("that one", mid="v2", room="venues")
                    check(t.ack.get("rules") == ["that_venue"], f"the soft rule should fire: {t.ack}")
                with step(f"{tag} a tool result over tool_result_cap: the directive is refused whole"):
                    t = await client.message("a huge result", mid="h1", room="bank")
                    warn = [w for w in t.warnings if w.get("code") == "too_large"]
                    check(warn and "tool_result_cap" in warn[0].get("message", ""),
                          f"a too_large warning naming tool_result_cap expected: {t.describe()}")
                    t = await client.message("show only food", mid="h2", room="bank")
                    check(app.frames["h2"]["last_tool_result"] == {"type": "transactions", "items": []},
                          f"the kept tool result should be unchanged: {harness.brief(app.frames['h2'], 600)}")
                    check(app.frames["h2"]["soft_context"] is None,
                          f"nothing of the refused directive is kept: {app.frames['h2']['soft_context']}")
                with step(f"{tag} an OpenAI-compatible upstream gets the tool result in its system message"):
                    n = len(fake.requests)
                    t = await client.message("llm: what did I spend?", mid="l1", room="bank")
                    t.expect_done()
                    msgs = (await fake.next_request("script", after=n)).messages
                    system = msgs[0].get("content", "") if msgs and msgs[0].get("role") == "system" else ""
                    check('"last_tool_result":{"type":"transactions","items":[]}' in system,
                          f"the system message should hold the last tool result: {system!r}")
                    roles = [m.get("role") for m in msgs]
                    check(roles == ["system", "user", "assistant", "user"] and all(set(m) == {"role", "content"}
                                                                                for m in msgs),
                          f"history_n 2 on the LLM: two of the dialog's messages, role and content only: {roles}")
                await client.close()
    finally:
        shutil.rmtree(rdir, ignore_errors=True)


async def part_redis():
    async with harness.RedisServer() as redis:
        await part_tool_results("redis", redis)


async def main(args):
    await independent(part_tool_results("memory"))
    await independent(part_redis())


if __name__ == "__main__":
    harness.run(main, timeout=90)
