/*
 * admin.c: the admin API (docs/architecture.md, "Operations"), for operators and support tools:
 *
 *   GET    /admin/dialogs/{user}/{room}   view or export a dialog (the context frame's state)
 *   DELETE /admin/dialogs/{user}/{room}   delete one dialog
 *   DELETE /admin/users/{user}            delete every dialog of a user (through the user's
 *                                         room set: the right to be forgotten; the answer
 *                                         says what the turn export keeps of them)
 *   GET    /admin/rules                   each rule's hits and cut-offs since it was loaded, and
 *                                         the rules that never fired
 *   GET    /admin/users/{user}/usage      the tokens a user spent, by room and upstream, and
 *                                         the totals (each room's dialog, loaded in turn)
 *   GET    /admin/users/{user}/profile    the user's profile (what they said about themselves)
 *   PUT    /admin/users/{user}/profile?set={...}  sets names of it (null forgets one)
 *   DELETE /admin/users/{user}/profile    forgets the whole profile
 *   PUT    /admin/users/{user}/profile/{name}?value=JSON   sets one name of it
 *   DELETE /admin/users/{user}/profile/{name}              forgets one name
 *   POST   /admin/reload                  load the rules again (as SIGHUP)
 *
 * Present only when CHATGATE_ADMIN_TOKEN is set (else every /admin path is 404), and then
 * only with "Authorization: Bearer <that token>" (else 401), compared in constant time.
 * Ids in paths are percent-decoded. With --admin-listen the API is on its own listener only.
 * Store calls answer later, so a request keeps its state in the connection's data until the
 * answer comes and its response is written on the next writable callback. No request takes a
 * body (a value travels in the query): lws 4.1 calls BODY_COMPLETION again and again, at
 * 100% CPU, until the transaction completes, and an answer that comes later never could
 * (cg_refuse_unread_body refuses every body before routing).
 * The admin API is plain HTTP: on its own listener a WebSocket upgrade is refused with 404
 * (on the main listener the session's check refuses it), and headers over max_header_bytes
 * get 431 there as on the main listener.
 */
#include <openssl/crypto.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "chatgate/core/alloc.h"
#include "chatgate/core/error.h"
#include "chatgate/store/profiles.h"
#include "chatgate/server/admin.h"
#include "chatgate/server/export.h"
#include "chatgate/server/handshake.h"
#include "chatgate/server/ops.h"
#include "chatgate/server/server.h"
#include "chatgate/proto/identity.h"
#include "chatgate/core/num.h"
#include "chatgate/core/log.h"
#include "chatgate/proto/protocol.h"

typedef struct admin_req {
    struct lws *wsi;
    cg_server *srv;
    cg_store_req *pending; /* a store call not yet answered */
    int status;
    char *body; /* JSON, malloc'd, once answered */
    char user[CG_MAX_USER + 1];
    char room[CG_MAX_ROOM + 1];
    int handled; /* routed already (a POST is routed once its body is in) */
    /* GET .../usage: the user's rooms, the next one to load, and what they add up to */
    json_t *rooms, *usage;
    size_t next_room;
    int profile_forget_all; /* DELETE .../profile: the names are read, then forgotten */
} admin_req;

size_t cg_admin_session_size(void)
{
    return sizeof(admin_req);
}

/* Copies an id (lws has already percent-decoded the path) into out; -1 when empty or too long. */
static int copy_id(const char *s, size_t len, char *out, size_t outlen)
{
    if (len == 0 || len >= outlen)
        return -1;
    memcpy(out, s, len);
    out[len] = 0;
    return 0;
}

/* ?user=...&room=... (each decoded by lws): the form for ids that hold a '/'. */
static int ids_from_query(struct lws *wsi, admin_req *a, int want_room)
{
    char buf[CG_MAX_USER + 16];
    const char *v = lws_get_urlarg_by_name(wsi, "user=", buf, sizeof(buf));
    if (!v || copy_id(v, strlen(v), a->user, sizeof(a->user)) < 0)
        return -1;
    if (!want_room)
        return 0;
    v = lws_get_urlarg_by_name(wsi, "room=", buf, sizeof(buf));
    return v ? copy_id(v, strlen(v), a->room, sizeof(a->room)) : -1;
}

static void answer(admin_req *a, int status, json_t *body)
{
    a->status = status;
    a->body = cg_protocol_dump(body);
    lws_callback_on_writable(a->wsi);
}

static void answer_error(admin_req *a, int status, const char *message)
{
    answer(a, status, json_pack("{s:s}", "error", message));
}

static void on_loaded(void *ctx, cg_dialog *d, const cg_store_status *st)
{
    admin_req *a = ctx;
    a->pending = NULL;
    json_t *state = cg_dialog_context(d);
    answer(a, 200, json_pack("{s:s, s:s, s:b, s:b, s:o}", "user", a->user, "room", a->room, "found", st->found,
                             "degraded", st->degraded, "state", state));
    cg_dialog_free(d);
}

/* {"user", "deleted"}, and for a whole user what the turn export keeps of them (export.h):
 * its records are copies already handed on, which this delete cannot reach. */
static json_t *deleted_answer(const admin_req *a)
{
    json_t *o = json_pack("{s:s, s:s}", "user", a->user, "deleted", a->room[0] ? a->room : "*");
    const char *kept = a->room[0] ? NULL : cg_export_kept_after_forget(a->srv->cfg);
    if (o && kept)
        json_object_set_new(o, "export_kept", json_string(kept));
    return o;
}

/* The profile's answer: {"user", "profile"} (413 when an update would pass profile_cap). A
 * DELETE reads the names first, then forgets them all. */
static void on_profile(void *ctx, json_t *profile, int err, const cg_store_status *st)
{
    admin_req *a = ctx;
    cg_store *store = a->srv->turn.store;
    a->pending = NULL;
    if (a->profile_forget_all) {
        a->profile_forget_all = 0;
        json_t *all = json_object();
        const char *name;
        json_t *v;
        json_object_foreach(profile, name, v) json_object_set_new(all, name, json_null());
        a->pending = store->ops->profiles->update(store, a->user, all, on_profile, a);
        json_decref(all);
        if (!a->pending)
            answer_error(a, 500, "the store refused the request");
        return;
    }
    if (err == CG_E_TOO_LARGE)
        answer_error(a, 413, "the profile would pass profile_cap: nothing was changed");
    else if (err)
        answer_error(a, 500, "the profile could not be changed");
    else if (st->degraded)
        answer(a, 503, json_pack("{s:s, s:s, s:O}", "error", "the store is unreachable: this gateway's copy answered",
                                 "user", a->user, "profile", profile));
    else
        answer(a, 200, json_pack("{s:s, s:O}", "user", a->user, "profile", profile));
}

/* The query argument arg ("value=", "set=") read as JSON, or NULL. As long as the request
 * line may be: a value past profile_cap is the store's 413. */
static json_t *query_json(admin_req *a, struct lws *wsi, const char *arg)
{
    size_t cap = (size_t)a->srv->cfg->max_header_bytes + 16;
    char *buf = cg_malloc(cap);
    const char *v = lws_get_urlarg_by_name(wsi, arg, buf, (int)cap);
    json_t *j = v ? json_loads(v, JSON_DECODE_ANY, NULL) : NULL;
    free(buf);
    return j;
}

/* The changes of PUT .../profile?set={...} (name -> value, null forgets), PUT
 * .../profile/{name}?value=JSON (set one) or DELETE .../profile/{name} (forget one), or NULL
 * with the 400 answered. */
static json_t *profile_change(admin_req *a, struct lws *wsi, const char *name, int is_put)
{
    json_t *changes = NULL;
    if (is_put && !name) {
        changes = query_json(a, wsi, "set=");
        if (!json_is_object(changes)) {
            json_decref(changes);
            answer_error(a, 400, "PUT .../profile takes ?set= with a JSON object of name -> value (null forgets "
                                 "a name), percent-encoded");
            return NULL;
        }
    } else {
        json_t *value = is_put ? query_json(a, wsi, "value=") : json_null(); /* DELETE: null forgets */
        if (is_put && (!value || json_is_null(value))) {
            json_decref(value);
            answer_error(a, 400, "PUT .../profile/{name} takes ?value= with the name's value as JSON "
                                 "(percent-encoded; DELETE forgets a name)");
            return NULL;
        }
        changes = json_object();
        json_object_set_new(changes, name, value);
    }
    char err[200];
    if (cg_profile_check(changes, err, sizeof(err)) < 0) {
        json_decref(changes);
        answer_error(a, 400, err);
        return NULL;
    }
    return changes;
}

/*
 * /admin/users/{user}/profile[/{name}] (rest: what follows "/admin/users/"): GET the profile,
 * PUT names of it (?set={...}), DELETE it whole; PUT one name (?value=JSON), DELETE one name.
 */
static void route_profile(admin_req *a, struct lws *wsi, const char *rest, int is_get, int is_put, int is_delete)
{
    cg_store *st = a->srv->turn.store;
    const char *mark = strstr(rest, "/profile");
    const char *name = mark && mark[8] == '/' ? mark + 9 : NULL;
    if (!mark || (mark[8] != 0 && mark[8] != '/') || copy_id(rest, (size_t)(mark - rest), a->user, sizeof(a->user)) < 0 ||
        strchr(a->user, '/') ||
        (name && (!*name || strchr(name, '/'))) || (is_get && name)) {
        answer_error(a, 400, "use GET, PUT (?set=) or DELETE /admin/users/{user}/profile, PUT (?value=) or DELETE "
                             "/admin/users/{user}/profile/{name} (percent-encoded)");
        return;
    }
    if (!st->ops->profiles) {
        answer_error(a, 404, "this store keeps no profiles");
        return;
    }
    cg_info("admin: %s the profile of one user", is_get ? "view" : is_put ? "change" : "forget");
    if (name || is_put) {
        json_t *changes = profile_change(a, wsi, name, is_put);
        if (changes && !(a->pending = st->ops->profiles->update(st, a->user, changes, on_profile, a)))
            answer_error(a, 500, "the store refused the request");
        json_decref(changes);
        return;
    }
    a->profile_forget_all = is_delete;
    if (!(a->pending = st->ops->profiles->get(st, a->user, on_profile, a)))
        answer_error(a, 500, "the store refused the request");
}

static void on_deleted(void *ctx, const cg_store_status *st)
{
    admin_req *a = ctx;
    a->pending = NULL;
    if (st->degraded) /* Redis is away: its copy is still there, so say it was not done */
        answer_error(a, 503, "the store is unreachable: deleted from memory only; try again");
    else
        answer(a, 200, deleted_answer(a));
}

/* Adds a dialog's usage ({upstream: {in, out, turns}}) to total's, upstream by upstream. */
static void add_usage(json_t *total, json_t *usage)
{
    const char *up, *k;
    json_t *u, *v;
    json_object_foreach(usage, up, u) {
        json_t *t = json_object_get(total, up);
        if (!t && json_object_set_new(total, up, t = json_object()) < 0)
            continue;
        json_object_foreach(u, k, v) {
            if (json_is_integer(v))
                json_object_set_new(t, k, json_integer(cg_sat_add(json_integer_value(json_object_get(t, k)), json_integer_value(v))));
        }
    }
}

static void load_next_room(admin_req *a);

static void on_room_usage(void *ctx, cg_dialog *d, const cg_store_status *st)
{
    admin_req *a = ctx;
    a->pending = NULL;
    json_t *by_room = json_object_get(a->usage, "rooms"), *total = json_object_get(a->usage, "total");
    const char *room = json_string_value(json_array_get(a->rooms, a->next_room - 1));
    if (st->degraded)
        json_object_set_new(a->usage, "degraded", json_true());
    if (d->usage && room) {
        json_object_set(by_room, room, d->usage);
        add_usage(total, d->usage);
    }
    cg_dialog_free(d);
    load_next_room(a);
}

/* Loads the user's rooms one after the other (one store call pending at a time, as every
 * admin request), then answers with what they add up to. */
static void load_next_room(admin_req *a)
{
    cg_store *st = a->srv->turn.store;
    const char *room = json_string_value(json_array_get(a->rooms, a->next_room));
    if (room) {
        a->next_room++;
        if ((a->pending = st->ops->dialogs->load(st, a->user, room, on_room_usage, a)))
            return;
        answer_error(a, 500, "the store refused the request");
        json_decref(a->usage);
    } else {
        json_object_set_new(a->usage, "user", json_string(a->user));
        answer(a, 200, a->usage); /* takes it */
    }
    json_decref(a->rooms); /* the connection may take another request: nothing is left held */
    a->rooms = a->usage = NULL;
}

static void on_rooms(void *ctx, json_t *rooms, const cg_store_status *st)
{
    admin_req *a = ctx;
    a->pending = NULL;
    a->rooms = json_incref(rooms);
    a->usage = json_pack("{s:{}, s:{}, s:b}", "rooms", "total", "degraded", st->degraded);
    if (!a->usage) {
        answer_error(a, 500, "out of memory");
        return;
    }
    load_next_room(a);
}

/* The header copied whole, NUL-terminated and malloc'd; NULL when absent. */
static char *header_copy(struct lws *wsi, enum lws_token_indexes tok)
{
    int len = lws_hdr_total_length(wsi, tok);
    if (len <= 0)
        return NULL;
    char *s = cg_malloc((size_t)len + 1);
    if (s && lws_hdr_copy(wsi, s, len + 1, tok) < 0) {
        free(s);
        s = NULL;
    }
    return s;
}

/* "Authorization: Bearer <token>", the token compared in constant time whatever its length. */
static int authorized(struct lws *wsi, const char *token)
{
    char *auth = header_copy(wsi, WSI_TOKEN_HTTP_AUTHORIZATION);
    size_t want = strlen(token);
    int ok = auth && strncasecmp(auth, "Bearer ", 7) == 0 && strlen(auth + 7) == want &&
             CRYPTO_memcmp(auth + 7, token, want) == 0;
    if (auth)
        OPENSSL_cleanse(auth, strlen(auth));
    free(auth);
    return ok;
}

static void route(admin_req *a, struct lws *wsi, const char *uri, int is_get, int is_post, int is_put,
                  int is_delete);

/* GET /admin/rules: each rule of the running set with its hits and cut-offs since it was
 * loaded (the group's, with --workers), and the names of those that never fired: the
 * rules a team can look at before it trusts or drops them. */
static json_t *rules_stats(const cg_server *srv)
{
    const cg_store_stats *st;
    long connections;
    const cg_metrics *m = cg_ops_metrics(srv, &st, &connections);
    const cg_ruleset *rs = srv->turn.rules;
    json_t *rules = json_array(), *never = json_array();
    size_t file;
    int line;
    const char *name;
    for (size_t i = 0; (name = cg_ruleset_rule(rs, i, &file, &line)); i++) {
        int counted = i < CG_METRIC_RULES;
        json_t *r = json_pack("{s:s,s:s,s:s,s:i}", "name", name, "file", cg_ruleset_file_name(rs, file), "path",
                              cg_ruleset_file(rs, file), "line", line);
        if (counted) {
            json_object_set_new(r, "hits", json_integer((json_int_t)m->rule_hits[i]));
            json_object_set_new(r, "limited", json_integer((json_int_t)m->rule_limited[i]));
            if (!m->rule_hits[i])
                json_array_append_new(never, json_string(name));
        }
        json_array_append_new(rules, r);
    }
    return json_pack("{s:o,s:o,s:{s:I,s:I}}", "rules", rules, "never_fired", never, "shadow", "same",
                     (json_int_t)m->shadow_same, "different", (json_int_t)m->shadow_different);
}

/* Routes one request; answers now or once the store has. */
static void admin_request(admin_req *a, struct lws *wsi)
{
    a->handled = 1;
    int is_get = lws_hdr_total_length(wsi, WSI_TOKEN_GET_URI) > 0;
    int is_post = lws_hdr_total_length(wsi, WSI_TOKEN_POST_URI) > 0;
    int is_put = lws_hdr_total_length(wsi, WSI_TOKEN_PUT_URI) > 0;
    int is_delete = lws_hdr_total_length(wsi, WSI_TOKEN_DELETE_URI) > 0;
    enum lws_token_indexes tok = is_get    ? WSI_TOKEN_GET_URI
                                 : is_post ? WSI_TOKEN_POST_URI
                                 : is_put  ? WSI_TOKEN_PUT_URI
                                           : WSI_TOKEN_DELETE_URI;
    char *uri = is_get || is_post || is_put || is_delete ? header_copy(wsi, tok) : NULL;
    if (!uri) {
        answer_error(a, 405, "use GET, POST, PUT or DELETE");
        return;
    }
    route(a, wsi, uri, is_get, is_post, is_put, is_delete);
    free(uri);
}

/* Checks the token and routes a request for uri (lws has percent-decoded it). */
static void route(admin_req *a, struct lws *wsi, const char *uri, int is_get, int is_post, int is_put, int is_delete)
{
    cg_server *srv = a->srv;
    cg_store *st = srv->turn.store;
    const char *token = getenv("CHATGATE_ADMIN_TOKEN");
    if (!token || !*token) {
        answer_error(a, 404, "not found");
        return;
    }
    if (!authorized(wsi, token)) {
        cg_warn("admin: refused a request without the admin token");
        answer_error(a, 401, "an Authorization: Bearer token is needed (CHATGATE_ADMIN_TOKEN)");
        return;
    }
    if (strcmp(uri, "/admin/rules") == 0 && is_get) {
        answer(a, 200, rules_stats(srv));
        return;
    }
    if (strcmp(uri, "/admin/reload") == 0 && is_post) {
        char err[1024];
        if (srv->reload_rules(srv, err, sizeof(err)) < 0)
            answer(a, 422, json_pack("{s:s}", "error", err));
        else
            answer(a, 200, json_pack("{s:I}", "rules", (json_int_t)cg_ruleset_count(srv->turn.rules)));
        return;
    }
    /*
     * lws has decoded the path already, so a '/' inside an id cannot be told from the one
     * between user and room: the room is everything after the user's segment, and a user id
     * with a '/' takes the query form (?user=...&room=...).
     */
    const char *p;
    if (strncmp(uri, "/admin/users/", 13) == 0 && strstr(uri + 13, "/profile") && (is_get || is_put || is_delete)) {
        route_profile(a, wsi, uri + 13, is_get, is_put, is_delete);
        return;
    }
    if (is_put) {
        answer_error(a, 405, "PUT is for /admin/users/{user}/profile/{name}");
        return;
    }
    if ((strncmp(uri, "/admin/dialogs/", 15) == 0 || strcmp(uri, "/admin/dialogs") == 0) && (is_get || is_delete)) {
        p = uri + 14;
        const char *slash = *p ? strchr(p + 1, '/') : NULL;
        /* a '/' after the user's segment is refused: "a%2Fb/r" and "a/b%2Fr" read the same */
        int ok = *p ? slash && !strchr(slash + 1, '/') &&
                          copy_id(p + 1, (size_t)(slash - p - 1), a->user, sizeof(a->user)) == 0 &&
                          copy_id(slash + 1, strlen(slash + 1), a->room, sizeof(a->room)) == 0
                    : ids_from_query(wsi, a, 1) == 0;
        if (!ok) {
            answer_error(a, 400, "use /admin/dialogs/{user}/{room} (percent-encoded), or, when an id holds a '/', "
                                 "/admin/dialogs?user=..&room=..");
            return;
        }
        cg_info("admin: %s dialog of one user", is_get ? "view" : "delete");
        a->pending = is_get ? st->ops->dialogs->load(st, a->user, a->room, on_loaded, a)
                            : st->ops->dialogs->remove(st, a->user, a->room, on_deleted, a);
    } else if (is_get && (strcmp(uri, "/admin/usage") == 0 ||
                          (strncmp(uri, "/admin/users/", 13) == 0 && strlen(uri) > 19 &&
                           strcmp(uri + strlen(uri) - 6, "/usage") == 0))) {
        /* /admin/users/{user}/usage, or /admin/usage?user=.. for a user id with a '/' */
        int ok = strcmp(uri, "/admin/usage") == 0
                     ? ids_from_query(wsi, a, 0) == 0
                     : copy_id(uri + 13, strlen(uri) - 19, a->user, sizeof(a->user)) == 0 && !strchr(a->user, '/');
        if (!ok) {
            answer_error(a, 400, "use /admin/users/{user}/usage (percent-encoded) or /admin/usage?user=..");
            return;
        }
        cg_info("admin: usage of one user");
        a->pending = st->ops->dialogs->rooms(st, a->user, on_rooms, a);
    } else if ((strncmp(uri, "/admin/users/", 13) == 0 || strcmp(uri, "/admin/users") == 0) && is_delete) {
        p = uri + 12;
        int ok = *p ? !strchr(p + 1, '/') && copy_id(p + 1, strlen(p + 1), a->user, sizeof(a->user)) == 0
                    : ids_from_query(wsi, a, 0) == 0;
        if (!ok) {
            answer_error(a, 400, "use /admin/users/{user} (percent-encoded) or /admin/users?user=..");
            return;
        }
        cg_info("admin: forget a user (every room)");
        a->pending = st->ops->dialogs->remove_user(st, a->user, on_deleted, a);
    } else {
        answer_error(a, 404, "no such admin path or method");
        return;
    }
    if (!a->pending)
        answer_error(a, 500, "the store refused the request");
}

static int write_answer(admin_req *a, struct lws *wsi)
{
    unsigned char head[LWS_PRE + 1024];
    unsigned char *start = head + LWS_PRE, *p = start, *end = head + sizeof(head);
    size_t len = strlen(a->body);
    if (lws_add_http_common_headers(wsi, (unsigned int)a->status, "application/json", (lws_filepos_t)len, &p, end) ||
        lws_add_http_header_by_token(wsi, WSI_TOKEN_HTTP_CACHE_CONTROL, (const unsigned char *)"no-store", 8, &p,
                                     end) ||
        lws_finalize_write_http_header(wsi, start, &p, end))
        return -1;
    unsigned char *buf = cg_malloc(LWS_PRE + len);
    memcpy(buf + LWS_PRE, a->body, len);
    int n = lws_write(wsi, buf + LWS_PRE, len, LWS_WRITE_HTTP_FINAL);
    free(buf);
    free(a->body);
    a->body = NULL;
    if (n < (int)len)
        return -1;
    return lws_http_transaction_completed(wsi) ? -1 : 0;
}

int cg_admin_callback(struct lws *wsi, enum lws_callback_reasons reason, void *user, void *in, size_t len)
{
    admin_req *a = user;
    switch (reason) {
    case LWS_CALLBACK_HTTP_CONFIRM_UPGRADE:
        /* only on the admin listener (protocols[0] there): nothing here speaks WebSocket */
        if (cg_refuse_large_headers(wsi))
            return 1;
        cg_warn("admin: refused a WebSocket upgrade on the admin listener");
        return cg_http_refuse(wsi, 404, "Not Found", "the admin API takes no WebSocket connections\n");
    case LWS_CALLBACK_FILTER_HTTP_CONNECTION:
        return cg_refuse_large_headers(wsi) || cg_refuse_unread_body(wsi) ? -1 : 0;
    case LWS_CALLBACK_HTTP:
        memset(a, 0, sizeof(*a));
        a->wsi = wsi;
        a->srv = cg_server_of(wsi);
        admin_request(a, wsi); /* no body: a request with one was refused before (cg_refuse_unread_body) */
        return 0;
    case LWS_CALLBACK_HTTP_BODY:
    case LWS_CALLBACK_HTTP_BODY_COMPLETION: /* a POST's "Content-Length: 0": answered already */
        return 0;
    case LWS_CALLBACK_HTTP_WRITEABLE:
        return a && a->body ? write_answer(a, wsi) : 0;
    case LWS_CALLBACK_CLOSED_HTTP:
    case LWS_CALLBACK_HTTP_DROP_PROTOCOL:
        if (a && a->pending) { /* the client left before the store answered */
            cg_store_abandon(a->pending);
            a->pending = NULL;
        }
        if (a) {
            free(a->body);
            a->body = NULL;
            json_decref(a->rooms);
            json_decref(a->usage);
            a->rooms = a->usage = NULL;
        }
        return lws_callback_http_dummy(wsi, reason, user, in, len);
    default:
        return lws_callback_http_dummy(wsi, reason, user, in, len);
    }
}
