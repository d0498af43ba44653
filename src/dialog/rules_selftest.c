/*
 * rules_selftest.c: the rules' own tests, the `expect` and `reject` lines of rule files
 * (cg_rules_check; `chatgate rules check DIR` runs it, and so can CI on a user's rules).
 *
 * Each line runs its one rule alone, with its `when` conditions taken as true and a fixed
 * previous message, so a rule is tested for what its pattern and normalisers do and not for
 * the dialog it happens to meet. The caller passes the clock: `chatgate rules check` uses
 * 2026-02-03T10:00:00Z, the clock rules/README.md promises the `expect` lines that name
 * dates. Failures are printed as "file:line: ..." at the expect/reject line, to be fixed in
 * an editor like a compiler's.
 */
#include <stdlib.h>
#include <string.h>

#include "chatgate/core/alloc.h"
#include "chatgate/dialog/rules.h"
#include "chatgate/dialog/rules_internal.h"

/* The rule's own output for a name of an expect line, as text. */
static char *actual_value(const rule *r, const cg_rules_result *res, const char *name)
{
    json_t *v = NULL;
    if (r->action == A_PARAMS)
        v = json_object_get(json_object_get(res->params, r->arg), name);
    else if (r->action == A_METADATA && strcmp(name, "content") == 0)
        v = json_object_get(res->metadata, r->arg);
    else if (r->action == A_REMEMBER)
        v = json_object_get(res->remember, name);
    else if (r->action == A_ENRICH && strcmp(name, "enriched") == 0 && res->enriched)
        return cg_strdup(res->enriched);
    if (!v)
        return NULL;
    if (json_is_string(v))
        return cg_strdup(json_string_value(v));
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
            cg_rules_result_init(&res);
            cg_rules_eval_range(rs, i, i + 1, t->text, NULL, CHECK_PREVIOUS, now, 0, &res);
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
