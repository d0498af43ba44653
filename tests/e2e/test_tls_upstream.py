"""End-to-end test of upstreams over TLS signed by a private CA: tls_ca_file (docs/upstreams.md, "Upstreams
over TLS"; issue 12, item 3: TLS session reuse).

Debian's openssl makes a CA and a certificate it signed for 127.0.0.1 (harness.tls_server);
the test's own servers serve with it: the fake OpenAI server over https, the fake app over
wss, the drop-in chat app (dropin_app.py) over wss. Covers:
- tls_ca_file names a missing file, a file with no certificate, a certificate that does not
  parse, a FIFO no one writes to (read at once, never waited on) or a directory: the
  gateway refuses to start, naming the key (or the flag) and what is wrong (test_config
  reads `--config` from a pipe, as `<(...)` gives, the same way);
- https without tls_ca_file: the turn fails, saying the certificate's issuer is unknown;
  with it: three turns answered on one kept connection (/metrics: opened 1, reused 2);
- https with max_idle_connections 0 (a new connection for every message): the second and
  third connections resume the first one's TLS session (the server sees it resumed;
  /metrics: chatgate_upstream_tls_resumed_total 2);
- a wss app upstream, and a drop-in app over wss: a whole turn each with tls_ca_file;
- a wss app at an IPv6 literal (wss://[::1]:P/app; lws 4.1.6 checks such a host as "[", the
  gateway checks the address itself): a turn when the certificate is for ::1, refused
  ("hostname mismatch") when it is for 127.0.0.1 alone. Left out, with a note, on a machine
  without IPv6 loopback.
"""

import asyncio
import os
import socket
import tempfile

import harness
from dropin_app import ChatApp, ChatClient
from harness import Client, FakeApp, FakeOpenAI, check, step

T = harness.DEFAULT_TIMEOUT


async def metric(gw, name, upstream):
    status, _, raw = await asyncio.to_thread(harness.http_get, gw.http_url + "/metrics")
    check(status == 200, f"GET /metrics: {status}")
    return harness.parse_metrics(raw.decode()).value(name, upstream=upstream)


async def config_errors(where, ca):
    broken = f"{where}/broken.pem"
    lines = open(ca).read().splitlines()
    lines[3] = "!" * len(lines[3])  # a line of the certificate's base64 body
    open(broken, "w").write("\n".join(lines) + "\n")
    fifo = f"{where}/fifo.pem"
    os.mkfifo(fifo)
    cases = ((f"{where}/none.pem", "cannot read", "No such file"),
             (f"{where}/key.pem", "holds no PEM certificate", None),
             (broken, "certificate 1 does not parse", None),
             (fifo, "holds no PEM certificate", None),  # no writer: read at once, not waited on
             (where, "cannot read", "Is a directory"))
    for path, says, also in cases:
        with step(f"tls_ca_file {path}: refused at start ({says})"):
            cfg = harness.make_config({"d": harness.demo_upstream()}, "d", tls_ca_file=path)
            code, out, cfg_path = await harness.gateway_exit(cfg)
            check(code == 2 and f"{cfg_path}: tls_ca_file: " in out and says in out and (also or "") in out,
                  f"exit {code}, expected 2 naming '{cfg_path}: tls_ca_file' and saying {says!r}: {out}")
    with step("--tls-ca-file with a missing file: refused, naming the flag"):
        code, out, _ = await harness.gateway_exit(None, ["--tls-ca-file", f"{where}/none.pem"])
        check(code == 2 and "--tls-ca-file: cannot read" in out, f"exit {code}: {out}")


async def https(ca, tls):
    async with FakeOpenAI(tls=tls) as fake:
        llm = {"llm": harness.openai_upstream(fake, "ok")}
        async with harness.Gateway([], harness.make_config(llm, "llm"), name="gw-no-ca") as gw:
            client = await Client.connect(gw)
            with step("https without tls_ca_file: upstream_unavailable, the issuer unknown"):
                err = (await client.message("hello", mid="n1")).expect_error("upstream_unavailable")
                check("unable to get local issuer certificate" in err.get("message", ""),
                      f"the error should say why: {harness.brief(err)}")
            await client.close()
        async with harness.Gateway([], harness.make_config(llm, "llm", tls_ca_file=ca), name="gw-ca") as gw:
            client = await Client.connect(gw)
            with step("tls_ca_file at start: the gateway says how many CA certificates it read"):
                check("tls_ca_file " + ca + ": 1 CA certificate trusted besides the system's" in gw.log_text(),
                      "the start-up log should name the file and the count")
            with step("https with tls_ca_file: 3 turns on one kept TLS connection"):
                before = len(fake.connections)
                for i in range(3):
                    turn = (await client.message(f"hello {i}", mid=f"k{i}")).expect_done()
                    check(turn.terminal.get("text") == f"echo: hello {i}", f"the reply: {turn.describe()}")
                conns = len(fake.connections) - before
                check(conns == 1, f"1 connection expected, the server had {conns}")
                for key, want in (("opened_total", 1), ("reused_total", 2)):
                    got = await metric(gw, f"chatgate_upstream_connections_{key}", "llm")
                    check(got == want, f"/metrics connections_{key} for llm: {got}, expected {want}")
            await client.close()
        fresh = {"fresh": harness.openai_upstream(fake, "ok", max_idle_connections=0)}
        async with harness.Gateway([], harness.make_config(fresh, "fresh", tls_ca_file=ca), name="gw-fresh") as gw:
            client = await Client.connect(gw)
            with step("max_idle_connections 0: a connection a message, each after the first resumes TLS"):
                before = len(fake.connections)
                for i in range(3):
                    (await client.message(f"fresh {i}", mid=f"f{i}")).expect_done()
                conns = fake.connections[before:]
                check(len(conns) == 3, f"3 connections expected, the server had {len(conns)}")
                resumed = [c.tls_resumed for c in conns]
                check(resumed == [False, True, True], f"TLS sessions resumed, by connection: {resumed}")
                got = await metric(gw, "chatgate_upstream_tls_resumed_total", "fresh")
                check(got == 2, f"/metrics chatgate_upstream_tls_resumed_total for fresh: {got}, expected 2")
            await client.close()


async def wss(ca, tls):
    async with FakeApp(tls=tls) as app:
        cfg = harness.make_config({"app": harness.app_upstream(app, "/app")}, "app", tls_ca_file=ca)
        async with harness.Gateway([], cfg, name="gw-wss") as gw:
            client = await Client.connect(gw)
            with step("a wss app upstream with tls_ca_file: a whole turn"):
                turn = (await client.message("hello over wss", mid="w1")).expect_done()
                check(turn.terminal.get("text") == "app got: hello over wss", f"the reply: {turn.describe()}")
                check(len(app.connections) == 1, f"the app should have one connection: {len(app.connections)}")
            await client.close()


def has_ipv6_loopback():
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


async def ipv6_literal(where, ca, tls):
    if not has_ipv6_loopback():
        print("   no IPv6 loopback (::1) on this machine: the IPv6 literal cases are left out")
        return
    other_ca, other_tls = harness.tls_server(where, names="IP:127.0.0.1")
    cases = (("for ::1", ca, tls, None), ("for 127.0.0.1 alone", other_ca, other_tls, "hostname mismatch"))
    for name, case_ca, case_tls, refused in cases:
        async with FakeApp(tls=case_tls, host="::1") as app:
            cfg = harness.make_config({"app": harness.app_upstream(app, "/app")}, "app", tls_ca_file=case_ca)
            async with harness.Gateway([], cfg, name="gw-wss-v6") as gw:
                client = await Client.connect(gw)
                with step(f"wss://[::1] with a certificate {name}: " + (f"refused ({refused})" if refused else "a turn")):
                    turn = await client.message("hello over IPv6", mid="v1")
                    if refused:
                        err = turn.expect_error("upstream_unavailable")
                        check(f"its TLS certificate was refused: {refused}" in err.get("message", "") and
                              "not for the host of the URL" in err.get("message", ""),
                              f"the error should say why: {harness.brief(err)}")
                    else:
                        turn.expect_done()
                        check(turn.terminal.get("text") == "app got: hello over IPv6", f"the reply: {turn.describe()}")
                await client.close()


async def dropin(ca, tls):
    async with ChatApp(tls=tls) as app:
        cfg = {"upstreams": {"demo": "demo"}, "log_level": "info", "tls_ca_file": ca,
               "dropin": {"path": "/socket", "app": app.url, "subprotocols": ["chat.v2"],
                          "forward_headers": ["Cookie"],
                          "client": {"chat": {"pointer": "/kind", "equals": "say"}, "text": "/body",
                                     "room": "/conversation", "id": "/msg_id"},
                          "app_frames": {"text": "/body", "id": "/reply_to",
                                         "end": {"pointer": "/kind", "equals": "end"}}}}
        async with harness.Gateway(config=cfg, name="gw-dropin-wss") as gw:
            with step("a drop-in app over wss with tls_ca_file: its client's turn goes through"):
                client = await ChatClient.connect(gw.ws_url("/socket"), app.issue_sid())
                await client.say("Hello over wss", "c1", "lobby")
                reply = await client.read_reply("c1", T)
                check(reply.kind == "end", f"the reply should end: {reply.frames}")
                check(len(app.sessions) == 1 and app.sessions[0].say("c1") is not None,
                      "the app should have got the say through the gateway")
                await client.close()


async def main(args):
    where = tempfile.mkdtemp(prefix="chatgate-e2e-tls-ca-")
    ca, tls = harness.tls_server(where)
    await config_errors(where, ca)
    await https(ca, tls)
    await wss(ca, tls)
    await ipv6_literal(tempfile.mkdtemp(prefix="chatgate-e2e-tls-ca2-"), ca, tls)
    await dropin(ca, tls)


if __name__ == "__main__":
    harness.run(main, timeout=80)
