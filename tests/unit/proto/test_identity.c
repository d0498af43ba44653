/*
 * test_identity.c: resume tokens and HS256 JWTs: good ones pass; forged, expired, not yet
 * valid, wrong-secret, wrong-alg and malformed ones are refused with a reason; so are tokens
 * without exp (unless allowed), and any part not in canonical base64url.
 */
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <stdlib.h>

#include "chatgate/proto/identity.h"
#include "unit.h"

static const unsigned char secret[] = "test-secret";
#define SECRET_LEN (sizeof(secret) - 1)

/* header.claims.signature with the given secret */
static char *make_jwt(const char *header, const char *claims, const unsigned char *key, size_t key_len)
{
    char *h = cg_base64url_encode((const unsigned char *)header, strlen(header));
    char *c = cg_base64url_encode((const unsigned char *)claims, strlen(claims));
    char signing[2048];
    snprintf(signing, sizeof(signing), "%s.%s", h, c);
    unsigned char mac[32];
    unsigned int n = 32;
    HMAC(EVP_sha256(), key, (int)key_len, (unsigned char *)signing, strlen(signing), mac, &n);
    char *sig = cg_base64url_encode(mac, 32);
    char *out = malloc(4096);
    snprintf(out, 4096, "%s.%s", signing, sig);
    free(h);
    free(c);
    free(sig);
    return out;
}

static int verify(const char *token, char *err)
{
    char user[300];
    return cg_identity_jwt_verify(secret, SECRET_LEN, token, 1000000, 30, user, sizeof(user), err, 256);
}

static void test_jwt(void)
{
    const char *hs = "{\"alg\":\"HS256\",\"typ\":\"JWT\"}";
    char err[256], user[300];
    char *good = make_jwt(hs, "{\"sub\":\"auth0|abc\",\"exp\":2000000,\"nbf\":900000}", secret, SECRET_LEN);
    CHECK(cg_identity_jwt_verify(secret, SECRET_LEN, good, 1000000, 30, user, sizeof(user), err, sizeof(err)) == 0);
    CHECK_STR(user, "auth0|abc");

    char *expired = make_jwt(hs, "{\"sub\":\"u\",\"exp\":999000}", secret, SECRET_LEN);
    CHECK(verify(expired, err) < 0 && strstr(err, "expired"));
    char *early = make_jwt(hs, "{\"sub\":\"u\",\"nbf\":1001000,\"exp\":2000000}", secret, SECRET_LEN);
    CHECK(verify(early, err) < 0 && strstr(err, "not valid yet"));
    char *wrong = make_jwt(hs, "{\"sub\":\"u\"}", (const unsigned char *)"other", 5);
    CHECK(verify(wrong, err) < 0 && strstr(err, "signature"));
    char *none = make_jwt("{\"alg\":\"none\"}", "{\"sub\":\"u\"}", secret, SECRET_LEN);
    CHECK(verify(none, err) < 0 && strstr(err, "HS256"));
    char *nosub = make_jwt(hs, "{\"exp\":2000000}", secret, SECRET_LEN);
    CHECK(verify(nosub, err) < 0 && strstr(err, "sub"));

    /* forged: claims changed after signing */
    char *forged = strdup(good);
    char *dot = strchr(forged, '.');
    char *c = cg_base64url_encode((const unsigned char *)"{\"sub\":\"admin\"}", 15);
    char rebuilt[4096];
    snprintf(rebuilt, sizeof(rebuilt), "%.*s.%s%s", (int)(dot - forged), forged, c, strchr(dot + 1, '.'));
    CHECK(verify(rebuilt, err) < 0 && strstr(err, "signature"));

    CHECK(verify("not-a-jwt", err) < 0);
    CHECK(verify("a.b.c.d", err) < 0);
    CHECK(verify("!!!.???.***", err) < 0);
    CHECK(verify("", err) < 0);

    free(good);
    free(expired);
    free(early);
    free(wrong);
    free(none);
    free(nosub);
    free(forged);
    free(c);
}

/* A JWT without exp would be valid for ever: refused unless the policy allows it. */
static void test_jwt_no_exp(void)
{
    const char *hs = "{\"alg\":\"HS256\",\"typ\":\"JWT\"}";
    char err[256], user[300];
    char *noexp = make_jwt(hs, "{\"sub\":\"u\"}", secret, SECRET_LEN);
    CHECK(verify(noexp, err) < 0 && strstr(err, "no exp"));
    char plan[65] = "x";
    CHECK(cg_identity_jwt_verify_ex(secret, SECRET_LEN, noexp, 1000000, 30, 1, user, sizeof(user), "plan", plan,
                                    sizeof(plan), err, sizeof(err)) == 0);
    CHECK_STR(user, "u");
    CHECK_STR(plan, ""); /* no such claim: the default plan */
    /* limits.plan_claim: the claim's value, or a name no plan has when it is not a fitting string */
    char *pro = make_jwt(hs, "{\"sub\":\"u\",\"tier\":\"pro\",\"n\":7}", secret, SECRET_LEN);
    CHECK(cg_identity_jwt_verify_ex(secret, SECRET_LEN, pro, 1000000, 30, 1, user, sizeof(user), "tier", plan,
                                    sizeof(plan), err, sizeof(err)) == 0);
    CHECK_STR(plan, "pro");
    CHECK(cg_identity_jwt_verify_ex(secret, SECRET_LEN, pro, 1000000, 30, 1, user, sizeof(user), "n", plan,
                                    sizeof(plan), err, sizeof(err)) == 0);
    CHECK(strstr(plan, "not a plan name") != NULL);
    free(pro);
    char *strexp = make_jwt(hs, "{\"sub\":\"u\",\"exp\":\"2000000\"}", secret, SECRET_LEN);
    CHECK(verify(strexp, err) < 0 && strstr(err, "exp must be a number"));
    /* huge NumericDates are refused (test_jwt_dates_in_range); fractional ones compared as numbers */
    char *huge = make_jwt(hs, "{\"sub\":\"u\",\"exp\":1e300,\"nbf\":-1e300}", secret, SECRET_LEN);
    CHECK(verify(huge, err) < 0 && strstr(err, "exp must be a number of seconds"));
    char *frac = make_jwt(hs, "{\"sub\":\"u\",\"exp\":999969.5}", secret, SECRET_LEN);
    CHECK(verify(frac, err) < 0 && strstr(err, "expired"));
    free(noexp);
    free(strexp);
    free(huge);
    free(frac);
}

/* The same token with other values in the unused low bits of a part's last character. */
static void test_jwt_canonical(void)
{
    static const char b64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    const char *hs = "{\"alg\":\"HS256\",\"typ\":\"JWT\"}";
    char err[256];
    char *good = make_jwt(hs, "{\"sub\":\"u\",\"exp\":2000000}", secret, SECRET_LEN);
    CHECK(verify(good, err) == 0);
    /* the signature: 32 bytes are 43 characters, the last one carries 2 unused bits */
    size_t n = strlen(good);
    int v = (int)(strchr(b64, good[n - 1]) - b64);
    for (int extra = 1; extra < 4; extra++) {
        char *t = strdup(good);
        t[n - 1] = b64[(v & ~3) | extra];
        CHECK(verify(t, err) < 0 && strstr(err, "signature"));
        free(t);
    }
    /* padding, the standard alphabet and whitespace are not base64url */
    char *padded = malloc(n + 2);
    snprintf(padded, n + 2, "%s=", good);
    CHECK(verify(padded, err) < 0);
    char *spaced = malloc(n + 2);
    snprintf(spaced, n + 2, " %s", good);
    CHECK(verify(spaced, err) < 0);
    free(padded);
    free(spaced);
    free(good);

    unsigned char out[8];
    CHECK(cg_base64url_decode("QQ", 2, out, sizeof(out)) == 1 && out[0] == 'A');
    CHECK(cg_base64url_decode("QR", 2, out, sizeof(out)) < 0); /* 4 unused bits set */
    CHECK(cg_base64url_decode("QUI", 3, out, sizeof(out)) == 2);
    CHECK(cg_base64url_decode("QUJ", 3, out, sizeof(out)) < 0); /* 2 unused bits set */
    CHECK(cg_base64url_decode("QUJD", 4, out, sizeof(out)) == 3 && memcmp(out, "ABC", 3) == 0);
    CHECK(cg_base64url_decode("QUJ=", 4, out, sizeof(out)) < 0);
    CHECK(cg_base64url_decode("Q+/A", 4, out, sizeof(out)) < 0);
    CHECK(cg_base64url_decode("QUJDQ", 5, out, sizeof(out)) < 0);
    CHECK(cg_base64url_decode("QUJDQUJDQUJD", 12, out, sizeof(out)) < 0); /* 9 bytes > 8 */
    CHECK(cg_base64url_decode("", 0, out, sizeof(out)) == 0);
}

static void test_resume(void)
{
    char user[300];
    char *t = cg_identity_resume_token(secret, SECRET_LEN, "u_1234");
    CHECK(cg_identity_resume_check(secret, SECRET_LEN, t, user, sizeof(user)) == 0);
    CHECK_STR(user, "u_1234");
    CHECK(cg_identity_resume_check((const unsigned char *)"x", 1, t, user, sizeof(user)) < 0);
    t[0] = 'v'; /* another user, same signature */
    CHECK(cg_identity_resume_check(secret, SECRET_LEN, t, user, sizeof(user)) < 0);
    CHECK(cg_identity_resume_check(secret, SECRET_LEN, "nodot", user, sizeof(user)) < 0);
    free(t);
}

/* exp and nbf out of any real date's range are refused, not taken as "never expires"
 * (issue 35, defect 6: "exp": 1e300 was accepted). */
static void test_jwt_dates_in_range(void)
{
    const char *hs = "{\"alg\":\"HS256\",\"typ\":\"JWT\"}";
    static const char *const bad[] = {
        "{\"sub\":\"u\",\"exp\":1e300}",          "{\"sub\":\"u\",\"exp\":1e19}",
        "{\"sub\":\"u\",\"exp\":253402300800}",   "{\"sub\":\"u\",\"exp\":-1}",
        "{\"sub\":\"u\",\"exp\":2000000,\"nbf\":-1e300}", "{\"sub\":\"u\",\"exp\":2000000,\"nbf\":1e300}",
        "{\"sub\":\"u\",\"exp\":\"2000000\"}",
    };
    char err[256];
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        char *jwt = make_jwt(hs, bad[i], secret, SECRET_LEN);
        CHECK(verify(jwt, err) < 0);
        CHECK(strstr(err, "exp") || strstr(err, "nbf"));
        free(jwt);
    }
    char *last = make_jwt(hs, "{\"sub\":\"u\",\"exp\":253402300799.5,\"nbf\":0}", secret, SECRET_LEN);
    CHECK(verify(last, err) < 0); /* past year 9999 by half a second */
    free(last);
    char *fine = make_jwt(hs, "{\"sub\":\"u\",\"exp\":253402300799,\"nbf\":0.5}", secret, SECRET_LEN);
    CHECK(verify(fine, err) == 0);
    free(fine);
}

int main(void)
{
    test_jwt_dates_in_range();
    test_jwt();
    test_jwt_no_exp();
    test_jwt_canonical();
    test_resume();
    return unit_done("test_identity");
}
