/*
 * rules_normalise.c: the value normalisers of `type` lines: what a user wrote ("Feb 20",
 * "two", "5k shillings") turned into the value an upstream can use ("2026-02-20", 2, 5000
 * and "KES"). rules/README.md lists every form each one reads.
 *
 * They are public (rules.h) so tests and tools can call them alone. Dates are read in the
 * process's time zone (TZ, which main sets from --timezone) against a clock passed in, never
 * the system's, so the same words give the same date in tests and in the rule tests. A text
 * a normaliser does not read is refused (-1) rather than guessed: the param is then left
 * out, and the dialog asks again instead of carrying a wrong value.
 */
#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "chatgate/dialog/rules.h"
#include "chatgate/dialog/rules_internal.h"

static const char *const month_names[] = {"jan", "feb", "mar", "apr", "may", "jun",
                                          "jul", "aug", "sep", "oct", "nov", "dec"};

/* A month from a word of at least three letters ("feb", "february"); 1-12 or 0. */
static int month_of(const char *w, size_t n)
{
    static const char *const full[] = {"january", "february", "march",     "april",   "may",      "june",
                                       "july",    "august",   "september", "october", "november", "december"};
    if (n < 3)
        return 0;
    for (int m = 0; m < 12; m++)
        if (strncmp(w, month_names[m], 3) == 0 && n <= strlen(full[m]) && strncmp(w, full[m], n) == 0)
            return m + 1;
    if (n == 4 && strncmp(w, "sept", 4) == 0)
        return 9;
    return 0;
}

/* v (0 <= v < 10^n) in n digits, zeros first. */
static void put_digits(char *out, int v, int n)
{
    for (int i = n - 1; i >= 0; i--, v /= 10)
        out[i] = (char)('0' + v % 10);
}

static void put_date(char out[11], int y, int m, int d)
{
    if (y >= 0 && y <= 9999 && m >= 0 && m <= 99 && d >= 0 && d <= 99) { /* every real date: no snprintf */
        put_digits(out, y, 4);
        out[4] = '-';
        put_digits(out + 5, m, 2);
        out[7] = '-';
        put_digits(out + 8, d, 2);
        out[10] = 0;
        return;
    }
    char tmp[48];
    snprintf(tmp, sizeof(tmp), "%04d-%02d-%02d", y, m, d);
    memcpy(out, tmp, 10);
    out[10] = 0;
}

static void format_date(int64_t t, char out[11])
{
    time_t tt = (time_t)t;
    struct tm tm;
    localtime_r(&tt, &tm); /* the gateway's time zone: TZ, set from --timezone (UTC by default) */
    put_date(out, tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday);
}

static int valid_day(int y, int m, int d)
{
    static const int days[] = {31, 29, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31};
    if (m < 1 || m > 12 || d < 1 || d > days[m - 1])
        return 0;
    return m != 2 || d < 29 || (y % 4 == 0 && (y % 100 != 0 || y % 400 == 0));
}

static int64_t day_start(int y, int m, int d)
{
    struct tm tm = {.tm_year = y - 1900, .tm_mon = m - 1, .tm_mday = d, .tm_hour = 12}; /* noon: no DST edge */
    tm.tm_isdst = -1;
    return (int64_t)mktime(&tm);
}

int cg_normalise_date(const char *in, int64_t now, char out[11])
{
    char s[128];
    size_t n = 0;
    for (const char *p = in; *p && n < sizeof(s) - 1; p++) /* lowercase, ',' and '.' as spaces */
        s[n++] = (*p == ',' || *p == '.') ? ' ' : (char)tolower((unsigned char)*p);
    s[n] = 0;
    char *t = cg_rules_trim(s);
    time_t tt = (time_t)now;
    struct tm today;
    localtime_r(&tt, &today);
    int ty = today.tm_year + 1900, tmon = today.tm_mon + 1, tday = today.tm_mday;
    static const struct { const char *word; int days; } relative[] = {
        {"today", 0}, {"tonight", 0}, {"tomorrow", 1}, {"day after tomorrow", 2}, {"the day after tomorrow", 2},
        {"next week", 7}, {"in a week", 7},
    };
    for (size_t i = 0; i < sizeof(relative) / sizeof(relative[0]); i++)
        if (strcmp(t, relative[i].word) == 0) {
            format_date(day_start(ty, tmon, tday) + relative[i].days * 86400, out);
            return 0;
        }
    int y, m, d;
    char tail;
    /* both numeric forms begin with a digit; sscanf is not cheap, and most dates are words */
    if (isdigit((unsigned char)t[0]) &&
        (sscanf(t, "%4d-%2d-%2d%c", &y, &m, &d, &tail) == 3 || sscanf(t, "%2d/%2d/%4d%c", &d, &m, &y, &tail) == 3)) {
        if (!valid_day(y, m, d))
            return -1;
        put_date(out, y, m, d);
        return 0;
    }
    /* words: a month name, a day number (1st, 20th), an optional year; "of" and "on" skipped */
    d = m = y = 0;
    for (char *w = t; *w;) {
        size_t len = strcspn(w, " ");
        char word[32];
        size_t wlen = len < 31 ? len : 31;
        memcpy(word, w, wlen);
        word[wlen] = 0;
        char *end;
        long v = strtol(word, &end, 10);
        if (end != word && (*end == 0 || strcmp(end, "st") == 0 || strcmp(end, "nd") == 0 ||
                            strcmp(end, "rd") == 0 || strcmp(end, "th") == 0)) {
            if (v >= 1 && v <= 31 && !d)
                d = (int)v;
            else if (v >= 1970 && v <= 2200 && !y && *end == 0)
                y = (int)v;
            else
                return -1;
        } else if (month_of(word, strlen(word)) && !m) {
            m = month_of(word, strlen(word));
        } else if (strcmp(word, "of") != 0 && strcmp(word, "on") != 0 && strcmp(word, "the") != 0) {
            return -1;
        }
        w += len;
        while (*w == ' ')
            w++;
    }
    if (!d || !m)
        return -1;
    if (!y) { /* the next such date on or after today (compared as dates: mktime, twice a
               * message with a date, was a twentieth of the rules' time; issue 12) */
        y = ty;
        if (!valid_day(y, m, d) || m < tmon || (m == tmon && d < tday))
            y++;
        while (!valid_day(y, m, d) && y < ty + 8)
            y++; /* 29 February */
    }
    if (!valid_day(y, m, d))
        return -1;
    put_date(out, y, m, d);
    return 0;
}

int cg_normalise_int(const char *in, long *out)
{
    static const char *const words[] = {"zero", "one", "two", "three", "four",  "five", "six",
                                        "seven", "eight", "nine", "ten", "eleven", "twelve"};
    char s[64];
    snprintf(s, sizeof(s), "%s", in);
    char *t = cg_rules_trim(s);
    for (char *p = t; *p; p++)
        *p = (char)tolower((unsigned char)*p);
    for (long i = 0; i < 13; i++)
        if (strcmp(t, words[i]) == 0 || (i == 1 && (strcmp(t, "a") == 0 || strcmp(t, "an") == 0))) {
            *out = i;
            return 0;
        }
    char *end;
    errno = 0;
    long v = strtol(t, &end, 10);
    if (end == t || *end || errno)
        return -1;
    *out = v;
    return 0;
}

/* The first currency named in s (lowercase): its ISO code into code ("" when none), and the
 * words of it blanked out of s. */
static void take_currency(char *s, char code[4])
{
    static const struct { const char *token; const char *code; } currencies[] = {
        {"kes", "KES"}, {"ksh", "KES"}, {"kshs", "KES"}, {"shillings", "KES"}, {"shilling", "KES"}, {"bob", "KES"},
        {"usd", "USD"}, {"dollars", "USD"}, {"dollar", "USD"}, {"$", "USD"}, {"eur", "EUR"}, {"euros", "EUR"},
        {"euro", "EUR"}, {"\xe2\x82\xac", "EUR"}, {"gbp", "GBP"}, {"pounds", "GBP"}, {"pound", "GBP"},
        {"\xc2\xa3", "GBP"},
    };
    code[0] = 0;
    for (size_t i = 0; i < sizeof(currencies) / sizeof(currencies[0]); i++) {
        char *hit = strstr(s, currencies[i].token);
        size_t len = strlen(currencies[i].token);
        if (!hit)
            continue;
        int word = isalpha((unsigned char)currencies[i].token[0]);
        if (word && ((hit > s && isalpha((unsigned char)hit[-1])) || isalpha((unsigned char)hit[len])))
            continue;
        snprintf(code, 4, "%s", currencies[i].code);
        memset(hit, ' ', len);
        return;
    }
}

/* in, lowercased (ASCII), into s of n bytes, cut to fit. */
static void lower_copy(const char *in, char *s, size_t n)
{
    size_t i = 0;
    for (; in[i] && i < n - 1; i++)
        s[i] = (char)tolower((unsigned char)in[i]);
    s[i] = 0;
}

int cg_normalise_currency(const char *in, char code[4])
{
    char s[128];
    lower_copy(in, s, sizeof(s));
    take_currency(s, code);
    return code[0] ? 0 : -1;
}

void cg_normalise_title(char *s)
{
    int start = 1;
    for (char *c = s; *c; c++) {
        unsigned char u = (unsigned char)*c;
        if (start && u < 0x80 && isalpha(u))
            *c = (char)toupper(u);
        start = u == ' ' || u == '-' || u == '\'';
    }
}

int cg_normalise_amount(const char *in, double *amount, char currency[4])
{
    char s[128];
    lower_copy(in, s, sizeof(s));
    take_currency(s, currency); /* taken out, wherever it stands */
    /* the number: digits with ',' thousands and '.' decimals, then k or m */
    char digits[64];
    size_t d = 0;
    char *p = cg_rules_trim(s);
    for (; *p && d < sizeof(digits) - 1; p++) {
        if (isdigit((unsigned char)*p) || *p == '.')
            digits[d++] = *p;
        else if (*p != ',')
            break;
    }
    digits[d] = 0;
    if (!d)
        return -1;
    char *end;
    double v = strtod(digits, &end);
    if (*end)
        return -1;
    p = cg_rules_trim(p);
    if (strcmp(p, "k") == 0 || strcmp(p, "thousand") == 0)
        v *= 1000;
    else if (strcmp(p, "m") == 0 || strcmp(p, "million") == 0)
        v *= 1000000;
    else if (*p)
        return -1;
    if (!isfinite(v))
        return -1;
    *amount = v;
    return 0;
}
