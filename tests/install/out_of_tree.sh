#!/usr/bin/env bash
# Chorus used from outside its tree, as a user would: installs the already-built
# tree into a temporary prefix (no rebuild), then
#   1. compiles every installed header alone (an installed header that includes
#      one that was not installed fails here),
#   2. configures, builds and runs examples/out_of_tree against it
#      (find_package(Chorus), DataParallel over cpu:0,cpu:1),
#   3. builds the same program through pkg-config (chorus.pc),
#   4. checks the bad input: find_package(Chorus 99) fails naming the version,
#      and a component the install lacks fails naming the component.
# A sanitized build (scripts/sanitize.sh) installs a library that needs the
# sanitizer runtimes: the programs built here against it get the build's
# -fsanitize= flags too. With CHORUS_TEST_QUICK=1 (the sanitizer stage) steps 1
# and 3 are left to the plain suite: step 1 only runs the compiler's front end,
# and step 3 builds again what step 2 built and ran under the sanitizers.
# Usage: out_of_tree.sh BUILD_DIR SOURCE_DIR     (ctest: install.out_of_tree)
set -euo pipefail
build=$(cd "$1" && pwd)
src=$(cd "$2" && pwd)
tmp=$(mktemp -d /tmp/chorus_install.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
prefix=$tmp/prefix
cxx=$(sed -n 's/^CMAKE_CXX_COMPILER:[A-Z]*=//p' "$build/CMakeCache.txt")
san=$(sed -n 's/^CMAKE_CXX_FLAGS:[A-Z]*=//p' "$build/CMakeCache.txt" | { grep -o -- '-fsanitize=[^ ]*' || true; } | tr '\n' ' ')
[ -n "$san" ] && echo "the build is sanitized: programs built against it here use $san"
gen=()
if command -v ninja >/dev/null 2>&1; then gen=(-G Ninja); fi
launch=()
if command -v ccache >/dev/null 2>&1; then launch=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache); fi

echo "== cmake --install $build --prefix $prefix"
cmake --install "$build" --prefix "$prefix" >"$tmp/install.log"
echo "installed: $(find "$prefix" -type f | wc -l) files;" \
     "$(find "$prefix/include/chorus" -name '*.h' | wc -l) headers;" \
     "$(cd "$prefix" && find . -path ./include -prune -o -type f -print | sort | tr "\n" " ")"
config=$(find "$prefix" -name ChorusConfig.cmake)
pcdir=$(dirname "$(find "$prefix" -name chorus.pc)")

echo "== every installed header compiles alone"
# The flags a user gets: ask CMake (the installed package) for them once.
mkdir -p "$tmp/flags"
cat >"$tmp/flags/CMakeLists.txt" <<'CM'
cmake_minimum_required(VERSION 3.25)
project(flags LANGUAGES CXX)
find_package(Chorus REQUIRED)
add_library(one_header OBJECT one_header.cpp)
target_link_libraries(one_header PRIVATE Chorus::chorus)
CM
echo '#include <chorus/chorus.h>' >"$tmp/flags/one_header.cpp"
cmake -S "$tmp/flags" -B "$tmp/flags/b" -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_CXX_COMPILER="$cxx" \
      -DCMAKE_EXPORT_COMPILE_COMMANDS=ON >"$tmp/flags.log"
# The compile command for one_header.cpp, minus its -o/-c parts.
flags=$(python3 -c 'import json,shlex,sys
c=json.load(open(sys.argv[1]))[0]; a=shlex.split(c["command"]); out=[]; skip=False
for x in a[1:]:
    if skip: skip=False; continue
    if x in ("-o","-c"): skip=True; continue
    out.append(x)
print(shlex.join(out))' "$tmp/flags/b/compile_commands.json")
(cd "$prefix/include" && find chorus -name '*.h' | sort) >"$tmp/headers"
if [ "${CHORUS_TEST_QUICK:-0}" = 1 ]; then
  echo "SKIPPED: every installed header compiles alone (CHORUS_TEST_QUICK=1; the plain suite checks it)"
  : >"$tmp/headers"
fi
fail=0
while read -r h; do
  printf '#include <%s>\n' "$h" >"$tmp/h_${h//\//_}.cpp"
  echo "$tmp/h_${h//\//_}.cpp"
done <"$tmp/headers" | xargs -P "$(nproc)" -I{} sh -c "$cxx $flags -fsyntax-only {} 2>{}.err || { echo 'FAILS ALONE:' {}; cat {}.err; exit 1; }" \
  || fail=1
[ "$fail" = 0 ] || { echo "an installed header does not compile alone (above)"; exit 1; }
echo "$(wc -l <"$tmp/headers") headers compile alone"

echo "== examples/out_of_tree: configure, build, run against $prefix"
cmake -S "$src/examples/out_of_tree" -B "$tmp/oot" "${gen[@]}" "${launch[@]}" -DCMAKE_PREFIX_PATH="$prefix" \
      -DCMAKE_CXX_COMPILER="$cxx" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_FLAGS="$san" \
      -DCMAKE_EXE_LINKER_FLAGS="$san" | grep -E 'Chorus|Build files'
cmake --build "$tmp/oot"
CHORUS_CPU_DEVICES=2 "$tmp/oot/train_dp"

echo "== the same program through pkg-config"
command -v pkg-config >/dev/null || { echo "pkg-config is not installed (apt-get install pkg-config)"; exit 1; }
if [ "${CHORUS_TEST_QUICK:-0}" = 1 ]; then
  echo "SKIPPED: building through pkg-config (CHORUS_TEST_QUICK=1; the plain suite builds and runs it)"
else
  pc=(env PKG_CONFIG_PATH="$pcdir")
  echo "pkg-config --modversion chorus: $("${pc[@]}" pkg-config --modversion chorus)"
  # shellcheck disable=SC2046
  "$cxx" -O1 $san "$src/examples/out_of_tree/train_dp.cpp" -o "$tmp/train_dp_pc" \
    $("${pc[@]}" pkg-config --cflags --libs chorus) -Wl,-rpath,"$(dirname "$pcdir")"
  CHORUS_CPU_DEVICES=2 "$tmp/train_dp_pc" | tail -1
fi

echo "== bad input"
expect_configure_error() {  # NAME PREFIX FIND_PACKAGE_ARGS PATTERN
  local d=$tmp/bad_$1
  mkdir -p "$d"
  printf 'cmake_minimum_required(VERSION 3.25)\nproject(bad LANGUAGES CXX)\nfind_package(%s)\n' "$3" >"$d/CMakeLists.txt"
  if cmake -S "$d" -B "$d/b" -DCMAKE_PREFIX_PATH="$2" -DCMAKE_CXX_COMPILER="$cxx" >"$d/log" 2>&1; then
    echo "find_package($3) configured; it should have failed"; exit 1
  fi
  # CMake wraps its messages. (grep -c, not -q: a grep that leaves early can
  # kill tr with SIGPIPE, which pipefail reports as no match.)
  if ! tr -s ' \n' '  ' <"$d/log" | grep -c -- "$4" >/dev/null; then
    echo "find_package($3) failed without saying \"$4\":"; cat "$d/log"; exit 1
  fi
  echo "find_package($3) fails at configure time:"
  sed -n '/CMake Error/,/Configuring incomplete/p' "$d/log" | grep -v -e '^ *$' -e 'Configuring incomplete' | sed 's/^/    /'
}
expect_configure_error version "$prefix" "Chorus 99 REQUIRED" 'requested version "99"'
# A backend the install lacks: NCCL in a CPU-only build. Where this build has
# every backend, a copy of the install is marked as built without NCCL.
missing=""
for f in NCCL CUDNN CUDA GLOO MPI; do
  if grep -q "^set(Chorus_WITH_$f OFF)" "$config"; then missing=$f; break; fi
done
lacking=$prefix
if [ -z "$missing" ]; then
  missing=NCCL
  lacking=$tmp/prefix_without_nccl
  cp -a "$prefix" "$lacking"
  sed -i 's/^set(Chorus_WITH_NCCL ON)/set(Chorus_WITH_NCCL OFF)/' "$(find "$lacking" -name ChorusConfig.cmake)"
  echo "(this build has every backend: $lacking is a copy marked as built without NCCL)"
fi
expect_configure_error component "$lacking" "Chorus REQUIRED COMPONENTS $missing" "was built without $missing"
expect_configure_error unknown_component "$prefix" "Chorus REQUIRED COMPONENTS TPU" 'has no component "TPU"'
echo "install.out_of_tree: ok"
