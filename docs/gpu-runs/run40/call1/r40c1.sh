# Run 40 call 1: rc.38 (the sorted frontier) against rc.37: the top-K and whole build side by side (vs_many.py, every
# output checked equal), the build alone over warps and phase widths (warps40.py), and the bench with rc.38 as the
# newest (the heap ratio). Each file goes to $OUT as soon as it is written.
F=$OUT; mkdir -p /tmp/site /tmp/jitcache && [ -f /tmp/site/.done ] || { tar -xJf .gpu/site.tar.xz -C /tmp/site && touch /tmp/site/.done; }
export TRITON_CACHE_DIR=/tmp/jitcache/triton
rm -rf /tmp/c1; mkdir -p /tmp/c1; C=/tmp/c1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $C/steps.txt; lscpu | grep -E "Model name|^CPU\(s\)" >> $C/steps.txt
t0=$(date +%s)
PY="env PYTHONPATH=/tmp/site:$PWD timeout"
$PY 150 python3 .gpu/scratch/vs_many.py 37 38 > $C/variants.txt 2>&1; echo rc=$? >> $C/variants.txt; cp $C/variants.txt $F/
echo "variants done at $(( $(date +%s) - t0 )) s" >> $C/steps.txt
$PY 200 python3 .gpu/scratch/warps40.py > $C/warps.txt 2>&1; echo rc=$? >> $C/warps.txt; cp $C/warps.txt $F/
echo "warps done at $(( $(date +%s) - t0 )) s" >> $C/steps.txt
$PY 60 python3 -c "import sys; sys.path.insert(0, '.'); sys.argv = ['bench/tree_build.py', '--device', 'cuda', '--budgets', '512', '--batch', '1', '--repeats', '21']; import bench.tree_build as b; b.PREVIOUS = 'ddtree@0.3.0-rc.37'; b.NEWEST = 'ddtree@0.3.0-rc.38'; b.main()" > $C/tree_build.txt 2>&1; echo rc=$? >> $C/tree_build.txt; cp $C/tree_build.txt $F/
echo "bench done at $(( $(date +%s) - t0 )) s" >> $C/steps.txt; cp $C/steps.txt $F/
cat $C/steps.txt $C/variants.txt $C/warps.txt; tail -8 $C/tree_build.txt
