/*
 * pipeline.h: what the gateway decides about one message before it goes upstream
 * (docs/architecture.md, "Data path"), in this order:
 *   1. cancel rules: clear awaiting; the message goes on with resolution cancel, or is
 *      absorbed (answered here, not forwarded) by `cancel absorb`;
 *   2. awaiting resolution (first, as docs/state.md "Awaiting" says): selection by number or by words
 *      against the options' fields, confirmation by the confirm rules, metadata by the
 *      metadata rules, input by any text; resolved messages go to the upstream that asked;
 *   3. extraction: params rules (normalised), forget rules, metadata annotations;
 *   4. merge into the dialog, within the params cap;
 *   5. soft context (priority 2): forwarded while fresh, never changes the route;
 *   6. enrichment (priority 3): follow-ups rewritten with the previous user message;
 *   7. route: route rules, else the awaiting source, else the default upstream.
 * Pure: the dialog is changed in place; the time is passed in. All or nothing: when the
 * merge is refused (error), nothing of the dialog has changed, awaiting included.
 */
#ifndef CHATGATE_PIPELINE_H
#define CHATGATE_PIPELINE_H

#include <jansson.h>

#include "chatgate/config/config.h"
#include "chatgate/dialog/dialog.h"
#include "chatgate/dialog/rules.h"

typedef struct cg_pipeline_result {
    int route;             /* index into the configured upstreams */
    int cancel;            /* a cancel rule fired */
    int absorb;            /* answer here (ack + empty done), do not forward */
    json_t *resolution;    /* {"type": ...} or NULL */
    char *enriched;        /* the rewritten message, or NULL */
    json_t *annotations;   /* {"metadata": {...}} */
    json_t *rules;         /* names of the rules that fired */
    json_t *limited;       /* rules cut off by a match limit */
    int soft_context_hit;  /* a fresh soft context goes along */
    json_t *remember;      /* attributes of the user's profile the rules took, or NULL */
    int error;             /* CG_E_TOO_LARGE: params over the cap; the dialog is as it was */
    char error_message[256];
} cg_pipeline_result;

/* The previous user message in d's history (its enriched form when it was rewritten), or NULL. */
const char *cg_pipeline_previous(const cg_dialog *d);

void cg_pipeline_run(const cg_config *cfg, const cg_ruleset *rs, cg_dialog *d, const char *text, int64_t now,
                     const cg_lifetimes *lt, cg_pipeline_result *out);
void cg_pipeline_result_free(cg_pipeline_result *r);

/* One message's turn on d, as the gateway runs it and `rules replay` replays it: counted
 * (message_count, last_activity), then decided (cg_pipeline_run). */
void cg_pipeline_begin(const cg_config *cfg, const cg_ruleset *rs, cg_dialog *d, const char *text, int64_t now,
                       const cg_lifetimes *lt, cg_pipeline_result *out);
/* The user's message into d's history at `at`, marked with its rewrite (enriched, or NULL). */
void cg_pipeline_keep_user(cg_dialog *d, const char *text, const char *enriched, int64_t at, const cg_lifetimes *lt);

/*
 * What one message decided, field by field: the one list both comparisons of two rule sets
 * use (the shadow set beside the live one, server/turn.c; `rules replay`, replay.c), and
 * the names the metrics and the replay's report give them.
 */
typedef enum {
    CG_OUTCOME_RULES,       /* the rules that fired */
    CG_OUTCOME_PARAMS,      /* the dialog's params after the message */
    CG_OUTCOME_RESOLUTION,  /* what it resolved, or null */
    CG_OUTCOME_ROUTE,       /* the upstream's name, "(absorbed)" or "(refused)" */
    CG_OUTCOME_ENRICHED,    /* the rewrite, or null */
    CG_OUTCOME_ANNOTATIONS, /* the metadata it carries */
    CG_OUTCOME_ERROR,       /* the refusal's message, or null */
    CG_OUTCOME_FIELDS       /* (a cancel rule shows in the resolution, {"type": "cancel"}, and an
                             * absorbed message in the route) */
} cg_outcome_field;
extern const char *const cg_outcome_names[CG_OUTCOME_FIELDS];

/* The outcome of res on d (after the run) as one JSON object of those fields, by name; NULL
 * out of memory. */
json_t *cg_pipeline_outcome(const cg_config *cfg, const cg_dialog *d, const cg_pipeline_result *res);
/* The fields in which two outcomes differ: bit (1 << field) each. */
unsigned cg_pipeline_outcome_diff(const json_t *a, const json_t *b);

/* Resolves text against awaiting selection options (array): the 1-based index or 0. */
int cg_pipeline_select(json_t *options, const char *text);

#endif
