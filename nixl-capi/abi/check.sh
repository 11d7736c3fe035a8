#!/usr/bin/env bash
# Check that nixl-capi/include/nixl_capi.h declares NIXL 1.5.1's C API exactly as
# nixl-sys 1.5.1's wrapper.h does, and optionally that a built libnixl_capi.so
# exports exactly that API.
#
#   nixl-capi/abi/check.sh [WRAPPER_H [LIBNIXL_CAPI_SO]]
#
#   WRAPPER_H        nixl-sys' wrapper.h (or env NIXL_SYS_WRAPPER_H; else looked
#                    for in Cargo's registry sources). Not found: SKIP, exit 0.
#   LIBNIXL_CAPI_SO  a libnixl_capi.so to check (or env NIXL_CAPI_LIB); optional.
#                    NVIDIA's library passes too (its nixl-rs extras are skipped).
#   env NIXL_CAPI_HEADER   header to check instead of nixl-capi/include/nixl_capi.h
#   env NIXL_CAPI_ABI_KEEP non-empty: keep the work directory (printed)
#
# What is compared (gcc does the parsing; nothing is matched by hand in C text):
#   a) prototypes: every nixl_capi_* declaration as gcc prints it (-aux-info),
#      typedef names and qualifiers included. NIXL declares nixl_capi_is_stub()
#      with an empty list, we with (void): treated as the same.
#   b) types: the type dump of gcc's -fdump-go-spec for every nixl_capi_* /
#      NIXL_CAPI_* name (struct field names and types, what each handle points
#      to, enum underlying types, enumerator values), and a C program generated
#      from wrapper.h's names, compiled (-std=c11 -Wall -Werror) against each
#      header, printing sizeof/alignof of every typedef and struct, offsetof and
#      size of every field, and every enumerator's value. Outputs must be equal.
#   c) library: nixl_capi_* symbols exported (nm -D --defined-only) = functions
#      of wrapper.h; SONAME libnixl_capi.so; if it is nixl-rs' library (exports
#      nixl_rs_capi_version), every nixl_rs_* function of our header is exported.
# Our nixl_rs_* additions are excluded from a) and b).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ours=${NIXL_CAPI_HEADER:-$here/../include/nixl_capi.h}
CC=${CC:-gcc}

wrapper=${1:-${NIXL_SYS_WRAPPER_H:-}}
lib=${2:-${NIXL_CAPI_LIB:-}}

if [[ -z "$wrapper" ]]; then
    for f in "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/nixl-sys-1.5.1/wrapper.h; do
        if [[ -f "$f" ]]; then wrapper=$f; break; fi
    done
fi
if [[ -z "$wrapper" ]]; then
    echo "SKIP nixl-capi ABI check: no wrapper.h given and nixl-sys-1.5.1 is not in ${CARGO_HOME:-$HOME/.cargo}/registry/src"
    exit 0
fi
if [[ ! -f "$wrapper" ]]; then
    echo "SKIP nixl-capi ABI check: $wrapper does not exist"
    exit 0
fi
if ! command -v "$CC" >/dev/null; then
    echo "SKIP nixl-capi ABI check: no C compiler ($CC)"
    exit 0
fi
[[ -f "$ours" ]] || { echo "FAIL: $ours missing" >&2; exit 1; }
if [[ -n "$lib" && ! -f "$lib" ]]; then
    echo "FAIL: library $lib does not exist" >&2
    exit 1
fi

wrapper=$(cd "$(dirname "$wrapper")" && pwd)/$(basename "$wrapper")
ours=$(cd "$(dirname "$ours")" && pwd)/$(basename "$ours")

work=$(mktemp -d "${TMPDIR:-/tmp}/nixl-capi-abi.XXXXXX")
if [[ -n "${NIXL_CAPI_ABI_KEEP:-}" ]]; then
    echo "nixl-capi ABI: keeping $work" >&2
else
    trap 'rm -rf "$work"' EXIT
fi

failed=0
fail() {
    echo "FAIL: $*" >&2
    failed=1
}
# compare WHAT EXPECTED ACTUAL [EXPECTED_LABEL ACTUAL_LABEL]: fail with a diff.
compare() {
    local a=${4:-NIXL wrapper.h} b=${5:-nixl_capi.h}
    if ! diff -u --label "$a" --label "$b" "$2" "$3" >"$work/diff.txt"; then
        fail "$1 differ (- $a, + $b):"
        cat "$work/diff.txt" >&2
    fi
}

# --- gcc's views of each header -------------------------------------------------
for side in nixl ours; do
    if [[ $side == nixl ]]; then h=$wrapper; else h=$ours; fi
    printf '#include "%s"\n' "$h" >"$work/$side.c"
    if ! "$CC" -std=c11 -fsyntax-only -aux-info "$work/$side.aux" "$work/$side.c" ||
        ! "$CC" -std=c11 -c -o /dev/null -fdump-go-spec="$work/$side.go" "$work/$side.c"; then
        echo "FAIL: $h does not compile as C11" >&2
        exit 1
    fi

    # a) prototypes: drop gcc's "/* file:line:NC */" prefix, squeeze spaces.
    grep -E '^/\*.*\*/ *extern .*[ *]nixl_capi_[A-Za-z0-9_]* \(' "$work/$side.aux" |
        sed -E 's|^/\*[^*]*\*/ *||; s/\(\/\* \?\?\? \*\/\)/(void)/; s/[[:space:]]+/ /g; s/ $//' |
        sort >"$work/$side.protos" || true
    sed -E 's/.*[ *](nixl_capi_[A-Za-z0-9_]*) \(.*/\1/' "$work/$side.protos" | sort -u >"$work/$side.funcs"

    # b) type dump: nixl_capi_* types and NIXL_CAPI_* constants, not functions.
    grep -E '^(type _nixl_capi_|const _NIXL_CAPI_|const _sizeof_nixl_capi_)' "$work/$side.go" |
        sort >"$work/$side.types" || true
done

# Our own additions, exported by nixl-rs' library only.
grep -E '^/\*.*\*/ *extern .*[ *]nixl_rs_[A-Za-z0-9_]* \(' "$work/ours.aux" |
    sed -E 's/.*[ *](nixl_rs_[A-Za-z0-9_]*) \(.*/\1/' | sort -u >"$work/ours.extras" || true

nfuncs=$(wc -l <"$work/nixl.funcs")
if [[ $nfuncs -ne 104 ]]; then
    fail "$wrapper declares $nfuncs nixl_capi_* functions, NIXL 1.5.1's declares 104"
fi

# Our header must also be clean C (strict) and C++.
"$CC" -std=c11 -Wall -Wextra -Wpedantic -Wstrict-prototypes -Werror -fsyntax-only "$work/ours.c" ||
    fail "nixl_capi.h does not compile cleanly as C11"
if command -v "${CXX:-g++}" >/dev/null; then
    printf '#include "%s"\nstatic_assert(sizeof(nixl_capi_agent_config_t) == 40, "");\n' "$ours" >"$work/ours.cc"
    "${CXX:-g++}" -std=c++11 -Wall -Wextra -Werror -fsyntax-only "$work/ours.cc" ||
        fail "nixl_capi.h does not compile as C++"
fi

# --- a) prototypes --------------------------------------------------------------
compare "nixl_capi_* prototypes" "$work/nixl.protos" "$work/ours.protos"

# --- b) types, from gcc's dump ---------------------------------------------------
compare "type definitions (gcc -fdump-go-spec)" "$work/nixl.types" "$work/ours.types"

# --- b) layouts and values, from a C program ------------------------------------
# Names come from wrapper.h's dump; a name our header lacks fails the build of
# the program against our header (reported), extra names of ours fail above.
typedefs=$(sed -nE 's/^type _(nixl_capi_[A-Za-z0-9_]*_t) .*/\1/p' "$work/nixl.types")
enumerators=$(sed -nE 's/^const _(NIXL_CAPI_[A-Za-z0-9_]*) = .*/\1/p' "$work/nixl.types")
structs=$(sed -nE 's/^type _(nixl_capi_[A-Za-z0-9_]*_s) struct \{ *[^} ].*/\1/p' "$work/nixl.types")
{
    cat <<'EOF'
#include <stdalign.h>
#include <stddef.h>
#include <stdio.h>
#include HEADER
#define SIZE(T) printf("size  %-44s %2zu align %zu\n", #T, sizeof(T), alignof(T))
#define FIELD(S, F) \
    printf("field %-44s %2zu size %zu\n", #S "." #F, offsetof(S, F), sizeof(((S *)0)->F))
#define VALUE(E) printf("value %-44s %lld\n", #E, (long long)(E))
#define INTEGER(T) printf("int   %-44s %s\n", #T, ((T)-1 < (T)0) ? "signed" : "unsigned")
int main(void) {
EOF
    for t in $typedefs; do
        echo "    SIZE($t);"
        # Enums: their signedness (the underlying integer type of the enum).
        if grep -qE "^type _$t u?int[0-9]+\$" "$work/nixl.types"; then echo "    INTEGER($t);"; fi
    done
    for s in $structs; do
        echo "    SIZE(struct $s);"
        body=$(sed -nE "s/^type _$s struct \{ *(.*)\}\$/\1/p" "$work/nixl.types")
        IFS=';' read -ra members <<<"$body"
        for m in "${members[@]}"; do
            f=$(awk '{print $1}' <<<"$m")
            [[ -z "$f" || "$f" == Godump_* ]] && continue
            echo "    FIELD(struct $s, $f);"
        done
    done
    for e in $enumerators; do echo "    VALUE($e);"; done
    echo "    return 0;"
    echo "}"
} >"$work/layout.c"
nlayouts=$(( $(grep -c '^    SIZE(' "$work/layout.c") + $(grep -c '^    FIELD(' "$work/layout.c") ))
nenums=$(grep -c '^    VALUE(' "$work/layout.c")

for side in nixl ours; do
    if [[ $side == nixl ]]; then h=$wrapper; else h=$ours; fi
    if "$CC" -std=c11 -Wall -Werror -DHEADER="\"$h\"" -o "$work/layout-$side" "$work/layout.c" 2>"$work/cc-$side.txt"; then
        "$work/layout-$side" >"$work/$side.layout"
    else
        fail "the layout program does not build against $h:"
        cat "$work/cc-$side.txt" >&2
        : >"$work/$side.layout"
    fi
done
compare "layouts and values" "$work/nixl.layout" "$work/ours.layout"

# --- c) the library -------------------------------------------------------------
libnote=""
if [[ -n "$lib" ]]; then
    nm -D --defined-only "$lib" | awk 'NF >= 3 { sub(/@.*/, "", $3); print $2, $3 }' >"$work/lib.syms"
    awk '$2 ~ /^nixl_capi_/ { print $2 }' "$work/lib.syms" | sort -u >"$work/lib.funcs"
    compare "nixl_capi_* functions" "$work/nixl.funcs" "$work/lib.funcs" "NIXL wrapper.h" "$lib"
    notfunc=$(awk '$2 ~ /^nixl_(capi|rs)_/ && $1 != "T" && $1 != "i" { print $2 " (" $1 ")" }' "$work/lib.syms")
    [[ -z "$notfunc" ]] || fail "$lib: exported as non-functions: $notfunc"

    soname=$(readelf -d "$lib" | sed -nE 's/.*\(SONAME\).*\[(.*)\].*/\1/p')
    [[ "$soname" == libnixl_capi.so ]] || fail "$lib: SONAME is '${soname:-none}', must be libnixl_capi.so"

    if awk '$2 == "nixl_rs_capi_version" { found = 1 } END { exit !found }' "$work/lib.syms"; then
        awk '$2 ~ /^nixl_rs_/ { print $2 }' "$work/lib.syms" | sort -u >"$work/lib.extras"
        compare "nixl_rs_* functions" "$work/ours.extras" "$work/lib.extras" "nixl_capi.h" "$lib"
        libnote="; $(basename "$lib"): $(wc -l <"$work/lib.funcs") nixl_capi_* + $(wc -l <"$work/lib.extras") nixl_rs_* symbols, SONAME $soname"
    else
        libnote="; $(basename "$lib"): $(wc -l <"$work/lib.funcs") nixl_capi_* symbols, SONAME $soname (not nixl-rs' library: nixl_rs_* extras not checked)"
    fi
fi

if [[ $failed -ne 0 ]]; then
    echo "nixl-capi ABI: MISMATCH with $wrapper" >&2
    exit 1
fi
echo "nixl-capi ABI: $nfuncs functions, $nlayouts layouts, $nenums enumerators match NIXL 1.5.1's wrapper.h$libnote"
