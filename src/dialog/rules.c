/*
 * rules.c: loading, compiling and evaluating rule files (see rules.h and rules/README.md).
 *
 * Loading reads every *.rules file of a directory in file-name order; a rule runs from its
 * `rule NAME` line to the next one. Any mistake stops the load with "file:line: message"
 * (a bad pattern adds PCRE2's text and the offset in the pattern), so a broken set never
 * replaces a working one. Evaluating runs every rule whose `when` conditions hold against
 * the message, bounded by the match limit and JIT stack of the set's match context.
 */
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "chatgate/core/utf8.h"
#include "chatgate/core/log.h"
#include "chatgate/dialog/rules.h"

typedef enum {
    A_CANCEL,
    A_CANCEL_ABSORB,
    A_CONFIRM_YES,
    A_CONFIRM_NO,
    A_METADATA,
    A_PARAMS,
    A_FORGET,
    A_ENRICH,
    A_ROUTE,
} rule_action;

typedef enum { C_AWAITING, C_NO_AWAITING, C_SERVICE, C_HAS, C_HISTORY } cond_kind;
typedef enum { N_DATE, N_INT, N_AMOUNT, N_LOWER } normaliser;

typedef struct rule_cond {
    cond_kind kind;
    char arg[129];
} rule_cond;

typedef struct rule_type {
    char group[64];
    normaliser norm;
} rule_type;

typedef struct rule_test {
    int line;
    int reject;
    char *text;
    json_t *want; /* name -> expected value as text */
} rule_test;

#define MAX_CONDS 8
#define MAX_TYPES 8
#define MAX_TESTS 32

typedef struct rule {
    char name[65];
    const char *file; /* owned by the set's file list */
    int line;
    char *pattern;
    int pattern_line;
    pcre2_code *re;
    int has_do;
    rule_action action;
    char arg[512];
    int case_sensitive;
    rule_cond conds[MAX_CONDS];
    int n_conds;
    rule_type types[MAX_TYPES];
    int n_types;
    rule_test tests[MAX_TESTS];
    int n_tests;
} rule;

struct cg_ruleset {
    int refs;
    rule *rules;
    size_t n, cap;
    char **files;
    size_t n_files;
    pcre2_match_context *mctx;
    pcre2_jit_stack *jit;
    pcre2_match_data *md;
};

/* The clock of `expect` lines that name dates: 2026-02-03T10:00:00Z (README). */

/* ---- the set ---------------------------------------------------------------------------- */

static void rule_free(rule *r)
{
    free(r->pattern);
    pcre2_code_free(r->re);
    for (int i = 0; i < r->n_tests; i++) {
        free(r->tests[i].text);
        json_decref(r->tests[i].want);
    }
}

static void ruleset_free(cg_ruleset *rs)
{
    for (size_t i = 0; i < rs->n; i++)
        rule_free(&rs->rules[i]);
    free(rs->rules);
    for (size_t i = 0; i < rs->n_files; i++)
        free(rs->files[i]);
    free(rs->files);
    pcre2_match_data_free(rs->md);
    pcre2_jit_stack_free(rs->jit);
    pcre2_match_context_free(rs->mctx);
    free(rs);
}

cg_ruleset *cg_ruleset_ref(cg_ruleset *rs)
{
    if (rs)
        rs->refs++;
    return rs;
}

void cg_ruleset_unref(cg_ruleset *rs)
{
    if (rs && --rs->refs == 0)
        ruleset_free(rs);
}

size_t cg_ruleset_count(const cg_ruleset *rs)
{
    return rs ? rs->n : 0;
}

/* ---- parsing ---------------------------------------------------------------------------- */

typedef struct parse_ctx {
    cg_ruleset *rs;
    const char *file; /* the path, for messages */
    int line;
    char *err;
    size_t errlen;
} parse_ctx;

static int perr(parse_ctx *p, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int perr(parse_ctx *p, const char *fmt, ...)
{
    int n = snprintf(p->err, p->errlen, "%s:%d: ", p->file, p->line);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(p->err + n, p->errlen - (size_t)n, fmt, ap);
    va_end(ap);
    return -1;
}

static char *trim(char *s)
{
    while (*s == ' ' || *s == '\t')
        s++;
    size_t n = strlen(s);
    while (n > 0 && (s[n - 1] == ' ' || s[n - 1] == '\t' || s[n - 1] == '\r' || s[n - 1] == '\n'))
        s[--n] = 0;
    return s;
}

/* Splits "word rest" into the first word and the trimmed rest. */
static char *split_word(char *s, char **rest)
{
    char *end = s + strcspn(s, " \t");
    if (*end) {
        *end = 0;
        *rest = trim(end + 1);
    } else {
        *rest = end;
    }
    return s;
}

static int valid_name(const char *s, size_t max)
{
    size_t n = strlen(s);
    if (n == 0 || n > max)
        return 0;
    for (; *s; s++)
        if (!isalnum((unsigned char)*s) && *s != '_' && *s != '-' && *s != '.')
            return 0;
    return 1;
}

/* Reads a double-quoted string at *s (\" and \\ escape); advances *s past it. */
static char *read_quoted(char **s)
{
    char *p = *s;
    if (*p != '"')
        return NULL;
    p++;
    char *out = malloc(strlen(p) + 1), *o = out;
    while (*p && *p != '"') {
        if (*p == '\\' && (p[1] == '"' || p[1] == '\\'))
            p++;
        *o++ = *p++;
    }
    if (*p != '"') {
        free(out);
        return NULL;
    }
    *o = 0;
    *s = p + 1;
    return out;
}

/* expect "text" name=value name="two words" ... / reject "text" */
static int parse_test(parse_ctx *p, rule *r, char *rest, int reject)
{
    if (r->n_tests == MAX_TESTS)
        return perr(p, "more than %d expect/reject lines in rule '%s'", MAX_TESTS, r->name);
    rule_test *t = &r->tests[r->n_tests];
    char *s = rest;
    t->text = read_quoted(&s);
    if (!t->text)
        return perr(p, "%s needs a double-quoted text: %s \"...\"", reject ? "reject" : "expect",
                    reject ? "reject" : "expect");
    t->line = p->line;
    t->reject = reject;
    t->want = json_object();
    r->n_tests++;
    for (s = trim(s); *s; s = trim(s)) {
        if (reject)
            return perr(p, "reject takes only the text");
        char *eq = strchr(s, '=');
        if (!eq || eq == s)
            return perr(p, "after the text, expect takes name=value pairs, not '%.40s'", s);
        *eq = 0;
        char *name = s;
        s = eq + 1;
        char *value;
        if (*s == '"') {
            value = read_quoted(&s);
            if (!value)
                return perr(p, "unterminated quoted value of '%s'", name);
        } else {
            size_t n = strcspn(s, " \t");
            value = strndup(s, n);
            s += n;
        }
        json_object_set_new(t->want, name, json_string(value));
        free(value);
    }
    return 0;
}

static int parse_do(parse_ctx *p, rule *r, char *rest)
{
    char *arg;
    char *verb = split_word(rest, &arg);
    static const struct { const char *verb; rule_action action; int needs_arg; } verbs[] = {
        {"cancel", A_CANCEL, 0}, {"confirm", A_CONFIRM_YES, 1}, {"metadata", A_METADATA, 1},
        {"params", A_PARAMS, 1}, {"forget", A_FORGET, 1},       {"enrich", A_ENRICH, 1},
        {"route", A_ROUTE, 1},
    };
    size_t i = 0;
    while (i < sizeof(verbs) / sizeof(verbs[0]) && strcmp(verbs[i].verb, verb) != 0)
        i++;
    if (i == sizeof(verbs) / sizeof(verbs[0]))
        return perr(p, "unknown action '%s' (cancel, confirm, metadata, params, forget, enrich, route)", verb);
    if (r->has_do)
        return perr(p, "rule '%s' has a second 'do' line; one action per rule", r->name);
    r->has_do = 1;
    r->action = verbs[i].action;
    if (verbs[i].needs_arg && !*arg)
        return perr(p, "'do %s' needs an argument", verb);
    if (strlen(arg) >= sizeof(r->arg))
        return perr(p, "the argument of 'do %s' is over %zu bytes", verb, sizeof(r->arg) - 1);
    snprintf(r->arg, sizeof(r->arg), "%s", arg);
    switch (r->action) {
    case A_CANCEL:
        if (strcmp(arg, "absorb") == 0)
            r->action = A_CANCEL_ABSORB;
        else if (*arg)
            return perr(p, "'do cancel' takes nothing or 'absorb', not '%s'", arg);
        break;
    case A_CONFIRM_YES:
        if (strcmp(arg, "no") == 0)
            r->action = A_CONFIRM_NO;
        else if (strcmp(arg, "yes") != 0)
            return perr(p, "'do confirm' takes yes or no, not '%s'", arg);
        break;
    case A_METADATA:
    case A_PARAMS:
    case A_ROUTE:
        if (!valid_name(arg, 64))
            return perr(p, "'%s' is not a name (letters, digits, _ . -; at most 64)", arg);
        break;
    case A_FORGET:
        if (!valid_name(arg, 128))
            return perr(p, "'%s' is not a param name (name or service.name)", arg);
        break;
    default:
        break;
    }
    return 0;
}

static int parse_when(parse_ctx *p, rule *r, char *rest)
{
    if (r->n_conds == MAX_CONDS)
        return perr(p, "more than %d 'when' lines in rule '%s'", MAX_CONDS, r->name);
    char *arg;
    char *what = split_word(rest, &arg);
    rule_cond *c = &r->conds[r->n_conds];
    if (strcmp(what, "awaiting") == 0) {
        static const char *const types[] = {"selection", "confirmation", "metadata", "input", "any"};
        int ok = 0;
        for (int i = 0; i < 5; i++)
            ok |= strcmp(arg, types[i]) == 0;
        if (!ok)
            return perr(p, "'when awaiting' takes selection, confirmation, metadata, input or any, not '%s'", arg);
        c->kind = C_AWAITING;
    } else if (strcmp(what, "no") == 0 && strcmp(arg, "awaiting") == 0) {
        c->kind = C_NO_AWAITING;
        arg = "";
    } else if (strcmp(what, "service") == 0) {
        c->kind = C_SERVICE;
    } else if (strcmp(what, "has") == 0) {
        c->kind = C_HAS;
    } else if (strcmp(what, "history") == 0 && !*arg) {
        c->kind = C_HISTORY;
    } else {
        return perr(p, "unknown condition 'when %s' (awaiting TYPE, no awaiting, service NAME, has PARAM, history)",
                    what);
    }
    if ((c->kind == C_SERVICE || c->kind == C_HAS) && !valid_name(arg, 128))
        return perr(p, "'when %s' needs a name, not '%s'", what, arg);
    snprintf(c->arg, sizeof(c->arg), "%s", arg);
    r->n_conds++;
    return 0;
}

static int parse_type(parse_ctx *p, rule *r, char *rest)
{
    char *norm;
    char *group = split_word(rest, &norm);
    if (r->n_types == MAX_TYPES)
        return perr(p, "more than %d 'type' lines in rule '%s'", MAX_TYPES, r->name);
    if (!valid_name(group, 63))
        return perr(p, "'type' needs a group name, then date, int, amount or lower");
    rule_type *t = &r->types[r->n_types];
    if (strcmp(norm, "date") == 0)
        t->norm = N_DATE;
    else if (strcmp(norm, "int") == 0)
        t->norm = N_INT;
    else if (strcmp(norm, "amount") == 0)
        t->norm = N_AMOUNT;
    else if (strcmp(norm, "lower") == 0)
        t->norm = N_LOWER;
    else
        return perr(p, "unknown normaliser '%s' (date, int, amount, lower)", norm);
    snprintf(t->group, sizeof(t->group), "%s", group);
    r->n_types++;
    return 0;
}

/* Compiles a rule's pattern; a PCRE2 error names the offset in the pattern. */
static int compile_rule(parse_ctx *p, rule *r)
{
    uint32_t opts = PCRE2_UTF | PCRE2_UCP | PCRE2_DUPNAMES | (r->case_sensitive ? 0 : PCRE2_CASELESS);
    int code;
    PCRE2_SIZE off;
    r->re = pcre2_compile((PCRE2_SPTR)r->pattern, PCRE2_ZERO_TERMINATED, opts, &code, &off, NULL);
    if (!r->re) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(code, msg, sizeof(msg));
        p->line = r->pattern_line;
        return perr(p, "rule '%s': bad pattern: %s at offset %zu of: %s", r->name, (char *)msg, (size_t)off,
                    r->pattern);
    }
    pcre2_jit_compile(r->re, PCRE2_JIT_COMPLETE); /* without JIT (unsupported CPU) it still runs */
    /* a `type` must name a group of the pattern */
    for (int i = 0; i < r->n_types; i++)
        if (pcre2_substring_number_from_name(r->re, (PCRE2_SPTR)r->types[i].group) == PCRE2_ERROR_NOSUBSTRING) {
            p->line = r->line;
            return perr(p, "rule '%s': 'type %s': the pattern has no group (?<%s>...)", r->name, r->types[i].group,
                        r->types[i].group);
        }
    return 0;
}

/* A rule is complete: it has a pattern and an action. */
static int finish_rule(parse_ctx *p, rule *r)
{
    int line = p->line;
    p->line = r->line;
    if (!r->pattern)
        return perr(p, "rule '%s' has no 'match' line", r->name);
    if (!r->has_do)
        return perr(p, "rule '%s' has no 'do' line", r->name);
    if (r->n_types && r->action != A_PARAMS)
        return perr(p, "rule '%s': 'type' lines are for 'do params' rules", r->name);
    p->line = line;
    return compile_rule(p, r);
}

static rule *new_rule(parse_ctx *p, const char *name)
{
    cg_ruleset *rs = p->rs;
    for (size_t i = 0; i < rs->n; i++)
        if (strcmp(rs->rules[i].name, name) == 0) {
            perr(p, "rule '%s' is defined twice (first at %s:%d)", name, rs->rules[i].file, rs->rules[i].line);
            return NULL;
        }
    if (rs->n == rs->cap) {
        size_t ncap = rs->cap ? rs->cap * 2 : 64;
        rule *nr = realloc(rs->rules, ncap * sizeof(rule));
        if (!nr)
            abort();
        rs->rules = nr;
        rs->cap = ncap;
    }
    rule *r = &rs->rules[rs->n++];
    memset(r, 0, sizeof(*r));
    snprintf(r->name, sizeof(r->name), "%s", name);
    r->file = p->file;
    r->line = p->line;
    return r;
}

static int parse_file(parse_ctx *p, FILE *f)
{
    char buf[8192];
    rule *r = NULL;
    p->line = 0;
    while (fgets(buf, sizeof(buf), f)) {
        p->line++;
        if (!strchr(buf, '\n') && !feof(f))
            return perr(p, "line over %zu bytes", sizeof(buf) - 2);
        char *line = trim(buf);
        if (!*line || *line == '#')
            continue;
        char *rest;
        char *kw = split_word(line, &rest);
        if (strcmp(kw, "rule") == 0) {
            if (r && finish_rule(p, r) < 0)
                return -1;
            if (!valid_name(rest, 64))
                return perr(p, "'rule' needs a name of letters, digits, _ . - (at most 64), not '%s'", rest);
            if (!(r = new_rule(p, rest)))
                return -1;
            continue;
        }
        if (!r)
            return perr(p, "'%s' outside a rule: a rule starts with 'rule NAME'", kw);
        int rc = 0;
        if (strcmp(kw, "match") == 0) {
            if (r->pattern)
                return perr(p, "rule '%s' has a second 'match' line; one pattern per rule (use | inside it)",
                            r->name);
            if (!*rest)
                return perr(p, "'match' needs a pattern");
            r->pattern = strdup(rest);
            r->pattern_line = p->line;
        } else if (strcmp(kw, "do") == 0) {
            rc = parse_do(p, r, rest);
        } else if (strcmp(kw, "when") == 0) {
            rc = parse_when(p, r, rest);
        } else if (strcmp(kw, "type") == 0) {
            rc = parse_type(p, r, rest);
        } else if (strcmp(kw, "option") == 0) {
            if (strcmp(rest, "case") != 0)
                return perr(p, "unknown option '%s' (case)", rest);
            r->case_sensitive = 1;
        } else if (strcmp(kw, "expect") == 0 || strcmp(kw, "reject") == 0) {
            rc = parse_test(p, r, rest, kw[0] == 'r');
        } else {
            return perr(p, "unknown keyword '%s' (rule, match, do, when, type, option, expect, reject)", kw);
        }
        if (rc < 0)
            return -1;
    }
    if (ferror(f))
        return perr(p, "read error: %s", strerror(errno));
    return r ? finish_rule(p, r) : 0;
}

static cg_ruleset *ruleset_finish(cg_ruleset *rs);

static int is_rules_file(const struct dirent *e)
{
    size_t n = strlen(e->d_name);
    return e->d_name[0] != '.' && n > 6 && strcmp(e->d_name + n - 6, ".rules") == 0;
}

int cg_rules_load(const char *dir, cg_ruleset **out, char *err, size_t errlen)
{
    struct dirent **names;
    int n = scandir(dir, &names, is_rules_file, alphasort);
    if (n < 0) {
        snprintf(err, errlen, "%s: %s", dir, strerror(errno));
        return -1;
    }
    cg_ruleset *rs = calloc(1, sizeof(*rs));
    rs->refs = 1;
    rs->files = calloc((size_t)n + 1, sizeof(char *));
    int rc = 0;
    for (int i = 0; i < n; i++) {
        char path[4096];
        snprintf(path, sizeof(path), "%s/%s", dir, names[i]->d_name);
        rs->files[rs->n_files++] = strdup(path);
        parse_ctx p = {.rs = rs, .file = rs->files[rs->n_files - 1], .err = err, .errlen = errlen};
        FILE *f = rc == 0 ? fopen(path, "r") : NULL;
        if (rc == 0 && !f) {
            snprintf(err, errlen, "%s: %s", path, strerror(errno));
            rc = -1;
        } else if (f) {
            rc = parse_file(&p, f);
            fclose(f);
        }
    }
    for (int i = 0; i < n; i++)
        free(names[i]);
    free(names);
    if (rc < 0) {
        ruleset_free(rs);
        return -1;
    }
    *out = ruleset_finish(rs);
    return 0;
}

int cg_rules_load_text(const char *name, const char *text, size_t len, cg_ruleset **out, char *err, size_t errlen)
{
    cg_ruleset *rs = calloc(1, sizeof(*rs));
    rs->refs = 1;
    rs->files = calloc(1, sizeof(char *));
    rs->files[rs->n_files++] = strdup(name);
    parse_ctx p = {.rs = rs, .file = rs->files[0], .err = err, .errlen = errlen};
    FILE *f = len ? fmemopen((void *)text, len, "r") : NULL;
    int rc = f ? parse_file(&p, f) : 0;
    if (f)
        fclose(f);
    if (rc < 0) {
        ruleset_free(rs);
        return -1;
    }
    *out = ruleset_finish(rs);
    return 0;
}

/* The match data and limits every evaluation of the set uses. */
static cg_ruleset *ruleset_finish(cg_ruleset *rs)
{
    uint32_t max_groups = 1;
    for (size_t i = 0; i < rs->n; i++) {
        uint32_t c = 0;
        pcre2_pattern_info(rs->rules[i].re, PCRE2_INFO_CAPTURECOUNT, &c);
        if (c + 1 > max_groups)
            max_groups = c + 1;
    }
    rs->md = pcre2_match_data_create(max_groups, NULL);
    rs->mctx = pcre2_match_context_create(NULL);
    pcre2_set_match_limit(rs->mctx, CG_RULES_MATCH_LIMIT);
    pcre2_set_depth_limit(rs->mctx, 1000); /* the interpreter's; the JIT ignores it (DESIGN.md section 7) */
    rs->jit = pcre2_jit_stack_create(32 * 1024, 512 * 1024, NULL);
    pcre2_jit_stack_assign(rs->mctx, NULL, rs->jit);
    return rs;
}

/* ---- normalisers ------------------------------------------------------------------------ */

static const char *const month_names[] = {"jan", "feb", "mar", "apr", "may", "jun",
                                          "jul", "aug", "sep", "oct", "nov", "dec"};

/* A month from a word of at least three letters ("feb", "february"); 1-12 or 0. */
static int month_of(const char *w, size_t n)
{
    static const char *const full[] = {"january", "february", "march",     "april",   "may",      "june",
                                       "july",    "august",   "september", "october", "november", "december"};
    if (n < 3)
        return 0;
    for (int m = 0; m < 12; m++)
        if (strncmp(w, month_names[m], 3) == 0 && n <= strlen(full[m]) && strncmp(w, full[m], n) == 0)
            return m + 1;
    if (n == 4 && strncmp(w, "sept", 4) == 0)
        return 9;
    return 0;
}

static void put_date(char out[11], int y, int m, int d)
{
    char tmp[48];
    snprintf(tmp, sizeof(tmp), "%04d-%02d-%02d", y, m, d);
    memcpy(out, tmp, 10);
    out[10] = 0;
}

static void format_date(int64_t t, char out[11])
{
    time_t tt = (time_t)t;
    struct tm tm;
    localtime_r(&tt, &tm); /* the gateway's time zone: TZ, set from --timezone (UTC by default) */
    put_date(out, tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday);
}

static int valid_day(int y, int m, int d)
{
    static const int days[] = {31, 29, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31};
    if (m < 1 || m > 12 || d < 1 || d > days[m - 1])
        return 0;
    return m != 2 || d < 29 || (y % 4 == 0 && (y % 100 != 0 || y % 400 == 0));
}

static int64_t day_start(int y, int m, int d)
{
    struct tm tm = {.tm_year = y - 1900, .tm_mon = m - 1, .tm_mday = d, .tm_hour = 12}; /* noon: no DST edge */
    tm.tm_isdst = -1;
    return (int64_t)mktime(&tm);
}

int cg_normalise_date(const char *in, int64_t now, char out[11])
{
    char s[128];
    size_t n = 0;
    for (const char *p = in; *p && n < sizeof(s) - 1; p++) /* lowercase, ',' and '.' as spaces */
        s[n++] = (*p == ',' || *p == '.') ? ' ' : (char)tolower((unsigned char)*p);
    s[n] = 0;
    char *t = trim(s);
    time_t tt = (time_t)now;
    struct tm today;
    localtime_r(&tt, &today);
    int64_t midnight = day_start(today.tm_year + 1900, today.tm_mon + 1, today.tm_mday);
    static const struct { const char *word; int days; } relative[] = {
        {"today", 0}, {"tonight", 0}, {"tomorrow", 1}, {"day after tomorrow", 2}, {"the day after tomorrow", 2},
        {"next week", 7}, {"in a week", 7},
    };
    for (size_t i = 0; i < sizeof(relative) / sizeof(relative[0]); i++)
        if (strcmp(t, relative[i].word) == 0) {
            format_date(midnight + relative[i].days * 86400, out);
            return 0;
        }
    int y, m, d;
    char tail;
    if (sscanf(t, "%4d-%2d-%2d%c", &y, &m, &d, &tail) == 3 || sscanf(t, "%2d/%2d/%4d%c", &d, &m, &y, &tail) == 3) {
        if (!valid_day(y, m, d))
            return -1;
        put_date(out, y, m, d);
        return 0;
    }
    /* words: a month name, a day number (1st, 20th), an optional year; "of" and "on" skipped */
    d = m = y = 0;
    for (char *w = t; *w;) {
        size_t len = strcspn(w, " ");
        char word[32];
        snprintf(word, sizeof(word), "%.*s", (int)(len < 31 ? len : 31), w);
        char *end;
        long v = strtol(word, &end, 10);
        if (end != word && (*end == 0 || strcmp(end, "st") == 0 || strcmp(end, "nd") == 0 ||
                            strcmp(end, "rd") == 0 || strcmp(end, "th") == 0)) {
            if (v >= 1 && v <= 31 && !d)
                d = (int)v;
            else if (v >= 1970 && v <= 2200 && !y && *end == 0)
                y = (int)v;
            else
                return -1;
        } else if (month_of(word, strlen(word)) && !m) {
            m = month_of(word, strlen(word));
        } else if (strcmp(word, "of") != 0 && strcmp(word, "on") != 0 && strcmp(word, "the") != 0) {
            return -1;
        }
        w += len;
        while (*w == ' ')
            w++;
    }
    if (!d || !m)
        return -1;
    if (!y) { /* the next such date on or after today */
        y = today.tm_year + 1900;
        if (!valid_day(y, m, d) || day_start(y, m, d) < midnight)
            y++;
        while (!valid_day(y, m, d) && y < today.tm_year + 1900 + 8)
            y++; /* 29 February */
    }
    if (!valid_day(y, m, d))
        return -1;
    put_date(out, y, m, d);
    return 0;
}

int cg_normalise_int(const char *in, long *out)
{
    static const char *const words[] = {"zero", "one", "two", "three", "four",  "five", "six",
                                        "seven", "eight", "nine", "ten", "eleven", "twelve"};
    char s[64];
    snprintf(s, sizeof(s), "%s", in);
    char *t = trim(s);
    for (char *p = t; *p; p++)
        *p = (char)tolower((unsigned char)*p);
    for (long i = 0; i < 13; i++)
        if (strcmp(t, words[i]) == 0 || (i == 1 && (strcmp(t, "a") == 0 || strcmp(t, "an") == 0))) {
            *out = i;
            return 0;
        }
    char *end;
    errno = 0;
    long v = strtol(t, &end, 10);
    if (end == t || *end || errno)
        return -1;
    *out = v;
    return 0;
}

int cg_normalise_amount(const char *in, double *amount, char currency[4])
{
    static const struct { const char *token; const char *code; } currencies[] = {
        {"kes", "KES"}, {"ksh", "KES"}, {"kshs", "KES"}, {"shillings", "KES"}, {"shilling", "KES"}, {"bob", "KES"},
        {"usd", "USD"}, {"dollars", "USD"}, {"dollar", "USD"}, {"$", "USD"}, {"eur", "EUR"}, {"euros", "EUR"},
        {"euro", "EUR"}, {"\xe2\x82\xac", "EUR"}, {"gbp", "GBP"}, {"pounds", "GBP"}, {"pound", "GBP"},
        {"\xc2\xa3", "GBP"},
    };
    char s[128];
    size_t n = 0;
    currency[0] = 0;
    for (const char *p = in; *p && n < sizeof(s) - 1; p++)
        s[n++] = (char)tolower((unsigned char)*p);
    s[n] = 0;
    /* take out the currency, wherever it stands */
    for (size_t i = 0; i < sizeof(currencies) / sizeof(currencies[0]); i++) {
        char *hit = strstr(s, currencies[i].token);
        size_t len = strlen(currencies[i].token);
        if (!hit)
            continue;
        int word = isalpha((unsigned char)currencies[i].token[0]);
        if (word && ((hit > s && isalpha((unsigned char)hit[-1])) || isalpha((unsigned char)hit[len])))
            continue;
        snprintf(currency, 4, "%s", currencies[i].code);
        memset(hit, ' ', len);
        break;
    }
    /* the number: digits with ',' thousands and '.' decimals, then k or m */
    char digits[64];
    size_t d = 0;
    char *p = trim(s);
    for (; *p && d < sizeof(digits) - 1; p++) {
        if (isdigit((unsigned char)*p) || *p == '.')
            digits[d++] = *p;
        else if (*p != ',')
            break;
    }
    digits[d] = 0;
    if (!d)
        return -1;
    char *end;
    double v = strtod(digits, &end);
    if (*end)
        return -1;
    p = trim(p);
    if (strcmp(p, "k") == 0 || strcmp(p, "thousand") == 0)
        v *= 1000;
    else if (strcmp(p, "m") == 0 || strcmp(p, "million") == 0)
        v *= 1000000;
    else if (*p)
        return -1;
    if (!isfinite(v))
        return -1;
    *amount = v;
    return 0;
}

/* ---- evaluating ------------------------------------------------------------------------- */

static int param_present(const cg_dialog *d, const char *key)
{
    const char *dot = strchr(key, '.');
    if (dot) {
        char service[129];
        snprintf(service, sizeof(service), "%.*s", (int)(dot - key), key);
        return json_object_get(json_object_get(d->params, service), dot + 1) != NULL;
    }
    return d->service && json_object_get(json_object_get(d->params, d->service), key) != NULL;
}

static int conditions_hold(const rule *r, const cg_dialog *d, const char *previous)
{
    for (int i = 0; i < r->n_conds; i++) {
        const rule_cond *c = &r->conds[i];
        const char *type = d && d->awaiting ? json_string_value(json_object_get(d->awaiting, "type")) : NULL;
        switch (c->kind) {
        case C_AWAITING:
            if (!type || (strcmp(c->arg, "any") != 0 && strcmp(c->arg, type) != 0))
                return 0;
            break;
        case C_NO_AWAITING:
            if (type)
                return 0;
            break;
        case C_SERVICE:
            if (!d || !d->service || strcmp(d->service, c->arg) != 0)
                return 0;
            break;
        case C_HAS:
            if (!d || !param_present(d, c->arg))
                return 0;
            break;
        case C_HISTORY:
            if (!previous || !*previous)
                return 0;
            break;
        }
    }
    return 1;
}

/* Copies group number g of the last match into a new string; NULL when it did not take part. */
static char *group_text(const cg_ruleset *rs, const char *subject, uint32_t g)
{
    PCRE2_SIZE *ov = pcre2_get_ovector_pointer(rs->md);
    if (g >= pcre2_get_ovector_count(rs->md) || ov[2 * g] == PCRE2_UNSET)
        return NULL;
    return strndup(subject + ov[2 * g], ov[2 * g + 1] - ov[2 * g]);
}

/* The text of named group name (with DUPNAMES, the first of that name that took part). */
static char *named_text(const cg_ruleset *rs, const rule *r, const char *subject, const char *name)
{
    PCRE2_SPTR first, last;
    int size = pcre2_substring_nametable_scan(r->re, (PCRE2_SPTR)name, &first, &last);
    if (size < 0)
        return NULL;
    for (PCRE2_SPTR e = first; e <= last; e += size) {
        char *t = group_text(rs, subject, (uint32_t)(e[0] << 8 | e[1]));
        if (t)
            return t;
    }
    return NULL;
}

/* Applies the rule's normaliser for group name to text; the new JSON value, or NULL. */
static json_t *normalised(const rule *r, const char *name, const char *text, int64_t now, json_t *params)
{
    for (int i = 0; i < r->n_types; i++) {
        if (strcmp(r->types[i].group, name) != 0)
            continue;
        char date[11], currency[4];
        long v;
        double amount;
        switch (r->types[i].norm) {
        case N_DATE:
            return cg_normalise_date(text, now, date) == 0 ? json_string(date) : NULL;
        case N_INT:
            return cg_normalise_int(text, &v) == 0 ? json_integer(v) : NULL;
        case N_LOWER: { /* ASCII letters only: other scripts are left as written */
            char *low = strdup(text);
            for (char *c = low; *c; c++)
                *c = (char)tolower((unsigned char)*c);
            json_t *v = json_string(low);
            free(low);
            return v;
        }
        case N_AMOUNT:
            if (cg_normalise_amount(text, &amount, currency) < 0)
                return NULL;
            if (currency[0] && !json_object_get(params, "currency"))
                json_object_set_new(params, "currency", json_string(currency));
            return amount == floor(amount) && fabs(amount) < 9e15 ? json_integer((json_int_t)amount)
                                                                  : json_real(amount);
        }
    }
    return json_string(text);
}

/* Named groups that took part, normalised, into an object; a value a normaliser refuses is left out. */
static json_t *params_of(const cg_ruleset *rs, const rule *r, const char *subject, int64_t now)
{
    json_t *params = json_object();
    uint32_t count = 0, entry_size = 0;
    PCRE2_SPTR table;
    pcre2_pattern_info(r->re, PCRE2_INFO_NAMECOUNT, &count);
    pcre2_pattern_info(r->re, PCRE2_INFO_NAMEENTRYSIZE, &entry_size);
    pcre2_pattern_info(r->re, PCRE2_INFO_NAMETABLE, &table);
    for (uint32_t i = 0; i < count; i++) {
        const char *name = (const char *)(table + i * entry_size + 2);
        if (json_object_get(params, name))
            continue; /* a duplicate name already taken */
        char *text = named_text(rs, r, subject, name);
        if (!text)
            continue;
        char *t = trim(text);
        json_t *v = *t ? normalised(r, name, t, now, params) : NULL;
        if (v)
            json_object_set_new(params, name, v);
        free(text);
    }
    return params;
}

/* {previous}, {text} and {group} in an enrich template. */
static char *expand_template(const cg_ruleset *rs, const rule *r, const char *subject, const char *text,
                             const char *previous)
{
    size_t cap = strlen(r->arg) + strlen(text) + strlen(previous) + 256, len = 0;
    char *out = malloc(cap);
    if (!out)
        abort(); /* out of memory: as everywhere a message is built */
    for (const char *p = r->arg; *p;) {
        const char *piece = NULL;
        char *owned = NULL;
        size_t plen = 0;
        const char *close = *p == '{' ? strchr(p, '}') : NULL;
        if (close) {
            char name[64];
            snprintf(name, sizeof(name), "%.*s", (int)(close - p - 1), p + 1);
            if (strcmp(name, "previous") == 0) {
                piece = previous;
                plen = strlen(previous);
                while (plen > 0 && strchr(" \t?.!", previous[plen - 1]))
                    plen--;
            } else if (strcmp(name, "text") == 0) {
                piece = text;
                plen = strlen(text);
            } else if ((owned = named_text(rs, r, subject, name))) {
                piece = owned;
                plen = strlen(owned);
            }
            p = close + 1;
        } else {
            piece = p++;
            plen = 1;
        }
        if (len + plen + 1 > cap) {
            cap = (len + plen + 1) * 2;
            char *grown = realloc(out, cap);
            if (!grown)
                abort();
            out = grown;
        }
        if (piece)
            memcpy(out + len, piece, plen);
        len += piece ? plen : 0;
        free(owned);
    }
    out[len] = 0;
    return out;
}

/* Runs one rule's pattern on subject: 1 matched, 0 not, -1 cut off by a limit. */
static int run_pattern(const cg_ruleset *rs, const rule *r, const char *subject, size_t len)
{
    int rc = pcre2_match(r->re, (PCRE2_SPTR)subject, len, 0, 0, rs->md, rs->mctx);
    if (rc >= 0)
        return 1;
    if (rc == PCRE2_ERROR_NOMATCH)
        return 0;
    cg_warn("rules: rule '%s' (%s:%d) stopped: %s; counted as no match", r->name, r->file, r->line,
            rc == PCRE2_ERROR_MATCHLIMIT ? "match limit" : rc == PCRE2_ERROR_JIT_STACKLIMIT ? "JIT stack limit"
                                                                                            : "match error");
    return -1;
}

/* What one matched rule adds to the result. */
static void apply_rule(const cg_ruleset *rs, const rule *r, const char *subject, const char *text,
                       const char *previous, int64_t now, cg_rules_result *out)
{
    switch (r->action) {
    case A_CANCEL:
    case A_CANCEL_ABSORB:
        if (!out->cancel)
            out->cancel = r->action == A_CANCEL_ABSORB ? 2 : 1;
        break;
    case A_CONFIRM_YES:
    case A_CONFIRM_NO:
        if (out->confirm < 0)
            out->confirm = r->action == A_CONFIRM_YES;
        break;
    case A_METADATA:
        if (!json_object_get(out->metadata, r->arg)) {
            char *content = named_text(rs, r, subject, "content");
            if (!content)
                content = group_text(rs, subject, 1);
            if (!content)
                content = group_text(rs, subject, 0);
            json_object_set_new(out->metadata, r->arg, json_string(trim(content)));
            free(content);
        }
        break;
    case A_PARAMS: {
        json_t *p = params_of(rs, r, subject, now);
        json_t *mine = json_object_get(out->params, r->arg);
        if (!mine)
            json_object_set_new(out->params, r->arg, mine = json_object());
        json_object_update(mine, p);
        json_decref(p);
        snprintf(out->service, sizeof(out->service), "%.64s", r->arg);
        break;
    }
    case A_FORGET:
        json_array_append_new(out->forget, json_string(r->arg));
        break;
    case A_ENRICH:
        if (!out->enriched && previous)
            out->enriched = expand_template(rs, r, subject, text, previous);
        break;
    case A_ROUTE:
        if (!out->route[0])
            snprintf(out->route, sizeof(out->route), "%.64s", r->arg);
        break;
    }
}

static void result_init(cg_rules_result *out)
{
    memset(out, 0, sizeof(*out));
    out->confirm = -1;
    out->metadata = json_object();
    out->params = json_object();
    out->forget = json_array();
    out->fired = json_array();
    out->limited = json_array();
}

void cg_rules_result_free(cg_rules_result *r)
{
    json_decref(r->metadata);
    json_decref(r->params);
    json_decref(r->forget);
    json_decref(r->fired);
    json_decref(r->limited);
    free(r->enriched);
    memset(r, 0, sizeof(*r));
}

/* Evaluates rules [from, to) of rs; conditions are skipped when check_conditions is 0. */
static void eval_range(const cg_ruleset *rs, size_t from, size_t to, const char *text, const cg_dialog *d,
                       const char *previous, int64_t now, int check_conditions, cg_rules_result *out)
{
    size_t len = strlen(text);
    if (len > CG_RULES_MAX_SCAN)
        len = cg_utf8_boundary(text, CG_RULES_MAX_SCAN);
    char *subject = strndup(text, len);
    for (size_t i = from; i < to; i++) {
        const rule *r = &rs->rules[i];
        if (check_conditions && !conditions_hold(r, d, previous))
            continue;
        if (r->action == A_ENRICH && !previous)
            continue;
        int m = run_pattern(rs, r, subject, len);
        if (m < 0)
            json_array_append_new(out->limited, json_string(r->name));
        if (m <= 0)
            continue;
        json_array_append_new(out->fired, json_string(r->name));
        apply_rule(rs, r, subject, text, previous, now, out);
    }
    free(subject);
}

void cg_rules_eval(const cg_ruleset *rs, const char *text, const cg_dialog *d, const char *previous, int64_t now,
                   cg_rules_result *out)
{
    result_init(out);
    if (rs)
        eval_range(rs, 0, rs->n, text, d, previous, now, 1, out);
}

int cg_rules_cancels(const cg_ruleset *rs, const char *text)
{
    if (!rs)
        return 0;
    size_t len = strlen(text);
    if (len > CG_RULES_MAX_SCAN)
        len = cg_utf8_boundary(text, CG_RULES_MAX_SCAN);
    for (size_t i = 0; i < rs->n; i++) {
        const rule *r = &rs->rules[i];
        if ((r->action == A_CANCEL || r->action == A_CANCEL_ABSORB) && r->n_conds == 0 &&
            run_pattern(rs, r, text, len) > 0)
            return 1;
    }
    return 0;
}

/* ---- rule tests -------------------------------------------------------------------------- */

/* The rule's own output for a name of an expect line, as text. */
static char *actual_value(const rule *r, const cg_rules_result *res, const char *name)
{
    json_t *v = NULL;
    if (r->action == A_PARAMS)
        v = json_object_get(json_object_get(res->params, r->arg), name);
    else if (r->action == A_METADATA && strcmp(name, "content") == 0)
        v = json_object_get(res->metadata, r->arg);
    else if (r->action == A_ENRICH && strcmp(name, "enriched") == 0 && res->enriched)
        return strdup(res->enriched);
    if (!v)
        return NULL;
    if (json_is_string(v))
        return strdup(json_string_value(v));
    return json_dumps(v, JSON_ENCODE_ANY | JSON_COMPACT);
}

#define CHECK_PREVIOUS "What's the weather in Tokyo?"

int cg_rules_check(const cg_ruleset *rs, int64_t now, FILE *out, int *n_tests)
{
    int failures = 0, total = 0;
    for (size_t i = 0; i < rs->n; i++) {
        const rule *r = &rs->rules[i];
        for (int k = 0; k < r->n_tests; k++) {
            const rule_test *t = &r->tests[k];
            cg_rules_result res;
            result_init(&res);
            eval_range(rs, i, i + 1, t->text, NULL, CHECK_PREVIOUS, now, 0, &res);
            total++;
            int fired = json_array_size(res.fired) > 0;
            if (t->reject && fired) {
                fprintf(out, "%s:%d: rule '%s' fired on \"%s\", which it must reject\n", r->file, t->line, r->name,
                        t->text);
                failures++;
            } else if (!t->reject && !fired) {
                fprintf(out, "%s:%d: rule '%s' did not fire on \"%s\"%s\n", r->file, t->line, r->name, t->text,
                        json_array_size(res.limited) ? " (cut off by the match limit)" : "");
                failures++;
            } else if (!t->reject) {
                const char *name;
                json_t *want;
                json_object_foreach(t->want, name, want) {
                    char *got = actual_value(r, &res, name);
                    if (!got || strcmp(got, json_string_value(want)) != 0) {
                        fprintf(out, "%s:%d: rule '%s' on \"%s\": %s is %s%s%s, expected \"%s\"\n", r->file, t->line,
                                r->name, t->text, name, got ? "\"" : "", got ? got : "missing", got ? "\"" : "",
                                json_string_value(want));
                        failures++;
                    }
                    free(got);
                }
            }
            cg_rules_result_free(&res);
        }
    }
    if (n_tests)
        *n_tests = total;
    return failures;
}
