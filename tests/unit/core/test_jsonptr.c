/*
 * test_jsonptr.c: RFC 6901 JSON Pointers, with the examples of the RFC's section 5.
 */
#include "chatgate/core/jsonptr.h"
#include "unit.h"

int main(void)
{
    json_t *doc = json_loads("{\"foo\":[\"bar\",\"baz\"],\"\":0,\"a/b\":1,\"c%d\":2,\"e^f\":3,\"g|h\":4,"
                             "\"i\\\\j\":5,\"k\\\"l\":6,\" \":7,\"m~n\":8}",
                             0, NULL);
    CHECK(cg_json_pointer_get(doc, "") == doc);
    CHECK(json_is_array(cg_json_pointer_get(doc, "/foo")));
    CHECK_STR(json_string_value(cg_json_pointer_get(doc, "/foo/0")), "bar");
    CHECK(json_integer_value(cg_json_pointer_get(doc, "/")) == 0);
    CHECK(json_integer_value(cg_json_pointer_get(doc, "/a~1b")) == 1);
    CHECK(json_integer_value(cg_json_pointer_get(doc, "/c%d")) == 2);
    CHECK(json_integer_value(cg_json_pointer_get(doc, "/i\\j")) == 5);
    CHECK(json_integer_value(cg_json_pointer_get(doc, "/ ")) == 7);
    CHECK(json_integer_value(cg_json_pointer_get(doc, "/m~0n")) == 8);
    CHECK(cg_json_pointer_get(doc, "/foo/2") == NULL);
    CHECK(cg_json_pointer_get(doc, "/foo/01") == NULL);
    CHECK(cg_json_pointer_get(doc, "/foo/-") == NULL);
    CHECK(cg_json_pointer_get(doc, "/nope/x") == NULL);
    CHECK(cg_json_pointer_valid("/text"));
    CHECK(cg_json_pointer_valid(""));
    CHECK(!cg_json_pointer_valid("text"));
    CHECK(!cg_json_pointer_valid("/a~2"));
    json_decref(doc);
    return unit_done("test_jsonptr");
}
