/*
 * rules_bench.c: what the rules cost per message (a benchmark, not a test).
 *
 *   rules_bench RULES_DIR [ITERATIONS]
 *   rules_bench RULES_DIR --per-rule MESSAGE [ITERATIONS]
 *
 * Runs the whole pipeline (every rule, the resolvers, the merge) on a mix of messages from
 * the reference scenarios, first with the rules in RULES_DIR, then with 1,000 generated
 * rules (params rules with named groups and a date normaliser, the costly kind), and prints
 * microseconds per message for each.
 *
 * --per-rule runs each rule alone on MESSAGE (its conditions not checked) and prints what it
 * costs, its share of evaluating an empty range taken off, costliest first: where to look
 * when the rules' time per message grows. Dates are read in UTC, as the gateway's default
 * (with TZ unset, glibc's mktime would read /etc/localtime at every call).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "chatgate/core/log.h"
#include "chatgate/dialog/pipeline.h"
#include "chatgate/dialog/rules.h"
#include "chatgate/dialog/rules_internal.h"

#define NOW 1770112800

static const char *const messages[] = {
    "Find me flights from Nairobi to London next week",
    "What about returning on Feb 20?",
    "Show me business class options",
    "Send 5000 shillings to +254712345678",
    "Send another 3000 to the same person",
    "What's the weather in Tokyo?",
    "And tomorrow?",
    "nevermind",
    "the Shinjuku one",
    "get the shroom burger",
    ("Tell me a long story about a cat who travels from Mombasa to Paris and back again, twice, "
     "with many details about the food, the weather and the people it meets on the way."), /* one, on two lines */
};
#define N_MESSAGES (sizeof(messages) / sizeof(messages[0]))

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static double run(const cg_ruleset *rs, long iterations)
{
    static cg_config cfg;
    cfg.n_upstreams = 1;
    cfg.upstreams[0].name = "llm";
    cg_lifetimes lt;
    cg_lifetimes_default(&lt);
    double start = now_s();
    for (long i = 0; i < iterations; i++) {
        const char *text = messages[i % N_MESSAGES];
        cg_dialog d;
        cg_dialog_init(&d, NOW);
        cg_dialog_push_history(&d, "user", "What's the weather in Tokyo?", NOW, &lt);
        if (i % 4 == 0) {
            d.awaiting = json_pack("{s:s, s:[{s:s}, {s:s}], s:s}", "type", "selection", "options", "district",
                                   "Shibuya", "district", "Shinjuku", "source", "llm");
            d.awaiting_expires = NOW + 60;
        }
        cg_pipeline_result res;
        cg_pipeline_run(&cfg, rs, &d, text, NOW, &lt, &res);
        cg_pipeline_result_free(&res);
        cg_dialog_free(&d);
    }
    return (now_s() - start) / (double)iterations * 1e6;
}

/* A baseline without rules: the pipeline's own cost (dialog, resolvers, JSON). */
static double run_empty(long iterations)
{
    char dir[] = "/tmp/cg-rules-empty-XXXXXX";
    if (!mkdtemp(dir))
        return -1;
    cg_ruleset *rs;
    char err[512];
    cg_rules_load(dir, &rs, err, sizeof(err));
    double us = run(rs, iterations);
    cg_ruleset_unref(rs);
    rmdir(dir);
    return us;
}

static cg_ruleset *generated(int n)
{
    char dir[] = "/tmp/cg-rules-gen-XXXXXX", path[256];
    if (!mkdtemp(dir))
        return NULL;
    snprintf(path, sizeof(path), "%s/50-generated.rules", dir);
    FILE *f = fopen(path, "w");
    for (int i = 0; i < n; i++)
        fprintf(f, "rule gen_%d\n  match \\b(?:item%d|thing%d)\\s+(?:on\\s+)?(?<when_%d>[\\p{L}\\d ]+?)\\s*[?.!]*$\n"
                   "  do params svc%d\n  type when_%d date\n",
                i, i, i, i, i % 50, i);
    fclose(f);
    cg_ruleset *rs;
    char err[1024];
    if (cg_rules_load(dir, &rs, err, sizeof(err)) < 0) {
        fprintf(stderr, "%s\n", err);
        exit(1);
    }
    unlink(path);
    rmdir(dir);
    return rs;
}

/* Microseconds for rules [from, to) on text, the best of five rounds of n. */
static double eval_us(const cg_ruleset *rs, size_t from, size_t to, const char *text, long n)
{
    double best = 1e9;
    for (int round = 0; round < 5; round++) {
        double start = now_s();
        for (long k = 0; k < n; k++) {
            cg_rules_result r;
            cg_rules_result_init(&r);
            cg_rules_eval_range(rs, from, to, text, NULL, NULL, NOW, 0, &r);
            cg_rules_result_free(&r);
        }
        double us = (now_s() - start) / (double)n * 1e6;
        if (us < best)
            best = us;
    }
    return best;
}

typedef struct {
    const char *name;
    double us;
} rule_cost;

static int by_cost(const void *a, const void *b)
{
    double d = ((const rule_cost *)b)->us - ((const rule_cost *)a)->us;
    return d > 0 ? 1 : d < 0 ? -1 : 0;
}

static int per_rule(const cg_ruleset *rs, const char *text, long n)
{
    size_t count = cg_ruleset_count(rs);
    rule_cost *costs = calloc(count ? count : 1, sizeof(*costs));
    if (!costs)
        return 1;
    double empty = eval_us(rs, 0, 0, text, n), total = 0;
    for (size_t i = 0; i < count; i++) {
        size_t file;
        int line;
        costs[i].name = cg_ruleset_rule(rs, i, &file, &line);
        costs[i].us = eval_us(rs, i, i + 1, text, n) - empty;
        total += costs[i].us;
    }
    qsort(costs, count, sizeof(*costs), by_cost);
    printf("%zu rules on \"%s\" (an empty range: %.3f us, taken off each)\n", count, text, empty);
    for (size_t i = 0; i < count; i++)
        printf("%8.3f us  %s\n", costs[i].us, costs[i].name);
    printf("%8.3f us  all of them\n", total);
    free(costs);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: rules_bench RULES_DIR [ITERATIONS]\n"
                        "       rules_bench RULES_DIR --per-rule MESSAGE [ITERATIONS]\n");
        return 2;
    }
    cg_log_set_level(CG_LOG_ERROR);
    setenv("TZ", "UTC", 1);
    tzset();
    int by_rule = argc > 3 && strcmp(argv[2], "--per-rule") == 0;
    long iterations = by_rule ? (argc > 4 ? atol(argv[4]) : 20000) : argc > 2 ? atol(argv[2]) : 200000;
    cg_ruleset *shipped;
    char err[1024];
    if (cg_rules_load(argv[1], &shipped, err, sizeof(err)) < 0) {
        fprintf(stderr, "%s\n", err);
        return 1;
    }
    if (by_rule) {
        int rc = per_rule(shipped, argv[3], iterations > 0 ? iterations : 20000);
        cg_ruleset_unref(shipped);
        return rc;
    }
    double base = run_empty(iterations);
    double us = run(shipped, iterations);
    cg_ruleset *gen = generated(1000);
    double us_gen = run(gen, iterations / 20);
    printf("pipeline without rules:  %.2f us/message\n", base);
    printf("shipped rules (%zu):      %.2f us/message (rules %.2f)\n", cg_ruleset_count(shipped), us, us - base);
    printf("1000 generated rules:    %.2f us/message (rules %.2f)\n", us_gen, us_gen - base);
    printf("RESULT rules_shipped=%zu shipped_us=%.2f generated=1000 generated_us=%.2f baseline_us=%.2f\n",
           cg_ruleset_count(shipped), us, us_gen, base);
    cg_ruleset_unref(shipped);
    cg_ruleset_unref(gen);
    return 0;
}
