#!/usr/bin/env bash
# The GPU steps, one per call: bash benchmarks/gpu.sh OUT_DIR STEP [ARGS...]
#   tests [PYTEST ARGS]      the kernel tests with the real compiler, every case of the sweeps (default: every file)
#   tests-alone [PYTEST ARGS]  the same, each test in its own process (after a sticky CUDA error)
#   bench [BENCH ARGS]       python -m humming_jax bench (the GEMMs; peers timed in the same run)
#   layer-bench [ARGS]       python -m humming_jax bench --layer (whole layers, stage by stage)
#   process-bench [ARGS]     benchmarks.bench_process_input
#   routing-bench [ARGS]     benchmarks.bench_routing
#   call-forms [ARGS]        benchmarks.bench_call_forms: host time of a decode step in each way of jitting it
#   tune [TUNE ARGS]         python -m humming_jax tune, written to OUT_DIR/tuning.json
#   k-scan [ARGS]            benchmarks.k_scan: one tiling at several K, the per-tile overhead (the line's intercept)
#   ab [AB ARGS]             benchmarks.ab_tilings: tilings of the bench's cases, interleaved in one process
#                            (a later --out names its JSON: several ab steps in one call, one log)
#   ab-gate-up [ARGS]        benchmarks.ab_gate_up: whole layers on w13 interleaved (the activation in its tiles)
#                            and in halves, interleaved in one process
#   profile [INSPECT ARGS]   Nsight Compute sections on one benchmarks.inspect_gemm call (the first NCU_COUNT,
#                            default 1, kernels matching NCU_KERNEL, default "gemm|mosaic": moe_gemm_* of both
#                            kernel families; with --humming and NCU_KERNEL=humming, Humming's kernel instead)
#   sass [INSPECT ARGS]      one benchmarks.inspect_gemm call: its kernels' PTX, ptxas report and SASS (Mosaic's
#                            dump, its K loop counted by benchmarks.sass_loop; NCU_SOURCE=1: Nsight's source page)
#   sanitize TOOL [PYTEST ARGS]  compute-sanitizer (memcheck, racecheck, initcheck, synccheck) over kernel tests
#   hostile [ARGS]           benchmarks.hostile_gemms (large GEMMs, hostile layouts) under compute-sanitizer
#   hostile-routing [ARGS]   benchmarks.hostile_routing (routing and scatter at 65,536 x 8) under compute-sanitizer
#   soak [SOAK ARGS]         benchmarks.soak: random hostile layers against the reference for --seconds
# Logs and JSON go to OUT_DIR; the code runs from this checkout (PYTHONPATH), nothing is installed —
# except Humming's wheel when one lies in .peers/ (ignored by git; the bench then times Humming's
# kernels in the same process: benchmarks/anchors/README.md). A bench step returns Humming's
# compiled kernels as OUT_DIR/humming_cache.tgz; kept as .peers/humming_cache.tgz, later steps
# start from it.
# One-off experiments are not steps: their commands live in the notes entry that records them.
set -u -o pipefail
out=${1:?output directory}
step=${2:?step}
shift 2
mkdir -p "$out"
cd "$(dirname "$0")/.."
# deepseek-v3 keeps two 15 GB bf16 weights per case: let JAX grow past its default 75 %.
# The expert-parallel exchange needs XLA's ragged-all-to-all decomposer (humming_jax.parallel).
# Compiled executables kept on the machine's disk: a later step on the same warm machine
# (bench, then ab of the same cases) loads them instead of compiling again.
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
export PYTHONPATH=$PWD JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 \
  PYTHONUNBUFFERED=1 XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_unsupported_enable_ragged_all_to_all_decomposer=true"
wheel=$(ls .peers/humming_kernels-*.whl 2>/dev/null | head -1)
if [ -n "$wheel" ]; then
  python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/humming_site "$wheel" &&
    export PYTHONPATH=$PYTHONPATH:/tmp/humming_site HUMMING_CACHE_DIR=/tmp/humming_cache && mkdir -p /tmp/humming_cache
  # Humming's kernels compiled in earlier steps (its code never changes: ~2-3 s a kernel saved).
  [ -f .peers/humming_cache.tgz ] && tar xzf .peers/humming_cache.tgz -C /tmp/humming_cache
fi
# Humming's compiled kernels back with the step's output (to keep in .peers/ for later steps).
keep_humming_cache() {
  if [ -n "${HUMMING_CACHE_DIR:-}" ] && [ -n "$(ls -A "$HUMMING_CACHE_DIR" 2>/dev/null)" ]; then
    tar czf "$out/humming_cache.tgz" -C "$HUMMING_CACHE_DIR" .
  fi
}
# Under the sanitizers XLA's autotuner is off: each candidate it launches is slow there, and it checks none of ours.
sanitized_xla_flags="$XLA_FLAGS --xla_gpu_autotune_level=0"
# SANITIZER_ARGS: more compute-sanitizer options for the sanitizer steps, e.g. "--kernel-name kns=moe_":
# only this library's kernels (every name starts moe_) instrumented, not the reference's XLA and cuBLAS kernels.
sanitizer="compute-sanitizer --error-exitcode 3 --print-limit 20 ${SANITIZER_ARGS:-}"
case $step in
  # A hung kernel fails its test after 120 s (pytest-timeout, on the GPU image) instead of holding a worker.
  tests) python3 -m pytest -q -n 6 --full -p no:cacheprovider -W ignore::DeprecationWarning --timeout 120 \
           --timeout-method thread "${@:-tests}" 2>&1 | tee "$out/tests.log" | tail -15 ;;
  bench) python3 -W ignore -m humming_jax bench --out "$out/gemm.json" "$@" 2>&1 | tee "$out/gemm_bench.log"
         keep_humming_cache ;;
  layer-bench) python3 -W ignore -m humming_jax bench --layer --out "$out/layer.json" "$@" 2>&1 |
                 tee "$out/layer_bench.log" | tail -40 ;;
  process-bench) python3 -W ignore -m benchmarks.bench_process_input --out "$out/process_input.json" "$@" 2>&1 |
                   tee "$out/process_bench.log" | tail -30 ;;
  routing-bench) python3 -W ignore -m benchmarks.bench_routing --out "$out/routing.json" "$@" 2>&1 |
                   tee "$out/routing_bench.log" | tail -30 ;;
  call-forms) python3 -W ignore -m benchmarks.bench_call_forms --out "$out/call_forms.json" "$@" 2>&1 |
                tee "$out/call_forms.log" | tail -30 ;;
  k-scan) python3 -W ignore -m benchmarks.k_scan --out "$out/k_scan.json" "$@" 2>&1 | tee "$out/k_scan.log" | tail -20 ;;
  ab) python3 -W ignore -m benchmarks.ab_tilings --out "$out/ab.json" "$@" 2>&1 | tee -a "$out/ab.log" | tail -40 ;;
  ab-gate-up) python3 -W ignore -m benchmarks.ab_gate_up --out "$out/ab_gate_up.json" "$@" 2>&1 | tee -a "$out/ab_gate_up.log" | tail -30 ;;
  tune) python3 -W ignore -m humming_jax tune --out "$out/tuning.json" "$@" 2>&1 | tee "$out/tune.log" | tail -30 ;;
  # The pipes' use, the instruction mix and each stall reason per issued instruction: what bounds a kernel.
  profile) ncu --clock-control none -k "regex:${NCU_KERNEL:-gemm|mosaic}" -c "${NCU_COUNT:-1}" --section SpeedOfLight --section Occupancy \
             --section LaunchStats --section WarpStateStats --section SchedulerStats \
             --section ComputeWorkloadAnalysis --section InstructionStats --section MemoryWorkloadAnalysis \
             --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio$" \
             python3 -W ignore -m benchmarks.inspect_gemm "$@" 2>&1 | tee "$out/profile.log" | tail -60 ;;
  # The kernels' SASS for one call, compiled afresh (a cached executable would skip the dump): Mosaic's own
  # dump (PTX, ptxas report — a "wgmma serialized" line says ptxas waits out each product —, SASS through
  # the nvdisasm the triton package ships: the image has no CUDA toolkit on PATH), each K loop counted by
  # benchmarks.sass_loop. With NCU_SOURCE=1 also Nsight Compute's source page for the first kernel matching
  # NCU_KERNEL (Triton's included) — each SASS instruction with its executed count and stall samples — as
  # kernel_sass.csv (a second run: ncu and the dump's nvdisasm in one process have crashed).
  sass) mkdir -p "$out/mosaic"
        bin=$(python3 -c "import os, triton; print(os.path.dirname(triton.__file__) + '/backends/nvidia/bin')")
        PATH="$bin:$PATH" JAX_ENABLE_COMPILATION_CACHE=false MOSAIC_GPU_DUMP_TO="$out/mosaic" MOSAIC_GPU_DUMP_SASS=1 \
          MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_PTXAS=1 \
          python3 -W ignore -m benchmarks.inspect_gemm "$@" 2>&1 | tee "$out/sass.log" | tail -8
        grep -H -E "serialized|spill|Used" "$out"/mosaic/*.ptxas | tee "$out/ptxas.txt"
        # no SASS dumped (nvdisasm failed): the PTX through the triton package's ptxas (benchmarks.sass_loop)
        kind=sass; [ -n "$(find "$out/mosaic" -name "*.sass")" ] || kind=ptx
        PATH="$bin:$PATH" find "$out/mosaic" -name "*.$kind" -exec python3 -m benchmarks.sass_loop {} + 2>&1 |
          tee "$out/sass_loop.txt" | head -60
        if [ -n "${NCU_SOURCE:-}" ]; then
          ncu --clock-control none -k "regex:${NCU_KERNEL:-gemm|mosaic}" -c 1 --section SourceCounters \
            --section LaunchStats -o "$out/kernel" -f python3 -W ignore -m benchmarks.inspect_gemm "$@" > /dev/null 2>&1
          ncu --import "$out/kernel.ncu-rep" --page source --print-source sass --csv > "$out/kernel_sass.csv" 2>&1
        fi
        tar czf "$out/mosaic.tgz" --exclude='*.mlir-passes.log' -C "$out" mosaic && rm -rf "$out/mosaic" ;;
  # Each test in its own process, 8 at once: a sticky CUDA error (a misaligned or illegal access) stays in
  # its test instead of failing every later test of a pytest-xdist worker. PASS/FAIL lines in
  # tests_alone.txt; a failing test's log kept as alone_N.log.
  tests-alone)
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.1 python3 -m pytest -q --collect-only --full -p no:cacheprovider \
      "${@:-tests}" 2>/dev/null | grep "::" > "$out/alone_ids.txt"
    one() {
      local log; log="$2/alone_$(echo "$1" | md5sum | cut -c1-8).log"
      if XLA_PYTHON_CLIENT_MEM_FRACTION=0.1 timeout 150 python3 -m pytest -q -x -p no:xdist -p no:cacheprovider \
           --full -W ignore::DeprecationWarning "$1" > "$log" 2>&1; then
        echo "PASS $1"; rm -f "$log"
      else echo "FAIL $1 :: $(grep -m1 -E '^E ' "$log" | cut -c1-160) ($log)"; fi
    }
    export -f one
    xargs -P 8 -I{} bash -c 'one "$@"' _ {} "$out" < "$out/alone_ids.txt" | sort > "$out/tests_alone.txt"
    echo "$(grep -c '^PASS' "$out/tests_alone.txt") passed alone of $(wc -l < "$out/alone_ids.txt")"
    grep '^FAIL' "$out/tests_alone.txt" ;;
  # One cudaMalloc per buffer (no XLA pool), so that a store past a buffer is an error, not another buffer's bytes.
  sanitize) tool=${1:?memcheck, racecheck, initcheck or synccheck}; shift
    XLA_FLAGS="$sanitized_xla_flags" XLA_PYTHON_CLIENT_ALLOCATOR=platform $sanitizer --tool "$tool" \
      python3 -m pytest -q -p no:cacheprovider -p no:xdist -W ignore::DeprecationWarning \
      "${@:-tests/test_process_input.py}" 2>&1 | tee "$out/sanitize_$tool.log" | tail -30 ;;
  # benchmarks.hostile_gemms under a sanitizer (SANITIZER, default memcheck): every GEMM family at
  # 65,536 rows on hostile layouts, each checked against the reference.
  # A first run outside the sanitizer, with the same flags, fills the compilation cache: under it a compile
  # of some pairs' programs runs past 250 s, a cached executable loads in seconds.
  hostile) XLA_FLAGS="$sanitized_xla_flags" python3 -W ignore -m benchmarks.hostile_gemms \
             --out "$out/hostile_unsanitized.json" "$@" > "$out/hostile_unsanitized.log" 2>&1 || exit 4
    XLA_FLAGS="$sanitized_xla_flags" XLA_PYTHON_CLIENT_ALLOCATOR=platform $sanitizer --tool "${SANITIZER:-memcheck}" \
             python3 -W ignore -m benchmarks.hostile_gemms --out "$out/hostile.json" "$@" 2>&1 |
             tee "$out/hostile.log" | tail -30 ;;
  # benchmarks.hostile_routing the same way: the routing and scatter kernels at 65,536 tokens x top-8, E=256.
  hostile-routing) XLA_FLAGS="$sanitized_xla_flags" python3 -W ignore -m benchmarks.hostile_routing \
             --out "$out/hostile_routing_unsanitized.json" "$@" > "$out/hostile_routing_unsanitized.log" 2>&1 || exit 4
    XLA_FLAGS="$sanitized_xla_flags" XLA_PYTHON_CLIENT_ALLOCATOR=platform $sanitizer --tool "${SANITIZER:-memcheck}" \
             python3 -W ignore -m benchmarks.hostile_routing --out "$out/hostile_routing.json" "$@" 2>&1 |
             tee "$out/hostile_routing.log" | tail -30 ;;
  soak) python3 -W ignore -m benchmarks.soak --out "$out/soak.json" "$@" 2>&1 | tee "$out/soak.log" | tail -20 ;;
  *) echo "unknown step: $step" >&2; exit 2 ;;
esac
