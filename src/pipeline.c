/*
 * pipeline.c: the per-message decisions of DESIGN.md section 1, step 3. For now the one
 * decision is the route: the default upstream. Rules (cancel, awaiting, params, enrichment,
 * route rules) plug in here.
 */
#include "chatgate/pipeline.h"

void cg_pipeline_run(const cg_config *cfg, const char *text, cg_pipeline_result *out)
{
    (void)text;
    out->route = cfg->default_index;
}
