/*
 * replay.c: `chatgate rules replay` (replay.h). Recorded conversations go through an old and
 * a new rule set, and every turn the two decide differently is printed, for a CI log.
 *
 * What must hold: a replayed turn is what the live gateway does with the message
 * (server/turn.c, turn_start and turn_save): the dialog as the store gives it back (parts
 * whose lifetime ran out are gone), counted, decided by cg_pipeline_run, then kept in the
 * history with its rewrite, at the line's time. Each dialog keeps one state per rule set, and
 * each state evolves from its own set's decisions only; assistant lines (and the state
 * directives they carry) are applied to both as recorded, since offline no upstream can
 * answer differently. Every transcript is read and checked before the first turn runs, so
 * a bad line ends the command (CG_REPLAY_BAD_INPUT) with nothing replayed or printed.
 *
 * Upstreams: offline there is no configuration, so the route is compared by name in a
 * configuration of our own: "default" is the configured default upstream, and every
 * upstream a route rule or a state directive names is taken as configured (live, a name the
 * configuration lacks would go to the default instead).
 */
#include <ctype.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "chatgate/core/alloc.h"
#include "chatgate/core/utf8.h"
#include "chatgate/dialog/pipeline.h"
#include "chatgate/dialog/replay.h"

#define REPLAY_CUT 200 /* bytes of a message or a rewrite that a difference shows */
#define REPLAY_MAX_FILE ((size_t)256 << 20) /* bytes of one transcript */
#define REPLAY_DEFAULT "default" /* the name of the configured default upstream */

/* One line of a transcript, checked: a user's message or an assistant's reply. */
typedef struct replay_line {
    int line;          /* JSON lines: the file's line, from 1; an export: 0 */
    size_t item;       /* an export: the index in its history */
    size_t dialog;     /* index into the transcript's dialogs */
    int assistant;
    const char *text;  /* borrowed from the transcript's JSON */
    int has_ts;
    int64_t ts;        /* unix seconds */
    json_t *state;     /* assistant: a state directive (borrowed), or NULL */
    const char *upstream; /* assistant: the upstream that answered */
} replay_line;

typedef struct replay_transcript {
    const char *path;
    json_t *json;      /* owns what the lines borrow: the lines' objects, or the export */
    json_t *ids;       /* the dialogs' ids, in order of first appearance */
    json_t *index;     /* id -> its index in ids */
    replay_line *lines;
    size_t n_lines, cap;
} replay_transcript;

/* One dialog while it is replayed: a state per rule set (0 old, 1 new). */
typedef struct replay_dialog {
    cg_dialog side[2];
    int started;
    int64_t clock; /* the time of its last line: when the gateway would have saved it */
    long turns;    /* user lines so far */
} replay_dialog;

typedef struct replay_ctx {
    const cg_replay_options *opt;
    const cg_ruleset *rules[2];
    cg_config *cfg; /* upstreams by name; the pipeline reads nothing else of it */
    cg_lifetimes lt;
    cg_replay_totals totals;
} replay_ctx;

/* ---- reading transcripts ------------------------------------------------------------- */

/* n digits at s as a number, or -1. */
static int digits(const char *s, int n)
{
    int v = 0;
    for (int i = 0; i < n; i++) {
        if (!isdigit((unsigned char)s[i]))
            return -1;
        v = v * 10 + (s[i] - '0');
    }
    return v;
}

/*
 * "2026-02-03T10:00:00Z" as unix seconds: a fraction of a second is dropped, the zone is Z,
 * +HH:MM, -HH:MM, +HHMM or none (UTC). 0, or -1 when s is not such a time.
 */
static int parse_iso_time(const char *s, int64_t *out)
{
    if (strlen(s) < 19 || s[4] != '-' || s[7] != '-' || !strchr("Tt ", s[10]) || s[13] != ':' || s[16] != ':')
        return -1;
    int y = digits(s, 4), mo = digits(s + 5, 2), d = digits(s + 8, 2);
    int h = digits(s + 11, 2), mi = digits(s + 14, 2), sec = digits(s + 17, 2);
    if (y < 1970 || mo < 1 || mo > 12 || d < 1 || d > 31 || h < 0 || h > 23 || mi < 0 || mi > 59 || sec < 0 ||
        sec > 60)
        return -1;
    const char *p = s + 19;
    if (*p == '.')
        for (p++; isdigit((unsigned char)*p); p++)
            ;
    long offset = 0;
    if ((*p == 'Z' || *p == 'z') && !p[1]) {
        p++;
    } else if (*p == '+' || *p == '-') {
        size_t rest = strlen(p); /* "+03:00" or "+0300" */
        int colon = rest == 6 && p[3] == ':';
        if (rest != 5 + (size_t)colon)
            return -1;
        int oh = digits(p + 1, 2), om = digits(p + 3 + colon, 2);
        if (oh < 0 || oh > 23 || om < 0 || om > 59)
            return -1;
        offset = (*p == '-' ? -1 : 1) * (oh * 3600L + om * 60L);
        p += rest;
    }
    if (*p)
        return -1;
    struct tm tm = {.tm_year = y - 1900, .tm_mon = mo - 1, .tm_mday = d, .tm_hour = h, .tm_min = mi, .tm_sec = sec};
    time_t t = timegm(&tm);
    if (tm.tm_mday != d) /* timegm moved "Feb 30" into March */
        return -1;
    *out = (int64_t)t - offset;
    return 0;
}

/* "ts": unix seconds (a number) or an ISO 8601 time. 0, or -1 with err. */
static int read_ts(json_t *v, int64_t *out, char *err, size_t errlen)
{
    if (json_is_integer(v) && json_integer_value(v) >= 0) {
        *out = (int64_t)json_integer_value(v);
        return 0;
    }
    if (json_is_real(v) && json_real_value(v) >= 0 && json_real_value(v) < 1e15) {
        *out = (int64_t)json_real_value(v);
        return 0;
    }
    if (json_is_string(v) && parse_iso_time(json_string_value(v), out) == 0)
        return 0;
    snprintf(err, errlen, "\"ts\" must be unix seconds or an ISO 8601 time such as \"2026-02-03T10:00:00Z\"");
    return -1;
}

/* The whole file at path, NUL-terminated, in *buf (malloc'd). 0, or -1 with err. */
static int read_whole(const char *path, char **buf, size_t *len, char *err, size_t errlen)
{
    char *b = NULL;
    size_t n = 0, cap = 0, got;
    int rc = -1;
    FILE *f = fopen(path, "rb");
    if (!f) {
        snprintf(err, errlen, "%s", strerror(errno));
        return -1;
    }
    errno = 0;
    do {
        if (cap - n < 2) { /* room for a byte more and the NUL */
            char *grown = cap < REPLAY_MAX_FILE ? cg_realloc(b, cap ? cap * 2 : 65536) : NULL;
            if (!grown) {
                if (cap < REPLAY_MAX_FILE)
                    snprintf(err, errlen, "out of memory");
                else
                    snprintf(err, errlen, "more than %zu bytes: too large for a transcript", REPLAY_MAX_FILE);
                goto done;
            }
            b = grown;
            cap = cap ? cap * 2 : 65536;
        }
        got = fread(b + n, 1, cap - n - 1, f);
        n += got;
    } while (got > 0);
    if (ferror(f)) { /* a directory opens, then reads as an error (EISDIR) */
        snprintf(err, errlen, "%s", strerror(errno ? errno : EIO));
        goto done;
    }
    b[n] = 0;
    *buf = b;
    *len = n;
    b = NULL;
    rc = 0;
done:
    free(b);
    fclose(f);
    return rc;
}

/* The index of the dialog id in t (added when new), or -1 out of memory. */
static long dialog_index(replay_transcript *t, const char *id)
{
    json_t *known = json_object_get(t->index, id);
    if (known)
        return (long)json_integer_value(known);
    size_t i = json_array_size(t->ids);
    if (json_array_append_new(t->ids, json_string(id)) < 0 ||
        json_object_set_new(t->index, id, json_integer((json_int_t)i)) < 0)
        return -1;
    return (long)i;
}

/* Room for one more line in t; NULL out of memory. */
static replay_line *new_line(replay_transcript *t)
{
    if (t->n_lines == t->cap) {
        size_t cap = t->cap ? t->cap * 2 : 64;
        replay_line *grown = cg_realloc(t->lines, cap * sizeof(*grown));
        t->lines = grown;
        t->cap = cap;
    }
    replay_line *l = &t->lines[t->n_lines++];
    memset(l, 0, sizeof(*l));
    return l;
}

/* Refuses a key a JSON line may not have: a typo ("txt", "time") would otherwise go unseen. */
static int check_keys(json_t *o, char *err, size_t errlen)
{
    static const char *const known[] = {"dialog", "role", "text", "ts", "state", "upstream"};
    const char *key;
    json_t *v;
    json_object_foreach(o, key, v) {
        size_t i = 0;
        while (i < sizeof(known) / sizeof(known[0]) && strcmp(key, known[i]) != 0)
            i++;
        if (i == sizeof(known) / sizeof(known[0])) {
            snprintf(err, errlen,
                     "unknown key \"%.64s\" (dialog, role, text, ts; state and upstream on assistant lines)", key);
            return -1;
        }
    }
    return 0;
}

/* One JSON line's object into l (its dialog set by the caller). 0, or -1 with err. */
static int read_line_object(json_t *o, replay_line *l, char *err, size_t errlen)
{
    if (check_keys(o, err, errlen) < 0)
        return -1;
    json_t *role = json_object_get(o, "role"), *text = json_object_get(o, "text");
    json_t *ts = json_object_get(o, "ts"), *state = json_object_get(o, "state");
    json_t *upstream = json_object_get(o, "upstream");
    if (role && !(json_is_string(role) && (strcmp(json_string_value(role), "user") == 0 ||
                                           strcmp(json_string_value(role), "assistant") == 0))) {
        snprintf(err, errlen, "\"role\" must be \"user\" (the default) or \"assistant\"");
        return -1;
    }
    l->assistant = role && strcmp(json_string_value(role), "assistant") == 0;
    if (!json_is_string(text) || (!l->assistant && json_string_length(text) == 0)) {
        snprintf(err, errlen, "\"text\" must be a string: the %s", l->assistant ? "reply" : "message (not empty)");
        return -1;
    }
    l->text = json_string_value(text);
    if (ts && read_ts(ts, &l->ts, err, errlen) < 0)
        return -1;
    l->has_ts = ts != NULL;
    if ((state || upstream) && !l->assistant) {
        snprintf(err, errlen, "\"state\" and \"upstream\" belong to assistant lines (\"role\": \"assistant\")");
        return -1;
    }
    if (state && !json_is_object(state)) {
        snprintf(err, errlen, "\"state\" must be an object: a state directive (docs/state.md)");
        return -1;
    }
    if (upstream && (!json_is_string(upstream) || json_string_length(upstream) == 0)) {
        snprintf(err, errlen, "\"upstream\" must be the name of the upstream that answered");
        return -1;
    }
    l->state = state;
    l->upstream = upstream ? json_string_value(upstream) : REPLAY_DEFAULT;
    return 0;
}

/* A JSON lines transcript: buf holds the file (NUL-terminated, len bytes). 0, or -1 with
 * err and *line set to the bad line. */
static int load_lines(replay_transcript *t, const char *buf, size_t len, int *line, char *err, size_t errlen)
{
    const char *p = buf, *end = buf + len;
    *line = 0;
    if (!(t->json = json_array()))
        goto oom;
    while (p < end) {
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        size_t n = nl ? (size_t)(nl - p) : (size_t)(end - p);
        const char *s = p;
        p += n + 1;
        ++*line;
        while (n > 0 && isspace((unsigned char)s[n - 1]))
            n--;
        while (n > 0 && isspace((unsigned char)*s))
            s++, n--;
        if (n == 0)
            continue; /* blank lines are allowed: they separate dialogs for a reader */
        json_error_t jerr;
        json_t *o = json_loadb(s, n, JSON_REJECT_DUPLICATES, &jerr);
        if (!json_is_object(o)) {
            if (o)
                snprintf(err, errlen, "a line must be a JSON object: {\"dialog\": ..., \"text\": ...}");
            else
                snprintf(err, errlen, "not JSON: %s (column %d)", jerr.text, jerr.column);
            json_decref(o);
            return -1;
        }
        replay_line *l = json_array_append_new(t->json, o) < 0 ? NULL : new_line(t);
        if (!l)
            goto oom;
        l->line = *line;
        if (read_line_object(o, l, err, errlen) < 0)
            return -1;
        json_t *id = json_object_get(o, "dialog");
        if (!json_is_string(id) || json_string_length(id) == 0) {
            snprintf(err, errlen, "\"dialog\" must be a string, the dialog's id");
            return -1;
        }
        long d = dialog_index(t, json_string_value(id));
        if (d < 0)
            goto oom;
        l->dialog = (size_t)d;
    }
    return 0;
oom:
    snprintf(err, errlen, "out of memory");
    return -1;
}

/* Is doc the admin API's export of a dialog ({"user","room",...,"state":{..."history":[...]}})
 * rather than a one-line transcript? A line has "dialog" and "text"; an export neither. */
static int is_export(json_t *doc)
{
    return json_is_object(doc) && !json_object_get(doc, "text") && !json_object_get(doc, "dialog") &&
           json_is_object(json_object_get(doc, "state"));
}

/*
 * The admin export (admin.c, the context frame's state of cg_dialog_context): its history's
 * messages become one dialog's lines, in order, at their "ts". The dialog is "USER/ROOM".
 * The history's "enriched" marks are left out: the rules being replayed make their own.
 * 0, or -1 with err and *item the bad history entry (-1: the document itself).
 */
static int load_export(replay_transcript *t, json_t *doc, long *item, char *err, size_t errlen)
{
    t->json = json_incref(doc);
    *item = -1;
    json_t *history = json_object_get(json_object_get(doc, "state"), "history");
    const char *user = json_string_value(json_object_get(doc, "user"));
    const char *room = json_string_value(json_object_get(doc, "room"));
    if (!json_is_array(history)) {
        snprintf(err, errlen, "an admin export's state has no \"history\" array");
        return -1;
    }
    /* the dialog's id, "USER/ROOM", as the admin path names it */
    json_t *id = json_sprintf("%s/%s", user ? user : "?", room ? room : "?");
    long added = id ? dialog_index(t, json_string_value(id)) : -1;
    json_decref(id);
    if (added < 0) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    size_t i;
    json_t *m;
    json_array_foreach(history, i, m) {
        *item = (long)i;
        const char *role = json_string_value(json_object_get(m, "role"));
        json_t *content = json_object_get(m, "content"), *ts = json_object_get(m, "ts");
        if (!role || (strcmp(role, "user") != 0 && strcmp(role, "assistant") != 0) || !json_is_string(content)) {
            snprintf(err, errlen, "a history entry must be {\"role\": \"user\" or \"assistant\", \"content\", \"ts\"}");
            return -1;
        }
        replay_line *l = new_line(t);
        if (!l) {
            snprintf(err, errlen, "out of memory");
            return -1;
        }
        l->item = i;
        l->assistant = strcmp(role, "assistant") == 0;
        l->text = json_string_value(content);
        l->upstream = REPLAY_DEFAULT;
        if (ts && read_ts(ts, &l->ts, err, errlen) < 0)
            return -1;
        l->has_ts = ts != NULL;
    }
    return 0;
}

static void transcript_free(replay_transcript *t)
{
    json_decref(t->json);
    json_decref(t->ids);
    json_decref(t->index);
    free(t->lines);
    memset(t, 0, sizeof(*t));
}

/* Reads and checks the transcript at path into t; on a mistake says "path:line: message"
 * on errf and returns -1 (t is then freed). */
static int transcript_load(replay_transcript *t, const char *path, FILE *errf)
{
    char err[512], *buf = NULL;
    size_t len = 0;
    int line = 0, rc = -1;
    long item = -1;
    json_t *doc = NULL;
    memset(t, 0, sizeof(*t));
    t->path = path;
    t->ids = json_array();
    t->index = json_object();
    if (!t->ids || !t->index) {
        fprintf(errf, "%s: out of memory\n", path);
        goto done;
    }
    if (read_whole(path, &buf, &len, err, sizeof(err)) < 0) {
        fprintf(errf, "%s: %s\n", path, err);
        goto done;
    }
    /* the whole file as one document: an export (one line of JSON lines parses too) */
    doc = json_loadb(buf, len, JSON_REJECT_DUPLICATES, NULL);
    if (is_export(doc)) {
        if (load_export(t, doc, &item, err, sizeof(err)) < 0) {
            if (item >= 0)
                fprintf(errf, "%s: history[%ld]: %s\n", path, item, err);
            else
                fprintf(errf, "%s: %s\n", path, err);
            goto done;
        }
    } else if (load_lines(t, buf, len, &line, err, sizeof(err)) < 0) {
        fprintf(errf, "%s:%d: %s\n", path, line, err);
        goto done;
    }
    rc = 0;
done:
    json_decref(doc);
    free(buf);
    if (rc < 0)
        transcript_free(t);
    return rc;
}

/* ---- replaying ------------------------------------------------------------------------ */

/* The index of the upstream name, added to our configuration when new (so the pipeline
 * routes to it and the route reads as its name); the default when the table is full. */
static int upstream_named(replay_ctx *c, const char *name)
{
    cg_config *cfg = c->cfg;
    for (int i = 0; i < cfg->n_upstreams; i++)
        if (strcmp(cfg->upstreams[i].name, name) == 0)
            return i;
    if (cfg->n_upstreams == CG_MAX_UPSTREAMS)
        return cfg->default_index;
    cfg->upstreams[cfg->n_upstreams].name = cg_strdup(name);
    return cfg->n_upstreams++;
}

/* d as the store would give it back at now, saved last at saved: the parts whose lifetime
 * ran out are gone (cg_dialog_lapse, the memory store's rule), or the whole dialog. */
static void dialog_reload(cg_dialog *d, int64_t saved, int64_t now, const cg_lifetimes *lt)
{
    if (saved + lt->dialog_s <= now) {
        cg_dialog_free(d);
        cg_dialog_init(d, now);
        return;
    }
    cg_dialog_lapse(d, now, saved + lt->params_s, saved + lt->history_s);
}

/* Makes sure the upstream a route rule would name is in our configuration before the
 * pipeline runs: the rules are evaluated once more for it, as `rules explain` does. */
static void note_route(replay_ctx *c, const cg_ruleset *rs, const cg_dialog *d, const char *text, int64_t now)
{
    cg_rules_result rr;
    cg_rules_eval(rs, text, d, cg_pipeline_previous(d), now, &rr);
    if (rr.route[0])
        upstream_named(c, rr.route);
    cg_rules_result_free(&rr);
}

/* One user message through one rule set, as the gateway's turn does it live (the same
 * cg_pipeline_begin and cg_pipeline_keep_user): counted, decided, kept in the history with
 * its rewrite. Its outcome (cg_pipeline_outcome), or NULL out of memory. */
static json_t *run_turn(replay_ctx *c, const cg_ruleset *rs, cg_dialog *d, const char *text, int64_t now)
{
    note_route(c, rs, d, text, now);
    cg_pipeline_result res;
    cg_pipeline_begin(c->cfg, rs, d, text, now, &c->lt, &res);
    json_t *outcome = cg_pipeline_outcome(c->cfg, d, &res);
    cg_pipeline_keep_user(d, text, res.enriched, now, &c->lt);
    if (!res.error)
        d->turn_count++;
    cg_pipeline_result_free(&res);
    return outcome;
}

/* Where line l is, for messages: "file:7", or "file history[3]" in an export. */
static void print_where(FILE *out, const replay_transcript *t, const replay_line *l)
{
    if (l->line)
        fprintf(out, "%s:%d", t->path, l->line);
    else
        fprintf(out, "%s history[%zu]", t->path, l->item);
}

/* text as a JSON string, cut at REPLAY_CUT bytes (on a character boundary) and then said so. */
static void print_text(FILE *out, const char *text)
{
    size_t len = strlen(text), n = len > REPLAY_CUT ? cg_utf8_boundary(text, REPLAY_CUT) : len;
    json_t *s = json_stringn(text, n);
    char *quoted = s ? json_dumps(s, JSON_ENCODE_ANY) : NULL;
    fputs(quoted ? quoted : "\"?\"", out);
    if (n < len)
        fprintf(out, " [cut, %zu bytes]", len);
    free(quoted);
    json_decref(s);
}

/* A dialog id as written, or quoted when it holds spaces or quotes (or is long). */
static void print_id(FILE *out, const char *id)
{
    const char *p = id;
    while (*p && (unsigned char)*p > ' ' && *p != '"')
        p++;
    if (*p || p - id > REPLAY_CUT)
        print_text(out, id);
    else
        fputs(id, out);
}

/* One field of an outcome: rules as [a, b], the route as its name, the enriched text cut,
 * the rest as compact JSON with sorted keys (params in a stable order to compare by eye). */
static void print_value(FILE *out, const char *field, json_t *v)
{
    if (strcmp(field, "rules") == 0) {
        size_t i;
        json_t *name;
        fputc('[', out);
        json_array_foreach(v, i, name) fprintf(out, "%s%s", i ? ", " : "", json_string_value(name));
        fputc(']', out);
    } else if (strcmp(field, "route") == 0) {
        fputs(json_string_value(v), out);
    } else if (strcmp(field, "enriched") == 0 && json_is_string(v)) {
        print_text(out, json_string_value(v));
    } else {
        char *s = json_dumps(v, JSON_ENCODE_ANY | JSON_COMPACT | JSON_SORT_KEYS);
        fputs(s ? s : "?", out);
        free(s);
    }
}

/* The block of a turn that differs: where, which dialog and turn, the text, then each
 * field that differs, old then new. */
static void print_difference(FILE *out, const replay_transcript *t, const replay_line *l, const replay_dialog *rd,
                             json_t *outcome[2])
{
    print_where(out, t, l);
    fputs(" dialog ", out);
    print_id(out, json_string_value(json_array_get(t->ids, l->dialog)));
    fprintf(out, " turn %ld ", rd->turns);
    print_text(out, l->text);
    fputc('\n', out);
    unsigned differs = cg_pipeline_outcome_diff(outcome[0], outcome[1]);
    for (int i = 0; i < CG_OUTCOME_FIELDS; i++) {
        if (!(differs & (1u << i)))
            continue;
        const char *field = cg_outcome_names[i];
        fprintf(out, "  %s:%*s old ", field, (int)(12 - strlen(field)), "");
        print_value(out, field, json_object_get(outcome[0], field));
        fputs(" new ", out);
        print_value(out, field, json_object_get(outcome[1], field));
        fputc('\n', out);
    }
}

/* A user line: the turn on both sides, compared. 0, or -1 out of memory. */
static int user_line(replay_ctx *c, const replay_transcript *t, const replay_line *l, replay_dialog *rd, int64_t now)
{
    json_t *outcome[2] = {NULL, NULL};
    int rc = -1;
    rd->turns++;
    c->totals.turns++;
    for (int k = 0; k < 2; k++)
        if (!(outcome[k] = run_turn(c, c->rules[k], &rd->side[k], l->text, now)))
            goto done;
    if (cg_pipeline_outcome_diff(outcome[0], outcome[1])) {
        c->totals.differing++;
        print_difference(c->opt->out, t, l, rd, outcome);
    }
    rc = 0;
done:
    json_decref(outcome[0]);
    json_decref(outcome[1]);
    return rc;
}

/* An assistant line: its state directive, then the reply into the history, on both sides
 * alike. A directive the gateway would refuse is refused here too, and said. */
static void assistant_line(replay_ctx *c, const replay_transcript *t, const replay_line *l, replay_dialog *rd,
                           int64_t now)
{
    char err[2][256] = {"", ""};
    if (l->state)
        upstream_named(c, l->upstream); /* a resolution goes back to it: it needs an index */
    for (int k = 0; k < 2; k++) {
        cg_dialog *d = &rd->side[k];
        if (l->state && cg_dialog_apply_directive(d, l->state, l->upstream, now, &c->lt, err[k], sizeof(err[k])) >= 0)
            err[k][0] = 0;
        cg_dialog_push_history(d, "assistant", l->text, now, &c->lt);
        d->last_activity = now;
    }
    /* said once when both sides refuse it alike (a mistake in the directive itself) */
    for (int k = 0; k < 2; k++) {
        if (!err[k][0] || (k == 1 && strcmp(err[0], err[1]) == 0))
            continue;
        print_where(c->opt->err, t, l);
        fprintf(c->opt->err, ": the state directive is refused (%s), as the gateway would: %s\n",
                strcmp(err[0], err[1]) == 0 ? "old and new rules" : k ? "new rules" : "old rules", err[k]);
    }
}

/* Every line of t in file order, each on its dialog's two states. 0, or -1 out of memory. */
static int replay_transcript_run(replay_ctx *c, const replay_transcript *t)
{
    size_t n = json_array_size(t->ids);
    replay_dialog *dialogs = cg_calloc(n ? n : 1, sizeof(*dialogs));
    int rc = -1;
    for (size_t i = 0; i < t->n_lines; i++) {
        const replay_line *l = &t->lines[i];
        replay_dialog *rd = &dialogs[l->dialog];
        /* a line without a time comes when its dialog's previous line did */
        int64_t now = l->has_ts ? l->ts : rd->started ? rd->clock : c->opt->start;
        if (!rd->started) {
            cg_dialog_init(&rd->side[0], now);
            cg_dialog_init(&rd->side[1], now);
            rd->started = 1;
        } else if (!l->assistant) { /* a reply belongs to its message's turn: no reload between */
            dialog_reload(&rd->side[0], rd->clock, now, &c->lt);
            dialog_reload(&rd->side[1], rd->clock, now, &c->lt);
        }
        rd->clock = now;
        if (l->assistant)
            assistant_line(c, t, l, rd, now);
        else if (user_line(c, t, l, rd, now) < 0)
            goto done;
    }
    rc = 0;
done:
    for (size_t i = 0; i < n; i++)
        if (dialogs[i].started) {
            cg_dialog_free(&dialogs[i].side[0]);
            cg_dialog_free(&dialogs[i].side[1]);
        }
    free(dialogs);
    return rc;
}

static const char *plural(long n)
{
    return n == 1 ? "" : "s";
}

int cg_replay_run(const cg_replay_options *opt, char *const *paths, int n_paths, cg_replay_totals *totals)
{
    replay_ctx c = {.opt = opt, .rules = {opt->old_rules, opt->new_rules}};
    replay_transcript *ts = cg_calloc(n_paths > 0 ? (size_t)n_paths : 1, sizeof(*ts));
    int loaded = 0, rc = CG_REPLAY_BAD_INPUT;
    cg_lifetimes_default(&c.lt);
    c.cfg = cg_calloc(1, sizeof(*c.cfg));
    c.cfg->upstreams[0].name = cg_strdup(REPLAY_DEFAULT);
    c.cfg->n_upstreams = 1; /* the default upstream, index 0 */
    /* all read and checked first: a bad line anywhere stops the replay before it prints */
    for (; loaded < n_paths; loaded++)
        if (transcript_load(&ts[loaded], paths[loaded], opt->err) < 0)
            goto done;
    for (int i = 0; i < n_paths; i++) {
        if (replay_transcript_run(&c, &ts[i]) < 0) {
            fprintf(opt->err, "%s: out of memory\n", paths[i]);
            goto done;
        }
        c.totals.transcripts++;
        c.totals.dialogs += (long)json_array_size(ts[i].ids);
    }
    fprintf(opt->out, "replay: %ld transcript%s, %ld dialog%s, %ld turn%s, %ld differing\n", c.totals.transcripts,
            plural(c.totals.transcripts), c.totals.dialogs, plural(c.totals.dialogs), c.totals.turns,
            plural(c.totals.turns), c.totals.differing);
    rc = c.totals.differing ? CG_REPLAY_DIFFERENT : CG_REPLAY_SAME;
done:
    for (int i = 0; i < loaded; i++)
        transcript_free(&ts[i]);
    free(ts);
    for (int i = 0; c.cfg && i < CG_MAX_UPSTREAMS; i++) /* names we set; the rest NULL */
        free(c.cfg->upstreams[i].name);
    free(c.cfg);
    if (totals)
        *totals = c.totals;
    return rc;
}
