/*
 * dialog.c: the dialog model of dialog.h. Every function is pure and takes the time as an
 * argument. JSON ownership follows jansson: parts held by cg_dialog are owned references.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chatgate/core/alloc.h"
#include "chatgate/core/num.h"
#include "chatgate/core/jsonout.h"
#include "chatgate/dialog/dialog.h"
#include "chatgate/core/error.h"

void cg_dialog_init(cg_dialog *d, int64_t now)
{
    memset(d, 0, sizeof(*d));
    d->params = json_object();
    d->history = json_array();
    d->created_at = d->last_activity = now;
}

void cg_dialog_free(cg_dialog *d)
{
    free(d->service);
    json_decref(d->params);
    json_decref(d->awaiting);
    json_decref(d->soft);
    json_decref(d->history);
    json_decref(d->last_tool_result);
    json_decref(d->usage);
    memset(d, 0, sizeof(*d));
}

void cg_dialog_add_usage(cg_dialog *d, const char *upstream, long long in, long long out)
{
    /* a new usage object, not the old one changed: the parts of a dialog are shared with the
     * stores' copies (cg_dialog_copy), so they are replaced, never changed in place */
    json_t *usage = d->usage ? json_copy(d->usage) : json_object();
    json_t *had = json_object_get(usage, upstream);
    json_t *u = json_is_object(had) ? json_copy(had) : json_object(); /* other members kept */
    if (!usage || !u)
        goto oom;
    static const char *const keys[] = {"in", "out", "turns"};
    long long add[] = {in, out, 1};
    for (int i = 0; i < 3; i++) {
        json_t *v = json_is_object(had) ? json_object_get(had, keys[i]) : NULL;
        if (json_object_set_new_nocheck(u, keys[i], json_integer(cg_sat_add(json_integer_value(v), add[i]))) < 0)
            goto oom;
    }
    if (json_object_set_new(usage, upstream, u) < 0) {
        u = NULL; /* taken, and freed, by the failed set */
        goto oom;
    }
    json_decref(d->usage);
    d->usage = usage;
    return;
oom: /* this turn's tokens go uncounted, the dialog is whole */
    json_decref(u);
    json_decref(usage);
}

void cg_dialog_expire(cg_dialog *d, int64_t now)
{
    if (d->awaiting && d->awaiting_expires <= now) {
        json_decref(d->awaiting);
        d->awaiting = NULL;
    }
    if (d->soft && d->soft_expires <= now) {
        json_decref(d->soft);
        d->soft = NULL;
    }
}

void cg_dialog_lapse(cg_dialog *d, int64_t now, int64_t params_exp, int64_t history_exp)
{
    cg_dialog_expire(d, now);
    if (params_exp <= now) {
        json_decref(d->params);
        d->params = json_object();
    }
    if (history_exp <= now) {
        json_decref(d->history);
        d->history = json_array();
        d->text_of = NULL;
    }
}

/* The size of j as compact JSON: written by the text writer (core/jsonout.h) into a buffer
 * dropped at once, which costs less than jansson's counting dump (json_dumpb into nothing
 * still walks its dump machinery token by token). 0 when j cannot be encoded. */
static size_t json_size(json_t *j)
{
    size_t n = 0;
    free(cg_json_dump_pre(j, 0, 1024, &n));
    return n;
}

/*
 * j's size as compact JSON, counted without writing anything: each byte of a key or string
 * counted as per_byte, each number (and true, false, null) as number. With 1 and 8 it is
 * close (json_weight, the memory store's bound); with 6 and 26 it is at least the size
 * (json_size_bound: every byte as if escaped, \u00XX; a real at its longest, jansson's
 * "%.17g" with its ".0" or exponent).
 */
static size_t json_measure(json_t *j, size_t per_byte, size_t number)
{
    size_t n = 2, i;
    const char *k;
    json_t *v;
    switch (json_typeof(j)) {
    case JSON_OBJECT:
        json_object_foreach(j, k, v) n += per_byte * strlen(k) + 4 + json_measure(v, per_byte, number);
        return n;
    case JSON_ARRAY:
        json_array_foreach(j, i, v) n += 1 + json_measure(v, per_byte, number);
        return n;
    case JSON_STRING:
        return per_byte * json_string_length(j) + 2;
    default:
        return number;
    }
}

static size_t json_size_bound(json_t *j)
{
    return json_measure(j, 6, 26);
}

/* Close to json_size (strings count unescaped, numbers as 8), without formatting anything. */
static size_t json_weight(json_t *j)
{
    return json_measure(j, 1, 8);
}

size_t cg_dialog_weight(const cg_dialog *d)
{
    size_t n = cg_dialog_weight_but_history(d) + 2;
    for (size_t i = 0; i < json_array_size(d->history); i++)
        n += cg_dialog_history_item_weight(json_array_get(d->history, i));
    return n;
}

size_t cg_dialog_history_item_weight(json_t *m)
{
    return 1 + json_weight(m);
}

long cg_dialog_history_kept(json_t *had, json_t *history)
{
    size_t n_had = json_array_size(had), n = json_array_size(history);
    if (!n_had)
        return 0;
    json_t *last = json_array_get(had, n_had - 1);
    size_t p = n; /* where had's last message sits in history */
    while (p > 0 && json_array_get(history, p - 1) != last)
        p--;
    if (p == 0 || p > n_had)
        return -1;
    for (size_t i = 0; i < p; i++) /* history[0..p) is the end of had */
        if (json_array_get(history, i) != json_array_get(had, n_had - p + i))
            return -1;
    return (long)p;
}

size_t cg_dialog_weight_parts(const cg_dialog *d, const cg_dialog *had, const size_t *had_w, size_t w[CG_DIALOG_PARTS])
{
    static const cg_dialog none;
    const cg_dialog *o = had && had_w ? had : &none;
    json_t *mine[CG_DIALOG_PARTS] = {d->params, d->awaiting, d->soft, d->last_tool_result, d->usage};
    json_t *theirs[CG_DIALOG_PARTS] = {o->params, o->awaiting, o->soft, o->last_tool_result, o->usage};
    size_t n = 128 + (d->service ? strlen(d->service) : 0); /* meta and the keys */
    for (int i = 0; i < CG_DIALOG_PARTS; i++) {
        if (mine[i] && mine[i] == theirs[i])
            w[i] = had_w[i];
        else /* the params are weighed even when absent, as "{}" */
            w[i] = mine[i] || i == 0 ? json_weight(mine[i]) : 0;
        n += w[i];
    }
    return n;
}

size_t cg_dialog_weight_but_history(const cg_dialog *d)
{
    size_t w[CG_DIALOG_PARTS];
    return cg_dialog_weight_parts(d, NULL, NULL, w);
}

int cg_dialog_copy(cg_dialog *dst, const cg_dialog *src)
{
    /* the parts are shared: nothing changes a part in place (dialog.h); deep copies of them
     * were a tenth of a turn's instructions with rules (callgrind, issue 12) */
    if (cg_dialog_share(dst, src) < 0)
        return -1;
    /* but the history array is the copy's own (a turn pushes to it); its items are shared */
    json_t *history = json_array();
    if (!history || (src->history && json_array_extend(history, src->history) < 0) || !dst->params) {
        json_decref(history);
        cg_dialog_free(dst);
        return -1;
    }
    json_decref(dst->history);
    dst->history = history;
    /* the same messages: the count goes with them (cg_dialog_history_text checks its length) */
    dst->text_of = src->text_of == src->history ? history : NULL;
    return 0;
}

int cg_dialog_share(cg_dialog *dst, const cg_dialog *src)
{
    *dst = *src;
    dst->service = src->service ? cg_strdup(src->service) : NULL;
    if (src->service && !dst->service) {
        *dst = (cg_dialog){0};
        return -1;
    }
    json_incref(dst->params);
    json_incref(dst->awaiting);
    json_incref(dst->soft);
    json_incref(dst->last_tool_result);
    json_incref(dst->usage);
    json_incref(dst->history);
    return 0;
}

/* Merges params (name -> value, null forgets) into all[service]; 0, or -1 out of memory.
 * all is a copy of the dialog's params of its own, but the objects in it are still the
 * dialog's (params_with): the service's object is copied before it changes. */
static int merge_service(json_t *all, const char *service, json_t *params)
{
    json_t *kept = json_object_get(all, service);
    json_t *mine = json_is_object(kept) ? json_copy(kept) : json_object();
    if (!mine || json_object_set_new(all, service, mine) < 0)
        return -1;
    const char *name;
    json_t *value;
    json_object_foreach(params, name, value) {
        if (json_is_null(value))
            json_object_del(mine, name);
        else if (json_object_set(mine, name, value) < 0)
            return -1;
    }
    if (json_object_size(mine) == 0)
        json_object_del(all, service);
    return 0;
}

/* 1, with err, when params pass the cap; the exact size is written out only when the bound
 * does not settle it. */
static int over_cap(json_t *params, const cg_lifetimes *lt, char *err, size_t errlen)
{
    size_t size = json_size_bound(params);
    if ((long)size > lt->params_cap)
        size = json_size(params);
    if ((long)size <= lt->params_cap)
        return 0;
    snprintf(err, errlen, "params would take %zu bytes, over the %ld-byte cap; nothing was changed", size,
             lt->params_cap);
    return 1;
}

/*
 * The dialog's params with every service of by_service merged, as a new object, or NULL
 * with err: the result would pass the cap (CG_E_TOO_LARGE in *rc), or memory ran out.
 * d is not touched, so a caller commits all the services or none.
 */
static json_t *params_with(const cg_dialog *d, json_t *by_service, const cg_lifetimes *lt, int *rc, char *err,
                           size_t errlen)
{
    /* one level: the services' objects are shared until merge_service changes one, and the
     * values in them are never changed in place (dialog.h) */
    json_t *all = json_copy(d->params);
    const char *service;
    json_t *params;
    json_object_foreach(by_service, service, params) {
        if (!all || merge_service(all, service, params) < 0) {
            snprintf(err, errlen, "out of memory merging params; nothing was changed");
            json_decref(all);
            *rc = CG_E_INTERNAL;
            return NULL;
        }
    }
    if (over_cap(all, lt, err, errlen)) {
        json_decref(all);
        *rc = CG_E_TOO_LARGE;
        return NULL;
    }
    return all;
}

/* Checks by_service: an object of service name -> object of params. */
static int check_services(json_t *by_service, char *err, size_t errlen)
{
    const char *service;
    json_t *params;
    if (!json_is_object(by_service))
        goto bad;
    json_object_foreach(by_service, service, params) {
        if (!*service || !json_is_object(params))
            goto bad;
    }
    return 0;
bad:
    snprintf(err, errlen, "params must be an object of a named service");
    return CG_E_BAD_FRAME;
}

/* 1 when merging by_service would leave d's params as they are: every value is there
 * already, every null names what is not (and no service it names is an empty object, which
 * a merge drops). A message that says again what the dialog holds (the same route every
 * turn) keeps the same params object, which the Redis save then sees is Redis's by its
 * pointer instead of comparing it member by member. */
static int merge_changes_nothing(const cg_dialog *d, json_t *by_service)
{
    const char *service, *name;
    json_t *params, *value;
    json_object_foreach(by_service, service, params) {
        json_t *kept = json_object_get(d->params, service);
        if (kept && (!json_is_object(kept) || json_object_size(kept) == 0))
            return 0;
        json_object_foreach(params, name, value) {
            json_t *had = json_object_get(kept, name);
            if (json_is_null(value) ? had != NULL : !had || !json_equal(had, value))
                return 0;
        }
    }
    return 1;
}

int cg_dialog_merge_all_params(cg_dialog *d, json_t *by_service, const cg_lifetimes *lt, char *err, size_t errlen)
{
    int rc = check_services(by_service, err, errlen);
    if (rc < 0)
        return rc;
    if (d->params && merge_changes_nothing(d, by_service)) /* still held to the cap, as a merge */
        return over_cap(d->params, lt, err, errlen) ? CG_E_TOO_LARGE : 0;
    json_t *all = params_with(d, by_service, lt, &rc, err, errlen);
    if (!all)
        return rc;
    json_decref(d->params);
    d->params = all;
    return 0;
}

int cg_dialog_merge_params(cg_dialog *d, const char *service, json_t *params, const cg_lifetimes *lt,
                           char *err, size_t errlen)
{
    if (!json_is_object(params) || !service || !*service) {
        snprintf(err, errlen, "params must be an object of a named service");
        return CG_E_BAD_FRAME;
    }
    json_t *one = json_object();
    if (!one || json_object_set(one, service, params) < 0) {
        json_decref(one);
        snprintf(err, errlen, "out of memory merging params; nothing was changed");
        return CG_E_INTERNAL;
    }
    int rc = cg_dialog_merge_all_params(d, one, lt, err, errlen);
    json_decref(one);
    return rc;
}

json_t *cg_dialog_params_merged(const cg_dialog *d, const char *service, json_t *defaults)
{
    json_t *out = json_is_object(defaults) ? json_deep_copy(defaults) : json_object();
    json_t *kept = service ? json_object_get(d->params, service) : NULL;
    if (json_is_object(kept))
        json_object_update(out, kept);
    return out;
}

int cg_dialog_forget(cg_dialog *d, json_t *keys)
{
    if (!json_array_size(keys))
        return 0;
    /* forgotten from a copy of the params, which then replaces them (dialog.h: parts are
     * never changed in place); out of memory, nothing is forgotten */
    json_t *params = json_deep_copy(d->params);
    if (!params)
        return 0;
    json_decref(d->params);
    d->params = params;
    int n = 0;
    size_t i;
    json_t *k;
    json_array_foreach(keys, i, k) {
        if (!json_is_string(k))
            continue;
        const char *key = json_string_value(k);
        const char *dot = strchr(key, '.');
        /* "service.name" of any length, or a name of the active service */
        char *service = dot ? cg_strndup(key, (size_t)(dot - key)) : d->service ? cg_strdup(d->service) : NULL;
        const char *name = dot ? dot + 1 : key;
        if (!service)
            continue;
        json_t *mine = json_object_get(d->params, service);
        if (json_object_del(mine, name) == 0)
            n++;
        if (json_is_object(mine) && json_object_size(mine) == 0)
            json_object_del(d->params, service);
        free(service);
    }
    return n;
}

static void set_service(cg_dialog *d, const char *service)
{
    free(d->service);
    d->service = service ? cg_strdup(service) : NULL;
}

/* The awaiting state a directive's awaiting object asks for, as kept; NULL out of memory. */
static json_t *awaiting_of(json_t *awaiting, const char *source)
{
    json_t *options = json_object_get(awaiting, "options");
    json_t *context = json_object_get(awaiting, "context");
    return json_pack("{s:O, s:O, s:O, s:s}", "type", json_object_get(awaiting, "type"), "options",
                     options ? options : json_null(), "context", context ? context : json_null(), "source",
                     source ? source : "");
}

/* A deep copy of an optional object or value; *out NULL for a JSON null. -1 out of memory. */
static int copy_or_clear(json_t *v, json_t **out)
{
    *out = NULL;
    if (!v || json_is_null(v))
        return 0;
    *out = json_deep_copy(v);
    return *out ? 0 : -1;
}

static void replace_json(json_t **slot, json_t *v)
{
    json_decref(*slot);
    *slot = v;
}

int cg_dialog_apply_directive(cg_dialog *d, json_t *state, const char *source, int64_t now,
                              const cg_lifetimes *lt, char *err, size_t errlen)
{
    if (!json_is_object(state)) {
        snprintf(err, errlen, "state must be an object");
        return CG_E_BAD_FRAME;
    }
    /* Checked and built whole before anything changes: a refused directive changes nothing. */
    json_t *service = json_object_get(state, "service");
    const char *svc = d->service;
    if (json_is_string(service) && json_string_length(service) > 0 && json_string_length(service) <= 64)
        svc = json_string_value(service);
    else if (service && !json_is_null(service)) {
        snprintf(err, errlen, "state.service must be a name of 1 to 64 bytes");
        return CG_E_BAD_FRAME;
    }
    json_t *awaiting = json_object_get(state, "awaiting");
    json_t *type = json_object_get(awaiting, "type");
    if (json_is_object(awaiting)) {
        static const char *const types[] = {"selection", "confirmation", "metadata", "input"};
        int ok = 0;
        for (size_t i = 0; json_is_string(type) && i < 4; i++)
            ok |= strcmp(json_string_value(type), types[i]) == 0;
        if (!ok) {
            snprintf(err, errlen, "state.awaiting.type must be selection, confirmation, metadata or input");
            return CG_E_BAD_FRAME;
        }
    }
    json_t *params = json_object_get(state, "params");
    if (params && !svc) {
        snprintf(err, errlen, "state.params needs a service (state.service, or an active one)");
        return CG_E_BAD_FRAME;
    }
    json_t *soft = json_object_get(state, "soft_context");
    json_t *tool = json_object_get(state, "last_tool_result");
    if (tool && !json_is_null(tool)) { /* it goes back to the backend every turn: bounded */
        size_t size = json_size(tool);
        if ((long)size > lt->tool_result_cap) {
            snprintf(err, errlen, "state.last_tool_result takes %zu bytes, over the %ld-byte tool_result_cap; "
                                  "nothing was changed", size, lt->tool_result_cap);
            return CG_E_TOO_LARGE;
        }
    }

    int rc = 0;
    json_t *new_params = NULL, *new_awaiting = NULL, *new_soft = NULL, *new_tool = NULL, *one = NULL;
    char *new_service = svc && svc != d->service ? cg_strdup(svc) : NULL;
    if (svc && svc != d->service && !new_service)
        goto oom;
    if (params) {
        if (!json_is_object(params)) {
            snprintf(err, errlen, "params must be an object of a named service");
            rc = CG_E_BAD_FRAME;
            goto fail;
        }
        one = json_object();
        if (!one || json_object_set(one, svc, params) < 0)
            goto oom;
        if (!(new_params = params_with(d, one, lt, &rc, err, errlen)))
            goto fail;
    }
    if (json_is_object(awaiting) && !(new_awaiting = awaiting_of(awaiting, source)))
        goto oom;
    if ((json_is_object(soft) && copy_or_clear(soft, &new_soft) < 0) || copy_or_clear(tool, &new_tool) < 0)
        goto oom;

    /* commit: nothing below can fail */
    if (new_params)
        replace_json(&d->params, new_params);
    if (new_service) {
        free(d->service);
        d->service = new_service;
    }
    if (json_is_null(awaiting)) {
        replace_json(&d->awaiting, NULL);
    } else if (new_awaiting) {
        json_t *ttl = json_object_get(awaiting, "ttl");
        /* a backend's number: a year at most, so that now + ttl never overflows */
        long seconds = json_is_integer(ttl) && json_integer_value(ttl) > 0
                           ? (long)cg_clamp(json_integer_value(ttl), 1, 366L * 86400)
                           : lt->awaiting_s;
        replace_json(&d->awaiting, new_awaiting);
        d->awaiting_expires = now + seconds;
    }
    if (json_is_null(soft)) {
        replace_json(&d->soft, NULL);
    } else if (new_soft) {
        /* as awaiting's: its own ttl (seconds, a year at most), else soft_s; and its source,
         * the upstream that set it (the gateway's word: an app's own "source" is replaced) */
        json_t *ttl = json_object_get(new_soft, "ttl");
        long seconds = json_is_integer(ttl) && json_integer_value(ttl) > 0
                           ? (long)cg_clamp(json_integer_value(ttl), 1, 366L * 86400)
                           : lt->soft_s;
        json_object_del(new_soft, "ttl");
        json_object_set_new(new_soft, "source", cg_json_string(source ? source : ""));
        replace_json(&d->soft, new_soft);
        d->soft_expires = now + seconds;
    }
    if (tool)
        replace_json(&d->last_tool_result, new_tool);
    json_decref(one);
    return 0;

oom:
    snprintf(err, errlen, "out of memory applying the state directive; nothing was changed");
    rc = CG_E_INTERNAL;
fail:
    json_decref(one);
    json_decref(new_params);
    json_decref(new_awaiting);
    json_decref(new_soft);
    json_decref(new_tool);
    free(new_service);
    return rc;
}

/* A history message's content, in bytes (0 for one without). */
static size_t content_bytes(json_t *m)
{
    return json_string_length(json_object_get(m, "content"));
}

json_t *cg_dialog_push_history(cg_dialog *d, const char *role, const char *content, int64_t ts,
                               const cg_lifetimes *lt)
{
    /* built member by member: json_pack reads its format string at every call, which was a
     * twentieth of a turn's instructions with no rules (callgrind, issue 12) */
    json_t *m = json_object();
    if (!m || json_object_set_new_nocheck(m, "role", cg_json_string(role)) < 0 ||
        json_object_set_new_nocheck(m, "content", cg_json_string(content)) < 0 ||
        json_object_set_new_nocheck(m, "ts", json_integer((json_int_t)ts)) < 0) {
        json_decref(m);
        return NULL; /* out of memory; content that is not UTF-8 never reaches here: it came from JSON */
    }
    int counted = d->text_of == d->history && d->text_n == json_array_size(d->history);
    size_t bytes = content_bytes(m);
    if (json_array_append_new(d->history, m) < 0)
        return NULL;
    d->text_bytes += bytes;
    while ((long)json_array_size(d->history) > lt->history_n) {
        d->text_bytes -= content_bytes(json_array_get(d->history, 0));
        json_array_remove(d->history, 0);
    }
    d->text_of = counted ? d->history : NULL;
    size_t n = d->text_n = json_array_size(d->history);
    return n && json_array_get(d->history, n - 1) == m ? m : NULL; /* history_n 0 keeps none */
}

size_t cg_dialog_history_text(cg_dialog *d)
{
    size_t n = json_array_size(d->history), i;
    json_t *m;
    if (d->text_of != d->history || d->text_n != n) {
        d->text_bytes = 0;
        json_array_foreach(d->history, i, m) d->text_bytes += content_bytes(m);
        d->text_of = d->history;
        d->text_n = n;
    }
    return d->text_bytes;
}

static json_t *or_null(json_t *j)
{
    return j ? json_incref(j) : json_null();
}

/* The active service as JSON: null when none (or, out of memory, unreadable). */
static json_t *service_json(const cg_dialog *d)
{
    json_t *s = d->service ? cg_json_string(d->service) : NULL;
    return s ? s : json_null();
}

json_t *cg_dialog_context(const cg_dialog *d)
{
    return json_pack("{s:o, s:O, s:o, s:o, s:O, s:{s:I, s:I, s:I, s:I}, s:o}", "service", service_json(d),
                     "params", d->params, "awaiting", or_null(d->awaiting), "soft_context", or_null(d->soft),
                     "history", d->history, "meta", "created_at", (json_int_t)d->created_at, "last_activity",
                     (json_int_t)d->last_activity, "turn_count", (json_int_t)d->turn_count, "message_count",
                     (json_int_t)d->message_count, "last_tool_result", or_null(d->last_tool_result));
}

json_t *cg_dialog_to_json(const cg_dialog *d)
{
    json_t *j = cg_dialog_context(d);
    if (!j || json_object_set_new(j, "awaiting_expires", json_integer(d->awaiting ? d->awaiting_expires : 0)) < 0 ||
        json_object_set_new(j, "soft_expires", json_integer(d->soft ? d->soft_expires : 0)) < 0 ||
        (d->usage && json_object_set(j, "usage", d->usage) < 0)) {
        json_decref(j);
        return NULL;
    }
    return j;
}

static int64_t int_of(json_t *o, const char *key)
{
    json_t *v = json_object_get(o, key);
    return json_is_integer(v) ? (int64_t)json_integer_value(v) : 0;
}

/* Reads j into d, taking each part with take: a deep copy, or a new reference to it. */
static void from_json(cg_dialog *d, json_t *j, int64_t now, json_t *(*take)(json_t *))
{
    cg_dialog_init(d, now);
    if (!json_is_object(j))
        return;
    json_t *service = json_object_get(j, "service");
    if (json_is_string(service))
        set_service(d, json_string_value(service));
    /* params and history are never NULL: a copy that fails leaves them empty */
    json_t *params = take(json_object_get(j, "params"));
    if (json_is_object(params))
        replace_json(&d->params, params);
    else
        json_decref(params);
    json_t *awaiting = json_object_get(j, "awaiting");
    if (json_is_object(awaiting)) {
        d->awaiting = take(awaiting);
        d->awaiting_expires = int_of(j, "awaiting_expires");
    }
    json_t *soft = json_object_get(j, "soft_context");
    if (json_is_object(soft)) {
        d->soft = take(soft);
        d->soft_expires = int_of(j, "soft_expires");
    }
    json_t *history = take(json_object_get(j, "history"));
    if (json_is_array(history)) {
        replace_json(&d->history, history);
        d->text_of = NULL;
    } else {
        json_decref(history);
    }
    json_t *tool = json_object_get(j, "last_tool_result");
    if (tool && !json_is_null(tool))
        d->last_tool_result = take(tool);
    json_t *usage = json_object_get(j, "usage");
    if (json_is_object(usage))
        d->usage = take(usage);
    json_t *meta = json_object_get(j, "meta");
    if (json_is_object(meta)) {
        d->created_at = int_of(meta, "created_at") ? int_of(meta, "created_at") : now;
        d->last_activity = int_of(meta, "last_activity") ? int_of(meta, "last_activity") : now;
        /* a stored count is a peer's number (Redis): bounded, so that counting on never wraps */
        d->turn_count = (long)cg_clamp(int_of(meta, "turn_count"), 0, 1LL << 53);
        d->message_count = (long)cg_clamp(int_of(meta, "message_count"), 0, 1LL << 53);
    }
    cg_dialog_expire(d, now);
}

static json_t *copy(json_t *j)
{
    return json_deep_copy(j);
}

void cg_dialog_from_json(cg_dialog *d, json_t *j, int64_t now)
{
    from_json(d, j, now, copy);
}

static json_t *share(json_t *j)
{
    return json_incref(j);
}

void cg_dialog_adopt_json(cg_dialog *d, json_t *j, int64_t now)
{
    from_json(d, j, now, share);
}

json_t *cg_dialog_tool_result(const cg_dialog *d, const cg_lifetimes *lt)
{
    json_t *tool = d->last_tool_result;
    if (!tool || json_is_null(tool) || (long)json_size(tool) > lt->tool_result_cap)
        return NULL;
    return tool;
}

char *cg_dialog_summary(const cg_dialog *d, json_t *merged_params, json_t *tool_result, json_t *profile,
                        json_t *resolution, json_t *annotations)
{
    json_t *parts = json_object();
    if (d->service)
        json_object_set_new(parts, "service", cg_json_string(d->service));
    if (json_object_size(merged_params))
        json_object_set(parts, "params", merged_params);
    if (d->awaiting)
        json_object_set_new(parts, "awaiting", json_pack("{s:O, s:O}", "type", json_object_get(d->awaiting, "type"),
                                                         "options", json_object_get(d->awaiting, "options")));
    if (d->soft)
        json_object_set(parts, "soft_context", d->soft);
    if (tool_result)
        json_object_set(parts, "last_tool_result", tool_result);
    if (json_object_size(profile))
        json_object_set(parts, "user_profile", profile);
    if (resolution)
        json_object_set(parts, "this_message_resolves", resolution);
    if (json_object_size(annotations))
        json_object_set(parts, "annotations", annotations);
    char *out = NULL;
    if (json_object_size(parts)) { /* the lead, then the parts, written once (no json_dumps) */
        static const char lead[] = "What the conversation has established so far: ";
        cg_jsonw w;
        size_t n;
        cg_jsonw_init(&w, 0, 256);
        cg_jsonw_raw(&w, lead, sizeof(lead) - 1);
        cg_jsonw_json(&w, parts);
        out = cg_jsonw_end(&w, &n);
    }
    json_decref(parts);
    return out ? out : cg_strdup(""); /* nothing established */
}

/* ---- merging two copies ------------------------------------------------------------------- */

static json_int_t message_ts(json_t *m)
{
    return json_integer_value(json_object_get(m, "ts"));
}

/*
 * Which of b's messages a holds: held[i] is 1 when b's i-th is one of a's (the same role,
 * content, time and marks), each of a's standing for one of b's at most. So a message said
 * twice in one second (a user's "yes", sent again) is two, not one: matched only by
 * equality, the second was taken for the first, and a merge dropped that turn.
 */
static void held_in(json_t *a, json_t *b, unsigned char *held)
{
    size_t na = json_array_size(a), nb = json_array_size(b);
    unsigned char *used = cg_calloc(na ? na : 1, 1);
    for (size_t i = 0; i < nb; i++) {
        held[i] = 0;
        for (size_t k = 0; k < na && !held[i]; k++) {
            if (!used[k] && json_equal(json_array_get(a, k), json_array_get(b, i)))
                used[k] = held[i] = 1;
        }
    }
    free(used);
}

/*
 * a with b's messages that a lacks, each once, *added their count. A history is in the order
 * its turns were saved, not of its messages' times (a turn that waited for the dialog's lease
 * has a user message older than the turn before it), so a's order is kept, and each run of
 * b's missing messages (its turns, user message first) goes in whole, before a's first turn
 * that began after it, else at the end: turns stay whole, in order of their time.
 */
static json_t *history_union(json_t *a, json_t *b, long *added)
{
    json_t *out = a ? json_copy(a) : json_array(); /* shallow: its messages are shared, never changed */
    size_t nb = json_array_size(b);
    unsigned char *held = cg_calloc(nb ? nb : 1, 1);
    held_in(a, b, held);
    *added = 0;
    for (size_t i = 0; out && i < nb;) {
        if (held[i]) {
            i++;
            continue;
        }
        size_t end = i + 1;
        while (end < nb && !held[end])
            end++;
        json_int_t began = message_ts(json_array_get(b, i));
        size_t at = json_array_size(out);
        for (size_t k = 0; k < json_array_size(out); k++) {
            json_t *m = json_array_get(out, k);
            json_t *role = json_object_get(m, "role");
            if (json_is_string(role) && strcmp(json_string_value(role), "user") == 0 && message_ts(m) > began) {
                at = k;
                break;
            }
        }
        for (size_t k = i; k < end; k++, at++) {
            if (json_array_insert(out, at, json_array_get(b, k)) < 0) {
                json_decref(out);
                out = NULL;
                break;
            }
        }
        *added += (long)(end - i);
        i = end;
    }
    free(held);
    return out;
}

/* a's params, with b's added (b's value wins where both have one when b_wins). */
static json_t *params_union(json_t *a, json_t *b, int b_wins)
{
    json_t *out = a ? json_deep_copy(a) : json_object(); /* out's own: the caller's copies stay as they are */
    const char *service, *name;
    json_t *names, *value;
    json_object_foreach(b, service, names) {
        json_t *mine = json_object_get(out, service);
        if (!mine) {
            if (json_object_set_new(out, service, json_deep_copy(names)) < 0)
                goto fail;
            continue;
        }
        json_object_foreach(names, name, value) {
            if ((b_wins || !json_object_get(mine, name)) && json_object_set(mine, name, value) < 0)
                goto fail;
        }
    }
    return out;
fail:
    json_decref(out);
    return NULL;
}

/* *slot holds value (a new reference), its old one released. */
static void hold_json(json_t **slot, json_t *value)
{
    json_t *old = *slot;
    *slot = value ? json_incref(value) : NULL;
    json_decref(old);
}

/* cg_dialog_goes_on_from, of two histories: a's last message among b's, before b's last. */
static int goes_on_from(json_t *b, json_t *a)
{
    size_t na = json_array_size(a), nb = json_array_size(b);
    json_t *last = na ? json_array_get(a, na - 1) : NULL;
    for (size_t i = nb ? nb - 1 : 0; last && i-- > 0;)
        if (json_equal(json_array_get(b, i), last))
            return 1;
    return 0;
}

int cg_dialog_goes_on_from(const cg_dialog *b, const cg_dialog *a)
{
    return goes_on_from(b->history, a->history);
}

long cg_dialog_merge(cg_dialog *into, const cg_dialog *other, const cg_lifetimes *lt)
{
    long added = 0;
    json_t *history = history_union(into->history, other->history, &added);
    /* last_activity is in whole seconds: in a tie, other counts as active last only when it
     * goes on from into (a write-back of turns in the second of Redis's last save: into is
     * where other came from); two copies that each hold turns of that second keep into's */
    int other_last = other->last_activity > into->last_activity ||
                     (other->last_activity == into->last_activity && goes_on_from(other->history, into->history));
    json_t *params = history ? params_union(into->params, other->params, other_last) : NULL;
    if (!history || !params) {
        json_decref(history);
        json_decref(params);
        return -1;
    }
    while ((long)json_array_size(history) > lt->history_n)
        json_array_remove(history, 0);
    json_decref(into->history);
    into->history = history;
    into->text_of = NULL; /* counted again when asked */
    json_decref(into->params);
    into->params = params;
    /* each part from the copy active last; a part only one copy has, from that one (a copy
     * begun from nothing has none: that is no decision to drop the other's) */
    if (other->service && (other_last || !into->service)) {
        char *service = cg_strdup(other->service);
        free(into->service);
        into->service = service;
    }
    if (other->awaiting && (other_last || !into->awaiting)) {
        hold_json(&into->awaiting, other->awaiting);
        into->awaiting_expires = other->awaiting_expires;
    }
    if (other->soft && (other_last || !into->soft)) {
        hold_json(&into->soft, other->soft);
        into->soft_expires = other->soft_expires;
    }
    if (other->last_tool_result && (other_last || !into->last_tool_result))
        hold_json(&into->last_tool_result, other->last_tool_result);
    if (other_last)
        into->last_activity = other->last_activity;
    if (other->created_at && (!into->created_at || other->created_at < into->created_at))
        into->created_at = other->created_at;
    if (other->turn_count > into->turn_count)
        into->turn_count = other->turn_count;
    if (other->message_count > into->message_count)
        into->message_count = other->message_count;
    if (!other->usage)
        return added;
    json_t *usage = into->usage ? json_deep_copy(into->usage) : json_object(); /* into's may be shared */
    if (!usage)
        return added;
    json_decref(into->usage);
    into->usage = usage;
    const char *upstream;
    json_t *u;
    json_object_foreach(other->usage, upstream, u) { /* per upstream, the larger count of each */
        json_t *mine = json_object_get(usage, upstream);
        if (!mine) {
            json_object_set_new(usage, upstream, json_deep_copy(u));
            continue;
        }
        const char *k;
        json_t *v;
        json_object_foreach(u, k, v) {
            if (json_integer_value(v) > json_integer_value(json_object_get(mine, k)))
                json_object_set(mine, k, v);
        }
    }
    return added;
}
