/*
 * fuzz_rules_load.c: libFuzzer target for the rule-file loader: any bytes as one rule
 * file must load or be refused with a message, never crash, leak or hang; a set that
 * loads is also evaluated once and its own tests run.
 */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "chatgate/core/log.h"
#include "chatgate/dialog/rules.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static int init;
    if (!init) {
        cg_log_set_level(CG_LOG_ERROR);
        init = 1;
    }
    cg_ruleset *rs;
    char err[1024];
    if (cg_rules_load_text("fuzz.rules", (const char *)data, size, &rs, err, sizeof(err)) < 0) {
        if (strncmp(err, "fuzz.rules:", 11) != 0)
            __builtin_trap(); /* every refusal names the file and line */
        return 0;
    }
    cg_rules_result r;
    cg_rules_eval(rs, "Find flights from Nairobi to London on Feb 10", NULL, "previous", 1770112800, &r);
    cg_rules_result_free(&r);
    FILE *devnull = fopen("/dev/null", "w");
    cg_rules_check(rs, 1770112800, devnull, NULL);
    fclose(devnull);
    cg_ruleset_unref(rs);
    return 0;
}
