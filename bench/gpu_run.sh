#!/usr/bin/env bash
# One call of a borrowed GPU machine (docs/gpu.md), in stages, each under its own time limit, so a
# stage that runs long still leaves the others' results: what comes back lies in $OUT (at most
# eight files; the rest in $OUT/extra.tgz).
#   bash bench/gpu_run.sh [STAGE ...]   stages: tests live stack (default: these three), flashinfer, wait,
#                                       fiwarm, cell
#     fiwarm in the background: JIT-build flashinfer's kernels (graph decode, and the paged prefill of the
#            steps run op by op) of the 8B shape and the tests' tiny model (bench/fi_warm.py), so that the
#            stages after it find them built
#     tests  the graph, engine, partition and IPC GPU tests (on past a failure, up to three: one
#            device call is too dear to learn only the first); TANDEM_TESTS_K picks them (pytest -k)
#     flashinfer  in the background: flashinfer's paged attention (JIT-built with the machine's nvcc)
#            against the torch backend; 'wait' waits for it (run it beside stages that measure nothing)
#     live   bench/cuda_live.py: chunked and dynamic on the live stack (TANDEM_LIVE_RATES,
#            TANDEM_LIVE_REQUESTS, TANDEM_LIVE_REPEATS, TANDEM_LIVE_VARIANTS: LABEL=POLICY:ENV=VALUE
#            contenders), decode's step log every 5 s; TANDEM_LIVE_PROFILE=START:COUNT adds a torch profile
#            of those decode steps (its start stalls decode for seconds: the goodput of that run is not one)
#     stack  the whole stack on the GPU against the CPU path's greedy tokens
#     cell   bench/cuda_cell.py without its handoff and graphs parts (TANDEM_CELL_SKIP): partitions,
#            repartition, graph decode attention (torch vs flashinfer) and this GPU's profile, which the
#            live stage after it predicts from
# TANDEM_LIVE_POLICIES (default "chunked dynamic") picks the live stage's policies; TANDEM_LIVE_TAG
# is appended to its files' names (cuda-live<TAG>.json), for a second live stage in one call. With
# TANDEM_RUN_BUDGET_S, the live stage ends 20 s before that many seconds from the start.
# Needs the carried .whl/ and .gpucarry/ (bench/gpu_carry.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:?set OUT}
work=/tmp/gpu-run && mkdir -p "$work"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 TANDEM_GPU_TOKENIZER_DIR=$PWD/.gpucarry/tok
# flashinfer JIT-builds its kernels with the machine's nvcc, for Hopper only
CUDA_HOME=$(dirname "$(dirname "$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)")")
export CUDA_HOME FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0a} MAX_JOBS=${MAX_JOBS:-12}
stages=("${@:-tests live stack}")
fiwarm_pids=()  # the background kernel builds of fiwarm, which stack waits for
# shellcheck disable=SC2068
for stage in ${stages[@]}; do
    echo "== $stage $(date +%T)"
    case $stage in
    tests)
        timeout 150 python3 -m pytest -p no:cacheprovider tests/gpu/test_cuda_engine.py tests/gpu/test_cuda_partition.py \
            tests/gpu/test_cuda_ipc.py tests/unit/test_cuda_without_gpu.py -q -o addopts="" --maxfail=3 \
            ${TANDEM_TESTS_K:+-k "$TANDEM_TESTS_K"} > "$OUT/gpu-tests.log" 2>&1
        tail -3 "$OUT/gpu-tests.log" ;;
    flashinfer)
        ( timeout "${TANDEM_FI_TIMEOUT_S:-240}" python3 -m pytest -p no:cacheprovider tests/gpu/test_flashinfer.py -q \
            -o addopts="" -rs > "$OUT/gpu-flashinfer.log" 2>&1; echo "flashinfer rc=$?" >> "$OUT/gpu-flashinfer.log" ) &
        echo "flashinfer: started in the background" ;;
    fiwarm)
        # the 8B shape, the stack test's flashinfer model and the GPU tests' fp16 one, side by side
        for shape in bfloat16:32:8:128 bfloat16:4:2:64 float16:4:2:64; do
            ( timeout 200 python3 -m bench.fi_warm "$shape" >> "$work/fi-warm.log" 2>&1 ) &
            fiwarm_pids+=($!)
        done
        echo "fiwarm: started in the background" ;;
    cell)
        timeout "${TANDEM_CELL_TIMEOUT_S:-240}" python3 bench/cuda_cell.py --out "$OUT/cuda-cell.json" \
            --profile-out "$work/profile-gpu.json" --skip "${TANDEM_CELL_SKIP:-handoff,graphs}" > "$work/cuda-cell.log" 2>&1
        echo "cell rc=$?"; grep -a "graph attention\|held-out\|failed\|Error" "$work/cuda-cell.log" | tail -30
        cp "$work/profile-gpu.json" "$OUT/" 2>/dev/null ;;
    wait)
        wait; tail -4 "$OUT/gpu-flashinfer.log" 2>/dev/null; cat "$work/fi-warm.log" 2>/dev/null ;;
    live)
        variants=()  # TANDEM_LIVE_VARIANTS="chunked-eager=chunked:TANDEM_CUDA_GRAPHS=off ..."
        for v in ${TANDEM_LIVE_VARIANTS:-}; do variants+=(--variant "$v"); done
        profile=()  # a torch profile stalls decode 3-6 s when it starts (CUPTI): never inside a measured run
        [ -n "${TANDEM_LIVE_PROFILE:-}" ] && profile=(TANDEM_TORCH_PROFILE_DIR=$work/prof \
            TANDEM_TORCH_PROFILE_STEPS=$TANDEM_LIVE_PROFILE)
        limit=${TANDEM_LIVE_TIMEOUT_S:-330}
        live=cuda-live${TANDEM_LIVE_TAG:-}  # a second live stage of one call names its files apart
        [ -n "${TANDEM_RUN_BUDGET_S:-}" ] && limit=$(( TANDEM_RUN_BUDGET_S - SECONDS - 20 < limit ?
                                                        TANDEM_RUN_BUDGET_S - SECONDS - 20 : limit ))
        gpu_profile=()  # this GPU's own profile, where the cell stage measured one
        [ -s "$work/profile-gpu.json" ] && gpu_profile=(--profile "$work/profile-gpu.json")
        echo "live: ${limit} s at most"
        # shellcheck disable=SC2086
        env TANDEM_STEP_STATS_S=5 "${profile[@]}" \
            timeout "$limit" python3 bench/cuda_live.py --tokenizer-dir .gpucarry/tok "${gpu_profile[@]}" \
            --policies ${TANDEM_LIVE_POLICIES:-chunked dynamic} \
            --rates ${TANDEM_LIVE_RATES:-8 12} --num-requests "${TANDEM_LIVE_REQUESTS:-80}" \
            --repeats "${TANDEM_LIVE_REPEATS:-1}" "${variants[@]}" \
            --out "$work/$live.json" > "$work/$live.log" 2>&1
        echo "live rc=$?"; tail -20 "$work/$live.log"
        cp "$work/$live.json" "$OUT/" 2>/dev/null
        for f in "$work/$live"-*-up.log; do  # one file however many stacks ran
            echo "=== $(basename "$f")"; grep -av '"POST \|"GET ' "$f"
        done > "$OUT/$live-up-logs.txt"
        grep -ah "steps:\|captured\|CUDA-graph\|attend\|Traceback\|Error" "$work/$live"-*-up.log | cut -c1-300 | tail -60 ;;
    stack)
        # its flashinfer case needs the kernels fiwarm builds: beside those builds it ran past 150 s (2026-12-04)
        [ ${#fiwarm_pids[@]} -gt 0 ] && { wait "${fiwarm_pids[@]}"; fiwarm_pids=(); }
        timeout 150 python3 -m pytest -p no:cacheprovider tests/gpu/test_cuda_stack.py -q -o addopts="" -x \
            > "$OUT/gpu-stack.log" 2>&1
        tail -3 "$OUT/gpu-stack.log" ;;
    *) echo "unknown stage $stage"; exit 2 ;;
    esac
    tar czf "$OUT/extra.tgz" -C "$work" . 2>/dev/null  # after every stage: a time limit may end the next
done
ls -la "$OUT"
