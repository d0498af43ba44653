/*
 * log.c: the process's log lines: "2026-11-22T05:50:00.123Z chatgate[pid] LEVEL text", or
 * {"ts":...,"level":...,"pid":...,"msg":...} with --log-format json.
 *
 * One write(2) per line so lines from one process never interleave mid-line. A line is
 * formatted whole (up to CG_LOG_MAX_FORMAT bytes), masked, and only then cut to
 * CG_LOG_MAX_MESSAGE bytes on a UTF-8 boundary: a cut never leaves half a secret that the
 * masks could not recognise. Bytes that are not UTF-8 become '?', so every line is text
 * (and JSON can carry it). Masking is three PCRE2 substitutions, compiled once, each
 * linear in the line (the patterns start only where a secret can start) and bounded by a
 * match limit; a line that cannot be masked is not written as it was, it is replaced by a
 * notice.
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

#include "chatgate/core/alloc.h"
#include "chatgate/core/log.h"
#include "chatgate/core/utf8.h"

#define CG_LOG_MAX_FORMAT (64 * 1024) /* bytes of a formatted line that are masked at all */
#define CG_LOG_MAX_MESSAGE 2048       /* bytes of a masked message that are written */
#define CG_LOG_TAIL_DROP 4096         /* dropped from a line cut at CG_LOG_MAX_FORMAT, see below */

static const char dropped_notice[] = "(a log line that could not be masked was dropped)";

static cg_log_level current_level = CG_LOG_INFO;
static int log_json;

void cg_log_set_json(int json)
{
    log_json = json;
}

/*
 * What is masked, in this order (tokens first: a JWT must not be half taken for a phone).
 * Phone numbers: international (+254 712 345 678), national with a trunk 0 (0712 345 678,
 * 07946-095-800, 020 7946 0958), an area code in brackets ((020) 7946 0958, (555) 123-4567)
 * and 555-123-4567; followed by anything but a word character, '/', or '.'/':' and a digit
 * ("message +254712345678: ..." is masked; 127.0.0.1:8080, times and counts stay).
 */
#define PHONE_END "(?![\\w/]|[.:]\\d)"
static const struct { const char *pattern; const char *replacement; } masks[] = {
    {"(?i)\\bbearer\\s+[\\w.~+/=-]+|\\beyJ[\\w-]+\\.[\\w-]+\\.[\\w-]*|\\bsk-[\\w-]{6,}"
     "|(?<=[?&])(?:access_token|resume|token|api_key)=[^&\\s\"']+|\\bu_[0-9a-f]{16}\\.[\\w-]{20,}",
     "[token]"},
    {"(?<![\\w.+-])[\\w.+-]+@[\\w-]+(?:\\.[\\w-]+)+", "[email]"},
    /* "+" and a country code is a phone number after anything but a digit or another "+"
     * (phone:+254..., id_+254...); the national forms need a word boundary of their own */
    {"(?<![\\d+])\\+\\d(?:[ ()-]{0,2}\\d){6,14}" PHONE_END
     "|(?<![\\w.:/+-])(?:0\\d(?:[ ()-]{0,2}\\d){7,12}"
     "|\\(\\d{2,5}\\)[ -]?\\d(?:[ -]?\\d){5,9}|\\d{3}-\\d{3}-\\d{4})" PHONE_END,
     "[phone]"},
};
#define N_MASKS (sizeof(masks) / sizeof(masks[0]))

static pcre2_code *mask_re[N_MASKS];
static pcre2_match_context *mask_mctx;

static void masks_compile(void)
{
    static int compiled;
    if (compiled)
        return;
    compiled = 1;
    mask_mctx = pcre2_match_context_create(NULL);
    if (mask_mctx)
        pcre2_set_match_limit(mask_mctx, 1000000);
    for (size_t i = 0; i < N_MASKS; i++) {
        int code;
        PCRE2_SIZE off;
        mask_re[i] = pcre2_compile((PCRE2_SPTR)masks[i].pattern, PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP, &code,
                                   &off, NULL);
        if (mask_re[i])
            pcre2_jit_compile(mask_re[i], PCRE2_JIT_COMPLETE);
    }
}

/* The largest length <= max that ends on a UTF-8 character boundary of s. */
static size_t utf8_cut(const char *s, size_t len, size_t max)
{
    if (len <= max)
        return len;
    while (max > 0 && ((unsigned char)s[max] & 0xC0) == 0x80)
        max--;
    return max;
}

/* One substitution over text into a new buffer sized to fit; NULL when it fails. */
static char *substitute(size_t i, const char *text)
{
    PCRE2_SIZE n = strlen(text) + 64;
    for (int attempt = 0; attempt < 2; attempt++) {
        char *out = cg_malloc(n);
        int rc = pcre2_substitute(mask_re[i], (PCRE2_SPTR)text, PCRE2_ZERO_TERMINATED, 0,
                                  PCRE2_SUBSTITUTE_GLOBAL | PCRE2_SUBSTITUTE_OVERFLOW_LENGTH, NULL, mask_mctx,
                                  (PCRE2_SPTR)masks[i].replacement, PCRE2_ZERO_TERMINATED, (PCRE2_UCHAR *)out, &n);
        if (rc >= 0)
            return out;
        free(out);
        if (rc != PCRE2_ERROR_NOMEMORY)
            return NULL; /* the match limit, say */
        /* n now holds the length needed */
    }
    return NULL;
}

char *cg_log_mask_dup(const char *text)
{
    masks_compile();
    size_t len = strlen(text);
    char *cur = cg_malloc(len + 1);
    memcpy(cur, text, len + 1);
    cg_utf8_clean(cur, len);
    for (size_t i = 0; i < N_MASKS; i++) {
        char *next = mask_re[i] ? substitute(i, cur) : NULL;
        free(cur);
        if (!next)
            return NULL; /* never the text as it was */
        cur = next;
    }
    return cur;
}

char *cg_log_mask(const char *text, char *out, size_t outlen)
{
    char *masked = cg_log_mask_dup(text);
    const char *src = masked ? masked : dropped_notice;
    size_t n = outlen ? utf8_cut(src, strlen(src), outlen - 1) : 0;
    if (outlen) {
        memcpy(out, src, n);
        out[n] = 0;
    }
    free(masked);
    return out;
}

/*
 * The message of fmt/ap, masked, then cut to CG_LOG_MAX_MESSAGE bytes; malloc'd, or NULL.
 * A message formatted longer than CG_LOG_MAX_FORMAT is masked on its first
 * CG_LOG_MAX_FORMAT bytes, and the last CG_LOG_TAIL_DROP bytes of that masked text are
 * dropped too: a secret cut by the format bound is not whole there, so no mask knows it.
 */
static char *format_masked(const char *fmt, va_list ap)
{
    va_list again;
    va_copy(again, ap);
    int n = vsnprintf(NULL, 0, fmt, ap);
    if (n < 0) {
        va_end(again);
        return NULL;
    }
    size_t cap = (size_t)n < CG_LOG_MAX_FORMAT ? (size_t)n : CG_LOG_MAX_FORMAT;
    char *raw = cg_malloc(cap + 1);
    vsnprintf(raw, cap + 1, fmt, again);
    va_end(again);
    int over = (size_t)n > cap;
    size_t rl = utf8_cut(raw, (size_t)n, cap);
    raw[rl] = 0;
    while (rl > 0 && raw[rl - 1] == '\n') /* lws hands us lines that already end in '\n' */
        raw[--rl] = 0;
    char *masked = cg_log_mask_dup(raw);
    free(raw);
    if (!masked)
        return NULL;
    size_t ml = strlen(masked);
    size_t keep = over ? (ml > CG_LOG_TAIL_DROP ? ml - CG_LOG_TAIL_DROP : 0) : ml;
    if (keep > CG_LOG_MAX_MESSAGE)
        keep = CG_LOG_MAX_MESSAGE;
    keep = utf8_cut(masked, ml, keep);
    if (keep == ml)
        return masked;
    static const char mark[] = " [cut]";
    char *cut = cg_realloc(masked, keep + sizeof(mark));
    memcpy(cut + keep, mark, sizeof(mark));
    return cut;
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

/* Writes one whole line (text and its '\n') with one write(2). */
static void write_line(const char *text)
{
    size_t n = strlen(text);
    char *line = cg_malloc(n + 1);
    memcpy(line, text, n);
    line[n] = '\n';
    ssize_t w = write(STDERR_FILENO, line, n + 1);
    (void)w;
    free(line);
}

void cg_log(cg_log_level level, const char *fmt, ...)
{
    if (!cg_log_enabled(level))
        return;
    char ts[80];
    struct timeval tv;
    struct tm tm;
    gettimeofday(&tv, NULL);
    gmtime_r(&tv.tv_sec, &tm);
    snprintf(ts, sizeof(ts), "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday,
             tm.tm_hour, tm.tm_min, tm.tm_sec, (int)(tv.tv_usec / 1000));
    va_list ap;
    va_start(ap, fmt);
    char *masked = format_masked(fmt, ap);
    va_end(ap);
    const char *msg = masked ? masked : dropped_notice;
    if (log_json) {
        json_t *o = json_pack("{s:s, s:s, s:i, s:s}", "ts", ts, "level", level_names[level], "pid", (int)getpid(),
                              "msg", msg);
        char *js = o ? json_dumps(o, JSON_COMPACT) : NULL;
        json_decref(o);
        write_line(js ? js : "{\"msg\":\"(a log line that could not be encoded)\"}");
        free(js);
    } else {
        char line[CG_LOG_MAX_MESSAGE + 256]; /* the message is at most CG_LOG_MAX_MESSAGE + " [cut]" */
        snprintf(line, sizeof(line), "%s chatgate[%d] %s %s", ts, (int)getpid(), level_names[level], msg);
        write_line(line);
    }
    free(masked);
}

static void lws_emit(int lws_level, const char *line)
{
    /* lws 4.1.6 says this at error level for every socket handed over with a buffer
     * (lws_adopt_socket_vhost_readbuf, which the listener uses for every connection): a
     * note of its own, not an error */
    if (strstr(line, "adopt_socket_readbuf: calling service"))
        return;
    cg_log(lws_level == LLL_ERR ? CG_LOG_ERROR : CG_LOG_WARN, "lws: %s", line);
}

void cg_log_route_lws(void)
{
    lws_set_log_level(LLL_ERR | LLL_WARN, lws_emit);
}
