/*
 * dialog.h: the state of one dialog (one user in one room), docs/state.md.
 *
 * Pure: JSON and numbers in, JSON and numbers out; the time is always passed in (unix
 * seconds), so the merge rules, expiry and history are unit-tested with any clock.
 *
 * A dialog's JSON parts (params, awaiting, soft context, tool result, usage, history items)
 * are values: once in a dialog, a part is never changed in place; every change makes a new
 * part and replaces the old one (the history array alone is a dialog's own, and a push
 * appends to it). So copies share their parts: the stores keep dialogs as structs (a save's
 * parts shared, cg_dialog_share; a load's parts shared too and its history array its own,
 * cg_dialog_copy), and a turn's changes to its copy never reach the store's before its save.
 * The Redis store reads its replies back with cg_dialog_adopt_json, and a
 * state file (`chatgate rules explain`) is read with cg_dialog_from_json, the form
 * cg_dialog_to_json writes.
 *
 * Params are kept per service ("travel" -> {"from": "Nairobi"}); what a message or a
 * backend adds is merged over what was kept (new > cached), and the service's configured
 * defaults lie under both when they are read (cg_dialog_params_merged), so a change of
 * defaults in the config shows at once.
 */
#ifndef CHATGATE_DIALOG_H
#define CHATGATE_DIALOG_H

#include <jansson.h>
#include <stdint.h>

#include "chatgate/config/config.h" /* cg_lifetimes */

typedef struct cg_dialog {
    char *service;            /* the active service, or NULL */
    json_t *params;           /* object: service -> object of name -> value */
    json_t *awaiting;         /* NULL or {type, options, context, source} */
    int64_t awaiting_expires; /* unix seconds */
    json_t *soft;             /* NULL or an object */
    int64_t soft_expires;
    json_t *history;          /* array of {role, content, ts}, oldest first */
    json_t *last_tool_result; /* NULL or any JSON */
    json_t *profile; /* the user's profile, for this turn's rules (`when profile`): borrowed from
                      * the turn, never kept, copied or freed with the dialog */
    int64_t created_at, last_activity;
    long turn_count, message_count;
    json_t *usage; /* NULL, or the tokens this dialog spent, by upstream:
                    * {"llm": {"in": N, "out": N, "turns": N}} (docs/configuration.md, "Usage") */
    /* cg_dialog_history_text's count, valid while history is text_of with text_n messages:
     * kept up to date by cg_dialog_push_history and cg_dialog_copy, counted again after
     * any other change */
    const json_t *text_of;
    size_t text_n, text_bytes;
} cg_dialog;

/* The bytes of the history's messages' content: a prompt's estimate when an upstream
 * reports no usage. Read at every call of an upstream, so kept from one message to the next
 * instead of read back from every message (a hash lookup into each, cold). */
size_t cg_dialog_history_text(cg_dialog *d);

/* Adds one turn's tokens, in (the prompt) and out (the reply), to d's usage of upstream. */
void cg_dialog_add_usage(cg_dialog *d, const char *upstream, long long in, long long out);

/* A new, empty dialog created at now. */
void cg_dialog_init(cg_dialog *d, int64_t now);
void cg_dialog_free(cg_dialog *d);
/*
 * Copies src into dst (uninitialised): the parts shared (new references), the history a new
 * array of the same items, so that dst can push to it. 0, or -1 out of memory (dst empty).
 */
int cg_dialog_copy(cg_dialog *dst, const cg_dialog *src);
/*
 * dst shares src's parts (new references; the service's name copied): for a dialog that
 * neither side changes afterwards, as a store keeps a saved one. 0, or -1 out of memory
 * (dst empty).
 */
int cg_dialog_share(cg_dialog *dst, const cg_dialog *src);
/* About what d weighs as compact JSON, counted without building it (memory store bound). */
size_t cg_dialog_weight(const cg_dialog *d);
/* The same without the history (the weight is this, 2, and each message's share of it). */
size_t cg_dialog_weight_but_history(const cg_dialog *d);
/* The parts cg_dialog_weight_but_history weighs: params, awaiting, soft context, last tool
 * result, usage. */
#define CG_DIALOG_PARTS 5
/*
 * cg_dialog_weight_but_history, each part's share into w; a part d shares with had (the same
 * pointer: parts are values, dialog.h's rule) takes its weight from had_w instead of being
 * measured again. had and had_w may be NULL. The memory store keeps w with its copy.
 */
size_t cg_dialog_weight_parts(const cg_dialog *d, const cg_dialog *had, const size_t *had_w, size_t w[CG_DIALOG_PARTS]);
size_t cg_dialog_history_item_weight(json_t *m);
/*
 * How history goes on from had, a copy of it kept earlier: the number of had's last messages
 * it starts with (the window of history_n may have moved past the first ones), the rest of it
 * new; -1 when it does not go on from had (cleared, or another dialog's). Messages are
 * compared by pointer, as nobody changes one once pushed. What a store keeps can then be
 * brought up to date with the new messages alone.
 */
long cg_dialog_history_kept(json_t *had, json_t *history);
/* Drops awaiting and soft context whose time is up. */
void cg_dialog_expire(cg_dialog *d, int64_t now);
/* d as a store gives it back at now: cg_dialog_expire, and params and history emptied when
 * their lifetimes (ending at params_exp and history_exp) ran out. The rule of the memory
 * store (Redis's keys expire the same), shared with `rules replay`. */
void cg_dialog_lapse(cg_dialog *d, int64_t now, int64_t params_exp, int64_t history_exp);

/*
 * Merges params (an object of name -> value; a null value forgets the name) into service.
 * Refuses the whole update with CG_E_TOO_LARGE, changing nothing, when the dialog's params
 * would pass lt->params_cap bytes of JSON; err then says by how much.
 */
int cg_dialog_merge_params(cg_dialog *d, const char *service, json_t *params, const cg_lifetimes *lt,
                           char *err, size_t errlen);
/*
 * The same for several services at once (by_service: service -> params), all or nothing:
 * the cap applies to the result of every merge, and on any error d is left as it was.
 */
int cg_dialog_merge_all_params(cg_dialog *d, json_t *by_service, const cg_lifetimes *lt, char *err, size_t errlen);
/* defaults < kept params of service, as a new object (never NULL). */
json_t *cg_dialog_params_merged(const cg_dialog *d, const char *service, json_t *defaults);
/* Forgets "service.name" keys, or names in the active service; returns how many went. */
int cg_dialog_forget(cg_dialog *d, json_t *keys);

/*
 * Applies a backend's state directive (docs/state.md): service, params, awaiting
 * (null clears; ttl in seconds optional), soft_context (null clears; ttl optional),
 * last_tool_result. source names the upstream that sent it (awaiting and soft context
 * remember it). Returns 0, or CG_E_TOO_LARGE / CG_E_BAD_FRAME (CG_E_INTERNAL out of
 * memory) with err; a refused directive changes nothing.
 */
int cg_dialog_apply_directive(cg_dialog *d, json_t *state, const char *source, int64_t now,
                              const cg_lifetimes *lt, char *err, size_t errlen);

/*
 * Appends one message ({"role", "content", "ts"}) to the history, keeping the last
 * lt->history_n. Returns it (d's), for the caller's marks (enriched, upstream, ...), set on it
 * before anyone else sees it (history items never change once shared); NULL when out of
 * memory or kept out (history_n 0). Marks set so, not handed in as an object to merge,
 * cost a turn no objects of their own (json_pack and json_object_update, callgrind, issue 39).
 */
json_t *cg_dialog_push_history(cg_dialog *d, const char *role, const char *content, int64_t ts,
                               const cg_lifetimes *lt);

/*
 * Merges two copies of one dialog that went separate ways (two gateways served it while the
 * store was switching, or a write-back meets a copy written meanwhile) into into: the
 * history is the union of both, each message once (the same role, content, time and marks;
 * one said twice is two: each of into's stands for one of other's),
 * into's in its order and other's turns it lacks each put whole before into's first turn that
 * began after it, cut to lt->history_n; a param set on both sides
 * takes the value of the copy active last, a param on one side is kept; awaiting, soft
 * context, service and the last tool result come from the copy active last, or from the one
 * that has them (a copy begun from nothing has none: no decision to drop the other's); counts and usage
 * take the larger of the two; created_at the earlier, last_activity the later. Returns how
 * many of other's messages were missing from into (0 when into held them all), or -1 out of
 * memory (into unchanged).
 */
long cg_dialog_merge(cg_dialog *into, const cg_dialog *other, const cg_lifetimes *lt);
/* b goes on from a: a's last message is one of b's, before b's last (b's turns came after
 * every turn of a, though the window of history_n may have cut a's older ones from b). A
 * merge of the two is then no conflict: a holds no turn b lacks. */
int cg_dialog_goes_on_from(const cg_dialog *b, const cg_dialog *a);

/* The state as the client's context frame shows it (docs/protocol.md, "Server frames"). New reference. */
json_t *cg_dialog_context(const cg_dialog *d);
/* Everything, expiry times included, for a store. New reference; NULL out of memory. */
json_t *cg_dialog_to_json(const cg_dialog *d);
/* Reads what cg_dialog_to_json wrote; missing or wrong-typed parts are left empty. */
void cg_dialog_from_json(cg_dialog *d, json_t *j, int64_t now);
/* The same, sharing j's parts instead of copying them: for a j built for this and dropped
 * right after (a store's load), which nobody changes afterwards. */
void cg_dialog_adopt_json(cg_dialog *d, json_t *j, int64_t now);

/* A short text of the state (tool_result: cg_dialog_tool_result's; profile: the user's, what
 * they said about themselves in any room), and of what this message
 * resolved and carries, for an LLM's system message; malloc'd, "" when there is nothing. JSON
 * arguments may be NULL. */
char *cg_dialog_summary(const cg_dialog *d, json_t *merged_params, json_t *tool_result, json_t *profile,
                        json_t *resolution, json_t *annotations);
/* The last tool result as it goes back to a backend (borrowed), or NULL when there is none or
 * it takes more than lt->tool_result_cap bytes (kept before the cap was checked on write). */
json_t *cg_dialog_tool_result(const cg_dialog *d, const cg_lifetimes *lt);

#endif
