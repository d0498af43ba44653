/*
 * rules_reply.c: rules on replies (`on reply`, rules/README.md): the upstream's text is
 * matched as it streams, and a match is masked (replaced), stops the reply, or tags it.
 *
 * Text arrives in deltas, and a match may be split across them ("+254 712" then
 * " 345 678"). The patterns are run with PCRE2's hard partial matching: where the text so
 * far ends inside what could still become a match, PCRE2 says so and where it began, and
 * only the text from there is held back until the next delta (or the reply's end). Text
 * that cannot begin a match goes to the client at once, masked: a reply that holds no
 * digits is never delayed by a phone number rule. A possible match is held for at most
 * `window` bytes (reply_window): past that, its rule is run again without partial matching,
 * as if the reply had ended there, and acts on what it finds (or lets the text go), so
 * nothing is held without bound and no other rule's match is passed over. Tag rules need no
 * hold: they run once, on the whole reply as the client got it, when it ends.
 *
 * Each rule is searched from the same place and the earliest match acts (a possible one
 * first on a tie, then the first rule in file order), then the search goes on after it:
 * masks never overlap. The last CONTEXT bytes already passed on stay in front of the held
 * text, so a lookbehind such as (?<!\d) sees what came before.
 */
#include <stdlib.h>
#include <string.h>

#include "chatgate/core/alloc.h"
#include "chatgate/core/buf.h"
#include "chatgate/core/log.h"
#include "chatgate/core/utf8.h"
#include "chatgate/dialog/rules.h"
#include "chatgate/dialog/rules_internal.h"

#define CONTEXT 16

struct cg_reply_filter {
    const cg_ruleset *rs;
    size_t window;
    char *held;       /* [0, ctx): passed on already, for lookbehinds; then the text come from the
                       * upstream and not passed on yet (raw: masks apply on output) */
    size_t held_len, held_cap, ctx;
    int held_ascii;   /* held is all ASCII: the rules' ASCII forms run on it (rule.re_ascii) */
    char *out;        /* what a feed passes on: reused from one delta to the next */
    size_t out_len, out_cap;
    json_t *acted;    /* rule name -> {"rule", "action", "count" | "tag"}, in the order they first acted */
    int stopped;
};

int cg_ruleset_has_reply_rules(const cg_ruleset *rs)
{
    return rs && rs->has_reply;
}

cg_reply_filter *cg_reply_filter_new(const cg_ruleset *rs, size_t window)
{
    if (!cg_ruleset_has_reply_rules(rs))
        return NULL;
    cg_reply_filter *f = cg_calloc(1, sizeof(*f));
    f->rs = rs;
    f->window = window;
    f->acted = json_object();
    return f;
}

void cg_reply_filter_free(cg_reply_filter *f)
{
    if (!f)
        return;
    free(f->held);
    free(f->out);
    json_decref(f->acted);
    free(f);
}

/* A rule acted: noted for the done frame, and counted once per reply among the rule's hits
 * (rules.h, cg_rules_counts) as a message rule is once per message. */
static void note_acted(cg_reply_filter *f, const rule *r)
{
    json_t *a = json_object_get(f->acted, r->name);
    if (a) {
        json_object_set_new(a, "count", json_integer(json_integer_value(json_object_get(a, "count")) + 1));
        return;
    }
    size_t i = (size_t)(r - f->rs->rules);
    if (f->rs->counts.hits && i < f->rs->counts.n_rules)
        f->rs->counts.hits[i]++;
    static const char *const names[] = {[A_MASK] = "mask", [A_STOP] = "stop", [A_TAG] = "tag"};
    a = json_pack("{s:s,s:s}", "rule", r->name, "action", names[r->action]);
    if (r->action == A_TAG)
        json_object_set_new(a, "tag", json_string(r->arg));
    else
        json_object_set_new(a, "count", json_integer(1));
    json_object_set_new(f->acted, r->name, a);
}

typedef struct reply_match {
    const rule *r;
    size_t start, end;
    int partial; /* the text ends inside what may still become a match, begun at start */
} reply_match;

/* One rule on held[from, len): 1 a match, 2 a possible one (partial), 0 none; its place in
 * the match data's ovector. */
static int run_reply_rule(cg_reply_filter *f, const rule *r, size_t from, int partial)
{
    const cg_ruleset *rs = f->rs;
    int rc = pcre2_match(cg_rule_code(r, f->held_ascii), (PCRE2_SPTR)f->held, f->held_len, from,
                         partial ? PCRE2_PARTIAL_HARD : 0, rs->md, rs->mctx);
    if (rc >= 0)
        return 1;
    if (rc == PCRE2_ERROR_PARTIAL)
        return 2;
    if (rc != PCRE2_ERROR_NOMATCH) {
        PCRE2_UCHAR why[120];
        pcre2_get_error_message(rc, why, sizeof(why));
        cg_warn("rules: reply rule '%s' (%s:%d) stopped: %s; counted as no match", r->name, r->file, r->line,
                (const char *)why);
    }
    return 0;
}

/* The earliest match, or possible match (unless final), of a mask or stop rule in
 * held[from, len); r NULL when none. An empty match is no match. A possible match longer
 * than the window is not waited for: that rule is run again as if the reply ended here. */
static reply_match earliest(cg_reply_filter *f, size_t from, int final)
{
    const cg_ruleset *rs = f->rs;
    reply_match best = {NULL, 0, 0, 0};
    for (size_t i = 0; i < rs->n; i++) {
        const rule *r = &rs->rules[i];
        if (!r->on_reply || r->action == A_TAG)
            continue;
        int rc = run_reply_rule(f, r, from, !final);
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(rs->md);
        if (rc == 2 && f->held_len - ov[0] > f->window)
            rc = run_reply_rule(f, r, from, 0);
        if (!rc)
            continue;
        int partial = rc == 2;
        if (!partial && ov[1] == ov[0])
            continue;
        if (!best.r || ov[0] < best.start || (ov[0] == best.start && partial && !best.partial))
            best = (reply_match){r, ov[0], partial ? f->held_len : ov[1], partial};
    }
    return best;
}

static void emit(cg_reply_filter *f, const char *s, size_t n)
{
    if (n)
        cg_buf_append(&f->out, &f->out_len, &f->out_cap, s, n, 256);
}

/* Keeps held[upto, len) and, before it, up to CONTEXT bytes already passed on (whole
 * characters), for the next delta's lookbehinds. */
static void keep_from(cg_reply_filter *f, size_t upto)
{
    size_t keep = upto < CONTEXT ? upto : CONTEXT;
    while (keep > 0 && ((unsigned char)f->held[upto - keep] & 0xC0) == 0x80)
        keep--;
    memmove(f->held, f->held + upto - keep, f->held_len - (upto - keep));
    f->held_len -= upto - keep;
    f->ctx = keep;
}

/* One delta (rules.h, cg_reply_filter_feed): what goes on now is appended to f->out. */
static int feed(cg_reply_filter *f, const char *text, size_t len, int final)
{
    cg_buf_append(&f->held, &f->held_len, &f->held_cap, text, len, 256);
    f->held_ascii = cg_utf8_ascii_prefix(f->held, f->held_len) == f->held_len; /* context and a delta */
    size_t pos = f->ctx, from = f->ctx; /* held[ctx, pos) is dealt with; the search goes on at from */
    size_t upto = f->held_len;          /* what may go now: all of it, unless a match may be under way */
    for (;;) {
        reply_match m = earliest(f, from, final);
        if (!m.r)
            break;
        if (m.partial) {
            upto = m.start; /* held from where it began (within the window), for the next delta */
            break;
        }
        emit(f, f->held + pos, m.start - pos);
        note_acted(f, m.r);
        if (m.r->action == A_STOP) {
            f->stopped = 1;
            return 1;
        }
        emit(f, m.r->arg, strlen(m.r->arg));
        pos = from = m.end;
    }
    if (upto > pos)
        emit(f, f->held + pos, upto - pos);
    else
        upto = pos;
    keep_from(f, upto);
    return 0;
}

/*
 * A delta no mask or stop rule can begin a match in (none of its bytes is one a match begins
 * with: the set's reply_first), while nothing is held: no match can start in it, nor in the
 * text before it, all passed on, so it goes as it came, and only its last CONTEXT bytes are
 * kept for the next delta's lookbehinds. Most deltas of most replies: running the rules'
 * patterns on each was a fifth of a relayed delta's instructions (issue 39's eighth round).
 */
static int passes(const cg_reply_filter *f, const char *text, size_t len)
{
    const cg_ruleset *rs = f->rs;
    if (!rs->reply_first_known || f->held_len != f->ctx)
        return 0;
    for (size_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)text[i];
        if (rs->reply_first[c / 8] & (1u << (c % 8)))
            return 0;
    }
    return 1;
}


int cg_reply_filter_feed(cg_reply_filter *f, const char *text, size_t len, int final, const char **out,
                         size_t *out_len)
{
    f->out_len = 0; /* the last delta's output has been passed on */
    if (!f->stopped && passes(f, text, len)) {
        cg_buf_append(&f->held, &f->held_len, &f->held_cap, text, len, 256);
        keep_from(f, f->held_len); /* all of it passed on: its last bytes are context */
        *out = text;
        *out_len = len;
        return 0;
    }
    int stopped = f->stopped || feed(f, text, len, final);
    *out = f->out;
    *out_len = f->out_len;
    return stopped;
}

void cg_reply_filter_tags(cg_reply_filter *f, const char *text, size_t len)
{
    const cg_ruleset *rs = f->rs;
    int ascii = cg_utf8_ascii_prefix(text, len) == len;
    for (size_t i = 0; i < rs->n; i++) {
        const rule *r = &rs->rules[i];
        if (r->on_reply && r->action == A_TAG &&
            pcre2_match(cg_rule_code(r, ascii), (PCRE2_SPTR)text, len, 0, 0, rs->md, rs->mctx) >= 0)
            note_acted(f, r);
    }
}

json_t *cg_reply_filter_acted(const cg_reply_filter *f)
{
    json_t *list = json_array();
    const char *name;
    json_t *a;
    json_object_foreach(f->acted, name, a)
        json_array_append(list, a);
    return list;
}
