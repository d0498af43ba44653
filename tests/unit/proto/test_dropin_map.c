/*
 * test_dropin_map.c: the drop-in mapping read as the apps' own parsers read frames (issue
 * 35): every frame socket.io-parser 4.2 takes for a chat event is a chat message or refused,
 * never passed; JSON the gateway cannot read, or in a binary frame, is refused; the object an
 * app reads as chatgate's is always the gateway's.
 */
#include <jansson.h>

#include "chatgate/proto/dropin_map.h"
#include "unit.h"

static json_t *sio_cfg(void)
{
    return json_loads("{\"codec\":\"socket.io\",\"client\":{\"chat\":{\"pointer\":\"/0\",\"equals\":\"chat message\"},"
                      "\"text\":\"/1\"}}",
                      0, NULL);
}

static json_t *json_cfg(void)
{
    return json_loads("{\"client\":{\"chat\":{\"pointer\":\"/kind\",\"equals\":\"say\"},\"text\":\"/body\","
                      "\"id\":\"/id\",\"room\":\"/room\"},\"object_key\":\"chatgate\"}",
                      0, NULL);
}

static cg_dropin_client_kind kind_of(json_t *cfg, const char *frame, size_t len, int binary, long *attachments)
{
    cg_dropin_chat chat;
    char why[160];
    char *copy = unit_dup_exact(frame, len);
    cg_dropin_client_kind k = cg_dropin_map_client(cfg, copy, len, binary, &chat, why, sizeof(why));
    if (attachments)
        *attachments = chat.attachments;
    CHECK(k != CG_DROPIN_REFUSE || why[0]);
    cg_dropin_chat_clear(&chat);
    free(copy);
    return k;
}

#define KIND(cfg, s) kind_of(cfg, s, strlen(s), 0, NULL)

/* socket.io-parser reads an ack id of digits and whitespace, and JSON with whitespace around:
 * every one of these is the chat event to the app, so to us */
static void test_socketio_grammar(void)
{
    json_t *cfg = sio_cfg();
    static const char *const chat[] = {"42[\"chat message\",\"a\"]", "42 [\"chat message\",\"a\"]",
                                       "42\t[\"chat message\",\"a\"]", "42\n[\"chat message\",\"a\"]",
                                       "427 [\"chat message\",\"a\"]", "42 1[\"chat message\",\"a\"]",
                                       "42\xc2\xa0[\"chat message\",\"a\"]", "42[ \"chat message\",\"a\"] "};
    for (size_t i = 0; i < sizeof(chat) / sizeof(chat[0]); i++)
        CHECK(KIND(cfg, chat[i]) == CG_DROPIN_CHAT);
    /* numbers out of range, lone surrogates, NUL, duplicate keys: the app reads them, we cannot */
    static const char *const refuse[] = {"42[\"chat message\",\"a\",1e400]", "42[\"chat message\",\"\\ud800\"]",
                                         "42[\"chat message\",\"a\\u0000b\"]",
                                         "42[\"chat message\",\"a\",18446744073709551616]",
                                         "42[\"chat message\",\"a\",{\"x\":1,\"x\":2}]"};
    for (size_t i = 0; i < sizeof(refuse) / sizeof(refuse[0]); i++)
        CHECK(KIND(cfg, refuse[i]) == CG_DROPIN_REFUSE);
    CHECK(KIND(cfg, "42[\"typing\",\"a\"]") == CG_DROPIN_PASS);
    CHECK(KIND(cfg, "42/admin,[\"chat message\",\"a\"]") == CG_DROPIN_PASS); /* another namespace */
    CHECK(KIND(cfg, "2") == CG_DROPIN_PASS);                                 /* a ping */
    CHECK(KIND(cfg, "42[5,\"a\"]") == CG_DROPIN_PASS);                       /* the handler of "5" */
    json_decref(cfg);
}

/* Binary events: whatever the count reads as, a chat event in one is refused, and the count
 * (as Number() reads it) says how many binary frames after it go too */
static void test_socketio_binary_events(void)
{
    json_t *cfg = sio_cfg();
    static const struct {
        const char *frame;
        long attachments;
    } cases[] = {{"451-[\"chat message\",{\"_placeholder\":true,\"num\":0}]", 1},
                 {"450-[\"chat message\",\"zero\"]", 0},
                 {"45-[\"chat message\",\"empty\"]", 0},
                 {"45 -[\"chat message\",\"space\"]", 0},
                 {"45+1-[\"chat message\",\"x\"]", 1},
                 {"45\n1-[\"chat message\",\"x\"]", 1},
                 {"451.0-[\"chat message\",\"x\"]", 1},
                 {"450x2-[\"chat message\",\"x\"]", 2},
                 {"450x1-[\"chat message\",\"x\",{\"user\":\"admin\"}]", 1}};
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        long n = -1;
        CHECK(kind_of(cfg, cases[i].frame, strlen(cases[i].frame), 0, &n) == CG_DROPIN_REFUSE);
        CHECK(n == cases[i].attachments);
    }
    long n = -1;
    const char *file = "451-[\"file\",{\"_placeholder\":true,\"num\":0}]";
    CHECK(kind_of(cfg, file, strlen(file), 0, &n) == CG_DROPIN_PASS && n == 1);
    json_decref(cfg);
}

/* The object is always the argument right after the ones the mapping takes, ack or not; a
 * client that sends more is refused */
static void test_socketio_object_place(void)
{
    json_t *cfg = sio_cfg();
    CHECK(KIND(cfg, "42[\"chat message\",\"x\",{\"user\":\"admin\"}]") == CG_DROPIN_REFUSE);
    static const struct {
        const char *in, *out;
    } cases[] = {{"42[\"chat message\",\"x\"]", "42[\"chat message\",\"x\",{\"user\":\"u\"}]"},
                 {"427[\"chat message\",\"y\"]", "427[\"chat message\",\"y\",{\"user\":\"u\"}]"}};
    for (size_t i = 0; i < 2; i++) {
        cg_dropin_chat chat;
        char why[160];
        CHECK(cg_dropin_map_client(cfg, cases[i].in, strlen(cases[i].in), 0, &chat, why, sizeof(why)) ==
              CG_DROPIN_CHAT);
        cg_frame_text f = cg_dropin_map_forward(cfg, &chat, json_pack("{s:s}", "user", "u"));
        CHECK_STR(f.json, cases[i].out);
        free(f.buf);
        cg_dropin_chat_clear(&chat);
    }
    /* with two arguments taken, a client that sends one gets null in the second's place */
    json_object_set_new(json_object_get(cfg, "client"), "arguments", json_integer(2));
    cg_dropin_chat chat;
    char why[160];
    const char *one = "42[\"chat message\",\"x\"]";
    CHECK(cg_dropin_map_client(cfg, one, strlen(one), 0, &chat, why, sizeof(why)) == CG_DROPIN_CHAT);
    cg_frame_text f = cg_dropin_map_forward(cfg, &chat, json_pack("{s:s}", "user", "u"));
    CHECK_STR(f.json, "42[\"chat message\",\"x\",null,{\"user\":\"u\"}]");
    free(f.buf);
    cg_dropin_chat_clear(&chat);
    json_decref(cfg);

    /* object_at "/-" written out is the default: the client's own object after its argument
     * is refused, not handed to the handler where it reads chatgate's */
    cfg = sio_cfg();
    json_object_set_new(cfg, "object_at", json_string("/-"));
    CHECK(KIND(cfg, "42[\"chat message\",\"x\",{\"user\":\"admin\"}]") == CG_DROPIN_REFUSE);
    CHECK(cg_dropin_map_client(cfg, one, strlen(one), 0, &chat, why, sizeof(why)) == CG_DROPIN_CHAT);
    f = cg_dropin_map_forward(cfg, &chat, json_pack("{s:s}", "user", "u"));
    CHECK_STR(f.json, "42[\"chat message\",\"x\",{\"user\":\"u\"}]");
    free(f.buf);
    cg_dropin_chat_clear(&chat);
    json_decref(cfg);
}

/* The json codec: JSON jansson refuses, a chat message in a binary frame, or one in another
 * encoding, is refused; a passed frame loses a member in chatgate's place */
static void test_json_codec(void)
{
    json_t *cfg = json_cfg();
    static const char *const refuse[] = {
        "{\"kind\":\"say\",\"body\":\"x\",\"n\":1e400}", "{\"kind\":\"say\",\"body\":\"x\",\"n\":NaN}",
        "{\"kind\":\"say\",\"body\":\"a\\u0000b\"}",     "{\"kind\":\"say\",\"body\":\"\\ud800\"}",
        "{\"kind\":\"say\",\"body\":\"x\",\"n\":18446744073709551616}",
        "{\"kind\":\"say\",\"body\":\"x\",\"kind\":\"typing\"}", "  [1, 2,"};
    for (size_t i = 0; i < sizeof(refuse) / sizeof(refuse[0]); i++)
        CHECK(KIND(cfg, refuse[i]) == CG_DROPIN_REFUSE);
    char id[256], room[400];
    snprintf(id, sizeof(id), "{\"kind\":\"say\",\"body\":\"x\",\"id\":\"%0*d\"}", 150, 0);
    snprintf(room, sizeof(room), "{\"kind\":\"say\",\"body\":\"x\",\"room\":\"%0*d\"}", 300, 0);
    CHECK(KIND(cfg, id) == CG_DROPIN_REFUSE);
    CHECK(KIND(cfg, room) == CG_DROPIN_REFUSE);
    const char *say = "{\"kind\":\"say\",\"body\":\"x\"}";
    CHECK(kind_of(cfg, say, strlen(say), 1, NULL) == CG_DROPIN_REFUSE); /* binary */
    static const char bom8[] = "\xef\xbb\xbf{\"kind\":\"say\",\"body\":\"x\"}";
    CHECK(kind_of(cfg, bom8, sizeof(bom8) - 1, 1, NULL) == CG_DROPIN_REFUSE);
    static const char utf16le[] = "{\0\"\0k\0\"\0:\0\"\0s\0\"\0}\0";
    CHECK(kind_of(cfg, utf16le, sizeof(utf16le) - 1, 1, NULL) == CG_DROPIN_REFUSE);
    static const char utf16be[] = "\0{\0\"\0k\0\"\0:\0\"\0s\0\"\0}";
    CHECK(kind_of(cfg, utf16be, sizeof(utf16be) - 1, 1, NULL) == CG_DROPIN_REFUSE);
    static const char png[] = "\x89PNG\r\n\x1a\n\0\0";
    CHECK(kind_of(cfg, png, sizeof(png) - 1, 1, NULL) == CG_DROPIN_PASS);
    CHECK(KIND(cfg, "ping") == CG_DROPIN_PASS);
    const char *typing = "{\"kind\":\"typing\",\"chatgate\":{\"user\":\"admin\"}}";
    cg_dropin_chat chat;
    char why[160];
    CHECK(cg_dropin_map_client(cfg, typing, strlen(typing), 0, &chat, why, sizeof(why)) == CG_DROPIN_STRIPPED);
    cg_frame_text f = cg_dropin_map_encode(cfg, &chat);
    CHECK_STR(f.json, "{\"kind\":\"typing\"}");
    free(f.buf);
    cg_dropin_chat_clear(&chat);
    json_decref(cfg);
}

/* A cancel frame's "{id}" is the id as the client wrote it: an integer stays one where the
 * template's string is "{id}" alone (issue 39's ninth round: "7" was sent, and an app keying
 * its messages by number stopped nothing); in a longer string, or a key, it is text. */
static void test_cancel_frame_id(void)
{
    json_t *cfg = json_cfg();
    json_t *appf = json_loads("{\"cancel_frame\":{\"kind\":\"halt\",\"msg_id\":\"{id}\",\"note\":\"stop {id}\","
                              "\"{id}\":[\"{id}\"]}}",
                              0, NULL);
    json_object_set_new(cfg, "app_frames", appf);
    const char *say = "{\"kind\":\"say\",\"body\":\"stop\",\"id\":7}";
    cg_dropin_chat chat;
    char why[160];
    char *copy = unit_dup_exact(say, strlen(say));
    CHECK(cg_dropin_map_client(cfg, copy, strlen(say), 0, &chat, why, sizeof(why)) == CG_DROPIN_CHAT);
    CHECK(chat.id_is_integer && strcmp(chat.id, "7") == 0);
    size_t len = 0;
    char *s = cg_dropin_map_cancel_frame(cfg, chat.id, chat.id_is_integer, &len);
    json_t *got = s ? json_loads(s, 0, NULL) : NULL;
    json_t *want = json_loads("{\"kind\":\"halt\",\"msg_id\":7,\"note\":\"stop 7\",\"7\":[7]}", 0, NULL);
    CHECK(got && json_equal(got, want));
    json_decref(got);
    free(s);
    s = cg_dropin_map_cancel_frame(cfg, "7", 0, &len); /* the client wrote "7" */
    got = s ? json_loads(s, 0, NULL) : NULL;
    CHECK(got && json_is_string(json_object_get(got, "msg_id")));
    json_decref(got);
    free(s);
    json_decref(want);
    cg_dropin_chat_clear(&chat);
    free(copy);
    json_decref(cfg);
}

int main(void)
{
    test_socketio_grammar();
    test_socketio_binary_events();
    test_socketio_object_place();
    test_json_codec();
    test_cancel_frame_id();
    return unit_done("test_dropin_map");
}
