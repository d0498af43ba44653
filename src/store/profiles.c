/*
 * profiles.c: users' profiles in memory (profiles.h). One jansson object, user -> entry,
 * whose iteration order is the order of use: a use takes the user out and puts it back at
 * the end, so the first is the least recently used, the one that goes past max_users.
 */
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chatgate/core/alloc.h"
#include "chatgate/core/error.h"
#include "chatgate/store/profiles.h"

struct cg_profiles {
    json_t *users; /* user -> {"p": profile, "until": unix seconds} */
    long max_users;
};

cg_profiles *cg_profiles_new(long max_users)
{
    cg_profiles *p = cg_calloc(1, sizeof(*p));
    p->users = json_object();
    p->max_users = max_users > 0 ? max_users : 1;
    return p;
}

void cg_profiles_free(cg_profiles *p)
{
    if (!p)
        return;
    json_decref(p->users);
    free(p);
}

static int valid_name(const char *name)
{
    size_t n = strlen(name);
    if (n == 0 || n > CG_PROFILE_NAME_MAX)
        return 0;
    for (const char *s = name; *s; s++)
        if (!isalnum((unsigned char)*s) && *s != '_' && *s != '-' && *s != '.')
            return 0;
    return 1;
}

int cg_profile_check(json_t *changes, char *err, size_t errlen)
{
    if (!json_is_object(changes)) {
        snprintf(err, errlen, "a profile must be an object of name -> value (null forgets the name)");
        return -1;
    }
    const char *name;
    json_t *v;
    json_object_foreach(changes, name, v) {
        if (!valid_name(name)) {
            snprintf(err, errlen, "'%.80s' is not a profile name (1 to %d letters, digits, _ - .)", name,
                     CG_PROFILE_NAME_MAX);
            return -1;
        }
    }
    return 0;
}

json_t *cg_profile_apply(json_t *current, json_t *changes)
{
    json_t *out = current ? json_copy(current) : json_object();
    const char *name;
    json_t *v;
    json_object_foreach(changes, name, v) {
        if (!out)
            break;
        if (json_is_null(v))
            json_object_del(out, name);
        else if (json_object_set(out, name, v) < 0) {
            json_decref(out);
            out = NULL;
        }
    }
    return out;
}

size_t cg_profile_size(json_t *profile)
{
    return profile ? json_dumpb(profile, NULL, 0, JSON_COMPACT) : 2;
}

/* user's entry, moved to the end (the most recently used); NULL when none. */
static json_t *entry_used(cg_profiles *p, const char *user)
{
    json_t *e = json_object_get(p->users, user);
    if (!e)
        return NULL;
    json_incref(e);
    json_object_del(p->users, user);
    json_object_set_new(p->users, user, e);
    return e;
}

json_t *cg_profiles_get(cg_profiles *p, const char *user, int64_t now, int64_t ttl_s)
{
    json_t *e = entry_used(p, user);
    if (!e)
        return NULL;
    if (json_integer_value(json_object_get(e, "until")) <= now) {
        json_object_del(p->users, user);
        return NULL;
    }
    json_object_set_new(e, "until", json_integer((json_int_t)(now + ttl_s)));
    return json_object_get(e, "p");
}

void cg_profiles_put(cg_profiles *p, const char *user, json_t *profile, int64_t now, int64_t ttl_s)
{
    if (!json_is_object(profile) || json_object_size(profile) == 0) {
        json_object_del(p->users, user);
        return;
    }
    json_t *e = json_pack("{s:O, s:I}", "p", profile, "until", (json_int_t)(now + ttl_s));
    if (!e)
        return;
    json_object_del(p->users, user); /* put back at the end */
    if ((long)json_object_size(p->users) >= p->max_users) { /* the least recently used goes */
        void *first = json_object_iter(p->users);
        char *oldest = first ? cg_strdup(json_object_iter_key(first)) : NULL;
        if (oldest)
            json_object_del(p->users, oldest);
        free(oldest);
    }
    json_object_set_new(p->users, user, e);
}

int cg_profiles_update(cg_profiles *p, const char *user, json_t *changes, int64_t now, int64_t ttl_s, long cap,
                       json_t **profile)
{
    json_t *had = cg_profiles_get(p, user, now, ttl_s);
    json_t *next = cg_profile_apply(had, changes);
    if (!next || (long)cg_profile_size(next) > cap) {
        json_decref(next);
        *profile = had ? json_incref(had) : NULL;
        return next ? CG_E_TOO_LARGE : CG_E_INTERNAL;
    }
    cg_profiles_put(p, user, next, now, ttl_s);
    *profile = next;
    return 0;
}

void cg_profiles_remove(cg_profiles *p, const char *user)
{
    json_object_del(p->users, user);
}

long cg_profiles_count(const cg_profiles *p)
{
    return (long)json_object_size(p->users);
}
