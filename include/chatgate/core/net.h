/*
 * net.h: what every network client of the gateway shares (the Redis store, the upstreams,
 * the drop-in app connections): resolving a host name off the event loop, and opening an
 * lws client connection on the gateway's one lws context; and writing a close frame, which
 * the client side and the server side of the gateway both do.
 *
 * cg_net is the narrow handle these clients get instead of the gateway: the loop, the lws
 * context and the vhost their connections belong to. The gateway fills it at start.
 */
#ifndef CHATGATE_CORE_NET_H
#define CHATGATE_CORE_NET_H

#include <uv.h>
#include <libwebsockets.h>

typedef struct cg_net {
    uv_loop_t *loop;
    struct lws_context *lws;
    struct lws_vhost *vhost;
    struct cg_flusher *flush; /* output written once per loop iteration (flush.h) */
    struct cg_keepalive *keepalive; /* pings of quiet WebSocket connections (keepalive.h) */
    const struct cg_tls_ca *tls_ca; /* CA certificates trusted besides the system's (tls_ca.h), or NULL */
} cg_net;

/*
 * Resolves host off the loop (uv_getaddrinfo on libuv's thread pool; numeric addresses skip
 * it) and calls done(data, address, err) on the loop with a numeric address (an IPv4 one
 * when the name has both), or address NULL and a message in err; never from inside start.
 * The returned handle lets the caller give up: cg_resolve_abandon() makes done never be
 * called. NULL when the lookup could not be started.
 */
typedef struct cg_resolve cg_resolve;
typedef void (*cg_resolve_fn)(void *data, const char *address, const char *err);
cg_resolve *cg_resolve_start(uv_loop_t *loop, const char *host, cg_resolve_fn done, void *data);
void cg_resolve_abandon(cg_resolve *r);

/* Where and how one lws client connection goes (cg_net_connect); NULLs for the defaults. */
typedef struct cg_connect_spec {
    const char *host;           /* host[:port] for the Host header; without the port, the TLS name */
    int port;
    int tls;
    const char *address;        /* numeric, resolved */
    const char *path;
    const char *subprotocol;    /* Sec-WebSocket-Protocol to ask for */
    const char *local_protocol; /* our lws protocol that handles the connection */
} cg_connect_spec;

/* lws's pings and idle hang-up turned off (a policy of zeros), for the context's accepted
 * connections and every client one: the keepalive does them (keepalive.h says why). */
extern const lws_retry_bo_t cg_net_no_lws_keepalive;

/* Starts an lws client connection as spec says, with opaque as the wsi's opaque user data;
 * lws stores the wsi in *pwsi before any callback. NULL on failure (a CLIENT_CONNECTION_ERROR
 * callback may already have run). */
struct lws *cg_net_connect(const cg_net *net, const cg_connect_spec *spec, void *opaque, struct lws **pwsi);

/*
 * Closes wsi soon, from anywhere on the loop (lws_set_timeout with LWS_TO_KILL_ASYNC, and
 * `reason` for lws's log). lws 4.1 on libuv looks at its timeouts only after it serviced a
 * socket, so a kill asked from our own timer or flush would wait for the next unrelated
 * event; lws_cancel_service() makes that event now.
 */
void cg_net_kill_async(const cg_net *net, struct lws *wsi, int reason);

/* LWS_WRITE_CLOSE, which lws 4.1's public header leaves out (lws_close_reason() followed by
 * returning -1 did not send the frame: the peer saw 1006). */
#define CG_LWS_WRITE_CLOSE 4

/* Writes a close frame with code and reason (cut to the 123 bytes a close frame holds, on a
 * UTF-8 character boundary); lws_write()'s result. From wsi's writable callback only. */
int cg_net_write_close(struct lws *wsi, int code, const char *reason);

/* LWS_CALLBACK_OPENSSL_PERFORM_SERVER_CERT_VERIFICATION (to protocols[0]: user is the
 * X509_STORE_CTX, in the SSL, len preverify_ok): a refusal is kept, with OpenSSL's reason,
 * for the connection's failure that follows; one lws cannot get right (a URL's IPv6 literal
 * host) is checked here and, when the certificate is for that address, overruled. */
void cg_net_tls_verified(const struct lws *wsi, void *x509_ctx, void *ssl, int preverify_ok);
/* Why wsi's server certificate was refused ("self-signed certificate (certificate depth
 * 0)"), once, or NULL when it was not: for the error of a client connection that failed. */
const char *cg_net_tls_refusal(const struct lws *wsi);

/*
 * Several finished text frames of a server connection, written with one send. lws writes
 * one frame per lws_write(), and so one send() per frame; a turn's delta and done, which
 * the app's reply brings in one read, then cost two trips through the kernel where a relay
 * like nginx makes one. lws has no call for several frames, so the batch carries them with
 * their RFC 6455 headers (FIN, text, unmasked: a server's; no extension is negotiated) and
 * goes out through lws_write(LWS_WRITE_HTTP), which lws passes through as bytes, keeping
 * what the kernel did not take as it does for any write.
 */
typedef struct cg_net_batch {
    char *buf;
    size_t len, cap;
} cg_net_batch;

/* The most a batch holds: frames past it wait for the next one (a send of 16 KiB is as cheap
 * as a smaller one; the batch's buffer is the process's, kept at that size). */
#define CG_NET_BATCH_BYTES 16384

/* Appends one frame (data, len bytes; text, or binary when binary is 1) to b. */
void cg_net_batch_add(cg_net_batch *b, const char *data, size_t len, int binary);

/* Writes b's frames and empties b (its buffer is kept for the next batch); -1 when the
 * socket failed. Outside wsi's callbacks too, as lws_write() is. */
int cg_net_batch_write(struct lws *wsi, cg_net_batch *b);

/* Frees b's buffer. */
void cg_net_batch_free(cg_net_batch *b);

/*
 * A client's text frame (binary: a binary one), made in place for lws_write(LWS_WRITE_HTTP): masks the len bytes
 * at payload with a fresh key and writes the header (FIN, text, MASK, length, key) into the
 * CG_NET_CLIENT_HEAD bytes before it (LWS_PRE bytes of headroom are enough). Returns the
 * header's size, the frame starting that far before payload; 0 when no key could be drawn.
 * lws masks each frame itself, but reads the key from /dev/urandom, one read() per frame
 * to the app (the ws upstream, drop-in): this draws keys from OpenSSL a pool at a time instead.
 */
#define CG_NET_CLIENT_HEAD 14
size_t cg_net_client_frame(unsigned char *payload, size_t len, int binary);

#endif
