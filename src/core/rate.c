/*
 * rate.c: a token bucket (see rate.h).
 */
#include "chatgate/core/rate.h"

void cg_rate_init(cg_rate *r, long burst, uint64_t now_ms)
{
    r->tokens = (double)burst;
    r->at_ms = now_ms;
}

int cg_rate_take(cg_rate *r, long per_second, long burst, uint64_t now_ms)
{
    if (now_ms > r->at_ms)
        r->tokens += (double)(now_ms - r->at_ms) * (double)per_second / 1000.0;
    if (r->tokens > (double)burst)
        r->tokens = (double)burst;
    r->at_ms = now_ms;
    if (r->tokens < 1.0)
        return 0;
    r->tokens -= 1.0;
    return 1;
}
