/*
 * redis_dialog.c: the Redis store's dialog operations (load, save, remove, forget a user)
 * and the tables of its four jobs: the keys, the scripts and their arguments, and reading
 * the replies. The link they travel over is redis_link.c's; what it could not do it answers
 * "unavailable", and degraded mode (fallback.c, in front of the store) answers from memory
 * then; what the Redis store's files share is in chatgate/store/redis_internal.h.
 *
 * Layout (docs/state.md), the user's hash tag on every key, so a user's dialogs, their
 * leases and the rooms set live on one shard (one cluster slot):
 *   P:{U}:R:state     HASH  "rev": the version of the dialog that the last save wrote
 *                           (docs/state.md, "The gateway's copy"), created_at, last_activity,
 *                           and "v": the rest of the dialog but its history as one JSON value
 *                           (params, service, counts, awaiting, soft context, last tool
 *                           result, usage, and when its params and the rest lapse), EXPIRE
 *                           the longest of params_s and dialog_s
 *   P:{U}:R:history   LIST  JSON messages, oldest first, EXPIRE 30 min
 *   P:{U}:R:lock      STRING the lease: the ticket "<holder>#<n>" of the turn that has the
 *                           dialog (PX redis.lease_ms), marked " w" while turns of other
 *                           gateways wait; deleted once let go, or "-<ticket> w" (EX
 *                           dialog_s) when turns still wait
 *   P:{U}:R:line      HASH  those turns' tickets, in order
 *   P:{U}:R:cancel    STRING set by another gateway to stop the lease holder's turn (its ticket)
 *   P:{U}:R:params, dialog, awaiting, soft: the dialog of versions before the state, a
 *                           key a part: read once by a load that finds no state, and deleted
 *   P:{U}:R:fence     STRING a fence counter of versions before the lock: only deleted
 *   P:{U}:rooms       ZSET  the user's rooms scored by their last save that rewrote or renewed
 *                           the lifetimes (ms; within 30 s by default), for "forget this
 *                           user" without SCAN and max_rooms_per_user
 * Every dialog operation but a turn's common load is one script on those keys, sent as
 * EVALSHA (and once as EVAL when the server answers NOSCRIPT): a load takes the lease, then
 * reads; a save checks the lease, writes the dialog and the rooms set, and lets go of the
 * lease. So it runs on a single Redis, behind twemproxy (which refuses MULTI) and on one
 * cluster slot, in one command and one round trip. A turn's load while the gateway holds a
 * copy is plain commands, pipelined (SET NX PX, HGET rev, EXISTS of the history); the load script
 * runs only when they do not all say yes (send_plain_load). (The gateway holds the whole
 * dialog for the turn, so rewriting is simpler than HSET/HDEL deltas and gives the same
 * keys.)
 *
 * Two things spare a turn most of that work (docs/state.md, "The gateway's copy"). Every
 * save writes a new rev, unique to this store, and the memory store keeps the gateway's copy
 * under it: a load names that rev, and Redis answers "same" instead of the dialog when its
 * copy is that one, so the dialog is not read, sent and parsed again. And a save whose
 * history is that copy's plus new messages appends them (RPUSH, LTRIM) instead of
 * rewriting the list, refused (-3) and merged with Redis's copy when Redis's rev is another.
 *
 * A save is conditional, inside its script: Redis's copy is kept when it is another
 * incarnation of the dialog (its created_at differs: this gateway loaded a fresh dialog
 * while Redis was away, and Redis still has the real one), and a write-back after an outage
 * is also refused when Redis's copy is newer (last_activity). A refused save is merged with
 * Redis's copy, read again, and written over the rev read (mode 3); after MERGE_TRIES
 * refusals it stays in memory for the write-back (merges_spent).
 */
#define _GNU_SOURCE /* asprintf */
#include <hiredis/hiredis.h>

#include <openssl/evp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "chatgate/core/alloc.h"
#include "chatgate/core/jsonout.h"
#include "chatgate/core/log.h"
#include "chatgate/core/num.h"
#include "chatgate/store/store.h"
#include "chatgate/store/redis_argv.h"
#include "chatgate/store/redis_internal.h"

static void on_rooms_reply(cg_redis_conn *ac, void *reply_, void *priv);
static void on_room_list(cg_redis_conn *ac, void *reply_, void *priv);

/* A command before r's last: its reply only says whether it failed. */
static void on_step_reply(cg_redis_conn *ac, void *reply_, void *priv)
{
    (void)ac;
    redis_req *r = priv;
    redisReply *reply = reply_;
    if (!reply || reply->type == REDIS_REPLY_ERROR) {
        if (reply)
            cg_warn("redis %s:%d: %s", r->rs->host, r->rs->port, reply->str);
        r->step_failed = 1;
    }
    r->steps--;
    if (r->finished && r->steps == 0)
        cg_redis_req_finish(r);
}

static void send_step(redis_store *rs, cg_argv *a, redis_req *r)
{
    r->steps++; /* before: a write that fails at once answers from inside the send */
    if (cg_redis_send_argv(rs, a, on_step_reply, r) < 0) {
        r->steps--;
        r->step_failed = 1;
    }
}

/* Sends r's last command; r is answered "unavailable" if that fails. */
static void send_last(redis_store *rs, cg_argv *a, cg_redis_reply_fn *fn, redis_req *r)
{
    if (cg_redis_send_argv(rs, a, fn, r) < 0) {
        rs->base.stats.errors++;
        cg_redis_answer_later_unavailable(r);
        return;
    }
}

/*
 * A dialog's keys (docs/state.md, "Redis layout"): its state (one hash: rev, created_at,
 * last_activity and the rest as one JSON value, v), its history, its lock (the lease), the
 * line of turns of other gateways waiting for it, and the flag another gateway sets to
 * cancel its turn. Then the keys of the layout before issue 39's ninth round (params, dialog,
 * awaiting, soft: read by a load that finds no state, once, after an upgrade) and the fence
 * counter of versions before the lock: deleted with the dialog, never written.
 */
enum { K_STATE, K_HISTORY, K_LOCK, K_LINE, K_PARAMS, K_DIALOG, K_AWAITING, K_SOFT, K_CANCEL, K_FENCE, K_COUNT };
static const char *const parts[K_COUNT] = {"state",  "history",  "lock", "line",   "params",
                                           "dialog", "awaiting", "soft", "cancel", "fence"};

/* Keys of the dialog, in the order a script numbers them (KEYS[1] first). */
typedef struct key_list {
    unsigned char n, at[K_COUNT];
} key_list;

/* Every key of a dialog: a deleted dialog leaves nothing of the user behind (a turn of it
 * running meanwhile keeps its entry in rs->leases, so its save still refuses to write over
 * another holder's lease). */
static const key_list all_keys = {K_COUNT, {0, 1, 2, 3, 4, 5, 6, 7, 8, 9}};

/* The dialog's (eu, er) keys of list, as arguments: a script's KEYS, or a DEL's. */
static void arg_dialog_keys(redis_store *rs, cg_argv *a, const char *eu, const char *er, const key_list *list)
{
    /* the first whole; the others copy its stem, "<prefix>:{<eu>}:<er>:" (two scripts a turn:
     * measuring and copying the pieces again for every key was 3,700 instructions) */
    const char *first = parts[list->at[0]];
    cg_argv_key(a, rs->base.cfg.prefix, eu, er, first);
    size_t stem = cg_argv_key_stem_len(rs->base.cfg.prefix, eu, er);
    size_t from = a->w.used - 2 - strlen(first) - stem; /* the first's bytes end at its CRLF */
    for (int k = 1; k < list->n; k++) {
        const char *part = parts[list->at[k]];
        size_t pl = strlen(part);
        cg_argv_known(a, stem + pl);
        if (a->w.used + stem >= a->w.cap)
            cg_jsonw_grow(&a->w, stem);
        memcpy(a->w.buf + a->w.used, a->w.buf + from, stem); /* from lies before: no overlap */
        a->w.used += stem;
        cg_jsonw_raw(&a->w, part, pl);
        cg_argv_done(a);
    }
}

/* ---- scripts: EVALSHA, and EVAL once when the server does not know the script ----------- */

typedef enum { S_LOAD, S_SAVE, S_RENEW, S_RELEASE, S_CANCEL, S_LIMIT, S_LIMIT_END, S_ROOMS, S_COUNT } script_id;
static const char *script_text(script_id id);

/* A save that met another copy of its dialog merges with it (merge_start), at most this often. */
#define MERGE_TRIES 4
struct redis_req;
static void merge_start(redis_store *rs, redis_req *r);
static char script_sha[S_COUNT][41];

void cg_redis_scripts_init(void)
{
    if (script_sha[0][0])
        return;
    for (int i = 0; i < S_COUNT; i++) {
        unsigned char md[EVP_MAX_MD_SIZE];
        unsigned int n = 0;
        const char *text = script_text((script_id)i);
        if (!EVP_Digest(text, strlen(text), md, &n, EVP_sha1(), NULL) || n != 20)
            abort();
        for (unsigned int k = 0; k < n; k++)
            snprintf(script_sha[i] + 2 * k, 3, "%02x", md[k]);
    }
}

/* The dialog's keys a script is given, those it uses only (Redis wants every key a script
 * touches named, and a key passed is a string Redis's Lua makes, hashing each of its bytes,
 * at every call: docs/state.md, "What the scripts cost Redis"); the save's are followed by
 * the user's rooms set. */
static const key_list script_keys[S_COUNT] = {
    [S_LOAD] = {8, {K_STATE, K_HISTORY, K_LOCK, K_LINE, K_PARAMS, K_DIALOG, K_AWAITING, K_SOFT}},
    [S_SAVE] = {3, {K_STATE, K_HISTORY, K_LOCK}},
    [S_RENEW] = {2, {K_LOCK, K_CANCEL}},
    [S_RELEASE] = {1, {K_LOCK}},
    [S_CANCEL] = {2, {K_LOCK, K_CANCEL}},
};

/* EVALSHA <sha> <n> <the dialog's keys of the script> [<the rooms set>: the save's], every
 * key under the user's hash tag */
static void arg_script(redis_store *rs, cg_argv *a, script_id id, const char *eu, const char *er)
{
    int rooms = id == S_SAVE;
    cg_argv_str(a, "EVALSHA");
    cg_argv_str(a, script_sha[id]);
    cg_argv_int(a, script_keys[id].n + rooms);
    arg_dialog_keys(rs, a, eu, er, &script_keys[id]);
    if (rooms)
        cg_argv_key(a, rs->base.cfg.prefix, eu, NULL, "rooms");
}

/* Sends a script command built in a (taken): by SHA, and once more as EVAL with its text
 * when the node answers NOSCRIPT (redis_link.c); 0, or -1 when the link refused it. */
static int send_script(redis_store *rs, script_id id, cg_argv *a, cg_redis_reply_fn *fn, void *priv)
{
    size_t len;
    const char *cmd = cg_argv_framed(a, &len);
    int rc = cmd ? cg_redis_link_script(rs->link, a->slot, cmd, len, script_text(id), fn, priv) : -1;
    cg_argv_free(a);
    return rc;
}

/* Sends r's script; r is answered "unavailable" if that fails. */
static void dispatch(redis_store *rs, redis_req *r);

static int send_last_script(redis_store *rs, script_id id, cg_argv *a, cg_redis_reply_fn *fn, redis_req *r)
{
    if (send_script(rs, id, a, fn, r) < 0) {
        rs->base.stats.errors++;
        cg_redis_answer_later_unavailable(r);
        return -1;
    }
    return 0;
}

/*
 * A save in flight holds back later loads of its dialog until it is answered. Pipelining
 * them behind it would be in order on one Redis, but a save answered NOSCRIPT (a restarted
 * or failed-over Redis, a shard behind twemproxy that had not seen the script) goes again as
 * EVAL after them: the next turn would read the dialog without this save, and its lease
 * would make this save fail. rs->saving counts the saves in flight per dialog key; the held
 * loads wait in rs->gated and go when their dialog has none.
 *
 * But a turn's load behind one plain save (a turn's, not a merge or a write-back: the
 * common case, a client's next message right after its done) goes at once, on the same
 * connection, asking about the rev that save writes (rs->save_next): Redis runs the two in
 * order, the save's answer updates the gateway's copy before the load's answer is read, and
 * the load answers "same" from it; one round trip instead of two. Should the load's answer
 * come while the save is still unanswered (it went again as EVAL after NOSCRIPT, or turned
 * into a merge), that answer read Redis before the save: it is dropped, and the load goes
 * again, behind the save sent again or at the gate (on_load_reply).
 */
static size_t params_count(json_t *params);

static void gate_enter(redis_store *rs, const char *key)
{
    json_t *n = json_object_get(rs->saving, key);
    json_object_set_new(rs->saving, key, json_integer(n ? json_integer_value(n) + 1 : 1));
    if (n) /* more than one save in flight: a load waits for them all */
        json_object_del(rs->save_next, key);
}

/* r, a plain save, is in flight alone for its dialog: what the copy will be once answered. */
static void gate_note_plain(redis_store *rs, const redis_req *r)
{
    json_t *n = json_object_get(rs->saving, r->key);
    if (!n || json_integer_value(n) != 1 || !r->rev)
        return;
    json_t *next = json_object();
    json_object_set_new(next, "rev", json_string(r->rev));
    json_object_set_new(next, "p", json_integer((json_int_t)params_count(r->snapshot->params)));
    json_object_set_new(next, "h", json_integer((json_int_t)json_array_size(r->snapshot->history)));
    json_object_set_new(rs->save_next, r->key, next);
}

static void gate_leave(redis_store *rs, const char *key)
{
    json_t *n = json_object_get(rs->saving, key);
    if (n && json_integer_value(n) > 1) {
        json_object_set_new(rs->saving, key, json_integer(json_integer_value(n) - 1));
        return;
    }
    json_object_del(rs->saving, key);
    json_object_del(rs->save_next, key);
    redis_req **pp = &rs->gated;
    while (*pp) { /* the held loads of this dialog go now, in their order */
        redis_req *r = *pp;
        if (strcmp(r->key, key) != 0) {
            pp = &r->wait_next;
            continue;
        }
        *pp = r->wait_next;
        r->wait_next = NULL;
        dispatch(rs, r);
        if (json_object_get(rs->saving, key)) /* cannot happen (loads do not save): stay safe */
            break;
    }
}

/* 1 when r (a load) must wait for a save of its dialog; it is held then. */
static int gated(redis_store *rs, redis_req *r)
{
    if (!json_object_get(rs->saving, r->key))
        return 0;
    redis_req **pp = &rs->gated;
    while (*pp)
        pp = &(*pp)->wait_next;
    *pp = r;
    return 1;
}

/* ---- load ------------------------------------------------------------------------------ */

/*
 * The dialog's lock is its lease (docs/state.md, "The dialog lease"): the turn's
 * ticket, "<holder>#<n>" (unique: the holder id has a random part, n counts its turns),
 * while the turn holds it (PX redis.lease_ms); once its save or release let it go, the lock
 * is deleted, or, while turns of other gateways wait in the line, "-<ticket> w"
 * (EX dialog_s; a holder id never begins with '-'). A held lock ends in " w" too while they
 * wait: only then, or when the lock is gone, does a load look at the line. So the load
 * script takes the lease in two calls (GET, SET; a turn's common load, send_plain_load,
 * in one SET NX) where the
 * lease, a fence counter (INCR) and the line's EXISTS were four (issue 39), and the lease
 * needs no number made in Lua: a lease's ticket names it wherever a fence did (a save's
 * check, the cancel flag). The common path reads the lock with string.byte and a plain
 * find: no Lua pattern, no number (callgrind of the replay, tests/bench/script_cost.sh).
 */

/* Lua: the lock read, `cur`, is the lease v (an expression), marked " w" or not. */
#define LUA_LOCK_IS(v) "(cur == " v " or cur == " v " .. ' w')"
/* Lua: the holder part, "<holder>#", of the lease v (a holder id holds no '#'): what begins
 * every ticket and rev of that holder. A pattern match: only off the common path. */
#define LUA_HOLDER_OF(v) "(string.match(" v ", '^[^#]*#') or " v ")"

/*
 * The load, one atomic step, on KEYS: 1 state, 2 history, 3 lock, 4 line, and 5-8 the parts
 * of the layout before the state (params, dialog, awaiting, soft). The dialog's lease (when
 * ARGV[1], the holder, is not empty), then the reads. A lease held by another holder answers
 * {"busy", its value, its PTTL} and reads nothing; else the lease is ARGV[5], the turn's
 * ticket, for ARGV[2] ms. The answer is the lease ("" when none was asked), then the state
 * hash's fields and the history; or, when ARGV[3] names the rev of the copy this gateway
 * holds and Redis's copy is that one, the lease and "same". Redis's copy is that one when its
 * state has that rev, and its history list is there when the copy has messages (ARGV[4]
 * "1"; "0" when it has none): a list lapsed or evicted alone. A dialog with no state but
 * parts of the layout before it (written before an upgrade) is read from those once: the
 * lease, then the four parts and the history (six elements), and its next save writes the
 * state (docs/state.md, "Upgrading").
 * ARGV[6], "1", comes with a turn that waited in line before: it looks for its place there
 * even when the lock does not say anyone waits (a save that found its lock lapsed lets go
 * unmarked). A turn's own lease, met again (its load sent again: a full read, behind a
 * save), is kept without a look at the line. The line's deadlines are Redis's clock (TIME,
 * after redis.replicate_commands(), which Redis 4 needs before a write that follows it).
 */
static const char load_script[] =
    "local lease = ''\n"
    "if ARGV[1] ~= '' then\n"
    "  local line, ticket = KEYS[4], ARGV[5]\n"
    "  local function queue(now)\n" /* takes (or keeps, renewed) this turn's place in line */
    "    local had = redis.call('HGET', line, ticket)\n"
    "    local seq = had and string.match(had, '^%d+') or redis.call('HINCRBY', line, '#', 1)\n"
    "    redis.call('HSET', line, ticket, seq .. ' ' .. string.format('%d', now + 10000))\n"
    "    redis.call('PEXPIRE', line, 20000)\n"
    "  end\n"
    "  local function clock()\n" /* Redis's, in ms, for the line's deadlines (before any write) */
    "    redis.replicate_commands()\n"
    "    local t = redis.call('TIME')\n"
    "    return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)\n"
    "  end\n"
    "  local cur = redis.call('GET', KEYS[3])\n"
    "  local marked = cur and string.byte(cur, -1) == 119\n" /* " w" (a ticket ends in a digit) */
    "  if cur and string.byte(cur, 1) ~= 45 and\n" /* held, not let go ('-'), and not by this holder */
    "     (string.find(cur, ARGV[1], 1, true) ~= 1 or string.byte(cur, #ARGV[1] + 1) ~= 35) then\n"
    "    queue(clock())\n"
    "    local ttl = redis.call('PTTL', KEYS[3])\n"
    "    if not marked and ttl > 0 then redis.call('SET', KEYS[3], cur .. ' w', 'PX', ttl) end\n"
    "    return {'busy', cur, ttl}\n"
    "  end\n"
    "  local mine = cur == ticket or marked and cur == ticket .. ' w'\n" /* this turn's own, loaded again */
    "  local waiting = mine and marked\n"
    "  if not mine and (not cur or marked or ARGV[6]) and redis.call('EXISTS', line) == 1 then\n"
    "    local all, first, first_seq, others, now = redis.call('HGETALL', line), nil, nil, 0, clock()\n"
    "    for i = 1, #all, 2 do\n"
    "      if all[i] ~= '#' then\n"
    "        local seq, due = string.match(all[i + 1], '^(%d+) (%d+)$')\n"
    "        if not due or tonumber(due) < now then redis.call('HDEL', line, all[i])\n" /* a waiter gone */
    "        else\n"
    "          if all[i] ~= ticket then others = others + 1 end\n"
    "          if not first_seq or tonumber(seq) < first_seq then first, first_seq = all[i], tonumber(seq) end\n"
    "        end\n"
    "      end\n"
    "    end\n"
    "    if first and first ~= ticket then\n"
    "      queue(now)\n"
    "      return {'busy', 'the turn ' .. first .. ' waiting before this one', 0}\n"
    "    end\n"
    "    redis.call('HDEL', line, ticket)\n"
    "    if others == 0 then redis.call('DEL', line) end\n"
    "    waiting = others > 0\n"
    "  end\n"
    "  lease = ticket\n"
    "  redis.call('SET', KEYS[3], waiting and ticket .. ' w' or ticket, 'PX', ARGV[2])\n"
    "end\n"
    "if ARGV[3] ~= '' and redis.call('HGET', KEYS[1], 'rev') == ARGV[3] and\n"
    "   (ARGV[4] == '0' or redis.call('EXISTS', KEYS[2]) == 1) then\n"
    "  return {lease, 'same'}\n"
    "end\n"
    "local state = redis.call('HGETALL', KEYS[1])\n"
    "if #state == 0 and redis.call('EXISTS', KEYS[5], KEYS[6]) > 0 then\n" /* the layout before the state */
    "  return {lease, redis.call('HGETALL', KEYS[5]), redis.call('HGETALL', KEYS[6]), redis.call('GET', KEYS[7]),\n"
    "          redis.call('GET', KEYS[8]), redis.call('LRANGE', KEYS[2], '0', '-1')}\n"
    "end\n"
    "return {lease, state, redis.call('LRANGE', KEYS[2], '0', '-1')}\n";

/* A lease still ours (ARGV[1], maybe marked " w" since), renewed for ARGV[2] ms: 1, 2 when
 * another gateway asked to cancel the turn (the flag names this lease; it is taken), or 0
 * when the lease is not ours.
 * A lease gone is never taken back here: a renewal sent again after NOSCRIPT may land after
 * the turn's save released it (the save itself decides about a lease lost in a failover). */
static const char renew_script[] = /* KEYS: lock, cancel */
    "local cur = redis.call('GET', KEYS[1])\n"
    "if not " LUA_LOCK_IS("ARGV[1]") " then return 0 end\n"
    "redis.call('PEXPIRE', KEYS[1], ARGV[2])\n"
    "if redis.call('GET', KEYS[2]) == ARGV[1] then redis.call('DEL', KEYS[2]) return 2 end\n"
    "return 1\n";

/* Another gateway's turn of the dialog must stop (ARGV[1]: the flag's lifetime, ms): the
 * flag its lease renewal reads, in case the bus message is lost; answers the lease ("" when
 * none is held) so that its holder can be told on the bus now. The flag holds the lease it
 * stops: a flag left over (its turn ended without a save, or a renewal) then never stops
 * the dialog's next turn, which has another ticket, so nothing need delete it. */
static const char cancel_script[] = /* KEYS: lock, cancel */
    "local cur = redis.call('GET', KEYS[1])\n"
    "if not cur or string.byte(cur, 1) == 45 then return '' end\n"
    "if string.byte(cur, -1) == 119 then cur = string.sub(cur, 1, -3) end\n"
    "redis.call('SET', KEYS[2], cur, 'PX', ARGV[1])\n"
    "return cur\n";

/* A lease let go by its holder without a save: the lock deleted (the plain way in takes a
 * missing lock), or, while turns of other gateways wait, "-<ticket> w" for ARGV[2] s (the
 * dialog's lifetime), which sends the next turn to the load script and the line. */
static const char release_script[] = /* KEYS: lock */
    "local cur = redis.call('GET', KEYS[1])\n"
    "if not " LUA_LOCK_IS("ARGV[1]") " then return 0 end\n"
    "if string.byte(cur, -1) == 119 then redis.call('SET', KEYS[1], '-' .. cur, 'EX', ARGV[2])\n"
    "else redis.call('DEL', KEYS[1]) end\n"
    "return 1\n";

/* A JSON value Redis holds, or NULL. An integer past a long long's range (a peer's count of
 * 99999999999999999999), which jansson refuses and with it the whole value (a dialog's state
 * is one value), is read as that bound, and said: counts saturate (core/num.h). */
static json_t *parse_json_reply(redisReply *r)
{
    if (!r || r->type != REDIS_REPLY_STRING)
        return NULL;
    json_t *j = json_loadb(r->str, r->len, JSON_DECODE_ANY | JSON_ALLOW_NUL, NULL);
    size_t n;
    char *saturated = j ? NULL : cg_json_saturate_ints(r->str, r->len, &n);
    if (saturated) {
        j = json_loadb(saturated, n, JSON_DECODE_ANY | JSON_ALLOW_NUL, NULL);
        free(saturated);
        if (j)
            cg_warn("redis: a value read back held an integer past 2^63: read as that bound");
    }
    return j;
}

/* Sets key in obj to v (stolen); a failure (out of memory, a key jansson refuses) is logged. */
static void set_checked(json_t *obj, const char *key, size_t key_len, json_t *v)
{
    if (!v || json_object_setn_new(obj, key, key_len, v) < 0)
        cg_warn("redis: dropped the field '%.*s' of a dialog read back (not valid UTF-8, or out of memory)",
                (int)(key_len > 64 ? 64 : key_len), key);
}

/*
 * What a full load left out of a dialog because Redis held something chatgate does not
 * write there (a params field that is not "<service>.<name>" with a JSON value, a history
 * message that is not a JSON object, ...): counted, the first one named, for one warning
 * (load_answer), after which the dialog's next save rewrites it without them.
 */
typedef struct left_out {
    size_t n;
    char first[128];
} left_out;

static void leave_out(left_out *lo, const char *what, const char *name, size_t len)
{
    if (lo->n++)
        return;
    char shown[65]; /* the name as printable ASCII: it came from Redis, written by anyone */
    size_t k = len < sizeof(shown) - 1 ? len : sizeof(shown) - 1;
    for (size_t i = 0; i < k; i++)
        shown[i] = name[i] >= 0x20 && name[i] < 0x7f ? name[i] : '?';
    shown[k] = 0;
    snprintf(lo->first, sizeof(lo->first), "%s '%s'", what, shown);
}

/* params: fields "<service>.<name>" -> JSON, into {service: {name: value}}; the hash's
 * "rev" (no dot: not a param) is the dialog's rev, into *rev (NULL when there is none) */
static json_t *params_from_reply(redisReply *rep, const char **rev, left_out *lo)
{
    json_t *params = json_object();
    for (size_t i = 0; params && rep->type == REDIS_REPLY_ARRAY && i + 1 < rep->elements; i += 2) {
        redisReply *f = rep->element[i];
        if (f->type != REDIS_REPLY_STRING)
            continue;
        if (f->len == 3 && memcmp(f->str, "rev", 3) == 0) {
            if (rep->element[i + 1]->type == REDIS_REPLY_STRING)
                *rev = rep->element[i + 1]->str;
            continue;
        }
        const char *dot = memchr(f->str, '.', f->len);
        json_t *v = parse_json_reply(rep->element[i + 1]);
        if (!dot || !v) {
            leave_out(lo, dot ? "params field (not JSON)" : "params field (no service)", f->str, f->len);
            json_decref(v);
            continue;
        }
        size_t service_len = (size_t)(dot - f->str);
        json_t *svc = json_object_getn(params, f->str, service_len);
        if (!svc) {
            svc = json_object();
            if (!svc || json_object_setn_new(params, f->str, service_len, svc) < 0) {
                set_checked(params, f->str, service_len, NULL);
                json_decref(v);
                continue;
            }
        }
        set_checked(svc, dot + 1, f->len - service_len - 1, v);
    }
    return params;
}

/* An expiring part ({...,"expires_at":N}) into j's `name` and `name_expires`. */
static void expiring_from_reply(json_t *j, redisReply *rep, const char *name, const char *expires_name,
                                left_out *lo)
{
    json_t *v = parse_json_reply(rep);
    if (!json_is_object(v)) {
        if (rep->type == REDIS_REPLY_STRING) /* there, but not an object */
            leave_out(lo, "part", name, strlen(name));
        json_decref(v);
        return;
    }
    json_t *expires = json_object_get(v, "expires_at");
    if (expires)
        json_object_set(j, expires_name, expires);
    json_object_del(v, "expires_at");
    set_checked(j, name, strlen(name), v);
}

/* The history list of a load: its messages, each a JSON object (another is left out). */
static json_t *history_from_reply(redisReply *rep, left_out *lo)
{
    json_t *history = json_array();
    for (size_t i = 0; history && rep->type == REDIS_REPLY_ARRAY && i < rep->elements; i++) {
        json_t *m = parse_json_reply(rep->element[i]);
        if (!json_is_object(m)) {
            char at[24];
            int n = snprintf(at, sizeof(at), "%zu", i + 1);
            leave_out(lo, "history message (not a JSON object) number", at, (size_t)n);
            json_decref(m);
        } else {
            (void)json_array_append_new(history, m); /* out of memory: m is freed, the history shorter */
        }
    }
    return history;
}

/*
 * The state hash (rev, created_at, last_activity, v) and the history list of a load, into the
 * JSON cg_dialog_from_json reads (v is that JSON but the history), and *rev into the state's
 * rev (NULL when it has none); an empty dialog's when there is no state, NULL only when out
 * of memory. A part past its lifetime (v's params_until and dialog_until, the saving
 * gateway's clock: docs/state.md, "Lifetimes in Redis") is left out, as a key of its own
 * that lapsed was. What it cannot read is left out and counted in lo.
 */
static json_t *dialog_from_state(redisReply *state, redisReply *hist, int64_t now, const char **rev, left_out *lo)
{
    *rev = NULL;
    json_t *j = NULL;
    for (size_t i = 0; state->type == REDIS_REPLY_ARRAY && i + 1 < state->elements; i += 2) {
        redisReply *f = state->element[i], *v = state->element[i + 1];
        if (f->type != REDIS_REPLY_STRING || v->type != REDIS_REPLY_STRING)
            continue;
        if (f->len == 3 && memcmp(f->str, "rev", 3) == 0) {
            *rev = v->str;
        } else if (f->len == 1 && f->str[0] == 'v') {
            json_decref(j);
            j = parse_json_reply(v);
            if (!json_is_object(j) || json_object_get(j, "history")) {
                leave_out(lo, "state field (not a dialog's JSON object)", f->str, f->len);
                json_decref(j);
                j = NULL;
            }
        }
    }
    if (!j)
        j = json_object();
    if (!j)
        return NULL;
    json_t *until = json_object_get(j, "params_until");
    if (json_is_integer(until) && json_integer_value(until) <= now)
        json_object_set_new(j, "params", json_object());
    until = json_object_get(j, "dialog_until");
    if (json_is_integer(until) && json_integer_value(until) <= now) {
        static const char *const dialog_parts[] = {"meta", "service", "usage", "last_tool_result"};
        for (size_t i = 0; i < sizeof(dialog_parts) / sizeof(dialog_parts[0]); i++)
            json_object_del(j, dialog_parts[i]);
    }
    json_object_del(j, "params_until");
    json_object_del(j, "dialog_until");
    set_checked(j, "history", 7, history_from_reply(hist, lo));
    return j;
}

/* The same from the five replies of a dialog written in the layout before the state (params,
 * dialog, awaiting, soft, history: docs/state.md, "Upgrading"), read once after an upgrade;
 * *rev is the params hash's. */
static json_t *dialog_from_parts(redisReply **rep, const char **rev, left_out *lo)
{
    *rev = NULL;
    json_t *j = json_object(), *meta = json_object();
    if (!j || !meta) {
        json_decref(j);
        json_decref(meta);
        return NULL;
    }
    set_checked(j, "params", 6, params_from_reply(rep[0], rev, lo));
    for (size_t i = 0; rep[1]->type == REDIS_REPLY_ARRAY && i + 1 < rep[1]->elements; i += 2) {
        redisReply *f = rep[1]->element[i], *v = rep[1]->element[i + 1];
        if (f->type != REDIS_REPLY_STRING || v->type != REDIS_REPLY_STRING)
            continue;
        if (strcmp(f->str, "service") == 0)
            set_checked(j, "service", 7, json_stringn(v->str, v->len));
        else if (strcmp(f->str, "last_tool_result") == 0 || strcmp(f->str, "usage") == 0) {
            json_t *parsed = parse_json_reply(v);
            if (parsed)
                set_checked(j, f->str, f->len, parsed);
            else
                leave_out(lo, "dialog field (not JSON)", f->str, f->len);
        } else
            set_checked(meta, f->str, f->len, json_integer(strtoll(v->str, NULL, 10)));
    }
    set_checked(j, "meta", 4, meta);
    expiring_from_reply(j, rep[2], "awaiting", "awaiting_expires", lo);
    expiring_from_reply(j, rep[3], "soft_context", "soft_expires", lo);
    set_checked(j, "history", 7, history_from_reply(rep[4], lo));
    return j;
}

/* A reply that failed: NULL (connection gone) or an error; logs the error's text. */
int cg_redis_reply_failed(redis_store *rs, redisReply *reply, size_t want_elements, const char *what)
{
    if (!reply)
        return 1;
    if (reply->type == REDIS_REPLY_ERROR) {
        cg_warn("redis %s:%d: %s failed: %s", rs->host, rs->port, what, reply->str);
        return 1;
    }
    if (want_elements && (reply->type != REDIS_REPLY_ARRAY || reply->elements != want_elements)) {
        cg_warn("redis %s:%d: %s: unexpected answer (type %d)", rs->host, rs->port, what, reply->type);
        return 1;
    }
    return 0;
}

static int lease_release(redis_store *rs, const char *eu, const char *er, const char *value);

/* The lease was held by another holder: the load is sent again after a backoff (25 ms,
 * doubling to 250 ms, never past the lease's own end), in the request's own timer. A wait
 * per dialog is rare (the in-process lock already queues this gateway's own turns), and
 * short: the holder's save releases it. With a bus, the holder is also asked to say when it
 * lets the lease go ("wait <key> <us>" on its channel); its "wake <key>" sends the load again
 * at once, so a turn waits for the turns ahead of it and not the backoff's rest. Without a
 * bus (or its message lost) the backoff still comes. */
static void leave_line(redis_store *rs, redis_req *r);

static void lease_waiting_add(redis_store *rs, redis_req *r)
{
    if (r->lw_listed)
        return;
    r->lw_next = rs->lease_waiting;
    rs->lease_waiting = r;
    r->lw_listed = 1;
}

void cg_redis_lease_unwait(redis_store *rs, redis_req *r)
{
    if (!r->lw_listed)
        return;
    for (redis_req **pp = &rs->lease_waiting; *pp; pp = &(*pp)->lw_next)
        if (*pp == r) {
            *pp = r->lw_next;
            break;
        }
    r->lw_next = NULL;
    r->lw_listed = 0;
}

/* The holder of a ticket, "<holder>#<n>" (a lease, a turn in line), up to its first space
 * (" w", " waiting ..."); NULL when it has none. */
static char *ticket_holder(const char *v, size_t len)
{
    const char *sp = memchr(v, ' ', len), *end = sp ? sp : v + len;
    while (end > v && end[-1] != '#')
        end--;
    return end > v + 1 ? cg_strndup(v, (size_t)(end - 1 - v)) : NULL;
}

/* The gateway a busy answer names: the lease's holder ("<holder>#<n>"), or that of the turn
 * waiting first ("the turn <holder>#<n> waiting before this one"); NULL when neither. */
static char *busy_holder(const redisReply *busy)
{
    const char *v = busy->element[1]->str;
    size_t len = busy->element[1]->len;
    if (len > 9 && strncmp(v, "the turn ", 9) == 0)
        v += 9, len -= 9;
    return ticket_holder(v, len);
}

/* Asks the gateway that holds (or waits first for) r's lease to wake r when it lets go. */
static void ask_wake(redis_store *rs, redis_req *r, const redisReply *busy)
{
    char *holder = rs->bus ? busy_holder(busy) : NULL;
    if (!holder || strcmp(holder, rs->holder) == 0 || (r->asked && strcmp(r->asked, holder) == 0)) {
        free(holder);
        return;
    }
    size_t n = 5 + strlen(r->key) + 1 + strlen(rs->holder) + 1;
    char *msg = cg_malloc(n);
    snprintf(msg, n, "wait %s %s", r->key, rs->holder);
    cg_redis_bus_publish(rs->bus, holder, msg);
    free(msg);
    free(r->asked);
    r->asked = holder;
}

#define WAKE_MAX_DIALOGS 10000 /* dialogs of ours others wait for, remembered at most */
#define WAKE_MAX_WAITERS 8     /* gateways remembered as waiting for one dialog */

/* Tells every gateway waiting for key's lease (wake_on_release) that it is free. */
static void wake_waiters(redis_store *rs, const char *key)
{
    json_t *list = json_object_get(rs->wake_on_release, key);
    if (!list || !rs->bus)
        return;
    size_t n = 5 + strlen(key) + 1, i;
    char *msg = cg_malloc(n);
    snprintf(msg, n, "wake %s", key);
    json_t *h;
    json_array_foreach(list, i, h) cg_redis_bus_publish(rs->bus, json_string_value(h), msg);
    free(msg);
    json_object_del(rs->wake_on_release, key);
}

/* "wait <key> <holder>": holder waits for a lease of ours; told when we let it go, or at once
 * when we hold none (it went meanwhile). */
static void note_waiter(redis_store *rs, const char *key, size_t key_len, const char *holder)
{
    char *k = cg_strndup(key, key_len);
    json_t *list = json_object_get(rs->wake_on_release, k);
    if (!list && json_object_size(rs->wake_on_release) < WAKE_MAX_DIALOGS) {
        list = json_array();
        json_object_set_new(rs->wake_on_release, k, list);
    }
    int known = 0;
    size_t i;
    json_t *h;
    json_array_foreach(list, i, h) known |= strcmp(json_string_value(h), holder) == 0;
    if (list && !known && json_array_size(list) < WAKE_MAX_WAITERS)
        json_array_append_new(list, json_string(holder));
    if (!json_object_get(rs->leases, k) && !json_object_get(rs->saving, k))
        wake_waiters(rs, k);
    free(k);
}

static void on_lease_retry(uv_timer_t *t);

/* "wake <key>": the loads waiting for key's lease ask again now. */
static void on_wake(redis_store *rs, const char *key)
{
    for (redis_req *r = rs->lease_waiting; r; r = r->lw_next)
        if (strcmp(r->key, key) == 0 && uv_is_active((uv_handle_t *)&r->defer)) {
            rs->base.stats.lease_wakes++;
            uv_timer_start(&r->defer, on_lease_retry, 0, 0);
        }
}

static void on_lease_retry(uv_timer_t *t)
{
    redis_req *r = t->data;
    cg_redis_lease_unwait(r->rs, r);
    if (r->abandoned || r->rs->closing) {
        leave_line(r->rs, r);
        cg_redis_req_finish(r);
        return;
    }
    dispatch(r->rs, r);
}

/* A turn that waited in line for the lease and went away gives up its place at once (else
 * the turns behind it would wait for its place to lapse). No answer. */
static void leave_line(redis_store *rs, redis_req *r)
{
    if (!r->ticket || !r->lease_waits || !cg_redis_linked(rs))
        return;
    cg_argv a = {0};
    cg_argv_str(&a, "HDEL");
    cg_argv_key(&a, rs->base.cfg.prefix, r->eu, r->er, "line");
    cg_argv_str(&a, r->ticket);
    cg_redis_send_argv(rs, &a, NULL, NULL);
    cg_argv_free(&a);
}

static void lease_wait(redis_store *rs, redis_req *r, redisReply *busy)
{
    long long pttl = busy->elements > 2 && busy->element[2]->type == REDIS_REPLY_INTEGER ? busy->element[2]->integer
                                                                                         : -1;
    uint64_t delay = 25u << (r->lease_waits < 4 ? r->lease_waits : 4);
    if (delay > 250)
        delay = 250;
    if (pttl > 0 && (uint64_t)pttl + 1 < delay)
        delay = (uint64_t)pttl + 1;
    if (r->lease_waits++ == 0) {
        rs->base.stats.lease_waits++;
        cg_debug("redis: a dialog's lease is held by %.*s: waiting", (int)(busy->element[1]->len > 64 ? 64 : busy->element[1]->len),
                 busy->element[1]->str);
    }
    r->defer.data = r;
    uv_timer_start(&r->defer, on_lease_retry, delay, 0);
    lease_waiting_add(rs, r);
    ask_wake(rs, r, busy);
}

/* {"v": the lease, "t": when taken (loop ms), "r": the rev of Redis's copy the load read,
 * when it had one}, rs->leases' entry of a dialog; NULL when the lease is not UTF-8 (which
 * is no lease of ours) or memory ran out. Built member by member: json_pack's format was a
 * fiftieth of a load's answer. */
static json_t *lease_held(const char *lease, size_t len, uint64_t now, const char *base_rev)
{
    json_t *held = json_object(), *v = cg_json_stringn(lease, len);
    if (!held || !v || json_object_set_new_nocheck(held, "v", v) < 0 ||
        json_object_set_new_nocheck(held, "t", json_integer((json_int_t)now)) < 0) {
        json_decref(held);
        if (!held)
            json_decref(v);
        return NULL;
    }
    json_t *rev = base_rev ? json_string(base_rev) : NULL; /* not UTF-8: none (a rewrite then trusts the lease) */
    if (rev)
        json_object_set_new_nocheck(held, "r", rev);
    return held;
}

static void send_load(redis_store *rs, redis_req *r);

/* Number of params (a dialog's), as Redis keeps them (a field per service and name). */
static size_t params_count(json_t *params)
{
    const char *service;
    json_t *names;
    size_t n = 0;
    json_object_foreach(params, service, names) n += json_object_size(names);
    return n;
}

/*
 * Redis answered "same" (load_script): d is filled from the gateway's copy and 1 returned,
 * or 0 when that copy is no longer the one asked about, or no longer holds what it held
 * when asked (a part of it lapsed meanwhile); r then loads in full.
 */
static int load_cached(redis_store *rs, redis_req *r, int64_t now, cg_dialog *d)
{
    const char *rev = cg_memstore_rev(cg_fallback_copy(rs->fb), r->key, now);
    if (!rev || strcmp(rev, r->rev) != 0)
        return 0;
    if (!cg_memstore_get(cg_fallback_copy(rs->fb), r->key, now, d))
        return 0;
    if (params_count(d->params) == r->copy_params && json_array_size(d->history) == r->copy_history) {
        free(r->base_rev);
        r->base_rev = cg_strdup(r->rev);
        return 1;
    }
    cg_dialog_free(d);
    return 0;
}

/* The load's dialog in d, from the replies or from the gateway's copy; 0, or -1 when the
 * answer is not one (an error, or out of memory), 1 when r was sent again in full. */
static void on_merge_loaded(void *ctx, cg_dialog *d, const cg_store_status *st);

static int load_answer(redis_store *rs, redis_req *r, redisReply *reply, int64_t now, cg_dialog *d)
{
    if (reply->elements >= 2 && reply->element[1]->type == REDIS_REPLY_STRING && r->rev) {
        if (reply->elements == 2 && load_cached(rs, r, now, d)) {
            rs->base.stats.loads_cached++;
            return 0;
        }
        r->full = 1; /* the lease stays taken: the next load is the same holder's */
        send_load(rs, r);
        return 1;
    }
    const char *rev;
    json_t *j;
    left_out lo = {0};
    int before_state = reply->elements == 6; /* written before an upgrade (load_script) */
    if (reply->elements == 3)
        j = dialog_from_state(reply->element[1], reply->element[2], now, &rev, &lo);
    else if (before_state)
        j = dialog_from_parts(reply->element + 1, &rev, &lo);
    else
        return -1;
    if (!j)
        return -1;
    if (before_state) /* Redis has no state of that rev: the next save writes the state anew */
        rev = NULL;
    free(r->base_rev); /* the rev read, even when the copy is given none below */
    r->base_rev = rev ? cg_strdup(rev) : NULL;
    if (lo.n) {
        /* no rev for the copy: its next save cannot append to what Redis holds, so it
         * rewrites every part, without what was left out (docs/state.md) */
        cg_warn("redis %s:%d: load: a dialog held %zu part(s) chatgate does not write, the first a %s: left out; "
                "its next save rewrites the dialog without them",
                rs->host, rs->port, lo.n, lo.first);
        rev = NULL;
    }
    cg_dialog_adopt_json(d, j, now); /* j was built from the replies for this */
    json_decref(j);
    if (r->cb.load == on_merge_loaded) {
        /* a merge's read: the save waiting for it must know the rev it read (Redis's, even
         * when parts were left out: the merge is written over that copy, without them; with
         * none the merge met -4 at every try and never landed); the gateway's copy is left as
         * it is (it may hold turns of this gateway that Redis's lacks) */
        redis_req *save = r->ctx;
        free(save->merge_rev);
        save->merge_rev = cg_strdup(r->base_rev ? r->base_rev : "");
        return 0;
    }
    if (!cg_fallback_is_dirty(rs->fb, r->key)) /* else memory's is newer: degraded mode answers from it */
        cg_memstore_put_rev(cg_fallback_copy(rs->fb), r->key, d, now, rev, 0); /* the copy that survives an outage */
    return 0;
}

/* r's load is answered with d (taken) and st; the lease it took (len > 0) is held until
 * the dialog's save or release, or let go at once when the caller left meanwhile. */
static void load_done(redis_store *rs, redis_req *r, const char *lease, size_t len, cg_dialog *d,
                      const cg_store_status *st)
{
    cg_fallback_known(rs->fb, r->key); /* Redis's copy is known now */
    /* a merge's read is answered closing too: the save waiting for it must end, or the store
     * (which waits for its requests) would never be freed */
    int wanted = !r->abandoned && (!rs->closing || r->cb.load == on_merge_loaded);
    if (len > 0 && wanted)
        json_object_set_new(rs->leases, r->key, lease_held(lease, len, uv_now(rs->base.loop), r->base_rev));
    else if (len > 0)
        lease_release(rs, r->eu, r->er, lease);
    if (wanted)
        r->cb.load(r->ctx, d, st);
    else
        cg_dialog_free(d);
    cg_redis_req_finish(r);
}

/* r went in behind a save of its dialog (send_load_behind), and was answered while that
 * save was not (ahead): its answer may have read Redis before that save (which went again
 * after NOSCRIPT, or merges), so it goes again, behind the save sent again or at the gate;
 * 1 then. A lease it took is this gateway's: the next load takes it again. */
static int load_again_behind(redis_store *rs, redis_req *r, int ahead)
{
    if (!r->pipelined)
        return 0;
    r->pipelined = 0;
    if (!ahead)
        return 0;
    rs->base.stats.loads_pipelined_again++;
    dispatch(rs, r);
    return 1;
}

static void on_load_reply(cg_redis_conn *ac, void *reply_, void *priv)
{
    (void)ac;
    redis_req *r = priv;
    redis_store *rs = r->rs;
    redisReply *reply = reply_;
    if (load_again_behind(rs, r, reply && json_object_get(rs->saving, r->key)))
        return;
    if (reply && reply->type == REDIS_REPLY_ARRAY && reply->elements == 3 && reply->element[0]->type == REDIS_REPLY_STRING &&
        strcmp(reply->element[0]->str, "busy") == 0 && reply->element[1]->type == REDIS_REPLY_STRING) {
        lease_wait(rs, r, reply);
        return;
    }
    int64_t now = rs->base.now(rs->base.clock_ctx);
    cg_dialog d;
    int rc = -1;
    if (cg_redis_reply_failed(rs, reply, 0, "load") || reply->type != REDIS_REPLY_ARRAY || reply->elements < 2 ||
        reply->element[0]->type != REDIS_REPLY_STRING || (rc = load_answer(rs, r, reply, now, &d)) < 0) {
        if (reply && reply->type != REDIS_REPLY_ERROR && rc < 0)
            cg_warn("redis %s:%d: load: unexpected answer (type %d, %zu elements)", rs->host, rs->port, reply->type,
                    reply->type == REDIS_REPLY_ARRAY ? reply->elements : 0);
        /* a lease this load took (its plain SET, or the script before it failed) is no one's
         * now: let go (the release script lets go only of this ticket's) */
        if (r->lease && r->ticket) {
            lease_release(rs, r->eu, r->er, r->ticket);
            leave_line(rs, r); /* a turn that waited in line: its place goes too */
        }
        rs->base.stats.errors++;
        cg_redis_answer_unavailable(r);
        return;
    }
    if (rc == 1)
        return; /* sent again, in full */
    cg_store_status st = {0};
    for (size_t i = 1; i < reply->elements; i++) /* any of the five keys there ("same": the dialog is) */
        st.found |= reply->element[i]->type == REDIS_REPLY_STRING ||
                    (reply->element[i]->type == REDIS_REPLY_ARRAY && reply->element[i]->elements > 0);
    load_done(rs, r, reply->element[0]->str, reply->element[0]->len, &d, &st);
}

static void send_load_cmd(redis_store *rs, redis_req *r);

static void send_load(redis_store *rs, redis_req *r)
{
    /* the rev of the copy this gateway holds, if Redis may answer "same" (a turn's load:
     * one without the lease is an admin's read, rare, and reads everything) */
    cg_memstore_view v = {0};
    if (r->lease && !r->full)
        (void)cg_memstore_view_of(cg_fallback_copy(rs->fb), r->key, rs->base.now(rs->base.clock_ctx), &v);
    free(r->rev);
    r->rev = v.rev ? cg_strdup(v.rev) : NULL;
    r->copy_params = params_count(v.params);
    r->copy_history = json_array_size(v.history);
    send_load_cmd(rs, r);
}

/* A turn's load behind the one plain save of its dialog in flight (the gate's comment): sent
 * now, asking about the rev that save writes; 0, or -1 when it must wait at the gate. */
static int send_load_behind(redis_store *rs, redis_req *r)
{
    json_t *next = json_object_get(rs->save_next, r->key);
    if (!next || !r->lease || r->full)
        return -1;
    free(r->rev);
    r->rev = cg_strdup(json_string_value(json_object_get(next, "rev")));
    r->copy_params = (size_t)json_integer_value(json_object_get(next, "p"));
    r->copy_history = (size_t)json_integer_value(json_object_get(next, "h"));
    r->pipelined = 1;
    rs->base.stats.loads_pipelined++;
    send_load_cmd(rs, r);
    return 0;
}

/*
 * The plain way in (issue 39). A turn's load that holds a copy of its dialog (the common
 * case) goes in as plain commands, pipelined, in place of the load script:
 *   SET <lock> <ticket> NX PX <lease_ms>   the lease, when the lock is free
 *   HGET <state> rev                       Redis's copy is the gateway's,
 *   EXISTS <history>                       and its history did not lapse alone (only when
 *                                          the copy has messages)
 * which are the script's questions, for a small part of what the script costs Redis (its
 * call, and every call made in it, are dear: docs/state.md, "What the scripts cost Redis").
 * A free lock is a missing one: a save or release lets go of a lock no one waits for by
 * deleting it. When all say yes, the turn is answered from the copy. Otherwise the
 * load script goes next, a second round trip: the lock was held, or let go with turns of
 * other gateways waiting ("-<ticket> w"), and the script puts the turn in line; or the lease
 * was taken and Redis's copy is another one, and the script, meeting the turn's own lease,
 * reads the dialog in full.
 * The three are not one atomic step, and need not be: the lease is taken first, and what
 * may write the dialog between them without the lease (a write-back) may as well write it
 * between the script and the turn's save. What is given up: a lock that lapsed (its holder
 * died) while turns waited in line is taken by whichever turn comes first, in line or not.
 */
enum { PLAIN_SENT = 1, PLAIN_LEASE = 2, PLAIN_REV = 4, PLAIN_PARTS = 8, PLAIN_FAILED = 16, PLAIN_AHEAD = 32 };

static void plain_answered(redis_req *r);

/* A plain command's reply, 1 when it is one (it is not, logged, when NULL or an error). One
 * answered while the save it went behind is not (PLAIN_AHEAD) may have run before that save:
 * in a cluster, a TRYAGAIN parks the save's many keys while the plain commands' one key each
 * is served, so that only some of them run after it. */
static int plain_reply(redis_req *r, redisReply *reply)
{
    if (r->pipelined && json_object_get(r->rs->saving, r->key))
        r->plain |= PLAIN_AHEAD;
    if (!cg_redis_reply_failed(r->rs, reply, 0, "load"))
        return 1;
    r->plain |= PLAIN_FAILED;
    return 0;
}

static void on_plain_lease(cg_redis_conn *ac, void *reply_, void *priv)
{
    (void)ac;
    redis_req *r = priv;
    redisReply *reply = reply_;
    if (plain_reply(r, reply) && reply->type == REDIS_REPLY_STATUS) /* OK; nil: the lock is not free */
        r->plain |= PLAIN_LEASE;
    plain_answered(r);
}

static void on_plain_rev(cg_redis_conn *ac, void *reply_, void *priv)
{
    (void)ac;
    redis_req *r = priv;
    redisReply *reply = reply_;
    if (plain_reply(r, reply) && reply->type == REDIS_REPLY_STRING && reply->len == strlen(r->rev) &&
        memcmp(reply->str, r->rev, reply->len) == 0)
        r->plain |= PLAIN_REV;
    plain_answered(r);
}

static void on_plain_parts(cg_redis_conn *ac, void *reply_, void *priv)
{
    (void)ac;
    redis_req *r = priv;
    redisReply *reply = reply_;
    if (plain_reply(r, reply) && reply->type == REDIS_REPLY_INTEGER && reply->integer == 1)
        r->plain |= PLAIN_PARTS;
    plain_answered(r);
}

/* The answers came (plain_due counts them, and a hold while they are sent). */
static void plain_answered(redis_req *r)
{
    if (--r->plain_due > 0)
        return;
    redis_store *rs = r->rs;
    int failed = r->plain & PLAIN_FAILED, lease = r->plain & PLAIN_LEASE;
    if (load_again_behind(rs, r, !failed && (r->plain & PLAIN_AHEAD)))
        return;
    if (failed || r->abandoned || rs->closing) {
        if (lease) /* taken, and no turn will let go of it */
            lease_release(rs, r->eu, r->er, r->ticket);
        if (!failed) { /* the caller left, or the store closes: no answer is wanted */
            cg_redis_req_finish(r);
            return;
        }
        rs->base.stats.errors++;
        cg_redis_answer_unavailable(r);
        return;
    }
    cg_dialog d;
    if (lease && (r->plain & PLAIN_REV) && (r->plain & PLAIN_PARTS) &&
        load_cached(rs, r, rs->base.now(rs->base.clock_ctx), &d)) {
        rs->base.stats.loads_cached++;
        cg_store_status st = {.found = 1};
        load_done(rs, r, r->ticket, strlen(r->ticket), &d, &st);
        return;
    }
    if (lease) /* Redis's copy is another: read in full, the lease kept (the script's "mine") */
        r->full = 1;
    send_load(rs, r);
}

/* 1 when the command went; counted before it goes (an answer may come from inside the send). */
static int plain_send(redis_store *rs, cg_argv *a, cg_redis_reply_fn *fn, redis_req *r)
{
    r->plain_due++;
    if (cg_redis_send_argv(rs, a, fn, r) == 0)
        return 1;
    r->plain_due--;
    r->plain |= PLAIN_FAILED;
    return 0;
}

static void send_plain_load(redis_store *rs, redis_req *r)
{
    const char *prefix = rs->base.cfg.prefix;
    cg_argv a = {0};
    int sent = 0;
    r->plain = PLAIN_SENT;
    r->plain_due = 1; /* held while sending: an answer given at once must not end r */
    cg_argv_str(&a, "SET");
    cg_argv_key(&a, prefix, r->eu, r->er, "lock");
    cg_argv_str(&a, r->ticket);
    cg_argv_str(&a, "NX");
    cg_argv_str(&a, "PX");
    cg_argv_int(&a, (long long)rs->base.cfg.lease_ms);
    sent += plain_send(rs, &a, on_plain_lease, r);
    cg_argv_str(&a, "HGET");
    cg_argv_key(&a, prefix, r->eu, r->er, parts[K_STATE]);
    cg_argv_str(&a, "rev");
    sent += plain_send(rs, &a, on_plain_rev, r);
    if (r->copy_history) {
        cg_argv_str(&a, "EXISTS");
        cg_argv_key(&a, prefix, r->eu, r->er, parts[K_HISTORY]);
        sent += plain_send(rs, &a, on_plain_parts, r);
    } else {
        r->plain |= PLAIN_PARTS; /* nothing of the copy's can have lapsed but the state, whose rev says */
    }
    cg_argv_free(&a);
    if (!sent) { /* none went: answered later, as a script that could not go is */
        r->plain_due = 0;
        rs->base.stats.errors++;
        cg_redis_answer_later_unavailable(r);
        return;
    }
    plain_answered(r); /* the hold */
}

/* "<holder>#<n>", a ticket's or a rev's (n counts from 1: far below 2^63), malloc'd:
 * written, not formatted by snprintf, which was a turn's 1,000 instructions (callgrind,
 * issue 39). */
static char *holder_numbered(redis_store *rs, unsigned long long n)
{
    cg_jsonw w;
    cg_jsonw_init(&w, 0, 64);
    cg_jsonw_raw(&w, rs->holder, strlen(rs->holder));
    CG_JSONW_LIT(&w, "#");
    cg_jsonw_int(&w, (long long)n);
    size_t len;
    char *s = cg_jsonw_end(&w, &len);
    if (!s)
        abort(); /* out of memory */
    return s;
}

static void send_load_cmd(redis_store *rs, redis_req *r)
{
    if (r->lease && !r->ticket) { /* its ticket: the lease's value, its place in line */
        r->ticket = holder_numbered(rs, ++rs->ticket_seq);
    }
    if (r->lease && r->rev && !r->full && !r->lease_waits && !(r->plain & PLAIN_SENT)) {
        send_plain_load(rs, r);
        return;
    }
    cg_argv a = {0};
    arg_script(rs, &a, S_LOAD, r->eu, r->er);
    cg_argv_str(&a, r->lease ? rs->holder : "");
    cg_argv_int(&a, (long long)rs->base.cfg.lease_ms);
    cg_argv_str(&a, r->rev ? r->rev : "");
    cg_argv_str(&a, r->copy_history ? "1" : "0");
    if (r->lease) { /* its place in the line of turns waiting for the lease (docs/state.md) */
        cg_argv_str(&a, r->ticket);
        if (r->lease_waits) /* it has a place in the line to take back */
            cg_argv_str(&a, "1");
    }
    send_last_script(rs, S_LOAD, &a, on_load_reply, r);
    cg_argv_free(&a);
}

/* ---- leases ---------------------------------------------------------------------------- */

/* "<dialog key> <lease>" names this gateway's lease now (rs->leases)? */
static int lease_current(redis_store *rs, const char *key_and_lease)
{
    size_t n = strcspn(key_and_lease, " ");
    json_t *held = json_object_getn(rs->leases, key_and_lease, n);
    const char *v = json_string_value(json_object_get(held, "v"));
    return key_and_lease[n] == ' ' && v && strcmp(v, key_and_lease + n + 1) == 0;
}

/* A cancel (the flag, or a bus message) names the dialog and the lease it is for: it stops
 * the turn only while that lease is still this gateway's, never the dialog's next turn. */
static void cancel_turn(redis_store *rs, const char *key_and_lease);

void cg_redis_bus_message(redis_store *rs, const char *text)
{
    if (strncmp(text, "wait ", 5) == 0) { /* a dialog key holds no space (escaped) */
        const char *key = text + 5, *sp = strchr(key, ' ');
        /* from Redis, so checked: a holder id as this store makes them, no longer */
        if (sp && sp[1] && strlen(sp + 1) < sizeof(rs->holder) && !strchr(sp + 1, ' '))
            note_waiter(rs, key, (size_t)(sp - key), sp + 1);
    } else if (strncmp(text, "wake ", 5) == 0) {
        on_wake(rs, text + 5);
    } else {
        cancel_turn(rs, text);
    }
}

static void cancel_turn(redis_store *rs, const char *key_and_lease)
{
    if (!lease_current(rs, key_and_lease))
        return;
    char *key = cg_strndup(key_and_lease, strcspn(key_and_lease, " "));
    rs->base.stats.remote_cancels++;
    if (rs->base.on_cancel)
        rs->base.on_cancel(rs->base.cancel_ctx, key);
    free(key);
}

/* A script no one waits for (a renewal, a cancel), and what its answer needs: the store (not
 * the connection's data, which in a cluster is the router's node) and a text. */
typedef struct store_note {
    redis_store *rs;
    char text[]; /* a renewal's "<dialog key> <lease>", a cancel's dialog key */
} store_note;

static store_note *note_new(redis_store *rs, const char *a, const char *b)
{
    size_t na = strlen(a), nb = b ? strlen(b) + 1 : 0;
    store_note *n = cg_malloc(sizeof(*n) + na + nb + 1);
    n->rs = rs;
    memcpy(n->text, a, na);
    if (b) {
        n->text[na] = ' ';
        memcpy(n->text + na + 1, b, nb - 1);
    }
    n->text[na + nb] = 0;
    return n;
}

static void on_lease_reply(cg_redis_conn *ac, void *reply_, void *priv)
{
    (void)ac;
    store_note *note = priv; /* a renewal's */
    const char *kl = note ? note->text : NULL;
    redisReply *reply = reply_;
    redis_store *rs = note ? note->rs : NULL;
    if (kl && rs && reply && reply->type == REDIS_REPLY_INTEGER && reply->integer == 2) {
        /* another gateway asked, and its bus message did not come (or came first) */
        cancel_turn(rs, kl);
    } else if (kl && rs && reply && reply->type == REDIS_REPLY_INTEGER && reply->integer == 0 &&
               lease_current(rs, kl)) {
        json_t *held = json_object_getn(rs->leases, kl, strcspn(kl, " "));
        if (held && !json_object_get(held, "lost")) {
            json_object_set_new(held, "lost", json_true());
            cg_warn("redis: the lease of a dialog in flight is no longer this gateway's (it was away past "
                    "redis.lease_ms): its save will be refused");
        }
    }
    free(note);
}

/* A release was answered: the gateways waiting for the lease are told. */
static void on_release_reply(cg_redis_conn *ac, void *reply, void *priv)
{
    (void)ac;
    store_note *note = priv; /* the dialog's key */
    if (reply)
        wake_waiters(note->rs, note->text);
    free(note);
}

/* Lets go of the lease value (the release script: only while the lock is that lease); 0, or
 * -1 when the link is down (the lease then lapses by itself). */
static int lease_release(redis_store *rs, const char *eu, const char *er, const char *value)
{
    cg_argv a = {0};
    arg_script(rs, &a, S_RELEASE, eu, er);
    cg_argv_str(&a, value);
    cg_argv_int(&a, (long long)rs->base.cfg.lifetimes.dialog_s); /* how long the lock says who let go */
    char *key = cg_store_key_join(eu, er);
    store_note *note = note_new(rs, key, NULL);
    free(key);
    int rc = send_script(rs, S_RELEASE, &a, on_release_reply, note);
    if (rc < 0)
        free(note);
    cg_argv_free(&a);
    return rc;
}

/* Splits a dialog key "<eu>:<er>" (escaped ids hold no ':'). */
static int key_split(const char *key, char **eu, char **er)
{
    const char *colon = strchr(key, ':');
    if (!colon)
        return -1;
    *eu = cg_strndup(key, (size_t)(colon - key));
    *er = cg_strdup(colon + 1);
    return 0;
}

void cg_redis_renew_leases(redis_store *rs)
{
    uint64_t now = uv_now(rs->base.loop);
    long every = rs->base.cfg.lease_ms / 3;
    const char *key;
    json_t *held;
    json_object_foreach(rs->leases, key, held) {
        json_int_t at = json_integer_value(json_object_get(held, "t"));
        if ((long)(now - (uint64_t)at) < every || json_object_get(held, "lost"))
            continue;
        char *eu, *er;
        if (key_split(key, &eu, &er) < 0)
            continue;
        cg_argv a = {0};
        arg_script(rs, &a, S_RENEW, eu, er);
        cg_argv_str(&a, json_string_value(json_object_get(held, "v")));
        cg_argv_int(&a, (long long)rs->base.cfg.lease_ms);
        store_note *k = note_new(rs, key, json_string_value(json_object_get(held, "v")));
        if (send_script(rs, S_RENEW, &a, on_lease_reply, k) < 0)
            free(k);
        cg_argv_free(&a);
        free(eu);
        free(er);
        json_object_set_new(held, "t", json_integer((json_int_t)now));
    }
}

static void on_cancel_reply(cg_redis_conn *ac, void *reply_, void *priv)
{
    (void)ac;
    store_note *note = priv;
    const char *key = note->text;
    redisReply *reply = reply_;
    redis_store *rs = note->rs;
    if (reply && reply->type == REDIS_REPLY_STRING && reply->len > 0) {
        char *holder = ticket_holder(reply->str, reply->len);
        char *kl = NULL;
        if (asprintf(&kl, "%s %.*s", key, (int)reply->len, reply->str) < 0)
            abort();
        if (holder && strcmp(holder, rs->holder) != 0)
            cg_redis_bus_publish(rs->bus, holder, kl);
        free(kl);
        free(holder);
    }
    free(note);
}

/* A cancel phrase or context.clear arrived here for a dialog whose turn may run on another
 * gateway: the flag its renewal reads, and a message on the holder's bus channel now. */
static void rs_cancel_remote(cg_store *st, const char *user, const char *room)
{
    redis_store *rs = (redis_store *)st;
    if (!cg_redis_linked(rs))
        return;
    char *key = cg_store_dialog_key(user, room), *eu, *er;
    if (key_split(key, &eu, &er) < 0) {
        free(key);
        return;
    }
    cg_argv a = {0};
    arg_script(rs, &a, S_CANCEL, eu, er);
    cg_argv_int(&a, (long long)rs->base.cfg.lease_ms);
    store_note *note = note_new(rs, key, NULL);
    if (send_script(rs, S_CANCEL, &a, on_cancel_reply, note) < 0)
        free(note);
    free(key);
    cg_argv_free(&a);
    free(eu);
    free(er);
}

/* A turn that saves nothing lets go of its lease (context.get, a load whose caller left). */
static void rs_release(cg_store *st, const char *user, const char *room)
{
    redis_store *rs = (redis_store *)st;
    char *key = cg_store_dialog_key(user, room);
    json_t *held = json_object_get(rs->leases, key);
    char *eu, *er;
    if (held && cg_redis_linked(rs) && key_split(key, &eu, &er) == 0) {
        lease_release(rs, eu, er, json_string_value(json_object_get(held, "v")));
        free(eu);
        free(er);
    }
    json_object_del(rs->leases, key);
    free(key);
}

/* ---- save ------------------------------------------------------------------------------ */

/*
 * The save, one atomic step on the dialog's keys (KEYS: 1 state, 2 history, 3 lock) and its
 * user's rooms set (KEYS[4]). ARGV: 1 the mode: "0" a save, "1" a write-back (also refused
 * when Redis's copy is newer), "2" a dialog that began from nothing while Redis was away
 * (written only if Redis has none), "3" a merge (written only over the rev it merged with,
 * ARGV[3], else -4), "4" a turn's rewrite under its lease when the gateway holds no copy with
 * a rev (evicted since its load, or the load left parts out): written only over the rev that
 * load read, ARGV[3], else -3, merged (a write-back or merge of another gateway holds no
 * lease, so the lease alone does not say that no one wrote meanwhile); 2 the lease this save
 * must still hold ("" for none: a write-back); 3 the rev of Redis's copy that the history is
 * appended to ("": the history is rewritten; modes 3 and 4: the rev the rewrite must find); 4
 * the rev this save writes; 5 created_at; 6 last_activity; 7 v, the dialog as JSON but its
 * history (what cg_dialog_from_json reads, with params_until and dialog_until); 8 how long
 * the state lives (the longest of params_s, dialog_s and an awaiting state's or soft
 * context's time left); 9 history_s; 10 how long the rooms set lives; 11 dialog_s (a lock let
 * go with turns waiting); 12 how many messages the history holds after this save; 13 how many
 * Redis's list holds when it is appended to (the copy's: a list lapsed or evicted alone is
 * not appended to); 14 "1" when the lifetimes are renewed (lifetimes_due); 15 the room
 * (escaped) for the rooms set; 16 how many rooms a user keeps (max_rooms_per_user; "0": no
 * bound); 17 now (ms: the room's score); then the history (appending: only its new messages).
 * The state is one HSET of rev, created_at, last_activity and v: the dialog's parts as keys
 * of their own (params, dialog, awaiting, soft) took 28 arguments and 2 to 6 calls more a
 * save until issue 39's ninth round (docs/state.md, "What the scripts cost Redis").
 * The rooms set is a ZSET scored by each room's last save that rewrote the dialog or renewed
 * the lifetimes (ms; an append's room is in it already, and writing its score at every save
 * was one call of a turn's 12, issue 39's eighth round): a new room past ARGV[16]
 * takes the user's least recently used ones out of it, and the answer is then
 * {code, evicted room, ...}, the gateway deleting their keys (undeclared keys are not the
 * script's to touch). A rooms SET of an older version is made a ZSET at its first ZADD.
 * A key's lifetime is set whenever this save makes the key (the rooms set's ZADD adds the
 * room, the state's HSET adds fields, a list appended to had none, a rewritten list is made
 * anew), so no key is ever left without one; a key that was there keeps the lifetime it had
 * (HSET, RPUSH, LTRIM keep it) unless ARGV[14] renews them all.
 * Returns 1 when written, -3 (with nothing written, or what was taken back) when an append
 * finds another rev or a list of another length, 0 when Redis holds another incarnation, -1
 * a newer copy, -2 when
 * the lease is no longer this save's: another holder has it, or let it go with turns waiting
 * ("-<its ticket> w"), or the lock is gone and Redis's copy has a rev another gateway wrote
 * (a rev is "<holder>#<n>"), other than ARGV[3]: that gateway took the dialog over once
 * this turn's lease lapsed, saved and let go (a let-go lock no one waits for is deleted).
 * A lock gone with Redis's copy still this turn's (lapsed, evicted, lost in a failover) is
 * no one else's, and neither is this holder's own other lease (a failover to a replica that
 * had not received it, a later turn's taken before this save ran again as EVAL): the save
 * goes on (this process orders its own turns of a dialog); an append's rev check decides,
 * and a rewrite that finds a rev of this gateway's own answers -5, merged like any save that
 * meets another copy. A save that held the lease lets go of it, written or not, but for -3 (the
 * turn is then merged with Redis's copy, and its lease let go once that is written): the
 * lock is deleted, or, while turns of other gateways wait, "-<ticket> w" for the dialog's
 * lifetime.
 * An append whose rev is Redis's needs no look at created_at and last_activity: any other
 * incarnation, or any newer write, would have written another rev. So only a rewrite reads
 * them (an append to another incarnation gets -3, and its rewrite then 0). The rev is read
 * even while the lease is still exactly this save's: a write-back and a merge write with no
 * lease (modes 1 and 3), so another gateway's can land during this turn, and with a history
 * at its length the list's count would not show it (a held lease skipped this read until
 * issue 39's third round, and such a turn then wrote over the other's params, its copy
 * missing the other's messages).
 * An append pushes its messages first: RPUSH answers the list's length, which must be the
 * copy's and theirs, so the list is checked without an LLEN of its own (one call of the
 * turn's 13, issue 12). A list of another length (lapsed or evicted alone) has them taken
 * back (LTRIM of as many from its end; a list that was not there is empty again, so gone),
 * and the save is refused (-3).
 * Kept cheap for Redis, whose time this script is most of (issue 12): the lease is compared
 * whole first (still this save's, the common case) and taken apart only when it differs; no
 * table is made but for evicted rooms, and no closure but save(); an append trims the list
 * only when it would hold more than ARGV[12]; no number is turned into a string for a call
 * (Lua does that with sprintf's "%.14g", a float's formatting), and none read twice.
 */
static const char save_script[] =
    "local held, evicted, cur = false, nil, nil\n"
    "if ARGV[2] ~= '' then\n"
    "  cur = redis.call('GET', KEYS[3])\n"
    "  held = " LUA_LOCK_IS("ARGV[2]") "\n"
    "  if not held and cur then\n" /* held or let go by another gateway since: -2 */
    "    local from = string.byte(cur, 1) == 45 and 2 or 1\n"
    "    if string.find(cur, " LUA_HOLDER_OF("ARGV[2]") ", from, true) ~= from then return -2 end\n"
    "  elseif not held and (ARGV[1] == '0' or ARGV[1] == '4') then\n" /* the lock gone: Redis's rev says who wrote since */
    "    local rev = redis.call('HGET', KEYS[1], 'rev')\n"
    "    if rev and rev ~= ARGV[3] then\n"
    "      if string.find(rev, " LUA_HOLDER_OF("ARGV[2]") ", 1, true) ~= 1 then return -2 end\n"
    "      if ARGV[3] == '' then return -5 end\n"
    "    end\n"
    "  end\n"
    "end\n"
    "local function save()\n"
    "  if ARGV[1] == '2' and redis.call('EXISTS', KEYS[1], KEYS[2]) > 0 then return 0 end\n"
    "  local append, keep, had = ARGV[3] ~= '' and ARGV[1] ~= '3' and ARGV[1] ~= '4', tonumber(ARGV[12]), tonumber(ARGV[13])\n"
    "  local renew, h, n, pushed = ARGV[14] == '1', 18, #ARGV, 0\n"
    "  if append then\n"
    "    if redis.call('HGET', KEYS[1], 'rev') ~= ARGV[3] then return -3 end\n"
    "    if keep > 0 and n >= h then\n"
    "      local len\n"
    "      for i = h, n, 200 do\n"
    "        len = redis.call('RPUSH', KEYS[2], unpack(ARGV, i, math.min(i + 199, n)))\n"
    "      end\n"
    "      pushed = n - h + 1\n"
    "      if len ~= had + pushed then\n"
    "        redis.call('LTRIM', KEYS[2], 0, -pushed - 1)\n"
    "        return -3\n"
    "      end\n"
    "    elseif redis.call('LLEN', KEYS[2]) ~= had then\n"
    "      return -3\n"
    "    end\n"
    "  elseif ARGV[1] == '3' or ARGV[1] == '4' then\n" /* a merge, a turn's rewrite: only over the copy read */
    "    if (redis.call('HGET', KEYS[1], 'rev') or '') ~= ARGV[3] then return ARGV[1] == '3' and -4 or -3 end\n"
    "  else\n"
    "    local have = redis.call('HMGET', KEYS[1], 'created_at', 'last_activity')\n"
    "    if have[1] and have[1] ~= ARGV[5] then return 0 end\n"
    "    if ARGV[1] == '1' and have[2] and tonumber(have[2]) > tonumber(ARGV[6]) then return -1 end\n"
    "  end\n"
    "  local room = 0\n"
    "  if not append or renew then\n" /* an append's room is in the set: its score is renewed when the lifetimes are */
    "    room = redis.pcall('ZADD', KEYS[4], ARGV[17], ARGV[15])\n"
    "    if type(room) == 'table' then\n" /* a rooms SET of a version before the bound: made a ZSET */
    "      local old = redis.call('SMEMBERS', KEYS[4])\n"
    "      redis.call('DEL', KEYS[4])\n"
    "      for i = 1, #old do redis.call('ZADD', KEYS[4], '0', old[i]) end\n"
    "      room = redis.call('ZADD', KEYS[4], ARGV[17], ARGV[15])\n"
    "    end\n"
    "    if room == 1 or renew then redis.call('EXPIRE', KEYS[4], ARGV[10]) end\n"
    "  end\n"
    "  if room == 1 and ARGV[16] ~= '0' then\n"
    "    local over = redis.call('ZCARD', KEYS[4]) - tonumber(ARGV[16])\n"
    "    if over > 0 then\n" /* the oldest go, one more looked at: this room may tie with them */
    "      evicted = {}\n"
    "      for _, r in ipairs(redis.call('ZRANGE', KEYS[4], 0, over)) do\n"
    "        if r ~= ARGV[15] and #evicted < over then evicted[#evicted + 1] = r end\n"
    "      end\n"
    "      redis.call('ZREM', KEYS[4], unpack(evicted))\n"
    "    end\n"
    "  end\n"
    "  local added = redis.call('HSET', KEYS[1], 'rev', ARGV[4], 'created_at', ARGV[5], 'last_activity', ARGV[6], 'v', ARGV[7])\n"
    "  if added > 0 or renew then redis.call('EXPIRE', KEYS[1], ARGV[8]) end\n"
    "  if not append or keep == 0 then redis.call('DEL', KEYS[2]) end\n"
    "  if pushed == 0 then\n"
    "    for i = h, n, 200 do\n"
    "      redis.call('RPUSH', KEYS[2], unpack(ARGV, i, math.min(i + 199, n)))\n"
    "    end\n"
    "  end\n"
    "  if keep > 0 then\n"
    "    if append and had + n - h + 1 > keep then redis.call('LTRIM', KEYS[2], '-' .. ARGV[12], '-1') end\n"
    "    if not append or ARGV[13] == '0' or renew then redis.call('EXPIRE', KEYS[2], ARGV[9]) end\n"
    "  end\n"
    "  return 1\n"
    "end\n"
    "local code = save()\n"
    "if ARGV[2] ~= '' and code ~= -3 and cur then\n" /* the lock let go: deleted, or marked still */
    "  if string.byte(cur, -1) == 119 then redis.call('SET', KEYS[3], '-' .. (held and cur or ARGV[2] .. ' w'), 'EX', ARGV[11])\n"
    "  else redis.call('DEL', KEYS[3]) end\n"
    "end\n"
    "if evicted then table.insert(evicted, 1, code); return evicted end\n"
    "return code\n";

/* ---- limits per user (limits.h) ------------------------------------------------------- */

/*
 * The counts of a user's limits, under the user's hash tag with the dialogs, named so that
 * no dialog key can be one (those are "<room>:<part>", a room holding no ':'):
 *   P:{U}:limit:messages:<minute>   STRING  messages let through in that minute
 *   P:{U}:limit:turns:now           ZSET    turns running: "<holder>:<turn>" -> ms it lapses
 *   P:{U}:limit:tokens:m<minute>    STRING  tokens spent in that minute
 *   P:{U}:limit:tokens:d<day>       STRING  tokens spent that UTC day
 * A turn's place in the set lapses after LIMIT_SLOT_MS when its end never comes (its
 * gateway died): a user is never held back for longer by a lost turn.
 */
#define LIMIT_SLOT_MS 300000

/* P:{U}:limit:<what><n>, n left out when negative ("turns:now"). */
static void arg_limit_key(cg_argv *a, redis_store *rs, const char *eu, const char *what, long long n)
{
    size_t start = cg_argv_begin(a);
    cg_argv_put_key(a, rs->base.cfg.prefix, eu, "limit", what);
    if (n >= 0)
        cg_jsonw_int(&a->w, n);
    cg_argv_end(a, start);
}

/* "<holder>:<turn>": a turn's member of the user's set of turns running. */
static void arg_turn_member(cg_argv *a, redis_store *rs, uint64_t turn)
{
    size_t start = cg_argv_begin(a);
    cg_jsonw_raw(&a->w, rs->holder, strlen(rs->holder));
    CG_JSONW_LIT(&a->w, ":");
    cg_jsonw_int(&a->w, (long long)turn); /* a count from 1: far below 2^63 */
    cg_argv_end(a, start);
}

/*
 * A message against the limits, one atomic step: KEYS 1 messages this minute, 2 turns
 * running, 3 tokens this minute, 4 tokens today; ARGV 1 now (ms), 2 to 5 the limits
 * (messages a minute, turns at once, tokens a minute, tokens a day; 0: none), 6 the turn's
 * member, 7 its place's lifetime, 8 and 9 the ms to the next minute and day. Answers
 * {limit met (limits.h's numbers, 0: none), retry after ms (0 for turns: the gateway's hint)};
 * counts only a message let through. A number given as an argument goes to a call as its
 * text, not as a Lua number (which Lua would format again with "%.14g", as for the dialog's
 * scripts); only the two sums are numbers.
 */
static const char limit_script[] =
    "local now = tonumber(ARGV[1])\n"
    "local function over(limit, key) return limit > 0 and tonumber(redis.call('GET', key) or '0') >= limit end\n"
    "if over(tonumber(ARGV[5]), KEYS[4]) then return {1, tonumber(ARGV[9])} end\n"
    "if over(tonumber(ARGV[4]), KEYS[3]) then return {2, tonumber(ARGV[8])} end\n"
    "local messages = tonumber(ARGV[2])\n"
    "if over(messages, KEYS[1]) then return {3, tonumber(ARGV[8])} end\n"
    "local turns = tonumber(ARGV[3])\n"
    "if turns > 0 then\n"
    "  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', ARGV[1])\n"
    "  if redis.call('ZCARD', KEYS[2]) >= turns then return {4, 0} end\n"
    "  redis.call('ZADD', KEYS[2], now + tonumber(ARGV[7]), ARGV[6])\n"
    "  redis.call('PEXPIRE', KEYS[2], ARGV[7])\n"
    "end\n"
    "if messages > 0 then\n"
    "  redis.call('INCR', KEYS[1])\n"
    "  redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[8]) + 1000)\n"
    "end\n"
    "return {0, 0}\n";

/* A turn's end: KEYS 1 turns running, 2 tokens this minute, 3 tokens today; ARGV 1 the
 * turn's member, 2 its tokens, 3 and 4 how long the two counts live (ms). */
static const char limit_end_script[] =
    "redis.call('ZREM', KEYS[1], ARGV[1])\n"
    "local n = tonumber(ARGV[2])\n"
    "if n > 0 then\n"
    "  redis.call('INCRBY', KEYS[2], ARGV[2])\n"
    "  redis.call('PEXPIRE', KEYS[2], ARGV[3])\n"
    "  redis.call('INCRBY', KEYS[3], ARGV[2])\n"
    "  redis.call('PEXPIRE', KEYS[3], ARGV[4])\n"
    "end\n"
    "return 0\n";

static void limit_end(redis_store *rs, const char *eu, const cg_limits *lim, uint64_t turn, int local,
                      long long tokens);

/* The verdict: {limit met, retry after ms}; anything else is a Redis that is not ours to
 * trust: "unavailable", and degraded mode judges the message from memory. A turn let
 * through that is gone by now (its client left) ends here. */
static void on_limit_reply(cg_redis_conn *ac, void *reply_, void *priv)
{
    (void)ac;
    redis_req *r = priv;
    redis_store *rs = r->rs;
    redisReply *reply = reply_;
    if (cg_redis_reply_failed(rs, reply, 2, "limits (EVALSHA)") || reply->element[0]->type != REDIS_REPLY_INTEGER ||
        reply->element[1]->type != REDIS_REPLY_INTEGER || reply->element[0]->integer < CG_LIMIT_OK ||
        reply->element[0]->integer > CG_LIMIT_TURNS) {
        rs->base.stats.errors++;
        cg_redis_answer_unavailable(r);
        return;
    }
    cg_limit_verdict v = {(cg_limit_hit)reply->element[0]->integer, (long)reply->element[1]->integer, 0};
    if (v.hit == CG_LIMIT_TURNS)
        v.retry_after_ms = CG_LIMIT_TURN_RETRY_MS;
    static const cg_store_status ok = {0};
    if (!r->abandoned && !rs->closing)
        r->cb.limit(r->ctx, &v, &ok);
    else if (v.hit == CG_LIMIT_OK)
        limit_end(rs, r->eu, &r->limits, r->turn, 0, 0);
    cg_redis_req_finish(r);
}

static void send_limit(redis_store *rs, redis_req *r)
{
    int64_t now = cg_store_now_ms(&rs->base);
    cg_limit_clock c;
    cg_limit_clock_at(now, &c);
    cg_argv a = {0};
    cg_argv_str(&a, "EVALSHA");
    cg_argv_str(&a, script_sha[S_LIMIT]);
    cg_argv_str(&a, "4");
    arg_limit_key(&a, rs, r->eu, "messages:", c.minute);
    arg_limit_key(&a, rs, r->eu, "turns:now", -1);
    arg_limit_key(&a, rs, r->eu, "tokens:m", c.minute);
    arg_limit_key(&a, rs, r->eu, "tokens:d", c.day);
    cg_argv_int(&a, (long long)now);
    cg_argv_int(&a, (long long)r->limits.messages_per_minute);
    cg_argv_int(&a, (long long)r->limits.turns_at_once);
    cg_argv_int(&a, (long long)r->limits.tokens_per_minute);
    cg_argv_int(&a, (long long)r->limits.tokens_per_day);
    arg_turn_member(&a, rs, r->turn);
    cg_argv_int(&a, (long long)LIMIT_SLOT_MS);
    cg_argv_int(&a, (long long)c.to_minute_ms);
    cg_argv_int(&a, (long long)c.to_day_ms);
    send_last_script(rs, S_LIMIT, &a, on_limit_reply, r);
    cg_argv_free(&a);
}

/*
 * A user's rooms set (KEYS[1]): ARGV[1] "" lists it (escaped rooms), else takes that room out
 * of it. A ZSET since max_rooms_per_user; a SET a save of this version has not made one yet
 * is read as it is.
 */
static const char rooms_script[] =
    "local t = redis.call('TYPE', KEYS[1])['ok']\n"
    "if ARGV[1] == '' then\n"
    "  if t == 'zset' then return redis.call('ZRANGE', KEYS[1], 0, -1) end\n"
    "  if t == 'set' then return redis.call('SMEMBERS', KEYS[1]) end\n"
    "  return {}\n"
    "end\n"
    "if t == 'zset' then return redis.call('ZREM', KEYS[1], ARGV[1]) end\n"
    "if t == 'set' then return redis.call('SREM', KEYS[1], ARGV[1]) end\n"
    "return 0\n";

/* EVALSHA <rooms script> 1 <the user's rooms set> <room or ""> */
static void arg_rooms_script(redis_store *rs, cg_argv *a, const char *eu, const char *er)
{
    cg_argv_str(a, "EVALSHA");
    cg_argv_str(a, script_sha[S_ROOMS]);
    cg_argv_str(a, "1");
    cg_argv_key(a, rs->base.cfg.prefix, eu, NULL, "rooms");
    cg_argv_str(a, er);
}

static const char *script_text(script_id id)
{
    static const char *const texts[S_COUNT] = {load_script,   save_script,  renew_script,     release_script,
                                               cancel_script, limit_script, limit_end_script, rooms_script};
    return texts[id];
}

/* Redis kept its own copy (save_script's 0, -1 or -2, once merging it was tried as often as
 * it may be): this one is dropped, from memory too, so the next load reads Redis's. */
static void save_refused(redis_store *rs, redis_req *r, long long why)
{
    rs->base.stats.save_conflicts++;
    cg_warn("redis %s:%d: a %s of a dialog was not written: Redis holds %s; its copy is kept", rs->host, rs->port,
            r->version ? "write-back" : "save",
            why == 0    ? "another copy (this one began while Redis was away)"
            : why == -2 ? "a copy whose lease another gateway holds"
            : why == -5 ? "a copy this turn's lease no longer guards (its lock was gone)"
                        : "a newer copy");
    cg_fallback_forget(rs->fb, r->key); /* the next load reads Redis's copy */
}

static void save_answered(redis_store *rs, redis_req *r, redisReply *reply);
static int release_kept(redis_store *rs, redis_req *r, char **kept);
static int release_leases(redis_store *rs, redis_req *r);
static void merges_spent(redis_store *rs, redis_req *r, long long code);

static void on_rooms_del_reply(cg_redis_conn *ac, void *reply_, void *priv)
{
    (void)ac;
    (void)priv;
    redisReply *reply = reply_;
    if (reply && reply->type == REDIS_REPLY_ERROR)
        cg_warn("redis: the dialogs of rooms over max_rooms_per_user were not deleted: %s (they lapse)", reply->str);
}

/*
 * A save that made a new room past max_rooms_per_user answers {code, the user's least
 * recently used rooms (escaped), taken out of the rooms set}: their keys go (one DEL, one
 * hash tag), and their copies here; the answer is then read as the code alone. A reply of
 * any other shape is left as it is (save_answered judges it).
 */
static redisReply *save_evictions(redis_store *rs, redis_req *r, redisReply *reply)
{
    if (!reply || reply->type != REDIS_REPLY_ARRAY || reply->elements < 2 ||
        reply->element[0]->type != REDIS_REPLY_INTEGER)
        return reply;
    cg_argv a = {0};
    cg_argv_str(&a, "DEL");
    size_t n = 0;
    for (size_t i = 1; i < reply->elements; i++) {
        redisReply *room = reply->element[i];
        if (room->type != REDIS_REPLY_STRING)
            continue;
        char *er = cg_strndup(room->str, room->len); /* stored escaped, as the keys use it */
        char *key = cg_store_key_join(r->eu, er); /* the gateway's key of that dialog */
        cg_fallback_remove(rs->fb, key);
        arg_dialog_keys(rs, &a, r->eu, er, &all_keys);
        free(key);
        free(er);
        n++;
    }
    rs->base.stats.evictions_rooms += n;
    cg_info("redis: a user's new room passed max_rooms_per_user (%ld): %zu least recently used forgotten",
            rs->base.cfg.max_rooms_per_user, n);
    if (n && cg_redis_send_argv(rs, &a, on_rooms_del_reply, NULL) < 0)
        cg_warn("redis: the dialogs of rooms over max_rooms_per_user could not be deleted now (they lapse)");
    cg_argv_free(&a);
    return reply->element[0];
}

/* ---- merging two copies of a dialog ------------------------------------------------------ */

static void on_merge_loaded(void *ctx, cg_dialog *d, const cg_store_status *st)
{
    redis_req *r = ctx;
    redis_store *rs = r->rs;
    if (st->unavailable) { /* Redis failed meanwhile: the save stays in memory, for the write-back */
        rs->base.stats.errors++;
        release_leases(rs, r);
        gate_leave(rs, r->key);
        cg_redis_answer_unavailable(r);
        return;
    }
    if (!r->merge_rev) /* the load's answer names Redis's rev (load_answer) */
        r->merge_rev = cg_strdup("");
    long added;
    /* both copies held turns the other lacked (a conflict, counted below): Redis's last
     * message is not among this copy's (its older ones may be, or cut by the window) */
    int both = st->found && json_array_size(d->history) && !cg_dialog_goes_on_from(r->snapshot, d);
    if (!st->found) { /* Redis has no copy (restarted empty, expired): this one goes as it is */
        cg_dialog_free(d);
        added = cg_dialog_copy(d, r->snapshot) < 0 ? -1 : 0;
    } else {
        /* a turn whose lease another gateway took began before that gateway's turns: where
         * both set a part, theirs is the newer, though this one saved last */
        if (r->lease_lost && r->snapshot->last_activity > d->last_activity)
            r->snapshot->last_activity = d->last_activity;
        added = cg_dialog_merge(d, r->snapshot, &rs->base.cfg.lifetimes);
    }
    cg_dialog *merged = added >= 0 ? cg_malloc(sizeof(*merged)) : NULL;
    if (!merged) {
        cg_dialog_free(d);
        cg_error("redis: out of memory merging two copies of a dialog: this gateway's is kept for the write-back");
        release_leases(rs, r);
        gate_leave(rs, r->key);
        cg_redis_answer_unavailable(r);
        return;
    }
    *merged = *d; /* d's parts move to merged */
    if (added > 0 && both) { /* a conflict, resolved (until issue 39's fourth round counted by
                              * the merge's length, which the window of history_n could hide) */
        rs->base.stats.merges++;
        rs->base.stats.merged_messages += (unsigned long)added;
        cg_warn("redis: dialog #%08lx had two copies (two gateways served it while the store switched, or a turn "
                "met another's write): merged, %ld message(s) of this gateway's added to Redis's (%s)",
                cg_store_key_tag(r->key), added, r->version ? "write-back" : "save");
    }
    cg_redis_snapshot_free(r->snapshot);
    r->snapshot = merged;
    /* a merge keeps every turn: it writes over Redis's copy only as it read it, with no lease;
     * the turn's own (an append refused -3 keeps it) is let go once that write is answered */
    if (r->lease_value && !r->release_after)
        r->release_after = r->lease_value;
    else
        free(r->lease_value);
    r->lease_value = NULL;
    r->full = 1;
    char *key = cg_strdup(r->key);
    cg_redis_send_save(rs, r); /* holds the gate in its turn */
    gate_leave(rs, key);
    free(key);
}

void cg_redis_send_writeback(redis_store *rs, redis_req *r)
{
    merge_start(rs, r);
}

/* r's save met another copy in Redis: Redis's is read in full (no lease), the two merged
 * (cg_dialog_merge), and the merge written where Redis still holds the copy read (save mode
 * 3, its rev), else read and merged again, up to MERGE_TRIES times. r lives on meanwhile. */
static void merge_start(redis_store *rs, redis_req *r)
{
    gate_enter(rs, r->key); /* later loads of the dialog wait for the merge's save */
    r->merges++;
    redis_req *l = cg_redis_req_new_escaped(rs, CG_STORE_LOAD, r->eu, r->er, r);
    l->cb.load = on_merge_loaded;
    l->full = 1;
    send_load(rs, l);
}

static void on_save_reply(cg_redis_conn *ac, void *reply_, void *priv)
{
    (void)ac;
    redis_req *r = priv;
    redis_store *rs = r->rs;
    redisReply *reply = reply_;
    reply = save_evictions(rs, r, reply);
    char *key = cg_strdup(r->key); /* r may be finished below; the gate opens last */
    if (!reply || reply->type != REDIS_REPLY_INTEGER || reply->integer > 0 || !r->snapshot) {
        save_answered(rs, r, reply);
    } else if (r->merges >= MERGE_TRIES) {
        merges_spent(rs, r, reply->integer);
    } else {
        /* Redis holds a copy other than the one this save began from (-3: appending found
         * another rev; 0, -1: another incarnation, or a newer copy; -4: the copy merged with
         * changed again; -2: the lease passed to another gateway, which may have saved; -5: a
         * rewrite found the lock gone and a copy this gateway wrote in Redis): both
         * copies' turns are kept, merged. This turn was answered: dropping it would lose it. */
        if (reply->integer == -2) {
            r->lease_lost = 1;
            rs->base.stats.lease_lost++;
            cg_warn("redis %s:%d: a turn's save found the dialog's lease passed to another gateway while this one was "
                    "away past redis.lease_ms (stopped, or cut off): its turn is merged into Redis's copy",
                    rs->host, rs->port);
        }
        merge_start(rs, r);
    }
    gate_leave(rs, key);
    free(key);
}

/* A save whose merges all met a copy newer still (-4: another writer saved between each
 * merge's read and its write): its turns are answered ones, so they are not dropped, as a
 * refused save's are, but kept in memory, dirty (the merged copy, with the other's turns),
 * and written back later like an outage's. Its lease is let go meanwhile. */
static void merges_spent(redis_store *rs, redis_req *r, long long code)
{
    rs->base.stats.save_conflicts++;
    cg_warn("redis %s:%d: a %s of dialog #%08lx met a newer copy after each of %d merges (%lld): kept in memory, "
            "written back later",
            rs->host, rs->port, r->version ? "write-back" : "save", cg_store_key_tag(r->key), MERGE_TRIES, code);
    if (!release_leases(rs, r))
        wake_waiters(rs, r->key);
    cg_redis_answer_unavailable(r);
}

/* A turn's lease that a save did not let go (an append refused -3 keeps it, and the merge
 * that follows writes with none): let go now (*kept, freed). 1 when the release went: its
 * answer wakes the gateways waiting for the lease. */
static int release_kept(redis_store *rs, redis_req *r, char **kept)
{
    int sent = *kept && lease_release(rs, r->eu, r->er, *kept) == 0;
    free(*kept);
    *kept = NULL;
    return sent;
}

/* A merge that ends without writing: the turn's lease, whichever round holds it (the first
 * moves it to release_after), is let go. 1 when a release went (its answer wakes waiters). */
static int release_leases(redis_store *rs, redis_req *r)
{
    int sent = release_kept(rs, r, &r->lease_value);
    return release_kept(rs, r, &r->release_after) | sent;
}

static void save_answered(redis_store *rs, redis_req *r, redisReply *reply)
{
    int failed = cg_redis_reply_failed(rs, reply, 0, "save") || reply->type != REDIS_REPLY_INTEGER;
    /* a merge's lease (the turn's, kept till now); and the turn's own when the script failed
     * (-OOM, -NOREPLICAS, -BUSY, a cluster's TRYAGAIN past its tries: it never ran, or stopped
     * before letting go), which no one would let go before it lapses */
    int released = failed ? release_leases(rs, r) : release_kept(rs, r, &r->release_after);
    if (!released)
        wake_waiters(rs, r->key); /* the save let the lease go (or it was not ours) */
    if (failed) {
        rs->base.stats.errors++;
        cg_redis_answer_unavailable(r); /* keeps it in memory, dirty, for the write-back */
        return;
    }
    int written = reply->integer == 1;
    cg_fallback_written(rs->fb, r->key, r->version, written); /* a write-back's end */
    if (!written) {
        save_refused(rs, r, reply->integer);
    } else if (!r->version || (r->merges && !cg_fallback_is_dirty(rs->fb, r->key))) {
        /* Redis's copy, of this rev (a merge's, unless a newer write of the dialog waits in
         * memory: that one stays, and is merged in its turn) */
        cg_memstore_keep(cg_fallback_copy(rs->fb), r->key, r->snapshot, rs->base.now(rs->base.clock_ctx), r->rev,
                         r->renewed);
        rs->base.stats.saves_appended += (unsigned long)r->appended;
    }
    static const cg_store_status ok = {0};
    if (!r->abandoned && !rs->closing && r->cb.done)
        r->cb.done(r->ctx, &ok);
    cg_redis_req_finish(r);
}

static void put_int_member(cg_jsonw *w, const char *name_lit, size_t name_len, long long n)
{
    cg_jsonw_raw(w, name_lit, name_len);
    cg_jsonw_int(w, n);
}
#define PUT_INT(w, lit, n) put_int_member((w), (lit), sizeof(lit) - 1, (n))

/* An awaiting state or soft context with its end, or null and 0 when it has none or it is
 * over. Its time left, when longer, is how long the state must live (*longest). */
static void put_expiring(cg_jsonw *w, const char *name, const char *expires_name, json_t *value, int64_t expires,
                         int64_t now, int64_t *longest)
{
    int live = value && expires > now;
    cg_jsonw_raw(w, name, strlen(name));
    cg_jsonw_json_or_null(w, live ? value : NULL);
    cg_jsonw_raw(w, expires_name, strlen(expires_name));
    cg_jsonw_int(w, live ? (long long)expires : 0);
    if (live && expires - now > *longest)
        *longest = expires - now;
}

/*
 * The state's v: the dialog but its history, as cg_dialog_to_json writes it (the keys
 * cg_dialog_from_json reads), written straight into the argument, with params_until and
 * dialog_until, the times its params and the rest lapse (the state is one key, which lives
 * the longest of their lifetimes: dialog_from_state leaves out what lapsed). *longest grows
 * to an awaiting state's or soft context's time left when that is longer.
 */
static void arg_state(cg_argv *a, const cg_dialog *d, const cg_lifetimes *lt, int64_t now, int64_t *longest)
{
    size_t start = cg_argv_begin(a);
    cg_jsonw *w = &a->w;
    CG_JSONW_LIT(w, "{\"service\":");
    size_t at = w->used;
    cg_jsonw_str(w, d->service, d->service ? strlen(d->service) : 0); /* NULL: null */
    cg_jsonw_null_if_failed(w, at);
    CG_JSONW_LIT(w, ",\"params\":");
    cg_jsonw_json_or_null(w, d->params);
    put_expiring(w, ",\"awaiting\":", ",\"awaiting_expires\":", d->awaiting, d->awaiting_expires, now, longest);
    put_expiring(w, ",\"soft_context\":", ",\"soft_expires\":", d->soft, d->soft_expires, now, longest);
    PUT_INT(w, ",\"meta\":{\"created_at\":", (long long)d->created_at);
    PUT_INT(w, ",\"last_activity\":", (long long)d->last_activity);
    PUT_INT(w, ",\"turn_count\":", (long long)d->turn_count);
    PUT_INT(w, ",\"message_count\":", (long long)d->message_count);
    CG_JSONW_LIT(w, "},\"last_tool_result\":");
    cg_jsonw_json_or_null(w, d->last_tool_result);
    if (d->usage) {
        CG_JSONW_LIT(w, ",\"usage\":");
        cg_jsonw_json_or_null(w, d->usage);
    }
    PUT_INT(w, ",\"params_until\":", (long long)(now + lt->params_s));
    PUT_INT(w, ",\"dialog_until\":", (long long)(now + lt->dialog_s));
    CG_JSONW_LIT(w, "}");
    cg_argv_end(a, start);
}

/*
 * Where the new messages of a save's history start, when the history can be appended to
 * Redis's list: the gateway's copy is of a known rev, and the history goes on from that
 * copy's (cg_dialog_history_kept); the save script checks that the rev is still Redis's and
 * that its list holds the copy's *n_had messages. -1 when it must be rewritten.
 */
static long history_appended_from(const cg_memstore_view *copy, json_t *history, size_t *n_had)
{
    json_t *had = copy->rev ? copy->history : NULL;
    *n_had = json_array_size(had);
    return had ? cg_dialog_history_kept(had, history) : -1;
}

/*
 * Does a save renew the lifetimes of the dialog's keys in Redis (docs/state.md, "Lifetimes
 * in Redis")? Renewing is an EXPIRE a key, five a turn: a fifth of the Lua calls of a turn,
 * and as many for Redis as the rest of its work on them (issue 12). So a save renews them
 * when its keys' lifetimes were last set (renewed, the gateway's copy's; 0 unknown) a
 * sixtieth of the shortest of the three lifetimes ago or more: with the defaults, at most
 * every 30 s of a dialog's turns, and a key lapses between 29.5 and 30 minutes after the
 * last save instead of 30. A lifetime under a minute renews at every save.
 */
static int lifetimes_due(const cg_lifetimes *lt, int64_t renewed, int64_t now)
{
    int64_t shortest = lt->params_s;
    if (lt->dialog_s < shortest)
        shortest = lt->dialog_s;
    if (lt->history_s < shortest)
        shortest = lt->history_s;
    return renewed <= 0 || now - renewed >= shortest / 60;
}

/* A room's last use, for the order of the rooms set: the store's clock in ms (CHATGATE_NOW
 * moves it), so that the turns of one second keep their order, across gateways too. A clock
 * a test put in its place has whole seconds only. */
static long long room_score(redis_store *rs)
{
    if (rs->base.now == cg_store_default_now)
        return cg_store_default_now_ms();
    return (long long)rs->base.now(rs->base.clock_ctx) * 1000;
}

void cg_redis_send_save(redis_store *rs, redis_req *r)
{
    const cg_lifetimes *lt = &rs->base.cfg.lifetimes;
    int64_t now = rs->base.now(rs->base.clock_ctx);
    const cg_dialog *d = r->snapshot; /* only read, into the arguments */
    cg_argv a = {0};
    const int64_t state_lifetime = lt->dialog_s > lt->params_s ? lt->dialog_s : lt->params_s;
    int64_t state_s = state_lifetime; /* how long the state lives: longer for an awaiting state or soft context */
    int64_t longest_lifetime = state_s > lt->history_s ? state_s : lt->history_s; /* the rooms set's, at least */

    cg_memstore_view copy; /* the gateway's copy: what this save can append to */
    cg_memstore_view_of(cg_fallback_copy(rs->fb), r->key, now, &copy);
    size_t n_had = 0;
    long from = r->version || r->full || r->merge_rev ? -1 : history_appended_from(&copy, d->history, &n_had);
    if (from < 0 && copy.rev && !r->merge_rev && !r->version && r->merges < MERGE_TRIES) {
        /* this turn's dialog does not go on from the copy Redis holds now (another gateway
         * wrote it since this one was loaded, or a write-back merged it): rewriting it would
         * drop what the other wrote, so the two merge */
        merge_start(rs, r);
        return;
    }
    /* the save script's mode (its comment). 4: a turn's rewrite under its lease while the
     * gateway holds no copy with a rev (evicted since the load, or the load left parts out),
     * only over the rev that load read, since a write-back or merge of another gateway (no
     * lease) may have landed meanwhile */
    char mode = r->merge_rev                                                    ? '3'
                : r->base_unknown || cg_fallback_base_unknown(rs->fb, r->key) ? '2'
                : r->version                                                  ? '1'
                : from < 0 && !copy.rev && r->lease_value && r->base_rev      ? '4'
                                                                              : '0';
    arg_script(rs, &a, S_SAVE, r->eu, r->er);
    cg_argv_arg(&a, &mode, 1);
    cg_argv_str(&a, r->lease_value ? r->lease_value : "");
    cg_argv_str(&a, r->merge_rev ? r->merge_rev : from >= 0 ? copy.rev : mode == '4' ? r->base_rev : ""); /* the rev it must find */
    /* a new rev for every write, write-backs too: a copy another gateway holds of an older one
     * must never pass for this one */
    free(r->rev);
    r->rev = holder_numbered(rs, ++rs->rev_seq);
    cg_argv_str(&a, r->rev);
    cg_argv_int(&a, (long long)d->created_at);
    cg_argv_int(&a, (long long)d->last_activity);
    arg_state(&a, d, lt, now, &state_s);
    int64_t longest = state_s > longest_lifetime ? state_s : longest_lifetime; /* the rooms set's */
    cg_argv_int(&a, (long long)state_s);
    cg_argv_int(&a, (long long)lt->history_s);
    cg_argv_int(&a, (long long)longest);
    cg_argv_int(&a, (long long)lt->dialog_s); /* how long a lock let go with turns waiting says so */
    cg_argv_int(&a, (long long)(json_array_size(d->history)));
    cg_argv_int(&a, (long long)n_had);
    /* a rewrite makes its keys anew, and an awaiting or soft context that outlives the state's
     * lifetime needs the state's renewed (an append's HSET keeps the lifetime it had: the
     * awaiting state it adds would go with it), and the rooms set's when it outlives all
     * three (longest then passes longest_lifetime too): those renew at once */
    int renew = from < 0 || state_s > state_lifetime || lifetimes_due(lt, copy.renewed, now);
    r->renewed = renew ? now : copy.renewed;
    cg_argv_str(&a, renew ? "1" : "0");
    cg_argv_str(&a, r->er);
    cg_argv_int(&a, (long long)rs->base.cfg.max_rooms_per_user);
    cg_argv_int(&a, room_score(rs)); /* the room's last use, its score */
    for (size_t i = from >= 0 ? (size_t)from : 0; i < json_array_size(d->history); i++)
        cg_argv_json(&a, json_array_get(d->history, i));
    r->appended = from >= 0;

    gate_enter(rs, r->key);
    if (send_last_script(rs, S_SAVE, &a, on_save_reply, r) < 0) {
        gate_leave(rs, r->key);
    } else {
        if (!r->version && !r->merges && !r->merge_rev)
            gate_note_plain(rs, r);
        /* a Sentinel's or a cluster's failover may promote a replica that lacks this save
         * (replication is asynchronous): what was saved lately is written again then
         * (cg_fallback_moved). A cluster's saves went unnoted until issue 39's seventh round,
         * so a cluster failover wrote nothing again */
        if (rs->master || rs->n_seeds)
            cg_fallback_note_saved(rs->fb, r->key, r->eu, r->er);
    }
    cg_argv_free(&a);
}

/* ---- remove ---------------------------------------------------------------------------- */

static void on_remove_reply(cg_redis_conn *ac, void *reply_, void *priv)
{
    (void)ac;
    redis_req *r = priv;
    redis_store *rs = r->rs;
    if (cg_redis_reply_failed(rs, reply_, 0, "delete") || r->step_failed) {
        rs->base.stats.errors++;
        cg_redis_answer_unavailable(r);
        return;
    }
    if (r->kind == CG_STORE_REMOVE)
        cg_fallback_remove(rs->fb, r->key);
    static const cg_store_status ok = {0};
    if (!r->abandoned && !rs->closing && r->cb.done)
        r->cb.done(r->ctx, &ok);
    cg_redis_req_finish(r);
}

static void send_remove(redis_store *rs, redis_req *r)
{
    cg_argv a = {0};
    cg_argv_str(&a, "DEL");
    arg_dialog_keys(rs, &a, r->eu, r->er, &all_keys);
    send_step(rs, &a, r);
    arg_rooms_script(rs, &a, r->eu, r->er); /* after the data: forget-user must find a room as long as it has data */
    send_last_script(rs, S_ROOMS, &a, on_remove_reply, r);
    cg_argv_free(&a);
}

/* ---- the ops --------------------------------------------------------------------------- */

/* Starts r on Redis, or answers it unavailable when the link is down (degraded mode, in
 * front of the store, answers from memory then: a delete while degraded is refused, 503 at
 * the admin API). */
static void dispatch(redis_store *rs, redis_req *r)
{
    int connected = cg_redis_linked(rs) && !rs->closing;
    if (r->kind == CG_STORE_LOAD && connected) {
        if (send_load_behind(rs, r) < 0 && !gated(rs, r))
            send_load(rs, r);
    } else if (r->kind == CG_STORE_SAVE && r->snapshot && connected) {
        cg_redis_send_save(rs, r);
    } else if (r->kind == CG_STORE_REMOVE && connected) {
        if (!gated(rs, r)) /* behind a save of the dialog in flight, as loads are */
            send_remove(rs, r);
    } else if (r->kind == CG_STORE_LIMIT && connected) {
        send_limit(rs, r);
    } else if ((r->kind == CG_STORE_ROOMS || r->kind == CG_STORE_REMOVE_USER) && connected) {
        /* both start from the user's rooms set */
        cg_argv a = {0};
        arg_rooms_script(rs, &a, r->eu, "");
        send_last_script(rs, S_ROOMS, &a, r->kind == CG_STORE_ROOMS ? on_room_list : on_rooms_reply, r);
        cg_argv_free(&a);
    } else {
        cg_redis_answer_later_unavailable(r);
    }
}

/* Requests made before the first connection is decided wait for it (a gateway just started
 * has not had its PING answered yet), rather than being served from an empty memory. */
static void start_or_wait(redis_store *rs, redis_req *r)
{
    if (cg_redis_linked(rs) || rs->base.stats.degraded || rs->closing) {
        dispatch(rs, r);
        return;
    }
    if (rs->waiting_tail)
        rs->waiting_tail->wait_next = r;
    else
        rs->waiting = r;
    rs->waiting_tail = r;
}

void cg_redis_drain_waiting(redis_store *rs)
{
    redis_req *r = rs->waiting;
    rs->waiting = rs->waiting_tail = NULL;
    while (r) {
        redis_req *next = r->wait_next;
        r->wait_next = NULL;
        dispatch(rs, r);
        r = next;
    }
}

static redis_req *load(cg_store *st, const char *user, const char *room, int lease, cg_store_load_fn cb,
                          void *ctx)
{
    redis_store *rs = (redis_store *)st;
    redis_req *r = cg_redis_req_new(rs, CG_STORE_LOAD, user, room, ctx);
    r->cb.load = cb;
    r->lease = lease;
    start_or_wait(rs, r);
    return r;
}

static cg_store_req *rs_load(cg_store *st, const char *user, const char *room, cg_store_load_fn cb, void *ctx)
{
    return (cg_store_req *)load(st, user, room, 0, cb, ctx);
}

/* A turn's load: the dialog's lease comes with it (waiting while another gateway holds it),
 * kept until the turn's save or rs_release. */
static cg_store_req *rs_lease(cg_store *st, const char *user, const char *room, cg_store_load_fn cb, void *ctx)
{
    return (cg_store_req *)load(st, user, room, 1, cb, ctx);
}

static cg_store_req *rs_save(cg_store *st, const char *user, const char *room, const cg_dialog *d,
                             cg_store_done_fn cb, void *ctx)
{
    redis_store *rs = (redis_store *)st;
    redis_req *r = cg_redis_req_new(rs, CG_STORE_SAVE, user, room, ctx);
    r->cb.done = cb;
    r->snapshot = cg_redis_snapshot(d);
    if (!r->snapshot) /* out of memory: nothing written, nothing overwritten */
        cg_error("redis %s:%d: out of memory: a dialog was not saved", rs->host, rs->port);
    json_t *held = json_object_get(rs->leases, r->key);
    if (held) { /* the turn's lease: the save writes only while it holds, and lets go of it */
        r->lease_value = cg_strdup(json_string_value(json_object_get(held, "v")));
        const char *base = json_string_value(json_object_get(held, "r"));
        r->base_rev = base ? cg_strdup(base) : NULL;
        json_object_del(rs->leases, r->key);
    }
    start_or_wait(rs, r);
    return (cg_store_req *)r; /* its first fields are cg_store_req's */
}

static cg_store_req *rs_remove(cg_store *st, const char *user, const char *room, cg_store_done_fn cb, void *ctx)
{
    redis_store *rs = (redis_store *)st;
    redis_req *r = cg_redis_req_new(rs, CG_STORE_REMOVE, user, room, ctx);
    r->cb.done = cb;
    start_or_wait(rs, r);
    return (cg_store_req *)r; /* its first fields are cg_store_req's */
}

static void arg_limit_key(cg_argv *a, redis_store *rs, const char *eu, const char *what, long long n);

/* A user's limit counts that may still live: this and the last minute's, today's and
 * yesterday's (a count outlives its window a little), and the turns running. */
static void arg_limit_keys(cg_argv *a, redis_store *rs, const char *eu)
{
    cg_limit_clock c;
    cg_limit_clock_at(cg_store_now_ms(&rs->base), &c);
    for (int back = 0; back < 2; back++) {
        arg_limit_key(a, rs, eu, "messages:", c.minute - back);
        arg_limit_key(a, rs, eu, "tokens:m", c.minute - back);
        arg_limit_key(a, rs, eu, "tokens:d", c.day - back);
    }
    arg_limit_key(a, rs, eu, "turns:now", -1);
}

/* Second step of remove_user: the rooms are known; every dialog's keys, the rooms set and
 * the user's limit counts go in one DEL (one hash tag: the user's), so nothing is left half
 * forgotten, nor counts that would outlive the user by a day. */
static void on_rooms_reply(cg_redis_conn *ac, void *reply_, void *priv)
{
    (void)ac;
    redis_req *r = priv;
    redis_store *rs = r->rs;
    redisReply *reply = reply_;
    if (cg_redis_reply_failed(rs, reply, 0, "forget user (its rooms)") || reply->type != REDIS_REPLY_ARRAY || !cg_redis_linked(rs)) {
        rs->base.stats.errors++;
        cg_redis_answer_unavailable(r);
        return;
    }
    cg_argv a = {0};
    cg_argv_str(&a, "DEL");
    for (size_t i = 0; i < reply->elements; i++) {
        redisReply *room = reply->element[i];
        if (room->type != REDIS_REPLY_STRING)
            continue;
        char *er = cg_strndup(room->str, room->len); /* stored escaped, as the keys use it */
        arg_dialog_keys(rs, &a, r->eu, er, &all_keys);
        free(er);
    }
    cg_argv_key(&a, rs->base.cfg.prefix, r->eu, NULL, "rooms");
    cg_redis_profile_key(rs, &a, r->eu);
    arg_limit_keys(&a, rs, r->eu);
    send_last(rs, &a, on_remove_reply, r);
    cg_argv_free(&a);
}

/* The rooms set, as names: the rooms are stored escaped, as the keys use them. */
static void on_room_list(cg_redis_conn *ac, void *reply_, void *priv)
{
    (void)ac;
    redis_req *r = priv;
    redis_store *rs = r->rs;
    redisReply *reply = reply_;
    if (cg_redis_reply_failed(rs, reply, 0, "rooms") || reply->type != REDIS_REPLY_ARRAY) {
        rs->base.stats.errors++;
        cg_redis_answer_unavailable(r);
        return;
    }
    json_t *rooms = json_array();
    for (size_t i = 0; rooms && i < reply->elements; i++) {
        redisReply *e = reply->element[i];
        if (e->type != REDIS_REPLY_STRING)
            continue;
        char *room = cg_store_unescape(e->str, e->len);
        json_array_append_new(rooms, json_string(room)); /* a name that is not UTF-8 is left out */
        free(room);
    }
    static const cg_store_status ok = {0};
    if (!r->abandoned && !rs->closing)
        r->cb.rooms(r->ctx, rooms, &ok);
    json_decref(rooms);
    cg_redis_req_finish(r);
}

static cg_store_req *rs_rooms(cg_store *st, const char *user, cg_store_rooms_fn cb, void *ctx)
{
    redis_store *rs = (redis_store *)st;
    redis_req *r = cg_redis_req_new(rs, CG_STORE_ROOMS, user, "", ctx);
    r->cb.rooms = cb;
    start_or_wait(rs, r);
    return (cg_store_req *)r; /* its first fields are cg_store_req's */
}

static cg_store_req *rs_remove_user(cg_store *st, const char *user, cg_store_done_fn cb, void *ctx)
{
    redis_store *rs = (redis_store *)st;
    redis_req *r = cg_redis_req_new(rs, CG_STORE_REMOVE_USER, user, "", ctx);
    r->cb.done = cb;
    cg_profiles_remove(rs->profiles, r->eu);
    json_object_del(rs->profile_pending, r->eu); /* a change made while Redis was away goes too */
    start_or_wait(rs, r);
    return (cg_store_req *)r; /* its first fields are cg_store_req's */
}

static cg_store_req *rs_limit(cg_store *st, const char *user, const cg_limits *lim, uint64_t turn,
                              cg_store_limit_fn cb, void *ctx)
{
    redis_store *rs = (redis_store *)st;
    redis_req *r = cg_redis_req_new(rs, CG_STORE_LIMIT, user, "", ctx);
    r->cb.limit = cb;
    r->limits = *lim;
    r->turn = turn;
    start_or_wait(rs, r);
    return (cg_store_req *)r; /* its first fields are cg_store_req's */
}

static void on_limit_end_reply(cg_redis_conn *ac, void *reply_, void *priv)
{
    (void)ac;
    (void)priv;
    redisReply *reply = reply_;
    if (reply && reply->type == REDIS_REPLY_ERROR)
        cg_warn("redis: a turn's end was not counted against its user's limits: %s", reply->str);
}

/* A turn counted in Redis ended: its place there goes, its tokens count there. (One
 * counted in memory, or ending while Redis is away, degraded mode ends.) With the link down
 * just now it cannot be told: the place lapses (LIMIT_SLOT_MS), the tokens are not counted. */
static void limit_end(redis_store *rs, const char *eu, const cg_limits *lim, uint64_t turn, int local,
                      long long tokens)
{
    (void)lim;
    (void)local;
    int64_t now = cg_store_now_ms(&rs->base);
    if (cg_redis_linked(rs)) { /* closing too: the link drains, and the place is let go */
        cg_limit_clock c;
        cg_limit_clock_at(now, &c);
        cg_argv a = {0};
        cg_argv_str(&a, "EVALSHA");
        cg_argv_str(&a, script_sha[S_LIMIT_END]);
        cg_argv_str(&a, "3");
        arg_limit_key(&a, rs, eu, "turns:now", -1);
        arg_limit_key(&a, rs, eu, "tokens:m", c.minute);
        arg_limit_key(&a, rs, eu, "tokens:d", c.day);
        arg_turn_member(&a, rs, turn);
        cg_argv_int(&a, (long long)tokens);
        cg_argv_int(&a, (long long)(c.to_minute_ms + 1000));
        cg_argv_int(&a, (long long)(c.to_day_ms + 1000));
        if (send_script(rs, S_LIMIT_END, &a, on_limit_end_reply, NULL) < 0)
            cg_warn("redis: a turn's end was not counted against its user's limits: the link is down");
        cg_argv_free(&a);
    }
}

static void rs_limit_end(cg_store *st, const char *user, const cg_limits *lim, uint64_t turn, int local,
                         long long tokens)
{
    char *eu = cg_store_escape(user);
    limit_end((redis_store *)st, eu, lim, turn, local, tokens);
    free(eu);
}

const cg_store_dialog_ops cg_redis_dialog_ops = {
    .load = rs_load,
    .save = rs_save,
    .remove = rs_remove,
    .remove_user = rs_remove_user,
    .rooms = rs_rooms,
};

const cg_store_lease_ops cg_redis_lease_ops = {.acquire = rs_lease, .release = rs_release};

const cg_store_limit_ops cg_redis_limit_ops = {.take = rs_limit, .end = rs_limit_end};

const cg_store_bus_ops cg_redis_bus_ops = {.cancel_remote = rs_cancel_remote};
