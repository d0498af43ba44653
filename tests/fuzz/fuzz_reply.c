/*
 * fuzz_reply.c: libFuzzer target for rules on replies (rules_reply.c) with the shipped card
 * rule and examples/reply-rules/: the input's first bytes pick the window and where the
 * text is cut into deltas; the rest is the reply's text. Besides the sanitizers, it checks
 * the filter's promise: with a window no smaller than the reply, what the client gets does
 * not depend on where the deltas were cut (a match split across them is caught), and a stop
 * ends the output at the same place.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "chatgate/core/log.h"
#include "chatgate/dialog/rules.h"

static cg_ruleset *rules;

static void init(void)
{
    cg_log_set_level(CG_LOG_ERROR);
    char err[1024];
    /* the examples and the shipped card rule, in one set */
    static const char *const files[] = {CG_SOURCE_DIR "/examples/reply-rules/91-contacts.rules",
                                        CG_SOURCE_DIR "/rules/90-replies.rules"};
    char *text = NULL;
    size_t len = 0;
    for (int i = 0; i < 2; i++) {
        FILE *f = fopen(files[i], "rb");
        if (!f)
            abort();
        char buf[65536];
        size_t n = fread(buf, 1, sizeof(buf), f);
        fclose(f);
        text = realloc(text, len + n + 1);
        memcpy(text + len, buf, n);
        len += n;
        text[len++] = '\n';
    }
    if (cg_rules_load_text("reply.rules", text, len, &rules, err, sizeof(err)) < 0) {
        fprintf(stderr, "%s\n", err);
        abort();
    }
    free(text);
}

/* One feed, its output appended to *all (*all_len bytes); 1 when stopped. */
static int feed(cg_reply_filter *f, const char *text, size_t n, int final, char **all, size_t *all_len)
{
    const char *out;
    size_t m;
    int stopped = cg_reply_filter_feed(f, text, n, final, &out, &m);
    *all = realloc(*all, *all_len + m + 1);
    if (m)
        memcpy(*all + *all_len, out, m);
    *all_len += m;
    return stopped;
}

/* The whole reply through a filter, cut after the bytes cuts[] says (at character
 * boundaries); the output and whether it stopped. */
static char *run(const char *text, size_t len, size_t window, const uint8_t *cuts, size_t n_cuts, size_t *out_len,
                 int *stopped)
{
    cg_reply_filter *f = cg_reply_filter_new(rules, window);
    char *all = NULL;
    size_t all_len = 0, at = 0;
    *stopped = 0;
    for (size_t i = 0; at < len && !*stopped; i++) {
        size_t n = i < n_cuts ? (size_t)cuts[i] % 16 + 1 : len - at;
        if (n > len - at)
            n = len - at;
        while (at + n < len && ((unsigned char)text[at + n] & 0xC0) == 0x80)
            n++; /* a delta is whole characters (a JSON string's) */
        *stopped = feed(f, text + at, n, 0, &all, &all_len);
        at += n;
    }
    if (!*stopped)
        *stopped = feed(f, "", 0, 1, &all, &all_len);
    cg_reply_filter_free(f);
    *out_len = all_len;
    return all;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!rules)
        init();
    if (size < 9)
        return 0;
    const uint8_t *cuts = data + 1;
    const char *text = (const char *)data + 9;
    size_t len = size - 9;
    json_t *valid = json_stringn(text, len); /* NULL unless UTF-8 */
    if (!valid || memchr(text, 0, len)) {
        json_decref(valid);
        return 0; /* an upstream's text is a JSON string: UTF-8, and chatgate's deltas hold no NUL */
    }
    json_decref(valid);
    size_t window = data[0] & 1 ? len + 1 : (size_t)data[0] % 64 + 8;
    size_t a_len, b_len;
    int a_stop, b_stop;
    char *a = run(text, len, window, cuts, 8, &a_len, &a_stop);
    char *b = run(text, len, window, cuts, 0, &b_len, &b_stop); /* one delta */
    if (window > len && (a_stop != b_stop || a_len != b_len || memcmp(a, b, a_len) != 0)) {
        fprintf(stderr, "the output depends on where the deltas were cut:\n  cut: %.*s\n  whole: %.*s\n", (int)a_len, a,
                (int)b_len, b);
        abort();
    }
    free(a);
    free(b);
    return 0;
}
