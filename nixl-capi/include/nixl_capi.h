/*
 * nixl_capi.h: the C interface of libnixl_capi.so as built by nixl-rs.
 *
 * nixl-rs' libnixl_capi.so exports NIXL 1.5.1's C API (the interface the
 * nixl-sys 1.5.1 crate loads in its stub mode) with the same symbol names,
 * types, struct layouts and enumerator values, so a program written against
 * NIXL's C API runs on nixl-rs by loading this library instead of NVIDIA's.
 * nixl-capi/abi/check.sh compares this header with nixl-sys' wrapper.h.
 *
 * Conventions shared by every call:
 *   - Every call but nixl_capi_is_stub() returns a nixl_capi_status_t.
 *     A required pointer that is NULL gives NIXL_CAPI_ERROR_INVALID_PARAM.
 *   - Every nixl_capi_opt_args_t parameter may be NULL: no optional arguments.
 *   - Handles written through an out-parameter belong to the caller, who frees
 *     them with the matching destroy_* / release_* call.
 *   - Bytes and strings written through a `void **` / `char **` out-parameter
 *     are allocated with malloc(); the caller frees them with free().
 *   - Strings and bytes written through a `const char **` / `const void **`
 *     out-parameter are borrowed: they stay valid until the object they came
 *     from is modified or destroyed, and must not be freed.
 *   - Calls are thread-safe; an agent may be used from several threads.
 *
 * SPDX-License-Identifier: Apache-2.0
 */
#ifndef NIXL_CAPI_H
#define NIXL_CAPI_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------ */
/* Status codes, enumerations and plain structs                              */
/* ------------------------------------------------------------------------ */

/*
 * Result of a call. IN_PROG is not a failure: a transfer was started and is
 * still running. nixl-rs never returns ERROR_EXCEPTION (a panic inside the
 * library is reported as ERROR_BACKEND); ERROR_INVALID_STATE only comes from
 * nixl_capi_destroy_xfer_req().
 */
typedef enum {
    NIXL_CAPI_SUCCESS = 0,
    NIXL_CAPI_ERROR_INVALID_PARAM = -1, /* NULL/malformed argument, bad index */
    NIXL_CAPI_ERROR_BACKEND = -2,       /* any other failure */
    NIXL_CAPI_ERROR_INVALID_STATE = -3, /* request destroyed before release */
    NIXL_CAPI_ERROR_EXCEPTION = -4,     /* reserved; not returned */
    NIXL_CAPI_IN_PROG = 1,              /* transfer still running */
    NIXL_CAPI_ERROR_NO_TELEMETRY = -5,  /* agent does not record telemetry */
    NIXL_CAPI_ERROR_NOT_FOUND = -6,     /* peer unknown / no backend serves it */
} nixl_capi_status_t;

/* Kind of memory a descriptor list describes. */
typedef enum {
    NIXL_CAPI_MEM_DRAM = 0,    /* host memory: addr = pointer, dev_id = 0 */
    NIXL_CAPI_MEM_VRAM = 1,    /* GPU memory: dev_id = device ordinal */
    NIXL_CAPI_MEM_BLOCK = 2,   /* block device */
    NIXL_CAPI_MEM_OBJECT = 3,  /* object store: dev_id = key id */
    NIXL_CAPI_MEM_FILE = 4,    /* file: addr = offset, dev_id = fd */
    NIXL_CAPI_MEM_UNKNOWN = 5
} nixl_capi_mem_type_t;

/* Opaque objects, reached only through the handle typedefs below. */
struct nixl_capi_agent_s;
struct nixl_capi_params_s;
struct nixl_capi_mem_list_s;
struct nixl_capi_string_list_s;
struct nixl_capi_backend_s;
struct nixl_capi_opt_args_s;
struct nixl_capi_param_iter_s;
struct nixl_capi_xfer_dlist_s;
struct nixl_capi_xfer_dlist_handle_s;
struct nixl_capi_reg_dlist_s;
struct nixl_capi_xfer_req_s;
struct nixl_capi_notif_map_s;
struct nixl_capi_query_resp_list_s;
struct nixl_capi_remote_dlist_s;
struct nixl_capi_mem_view_s;

/*
 * Telemetry of one completed transfer, filled in by
 * nixl_capi_get_xfer_telemetry() into a struct the caller provides.
 * All fields are 64-bit; sizeof == 40.
 */
struct nixl_capi_xfer_telemetry_s {
    uint64_t start_time_us;    /* post time, microseconds since the Unix epoch */
    uint64_t post_duration_us; /* time spent inside the post call */
    uint64_t xfer_duration_us; /* post until completion was observed */
    uint64_t total_bytes;      /* sum of the descriptor lengths */
    uint64_t desc_count;       /* number of descriptors moved */
};

/* Handles. Each is a pointer to one of the opaque structs above. */
typedef struct nixl_capi_agent_s *nixl_capi_agent_t;
typedef struct nixl_capi_params_s *nixl_capi_params_t;
typedef struct nixl_capi_mem_list_s *nixl_capi_mem_list_t;
typedef struct nixl_capi_string_list_s *nixl_capi_string_list_t;
typedef struct nixl_capi_backend_s *nixl_capi_backend_t;
typedef struct nixl_capi_opt_args_s *nixl_capi_opt_args_t;
typedef struct nixl_capi_param_iter_s *nixl_capi_param_iter_t;
typedef struct nixl_capi_xfer_dlist_s *nixl_capi_xfer_dlist_t;
typedef struct nixl_capi_xfer_dlist_handle_s *nixl_capi_xfer_dlist_handle_t;
typedef struct nixl_capi_reg_dlist_s *nixl_capi_reg_dlist_t;
typedef struct nixl_capi_xfer_req_s *nixl_capi_xfer_req_t;
typedef struct nixl_capi_notif_map_s *nixl_capi_notif_map_t;
typedef struct nixl_capi_query_resp_list_s *nixl_capi_query_resp_list_t;
typedef struct nixl_capi_remote_dlist_s *nixl_capi_remote_dlist_t;
typedef struct nixl_capi_mem_view_s *nixl_capi_mem_view_t;

/* Telemetry out-parameter: a POINTER to the caller's struct (not the struct). */
typedef struct nixl_capi_xfer_telemetry_s *nixl_capi_xfer_telemetry_t;

/* Locking mode of an agent. nixl-rs is always thread-safe and ignores it. */
typedef enum {
    NIXL_CAPI_THREAD_SYNC_NONE = 0,
    NIXL_CAPI_THREAD_SYNC_STRICT = 1,
    NIXL_CAPI_THREAD_SYNC_RW = 2,
    NIXL_CAPI_THREAD_SYNC_DEFAULT = NIXL_CAPI_THREAD_SYNC_NONE,
} nixl_capi_thread_sync_t;

/*
 * Agent configuration, read by nixl_capi_create_configured_agent().
 * x86_64 layout: offsets 0, 1, 4, 8, 12, 16, 24, 32; sizeof == 40.
 */
typedef struct nixl_capi_agent_config_s {
    bool enable_prog_thread;     /* progress thread (nixl-rs progresses anyway) */
    bool enable_listen_thread;   /* serve metadata on listen_port */
    int listen_port;             /* TCP port of the listener; 0 = any free one */
    nixl_capi_thread_sync_t thread_sync; /* ignored by nixl-rs */
    unsigned int num_workers;    /* ignored (as by NIXL) */
    uint64_t pthr_delay_us;      /* progress thread delay */
    uint64_t lthr_delay_us;      /* listener thread delay */
    bool capture_telemetry;      /* record per-transfer telemetry; the
                                    NIXL_TELEMETRY_ENABLE environment wins */
} nixl_capi_agent_config_t;

/* Direction of a transfer, seen from the initiator's local descriptors. */
typedef enum {
    NIXL_CAPI_XFER_OP_READ = 0,  /* remote -> local */
    NIXL_CAPI_XFER_OP_WRITE = 1, /* local -> remote */
} nixl_capi_xfer_op_t;

/* How nixl_capi_estimate_xfer_cost() arrived at its estimate. */
typedef enum {
    NIXL_CAPI_COST_ANALYTICAL_BACKEND = 0,
} nixl_capi_cost_t;

/* ------------------------------------------------------------------------ */
/* Agents                                                                    */
/* ------------------------------------------------------------------------ */

/*
 * Create an agent named `name` (non-empty, unique among peers). The default
 * configuration is NIXL's C API default (progress thread on, no listener, no
 * telemetry). In nixl-rs the agent's backends are fixed at the first call that
 * needs the running agent (registration, metadata, transfers, notifications):
 * create every backend before that. Free with nixl_capi_destroy_agent().
 */
nixl_capi_status_t
nixl_capi_create_configured_agent(const char *name,
                                  const nixl_capi_agent_config_t *cfg,
                                  nixl_capi_agent_t *agent);
nixl_capi_status_t nixl_capi_create_agent(const char *name, nixl_capi_agent_t *agent);

/*
 * Destroy an agent, its backends, registrations and connections. Release the
 * agent's transfer requests, prepared lists and memory views first.
 */
nixl_capi_status_t nixl_capi_destroy_agent(nixl_capi_agent_t agent);

/* ------------------------------------------------------------------------ */
/* Metadata exchange                                                         */
/* ------------------------------------------------------------------------ */

/*
 * The agent's metadata (name, connection info, registrations) as an opaque
 * blob for a peer's nixl_capi_load_remote_md(). *data is malloc'd (never NULL
 * on success); free() it.
 */
nixl_capi_status_t nixl_capi_get_local_md(nixl_capi_agent_t agent, void **data, size_t *len);

/*
 * Like get_local_md, restricted to the registrations in `descs`; an empty
 * list gives the connection info alone. *data is malloc'd; free() it.
 */
nixl_capi_status_t
nixl_capi_get_local_partial_md(nixl_capi_agent_t agent,
                               nixl_capi_reg_dlist_t descs,
                               void **data,
                               size_t *len,
                               nixl_capi_opt_args_t opt_args);

/*
 * Load a peer's metadata blob (full or partial; loading again adds to what is
 * known). *agent_name receives the peer's name, malloc'd; free() it.
 */
nixl_capi_status_t
nixl_capi_load_remote_md(nixl_capi_agent_t agent, const void *data, size_t len, char **agent_name);

/* Forget a peer's metadata and disconnect from it (NOT_FOUND if unknown). */
nixl_capi_status_t nixl_capi_invalidate_remote_md(nixl_capi_agent_t agent, const char *remote_agent);

/*
 * Side-channel metadata exchange. With an IP address in opt_args
 * (nixl_capi_opt_args_set_ip_addr / _set_port) the peer's listener is used;
 * otherwise etcd at NIXL_ETCD_ENDPOINTS (nixl-rs' library built with its
 * `etcd` feature; else, or with the variable unset, ERROR_INVALID_PARAM).
 * Partial metadata through etcd needs a label this API cannot give
 * (ERROR_INVALID_PARAM). These calls queue the exchange and return; poll
 * nixl_capi_check_remote_md() for its result.
 */
nixl_capi_status_t nixl_capi_invalidate_local_md(nixl_capi_agent_t agent, nixl_capi_opt_args_t opt_args);
nixl_capi_status_t nixl_capi_send_local_md(nixl_capi_agent_t agent, nixl_capi_opt_args_t opt_args);
nixl_capi_status_t
nixl_capi_send_local_partial_md(nixl_capi_agent_t agent,
                                nixl_capi_reg_dlist_t descs,
                                nixl_capi_opt_args_t opt_args);
nixl_capi_status_t
nixl_capi_fetch_remote_md(nixl_capi_agent_t agent, const char *remote_name, nixl_capi_opt_args_t opt_args);

/*
 * SUCCESS when the peer's metadata is loaded and (if `descs` is non-NULL and
 * non-empty) covers every descriptor of `descs`; NOT_FOUND otherwise.
 */
nixl_capi_status_t
nixl_capi_check_remote_md(nixl_capi_agent_t agent, const char *remote_name, nixl_capi_xfer_dlist_t descs);

/* ------------------------------------------------------------------------ */
/* Plugins and backends                                                      */
/* ------------------------------------------------------------------------ */

/* Names of the backends this library can create (nixl-rs: "UCX", "TCP", ...). */
nixl_capi_status_t nixl_capi_get_available_plugins(nixl_capi_agent_t agent, nixl_capi_string_list_t *plugins);

/*
 * Memory types a plugin supports and its default parameters. Both handles
 * are new; free them with destroy_mem_list / destroy_params. An unknown
 * plugin gives ERROR_BACKEND.
 */
nixl_capi_status_t
nixl_capi_get_plugin_params(nixl_capi_agent_t agent,
                            const char *plugin_name,
                            nixl_capi_mem_list_t *mems,
                            nixl_capi_params_t *params);

/*
 * Create a backend of plugin `plugin_name` in the agent, configured by
 * `params` (as from get_plugin_params, possibly edited). Every failure gives
 * ERROR_BACKEND. *backend is a reference to the agent's backend: destroying
 * it frees the reference only; the backend lives as long as the agent.
 */
nixl_capi_status_t
nixl_capi_create_backend(nixl_capi_agent_t agent,
                         const char *plugin_name,
                         nixl_capi_params_t params,
                         nixl_capi_backend_t *backend);
nixl_capi_status_t nixl_capi_destroy_backend(nixl_capi_backend_t backend);

/* Memory types and effective parameters of a created backend (new handles). */
nixl_capi_status_t
nixl_capi_get_backend_params(nixl_capi_agent_t agent,
                             nixl_capi_backend_t backend,
                             nixl_capi_mem_list_t *mems,
                             nixl_capi_params_t *params);

/* ------------------------------------------------------------------------ */
/* String lists, memory-type lists, parameter maps                           */
/* ------------------------------------------------------------------------ */

/* String list: index out of range gives INVALID_PARAM; *str is borrowed. */
nixl_capi_status_t nixl_capi_destroy_string_list(nixl_capi_string_list_t list);
nixl_capi_status_t nixl_capi_string_list_size(nixl_capi_string_list_t list, size_t *size);
nixl_capi_status_t nixl_capi_string_list_get(nixl_capi_string_list_t list, size_t index, const char **str);

/* Memory-type list. */
nixl_capi_status_t nixl_capi_destroy_mem_list(nixl_capi_mem_list_t list);
nixl_capi_status_t nixl_capi_mem_list_is_empty(nixl_capi_mem_list_t list, bool *is_empty);
nixl_capi_status_t nixl_capi_mem_list_size(nixl_capi_mem_list_t list, size_t *size);
nixl_capi_status_t
nixl_capi_mem_list_get(nixl_capi_mem_list_t list, size_t index, nixl_capi_mem_type_t *mem_type);

/* "DRAM", "VRAM", "BLOCK", "OBJECT", "FILE", "UNKNOWN" (static strings). */
nixl_capi_status_t nixl_capi_mem_type_to_string(nixl_capi_mem_type_t mem_type, const char **str);

/*
 * Parameter map (string -> string). params_add inserts or overwrites. The
 * iterator yields borrowed key/value pointers; at the end it sets *has_next
 * to false and leaves *key / *value untouched. Do not change the map while
 * iterating it.
 */
nixl_capi_status_t nixl_capi_create_params(nixl_capi_params_t *params);
nixl_capi_status_t nixl_capi_destroy_params(nixl_capi_params_t params);
nixl_capi_status_t nixl_capi_params_add(nixl_capi_params_t params, const char *key, const char *value);
nixl_capi_status_t nixl_capi_params_is_empty(nixl_capi_params_t params, bool *is_empty);
nixl_capi_status_t nixl_capi_params_create_iterator(nixl_capi_params_t params, nixl_capi_param_iter_t *iter);
nixl_capi_status_t
nixl_capi_params_iterator_next(nixl_capi_param_iter_t iter,
                               const char **key,
                               const char **value,
                               bool *has_next);
nixl_capi_status_t nixl_capi_params_destroy_iterator(nixl_capi_param_iter_t iter);

/* ------------------------------------------------------------------------ */
/* Optional arguments                                                        */
/* ------------------------------------------------------------------------ */

/*
 * A set of optional arguments for the agent calls. Setters copy what they
 * are given. add_backend restricts a call to the listed backends (the
 * backend handle may be destroyed afterwards). A notification is sent with
 * a transfer when has_notif is true; set_notif_msg gives its bytes.
 * The getters return malloc'd copies (NULL and 0 when unset); free() them.
 */
nixl_capi_status_t nixl_capi_create_opt_args(nixl_capi_opt_args_t *args);
nixl_capi_status_t nixl_capi_destroy_opt_args(nixl_capi_opt_args_t args);
nixl_capi_status_t nixl_capi_opt_args_add_backend(nixl_capi_opt_args_t args, nixl_capi_backend_t backend);
nixl_capi_status_t nixl_capi_opt_args_set_notif_msg(nixl_capi_opt_args_t args, const void *data, size_t len);
nixl_capi_status_t nixl_capi_opt_args_get_notif_msg(nixl_capi_opt_args_t args, void **data, size_t *len);

/* An opaque, backend-defined blob passed to the backend with a request. */
nixl_capi_status_t
nixl_capi_opt_args_set_custom_param(nixl_capi_opt_args_t args, const void *data, size_t len);
nixl_capi_status_t
nixl_capi_opt_args_get_custom_param(nixl_capi_opt_args_t args, void **data, size_t *len);

nixl_capi_status_t nixl_capi_opt_args_set_has_notif(nixl_capi_opt_args_t args, bool has_notif);
nixl_capi_status_t nixl_capi_opt_args_get_has_notif(nixl_capi_opt_args_t args, bool *has_notif);

/* Keep adjacent descriptors apart in nixl_capi_make_xfer_req(). */
nixl_capi_status_t nixl_capi_opt_args_set_skip_desc_merge(nixl_capi_opt_args_t args, bool skip_merge);
nixl_capi_status_t nixl_capi_opt_args_get_skip_desc_merge(nixl_capi_opt_args_t args, bool *skip_merge);

/* Address of a peer's metadata listener for send/fetch/invalidate (port: 8888 if unset). */
nixl_capi_status_t nixl_capi_opt_args_set_ip_addr(nixl_capi_opt_args_t args, const char *ip_addr);
nixl_capi_status_t nixl_capi_opt_args_set_port(nixl_capi_opt_args_t args, uint16_t port);

/* ------------------------------------------------------------------------ */
/* Descriptor lists                                                          */
/* ------------------------------------------------------------------------ */

/*
 * Transfer descriptor list: (addr, len, dev_id) triples of one memory type.
 * desc_count and len are the same. trim is a no-op. rem_desc out of range
 * gives ERROR_BACKEND; resize grows with zeroed descriptors. print writes
 * the list to stdout.
 */
nixl_capi_status_t
nixl_capi_create_xfer_dlist(nixl_capi_mem_type_t mem_type, nixl_capi_xfer_dlist_t *dlist);
nixl_capi_status_t nixl_capi_destroy_xfer_dlist(nixl_capi_xfer_dlist_t dlist);
nixl_capi_status_t nixl_capi_xfer_dlist_get_type(nixl_capi_xfer_dlist_t dlist, nixl_capi_mem_type_t *mem_type);
nixl_capi_status_t
nixl_capi_xfer_dlist_add_desc(nixl_capi_xfer_dlist_t dlist, uintptr_t addr, size_t len, uint64_t dev_id);
nixl_capi_status_t nixl_capi_xfer_dlist_desc_count(nixl_capi_xfer_dlist_t dlist, size_t *count);
nixl_capi_status_t nixl_capi_xfer_dlist_len(nixl_capi_xfer_dlist_t dlist, size_t *len);
nixl_capi_status_t nixl_capi_xfer_dlist_is_empty(nixl_capi_xfer_dlist_t dlist, bool *is_empty);
nixl_capi_status_t nixl_capi_xfer_dlist_trim(nixl_capi_xfer_dlist_t dlist);
nixl_capi_status_t nixl_capi_xfer_dlist_rem_desc(nixl_capi_xfer_dlist_t dlist, int index);
nixl_capi_status_t nixl_capi_xfer_dlist_clear(nixl_capi_xfer_dlist_t dlist);
nixl_capi_status_t nixl_capi_xfer_dlist_resize(nixl_capi_xfer_dlist_t dlist, size_t new_size);
nixl_capi_status_t nixl_capi_xfer_dlist_print(nixl_capi_xfer_dlist_t dlist);

/*
 * Registration descriptor list: as above, plus per-descriptor metadata bytes
 * (copied; e.g. a file path for FILE memory). metadata may be NULL when
 * metadata_len is 0.
 */
nixl_capi_status_t
nixl_capi_create_reg_dlist(nixl_capi_mem_type_t mem_type, nixl_capi_reg_dlist_t *dlist);
nixl_capi_status_t nixl_capi_destroy_reg_dlist(nixl_capi_reg_dlist_t dlist);
nixl_capi_status_t nixl_capi_reg_dlist_get_type(nixl_capi_reg_dlist_t dlist, nixl_capi_mem_type_t *mem_type);
nixl_capi_status_t
nixl_capi_reg_dlist_add_desc(nixl_capi_reg_dlist_t dlist,
                             uintptr_t addr,
                             size_t len,
                             uint64_t dev_id,
                             const void *metadata,
                             size_t metadata_len);
nixl_capi_status_t nixl_capi_reg_dlist_desc_count(nixl_capi_reg_dlist_t dlist, size_t *count);
nixl_capi_status_t nixl_capi_reg_dlist_is_empty(nixl_capi_reg_dlist_t dlist, bool *is_empty);
nixl_capi_status_t nixl_capi_reg_dlist_trim(nixl_capi_reg_dlist_t dlist);
nixl_capi_status_t nixl_capi_reg_dlist_rem_desc(nixl_capi_reg_dlist_t dlist, int index);
nixl_capi_status_t nixl_capi_reg_dlist_clear(nixl_capi_reg_dlist_t dlist);
nixl_capi_status_t nixl_capi_reg_dlist_resize(nixl_capi_reg_dlist_t dlist, size_t new_size);
nixl_capi_status_t nixl_capi_reg_dlist_print(nixl_capi_reg_dlist_t dlist);

/*
 * Remote descriptor list (memory views): each descriptor names the agent
 * that owns it; a NULL remote_agent is a placeholder keeping indices aligned.
 */
nixl_capi_status_t
nixl_capi_create_remote_dlist(nixl_capi_mem_type_t mem_type, nixl_capi_remote_dlist_t *dlist);
nixl_capi_status_t nixl_capi_destroy_remote_dlist(nixl_capi_remote_dlist_t dlist);
nixl_capi_status_t
nixl_capi_remote_dlist_add_desc(nixl_capi_remote_dlist_t dlist,
                                uintptr_t addr,
                                size_t len,
                                uint64_t dev_id,
                                const char *remote_agent);

/* ------------------------------------------------------------------------ */
/* Memory registration and queries                                           */
/* ------------------------------------------------------------------------ */

/*
 * Register the memory of `dlist` with the backends named in opt_args, else
 * with every backend of the agent that supports its memory type (NOT_FOUND
 * if there is none). Deregister with an equal (addr, len, dev_id) list.
 * Registered memory must stay valid until it is deregistered.
 */
nixl_capi_status_t
nixl_capi_register_mem(nixl_capi_agent_t agent, nixl_capi_reg_dlist_t dlist, nixl_capi_opt_args_t opt_args);
nixl_capi_status_t
nixl_capi_deregister_mem(nixl_capi_agent_t agent, nixl_capi_reg_dlist_t dlist, nixl_capi_opt_args_t opt_args);

/* Connect now to a peer whose metadata is loaded, instead of at first use. */
nixl_capi_status_t
nixl_capi_agent_make_connection(nixl_capi_agent_t agent, const char *remote_agent, nixl_capi_opt_args_t opt_args);

/*
 * Ask the one backend named in opt_args about each descriptor of `descs`;
 * fills the caller's `resp` list with one optional parameter map per
 * descriptor. get_params returns a new map (destroy_params).
 */
nixl_capi_status_t
nixl_capi_query_mem(nixl_capi_agent_t agent,
                    nixl_capi_reg_dlist_t descs,
                    nixl_capi_query_resp_list_t resp,
                    nixl_capi_opt_args_t opt_args);
nixl_capi_status_t nixl_capi_create_query_resp_list(nixl_capi_query_resp_list_t *list);
nixl_capi_status_t nixl_capi_destroy_query_resp_list(nixl_capi_query_resp_list_t list);
nixl_capi_status_t nixl_capi_query_resp_list_size(nixl_capi_query_resp_list_t list, size_t *size);
nixl_capi_status_t
nixl_capi_query_resp_list_has_value(nixl_capi_query_resp_list_t list, size_t index, bool *has_value);
nixl_capi_status_t
nixl_capi_query_resp_list_get_params(nixl_capi_query_resp_list_t list,
                                     size_t index,
                                     nixl_capi_params_t *params);

/* ------------------------------------------------------------------------ */
/* Transfers                                                                 */
/* ------------------------------------------------------------------------ */

/*
 * Prepare a descriptor list for index-based requests: agent_name "" for the
 * local side, a peer's name (or the agent's own, for loopback) for the
 * remote side. Release with nixl_capi_release_xfer_dlist_handle().
 */
nixl_capi_status_t
nixl_capi_prep_xfer_dlist(nixl_capi_agent_t agent,
                          const char *agent_name,
                          nixl_capi_xfer_dlist_t descs,
                          nixl_capi_xfer_dlist_handle_t *dlist_hndl,
                          nixl_capi_opt_args_t opt_args);
nixl_capi_status_t
nixl_capi_release_xfer_dlist_handle(nixl_capi_agent_t agent, nixl_capi_xfer_dlist_handle_t dlist_handle);

/* A request pairing local_indices[i] with remote_indices[i] of prepared lists. */
nixl_capi_status_t
nixl_capi_make_xfer_req(nixl_capi_agent_t agent,
                        nixl_capi_xfer_op_t operation,
                        nixl_capi_xfer_dlist_handle_t local_descs,
                        const int *local_indices,
                        size_t local_indices_count,
                        nixl_capi_xfer_dlist_handle_t remote_descs,
                        const int *remote_indices,
                        size_t remote_indices_count,
                        nixl_capi_xfer_req_t *req_hndl,
                        nixl_capi_opt_args_t opt_args);

/*
 * A request moving local_descs[i] to/from remote_descs[i] of `remote_agent`
 * (the agent's own name: loopback). Both lists must have the same count and
 * per-index lengths. Every failure gives ERROR_BACKEND. A notification set in
 * opt_args is sent to the peer when the transfer completes.
 */
nixl_capi_status_t
nixl_capi_create_xfer_req(nixl_capi_agent_t agent,
                          nixl_capi_xfer_op_t operation,
                          nixl_capi_xfer_dlist_t local_descs,
                          nixl_capi_xfer_dlist_t remote_descs,
                          const char *remote_agent,
                          nixl_capi_xfer_req_t *req_hndl,
                          nixl_capi_opt_args_t opt_args);

/* The backend's estimate of a request's duration (most backends: unsupported). */
nixl_capi_status_t
nixl_capi_estimate_xfer_cost(nixl_capi_agent_t agent,
                             nixl_capi_xfer_req_t req_hndl,
                             nixl_capi_opt_args_t opt_args,
                             int64_t *duration_us,
                             int64_t *err_margin_us,
                             nixl_capi_cost_t *method);

/*
 * Start a request (again, once the previous post completed). SUCCESS: done
 * already; IN_PROG: poll nixl_capi_get_xfer_status() until it is not IN_PROG.
 * A non-NULL opt_args replaces the notification given at creation (none set
 * in it: no notification); NULL keeps it.
 */
nixl_capi_status_t
nixl_capi_post_xfer_req(nixl_capi_agent_t agent, nixl_capi_xfer_req_t req_hndl, nixl_capi_opt_args_t opt_args);
nixl_capi_status_t nixl_capi_get_xfer_status(nixl_capi_agent_t agent, nixl_capi_xfer_req_t req_hndl);

/* The backend serving a request, as a new reference (destroy_backend). */
nixl_capi_status_t
nixl_capi_query_xfer_backend(nixl_capi_agent_t agent,
                             nixl_capi_xfer_req_t req_hndl,
                             nixl_capi_backend_t *backend);

/*
 * Telemetry of a completed request into the caller's struct. NO_TELEMETRY
 * when the agent records none; the request's own status while it is not done.
 */
nixl_capi_status_t
nixl_capi_get_xfer_telemetry(nixl_capi_agent_t agent,
                             nixl_capi_xfer_req_t req_hndl,
                             nixl_capi_xfer_telemetry_t telemetry);

/*
 * Tear a request down in two steps: release (cancels a transfer still in
 * progress) then destroy (frees the handle; INVALID_STATE, nothing freed,
 * if it was not released).
 */
nixl_capi_status_t nixl_capi_release_xfer_req(nixl_capi_agent_t agent, nixl_capi_xfer_req_t req);
nixl_capi_status_t nixl_capi_destroy_xfer_req(nixl_capi_xfer_req_t req);

/* ------------------------------------------------------------------------ */
/* Notifications                                                             */
/* ------------------------------------------------------------------------ */

/*
 * Move the notifications received since the last call into `notif_map`
 * (appending). ERROR_BACKEND when no backend of the agent carries
 * notifications.
 */
nixl_capi_status_t
nixl_capi_get_notifs(nixl_capi_agent_t agent, nixl_capi_notif_map_t notif_map, nixl_capi_opt_args_t opt_args);

/* Send `len` bytes as a standalone notification to a peer (or to self). */
nixl_capi_status_t
nixl_capi_gen_notif(nixl_capi_agent_t agent,
                    const char *remote_agent,
                    const void *data,
                    size_t len,
                    nixl_capi_opt_args_t opt_args);

/*
 * Notification map: sender name -> messages in arrival order. size counts
 * senders. Names and message bytes are borrowed (messages are not
 * NUL-terminated). Bad index or unknown sender gives INVALID_PARAM.
 */
nixl_capi_status_t nixl_capi_create_notif_map(nixl_capi_notif_map_t *notif_map);
nixl_capi_status_t nixl_capi_destroy_notif_map(nixl_capi_notif_map_t notif_map);
nixl_capi_status_t nixl_capi_notif_map_size(nixl_capi_notif_map_t map, size_t *size);
nixl_capi_status_t
nixl_capi_notif_map_get_agent_at(nixl_capi_notif_map_t map, size_t index, const char **agent_name);
nixl_capi_status_t
nixl_capi_notif_map_get_notifs_size(nixl_capi_notif_map_t map, const char *agent_name, size_t *size);
nixl_capi_status_t
nixl_capi_notif_map_get_notif(nixl_capi_notif_map_t map,
                              const char *agent_name,
                              size_t index,
                              const void **data,
                              size_t *len);
nixl_capi_status_t nixl_capi_notif_map_clear(nixl_capi_notif_map_t map);

/* ------------------------------------------------------------------------ */
/* Memory views (device-initiated transfers)                                 */
/* ------------------------------------------------------------------------ */

/*
 * Backend handles describing local or remote buffers for GPU-initiated
 * transfers. nixl-rs has no device-initiated backend: both prep calls give
 * NOT_FOUND, and release_mem_view gives INVALID_PARAM (no handle is ever
 * one of its views).
 */
nixl_capi_status_t
nixl_capi_prep_mem_view_local(nixl_capi_agent_t agent,
                              nixl_capi_xfer_dlist_t descs,
                              nixl_capi_mem_view_t *mvh,
                              nixl_capi_opt_args_t opt_args);
nixl_capi_status_t
nixl_capi_prep_mem_view_remote(nixl_capi_agent_t agent,
                               nixl_capi_remote_dlist_t descs,
                               nixl_capi_mem_view_t *mvh,
                               nixl_capi_opt_args_t opt_args);
nixl_capi_status_t nixl_capi_release_mem_view(nixl_capi_agent_t agent, nixl_capi_mem_view_t mvh);

/* ------------------------------------------------------------------------ */
/* Stub detection                                                            */
/* ------------------------------------------------------------------------ */

/*
 * false: this is a real implementation. (nixl-sys' stubs answer this call
 * themselves, true when they could not load libnixl_capi.so.) NIXL's header
 * declares it with an empty parameter list; (void) is the same function.
 */
bool nixl_capi_is_stub(void);

/* ------------------------------------------------------------------------ */
/* nixl-rs additions (not part of NIXL's C API; absent from NVIDIA's library) */
/* ------------------------------------------------------------------------ */

/*
 * A static string naming the implementation, e.g.
 * "nixl-rs 0.1.0 (NIXL C API 1.5.1)". Do not free it. Programs that must also
 * run on NVIDIA's library can look it up with dlsym(RTLD_DEFAULT, ...).
 */
const char *nixl_rs_capi_version(void);

/*
 * The native transport libraries (libucp, libibverbs, ...) mapped into the
 * process, as absolute paths separated by '\n'. *paths is malloc'd; free() it.
 */
nixl_capi_status_t nixl_rs_capi_native_libraries(char **paths);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* NIXL_CAPI_H */
