/*
 * rules_eval.c: what the rules say about one message (cg_rules_eval), and the quick cancel
 * check a message gets on arrival (cg_rules_cancels).
 *
 * Every rule whose `when` conditions hold runs its pattern on the message, in file order;
 * each rule that matches adds its action to the result, and where actions would clash the
 * first rule wins (the first cancel, confirm, enrich or route). Matching is bounded: the
 * subject is cut at CG_RULES_MAX_SCAN bytes on a UTF-8 boundary, and the set's match limit
 * and JIT stack stop any pattern from stalling the loop; a rule cut off counts as no match
 * and is named in `limited`, so a slow pattern costs its own answer, never the message's.
 */
#include <ctype.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "chatgate/core/alloc.h"
#include "chatgate/core/jsonout.h"
#include "chatgate/core/log.h"
#include "chatgate/core/utf8.h"
#include "chatgate/dialog/rules.h"
#include "chatgate/dialog/rules_internal.h"

static int param_present(const cg_dialog *d, const char *key)
{
    const char *dot = strchr(key, '.');
    if (dot)
        return json_object_get(json_object_getn(d->params, key, (size_t)(dot - key)), dot + 1) != NULL;
    return d->service && json_object_get(json_object_get(d->params, d->service), key) != NULL;
}

/* What path ("a.b.0": object members, array indexes) names inside v, or NULL. */
static json_t *at_path(json_t *v, const char *path)
{
    while (v && *path) {
        size_t n = strcspn(path, ".");
        char *end;
        unsigned long i = strtoul(path, &end, 10);
        if (json_is_object(v))
            v = json_object_getn(v, path, n);
        else if (json_is_array(v) && n > 0 && end == path + n && path[0] != '-' && path[0] != '+')
            v = json_array_get(v, i);
        else
            v = NULL;
        path += n + (path[n] == '.');
    }
    return v;
}

/* `when tool[.PATH] [VALUE]`, `when soft[.PATH] [VALUE]` on v (the last tool result, the
 * soft context): what the path names is there and not null, and, with a value, a string of
 * that text or a number or boolean written that way. */
static int value_holds(json_t *v, const rule_cond *c)
{
    v = at_path(v, c->arg);
    if (!v || json_is_null(v))
        return 0;
    if (!c->value[0])
        return 1;
    if (json_is_string(v))
        return strcmp(json_string_value(v), c->value) == 0;
    if (json_is_object(v) || json_is_array(v))
        return 0;
    char *text = json_dumps(v, JSON_ENCODE_ANY | JSON_COMPACT);
    int same = text && strcmp(text, c->value) == 0;
    free(text);
    return same;
}

static int conditions_hold(const rule *r, const cg_dialog *d, const char *previous)
{
    const char *type = d && d->awaiting ? json_string_value(json_object_get(d->awaiting, "type")) : NULL;
    for (int i = 0; i < r->n_conds; i++) {
        const rule_cond *c = &r->conds[i];
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
        case C_TOOL:
        case C_SOFT:
        case C_PROFILE:
            if (!d || !value_holds(c->kind == C_TOOL ? d->last_tool_result : c->kind == C_SOFT ? d->soft : d->profile, c))
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
    return cg_strndup(subject + ov[2 * g], ov[2 * g + 1] - ov[2 * g]);
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
            return cg_normalise_date(text, now, date) == 0 ? cg_json_string(date) : NULL;
        case N_INT:
            return cg_normalise_int(text, &v) == 0 ? json_integer(v) : NULL;
        case N_LOWER: { /* ASCII letters only: other scripts are left as written */
            char *low = cg_strdup(text);
            for (char *c = low; *c; c++)
                *c = (char)tolower((unsigned char)*c);
            json_t *v = cg_json_string(low);
            free(low);
            return v;
        }
        case N_CURRENCY:
            return cg_normalise_currency(text, currency) == 0 ? cg_json_string(currency) : NULL;
        case N_TITLE: {
            char *t = cg_strdup(text);
            cg_normalise_title(t);
            json_t *v = cg_json_string(t);
            free(t);
            return v;
        }
        case N_AMOUNT:
            if (cg_normalise_amount(text, &amount, currency) < 0)
                return NULL;
            if (currency[0] && !json_object_get(params, "currency"))
                json_object_set_new(params, "currency", cg_json_string(currency));
            return amount == floor(amount) && fabs(amount) < 9e15 ? json_integer((json_int_t)amount)
                                                                  : json_real(amount);
        }
    }
    return cg_json_string(text);
}

/*
 * Named groups that took part, normalised, into an object; a value a normaliser refuses is
 * left out. The name table is walked once: its entries are sorted by name, those of one name
 * (DUPNAMES) together in the order of their groups, so a name's value is its first group
 * that took part (named_text's), and the name's other entries are passed over, taken or not.
 * Groups that never take part (DEFINE's) cost a look at the ovector.
 */
static json_t *params_of(const cg_ruleset *rs, const rule *r, const char *subject, int64_t now)
{
    json_t *params = json_object();
    uint32_t count = 0, entry_size = 0;
    PCRE2_SPTR table;
    pcre2_pattern_info(r->re, PCRE2_INFO_NAMECOUNT, &count);
    pcre2_pattern_info(r->re, PCRE2_INFO_NAMEENTRYSIZE, &entry_size);
    pcre2_pattern_info(r->re, PCRE2_INFO_NAMETABLE, &table);
    const char *handled = NULL; /* the last name whose group took part */
    for (uint32_t i = 0; i < count; i++) {
        PCRE2_SPTR e = table + i * entry_size;
        const char *name = (const char *)(e + 2);
        if (handled && strcmp(name, handled) == 0)
            continue; /* a duplicate name already taken */
        char *text = group_text(rs, subject, (uint32_t)(e[0] << 8 | e[1]));
        if (!text)
            continue; /* this group did not take part; the name's next one may have */
        handled = name;
        char *t = cg_rules_trim(text);
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
    char *out = cg_malloc(cap);
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
            char *grown = cg_realloc(out, cap);
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

/*
 * How a subject is matched: PCRE2_NO_UTF_CHECK once it is known valid UTF-8, and whether it
 * is all ASCII (then a rule's ASCII form runs, rule.re_ascii). PCRE2 checks the whole
 * subject at every pcre2_match() otherwise, and a message runs every rule on the same text;
 * checked once here, as PCRE2's documentation advises. Text that is not valid keeps the
 * check, and PCRE2's error (counted as no match).
 */
typedef struct subject_mode {
    uint32_t options;
    int ascii;
} subject_mode;

static subject_mode subject_mode_of(const char *subject, size_t len)
{
    size_t i = cg_utf8_ascii_prefix(subject, len);
    subject_mode m = {PCRE2_NO_UTF_CHECK, i == len};
    if (!m.ascii && !cg_utf8_valid(subject + i, len - i))
        m.options = 0;
    return m;
}

/* Runs one rule's pattern on subject: 1 matched, 0 not, -1 cut off by a limit. An all-ASCII
 * subject is matched by the pattern's ASCII form when it has one: the same groups, numbered
 * alike, so the ovector and the name table read the same. */
static int run_pattern(const cg_ruleset *rs, const rule *r, const char *subject, size_t len, subject_mode mode)
{
    const pcre2_code *code = cg_rule_code(r, mode.ascii);
    /* JIT code called straight: pcre2_match's checks of its arguments, every rule of every
     * message, were a tenth of the rules' PCRE2 time (issue 12). Only on a subject known to
     * be valid UTF-8 (PCRE2_NO_UTF_CHECK), which pcre2_jit_match never checks. */
    int jit = code == r->re ? r->jit : r->jit_ascii;
    int rc = jit && (mode.options & PCRE2_NO_UTF_CHECK)
                 ? pcre2_jit_match(code, (PCRE2_SPTR)subject, len, 0, 0, rs->md, rs->mctx)
                 : pcre2_match(code, (PCRE2_SPTR)subject, len, 0, mode.options, rs->md, rs->mctx);
    if (rc >= 0)
        return 1;
    if (rc == PCRE2_ERROR_NOMATCH)
        return 0;
    cg_warn("rules: rule '%s' (%s:%d) stopped: %s; counted as no match", r->name, r->file, r->line,
            rc == PCRE2_ERROR_MATCHLIMIT ? "match limit" : rc == PCRE2_ERROR_JIT_STACKLIMIT ? "JIT stack limit"
                                                                                            : "match error");
    return -1;
}

/* A rule's service or route name into the result's field (65 bytes: at most 64 of the
 * name, as before); a few times a message, so no snprintf. */
static void copy_name(char *dst, size_t size, const char *name)
{
    size_t n = strnlen(name, size - 1);
    memcpy(dst, name, n);
    dst[n] = 0;
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
            if (!out->metadata)
                out->metadata = json_object();
            json_object_set_new(out->metadata, r->arg, cg_json_string(cg_rules_trim(content)));
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
        copy_name(out->service, sizeof(out->service), r->arg);
        break;
    }
    case A_REMEMBER: /* the group of the attribute's name, else group 1, else the match */
        if (!json_object_get(out->remember, r->arg)) {
            char *text = named_text(rs, r, subject, r->arg);
            if (!text)
                text = group_text(rs, subject, 1);
            if (!text)
                text = group_text(rs, subject, 0);
            char *t = text ? cg_rules_trim(text) : NULL;
            json_t *scratch = json_object(); /* amount's currency goes nowhere here */
            json_t *v = t && *t ? normalised(r, r->arg, t, now, scratch) : NULL;
            json_decref(scratch);
            if (v && !out->remember)
                out->remember = json_object();
            if (v)
                json_object_set_new(out->remember, r->arg, v);
            free(text);
        }
        break;
    case A_FORGET:
        if (!out->forget)
            out->forget = json_array();
        json_array_append_new(out->forget, cg_json_string(r->arg));
        break;
    case A_ENRICH:
        if (!out->enriched && previous)
            out->enriched = expand_template(rs, r, subject, text, previous);
        break;
    case A_ROUTE:
        if (!out->route[0])
            copy_name(out->route, sizeof(out->route), r->arg);
        break;
    case A_MASK: /* reply rules act in rules_reply.c; here only their own tests run them */
    case A_STOP:
    case A_TAG:
        break;
    }
}

void cg_rules_result_init(cg_rules_result *out)
{
    memset(out, 0, sizeof(*out));
    out->confirm = -1;
    out->params = json_object();
    out->fired = json_array();
    /* metadata, forget and limited are made by the first rule that adds to them: most
     * messages have none, and the three were six allocations a message (issue 12) */
}

void cg_rules_result_free(cg_rules_result *r)
{
    json_decref(r->remember);
    json_decref(r->metadata);
    json_decref(r->params);
    json_decref(r->forget);
    json_decref(r->fired);
    json_decref(r->limited);
    free(r->enriched);
    memset(r, 0, sizeof(*r));
}

/* The counts' clock: the time of the file's rules just run goes to its histogram. */
static void time_file(const cg_rules_counts *c, size_t file, double *t0)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    double now = (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
    if (file < c->n_files)
        cg_histogram_observe(&c->file_time[file], now - *t0);
    *t0 = now;
}

/* Evaluates rules [from, to) of rs; conditions are skipped when check_conditions is 0. */
void cg_rules_eval_range(const cg_ruleset *rs, size_t from, size_t to, const char *text, const cg_dialog *d,
                         const char *previous, int64_t now, int check_conditions, cg_rules_result *out)
{
    size_t len = strlen(text);
    if (len > CG_RULES_MAX_SCAN)
        len = cg_utf8_boundary(text, CG_RULES_MAX_SCAN);
    /* the subject is text's first len bytes: PCRE gets the length, and groups are copied by
     * their offsets, which never pass it */
    const char *subject = text;
    subject_mode mode = subject_mode_of(subject, len);
    const cg_rules_counts *c = rs->counts.hits ? &rs->counts : NULL;
    size_t file = SIZE_MAX; /* the file whose rules run now, for its time */
    double t0 = 0;
    for (size_t i = from; i < to; i++) {
        const rule *r = &rs->rules[i];
        if (c && r->file_index != file) {
            time_file(c, file, &t0);
            file = r->file_index;
        }
        if (check_conditions && (r->on_reply || !conditions_hold(r, d, previous)))
            continue; /* a reply rule never runs on a message (its own tests run it) */
        if (r->action == A_ENRICH && !previous)
            continue;
        int m = run_pattern(rs, r, subject, len, mode);
        if (m < 0) {
            if (!out->limited)
                out->limited = json_array();
            json_array_append(out->limited, r->name_json);
            if (c && i < c->n_rules)
                c->limited[i]++;
        }
        if (m <= 0)
            continue;
        if (c && i < c->n_rules)
            c->hits[i]++;
        json_array_append(out->fired, r->name_json);
        apply_rule(rs, r, subject, text, previous, now, out);
    }
    if (c)
        time_file(c, file, &t0);
}

void cg_rules_eval(const cg_ruleset *rs, const char *text, const cg_dialog *d, const char *previous, int64_t now,
                   cg_rules_result *out)
{
    cg_rules_result_init(out);
    if (rs)
        cg_rules_eval_range(rs, 0, rs->n, text, d, previous, now, 1, out);
}

int cg_rules_cancels(const cg_ruleset *rs, const char *text)
{
    if (!rs)
        return 0;
    size_t len = strlen(text);
    if (len > CG_RULES_MAX_SCAN)
        len = cg_utf8_boundary(text, CG_RULES_MAX_SCAN);
    subject_mode mode = subject_mode_of(text, len);
    for (size_t i = 0; i < rs->n; i++) {
        const rule *r = &rs->rules[i];
        if ((r->action == A_CANCEL || r->action == A_CANCEL_ABSORB) && r->n_conds == 0 &&
            run_pattern(rs, r, text, len, mode) > 0)
            return 1;
    }
    return 0;
}
