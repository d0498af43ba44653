/*
 * http_pool.h: the kept-alive HTTP/1.1 connections of one OpenAI-compatible upstream
 * (src/upstream/http_pool.c), libcurl's multi interface driven by the gateway's libuv loop.
 *
 * Why libcurl and not lws's client: lws 4.1.6 can keep one idle client connection per
 * endpoint (LCCSCF_PIPELINE, keep_warm_secs), but every request to the same endpoint then
 * queues behind that one socket (two streaming replies would run one after the other), it
 * only finds the idle socket when the Host header equals the numeric address, and it keeps
 * no TLS sessions. libcurl keeps a bounded cache of idle connections per multi handle,
 * resumes TLS sessions (kept in a share handle), closes a connection whose response was
 * not read to its end, or that answered `Connection: close` or HTTP/1.0, and retries a
 * request once on a fresh connection when a kept one turns out dead before any answer.
 *
 * The pool owns its multi handles (one for each replies_per_handle transfers at once, up to
 * 64: http_pool.c says why), its uv handles and the sockets; a transfer (one easy handle) is
 * the caller's until cg_http_pool_start takes it (0: the pool frees it however it ends;
 * -1: still the caller's, to free). cg_http_pool_start adds it: `done` is called once,
 * from the loop and outside any libcurl callback, when the transfer ends by itself (the easy handle
 * is then cleaned up by the pool). cg_http_pool_stop takes it out early (a cancel, a
 * timeout, a reply we refuse); libcurl then closes its connection rather than keep it,
 * which is how the backend learns to stop generating; `done` still comes, with
 * CURLE_ABORTED_BY_CALLBACK, at once or (asked from inside libcurl) soon after. Until done
 * the transfer's own callbacks may still run.
 *
 * Idle connections: at most max_idle_connections are kept besides the busy ones, in each
 * multi handle (CURLMOPT_MAXCONNECTS, which counts both, follows its transfers); one idle
 * longer than idle_keepalive_ms, or than the server's own `Keep-Alive: timeout=N` less a
 * second, is not used again (CURLOPT_MAXAGE_CONN, whole seconds); and when nothing has run
 * in a multi handle for idle_keepalive_ms the pool closes all of its connections (libcurl
 * itself closes an old one only when it looks for a connection).
 */
#ifndef CHATGATE_UPSTREAM_HTTP_POOL_H
#define CHATGATE_UPSTREAM_HTTP_POOL_H

#include <curl/curl.h>
#include <uv.h>

#include "chatgate/config/config.h"
#include "chatgate/core/metrics.h"

typedef struct cg_http_pool cg_http_pool;
typedef void (*cg_http_done_fn)(void *data, CURLcode result);

/* A pool for the upstream cfg on loop, whose TLS connections trust ca (tls_ca_file, may be
 * NULL) besides the system's CAs; metrics (may be NULL) gets its counters at index. NULL
 * when libcurl cannot start. */
cg_http_pool *cg_http_pool_new(uv_loop_t *loop, const cg_upstream_config *cfg, const struct cg_tls_ca *ca,
                               cg_metrics *metrics, int index);

/* A new easy handle with the pool's settings (its sockets, the TLS session share, the idle
 * age); the caller sets the request and owns the handle until cg_http_pool_start takes it.
 * NULL on failure. */
CURL *cg_http_pool_easy(cg_http_pool *p);

/* Runs the transfer; -1 when it could not be added (done is then never called). */
int cg_http_pool_start(cg_http_pool *p, CURL *easy, cg_http_done_fn done, void *data);

/* Takes a running transfer out; an unfinished one's connection is closed, not kept. */
void cg_http_pool_stop(cg_http_pool *p, CURL *easy);

/* Stops reading the transfer's response (paused 1) or reads on (0, from the loop soon:
 * data libcurl held comes out then, never from inside this call). */
void cg_http_pool_pause(cg_http_pool *p, CURL *easy, int paused);

/* The request of a running transfer goes out on a connection (CURLOPT_PREREQFUNCTION
 * time): counted as a reuse when the connection was kept from before, as a TLS resumption
 * when it is new and its handshake resumed a session; from here until the
 * transfer ends its connection is busy, not idle. */
void cg_http_pool_sending(cg_http_pool *p, CURL *easy);

/* A response header line: notes a `Keep-Alive: timeout=N`. */
void cg_http_pool_header(cg_http_pool *p, const char *line, size_t len);

/* Closes every connection and frees the pool once its handles are closed. Transfers still
 * running end now: their `done` comes from inside this call, with
 * CURLE_ABORTED_BY_CALLBACK. */
void cg_http_pool_free(cg_http_pool *p);

#endif
