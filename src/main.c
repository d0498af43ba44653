/*
 * main.c: reads the configuration, starts the gateway on a libuv loop and runs it.
 * Exit status: 0 after a clean stop, 1 when the server cannot start, 2 for a mistake in
 * the flags or the configuration file. With --workers N the process first becomes the master
 * of N workers (server/master.c), each of which runs the gateway below.
 */
#include <uv.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef CG_MIMALLOC
#include <mimalloc.h>
#endif

#include "chatgate/core/alloc.h"
#include "chatgate/config/config.h"
#include "chatgate/server/gateway.h"
#include "chatgate/server/master.h"
#include "chatgate/core/log.h"
#include "chatgate/dialog/pipeline.h"
#include "chatgate/dialog/replay.h"
#include "chatgate/dialog/rules.h"
#include "chatgate/store/store.h"

/* The clock of `rules check`, and of `rules explain` and `rules replay` without
 * CHATGATE_NOW: rule tests that name dates ("Feb 20", "next week") mean the same thing every day. */
#define RULES_CHECK_NOW 1770112800 /* 2026-02-03T10:00:00Z */

static int rules_usage(void)
{
    fprintf(stderr, "usage: chatgate rules check DIR\n"
                    "       chatgate rules explain DIR \"text\" [--state FILE.json]\n"
                    "       chatgate rules replay --old DIR --new DIR TRANSCRIPT...\n"
                    "         (TRANSCRIPT: JSON lines {\"dialog\",\"text\",\"ts\"}, or an admin dialog export;\n"
                    "          exit 0: no turn differs, 1: some do, 2: a usage or input error)\n");
    return 2;
}

/* chatgate rules check DIR: every expect/reject line; non-zero and file:line on a failure. */
static int rules_check(const char *dir)
{
    cg_ruleset *rs;
    char err[1024];
    if (cg_rules_load(dir, &rs, err, sizeof(err)) < 0) {
        fprintf(stderr, "%s\n", err);
        return 1;
    }
    int n_tests = 0;
    int failures = cg_rules_check(rs, RULES_CHECK_NOW, stdout, &n_tests);
    printf("rules check: %zu rules, %d tests, %d passed, %d failed\n", cg_ruleset_count(rs), n_tests,
           n_tests - failures, failures);
    cg_ruleset_unref(rs);
    return failures ? 1 : 0;
}

/* chatgate rules explain DIR "text" [--state FILE]: what fires and the state after, as JSON. */
static int rules_explain(int argc, char **argv)
{
    const char *dir = argv[3], *text = argv[4], *state_file = NULL;
    if (argc == 7 && strcmp(argv[5], "--state") == 0)
        state_file = argv[6];
    else if (argc != 5)
        return rules_usage();
    cg_ruleset *rs;
    char err[1024];
    if (cg_rules_load(dir, &rs, err, sizeof(err)) < 0) {
        fprintf(stderr, "%s\n", err);
        return 1;
    }
    int64_t now = getenv("CHATGATE_NOW") ? cg_store_default_now(NULL) : RULES_CHECK_NOW;
    cg_dialog d;
    json_t *state = NULL;
    if (state_file) {
        json_error_t jerr;
        state = json_load_file(state_file, 0, &jerr);
        if (!json_is_object(state)) {
            fprintf(stderr, "%s:%d:%d: %s\n", state_file, jerr.line, jerr.column,
                    state ? "the state must be a JSON object" : jerr.text);
            json_decref(state);
            cg_ruleset_unref(rs);
            return 1;
        }
    }
    cg_dialog_from_json(&d, state, now);
    /* a state file written by hand gives awaiting and soft context without their expiry
     * (so cg_dialog_from_json drops them): they hold for this explanation */
    json_t *awaiting = json_object_get(state, "awaiting"), *soft = json_object_get(state, "soft_context");
    if (json_is_object(awaiting) && !d.awaiting) {
        d.awaiting = json_deep_copy(awaiting);
        d.awaiting_expires = now + 120;
    }
    if (json_is_object(soft) && !d.soft) {
        d.soft = json_deep_copy(soft);
        d.soft_expires = now + 300;
    }
    static cg_config cfg; /* routes name the default upstream only */
    cg_upstream_config up = {.name = "default"};
    cfg.upstreams[0] = up;
    cfg.n_upstreams = 1;
    cg_lifetimes lt;
    cg_lifetimes_default(&lt);
    cg_rules_result rr;
    cg_rules_eval(rs, text, &d, cg_pipeline_previous(&d), now, &rr);
    cg_pipeline_result res;
    cg_pipeline_run(&cfg, rs, &d, text, now, &lt, &res);
    json_t *out = json_pack("{s:s, s:O, s:o, s:o, s:O, s:o, s:o, s:O, s:o, s:o}", "text", text, "fired", rr.fired,
                            "limited", rr.limited ? json_incref(rr.limited) : json_array(), "cancel",
                            res.cancel ? json_string(res.absorb ? "absorb" : "forward") : json_null(), "params",
                            rr.params, "enriched", res.enriched ? json_string(res.enriched) : json_null(),
                            "resolution", res.resolution ? json_incref(res.resolution) : json_null(), "annotations",
                            res.annotations, "error",
                            res.error ? json_string(res.error_message) : json_null(), "state", cg_dialog_context(&d));
    if (rr.route[0])
        json_object_set_new(out, "route", json_string(rr.route));
    char *s = json_dumps(out, JSON_INDENT(2));
    printf("%s\n", s);
    free(s);
    json_decref(out);
    json_decref(state);
    cg_rules_result_free(&rr);
    cg_pipeline_result_free(&res);
    cg_dialog_free(&d);
    cg_ruleset_unref(rs);
    return 0;
}

/*
 * chatgate rules replay --old DIR --new DIR TRANSCRIPT...: the recorded turns that the new
 * rules decide differently (dialog/replay.h). Flags and transcripts in any order; "--" ends
 * the flags. Exit status: that of cg_replay_run, 2 also for a set that does not load.
 */
static int rules_replay(int argc, char **argv)
{
    const char *dirs[2] = {NULL, NULL}; /* --old, --new */
    cg_ruleset *rs[2] = {NULL, NULL};
    char **paths = cg_calloc((size_t)argc, sizeof(*paths)); /* the transcripts, in order */
    char err[1024];
    int n_paths = 0, flags = 1, rc = 2;
    for (int i = 3; i < argc; i++) {
        int which = strcmp(argv[i], "--old") == 0 ? 0 : strcmp(argv[i], "--new") == 0 ? 1 : -1;
        if (flags && strcmp(argv[i], "--") == 0) {
            flags = 0;
        } else if (flags && which >= 0) {
            if (dirs[which] || i + 1 == argc)
                goto usage;
            dirs[which] = argv[++i];
        } else if (flags && strncmp(argv[i], "--", 2) == 0) {
            goto usage;
        } else {
            paths[n_paths++] = argv[i];
        }
    }
    if (!dirs[0] || !dirs[1] || n_paths == 0)
        goto usage;
    for (int k = 0; k < 2; k++)
        if (cg_rules_load(dirs[k], &rs[k], err, sizeof(err)) < 0) {
            fprintf(stderr, "%s %s: %s\n", k ? "--new" : "--old", dirs[k], err);
            rs[k] = NULL;
            goto done;
        }
    cg_replay_options opt = {
        .old_rules = rs[0], .new_rules = rs[1], .out = stdout, .err = stderr,
        .start = getenv("CHATGATE_NOW") ? cg_store_default_now(NULL) : RULES_CHECK_NOW,
    };
    rc = cg_replay_run(&opt, paths, n_paths, NULL);
    goto done;
usage:
    rc = rules_usage();
done:
    for (int k = 0; k < 2; k++)
        if (rs[k])
            cg_ruleset_unref(rs[k]);
    free(paths);
    return rc;
}

/*
 * Says which malloc the process runs on. A build with mimalloc (CMake's CHATGATE_MIMALLOC)
 * checks that a block from malloc is mimalloc's: an LD_PRELOAD of another allocator, or a
 * link order that put the C library first, would leave it linked but unused.
 */
static void log_malloc(void)
{
#ifdef CG_MIMALLOC
    void *probe = cg_malloc(16);
    int ours = probe && mi_is_in_heap_region(probe);
    free(probe);
    int v = mi_version(); /* 209 for 2.0.9 */
    if (ours)
        cg_info("malloc: mimalloc %d.%d.%d", v / 100, v / 10 % 10, v % 10);
    else
        cg_warn("malloc: mimalloc %d.%d.%d is linked but malloc is another's (an LD_PRELOAD?)", v / 100,
                v / 10 % 10, v % 10);
#else
    cg_info("malloc: the C library's");
#endif
}

/*
 * mimalloc keeps the pages a burst of connections used after they close, to give back later
 * (its decommit delay); but the later comes only with more work on those pages, so a gateway
 * that served thousands and went quiet held them for good (+2 to +12 MiB of RSS after 5,000
 * connections closed, compare.sh --idle). With no delay a page goes back once empty
 * (+0.3 MiB); a steady load empties none (no madvise under compare.sh's turns, strace).
 * MIMALLOC_DECOMMIT_DELAY in the environment still decides.
 */
static void malloc_tune(void)
{
#ifdef CG_MIMALLOC
    if (!getenv("MIMALLOC_DECOMMIT_DELAY"))
        mi_option_set(mi_option_decommit_delay, 0);
#endif
}

static int rules_command(int argc, char **argv)
{
    if (argc == 4 && strcmp(argv[2], "check") == 0)
        return rules_check(argv[3]);
    if (argc >= 5 && strcmp(argv[2], "explain") == 0)
        return rules_explain(argc, argv);
    if (argc >= 3 && strcmp(argv[2], "replay") == 0)
        return rules_replay(argc, argv);
    return rules_usage();
}

int main(int argc, char **argv)
{
    cg_alloc_init(); /* before any json_*: one out-of-memory policy (core/alloc.h) */
    setenv("TZ", "UTC", 1); /* the rules' dates: UTC unless --timezone says otherwise */
    tzset();
    if (argc >= 2 && strcmp(argv[1], "rules") == 0)
        return rules_command(argc, argv);
    static cg_config cfg;
    char err[1024];
    int rc = cg_config_load(&cfg, argc, argv, err, sizeof(err));
    if (rc == CG_CONFIG_EXIT_OK) {
        cg_config_free(&cfg);
        return 0;
    }
    if (rc != 0) {
        fprintf(stderr, "chatgate: %s\n", err);
        cg_config_free(&cfg);
        return 2;
    }
    cg_log_set_level((cg_log_level)cg_log_level_parse(cfg.log_level));
    cg_log_set_json(strcmp(cfg.log_format, "json") == 0);
    setenv("TZ", cfg.timezone, 1);
    tzset();
    cg_log_route_lws();
    malloc_tune();
    log_malloc();
    /* --workers N: this process becomes the master (it returns here only when every worker
     * has stopped); each worker goes on below as a gateway of its own */
    if (cfg.workers > 1 && cg_master_run(&cfg, &rc) == 0) {
        cg_config_free(&cfg);
        return rc;
    }

    uv_loop_t loop;
    uv_loop_init(&loop);
    static cg_gateway gw;
    srand((unsigned)(uv_hrtime() ^ (uint64_t)uv_os_getpid()));
    rc = cg_gateway_start(&gw, &cfg, &loop, err, sizeof(err));
    if (rc < 0) {
        if (rc == CG_GATEWAY_BAD_CONFIG)
            fprintf(stderr, "chatgate: %s\n", err);
        cg_gateway_abort(&gw);
        cg_config_free(&cfg);
        if (uv_loop_close(&loop) != 0) /* abort has closed every handle start opened */
            cg_warn("the event loop still had handles after a failed start");
        return rc == CG_GATEWAY_BAD_CONFIG ? 2 : 1;
    }
    cg_worker_ready(); /* --workers: tells the master; nothing without */
    rc = cg_gateway_run(&gw);
    /* Run until the handles the gateway and lws closed are gone, then close the loop. */
    uv_run(&loop, UV_RUN_DEFAULT);
    if (uv_loop_close(&loop) != 0)
        cg_warn("the event loop still had handles at exit");
    cg_config_free(&cfg);
    cg_info("stopped");
    return rc;
}
