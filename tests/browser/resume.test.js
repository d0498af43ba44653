#!/usr/bin/env node
// Browser test of the demo page resuming a reply after a lost connection (issue 38, item 4).
//
// The page talks to the gateway through a TCP proxy of this test, the network the test can
// cut: cut() resets every connection at once (no close frame: the page sees 1006, the
// gateway a lost connection) and refuses new ones until up(). (Chromium's own offline
// emulation, CDP Network.emulateNetworkConditions, holds an open WebSocket's frames and
// delivers them when back online: it never drops the connection, so it cannot test this.)
// The demo upstream sends a word every 100 ms, so a reply takes some 3 s. Then:
//   1. a reply cut mid-stream, the network down for a second (a reconnect attempt fails):
//      the page shows it resuming, reconnects by itself, sends {"type":"resume","id",
//      "after"} with the seq of the last delta it got, and shows the whole reply once: every
//      text the reply showed extends the one before (no repeat, no rewrite), the last equals
//      the done's text, one terminal frame, no second ack;
//   2. a second reply cut mid-stream; after the resume, Stop: the cancel goes out with the
//      same id, the reply ends stopped (one `cancelled`), and no more text comes;
//   3. a third reply cut while the gateway restarts (it forgets its replies): the resume gets
//      not_found and the page marks the reply interrupted, then goes on (a fourth message
//      gets its whole reply);
//   4. the page logged no error but the failed connection attempts.
// The reply texts hold non-ASCII characters: a delta's seq counts bytes, not characters.
//
// Usage: node resume.test.js [CHATGATE_BINARY] [--out DIR]
//   CHATGATE_BINARY  the gateway (else $CHATGATE_BINARY, else ../../build/chatgate)
//   --out DIR        where a failure's screenshot goes (else $CHATGATE_BROWSER_OUT, else .)
//   $CHATGATE_CHROMIUM  the browser (default /usr/bin/chromium)
// Exit status 0 on pass, 1 on failure (with the failing step, the WebSocket frames and the
// gateway's log tail), 77 when chromium is missing (ctest reports it as skipped).
"use strict";

const fs = require("fs");
const net = require("net");
const os = require("os");
const path = require("path");
const { REPO, stamp, say, fail, check, sleep, until, parseArgs, preflight, steps, run, launchChromium,
  startOnFreePort, GatewayProcess } = require("./common");

const DEADLINE_MS = 55000; // the whole test, browser start to cleanup
const WORD_MS = 100;       // the demo upstream's pace

// ---- the gateway and the network between it and the page --------------------------------

class Gateway extends GatewayProcess {
  constructor(binary, port, config) {
    super(binary, port, {
      args: ["--web", path.join(REPO, "web"), "--config", config],
      // fixed, so the page's resume token (its user) survives the restart of step 3
      env: { CHATGATE_RESUME_SECRET: "browser-test-resume-secret-0123456789" },
      keepLines: 400,
    });
  }
}

// 127.0.0.1:port -> the gateway, byte for byte. cut() resets every connection and refuses
// (resets) new ones until up().
class CutProxy {
  constructor(targetPort) {
    this.targetPort = targetPort;
    this.conns = new Set();
    this.down = false;
    this.refused = 0;
  }

  get base() { return "http://127.0.0.1:" + this.port; }

  start() {
    this.server = net.createServer((client) => {
      if (this.down) {
        this.refused++;
        client.resetAndDestroy();
        return;
      }
      const upstream = net.connect(this.targetPort, "127.0.0.1");
      const pair = { client, upstream };
      this.conns.add(pair);
      const end = () => {
        this.conns.delete(pair);
        client.destroy();
        upstream.destroy();
      };
      for (const s of [client, upstream]) {
        s.setNoDelay(true);
        s.on("error", end);
        s.on("close", end);
      }
      client.pipe(upstream);
      upstream.pipe(client);
    });
    return new Promise((resolve, reject) => {
      this.server.on("error", reject);
      this.server.listen(0, "127.0.0.1", () => {
        this.port = this.server.address().port;
        resolve();
      });
    });
  }

  cut() {
    this.down = true;
    for (const { client, upstream } of this.conns) {
      client.resetAndDestroy();
      upstream.destroy();
    }
    this.conns.clear();
  }

  up() { this.down = false; }

  stop() {
    this.cut();
    return new Promise((resolve) => this.server.close(() => resolve()));
  }
}

// ---- the test -------------------------------------------------------------------------

// The demo upstream's reply echoes the message: long ones make it last.
const TEXT_A = "Tell me about the café in Zürich — the naïve one with crème brûlée ✓ and a view of the lake please";
const TEXT_B = "And the smørrebrød place in Århus — is it open on Sunday evening for a table of four people";
const TEXT_C = "What about Kraków — the pierogi ✓ near the old square and the river walk in spring time";
const TEXT_D = "Thanks — that is all for now";

async function main() {
  const opts = parseArgs(process.argv.slice(2), "node resume.test.js [CHATGATE_BINARY] [--out DIR]");
  const playwright = preflight(opts);

  fs.mkdirSync(opts.out, { recursive: true });
  const tmp = fs.mkdtempSync(path.join(os.tmpdir(), "chatgate-resume-"));
  const profile = path.join(tmp, "profile");
  const config = path.join(tmp, "config.json");
  fs.writeFileSync(config, JSON.stringify({
    upstreams: { demo: { url: "demo", delay_ms: WORD_MS } },
    default_upstream: "demo",
  }, null, 2));

  let gateway = null;
  let proxy = null;
  let context = null;
  let page = null;
  const problems = [];   // console errors, page errors
  const sockets = [];    // each WebSocket the page opened: {url, sent: [frame], received: [frame]}
  const log = [];        // the last frames each way, for the failure report
  const { step, failed } = steps(DEADLINE_MS, () => { if (gateway) gateway.stop(); });

  // Every frame of the page's sockets about message id: [{sock, dir, f}], in order.
  const framesOf = (id) => {
    const out = [];
    sockets.forEach((s, i) => {
      for (const f of s.sent) if (f.id === id) out.push({ sock: i, dir: ">", f });
      for (const f of s.received) if (f.id === id) out.push({ sock: i, dir: "<", f });
    });
    return out;
  };
  const TERMINAL = new Set(["done", "cancelled", "error"]);
  const terminalsOf = (id) => framesOf(id).filter((x) => x.dir === "<" && TERMINAL.has(x.f.type));

  try {
    await step("start the gateway and the proxy in front of it", async () => {
      await startOnFreePort((port) => (gateway = new Gateway(opts.gateway, port, config)));
      proxy = new CutProxy(gateway.port);
      await proxy.start();
      say(`      gateway ${opts.gateway} on ${gateway.base}, the page through ${proxy.base}`);
    });

    await step("start chromium; open the page", async () => {
      context = await launchChromium(playwright, opts.chromium, profile, {
        viewport: { width: 1280, height: 800 }, locale: "en-GB", timezoneId: "UTC",
      });
      page = context.pages()[0] || (await context.newPage());
      page.on("console", (m) => { if (m.type() === "error") problems.push("console error: " + m.text()); });
      page.on("pageerror", (e) => problems.push("page error: " + e.message));
      page.on("websocket", (ws) => {
        const s = { url: ws.url(), sent: [], received: [] };
        const n = sockets.push(s) - 1;
        const note = (dir, data) => {
          log.push(`${stamp()} #${n} ${dir} ${String(data).slice(0, 140)}`);
          if (log.length > 80) log.shift();
        };
        note("open", ws.url());
        const parse = (data) => { try { return JSON.parse(data); } catch (e) { return {}; } };
        ws.on("framesent", (f) => { s.sent.push(parse(f.payload)); note(">", f.payload); });
        ws.on("framereceived", (f) => {
          s.received.push(parse(f.payload));
          if (!String(f.payload).startsWith('{"type":"delta"')) note("<", f.payload);
        });
        ws.on("close", () => note("closed", ""));
      });
      await page.goto(proxy.base + "/", { waitUntil: "load" });
      await page.waitForSelector('#status[data-state="open"]');
    });

    // page.waitForFunction compiles its predicate with eval, which the page's CSP refuses;
    // page.evaluate is not subject to it, so poll with that.
    const waitUntil = (fn, arg, timeoutMs, message) => until(() => page.evaluate(fn, arg), timeoutMs, message);
    const reply = (id) => page.locator(`#log .turn[data-id="${id}"] .msg-assistant`);
    const replyIn = (id, state) => page.locator(`#log .turn[data-id="${id}"] .msg-assistant[data-state="${state}"]`);
    const replyText = async (id) => (await reply(id).locator(".msg-text").textContent());
    const deltasOn = (sock, id) => sockets[sock].received.filter((f) => f.type === "delta" && f.id === id);

    // Sends text; returns the new turn's id once its reply shows `deltas` deltas. Every text
    // the reply shows and every state it takes are recorded in the page (a MutationObserver:
    // one record per frame the page handles), for noRepeatNoGap.
    async function sendAndStream(text, deltas) {
      const before = await page.locator("#log .turn").count();
      await page.fill("#text", text);
      await page.click("#send");
      await page.locator("#log .turn").nth(before).waitFor();
      const id = await page.locator("#log .turn").nth(before).getAttribute("data-id");
      await page.evaluate((id) => {
        const r = document.querySelector(`.turn[data-id="${id}"] .msg-assistant`);
        const rec = { texts: [], states: [r.dataset.state] };
        (window.__resumeTest ||= {})[id] = rec;
        new MutationObserver(() => {
          const t = r.querySelector(".msg-text").textContent;
          if (t !== rec.texts[rec.texts.length - 1]) rec.texts.push(t);
          if (r.dataset.state !== rec.states[rec.states.length - 1]) rec.states.push(r.dataset.state);
        }).observe(r, { subtree: true, childList: true, characterData: true, attributes: true });
      }, id);
      const sock = sockets.length - 1;
      await until(() => deltasOn(sock, id).length >= deltas, 5000, `the reply to ${id} did not stream ${deltas} deltas`);
      await waitUntil((id) => document.querySelector(`.turn[data-id="${id}"] .msg-assistant`).dataset.state === "streaming",
        id, 5000, `the reply to ${id} is not shown streaming`);
      return { id, sock };
    }

    // Cuts the network; the page notices (the reply waits to resume, the status says
    // disconnected). Returns the seq of the last delta of id the page got before the cut.
    async function cutMidReply(id, sock) {
      check(!terminalsOf(id).length, `the reply to ${id} ended before the cut: make it longer`);
      proxy.cut();
      await page.waitForSelector('#status[data-state="closed"]', { timeout: 5000 });
      await replyIn(id, "resuming").waitFor({ timeout: 5000 })
        .catch(async () => fail(`after the cut the reply to ${id} is ${await reply(id).getAttribute("data-state")}, not resuming`));
      const ds = deltasOn(sock, id);
      const seq = ds[ds.length - 1].seq;
      check(Number.isInteger(seq) && seq > 0, `the deltas carry no seq: ${JSON.stringify(ds[ds.length - 1])}`);
      say(`      cut after ${ds.length} deltas of ${id} (seq ${seq}): “${(await replyText(id)).slice(0, 40)}…”`);
      return seq;
    }

    // The page reconnected and asked for the rest of id after `seq`: returns the new socket.
    async function expectResume(id, seq, oldSock) {
      await page.waitForSelector('#status[data-state="open"]', { timeout: 10000 });
      const sock = sockets.length - 1;
      check(sock > oldSock, "the page is open again but opened no new WebSocket");
      check(/[?&]resume=/.test(sockets[sock].url), "the page reconnected without its resume token: " + sockets[sock].url);
      const resumes = await until(() => {
        const r = sockets[sock].sent.filter((f) => f.type === "resume" && f.id === id);
        return r.length ? r : null;
      }, 5000, `the page did not send {"type":"resume","id":"${id}"} on its new connection`);
      check(resumes.length === 1 && resumes[0].after === seq,
        `the page's resume is ${JSON.stringify(resumes)}; expected one with after ${seq} (the last delta's seq)`);
      return sock;
    }

    // Every text the reply showed extends the one before it (nothing shown twice, nothing
    // rewritten: what the done's text replaced at the end was the same text), the last
    // is `want`.
    async function noRepeatNoGap(id, want) {
      const rec = await page.evaluate((id) => window.__resumeTest[id], id);
      for (let i = 1; i < rec.texts.length; i++) {
        check(rec.texts[i].startsWith(rec.texts[i - 1]),
          `the reply to ${id} was rewritten (a repeat or a gap the done's text had to fix):\n` +
          `  shown:      ${JSON.stringify(rec.texts[i - 1])}\n  then shown: ${JSON.stringify(rec.texts[i])}`);
      }
      const last = rec.texts[rec.texts.length - 1];
      check(last === want, `the reply to ${id} shows\n  ${JSON.stringify(last)}\nnot\n  ${JSON.stringify(want)}`);
      return rec;
    }

    await step("a reply cut mid-stream, the network down 1 s: the page resumes it, the whole reply once", async () => {
      const { id, sock } = await sendAndStream(TEXT_A, 5);
      const seq = await cutMidReply(id, sock);
      await sleep(1000); // down: the page's first reconnect attempt (after ~0.5 s) fails
      check(proxy.refused >= 1, "the page did not try to reconnect while the network was down");
      check((await page.textContent("#status")).includes("retrying"), "the status does not say the page retries");
      proxy.up();
      const sock2 = await expectResume(id, seq, sock);
      await replyIn(id, "done").waitFor({ timeout: 10000 })
        .catch(async () => fail(`the resumed reply to ${id} did not finish: ${await reply(id).getAttribute("data-state")}`));
      const terms = terminalsOf(id);
      check(terms.length === 1 && terms[0].f.type === "done" && terms[0].sock === sock2,
        `expected one done for ${id}, on the new connection: ${JSON.stringify(terms)}`);
      const done = terms[0].f;
      check(done.text.includes("You said") && done.text.includes("crème brûlée ✓"), "not the demo's reply: " + done.text);
      check(!sockets[sock2].received.some((f) => f.type === "ack" && f.id === id), `the resume of ${id} got a second ack`);
      const after = deltasOn(sock2, id);
      check(after.length >= 2, `only ${after.length} delta(s) after the resume: the reply was not live any more`);
      const rec = await noRepeatNoGap(id, done.text);
      const states = rec.states.filter((st) => st !== "queued").join(" "); // queued may be gone before the recording
      check(states === "streaming resuming streaming done", `the reply went through the states ${rec.states.join(" ")}`);
      check((await reply(id).getAttribute("data-resumed")) === "1", "the reply is not marked resumed");
      check((await reply(id).locator(".msg-status").textContent()).includes("resumed"), "the reply does not say it was resumed");
      say(`      resumed after seq ${seq}: ${after.length} deltas (the first with ${Buffer.byteLength(after[0].text)} bytes kept), ` +
        `then the done (${Buffer.byteLength(done.text)} bytes), on socket #${sock2}`);
    });

    await step("a second reply cut mid-stream: after the resume, Stop still stops it", async () => {
      const { id, sock } = await sendAndStream(TEXT_B, 4);
      const seq = await cutMidReply(id, sock);
      await sleep(200);
      proxy.up();
      const sock2 = await expectResume(id, seq, sock);
      // the rest streams again (the catch-up delta and a live one), then Stop
      await until(() => deltasOn(sock2, id).length >= 2, 5000, `the resumed reply to ${id} does not stream`);
      await waitUntil((id) => document.querySelector(`.turn[data-id="${id}"] .msg-assistant`).dataset.state === "streaming",
        id, 5000, `the resumed reply to ${id} is not shown streaming`);
      check(!terminalsOf(id).length, `the reply to ${id} ended before Stop: make it longer`);
      check(!(await page.isDisabled("#stop")), "the Stop button is disabled while the resumed reply streams");
      check((await page.getAttribute("#stop", "data-target")) === id, "the Stop button does not target the resumed reply");
      await page.click("#stop");
      await replyIn(id, "stopped").waitFor({ timeout: 5000 })
        .catch(async () => fail(`the resumed reply was not stopped: ${await reply(id).getAttribute("data-state")}`));
      const cancels = sockets[sock2].sent.filter((f) => f.type === "cancel");
      check(cancels.length === 1 && cancels[0].id === id, `the cancels sent: ${JSON.stringify(cancels)}`);
      const textAtStop = await replyText(id);
      await sleep(6 * WORD_MS);
      check((await replyText(id)) === textAtStop, "the stopped reply kept growing");
      const terms = terminalsOf(id);
      check(terms.length === 1 && terms[0].f.type === "cancelled", `expected one cancelled for ${id}: ${JSON.stringify(terms)}`);
      const all = sockets[sock2].received.filter((f) => f.id === id);
      check(all[all.length - 1].type === "cancelled", `frames of ${id} came after its cancelled: ${JSON.stringify(all.slice(-3))}`);
      check(!textAtStop.includes("You said"), "the reply finished before Stop took effect: " + textAtStop);
      await noRepeatNoGap(id, textAtStop);
      check(await page.isDisabled("#stop"), "the Stop button is still enabled after the reply stopped");
      say(`      stopped after ${Buffer.byteLength(textAtStop)} bytes: “${textAtStop.slice(0, 40)}…”`);
    });

    await step("a reply the gateway forgot (it restarted): the page marks it interrupted and goes on", async () => {
      const user = await page.getAttribute("#status", "data-user");
      const { id, sock } = await sendAndStream(TEXT_C, 3);
      await cutMidReply(id, sock);
      await gateway.stop(); // its replies go with it
      await gateway.start();
      proxy.up();
      await page.waitForSelector('#status[data-state="open"]', { timeout: 10000 });
      check((await page.getAttribute("#status", "data-user")) === user, "after the restart the page is another user");
      await replyIn(id, "interrupted").waitFor({ timeout: 5000 })
        .catch(async () => fail(`the forgotten reply is ${await reply(id).getAttribute("data-state")}, not interrupted`));
      check((await reply(id).locator(".msg-status").textContent()).includes("interrupted"), "the reply does not say interrupted");
      const terms = terminalsOf(id);
      check(terms.length === 1 && terms[0].f.type === "error" && terms[0].f.code === "not_found",
        `expected one not_found for ${id}: ${JSON.stringify(terms)}`);
      check(await page.isDisabled("#stop"), "the Stop button is enabled with no reply in flight");
      const next = await sendAndStream(TEXT_D, 1);
      await replyIn(next.id, "done").waitFor({ timeout: 10000 });
      const done = terminalsOf(next.id);
      check(done.length === 1 && done[0].f.type === "done", `the next message's reply: ${JSON.stringify(done)}`);
      await noRepeatNoGap(next.id, done[0].f.text);
    });

    await step("no console error but the refused connection attempts", async () => {
      const real = problems.filter((p) => !/WebSocket connection to .* failed/.test(p));
      check(real.length === 0, "the page had problems:\n  " + real.join("\n  "));
    });

    say("PASS");
    return 0;
  } catch (e) {
    failed(e);
    if (page) {
      const shot = path.join(opts.out, "resume-failure.png");
      await page.screenshot({ path: shot }).then(() => console.error("screenshot of the failure: " + shot), () => {});
    }
    if (problems.length) console.error("--- page problems\n" + problems.join("\n"));
    if (log.length) console.error("--- WebSocket frames but deltas (last 80)\n" + log.join("\n"));
    if (gateway) console.error("--- gateway log (last 40)\n" + gateway.tail(40));
    return 1;
  } finally {
    if (context) await context.close().catch(() => {});
    if (proxy) await proxy.stop();
    if (gateway) await gateway.stop();
    fs.rmSync(tmp, { recursive: true, force: true });
  }
}

run(main);
