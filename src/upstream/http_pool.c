/*
 * http_pool.c: one upstream's kept-alive HTTP connections, libcurl's multi interface on the
 * gateway's libuv loop (see http_pool.h for why libcurl, and what is kept for how long).
 *
 * The glue is libcurl's multi_socket API: libcurl says which sockets to watch
 * (on_socket -> a uv_poll_t each) and when to call it back (on_curl_timer -> a uv timer),
 * and every poll event or timer goes to curl_multi_socket_action, after which the finished
 * transfers are read off (finish_done).
 *
 * libcurl forbids adding or removing a transfer from inside any of its callbacks, and a
 * reply's callbacks reach the session, which may start the next message or cancel one. So
 * while the pool is inside libcurl (in_curl), start and stop only mark the transfer and the
 * pool applies them when libcurl returns (apply_pending); a resume is always applied from
 * the loop (a zero timer), since libcurl delivers held data from inside curl_easy_pause and
 * the session must not hear of a reply from inside its own pause call.
 *
 * Counted into metrics at the upstream's index: connections opened (the opensocket
 * callback), requests sent on a kept connection and new TLS connections that resumed an
 * earlier session (cg_http_pool_sending), and the idle gauge (sockets open less the
 * transfers that hold one).
 */
#include <ctype.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>
#include <sys/queue.h>
#include <sys/socket.h>

#include <openssl/ssl.h>

#include "chatgate/core/alloc.h"
#include "chatgate/core/log.h"
#include "chatgate/core/tls_ca.h"
#include "chatgate/upstream/http_pool.h"

typedef struct transfer {
    CURL *easy;
    cg_http_done_fn done;
    void *data;
    int added;   /* in the multi handle */
    int busy;    /* its request went out on a connection: that one is not idle */
    int stop;    /* stop asked while the pool was inside libcurl */
    int resume;  /* curl_easy_pause(CONT) asked */
    LIST_ENTRY(transfer) link; /* in the pool's transfers */
} transfer;

typedef struct sock_watch {
    uv_poll_t poll;
    cg_http_pool *pool;
    curl_socket_t fd;
} sock_watch;

struct cg_http_pool {
    uv_loop_t *loop;
    const cg_upstream_config *cfg;
    cg_metrics *metrics;
    int index;
    CURLM *multi;  /* NULL while no connection is open and nothing runs */
    CURLSH *share; /* TLS sessions and DNS answers, kept across multi handles */
    const cg_tls_ca *ca; /* trusted besides the system's CAs (tls_ca_file), or NULL */
    uv_timer_t curl_timer, kick, idle;
    LIST_HEAD(, transfer) transfers; /* every running transfer */
    int asked;           /* a transfer has a stop, an add or a resume to apply (apply_pending) */
    long open;           /* sockets open now */
    long busy;           /* transfers that hold a connection */
    long added;          /* transfers in the multi handle: the connections they may hold */
    long server_keepalive_s; /* the last `Keep-Alive: timeout=N` heard, 0 when none */
    int in_curl;
    int freeing;
    int handles; /* uv handles not yet closed (the pool is freed at 0) */
};

static void update_idle(cg_http_pool *p)
{
    if (p->metrics)
        p->metrics->upstream_conns_idle[p->index] = p->open > p->busy ? (unsigned long)(p->open - p->busy) : 0;
}

/* ---- sockets and timers ---------------------------------------------------------------- */

static void socket_action(cg_http_pool *p, curl_socket_t fd, int events);

static void on_poll(uv_poll_t *h, int status, int events)
{
    sock_watch *w = h->data;
    int flags = status < 0 ? CURL_CSELECT_ERR
                           : ((events & UV_READABLE) ? CURL_CSELECT_IN : 0) | ((events & UV_WRITABLE) ? CURL_CSELECT_OUT : 0);
    socket_action(w->pool, w->fd, flags);
}

static void watch_closed(uv_handle_t *h)
{
    free(h->data);
}

static int on_socket(CURL *easy, curl_socket_t fd, int what, void *userp, void *socketp)
{
    (void)easy;
    cg_http_pool *p = userp;
    sock_watch *w = socketp;
    if (what == CURL_POLL_REMOVE) {
        if (w) {
            curl_multi_assign(p->multi, fd, NULL);
            uv_close((uv_handle_t *)&w->poll, watch_closed);
        }
        return 0;
    }
    if (!w) {
        w = cg_calloc(1, sizeof(*w));
        if (uv_poll_init_socket(p->loop, &w->poll, fd) < 0) {
            free(w);
            return -1;
        }
        uv_unref((uv_handle_t *)&w->poll); /* see cg_http_pool_new */
        w->pool = p;
        w->fd = fd;
        w->poll.data = w;
        curl_multi_assign(p->multi, fd, w);
    }
    int events = (what & CURL_POLL_IN ? UV_READABLE : 0) | (what & CURL_POLL_OUT ? UV_WRITABLE : 0);
    uv_poll_start(&w->poll, events, on_poll);
    return 0;
}

static void on_curl_timeout(uv_timer_t *t)
{
    socket_action(t->data, CURL_SOCKET_TIMEOUT, 0);
}

static int on_curl_timer(CURLM *multi, long ms, void *userp)
{
    (void)multi;
    cg_http_pool *p = userp;
    if (ms < 0)
        uv_timer_stop(&p->curl_timer);
    else
        uv_timer_start(&p->curl_timer, on_curl_timeout, (uint64_t)ms, 0);
    return 0;
}

static curl_socket_t on_open_socket(void *userp, curlsocktype purpose, struct curl_sockaddr *a)
{
    cg_http_pool *p = userp;
    (void)purpose;
    curl_socket_t fd = socket(a->family, a->socktype, a->protocol);
    if (fd == CURL_SOCKET_BAD)
        return fd;
    p->open++;
    if (p->metrics)
        p->metrics->upstream_conns_opened[p->index]++;
    update_idle(p);
    return fd;
}

static int on_close_socket(void *userp, curl_socket_t fd)
{
    cg_http_pool *p = userp;
    p->open--;
    update_idle(p);
    return close(fd);
}

/* ---- the multi handle ------------------------------------------------------------------ */

/*
 * max_idle_connections bounds the idle connections. libcurl's CURLMOPT_MAXCONNECTS bounds
 * its whole cache, busy connections included: when a transfer ends with the cache past it,
 * libcurl walks every connection for the oldest idle one and closes it. Set to
 * max_idle_connections, more replies at once than that closed each connection as its reply
 * ended (the one just let go was the only idle one), so every message paid a new TCP and
 * TLS connection, and each end a walk of them all. So the bound follows the transfers: libcurl
 * reads it only when a transfer lets its connection go, while that transfer is still
 * counted here (it leaves in finish_done), so the others' connections may be busy and
 * max_idle_connections more may wait, the one let go among them. Set whenever the count
 * changes. max_idle_connections 0 forbids reuse instead (cg_http_pool_easy), and the bound
 * is libcurl's default.
 */
static void cache_bound(cg_http_pool *p)
{
    if (p->multi && p->cfg->max_idle_connections > 0)
        curl_multi_setopt(p->multi, CURLMOPT_MAXCONNECTS,
                          (p->added > 0 ? p->added - 1 : 0) + (long)p->cfg->max_idle_connections);
}

/* Puts the transfer into the multi handle; -1 when libcurl refuses it. */
static int transfer_add(cg_http_pool *p, transfer *t)
{
    if (curl_multi_add_handle(p->multi, t->easy) != CURLM_OK)
        return -1;
    t->added = 1;
    p->added++;
    cache_bound(p);
    return 0;
}

static int multi_open(cg_http_pool *p)
{
    if (p->multi)
        return 0;
    p->multi = curl_multi_init();
    if (!p->multi)
        return -1;
    curl_multi_setopt(p->multi, CURLMOPT_SOCKETFUNCTION, on_socket);
    curl_multi_setopt(p->multi, CURLMOPT_SOCKETDATA, p);
    curl_multi_setopt(p->multi, CURLMOPT_TIMERFUNCTION, on_curl_timer);
    curl_multi_setopt(p->multi, CURLMOPT_TIMERDATA, p);
    cache_bound(p);
    return 0;
}

/* Every idle connection closed: the multi handle goes with them (a new one comes with the
 * next transfer; the TLS sessions stay in the share). */
static void multi_close(cg_http_pool *p)
{
    if (!p->multi || !LIST_EMPTY(&p->transfers))
        return;
    p->in_curl++;
    curl_multi_cleanup(p->multi);
    p->in_curl--;
    p->multi = NULL;
    uv_timer_stop(&p->curl_timer);
}

static long keepalive_ms(const cg_http_pool *p)
{
    long ms = p->cfg->idle_keepalive_ms;
    /* a server that says how long it keeps a connection is believed, a second early */
    if (p->server_keepalive_s > 0 && (p->server_keepalive_s - 1) * 1000 < ms)
        ms = p->server_keepalive_s > 1 ? (p->server_keepalive_s - 1) * 1000 : 500;
    return ms;
}

static void on_idle_timeout(uv_timer_t *t)
{
    cg_http_pool *p = t->data;
    if (LIST_EMPTY(&p->transfers) && p->open > 0)
        cg_debug("upstream '%s': closing %ld idle connection(s)", p->cfg->name, p->open);
    multi_close(p);
}

static void arm_idle(cg_http_pool *p)
{
    if (!LIST_EMPTY(&p->transfers) || !p->multi)
        uv_timer_stop(&p->idle);
    else
        uv_timer_start(&p->idle, on_idle_timeout, (uint64_t)keepalive_ms(p), 0);
}

/* The transfer leaves the pool: out of the multi handle, cleaned up, its owner told. */
static void transfer_end(cg_http_pool *p, transfer *t, CURLcode result)
{
    if (t->added) {
        curl_multi_remove_handle(p->multi, t->easy); /* an unfinished one's connection closes */
        p->added--;
        cache_bound(p);
    }
    if (t->busy)
        p->busy--;
    LIST_REMOVE(t, link);
    curl_easy_cleanup(t->easy);
    update_idle(p);
    cg_http_done_fn done = t->done;
    void *data = t->data;
    free(t);
    done(data, result);
}

/* The transfer an easy handle belongs to (CURLOPT_PRIVATE). */
static transfer *transfer_of(CURL *easy)
{
    transfer *t = NULL;
    curl_easy_getinfo(easy, CURLINFO_PRIVATE, (char **)&t);
    return t;
}

/* The owners hear of their ended transfers; what they start or stop meanwhile waits (in_curl). */
static void finish_done(cg_http_pool *p)
{
    CURLMsg *msg;
    int left;
    p->in_curl++;
    while (p->multi && (msg = curl_multi_info_read(p->multi, &left))) {
        if (msg->msg != CURLMSG_DONE)
            continue;
        transfer_end(p, transfer_of(msg->easy_handle), msg->data.result);
    }
    p->in_curl--;
}

/* Applies what was asked while libcurl was running: stops, adds, resumes. Whatever the
 * owners ask meanwhile waits for the next kick (in_curl), so the list holds still. */
static void apply_pending(cg_http_pool *p)
{
    /* Only when something was asked: walking every transfer after every socket event was
     * the pool's largest cost with many replies streaming (6% of the gateway's CPU in perf at
     * 200 streams; CPU per delta x0.93 to x0.96 of the walk's, A/B in one run of
     * tests/bench/stream.sh). An ask made during the walk sets it again. */
    if (!p->asked)
        return;
    p->asked = 0;
    p->in_curl++;
    for (transfer *t = LIST_FIRST(&p->transfers), *next; t; t = next) {
        next = LIST_NEXT(t, link);
        if (t->stop) {
            transfer_end(p, t, CURLE_ABORTED_BY_CALLBACK);
            continue;
        }
        if (!t->added && transfer_add(p, t) < 0) {
            transfer_end(p, t, CURLE_OUT_OF_MEMORY);
            continue;
        }
        if (t->resume) {
            t->resume = 0;
            /* held data comes out of curl_easy_pause itself, to the owner (in_curl) */
            curl_easy_pause(t->easy, CURLPAUSE_CONT);
        }
    }
    p->in_curl--;
}

static void socket_action(cg_http_pool *p, curl_socket_t fd, int events)
{
    if (!p->multi)
        return;
    int running;
    p->in_curl++;
    curl_multi_socket_action(p->multi, fd, events, &running);
    p->in_curl--;
    if (p->in_curl)
        return;
    finish_done(p);
    apply_pending(p);
    arm_idle(p);
}

static void on_kick(uv_timer_t *t)
{
    cg_http_pool *p = t->data;
    if (!p->multi)
        return;
    apply_pending(p);
    finish_done(p);
    arm_idle(p);
}

/* ---- the API ---------------------------------------------------------------------------- */

/* CURLOPT_SSL_CTX_FUNCTION: a new TLS connection's context, before its handshake, gets the
 * pool's extra CAs beside the system's, which libcurl has loaded into it already. */
static CURLcode on_ssl_ctx(CURL *easy, void *ssl_ctx, void *data)
{
    (void)easy;
    return cg_tls_ca_trust(data, ssl_ctx) < 0 ? CURLE_OUT_OF_MEMORY : CURLE_OK;
}

cg_http_pool *cg_http_pool_new(uv_loop_t *loop, const cg_upstream_config *cfg, const cg_tls_ca *ca,
                               cg_metrics *metrics, int index)
{
    static int curl_ready;
    if (!curl_ready) {
        if (curl_global_init(CURL_GLOBAL_DEFAULT) != CURLE_OK)
            return NULL;
        curl_ready = 1;
    }
    cg_http_pool *p = cg_calloc(1, sizeof(*p));
    LIST_INIT(&p->transfers);
    p->loop = loop;
    p->cfg = cfg;
    p->ca = ca;
    p->metrics = metrics;
    p->index = index;
    p->share = curl_share_init();
    if (!p->share) {
        free(p);
        return NULL;
    }
    curl_share_setopt(p->share, CURLSHOPT_SHARE, CURL_LOCK_DATA_SSL_SESSION);
    curl_share_setopt(p->share, CURLSHOPT_SHARE, CURL_LOCK_DATA_DNS);
    uv_timer_init(loop, &p->curl_timer);
    uv_timer_init(loop, &p->kick);
    uv_timer_init(loop, &p->idle);
    p->curl_timer.data = p->kick.data = p->idle.data = p;
    p->handles = 3;
    /* The pool's handles do not keep the loop running: at the gateway's stop, its sessions
     * (whose calls these are) are gone first, and idle connections are not a reason to stay;
     * cg_upstream_close (the gateway's stop) frees the pool. */
    uv_unref((uv_handle_t *)&p->curl_timer);
    uv_unref((uv_handle_t *)&p->kick);
    uv_unref((uv_handle_t *)&p->idle);
    return p;
}

CURL *cg_http_pool_easy(cg_http_pool *p)
{
    CURL *e = curl_easy_init();
    if (!e)
        return NULL;
    long age_s = (keepalive_ms(p) + 999) / 1000;
    curl_easy_setopt(e, CURLOPT_SHARE, p->share);
    curl_easy_setopt(e, CURLOPT_OPENSOCKETFUNCTION, on_open_socket);
    curl_easy_setopt(e, CURLOPT_OPENSOCKETDATA, p);
    curl_easy_setopt(e, CURLOPT_CLOSESOCKETFUNCTION, on_close_socket);
    curl_easy_setopt(e, CURLOPT_CLOSESOCKETDATA, p);
    curl_easy_setopt(e, CURLOPT_MAXAGE_CONN, age_s > 0 ? age_s : 1L);
    curl_easy_setopt(e, CURLOPT_FORBID_REUSE, p->cfg->max_idle_connections > 0 ? 0L : 1L);
    curl_easy_setopt(e, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(e, CURLOPT_PROXY, ""); /* as before: no proxy from the environment */
    /* HTTP/1.1, one request per connection at a time: a cancel closes exactly its own */
    curl_easy_setopt(e, CURLOPT_HTTP_VERSION, (long)CURL_HTTP_VERSION_1_1);
    if (p->ca && (curl_easy_setopt(e, CURLOPT_SSL_CTX_FUNCTION, on_ssl_ctx) != CURLE_OK ||
                  curl_easy_setopt(e, CURLOPT_SSL_CTX_DATA, (void *)p->ca) != CURLE_OK)) {
        /* a libcurl built on another TLS library than OpenSSL (Debian's libcurl4-openssl is) */
        cg_error("upstream %s: tls_ca_file cannot be used: this libcurl's TLS library is not OpenSSL", p->cfg->name);
        curl_easy_cleanup(e);
        return NULL;
    }
    return e;
}

int cg_http_pool_start(cg_http_pool *p, CURL *easy, cg_http_done_fn done, void *data)
{
    if (p->freeing || multi_open(p) < 0)
        return -1;
    transfer *t = cg_calloc(1, sizeof(*t));
    t->easy = easy;
    t->done = done;
    t->data = data;
    curl_easy_setopt(easy, CURLOPT_PRIVATE, t);
    if (!p->in_curl) {
        if (transfer_add(p, t) < 0) {
            free(t);
            return -1;
        }
    } else {
        p->asked = 1;
        uv_timer_start(&p->kick, on_kick, 0, 0);
    }
    LIST_INSERT_HEAD(&p->transfers, t, link);
    uv_timer_stop(&p->idle);
    return 0;
}

void cg_http_pool_stop(cg_http_pool *p, CURL *easy)
{
    transfer *t = transfer_of(easy);
    if (!t)
        return;
    if (p->in_curl) {
        t->stop = 1;
        p->asked = 1;
        uv_timer_start(&p->kick, on_kick, 0, 0);
        return;
    }
    transfer_end(p, t, CURLE_ABORTED_BY_CALLBACK);
    arm_idle(p);
}

void cg_http_pool_pause(cg_http_pool *p, CURL *easy, int paused)
{
    transfer *t = transfer_of(easy);
    if (!t)
        return;
    if (paused) {
        t->resume = 0;
        if (t->added)
            curl_easy_pause(easy, CURLPAUSE_RECV);
        return;
    }
    t->resume = 1;
    p->asked = 1;
    uv_timer_start(&p->kick, on_kick, 0, 0);
}

/* 1 when the transfer's connection, just made, is TLS that resumed a session of an earlier
 * one (the share handle keeps them) rather than a full handshake. */
static int tls_resumed(CURL *easy)
{
    struct curl_tlssessioninfo *info = NULL;
    if (curl_easy_getinfo(easy, CURLINFO_TLS_SSL_PTR, &info) != CURLE_OK || !info ||
        info->backend != CURLSSLBACKEND_OPENSSL || !info->internals)
        return 0;
    return SSL_session_reused(info->internals) == 1;
}

void cg_http_pool_sending(cg_http_pool *p, CURL *easy)
{
    transfer *t = transfer_of(easy);
    long connects = 0;
    curl_easy_getinfo(easy, CURLINFO_NUM_CONNECTS, &connects);
    if (connects == 0 && p->metrics)
        p->metrics->upstream_conns_reused[p->index]++;
    else if (p->metrics && tls_resumed(easy))
        p->metrics->upstream_tls_resumed[p->index]++;
    if (t && !t->busy) {
        t->busy = 1;
        p->busy++;
        update_idle(p);
    }
}

void cg_http_pool_header(cg_http_pool *p, const char *line, size_t len)
{
    static const char name[] = "keep-alive:";
    if (len < sizeof(name) || strncasecmp(line, name, sizeof(name) - 1) != 0)
        return;
    char value[128];
    size_t n = len - (sizeof(name) - 1) < sizeof(value) - 1 ? len - (sizeof(name) - 1) : sizeof(value) - 1;
    for (size_t i = 0; i < n; i++)
        value[i] = (char)tolower((unsigned char)line[sizeof(name) - 1 + i]);
    value[n] = 0;
    const char *t = strstr(value, "timeout=");
    long v = t ? strtol(t + 8, NULL, 10) : 0;
    if (v > 0 && v < 86400)
        p->server_keepalive_s = v;
}

static void pool_handle_closed(uv_handle_t *h)
{
    cg_http_pool *p = h->data;
    if (--p->handles == 0) {
        curl_share_cleanup(p->share);
        free(p);
    }
}

void cg_http_pool_free(cg_http_pool *p)
{
    if (!p || p->freeing)
        return;
    p->freeing = 1;
    while (!LIST_EMPTY(&p->transfers))
        transfer_end(p, LIST_FIRST(&p->transfers), CURLE_ABORTED_BY_CALLBACK);
    multi_close(p);
    uv_close((uv_handle_t *)&p->curl_timer, pool_handle_closed);
    uv_close((uv_handle_t *)&p->kick, pool_handle_closed);
    uv_close((uv_handle_t *)&p->idle, pool_handle_closed);
}
