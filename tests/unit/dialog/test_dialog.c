/*
 * test_dialog.c: the dialog model: merge (new > cached > defaults), the params cap,
 * all or nothing over several services (in the pipeline and in a directive), forget with
 * service names of any length, state directives, expiry, history FIFO, and the JSON round
 * trip the stores use.
 */
#include <stdlib.h>

#include "chatgate/dialog/dialog.h"
#include "chatgate/core/error.h"
#include "chatgate/dialog/pipeline.h"
#include "chatgate/dialog/rules.h"
#include "unit.h"

static cg_lifetimes lt;

static const char *param(const cg_dialog *d, const char *service, const char *name)
{
    return json_string_value(json_object_get(json_object_get(d->params, service), name));
}

static void test_merge(void)
{
    cg_dialog d;
    char err[256];
    cg_dialog_init(&d, 1000);
    json_t *p1 = json_pack("{s:s, s:s, s:s}", "from", "Nairobi", "to", "London", "departure_date", "2026-02-10");
    CHECK(cg_dialog_merge_params(&d, "travel", p1, &lt, err, sizeof(err)) == 0);
    json_t *p2 = json_pack("{s:s, s:s}", "return_date", "2026-02-20", "from", "Mombasa");
    CHECK(cg_dialog_merge_params(&d, "travel", p2, &lt, err, sizeof(err)) == 0);
    CHECK_STR(param(&d, "travel", "from"), "Mombasa"); /* new over cached */
    CHECK_STR(param(&d, "travel", "to"), "London");
    CHECK_STR(param(&d, "travel", "return_date"), "2026-02-20");

    json_t *defaults = json_pack("{s:s, s:s}", "cabin_class", "economy", "to", "Paris");
    json_t *merged = cg_dialog_params_merged(&d, "travel", defaults);
    CHECK_STR(json_string_value(json_object_get(merged, "cabin_class")), "economy"); /* defaults under */
    CHECK_STR(json_string_value(json_object_get(merged, "to")), "London");          /* cached over defaults */
    json_decref(merged);

    /* a null value forgets; services stay apart */
    json_t *p3 = json_pack("{s:n}", "return_date");
    CHECK(cg_dialog_merge_params(&d, "travel", p3, &lt, err, sizeof(err)) == 0);
    CHECK(param(&d, "travel", "return_date") == NULL);
    json_t *p4 = json_pack("{s:i, s:s}", "amount", 5000, "currency", "KES");
    CHECK(cg_dialog_merge_params(&d, "payment", p4, &lt, err, sizeof(err)) == 0);
    CHECK_STR(param(&d, "travel", "to"), "London");
    CHECK(json_integer_value(json_object_get(json_object_get(d.params, "payment"), "amount")) == 5000);

    /* a merge that changes nothing keeps the params object (the Redis save compares by
     * pointer first); any value that differs, or a null naming something held, replaces it */
    json_t *before = d.params;
    json_t *same = json_pack("{s:s, s:n}", "to", "London", "return_date");
    CHECK(cg_dialog_merge_params(&d, "travel", same, &lt, err, sizeof(err)) == 0);
    CHECK(d.params == before);
    json_t *other = json_pack("{s:s}", "to", "Paris");
    CHECK(cg_dialog_merge_params(&d, "travel", other, &lt, err, sizeof(err)) == 0);
    CHECK(d.params != before);
    CHECK_STR(param(&d, "travel", "to"), "Paris");
    before = d.params;
    json_t *drop = json_pack("{s:n}", "to");
    CHECK(cg_dialog_merge_params(&d, "travel", drop, &lt, err, sizeof(err)) == 0);
    CHECK(d.params != before && param(&d, "travel", "to") == NULL);
    json_decref(same);
    json_decref(other);
    json_decref(drop);

    /* forget: "service.name", or a name of the active service */
    d.service = strdup("travel");
    json_t *keys = json_pack("[s, s, s]", "payment.currency", "from", "nosuch.thing");
    CHECK(cg_dialog_forget(&d, keys) == 2);
    CHECK(param(&d, "travel", "from") == NULL);
    CHECK(json_object_get(json_object_get(d.params, "payment"), "currency") == NULL);

    json_decref(keys);
    json_decref(defaults);
    json_decref(p1);
    json_decref(p2);
    json_decref(p3);
    json_decref(p4);
    cg_dialog_free(&d);
}

static void test_cap(void)
{
    cg_dialog d;
    char err[256];
    cg_lifetimes small = lt;
    small.params_cap = 100;
    cg_dialog_init(&d, 0);
    json_t *ok = json_pack("{s:s}", "from", "Nairobi");
    CHECK(cg_dialog_merge_params(&d, "travel", ok, &small, err, sizeof(err)) == 0);
    char big[200];
    memset(big, 'x', sizeof(big) - 1);
    big[sizeof(big) - 1] = 0;
    json_t *toobig = json_pack("{s:s, s:s}", "to", big, "from", "Mombasa");
    CHECK(cg_dialog_merge_params(&d, "travel", toobig, &small, err, sizeof(err)) == CG_E_TOO_LARGE);
    CHECK(strstr(err, "over the 100-byte cap") != NULL);
    CHECK_STR(param(&d, "travel", "from"), "Nairobi"); /* nothing changed, nothing truncated */
    CHECK(param(&d, "travel", "to") == NULL);
    /* the cap is the exact compact size: at it, taken; a byte under it, refused with the size
     * (the bound that spares writing the params out is well over it here) */
    json_t *edge = json_pack("{s:s}", "to", "London \"Heathrow\"");
    cg_dialog probe;
    cg_dialog_init(&probe, 0);
    CHECK(cg_dialog_merge_params(&probe, "travel", ok, &lt, err, sizeof(err)) == 0);
    CHECK(cg_dialog_merge_params(&probe, "travel", edge, &lt, err, sizeof(err)) == 0);
    long exact = (long)json_dumpb(probe.params, NULL, 0, JSON_COMPACT);
    small.params_cap = exact - 1;
    CHECK(cg_dialog_merge_params(&d, "travel", edge, &small, err, sizeof(err)) == CG_E_TOO_LARGE);
    char want[64];
    snprintf(want, sizeof(want), "would take %ld bytes", exact);
    CHECK(strstr(err, want) != NULL);
    small.params_cap = exact;
    CHECK(cg_dialog_merge_params(&d, "travel", edge, &small, err, sizeof(err)) == 0);
    CHECK_STR(param(&d, "travel", "to"), "London \"Heathrow\"");
    /* a merge that changes nothing is still held to the cap (lowered by a reload since):
     * refused as any merge would be */
    small.params_cap = exact - 1;
    CHECK(cg_dialog_merge_params(&d, "travel", edge, &small, err, sizeof(err)) == CG_E_TOO_LARGE);
    CHECK(strstr(err, want) != NULL);
    cg_dialog_free(&probe);
    json_decref(edge);
    json_decref(ok);
    json_decref(toobig);
    cg_dialog_free(&d);
}

/* The whole dialog as text, to compare before and after. */
static char *dialog_text(const cg_dialog *d)
{
    json_t *j = cg_dialog_to_json(d);
    char *s = json_dumps(j, JSON_COMPACT | JSON_SORT_KEYS);
    json_decref(j);
    return s;
}

/*
 * Two services' params from one message, the second over the cap (issue 9, defect 12):
 * the first was merged and the awaiting state cleared before the second was refused, and
 * that half state was saved. Now the message changes nothing.
 */
static void test_pipeline_cap_all_or_nothing(void)
{
    static const char rules[] = "rule small_one\n  match \\bsmall\\s+(?<x>\\w+)\n  do params alpha\n"
                                "rule big_one\n  match \\bbig\\s+(?<y>\\w+)\n  do params beta\n";
    cg_ruleset *rs = NULL;
    char err[256];
    CHECK(cg_rules_load_text("test.rules", rules, strlen(rules), &rs, err, sizeof(err)) == 0);
    if (!rs) {
        fprintf(stderr, "rules: %s\n", err);
        return;
    }
    static cg_config cfg;
    cfg.n_upstreams = 1;
    cfg.upstreams[0].name = "app";
    cg_lifetimes small = lt;
    small.params_cap = 64;

    cg_dialog d;
    cg_dialog_init(&d, 1000);
    d.service = strdup("gamma");
    d.awaiting = json_pack("{s:s, s:s}", "type", "input", "source", "app"); /* any text resolves it */
    d.awaiting_expires = 5000;
    json_t *kept = json_pack("{s:s}", "z", "kept");
    CHECK(cg_dialog_merge_params(&d, "gamma", kept, &small, err, sizeof(err)) == 0);
    char *before = dialog_text(&d);

    char text[200];
    snprintf(text, sizeof(text), "small one big %0100d", 7);
    cg_pipeline_result p;
    cg_pipeline_run(&cfg, rs, &d, text, 1001, &small, &p);
    CHECK(p.error == CG_E_TOO_LARGE);
    CHECK(strstr(p.error_message, "over the 64-byte cap") != NULL);
    CHECK(p.resolution == NULL); /* nothing was resolved either */
    char *after = dialog_text(&d);
    CHECK_STR(after, before);
    CHECK(param(&d, "alpha", "x") == NULL);
    CHECK(d.awaiting != NULL);
    cg_pipeline_result_free(&p);
    free(after);

    /* within the cap, both services land and the awaiting state is resolved */
    cg_pipeline_run(&cfg, rs, &d, "small one big two", 1002, &small, &p);
    CHECK(p.error == 0);
    CHECK_STR(param(&d, "alpha", "x"), "one");
    CHECK_STR(param(&d, "beta", "y"), "two");
    CHECK(d.awaiting == NULL);
    CHECK_STR(json_string_value(json_object_get(p.resolution, "type")), "input");
    cg_pipeline_result_free(&p);

    free(before);
    json_decref(kept);
    cg_dialog_free(&d);
    cg_ruleset_unref(rs);
}

/* A directive refused for its params changes nothing, service and awaiting included. */
static void test_directive_all_or_nothing(void)
{
    cg_dialog d;
    char err[256];
    cg_lifetimes small = lt;
    small.params_cap = 64;
    cg_dialog_init(&d, 1000);
    d.service = strdup("travel");
    char *before = dialog_text(&d);
    char big[120];
    memset(big, 'x', sizeof(big) - 1);
    big[sizeof(big) - 1] = 0;
    json_t *state = json_pack("{s:s, s:{s:s}, s:{s:s}, s:{s:i}, s:[i]}", "service", "food", "params", "city", big,
                              "awaiting", "type", "confirmation", "soft_context", "n", 1, "last_tool_result", 1);
    CHECK(cg_dialog_apply_directive(&d, state, "app", 1001, &small, err, sizeof(err)) == CG_E_TOO_LARGE);
    char *after = dialog_text(&d);
    CHECK_STR(after, before);
    CHECK_STR(d.service, "travel");
    free(before);
    free(after);
    json_decref(state);
    cg_dialog_free(&d);
}

/* "service.name" keys whose service is longer than any fixed buffer still name it. */
static void test_forget_long_service(void)
{
    cg_dialog d;
    char err[256];
    cg_dialog_init(&d, 0);
    d.service = strdup("other");
    char service[301];
    memset(service, 's', 300);
    service[300] = 0;
    json_t *p = json_pack("{s:s}", "name", "v");
    CHECK(cg_dialog_merge_params(&d, service, p, &lt, err, sizeof(err)) == 0);
    char key[320];
    snprintf(key, sizeof(key), "%s.name", service);
    json_t *keys = json_pack("[s]", key);
    CHECK(cg_dialog_forget(&d, keys) == 1);
    CHECK(json_object_size(d.params) == 0);
    json_decref(keys);
    json_decref(p);
    cg_dialog_free(&d);
}

static void test_directive_and_expiry(void)
{
    cg_dialog d;
    char err[256];
    cg_dialog_init(&d, 1000);
    json_error_t jerr;
    json_t *state = json_loads("{\"service\":\"food\",\"params\":{\"city\":\"Tokyo\"},"
                               "\"awaiting\":{\"type\":\"selection\",\"options\":[{\"name\":\"Shake Shack\"}],"
                               "\"context\":{\"selection_type\":\"venue\"},\"ttl\":60},"
                               "\"soft_context\":{\"last_action\":\"added_venue\"},\"last_tool_result\":[1,2]}",
                               0, &jerr);
    CHECK(cg_dialog_apply_directive(&d, state, "app", 1000, &lt, err, sizeof(err)) == 0);
    CHECK_STR(d.service, "food");
    CHECK_STR(param(&d, "food", "city"), "Tokyo");
    CHECK_STR(json_string_value(json_object_get(d.awaiting, "source")), "app");
    CHECK(d.awaiting_expires == 1060);
    CHECK(d.soft_expires == 1000 + lt.soft_s);
    CHECK(json_array_size(d.last_tool_result) == 2);

    cg_dialog_expire(&d, 1059);
    CHECK(d.awaiting != NULL);
    cg_dialog_expire(&d, 1060);
    CHECK(d.awaiting == NULL); /* 60 s later: gone */
    CHECK(d.soft != NULL);
    cg_dialog_expire(&d, 1000 + lt.soft_s);
    CHECK(d.soft == NULL);

    json_t *clear = json_loads("{\"awaiting\":{\"type\":\"confirmation\"}}", 0, NULL);
    CHECK(cg_dialog_apply_directive(&d, clear, "app", 2000, &lt, err, sizeof(err)) == 0);
    CHECK(d.awaiting_expires == 2000 + lt.awaiting_s); /* the default lifetime */
    json_t *null_awaiting = json_loads("{\"awaiting\":null}", 0, NULL);
    CHECK(cg_dialog_apply_directive(&d, null_awaiting, "app", 2001, &lt, err, sizeof(err)) == 0);
    CHECK(d.awaiting == NULL);
    json_t *bad = json_loads("{\"awaiting\":{\"type\":\"telepathy\"}}", 0, NULL);
    CHECK(cg_dialog_apply_directive(&d, bad, "app", 2001, &lt, err, sizeof(err)) == CG_E_BAD_FRAME);

    json_decref(state);
    json_decref(clear);
    json_decref(null_awaiting);
    json_decref(bad);
    cg_dialog_free(&d);
}

static void test_history_and_round_trip(void)
{
    cg_dialog d, back;
    cg_dialog_init(&d, 100);
    char text[32];
    for (int i = 1; i <= 12; i++) {
        snprintf(text, sizeof(text), "m%d", i);
        cg_dialog_push_history(&d, i % 2 ? "user" : "assistant", text, 100 + i, &lt);
    }
    CHECK(json_array_size(d.history) == 10); /* FIFO at N = 10 */
    CHECK_STR(json_string_value(json_object_get(json_array_get(d.history, 0), "content")), "m3");
    CHECK_STR(json_string_value(json_object_get(json_array_get(d.history, 9), "content")), "m12");

    d.service = strdup("travel");
    d.turn_count = 6;
    d.message_count = 7;
    json_t *p = json_pack("{s:s}", "from", "Nairobi");
    char err[64];
    cg_dialog_merge_params(&d, "travel", p, &lt, err, sizeof(err));
    d.soft = json_pack("{s:s}", "last_item_name", "Shake Shack");
    d.soft_expires = 500;
    json_t *j = cg_dialog_to_json(&d);
    cg_dialog_from_json(&back, j, 200);
    CHECK_STR(back.service, "travel");
    CHECK_STR(param(&back, "travel", "from"), "Nairobi");
    CHECK(back.turn_count == 6 && back.message_count == 7 && back.created_at == 100);
    CHECK(json_array_size(back.history) == 10);
    CHECK(back.soft != NULL && back.soft_expires == 500);
    cg_dialog_free(&back);
    cg_dialog_from_json(&back, j, 600); /* read after the soft context's time */
    CHECK(back.soft == NULL);
    cg_dialog_free(&back);

    /* adopting shares j's parts: the same dialog, and j's parts are d's now */
    cg_dialog_adopt_json(&back, j, 200);
    CHECK_STR(param(&back, "travel", "from"), "Nairobi");
    CHECK(back.params == json_object_get(j, "params"));
    CHECK(back.history == json_object_get(j, "history"));
    CHECK(back.turn_count == 6 && back.soft_expires == 500);
    cg_dialog_free(&back);
    CHECK(json_object_get(j, "params") != NULL); /* j still holds its own reference */

    /* a copy: the parts shared (they are values, dialog.h), the history a new array of the
     * same items; what the dialog's functions change in the copy is replaced there, so the
     * original does not change; the weight close to JSON's */
    cg_dialog copy;
    CHECK(cg_dialog_copy(&copy, &d) == 0);
    CHECK(copy.params == d.params && copy.soft == d.soft);
    CHECK(copy.history != d.history && json_array_size(copy.history) == 10);
    CHECK(json_array_get(copy.history, 3) == json_array_get(d.history, 3));
    CHECK_STR(copy.service, "travel");
    CHECK(copy.service != d.service);
    json_t *to = json_pack("{s:s}", "to", "London");
    CHECK(cg_dialog_merge_params(&copy, "travel", to, &lt, err, sizeof(err)) == 0);
    json_decref(to);
    CHECK_STR(param(&copy, "travel", "to"), "London");
    CHECK(param(&d, "travel", "to") == NULL); /* the original's params did not change */
    json_t *forget = json_pack("[s]", "travel.from");
    CHECK(cg_dialog_forget(&copy, forget) == 1);
    json_decref(forget);
    CHECK(param(&copy, "travel", "from") == NULL);
    CHECK_STR(param(&d, "travel", "from"), "Nairobi");
    cg_dialog_add_usage(&d, "llm", 10, 20);
    cg_dialog shares;
    CHECK(cg_dialog_copy(&shares, &d) == 0);
    cg_dialog_add_usage(&shares, "llm", 1, 2);
    cg_dialog_add_usage(&shares, "app", 3, 4);
    CHECK(json_integer_value(json_object_get(json_object_get(d.usage, "llm"), "in")) == 10);
    CHECK(json_object_get(d.usage, "app") == NULL);
    CHECK(json_integer_value(json_object_get(json_object_get(shares.usage, "llm"), "out")) == 22);
    CHECK(json_integer_value(json_object_get(json_object_get(shares.usage, "llm"), "turns")) == 2);
    CHECK(json_integer_value(json_object_get(json_object_get(shares.usage, "app"), "turns")) == 1);
    cg_dialog_free(&shares);
    size_t weight = cg_dialog_weight(&d), compact = json_dumpb(j, NULL, 0, JSON_COMPACT);
    CHECK(weight > compact / 2 && weight < compact * 2);
    cg_dialog_free(&copy);

    char *summary = cg_dialog_summary(&d, json_object_get(d.params, "travel"), NULL, NULL, NULL, NULL);
    CHECK(strstr(summary, "\"from\":\"Nairobi\"") != NULL);
    CHECK(strstr(summary, "\"service\":\"travel\"") != NULL);
    free(summary);

    json_decref(j);
    json_decref(p);
    cg_dialog_free(&d);
}

/* cg_dialog_history_kept: how a turn's history goes on from a copy kept before it */
static void test_history_kept(void)
{
    cg_dialog d;
    cg_dialog_init(&d, 100);
    json_t *empty = json_array();
    CHECK(cg_dialog_history_kept(empty, d.history) == 0); /* nothing kept: all of it new */
    for (int i = 1; i <= 4; i++)
        cg_dialog_push_history(&d, "user", "m", 100 + i, &lt);
    CHECK(cg_dialog_history_kept(empty, d.history) == 0);
    cg_dialog had;
    CHECK(cg_dialog_copy(&had, &d) == 0);
    CHECK(cg_dialog_history_kept(had.history, d.history) == 4); /* nothing new */
    cg_dialog_push_history(&d, "user", "m5", 105, &lt);
    cg_dialog_push_history(&d, "assistant", "m6", 106, &lt);
    CHECK(cg_dialog_history_kept(had.history, d.history) == 4);
    for (int i = 7; i <= 14; i++) /* past history_n (10): the window moves over 4 of had's */
        cg_dialog_push_history(&d, "user", "m", 100 + i, &lt);
    CHECK(json_array_size(d.history) == 10);
    CHECK(cg_dialog_history_kept(had.history, d.history) == -1); /* all of had gone */
    cg_dialog_free(&d);
    /* one of had's left at the front */
    CHECK(cg_dialog_copy(&d, &had) == 0);
    for (int i = 5; i <= 13; i++)
        cg_dialog_push_history(&d, "user", "m", 100 + i, &lt);
    CHECK(json_array_size(d.history) == 10);
    CHECK(cg_dialog_history_kept(had.history, d.history) == 1);
    CHECK(json_array_get(d.history, 0) == json_array_get(had.history, 3));
    /* another dialog's history with equal text is not a continuation: items by pointer */
    cg_dialog other;
    cg_dialog_init(&other, 100);
    for (int i = 1; i <= 4; i++)
        cg_dialog_push_history(&other, "user", "m", 100 + i, &lt);
    CHECK(cg_dialog_history_kept(had.history, other.history) == -1);
    /* a cleared history */
    json_array_clear(d.history);
    CHECK(cg_dialog_history_kept(had.history, d.history) == -1);
    /* the weight, put together from the messages' shares, is the whole's */
    size_t w = cg_dialog_weight_but_history(&other) + 2;
    for (size_t i = 0; i < json_array_size(other.history); i++)
        w += cg_dialog_history_item_weight(json_array_get(other.history, i));
    CHECK(w == cg_dialog_weight(&other));
    cg_dialog_free(&other);
    cg_dialog_free(&had);
    cg_dialog_free(&d);
    json_decref(empty);
}

/* The history's content bytes, counted the long way. */
static size_t text_counted(const cg_dialog *d)
{
    size_t n = 0, i;
    json_t *m;
    json_array_foreach(d->history, i, m) n += json_string_length(json_object_get(m, "content"));
    return n;
}

/* cg_dialog_history_text, kept by each push as the window moves, through copies (a load's),
 * shares (a save's), a lapse and a history replaced, equals the count the long way. */
static void test_history_text(void)
{
    cg_lifetimes small = lt;
    small.history_n = 4;
    cg_dialog d;
    cg_dialog_init(&d, 1000);
    int exact = cg_dialog_history_text(&d) == 0;
    for (int i = 0; i < 40; i++) {
        char text[64];
        snprintf(text, sizeof(text), "message %d %.*s", i, i % 13, "xxxxxxxxxxxxx");
        json_t *m = cg_dialog_push_history(&d, i % 2 ? "assistant" : "user", text, 1000 + i, &small);
        CHECK(m && json_array_get(d.history, json_array_size(d.history) - 1) == m); /* the one pushed */
        if (i % 5 == 0)
            json_object_set_new(m, "cancelled", json_true());
        exact &= cg_dialog_history_text(&d) == text_counted(&d);
        if (i % 3 == 0) { /* the next turn's copy, as a load's */
            cg_dialog next;
            CHECK(cg_dialog_copy(&next, &d) == 0);
            cg_dialog_free(&d);
            d = next;
        }
        if (i % 7 == 0) { /* kept as a save's, read back */
            cg_dialog kept;
            CHECK(cg_dialog_share(&kept, &d) == 0);
            exact &= cg_dialog_history_text(&kept) == text_counted(&kept);
            cg_dialog_free(&kept);
        }
        if (i == 20) /* the history's time up */
            cg_dialog_lapse(&d, 5000, 9000, 4000);
        if (i == 30) { /* a history read from a store's JSON */
            json_t *j = cg_dialog_to_json(&d);
            json_array_remove(json_object_get(j, "history"), 0);
            cg_dialog_free(&d);
            cg_dialog_from_json(&d, j, 1000);
            json_decref(j);
        }
        exact &= cg_dialog_history_text(&d) == text_counted(&d);
    }
    CHECK(exact);
    CHECK(json_array_size(d.history) == 4 && text_counted(&d) > 0);
    cg_dialog_free(&d);
    /* a history of no messages (history_n 0) keeps none: nothing handed back to mark */
    small.history_n = 0;
    cg_dialog_init(&d, 1000);
    CHECK(cg_dialog_push_history(&d, "user", "kept out", 1000, &small) == NULL);
    CHECK(json_array_size(d.history) == 0 && cg_dialog_history_text(&d) == 0);
    cg_dialog_free(&d);
}

/* Two copies of one dialog that went separate ways (two gateways while the store switched):
 * the merge keeps every message once, in order of time, and the later copy's state. */
static void test_merge_copies(void)
{
    cg_dialog a, b;
    cg_dialog_init(&a, 100);
    cg_dialog_push_history(&a, "user", "u1", 100, &lt);
    cg_dialog_push_history(&a, "assistant", "a1", 101, &lt);
    CHECK(cg_dialog_copy(&b, &a) == 0); /* the common part */
    cg_dialog_push_history(&a, "user", "from A", 110, &lt);
    cg_dialog_push_history(&a, "assistant", "A's answer", 112, &lt);
    cg_dialog_push_history(&b, "user", "from B", 111, &lt);
    json_object_set_new(cg_dialog_push_history(&b, "assistant", "B's answer", 111, &lt), "cancelled", json_true());
    a.last_activity = 112;
    b.last_activity = 120;
    a.turn_count = 2;
    b.turn_count = 3;
    json_t *pa = json_pack("{s:{s:s, s:s}}", "travel", "from", "A", "only_a", "x");
    json_t *pb = json_pack("{s:{s:s}, s:{s:i}}", "travel", "from", "B", "food", "n", 2);
    CHECK(cg_dialog_merge_all_params(&a, pa, &lt, NULL, 0) == 0);
    CHECK(cg_dialog_merge_all_params(&b, pb, &lt, NULL, 0) == 0);
    json_decref(pa);
    json_decref(pb);
    b.soft = json_pack("{s:s}", "topic", "B");
    b.soft_expires = 999;

    long added = cg_dialog_merge(&a, &b, &lt);
    CHECK(added == 2); /* B's two messages; the common two were A's already */
    /* B's turn began after A's (111 > 110): it goes after it, whole */
    const char *want[] = {"u1", "a1", "from A", "A's answer", "from B", "B's answer"};
    CHECK(json_array_size(a.history) == 6);
    for (size_t i = 0; i < 6 && i < json_array_size(a.history); i++)
        CHECK_STR(json_string_value(json_object_get(json_array_get(a.history, i), "content")), want[i]);
    CHECK(json_is_true(json_object_get(json_array_get(a.history, 5), "cancelled")));
    /* B was active last: its value wins where both set one; A's own are kept */
    CHECK_STR(json_string_value(json_object_get(json_object_get(a.params, "travel"), "from")), "B");
    CHECK_STR(json_string_value(json_object_get(json_object_get(a.params, "travel"), "only_a")), "x");
    CHECK(json_integer_value(json_object_get(json_object_get(a.params, "food"), "n")) == 2);
    CHECK_STR(json_string_value(json_object_get(a.soft, "topic")), "B");
    CHECK(a.last_activity == 120 && a.turn_count == 3);
    CHECK(cg_dialog_history_text(&a) == strlen("u1a1from AA's answerfrom BB's answer"));

    /* merged again with either: nothing new; b unchanged by the merge */
    CHECK(cg_dialog_merge(&a, &b, &lt) == 0);
    CHECK(json_array_size(a.history) == 6 && json_array_size(b.history) == 4);

    /* the window: history_n keeps the newest */
    cg_lifetimes small = lt;
    small.history_n = 3;
    cg_dialog c;
    cg_dialog_init(&c, 100);
    CHECK(cg_dialog_merge(&c, &a, &small) == 6); /* all missing from c; the window keeps 3 */
    CHECK(json_array_size(c.history) == 3);
    CHECK_STR(json_string_value(json_object_get(json_array_get(c.history, 0), "content")), "A's answer");

    /* a turn of the other copy that began before one of into's goes before it, whole */
    cg_dialog e, f;
    cg_dialog_init(&e, 100);
    cg_dialog_push_history(&e, "user", "late", 120, &lt);
    cg_dialog_push_history(&e, "assistant", "late answer", 121, &lt);
    cg_dialog_init(&f, 100);
    cg_dialog_push_history(&f, "user", "early", 115, &lt);
    cg_dialog_push_history(&f, "assistant", "early answer", 125, &lt);
    CHECK(cg_dialog_merge(&e, &f, &lt) == 2);
    const char *order[] = {"early", "early answer", "late", "late answer"};
    for (size_t i = 0; i < 4 && i < json_array_size(e.history); i++)
        CHECK_STR(json_string_value(json_object_get(json_array_get(e.history, i), "content")), order[i]);
    cg_dialog_free(&e);
    cg_dialog_free(&f);

    /* a message said twice in one second ("yes", sent again, the same answer) is two: the
     * copy that holds both gives the other its second turn */
    cg_dialog once, twice;
    cg_dialog_init(&once, 100);
    cg_dialog_push_history(&once, "user", "book it", 130, &lt);
    cg_dialog_push_history(&once, "user", "yes", 131, &lt);
    cg_dialog_push_history(&once, "assistant", "done", 131, &lt);
    CHECK(cg_dialog_copy(&twice, &once) == 0);
    cg_dialog_push_history(&twice, "user", "yes", 131, &lt);
    cg_dialog_push_history(&twice, "assistant", "done", 131, &lt);
    CHECK(cg_dialog_merge(&once, &twice, &lt) == 2);
    CHECK(json_array_size(once.history) == 5);
    CHECK(cg_dialog_merge(&once, &twice, &lt) == 0); /* and once only */
    CHECK(cg_dialog_merge(&twice, &once, &lt) == 0);
    CHECK(json_array_size(twice.history) == 5);
    cg_dialog_free(&once);
    cg_dialog_free(&twice);
    cg_dialog_free(&a);
    cg_dialog_free(&b);
    cg_dialog_free(&c);
}

/* Two copies active in the same second (last_activity is in seconds): the one that goes on
 * from the other (a write-back of turns made in the second of Redis's last save) counts as
 * active last, its params kept; two that each hold a turn the other lacks keep into's. */
static void test_merge_same_second(void)
{
    cg_dialog base, ahead, apart;
    cg_dialog_init(&base, 100);
    cg_dialog_push_history(&base, "user", "from Kisumu", 100, &lt);
    cg_dialog_push_history(&base, "assistant", "ok Kisumu", 100, &lt);
    json_t *p = json_pack("{s:{s:s}}", "travel", "from", "Kisumu");
    CHECK(cg_dialog_merge_all_params(&base, p, &lt, NULL, 0) == 0);
    json_decref(p);
    CHECK(cg_dialog_copy(&ahead, &base) == 0);
    CHECK(cg_dialog_copy(&apart, &base) == 0);
    cg_dialog_push_history(&ahead, "user", "from nowhere", 100, &lt);
    cg_dialog_push_history(&ahead, "assistant", "ok nowhere", 100, &lt);
    p = json_pack("{s:{s:s}}", "travel", "from", "nowhere");
    CHECK(cg_dialog_merge_all_params(&ahead, p, &lt, NULL, 0) == 0);
    json_decref(p);
    base.last_activity = ahead.last_activity = apart.last_activity = 100;

    cg_dialog into;
    CHECK(cg_dialog_copy(&into, &base) == 0);
    CHECK(cg_dialog_merge(&into, &ahead, &lt) == 2);
    CHECK_STR(json_string_value(json_object_get(json_object_get(into.params, "travel"), "from")), "nowhere");
    cg_dialog_free(&into);

    /* the same with a window of 3 that cut base's first message from ahead */
    cg_lifetimes small = lt;
    small.history_n = 3;
    json_array_remove(ahead.history, 0);
    CHECK(cg_dialog_copy(&into, &base) == 0);
    CHECK(cg_dialog_merge(&into, &ahead, &small) == 2);
    CHECK_STR(json_string_value(json_object_get(json_object_get(into.params, "travel"), "from")), "nowhere");
    cg_dialog_free(&into);

    /* apart holds a turn of that second that ahead lacks: into (apart) keeps its value */
    cg_dialog_push_history(&apart, "user", "from Mombasa", 100, &lt);
    p = json_pack("{s:{s:s}}", "travel", "from", "Mombasa");
    CHECK(cg_dialog_merge_all_params(&apart, p, &lt, NULL, 0) == 0);
    json_decref(p);
    CHECK(cg_dialog_merge(&apart, &ahead, &lt) == 2); /* ahead's turn */
    CHECK_STR(json_string_value(json_object_get(json_object_get(apart.params, "travel"), "from")), "Mombasa");
    cg_dialog_free(&base);
    cg_dialog_free(&ahead);
    cg_dialog_free(&apart);
}

/* The last tool result: within tool_result_cap it is kept and handed back (and in the LLM's
 * summary); a directive with a larger one is refused whole; one kept larger (before the cap
 * was checked on write) is not handed back. */
static void test_tool_result_cap(void)
{
    cg_lifetimes small = lt;
    small.tool_result_cap = 64;
    cg_dialog d;
    cg_dialog_init(&d, 1000);
    char err[256];
    json_t *fits = json_loads("{\"last_tool_result\": {\"type\": \"transactions\", \"n\": 2}}", 0, NULL);
    CHECK(cg_dialog_apply_directive(&d, fits, "app", 1000, &small, err, sizeof(err)) == 0);
    CHECK(cg_dialog_tool_result(&d, &small) == d.last_tool_result && d.last_tool_result);
    char *summary = cg_dialog_summary(&d, NULL, cg_dialog_tool_result(&d, &small), NULL, NULL, NULL);
    CHECK(strstr(summary, "\"last_tool_result\":{\"type\":\"transactions\",\"n\":2}") != NULL);
    free(summary);
    json_t *big = json_pack("{s:{s:s, s:s}, s:{s:s}}", "last_tool_result", "type", "transactions", "items",
                            "0123456789012345678901234567890123456789012345678901234567890123", "soft_context", "a", "b");
    CHECK(cg_dialog_apply_directive(&d, big, "app", 1001, &small, err, sizeof(err)) == CG_E_TOO_LARGE);
    CHECK(strstr(err, "over the 64-byte tool_result_cap") != NULL);
    CHECK(json_integer_value(json_object_get(d.last_tool_result, "n")) == 2 && d.soft == NULL); /* unchanged */
    CHECK(cg_dialog_apply_directive(&d, big, "app", 1001, &lt, err, sizeof(err)) == 0);
    CHECK(cg_dialog_tool_result(&d, &lt) != NULL);
    CHECK(cg_dialog_tool_result(&d, &small) == NULL); /* kept, but too large to hand back */
    json_t *clear = json_loads("{\"last_tool_result\": null}", 0, NULL);
    CHECK(cg_dialog_apply_directive(&d, clear, "app", 1002, &small, err, sizeof(err)) == 0);
    CHECK(d.last_tool_result == NULL && cg_dialog_tool_result(&d, &lt) == NULL);
    json_decref(fits);
    json_decref(big);
    json_decref(clear);
    cg_dialog_free(&d);
}

/* Soft context takes its directive's ttl (taken out of it) and keeps its source. */
static void test_soft_ttl_source(void)
{
    cg_dialog d;
    cg_dialog_init(&d, 1000);
    char err[256];
    json_t *own = json_loads("{\"soft_context\": {\"last_action\": \"added\", \"ttl\": 600, \"source\": \"me\"}}", 0, NULL);
    CHECK(cg_dialog_apply_directive(&d, own, "app", 1000, &lt, err, sizeof(err)) == 0);
    CHECK(d.soft_expires == 1600 && json_object_get(d.soft, "ttl") == NULL);
    CHECK(strcmp(json_string_value(json_object_get(d.soft, "source")), "app") == 0); /* the gateway's word */
    json_t *plain = json_loads("{\"soft_context\": {\"last_action\": \"listed\", \"ttl\": -5}}", 0, NULL);
    CHECK(cg_dialog_apply_directive(&d, plain, "llm", 2000, &lt, err, sizeof(err)) == 0);
    CHECK(d.soft_expires == 2000 + lt.soft_s); /* no usable ttl: soft_s */
    CHECK(strcmp(json_string_value(json_object_get(d.soft, "source")), "llm") == 0);
    json_decref(own);
    json_decref(plain);
    cg_dialog_free(&d);
}

int main(void)
{
    cg_lifetimes_default(&lt);
    test_history_kept();
    test_history_text();
    test_merge();
    test_merge_copies();
    test_merge_same_second();
    test_cap();
    test_pipeline_cap_all_or_nothing();
    test_directive_all_or_nothing();
    test_forget_long_service();
    test_directive_and_expiry();
    test_history_and_round_trip();
    test_tool_result_cap();
    test_soft_ttl_source();
    return unit_done("test_dialog");
}
