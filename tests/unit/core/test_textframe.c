/*
 * test_textframe.c: the frame around a streamed reply's text (core/textframe.h). A frame is
 * kept only around a text that is the buffer's own bytes between two quotes; a buffer matches
 * only when it is the same two runs around a text that needs no decoding (no quote, backslash
 * or control byte; valid UTF-8), so no other JSON can pass for a delta of the kept shape.
 * Every input is an exact-size heap copy, so ASan sees a read past it.
 */
#include <stdlib.h>
#include <string.h>

#include "chatgate/core/textframe.h"
#include "unit.h"

#define A "{\"type\":\"delta\",\"id\":\"m1\",\"text\":\""
#define B "\"}"

/* Matches s against fr: 1 with *got the text (a copy, NUL-terminated), else 0. */
static int match(const cg_textframe *fr, const char *s, char *got, size_t cap)
{
    size_t n = strlen(s);
    char *copy = unit_dup_exact(s, n);
    const char *t;
    size_t t_len;
    int ok = cg_textframe_match(fr, copy, n, &t, &t_len);
    if (ok) {
        CHECK(t >= copy && t + t_len <= copy + n);
        size_t k = t_len < cap - 1 ? t_len : cap - 1;
        memcpy(got, t, k);
        got[k] = 0;
    }
    free(copy);
    return ok;
}

/* Keeps the frame of s around its text at [at, at + len). */
static void keep(cg_textframe *fr, const char *s, size_t at, size_t len)
{
    cg_textframe_keep(fr, s, strlen(s), s + at, len);
}

static void test_keep_and_match(void)
{
    cg_textframe fr = {0};
    char got[128];
    CHECK(!match(&fr, A "x" B, got, sizeof(got))); /* none kept yet */
    static const char first[] = A "Hello" B;
    keep(&fr, first, sizeof(A) - 1, 5);
    CHECK(fr.before == sizeof(A) - 1 && fr.after == sizeof(B) - 1);
    CHECK(match(&fr, A " world" B, got, sizeof(got)) && strcmp(got, " world") == 0);
    CHECK(match(&fr, A B, got, sizeof(got)) && strcmp(got, "") == 0);
    CHECK(match(&fr, A "caf\xC3\xA9 \xF0\x9F\x98\x80 \x7f" B, got, sizeof(got)) &&
          strcmp(got, "caf\xC3\xA9 \xF0\x9F\x98\x80 \x7f") == 0);
    CHECK(match(&fr, A "a long text of more than eight bytes, in words" B, got, sizeof(got)));
    /* text that would need decoding, or would make other JSON: not the frame's */
    CHECK(!match(&fr, A "a\\nb" B, got, sizeof(got)));
    CHECK(!match(&fr, A "a\"b" B, got, sizeof(got)));
    CHECK(!match(&fr, A "\",\"type\":\"done" B, got, sizeof(got)));
    CHECK(!match(&fr, A "tab\there" B, got, sizeof(got)));
    CHECK(!match(&fr, A "12345678\x01" B, got, sizeof(got)));
    CHECK(!match(&fr, A "\xC3" B, got, sizeof(got)));               /* cut short */
    CHECK(!match(&fr, A "\xC0\xAF" B, got, sizeof(got)));           /* overlong */
    CHECK(!match(&fr, A "\xED\xA0\x80" B, got, sizeof(got)));       /* a surrogate */
    CHECK(!match(&fr, A "\xF4\x90\x80\x80" B, got, sizeof(got)));   /* past U+10FFFF */
    /* other runs around it */
    CHECK(!match(&fr, "{\"type\":\"delta\",\"id\":\"m2\",\"text\":\"x" B, got, sizeof(got)));
    CHECK(!match(&fr, A "x\"} ", got, sizeof(got)));
    CHECK(!match(&fr, A "x\"}}", got, sizeof(got)));
    CHECK(!match(&fr, A, got, sizeof(got)));                        /* shorter than the frame */
    CHECK(!match(&fr, "", got, sizeof(got)));
}

static void test_not_kept(void)
{
    cg_textframe fr = {0};
    char got[64];
    keep(&fr, A "Hello" B, sizeof(A) - 1, 5);
    CHECK(fr.before);
    /* a text not between two quotes forgets the frame kept before */
    static const char unquoted[] = "{\"type\":\"delta\",\"text\":null}";
    keep(&fr, unquoted, 10, 4);
    CHECK(!fr.before && !match(&fr, A "x" B, got, sizeof(got)));
    /* a text at either end of the buffer: no quote around it */
    static const char bare[] = "Hello";
    keep(&fr, bare, 0, 5);
    CHECK(!fr.before);
    /* a frame over CG_TEXTFRAME_MAX is not kept */
    char big[CG_TEXTFRAME_MAX + 64];
    memset(big, 'a', sizeof(big) - 1);
    big[sizeof(big) - 1] = 0;
    big[10] = '"';
    big[13] = '"';
    keep(&fr, big, 11, 2);
    CHECK(!fr.before);
}

int main(void)
{
    test_keep_and_match();
    test_not_kept();
    return unit_done("unit_textframe");
}
