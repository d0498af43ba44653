/*
 * limits_config.c: the "limits" section, checked whole at load (limits_config.h), and the
 * plan of a connection.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chatgate/core/alloc.h"
#include "chatgate/config/limits_config.h"

/* One key of a plan: its place in cg_limits. */
typedef struct limit_key {
    const char *name;
    long long max;
} limit_key;

static const limit_key limit_keys[] = {
    {"messages_per_minute", 1000000},
    {"turns_at_once", 100000},
    {"tokens_per_minute", 1000000000000LL},
    {"tokens_per_day", 1000000000000LL},
};

static void limit_set(cg_limits *lim, size_t i, long long v)
{
    if (i == 0)
        lim->messages_per_minute = (long)v;
    else if (i == 1)
        lim->turns_at_once = (long)v;
    else if (i == 2)
        lim->tokens_per_minute = v;
    else
        lim->tokens_per_day = v;
}

/* Key of a plan object (where: "limits" or "limits.plans.NAME"): 1 if it was a limit, 0 if
 * not one, -1 (err) when its value is wrong. */
static int load_limit(cg_limits *lim, const char *file, const char *where, const char *key, json_t *v, char *err,
                      size_t errlen)
{
    for (size_t i = 0; i < sizeof(limit_keys) / sizeof(limit_keys[0]); i++) {
        if (strcmp(key, limit_keys[i].name) != 0)
            continue;
        if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > limit_keys[i].max) {
            snprintf(err, errlen, "%s: %s.%s: must be a whole number from 0 (no limit) to %lld", file, where, key,
                     limit_keys[i].max);
            return -1;
        }
        limit_set(lim, i, (long long)json_integer_value(v));
        return 1;
    }
    return 0;
}

static int load_plans(cg_limits_config *lc, const char *file, json_t *plans, char *err, size_t errlen)
{
    if (!json_is_object(plans)) {
        snprintf(err, errlen, "%s: limits.plans: must be an object of plan name -> {limits}", file);
        return -1;
    }
    const char *name;
    json_t *plan;
    json_object_foreach(plans, name, plan) {
        if (!*name || strlen(name) > CG_MAX_PLAN_NAME || strcmp(name, "default") == 0) {
            snprintf(err, errlen,
                     "%s: limits.plans.%s: a plan's name is 1 to %d bytes and not \"default\" (the section's own keys)",
                     file, name, CG_MAX_PLAN_NAME);
            return -1;
        }
        if (!json_is_object(plan) || lc->n_plans == CG_MAX_PLANS) {
            snprintf(err, errlen, "%s: limits.plans.%s: must be an object of limits (at most %d plans)", file, name,
                     CG_MAX_PLANS);
            return -1;
        }
        cg_limit_plan *p = &lc->plans[lc->n_plans];
        p->limits = lc->base; /* the keys a plan leaves out */
        char where[96];
        snprintf(where, sizeof(where), "limits.plans.%s", name);
        const char *key;
        json_t *v;
        json_object_foreach(plan, key, v) {
            int rc = load_limit(&p->limits, file, where, key, v, err, errlen);
            if (rc < 0)
                return -1;
            if (rc == 0) {
                snprintf(err, errlen, "%s: %s.%s: unknown key (a plan sets messages_per_minute, turns_at_once, "
                         "tokens_per_minute, tokens_per_day)", file, where, key);
                return -1;
            }
        }
        p->name = cg_strdup(name);
        lc->n_plans++;
    }
    return 0;
}

static const cg_limits *plan_named(const cg_limits_config *lc, const char *name)
{
    if (strcmp(name, "default") == 0)
        return &lc->base;
    for (int i = 0; i < lc->n_plans; i++)
        if (strcmp(lc->plans[i].name, name) == 0)
            return &lc->plans[i].limits;
    return NULL;
}

static int check_users(const cg_limits_config *lc, const char *file, json_t *users, char *err, size_t errlen)
{
    if (!json_is_object(users)) {
        snprintf(err, errlen, "%s: limits.users: must be an object of user id -> plan name", file);
        return -1;
    }
    const char *user;
    json_t *plan;
    json_object_foreach(users, user, plan) {
        if (!json_is_string(plan) || !plan_named(lc, json_string_value(plan))) {
            snprintf(err, errlen, "%s: limits.users.%s: must name a plan of limits.plans, or \"default\"", file, user);
            return -1;
        }
    }
    return 0;
}

int cg_limits_config_load(cg_limits_config *lc, const char *file, json_t *val, char *err, size_t errlen)
{
    cg_limits_config_free(lc);
    if (!json_is_object(val)) {
        snprintf(err, errlen, "%s: limits: must be an object", file);
        return -1;
    }
    const char *key;
    json_t *v;
    json_object_foreach(val, key, v) { /* the default plan first: the named plans start from it */
        int rc = load_limit(&lc->base, file, "limits", key, v, err, errlen);
        if (rc < 0)
            goto fail;
        if (rc == 1 || strcmp(key, "plans") == 0 || strcmp(key, "users") == 0)
            continue;
        if (strcmp(key, "plan_claim") == 0 && json_is_string(v) && json_string_length(v) > 0) {
            lc->plan_claim = cg_strdup(json_string_value(v));
            continue;
        }
        snprintf(err, errlen,
                 strcmp(key, "plan_claim") == 0 ? "%s: limits.%s: must be the name of a JWT claim"
                                                : "%s: limits.%s: unknown key",
                 file, key);
        goto fail;
    }
    json_t *plans = json_object_get(val, "plans"), *users = json_object_get(val, "users");
    if ((plans && load_plans(lc, file, plans, err, errlen) < 0) || (users && check_users(lc, file, users, err, errlen) < 0))
        goto fail;
    lc->users = json_incref(users);
    return 0;
fail:
    cg_limits_config_free(lc);
    return -1;
}

void cg_limits_config_free(cg_limits_config *lc)
{
    for (int i = 0; i < lc->n_plans; i++)
        free(lc->plans[i].name);
    free(lc->plan_claim);
    json_decref(lc->users);
    memset(lc, 0, sizeof(*lc));
}

const cg_limits *cg_limits_for(const cg_limits_config *lc, const char *user, const char *plan, int *warn)
{
    const char *name = json_string_value(json_object_get(lc->users, user));
    *warn = 0;
    if (!name)
        name = plan && *plan ? plan : "default";
    const cg_limits *lim = plan_named(lc, name);
    if (!lim) {
        *warn = 1;
        lim = &lc->base;
    }
    return cg_limits_any(lim) ? lim : NULL;
}
