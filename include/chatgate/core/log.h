/*
 * log.h: one line per event on stderr, with a level, as text or as JSON.
 *
 * Every line is masked before it is written, and before it is cut to its 2,048-byte bound:
 * e-mail addresses, phone numbers (international and national forms) and tokens (bearer
 * tokens, JWTs, API keys, resume tokens, token query parameters) become [email], [phone],
 * [token], whoever logged them (an upstream's error text can quote a user).
 * libwebsockets' own log lines are routed here too, at warning and error level.
 */
#ifndef CHATGATE_LOG_H
#define CHATGATE_LOG_H

#include <stddef.h>

typedef enum cg_log_level {
    CG_LOG_ERROR = 0,
    CG_LOG_WARN = 1,
    CG_LOG_INFO = 2,
    CG_LOG_DEBUG = 3,
} cg_log_level;

/* Parses "error", "warn", "info" or "debug"; returns the level or -1. */
int cg_log_level_parse(const char *name);
void cg_log_set_level(cg_log_level level);
/* 1: one JSON object per line ({"ts","level","pid","msg"}); 0: text (the default). */
void cg_log_set_json(int json);
/* Masks PII and secrets in text into out (always NUL-terminated, cut on a UTF-8 boundary
 * after masking, bytes that are not UTF-8 as '?'); returns out. */
char *cg_log_mask(const char *text, char *out, size_t outlen);
/* The same into a new string of the length it needs (malloc'd); NULL when it cannot be
 * masked (the caller then writes nothing of text). */
char *cg_log_mask_dup(const char *text);
int cg_log_enabled(cg_log_level level);
/* Hands libwebsockets' log lines to cg_log. */
void cg_log_route_lws(void);

void cg_log(cg_log_level level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#define cg_error(...) cg_log(CG_LOG_ERROR, __VA_ARGS__)
#define cg_warn(...) cg_log(CG_LOG_WARN, __VA_ARGS__)
#define cg_info(...) cg_log(CG_LOG_INFO, __VA_ARGS__)
#define cg_debug(...)                                                           \
    do {                                                                        \
        if (cg_log_enabled(CG_LOG_DEBUG))                                       \
            cg_log(CG_LOG_DEBUG, __VA_ARGS__);                                  \
    } while (0)

#endif
