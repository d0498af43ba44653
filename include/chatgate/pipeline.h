/*
 * pipeline.h: what the gateway decides about one message before it goes upstream.
 *
 * DESIGN.md section 1, step 3: cancel rules, awaiting resolution, extraction, merge, soft
 * context, enrichment, route. Rules and dialog state arrive in later versions; today the
 * pipeline only routes, to the default upstream. It is pure: no I/O, no clock.
 */
#ifndef CHATGATE_PIPELINE_H
#define CHATGATE_PIPELINE_H

#include "chatgate/config.h"

typedef struct cg_pipeline_result {
    int route; /* index into the configured upstreams */
} cg_pipeline_result;

void cg_pipeline_run(const cg_config *cfg, const char *text, cg_pipeline_result *out);

#endif
