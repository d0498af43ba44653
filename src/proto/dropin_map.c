/*
 * dropin_map.c: the drop-in mapping (see dropin_map.h). Pure: everything a frame carries is
 * untrusted, so every value is checked for type and size before it is used, ids and rooms
 * are copied with their real length (never cut), and every jansson result is checked.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chatgate/core/alloc.h"
#include "chatgate/proto/dropin_map.h"
#include "chatgate/core/jsonout.h"
#include "chatgate/core/jsonptr.h"
#include "chatgate/core/utf8.h"
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
 * socket.io-parser's reading of one text frame (its Decoder.decodeString, version 4.2, as
 * socket.io 4 runs it): what the app will take for an event must be what we take for one,
 * or a frame we pass as "not ours" reaches the app's chat handler unchecked. After the
 * Engine.IO message type "4": the packet type ("2" an EVENT, "5" a BINARY_EVENT, whose
 * attachment count ends at a "-"), then "/ns" up to a ',' (or the end) when a '/' comes
 * next, then an ack id: every following character that JavaScript's Number() reads as a
 * number, which takes in whitespace as well as digits ("42 [" is an event with ack id 0),
 * then the JSON payload (JSON.parse: whitespace around it is fine).
 */
typedef enum { SIO_NOT_EVENT, SIO_EVENT, SIO_UNREADABLE } sio_kind;

typedef struct sio_event {
    size_t prefix_len;  /* up to the payload: "42/ns,7" */
    long attachments;   /* a BINARY_EVENT's binary frames that follow, else 0 */
    json_t *args;       /* the payload when it is an event's array (owned) */
} sio_event;

/* Length of the JavaScript whitespace character at s (ASCII, and the Unicode spaces that
 * Number() trims, in UTF-8), 0 when there is none. */
static size_t js_space(const unsigned char *s, size_t n)
{
    if (n >= 1 && (*s == ' ' || (*s >= '\t' && *s <= '\r')))
        return 1;
    if (n >= 2 && s[0] == 0xC2 && s[1] == 0xA0)
        return 2;
    if (n < 3)
        return 0;
    unsigned cp = (unsigned)(s[0] & 0x0F) << 12 | (unsigned)(s[1] & 0x3F) << 6 | (s[2] & 0x3F);
    int three = (s[0] & 0xF0) == 0xE0 && (s[1] & 0xC0) == 0x80 && (s[2] & 0xC0) == 0x80;
    return three && (cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 ||
                     cp == 0x202F || cp == 0x205F || cp == 0x3000 || cp == 0xFEFF)
               ? 3
               : 0;
}

/*
 * A binary event's attachment count as JavaScript's Number() reads it ("1", " 1", "+1",
 * "1.0", "0x1", "" is 0): parser versions differ on which counts they take (4.2.4 takes 0,
 * 4.2.7 refuses it), so every binary event is one for us, and the count only says how many
 * binary frames follow it; 0 when it is no whole number (nothing is then taken as its).
 */
static long sio_attachments(const char *s, size_t n)
{
    char text[32];
    size_t w;
    while (n && (w = js_space((const unsigned char *)s, n))) {
        s += w;
        n -= w;
    }
    while (n && (s[n - 1] == ' ' || (s[n - 1] >= '\t' && s[n - 1] <= '\r')))
        n--;
    if (n == 0 || n >= sizeof(text))
        return 0;
    memcpy(text, s, n);
    text[n] = 0;
    char *end;
    double v = (n > 2 && text[0] == '0' && (text[1] == 'x' || text[1] == 'X')) ? (double)strtol(text + 2, &end, 16)
                                                                               : strtod(text, &end);
    return *end || !(v >= 0 && v <= 1000) || v != (double)(long)v ? 0 : (long)v;
}

/* An event's name as socket.io's emitter finds its handler: a number is its decimal text. */
static void sio_name_as_text(json_t *args)
{
    json_t *name = json_array_get(args, 0);
    double v = json_number_value(name);
    if (!json_is_number(name) || v != v || v < -1e15 || v > 1e15 || v != (double)(long long)v)
        return;
    char text[32];
    snprintf(text, sizeof(text), "%lld", (long long)v);
    json_array_set_new(args, 0, json_string(text));
}

/*
 * Reads buf as socket.io-parser does. SIO_EVENT: an event (or binary event) of the mapping's
 * namespace with its array in ev->args; SIO_UNREADABLE: one of that namespace that the app
 * reads as an event but we cannot (its JSON is one jansson refuses: a number out of range, a
 * lone surrogate, \u0000, a duplicate key); SIO_NOT_EVENT: anything else (another packet
 * type, another namespace, a frame the app's parser refuses).
 */
static sio_kind socketio_event(json_t *cfg, const char *buf, size_t len, sio_event *ev)
{
    const unsigned char *b = (const unsigned char *)buf;
    const char *want = cfg_str(cfg, NULL, "namespace");
    size_t i = 2;
    memset(ev, 0, sizeof(*ev));
    if (len < 3 || b[0] != '4' || (b[1] != '2' && b[1] != '5'))
        return SIO_NOT_EVENT;
    if (b[1] == '5') { /* the attachment count, up to '-' */
        const char *dash = memchr(buf + i, '-', len - i);
        if (!dash)
            return SIO_NOT_EVENT; /* the app's parser refuses it too */
        ev->attachments = sio_attachments(buf + i, (size_t)(dash - buf) - i);
        i = (size_t)(dash - buf) + 1;
    }
    const char *ns = "/";
    size_t ns_len = 1;
    if (i < len && b[i] == '/') {
        const char *comma = memchr(buf + i, ',', len - i);
        ns = buf + i;
        ns_len = comma ? (size_t)(comma - ns) : len - i;
        i += ns_len + (comma != NULL);
    }
    if (!want)
        want = "/";
    if (ns_len != strlen(want) || memcmp(ns, want, ns_len) != 0)
        return SIO_NOT_EVENT;
    for (size_t w; i < len; i += w) /* the ack id */
        if (!(w = b[i] >= '0' && b[i] <= '9' ? 1 : js_space(b + i, len - i)))
            break;
    ev->prefix_len = i;
    if (i == len)
        return SIO_NOT_EVENT; /* no payload: the app's parser refuses an event without one */
    json_error_t jerr;
    json_t *payload = json_loadb(buf + i, len - i, JSON_REJECT_DUPLICATES, &jerr);
    if (!payload) {
        size_t k = i;
        while (k < len && (b[k] == ' ' || b[k] == '\t' || b[k] == '\n' || b[k] == '\r'))
            k++;
        return k < len && b[k] == '[' ? SIO_UNREADABLE : SIO_NOT_EVENT;
    }
    sio_name_as_text(payload);
    if (!json_is_string(json_array_get(payload, 0))) { /* the app's parser refuses it too */
        json_decref(payload);
        return SIO_NOT_EVENT;
    }
    ev->args = payload;
    return SIO_EVENT;
}

/* Does a binary frame hold JSON in another encoding than plain UTF-8, as Python's json.loads
 * reads bytes (a UTF-8 BOM, UTF-16 or UTF-32 with or without one)? After any BOM, NULs and
 * whitespace, the first byte starts an object or array. */
static int other_encoding_json(const char *buf, size_t len)
{
    const unsigned char *b = (const unsigned char *)buf;
    size_t k = len >= 3 && b[0] == 0xEF && b[1] == 0xBB && b[2] == 0xBF ? 3 : 0;
    int odd = k > 0;
    for (; k < len && (b[k] == 0 || b[k] == 0xFE || b[k] == 0xFF || b[k] == ' ' || b[k] == '\t' || b[k] == '\n' ||
                       b[k] == '\r');
         k++)
        odd |= b[k] == 0 || b[k] >= 0xFE;
    return odd && k < len && (b[k] == '{' || b[k] == '[');
}

/* Is the first byte that is not JSON whitespace one that starts an object or array? */
static int looks_like_json(const char *buf, size_t len)
{
    size_t k = 0;
    while (k < len && (buf[k] == ' ' || buf[k] == '\t' || buf[k] == '\n' || buf[k] == '\r'))
        k++;
    return k < len && (buf[k] == '{' || buf[k] == '[');
}

/*
 * A client frame as the value the mapping reads (see dropin_map.h): *v NULL when it holds
 * nothing the app reads as a message; -1 (and why) when the app would read it but we cannot
 * check it. A binary frame is read as text when it is UTF-8: apps that parse JSON parse
 * bytes too (Python's json.loads, JSON.parse of a Buffer).
 */
static int decode_client(json_t *cfg, const char *buf, size_t len, int binary, json_t **v, char **prefix,
                         long *attachments, char *why, size_t whylen)
{
    *v = NULL;
    *attachments = 0;
    int utf8;
    switch (codec_of(cfg)) {
    case CODEC_TEXT:
        utf8 = cg_utf8_valid(buf, len);
        if (!utf8 && !binary) {
            snprintf(why, whylen, "a text frame that is not UTF-8");
            return -1;
        }
        if (utf8 && memchr(buf, 0, len)) { /* the rules would read up to the NUL, the app past it */
            snprintf(why, whylen, "a message holding a NUL byte");
            return -1;
        }
        if (utf8 && binary) {
            snprintf(why, whylen, "a chat message in a binary frame: send it as text");
            return -1;
        }
        *v = utf8 ? json_stringn(buf, len) : NULL;
        return 0;
    case CODEC_SOCKETIO: {
        if (binary) /* an attachment: its event decided (the caller counts them) */
            return 0;
        sio_event ev;
        sio_kind k = socketio_event(cfg, buf, len, &ev);
        if (k == SIO_UNREADABLE) {
            *attachments = ev.attachments;
            snprintf(why, whylen, "an event whose JSON the gateway cannot read (a number out of range, a lone "
                                  "surrogate, \\u0000 or a duplicate key)");
            return -1;
        }
        if (k == SIO_NOT_EVENT)
            return 0;
        *attachments = ev.attachments;
        *v = ev.args;
        *prefix = cg_strndup(buf, ev.prefix_len);
        return 0;
    }
    default:
        if (binary && other_encoding_json(buf, len)) {
            snprintf(why, whylen, "JSON in a binary frame that is not plain UTF-8 (a BOM, UTF-16 or UTF-32): send "
                                  "chat messages as text");
            return -1;
        }
        if (binary && !cg_utf8_valid(buf, len)) { /* a text frame's UTF-8 is jansson's to check */
            if (!looks_like_json(buf, len))
                return 0; /* bytes, not a message */
            /* Node's JSON.parse of a Buffer reads bad bytes as U+FFFD: the app would read it */
            snprintf(why, whylen, "JSON in a binary frame that is not valid UTF-8: send chat messages as text");
            return -1;
        }
        *v = json_loadb(buf, len, JSON_REJECT_DUPLICATES, NULL);
        if (!*v && looks_like_json(buf, len)) {
            snprintf(why, whylen, "JSON the gateway cannot read (a number out of range, NaN, a lone surrogate, "
                                  "\\u0000 or a duplicate key)");
            return -1;
        }
        return 0;
    }
}

/* An app frame as the value the mapping reads; NULL when it holds none. */
static json_t *decode_app(json_t *cfg, const char *buf, size_t len)
{
    sio_event ev;
    switch (codec_of(cfg)) {
    case CODEC_TEXT:
        return json_stringn(buf, len); /* NULL when not UTF-8 */
    case CODEC_SOCKETIO:
        return socketio_event(cfg, buf, len, &ev) == SIO_EVENT ? ev.args : NULL;
    default:
        return json_loadb(buf, len, JSON_ALLOW_NUL, NULL);
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
    char *out = cg_malloc(n + 1);
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
    if (json_is_integer(v)) { /* (cg_dropin_map_client notes it for the cancel frame) */
        char num[32];
        int n = snprintf(num, sizeof(num), "%" JSON_INTEGER_FORMAT, json_integer_value(v));
        *out = dup_bytes(num, (size_t)n);
        return 0;
    }
    if (!v || json_is_null(v) || (json_is_string(v) && json_string_length(v) == 0)) {
        *out = dup_bytes(dflt, strlen(dflt));
        return 0;
    }
    if (!json_is_string(v) || json_string_length(v) > max || memchr(json_string_value(v), 0, json_string_length(v))) {
        snprintf(why, whylen, "dropin.client.%s (%s): must be a string of 1 to %zu bytes or an integer", name, ptr,
                 max);
        return -1;
    }
    *out = dup_bytes(json_string_value(v), json_string_length(v));
    return 0;
}

int cg_dropin_map_arguments(json_t *cfg)
{
    json_t *client = json_object_get(cfg, "client");
    json_t *set = json_object_get(client, "arguments");
    if (json_is_integer(set))
        return (int)json_integer_value(set);
    static const char *const ptrs[] = {"text", "id", "room"};
    long n = 1;
    for (int i = 0; i < 3; i++) { /* "/2/text": the event's second argument */
        const char *p = json_string_value(json_object_get(client, ptrs[i]));
        char *end;
        long at = p && p[0] == '/' && p[1] >= '0' && p[1] <= '9' ? strtol(p + 1, &end, 10) : 0;
        if (at > n && at <= CG_DROPIN_MAX_ARGUMENTS && (*end == 0 || *end == '/'))
            n = at;
    }
    return (int)n;
}

/* Is the chatgate object one of the socket.io event's arguments, appended after them (the
 * default, or object_at "/-" written out)? A handler takes its arguments by position, so the
 * client's arguments are counted, and the object always goes at the same one. (Any other
 * append pointer is an array inside the frame: the object is its last element, which a
 * client cannot take, since it is appended after what the client sent.) */
static int appends_object(json_t *cfg)
{
    const char *at = cfg_str(cfg, NULL, "object_at");
    return codec_of(cfg) == CODEC_SOCKETIO && (!at || strcmp(at, "/-") == 0);
}

/* json codec: a client frame that carries a member where the chatgate object goes (object_at,
 * object_key), or where the app puts a state directive (state_key): the member is removed, so
 * that no frame reaches the app with an object the client wrote in chatgate's place, and no app
 * that echoes what a client sent hands the gateway a directive the client wrote. 1 when one was
 * removed. */
static int strip_object(json_t *cfg, json_t *frame)
{
    if (codec_of(cfg) != CODEC_JSON)
        return 0;
    const char *at = cfg_str(cfg, NULL, "object_at"), *key = cfg_str(cfg, NULL, "object_key");
    const char *state_key = cfg_str(cfg, NULL, "state_key");
    json_t *target = cg_json_pointer_get(frame, at ? at : "");
    int stripped = json_is_object(target) && json_object_del(target, key ? key : "chatgate") == 0;
    if (state_key && json_is_object(frame) && json_object_del(frame, state_key) == 0)
        stripped = 1;
    return stripped;
}

cg_dropin_client_kind cg_dropin_map_client(json_t *cfg, const char *buf, size_t len, int binary,
                                           cg_dropin_chat *chat, char *why, size_t whylen)
{
    memset(chat, 0, sizeof(*chat));
    why[0] = 0;
    json_t *client = json_object_get(cfg, "client");
    int text_codec = codec_of(cfg) == CODEC_TEXT;
    json_t *o;
    if (decode_client(cfg, buf, len, binary, &o, &chat->prefix, &chat->attachments, why, whylen) < 0)
        goto refuse;
    if (!o) {
        free(chat->prefix);
        chat->prefix = NULL;
        return CG_DROPIN_PASS;
    }
    chat->frame = o;
    int cancel = matches(o, json_object_get(client, "cancel"));
    int is_chat = text_codec || matches(o, json_object_get(client, "chat"));
    int binary_event = chat->prefix && chat->prefix[1] == '5'; /* "45...-": whatever its count */
    if ((cancel || is_chat) && (binary || binary_event)) {
        snprintf(why, whylen, "a %s in a binary frame or binary event: send it as text",
                 cancel ? "cancel" : "chat message");
        goto refuse;
    }
    if (cancel && !is_chat) { /* a frame that is both is a chat message: it passes the pipeline */
        char *id = NULL;      /* the message it stops ("": whichever is in flight) */
        if (field_text(o, cfg_str(cfg, "client", "cancel_id"), CG_MAX_ID, "", "cancel_id", &id, why, whylen) < 0)
            why[0] = 0;       /* an id no message can have: it stops none */
        if (!strip_object(cfg, o))
            cg_dropin_chat_clear(chat); /* no frame: it goes as it came */
        chat->id = id;
        return CG_DROPIN_CANCEL;
    }
    if (!is_chat) {
        long attachments = chat->attachments;
        int stripped = strip_object(cfg, o);
        if (!stripped)
            cg_dropin_chat_clear(chat);
        chat->attachments = attachments;
        return stripped ? CG_DROPIN_STRIPPED : CG_DROPIN_PASS;
    }
    const char *text_ptr = text_codec ? "" : cfg_str(cfg, "client", "text");
    json_t *text = text_ptr ? cg_json_pointer_get(o, text_ptr) : NULL;
    if (!json_is_string(text) || json_string_length(text) == 0) {
        snprintf(why, whylen, "dropin.client.text (%s): must be a non-empty string", text_ptr ? text_ptr : "");
        goto refuse;
    }
    if (memchr(json_string_value(text), 0, json_string_length(text))) {
        snprintf(why, whylen, "dropin.client.text (%s): holds a NUL byte", text_ptr);
        goto refuse;
    }
    int takes = appends_object(cfg) ? cg_dropin_map_arguments(cfg) : 0;
    if (takes && json_array_size(o) - 1 > (size_t)takes) {
        snprintf(why, whylen, "the chat event has %zu arguments, the mapping takes %d (dropin.client.arguments): "
                              "the one after them is chatgate's",
                 json_array_size(o) - 1, takes);
        goto refuse;
    }
    const char *id_ptr = cfg_str(cfg, "client", "id");
    if (field_text(o, id_ptr, CG_MAX_ID, "", "id", &chat->id, why, whylen) < 0 ||
        field_text(o, cfg_str(cfg, "client", "room"), CG_MAX_ROOM, "default", "room", &chat->room, why, whylen) < 0)
        goto refuse;
    chat->id_is_integer = id_ptr && json_is_integer(cg_json_pointer_get(o, id_ptr));
    chat->text = dup_bytes(json_string_value(text), json_string_length(text));
    strip_object(cfg, o); /* a state directive the client wrote (chatgate's object is replaced) */
    return CG_DROPIN_CHAT;
refuse: {
    long attachments = chat->attachments;
    cg_dropin_chat_clear(chat);
    chat->attachments = attachments;
    return CG_DROPIN_REFUSE;
}
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
    f.buf = cg_malloc(CG_FRAME_PRE + len + 1);
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
    /* socket.io: the object goes right after the arguments the mapping takes (padded with
     * null when the client sent fewer), so it is always the same argument of the handler; an
     * event with an ack id gets it there too, its callback after it */
    json_t *copy = chat->frame ? json_deep_copy(chat->frame) : NULL;
    if (!copy) {
        json_decref(object);
        return f;
    }
    int pad = appends_object(cfg) ? cg_dropin_map_arguments(cfg) + 1 : 0;
    while (json_array_size(copy) < (size_t)pad && json_array_append_new(copy, json_null()) == 0)
        ;
    if (object && place_object(cfg, copy, object) == 0) /* place_object takes object, placed or not */
        f = encode(chat->prefix, copy);
    json_decref(copy);
    return f;
}

cg_frame_text cg_dropin_map_encode(json_t *cfg, const cg_dropin_chat *chat)
{
    return encode(codec_of(cfg) == CODEC_SOCKETIO ? chat->prefix : NULL, chat->frame);
}

int cg_dropin_map_app(json_t *cfg, const char *buf, size_t len, int binary, cg_dropin_app_frame *out)
{
    memset(out, 0, sizeof(*out));
    json_t *appf = json_object_get(cfg, "app_frames");
    codec c = codec_of(cfg);
    /* app frames are relayed as they came, never re-encoded but for a directive */
    json_t *o = binary ? NULL : decode_app(cfg, buf, len);
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

char *cg_dropin_map_cancel_frame(json_t *cfg, const char *id, int id_is_integer, size_t *len)
{
    json_t *tmpl = json_object_get(json_object_get(cfg, "app_frames"), "cancel_frame");
    codec c = codec_of(cfg);
    if (!tmpl)
        return NULL;
    /* the template's text, and the id as it goes in: JSON-escaped (no quotes), or as it is */
    char *s = c == CODEC_TEXT ? cg_strdup(json_string_value(tmpl) ? json_string_value(tmpl) : "")
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
    out = cg_malloc(cap);
    memcpy(out, head, hl);
    int bare = c != CODEC_TEXT && id_is_integer; /* "{id}" alone: the number, unquoted */
    for (const char *p = s; *p;) {
        if (bare && strncmp(p, "\"{id}\"", 6) == 0 && p[6] != ':') { /* a value, not a key (compact JSON) */
            memcpy(out + n, id_text, idl); /* digits and '-': nothing JSON escapes */
            n += idl;
            p += 6;
        } else if (strncmp(p, "{id}", 4) == 0) {
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
