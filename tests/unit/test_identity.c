/*
 * test_identity.c: resume tokens and HS256 JWTs: good ones pass; forged, expired, not yet
 * valid, wrong-secret, wrong-alg and malformed ones are refused with a reason.
 */
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <stdlib.h>

#include "chatgate/identity.h"
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
    char *early = make_jwt(hs, "{\"sub\":\"u\",\"nbf\":1001000}", secret, SECRET_LEN);
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

int main(void)
{
    test_jwt();
    test_resume();
    return unit_done("test_identity");
}
