/*
 * export.c: the turn export (export.h): records made where turns end, held in one bounded
 * queue, and taken from the loop by one of two sinks.
 *
 *   redis: each record is one XADD (store.h's stream table, over the store's link), at most
 *          EXPORT_REDIS_IN_FLIGHT at once. While Redis is away the append fails at once and
 *          the queue waits for a retry a second later; a record whose XADD failed on its way
 *          goes back to the queue's front.
 *   file:  records are written as JSON lines, a batch at a time, by uv_fs_write on libuv's
 *          thread pool, to a file opened O_APPEND (so a rename under it, or another worker
 *          appending too, never makes lines overlap). One file operation at a time: open,
 *          fstat, write, close, rename each hand on to the next from their callback. A write
 *          or open that fails keeps the batch and tries again a second later (a full disk).
 *          Past export.max_bytes the file is renamed to PATH.1 and a new one opened; SIGHUP
 *          reopens PATH (the operator renamed it).
 *
 * The bound (export.max_queue) counts the records queued and those on their way (a batch
 * being written, XADDs unanswered): memory stays bounded whatever the sink does.
 */
#define _GNU_SOURCE /* asprintf */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include "chatgate/core/alloc.h"
#include "chatgate/core/log.h"
#include "chatgate/server/export.h"

#define EXPORT_REDIS_IN_FLIGHT 64      /* XADDs unanswered at once */
#define EXPORT_BATCH_BYTES (256 << 10) /* a file write takes records up to about this much */
#define EXPORT_RETRY_MS 1000           /* the sink was away: tried again after this */

/* One record: its JSON and a newline (the file's line; the stream's value without it). */
typedef struct export_item {
    struct export_item *next;
    cg_exporter *ex;
    size_t len; /* with the newline */
    char line[];
} export_item;

/* The file's one operation under way, if any. */
typedef enum { FILE_IDLE, FILE_OPENING, FILE_STATTING, FILE_WRITING, FILE_CLOSING, FILE_RENAMING } file_op;

struct cg_exporter {
    uv_loop_t *loop;
    const cg_config *cfg;
    cg_store *store;   /* export.to redis: the gateway's */
    cg_metrics *m;
    int to_file;
    char gateway[300]; /* "host:pid": which gateway made a record */
    unsigned long long seq; /* the last record's number in this process */
    export_item *head, *tail; /* queued, oldest first */
    long queued;
    long on_way; /* redis: XADDs unanswered; file: records in the batch */
    uv_timer_t retry;
    int retry_armed, closing, retry_closed;
    int away_logged; /* the sink's failure is logged once an outage */
    /* file */
    uv_fs_t req;
    file_op op;
    uv_file fd; /* -1: closed */
    int64_t size;
    int reopen_wanted, rotate_wanted;
    char *rotated; /* "PATH.1" */
    char *batch;   /* lines being written: batch_len bytes, batch_off of them written */
    size_t batch_len, batch_off, batch_cap;
};

static void export_pump(cg_exporter *ex);

/* ---- the queue ---------------------------------------------------------------------- */

static void export_gauge(cg_exporter *ex)
{
    ex->m->export_queued = (unsigned long)(ex->queued + ex->on_way);
}

static void queue_push(cg_exporter *ex, export_item *it)
{
    it->next = NULL;
    if (ex->tail)
        ex->tail->next = it;
    else
        ex->head = it;
    ex->tail = it;
    ex->queued++;
}

/* A record the sink failed goes first again (it is the oldest). */
static void queue_push_front(cg_exporter *ex, export_item *it)
{
    it->next = ex->head;
    ex->head = it;
    if (!ex->tail)
        ex->tail = it;
    ex->queued++;
}

static export_item *queue_pop(cg_exporter *ex)
{
    export_item *it = ex->head;
    if (!it)
        return NULL;
    ex->head = it->next;
    if (!ex->head)
        ex->tail = NULL;
    ex->queued--;
    return it;
}

/* Drops every queued record (the end, with no sink to take them): counted. */
static void queue_drop_all(cg_exporter *ex)
{
    export_item *it;
    while ((it = queue_pop(ex))) {
        ex->m->export_dropped++;
        free(it);
    }
    export_gauge(ex);
}

static void maybe_free(cg_exporter *ex)
{
    if (!ex->closing || !ex->retry_closed || ex->on_way || ex->op != FILE_IDLE || ex->fd >= 0)
        return;
    free(ex->batch);
    free(ex->rotated);
    free(ex);
}

static void on_retry(uv_timer_t *t)
{
    cg_exporter *ex = t->data;
    ex->retry_armed = 0;
    export_pump(ex);
}

/* The sink is away: the queue waits, and it is tried again a little later (never while
 * closing: what is left then is dropped). */
static void export_retry_later(cg_exporter *ex)
{
    if (ex->closing || ex->retry_armed)
        return;
    ex->retry_armed = 1;
    uv_timer_start(&ex->retry, on_retry, EXPORT_RETRY_MS, 0);
}

/* ---- redis: one XADD a record ------------------------------------------------------- */

static void on_appended(void *ctx, int ok)
{
    export_item *it = ctx;
    cg_exporter *ex = it->ex;
    ex->on_way--;
    if (ok) {
        ex->m->export_records++;
        ex->away_logged = 0;
        free(it);
    } else if (ex->closing) {
        ex->m->export_dropped++;
        free(it);
    } else {
        queue_push_front(ex, it); /* Redis may have taken it: a consumer may see it twice */
        export_retry_later(ex);   /* not at once: an error answer would come back at once */
    }
    export_gauge(ex);
    if (ex->closing)
        maybe_free(ex);
    else
        export_pump(ex);
}

static void redis_pump(cg_exporter *ex)
{
    const cg_store_stream_ops *stream = ex->store->ops->stream;
    if (ex->retry_armed)
        return;
    while (ex->head && (ex->closing || ex->on_way < EXPORT_REDIS_IN_FLIGHT)) {
        export_item *it = queue_pop(ex);
        if (stream->append(ex->store, ex->cfg->export_stream, "turn", it->line, it->len - 1, ex->cfg->export_max_len,
                           on_appended, it) < 0) {
            queue_push_front(ex, it);
            if (!ex->away_logged)
                cg_warn("export: Redis is away: turn records wait in memory (export.max_queue %ld, then dropped)",
                        ex->cfg->export_max_queue);
            ex->away_logged = 1;
            export_retry_later(ex);
            break;
        }
        ex->on_way++;
    }
    export_gauge(ex);
}

/* ---- file: JSON lines through libuv's thread pool ----------------------------------- */

static void file_start_open(cg_exporter *ex);

/* The file's sink failed (what: the operation): logged once an outage; tried again later. */
static void file_away(cg_exporter *ex, const char *what, ssize_t result)
{
    if (!ex->away_logged)
        cg_error("export: %s %s: %s; turn records wait in memory (export.max_queue %ld, then dropped)", what,
                 ex->cfg->export_path, uv_strerror((int)result), ex->cfg->export_max_queue);
    ex->away_logged = 1;
    export_retry_later(ex);
}

static void on_file_stat(uv_fs_t *req)
{
    cg_exporter *ex = req->data;
    ex->size = req->result == 0 ? (int64_t)req->statbuf.st_size : 0;
    uv_fs_req_cleanup(req);
    ex->op = FILE_IDLE;
    export_pump(ex);
}

static void on_file_open(uv_fs_t *req)
{
    cg_exporter *ex = req->data;
    ssize_t result = req->result;
    uv_fs_req_cleanup(req);
    ex->op = FILE_IDLE;
    if (result < 0) {
        file_away(ex, "cannot open", result);
        if (ex->closing)
            export_pump(ex);
        return;
    }
    ex->fd = (uv_file)result;
    ex->op = FILE_STATTING;
    uv_fs_fstat(ex->loop, &ex->req, ex->fd, on_file_stat);
}

static void file_start_open(cg_exporter *ex)
{
    ex->reopen_wanted = 0; /* this open is the reopen asked for */
    ex->op = FILE_OPENING;
    uv_fs_open(ex->loop, &ex->req, ex->cfg->export_path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0640, on_file_open);
}

static void on_file_renamed(uv_fs_t *req)
{
    cg_exporter *ex = req->data;
    if (req->result < 0)
        cg_warn("export: cannot rename %s to %s: %s (the file goes on growing)", ex->cfg->export_path, ex->rotated,
                uv_strerror((int)req->result));
    uv_fs_req_cleanup(req);
    file_start_open(ex);
}

static void on_file_closed(uv_fs_t *req)
{
    cg_exporter *ex = req->data;
    uv_fs_req_cleanup(req);
    ex->fd = -1;
    ex->op = FILE_IDLE;
    if (ex->closing) {
        maybe_free(ex);
        return;
    }
    if (ex->rotate_wanted) {
        ex->rotate_wanted = 0;
        ex->op = FILE_RENAMING;
        uv_fs_rename(ex->loop, &ex->req, ex->cfg->export_path, ex->rotated, on_file_renamed);
        return;
    }
    file_start_open(ex);
}

static void file_start_close(cg_exporter *ex)
{
    ex->reopen_wanted = 0;
    ex->op = FILE_CLOSING;
    uv_fs_close(ex->loop, &ex->req, ex->fd, on_file_closed);
}

static void on_file_written(uv_fs_t *req)
{
    cg_exporter *ex = req->data;
    ssize_t result = req->result;
    uv_fs_req_cleanup(req);
    ex->op = FILE_IDLE;
    if (result < 0) {
        /* the batch stays: written again (whole or its rest) once the file takes it */
        file_away(ex, "cannot write", result);
        if (ex->closing) { /* nowhere to go: the end drops it */
            ex->m->export_dropped += (unsigned long)ex->on_way;
            ex->on_way = 0;
            ex->batch_len = ex->batch_off = 0;
        }
        export_pump(ex);
        return;
    }
    ex->batch_off += (size_t)result;
    ex->size += result;
    if (ex->batch_off == ex->batch_len) {
        ex->m->export_records += (unsigned long)ex->on_way;
        ex->on_way = 0;
        ex->batch_len = ex->batch_off = 0;
        ex->away_logged = 0;
        export_gauge(ex);
        if (ex->cfg->export_max_bytes > 0 && ex->size >= ex->cfg->export_max_bytes)
            ex->rotate_wanted = 1;
    }
    export_pump(ex);
}

/* Moves queued records into the batch, up to about EXPORT_BATCH_BYTES (one at least). */
static void file_fill_batch(cg_exporter *ex)
{
    export_item *it;
    while (ex->head && (ex->batch_len == 0 || ex->batch_len + ex->head->len <= EXPORT_BATCH_BYTES)) {
        it = queue_pop(ex);
        if (ex->batch_len + it->len > ex->batch_cap) {
            ex->batch_cap = ex->batch_len + it->len > EXPORT_BATCH_BYTES ? ex->batch_len + it->len : EXPORT_BATCH_BYTES;
            ex->batch = cg_realloc(ex->batch, ex->batch_cap);
        }
        memcpy(ex->batch + ex->batch_len, it->line, it->len);
        ex->batch_len += it->len;
        ex->on_way++;
        free(it);
    }
}

/* The file's next operation, when none is under way: a reopen or rotation asked for, the
 * open after a failure, or the next batch. */
static void file_pump(cg_exporter *ex)
{
    if (ex->op != FILE_IDLE || ex->retry_armed)
        return;
    if (ex->fd >= 0 && (ex->reopen_wanted || ex->rotate_wanted) && ex->batch_len == 0) {
        file_start_close(ex);
        return;
    }
    if (ex->fd < 0) {
        if (ex->closing) { /* the file went and could not come back: what is left is dropped */
            queue_drop_all(ex);
            maybe_free(ex);
        } else if (!ex->retry_armed) {
            file_start_open(ex);
        }
        return;
    }
    if (ex->batch_len == 0)
        file_fill_batch(ex);
    export_gauge(ex);
    if (ex->batch_len == 0) {
        if (ex->closing)
            file_start_close(ex);
        return;
    }
    uv_buf_t buf = uv_buf_init(ex->batch + ex->batch_off, (unsigned)(ex->batch_len - ex->batch_off));
    ex->op = FILE_WRITING;
    uv_fs_write(ex->loop, &ex->req, ex->fd, &buf, 1, -1, on_file_written);
}

static void export_pump(cg_exporter *ex)
{
    if (ex->to_file)
        file_pump(ex);
    else
        redis_pump(ex);
}

/* ---- the record --------------------------------------------------------------------- */

/* Wall-clock now as 2026-11-22T05:50:00.123Z. */
static void iso_now(char *out, size_t outlen)
{
    struct timeval tv;
    struct tm tm;
    gettimeofday(&tv, NULL);
    gmtime_r(&tv.tv_sec, &tm);
    size_t n = strftime(out, outlen, "%Y-%m-%dT%H:%M:%S", &tm);
    snprintf(out + n, outlen - n, ".%03dZ", (int)(tv.tv_usec / 1000));
}

static void set_str(json_t *o, const char *key, const char *s)
{
    json_object_set_new(o, key, s ? json_string(s) : json_null());
}

/* A text as the config wants it: as it is, or masked (NULL when it cannot be masked: never
 * the text as it was). len bytes of s. */
static json_t *export_text(const cg_exporter *ex, const char *s, size_t len)
{
    if (!s)
        return json_null();
    if (!ex->cfg->export_mask) {
        json_t *v = json_stringn(s, len);
        return v ? v : json_null();
    }
    char *copy = cg_strndup(s, len), *masked = cg_log_mask_dup(copy);
    json_t *v = masked ? json_string(masked) : NULL;
    free(copy);
    free(masked);
    return v ? v : json_null();
}

static json_t *record_usage(const cg_export_record *r)
{
    if (!r->has_usage)
        return json_null();
    return json_pack("{s:I,s:I,s:b}", "tokens_in", (json_int_t)r->tokens_in, "tokens_out", (json_int_t)r->tokens_out,
                     "reported", r->tokens_reported);
}

/* The record's JSON (docs/operations.md, "The turn export", lists its members). */
static json_t *record_json(cg_exporter *ex, const cg_export_record *r)
{
    char when[40];
    iso_now(when, sizeof(when));
    json_t *o = json_object();
    set_str(o, "time", when);
    set_str(o, "gateway", ex->gateway);
    json_object_set_new(o, "seq", json_integer((json_int_t)++ex->seq));
    set_str(o, "user", r->user);
    set_str(o, "room", r->room);
    set_str(o, "id", r->id);
    set_str(o, "service", r->service);
    json_object_set_new(o, "params", r->params ? json_incref(r->params) : json_object());
    json_object_set_new(o, "rules", r->rules ? json_incref(r->rules) : json_array());
    set_str(o, "route", r->route);
    set_str(o, "upstream", r->upstream);
    json_object_set_new(o, "replica", r->replica >= 0 ? json_integer(r->replica) : json_null());
    json_object_set_new(o, "attempts", r->attempts > 0 ? json_integer(r->attempts) : json_null());
    set_str(o, "fallback_from", r->fallback_from);
    set_str(o, "end", r->end);
    set_str(o, "code", r->code);
    json_object_set_new(o, "absorbed", json_boolean(r->absorbed));
    json_object_set_new(o, "truncated", json_boolean(r->truncated));
    json_object_set_new(o, "reply_rules", r->reply_rules ? json_incref(r->reply_rules) : json_null());
    json_object_set_new(o, "usage", record_usage(r));
    json_object_set_new(o, "first_byte_ms", r->first_byte_ms >= 0 ? json_real(r->first_byte_ms) : json_null());
    json_object_set_new(o, "total_ms", json_real(r->total_ms));
    if (ex->cfg->export_texts) {
        json_object_set_new(o, "text", export_text(ex, r->text, r->text ? strlen(r->text) : 0));
        json_object_set_new(o, "reply", export_text(ex, r->reply ? r->reply : "", r->reply_len));
    }
    return o;
}

void cg_export_turn(cg_exporter *ex, const cg_export_record *r)
{
    if (!ex || ex->closing)
        return;
    if (ex->queued + ex->on_way >= ex->cfg->export_max_queue) {
        ex->m->export_dropped++; /* the sink is slow or away: the turn goes on without its record */
        return;
    }
    json_t *o = record_json(ex, r);
    char *text = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    if (!text) {
        ex->m->export_dropped++;
        return;
    }
    size_t len = strlen(text);
    export_item *it = cg_malloc(sizeof(*it) + len + 1);
    it->ex = ex;
    it->len = len + 1;
    memcpy(it->line, text, len);
    it->line[len] = '\n';
    free(text);
    queue_push(ex, it);
    export_gauge(ex);
    export_pump(ex);
}

/* ---- open, reopen, close ------------------------------------------------------------- */

/* The file at start, opened at once (before the loop runs, so that a wrong path stops the
 * start with its name): 0, or -1 with err. */
static int file_open_now(cg_exporter *ex, char *err, size_t errlen)
{
    uv_fs_t req;
    int fd = uv_fs_open(NULL, &req, ex->cfg->export_path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0640, NULL);
    uv_fs_req_cleanup(&req);
    if (fd < 0) {
        snprintf(err, errlen, "export.path: cannot open %s for appending: %s", ex->cfg->export_path, uv_strerror(fd));
        return -1;
    }
    ex->fd = fd;
    if (uv_fs_fstat(NULL, &req, fd, NULL) == 0)
        ex->size = (int64_t)req.statbuf.st_size;
    uv_fs_req_cleanup(&req);
    return 0;
}

int cg_export_open(cg_exporter **out, uv_loop_t *loop, const cg_config *cfg, cg_store *store, cg_metrics *metrics,
                   char *err, size_t errlen)
{
    *out = NULL;
    if (!cfg->export_to)
        return 0;
    int to_file = strcmp(cfg->export_to, "file") == 0;
    if (!to_file && !store->ops->stream) { /* config.c refuses it; a store without streams is no sink */
        snprintf(err, errlen, "export.to redis: the %s store keeps no stream", store->ops->name);
        return -1;
    }
    cg_exporter *ex = cg_calloc(1, sizeof(*ex));
    ex->loop = loop;
    ex->cfg = cfg;
    ex->store = store;
    ex->m = metrics;
    ex->to_file = to_file;
    ex->fd = -1;
    ex->req.data = ex;
    char host[256] = "localhost";
    gethostname(host, sizeof(host) - 1);
    snprintf(ex->gateway, sizeof(ex->gateway), "%s:%d", host, (int)getpid());
    if (to_file) {
        if (asprintf(&ex->rotated, "%s.1", cfg->export_path) < 0 || file_open_now(ex, err, errlen) < 0) {
            free(ex->rotated);
            free(ex);
            return -1;
        }
    }
    uv_timer_init(loop, &ex->retry);
    ex->retry.data = ex;
    *out = ex;
    if (to_file)
        cg_info("export: turn records to %s%s", cfg->export_path,
                cfg->export_max_bytes > 0 ? ", renamed to .1 past export.max_bytes" : "");
    else
        cg_info("export: turn records to the Redis stream %s:%s (MAXLEN ~ %ld)", cfg->redis_prefix,
                cfg->export_stream, cfg->export_max_len);
    return 0;
}

void cg_export_reopen(cg_exporter *ex)
{
    if (!ex || !ex->to_file || ex->closing)
        return;
    cg_info("export: reopening %s", ex->cfg->export_path);
    ex->reopen_wanted = 1;
    if (ex->retry_armed) { /* away: try now, the operator may have mended it */
        uv_timer_stop(&ex->retry);
        ex->retry_armed = 0;
    }
    export_pump(ex);
}

static void on_retry_closed(uv_handle_t *h)
{
    cg_exporter *ex = h->data;
    ex->retry_closed = 1;
    maybe_free(ex);
}

void cg_export_close(cg_exporter *ex)
{
    if (!ex)
        return;
    ex->closing = 1;
    ex->retry_armed = 0;
    uv_close((uv_handle_t *)&ex->retry, on_retry_closed);
    export_pump(ex);
    if (!ex->to_file) /* what Redis would not take now is dropped; the XADDs sent are answered */
        queue_drop_all(ex);
}

const char *cg_export_kept_after_forget(const cg_config *cfg)
{
    if (!cfg->export_to)
        return NULL;
    if (strcmp(cfg->export_to, "file") == 0)
        return "the turn export's file (export.path) and its rotated copies keep this user's records: "
               "remove them there (each line's \"user\")";
    return "the turn export's Redis stream (export.stream) keeps this user's records until MAXLEN trims them: "
           "Redis cannot find a user's entries without reading the whole stream, so they are not deleted here "
           "(XRANGE and XDEL by the record's \"user\", or a consumer that drops them)";
}
