#!/usr/bin/env bash
# The GPU scripts, checked on a machine without a GPU:
#   - every file parses (bash -n): scripts/gpu_check.sh, its stage files
#     (scripts/gpu/stages/*.sh), scripts/gpu_gpt.sh;
#   - `gpu_check.sh --list` names, from the stage files, exactly the stages the
#     one-file script had (31), each once and with what it does;
#   - every `scripts/gpu_check.sh STAGE...` command quoted in the repository's
#     docs, scripts and tests names stages that exist;
#   - an unknown stage is refused with one line before anything runs;
#   - the dispatcher's wiring, with the GPU tools replaced by stubs that log
#     their arguments (nvidia-smi, the chorus binary, PyTorch's scripts): the
#     named stages run in --list order whatever order they are given in, after
#     nvidia-smi and `chorus --version`; DDP_GPUS=4 gives the ddp stage four
#     devices and PyTorch DDP four GPUs; the summary pairs the rows.
# Usage: gpu_scripts.sh [CHORUS_BINARY] (unused: nothing here needs a build).
set -uo pipefail
cd "$(dirname "$0")/../.."
fail=0
check() { if eval "$2"; then echo "ok: $1"; else echo "FAIL: $1"; fail=1; fi; }
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT

for f in scripts/gpu_check.sh scripts/gpu/stages/*.sh scripts/gpu_gpt.sh; do
  check "bash -n $f" "bash -n '$f'"
done

expected="build tests sanitize racetorch graphlaunch dpcrash dpupdates microbatch memrun bench bnbench direct convadd
tracecmp train layout dp ddp ddpgraphs ddpprof ddptune ddptrain dist pipeline pipetrain graphs dpgraphs profile ncu
hostprof multi"
bash scripts/gpu_check.sh --list > "$tmp/list"; rc=$?
check "--list runs without a GPU (exit $rc)" "[ $rc = 0 ]"
check "--list names the 31 stages of the one-file script, each once" \
  "[ \"\$(awk '{print \$1}' '$tmp/list' | sort | tr '\n' ' ')\" = \"\$(tr ' \n' '\n\n' <<<'$expected' | sort | tr '\n' ' ')\" ]"
check "every stage says what it does" "[ \$(awk 'NF < 3' '$tmp/list' | wc -l) = 0 ]"
check "build is the first stage" "[ \"\$(head -1 '$tmp/list' | awk '{print \$1}')\" = build ]"

# Stages quoted in commands: `scripts/gpu_check.sh build tests bench` (in a code span).
stages=" $(awk '{print $1}' "$tmp/list" | tr '\n' ' ')"
quoted=$(grep -rhoE 'gpu_check\.sh( [a-z0-9]+)+`' README.md docs scripts tests bench CMakeLists.txt 2>/dev/null |
         sed -E 's/^gpu_check\.sh //; s/`$//' | tr ' ' '\n' | sort -u)
unknown=""
for s in $quoted; do [[ $stages == *" $s "* ]] || unknown+=" $s"; done
check "every stage quoted in a gpu_check.sh command exists ($(wc -w <<<"$quoted") names)${unknown:+: not stages:$unknown}" \
  "[ -z '$unknown' ] && [ $(wc -w <<<"$quoted") -gt 10 ]"

out=$(bash scripts/gpu_check.sh build nosuch 2>&1); rc=$?
check "an unknown stage is refused, one line (exit $rc): $out" \
  "[ $rc = 2 ] && [ \$(wc -l <<<\"\$out\") = 1 ] && grep -q \"no stage 'nosuch'\" <<<\"\$out\""

# The dispatcher with stubs for the GPU machine's tools, in a copy of the scripts.
mkdir -p "$tmp/repo/scripts" "$tmp/repo/build-gpu" "$tmp/repo/.bench" "$tmp/bin"
cp -r scripts/gpu_check.sh scripts/gpu "$tmp/repo/scripts/"
log="$tmp/calls"
cat > "$tmp/bin/nvidia-smi" <<EOF
#!/usr/bin/env bash
echo "nvidia-smi \$*" >> '$log'; echo "GPU 0: stub"
EOF
cat > "$tmp/repo/build-gpu/chorus" <<EOF
#!/usr/bin/env bash
echo "chorus \$*" >> '$log'
# bench --json: one row per device count, as chorus bench prints them.
if [ "\$1" = bench ]; then
  args=" \$* "; model=\$(sed -E 's/.* --model ([^ ]+) .*/\1/' <<<"\$args"); prec=\$(sed -E 's/.* --precision ([^ ]+) .*/\1/' <<<"\$args")
  strat=\$(sed -E 's/.* --strategy ([^ ]+) .*/\1/' <<<"\$args"); counts=\$(sed -E 's/.* --device-counts ([^ ]+) .*/\1/' <<<"\$args")
  cl=false; [[ \$args == *" --channels-last "* ]] && cl=true
  for n in \${counts//,/ }; do
    echo "{\"model\": \"\$model\", \"precision\": \"\$prec\", \"strategy\": \"\$strat\", \"devices\": \$n, \"channels_last\": \$cl, \"img_per_s\": \$((1000 * n)), \"peak_mem_bytes\": 1048576}"
  done
fi
EOF
for py in scripts/torch_reference.py .bench/torch_baseline.py; do
  cat > "$tmp/repo/$py" <<EOF
import json, sys
open('$log', 'a').write('torch ' + ' '.join(sys.argv[1:]) + '\n')
a = sys.argv[1:]
get = lambda k, d: a[a.index(k) + 1] if k in a else d
print(json.dumps({"torch": 1, "model": get("--model", "?"), "precision": get("--precision", "?"), "gpus": int(get("--gpus", 1)),
                  "mode": get("--mode", "single"), "channels_last": "--channels-last" in a, "img_per_s": 500.0, "peak_mem_bytes": 1048576}))
EOF
done
chmod +x "$tmp/bin/nvidia-smi" "$tmp/repo/build-gpu/chorus"
(cd "$tmp/repo" && PATH="$tmp/bin:$PATH" OUT="$tmp/out" DDP_GPUS=4 DDP_CONFIGS="wrn-16-4:bf16:--channels-last" \
  DDP_DP=0 DDP_TORCH_SINGLE=0 bash scripts/gpu_check.sh ddp dp) > "$tmp/run.out" 2>&1; rc=$?
check "the dispatcher runs two stages with stubs (exit $rc)" "[ $rc = 0 ]"
order=$(awk '{print $1 " " $2}' "$log" | uniq | tr '\n' ',')
check "nvidia-smi, then chorus --version and devices, first: $order" \
  "[[ '$order' == 'nvidia-smi -L,chorus --version,chorus devices,'* ]]"
first_dp=$(grep -n -- '--strategy dp' "$log" | head -1 | cut -d: -f1)
first_ddp=$(grep -n -- '--strategy ddp' "$log" | head -1 | cut -d: -f1)
check "dp (60-data-parallel.sh) ran before ddp (70-ddp.sh), though named after it" \
  "[ -n '$first_dp' ] && [ -n '$first_ddp' ] && [ '$first_dp' -lt '$first_ddp' ]"
check "dp: WRN-28-10 fp32 and bf16 at 1 and 2 GPUs" \
  "[ \$(grep -c -- 'bench --model wrn-28-10 --strategy dp --devices cuda:0,cuda:1 --device-counts 1,2' '$log') = 2 ]"
check "DDP_GPUS=4: ddp on cuda:0-3 at 1 and 4 GPUs, eager at 4, PyTorch DDP on 4" \
  "grep -q -- '--strategy ddp --devices cuda:0,cuda:1,cuda:2,cuda:3 --device-counts 1,4 ' '$log' &&
   grep -q -- '--device-counts 4 .*--no-cuda-graphs' '$log' && grep -q -- '--mode ddp --gpus 4' '$log'"
check "the summary pairs the 4-GPU DDP row with PyTorch DDP's" \
  "grep -qE '^wrn-16-4 +bf16 +ddp +no +4 +4000.0 +500.0 +8.00' '$tmp/run.out'"
exit $fail
