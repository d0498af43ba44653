/*
 * error.h: chatgate's error codes.
 *
 * Functions return 0 or one of these negative codes. One X-macro table gives the
 * enum, the protocol's error code strings (docs/protocol.md, "Errors") and cg_strerror(), so
 * the names on the wire and in the code cannot drift apart.
 */
#ifndef CHATGATE_ERROR_H
#define CHATGATE_ERROR_H

/* XX(enum name, code on the wire, human text) */
#define CG_ERR_MAP(XX)                                                          \
    XX(BAD_FRAME, "bad_frame", "malformed frame")                               \
    XX(TOO_LARGE, "too_large", "too large")                                     \
    XX(RATE_LIMITED, "rate_limited", "rate limited")                            \
    XX(UNAUTHORIZED, "unauthorized", "unauthorized")                            \
    XX(NOT_FOUND, "not_found", "not found")                                     \
    XX(UPSTREAM_UNAVAILABLE, "upstream_unavailable", "upstream unavailable")    \
    XX(UPSTREAM_ERROR, "upstream_error", "upstream error")                      \
    XX(UPSTREAM_TIMEOUT, "upstream_timeout", "upstream timed out")              \
    XX(INTERNAL, "internal", "internal error")                                  \
    XX(BLOCKED, "blocked", "stopped by a reply rule")

typedef enum cg_err {
    CG_OK = 0,
#define CG__ERR_ENUM(name, code, text) CG_E_##name,
    CG__ERR_FIRST = -100,
    CG_ERR_MAP(CG__ERR_ENUM)
#undef CG__ERR_ENUM
    CG__ERR_END /* one past the last code */
} cg_err;

/* How many codes there are; code err's slot among them is err - CG__ERR_FIRST - 1. */
#define CG_ERR_COUNT (CG__ERR_END - CG__ERR_FIRST - 1)

/* The protocol's code for err ("bad_frame"); "internal" for anything unknown. */
const char *cg_err_code(int err);
/* A short human text for err. */
const char *cg_strerror(int err);

#endif
