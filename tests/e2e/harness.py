"""Shared machinery for chatgate's end-to-end tests.

Every test script runs the real gateway binary as a subprocess on a free port and talks to it
as a client would, over a real WebSocket (the `websockets` library, legacy asyncio API of
Debian 12's python3-websockets 10.4). The backends the gateway forwards to are fakes that
run inside the test process, on the same asyncio loop as the clients, so a test can look at
what the gateway sent upstream and at when the gateway closed an upstream request:

- `FakeOpenAI`: an OpenAI-compatible HTTP/1.1 server written by hand on asyncio streams
  (`POST /<behaviour>/v1/chat/completions`; the path prefix picks the behaviour: ok, quick,
  slow, huge, errors, hangs, garbage..., listed in its docstring).
- `FakeApp`: a chat application's WebSocket server (`websockets.serve`; the path picks the
  behaviour: /app, /slow, /error, /garbage, /close..., listed in its docstring).
- `Gateway`: starts and stops the binary, captures its stderr to a log file, reads its RSS.
- `Client`: a WebSocket client of the gateway that checks the hello, collects the frames
  of one message (`collect_turn`) and keeps frames about other messages for later.
- `FrameTracker`: checks the per-message invariants of the protocol on a whole stream of
  frames: at most one ack, exactly one terminal frame (done, cancelled or error), nothing
  after it, and done.text equal to the concatenation of the deltas.

A script calls `run(main)`; `main(args)` is a coroutine. `run` parses `--gateway`, enforces
an overall time limit, stops every gateway still running, fails the test if a gateway log
holds a sanitizer report, and on failure prints which step failed and the tail of the log of
the gateway concerned (the others' log paths). Parts of a script that are independent of each
other run under `independent(...)`, so that one failure does not hide the next. Exit status:
0 pass, 1 fail.
"""

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.error
import urllib.request
from pathlib import Path

import websockets

PROTOCOL = "chatgate.v1"
REPO_ROOT = Path(__file__).resolve().parents[2]
# A frame that ends a message. An error "not_found" is the answer to a cancel, not the end
# of the message it names (docs/protocol.md, Ordering), so it is not terminal.
TERMINAL_TYPES = ("done", "cancelled", "error")
ANY = object()  # matches any id
DEFAULT_TIMEOUT = 10.0  # seconds to wait for one expected frame (ASan builds are slow)

_options = argparse.Namespace(gateway=None, keep_logs=False)
_gateways = []  # every Gateway started by this process, for logs and cleanup
_temp_dirs = []  # every directory made by temp_dir: removed when the test passes
_current_step = [None]
_failures = []  # (step, message, gateway) of every failure; any makes the script fail


class TestFailure(AssertionError):
    """A failed expectation; its message says what was expected and what came."""


def fail(message):
    raise TestFailure(message)


def check(condition, message):
    if not condition:
        fail(message)


def brief(obj, limit=300):
    """A frame or value as one short line, for failure messages."""
    text = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, default=str)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


@contextlib.contextmanager
def step(name):
    """Announce one part of a test; a failure inside names it."""
    print(f"-- {name}", flush=True)
    _current_step[0] = name
    started = time.monotonic()
    yield
    print(f"   ok ({time.monotonic() - started:.2f}s)", flush=True)
    _current_step[0] = None


def describe_frames(frames, title, first=4, last=6):
    """A list of frames for a failure message: count, the first and the last few."""
    shown = [brief(f, 160) for f in frames]
    if len(shown) > first + last:
        shown = shown[:first] + [f"... {len(frames) - first - last} more ..."] + shown[-last:]
    return f"{title} ({len(frames)} frames): [" + ", ".join(shown) + "]"


def is_terminal(frame):
    kind = frame.get("type")
    if kind == "error" and frame.get("code") == "not_found":
        return False
    return kind in TERMINAL_TYPES


_ports_given = set()
_port_random = random.Random(os.getpid() ^ time.monotonic_ns())


def _ephemeral_range():
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port():
    """A TCP port on 127.0.0.1 that nothing listens on (at the time of the call).

    Not one the kernel would pick for a bind to port 0 or for a connection's own end: those
    come from the ephemeral range, where the tests running beside this one (ctest -j) take
    ports all the time, so a port found free there is often taken before our child binds it.
    A random port below that range, never the same twice in one test, rarely is.
    """
    low, _ = _ephemeral_range()
    top = low - 1 if low > 12000 else 65535
    for _ in range(200):
        port = _port_random.randrange(10000, top)
        if port in _ports_given:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _ports_given.add(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def wait_until(predicate, timeout):
    """Poll `predicate` every 10 ms until it holds (True) or `timeout` passes (False)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


async def wait_condition(predicate, timeout, what, interval=0.01):
    """Poll `predicate` (a function, or an async one) every `interval` s until its value is
    truthy and return that value; fail with `what` (a string, or a function giving one, for
    the state at the time) when `timeout` passes first. The predicate is tried once more
    at the deadline, so a slow poll does not make it fail early."""
    deadline = time.monotonic() + timeout
    while True:
        late = time.monotonic() >= deadline
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if late:
            fail(f"not within {timeout:.1f}s: {what() if callable(what) else what}")
        await asyncio.sleep(min(interval, max(0.0, deadline - time.monotonic())))


async def metrics_of(gw):
    """The gateway's /metrics, parsed."""
    status, _, body = await asyncio.to_thread(http_get, gw.http_url + "/metrics")
    check(status == 200, f"/metrics of {gw.name}: HTTP {status}")
    return parse_metrics(body.decode())


async def wait_metric(gw, name, predicate, timeout, what=None, **labels):
    """Poll /metrics until `predicate(value of name{labels})` holds (a missing series is
    None); return the Metrics. Fails with the last value when `timeout` passes."""
    last = {}

    async def probe():
        m = await metrics_of(gw)
        last["v"] = m.value(name, **labels) if m.has(name, **labels) else None
        return m if predicate(last["v"]) else None
    return await wait_condition(probe, timeout, lambda: f"{what or 'the metric'}: {name}{labels or ''} "
                                                        f"is {last.get('v')}", interval=0.05)


async def wait_log(gw, pattern, timeout, start=0):
    """Wait until the gateway's log, from character `start` on, has a line matching the
    regular expression `pattern`; return the match. Fails (with the log's tail) on timeout
    or when the gateway exits first."""
    rx = re.compile(pattern, re.MULTILINE)

    def probe():
        m = rx.search(gw.log_text(), start)
        if not m:
            gw.assert_alive()
        return m
    return await wait_condition(probe, timeout, lambda: f"{gw.name}: no log line matching {pattern!r}\n"
                                                        f"{gw.log_tail(15)}", interval=0.02)


def words_of(text):
    """Split a reply into the pieces a fake streams: each word with its trailing space."""
    return re.findall(r"\S+\s*", text)


def long_non_ascii(prefix, variant):
    """`prefix` and 400 two-byte characters, shifted by `variant` % 2 ASCII bytes: of two
    variants, one puts a character across any byte offset a gateway might cut the text at."""
    return prefix + "x" * (variant % 2) + "é" * 400


def asan_env(**options):
    """ASAN_OPTIONS for a gateway: the caller's own, plus these (harmless without ASan)."""
    current = os.environ.get("ASAN_OPTIONS", "")
    extra = ":".join(f"{k}={v}" for k, v in options.items())
    return {"ASAN_OPTIONS": f"{current}:{extra}" if current else extra}


# --------------------------------------------------------------------------------------
# npm packages of the tests


def npm_modules(pkg, work, markers, what, skip):
    """The node_modules holding `markers` (paths under node_modules) for the package.json and
    package-lock.json of directory `pkg`: pkg's own when someone ran `npm ci` there, else
    work/node_modules, installed there with `npm ci` when missing or out of date.

    Tests that share `work` (ctest -j runs them at once) take turns under a lock file beside
    it: two `npm ci` in one directory remove each other's files (ENOTEMPTY, corrupt tarballs).
    `skip(reason)` is called (and must exit) when node or npm is missing."""
    import fcntl
    if shutil.which("node") is None:
        skip("node not found (Debian: apt-get install nodejs npm)")
    own = pkg / "node_modules"
    if all((own / m).is_file() for m in markers):
        return own
    work = Path(work)
    work.parent.mkdir(parents=True, exist_ok=True)
    modules, lock = work / "node_modules", work / "package-lock.json"
    with open(work.parent / f".{work.name}.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # released when the file closes
        if all((modules / m).is_file() for m in markers) and lock.is_file() \
                and lock.read_bytes() == (pkg / "package-lock.json").read_bytes():
            return modules
        if shutil.which("npm") is None:
            skip("npm not found (Debian: apt-get install npm)")
        print(f"installing {what} into {work} (npm ci)", flush=True)
        work.mkdir(parents=True, exist_ok=True)
        if work.resolve() != pkg.resolve():
            shutil.copy(pkg / "package.json", work / "package.json")
            shutil.copy(pkg / "package-lock.json", lock)
        try:
            proc = subprocess.run(["npm", "ci", "--no-audit", "--no-fund", "--ignore-scripts"], cwd=work,
                                  stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
            ok, out = proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        except subprocess.TimeoutExpired:
            ok, out = False, "npm ci ran for 300 s"
        if not ok or not all((modules / m).is_file() for m in markers):
            if work.resolve() != pkg.resolve():
                lock.unlink(missing_ok=True)  # so the next run tries again
            print(out, file=sys.stderr)
            print(f"FAIL: npm ci in {work} did not install {what} (is the npm registry reachable?)",
                  file=sys.stderr, flush=True)
            sys.exit(1)
    return modules


# --------------------------------------------------------------------------------------
# The gateway process


def temp_dir(prefix):
    """A new directory under the system's temporary directory, removed with all it holds
    when the test passes (kept, with the logs, when it fails or under --keep-logs)."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    _temp_dirs.append(path)
    return path


class Gateway:
    """The chatgate binary as a subprocess.

    `Gateway(args, config)` runs `chatgate --listen 127.0.0.1:PORT [--config FILE] *args`
    with the repository root as working directory (so the default web/ and rules/ are
    found). `config` may be a dict (written as JSON) or a string (written as is). `env`
    adds environment variables; CHATGATE_* variables and REDIS_URL of the caller are not
    inherited, so a test sees only what it sets.

    Use `async with Gateway(...) as gw:` in tests (start and stop do not block the loop,
    which also runs the fake upstreams), or `start()`/`stop()` with try/finally.
    """

    def __init__(self, args=(), config=None, env=None, binary=None, port=None, name=None):
        self.binary = binary or _options.gateway
        self.args = [str(a) for a in args]
        self.config = config
        self.port = port or free_port()
        self.port_retries = 0 if port else 2  # a port we chose and another process took
        self.name = name or f"gateway:{self.port}"
        self.extra_env = dict(env or {})
        self.proc = None
        self.returncode = None
        self.stopped = False
        self.failed = False  # this gateway caused the failure: show its log
        self.stop_note = None  # how the process ended, when not by a clean exit 0
        self.dir = temp_dir("chatgate-e2e-")
        self.log_path = self.dir / "gateway.log"
        self.config_path = None

    # -- properties
    @property
    def pid(self):
        return self.proc.pid if self.proc else None

    @property
    def url(self):
        return f"ws://127.0.0.1:{self.port}/ws"

    @property
    def http_url(self):
        return f"http://127.0.0.1:{self.port}"

    def ws_url(self, path):
        """A WebSocket URL on this gateway for another path than /ws (drop-in mode)."""
        return f"ws://127.0.0.1:{self.port}{path}"

    def command(self):
        cmd = [str(self.binary), "--listen", f"127.0.0.1:{self.port}"]
        if self.config is not None:
            cmd += ["--config", str(self.config_path)]
        return cmd + self.args

    # -- lifecycle
    def _spawn(self):
        if not self.binary:
            fail("no gateway binary given (use --gateway PATH)")
        if not os.access(self.binary, os.X_OK):
            fail(f"gateway binary not found or not executable: {self.binary}")
        if self.config is not None:
            self.config_path = self.dir / "config.json"
            text = self.config if isinstance(self.config, str) else json.dumps(self.config, indent=2)
            self.config_path.write_text(text)
        # Neither the caller's CHATGATE_* nor REDIS_URL (the gateway's default store).
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("CHATGATE_") and k != "REDIS_URL"}
        env.update(self.extra_env)
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            self.command(), cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL,
            stdout=self._log, stderr=subprocess.STDOUT)
        _gateways.append(self)

    def _port_accepts(self):
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                pass
        except OSError:
            return False
        return self._listener_is_ours()

    def _listener_is_ours(self):
        """Whether the socket listening on our port is this gateway's (or one of its
        workers'), not another process's that took the port first: /proc/net/tcp names the
        listening sockets' inodes, /proc/PID/fd the process's sockets."""
        port_hex = f":{self.port:04X}"
        try:
            inodes = set()
            for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
                fields = line.split()
                if fields[1].endswith(port_hex) and fields[3] == "0A":
                    inodes.add(f"socket:[{fields[9]}]")
            pids, seen = [self.proc.pid], set()
            while pids:
                pid = pids.pop()
                seen.add(pid)
                for task in Path(f"/proc/{pid}/task").iterdir():
                    pids += [int(c) for c in (task / "children").read_text().split() if int(c) not in seen]
                for fd in Path(f"/proc/{pid}/fd").iterdir():
                    with contextlib.suppress(OSError):
                        if os.readlink(fd) in inodes:
                            return True
        except (OSError, ValueError, IndexError):
            return True  # no /proc to ask: the port accepting is all we know
        return False

    def _port_was_taken(self):
        """The gateway exited because another process took the port we chose for it: it is
        started again on another one (free_port's check and the gateway's bind race)."""
        if self.port_retries == 0:
            return False
        self._log.close()
        if b"Address already in use" not in self.log_path.read_bytes():
            self._log = open(self.log_path, "ab")
            return False
        self.port_retries -= 1
        _gateways.remove(self)
        print(f"   note: {self.name}'s port {self.port} was taken by another process; started again on another",
              flush=True)
        self.port = free_port()
        self._spawn()
        return True

    def _check_startup(self, deadline, timeout):
        code = self.proc.poll()
        if code is not None and self._port_was_taken():
            return
        if code is not None:
            self.returncode = code
            self.stopped = True
            self._log.close()
            self.failed = True
            fail(f"{self.name} exited with status {code} before accepting connections\n"
                 f"command: {' '.join(self.command())}")
        if time.monotonic() > deadline:
            self.failed = True
            fail(f"{self.name} did not accept connections on port {self.port} within {timeout:.0f} s")

    def start(self, timeout=10.0):
        self._spawn()
        deadline = time.monotonic() + timeout
        while not self._port_accepts():
            self._check_startup(deadline, timeout)
            time.sleep(0.05)
        return self

    async def astart(self, timeout=10.0):
        self._spawn()
        deadline = time.monotonic() + timeout
        while not await asyncio.to_thread(self._port_accepts):
            self._check_startup(deadline, timeout)
            await asyncio.sleep(0.05)
        return self

    def _terminate(self):
        """Send SIGTERM; False if the process had already died on its own."""
        code = self.proc.poll()
        if code is not None:
            self.stop_note = f"died on its own (status {code}) before the test stopped it"
            return False
        self.proc.send_signal(signal.SIGTERM)
        return True

    def _finish(self, code, was_running):
        self.returncode = code
        self.stopped = True
        self._log.close()
        if was_running and code == -signal.SIGKILL:
            self.stop_note = "ignored SIGTERM for 5 s and was killed"
        elif was_running and code == -signal.SIGTERM:
            self.stop_note = "ended by SIGTERM's default action (docs/architecture.md, Shutdown: graceful exit 0)"
        elif was_running and code != 0:
            self.stop_note = f"exited with status {code} after SIGTERM"
        if self.stop_note:
            print(f"   note: {self.name} {self.stop_note}", flush=True)
        if not was_running:
            self.failed = True
            fail(f"{self.name} {self.stop_note}")
        return code

    def stop(self, timeout=5.0):
        """SIGTERM, wait up to `timeout`, then SIGKILL. Returns the exit status. Fails if
        the process had died before (a crash)."""
        if self.proc is None or self.stopped:
            return self.returncode
        was_running = self._terminate()
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        return self._finish(code, was_running)

    async def astop(self, timeout=5.0):
        """stop() without blocking the loop (the fakes keep serving meanwhile)."""
        if self.proc is None or self.stopped:
            return self.returncode
        was_running = self._terminate()
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if self.proc.poll() is None:
            self.proc.kill()
        return self._finish(self.proc.wait(), was_running)

    async def __aenter__(self):
        return await self.astart()

    async def __aexit__(self, exc_type, exc, tb):
        if exc_type is None:
            await self.astop()
        else:
            # Keep the original failure; still stop the process.
            with contextlib.suppress(Exception):
                await self.astop()
        return False

    # -- signals sent by the test itself (graceful shutdown tests)
    def send_signal(self, signum=signal.SIGTERM):
        """Send `signum` to the running gateway (the test then waits with await_exit)."""
        check(self.alive(), f"{self.name} is not running (status {self.proc.poll()})")
        self.proc.send_signal(signum)

    async def await_exit(self, timeout):
        """Wait up to `timeout` s for the process to exit after a signal the test sent; its
        exit status, or None if it is still running (then `run` kills it at the end)."""
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        code = self.proc.poll()
        if code is None:
            return None
        if not self.stopped:
            self._finish(code, True)
        return code

    # -- inspection
    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def assert_alive(self):
        if not self.alive():
            self.failed = True
            fail(f"{self.name} is not running any more (status {self.proc.poll()})")

    def rss_kb(self):
        """The gateway's resident set size (VmRSS) in kB."""
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        fail(f"no VmRSS for pid {self.pid}")

    def log_text(self):
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines=40):
        text = self.log_text().splitlines()
        tail = "\n".join("   | " + line for line in text[-lines:])
        return f"--- last {min(lines, len(text))} of {len(text)} log lines of {self.name} ({self.log_path}):\n{tail}"

    def sanitizer_report(self):
        """The first lines of an ASan/UBSan/LSan report in the log, or None."""
        text = self.log_text()
        match = re.search(r"^.*(ERROR: (Address|Leak|Memory|Thread)Sanitizer|runtime error:).*$",
                          text, re.MULTILINE)
        if not match:
            return None
        return "\n".join(text[match.start():].splitlines()[:30])


async def gateway_exit(config=None, args=(), env=None, timeout=10.0):
    """Run the gateway with `config` (a dict or a string, written to a file) and `args`,
    expecting it to exit on its own (a configuration mistake): (exit status, stdout + stderr,
    the config file's path). Fails if it is still running after `timeout` seconds."""
    directory = temp_dir("chatgate-e2e-cfg-")
    cmd = [str(_options.gateway), "--listen", f"127.0.0.1:{free_port()}"]
    path = None
    if config is not None:
        path = directory / "config.json"
        path.write_text(config if isinstance(config, str) else json.dumps(config, indent=2))
        cmd += ["--config", str(path)]
    cmd += [str(a) for a in args]
    run_env = {k: v for k, v in os.environ.items() if not k.startswith("CHATGATE_") and k != "REDIS_URL"}
    run_env.update(env or {})

    def start():
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
                              env=run_env, cwd=REPO_ROOT)
    try:
        proc = await asyncio.to_thread(start)
    except subprocess.TimeoutExpired:
        fail(f"the gateway was still running after {timeout:.0f} s; it should have exited "
             f"(command: {' '.join(cmd)})")
    return proc.returncode, proc.stdout + proc.stderr, path


async def check_refused(config, where, why):
    """The gateway refuses `config` at start: exit 2, the message naming `where` (a key's
    path) and saying `why`."""
    code, out, _ = await gateway_exit(config)
    check(code == 2 and where in out and why in out, f"exit {code}, expected 2 naming {where} ({why!r}): {out}")


def http_get(url, timeout=DEFAULT_TIMEOUT):
    """A blocking GET: (status, headers, body). Run it with asyncio.to_thread."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


def http_request(url, method="GET", headers=None, body=None, timeout=DEFAULT_TIMEOUT):
    """A blocking request with any method: (status, headers, body). Run it with
    asyncio.to_thread. `body` is bytes, a str or a JSON-able object (sent as JSON)."""
    if body is not None and not isinstance(body, (bytes, str)):
        body = json.dumps(body)
    if isinstance(body, str):
        body = body.encode()
    req = urllib.request.Request(url, data=body, method=method, headers=dict(headers or {}))
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


class Metrics:
    """A parsed Prometheus text exposition (version 0.0.4): `samples` maps (name, labels as a
    sorted tuple of pairs) to a float, `types` a family name to its TYPE. `value(name,
    **labels)` is one sample (fails when absent); `series(name)` every sample of a name."""

    def __init__(self, text):
        self.text = text
        self.samples = {}
        self.types = {}
        self.helps = {}
        self.order = []
        label_re = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*(,|$)')
        sample_re = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+(-?\d+))?$')
        for n, line in enumerate(text.split("\n"), 1):
            if not line.strip():
                continue
            if line.startswith("#"):
                parts = line.split(None, 3)
                if len(parts) >= 3 and parts[1] == "TYPE":
                    check(len(parts) == 4 and parts[3] in ("counter", "gauge", "histogram", "summary", "untyped"),
                          f"metrics line {n}: bad TYPE line {line!r}")
                    check(parts[2] not in self.types, f"metrics line {n}: second TYPE for {parts[2]}")
                    self.types[parts[2]] = parts[3]
                elif len(parts) >= 3 and parts[1] == "HELP":
                    self.helps[parts[2]] = parts[3] if len(parts) > 3 else ""
                continue
            m = sample_re.match(line)
            check(m, f"metrics line {n} is not a sample: {line!r}")
            name, raw_labels, raw_value = m.group(1), m.group(2), m.group(3)
            labels = []
            if raw_labels:
                pos = 0
                while pos < len(raw_labels):
                    lm = label_re.match(raw_labels, pos)
                    check(lm, f"metrics line {n}: bad labels {raw_labels!r}")
                    value = re.sub(r"\\(.)", lambda e: "\n" if e.group(1) == "n" else e.group(1), lm.group(2))
                    labels.append((lm.group(1), value))
                    pos = lm.end()
            names = [k for k, _ in labels]
            check(len(set(names)) == len(names), f"metrics line {n}: a label twice: {line!r}")
            try:
                value = float(raw_value)  # also +Inf, -Inf, NaN
            except ValueError:
                fail(f"metrics line {n}: the value is not a number: {line!r}")
            key = (name, tuple(sorted(labels)))
            check(key not in self.samples, f"metrics line {n}: the same series twice: {line!r}")
            self.samples[key] = value
            self.order.append(key)

    def family(self, name):
        """The TYPE'd family a sample name belongs to (histogram _bucket/_sum/_count)."""
        if name in self.types:
            return name
        for suffix in ("_bucket", "_sum", "_count"):
            if name.endswith(suffix) and self.types.get(name[:-len(suffix)]) in ("histogram", "summary"):
                return name[:-len(suffix)]
        return None

    def has(self, name, **labels):
        return (name, tuple(sorted(labels.items()))) in self.samples

    def value(self, name, **labels):
        key = (name, tuple(sorted(labels.items())))
        if key not in self.samples:
            shown = [f"{n}{dict(l)}" for n, l in self.samples if n == name]
            fail(f"/metrics has no sample {name}{labels or ''}; samples of that name: {shown}")
        return self.samples[key]

    def series(self, name):
        """{labels dict as a sorted tuple: value} of every sample named `name`."""
        return {labels: v for (n, labels), v in self.samples.items() if n == name}

    def histogram(self, name, **labels):
        """(buckets [(le, cumulative count)] in le order, sum, count) of one histogram."""
        buckets = []
        for (n, lbls), v in self.samples.items():
            d = dict(lbls)
            if n == name + "_bucket" and all(d.get(k) == str(val) for k, val in labels.items()) \
                    and set(d) == set(labels) | {"le"}:
                buckets.append((float(d["le"]), v))
        buckets.sort()
        return buckets, self.value(name + "_sum", **labels), self.value(name + "_count", **labels)


def parse_metrics(text):
    return Metrics(text)


# --------------------------------------------------------------------------------------
# Config helpers


def tls_server(directory, names="IP:127.0.0.1,IP:::1,DNS:localhost"):
    """A test CA and a certificate it signed for `names` (subjectAltName), made by Debian's
    openssl in `directory`: (the CA's PEM file, for tls_ca_file; a server ssl.SSLContext with
    the certificate, for FakeOpenAI and WsServer)."""
    d = Path(directory)
    (d / "ext.cnf").write_text(f"subjectAltName={names}\n")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for cmd in (["req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
                 "-subj", "/CN=chatgate test CA"],
                ["req", *ec, "-keyout", "key.pem", "-out", "req.csr", "-subj", "/CN=localhost"],
                ["x509", "-req", "-in", "req.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", "cert.pem", "-days", "2", "-extfile", "ext.cnf"]):
        subprocess.run(["openssl", *cmd], check=True, capture_output=True, cwd=d)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(d / "cert.pem", d / "key.pem")
    return str(d / "ca.pem"), ctx


def openai_upstream(fake, behaviour, model="test-model", **timeouts):
    """Config of an OpenAI-compatible upstream served by `fake` with `behaviour`."""
    cfg = {"url": fake.url(behaviour), "model": model, "connect_timeout_ms": 2000,
           "first_byte_timeout_ms": 2000, "idle_timeout_ms": 2000}
    cfg.update(timeouts)
    return cfg


def app_upstream(app, path, **timeouts):
    """Config of a WebSocket app upstream served by `app` at `path`."""
    cfg = {"url": app.url(path), "connect_timeout_ms": 2000, "first_byte_timeout_ms": 2000,
           "idle_timeout_ms": 2000}
    cfg.update(timeouts)
    return cfg


def demo_upstream(delay_ms=0):
    return {"url": "demo", "delay_ms": delay_ms}


def make_config(upstreams, default, **extra):
    cfg = {"upstreams": upstreams, "default_upstream": default, "log_level": "info"}
    cfg.update(extra)
    return cfg


# --------------------------------------------------------------------------------------
# Fake OpenAI-compatible server


class HttpConnection:
    """One TCP connection to the fake server. A pump task reads everything into `buf`, so
    the moment the gateway closes the connection is known (`closed_at`) even while a
    handler sleeps between writes. (When the fake ends a response by closing the
    connection itself, `closed_at` is that moment.)"""

    def __init__(self, reader, writer):
        self.reader = reader
        self.writer = writer
        tls = writer.get_extra_info("ssl_object")
        self.tls_resumed = tls.session_reused if tls else None  # None: not TLS
        self.buf = bytearray()
        self.eof = False
        self.opened_at = time.monotonic()
        self.closed_at = None
        self.closed = asyncio.Event()
        self._wakeup = asyncio.Event()
        self._pump_task = asyncio.create_task(self._pump())

    async def _pump(self):
        try:
            while True:
                data = await self.reader.read(65536)
                if not data:
                    break
                self.buf += data
                self._wakeup.set()
        except (ConnectionError, OSError):
            pass
        finally:
            self.mark_closed()

    def mark_closed(self):
        if not self.eof:
            self.eof = True
            self.closed_at = time.monotonic()
            self.closed.set()
            self._wakeup.set()

    async def _wait_for(self, parse):
        """Run `parse` over the buffer until it returns something; None at EOF."""
        while True:
            result = parse()
            if result is not None:
                return result
            if self.eof:
                return None
            self._wakeup.clear()
            await self._wakeup.wait()

    def _take(self, n):
        data = bytes(self.buf[:n])
        del self.buf[:n]
        return data

    def _take_line(self, limit=65536):
        end = self.buf.find(b"\r\n")
        if end < 0:
            if len(self.buf) > limit:
                raise ValueError("line too long")
            return None
        line = self._take(end + 2)
        return line[:-2]

    async def read_request(self):
        """Parse one HTTP/1.1 request, or None when the peer closed first."""
        head = await self._wait_for(lambda: self._take(self.buf.index(b"\r\n\r\n") + 4)
                                    if b"\r\n\r\n" in self.buf else None)
        if head is None:
            return None
        lines = head.decode("latin-1").split("\r\n")
        method, target, version = lines[0].split(" ", 2)
        headers = {}
        for line in lines[1:]:
            if line:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        if headers.get("expect", "").lower() == "100-continue":
            await self.send(b"HTTP/1.1 100 Continue\r\n\r\n")
        body = b""
        if "chunked" in headers.get("transfer-encoding", "").lower():
            while True:
                size_line = await self._wait_for(self._take_line)
                if size_line is None:
                    return None
                size = int(size_line.split(b";")[0], 16)
                chunk = await self._wait_for(
                    lambda: self._take(size + 2) if len(self.buf) >= size + 2 else None)
                if chunk is None:
                    return None
                if size == 0:
                    break  # (trailers are not supported; the gateway sends none)
                body += chunk[:-2]
        elif "content-length" in headers:
            n = int(headers["content-length"])
            body = await self._wait_for(lambda: self._take(n) if len(self.buf) >= n else None)
            if body is None:
                return None
        return UpstreamRequest(self, method, target, version, headers, body)

    async def send(self, data):
        """Write and drain; False if the gateway has gone (the caller stops)."""
        if self.eof:
            return False
        try:
            self.writer.write(data)
            await self.writer.drain()
        except (ConnectionError, OSError):
            self.mark_closed()
            return False
        return not self.eof

    def close(self):
        """Close from the fake's side (closed_at is then this moment, if not set before)."""
        self._pump_task.cancel()
        self.writer.close()
        self.mark_closed()


class UpstreamRequest:
    """One request the gateway made to the fake OpenAI server."""

    def __init__(self, conn, method, target, version, headers, body):
        self.conn = conn
        self.method = method
        self.path = target
        self.version = version
        self.headers = headers  # names lower-cased
        self.raw_body = body
        try:
            self.json = json.loads(body) if body else None
        except ValueError:
            self.json = None
        parts = target.split("?")[0].strip("/").split("/")
        self.behaviour = parts[0] if parts else ""
        self.received_at = time.monotonic()
        self.finished_at = None      # when the fake wrote the whole response
        self.aborted = False         # the gateway closed before the response was complete
        self.bytes_written = 0       # response bytes written so far (headers included)
        self.progress = []           # (monotonic time, bytes_written) after each write
        self.reply_text = None       # what the deltas of an SSE reply add up to
        self.usage = None            # the usage the fake reported

    @property
    def closed_at(self):
        return self.conn.closed_at

    @property
    def messages(self):
        return (self.json or {}).get("messages") or []

    @property
    def last_user_text(self):
        for msg in reversed(self.messages):
            if isinstance(msg, dict) and msg.get("role") == "user":
                return msg.get("content")
        return None

    def bytes_written_at(self, when):
        """Bytes written up to monotonic time `when`."""
        written = 0
        for t, n in self.progress:
            if t > when:
                break
            written = n
        return written

    async def wait_closed(self, timeout):
        """Wait until the gateway closes this request's connection; True if it did."""
        try:
            await asyncio.wait_for(self.conn.closed.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    def describe(self):
        return (f"{self.method} {self.path} auth={self.headers.get('authorization')!r} "
                f"body={brief(self.json if self.json is not None else self.raw_body)}")


def sse_event(obj):
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def completion_chunk(delta, finish_reason=None):
    return {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 1700000000,
            "model": "fake", "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]}


def chunk(data):
    """One piece of a chunked transfer-encoded body."""
    return b"%x\r\n" % len(data) + data + b"\r\n"


class FakeOpenAI:
    """An OpenAI-compatible chat completions server in the test process.

    `url(behaviour)` is the base URL an upstream config takes (`http://127.0.0.1:P/ok/v1`).
    Behaviours (first path segment):
      ok       echoes "echo: <last user message>" word by word as SSE, exercising the parser:
               a role-only first delta, LF and CRLF line ends, a comment line, events split
               across TCP writes and chunks, two events in one write, a finish_reason event,
               a usage event, then `data: [DONE]`.
      quick    6 words, 50 ms apart (queue tests).
      slow     100 words, 100 ms apart (cancel tests).
      huge     `huge_total` bytes of content in events of `huge_event` bytes, as fast as
               the socket takes them (each write drained; a small SO_SNDBUF so the fake's own
               kernel buffer hides little); `progress` records the bytes written over time.
      err500   500 with {"error":{"message":"model overloaded"}}.
      err500echo  500 whose message quotes the last user message ("model overloaded by: TEXT"),
               as some servers do (the log masking tests).
      err401   401 with {"error":{"message":"invalid api key"}}.
      err429   429 with `Retry-After: 30` (the connection kept).
      err500utf8  500 whose message is "model overloaded " and 400 "é" (UTF-8, not
               escaped), shifted by one byte on every other request (long_non_ascii).
      midfail  3 words, then an event {"error":{"message":"context length exceeded"}}.
      cutoff   3 words, then the connection is reset (no [DONE], no last chunk).
      hang     reads the request and never answers.
      garbage  200 text/event-stream whose data lines are not JSON.
      script   by the last user message: "FAIL" in it -> err500; "SLOW" -> `slow_words`
               words `slow_interval` apart (w0 w1 ...); else "echo: <text>" word by word.
    Every request is kept in `requests` (path, lower-cased headers, parsed JSON body, timing).
    With `tls` (a server ssl.SSLContext, tls_server()) it serves https.
    """

    def __init__(self, tls=None):
        self.tls = tls
        self.requests = []
        self.connections = []
        self.server = None
        self.port = None
        self.huge_total = 20 * 1024 * 1024
        self.huge_event = 16 * 1024
        self.slow_words = 100
        self.slow_interval = 0.1
        self.quick_words = 6
        self.quick_interval = 0.05

    async def start(self):
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0, ssl=self.tls)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def stop(self):
        if self.server:
            self.server.close()
            for conn in self.connections:
                conn.close()
            await self.server.wait_closed()

    async def __aenter__(self):
        return await self.start()

    async def __aexit__(self, *exc):
        await self.stop()

    def url(self, behaviour):
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}/{behaviour}/v1"

    def requests_for(self, behaviour):
        return [r for r in self.requests if r.behaviour == behaviour]

    async def next_request(self, behaviour=None, after=0, timeout=DEFAULT_TIMEOUT):
        """The first request (of `behaviour`) with index >= `after`, waiting for it."""
        deadline = time.monotonic() + timeout
        while True:
            for req in self.requests[after:]:
                if behaviour is None or req.behaviour == behaviour:
                    return req
            if time.monotonic() > deadline:
                fail(f"the fake OpenAI server got no {behaviour or ''} request within {timeout}s; "
                     f"requests so far: {[r.describe() for r in self.requests]}")
            await asyncio.sleep(0.01)

    async def _handle(self, reader, writer):
        conn = HttpConnection(reader, writer)
        self.connections.append(conn)
        try:
            while True:
                req = await conn.read_request()
                if req is None:
                    break
                self.requests.append(req)
                keep_alive = await self._respond(conn, req)
                if not keep_alive or conn.eof:
                    break
                if req.headers.get("connection", "").lower() == "close":
                    break
        except (ConnectionError, OSError, ValueError) as err:
            print(f"   fake OpenAI: connection error: {err!r}", flush=True)
        finally:
            await asyncio.sleep(0)  # let the pump record an EOF that already arrived
            conn.close()

    # -- responses
    async def _write(self, conn, req, data):
        ok = await conn.send(data)
        if ok:
            req.bytes_written += len(data)
            req.progress.append((time.monotonic(), req.bytes_written))
        else:
            req.aborted = True
        return ok

    async def _respond(self, conn, req):
        if req.method != "POST" or not req.path.split("?")[0].endswith("/chat/completions"):
            return await self._json_response(conn, req, 404, "Not Found",
                                             {"error": {"message": f"no route {req.path}"}})
        handler = getattr(self, "_do_" + req.behaviour, None)
        if handler is None:
            return await self._json_response(conn, req, 404, "Not Found",
                                             {"error": {"message": f"unknown behaviour {req.behaviour}"}})
        return await handler(conn, req)

    async def _json_response(self, conn, req, status, reason, obj):
        body = json.dumps(obj).encode()
        head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
        await self._write(conn, req, head + body)
        req.finished_at = time.monotonic()
        return False

    async def _sse_head(self, conn, req):
        return await self._write(conn, req, (
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
            b"Transfer-Encoding: chunked\r\nConnection: keep-alive\r\n\r\n"))

    def _usage(self, req, completion_tokens):
        prompt_tokens = sum(len(str(m.get("content", "")).split())
                            for m in req.messages if isinstance(m, dict))
        req.usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}
        return {"choices": [], "usage": req.usage}

    async def _sse_end(self, conn, req, n_tokens):
        ok = (await self._write(conn, req, chunk(sse_event(completion_chunk({}, "stop"))))
              and await self._write(conn, req, chunk(sse_event(self._usage(req, n_tokens))))
              and await self._write(conn, req, chunk(b"data: [DONE]\n\n"))
              and await self._write(conn, req, b"0\r\n\r\n"))
        if ok:
            req.finished_at = time.monotonic()
        return ok

    async def _do_ok(self, conn, req):
        words = words_of("echo: " + str(req.last_user_text))
        req.reply_text = "".join(words)
        if not await self._sse_head(conn, req):
            return False
        events = [sse_event(completion_chunk({"role": "assistant", "content": ""}))]
        events += [sse_event(completion_chunk({"content": w})) for w in words]
        pieces = []  # the chunks to write, each its own TCP write
        for i, ev in enumerate(events):
            if i == 2:  # CRLF line ends
                ev = ev.replace(b"\n", b"\r\n")
            if i == 3:  # a comment line before the event
                pieces.append(b": keep-alive\n\n")
            if i == 1 or i == len(events) - 1:  # split mid-prefix and mid-JSON across writes
                pieces += [ev[:3], ev[3:len(ev) // 2], ev[len(ev) // 2:]]
            elif i == 4 and pieces:  # two events in one write
                pieces[-1] += ev
            else:
                pieces.append(ev)
        for piece in pieces:
            if not await self._write(conn, req, chunk(piece)):
                return False
            await asyncio.sleep(0.002)  # separate TCP segments, so the gateway sees splits
        return await self._sse_end(conn, req, len(words))

    async def _stream_words(self, conn, req, count, interval):
        words = [f"w{i} " for i in range(count)]
        req.reply_text = "".join(words)
        if not await self._sse_head(conn, req):
            return False
        for w in words:
            if not await self._write(conn, req, chunk(sse_event(completion_chunk({"content": w})))):
                return False
            await asyncio.sleep(interval)
            if conn.eof:
                req.aborted = True
                return False
        return await self._sse_end(conn, req, count)

    async def _do_script(self, conn, req):
        text = str(req.last_user_text)
        if "FAIL" in text:
            return await self._do_err500(conn, req)
        if "SLOW" in text:
            return await self._do_slow(conn, req)
        words = words_of("echo: " + text)
        req.reply_text = "".join(words)
        if not await self._sse_head(conn, req):
            return False
        for w in words:
            if not await self._write(conn, req, chunk(sse_event(completion_chunk({"content": w})))):
                return False
        return await self._sse_end(conn, req, len(words))

    async def _do_slow(self, conn, req):
        return await self._stream_words(conn, req, self.slow_words, self.slow_interval)

    async def _do_quick(self, conn, req):
        return await self._stream_words(conn, req, self.quick_words, self.quick_interval)

    async def _do_huge(self, conn, req):
        sock = conn.writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
        conn.writer.transport.set_write_buffer_limits(high=64 * 1024)
        if not await self._sse_head(conn, req):
            return False
        pattern = "abcdefghijklmnopqrstuvwxyz0123456789"
        content = (pattern * (self.huge_event // len(pattern) + 1))[:self.huge_event]
        event = chunk(sse_event(completion_chunk({"content": content})))
        sent = 0
        n_events = 0
        while sent < self.huge_total:
            if not await self._write(conn, req, event):
                return False
            sent += len(content)
            n_events += 1
        req.reply_text = None  # too big to keep; huge_content_bytes says how much
        req.huge_content_bytes = sent
        return await self._sse_end(conn, req, n_events)

    async def _do_midfail(self, conn, req):
        if not await self._sse_head(conn, req):
            return False
        for w in ("partial ", "reply ", "then "):
            if not await self._write(conn, req, chunk(sse_event(completion_chunk({"content": w})))):
                return False
        error = {"error": {"message": "context length exceeded", "type": "invalid_request_error"}}
        if await self._write(conn, req, chunk(sse_event(error)) + b"0\r\n\r\n"):
            req.finished_at = time.monotonic()
        return False

    async def _do_cutoff(self, conn, req):
        if not await self._sse_head(conn, req):
            return False
        for w in ("partial ", "reply ", "then "):
            if not await self._write(conn, req, chunk(sse_event(completion_chunk({"content": w})))):
                return False
        await asyncio.sleep(0.05)
        conn.writer.transport.abort()  # the upstream dies mid-reply: no [DONE], no last chunk
        req.finished_at = time.monotonic()
        return False

    async def _do_err500echo(self, conn, req):
        return await self._json_response(conn, req, 500, "Internal Server Error",
                                         {"error": {"message": f"model overloaded by: {req.last_user_text}"}})

    async def _do_err500(self, conn, req):
        return await self._json_response(conn, req, 500, "Internal Server Error",
                                         {"error": {"message": "model overloaded"}})

    async def _do_err500utf8(self, conn, req):
        variant = len(self.requests_for("err500utf8"))
        message = long_non_ascii("model overloaded ", variant)
        body = json.dumps({"error": {"message": message}}, ensure_ascii=False).encode()
        head = (f"HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/json; charset=utf-8\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
        await self._write(conn, req, head + body)
        req.finished_at = time.monotonic()
        return False

    async def _do_err429(self, conn, req):
        body = json.dumps({"error": {"message": "rate limited", "type": "rate_limit_error"}}).encode()
        head = (f"HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json\r\nRetry-After: 30\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        if await self._write(conn, req, head + body):
            req.finished_at = time.monotonic()
        return True

    async def _do_err401(self, conn, req):
        return await self._json_response(conn, req, 401, "Unauthorized",
                                         {"error": {"message": "invalid api key"}})

    async def _do_hang(self, conn, req):
        await conn.closed.wait()
        req.aborted = True
        return False

    async def _do_garbage(self, conn, req):
        if not await self._sse_head(conn, req):
            return False
        for _ in range(3):
            if not await self._write(conn, req, chunk(b"data: this is not json\n\n")):
                return False
        if await self._write(conn, req, b"0\r\n\r\n"):
            req.finished_at = time.monotonic()
        return False


# --------------------------------------------------------------------------------------
# Fake WebSocket chat application


class AppConnection:
    """One upstream WebSocket connection the gateway opened to the fake app."""

    def __init__(self, path):
        self.path = path
        self.opened_at = time.monotonic()
        self.closed_at = None
        self.closed = asyncio.Event()
        self.frames = []   # every frame received, parsed (or the raw text if not JSON)
        self.cancels = []  # (id, monotonic time) of each cancel frame received
        self.tasks = {}

    @property
    def messages(self):
        return [f for f in self.frames if isinstance(f, dict) and f.get("type") == "message"]

    async def wait_closed(self, timeout):
        try:
            await asyncio.wait_for(self.closed.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False


class WsServer:
    """A WebSocket server of the test's own on a free local port: subclasses give `_handler(ws)`
    and, in `serve_options`, what websockets.serve should get besides (frame size, write limit).
    `async with` starts and stops it; `url(path)` is where the gateway finds it. With `tls` (a
    server ssl.SSLContext, tls_server()) it serves wss; `host` is the address it listens on."""

    serve_options = {}

    def __init__(self, tls=None, host="127.0.0.1"):
        self.tls = tls
        self.host = host
        self.server = None
        self.port = None

    async def start(self):
        self.server = await websockets.serve(self._handler, self.host, 0, ssl=self.tls, **self.serve_options)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def stop(self):
        if self.server:
            self.server.close()
            await self.server.wait_closed()

    async def __aenter__(self):
        return await self.start()

    async def __aexit__(self, *exc):
        await self.stop()

    def url(self, path):
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'wss' if self.tls else 'ws'}://{host}:{self.port}{path}"


class FakeApp(WsServer):
    """A chat application's WebSocket server in the test process.

    `url(path)` is the upstream URL (`ws://127.0.0.1:P/app`). Behaviour by path:
      /app      replies "app got: <text>" word by word (delta frames, then done).
      /slow     100 deltas 100 ms apart, then done; records cancel frames and stops that reply.
      /error    answers {"type":"error","id":ID,"message":"backend exploded"}.
      /error_echo  an error whose message quotes the user's text ("backend exploded on: TEXT").
      /garbage  answers a text frame that is not JSON, then nothing.
      /error_utf8, /garbage_utf8  the same with long non-ASCII text (long_non_ascii),
                shifted by one byte on every other reply.
      /reply_then_garbage  odd messages of a connection as /app, even ones get "oops{".
      /close    closes the connection as soon as a message arrives.
      /close_mid  two deltas, then closes the connection (no done).
      /state    the "state app": replies "app got: <text before STATE:>" word by word, and
                its done carries a state directive (docs/state.md, The state directive) when the test
                scripted one: the JSON after "STATE:" in the user's text, else
                `directives[id]` (popped). "[delay=S]" in the text sleeps S seconds after
                the first delta (for ordering and cancel tests). Every frame is recorded
                (`message_frame(id)` finds the forwarded message frame of an id).
    """

    serve_options = {"max_size": 2**22}

    def __init__(self, tls=None, host="127.0.0.1"):
        super().__init__(tls, host)
        self.connections = []
        self.slow_deltas = 100
        self.slow_interval = 0.1
        self.variant = 0  # counts the replies of the _utf8 paths
        self.directives = {}  # /state: message id -> state directive for its done

    @property
    def opened(self):
        return len(self.connections)

    @property
    def closed(self):
        return sum(1 for c in self.connections if c.closed_at is not None)

    @property
    def messages(self):
        return [m for c in self.connections for m in c.messages]

    def message_frame(self, mid):
        """The last message frame with id `mid` the app received (any connection), or None."""
        found = None
        for conn in self.connections:
            for m in conn.messages:
                if m.get("id") == mid:
                    found = m
        return found

    async def wait_message(self, mid, timeout=DEFAULT_TIMEOUT):
        """The message frame with id `mid`, waiting for it."""
        if not await wait_until(lambda: self.message_frame(mid) is not None, timeout):
            fail(f"the fake app got no message with id {mid!r} within {timeout}s; ids so far: "
                 f"{[m.get('id') for m in self.messages][-10:]}")
        return self.message_frame(mid)

    async def next_connection(self, after=0, timeout=DEFAULT_TIMEOUT):
        deadline = time.monotonic() + timeout
        while len(self.connections) <= after:
            if time.monotonic() > deadline:
                fail(f"the fake app got no new upstream connection within {timeout}s")
            await asyncio.sleep(0.01)
        return self.connections[after]

    async def _handler(self, ws):
        conn = AppConnection(ws.path)
        self.connections.append(conn)
        try:
            async for raw in ws:
                try:
                    frame = json.loads(raw)
                except (ValueError, TypeError):
                    conn.frames.append(raw)
                    continue
                conn.frames.append(frame)
                if not isinstance(frame, dict):
                    continue
                if frame.get("type") == "cancel":
                    conn.cancels.append((frame.get("id"), time.monotonic()))
                    task = conn.tasks.pop(frame.get("id"), None)
                    if task:
                        task.cancel()
                elif frame.get("type") == "message":
                    if ws.path == "/close":
                        await ws.close()
                        break
                    conn.tasks[frame.get("id")] = asyncio.create_task(self._reply(ws, conn, frame))
        except websockets.ConnectionClosed:
            pass
        finally:
            conn.closed_at = time.monotonic()
            conn.closed.set()
            for task in conn.tasks.values():
                task.cancel()

    async def _reply(self, ws, conn, frame):
        mid = frame.get("id")
        try:
            if ws.path == "/app" or ws.path == "/reply_then_garbage" and len(conn.messages) % 2 == 1:
                words = words_of(f"app got: {frame.get('text')}")
                for w in words:
                    await ws.send(json.dumps({"type": "delta", "id": mid, "text": w}))
                await ws.send(json.dumps({"type": "done", "id": mid, "text": "".join(words)}))
            elif ws.path == "/slow":
                words = [f"s{i} " for i in range(self.slow_deltas)]
                for w in words:
                    await ws.send(json.dumps({"type": "delta", "id": mid, "text": w}))
                    await asyncio.sleep(self.slow_interval)
                await ws.send(json.dumps({"type": "done", "id": mid, "text": "".join(words)}))
            elif ws.path == "/state":
                await self._reply_state(ws, frame)
            elif ws.path == "/error":
                await ws.send(json.dumps({"type": "error", "id": mid, "message": "backend exploded"}))
            elif ws.path == "/error_echo":
                await ws.send(json.dumps({"type": "error", "id": mid,
                                          "message": f"backend exploded on: {frame.get('text')}"}))
            elif ws.path == "/error_utf8":
                self.variant += 1
                await ws.send(json.dumps({"type": "error", "id": mid,
                                          "message": long_non_ascii("backend exploded ", self.variant)},
                                         ensure_ascii=False))
            elif ws.path == "/garbage":
                await ws.send("this is not json {")
            elif ws.path == "/close_mid":
                for w in ("partial ", "reply "):
                    await ws.send(json.dumps({"type": "delta", "id": mid, "text": w}))
                await asyncio.sleep(0.05)
                await ws.close()
            elif ws.path == "/reply_then_garbage":
                await ws.send("oops{")
            elif ws.path == "/garbage_utf8":
                self.variant += 1
                await ws.send(long_non_ascii("this is not json { ", self.variant))
            else:
                await ws.send(json.dumps({"type": "error", "id": mid,
                                          "message": f"fake app: unknown path {ws.path}"}))
        except websockets.ConnectionClosed:
            pass
        finally:
            if conn.tasks.get(mid) is asyncio.current_task():
                del conn.tasks[mid]


    async def _reply_state(self, ws, frame):
        mid = frame.get("id")
        text = frame.get("text") or ""
        visible, marker, blob = text.partition("STATE:")
        state = self.directives.pop(mid, None)
        if marker:
            state = json.loads(blob)
        delay = re.search(r"\[delay=([0-9.]+)\]", visible)
        visible = re.sub(r"\s*\[delay=[0-9.]+\]", "", visible).strip()
        words = words_of(f"app got: {visible}")
        for i, w in enumerate(words):
            await ws.send(json.dumps({"type": "delta", "id": mid, "text": w}))
            if i == 0 and delay:
                await asyncio.sleep(float(delay.group(1)))
        done = {"type": "done", "id": mid, "text": "".join(words)}
        if state is not None:
            done["state"] = state
        await ws.send(json.dumps(done))


def state_reply_text(text):
    """What the /state app answers to `text` (the done text the client and history see)."""
    visible = text.partition("STATE:")[0]
    visible = re.sub(r"\s*\[delay=[0-9.]+\]", "", visible).strip()
    return "".join(words_of(f"app got: {visible}"))


# --------------------------------------------------------------------------------------
# Client of the gateway


class Turn:
    """The frames about one message id, in arrival order, ending with its terminal frame."""

    def __init__(self, mid, frames):
        self.id = mid
        self.frames = frames

    def of_type(self, kind):
        return [f for f in self.frames if f.get("type") == kind]

    @property
    def ack(self):
        acks = self.of_type("ack")
        return acks[0] if acks else None

    @property
    def deltas(self):
        return self.of_type("delta")

    @property
    def warnings(self):
        """Warning frames about this message (never terminal: store_degraded, too_large)."""
        return self.of_type("warning")

    @property
    def protocol_frames(self):
        """The frames but warnings: ack, deltas, terminal."""
        return [f for f in self.frames if f.get("type") != "warning"]

    @property
    def terminal(self):
        return self.frames[-1]

    @property
    def kind(self):
        return self.terminal.get("type")

    def describe(self):
        return describe_frames(self.frames, f"turn {self.id!r}")

    def expect_done(self):
        """Check ack, deltas, done in that order and done.text == concat(deltas)."""
        FrameTracker().feed_all(self.frames)
        if self.kind != "done":
            fail(f"expected done for {self.id!r}, got {brief(self.terminal)}\n{self.describe()}")
        frames = self.protocol_frames
        check(self.ack is not None and frames[0] is self.ack,
              f"expected an ack first (warnings aside)\n{self.describe()}")
        return self

    def expect_error(self, *codes):
        if self.kind != "error" or (codes and self.terminal.get("code") not in codes):
            fail(f"expected error {'/'.join(codes)} for {self.id!r}, got {brief(self.terminal)}\n"
                 f"{self.describe()}")
        FrameTracker().feed_all(self.frames)
        return self.terminal


class Client:
    """A WebSocket client of the gateway.

    Frames are read in order; the collectors take the frames they look for and keep the
    rest (`pending`) for later calls, so nothing is lost when replies of several messages
    interleave. `received` keeps every frame for failure messages.
    """

    counter = 0

    def __init__(self, ws, hello):
        self.ws = ws
        self.hello = hello
        self.pending = []
        self.received = []
        self.tracker = None

    def track(self):
        """Check the per-message invariants on every frame from now on (FrameTracker)."""
        self.tracker = FrameTracker()
        return self.tracker

    def position(self, frame):
        """Where `frame` (the object itself) is in `received`."""
        return next(i for i, f in enumerate(self.received) if f is frame)

    @classmethod
    async def connect(cls, gw, check_hello=True, expect_user=None, **kwargs):
        """Connect and check the hello. `expect_user`: None (a fresh u_... id of auth
        none), a string (that exact user, as auth jwt/header or a resume gives), or ANY."""
        url = gw if isinstance(gw, str) else gw.url
        kwargs.setdefault("open_timeout", DEFAULT_TIMEOUT)
        kwargs.setdefault("max_size", 2**22)
        ws = await websockets.connect(url, **kwargs)
        client = cls(ws, None)
        if check_hello:
            hello = await client.recv()
            check(hello.get("type") == "hello", f"first frame is not a hello: {brief(hello)}")
            check(hello.get("protocol") == PROTOCOL, f"hello.protocol is not {PROTOCOL}: {brief(hello)}")
            if expect_user is None:
                check(isinstance(hello.get("user"), str) and hello["user"].startswith("u_"),
                      f"hello.user should be a string u_...: {brief(hello)}")
            elif expect_user is ANY:
                check(isinstance(hello.get("user"), str) and hello["user"],
                      f"hello.user should be a non-empty string: {brief(hello)}")
            else:
                check(hello.get("user") == expect_user,
                      f"hello.user should be {expect_user!r}: {brief(hello)}")
            check(isinstance(hello.get("session"), str) and hello["session"].startswith("s_"),
                  f"hello.session should be a string s_...: {brief(hello)}")
            check("resume" in hello, f"hello has no resume field: {brief(hello)}")
            client.hello = hello
        return client

    @property
    def open(self):
        return self.ws.open

    async def close(self):
        await self.ws.close()

    async def send(self, obj):
        await self.ws.send(json.dumps(obj))

    async def send_raw(self, data):
        """Send a str (text frame) or bytes (binary frame) as is."""
        await self.ws.send(data)

    async def send_message(self, text, mid=None, room=None, **extra):
        frame = {"type": "message", "text": text}
        if mid is not None:
            frame["id"] = mid
        if room is not None:
            frame["room"] = room
        frame.update(extra)
        await self.send(frame)

    async def cancel(self, mid):
        await self.send({"type": "cancel", "id": mid})

    async def _read(self, timeout):
        try:
            raw = await asyncio.wait_for(self.ws.recv(), timeout)
        except asyncio.TimeoutError:
            return None
        except websockets.ConnectionClosed as err:
            fail(f"the gateway closed the connection (code {err.code}, reason {err.reason!r}); "
                 f"last frames: {[brief(f, 120) for f in self.received[-5:]]}")
        if isinstance(raw, bytes):
            fail(f"the gateway sent a binary frame: {raw[:80]!r}")
        try:
            frame = json.loads(raw)
        except ValueError:
            fail(f"the gateway sent a frame that is not JSON: {brief(raw)}")
        check(isinstance(frame, dict), f"the gateway sent a frame that is not an object: {brief(raw)}")
        self.received.append(frame)
        if self.tracker is not None:
            self.tracker.feed(frame)
        return frame

    async def next_matching(self, predicate, timeout=DEFAULT_TIMEOUT, what="a frame"):
        """The first frame (pending ones first) for which `predicate` holds; the others stay
        pending, in order."""
        for i, frame in enumerate(self.pending):
            if predicate(frame):
                return self.pending.pop(i)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            frame = await self._read(left) if left > 0 else None
            if frame is None:
                fail(f"no {what} within {timeout:.1f}s; frames not taken: "
                     f"{[brief(f, 120) for f in self.pending[-8:]]}; "
                     f"last frames: {[brief(f, 120) for f in self.received[-5:]]}")
            if predicate(frame):
                return frame
            self.pending.append(frame)

    async def recv(self, timeout=DEFAULT_TIMEOUT):
        """The next frame (pending first)."""
        return await self.next_matching(lambda f: True, timeout, "frame")

    async def recv_type(self, kind, mid=None, timeout=DEFAULT_TIMEOUT):
        def match(f):
            return f.get("type") == kind and (mid is None or f.get("id") == mid)
        return await self.next_matching(match, timeout, f"{kind} frame for id {mid!r}")

    async def expect_error(self, code, mid=ANY, timeout=DEFAULT_TIMEOUT):
        """The next error frame (about `mid` unless ANY); its code must be `code` (or one
        of a tuple of codes)."""
        def match(f):
            return f.get("type") == "error" and (mid is ANY or f.get("id") == mid)
        frame = await self.next_matching(match, timeout, f"error frame (want code {code})")
        codes = code if isinstance(code, (tuple, list, set)) else (code,)
        check(frame.get("code") in codes, f"expected error code {code}, got {brief(frame)}")
        check(isinstance(frame.get("message"), str), f"error frame without a message: {brief(frame)}")
        return frame

    def frames_about(self, mid):
        """Every frame received so far about message `mid` (answers to cancels excluded)."""
        return [f for f in self.received if f.get("id") == mid
                and not (f.get("type") == "error" and f.get("code") == "not_found")]

    async def collect_turn(self, mid, timeout=DEFAULT_TIMEOUT):
        """Wait for the terminal frame of `mid`; the Turn holds every frame about `mid`
        received on this connection up to it, also those an earlier call took (an ack taken
        with recv_type, say). Message ids are assumed unique per connection."""
        deadline = time.monotonic() + timeout
        while True:
            left = max(0.0, deadline - time.monotonic())
            try:
                frame = await self.next_matching(lambda f: f.get("id") == mid, left,
                                                 f"terminal frame for id {mid!r}")
            except TestFailure as err:
                title = f"frames for {mid!r} so far"
                raise TestFailure(f"{err}\n{describe_frames(self.frames_about(mid), title)}") from None
            if is_terminal(frame):
                frames = self.frames_about(mid)
                end = next(i for i, f in enumerate(frames) if f is frame)
                return Turn(mid, frames[:end + 1])

    async def message(self, text, mid=None, room=None, timeout=DEFAULT_TIMEOUT, **extra):
        """Send a message and collect its turn. Without `mid` the id comes from the ack."""
        await self.send_message(text, mid, room, **extra)
        if mid is None:
            ack = await self.next_matching(lambda f: f.get("type") in ("ack", "error"), timeout,
                                           "ack for a message without id")
            check(ack.get("type") == "ack", f"expected an ack, got {brief(ack)}")
            mid = ack.get("id")
            check(isinstance(mid, str) and mid, f"the ack of a message without id has no id: {brief(ack)}")
        return await self.collect_turn(mid, timeout)

    async def expect_silence(self, seconds, predicate=lambda f: True, what="frame"):
        """Fail if a frame matching `predicate` arrives within `seconds` (others stay pending)."""
        for frame in self.pending:
            if predicate(frame):
                fail(f"unexpected {what}: {brief(frame)}")
        deadline = time.monotonic() + seconds
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            frame = await self._read(left)
            if frame is None:
                return
            if predicate(frame):
                fail(f"unexpected {what}: {brief(frame)}")
            self.pending.append(frame)

    async def check_alive(self):
        """The connection still answers: a cancel of an unknown id gets not_found."""
        check(self.ws.open, "the gateway closed the connection")
        Client.counter += 1
        probe = f"probe-{Client.counter}"
        await self.cancel(probe)
        frame = await self.next_matching(lambda f: f.get("id") == probe, DEFAULT_TIMEOUT,
                                         f"answer to cancel of unknown id {probe}")
        check(frame.get("type") == "error" and frame.get("code") == "not_found",
              f"cancel of an unknown id should get error not_found, got {brief(frame)}")


def check_ack(ack, mid, room, route):
    """An ack of a message with no rules involved: the exact shape of docs/protocol.md, Server frames."""
    expected = {"type": "ack", "id": mid, "room": room, "route": route, "service": None,
                "params": {}, "enriched": None, "resolution": None, "rules": []}
    for key, value in expected.items():
        check(key in ack and ack[key] == value,
              f"ack.{key} should be {value!r}, got {ack.get(key, '<missing>')!r}: {brief(ack)}")


class FrameTracker:
    """Checks, over all frames of one connection, the invariants of each message id:
    ack at most once and before anything else about it, deltas and the terminal frame after
    it, exactly one terminal frame, nothing after it, done.text == concat(deltas) (or, when
    done says "truncated": true, a proper prefix of it)."""

    def __init__(self):
        self.state = {}       # id -> {"ack": bool, "deltas": [...], "terminal": frame}
        self.order = []       # (kind, id) in arrival order, kind in ack/terminal
        self.frames = []

    def feed(self, frame):
        self.frames.append(frame)
        kind = frame.get("type")
        mid = frame.get("id")
        if kind not in ("ack", "delta", "done", "cancelled", "error") or mid is None:
            return
        if kind == "error" and frame.get("code") == "not_found":
            return
        st = self.state.setdefault(mid, {"ack": None, "deltas": [], "bytes": 0, "terminal": None})
        if st["terminal"] is not None:
            fail(f"frame after the terminal frame of {mid!r}: {brief(frame)} "
                 f"(terminal was {brief(st['terminal'])})")
        if kind == "ack":
            check(st["ack"] is None, f"second ack for {mid!r}: {brief(frame)}")
            check(not st["deltas"], f"ack after deltas for {mid!r}: {brief(frame)}")
            st["ack"] = frame
            self.order.append(("ack", mid))
        elif kind == "delta":
            check(st["ack"] is not None, f"delta before the ack of {mid!r}: {brief(frame)}")
            check(isinstance(frame.get("text"), str), f"delta text is not a string: {brief(frame)}")
            st["deltas"].append(frame["text"])
            # a running count: joining every delta at each one was quadratic, a minute of
            # the test's own CPU over a 20 MB reply
            st["bytes"] += len(frame["text"].encode("utf-8"))
            relayed = st["bytes"]
            check(frame.get("seq") == relayed,
                  f"delta seq of {mid!r} is {frame.get('seq')!r}, not the reply's bytes so far ({relayed}): "
                  f"{brief(frame)}")
        else:
            st["terminal"] = frame
            self.order.append(("terminal", mid))
            if kind == "done":
                check(st["ack"] is not None, f"done without an ack for {mid!r}: {brief(frame)}")
                joined = "".join(st["deltas"])
                text = frame.get("text")
                if frame.get("truncated") is True:
                    # The gateway keeps at most max_reply_bytes of a reply for done.text and
                    # says so; the deltas still carry all of it.
                    check(isinstance(text, str) and joined.startswith(text) and len(text) < len(joined),
                          f"done.text of {mid!r} (truncated) is not a prefix of its deltas:\n"
                          f"  done.text: {brief(text)}\n  deltas:    {brief(joined)}")
                else:
                    check(text == joined,
                          f"done.text of {mid!r} is not the concatenation of its deltas:\n"
                          f"  done.text: {brief(text)}\n  deltas:    {brief(joined)}")
                check("usage" in frame, f"done without a usage field: {brief(frame)}")

    def feed_all(self, frames):
        for f in frames:
            self.feed(f)
        return self

    def terminal(self, mid):
        st = self.state.get(mid)
        return st and st["terminal"]

    def assert_one_terminal_each(self, ids):
        """Every id in `ids` has got exactly one terminal frame (feed() refuses a second)."""
        missing = [m for m in ids if not self.terminal(m)]
        check(not missing, f"{len(missing)} message(s) got no terminal frame: {missing[:10]}")
        extra = [m for m in self.state if m not in set(ids)]
        check(not extra, f"frames about ids never sent: {extra[:10]}")


# --------------------------------------------------------------------------------------
# A real Redis for the state tests


REDIS_SERVER = "/usr/bin/redis-server"
_redis_servers = []  # every RedisServer started by this process, for cleanup


class RedisError(Exception):
    """An error reply from Redis (-ERR ...)."""


def _resp_encode(args):
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        data = a if isinstance(a, bytes) else str(a).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


class _RespReader:
    def __init__(self, sock):
        self.sock = sock
        self.buf = b""

    def _fill(self):
        data = self.sock.recv(65536)
        if not data:
            raise ConnectionError("Redis closed the connection")
        self.buf += data

    def _line(self):
        while b"\r\n" not in self.buf:
            self._fill()
        line, _, self.buf = self.buf.partition(b"\r\n")
        return line

    def _exact(self, n):
        while len(self.buf) < n + 2:
            self._fill()
        data, self.buf = self.buf[:n], self.buf[n + 2:]
        return data

    def read(self):
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest.decode()
        if kind == b"-":
            return RedisError(rest.decode())
        if kind == b":":
            return int(rest)
        if kind == b"$":
            n = int(rest)
            return None if n < 0 else self._exact(n).decode("utf-8", "surrogateescape")
        if kind == b"*":
            n = int(rest)
            return None if n < 0 else [self.read() for _ in range(n)]
        raise ConnectionError(f"unexpected RESP line {line!r}")


async def wait_listening(port, proc, what, log_path, timeout=5.0):
    """Wait until a process the test started accepts TCP connections on `port`; fail with
    the end of its log when it exits first or does not listen within `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            return
        except OSError:
            exited, late = proc.poll() is not None, time.monotonic() >= deadline
            if exited or late:  # the log is read only to say why
                tail = Path(log_path).read_text(errors="replace")[-500:] if Path(log_path).exists() else ""
                check(not exited, f"{what} exited ({proc.returncode}): {tail}")
                check(not late, f"{what} did not listen on {port}: {tail}")
            await asyncio.sleep(0.05)


class Nutcracker:
    """Debian's nutcracker (twemproxy) with hash_tag "{}" in front of Redis servers on
    `redis_ports` (docs/state.md, Redis layout). `distribution: modula`: with `ketama` and
    fnv1a_64, Debian's 0.5 put every test user on one shard of two (docs/deployment.md)."""

    BINARY = "/usr/sbin/nutcracker"

    def __init__(self, redis_ports):
        self.port = free_port()
        self.dir = temp_dir("chatgate-e2e-nutcracker-")
        self.log = self.dir / "nutcracker.log"
        servers = "".join(f"   - 127.0.0.1:{p}:1\n" for p in redis_ports)
        (self.dir / "nutcracker.yml").write_text(
            "chatgate:\n"
            f"  listen: 127.0.0.1:{self.port}\n"
            "  hash: fnv1a_64\n  distribution: modula\n  hash_tag: \"{}\"\n  redis: true\n"
            "  timeout: 2000\n  auto_eject_hosts: false\n  servers:\n" + servers)
        self.proc = None

    async def start(self):
        if not os.access(self.BINARY, os.X_OK):
            fail("nutcracker not found (Debian package nutcracker; scripts/deps.sh test)")
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [self.BINARY, "-c", str(self.dir / "nutcracker.yml"), "-s", str(free_port()), "-a", "127.0.0.1"],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
        await wait_listening(self.port, self.proc, "nutcracker", self.log)
        return self

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


class RedisServer:
    """A redis-server of the test's own on a free port (no persistence, its own temp dir).

    `start()`/`astart()` spawn it and wait for PING; `stop()` (SIGTERM), `kill()` (SIGKILL),
    `pause()` (SIGSTOP: the socket stays open and nothing answers), `resume()` (SIGCONT),
    `restart()` (a new process on the same port, empty). A tiny synchronous client for
    inspection: `command(*args)`, `keys`, `hgetall`, `lrange`, `ttl`, `get`, `smembers`,
    `info_commandstats`. Each call opens its own short connection, so it never shares a
    socket with a paused server.
    """

    def __init__(self, port=None, password=None):
        self.port = port or free_port()
        self.password = password  # --requirepass; the inspection client AUTHs with it
        self.dir = temp_dir("chatgate-e2e-redis-")
        self.log_path = self.dir / "redis.log"
        self.proc = None
        self.paused = False
        self.starts = 0
        _redis_servers.append(self)

    @property
    def url(self):
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}"

    def command_line(self):
        cmd = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
               "--appendonly", "no", "--daemonize", "no", "--dir", str(self.dir)]
        if self.password:
            cmd += ["--requirepass", self.password]
        return cmd

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def _spawn(self):
        if not os.access(REDIS_SERVER, os.X_OK):
            fail(f"{REDIS_SERVER} not found (Debian package redis-server)")
        check(not self.alive(), f"redis on port {self.port} is already running")
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.command_line(), cwd=self.dir, stdin=subprocess.DEVNULL,
                                     stdout=self._log, stderr=subprocess.STDOUT)
        self.paused = False
        self.starts += 1

    def _ping(self):
        try:
            return self.command("PING", timeout=0.5) == "PONG"
        except (OSError, ConnectionError, RedisError):
            return False

    def _check_started(self, deadline):
        if self.proc.poll() is not None:
            fail(f"redis-server exited with status {self.proc.poll()} at start:\n{self.log_tail()}")
        if time.monotonic() > deadline:
            fail(f"redis-server did not answer PING on port {self.port}:\n{self.log_tail()}")

    def start(self, timeout=10.0):
        self._spawn()
        deadline = time.monotonic() + timeout
        while not self._ping():
            self._check_started(deadline)
            time.sleep(0.02)
        return self

    async def astart(self, timeout=10.0):
        self._spawn()
        deadline = time.monotonic() + timeout
        while not await asyncio.to_thread(self._ping):
            self._check_started(deadline)
            await asyncio.sleep(0.02)
        return self

    def _wait_gone(self):
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()

    def stop(self):
        """SIGTERM and wait (SIGCONT first if paused)."""
        if self.alive():
            if self.paused:
                self.resume()
            self.proc.terminate()
            self._wait_gone()

    def kill(self):
        """SIGKILL and wait: Redis vanishes without a word (its sockets are reset/closed)."""
        if self.alive():
            self.proc.kill()
            self._wait_gone()
            self.paused = False

    def pause(self):
        """SIGSTOP: connections stay open, nothing is answered."""
        check(self.alive(), "redis is not running")
        self.proc.send_signal(signal.SIGSTOP)
        self.paused = True

    def resume(self):
        if self.alive():
            self.proc.send_signal(signal.SIGCONT)
        self.paused = False

    def restart(self):
        """A new, empty server on the same port (after stop or kill)."""
        self.kill()
        return self.start()

    async def arestart(self):
        self.kill()
        return await self.astart()

    def log_tail(self, lines=20):
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no redis log)"
        return "\n".join("   | " + line for line in text[-lines:])

    def cleanup(self, keep=False):
        if self.alive():
            with contextlib.suppress(OSError):
                self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait()
        if not keep:
            with contextlib.suppress(OSError):
                for p in self.dir.iterdir():
                    p.unlink()
                self.dir.rmdir()

    async def __aenter__(self):
        return await self.astart()

    async def __aexit__(self, *exc):
        self.cleanup(keep=True)
        return False

    # -- the inspection client
    def command(self, *args, timeout=2.0, db=None):
        """Send one command on a fresh connection (in database `db` if given); the parsed
        reply (RedisError raised)."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=timeout) as sock:
            reader = _RespReader(sock)
            if self.password:
                sock.sendall(_resp_encode(["AUTH", self.password]))
                authed = reader.read()
                if isinstance(authed, RedisError):
                    raise authed
            if db is not None:
                sock.sendall(_resp_encode(["SELECT", db]))
                selected = reader.read()
                if isinstance(selected, RedisError):
                    raise selected
            sock.sendall(_resp_encode(args))
            reply = reader.read()
        if isinstance(reply, RedisError):
            raise reply
        return reply

    def keys(self, pattern="*"):
        return sorted(self.command("KEYS", pattern))

    def get(self, key):
        return self.command("GET", key)

    def type(self, key):
        return self.command("TYPE", key)

    def hgetall(self, key):
        flat = self.command("HGETALL", key)
        return dict(zip(flat[::2], flat[1::2]))

    def state(self, key):
        """A dialog's state (docs/state.md, Redis layout: the HASH `<dialog>:state`): its v,
        decoded, with "rev", "created_at" and "last_activity" from the hash's own fields; {}
        when there is none. Fails when the hash is there without a rev like '<holder>#<n>' or
        a v that is a JSON object."""
        fields = self.hgetall(key)
        if not fields:
            return {}
        rev = fields.get("rev")
        if not (isinstance(rev, str) and re.fullmatch(r"\S+#[0-9]+", rev)):
            fail(f"{key}: the state hash has no rev like '<holder>#<n>': {fields}")
        try:
            v = json.loads(fields.get("v", ""))
        except ValueError:
            v = None
        if not isinstance(v, dict):
            fail(f"{key}: the state hash's v is not a JSON object: {fields}")
        v["rev"] = rev
        for name in ("created_at", "last_activity"):
            if name in fields:
                v[name] = int(fields[name])
        return v

    def params_hash(self, key):
        """A dialog's params as the params HASH of the layout before the state held them:
        "<service>.<name>" -> the value as compact JSON text, from the state at `key` (a
        dialog_key(..., "state")); {} when there is none."""
        params = self.state(key).get("params") or {}
        return {f"{service}.{name}": json.dumps(value, separators=(",", ":"), ensure_ascii=False)
                for service, names in params.items() for name, value in names.items()}

    def param(self, key, field):
        """One param, "<service>.<name>", as compact JSON text (HGET of the params hash before
        the state), or None."""
        return self.params_hash(key).get(field)

    def lrange(self, key, start=0, stop=-1):
        return self.command("LRANGE", key, start, stop)

    def smembers(self, key):
        return set(self.command("SMEMBERS", key))

    def zrange(self, key, start=0, stop=-1):
        return self.command("ZRANGE", key, start, stop)

    def ttl(self, key):
        return self.command("TTL", key)

    def find_key(self, key):
        """`key` if it exists, else the same key with lower-case percent escapes if that one
        exists (docs/state.md, Keys, says upper-case hex; accept either), else None."""
        lower = re.sub(r"%[0-9A-F]{2}", lambda m: m.group(0).lower(), key)
        for k in (key, lower):
            if self.type(k) != "none":
                return k
        return None

    def flushall(self):
        return self.command("FLUSHALL")

    def config_resetstat(self):
        return self.command("CONFIG", "RESETSTAT")

    def info_commandstats(self):
        """{command: {"calls": n, "usec": n, ...}} from INFO commandstats."""
        stats = {}
        for line in self.command("INFO", "commandstats").splitlines():
            if line.startswith("cmdstat_"):
                name, _, fields = line[len("cmdstat_"):].partition(":")
                stats[name] = {}
                for field in fields.split(","):
                    k, _, v = field.partition("=")
                    with contextlib.suppress(ValueError):
                        stats[name][k] = float(v) if "." in v else int(v)
        return stats


def dialog_key(user, room, part, prefix="chatgate"):
    """The Redis key of one part of a dialog (docs/state.md, Redis layout), ids escaped; the
    hash tag is the user's, so a user's dialogs and rooms set share one slot."""
    return f"{prefix}:{{{escape_id(user)}}}:{escape_id(room)}:{part}"


def rooms_key(user, prefix="chatgate"):
    return f"{prefix}:{{{escape_id(user)}}}:rooms"


def escape_id(ident):
    """Percent-encoding of every byte outside [A-Za-z0-9_.@|-] (docs/state.md, Keys); upper-
    case hex digits. (The tests also accept lower case: see keys_match_escaped.)"""
    safe = set(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.@|-")
    return "".join(chr(b) if b in safe else "%%%02X" % b for b in ident.encode())


def empty_rules_dir():
    """A directory without rule files: the state tests drive state by directives only."""
    path = temp_dir("chatgate-e2e-norules-")
    return str(path)


def state_config(upstreams, default, store="memory", lifetimes=None, redis=None, **extra):
    """A gateway config for the state tests: `store` ("memory" or a redis:// URL), the
    travel service's defaults (cabin_class economy), short command timeouts for Redis."""
    cfg = make_config(upstreams, default, store=store,
                      services={"travel": {"defaults": {"cabin_class": "economy"}}},
                      rate_limit={"messages_per_second": 100_000, "burst": 100_000})
    if lifetimes:
        cfg["lifetimes"] = lifetimes
    redis_cfg = {"prefix": "chatgate", "command_timeout_ms": 1000, "connect_timeout_ms": 1000}
    redis_cfg.update(redis or {})
    cfg["redis"] = redis_cfg
    cfg.update(extra)
    return cfg


def check_turn_done(turn):
    """done after ack (warnings aside), and no state directive leaked to the client."""
    turn.expect_done()
    check("state" not in turn.terminal,
          f"the client's done frame carries the app's state directive: {brief(turn.terminal)}")
    return turn


def history_pairs(history):
    """[(role, content), ...] of a history list, for comparisons."""
    check(isinstance(history, list), f"history should be a list, got {brief(history)}")
    out = []
    for m in history:
        check(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str),
              f"a history entry is not {{role, content, ts}}: {brief(m)}")
        out.append((m["role"], m["content"]))
    return out


def check_history_ts(history, slack=120):
    now = time.time()
    for m in history:
        ts = m.get("ts")
        check(isinstance(ts, (int, float)) and not isinstance(ts, bool) and abs(ts - now) < slack,
              f"history entry ts should be unix seconds near now ({now:.0f}): {brief(m)}")


async def context_command(client, kind, room, timeout=DEFAULT_TIMEOUT, **extra):
    """Send context.get / context.forget / context.clear and return the context frame's
    state (after checking its room)."""
    frame = {"type": kind, "room": room}
    frame.update(extra)
    await client.send(frame)
    answer = await client.next_matching(
        lambda f: f.get("type") == "context" or (f.get("type") == "error" and f.get("id") is None),
        timeout, f"context frame answering {kind} of room {room!r}")
    check(answer.get("type") == "context", f"{kind} of room {room!r} got {brief(answer)}")
    check(answer.get("room") == room, f"context frame for room {room!r} has room {answer.get('room')!r}")
    state = answer.get("state")
    check(isinstance(state, dict), f"context frame without a state object: {brief(answer)}")
    return state


class RedisFront:
    """A TCP server between a gateway and a real Redis. mode "proxy" passes the bytes on;
    "error" answers every command with `error` (a RESP error line, without the '-');
    "stall" accepts and answers nothing (Redis stopped, for this gateway only). A mode holds
    for the connections accepted while it is set; `cut()` closes every open connection.
    `delay` (s) passes each piece of Redis's answers on that long after it came, in "proxy":
    a constant latency, as of a Redis far away or busy (a piece never waits behind the
    previous one's delay). `accepted` counts the gateway's connections (its tries, Redis
    away); Redis gone, the gateway's connection is closed."""

    def __init__(self, redis_port, delay=0.0):
        self.redis_port = redis_port
        self.mode = "proxy"
        self.delay = delay
        self.error = ""
        self.accepted = 0
        self.writers = set()
        self.server = None
        self.port = None

    async def start(self):
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    @property
    def url(self):
        return f"redis://127.0.0.1:{self.port}"

    def cut(self):
        for w in list(self.writers):
            w.close()

    async def close(self):
        self.cut()
        self.server.close()

    async def _serve(self, reader, writer):
        self.accepted += 1
        self.writers.add(writer)
        try:
            if self.mode == "error":
                while await self._read_command(reader):
                    writer.write(b"-" + self.error.encode() + b"\r\n")
                    await writer.drain()
            elif self.mode == "stall":
                while await reader.read(65536):
                    pass
            else:
                await self._proxy(reader, writer)
        except (OSError, asyncio.IncompleteReadError, ValueError):
            pass
        finally:
            self.writers.discard(writer)
            writer.close()

    @staticmethod
    async def _read_command(reader):
        """One RESP command (an array of bulk strings); False at the end of the stream."""
        line = await reader.readline()
        if not line:
            return False
        for _ in range(int(line[1:])):
            size = await reader.readline()
            await reader.readexactly(int(size[1:]) + 2)
        return True

    async def _proxy(self, reader, writer):
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.redis_port)
        self.writers.add(up_writer)
        loop = asyncio.get_running_loop()
        due = asyncio.Queue()

        async def requests():
            while data := await reader.read(65536):
                up_writer.write(data)
                await up_writer.drain()

        async def answers():
            while data := await up_reader.read(65536):
                due.put_nowait((loop.time() + self.delay, data))
            due.put_nowait((loop.time() + self.delay, None))

        async def pass_on():
            while True:
                at, data = await due.get()
                await asyncio.sleep(max(0.0, at - loop.time()))
                if data is None:
                    return
                writer.write(data)
                await writer.drain()

        tasks = [asyncio.create_task(t) for t in (requests(), answers(), pass_on())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.writers.discard(up_writer)
            up_writer.close()


# --------------------------------------------------------------------------------------
# Identity helpers


def b64url(data):
    import base64
    if isinstance(data, str):
        data = data.encode()
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def children_of(pid):
    """The pids whose parent is `pid` (from /proc/*/stat), alive (not zombies)."""
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[1]) == pid and fields[0] != "Z":
            found.add(int(entry))
    return found


def make_jwt(secret, claims, header=None, sign=True, raw_payload=False):
    """An HS256 JWT (compact form) signed with `secret`; `header` overrides the JOSE header
    (alg "none" and the like, for forgeries); `raw_payload`: `claims` is the payload text."""
    import hashlib
    import hmac
    head = header if header is not None else {"alg": "HS256", "typ": "JWT"}
    payload = claims if raw_payload else json.dumps(claims, separators=(",", ":"))
    signing_input = b64url(json.dumps(head, separators=(",", ":"))) + "." + b64url(payload)
    if not sign:
        return signing_input + "."
    key = secret.encode() if isinstance(secret, str) else secret
    sig = hmac.new(key, signing_input.encode(), hashlib.sha256).digest()
    return signing_input + "." + b64url(sig)


async def handshake_status(url, **kwargs):
    """Open a WebSocket and close it again: 101 if accepted, else the HTTP status refused with."""
    kwargs.setdefault("open_timeout", DEFAULT_TIMEOUT)
    try:
        ws = await websockets.connect(url, **kwargs)
    except websockets.InvalidStatusCode as err:
        return err.status_code
    await ws.close()
    return 101


async def expect_unauthorized(url, what, **kwargs):
    """Connect with bad credentials: the gateway must send an error frame with code
    unauthorized (and id null), no hello, and close with 1008. Returns the error frame.
    (A refusal in the HTTP handshake (401/403) is not what docs/protocol.md, Identity, says; it
    fails with the status named.)"""
    kwargs.setdefault("open_timeout", DEFAULT_TIMEOUT)
    try:
        ws = await websockets.connect(url, **kwargs)
    except websockets.InvalidStatusCode as err:
        fail(f"{what}: the handshake was refused with HTTP {err.status_code}; expected an "
             f"error frame unauthorized and close 1008")
    frames = []
    code = None
    try:
        while True:
            raw = await asyncio.wait_for(ws.recv(), DEFAULT_TIMEOUT)
            frames.append(json.loads(raw) if isinstance(raw, str) else raw)
    except websockets.ConnectionClosed as err:
        code = err.code
    except asyncio.TimeoutError:
        await ws.close()
        fail(f"{what}: the gateway did not close the connection within {DEFAULT_TIMEOUT}s; "
             f"frames: {[brief(f, 160) for f in frames]}")
    hellos = [f for f in frames if isinstance(f, dict) and f.get("type") == "hello"]
    errors = [f for f in frames if isinstance(f, dict) and f.get("type") == "error"]
    if hellos:
        fail(f"{what}: the gateway sent a hello (a user id) before refusing: {brief(hellos[0])}")
    check(errors and errors[0].get("code") == "unauthorized",
          f"{what}: expected an error frame with code unauthorized, got {[brief(f, 160) for f in frames]} "
          f"and close code {code}")
    check(errors[0].get("id") is None, f"{what}: the unauthorized error should have id null: {brief(errors[0])}")
    check(code == 1008, f"{what}: expected close code 1008, got {code}")
    return errors[0]


# --------------------------------------------------------------------------------------
# Running a test script


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=sys.modules["__main__"].__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gateway", default=os.environ.get("CHATGATE_BINARY",
                                                            str(REPO_ROOT / "build" / "chatgate")),
                        help="path of the chatgate binary (default: build/chatgate)")
    parser.add_argument("--keep-logs", action="store_true", help="print where the logs are kept")
    return parser.parse_args(argv)


async def _stop_all():
    for gw in _gateways:
        if gw.proc is not None and not gw.stopped:
            with contextlib.suppress(Exception):
                await gw.astop()


def _record_failure(message, err=None):
    """Keep a failure with its step and the gateway it most likely concerns."""
    if err is not None:
        print("Traceback (most recent call last):\n" + "".join(traceback.format_tb(err.__traceback__)),
              end="", file=sys.stderr, flush=True)
    gw = next((g for g in reversed(_gateways) if g.failed), _gateways[-1] if _gateways else None)
    _failures.append((_current_step[0], message, gw))
    print(f"   FAILED: {message.splitlines()[0][:200]} (details at the end)", flush=True)
    _current_step[0] = None


async def independent(part):
    """Await `part`, a coroutine that is one independent part of a test (it starts its own
    gateway): if it fails, the failure is recorded, the test goes on with the next part,
    and the script fails at the end. So one gateway bug does not hide the others."""
    try:
        await part
    except TestFailure as err:
        _record_failure(str(err), err)


def run(main, timeout=100):
    """Run `main(args)`, a coroutine function, as the whole test; exit 0 on pass, 1 on fail."""
    global _options
    _options = parse_args()
    name = Path(sys.argv[0]).stem
    started = time.monotonic()

    async def guarded():
        try:
            await asyncio.wait_for(main(_options), timeout)
        except asyncio.TimeoutError:
            fail(f"the test did not finish within {timeout}s")
        finally:
            await _stop_all()

    try:
        asyncio.run(guarded())
    except KeyboardInterrupt:
        _record_failure("interrupted")
    except TestFailure as err:
        _record_failure(str(err), err)
    except Exception as err:  # a bug in the test or an unexpected library error
        traceback.print_exc()
        _record_failure(f"{type(err).__name__}: {err}")
    finally:
        for gw in _gateways:
            if gw.alive():
                gw.proc.kill()
                gw.proc.wait()
        for rs in _redis_servers:
            rs.cleanup(keep=True)

    for gw in _gateways:
        report = gw.sanitizer_report()
        if report:
            _failures.append((None, f"{gw.name} logged a sanitizer report:\n{report}", gw))
    if _failures:
        shown = set()
        for step_name, message, gw in _failures:
            print(f"\nFAIL {name}" + (f" (step: {step_name})" if step_name else "") + f": {message}",
                  flush=True)
            if gw is not None and gw not in shown:
                print(gw.log_tail(), flush=True)
                shown.add(gw)
        others = [gw for gw in _gateways if gw not in shown]
        if others:
            print("--- other gateway logs: " + " ".join(str(gw.log_path) for gw in others), flush=True)
        if _redis_servers:
            print("--- redis logs: " + " ".join(str(rs.log_path) for rs in _redis_servers), flush=True)
        print(f"\nFAIL {name}: {len(_failures)} failure(s) in {time.monotonic() - started:.1f}s", flush=True)
        sys.exit(1)
    if _options.keep_logs:
        for gw in _gateways:
            print(f"log of {gw.name}: {gw.log_path}")
    else:
        for rs in _redis_servers:
            rs.cleanup()
        for path in _temp_dirs:
            shutil.rmtree(path, ignore_errors=True)
    print(f"PASS {name} ({time.monotonic() - started:.1f}s)", flush=True)
    sys.exit(0)
