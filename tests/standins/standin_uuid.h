/*
 * STAND-IN for tests only: GPU UUID text -> the 16 bytes of a CUuuid, for the
 * world (the gpus file) and the fake cuda-checkpoint (--device-map) alike.
 */
#ifndef STANDIN_UUID_H
#define STANDIN_UUID_H

#include <stddef.h>
#include <string.h>

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* The first len bytes of "GPU-1a2b3c4d-...." (or "MIG-...") -> 16 bytes; 0 on success. */
static int standin_parse_uuid(const char *text, size_t len, unsigned char out[16]) {
    if (len >= 4 && (strncmp(text, "GPU-", 4) == 0 || strncmp(text, "MIG-", 4) == 0)) {
        text += 4;
        len -= 4;
    }
    int n = 0;
    for (size_t i = 0; i < len && n < 32; i++) {
        if (text[i] == '-') continue;
        int v = hexval(text[i]);
        if (v < 0) return -1;
        if (n % 2 == 0)
            out[n / 2] = (unsigned char)(v << 4);
        else
            out[n / 2] |= (unsigned char)v;
        n++;
    }
    return n == 32 ? 0 : -1;
}

#endif
