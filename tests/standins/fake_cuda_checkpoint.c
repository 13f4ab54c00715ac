/*
 * STAND-IN for tests only: a fake `cuda-checkpoint` executable.
 *
 * Like the real one (a ~6 KB stub importing cuDriverGetVersion and
 * cuGetExportTable from libcuda.so.1), everything it does comes from the
 * driver library it is linked with, here the fake libcuda, so its states,
 * strings and exit codes are the driver's:
 *
 *   --help                                  help text of the driver's version (R550: --toggle only;
 *                                           R555+: --get-state, --action, --timeout, --get-restore-tid;
 *                                           R580+: --device-map)
 *   --get-state --pid P                     prints running | locked | checkpointed | failed
 *   --action lock|checkpoint|restore|unlock --pid P [--timeout MS] [--device-map OLD=NEW,...]
 *   --toggle --pid P                        running <-> checkpointed
 *   --get-restore-tid --pid P               prints the restore thread id
 *
 * On failure: `Could not <action> on process ID <pid>: "<cuGetErrorString>"`
 * (`Error toggling CUDA in process ID ...` for --toggle) on stderr, exit status
 * the CUresult truncated to 8 bits. A driver older than CUDA 12.4 (R550):
 * `Insufficient driver`, exit 255.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "standin_table.h"
#include "standin_uuid.h"

extern int cuDriverGetVersion(int *version);
extern int cuGetExportTable(const void **table, const void *id);
extern int cuGetErrorString(int error, const char **text);

static const char *release_of(int version) {
    const char *env = getenv("HIBERNATE_STANDIN_DRIVER_RELEASE");
    if (env && *env) return env;
    if (version >= 13000) return "580.95.05";
    if (version >= 12090) return "575.57.08";
    if (version >= 12080) return "570.86.10";
    if (version >= 12050) return "555.42.06";
    return "550.54.15";
}

static void help(int version) {
    printf("CUDA checkpoint and restore utility (test stand-in).\n");
    printf("Version %s.\n\n", release_of(version));
    if (version < 12050) {
        printf("    --toggle --pid <value>\n        Toggle the CUDA state of the process.\n\n");
        printf("    --help\n        This text.\n");
        return;
    }
    printf("Operations:\n");
    printf("--get-state --pid <pid>\n        Print the checkpoint state of <pid>\n\n");
    printf("--action lock | checkpoint | restore | unlock --pid <pid> [--timeout <ms>]");
    if (version >= 13000) printf(" [--device-map <old>=<new>,...]");
    printf("\n        Perform one action on <pid>; lock takes an optional timeout in milliseconds.\n\n");
    printf("--toggle --pid <pid>\n        Switch <pid> between running and checkpointed\n\n");
    printf("--get-restore-tid --pid <pid>\n        Print the CUDA restore thread ID of <pid>\n\n");
    printf("Options:\n--pid|-p <pid>\n--timeout|-t <timeout>\n");
    if (version >= 13000) printf("--device-map <old uuid>=<new uuid>,...\n        GPUs to restore onto\n");
    printf("--help|-h\n");
}

static int parse_map(const char *map, standin_pair *pairs, unsigned int max) {
    unsigned int n = 0;
    const char *p = map;
    while (*p && n < max) {
        const char *comma = strchr(p, ',');
        size_t len = comma ? (size_t)(comma - p) : strlen(p);
        const char *eq = memchr(p, '=', len);
        if (!eq) return -1;
        if (standin_parse_uuid(p, (size_t)(eq - p), pairs[n].old_uuid) != 0) return -1;
        if (standin_parse_uuid(eq + 1, len - (size_t)(eq - p) - 1, pairs[n].new_uuid) != 0) return -1;
        n++;
        p += len + (comma ? 1 : 0);
    }
    return (int)n;
}

static int fail(const char *what, int pid, int code) {
    const char *text = NULL;
    if (cuGetErrorString(code, &text) != 0 || !text) text = "unknown error";
    if (strcmp(what, "toggle") == 0)
        fprintf(stderr, "Error toggling CUDA in process ID %d: \"%s\"\n", pid, text);
    else
        fprintf(stderr, "Could not %s on process ID %d: \"%s\"\n", what, pid, text);
    return code & 0xff;
}

int main(int argc, char **argv) {
    int version = 0;
    if (cuDriverGetVersion(&version) != 0 || version < 12040) {
        fprintf(stderr, "Insufficient driver\n");
        return 255;
    }
    const char *action = NULL, *map = NULL;
    int pid = -1, get_state = 0, toggle = 0, get_tid = 0;
    unsigned int timeout_ms = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *next = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            help(version);
            return 0;
        } else if ((!strcmp(a, "--pid") || !strcmp(a, "-p")) && next) {
            pid = atoi(next);
            i++;
        } else if (!strcmp(a, "--toggle")) {
            toggle = 1;
        } else if (version >= 12050 && !strcmp(a, "--get-state")) {
            get_state = 1;
        } else if (version >= 12050 && !strcmp(a, "--get-restore-tid")) {
            get_tid = 1;
        } else if (version >= 12050 && !strcmp(a, "--action") && next) {
            action = next;
            i++;
        } else if (version >= 12050 && (!strcmp(a, "--timeout") || !strcmp(a, "-t")) && next) {
            timeout_ms = (unsigned int)strtoul(next, NULL, 10);
            i++;
        } else if (version >= 13000 && !strcmp(a, "--device-map") && next) {
            map = next;
            i++;
        } else {
            fprintf(stderr, "Unknown option: %s\n", a);
            help(version);
            return 1;
        }
    }
    if (pid <= 0 || (!action && !get_state && !toggle && !get_tid)) {
        help(version);
        return 1;
    }
    const standin_table *table = NULL;
    if (cuGetExportTable((const void **)&table, NULL) != 0 || !table) {
        fprintf(stderr, "Insufficient driver\n");
        return 255;
    }
    int code = table->init("binary");
    if (code != 0) {
        const char *text = NULL;
        if (cuGetErrorString(code, &text) != 0 || !text) text = "unknown error";
        fprintf(stderr, "Error initializing CUDA: \"%s\"\n", text);
        return code & 0xff;
    }
    int out = 0;
    if (get_state) {
        static const char *names[] = {"running", "locked", "checkpointed", "failed", "checkpointing", "restoring"};
        code = table->op("binary", "state", pid, 0, NULL, 0, &out);
        if (code) return fail("get state", pid, code);
        printf("%s\n", out >= 0 && out < 6 ? names[out] : "unknown");
        return 0;
    }
    if (get_tid) {
        code = table->op("binary", "restore-tid", pid, 0, NULL, 0, &out);
        if (code) return fail("get restore tid", pid, code);
        printf("%d\n", out);
        return 0;
    }
    if (toggle) {
        code = table->op("binary", "state", pid, 0, NULL, 0, &out);
        if (code) return fail("toggle", pid, code);
        const char *steps[2];
        if (out == 0) {
            steps[0] = "lock";
            steps[1] = "checkpoint";
        } else if (out == 2) {
            steps[0] = "restore";
            steps[1] = "unlock";
        } else {
            return fail("toggle", pid, 401);
        }
        for (int s = 0; s < 2; s++) {
            code = table->op("binary", steps[s], pid, 0, NULL, 0, &out);
            if (code) return fail("toggle", pid, code);
        }
        return 0;
    }
    standin_pair pairs[16];
    int npairs = 0;
    if (map) {
        if (strcmp(action, "restore") != 0 || (npairs = parse_map(map, pairs, 16)) <= 0) {
            fprintf(stderr, "Invalid device map: %s\n", map);
            return 1;
        }
    }
    if (strcmp(action, "lock") && strcmp(action, "checkpoint") && strcmp(action, "restore") &&
        strcmp(action, "unlock")) {
        fprintf(stderr, "Unknown action: %s\n", action);
        return 1;
    }
    code = table->op("binary", action, pid, strcmp(action, "lock") == 0 ? timeout_ms : 0, pairs,
                     (unsigned int)npairs, &out);
    if (code) return fail(action, pid, code);
    return 0;
}
