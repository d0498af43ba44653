/*
 * worker.c: a worker of --workers N (worker.h): listening sockets of its own, shared with
 * the other workers through SO_REUSEPORT, whose connections are adopted by lws; and the
 * figures it copies into its slot of the shared memory (master.h) for /metrics.
 *
 * Accepting: a uv_poll on the listening socket (level-triggered) accepts up to
 * CG_ACCEPT_BATCH connections per wake-up and hands each to lws_adopt_socket_vhost(),
 * which closes it itself when it cannot take it. When the process runs out of descriptors
 * (EMFILE), the poll pauses for CG_ACCEPT_PAUSE_MS instead of waking at once again for the
 * same connection: the pending connections wait in the kernel's backlog.
 */
#define _GNU_SOURCE /* accept4 */
#include <uv.h>
#include <libwebsockets.h>

#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "chatgate/core/log.h"
#include "chatgate/server/master.h"
#include "chatgate/server/worker.h"

#define CG_ACCEPT_BATCH 64
#define CG_ACCEPT_PAUSE_MS 100
#define CG_MAX_LISTENERS 2

typedef struct listener {
    uv_poll_t poll;
    uv_timer_t pause; /* resumes accepting after EMFILE */
    int fd;
    int open;
    struct lws_vhost *vh;
    const char *what;
} listener;

static listener listeners[CG_MAX_LISTENERS];
static uv_timer_t publish_timer;
static int publishing;

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
        if (!lws_adopt_socket_vhost(l->vh, fd)) /* it closed fd */
            cg_warn("%s: libwebsockets could not take a new connection", l->what);
    }
}

/* A listening socket on host:port with SO_REUSEPORT: -1 (logged) or the fd. The name is
 * resolved before the loop serves anything (the worker's start). */
static int open_socket(const char *host, int port, const char *what)
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
        cg_error("%s: cannot listen on %s:%d: %s (with --workers, an address or a host name, not an interface)",
                 what, host, port, gai_strerror(rc));
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
            setsockopt(fd, SOL_SOCKET, SO_REUSEPORT, &one, sizeof(one)) < 0 ||
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

int cg_worker_listen(uv_loop_t *loop, struct lws_vhost *vh, const char *host, int port, const char *what)
{
    listener *l = NULL;
    for (int i = 0; i < CG_MAX_LISTENERS && !l; i++)
        if (!listeners[i].open)
            l = &listeners[i];
    if (!l) {
        cg_error("%s: too many listeners", what);
        return -1;
    }
    int fd = open_socket(host, port, what);
    if (fd < 0)
        return -1;
    *l = (listener){.fd = fd, .open = 1, .vh = vh, .what = what};
    uv_poll_init(loop, &l->poll, fd);
    uv_timer_init(loop, &l->pause);
    l->poll.data = l->pause.data = l;
    uv_poll_start(&l->poll, UV_READABLE, on_readable);
    return 0;
}

void cg_worker_publish(const cg_server *srv)
{
    cg_worker_slot *slot = cg_worker_self();
    if (!slot)
        return;
    slot->metrics = srv->metrics;
    slot->connections = srv->n_sessions;
    if (srv->turn.store) {
        slot->store = srv->turn.store->stats;
        /* the outage going on counts too */
        slot->store.degraded_seconds = cg_store_degraded_seconds(&srv->turn.store->stats, uv_now(srv->net.loop));
    }
}

static void on_publish(uv_timer_t *t)
{
    cg_worker_publish(t->data);
}

void cg_worker_publish_start(const cg_server *srv)
{
    if (!cg_worker_self())
        return;
    uv_timer_init(srv->net.loop, &publish_timer);
    publish_timer.data = (void *)srv;
    uv_timer_start(&publish_timer, on_publish, CG_WORKER_PUBLISH_MS, CG_WORKER_PUBLISH_MS);
    publishing = 1;
}

static void on_poll_closed(uv_handle_t *h)
{
    listener *l = h->data;
    close(l->fd); /* after the poll let go of it */
    l->fd = -1;
}

void cg_worker_stop(const cg_server *srv)
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
    if (publishing) {
        cg_worker_publish(srv);
        uv_timer_stop(&publish_timer);
        uv_close((uv_handle_t *)&publish_timer, NULL);
        publishing = 0;
    }
}
