/*
 * identity.h: who a connection is (docs/protocol.md, "Identity"). The user id never comes from a
 * frame: it comes from a resume token the gateway signed (auth none), an HS256 JWT (auth
 * jwt), or a header a trusted proxy set (auth header).
 *
 * Pure apart from OpenSSL's HMAC: the time is passed in, secrets are passed in.
 */
#ifndef CHATGATE_IDENTITY_H
#define CHATGATE_IDENTITY_H

#include <stddef.h>
#include <stdint.h>

#define CG_MAX_USER 256

/* "<user>.<base64url HMAC-SHA256(secret, user)>", malloc'd. */
char *cg_identity_resume_token(const unsigned char *secret, size_t secret_len, const char *user);
/* Checks a resume token; 0 with the user id in user, or -1. */
int cg_identity_resume_check(const unsigned char *secret, size_t secret_len, const char *token, char *user,
                             size_t userlen);

/* Longest base64url part of a JWT taken (a request's headers are bounded anyway). */
#define CG_JWT_MAX_PART 65536

/*
 * Verifies an HS256 JWT: signature, alg, exp and nbf against now (with leeway_s), and takes
 * sub as the user id (1 to CG_MAX_USER bytes). A token without exp is refused unless
 * allow_no_exp (config jwt.allow_no_exp): it would be valid for ever. Every part must be
 * canonical base64url. With plan (planlen bytes), the plan_claim's value (limits.plan_claim)
 * goes there: "" when the token has none, a name no plan has when it is not a string that fits.
 * 0, or -1 with the reason in err.
 */
int cg_identity_jwt_verify_ex(const unsigned char *secret, size_t secret_len, const char *token, int64_t now,
                              long leeway_s, int allow_no_exp, char *user, size_t userlen, const char *plan_claim,
                              char *plan, size_t planlen, char *err, size_t errlen);
/* The same with allow_no_exp 0 and no plan. */
int cg_identity_jwt_verify(const unsigned char *secret, size_t secret_len, const char *token, int64_t now,
                           long leeway_s, char *user, size_t userlen, char *err, size_t errlen);

/* base64url without padding; the decoder returns the length, or -1 for anything but the
 * canonical encoding (url alphabet, no '=', unused bits zero) or when out is too small.
 * Used by tests too. */
char *cg_base64url_encode(const unsigned char *in, size_t len);
long cg_base64url_decode(const char *in, size_t len, unsigned char *out, size_t outlen);

#endif
