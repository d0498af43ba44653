/*
 * fuzz_chunk.c: libFuzzer target for the streamed chunk reader (upstream/chunk.h): any bytes,
 * as an upstream could send them in an event's data, must never crash, leak or read outside
 * the input, and whenever cg_chunk_read takes a chunk as plain, its content and finish must
 * be what openai.c's jansson path takes from the same bytes (chunk_ref.h).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../unit/upstream/chunk_ref.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char *copy = malloc(size ? size : 1); /* exact size: ASan sees a read past it */
    if (!copy)
        return 0;
    memcpy(copy, data, size);
    chunk_ref r;
    chunk_ref_read(&r, copy, size);
    cg_chunk k;
    if (cg_chunk_read(&k, copy, size) && !chunk_ref_agrees(&k, &r))
        __builtin_trap();
    cg_chunk_free(&k);
    chunk_ref_free(&r);
    free(copy);
    return 0;
}
