OUT=$OUT bash scripts/gpu_check.sh build 2>&1 | grep -E 'build ok|error' | head
A="bench --model wrn-28-10 --strategy dp --devices cuda:0,cuda:1 --device-counts 1,2 --precision bf16 --channels-last --batch-size 128 --steps 20 --warmup 8"
timeout 100 ./build-gpu/chorus $A > $OUT/crash.txt 2>&1; echo rc=$?
grep -v '^\[' $OUT/crash.txt | c++filt | cut -c1-300 | tail -40
for l in $(grep -o 'build-gpu/[a-z_.]*(+0x[0-9a-f]*)' $OUT/crash.txt); do f=${l%%(*}; o=${l#*(+}; o=${o%)}; addr2line -f -C -e $f $o | paste -sd' '; done | head -30
