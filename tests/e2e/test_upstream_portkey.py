"""End-to-end test of the self-hosted Portkey example of docs/upstreams.md, "Upstream headers":
chatgate -> the self-hosted Portkey gateway (npm @portkey-ai/gateway 1.15.2, pinned in
tests/e2e/portkey/package-lock.json) -> an OpenAI-compatible provider at the address in
`x-portkey-custom-host`, here mock-llm (npm @dwmkerr/mock-llm, as in
tests/e2e/test_upstream_mockllm.py, whose install and helpers this test imports) configured
by tests/e2e/portkey/mock-llm.yaml to answer 401 unless the request carries
`Authorization: Bearer <key>`, and with it to stream a reply that echoes the last user
message, the model and the request's user-agent.

The gateway's upstream is that example's, with the ports the test picked:
    "portkey-local": {"url": "http://127.0.0.1:PKPORT/v1", "model": "llama3.1",
                      "api_key_env": "PROVIDER_API_KEY",
                      "headers": {"x-portkey-provider": "openai",
                                  "x-portkey-custom-host": "http://127.0.0.1:MOCKPORT/v1"}}
with PROVIDER_API_KEY set for the gateway (a fresh random secret each run): the self-hosted
Portkey keeps no keys of its own and passes the bearer token on to the provider.

- Portkey on its own, without chatgate: a streaming chat completion with the example's headers
  streams mock-llm's reply (the fixture works, so a failure below is chatgate's);
- through chatgate (chatgate.v1 on /ws): a message gets done with mock-llm's reply, streamed
  (several deltas) through Portkey, and mock-llm saw Portkey's user-agent, not chatgate's;
- not tried: the hosted-service example's headers alone (no x-portkey-custom-host), which
  makes Portkey look up api.openai.com; a test sends nothing past this machine.

Portkey 1.15.2 from npm as such answers a streaming chat completion to the openai provider
(chatgate always streams) with 500 {"status":"failure","message":"Something went wrong"} (its log: "TypeError:
immutable" in updateHeaders) when npm gives it @hono/node-server 1.14.2 or later, as its
"^1.3.3" now does (Portkey-AI/gateway issue 1389); tests/e2e/portkey/package.json holds
@hono/node-server at 1.14.1 (npm "overrides"). Its postinstall (patch-package) does nothing
for an npm install (the package ships no patches/), so it is installed with --ignore-scripts.
Portkey has no option for its listen address: it listens on all interfaces (port PKPORT) for
the few seconds of the test. It takes 127.0.0.1 and localhost as custom hosts by default (a
private address such as 10.x or 192.168.x only when named in its TRUSTED_CUSTOM_HOSTS).

Portkey and mock-llm are installed with `npm ci` into ./portkey and ./mockllm of the current
directory (ctest: the build tree's tests/e2e; run from the repository root or tests/e2e: into
tests/e2e/portkey and tests/e2e/mockllm, whose node_modules git ignores) unless
tests/e2e/portkey/node_modules (tests/e2e/mockllm/node_modules) has it already; no other
download. The test takes a few seconds (plus the first `npm ci`). Exits 77 (ctest: skipped)
when node or npm is missing, unless CHATGATE_REQUIRE_BROWSER=1 (then it fails).
"""

import asyncio
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import harness
from harness import Client, Gateway, check, free_port, make_config, run, step
from test_upstream_mockllm import MockLLM, NodeProcess, http, mockllm_modules, skip_or_fail, sse_text

HERE = Path(__file__).resolve().parent
PKG = HERE / "portkey"
ENV_NAME = "PROVIDER_API_KEY"  # the example's api_key_env (docs/upstreams.md)
MODEL = "llama3.1"  # the example's model (docs/upstreams.md)
GATEWAY_PKG = Path("@portkey-ai") / "gateway"


def portkey_modules():
    """The node_modules holding @portkey-ai/gateway: tests/e2e/portkey's when someone ran
    `npm ci` there, else ./portkey/node_modules, installed there from the package-lock.json
    (harness.npm_modules, as mockllm_modules does for mock-llm)."""
    in_source = Path.cwd().resolve() in (harness.REPO_ROOT, HERE)
    return harness.npm_modules(PKG, PKG if in_source else Path.cwd() / "portkey",
                               [GATEWAY_PKG / "package.json"], "@portkey-ai/gateway", skip_or_fail)


class ProviderMock(MockLLM):
    """mock-llm with tests/e2e/portkey/mock-llm.yaml (a bearer token) instead of the one of
    test_upstream_mockllm.py (x-portkey-api-key, which Portkey does not pass on)."""

    config_file = PKG / "mock-llm.yaml"

    def requests(self):
        """How many chat completions mock-llm has been sent (its log has a line for each)."""
        return self.log_text().count("POST /v1/chat/completions")


class Portkey(NodeProcess):
    """The self-hosted Portkey gateway as a subprocess on a free port (--headless: no console UI)."""

    def __init__(self, modules):
        self.main = modules / GATEWAY_PKG / "build" / "start-server.js"
        self.port = free_port()
        self.dir = harness.temp_dir("chatgate-portkey-")
        self.log_path = self.dir / "portkey.log"
        self.proc = None

    @property
    def base(self):
        return f"http://127.0.0.1:{self.port}"

    async def start(self, timeout=20.0):
        check(self.main.is_file(), f"no Portkey gateway at {self.main}")
        self._log = open(self.log_path, "wb")
        env = {k: v for k, v in os.environ.items() if k != ENV_NAME}
        self.proc = subprocess.Popen(["node", str(self.main), f"--port={self.port}", "--headless"],
                                     cwd=self.dir, env=env, stdin=subprocess.DEVNULL,
                                     stdout=self._log, stderr=subprocess.STDOUT)
        await wait_http(self.base + "/", self.proc, timeout, "Portkey", self.log_text)
        return self


async def wait_http(url, proc, timeout, what, log_text):
    deadline = time.monotonic() + timeout
    while True:
        status, _, _ = await asyncio.to_thread(http, url, timeout=1)
        if status == 200:
            return
        if proc.poll() is not None or time.monotonic() > deadline:
            harness.fail(f"{what} did not start on {url} (status {proc.poll()}):\n{log_text()[-2000:]}")
        await asyncio.sleep(0.1)


def readme_headers(mock, custom_host=True):
    headers = {"x-portkey-provider": "openai"}
    if custom_host:
        headers["x-portkey-custom-host"] = f"{mock.base}/v1"
    return headers


def upstream_config(pk, mock, custom_host=True):
    return {"portkey-local": {"url": f"{pk.base}/v1", "model": MODEL, "api_key_env": ENV_NAME,
                              "headers": readme_headers(mock, custom_host),
                              "connect_timeout_ms": 3000, "first_byte_timeout_ms": 8000,
                              "idle_timeout_ms": 8000}}


def expected_prefix(text):
    return f"mock-llm via portkey: {text} | model={MODEL} | user-agent="


MODULES = PK_MODULES = None  # set before run(): installing may exit 77 (skipped)


async def main(args):
    key = "sk-" + secrets.token_hex(16)  # only in the gateway's environment and mock-llm's rule
    mock = ProviderMock(MODULES, key)
    pk = Portkey(PK_MODULES)
    try:
        with step(f"start mock-llm and the self-hosted Portkey gateway ({PK_MODULES}/{GATEWAY_PKG})"):
            await asyncio.gather(mock.start(), pk.start())

        with step("Portkey on its own: a streaming chat completion with the headers docs/upstreams.md gives streams "
                  "mock-llm's reply"):
            url = pk.base + "/v1/chat/completions"
            req = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "ping"}]}
            headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}",
                       **readme_headers(mock)}
            status, _, body = await asyncio.to_thread(http, url, "POST", headers, req)
            text, errors = sse_text(body)
            hint = (" (Portkey's TypeError: immutable: is @hono/node-server newer than 1.14.1? "
                    "see tests/e2e/portkey/package.json)" if "Something went wrong" in body else "")
            check(status == 200 and not errors and text.startswith(expected_prefix("ping")),
                  f"Portkey -> mock-llm: {status} {text!r} {errors} {body[:300]!r}{hint}\n"
                  f"Portkey's log: {pk.log_text()[-1500:]}")
            status, _, body = await asyncio.to_thread(http, url, "POST", dict(headers, Authorization="Bearer nope"),
                                                      req)
            text, errors = sse_text(body)
            check(any(e.get("code") == "invalid_api_key" for e in errors),
                  f"with a wrong key mock-llm should refuse (the bearer token reaches it): {status} {body[:300]!r}")

        env = {ENV_NAME: key}
        gw = Gateway(config=make_config(upstream_config(pk, mock), "portkey-local"), env=env,
                     name="gateway:portkey-local")
        async with gw:
            client = await Client.connect(gw)
            with step("chatgate with the upstream docs/upstreams.md gives: a message gets done with mock-llm's reply, "
                      "streamed through Portkey"):
                text = "Hello Portkey, are you there?"
                turn = await client.message(text, mid="m1", room="r1")
                turn.expect_done()
                got = turn.terminal.get("text") or ""
                check(got.startswith(expected_prefix(text)),
                      f"the reply should start {expected_prefix(text)!r}\n got {got!r}")
                agent = got[len(expected_prefix(text)):]
                check(agent and not agent.startswith("chatgate/"),
                      f"mock-llm should see Portkey's user-agent, not chatgate's: {agent!r}")
                check(len(turn.deltas) >= 3, f"the reply came in {len(turn.deltas)} deltas, mock-llm streams "
                                             f"12 characters a chunk: {turn.describe()}")
            with step("a second message on the same connection"):
                turn = await client.message("And again?", mid="m2", room="r1")
                turn.expect_done()
                check((turn.terminal.get("text") or "").startswith(expected_prefix("And again?")),
                      f"second reply {turn.terminal.get('text')!r}")
            await client.close()
        with step("the gateway's log never shows the key"):
            check(key not in gw.log_text(), "the key is in the gateway's log")

    finally:
        pk.stop()
        mock.stop()


if __name__ == "__main__":
    os.environ.pop(ENV_NAME, None)  # only the gateways this test starts get it
    MODULES = mockllm_modules()
    PK_MODULES = portkey_modules()
    run(main, timeout=60)
