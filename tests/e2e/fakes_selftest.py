"""Self-test of the e2e harness's fake upstreams; needs no gateway.

Talks to FakeOpenAI with a plain HTTP/1.1 client (chunked decoding and SSE parsing written
here, independently of the fake) and to FakeApp with a websockets client, so that a failure
of an e2e test can be blamed on the gateway, not on a fake:
- ok: the SSE events reassemble to "echo: <text>", usage and [DONE] arrive, request recorded
  (path, Authorization, JSON body);
- err500 / err401: status and error body;
- garbage: data lines that are not JSON;
- hang: no answer, and closing the client is recorded as the request's close;
- slow: closing mid-stream is recorded within a moment;
- huge: a client that stops reading stalls the writer (the fake honours backpressure);
- app /app, /error, /garbage, /close, /slow with cancel.
"""

import asyncio
import json
import time

import websockets

import harness
from harness import check, step


async def http_post(port, path, body, headers=None, read=True):
    """POST and return (status, headers, body bytes de-chunked), or the open streams."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
    for k, v in (headers or {}).items():
        head += f"{k}: {v}\r\n"
    writer.write(head.encode() + b"\r\n" + data)
    await writer.drain()
    if not read:
        return reader, writer
    status_line = await reader.readline()
    status = int(status_line.split()[1])
    hdrs = {}
    while True:
        line = (await reader.readline()).decode().strip()
        if not line:
            break
        k, _, v = line.partition(":")
        hdrs[k.strip().lower()] = v.strip()
    body = b""
    if hdrs.get("transfer-encoding") == "chunked":
        while True:
            size = int((await reader.readline()).split(b";")[0], 16)
            piece = await reader.readexactly(size + 2)
            if size == 0:
                break
            body += piece[:-2]
    else:
        body = await reader.readexactly(int(hdrs["content-length"]))
    writer.close()
    return status, hdrs, body


def parse_sse(body):
    """Data payloads of an SSE body (LF or CRLF line ends, comments skipped)."""
    text = body.decode().replace("\r\n", "\n")
    out = []
    for block in text.split("\n\n"):
        data = [line[5:].lstrip(" ") for line in block.split("\n") if line.startswith("data:")]
        if data:
            out.append("\n".join(data))
    return out


async def main(args):
    async with harness.FakeOpenAI() as fake, harness.FakeApp() as app:
        with step("ok streams echo over SSE and records the request"):
            body = {"model": "m", "stream": True,
                    "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hello big world"}]}
            status, hdrs, raw = await http_post(fake.port, "/ok/v1/chat/completions", body,
                                                {"Authorization": "Bearer sk-x"})
            check(status == 200 and hdrs["content-type"] == "text/event-stream", f"{status} {hdrs}")
            check(b"\r\n" in raw and b": keep-alive" in raw, "CRLF and comment expected")
            events = parse_sse(raw)
            check(events[-1] == "[DONE]", events[-1])
            text, usage = "", None
            for ev in events[:-1]:
                obj = json.loads(ev)
                if obj.get("usage"):
                    usage = obj["usage"]
                for ch in obj["choices"]:
                    text += ch["delta"].get("content") or ""
            check(text == "echo: hello big world", repr(text))
            req = fake.requests[-1]
            check(req.path == "/ok/v1/chat/completions" and req.behaviour == "ok", req.describe())
            check(req.headers["authorization"] == "Bearer sk-x", req.describe())
            check(req.last_user_text == "hello big world" and req.json["stream"] is True, req.describe())
            check(usage == req.usage and usage["completion_tokens"] == 4, f"{usage} {req.usage}")
            check(req.reply_text == text, req.reply_text)

        with step("err500 / err401 / garbage"):
            status, _, raw = await http_post(fake.port, "/err500/v1/chat/completions", {"messages": []})
            check(status == 500 and json.loads(raw)["error"]["message"] == "model overloaded", raw)
            status, _, raw = await http_post(fake.port, "/err401/v1/chat/completions", {"messages": []})
            check(status == 401 and json.loads(raw)["error"]["message"] == "invalid api key", raw)
            status, _, raw = await http_post(fake.port, "/garbage/v1/chat/completions", {"messages": []})
            check(status == 200 and parse_sse(raw) == ["this is not json"] * 3, raw)

        with step("hang records the close of the client"):
            reader, writer = await http_post(fake.port, "/hang/v1/chat/completions", {"messages": []}, read=False)
            req = await fake.next_request("hang")
            check(not await req.wait_closed(0.3), "hang closed on its own")
            t0 = time.monotonic()
            writer.close()
            check(await req.wait_closed(1.0), "close not recorded")
            check(req.closed_at - t0 < 0.2, f"close recorded late: {req.closed_at - t0:.3f}s")

        with step("slow records a client going away mid-stream"):
            n = len(fake.requests)
            reader, writer = await http_post(fake.port, "/slow/v1/chat/completions", {"messages": []}, read=False)
            req = await fake.next_request("slow", after=n)
            await asyncio.sleep(0.35)
            t0 = time.monotonic()
            writer.close()
            check(await req.wait_closed(1.0), "close not recorded")
            await asyncio.sleep(0.25)
            check(req.aborted and req.finished_at is None, "slow should stop writing")
            print(f"   close seen after {req.closed_at - t0:.3f}s; {req.bytes_written} bytes written")

        with step("huge stalls when the client stops reading"):
            fake.huge_total = 8 * 1024 * 1024
            n = len(fake.requests)
            import socket
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
            sock.setblocking(False)
            await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", fake.port))
            reader, writer = await asyncio.open_connection(sock=sock, limit=2**16)
            data = json.dumps({"messages": []}).encode()
            writer.write(b"POST /huge/v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(data) + data)
            await reader.read(1000)
            req = await fake.next_request("huge", after=n)
            await asyncio.sleep(1.0)
            w1 = req.bytes_written
            await asyncio.sleep(1.0)
            w2 = req.bytes_written
            print(f"   written while client paused: {w1} then {w2} bytes of {fake.huge_total}")
            check(w2 == w1 and w2 < fake.huge_total // 2, "the fake does not stall")
            total = 0
            while True:
                piece = await reader.read(1 << 20)
                if not piece:
                    break
                total += len(piece)
                if b"[DONE]" in piece[-40:]:
                    break
            check(req.huge_content_bytes == fake.huge_total, "huge did not finish")
            writer.close()

        with step("app: /app, /error, /garbage, /close, /slow + cancel"):
            async with websockets.connect(app.url("/app")) as ws:
                await ws.send(json.dumps({"type": "message", "id": "a1", "text": "hi there"}))
                frames = []
                while True:
                    f = json.loads(await ws.recv())
                    frames.append(f)
                    if f["type"] == "done":
                        break
                text = "".join(f["text"] for f in frames if f["type"] == "delta")
                check(text == "app got: hi there" == frames[-1]["text"], frames)
            async with websockets.connect(app.url("/error")) as ws:
                await ws.send(json.dumps({"type": "message", "id": "e1", "text": "x"}))
                check(json.loads(await ws.recv()) == {"type": "error", "id": "e1", "message": "backend exploded"}, "error")
            async with websockets.connect(app.url("/garbage")) as ws:
                await ws.send(json.dumps({"type": "message", "id": "g1", "text": "x"}))
                check(await ws.recv() == "this is not json {", "garbage")
            async with websockets.connect(app.url("/close")) as ws:
                await ws.send(json.dumps({"type": "message", "id": "c1", "text": "x"}))
                try:
                    await asyncio.wait_for(ws.recv(), 2)
                    check(False, "expected a close")
                except websockets.ConnectionClosed:
                    pass
            async with websockets.connect(app.url("/slow")) as ws:
                await ws.send(json.dumps({"type": "message", "id": "s1", "text": "x"}))
                await ws.recv()
                await ws.recv()
                await ws.send(json.dumps({"type": "cancel", "id": "s1"}))
                await asyncio.sleep(0.1)
                with_drain = 0
                try:
                    while True:
                        await asyncio.wait_for(ws.recv(), 0.3)
                        with_drain += 1
                except asyncio.TimeoutError:
                    pass
                check(with_drain <= 1, f"slow kept sending after cancel: {with_drain}")
            await asyncio.sleep(0.1)
            conn = app.connections[-1]
            check(conn.cancels and conn.cancels[0][0] == "s1", conn.cancels)
            check(app.opened == 5 and app.closed == 5, f"opened {app.opened} closed {app.closed}")


if __name__ == "__main__":
    harness.run(main, timeout=60)
