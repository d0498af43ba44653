/*
 * identity.c: resume tokens and HS256 JWTs, with OpenSSL's HMAC and base64 (DESIGN.md
 * section 10: Debian's libwebsockets has no JOSE). Signatures are compared in constant time.
 */
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chatgate/identity.h"

char *cg_base64url_encode(const unsigned char *in, size_t len)
{
    size_t n = 4 * ((len + 2) / 3) + 1;
    char *out = malloc(n);
    if (!out)
        abort();
    int m = EVP_EncodeBlock((unsigned char *)out, in, (int)len);
    while (m > 0 && out[m - 1] == '=')
        m--;
    out[m] = 0;
    for (char *p = out; *p; p++)
        *p = *p == '+' ? '-' : *p == '/' ? '_' : *p;
    return out;
}

long cg_base64url_decode(const char *in, size_t len, unsigned char *out, size_t outlen)
{
    size_t padded = (len + 3) / 4 * 4;
    if (len % 4 == 1 || padded / 4 * 3 > outlen)
        return -1;
    char *buf = malloc(padded + 1);
    if (!buf)
        return -1;
    for (size_t i = 0; i < len; i++) {
        char c = in[i];
        if (c == '+' || c == '/' || c == '=') { /* url alphabet only */
            free(buf);
            return -1;
        }
        buf[i] = c == '-' ? '+' : c == '_' ? '/' : c;
    }
    for (size_t i = len; i < padded; i++)
        buf[i] = '=';
    buf[padded] = 0;
    int n = EVP_DecodeBlock(out, (unsigned char *)buf, (int)padded);
    free(buf);
    if (n < 0)
        return -1;
    return n - (long)(padded - len); /* EVP_DecodeBlock counts the padding as bytes */
}

static void hmac256(const unsigned char *key, size_t key_len, const void *data, size_t len, unsigned char out[32])
{
    unsigned int n = 32;
    HMAC(EVP_sha256(), key, (int)key_len, data, len, out, &n);
}

char *cg_identity_resume_token(const unsigned char *secret, size_t secret_len, const char *user)
{
    unsigned char mac[32];
    hmac256(secret, secret_len, user, strlen(user), mac);
    char *sig = cg_base64url_encode(mac, sizeof(mac));
    size_t n = strlen(user) + strlen(sig) + 2;
    char *token = malloc(n);
    if (!token)
        abort();
    snprintf(token, n, "%s.%s", user, sig);
    free(sig);
    return token;
}

int cg_identity_resume_check(const unsigned char *secret, size_t secret_len, const char *token, char *user,
                             size_t userlen)
{
    const char *dot = strrchr(token, '.');
    if (!dot || dot == token || (size_t)(dot - token) >= userlen)
        return -1;
    unsigned char mac[32], got[48];
    hmac256(secret, secret_len, token, (size_t)(dot - token), mac);
    if (cg_base64url_decode(dot + 1, strlen(dot + 1), got, sizeof(got)) != 32 || CRYPTO_memcmp(mac, got, 32) != 0)
        return -1;
    snprintf(user, userlen, "%.*s", (int)(dot - token), token);
    return 0;
}

/* Decodes one base64url JWT part into a JSON object; NULL when it is not one. */
static json_t *jwt_part(const char *s, size_t len)
{
    if (len > 8192)
        return NULL;
    unsigned char buf[6144 + 4];
    long n = cg_base64url_decode(s, len, buf, sizeof(buf));
    if (n < 0)
        return NULL;
    json_t *j = json_loadb((const char *)buf, (size_t)n, 0, NULL);
    if (!json_is_object(j)) {
        json_decref(j);
        return NULL;
    }
    return j;
}

int cg_identity_jwt_verify(const unsigned char *secret, size_t secret_len, const char *token, int64_t now,
                           long leeway_s, char *user, size_t userlen, char *err, size_t errlen)
{
    const char *d1 = strchr(token, '.');
    const char *d2 = d1 ? strchr(d1 + 1, '.') : NULL;
    if (!d1 || !d2 || strchr(d2 + 1, '.')) {
        snprintf(err, errlen, "the token is not a JWT (three dot-separated parts)");
        return -1;
    }
    json_t *header = jwt_part(token, (size_t)(d1 - token));
    json_t *claims = jwt_part(d1 + 1, (size_t)(d2 - d1 - 1));
    int rc = -1;
    unsigned char mac[32], sig[48];
    if (!header || !claims) {
        snprintf(err, errlen, "the token's header or claims are not base64url JSON");
        goto out;
    }
    json_t *alg = json_object_get(header, "alg");
    if (!json_is_string(alg) || strcmp(json_string_value(alg), "HS256") != 0) {
        snprintf(err, errlen, "the token's alg must be HS256");
        goto out;
    }
    hmac256(secret, secret_len, token, (size_t)(d2 - token), mac);
    if (cg_base64url_decode(d2 + 1, strlen(d2 + 1), sig, sizeof(sig)) != 32 || CRYPTO_memcmp(mac, sig, 32) != 0) {
        snprintf(err, errlen, "the token's signature does not match");
        goto out;
    }
    json_t *exp = json_object_get(claims, "exp");
    json_t *nbf = json_object_get(claims, "nbf");
    if (exp && (!json_is_number(exp) || (int64_t)json_number_value(exp) + leeway_s <= now)) {
        snprintf(err, errlen, "the token has expired");
        goto out;
    }
    if (nbf && (!json_is_number(nbf) || (int64_t)json_number_value(nbf) - leeway_s > now)) {
        snprintf(err, errlen, "the token is not valid yet (nbf)");
        goto out;
    }
    json_t *sub = json_object_get(claims, "sub");
    if (!json_is_string(sub) || json_string_length(sub) == 0 || json_string_length(sub) > CG_MAX_USER ||
        json_string_length(sub) >= userlen) {
        snprintf(err, errlen, "the token's sub must be a string of 1 to %d bytes", CG_MAX_USER);
        goto out;
    }
    snprintf(user, userlen, "%s", json_string_value(sub));
    rc = 0;
out:
    json_decref(header);
    json_decref(claims);
    return rc;
}
