/*
 * http_pool.c: one upstream's kept-alive HTTP connections, libcurl's multi interface on the
 * gateway's libuv loop (see http_pool.h for why libcurl, and what is kept for how long).
 *
 * The glue is libcurl's multi_socket API: libcurl says which sockets to watch
 * (on_socket -> a uv_poll_t each) and when to call it back (on_curl_timer -> a uv timer),
 * and every poll event or timer goes to curl_multi_socket_action, after which the finished
 * transfers are read off (finish_done).
 *
 * A pool runs its transfers in lanes: a lane is one multi handle with its own connections,
 * and takes at most cfg->replies_per_handle transfers at once, the first lane with room
 * taking the next. libcurl 7.88 walks a multi handle's every connection at each transfer's
 * start (for one to reuse) and end (curl_multi_remove_handle looks for connect-only ones),
 * and hashes its sockets in 911 fixed slots: with 6,000 streams of 20 deltas, those walks
 * were a quarter of the gateway's CPU (perf, issue 39). Lanes keep each walk to a lane's
 * connections. A connection is reused within its lane only; with fewer transfers than a
 * lane takes, every one runs in the first, as with one handle.
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

typedef struct lane lane;

typedef struct transfer {
    CURL *easy;
    lane *lane;  /* the multi handle it runs in */
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
    lane *lane;
    curl_socket_t fd;
} sock_watch;

/* Lanes a pool may open: past LANES_MAX * replies_per_handle transfers, the emptiest lane
 * takes the next. */
#define LANES_MAX 64

struct lane {
    cg_http_pool *pool;
    CURLM *multi;        /* NULL while no connection is open and nothing runs */
    uv_timer_t curl_timer, idle;
    long added;          /* transfers in the multi handle: the connections they may hold */
    long transfers;      /* transfers it runs, added or waiting to be */
    int ready;           /* its timers are initialised (a lane is set up at its first use) */
};

struct cg_http_pool {
    uv_loop_t *loop;
    const cg_upstream_config *cfg;
    cg_metrics *metrics;
    int index;
    CURLSH *share; /* TLS sessions and DNS answers, kept across multi handles */
    const cg_tls_ca *ca; /* trusted besides the system's CAs (tls_ca_file), or NULL */
    uv_timer_t kick;
    lane lanes[LANES_MAX];
    LIST_HEAD(, transfer) transfers; /* every running transfer */
    int asked;           /* a transfer has a stop, an add or a resume to apply (apply_pending) */
    long open;           /* sockets open now */
    long busy;           /* transfers that hold a connection */
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

static void socket_action(lane *l, curl_socket_t fd, int events);

static void on_poll(uv_poll_t *h, int status, int events)
{
    sock_watch *w = h->data;
    int flags = status < 0 ? CURL_CSELECT_ERR
                           : ((events & UV_READABLE) ? CURL_CSELECT_IN : 0) | ((events & UV_WRITABLE) ? CURL_CSELECT_OUT : 0);
    socket_action(w->lane, w->fd, flags);
}

static void watch_closed(uv_handle_t *h)
{
    free(h->data);
}

static int on_socket(CURL *easy, curl_socket_t fd, int what, void *userp, void *socketp)
{
    (void)easy;
    lane *l = userp;
    sock_watch *w = socketp;
    if (what == CURL_POLL_REMOVE) {
        if (w) {
            curl_multi_assign(l->multi, fd, NULL);
            uv_close((uv_handle_t *)&w->poll, watch_closed);
        }
        return 0;
    }
    if (!w) {
        w = cg_calloc(1, sizeof(*w));
        if (uv_poll_init_socket(l->pool->loop, &w->poll, fd) < 0) {
            free(w);
            return -1;
        }
        uv_unref((uv_handle_t *)&w->poll); /* see cg_http_pool_new */
        w->lane = l;
        w->fd = fd;
        w->poll.data = w;
        curl_multi_assign(l->multi, fd, w);
    }
    int events = (what & CURL_POLL_IN ? UV_READABLE : 0) | (what & CURL_POLL_OUT ? UV_WRITABLE : 0);
    uv_poll_start(&w->poll, events, on_poll);
    return 0;
}

static void on_curl_timeout(uv_timer_t *t);

static int on_curl_timer(CURLM *multi, long ms, void *userp)
{
    (void)multi;
    lane *l = userp;
    if (ms < 0)
        uv_timer_stop(&l->curl_timer);
    else
        uv_timer_start(&l->curl_timer, on_curl_timeout, (uint64_t)ms, 0);
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

/* ---- the lanes' multi handles ----------------------------------------------------------- */

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
 * is libcurl's default. Each lane has its own cache and bound, so a pool keeps up to
 * max_idle_connections idle in each lane that ran transfers in the last idle_keepalive_ms.
 */
static void cache_bound(lane *l)
{
    if (l->multi && l->pool->cfg->max_idle_connections > 0)
        curl_multi_setopt(l->multi, CURLMOPT_MAXCONNECTS,
                          (l->added > 0 ? l->added - 1 : 0) + (long)l->pool->cfg->max_idle_connections);
}

/* Puts the transfer into its lane's multi handle; -1 when libcurl refuses it. */
static int transfer_add(transfer *t)
{
    lane *l = t->lane;
    if (curl_multi_add_handle(l->multi, t->easy) != CURLM_OK)
        return -1;
    t->added = 1;
    l->added++;
    cache_bound(l);
    return 0;
}

static int multi_open(lane *l)
{
    if (l->multi)
        return 0;
    l->multi = curl_multi_init();
    if (!l->multi)
        return -1;
    curl_multi_setopt(l->multi, CURLMOPT_SOCKETFUNCTION, on_socket);
    curl_multi_setopt(l->multi, CURLMOPT_SOCKETDATA, l);
    curl_multi_setopt(l->multi, CURLMOPT_TIMERFUNCTION, on_curl_timer);
    curl_multi_setopt(l->multi, CURLMOPT_TIMERDATA, l);
    cache_bound(l);
    return 0;
}

/* Every idle connection of the lane closed: its multi handle goes with them (a new one
 * comes with its next transfer; the TLS sessions stay in the share). */
static void multi_close(lane *l)
{
    if (!l->multi || l->transfers > 0)
        return;
    l->pool->in_curl++;
    curl_multi_cleanup(l->multi);
    l->pool->in_curl--;
    l->multi = NULL;
    uv_timer_stop(&l->curl_timer);
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
    lane *l = t->data;
    if (l->transfers == 0 && l->multi)
        cg_debug("upstream '%s': closing the idle connections of lane %d (%ld open in all)", l->pool->cfg->name,
                 (int)(l - l->pool->lanes), l->pool->open);
    multi_close(l);
}

/* A lane with no transfer closes its connections after idle_keepalive_ms. */
static void arm_idle(lane *l)
{
    if (l->transfers > 0 || !l->multi)
        uv_timer_stop(&l->idle);
    else
        uv_timer_start(&l->idle, on_idle_timeout, (uint64_t)keepalive_ms(l->pool), 0);
}

/* The transfer leaves the pool: out of the multi handle, cleaned up, its owner told. */
static void transfer_end(cg_http_pool *p, transfer *t, CURLcode result)
{
    lane *l = t->lane;
    if (t->added) {
        curl_multi_remove_handle(l->multi, t->easy); /* an unfinished one's connection closes */
        l->added--;
        cache_bound(l);
    }
    l->transfers--;
    arm_idle(l); /* its last transfer: its connections close after idle_keepalive_ms */
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

/* The owners hear of the lane's ended transfers; what they start or stop meanwhile waits
 * (in_curl). */
static void finish_done(lane *l)
{
    cg_http_pool *p = l->pool;
    CURLMsg *msg;
    int left;
    p->in_curl++;
    while (l->multi && (msg = curl_multi_info_read(l->multi, &left))) {
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
        if (!t->added && transfer_add(t) < 0) {
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

static void socket_action(lane *l, curl_socket_t fd, int events)
{
    cg_http_pool *p = l->pool;
    if (!l->multi)
        return;
    int running;
    p->in_curl++;
    curl_multi_socket_action(l->multi, fd, events, &running);
    p->in_curl--;
    if (p->in_curl)
        return;
    finish_done(l);
    apply_pending(p);
    arm_idle(l); /* an event of an idle lane's connection: idle from now */
}

static void on_curl_timeout(uv_timer_t *t)
{
    socket_action(t->data, CURL_SOCKET_TIMEOUT, 0);
}

static void on_kick(uv_timer_t *t)
{
    cg_http_pool *p = t->data;
    apply_pending(p);
    for (int i = 0; i < LANES_MAX && p->lanes[i].ready; i++)
        finish_done(&p->lanes[i]);
}

/* Sets up lane i at its first use: its timers (the pool's handles, closed with it). */
static lane *lane_ready(cg_http_pool *p, int i)
{
    lane *l = &p->lanes[i];
    if (!l->ready) {
        l->pool = p;
        uv_timer_init(p->loop, &l->curl_timer);
        uv_timer_init(p->loop, &l->idle);
        l->curl_timer.data = l->idle.data = l;
        uv_unref((uv_handle_t *)&l->curl_timer); /* see cg_http_pool_new */
        uv_unref((uv_handle_t *)&l->idle);
        p->handles += 2;
        l->ready = 1;
    }
    return l;
}

/* The lane of a new transfer: the first with room (replies_per_handle; a configuration
 * made without it gets the default), else, every lane full, the one running fewest. */
static lane *lane_for_next(cg_http_pool *p)
{
    long per = p->cfg->replies_per_handle > 0 ? p->cfg->replies_per_handle : CG_REPLIES_PER_HANDLE;
    int emptiest = 0;
    for (int i = 0; i < LANES_MAX; i++) {
        lane *l = &p->lanes[i];
        if (!l->ready || l->transfers < per)
            return lane_ready(p, i);
        if (l->transfers < p->lanes[emptiest].transfers)
            emptiest = i;
    }
    return &p->lanes[emptiest];
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
    uv_timer_init(loop, &p->kick);
    p->kick.data = p;
    p->handles = 1;
    /* The pool's handles (the lanes' too) do not keep the loop running: at the gateway's
     * stop, its sessions (whose calls these are) are gone first, and idle connections are
     * not a reason to stay; cg_upstream_close (the gateway's stop) frees the pool. */
    uv_unref((uv_handle_t *)&p->kick);
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
    if (p->freeing)
        return -1;
    lane *l = lane_for_next(p);
    if (multi_open(l) < 0)
        return -1;
    transfer *t = cg_calloc(1, sizeof(*t));
    t->easy = easy;
    t->lane = l;
    t->done = done;
    t->data = data;
    curl_easy_setopt(easy, CURLOPT_PRIVATE, t);
    if (!p->in_curl) {
        if (transfer_add(t) < 0) {
            free(t);
            return -1;
        }
    } else {
        p->asked = 1;
        uv_timer_start(&p->kick, on_kick, 0, 0);
    }
    l->transfers++;
    LIST_INSERT_HEAD(&p->transfers, t, link);
    uv_timer_stop(&l->idle);
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

/* One of the pool's uv handles closed: the pool goes with the last. */
static void handle_closed(cg_http_pool *p)
{
    if (--p->handles == 0) {
        curl_share_cleanup(p->share);
        free(p);
    }
}

static void pool_handle_closed(uv_handle_t *h)
{
    handle_closed(h->data);
}

static void lane_handle_closed(uv_handle_t *h)
{
    handle_closed(((lane *)h->data)->pool);
}

void cg_http_pool_free(cg_http_pool *p)
{
    if (!p || p->freeing)
        return;
    p->freeing = 1;
    while (!LIST_EMPTY(&p->transfers))
        transfer_end(p, LIST_FIRST(&p->transfers), CURLE_ABORTED_BY_CALLBACK);
    for (int i = 0; i < LANES_MAX && p->lanes[i].ready; i++) {
        lane *l = &p->lanes[i];
        multi_close(l);
        uv_close((uv_handle_t *)&l->curl_timer, lane_handle_closed);
        uv_close((uv_handle_t *)&l->idle, lane_handle_closed);
    }
    uv_close((uv_handle_t *)&p->kick, pool_handle_closed);
}
