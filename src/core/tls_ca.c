/*
 * tls_ca.c: the extra CA certificates of the gateway's TLS clients (see tls_ca.h): read
 * once from a PEM file, added to each OpenSSL context that verifies an upstream.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>

#include "chatgate/core/alloc.h"
#include "chatgate/core/file.h"
#include "chatgate/core/tls_ca.h"

/* A CA file larger than this is refused: Debian's whole bundle of public CAs is about
 * 200 KiB, and a file with no end (/dev/urandom) must not hold up the start. */
#define CG_TLS_CA_MAX_BYTES ((size_t)16 << 20)

struct cg_tls_ca {
    STACK_OF(X509) *certs; /* owned, with a reference on each */
};

/* OpenSSL's reason for the last failure, its queue emptied. */
static const char *openssl_reason(char *buf, size_t len)
{
    unsigned long e = ERR_peek_last_error();
    if (e)
        ERR_error_string_n(e, buf, len);
    else
        snprintf(buf, len, "unknown error");
    ERR_clear_error();
    return buf;
}

cg_tls_ca *cg_tls_ca_load(const char *path, char *err, size_t errlen)
{
    char why[256];
    cg_tls_ca *ca = cg_calloc(1, sizeof(*ca));
    BIO *in = NULL;
    char *text = NULL; /* the file's bytes: the BIO reads them in place */
    if (!(ca->certs = sk_X509_new_null())) { /* OpenSSL's own allocation */
        snprintf(err, errlen, "out of memory");
        goto fail;
    }
    size_t len = 0;
    text = cg_file_read(path, CG_TLS_CA_MAX_BYTES, &len, why, sizeof(why));
    if (!text) {
        snprintf(err, errlen, "cannot read %s", why);
        goto fail;
    }
    ERR_clear_error();
    in = BIO_new_mem_buf(text, (int)len);
    if (!in) {
        snprintf(err, errlen, "out of memory");
        goto fail;
    }
    X509 *x;
    while ((x = PEM_read_bio_X509(in, NULL, NULL, NULL)) != NULL) {
        if (!sk_X509_push(ca->certs, x)) {
            X509_free(x);
            snprintf(err, errlen, "out of memory");
            goto fail;
        }
    }
    /* the reader ends with "no start line" at the end of the file; anything else is a
     * certificate that did not parse */
    unsigned long e = ERR_peek_last_error();
    if (e && !(ERR_GET_LIB(e) == ERR_LIB_PEM && ERR_GET_REASON(e) == PEM_R_NO_START_LINE)) {
        snprintf(err, errlen, "%s: certificate %d does not parse: %s", path, sk_X509_num(ca->certs) + 1,
                 openssl_reason(why, sizeof(why)));
        goto fail;
    }
    ERR_clear_error();
    if (sk_X509_num(ca->certs) == 0) {
        snprintf(err, errlen, "%s holds no PEM certificate (-----BEGIN CERTIFICATE-----)", path);
        goto fail;
    }
    BIO_free(in);
    free(text);
    return ca;
fail:
    BIO_free(in);
    free(text);
    cg_tls_ca_free(ca);
    return NULL;
}

int cg_tls_ca_count(const cg_tls_ca *ca)
{
    return ca ? sk_X509_num(ca->certs) : 0;
}

int cg_tls_ca_trust(const cg_tls_ca *ca, void *ssl_ctx)
{
    X509_STORE *store = ca && ssl_ctx ? SSL_CTX_get_cert_store((SSL_CTX *)ssl_ctx) : NULL;
    if (!store)
        return ca ? -1 : 0;
    for (int i = 0; i < sk_X509_num(ca->certs); i++) {
        /* a certificate the store has already (a second vhost, a context OpenSSL shares) is
         * accepted again without a copy */
        if (!X509_STORE_add_cert(store, sk_X509_value(ca->certs, i))) {
            ERR_clear_error();
            return -1;
        }
    }
    return 0;
}

void cg_tls_ca_free(cg_tls_ca *ca)
{
    if (!ca)
        return;
    sk_X509_pop_free(ca->certs, X509_free);
    free(ca);
}
