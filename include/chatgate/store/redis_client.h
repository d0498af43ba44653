/*
 * redis_client.h: one connection to one Redis node, on the gateway's libuv loop, in plain
 * TCP or TLS. It knows nothing of dialogs: the store (redis_store.c, redis_dialog.c), the
 * cancel bus, the Sentinel queries and the cluster router (redis_cluster.c) all talk to
 * Redis through it.
 *
 * Why not hiredis's own async context: hiredis 0.14 (Debian 12's) reads and writes its
 * socket itself, so it cannot speak TLS, and its libuv adapter polls for POLLOUT before
 * every write. Here the socket is a uv_tcp_t of ours; TLS is OpenSSL over memory BIOs on
 * that handle (nothing blocks: the handshake advances as bytes come); commands are built by
 * hiredis's formatter and replies parsed by hiredis's reader, so a reply is the redisReply
 * every caller already reads.
 *
 * Commands are queued and written once per loop iteration through the gateway's flusher
 * (core/flush.h), ahead of the client frames of the same iteration; replies are matched to
 * commands in order. A connection that SUBSCRIBEs gives every later reply (confirmations and
 * messages) to that command's callback.
 *
 * Callbacks: a command's is called once, with its reply, or with NULL when the connection
 * closed before the reply came. The event callback says the connection is up (TCP and TLS
 * done) or gone (with why); after "gone" the connection is freed by itself. Any callback may
 * close the connection; the free waits until the callback returns.
 */
#ifndef CHATGATE_STORE_REDIS_CLIENT_H
#define CHATGATE_STORE_REDIS_CLIENT_H

#include <stddef.h>
#include <uv.h>

struct cg_flusher;

typedef struct cg_redis_conn cg_redis_conn;
typedef struct cg_redis_tls cg_redis_tls;

/* reply: a redisReply (freed by the connection after the call), or NULL: the connection is gone */
typedef void cg_redis_reply_fn(cg_redis_conn *c, void *reply, void *priv);
/* up: 1 the connection is ready for commands; 0 it failed or closed (why says how, NULL after
 * cg_redis_conn_close_graceful), and is freed once this returns. */
typedef void cg_redis_event_fn(cg_redis_conn *c, int up, const char *why);

/* TLS to Redis: certificate and host name checked unless verify is 0. */
typedef struct cg_redis_tls_config {
    const char *ca_file;     /* PEM CA certificates; NULL: the system's */
    const char *cert_file;   /* client certificate for mutual TLS, or NULL */
    const char *key_file;    /* its key (NULL: in cert_file) */
    const char *server_name; /* the name the certificate must be for; NULL: the URL's host */
    int verify;
} cg_redis_tls_config;

/* A TLS context for any number of connections; NULL with err naming the file and what is
 * wrong with it. */
cg_redis_tls *cg_redis_tls_new(const cg_redis_tls_config *cfg, char *err, size_t errlen);
void cg_redis_tls_free(cg_redis_tls *t);

/*
 * Connects to a numeric address (IPv4 or IPv6). host is the name the URL gave (the TLS name
 * checked, unless the config names another); tls NULL for plain TCP. NULL with why filled
 * when the connect could not even start. The event callback says when it is up.
 */
cg_redis_conn *cg_redis_conn_open(uv_loop_t *loop, const char *address, int port, const char *host,
                                  cg_redis_tls *tls, struct cg_flusher *flush, void *data,
                                  cg_redis_event_fn *on_event, char *why, size_t whylen);
void *cg_redis_conn_data(const cg_redis_conn *c);
void cg_redis_conn_set_data(cg_redis_conn *c, void *data);
/* "ip:port" it connects to (for logs and the cluster's node table) */
const char *cg_redis_conn_peer(const cg_redis_conn *c);
/* The host name c was opened for (the name its TLS certificate is checked against). */
const char *cg_redis_conn_host(const cg_redis_conn *c);

/* Why it failed or closed (for a command callback given NULL). */
const char *cg_redis_conn_error(const cg_redis_conn *c);

/* Queue a command; 0, or -1 when the connection is closing (cb is then never called). */
int cg_redis_conn_argv(cg_redis_conn *c, cg_redis_reply_fn *cb, void *priv, int argc, const char **argv,
                       const size_t *lens);
int cg_redis_conn_cmd(cg_redis_conn *c, cg_redis_reply_fn *cb, void *priv, const char *fmt, ...);
/* cmd is a whole command in RESP (redisFormatCommandArgv's), copied */
int cg_redis_conn_formatted(cg_redis_conn *c, cg_redis_reply_fn *cb, void *priv, const char *cmd, size_t len);

/* AUTH [user] password; its answer to cb, or with cb NULL a refusal fails the connection
 * (it would go on as Redis's default user). 0, or -1 as cg_redis_conn_argv. */
int cg_redis_conn_auth(cg_redis_conn *c, const char *user, const char *password, cg_redis_reply_fn *cb, void *priv);
/* Fails the connection (a setup answer refused, say): closed as if lost, the event says why. */
void cg_redis_conn_fail(cg_redis_conn *c, const char *why);
/* Closes at once: commands still waiting get NULL; no event. */
void cg_redis_conn_close(cg_redis_conn *c);
/* Closes once every reply due has come (no new commands): then the event with up 0, why NULL. */
void cg_redis_conn_close_graceful(cg_redis_conn *c);
/* -READONLY answers seen so far (the node became a replica), and resets the count. */
unsigned cg_redis_conn_take_readonly(cg_redis_conn *c);

#endif
