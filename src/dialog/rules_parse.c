/*
 * rules_parse.c: reading a rule file into rules (the format is rules/README.md's).
 *
 * A rule runs from its `rule NAME` line to the next one; every other line is a keyword
 * (match, do, when, type, option, expect, reject) and its argument. The parser checks all
 * it can before a message is ever evaluated: one pattern and one action per rule, known
 * actions, conditions and normalisers, names that fit their fields, a `type` for a group
 * the pattern has. The first mistake stops it with "file:line: message" (a bad pattern
 * adds PCRE2's text and the offset in the pattern), since a set that half-loads would
 * answer differently from the files a user reads. Patterns are compiled here, once.
 */
#include <ctype.h>
#include <errno.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "chatgate/core/alloc.h"
#include "chatgate/core/jsonout.h"
#include "chatgate/dialog/rules.h"
#include "chatgate/dialog/rules_internal.h"

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

/* Splits "word rest" into the first word and the trimmed rest. */
static char *split_word(char *s, char **rest)
{
    char *end = s + strcspn(s, " \t");
    if (*end) {
        *end = 0;
        *rest = cg_rules_trim(end + 1);
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
    char *out = cg_malloc(strlen(p) + 1), *o = out;
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
    for (s = cg_rules_trim(s); *s; s = cg_rules_trim(s)) {
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
            value = cg_strndup(s, n);
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
        {"route", A_ROUTE, 1},   {"mask", A_MASK, 0},         {"stop", A_STOP, 0},
        {"tag", A_TAG, 1},       {"remember", A_REMEMBER, 1},
    };
    size_t i = 0;
    while (i < sizeof(verbs) / sizeof(verbs[0]) && strcmp(verbs[i].verb, verb) != 0)
        i++;
    if (i == sizeof(verbs) / sizeof(verbs[0]))
        return perr(p, "unknown action '%s' (cancel, confirm, metadata, params, forget, enrich, route, remember; on "
                       "reply: mask, stop, tag)",
                    verb);
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
    case A_STOP:
        if (*arg)
            return perr(p, "'do stop' takes nothing, not '%s'", arg);
        break;
    case A_MASK:
        if (!*arg) /* what a masked match reads as, unless the rule says */
            snprintf(r->arg, sizeof(r->arg), "%s", "[masked]");
        break;
    case A_METADATA:
    case A_PARAMS:
    case A_ROUTE:
    case A_TAG:
    case A_REMEMBER:
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

/* `when tool[.PATH] [VALUE]`, `when soft[.PATH] [VALUE]` and `when profile[.NAME] [VALUE]`:
 * path is what follows the word ("" or ".a.b"), value the rest of the line ("" when absent). */
static int parse_when_value(parse_ctx *p, rule *r, rule_cond *c, cond_kind kind, const char *path, const char *value)
{
    const char *what = kind == C_TOOL ? "tool" : kind == C_SOFT ? "soft" : "profile";
    if (*path && !valid_name(path + 1, 128))
        return perr(p, "'when %s%s' needs a path of names after the dot (letters, digits, _ - .), at most 128 bytes",
                    what, path);
    if (strlen(value) > 128)
        return perr(p, "'when %s%s' takes a value of at most 128 bytes", what, path);
    c->kind = kind;
    snprintf(c->arg, sizeof(c->arg), "%s", *path ? path + 1 : "");
    snprintf(c->value, sizeof(c->value), "%s", value);
    r->n_conds++;
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
    } else if (strncmp(what, "tool", 4) == 0 && (what[4] == 0 || what[4] == '.')) {
        return parse_when_value(p, r, c, C_TOOL, what + 4, arg);
    } else if (strncmp(what, "soft", 4) == 0 && (what[4] == 0 || what[4] == '.')) {
        return parse_when_value(p, r, c, C_SOFT, what + 4, arg);
    } else if (strncmp(what, "profile", 7) == 0 && (what[7] == 0 || what[7] == '.')) {
        return parse_when_value(p, r, c, C_PROFILE, what + 7, arg);
    } else {
        return perr(p,
                    "unknown condition 'when %s' (awaiting TYPE, no awaiting, service NAME, has PARAM, history, "
                    "tool[.PATH] [VALUE], soft[.PATH] [VALUE], profile[.NAME] [VALUE])",
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
        return perr(p, "'type' needs a group name, then date, int, amount, lower, currency or title");
    rule_type *t = &r->types[r->n_types];
    if (strcmp(norm, "date") == 0)
        t->norm = N_DATE;
    else if (strcmp(norm, "int") == 0)
        t->norm = N_INT;
    else if (strcmp(norm, "amount") == 0)
        t->norm = N_AMOUNT;
    else if (strcmp(norm, "lower") == 0)
        t->norm = N_LOWER;
    else if (strcmp(norm, "currency") == 0)
        t->norm = N_CURRENCY;
    else if (strcmp(norm, "title") == 0)
        t->norm = N_TITLE;
    else
        return perr(p, "unknown normaliser '%s' (date, int, amount, lower, currency, title)", norm);
    snprintf(t->group, sizeof(t->group), "%s", group);
    r->n_types++;
    return 0;
}

/*
 * 1 when the pattern, compiled without UTF and UCP, matches an all-ASCII subject exactly as
 * it does with them. Without UTF a character past ASCII is its bytes, so a quantifier after
 * one ("don’?t") would apply to its last byte alone: such a character must stand inside a
 * [class], where its bytes are only more members that an ASCII subject never has ([^...]
 * likewise). Everything else reads the same on ASCII: \w \d \s \b and POSIX classes
 * under UCP are the ASCII ones there, and caseless ASCII letters differ only in matching
 * two characters past ASCII (the Kelvin sign and long s). \x{...} past 0xff does not compile
 * without UTF (then no second pattern). Comments and extended mode, where a '[' may not open
 * a class, are not looked into: 0.
 */
static int ascii_equivalent(const char *pattern)
{
    int in_class = 0;
    for (const unsigned char *c = (const unsigned char *)pattern; *c; c++) {
        if (*c >= 0x80 && !in_class)
            return 0;
        if (*c == '\\') {
            if (c[1] == 'Q' || c[1] == 'E' || !c[1])
                return 0; /* quoting: not looked into */
            c++;          /* the escaped character, whatever it is */
        } else if (*c == '(' && c[1] == '?' && (c[2] == '#' || strchr("imnsxJU-^", c[2]))) {
            for (const unsigned char *f = c + 2; *f && *f != ')' && *f != ':'; f++)
                if (*f == 'x' || *f == '#')
                    return 0; /* a comment, or extended mode */
        } else if (!in_class && *c == '[') {
            in_class = 1;
            if (c[1] == '^')
                c++;
            if (c[1] == ']')
                c++; /* a ']' first is a member */
        } else if (in_class && *c == '[' && c[1] == ':') {
            const char *end = strstr((const char *)c + 2, ":]");
            if (!end)
                return 0;
            c = (const unsigned char *)end + 1;
        } else if (in_class && *c == ']') {
            in_class = 0;
        }
    }
    return !in_class;
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
    /* without JIT (unsupported CPU) it still runs; a reply rule is also matched partially
     * (rules_reply.c: a match that may go on in the next delta) */
    r->jit = pcre2_jit_compile(r->re, PCRE2_JIT_COMPLETE | (r->on_reply ? PCRE2_JIT_PARTIAL_HARD : 0)) == 0;
    if (ascii_equivalent(r->pattern)) {
        r->re_ascii = pcre2_compile((PCRE2_SPTR)r->pattern, PCRE2_ZERO_TERMINATED, opts & ~(PCRE2_UTF | PCRE2_UCP),
                                    &code, &off, NULL);
        if (r->re_ascii)
            r->jit_ascii =
                pcre2_jit_compile(r->re_ascii, PCRE2_JIT_COMPLETE | (r->on_reply ? PCRE2_JIT_PARTIAL_HARD : 0)) == 0;
    }
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
    if (r->n_types && r->action != A_PARAMS && r->action != A_REMEMBER)
        return perr(p, "rule '%s': 'type' lines are for 'do params' and 'do remember' rules", r->name);
    int reply_action = r->action == A_MASK || r->action == A_STOP || r->action == A_TAG;
    if (r->on_reply && !reply_action)
        return perr(p, "rule '%s' is 'on reply': its action must be mask, stop or tag", r->name);
    if (!r->on_reply && reply_action)
        return perr(p, "rule '%s': mask, stop and tag act on replies: add 'on reply'", r->name);
    if (r->on_reply && r->n_conds)
        return perr(p, "rule '%s' is 'on reply': 'when' conditions are for rules on messages", r->name);
    p->line = line;
    r->name_json = cg_json_string(r->name); /* NULL (out of memory): its lists leave it out */
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
        rule *nr = cg_realloc(rs->rules, ncap * sizeof(rule));
        rs->rules = nr;
        rs->cap = ncap;
    }
    rule *r = &rs->rules[rs->n++];
    memset(r, 0, sizeof(*r));
    snprintf(r->name, sizeof(r->name), "%s", name);
    r->file = p->file;
    r->file_index = rs->n_files - 1; /* the file being read is the list's last */
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
        char *line = cg_rules_trim(buf);
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
            r->pattern = cg_strdup(rest);
            r->pattern_line = p->line;
        } else if (strcmp(kw, "do") == 0) {
            rc = parse_do(p, r, rest);
        } else if (strcmp(kw, "when") == 0) {
            rc = parse_when(p, r, rest);
        } else if (strcmp(kw, "type") == 0) {
            rc = parse_type(p, r, rest);
        } else if (strcmp(kw, "on") == 0) {
            if (strcmp(rest, "reply") != 0 && strcmp(rest, "message") != 0)
                return perr(p, "'on' takes message (the default) or reply, not '%s'", rest);
            r->on_reply = rest[0] == 'r';
        } else if (strcmp(kw, "option") == 0) {
            if (strcmp(rest, "case") != 0)
                return perr(p, "unknown option '%s' (case)", rest);
            r->case_sensitive = 1;
        } else if (strcmp(kw, "expect") == 0 || strcmp(kw, "reject") == 0) {
            rc = parse_test(p, r, rest, kw[0] == 'r');
        } else {
            return perr(p, "unknown keyword '%s' (rule, match, do, on, when, type, option, expect, reject)", kw);
        }
        if (rc < 0)
            return -1;
    }
    if (ferror(f))
        return perr(p, "read error: %s", strerror(errno));
    return r ? finish_rule(p, r) : 0;
}

int cg_rules_parse_file(cg_ruleset *rs, const char *file, FILE *f, char *err, size_t errlen)
{
    parse_ctx p = {.rs = rs, .file = file, .err = err, .errlen = errlen};
    return parse_file(&p, f);
}
