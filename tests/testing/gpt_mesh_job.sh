# Sourced by the GPT mesh tests (tests/apps/train_gpt_mesh*.sh): the shared
# setup of a test that trains a small GPT on a text corpus, in one process
# and over `chorus launch`. Needs CHORUS set and free_port.sh sourced.
#   check NAME COMMAND       "ok: NAME" or "FAIL: NAME" (and fail=1)
#   text_corpus SEED FILE    3000 lines of 12 random words
#   loss JSON KEY            a figure of a run's --json line
#   close A B                A within 2e-5 of B (relative; float32 sums in another order)
#   launch N ARGS...         chorus launch of N ranks; rank 0's JSON line on stdout, stderr in $tmp/launch.err
fail=0
check() { if eval "$2"; then echo "ok: $1"; else echo "FAIL: $1"; fail=1; fi; }
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
text_corpus() {
  python3 -c "
import random; random.seed($1); w='in the beginning god created heaven and earth light was good'.split()
print('\n'.join(' '.join(random.choice(w) for _ in range(12)) for _ in range(3000)))" > "$2"
}
loss() { python3 -c "import json,sys; print(json.loads(sys.argv[1])['$2'])" "$1"; }
close() { python3 -c "import sys; a,b=float(sys.argv[1]),float(sys.argv[2]); sys.exit(0 if abs(a-b) <= 2e-5*max(1,abs(b)) else 1)" "$1" "$2"; }
launch() {
  local n=$1; shift
  timeout 300 "$CHORUS" launch --nproc-per-node "$n" --master-port "$(free_port)" --grace-period 2 -- "$CHORUS" "$@" \
    2>"$tmp/launch.err" | grep '^{\|^\[rank 0\] {' | sed 's/^\[rank 0\] //'
}
