/*
 * rules.c: the rule set: loading it from a directory or a text, sharing it, freeing it
 * (see rules.h, and rules/README.md for the file format).
 *
 * Loading reads every *.rules file of a directory in file-name order and hands each to the
 * parser (rules_parse.c). Any mistake stops the load with "file:line: message" and frees
 * what was read, so a broken set never replaces a working one. A loaded set gets the match
 * data, match limit and JIT stack every evaluation of it uses (rules_eval.c), then is
 * read-only and counted: sessions hold references, and a reload swaps sets without
 * touching one a message in flight still uses.
 */
#include <dirent.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "chatgate/core/alloc.h"
#include "chatgate/core/file.h"
#include "chatgate/dialog/rules.h"
#include "chatgate/dialog/rules_internal.h"

static void rule_free(rule *r)
{
    json_decref(r->name_json);
    free(r->pattern);
    pcre2_code_free(r->re);
    pcre2_code_free(r->re_ascii);
    for (int i = 0; i < r->n_tests; i++) {
        free(r->tests[i].text);
        json_decref(r->tests[i].want);
    }
}

static void ruleset_free(cg_ruleset *rs)
{
    for (size_t i = 0; i < rs->n; i++)
        rule_free(&rs->rules[i]);
    free(rs->rules);
    for (size_t i = 0; i < rs->n_files; i++)
        free(rs->files[i]);
    free(rs->files);
    pcre2_match_data_free(rs->md);
    pcre2_jit_stack_free(rs->jit);
    pcre2_match_context_free(rs->mctx);
    free(rs);
}

cg_ruleset *cg_ruleset_ref(cg_ruleset *rs)
{
    if (rs)
        rs->refs++;
    return rs;
}

void cg_ruleset_unref(cg_ruleset *rs)
{
    if (rs && --rs->refs == 0)
        ruleset_free(rs);
}

int cg_ruleset_reads_previous(const cg_ruleset *rs)
{
    return rs && rs->reads_previous;
}

size_t cg_ruleset_count(const cg_ruleset *rs)
{
    return rs ? rs->n : 0;
}

const char *cg_ruleset_rule(const cg_ruleset *rs, size_t i, size_t *file, int *line)
{
    if (!rs || i >= rs->n)
        return NULL;
    *file = rs->rules[i].file_index;
    *line = rs->rules[i].line;
    return rs->rules[i].name;
}

size_t cg_ruleset_files(const cg_ruleset *rs)
{
    return rs ? rs->n_files : 0;
}

const char *cg_ruleset_file(const cg_ruleset *rs, size_t i)
{
    return rs && i < rs->n_files ? rs->files[i] : NULL;
}

const char *cg_ruleset_file_name(const cg_ruleset *rs, size_t i)
{
    const char *path = cg_ruleset_file(rs, i);
    const char *slash = path ? strrchr(path, '/') : NULL;
    return slash ? slash + 1 : path;
}

void cg_ruleset_count_into(cg_ruleset *rs, const cg_rules_counts *counts)
{
    rs->counts = *counts;
}

/* Shared by the parser, the normalisers and evaluation. */
char *cg_rules_trim(char *s)
{
    while (*s == ' ' || *s == '\t')
        s++;
    size_t n = strlen(s);
    while (n > 0 && (s[n - 1] == ' ' || s[n - 1] == '\t' || s[n - 1] == '\r' || s[n - 1] == '\n'))
        s[--n] = 0;
    return s;
}

/* Adds to map the bytes a match of code can begin with (PCRE2's start bitmap, or its first
 * code unit); 0 when PCRE2 does not know them, or the pattern can match nothing at all. */
static int first_bytes(const pcre2_code *code, int caseless, unsigned char map[32])
{
    const uint8_t *bits = NULL;
    uint32_t empty = 1, type = 0, unit = 0;
    if (pcre2_pattern_info(code, PCRE2_INFO_MATCHEMPTY, &empty) != 0 || empty ||
        pcre2_pattern_info(code, PCRE2_INFO_FIRSTCODETYPE, &type) != 0)
        return 0;
    if (type == 1) { /* one code unit begins every match (its other case too when caseless) */
        pcre2_pattern_info(code, PCRE2_INFO_FIRSTCODEUNIT, &unit);
        if (unit > 0xff || (caseless && unit >= 0x80))
            return 0;
        map[unit / 8] |= (unsigned char)(1u << (unit % 8));
        if (caseless && ((unit | 0x20) >= 'a' && (unit | 0x20) <= 'z'))
            map[(unit ^ 0x20) / 8] |= (unsigned char)(1u << ((unit ^ 0x20) % 8));
        return 1;
    }
    if (type != 0 || pcre2_pattern_info(code, PCRE2_INFO_FIRSTBITMAP, &bits) != 0 || !bits)
        return 0; /* a match at a line's start, or anywhere */
    for (int i = 0; i < 32; i++)
        map[i] |= bits[i];
    return 1;
}

/* The bytes a match of any mask or stop reply rule can begin with (rules_internal.h:
 * reply_first), of both forms of each pattern. PCRE2 knows none for the UTF form of most
 * patterns with \d or \w (Unicode's digits and letters begin with many bytes); a rule with
 * an ASCII form then counts every byte past ASCII: at an ASCII byte the two forms begin the
 * same matches (rules_parse.c, ascii_equivalent), so the ASCII form's bytes say it there. */
static void reply_first_bytes(cg_ruleset *rs)
{
    int known = rs->has_reply;
    for (size_t i = 0; i < rs->n && known; i++) {
        const rule *r = &rs->rules[i];
        if (!r->on_reply || r->action == A_TAG)
            continue;
        int ascii = r->re_ascii && first_bytes(r->re_ascii, !r->case_sensitive, rs->reply_first);
        int utf = first_bytes(r->re, !r->case_sensitive, rs->reply_first);
        if ((r->re_ascii && !ascii) || (!utf && !ascii))
            known = 0;
        else if (!utf)
            memset(rs->reply_first + 0x80 / 8, 0xff, 0x80 / 8);
    }
    rs->reply_first_known = known;
}

/* The match data and limits every evaluation of the set uses, whether it has reply rules,
 * and whether a message's rules read the previous message. */
static cg_ruleset *ruleset_finish(cg_ruleset *rs)
{
    uint32_t max_groups = 1;
    for (size_t i = 0; i < rs->n; i++) {
        const rule *r = &rs->rules[i];
        rs->has_reply |= r->on_reply;
        for (int k = 0; !r->on_reply && k < r->n_conds; k++)
            rs->reads_previous |= r->conds[k].kind == C_HISTORY;
        rs->reads_previous |= !r->on_reply && r->action == A_ENRICH;
        uint32_t c = 0;
        pcre2_pattern_info(rs->rules[i].re, PCRE2_INFO_CAPTURECOUNT, &c);
        if (c + 1 > max_groups)
            max_groups = c + 1;
    }
    reply_first_bytes(rs);
    rs->md = pcre2_match_data_create(max_groups, NULL);
    rs->mctx = pcre2_match_context_create(NULL);
    pcre2_set_match_limit(rs->mctx, CG_RULES_MATCH_LIMIT);
    pcre2_set_depth_limit(rs->mctx, 1000); /* the interpreter's; the JIT ignores it (rules/README.md) */
    rs->jit = pcre2_jit_stack_create(32 * 1024, 512 * 1024, NULL);
    pcre2_jit_stack_assign(rs->mctx, NULL, rs->jit);
    return rs;
}

static int is_rules_file(const struct dirent *e)
{
    size_t n = strlen(e->d_name);
    return e->d_name[0] != '.' && n > 6 && strcmp(e->d_name + n - 6, ".rules") == 0;
}

/* A rule file larger than this is refused (the shipped set is 35 KiB in all). */
#define CG_RULES_FILE_MAX_BYTES ((size_t)16 << 20)

/* Parses len bytes of a rule file's text (named name in messages) into rs: the parser reads
 * a stream, so the text is handed to it as one. 0, or -1 with the message in err. */
static int parse_text(cg_ruleset *rs, const char *name, const char *text, size_t len, char *err, size_t errlen)
{
    if (!len)
        return 0; /* fmemopen refuses an empty buffer; an empty file holds no rule */
    FILE *f = fmemopen((void *)text, len, "r");
    if (!f) {
        snprintf(err, errlen, "%s: %s", name, strerror(errno));
        return -1;
    }
    int rc = cg_rules_parse_file(rs, name, f, err, errlen);
    fclose(f);
    return rc;
}

/* Reads one rule file whole (core/file.h: never waiting on a FIFO without a writer, which a
 * reload on the loop would have) and parses it into rs. 0, or -1 with the message in err. */
static int load_file(cg_ruleset *rs, const char *path, char *err, size_t errlen)
{
    size_t len = 0;
    char *text = cg_file_read(path, CG_RULES_FILE_MAX_BYTES, &len, err, errlen);
    if (!text)
        return -1;
    int rc = parse_text(rs, path, text, len, err, errlen);
    free(text);
    return rc;
}

int cg_rules_load(const char *dir, cg_ruleset **out, char *err, size_t errlen)
{
    struct dirent **names;
    int n = scandir(dir, &names, is_rules_file, alphasort);
    if (n < 0) {
        snprintf(err, errlen, "%s: %s", dir, strerror(errno));
        return -1;
    }
    cg_ruleset *rs = cg_calloc(1, sizeof(*rs));
    rs->refs = 1;
    rs->files = cg_calloc((size_t)n + 1, sizeof(char *));
    int rc = 0;
    for (int i = 0; i < n; i++) {
        char path[4096];
        snprintf(path, sizeof(path), "%s/%s", dir, names[i]->d_name);
        rs->files[rs->n_files++] = cg_strdup(path);
        if (rc == 0)
            rc = load_file(rs, rs->files[rs->n_files - 1], err, errlen);
    }
    for (int i = 0; i < n; i++)
        free(names[i]);
    free(names);
    if (rc < 0) {
        ruleset_free(rs);
        return -1;
    }
    *out = ruleset_finish(rs);
    return 0;
}

int cg_rules_load_text(const char *name, const char *text, size_t len, cg_ruleset **out, char *err, size_t errlen)
{
    cg_ruleset *rs = cg_calloc(1, sizeof(*rs));
    rs->refs = 1;
    rs->files = cg_calloc(1, sizeof(char *));
    rs->files[rs->n_files++] = cg_strdup(name);
    if (parse_text(rs, rs->files[0], text, len, err, errlen) < 0) {
        ruleset_free(rs);
        return -1;
    }
    *out = ruleset_finish(rs);
    return 0;
}
