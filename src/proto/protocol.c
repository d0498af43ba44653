/*
 * protocol.c: chatgate.v1 frames in and out (docs/protocol.md).
 *
 * A client's frame is read by the flat reader when it is an object of plain members
 * (core/jsonflat.h: strings, true, false, null; most frames), else by jansson. Either way
 * JSON syntax, UTF-8 and NUL are checked (json_loadb refuses invalid UTF-8 and "\u0000"
 * unless asked; the flat reader reads only what jansson accepts), so a text frame with bad
 * bytes is answered as bad_frame with jansson's own position and reason, and every string
 * taken from a frame is a proper C string.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chatgate/core/alloc.h"
#include "chatgate/core/utf8.h"
#include "chatgate/core/error.h"
#include "chatgate/core/jsonflat.h"
#include "chatgate/core/jsonout.h"
#include "chatgate/proto/protocol.h"

static int fail(char *err, size_t errlen, const char *msg)
{
    snprintf(err, errlen, "%s", msg);
    return CG_E_BAD_FRAME;
}

/*
 * A frame's member as the checks below see it, whichever reader read the frame: the flat
 * reader for a frame of plain members (core/jsonflat.h, most frames), else jansson's tree.
 * A string's text is not NUL-terminated in the first case.
 */
typedef enum { M_ABSENT, M_NULL, M_STRING, M_OTHER } member_kind;
typedef struct member {
    member_kind kind;
    const char *s;
    size_t len;
} member;

typedef struct frame {
    const cg_jsonflat *flat; /* or */
    json_t *root;
} frame;

static member get(const frame *f, const char *key)
{
    member m = {M_ABSENT, NULL, 0};
    if (f->flat) {
        const cg_jsonflat_member *fm = cg_jsonflat_get(f->flat, key);
        if (fm) {
            m.kind = fm->kind == CG_JSONFLAT_STRING ? M_STRING : fm->kind == CG_JSONFLAT_NULL ? M_NULL : M_OTHER;
            m.s = fm->str;
            m.len = fm->len;
        }
        return m;
    }
    json_t *v = json_object_get(f->root, key);
    if (v) {
        m.kind = json_is_string(v) ? M_STRING : json_is_null(v) ? M_NULL : M_OTHER;
        if (m.kind == M_STRING) {
            m.s = json_string_value(v);
            m.len = json_string_length(v);
        }
    }
    return m;
}

static int is(member m, const char *text)
{
    return m.kind == M_STRING && m.len == strlen(text) && memcmp(m.s, text, m.len) == 0;
}

/* Copies an optional string field of at most max bytes into out; 0 or CG_E_BAD_FRAME. */
static int string_field(const frame *f, const char *key, char *out, size_t max, char *err, size_t errlen)
{
    member m = get(f, key);
    if (m.kind == M_ABSENT || m.kind == M_NULL)
        return 0;
    if (m.kind != M_STRING) {
        snprintf(err, errlen, "field '%s' must be a string", key);
        return CG_E_BAD_FRAME;
    }
    if (m.len == 0 || m.len > max) {
        snprintf(err, errlen, "field '%s' must be 1 to %zu bytes", key, max);
        return CG_E_BAD_FRAME;
    }
    memcpy(out, m.s, m.len);
    out[m.len] = '\0';
    return 0;
}

/* resume's "after": the seq of the last delta the client has (0 or absent: none), a whole
 * number; only in jansson's tree (the flat reader reads no numbers). */
static int after_field(const frame *f, uint64_t *after, char *err, size_t errlen)
{
    member m = get(f, "after");
    *after = 0;
    if (m.kind == M_ABSENT || m.kind == M_NULL)
        return 0;
    json_t *v = f->root ? json_object_get(f->root, "after") : NULL; /* a string or a bool: read flat */
    if (!json_is_integer(v) || json_integer_value(v) < 0)
        return fail(err, errlen, "field 'after' must be a whole number from 0 (the 'seq' of the last delta kept)");
    *after = (uint64_t)json_integer_value(v);
    return 0;
}

/* The frame's members into out, whichever reader read them. */
static int parse_members(const frame *f, cg_client_frame *out, char *err, size_t errlen)
{
    int rc;
    /* The id first, so that later errors can name the message they are about. */
    if ((rc = string_field(f, "id", out->id, CG_MAX_ID, err, errlen)) < 0)
        return rc;
    member type = get(f, "type");
    if (type.kind != M_STRING)
        return fail(err, errlen, "field 'type' is missing or not a string");
    if (is(type, "message")) {
        out->type = CG_FRAME_MESSAGE;
        if ((rc = string_field(f, "room", out->room, CG_MAX_ROOM, err, errlen)) < 0)
            return rc;
        if (!out->room[0])
            strcpy(out->room, "default");
        member text = get(f, "text");
        if (text.kind != M_STRING)
            return fail(err, errlen, "field 'text' is missing or not a string");
        if (text.len == 0)
            return fail(err, errlen, "field 'text' is empty");
        /* a client's text holds no NUL: jansson refuses "\u0000" here, the flat reader any \u */
        out->text = cg_malloc(text.len + 1);
        memcpy(out->text, text.s, text.len);
        out->text[text.len] = '\0';
    } else if (type.len > 8 && memcmp(type.s, "context.", 8) == 0) {
        static const struct { const char *name; cg_frame_type type; } kinds[] = {
            {"context.get", CG_FRAME_CONTEXT_GET},
            {"context.forget", CG_FRAME_CONTEXT_FORGET},
            {"context.clear", CG_FRAME_CONTEXT_CLEAR},
        };
        size_t i = 0;
        while (i < 3 && !is(type, kinds[i].name))
            i++;
        if (i == 3) {
            snprintf(err, errlen, "unknown type '%.*s'", (int)(type.len < 64 ? type.len : 64), type.s);
            return CG_E_BAD_FRAME;
        }
        out->type = kinds[i].type;
        if ((rc = string_field(f, "room", out->room, CG_MAX_ROOM, err, errlen)) < 0)
            return rc;
        if (!out->room[0])
            strcpy(out->room, "default");
        if (out->type == CG_FRAME_CONTEXT_FORGET) {
            /* an array: only in jansson's tree (the flat reader reads no arrays) */
            json_t *keys = f->root ? json_object_get(f->root, "keys") : NULL;
            size_t k;
            json_t *key;
            int ok = json_is_array(keys) && json_array_size(keys) > 0 && json_array_size(keys) <= 100;
            json_array_foreach(keys, k, key) ok &= json_is_string(key);
            if (!ok)
                return fail(err, errlen, "context.forget needs 'keys': 1 to 100 strings like \"travel.from\"");
            out->keys = json_incref(keys);
        }
    } else if (is(type, "profile.get") || is(type, "profile.forget")) {
        out->type = is(type, "profile.get") ? CG_FRAME_PROFILE_GET : CG_FRAME_PROFILE_FORGET;
        /* profile.forget's names, an array (jansson's tree only); none: every name */
        json_t *keys = f->root ? json_object_get(f->root, "keys") : NULL;
        size_t k;
        json_t *key;
        int ok = !keys || (json_is_array(keys) && json_array_size(keys) > 0 && json_array_size(keys) <= 100);
        json_array_foreach(keys, k, key) ok &= json_is_string(key);
        if (out->type == CG_FRAME_PROFILE_FORGET && !ok)
            return fail(err, errlen, "profile.forget takes 'keys': 1 to 100 names like \"home_city\", or none to "
                                     "forget the whole profile");
        if (out->type == CG_FRAME_PROFILE_FORGET)
            out->keys = json_incref(keys);
    } else if (is(type, "cancel")) {
        out->type = CG_FRAME_CANCEL;
        if (!out->id[0])
            return fail(err, errlen, "cancel needs the 'id' of the message to cancel");
    } else if (is(type, "resume")) {
        out->type = CG_FRAME_RESUME;
        if (!out->id[0])
            return fail(err, errlen, "resume needs the 'id' of the message whose reply to resume");
        return after_field(f, &out->after, err, errlen);
    } else {
        snprintf(err, errlen, "unknown type '%.*s'", (int)(type.len < 64 ? type.len : 64), type.s);
        return CG_E_BAD_FRAME;
    }
    return 0;
}

int cg_protocol_parse(const char *buf, size_t len, cg_client_frame *out, char *err, size_t errlen)
{
    memset(out, 0, sizeof(*out));
    cg_jsonflat flat;
    frame f = {NULL, NULL};
    int rc;
    if (cg_jsonflat_read(&flat, buf, len)) {
        f.flat = &flat;
        rc = parse_members(&f, out, err, errlen);
    } else {
        json_error_t jerr;
        f.root = json_loadb(buf, len, JSON_REJECT_DUPLICATES | JSON_DECODE_ANY, &jerr);
        if (!f.root) {
            snprintf(err, errlen, "not JSON: %s at line %d column %d", jerr.text, jerr.line, jerr.column);
            rc = CG_E_BAD_FRAME;
        } else if (!json_is_object(f.root)) {
            rc = fail(err, errlen, "the frame must be a JSON object");
        } else {
            rc = parse_members(&f, out, err, errlen);
        }
        json_decref(f.root);
    }
    cg_jsonflat_free(&flat);
    if (rc < 0)
        cg_client_frame_clear(out);
    return rc;
}

void cg_client_frame_clear(cg_client_frame *f)
{
    free(f->text);
    f->text = NULL;
    json_decref(f->keys);
    f->keys = NULL;
}

/* The frame for an object that could not be built: text that is not UTF-8 (callers cut text
 * on code point boundaries, cg_utf8_boundary, so this is a bug, not an input), or no
 * memory; it must not take the process down. */
static char *fallback_frame(size_t pre, size_t *len)
{
    static const char fallback[] = "{\"type\":\"error\",\"id\":null,\"code\":\"internal\","
                                   "\"message\":\"a frame could not be encoded\"}";
    char *s = cg_malloc(pre + sizeof(fallback));
    memcpy(s + pre, fallback, sizeof(fallback));
    *len = sizeof(fallback) - 1;
    return s;
}

/* obj compactly at pre bytes into one malloc'd buffer (not json_dumps' growth and copy);
 * decrefs obj. */
static char *dump_pre(json_t *obj, size_t pre, size_t *len)
{
    char *s = obj ? cg_json_dump_pre(obj, pre, 256, len) : NULL;
    json_decref(obj);
    return s ? s : fallback_frame(pre, len);
}

char *cg_protocol_dump(json_t *obj)
{
    size_t len;
    return dump_pre(obj, 0, &len);
}

cg_frame_text cg_protocol_frame(json_t *obj)
{
    cg_frame_text f;
    f.buf = dump_pre(obj, CG_FRAME_PRE, &f.len);
    f.json = f.buf + CG_FRAME_PRE;
    return f;
}

/* The frame a text writer (core/jsonout.h) holds: the hot frames of a turn are written as
 * text, not built as trees; their keys in the order the tree's had. */
static cg_frame_text frame_written(cg_jsonw *w)
{
    cg_frame_text f;
    f.buf = cg_jsonw_end(w, &f.len);
    if (!f.buf)
        f.buf = fallback_frame(CG_FRAME_PRE, &f.len);
    f.json = f.buf + CG_FRAME_PRE;
    return f;
}

static json_t *id_or_null(const char *id)
{
    return id && *id ? json_string(id) : json_null();
}

cg_frame_text cg_protocol_hello(const char *user, const char *session, const char *resume)
{
    return cg_protocol_frame(json_pack("{s:s, s:s, s:s, s:s, s:o}", "type", "hello", "protocol",
                                      CG_PROTOCOL_NAME, "user", user, "session", session, "resume",
                                      resume ? json_string(resume) : json_null()));
}

cg_frame_text cg_protocol_ack(const cg_ack *a)
{
    cg_jsonw w;
    cg_jsonw_init(&w, CG_FRAME_PRE, 256);
    CG_JSONW_LIT(&w, "{\"type\":\"ack\"");
    cg_jsonw_member_str(&w, "id", a->id);
    cg_jsonw_member_str(&w, "room", a->room);
    cg_jsonw_member_str(&w, "route", a->route);
    cg_jsonw_member_str(&w, "service", a->service);
    cg_jsonw_member_json(&w, "params", a->params, "{}");
    cg_jsonw_member_str(&w, "enriched", a->enriched);
    cg_jsonw_member_json(&w, "resolution", a->resolution, "null");
    cg_jsonw_member_json(&w, "rules", a->rules, "[]");
    if (json_array_size(a->from_profile))
        cg_jsonw_member_json(&w, "from_profile", a->from_profile, "[]");
    CG_JSONW_LIT(&w, "}");
    w.failed |= !a->id || !a->room || !a->route; /* as json_pack refuses a NULL "s" */
    return frame_written(&w);
}

cg_frame_text cg_protocol_context(const char *room, json_t *state)
{
    return cg_protocol_frame(json_pack("{s:s, s:s, s:O}", "type", "context", "room", room, "state", state));
}

cg_frame_text cg_protocol_profile(json_t *profile)
{
    return cg_protocol_frame(json_pack("{s:s, s:O}", "type", "profile", "profile", profile));
}

cg_frame_text cg_protocol_warning(const char *id, const char *code, const char *message)
{
    return cg_protocol_frame(json_pack("{s:s, s:o, s:s, s:s}", "type", "warning", "id", id_or_null(id), "code",
                                      code, "message", message));
}

/* The start of a delta or done frame: {"type":TYPE,"id":id,"text":text */
static void reply_frame_start(cg_jsonw *w, const char *type, const char *id, const char *text, size_t len)
{
    cg_jsonw_init(w, CG_FRAME_PRE, 96 + len + len / 8);
    CG_JSONW_LIT(w, "{\"type\":");
    cg_jsonw_str(w, type, strlen(type));
    cg_jsonw_member_str(w, "id", id);
    CG_JSONW_LIT(w, ",\"text\":");
    cg_jsonw_str(w, text, len);
    w->failed |= !id || !text; /* a frame without them would mislead: the internal error instead */
}

cg_frame_text cg_protocol_delta(const char *id, const char *text, size_t len, uint64_t seq)
{
    cg_jsonw w;
    reply_frame_start(&w, "delta", id, text, len);
    CG_JSONW_LIT(&w, ",\"seq\":");
    cg_jsonw_int(&w, (long long)seq);
    CG_JSONW_LIT(&w, "}");
    return frame_written(&w);
}

cg_frame_text cg_protocol_done(const char *id, const char *text, size_t len, json_t *usage, int truncated,
                               const cg_answer *who)
{
    cg_jsonw w;
    reply_frame_start(&w, "done", id, text, len);
    cg_jsonw_member_json(&w, "usage", usage, "null");
    if (truncated)
        CG_JSONW_LIT(&w, ",\"truncated\":true");
    if (who && who->upstream) {
        cg_jsonw_member_str(&w, "upstream", who->upstream);
        if (who->replica >= 0) {
            CG_JSONW_LIT(&w, ",\"replica\":");
            cg_jsonw_int(&w, who->replica);
        }
        if (who->attempts > 1) {
            CG_JSONW_LIT(&w, ",\"attempts\":");
            cg_jsonw_int(&w, who->attempts);
        }
        if (who->fallback_from)
            cg_jsonw_member_str(&w, "fallback_from", who->fallback_from);
    }
    if (who && who->reply_rules)
        cg_jsonw_member_json(&w, "reply_rules", who->reply_rules, "null");
    CG_JSONW_LIT(&w, "}");
    return frame_written(&w);
}

cg_frame_text cg_protocol_cancelled(const char *id)
{
    return cg_protocol_frame(json_pack("{s:s, s:s}", "type", "cancelled", "id", id));
}

/* The error frame's object (type, id, code, message, in that order); NULL when it could not
 * be built. */
static json_t *error_object(const char *id, const char *code, const char *message)
{
    /* Messages quote what upstreams sent, cut to a length: make them valid UTF-8, every
     * bad or cut-off byte shown as '?', so the frame can always be built. */
    char *clean = cg_strdup(message);
    cg_utf8_clean(clean, strlen(clean));
    json_t *o = json_pack("{s:s, s:o, s:s, s:s}", "type", "error", "id", id_or_null(id), "code", code, "message",
                          clean);
    free(clean);
    return o;
}

cg_frame_text cg_protocol_error(const char *id, const char *code, const char *message)
{
    return cg_protocol_frame(error_object(id, code, message));
}

cg_frame_text cg_protocol_error_detail(const char *id, const char *code, const char *message, json_t *detail)
{
    json_t *o = error_object(id, code, message);
    /* after the error's own members (jansson keeps the order they were set in); when that
     * fails (no memory), the error itself still goes out */
    if (o && json_is_object(detail))
        (void)json_object_update_missing(o, detail);
    return cg_protocol_frame(o);
}
