/*
 * log.c: the process's log lines: "2026-11-22T05:50:00.123Z chatgate[pid] LEVEL text", or
 * {"ts":...,"level":...,"pid":...,"msg":...} with --log-format json.
 *
 * One write(2) per line so lines from one process never interleave mid-line. Masking is
 * three PCRE2 substitutions, compiled once; a line that cannot be masked is not written as
 * it was, it is replaced by a notice.
 */
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <uv.h>
#include <libwebsockets.h>
#include <jansson.h>

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include "chatgate/log.h"

static cg_log_level current_level = CG_LOG_INFO;
static int log_json;

void cg_log_set_json(int json)
{
    log_json = json;
}

/* What is masked, in this order (tokens first: a JWT must not be half taken for a phone). */
static const struct { const char *pattern; const char *replacement; } masks[] = {
    {"(?i)\\bbearer\\s+[\\w.~+/=-]+|\\beyJ[\\w-]+\\.[\\w-]+\\.[\\w-]*|\\bsk-[\\w-]{6,}"
     "|(?<=[?&])(?:access_token|resume|token|api_key)=[^&\\s\"]+|\\bu_[0-9a-f]{16}\\.[\\w-]{20,}",
     "[token]"},
    {"[\\w.+-]+@[\\w-]+(?:\\.[\\w-]+)+", "[email]"},
    /* international (+...), national (0...) or (555) 123-4567; a bare count like 1048576 stays */
    {"(?<![\\w.:/-])(?:\\+\\d(?:[ ()-]{0,2}\\d){6,14}|0\\d(?:[ ()-]{0,2}\\d){7,12}"
     "|\\(\\d{3}\\)\\s?\\d{3}[ -]?\\d{4})(?![\\w:/]|\\.\\d)",
     "[phone]"},
};
#define N_MASKS (sizeof(masks) / sizeof(masks[0]))

char *cg_log_mask(const char *text, char *out, size_t outlen)
{
    static pcre2_code *re[N_MASKS];
    static int compiled;
    if (!compiled) {
        compiled = 1;
        for (size_t i = 0; i < N_MASKS; i++) {
            int code;
            PCRE2_SIZE off;
            re[i] = pcre2_compile((PCRE2_SPTR)masks[i].pattern, PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP, &code,
                                  &off, NULL);
            if (re[i])
                pcre2_jit_compile(re[i], PCRE2_JIT_COMPLETE);
        }
    }
    char tmp[4096];
    snprintf(tmp, sizeof(tmp), "%s", text);
    for (size_t i = 0; i < N_MASKS; i++) {
        PCRE2_SIZE n = outlen;
        int rc = re[i] ? pcre2_substitute(re[i], (PCRE2_SPTR)tmp, PCRE2_ZERO_TERMINATED, 0,
                                          PCRE2_SUBSTITUTE_GLOBAL,
                                          NULL, NULL, (PCRE2_SPTR)masks[i].replacement, PCRE2_ZERO_TERMINATED,
                                          (PCRE2_UCHAR *)out, &n)
                       : -1;
        if (rc < 0) { /* not UTF-8, or too long: say so rather than write it unmasked */
            snprintf(out, outlen, "(a log line that could not be masked was dropped)");
            return out;
        }
        snprintf(tmp, sizeof(tmp), "%s", out);
    }
    return out;
}
static const char *const level_names[] = {"error", "warn", "info", "debug"};

int cg_log_level_parse(const char *name)
{
    for (int i = 0; i < 4; i++)
        if (strcmp(name, level_names[i]) == 0)
            return i;
    return -1;
}

void cg_log_set_level(cg_log_level level)
{
    current_level = level;
}

int cg_log_enabled(cg_log_level level)
{
    return level <= current_level;
}

void cg_log(cg_log_level level, const char *fmt, ...)
{
    if (!cg_log_enabled(level))
        return;
    char ts[80], raw[2048], masked[2048], line[4096];
    struct timeval tv;
    struct tm tm;
    gettimeofday(&tv, NULL);
    gmtime_r(&tv.tv_sec, &tm);
    snprintf(ts, sizeof(ts), "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday,
             tm.tm_hour, tm.tm_min, tm.tm_sec, (int)(tv.tv_usec / 1000));
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(raw, sizeof(raw), fmt, ap);
    va_end(ap);
    size_t rl = strlen(raw);
    while (rl > 0 && raw[rl - 1] == '\n') /* lws hands us lines that already end in '\n' */
        raw[--rl] = 0;
    cg_log_mask(raw, masked, sizeof(masked));
    int len;
    if (log_json) {
        json_t *o = json_pack("{s:s, s:s, s:i, s:s}", "ts", ts, "level", level_names[level], "pid", (int)getpid(),
                              "msg", masked);
        char *js = o ? json_dumps(o, JSON_COMPACT) : NULL;
        json_decref(o);
        len = snprintf(line, sizeof(line) - 1, "%s", js ? js : "{\"msg\":\"(a log line that could not be encoded)\"}");
        free(js);
    } else {
        len = snprintf(line, sizeof(line) - 1, "%s chatgate[%d] %s %s", ts, (int)getpid(), level_names[level], masked);
    }
    if (len < 0)
        return;
    if ((size_t)len > sizeof(line) - 2)
        len = (int)sizeof(line) - 2;
    line[len++] = '\n';
    ssize_t w = write(STDERR_FILENO, line, (size_t)len);
    (void)w;
}

static void lws_emit(int lws_level, const char *line)
{
    cg_log(lws_level == LLL_ERR ? CG_LOG_ERROR : CG_LOG_WARN, "lws: %s", line);
}

void cg_log_route_lws(void)
{
    lws_set_log_level(LLL_ERR | LLL_WARN, lws_emit);
}
