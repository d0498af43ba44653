/*
 * test_fallback.c: degraded mode (fallback.c) around a fake store, on a real uv loop, with
 * an injected clock and no socket: answers from memory while the store is away (the
 * warning once per dialog and outage, a dialog never seen marked as of unknown base), the
 * write-back when it returns (each dirty dialog handed to the backend once, with its version;
 * a newer write made meanwhile sent when the older one is answered; a refused one dropped;
 * one memory no longer holds never written), the bounds of the dirty set, a failed
 * write-back sent again by the tick, the rewrite after a move, forgetting a user, and
 * requests whose caller left.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chatgate/store/fallback.h"
#include "chatgate/store/store.h"
#include "unit.h"

/* ---- the fake store: a clock and a backend that records the write-backs ----------------- */

typedef struct written_rec {
    char key[64];
    long version;
    int base_unknown;
    char from[32]; /* the dialog's travel.from, to tell versions apart */
} written_rec;

typedef struct fake {
    cg_store st;
    int64_t now;      /* the store's clock, unix seconds */
    int refuse_start; /* the backend cannot start a write-back */
    written_rec got[32];
    int n;
} fake;

static int64_t fake_now(void *ctx)
{
    return ((fake *)ctx)->now;
}

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
    return cg_fallback_new(&f->st, "fake store", &fake_ops, f);
}

/* ---- requests, as a store hands them over -------------------------------------------------- */

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

static answer load(cg_fallback *fb, const char *key)
{
    answer a = {0};
    cg_store_req req = {.ctx = &a, .kind = CG_STORE_LOAD, .cb.load = on_load};
    cg_fallback_subject s = {.key = key};
    cg_fallback_answer_req(fb, &req, &s, 0);
    return a;
}

/* A save of key (user u, room r) with travel.from = from, answered from memory. */
static answer save(fake *f, cg_fallback *fb, const char *u, const char *r, const char *from)
{
    char key[64], err[64];
    snprintf(key, sizeof(key), "%s:%s", u, r);
    cg_dialog d;
    cg_dialog_init(&d, f->now);
    json_t *p = json_pack("{s:s}", "from", from);
    cg_dialog_merge_params(&d, "travel", p, &f->st.cfg.lifetimes, err, sizeof(err));
    json_decref(p);
    answer a = {0};
    cg_store_req req = {.ctx = &a, .kind = CG_STORE_SAVE, .cb.done = on_done};
    cg_fallback_subject s = {.key = key, .eu = u, .er = r, .snapshot = &d};
    cg_fallback_answer_req(fb, &req, &s, 0);
    cg_dialog_free(&d);
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

    answer l1 = load(fb, "alice:r1");
    CHECK(l1.calls == 1 && l1.st.degraded && l1.st.warn && l1.st.found);
    CHECK_STR(l1.from, "Nairobi");
    answer l2 = load(fb, "alice:r1");
    CHECK(l2.st.degraded && !l2.st.warn && l2.st.found); /* warned once per dialog and outage */

    answer l3 = load(fb, "bob:r2"); /* never seen: the store's copy is unknown */
    CHECK(!l3.st.found && l3.st.warn);
    CHECK(cg_fallback_base_unknown(fb, "bob:r2"));
    save(&f, fb, "bob", "r2", "Mombasa");
    CHECK(f.st.stats.degraded_answers == 5);

    cg_fallback_up(fb, 0);
    CHECK(!cg_fallback_degraded(fb) && f.st.stats.degraded_seconds >= 0);
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
    int found = load(fb, "bob:r2").st.found; /* the next load reads the store's copy */
    CHECK(!found);

    cg_fallback_down(fb, "timeout");
    CHECK(load(fb, "alice:r1").st.warn); /* a new outage warns again */
    cg_fallback_up(fb, 0);
    cg_fallback_free(fb);
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
    cg_fallback_written(fb, "u:r", f.got[0].version, 1); /* the older one: the newer goes now */
    CHECK(f.n == 2 && f.got[1].version > f.got[0].version);
    CHECK_STR(f.got[1].from, "v2");
    CHECK(!f.got[1].base_unknown);
    CHECK(cg_fallback_is_dirty(fb, "u:r") && f.st.stats.flushed == 0);
    cg_fallback_written(fb, "u:r", f.got[1].version, 1);
    CHECK(!cg_fallback_is_dirty(fb, "u:r") && f.st.stats.flushed == 1);

    /* an older write-back refused while a newer write waits: both are dropped */
    cg_fallback_down(fb, "down");
    save(&f, fb, "u", "r", "v3");
    cg_fallback_up(fb, 0);
    save(&f, fb, "u", "r", "v4");
    cg_fallback_written(fb, "u:r", f.got[2].version, 0);
    CHECK(!cg_fallback_is_dirty(fb, "u:r") && f.n == 3);
    cg_fallback_free(fb);
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
    cg_fallback_free(fb);

    /* in bytes: one dialog's worth at most */
    fb = fake_open(&f, loop, 100, 300);
    cg_fallback_down(fb, "down");
    save(&f, fb, "u", "a", "1");
    save(&f, fb, "u", "b", "2");
    CHECK(cg_fallback_dirty_count(fb) == 1 && cg_fallback_is_dirty(fb, "u:b"));
    CHECK(f.st.stats.writeback_pending_bytes <= 300);
    cg_fallback_free(fb);

    /* memory no longer holds it (its lifetime is up): never written blank over the store's */
    fb = fake_open(&f, loop, 100, 0);
    cg_fallback_down(fb, "down");
    save(&f, fb, "u", "a", "1");
    f.now += f.st.cfg.lifetimes.dialog_s + 1;
    cg_fallback_up(fb, 0);
    CHECK(f.n == 0 && f.st.stats.writeback_dropped_gone == 1 && cg_fallback_dirty_count(fb) == 0);
    cg_fallback_free(fb);
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
    cg_store_req req = {.kind = CG_STORE_SAVE};
    cg_fallback_subject s = {.key = "u:a", .eu = "u", .er = "a", .version = f.got[0].version};
    cg_fallback_answer_req(fb, &req, &s, 0);
    CHECK(cg_fallback_is_dirty(fb, "u:a"));
    cg_fallback_tick(fb, 5900);
    CHECK(f.n == 1);
    cg_fallback_tick(fb, 6000);
    CHECK(f.n == 2 && f.got[1].version == f.got[0].version);

    /* nothing goes while the store is away */
    cg_fallback_answer_req(fb, &req, &s, 0);
    cg_fallback_down(fb, "down");
    cg_fallback_tick(fb, 9000);
    CHECK(f.n == 2);
    cg_fallback_free(fb);
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
    cg_fallback_free(fb);
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
    cg_fallback_free(fb);
}

static void test_forget_user_and_abandoned(uv_loop_t *loop)
{
    fake f;
    cg_fallback *fb = fake_open(&f, loop, 100, 0);
    cg_fallback_down(fb, "down");
    save(&f, fb, "alice", "a", "1");
    save(&f, fb, "alice", "b", "2");
    save(&f, fb, "bob", "a", "3");

    cg_limits lim = {0};
    lim.messages_per_minute = 1;
    answer a = {0};
    cg_store_req req = {.ctx = &a, .kind = CG_STORE_LIMIT, .cb.limit = on_limit};
    cg_fallback_subject s = {.key = "alice:", .eu = "alice", .limits = &lim};
    cg_fallback_answer_req(fb, &req, &s, 0);
    CHECK(a.calls == 1 && a.v.hit == CG_LIMIT_OK && a.st.degraded);
    cg_fallback_answer_req(fb, &req, &s, 0);
    CHECK(a.calls == 2 && a.v.hit != CG_LIMIT_OK); /* counted here while away */

    answer gone = {0};
    cg_store_req rm = {.ctx = &gone, .kind = CG_STORE_REMOVE_USER, .cb.done = on_done};
    cg_fallback_subject su = {.key = "alice:", .eu = "alice", .user = "alice"};
    cg_fallback_answer_req(fb, &rm, &su, 0);
    CHECK(gone.calls == 1 && gone.st.degraded);
    CHECK(cg_fallback_dirty_count(fb) == 1 && cg_fallback_is_dirty(fb, "bob:a"));
    CHECK(!load(fb, "alice:a").st.found);
    cg_fallback_answer_req(fb, &req, &s, 0); /* her counts went too */
    CHECK(a.calls == 3 && a.v.hit == CG_LIMIT_OK);

    /* a caller gone: no callback, and a limit not counted */
    answer late = {0};
    cg_store_req lr = {.ctx = &late, .abandoned = 1, .kind = CG_STORE_LIMIT, .cb.limit = on_limit};
    cg_fallback_answer_req(fb, &lr, &s, 0);
    cg_store_req ld = {.ctx = &late, .kind = CG_STORE_LOAD, .cb.load = on_load};
    cg_fallback_subject sl = {.key = "bob:a"};
    cg_fallback_answer_req(fb, &ld, &sl, 1); /* the store is closing */
    CHECK(late.calls == 0);
    cg_fallback_answer_req(fb, &req, &s, 0);
    CHECK(a.calls == 4 && a.v.hit != CG_LIMIT_OK); /* the abandoned take was not counted */

    answer rooms_a = {0};
    cg_store_req rr = {.ctx = &rooms_a, .kind = CG_STORE_REMOVE, .cb.done = on_done};
    cg_fallback_subject sr = {.key = "bob:a"};
    cg_fallback_answer_req(fb, &rr, &sr, 0);
    CHECK(rooms_a.calls == 1 && cg_fallback_dirty_count(fb) == 0);
    cg_fallback_free(fb);
}

int main(void)
{
    uv_loop_t loop;
    uv_loop_init(&loop);
    test_outage_and_writeback(&loop);
    test_newer_write_meanwhile(&loop);
    test_bounds_and_gone(&loop);
    test_failed_writeback_goes_again(&loop);
    test_rewrite_after_move(&loop);
    test_rewrite_after_part_moved(&loop);
    test_forget_user_and_abandoned(&loop);
    uv_loop_close(&loop);
    return unit_done("fallback");
}
