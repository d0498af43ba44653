/*
 * fuzz_pipeline.c: libFuzzer target for one message through the pipeline with the
 * shipped rules: the input is a client frame (as a client would send it); the first byte
 * also picks the awaiting state the dialog is in, so every resolver is reached.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "chatgate/core/log.h"
#include "chatgate/dialog/pipeline.h"
#include "chatgate/proto/protocol.h"
#include "chatgate/dialog/rules.h"

#define NOW 1770112800

static cg_ruleset *rules;
static cg_config cfg;

static void init(void)
{
    cg_log_set_level(CG_LOG_ERROR);
    char err[1024];
    if (cg_rules_load(CG_SOURCE_DIR "/rules", &rules, err, sizeof(err)) < 0) {
        fprintf(stderr, "%s\n", err);
        abort();
    }
    cfg.n_upstreams = 2;
    cfg.upstreams[0].name = "llm";
    cfg.upstreams[1].name = "app";
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!rules)
        init();
    if (size < 1)
        return 0;
    cg_client_frame f;
    char err[256];
    if (cg_protocol_parse((const char *)data + 1, size - 1, &f, err, sizeof(err)) < 0 || !f.text) {
        cg_client_frame_clear(&f);
        return 0;
    }
    cg_lifetimes lt;
    cg_lifetimes_default(&lt);
    cg_dialog d;
    cg_dialog_init(&d, NOW);
    static const char *const types[] = {NULL, "selection", "confirmation", "metadata", "input"};
    const char *type = types[data[0] % 5];
    if (type) {
        d.awaiting = json_pack("{s:s, s:[{s:s, s:s}, {s:s, s:s}], s:s}", "type", type, "options", "name", "Shake Shack",
                               "district", "Shibuya", "name", "Shake Shack", "district", "Shinjuku", "source", "app");
        d.awaiting_expires = NOW + 60;
    }
    cg_dialog_push_history(&d, "user", "What's the weather in Tokyo?", NOW - 10, &lt);
    d.service = strdup("travel");
    cg_pipeline_result res;
    cg_pipeline_run(&cfg, rules, &d, f.text, NOW, &lt, &res);
    cg_pipeline_result_free(&res);
    cg_dialog_free(&d);
    cg_client_frame_clear(&f);
    return 0;
}
