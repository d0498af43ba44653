/*
 * main.c: reads the configuration, starts the gateway on a libuv loop and runs it.
 * Exit status: 0 after a clean stop, 1 when the server cannot start, 2 for a mistake in
 * the flags or the configuration file.
 */
#include <uv.h>

#include <stdio.h>

#include "chatgate/config.h"
#include "chatgate/gateway.h"
#include "chatgate/log.h"

int main(int argc, char **argv)
{
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
    cg_log_route_lws();

    uv_loop_t loop;
    uv_loop_init(&loop);
    static cg_gateway gw;
    srand((unsigned)(uv_hrtime() ^ (uint64_t)uv_os_getpid()));
    rc = cg_gateway_start(&gw, &cfg, &loop, err, sizeof(err));
    if (rc == CG_GATEWAY_BAD_CONFIG) {
        fprintf(stderr, "chatgate: %s\n", err);
        return 2;
    }
    if (rc < 0)
        return 1;
    rc = cg_gateway_run(&gw);
    /* Run until the handles the gateway and lws closed are gone, then close the loop. */
    uv_run(&loop, UV_RUN_DEFAULT);
    if (uv_loop_close(&loop) != 0)
        cg_warn("the event loop still had handles at exit");
    cg_config_free(&cfg);
    cg_info("stopped");
    return rc;
}
