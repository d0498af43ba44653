/*
 * test_wsconn.c: a connection's plumbing (core/wsconn.h) on a real libuv loop and flusher,
 * with a fake socket (its io table) that records what is written: frames leave in order,
 * several in one send on the server side and masked on the client side; a full socket waits
 * for the writable callback; a held frame holds the ones behind it until released, and can
 * be taken out; a close frame ends the queue, goes only from the writable callback, and the
 * connection goes at the writable after it; a gone socket takes nothing, its frames kept; a close asked before the socket opens waits for
 * it; the water marks tell the owner once per change; max_frames bounds the queue; a lazy
 * frame is made as it is written; a lone frame waits for company, or for its time; a failed
 * write outside the callbacks reaches the owner; reading is paused, kept while not open;
 * peers' close frames are checked.
 */
#include <string.h>
#include <uv.h>

#include "chatgate/core/flush.h"
#include "chatgate/core/wsconn.h"
#include "unit.h"

static uv_loop_t loop;
static cg_flusher flusher;
static cg_net net;
static cg_net_batch batch;

/* ---- the fake socket --------------------------------------------------------------------- */

static char log_[4096]; /* what was written: "T:text|", "B:bin|", "S:n|" (a send of n frames), "C:code:reason|" */
static int partial, fail_writes, writable_asked, rx_enabled = -1, close_secs, writes;

static void note(const char *fmt, const char *s, size_t len)
{
    size_t used = strlen(log_);
    snprintf(log_ + used, sizeof(log_) - used, fmt, (int)len, s);
}

/* Reads the RFC 6455 frames in bytes (masked ones unmasked): each noted; their count. */
static int note_frames(const unsigned char *p, size_t len)
{
    int n = 0;
    for (size_t i = 0; i < len; n++) {
        int binary = (p[i] & 0x0f) == 2, masked = p[i + 1] & 0x80;
        size_t plen = p[i + 1] & 0x7f, h = 2;
        if (plen == 126) {
            plen = (size_t)p[i + 2] << 8 | p[i + 3];
            h = 4;
        }
        const unsigned char *key = p + i + h;
        h += masked ? 4 : 0;
        char payload[2048];
        for (size_t j = 0; j < plen && j < sizeof(payload); j++)
            payload[j] = (char)(masked ? p[i + h + j] ^ key[j & 3] : p[i + h + j]);
        note(binary ? "B:%.*s|" : "T:%.*s|", payload, plen);
        i += h + plen;
    }
    return n;
}

static int fake_write(cg_wsconn *c, unsigned char *data, size_t len, int kind)
{
    (void)c;
    writes++;
    if (fail_writes)
        return -1;
    if (kind == LWS_WRITE_HTTP) {
        char head[16];
        int n = note_frames(data, len);
        snprintf(head, sizeof(head), "S:%d|", n);
        note("%.*s", head, strlen(head));
    } else {
        note(kind == LWS_WRITE_BINARY ? "B:%.*s|" : "T:%.*s|", (const char *)data, len);
    }
    return (int)len;
}

static int fake_write_close(cg_wsconn *c, int code, const char *reason)
{
    (void)c;
    char s[160];
    snprintf(s, sizeof(s), "C:%d:%s|", code, reason);
    note("%.*s", s, strlen(s));
    return 0;
}

static int fake_partial(cg_wsconn *c)
{
    (void)c;
    return partial;
}

static void fake_want_writable(cg_wsconn *c)
{
    (void)c;
    writable_asked++;
}

static void fake_rx_flow(cg_wsconn *c, int enable)
{
    (void)c;
    rx_enabled = enable;
}

static void fake_close_within(cg_wsconn *c, int secs)
{
    (void)c;
    close_secs = secs;
}

static const cg_wsconn_io fake_io = {fake_write, fake_write_close, fake_partial, fake_want_writable, fake_rx_flow,
                                     fake_close_within};

/* ---- the owner --------------------------------------------------------------------------- */

static int flows, last_full, last_overfull, lost;

static void owner_flow(cg_wsconn *c, int full, int overfull)
{
    (void)c;
    flows++;
    last_full = full;
    last_overfull = overfull;
}

/* A lazy frame: text the owner grows, made into "<text>!" when written. */
typedef struct lazy {
    cg_wsframe f;
    char text[256];
} lazy;

static void owner_finish(cg_wsconn *c, cg_wsframe *f)
{
    (void)c;
    lazy *z = (lazy *)f;
    size_t n = strlen(z->text);
    f->buf = malloc(CG_WS_PRE + n + 2);
    memcpy(f->buf + CG_WS_PRE, z->text, n);
    memcpy(f->buf + CG_WS_PRE + n, "!", 2);
    f->len = n + 1;
}

static int frames_freed;

static void owner_free(cg_wsframe *f)
{
    frames_freed++;
    free(f->buf);
    free(f);
}

static void owner_lost(cg_wsconn *c)
{
    (void)c;
    lost++;
}

static const cg_wsconn_ops owner_ops = {owner_flow, owner_finish, owner_lost};

static struct lws *const fake_wsi = (struct lws *)&fake_io; /* never dereferenced: the io is fake */

static void reset(cg_wsconn *c, cg_ws_role role)
{
    log_[0] = 0;
    partial = fail_writes = writable_asked = close_secs = writes = 0;
    rx_enabled = -1;
    flows = last_full = last_overfull = lost = frames_freed = 0;
    cg_wsconn_init(c, role, &net, &owner_ops, NULL);
    c->io = &fake_io;
    c->batch = role == CG_WS_SERVER ? &batch : NULL;
}

static void turn_loop(void)
{
    uv_run(&loop, UV_RUN_NOWAIT);
}

/* ---- the cases --------------------------------------------------------------------------- */

static void test_order_and_batch(void)
{
    cg_wsconn c;
    unsigned long out = 0;
    reset(&c, CG_WS_SERVER);
    c.frames_out = &out;
    cg_wsconn_send(&c, "a", 1, 0);
    cg_wsconn_send(&c, "b", 1, 0);
    turn_loop();
    CHECK_STR(log_, ""); /* not open yet */
    cg_wsconn_open(&c, fake_wsi);
    cg_wsconn_send(&c, "c", 1, 1);
    turn_loop();
    CHECK_STR(log_, "T:a|T:b|B:c|S:3|"); /* one send, in order */
    CHECK(out == 3 && c.bytes == 0 && c.n == 0 && writes == 1);
    log_[0] = 0;
    cg_wsconn_send(&c, "alone", 5, 0);
    turn_loop();
    CHECK_STR(log_, "T:alone|");
    cg_wsconn_clear(&c);
}

static void test_full_socket(void)
{
    cg_wsconn c;
    reset(&c, CG_WS_SERVER);
    cg_wsconn_open(&c, fake_wsi);
    partial = 1;
    writable_asked = 0;
    cg_wsconn_send(&c, "x", 1, 0);
    turn_loop();
    CHECK_STR(log_, "");
    CHECK(writable_asked == 1);
    partial = 0;
    CHECK(cg_wsconn_writable(&c) == 0);
    CHECK_STR(log_, "T:x|");
    cg_wsconn_clear(&c);
}

static void test_held(void)
{
    cg_wsconn c;
    reset(&c, CG_WS_CLIENT);
    cg_wsconn_open(&c, fake_wsi);
    cg_wsconn_send(&c, "first", 5, 0);
    cg_wsframe *h = cg_wsframe_new("chat", 4, 0);
    h->held = 1;
    cg_wsconn_push(&c, h);
    cg_wsconn_send(&c, "after", 5, 0);
    turn_loop();
    CHECK_STR(log_, "T:first|S:1|"); /* masked, one send each */
    CHECK(c.n == 2 && c.bytes == 9);
    char *buf = malloc(CG_WS_PRE + 12);
    memcpy(buf + CG_WS_PRE, "chat+object", 11);
    cg_wsconn_release(&c, h, buf, 11);
    CHECK(c.bytes == 16);
    turn_loop();
    CHECK_STR(log_, "T:first|S:1|T:chat+object|S:1|T:after|S:1|");
    /* a held frame taken out: the ones behind it go */
    log_[0] = 0;
    h = cg_wsframe_new("refused", 7, 0);
    h->held = 1;
    cg_wsconn_push(&c, h);
    cg_wsconn_send(&c, "next", 4, 0);
    turn_loop();
    CHECK_STR(log_, "");
    cg_wsconn_remove(&c, h);
    turn_loop();
    CHECK_STR(log_, "T:next|S:1|");
    CHECK(c.bytes == 0 && c.n == 0);
    cg_wsconn_clear(&c);
}

static void test_close(void)
{
    cg_wsconn c;
    reset(&c, CG_WS_SERVER);
    cg_wsconn_open(&c, fake_wsi);
    cg_wsconn_send(&c, "last", 4, 0);
    cg_wsconn_close(&c, 1001, "going away");
    cg_wsconn_close(&c, 1000, "again"); /* one close frame */
    CHECK(cg_wsconn_send(&c, "late", 4, 0) < 0);
    CHECK(close_secs == CG_WSCONN_CLOSE_WAIT_S);
    turn_loop();
    CHECK_STR(log_, "T:last|"); /* the close frame waits for the writable callback */
    CHECK(cg_wsconn_writable(&c) == 0);
    CHECK_STR(log_, "T:last|C:1001:going away|");
    CHECK(c.state == CG_WSCONN_CLOSE_SENT);
    CHECK(cg_wsconn_writable(&c) < 0); /* the connection goes */
    CHECK(cg_wsconn_send(&c, "later", 5, 0) < 0);
    cg_wsconn_clear(&c);

    /* asked before the socket opened: written once it is */
    reset(&c, CG_WS_CLIENT);
    cg_wsconn_send(&c, "q", 1, 0);
    cg_wsconn_close(&c, 1001, "client left");
    CHECK(close_secs == 0);
    cg_wsconn_open(&c, fake_wsi);
    CHECK(close_secs == CG_WSCONN_CLOSE_WAIT_S && writable_asked > 0);
    CHECK(cg_wsconn_writable(&c) == 0);
    CHECK_STR(log_, "T:q|S:1|C:1001:client left|");
    cg_wsconn_clear(&c);

    /* the socket gone: nothing more is written or taken; a held frame stays its owner's
     * to release or remove until the queue is cleared */
    reset(&c, CG_WS_CLIENT);
    cg_wsconn_open(&c, fake_wsi);
    cg_wsframe *h = cg_wsframe_new("held", 4, 0);
    h->held = 1;
    cg_wsconn_push(&c, h);
    cg_wsconn_gone(&c);
    CHECK(cg_wsconn_send(&c, "late", 4, 0) < 0);
    cg_wsconn_release(&c, h, NULL, 0);
    turn_loop();
    CHECK_STR(log_, "");
    CHECK(c.n == 1);
    cg_wsconn_remove(&c, h);
    CHECK(c.n == 0 && c.bytes == 0);
    cg_wsconn_clear(&c);

    /* an answer to a bad close frame: now */
    reset(&c, CG_WS_SERVER);
    cg_wsconn_open(&c, fake_wsi);
    cg_wsconn_send(&c, "unsent", 6, 0);
    cg_wsconn_close_now(&c, 1002, "invalid close frame");
    CHECK_STR(log_, "C:1002:invalid close frame|");
    CHECK(cg_wsconn_writable(&c) < 0);
    cg_wsconn_clear(&c);
}

static void test_marks(void)
{
    cg_wsconn c;
    reset(&c, CG_WS_SERVER);
    size_t w = 60 + CG_WSFRAME_COST; /* what a frame of 60 bytes counts for */
    c.high = w + w / 2;
    char data[100];
    memset(data, 'x', sizeof(data));
    cg_wsconn_send(&c, data, 60, 0);
    CHECK(flows == 0);
    cg_wsconn_send(&c, data, 60, 0);
    CHECK(flows == 1 && last_full == 1 && last_overfull == 0);
    cg_wsconn_send(&c, data, 60, 0);
    CHECK(flows == 1); /* 3w: full still, not overfull */
    cg_wsconn_send(&c, data, 30, 0);
    CHECK(flows == 2 && last_full == 1 && last_overfull == 1);
    cg_wsconn_open(&c, fake_wsi);
    turn_loop();
    CHECK(flows == 3 && last_full == 0 && last_overfull == 0 && c.bytes == 0);
    cg_wsconn_clear(&c);

    /* empty frames fill a queue too (a peer's, relayed): each counts its cost */
    reset(&c, CG_WS_SERVER);
    c.high = 10 * CG_WSFRAME_COST;
    for (int i = 0; i < 11; i++)
        cg_wsconn_send(&c, "", 0, 0);
    CHECK(flows == 1 && last_full == 1 && c.bytes == 0);
    cg_wsconn_clear(&c);

    reset(&c, CG_WS_CLIENT);
    c.max_frames = 2;
    CHECK(cg_wsconn_send(&c, "1", 1, 0) == 0);
    CHECK(cg_wsconn_send(&c, "2", 1, 0) == 0);
    CHECK(cg_wsconn_send(&c, "3", 1, 0) < 0);
    CHECK(c.n == 2);
    cg_wsconn_clear(&c);
}

static void test_lazy_and_spare(void)
{
    cg_wsconn c;
    reset(&c, CG_WS_SERVER);
    cg_wsconn_open(&c, fake_wsi);
    lazy *z = calloc(1, sizeof(*z));
    z->f.destroy = owner_free;
    strcpy(z->text, "he");
    z->f.len = 2;
    cg_wsconn_push(&c, &z->f);
    strcat(z->text, "llo");
    cg_wsconn_grew(&c, 3);
    CHECK(c.bytes == 5);
    cg_wsconn_send(&c, "done", 4, 0);
    turn_loop();
    CHECK_STR(log_, "T:hello!|T:done|S:2|");
    CHECK(c.bytes == 0 && frames_freed == 1);
    cg_wsconn_clear(&c);

    reset(&c, CG_WS_CLIENT);
    cg_wsconn_open(&c, fake_wsi);
    char *buf = malloc(CG_WS_PRE + 64);
    memcpy(buf + CG_WS_PRE, "kept", 4);
    cg_wsconn_push(&c, cg_wsframe_adopt(buf, 4, CG_WS_PRE + 64, 0));
    turn_loop();
    size_t cap = 0;
    char *spare = cg_wsconn_spare(&c, &cap);
    CHECK(spare == buf && cap == CG_WS_PRE + 64);
    CHECK(cg_wsconn_spare(&c, &cap) == NULL && cap == 0);
    free(spare);
    cg_wsconn_clear(&c);
}

static void on_guard(uv_timer_t *t)
{
    (void)t;
}

static void test_lone_frame(void)
{
    cg_wsconn c;
    reset(&c, CG_WS_SERVER);
    cg_wsconn_open(&c, fake_wsi);
    cg_wsconn_send(&c, "ack", 3, 0);
    cg_wsconn_wait(&c, 20);
    turn_loop();
    CHECK_STR(log_, ""); /* waits for company */
    cg_wsconn_send(&c, "delta", 5, 0);
    turn_loop();
    CHECK_STR(log_, "T:ack|T:delta|S:2|");

    log_[0] = 0;
    cg_wsconn_send(&c, "ack2", 4, 0);
    cg_wsconn_wait(&c, 20);
    uv_timer_t guard;
    uv_timer_init(&loop, &guard);
    uv_timer_start(&guard, on_guard, 1000, 0);
    uint64_t start = uv_now(&loop);
    while (!log_[0] && uv_now(&loop) - start < 1000)
        uv_run(&loop, UV_RUN_ONCE);
    CHECK_STR(log_, "T:ack2|"); /* its time passed */
    CHECK(uv_now(&loop) - start >= 19);
    uv_close((uv_handle_t *)&guard, NULL);
    turn_loop();
    cg_wsconn_clear(&c);
}

static void test_failures_and_reading(void)
{
    cg_wsconn c;
    reset(&c, CG_WS_SERVER);
    cg_wsconn_pause_rx(&c, 1);
    CHECK(rx_enabled == -1); /* not open: kept */
    cg_wsconn_open(&c, fake_wsi);
    CHECK(rx_enabled == 0);
    cg_wsconn_pause_rx(&c, 0);
    CHECK(rx_enabled == 1);
    fail_writes = 1;
    cg_wsconn_send(&c, "x", 1, 0);
    turn_loop();
    CHECK(lost == 1);
    fail_writes = 0;
    cg_wsconn_send(&c, "y", 1, 0);
    CHECK(cg_wsconn_writable(&c) == 0);
    CHECK_STR(log_, "T:y|");

    const char *msg;
    size_t len;
    CHECK(cg_wsconn_receive(&c, 1, 0, "hel", 3, 10, &msg, &len) == 0);
    CHECK(cg_wsconn_receive(&c, 0, 1, "lo", 2, 10, &msg, &len) == 1);
    CHECK(msg && len == 5 && memcmp(msg, "hello", 5) == 0);
    cg_wsconn_received(&c);
    CHECK(cg_wsconn_receive(&c, 1, 1, "too long for it", 15, 10, &msg, &len) == 1 && !msg);
    cg_wsconn_received(&c);
    cg_wsconn_clear(&c);

    CHECK(cg_ws_close_check("", 0) == 0);
    CHECK(cg_ws_close_check("\x03", 1) == 1002);
    CHECK(cg_ws_close_check("\x03\xe8ok", 4) == 0);           /* 1000 */
    CHECK(cg_ws_close_check("\x03\xed", 2) == 1002);          /* 1005 may not be sent */
    CHECK(cg_ws_close_check("\x13\x88", 2) == 1002);          /* 5000 */
    CHECK(cg_ws_close_check("\x0f\xa0\xff", 3) == 1007);      /* 4000, a reason not UTF-8 */
}

int main(void)
{
    uv_loop_init(&loop);
    cg_flusher_init(&flusher, &loop);
    net.loop = &loop;
    net.flush = &flusher;
    test_order_and_batch();
    test_full_socket();
    test_held();
    test_close();
    test_marks();
    test_lazy_and_spare();
    test_lone_frame();
    test_failures_and_reading();
    cg_flusher_close(&flusher);
    uv_run(&loop, UV_RUN_DEFAULT);
    uv_loop_close(&loop);
    cg_net_batch_free(&batch);
    return unit_done("wsconn");
}
