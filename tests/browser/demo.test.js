#!/usr/bin/env node
// Browser test of chatgate's demo page (web/), issue 5 item 2.
//
// Starts the real gateway on a free local port (demo upstream, shipped rules, the clock
// fixed at CHATGATE_NOW=2026-02-03T10:00:00Z so "next week" is 2026-02-10), drives
// Debian's /usr/bin/chromium with playwright-core (never a downloaded browser), and:
//   1. plays the flight search of docs/scenarios.md in room "trip" and checks the panel shows
//      travel from=Nairobi, to=London, departure_date=2026-02-10, return_date=2026-02-20,
//      and that each message shows its route and the rules that fired;
//   2. sends another message, clicks Stop while it streams, and checks the reply is marked
//      stopped, stops growing, and is recorded as stopped in the gateway's history;
//   3. saves screenshots: laptop (1280x800) and phone (390x844, chat and context views);
//   4. forgets a param with its button, switches to another room (empty panel) and back;
//      says "I live in Nairobi" there: the profile panel shows it, with a forget button, and
//      "Find flights to London" shows travel.from Nairobi marked as from the profile;
//   5. reloads the page (resume keeps the user and its dialog), then restarts the gateway
//      and checks the page reconnects by itself as the same user;
//   6. checks the page asked nothing of any host but the gateway and logged no error
//      (a Content-Security-Policy violation is logged as one).
//
// Usage: node demo.test.js [CHATGATE_BINARY] [--out DIR] [--docs FILE]
//   CHATGATE_BINARY  the gateway (else $CHATGATE_BINARY, else ../../build/chatgate)
//   --out DIR        where screenshots go (else $CHATGATE_BROWSER_OUT, else the current directory)
//   --docs FILE      also copy the laptop screenshot there (e.g. docs/demo.png)
//   $CHATGATE_CHROMIUM  the browser (default /usr/bin/chromium)
//   $CHATGATE_TEST_LOG_LEVEL  the gateway's --log-level (default info; its log tail is
//                       printed on failure)
// Exit status 0 on pass, 1 on failure (with the failing step, the page's console and the
// gateway's log tail), 77 when chromium is missing (ctest reports it as skipped).
"use strict";

const fs = require("fs");
const os = require("os");
const path = require("path");
const { REPO, stamp, say, fail, check, sleep, until, parseArgs, preflight, steps, run, launchChromium,
  startOnFreePort, GatewayProcess } = require("./common");

const DEADLINE_MS = 55000; // the whole test, browser start to cleanup

// ---- the gateway --------------------------------------------------------------------

// The gateway serving the demo page (web/).
class Gateway extends GatewayProcess {
  constructor(binary, port) {
    super(binary, port, {
      args: ["--web", path.join(REPO, "web")],
      // fixed, so a resume token survives the restart in step 4
      env: { CHATGATE_RESUME_SECRET: "browser-test-resume-secret-0123456789" },
      keepLines: 400,
    });
  }
}

// ---- the test -----------------------------------------------------------------------

const TURN_1 = "Find me flights from Nairobi to London next week";
const TURN_2 = "What about returning on Feb 20?";
const TURN_STOP = "Tell me more about the cheapest one";

async function main() {
  const opts = parseArgs(process.argv.slice(2), "node demo.test.js [CHATGATE_BINARY] [--out DIR] [--docs FILE]",
    { docs: process.env.CHATGATE_DEMO_PNG || null });
  const playwright = preflight(opts);

  fs.mkdirSync(opts.out, { recursive: true });
  const profile = fs.mkdtempSync(path.join(os.tmpdir(), "chatgate-chromium-"));
  let gateway = null;
  let context = null;
  let page = null;
  const consoleLines = [];   // everything the page logged
  const problems = [];       // console errors, page errors, requests elsewhere
  const frames = [];         // the last WebSocket frames each way
  const { step, failed } = steps(DEADLINE_MS, () => { if (gateway) gateway.stop(); });

  try {
    await step("start the gateway", async () => {
      await startOnFreePort((port) => (gateway = new Gateway(opts.gateway, port)));
      say(`      gateway ${opts.gateway} on ${gateway.base}`);
    });

    await step("start chromium", async () => {
      context = await launchChromium(playwright, opts.chromium, profile, {
        viewport: { width: 1280, height: 800 },
        deviceScaleFactor: 1,
        colorScheme: "light",
        locale: "en-GB",
        timezoneId: "UTC",
      });
      page = context.pages()[0] || (await context.newPage());
      page.on("console", (m) => {
        consoleLines.push(`[${m.type()}] ${m.text()}`);
        if (m.type() === "error") problems.push("console error: " + m.text());
      });
      page.on("pageerror", (e) => problems.push("page error: " + e.message));
      // the WebSocket traffic, for the failure report
      page.on("websocket", (sock) => {
        const note = (dir, data) => {
          frames.push(`${stamp()} ${dir} ${String(data).slice(0, 160)}`);
          if (frames.length > 60) frames.shift();
        };
        note("open", sock.url());
        if (!sock.url().startsWith("ws://127.0.0.1:" + gateway.port + "/")) problems.push("WebSocket outside the gateway: " + sock.url());
        sock.on("framesent", (f) => note(">", f.payload));
        sock.on("framereceived", (f) => note("<", f.payload));
        sock.on("close", () => note("closed", ""));
      });
      page.on("request", (r) => {
        const u = r.url();
        if (!u.startsWith(gateway.base + "/") && !u.startsWith("ws://127.0.0.1:" + gateway.port + "/") &&
            !u.startsWith("data:") && u !== "about:blank") problems.push("request outside the gateway: " + u);
      });
      say("      " + (await page.evaluate(() => navigator.userAgent.match(/Chrom[a-z]*\/[\d.]+/)?.[0] || navigator.userAgent)) +
        ", playwright-core " + require("playwright-core/package.json").version);
    });

    await step("open the page; it connects", async () => {
      await page.goto(gateway.base + "/", { waitUntil: "load" });
      await page.waitForSelector('#status[data-state="open"]');
      await page.selectOption("#room", "trip");
      await page.waitForSelector('#context[data-room="trip"]');
    });

    // page.waitForFunction compiles its predicate with eval, which the page's CSP
    // (script-src 'self') refuses; page.evaluate is not subject to it, so poll with that.
    const waitUntil = (fn, arg, timeoutMs, message) => until(() => page.evaluate(fn, arg), timeoutMs, message);

    const lastTurn = () => page.locator("#log .transcript:not([hidden]) .turn").last();

    // Type a message, send it, wait for its reply to finish; returns the turn locator.
    async function playTurn(text) {
      await page.fill("#text", text);
      await page.click("#send");
      const turn = lastTurn();
      await turn.locator(".msg-user").filter({ hasText: text }).waitFor();
      await turn.locator('.msg-assistant[data-state="done"]').waitFor({ timeout: 15000 });
      return turn;
    }

    async function paramValue(key) {
      const v = page.locator(`#ctx-params [data-param="${key}"] .param-value`);
      return (await v.count()) ? (await v.textContent()).trim() : null;
    }

    // The panel follows the gateway's context frame, sent after the reply: poll for it.
    async function expectParams(want, what) {
      const until = Date.now() + 5000;
      let got;
      for (;;) {
        got = {};
        for (const k of Object.keys(want)) got[k] = await paramValue(k);
        if (Object.keys(want).every((k) => got[k] === want[k])) return;
        if (Date.now() > until) fail(`${what}: the context panel shows ${JSON.stringify(got)}, expected ${JSON.stringify(want)}`);
        await sleep(100);
      }
    }

    await step("turn 1: " + TURN_1, async () => {
      const turn = await playTurn(TURN_1);
      const rules = await turn.locator(".ack .rule").allTextContents();
      check(rules.includes("flight_route"), `turn 1: the rules under the message are ${JSON.stringify(rules)}, expected flight_route`);
      check((await turn.locator(".ack .ack-route").textContent()) === "demo", "turn 1: route is not shown as demo");
      const reply = await turn.locator(".msg-assistant .msg-text").textContent();
      check(reply.includes("Nairobi") && reply.includes("2026-02-10"), "turn 1: the reply does not echo the params: " + reply);
      await expectParams({ "travel.from": "Nairobi", "travel.to": "London", "travel.departure_date": "2026-02-10" }, "after turn 1");
    });

    await step("turn 2: " + TURN_2, async () => {
      const turn = await playTurn(TURN_2);
      const rules = await turn.locator(".ack .rule").allTextContents();
      check(rules.includes("return_date"), `turn 2: the rules under the message are ${JSON.stringify(rules)}, expected return_date`);
    });

    await step("the panel shows from Nairobi, to London, 2026-02-10 and 2026-02-20", async () => {
      await expectParams({
        "travel.from": "Nairobi",
        "travel.to": "London",
        "travel.departure_date": "2026-02-10",
        "travel.return_date": "2026-02-20",
      }, "after turn 2");
      check((await page.textContent("#ctx-service")).trim() === "travel", "the active service is not shown as travel");
      await waitUntil(() => document.querySelectorAll("#ctx-history li[data-role]").length === 4, null, 5000,
        "the history in the panel does not have the 4 messages of the two turns");
      check((await page.locator('#ctx-params button[data-forget="travel.from"]').count()) === 1, "no forget button for travel.from");
    });

    await step("send a third message and Stop it midway", async () => {
      await page.fill("#text", TURN_STOP);
      await page.click("#send");
      const turn = lastTurn();
      await turn.locator(".msg-user").filter({ hasText: TURN_STOP }).waitFor();
      const reply = turn.locator(".msg-assistant");
      // let a few words stream in (the demo upstream sends one every 30 ms), then Stop
      await waitUntil((el) => el.dataset.state === "streaming" && el.querySelector(".msg-text").textContent.length >= 20,
        await reply.elementHandle(), 5000, "the third reply did not start streaming");
      check(!(await page.isDisabled("#stop")), "the Stop button is disabled while a reply streams");
      await page.click("#stop");
      await turn.locator('.msg-assistant[data-state="stopped"]').waitFor({ timeout: 5000 })
        .catch(async () => fail(`the reply was not marked stopped (state ${await reply.getAttribute("data-state")})`));
      const textAtStop = await reply.locator(".msg-text").textContent();
      await sleep(800); // ~26 words' worth of the demo's 30 ms pace
      const textLater = await reply.locator(".msg-text").textContent();
      check(textLater === textAtStop, `the stopped reply kept growing: ${textAtStop.length} -> ${textLater.length} characters`);
      check(!textAtStop.includes("You said:"), "the reply finished before Stop took effect: " + textAtStop);
      check((await reply.locator(".msg-status").textContent()).includes("stopped"), "the stopped reply is not labelled stopped");
      check(await page.isDisabled("#stop"), "the Stop button is still enabled after the reply stopped");
      say(`      stopped after ${textAtStop.length} characters: “${textAtStop.slice(0, 50)}…”`);
      // the gateway recorded the turn as cancelled, and the params are untouched
      await waitUntil(() => {
        const items = document.querySelectorAll("#ctx-history li[data-role]");
        return items.length === 6 && items[5].textContent.includes("(stopped)");
      }, null, 5000, "the panel's history does not end with the stopped reply");
      await expectParams({ "travel.from": "Nairobi", "travel.to": "London",
        "travel.departure_date": "2026-02-10", "travel.return_date": "2026-02-20" }, "after the stopped turn");
    });

    await step("screenshots (laptop 1280x800, phone 390x844)", async () => {
      await page.locator("#text").blur();
      const laptop = path.join(opts.out, "demo.png");
      await page.screenshot({ path: laptop });
      await page.setViewportSize({ width: 390, height: 844 });
      check(!(await page.isVisible("#context")), "phone: the context panel should be behind the Context button");
      check(await page.isVisible("#ctx-toggle"), "phone: no Context button");
      await page.screenshot({ path: path.join(opts.out, "demo-phone.png") });
      await page.click("#ctx-toggle");
      check(await page.isVisible("#context"), "phone: the Context button does not show the panel");
      check((await paramValue("travel.return_date")) === "2026-02-20", "phone: the panel lacks return_date");
      await page.screenshot({ path: path.join(opts.out, "demo-phone-context.png") });
      await page.click("#ctx-toggle");
      await page.setViewportSize({ width: 1280, height: 800 });
      check(await page.isVisible("#context"), "laptop: the context panel is not beside the chat");
      if (opts.docs) {
        fs.mkdirSync(path.dirname(opts.docs), { recursive: true });
        fs.copyFileSync(laptop, opts.docs);
      }
      say(`      ${laptop}, demo-phone.png, demo-phone-context.png` + (opts.docs ? `; copied to ${opts.docs}` : ""));
    });

    await step("forget a param; switch rooms and back", async () => {
      await page.click('#ctx-params button[data-forget="travel.return_date"]');
      await waitUntil(() => !document.querySelector('#ctx-params [data-param="travel.return_date"]'), null, 5000,
        "the forget button did not remove travel.return_date from the panel");
      await expectParams({ "travel.from": "Nairobi", "travel.departure_date": "2026-02-10" }, "after forgetting return_date");
      await page.selectOption("#room", "weather");
      await page.waitForSelector('#context[data-room="weather"][data-state="ok"]');
      check((await page.locator("#ctx-params [data-param]").count()) === 0, "room weather shows params of another room");
      check((await page.textContent("#ctx-service")).trim() === "none", "room weather has an active service");
      check((await page.locator('#log .transcript[data-room="weather"] .turn').count()) === 0, "room weather shows turns");
      check(!(await page.isVisible('#log .transcript[data-room="trip"]')), "room trip's transcript is still shown in room weather");
      await page.selectOption("#room", "trip");
      await expectParams({ "travel.from": "Nairobi", "travel.to": "London" }, "back in room trip");
      check(await page.isVisible('#log .transcript[data-room="trip"] .turn >> nth=2'), "room trip's transcript is not shown again");
    });

    await step("the profile: said in one room, shown with a forget button; the param it gives is marked", async () => {
      await page.selectOption("#room", "weather");
      await page.waitForSelector('#context[data-room="weather"][data-state="ok"]');
      await playTurn("I live in Nairobi");
      await waitUntil(() => {
        const v = document.querySelector('#ctx-profile [data-profile="home_city"] .param-value');
        return !!v && v.textContent === "Nairobi";
      }, null, 5000, "the profile panel should show home_city Nairobi");
      await playTurn("Find flights to London");
      await waitUntil(() => {
        const v = document.querySelector('#ctx-params [data-param="travel.from"][data-from="profile"] .param-value');
        return !!v && v.textContent === "Nairobi";
      }, null, 5000, "travel.from should show Nairobi, marked as from the profile");
      await page.click('#ctx-profile button[data-profile-forget="home_city"]');
      await waitUntil(() => !document.querySelector('#ctx-profile [data-profile="home_city"]'), null, 5000,
        "the profile's forget button did not remove home_city");
      await page.selectOption("#room", "trip");
      await expectParams({ "travel.from": "Nairobi", "travel.to": "London" }, "back in room trip");
    });

    await step("reload: resume keeps the user and the room's dialog", async () => {
      const user = await page.getAttribute("#status", "data-user");
      await page.reload({ waitUntil: "load" });
      await page.waitForSelector('#status[data-state="open"]');
      check((await page.getAttribute("#status", "data-user")) === user, "after a reload the page is another user: resume failed");
      check((await page.inputValue("#room")) === "trip", "after a reload the room is not trip");
      await expectParams({ "travel.from": "Nairobi", "travel.departure_date": "2026-02-10" }, "after a reload");
      check((await page.locator("#log .msg-restored").count()) === 6, "after a reload the room's history is not shown in the chat");
    });

    await step("gateway restart: the page reconnects by itself as the same user", async () => {
      const user = await page.getAttribute("#status", "data-user");
      const r = await gateway.stop();
      if (!r || r.code !== 0) say(`      note: the gateway's exit on SIGTERM was ${JSON.stringify(r)}`);
      await page.waitForSelector('#status[data-state="closed"]', { timeout: 5000 });
      await gateway.start();
      await page.waitForSelector('#status[data-state="open"]', { timeout: 15000 });
      check((await page.getAttribute("#status", "data-user")) === user, "after reconnecting the page is another user: resume failed");
      // the memory store went with the old process: the panel must now say so
      await waitUntil(() => document.querySelectorAll("#ctx-params [data-param]").length === 0, null, 5000,
        "after the restart the panel still shows params the new gateway does not have");
      await playTurn(TURN_1);
      await expectParams({ "travel.from": "Nairobi", "travel.to": "London" }, "after reconnecting");
    });

    await step("a rule on replies: the card number the demo echoes is masked, and the page says which rule acted", async () => {
      const text = "Pay with my card 4111 1111 1111 1111 please";
      const turn = await playTurn(text);
      const reply = await turn.locator(".msg-assistant .msg-text").textContent();
      check(reply.includes("[card number]") && !reply.includes("4111"), "the reply shows the card number: " + reply);
      const chips = await turn.locator('.reply-rule[data-rule="reply_card_number"][data-action="mask"]').allTextContents();
      check(chips.length === 1 && chips[0].includes("mask"), `under the reply the page shows ${JSON.stringify(chips)}`);
    });

    await step("no request outside the gateway, no console error", async () => {
      // Dropped connections during the restart log WebSocket errors: those are expected.
      const real = problems.filter((p) => !/WebSocket connection to .* failed/.test(p));
      check(real.length === 0, "the page had problems:\n  " + real.join("\n  "));
    });

    say("PASS");
    return 0;
  } catch (e) {
    failed(e);
    if (page) {
      const shot = path.join(opts.out, "demo-failure.png");
      await page.screenshot({ path: shot }).then(() => console.error("screenshot of the failure: " + shot), () => {});
    }
    if (consoleLines.length) console.error("--- page console (last 30)\n" + consoleLines.slice(-30).join("\n"));
    if (frames.length) console.error("--- WebSocket frames (last 60)\n" + frames.join("\n"));
    if (gateway) console.error("--- gateway log (last 40)\n" + gateway.tail(40));
    return 1;
  } finally {
    if (context) await context.close().catch(() => {});
    if (gateway) await gateway.stop();
    fs.rmSync(profile, { recursive: true, force: true });
  }
}

run(main);
