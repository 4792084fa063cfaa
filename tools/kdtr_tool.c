/*
 * kdtr_tool - list / verify KDTR bundles with include/kdtr.h (and a batch mode for fuzzing).
 *
 *   kdtr_tool list FILE          canonical table (header line, then one line per tensor), byte-identical
 *                                to `python -m k2vec.kdtr list`
 *   kdtr_tool verify FILE...     structure + every checksum; "FILE: OK ..." or an error, per file
 *   kdtr_tool fuzz CORPUS        CORPUS = records of [u64 LE length][bytes]; each record is copied
 *                                into its own exact-size heap block (so ASan sees any over-read)
 *                                and opened + verified; prints "<index> ok" or
 *                                "<index> err <offset> <field>" per record. Exits 3 if any
 *                                allocation by the reader exceeded that record's size.
 *
 * Exit status: 0 all good, 1 a bad bundle, 2 usage or I/O error.
 * Build: gcc -std=c11 -O2 -Wall -Wextra -Werror -Iinclude tools/kdtr_tool.c -o kdtr_tool
 */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* Every allocation the reader makes goes through here, so `fuzz` can check none exceeds the input. */
static size_t g_max_alloc;
static void *tool_malloc(size_t n) {
    if (n > g_max_alloc) g_max_alloc = n;
    return malloc(n);
}
#define KDTR_MALLOC(n) tool_malloc(n)
#define KDTR_FREE(p) free(p)
#include "kdtr.h"

typedef struct {
    const void *data;
    size_t size;
    int fd;
} mapped;

static int map_file(const char *path, mapped *m) {
    struct stat st;
    m->data = NULL;
    m->size = 0;
    m->fd = open(path, O_RDONLY);
    if (m->fd < 0 || fstat(m->fd, &st) != 0) {
        fprintf(stderr, "%s: %s\n", path, strerror(errno));
        if (m->fd >= 0) close(m->fd);
        return -1;
    }
    m->size = (size_t)st.st_size;
    if (m->size) { /* mmap of 0 bytes fails; kdtr_open reports an empty file itself */
        void *p = mmap(NULL, m->size, PROT_READ, MAP_PRIVATE, m->fd, 0);
        if (p == MAP_FAILED) {
            fprintf(stderr, "%s: mmap: %s\n", path, strerror(errno));
            close(m->fd);
            return -1;
        }
        m->data = p;
    }
    return 0;
}

static void unmap_file(mapped *m) {
    if (m->data) munmap((void *)m->data, m->size);
    close(m->fd);
}

static int cmd_list(const char *path) {
    mapped m;
    kdtr_file f;
    kdtr_tensor t;
    uint64_t cur = 0;
    char line[640];
    int rc = 0;
    if (map_file(path, &m)) return 2;
    if (kdtr_open(&f, m.data, m.size) != 0) {
        fprintf(stderr, "%s: error: %s\n", path, f.error);
        rc = 1;
    } else {
        puts("# name dtype shape offset nbytes crc32");
        while (kdtr_next(&f, &cur, &t)) {
            kdtr_format_line(&t, line, sizeof line);
            puts(line);
        }
    }
    unmap_file(&m);
    return rc;
}

static int cmd_verify(const char *path) {
    mapped m;
    kdtr_file f;
    kdtr_tensor t;
    uint64_t cur = 0, bytes = 0;
    int rc = 0;
    if (map_file(path, &m)) return 2;
    if (kdtr_open(&f, m.data, m.size) != 0 || kdtr_verify(&f) != 0) {
        fprintf(stderr, "%s: FAILED: %s\n", path, f.error);
        rc = 1;
    } else {
        while (kdtr_next(&f, &cur, &t)) bytes += t.nbytes;
        printf("%s: OK, %llu tensors, %llu data bytes\n", path, (unsigned long long)f.tensor_count,
               (unsigned long long)bytes);
    }
    unmap_file(&m);
    return rc;
}

static int cmd_fuzz(const char *path) {
    FILE *in = fopen(path, "rb");
    unsigned char lenbuf[8];
    unsigned long long index = 0;
    int over_alloc = 0;
    if (!in) {
        fprintf(stderr, "%s: %s\n", path, strerror(errno));
        return 2;
    }
    while (fread(lenbuf, 1, 8, in) == 8) {
        uint64_t len = kdtr__u64(lenbuf);
        unsigned char *buf = NULL;
        kdtr_file f;
        if (len > ((uint64_t)1 << 32)) {
            fprintf(stderr, "record %llu: length %llu too large for a fuzz record\n", index, (unsigned long long)len);
            fclose(in);
            return 2;
        }
        if (len) {
            buf = malloc((size_t)len);
            if (!buf || fread(buf, 1, (size_t)len, in) != (size_t)len) {
                fprintf(stderr, "record %llu: short read\n", index);
                free(buf);
                fclose(in);
                return 2;
            }
        }
        g_max_alloc = 0;
        if (kdtr_open(&f, buf, (size_t)len) == 0 && kdtr_verify(&f) == 0) printf("%llu ok\n", index);
        else printf("%llu err %llu %s\n", index, (unsigned long long)f.err_offset, f.err_field);
        if (g_max_alloc > len) {
            printf("%llu alloc %zu > %llu\n", index, g_max_alloc, (unsigned long long)len);
            over_alloc = 1;
        }
        free(buf);
        index++;
    }
    fclose(in);
    return over_alloc ? 3 : 0;
}

int main(int argc, char **argv) {
    int i, rc = 0, r;
    if (argc == 3 && strcmp(argv[1], "list") == 0) return cmd_list(argv[2]);
    if (argc == 3 && strcmp(argv[1], "fuzz") == 0) return cmd_fuzz(argv[2]);
    if (argc >= 3 && strcmp(argv[1], "verify") == 0) {
        for (i = 2; i < argc; i++) {
            r = cmd_verify(argv[i]);
            if (r > rc) rc = r;
        }
        return rc;
    }
    fprintf(stderr, "usage: %s list FILE | verify FILE... | fuzz CORPUS\n", argv[0]);
    return 2;
}
