/*
 * limits_config.h: the "limits" section of the config file (docs/configuration.md, "Limits per user"):
 * the default plan's limits, named plans that override some of them, and how a
 * connection's plan is found: the operator's own list of users first, then a JWT claim.
 *
 *   "limits": {
 *     "messages_per_minute": 20, "turns_at_once": 2,
 *     "tokens_per_minute": 20000, "tokens_per_day": 200000,
 *     "plan_claim": "plan",
 *     "plans": {"pro": {"messages_per_minute": 120, "tokens_per_day": 0}},
 *     "users": {"ops-bot": "pro"}
 *   }
 *
 * 0 is no limit; a plan's missing keys are the default plan's.
 */
#ifndef CHATGATE_CONFIG_LIMITS_CONFIG_H
#define CHATGATE_CONFIG_LIMITS_CONFIG_H

#include <jansson.h>
#include <stddef.h>

/* One plan's limits; 0: no limit. */
typedef struct cg_limits {
    long messages_per_minute;
    long turns_at_once;
    long long tokens_per_minute;
    long long tokens_per_day;
} cg_limits;

/* 1 when any of lim's limits is set. */
static inline int cg_limits_any(const cg_limits *lim)
{
    return lim->messages_per_minute > 0 || lim->turns_at_once > 0 || lim->tokens_per_minute > 0 ||
           lim->tokens_per_day > 0;
}

#define CG_MAX_PLANS 64
#define CG_MAX_PLAN_NAME 64

typedef struct cg_limit_plan {
    char *name;
    cg_limits limits;
} cg_limit_plan;

typedef struct cg_limits_config {
    cg_limits base;     /* the plan "default" */
    char *plan_claim;   /* the JWT claim naming a connection's plan, or NULL */
    cg_limit_plan plans[CG_MAX_PLANS];
    int n_plans;
    json_t *users;      /* user id -> plan name (checked to exist), or NULL */
} cg_limits_config;

/* Loads the section (val) into lc, replacing what it held; 0, or -1 with
 * "file: limits.key: message" in err. */
int cg_limits_config_load(cg_limits_config *lc, const char *file, json_t *val, char *err, size_t errlen);
void cg_limits_config_free(cg_limits_config *lc);

/* The plan a connection is held to, by the operator's list of users, then the plan its
 * token named (NULL or "": none); unknown names are the default plan (warn set to 1 then).
 * NULL when that plan sets no limit: nothing to count. */
const cg_limits *cg_limits_for(const cg_limits_config *lc, const char *user, const char *plan, int *warn);

#endif
