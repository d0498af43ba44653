/*
 * test_dialog.c: the dialog model: merge (new > cached > defaults), the params cap,
 * forget, state directives, expiry, history FIFO, and the JSON round trip the stores use.
 */
#include <stdlib.h>

#include "chatgate/dialog.h"
#include "chatgate/error.h"
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
    json_decref(ok);
    json_decref(toobig);
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
        cg_dialog_push_history(&d, i % 2 ? "user" : "assistant", text, 100 + i, &lt, NULL);
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

    char *summary = cg_dialog_summary(&d, json_object_get(d.params, "travel"), NULL, NULL);
    CHECK(strstr(summary, "\"from\":\"Nairobi\"") != NULL);
    CHECK(strstr(summary, "\"service\":\"travel\"") != NULL);
    free(summary);

    json_decref(j);
    json_decref(p);
    cg_dialog_free(&d);
}

int main(void)
{
    cg_lifetimes_default(&lt);
    test_merge();
    test_cap();
    test_directive_and_expiry();
    test_history_and_round_trip();
    return unit_done("test_dialog");
}
