/*
 * STAND-IN for tests only: what the fake libcuda hands the fake cuda-checkpoint
 * through cuGetExportTable, so both drive one state machine.
 */
#ifndef STANDIN_TABLE_H
#define STANDIN_TABLE_H

#include <stddef.h>

typedef struct {
    unsigned char old_uuid[16];
    unsigned char new_uuid[16];
} standin_pair;

typedef struct {
    size_t size;
    int (*op)(const char *caller, const char *step, int pid, unsigned int timeout_ms, const standin_pair *pairs,
              unsigned int npairs, int *out);
    int (*init)(const char *caller);
} standin_table;

#endif
