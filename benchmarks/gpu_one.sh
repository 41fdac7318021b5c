# Every one-GPU table of docs/benchmarks.md in one device call each (nvidia-h200), from the
# repository root on the device with the wheels the image lacks carried in .whl/:
#     bash benchmarks/gpu_one.sh paths    # staged commit, delta compare, MoE on CUDA, ipc ratios
#     bash benchmarks/gpu_one.sh peers    # checkpoint-engine side by side
# Results and logs go to $OUT.
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site NCCL_NVLS_ENABLE=0 WTRANSFER_BENCH_DIR=$OUT
ts() { date +%H:%M:%S; }
echo "$(ts) setup"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .whl/*.whl > /tmp/wheels.log 2>&1 || tail -5 /tmp/wheels.log
python3 -m pip install -q --no-deps --no-build-isolation -e . -e backends/ipc -e backends/nccl \
    > /tmp/install.log 2>&1 || tail -5 /tmp/install.log
case "$1" in
paths)
    echo "$(ts) this wave's paths"
    timeout 200 python3 benchmarks/gpu_paths.py --model qwen3-8b --repeats 5 \
        2>&1 | tee $OUT/paths.txt | tail -12; echo "rc $?"
    for run in 1 2 3; do
        echo "$(ts) ipc zero-copy and packed, run $run"
        WTRANSFER_BENCH_DIR=$OUT/ipc-$run timeout 110 python3 benchmarks/transfer.py \
            --backend ipc --device cuda:0 --models qwen3-8b --bucket-mb 1024 --repeats 5 \
            > $OUT/ipc-$run.txt 2>&1; echo "rc $?"
        tail -8 $OUT/ipc-$run.txt
    done ;;
peers)
    echo "$(ts) checkpoint-engine side by side"
    timeout 560 python3 benchmarks/peers.py --model qwen3-8b 2>&1 | tee $OUT/peers.txt \
        | tail -25; echo "rc $?" ;;
*) echo "usage: gpu_one.sh paths|peers"; exit 2 ;;
esac
echo "$(ts) done"
