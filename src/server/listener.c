/*
 * listener.c: the gateway's listening sockets and the reading of each connection's request
 * head before lws serves it (see listener.h).
 *
 * Accepting: a uv_poll on the listening socket (level-triggered) accepts up to
 * CG_ACCEPT_BATCH connections per wake-up. When the process runs out of descriptors
 * (EMFILE), the poll pauses for CG_ACCEPT_PAUSE_MS instead of waking at once again for the
 * same connection: the pending connections wait in the kernel's backlog.
 *
 * The head: each accepted connection gets a head_conn (its poll, a timer, a buffer) until
 * its head is read, at most max_connections of them at once and CG_HEAD_TIMEOUT_MS each.
 * What has come is looked at with MSG_PEEK: while the head is not whole, all of it is taken
 * (so the level-triggered poll waits for more); once it is, only what lws is handed is taken,
 * so the CRLF that a held head ends with stays in the socket for lws to read later. Then
 * both handles close, and from the close callback (libuv allows one poll per socket, and
 * lws makes its own) the socket and what was read go to lws. A head whose headers are over
 * max_header_bytes is answered 431 here (lws's own check sees only the headers it knows by
 * name); one over the buffer is handed over as far as it came: lws reads the rest and
 * answers 431. (A head that has come
 * up to "\r\n\r" keeps that byte in the socket, looked at again 2 ms later: head_readable.)
 *
 * The buffer starts at CG_HEAD_FIRST bytes, which a browser's or a client library's
 * handshake fits in, and doubles up to the header space only for a head that needs it: a
 * burst of connections (thousands opening at once) would otherwise each touch the whole
 * header space (64 KiB by default), and the allocator keeps what was touched.
 */
#define _GNU_SOURCE /* accept4, memmem */
#include <uv.h>
#include <libwebsockets.h>

#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <unistd.h>

#include "chatgate/core/alloc.h"
#include "chatgate/core/log.h"
#include "chatgate/server/dropin.h"
#include "chatgate/server/handshake.h"
#include "chatgate/server/listener.h"

#define CG_ACCEPT_BATCH 64
#define CG_ACCEPT_PAUSE_MS 100
#define CG_MAX_LISTENERS 2
#define CG_HEAD_TIMEOUT_MS 10000 /* as lws's own wait for a head (timeout_secs_ah_idle) */
#define CG_HEAD_FIRST 2048       /* the head buffer's first size */
#define CG_HEAD_AGAIN_MS 2       /* the pause before a head's last byte is looked for again */

typedef struct listener {
    uv_poll_t poll;
    uv_timer_t pause; /* resumes accepting after EMFILE */
    int fd;
    int open;
    int flags;
    cg_server *srv;
    struct lws_vhost *vh;
    const char *what;
} listener;

/* A connection whose request head is being read; freed once both handles have closed. */
typedef struct head_conn {
    uv_poll_t poll;
    uv_timer_t timer;
    uv_timer_t again; /* reads again after a pause: the head's last byte is awaited (head_readable) */
    listener *l;
    int fd;
    int handles;   /* open handles: the struct goes when all three have closed */
    int finished;  /* the handles are closing */
    int adopt;     /* then: hand the socket to lws (1), or close it (0) */
    int hold;      /* a drop-in upgrade: handed over without the last CRLF, held */
    size_t len, taken, give; /* bytes come (peeked); taken out of the socket; lws gets */
    size_t size, cap;        /* the buffer's size now, and at most */
    struct head_conn *prev, *next;
    char *buf; /* owned */
} head_conn;

static listener listeners[CG_MAX_LISTENERS];
static head_conn *heads; /* those being read or closing, for the drain */
static long n_heads;

/* ---- the head ----------------------------------------------------------------------- */

static void head_unlink(head_conn *h)
{
    if (h->prev)
        h->prev->next = h->next;
    else
        heads = h->next;
    if (h->next)
        h->next->prev = h->prev;
    h->prev = h->next = NULL;
    n_heads--;
}

/* Both handles closed: the socket goes to lws (held for its app, when a drop-in upgrade),
 * or is closed. */
static void head_closed(uv_handle_t *handle)
{
    head_conn *h = handle->data;
    if (--h->handles > 0)
        return;
    head_unlink(h);
    if (!h->adopt) {
        close(h->fd);
        free(h->buf);
        free(h);
        return;
    }
    cg_server *srv = h->l->srv;
    struct lws *wsi = lws_adopt_socket_vhost_readbuf(h->l->vh, h->fd, h->buf, h->give);
    if (!wsi) /* it closed the socket: it served the request buffered with it at once, and the
               * request said "Connection: close" (lws 4.1 returns NULL then), or it refused it */
        cg_debug("%s: libwebsockets closed a connection as it took it (served at once, or refused)", h->l->what);
    else if (h->hold) {
        /* lws has read every header but not the head's end: it reads on when the app has
         * answered (dropin.c), or at once when the connection is not to be held */
        lws_rx_flow_control(wsi, 0);
        if (cg_dropin_hold(srv, wsi) < 0)
            lws_rx_flow_control(wsi, 1);
    }
    free(h->buf); /* lws copied what it was given */
    free(h);
}

static void head_finish(head_conn *h, int adopt)
{
    h->finished = 1;
    h->adopt = adopt;
    uv_poll_stop(&h->poll);
    uv_timer_stop(&h->timer);
    uv_timer_stop(&h->again);
    uv_close((uv_handle_t *)&h->poll, head_closed);
    uv_close((uv_handle_t *)&h->timer, head_closed);
    uv_close((uv_handle_t *)&h->again, head_closed);
}

/* The request target of the head (its request line's second word), and its length. */
static const char *head_target(const head_conn *h, size_t *n)
{
    const char *sp = memchr(h->buf, ' ', h->len);
    const char *t = sp ? sp + 1 : NULL;
    const char *end = t ? memchr(t, ' ', h->len - (size_t)(t - h->buf)) : NULL;
    *n = end ? (size_t)(end - t) : 0;
    return end ? t : NULL;
}

/* Does the head ask for a WebSocket upgrade ("Upgrade: websocket", any case)? */
static int head_upgrade(const head_conn *h)
{
    for (const char *p = h->buf, *end = h->buf + h->len; p < end;) {
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        size_t n = nl ? (size_t)(nl - p) : (size_t)(end - p);
        if (n > 8 && strncasecmp(p, "upgrade:", 8) == 0 && memmem(p, n, "ebsocket", 8)) /* [Ww]ebsocket */
            return 1;
        p += n + 1;
    }
    return 0;
}

/* Does the target's path hold a dot segment ("/./", "/../", or one at its end), its dots
 * and slashes written as they are or as %2e and %2f, which lws decodes before it collapses
 * them ("/ws%2F..%2Fws" is "/ws/../ws" to lws)? */
static int dot_segments(const char *raw, size_t n)
{
    char t[1024];
    size_t path = 0;
    for (size_t i = 0; i < n && raw[i] != '?' && raw[i] != '#' && path < sizeof(t); i++) {
        char c = raw[i];
        if (c == '%' && i + 2 < n && raw[i + 1] == '2') {
            char e = (char)(raw[i + 2] | 0x20);
            c = e == 'e' ? '.' : e == 'f' ? '/' : c;
        }
        t[path++] = c;
        i += c != raw[i] ? 2 : 0;
    }
    for (size_t i = 0; i + 1 < path; i++) {
        if (t[i] != '/' || t[i + 1] != '.')
            continue;
        size_t j = i + 2 < path && t[i + 2] == '.' ? i + 3 : i + 2;
        if (j == path || t[j] == '/')
            return 1;
    }
    return 0;
}

static int head_take(head_conn *h, size_t upto);

/* Answers the head here (a refusal, "connection: close") and closes the connection. The
 * head is taken out of the socket first: closing a socket with bytes unread sends a reset,
 * which can reach the client before it has read the answer. */
static void head_refuse(head_conn *h, int status, const char *reason, const char *body)
{
    if (head_take(h, h->len) < 0) {
        head_finish(h, 0);
        return;
    }
    char answer[512];
    int n = snprintf(answer, sizeof(answer),
                     "HTTP/1.1 %d %s\r\ncontent-type: text/plain\r\ncontent-length: %zu\r\n"
                     "cache-control: no-store\r\nconnection: close\r\n\r\n%s",
                     status, reason, strlen(body), body);
    h->l->srv->metrics.refused_connections++;
    if (n > 0 && (size_t)n < sizeof(answer) && send(h->fd, answer, (size_t)n, MSG_NOSIGNAL) < 0)
        cg_debug("%s: the %d could not be sent: %s", h->l->what, status, strerror(errno));
    head_finish(h, 0);
}

/*
 * A head whose headers (every byte after the request line, up to the blank line: names,
 * values, line ends) are over max_header_bytes: 431, here. lws's own check sums only the
 * headers it knows by name (its token table), so a request padded with headers of other
 * names (three 15 KB X-Pad headers) passed it until issue 39's ninth round.
 */
static void refuse_large(head_conn *h, size_t header_bytes)
{
    long limit = h->l->srv->cfg->max_header_bytes;
    char body[160];
    cg_warn("%s: refused a request with %zu bytes of headers or more, over max_header_bytes (%ld): 431", h->l->what,
            header_bytes, limit);
    snprintf(body, sizeof(body), "the request's headers are over %ld bytes (a cookie or token too long?)\n", limit);
    head_refuse(h, 431, "Request Header Fields Too Large", body);
}

/* The bytes of the head's headers: from after the request line to the blank line (end). */
static size_t head_header_bytes(const head_conn *h, size_t end)
{
    const char *nl = memchr(h->buf, '\n', end);
    size_t from = nl ? (size_t)(nl - h->buf) + 1 : end;
    return end - 2 > from ? end - 2 - from : 0;
}

/* The head is whole (its blank line ends at end; h->len bytes have come, h->taken of them
 * are out of the socket): answered here (headers over the bound, dot segments), or handed
 * to lws, whole or held. */
static void head_done(head_conn *h, size_t end)
{
    size_t tn, header_bytes = head_header_bytes(h, end);
    if (header_bytes > (size_t)h->l->srv->cfg->max_header_bytes) {
        refuse_large(h, header_bytes);
        return;
    }
    const char *target = head_target(h, &tn);
    int upgrade = head_upgrade(h);
    if (upgrade && target && dot_segments(target, tn)) {
        /* its path only, whole: a query may hold a token in a form the log's masks do not know
         * (percent-encoded), and a value cut before the masks see it is not masked */
        size_t pn = 0;
        while (pn < tn && target[pn] != '?' && target[pn] != ';' && target[pn] != '#')
            pn++;
        if (pn <= 200)
            cg_warn("%s: refused a WebSocket handshake whose target's path holds dot segments ('%.*s'): 400",
                    h->l->what, (int)pn, target);
        else
            cg_warn("%s: refused a WebSocket handshake whose target's path (%zu bytes) holds dot segments: 400",
                    h->l->what, pn);
        head_refuse(h, 400, "Bad Request", "a WebSocket request target may not hold dot segments\n");
        return;
    }
    /* held only when lws can hold the whole head in its header space and nothing came after
     * it (a client sends no frame before its 101) */
    char path[1024];
    snprintf(path, sizeof(path), "%.*s", target ? (int)(tn < sizeof(path) - 1 ? tn : sizeof(path) - 1) : 0,
             target ? target : "");
    path[strcspn(path, "?")] = 0;
    h->hold = (h->l->flags & CG_LISTEN_DROPIN) && upgrade && end == h->len && end - 2 >= h->taken &&
              h->len <= (size_t)h->l->srv->cfg->max_header_bytes * 2 && cg_handshake_path_is_dropin(h->l->srv, path);
    h->give = h->hold ? h->len - 2 : h->len;
    if (head_take(h, h->give) < 0) {
        head_finish(h, 0);
        return;
    }
    head_finish(h, 1);
}

/* Takes the bytes up to upto out of the socket (they were peeked into the buffer): 0, or -1
 * when the socket fails. */
static int head_take(head_conn *h, size_t upto)
{
    while (h->taken < upto) {
        ssize_t n = recv(h->fd, h->buf + h->taken, upto - h->taken, 0);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return -1;
        h->taken += (size_t)n;
    }
    return 0;
}

static void head_readable(uv_poll_t *p, int status, int events);

static void head_again(uv_timer_t *t)
{
    head_conn *h = t->data;
    uv_poll_start(&h->poll, UV_READABLE, head_readable);
}

static void head_readable(uv_poll_t *p, int status, int events)
{
    (void)events;
    head_conn *h = p->data;
    if (status < 0) {
        head_finish(h, 0);
        return;
    }
    /* what is in the socket, after what was taken already */
    ssize_t n = recv(h->fd, h->buf + h->taken, h->size - h->taken, MSG_PEEK);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))
        return;
    if (n <= 0) { /* gone before its head was whole */
        head_finish(h, 0);
        return;
    }
    size_t from = h->taken > 3 ? h->taken - 3 : 0;
    h->len = h->taken + (size_t)n;
    const char *blank = memmem(h->buf + from, h->len - from, "\r\n\r\n", 4);
    if (blank) {
        head_done(h, (size_t)(blank - h->buf) + 4);
        return;
    }
    /* Not whole: all of it is taken, and the poll waits for more. But a head that has come
     * up to "\r\n\r" on a drop-in listener keeps that "\r" in the socket: it may begin the
     * final CRLF, which a held head leaves for lws (head_done). The poll, which would wake at
     * once for it, pauses meanwhile, and the socket is looked at again shortly. */
    if (h->len == h->cap) { /* over the header space: lws reads on (to the end, which this
                             * buffer cannot), and answers 431 */
        if (head_take(h, h->len) < 0) {
            head_finish(h, 0);
            return;
        }
        h->give = h->len;
        head_finish(h, 1);
        return;
    }
    int full = h->len == h->size; /* the peek filled the buffer: more may wait in the socket */
    int keep = (h->l->flags & CG_LISTEN_DROPIN) && h->len >= 3 && memcmp(h->buf + h->len - 3, "\r\n\r", 3) == 0;
    if (keep) {
        h->len--;
        uv_poll_stop(&h->poll);
        uv_timer_start(&h->again, head_again, CG_HEAD_AGAIN_MS, 0);
    }
    if (head_take(h, h->len) < 0) {
        head_finish(h, 0);
    } else if (full) { /* room for more (the poll, or the pause's end, looks again) */
        h->size = h->size * 2 < h->cap ? h->size * 2 : h->cap;
        h->buf = cg_realloc(h->buf, h->size);
    }
}

static void head_timeout(uv_timer_t *t)
{
    head_finish(t->data, 0);
}

static void head_start(listener *l, int fd)
{
    const cg_config *cfg = l->srv->cfg;
    if (n_heads >= cfg->max_connections) { /* those closing still hold their socket: counted too */
        cg_warn("%s: %ld connections are still sending their request head: one more is closed", l->what, n_heads);
        close(fd);
        return;
    }
    size_t cap = (size_t)cfg->max_header_bytes * 4 + 2048; /* within lws's pt_serv_buf_size (gateway.c) */
    head_conn *h = cg_calloc(1, sizeof(*h));
    h->l = l;
    h->fd = fd;
    h->cap = cap;
    h->size = CG_HEAD_FIRST < cap ? CG_HEAD_FIRST : cap;
    h->buf = cg_malloc(h->size);
    h->handles = 3;
    h->next = heads;
    if (heads)
        heads->prev = h;
    heads = h;
    n_heads++;
    uv_loop_t *loop = uv_handle_get_loop((uv_handle_t *)&l->poll);
    uv_poll_init(loop, &h->poll, fd);
    uv_timer_init(loop, &h->timer);
    uv_timer_init(loop, &h->again);
    h->poll.data = h->timer.data = h->again.data = h;
    uv_poll_start(&h->poll, UV_READABLE, head_readable);
    uv_timer_start(&h->timer, head_timeout, CG_HEAD_TIMEOUT_MS, 0);
}

/* ---- accepting ---------------------------------------------------------------------- */

static void on_readable(uv_poll_t *p, int status, int events);

static void on_pause_end(uv_timer_t *t)
{
    listener *l = t->data;
    uv_poll_start(&l->poll, UV_READABLE, on_readable);
}

static void on_readable(uv_poll_t *p, int status, int events)
{
    (void)events;
    listener *l = p->data;
    if (status < 0) {
        cg_warn("%s: polling the listening socket failed: %s", l->what, uv_strerror(status));
        return;
    }
    for (int i = 0; i < CG_ACCEPT_BATCH; i++) {
        int fd = accept4(l->fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EINTR || errno == ECONNABORTED)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                return;
            /* EMFILE, ENFILE, ENOBUFS, ENOMEM: wait instead of spinning on the same one */
            cg_warn("%s: accept: %s; pausing %d ms", l->what, strerror(errno), CG_ACCEPT_PAUSE_MS);
            uv_poll_stop(&l->poll);
            uv_timer_start(&l->pause, on_pause_end, CG_ACCEPT_PAUSE_MS, 0);
            return;
        }
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one)); /* as lws does for its own */
        head_start(l, fd);
    }
}

/* A listening socket on host:port (SO_REUSEPORT when shared): -1 (logged) or the fd. The
 * name is resolved before the loop serves anything (the gateway's start). */
static int open_socket(const char *host, int port, int shared, const char *what)
{
    struct addrinfo hints, *res = NULL;
    memset(&hints, 0, sizeof(hints));
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
    char portstr[16];
    snprintf(portstr, sizeof(portstr), "%d", port);
    int rc = getaddrinfo(host && *host ? host : NULL, portstr, &hints, &res);
    if (rc != 0) {
        cg_error("%s: cannot listen on %s:%d: %s (an address or a host name, not an interface)", what, host, port,
                 gai_strerror(rc));
        return -1;
    }
    int fd = -1, err = 0;
    for (struct addrinfo *ai = res; ai && fd < 0; ai = ai->ai_next) {
        fd = socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol);
        if (fd < 0) {
            err = errno;
            continue;
        }
        int one = 1;
        if (setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) < 0 ||
            (shared && setsockopt(fd, SOL_SOCKET, SO_REUSEPORT, &one, sizeof(one)) < 0) ||
            bind(fd, ai->ai_addr, ai->ai_addrlen) < 0 || listen(fd, SOMAXCONN) < 0) {
            err = errno;
            close(fd);
            fd = -1;
        }
    }
    freeaddrinfo(res);
    if (fd < 0)
        cg_error("%s: could not start listening on %s:%d: %s (in use, or not an address of this machine?)", what,
                 host, port, strerror(err));
    return fd;
}

int cg_listener_open(cg_server *srv, struct lws_vhost *vh, const char *host, int port, int flags, const char *what)
{
    listener *l = NULL;
    for (int i = 0; i < CG_MAX_LISTENERS && !l; i++)
        if (!listeners[i].open)
            l = &listeners[i];
    if (!l) {
        cg_error("%s: too many listeners", what);
        return -1;
    }
    int fd = open_socket(host, port, flags & CG_LISTEN_SHARED, what);
    if (fd < 0)
        return -1;
    *l = (listener){.fd = fd, .open = 1, .flags = flags, .srv = srv, .vh = vh, .what = what};
    uv_poll_init(srv->net.loop, &l->poll, fd);
    uv_timer_init(srv->net.loop, &l->pause);
    l->poll.data = l->pause.data = l;
    uv_poll_start(&l->poll, UV_READABLE, on_readable);
    return 0;
}

static void on_poll_closed(uv_handle_t *h)
{
    listener *l = h->data;
    close(l->fd); /* after the poll let go of it */
    l->fd = -1;
}

void cg_listener_close_all(void)
{
    for (int i = 0; i < CG_MAX_LISTENERS; i++) {
        listener *l = &listeners[i];
        if (!l->open)
            continue;
        uv_poll_stop(&l->poll);
        uv_timer_stop(&l->pause);
        uv_close((uv_handle_t *)&l->poll, on_poll_closed);
        uv_close((uv_handle_t *)&l->pause, NULL);
        l->open = 0;
    }
    /* none goes to lws now, which is about to be destroyed: not even one already closing */
    for (head_conn *h = heads; h; h = h->next) {
        if (!h->finished)
            head_finish(h, 0);
        h->adopt = 0;
    }
}
