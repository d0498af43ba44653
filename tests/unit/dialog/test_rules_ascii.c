/*
 * test_rules_ascii.c: a rule's ASCII form (rule.re_ascii: its pattern compiled without UTF and
 * UCP, which the rules run on an all-ASCII message instead of the pattern itself) held to the
 * pattern on ASCII subjects. For every rule of the shipped set and of a set written here to
 * stress the edges (\w \b \s \d under UCP, caseless letters, [^...] with characters past
 * ASCII, POSIX classes, lookbehind, named and numbered groups), every subject gives the same
 * answer and the same ovector from both (a reply rule's partial match too, as the reply
 * filter runs it on held text): the subjects are every rule test line that is ASCII,
 * the reference scenarios' messages, and 20,000 generated from the words of the patterns,
 * digits and punctuation with a fixed seed. And the forms are made only where they are safe:
 * a pattern with a character past ASCII outside a class ("don’?t", where without UTF the '?'
 * would apply to one byte), a \Q quote, a comment or extended mode gets none; one whose
 * characters past ASCII are all inside classes gets one. So a rule reads an English message
 * the same through either, and the test fails if the two ever disagree.
 */
#include <stdlib.h>
#include <string.h>

#include "chatgate/dialog/rules.h"
#include "chatgate/dialog/rules_internal.h"
#include "unit.h"

#define OV_MAX 128

static const char *const scenario_messages[] = {
    "Find me flights from Nairobi to London next week", "What about returning on Feb 20?",
    "Show me business class options", "Send 5000 shillings to +254712345678",
    "Send another 3000 to the same person", "What's the weather in Tokyo?", "And tomorrow?", "nevermind",
    "the Shinjuku one", "get the shroom burger", "Find flights from Nairobi to London on Feb 10",
    "cancel my flight to London", "no thanks", "yes please", "Don't miss the ramen!", "it's cozy and quiet",
    "great for kids", "fly business class", "2 passengers", "forget my origin", "my card is 4111 1111 1111 1111",
    "pay 3k bob to 0712345678", "change it to 7000", "make it economy", "the day after tomorrow",
    "on the 3rd of March 2027", "12/04/2026", "2026-02-30", "KELVIN k K s S", "tab\there\nnewline\r\v\f end",
    "dont", "i dont know", "dont miss the ramen", "its cozy", "lets do it", "thats right",
    "card 4111 1111 1111 1111 ok", "card 4111 1111 11", "4111-1111-1111-1111", "x4111111111111111",
};

static uint64_t seed = 88172645463325252ULL;
static unsigned rnd(unsigned n)
{
    return unit_rand(&seed) % n;
}

/* The words of a pattern (runs of letters), as a pool for subjects. */
static size_t words_of(const char *pattern, char pool[][24], size_t n, size_t cap)
{
    for (const char *p = pattern; *p && n < cap;) {
        size_t len = 0;
        while ((p[len] >= 'a' && p[len] <= 'z') || (p[len] >= 'A' && p[len] <= 'Z'))
            len++;
        if (len >= 2 && len < 24) {
            memcpy(pool[n], p, len);
            pool[n++][len] = 0;
        }
        p += len ? len : 1;
    }
    return n;
}

static int compared, matched, disagreed;

/* Both forms of r on subject with options: the same rc and the same ovector (a partial
 * match sets its first pair). */
static void compare_with(const rule *r, const char *subject, uint32_t options, pcre2_match_data *a,
                         pcre2_match_data *b)
{
    size_t len = strlen(subject);
    int ra = pcre2_match(r->re, (PCRE2_SPTR)subject, len, 0, options, a, NULL);
    int rb = pcre2_match(r->re_ascii, (PCRE2_SPTR)subject, len, 0, options, b, NULL);
    int same = ra == rb, pairs = ra == PCRE2_ERROR_PARTIAL ? 1 : ra;
    PCRE2_SIZE *oa = pcre2_get_ovector_pointer(a), *ob = pcre2_get_ovector_pointer(b);
    for (int i = 0; same && pairs > 0 && i < 2 * pairs; i++)
        same = oa[i] == ob[i];
    compared++;
    matched += ra > 0 || ra == PCRE2_ERROR_PARTIAL;
    if (!same && disagreed++ < 10)
        fprintf(stderr, "rule '%s' on \"%s\" (options %x): %d with UTF, %d in its ASCII form\n", r->name, subject,
                (unsigned)options, ra, rb);
    CHECK(same);
}

/* A reply rule is also matched partially, as the reply filter does on held text. */
static void compare(const rule *r, const char *subject, pcre2_match_data *a, pcre2_match_data *b)
{
    compare_with(r, subject, 0, a, b);
    if (r->on_reply)
        compare_with(r, subject, PCRE2_PARTIAL_HARD, a, b);
}

static void check_set(const cg_ruleset *rs, int n_generated)
{
    pcre2_match_data *a = pcre2_match_data_create(OV_MAX, NULL), *b = pcre2_match_data_create(OV_MAX, NULL);
    static char pool[4096][24];
    size_t n_pool = 0;
    for (size_t i = 0; i < rs->n; i++)
        n_pool = words_of(rs->rules[i].pattern, pool, n_pool, 4096);
    static const char *const extra[] = {"1", "12", "2026", "3rd", "+254712345678", "$", ",", ".", "!", "?", "'",
                                        "-", "/", "  ", "\t", "_", "@", "a.b@c.io", "KES", "5k", "Feb", "10"};
    for (size_t i = 0; i < rs->n; i++) {
        const rule *r = &rs->rules[i];
        if (!r->re_ascii)
            continue;
        for (size_t j = 0; j < rs->n; j++) /* every rule on every rule's test lines */
            for (int t = 0; t < rs->rules[j].n_tests; t++) {
                const char *text = rs->rules[j].tests[t].text;
                int ascii = 1;
                for (const char *c = text; *c; c++)
                    ascii &= (unsigned char)*c < 0x80;
                if (ascii)
                    compare(r, text, a, b);
            }
        for (size_t m = 0; m < sizeof(scenario_messages) / sizeof(*scenario_messages); m++)
            compare(r, scenario_messages[m], a, b);
        for (int g = 0; g < n_generated; g++) {
            char subject[256] = "";
            size_t used = 0;
            int words = 1 + (int)rnd(9);
            for (int w = 0; w < words; w++) {
                const char *piece = rnd(4) ? pool[rnd((unsigned)n_pool)] : extra[rnd(sizeof(extra) / sizeof(*extra))];
                size_t plen = strlen(piece);
                if (used + plen + 2 >= sizeof(subject))
                    break;
                if (w && rnd(3))
                    subject[used++] = ' ';
                memcpy(subject + used, piece, plen);
                used += plen;
                if (rnd(8) == 0) /* a letter's case flipped */
                    subject[used - 1] ^= (subject[used - 1] >= 'A' && subject[used - 1] <= 'z') ? 0x20 : 0;
                subject[used] = 0;
            }
            compare(r, subject, a, b);
        }
    }
    pcre2_match_data_free(a);
    pcre2_match_data_free(b);
}

static const rule *find(const cg_ruleset *rs, const char *name)
{
    for (size_t i = 0; i < rs->n; i++)
        if (strcmp(rs->rules[i].name, name) == 0)
            return &rs->rules[i];
    return NULL;
}

int main(void)
{
    char err[512];
    cg_ruleset *shipped = NULL;
    CHECK(cg_rules_load(CG_SOURCE_DIR "/rules", &shipped, err, sizeof(err)) == 0);
    size_t with = 0;
    for (size_t i = 0; shipped && i < shipped->n; i++)
        with += shipped->rules[i].re_ascii != NULL;
    /* the costly travel and payment rules have one (their ’ and € stand in classes), and
     * the reply rule; the confirm rules' emoji stand outside any class */
    CHECK(with >= 20);
    CHECK(find(shipped, "departure_date") && find(shipped, "departure_date")->re_ascii);
    CHECK(find(shipped, "flight_route") && find(shipped, "flight_route")->re_ascii);
    CHECK(find(shipped, "confirm_yes") && !find(shipped, "confirm_yes")->re_ascii);
    CHECK(find(shipped, "reply_card_number") && find(shipped, "reply_card_number")->re_ascii);
    if (shipped)
        check_set(shipped, 20000);

    static const char edges[] =
        "rule words\n  match \\b(?<w>\\w+)\\s+(\\d+)\\b\n  do params t\n"
        "rule caseless\n  match kelvin|STRESS|(?<=x)s\n  do params t\n"
        "rule negated\n  match a[^’é]b[[:punct:]][[:alpha:]]+\n  do params t\n"
        "rule spaces\n  match ^\\s*(?:ok|yes)[\\s,.!]*$\n  do params t\n"
        "rule quant\n  match don’?t\n  do params t\n"
        "rule quoted\n  match \\Qé?\\E\n  do params t\n"
        "rule comment\n  match (?#é)ab\n  do params t\n"
        "rule extended\n  match (?x) a b # é\n  do params t\n"
        "rule big\n  match \\x{263A}|smile\n  do params t\n"
        "rule sensitive\n  option case\n  match Feb\\s+\\d+\n  do params t\n"
        "rule card\n  on reply\n  match (?<![\\w+-])(?:\\d{4}[ -]?){3}\\d{4}(?![\\w-])\n  do mask [card]\n";
    cg_ruleset *rs = NULL;
    int loaded = cg_rules_load_text("edges.rules", edges, strlen(edges), &rs, err, sizeof(err));
    if (loaded != 0)
        fprintf(stderr, "edges.rules: %s\n", err);
    CHECK(loaded == 0);
    if (rs) {
        CHECK(find(rs, "words")->re_ascii && find(rs, "caseless")->re_ascii && find(rs, "negated")->re_ascii &&
              find(rs, "spaces")->re_ascii && find(rs, "sensitive")->re_ascii && find(rs, "card")->re_ascii);
        CHECK(!find(rs, "quant")->re_ascii);    /* ’ outside a class */
        CHECK(!find(rs, "quoted")->re_ascii);   /* \Q...\E not looked into */
        CHECK(!find(rs, "comment")->re_ascii);  /* (?#...) */
        CHECK(!find(rs, "extended")->re_ascii); /* (?x) */
        CHECK(!find(rs, "big")->re_ascii);      /* \x{263A} does not compile without UTF */
        check_set(rs, 20000);
    }
    CHECK(compared > 100000 && matched > 1000); /* the comparisons were made, and many matched */
    fprintf(stderr, "compared %d subjects, %d matched, %d disagreements\n", compared, matched, disagreed);
    if (rs)
        cg_ruleset_unref(rs);
    if (shipped)
        cg_ruleset_unref(shipped);
    return unit_done("test_rules_ascii");
}
