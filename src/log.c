/*
 * log.c: the process's log lines: "2026-11-22T05:50:00.123Z chatgate[pid] LEVEL text".
 *
 * One write(2) per line so lines from one process never interleave mid-line.
 */
#include <uv.h>
#include <libwebsockets.h>

#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include "chatgate/log.h"

static cg_log_level current_level = CG_LOG_INFO;
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
    char line[2048];
    struct timeval tv;
    struct tm tm;
    gettimeofday(&tv, NULL);
    gmtime_r(&tv.tv_sec, &tm);
    int n = snprintf(line, sizeof(line), "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ chatgate[%d] %s ",
                     tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min,
                     tm.tm_sec, (int)(tv.tv_usec / 1000), (int)getpid(), level_names[level]);
    va_list ap;
    va_start(ap, fmt);
    int m = vsnprintf(line + n, sizeof(line) - (size_t)n - 1, fmt, ap);
    va_end(ap);
    size_t len = (size_t)n + (m < 0 ? 0 : (size_t)m);
    if (len > sizeof(line) - 2)
        len = sizeof(line) - 2;
    /* lws hands us lines that already end in '\n'. */
    while (len > 0 && line[len - 1] == '\n')
        len--;
    line[len++] = '\n';
    ssize_t w = write(STDERR_FILENO, line, len);
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
