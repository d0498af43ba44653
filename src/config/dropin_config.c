/*
 * dropin_config.c: the schema check of the "dropin" object of a config file (see
 * dropin_config.h): which keys it may have, and that every pointer and marker of the
 * mapping is well formed, so a mistake is reported at start with its key, not met later
 * on the data path.
 */
#include <stdio.h>
#include <string.h>

#include "chatgate/config/dropin_config.h"
#include "chatgate/core/jsonptr.h"

static int check_pointer(json_t *obj, const char *key, int required, const char *file, const char *where,
                         char *err, size_t errlen)
{
    json_t *v = json_object_get(obj, key);
    if (!v && !required)
        return 0;
    if (!json_is_string(v) || !cg_json_pointer_valid(json_string_value(v))) {
        snprintf(err, errlen, "%s: dropin.%s.%s: must be a JSON pointer (RFC 6901) such as \"/text\"", file, where,
                 key);
        return -1;
    }
    return 0;
}

/*
 * A marker: {"pointer": P, "equals": V}, {"pointer": P, "in": [V, ...]},
 * {"pointer": P, "exists": true}, or {"every_text_frame": true}; nothing else in it.
 */
static int check_marker(json_t *obj, const char *key, int required, const char *file, const char *where, char *err,
                        size_t errlen)
{
    json_t *m = json_object_get(obj, key);
    if (!m && !required)
        return 0;
    json_t *ptr = json_object_get(m, "pointer"), *in = json_object_get(m, "in"), *ex = json_object_get(m, "exists");
    int tests = !!json_object_get(m, "equals") + !!in + !!ex;
    int ok = json_is_object(m) &&
             ((json_object_size(m) == 1 && json_is_true(json_object_get(m, "every_text_frame"))) ||
              (json_object_size(m) == 2 && tests == 1 && json_is_string(ptr) &&
               cg_json_pointer_valid(json_string_value(ptr)) && (!in || (json_is_array(in) && json_array_size(in))) &&
               (!ex || json_is_true(ex))));
    if (!ok) {
        snprintf(err, errlen,
                 "%s: dropin.%s.%s: must be {\"pointer\": \"/type\", \"equals\": VALUE}, {\"pointer\": P, \"in\": "
                 "[VALUE, ...]}, {\"pointer\": P, \"exists\": true} or {\"every_text_frame\": true}",
                 file, where, key);
        return -1;
    }
    return 0;
}

/* The text codec has no fields to point at: every text frame is the message or the reply. */
static int check_text_codec(json_t *d, const char *file, char *err, size_t errlen)
{
    static const char *const sections[] = {"client", "app_frames"};
    for (int i = 0; i < 2; i++) {
        json_t *sec = json_object_get(d, sections[i]);
        if (sec && !json_is_object(sec)) {
            snprintf(err, errlen, "%s: dropin.%s: must be an object", file, sections[i]);
            return -1;
        }
        const char *key;
        json_t *v;
        json_object_foreach(json_object_get(d, sections[i]), key, v) {
            if (i == 1 && strcmp(key, "cancel_frame") == 0 && json_is_string(v))
                continue;
            if (i == 1 && strcmp(key, "reply") == 0) /* which frames are the reply: every_text_frame */
                continue;
            snprintf(err, errlen,
                     "%s: dropin.%s.%s: the text codec has no fields to map (every text frame is the message, or "
                     "the reply); only app_frames.cancel_frame, as a string, and app_frames.reply may be set",
                     file, sections[i], key);
            return -1;
        }
    }
    if (json_object_get(d, "object_at") || json_object_get(d, "namespace")) {
        snprintf(err, errlen, "%s: dropin: object_at and namespace need the json or socket.io codec", file);
        return -1;
    }
    return check_marker(json_object_get(d, "app_frames"), "reply", 0, file, "app_frames", err, errlen);
}

/* Mappings that load but could never work are refused with the reason. */
static int check_workable(json_t *d, const char *codec, const char *file, char *err, size_t errlen)
{
    json_t *client = json_object_get(d, "client"), *appf = json_object_get(d, "app_frames");
    if (json_object_get(appf, "id") && !json_object_get(client, "id")) {
        snprintf(err, errlen,
                 "%s: dropin.app_frames.id: the client's messages have no id (dropin.client.id), so no reply "
                 "could ever be matched to one",
                 file);
        return -1;
    }
    json_t *cf = json_object_get(appf, "cancel_frame");
    int sio = strcmp(codec, "socket.io") == 0;
    if (cf && (sio ? !json_is_array(cf) || !json_array_size(cf) || !json_is_string(json_array_get(cf, 0))
                   : strcmp(codec, "json") == 0 && !json_is_object(cf))) {
        snprintf(err, errlen, "%s: dropin.app_frames.cancel_frame: must be %s to send, \"{id}\" for the id", file,
                 sio ? "the event array ([\"name\", args...])" : "the JSON object");
        return -1;
    }
    if (json_object_get(d, "state_key") && strcmp(codec, "json") != 0) {
        snprintf(err, errlen, "%s: dropin.state_key: a state directive is read from JSON app frames: it needs the "
                 "json codec", file);
        return -1;
    }
    json_t *at = json_object_get(d, "object_at");
    if (at && (!json_is_string(at) || !cg_json_pointer_valid(json_string_value(at)))) {
        snprintf(err, errlen, "%s: dropin.object_at: must be a JSON pointer (RFC 6901), \"/-\" to append to an array",
                 file);
        return -1;
    }
    return 0;
}

int cg_dropin_config_check(json_t *d, const char *file, char *err, size_t errlen)
{
    static const char *const known[] = {"path", "app", "subprotocols", "forward_headers", "user_cookie", "client",
                                        "app_frames", "object_key", "state_key", "turn_timeout_ms", "codec",
                                        "namespace", "object_at", "host", "headers", "reply_gap_ms", NULL};
    if (!json_is_object(d)) {
        snprintf(err, errlen, "%s: dropin: must be an object", file);
        return -1;
    }
    const char *key;
    json_t *v;
    json_object_foreach(d, key, v) {
        int ok = 0;
        for (int i = 0; known[i]; i++)
            ok |= strcmp(key, known[i]) == 0;
        if (!ok) {
            snprintf(err, errlen, "%s: dropin.%s: unknown key", file, key);
            return -1;
        }
    }
    json_t *codec_v = json_object_get(d, "codec");
    const char *codec = codec_v ? json_string_value(codec_v) : "json";
    if (!codec || (strcmp(codec, "json") && strcmp(codec, "socket.io") && strcmp(codec, "text"))) {
        snprintf(err, errlen, "%s: dropin.codec: must be \"json\", \"socket.io\" or \"text\"", file);
        return -1;
    }
    json_t *ns = json_object_get(d, "namespace");
    if (ns && (strcmp(codec, "socket.io") || !json_is_string(ns) || json_string_value(ns)[0] != '/' ||
               strpbrk(json_string_value(ns), ",\"") || json_string_length(ns) > 128)) {
        snprintf(err, errlen, "%s: dropin.namespace: the socket.io codec's namespace, such as \"/chat\" (no ',')",
                 file);
        return -1;
    }
    json_t *host = json_object_get(d, "host");
    if (host && (!json_is_string(host) || json_string_length(host) == 0 || json_string_length(host) > 110 ||
                 strpbrk(json_string_value(host), "\r\n /"))) {
        snprintf(err, errlen, "%s: dropin.host: must be \"client\", \"app\" or a host[:port]", file);
        return -1;
    }
    json_t *path = json_object_get(d, "path");
    if (!json_is_string(path) || json_string_value(path)[0] != '/' || strcmp(json_string_value(path), "/ws") == 0) {
        snprintf(err, errlen, "%s: dropin.path: must be the app's WebSocket path, such as \"/socket\" (not /ws)",
                 file);
        return -1;
    }
    json_t *app = json_object_get(d, "app");
    const char *url = json_string_value(app);
    if (!json_is_string(app) || (strncmp(url, "ws://", 5) != 0 && strncmp(url, "wss://", 6) != 0)) {
        snprintf(err, errlen, "%s: dropin.app: must be the app's ws:// or wss:// URL", file);
        return -1;
    }
    static const char *const lists[] = {"subprotocols", "forward_headers"};
    for (int i = 0; i < 2; i++) {
        json_t *list = json_object_get(d, lists[i]);
        size_t k;
        json_t *item;
        int ok = !list || (json_is_array(list) && json_array_size(list) <= CG_DROPIN_MAX_FORWARD_HEADERS);
        json_array_foreach(list, k, item) ok &= json_is_string(item) && json_string_length(item) > 0 &&
                                               json_string_length(item) < 64;
        if (!ok) {
            snprintf(err, errlen, "%s: dropin.%s: must be a list of at most %d names", file, lists[i],
                     CG_DROPIN_MAX_FORWARD_HEADERS);
            return -1;
        }
    }
    static const char *const times[] = {"turn_timeout_ms", "reply_gap_ms"};
    for (int i = 0; i < 2; i++) {
        json_t *t = json_object_get(d, times[i]);
        if (t && (!json_is_integer(t) || json_integer_value(t) < 100 || json_integer_value(t) > 3600000)) {
            snprintf(err, errlen, "%s: dropin.%s: must be an integer from 100 to 3600000", file, times[i]);
            return -1;
        }
    }
    if (strcmp(codec, "text") == 0)
        return check_text_codec(d, file, err, errlen);
    json_t *client = json_object_get(d, "client");
    if (!json_is_object(client)) {
        snprintf(err, errlen, "%s: dropin.client: must be an object: chat, text, room, id, cancel, cancel_id", file);
        return -1;
    }
    if (check_marker(client, "chat", 1, file, "client", err, errlen) < 0 ||
        check_pointer(client, "text", 1, file, "client", err, errlen) < 0 ||
        check_pointer(client, "room", 0, file, "client", err, errlen) < 0 ||
        check_pointer(client, "id", 0, file, "client", err, errlen) < 0 ||
        check_marker(client, "cancel", 0, file, "client", err, errlen) < 0 ||
        check_pointer(client, "cancel_id", 0, file, "client", err, errlen) < 0)
        return -1;
    json_t *args = json_object_get(client, "arguments");
    if (args && (strcmp(codec, "socket.io") || !json_is_integer(args) || json_integer_value(args) < 1 ||
                 json_integer_value(args) > CG_DROPIN_MAX_ARGUMENTS)) {
        snprintf(err, errlen, "%s: dropin.client.arguments: the socket.io chat event's argument count, an integer "
                 "from 1 to %d", file, CG_DROPIN_MAX_ARGUMENTS);
        return -1;
    }
    json_t *appf = json_object_get(d, "app_frames");
    if (appf && !json_is_object(appf)) {
        snprintf(err, errlen, "%s: dropin.app_frames: must be an object: text, id, end, cancelled, cancel_frame",
                 file);
        return -1;
    }
    if (check_pointer(appf, "text", 0, file, "app_frames", err, errlen) < 0 ||
        check_pointer(appf, "id", 0, file, "app_frames", err, errlen) < 0 ||
        check_marker(appf, "end", 0, file, "app_frames", err, errlen) < 0 ||
        check_marker(appf, "cancelled", 0, file, "app_frames", err, errlen) < 0 ||
        check_marker(appf, "reply", 0, file, "app_frames", err, errlen) < 0)
        return -1;
    return check_workable(d, codec, file, err, errlen);
}

