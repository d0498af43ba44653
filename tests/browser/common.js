// What the browser tests share: demo.test.js and origin.test.js both require("./common").
// It holds their output (say, with the seconds since the start), their failures (fail,
// check, TestFailure), waiting (sleep, until), the command line both take (parseArgs), what
// they need before they start (preflight), their steps under a deadline (steps, run),
// Debian's chromium (launchChromium), and the gateway process (GatewayProcess, on a free
// local port, with the shipped rules and the clock fixed at NOW, its log kept).
"use strict";

const { spawn } = require("child_process");
const fs = require("fs");
const http = require("http");
const net = require("net");
const path = require("path");

const REPO = path.resolve(__dirname, "..", "..");
const NOW = "2026-02-03T10:00:00Z"; // so "next week" is 2026-02-10

// ---- output -------------------------------------------------------------------------

const t0 = Date.now();
const stamp = () => ((Date.now() - t0) / 1000).toFixed(1).padStart(5) + "s";
const say = (msg) => console.log(stamp() + "  " + msg);

class TestFailure extends Error {}
function fail(msg) { throw new TestFailure(msg); }
function check(cond, msg) { if (!cond) fail(msg); }
const explain = (e) => (e instanceof TestFailure ? e.message : e.stack || e);

// ---- waiting ------------------------------------------------------------------------

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

// Polls pred until it returns something true, and returns that; fails with message (or
// what message() says) after timeoutMs.
async function until(pred, timeoutMs, message) {
  const end = Date.now() + timeoutMs;
  for (;;) {
    const v = await pred();
    if (v) return v;
    if (Date.now() > end) fail(typeof message === "function" ? message() : message);
    await sleep(20);
  }
}

// ---- arguments ----------------------------------------------------------------------

// [CHATGATE_BINARY] [--out DIR], and `--KEY FILE` for each key of extra (its value there
// the default); every path made absolute.
function parseArgs(argv, usage, extra = {}) {
  const opts = {
    gateway: process.env.CHATGATE_BINARY || path.join(REPO, "build", "chatgate"),
    out: process.env.CHATGATE_BROWSER_OUT || process.cwd(),
    ...extra,
    chromium: process.env.CHATGATE_CHROMIUM || "/usr/bin/chromium",
  };
  for (let i = 0; i < argv.length; i++) {
    const a = argv[i];
    if (a === "--out") opts.out = argv[++i];
    else if (a.startsWith("--") && Object.hasOwn(extra, a.slice(2))) opts[a.slice(2)] = argv[++i];
    else if (a === "--help" || a === "-h") {
      console.log("usage: " + usage);
      process.exit(0);
    } else if (!a.startsWith("--")) opts.gateway = a;
    else fail("unknown option " + a);
  }
  opts.gateway = path.resolve(opts.gateway);
  opts.out = path.resolve(opts.out);
  for (const k of Object.keys(extra)) if (opts[k]) opts[k] = path.resolve(opts[k]);
  return opts;
}

// ---- the run ------------------------------------------------------------------------

// Exits 77 (ctest: skipped) when chromium is missing; fails without the gateway binary or
// without playwright-core (or a module of `also`). Returns playwright-core.
function preflight(opts, also = []) {
  if (!fs.existsSync(opts.chromium)) {
    console.error(`SKIP: ${opts.chromium} not found (Debian: apt-get install chromium)`);
    process.exit(77);
  }
  check(fs.existsSync(opts.gateway), `no gateway binary at ${opts.gateway} (give its path as the first argument)`);
  try {
    const playwright = require("playwright-core");
    for (const m of also) require.resolve(m);
    return playwright;
  } catch (e) {
    fail(["playwright-core", ...also].join(" or ") + " is not installed: run `npm ci` in tests/browser (" + e.message + ")");
  }
}

// A test's steps: step(name, fn) runs fn and says "ok    name"; failed(e) reports e as the
// failure of the step under way. Past deadlineMs the test fails at once, after onDeadline()
// (which stops what the test started).
function steps(deadlineMs, onDeadline) {
  let current = "start";
  const deadline = setTimeout(() => {
    console.error(`FAIL: the test took over ${deadlineMs / 1000} s (step: ${current})`);
    onDeadline();
    process.exit(1);
  }, deadlineMs);
  deadline.unref();

  const step = async (name, fn) => {
    current = name;
    await fn();
    say("ok    " + name);
  };
  const failed = (e) => console.error(`FAIL (${current}): ${explain(e)}`);
  return { step, failed };
}

// Runs main() and exits with the status it returns (an error it throws: 1).
function run(main) {
  main().then((code) => process.exit(code), (e) => {
    console.error("FAIL: " + explain(e));
    process.exit(1);
  });
}

// ---- chromium -----------------------------------------------------------------------

// Debian's chromium (executablePath), headless, with the profile directory `profile`;
// `options` adds the test's own (viewport, locale...). Its actions time out after 10 s.
async function launchChromium(playwright, executablePath, profile, options) {
  const context = await playwright.chromium.launchPersistentContext(profile, {
    executablePath,
    headless: true,
    // The network is closed: without these chromium waits on lookups it will never get.
    args: ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
      "--disable-background-networking", "--disable-component-update", "--disable-sync",
      "--no-proxy-server", "--disable-dev-shm-usage"],
    timeout: 20000,
    ...options,
  });
  context.setDefaultTimeout(10000);
  return context;
}

// ---- the gateway --------------------------------------------------------------------

function freePort() {
  return new Promise((resolve, reject) => {
    const srv = net.createServer();
    srv.unref();
    srv.on("error", reject);
    srv.listen(0, "127.0.0.1", () => {
      const { port } = srv.address();
      srv.close(() => resolve(port));
    });
  });
}

function httpGet(url, timeoutMs) {
  return new Promise((resolve) => {
    const req = http.get(url, { timeout: timeoutMs }, (res) => {
      res.resume();
      res.on("end", () => resolve(res.statusCode));
    });
    req.on("timeout", () => { req.destroy(); resolve(0); });
    req.on("error", () => resolve(0));
  });
}

// The gateway on 127.0.0.1:port with the shipped rules, CHATGATE_NOW=NOW and the memory
// store; `args` and `env` are the test's own, `cwd` its working directory. Its output is kept
// in `log` (the last `keepLines` lines). start() returns once /healthz answers and may be
// called again after stop(), which sends SIGTERM (SIGKILL after 5 s) and returns {code, sig}.
class GatewayProcess {
  constructor(binary, port, { args = [], env = {}, cwd, keepLines = Infinity } = {}) {
    this.binary = binary;
    this.port = port;
    this.args = args;
    this.env = env;
    this.cwd = cwd;
    this.keepLines = keepLines;
    this.log = [];
    this.proc = null;
    this.exited = null;
  }

  get base() { return "http://127.0.0.1:" + this.port; }

  async start() {
    const args = ["--listen", "127.0.0.1:" + this.port, ...this.args,
      "--rules", path.join(REPO, "rules"), "--log-level", process.env.CHATGATE_TEST_LOG_LEVEL || "info"];
    const env = { ...process.env, CHATGATE_NOW: NOW, ...this.env };
    delete env.REDIS_URL; // the memory store, whatever the caller's environment says
    this.exited = null;
    const proc = spawn(this.binary, args, { env, cwd: this.cwd, stdio: ["ignore", "pipe", "pipe"] });
    this.proc = proc;
    const keep = (chunk) => {
      for (const line of chunk.toString().split("\n")) if (line) this.log.push(line);
      if (this.log.length > this.keepLines) this.log.splice(0, this.log.length - this.keepLines);
    };
    proc.stdout.on("data", keep);
    proc.stderr.on("data", keep);
    this.exitPromise = new Promise((resolve) => proc.on("exit", (code, sig) => {
      this.exited = { code, sig };
      resolve(this.exited);
    }));
    proc.on("error", (e) => { this.log.push("spawn error: " + e.message); });
    const end = Date.now() + 10000;
    while (Date.now() < end) {
      if (this.exited) fail(this.exitedAtStart());
      if ((await httpGet(this.base + "/healthz", 500)) === 200) return;
      await sleep(100);
    }
    fail("the gateway did not answer /healthz within 10 s");
  }

  // What start() fails with when the gateway exits before it answers.
  exitedAtStart() { return `the gateway exited at start (status ${this.exited.code}, signal ${this.exited.sig})`; }

  async stop() {
    if (!this.proc || this.exited) return this.exited;
    this.proc.kill("SIGTERM");
    const timer = setTimeout(() => { if (!this.exited) this.proc.kill("SIGKILL"); }, 5000);
    const r = await this.exitPromise;
    clearTimeout(timer);
    return r;
  }

  tail(n) { return this.log.slice(-n).join("\n"); }
}

// Starts the process make(port) builds on a free port (make may keep it, for a deadline's
// cleanup); a free port can be taken between the probe and the bind, so up to three tries.
async function startOnFreePort(make) {
  for (let attempt = 1; ; attempt++) {
    const proc = make(await freePort());
    try {
      await proc.start();
      return proc;
    } catch (e) {
      await proc.stop();
      if (attempt >= 3) throw e;
    }
  }
}

module.exports = {
  REPO, NOW, stamp, say, TestFailure, fail, check, explain, sleep, until, parseArgs, preflight, steps, run,
  launchChromium, freePort, httpGet, GatewayProcess, startOnFreePort,
};
