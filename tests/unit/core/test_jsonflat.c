/*
 * test_jsonflat.c: the flat frame reader (jsonflat.h, cg_jsonflat_read) held to jansson, whose
 * json_loadb it stands in for on the hot path. The reader may say 0 to anything (the caller
 * then reads the frame with jansson, as before), but when it says 1 its members must be the
 * ones json_loadb(JSON_REJECT_DUPLICATES) finds in the same text: the same keys, kinds and
 * string bytes (lengths too), in the same order, or a frame would mean one thing to the
 * gateway on the fast path and another on the slow one. So: the frames a turn reads (a
 * client's message, the app's delta and done) and the plain forms (whitespace, true, false,
 * null, every escape but \u, raw 2- to 4-byte characters, empty keys and strings) must be
 * read, with the right values; what is not the plain case (any \u escape, numbers, arrays,
 * nested objects, a key twice, 17 members, text that is not UTF-8, control characters,
 * anything but one object, comments, broken syntax, whitespace jansson does not skip) must not
 * be. Then 150,000 objects from a grammar (plain pieces mixed with the ones that are not) and
 * 100,000 valid frames with bytes deleted, inserted and replaced, with a fixed seed: every
 * read must agree with jansson member by member, every plain object must be read and match
 * what the grammar put in it (so a reader that falls back on everything fails), and a good
 * share of them must be read at all. Every input is an exact-size heap copy, so ASan sees any
 * read past it. A disagreement is shown with its input bytes and what each side said.
 */
#define _GNU_SOURCE /* memmem */
#include <jansson.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "chatgate/core/jsonflat.h"
#include "unit.h"

/* ---- showing a disagreement ----------------------------------------------------------- */

static void show_hex(const char *label, const char *s, size_t n)
{
    fprintf(stderr, "    %s (%zu bytes):", label, n);
    for (size_t i = 0; i < n && i < 160; i++)
        fprintf(stderr, " %02x", (unsigned char)s[i]);
    fprintf(stderr, "%s\n", n > 160 ? " ..." : "");
}

/* Text (up to 160 bytes), printable ASCII as it is, other bytes as \xNN. */
static void show_text(const char *label, const char *s, size_t n)
{
    fprintf(stderr, "    %s: \"", label);
    for (size_t i = 0; i < n && i < 160; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c >= 0x20 && c < 0x7f && c != '"' && c != '\\')
            fputc(c, stderr);
        else
            fprintf(stderr, "\\x%02x", c);
    }
    fprintf(stderr, "\"%s\n", n > 160 ? "..." : "");
}

static const char *kind_name(cg_jsonflat_kind k)
{
    return k == CG_JSONFLAT_STRING ? "string"
           : k == CG_JSONFLAT_NULL ? "null"
           : k == CG_JSONFLAT_TRUE ? "true"
           : k == CG_JSONFLAT_FALSE ? "false"
                                    : "?";
}

static void show_reader(const cg_jsonflat *f)
{
    fprintf(stderr, "    reader: 1, %zu members\n", f->n);
    for (size_t i = 0; i < f->n && i < CG_JSONFLAT_MAX; i++) {
        const cg_jsonflat_member *m = &f->m[i];
        fprintf(stderr, "      [%zu] %s", i, kind_name(m->kind));
        show_text("key", m->key, m->key_len);
        if (m->kind == CG_JSONFLAT_STRING)
            show_text("      value", m->str, m->len);
    }
}

/* A group of inputs: how many, how many read, how many disagreed (the first few shown). */
typedef struct {
    const char *name;
    long runs, read, wrong;
    long plain, plain_missed, model_wrong; /* grammar inputs that are the plain case */
} tally;

static void report(tally *t, const char *in, size_t len, const cg_jsonflat *f, const char *why)
{
    if (t->wrong++ >= 3)
        return;
    fprintf(stderr, "  %s: the reader read a frame jansson reads otherwise: %s\n", t->name, why);
    show_hex("input", in, len);
    show_text("input", in, len);
    show_reader(f);
}

/* ---- the two sides -------------------------------------------------------------------- */

static int same_bytes(const char *a, size_t an, const char *b, size_t bn)
{
    return an == bn && (an == 0 || memcmp(a, b, an) == 0);
}

/* Whether jansson reads in[0..len) as an object with exactly f's members, in f's order;
 * why says how not. */
static int jansson_agrees(const cg_jsonflat *f, const char *in, size_t len, char *why, size_t why_n)
{
    json_error_t err;
    json_t *j = json_loadb(in, len, JSON_REJECT_DUPLICATES, &err);
    if (!j) {
        snprintf(why, why_n, "jansson refuses it (%s, line %d column %d)", err.text, err.line,
                 err.column);
        return 0;
    }
    int ok = 0;
    if (!json_is_object(j)) {
        snprintf(why, why_n, "jansson reads something other than an object");
        goto out;
    }
    if (json_object_size(j) != f->n) {
        snprintf(why, why_n, "jansson finds %zu members, the reader %zu", json_object_size(j), f->n);
        goto out;
    }
    void *it = json_object_iter(j);
    for (size_t i = 0; i < f->n; i++, it = json_object_iter_next(j, it)) {
        const cg_jsonflat_member *m = &f->m[i];
        if (!it) {
            snprintf(why, why_n, "jansson's members end at %zu", i);
            goto out;
        }
        const char *key = json_object_iter_key(it);
        size_t key_len = json_object_iter_key_len(it);
        if (!same_bytes(key, key_len, m->key, m->key_len)) {
            snprintf(why, why_n, "member %zu: jansson's key is \"%.*s\" (%zu bytes)", i,
                     (int)key_len, key, key_len);
            goto out;
        }
        json_t *v = json_object_iter_value(it);
        int kind_ok = m->kind == CG_JSONFLAT_STRING ? json_is_string(v)
                      : m->kind == CG_JSONFLAT_NULL  ? json_is_null(v)
                      : m->kind == CG_JSONFLAT_TRUE  ? json_is_true(v)
                      : m->kind == CG_JSONFLAT_FALSE ? json_is_false(v)
                                                     : 0;
        if (!kind_ok) {
            snprintf(why, why_n, "member %zu: jansson's value is of type %d, the reader's %s", i,
                     (int)json_typeof(v), kind_name(m->kind));
            goto out;
        }
        if (m->kind == CG_JSONFLAT_STRING &&
            !same_bytes(json_string_value(v), json_string_length(v), m->str, m->len)) {
            snprintf(why, why_n, "member %zu: jansson's value is \"%.*s\" (%zu bytes)", i,
                     (int)json_string_length(v), json_string_value(v), json_string_length(v));
            goto out;
        }
    }
    if (it) {
        snprintf(why, why_n, "jansson has members after the reader's %zu", f->n);
        goto out;
    }
    ok = 1;
out:
    json_decref(j);
    return ok;
}

/* Reads in[0..len) (an exact-size copy of it) and, when the reader says 1, holds it to
 * jansson. Returns what the reader said. */
static int check_read(tally *t, const char *in, size_t len)
{
    char *copy = unit_dup_exact(in, len);
    cg_jsonflat f;
    int r = cg_jsonflat_read(&f, copy, len);
    t->runs++;
    if (r) {
        t->read++;
        char why[512];
        int bad = f.n > CG_JSONFLAT_MAX;
        if (bad)
            snprintf(why, sizeof(why), "%zu members", f.n);
        else if (!jansson_agrees(&f, copy, len, why, sizeof(why)))
            bad = 1;
        if (bad)
            report(t, copy, len, &f, why);
    }
    cg_jsonflat_free(&f);
    free(copy);
    return r;
}

static void done(tally *t)
{
    if (t->wrong)
        fprintf(stderr, "%s: %ld of %ld reads disagree with jansson\n", t->name, t->wrong, t->read);
    CHECK(t->runs > 0);
    CHECK(t->wrong == 0);
}

/* ---- 1. fixed frames that must be read ------------------------------------------------ */

typedef struct {
    const char *key;
    cg_jsonflat_kind kind;
    const char *str; /* for a string; its length is str_len, or strlen when that is 0 */
    size_t str_len;
} want_member;

/* Reads the frame, which must be read with exactly the members want[0..n), checked both by
 * position and through cg_jsonflat_get, and agree with jansson. */
static void must_read(tally *t, const char *in, size_t len, const want_member *want, size_t n)
{
    char *copy = unit_dup_exact(in, len);
    cg_jsonflat f;
    int r = cg_jsonflat_read(&f, copy, len);
    t->runs++;
    CHECK(r == 1);
    if (r != 1) {
        fprintf(stderr, "  %s: not read:\n", t->name);
        show_text("input", in, len);
    }
    if (r == 1) {
        t->read++;
        char why[512];
        if (!jansson_agrees(&f, copy, len, why, sizeof(why)))
            report(t, copy, len, &f, why);
        CHECK(f.n == n);
        for (size_t i = 0; i < n && i < f.n; i++) {
            const cg_jsonflat_member *m = &f.m[i];
            size_t want_len = want[i].str ? (want[i].str_len ? want[i].str_len : strlen(want[i].str)) : 0;
            CHECK(same_bytes(m->key, m->key_len, want[i].key, strlen(want[i].key)));
            CHECK(m->kind == want[i].kind);
            if (want[i].kind == CG_JSONFLAT_STRING) {
                CHECK(m->len == want_len);
                CHECK(same_bytes(m->str, m->len, want[i].str, want_len));
            }
            CHECK(cg_jsonflat_get(&f, want[i].key) == m);
        }
        CHECK(cg_jsonflat_get(&f, "no such key") == NULL);
    }
    cg_jsonflat_free(&f);
    free(copy);
}

#define L(lit) lit, sizeof(lit) - 1
#define N(arr) (sizeof(arr) / sizeof(arr[0]))
#define STR(k, v) {k, CG_JSONFLAT_STRING, v, 0}

static void test_read(void)
{
    tally t = {.name = "frames that must be read"};

    static const want_member client[] = {
        STR("type", "message"), STR("id", "m1"), STR("room", "bench"),
        STR("text", "Find flights from Nairobi to London on Feb 10"),
    };
    must_read(&t,
              L("{\"type\":\"message\",\"id\":\"m1\",\"room\":\"bench\",\"text\":\"Find flights "
                "from Nairobi to London on Feb 10\"}"),
              client, N(client));

    static const want_member delta[] = {STR("type", "delta"), STR("id", "x"), STR("text", "hi")};
    must_read(&t, L("{\"type\":\"delta\",\"id\":\"x\",\"text\":\"hi\"}"), delta, N(delta));
    static const want_member done_[] = {STR("type", "done"), STR("id", "x")};
    must_read(&t, L("{\"type\":\"done\",\"id\":\"x\"}"), done_, N(done_));

    must_read(&t, L("{}"), NULL, 0);
    must_read(&t, L(" \t\r\n{ \t\r\n} \t\r\n"), NULL, 0);

    /* whitespace around every token: JSON's four characters only */
    static const want_member ws[] = {STR("a", "b"), STR("c", "d")};
    must_read(&t, L(" {\n\t\"a\" :\r\n \"b\"\t,\r\"c\"\n:\t\"d\" \n}\r\n"), ws, N(ws));

    static const want_member lits[] = {
        {"t", CG_JSONFLAT_TRUE, NULL, 0}, {"f", CG_JSONFLAT_FALSE, NULL, 0},
        {"n", CG_JSONFLAT_NULL, NULL, 0}, STR("s", "null"),
    };
    must_read(&t, L("{\"t\":true,\"f\":false,\"n\":null,\"s\":\"null\"}"), lits, N(lits));

    /* every escape but \u, decoded (into the reader's own copy), in values and in keys */
    static const want_member esc[] = {
        STR("q", "a\"b"), STR("bs", "a\\b"), STR("sl", "a/b"), STR("nl", "a\nb"),
        STR("tab", "a\tb"), STR("cr", "a\rb"), STR("bsp", "a\bb"), STR("ff", "a\fb"),
        STR("all", "\"\\/\n\t\r\b\f"), STR("k\"e\\y/\n", "v"), STR("end", "\\"),
    };
    must_read(&t,
              L("{\"q\":\"a\\\"b\",\"bs\":\"a\\\\b\",\"sl\":\"a\\/b\",\"nl\":\"a\\nb\","
                "\"tab\":\"a\\tb\",\"cr\":\"a\\rb\",\"bsp\":\"a\\bb\",\"ff\":\"a\\fb\","
                "\"all\":\"\\\"\\\\\\/\\n\\t\\r\\b\\f\",\"k\\\"e\\\\y\\/\\n\":\"v\",\"end\":\"\\\\\"}"),
              esc, N(esc));

    /* raw UTF-8 kept as it is, keys too */
    static const want_member utf[] = {
        STR("e", "caf\xC3\xA9"), STR("emoji", "\xF0\x9F\x98\x80!"), STR("\xC3\xA9t\xC3\xA9", "\xE2\x82\xAC"),
        STR("edges", "\xC2\x80\xDF\xBF\xE0\xA0\x80\xED\x9F\xBF\xEE\x80\x80\xEF\xBF\xBF\xF0\x90\x80\x80\xF4\x8F\xBF\xBF"),
        STR("esc+utf", "\xC3\xA9\n\xF0\x9F\x98\x80"),
    };
    must_read(&t,
              L("{\"e\":\"caf\xC3\xA9\",\"emoji\":\"\xF0\x9F\x98\x80!\",\"\xC3\xA9t\xC3\xA9\":\"\xE2\x82\xAC\","
                "\"edges\":\"\xC2\x80\xDF\xBF\xE0\xA0\x80\xED\x9F\xBF\xEE\x80\x80\xEF\xBF\xBF\xF0\x90\x80\x80\xF4\x8F\xBF\xBF\","
                "\"esc+utf\":\"\xC3\xA9\\n\xF0\x9F\x98\x80\"}"),
              utf, N(utf));

    /* the empty key and the empty string */
    static const want_member empty[] = {STR("", ""), STR("x", "")};
    must_read(&t, L("{\"\":\"\",\"x\":\"\"}"), empty, N(empty));

    /* 16 members, the most; keys that differ only after an escape */
    static const want_member sixteen[] = {
        STR("a", "1"), STR("b", "2"), STR("c", "3"), STR("d", "4"), STR("e", "5"), STR("f", "6"),
        STR("g", "7"), STR("h", "8"), STR("i", "9"), STR("j", "10"), STR("k", "11"), STR("l", "12"),
        STR("m", "13"), STR("n", "14"), STR("o", "15"), STR("p", "16"),
    };
    must_read(&t,
              L("{\"a\":\"1\",\"b\":\"2\",\"c\":\"3\",\"d\":\"4\",\"e\":\"5\",\"f\":\"6\",\"g\":\"7\","
                "\"h\":\"8\",\"i\":\"9\",\"j\":\"10\",\"k\":\"11\",\"l\":\"12\",\"m\":\"13\","
                "\"n\":\"14\",\"o\":\"15\",\"p\":\"16\"}"),
              sixteen, N(sixteen));
    static const want_member near[] = {STR("a/", "x"), STR("a\\", "y"), STR("a", "z")};
    must_read(&t, L("{\"a\\/\":\"x\",\"a\\\\\":\"y\",\"a\":\"z\"}"), near, N(near));

    /* a long value with escapes through it: the reader's copy holds all of it */
    enum { LONG = 8192 };
    char *in = malloc(LONG * 2 + 32), *dec = malloc(LONG + 1);
    if (!in || !dec)
        abort();
    size_t n = 0;
    memcpy(in, "{\"long\":\"", 9);
    n = 9;
    for (size_t i = 0; i < LONG; i++) {
        dec[i] = i % 7 == 0 ? '\n' : (char)('a' + i % 26);
        if (dec[i] == '\n')
            in[n++] = '\\', in[n++] = 'n';
        else
            in[n++] = dec[i];
    }
    memcpy(in + n, "\"}", 2);
    n += 2;
    const want_member longv[] = {{"long", CG_JSONFLAT_STRING, dec, LONG}};
    must_read(&t, in, n, longv, 1);
    free(in);
    free(dec);

    CHECK(t.read == t.runs);
    done(&t);
}

/* ---- 2. fixed frames that must not be read -------------------------------------------- */

static void test_not_read(void)
{
    static const struct {
        const char *s;
        size_t n;
    } cases[] = {
        /* any \u escape: jansson's and yajl's readings of them differ, or NUL */
        {L("{\"a\":\"\\u00e9\"}")}, {L("{\"a\":\"\\u0000\"}")}, {L("{\"a\":\"\\ud800\"}")},
        {L("{\"a\":\"\\udc00x\"}")}, {L("{\"a\":\"\\ud83d\\ude00\"}")}, {L("{\"\\u0061\":\"b\"}")},
        {L("{\"a\":\"b\",\"\\u0061\":\"c\"}")}, {L("{\"a\":\"\\u0041\"}")},
        /* numbers, arrays, nested objects */
        {L("{\"a\":1}")}, {L("{\"a\":-0}")}, {L("{\"a\":1e999}")}, {L("{\"a\":99999999999999999999}")},
        {L("{\"a\":0.5}")}, {L("{\"a\":\"b\",\"n\":2}")}, {L("{\"a\":{}}")}, {L("{\"a\":{\"b\":\"c\"}}")},
        {L("{\"a\":[]}")}, {L("{\"a\":[\"b\"]}")}, {L("{\"a\":\"b\",\"c\":[1,2]}")},
        /* not an object */
        {L("[]")}, {L("[{}]")}, {L("[\"a\",\"b\"]")}, {L("\"a\"")}, {L("1")}, {L("null")},
        {L("true")}, {L("false")},
        /* a key twice, also as different text */
        {L("{\"a\":\"b\",\"a\":\"c\"}")}, {L("{\"a\":\"b\",\"a\":null}")}, {L("{\"/\":\"b\",\"\\/\":\"c\"}")},
        {L("{\"\":\"\",\"\":\"\"}")},
        /* 17 members */
        {L("{\"a\":\"1\",\"b\":\"2\",\"c\":\"3\",\"d\":\"4\",\"e\":\"5\",\"f\":\"6\",\"g\":\"7\","
           "\"h\":\"8\",\"i\":\"9\",\"j\":\"10\",\"k\":\"11\",\"l\":\"12\",\"m\":\"13\","
           "\"n\":\"14\",\"o\":\"15\",\"p\":\"16\",\"q\":\"17\"}")},
        /* text that is not UTF-8, in a value, in a key, outside strings */
        {L("{\"a\":\"\x80\"}")}, {L("{\"a\":\"\xC0\x80\"}")}, {L("{\"a\":\"\xED\xA0\x80\"}")},
        {L("{\"a\":\"\xF5\x80\x80\x80\"}")}, {L("{\"a\":\"\xE2\x82\"}")}, {L("{\"a\":\"\xF0\x9F\x98\"}")},
        {L("{\"a\":\"\xE0\x80\x80\"}")}, {L("{\"a\":\"\xF4\x90\x80\x80\"}")}, {L("{\"a\":\"\xFF\"}")},
        {L("{\"\x80\":\"b\"}")}, {L("{\"a\":\"b\"}\x80")}, {L("\xEF\xBB\xBF{}")},
        /* control characters, raw */
        {L("{\"a\":\"\x01\"}")}, {L("{\"a\":\"\x1f\"}")}, {L("{\"a\":\"x\ny\"}")},
        {L("{\"a\":\"x\ty\"}")}, {"{\"a\":\"\0\"}", 8}, {"{\"\0\":\"b\"}", 8}, {"{}\0", 3},
        /* whitespace jansson does not skip (yajl does: \f and \v) */
        {L("{\f}")}, {L("{\v}")}, {L("{}\f")}, {L("\v{}")}, {L("{\"a\":\"b\"\f}")},
        {L("{\"a\"\v:\"b\"}")}, {L("{\"a\":\f\"b\"}")}, {L("{\xC2\xA0}")},
        /* anything after the object, or a second object */
        {L("{} x")}, {L("{}{}")}, {L("{} {}")}, {L("{}}")}, {L("{},")}, {L("{}\"\"")}, {L("{}1")},
        /* ... a string begun after it and not ended (yajl waits for its end) */
        {L("{}\"")}, {L("{} \"abc")}, {L("{\"a\":\"b\"}\n\"x y")}, {L("{}\"}")},
        /* comments */
        {L("/*x*/{}")}, {L("{}/*x*/")}, {L("{/*x*/}")}, {L("{} // x")}, {L("// x\n{}")},
        /* broken syntax */
        {L("{\"a\" \"b\"}")}, {L("{\"a\":\"b\" \"c\":\"d\"}")}, {L("{\"a\":\"b}")}, {L("{\"a\":\"b")},
        {L("{\"a\":\"b\"")}, {L("{\"a\":")}, {L("{\"a\"")}, {L("{\"a")}, {L("{")}, {L("}")},
        {L("")}, {L(" ")}, {L("{'a':'b'}")}, {L("{\"a\":'b'}")}, {L("{\"a\":\"b\",}")}, {L("{,}")},
        {L("{,\"a\":\"b\"}")}, {L("{\"a\":\"b\",,\"c\":\"d\"}")}, {L("{a:\"b\"}")}, {L("{\"a\"::\"b\"}")},
        {L("{\"a\":}")}, {L("{\"a\":True}")}, {L("{\"a\":nul}")}, {L("{\"a\":nulll}")},
        {L("{\"a\":\"\\x\"}")}, {L("{\"a\":\"\\'\"}")}, {L("{\"a\":\"\\\"}")}, {L("{\"a\":\"\\u\"}")},
        {L("{\"a\":\"\\v\"}")}, {L("{\"a\":\"\\0\"}")}, {L("{\"a\":undefined}")}, {L("{\"a\"=\"b\"}")},
    };
    tally t = {.name = "frames that must not be read"};
    for (size_t i = 0; i < N(cases); i++) {
        if (check_read(&t, cases[i].s, cases[i].n) != 0) {
            CHECK(!"read a frame that is not the plain case");
            fprintf(stderr, "  not the plain case, but read:\n");
            show_hex("input", cases[i].s, cases[i].n);
            show_text("input", cases[i].s, cases[i].n);
        }
    }
    done(&t);
}

/* ---- 3. random frames, deterministic -------------------------------------------------- */

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;

static uint32_t rnd(void)
{
    return unit_rand(&rng_state);
}

/* per thousand */
static int chance(unsigned p)
{
    return rnd() % 1000 < p;
}

typedef struct {
    const char *raw, *dec; /* as JSON string text, and what it decodes to */
    size_t raw_n, dec_n;
} piece;

#define S(raw, dec) {raw, dec, sizeof(raw) - 1, sizeof(dec) - 1}
#define X(raw) {raw, "", sizeof(raw) - 1, 0}

/* String text of the plain case: ASCII, structural characters, every escape but \u, raw
 * characters at the edges of their ranges. */
static const piece plain_pieces[] = {
    S("a", "a"), S("Z", "Z"), S("hello", "hello"), S("type", "type"), S("id", "id"),
    S("text", "text"), S(" ", " "), S("0", "0"), S("u", "u"), S("{", "{"), S("}", "}"),
    S("[", "["), S("]", "]"), S(":", ":"), S(",", ","), S("/", "/"), S("*", "*"), S("'", "'"),
    S("~", "~"), S("\x7f", "\x7f"), S("null", "null"),
    S("\\\"", "\""), S("\\\\", "\\"), S("\\/", "/"), S("\\n", "\n"), S("\\t", "\t"),
    S("\\r", "\r"), S("\\b", "\b"), S("\\f", "\f"),
    S("\xC2\x80", "\xC2\x80"), S("\xC3\xA9", "\xC3\xA9"), S("\xDF\xBF", "\xDF\xBF"),
    S("\xE0\xA0\x80", "\xE0\xA0\x80"), S("\xE2\x82\xAC", "\xE2\x82\xAC"),
    S("\xE2\x80\xA8", "\xE2\x80\xA8"), S("\xED\x9F\xBF", "\xED\x9F\xBF"),
    S("\xEE\x80\x80", "\xEE\x80\x80"), S("\xEF\xBB\xBF", "\xEF\xBB\xBF"),
    S("\xEF\xBF\xBF", "\xEF\xBF\xBF"), S("\xF0\x90\x80\x80", "\xF0\x90\x80\x80"),
    S("\xF0\x9F\x98\x80", "\xF0\x9F\x98\x80"), S("\xF4\x8F\xBF\xBF", "\xF4\x8F\xBF\xBF"),
};

/* String text that is not: \u escapes, bytes that are not UTF-8, raw control characters,
 * escapes JSON does not have, a quote or backslash that breaks the string. */
static const piece dirty_pieces[] = {
    X("\\u00e9"), X("\\u0000"), X("\\ud800"), X("\\udc00"), X("\\ud83d\\ude00"), X("\\u0041"),
    X("\\u002F"), X("\\u"), X("\\u12"),
    X("\x80"), X("\xBF"), X("\xC0\x80"), X("\xC1\xBF"), X("\xED\xA0\x80"), X("\xED\xBF\xBF"),
    X("\xE0\x80\x80"), X("\xF0\x80\x80\x80"), X("\xF4\x90\x80\x80"), X("\xF5\x80\x80\x80"),
    X("\xE2\x82"), X("\xF0\x9F\x98"), X("\xC3"), X("\xFE"), X("\xFF"),
    X("\x01"), X("\x1f"), X("\n"), X("\t"), X("\r"), {"\0", "", 1, 0},
    X("\\x"), X("\\'"), X("\\v"), X("\\0"), X("\\a"), X("\""), X("\\"),
};

/* Values that are not the plain case (numbers, arrays, objects) or not JSON. */
static const char *const dirty_values[] = {
    "1", "-0", "0", "0.5", "-1", "1e999", "1E-5", "99999999999999999999", "01", "+1", ".5", "1.",
    "[]", "[\"a\"]", "[1,2]", "[[]]", "{}", "{\"a\":\"b\"}", "{\"a\":{}}", "True", "nul", "nulll",
    "undefined", "NaN", "'a'", "\"a\" \"b\"", "tru", "falsey",
};

/* Whitespace JSON has, and what only yajl (or nobody) skips. */
static const char *const plain_ws[] = {"", "", "", "", " ", "\n", "\t", "\r", "\r\n", " \t \n"};
static const piece dirty_ws[] = {
    X("\f"), X("\v"), X(" \f "), X("\n\v"), {"\0", "", 1, 0}, X("\xC2\xA0"), X("/*x*/"), X("//x\n"),
};

typedef struct {
    size_t key_at, key_len, val_at, val_len;
    cg_jsonflat_kind kind;
} model_member;

/* A generated object: its text, and what the grammar put into it. */
typedef struct {
    char text[16384];
    size_t n;
    char dec[16384]; /* decoded keys and values */
    size_t dn;
    model_member m[24];
    size_t nm;
    int dirty; /* something not the plain case went in (it may still have come out plain) */
} gen;

static void put(gen *g, const char *s, size_t n)
{
    if (g->n + n > sizeof(g->text))
        abort(); /* the grammar's sizes keep it well under */
    memcpy(g->text + g->n, s, n);
    g->n += n;
}

static void put_dec(gen *g, const char *s, size_t n)
{
    if (g->dn + n > sizeof(g->dec))
        abort();
    memcpy(g->dec + g->dn, s, n);
    g->dn += n;
}

/* Whitespace, of the kind JSON has unless the dirty rate p picks one it does not. */
static void ws(gen *g, unsigned p)
{
    if (chance(p)) {
        const piece *w = &dirty_ws[rnd() % N(dirty_ws)];
        put(g, w->raw, w->raw_n);
        g->dirty = 1;
    } else {
        const char *w = plain_ws[rnd() % N(plain_ws)];
        put(g, w, strlen(w));
    }
}

/* A string of up to max pieces, quoted; its decoded bytes appended to dec. */
static void string(gen *g, size_t max, unsigned p, size_t *at, size_t *len)
{
    size_t pieces = rnd() % (max + 1);
    *at = g->dn;
    put(g, "\"", 1);
    for (size_t i = 0; i < pieces; i++) {
        const piece *s;
        if (chance(p)) {
            s = &dirty_pieces[rnd() % N(dirty_pieces)];
            g->dirty = 1;
        } else {
            s = &plain_pieces[rnd() % N(plain_pieces)];
        }
        put(g, s->raw, s->raw_n);
        put_dec(g, s->dec, s->dec_n);
    }
    put(g, "\"", 1);
    *len = g->dn - *at;
}

/* An object from the grammar: plain when p is 0, else each choice goes wrong with
 * probability p per thousand. */
static void generate(gen *g, unsigned p)
{
    g->n = g->dn = g->nm = 0;
    g->dirty = 0;
    size_t members = rnd() % 4 == 0 ? rnd() % 17 : rnd() % 6;
    if (p && chance(100))
        members = 15 + rnd() % 6; /* around the most */
    int wrap = p && chance(p / 2);
    if (wrap)
        put(g, "[", 1), g->dirty = 1;
    if (p && chance(p / 4))
        put(g, "\xEF\xBB\xBF", 3), g->dirty = 1; /* a BOM */
    ws(g, p);
    put(g, "{", 1);
    for (size_t i = 0; i < members; i++) {
        ws(g, p);
        model_member *m = &g->m[g->nm++];
        if (p && i > 0 && chance(p)) { /* a key again, as the same text */
            const model_member *old = &g->m[rnd() % i];
            m->key_at = g->dn;
            put_dec(g, g->dec + old->key_at, old->key_len);
            m->key_len = old->key_len;
            put(g, "\"", 1);
            /* written again from its decoded bytes (escaping what must be): the same key to
             * both readers; is_plain finds it twice and only the jansson check applies */
            for (size_t k = 0; k < old->key_len; k++) {
                char c = g->dec[old->key_at + k];
                if (c == '"' || c == '\\')
                    put(g, "\\", 1);
                if (c == '\n')
                    put(g, "\\n", 2);
                else if (c == '\t')
                    put(g, "\\t", 2);
                else if (c == '\r')
                    put(g, "\\r", 2);
                else if (c == '\b')
                    put(g, "\\b", 2);
                else if (c == '\f')
                    put(g, "\\f", 2);
                else
                    put(g, &c, 1);
            }
            put(g, "\"", 1);
        } else if (p && chance(p / 2)) { /* a key that is not a string */
            put(g, "a", 1);
            m->key_at = g->dn, m->key_len = 0;
            g->dirty = 1;
        } else {
            string(g, rnd() % 8 == 0 ? 0 : 3, p, &m->key_at, &m->key_len);
        }
        ws(g, p);
        if (!(p && chance(p / 2)))
            put(g, ":", 1);
        else
            g->dirty = 1;
        ws(g, p);
        unsigned v = rnd() % 100;
        m->val_at = g->dn, m->val_len = 0;
        if (p && chance(p)) {
            const char *d = dirty_values[rnd() % N(dirty_values)];
            put(g, d, strlen(d));
            g->dirty = 1;
        } else if (v < 80) {
            m->kind = CG_JSONFLAT_STRING;
            string(g, rnd() % 4 == 0 ? 24 : 6, p, &m->val_at, &m->val_len);
        } else if (v < 87) {
            m->kind = CG_JSONFLAT_TRUE;
            put(g, "true", 4);
        } else if (v < 94) {
            m->kind = CG_JSONFLAT_FALSE;
            put(g, "false", 5);
        } else {
            m->kind = CG_JSONFLAT_NULL;
            put(g, "null", 4);
        }
        ws(g, p);
        if (i + 1 < members) {
            if (!(p && chance(p / 2)))
                put(g, ",", 1);
            else
                g->dirty = 1;
        } else if (p && chance(p / 2)) {
            put(g, ",", 1); /* a trailing comma */
            g->dirty = 1;
        }
    }
    if (!(p && chance(p / 4)))
        put(g, "}", 1);
    else
        g->dirty = 1;
    ws(g, p);
    if (wrap)
        put(g, "]", 1);
    if (p && chance(p / 2)) { /* something after it */
        static const char *const after[] = {"x", "{}", "1", "\"\"", ",", "}", "null", "[]",
                                            "\"", "\"abc", " \"x"};
        const char *a = after[rnd() % N(after)];
        put(g, a, strlen(a));
        g->dirty = 1;
    }
}

/* Whether the generated object is the plain case: nothing dirty went in, at most 16 members,
 * no key twice. Text with the bytes \u in it (as in "\\u") may be left to jansson too: the
 * reader looks for them as bytes, not as escapes. */
static int is_plain(const gen *g)
{
    if (g->dirty || g->nm > CG_JSONFLAT_MAX || memmem(g->text, g->n, "\\u", 2))
        return 0;
    for (size_t i = 0; i < g->nm; i++)
        for (size_t j = 0; j < i; j++)
            if (same_bytes(g->dec + g->m[i].key_at, g->m[i].key_len, g->dec + g->m[j].key_at,
                           g->m[j].key_len))
                return 0;
    return 1;
}

/* Reads a plain object, which must be read with the members the grammar put in it. */
static void read_model(tally *t, const gen *g)
{
    char *copy = unit_dup_exact(g->text, g->n);
    cg_jsonflat f;
    int r = cg_jsonflat_read(&f, copy, g->n);
    t->runs++;
    t->plain++;
    if (!r) {
        if (t->plain_missed++ < 3) {
            fprintf(stderr, "  %s: a plain object not read\n", t->name);
            show_hex("input", copy, g->n);
            show_text("input", copy, g->n);
        }
    } else {
        t->read++;
        char why[512];
        if (!jansson_agrees(&f, copy, g->n, why, sizeof(why)))
            report(t, copy, g->n, &f, why);
        int same = f.n == g->nm;
        for (size_t i = 0; same && i < f.n; i++) {
            const cg_jsonflat_member *m = &f.m[i];
            const model_member *w = &g->m[i];
            same = same_bytes(m->key, m->key_len, g->dec + w->key_at, w->key_len) &&
                   m->kind == w->kind &&
                   (m->kind != CG_JSONFLAT_STRING ||
                    same_bytes(m->str, m->len, g->dec + w->val_at, w->val_len));
        }
        if (!same && t->model_wrong++ < 3) {
            fprintf(stderr, "  %s: read, but not the members the grammar put in\n", t->name);
            show_hex("input", copy, g->n);
            show_reader(&f);
        }
    }
    cg_jsonflat_free(&f);
    free(copy);
}

static void test_grammar(void)
{
    enum { RUNS = 150000 };
    tally t = {.name = "grammar objects"};
    static gen g;
    long dirty_runs = 0, dirty_read = 0;
    for (int k = 0; k < RUNS; k++) {
        /* half of them plain by construction, the rest going wrong at 0.5% to 8% a choice */
        static const unsigned rates[] = {0, 0, 0, 0, 5, 20, 40, 80};
        generate(&g, rates[rnd() % N(rates)]);
        if (is_plain(&g)) {
            read_model(&t, &g);
        } else {
            dirty_runs++;
            dirty_read += check_read(&t, g.text, g.n);
        }
    }
    printf("grammar: %ld objects, %ld read; %ld plain (%ld not read, %ld misread); "
           "%ld not plain, %ld of them read\n",
           t.runs, t.read, t.plain, t.plain_missed, t.model_wrong, dirty_runs, dirty_read);
    CHECK(t.runs == RUNS);
    CHECK(t.plain > RUNS / 3);    /* the grammar does make plain objects */
    CHECK(dirty_runs > RUNS / 10); /* and others */
    CHECK(t.read * 5 > t.runs);   /* > 20% read: not passing by reading nothing */
    CHECK(t.plain_missed == 0);   /* no fallback on the plain case */
    CHECK(t.model_wrong == 0);
    done(&t);
}

/* ---- 4. valid frames with bytes deleted, inserted and replaced ------------------------ */

/* Bytes that change what a frame means: syntax, escapes, digits, whitespace of both kinds,
 * control characters, bytes that start or break UTF-8. */
static const unsigned char mut_bytes[] = {
    '{', '}', '[', ']', ':', ',', '"', '\\', 'u', '/', '*', '0', '1', '-', 'e', '.', 't', 'f',
    'n', 'a', ' ', '\t', '\n', '\r', '\f', '\v', 0x00, 0x01, 0x1f, 0x7f, 0x80, 0xbf, 0xc0,
    0xc2, 0xc3, 0xa9, 0xe2, 0xed, 0xa0, 0xef, 0xf0, 0x9f, 0xf4, 0xf5, 0xff,
};

static unsigned char mut_byte(void)
{
    return rnd() % 4 == 0 ? (unsigned char)rnd() : mut_bytes[rnd() % sizeof(mut_bytes)];
}

static void test_mutated(void)
{
    enum { RUNS = 100000 };
    static const char *const frames[] = {
        ("{\"type\":\"message\",\"id\":\"m1\",\"room\":\"bench\",\"text\":\"Find flights from "
         "Nairobi to London on Feb 10\"}"), /* one frame, on two lines */
        "{\"type\":\"delta\",\"id\":\"x\",\"text\":\"hi\"}",
        "{\"type\":\"done\",\"id\":\"x\"}",
        "{ \"a\" : \"b\\n\\\"c\\\"\" , \"t\" : true , \"f\" : false , \"n\" : null }",
        "{\"e\":\"caf\xC3\xA9 \xF0\x9F\x98\x80\",\"\":\"\"}",
    };
    tally t = {.name = "mutated frames"};
    static gen g;
    char buf[16384 + 16];
    for (int k = 0; k < RUNS; k++) {
        size_t n;
        if (rnd() % 2) {
            const char *fr = frames[rnd() % N(frames)];
            n = strlen(fr);
            memcpy(buf, fr, n);
        } else {
            do
                generate(&g, 0);
            while (g.n > sizeof(buf) - 16);
            memcpy(buf, g.text, g.n);
            n = g.n;
        }
        size_t edits = 1 + rnd() % 3;
        for (size_t e = 0; e < edits; e++)
            unit_mutate(&rng_state, buf, &n, sizeof(buf), (char)mut_byte());
        check_read(&t, buf, n);
    }
    printf("mutated: %ld frames, %ld read\n", t.runs, t.read);
    CHECK(t.runs == RUNS);
    CHECK(t.read > 0);
    done(&t);
}

/* ---- the reader's own state ----------------------------------------------------------- */

static void test_reuse(void)
{
    /* one cg_jsonflat for frame after frame, read or not, escapes or not: each read starts
     * afresh (ASan's leak check sees a copy not freed) */
    tally t = {.name = "one reader, many frames"};
    cg_jsonflat f;
    static const char *const seq[] = {
        "{\"a\":\"x\\ny\"}", "{\"a\":1}", "{\"b\":\"\\\"\"}", "[]", "{\"c\":\"plain\"}",
        "{\"d\":\"\\t\",\"e\":{}}", "{}",
    };
    static const int want[] = {1, 0, 1, 0, 1, 0, 1};
    for (int round = 0; round < 3; round++)
        for (size_t i = 0; i < N(seq); i++) {
            size_t len = strlen(seq[i]);
            char *copy = unit_dup_exact(seq[i], len);
            int r = cg_jsonflat_read(&f, copy, len);
            t.runs++;
            CHECK(r == want[i]);
            if (r) {
                char why[512];
                t.read++;
                if (!jansson_agrees(&f, copy, len, why, sizeof(why)))
                    report(&t, copy, len, &f, why);
            }
            cg_jsonflat_free(&f);
            cg_jsonflat_free(&f); /* twice is harmless */
            free(copy);
        }
    done(&t);
}

int main(void)
{
    test_read();
    test_not_read();
    test_grammar();
    test_mutated();
    test_reuse();
    return unit_done("unit_jsonflat");
}
