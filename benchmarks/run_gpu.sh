#!/usr/bin/env bash
# One GPU session's checks and measurements, in priority order. Usage (from the
# repository root, on the GPU machine): bash benchmarks/run_gpu.sh OUT_DIR [STEP...]
# Steps: ring-tests rotation-ab hadamard-reread hadamard-pieces hadamard-mosaic-profile hadamard-mosaic hadamard-two-pass align-gate indexed-zeros zero-fill gemm-bench-decode-mixtral hadamard-rows t1-profile int4-prefill-bench int4-prefill-combos mosaic-cluster process-copy hadamard-profile hadamard-sub mixtral-w2-prefill gemm-bench-t1 t1-split gemm-bench-decode gemm-bench-small v17-tests mosaic-words-mixtral mosaic-wide mosaic-decode-words w2-decode-stages mixtral-w2-decode v15-tests mosaic-decode mosaic-ptxas mosaic-delay mosaic-delay-int4 mosaic-swap-w2 v14-tests mosaic-int4 mosaic-profile mosaic-fp4 mosaic-split-bf16 mosaic-tests mosaic-inspect mosaic-w2 v12-tests column-tiles tune-w2-decode fp4-prefill-profile one-block-768 silu-profile v11-tests fp4-inspect tune-decode-small hadamard-768 tune-mid-4bit tune-mid-4bit-w2 tune-prefill-indexed hadamard-ab planar-inspect v10-tests tune-w2-4bit tune-large-4bit v9-tests pair-inspect-2 tune-prefill-fp4 tune-decode-indexed v8-tests pair-inspect process-loop tune-prefill-int4 gemm-bench-mixtral gemm-profile-prefill gemm-bench-small-mixtral gemm-bench-gptoss v7-tests routing-tiles process-tiles hadamard-split gemm-profile tune-w2 gemm-bench-awq v6-tests v5-tests tune-decode tune-prefill routing-bench-large gemm-tests gemm-bench gemm-bench-prefill gemm-bench-large tune tune-large process-nvfp4
#        routing-tests process-tests routing-bench process-bench
# Each step fits in 10 minutes; the bench JSON is rewritten after every row.
set -u
out=${1:?output directory}
shift
steps=${*:-v12-tests process-bench}
mkdir -p "$out"
# deepseek-v3 keeps two 15 GB bf16 weights per case: let JAX grow past its default 75 %
# (torch returns its cached blocks after timing, see humming_jax.bench).
export JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
# A hung kernel fails its test after 120 s (pytest-timeout, on the GPU image) instead of holding a worker.
pytest_gpu() { timeout "$1" python3 -m pytest -q -n 6 -p no:cacheprovider -W ignore::DeprecationWarning \
                 --timeout 120 --timeout-method thread "${@:2}"; }
# The tune steps merge into a copy of the shipped table: what comes back in OUT
# is the whole new table (copy it over humming_jax/tuning_h200.json after review).
table="$out/tuning_h200.json"
[ -f "$table" ] || cp humming_jax/tuning_h200.json "$table"
for step in $steps; do
  echo "=== $step"
  case $step in
    # GEMM v17 (word_decode: nibbles from the codes' 32-bit registers) with the real compiler: its GPU-only tests
    # (f16, uint4 zero points, 16-row tiles), then the mixtral entries it was set on without a timing.
    v17-tests) pytest_gpu 200 tests/test_gemm_mosaic.py 2>&1 | tee "$out/v17_tests.log" | tail -8 ;;
    mosaic-words-mixtral) for gemm in w13 w2; do  # int4 T=4096 (swap_ab: w13 3969.1 / 4032.1 bench, w2 2073.3)
                            timeout 270 python3 -W ignore -m benchmarks.inspect_gemm --problem mixtral-8x7b --gemm $gemm \
                              --fmt int4_g128 --tokens 4096 --config 128,256,128,4,3,mosaic,group_m=8,swap_ab \
                              --config 128,256,128,4,3,mosaic,group_m=8,swap_ab,word_decode 2>&1 | tail -2
                          done | tee "$out/mosaic_words_mixtral.log" ;;
    # process_input at T=4096 against a same-run pass over as many bytes (the issue's measure: bench `x copy`).
    process-copy) timeout 200 python3 -W ignore -m benchmarks.bench_process_input --tokens 4096 \
                    --out "$out/process_copy.json" 2>&1 | tee "$out/process_copy.log" | tail -14 ;;
    # T=1 decode against the measured copy (the decode target's unmeasured point; ~0.56-0.65 estimated from the
    # copies of other sizes), then split K at T=1: 192 programs of 8 K steps (qwen3 w13) are a latency chain each
    # (or more of each chain in flight: 5 stages).
    gemm-bench-t1) timeout 200 python3 -W ignore -m humming_jax bench --problems qwen3-30b-a3b --tokens 1 \
                     --formats int4_g128 mxfp4 --out "$out/gemm_t1.json" 2>&1 | tee "$out/gemm_bench_t1.log" | tail -10 ;;
    # T=16 int4 / MXFP4 with the table as it stands (qwen3 w2's 2-stage (16,128] entry not benched yet).
    gemm-bench-decode) timeout 200 python3 -W ignore -m humming_jax bench --problems qwen3-30b-a3b --tokens 16 \
                         --formats int4_g128 mxfp4 --out "$out/gemm_decode.json" 2>&1 | tee "$out/gemm_bench_decode.log" | tail -10 ;;
    t1-split) for fmt in int4_g128 mxfp4; do
                timeout 120 python3 -W ignore -m benchmarks.inspect_gemm --problem qwen3-30b-a3b --gemm w13 --fmt $fmt \
                  --tokens 1 --config 16,64,256,4,3,swap_ab,word_decode,fold_scales,pair_decode \
                  --config 16,64,256,4,3,swap_ab,word_decode,fold_scales,pair_decode,split_k=2 \
                  --config 16,64,128,4,3,swap_ab,word_decode,fold_scales,pair_decode,split_k=4 \
                  --config 16,32,256,4,3,swap_ab,word_decode,fold_scales,pair_decode \
                  --config 16,64,256,4,5,swap_ab,word_decode,fold_scales,pair_decode 2>&1 | tail -5
              done | tee "$out/t1_split.log" ;;
    # GEMM v20: clusters of two programs on adjacent column tiles of one row tile, x's TMA loads multicast to both
    # (bf16 128x256x64: 48 KB a K step from L2 -> 40), or on a pair of row tiles of one expert, the weight's
    # multicast (-> 32 KB); at mixtral w13's 577 TFLOP/s the tiles pull ~6.8 TB/s from L2, near what an
    # H100-class L2 serves. Tests first (the register-operand forms run compiled only).
    mosaic-cluster) pytest_gpu 150 tests/test_gemm_mosaic.py -k "cluster" 2>&1 | tail -3
                    for problem in mixtral-8x7b qwen3-30b-a3b; do
                      for gemm in w13 w2; do
                        timeout 170 python3 -W ignore -m benchmarks.inspect_gemm --problem $problem --gemm $gemm \
                          --fmt bf16 --tokens 4096 --config 128,256,64,4,3,mosaic,group_m=8 \
                          --config 128,256,64,4,3,mosaic,group_m=8,cluster_n=2 \
                          --config 128,256,64,4,3,mosaic,group_m=8,cluster_m=2 \
                          --config 128,256,64,4,4,mosaic,group_m=8,cluster_m=2 2>&1 | tail -4
                      done
                    done | tee "$out/mosaic_cluster.log"
                    timeout 120 python3 -W ignore -m benchmarks.inspect_gemm --problem qwen3-30b-a3b --gemm w13 \
                      --fmt int4_g128 --tokens 4096 --config 128,256,128,4,3,mosaic,group_m=8,swap_ab,word_decode \
                      --config 128,256,128,4,3,mosaic,group_m=8,swap_ab,word_decode,cluster_n=2 2>&1 \
                      | tail -2 | tee -a "$out/mosaic_cluster.log" ;;
    # process_input v7: each Hadamard block of 128 as 128/S products with the S x S matrix and f32 butterflies
    # (H_128 = H_{128/S} (x) H_S): offline sm_90 SASS, K=768 8x4x1x4: HMMA 96 -> 48 (h64) / 24 (h32) a block,
    # registers 168 -> 136 / 128, shared memory 61 -> 35 / 28 KB (3 -> 4 programs an SM with h32); K=2048
    # 4x8x1x8: 90 -> 61 KB with h64 (2 -> 3 programs an SM), 438 -> 459 instructions a block. Tests first.
    hadamard-sub) pytest_gpu 150 tests/test_process_input.py -k "sub or butterfl or operands" 2>&1 | tail -3
                  timeout 300 python3 -W ignore -m benchmarks.bench_process_input --tokens 4096 --widths 768 2048 \
                    --cases hadamard128+fp8_token --tiles 0x0h64 0x0h32 8x4x1x4h64 8x4x1x4h32 16x4x1x4h32 8x4x1x8h32 \
                    4x8x1x8h64 4x8x1x8h32 --out "$out/hadamard_sub.json" 2>&1 | tee "$out/hadamard_sub.log" | tail -20 ;;
    # int4 T=4096 with the cluster_n=2 entries (thirteenth session), torch's bf16 grouped GEMM in the same run.
    int4-prefill-bench) timeout 450 python3 -W ignore -m humming_jax bench --problems qwen3-30b-a3b mixtral-8x7b \
                          --tokens 4096 --formats int4_g128 --out "$out/gemm_int4_prefill.json" 2>&1 \
                          | tee "$out/gemm_int4_prefill.log" | tail -10 ;;
    # process_input v9: the Mosaic GPU rotation (tiles 0x0m / 0x0m2: 64-token tiles streamed by TMA, products taken
    # twice on wgmma by 1 or 2 compute warpgroups, e4m3 stores through swizzled slots). Its tests with the real
    # compiler (and the mended operands comparison), then T=16/512/4096 at K=768 against the Triton default
    # (fifteenth session 39.4 us, 0.57). Prediction: K=768 T=4096 ~20-26 us with one warpgroup (>= 0.85 of the
    # copy), two at the copy's pace if one is compute-bound; T=16 / 512 slower than Triton (2 / 64 programs).
    # process_input v10: the Mosaic rotation with barriers a piece (a 64-column piece refilled as soon as every
    # warpgroup is done with it) and a warpgroup of its own for the row max (x). Sixteenth session, T=4096 K=768
    # (copy 21.9-24.9 us): v9 0x0m2 38.9-43.0 us, 0x0m3 37.6-40.5 (0.54-0.59), 0x0m3x with whole-tile barriers 39.2;
    # v9 cut down: no first pass 27.8, no products 26.8, loads only 16.9, one warpgroup's first pass alone 20.4: with
    # two tiles of 96 KB in flight, a tile's row max waited for the last tile's release (load + max in series).
    # Prediction: 0x0m3x <= 30 us (>= 0.75 of the copy); 0x0m3 ~35.
    # process_input v13 (self_loads) and v14 (own_rings): their GPU-only tests (compiled there; a barrier bug hangs:
    # pytest-timeout fails it). 13 passed in the nineteenth session.
    ring-tests) pytest_gpu 150 tests/test_process_input.py -k "self_loads or own_rings or write_variants or 4rs or 3o" \
                  > "$out/ring_tests.log" 2>&1
                tail -3 "$out/ring_tests.log" ;;
    # In-process interleaved A/B of the rotation's forms against v12 (each variant compiles once, ~20 s).
    rotation-ab) own="own_rings=True,max_warpgroup=False,reread=False"
                 timeout 280 python3 -W ignore -m benchmarks.ab_rotation --rounds 7 --warpgroups 4 v12: \
                   self:self_loads=True "own4:$own" "own3:$own,warpgroups=3" "own2:$own,warpgroups=2" 2>&1 \
                   | tee "$out/ab4.log" | tail -7
                 timeout 200 python3 -W ignore -m benchmarks.ab_rotation --rounds 7 --warpgroups 3 v12: \
                   self:self_loads=True ring2:first_ring=2 2>&1 | tee "$out/ab3.log" | tail -5 ;;
    # process_input v11 (the second pass re-read from L2 through rings of Hadamard blocks).
    hadamard-reread) pytest_gpu 150 tests/test_process_input.py -k "mosaic" > "$out/mosaic_tests.log" 2>&1
                     tail -3 "$out/mosaic_tests.log"
                     timeout 300 python3 -W ignore -m benchmarks.bench_process_input --tokens 16 512 4096 --widths 768 \
                       --cases hadamard128+fp8_token --tiles 0x0m4r 0x0m3o 0x0m2o \
                       --out "$out/hadamard_reread.json" 2>&1 | tee "$out/hadamard_reread.log" | tail -16 ;;
    hadamard-pieces) pytest_gpu 150 tests/test_process_input.py -k "mosaic" > "$out/mosaic_tests.log" 2>&1
                     tail -3 "$out/mosaic_tests.log"
                     timeout 300 python3 -W ignore -m benchmarks.bench_process_input --tokens 16 512 4096 --widths 768 \
                       --cases hadamard128+fp8_token --tiles 0x0m2 0x0m3 0x0m2x 0x0m3x \
                       --out "$out/hadamard_pieces.json" 2>&1 | tee "$out/hadamard_pieces.log" | tail -16 ;;
    # The Mosaic rotation's stall reasons (SourceCounters left out: with it ncu's replay failed the launch).
    hadamard-mosaic-profile) for tiles in 0x0m3 0x0m2; do
                              timeout 150 ncu -k regex:mosaic_gpu -c 1 --section SpeedOfLight --section LaunchStats \
                                --section Occupancy --section WarpStateStats --section SchedulerStats \
                                --section MemoryWorkloadAnalysis --metrics \
smsp__average_warp_latency_issue_stalled_barrier,smsp__average_warp_latency_issue_stalled_membar,\
smsp__average_warp_latency_issue_stalled_long_scoreboard,smsp__average_warp_latency_issue_stalled_wait,\
smsp__average_warp_latency_issue_stalled_short_scoreboard,smsp__average_warp_latency_issue_stalled_math_pipe_throttle,\
smsp__average_warp_latency_issue_stalled_sleeping,smsp__average_warp_latency_issue_stalled_dispatch_stall,\
smsp__inst_executed.sum,smsp__cycles_active.avg \
                                python3 -W ignore -m benchmarks.bench_process_input --tokens 4096 --widths 768 \
                                --cases hadamard128+fp8_token --tiles $tiles --out "$out/rot_prof_$tiles.json" \
                                > "$out/rot_${tiles}_profile.txt" 2>&1
                              grep -E "Duration|Registers|Stall|stalled|Issued|Warp Cycles|Throughput|inst_executed|Eligible|LaunchFailed" \
                                "$out/rot_${tiles}_profile.txt" | head -40
                            done ;;
    hadamard-mosaic) pytest_gpu 150 tests/test_process_input.py -k "mosaic or operands" 2>&1 | tail -3
                     timeout 300 python3 -W ignore -m benchmarks.bench_process_input --tokens 16 512 4096 \
                       --widths 768 --cases hadamard128+fp8_token --tiles 0x0m 0x0m2 --out "$out/hadamard_mosaic.json" 2>&1 \
                       | tee "$out/hadamard_mosaic.log" | tail -8 ;;
    # process_input v8: two passes with sub-block products (tiles RxWx2hS). Offline sm_90 SASS, K=768, per element
    # and thread (both passes): 128x8x2h64 7.0 instructions (93 registers, 80 KB shared: 2 programs an SM),
    # 64x4x2h64 14.0 (94, 45 KB: 5), 64x8x2h64 17.4 (60, 45 KB: 5), 32x4x2h64 20.8; one pass 16x4x1x4h64 15.1
    # (195 registers: 2 programs; 37.3 us = 0.60 of the copy), 8x4 22 (136: 3; 38.5 us). The second pass re-reads x
    # (from L2 while the rows in flight fit: ~52 MB at 128x8). Prediction: 128x8x2h64 K=768 <= 30 us (>= 0.73).
    hadamard-two-pass) pytest_gpu 150 tests/test_process_input.py -k "two_pass or sub_block" 2>&1 | tail -3
                       timeout 300 python3 -W ignore -m benchmarks.bench_process_input --tokens 4096 --widths 768 2048 \
                         --cases hadamard128+fp8_token --tiles 128x8x2h64 64x4x2h64 64x8x2h64 32x4x2h64 128x8x2h32 \
                         128x8x2 16x4x1x4h64 0x0 --out "$out/hadamard_two_pass.json" 2>&1 \
                         | tee "$out/hadamard_two_pass.log" | tail -17 ;;
    # v22 as it stands (align lists the dropped slots with no extra bin: their places come from the chunk bases;
    # fill compares of 32 bins): the tests with the real compiler, then align / scatter times (fourteenth session,
    # E=128 T=16/512/4096: 14.5 / 15.5 / 29.0 us before v22, 19.6 / 20.5 / 25.9 with an extra bin (256 bins) and the
    # new fill tiles; prediction <= 14.5 at T=16).
    align-gate) pytest_gpu 200 tests/test_routing.py tests/test_gemm_kernel.py \
                  -k "align or grouping or routings or dead_blocks" 2>&1 | tail -3
                timeout 200 python3 -W ignore -m benchmarks.bench_routing --tokens 16 512 4096 --experts 128,8 8,2 256,8 \
                  --hidden 2048 --out "$out/routing_gate.json" 2>&1 | grep -E "align|scatter" | tee "$out/routing_gate.log" ;;
    # GEMM v22: moe_align_block_size lists the dropped slots past num_tokens_padded, so the indexed GEMM zeroes
    # their rows itself (no zero fill before it). Its tests and align's with the real compiler, then qwen3 and
    # mixtral T=1 / T=16 against the same-run copy (fourteenth session, v21: qwen3 T=1 w13 indexed int4 12.1 us 0.58,
    # MXFP4 12.8 0.56; grouped 11.0 / 11.1), then the routing ops' times (align counts one more bin: 256 at E=128).
    indexed-zeros) pytest_gpu 200 tests/test_gemm_kernel.py tests/test_routing.py \
                     -k "indexed or random_routings or dead_blocks or align or grouping" 2>&1 | tail -3
                   timeout 300 python3 -W ignore -m humming_jax bench --problems qwen3-30b-a3b mixtral-8x7b --tokens 1 16 \
                     --formats int4_g128 mxfp4 --out "$out/gemm_indexed_zeros.json" 2>&1 \
                     | tee "$out/gemm_indexed_zeros.log" | tail -33
                   timeout 150 python3 -W ignore -m benchmarks.bench_routing --tokens 16 512 4096 --experts 8,2 128,8 \
                     --out "$out/routing.json" 2>&1 | grep -v '^done' | tee "$out/routing_bench.log" | tail -30 ;;
    # GEMM v21: the kernel writes its zeros (no zero-fill before it but for indexed): the kernel's tests
    # with the real compiler, then T=1 and T=16 against the same-run copy (thirteenth session: T=1 w13 12.4 us,
    # 0.43; w2 8.3, 0.58; T=16 w13 55.3, w2 34.0).
    zero-fill) pytest_gpu 200 tests/test_gemm_kernel.py -k "outside_every or at_the_bound or grouped_masked or (dense and int4)" \
                 2>&1 | tail -3
               timeout 150 python3 -W ignore -m humming_jax bench --problems qwen3-30b-a3b --tokens 1 16 \
                 --formats int4_g128 mxfp4 --out "$out/gemm_zero_fill.json" 2>&1 | tee "$out/gemm_zero_fill.log" | tail -17 ;;
    # mixtral decode (T=16, int4 / MXFP4) against the same-run copy: w2 0.54-0.59 in the ninth session (before v17).
    gemm-bench-decode-mixtral) timeout 300 python3 -W ignore -m humming_jax bench --problems mixtral-8x7b --tokens 16 \
                                 --formats int4_g128 mxfp4 --out "$out/gemm_decode_mixtral.json" 2>&1 \
                                 | tee "$out/gemm_bench_decode_mixtral.log" | tail -10 ;;
    # process_input: the rows of the sub-block Hadamard products (thirteenth session: K=768 0x0h64 39.1 us = 0.54
    # of the copy, K=2048 8x4x1x4h64 74.2 = 0.70 and 0x0h64 77.6 = 0.67; the run-to-run spread is ~5 %).
    hadamard-rows) timeout 300 python3 -W ignore -m benchmarks.bench_process_input --tokens 4096 --widths 768 2048 \
                     --cases hadamard128+fp8_token --tiles 8x4x1x4h64 16x4x1x4h64 16x4x1x2h64 8x4x1x8h64 \
                     16x8x1x4h64 8x8x1x4h64 8x8x1x2h64 0x0 --out "$out/hadamard_rows.json" 2>&1 | tee "$out/hadamard_rows.log" | tail -16 ;;
    # T=1 (qwen3 w13 int4: 12.4 us = 0.43 of the same-run copy; two fits give ~4 us fixed + 0.63 us/MB, i.e. a
    # marginal 1.6 TB/s): what one call launches (the optimized module; indexed keeps the zero fill v21 removed
    # from the grouped layouts) and what the GEMM waits on (Nsight sections).
    t1-profile) cfg=16,64,256,4,3,swap_ab,word_decode,fold_scales,pair_decode
                for layout in grouped indexed; do
                  timeout 120 python3 -W ignore -m benchmarks.inspect_gemm --fmt int4_g128 --tokens 1 --layout $layout \
                    --config $cfg --hlo 2>&1 | tail -2
                done | tee "$out/t1_launches.log"
                timeout 200 ncu -k regex:gemm -c 1 --section SpeedOfLight --section Occupancy --section LaunchStats \
                  --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
                  python3 -W ignore -m benchmarks.inspect_gemm --fmt int4_g128 --tokens 1 --config $cfg \
                  > "$out/t1_ncu.txt" 2>&1
                grep -E "Duration|Throughput|Issued|Stall|Warp Cycles|Occupancy|Registers|Eligible|Hit Rate|Shared" \
                  "$out/t1_ncu.txt" | head -40 ;;
    # The thirteenth session's mixtral-w2-prefill: two epilogue slots -7.9 %, cluster_n=2 -6 %, 4 stages -4.3 % on
    # mixtral int4 w2; cluster_n=2 -6.6 % on w13 and -5.6 % on qwen3 w13. Do they stack?
    int4-prefill-combos) for problem in mixtral-8x7b qwen3-30b-a3b; do
                           for gemm in w2 w13; do
                             timeout 150 python3 -W ignore -m benchmarks.inspect_gemm --problem $problem --gemm $gemm \
                               --fmt int4_g128 --tokens 4096 --config 128,256,128,4,3,mosaic,group_m=8,swap_ab,word_decode,cluster_n=2 \
                               --config 128,256,128,4,3,mosaic,group_m=8,swap_ab,word_decode,epilogue_slots=2 \
                               --config 128,256,128,4,3,mosaic,group_m=8,swap_ab,word_decode,epilogue_slots=2,cluster_n=2 2>&1 | tail -3
                           done
                         done | tee "$out/int4_prefill_combos.log" ;;
    # mixtral int4 w2 at T=4096: 0.798x of torch in the twelfth session's bench (1863.6 us against 1486.9):
    # 4 stages, wider bands, two epilogue slots, a 128-column tile.
    mixtral-w2-prefill) timeout 400 python3 -W ignore -m benchmarks.inspect_gemm --problem mixtral-8x7b --gemm w2 \
                          --fmt int4_g128 --tokens 4096 --config 128,256,128,4,3,mosaic,group_m=8,swap_ab,word_decode \
                          --config 128,256,128,4,4,mosaic,group_m=8,swap_ab,word_decode \
                          --config 128,256,128,4,3,mosaic,group_m=16,swap_ab,word_decode \
                          --config 128,256,128,4,3,mosaic,group_m=8,swap_ab,word_decode,epilogue_slots=2 \
                          --config 128,128,128,4,4,mosaic,group_m=8,swap_ab,word_decode \
                          --config 128,256,128,4,3,mosaic,group_m=8,swap_ab,word_decode,cluster_n=2 2>&1 \
                          | tail -6 | tee "$out/mixtral_w2_prefill.log"
                        timeout 150 python3 -W ignore -m benchmarks.inspect_gemm --problem mixtral-8x7b --gemm w13 \
                          --fmt int4_g128 --tokens 4096 --config 128,256,128,4,3,mosaic,group_m=8,swap_ab,word_decode \
                          --config 128,256,128,4,3,mosaic,group_m=8,swap_ab,word_decode,cluster_n=2 2>&1 \
                          | tail -2 | tee -a "$out/mixtral_w2_prefill.log" ;;
    # The 128x256 tile with split rows: each compute warpgroup 64 rows x 256 columns, one m64n256 wgmma a k16 step
    # instead of two m64n128 (the weight tile read once from shared memory: 10 KB of operands instead of 12, with the
    # TMA writes ~127 B/clk against ~143 at the tensor rate — if shared memory is the limit, ~10 % faster).
    # v19: two epilogue slots a warpgroup (the next 64-column chunk written while the last one's store reads).
    mosaic-wide) for problem in mixtral-8x7b qwen3-30b-a3b; do  # bf16 T=4096 (mixtral w13 3434.2 in the bench)
                   for gemm in w13 w2; do
                     timeout 170 python3 -W ignore -m benchmarks.inspect_gemm --problem $problem --gemm $gemm --fmt bf16 \
                       --tokens 4096 --config 128,256,64,4,3,mosaic,group_m=8 \
                       --config 128,256,64,4,3,mosaic,group_m=8,split_rows \
                       --config 128,256,64,4,4,mosaic,group_m=8,split_rows \
                       --config 128,256,64,4,3,mosaic,group_m=8,split_rows,epilogue_slots=2 \
                       --config 128,256,64,4,3,mosaic,group_m=8,epilogue_slots=2 2>&1 | tail -5
                   done
                 done | tee "$out/mosaic_wide.log" ;;
    # v16's decode tiles with v17's word decode (T=16; v16 without it: qwen3 w13 106.1 us against the Triton
    # entry's 56.1).
    mosaic-decode-words) for gemm in w13 w2; do
                           timeout 120 python3 -W ignore -m benchmarks.inspect_gemm --problem qwen3-30b-a3b --gemm $gemm \
                             --fmt int4_g128 --tokens 16 --config 16,256,128,4,4,mosaic,swap_ab \
                             --config 16,256,128,4,4,mosaic,swap_ab,word_decode \
                             --config 16,256,128,4,6,mosaic,swap_ab,word_decode,delay_release=1 \
                             --config 32,256,128,4,4,mosaic,swap_ab,word_decode 2>&1 | tail -4
                         done | tee "$out/mosaic_decode_words.log" ;;
    # qwen3 w2 decode (K=768: 3 K steps a program, 46 % of copy): 2 stages won 35.4 -> 33.7 us at 16x128x256 in the
    # eleventh session (less shared memory a program, more programs an SM); smaller and 2-warp tiles the same way.
    w2-decode-stages) for fmt in int4_g128 mxfp4; do
                        timeout 120 python3 -W ignore -m benchmarks.inspect_gemm --problem qwen3-30b-a3b --gemm w2 --fmt $fmt \
                          --tokens 16 --config 16,128,256,4,2,word_decode,fold_scales,pair_decode \
                          --config 16,64,256,4,2,word_decode,fold_scales,pair_decode \
                          --config 16,64,256,2,2,word_decode,fold_scales,pair_decode \
                          --config 16,128,128,4,2,word_decode,fold_scales,pair_decode \
                          --config 16,32,256,2,2,word_decode,fold_scales,pair_decode 2>&1 | tail -5
                      done | tee "$out/w2_decode_stages.log" ;;
    # mixtral w2 decode (K=14336, 8 experts x 32 column tiles = 256 programs, 2 an SM: 54-59 % of the measured copy):
    # more programs an SM to hide each one's decode latency — K split in 2 / 4, or 64-column tiles.
    mixtral-w2-decode) for fmt in int4_g128 mxfp4; do
                         timeout 250 python3 -W ignore -m benchmarks.inspect_gemm --problem mixtral-8x7b --gemm w2 --fmt $fmt \
                           --tokens 16 --config 16,128,256,4,3,word_decode,fold_scales,pair_decode \
                           --config 16,128,256,4,3,word_decode,fold_scales,pair_decode,split_k=2 \
                           --config 16,128,256,4,3,word_decode,fold_scales,pair_decode,split_k=4 \
                           --config 16,64,256,4,3,word_decode,fold_scales,pair_decode 2>&1 | tail -4
                       done | tee "$out/mixtral_w2_decode.log" ;;
    # Eighth session's code with the real lowering: column tiles, one-block rows, the K=768 Hadamard rule.
    v12-tests) { pytest_gpu 150 tests/test_gemm_kernel.py -k "column_tiles or planar or half_bits"
                 pytest_gpu 150 tests/test_process_input.py tests/test_lowering.py; } 2>&1 | tee "$out/v12_tests.log" | tail -8 ;;
    # GEMM v13: the Mosaic GPU kernel — its tests with the real compiler, then against the Triton entries
    # at prefill (bf16 mixtral w13 3788 us = 0.77x torch, 508 TFLOP/s; ragged_dot_mgpu 3380.6).
    mosaic-tests) pytest_gpu 200 tests/test_gemm_mosaic.py 2>&1 | tee "$out/mosaic_tests.log" | tail -8 ;;
    mosaic-inspect) mosaic="--config 128,256,64,4,4,mosaic,dequantize_first,group_m=8
                            --config 128,256,64,4,3,mosaic,dequantize_first,group_m=8
                            --config 128,128,64,4,4,mosaic,dequantize_first,group_m=8"
                    for problem in mixtral-8x7b qwen3-30b-a3b; do  # against the bf16 entries' Triton tile
                      timeout 180 python3 -W ignore -m benchmarks.inspect_gemm --problem $problem --fmt bf16 \
                        --tokens 4096 $mosaic --config 128,256,64,8,4,group_m=8 2>&1 | tail -4
                    done | tee "$out/mosaic_inspect.log"
                    timeout 180 python3 -W ignore -m benchmarks.inspect_gemm --problem mixtral-8x7b --fmt int4_g128 \
                      --tokens 4096 $mosaic --config 128,128,128,8,3,swap_ab,group_m=8,word_decode,fold_scales,pair_decode \
                      2>&1 | tail -4 | tee -a "$out/mosaic_inspect.log" ;;
    # GEMM v15: delay_release (a K step's product in flight while the next is issued, the last step waiting for
    # all) on the 16-bit path and the swap_ab form; its tests with the real compiler, then against v13 / v14.
    v15-tests) pytest_gpu 200 tests/test_gemm_mosaic.py 2>&1 | tee "$out/v15_tests.log" | tail -8 ;;
    mosaic-delay) for problem in mixtral-8x7b qwen3-30b-a3b; do  # bf16 T=4096 (v13: mixtral 3340.3 / 1660.3, qwen3 469.5 / 281.3)
                    for gemm in w13 w2; do
                      timeout 120 python3 -W ignore -m benchmarks.inspect_gemm --problem $problem --gemm $gemm --fmt bf16 \
                        --tokens 4096 --config 128,256,64,4,4,mosaic,group_m=8 \
                        --config 128,256,64,4,4,mosaic,group_m=8,delay_release=1 \
                        --config 128,256,64,4,3,mosaic,group_m=8,delay_release=1 \
                        --config 256,128,64,4,4,mosaic,group_m=8,split_rows,delay_release=1 2>&1 | tail -4
                    done
                  done | tee "$out/mosaic_delay.log" ;;
    mosaic-delay-int4) swap="--config 128,256,128,4,3,mosaic,group_m=8,swap_ab
                             --config 128,256,128,4,3,mosaic,group_m=8,swap_ab,delay_release=1"
                       for gemm in w2 w13; do  # qwen3 int4 T=4096 (v14 swap_ab: w2 363.5, w13 614.8; Triton w13 604.8)
                         timeout 150 python3 -W ignore -m benchmarks.inspect_gemm --problem qwen3-30b-a3b --gemm $gemm \
                           --fmt int4_g128 --tokens 4096 $swap 2>&1 | tail -2
                       done | tee "$out/mosaic_delay_int4.log"
                       timeout 270 python3 -W ignore -m benchmarks.inspect_gemm --problem mixtral-8x7b --fmt int4_g128 \
                         --tokens 4096 $swap 2>&1 | tail -2 | tee -a "$out/mosaic_delay_int4.log" ;;
    # ptxas's report (registers, spills, "wgmma ... serialized" warnings) and the SASS of each Mosaic form, from a
    # compile each (qwen3 w13 at T=512: no timing needed); summaries in mosaic_ptxas.log, the SASS of each form kept.
    mosaic-ptxas) for form in "bf16 128,256,64,4,3,mosaic,group_m=8" "bf16 128,256,64,4,3,mosaic,group_m=8,split_rows" \
                              "int4_g128 128,256,128,4,3,mosaic,group_m=8,swap_ab" \
                              "int4_g128 128,256,128,4,3,mosaic,group_m=8,swap_ab,word_decode"; do
                    set -- $form
                    dump=$(mktemp -d)
                    MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_SASS=1 MOSAIC_GPU_DUMP_TO=$dump timeout 150 python3 -W ignore \
                      -m benchmarks.inspect_gemm --problem qwen3-30b-a3b --tokens 512 --fmt $1 --config $2 > /dev/null 2>&1
                    name=$(echo "$1_$2" | tr ',=' '__')
                    { echo "== $1 $2"; grep -rhiE "spill|serializ|registers|warning" $dump | sort | uniq -c | head -20
                      # SASS lines read "/*0a40*/  HGMMA.64x128x16..." (the MLIR dumps carry the binary, not these).
                      sass=$(grep -rlaE "^[[:space:]]*/\*[0-9a-f]{4,}\*/[[:space:]]+HGMMA" $dump | head -1)
                      [ -n "$sass" ] && { cp "$sass" "$out/sass_$name.txt"
                        for op in HGMMA WARPGROUP.DEPBAR WARPGROUP.ARRIVE LDL STL SYNCS BAR.SYNC HFMA2 HMUL2 LOP3 STSM LDSM; do
                          printf "%s %s\n" $op "$(grep -c "$op" "$sass")"; done; }
                    } 2>&1 | tee -a "$out/mosaic_ptxas.log"
                    rm -rf "$dump"
                  done ;;
    # GEMM v16: decode-sized row tiles on the Mosaic swap_ab form (x's 16 rows the wgmma's N; persistent, TMA-fed,
    # the weights decoded in registers) against the Triton decode entries at T=16 (qwen3 w13 55.9 us = 58 % of copy,
    # w2 ~34, mixtral w13 168.9 = 67 %). inspect_gemm's GB/s over 4300 is the copy fraction.
    mosaic-decode) v16="--config 16,256,128,4,4,mosaic,swap_ab --config 16,256,128,4,6,mosaic,swap_ab,delay_release=1
                        --config 16,128,128,4,6,mosaic,swap_ab,delay_release=1 --config 16,256,128,4,8,mosaic,swap_ab,delay_release=1"
                   for gemm in w13 w2; do
                     timeout 120 python3 -W ignore -m benchmarks.inspect_gemm --problem qwen3-30b-a3b --gemm $gemm \
                       --fmt int4_g128 --tokens 16 $v16 --config 16,128,256,4,3,word_decode,fold_scales,pair_decode 2>&1 | tail -5
                   done | tee "$out/mosaic_decode.log"
                   timeout 240 python3 -W ignore -m benchmarks.inspect_gemm --problem mixtral-8x7b --fmt int4_g128 --tokens 16 \
                     $v16 --config 16,128,256,4,3,word_decode,fold_scales,pair_decode 2>&1 | tail -5 \
                     | tee -a "$out/mosaic_decode.log"
                   # T=1 (qwen3: 8 experts, 18-25 % of copy on the Triton entry 16x64x256): 128-column tiles for items.
                   timeout 100 python3 -W ignore -m benchmarks.inspect_gemm --problem qwen3-30b-a3b --fmt int4_g128 --tokens 1 \
                     --config 16,128,128,4,6,mosaic,swap_ab,delay_release=1 --config 16,128,128,4,8,mosaic,swap_ab,delay_release=1 \
                     --config 16,64,256,4,3,swap_ab,word_decode,fold_scales,pair_decode 2>&1 | tail -3 \
                     | tee -a "$out/mosaic_decode.log" ;;
    # mixtral w2 int4 (K=14336) on v14's swap_ab form against its dequantize-first entry (2131.0 / 2132.2 us).
    mosaic-swap-w2) timeout 400 python3 -W ignore -m benchmarks.inspect_gemm --problem mixtral-8x7b --gemm w2 \
                      --fmt int4_g128 --tokens 4096 --config 128,256,128,4,3,mosaic,group_m=8,swap_ab \
                      --config 128,256,128,4,3,mosaic,group_m=8,swap_ab,delay_release=1 \
                      --config 128,256,64,4,3,mosaic,dequantize_first,group_m=8 2>&1 | tail -3 \
                      | tee "$out/mosaic_swap_w2.log" ;;
    # GEMM v14: 4-bit weights decoded in the Mosaic kernel (planar int4), its tests and mixtral / qwen3 int4
    # prefill against v13's dequantize-first entry and the Triton tile.
    v14-tests) pytest_gpu 200 tests/test_gemm_mosaic.py 2>&1 | tee "$out/v14_tests.log" | tail -8 ;;
    mosaic-int4) v14="--config 128,256,128,4,3,mosaic,group_m=8 --config 128,256,128,4,3,mosaic,group_m=8,swap_ab
                      --config 256,128,128,4,2,mosaic,group_m=8,split_rows --config 128,256,128,4,2,mosaic,group_m=8,stage_slots=4"
                 for gemm in w13 w2; do  # qwen3 T=4096 (the ninth session: v14 628.4 us, Triton 607.2 on w13)
                   timeout 150 python3 -W ignore -m benchmarks.inspect_gemm --problem qwen3-30b-a3b --gemm $gemm \
                     --fmt int4_g128 --tokens 4096 $v14 \
                     --config 128,128,128,8,3,swap_ab,group_m=8,word_decode,fold_scales,pair_decode 2>&1 | tail -5
                 done | tee "$out/mosaic_int4.log"
                 timeout 270 python3 -W ignore -m benchmarks.inspect_gemm --problem mixtral-8x7b --fmt int4_g128 \
                   --tokens 4096 $v14 --config 128,256,64,4,3,mosaic,dequantize_first,group_m=8 2>&1 | tail -5 \
                   | tee -a "$out/mosaic_int4.log" ;;
    # bf16 prefill with the warpgroups on half the rows each (256x128 tiles) against v13's 128x256 (mixtral 3340.3,
    # qwen3 w13 469.5 us); gpt-oss (bias; N=5760 fits only the 256x128 tile: its 128x256 rows fall back to Triton).
    mosaic-split-bf16) for problem in mixtral-8x7b qwen3-30b-a3b gpt-oss-120b; do
                         timeout 200 python3 -W ignore -m benchmarks.inspect_gemm --problem $problem --fmt bf16 \
                           --tokens 4096 --config 256,128,64,4,4,mosaic,group_m=8,split_rows \
                           --config 256,128,64,4,3,mosaic,group_m=8,split_rows \
                           --config 128,256,64,4,3,mosaic,group_m=8 2>&1 | tail -3
                       done | tee "$out/mosaic_split_bf16.log" ;;
    # MXFP4 prefill through dequantize-first on the Mosaic kernel against the Triton 128x256x128 tile
    # (mixtral 5815.4 us, qwen3 764.1 in the ninth session's bench).
    mosaic-fp4) for problem in mixtral-8x7b qwen3-30b-a3b; do
                  timeout 270 python3 -W ignore -m benchmarks.inspect_gemm --problem $problem --fmt mxfp4 --tokens 4096 \
                    --config 128,256,64,4,3,mosaic,dequantize_first,group_m=8 \
                    --config 128,256,128,8,3,swap_ab,group_m=8,word_decode,fold_scales,pair_decode 2>&1 | tail -2
                done | tee "$out/mosaic_fp4.log" ;;
    # The Mosaic kernel's SASS and stall reasons: v17 int4 (swap_ab + word_decode) and bf16 at T=4096, and v16's
    # decode tile at T=16 (2x the Triton entry's time: where do its ~3200 cycles a K step go?). The kernel is named
    # by Mosaic (anonymous_mosaic_gpu_kernel): ncu's name filter finds it. (The tenth and eleventh sessions' runs
    # matched the launch by its 384 threads among the first launches, missed it and profiled an XLA fusion.)
    mosaic-profile) for case in "4096 int4_g128 128,256,128,4,3,mosaic,group_m=8,swap_ab,word_decode" \
                                "4096 bf16 128,256,64,4,3,mosaic,group_m=8" "16 int4_g128 16,256,128,4,4,mosaic,swap_ab,word_decode"; do
                      set -- $case
                      tag="$2_t$1"
                      timeout 200 ncu -k regex:mosaic_gpu -c 1 --section LaunchStats --section Occupancy \
                        --section WarpStateStats --section SchedulerStats --section SourceCounters -o "$out/mosaic_$tag" \
                        python3 -W ignore -m benchmarks.inspect_gemm --problem qwen3-30b-a3b --tokens $1 --fmt $2 --config $3 \
                        > "$out/mosaic_${tag}_run.txt" 2>&1
                      grep "==PROF== Profiling" "$out/mosaic_${tag}_run.txt" | head -2
                      ncu --import "$out/mosaic_$tag.ncu-rep" --page details > "$out/mosaic_${tag}_profile.txt" 2>&1
                      ncu --import "$out/mosaic_$tag.ncu-rep" --page source --print-source sass --csv \
                        > "$out/mosaic_${tag}_sass.csv" 2>&1
                      grep -E "Duration|Registers|Stall|Issued|Warp Cycles" "$out/mosaic_${tag}_profile.txt" | head -30
                    done ;;
    # Ninth session: the Mosaic kernel on the w2 products (K=768 on qwen3, K=14336 on mixtral) against the Triton tiles.
    mosaic-w2) mosaic="--config 128,256,64,4,4,mosaic,dequantize_first,group_m=8
                       --config 128,256,64,4,3,mosaic,dequantize_first,group_m=8"
               for problem in qwen3-30b-a3b mixtral-8x7b; do
                 timeout 150 python3 -W ignore -m benchmarks.inspect_gemm --problem $problem --gemm w2 --fmt bf16 \
                   --tokens 4096 $mosaic --config 128,256,64,8,4,group_m=8 2>&1 | tail -3
               done | tee "$out/mosaic_w2.log"
               timeout 150 python3 -W ignore -m benchmarks.inspect_gemm --problem mixtral-8x7b --gemm w2 --fmt int4_g128 \
                 --tokens 4096 $mosaic --config 128,128,128,8,3,swap_ab,group_m=8,word_decode,fold_scales,pair_decode \
                 2>&1 | tail -3 | tee -a "$out/mosaic_w2.log" ;;
    # Eighth session: column tiles per program (one pipelined loop over column and K tiles), qwen3 w2 at T=16 / 4096.
    column-tiles) for args in "--tokens 16 --fmt int4_g128" "--tokens 16 --fmt mxfp4"; do
                    timeout 150 python3 -W ignore -m benchmarks.inspect_gemm --gemm w2 $args \
                      --config 16,128,256,4,3,word_decode,fold_scales,pair_decode \
                      --config 16,128,256,4,3,word_decode,fold_scales,pair_decode,column_tiles=2 \
                      --config 16,128,256,4,3,word_decode,fold_scales,pair_decode,column_tiles=4 \
                      --config 16,256,256,8,3,word_decode,fold_scales,pair_decode 2>&1 | tail -4
                  done | tee "$out/column_tiles.log"
                  for fmt in int4_g128 bf16; do
                    timeout 200 python3 -W ignore -m benchmarks.inspect_gemm --gemm w2 --tokens 4096 --fmt $fmt \
                      --config 128,128,128,8,3,swap_ab,group_m=8,word_decode,fold_scales,pair_decode \
                      --config 128,128,128,8,3,swap_ab,group_m=8,word_decode,fold_scales,pair_decode,column_tiles=2 \
                      --config 128,256,64,8,4 --config 128,256,64,8,4,column_tiles=2 2>&1 | tail -4
                  done | tee -a "$out/column_tiles.log" ;;
    # MXFP4 prefill runs 1.3x (qwen3) to 1.7x (mixtral) int4's time on the same tile while the offline sm_90
    # loops differ by 9 % (281 / 259 instructions): the GPU build's SASS and stall reasons of both.
    fp4-prefill-profile) for fmt in mxfp4 int4_g128; do
                           timeout 200 ncu -k regex:gemm -c 1 --section LaunchStats --section Occupancy \
                             --section WarpStateStats --section SchedulerStats --section SourceCounters -o "$out/prefill_$fmt" \
                             python3 -W ignore -m benchmarks.inspect_gemm --fmt $fmt --tokens 4096 \
                             --config 128,128,128,8,3,swap_ab,group_m=8,word_decode,fold_scales,pair_decode \
                             > "$out/prefill_${fmt}_run.txt" 2>&1
                           ncu --import "$out/prefill_$fmt.ncu-rep" --page details > "$out/prefill_${fmt}_profile.txt" 2>&1
                           ncu --import "$out/prefill_$fmt.ncu-rep" --page source --print-source sass --csv \
                             > "$out/prefill_${fmt}_sass.csv" 2>&1
                           rm -f "$out/prefill_$fmt.ncu-rep"
                           grep -E "Stall|Warp Cycles|Registers|Achieved Occupancy|Issued|Local" \
                             "$out/prefill_${fmt}_profile.txt" | head -24
                         done ;;
    # process_input K=768 as one masked 1024-wide block (tiles "...p") against 512 + 256 (62 % / 38 %, target 70 %).
    one-block-768) timeout 300 python3 -W ignore -m benchmarks.bench_process_input --tokens 4096 --widths 768 \
                     --cases silu+fp8_group128 silu+mxfp8 hadamard128+fp8_token \
                     --tiles 0x0p 4x4p 8x4p 8x8p 8x4x1x4p 8x8x1x4p 16x8x1x4p \
                     --out "$out/one_block_768.json" 2>&1 | tee "$out/one_block_768.log" | tail -26 ;;
    # SILU + fp8 per group: K=768 at 62 % of copy bandwidth, K=2048 at 80 %, with about the same instructions
    # per element offline (42.3 / 38.5, sm_90 SASS): issue-bound, or latency? Stall reasons of both.
    silu-profile) for width in 768 2048; do
                    timeout 200 ncu -k regex:process_input -c 1 --section SpeedOfLight --section Occupancy \
                      --section LaunchStats --section WarpStateStats --section SchedulerStats \
                      python3 -W ignore -m benchmarks.bench_process_input --tokens 4096 --widths $width \
                      --cases silu+fp8_group128 --out "$out/silu_profile_$width.json" > "$out/silu_ncu_$width.txt" 2>&1
                    grep -E "Throughput|Issued|Stall|Warp Cycles|Occupancy|Registers|Eligible" "$out/silu_ncu_$width.txt" \
                      | head -30
                  done ;;
    # w2's decode entries with the column-tile candidates (T=1..16 and T=16..128).
    tune-w2-decode) timeout 540 python3 -W ignore -m humming_jax tune --problem qwen3-30b-a3b --gemm w2 \
                      --formats int4_g128 mxfp4 --layouts grouped --max-m 128 --per-shape --out "$table" 2>&1 \
                      | tee "$out/tune_w2_decode.log" | tail -8 ;;
    # After the seventh session: GEMM v10 (folded e2m1 without the decoder's multiply), the fp8 row scatter.
    v11-tests) pytest_gpu 420 tests/test_gemm_kernel.py tests/test_word_decode.py tests/test_lowering.py tests/test_formats.py \
                 tests/test_routing.py tests/test_nn.py tests/test_pipelines.py 2>&1 | tee "$out/v11_tests.log" | tail -8 ;;
    # v10/v11 MXFP4 against the seventh session's figures: decode 73.0 us (T=16), prefill tiles at T=4096.
    fp4-inspect) for order in "" "--nibble-halves"; do  # v11 (the decoder's bit order), then v10
                   timeout 150 python3 -W ignore -m benchmarks.inspect_gemm --fmt mxfp4 --tokens 16 $order \
                     --config 16,128,256,4,3,word_decode,fold_scales,pair_decode 2>&1 | tail -1
                 done | tee "$out/fp4_inspect.log"
                 timeout 300 python3 -W ignore -m benchmarks.inspect_gemm --fmt mxfp4 --tokens 4096 \
                   --config 64,128,128,4,3,swap_ab,group_m=8,word_decode,fold_scales,pair_decode \
                   --config 128,128,128,8,3,swap_ab,group_m=8,word_decode,fold_scales,pair_decode \
                   --config 128,256,128,8,3,swap_ab,group_m=8,word_decode,fold_scales,pair_decode 2>&1 \
                   | tee -a "$out/fp4_inspect.log" | tail -3 ;;
    # qwen3's own 4-bit entries where its experts hold 8 and 32 rows (T=128, T=512: the heuristic ran there).
    tune-mid-4bit) timeout 540 python3 -W ignore -m humming_jax tune --problem qwen3-30b-a3b --formats int4_g128 mxfp4 \
                     --layouts grouped --min-m 129 --max-m 4096 --per-shape --out "$table" 2>&1 \
                     | tee "$out/tune_mid_4bit.log" | tail -8 ;;
    tune-mid-4bit-w2) timeout 540 python3 -W ignore -m humming_jax tune --problem qwen3-30b-a3b --gemm w2 \
                        --formats int4_g128 mxfp4 --layouts grouped --min-m 129 --max-m 4096 --per-shape --out "$table" 2>&1 \
                        | tee "$out/tune_mid_4bit_w2.log" | tail -8 ;;
    # Hadamard K=768 (28 %): rows per program were never swept with the v4/v6 loop (the default is 4 rows).
    hadamard-768) timeout 300 python3 -W ignore -m benchmarks.bench_process_input --tokens 4096 --widths 768 \
                    --cases hadamard128+fp8_token silu+fp8_group128 --tiles 8x4 8x8 16x8 32x8 8x4x1x4 16x8x1x4 \
                    --out "$out/hadamard_768.json" 2>&1 | tee "$out/hadamard_768.log" | tail -14 ;;
    # T=1-2 (M <= 16) with the split-K decode candidates (T=1: 21 % of copy bandwidth, latency-bound).
    tune-decode-small) timeout 400 python3 -W ignore -m humming_jax tune --problem qwen3-30b-a3b --formats int4_g128 mxfp4 \
                         --max-m 16 --out "$table" 2>&1 | tee "$out/tune_decode_small.log" | tail -8 ;;
    # The indexed 4-bit prefill has no entry of its own (heuristic: 849 / 890 us at T=4096, 0.55x torch).
    tune-prefill-indexed) timeout 540 python3 -W ignore -m humming_jax tune --problem qwen3-30b-a3b --formats int4_g128 mxfp4 \
                            --layouts indexed --min-m 8193 --out "$table" 2>&1 | tee "$out/tune_prefill_indexed.log" | tail -8 ;;
    # After the fifth session: the pair decode and aligned word loads, the parallel bin prefix, process_input row blocks.
    # process_input v6: Hadamard blocks loaded as the product's operand (default) against the reshaped rows ("r").
    hadamard-ab) timeout 300 python3 -W ignore -m benchmarks.bench_process_input --tokens 4096 --widths 768 2048 \
                   --cases hadamard128+fp8_token --tiles 0x0r 0x0x1x8r 0x0x1x4 0x0x1x16 \
                   --out "$out/hadamard_ab.json" 2>&1 | tee "$out/hadamard_ab.log" | tail -14 ;;
    # v9: planar 4-bit weights (no split copy of x) against K order, decode and prefill, the tuned tilings.
    planar-inspect) for order in "" "--k-order"; do
                      timeout 150 python3 -W ignore -m benchmarks.inspect_gemm --fmt int4_g128 --tokens 16 $order \
                        --config 16,128,256,4,3,word_decode,fold_scales,pair_decode 2>&1 | tail -1
                      timeout 150 python3 -W ignore -m benchmarks.inspect_gemm --fmt int4_g128 --tokens 4096 $order \
                        --config 128,128,128,8,3,swap_ab,group_m=8,word_decode,fold_scales,pair_decode 2>&1 | tail -1
                    done | tee "$out/planar_inspect.log" ;;
    # After the sixth session: every kernel module with the real lowering (halves for pairs, chosen row blocks).
    v10-tests) pytest_gpu 420 tests/test_gemm_kernel.py tests/test_word_decode.py tests/test_lowering.py \
                 tests/test_process_input.py tests/test_routing.py tests/test_nn.py tests/test_pipelines.py 2>&1 \
                 | tee "$out/v10_tests.log" | tail -8 ;;
    # qwen3 w2 (K=768) 4-bit entries of its own shape: decode (0,128] and prefill (M > 8192).
    tune-w2-4bit) for range in "--max-m 128" "--min-m 8193"; do
                    timeout 270 python3 -W ignore -m humming_jax tune --problem qwen3-30b-a3b --gemm w2 \
                      --formats int4_g128 mxfp4 --layouts grouped $range --per-shape --out "$table" 2>&1 \
                      | tee -a "$out/tune_w2_4bit.log" | tail -6
                  done ;;
    # mixtral w13 4-bit prefill per shape (M in (1024, 8192]: T=4096, 1024 rows per expert).
    tune-large-4bit) timeout 540 python3 -W ignore -m humming_jax tune --problem mixtral-8x7b --formats int4_g128 \
                       --layouts grouped --min-m 1025 --max-m 8192 --per-shape --out "$table" 2>&1 \
                       | tee "$out/tune_large_4bit.log" | tail -12 ;;
    # After the sixth session's first run: pairs read words as 16-bit halves (right in any layout Triton picks).
    v9-tests) pytest_gpu 300 tests/test_gemm_kernel.py tests/test_word_decode.py tests/test_lowering.py -k "pair or word" \
                2>&1 | tee "$out/v9_tests.log" | tail -5 ;;
    pair-inspect-2) timeout 300 python3 -W ignore -m benchmarks.inspect_gemm --fmt int4_g128 --tokens 16 \
                      --config 16,32,256,2,3,word_decode,fold_scales,pair_decode \
                      --config 16,64,256,4,3,word_decode,fold_scales --config 16,64,256,4,3,word_decode,fold_scales,pair_decode \
                      --config 16,64,256,4,4,word_decode,fold_scales,pair_decode 2>&1 | tee "$out/pair_inspect.log" | tail -5
                    timeout 200 python3 -W ignore -m benchmarks.inspect_gemm --fmt mxfp4 --tokens 16 \
                      --config 16,32,256,2,3,word_decode,fold_scales,pair_decode \
                      --config 16,64,256,4,3,word_decode,fold_scales,pair_decode 2>&1 | tee -a "$out/pair_inspect.log" | tail -3 ;;
    tune-prefill-fp4) timeout 300 python3 -W ignore -m humming_jax tune --problem qwen3-30b-a3b --formats mxfp4 \
                        --layouts grouped --min-m 8193 --out "$table" 2>&1 | tee "$out/tune_prefill_fp4.log" | tail -8 ;;
    tune-decode-indexed) timeout 300 python3 -W ignore -m humming_jax tune --problem qwen3-30b-a3b --formats int4_g128 mxfp4 \
                           --layouts indexed --max-m 128 --out "$table" 2>&1 | tee "$out/tune_decode_indexed.log" | tail -8 ;;
    v8-tests) pytest_gpu 300 tests/test_gemm_kernel.py tests/test_word_decode.py -k "pair or word or fold" \
                2>&1 | tee "$out/v8_tests.log" | tail -5
              pytest_gpu 240 tests/test_routing.py tests/test_process_input.py -k "grouping or align or scatter or row_blocks" \
                2>&1 | tee -a "$out/v8_tests.log" | tail -5 ;;
    pair-inspect) timeout 300 python3 -W ignore -m benchmarks.inspect_gemm --fmt int4_g128 --tokens 16 \
                    --config 16,32,256,2,3,word_decode,fold_scales --config 16,32,256,2,3,word_decode,fold_scales,pair_decode \
                    --config 16,64,256,4,3,word_decode,fold_scales,pair_decode 2>&1 | tee "$out/pair_inspect.log" | tail -5
                  timeout 200 python3 -W ignore -m benchmarks.inspect_gemm --fmt mxfp4 --tokens 16 \
                    --config 16,32,256,2,3,word_decode,fold_scales --config 16,32,256,2,3,word_decode,fold_scales,pair_decode \
                    2>&1 | tee -a "$out/pair_inspect.log" | tail -3 ;;
    tune-prefill-int4) timeout 540 python3 -W ignore -m humming_jax tune --problem qwen3-30b-a3b --formats int4_g128 \
                         --layouts grouped --min-m 8193 --out "$table" 2>&1 | tee "$out/tune_prefill_int4.log" | tail -30 ;;
    # process_input v4: row blocks per program (next block's loads issued first, the Hadamard matrix read once).
    process-loop) timeout 400 python3 -W ignore -m benchmarks.bench_process_input --tokens 4096 --widths 768 2048 2880 \
                    --cases silu+fp8_group128 silu+mxfp8 hadamard128+fp8_token \
                    --tiles 0x0x1x2 0x0x1x4 0x0x1x8 0x0x1x16 --out "$out/process_loop.json" 2>&1 | tee "$out/process_loop.log" | tail -40 ;;
    # After the fourth session: row_tiles of the routing ops, folded decode defaults, the bench's chunked weights.
    v7-tests) pytest_gpu 300 tests/test_routing.py tests/test_process_input.py tests/test_gemm_kernel.py \
                -k "tiles or every_layout or under_16 or folded or random_weight or not_a_multiple or split_k or hadamard" 2>&1 | tee "$out/v7_tests.log" | tail -25 ;;
    # Row tilings of permute / unpermute / fused_mul_sum at the 70 % target's size.
    routing-tiles) timeout 300 python3 -W ignore -m benchmarks.bench_routing --tokens 4096 --experts 128,8 --hidden 7168 \
                     --row-tiles 8x512x4 4x1024x4 8x1024x8 8x512x8 16x256x4 4x512x4 2x2048x8 4x256x4 2x512x2 \
                     --out "$out/routing_tiles.json" 2>&1 | grep -v '^done' | tee "$out/routing_tiles.log" ;;
    # Where the Hadamard case's time goes: rotation alone, + per-group scale, + per-token scale.
    # (and the two-pass kernel: 128-column blocks of 64 / 32 rows, the per-token max in a first pass).
    hadamard-split) timeout 240 python3 -W ignore -m benchmarks.bench_process_input --tokens 512 4096 --widths 768 2048 \
                      --cases hadamard128+none hadamard128+fp8_group128 hadamard128+fp8_token silu+fp8_group128 \
                      --tiles 0x0x2 32x4x2 --out "$out/hadamard_split.json" 2>&1 | tee "$out/hadamard_split.log" | tail -30 ;;
    # Rows per program and warps of process_input where it misses 70 % (K=768: 61 %, K=2880: 64 %).
    process-tiles) timeout 300 python3 -W ignore -m benchmarks.bench_process_input --tokens 4096 --widths 768 2048 2880 \
                     --cases silu+fp8_group128 silu+mxfp8 --tiles 2x4 4x4 4x8 8x8 16x8 8x4 \
                     --out "$out/process_tiles.json" 2>&1 | tee "$out/process_tiles.log" | tail -45 ;;
    # Stall reasons and the SASS of the folded int4 decode kernel: are there shared-memory
    # round trips (STS/LDS + BAR.SYNC) per decoded piece, and how many instructions per weight?
    gemm-profile) timeout 300 ncu -k regex:gemm -c 1 --section LaunchStats --section Occupancy \
                    --section WarpStateStats --section SchedulerStats --section SourceCounters -o "$out/gemm_decode" \
                    python3 -W ignore -m benchmarks.inspect_gemm --fmt int4_g128 --tokens 16 \
                    --config 16,64,256,4,3,word_decode,fold_scales > "$out/gemm_ncu_run.txt" 2>&1
                  ncu --import "$out/gemm_decode.ncu-rep" --page details > "$out/gemm_profile.txt" 2>&1
                  ncu --import "$out/gemm_decode.ncu-rep" --page source --print-source sass --csv \
                    > "$out/gemm_sass.csv" 2>&1
                  grep -E "Stall|Warp Cycles|Registers|Achieved Occupancy|Issued" "$out/gemm_profile.txt" | head -40
                  grep -c -E "BAR|LDS|STS" "$out/gemm_sass.csv" ;;
    # The same for the 4-bit prefill tile (qwen3 w13 int4 T=4096: 1050 us = 0.43x torch): decode or MMA bound?
    gemm-profile-prefill) timeout 300 ncu -k regex:gemm -c 1 --section LaunchStats --section Occupancy \
                            --section WarpStateStats --section SchedulerStats --section SourceCounters -o "$out/gemm_prefill" \
                            python3 -W ignore -m benchmarks.inspect_gemm --fmt int4_g128 --tokens 4096 \
                            --config 64,128,128,4,3,swap_ab,word_decode,group_m=8,pair_decode > "$out/gemm_prefill_run.txt" 2>&1
                          ncu --import "$out/gemm_prefill.ncu-rep" --page details > "$out/gemm_prefill_profile.txt" 2>&1
                          ncu --import "$out/gemm_prefill.ncu-rep" --page source --print-source sass --csv \
                            > "$out/gemm_prefill_sass.csv" 2>&1
                          grep -E "Stall|Warp Cycles|Registers|Achieved Occupancy|Issued|Local" "$out/gemm_prefill_profile.txt" | head -40 ;;
    hadamard-profile) for width in 768 2048; do  # never run before the twelfth session's plan
                        timeout 200 ncu -k regex:process_input -c 1 --section SpeedOfLight --section Occupancy \
                          --section LaunchStats --section WarpStateStats --section SchedulerStats \
                          --section MemoryWorkloadAnalysis \
                          python3 -W ignore -m benchmarks.bench_process_input --tokens 4096 --widths $width \
                          --cases hadamard128+fp8_token --out "$out/hadamard_profile_$width.json" \
                          > "$out/hadamard_ncu_$width.txt" 2>&1
                        grep -E "Throughput|Issued|Stall|Warp Cycles|Occupancy|Registers|Eligible|Hit Rate|Shared" \
                          "$out/hadamard_ncu_$width.txt" | head -40
                      done ;;
    # What changed after v5: routing v2 tiles, process_input column blocks, folded GEMM scales.
    v6-tests) pytest_gpu 360 tests/test_routing.py tests/test_process_input.py tests/test_gemm_kernel.py \
                -k "not test_gemm_kernel or folded or word" 2>&1 | tee "$out/v6_tests.log" | tail -25 ;;
    # Quantized prefill candidates (fold_scales, word decode) on qwen3, grouped layout.
    tune-prefill) timeout 400 python3 -W ignore -m humming_jax tune --problem qwen3-30b-a3b --formats int4_g128 mxfp4 \
                    --layouts grouped --min-m 8193 --out "$table" 2>&1 | tee "$out/tune_prefill.log" | tail -30 ;;
    # The kernels added after v4 (word decode PTX, banded order, ragged K) and the pipelines.
    v5-tests) pytest_gpu 300 tests/test_gemm_kernel.py -k "word or banded or not_a_multiple" tests/test_pipelines.py \
                2>&1 | tee "$out/v5_tests.log" | tail -25 ;;
    # Quantized decode candidates (word decode) on qwen3, grouped layout.
    tune-decode) timeout 540 python3 -W ignore -m humming_jax tune --problem qwen3-30b-a3b --formats int4_g128 mxfp4 \
                   --layouts grouped --max-m 128 --out "$table" 2>&1 | tee "$out/tune_decode.log" | tail -30 ;;
    gemm-tests) pytest_gpu 300 tests/test_gemm_kernel.py tests/test_pipelines.py 2>&1 | tee "$out/gemm_tests.log" | tail -15 ;;
    # qwen3 + mixtral at T=16 and 4096 took more than 420 s (fifth session): one problem per step.
    gemm-bench-prefill) timeout 300 python3 -W ignore -m humming_jax bench --problems qwen3-30b-a3b \
                          --tokens 4096 --out "$out/gemm_prefill.json" 2>&1 | tee "$out/gemm_bench_prefill.log" ;;
    gemm-bench) timeout 420 python3 -W ignore -m humming_jax bench --problems qwen3-30b-a3b \
                  --tokens 16 4096 --out "$out/gemm.json" 2>&1 | tee "$out/gemm_bench.log" ;;
    gemm-bench-mixtral) timeout 540 python3 -W ignore -m humming_jax bench --problems mixtral-8x7b \
                          --tokens 16 4096 --out "$out/gemm_mixtral.json" 2>&1 | tee "$out/gemm_bench_mixtral.log" ;;
    # AWQ-style uint4 with zero points at decode (folded scales and zero points).
    gemm-bench-awq) timeout 200 python3 -W ignore -m humming_jax bench --problems qwen3-30b-a3b mixtral-8x7b --tokens 16 \
                      --formats uint4_zp_g128 --no-compare --out "$out/gemm_awq.json" 2>&1 | tee "$out/gemm_bench_awq.log" ;;
    # One problem per step: two problems at three token counts do not fit 540 s (a qwen3 T is ~100-140 s).
    gemm-bench-small) timeout 540 python3 -W ignore -m humming_jax bench --problems qwen3-30b-a3b \
                        --tokens 1 128 512 --out "$out/gemm_small.json" 2>&1 | tee "$out/gemm_bench_small.log" ;;
    gemm-bench-small-mixtral) timeout 540 python3 -W ignore -m humming_jax bench --problems mixtral-8x7b \
                        --tokens 1 128 512 --out "$out/gemm_small_mixtral.json" 2>&1 | tee "$out/gemm_bench_small_mixtral.log" ;;
    gemm-bench-large) timeout 540 python3 -W ignore -m humming_jax bench --problems deepseek-v3 \
                        --tokens 16 4096 --out "$out/gemm_large.json" 2>&1 | tee "$out/gemm_bench_large.log" ;;
    gemm-bench-gptoss) timeout 540 python3 -W ignore -m humming_jax bench --problems gpt-oss-120b \
                        --tokens 16 4096 --out "$out/gemm_gptoss.json" 2>&1 | tee "$out/gemm_bench_gptoss.log" ;;
    tune) timeout 540 python3 -W ignore -m humming_jax tune --problem qwen3-30b-a3b --formats bf16 int4_g128 \
            --out "$out/tuning_h200.json" 2>&1 | tee "$out/tune.log" | tail -20 ;;
    # qwen3 w2 (K=768) prefill, bf16 at 0.86x torch: its own entries, keyed by its shape.
    tune-w2) timeout 400 python3 -W ignore -m humming_jax tune --problem qwen3-30b-a3b --gemm w2 --formats bf16 \
               --layouts grouped --min-m 8193 --per-shape --out "$table" 2>&1 | tee "$out/tune_w2.log" | tail -20 ;;
    # Large experts (the banded program order, group_m): mixtral prefill.
    tune-large) timeout 540 python3 -W ignore -m humming_jax tune --problem mixtral-8x7b --formats bf16 int4_g128 \
                  --layouts grouped --min-m 1025 --max-m 8192 --per-shape --out "$table" 2>&1 \
                  | tee "$out/tune_large.log" | tail -20 ;;
    # NVFP4 input quantization: kernel and reference each against float64 (which side is off on the GPU).
    process-nvfp4) pytest_gpu 120 tests/test_process_input.py -k "float64 or nvfp4" 2>&1 | tee "$out/nvfp4.log" | tail -20 ;;
    routing-tests) pytest_gpu 240 tests/test_routing.py 2>&1 | tee "$out/routing_tests.log" | tail -5 ;;
    process-tests) pytest_gpu 120 tests/test_process_input.py 2>&1 | tee "$out/process_tests.log" | tail -20 ;;
    routing-bench) timeout 300 python3 -W ignore -m benchmarks.bench_routing --tokens 16 512 4096 --experts 8,2 128,8 \
                     --out "$out/routing.json" 2>&1 | grep -v '^done' | tee "$out/routing_bench.log" ;;
    routing-bench-large) timeout 300 python3 -W ignore -m benchmarks.bench_routing --tokens 4096 16384 --experts 256,8 \
                           --hidden 7168 --out "$out/routing_large.json" 2>&1 | grep -v '^done' | tee "$out/routing_large.log" ;;
    process-bench) timeout 150 python3 -W ignore -m benchmarks.bench_process_input --out "$out/process_input.json" \
                     2>&1 | tee "$out/process_bench.log" | tail -30 ;;
    *) echo "unknown step $step" ;;
  esac
done
