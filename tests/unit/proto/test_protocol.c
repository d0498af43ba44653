/*
 * test_protocol.c: chatgate.v1 frame parsing (every bad_frame case names what was wrong)
 * and the frames the gateway builds.
 */
#include <jansson.h>
#include <stdlib.h>

#include "chatgate/core/utf8.h"
#include "chatgate/core/error.h"
#include "chatgate/proto/protocol.h"
#include "unit.h"

static int parse(const char *s, cg_client_frame *f, char *err, size_t errlen)
{
    return cg_protocol_parse(s, strlen(s), f, err, errlen);
}

/* The frame is refused as bad_frame with a message containing want. */
static void check_bad(const char *frame, const char *want, const char *want_id)
{
    cg_client_frame f;
    char err[256] = "";
    int rc = cg_protocol_parse(frame, strlen(frame), &f, err, sizeof(err));
    unit_checks++;
    if (rc != CG_E_BAD_FRAME || !strstr(err, want) || strcmp(f.id, want_id) != 0) {
        unit_failures++;
        fprintf(stderr, "frame %s: rc %d, err \"%s\", id \"%s\"; expected bad_frame with \"%s\", id \"%s\"\n",
                frame, rc, err, f.id, want, want_id);
    }
    cg_client_frame_clear(&f);
}

static void test_good(void)
{
    cg_client_frame f;
    char err[256];
    CHECK(parse("{\"type\":\"message\",\"id\":\"m1\",\"room\":\"trip\",\"text\":\"Find flights\"}", &f, err,
                sizeof(err)) == 0);
    CHECK(f.type == CG_FRAME_MESSAGE);
    CHECK_STR(f.id, "m1");
    CHECK_STR(f.room, "trip");
    CHECK_STR(f.text, "Find flights");
    cg_client_frame_clear(&f);

    CHECK(parse("{\"type\":\"message\",\"text\":\"h\\u00e9llo \\ud83d\\udc4d\"}", &f, err, sizeof(err)) == 0);
    CHECK_STR(f.id, "");
    CHECK_STR(f.room, "default");
    CHECK_STR(f.text, "h\xc3\xa9llo \xf0\x9f\x91\x8d");
    cg_client_frame_clear(&f);

    CHECK(parse("{\"type\":\"context.forget\",\"room\":\"trip\",\"keys\":[\"travel.from\"]}", &f, err,
                sizeof(err)) == 0);
    CHECK(f.type == CG_FRAME_CONTEXT_FORGET);
    CHECK_STR(f.room, "trip");
    CHECK(json_array_size(f.keys) == 1);
    cg_client_frame_clear(&f);
    CHECK(parse("{\"type\":\"context.get\"}", &f, err, sizeof(err)) == 0);
    CHECK(f.type == CG_FRAME_CONTEXT_GET);
    CHECK_STR(f.room, "default");
    cg_client_frame_clear(&f);

    /* profile.get, profile.forget with names or none (all of it) */
    CHECK(parse("{\"type\":\"profile.get\"}", &f, err, sizeof(err)) == 0 && f.type == CG_FRAME_PROFILE_GET);
    cg_client_frame_clear(&f);
    CHECK(parse("{\"type\":\"profile.forget\",\"keys\":[\"home_city\"]}", &f, err, sizeof(err)) == 0);
    CHECK(f.type == CG_FRAME_PROFILE_FORGET && json_array_size(f.keys) == 1);
    cg_client_frame_clear(&f);
    CHECK(parse("{\"type\":\"profile.forget\"}", &f, err, sizeof(err)) == 0);
    CHECK(f.type == CG_FRAME_PROFILE_FORGET && f.keys == NULL);
    cg_client_frame_clear(&f);
    CHECK(parse("{\"type\":\"profile.forget\",\"keys\":[]}", &f, err, sizeof(err)) < 0);
    CHECK(strstr(err, "profile.forget takes 'keys'") != NULL);
    cg_client_frame_clear(&f);
    CHECK(parse("{\"type\":\"profile.forget\",\"keys\":[1]}", &f, err, sizeof(err)) < 0);
    cg_client_frame_clear(&f);

    CHECK(parse("{\"type\":\"cancel\",\"id\":\"m1\"}", &f, err, sizeof(err)) == 0);
    CHECK(f.type == CG_FRAME_CANCEL);
    CHECK_STR(f.id, "m1");
    cg_client_frame_clear(&f);

    /* resume: after the last seq kept; none (absent, null) is 0 */
    CHECK(parse("{\"type\":\"resume\",\"id\":\"m1\",\"after\":1234567890123}", &f, err, sizeof(err)) == 0);
    CHECK(f.type == CG_FRAME_RESUME && f.after == 1234567890123ULL);
    CHECK_STR(f.id, "m1");
    cg_client_frame_clear(&f);
    CHECK(parse("{\"type\":\"resume\",\"id\":\"m1\"}", &f, err, sizeof(err)) == 0);
    CHECK(f.type == CG_FRAME_RESUME && f.after == 0);
    cg_client_frame_clear(&f);
    CHECK(parse("{\"type\":\"resume\",\"id\":\"m1\",\"after\":null}", &f, err, sizeof(err)) == 0);
    CHECK(f.after == 0);
    cg_client_frame_clear(&f);
    static const char *const bad[] = {
        "{\"type\":\"resume\",\"after\":3}",                  /* no id */
        "{\"type\":\"resume\",\"id\":\"m1\",\"after\":-1}",   /* negative */
        "{\"type\":\"resume\",\"id\":\"m1\",\"after\":1.5}",  /* not whole */
        "{\"type\":\"resume\",\"id\":\"m1\",\"after\":\"3\"}", /* a string */
        "{\"type\":\"resume\",\"id\":\"m1\",\"after\":1e400}", /* out of range */
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        CHECK(parse(bad[i], &f, err, sizeof(err)) == CG_E_BAD_FRAME);
        CHECK(strstr(err, "'after'") != NULL || strstr(err, "'id'") != NULL || strstr(err, "JSON") != NULL);
        cg_client_frame_clear(&f);
    }
}

static void test_bad(void)
{
    check_bad("", "not JSON", "");
    check_bad("hello", "not JSON", "");
    check_bad("{\"type\":\"message\",", "not JSON", "");
    check_bad("[1,2]", "must be a JSON object", "");
    check_bad("42", "must be a JSON object", "");
    check_bad("{}", "'type'", "");
    check_bad("{\"type\":7}", "'type'", "");
    check_bad("{\"type\":\"shout\",\"id\":\"x\"}", "unknown type 'shout'", "x");
    check_bad("{\"type\":\"message\",\"id\":\"m2\"}", "'text'", "m2");
    check_bad("{\"type\":\"message\",\"id\":\"m2\",\"text\":5}", "'text'", "m2");
    check_bad("{\"type\":\"message\",\"id\":\"m2\",\"text\":\"\"}", "'text' is empty", "m2");
    check_bad("{\"type\":\"message\",\"id\":3,\"text\":\"x\"}", "'id' must be a string", "");
    check_bad("{\"type\":\"message\",\"id\":\"m3\",\"room\":[],\"text\":\"x\"}", "'room' must be a string", "m3");
    check_bad("{\"type\":\"message\",\"id\":\"m4\",\"text\":\"a\\u0000b\"}", "NUL", ""); /* jansson refuses it */
    check_bad("{\"type\":\"cancel\"}", "'id'", "");
    check_bad("{\"type\":\"context.forget\",\"keys\":\"travel.from\"}", "'keys'", "");
    check_bad("{\"type\":\"context.forget\",\"keys\":[1]}", "'keys'", "");
    check_bad("{\"type\":\"context.explode\"}", "unknown type", "");
    check_bad("{\"type\":\"message\",\"type\":\"cancel\"}", "duplicate", "");
    /* invalid UTF-8 inside a string: jansson refuses it */
    check_bad("{\"type\":\"message\",\"text\":\"\xff\xfe\"}", "not JSON", "");

    char big[400];
    memset(big, 'r', sizeof(big));
    char frame[600];
    snprintf(frame, sizeof(frame), "{\"type\":\"message\",\"id\":\"m5\",\"room\":\"%.*s\",\"text\":\"x\"}", 300, big);
    check_bad(frame, "'room' must be 1 to 256 bytes", "m5");
}

static void test_build(void)
{
    cg_ack ack = {.id = "m1", .room = "trip", .route = "llm"};
    cg_frame_text f = cg_protocol_ack(&ack);
    char *s = f.json;
    json_t *o = json_loads(s, 0, NULL);
    CHECK_STR(json_string_value(json_object_get(o, "type")), "ack");
    CHECK_STR(json_string_value(json_object_get(o, "route")), "llm");
    CHECK(json_is_null(json_object_get(o, "service")));
    CHECK(json_is_object(json_object_get(o, "params")));
    CHECK(json_is_array(json_object_get(o, "rules")));
    json_decref(o);
    free(f.buf);

    s = (f = cg_protocol_error(NULL, "bad_frame", "x")).json;
    CHECK_STR(s, "{\"type\":\"error\",\"id\":null,\"code\":\"bad_frame\",\"message\":\"x\"}");
    free(f.buf);

    /* an upstream's words cut mid-character, or not UTF-8 at all, still make a frame */
    s = (f = cg_protocol_error("m1", "upstream_error", "boom \xc3\xa9\xc3")).json;
    CHECK_STR(s, "{\"type\":\"error\",\"id\":\"m1\",\"code\":\"upstream_error\",\"message\":\"boom \xc3\xa9?\"}");
    free(f.buf);
    s = (f = cg_protocol_error("m1", "upstream_error", "\xff\xfe ok \xed\xa0\x80")).json;
    CHECK_STR(s, "{\"type\":\"error\",\"id\":\"m1\",\"code\":\"upstream_error\",\"message\":\"?? ok ???\"}");
    free(f.buf);

    json_t *usage = json_pack("{s:i}", "prompt_tokens", 3);
    s = (f = cg_protocol_done("m1", "abc", 3, usage, 1, NULL)).json;
    CHECK_STR(s, "{\"type\":\"done\",\"id\":\"m1\",\"text\":\"abc\",\"usage\":{\"prompt_tokens\":3},\"truncated\":true}");
    free(f.buf);
    cg_answer who = {.upstream = "llm", .replica = 2, .attempts = 2, .fallback_from = NULL};
    s = (f = cg_protocol_done("m1", "", 0, NULL, 0, &who)).json;
    CHECK_STR(s, "{\"type\":\"done\",\"id\":\"m1\",\"text\":\"\",\"usage\":null,\"upstream\":\"llm\",\"replica\":2,"
                 "\"attempts\":2}");
    free(f.buf);
    who = (cg_answer){.upstream = "backup", .replica = -1, .attempts = 1, .fallback_from = "llm"};
    s = (f = cg_protocol_done("m1", "", 0, NULL, 0, &who)).json;
    CHECK_STR(s, "{\"type\":\"done\",\"id\":\"m1\",\"text\":\"\",\"usage\":null,\"upstream\":\"backup\","
                 "\"fallback_from\":\"llm\"}");
    free(f.buf);
    json_decref(usage);

    /* the frames written as text (jsonout.h) are the bytes jansson dumped for them */
    json_t *params = json_pack("{s:s, s:i}", "from", "Nair\"obi", "n", 2);
    json_t *resolution = json_pack("{s:s}", "kind", "selection");
    json_t *rules = json_pack("[s]", "travel.from");
    ack = (cg_ack){.id = "m\n2", .room = "r\xc3\xa9", .route = "app", .service = "travel", .params = params,
                   .enriched = "e\\", .resolution = resolution, .rules = rules};
    s = (f = cg_protocol_ack(&ack)).json;
    o = json_pack("{s:s, s:s, s:s, s:s, s:s, s:O, s:s, s:O, s:O}", "type", "ack", "id", ack.id, "room", ack.room,
                  "route", ack.route, "service", ack.service, "params", params, "enriched", ack.enriched,
                  "resolution", resolution, "rules", rules);
    char *want = json_dumps(o, JSON_COMPACT);
    CHECK_STR(s, want);
    free(want);
    json_decref(o);
    free(f.buf);
    s = (f = cg_protocol_delta("m1", "a\"b\\c\x01\x1f\t\xe2\x82\xac/", 12, 40)).json;
    CHECK_STR(s, "{\"type\":\"delta\",\"id\":\"m1\",\"text\":\"a\\\"b\\\\c\\u0001\\u001F\\t\xe2\x82\xac/\",\"seq\":40}");
    free(f.buf);
    /* text that is not UTF-8 (a bug upstream of here) gives the internal error, not a bad frame */
    s = (f = cg_protocol_delta("m1", "ab\xc3", 3, 3)).json;
    CHECK(strstr(s, "\"code\":\"internal\"") != NULL);
    free(f.buf);
    s = (f = cg_protocol_done(NULL, "ab", 2, NULL, 0, NULL)).json;
    CHECK(strstr(s, "\"code\":\"internal\"") != NULL);
    free(f.buf);
    json_decref(params);
    json_decref(resolution);
    json_decref(rules);

    CHECK_STR(cg_err_code(CG_E_UPSTREAM_TIMEOUT), "upstream_timeout");
    CHECK_STR(cg_err_code(CG_E_RATE_LIMITED), "rate_limited");
}

static void test_utf8_boundary(void)
{
    const char *s = "a\xc3\xa9"; /* a é */
    CHECK(cg_utf8_boundary(s, 3) == 3);
    CHECK(cg_utf8_boundary(s, 2) == 1); /* would end inside é */
    const char *thumb = "\xf0\x9f\x91\x8d";
    CHECK(cg_utf8_boundary(thumb, 4) == 4);
    CHECK(cg_utf8_boundary(thumb, 3) == 0);
    CHECK(cg_utf8_boundary(thumb, 1) == 0);
    CHECK(cg_utf8_boundary("abc", 2) == 2);
    /* a cut text always builds a valid frame */
    cg_frame_text f = cg_protocol_delta("m", thumb, cg_utf8_boundary(thumb, 2), 0);
    char *d = f.json;
    CHECK(strstr(d, "\"type\":\"delta\"") != NULL);
    free(f.buf);
}

int main(void)
{
    test_good();
    test_bad();
    test_build();
    test_utf8_boundary();
    return unit_done("test_protocol");
}
