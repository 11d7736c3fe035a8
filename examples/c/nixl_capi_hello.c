/*
 * nixl_capi_hello.c: NIXL's C API in one process, two agents.
 *
 * "initiator" WRITEs 1 MiB into "target"'s buffer with a notification, the
 * target waits for the notification and checks the bytes, then the initiator
 * READs them back into a second buffer and checks them. Runs unchanged on
 * nixl-rs' libnixl_capi.so and on NVIDIA's (only the library differs).
 *
 * Build (from the repository root):
 *   cc -O2 -o nixl_capi_hello examples/c/nixl_capi_hello.c -Inixl-capi/include \
 *      -L<dir with libnixl_capi.so> -lnixl_capi -ldl
 * Run:
 *   LD_LIBRARY_PATH=<dir with libnixl_capi.so> ./nixl_capi_hello [BACKEND]
 * BACKEND defaults to UCX; nixl-rs also offers TCP. On NVIDIA's library (the
 * nixl-cu12 wheel; it finds its plugins in <libnixl.so dir>/plugins, or in
 * NIXL_PLUGIN_DIR) on a host without RDMA, keep its UCX off InfiniBand, whose
 * bundled libnl crashes at exit otherwise:
 *   UCX_MODULES=^ib UCX_NET_DEVICES=lo \
 *   LD_LIBRARY_PATH=<wheel>/.nixl_cu12.mesonpy.libs ./nixl_capi_hello
 */
#define _GNU_SOURCE /* RTLD_DEFAULT */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "nixl_capi.h"

#define BUF_LEN (1u << 20)
static const char MSG[] = "hello from initiator";

/* Every call is checked: on failure, name the call and its status, exit 1. */
#define CHECK(call)                                                          \
    do {                                                                     \
        nixl_capi_status_t st_ = (call);                                     \
        if (st_ != NIXL_CAPI_SUCCESS) {                                      \
            fprintf(stderr, "%s:%d: %s failed: status %d\n", __FILE__,       \
                    __LINE__, #call, (int)st_);                              \
            exit(1);                                                         \
        }                                                                    \
    } while (0)

static void die(const char *what) {
    fprintf(stderr, "error: %s\n", what);
    exit(1);
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* An agent with one backend, configured with the plugin's default parameters.
 * Backends are created before anything else is done with the agent. */
static void make_agent(const char *name, const char *plugin, nixl_capi_agent_t *agent,
                       nixl_capi_backend_t *backend) {
    nixl_capi_mem_list_t mems;
    nixl_capi_params_t params;
    CHECK(nixl_capi_create_agent(name, agent));
    CHECK(nixl_capi_get_plugin_params(*agent, plugin, &mems, &params));
    CHECK(nixl_capi_create_backend(*agent, plugin, params, backend));
    CHECK(nixl_capi_destroy_mem_list(mems));
    CHECK(nixl_capi_destroy_params(params));
}

/* Register one DRAM buffer; the list is kept to deregister it later. */
static nixl_capi_reg_dlist_t register_buf(nixl_capi_agent_t agent, void *buf) {
    nixl_capi_reg_dlist_t dl;
    CHECK(nixl_capi_create_reg_dlist(NIXL_CAPI_MEM_DRAM, &dl));
    CHECK(nixl_capi_reg_dlist_add_desc(dl, (uintptr_t)buf, BUF_LEN, 0, NULL, 0));
    CHECK(nixl_capi_register_mem(agent, dl, NULL));
    return dl;
}

/* One transfer between local[0..BUF_LEN) and the peer's remote[0..BUF_LEN):
 * create, post, poll until done, then release and destroy the request. */
static void transfer(nixl_capi_agent_t agent, nixl_capi_xfer_op_t op, void *local,
                     void *remote, const char *peer, nixl_capi_opt_args_t opt) {
    nixl_capi_xfer_dlist_t ldl, rdl;
    nixl_capi_xfer_req_t req;
    nixl_capi_status_t st;
    CHECK(nixl_capi_create_xfer_dlist(NIXL_CAPI_MEM_DRAM, &ldl));
    CHECK(nixl_capi_create_xfer_dlist(NIXL_CAPI_MEM_DRAM, &rdl));
    CHECK(nixl_capi_xfer_dlist_add_desc(ldl, (uintptr_t)local, BUF_LEN, 0));
    CHECK(nixl_capi_xfer_dlist_add_desc(rdl, (uintptr_t)remote, BUF_LEN, 0));
    CHECK(nixl_capi_create_xfer_req(agent, op, ldl, rdl, peer, &req, opt));

    st = nixl_capi_post_xfer_req(agent, req, NULL); /* NULL: keep its notification */
    for (double end = now_s() + 10.0; st == NIXL_CAPI_IN_PROG && now_s() < end;)
        st = nixl_capi_get_xfer_status(agent, req);
    if (st != NIXL_CAPI_SUCCESS) {
        fprintf(stderr, "%s transfer: status %d\n", op == NIXL_CAPI_XFER_OP_WRITE ? "WRITE" : "READ",
                (int)st);
        exit(1);
    }
    CHECK(nixl_capi_release_xfer_req(agent, req));
    CHECK(nixl_capi_destroy_xfer_req(req));
    CHECK(nixl_capi_destroy_xfer_dlist(ldl));
    CHECK(nixl_capi_destroy_xfer_dlist(rdl));
}

/* Wait (up to 5 s) until `agent` has received MSG from `from`. */
static void wait_notif(nixl_capi_agent_t agent, const char *from) {
    nixl_capi_notif_map_t map;
    CHECK(nixl_capi_create_notif_map(&map));
    for (double end = now_s() + 5.0;;) {
        size_t n = 0;
        CHECK(nixl_capi_get_notifs(agent, map, NULL)); /* appends to the map */
        if (nixl_capi_notif_map_get_notifs_size(map, from, &n) == NIXL_CAPI_SUCCESS && n > 0) {
            const void *data;
            size_t len;
            CHECK(nixl_capi_notif_map_get_notif(map, from, 0, &data, &len));
            if (len != sizeof MSG - 1 || memcmp(data, MSG, len) != 0)
                die("unexpected notification message");
            break;
        }
        if (now_s() > end)
            die("no notification within 5 s");
    }
    CHECK(nixl_capi_destroy_notif_map(map));
}

static void verify(const unsigned char *buf, const char *what) {
    for (size_t i = 0; i < BUF_LEN; i++)
        if (buf[i] != (unsigned char)(i * 7 + 1)) {
            fprintf(stderr, "%s: byte %zu is %u\n", what, i, buf[i]);
            exit(1);
        }
}

int main(int argc, char **argv) {
    const char *plugin = argc > 1 ? argv[1] : "UCX";
    nixl_capi_agent_t ini, tgt;
    nixl_capi_backend_t ini_be, tgt_be;
    nixl_capi_opt_args_t opt;
    void *md;
    size_t md_len;
    char *peer;

    /* Which library runs: nixl-rs exports nixl_rs_capi_version, NVIDIA's does
     * not. Looked up at run time so this links against either. */
    const char *(*version)(void);
    *(void **)&version = dlsym(RTLD_DEFAULT, "nixl_rs_capi_version");
    printf("implementation: %s\n", version ? version() : "NIXL (not nixl-rs)");

    unsigned char *src = malloc(BUF_LEN), *dst = malloc(BUF_LEN), *back = malloc(BUF_LEN);
    if (!src || !dst || !back)
        die("out of memory");
    for (size_t i = 0; i < BUF_LEN; i++)
        src[i] = (unsigned char)(i * 7 + 1);
    memset(dst, 0, BUF_LEN);
    memset(back, 0, BUF_LEN);

    /* Two agents, one backend each, one registered buffer each (plus the
     * initiator's read-back buffer). */
    make_agent("initiator", plugin, &ini, &ini_be);
    make_agent("target", plugin, &tgt, &tgt_be);
    nixl_capi_reg_dlist_t ini_src = register_buf(ini, src);
    nixl_capi_reg_dlist_t ini_back = register_buf(ini, back);
    nixl_capi_reg_dlist_t tgt_dst = register_buf(tgt, dst);

    /* Metadata exchange, in-process: the target's blob loaded by the initiator.
     * Both the blob and the returned name are malloc'd by the library. */
    CHECK(nixl_capi_get_local_md(tgt, &md, &md_len));
    CHECK(nixl_capi_load_remote_md(ini, md, md_len, &peer));
    free(md);
    if (strcmp(peer, "target") != 0)
        die("load_remote_md returned another agent name");
    free(peer);

    /* WRITE src -> target's dst, with a notification for the target. */
    CHECK(nixl_capi_create_opt_args(&opt));
    CHECK(nixl_capi_opt_args_set_notif_msg(opt, MSG, sizeof MSG - 1));
    CHECK(nixl_capi_opt_args_set_has_notif(opt, true));
    transfer(ini, NIXL_CAPI_XFER_OP_WRITE, src, dst, "target", opt);
    wait_notif(tgt, "initiator");
    verify(dst, "target buffer after WRITE");

    /* READ target's dst back into the initiator's second buffer. */
    transfer(ini, NIXL_CAPI_XFER_OP_READ, back, dst, "target", NULL);
    verify(back, "read-back buffer after READ");
    printf("ok\n");

    /* Tear down: registrations, the peer's metadata, backends, agents. */
    CHECK(nixl_capi_destroy_opt_args(opt));
    CHECK(nixl_capi_deregister_mem(ini, ini_src, NULL));
    CHECK(nixl_capi_deregister_mem(ini, ini_back, NULL));
    CHECK(nixl_capi_deregister_mem(tgt, tgt_dst, NULL));
    CHECK(nixl_capi_destroy_reg_dlist(ini_src));
    CHECK(nixl_capi_destroy_reg_dlist(ini_back));
    CHECK(nixl_capi_destroy_reg_dlist(tgt_dst));
    CHECK(nixl_capi_invalidate_remote_md(ini, "target"));
    CHECK(nixl_capi_destroy_backend(ini_be));
    CHECK(nixl_capi_destroy_backend(tgt_be));
    CHECK(nixl_capi_destroy_agent(ini));
    CHECK(nixl_capi_destroy_agent(tgt));
    free(src);
    free(dst);
    free(back);
    return 0;
}
