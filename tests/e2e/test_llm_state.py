"""End-to-end test of state set by an LLM (issue 40, item 3; docs/upstreams.md, "State from the
model"): an OpenAI-compatible upstream with `state_tool` offers the model the function
chatgate_state; a call of it is a state directive, applied as an app's, never shown to the
client, and the next user message resolves against it.

The model is a scripted OpenAI-compatible server (harness.FakeOpenAI with a behaviour of this
test): by the last message of the request it streams text and/or a chatgate_state call whose
arguments come in pieces, as OpenAI's API streams them. Checked, with the shipped rules:
- the payment confirmation of docs/scenarios.md driven by the model: "Send 5000 KES to
  +254712345678" -> the model asks and calls chatgate_state (service payment, its params,
  awaiting confirmation); the client sees the question only; "yes" resolves the
  confirmation (ack.resolution), goes back to the model, whose system message says what the
  message resolves and the kept params; the model's next call clears awaiting and keeps a
  tool result;
- the hotel selection with a model that only calls the function (no text, finish_reason
  tool_calls): the gateway asks again with the call and a tool message, tool_choice none,
  and streams that reply; "the second one" resolves to the second option; a continuation
  that gets no answer at all ends in upstream_unavailable, not a "200 without events";
- the model's call keeps what the user said about themselves in the user's profile;
- arguments that are not a JSON object: a warning bad_frame, nothing kept, the reply done;
- an upstream without state_tool: no `tools` in its request, and a call in its answer is
  ignored (nothing kept).
"""

import json
import os

import harness
from harness import Client, check, chunk, completion_chunk, context_command, independent, sse_event, step

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAYMENT = {"amount": 5000, "currency": "KES", "recipient": "+254712345678"}
HOTELS = [{"name": "Park Hyatt", "district": "Shinjuku"}, {"name": "Aman", "district": "Otemachi"}]


def tool_chunk(index, arguments, call_id=None):
    call = {"index": index, "function": {"arguments": arguments}}
    if call_id:
        call.update(id=call_id, type="function")
        call["function"]["name"] = "chatgate_state"
    return completion_chunk({"tool_calls": [call]})


class ScriptedModel(harness.FakeOpenAI):
    """The `model` behaviour: what it answers by the request's last message."""

    async def _do_model(self, conn, req):
        last = req.messages[-1] if req.messages else {}
        text, call = "", None
        if last.get("role") == "tool" and req.last_user_text == "Find me a hotel, then fail":
            conn.writer.transport.abort()  # the continuation gets no answer at all
            req.aborted = True
            return False
        if last.get("role") == "tool":
            text = "I found two hotels: 1. Park Hyatt 2. Aman. Which one?"
        elif req.last_user_text == "Send 5000 KES to +254712345678":
            text = "Shall I send 5000 KES to +254712345678? Please confirm."
            call = {"service": "payment", "params": PAYMENT,
                    "awaiting": {"type": "confirmation", "context": {"action": "send_money"}}}
        elif req.last_user_text == "yes":
            text = "Sent 5000 KES."
            call = {"awaiting": None, "last_tool_result": {"type": "payment", "status": "sent"}}
        elif req.last_user_text in ("Find me a hotel in Tokyo", "Find me a hotel, then fail"):
            call = {"service": "hotels", "awaiting": {"type": "selection", "options": HOTELS}}
        elif req.last_user_text == "the second one":
            text = "Booked the Aman."
        elif req.last_user_text == "I live in Nairobi, call me Sam":
            text, call = "Noted, Sam.", {"profile": {"name": "Sam", "home_city": "Nairobi"}}
        elif req.last_user_text == "broken call":
            text, call = "Oops.", "{not json"
        else:
            text = "echo: " + str(req.last_user_text)
        if not await self._sse_head(conn, req):
            return False
        events = [completion_chunk({"role": "assistant", "content": None if call and not text else ""})]
        events += [completion_chunk({"content": w}) for w in harness.words_of(text)] if text else []
        if call is not None:
            args = call if isinstance(call, str) else json.dumps(call)
            thirds = [args[:len(args) // 3], args[len(args) // 3:2 * len(args) // 3], args[2 * len(args) // 3:]]
            events.append(tool_chunk(0, thirds[0], call_id="call_1"))
            events += [tool_chunk(0, piece) for piece in thirds[1:]]
        events.append(completion_chunk({}, "tool_calls" if call is not None else "stop"))
        req.reply_text = text
        for ev in events:
            if not await self._write(conn, req, chunk(sse_event(ev))):
                return False
        ok = (await self._write(conn, req, chunk(sse_event(self._usage(req, 5))))
              and await self._write(conn, req, chunk(b"data: [DONE]\n\n"))
              and await self._write(conn, req, b"0\r\n\r\n"))
        return ok


def tool_names(req):
    return [t.get("function", {}).get("name") for t in (req.json or {}).get("tools", [])]


def system_of(req):
    msgs = req.messages
    return msgs[0].get("content", "") if msgs and msgs[0].get("role") == "system" else ""


def text_of(turn):
    return "".join(d.get("text", "") for d in turn.deltas)


async def part_model_state():
    async with ScriptedModel() as model:
        upstreams = {"llm": dict(harness.openai_upstream(model, "model"), state_tool=True),
                     "plain": harness.openai_upstream(model, "model")}
        config = harness.state_config(upstreams, "llm")
        async with harness.Gateway(["--rules", os.path.join(ROOT, "rules")], config, name="gateway") as gw:
            client = await Client.connect(gw)
            with step("the model asks for a confirmation and calls chatgate_state: the client sees the question only"):
                n = len(model.requests)
                t = await client.message("Send 5000 KES to +254712345678", mid="p1", room="pay")
                t.expect_done()
                req = await model.next_request("model", after=n)
                check(tool_names(req) == ["chatgate_state"] and req.json.get("tool_choice") == "auto",
                      f"the request should offer chatgate_state: {harness.brief(req.json.get('tools'), 400)}")
                want = "Shall I send 5000 KES to +254712345678? Please confirm."
                check(text_of(t) == want and t.terminal.get("text") == want,
                      f"the client should get the question alone: {t.describe()}")
                check(not t.warnings and "chatgate_state" not in json.dumps(t.frames),
                      f"nothing of the call reaches the client: {t.describe()}")
                ctx = await context_command(client, "context.get", "pay")
                check(ctx["awaiting"] and ctx["awaiting"].get("type") == "confirmation"
                      and ctx["awaiting"].get("source") == "llm" and ctx["service"] == "payment"
                      and ctx["params"].get("payment") == PAYMENT,
                      f"the model's directive should be kept: {harness.brief(ctx, 600)}")
            with step("'yes' resolves the confirmation; the model hears it in its system message"):
                n = len(model.requests)
                t = await client.message("yes", mid="p2", room="pay")
                t.expect_done()
                check(t.ack.get("resolution") == {"type": "confirmation", "confirmed": True},
                      f"ack.resolution {t.ack.get('resolution')}")
                system = system_of(await model.next_request("model", after=n))
                check('"this_message_resolves":{"type":"confirmation","confirmed":true}' in system
                      and '"recipient":"+254712345678"' in system,
                      f"the system message should say what 'yes' resolves and the params: {system!r}")
                ctx = await context_command(client, "context.get", "pay")
                check(ctx["awaiting"] is None and ctx["last_tool_result"] == {"type": "payment", "status": "sent"},
                      f"the model's second call: awaiting cleared, the tool result kept: {harness.brief(ctx, 600)}")
            with step("a model that only calls the function: asked again with the call, its reply streams"):
                n = len(model.requests)
                t = await client.message("Find me a hotel in Tokyo", mid="h1", room="hotel")
                t.expect_done()
                first = await model.next_request("model", after=n)
                again = await model.next_request("model", after=n + 1)
                check(first.json.get("tool_choice") == "auto" and again.json.get("tool_choice") == "none",
                      f"tool_choice auto, then none: {first.json.get('tool_choice')}, {again.json.get('tool_choice')}")
                roles = [m.get("role") for m in again.messages]
                check(roles[-2:] == ["assistant", "tool"]
                      and again.messages[-2]["tool_calls"][0]["function"]["name"] == "chatgate_state"
                      and again.messages[-1].get("tool_call_id") == "call_1",
                      f"the second request should end with the call and a tool message: {harness.brief(again.messages[-2:], 600)}")
                want = "I found two hotels: 1. Park Hyatt 2. Aman. Which one?"
                check(t.terminal.get("text") == want and text_of(t) == want, f"{t.describe()}")
            with step("the continuation after a call, answered with nothing at all (the connection reset): "
                      "the upstream sent no answer (upstream_unavailable), not a 200 without events (the first "
                      "answer's status was kept)"):
                t = await client.message("Find me a hotel, then fail", mid="hf", room="hotelfail")
                check(t.kind == "error" and t.terminal.get("code") == "upstream_unavailable"
                      and "200" not in t.terminal.get("message", ""),
                      f"a continuation that got no answer: {t.describe()}")
            with step("'the second one' resolves the model's selection"):
                t = await client.message("the second one", mid="h2", room="hotel")
                t.expect_done()
                check(t.ack.get("resolution") == {"type": "selection", "index": 2, "option": HOTELS[1]},
                      f"ack.resolution {t.ack.get('resolution')}")
                check(t.terminal.get("text") == "Booked the Aman.", f"{t.describe()}")
            with step("the model keeps what the user said about themselves in the profile"):
                t = await client.message("I live in Nairobi, call me Sam", mid="s1", room="self")
                t.expect_done()
                await client.send({"type": "profile.get"})
                frame = await client.next_matching(lambda f: f.get("type") == "profile", 5, "the profile")
                check(frame["profile"] == {"name": "Sam", "home_city": "Nairobi"}, f"{frame}")
            with step("arguments that are not a JSON object: warning bad_frame, nothing kept, done"):
                t = await client.message("broken call", mid="b1", room="broken")
                t.expect_done()
                check([w.get("code") for w in t.warnings] == ["bad_frame"], f"{t.describe()}")
                ctx = await context_command(client, "context.get", "broken")
                check(ctx["service"] is None and ctx["awaiting"] is None, f"{harness.brief(ctx, 400)}")
            await client.close()
        config = harness.state_config(upstreams, "plain")
        async with harness.Gateway(["--rules", os.path.join(ROOT, "rules")], config, name="gateway:plain") as gw:
            client = await Client.connect(gw)
            with step("an upstream without state_tool: no tools offered, a call in its answer ignored"):
                n = len(model.requests)
                t = await client.message("Send 5000 KES to +254712345678", mid="q1", room="plain")
                t.expect_done()
                req = await model.next_request("model", after=n)
                check("tools" not in req.json and "tool_choice" not in req.json,
                      f"no tools without state_tool: {harness.brief(req.json, 300)}")
                ctx = await context_command(client, "context.get", "plain")
                check(ctx["awaiting"] is None and ctx["last_tool_result"] is None,
                      f"no awaiting from an upstream without state_tool (the params are the rules'): "
                      f"{harness.brief(ctx, 400)}")
            await client.close()


async def main(args):
    await independent(part_model_state())


if __name__ == "__main__":
    harness.run(main, timeout=60)
