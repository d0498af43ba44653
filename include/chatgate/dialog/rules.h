/*
 * rules.h: rule files (rules/README.md): PCRE2 patterns that say what a message
 * cancels, confirms, selects, adds or asks again.
 *
 * A rule set is loaded from a directory's *.rules files in file-name order, compiled once
 * (UTF, UCP, caseless unless `option case`, DUPNAMES; JIT) and shared read-only: sessions
 * hold a reference, so a reload (SIGHUP) swaps the set while messages in flight finish with
 * the one they started with. Matching is bounded: the subject is cut at CG_RULES_MAX_SCAN
 * bytes, and a match limit and a sized JIT stack stop any pattern from stalling the loop;
 * a rule cut off by a limit counts as no match and is reported in `limited`.
 *
 * Pure: no I/O after loading, no clock (the time is passed in).
 */
#ifndef CHATGATE_RULES_H
#define CHATGATE_RULES_H

#include <jansson.h>
#include <stdint.h>
#include <stdio.h>

#include "chatgate/core/metrics.h"
#include "chatgate/dialog/dialog.h"

#define CG_RULES_MAX_SCAN 4096   /* bytes of a message the patterns see */
#define CG_RULES_MATCH_LIMIT 100000

typedef struct cg_ruleset cg_ruleset;

/* Loads every *.rules file of dir. 0, or -1 with "file:line: message" in err. */
int cg_rules_load(const char *dir, cg_ruleset **out, char *err, size_t errlen);
/* The same from one file's text held in memory (name is used in messages); for fuzzing. */
int cg_rules_load_text(const char *name, const char *text, size_t len, cg_ruleset **out, char *err, size_t errlen);
cg_ruleset *cg_ruleset_ref(cg_ruleset *rs);
void cg_ruleset_unref(cg_ruleset *rs);
size_t cg_ruleset_count(const cg_ruleset *rs);
/* Rule i of the set (file order): its name, with its file's index and its line; NULL past the end. */
const char *cg_ruleset_rule(const cg_ruleset *rs, size_t i, size_t *file, int *line);
/* The set's files, in load order: how many, and file i's path. */
size_t cg_ruleset_files(const cg_ruleset *rs);
const char *cg_ruleset_file(const cg_ruleset *rs, size_t i);
/* File i's base name (its directory is the config's: what /metrics and the admin API show). */
const char *cg_ruleset_file_name(const cg_ruleset *rs, size_t i);

/*
 * Per-rule figures (/metrics, GET /admin/rules): once counts are attached to a set, every
 * cg_rules_eval on it adds each rule's hit and match-limit cut-off, by the rule's index
 * (rules past n_rules are not counted), and observes the time each file's rules took
 * (monotonic clock: the one thing evaluation reads besides its arguments). The arrays are
 * the caller's (the gateway's metrics) and must outlive the set's use.
 */
typedef struct cg_rules_counts {
    unsigned long *hits, *limited; /* by rule index, up to n_rules */
    size_t n_rules;
    cg_histogram *file_time;       /* seconds a message spent in each file's rules, up to n_files */
    size_t n_files;
} cg_rules_counts;
void cg_ruleset_count_into(cg_ruleset *rs, const cg_rules_counts *counts);

/* What the rules say about one message. */
typedef struct cg_rules_result {
    int cancel;          /* 0; 1 cancel (forwarded with resolution cancel); 2 cancel absorb */
    int confirm;         /* -1 none, 0 no, 1 yes */
    json_t *metadata;    /* {"must_try": "shroom burger"}, or NULL: none */
    char service[65];    /* the service of the last params rule that fired, or "" */
    json_t *params;      /* {"travel": {"from": "Nairobi"}}, normalised */
    json_t *forget;      /* ["travel.from", "from"], or NULL: none */
    json_t *remember;    /* the user's profile: {"home_city": "Nairobi"}, or NULL: none */
    char *enriched;      /* the rewritten message, or NULL */
    char route[65];      /* a route rule's upstream, or "" */
    json_t *fired;       /* names of the rules that fired, in order */
    json_t *limited;     /* names of rules cut off by a match limit, or NULL: none */
} cg_rules_result;

/*
 * Evaluates every rule on text. d gives the `when` conditions (may be NULL: none hold but
 * those that need nothing); previous is the previous user message for {previous} (may be
 * NULL: enrich rules then do not fire); now is unix seconds for the date normaliser.
 */
void cg_rules_eval(const cg_ruleset *rs, const char *text, const cg_dialog *d, const char *previous, int64_t now,
                   cg_rules_result *out);
void cg_rules_result_free(cg_rules_result *r);

/* Does a cancel rule without conditions match text? The check a message gets on arrival,
 * before its dialog is loaded (docs/architecture.md): only those rules run, nothing else. */
int cg_rules_cancels(const cg_ruleset *rs, const char *text);

/* Runs the expect/reject lines of every rule at the clock `now`; prints each failure as
 * "file:line: ..." to out and returns how many failed. */
int cg_rules_check(const cg_ruleset *rs, int64_t now, FILE *out, int *n_tests);

/*
 * Rules on replies (`on reply`: mask, stop, tag; rules/README.md): a filter over one
 * reply's text as it streams (rules_reply.c). It holds back only text that may begin a
 * match (PCRE2 partial matching), at most `window` bytes of it, so a match split across
 * deltas is caught. The set must outlive the filter.
 */
typedef struct cg_reply_filter cg_reply_filter;
int cg_ruleset_has_reply_rules(const cg_ruleset *rs);
/* Whether the set's message rules read the previous user message (an enrich rule, or a
 * `history` condition): the pipeline looks it up in the history only then. */
int cg_ruleset_reads_previous(const cg_ruleset *rs);
/* A filter for one reply; NULL when the set has no reply rules (nothing to do or hold). */
cg_reply_filter *cg_reply_filter_new(const cg_ruleset *rs, size_t window);
void cg_reply_filter_free(cg_reply_filter *f);
/* Feeds len bytes of the reply (final: it ended, nothing more comes): the text the client
 * may have now, masked, is *out (*out_len bytes, maybe 0; the filter's buffer, good until
 * the next feed, reused so that a delta costs no allocation; or text itself, when no rule
 * could act on it). 0, or 1 when a stop rule
 * matched: *out is the text before the match, and nothing more goes. */
int cg_reply_filter_feed(cg_reply_filter *f, const char *text, size_t len, int final, const char **out,
                         size_t *out_len);
/* Runs the tag rules on the whole reply as the client got it (once, at its end). */
void cg_reply_filter_tags(cg_reply_filter *f, const char *text, size_t len);
/* What acted on the reply, in the order each first did: a new array of
 * {"rule", "action": "mask"|"stop"|"tag", "count" (mask, stop) | "tag"}. */
json_t *cg_reply_filter_acted(const cg_reply_filter *f);

/* Normalisers (rules/README.md), in the process's time zone (TZ: main sets it from
 * --timezone, UTC by default). 0, or -1 when in is not one. */
int cg_normalise_date(const char *in, int64_t now, char out[11]);
int cg_normalise_int(const char *in, long *out);
/* "5000 shillings" -> 5000, "KES"; "3k" -> 3000, ""; currency is "" when none is said */
int cg_normalise_amount(const char *in, double *amount, char currency[4]);
/* The currency in ("euros", "KSh", "$") as its ISO code: 0, or -1 when it names none. */
int cg_normalise_currency(const char *in, char code[4]);
/* Each word's first ASCII letter in capitals ("new york" -> "New York"), in place. */
void cg_normalise_title(char *s);

#endif
