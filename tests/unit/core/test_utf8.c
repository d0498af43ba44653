/*
 * test_utf8.c: cutting text on a character boundary (utf8.h). cg_utf8_boundary(text, len)
 * is the largest n <= len such that text[0..n) does not end inside a UTF-8 sequence: ASCII
 * is cut anywhere, a 2-, 3- or 4-byte sequence cut at any of its inner offsets is dropped
 * whole, and a cut of valid text is valid UTF-8 (jansson takes it). Bytes that start no
 * valid sequence must not make it read outside text[0..len) or cut more than a sequence.
 * Every text is copied into a buffer of exactly len bytes, so ASan sees any read past it.
 */
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "chatgate/core/utf8.h"
#include "unit.h"

/* cg_utf8_boundary on an exact-size heap copy of text[0..len). */
static size_t cut(const char *text, size_t len)
{
    char *copy = malloc(len ? len : 1);
    if (!copy)
        abort();
    memcpy(copy, text, len);
    size_t n = cg_utf8_boundary(copy, len);
    free(copy);
    return n;
}

static size_t encode(unsigned cp, char *out)
{
    unsigned char *o = (unsigned char *)out;
    if (cp < 0x80) {
        o[0] = (unsigned char)cp;
        return 1;
    }
    if (cp < 0x800) {
        o[0] = (unsigned char)(0xC0 | cp >> 6);
        o[1] = (unsigned char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        o[0] = (unsigned char)(0xE0 | cp >> 12);
        o[1] = (unsigned char)(0x80 | (cp >> 6 & 0x3F));
        o[2] = (unsigned char)(0x80 | (cp & 0x3F));
        return 3;
    }
    o[0] = (unsigned char)(0xF0 | cp >> 18);
    o[1] = (unsigned char)(0x80 | (cp >> 12 & 0x3F));
    o[2] = (unsigned char)(0x80 | (cp >> 6 & 0x3F));
    o[3] = (unsigned char)(0x80 | (cp & 0x3F));
    return 4;
}

static void test_ascii(void)
{
    const char *s = "hello, world";
    int wrong = 0;
    for (size_t len = 0; len <= strlen(s); len++)
        wrong += cut(s, len) != len;
    CHECK(wrong == 0);
    CHECK(cut("", 0) == 0);
    CHECK(cut("\x7f", 1) == 1); /* DEL is the last one-byte character */
}

/* Every offset into "a" + one sequence of each length + "b". */
static void test_each_length(void)
{
    /* é U+00E9 (2), € U+20AC (3), 😀 U+1F600 (4) */
    const char *seqs[] = {"\xC3\xA9", "\xE2\x82\xAC", "\xF0\x9F\x98\x80"};
    for (int i = 0; i < 3; i++) {
        char buf[8];
        size_t n = strlen(seqs[i]);
        buf[0] = 'a';
        memcpy(buf + 1, seqs[i], n);
        buf[1 + n] = 'b';
        CHECK(cut(buf, 0) == 0);
        CHECK(cut(buf, 1) == 1);
        for (size_t k = 1; k < n; k++) /* inside the sequence: back to before its lead */
            CHECK(cut(buf, 1 + k) == 1);
        CHECK(cut(buf, 1 + n) == 1 + n); /* the whole sequence */
        CHECK(cut(buf, 2 + n) == 2 + n);
        /* the sequence alone, at the start of the text */
        for (size_t k = 1; k < n; k++)
            CHECK(cut(seqs[i], k) == 0);
        CHECK(cut(seqs[i], n) == n);
    }
}

/* Every code point (but the surrogates), after a 4-byte character, cut at every offset:
 * the cut keeps whole characters only, and the longest run of them. */
static void test_every_code_point(void)
{
    unsigned wrong = 0, first_bad = 0;
    char buf[8] = "\xF0\x9F\x98\x80"; /* 😀: a sequence right before, so a miscount shows */
    for (unsigned cp = 0; cp <= 0x10FFFF; cp++) {
        if (cp >= 0xD800 && cp <= 0xDFFF)
            continue;
        size_t n = encode(cp, buf + 4);
        for (size_t k = 0; k <= n; k++) {
            size_t want = k == n ? 4 + n : 4;
            if (cut(buf, 4 + k) != want && !wrong++)
                first_bad = cp;
        }
    }
    if (wrong)
        fprintf(stderr, "every code point: %u wrong cuts, the first at U+%04X\n", wrong, first_bad);
    CHECK(wrong == 0);
}

/* A cut of valid text at every offset is valid UTF-8: jansson, which refuses anything
 * else, takes it; and it is the longest prefix jansson takes. */
static void test_valid_for_jansson(void)
{
    const char *s = "Zürich → 東京 😀 ok ∑é";
    size_t len = strlen(s);
    int refused = 0, short_cut = 0;
    for (size_t k = 0; k <= len; k++) {
        size_t n = cut(s, k);
        json_t *j = json_stringn(s, n);
        refused += !j;
        json_decref(j);
        /* nothing longer up to k would have done */
        for (size_t m = n + 1; m <= k; m++) {
            json_t *longer = json_stringn(s, m);
            short_cut += longer != NULL;
            json_decref(longer);
        }
    }
    CHECK(refused == 0);
    CHECK(short_cut == 0);
}

/* Bytes that start no valid sequence. The rule is read off the bytes, not the meaning:
 * continuation bytes (10xxxxxx) belong to the lead before them, at most three back; a lead
 * is judged by its high bits (0xC0/0xC1 like a two-byte lead, 0xF5..0xFF like a four-byte
 * one). So it never cuts more than three bytes, never reads before the text, and keeps what
 * is not an unfinished sequence. */
static void test_invalid(void)
{
    /* stray continuation bytes with no lead: nothing unfinished, nothing cut */
    CHECK(cut("\x80", 1) == 1);
    CHECK(cut("\x80\xBF\x80", 3) == 3);
    CHECK(cut("\xBF\xBF\xBF\xBF\xBF", 5) == 5);
    CHECK(cut("a\x80", 2) == 2);
    CHECK(cut("ab\x80\x80\x80", 5) == 5);
    /* a run of continuation bytes longer than any sequence after a lead: the lead is too far
     * back to be theirs, nothing is cut */
    CHECK(cut("\xE2\x82\xAC\x80", 4) == 4);
    CHECK(cut("\xF0\x9F\x98\x80\x80\x80", 6) == 6);
    /* a lead cut short and followed by ASCII: the sequence is already broken, nothing cut */
    CHECK(cut("\xE2" "a", 2) == 2);
    CHECK(cut("\xF0\x9F" "a", 3) == 3);
    /* 0xC0 and 0xC1 (overlong two-byte leads) are two-byte leads */
    CHECK(cut("a\xC0", 2) == 1);
    CHECK(cut("a\xC0\x80", 3) == 3);
    CHECK(cut("a\xC1\xBF", 3) == 3);
    /* 0xF5..0xFF (past U+10FFFF, or no sequence at all) are four-byte leads */
    CHECK(cut("a\xFF", 2) == 1);
    CHECK(cut("a\xF8\x80\x80", 4) == 1);
    CHECK(cut("a\xF5\x80\x80\x80", 5) == 5);
    CHECK(cut("\xFE", 1) == 0);
    /* every byte value at the end of "ab" and in every position of a 4-byte window: never
     * more than three bytes cut, never more than len */
    int wrong = 0;
    for (unsigned b = 0; b < 256; b++) {
        char t[3] = {'a', 'b', (char)b};
        size_t n = cut(t, 3);
        wrong += n > 3 || n < 2;
        for (unsigned c = 0; c < 256; c += 5) {
            char u[4] = {(char)b, (char)c, (char)(b ^ c), (char)(0x80 | c)};
            for (size_t len = 0; len <= 4; len++) {
                size_t m = cut(u, len);
                wrong += m > len || len - m > 3;
            }
        }
    }
    CHECK(wrong == 0);
}

/* cg_utf8_valid agrees with jansson on what is UTF-8: valid text, and every invalid form */
static void test_valid(void)
{
    static const char *const good[] = {"", "abc", "a\xc3\xa9", "\xe2\x82\xac", "\xf0\x9f\x91\x8d x", "\xf4\x8f\xbf\xbf"};
    static const char *const bad[] = {"\x80", "a\xc3", "\xc0\x80", "\xe0\x80\x80", "\xed\xa0\x80",
                                      "\xf0\x80\x80\x80", "\xf4\x90\x80\x80", "\xf5\x80\x80\x80", "ok\xff"};
    for (size_t i = 0; i < sizeof(good) / sizeof(good[0]); i++) {
        CHECK(cg_utf8_valid(good[i], strlen(good[i])));
        json_t *j = json_stringn(good[i], strlen(good[i]));
        CHECK(j != NULL);
        json_decref(j);
    }
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        CHECK(!cg_utf8_valid(bad[i], strlen(bad[i])));
        CHECK(json_stringn(bad[i], strlen(bad[i])) == NULL);
    }
    CHECK(cg_utf8_valid("a\0b", 3)); /* a NUL is a character */
}

/* The ASCII prefix (eight bytes at a time, then byte by byte): a byte past ASCII at every
 * place of texts of every length up to 40 is where the prefix ends. */
static void test_ascii_prefix(void)
{
    char text[40];
    int wrong = 0;
    for (size_t n = 0; n <= sizeof(text); n++) {
        memset(text, 'a', sizeof(text));
        wrong += cg_utf8_ascii_prefix(text, n) != n;
        for (size_t at = 0; at < n; at++) {
            memset(text, 'a', sizeof(text));
            text[at] = (char)(at % 2 ? 0x80 : 0xff);
            wrong += cg_utf8_ascii_prefix(text, n) != at;
        }
    }
    CHECK(wrong == 0);
}

int main(void)
{
    test_ascii_prefix();
    test_valid();
    test_ascii();
    test_each_length();
    test_every_code_point();
    test_valid_for_jansson();
    test_invalid();
    return unit_done("test_utf8");
}
