"""End-to-end test of an OpenAI-compatible upstream the project did not write, with a required
header (issue 13, items 5 and 6): mock-llm (npm @dwmkerr/mock-llm, pinned in
tests/e2e/mockllm/package-lock.json) as the upstream of kind openai, configured by
tests/e2e/mockllm/mock-llm.yaml to answer 401 unless the request carries
`x-portkey-api-key: <key>`, and with it to stream a reply that echoes the last user message
and reports the request's user-agent, host, origin and x-portkey-provider headers.

The gateway's upstream (spec, Upstreams):
    "llm": {"url": "http://127.0.0.1:PORT/v1", "model": "mock-model",
            "headers": {"x-portkey-api-key": {"env": "TEST_PORTKEY_KEY"},
                        "x-portkey-provider": "openai"}}
with TEST_PORTKEY_KEY set for the gateway (a fresh random secret each run).

Through the chatgate.v1 protocol on /ws (a client that sends a browser's Origin):
- mock-llm itself, without the gateway: 401 without the header, the echo with it (the
  fixture works, so a failure below is the gateway's);
- the flight search's second turn reaches mock-llm with the merged params in its system
  message; "stop" while a long reply streams cancels it at once;
- a message gets the streamed reply (several deltas, done.text their concatenation), and
  the request carried the header, `User-Agent: chatgate/<version>` (`chatgate --version`),
  `Host: 127.0.0.1:PORT` with the port, and no Origin (the client's is not passed on);
- the gateway's log (at debug) and /metrics never show the secret in clear;
- a second gateway without the header in its config: the message gets error upstream_error
  with mock-llm's invalid_api_key (mock-llm answers a streaming request's 401 as HTTP 200
  with the error as the stream's one event, so `status` is 200: docs/protocol.md, Errors);
- the env variable unset: the gateway does not start, and says which header lacks it.

mock-llm is installed with `npm ci` into ./mockllm of the current directory (ctest: the
build tree's tests/e2e; run from the repository root or tests/e2e: into tests/e2e/mockllm,
whose node_modules git ignores) unless tests/e2e/mockllm/node_modules has it already; no
other download. The test takes a few seconds (plus the first `npm ci`). Exits 77 (ctest: skipped) when node or npm is missing, unless
CHATGATE_REQUIRE_BROWSER=1 (then it fails).
"""

import asyncio
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import harness
from harness import Client, Gateway, check, free_port, make_config, run, step

HERE = Path(__file__).resolve().parent
PKG = HERE / "mockllm"
ENV_NAME = "TEST_PORTKEY_KEY"
PROVIDER = "openai"


def skip_or_fail(reason):
    print(f"SKIP: {reason}", file=sys.stderr, flush=True)
    sys.exit(1 if os.environ.get("CHATGATE_REQUIRE_BROWSER") == "1" else 77)


def mockllm_modules():
    """The node_modules holding @dwmkerr/mock-llm: tests/e2e/mockllm's when someone ran
    `npm ci` there, else ./mockllm/node_modules, installed there from the package-lock.json
    (harness.npm_modules). Run from the source tree, it installs into tests/e2e/mockllm itself
    (node_modules is git-ignored), not into a new directory of the checkout."""
    in_source = Path.cwd().resolve() in (harness.REPO_ROOT, HERE)
    return harness.npm_modules(PKG, PKG if in_source else Path.cwd() / "mockllm",
                               [Path("@dwmkerr") / "mock-llm" / "package.json"], "@dwmkerr/mock-llm",
                               skip_or_fail)


class NodeProcess:
    """What a node server of these tests shares: its log (self.log_path, written through
    self._log) and its stop (SIGTERM, then SIGKILL after 5 s). test_upstream_portkey.py's
    Portkey is one too."""

    def log_text(self):
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc:
            self._log.close()


class MockLLM(NodeProcess):
    """mock-llm as a subprocess on a free port, with `config_file` (its MOCKLLM_KEY replaced by
    `key`); test_upstream_portkey.py gives it a config of its own."""

    config_file = PKG / "mock-llm.yaml"

    def __init__(self, modules, key):
        self.main = modules / "@dwmkerr" / "mock-llm" / "dist" / "main.js"
        self.key = key
        self.port = free_port()
        self.dir = harness.temp_dir("chatgate-mockllm-")
        self.log_path = self.dir / "mock-llm.log"
        self.proc = None

    @property
    def base(self):
        return f"http://127.0.0.1:{self.port}"

    async def start(self, timeout=15.0):
        check(self.main.is_file(), f"no mock-llm at {self.main}")
        config = self.config_file.read_text().replace("MOCKLLM_KEY", self.key)
        config = config.replace("LONG_STORY", " ".join(["once upon a time"] * 75))
        (self.dir / "mock-llm.yaml").write_text(config)
        env = dict(os.environ, PORT=str(self.port), HOST="127.0.0.1")
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(["node", str(self.main), "--config", str(self.dir / "mock-llm.yaml")],
                                     cwd=self.dir, env=env, stdin=subprocess.DEVNULL,
                                     stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while True:
            status, _, _ = await asyncio.to_thread(http, self.base + "/health", timeout=1)
            if status == 200:
                return self
            if self.proc.poll() is not None or time.monotonic() > deadline:
                harness.fail(f"mock-llm did not start on port {self.port} (status {self.proc.poll()}):\n"
                             f"{self.log_text()[-2000:]}")
            await asyncio.sleep(0.1)

    def stop(self):
        NodeProcess.stop(self)
        shutil.rmtree(self.dir, ignore_errors=True)


def http(url, method="GET", headers=None, body=None, timeout=10):
    """harness.http_request with the body as text, and (0, {}, "") when nothing answers yet."""
    try:
        status, got, data = harness.http_request(url, method, headers, body, timeout)
    except OSError:
        return 0, {}, ""
    return status, got, data.decode(errors="replace")


def sse_text(body):
    """The concatenated delta contents and the error events of an SSE body."""
    text, errors = "", []
    for line in body.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        if "error" in event:
            errors.append(event["error"])
        for choice in event.get("choices", []):
            text += choice.get("delta", {}).get("content") or ""
    return text, errors


def expected_reply(text, version, port, origin="null"):
    return (f"echo: {text} | user-agent=chatgate/{version} | host=127.0.0.1:{port} | origin={origin} | "
            f"provider={PROVIDER}")


def upstream_config(mock, with_key=True):
    headers = {"x-portkey-provider": PROVIDER}
    if with_key:
        headers = {"x-portkey-api-key": {"env": ENV_NAME}, **headers}
    return {"llm": {"url": f"{mock.base}/v1", "model": "mock-model", "headers": headers,
                    "connect_timeout_ms": 3000, "first_byte_timeout_ms": 5000, "idle_timeout_ms": 5000}}


MODULES = None  # set before run(): installing may exit 77 (skipped)


async def main(args):
    modules = MODULES
    proc = await asyncio.to_thread(subprocess.run, [args.gateway, "--version"], capture_output=True, text=True)
    match = re.search(r"\b(\d+\.\d+\.\d+\S*)", proc.stdout + proc.stderr)
    check(proc.returncode == 0 and match, f"`chatgate --version` said {proc.stdout + proc.stderr!r}")
    version = match.group(1)
    key = "pk-" + secrets.token_hex(16)  # the secret: only in the gateway's environment and mock-llm's rule
    mock = MockLLM(modules, key)
    try:
        with step(f"start mock-llm ({modules}/@dwmkerr/mock-llm) with mock-llm.yaml"):
            await mock.start()
        with step("mock-llm on its own: 401 without the header, the streamed echo with it"):
            url = mock.base + "/v1/chat/completions"
            req = {"model": "m", "messages": [{"role": "user", "content": "ping"}]}
            status, _, body = await asyncio.to_thread(http, url, "POST", {"Content-Type": "application/json"}, req)
            check(status == 401 and "invalid_api_key" in body, f"mock-llm without the key: {status} {body[:300]}")
            status, _, body = await asyncio.to_thread(
                http, url, "POST", {"Content-Type": "application/json", "x-portkey-api-key": key,
                                    "User-Agent": "probe/1"}, dict(req, stream=True))
            text, errors = sse_text(body)
            check(status == 200 and not errors and text.startswith("echo: ping | user-agent=probe/1 | "
                                                                   f"host=127.0.0.1:{mock.port} | origin=null"),
                  f"mock-llm with the key: {status} {text!r} {errors}")

        env = {ENV_NAME: key, "CHATGATE_NOW": "2026-02-03T10:00:00Z"}  # "next week" of the flight search
        gw = Gateway(config=make_config(upstream_config(mock), "llm", log_level="debug"), env=env,
                     name="gateway:with-key")
        async with gw:
            origin = f"http://127.0.0.1:{gw.port}"
            client = await Client.connect(gw, origin=origin)
            with step("a message through the gateway gets mock-llm's streamed reply"):
                text = "Hello mock, are you there?"
                turn = await client.message(text, mid="m1", room="r1")
                turn.expect_done()
                want = expected_reply(text, version, mock.port)
                got = turn.terminal.get("text")
                if got != want:
                    harness.fail(f"the reply should be {want!r}\n got {got!r}"
                                 + (" (mock-llm answered 401: the header did not reach it)"
                                    if "invalid_api_key" in json.dumps(turn.frames) or "401" in str(got) else ""))
                check(len(turn.deltas) >= 3, f"the reply came in {len(turn.deltas)} deltas, mock-llm streams "
                                             f"12 characters a chunk: {turn.describe()}")
            with step("the request carried x-portkey-api-key (else 401), "
                      f"User-Agent chatgate/{version}, Host 127.0.0.1:{mock.port}, no Origin"):
                # each of these is in `want` above; checked one by one for a clear message
                for part, what in ((f"user-agent=chatgate/{version} ", "User-Agent"),
                                   (f"host=127.0.0.1:{mock.port} ", "Host (with the port)"),
                                   ("origin=null ", "no Origin (the client's " + origin + " is not passed on)"),
                                   (f"provider={PROVIDER}", "x-portkey-provider")):
                    check(part in got, f"{what}: mock-llm reported {got!r}")
            with step("a second message on the same connection (a kept-alive connection carries them too)"):
                turn = await client.message("And again?", mid="m2", room="r1")
                turn.expect_done()
                check(turn.terminal.get("text") == expected_reply("And again?", version, mock.port),
                      f"second reply {turn.terminal.get('text')!r}")
            with step("the flight search: its second turn reaches mock-llm with the merged params in the system "
                      "message (else mock-llm's echo rule answers)"):
                t1 = await client.message("Find me flights from Nairobi to London next week", mid="f1", room="trip")
                t1.expect_done()
                t2 = await client.message("What about returning on Feb 20?", mid="f2", room="trip")
                t2.expect_done()
                check(t2.terminal.get("text") == "merged: Nairobi London 2026-02-10 2026-02-20",
                      f"mock-llm did not see the merged params in the system message: {t2.terminal.get('text')!r}")
            with step("a cancel phrase while mock-llm streams a long reply: that reply is cancelled at once"):
                await client.send_message("tell me a long story", "s1", "story")
                await client.recv_type("delta", "s1")
                started = time.monotonic()
                await client.send_message("stop", "s2", "story")
                first = await client.collect_turn("s1", timeout=5.0)
                took = time.monotonic() - started
                check(first.kind == "cancelled", f"s1 should be cancelled by 'stop': {first.describe()}")
                check(took < 1.0, f"s1 was cancelled {took:.2f}s after 'stop' (its reply had 1.5 s to go)")
                harness.check_turn_done(await client.collect_turn("s2"))
            await client.close()
            metrics = await asyncio.to_thread(http, gw.http_url + "/metrics")
        with step("the gateway's log (at debug) and /metrics never show the key in clear"):
            check(key not in metrics[2], "the key is in /metrics")
            log = gw.log_text()
            check(log.strip(), "the gateway's log is empty")
            check(key not in log, f"the key {key[:6]}... is in the gateway's log:\n" +
                  "\n".join(line for line in log.splitlines() if key in line)[:1000])
            check(key[3:] not in log and key[-12:] not in log, "a part of the key is in the gateway's log")

        gw2 = Gateway(config=make_config(upstream_config(mock, with_key=False), "llm"), env=env,
                      name="gateway:without-key")
        async with gw2:
            client = await Client.connect(gw2)
            with step("without the header in the config: error upstream_error, mock-llm's invalid_api_key"):
                turn = await client.message("Hello without a key", mid="n1", room="r1")
                err = turn.expect_error("upstream_error")
                check(err.get("upstream_code") == "invalid_api_key" and err.get("upstream_type") == "invalid_request_error",
                      f"the error should carry mock-llm's type and code: {harness.brief(err)}")
                check("401 Unauthorized" in err.get("message", ""), f"the message should quote mock-llm's: {harness.brief(err)}")
                # mock-llm sends a streaming request's error as HTTP 200 + one error event
                check(err.get("status") == 200, f"status should be 200 (the stream began, then failed): {harness.brief(err)}")
                check(not turn.deltas, f"deltas before the error: {turn.describe()}")
            await client.close()

        with step(f"the env variable {ENV_NAME} unset: the gateway does not start and names the header"):
            code, output, _ = await harness.gateway_exit(make_config(upstream_config(mock), "llm"), env={})
            check(code != 0, f"the gateway started without {ENV_NAME} (status {code}): {output[-500:]}")
            check(ENV_NAME in output or "x-portkey-api-key" in output,
                  f"the startup error does not name the header or the variable: {output[-500:]!r}")
            check(key not in output, "the startup error shows the key")
    finally:
        mock.stop()


if __name__ == "__main__":
    os.environ.pop(ENV_NAME, None)  # only the gateways this test starts get it
    MODULES = mockllm_modules()
    run(main, timeout=75)
