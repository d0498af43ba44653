/*
 * test_fallback.c: degraded mode (fallback.c), the wrapper, in front of a fake inner store,
 * on a real uv loop, with an injected clock and no socket: requests go to the inner store
 * while it is up and its answers are passed on; what it answers "unavailable" memory
 * answers (a load from the gateway's copy, a save kept for the write-back); a dirty dialog
 * is served from memory without asking it; answers from memory while the store is away (the
 * warning once per dialog and outage, a dialog never seen marked as of unknown base); the
 * write-back when it returns (each dirty dialog handed to the backend once, with its
 * version; a newer write made meanwhile sent when the older one is answered; a refused one
 * dropped, a newer one kept; one memory no longer holds never written), the bounds of the dirty set, a failed
 * write-back sent again by the tick, the write-back at closing (the store up or away; a save
 * still at the store counted in flight, marked when it fails), the rewrite after a move,
 * forgetting a user, and requests whose caller left (at the wrapper and at the inner store).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chatgate/core/alloc.h"
#include "chatgate/store/fallback.h"
#include "chatgate/store/store.h"
#include "unit.h"

/* ---- the fake store: a clock, an inner store, a backend that records the write-backs ---- */

typedef struct written_rec {
    char key[64];
    long version;
    int base_unknown;
    char from[32]; /* the dialog's travel.from, to tell versions apart */
} written_rec;

typedef struct inner_req inner_req;

typedef struct fake {
    cg_store st;
    int64_t now;      /* the store's clock, unix seconds */
    int refuse_start; /* the backend cannot start a write-back */
    written_rec got[32];
    int n;
    /* the inner store */
    int unavailable;  /* it answers every request "unavailable" */
    int asked;        /* requests it was given */
    int released;     /* leases let go */
    int saved;        /* saves it took */
    int abandoned;    /* its requests whose caller left before its answer */
    int ended;        /* turns' ends it was told */
    const cg_dialog *unsaved; /* the dialog a failed save answers it had (a merge's), or NULL */
    inner_req *due;   /* its answers, from the loop */
    uv_timer_t timer;
} fake;

struct inner_req {
    CG_STORE_REQ_FIELDS
    fake *f;
    inner_req *next;
};

static int64_t fake_now(void *ctx)
{
    return ((fake *)ctx)->now;
}

/* The inner store's answers: a dialog with travel.from "inner", or "unavailable". */
static void inner_answer(uv_timer_t *t)
{
    fake *f = t->data;
    inner_req *r = f->due;
    f->due = NULL;
    while (r) {
        inner_req *next = r->next;
        cg_store_status st = {.unavailable = f->unavailable, .found = !f->unavailable};
        f->abandoned += r->abandoned;
        if (!r->abandoned && r->kind == CG_STORE_LOAD) {
            cg_dialog d;
            char err[64];
            cg_dialog_init(&d, f->now);
            json_t *p = json_pack("{s:s}", "from", "inner");
            cg_dialog_merge_params(&d, "travel", p, &f->st.cfg.lifetimes, err, sizeof(err));
            json_decref(p);
            if (f->unavailable) {
                cg_dialog_free(&d);
                r->cb.load(r->ctx, NULL, &st);
            } else {
                r->cb.load(r->ctx, &d, &st);
            }
        } else if (!r->abandoned && r->kind == CG_STORE_LIMIT) {
            cg_limit_verdict v = {CG_LIMIT_OK, 0, 0};
            r->cb.limit(r->ctx, f->unavailable ? NULL : &v, &st);
        } else if (!r->abandoned && r->kind == CG_STORE_ROOMS) {
            json_t *rooms = json_pack("[s]", "inner");
            r->cb.rooms(r->ctx, f->unavailable ? NULL : rooms, &st);
            json_decref(rooms);
        } else if (!r->abandoned && r->cb.done) {
            f->saved += r->kind == CG_STORE_SAVE && !f->unavailable;
            st.unsaved = r->kind == CG_STORE_SAVE && f->unavailable ? f->unsaved : NULL;
            r->cb.done(r->ctx, &st);
        }
        free(r);
        r = next;
    }
}

static cg_store_req *inner_new(cg_store *st, cg_store_op kind, void *ctx)
{
    fake *f = (fake *)st;
    inner_req *r = cg_calloc(1, sizeof(*r));
    r->kind = kind;
    r->ctx = ctx;
    r->f = f;
    inner_req **pp = &f->due; /* answered in order */
    while (*pp)
        pp = &(*pp)->next;
    *pp = r;
    f->asked++;
    uv_timer_start(&f->timer, inner_answer, 0, 0);
    return (cg_store_req *)r;
}

static cg_store_req *inner_load(cg_store *st, const char *user, const char *room, cg_store_load_fn cb, void *ctx)
{
    (void)user;
    (void)room;
    cg_store_req *r = inner_new(st, CG_STORE_LOAD, ctx);
    r->cb.load = cb;
    return r;
}

static cg_store_req *inner_save(cg_store *st, const char *user, const char *room, const cg_dialog *d,
                                cg_store_done_fn cb, void *ctx)
{
    (void)user;
    (void)room;
    (void)d;
    cg_store_req *r = inner_new(st, CG_STORE_SAVE, ctx);
    r->cb.done = cb;
    return r;
}

static cg_store_req *inner_remove(cg_store *st, const char *user, const char *room, cg_store_done_fn cb, void *ctx)
{
    (void)user;
    (void)room;
    cg_store_req *r = inner_new(st, CG_STORE_REMOVE, ctx);
    r->cb.done = cb;
    return r;
}

static cg_store_req *inner_remove_user(cg_store *st, const char *user, cg_store_done_fn cb, void *ctx)
{
    (void)user;
    cg_store_req *r = inner_new(st, CG_STORE_REMOVE_USER, ctx);
    r->cb.done = cb;
    return r;
}

static cg_store_req *inner_rooms(cg_store *st, const char *user, cg_store_rooms_fn cb, void *ctx)
{
    (void)user;
    cg_store_req *r = inner_new(st, CG_STORE_ROOMS, ctx);
    r->cb.rooms = cb;
    return r;
}

static void inner_release(cg_store *st, const char *user, const char *room)
{
    (void)user;
    (void)room;
    ((fake *)st)->released++;
}

static cg_store_req *inner_take(cg_store *st, const char *user, const cg_limits *lim, uint64_t turn,
                                cg_store_limit_fn cb, void *ctx)
{
    (void)user;
    (void)lim;
    (void)turn;
    cg_store_req *r = inner_new(st, CG_STORE_LIMIT, ctx);
    r->cb.limit = cb;
    return r;
}

static void inner_end(cg_store *st, const char *user, const cg_limits *lim, uint64_t turn, int local, long long tokens)
{
    ((fake *)st)->ended++;
    (void)user;
    (void)lim;
    (void)turn;
    (void)local;
    (void)tokens;
}

static const cg_store_dialog_ops inner_dialogs = {inner_load, inner_save, inner_remove, inner_remove_user, inner_rooms};
static const cg_store_lease_ops inner_lease = {inner_load, inner_release};
static const cg_store_limit_ops inner_limits = {inner_take, inner_end};

static int fake_writeback(void *backend, const cg_fallback_dirty *item, cg_dialog *d)
{
    fake *f = backend;
    if (f->refuse_start || f->n == (int)(sizeof(f->got) / sizeof(f->got[0]))) {
        cg_dialog_free(d);
        return -1;
    }
    written_rec *w = &f->got[f->n++];
    snprintf(w->key, sizeof(w->key), "%s", item->key);
    w->version = item->version;
    w->base_unknown = item->base_unknown;
    const char *from = json_string_value(json_object_get(json_object_get(d->params, "travel"), "from"));
    snprintf(w->from, sizeof(w->from), "%s", from ? from : "");
    cg_dialog_free(d);
    return 0;
}

static const cg_fallback_backend_ops fake_ops = {.writeback = fake_writeback};

static cg_fallback *fake_open(fake *f, uv_loop_t *loop, long max_dialogs, long writeback_max_bytes)
{
    memset(f, 0, sizeof(*f));
    f->st.loop = loop;
    f->st.cfg.max_dialogs = max_dialogs;
    f->st.cfg.writeback_max_bytes = writeback_max_bytes;
    cg_lifetimes_default(&f->st.cfg.lifetimes);
    f->st.now = fake_now;
    f->st.clock_ctx = f;
    f->now = 1000000;
    uv_timer_init(loop, &f->timer);
    f->timer.data = f;
    static const cg_fallback_inner inner = {&inner_dialogs, &inner_lease, &inner_limits};
    return cg_fallback_new(&f->st, "fake store", &inner, &fake_ops, f);
}

/* The store's end, once cg_fallback_closing was called: the fallback's timer closes, then it
 * is freed. */
static void fake_free(fake *f, cg_fallback *fb)
{
    uv_close((uv_handle_t *)&f->timer, NULL);
    uv_run(f->st.loop, UV_RUN_DEFAULT);
    cg_fallback_free(fb);
}

static void fake_close(fake *f, cg_fallback *fb)
{
    cg_fallback_closing(fb, NULL, NULL);
    fake_free(f, fb);
}

/* ---- requests, through the wrapper's tables ------------------------------------------------ */

typedef struct answer {
    int calls;
    cg_store_status st;
    char from[32];
    cg_limit_verdict v;
} answer;

static void on_load(void *ctx, cg_dialog *d, const cg_store_status *st)
{
    answer *a = ctx;
    a->calls++;
    a->st = *st;
    const char *from = json_string_value(json_object_get(json_object_get(d->params, "travel"), "from"));
    snprintf(a->from, sizeof(a->from), "%s", from ? from : "");
    cg_dialog_free(d);
}

static void on_done(void *ctx, const cg_store_status *st)
{
    answer *a = ctx;
    a->calls++;
    a->st = *st;
}

static void on_limit(void *ctx, const cg_limit_verdict *v, const cg_store_status *st)
{
    answer *a = ctx;
    a->calls++;
    a->st = *st;
    a->v = *v;
}

static void on_rooms(void *ctx, json_t *rooms, const cg_store_status *st)
{
    answer *a = ctx;
    a->calls++;
    a->st = *st;
    snprintf(a->from, sizeof(a->from), "%s", json_string_value(json_array_get(rooms, 0)) ? json_string_value(json_array_get(rooms, 0)) : "");
}

/* A turn's load (the lease's acquire) of key "<user>:<room>", answered. */
static answer load(fake *f, const char *key)
{
    char user[32], *room;
    snprintf(user, sizeof(user), "%s", key);
    room = strchr(user, ':');
    *room++ = 0;
    answer a = {0};
    cg_fallback_lease_ops.acquire(&f->st, user, room, on_load, &a);
    uv_run(f->st.loop, UV_RUN_DEFAULT);
    return a;
}

/* A save of key (user u, room r) with travel.from = from, answered. */
static answer save(fake *f, cg_fallback *fb, const char *u, const char *r, const char *from)
{
    (void)fb;
    char err[64];
    cg_dialog d;
    cg_dialog_init(&d, f->now);
    json_t *p = json_pack("{s:s}", "from", from);
    cg_dialog_merge_params(&d, "travel", p, &f->st.cfg.lifetimes, err, sizeof(err));
    json_decref(p);
    answer a = {0};
    cg_fallback_dialog_ops.save(&f->st, u, r, &d, on_done, &a);
    cg_dialog_free(&d); /* the store shares its parts, never relies on this copy */
    uv_run(f->st.loop, UV_RUN_DEFAULT);
    return a;
}

static answer take(fake *f, const char *user, const cg_limits *lim, int abandon)
{
    answer a = {0};
    cg_store_req *r = cg_fallback_limit_ops.take(&f->st, user, lim, 1, on_limit, &a);
    if (abandon)
        cg_store_abandon(r);
    uv_run(f->st.loop, UV_RUN_DEFAULT);
    return a;
}

/* ---- the cases ------------------------------------------------------------------------------ */

static void test_outage_and_writeback(uv_loop_t *loop)
{
    fake f;
    cg_fallback *fb = fake_open(&f, loop, 100, 0);
    CHECK(!cg_fallback_degraded(fb));
    cg_fallback_down(fb, "connection refused");
    CHECK(cg_fallback_degraded(fb) && f.st.stats.degraded);

    answer s1 = save(&f, fb, "alice", "r1", "Nairobi");
    CHECK(s1.calls == 1 && s1.st.degraded && !s1.st.warn); /* a save's answer uses up no warning */
    CHECK(cg_fallback_is_dirty(fb, "alice:r1"));
    CHECK(f.st.stats.writeback_pending == 1 && f.st.stats.writeback_pending_bytes > 0);

    answer l1 = load(&f, "alice:r1");
    CHECK(l1.calls == 1 && l1.st.degraded && l1.st.warn && l1.st.found);
    CHECK_STR(l1.from, "Nairobi");
    answer l2 = load(&f, "alice:r1");
    CHECK(l2.st.degraded && !l2.st.warn && l2.st.found); /* warned once per dialog and outage */

    answer l3 = load(&f, "bob:r2"); /* never seen: the store's copy is unknown */
    CHECK(!l3.st.found && l3.st.warn);
    CHECK(cg_fallback_base_unknown(fb, "bob:r2"));
    save(&f, fb, "bob", "r2", "Mombasa");
    CHECK(f.st.stats.degraded_answers == 5);

    cg_fallback_up(fb, 0);
    CHECK(!cg_fallback_degraded(fb));
    CHECK(f.n == 2); /* each dirty dialog handed over once, oldest first */
    CHECK_STR(f.got[0].key, "alice:r1");
    CHECK_STR(f.got[0].from, "Nairobi");
    CHECK(!f.got[0].base_unknown);
    CHECK_STR(f.got[1].key, "bob:r2");
    CHECK(f.got[1].base_unknown); /* it must only create, never replace */
    CHECK(f.got[0].version != f.got[1].version);
    CHECK(!cg_fallback_base_unknown(fb, "bob:r2")); /* its write-back goes first */
    CHECK(cg_fallback_dirty_count(fb) == 2);         /* until answered */

    cg_fallback_written(fb, "alice:r1", f.got[0].version, 1);
    CHECK(!cg_fallback_is_dirty(fb, "alice:r1") && f.st.stats.flushed == 1);
    cg_fallback_written(fb, "bob:r2", f.got[1].version, 0); /* refused: the store kept its copy */
    cg_fallback_forget(fb, "bob:r2");
    CHECK(!cg_fallback_is_dirty(fb, "bob:r2") && f.st.stats.flushed == 1);
    CHECK(f.st.stats.writeback_pending == 0 && f.st.stats.writeback_pending_bytes == 0);
    answer again = load(&f, "bob:r2"); /* the next load reads the store's copy */
    CHECK(!again.st.degraded && f.asked == 1);
    CHECK_STR(again.from, "inner");

    cg_fallback_down(fb, "timeout");
    CHECK(load(&f, "alice:r1").st.warn); /* a new outage warns again */
    cg_fallback_up(fb, 0);
    fake_close(&f, fb);
}

static void test_newer_write_meanwhile(uv_loop_t *loop)
{
    fake f;
    cg_fallback *fb = fake_open(&f, loop, 100, 0);
    cg_fallback_down(fb, "down");
    save(&f, fb, "u", "r", "v1");
    cg_fallback_up(fb, 0);
    CHECK(f.n == 1);
    /* while its write-back is in flight the dialog is still served and written here */
    CHECK(cg_fallback_is_dirty(fb, "u:r"));
    save(&f, fb, "u", "r", "v2");
    /* one write-back of a dialog at a time: the newer waits for the older's answer, neither
     * the tick nor a reconnect sends it meanwhile (two ran at once, and made each other's
     * merges meet a newer copy) */
    cg_fallback_tick(fb, 5000);
    cg_fallback_up(fb, 0);
    CHECK(f.n == 1);
    cg_fallback_written(fb, "u:r", f.got[0].version, 1); /* the older one: the newer goes now */
    CHECK(f.n == 2 && f.got[1].version > f.got[0].version);
    CHECK_STR(f.got[1].from, "v2");
    CHECK(!f.got[1].base_unknown);
    CHECK(cg_fallback_is_dirty(fb, "u:r") && f.st.stats.flushed == 0);
    cg_fallback_written(fb, "u:r", f.got[1].version, 1);
    CHECK(!cg_fallback_is_dirty(fb, "u:r") && f.st.stats.flushed == 1);

    /* an older write-back refused while a newer write waits: the newer, turns answered since,
     * stays for its own write-back (the store merges it with its copy); it was dropped too */
    cg_fallback_down(fb, "down");
    save(&f, fb, "u", "r", "v3");
    cg_fallback_up(fb, 0);
    save(&f, fb, "u", "r", "v4");
    cg_fallback_written(fb, "u:r", f.got[2].version, 0);
    CHECK(cg_fallback_is_dirty(fb, "u:r") && f.n == 3);
    fake_close(&f, fb);
}

static void test_bounds_and_gone(uv_loop_t *loop)
{
    fake f;
    cg_fallback *fb = fake_open(&f, loop, 3, 0);
    cg_fallback_down(fb, "down");
    save(&f, fb, "u", "a", "1");
    save(&f, fb, "u", "b", "2");
    save(&f, fb, "u", "c", "3");
    save(&f, fb, "u", "d", "4");
    /* the least recently written went: a */
    CHECK(cg_fallback_dirty_count(fb) == 3 && f.st.stats.writeback_dropped_bound == 1);
    CHECK(!cg_fallback_is_dirty(fb, "u:a"));
    save(&f, fb, "u", "b", "5"); /* written again: the newest now, so c goes next */
    save(&f, fb, "u", "e", "6");
    CHECK(cg_fallback_dirty_count(fb) == 3 && f.st.stats.writeback_dropped_bound == 2);
    CHECK(!cg_fallback_is_dirty(fb, "u:c"));
    CHECK(cg_fallback_is_dirty(fb, "u:b") && cg_fallback_is_dirty(fb, "u:d") && cg_fallback_is_dirty(fb, "u:e"));
    fake_close(&f, fb);

    /* in bytes: one dialog's worth at most */
    fb = fake_open(&f, loop, 100, 300);
    cg_fallback_down(fb, "down");
    save(&f, fb, "u", "a", "1");
    save(&f, fb, "u", "b", "2");
    CHECK(cg_fallback_dirty_count(fb) == 1 && cg_fallback_is_dirty(fb, "u:b"));
    CHECK(f.st.stats.writeback_pending_bytes <= 300);
    fake_close(&f, fb);

    /* memory no longer holds it (its lifetime is up): never written blank over the store's */
    fb = fake_open(&f, loop, 100, 0);
    cg_fallback_down(fb, "down");
    save(&f, fb, "u", "a", "1");
    f.now += f.st.cfg.lifetimes.dialog_s + 1;
    cg_fallback_up(fb, 0);
    CHECK(f.n == 0 && f.st.stats.writeback_dropped_gone == 1 && cg_fallback_dirty_count(fb) == 0);
    fake_close(&f, fb);
}

static void test_failed_writeback_goes_again(uv_loop_t *loop)
{
    fake f;
    cg_fallback *fb = fake_open(&f, loop, 100, 0);
    cg_fallback_down(fb, "down");
    save(&f, fb, "u", "a", "1");
    f.refuse_start = 1; /* the backend cannot start it: stays dirty, not in flight */
    cg_fallback_up(fb, 0);
    CHECK(f.n == 0 && cg_fallback_is_dirty(fb, "u:a"));
    f.refuse_start = 0;
    cg_fallback_tick(fb, 5000);
    CHECK(f.n == 1);
    cg_fallback_tick(fb, 5500); /* in flight, and within the second: nothing */
    CHECK(f.n == 1);

    /* the store failed it (an error answer): sent again a second after the last round */
    unsigned long failed = f.st.stats.writeback_failed;
    cg_fallback_writeback_failed(fb, "u:a", f.got[0].version);
    CHECK(cg_fallback_is_dirty(fb, "u:a"));
    CHECK(f.st.stats.writeback_failed == failed + 1); /* /metrics: chatgate_store_writeback_failures_total */
    cg_fallback_tick(fb, 5900);
    CHECK(f.n == 1);
    cg_fallback_tick(fb, 6000);
    CHECK(f.n == 2 && f.got[1].version == f.got[0].version);

    /* nothing goes while the store is away */
    cg_fallback_writeback_failed(fb, "u:a", f.got[0].version);
    cg_fallback_down(fb, "down");
    cg_fallback_tick(fb, 9000);
    CHECK(f.n == 2);
    fake_close(&f, fb);
}

/* Closing while the store is up: the dialogs still marked go now (the store waits for them),
 * those in flight go on, a newer version after its older one; the store away, none goes. */
static void test_closing_writes_back(uv_loop_t *loop)
{
    fake f;
    cg_fallback *fb = fake_open(&f, loop, 100, 0);
    cg_fallback_down(fb, "down");
    save(&f, fb, "u", "a", "a1");
    save(&f, fb, "u", "b", "b1");
    cg_fallback_up(fb, 0);
    CHECK(f.n == 2);
    save(&f, fb, "u", "a", "a2");                            /* waits behind a1's write-back */
    cg_fallback_writeback_failed(fb, "u:b", f.got[1].version); /* waits for the tick's next round */
    cg_fallback_closing(fb, NULL, NULL);
    CHECK(f.n == 3); /* b again, at once; a's in flight goes on */
    CHECK_STR(f.got[2].key, "u:b");
    CHECK(f.got[2].version == f.got[1].version);
    cg_fallback_written(fb, "u:a", f.got[0].version, 1); /* closing, the newer goes still */
    CHECK(f.n == 4);
    CHECK_STR(f.got[3].from, "a2");
    cg_fallback_written(fb, "u:b", f.got[2].version, 1);
    cg_fallback_written(fb, "u:a", f.got[3].version, 1);
    CHECK(cg_fallback_dirty_count(fb) == 0 && f.st.stats.flushed == 2);
    cg_fallback_stop_writeback(fb, "all written back");
    fake_free(&f, fb);

    /* the store away: nothing goes, what is marked is lost at exit (said) */
    fb = fake_open(&f, loop, 100, 0);
    cg_fallback_down(fb, "down");
    save(&f, fb, "u", "a", "a1");
    cg_fallback_closing(fb, NULL, NULL);
    CHECK(f.n == 0 && cg_fallback_dirty_count(fb) == 1);
    cg_fallback_stop_writeback(fb, "the store is away");
    fake_free(&f, fb);
}

/* A save its store was still doing at closing counts as in flight (the store waits for it),
 * until answered: taken, it is done; failed, it is marked only then, after the closing, and
 * the store's tick writes it back. */
static void test_closing_waits_for_saves(uv_loop_t *loop)
{
    fake f;
    cg_fallback *fb = fake_open(&f, loop, 100, 0);
    char err[64];
    cg_dialog d;
    cg_dialog_init(&d, f.now);
    json_t *p = json_pack("{s:s}", "from", "a1");
    cg_dialog_merge_params(&d, "travel", p, &f.st.cfg.lifetimes, err, sizeof(err));
    json_decref(p);
    cg_fallback_dialog_ops.save(&f.st, "u", "a", &d, NULL, NULL); /* a turn's save: nobody waits */
    cg_fallback_dialog_ops.save(&f.st, "u", "b", &d, NULL, NULL);
    cg_dialog_free(&d);
    CHECK(cg_fallback_saves_in_flight(fb) == 2 && cg_fallback_dirty_count(fb) == 0);
    f.unavailable = 1; /* the store fails both (an error answer, or its link went) */
    cg_fallback_closing(fb, NULL, NULL);
    CHECK(cg_fallback_saves_in_flight(fb) == 2 && f.n == 0);
    uv_run(loop, UV_RUN_DEFAULT);
    CHECK(cg_fallback_saves_in_flight(fb) == 0 && cg_fallback_dirty_count(fb) == 2);
    f.unavailable = 0;
    cg_fallback_tick(fb, 5000);
    CHECK(f.n == 2);
    cg_fallback_written(fb, "u:a", f.got[0].version, 1);
    cg_fallback_written(fb, "u:b", f.got[1].version, 1);
    CHECK(cg_fallback_dirty_count(fb) == 0);
    cg_fallback_stop_writeback(fb, "all written back");
    fake_free(&f, fb);
}

static void test_rewrite_after_move(uv_loop_t *loop)
{
    fake f;
    cg_fallback *fb = fake_open(&f, loop, 100, 0);
    /* saved through the store, which kept its copy here */
    cg_dialog d;
    cg_dialog_init(&d, f.now);
    cg_memstore_keep(cg_fallback_copy(fb), "u:a", &d, f.now, "rev1", 0);
    cg_dialog_free(&d);
    cg_fallback_note_saved(fb, "u:a", "u", "a");
    cg_fallback_note_saved(fb, "u:gone", "u", "gone"); /* memory lost it: not written */
    cg_fallback_down(fb, "failover");
    cg_fallback_up(fb, 0); /* the same copy: nothing again */
    CHECK(f.n == 0);
    cg_fallback_note_saved(fb, "u:a", "u", "a");
    cg_fallback_down(fb, "failover");
    cg_fallback_up(fb, 1); /* another primary: what the old one took last goes again */
    CHECK(f.n == 1);
    CHECK_STR(f.got[0].key, "u:a");
    cg_fallback_written(fb, "u:a", f.got[0].version, 1);
    cg_fallback_down(fb, "failover");
    cg_fallback_up(fb, 1); /* noted once: the set was emptied */
    CHECK(f.n == 1);
    fake_close(&f, fb);
}

static int pick_u(void *ctx, const char *eu)
{
    (void)ctx;
    return strcmp(eu, "u") == 0;
}

/* A cluster master's slots went to its replica while the store stayed up: only the dialogs of
 * the users in them go again; the others stay noted for a later move. */
static void test_rewrite_after_part_moved(uv_loop_t *loop)
{
    fake f;
    cg_fallback *fb = fake_open(&f, loop, 100, 0);
    cg_dialog d;
    cg_dialog_init(&d, f.now);
    cg_memstore_keep(cg_fallback_copy(fb), "u:a", &d, f.now, "rev1", 0);
    cg_memstore_keep(cg_fallback_copy(fb), "v:b", &d, f.now, "rev1", 0);
    cg_dialog_free(&d);
    cg_fallback_note_saved(fb, "u:a", "u", "a");
    cg_fallback_note_saved(fb, "v:b", "v", "b");
    cg_fallback_moved(fb, pick_u, NULL);
    CHECK(f.n == 1);
    CHECK_STR(f.got[0].key, "u:a");
    cg_fallback_written(fb, "u:a", f.got[0].version, 1);
    cg_fallback_moved(fb, pick_u, NULL); /* u's was taken off the set */
    CHECK(f.n == 1);
    cg_fallback_down(fb, "failover");
    cg_fallback_up(fb, 1); /* a move of everything: v's, still noted, goes */
    CHECK(f.n == 2);
    CHECK_STR(f.got[1].key, "v:b");
    fake_close(&f, fb);
}

static void test_forget_user_and_abandoned(uv_loop_t *loop)
{
    fake f;
    cg_fallback *fb = fake_open(&f, loop, 100, 0);
    cg_fallback_down(fb, "down");
    f.unavailable = 1; /* as a store away answers what reaches it */
    save(&f, fb, "alice", "a", "1");
    save(&f, fb, "alice", "b", "2");
    save(&f, fb, "bob", "a", "3");

    cg_limits lim = {0};
    lim.messages_per_minute = 1;
    answer a = take(&f, "alice", &lim, 0);
    CHECK(a.calls == 1 && a.v.hit == CG_LIMIT_OK && a.st.degraded);
    a = take(&f, "alice", &lim, 0);
    CHECK(a.calls == 1 && a.v.hit != CG_LIMIT_OK); /* counted here while away */

    answer gone = {0};
    cg_fallback_dialog_ops.remove_user(&f.st, "alice", on_done, &gone);
    uv_run(loop, UV_RUN_DEFAULT);
    CHECK(gone.calls == 1 && gone.st.degraded);
    CHECK(cg_fallback_dirty_count(fb) == 1 && cg_fallback_is_dirty(fb, "bob:a"));
    CHECK(!load(&f, "alice:a").st.found);
    a = take(&f, "alice", &lim, 0); /* her counts went too */
    CHECK(a.calls == 1 && a.v.hit == CG_LIMIT_OK);

    /* a caller gone: no callback, and a limit not counted */
    answer late = take(&f, "carol", &lim, 1);
    CHECK(late.calls == 0);
    a = take(&f, "carol", &lim, 0);
    CHECK(a.calls == 1 && a.v.hit == CG_LIMIT_OK); /* the abandoned take was not counted */

    answer rooms_a = {0};
    cg_fallback_dialog_ops.rooms(&f.st, "bob", on_rooms, &rooms_a);
    uv_run(loop, UV_RUN_DEFAULT);
    CHECK(rooms_a.calls == 1 && rooms_a.st.degraded);
    CHECK_STR(rooms_a.from, "a"); /* memory's, not the inner store's */
    answer rm = {0};
    cg_fallback_dialog_ops.remove(&f.st, "bob", "a", on_done, &rm);
    uv_run(loop, UV_RUN_DEFAULT);
    CHECK(rm.calls == 1 && rm.st.degraded && cg_fallback_dirty_count(fb) == 0);
    CHECK(f.asked == 2); /* only the deletes reached the inner store while it was away (it
                          * forgets what it keeps of its own too) */

    /* the store is closing: nobody is called back */
    answer closing = {0};
    cg_fallback_lease_ops.acquire(&f.st, "bob", "a", on_load, &closing);
    fake_close(&f, fb);
    CHECK(closing.calls == 0);
}

/* While the store is up the wrapper only passes requests on; what the store could not do,
 * memory does; a dialog whose save the store failed is served here until its write-back. */
static void test_in_front_of_the_store(uv_loop_t *loop)
{
    fake f;
    cg_fallback *fb = fake_open(&f, loop, 100, 0);
    answer l = load(&f, "u:a");
    CHECK(l.calls == 1 && !l.st.degraded && l.st.found && f.asked == 1);
    CHECK_STR(l.from, "inner");
    answer s = save(&f, fb, "u", "a", "mine");
    CHECK(s.calls == 1 && !s.st.degraded && f.saved == 1 && !cg_fallback_is_dirty(fb, "u:a"));
    cg_limits lim = {0};
    lim.messages_per_minute = 1;
    answer t = take(&f, "u", &lim, 0);
    CHECK(t.calls == 1 && !t.st.degraded && f.asked == 3);
    answer ro = {0};
    cg_fallback_dialog_ops.rooms(&f.st, "u", on_rooms, &ro);
    uv_run(loop, UV_RUN_DEFAULT);
    CHECK_STR(ro.from, "inner");

    /* the store fails a save (an error answer, a timeout): kept here, dirty, and the next
     * load is memory's, without asking the store */
    f.unavailable = 1;
    s = save(&f, fb, "u", "a", "kept");
    CHECK(s.calls == 1 && s.st.degraded && cg_fallback_is_dirty(fb, "u:a"));
    f.unavailable = 0;
    int asked = f.asked;
    l = load(&f, "u:a");
    CHECK(l.st.degraded && l.st.found && f.asked == asked);
    CHECK_STR(l.from, "kept");
    int released = f.released;
    s = save(&f, fb, "u", "a", "kept2"); /* written here too until the write-back */
    CHECK(s.st.degraded && f.asked == asked);
    CHECK(f.released == released + 1); /* the save ends the turn's lease at the store */
    CHECK(f.n == 0); /* the tick writes it back (the store stayed up) */
    cg_fallback_tick(fb, 10000);
    CHECK(f.n == 1 && f.got[0].version > 0);
    CHECK_STR(f.got[0].from, "kept2");
    cg_fallback_written(fb, "u:a", f.got[0].version, 1);
    CHECK(!cg_fallback_is_dirty(fb, "u:a"));

    /* a load the store could not answer is memory's */
    f.unavailable = 1;
    l = load(&f, "v:b");
    CHECK(l.calls == 1 && l.st.degraded && l.st.warn && !l.st.found && f.asked == asked + 1);
    t = take(&f, "v", &lim, 0);
    CHECK(t.calls == 1 && t.st.degraded && t.v.local);
    f.unavailable = 0;

    /* a turn's load the store answered after the dialog went dirty (its save failed while the
     * load waited behind it): memory's answer, and the lease the store gave is let go */
    answer la = {0};
    cg_fallback_lease_ops.acquire(&f.st, "w", "c", on_load, &la);
    cg_dialog d;
    cg_dialog_init(&d, f.now);
    cg_fallback_down(fb, "a moment"); /* the save goes to memory now, dirty */
    answer sa = {0};
    cg_fallback_dialog_ops.save(&f.st, "w", "c", &d, on_done, &sa);
    cg_dialog_free(&d);
    f.refuse_start = 1; /* its write-back does not start: it stays dirty */
    cg_fallback_up(fb, 0);
    f.refuse_start = 0;
    uv_run(loop, UV_RUN_DEFAULT);
    CHECK(sa.calls == 1 && sa.st.degraded && cg_fallback_is_dirty(fb, "w:c"));
    CHECK(la.calls == 1 && la.st.degraded && f.released == released + 3); /* the save's, the load's */

    /* a caller gone while its load is at the store: the store's request is abandoned too */
    answer gone = {0};
    cg_store_req *r = cg_fallback_lease_ops.acquire(&f.st, "x", "d", on_load, &gone);
    cg_store_abandon(r);
    uv_run(loop, UV_RUN_DEFAULT);
    CHECK(gone.calls == 0 && f.abandoned == 1);

    /* a delete behind a save at the store, both failed: the save is kept, then the delete
     * done here again, so the deleted dialog is never written back */
    cg_dialog_init(&d, f.now);
    f.unavailable = 1;
    answer sz = {0}, rz = {0};
    cg_fallback_dialog_ops.save(&f.st, "r", "z", &d, on_done, &sz);
    cg_fallback_dialog_ops.remove(&f.st, "r", "z", on_done, &rz);
    cg_dialog_free(&d);
    uv_run(loop, UV_RUN_DEFAULT);
    f.unavailable = 0;
    CHECK(sz.calls == 1 && rz.calls == 1 && rz.st.degraded);
    CHECK(!cg_fallback_is_dirty(fb, "r:z"));

    /* a save the store had merged with its own copy before failing: memory keeps the merge */
    char err[64];
    cg_dialog md;
    cg_dialog_init(&md, f.now);
    json_t *p = json_pack("{s:s}", "from", "merged");
    cg_dialog_merge_params(&md, "travel", p, &f.st.cfg.lifetimes, err, sizeof(err));
    json_decref(p);
    f.unsaved = &md;
    f.unavailable = 1;
    s = save(&f, fb, "m", "n", "mine");
    f.unavailable = 0;
    f.unsaved = NULL;
    cg_dialog_free(&md);
    l = load(&f, "m:n");
    CHECK(s.st.degraded && l.st.degraded);
    CHECK_STR(l.from, "merged");

    /* a turn's end: the store's when it counted the turn and is up, else memory's */
    cg_fallback_limit_ops.end(&f.st, "v", &lim, 1, 0, 10);
    CHECK(f.ended == 1);
    cg_fallback_limit_ops.end(&f.st, "v", &lim, 2, 1, 10); /* counted here: ends here */
    cg_fallback_down(fb, "down");
    cg_fallback_limit_ops.end(&f.st, "v", &lim, 3, 0, 10); /* the store away */
    CHECK(f.ended == 1);
    cg_fallback_up(fb, 0);

    /* each request counted once, by the wrapper */
    CHECK(f.st.stats.loads == 6 && f.st.stats.saves == 6 && f.st.stats.deletes == 1);
    fake_close(&f, fb);
}

int main(void)
{
    uv_loop_t loop;
    uv_loop_init(&loop);
    test_outage_and_writeback(&loop);
    test_newer_write_meanwhile(&loop);
    test_bounds_and_gone(&loop);
    test_failed_writeback_goes_again(&loop);
    test_closing_writes_back(&loop);
    test_closing_waits_for_saves(&loop);
    test_rewrite_after_move(&loop);
    test_rewrite_after_part_moved(&loop);
    test_forget_user_and_abandoned(&loop);
    test_in_front_of_the_store(&loop);
    uv_loop_close(&loop);
    return unit_done("fallback");
}
