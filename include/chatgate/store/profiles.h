#ifndef CHATGATE_STORE_PROFILES_H
#define CHATGATE_STORE_PROFILES_H
/*
 * profiles.h: users' profiles held in memory (docs/state.md, "The user's profile").
 *
 * A profile is what a user said about themselves ("call me Sam", "I live in Nairobi"):
 * named attributes, each a JSON value, shared by all of the user's rooms. It lives
 * lifetimes.profile_s after its last use (a read or a write renews it) and takes at most
 * profile_cap bytes as compact JSON.
 *
 * The memory store keeps its users' profiles here; the Redis store keeps its copies of what
 * Redis answered here, which answer while Redis is away. At most max_users profiles are held;
 * past it the least recently used goes (the table keeps its users in order of use).
 */
#include <jansson.h>
#include <stddef.h>
#include <stdint.h>

typedef struct cg_profiles cg_profiles;

/* The longest name of an attribute, and its bytes: letters, digits, '_', '-', '.'. */
#define CG_PROFILE_NAME_MAX 64

cg_profiles *cg_profiles_new(long max_users);
void cg_profiles_free(cg_profiles *p);

/*
 * Checks changes (an object of name -> value; null forgets the name) as a whole: 0, or -1
 * with err naming the first name that is not one. Nothing is applied.
 */
int cg_profile_check(json_t *changes, char *err, size_t errlen);
/* current with changes applied, as a new object (current may be NULL); NULL out of memory. */
json_t *cg_profile_apply(json_t *current, json_t *changes);
/* The profile's size as compact JSON ({} is 2). */
size_t cg_profile_size(json_t *profile);

/* user's profile at now (borrowed; NULL when none, or lapsed), its lifetime renewed to
 * now + ttl_s. */
json_t *cg_profiles_get(cg_profiles *p, const char *user, int64_t now, int64_t ttl_s);
/* Puts a copy of profile (an empty one removes it) as user's, living until now + ttl_s. */
void cg_profiles_put(cg_profiles *p, const char *user, json_t *profile, int64_t now, int64_t ttl_s);
/* Applies changes (checked: cg_profile_check) to user's profile, as long as the result takes
 * at most cap bytes: 0, or CG_E_TOO_LARGE (nothing changed), or CG_E_INTERNAL (out of
 * memory). *profile gets the profile after it (a new reference; NULL when there is none). */
int cg_profiles_update(cg_profiles *p, const char *user, json_t *changes, int64_t now, int64_t ttl_s, long cap,
                       json_t **profile);
/* Forgets user's profile. */
void cg_profiles_remove(cg_profiles *p, const char *user);
/* How many profiles are held. */
long cg_profiles_count(const cg_profiles *p);

#endif
