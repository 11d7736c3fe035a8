//! Give the cdylib NIXL's SONAME, `libnixl_capi.so`: a program that preloads the
//! library by path (Dynamo's `KVBM_NIXL_CAPI_LIB`) then `dlopen`s the bare name
//! (nixl-sys' stubs) finds the loaded copy only by that name.
fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libnixl_capi.so");
}
