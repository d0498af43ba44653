"""End-to-end test of the monitoring kit (issue 16, item 3): the Grafana dashboard
packaging/grafana/chatgate.json and the Prometheus alert rules
packaging/prometheus/chatgate-alerts.yml, held against what a running gateway serves on
GET /metrics, so that neither can name a series chatgate does not have.

1. The dashboard is a Grafana (9/10) dashboard model: title, uid, schemaVersion, panels
   (rows' nested panels too) with unique integer ids, a type and a gridPos inside 24 columns
   that overlaps no other; every panel but a row has targets, each with a refId unique in the
   panel and a non-empty expr; a `datasource` template variable (DS_PROMETHEUS, query
   prometheus) that every panel and target uses (`${DS_PROMETHEUS}`); query variables `job`
   and `instance` on it (instance filtered by $job); every chatgate selector of a panel or
   an annotation filters job=~"$job" and instance=~"$instance". It covers what issue 16
   asks for: connections, turns by end, latency by stage, errors by code, upstream errors,
   the store, rules (fired, per rule, file time, shadow), limits per user, tokens, workers.
2. The alert rules: groups of rules, each with an alert name (unique), an expr, a
   `severity` label (critical, warning or info) and the summary and description
   annotations; they cover the gateway down (up == 0), the store degraded for over a
   minute, the error ratio, the p99 turn latency, failing upstreams, worker restarts.
3. A live /metrics: `--workers 2 --store redis://...` (a redis-server of the test's own,
   harness.RedisServer), an OpenAI-compatible fake and the demo upstream, the shipped
   rules/, two messages (one firing rules) answered done, so the per-worker, per-upstream
   and per-rule families are all there.
4. Every expr of the dashboard (panels, annotations, template variables) and of the alert
   rules, read token by token: each metric it queries exists in that /metrics by its exact
   sample name (a histogram through _bucket, _sum or _count: its bare family name has no
   series); only `up` besides chatgate_* names; every label a selector matches on or a
   by/without/on clause names is a label of that family (job and instance are the target's
   labels Prometheus adds); a value matched with = (or =~) is one the family has (`""`: a
   series without the label); rate/irate/increase read counters (or histogram parts);
   histogram_quantile reads a _bucket series grouped by le.
5. `promtool check rules` on the alert rules passes; and the dashboard's exprs, Grafana's
   variables replaced, as recording rules through `promtool check rules`: each is valid
   PromQL.
6. The checks catch a bad dashboard: a copy naming chatgate_no_such_total, one grouping by
   a label the family lacks, one filtering on a value it never has: each is reported.

CHATGATE_DASHBOARD and CHATGATE_ALERT_RULES name other files to check (a copy being edited).
"""

import asyncio
import copy
import difflib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import harness
from harness import Client, check, fail, independent, step

DASHBOARD = Path(os.environ.get("CHATGATE_DASHBOARD") or harness.REPO_ROOT / "packaging/grafana/chatgate.json")
ALERT_RULES = Path(os.environ.get("CHATGATE_ALERT_RULES") or
                   harness.REPO_ROOT / "packaging/prometheus/chatgate-alerts.yml")
DS_VAR = "DS_PROMETHEUS"
# Labels Prometheus attaches to every series of a scrape target: not in /metrics itself.
TARGET_LABELS = {"job", "instance"}
# Series Prometheus makes itself for a target; the only names besides chatgate_* allowed.
PROMETHEUS_SERIES = {"up"}
# What issue 16 asks the dashboard to show, and the alert rules to watch (sample names).
DASHBOARD_MUST_QUERY = {
    "chatgate_connections", "chatgate_turns_total", "chatgate_stage_seconds_bucket", "chatgate_errors_total",
    "chatgate_upstream_errors_total", "chatgate_store_degraded", "chatgate_store_degraded_seconds_total",
    "chatgate_rules_fired_total", "chatgate_rule_hits_total", "chatgate_rule_file_seconds_bucket",
    "chatgate_shadow_rules_differences_total", "chatgate_limited_total", "chatgate_tokens_total",
    "chatgate_worker_up", "chatgate_worker_restarts_total",
}
ALERTS_MUST_QUERY = {
    "up", "chatgate_store_degraded", "chatgate_turns_total", "chatgate_stage_seconds_bucket",
    "chatgate_upstream_errors_total", "chatgate_worker_restarts_total",
}
SEVERITIES = {"critical", "warning", "info"}

# ---------------------------------------------------------------------------------------
# PromQL, read token by token: enough to find selectors, their matchers, the functions
# around them and the label lists of by/without/on/ignoring/group_left/group_right.

_TOKEN = re.compile(r"""
    (?P<space>\s+)
  | (?P<comment>\#[^\n]*)
  | (?P<str>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
  | (?P<range>\[[^\]]*\])
  | (?P<var>\$\{[^}]*\}|\$[A-Za-z_][A-Za-z0-9_]*)
  | (?P<dur>(?:\d+(?:ms|s|m|h|d|w|y))+(?![A-Za-z0-9_]))
  | (?P<num>0[xX][0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<op>=~|!~|!=|==|<=|>=|[-+*/%^<>=(){},@])
""", re.X)
_CLAUSES = {"by", "without", "on", "ignoring", "group_left", "group_right"}
_KEYWORDS = _CLAUSES | {"and", "or", "unless", "bool", "offset", "atan2", "inf", "nan", "start", "end"}
_COUNTER_FUNCS = {"rate", "irate", "increase", "resets"}
_GAUGE_FUNCS = {"delta", "idelta", "deriv", "predict_linear", "holt_winters"}


def tokenize(expr):
    tokens, pos = [], 0
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        if not m:
            raise ValueError(f"cannot read {expr[pos:pos + 20]!r} at offset {pos}")
        pos = m.end()
        if m.lastgroup not in ("space", "comment"):
            tokens.append((m.lastgroup, m.group()))
    return tokens


def unquote(s):
    if s[0] == "`":
        return s[1:-1]
    return re.sub(r"\\(.)", lambda e: {"n": "\n", "t": "\t"}.get(e.group(1), e.group(1)), s[1:-1])


def parse_promql(expr):
    """(selectors, clauses): selectors as dicts {name, matchers [(label, op, value)], funcs
    (the calls around it, innermost last), at (token index)}; clauses as (keyword, labels,
    (first, last) token range the clause applies to)."""
    tokens = tokenize(expr)
    match, stack = {}, []
    for i, (kind, text) in enumerate(tokens):
        if text in "({" and kind == "op":
            stack.append(i)
        elif text in ")}" and kind == "op":
            if not stack:
                raise ValueError(f"unbalanced {text!r}")
            j = stack.pop()
            match[i], match[j] = j, i
    if stack:
        raise ValueError("unbalanced parenthesis or brace")
    calls = []  # (name, open, close)
    selectors, clauses = [], []
    i = 0
    while i < len(tokens):
        kind, text = tokens[i]
        nxt = tokens[i + 1][1] if i + 1 < len(tokens) else None
        if kind == "ident" and text in _CLAUSES and nxt == "(":
            close = match[i + 1]
            labels = [t for k, t in tokens[i + 2:close] if k == "ident"]
            if text in ("by", "without"):
                if i > 0 and tokens[i - 1][1] == ")":  # sum (x) by (l)
                    scope = (match[i - 1], i - 1)
                elif close + 1 < len(tokens) and tokens[close + 1][1] == "(":  # sum by (l) (x)
                    scope = (close + 1, match[close + 1])
                else:
                    raise ValueError(f"{text} (...) without its aggregation's argument")
            else:
                scope = (0, len(tokens))
            clauses.append((text, labels, scope))
            i = close + 1
            continue
        if kind == "ident" and nxt == "(":
            calls.append((text, i + 1, match[i + 1]))
            i += 1
            continue
        if kind == "ident" and nxt in ("by", "without"):  # sum by (l) (x): an aggregation
            i += 1
            continue
        if kind == "ident" and text == "offset":
            i += 2
            continue
        if (kind == "ident" and text not in _KEYWORDS) or (kind == "op" and text == "{"):
            at = i
            name = text if kind == "ident" else None
            matchers = []
            j = i + 1 if kind == "ident" else i
            if j < len(tokens) and tokens[j][1] == "{":
                close = match[j]
                inner = [t for t in tokens[j + 1:close] if t[1] != ","]
                if len(inner) % 3:
                    raise ValueError(f"cannot read the matchers of {name}: {[t for _, t in inner]}")
                for k in range(0, len(inner), 3):
                    (lk, label), (_, op), (vk, value) = inner[k:k + 3]
                    if lk != "ident" or op not in ("=", "!=", "=~", "!~") or vk != "str":
                        raise ValueError(f"cannot read the matcher {label} {op} {value} of {name}")
                    matchers.append((label, op, unquote(value)))
                j = close + 1
            if name is None:
                name = next((v for lb, op, v in matchers if lb == "__name__" and op == "="), None)
            selectors.append({"name": name, "matchers": matchers, "at": at})
            i = j
            continue
        i += 1
    for sel in selectors:
        sel["funcs"] = [name for name, o, c in sorted(calls, key=lambda x: x[1]) if o < sel["at"] < c]
    return selectors, clauses


class Exposition:
    """What one /metrics offers: sample names, their labels and values, their families' types."""

    def __init__(self, metrics):
        self.m = metrics
        self.labels = {}  # sample name -> {label: set of values}
        self.lacking = {}  # sample name -> labels some of its samples do not have
        for (name, labels), _ in metrics.samples.items():
            d = dict(labels)
            known = self.labels.setdefault(name, {})
            for k, v in d.items():
                known.setdefault(k, set()).add(v)
        for (name, labels), _ in metrics.samples.items():
            d = dict(labels)
            self.lacking.setdefault(name, set()).update(k for k in self.labels[name] if k not in d)

    def family(self, name):
        fam = self.m.family(name)
        return fam, self.m.types.get(fam)


def check_expr(where, expr, expo, filters=False):
    """Problems (strings) of one expr against the exposition. filters: every chatgate
    selector must filter job=~"$job" and instance=~"$instance" (a panel of the dashboard)."""
    try:
        selectors, clauses = parse_promql(expr)
    except (ValueError, KeyError) as err:
        return [f"{where}: cannot read the expr ({err}): {expr}"]
    problems = []
    if not selectors:
        problems.append(f"{where}: queries no metric: {expr}")
    for sel in selectors:
        name = sel["name"]
        if name is None:
            problems.append(f"{where}: a selector without a metric name: {expr}")
            continue
        if name in PROMETHEUS_SERIES:
            for label, _, _ in sel["matchers"]:
                if label not in TARGET_LABELS:
                    problems.append(f"{where}: {name} has no label {label!r} (only {sorted(TARGET_LABELS)})")
            continue
        if not name.startswith("chatgate_"):
            problems.append(f"{where}: {name} is not a chatgate metric (nor one of {sorted(PROMETHEUS_SERIES)})")
            continue
        fam, kind = expo.family(name)
        if name not in expo.labels:
            if kind == "histogram":
                problems.append(f"{where}: {name} is a histogram: it has no series of its own; "
                                f"query {name}_bucket, {name}_sum or {name}_count")
            else:
                near = difflib.get_close_matches(name, expo.labels, n=3, cutoff=0.6)
                problems.append(f"{where}: {name} is not in /metrics" + (f" (did you mean {', '.join(near)}?)"
                                                                        if near else ""))
            continue
        known = expo.labels[name]
        if filters:
            got = {(lb, op, v) for lb, op, v in sel["matchers"]}
            for want in (("job", "=~", "$job"), ("instance", "=~", "$instance")):
                if want not in got:
                    problems.append(f'{where}: {name} should filter {want[0]}=~"{want[2]}" '
                                    f"(the dashboard's variables): {expr}")
        for label, op, value in sel["matchers"]:
            if label in TARGET_LABELS or label == "__name__":
                continue
            if label not in known:
                problems.append(f"{where}: {name} (family {fam}) has no label {label!r}; its labels: "
                                f"{sorted(known)}")
                continue
            if "$" in value or op in ("!=", "!~"):
                continue
            values = known[label]
            if op == "=" and value == "":
                if label not in expo.lacking[name]:
                    problems.append(f'{where}: {name}{{{label}=""}} matches nothing: every sample has a {label}')
            elif op == "=" and value not in values:
                problems.append(f"{where}: {name} has no {label}={value!r}; its values: {sorted(values)}")
            elif op == "=~" and not any(re.fullmatch(value, v) for v in values):
                problems.append(f"{where}: {name}{{{label}=~{value!r}}} matches none of {sorted(values)}")
        inner = sel["funcs"][-1] if sel["funcs"] else None
        part = kind == "histogram" and name != fam
        if inner in _COUNTER_FUNCS and kind != "counter" and not part:
            problems.append(f"{where}: {inner}() of {name}, a {kind}: {inner}() is for counters")
        if inner in _GAUGE_FUNCS and kind != "gauge":
            problems.append(f"{where}: {inner}() of {name}, a {kind}: {inner}() is for gauges")
        if "histogram_quantile" in sel["funcs"] and not (kind == "histogram" and name == fam + "_bucket"):
            problems.append(f"{where}: histogram_quantile() over {name}: it reads a histogram's _bucket series")
    for keyword, labels, (first, last) in clauses:
        inside = [s for s in selectors if first <= s["at"] <= last and s["name"] in expo.labels]
        for label in labels:
            if label in TARGET_LABELS:
                continue
            having = [s["name"] for s in inside if label in expo.labels[s["name"]]]
            if keyword in ("by", "without"):
                lacking = sorted({s["name"] for s in inside} - set(having))
                if lacking:
                    problems.append(f"{where}: {keyword} ({label}) but {', '.join(lacking)} has no label "
                                    f"{label!r}: {expr}")
            elif not having:
                problems.append(f"{where}: {keyword} ({label}) but no metric of the expr has that label: {expr}")
        if keyword == "by" and "le" not in labels:
            for s in inside:
                if "histogram_quantile" in s["funcs"]:
                    problems.append(f"{where}: by ({', '.join(labels)}) drops le, which "
                                    f"histogram_quantile() needs: {expr}")
    return problems


def queried_names(expr):
    try:
        return {s["name"] for s in parse_promql(expr)[0] if s["name"]}
    except (ValueError, KeyError):
        return set()


# ---------------------------------------------------------------------------------------
# The dashboard


def all_panels(panels):
    for p in panels:
        yield p
        yield from all_panels(p.get("panels") or [])


def variable_expr(var):
    """(expr, label or None) of a query variable: label_values(EXPR, LABEL) or
    query_result(EXPR); (None, None) for the forms that name no series."""
    q = var.get("query")
    if isinstance(q, dict):
        q = q.get("query")
    q = (q or "").strip()
    m = re.fullmatch(r"label_values\((.+),\s*([A-Za-z_][A-Za-z0-9_]*)\s*\)", q, re.S)
    if m:
        return m.group(1), m.group(2)
    m = re.fullmatch(r"query_result\((.+)\)", q, re.S)
    if m:
        return m.group(1), None
    return None, None


def dashboard_structure(dash):
    """Problems of the dashboard model, and its exprs: [(where, expr, filters, label)]."""
    problems, exprs = [], []
    for key, kind in (("title", str), ("uid", str), ("schemaVersion", int), ("panels", list),
                      ("templating", dict), ("time", dict)):
        if not isinstance(dash.get(key), kind):
            problems.append(f"the dashboard's {key!r} should be a {kind.__name__}: {dash.get(key)!r}")
    if problems:
        return problems, exprs
    if len(dash["uid"]) > 40:
        problems.append(f"uid {dash['uid']!r} is longer than Grafana's 40 characters")
    variables = {v.get("name"): v for v in dash["templating"].get("list", [])}
    ds = variables.get(DS_VAR)
    if not ds or ds.get("type") != "datasource" or ds.get("query") != "prometheus":
        problems.append(f"no datasource template variable {DS_VAR} of type datasource, query prometheus: {ds}")
    ds_ref = "${" + DS_VAR + "}"

    def uses_ds(obj, where):
        d = obj.get("datasource")
        uid = d.get("uid") if isinstance(d, dict) else d
        if uid != ds_ref:
            problems.append(f"{where}: datasource {d!r}, expected uid {ds_ref}")

    for name in ("job", "instance"):
        var = variables.get(name)
        if not var or var.get("type") != "query":
            problems.append(f"no query template variable {name!r}")
            continue
        uses_ds(var, f"variable {name}")
        expr, label = variable_expr(var)
        if not expr or label != name:
            problems.append(f"variable {name}: expected label_values(<chatgate metric>, {name}): {var.get('query')}")
            continue
        if name == "instance" and "$job" not in expr:
            problems.append(f"variable instance should be filtered by $job: {expr}")
        exprs.append((f"variable {name}", expr, False, label))
    ids, rects = set(), []
    for p in all_panels(dash["panels"]):
        where = f"panel {p.get('id')} {p.get('title')!r}"
        if not isinstance(p.get("id"), int) or isinstance(p.get("id"), bool):
            problems.append(f"{where}: no integer id")
        elif p["id"] in ids:
            problems.append(f"{where}: id {p['id']} is used twice")
        ids.add(p.get("id"))
        if not p.get("type") or not p.get("title"):
            problems.append(f"{where}: a panel needs a type and a title")
        g = p.get("gridPos") or {}
        if not all(isinstance(g.get(k), int) for k in "hwxy") or g["x"] < 0 or g["w"] < 1 or g["x"] + g["w"] > 24:
            problems.append(f"{where}: gridPos {g} is not inside the 24 columns")
        else:
            for other, og in rects:
                if g["x"] < og["x"] + og["w"] and og["x"] < g["x"] + g["w"] and \
                        g["y"] < og["y"] + og["h"] and og["y"] < g["y"] + g["h"]:
                    problems.append(f"{where}: gridPos {g} overlaps {other} {og}")
            rects.append((where, g))
        if p.get("type") == "row":
            continue
        uses_ds(p, where)
        targets = p.get("targets")
        if not isinstance(targets, list) or not targets:
            problems.append(f"{where}: no targets")
            continue
        refs = [t.get("refId") for t in targets]
        if len(set(refs)) != len(refs) or not all(refs):
            problems.append(f"{where}: refIds should be set and unique: {refs}")
        for t in targets:
            uses_ds(t, f"{where} target {t.get('refId')}")
            if not isinstance(t.get("expr"), str) or not t["expr"].strip():
                problems.append(f"{where} target {t.get('refId')}: no expr")
                continue
            exprs.append((f"{where} target {t.get('refId')}", t["expr"], True, None))
    for a in dash.get("annotations", {}).get("list", []):
        if a.get("expr"):
            uses_ds(a, f"annotation {a.get('name')!r}")
            exprs.append((f"annotation {a.get('name')!r}", a["expr"], True, None))
    queried = set().union(*(queried_names(e) for _, e, _, _ in exprs)) if exprs else set()
    missing = sorted(DASHBOARD_MUST_QUERY - queried)
    if missing:
        problems.append(f"the dashboard shows nothing of {missing}")
    return problems, exprs


def check_exprs(exprs, expo):
    problems = []
    for where, expr, filters, label in exprs:
        problems += check_expr(where, expr, expo, filters)
        if label and label not in TARGET_LABELS:
            for name in queried_names(expr):
                if name in expo.labels and label not in expo.labels[name]:
                    problems.append(f"{where}: label_values over {name}, which has no label {label!r}")
    return problems


def report(problems, what):
    check(not problems, f"{len(problems)} problem(s) in {what}:\n  " + "\n  ".join(problems))


# ---------------------------------------------------------------------------------------
# The alert rules


def load_alert_rules():
    try:
        import yaml
    except ImportError:
        fail("python3-yaml is needed to read the alert rules (Debian package python3-yaml)")
    with open(ALERT_RULES) as f:
        return yaml.safe_load(f)


def alerts_structure(doc):
    problems, exprs, names = [], [], set()
    groups = doc.get("groups") if isinstance(doc, dict) else None
    if not isinstance(groups, list) or not groups:
        return [f"{ALERT_RULES.name}: no groups"], exprs
    for g in groups:
        for r in g.get("rules") or []:
            name = r.get("alert")
            where = f"alert {name}"
            if not name:
                problems.append(f"group {g.get('name')}: a rule that is not an alert (record: {r.get('record')})")
                continue
            if name in names:
                problems.append(f"{where}: the name is used twice")
            names.add(name)
            if r.get("labels", {}).get("severity") not in SEVERITIES:
                problems.append(f"{where}: severity label {r.get('labels', {}).get('severity')!r}, "
                                f"expected one of {sorted(SEVERITIES)}")
            for key in ("summary", "description"):
                if not str(r.get("annotations", {}).get(key) or "").strip():
                    problems.append(f"{where}: no {key} annotation")
            if not str(r.get("expr") or "").strip():
                problems.append(f"{where}: no expr")
                continue
            exprs.append((where, str(r["expr"]), False, None))
    queried = set().union(*(queried_names(e) for _, e, _, _ in exprs)) if exprs else set()
    missing = sorted(ALERTS_MUST_QUERY - queried)
    if missing:
        problems.append(f"no alert watches {missing}")
    return problems, exprs


# ---------------------------------------------------------------------------------------
# promtool


def promtool():
    path = shutil.which("promtool")
    if not path:
        fail("promtool not found: `scripts/deps.sh test` installs Debian's prometheus package, which has it")
    return path


def promtool_check(path):
    proc = subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True, text=True, timeout=30)
    return proc.returncode, (proc.stdout + proc.stderr).strip()


def grafana_to_promql(expr):
    """The expr as Prometheus would get it from Grafana: the interval variables a duration,
    the others (in label values) a regex matching anything."""
    expr = re.sub(r"\$\{?__(rate_interval|interval|range)\}?", "5m", expr)
    return re.sub(r"\$\{?[A-Za-z_][A-Za-z0-9_]*\}?", ".+", expr)


# ---------------------------------------------------------------------------------------
# The test


async def live_metrics(redis):
    """/metrics of --workers 2 on the redis-server, after two messages."""
    async with harness.FakeOpenAI() as fake:
        config = harness.make_config({"llm": harness.openai_upstream(fake, "ok"), "demo": harness.demo_upstream()},
                                     "llm")
        async with harness.Gateway(["--workers", "2", "--store", redis.url], config,
                                   name="gateway-dashboard") as gw:
            client = await Client.connect(gw)
            try:
                for i, text in enumerate(["Find me flights from Nairobi to London next week", "hello there"]):
                    (await client.message(text, mid=f"m{i}")).expect_done()
            finally:
                await client.close()
            deadline = time.monotonic() + 10
            while True:
                status, _, body = await asyncio.to_thread(harness.http_get, gw.http_url + "/metrics")
                check(status == 200, f"/metrics answered {status}")
                m = harness.parse_metrics(body.decode())
                ups = [v for labels, v in m.series("chatgate_worker_up").items() if labels]
                if ups == [1, 1] and m.value("chatgate_turns_total", end="done") == 2:
                    return m
                check(time.monotonic() < deadline,
                      f"/metrics should show both workers up and 2 turns done: {harness.brief(m.text, 2000)}")
                await asyncio.sleep(0.1)


async def part_promtool(dash_exprs):
    with step("promtool check rules passes on the alert rules"):
        code, out = await asyncio.to_thread(promtool_check, ALERT_RULES)
        check(code == 0, f"promtool check rules {ALERT_RULES} exited {code}:\n{out}")
        print(f"   {out.splitlines()[-1].strip()}", flush=True)
    with step("every dashboard expr is valid PromQL (promtool, as recording rules)"):
        rules = [{"record": f"chatgate_dashboard:expr_{i}", "expr": grafana_to_promql(expr)}
                 for i, (_, expr, _, _) in enumerate(dash_exprs)]
        with tempfile.TemporaryDirectory(prefix="chatgate-e2e-dashboard-") as d:
            path = Path(d) / "dashboard-exprs.yml"
            path.write_text(json.dumps({"groups": [{"name": "dashboard", "rules": rules}]}, indent=1))
            code, out = await asyncio.to_thread(promtool_check, path)
        if code != 0:
            named = sorted({int(i) for i in re.findall(r"chatgate_dashboard:expr_(\d+)", out)})
            index = "\n".join(f"  expr_{i}: {dash_exprs[i][0]}: {dash_exprs[i][1]}" for i in named)
            fail(f"promtool check rules on the dashboard's exprs exited {code}:\n{out}\nwhich are:\n{index}")


async def part_report(name, problems, what):
    with step(name):
        report(problems, what)


async def part_exprs(name, exprs, expo, what, show=False):
    with step(name):
        report(check_exprs(exprs, expo), what)
        if show:
            used = sorted(set().union(*(queried_names(e) for _, e, _, _ in exprs)))
            print(f"   {len(used)} series names: {', '.join(used)}", flush=True)


async def part_catches(dash, expo):
    with step("the checks catch a dashboard naming a metric, a label or a value /metrics does not have"):
        target = next((t for p in all_panels(dash["panels"]) for t in p.get("targets", [])
                       if "chatgate_turns_total{" in t.get("expr", "") and "by (end)" in t.get("expr", "")), None)
        check(target, "no target of the dashboard sums chatgate_turns_total by (end) to make bad copies of")
        for old, new, expect in (
                ("chatgate_turns_total", "chatgate_no_such_total", "chatgate_no_such_total is not in /metrics"),
                ("by (end)", "by (ending)", "by (ending) but chatgate_turns_total has no label 'ending'"),
                ("chatgate_turns_total{", 'chatgate_turns_total{end="failed",', "has no end='failed'")):
            bad = copy.deepcopy(dash)
            t = next(t for p in all_panels(bad["panels"]) for t in p.get("targets", []) if t["expr"] == target["expr"])
            t["expr"] = t["expr"].replace(old, new)
            problems, exprs = dashboard_structure(bad)
            problems += check_exprs(exprs, expo)
            check(any(expect in p for p in problems),
                  f"a copy with {new!r} in {t['expr']!r} should be reported ({expect!r}); reported: {problems}")


def shown(path):
    return path.relative_to(harness.REPO_ROOT) if path.is_relative_to(harness.REPO_ROOT) else path


async def main(args):
    with step(f"read {shown(DASHBOARD)} and {shown(ALERT_RULES)}"):
        with open(DASHBOARD) as f:
            dash = json.load(f)
        dash_problems, dash_exprs = dashboard_structure(dash)
        alert_problems, alert_exprs = alerts_structure(load_alert_rules())
        print(f"   dashboard: {sum(1 for _ in all_panels(dash.get('panels') or []))} panels, {len(dash_exprs)} "
              f"exprs; alert rules: {len(alert_exprs)}", flush=True)
    await independent(part_report("the dashboard is a Grafana dashboard over the DS_PROMETHEUS, job and instance "
                                  "variables, showing what issue 16 asks", dash_problems, DASHBOARD.name))
    await independent(part_report("the alert rules have a severity, a summary and a description, and cover what "
                                  "issue 16 asks", alert_problems, ALERT_RULES.name))
    await independent(part_promtool(dash_exprs))
    redis = await harness.RedisServer().astart()
    try:
        with step("a live /metrics: --workers 2 --store redis://..., two messages answered"):
            expo = Exposition(await live_metrics(redis))
    finally:
        redis.cleanup()
    await independent(part_exprs(f"the dashboard's {len(dash_exprs)} exprs query only series, labels and values "
                                 "/metrics has", dash_exprs, expo, DASHBOARD.name, show=True))
    await independent(part_exprs(f"the {len(alert_exprs)} alert rules query only series, labels and values "
                                 "/metrics has", alert_exprs, expo, ALERT_RULES.name))
    await independent(part_catches(dash, expo))


if __name__ == "__main__":
    harness.run(main, timeout=55)
