/*
 * test_jsonw.c: the JSON text writer (jsonout.h, cg_jsonw), checked against jansson, which it
 * replaces on the hot path: every frame it writes must be the bytes json_dumps wrote before,
 * or a client or app that compares frames (or a test that does) sees a change. A string is
 * compared with json_dumps(json_stringn(s, len), JSON_COMPACT | JSON_ENCODE_ANY): the empty
 * string, every ASCII byte alone, embedded NULs, 64 KiB texts and 100,000 random strings made
 * of the pieces escaping gets wrong (quotes, backslashes, control characters, '/', DEL, 2- to
 * 4-byte characters at the edges of their ranges). Text that is not UTF-8 must fail the frame
 * exactly when json_stringn refuses it: stray and cut-off bytes, overlong forms, surrogates,
 * past U+10FFFF, every two-byte text and random bytes. Values go through jansson and must
 * dump as it dumps them; integers print as %lld. Whole frames parse back (json_loads) to
 * what was written, at headrooms of 0, 16 and 32 bytes and from hints too small for them, so
 * the buffer grows. A failed piece makes the frame fail, whatever is written after it, and
 * frees the buffer (ASan's leak check shows it). Every input is an exact-size heap copy, so
 * ASan sees any read past it. A disagreement is shown with its input bytes and both texts.
 */
#include <jansson.h>
#include <limits.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "chatgate/core/jsonout.h"
#include "chatgate/core/swar.h"
#include "unit.h"

/* ---- the two sides -------------------------------------------------------------------- */

/* The writer's text for the string s[0..len) alone (an exact-size copy of it): a malloc'd
 * NUL-terminated copy, *n its length, or NULL when the writer fails it (s NULL is given as
 * NULL). The frame's own
 * checks (its length, its NUL) are counted in *bad. */
static char *writer_str(const char *s, size_t len, size_t pre, size_t hint, size_t *n, long *bad)
{
    char *copy = s ? unit_dup_exact(s, len) : NULL;
    cg_jsonw w;
    cg_jsonw_init(&w, pre, hint);
    cg_jsonw_str(&w, copy, len);
    size_t l = (size_t)-1;
    char *buf = cg_jsonw_end(&w, &l);
    free(copy);
    if (!buf)
        return NULL;
    if (l == (size_t)-1 || buf[pre + l] != 0 || strlen(buf + pre) != l)
        ++*bad;
    char *out = malloc(l + 1);
    if (!out)
        abort();
    memcpy(out, buf + pre, l + 1);
    free(buf);
    *n = l;
    return out;
}

/* jansson's text for the same string, or NULL when json_stringn refuses it. */
static char *jansson_str(const char *s, size_t len)
{
    json_t *j = json_stringn(s, len);
    if (!j)
        return NULL;
    char *d = json_dumps(j, JSON_COMPACT | JSON_ENCODE_ANY);
    json_decref(j);
    if (!d)
        abort();
    return d;
}

/* ---- showing a disagreement ----------------------------------------------------------- */

static void show_hex(const char *label, const char *s, size_t n)
{
    fprintf(stderr, "    %s (%zu bytes):", label, n);
    for (size_t i = 0; i < n && i < 48; i++)
        fprintf(stderr, " %02x", (unsigned char)s[i]);
    fprintf(stderr, "%s\n", n > 48 ? " ..." : "");
}

/* Text from `at` on (up to 64 bytes), printable ASCII as it is, other bytes as \xNN. */
static void show_text(const char *label, const char *s, size_t n, size_t at)
{
    if (!s) {
        fprintf(stderr, "    %s: fails (NULL)\n", label);
        return;
    }
    fprintf(stderr, "    %s (%zu bytes, from offset %zu): %s", label, n, at, at ? "..." : "");
    for (size_t i = at; i < n && i < at + 64; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c >= 0x20 && c < 0x7f)
            fputc(c, stderr);
        else
            fprintf(stderr, "\\x%02x", c);
    }
    fprintf(stderr, "%s\n", n > at + 64 ? "..." : "");
}

/* A group of comparisons: how many disagreed, the first few shown. */
typedef struct {
    const char *name;
    long runs, wrong, bad_frame;
} tally;

static void disagree(tally *t, const char *in, size_t in_len, const char *mine, size_t mine_len,
                     const char *theirs, size_t theirs_len)
{
    if (t->wrong++ >= 3)
        return;
    size_t at = 0;
    if (mine && theirs) {
        while (at < mine_len && at < theirs_len && mine[at] == theirs[at])
            at++;
        at = at > 16 ? at - 16 : 0;
    }
    fprintf(stderr, "  %s: the writer disagrees with jansson\n", t->name);
    show_hex("input", in, in_len);
    show_text("writer ", mine, mine_len, at);
    show_text("jansson", theirs, theirs_len, at);
}

/* The writer against jansson for one string; returns 1 when they agree. */
static int compare_at(tally *t, const char *s, size_t len, size_t pre, size_t hint)
{
    size_t mine_len = 0;
    char *mine = writer_str(s, len, pre, hint, &mine_len, &t->bad_frame);
    char *theirs = jansson_str(s, len);
    size_t theirs_len = theirs ? strlen(theirs) : 0;
    int same = (!mine && !theirs) ||
               (mine && theirs && mine_len == theirs_len && memcmp(mine, theirs, mine_len) == 0);
    t->runs++;
    if (!same)
        disagree(t, s, len, mine, mine_len, theirs, theirs_len);
    free(mine);
    free(theirs);
    return same;
}

static int compare(tally *t, const char *s, size_t len)
{
    return compare_at(t, s, len, 0, 0);
}

static void done(tally *t)
{
    if (t->wrong)
        fprintf(stderr, "%s: %ld of %ld strings disagree with jansson\n", t->name, t->wrong, t->runs);
    if (t->bad_frame)
        fprintf(stderr, "%s: %ld texts with a wrong length or no NUL after them\n", t->name,
                t->bad_frame);
    CHECK(t->runs > 0);
    CHECK(t->wrong == 0);
    CHECK(t->bad_frame == 0);
}

/* ---- random strings, deterministic ---------------------------------------------------- */

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;

static uint32_t rnd(void)
{
    return unit_rand(&rng_state);
}

typedef struct {
    const char *s;
    size_t n;
} piece;

#define P(lit) {lit, sizeof(lit) - 1}

/* What escaping and UTF-8 checking can get wrong, every piece valid UTF-8. */
static const piece pool[] = {
    P("a"), P("Z"), P("hello"), P(" "), P("0"), P("~"), P("{"), P("}"), P(":"), P(","), P("["),
    P("\""), P("\\"), P("/"), P("\\u0041"), P("\\\""), P("\"\""),
    P("\0"), P("\x01"), P("\b"), P("\t"), P("\n"), P("\x0b"), P("\f"), P("\r"), P("\x0e"),
    P("\x10"), P("\x1a"), P("\x1b"), P("\x1f"), P("\x7f"),
    P("\xC2\x80"),         /* U+0080, the first 2-byte character */
    P("\xC3\xA9"),         /* é */
    P("\xDF\xBF"),         /* U+07FF, the last */
    P("\xE0\xA0\x80"),     /* U+0800, the first 3-byte character */
    P("\xE2\x82\xAC"),     /* € */
    P("\xE2\x80\xA8"),     /* U+2028, not escaped by jansson */
    P("\xED\x9F\xBF"),     /* U+D7FF, right before the surrogates */
    P("\xEE\x80\x80"),     /* U+E000, right after them */
    P("\xEF\xBB\xBF"),     /* the BOM */
    P("\xEF\xBF\xBF"),     /* U+FFFF */
    P("\xF0\x90\x80\x80"), /* U+10000, the first 4-byte character */
    P("\xF0\x9F\x98\x80"), /* 😀 */
    P("\xF4\x8F\xBF\xBF"), /* U+10FFFF, the last */
};
#define POOL_N (sizeof(pool) / sizeof(pool[0]))

/* Appends random pieces to out (room for cap bytes) until it holds at least want bytes or
 * nothing more fits; returns its length. */
static size_t random_text(char *out, size_t cap, size_t want)
{
    size_t n = 0;
    while (n < want) {
        const piece *p = &pool[rnd() % POOL_N];
        if (n + p->n > cap)
            break;
        memcpy(out + n, p->s, p->n);
        n += p->n;
    }
    return n;
}

/* ---- 1. valid strings ----------------------------------------------------------------- */

static size_t writer_len(const char *s, size_t len, char **out)
{
    long bad = 0;
    size_t n = 0;
    *out = writer_str(s, len, 0, 0, &n, &bad);
    CHECK(bad == 0);
    return n;
}

static void test_literal_escapes(void)
{
    /* the escapes jansson writes with a letter, and what it does not escape */
    static const struct {
        const char *in, *want;
    } cases[] = {
        {"", "\"\""},       {"\"", "\"\\\"\""},   {"\\", "\"\\\\\""}, {"/", "\"/\""},
        {"\b", "\"\\b\""},  {"\f", "\"\\f\""},    {"\n", "\"\\n\""},  {"\r", "\"\\r\""},
        {"\t", "\"\\t\""},  {"\x7f", "\"\x7f\""}, {"a b", "\"a b\""}, {"\xC3\xA9", "\"\xC3\xA9\""},
        {"\xF0\x9F\x98\x80", "\"\xF0\x9F\x98\x80\""},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        char *out;
        writer_len(cases[i].in, strlen(cases[i].in), &out);
        CHECK_STR(out, cases[i].want);
        free(out);
    }
}

static void test_each_ascii_byte(void)
{
    tally t = {.name = "every byte 0x00..0x7f alone"};
    char wrong[128 * 5 + 1] = "";
    for (unsigned b = 0; b < 0x80; b++) {
        char c = (char)b;
        if (!compare(&t, &c, 1))
            snprintf(wrong + strlen(wrong), sizeof(wrong) - strlen(wrong), " %02x", b);
    }
    if (t.wrong)
        fprintf(stderr, "  the bytes that disagree:%s\n", wrong);
    done(&t);

    /* each byte between two letters, and twice in a row */
    tally u = {.name = "every byte 0x00..0x7f inside text"};
    for (unsigned b = 0; b < 0x80; b++) {
        char s[5] = {'x', (char)b, (char)b, 'y', (char)b};
        compare(&u, s, 4);
        compare(&u, s, 5);
    }
    done(&u);
}

static void test_nul_and_edges(void)
{
    tally t = {.name = "embedded NULs and valid edges"};
    compare(&t, "", 0);
    compare(&t, "\0", 1);
    compare(&t, "\0\0\0", 3);
    compare(&t, "a\0b", 3);
    compare(&t, "\0\"\\\0", 4);
    compare(&t, "end\0", 4);
    for (size_t i = 0; i < POOL_N; i++) {
        compare(&t, pool[i].s, pool[i].n);
        for (size_t j = 0; j < POOL_N; j++) { /* every pair of pieces */
            char s[16];
            memcpy(s, pool[i].s, pool[i].n);
            memcpy(s + pool[i].n, pool[j].s, pool[j].n);
            compare(&t, s, pool[i].n + pool[j].n);
        }
    }
    done(&t);
}

static void test_long_strings(void)
{
    enum { LONG = 64 * 1024 };
    char *s = malloc(LONG);
    if (!s)
        abort();
    tally t = {.name = "64 KiB strings"};

    for (size_t i = 0; i < LONG; i++) /* plain ASCII: one run, nothing escaped */
        s[i] = (char)('a' + i % 26);
    compare(&t, s, LONG);
    for (size_t i = 0; i < LONG; i += 4) /* all 4-byte characters */
        memcpy(s + i, "\xF0\x9F\x98\x80", 4);
    compare(&t, s, LONG);
    for (size_t i = 0; i + 3 <= LONG; i += 3) /* all 3-byte characters, then ASCII */
        memcpy(s + i, "\xE2\x82\xAC", 3);
    s[LONG - 1] = '!';
    compare(&t, s, LONG);
    memset(s, '\n', LONG); /* all escaped: the text doubles */
    compare(&t, s, LONG);
    memset(s, 0, LONG); /* all NULs: six times the text */
    compare(&t, s, LONG);

    for (int k = 0; k < 4; k++) { /* mixed pieces, padded to exactly 64 KiB */
        size_t n = random_text(s, LONG, LONG - 4);
        while (n < LONG)
            s[n++] = 'p';
        compare(&t, s, LONG);
        /* and the same, broken at the end and at the start: both refuse it */
        s[LONG - 1] = (char)0xFF;
        compare(&t, s, LONG);
        s[LONG - 1] = 'p';
        s[0] = (char)0x80;
        compare(&t, s, LONG);
    }
    /* a 4-byte character cut off by the end of the text */
    for (size_t i = 0; i < LONG; i += 4)
        memcpy(s + i, "\xF0\x9F\x98\x80", 4);
    compare(&t, s, LONG - 1);
    compare(&t, s, LONG - 2);
    compare(&t, s, LONG - 3);
    done(&t);
    free(s);
}

static void test_random_strings(void)
{
    tally t = {.name = "random strings"};
    char s[4 * 40];
    for (int k = 0; k < 100000; k++) {
        size_t n = random_text(s, sizeof(s), rnd() % 40);
        compare(&t, s, n);
    }
    done(&t);
}

/* ---- 2. text that is not UTF-8 -------------------------------------------------------- */

static void test_invalid(void)
{
    static const piece bad[] = {
        P("\x80"), P("\xBF"), P("a\x80" "b"), P("\xC3\xA9\xA9"),       /* stray continuations */
        P("\xC3"), P("a\xE2\x82"), P("\xF0\x9F\x98"), P("\xF0\x9F"), P("\xF0"), /* cut off */
        P("\xE2" "a\xAC"), P("\xC3" "A"), P("\xF0\x9F\x98" "A"),         /* broken by ASCII */
        P("\xC0\x80"), P("\xC1\xBF"), P("\xE0\x80\x80"), P("\xE0\x9F\xBF"), /* overlong */
        P("\xF0\x80\x80\x80"), P("\xF0\x8F\xBF\xBF"),
        P("\xED\xA0\x80"), P("\xED\xBF\xBF"), P("\xED\xA0\xBD\xED\xB8\x80"), /* surrogates */
        P("\xF4\x90\x80\x80"), P("\xF4\xBF\xBF\xBF"), P("\xF5\x80\x80\x80"), /* past U+10FFFF */
        P("\xF7\xBF\xBF\xBF"), P("\xF8\x88\x80\x80\x80"), P("\xFC\x84\x80\x80\x80\x80"),
        P("\xFE"), P("\xFF"), P("ok\xFF"), P("\xFF" "ok"),
    };
    tally t = {.name = "invalid UTF-8"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        compare(&t, bad[i].s, bad[i].n);
        size_t n;
        long frame = 0;
        char *out = writer_str(bad[i].s, bad[i].n, 16, 0, &n, &frame);
        CHECK(out == NULL); /* and refused outright, not only as jansson does */
        free(out);
    }
    /* each lead byte 0xF5..0xFF with continuations after it */
    for (unsigned b = 0xF5; b <= 0xFF; b++) {
        char s[4] = {(char)b, (char)0x80, (char)0x80, (char)0x80};
        compare(&t, s, 4);
    }
    done(&t);

    /* every byte 0x80..0xff alone, and every two-byte text */
    tally u = {.name = "every byte alone, every two bytes"};
    for (unsigned a = 0; a < 256; a++) {
        char c = (char)a;
        compare(&u, &c, 1);
        for (unsigned b = 0; b < 256; b++) {
            char s[2] = {(char)a, (char)b};
            compare(&u, s, 2);
        }
    }
    done(&u);

    /* every three- and four-byte lead with every second byte, the rest at their edges */
    tally v = {.name = "every lead 0xE0..0xFF, every second byte"};
    static const unsigned char tails[] = {0x00, 0x41, 0x7F, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF, 0xC0, 0xFF};
    for (unsigned a = 0xE0; a <= 0xFF; a++)
        for (unsigned b = 0; b < 256; b++)
            for (size_t k = 0; k < sizeof(tails); k++) {
                char s[5] = {(char)a, (char)b, (char)tails[k], (char)0x80, 'z'};
                compare(&v, s, 3);
                compare(&v, s, 4);
                compare(&v, s, 5);
            }
    done(&v);

    /* random bytes, and random mixes of valid pieces with random bytes and cut pieces */
    tally w = {.name = "random bytes"};
    for (int k = 0; k < 50000; k++) {
        char s[64];
        size_t n = 0, want = rnd() % 24;
        while (n < want) {
            uint32_t r = rnd();
            if (r % 4 == 0 || k % 2 == 0) {
                s[n++] = (char)(r >> 8);
            } else {
                const piece *p = &pool[(r >> 8) % POOL_N];
                size_t take = r % 5 == 1 && p->n > 1 ? 1 + (r >> 16) % (p->n - 1) : p->n;
                memcpy(s + n, p->s, take);
                n += take;
            }
        }
        compare(&w, s, n);
    }
    done(&w);
}

/* ---- 3. null and jansson values ------------------------------------------------------- */

/* The writer's text for one value alone, NULL when it fails. */
static char *writer_json(json_t *v, size_t *n)
{
    cg_jsonw w;
    cg_jsonw_init(&w, 8, 0);
    cg_jsonw_json(&w, v);
    char *buf = cg_jsonw_end(&w, n);
    if (!buf)
        return NULL;
    char *out = strdup(buf + 8);
    if (!out)
        abort();
    CHECK(buf[8 + *n] == 0);
    free(buf);
    return out;
}

static void test_null_and_values(void)
{
    char *out;
    size_t n = 0;
    long bad = 0;

    out = writer_str(NULL, 0, 0, 0, &n, &bad);
    CHECK_STR(out, "null");
    CHECK(n == 4);
    free(out);
    out = writer_str(NULL, 5, 0, 0, &n, &bad); /* NULL writes null, whatever len says */
    CHECK_STR(out, "null");
    free(out);
    CHECK(bad == 0);
    /* next to a value's null */
    cg_jsonw w;
    cg_jsonw_init(&w, 4, 0);
    cg_jsonw_str(&w, NULL, 0);
    cg_jsonw_json(&w, NULL);
    char *buf = cg_jsonw_end(&w, &n);
    CHECK(buf != NULL);
    if (buf)
        CHECK_STR(buf + 4, "nullnull");
    CHECK(n == 8);
    free(buf);

    static const char *texts[] = {
        "{}",
        "[]",
        "{\"a\":1}",
        "[1,2,3]",
        "{\"usage\":{\"prompt_tokens\":12,\"completion_tokens\":345,\"total_tokens\":357}}",
        "{\"z\":[],\"a\":{},\"m\":[{}],\"k\":[[]]}",
        "[null,true,false,0,-1,1.5,\"x\"]",
        "{\"params\":{\"temperature\":0.7,\"top_p\":1.0,\"stop\":[\"\\n\",\"\\u0001\"],\"n\":null}}",
        "{\"s\":\"\\u0000\\u001f\\u007f/\\\"\\\\\\b\\f\\n\\r\\t\\u000b\"}",
        "\"\"",
        "\"caf\\u00e9 \\ud83d\\ude00 \\u2028\"",
        "\"\\u0000\"",
        "0",
        "-9223372036854775808",
        "9223372036854775807",
        "0.1",
        "1e300",
        "-2.5e-300",
        "3.0",
        "true",
        "false",
        "null",
        "[[[[[[[[[[1]]]]]]]]]]",
    };
    tally t = {.name = "cg_jsonw_json"};
    for (size_t i = 0; i < sizeof(texts) / sizeof(texts[0]); i++) {
        json_error_t err;
        json_t *v = json_loads(texts[i], JSON_DECODE_ANY | JSON_ALLOW_NUL, &err);
        CHECK(v != NULL);
        if (!v) {
            fprintf(stderr, "  cannot load %s: %s\n", texts[i], err.text);
            continue;
        }
        char *mine = writer_json(v, &n);
        char *theirs = json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY);
        t.runs++;
        if (!mine || !theirs || strcmp(mine, theirs) != 0 || n != strlen(theirs))
            disagree(&t, texts[i], strlen(texts[i]), mine, mine ? n : 0, theirs,
                     theirs ? strlen(theirs) : 0);
        free(mine);
        free(theirs);
        json_decref(v);
    }
    /* values built rather than parsed */
    json_t *built[] = {
        json_integer(LLONG_MIN), json_real(-0.0),        json_real(1.0 / 3.0), json_true(),
        json_false(),            json_null(),            json_stringn("a\0b", 3),
        json_object(),           json_array(),           json_pack("{s:[i,f,s#]}", "k", 7, 0.25, "\x01\xC3\xA9", 3),
    };
    for (size_t i = 0; i < sizeof(built) / sizeof(built[0]); i++) {
        CHECK(built[i] != NULL);
        char *mine = writer_json(built[i], &n);
        char *theirs = json_dumps(built[i], JSON_COMPACT | JSON_ENCODE_ANY);
        t.runs++;
        if (!mine || !theirs || strcmp(mine, theirs) != 0)
            disagree(&t, "(built value)", 13, mine, mine ? strlen(mine) : 0, theirs,
                     theirs ? strlen(theirs) : 0);
        free(mine);
        free(theirs);
        json_decref(built[i]);
    }
    done(&t);
}

/* ---- 4. integers ---------------------------------------------------------------------- */

static void test_int(void)
{
    /* each digit count, odd and even (two digits are written at a time), at their edges */
    static const long long ns[] = {0,       -1,       1,         9,          10,        -10,      11,
                                   99,      -99,      100,       101,        999,       1000,     1009,
                                   9999,    10000,    99999,     100000,     123456789, 1700000000123,
                                   LLONG_MIN, LLONG_MAX, LLONG_MIN + 1, LLONG_MAX - 1};
    for (size_t i = 0; i < sizeof(ns) / sizeof(ns[0]); i++) {
        cg_jsonw w;
        cg_jsonw_init(&w, 16, 0);
        cg_jsonw_int(&w, ns[i]);
        size_t n = 0;
        char *buf = cg_jsonw_end(&w, &n);
        char want[32];
        snprintf(want, sizeof(want), "%lld", ns[i]);
        CHECK(buf != NULL);
        if (!buf)
            continue;
        CHECK_STR(buf + 16, want);
        CHECK(n == strlen(want));
        free(buf);
    }
}

/* ---- 5. whole frames ------------------------------------------------------------------ */

/* {"type":"delta","id":<id>,"text":<text>,"seq":<seq>,"usage":<usage>} written at pre with
 * the hint given; returns 1 when it parses back to what was written and is the bytes jansson
 * dumps for the same object. */
static int frame_round_trip(const char *id, size_t id_len, const char *text, size_t text_len,
                            long long seq, json_t *usage, size_t pre, size_t hint)
{
    char *idc = unit_dup_exact(id, id_len), *textc = unit_dup_exact(text, text_len);
    cg_jsonw w;
    cg_jsonw_init(&w, pre, hint);
    CG_JSONW_LIT(&w, "{\"type\":\"delta\",\"id\":");
    cg_jsonw_str(&w, idc, id_len);
    CG_JSONW_LIT(&w, ",\"text\":");
    cg_jsonw_str(&w, textc, text_len);
    CG_JSONW_LIT(&w, ",\"seq\":");
    cg_jsonw_int(&w, seq);
    CG_JSONW_LIT(&w, ",\"usage\":");
    cg_jsonw_json(&w, usage);
    CG_JSONW_LIT(&w, "}");
    size_t len = (size_t)-1;
    char *buf = cg_jsonw_end(&w, &len);
    free(idc);
    free(textc);
    if (!buf || len == (size_t)-1)
        return 0;
    int ok = buf[pre + len] == 0 && strlen(buf + pre) == len;

    json_error_t err;
    json_t *j = json_loads(buf + pre, JSON_ALLOW_NUL, &err);
    json_t *jid = json_object_get(j, "id"), *jtext = json_object_get(j, "text");
    ok = ok && j && json_object_size(j) == 5 &&
         strcmp(json_string_value(json_object_get(j, "type")) ? json_string_value(json_object_get(j, "type")) : "",
                "delta") == 0 &&
         json_is_string(jid) && json_string_length(jid) == id_len &&
         memcmp(json_string_value(jid), id, id_len) == 0 && json_is_string(jtext) &&
         json_string_length(jtext) == text_len && memcmp(json_string_value(jtext), text, text_len) == 0 &&
         json_is_integer(json_object_get(j, "seq")) &&
         json_integer_value(json_object_get(j, "seq")) == seq &&
         json_equal(json_object_get(j, "usage"), usage ? usage : json_null());
    json_decref(j);

    /* the same object, built and dumped by jansson (objects keep their order) */
    json_t *o = json_object();
    json_object_set_new(o, "type", json_string("delta"));
    json_object_set_new(o, "id", json_stringn(id, id_len));
    json_object_set_new(o, "text", json_stringn(text, text_len));
    json_object_set_new(o, "seq", json_integer(seq));
    json_object_set(o, "usage", usage ? usage : json_null());
    char *theirs = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    if (!theirs || strcmp(theirs, buf + pre) != 0) {
        static int shown;
        if (shown++ < 3) {
            fprintf(stderr, "  frame: the writer's frame is not jansson's\n");
            show_hex("text", text, text_len);
            size_t at = 0;
            while (theirs && buf[pre + at] && buf[pre + at] == theirs[at])
                at++;
            at = at > 16 ? at - 16 : 0;
            show_text("writer ", buf + pre, len, at);
            show_text("jansson", theirs, theirs ? strlen(theirs) : 0, at);
        }
        ok = 0;
    }
    free(theirs);
    free(buf);
    return ok;
}

static void test_frames(void)
{
    static const size_t pres[] = {0, 16, 32};
    static const size_t hints[] = {0, 1, 7, 64, 300, 4096};
    json_t *usage = json_pack("{s:i,s:i}", "prompt_tokens", 3, "completion_tokens", 14);
    long wrong = 0, runs = 0;
    char text[4 * 200], id[4 * 12];
    for (int k = 0; k < 3000; k++) {
        size_t id_len = random_text(id, sizeof(id), rnd() % 12);
        size_t text_len = random_text(text, sizeof(text), rnd() % 200);
        size_t pre = pres[k % 3], hint = hints[(k / 3) % 6];
        wrong += !frame_round_trip(id, id_len, text, text_len, (long long)rnd() - 0x7fffffffLL,
                                   k % 4 ? usage : NULL, pre, hint);
        runs++;
    }
    if (wrong)
        fprintf(stderr, "frames: %ld of %ld random frames wrong\n", wrong, runs);
    CHECK(wrong == 0);

    /* big texts from no hint and tiny hints: the buffer grows, the headroom stays */
    enum { BIG = 200 * 1024 };
    char *big = malloc(BIG);
    if (!big)
        abort();
    size_t big_len = random_text(big, BIG, BIG - 8);
    for (size_t p = 0; p < 3; p++)
        for (size_t h = 0; h < 3; h++)
            CHECK(frame_round_trip("c-1", 3, big, big_len, LLONG_MIN, usage, pres[p], hints[h]));
    memset(big, '\x01', BIG); /* six bytes written for each */
    CHECK(frame_round_trip("", 0, big, BIG, LLONG_MAX, NULL, 32, 0));
    free(big);

    /* many small pieces into a buffer from a hint of 0: growth across piece boundaries */
    cg_jsonw w;
    cg_jsonw_init(&w, 32, 0);
    CG_JSONW_LIT(&w, "[");
    for (int i = 0; i < 5000; i++) {
        if (i)
            CG_JSONW_LIT(&w, ",");
        if (i % 3 == 0)
            cg_jsonw_int(&w, i);
        else if (i % 3 == 1)
            cg_jsonw_str(&w, "\"e\xC3\xA9\n", 5);
        else
            cg_jsonw_json(&w, usage);
    }
    CG_JSONW_LIT(&w, "]");
    size_t len = 0;
    char *buf = cg_jsonw_end(&w, &len);
    CHECK(buf != NULL);
    if (buf) {
        CHECK(buf[32 + len] == 0);
        CHECK(strlen(buf + 32) == len);
        json_t *a = json_loads(buf + 32, 0, NULL);
        CHECK(json_array_size(a) == 5000);
        CHECK(json_integer_value(json_array_get(a, 2997)) == 2997);
        CHECK_STR(json_string_value(json_array_get(a, 4999)), "\"e\xC3\xA9\n");
        CHECK(json_equal(json_array_get(a, 5), usage));
        json_decref(a);
        free(buf);
    }
    json_decref(usage);

    /* an empty text: just the headroom and the NUL */
    cg_jsonw_init(&w, 16, 0);
    len = 99;
    buf = cg_jsonw_end(&w, &len);
    CHECK(buf != NULL);
    CHECK(len == 0);
    if (buf)
        CHECK(buf[16] == 0);
    free(buf);
}

/* ---- 6. a failed piece fails the frame ------------------------------------------------ */

static void test_failure_sticks(void)
{
    size_t len = 77;
    cg_jsonw w;

    /* a bad string, then every kind of piece after it, some of them big */
    cg_jsonw_init(&w, 16, 0);
    CG_JSONW_LIT(&w, "{\"text\":");
    cg_jsonw_str(&w, "ok\xC0\x80", 4);
    CG_JSONW_LIT(&w, ",\"more\":");
    cg_jsonw_str(&w, "fine", 4);
    cg_jsonw_str(&w, NULL, 0);
    cg_jsonw_int(&w, LLONG_MIN);
    json_t *o = json_pack("{s:s}", "k", "v");
    cg_jsonw_json(&w, o);
    cg_jsonw_json(&w, NULL);
    char *big = malloc(100000);
    if (!big)
        abort();
    memset(big, 'x', 100000);
    cg_jsonw_raw(&w, big, 100000);
    cg_jsonw_str(&w, big, 100000);
    CG_JSONW_LIT(&w, "}");
    CHECK(cg_jsonw_end(&w, &len) == NULL);

    /* a bad string first, nothing else */
    cg_jsonw_init(&w, 0, 0);
    cg_jsonw_str(&w, "\xFF", 1);
    CHECK(cg_jsonw_end(&w, &len) == NULL);

    /* a bad string after a big good one (the buffer had grown) */
    cg_jsonw_init(&w, 32, 1);
    cg_jsonw_str(&w, big, 100000);
    cg_jsonw_str(&w, "\xED\xA0\x80", 3);
    cg_jsonw_str(&w, big, 100000);
    CHECK(cg_jsonw_end(&w, &len) == NULL);

    /* two bad strings */
    cg_jsonw_init(&w, 0, 0);
    cg_jsonw_str(&w, "\x80", 1);
    cg_jsonw_str(&w, "\xF4\x90\x80\x80", 4);
    CHECK(cg_jsonw_end(&w, &len) == NULL);

    /* a value jansson cannot dump (a string made without the check): jansson fails it too */
    json_t *raw = json_stringn_nocheck("a\xFF" "b", 3);
    json_t *holder = json_pack("{s:O}", "bad", raw);
    char *d = json_dumps(holder, JSON_COMPACT | JSON_ENCODE_ANY);
    CHECK(d == NULL);
    free(d);
    cg_jsonw_init(&w, 16, 0);
    CG_JSONW_LIT(&w, "{\"params\":");
    cg_jsonw_json(&w, holder);
    CG_JSONW_LIT(&w, "}");
    cg_jsonw_str(&w, "fine", 4);
    CHECK(cg_jsonw_end(&w, &len) == NULL);
    cg_jsonw_init(&w, 0, 0);
    cg_jsonw_json(&w, raw);
    cg_jsonw_json(&w, o);
    CHECK(cg_jsonw_end(&w, &len) == NULL);
    json_decref(holder);
    json_decref(raw);

    /* a writer after a failed one is a fresh start */
    cg_jsonw_init(&w, 8, 0);
    cg_jsonw_json(&w, o);
    char *buf = cg_jsonw_end(&w, &len);
    CHECK(buf != NULL);
    if (buf)
        CHECK_STR(buf + 8, "{\"k\":\"v\"}");
    CHECK(len == 9);
    free(buf);
    json_decref(o);
    free(big);
}

/* A random value of jansson's every type, nested up to depth levels, keys and strings from
 * random_text (quotes, controls, multibyte characters), integers at their extremes too. */
static json_t *random_value(int depth)
{
    char text[64];
    int kind = (int)(rnd() % (depth > 0 ? 9 : 7));
    switch (kind) {
    case 0:
        return json_null();
    case 1:
        return json_true();
    case 2:
        return json_false();
    case 3: {
        static const json_int_t edges[] = {0, -1, 1, 9, 10, -10, LLONG_MAX, LLONG_MIN, 1795490983};
        return json_integer(rnd() % 2 ? edges[rnd() % 9] : (json_int_t)(((uint64_t)rnd() << 32) | rnd()));
    }
    case 4:
        return json_real((double)(int32_t)rnd() / (double)(rnd() % 1000 + 1));
    case 5:
    case 6:
        return json_stringn(text, random_text(text, sizeof(text), rnd() % 24));
    case 7: {
        json_t *a = json_array();
        for (int i = (int)(rnd() % 5); i > 0; i--)
            json_array_append_new(a, random_value(depth - 1));
        return a;
    }
    default: {
        json_t *o = json_object();
        for (int i = (int)(rnd() % 5); i > 0; i--) {
            size_t n = random_text(text, sizeof(text) - 1, rnd() % 12);
            text[n] = 0;
            if (strlen(text) == n) /* a key holds no NUL */
                json_object_set_new(o, text, random_value(depth - 1));
        }
        return o;
    }
    }
}

/* cg_jsonw_json walks values itself (jansson's dump only for reals): 20,000 random trees
 * must come out as json_dumps writes them, keys in the order they were set. */
static void test_random_values(void)
{
    int same = 1;
    for (int k = 0; k < 20000; k++) {
        json_t *v = random_value(4);
        size_t n = 0;
        char *mine = writer_json(v, &n), *theirs = json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY);
        if (!mine || !theirs || strcmp(mine, theirs) != 0) {
            if (same)
                fprintf(stderr, "value %d: writer %s\n          jansson %s\n", k, mine ? mine : "(failed)",
                        theirs ? theirs : "(failed)");
            same = 0;
        }
        free(mine);
        free(theirs);
        json_decref(v);
    }
    CHECK(same);
    /* a cycle is refused, as jansson refuses it */
    json_t *a = json_array(), *b = json_array();
    json_array_append(a, b);
    json_array_append(b, a);
    size_t n = 0;
    char *mine = writer_json(a, &n);
    CHECK(mine == NULL);
    free(mine);
    json_array_clear(b);
    json_decref(a);
    json_decref(b);
}

/* A buffer handed back in (cg_jsonw_init_in): kept when it holds the text's headroom and
 * hint, its text written from the headroom on; replaced (and freed: ASan sees a leak
 * otherwise) when too small; NULL is a new one. */
static void test_init_in(void)
{
    cg_jsonw w;
    cg_jsonw_init_in(&w, 16, 100, NULL, 0);
    CHECK(w.buf && w.used == 16 && w.cap >= 117);
    CG_JSONW_LIT(&w, "{\"a\":1}");
    size_t len, cap = w.cap;
    char *buf = cg_jsonw_end(&w, &len);
    CHECK(len == 7 && strcmp(buf + 16, "{\"a\":1}") == 0);
    cg_jsonw_init_in(&w, 16, 50, buf, cap);
    CHECK(w.buf == buf && w.cap == cap && w.used == 16 && !w.failed);
    cg_jsonw_str(&w, "x", 1);
    buf = cg_jsonw_end(&w, &len);
    CHECK(len == 3 && strcmp(buf + 16, "\"x\"") == 0);
    cg_jsonw_init_in(&w, 16, cap * 4, buf, cap); /* too small: a new buffer */
    CHECK(w.buf && w.cap >= 16 + cap * 4 + 1 && w.used == 16);
    free(cg_jsonw_end(&w, &len));
}

/* swar.h's word tests, which the writer's and the flat reader's fast paths rest on: every
 * byte value at every place of a word of other bytes, against a byte-by-byte answer. */
static void test_swar(void)
{
    static const unsigned char fill[] = {'a', ' ', 0x7f, 0x20, 0x00, 0xff};
    int wrong = 0;
    for (size_t f = 0; f < sizeof(fill); f++)
        for (int b = 0; b < 256; b++)
            for (int at = 0; at < 8; at++) {
                unsigned char word[8];
                memset(word, fill[f], 8);
                word[at] = (unsigned char)b;
                uint64_t v = cg_swar_load(word);
                int has_quote = 0, below = 0;
                for (int i = 0; i < 8; i++) {
                    has_quote |= word[i] == '"';
                    below |= word[i] < 0x20;
                }
                wrong += !cg_swar_has(v, '"') != !has_quote;
                wrong += !cg_swar_has_below(v, 0x20) != !below;
            }
    CHECK(wrong == 0);
}

/* cg_json_stringn makes what json_stringn makes: the same string for UTF-8 (NULs inside
 * included), NULL for anything else, on random texts and the invalid ones below. */
static void test_json_stringn(void)
{
    static const char *const bad[] = {"\xff", "a\xc3", "\xc0\xaf", "\xed\xa0\x80", "\xf4\x90\x80\x80", "abcdefgh\x80"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
        CHECK(cg_json_stringn(bad[i], strlen(bad[i])) == NULL && json_stringn(bad[i], strlen(bad[i])) == NULL);
    CHECK(cg_json_string(NULL) == NULL);
    int wrong = 0;
    for (int k = 0; k < 20000; k++) {
        char s[64];
        size_t n = random_text(s, sizeof(s), rnd() % 40);
        if (rnd() % 4 == 0 && n) /* a stray byte somewhere */
            s[rnd() % n] = (char)(0x80 + rnd() % 0x80);
        json_t *a = cg_json_stringn(s, n), *b = json_stringn(s, n);
        wrong += !a != !b || (a && !json_equal(a, b));
        json_decref(a);
        json_decref(b);
    }
    CHECK(wrong == 0);
}

/* cg_jsonw_json_or_null, cg_jsonw_null_if_failed: a value that cannot be written becomes null
 * in its place, and what comes after it is written (a save's state, one JSON value). */
static void test_or_null(void)
{
    size_t len = 0;
    cg_jsonw w;
    cg_jsonw_init(&w, 0, 0);
    json_t *bad = json_stringn_nocheck("ok\xC0\x80", 4), *good = json_pack("{s:i}", "n", 7);
    CG_JSONW_LIT(&w, "{\"a\":");
    cg_jsonw_json_or_null(&w, bad);
    CG_JSONW_LIT(&w, ",\"b\":");
    size_t at = w.used;
    cg_jsonw_str(&w, "\xFF", 1);
    cg_jsonw_null_if_failed(&w, at);
    CG_JSONW_LIT(&w, ",\"c\":");
    cg_jsonw_json_or_null(&w, good);
    CG_JSONW_LIT(&w, "}");
    char *out = cg_jsonw_end(&w, &len);
    CHECK_STR(out, "{\"a\":null,\"b\":null,\"c\":{\"n\":7}}");
    free(out);
    json_decref(bad);
    json_decref(good);
}

int main(void)
{
    test_or_null();
    test_swar();
    test_json_stringn();
    test_init_in();
    test_random_values();
    test_literal_escapes();
    test_each_ascii_byte();
    test_nul_and_edges();
    test_long_strings();
    test_random_strings();
    test_invalid();
    test_null_and_values();
    test_int();
    test_frames();
    test_failure_sticks();
    return unit_done("test_jsonw");
}
