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

/* {"pointer": "/type", "equals": "chat"} */
static int check_marker(json_t *obj, const char *key, int required, const char *file, const char *where, char *err,
                        size_t errlen)
{
    json_t *m = json_object_get(obj, key);
    if (!m && !required)
        return 0;
    json_t *ptr = json_object_get(m, "pointer");
    if (!json_is_object(m) || !json_is_string(ptr) || !cg_json_pointer_valid(json_string_value(ptr)) ||
        !json_object_get(m, "equals")) {
        snprintf(err, errlen,
                 "%s: dropin.%s.%s: must be {\"pointer\": \"/type\", \"equals\": VALUE} with a JSON pointer (RFC 6901)",
                 file, where, key);
        return -1;
    }
    return 0;
}

int cg_dropin_config_check(json_t *d, const char *file, char *err, size_t errlen)
{
    static const char *const known[] = {"path", "app", "subprotocols", "forward_headers", "user_cookie", "client",
                                        "app_frames", "object_key", "state_key", "turn_timeout_ms", NULL};
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
    json_t *tt = json_object_get(d, "turn_timeout_ms");
    if (tt && (!json_is_integer(tt) || json_integer_value(tt) < 100 || json_integer_value(tt) > 3600000)) {
        snprintf(err, errlen, "%s: dropin.turn_timeout_ms: must be an integer from 100 to 3600000", file);
        return -1;
    }
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
    json_t *appf = json_object_get(d, "app_frames");
    if (appf && !json_is_object(appf)) {
        snprintf(err, errlen, "%s: dropin.app_frames: must be an object: text, id, end, cancelled, cancel_frame",
                 file);
        return -1;
    }
    if (check_pointer(appf, "text", 0, file, "app_frames", err, errlen) < 0 ||
        check_pointer(appf, "id", 0, file, "app_frames", err, errlen) < 0 ||
        check_marker(appf, "end", 0, file, "app_frames", err, errlen) < 0 ||
        check_marker(appf, "cancelled", 0, file, "app_frames", err, errlen) < 0)
        return -1;
    json_t *cf = json_object_get(appf, "cancel_frame");
    if (cf && !json_is_object(cf)) {
        snprintf(err, errlen, "%s: dropin.app_frames.cancel_frame: must be the JSON object to send, \"{id}\" for the id",
                 file);
        return -1;
    }
    return 0;
}

