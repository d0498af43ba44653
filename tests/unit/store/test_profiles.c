/*
 * test_profiles.c: users' profiles in memory (store/profiles.h): the names a profile takes,
 * changes applied (null forgets), the size the cap is measured in (compact JSON, as the Redis
 * script counts it), the lifetime renewed by a read, and the bound on users (the least
 * recently used goes).
 */
#include <jansson.h>
#include <string.h>

#include "chatgate/store/profiles.h"
#include "unit.h"

static void test_check_and_apply(void)
{
    char err[200];
    json_t *ok = json_pack("{s:s, s:i, s:n}", "home_city", "Nairobi", "kids.count", 2, "old-name", NULL);
    CHECK(cg_profile_check(ok, err, sizeof(err)) == 0);
    static const char *const bad[] = {"home city", "", "a/b", "é", "x\"y"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        json_t *b = json_object();
        json_object_set_new(b, bad[i], json_true());
        CHECK(cg_profile_check(b, err, sizeof(err)) < 0 && strstr(err, "is not a profile name"));
        json_decref(b);
    }
    char long_name[CG_PROFILE_NAME_MAX + 2];
    memset(long_name, 'a', sizeof(long_name) - 1);
    long_name[sizeof(long_name) - 1] = 0;
    json_t *l = json_object();
    json_object_set_new(l, long_name, json_true());
    CHECK(cg_profile_check(l, err, sizeof(err)) < 0);
    long_name[CG_PROFILE_NAME_MAX] = 0; /* 64: fits */
    json_object_clear(l);
    json_object_set_new(l, long_name, json_true());
    CHECK(cg_profile_check(l, err, sizeof(err)) == 0);
    json_decref(l);
    json_t *array = json_array();
    CHECK(cg_profile_check(array, err, sizeof(err)) < 0); /* not an object */
    json_decref(array);

    json_t *had = json_pack("{s:s, s:s}", "name", "Sam", "old-name", "x");
    json_t *next = cg_profile_apply(had, ok);
    CHECK(json_object_size(next) == 3 && json_object_get(next, "old-name") == NULL);
    CHECK(strcmp(json_string_value(json_object_get(next, "name")), "Sam") == 0);
    CHECK(json_object_size(had) == 2); /* had is not changed */
    json_t *fresh = cg_profile_apply(NULL, ok);
    CHECK(json_object_size(fresh) == 2);
    json_decref(next);
    json_decref(fresh);
    json_decref(had);
    json_decref(ok);
}

/* The size is the compact JSON's, which is what the Redis script computes from the names and
 * the values' texts: 2 + sum(len(name) + len(value) + 3) + commas. */
static void test_size(void)
{
    CHECK(cg_profile_size(NULL) == 2);
    json_t *e = json_object();
    CHECK(cg_profile_size(e) == 2);
    json_object_set_new(e, "a", json_string("bc"));
    CHECK(cg_profile_size(e) == strlen("{\"a\":\"bc\"}"));
    json_object_set_new(e, "n", json_integer(12));
    size_t want = 2 + (1 + 4 + 3) + (1 + 2 + 3) + 1; /* {"a":"bc","n":12} */
    CHECK(cg_profile_size(e) == want && want == strlen("{\"a\":\"bc\",\"n\":12}"));
    json_decref(e);
}

static void test_lifetime_and_bound(void)
{
    cg_profiles *p = cg_profiles_new(2);
    json_t *sam = json_pack("{s:s}", "name", "Sam");
    cg_profiles_put(p, "u1", sam, 1000, 10);
    CHECK(cg_profiles_get(p, "u1", 1009, 10) != NULL); /* read at 1009: renewed to 1019 */
    CHECK(cg_profiles_get(p, "u1", 1018, 10) != NULL);
    CHECK(cg_profiles_get(p, "u1", 1029, 10) == NULL); /* lapsed: 1028 */
    CHECK(cg_profiles_count(p) == 0);
    cg_profiles_put(p, "u1", sam, 2000, 100);
    cg_profiles_put(p, "u2", sam, 2000, 100);
    CHECK(cg_profiles_get(p, "u1", 2001, 100) != NULL); /* u1 used last: u2 is the oldest */
    cg_profiles_put(p, "u3", sam, 2002, 100);
    CHECK(cg_profiles_count(p) == 2);
    CHECK(cg_profiles_get(p, "u2", 2003, 100) == NULL);
    CHECK(cg_profiles_get(p, "u1", 2003, 100) != NULL && cg_profiles_get(p, "u3", 2003, 100) != NULL);
    json_t *empty = json_object();
    cg_profiles_put(p, "u1", empty, 2004, 100); /* an empty profile is none */
    CHECK(cg_profiles_get(p, "u1", 2004, 100) == NULL);
    cg_profiles_remove(p, "u3");
    CHECK(cg_profiles_count(p) == 0);
    json_decref(empty);
    json_decref(sam);
    cg_profiles_free(p);
}

int main(void)
{
    test_check_and_apply();
    test_size();
    test_lifetime_and_bound();
    return unit_done("unit_profiles");
}
