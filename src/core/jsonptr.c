/*
 * jsonptr.c: RFC 6901 JSON Pointer lookup on jansson values.
 */
#include <stdlib.h>
#include <string.h>

#include "chatgate/core/jsonptr.h"

int cg_json_pointer_valid(const char *ptr)
{
    if (!ptr || (*ptr && *ptr != '/'))
        return 0;
    for (const char *p = ptr; *p; p++)
        if (*p == '~' && p[1] != '0' && p[1] != '1')
            return 0;
    return 1;
}

/* Unescapes one reference token [s, e) into out (~1 -> '/', ~0 -> '~'). */
static void unescape(const char *s, const char *e, char *out)
{
    for (; s < e; s++) {
        if (*s == '~' && s + 1 < e) {
            *out++ = s[1] == '1' ? '/' : '~';
            s++;
        } else {
            *out++ = *s;
        }
    }
    *out = 0;
}

json_t *cg_json_pointer_get(json_t *root, const char *ptr)
{
    if (!cg_json_pointer_valid(ptr))
        return NULL;
    json_t *cur = root;
    char token[512];
    for (const char *p = ptr; cur && *p == '/';) {
        const char *start = p + 1;
        const char *end = strchr(start, '/');
        if (!end)
            end = start + strlen(start);
        if ((size_t)(end - start) >= sizeof(token))
            return NULL;
        unescape(start, end, token);
        if (json_is_object(cur)) {
            cur = json_object_get(cur, token);
        } else if (json_is_array(cur)) {
            char *stop;
            unsigned long i = strtoul(token, &stop, 10);
            /* an index is digits without a leading zero; "-" (past the end) names nothing */
            if (!*token || *stop || (token[0] == '0' && token[1]))
                return NULL;
            cur = json_array_get(cur, i);
        } else {
            return NULL;
        }
        p = end;
    }
    return cur;
}
