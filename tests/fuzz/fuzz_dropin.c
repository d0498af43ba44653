/*
 * fuzz_dropin.c: libFuzzer target for the drop-in mapping (dropin_map.h): one client frame
 * and one app frame through it. Input: a first byte that picks the mapping (the json codec
 * with pointers at the top or nested, with or without a cancel frame and a state key; the
 * socket.io codec in a namespace; the text codec) and whether the frames are binary, then the
 * client frame, a NUL byte, and the app frame. Beyond "no crash, no leak", it checks what the
 * gateway relies on: a chat message's id and room are within their bounds and valid UTF-8
 * (so any later json_string of them succeeds), the forwarded frame is the client's plus the
 * chatgate object (socket.io: behind the client's own packet prefix; text: the text as it
 * came), the cancel frame is JSON (socket.io: behind "42" and the namespace), and an app frame
 * with a state directive is relayed without it. The bytes also go through the close frame
 * check.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chatgate/core/jsonptr.h"
#include "chatgate/core/wsconn.h"
#include "chatgate/proto/dropin_map.h"
#include "chatgate/proto/protocol.h"
#include "chatgate/server/handshake.h"

#define CHECK(c)                                                                                                   \
    do {                                                                                                           \
        if (!(c)) {                                                                                                \
            fprintf(stderr, "fuzz_dropin: %s:%d: %s\n", __FILE__, __LINE__, #c);                                   \
            abort();                                                                                               \
        }                                                                                                          \
    } while (0)

static const char *const mappings[] = {
    /* the README's example */
    "{\"client\": {\"chat\": {\"pointer\": \"/kind\", \"equals\": \"say\"}, \"text\": \"/body\","
    " \"room\": \"/conversation\", \"id\": \"/msg_id\", \"cancel\": {\"pointer\": \"/kind\", \"equals\": \"halt\"},"
    " \"cancel_id\": \"/msg_id\"}, \"app_frames\": {\"text\": \"/body\", \"id\": \"/reply_to\","
    " \"end\": {\"pointer\": \"/kind\", \"equals\": \"end\"}, \"cancelled\": {\"pointer\": \"/kind\", \"equals\": \"halted\"},"
    " \"cancel_frame\": {\"kind\": \"halt\", \"msg_id\": \"{id}\", \"{id}\": [\"{id}{id}\"]}},"
    " \"object_key\": \"chatgate\", \"state_key\": \"chatgate_state\"}",
    /* nested pointers, escapes, no cancel frame, default object key */
    "{\"client\": {\"chat\": {\"pointer\": \"/m/t\", \"equals\": 1}, \"text\": \"/m/a~1b/0\","
    " \"room\": \"/m/r\", \"id\": \"/m/i~0d\"}, \"app_frames\": {\"text\": \"/d/0/t\", \"id\": \"/d/0/i\","
    " \"end\": {\"pointer\": \"\", \"equals\": {\"done\": true}}}, \"state_key\": \"s\"}",
    /* the whole frame is the text; ids are the type field */
    "{\"client\": {\"chat\": {\"pointer\": \"/type\", \"equals\": \"message\"}, \"text\": \"/text\", \"id\": \"/type\"},"
    " \"app_frames\": {\"id\": \"/id\", \"cancelled\": {\"pointer\": \"/type\", \"equals\": \"cancelled\"},"
    " \"cancel_frame\": {\"type\": \"cancel\", \"id\": \"{id}\"}}, \"object_key\": \"type\"}",
    /* socket.io: events of /chat, the object appended as the last argument, markers in and exists */
    "{\"codec\": \"socket.io\", \"namespace\": \"/chat\", \"client\": {\"chat\": {\"pointer\": \"/0\", \"in\":"
    " [\"chat message\", \"ask\"]}, \"text\": \"/1\", \"id\": \"/2/id\", \"cancel\": {\"pointer\": \"/0\","
    " \"equals\": \"cancel\"}}, \"app_frames\": {\"reply\": {\"pointer\": \"/1\", \"exists\": true}, \"text\":"
    " \"/1\", \"id\": \"/2\", \"cancel_frame\": [\"cancel\", \"{id}\"]}}",
    /* text: the frame is the message and the reply */
    "{\"codec\": \"text\", \"app_frames\": {\"cancel_frame\": \"/cancel {id}\"}}",
};
#define N_MAPPINGS (sizeof(mappings) / sizeof(mappings[0]))

static json_t *cfgs[N_MAPPINGS];

static int utf8_ok(const char *s)
{
    json_t *j = json_string(s);
    json_decref(j);
    return j != NULL;
}

static void client_side(json_t *cfg, const char *buf, size_t len, int binary)
{
    cg_dropin_chat chat;
    char why[160];
    cg_dropin_client_kind kind = cg_dropin_map_client(cfg, buf, len, binary, &chat, why, sizeof(why));
    CHECK(kind != CG_DROPIN_REFUSE || why[0]);
    if (kind == CG_DROPIN_STRIPPED) { /* the frame without the member in chatgate's place */
        const char *key = json_string_value(json_object_get(cfg, "object_key"));
        const char *at = json_string_value(json_object_get(cfg, "object_at"));
        CHECK(!json_object_get(cg_json_pointer_get(chat.frame, at ? at : ""), key ? key : "chatgate"));
        cg_frame_text f = cg_dropin_map_encode(cfg, &chat);
        CHECK(f.buf);
        free(f.buf);
        cg_dropin_chat_clear(&chat);
        return;
    }
    if (kind == CG_DROPIN_CANCEL) { /* the id it stops, and the frame without a member in chatgate's
                                     * place when it carried one */
        const char *key = json_string_value(json_object_get(cfg, "object_key"));
        const char *at = json_string_value(json_object_get(cfg, "object_at"));
        CHECK(!chat.frame || !json_object_get(cg_json_pointer_get(chat.frame, at ? at : ""), key ? key : "chatgate"));
        CHECK(!chat.id || strlen(chat.id) <= CG_MAX_ID);
        cg_dropin_chat_clear(&chat);
        return;
    }
    if (kind != CG_DROPIN_CHAT) {
        CHECK(!chat.frame && !chat.id);
        return;
    }
    CHECK(!binary);
    CHECK(strlen(chat.id) <= CG_MAX_ID && utf8_ok(chat.id));
    CHECK(chat.room[0] && strlen(chat.room) <= CG_MAX_ROOM && utf8_ok(chat.room));
    CHECK(chat.text[0] && utf8_ok(chat.text));
    json_t *object = json_pack("{s:s, s:s}", "room", chat.room, "id", chat.id);
    CHECK(object);
    cg_frame_text built = cg_dropin_map_forward(cfg, &chat, json_incref(object));
    const char *fwd = built.json;
    CHECK(fwd && built.len == strlen(fwd));
    const char *codec = json_string_value(json_object_get(cfg, "codec"));
    if (codec && strcmp(codec, "text") == 0) { /* the text as it came, no object */
        CHECK(built.len == len && memcmp(fwd, buf, len) == 0);
    } else if (codec) { /* socket.io: the client's prefix, then its array and the object */
        size_t plen = strlen(chat.prefix);
        CHECK(strncmp(fwd, chat.prefix, plen) == 0 && memcmp(buf, chat.prefix, plen) == 0);
        json_t *back = json_loads(fwd + plen, 0, NULL);
        size_t n = json_array_size(back);
        size_t at = (size_t)cg_dropin_map_arguments(cfg) + 1; /* right after the arguments, ack or not */
        if (!json_object_get(cfg, "object_at")) {
            CHECK(n == at + 1 && json_equal(json_array_get(back, at), object));
            for (size_t i = 0; i < at; i++)
                CHECK(json_equal(json_array_get(back, i), json_array_get(chat.frame, i)) ||
                      (json_is_null(json_array_get(back, i)) && i >= json_array_size(chat.frame)));
        }
        json_decref(back);
    } else {
        json_t *back = json_loads(fwd, 0, NULL);
        CHECK(back);
        const char *key = json_string_value(json_object_get(cfg, "object_key"));
        CHECK(json_equal(json_object_get(back, key ? key : "chatgate"), object));
        json_object_del(back, key ? key : "chatgate");
        json_t *orig = json_copy(chat.frame);
        json_object_del(orig, key ? key : "chatgate");
        CHECK(json_equal(back, orig));
        json_decref(orig);
        json_decref(back);
    }
    json_decref(object);
    free(built.buf);
    size_t clen = 0;
    char *cancel = cg_dropin_map_cancel_frame(cfg, chat.id, chat.id_is_integer, &clen);
    int has_cancel = json_object_get(json_object_get(cfg, "app_frames"), "cancel_frame") != NULL;
    CHECK(!cancel == !has_cancel);
    if (cancel && !(codec && strcmp(codec, "text") == 0)) { /* JSON, behind socket.io's "42" */
        const char *j = cancel;
        if (codec) { /* "42", then "/ns," for a namespace but the main one */
            CHECK(strncmp(cancel, "42", 2) == 0);
            j = cancel[2] == '/' ? strchr(cancel, ',') : cancel + 1;
            CHECK(j++);
        }
        json_t *c = json_loads(j, 0, NULL);
        CHECK(c && clen == strlen(cancel));
        json_decref(c);
    }
    free(cancel);
    cg_dropin_chat_clear(&chat);
}

static void app_side(json_t *cfg, const char *buf, size_t len, int binary)
{
    cg_dropin_app_frame a;
    int rc = cg_dropin_map_app(cfg, buf, len, binary, &a);
    CHECK(rc == 0); /* only out of memory fails */
    if (a.state) {
        CHECK(a.rewritten && a.rewritten_len == strlen(a.rewritten));
        json_t *back = json_loads(a.rewritten, JSON_ALLOW_NUL, NULL);
        CHECK(back && !json_object_get(back, json_string_value(json_object_get(cfg, "state_key"))));
        json_decref(back);
    }
    (void)cg_dropin_app_frame_about(&a, "m1");
    (void)cg_dropin_app_frame_about(&a, "");
    cg_dropin_app_frame_clear(&a);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!cfgs[0])
        for (size_t i = 0; i < N_MAPPINGS; i++)
            CHECK((cfgs[i] = json_loads(mappings[i], 0, NULL)));
    if (size < 1)
        return 0;
    json_t *cfg = cfgs[data[0] % N_MAPPINGS];
    int binary = (data[0] >> 4) == 0xF;
    const char *rest = (const char *)data + 1;
    size_t n = size - 1;
    const char *sep = memchr(rest, 0, n);
    size_t clen = sep ? (size_t)(sep - rest) : n;
    client_side(cfg, rest, clen, binary);
    if (sep)
        app_side(cfg, sep + 1, n - clen - 1, binary);
    (void)cg_ws_close_check(rest, clen);
    return 0;
}
