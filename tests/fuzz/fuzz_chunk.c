/*
 * fuzz_chunk.c: libFuzzer target for the streamed chunk reader (upstream/chunk.h): any bytes,
 * as an upstream could send them in an event's data, must never crash, leak or read outside
 * the input, and whenever cg_chunk_read takes a chunk as plain, its content and finish must
 * be what openai.c's jansson path takes from the same bytes (chunk_ref.h). The input up to
 * its first newline is read first, as a reply's first chunk whose head is kept (chunk.h), then
 * the rest with that head: both held to jansson.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../unit/upstream/chunk_ref.h"

/* Reads data[0..size) both ways, the reader with head: they must agree. */
static void read_one(cg_chunk_head *head, const uint8_t *data, size_t size)
{
    char *copy = malloc(size ? size : 1); /* exact size: ASan sees a read past it */
    if (!copy)
        return;
    memcpy(copy, data, size);
    chunk_ref r;
    chunk_ref_read(&r, copy, size);
    cg_chunk k;
    if (cg_chunk_read(&k, head, copy, size) && !chunk_ref_agrees(&k, &r))
        __builtin_trap();
    cg_chunk_free(&k);
    chunk_ref_free(&r);
    free(copy);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    cg_chunk_head head = {0};
    const uint8_t *nl = memchr(data, '\n', size);
    size_t first = nl ? (size_t)(nl - data) : size;
    read_one(&head, data, first);
    read_one(&head, nl ? nl + 1 : data, nl ? size - first - 1 : size);
    return 0;
}
