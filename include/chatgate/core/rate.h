/*
 * rate.h: a token bucket, the rate limit of a client connection (rate_limit.messages_per_second
 * and rate_limit.burst). The clock is passed in, so it is tested without a loop.
 */
#ifndef CHATGATE_CORE_RATE_H
#define CHATGATE_CORE_RATE_H

#include <stdint.h>

/* A token bucket; refilled from the clock the caller passes (milliseconds). */
typedef struct cg_rate {
    double tokens;
    uint64_t at_ms;
} cg_rate;

void cg_rate_init(cg_rate *r, long burst, uint64_t now_ms);
/* 1 and a token taken, or 0 when the bucket is empty (over the rate). */
int cg_rate_take(cg_rate *r, long per_second, long burst, uint64_t now_ms);

#endif
