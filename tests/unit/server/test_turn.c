/*
 * test_turn.c: a turn's every path (server/turn.c) driven through fakes of what it talks to,
 * on a real uv loop, with no socket and no sleep: a store whose answers the test gives when
 * it chooses (a limit's verdict, a dialog's load), upstreams whose deltas, done and errors
 * the test sends, and a sink that writes down what the client would be told.
 *
 * What each case checks: the events the client gets, in order, and exactly one terminal event
 * (done, cancelled or error) per chat message; what the store is asked (the dialog saved once,
 * with the user's message and the reply; a lease let go when nothing was saved; a limit taken
 * ended once); what an upstream is asked (started, cancelled); and that a request the turn
 * dropped is never handed on.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chatgate/core/error.h"
#include "chatgate/server/turn.h"
#include "unit.h"

/* ---- the fake store: requests held until the test answers them --------------------------- */

typedef struct fake_req {
    CG_STORE_REQ_FIELDS
    struct fake_req *next;
    char room[64];
} fake_req;

typedef struct fake_store {
    cg_store base;
    fake_req *pending;                 /* limits and loads not answered yet, oldest first */
    int saves, removes, releases, limit_takes, limit_ends;
    int fail_loads;                    /* the next ones the store refuses to start (acquire: NULL) */
    char last_history[512];            /* the last saved dialog's history, as JSON */
    json_t *dialogs;                   /* room -> the dialog as saved (cg_dialog_to_json) */
} fake_store;

static fake_req *hold(fake_store *fs, cg_store_op kind, const char *room, void *ctx)
{
    fake_req *r = calloc(1, sizeof(*r));
    if (!r)
        abort();
    r->kind = kind;
    r->ctx = ctx;
    snprintf(r->room, sizeof(r->room), "%s", room ? room : "");
    fake_req **pp = &fs->pending;
    while (*pp)
        pp = &(*pp)->next;
    *pp = r;
    return r;
}

/* The oldest pending request of that kind, taken out of the list; NULL when none. */
static fake_req *take(fake_store *fs, cg_store_op kind)
{
    for (fake_req **pp = &fs->pending; *pp; pp = &(*pp)->next)
        if ((*pp)->kind == kind) {
            fake_req *r = *pp;
            *pp = r->next;
            return r;
        }
    return NULL;
}

static int pending(fake_store *fs, cg_store_op kind)
{
    int n = 0;
    for (fake_req *r = fs->pending; r; r = r->next)
        n += r->kind == kind && !r->abandoned;
    return n;
}

static cg_store_req *fs_acquire(cg_store *st, const char *user, const char *room, cg_store_load_fn cb, void *ctx)
{
    (void)user;
    fake_store *fs = (fake_store *)st;
    if (fs->fail_loads > 0) { /* the store could not start the load: nothing held, no lease */
        fs->fail_loads--;
        return NULL;
    }
    fake_req *r = hold(fs, CG_STORE_LOAD, room, ctx);
    r->cb.load = cb;
    return (cg_store_req *)r;
}

static void fs_release(cg_store *st, const char *user, const char *room)
{
    (void)user;
    (void)room;
    ((fake_store *)st)->releases++;
}

static cg_store_req *fs_save(cg_store *st, const char *user, const char *room, const cg_dialog *d,
                             cg_store_done_fn cb, void *ctx)
{
    (void)user;
    (void)cb;
    (void)ctx;
    fake_store *fs = (fake_store *)st;
    fs->saves++;
    char *h = json_dumps(d->history, JSON_COMPACT);
    snprintf(fs->last_history, sizeof(fs->last_history), "%s", h ? h : "");
    free(h);
    json_object_set_new(fs->dialogs, room, cg_dialog_to_json(d));
    return NULL; /* a turn's save needs no answer */
}

static cg_store_req *fs_remove(cg_store *st, const char *user, const char *room, cg_store_done_fn cb, void *ctx)
{
    (void)user;
    (void)cb;
    (void)ctx;
    fake_store *fs = (fake_store *)st;
    fs->removes++;
    json_object_del(fs->dialogs, room);
    return NULL;
}

static cg_store_req *fs_take(cg_store *st, const char *user, const cg_limits *lim, uint64_t turn,
                             cg_store_limit_fn cb, void *ctx)
{
    (void)user;
    (void)lim;
    (void)turn;
    fake_store *fs = (fake_store *)st;
    fs->limit_takes++;
    fake_req *r = hold(fs, CG_STORE_LIMIT, "", ctx);
    r->cb.limit = cb;
    return (cg_store_req *)r;
}

static void fs_limit_end(cg_store *st, const char *user, const cg_limits *lim, uint64_t turn, int local,
                         long long tokens)
{
    (void)user;
    (void)lim;
    (void)turn;
    (void)local;
    (void)tokens;
    ((fake_store *)st)->limit_ends++;
}

static const cg_store_dialog_ops fs_dialogs = {.save = fs_save, .remove = fs_remove};
static const cg_store_lease_ops fs_lease = {.acquire = fs_acquire, .release = fs_release};
static const cg_store_limit_ops fs_limits = {.take = fs_take, .end = fs_limit_end};
static const cg_store_ops fs_ops = {.name = "fake", .dialogs = &fs_dialogs, .lease = &fs_lease, .limits = &fs_limits};

static int64_t fs_now(void *ctx)
{
    (void)ctx;
    return 1700000000;
}

/* Answers the oldest pending load: the dialog as last saved, or a fresh one. An abandoned
 * request is only freed (its caller is gone: store.h). 0, or -1 when none was pending. */
static int answer_load(fake_store *fs)
{
    fake_req *r = take(fs, CG_STORE_LOAD);
    if (!r)
        return -1;
    if (!r->abandoned) {
        cg_dialog d;
        json_t *saved = json_object_get(fs->dialogs, r->room);
        cg_dialog_from_json(&d, saved, fs_now(NULL)); /* a fresh dialog when NULL */
        cg_store_status st = {.found = saved != NULL};
        r->cb.load(r->ctx, &d, &st);
    }
    free(r);
    return 0;
}

static int answer_limit(fake_store *fs, cg_limit_hit hit)
{
    fake_req *r = take(fs, CG_STORE_LIMIT);
    if (!r)
        return -1;
    if (!r->abandoned) {
        cg_limit_verdict v = {.hit = hit, .retry_after_ms = hit ? 1500 : 0};
        cg_store_status st = {0};
        r->cb.limit(r->ctx, &v, &st);
    }
    free(r);
    return 0;
}

/* ---- fake upstreams: calls the test answers ---------------------------------------------- */

struct cg_upstream_call {
    const cg_upstream_events *ev;
    void *ctx;
    int index;      /* the upstream's */
    int cancelled;
    int paused;
    char text[256]; /* what it was asked: the message's text */
};

typedef struct fake_up {
    cg_upstream_call *calls[16];
    int n_calls;
    int starts[2]; /* by upstream */
    int cancels;
} fake_up;

static fake_up ups; /* the upstreams' calls, for the test to answer */

static int fu_start(cg_upstream *up, void **conn_slot, const cg_upstream_message *m, const cg_upstream_events *ev,
                    void *ctx, cg_upstream_call **call)
{
    (void)conn_slot;
    cg_upstream_call *c = calloc(1, sizeof(*c));
    if (!c || ups.n_calls == 16)
        abort();
    c->ev = ev;
    c->ctx = ctx;
    c->index = up->index;
    snprintf(c->text, sizeof(c->text), "%s", m->text);
    ups.calls[ups.n_calls++] = c;
    ups.starts[up->index]++;
    *call = c;
    return 0;
}

static void fu_cancel(cg_upstream_call *call)
{
    call->cancelled = 1;
    ups.cancels++;
}

static void fu_pause(cg_upstream_call *call, int paused)
{
    call->paused = paused;
}

static const cg_upstream_ops fu_ops = {.kind = "fake", .start = fu_start, .cancel = fu_cancel, .pause = fu_pause};

/* The newest call, which the turn must not have cancelled (the test answers only live calls). */
static cg_upstream_call *live_call(void)
{
    cg_upstream_call *c = ups.n_calls ? ups.calls[ups.n_calls - 1] : NULL;
    CHECK(c && !c->cancelled);
    return c && !c->cancelled ? c : NULL;
}

static void up_delta(const char *text)
{
    cg_upstream_call *c = live_call();
    if (c)
        c->ev->on_delta(c->ctx, text, strlen(text));
}

static void up_done(void)
{
    cg_upstream_call *c = live_call();
    if (c)
        c->ev->on_done(c->ctx, NULL, NULL);
}

static void up_error(int err, int status)
{
    cg_upstream_call *c = live_call();
    if (!c)
        return;
    json_t *detail = status ? json_pack("{s:i}", "status", status) : NULL;
    c->ev->on_error(c->ctx, err, "the fake upstream failed", detail);
    json_decref(detail);
}

/* ---- the sink: what the client is told ----------------------------------------------------- */

typedef struct client {
    char log[2048]; /* "ack:m1 delta:m1 done:m1 ..." */
    char said[1024]; /* the deltas' text, end to end */
    json_t *terminals; /* id -> how many terminal events */
    int last_err;
    char last_done[256];
    json_t *last_context;
    void *unsent[8];
    int n_unsent;
    uint64_t said_of_turn; /* the last delta's seq, 0 at each ack */
    int seq_bad;           /* deltas whose seq was not the bytes relayed so far */
} client;

static void note(client *c, const char *what, const char *id)
{
    snprintf(c->log + strlen(c->log), sizeof(c->log) - strlen(c->log), "%s%s:%s", c->log[0] ? " " : "", what,
             id ? id : "-");
}

static void terminal(client *c, const char *id)
{
    const char *k = id ? id : "-";
    json_object_set_new(c->terminals, k, json_integer(json_integer_value(json_object_get(c->terminals, k)) + 1));
}

static void sk_ack(void *conn, const cg_ack *ack)
{
    client *c = conn;
    note(c, "ack", ack->id);
    c->said_of_turn = 0;
}

static void sk_delta(void *conn, const char *id, const char *text, size_t len, uint64_t seq)
{
    client *c = conn;
    note(c, "delta", id);
    snprintf(c->said + strlen(c->said), sizeof(c->said) - strlen(c->said), "%.*s", (int)len, text);
    c->seq_bad += seq != c->said_of_turn + len; /* seq: the reply's bytes relayed so far */
    c->said_of_turn = seq;
}

static void sk_done(void *conn, const char *id, const char *reply, size_t len, json_t *usage, int truncated,
                    const cg_answer *who)
{
    (void)usage;
    (void)truncated;
    client *c = conn;
    note(c, "done", id);
    terminal(c, id);
    snprintf(c->last_done, sizeof(c->last_done), "%.*s|%s", (int)len, reply, who && who->fallback_from ? "fallback" : "");
}

static void sk_cancelled(void *conn, const char *id)
{
    note(conn, "cancelled", id);
    terminal(conn, id);
}

static void sk_error(void *conn, const char *id, int err, const char *message, json_t *detail)
{
    (void)message;
    (void)detail;
    client *c = conn;
    note(c, "error", id);
    c->last_err = err;
    if (id) /* a chat message's end; an error about nothing in particular is not one */
        terminal(c, id);
}

static void sk_warning(void *conn, const char *id, const char *code, const char *message)
{
    (void)message;
    note(conn, code, id);
}

static void sk_context(void *conn, const char *room, json_t *state)
{
    client *c = conn;
    note(c, "context", room);
    json_decref(c->last_context);
    c->last_context = json_incref(state);
}

static const cg_turn_sink sink = {.ack = sk_ack, .delta = sk_delta, .done = sk_done, .cancelled = sk_cancelled,
                                  .error = sk_error, .warning = sk_warning, .context = sk_context};

/* ---- the world: a config, the shipped rules, two upstreams (llm falls back to backup) ----- */

typedef struct world {
    uv_loop_t loop;
    cg_config cfg;
    cg_ruleset *rules;
    cg_metrics metrics;
    cg_upstream up[2];
    cg_turn_env env;
    fake_store fs;
    client cl;
    cg_turns q;
} world;

static void world_open(world *w, const char *extra_config)
{
    memset(w, 0, sizeof(*w));
    memset(&ups, 0, sizeof(ups));
    uv_loop_init(&w->loop);
    char text[1024], err[256];
    snprintf(text, sizeof(text),
             "{\"upstreams\": {\"llm\": {\"url\": \"demo\", \"fallback\": \"backup\"}, \"backup\": {\"url\": \"demo\"}},"
             " \"default_upstream\": \"llm\", \"services\": {\"travel\": {\"defaults\": {}}}%s}",
             extra_config ? extra_config : "");
    if (cg_config_load_text(&w->cfg, "test.json", text, strlen(text), err, sizeof(err)) != 0) {
        fprintf(stderr, "config: %s\n", err);
        abort();
    }
    if (cg_rules_load(CG_SOURCE_DIR "/rules", &w->rules, err, sizeof(err)) != 0) {
        fprintf(stderr, "rules: %s\n", err);
        abort();
    }
    for (int i = 0; i < 2; i++) {
        w->up[i].ops = &fu_ops;
        w->up[i].cfg = &w->cfg.upstreams[i];
        w->up[i].index = i;
    }
    CHECK_STR(w->cfg.upstreams[0].name, "llm"); /* the config keeps the file's order */
    w->fs.base.ops = &fs_ops;
    w->fs.base.loop = &w->loop;
    w->fs.base.now = fs_now;
    w->fs.dialogs = json_object();
    w->env.cfg = &w->cfg;
    w->env.loop = &w->loop;
    w->env.store = &w->fs.base;
    w->env.rules = w->rules;
    w->env.upstreams = w->up;
    w->env.n_upstreams = 2;
    w->env.metrics = &w->metrics;
    w->env.locks = json_object();
    cg_turn_env_services(&w->env);
    w->cl.terminals = json_object();
    cg_turns_init(&w->q, &w->env, &sink, NULL, &w->cl, "alice", "s_test");
}

/* Closes the connection and checks what every path must leave: no request of the store still
 * wanted, no limit taken and not ended, and every chat message ended exactly once. */
static void world_close(world *w)
{
    cg_turns_close(&w->q);
    while (answer_load(&w->fs) == 0 || answer_limit(&w->fs, CG_LIMIT_OK) == 0)
        ; /* abandoned ones: freed, their callbacks not called (CHECKs in them would fail) */
    const char *id;
    json_t *n;
    json_object_foreach(w->cl.terminals, id, n) {
        if (json_integer_value(n) != 1)
            fprintf(stderr, "message %s: %lld terminal events (%s)\n", id, (long long)json_integer_value(n), w->cl.log);
        CHECK(json_integer_value(n) == 1);
    }
    CHECK(w->fs.limit_takes == w->fs.limit_ends);
    CHECK(w->env.inflight == 0);
    CHECK(w->cl.seq_bad == 0);
    uv_run(&w->loop, UV_RUN_NOWAIT); /* the turns' timer, if one was made, closes */
    for (int i = 0; i < ups.n_calls; i++)
        free(ups.calls[i]);
    json_decref(w->cl.terminals);
    json_decref(w->cl.last_context);
    json_decref(w->fs.dialogs);
    json_decref(w->env.locks);
    cg_ruleset_unref(w->rules);
    cg_config_free(&w->cfg);
    CHECK(uv_loop_close(&w->loop) == 0);
}

static int send_chat(world *w, const char *id, const char *room, const char *text)
{
    cg_turn_request r = {.kind = CG_TURN_CHAT, .id = strdup(id), .room = strdup(room), .text = strdup(text),
                         .unique_id = 1};
    return cg_turns_submit(&w->q, &r);
}

static int send_context(world *w, cg_turn_kind kind, const char *room)
{
    cg_turn_request r = {.kind = kind, .id = strdup(""), .room = strdup(room)};
    return cg_turns_submit(&w->q, &r);
}

static long terminals_of(world *w, const char *id)
{
    return (long)json_integer_value(json_object_get(w->cl.terminals, id));
}

/* ---- the cases ------------------------------------------------------------------------------ */

/* A message's whole life: load, ack, deltas, done, saved with both messages, nothing let go
 * without a save. */
static void test_done(void)
{
    world w;
    world_open(&w, NULL);
    CHECK(send_chat(&w, "m1", "r1", "hello there") == 0);
    CHECK(pending(&w.fs, CG_STORE_LOAD) == 1 && ups.n_calls == 0);
    CHECK(answer_load(&w.fs) == 0);
    CHECK(ups.starts[0] == 1);
    CHECK_STR(ups.calls[0]->text, "hello there");
    up_delta("Hi ");
    up_delta("Alice");
    up_done();
    CHECK_STR(w.cl.log, "ack:m1 delta:m1 delta:m1 done:m1");
    CHECK_STR(w.cl.last_done, "Hi Alice|");
    CHECK(w.fs.saves == 1 && w.fs.releases == 0);
    CHECK(strstr(w.fs.last_history, "\"hello there\"") && strstr(w.fs.last_history, "\"Hi Alice\""));
    CHECK(w.metrics.turns_done == 1);
    world_close(&w);
}

/* One request of a connection at a time, in order: the second waits for the first's end. */
static void test_in_order(void)
{
    world w;
    world_open(&w, NULL);
    send_chat(&w, "m1", "r1", "first");
    send_chat(&w, "m2", "r1", "second");
    answer_load(&w.fs);
    CHECK(pending(&w.fs, CG_STORE_LOAD) == 0); /* m2 is not loaded while m1 runs */
    up_done();
    CHECK(pending(&w.fs, CG_STORE_LOAD) == 1);
    answer_load(&w.fs);
    CHECK(ups.n_calls == 2);
    CHECK_STR(ups.calls[1]->text, "second");
    up_delta("ok");
    up_done();
    CHECK(terminals_of(&w, "m1") == 1 && terminals_of(&w, "m2") == 1);
    CHECK(w.fs.saves == 2);
    /* the second turn read the first's save: its history holds both user messages */
    CHECK(strstr(w.fs.last_history, "\"first\"") && strstr(w.fs.last_history, "\"second\""));
    /* an id still in use is refused (the refusal is the second message's end, not the first's) */
    send_chat(&w, "m3", "r1", "third");
    CHECK(send_chat(&w, "m3", "r1", "again") == CG_E_BAD_FRAME);
    CHECK(terminals_of(&w, "m3") == 1 && w.cl.last_err == CG_E_BAD_FRAME);
    json_object_del(w.cl.terminals, "m3");
    answer_load(&w.fs);
    up_done();
    CHECK(terminals_of(&w, "m3") == 1);
    world_close(&w);
}

/* The client's cancel at each stage: while the store counts its limits, while it waits for the
 * dialog's lock, while the dialog loads, during the call. Each ends with one cancelled, the
 * store's request abandoned, and nothing after it. */
static void test_cancel_each_stage(void)
{
    world w;
    /* limiting */
    world_open(&w, ", \"limits\": {\"messages_per_minute\": 100}");
    cg_turns_set_plan(&w.q, NULL);
    send_chat(&w, "m1", "r1", "hello");
    CHECK(pending(&w.fs, CG_STORE_LIMIT) == 1);
    CHECK(cg_turns_cancel(&w.q, "m1") == 0);
    CHECK_STR(w.cl.log, "cancelled:m1");
    CHECK(pending(&w.fs, CG_STORE_LIMIT) == 0); /* abandoned */
    CHECK(answer_limit(&w.fs, CG_LIMIT_OK) == 0 && pending(&w.fs, CG_STORE_LOAD) == 0);
    CHECK(w.fs.limit_ends == 0 && w.fs.limit_takes == 1);
    w.fs.limit_takes = 0; /* never counted: nothing to end */
    CHECK(ups.n_calls == 0 && w.fs.saves == 0);
    world_close(&w);

    /* loading */
    world_open(&w, NULL);
    send_chat(&w, "m1", "r1", "hello");
    CHECK(cg_turns_cancel(&w.q, "m1") == 0);
    CHECK_STR(w.cl.log, "cancelled:m1");
    CHECK(pending(&w.fs, CG_STORE_LOAD) == 0);
    answer_load(&w.fs);
    CHECK(ups.n_calls == 0 && w.fs.saves == 0);
    world_close(&w);

    /* locking: another connection of the same user holds the dialog */
    world_open(&w, NULL);
    client other_cl = {.terminals = json_object()};
    cg_turns other;
    cg_turns_init(&other, &w.env, &sink, NULL, &other_cl, "alice", "s_other");
    cg_turn_request r = {.kind = CG_TURN_CHAT, .id = strdup("o1"), .room = strdup("r1"), .text = strdup("mine")};
    cg_turns_submit(&other, &r);
    answer_load(&w.fs); /* the other tab's turn holds the lock, its call in flight */
    send_chat(&w, "m1", "r1", "hello");
    CHECK(pending(&w.fs, CG_STORE_LOAD) == 0); /* waits for the lock */
    CHECK(cg_turns_cancel(&w.q, "m1") == 0);
    CHECK_STR(w.cl.log, "cancelled:m1");
    up_done(); /* the other's turn ends: the lock passes to no one */
    CHECK(pending(&w.fs, CG_STORE_LOAD) == 0);
    CHECK(json_integer_value(json_object_get(other_cl.terminals, "o1")) == 1);
    cg_turns_close(&other);
    json_decref(other_cl.terminals);
    world_close(&w);

    /* calling, and streaming: the call is cancelled, the turn saved as cancelled */
    world_open(&w, NULL);
    send_chat(&w, "m1", "r1", "hello");
    answer_load(&w.fs);
    up_delta("partial");
    CHECK(cg_turns_cancel(&w.q, "m1") == 0);
    CHECK(ups.calls[0]->cancelled && ups.cancels == 1);
    CHECK_STR(w.cl.log, "ack:m1 delta:m1 cancelled:m1");
    CHECK(w.fs.saves == 1 && strstr(w.fs.last_history, "\"cancelled\":true"));
    CHECK(w.metrics.turns_cancelled == 1);
    CHECK(cg_turns_cancel(&w.q, "m1") == -1); /* it is over */
    world_close(&w);

    /* a message still waiting in the queue */
    world_open(&w, NULL);
    send_chat(&w, "m1", "r1", "first");
    send_chat(&w, "m2", "r1", "second");
    CHECK(cg_turns_cancel(&w.q, "m2") == 0);
    answer_load(&w.fs);
    up_done();
    CHECK_STR(w.cl.log, "cancelled:m2 ack:m1 done:m1");
    CHECK(pending(&w.fs, CG_STORE_LOAD) == 0 && ups.n_calls == 1);
    world_close(&w);
}

/* A cancel phrase stops the reply in flight of its room at once; the phrase itself then runs
 * as a message of its own. */
static void test_cancel_phrase(void)
{
    world w;
    world_open(&w, NULL);
    send_chat(&w, "m1", "r1", "hello");
    answer_load(&w.fs);
    up_delta("a long reply");
    send_chat(&w, "m2", "r1", "cancel");
    CHECK(ups.calls[0]->cancelled);
    CHECK(terminals_of(&w, "m1") == 1);
    CHECK(strstr(w.cl.log, "cancelled:m1") != NULL);
    answer_load(&w.fs);
    world_close(&w); /* m2 may be answered here or not: whatever it is, once */
}

/* An upstream's 503: the fallback upstream answers, once, before any text went on; a 4xx
 * does not fall back; a failure after text does not either. */
static void test_fallback(void)
{
    world w;
    world_open(&w, NULL);
    send_chat(&w, "m1", "r1", "hello");
    answer_load(&w.fs);
    up_error(CG_E_UPSTREAM_ERROR, 503);
    CHECK(ups.starts[0] == 1 && ups.starts[1] == 1); /* the backup got the same message */
    CHECK_STR(ups.calls[1]->text, "hello");
    CHECK(terminals_of(&w, "m1") == 0);
    up_delta("from backup");
    up_done();
    CHECK_STR(w.cl.log, "ack:m1 delta:m1 done:m1");
    CHECK_STR(w.cl.last_done, "from backup|fallback");
    CHECK(w.metrics.upstream_fallbacks[0] == 1);

    /* the backup fails too: no second fallback, the error is the end */
    send_chat(&w, "m2", "r1", "again");
    answer_load(&w.fs);
    up_error(CG_E_UPSTREAM_UNAVAILABLE, 0);
    up_error(CG_E_UPSTREAM_UNAVAILABLE, 0);
    CHECK(terminals_of(&w, "m2") == 1 && w.cl.last_err == CG_E_UPSTREAM_UNAVAILABLE);
    CHECK(ups.n_calls == 4);

    /* a 400 says the request is wrong: the fallback would say the same */
    send_chat(&w, "m3", "r1", "bad");
    answer_load(&w.fs);
    up_error(CG_E_UPSTREAM_ERROR, 400);
    CHECK(terminals_of(&w, "m3") == 1 && ups.n_calls == 5);

    /* text already went to the client: no fallback */
    send_chat(&w, "m4", "r1", "half");
    answer_load(&w.fs);
    up_delta("half a reply");
    up_error(CG_E_UPSTREAM_ERROR, 503);
    CHECK(terminals_of(&w, "m4") == 1 && ups.n_calls == 6);
    CHECK(w.fs.saves == 4);
    world_close(&w);
}

/* The client goes mid-stream: the call is cancelled, the turn saved as cancelled with what was
 * said, and the client is told nothing more. */
static void test_close_mid_stream(void)
{
    world w;
    world_open(&w, NULL);
    send_chat(&w, "m1", "r1", "hello");
    send_chat(&w, "m2", "r1", "queued");
    answer_load(&w.fs);
    up_delta("half");
    cg_turns_close(&w.q);
    CHECK(ups.calls[0]->cancelled);
    CHECK(w.fs.saves == 1 && strstr(w.fs.last_history, "\"half\""));
    CHECK_STR(w.cl.log, "ack:m1 delta:m1");
    CHECK(pending(&w.fs, CG_STORE_LOAD) == 0); /* m2 was dropped, never loaded */
    json_object_clear(w.cl.terminals);         /* no terminal event after the close */
    world_close(&w);

    /* closed while the dialog loads: the load abandoned, nothing saved, the lease let go by
     * the store (the abandoned load takes none) */
    world_open(&w, NULL);
    send_chat(&w, "m1", "r1", "hello");
    cg_turns_close(&w.q);
    CHECK(pending(&w.fs, CG_STORE_LOAD) == 0 && w.fs.saves == 0);
    world_close(&w);
}

/* A user's limit refuses the message before its dialog: rate_limited, never loaded, never
 * called, and not a turn in the figures. */
static void test_limit_refused(void)
{
    world w;
    world_open(&w, ", \"limits\": {\"messages_per_minute\": 1}");
    cg_turns_set_plan(&w.q, NULL);
    send_chat(&w, "m1", "r1", "hello");
    CHECK(answer_limit(&w.fs, CG_LIMIT_MESSAGES) == 0);
    CHECK_STR(w.cl.log, "error:m1");
    CHECK(w.cl.last_err == CG_E_RATE_LIMITED);
    CHECK(pending(&w.fs, CG_STORE_LOAD) == 0 && ups.n_calls == 0 && w.fs.saves == 0);
    CHECK(w.metrics.limited[CG_LIMIT_MESSAGES] == 1);
    w.fs.limit_takes--; /* refused: nothing was held, so nothing to end */
    /* the next one goes */
    send_chat(&w, "m2", "r1", "hello again");
    answer_limit(&w.fs, CG_LIMIT_OK);
    answer_load(&w.fs);
    up_done();
    CHECK(terminals_of(&w, "m2") == 1 && w.fs.limit_ends == 1);
    world_close(&w);
}

/* Params over the cap: refused with an error, nothing called, the turn saved as an error. */
static void test_params_cap(void)
{
    world w;
    world_open(&w, ", \"params_cap\": 64");
    send_chat(&w, "m1", "r1",
              "Find me flights from Nairobiiiiiiiiiiiiiiiiiiiiiiiiiiiiiii to Londonnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnn "
              "next week");
    answer_load(&w.fs);
    CHECK(ups.n_calls == 0);
    CHECK(terminals_of(&w, "m1") == 1);
    CHECK(w.cl.last_err == CG_E_TOO_LARGE);
    CHECK(w.metrics.turns_error == 1);
    world_close(&w);
}

/* A reload between a message's arrival and its start: it runs with the set it arrived under,
 * which lives until it ends. */
static void test_reload_while_queued(void)
{
    world w;
    world_open(&w, NULL);
    send_chat(&w, "m1", "r1", "hello");
    send_chat(&w, "m2", "r1", "Find me flights from Nairobi to London next week");
    char err[256];
    cg_ruleset *empty = NULL;
    CHECK(cg_rules_load_text("empty.rules", "", 0, &empty, err, sizeof(err)) == 0);
    cg_ruleset *old = w.env.rules;
    w.env.rules = empty; /* the reload: the gateway drops its reference to the old set */
    w.rules = empty;
    cg_ruleset_unref(old); /* still held by m1 and m2 */
    answer_load(&w.fs);
    up_done();
    answer_load(&w.fs);
    up_done();
    /* m2 ran under the old set: its travel params were extracted */
    json_t *saved = json_object_get(w.fs.dialogs, "r1");
    CHECK(json_is_string(json_object_get(json_object_get(json_object_get(saved, "params"), "travel"), "from")));
    /* a message after the reload runs under the new one: nothing extracted */
    send_chat(&w, "m3", "r2", "Find me flights from Nairobi to Paris next week");
    answer_load(&w.fs);
    up_done();
    saved = json_object_get(w.fs.dialogs, "r2");
    CHECK(!json_object_get(json_object_get(saved, "params"), "travel"));
    world_close(&w);
}

/* Context commands: answered from the loaded dialog; clear removes it; nothing is called. */
static void test_context(void)
{
    world w;
    world_open(&w, NULL);
    send_chat(&w, "m1", "r1", "Find me flights from Nairobi to London next week");
    answer_load(&w.fs);
    up_done();
    send_context(&w, CG_TURN_CONTEXT_GET, "r1");
    answer_load(&w.fs);
    CHECK(strstr(w.cl.log, "context:r1") != NULL);
    CHECK(json_object_get(json_object_get(w.cl.last_context, "params"), "travel") != NULL);
    CHECK(w.fs.releases == 1); /* a get saves nothing: its lease goes back */
    send_context(&w, CG_TURN_CONTEXT_CLEAR, "r1");
    answer_load(&w.fs);
    CHECK(w.fs.removes == 1 && !json_object_get(w.fs.dialogs, "r1"));
    CHECK(ups.n_calls == 1);
    world_close(&w);
}

/* Slow client: the call in flight pauses, and a call started while paused starts paused. */
static void test_pause(void)
{
    world w;
    world_open(&w, NULL);
    send_chat(&w, "m1", "r1", "hello");
    answer_load(&w.fs);
    cg_turns_pause(&w.q, 1);
    CHECK(ups.calls[0]->paused == 1);
    up_error(CG_E_UPSTREAM_ERROR, 503); /* the fallback's call starts paused too */
    CHECK(ups.calls[1]->paused == 1);
    cg_turns_pause(&w.q, 0);
    CHECK(ups.calls[1]->paused == 0);
    up_done();
    world_close(&w);
}


/* A stop rule on the reply: the text held back is never said, the call is cancelled from the
 * loop (not inside the upstream's callback), and the message ends with one error, blocked. */
static void test_blocked(void)
{
    world w;
    world_open(&w, NULL);
    static const char rules[] = "rule reply_secret_key\n  on      reply\n  match   \\bsk-[a-z]{16,}\n  do      stop\n";
    char err[256];
    cg_ruleset *stop = NULL;
    if (cg_rules_load_text("stop.rules", rules, strlen(rules), &stop, err, sizeof(err)) != 0)
        fprintf(stderr, "rules: %s\n", err);
    CHECK(stop != NULL);
    cg_ruleset_unref(w.env.rules);
    w.env.rules = w.rules = stop;
    send_chat(&w, "m1", "r1", "what is my key?");
    answer_load(&w.fs);
    up_delta("your key is sk-abcdefghijklmnopqrstuvwxyz and more");
    CHECK(terminals_of(&w, "m1") == 0 && !ups.calls[0]->cancelled); /* not from inside its callback */
    uv_run(&w.loop, UV_RUN_NOWAIT);
    CHECK(ups.calls[0]->cancelled);
    CHECK(terminals_of(&w, "m1") == 1 && w.cl.last_err == CG_E_BLOCKED);
    CHECK(strstr(w.cl.said, "sk-") == NULL); /* the secret never went out */
    CHECK(w.metrics.turns_blocked == 1 && w.fs.saves == 1);
    world_close(&w);
}

/* ---- a forwarding adapter (drop-in): the message goes over the adapter's own connection --- */

typedef struct app {
    cg_turn *t;        /* the forwarded turn in flight */
    int forwarded, stopped, unsent;
    char opaque_back[64]; /* which opaques came back, and how: "F1 U2 ..." */
} app;

static app the_app;

static int fw_forward(void *conn, cg_turn *t, const cg_turn_forward *f)
{
    (void)conn;
    the_app.t = t;
    the_app.forwarded++;
    snprintf(the_app.opaque_back + strlen(the_app.opaque_back), sizeof(the_app.opaque_back) - strlen(the_app.opaque_back),
             "F%s ", (const char *)f->opaque);
    return 0;
}

static void fw_stop(void *conn, cg_turn *t, int client_said)
{
    (void)conn;
    (void)client_said;
    CHECK(t == the_app.t);
    the_app.stopped++;
}

static void fw_unsent(void *conn, void *opaque)
{
    (void)conn;
    the_app.unsent++;
    snprintf(the_app.opaque_back + strlen(the_app.opaque_back), sizeof(the_app.opaque_back) - strlen(the_app.opaque_back),
             "U%s ", (const char *)opaque);
}

static const cg_turn_sink fw_sink = {.error = sk_error, .warning = sk_warning, .forward = fw_forward,
                                     .stop_forward = fw_stop, .unsent = fw_unsent};

static void forwarding(world *w)
{
    memset(&the_app, 0, sizeof(the_app));
    cg_turns_close(&w->q);
    static const cg_turn_forwarding fw = {0}; /* each case sets what it tests */
    cg_turns_init(&w->q, &w->env, &fw_sink, &fw, &w->cl, "alice", "s_dropin");
}

static int send_frame(world *w, const char *id, const char *text, const char *opaque)
{
    cg_turn_request r = {.kind = CG_TURN_CHAT, .id = strdup(id), .room = strdup("r1"), .text = strdup(text),
                         .opaque = (void *)opaque};
    return cg_turns_submit(&w->q, &r);
}

static void test_forward(void)
{
    world w;
    world_open(&w, NULL);
    forwarding(&w);
    send_frame(&w, "a1", "hello app", "1");
    answer_load(&w.fs);
    CHECK(the_app.forwarded == 1 && ups.n_calls == 0);
    cg_turn_reply(the_app.t, "hi ", 3);
    cg_turn_reply(the_app.t, "there", 5);
    cg_turn_end(the_app.t, 0);
    CHECK(w.fs.saves == 1 && strstr(w.fs.last_history, "\"hi there\""));

    /* the client cancels: the app is told, the turn goes on until the app's end; a cancel
     * that names another message (client.cancel_id) stops nothing */
    send_frame(&w, "a2", "long one", "2");
    answer_load(&w.fs);
    cg_turns_cancel_current(&w.q, "a1");
    CHECK(the_app.stopped == 0);
    cg_turns_cancel_current(&w.q, "a2");
    CHECK(the_app.stopped == 1 && w.fs.saves == 1);
    cg_turn_end(the_app.t, 1);
    CHECK(w.fs.saves == 2 && strstr(w.fs.last_history, "\"long one\""));
    CHECK(w.metrics.turns_cancelled == 1);

    /* a cancel before the message is forwarded stops nothing: it goes, and the app gets the
     * client's cancel after it (the adapter's own relay) */
    send_frame(&w, "a3", "loading", "3");
    cg_turns_cancel_current(&w.q, "");
    answer_load(&w.fs);
    CHECK(the_app.forwarded == 3 && the_app.stopped == 1);
    cg_turn_end(the_app.t, 0);
    /* one cancelled while it waits in the queue is given back, never forwarded */
    send_frame(&w, "a4", "first", "4");
    send_frame(&w, "a5", "queued", "5");
    CHECK(cg_turns_cancel(&w.q, "a5") == 0);
    answer_load(&w.fs);
    cg_turn_end(the_app.t, 0);
    CHECK(pending(&w.fs, CG_STORE_LOAD) == 0);
    CHECK_STR(the_app.opaque_back, "F1 F2 F3 U5 F4 ");
    CHECK(w.fs.saves == 4);

    /* the app says nothing: the turn ends after reply_timeout_ms, its dialog free */
    w.q.fw.reply_timeout_ms = 1;
    send_frame(&w, "a6", "anyone?", "6");
    answer_load(&w.fs);
    CHECK(the_app.forwarded == 5);
    uv_run(&w.loop, UV_RUN_DEFAULT); /* until the timer, the loop's only live handle, has run */
    CHECK(w.fs.saves == 5 && w.q.inflight == NULL);

    /* supersede: the next message ends the forwarded turn in flight */
    w.q.fw.reply_timeout_ms = 0;
    w.q.fw.supersede = 1;
    send_frame(&w, "a7", "one", "7");
    answer_load(&w.fs);
    send_frame(&w, "a8", "two", "8");
    CHECK(w.fs.saves == 6); /* a7 ended, saved */
    answer_load(&w.fs);
    CHECK(the_app.forwarded == 7);
    cg_turns_close(&w.q); /* a8 in flight: saved as cancelled, and nothing is given back twice */
    CHECK(w.fs.saves == 7);
    CHECK_STR(the_app.opaque_back, "F1 F2 F3 U5 F4 F6 F7 F8 ");
    world_close(&w);
}

static void test_forward_limit_refused(void)
{
    world w;
    world_open(&w, ", \"limits\": {\"messages_per_minute\": 1}");
    forwarding(&w);
    cg_turns_set_plan(&w.q, NULL);
    send_frame(&w, "a1", "hello", "1");
    answer_limit(&w.fs, CG_LIMIT_MESSAGES);
    w.fs.limit_takes--;
    CHECK_STR(the_app.opaque_back, "U1 ");
    CHECK(w.cl.last_err == CG_E_RATE_LIMITED && the_app.forwarded == 0);
    /* and closed while the limit is counted: given back too */
    send_frame(&w, "a2", "hello", "2");
    cg_turns_close(&w.q);
    CHECK_STR(the_app.opaque_back, "U1 U2 ");
    answer_limit(&w.fs, CG_LIMIT_OK);
    w.fs.limit_takes--;
    json_object_clear(w.cl.terminals);
    world_close(&w);
}

/*
 * Issue 35, defect 1 (a refused drop-in chat frame must never reach the app), for the refusal
 * when the store cannot start the dialog's load (turn_load -> say_early_error): the turn says
 * the error (internal, the message's one end), hands the frame's opaque back through unsent
 * exactly once, and never calls forward; the frames after it go on. At each place the load
 * starts from: first in line, behind another turn of the connection, after the user's limits
 * (the limit taken is ended), and when another tab's turn lets the dialog's lock go. The
 * adapter's side (unsent drops the frame: dropin.c, sink_unsent) is one function for every
 * refusal after arrival; test_dropin_trust's part_user_limit holds it with real processes.
 * Fails if a failed load reached forward (as the params cap's refusal did before 164cb37) or
 * if its opaque were not given back (the frame would wait in the adapter's queue for ever,
 * and what the client sent after it with it).
 */
static void test_forward_load_failed(void)
{
    world w;
    world_open(&w, NULL);
    forwarding(&w);
    w.fs.fail_loads = 1;
    CHECK(send_frame(&w, "a1", "hello", "1") == 0); /* accepted: the refusal is the turn's */
    CHECK_STR(the_app.opaque_back, "U1 ");
    CHECK(the_app.forwarded == 0 && w.cl.last_err == CG_E_INTERNAL && terminals_of(&w, "a1") == 1);
    CHECK(w.fs.saves == 0 && w.fs.releases == 0 && pending(&w.fs, CG_STORE_LOAD) == 0);
    CHECK(w.q.inflight == NULL && w.env.inflight == 0);
    /* the line moves on: the next frame is loaded and forwarded */
    send_frame(&w, "a2", "again", "2");
    answer_load(&w.fs);
    CHECK(the_app.forwarded == 1);
    cg_turn_end(the_app.t, 0);
    /* one queued behind a forwarded turn: its load is refused when its turn comes */
    send_frame(&w, "a3", "first", "3");
    send_frame(&w, "a4", "queued", "4");
    answer_load(&w.fs);
    w.fs.fail_loads = 1;
    cg_turn_end(the_app.t, 0);
    CHECK_STR(the_app.opaque_back, "U1 F2 F3 U4 ");
    CHECK(the_app.forwarded == 2 && terminals_of(&w, "a4") == 1 && w.fs.saves == 2);
    world_close(&w);

    /* with a user's limits: counted, then the load refused; the limit it took is ended */
    world_open(&w, ", \"limits\": {\"messages_per_minute\": 10}");
    forwarding(&w);
    cg_turns_set_plan(&w.q, NULL);
    w.fs.fail_loads = 1;
    send_frame(&w, "b1", "hello", "1");
    CHECK_STR(the_app.opaque_back, ""); /* not before the limit's verdict */
    CHECK(answer_limit(&w.fs, CG_LIMIT_OK) == 0);
    CHECK_STR(the_app.opaque_back, "U1 ");
    CHECK(the_app.forwarded == 0 && w.cl.last_err == CG_E_INTERNAL && terminals_of(&w, "b1") == 1);
    CHECK(w.fs.limit_ends == 1);
    world_close(&w);

    /* waiting for the dialog's lock, which another tab's forwarded turn holds: the load is
     * refused when the lock passes */
    world_open(&w, NULL);
    forwarding(&w);
    client other_cl = {.terminals = json_object()};
    cg_turns other;
    static const cg_turn_forwarding fw = {0};
    cg_turns_init(&other, &w.env, &fw_sink, &fw, &other_cl, "alice", "s_other");
    cg_turn_request r = {.kind = CG_TURN_CHAT, .id = strdup("o1"), .room = strdup("r1"), .text = strdup("mine"),
                         .opaque = (void *)"O"};
    CHECK(cg_turns_submit(&other, &r) == 0);
    answer_load(&w.fs);
    CHECK(the_app.forwarded == 1);
    cg_turn *held = the_app.t;
    send_frame(&w, "c1", "hello", "1");
    CHECK(pending(&w.fs, CG_STORE_LOAD) == 0); /* waits for the lock */
    w.fs.fail_loads = 1;
    cg_turn_end(held, 0); /* the other tab's turn ends: the lock passes to c1, whose load is refused */
    CHECK_STR(the_app.opaque_back, "FO U1 ");
    CHECK(the_app.forwarded == 1 && terminals_of(&w, "c1") == 1 && w.cl.last_err == CG_E_INTERNAL);
    CHECK(w.q.inflight == NULL && pending(&w.fs, CG_STORE_LOAD) == 0);
    cg_turns_close(&other);
    json_decref(other_cl.terminals);
    world_close(&w);
}

/*
 * Issue 35, defect 1, the params cap on a drop-in turn: refused (too_large), saved as an error
 * with the dialog unchanged, the frame handed back unsent, never forwarded. Before 164cb37
 * turn_start refused over-the-cap params only for a sink without forward: a drop-in turn was
 * forwarded with the error in its chatgate object (this case then sees "F1 ").
 */
static void test_forward_params_cap(void)
{
    world w;
    world_open(&w, ", \"params_cap\": 64");
    forwarding(&w);
    send_frame(&w, "p1",
               "Find me flights from Nairobiiiiiiiiiiiiiiiiiiiiiiiiiiiiiii to Londonnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnn "
               "next week",
               "1");
    answer_load(&w.fs);
    CHECK_STR(the_app.opaque_back, "U1 ");
    CHECK(the_app.forwarded == 0 && w.cl.last_err == CG_E_TOO_LARGE && terminals_of(&w, "p1") == 1);
    CHECK(w.fs.saves == 1 && w.metrics.turns_error == 1);
    CHECK(!json_object_get(json_object_get(json_object_get(w.fs.dialogs, "r1"), "params"), "travel"));
    /* the next frame goes */
    send_frame(&w, "p2", "hello", "2");
    answer_load(&w.fs);
    CHECK_STR(the_app.opaque_back, "U1 F2 ");
    cg_turn_end(the_app.t, 0);
    world_close(&w);
}

/*
 * Issue 35, defect 1, at shutdown: a drop-in frame that arrives while the gateway drains
 * (env.stopping, set by SIGTERM: gateway.c, on_signal) is refused on arrival (turns_accept):
 * cg_turns_submit answers the code, the client's error is said, and the frame is neither
 * forwarded nor handed back through unsent (turn.h: a refused request's opaque stays the
 * caller's, which drops it; an unsent as well would free it twice). The reply in flight
 * still ends and is saved, as a drain lets it. Fails if a drain stopped refusing drop-in
 * frames (the frame would queue behind the reply in flight and be forwarded at its end) or
 * if the refusal gave the opaque back too.
 */
static void test_forward_draining(void)
{
    world w;
    world_open(&w, NULL);
    forwarding(&w);
    send_frame(&w, "d1", "before", "1");
    answer_load(&w.fs);
    CHECK(the_app.forwarded == 1);
    cg_turn *in_flight = the_app.t;
    w.env.stopping = 1; /* the drain begins */
    CHECK(send_frame(&w, "d2", "during the drain", "2") == CG_E_INTERNAL);
    CHECK(terminals_of(&w, "d2") == 1 && w.cl.last_err == CG_E_INTERNAL);
    CHECK(w.q.queued == 0 && w.q.head == NULL);
    CHECK_STR(the_app.opaque_back, "F1 ");
    cg_turn_end(in_flight, 0); /* the reply in flight ends: nothing was waiting behind it */
    CHECK(w.fs.saves == 1 && pending(&w.fs, CG_STORE_LOAD) == 0 && w.q.inflight == NULL);
    CHECK_STR(the_app.opaque_back, "F1 ");
    CHECK(the_app.forwarded == 1);
    /* a frame before any limit or load is refused the same (no turn in flight) */
    CHECK(send_frame(&w, "d3", "and again", "3") == CG_E_INTERNAL);
    CHECK(pending(&w.fs, CG_STORE_LOAD) == 0 && the_app.forwarded == 1);
    CHECK_STR(the_app.opaque_back, "F1 ");
    world_close(&w);
}

int main(void)
{
    test_done();
    test_in_order();
    test_cancel_each_stage();
    test_cancel_phrase();
    test_fallback();
    test_close_mid_stream();
    test_limit_refused();
    test_params_cap();
    test_reload_while_queued();
    test_context();
    test_pause();
    test_blocked();
    test_forward();
    test_forward_limit_refused();
    test_forward_load_failed();
    test_forward_params_cap();
    test_forward_draining();
    return unit_done("turn");
}
