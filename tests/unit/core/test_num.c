/*
 * test_num.c: numbers from peers saturate (num.h). cg_json_saturate_ints writes every
 * integer a long long cannot hold, outside strings, as the bound it passed, so that jansson
 * reads the text (it refuses the whole text for one such number: a dialog's state in Redis
 * is one JSON value, issue 39's ninth round), and leaves everything else as it was.
 */
#include <jansson.h>
#include <limits.h>

#include "chatgate/core/num.h"
#include "unit.h"

/* The text saturated (the input when nothing changed), as an exact-size copy so that ASan
 * sees a read past its end; "" when out of memory. */
static char *saturated(const char *s)
{
    size_t len = strlen(s), n = 0;
    char *in = unit_dup_exact(s, len);
    char *out = cg_json_saturate_ints(in, len, &n);
    if (out)
        CHECK(n == strlen(out) && n <= len);
    else
        out = strdup(s);
    free(in);
    return out;
}

static void test_saturates(void)
{
    static const struct {
        const char *in, *want;
    } cases[] = {
        {"{\"n\":99999999999999999999}", "{\"n\":9223372036854775807}"},
        {"{\"n\":-99999999999999999999}", "{\"n\":-9223372036854775808}"},
        {"[9223372036854775807,9223372036854775808]", "[9223372036854775807,9223372036854775807]"},
        {"[-9223372036854775808,-9223372036854775809]", "[-9223372036854775808,-9223372036854775808]"},
        {"{\"a\":\"99999999999999999999\",\"b\":1e400,\"c\":12345678901234567890.5}",
         "{\"a\":\"99999999999999999999\",\"b\":1e400,\"c\":12345678901234567890.5}"}, /* a string, reals */
        {"{\"s\":\"x\\\"99999999999999999999\",\"n\":123456789012345678901234}",
         "{\"s\":\"x\\\"99999999999999999999\",\"n\":9223372036854775807}"}, /* an escaped quote */
        {"{\"k\":1,\"m\":{\"turn_count\":100000000000000000000,\"x\":[1,2,3]}}",
         "{\"k\":1,\"m\":{\"turn_count\":9223372036854775807,\"x\":[1,2,3]}}"},
        {"", ""},
        {"1", "1"},
        {"99999999999999999999", "9223372036854775807"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        char *out = saturated(cases[i].in);
        CHECK_STR(out, cases[i].want);
        free(out);
    }
    /* what jansson refused, it reads once saturated */
    const char *state = "{\"meta\":{\"turn_count\":99999999999999999999},\"params\":{\"t\":{\"to\":\"London\"}}}";
    CHECK(json_loads(state, 0, NULL) == NULL);
    char *out = saturated(state);
    json_t *j = json_loads(out, 0, NULL);
    CHECK(j && json_integer_value(json_object_get(json_object_get(j, "meta"), "turn_count")) == LLONG_MAX);
    json_decref(j);
    free(out);
}

int main(void)
{
    test_saturates();
    return unit_done("test_num");
}
