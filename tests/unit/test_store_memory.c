/*
 * test_store_memory.c: the in-memory store with an injected clock: the lifetimes of each
 * part (the ones Redis gets from key expiry), the least-recently-used bound and its count,
 * and dialog keys that no id can make collide.
 */
#include <stdlib.h>

#include "chatgate/store.h"
#include "unit.h"

static void put_dialog(cg_memstore *m, const char *key, int64_t now, const char *from)
{
    cg_dialog d;
    char err[64];
    cg_lifetimes lt;
    cg_lifetimes_default(&lt);
    cg_dialog_init(&d, now);
    json_t *p = json_pack("{s:s}", "from", from);
    cg_dialog_merge_params(&d, "travel", p, &lt, err, sizeof(err));
    cg_dialog_push_history(&d, "user", "hi", now, &lt, NULL);
    cg_memstore_put(m, key, &d, now);
    json_decref(p);
    cg_dialog_free(&d);
}

static const char *from_of(cg_memstore *m, const char *key, int64_t now, int *existed)
{
    static char out[64];
    cg_dialog d;
    *existed = cg_memstore_get(m, key, now, &d);
    const char *v = json_string_value(json_object_get(json_object_get(d.params, "travel"), "from"));
    snprintf(out, sizeof(out), "%s", v ? v : "");
    cg_dialog_free(&d);
    return out;
}

static void test_lifetimes(void)
{
    cg_lifetimes lt;
    cg_lifetimes_default(&lt);
    lt.params_s = 100;
    lt.history_s = 50;
    lt.dialog_s = 200;
    cg_store_stats stats = {0};
    cg_memstore *m = cg_memstore_new(10, &lt, &stats);
    int existed;
    put_dialog(m, "u:r", 1000, "Nairobi");
    CHECK_STR(from_of(m, "u:r", 1099, &existed), "Nairobi");
    CHECK(existed);

    cg_dialog d;
    cg_memstore_get(m, "u:r", 1049, &d);
    CHECK(json_array_size(d.history) == 1);
    cg_dialog_free(&d);
    cg_memstore_get(m, "u:r", 1050, &d); /* history's 50 s are up */
    CHECK(json_array_size(d.history) == 0);
    cg_dialog_free(&d);

    CHECK_STR(from_of(m, "u:r", 1100, &existed), ""); /* params' 100 s are up */
    CHECK(existed);
    CHECK_STR(from_of(m, "u:r", 1200, &existed), ""); /* the dialog's 200 s: gone */
    CHECK(!existed);
    CHECK(cg_memstore_count(m) == 0);
    cg_memstore_free(m);
}

static void test_lru(void)
{
    cg_lifetimes lt;
    cg_lifetimes_default(&lt);
    cg_store_stats stats = {0};
    cg_memstore *m = cg_memstore_new(3, &lt, &stats);
    int existed;
    put_dialog(m, "a", 0, "A");
    put_dialog(m, "b", 0, "B");
    put_dialog(m, "c", 0, "C");
    from_of(m, "a", 1, &existed); /* a is now the most recently used */
    put_dialog(m, "d", 2, "D");   /* over the bound: b goes */
    CHECK(cg_memstore_count(m) == 3);
    CHECK(stats.evictions == 1);
    from_of(m, "b", 3, &existed);
    CHECK(!existed);
    CHECK_STR(from_of(m, "a", 3, &existed), "A");
    CHECK_STR(from_of(m, "d", 3, &existed), "D");
    cg_memstore_free(m);
}

static void test_keys(void)
{
    char *k1 = cg_store_dialog_key("a", "b:c");
    char *k2 = cg_store_dialog_key("a:b", "c");
    CHECK(strcmp(k1, k2) != 0);
    CHECK_STR(k1, "a:b%3Ac");
    CHECK_STR(k2, "a%3Ab:c");
    char *k3 = cg_store_dialog_key("auth0|abc", "a}:{b *");
    CHECK_STR(k3, "auth0|abc:a%7D%3A%7Bb%20%2A");
    char *k4 = cg_store_dialog_key("\xc3\xbc", "r");
    CHECK_STR(k4, "%C3%BC:r");
    free(k1);
    free(k2);
    free(k3);
    free(k4);
}

int main(void)
{
    test_lifetimes();
    test_lru();
    test_keys();
    return unit_done("test_store_memory");
}
