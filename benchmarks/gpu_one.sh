# Every one-GPU table of docs/benchmarks.md in one device call each (nvidia-h200), from the
# repository root on the device with the wheels the image lacks carried in .whl/:
#     bash benchmarks/gpu_one.sh suite    # every gpu-marked test but the stress ones, four at
#                                         # a time (one GPU)
#     bash benchmarks/gpu_one.sh paths    # staged commit, delta compare, MoE on CUDA, FP8 matmul
#                                         # and update, the delta prepare with and without
#                                         # Triton, hand-over, ipc
#     bash benchmarks/gpu_one.sh ipc      # the ipc ratios alone (three runs, RUNS="1" for one;
#                                         # BUCKETS=0 for zero-copy and the default packed
#                                         # path only)
#     bash benchmarks/gpu_one.sh delta    # the delta comparison's GPU tests; today's way to
#                                         # find changed words against a per-block compaction;
#                                         # the 8B prepare through the Triton comparison and
#                                         # the eager ops
#     bash benchmarks/gpu_one.sh ucx      # ucx's default (reads where UCX chose them) and
#                                         # tagged buckets against one raw UCX send
#     bash benchmarks/gpu_one.sh peers    # checkpoint-engine side by side
#     bash benchmarks/gpu_one.sh inplace  # ipc's M->N and TP zero-copy GPU tests, then 2 trainer
#                                         # processes -> engine TP=2: one sender, M->N read
#                                         # in place, M->N staged
#     bash benchmarks/gpu_one.sh graphs   # copy graphs: their GPU test and ipc's in-place and
#                                         # zero-copy tests, then 8B 2 trainer processes ->
#                                         # engine TP=2 with graphs on, then off
#                                         # (WTRANSFER_COPY_GRAPH=0), the same run
#     bash benchmarks/gpu_one.sh calls    # ipc M->N read in place (no announcement): its GPU
#                                         # tests and staged replays, then 8B 2 -> TP=2 (one
#                                         # sender, M->N)
#     bash benchmarks/gpu_one.sh staged   # staged updates' throughput, eight updates a row: the
#                                         # trainer a thread of the engine's process, then a
#                                         # process of its own (MODELS, default qwen3-8b;
#                                         # INFLIGHT; SWITCH_MS=0.5: then a thread with that GIL
#                                         # switch interval)
#     bash benchmarks/gpu_one.sh small    # Qwen3-1.7B, where the fixed cost per update weighs
#                                         # most: ipc zero-copy and packed (three runs), ucx,
#                                         # the host path beside checkpoint-engine, the delta
#                                         # prepare
#     bash benchmarks/gpu_one.sh m2n      # 2 trainer processes -> our engine's 2 TP workers,
#                                         # then -> 1 receiver, over CUDA IPC
#     bash benchmarks/gpu_one.sh trace    # a timeline of the trainer and the engine through
#                                         # 8B zero-copy updates (where the time goes)
#     bash benchmarks/gpu_one.sh timeline # every process's marks through the 8B 2 -> TP=2
#                                         # updates (M->N, then one sender), one time axis
#     bash benchmarks/gpu_one.sh finite   # the checked copy against copy_; what refusing NaN/inf
#                                         # costs an 8B zero-copy update
#     bash benchmarks/gpu_one.sh engine   # the engine's GPU tests, SDPA's kernels per new
#                                         # prefill shape, then benchmarks/stall.py on
#                                         # CUDA (MODELS, INFLIGHT, MODES: what to run), then
#                                         # decode_profile.py with and without the Triton layers
#     bash benchmarks/gpu_one.sh profile  # py-spy of the engine and ranks during the 8B
#                                         # 2 -> TP=2 updates (one sender, then M->N); needs
#                                         # the py-spy wheel in .whl/ (pip download py-spy)
# The image lacks (wheels in .whl/, cp312 manylinux; as this checkout's .venv has them):
# pyzmq, fastapi (0.165 needs opentelemetry-api), starlette, uvicorn, pydantic, pydantic-core,
# annotated-types, typing-inspection, typing-extensions (>= 4.16 for pydantic 2.14).
# The UCX wheels (ucxx-cu13, libucxx-cu13, libucx-cu13<1.22, rmm-cu13, librmm-cu13,
# rapids-logger) go in .whl/ucx/ (about 53 MB); without them the ucx tests fail to start.
# Results and logs go to $OUT.
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site NCCL_NVLS_ENABLE=0 WTRANSFER_BENCH_DIR=$OUT
ts() { date +%H:%M:%S; }
echo "$(ts) setup"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .whl/*.whl $(ls .whl/ucx/*.whl 2>/dev/null) > /tmp/wheels.log 2>&1 || tail -5 /tmp/wheels.log
python3 -m pip install -q --no-deps --no-build-isolation -e . -e backends/ipc -e backends/nccl \
    -e backends/ucx -e integrations/vllm > /tmp/install.log 2>&1 || tail -5 /tmp/install.log
case "$1" in
suite)
    echo "$(ts) gpu-marked tests, 4 workers (a hang prints every thread's stack after 120 s;"
    echo "   stress tests, whose device-wide memory readings the other workers disturb, left out)"
    timeout 400 python3 -m pytest -m "gpu and not stress" -q -n 4 --dist loadscope \
        -p no:cacheprovider \
        --durations=15 -o faulthandler_timeout=120 tests > $OUT/suite.txt 2>&1; echo "rc $?"
    grep -E "passed|failed|FAILED|ERROR|s call" $OUT/suite.txt | tail -40 ;;
paths|ipc)
    if [ "$1" = paths ]; then
        echo "$(ts) this wave's paths"
        timeout 200 python3 benchmarks/gpu_paths.py --model qwen3-8b --repeats 5 \
            2>&1 | tee $OUT/paths.txt | tail -12; echo "rc $?"
        echo "$(ts) FP8 projections: FP8 x FP8 block-scaled against dequantize and bf16"
        timeout 120 python3 benchmarks/fp8_matmul.py 2>&1 | tee $OUT/fp8_matmul.txt \
            | tail -22; echo "rc $?"
        echo "$(ts) FP8 engine fed both ways"
        timeout 200 python3 benchmarks/fp8_update.py --model qwen3-8b --device cuda:0 \
            --repeats 3 2>&1 | tee $OUT/fp8.txt | tail -8; echo "rc $?"
        echo "$(ts) the delta sender's prepare: the Triton comparison, then the eager ops"
        for triton in 1 0; do
            WTRANSFER_DELTA_TRITON=$triton timeout 100 python3 benchmarks/delta_profile.py \
                --model qwen3-8b > $OUT/delta-$triton.txt 2>&1; echo "rc $?"
            grep -E "perturbed|copy" $OUT/delta-$triton.txt
        done
        echo "$(ts) bucket hand-over and copy strategies"
        timeout 150 python3 benchmarks/handover.py --model qwen3-8b --buckets-mb 64,1024 \
            2>&1 | tee $OUT/handover.txt | tail -30; echo "rc $?"
    fi
    for run in ${RUNS:-1 2 3}; do  # bucket 0: the default (packed through CUDA staging: 1 GiB x 4
        # buffers), then 4 buffers of 1 GiB and of 512 MiB named; the first run builds the
        # 16 GB model cold (one ran past 110 s on 2026-12-02)
        echo "$(ts) ipc zero-copy and packed, run $run"
        WTRANSFER_BENCH_DIR=$OUT/ipc-$run timeout 170 python3 benchmarks/transfer.py \
            --backend ipc --device cuda:0 --models qwen3-8b \
            --bucket-mb "${BUCKETS:-0,1024x4,512x4}" --repeats 5 > $OUT/ipc-$run.txt 2>&1; echo "rc $?"
        tail -10 $OUT/ipc-$run.txt
    done ;;
delta)
    echo "$(ts) the delta comparison's GPU tests"
    timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider -o faulthandler_timeout=60 \
        tests/core/test_delta_compare.py tests/inference/test_delta_engine.py > $OUT/delta-tests.txt 2>&1
    echo "rc $?"; grep -E "passed|failed|FAILED|Error" $OUT/delta-tests.txt | tail -15
    echo "$(ts) finding a group's changed words: nonzero and gather, or a per-block compaction"
    timeout 90 python3 benchmarks/delta_compaction.py 2>&1 | grep -E "group|changed|equal"
    echo "$(ts) the delta sender's prepare: the Triton comparison, then the eager ops"
    for triton in 1 0; do
        fractions=0.0003,0.01; [ $triton = 1 ] && fractions=0.0003,0.01,0.05,0.3
        WTRANSFER_DELTA_TRITON=$triton timeout 150 python3 benchmarks/delta_profile.py \
            --model qwen3-8b --fractions $fractions > $OUT/delta-$triton.txt 2>&1; echo "rc $?"
        grep -E "perturbed|copy|_kernel|Self CUDA" $OUT/delta-$triton.txt | cut -c1-60,150-
    done ;;
ucx)
    echo "$(ts) ucx: the default (what UCX chose here) and tagged 1 GiB buckets, one GPU"
    WTRANSFER_BENCH_DIR=$OUT/ucx timeout 400 python3 benchmarks/transfer.py --backend ucx \
        --device cuda:0 --models qwen3-8b --bucket-mb 1024 --repeats 5 > $OUT/ucx.txt 2>&1
    echo "rc $?"; tail -8 $OUT/ucx.txt ;;
peers)
    echo "$(ts) checkpoint-engine side by side"
    timeout 560 python3 benchmarks/peers.py --model qwen3-8b 2>&1 | tee $OUT/peers.txt \
        | tail -25; echo "rc $?" ;;
inplace)
    echo "$(ts) ipc's GPU tests: M->N read in place and staged, zero-copy"
    timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider -o faulthandler_timeout=90 \
        --tb=short tests/backends/test_m2n_transfers.py tests/backends/test_ipc_cuda.py \
        -k "two_trainer_processes or packed_sender or zero_copy_update_into_a_tp" \
        > $OUT/inplace-tests.txt 2>&1
    echo "rc $?"; grep -E "passed|failed|FAILED|Error" $OUT/inplace-tests.txt | tail -15
    echo "$(ts) M->N over CUDA IPC into TP=2: one sender, read in place, staged"
    WTRANSFER_BENCH_DIR=$OUT/m2n-tp2 timeout 330 python3 benchmarks/transfer.py --backend ipc \
        --device cuda:0 --models qwen3-8b --trainer-ranks 2 --engine-tp 2 --bucket-mb 1024 \
        --repeats 3 --update-staging off --update-rollback off > $OUT/m2n-tp2.txt 2>&1
    echo "rc $?"; tail -8 $OUT/m2n-tp2.txt ;;
graphs)
    echo "$(ts) copy graphs: their GPU test, ipc's in-place and zero-copy GPU tests"
    timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider -o faulthandler_timeout=90 \
        --tb=short tests/core/test_copy_graph.py tests/backends/test_m2n_transfers.py \
        tests/backends/test_ipc_cuda.py \
        -k "replay_their_copies or two_trainer_processes or zero_copy_update_into_a_tp" \
        > $OUT/graphs-tests.txt 2>&1
    echo "rc $?"; grep -E "passed|failed|FAILED|Error" $OUT/graphs-tests.txt | tail -15
    for graphs in 1 0; do
        echo "$(ts) 8B 2 -> TP=2, copy graphs $graphs"
        WTRANSFER_COPY_GRAPH=$graphs WTRANSFER_BENCH_DIR=$OUT/graphs-$graphs timeout 180 \
            python3 benchmarks/transfer.py --backend ipc --device cuda:0 --models qwen3-8b \
            --trainer-ranks 2 --engine-tp 2 --bucket-mb 1024 --repeats 5 \
            --paths "one sender,M->N" --update-staging off --update-rollback off \
            > $OUT/graphs-$graphs.txt 2>&1
        echo "rc $?"; tail -6 $OUT/graphs-$graphs.txt
    done ;;
calls)
    echo "$(ts) GPU tests: ipc M->N read in place (no announcement), staged updates that"
    echo "   replay their copies (a cold machine builds its kernels in the first ones)"
    timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider -o faulthandler_timeout=120 \
        --tb=short tests/backends/test_m2n_transfers.py tests/backends/test_ipc_m2n_in_place.py \
        tests/inference/test_decode_graphs.py tests/core/test_copy_graph.py \
        -k "two_trainer_processes or in_place or replay" > $OUT/calls-tests.txt 2>&1
    echo "rc $?"; grep -E "passed|failed|FAILED|Error" $OUT/calls-tests.txt | tail -15
    echo "$(ts) 8B 2 -> TP=2: one sender, M->N read in place (the 8B engine starts in ~100 s)"
    WTRANSFER_BENCH_DIR=$OUT/calls timeout 300 python3 benchmarks/transfer.py --backend ipc \
        --device cuda:0 --models qwen3-8b --trainer-ranks 2 --engine-tp 2 --bucket-mb 1024 \
        --repeats 5 --paths "one sender,M->N" --update-staging off --update-rollback off \
        > $OUT/calls.txt 2>&1
    echo "rc $?"; tail -6 $OUT/calls.txt ;;
staged)
    # (is a staged update's slowdown of the steps the engine's GIL? the trainer as a thread of
    # the engine's process, then as a process of its own over HTTP; with SWITCH_MS=0.5, the
    # thread again with that GIL switch interval; eight updates a row, copy graphs on)
    echo "$(ts) staged updates: ${MODELS:=qwen3-8b} x${INFLIGHT:=16}, none / staged, trainer"
    echo "   thread and process"
    timeout 330 python3 benchmarks/stall.py --device cuda --models $MODELS --inflight $INFLIGHT \
        --modes "none,staged" --updates 8 --trainer thread,process 2>&1 \
        | tee $OUT/staged.txt | tail -5; echo "rc ${PIPESTATUS[0]}"
    if [ -n "$SWITCH_MS" ]; then
        echo "$(ts) the same, trainer thread, GIL switch interval $SWITCH_MS ms"
        WTRANSFER_BENCH_DIR=$OUT/switch timeout 230 python3 benchmarks/stall.py --device cuda \
            --models $MODELS --inflight $INFLIGHT --modes "none,staged" --updates 8 \
            --switch-interval-ms $SWITCH_MS 2>&1 | tee $OUT/staged-switch.txt | tail -4
        echo "rc ${PIPESTATUS[0]}"
    fi ;;
small)  # (PARTS: which of "ipc ucx delta peers", default all)
    PARTS=${PARTS:-ipc ucx delta peers}
    for run in $([[ $PARTS == *ipc* ]] && echo 1 2 3); do  # (the fixed cost per update
        # weighs most at this size: #61's 1.3x)
        echo "$(ts) ipc zero-copy and the packed default, Qwen3-1.7B, run $run"
        WTRANSFER_BENCH_DIR=$OUT/small-ipc-$run timeout 150 python3 benchmarks/transfer.py \
            --backend ipc --device cuda:0 --models qwen3-1.7b --bucket-mb 0 --repeats 7 \
            > $OUT/small-ipc-$run.txt 2>&1; echo "rc $?"; tail -5 $OUT/small-ipc-$run.txt
    done
    if [[ $PARTS == *ucx* ]]; then
        echo "$(ts) ucx's default against one raw UCX send, Qwen3-1.7B"
        WTRANSFER_BENCH_DIR=$OUT/small-ucx timeout 200 python3 benchmarks/transfer.py \
            --backend ucx --device cuda:0 --models qwen3-1.7b --bucket-mb 1024 --repeats 7 \
            > $OUT/small-ucx.txt 2>&1; echo "rc $?"; tail -5 $OUT/small-ucx.txt
    fi
    if [[ $PARTS == *delta* ]]; then
        echo "$(ts) the delta sender's prepare, Qwen3-1.7B"
        timeout 120 python3 benchmarks/delta_profile.py --model qwen3-1.7b \
            --fractions 0.0003,0.01 > $OUT/small-delta.txt 2>&1; echo "rc $?"
        grep -E "perturbed|copy" $OUT/small-delta.txt
    fi
    if [[ $PARTS == *peers* ]]; then
        echo "$(ts) the host path at every default beside checkpoint-engine, Qwen3-1.7B"
        timeout 300 python3 benchmarks/peers.py --model qwen3-1.7b 2>&1 \
            | tee $OUT/small-peers.txt | tail -14; echo "rc $?"
    fi ;;
m2n)
    # staging off: two trainer replicas and a shadow-staged 8B engine overflow an 80 GB card
    echo "$(ts) M->N over CUDA IPC: two trainer processes (replicas) -> engine TP=2, one GPU"
    WTRANSFER_BENCH_DIR=$OUT/m2n-tp2 timeout 300 python3 benchmarks/transfer.py --backend ipc \
        --device cuda:0 --models qwen3-8b --trainer-ranks 2 --engine-tp 2 --bucket-mb 1024 \
        --repeats 3 --update-staging ${STAGING:-off} > $OUT/m2n-tp2.txt 2>&1; echo "rc $?"
    tail -8 $OUT/m2n-tp2.txt
    echo "$(ts) M->N over CUDA IPC: two trainer processes (replicas) -> one receiver, one GPU"
    WTRANSFER_BENCH_DIR=$OUT/m2n timeout 560 python3 benchmarks/transfer.py --backend ipc \
        --device cuda:0 --models qwen3-8b --trainer-ranks 2 --senders 2 --bucket-mb 1024 \
        --repeats 3 > $OUT/m2n.txt 2>&1; echo "rc $?"
    tail -12 $OUT/m2n.txt ;;
trace)
    echo "$(ts) where an 8B zero-copy update's time goes"
    timeout 300 python3 benchmarks/zero_copy_trace.py --model qwen3-8b --device cuda:0 \
        > $OUT/trace.txt 2>&1; echo "rc $?"
    cat $OUT/trace.txt | tail -80 ;;
profile)
    for path in one-sender m2n; do
        echo "$(ts) where the 8B 2 -> TP=2 update's time goes: $path"
        timeout 280 python3 benchmarks/profile_update.py --model qwen3-8b --device cuda:0 \
            --tp 2 --path $path --updates 10 --py-spy /tmp/site/bin/py-spy \
            > $OUT/profile-$path.txt 2>&1; echo "rc $?"
        grep -A14 "^engine\|median update" $OUT/profile-$path.txt | head -60
    done ;;
timeline)
    for path in ${PATHS:-m2n one-sender}; do  # (a cold 8B engine start took 83 s once)
        echo "$(ts) a timeline of every process through 8B 2 -> TP=2 updates: $path"
        timeout ${TIMELINE_S:-300} python3 benchmarks/update_timeline.py --model qwen3-8b \
            --device cuda:0 --tp 2 --path $path --updates 3 > $OUT/timeline-$path.txt 2>&1
        echo "rc $?"; grep -B2 -A40 "median update" $OUT/timeline-$path.txt | head -60
    done ;;
finite)
    echo "$(ts) the checked copy (copy + NaN/inf test in one read) against copy_, alone and"
    echo "   over the 8B tensor list"
    timeout 150 python3 benchmarks/checked_copy.py --mib 1024 --model qwen3-8b --repeats 7 \
        2>&1 | tee $OUT/checked_copy.txt | tail -14; echo "rc $?"
    echo "$(ts) the finite check: an 8B update with it and without, the check alone, one copy"
    timeout 300 python3 benchmarks/finite_check.py --model qwen3-8b --device cuda:0 \
        --repeats 5 2>&1 | tee $OUT/finite.txt | tail -8; echo "rc $?" ;;
engine)
    echo "$(ts) the engine's GPU tests (CUDA graphs, memory given back at shutdown)"
    timeout ${TESTS_S:-240} python3 -m pytest -m gpu -q -p no:cacheprovider -x tests/inference \
        > $OUT/engine-tests.txt 2>&1; echo "rc $?"; tail -5 $OUT/engine-tests.txt
    echo "$(ts) SDPA's kernels on prefill shapes: first call per new shape, then"
    timeout 60 python3 benchmarks/sdpa_plans.py 2>&1 | grep -v Warn | tail -17
    echo "$(ts) decode speed and update stall: ${MODELS:=qwen3-0.6b,qwen3-8b} x ${INFLIGHT:=16}"
    timeout ${STALL_S:-330} python3 benchmarks/stall.py --device cuda --models $MODELS \
        --inflight $INFLIGHT --modes "${MODES:-none,none gather,staged,staged keep KV}" \
        --updates 3 2>&1 | tee $OUT/stall.txt | tail -30; echo "rc $?"
    echo "$(ts) where a decode step's time goes: kernels per step, with and without the Triton"
    echo "   layers (${MODELS%%,*} x16)"
    for fused in 1 0; do
        WTRANSFER_FUSED_LAYERS=$fused timeout 60 python3 benchmarks/decode_profile.py \
            --model ${MODELS%%,*} --inflight 16 $([ $fused = 0 ] && echo --gather) 2>&1 \
            | grep -v USDT | tail -14
    done ;;
*) echo "usage: gpu_one.sh suite|paths|ipc|ucx|peers|calls|staged|small|m2n|trace|profile|timeline|finite|engine"; exit 2 ;;
esac
echo "$(ts) done"
