/*
 * A TEST DOUBLE of the CUDA driver library (libcuda.so.1), for nixl-rs's tests on
 * machines without a GPU. It is not CUDA: "device memory" is host memory and every
 * copy is memcpy. It implements the calls nixl makes with the driver's semantics
 * that matter to nixl, and checks how they are used:
 *
 * - memory calls need a current context (CUDA_ERROR_INVALID_CONTEXT otherwise);
 * - device ranges must lie in a live cuMemAlloc allocation, and asynchronous copies
 *   must use page-locked memory from cuMemHostAlloc (nixl's staging design);
 * - asynchronous copies and stream callbacks run later, in order, on a thread per
 *   stream; a copy whose memory was freed before it ran, or any driver call made from
 *   inside a stream callback (forbidden by CUDA), aborts the process with a message;
 * - cuMemGetHandleForAddressRange wants host-page-aligned ranges inside one
 *   allocation and returns a descriptor of /dev/null;
 * - freed memory is never handed out again and faults on access;
 * - inter-process handles (cuIpcGetMemHandle, cuIpcOpenMemHandle_v2,
 *   cuIpcCloseMemHandle) really share memory between processes: device memory is a
 *   shared memfd mapping, a handle names the exporting process, its descriptor and the
 *   allocation's id, and opening one maps the same pages. As CUDA requires, a handle
 *   cannot be opened in the process that made it, and freeing memory another process
 *   still has open (undefined in CUDA) aborts the exporter with a message;
 * - cuMemcpyDtoDAsync_v2 runs in stream order like the other asynchronous copies;
 * - the one kernel nixl ships (nixl_gather) loads from its PTX, and a launch runs its
 *   effect in stream order, following the grid it was given (see cuLaunchKernel).
 *
 * Every other symbol of the driver API is a generated stub returning
 * CUDA_ERROR_NOT_SUPPORTED (801), so that a binding which resolves them all loads.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <sys/mman.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef uint64_t CUdeviceptr;
typedef struct fake_stream *CUstream;
typedef void (*CUstreamCallback)(CUstream, CUresult, void *);

enum {
    OK = 0,
    INVALID_VALUE = 1,
    NOT_INITIALIZED = 3,
    INVALID_DEVICE = 101,
    INVALID_CONTEXT = 201,
    NOT_SUPPORTED = 801,
};

#define DEVICES 2
static int initialised;
static char contexts[DEVICES];
static __thread CUcontext current;
static __thread int in_callback;

static void fatal(const char *what) {
    fprintf(stderr, "fake libcuda (test double): %s\n", what);
    fflush(stderr);
    abort();
}

#define ENTER()                                                                    \
    do {                                                                           \
        if (in_callback) fatal("a CUDA call from inside a stream callback");       \
    } while (0)
#define NEED_CTX()                                                                 \
    do {                                                                           \
        ENTER();                                                                   \
        if (!initialised) return NOT_INITIALIZED;                                  \
        if (!current) return INVALID_CONTEXT;                                      \
    } while (0)

enum kind { DEVICE = 1, PINNED = 2 };
/* The page after a device allocation's bytes, shared by every process that maps it. */
#define IMPORTERS 64
struct shared_tail {
    uint64_t id;              /* the allocation's id, as its handles carry it */
    int importers[IMPORTERS]; /* pids that have it open through a handle (0: free) */
};

/* Whether process `pid` is alive (a zombie or a dead process has dropped its
 * mappings, as the real driver drops a dead process's). */
static int alive(int pid) {
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    char *close_paren = strrchr(buf, ')');
    if (!close_paren || close_paren[1] != ' ') return 1;
    char state = close_paren[2];
    return state != 'Z' && state != 'X';
}

/* A live process other than this one has the allocation open. */
static int open_elsewhere(struct shared_tail *t) {
    for (int i = 0; i < IMPORTERS; i++) {
        int pid = __atomic_load_n(&t->importers[i], __ATOMIC_ACQUIRE);
        if (pid && alive(pid)) return pid;
    }
    return 0;
}
struct alloc {
    uintptr_t base;
    size_t len;
    enum kind kind;
    int fd;                     /* device memory: its memfd (exported: -1 when imported) */
    uint64_t id;
    int imported;               /* opened from another process's handle */
    struct shared_tail *tail;   /* device memory */
    struct alloc *next;
};
static uint64_t next_id = 1;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static struct alloc *allocs;

/* Whether p..p+n lies in one live allocation of `kind` (callers hold `mu`). */
static int inside(uintptr_t p, size_t n, enum kind kind) {
    for (struct alloc *a = allocs; a; a = a->next)
        if (a->kind == kind && p >= a->base && p + n >= p && p + n <= a->base + a->len)
            return 1;
    return 0;
}

static int checked(uintptr_t p, size_t n, enum kind kind) {
    pthread_mutex_lock(&mu);
    int ok = inside(p, n, kind);
    pthread_mutex_unlock(&mu);
    return ok;
}

/* Allocations are mappings of their own, never reused: a freed one stays reserved
 * and inaccessible (PROT_NONE), so a late access faults instead of silently
 * reading or writing a newer allocation at the same address. Device memory is a
 * shared memfd mapping (plus one tail page the processes that map it share), so that
 * inter-process handles can map the same pages elsewhere. */
static CUresult add(uintptr_t *out, size_t len, size_t align, enum kind kind) {
    size_t rounded = (len + align - 1) / align * align;
    if (!rounded) rounded = align;
    size_t mapped = rounded + (kind == DEVICE ? 4096 : 0);
    /* Over-map to align the start, as the real allocators do. */
    void *m = mmap(NULL, mapped + align, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                   -1, 0);
    if (m == MAP_FAILED) return 2; /* CUDA_ERROR_OUT_OF_MEMORY */
    void *p = (void *)(((uintptr_t)m + align - 1) / align * align);
    int fd = -1;
    if (kind == DEVICE) {
        fd = memfd_create("fake-cuda-device", MFD_CLOEXEC);
        if (fd < 0 || ftruncate(fd, mapped) < 0 ||
            mmap(p, mapped, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0) == MAP_FAILED) {
            if (fd >= 0) close(fd);
            munmap(m, mapped + align);
            return 2;
        }
    }
    struct alloc *a = calloc(1, sizeof *a);
    a->base = (uintptr_t)p;
    a->len = rounded;
    a->kind = kind;
    a->fd = fd;
    pthread_mutex_lock(&mu);
    a->id = ((uint64_t)getpid() << 32) | next_id++;
    if (kind == DEVICE) {
        a->tail = (struct shared_tail *)((char *)p + rounded);
        a->tail->id = a->id;
    }
    a->next = allocs;
    allocs = a;
    pthread_mutex_unlock(&mu);
    *out = (uintptr_t)p;
    return OK;
}

/* Unlink and quarantine `gone` (callers hold `mu`, and free it after unlocking). */
static void quarantine(struct alloc *gone) {
    size_t mapped = gone->len + (gone->tail ? 4096 : 0);
    if (gone->fd >= 0) close(gone->fd);
    /* Drop the shared pages from this process, keep the range reserved. */
    mmap((void *)gone->base, mapped, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
}

static CUresult release(uintptr_t p, enum kind kind) {
    pthread_mutex_lock(&mu);
    for (struct alloc **a = &allocs; *a; a = &(*a)->next) {
        if ((*a)->base == p && (*a)->kind == kind) {
            struct alloc *gone = *a;
            if (gone->imported) fatal("cuMemFree of memory opened through an IPC handle");
            if (gone->tail && open_elsewhere(gone->tail))
                fatal("device memory freed while another process still has it open through "
                      "an IPC handle (undefined in CUDA: the importer must close it first)");
            *a = gone->next;
            quarantine(gone);
            pthread_mutex_unlock(&mu);
            free(gone);
            return OK;
        }
    }
    pthread_mutex_unlock(&mu);
    return INVALID_VALUE;
}

CUresult cuDriverGetVersion(int *v) { *v = 12040; return OK; }
CUresult cuInit(unsigned flags) { ENTER(); (void)flags; initialised = 1; return OK; }
CUresult cuDeviceGetCount(int *n) {
    ENTER();
    if (!initialised) return NOT_INITIALIZED;
    *n = DEVICES;
    return OK;
}
CUresult cuDeviceGet(CUdevice *d, int ordinal) {
    ENTER();
    if (!initialised) return NOT_INITIALIZED;
    if (ordinal < 0 || ordinal >= DEVICES) return INVALID_DEVICE;
    *d = ordinal;
    return OK;
}
CUresult cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d) {
    ENTER();
    if (d < 0 || d >= DEVICES) return INVALID_DEVICE;
    *c = &contexts[d];
    return OK;
}
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) { ENTER(); (void)d; return OK; }
CUresult cuCtxGetCurrent(CUcontext *c) { ENTER(); *c = current; return OK; }
CUresult cuCtxSetCurrent(CUcontext c) { ENTER(); current = c; return OK; }

/* The context stack: push makes a context current, pop restores the one below. */
static __thread CUcontext stack[16];
static __thread int depth;
CUresult cuCtxPushCurrent_v2(CUcontext c) {
    ENTER();
    if (!c) return INVALID_CONTEXT;
    if (depth == 16) fatal("context stack overflow (pushes without pops)");
    stack[depth++] = current;
    current = c;
    return OK;
}
CUresult cuCtxPopCurrent_v2(CUcontext *c) {
    ENTER();
    if (!depth) return INVALID_CONTEXT;
    if (c) *c = current;
    current = stack[--depth];
    return OK;
}

CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n) {
    NEED_CTX();
    uintptr_t out;
    CUresult r = add(&out, n, 1 << 16, DEVICE);
    *p = out;
    return r;
}
CUresult cuMemFree_v2(CUdeviceptr p) { NEED_CTX(); return release(p, DEVICE); }
CUresult cuMemHostAlloc(void **p, size_t n, unsigned flags) {
    NEED_CTX();
    (void)flags;
    uintptr_t out;
    CUresult r = add(&out, n, 4096, PINNED);
    *p = (void *)out;
    return r;
}
CUresult cuMemFreeHost(void *p) { NEED_CTX(); return release((uintptr_t)p, PINNED); }

/* Synchronous copies check and copy under `mu`, so a racing free is caught. */
CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n) {
    NEED_CTX();
    pthread_mutex_lock(&mu);
    int ok = inside(src, n, DEVICE);
    if (ok) memcpy(dst, (void *)src, n);
    pthread_mutex_unlock(&mu);
    return ok ? OK : INVALID_VALUE;
}
CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n) {
    NEED_CTX();
    pthread_mutex_lock(&mu);
    int ok = inside(dst, n, DEVICE);
    if (ok) memcpy((void *)dst, src, n);
    pthread_mutex_unlock(&mu);
    return ok ? OK : INVALID_VALUE;
}
CUresult cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t n) {
    NEED_CTX();
    pthread_mutex_lock(&mu);
    int ok = inside(dst, n, DEVICE) && inside(src, n, DEVICE);
    if (ok) memmove((void *)dst, (void *)src, n);
    pthread_mutex_unlock(&mu);
    return ok ? OK : INVALID_VALUE;
}

/* Streams: a FIFO of operations run by a thread of the stream's own. */
struct op {
    int is_copy;
    uintptr_t dst, src;
    size_t n;
    enum kind dst_kind, src_kind;
    CUstreamCallback cb;
    void *data;
    struct op *next;
};
struct fake_stream {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    struct op *head, *tail;
    int busy;
    pthread_t thread;
};

static void *stream_main(void *arg) {
    struct fake_stream *s = arg;
    for (;;) {
        pthread_mutex_lock(&s->mu);
        while (!s->head) pthread_cond_wait(&s->cv, &s->mu);
        struct op *o = s->head;
        s->head = o->next;
        if (!s->head) s->tail = NULL;
        s->busy = 1;
        pthread_mutex_unlock(&s->mu);
        if (o->is_copy) {
            /* Large copies take a while, as over PCIe. */
            if (o->n >= (1 << 20)) {
                struct timespec t = {0, 300000};
                nanosleep(&t, NULL);
            }
            pthread_mutex_lock(&mu);
            int ok = inside(o->dst, o->n, o->dst_kind) && inside(o->src, o->n, o->src_kind);
            if (ok) memcpy((void *)o->dst, (void *)o->src, o->n);
            pthread_mutex_unlock(&mu);
            if (!ok) fatal("an asynchronous copy's memory was freed before the copy ran");
        } else {
            in_callback = 1;
            o->cb(s, OK, o->data);
            in_callback = 0;
        }
        free(o);
        pthread_mutex_lock(&s->mu);
        s->busy = 0;
        pthread_cond_broadcast(&s->cv);
        pthread_mutex_unlock(&s->mu);
    }
    return NULL;
}

CUresult cuStreamCreate(CUstream *out, unsigned flags) {
    NEED_CTX();
    (void)flags;
    struct fake_stream *s = calloc(1, sizeof *s);
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    pthread_create(&s->thread, NULL, stream_main, s);
    pthread_detach(s->thread);
    *out = s;
    return OK;
}

static void push(struct fake_stream *s, struct op *o) {
    pthread_mutex_lock(&s->mu);
    if (s->tail) s->tail->next = o; else s->head = o;
    s->tail = o;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

static CUresult copy_async(uintptr_t dst, enum kind dk, uintptr_t src, enum kind sk, size_t n,
                           CUstream s) {
    NEED_CTX();
    if (!s) fatal("an asynchronous copy on the legacy default stream");
    if (!checked(dst, n, dk) || !checked(src, n, sk)) {
        fprintf(stderr, "fake libcuda (test double): asynchronous copy of %zu bytes "
                        "outside device memory or page-locked host memory\n", n);
        return INVALID_VALUE;
    }
    struct op *o = calloc(1, sizeof *o);
    o->is_copy = 1;
    o->dst = dst;
    o->src = src;
    o->n = n;
    o->dst_kind = dk;
    o->src_kind = sk;
    push(s, o);
    return OK;
}
CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, CUstream s) {
    return copy_async((uintptr_t)dst, PINNED, src, DEVICE, n, s);
}
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, CUstream s) {
    return copy_async(dst, DEVICE, (uintptr_t)src, PINNED, n, s);
}
CUresult cuStreamAddCallback(CUstream s, CUstreamCallback cb, void *data, unsigned flags) {
    NEED_CTX();
    if (!s || !cb || flags) return INVALID_VALUE;
    struct op *o = calloc(1, sizeof *o);
    o->cb = cb;
    o->data = data;
    push(s, o);
    return OK;
}
CUresult cuStreamSynchronize(CUstream s) {
    NEED_CTX();
    /* The legacy stream: this double runs its (synchronous) copies at once. */
    if (!s) return OK;
    pthread_mutex_lock(&s->mu);
    while (s->head || s->busy) pthread_cond_wait(&s->cv, &s->mu);
    pthread_mutex_unlock(&s->mu);
    return OK;
}

CUresult cuMemGetHandleForAddressRange(void *handle, CUdeviceptr p, size_t n, int type,
                                       unsigned long long flags) {
    NEED_CTX();
    if (type != 1 || flags) return INVALID_VALUE;
    if (p % 4096 || n % 4096 || !n) return INVALID_VALUE;
    if (!checked(p, n, DEVICE)) return INVALID_VALUE;
    int fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 999;
    *(int *)handle = fd;
    return OK;
}

/* The base and length of the allocation holding `p`. */
CUresult cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size, CUdeviceptr p) {
    NEED_CTX();
    pthread_mutex_lock(&mu);
    for (struct alloc *a = allocs; a; a = a->next) {
        if (a->kind == DEVICE && p >= a->base && p < a->base + a->len) {
            if (base) *base = a->base;
            if (size) *size = a->len;
            pthread_mutex_unlock(&mu);
            return OK;
        }
    }
    pthread_mutex_unlock(&mu);
    return 400; /* CUDA_ERROR_INVALID_HANDLE, as for memory the driver did not allocate */
}

/* An inter-process handle: 64 opaque bytes, here the exporter's pid, its memfd's
 * descriptor number, the allocation's id and length. */
typedef struct { char reserved[64]; } CUipcMemHandle;
struct fake_handle {
    uint32_t magic, pid;
    int32_t fd, pad;
    uint64_t id, len;
};
#define HANDLE_MAGIC 0x50494b46u /* "FKIP" */

CUresult cuIpcGetMemHandle(CUipcMemHandle *h, CUdeviceptr p) {
    NEED_CTX();
    pthread_mutex_lock(&mu);
    for (struct alloc *a = allocs; a; a = a->next) {
        /* Only the start of an allocation of this process's own has a handle. */
        if (a->kind == DEVICE && a->base == p && !a->imported) {
            struct fake_handle f = {HANDLE_MAGIC, (uint32_t)getpid(), a->fd, 0, a->id, a->len};
            memset(h, 0, sizeof *h);
            memcpy(h, &f, sizeof f);
            pthread_mutex_unlock(&mu);
            return OK;
        }
    }
    pthread_mutex_unlock(&mu);
    return INVALID_VALUE;
}

CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *out, CUipcMemHandle h, unsigned flags) {
    NEED_CTX();
    if (flags > 1) return INVALID_VALUE;
    struct fake_handle f;
    memcpy(&f, &h, sizeof f);
    if (f.magic != HANDLE_MAGIC) return INVALID_VALUE;
    /* CUDA refuses a handle in the process that made it. */
    if (f.pid == (uint32_t)getpid()) return INVALID_CONTEXT;
    char path[64];
    snprintf(path, sizeof path, "/proc/%u/fd/%d", f.pid, f.fd);
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0) return INVALID_VALUE; /* the exporter or its memory is gone */
    size_t mapped = f.len + 4096;
    void *p = mmap(NULL, mapped, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) return INVALID_VALUE;
    struct shared_tail *tail = (struct shared_tail *)((char *)p + f.len);
    if (tail->id != f.id) { /* the descriptor now names other memory: a stale handle */
        munmap(p, mapped);
        return INVALID_VALUE;
    }
    int slot = -1;
    for (int i = 0; i < IMPORTERS && slot < 0; i++) {
        int zero = 0;
        if (__atomic_compare_exchange_n(&tail->importers[i], &zero, (int)getpid(), 0,
                                        __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            slot = i;
    }
    if (slot < 0) fatal("more importers of one allocation than this double tracks");
    struct alloc *a = calloc(1, sizeof *a);
    a->base = (uintptr_t)p;
    a->len = f.len;
    a->kind = DEVICE;
    a->fd = -1;
    a->id = f.id;
    a->imported = 1;
    a->tail = tail;
    pthread_mutex_lock(&mu);
    a->next = allocs;
    allocs = a;
    pthread_mutex_unlock(&mu);
    *out = (uintptr_t)p;
    return OK;
}

CUresult cuIpcCloseMemHandle(CUdeviceptr p) {
    NEED_CTX();
    pthread_mutex_lock(&mu);
    for (struct alloc **a = &allocs; *a; a = &(*a)->next) {
        if ((*a)->base == p && (*a)->imported) {
            struct alloc *gone = *a;
            *a = gone->next;
            int me = (int)getpid(), found = 0;
            for (int i = 0; i < IMPORTERS && !found; i++) {
                int pid = me;
                found = __atomic_compare_exchange_n(&gone->tail->importers[i], &pid, 0, 0,
                                                    __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
            }
            quarantine(gone);
            pthread_mutex_unlock(&mu);
            free(gone);
            return OK;
        }
    }
    pthread_mutex_unlock(&mu);
    return INVALID_VALUE;
}

CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) {
    return copy_async(dst, DEVICE, src, DEVICE, n, s);
}

/* Modules: the one kernel nixl ships (nixl_gather, nixl/src/gpu/gather.ptx) is
 * recognised by its PTX text and launching it runs its effect on the host, in stream
 * order: entry i < min(grid x, count) of the table passed by value copies
 * min(len, grid y x 64 KiB) bytes from its source to its destination. Any other image
 * is refused. Each launch is logged to the file NIXL_FAKE_CUDA_LAUNCH_LOG names, when
 * set, so that tests can tell the kernel ran. */
static int gather_module, gather_function;

CUresult cuModuleLoadData(void **m, const void *image) {
    NEED_CTX();
    const char *t = image;
    if (!m || !t || !strstr(t, ".version") || !strstr(t, ".entry nixl_gather("))
        return 218; /* CUDA_ERROR_INVALID_PTX */
    *m = &gather_module;
    return OK;
}

CUresult cuModuleGetFunction(void **f, void *m, const char *name) {
    NEED_CTX();
    if (m != &gather_module) return 400; /* CUDA_ERROR_INVALID_HANDLE */
    if (!name || strcmp(name, "nixl_gather")) return 500; /* CUDA_ERROR_NOT_FOUND */
    *f = &gather_function;
    return OK;
}

CUresult cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                        unsigned by, unsigned bz, unsigned shared, CUstream s, void **params,
                        void **extra) {
    NEED_CTX();
    if (f != &gather_function) return 400;
    if (!s) fatal("a kernel launch on the legacy default stream");
    if (!gx || !gy || !gz || !bx || !by || !bz || gy > 65535 || gz > 65535 ||
        (uint64_t)bx * by * bz > 1024 || shared || !params || extra)
        return INVALID_VALUE;
    /* The parameter is copied now, as the driver does. */
    unsigned char table[3080];
    memcpy(table, params[0], sizeof table);
    uint32_t count;
    memcpy(&count, table, 4);
    if (count > 128) fatal("a gather table with more entries than its parameter holds");
    for (uint32_t i = 0; i < gx && i < count; i++) {
        uint64_t e[3];
        memcpy(e, table + 8 + 24 * i, sizeof e);
        size_t n = e[2] < (uint64_t)gy * 65536 ? e[2] : (uint64_t)gy * 65536;
        if (!n) continue;
        if (!checked(e[0], n, DEVICE) || !checked(e[1], n, DEVICE))
            fatal("the gather kernel would touch memory outside device allocations "
                  "(an illegal address: CUDA would poison the context)");
        struct op *o = calloc(1, sizeof *o);
        o->is_copy = 1;
        o->dst = e[0];
        o->src = e[1];
        o->n = n;
        o->dst_kind = DEVICE;
        o->src_kind = DEVICE;
        push(s, o);
    }
    const char *log = getenv("NIXL_FAKE_CUDA_LAUNCH_LOG");
    if (log) {
        int fd = open(log, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0600);
        if (fd >= 0) {
            char line[96];
            int len = snprintf(line, sizeof line, "nixl_gather %u %u %u %u\n", gx, gy, bx,
                               count);
            if (write(fd, line, len) < 0) { /* nothing to do */ }
            close(fd);
        }
    }
    return OK;
}

CUresult cuGetErrorName(CUresult r, const char **s) { (void)r; *s = "CUDA_ERROR_FAKE"; return OK; }
CUresult cuGetErrorString(CUresult r, const char **s) {
    (void)r;
    *s = "fake libcuda (test double) error";
    return OK;
}
