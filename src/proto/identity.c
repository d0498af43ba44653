/*
 * identity.c: resume tokens and HS256 JWTs, with OpenSSL's HMAC (docs/architecture.md, "Notes on the libraries":
 * Debian's libwebsockets has no JOSE). Signatures are compared in constant time. base64url
 * is decoded strictly (the url alphabet, no padding, no whitespace, zero unused bits), so a
 * token has exactly one spelling; a JWT must carry exp unless the policy says otherwise.
 */
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chatgate/core/alloc.h"
#include "chatgate/proto/identity.h"

char *cg_base64url_encode(const unsigned char *in, size_t len)
{
    size_t n = 4 * ((len + 2) / 3) + 1;
    char *out = cg_malloc(n);
    int m = EVP_EncodeBlock((unsigned char *)out, in, (int)len);
    while (m > 0 && out[m - 1] == '=')
        m--;
    out[m] = 0;
    for (char *p = out; *p; p++)
        *p = *p == '+' ? '-' : *p == '/' ? '_' : *p;
    return out;
}

/* The value of one base64url character, or -1 for anything else (padding, '+', '/',
 * whitespace: EVP_DecodeBlock would skip whitespace, so the decoder is our own). */
static int b64url_value(unsigned char c)
{
    if (c >= 'A' && c <= 'Z')
        return c - 'A';
    if (c >= 'a' && c <= 'z')
        return c - 'a' + 26;
    if (c >= '0' && c <= '9')
        return c - '0' + 52;
    return c == '-' ? 62 : c == '_' ? 63 : -1;
}

/*
 * Strict: the url alphabet only, no padding, and canonical, i.e. the bits the last
 * character carries past the final byte are zero. Without that check "...Q" and "...R"
 * decode to the same signature, so a token would have several spellings (RFC 4648
 * section 3.5; RFC 7515 asks for the canonical one).
 */
long cg_base64url_decode(const char *in, size_t len, unsigned char *out, size_t outlen)
{
    size_t rest = len % 4;
    if (rest == 1 || len / 4 * 3 + (rest ? rest - 1 : 0) > outlen)
        return -1;
    size_t n = 0;
    uint32_t acc = 0;
    int bits = 0;
    for (size_t i = 0; i < len; i++) {
        int v = b64url_value((unsigned char)in[i]);
        if (v < 0)
            return -1;
        acc = (acc << 6) | (uint32_t)v;
        bits += 6;
        if (bits >= 8) {
            bits -= 8;
            out[n++] = (unsigned char)(acc >> bits);
            acc &= (1u << bits) - 1;
        }
    }
    if (acc != 0) /* unused low bits of the last character: not the canonical encoding */
        return -1;
    return (long)n;
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
    char *token = cg_malloc(n);
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

/* Decodes one base64url JWT part into a JSON object; NULL when it is not one. The part is
 * decoded into a buffer of its own length (the request's header space bounds it). */
static json_t *jwt_part(const char *s, size_t len)
{
    if (len > CG_JWT_MAX_PART)
        return NULL;
    size_t cap = len / 4 * 3 + 3;
    unsigned char *buf = cg_malloc(cap);
    long n = cg_base64url_decode(s, len, buf, cap);
    json_t *j = n < 0 ? NULL : json_loadb((const char *)buf, (size_t)n, JSON_REJECT_DUPLICATES, NULL);
    free(buf);
    if (!json_is_object(j)) {
        json_decref(j);
        return NULL;
    }
    return j;
}

/* The last second of year 9999: a NumericDate past it is no date a real issuer writes. */
#define CG_JWT_MAX_DATE 253402300799.0

/*
 * exp and nbf are NumericDates (RFC 7519 section 2): compared as doubles, since a huge or
 * fractional value cast to an integer would be undefined. Each must be a number from 0 to
 * the end of year 9999 (so "exp": 1e300 is refused, not a token that never expires). exp is
 * required unless the policy allows tokens that never expire.
 */
static int numeric_date(json_t *claims, const char *name, double *out, char *err, size_t errlen)
{
    json_t *v = json_object_get(claims, name);
    if (!v)
        return 0;
    double d = json_number_value(v);
    if (!json_is_number(v) || !(d >= 0 && d <= CG_JWT_MAX_DATE)) {
        snprintf(err, errlen, "the token's %s must be a number of seconds since 1970, up to year 9999", name);
        return -1;
    }
    *out = d;
    return 1;
}

static int check_times(json_t *claims, int64_t now, long leeway_s, int allow_no_exp, char *err, size_t errlen)
{
    double t = (double)now, exp = 0, nbf = 0;
    int has_exp = numeric_date(claims, "exp", &exp, err, errlen);
    int has_nbf = has_exp < 0 ? -1 : numeric_date(claims, "nbf", &nbf, err, errlen);
    if (has_exp < 0 || has_nbf < 0)
        return -1;
    if (!has_exp && !allow_no_exp) {
        snprintf(err, errlen, "the token has no exp (expiry); such tokens are refused unless jwt.allow_no_exp is set");
        return -1;
    }
    if (has_exp && exp + (double)leeway_s <= t) {
        snprintf(err, errlen, "the token has expired");
        return -1;
    }
    if (has_nbf && nbf - (double)leeway_s > t) {
        snprintf(err, errlen, "the token is not valid yet (nbf)");
        return -1;
    }
    return 0;
}

/* The plan the claim names (limits_config.h), or a name no plan has, saying what was wrong. */
static void take_plan(json_t *claims, const char *plan_claim, char *plan, size_t planlen)
{
    json_t *v = plan_claim ? json_object_get(claims, plan_claim) : NULL;
    if (!v)
        plan[0] = 0;
    else if (json_is_string(v) && json_string_length(v) > 0 && json_string_length(v) < planlen)
        memcpy(plan, json_string_value(v), json_string_length(v) + 1);
    else
        snprintf(plan, planlen, "(the claim is not a plan name)");
}

int cg_identity_jwt_verify_ex(const unsigned char *secret, size_t secret_len, const char *token, int64_t now,
                              long leeway_s, int allow_no_exp, char *user, size_t userlen, const char *plan_claim,
                              char *plan, size_t planlen, char *err, size_t errlen)
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
    if (check_times(claims, now, leeway_s, allow_no_exp, err, errlen) < 0)
        goto out;
    json_t *sub = json_object_get(claims, "sub");
    if (!json_is_string(sub) || json_string_length(sub) == 0 || json_string_length(sub) > CG_MAX_USER ||
        json_string_length(sub) >= userlen) {
        snprintf(err, errlen, "the token's sub must be a string of 1 to %d bytes", CG_MAX_USER);
        goto out;
    }
    memcpy(user, json_string_value(sub), json_string_length(sub) + 1);
    if (plan)
        take_plan(claims, plan_claim, plan, planlen);
    rc = 0;
out:
    json_decref(header);
    json_decref(claims);
    return rc;
}

int cg_identity_jwt_verify(const unsigned char *secret, size_t secret_len, const char *token, int64_t now,
                           long leeway_s, char *user, size_t userlen, char *err, size_t errlen)
{
    return cg_identity_jwt_verify_ex(secret, secret_len, token, now, leeway_s, 0, user, userlen, NULL, NULL, 0, err,
                                     errlen);
}
