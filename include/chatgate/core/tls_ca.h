/*
 * tls_ca.h: the CA certificates the gateway's TLS clients trust besides the system's
 * (tls_ca_file: an LLM behind https, a wss app or a drop-in app whose certificate a private
 * CA signed). Both TLS clients take them into their own OpenSSL context, added to the
 * system's store rather than in its place, so that public upstreams keep working beside a
 * private one:
 *   - libwebsockets (wss upstreams, drop-in apps): the client context of the gateway's
 *     vhost, from LWS_CALLBACK_OPENSSL_LOAD_EXTRA_CLIENT_VERIFY_CERTS (gateway.c);
 *   - libcurl (https upstreams): each connection's context, from CURLOPT_SSL_CTX_FUNCTION
 *     (http_pool.c); libcurl's own CA file setting would replace the system's bundle.
 * The file is read once, at start; the set is immutable after and freed at exit.
 */
#ifndef CHATGATE_CORE_TLS_CA_H
#define CHATGATE_CORE_TLS_CA_H

#include <stddef.h>

typedef struct cg_tls_ca cg_tls_ca;

/* Reads the PEM certificates of path (core/file.h: a pipe too). NULL with a message in err
 * when the file cannot be read, holds more than 16 MiB, holds no certificate, or one of them
 * does not parse (the message says which, and OpenSSL's reason). */
cg_tls_ca *cg_tls_ca_load(const char *path, char *err, size_t errlen);

/* How many certificates ca holds (0 for NULL). */
int cg_tls_ca_count(const cg_tls_ca *ca);

/* Adds ca's certificates to the verify store of ssl_ctx (an OpenSSL SSL_CTX *); nothing
 * when ca is NULL. 0, or -1 when OpenSSL refused one (out of memory). */
int cg_tls_ca_trust(const cg_tls_ca *ca, void *ssl_ctx);

void cg_tls_ca_free(cg_tls_ca *ca);

#endif
