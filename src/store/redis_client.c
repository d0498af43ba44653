/*
 * redis_client.c: one connection to one Redis node (redis_client.h): a uv_tcp_t, OpenSSL
 * over memory BIOs when it is TLS, hiredis's formatter and reader, and the queue of
 * callbacks waiting for replies, in order.
 *
 * Life of a connection: CONNECTING (TCP) -> HANDSHAKE (TLS only) -> UP -> CLOSED. Commands
 * queued before UP wait in the output buffer. Closing runs the waiting callbacks with NULL,
 * closes the handle, and frees the connection in the handle's close callback; a close from
 * inside one of the connection's callbacks only marks it, and the dispatch that called the
 * callback finishes the job when it returns (`depth`).
 */
#include "chatgate/core/alloc.h"
#include "chatgate/store/redis_client.h"

#include <hiredis/hiredis.h>
#include <hiredis/read.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>

#include <arpa/inet.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chatgate/core/flush.h"

#define READ_CHUNK 16384

typedef enum { C_CONNECTING, C_HANDSHAKE, C_UP, C_CLOSED } conn_state;

struct cg_redis_tls {
    SSL_CTX *ctx;
    char *server_name;
    int verify;
};

typedef struct pending {
    cg_redis_reply_fn *cb;
    void *priv;
    struct pending *next;
} pending;

typedef struct write_req {
    uv_write_t req;
    char data[];
} write_req;

struct cg_redis_conn {
    uv_tcp_t tcp;
    uv_connect_t connect;
    conn_state state;
    void *data;
    cg_redis_event_fn *on_event;
    char peer[64];
    char host[256]; /* the URL's host: the TLS name checked */
    cg_redis_tls *tls;
    SSL *ssl;
    BIO *rbio, *wbio; /* network side of the TLS engine: what came, what must go */
    redisReader *reader;
    pending *head, *tail; /* waiting for their replies, oldest first */
    cg_redis_reply_fn *push_cb; /* SUBSCRIBEd: every reply goes here */
    void *push_priv;
    char *out; /* commands not yet written (plain text; TLS encrypts at the write) */
    size_t out_len, out_cap;
    cg_flusher *flusher;
    cg_flush_item flush;
    char rbuf[READ_CHUNK];
    unsigned readonly;
    int answered;    /* a reply came: TLS is surely done (TLS 1.3 refuses a client late) */
    int depth;       /* inside our callbacks: a close waits for the outermost to return */
    int close_asked; /* 1: at once, 2: graceful (when no reply is due) */
    int event_due;   /* the gone event is still to be given (not after cg_redis_conn_close) */
    char why[256];
};

/* ---- TLS context ------------------------------------------------------------------------ */

static void tls_error(char *err, size_t errlen, const char *what, const char *file)
{
    unsigned long e = ERR_get_error();
    char detail[160] = "";
    if (e)
        ERR_error_string_n(e, detail, sizeof(detail));
    ERR_clear_error();
    snprintf(err, errlen, "redis TLS: %s%s%s: %s", what, file ? " " : "", file ? file : "", e ? detail : "refused");
}

cg_redis_tls *cg_redis_tls_new(const cg_redis_tls_config *cfg, char *err, size_t errlen)
{
    cg_redis_tls *t = cg_calloc(1, sizeof(*t));
    if (!(t->ctx = SSL_CTX_new(TLS_client_method()))) {
        snprintf(err, errlen, "redis TLS: OpenSSL could not make a context");
        free(t);
        return NULL;
    }
    SSL_CTX_set_min_proto_version(t->ctx, TLS1_2_VERSION);
    t->verify = cfg->verify;
    if (cfg->ca_file) {
        if (SSL_CTX_load_verify_locations(t->ctx, cfg->ca_file, NULL) != 1) {
            tls_error(err, errlen, "cannot read the CA certificates of redis.tls_ca_file", cfg->ca_file);
            goto fail;
        }
    } else if (SSL_CTX_set_default_verify_paths(t->ctx) != 1) {
        tls_error(err, errlen, "cannot read the system's CA certificates", NULL);
        goto fail;
    }
    if (cfg->cert_file) {
        const char *key = cfg->key_file ? cfg->key_file : cfg->cert_file;
        if (SSL_CTX_use_certificate_chain_file(t->ctx, cfg->cert_file) != 1) {
            tls_error(err, errlen, "cannot read the client certificate of redis.tls_cert_file", cfg->cert_file);
            goto fail;
        }
        if (SSL_CTX_use_PrivateKey_file(t->ctx, key, SSL_FILETYPE_PEM) != 1) {
            tls_error(err, errlen, "cannot read the client key of redis.tls_key_file", key);
            goto fail;
        }
        if (SSL_CTX_check_private_key(t->ctx) != 1) {
            tls_error(err, errlen, "the key does not match the certificate", cfg->cert_file);
            goto fail;
        }
    } else if (cfg->key_file) {
        snprintf(err, errlen, "redis TLS: redis.tls_key_file %s without redis.tls_cert_file", cfg->key_file);
        goto fail;
    }
    SSL_CTX_set_verify(t->ctx, t->verify ? SSL_VERIFY_PEER : SSL_VERIFY_NONE, NULL);
    if (cfg->server_name)
        t->server_name = cg_strdup(cfg->server_name);
    return t;
fail:
    cg_redis_tls_free(t);
    return NULL;
}

void cg_redis_tls_free(cg_redis_tls *t)
{
    if (!t)
        return;
    SSL_CTX_free(t->ctx);
    free(t->server_name);
    free(t);
}

/* Why a handshake failed, in words an operator can act on. */
static void handshake_failed_why(cg_redis_conn *c, char *why, size_t len)
{
    long v = SSL_get_verify_result(c->ssl);
    if (v != X509_V_OK) {
        const char *hint = "";
        if (v == X509_V_ERR_UNABLE_TO_GET_ISSUER_CERT_LOCALLY || v == X509_V_ERR_DEPTH_ZERO_SELF_SIGNED_CERT ||
            v == X509_V_ERR_SELF_SIGNED_CERT_IN_CHAIN || v == X509_V_ERR_UNABLE_TO_VERIFY_LEAF_SIGNATURE)
            hint = " (no CA of redis.tls_ca_file, or of the system's, signed it)";
        else if (v == X509_V_ERR_HOSTNAME_MISMATCH || v == X509_V_ERR_IP_ADDRESS_MISMATCH)
            hint = " (it is not for the host of the URL, or redis.tls_server_name)";
        snprintf(why, len, "its TLS certificate was refused: %s%s", X509_verify_cert_error_string(v), hint);
        ERR_clear_error();
        return;
    }
    unsigned long e = ERR_get_error();
    char detail[160] = "the server closed the connection (does it want a client certificate: redis.tls_cert_file?)";
    if (e)
        ERR_error_string_n(e, detail, sizeof(detail));
    ERR_clear_error();
    snprintf(why, len, "TLS handshake failed: %s", detail);
}

/* ---- closing ------------------------------------------------------------------------------ */

static void on_handle_closed(uv_handle_t *h)
{
    cg_redis_conn *c = h->data;
    if (c->ssl)
        SSL_free(c->ssl); /* and its BIOs */
    if (c->reader)
        redisReaderFree(c->reader);
    free(c->out);
    free(c);
}

/* The end: callbacks waiting get NULL (a callback of theirs may ask to close again: that is
 * a no-op now), the gone event if due, then the handle closes and frees c. */
static void finish(cg_redis_conn *c)
{
    if (c->state == C_CLOSED)
        return;
    c->state = C_CLOSED;
    cg_flush_cancel(&c->flush);
    c->depth++;
    while (c->head) {
        pending *p = c->head;
        c->head = p->next;
        if (p->cb)
            p->cb(c, NULL, p->priv);
        free(p);
    }
    c->tail = NULL;
    if (c->push_cb) {
        cg_redis_reply_fn *cb = c->push_cb;
        c->push_cb = NULL;
        cb(c, NULL, c->push_priv);
    }
    if (c->event_due && c->on_event)
        c->on_event(c, 0, c->close_asked == 2 ? NULL : c->why);
    c->depth--;
    uv_close((uv_handle_t *)&c->tcp, on_handle_closed);
}

/* The connection failed (why): closed now, or when the outermost callback returns. */
static void fail(cg_redis_conn *c, const char *why)
{
    if (c->state == C_CLOSED || c->close_asked == 1)
        return;
    if (!c->why[0] || c->close_asked == 2)
        snprintf(c->why, sizeof(c->why), "%s", why);
    c->close_asked = 1;
    if (c->depth == 0)
        finish(c);
}

/* A refused AUTH fails the connection: it would go on as Redis's default user, with its
 * rights. */
static void on_auth_checked(cg_redis_conn *c, void *reply_, void *priv)
{
    (void)priv;
    redisReply *reply = reply_;
    if (reply && reply->type == REDIS_REPLY_ERROR) {
        char why[200];
        snprintf(why, sizeof(why), "AUTH was answered '%.120s'", reply->str);
        fail(c, why);
    }
}

int cg_redis_conn_auth(cg_redis_conn *c, const char *user, const char *password, cg_redis_reply_fn *cb, void *priv)
{
    const char *argv[] = {"AUTH", user ? user : password, password};
    size_t len[] = {4, strlen(argv[1]), strlen(password)};
    return cg_redis_conn_argv(c, cb ? cb : on_auth_checked, priv, user ? 3 : 2, argv, len);
}

void cg_redis_conn_fail(cg_redis_conn *c, const char *why)
{
    if (c)
        fail(c, why);
}

void cg_redis_conn_close(cg_redis_conn *c)
{
    if (!c || c->state == C_CLOSED)
        return;
    c->event_due = 0;
    c->close_asked = 1;
    if (c->depth == 0)
        finish(c);
}

void cg_redis_conn_close_graceful(cg_redis_conn *c)
{
    if (!c || c->state == C_CLOSED || c->close_asked)
        return;
    c->close_asked = 2;
    if (!c->head && !c->push_cb && c->depth == 0)
        finish(c);
}

/* ---- writing ------------------------------------------------------------------------------ */

/* The socket failed (err, libuv's). Before the first answer on a TLS connection that is most
 * likely the server refusing this client (TLS 1.3 refuses a client certificate after the
 * client's side of the handshake is done, and resets): what OpenSSL read says why. */
static void io_failed(cg_redis_conn *c, int err)
{
    char why[240];
    if (c->ssl && !c->answered)
        handshake_failed_why(c, why, sizeof(why));
    else
        snprintf(why, sizeof(why), "%s", err == UV_EOF ? "the server closed the connection" : uv_strerror(err));
    fail(c, why);
}

static void on_written(uv_write_t *req, int status)
{
    cg_redis_conn *c = req->data;
    free(req);
    if (status < 0 && status != UV_ECANCELED)
        io_failed(c, status);
}

/* Sends bytes on the socket: what the kernel takes at once, the rest through uv_write (which
 * keeps the order: uv_try_write refuses while a write waits). */
static void send_bytes(cg_redis_conn *c, const char *buf, size_t len)
{
    uv_buf_t b = uv_buf_init((char *)buf, (unsigned)len);
    int n = uv_try_write((uv_stream_t *)&c->tcp, &b, 1);
    if (n == UV_EAGAIN || n == UV_ENOSYS)
        n = 0;
    if (n < 0) {
        io_failed(c, n);
        return;
    }
    if ((size_t)n == len)
        return;
    write_req *w = cg_malloc(sizeof(*w) + len - (size_t)n);
    memcpy(w->data, buf + n, len - (size_t)n);
    w->req.data = c;
    uv_buf_t rest = uv_buf_init(w->data, (unsigned)(len - (size_t)n));
    int rc = uv_write(&w->req, (uv_stream_t *)&c->tcp, &rest, 1, on_written);
    if (rc < 0) {
        free(w);
        io_failed(c, rc);
    }
}

/* What the TLS engine has produced for the network goes out. */
static void send_tls_output(cg_redis_conn *c)
{
    char buf[READ_CHUNK];
    int n;
    while (c->state != C_CLOSED && (n = BIO_read(c->wbio, buf, sizeof(buf))) > 0)
        send_bytes(c, buf, (size_t)n);
}

static void write_out(cg_redis_conn *c)
{
    if (c->state != C_UP || c->out_len == 0)
        return;
    if (!c->ssl) {
        size_t len = c->out_len;
        c->out_len = 0;
        send_bytes(c, c->out, len);
        return;
    }
    int n = SSL_write(c->ssl, c->out, (int)c->out_len); /* into the memory BIO: all of it */
    if (n <= 0) {
        int e = SSL_get_error(c->ssl, n);
        if (e != SSL_ERROR_WANT_READ && e != SSL_ERROR_WANT_WRITE) {
            char why[200];
            handshake_failed_why(c, why, sizeof(why));
            fail(c, why);
            return;
        }
    } else {
        memmove(c->out, c->out + n, c->out_len - (size_t)n);
        c->out_len -= (size_t)n;
    }
    send_tls_output(c);
}

static void on_flush(cg_flush_item *item)
{
    cg_redis_conn *c = (cg_redis_conn *)((char *)item - offsetof(cg_redis_conn, flush));
    write_out(c);
}

/* The end of the iteration writes what was queued, in one write (at once with no flusher, or
 * when the gateway's is gone). */
static void want_write(cg_redis_conn *c)
{
    if (c->state != C_UP || c->flush.pprev)
        return;
    if (!c->flusher || cg_flush_request_first(c->flusher, &c->flush, on_flush) < 0)
        write_out(c);
}

/* ---- commands ----------------------------------------------------------------------------- */

static int is_subscribe(const char *cmd, size_t len)
{
    /* "*N\r\n$L\r\nNAME\r\n": the name after the second line */
    const char *p = memchr(cmd, '\n', len);
    if (!p || (size_t)(p - cmd) + 1 >= len)
        return 0;
    p = memchr(p + 1, '\n', len - (size_t)(p + 1 - cmd));
    if (!p)
        return 0;
    p++;
    size_t left = len - (size_t)(p - cmd);
    return (left >= 10 && strncasecmp(p, "SUBSCRIBE\r", 10) == 0) ||
           (left >= 11 && strncasecmp(p, "SSUBSCRIBE\r", 11) == 0) ||
           (left >= 11 && strncasecmp(p, "PSUBSCRIBE\r", 11) == 0);
}

int cg_redis_conn_formatted(cg_redis_conn *c, cg_redis_reply_fn *cb, void *priv, const char *cmd, size_t len)
{
    if (!c || c->state == C_CLOSED || c->close_asked)
        return -1;
    if (c->out_len + len > c->out_cap) {
        size_t cap = c->out_cap ? c->out_cap : 4096;
        while (cap < c->out_len + len)
            cap *= 2;
        char *out = cg_realloc(c->out, cap);
        c->out = out;
        c->out_cap = cap;
    }
    if (is_subscribe(cmd, len)) {
        c->push_cb = cb;
        c->push_priv = priv;
    } else {
        pending *p = cg_malloc(sizeof(*p));
        p->cb = cb;
        p->priv = priv;
        p->next = NULL;
        if (c->tail)
            c->tail->next = p;
        else
            c->head = p;
        c->tail = p;
    }
    memcpy(c->out + c->out_len, cmd, len);
    c->out_len += len;
    want_write(c);
    return 0;
}

int cg_redis_conn_argv(cg_redis_conn *c, cg_redis_reply_fn *cb, void *priv, int argc, const char **argv,
                       const size_t *lens)
{
    char *cmd = NULL;
    int len = redisFormatCommandArgv(&cmd, argc, argv, lens);
    if (len < 0)
        return -1;
    int rc = cg_redis_conn_formatted(c, cb, priv, cmd, (size_t)len);
    free(cmd); /* hiredis 0.14's redisFormatCommandArgv allocates with malloc */
    return rc;
}

int cg_redis_conn_cmd(cg_redis_conn *c, cg_redis_reply_fn *cb, void *priv, const char *fmt, ...)
{
    char *cmd = NULL;
    va_list ap;
    va_start(ap, fmt);
    int len = redisvFormatCommand(&cmd, fmt, ap);
    va_end(ap);
    if (len < 0)
        return -1;
    int rc = cg_redis_conn_formatted(c, cb, priv, cmd, (size_t)len);
    free(cmd);
    return rc;
}

/* ---- reading ------------------------------------------------------------------------------ */

/* Hands every whole reply the reader holds to its callback. */
static void dispatch_replies(cg_redis_conn *c)
{
    void *reply;
    while (c->state != C_CLOSED && c->close_asked != 1) {
        if (redisReaderGetReply(c->reader, &reply) != REDIS_OK) {
            char why[160];
            snprintf(why, sizeof(why), "unreadable answer: %s", c->reader->errstr);
            fail(c, why);
            return;
        }
        if (!reply)
            return;
        redisReply *r = reply;
        c->answered = 1;
        if (r->type == REDIS_REPLY_ERROR && strncmp(r->str, "READONLY", 8) == 0)
            c->readonly++;
        if (c->push_cb && !c->head) {
            c->push_cb(c, reply, c->push_priv);
        } else if (c->head) {
            pending *p = c->head;
            c->head = p->next;
            if (!c->head)
                c->tail = NULL;
            if (p->cb)
                p->cb(c, reply, p->priv);
            free(p);
        } else {
            freeReplyObject(reply);
            fail(c, "an answer to no command");
            return;
        }
        freeReplyObject(reply);
    }
}

static void feed(cg_redis_conn *c, const char *buf, size_t len)
{
    if (redisReaderFeed(c->reader, buf, len) != REDIS_OK)
        fail(c, "out of memory reading an answer");
}

static void became_up(cg_redis_conn *c)
{
    c->state = C_UP;
    if (c->on_event)
        c->on_event(c, 1, NULL);
    if (c->state == C_UP && !c->close_asked)
        want_write(c);
}

/* The TLS engine got bytes: the handshake goes on, or records are decrypted and fed. */
static void tls_input(cg_redis_conn *c)
{
    if (c->state == C_HANDSHAKE) {
        int rc = SSL_do_handshake(c->ssl);
        send_tls_output(c);
        if (rc != 1) {
            int e = SSL_get_error(c->ssl, rc);
            if (e == SSL_ERROR_WANT_READ || e == SSL_ERROR_WANT_WRITE)
                return;
            char why[240];
            handshake_failed_why(c, why, sizeof(why));
            fail(c, why);
            return;
        }
        became_up(c);
        if (c->state != C_UP || c->close_asked)
            return;
    }
    char buf[READ_CHUNK];
    for (;;) {
        int n = SSL_read(c->ssl, buf, sizeof(buf));
        if (n > 0) {
            feed(c, buf, (size_t)n);
            continue;
        }
        int e = SSL_get_error(c->ssl, n);
        if (e == SSL_ERROR_WANT_READ || e == SSL_ERROR_WANT_WRITE)
            break;
        char why[240];
        if (!c->answered) /* TLS 1.3: a refused client certificate comes after the handshake */
            handshake_failed_why(c, why, sizeof(why));
        else if (e == SSL_ERROR_ZERO_RETURN)
            snprintf(why, sizeof(why), "the server closed the TLS session");
        else
            tls_error(why, sizeof(why), "error reading", NULL);
        fail(c, why);
        return;
    }
    send_tls_output(c); /* a key update's answer, if any */
    if (c->out_len)      /* a write that waited for the peer */
        want_write(c);
}

static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf)
{
    (void)suggested;
    cg_redis_conn *c = h->data;
    *buf = uv_buf_init(c->rbuf, sizeof(c->rbuf));
}

static void on_read(uv_stream_t *s, ssize_t n, const uv_buf_t *buf)
{
    cg_redis_conn *c = s->data;
    if (n == 0)
        return;
    cg_flusher *f = c->flusher;
    c->depth++;
    if (n < 0) {
        io_failed(c, (int)n);
    } else if (c->ssl) {
        if (BIO_write(c->rbio, buf->base, (int)n) != (int)n)
            fail(c, "out of memory reading");
        else
            tls_input(c);
    } else {
        feed(c, buf->base, (size_t)n);
    }
    dispatch_replies(c);
    c->depth--;
    if (c->depth == 0 && (c->close_asked == 1 || (c->close_asked == 2 && !c->head && !c->push_cb)))
        finish(c);
    if (f) /* what the answers made ready goes to its clients now (core/flush.h) */
        cg_flush_event_end(f, c);
}

static int is_ip(const char *host)
{
    unsigned char buf[16];
    return inet_pton(AF_INET, host, buf) == 1 || inet_pton(AF_INET6, host, buf) == 1;
}

static int tls_start(cg_redis_conn *c)
{
    c->ssl = SSL_new(c->tls->ctx);
    c->rbio = BIO_new(BIO_s_mem());
    c->wbio = BIO_new(BIO_s_mem());
    if (!c->ssl || !c->rbio || !c->wbio) {
        BIO_free(c->rbio);
        BIO_free(c->wbio);
        c->rbio = c->wbio = NULL;
        return -1;
    }
    SSL_set_bio(c->ssl, c->rbio, c->wbio); /* the SSL owns them now */
    SSL_set_connect_state(c->ssl);
    const char *name = c->tls->server_name ? c->tls->server_name : c->host;
    if (!is_ip(name))
        SSL_set_tlsext_host_name(c->ssl, name);
    if (c->tls->verify) {
        X509_VERIFY_PARAM *param = SSL_get0_param(c->ssl);
        if (is_ip(name) ? X509_VERIFY_PARAM_set1_ip_asc(param, name) != 1 : SSL_set1_host(c->ssl, name) != 1)
            return -1;
    }
    c->state = C_HANDSHAKE;
    tls_input(c); /* the ClientHello */
    return 0;
}

static void on_connected(uv_connect_t *req, int status)
{
    cg_redis_conn *c = req->data;
    if (c->state == C_CLOSED)
        return;
    c->depth++;
    if (status < 0) {
        fail(c, uv_strerror(status));
    } else if (uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read) < 0) {
        fail(c, "cannot read the socket");
    } else if (c->tls) {
        if (tls_start(c) < 0)
            fail(c, "cannot start TLS (out of memory, or a bad redis.tls_server_name)");
    } else {
        became_up(c);
    }
    c->depth--;
    if (c->depth == 0 && c->close_asked == 1)
        finish(c);
}

cg_redis_conn *cg_redis_conn_open(uv_loop_t *loop, const char *address, int port, const char *host,
                                  cg_redis_tls *tls, cg_flusher *flush, void *data, cg_redis_event_fn *on_event,
                                  char *why, size_t whylen)
{
    struct sockaddr_storage sa;
    if (uv_ip4_addr(address, port, (struct sockaddr_in *)&sa) != 0 &&
        uv_ip6_addr(address, port, (struct sockaddr_in6 *)&sa) != 0) {
        snprintf(why, whylen, "'%s' is not an IP address", address);
        return NULL;
    }
    cg_redis_conn *c = cg_calloc(1, sizeof(*c));
    if (!(c->reader = redisReaderCreate())) /* hiredis's own allocation */
        cg_out_of_memory(sizeof(redisReader));
    c->reader->maxbuf = 0; /* keep its buffer: answers come all the time */
    if (uv_tcp_init(loop, &c->tcp) != 0) {
        redisReaderFree(c->reader);
        free(c);
        snprintf(why, whylen, "cannot make a socket");
        return NULL;
    }
    c->tcp.data = c;
    c->connect.data = c;
    c->data = data;
    c->on_event = on_event;
    c->event_due = 1;
    c->tls = tls;
    c->flusher = flush;
    snprintf(c->host, sizeof(c->host), "%s", host ? host : address);
    snprintf(c->peer, sizeof(c->peer), strchr(address, ':') ? "[%s]:%d" : "%s:%d", address, port);
    uv_tcp_nodelay(&c->tcp, 1);
    int rc = uv_tcp_connect(&c->connect, &c->tcp, (const struct sockaddr *)&sa, on_connected);
    if (rc < 0) {
        snprintf(why, whylen, "%s", uv_strerror(rc));
        c->state = C_CLOSED;
        uv_close((uv_handle_t *)&c->tcp, on_handle_closed);
        return NULL;
    }
    return c;
}

void *cg_redis_conn_data(const cg_redis_conn *c)
{
    return c ? c->data : NULL; /* a cluster command answered after its router closed has none */
}

void cg_redis_conn_set_data(cg_redis_conn *c, void *data)
{
    c->data = data;
}

const char *cg_redis_conn_error(const cg_redis_conn *c)
{
    return c->why[0] ? c->why : "the connection closed";
}

const char *cg_redis_conn_host(const cg_redis_conn *c)
{
    return c->host;
}

const char *cg_redis_conn_peer(const cg_redis_conn *c)
{
    return c->peer;
}

unsigned cg_redis_conn_take_readonly(cg_redis_conn *c)
{
    unsigned n = c->readonly;
    c->readonly = 0;
    return n;
}
