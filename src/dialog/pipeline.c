/*
 * pipeline.c: the per-message decisions of pipeline.h, on the rules' verdict and the
 * dialog's state.
 */
#define _GNU_SOURCE /* strcasestr */
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chatgate/core/alloc.h"
#include "chatgate/core/error.h"
#include "chatgate/core/jsonout.h"
#include "chatgate/core/log.h"
#include "chatgate/dialog/pipeline.h"

const char *cg_pipeline_previous(const cg_dialog *d)
{
    for (size_t i = json_array_size(d->history); i > 0; i--) {
        json_t *m = json_array_get(d->history, i - 1);
        if (json_is_string(json_object_get(m, "role")) &&
            strcmp(json_string_value(json_object_get(m, "role")), "user") == 0) {
            /* as it was understood: "And tomorrow?" then "and in Osaka?" chain */
            json_t *enriched = json_object_get(m, "enriched");
            return json_is_string(enriched) ? json_string_value(enriched)
                                            : json_string_value(json_object_get(m, "content"));
        }
    }
    return NULL;
}

/* "2", "#2", "number 2", "option 2", "2nd", "second", "the second one", "last" */
static int selection_number(const char *text, int n_options)
{
    static const char *const ordinals[] = {"first", "second", "third", "fourth", "fifth",
                                           "sixth", "seventh", "eighth", "ninth", "tenth"};
    static const char *const cardinals[] = {"one", "two", "three", "four", "five",
                                            "six", "seven", "eight", "nine", "ten"};
    char s[64], *p;
    size_t n = 0;
    for (const char *c = text; *c && n < sizeof(s) - 1; c++)
        if (!strchr(".!?", *c))
            s[n++] = (char)tolower((unsigned char)*c);
    s[n] = 0;
    p = s;
    while (*p == ' ')
        p++;
    while (n > 0 && s[n - 1] == ' ')
        s[--n] = 0;
    static const char *const lead[] = {"the ", "number ", "option ", "no ", "#", "choice "};
    for (int again = 1; again;) {
        again = 0;
        for (size_t i = 0; i < sizeof(lead) / sizeof(lead[0]); i++)
            if (strncmp(p, lead[i], strlen(lead[i])) == 0) {
                p += strlen(lead[i]);
                again = 1;
            }
    }
    size_t len = strlen(p);
    if (len > 4 && strcmp(p + len - 4, " one") == 0)
        p[len - 4] = 0;
    char *end;
    long v = strtol(p, &end, 10);
    if (end != p && (!*end || !strcmp(end, "st") || !strcmp(end, "nd") || !strcmp(end, "rd") || !strcmp(end, "th")))
        return v >= 1 && v <= n_options ? (int)v : 0;
    for (int i = 0; i < 10; i++)
        if (strcmp(p, ordinals[i]) == 0 || strcmp(p, cardinals[i]) == 0)
            return i + 1 <= n_options ? i + 1 : 0;
    if (strcmp(p, "last") == 0)
        return n_options;
    return 0;
}

/* Does text hold word (case-insensitive, at word boundaries)? */
static int has_word(const char *text, const char *word)
{
    size_t n = strlen(word);
    if (n < 2)
        return 0;
    for (const char *hit = strcasestr(text, word); hit; hit = strcasestr(hit + 1, word)) {
        int before = hit == text || !isalnum((unsigned char)hit[-1]);
        int after = !isalnum((unsigned char)hit[n]);
        if (before && after)
            return 1;
    }
    return 0;
}

int cg_pipeline_select(json_t *options, const char *text)
{
    int n = (int)json_array_size(options);
    int by_number = selection_number(text, n);
    if (by_number)
        return by_number;
    /* by words: the option whose string fields the text names most, if only one does */
    int best = 0, best_score = 0, tie = 0;
    for (int i = 0; i < n; i++) {
        json_t *opt = json_array_get(options, (size_t)i);
        int score = 0;
        if (json_is_string(opt)) {
            score = has_word(text, json_string_value(opt));
        } else {
            const char *key;
            json_t *v;
            json_object_foreach(opt, key, v) if (json_is_string(v)) score += has_word(text, json_string_value(v));
        }
        if (score > best_score) {
            best_score = score;
            best = i + 1;
            tie = 0;
        } else if (score && score == best_score) {
            tie = 1;
        }
    }
    return best_score && !tie ? best : 0;
}

/* The awaiting state, resolved by this message, or NULL. */
static json_t *resolve_awaiting(const cg_dialog *d, const char *text, const cg_rules_result *rr)
{
    const char *type = json_string_value(json_object_get(d->awaiting, "type"));
    if (!type)
        return NULL;
    if (strcmp(type, "selection") == 0) {
        json_t *options = json_object_get(d->awaiting, "options");
        int i = cg_pipeline_select(options, text);
        if (i)
            return json_pack("{s:s, s:i, s:O}", "type", "selection", "index", i, "option",
                             json_array_get(options, (size_t)i - 1));
    } else if (strcmp(type, "confirmation") == 0) {
        if (rr->confirm >= 0)
            return json_pack("{s:s, s:b}", "type", "confirmation", "confirmed", rr->confirm);
    } else if (strcmp(type, "metadata") == 0) {
        void *it = json_object_iter(rr->metadata);
        if (it)
            return json_pack("{s:s, s:s, s:O}", "type", "metadata", "metadata_type", json_object_iter_key(it),
                             "content", json_object_iter_value(it));
    } else if (strcmp(type, "input") == 0) {
        return json_pack("{s:s, s:s}", "type", "input", "content", text);
    }
    return NULL;
}

static int upstream_index(const cg_config *cfg, const char *name)
{
    for (int i = 0; name && *name && i < cfg->n_upstreams; i++)
        if (strcmp(cfg->upstreams[i].name, name) == 0)
            return i;
    return -1;
}

void cg_pipeline_run(const cg_config *cfg, const cg_ruleset *rs, cg_dialog *d, const char *text, int64_t now,
                     const cg_lifetimes *lt, cg_pipeline_result *out)
{
    memset(out, 0, sizeof(*out));
    out->route = cfg->default_index;
    cg_rules_result rr;
    /* the previous message is a walk back through the history: only for rules that read it */
    cg_rules_eval(rs, text, d, cg_ruleset_reads_previous(rs) ? cg_pipeline_previous(d) : NULL, now, &rr);
    out->rules = json_incref(rr.fired);
    out->limited = json_incref(rr.limited);
    out->remember = json_incref(rr.remember);
    out->annotations = json_object();
    int asked = -1; /* the upstream whose awaiting this message resolved */

    /* 1. cancel, before everything; 2. awaiting resolution. Decided here, applied below
     * with the merge, so that a refused merge leaves the awaiting state as it was. */
    if (rr.cancel) {
        out->cancel = 1;
        out->absorb = rr.cancel == 2;
        out->resolution = json_pack("{s:s}", "type", "cancel");
    } else if (d->awaiting) {
        out->resolution = resolve_awaiting(d, text, &rr);
        if (out->resolution)
            asked = upstream_index(cfg, json_string_value(json_object_get(d->awaiting, "source")));
    }

    /* 3, 4. extraction and merge: every service or none (the cap applies to the whole) */
    int rc = json_object_size(rr.params)
                 ? cg_dialog_merge_all_params(d, rr.params, lt, out->error_message, sizeof(out->error_message))
                 : 0;
    if (rc < 0) {
        /* refused: the dialog is as it was before the message, and nothing was resolved */
        out->error = rc;
        out->cancel = out->absorb = 0;
        json_decref(out->resolution);
        out->resolution = NULL;
        goto done;
    }
    if (rr.cancel || out->resolution) {
        json_decref(d->awaiting);
        d->awaiting = NULL;
    }
    if (rr.service[0] && (!d->service || strcmp(d->service, rr.service) != 0)) {
        free(d->service);
        d->service = cg_strdup(rr.service);
    }
    cg_dialog_forget(d, rr.forget);
    if (json_object_size(rr.metadata))
        json_object_set(out->annotations, "metadata", rr.metadata);

    /* 5. soft context: it travels with the dialog while fresh */
    out->soft_context_hit = d->soft != NULL && !out->resolution;

    /* 6. enrichment */
    if (rr.enriched && !out->resolution) {
        out->enriched = rr.enriched;
        rr.enriched = NULL;
    }

    /* 7. route */
    int routed = upstream_index(cfg, rr.route);
    if (rr.route[0] && routed < 0)
        cg_warn("rules: route to '%s', which is not a configured upstream; using the default", rr.route);
    out->route = routed >= 0 ? routed : asked >= 0 ? asked : cfg->default_index;
done:
    cg_rules_result_free(&rr);
}

void cg_pipeline_begin(const cg_config *cfg, const cg_ruleset *rs, cg_dialog *d, const char *text, int64_t now,
                       const cg_lifetimes *lt, cg_pipeline_result *out)
{
    d->message_count++;
    d->last_activity = now;
    cg_pipeline_run(cfg, rs, d, text, now, lt, out);
}

void cg_pipeline_keep_user(cg_dialog *d, const char *text, const char *enriched, int64_t at, const cg_lifetimes *lt)
{
    json_t *m = cg_dialog_push_history(d, "user", text, at, lt);
    if (m && enriched) /* a mark that fails (out of memory) is only left out */
        json_object_set_new_nocheck(m, "enriched", cg_json_string(enriched));
}

const char *const cg_outcome_names[CG_OUTCOME_FIELDS] = {
    "rules", "params", "resolution", "route", "enriched", "annotations", "error",
};

json_t *cg_pipeline_outcome(const cg_config *cfg, const cg_dialog *d, const cg_pipeline_result *res)
{
    /* an absorbed or refused message goes nowhere: its route says so rather than a name */
    const char *route = res->error ? "(refused)" : res->absorb ? "(absorbed)" : cfg->upstreams[res->route].name;
    json_t *o = json_object();
    json_t *v[CG_OUTCOME_FIELDS] = {
        [CG_OUTCOME_RULES] = res->rules ? json_incref(res->rules) : json_array(),
        [CG_OUTCOME_PARAMS] = json_deep_copy(d->params),
        [CG_OUTCOME_RESOLUTION] = res->resolution ? json_incref(res->resolution) : json_null(),
        [CG_OUTCOME_ROUTE] = json_string(route),
        [CG_OUTCOME_ENRICHED] = res->enriched ? json_string(res->enriched) : json_null(),
        [CG_OUTCOME_ANNOTATIONS] = res->annotations ? json_incref(res->annotations) : json_null(),
        [CG_OUTCOME_ERROR] = res->error ? json_string(res->error_message) : json_null(),
    };
    int ok = o != NULL;
    for (int i = 0; i < CG_OUTCOME_FIELDS; i++)
        ok &= v[i] && json_object_set_new(o, cg_outcome_names[i], v[i]) == 0; /* set_new takes v[i] either way */
    if (!ok) {
        json_decref(o);
        return NULL;
    }
    return o;
}

unsigned cg_pipeline_outcome_diff(const json_t *a, const json_t *b)
{
    unsigned differs = 0;
    for (int i = 0; i < CG_OUTCOME_FIELDS; i++)
        if (!json_equal(json_object_get(a, cg_outcome_names[i]), json_object_get(b, cg_outcome_names[i])))
            differs |= 1u << i;
    return differs;
}

void cg_pipeline_result_free(cg_pipeline_result *r)
{
    json_decref(r->resolution);
    json_decref(r->annotations);
    json_decref(r->rules);
    json_decref(r->limited);
    json_decref(r->remember);
    free(r->enriched);
    memset(r, 0, sizeof(*r));
}
