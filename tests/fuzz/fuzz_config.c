/*
 * fuzz_config.c: libFuzzer target for the config loader (config.c): any bytes as the text
 * of a --config file are loaded and checked as the gateway does at startup (defaults, the
 * file, then the checks, through cg_config_load_text). Each must load, or be refused with
 * a message naming the file, never crash, leak or hang; what loads must be usable.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "chatgate/config/config.h"
#include "chatgate/core/log.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static int init;
    if (!init) {
        cg_log_set_level(CG_LOG_ERROR);
        unsetenv("REDIS_URL");
        setenv("CHATGATE_JWT_SECRET", "fuzz-secret", 1); /* so that "auth": "jwt" loads */
        init = 1;
    }
    cg_config cfg;
    char err[1024];
    err[0] = 0;
    int rc = cg_config_load_text(&cfg, "fuzz.json", (const char *)data, size, err, sizeof(err));
    if (rc != 0) {
        if (rc != CG_CONFIG_EXIT_USAGE || strncmp(err, "fuzz.json", 9) != 0)
            __builtin_trap(); /* every refusal names the file */
    } else {
        if (!cfg.listen_host || cfg.listen_port < 1 || cfg.n_upstreams < 1 || cfg.default_index < 0 ||
            cfg.default_index >= cfg.n_upstreams || !cfg.redis_prefix || strpbrk(cfg.redis_prefix, "{}") ||
            !cfg.rules_dir || !cfg.web_dir || cfg.max_header_bytes < 1024 || cfg.max_header_bytes > 65535)
            __builtin_trap();
        for (int i = 0; i < cfg.n_upstreams; i++)
            if (!cfg.upstreams[i].name || !cfg.upstreams[i].url ||
                (cfg.upstreams[i].kind != CG_UPSTREAM_DEMO && (!cfg.upstreams[i].host || !cfg.upstreams[i].path)))
                __builtin_trap();
    }
    cg_config_free(&cfg);
    return 0;
}
