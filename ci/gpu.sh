#!/usr/bin/env bash
# The checks and figures of a session with a lent GPU (docs/gpu.md). On the GPU machine, after
# ../shared/gpu's install.sh and `. /tmp/gpu-env.sh`:
#
#     bash ci/gpu.sh "$OUT"
#
# Each step is bounded in time, logs to OUT/<step>.log and adds a line to OUT/summary.txt; a step that
# would start past DEADLINE seconds is skipped, so a second call (on the same warm machine) goes on where
# the first stopped: bundles and exports under WORK are reused. STEPS (names or globs, default every step)
# selects what runs: a lent session's 15 minutes hold about one precision's figures, so a later session
# picks what the earlier ones did not reach. The model and every precision's export run in the background
# (CPU work) while the GPU's checks run (golden to gates); then the measurements, each kind for every
# precision before the next kind. The steps, most wanted first:
#   gpu          nvidia-smi's view of the card
#   model        the full-size random model the exports read
#   export-P     the full-size random bundle exported in P (decode=fp16: the decode steps on an fp16
#                llm_decode, its caches in buffers on the GPU, the rest fp32; gpu-fp16: every graph in fp16,
#                the decode steps on llm_decode; fp32), the graphs PROVIDER opens (--providers)
#   golden       cosyvoice-golden check on the demo bundle: tokens, mel and audio against torch (fp32)
#   tests        the tests that use CUDA where it is present
#   tiny-model   the tiny model the gates export
#   gates-P      the demo model exported in P (decode=fp16, tf32, gpu-fp16) and judged on the GPU by golden's
#                precision bounds
#   bench-P      cosyvoice-bench on it: first chunk p50/p95, stages against the GPU's bounds, concurrency
#                1 and 4 (beside the batched decode, with an llm_decode; its decode steps replayed from CUDA
#                graphs where they can be, as the runtime's are by default)
#   nographs-P   with an llm_decode, on cuda: bench-P again with the decode steps launched node by node
#                (--no-cuda-graphs), where bench-P replays them from CUDA graphs (the runtime's default)
#   stacking-P   the DiT's calls of 1, 4 and 16 streams one after another against one stacked call
#   vocstacking-P  the same for the vocoder's windows (one hift_decoder call)
#   streamsN-P   with an llm_decode: STREAMS (16) concurrent streams of 125 tokens, unbatched, batched (the
#                many-streams target) and batched on --flow-window all, a bench of their own so that a slow
#                level costs only its figures; on cuda with the decode steps replayed from CUDA graphs, so
#                the unbatched streams decode one at a time
#   stacked-streamsN-P  streamsN-P again with the streams' DiT and vocoder calls stacked (--stack-dit
#                --stack-vocoder)
#   profile-P    its hot graph calls under onnxruntime's profiler: time per provider, host/device copies
#   variants-P   with an llm_decode: its step for 1, 4 and 16 decodings as the runtime makes it, bound once,
#                replayed from a CUDA graph, with XQA on and off: times, and log-probs against the runtime's
#   rowsN-P      with an llm_decode: its decode step for N (4, 16) decodings at once, profiled
#   slots1-streamsN-P  streamsN-P again with one chunk at a time (--chunk-slots 1, the CPU's way) against
#                the GPU's default, every stream's chunks at once
# (P in a step's or a file's name with its = and , as -)
#
# PROVIDER=cpu SIZE=tiny runs the same steps on a CPU: that is how the script is tested, with SCRIPT_CHECK=1:
# the tests step collects its tests without running them (the suite runs them on the CPU) and the stacking
# steps time 2 rounds, not 10.
set -uo pipefail
OUT=${1:?usage: ci/gpu.sh OUT}
PROVIDER=${PROVIDER:-cuda}
SIZE=${SIZE:-full}
GATES=${GATES:-"decode=fp16 tf32 gpu-fp16"}
PRECISIONS=${PRECISIONS:-"decode=fp16 gpu-fp16 fp32"}
STREAMS=${STREAMS:-16}
DEADLINE=${DEADLINE:-540}
WORK=${WORK:-/tmp/gpu-work}
SCRIPT_CHECK=${SCRIPT_CHECK:-0}
ROUNDS=10 TESTS_RUN=()
((SCRIPT_CHECK)) && ROUNDS=2 TESTS_RUN=(--collect-only)
read -ra SELECTED <<<"${STEPS:-*}"  # read -a: the globs stay patterns, not file names
PY=${PYTHON:-python3}
cd "$(dirname "$0")/.."
mkdir -p "$OUT" "$WORK"
start=$SECONDS

# selected NAME: whether STEPS names NAME or a glob matching it
selected() {
    local pattern
    for pattern in "${SELECTED[@]}"; do
        [[ $1 == $pattern ]] && return 0  # unquoted: matched as a glob
    done
    return 1
}

# step NAME LIMIT COMMAND...: run COMMAND with at most LIMIT seconds (less if the deadline is nearer; not
# at all with under a quarter of LIMIT left, where a step cut short would bring back nothing)
step() {
    local name=$1 limit=$2 left rc began
    shift 2
    if ! selected "$name"; then
        echo "$name: not selected (STEPS)" >>"$OUT/summary.txt"
        return 0
    fi
    left=$((DEADLINE - (SECONDS - start)))
    if ((left < 30)); then
        echo "$name: skipped, ${DEADLINE} s deadline reached" | tee -a "$OUT/summary.txt"
        return 0
    fi
    if ((4 * left < limit)); then
        echo "$name: skipped, ${left} s left before the deadline, under a quarter of its ${limit} s" \
            | tee -a "$OUT/summary.txt"
        return 0
    fi
    ((limit > left)) && limit=$left
    began=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    echo "$name: exit $rc after $((SECONDS - began)) s$( ((rc == 124)) && echo " (its ${limit} s ran out)")" \
        | tee -a "$OUT/summary.txt"
    return 0
}

# export PRECISION MODEL OUT [PROVIDER]: a runtime bundle, reused where an earlier call finished it, its
# graphs that another precision's bundle of MODEL holds alike linked from there (--reuse-from); with
# PROVIDER, only the graphs its pipeline opens (--providers: on cuda an fp16 llm_decode's bundle has no llm,
# 30 % of the export's time on a 2-core AMD EPYC Zen 4 with AVX-512)
export_bundle() {
    local precision=$1 model=$2 out=$3 other args=()
    [ -f "$out/manifest.json" ] && { echo "reused $out"; return 0; }
    for other in "$model"-*/; do
        [ -f "$other/manifest.json" ] && args+=(--reuse-from "$other")
    done
    [ -n "${4:-}" ] && args+=(--providers "$4")
    "$PY" -m cosyvoice_export all --model-dir "$model" --out "$out" --precision "$precision" "${args[@]}"
}

step gpu 30 bash -c 'nvidia-smi || echo "no nvidia-smi"'
(
    [ -f "$WORK/$SIZE/llm.pt" ] || step model 240 "$PY" -m cosyvoice_export tiny-bundle "$WORK/$SIZE" --size "$SIZE"
    for p in $PRECISIONS; do  # one at a time: each takes every core (two at once ran past 300 s, one 83 s)
        tag=${p//[=,]/-}
        step "export-$tag" 300 bash -c "$(declare -f export_bundle); PY=$PY; export_bundle $p $WORK/$SIZE \
            $WORK/$SIZE-$tag $PROVIDER"
    done
) &
exports=$!
step golden 120 "$PY" -m cosyvoice_golden check --provider "$PROVIDER"
# --failures-at-once: a CUDA error can end the process before pytest's summary
step tests 300 "$PY" -m pytest -q -p no:cacheprovider -rs --failures-at-once "${TESTS_RUN[@]}" tests/test_bench_gpu.py \
    tests/test_precision.py tests/test_capture_gate.py \
    tests/test_runtime_core.py tests/test_llm_decode.py::test_the_fp16_body_decodes_in_place_close_to_llm \
    tests/test_decode_batch.py::test_batched_rows_follow_their_runs_alone tests/test_decode_variants.py \
    tests/test_dit_stacking.py tests/test_decode_graphs.py \
    tests/test_dit_stack.py::test_on_cuda_stacked_streams_keep_their_caches_there \
    tests/test_vocoder_stack.py::test_on_cuda_stacked_windows_follow_their_calls_alone \
    tests/test_shape_pool.py tests/test_dit_graphs.py::test_on_cuda_replayed_calls_equal_launched_ones
[ -f "$WORK/gates/llm.pt" ] || step tiny-model 120 "$PY" -m cosyvoice_export tiny-bundle "$WORK/gates"
for p in $GATES; do
    tag=${p//[=,]/-}
    step "gates-$tag" 240 bash -c "$(declare -f export_bundle); PY=$PY; export_bundle $p $WORK/gates \
        $WORK/gates-$tag && $PY -m cosyvoice_golden check --model $WORK/gates-$tag --precision $p --provider $PROVIDER"
done
wait $exports

# measure KIND PRECISION: one kind of measurement on the precision's bundle, where it was exported
measure() {
    local kind=$1 p=$2 tag bundle batches rows
    tag=${p//[=,]/-}
    bundle=$WORK/$SIZE-$tag
    [ -f "$bundle/manifest.json" ] || return 0
    batches=$(grep -c '"llm_decode"' "$bundle/manifest.json")
    case $kind in
    bench) step "bench-$tag" 300 "$PY" -m cosyvoice_bench --model "$bundle" --provider "$PROVIDER" \
        --lengths long --concurrency 1,4 --quick --repeat 3 --tokens 250 --first-chunk-tokens 10 \
        --flow-window all --no-progress --json "$OUT/bench-$tag.json" ;;
    nographs) ((batches)) || return 0
        if [ "$PROVIDER" = cuda ]; then
            step "nographs-$tag" 300 "$PY" -m cosyvoice_bench --model "$bundle" --provider "$PROVIDER" \
                --lengths long --concurrency 1,4 --quick --repeat 3 --tokens 250 --first-chunk-tokens 10 \
                --no-cuda-graphs --no-progress --json "$OUT/nographs-$tag.json"
        elif selected "nographs-$tag"; then
            echo "nographs-$tag: skipped, CUDA graphs are the cuda provider's" >>"$OUT/summary.txt"
        fi ;;
    stacking) step "stacking-$tag" 120 "$PY" -m cosyvoice_bench.dit_stacking --model "$bundle" \
        --provider "$PROVIDER" --streams 1,4,16 --rounds $ROUNDS --json "$OUT/stacking-$tag.json" ;;
    vocstacking) step "vocstacking-$tag" 120 "$PY" -m cosyvoice_bench.vocoder_stacking --model "$bundle" \
        --provider "$PROVIDER" --streams 1,4,16 --rounds $ROUNDS --json "$OUT/vocstacking-$tag.json" ;;
    streams) ((batches)) && step "streams$STREAMS-$tag" 360 "$PY" -m cosyvoice_bench --model "$bundle" \
        --provider "$PROVIDER" --lengths long --concurrency "$STREAMS" --quick --tokens 125 --flow-window all \
        --no-progress --json "$OUT/streams$STREAMS-$tag.json" ;;
    stacked) ((batches)) && step "stacked-streams$STREAMS-$tag" 360 "$PY" -m cosyvoice_bench --model "$bundle" \
        --provider "$PROVIDER" --lengths long --concurrency "$STREAMS" --quick --tokens 125 --stack-dit \
        --stack-vocoder --no-progress --json "$OUT/stacked-streams$STREAMS-$tag.json" ;;
    profile) step "profile-$tag" 120 "$PY" -m cosyvoice_bench.graph_profile --model "$bundle" \
        --provider "$PROVIDER" --json "$OUT/profile-$tag.json" ;;
    variants) ((batches)) && step "variants-$tag" 240 "$PY" -m cosyvoice_bench.decode_variants \
        --model "$bundle" --provider "$PROVIDER" --rows 1,4,16 --json "$OUT/variants-$tag.json" ;;
    rows) if ((batches)); then
        for rows in 4 16; do
            step "rows$rows-$tag" 120 "$PY" -m cosyvoice_bench.graph_profile --model "$bundle" \
                --provider "$PROVIDER" --decode-rows $rows --json "$OUT/rows$rows-$tag.json"
        done
    fi ;;
    slots1) ((batches)) && step "slots1-streams$STREAMS-$tag" 360 "$PY" -m cosyvoice_bench --model "$bundle" \
        --provider "$PROVIDER" --lengths long --concurrency "$STREAMS" --quick --tokens 125 --chunk-slots 1 \
        --no-progress --json "$OUT/slots1-streams$STREAMS-$tag.json" ;;
    esac
    return 0
}

for kind in bench nographs stacking vocstacking streams stacked profile variants rows slots1; do
    for p in $PRECISIONS; do
        measure "$kind" "$p"
    done
done
echo "done in $((SECONDS - start)) s; the logs are in $OUT" | tee -a "$OUT/summary.txt"
