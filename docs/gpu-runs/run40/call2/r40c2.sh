# Run 40 call 2: rc.38 (the sorted frontier) in a server: stress at 256 against plain, the full grammar client
# (greedy prompts, regex greedy and sampled, T = 0.8) on plain, DFLASH and DDTREE@64, interleaved speed against DFLASH.
# Each file goes to $OUT as soon as it is written; all of them are in call2.tar.gz too.
F=$OUT; mkdir -p /tmp/site /tmp/jitcache && [ -f /tmp/site/.done ] || { tar -xJf .gpu/site.tar.xz -C /tmp/site && touch /tmp/site/.done; }
export TRITON_CACHE_DIR=/tmp/jitcache/triton
rm -rf /tmp/site_dd /tmp/c2 /tmp/out40c2; mkdir -p /tmp/c2; C=/tmp/c2
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $C/steps.txt
t0=$(date +%s); left=${LEFT:-570}
echo "servers get $left s, on rc.38" >> $C/steps.txt; cp $C/steps.txt $F/
GRAMMAR_CLIENT=1 BUDGET=$left SPEED_REPEATS=19 SPEED_TIMEOUT=$(( left - 280 > 90 ? left - 280 : 90 )) \
  DDTREE_VERSION=0.3.0-rc.38 SPEED_CASES="copy_dflash copy_ddtree64" OUT=/tmp/out40c2 \
  PYTHONPATH=/tmp/site timeout $left bash tools/gpu/ddtree_run.sh copy_stress_plain copy_stress_ddtree256 copy_plain copy_dflash copy_ddtree64 > $C/run.txt 2>&1
echo "servers rc=$? at $(( $(date +%s) - t0 )) s" >> $C/steps.txt
cp /tmp/out40c2/results.tar.gz /tmp/out40c2/w/compare.txt /tmp/out40c2/w/speed*.json $C/ 2>/dev/null
tar czf $F/call2.tar.gz -C /tmp c2
cp $C/steps.txt $C/compare.txt $C/speed*.json $F/ 2>/dev/null
cat $C/steps.txt; grep -E "STRESS|HYBRID|SPEED|x |identical=False" $C/compare.txt | cut -c1-220 | tail -40; tail -5 $C/run.txt
