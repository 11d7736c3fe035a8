/*
 * nixl_capi_bench.c: host-memory transfer benchmark over NIXL's C API.
 *
 * Two processes on one host (fork() before any NIXL call; each makes its own
 * agent): a target that registers a buffer and an initiator that WRITEs into it
 * or READs from it. Metadata and control messages go over two pipes. For every
 * (op, size, batch) cell the initiator builds one request of `batch`
 * descriptors of `size` bytes (non-adjacent blocks, so nothing merges; see
 * --contiguous), creates it once and re-posts it: post_xfer_req, then
 * get_xfer_status polled until done. Data is verified once per cell.
 *
 * Runs unchanged on NVIDIA's libnixl_capi.so and on nixl-rs' (only the library
 * on LD_LIBRARY_PATH differs); scripts/capi-bench runs both and tabulates.
 *
 * Build (from the repository root):
 *   cc -O2 -o nixl_capi_bench examples/c/nixl_capi_bench.c -Inixl-capi/include \
 *      -L<dir with libnixl_capi.so> -lnixl_capi -ldl
 * Run: LD_LIBRARY_PATH=<dir with libnixl_capi.so> ./nixl_capi_bench [options]
 *   --backend NAME   plugin (UCX; nixl-rs also has TCP)          [UCX]
 *   --sizes LIST     block sizes, K/M suffixes                   [4K,16K,64K,256K,1M,4M,16M]
 *   --batch LIST     descriptors per request                     [1,32]
 *   --ops LIST       WRITE,READ                                  [WRITE,READ]
 *   --iters N        at least N timed transfers per cell         [5]
 *   --time S         and at least S seconds per cell             [0.5]
 *   --warmup N       untimed transfers per cell (at least)       [2]
 *   --contiguous     adjacent blocks (the library may merge them)
 *   --prog-thread    agents with NIXL's progress thread (default off, as nixlbench)
 *
 * Output, one line per cell: impl=nixl|nixl-rs backend= op= size= batch= iters=
 * GBps= (payload bytes/s/1e9) us_per_xfer= (per completed request: post + polls)
 * post_ns= (mean post_xfer_req) polls_per_xfer= (get_xfer_status calls after a post
 * returned IN_PROG) poll_ns= (their mean; "-": none) status_ns= (get_xfer_status on
 * the completed request: the call's bare cost) verify=ok. Exit status nonzero if
 * any call fails or any check does not match.
 *
 * SPDX-License-Identifier: Apache-2.0
 */
#define _GNU_SOURCE /* RTLD_DEFAULT */
#include <dlfcn.h>
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "nixl_capi.h"

#define TARGET "bench-target"
#define INITIATOR "bench-initiator"
#define GAP 4096 /* bytes between blocks unless --contiguous */
#define STATUS_CALLS 1000

static const char *role = "initiator";

#define CHECK(call)                                                             \
    do {                                                                        \
        nixl_capi_status_t st_ = (call);                                        \
        if (st_ != NIXL_CAPI_SUCCESS) {                                         \
            fprintf(stderr, "%s: %s failed: status %d (line %d)\n", role,       \
                    #call, (int)st_, __LINE__);                                 \
            exit(1);                                                            \
        }                                                                       \
    } while (0)

static void die(const char *what) {
    fprintf(stderr, "%s: error: %s\n", role, what);
    exit(1);
}

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* ---- options ---------------------------------------------------------- */

#define MAXN 32
static const char *backend = "UCX";
static size_t sizes[MAXN], batches[MAXN];
static size_t ops[MAXN];
static int nsizes, nbatches, nops;
static long min_iters = 5, warmup = 2;
static double cell_s = 0.5;
static int contiguous, prog_thread;

static size_t parse_size(const char *s) {
    char *end;
    unsigned long long v = strtoull(s, &end, 10);
    const char *units = "KMG", *u = *end ? strchr(units, *end & ~0x20) : NULL;
    if (u) v <<= 10 * (u - units + 1), end++;
    if (end == s || (*end && *end != 'B' && *end != 'b')) die("bad size");
    return (size_t)v;
}

/* A comma-separated list of kind 's' (sizes), 'n' (numbers) or 'o' (WRITE/READ). */
static int parse_list(const char *arg, size_t *out, char kind) {
    char *copy = strdup(arg), *save = NULL;
    int n = 0;
    for (char *t = strtok_r(copy, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        if (n == MAXN) die("list too long");
        size_t v = kind == 's' ? parse_size(t) : (size_t)strtoul(t, NULL, 10);
        if (kind == 'o')
            v = !strcasecmp(t, "WRITE") ? NIXL_CAPI_XFER_OP_WRITE
              : !strcasecmp(t, "READ")  ? NIXL_CAPI_XFER_OP_READ : (die("ops: WRITE, READ"), 0);
        else if (v == 0 || (kind == 's' && v % 8))
            die("sizes must be multiples of 8, batches at least 1");
        out[n++] = v;
    }
    free(copy);
    return n;
}

static void usage(void) {
    fprintf(stderr, "usage: nixl_capi_bench [--backend UCX|TCP] [--sizes 4K,1M] [--batch 1,32]"
                    " [--ops WRITE,READ]\n  [--iters N] [--time S] [--warmup N] [--contiguous]"
                    " [--prog-thread]\n");
    exit(2);
}

static void parse_args(int argc, char **argv) {
    nsizes = parse_list("4K,16K,64K,256K,1M,4M,16M", sizes, 's');
    nbatches = parse_list("1,32", batches, 'n');
    nops = parse_list("WRITE,READ", ops, 'o');
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--contiguous")) { contiguous = 1; continue; }
        if (!strcmp(a, "--prog-thread")) { prog_thread = 1; continue; }
        if (!v) usage();
        i++;
        if (!strcmp(a, "--backend")) backend = v;
        else if (!strcmp(a, "--sizes")) nsizes = parse_list(v, sizes, 's');
        else if (!strcmp(a, "--batch")) nbatches = parse_list(v, batches, 'n');
        else if (!strcmp(a, "--ops")) nops = parse_list(v, ops, 'o');
        else if (!strcmp(a, "--iters")) min_iters = atol(v);
        else if (!strcmp(a, "--time")) cell_s = atof(v);
        else if (!strcmp(a, "--warmup")) warmup = atol(v);
        else usage();
    }
    if (!nsizes || !nbatches || !nops || min_iters < 1) usage();
}

static size_t stride_of(size_t size) { return contiguous ? size : size + GAP; }

/* One buffer serves every cell: room for the largest batch of the largest size. */
static size_t buffer_len(void) {
    size_t smax = 0, bmax = 0;
    for (int i = 0; i < nsizes; i++) smax = sizes[i] > smax ? sizes[i] : smax;
    for (int i = 0; i < nbatches; i++) bmax = batches[i] > bmax ? batches[i] : bmax;
    return bmax * stride_of(smax);
}

/* ---- pipe messages: a fixed header, then `len` payload bytes ----------- */

enum { MSG_MD = 1, MSG_FILL, MSG_CHECK, MSG_ACK, MSG_QUIT };
struct msg { uint32_t type, pad; uint64_t a, b, c, d, len; };

static void io_all(int fd, void *p, size_t n, int writing) {
    for (char *c = p; n;) {
        ssize_t r = writing ? write(fd, c, n) : read(fd, c, n);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) die(writing ? "pipe write (peer gone?)" : "pipe read (peer gone?)");
        c += r, n -= (size_t)r;
    }
}

static void send_msg(int fd, uint32_t type, uint64_t a, uint64_t b, uint64_t c, uint64_t d,
                     const void *payload, size_t len) {
    struct msg m = {type, 0, a, b, c, d, len};
    io_all(fd, &m, sizeof m, 1);
    if (len) io_all(fd, (void *)payload, len, 1);
}

/* Reads one message; the payload (if any) is malloc'd into *payload. */
static struct msg recv_msg(int fd, void **payload) {
    struct msg m;
    io_all(fd, &m, sizeof m, 0);
    if (payload) *payload = NULL;
    if (m.len) {
        void *p = malloc(m.len);
        if (!p) die("out of memory");
        io_all(fd, p, m.len, 0);
        if (payload) *payload = p; else free(p);
    }
    return m;
}

/* ---- data pattern: 64-bit words, distinct per cell (seed) and position -- */

static inline uint64_t pat(uint64_t seed, uint64_t word) {
    return (seed << 48) ^ (word * 0x9E3779B97F4A7C15ull) ^ 0x5A5A;
}

/* Fill (or count mismatches of) blocks k*stride..+size of buf, words indexed from buf. */
static uint64_t pattern(char *buf, uint64_t seed, size_t size, size_t batch, size_t stride,
                        int check) {
    uint64_t bad = 0;
    for (size_t k = 0; k < batch; k++) {
        uint64_t *w = (uint64_t *)(buf + k * stride), base = k * stride / 8;
        for (size_t i = 0; i < size / 8; i++) {
            if (check) bad += w[i] != pat(seed, base + i);
            else w[i] = pat(seed, base + i);
        }
    }
    return bad;
}

/* ---- agent setup / teardown (both processes) -------------------------- */

struct side { nixl_capi_agent_t agent; nixl_capi_backend_t backend;
              nixl_capi_reg_dlist_t reg; char *buf; size_t len; };

static void side_up(struct side *s, const char *name) {
    nixl_capi_agent_config_t cfg = {
        .enable_prog_thread = prog_thread != 0, .enable_listen_thread = false,
        .listen_port = 0, .thread_sync = NIXL_CAPI_THREAD_SYNC_DEFAULT, .num_workers = 1,
        .pthr_delay_us = 0, .lthr_delay_us = 100000, .capture_telemetry = false};
    nixl_capi_mem_list_t mems;
    nixl_capi_params_t params;
    CHECK(nixl_capi_create_configured_agent(name, &cfg, &s->agent));
    CHECK(nixl_capi_get_plugin_params(s->agent, backend, &mems, &params));
    CHECK(nixl_capi_create_backend(s->agent, backend, params, &s->backend));
    CHECK(nixl_capi_destroy_mem_list(mems));
    CHECK(nixl_capi_destroy_params(params));

    s->len = buffer_len();
    /* 2 MiB-aligned, huge pages asked for (as numpy / PyTorch buffers do): every
     * block then lies in the same kind of page whatever the address. */
    if (posix_memalign((void **)&s->buf, 2u << 20, s->len)) die("out of memory");
    madvise(s->buf, s->len, MADV_HUGEPAGE);
    memset(s->buf, 0, s->len); /* fault every page in before registering */
    CHECK(nixl_capi_create_reg_dlist(NIXL_CAPI_MEM_DRAM, &s->reg));
    CHECK(nixl_capi_reg_dlist_add_desc(s->reg, (uintptr_t)s->buf, s->len, 0, NULL, 0));
    CHECK(nixl_capi_register_mem(s->agent, s->reg, NULL));
}

static void send_md(struct side *s, int fd) {
    void *md;
    size_t len;
    CHECK(nixl_capi_get_local_md(s->agent, &md, &len));
    send_msg(fd, MSG_MD, (uintptr_t)s->buf, s->len, 0, 0, md, len);
    free(md);
}

/* Loads the peer's metadata; returns the address of its buffer. */
static uint64_t load_md(struct side *s, int fd, const char *expect) {
    void *md;
    char *name = NULL;
    struct msg m = recv_msg(fd, &md);
    if (m.type != MSG_MD || !md) die("expected metadata");
    CHECK(nixl_capi_load_remote_md(s->agent, md, m.len, &name));
    if (strcmp(name, expect)) die("peer metadata names another agent");
    free(name);
    free(md);
    if (m.b < s->len) die("peer buffer too small");
    return m.a;
}

static void side_down(struct side *s, const char *peer) {
    CHECK(nixl_capi_deregister_mem(s->agent, s->reg, NULL));
    CHECK(nixl_capi_destroy_reg_dlist(s->reg));
    nixl_capi_status_t st = nixl_capi_invalidate_remote_md(s->agent, peer);
    if (st != NIXL_CAPI_SUCCESS && st != NIXL_CAPI_ERROR_NOT_FOUND)
        CHECK(st);
    CHECK(nixl_capi_destroy_backend(s->backend));
    CHECK(nixl_capi_destroy_agent(s->agent));
    free(s->buf);
}

/* ---- target ------------------------------------------------------------ */

/* Serves FILL / CHECK until QUIT. Without a progress thread NIXL's agent makes
 * progress only inside its calls, so the target polls notifications every 10 ms
 * while it waits (as nixlbench's target does). */
static int run_target(int in, int out) {
    struct side s;
    role = "target";
    side_up(&s, TARGET);
    send_md(&s, out);
    load_md(&s, in, INITIATOR);
    nixl_capi_notif_map_t notifs;
    CHECK(nixl_capi_create_notif_map(&notifs));
    for (;;) {
        struct pollfd p = {in, POLLIN, 0};
        int r = poll(&p, 1, 10);
        if (r < 0 && errno != EINTR) die("poll");
        if (r <= 0) {
            if (!prog_thread) {
                CHECK(nixl_capi_get_notifs(s.agent, notifs, NULL));
                CHECK(nixl_capi_notif_map_clear(notifs));
            }
            continue;
        }
        struct msg m = recv_msg(in, NULL);
        if (m.type == MSG_FILL) {
            pattern(s.buf, m.a, m.b, m.c, m.d, 0);
            send_msg(out, MSG_ACK, 0, 0, 0, 0, NULL, 0);
        } else if (m.type == MSG_CHECK) {
            uint64_t bad = pattern(s.buf, m.a, m.b, m.c, m.d, 1);
            send_msg(out, MSG_ACK, bad, 0, 0, 0, NULL, 0);
        } else if (m.type == MSG_QUIT) {
            break;
        } else {
            die("unexpected message");
        }
    }
    CHECK(nixl_capi_destroy_notif_map(notifs));
    side_down(&s, INITIATOR);
    send_msg(out, MSG_ACK, 0, 0, 0, 0, NULL, 0);
    return 0;
}

/* ---- initiator --------------------------------------------------------- */

struct result { long iters; double gbps, us, post_ns, poll_ns, polls, status_ns; };

/* One post + poll to completion; adds the call durations to the counters. */
static void xfer_once(nixl_capi_agent_t agent, nixl_capi_xfer_req_t req, uint64_t *post_t,
                      uint64_t *poll_t, uint64_t *npoll) {
    uint64_t t0 = now_ns();
    nixl_capi_status_t st = nixl_capi_post_xfer_req(agent, req, NULL);
    uint64_t t1 = now_ns();
    *post_t += t1 - t0;
    while (st == NIXL_CAPI_IN_PROG) {
        t0 = now_ns();
        st = nixl_capi_get_xfer_status(agent, req);
        t1 = now_ns();
        *poll_t += t1 - t0, (*npoll)++;
    }
    if (st != NIXL_CAPI_SUCCESS) {
        fprintf(stderr, "%s: post_xfer_req/get_xfer_status failed: status %d\n", role, (int)st);
        exit(1);
    }
}

static struct result run_cell(struct side *s, uint64_t remote, int op, size_t size,
                              size_t batch, int tin, int tout, uint64_t seed) {
    size_t stride = stride_of(size);
    nixl_capi_xfer_dlist_t local, rem;
    nixl_capi_xfer_req_t req;
    struct msg m;

    /* The source holds this cell's pattern, the destination zeros. */
    if (op == NIXL_CAPI_XFER_OP_WRITE) {
        pattern(s->buf, seed, size, batch, stride, 0);
    } else {
        memset(s->buf, 0, batch * stride);
        send_msg(tout, MSG_FILL, seed, size, batch, stride, NULL, 0);
        if (recv_msg(tin, NULL).type != MSG_ACK) die("target did not fill");
    }

    CHECK(nixl_capi_create_xfer_dlist(NIXL_CAPI_MEM_DRAM, &local));
    CHECK(nixl_capi_create_xfer_dlist(NIXL_CAPI_MEM_DRAM, &rem));
    for (size_t k = 0; k < batch; k++) {
        CHECK(nixl_capi_xfer_dlist_add_desc(local, (uintptr_t)s->buf + k * stride, size, 0));
        CHECK(nixl_capi_xfer_dlist_add_desc(rem, remote + k * stride, size, 0));
    }
    CHECK(nixl_capi_create_xfer_req(s->agent, (nixl_capi_xfer_op_t)op, local, rem, TARGET,
                                    &req, NULL));

    uint64_t post_t = 0, poll_t = 0, npoll = 0;
    uint64_t t0 = now_ns(), warm_ns = (uint64_t)(cell_s * 0.1e9);
    for (long i = 0; i < 1 || i < warmup || now_ns() - t0 < warm_ns; i++)
        xfer_once(s->agent, req, &post_t, &poll_t, &npoll);

    /* Warm-up transfers completed: check the destination once. */
    uint64_t bad;
    if (op == NIXL_CAPI_XFER_OP_WRITE) {
        send_msg(tout, MSG_CHECK, seed, size, batch, stride, NULL, 0);
        m = recv_msg(tin, NULL);
        if (m.type != MSG_ACK) die("target did not check");
        bad = m.a;
    } else {
        bad = pattern(s->buf, seed, size, batch, stride, 1);
    }
    if (bad) {
        fprintf(stderr, "%s: %s size=%zu batch=%zu: %llu words differ at the destination\n",
                role, op == NIXL_CAPI_XFER_OP_WRITE ? "WRITE" : "READ", size, batch,
                (unsigned long long)bad);
        exit(1);
    }

    post_t = poll_t = npoll = 0;
    long iters = 0;
    uint64_t limit = (uint64_t)(cell_s * 1e9), elapsed;
    t0 = now_ns();
    do {
        xfer_once(s->agent, req, &post_t, &poll_t, &npoll);
        iters++;
        elapsed = now_ns() - t0;
    } while (iters < min_iters || elapsed < limit);

    /* The cost of a status call alone: on the completed request (SUCCESS is sticky). */
    uint64_t ts = now_ns();
    for (int i = 0; i < STATUS_CALLS; i++)
        CHECK(nixl_capi_get_xfer_status(s->agent, req));
    ts = now_ns() - ts;

    CHECK(nixl_capi_release_xfer_req(s->agent, req));
    CHECK(nixl_capi_destroy_xfer_req(req));
    CHECK(nixl_capi_destroy_xfer_dlist(local));
    CHECK(nixl_capi_destroy_xfer_dlist(rem));

    struct result r = {iters, (double)iters * batch * size / (double)elapsed,
                       (double)elapsed / 1e3 / iters, (double)post_t / iters,
                       npoll ? (double)poll_t / npoll : -1, (double)npoll / iters,
                       (double)ts / STATUS_CALLS};
    return r;
}

static int run_initiator(int in, int out, pid_t child) {
    /* Only nixl-rs' library has this symbol. */
    const char *(*version)(void) = (const char *(*)(void))dlsym(RTLD_DEFAULT,
                                                                  "nixl_rs_capi_version");
    const char *impl = version ? "nixl-rs" : "nixl";
    struct side s;
    side_up(&s, INITIATOR);
    uint64_t remote = load_md(&s, in, TARGET);
    send_md(&s, out);
    printf("# impl=%s%s%s backend=%s layout=%s prog_thread=%d min_iters=%ld time_s=%g\n",
           impl, version ? " version=" : "", version ? version() : "", backend,
           contiguous ? "contiguous" : "gapped", prog_thread, min_iters, cell_s);
    fflush(stdout);

    uint64_t seed = 1;
    for (int o = 0; o < nops; o++)
        for (int i = 0; i < nsizes; i++)
            for (int b = 0; b < nbatches; b++) {
                struct result r = run_cell(&s, remote, ops[o], sizes[i], batches[b], in,
                                           out, seed++);
                char poll[32] = "-";
                if (r.poll_ns >= 0) snprintf(poll, sizeof poll, "%.0f", r.poll_ns);
                printf("impl=%s backend=%s op=%s size=%zu batch=%zu iters=%ld GBps=%.3f "
                       "us_per_xfer=%.2f post_ns=%.0f polls_per_xfer=%.2f poll_ns=%s "
                       "status_ns=%.0f verify=ok\n",
                       impl, backend, ops[o] == NIXL_CAPI_XFER_OP_WRITE ? "WRITE" : "READ",
                       sizes[i], batches[b], r.iters, r.gbps, r.us, r.post_ns, r.polls, poll,
                       r.status_ns);
                fflush(stdout);
            }

    side_down(&s, TARGET);
    send_msg(out, MSG_QUIT, 0, 0, 0, 0, NULL, 0);
    if (recv_msg(in, NULL).type != MSG_ACK) die("target did not shut down");
    int status;
    if (waitpid(child, &status, 0) < 0) die("waitpid");
    if (!WIFEXITED(status) || WEXITSTATUS(status)) die("target failed");
    return 0;
}

int main(int argc, char **argv) {
    int to_target[2], to_init[2];
    parse_args(argc, argv);
    signal(SIGPIPE, SIG_IGN); /* a vanished peer shows as a failed pipe write */
    if (pipe(to_target) || pipe(to_init)) die("pipe");
    fflush(NULL);
    pid_t pid = fork(); /* before any NIXL call: each process has its own agent */
    if (pid < 0) die("fork");
    if (pid == 0) {
        close(to_target[1]), close(to_init[0]);
        return run_target(to_target[0], to_init[1]);
    }
    close(to_target[0]), close(to_init[1]);
    return run_initiator(to_init[0], to_target[1], pid);
}
