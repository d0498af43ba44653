/*
 * dropin_map.c: the drop-in mapping (see dropin_map.h). Pure: everything a frame carries is
 * untrusted, so every value is checked for type and size before it is used, ids and rooms
 * are copied with their real length (never cut), and every jansson result is checked.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chatgate/proto/dropin_map.h"
#include "chatgate/core/jsonout.h"
#include "chatgate/core/jsonptr.h"
#include "chatgate/proto/protocol.h"

static const char *cfg_str(json_t *cfg, const char *section, const char *key)
{
    json_t *s = section ? json_object_get(cfg, section) : cfg;
    return json_string_value(json_object_get(s, key));
}

typedef enum { CODEC_JSON, CODEC_SOCKETIO, CODEC_TEXT } codec;

static codec codec_of(json_t *cfg)
{
    const char *c = cfg_str(cfg, NULL, "codec");
    return !c || strcmp(c, "json") == 0 ? CODEC_JSON : strcmp(c, "socket.io") == 0 ? CODEC_SOCKETIO : CODEC_TEXT;
}

/*
 * A Socket.IO EVENT in an Engine.IO message: "4" (message) "2" (event), then "/ns," when
 * not the main namespace, then the ack id's digits, then the JSON array. Only events of the
 * mapping's namespace (dropin.namespace, "/") are ours; *prefix_len is the length up to the
 * array. The array is returned when it is one whose first element (the event name) is a
 * string, else NULL.
 */
static json_t *socketio_event(json_t *cfg, const char *buf, size_t len, size_t *prefix_len)
{
    const char *want = cfg_str(cfg, NULL, "namespace");
    size_t i = 2, ns_len = 1;
    const char *ns = "/";
    if (len < 3 || buf[0] != '4' || buf[1] != '2')
        return NULL;
    if (buf[i] == '/') {
        const char *comma = memchr(buf + i, ',', len - i);
        if (!comma)
            return NULL;
        ns = buf + i;
        ns_len = (size_t)(comma - ns);
        i = (size_t)(comma - buf) + 1;
    }
    if (!want)
        want = "/";
    if (ns_len != strlen(want) || memcmp(ns, want, ns_len) != 0)
        return NULL;
    while (i < len && buf[i] >= '0' && buf[i] <= '9')
        i++;
    json_t *arr = i < len && buf[i] == '[' ? json_loadb(buf + i, len - i, 0, NULL) : NULL;
    if (!json_is_string(json_array_get(arr, 0))) {
        json_decref(arr);
        return NULL;
    }
    *prefix_len = i;
    return arr;
}

/* A text frame as the value the mapping reads (see dropin_map.h); NULL when it holds none. */
static json_t *decode(json_t *cfg, const char *buf, size_t len, size_t flags, char **prefix)
{
    size_t plen = 0;
    json_t *v;
    switch (codec_of(cfg)) {
    case CODEC_TEXT:
        return json_stringn(buf, len); /* NULL when not UTF-8 */
    case CODEC_SOCKETIO:
        v = socketio_event(cfg, buf, len, &plen);
        if (v && prefix && !(*prefix = strndup(buf, plen)))
            abort();
        return v;
    default:
        return json_loadb(buf, len, flags, NULL);
    }
}

/* Does the value match a marker of the config (dropin_config.c's check_marker forms)? */
static int matches(json_t *frame, json_t *marker)
{
    if (!frame || !marker)
        return 0;
    if (json_is_true(json_object_get(marker, "every_text_frame")))
        return 1;
    const char *ptr = json_string_value(json_object_get(marker, "pointer"));
    json_t *v = ptr ? cg_json_pointer_get(frame, ptr) : NULL, *in = json_object_get(marker, "in"), *one;
    size_t i;
    if (!v)
        return 0;
    if (json_is_true(json_object_get(marker, "exists")))
        return 1;
    json_array_foreach(in, i, one) if (json_equal(v, one)) return 1;
    return json_equal(v, json_object_get(marker, "equals"));
}

static char *dup_bytes(const char *s, size_t n)
{
    char *out = malloc(n + 1);
    if (!out)
        abort();
    memcpy(out, s, n);
    out[n] = 0;
    return out;
}

/*
 * A chat message's id or room at ptr, as text: a string of 1 to max bytes as it is, an
 * integer written out; absent, null or "" give dflt. -1 (and why) for any other value.
 */
static int field_text(json_t *frame, const char *ptr, size_t max, const char *dflt, const char *name, char **out,
                      char *why, size_t whylen)
{
    json_t *v = ptr ? cg_json_pointer_get(frame, ptr) : NULL;
    if (json_is_integer(v)) {
        char num[32];
        int n = snprintf(num, sizeof(num), "%" JSON_INTEGER_FORMAT, json_integer_value(v));
        *out = dup_bytes(num, (size_t)n);
        return 0;
    }
    if (!v || json_is_null(v) || (json_is_string(v) && json_string_length(v) == 0)) {
        *out = dup_bytes(dflt, strlen(dflt));
        return 0;
    }
    if (!json_is_string(v) || json_string_length(v) > max) {
        snprintf(why, whylen, "dropin.client.%s (%s): must be a string of 1 to %zu bytes or an integer", name, ptr,
                 max);
        return -1;
    }
    *out = dup_bytes(json_string_value(v), json_string_length(v));
    return 0;
}

cg_dropin_client_kind cg_dropin_map_client(json_t *cfg, const char *buf, size_t len, int binary,
                                           cg_dropin_chat *chat, char *why, size_t whylen)
{
    memset(chat, 0, sizeof(*chat));
    why[0] = 0;
    json_t *client = json_object_get(cfg, "client");
    int text_codec = codec_of(cfg) == CODEC_TEXT;
    json_t *o = binary ? NULL : decode(cfg, buf, len, 0, &chat->prefix);
    if (!o) {
        free(chat->prefix);
        chat->prefix = NULL;
        return CG_DROPIN_PASS;
    }
    chat->frame = o;
    if (matches(o, json_object_get(client, "cancel"))) {
        cg_dropin_chat_clear(chat);
        return CG_DROPIN_CANCEL;
    }
    if (!text_codec && !matches(o, json_object_get(client, "chat"))) {
        cg_dropin_chat_clear(chat);
        return CG_DROPIN_PASS;
    }
    const char *text_ptr = text_codec ? "" : cfg_str(cfg, "client", "text");
    json_t *text = text_ptr ? cg_json_pointer_get(o, text_ptr) : NULL;
    if (!json_is_string(text) || json_string_length(text) == 0) {
        snprintf(why, whylen, "dropin.client.text (%s): must be a non-empty string", text_ptr ? text_ptr : "");
        goto bad;
    }
    if (field_text(o, cfg_str(cfg, "client", "id"), CG_MAX_ID, "", "id", &chat->id, why, whylen) < 0 ||
        field_text(o, cfg_str(cfg, "client", "room"), CG_MAX_ROOM, "default", "room", &chat->room, why, whylen) < 0)
        goto bad;
    chat->text = dup_bytes(json_string_value(text), json_string_length(text));
    return CG_DROPIN_CHAT;
bad:
    cg_dropin_chat_clear(chat);
    return CG_DROPIN_BAD_CHAT;
}

void cg_dropin_chat_clear(cg_dropin_chat *chat)
{
    json_decref(chat->frame);
    free(chat->prefix);
    free(chat->id);
    free(chat->room);
    free(chat->text);
    memset(chat, 0, sizeof(*chat));
}

/* Puts object into copy at dropin.object_at: under object_key in the object there, or, for a
 * pointer ending in "/-", appended to the array there. Takes object; -1 when the frame has no
 * such place. */
static int place_object(json_t *cfg, json_t *copy, json_t *object)
{
    const char *key = cfg_str(cfg, NULL, "object_key");
    const char *at = cfg_str(cfg, NULL, "object_at");
    if (!at)
        at = codec_of(cfg) == CODEC_SOCKETIO ? "/-" : "";
    size_t n = strlen(at);
    if (n >= 2 && strcmp(at + n - 2, "/-") == 0) {
        char *parent = dup_bytes(at, n - 2);
        json_t *arr = cg_json_pointer_get(copy, parent);
        free(parent);
        if (json_is_array(arr))
            return json_array_append_new(arr, object);
    } else {
        json_t *target = cg_json_pointer_get(copy, at);
        if (json_is_object(target))
            return json_object_set_new(target, key ? key : "chatgate", object);
    }
    json_decref(object);
    return -1;
}

/* The text codec's frame: the text as it came (CG_FRAME_PRE of room in front). */
static cg_frame_text text_frame(const char *text, size_t len)
{
    cg_frame_text f = {0};
    f.buf = malloc(CG_FRAME_PRE + len + 1);
    if (!f.buf)
        abort();
    f.json = f.buf + CG_FRAME_PRE;
    memcpy(f.json, text, len);
    f.len = len;
    f.json[len] = 0;
    return f;
}

/* value as the codec writes it: the packet's prefix (socket.io; NULL for json), then the
 * compact JSON, dumped where it is sent from (lws's header goes in the room before). */
static cg_frame_text encode(const char *prefix, json_t *value)
{
    cg_frame_text f = {0};
    size_t plen = prefix ? strlen(prefix) : 0, n = 0;
    f.buf = cg_json_dump_pre(value, CG_FRAME_PRE + plen, 1024, &n);
    if (!f.buf)
        return f;
    f.json = f.buf + CG_FRAME_PRE;
    if (plen)
        memcpy(f.json, prefix, plen);
    f.len = plen + n;
    return f;
}

cg_frame_text cg_dropin_map_forward(json_t *cfg, const cg_dropin_chat *chat, json_t *object)
{
    cg_frame_text f = {0};
    if (codec_of(cfg) == CODEC_TEXT) { /* no place for the object: the text as it came */
        json_decref(object);
        return json_is_string(chat->frame)
                   ? text_frame(json_string_value(chat->frame), json_string_length(chat->frame))
                   : f;
    }
    /* socket.io hands an event's ack callback to the handler after its arguments: one more
     * argument would take the callback's place, so an event with an ack id gets the object
     * only where object_at says, never appended by default */
    size_t plen = chat->prefix ? strlen(chat->prefix) : 0;
    int ack = plen > 2 && chat->prefix[plen - 1] >= '0' && chat->prefix[plen - 1] <= '9'; /* "427", "42/ns,7" */
    if (ack && !cfg_str(cfg, NULL, "object_at")) {
        json_decref(object);
        return encode(chat->prefix, chat->frame);
    }
    json_t *copy = chat->frame ? json_deep_copy(chat->frame) : NULL;
    if (!copy) {
        json_decref(object);
        return f;
    }
    if (object && place_object(cfg, copy, object) == 0) /* place_object takes object, placed or not */
        f = encode(chat->prefix, copy);
    json_decref(copy);
    return f;
}

int cg_dropin_map_app(json_t *cfg, const char *buf, size_t len, int binary, cg_dropin_app_frame *out)
{
    memset(out, 0, sizeof(*out));
    json_t *appf = json_object_get(cfg, "app_frames");
    codec c = codec_of(cfg);
    char *prefix = NULL;
    json_t *o = binary ? NULL : decode(cfg, buf, len, JSON_ALLOW_NUL, &prefix);
    free(prefix); /* app frames are relayed as they came, never re-encoded but for a directive */
    if (!o || (c == CODEC_JSON && !json_is_object(o))) {
        json_decref(o);
        return 0;
    }
    out->frame = o;
    json_t *reply = json_object_get(appf, "reply");
    out->reply = !reply || matches(o, reply);
    if (c == CODEC_TEXT) {
        out->text = json_string_value(o);
        out->text_len = json_string_length(o);
        return 0;
    }
    const char *id_ptr = cfg_str(cfg, "app_frames", "id");
    json_t *id = id_ptr ? cg_json_pointer_get(o, id_ptr) : NULL;
    if (json_is_string(id) && json_string_length(id) > 0) {
        out->id_len = json_string_length(id);
        out->id = dup_bytes(json_string_value(id), out->id_len);
    } else if (json_is_integer(id)) {
        char num[32];
        out->id_len = (size_t)snprintf(num, sizeof(num), "%" JSON_INTEGER_FORMAT, json_integer_value(id));
        out->id = dup_bytes(num, out->id_len);
    }
    out->end = matches(o, json_object_get(appf, "end"));
    out->cancelled = matches(o, json_object_get(appf, "cancelled"));
    const char *text_ptr = cfg_str(cfg, "app_frames", "text");
    json_t *text = text_ptr ? cg_json_pointer_get(o, text_ptr) : NULL;
    if (json_is_string(text)) {
        out->text = json_string_value(text);
        out->text_len = json_string_length(text);
    }
    const char *state_key = cfg_str(cfg, NULL, "state_key");
    json_t *state = state_key && c == CODEC_JSON ? json_object_get(o, state_key) : NULL;
    if (!state)
        return 0;
    /* the directive is kept (a reference, so text under it stays valid) and removed */
    out->state = json_incref(state);
    json_object_del(o, state_key);
    out->rewritten = json_dumps(o, JSON_COMPACT);
    if (!out->rewritten)
        return -1;
    out->rewritten_len = strlen(out->rewritten);
    return 0;
}

void cg_dropin_app_frame_clear(cg_dropin_app_frame *f)
{
    json_decref(f->state);
    json_decref(f->frame);
    free(f->id);
    free(f->rewritten);
    memset(f, 0, sizeof(*f));
}

int cg_dropin_app_frame_about(const cg_dropin_app_frame *f, const char *id)
{
    return !f->id || (f->id_len == strlen(id) && memcmp(f->id, id, f->id_len) == 0);
}

char *cg_dropin_map_cancel_frame(json_t *cfg, const char *id, size_t *len)
{
    json_t *tmpl = json_object_get(json_object_get(cfg, "app_frames"), "cancel_frame");
    codec c = codec_of(cfg);
    if (!tmpl)
        return NULL;
    /* the template's text, and the id as it goes in: JSON-escaped (no quotes), or as it is */
    char *s = c == CODEC_TEXT ? strdup(json_string_value(tmpl) ? json_string_value(tmpl) : "")
                              : json_dumps(tmpl, JSON_COMPACT);
    json_t *id_str = c == CODEC_TEXT ? NULL : json_string(id);
    char *id_json = id_str ? json_dumps(id_str, JSON_ENCODE_ANY) : NULL;
    const char *id_text = c == CODEC_TEXT ? id : id_json ? id_json + 1 : NULL;
    size_t idl = id_text ? strlen(id_text) - (c == CODEC_TEXT ? 0 : 1) : 0;
    char *out = NULL;
    json_decref(id_str);
    if (!s || !id_text)
        goto done;
    /* socket.io: an event of the mapping's namespace, "42" and "/ns," unless it is "/" */
    const char *ns = cfg_str(cfg, NULL, "namespace");
    char head[160] = "";
    if (c == CODEC_SOCKETIO)
        snprintf(head, sizeof(head), "42%s%s", ns && strcmp(ns, "/") ? ns : "", ns && strcmp(ns, "/") ? "," : "");
    size_t hl = strlen(head), cap = hl + strlen(s) * (idl + 1) + 1, n = hl;
    out = malloc(cap);
    if (!out)
        abort();
    memcpy(out, head, hl);
    for (const char *p = s; *p;) {
        if (strncmp(p, "{id}", 4) == 0) {
            memcpy(out + n, id_text, idl);
            n += idl;
            p += 4;
        } else {
            out[n++] = *p++;
        }
    }
    out[n] = 0;
    *len = n;
done:
    free(s);
    free(id_json);
    return out;
}
