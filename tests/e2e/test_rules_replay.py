"""End-to-end test of `chatgate rules replay --old DIR --new DIR TRANSCRIPT...` (issue 15,
item 2: replay before deploy). The binary is run as a CI job would run it; a gateway is
started only to record a dialog through the admin API.

The transcripts are tests/e2e/transcripts/*.jsonl: the acceptance conversations of
docs/scenarios.md (the flight search with "What about returning on Feb 20?", forget, the
short follow-ups and params expiry; the payment with its confirmations, "nope" while one
waits; the selection "in Shibuya", "the second one", "nevermind", "#3" and a metadata note;
the weather follow-ups; the cancel phrases and the phrases that are no cancel), several
dialogs a file, some interleaved, with assistant lines carrying the apps' state directives.

- the shipped rules against themselves: exit 0, no turn reported, and the summary counts
  the transcripts, dialogs and turns (counted here from the files);
- one rule changed in a copy of rules/: exit 1, and the turns reported are exactly the
  (file:line)s that change touches, with exactly the fields that differ, including the later
  turns of a dialog whose state the change made differ (and not the turns after the states
  meet again):
    "nope" dropped from the cancel rule: the two "nope"s, and the "yes" after the one that
    left a confirmation waiting under the new rules;
    `type return_date date` dropped: the turn that sets return_date and every later turn of
    its dialog until "forget the dates";
    a route rule added ("add ..." to the app): the four "add shake shack" turns, route only;
- malformed input: exit 2 with file:line (or file: history[i]) and nothing on stdout, even
  when good transcripts come first; usage mistakes; a rule set that does not load;
- the admin export: a gateway (demo upstream, shipped rules, CHATGATE_NOW) plays the flight
  dialog; GET /admin/dialogs/{user}/{room} saved to a file replays like the same dialog's
  JSON lines (same turns, same differences, same summary), and what replay says the
  shipped rules decide on each turn is what the live gateway acknowledged.

Every run of the binary must leave no sanitizer report on stderr (ASan builds).
"""

import asyncio
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import harness
from harness import Client, brief, check, fail, independent, step

NOW = "2026-02-03T10:00:00Z"
SHIPPED = harness.REPO_ROOT / "rules"
TRANSCRIPTS = Path("tests/e2e/transcripts")  # relative to the repository: as CI logs show them
TOKEN = "replay-admin-token-5678"
USER = "replay-user"

_binary = [None]  # the chatgate binary under test (--gateway)


def transcript_files():
    return sorted(str(p.relative_to(harness.REPO_ROOT)) for p in (harness.REPO_ROOT / TRANSCRIPTS).glob("*.jsonl"))


def read_lines(name):
    """[(line number, object)] of a JSON lines transcript, blank lines skipped."""
    out = []
    for number, text in enumerate((harness.REPO_ROOT / name).read_text().splitlines(), 1):
        if text.strip():
            out.append((number, json.loads(text)))
    return out


def at(name, dialog, text):
    """"FILE:LINE" of the one user line of `dialog` in transcript `name` that says `text`."""
    found = [n for n, o in read_lines(TRANSCRIPTS / name)
             if o["dialog"] == dialog and o["text"] == text and o.get("role", "user") == "user"]
    check(len(found) == 1, f"{name}: dialog {dialog} should say {text!r} exactly once, found lines {found}")
    return f"{TRANSCRIPTS / name}:{found[0]}"


def rules_copy(change=None, extra=None):
    """A copy of the shipped rules/ with one change: change = (file, old text, new text)."""
    path = harness.temp_dir("chatgate-replay-rules-")
    for f in SHIPPED.glob("*.rules"):
        shutil.copy(f, path / f.name)
    if change:
        name, old, new = change
        text = (path / name).read_text()
        check(text.count(old) == 1, f"{name} should hold {old!r} once (the shipped rules changed?)")
        (path / name).write_text(text.replace(old, new))
    for name, text in (extra or {}).items():
        (path / name).write_text(text)
    return path


def run_replay(*args, env=None):
    """`chatgate rules replay ARGS` from the repository root: (exit status, stdout, stderr).
    The caller's CHATGATE_* are not passed on, so the clock is the fixed default."""
    run_env = {k: v for k, v in os.environ.items() if not k.startswith("CHATGATE_")}
    run_env.update(env or {})
    cmd = [str(_binary[0]), "rules", "replay", *[str(a) for a in args]]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30, cwd=harness.REPO_ROOT, env=run_env,
                          stdin=subprocess.DEVNULL)
    if re.search(r"ERROR: (Address|Leak|Memory)Sanitizer|runtime error:", proc.stderr):
        fail(f"a sanitizer report from {' '.join(cmd)}:\n{proc.stderr[-3000:]}")
    return proc.returncode, proc.stdout, proc.stderr


async def replay(*args, env=None):
    return await asyncio.to_thread(run_replay, *args, env=env)


HEADER = re.compile(r'^(?P<where>\S+:\d+|\S+ history\[\d+\]) dialog (?P<dialog>\S+) turn (?P<turn>\d+) '
                    r'(?P<text>".*")$')
FIELD = re.compile(r"^  (?P<field>\w+):\s+old (?P<values>.*)$")
SUMMARY = re.compile(r"^replay: (\d+) transcripts?, (\d+) dialogs?, (\d+) turns?, (\d+) differing$")


def parse_output(out):
    """The differing turns as {where: (dialog, turn, text, [field lines])}, and the summary
    (transcripts, dialogs, turns, differing). A field line reads "rules: old [...] new [...]"."""
    lines = out.splitlines()
    check(lines and SUMMARY.match(lines[-1]), f"the output should end with the summary line:\n{out}")
    blocks, current = {}, None
    for line in lines[:-1]:
        header, field = HEADER.match(line), FIELD.match(line)
        if header:
            check(header["where"] not in blocks, f"{header['where']} reported twice:\n{out}")
            current = blocks[header["where"]] = (header["dialog"], int(header["turn"]), json.loads(header["text"]), [])
        elif field and current:
            current[3].append(f"{field['field']}: old {field['values']}")
        else:
            fail(f"an output line that is neither a turn nor a field of one: {line!r}\n{out}")
    return blocks, tuple(int(n) for n in SUMMARY.match(lines[-1]).groups())


def expected_totals(files):
    """(transcripts, dialogs, turns) counted from the files themselves."""
    dialogs, turns = set(), 0
    for name in files:
        for _, o in read_lines(name):
            dialogs.add((name, o["dialog"]))
            turns += o.get("role", "user") == "user"
    return len(files), len(dialogs), turns


def check_blocks(blocks, expected, what):
    """The reported turns are exactly `expected` {where: (dialog, turn, text, [fields])}."""
    check(set(blocks) == set(expected), f"{what}: the turns reported should be exactly\n  {sorted(expected)}\n"
                                        f"got\n  {sorted(blocks)}")
    for where, want in expected.items():
        check(blocks[where] == want, f"{what}: {where} should be reported as\n  {want}\ngot\n  {blocks[where]}")


# --------------------------------------------------------------------------------------


async def part_same_rules():
    files = transcript_files()
    with step(f"the shipped rules against themselves on {len(files)} transcripts: exit 0, nothing differs"):
        check(len(files) >= 4, f"tests/e2e/transcripts should hold the scenarios' transcripts: {files}")
        n_transcripts, n_dialogs, n_turns = expected_totals(files)
        check(n_turns >= 20 and n_dialogs >= 5, f"the transcripts should hold 20 turns or more: {n_turns}")
        rc, out, err = await replay("--old", SHIPPED, "--new", SHIPPED, *files)
        check(rc == 0, f"exit {rc}, expected 0\nstdout: {out}\nstderr: {err}")
        blocks, totals = parse_output(out)
        check(not blocks, f"no turn should differ: {sorted(blocks)}")
        check(totals == (n_transcripts, n_dialogs, n_turns, 0), f"summary {totals}, expected "
              f"{(n_transcripts, n_dialogs, n_turns, 0)}: {out}")
        check(err == "", f"nothing should be said on stderr: {err}")
    with step("flags after the transcripts, and '--' before a transcript: the same"):
        rc, out2, _ = await replay(*files[:1], "--new", SHIPPED, "--old", SHIPPED, "--", *files[1:])
        check(rc == 0 and out2 == out, f"exit {rc}: {out2}")


NOT_CANCEL = ["rules: old [cancel] new []", 'resolution: old {"type":"cancel"} new null']


async def part_cancel_phrase_dropped():
    cancel = '|nah|nope|'
    rules = rules_copy(("10-cancel.rules", cancel, "|nah|"))
    with step("'nope' dropped from the cancel rule: the two 'nope's and the 'yes' that now confirms"):
        rc, out, err = await replay("--old", SHIPPED, "--new", rules, *transcript_files())
        check(rc == 1, f"exit {rc}, expected 1\nstdout: {out}\nstderr: {err}")
        blocks, totals = parse_output(out)
        expected = {
            # a cancel no more, where nothing waited: the states stay alike after it
            at("cancel.jsonl", "cancels", "nope"): ("cancels", 8, "nope", NOT_CANCEL),
            # while the payment's confirmation waits: under the new rules it stays waiting ...
            at("payment.jsonl", "wallet-nope", "nope"): ("wallet-nope", 2, "nope", NOT_CANCEL),
            # ... so the next "yes" confirms it and goes to the app that asked (a later turn
            # differing because the dialog's state does); the turn after that does not differ
            at("payment.jsonl", "wallet-nope", "yes"): ("wallet-nope", 3, "yes", [
                "rules: old [] new [confirm_yes]",
                'resolution: old null new {"confirmed":true,"type":"confirmation"}',
                "route: old default new app"]),
        }
        check_blocks(blocks, expected, "nope dropped")
        check(totals[3] == 3, f"the summary should count 3 differing turns: {totals}")


def travel(**params):
    return json.dumps({"travel": params}, sort_keys=True, separators=(",", ":"))


async def part_params_rule_changed():
    rules = rules_copy(("50-travel.rules", "  type    return_date date\n", ""))
    with step("return_date no longer normalised: its turn, and every later turn of the dialog that keeps it"):
        rc, out, err = await replay("--old", SHIPPED, "--new", rules, *transcript_files())
        check(rc == 1, f"exit {rc}, expected 1\nstdout: {out}\nstderr: {err}")
        blocks, _ = parse_output(out)
        kept = dict(departure_date="2026-02-10", to="London")
        business = dict(kept, cabin_class="business")
        turns = [  # (text, turn, the params after it but return_date)
            ("What about returning on Feb 20?", 2, dict(kept, **{"from": "Nairobi"})),
            ("Show me business class options", 3, dict(business, **{"from": "Nairobi"})),
            ("Flights from Mombasa (not Nairobi) to London", 4, dict(business, **{"from": "Mombasa"})),
            ("for two adults", 5, dict(business, passenger_count=2, **{"from": "Mombasa"})),
            ("forget my origin", 6, dict(business, passenger_count=2)),
            # "forget the dates" drops return_date on both sides: from there the states are alike
        ]
        expected = {
            at("flights.jsonl", "trip", text): ("trip", turn, text, [
                f"params: old {travel(**params, return_date='2026-02-20')} "
                f"new {travel(**params, return_date='Feb 20')}"])
            for text, turn, params in turns
        }
        # seven hours later: the dialog expired (lifetimes), so only return_date is kept
        expected[at("flights.jsonl", "trip-expiry", "Return date Feb 20")] = ("trip-expiry", 3, "Return date Feb 20", [
            f"params: old {travel(return_date='2026-02-20')} new {travel(return_date='Feb 20')}"])
        check_blocks(blocks, expected, "return_date untyped")


ROUTE_RULE = """# replay test: "add ..." goes to the trip planner app
rule to_app
  match   ^\\s*add\\s
  do      route app
"""


async def part_route_rule_added():
    rules = rules_copy(extra={"75-route.rules": ROUTE_RULE})
    with step("a route rule added: the four 'add shake shack' turns, by the route's name"):
        rc, out, err = await replay("--old", SHIPPED, "--new", rules, *transcript_files())
        check(rc == 1, f"exit {rc}, expected 1\nstdout: {out}\nstderr: {err}")
        blocks, _ = parse_output(out)
        fields = ["rules: old [] new [to_app]", "route: old default new app"]
        expected = {at("selection.jsonl", d, "add shake shack"): (d, 1, "add shake shack", fields)
                    for d in ("venues", "venues-2", "venues-3", "venues-4")}
        check_blocks(blocks, expected, "route rule added")


BAD_LINES = [  # (the bad line, what the message says)
    ('{"dialog": "d1", "text": "Find me flights from Nairobi to London next week"', "not JSON"),
    ('{"dialog": "d1"}', '"text" must be a string'),
    ('{"dialog": "d1", "txt": "hello"}', 'unknown key "txt"'),
    ('{"dialog": "d1", "text": "hello", "ts": "yesterday"}', '"ts" must be unix seconds or an ISO 8601 time'),
    ('{"dialog": "d1", "text": "hello", "ts": "2026-02-30T10:00:00Z"}', '"ts" must be'),
    ('{"text": "hello"}', '"dialog" must be a string'),
    ('{"dialog": "d1", "role": "system", "text": "hello"}', '"role" must be'),
    ('{"dialog": "d1", "text": "yes", "state": {"awaiting": null}}',
     '"state" and "upstream" belong to assistant lines'),
    ('["dialog", "d1"]', "a line must be a JSON object"),
]


async def part_malformed():
    directory = harness.temp_dir("chatgate-replay-bad-")
    good = transcript_files()[0]
    with step("a malformed line: exit 2, file:line, nothing replayed (a good transcript first)"):
        for i, (bad, says) in enumerate(BAD_LINES):
            path = directory / f"bad{i}.jsonl"
            # line 1 good, line 2 blank, line 3 good, line 4 the bad one
            path.write_text('{"dialog": "d1", "text": "What\'s the weather in Tokyo?"}\n\n'
                            '{"dialog": "d1", "text": "And tomorrow?"}\n' + bad + "\n")
            rc, out, err = await replay("--old", SHIPPED, "--new", SHIPPED, good, path)
            check(rc == 2, f"{bad}: exit {rc}, expected 2\nstdout: {out}\nstderr: {err}")
            check(err.startswith(f"{path}:4: ") and says in err, f"{bad}: stderr should name {path}:4 and say "
                                                                  f"{says!r}: {err!r}")
            check(out == "", f"{bad}: nothing should be replayed or printed: {out!r}")
    with step("a file that cannot be read, a bad admin export: exit 2 naming it"):
        missing = directory / "missing.jsonl"
        rc, out, err = await replay("--old", SHIPPED, "--new", SHIPPED, missing)
        check(rc == 2 and err.startswith(f"{missing}: ") and out == "", f"exit {rc}: {err!r} {out!r}")
        export = directory / "export.json"
        export.write_text(json.dumps({"user": "u", "room": "r", "found": True, "state": {"history": [
            {"role": "user", "content": "hello", "ts": 1770112800},
            {"role": "system", "content": "hello", "ts": 1770112800}]}}, indent=2))
        rc, out, err = await replay("--old", SHIPPED, "--new", SHIPPED, export)
        check(rc == 2 and err.startswith(f"{export}: history[1]: ") and out == "", f"exit {rc}: {err!r} {out!r}")
    with step("usage mistakes and a rule set that does not load: exit 2"):
        for args in (["--old", SHIPPED, good], ["--new", SHIPPED, good], ["--old", SHIPPED, "--new", SHIPPED],
                     ["--old", SHIPPED, "--old", SHIPPED, "--new", SHIPPED, good],
                     ["--old", SHIPPED, "--new", SHIPPED, "--verbose", good], ["--old"]):
            rc, out, err = await replay(*args)
            check(rc == 2 and "usage:" in err and "rules replay --old DIR --new DIR" in err,
                  f"{args}: exit {rc}, expected 2 and the usage: {err!r}")
        broken = rules_copy(extra={"99-broken.rules": "rule broken\n  match   (unclosed\n  do      cancel\n"})
        rc, out, err = await replay("--old", SHIPPED, "--new", broken, good)
        check(rc == 2 and err.startswith("--new ") and "99-broken.rules:2" in err and out == "",
              f"a broken --new set: exit {rc}: {err!r}")


async def part_admin_export():
    """A dialog recorded by a live gateway, exported, replayed like its JSON lines."""
    trip = [(n, o) for n, o in read_lines(TRANSCRIPTS / "flights.jsonl") if o["dialog"] == "trip"]
    texts = [o["text"] for _, o in trip if o.get("role", "user") == "user"]
    directory = harness.temp_dir("chatgate-replay-export-")
    env = {"CHATGATE_NOW": NOW, "CHATGATE_ADMIN_TOKEN": TOKEN}
    args = ["--rules", SHIPPED, "--auth", "header", "--user-header", "X-User-Id"]
    config = harness.make_config({"demo": harness.demo_upstream(0)}, "demo", store="memory",
                                 history_n=50,
                                 rate_limit={"messages_per_second": 100_000, "burst": 100_000})
    acks = []
    async with harness.Gateway(args, config, env=env, name="gateway-replay") as gw:
        with step(f"a live gateway plays the flight dialog ({len(texts)} turns) and exports it"):
            client = await Client.connect(gw, expect_user=USER, extra_headers={"X-User-Id": USER})
            for i, text in enumerate(texts, 1):
                t = await client.message(text, mid=f"r{i}", room="trip")
                t.expect_done()
                acks.append(t.ack)
            await client.close()
            status, _, body = await asyncio.to_thread(
                harness.http_request, f"{gw.http_url}/admin/dialogs/{USER}/trip", "GET",
                {"Authorization": f"Bearer {TOKEN}"})
            check(status == 200, f"GET /admin/dialogs/{USER}/trip: {status} {body[:300]!r}")
            exported = json.loads(body)
            history = exported["state"]["history"]
            check([m["content"] for m in history if m["role"] == "user"] == texts,
                  f"the export should hold every user message: {brief(history, 800)}")
    export = directory / "trip-export.json"
    export.write_text(json.dumps(exported, indent=2, ensure_ascii=False))
    lines = directory / "trip.jsonl"
    lines.write_text("".join(json.dumps(o, ensure_ascii=False) + "\n" for _, o in trip))

    def comparable(blocks):
        """What a replay says of each turn, without where it is and the dialog's name."""
        return sorted((turn, text, fields) for _, turn, text, fields in blocks.values())

    untyped = rules_copy(("50-travel.rules", "  type    return_date date\n", ""))
    with step("the export and the JSON lines replay alike: same rules, then one rule changed"):
        for new, want_rc in ((SHIPPED, 0), (untyped, 1)):
            rc_x, out_x, err_x = await replay("--old", SHIPPED, "--new", new, export)
            rc_l, out_l, err_l = await replay("--old", SHIPPED, "--new", new, lines)
            check(rc_x == rc_l == want_rc, f"exit {rc_x} (export) and {rc_l} (lines), expected {want_rc}\n"
                                           f"export: {out_x}{err_x}\nlines: {out_l}{err_l}")
            blocks_x, totals_x = parse_output(out_x)
            blocks_l, totals_l = parse_output(out_l)
            check(totals_x == totals_l == (1, 1, len(texts), 5 if want_rc else 0),
                  f"summaries: export {totals_x}, lines {totals_l}")
            check(comparable(blocks_x) == comparable(blocks_l),
                  f"the export's differences should be the lines':\nexport:\n{out_x}\nlines:\n{out_l}")
            for where, (dialog, turn, _, _) in blocks_x.items():
                check(dialog == f"{USER}/trip" and where == f"{export} history[{2 * (turn - 1)}]",
                      f"an export's turn is named by its history entry and USER/ROOM: {where} dialog {dialog}")
    with step("what replay says the shipped rules decide is what the live gateway acknowledged"):
        empty = harness.temp_dir("chatgate-replay-norules-")
        rc, out, err = await replay("--old", empty, "--new", SHIPPED, export)
        blocks, _ = parse_output(out)
        by_turn = {turn: fields for _, turn, _, fields in blocks.values()}
        # against no rules at all, every turn of this dialog differs (each fires a rule)
        check(rc == 1 and sorted(by_turn) == list(range(1, len(texts) + 1)),
              f"exit {rc}; every turn should be reported against an empty rule set:\n{out}{err}")
        for turn, ack in enumerate(acks, 1):
            fields = {f.split(":", 1)[0]: f.split(" new ", 1)[1] for f in by_turn.get(turn, [])}
            rules = fields.get("rules", "[]")[1:-1]
            check((rules.split(", ") if rules else []) == ack["rules"],
                  f"turn {turn}: replay's rules {rules!r}, the gateway's ack {ack['rules']}")
            params = json.loads(fields["params"]) if "params" in fields else {}
            check(params.get("travel", {}) == ack["params"],
                  f"turn {turn}: replay's params {params}, the gateway's ack {ack['params']}")
            enriched = json.loads(fields["enriched"]) if "enriched" in fields else None
            check(enriched == ack["enriched"], f"turn {turn}: replay's enriched {enriched!r}, the ack's "
                                               f"{ack['enriched']!r}")


async def main(args):
    _binary[0] = args.gateway
    for part in (part_same_rules(), part_cancel_phrase_dropped(), part_params_rule_changed(),
                 part_route_rule_added(), part_malformed(), part_admin_export()):
        await independent(part)


if __name__ == "__main__":
    harness.run(main, timeout=55)
