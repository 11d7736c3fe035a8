// nixl-uccl's exception boundary: every call into libuccl_p2p.so goes through one of
// these wrappers, which call the function pointer they are given and turn a C++
// exception into a return code and a message. An exception must never unwind into
// Rust frames (that aborts the process). UCCL 0.1.1 throws from some calls (a
// write on a connection whose setup failed, std::runtime_error from its checks).
//
// Each wrapper returns 0 when the call returned, 1 when it threw; then `err` holds
// what() (truncated to `len - 1` bytes, NUL-terminated). The declarations mirror
// nixl-uccl's (src/library.rs, SYMBOLS), which a test checks against the wheel.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>

namespace {

struct FifoItem {
  uint64_t addr;
  uint32_t size;
  uint32_t rkey;
  uint32_t nmsgs;
  uint32_t rid;
  uint64_t idx;
  char padding[32];
};
static_assert(sizeof(FifoItem) == 64, "UCCL's FifoItem is 64 bytes");

void say(char* err, size_t len, const char* what) {
  if (err == nullptr || len == 0) return;
  if (what == nullptr) what = "";
  std::strncpy(err, what, len - 1);
  err[len - 1] = '\0';
}

template <class F>
int guarded(char* err, size_t len, F&& f) noexcept {
  try {
    f();
    return 0;
  } catch (const std::exception& e) {
    say(err, len, e.what());
  } catch (...) {
    say(err, len, "an exception that is not a std::exception");
  }
  return 1;
}

}  // namespace

extern "C" {

int nixl_uccl_create(void* f, int num_cpus, bool in_python, void** out, char* err,
                     size_t len) noexcept {
  return guarded(err, len, [&] {
    *out = reinterpret_cast<void* (*)(int, bool)>(f)(num_cpus, in_python);
  });
}

// destroy, stop_accept, conn_destroy: void f(handle).
int nixl_uccl_void1(void* f, void* h, char* err, size_t len) noexcept {
  return guarded(err, len, [&] { reinterpret_cast<void (*)(void*)>(f)(h); });
}

int nixl_uccl_connect(void* f, void* e, const char* ip, const char* gpu, int port,
                      bool same_process, void** out, char* err, size_t len) noexcept {
  return guarded(err, len, [&] {
    *out = reinterpret_cast<void* (*)(void*, const char*, const char*, int, bool)>(f)(
        e, ip, gpu, port, same_process);
  });
}

int nixl_uccl_accept(void* f, void* e, char* ip, size_t ip_len, int* gpu, void** out,
                     char* err, size_t len) noexcept {
  return guarded(err, len, [&] {
    *out = reinterpret_cast<void* (*)(void*, char*, size_t, int*)>(f)(e, ip, ip_len, gpu);
  });
}

int nixl_uccl_reg(void* f, void* e, uintptr_t data, size_t size, uint64_t* mr, int* rc,
                  char* err, size_t len) noexcept {
  return guarded(err, len, [&] {
    *rc = reinterpret_cast<int (*)(void*, uintptr_t, size_t, uint64_t&)>(f)(e, data, size,
                                                                             *mr);
  });
}

int nixl_uccl_mr_destroy(void* f, void* e, uint64_t mr, char* err, size_t len) noexcept {
  return guarded(err, len, [&] { reinterpret_cast<void (*)(void*, uint64_t)>(f)(e, mr); });
}

int nixl_uccl_prepare_fifo(void* f, void* e, uint64_t mr, const void* data, size_t size,
                           char* fifo, int* rc, char* err, size_t len) noexcept {
  return guarded(err, len, [&] {
    *rc = reinterpret_cast<int (*)(void*, uint64_t, const void*, size_t, char*)>(f)(
        e, mr, data, size, fifo);
  });
}

// write and read: the same signature.
int nixl_uccl_xfer(void* f, void* c, uint64_t mr, const void* data, size_t size,
                   const FifoItem* remote, uint64_t* id, int* rc, char* err,
                   size_t len) noexcept {
  return guarded(err, len, [&] {
    *rc = reinterpret_cast<int (*)(void*, uint64_t, const void*, size_t, FifoItem,
                                   uint64_t*)>(f)(c, mr, data, size, *remote, id);
  });
}

int nixl_uccl_xfer_status(void* f, void* c, uint64_t id, bool* done, char* err,
                          size_t len) noexcept {
  return guarded(err, len,
                 [&] { *done = reinterpret_cast<bool (*)(void*, uint64_t)>(f)(c, id); });
}

int nixl_uccl_get_metadata(void* f, void* e, char** out, int* rc, char* err,
                           size_t len) noexcept {
  return guarded(err, len,
                 [&] { *rc = reinterpret_cast<int (*)(void*, char**)>(f)(e, out); });
}

// Frees what uccl_engine_get_metadata allocated with new char[].
void nixl_uccl_delete_array(char* p) noexcept { delete[] p; }

}  // extern "C"
