/*
 * rules_bench.c: what the rules cost per message (a benchmark, not a test).
 *
 *   rules_bench RULES_DIR [ITERATIONS]
 *
 * Runs the whole pipeline (every rule, the resolvers, the merge) on a mix of messages from
 * the reference scenarios, first with the rules in RULES_DIR, then with 1,000 generated
 * rules (params rules with named groups and a date normaliser, the costly kind), and prints
 * microseconds per message for each.
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
    "Tell me a long story about a cat who travels from Mombasa to Paris and back again, twice, "
    "with many details about the food, the weather and the people it meets on the way.",
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
        cg_dialog_push_history(&d, "user", "What's the weather in Tokyo?", NOW, &lt, NULL);
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

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: rules_bench RULES_DIR [ITERATIONS]\n");
        return 2;
    }
    cg_log_set_level(CG_LOG_ERROR);
    long iterations = argc > 2 ? atol(argv[2]) : 200000;
    cg_ruleset *shipped;
    char err[1024];
    if (cg_rules_load(argv[1], &shipped, err, sizeof(err)) < 0) {
        fprintf(stderr, "%s\n", err);
        return 1;
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
