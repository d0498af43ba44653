/*
 * test_rules.c: the rules engine: normalisers at a fixed clock, loader errors that name
 * file:line (and PCRE2's offset), actions and conditions, the match limit, the selection
 * resolver and the pipeline's order (cancel before awaiting before extraction).
 */
#include <stdlib.h>
#include <time.h>
#include <sys/stat.h>
#include <unistd.h>

#include "chatgate/core/error.h"
#include "chatgate/dialog/pipeline.h"
#include "chatgate/dialog/rules.h"
#include "unit.h"

#define NOW 1770112800 /* 2026-02-03T10:00:00Z, a Tuesday */

static char dir[64];

static void write_rules(const char *name, const char *text)
{
    char path[256];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    FILE *f = fopen(path, "w");
    fputs(text, f);
    fclose(f);
}

static void clear_dir(void)
{
    char cmd[128];
    snprintf(cmd, sizeof(cmd), "rm -f %s/*.rules", dir);
    if (system(cmd) != 0)
        fprintf(stderr, "could not clear %s\n", dir);
}

static void test_dates(void)
{
    static const struct { const char *in, *out; } cases[] = {
        {"Feb 20", "2026-02-20"},      {"20 February", "2026-02-20"}, {"february 20th", "2026-02-20"},
        {"20th of Feb", "2026-02-20"}, {"tomorrow", "2026-02-04"},    {"today", "2026-02-03"},
        {"next week", "2026-02-10"},   {"2026-02-20", "2026-02-20"},  {"20/02/2026", "2026-02-20"},
        {"Feb 1", "2027-02-01"},       /* already past this year: the next one */
        {"Feb 3", "2026-02-03"},       /* today counts */
        {"Feb 29", "2028-02-29"},      {"Dec 25, 2026", "2026-12-25"},
    };
    char out[11];
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        int rc = cg_normalise_date(cases[i].in, NOW, out);
        CHECK(rc == 0);
        if (rc == 0)
            CHECK_STR(out, cases[i].out);
    }
    CHECK(cg_normalise_date("Feb 30", NOW, out) < 0);
    CHECK(cg_normalise_date("someday", NOW, out) < 0);
    CHECK(cg_normalise_date("2026-13-01", NOW, out) < 0);
    CHECK(cg_normalise_date("", NOW, out) < 0);
}

static void test_numbers(void)
{
    long v;
    CHECK(cg_normalise_int("2", &v) == 0 && v == 2);
    CHECK(cg_normalise_int("two", &v) == 0 && v == 2);
    CHECK(cg_normalise_int("Three", &v) == 0 && v == 3);
    CHECK(cg_normalise_int("many", &v) < 0);
    double a;
    char cur[4];
    CHECK(cg_normalise_amount("5000 shillings", &a, cur) == 0 && a == 5000);
    CHECK_STR(cur, "KES");
    CHECK(cg_normalise_amount("3k", &a, cur) == 0 && a == 3000);
    CHECK_STR(cur, "");
    CHECK(cg_normalise_amount("KES 5,000", &a, cur) == 0 && a == 5000);
    CHECK_STR(cur, "KES");
    CHECK(cg_normalise_amount("$20", &a, cur) == 0 && a == 20);
    CHECK_STR(cur, "USD");
    CHECK(cg_normalise_amount("2.5k", &a, cur) == 0 && a == 2500);
    CHECK(cg_normalise_amount("lots", &a, cur) < 0);
}

/* Loading fails with a message that contains want. */
static void check_load_error(const char *text, const char *want)
{
    clear_dir();
    write_rules("50-x.rules", text);
    cg_ruleset *rs = NULL;
    char err[1024] = "";
    int rc = cg_rules_load(dir, &rs, err, sizeof(err));
    unit_checks++;
    if (rc == 0 || !strstr(err, want)) {
        unit_failures++;
        fprintf(stderr, "loading %s: rc %d, err \"%s\", wanted \"%s\"\n", text, rc, err, want);
    }
    if (rs)
        cg_ruleset_unref(rs);
}

static void test_load_errors(void)
{
    char want[256];
    snprintf(want, sizeof(want), "%s/50-x.rules:3: rule 'bad': bad pattern: missing closing parenthesis at offset 4 of: (abc", dir);
    check_load_error("# x\nrule bad\n  match   (abc\n  do cancel\n", want);
    snprintf(want, sizeof(want), "%s/50-x.rules:2: unknown action 'explode'", dir);
    check_load_error("rule a\n  do explode\n", want);
    check_load_error("rule a\n  do cancel\n", "rule 'a' has no 'match' line");
    check_load_error("rule a\n  match x\n", "rule 'a' has no 'do' line");
    check_load_error("match x\n", ":1: 'match' outside a rule");
    check_load_error("rule a\n match x\n do cancel\nrule a\n match y\n do cancel\n", "rule 'a' is defined twice");
    check_load_error("rule a\n match (?<d>x)\n do params travel\n type e date\n", "the pattern has no group (?<e>");
    check_load_error("rule a\n match x\n do confirm maybe\n", "'do confirm' takes yes or no");
    check_load_error("rule a\n match x\n do cancel\n when raining\n", "unknown condition 'when raining'");
    check_load_error("rule a\n match x\n do cancel\n expect nevermind\n", "expect needs a double-quoted text");
    check_load_error("rule a\n match x\n do cancel\n flavour sweet\n", "unknown keyword 'flavour'");
}

static void test_eval_and_check(void)
{
    clear_dir();
    write_rules("10-cancel.rules", "rule cancel\n  match ^\\s*(?:cancel|never\\s*mind)\\s*[.!]*$\n  do cancel\n"
                                    "  expect \"Never mind!\"\n  reject \"cancel my subscription\"\n");
    write_rules("50-travel.rules",
                "rule route\n  match \\bfrom\\s+(?<from>\\p{L}+)(?:\\s*\\(not\\s+\\p{L}+\\))?\\s+to\\s+(?<to>\\p{L}+)\n"
                "  do params travel\n  expect \"from Mombasa (not Nairobi) to London\" from=Mombasa to=London\n"
                "rule ret\n  match \\breturn(?:ing)?\\s+(?:on\\s+)?(?<return_date>[\\p{L}\\d ,]+?)\\s*[?.!]*$\n"
                "  do params travel\n  type return_date date\n  expect \"What about returning on Feb 20?\" return_date=2026-02-20\n"
                "rule yes\n  match ^\\s*(?:yes|\xf0\x9f\x91\x8d)\\s*$\n  do confirm yes\n  when awaiting confirmation\n"
                "  expect \"\xf0\x9f\x91\x8d\"\n"
                "rule when_later\n  match ^\\s*and\\s+(?<when>tomorrow)\\s*\\?*$\n  do enrich {previous} {when}?\n  when history\n"
                "  expect \"And tomorrow?\" enriched=\"What's the weather in Tokyo tomorrow?\"\n"
                "rule wrong\n  match flights\n  do params travel\n  expect \"cheap flights\" from=Paris\n");
    cg_ruleset *rs;
    char err[1024];
    CHECK(cg_rules_load(dir, &rs, err, sizeof(err)) == 0);
    CHECK(cg_ruleset_count(rs) == 6);

    char *buf;
    size_t len;
    FILE *out = open_memstream(&buf, &len);
    int n_tests;
    CHECK(cg_rules_check(rs, NOW, out, &n_tests) == 1); /* only 'wrong' fails */
    fclose(out);
    CHECK(n_tests == 7);
    CHECK(strstr(buf, "50-travel.rules:23: rule 'wrong' on \"cheap flights\": from is missing") != NULL);
    free(buf);

    cg_rules_result r;
    cg_dialog d;
    cg_dialog_init(&d, NOW);
    cg_rules_eval(rs, "Find flights from Nairobi to London", &d, NULL, NOW, &r);
    CHECK_STR(r.service, "travel");
    CHECK_STR(json_string_value(json_object_get(json_object_get(r.params, "travel"), "from")), "Nairobi");
    CHECK(r.cancel == 0 && r.confirm == -1);
    cg_rules_result_free(&r);

    cg_rules_eval(rs, "yes", &d, NULL, NOW, &r); /* not awaiting a confirmation: the rule waits */
    CHECK(r.confirm == -1);
    cg_rules_result_free(&r);
    d.awaiting = json_pack("{s:s, s:s}", "type", "confirmation", "source", "app");
    d.awaiting_expires = NOW + 60;
    cg_rules_eval(rs, "\xf0\x9f\x91\x8d", &d, NULL, NOW, &r);
    CHECK(r.confirm == 1);
    cg_rules_result_free(&r);

    cg_rules_eval(rs, "And tomorrow?", &d, "What's the weather in Tokyo?", NOW, &r);
    CHECK_STR(r.enriched, "What's the weather in Tokyo tomorrow?");
    cg_rules_result_free(&r);
    cg_rules_eval(rs, "And tomorrow?", &d, NULL, NOW, &r); /* no history: no enrichment */
    CHECK(r.enriched == NULL);
    cg_rules_result_free(&r);

    /* the pipeline: cancel comes before the awaiting confirmation it would otherwise answer */
    static cg_config cfg;
    cfg.n_upstreams = 2;
    cfg.upstreams[0].name = "llm";
    cfg.upstreams[1].name = "app";
    cfg.default_index = 0;
    cg_lifetimes lt;
    cg_lifetimes_default(&lt);
    cg_pipeline_result p;
    cg_pipeline_run(&cfg, rs, &d, "never mind", NOW, &lt, &p);
    CHECK(p.cancel && !p.absorb);
    CHECK_STR(json_string_value(json_object_get(p.resolution, "type")), "cancel");
    CHECK(d.awaiting == NULL);
    cg_pipeline_result_free(&p);

    d.awaiting = json_pack("{s:s, s:s}", "type", "confirmation", "source", "app");
    cg_pipeline_run(&cfg, rs, &d, "yes", NOW, &lt, &p);
    CHECK(json_is_true(json_object_get(p.resolution, "confirmed")));
    CHECK(p.route == 1); /* back to the upstream that asked */
    cg_pipeline_result_free(&p);

    cg_dialog_free(&d);
    cg_ruleset_unref(rs);
}

/* `when tool[.PATH] [VALUE]` and `when soft[.PATH] [VALUE]`: the third document's follow-up
 * ("filter for food" only after a transactions result), paths into objects and arrays,
 * values of each JSON type, and the load errors. */
static void test_tool_and_soft_conditions(void)
{
    clear_dir();
    write_rules("50-bank.rules",
                "rule filter\n  match ^\\s*(?:filter|show only)\\s+(?:for\\s+)?(?<category>\\p{L}+)\n"
                "  do params transactions\n  when tool.type transactions\n  expect \"filter for food\" category=food\n"
                "rule any_tool\n  match ^again$\n  do enrich again with the tool\n  when tool\n"
                "rule first_item\n  match ^first$\n  do enrich the first is food\n  when tool.items.0.category food\n"
                "rule count\n  match ^count$\n  do enrich three\n  when tool.count 3\n"
                "rule flag\n  match ^flag$\n  do enrich flagged\n  when tool.done true\n"
                "rule soft_venue\n  match ^that one$\n  do enrich the venue\n  when soft.last_action added_venue\n"
                "rule soft_any\n  match ^soft$\n  do enrich soft there\n  when soft\n");
    cg_ruleset *rs;
    char err[1024];
    CHECK(cg_rules_load(dir, &rs, err, sizeof(err)) == 0);
    cg_dialog d;
    cg_dialog_init(&d, NOW);
    cg_rules_result r;
    /* no tool result, no soft context: none of them */
    static const char *const texts[] = {"filter for food", "again", "first", "count", "flag", "that one", "soft"};
    for (size_t i = 0; i < sizeof(texts) / sizeof(texts[0]); i++) {
        cg_rules_eval(rs, texts[i], &d, "before", NOW, &r);
        CHECK(!r.service[0] && r.enriched == NULL);
        cg_rules_result_free(&r);
    }
    /* another kind of result: the filter waits */
    d.last_tool_result = json_pack("{s:s}", "type", "goals");
    cg_rules_eval(rs, "filter for food", &d, "before", NOW, &r);
    CHECK(!r.service[0]);
    cg_rules_result_free(&r);
    cg_rules_eval(rs, "again", &d, "before", NOW, &r);
    CHECK_STR(r.enriched, "again with the tool");
    cg_rules_result_free(&r);
    json_decref(d.last_tool_result);
    d.last_tool_result = json_pack("{s:s, s:[{s:s, s:i}, {s:s, s:i}], s:i, s:b}", "type", "transactions", "items",
                                   "category", "food", "amount", 12, "category", "travel", "amount", 300, "count",
                                   3, "done", 1);
    cg_rules_eval(rs, "Filter for FOOD", &d, "before", NOW, &r);
    CHECK_STR(r.service, "transactions");
    CHECK_STR(json_string_value(json_object_get(json_object_get(r.params, "transactions"), "category")), "FOOD");
    cg_rules_result_free(&r);
    cg_rules_eval(rs, "first", &d, "before", NOW, &r);
    CHECK_STR(r.enriched, "the first is food");
    cg_rules_result_free(&r);
    cg_rules_eval(rs, "count", &d, "before", NOW, &r);
    CHECK_STR(r.enriched, "three");
    cg_rules_result_free(&r);
    cg_rules_eval(rs, "flag", &d, "before", NOW, &r);
    CHECK_STR(r.enriched, "flagged");
    cg_rules_result_free(&r);
    json_object_set_new(d.last_tool_result, "count", json_string("3")); /* "3" is 3 too: the text */
    json_object_set_new(d.last_tool_result, "items", json_array());     /* no item 0 */
    cg_rules_eval(rs, "count", &d, "before", NOW, &r);
    CHECK_STR(r.enriched, "three");
    cg_rules_result_free(&r);
    cg_rules_eval(rs, "first", &d, "before", NOW, &r);
    CHECK(r.enriched == NULL);
    cg_rules_result_free(&r);
    json_object_set_new(d.last_tool_result, "done", json_null()); /* null is not there */
    cg_rules_eval(rs, "flag", &d, "before", NOW, &r);
    CHECK(r.enriched == NULL);
    cg_rules_result_free(&r);
    d.soft = json_pack("{s:s}", "last_action", "added_venue");
    cg_rules_eval(rs, "that one", &d, "before", NOW, &r);
    CHECK_STR(r.enriched, "the venue");
    cg_rules_result_free(&r);
    cg_rules_eval(rs, "soft", &d, "before", NOW, &r);
    CHECK_STR(r.enriched, "soft there");
    cg_rules_result_free(&r);
    cg_dialog_free(&d);
    cg_ruleset_unref(rs);

    /* `do remember NAME` and `when profile[.NAME] [VALUE]` */
    clear_dir();
    write_rules("15-profile.rules",
                "rule home\n  match i\\s+live\\s+in\\s+(?<home_city>\\p{L}+)\n  do remember home_city\n  type home_city title\n"
                "  expect \"I live in nairobi\" home_city=Nairobi\n"
                "rule cur\n  match prices\\s+in\\s+(?<currency>\\p{L}+)\n  do remember currency\n  type currency currency\n"
                "rule local\n  match ^home$\n  do enrich the home city\n  when profile.home_city Nairobi\n");
    rs = NULL;
    CHECK(cg_rules_load(dir, &rs, err, sizeof(err)) == 0);
    if (!rs) {
        fprintf(stderr, "  %s\n", err);
        return;
    }
    char *buf;
    size_t len;
    FILE *out = open_memstream(&buf, &len);
    int n_tests;
    CHECK(cg_rules_check(rs, NOW, out, &n_tests) == 0 && n_tests == 1);
    fclose(out);
    free(buf);
    cg_dialog_init(&d, NOW);
    cg_rules_eval(rs, "I live in nairobi, prices in euros", &d, "before", NOW, &r);
    CHECK_STR(json_string_value(json_object_get(r.remember, "home_city")), "Nairobi");
    CHECK_STR(json_string_value(json_object_get(r.remember, "currency")), "EUR");
    cg_rules_result_free(&r);
    cg_rules_eval(rs, "home", &d, "before", NOW, &r); /* no profile */
    CHECK(r.enriched == NULL && r.remember == NULL);
    cg_rules_result_free(&r);
    json_t *profile = json_pack("{s:s}", "home_city", "Nairobi");
    d.profile = profile; /* borrowed, as a turn lends it */
    cg_rules_eval(rs, "home", &d, "before", NOW, &r);
    CHECK_STR(r.enriched, "the home city");
    cg_rules_result_free(&r);
    cg_dialog_free(&d); /* leaves the borrowed profile alone */
    json_decref(profile);
    cg_ruleset_unref(rs);
    check_load_error("rule a\n match x\n do remember\n", "'do remember' needs an argument");
    check_load_error("rule a\n match x\n do remember home city\n", "is not a name");
    check_load_error("rule a\n match (?<x>y)\n do cancel\n type x title\n", "'type' lines are for");
    check_load_error("rule a\n match x\n do cancel\n when tool.\n", "'when tool.' needs a path of names");
    check_load_error("rule a\n match x\n do cancel\n when soft.a b\n when tools\n", "unknown condition 'when tools'");
    check_load_error("rule a\n match x\n do cancel\n when soft.a/b\n", "'when soft.a/b' needs a path");
}

static void test_match_limit(void)
{
    clear_dir();
    /* catastrophic backtracking: cut off by the match limit, counted as no match */
    write_rules("10-redos.rules", "rule redos\n  match ^(a+)+$\n  do cancel\n");
    cg_ruleset *rs;
    char err[1024];
    CHECK(cg_rules_load(dir, &rs, err, sizeof(err)) == 0);
    char text[64];
    memset(text, 'a', 40);
    strcpy(text + 40, "!");
    cg_rules_result r;
    cg_rules_eval(rs, text, NULL, NULL, NOW, &r);
    CHECK(r.cancel == 0);
    CHECK(json_array_size(r.limited) == 1);
    cg_rules_result_free(&r);
    cg_ruleset_unref(rs);
}

/* A params rule's value per name (DUPNAMES): the first group of the name that took part,
 * normalised; when the normaliser refuses it, the name is left out, whatever a later group
 * of the name holds. DEFINE's groups never become params. */
static json_t *params_for(const cg_ruleset *rs, const char *text)
{
    cg_rules_result r;
    cg_rules_eval(rs, text, NULL, NULL, NOW, &r);
    json_t *p = json_incref(json_object_get(r.params, "travel"));
    cg_rules_result_free(&r);
    return p;
}

static void test_dupnames(void)
{
    clear_dir();
    write_rules("50-dup.rules", "rule dup\n"
                                "  match (?:from\\s+(?<from>(?&w))|(?<from>(?&w))\\s+departure)(?:\\s+(?<n>\\w+)\\s+(?<n>\\d+))?"
                                "(?(DEFINE)(?<w>\\p{L}+))\n"
                                "  do params travel\n  type n int\n");
    cg_ruleset *rs;
    char err[1024];
    CHECK(cg_rules_load(dir, &rs, err, sizeof(err)) == 0);
    json_t *p = params_for(rs, "from Kisumu");
    CHECK(p && json_object_size(p) == 1 && strcmp(json_string_value(json_object_get(p, "from")), "Kisumu") == 0);
    json_decref(p);
    p = params_for(rs, "Mombasa departure"); /* the second group of the name */
    CHECK(p && json_object_size(p) == 1 && strcmp(json_string_value(json_object_get(p, "from")), "Mombasa") == 0);
    json_decref(p);
    p = params_for(rs, "from Kisumu 7 5"); /* n's first group, 7, is the value */
    CHECK(p && json_integer_value(json_object_get(p, "n")) == 7);
    json_decref(p);
    p = params_for(rs, "from Kisumu abc 5"); /* its first group is refused: no n, not 5 */
    CHECK(p && json_object_size(p) == 1 && !json_object_get(p, "n") && !json_object_get(p, "w"));
    json_decref(p);
    cg_ruleset_unref(rs);
}

static void test_selection(void)
{
    json_error_t jerr;
    json_t *opts = json_loads("[{\"name\":\"Shake Shack\",\"district\":\"Shibuya\"},"
                              "{\"name\":\"Shake Shack\",\"district\":\"Shinjuku\"},"
                              "{\"name\":\"Shake Shack\",\"district\":\"Harajuku\"}]",
                              0, &jerr);
    CHECK(cg_pipeline_select(opts, "2") == 2);
    CHECK(cg_pipeline_select(opts, "#3") == 3);
    CHECK(cg_pipeline_select(opts, "the second one") == 2);
    CHECK(cg_pipeline_select(opts, "second") == 2);
    CHECK(cg_pipeline_select(opts, "in Shibuya") == 1);
    CHECK(cg_pipeline_select(opts, "the Shinjuku one") == 2);
    CHECK(cg_pipeline_select(opts, "the Shake Shack in Harajuku please") == 3);
    CHECK(cg_pipeline_select(opts, "4") == 0);
    CHECK(cg_pipeline_select(opts, "Shake Shack") == 0); /* names all three */
    CHECK(cg_pipeline_select(opts, "what is the weather") == 0);
    json_decref(opts);
}

/* A day in Nairobi (UTC+3) starts at 21:00 UTC the day before. */
static void test_timezone(void)
{
    char out[11];
    setenv("TZ", "Africa/Nairobi", 1);
    tzset();
    CHECK(cg_normalise_date("today", 1770152400 /* 2026-02-03T21:00:00Z */, out) == 0);
    CHECK_STR(out, "2026-02-04");
    CHECK(cg_normalise_date("tomorrow", 1770152400, out) == 0);
    CHECK_STR(out, "2026-02-05");
    setenv("TZ", "UTC", 1);
    tzset();
    CHECK(cg_normalise_date("today", 1770152400, out) == 0);
    CHECK_STR(out, "2026-02-03");
}

/* Feeds text to a filter in deltas of `step` bytes (0: one delta), then the end: the output. */
static char *reply_through(const cg_ruleset *rs, size_t window, const char *text, size_t step)
{
    cg_reply_filter *f = cg_reply_filter_new(rs, window);
    char *all = calloc(1, 1);
    size_t len = strlen(text), all_len = 0;
    for (size_t at = 0; at <= len;) {
        size_t n = step && len - at > step ? step : len - at;
        int final = at + n == len;
        const char *out;
        size_t m;
        int stop = cg_reply_filter_feed(f, text + at, n, final, &out, &m);
        all = realloc(all, all_len + m + 1);
        if (m)
            memcpy(all + all_len, out, m);
        all_len += m;
        all[all_len] = 0;
        at += n;
        if (final || stop)
            break;
    }
    cg_reply_filter_free(f);
    return all;
}

/* Rules on replies: a match split across deltas is masked as if whole; a possible match of
 * one rule that outgrows the window does not hide another rule's match at the same place
 * (the review's case: a card number before a long word that could be an e-mail address). */
static void test_reply_rules(void)
{
    static const char text[] = "rule card\n  on reply\n  match (?<![\\w+-])(?:\\d{4}[ -]?){3}\\d{4}(?![\\w-])\n"
                               "  do mask [card]\n"
                               "rule mail\n  on reply\n  match [\\w.+-]+@[\\w-]+(?:\\.[\\w-]+)+\n  do mask [mail]\n"
                               "rule key\n  on reply\n  match sk-[a-z]{8}\n  do stop\n";
    cg_ruleset *rs = NULL;
    char err[256];
    CHECK(cg_rules_load_text("reply.rules", text, strlen(text), &rs, err, sizeof(err)) == 0);
    const char *cases[][2] = {
        {"call 4111 1111 1111 1111 now", "call [card] now"},
        {"write to a.b@example.com please", "write to [mail] please"},
        {"Charged to 4111111111111111.ref_abcdefghijklmnopqrstuvwxyz_abcdefghijklmnopqrstuvwxyz ok",
         "Charged to [card].ref_abcdefghijklmnopqrstuvwxyz_abcdefghijklmnopqrstuvwxyz ok"},
        {"no match here at all", "no match here at all"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
        for (size_t step = 0; step <= 7; step++) {
            char *got = reply_through(rs, 64, cases[i][0], step);
            CHECK_STR(got, cases[i][1]);
            free(got);
        }
    /* a stop: the text before it, nothing after, in any cut */
    for (size_t step = 0; step <= 5; step++) {
        char *got = reply_through(rs, 64, "your key is sk-abcdefgh and more", step);
        CHECK_STR(got, "your key is ");
        free(got);
    }
    /* a long run that could still be an e-mail address is not held past the window */
    char run[4096];
    memset(run, 'a', sizeof(run) - 1);
    run[sizeof(run) - 1] = 0;
    cg_reply_filter *f = cg_reply_filter_new(rs, 64);
    const char *out;
    size_t m;
    CHECK(cg_reply_filter_feed(f, run, strlen(run), 0, &out, &m) == 0);
    CHECK(m == strlen(run)); /* nothing to wait for: the possible match outgrew the window */
    cg_reply_filter_free(f);
    cg_ruleset_unref(rs);
}

/* Feeds one delta; 1 when it went on as it came (the filter's own text, untouched). */
static int fed_as_is(cg_reply_filter *f, const char *text, int final, char *got, size_t cap)
{
    const char *out;
    size_t m;
    cg_reply_filter_feed(f, text, strlen(text), final, &out, &m);
    size_t had = strlen(got);
    if (m && had + m < cap) {
        memcpy(got + had, out, m);
        got[had + m] = 0;
    }
    return out == text && m == strlen(text);
}

/* A delta none of whose bytes can begin a mask or stop rule's match passes as it came, while
 * nothing is held; what it leaves for the next delta's lookbehind is kept (issue 39). */
static void test_reply_pass(void)
{
    /* the shipped card rule's shape (digits begin a match), and a caseless stop rule ('s' or 'S') */
    static const char text[] = "rule card\n  on reply\n  match (?<![\\w+-])(?:\\d{4}[ -]?){3}\\d{4}(?![\\w-])\n"
                               "  do mask [card]\n"
                               "rule key\n  on reply\n  match sk-[a-z]{8}\n  do stop\n";
    cg_ruleset *rs = NULL;
    char err[256];
    CHECK(cg_rules_load_text("pass.rules", text, strlen(text), &rs, err, sizeof(err)) == 0);
    char got[256] = "";
    cg_reply_filter *f = cg_reply_filter_new(rs, 64);
    CHECK(fed_as_is(f, "Your card: ", 0, got, sizeof(got)));
    CHECK(!fed_as_is(f, "4111 1111 ", 0, got, sizeof(got))); /* digits: may begin a match, held */
    CHECK(!fed_as_is(f, "1111 1111 was used", 1, got, sizeof(got)));
    CHECK_STR(got, "Your card: [card] was used");
    cg_reply_filter_free(f);
    /* the lookbehind sees the text passed on before: "abc4111..." holds no card number */
    got[0] = 0;
    f = cg_reply_filter_new(rs, 64);
    CHECK(fed_as_is(f, "abc", 0, got, sizeof(got)));
    fed_as_is(f, "4111 1111 1111 1111", 1, got, sizeof(got));
    CHECK_STR(got, "abc4111 1111 1111 1111");
    cg_reply_filter_free(f);
    /* a caseless rule's first letter in either case stops the pass: "SK-..." is the key */
    got[0] = 0;
    f = cg_reply_filter_new(rs, 64);
    CHECK(fed_as_is(f, "your key: ", 0, got, sizeof(got)));
    CHECK(!fed_as_is(f, "SK-ABCDEFGH and more", 1, got, sizeof(got)));
    CHECK_STR(got, "your key: ");
    cg_reply_filter_free(f);
    /* a byte past ASCII may begin a Unicode digit: such a delta does not pass */
    got[0] = 0;
    f = cg_reply_filter_new(rs, 64);
    CHECK(!fed_as_is(f, "caf\xC3\xA9 ", 0, got, sizeof(got)));
    CHECK(fed_as_is(f, "ok", 1, got, sizeof(got)));
    CHECK_STR(got, "caf\xC3\xA9 ok");
    cg_reply_filter_free(f);
    /* and any cut of a text gives what one delta gives */
    const char *texts[] = {"paid with 4111111111111111. Thanks, sk-abcdefgh", "abc 4111-1111-1111-1111 ok",
                           "Amex 3782 822463 10005 on file", "no digits in here at all, none"};
    for (size_t i = 0; i < sizeof(texts) / sizeof(texts[0]); i++) {
        char *whole = reply_through(rs, 64, texts[i], 0);
        for (size_t step = 1; step <= 9; step++) {
            char *cut = reply_through(rs, 64, texts[i], step);
            CHECK_STR(cut, whole);
            free(cut);
        }
        free(whole);
    }
    cg_ruleset_unref(rs);
}

/* A *.rules FIFO no one writes to (core/file.h): read at once as empty, where fopen()
 * waited in open() for ever, which on a SIGHUP reload would have stopped the loop. */
static void test_fifo_file(void)
{
    clear_dir();
    write_rules("10-a.rules", "rule cancel\n  match ^\\s*cancel\\s*$\n  do cancel\n");
    char fifo[300];
    snprintf(fifo, sizeof(fifo), "%s/20-fifo.rules", dir);
    CHECK(mkfifo(fifo, 0600) == 0);
    cg_ruleset *rs = NULL;
    char err[1024] = "";
    CHECK(cg_rules_load(dir, &rs, err, sizeof(err)) == 0);
    CHECK(rs && cg_ruleset_count(rs) == 1);
    if (rs)
        cg_ruleset_unref(rs);
    unlink(fifo);
}

int main(void)
{
    setenv("TZ", "UTC", 1);
    tzset();
    snprintf(dir, sizeof(dir), "/tmp/cg-test-rules-%d", (int)getpid());
    mkdir(dir, 0700);
    test_dates();
    test_numbers();
    test_load_errors();
    test_eval_and_check();
    test_match_limit();
    test_tool_and_soft_conditions();
    test_dupnames();
    test_selection();
    test_timezone();
    test_reply_rules();
    test_reply_pass();
    test_fifo_file();
    clear_dir();
    rmdir(dir);
    return unit_done("test_rules");
}
