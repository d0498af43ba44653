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

/* Does the frame match a {"pointer", "equals"} marker of the config? */
static int matches(json_t *frame, json_t *marker)
{
    const char *ptr = json_string_value(json_object_get(marker, "pointer"));
    json_t *v = ptr ? cg_json_pointer_get(frame, ptr) : NULL;
    return v && json_equal(v, json_object_get(marker, "equals"));
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
    json_t *o = binary ? NULL : json_loadb(buf, len, 0, NULL);
    if (!o)
        return CG_DROPIN_PASS;
    if (matches(o, json_object_get(client, "cancel"))) {
        json_decref(o);
        return CG_DROPIN_CANCEL;
    }
    if (!matches(o, json_object_get(client, "chat"))) {
        json_decref(o);
        return CG_DROPIN_PASS;
    }
    const char *text_ptr = cfg_str(cfg, "client", "text");
    json_t *text = text_ptr ? cg_json_pointer_get(o, text_ptr) : NULL;
    chat->frame = o;
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
    free(chat->id);
    free(chat->room);
    free(chat->text);
    memset(chat, 0, sizeof(*chat));
}

cg_frame_text cg_dropin_map_forward(json_t *cfg, const cg_dropin_chat *chat, json_t *object)
{
    cg_frame_text f = {0};
    const char *key = cfg_str(cfg, NULL, "object_key");
    json_t *copy = json_is_object(chat->frame) ? json_copy(chat->frame) : NULL;
    if (!copy || !object || json_object_set_new(copy, key ? key : "chatgate", object) < 0) {
        if (!copy)
            json_decref(object); /* json_object_set_new takes it even when it fails */
        json_decref(copy);
        return f;
    }
    /* dumped where it is sent from: the drop-in queue writes it from json, lws's header before */
    f.buf = cg_json_dump_pre(copy, CG_FRAME_PRE, 1024, &f.len);
    json_decref(copy);
    if (f.buf)
        f.json = f.buf + CG_FRAME_PRE;
    return f;
}

int cg_dropin_map_app(json_t *cfg, const char *buf, size_t len, int binary, cg_dropin_app_frame *out)
{
    memset(out, 0, sizeof(*out));
    json_t *appf = json_object_get(cfg, "app_frames");
    json_t *o = binary ? NULL : json_loadb(buf, len, JSON_ALLOW_NUL, NULL);
    if (!json_is_object(o)) {
        json_decref(o);
        return 0;
    }
    out->frame = o;
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
    json_t *state = state_key ? json_object_get(o, state_key) : NULL;
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
    json_t *id_str = tmpl ? json_string(id) : NULL;
    char *s = id_str ? json_dumps(tmpl, JSON_COMPACT) : NULL;
    char *id_json = s ? json_dumps(id_str, JSON_ENCODE_ANY) : NULL;
    char *out = NULL;
    json_decref(id_str);
    if (!id_json)
        goto done;
    /* "{id}" anywhere in the template's text becomes the id, JSON-escaped (no quotes) */
    size_t idl = strlen(id_json) - 2, cap = strlen(s) * (idl + 1) + 1, n = 0;
    out = malloc(cap);
    if (!out)
        abort();
    for (const char *p = s; *p;) {
        if (strncmp(p, "{id}", 4) == 0) {
            memcpy(out + n, id_json + 1, idl);
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
