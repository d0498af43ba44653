"""The man page (docs/chatgate.1) and the bash completion (packaging/bash-completion/chatgate)
held to the binary (issue 16, item 4), so that neither drifts from what chatgate accepts:

- every flag of `chatgate --help` is an entry (.TP, then .B/.BI/.BR --flag) of the man page's
  OPTIONS, and every entry there is a flag of --help;
- every key of `chatgate --help-config` (KEY<TAB>TYPE<TAB>default<TAB>meaning a line) is an
  entry of CONFIGURATION, and the other way round; an integer key's range and default, and
  an enum key's values, are the ones the binary prints;
- every flag of --help is in the completion script's flag list and the other way round;
  completing in bash gives the values --help-config lists for --auth, --log-level and
  --log-format, directories for --rules/--web/--shadow-rules, files for --config, no flag
  after a flag that takes a value, and the `rules` subcommands;
- every flag that takes a value, but --upstream and --config, is a key of --help-config;
- every key --help-config lists is accepted by the loader: gateways start with files that
  set each of them (the test fails when a listed key has no value here); every integer key
  is taken at both ends of the range --help-config gives and refused one past either end;
  unknown keys, top-level and nested, and an unknown flag are refused with exit 2;
- the page renders without warnings (groff -man -ww, man --warnings); skipped, saying so,
  only when neither groff nor man is installed.

Adding a flag or a key to src/config/config.c without its man page entry (and, for a flag,
its completion) makes this test fail, naming it.
"""

import asyncio
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import harness
from harness import Gateway, brief, check, fail, free_port, independent, step

MAN = harness.REPO_ROOT / "docs" / "chatgate.1"
COMPLETION = harness.REPO_ROOT / "packaging" / "bash-completion" / "chatgate"
COMPLETION_NAME = "packaging/bash-completion/chatgate"
# flags that are no key of the file (config.c: apply_flag, cg_config_load)
NOT_KEYS = {"upstream", "config", "help", "help-config", "version"}
VALUELESS = {"help", "help-config", "version"}
ENUM_FLAGS = {"auth": "auth", "log-level": "log_level", "log-format": "log_format"}
DIR_FLAGS = ("rules", "shadow-rules", "web")

# an integer key's type in --help-config: "integer MIN..MAX", or "integer MIN..MAX | WORD" when
# a word is taken besides a number (workers: auto)
INTEGER = re.compile(r"integer (-?\d+)\.\.(-?\d+)(?: \| (\w+))?")

_binary = [None]


def run_binary(*args):
    """The binary run to its end: the CompletedProcess (callers check that stderr is empty: an
    ASan report would be there)."""
    return subprocess.run([str(_binary[0]), *args], capture_output=True, text=True, timeout=20,
                          stdin=subprocess.DEVNULL)


def help_flags():
    """The flags of `chatgate --help`, in order, without the dashes."""
    proc = run_binary("--help")
    check(proc.returncode == 0 and not proc.stderr, f"--help: exit {proc.returncode}, stderr {brief(proc.stderr)}")
    flags = re.findall(r"^  --([a-z][a-z0-9-]*)", proc.stdout, re.MULTILINE)
    check(len(flags) == len(set(flags)), f"--help lists a flag twice: {flags}")
    check("help-config" in flags, f"--help does not list --help-config: {brief(proc.stdout)}")
    return flags


def help_config():
    """{key: (type, default, meaning)} of `chatgate --help-config`, in order."""
    proc = run_binary("--help-config")
    check(proc.returncode == 0 and not proc.stderr,
          f"--help-config: exit {proc.returncode}, stderr {brief(proc.stderr)}")
    rows = {}
    for number, line in enumerate(proc.stdout.splitlines(), 1):
        fields = line.split("\t")
        check(len(fields) == 4 and all(f.strip() for f in fields),
              f"--help-config line {number} is not KEY<TAB>TYPE<TAB>default<TAB>meaning: {line!r}")
        check(fields[0] not in rows, f"--help-config lists {fields[0]} twice")
        rows[fields[0]] = tuple(fields[1:])
    check(len(rows) > 50, f"--help-config lists only {len(rows)} keys")
    return rows


# ---- the man page -------------------------------------------------------------------------

def man_sections():
    """{section name: [lines]} of docs/chatgate.1."""
    sections, name = {}, None
    for line in MAN.read_text().splitlines():
        if line.startswith(".SH "):
            name = line[4:].strip().strip('"')
            sections[name] = []
        elif name:
            sections[name].append(line)
    return sections


def unescape(text):
    """The text of a troff word: font changes dropped, \\- as -."""
    return re.sub(r"\\f[BIRP]", "", text).replace("\\-", "-").replace("\\e", "\\")


def tagged_entries(lines):
    """[(tag, the lines of its paragraph)] of the .TP entries of a section whose tag line
    is .B/.BI/.BR: the tag is its first word, unescaped."""
    entries = []
    for i, line in enumerate(lines[:-1]):
        if line.strip() != ".TP":
            continue
        match = re.match(r"\.B[IR]?\s+(\S+)", lines[i + 1])
        if not match:
            continue
        body = []
        for following in lines[i + 2:]:
            if following.startswith((".TP", ".SS", ".PP")):
                break
            body.append(following)
        entries.append((unescape(match.group(1)), body))
    return entries


def compare(what, have, want, have_name, want_name):
    missing = [k for k in want if k not in have]
    extra = [k for k in have if k not in want]
    check(not missing and not extra,
          f"{what}: in {want_name} but not in {have_name}: {missing}; in {have_name} but not in {want_name}: {extra}")


def check_options(flags, sections):
    check("OPTIONS" in sections, f"{MAN.name} has no OPTIONS section: {list(sections)}")
    entries = [tag for tag, _ in tagged_entries(sections["OPTIONS"])]
    check(all(t.startswith("--") for t in entries), f"OPTIONS entries that are no flag: {entries}")
    names = [t[2:] for t in entries]
    check(len(names) == len(set(names)), f"OPTIONS has an entry twice: {names}")
    compare("flags", names, flags, "the man page's OPTIONS", "chatgate --help")


def check_configuration(keys, sections):
    check("CONFIGURATION" in sections, f"{MAN.name} has no CONFIGURATION section: {list(sections)}")
    entries = tagged_entries(sections["CONFIGURATION"])
    names = [tag for tag, _ in entries]
    check(len(names) == len(set(names)), f"CONFIGURATION has an entry twice: {names}")
    compare("config keys", names, list(keys), "the man page's CONFIGURATION", "chatgate --help-config")
    # the ranges, defaults and values the page states are the binary's
    wrong = []
    for name, body in entries:
        kind, default, _ = keys[name]
        text = " ".join(body)
        integer = INTEGER.fullmatch(kind)
        if integer and f"from {integer[1]} to {integer[2]}" not in text:
            wrong.append(f"{name}: not 'from {integer[1]} to {integer[2]}'")
        if integer and default != "-" and f"default \\fB{default}\\fR" not in text:
            wrong.append(f"{name}: not 'default {default}'")
        if integer and integer[3] and f"\\fB{integer[3]}\\fR" not in text:
            wrong.append(f"{name}: the word {integer[3]} not given")
        if kind.startswith("enum "):
            for value in kind[5:].split("|"):
                if f"\\fB{value}\\fR" not in text:
                    wrong.append(f"{name}: value {value} not given")
    check(not wrong, f"CONFIGURATION entries that differ from --help-config: {wrong}")


def check_render():
    """No warning from groff -man -ww, nor from man --warnings (80 columns)."""
    groff, man = shutil.which("groff"), shutil.which("man")
    if not groff and not man:
        print("   skipped: neither groff nor man is installed, the page is not rendered", flush=True)
        return
    runs = []
    if groff:
        runs.append(([groff, "-man", "-ww", "-z", str(MAN)], None))
        runs.append(([groff, "-man", "-Tutf8", "-ww", "-z", str(MAN)], None))
    if man:
        runs.append(([man, "--warnings", "-l", str(MAN)], {**os.environ, "MANWIDTH": "80", "MANPAGER": "cat",
                                                          "PAGER": "cat"}))
    for cmd, env in runs:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30, env=env, stdin=subprocess.DEVNULL)
        check(proc.returncode == 0 and not proc.stderr.strip(),
              f"{' '.join(cmd)}: exit {proc.returncode}, warnings:\n{proc.stderr}")
        print(f"   {' '.join(Path(c).name if i == 0 else c for i, c in enumerate(cmd))}: no warnings", flush=True)


# ---- the completion -------------------------------------------------------------------------

def completion_flags():
    match = re.search(r'local flags="([^"]*)"', COMPLETION.read_text())
    check(match, f"{COMPLETION}: no `local flags=\"...\"` list")
    words = match.group(1).split()
    check(all(w.startswith("--") for w in words), f"{COMPLETION}: flag list holds non-flags: {words}")
    return [w[2:] for w in words]


def complete(*cases):
    """COMPREPLY of _chatgate for each case, a list of words after `chatgate` (the last is the
    one completed), in one bash without the user's rc files."""
    script = [f"source {json.dumps(str(COMPLETION))} || exit 3"]
    for words in cases:
        quoted = " ".join(json.dumps(w) for w in ["chatgate", *words])
        script.append(f"COMP_WORDS=({quoted}); COMP_CWORD={len(words)}; COMPREPLY=(); _chatgate; "
                      "printf '%s\\x1f' \"${COMPREPLY[@]}\"; printf '\\n'")
    proc = subprocess.run(["bash", "--norc", "--noprofile", "-c", "\n".join(script)], capture_output=True,
                          text=True, timeout=20, cwd=harness.REPO_ROOT, stdin=subprocess.DEVNULL)
    check(proc.returncode == 0 and not proc.stderr, f"bash completion: exit {proc.returncode}: {proc.stderr}")
    lines = proc.stdout.split("\n")[:len(cases)]
    return [sorted(w for w in line.split("\x1f") if w) for line in lines]


def check_completion_values(flags, keys):
    enums = {flag: sorted(keys[key][0][5:].split("|")) for flag, key in ENUM_FLAGS.items()}
    valued = [f for f in flags if f not in VALUELESS]
    cases = [[f"--{f}", ""] for f in ENUM_FLAGS]
    cases += [["--auth", "=", ""], ["--log-format", "j"]]
    cases += [[f"--{f}", "ru"] for f in DIR_FLAGS]
    cases += [["--config", "CMakeL"], ["--rules", "CMakeL"]]
    cases += [[f"--{f}", "--"] for f in valued]
    cases += [["rules", ""], ["rules", "check", "ru"], ["rules", "replay", "--"], ["rules", "replay", "--old", "ru"],
              ["rules", "explain", "rules", "text", "--"], ["--help-c"], [""]]
    got = complete(*cases)
    results = dict(zip((tuple(c) for c in cases), got))
    for flag, values in enums.items():
        check(results[(f"--{flag}", "")] == values,
              f"completing --{flag}: {results[(f'--{flag}', '')]}, --help-config says {values}")
    check(results[("--auth", "=", "")] == enums["auth"], f"completing --auth=: {results[('--auth', '=', '')]}")
    check(results[("--log-format", "j")] == ["json"], f"completing --log-format j: {results[('--log-format', 'j')]}")
    for flag in DIR_FLAGS:
        check(results[(f"--{flag}", "ru")] == ["rules"], f"completing --{flag} ru: {results[(f'--{flag}', 'ru')]}")
    check(results[("--config", "CMakeL")] == ["CMakeLists.txt"], f"--config takes files: {results[('--config', 'CMakeL')]}")
    check(results[("--rules", "CMakeL")] == [], f"--rules takes directories only: {results[('--rules', 'CMakeL')]}")
    offered = [f for f in valued if results[(f"--{f}", "--")]]
    check(not offered, f"flags offered where these flags' values go: {offered}")
    check(results[("rules", "")] == ["check", "explain", "replay"], f"`chatgate rules`: {results[('rules', '')]}")
    check(results[("rules", "check", "ru")] == ["rules"], f"`rules check ru`: {results[('rules', 'check', 'ru')]}")
    check({"--old", "--new"} <= set(results[("rules", "replay", "--")]),
          f"`rules replay --`: {results[('rules', 'replay', '--')]}")
    check(results[("rules", "replay", "--old", "ru")] == ["rules"],
          f"`rules replay --old ru`: {results[('rules', 'replay', '--old', 'ru')]}")
    check(results[("rules", "explain", "rules", "text", "--")] == ["--state"],
          f"`rules explain DIR text --`: {results[('rules', 'explain', 'rules', 'text', '--')]}")
    check(results[("--help-c",)] == ["--help-config"], f"--help-c: {results[('--help-c',)]}")
    check(sorted(results[("",)]) == sorted(["rules"] + [f"--{f}" for f in flags]),
          f"the first word: {results[('',)]}")


# ---- the loader ---------------------------------------------------------------------------

def set_path(obj, path, value):
    *parents, last = path.split(".")
    for p in parents:
        obj = obj.setdefault(p, {})
    obj[last] = value


def key_paths(obj, path="", out=None):
    """Every path of a config object, with the names chosen in the file as --help-config
    writes them (upstreams.NAME, services.NAME, limits.plans.NAME, limits.users.USER)."""
    out = set() if out is None else out
    if not isinstance(obj, dict):
        return out
    for key, value in obj.items():
        name = key
        if path in ("upstreams", "services", "limits.plans"):
            name = "NAME"
        elif path == "limits.users":
            name = "USER"
        full = f"{path}.{name}" if path else name
        out.add(full)
        key_paths(value, full, out)
    return out


def scalar_value(key, kind, default, samples):
    """A valid value of a key of a table row: a sample, or its default, or its minimum."""
    if key in samples:
        return samples[key]
    integer = INTEGER.fullmatch(kind)
    if integer:
        return int(default) if default != "-" else int(integer[1])
    if kind == "boolean":
        return default != "true"  # the other value than the default
    if kind.startswith("enum ") or (kind == "string" and default != "-"):
        return default
    fail(f"--help-config lists {key} ({kind}, no default), and tests/e2e/test_manpage.py has no valid value "
         "for it: add one to its samples")


def full_configs(keys):
    """Two files that set, between them, every key --help-config lists: (config, config)."""
    zones = "/usr/share/zoneinfo"
    samples = {
        "listen": "127.0.0.1:8080",  # the --listen flag of the harness wins
        "admin_listen": f"127.0.0.1:{free_port()}",
        "default_upstream": "d",
        "store": "memory",
        "rules": str(harness.REPO_ROOT / "rules"),
        "shadow_rules": str(harness.REPO_ROOT / "rules"),
        "web": str(harness.REPO_ROOT / "web"),
        "timezone": "Africa/Nairobi" if os.path.isfile(f"{zones}/Africa/Nairobi") else "UTC",
        "tls_ca_file": harness.tls_server(harness.temp_dir("chatgate-e2e-manpage-ca-"))[0],
        "allow_origin": ["https://chat.example", "https://app.example"],
        "redis.prefix": "cg-manpage",
        "redis.bus": "redis://127.0.0.1:6379",
        "redis.tls_ca_file": "/etc/ssl/certs/ca-certificates.crt",  # read only by a rediss store
        "redis.tls_cert_file": "/etc/chatgate/redis-client.pem",
        "redis.tls_key_file": "/etc/chatgate/redis-client.key",
        "redis.tls_server_name": "redis.example",
        "export.to": "file",  # the memory store has no stream
        "export.path": str(Path(harness.temp_dir("chatgate-e2e-manpage-export-")) / "turns.jsonl"),
        "upstreams.NAME.model": "test-model",
        "upstreams.NAME.api_key_env": "CG_MANPAGE_API_KEY",
        "upstreams.NAME.fallback": "d",
    }
    first = {}
    llm = {"urls": ["http://127.0.0.1:9/v1", "http://127.0.0.1:10/v1"], "balance": "least_busy",
           "headers": {"X-Tenant": "manpage", "X-From-Env": {"env": "CG_MANPAGE_HEADER"}}}
    for key, (kind, default, _) in keys.items():
        if key.startswith("upstreams.NAME."):
            sub = key[len("upstreams.NAME."):]
            if sub not in ("url", "urls", "balance", "headers"):
                llm[sub] = scalar_value(key, kind, default, samples)
        elif "NAME" not in key and "USER" not in key and not key.startswith(("limits.", "dropin.")):
            set_path(first, key, scalar_value(key, kind, default, samples))
    first["upstreams"] = {"d": {"url": "demo", "delay_ms": 0}, "llm": llm}
    first["services"] = {"travel": {"defaults": {"cabin_class": "economy"}, "profile_defaults": {"from": "home_city"}}}
    first["limits"] = {"messages_per_minute": 20, "turns_at_once": 2, "tokens_per_minute": 20000,
                       "tokens_per_day": 200000, "plan_claim": "plan",
                       "plans": {"pro": {"messages_per_minute": 120, "tokens_per_day": 0}},
                       "users": {"ops-bot": "pro"}}
    first["dropin"] = {
        "path": "/socket", "app": "ws://127.0.0.1:9", "codec": "json", "subprotocols": ["chat.v2"],
        "forward_headers": ["Cookie", "Authorization"], "user_cookie": "sid", "host": "app",
        "headers": {"X-Tenant": "manpage"},
        "client": {"chat": {"pointer": "/kind", "equals": "say"}, "text": "/body", "room": "/conversation",
                   "id": "/msg_id", "cancel": {"pointer": "/kind", "in": ["halt", "stop"]}, "cancel_id": "/msg_id"},
        "app_frames": {"text": "/body", "id": "/reply_to", "end": {"pointer": "/kind", "equals": "end"},
                       "cancelled": {"pointer": "/kind", "equals": "halted"},
                       "reply": {"pointer": "/body", "exists": True},
                       "cancel_frame": {"kind": "halt", "msg_id": "{id}"}},
        "object_key": "chatgate", "object_at": "", "state_key": "chatgate_state",
        "turn_timeout_ms": 60000, "reply_gap_ms": 1500,
    }
    # the socket.io codec's own keys (namespace), and an upstream given by its URL alone
    second = {
        "upstreams": {"s": "demo"},
        "dropin": {"path": "/socket.io/", "app": "ws://127.0.0.1:9", "codec": "socket.io", "namespace": "/chat",
                   "client": {"chat": {"pointer": "/0", "equals": "chat message"}, "text": "/1", "arguments": 1},
                   "app_frames": {"reply": {"pointer": "/0", "equals": "bot message"}, "text": "/1",
                                  "cancel_frame": ["cancel", "{id}"]},
                   "object_at": "/-"},
    }
    covered = key_paths(first) | key_paths(second)
    missing = [k for k in keys if k not in covered]
    check(not missing, f"keys --help-config lists that tests/e2e/test_manpage.py sets in no file: {missing}")
    return first, second


MIN_DROPIN = {"path": "/socket", "app": "ws://127.0.0.1:9",
              "client": {"chat": {"every_text_frame": True}, "text": "/body"}}
# the keys only the socket.io codec takes, and a minimal mapping of that codec
SOCKETIO_KEYS = {"dropin.client.arguments"}
MIN_DROPIN_SOCKETIO = {"path": "/socket.io/", "app": "ws://127.0.0.1:9", "codec": "socket.io",
                       "client": {"chat": {"pointer": "/0", "equals": "chat message"}, "text": "/1"}}


def run_config(config):
    """The gateway started with `config` as its file, expected to exit at once (a mistake):
    (status, output); status None when it was still running after 5 s (it took the file)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHATGATE_") and k != "REDIS_URL"}
    with tempfile.TemporaryDirectory(prefix="chatgate-manpage-") as directory:
        path = Path(directory) / "config.json"
        path.write_text(json.dumps(config, indent=2))
        cmd = [str(_binary[0]), "--listen", f"127.0.0.1:{free_port()}", "--config", str(path)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=5, cwd=harness.REPO_ROOT, env=env,
                                  stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired as err:  # subprocess.run has killed it
            out = [o.decode(errors="replace") if isinstance(o, bytes) else o or "" for o in (err.stdout, err.stderr)]
            return None, "".join(out)
    return proc.returncode, proc.stdout + proc.stderr


async def run_configs(configs):
    """run_config of each, eight at a time."""
    limit = asyncio.Semaphore(8)

    async def one(config):
        async with limit:
            return await asyncio.to_thread(run_config, config)
    results = await asyncio.gather(*(one(c) for c in configs))
    reports = [out for _, out in results if re.search(r"ERROR: \w+Sanitizer|runtime error:", out)]
    check(not reports, f"a sanitizer report:\n{reports[0] if reports else ''}")
    return results


def with_key(config, key, value):
    """config with `key` of --help-config set to value (an upstream's keys in upstream "u", a
    drop-in key in a minimal mapping): (config, the key's path as the loader names it)."""
    config = json.loads(json.dumps(config))
    if key.startswith("upstreams.NAME."):
        key = "upstreams.u." + key.split(".", 2)[2]
        config.setdefault("upstreams", {}).setdefault("u", {"url": "demo"})
    if key in SOCKETIO_KEYS and config.get("dropin", {}).get("codec") != "socket.io":
        config["dropin"] = {**json.loads(json.dumps(MIN_DROPIN_SOCKETIO)), **{
            k: v for k, v in config.get("dropin", {}).items() if k not in MIN_DROPIN}}
    if key.startswith("dropin."):
        config.setdefault("dropin", json.loads(json.dumps(MIN_DROPIN)))
    set_path(config, key, value)
    return config, key


def integer_keys(keys):
    """{key: (min, max)} of the integer keys of --help-config."""
    out = {}
    for key, (kind, _, _) in keys.items():
        match = INTEGER.fullmatch(kind)
        if match:
            out[key] = (int(match[1]), int(match[2]))
    return out


def integer_words(keys):
    """{key: word} of the integer keys that take a word besides a number (workers: auto)."""
    return {key: m[3] for key, (kind, _, _) in keys.items() if (m := INTEGER.fullmatch(kind)) and m[3]}


async def check_bounds(keys):
    ranges = integer_keys(keys)
    # workers above 1 needs a Redis store (config.c, check): its maximum is left out
    at_bound = {"max": {k: hi for k, (lo, hi) in ranges.items() if k != "workers"},
                "min": {k: lo for k, (lo, hi) in ranges.items()}}
    for which, values in at_bound.items():
        with step(f"the {len(values)} integer keys all at their {which}imum: the gateway starts"):
            config = {}
            for key, value in values.items():
                config, _ = with_key(config, key, value)
            async with Gateway(config=config, name=f"keys-at-{which}") as gw:
                gw.assert_alive()
    words = integer_words(keys)
    with step(f"the {len(words)} integer key(s) taking a word ({', '.join(words)}) take it, in a file and as a flag"):
        check(words, "--help-config lists no integer key with a word; workers takes auto")
        for key, word in words.items():
            config, _ = with_key({}, key, word)
            async with Gateway(config=config, name=f"word-{key}") as gw:
                gw.assert_alive()
            if "." not in key:
                async with Gateway(args=[f"--{key.replace('_', '-')}", word], name=f"word-flag-{key}") as gw:
                    gw.assert_alive()
    with step(f"each of the {len(ranges)} integer keys one past its range, either side: exit 2, naming it"):
        cases = [with_key({}, key, value) + (value,) for key, (lo, hi) in ranges.items() for value in (lo - 1, hi + 1)]
        results = await run_configs([config for config, _, _ in cases])
        wrong = [f"{where}={value}: exit {code}: {brief(out, 200)}"
                 for (_, where, value), (code, out) in zip(cases, results) if code != 2 or where not in out]
        check(not wrong, f"values outside the range --help-config gives, not refused as such: {wrong}")


async def check_loader(flags, keys):
    with step("every flag with a value, but --upstream and --config, is a key of --help-config"):
        orphans = [f for f in flags if f not in NOT_KEYS and f.replace("-", "_") not in keys]
        check(not orphans, f"flags with no key in --help-config: {orphans}")

    first, second = full_configs(keys)
    env = {"CG_MANPAGE_HEADER": "from-env", "CG_MANPAGE_API_KEY": "sk-manpage"}
    with step(f"a file setting the {len(key_paths(first))} paths of every table key, upstreams, limits "
              "and a json drop-in mapping: the gateway starts"):
        async with Gateway(config=first, env=env, name="all-keys") as gw:
            gw.assert_alive()
    with step("a socket.io drop-in mapping with its namespace, and an upstream given as its URL: starts"):
        async with Gateway(config=second, name="socketio-keys") as gw:
            gw.assert_alive()

    await check_bounds(keys)

    with step("unknown keys, at the top and nested, and an unknown flag: exit 2, named"):
        cases = [
            ({"no_such_key": 1}, "no_such_key: unknown key"),
            ({"rate_limit": {"no_such_key": 1}}, "rate_limit.no_such_key: unknown key"),
            ({"upstreams": {"d": {"url": "demo", "no_such_key": 1}}}, "upstreams.d.no_such_key: unknown key"),
            ({"limits": {"no_such_key": 1}}, "limits.no_such_key: unknown key"),
            ({"limits": {"plans": {"pro": {"no_such_key": 1}}}}, "limits.plans.pro.no_such_key: unknown key"),
            ({"dropin": {**MIN_DROPIN, "no_such_key": 1}}, "dropin.no_such_key: unknown key"),
            ({"services": {"travel": {"no_such_key": {}}}}, "services.travel.no_such_key: unknown key"),
        ]
        results = await run_configs([config for config, _ in cases])
        for (config, want), (code, out) in zip(cases, results):
            check(code == 2 and want in out, f"{json.dumps(config)}: exit {code}, expected 2 and {want!r}: {out}")
        proc = await asyncio.to_thread(run_binary, "--no-such-flag", "1")
        out = proc.stdout + proc.stderr
        check(proc.returncode == 2 and "--no-such-flag: unknown option" in out,
              f"--no-such-flag: exit {proc.returncode}: {out}")


async def main(args):
    _binary[0] = args.gateway
    with step("chatgate --help and --help-config"):
        flags = help_flags()
        keys = help_config()
        print(f"   {len(flags)} flags, {len(keys)} config keys", flush=True)
    sections = man_sections()

    async def options():
        with step("every flag of --help has an OPTIONS entry in docs/chatgate.1, and nothing else does"):
            check_options(flags, sections)

    async def configuration():
        with step("every key of --help-config has a CONFIGURATION entry, with its range, default and values"):
            check_configuration(keys, sections)

    async def sections_present():
        with step("the page has the sections of a man page"):
            want = ["NAME", "SYNOPSIS", "DESCRIPTION", "OPTIONS", "CONFIGURATION", "ENVIRONMENT", "SIGNALS",
                    "FILES", "EXIT STATUS", "SEE ALSO"]
            missing = [s for s in want if s not in sections]
            check(not missing, f"sections missing from {MAN.name}: {missing}")
            env_text = "\n".join(sections["ENVIRONMENT"])
            names = set(re.findall(r'getenv\("([A-Z_]+)"\)',
                                   "\n".join(p.read_text() for p in (harness.REPO_ROOT / "src").rglob("*.c"))))
            undocumented = sorted(n for n in names if n not in env_text)
            check(not undocumented, f"variables src/ reads that ENVIRONMENT does not name: {undocumented}")

    async def render():
        with step("the page renders without warnings"):
            check_render()

    async def completion():
        with step("the completion's flags are those of --help"):
            compare("flags", completion_flags(), flags, COMPLETION_NAME, "chatgate --help")
        with step("completing in bash: enum values, directories, files, rules subcommands"):
            if not shutil.which("bash"):
                print("   skipped: no bash", flush=True)
                return
            check_completion_values(flags, keys)

    async def loader():
        await check_loader(flags, keys)

    for part in (options, configuration, sections_present, render, completion, loader):
        await independent(part())


if __name__ == "__main__":
    harness.run(main, timeout=55)  # ctest's TIMEOUT is 60
