/*
 * test_chunk.c: the streamed chunk reader (upstream/chunk.h, cg_chunk_read) held to jansson,
 * whose json_loadb it stands in for on every delta of an OpenAI-compatible reply. The reader
 * may say 0 to anything (openai.c then reads the chunk with jansson, as before), but when it
 * says 1 its content and finish must be what openai.c's jansson path takes from the same text
 * (chunk_ref.h), or a delta would mean one thing on the fast path and another on the slow.
 * So: the chunks real servers send (OpenAI's, vLLM's, llama.cpp's, Ollama's shapes) must be
 * read with the right values; what is not the plain case must not be; and 200,000 real
 * chunks with bytes deleted, inserted and replaced, with a fixed seed, must agree with
 * jansson whenever read. Every input is an exact-size heap copy, so ASan sees a read past it.
 * The reply's head (chunk.h): the chunks of one reply after the first are read from the end
 * of the head it kept, and must still agree with jansson, mutated too; a chunk that is the
 * head and a "}" (invalid: the head ends in a comma) must not be read as "{}".
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chunk_ref.h"
#include "unit.h"

#define L(s) s, sizeof(s) - 1
#define N(a) (sizeof(a) / sizeof((a)[0]))

static void show(const char *what, const char *s, size_t n)
{
    fprintf(stderr, "  %s: \"", what);
    for (size_t i = 0; i < n && i < 200; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c >= 0x20 && c < 0x7f)
            fputc(c, stderr);
        else
            fprintf(stderr, "\\x%02x", c);
    }
    fprintf(stderr, "\"\n");
}

/* Reads s[0..n) both ways, the reader with head (NULL: none); 1 when the reader said 1
 * (and then checks it agreed). */
static int read_both(const char *s, size_t n, cg_chunk_head *head, cg_chunk *k, int *agreed)
{
    char *copy = unit_dup_exact(s, n);
    chunk_ref r;
    chunk_ref_read(&r, copy, n);
    int plain = cg_chunk_read(k, head, copy, n);
    *agreed = !plain || chunk_ref_agrees(k, &r);
    if (!*agreed)
        show("the reader and jansson disagree on", s, n);
    cg_chunk_free(k);
    chunk_ref_free(&r);
    free(copy);
    return plain;
}

/* ---- 1. what servers send: read, with the right values -------------------------------- */

typedef struct {
    const char *s;
    size_t n;
    const char *content; /* NULL: no delta */
    int finished;
} plain_case;

static void test_plain(void)
{
    static const plain_case cases[] = {
        /* OpenAI: the role, text, the finish, then usage null or absent */
        {L("{\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1700000000,\"model\":\"gpt-4o\","
           "\"system_fingerprint\":\"fp_1\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},"
           "\"logprobs\":null,\"finish_reason\":null}],\"usage\":null}"),
         NULL, 0},
        {L("{\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"created\":1700000000,\"model\":\"m\",\"choices\":[{\"index\":0,"
           "\"delta\":{\"content\":\"Hello\"},\"logprobs\":null,\"finish_reason\":null}]}"),
         "Hello", 0},
        {L("{\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}"), NULL, 1},
        {L("{\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"length\"}],\"usage\":null}"), NULL, 1},
        {L("{\"choices\":[],\"usage\":null}"), NULL, 0},
        {L("{}"), NULL, 0},
        /* escapes and raw UTF-8 in the text */
        {L("{\"choices\":[{\"delta\":{\"content\":\"a\\nb\\\"c\\\\d\\/e\\tf\"}}]}"), "a\nb\"c\\d/e\tf", 0},
        {L("{\"choices\":[{\"delta\":{\"content\":\"caf\xC3\xA9 \xF0\x9F\x98\x80\"}}]}"), "caf\xC3\xA9 \xF0\x9F\x98\x80", 0},
        /* vLLM: logprobs, a float, a stop_reason */
        {L("{\"id\":\"cmpl-1\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\" world\"},\"logprobs\":{\"content\":[{\"token\":"
           "\" world\",\"logprob\":-0.0312,\"bytes\":[32,119]}]},\"finish_reason\":null,\"stop_reason\":null}]}"),
         " world", 0},
        /* tool_calls null (some servers send it with every delta) */
        {L("{\"choices\":[{\"delta\":{\"content\":\"x\",\"tool_calls\":null},\"finish_reason\":null}]}"), "x", 0},
        /* the content in the second choice is not the first's */
        {L("{\"choices\":[{\"delta\":{\"content\":\"one\"}},{\"delta\":{\"content\":\"two\"}}]}"), "one", 0},
        /* the members in another order, whitespace around them, a null content */
        {L(" \n{ \"choices\" : [ { \"finish_reason\" : null , \"delta\" : { \"content\" : \"x\" } } ] , \"created\" : -12 }\r\n"),
         "x", 0},
        {L("{\"choices\":[{\"delta\":{\"content\":null},\"finish_reason\":\"stop\"}]}"), NULL, 1},
        /* finish_reason of another type is still a finish, as for jansson */
        {L("{\"choices\":[{\"finish_reason\":true}]}"), NULL, 1},
        {L("{\"choices\":[{\"finish_reason\":{\"type\":\"stop\"}}]}"), NULL, 1},
        /* keys that matter only at their place */
        {L("{\"model\":{\"content\":\"no\",\"choices\":[1]},\"choices\":[{\"delta\":{\"content\":\"yes\"}}]}"), "yes", 0},
        {L("{\"x\":[{\"error\":1}],\"choices\":[{\"delta\":{\"x\":{\"content\":\"no\"}}}]}"), NULL, 0},
        /* numbers jansson reads */
        {L("{\"a\":123456789012345678,\"b\":-0.5,\"c\":0,\"d\":12345678901234567890.5,\"choices\":[]}"), NULL, 0},
    };
    for (size_t i = 0; i < N(cases); i++) {
        cg_chunk k;
        int agreed;
        char *copy = unit_dup_exact(cases[i].s, cases[i].n);
        int plain = cg_chunk_read(&k, NULL, copy, cases[i].n);
        CHECK(plain);
        if (plain) {
            size_t want = cases[i].content ? strlen(cases[i].content) : 0;
            CHECK(k.content_len == want && (!want || memcmp(k.content, cases[i].content, want) == 0));
            CHECK(k.finished == cases[i].finished);
        }
        if (!plain)
            show("not read", cases[i].s, cases[i].n);
        cg_chunk_free(&k);
        free(copy);
        CHECK(read_both(cases[i].s, cases[i].n, NULL, &k, &agreed) && agreed);
    }
}

/* ---- 2. what is not the plain case: left to jansson ----------------------------------- */

static void test_not_plain(void)
{
    static const struct {
        const char *s;
        size_t n;
    } cases[] = {
        {L("{\"choices\":[{\"delta\":{\"content\":\"\\u00e9\"}}]}")},
        {L("{\"choices\":[{\"delta\":{\"content\":\"\\u0000\"}}]}")},
        {L("{\"error\":{\"message\":\"overloaded\"}}")},
        {L("{\"choices\":[],\"error\":null}")},
        {L("{\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":7,\"total_tokens\":12}}")},
        {L("{\"choices\":[],\"usage\":1}")},
        {L("{\"choices\":[],\"choices\":[{\"delta\":{\"content\":\"b\"}}]}")},
        {L("{\"choices\":[{\"delta\":{\"content\":\"a\",\"content\":\"b\"}}]}")},
        {L("{\"choices\":[{\"delta\":{},\"delta\":{\"content\":\"b\"}}]}")},
        {L("{\"choices\":[{\"finish_reason\":null,\"finish_reason\":\"stop\"}]}")},
        {L("{\"a\":1e5,\"choices\":[]}")},
        {L("{\"a\":1E400,\"choices\":[]}")},
        {L("{\"a\":1234567890123456789,\"choices\":[]}")},
        {L("{\"a\":0.12345678901234567890123,\"choices\":[]}")},
        {L("[{\"choices\":[]}]")},
        {L("\"x\"")},
        {L("null")},
        {L("{\"choices\":[]} x")},
        {L("{\"choices\":[]}{}")},
        {L("{\"choices\":[]}\f")},
        {L("{\"choices\":{}}")},
        {L("{\"choices\":null}")},
        {L("{\"choices\":[\"x\"]}")},
        {L("{\"choices\":[{\"delta\":\"x\"}]}")},
        {L("{\"choices\":[{\"delta\":{\"content\":5}}]}")},
        /* a tool call: the state function's arguments are read by jansson (openai.c) */
        {L("{\"choices\":[{\"delta\":{\"tool_calls\":[{\"index\":0,\"id\":\"call_1\",\"function\":{\"name\":\"f\","
           "\"arguments\":\"{\\\"a\\\":1}\"}}]},\"finish_reason\":null}]}")},
        {L("{\"choices\":[{\"delta\":{\"tool_calls\":{}}}]}")},
        {L("{\"choices\":[{\"delta\":{\"content\":[\"x\"]}}]}")},
        {L("{\"a\":[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]],\"choices\":[]}")},
        {L("{\"choices\":[{\"delta\":{\"content\":\"\xC3\"}}]}")},
        {L("{\"choices\":[{\"delta\":{\"content\":\"\xED\xA0\x80\"}}]}")},
        {L("{\"choices\":[{\"delta\":{\"content\":\"a\x01\"}}]}")},
        {L("{\"choices\":[{\"delta\":{\"content\":\"a\"}}]")},
        {L("")},
        {L("{/*x*/\"choices\":[]}")},
    };
    for (size_t i = 0; i < N(cases); i++) {
        cg_chunk k;
        int agreed;
        int plain = read_both(cases[i].s, cases[i].n, NULL, &k, &agreed);
        CHECK(!plain);
        if (plain)
            show("read, but not the plain case", cases[i].s, cases[i].n);
    }
}

/* ---- 3. real chunks mutated, deterministic --------------------------------------------- */

static void test_mutated(void)
{
    static const char *const seeds[] = {
        "{\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"created\":1700000000,\"model\":\"m\",\"choices\":[{\"index\":0,"
        "\"delta\":{\"content\":\"Hello there, caf\xC3\xA9\"},\"finish_reason\":null}]}",
        "{\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"created\":1700000000,\"model\":\"m\",\"choices\":[{\"index\":0,"
        "\"delta\":{\"content\":\"He said \\\"hi\\\"\\n\"},\"logprobs\":null,\"finish_reason\":null}],\"usage\":null}",
        "{\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}",
        "{\"choices\":[{\"delta\":{\"content\":\"caf\xC3\xA9\"},\"logprobs\":{\"x\":[-0.5,1,true,false,null]}}]}",
        "{\"choices\":[{\"delta\":{\"content\":\"a\"}},{\"delta\":{\"content\":\"b\"}}],\"error\":null}",
    };
    static const char alphabet[] = "{}[]\":,\\ 0123456789.-eEtrufalsn\xC3\xA9\x01\f";
    uint64_t state = 0x5DEECE66Dull;
    unsigned reads = 0, runs = 200000, disagreements = 0, from_head = 0, in_frame = 0;
    char buf[512];
    for (unsigned i = 0; i < runs; i++) {
        const char *seed = seeds[i % N(seeds)];
        size_t n = strlen(seed);
        cg_chunk k;
        int agreed;
        /* every other run: the seed read first, its head kept, as the reply's first chunk */
        cg_chunk_head head = {0};
        int with_head = (i / N(seeds)) % 2;
        if (with_head) {
            read_both(seed, n, &head, &k, &agreed); /* the fourth is not plain ("error") */
            CHECK(agreed);
            from_head += head.len > 0;
        }
        memcpy(buf, seed, n);
        for (unsigned m = 1 + unit_rand(&state) % 3; m > 0; m--)
            unit_mutate(&state, buf, &n, sizeof(buf), alphabet[unit_rand(&state) % (sizeof(alphabet) - 1)]);
        int plain = read_both(buf, n, with_head ? &head : NULL, &k, &agreed);
        reads += plain;
        in_frame += plain && k.path == CG_CHUNK_IN_FRAME;
        disagreements += !agreed;
    }
    CHECK(disagreements == 0);
    CHECK(from_head == 2 * (runs / N(seeds) / 2)); /* the first two seeds' heads, each time */
    CHECK(in_frame > runs / 400); /* mutations of the first seed's text */
    /* a reader that leaves everything to jansson would agree too: most mutations keep a
     * chunk plain (a byte inside a string or a number), so a good share must be read */
    fprintf(stderr, "test_chunk: %u of %u mutated chunks read (%u in a frame), %u disagreements\n", reads, runs,
            in_frame, disagreements);
    CHECK(reads > runs / 5);
}

/* ---- 4. the reply's head and frame ------------------------------------------------------ */

#define HEAD "{\"id\":\"chatcmpl-9\",\"object\":\"chat.completion.chunk\",\"created\":1700000000,\"model\":\"m\","
#define FRAME_A HEAD "\"choices\":[{\"index\":0,\"delta\":{\"content\":\""
#define FRAME_B "\"},\"finish_reason\":null}]}"

static void test_head(void)
{
    cg_chunk_head head = {0};
    cg_chunk k;
    int agreed;
    static const char first[] = FRAME_A "one" FRAME_B;
    CHECK(read_both(L(first), &head, &k, &agreed) && agreed);
    CHECK(head.len == sizeof(HEAD) - 1 && memcmp(head.bytes, HEAD, head.len) == 0);
    CHECK(head.frame.before == sizeof(FRAME_A) - 1 && head.frame.after == sizeof(FRAME_B) - 1);
    /* read one after the other, each with what the ones before left */
    static const struct {
        const char *s;
        size_t n;
        const char *content; /* NULL: no delta */
        int plain, finished, path;
    } next[] = {
        {L(FRAME_A "two" FRAME_B), "two", 1, 0, CG_CHUNK_IN_FRAME},
        {L(FRAME_A "caf\xC3\xA9, \x7f ok" FRAME_B), "caf\xC3\xA9, \x7f ok", 1, 0, CG_CHUNK_IN_FRAME},
        {L(FRAME_A FRAME_B), NULL, 1, 0, CG_CHUNK_IN_FRAME},
        /* text the frame cannot take as it stands: the head, or the whole chunk, reads it */
        {L(FRAME_A "a\\nb" FRAME_B), "a\nb", 1, 0, CG_CHUNK_AFTER_HEAD},
        {L(FRAME_A "a\"b" FRAME_B), NULL, 0, 0, CG_CHUNK_AFTER_HEAD},
        {L(FRAME_A "a\x01" FRAME_B), NULL, 0, 0, CG_CHUNK_AFTER_HEAD},
        {L(FRAME_A "a\xC3" FRAME_B), NULL, 0, 0, CG_CHUNK_AFTER_HEAD},
        {L(FRAME_A "a" FRAME_B " x"), NULL, 0, 0, CG_CHUNK_AFTER_HEAD},
        {L(FRAME_A "a" FRAME_B "\n"), "a", 1, 0, CG_CHUNK_AFTER_HEAD},
        {L(HEAD "\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}"), NULL, 1, 1, CG_CHUNK_AFTER_HEAD},
        /* the frame of "a" and a newline, from the chunk before last */
        {L(FRAME_A "three" FRAME_B "\n"), "three", 1, 0, CG_CHUNK_IN_FRAME},
        /* text with quotes that would make other members: not the frame's */
        {L(FRAME_A "\",\"x\":\"" FRAME_B), NULL, 1, 0, CG_CHUNK_AFTER_HEAD},
        /* after the head: any member, the keys that matter as ever */
        {L(HEAD "\"x\":[1,{\"choices\":2}],\"choices\":[{\"delta\":{\"content\":\"four\"}}]}"), "four", 1, 0,
         CG_CHUNK_AFTER_HEAD},
        {L(HEAD "\"choices\":[],\"choices\":[{\"delta\":{\"content\":\"b\"}}]}"), NULL, 0, 0, CG_CHUNK_AFTER_HEAD},
        {L(HEAD "\"error\":{\"message\":\"overloaded\"}}"), NULL, 0, 0, CG_CHUNK_AFTER_HEAD},
        {L(HEAD "\"choices\":[],\"usage\":{\"prompt_tokens\":5}}"), NULL, 0, 0, CG_CHUNK_AFTER_HEAD},
        /* the head then "}": invalid (a comma before it), not "{}" */
        {L(HEAD "}"), NULL, 0, 0, CG_CHUNK_WHOLE},
        {L(HEAD " }"), NULL, 0, 0, CG_CHUNK_WHOLE},
        {L(HEAD "\"choices\":[]"), NULL, 0, 0, CG_CHUNK_AFTER_HEAD},
        {L(HEAD "\"choices\":[]} x"), NULL, 0, 0, CG_CHUNK_AFTER_HEAD},
        /* another head: read whole, and kept */
        {L("{\"id\":\"chatcmpl-10\",\"choices\":[{\"delta\":{\"content\":\"five\"}}]}"), "five", 1, 0, CG_CHUNK_WHOLE},
    };
    for (size_t i = 0; i < N(next); i++) {
        cg_chunk_head was = head;
        int plain = read_both(next[i].s, next[i].n, &head, &k, &agreed);
        CHECK(agreed && plain == next[i].plain);
        char *copy = unit_dup_exact(next[i].s, next[i].n);
        int again = cg_chunk_read(&k, &was, copy, next[i].n);
        CHECK(again == plain && k.path == next[i].path);
        if (again) {
            size_t want = next[i].content ? strlen(next[i].content) : 0;
            CHECK(k.content_len == want && (!want || memcmp(k.content, next[i].content, want) == 0));
            CHECK(k.finished == next[i].finished);
        }
        cg_chunk_free(&k);
        free(copy);
        if (!agreed || plain != next[i].plain || again != plain || k.path != next[i].path)
            show("the head's case", next[i].s, next[i].n);
    }
    CHECK(head.len == strlen("{\"id\":\"chatcmpl-10\","));
}

int main(void)
{
    test_plain();
    test_head();
    test_not_plain();
    test_mutated();
    return unit_done("unit_chunk");
}
