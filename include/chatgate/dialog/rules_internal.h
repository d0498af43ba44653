/*
 * rules_internal.h: what the parts of the rules engine share. Only src/dialog/rules*.c
 * include it; everyone else sees rules.h, where a cg_ruleset is opaque.
 *
 * The engine is one set of compiled rules and four files that each do one thing with it:
 * rules.c owns the set (loading a directory or a text, references, the match context),
 * rules_parse.c turns a rule file's lines into rules, rules_normalise.c turns the words a
 * pattern captured into values, rules_eval.c runs a message against the set, and
 * rules_selftest.c runs the rules' own expect/reject lines. The types below are what a
 * rule file says once parsed; a set is read-only after loading, so evaluation may share it
 * (only its match data is written, by the one thread that evaluates).
 */
#ifndef CHATGATE_DIALOG_RULES_INTERNAL_H
#define CHATGATE_DIALOG_RULES_INTERNAL_H

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <stdint.h>
#include <stdio.h>

#include "chatgate/core/metrics.h"
#include "chatgate/dialog/dialog.h"

/* rules.h's types, by their tags: this header stands without rules.h (each rules*.c
 * includes both), so the include graph has no rules.c -> here -> rules.h loop. */
typedef struct cg_ruleset cg_ruleset;
struct cg_rules_result;

/* rules.h's cg_rules_counts: the set holds one (by value) */
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
    A_REMEMBER, /* an attribute of the user's profile (docs/state.md, "The user's profile") */
    /* `on reply` rules: on the upstream's text as it streams (rules_reply.c) */
    A_MASK,
    A_STOP,
    A_TAG,
} rule_action;

typedef enum { C_AWAITING, C_NO_AWAITING, C_SERVICE, C_HAS, C_HISTORY, C_TOOL, C_SOFT, C_PROFILE } cond_kind;
typedef enum { N_DATE, N_INT, N_AMOUNT, N_LOWER, N_CURRENCY, N_TITLE } normaliser;

typedef struct rule_cond {
    cond_kind kind;
    char arg[129];   /* C_TOOL, C_SOFT, C_PROFILE: the path inside the value ("" for the value itself) */
    char value[129]; /* C_TOOL, C_SOFT, C_PROFILE: what it must be ("" when only present) */
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
    json_t *name_json; /* the name as a JSON string, owned: what a message's list of fired
                        * (or limited) rules holds, made once, not at every match */
    const char *file; /* owned by the set's file list */
    size_t file_index; /* its place in that list */
    int line;
    char *pattern;
    int pattern_line;
    pcre2_code *re;
    /* the same pattern compiled without UTF and UCP, run instead of re on a subject that is
     * all ASCII (a message, or a reply's held text), where it matches the same at about half
     * the cost; NULL when the pattern has a character past ASCII outside a [class]
     * (rules_parse.c, ascii_equivalent) */
    pcre2_code *re_ascii;
    int jit, jit_ascii; /* re and re_ascii were JIT-compiled (not on every CPU) */
    int has_do;
    rule_action action;
    char arg[512];
    int case_sensitive;
    int on_reply; /* `on reply`: matched on replies, never on messages */
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
    cg_rules_counts counts; /* where evaluation counts what each rule did; zero: nowhere */
    int has_reply;          /* some rule is `on reply` (known at load: each reply asks) */
    /* every byte a match of a mask or stop reply rule can begin with, when PCRE2 knows it of
     * each of their patterns (rules.c, reply_first_bytes): a delta with none of them, and no
     * text held, passes those rules as it is (rules_reply.c) */
    unsigned char reply_first[32];
    int reply_first_known;
    int reads_previous;     /* some message rule enriches, or needs the history (cg_ruleset_reads_previous) */
};

/* The code r runs on a subject: its ASCII form when the subject is all ASCII and it has one. */
static inline const pcre2_code *cg_rule_code(const rule *r, int ascii)
{
    return ascii && r->re_ascii ? r->re_ascii : r->re;
}

/* rules.c: trims spaces and tabs at both ends, and line ends at the end, in place. */
char *cg_rules_trim(char *s);

/* rules_parse.c: reads one rule file into rs's rules; file is the path for messages (it
 * must live as long as the set). 0, or -1 with "file:line: message" in err. */
int cg_rules_parse_file(cg_ruleset *rs, const char *file, FILE *f, char *err, size_t errlen);

/* rules_eval.c: an empty result, and rules [from, to) of rs run on text into out (the
 * conditions are skipped when check_conditions is 0, as the rule tests do). */
void cg_rules_result_init(struct cg_rules_result *out);
void cg_rules_eval_range(const cg_ruleset *rs, size_t from, size_t to, const char *text, const cg_dialog *d,
                         const char *previous, int64_t now, int check_conditions,
                         struct cg_rules_result *out);

#endif
