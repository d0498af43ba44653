/*
 * wsconn.c: one WebSocket connection's frame queue, writes, close, marks and reading (see
 * wsconn.h).
 */
#include "chatgate/core/wsconn.h"

#include <stdlib.h>
#include <string.h>

#include "chatgate/core/alloc.h"
#include "chatgate/core/utf8.h"

_Static_assert(CG_WS_PRE >= LWS_PRE && CG_WS_PRE >= CG_NET_CLIENT_HEAD,
               "a frame's headroom holds lws's LWS_PRE, and a client frame's header");

/* ---- lws's socket ------------------------------------------------------------------------ */

static int lws_io_write(cg_wsconn *c, unsigned char *data, size_t len, int kind)
{
    return lws_write(c->wsi, data, len, (enum lws_write_protocol)kind);
}

static int lws_io_write_close(cg_wsconn *c, int code, const char *reason)
{
    return cg_net_write_close(c->wsi, code, reason);
}

static int lws_io_partial(cg_wsconn *c)
{
    return lws_partial_buffered(c->wsi);
}

static void lws_io_want_writable(cg_wsconn *c)
{
    lws_callback_on_writable(c->wsi);
}

static void lws_io_rx_flow(cg_wsconn *c, int enable)
{
    lws_rx_flow_control(c->wsi, enable);
}

static void lws_io_close_within(cg_wsconn *c, int secs)
{
    lws_set_timeout(c->wsi, PENDING_TIMEOUT_CLOSE_SEND, secs);
}

const cg_wsconn_io cg_wsconn_lws_io = {
    .write = lws_io_write,
    .write_close = lws_io_write_close,
    .partial = lws_io_partial,
    .want_writable = lws_io_want_writable,
    .rx_flow = lws_io_rx_flow,
    .close_within = lws_io_close_within,
};

/* ---- frames ------------------------------------------------------------------------------ */

cg_wsframe *cg_wsframe_adopt(char *buf, size_t len, size_t cap, int binary)
{
    cg_wsframe *f = cg_calloc(1, sizeof(*f));
    f->buf = buf;
    f->len = len;
    f->cap = cap;
    f->binary = binary;
    return f;
}

cg_wsframe *cg_wsframe_new(const void *data, size_t len, int binary)
{
    char *buf = cg_malloc(CG_WS_PRE + len + 1);
    if (len)
        memcpy(buf + CG_WS_PRE, data, len);
    buf[CG_WS_PRE + len] = 0; /* a close frame's reason is a C string */
    return cg_wsframe_adopt(buf, len, 0, binary);
}

void cg_wsframe_free(cg_wsframe *f)
{
    if (f->destroy) {
        f->destroy(f);
        return;
    }
    free(f->buf);
    free(f);
}

/* ---- the queue --------------------------------------------------------------------------- */

void cg_wsconn_init(cg_wsconn *c, cg_ws_role role, const cg_net *net, const cg_wsconn_ops *ops, void *owner)
{
    memset(c, 0, sizeof(*c));
    c->role = role;
    c->net = net;
    c->ops = ops;
    c->owner = owner;
    c->io = &cg_wsconn_lws_io;
    c->state = CG_WSCONN_WAITING;
}

/* The marks: full past high until under a quarter of it, overfull past twice high until
 * the same, the queue's bytes counted with each frame's cost. A queue without a mark is
 * never full. */
static void check_flow(cg_wsconn *c)
{
    if (!c->high)
        return;
    size_t held = c->bytes + (size_t)c->n * CG_WSFRAME_COST;
    int full = c->full ? held > c->high / 4 : held > c->high;
    int overfull = c->overfull ? held > c->high / 4 : held > 2 * c->high;
    if (full == c->full && overfull == c->overfull)
        return;
    c->full = full;
    c->overfull = overfull;
    if (c->ops && c->ops->flow)
        c->ops->flow(c, full, overfull);
}

static void on_flush(cg_flush_item *item);

static int is_open(const cg_wsconn *c)
{
    return c->wsi && (c->state == CG_WSCONN_OPEN || c->state == CG_WSCONN_CLOSING);
}

static void request_flush(cg_wsconn *c)
{
    if (is_open(c) && c->head && !c->head->held)
        cg_flush_request(c->net->flush, &c->flush, on_flush);
}

static void lone_release(cg_wsconn *c)
{
    c->lone = NULL;
    cg_flush_cancel(&c->lone_item);
}

/* A close frame is queued or out: nothing more is taken. */
static int closing(const cg_wsconn *c)
{
    return c->state == CG_WSCONN_CLOSE_SENT || (c->tail && c->tail->close);
}

int cg_wsconn_push(cg_wsconn *c, cg_wsframe *f)
{
    if (closing(c) || (c->max_frames && c->n >= c->max_frames)) {
        cg_wsframe_free(f);
        return -1;
    }
    if (c->lone) /* company for the frame that waits: both go now */
        lone_release(c);
    f->next = NULL;
    if (c->tail)
        c->tail->next = f;
    else
        c->head = f;
    c->tail = f;
    c->bytes += f->len;
    c->n++;
    if (f->close && c->state == CG_WSCONN_OPEN)
        c->state = CG_WSCONN_CLOSING;
    request_flush(c);
    check_flow(c);
    return 0;
}

int cg_wsconn_send(cg_wsconn *c, const void *data, size_t len, int binary)
{
    return cg_wsconn_push(c, cg_wsframe_new(data, len, binary));
}

void cg_wsconn_grew(cg_wsconn *c, size_t n)
{
    c->tail->len += n;
    c->bytes += n;
    check_flow(c);
}

static void lone_due(cg_flush_item *item)
{
    cg_wsconn *c = (cg_wsconn *)((char *)item - offsetof(cg_wsconn, lone_item));
    c->lone = NULL;
    request_flush(c);
}

void cg_wsconn_wait(cg_wsconn *c, unsigned ms)
{
    if (!ms || c->head != c->tail || !c->tail)
        return;
    c->lone = c->tail;
    cg_flush_later(c->net->flush, &c->lone_item, lone_due, ms);
}

/* A close frame while WAITING stays WAITING: it is written once the socket opens. */
void cg_wsconn_close(cg_wsconn *c, int code, const char *reason)
{
    if (closing(c))
        return;
    cg_wsframe *f = cg_wsframe_new(reason, strlen(reason), 0);
    f->close = code;
    cg_wsconn_push(c, f);
    if (is_open(c)) {
        c->io->close_within(c, CG_WSCONN_CLOSE_WAIT_S);
        c->io->want_writable(c);
    }
}

int cg_wsconn_closing(const cg_wsconn *c)
{
    return closing(c);
}

void cg_wsconn_close_now(cg_wsconn *c, int code, const char *reason)
{
    if (c->state == CG_WSCONN_CLOSE_SENT || !c->wsi)
        return;
    c->io->write_close(c, code, reason);
    c->state = CG_WSCONN_CLOSE_SENT;
    c->io->want_writable(c);
}

static void unlink_frame(cg_wsconn *c, cg_wsframe *f)
{
    cg_wsframe **pp = &c->head, *prev = NULL;
    while (*pp && *pp != f)
        prev = *pp, pp = &(*pp)->next;
    if (!*pp)
        return;
    *pp = f->next;
    if (c->tail == f)
        c->tail = prev;
    c->bytes -= f->len;
    c->n--;
    if (c->lone == f)
        lone_release(c);
    f->next = NULL;
}

void cg_wsconn_remove(cg_wsconn *c, cg_wsframe *f)
{
    unlink_frame(c, f);
    cg_wsframe_free(f);
    request_flush(c);
    check_flow(c);
}

void cg_wsconn_release(cg_wsconn *c, cg_wsframe *f, char *buf, size_t len)
{
    if (buf) {
        free(f->buf);
        f->buf = buf;
        c->bytes = c->bytes - f->len + len;
        f->len = len;
    }
    f->held = 0;
    request_flush(c);
    check_flow(c);
}

void cg_wsconn_soon(cg_wsconn *c, int after_first)
{
    if (c->flush.pprev)
        cg_flush_request_event(c->net->flush, &c->flush, on_flush, c->wsi, after_first);
}

/* ---- writing ----------------------------------------------------------------------------- */

/* The head frame, out of the queue, made if lazy. */
static cg_wsframe *pop(cg_wsconn *c)
{
    cg_wsframe *f = c->head;
    unlink_frame(c, f);
    if (!f->buf && c->ops && c->ops->finish)
        c->ops->finish(c, f);
    if (c->frames_out)
        (*c->frames_out)++;
    return f;
}

/* f is written: its buffer becomes the spare when it may and none is kept. */
static void written(cg_wsconn *c, cg_wsframe *f)
{
    if (!c->spare && f->cap) {
        c->spare = f->buf;
        c->spare_cap = f->cap;
        f->buf = NULL;
    }
    cg_wsframe_free(f);
}

/* A client's frame: masked in place, its header in the headroom, written as bytes. */
static int write_client(cg_wsconn *c, cg_wsframe *f)
{
    unsigned char *payload = (unsigned char *)f->buf + CG_WS_PRE;
    size_t head = cg_net_client_frame(payload, f->len, f->binary), len = head + f->len;
    int n = head ? c->io->write(c, payload - head, len, LWS_WRITE_HTTP) : -1;
    written(c, f);
    return n < (int)len ? -1 : 0;
}

/* 1 when the head frame goes in a server batch holding `held` bytes. */
static int batch_takes(const cg_wsconn *c, size_t held)
{
    const cg_wsframe *f = c->head;
    return f && !f->held && !f->close && held + f->len <= CG_NET_BATCH_BYTES;
}

/*
 * A server's frames: the head one through lws_write(), or, when more are waiting, as many
 * as fit in CG_NET_BATCH_BYTES with one send (net.h: the frames read in one packet leave in
 * one, as a relay's would; a lazy frame counts what it has, which escaping may add to).
 */
static int write_server(cg_wsconn *c)
{
    cg_wsframe *f = pop(c);
    if (!c->batch || !batch_takes(c, f->len)) {
        unsigned char *data = (unsigned char *)f->buf + CG_WS_PRE;
        size_t len = f->len;
        int n = c->io->write(c, data, len, f->binary ? LWS_WRITE_BINARY : LWS_WRITE_TEXT);
        written(c, f);
        return n < (int)len ? -1 : 0;
    }
    cg_net_batch *b = c->batch;
    for (;;) {
        cg_net_batch_add(b, f->buf + CG_WS_PRE, f->len, f->binary);
        written(c, f);
        if (!batch_takes(c, b->len))
            break;
        f = pop(c);
    }
    size_t len = b->len;
    b->len = 0;
    return c->io->write(c, (unsigned char *)b->buf, len, LWS_WRITE_HTTP) < (int)len ? -1 : 0;
}

/* The close frame at the head: out, and the connection goes at the next writable. */
static void write_close_frame(cg_wsconn *c)
{
    cg_wsframe *f = c->head;
    unlink_frame(c, f);
    c->io->write_close(c, f->close, f->buf + CG_WS_PRE);
    c->state = CG_WSCONN_CLOSE_SENT;
    cg_wsframe_free(f);
}

/*
 * Writes the ready frames at the head while the socket takes them (lws keeps the part of
 * a write the kernel did not take and sends it first), up to a held frame, and a close
 * frame only from the writable callback. What is left waits for the writable callback.
 * -1 when the socket failed.
 */
static int write_queue(cg_wsconn *c, int from_writable)
{
    int rc = 0;
    cg_wsframe *f;
    while ((f = c->head) && !f->held && !c->io->partial(c)) {
        if (f->close) {
            if (from_writable)
                write_close_frame(c);
            break;
        }
        if ((rc = c->role == CG_WS_SERVER ? write_server(c) : write_client(c, pop(c))) < 0)
            break;
    }
    if (rc == 0 && (c->state == CG_WSCONN_CLOSE_SENT || (c->head && !c->head->held)))
        c->io->want_writable(c);
    check_flow(c);
    return rc;
}

static void on_flush(cg_flush_item *item)
{
    cg_wsconn *c = (cg_wsconn *)((char *)item - offsetof(cg_wsconn, flush));
    if (c->lone && c->head == c->lone && c->tail == c->lone)
        return; /* it waits for company (cg_wsconn_wait); lone_due registers again */
    if (!is_open(c) || write_queue(c, 0) == 0)
        return;
    /* not inside the connection's own callback: lws closes it soon */
    if (c->ops && c->ops->lost)
        c->ops->lost(c);
    else
        cg_net_kill_async(c->net, c->wsi, PENDING_TIMEOUT_CLOSE_SEND);
}

int cg_wsconn_writable(cg_wsconn *c)
{
    if (c->state == CG_WSCONN_CLOSE_SENT)
        return -1;
    if (c->lone)
        lone_release(c); /* written another way */
    return write_queue(c, 1);
}

void cg_wsconn_open(cg_wsconn *c, struct lws *wsi)
{
    c->wsi = wsi;
    int close_queued = closing(c);
    c->state = close_queued ? CG_WSCONN_CLOSING : CG_WSCONN_OPEN;
    if (c->rx_paused)
        c->io->rx_flow(c, 0);
    if (close_queued)
        c->io->close_within(c, CG_WSCONN_CLOSE_WAIT_S);
    if (c->head)
        c->io->want_writable(c); /* a close frame, or frames, may wait: the writable writes them */
    request_flush(c);
}

char *cg_wsconn_spare(cg_wsconn *c, size_t *cap)
{
    char *s = c->spare;
    *cap = s ? c->spare_cap : 0;
    c->spare = NULL;
    c->spare_cap = 0;
    return s;
}

void cg_wsconn_clear(cg_wsconn *c)
{
    cg_flush_cancel(&c->flush);
    lone_release(c);
    while (c->head) {
        cg_wsframe *f = c->head;
        unlink_frame(c, f);
        cg_wsframe_free(f);
    }
    free(c->spare);
    c->spare = NULL;
    c->spare_cap = 0;
    cg_wsrx_done(&c->rx);
}

void cg_wsconn_gone(cg_wsconn *c)
{
    cg_flush_cancel(&c->flush);
    lone_release(c);
    c->wsi = NULL;
    c->state = CG_WSCONN_CLOSE_SENT;
}

/* ---- reading ----------------------------------------------------------------------------- */

void cg_wsconn_pause_rx(cg_wsconn *c, int paused)
{
    paused = !!paused;
    if (c->rx_paused == paused)
        return;
    c->rx_paused = paused;
    if (is_open(c))
        c->io->rx_flow(c, !paused);
}

int cg_wsconn_receive(cg_wsconn *c, int first, int final, const void *in, size_t len, size_t max,
                      const char **msg, size_t *msg_len)
{
    return cg_wsrx_feed(&c->rx, first, final, in, len, max, msg, msg_len);
}

void cg_wsconn_received(cg_wsconn *c)
{
    cg_wsrx_done(&c->rx);
}

int cg_ws_close_check(const void *payload, size_t len)
{
    const unsigned char *p = payload;
    if (len == 0)
        return 0;
    if (len == 1)
        return 1002;
    int code = p[0] << 8 | p[1];
    if (code < 1000 || code > 4999 || code == 1004 || code == 1005 || code == 1006 || code == 1015 ||
        (code >= 1016 && code <= 2999))
        return 1002;
    return cg_utf8_valid((const char *)p + 2, len - 2) ? 0 : 1007;
}
