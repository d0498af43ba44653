"""End-to-end test: a slow client must not make the gateway buffer an upstream's reply.

A client with a small receive side (websockets max_queue=1, read_limit=64 KiB, SO_RCVBUF
64 KiB) asks the fake OpenAI /huge upstream, which streams 20 MB of content (16 KiB per SSE
event) as fast as its socket accepts, then stops reading for 5 s. Meanwhile the gateway's
RSS (VmRSS) and the bytes the upstream managed to write are sampled every 0.25 s.

Covers (docs/architecture.md, Back-pressure and bounds: slow clients get a bounded queue):
- backpressure reaches the upstream: the upstream writer stalls during the pause (less than
  1 MB written in the last 2 s of it) and has written well under the 20 MB by its end;
- the gateway's RSS grows by less than 32 MB over its baseline during the pause;
- after the client resumes reading, the reply completes: done arrives, and the deltas add up
  to the whole 20 MB with nothing lost or reordered (done.text is the whole reply, or a prefix
  of it marked "truncated": true when the gateway caps it with max_reply_bytes);
- the same for a reply resumed after a lost connection, read slowly by the connection that
  resumed it: the upstream stalls, RSS stays bounded, then the reply comes whole.
Prints "slow client: peak gateway RSS X kB (baseline Y kB), upstream bytes written while
paused Z". ASan's quarantine is capped for this gateway (ASAN_OPTIONS) so that freed memory
held by ASan is not mistaken for buffering.
"""

import asyncio
import socket
import time

import harness
from harness import Client, check, step

TOTAL = 20 * 1024 * 1024
EVENT = 16 * 1024
PAUSE = 5.0
SAMPLE = 0.25
MAX_RSS_GROWTH_KB = 32 * 1024
MAX_WRITTEN_BY_PAUSE_END = TOTAL // 2
MAX_WRITTEN_LAST_2S = 1024 * 1024


async def small_socket(port):
    """A connected TCP socket with a small receive buffer (the kernel then buffers little)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    return sock


async def main(args):
    async with harness.FakeOpenAI() as fake:
        fake.huge_total = TOTAL
        fake.huge_event = EVENT
        config = harness.make_config(
            {"huge": harness.openai_upstream(fake, "huge", first_byte_timeout_ms=5000,
                                             idle_timeout_ms=60000)}, "huge")
        env = harness.asan_env(quarantine_size_mb=1, malloc_context_size=5)
        async with harness.Gateway([], config, env=env) as gw:
            sock = await small_socket(gw.port)
            client = await Client.connect(gw, sock=sock, max_queue=1, read_limit=2**16, max_size=2**26)
            tracker = client.track()
            await asyncio.sleep(0.2)  # the RSS baseline once the connection has settled
            baseline = gw.rss_kb()

            with step(f"client stops reading for {PAUSE:.0f}s while /huge streams {TOTAL >> 20} MB"):
                await client.send_message("flood me", "h1")
                await client.recv_type("ack", "h1")
                await client.recv_type("delta", "h1")
                req = await fake.next_request("huge")
                paused_at = time.monotonic()
                written_at_pause = req.bytes_written
                peak = baseline
                samples = []
                while time.monotonic() - paused_at < PAUSE:
                    await asyncio.sleep(SAMPLE)  # the RSS sampling period
                    rss = gw.rss_kb()
                    peak = max(peak, rss)
                    samples.append((round(time.monotonic() - paused_at, 2), rss, req.bytes_written))
                resumed_at = time.monotonic()
                written_end = req.bytes_written
                written_2s_before = req.bytes_written_at(resumed_at - 2.0)
                print(f"slow client: peak gateway RSS {peak} kB (baseline {baseline} kB), "
                      f"upstream bytes written while paused {written_end - written_at_pause} "
                      f"({written_end} in all by the end of the pause, of {TOTAL})")
                print("   samples (s, RSS kB, upstream bytes): "
                      + " ".join(f"{t}:{r}:{w}" for t, r, w in samples[::4]))
                check(req.finished_at is None and not req.aborted,
                      "the upstream reply ended during the pause: the gateway buffered it all "
                      f"or dropped it (aborted={req.aborted})")
                check(written_end - written_2s_before < MAX_WRITTEN_LAST_2S,
                      f"the upstream kept writing during the pause ({written_end - written_2s_before} "
                      f"bytes in its last 2 s): backpressure did not reach it")
                check(written_end < MAX_WRITTEN_BY_PAUSE_END,
                      f"the upstream wrote {written_end} of {TOTAL} bytes while the client was not reading")
                check(peak - baseline < MAX_RSS_GROWTH_KB,
                      f"gateway RSS grew by {peak - baseline} kB (limit {MAX_RSS_GROWTH_KB} kB)")

            with step("client resumes reading: done arrives, the deltas add up to the whole reply"):
                turn = await client.collect_turn("h1", timeout=60)
                check(turn.kind == "done", f"expected done after resuming, got {harness.brief(turn.terminal)}")
                pattern = "abcdefghijklmnopqrstuvwxyz0123456789"
                piece = (pattern * (EVENT // len(pattern) + 1))[:EVENT]
                deltas = "".join(f["text"] for f in client.received
                                 if f.get("type") == "delta" and f.get("id") == "h1")
                check(len(deltas) == TOTAL, f"the deltas carry {len(deltas)} characters, the upstream sent {TOTAL}")
                check(deltas == piece * (TOTAL // EVENT), "the reply's content was altered or reordered")
                # done.text is the whole reply, or a prefix marked "truncated" (max_reply_bytes);
                # the tracker has checked it against all the deltas.
                check(tracker.terminal("h1") is turn.terminal, "test bug: the tracker missed the done")
                done = turn.terminal
                print(f"   done.text: {len(done['text'])} characters"
                      + (" (truncated: true)" if done.get("truncated") else ""))
                print(f"   resumed: {len(deltas)} delta characters, done after "
                      f"{time.monotonic() - resumed_at:.2f}s; RSS now {gw.rss_kb()} kB")
            await client.check_alive()
            await client.close()

        async with harness.Gateway([], config, env=env, name="gateway:resumed") as gw:
            await resumed_slow(fake, gw)


async def resumed_slow(fake, gw):
    """The same for a reply resumed on another connection (resume.h): the old connection
    stops reading (a phone that lost its network: it still looks open), a new one resumes the
    reply (taking it over) and reads slowly: the reply must pause for it as for its own."""
    sock = await small_socket(gw.port)
    first = await Client.connect(gw, sock=sock, max_queue=1, read_limit=2**16, max_size=2**26)
    token = first.hello["resume"]
    await first.send_message("flood me, then lose me", "r1")
    await first.recv_type("ack", "r1")
    d = await first.recv_type("delta", "r1")  # and nothing more is read on this connection
    req = await fake.next_request("huge", after=len(fake.requests) - 1)
    sock2 = await small_socket(gw.port)
    client = await Client.connect(f"{gw.url}?resume={token}", expect_user=token.split(".")[0], sock=sock2,
                                  max_queue=1, read_limit=2**16, max_size=2**26)
    baseline = gw.rss_kb()
    with step(f"a resumed reply whose new connection stops reading for {PAUSE:.0f}s: the upstream stalls too"):
        await client.send({"type": "resume", "id": "r1", "after": d["seq"]})
        await client.recv_type("delta", "r1")
        paused_at = time.monotonic()
        peak = baseline
        while time.monotonic() - paused_at < PAUSE:
            await asyncio.sleep(SAMPLE)  # the RSS sampling period
            peak = max(peak, gw.rss_kb())
        resumed_at = time.monotonic()
        written_end = req.bytes_written
        written_2s_before = req.bytes_written_at(resumed_at - 2.0)
        print(f"   resumed slow client: peak RSS {peak} kB (baseline {baseline} kB), upstream wrote "
              f"{written_end - written_2s_before} bytes in the pause's last 2 s ({written_end} in all)")
        check(req.finished_at is None and not req.aborted, "the upstream reply ended during the pause")
        check(written_end - written_2s_before < MAX_WRITTEN_LAST_2S,
              f"the upstream kept writing for a resumed reply nobody read ({written_end - written_2s_before} "
              f"bytes in the pause's last 2 s): backpressure did not reach it")
        check(peak - baseline < MAX_RSS_GROWTH_KB, f"gateway RSS grew by {peak - baseline} kB")
    with step("the resumed connection reads again: the rest comes, the reply whole once"):
        turn = await client.collect_turn("r1", timeout=60)
        check(turn.kind == "done", f"expected done, got {harness.brief(turn.terminal)}")
        text = d["text"] + "".join(f["text"] for f in turn.deltas)
        check(len(text) == TOTAL, f"the reply came back {len(text)} characters long, of {TOTAL}")
    await client.close()


if __name__ == "__main__":
    harness.run(main, timeout=110)
