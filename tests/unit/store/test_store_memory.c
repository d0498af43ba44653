/*
 * test_store_memory.c: the in-memory store with an injected clock: the lifetimes of each
 * part (the ones Redis gets from key expiry), the least-recently-used bounds (dialogs and
 * bytes) and their counts, eviction of keys of any length, and dialog keys that no id can
 * make collide.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chatgate/store/store.h"
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
    cg_dialog_push_history(&d, "user", "hi", now, &lt);
    cg_memstore_put_rev(m, key, &d, now, NULL, 0);
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

/* Keys longer than any buffer the eviction once copied them into (1,024 bytes): escaped
 * user and room ids of 256 bytes each, every byte escaped, make 1,537-byte keys. Eviction
 * used to cut the copy, miss the key and spin for ever; now each one goes. */
static void test_evict_long_keys(void)
{
    cg_lifetimes lt;
    cg_lifetimes_default(&lt);
    cg_store_stats stats = {0};
    cg_memstore *m = cg_memstore_new(2, &lt, &stats);
    char user[257], room[257];
    memset(user, ' ', 256);
    user[256] = 0;
    char *keys[6];
    for (int i = 0; i < 6; i++) {
        memset(room, '#', 256);
        room[255] = (char)('a' + i); /* the keys differ only at their very end, past 1,024 */
        room[256] = 0;
        keys[i] = cg_store_dialog_key(user, room);
        CHECK(strlen(keys[i]) > 1024);
        put_dialog(m, keys[i], i, "X");
        CHECK(cg_memstore_count(m) <= 2);
    }
    CHECK(cg_memstore_count(m) == 2);
    CHECK(stats.evictions == 4);
    int existed;
    from_of(m, keys[3], 10, &existed);
    CHECK(!existed);
    CHECK_STR(from_of(m, keys[4], 10, &existed), "X");
    CHECK(existed);
    CHECK_STR(from_of(m, keys[5], 10, &existed), "X");
    CHECK(existed);
    for (int i = 0; i < 6; i++)
        free(keys[i]);
    cg_memstore_free(m);
}

/* A dialog whose history holds text of n bytes. */
static void put_sized(cg_memstore *m, const char *key, int64_t now, size_t n)
{
    cg_dialog d;
    cg_lifetimes lt;
    cg_lifetimes_default(&lt);
    cg_dialog_init(&d, now);
    char *text = malloc(n + 1);
    memset(text, 'x', n);
    text[n] = 0;
    cg_dialog_push_history(&d, "assistant", text, now, &lt);
    cg_memstore_put_rev(m, key, &d, now, NULL, 0);
    free(text);
    cg_dialog_free(&d);
}

static void test_byte_bound(void)
{
    cg_lifetimes lt;
    cg_lifetimes_default(&lt);
    cg_store_stats stats = {0};
    cg_memstore *m = cg_memstore_new(1000, &lt, &stats);
    cg_memstore_set_max_bytes(m, 50000);
    int existed;
    put_sized(m, "a", 0, 10000);
    size_t one = cg_memstore_bytes(m);
    CHECK(one > 10000 && one < 11000);
    CHECK(stats.memory_bytes == one);
    put_sized(m, "b", 0, 10000);
    put_sized(m, "c", 0, 10000);
    put_sized(m, "d", 0, 10000);
    from_of(m, "a", 1, &existed); /* a is now the most recently used */
    CHECK(existed);
    put_sized(m, "e", 2, 15000); /* over 50,000 bytes: b goes, the least recently used */
    CHECK(cg_memstore_bytes(m) <= 50000);
    CHECK(stats.evictions_bytes == 1);
    CHECK(stats.evictions == 0);
    CHECK(cg_memstore_count(m) == 4);
    from_of(m, "b", 3, &existed);
    CHECK(!existed);
    from_of(m, "a", 3, &existed);
    CHECK(existed);

    /* rewriting a dialog replaces its weight, not adds to it */
    size_t before = cg_memstore_bytes(m);
    put_sized(m, "a", 4, 10000);
    CHECK(cg_memstore_bytes(m) == before);

    /* one dialog bigger than the whole bound: kept alone, everything older goes */
    put_sized(m, "big", 5, 60000);
    CHECK(cg_memstore_count(m) == 1);
    CHECK(stats.evictions_bytes == 5);
    from_of(m, "big", 6, &existed);
    CHECK(existed);

    /* deletes give their bytes back */
    cg_memstore_del(m, "big");
    CHECK(cg_memstore_bytes(m) == 0);
    CHECK(stats.memory_bytes == 0);
    put_sized(m, "u:r1", 7, 1000);
    put_sized(m, "u:r2", 7, 1000);
    CHECK(cg_memstore_del_user(m, "u") == 2);
    CHECK(cg_memstore_bytes(m) == 0);
    /* and so do expired dialogs, once read */
    put_sized(m, "old", 8, 1000);
    from_of(m, "old", 8 + lt.dialog_s, &existed);
    CHECK(!existed);
    CHECK(cg_memstore_bytes(m) == 0);
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
    /* every byte: kept when in [A-Za-z0-9_.@|-], else %XX */
    static const char kept[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.@|-";
    for (int c = 1; c < 256; c++) {
        char id[2] = {(char)c, 0}, want[4];
        if (strchr(kept, c))
            snprintf(want, sizeof(want), "%c", c);
        else
            snprintf(want, sizeof(want), "%%%02X", c);
        char *e = cg_store_escape(id);
        CHECK_STR(e, want);
        free(e);
    }
}

/* The bytes held follow the dialog's weight when each put's history goes on from the last
 * (counted from the messages that came and went), is cleared, or is another; and the rev
 * and the renewal time stay with their put only. */
static void test_weight_and_rev(void)
{
    cg_lifetimes lt;
    cg_lifetimes_default(&lt);
    cg_memstore *m = cg_memstore_new(100, &lt, NULL);
    const char *key = "u:r";
    size_t key_len = strlen(key);
    cg_dialog d;
    cg_dialog_init(&d, 1000);
    int exact = 1, last_n = 0;
    for (int i = 0; i < 60; i++) {
        char text[128];
        snprintf(text, sizeof(text), "message %d %.*s", i, i, "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx");
        cg_dialog_push_history(&d, i % 2 ? "assistant" : "user", text, 1000 + i, &lt);
        if (i == 30)
            json_array_clear(d.history);
        if (i == 40) { /* another history of equal text: weighed whole */
            cg_dialog other;
            cg_dialog_init(&other, 1000);
            for (size_t k = 0; k < json_array_size(d.history); k++) {
                json_t *c = json_deep_copy(json_array_get(d.history, k));
                json_array_append_new(other.history, c);
            }
            json_decref(d.history);
            d.history = json_incref(other.history);
            cg_dialog_free(&other);
        }
        if (i % 2) /* kept (a save's: its parts shared) or copied (a load's) */
            cg_memstore_keep(m, key, &d, 1000, i % 3 ? "rev" : NULL, i);
        else
            cg_memstore_put_rev(m, key, &d, 1000, i % 3 ? "rev" : NULL, i);
        exact &= cg_memstore_bytes(m) == key_len + cg_dialog_weight(&d);
        json_t *was = cg_dialog_to_json(&d);
        /* a turn's next copy comes from the store, as a load's: the same dialog, its own parts */
        cg_dialog_free(&d);
        CHECK(cg_memstore_get(m, key, 1000, &d) == 1);
        json_t *is = cg_dialog_to_json(&d);
        exact &= json_equal(was, is);
        json_decref(was);
        json_decref(is);
        /* the turn's change: new params most turns; on the others the params are the very
         * object the store holds, whose weight the next put takes from the entry (as usage's
         * when no turn added to it) */
        if (i % 4 != 3) {
            json_t *p = json_pack("{s:i}", "n", i);
            char err[64];
            cg_dialog_merge_params(&d, "travel", p, &lt, err, sizeof(err));
            json_decref(p);
        }
        if (i % 5 == 0)
            cg_dialog_add_usage(&d, "llm", 10, i);
        cg_dialog held;
        CHECK(cg_memstore_get(m, key, 1000, &held) == 1);
        exact &= json_integer_value(json_object_get(json_object_get(held.params, "travel"), "n")) == last_n;
        if (i % 4 != 3)
            last_n = i;
        cg_dialog_free(&held);
        const char *rev = cg_memstore_rev(m, key, 1000);
        exact &= i % 3 ? rev && strcmp(rev, "rev") == 0 : rev == NULL;
        cg_memstore_view v;
        exact &= cg_memstore_view_of(m, key, 1000, &v) == 1 && v.rev == rev && v.history && v.params &&
                 v.renewed == i; /* the renewal time of the last put, whether kept or copied */
    }
    CHECK(exact);
    /* the history's time up: no history to append to; the dialog's: no entry, no rev */
    cg_memstore_view v;
    CHECK(cg_memstore_view_of(m, key, 1000 + lt.history_s, &v) == 1 && v.history == NULL && v.params);
    CHECK(cg_memstore_view_of(m, key, 1000 + lt.dialog_s, &v) == 0 && !v.rev && !v.history && !v.renewed);
    CHECK(cg_memstore_rev(m, key, 1000 + lt.dialog_s) == NULL);
    CHECK(cg_memstore_bytes(m) == 0);
    cg_dialog_free(&d);
    cg_memstore_free(m);
}

/* max_rooms_per_user (issue 35): a user past the bound loses their least recently used
 * room, counted; other users and a room saved again are untouched. */
static void test_rooms_bound(void)
{
    cg_lifetimes lt;
    cg_lifetimes_default(&lt);
    cg_store_stats stats = {0};
    cg_memstore *m = cg_memstore_new(100, &lt, &stats);
    cg_memstore_set_max_rooms(m, 3);
    int existed;
    put_dialog(m, "u:r1", 0, "1");
    put_dialog(m, "u:r2", 1, "2");
    put_dialog(m, "v:r1", 2, "v");
    put_dialog(m, "u:r3", 3, "3");
    put_dialog(m, "u:r1", 4, "1b"); /* saved again: no new room */
    CHECK(stats.evictions_rooms == 0 && cg_memstore_count(m) == 4);
    from_of(m, "u:r2", 5, &existed); /* used: r3 is u's least recently used now */
    put_dialog(m, "u:r4", 6, "4");   /* u's fourth room: r3 goes */
    CHECK(stats.evictions_rooms == 1);
    from_of(m, "u:r3", 7, &existed);
    CHECK(!existed);
    CHECK_STR(from_of(m, "u:r1", 7, &existed), "1b");
    CHECK_STR(from_of(m, "u:r2", 7, &existed), "2");
    CHECK_STR(from_of(m, "u:r4", 7, &existed), "4");
    CHECK_STR(from_of(m, "v:r1", 7, &existed), "v"); /* another user's room stays */
    /* a user forgotten starts again from none */
    CHECK(cg_memstore_del_user(m, "u") == 3);
    for (int i = 0; i < 3; i++) {
        char key[16];
        snprintf(key, sizeof(key), "u:n%d", i);
        put_dialog(m, key, 10 + i, "n");
    }
    CHECK(stats.evictions_rooms == 1 && cg_memstore_count(m) == 4);
    cg_memstore_free(m);
}

/* A pinned dialog (the Redis store's written while Redis was away) is never evicted, nor
 * counted by the bounds: the others go around it, up to the bounds beside it; it still
 * lapses and goes with a delete, and once let go it is evictable again, as if just used or
 * as the oldest. */
static void test_pinned(void)
{
    cg_lifetimes lt;
    cg_lifetimes_default(&lt);
    cg_store_stats stats = {0};
    cg_memstore *m = cg_memstore_new(2, &lt, &stats);
    int existed;
    put_dialog(m, "a", 0, "A");
    cg_memstore_pin(m, "a", CG_MEMSTORE_PIN);
    cg_memstore_pin(m, "nobody", CG_MEMSTORE_PIN); /* no entry: nothing to pin */
    put_dialog(m, "b", 0, "B");
    put_dialog(m, "c", 0, "C"); /* two beside a: within the bound */
    CHECK(cg_memstore_count(m) == 3 && stats.evictions == 0);
    put_dialog(m, "d", 1, "D"); /* b goes, not the older a */
    CHECK(cg_memstore_count(m) == 3 && stats.evictions == 1);
    from_of(m, "b", 2, &existed);
    CHECK(!existed);
    CHECK_STR(from_of(m, "a", 2, &existed), "A"); /* read: still pinned */
    put_dialog(m, "a", 2, "A2");                  /* written again: still pinned */
    put_dialog(m, "e", 3, "E");                   /* c goes */
    CHECK(stats.evictions == 2);
    CHECK_STR(from_of(m, "a", 4, &existed), "A2");

    /* the bounds count none of the pinned: two more beside them, nothing evicted */
    cg_memstore_pin(m, "d", CG_MEMSTORE_PIN);
    cg_memstore_pin(m, "e", CG_MEMSTORE_PIN);
    put_dialog(m, "f", 5, "F");
    put_dialog(m, "g", 5, "G");
    CHECK(cg_memstore_count(m) == 5 && stats.evictions == 2);

    /* let go as the oldest: the first to go at the next write */
    cg_memstore_pin(m, "d", CG_MEMSTORE_UNPIN_OLDEST);
    put_dialog(m, "h", 6, "H"); /* d and f go */
    CHECK(cg_memstore_count(m) == 4 && stats.evictions == 4);
    from_of(m, "d", 7, &existed);
    CHECK(!existed);
    from_of(m, "f", 7, &existed);
    CHECK(!existed);
    /* let go as just used: the others go first */
    cg_memstore_pin(m, "e", CG_MEMSTORE_UNPIN);
    put_dialog(m, "i", 8, "I"); /* g and h go */
    CHECK(cg_memstore_count(m) == 3 && stats.evictions == 6);
    CHECK_STR(from_of(m, "e", 9, &existed), "E");

    /* the byte bound counts none of the pinned either */
    cg_memstore_set_max_bytes(m, cg_memstore_bytes(m));
    cg_memstore_pin(m, "e", CG_MEMSTORE_PIN);
    put_dialog(m, "j", 9, "J"); /* the bytes of e are off the count: room for j beside i */
    CHECK(stats.evictions_bytes == 0 && cg_memstore_count(m) == 4);

    /* a pinned one is listed among its user's rooms, still lapses, and goes with a delete or
     * its user's */
    put_dialog(m, "u:x", 9, "X");
    cg_memstore_pin(m, "u:x", CG_MEMSTORE_PIN);
    json_t *rooms = cg_memstore_rooms(m, "u:");
    CHECK(json_array_size(rooms) == 1 && strcmp(json_string_value(json_array_get(rooms, 0)), "x") == 0);
    json_decref(rooms);
    CHECK(cg_memstore_del_user(m, "u") == 1);
    from_of(m, "u:x", 9, &existed);
    CHECK(!existed);
    cg_memstore_del(m, "e");
    from_of(m, "e", 9, &existed);
    CHECK(!existed);
    from_of(m, "a", 9 + lt.dialog_s, &existed);
    CHECK(!existed);
    cg_memstore_free(m);
}

int main(void)
{
    test_pinned();
    test_rooms_bound();
    test_weight_and_rev();
    test_lifetimes();
    test_lru();
    test_evict_long_keys();
    test_byte_bound();
    test_keys();
    return unit_done("test_store_memory");
}
