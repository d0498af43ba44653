/*
 * net.c: resolving host names off the event loop, and opening lws client connections on the
 * gateway's lws context, close frames, and frames written whole (see net.h).
 */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <openssl/rand.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>

#include "chatgate/core/alloc.h"
#include "chatgate/core/net.h"
#include "chatgate/core/buf.h"
#include "chatgate/core/utf8.h"

/*
 * A resolution in flight. uv_getaddrinfo cannot be stopped once it runs on the thread
 * pool, so abandoning only clears `done`; the request frees itself when libuv calls back.
 */
struct cg_resolve {
    uv_getaddrinfo_t req;
    uv_idle_t idle; /* numeric addresses still answer from the loop, never from start */
    cg_resolve_fn done;
    void *data;
    char address[INET6_ADDRSTRLEN];
};

static void resolve_idle_closed(uv_handle_t *h)
{
    free(h->data);
}

static void resolve_numeric(uv_idle_t *idle)
{
    cg_resolve *r = idle->data;
    uv_idle_stop(idle);
    if (r->done)
        r->done(r->data, r->address, NULL);
    uv_close((uv_handle_t *)idle, resolve_idle_closed);
}

static void resolve_done(uv_getaddrinfo_t *req, int status, struct addrinfo *res)
{
    cg_resolve *r = req->data;
    char err[160];
    const char *address = NULL;
    /* IPv4 first, as hiredis and most clients do: "localhost" often lists ::1 first, and a
     * server bound to 127.0.0.1 only would refuse every connect (one address is tried) */
    const struct addrinfo *pick = NULL;
    for (const struct addrinfo *ai = status == 0 ? res : NULL; ai; ai = ai->ai_next) {
        if (ai->ai_family == AF_INET) {
            pick = ai;
            break;
        }
        if (!pick && ai->ai_family == AF_INET6)
            pick = ai;
    }
    if (pick) {
        const void *a = pick->ai_family == AF_INET6 ? (const void *)&((struct sockaddr_in6 *)pick->ai_addr)->sin6_addr
                                                    : (const void *)&((struct sockaddr_in *)pick->ai_addr)->sin_addr;
        if (inet_ntop(pick->ai_family, a, r->address, sizeof(r->address)))
            address = r->address;
    }
    if (!address)
        snprintf(err, sizeof(err), "could not resolve the host: %s", status ? uv_strerror(status) : "no address");
    if (r->done)
        r->done(r->data, address, address ? NULL : err);
    uv_freeaddrinfo(res);
    free(r);
}

cg_resolve *cg_resolve_start(uv_loop_t *loop, const char *host, cg_resolve_fn done, void *data)
{
    cg_resolve *r = cg_calloc(1, sizeof(*r));
    r->done = done;
    r->data = data;
    unsigned char buf[sizeof(struct in6_addr)];
    if (inet_pton(AF_INET, host, buf) == 1 || inet_pton(AF_INET6, host, buf) == 1) {
        snprintf(r->address, sizeof(r->address), "%s", host);
        uv_idle_init(loop, &r->idle);
        r->idle.data = r;
        uv_idle_start(&r->idle, resolve_numeric);
        return r;
    }
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM};
    r->req.data = r;
    if (uv_getaddrinfo(loop, &r->req, resolve_done, host, NULL, &hints) < 0) {
        free(r);
        return NULL;
    }
    return r;
}

void cg_resolve_abandon(cg_resolve *r)
{
    r->done = NULL;
}

const lws_retry_bo_t cg_net_no_lws_keepalive;

struct lws *cg_net_connect(const cg_net *net, const cg_connect_spec *spec, void *opaque, struct lws **pwsi)
{
    struct lws_client_connect_info i;
    memset(&i, 0, sizeof(i));
    i.context = net->lws;
    i.vhost = net->vhost;
    i.address = spec->address;
    i.port = spec->port;
    i.path = spec->path;
    i.host = spec->host;
    i.origin = NULL; /* lws would write "http://" before it: whoever needs one appends it */
    i.protocol = spec->subprotocol;
    i.ssl_connection = spec->tls ? LCCSCF_USE_SSL : 0;
    i.local_protocol_name = spec->local_protocol;
    i.opaque_user_data = opaque;
    i.pwsi = pwsi;
    /* without a policy lws would use its context's default, a ping every 300 s */
    i.retry_and_idle_policy = &cg_net_no_lws_keepalive;
    return lws_client_connect_via_info(&i);
}

/* The last client connection whose server certificate OpenSSL refused, and why: lws reports
 * the refusal to protocols[0] and then the connection's failure to its own protocol, with a
 * text that does not say why ("connect SSL err 1: error:00000001:lib(0)::reason(1)"), at
 * once and in that order; one slot is enough. */
static struct {
    const struct lws *wsi;
    char why[192];
} tls_refusal;

/*
 * lws 4.1.6 takes the name a certificate must be for from the Host header's text, cut at its
 * first ':' to drop the port, so an IPv6 literal ("[::1]:8443") is checked as "[" and never
 * matches. Such a name is checked here instead: the certificate must be for the IPv6 address
 * the connection went to, which is the literal itself (a literal is not resolved). Any other
 * name lws checks as it is.
 */
static int ipv6_literal_matches(X509_STORE_CTX *ctx, SSL *ssl)
{
    if (!ssl || X509_STORE_CTX_get_error(ctx) != X509_V_ERR_HOSTNAME_MISMATCH)
        return 0;
    const char *name = X509_VERIFY_PARAM_get0_host(SSL_get0_param(ssl), 0);
    X509 *cert = X509_STORE_CTX_get_current_cert(ctx);
    struct sockaddr_in6 peer;
    socklen_t len = sizeof(peer);
    int fd = SSL_get_fd(ssl);
    if (!name || strcmp(name, "[") != 0 || !cert || fd < 0 || getpeername(fd, (struct sockaddr *)&peer, &len) != 0 ||
        peer.sin6_family != AF_INET6)
        return 0;
    return X509_check_ip(cert, (const unsigned char *)&peer.sin6_addr, sizeof(peer.sin6_addr), 0) == 1;
}

/* What a refusal's reason leaves unsaid: where trust comes from. */
static const char *refusal_hint(int err)
{
    switch (err) {
    case X509_V_ERR_DEPTH_ZERO_SELF_SIGNED_CERT:
    case X509_V_ERR_SELF_SIGNED_CERT_IN_CHAIN:
    case X509_V_ERR_UNABLE_TO_GET_ISSUER_CERT_LOCALLY:
    case X509_V_ERR_UNABLE_TO_VERIFY_LEAF_SIGNATURE:
        return " (neither the system's CA certificates nor tls_ca_file trust it)";
    case X509_V_ERR_HOSTNAME_MISMATCH:
    case X509_V_ERR_IP_ADDRESS_MISMATCH:
        return " (it is not for the host of the URL)";
    default:
        return "";
    }
}

void cg_net_tls_verified(const struct lws *wsi, void *x509_ctx, void *ssl, int preverify_ok)
{
    if (preverify_ok || !x509_ctx)
        return;
    X509_STORE_CTX *ctx = x509_ctx;
    if (ipv6_literal_matches(ctx, ssl)) {
        X509_STORE_CTX_set_error(ctx, X509_V_OK); /* lws then lets the handshake go on */
        return;
    }
    int err = X509_STORE_CTX_get_error(ctx);
    tls_refusal.wsi = wsi;
    snprintf(tls_refusal.why, sizeof(tls_refusal.why), "%s (certificate depth %d)%s", X509_verify_cert_error_string(err),
             X509_STORE_CTX_get_error_depth(ctx), refusal_hint(err));
}

const char *cg_net_tls_refusal(const struct lws *wsi)
{
    if (!wsi || tls_refusal.wsi != wsi)
        return NULL;
    tls_refusal.wsi = NULL; /* taken: a later connection at the same address is another */
    return tls_refusal.why;
}

void cg_net_kill_async(const cg_net *net, struct lws *wsi, int reason)
{
    lws_set_timeout(wsi, (enum pending_timeout)reason, LWS_TO_KILL_ASYNC);
    lws_cancel_service(net->lws);
}

int cg_net_write_close(struct lws *wsi, int code, const char *reason)
{
    unsigned char close[LWS_PRE + 2 + 123];
    size_t rl = strlen(reason);
    rl = cg_utf8_boundary(reason, rl > 123 ? 123 : rl);
    close[LWS_PRE] = (unsigned char)(code >> 8);
    close[LWS_PRE + 1] = (unsigned char)(code & 0xff);
    memcpy(close + LWS_PRE + 2, reason, rl);
    return lws_write(wsi, close + LWS_PRE, 2 + rl, (enum lws_write_protocol)CG_LWS_WRITE_CLOSE);
}

/* An RFC 6455 header of a final text (or binary) frame of len bytes into hdr (at least 10
 * bytes), with the MASK bit when masked (the caller appends the 4-byte key); its size. */
static size_t frame_header(unsigned char *hdr, size_t len, int binary, int masked)
{
    size_t h = 2;
    hdr[0] = binary ? 0x82 : 0x81; /* FIN, binary or text */
    if (len < 126) {
        hdr[1] = (unsigned char)len;
    } else if (len <= 0xffff) {
        hdr[1] = 126;
        hdr[2] = (unsigned char)(len >> 8);
        hdr[3] = (unsigned char)len;
        h = 4;
    } else {
        hdr[1] = 127;
        for (int i = 0; i < 8; i++)
            hdr[2 + i] = (unsigned char)((uint64_t)len >> (56 - 8 * i));
        h = 10;
    }
    if (masked)
        hdr[1] |= 0x80;
    return h;
}

void cg_net_batch_add(cg_net_batch *b, const char *data, size_t len, int binary)
{
    unsigned char hdr[10];
    size_t h = frame_header(hdr, len, binary, 0);
    cg_buf_append(&b->buf, &b->len, &b->cap, hdr, h, 1024);
    cg_buf_append(&b->buf, &b->len, &b->cap, data, len, 1024);
}

/*
 * Masking keys, drawn from OpenSSL's generator a pool at a time (RFC 6455 5.3 asks for
 * keys a peer cannot predict). The pool is emptied in a forked child (--workers), so that
 * no two processes use the same keys.
 */
static unsigned char mask_pool[4096];
static size_t mask_used = sizeof(mask_pool);

static void mask_pool_forget(void)
{
    mask_used = sizeof(mask_pool);
}

static int next_mask(unsigned char key[4])
{
    static int at_fork;
    if (!at_fork) {
        pthread_atfork(NULL, NULL, mask_pool_forget);
        at_fork = 1;
    }
    if (mask_used == sizeof(mask_pool)) {
        if (RAND_bytes(mask_pool, (int)sizeof(mask_pool)) != 1)
            return -1;
        mask_used = 0;
    }
    memcpy(key, mask_pool + mask_used, 4);
    mask_used += 4;
    return 0;
}

size_t cg_net_client_frame(unsigned char *payload, size_t len, int binary)
{
    unsigned char hdr[14], key[4];
    if (next_mask(key) < 0)
        return 0;
    size_t h = frame_header(hdr, len, binary, 1);
    memcpy(hdr + h, key, 4);
    h += 4;
    memcpy(payload - h, hdr, h);
    /* eight bytes at a time: the key repeats every four, and i stays a multiple of four */
    unsigned char key8[8] = {key[0], key[1], key[2], key[3], key[0], key[1], key[2], key[3]};
    uint64_t k;
    memcpy(&k, key8, 8);
    size_t i = 0;
    for (; i + 8 <= len; i += 8) {
        uint64_t v;
        memcpy(&v, payload + i, 8);
        v ^= k;
        memcpy(payload + i, &v, 8);
    }
    for (; i < len; i++)
        payload[i] ^= key[i & 3];
    return h;
}

int cg_net_batch_write(struct lws *wsi, cg_net_batch *b)
{
    size_t len = b->len;
    b->len = 0;
    if (!len)
        return 0;
    return lws_write(wsi, (unsigned char *)b->buf, len, LWS_WRITE_HTTP) < (int)len ? -1 : 0;
}

void cg_net_batch_free(cg_net_batch *b)
{
    free(b->buf);
    *b = (cg_net_batch){0};
}
