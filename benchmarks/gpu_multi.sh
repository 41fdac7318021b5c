# The multi-GPU nccl run: trainer on cuda:0, receiver on cuda:1 (nvidia-h200-x2); about 8 min.
# Run from the repository root on the device machine with the pyzmq wheel carried in .whl/
# (the image has torch and NCCL but not pyzmq); results and logs go to $OUT.
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site NCCL_NVLS_ENABLE=0
ts() { date +%H:%M:%S; }
echo "$(ts) setup"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/pyzmq*.whl
python3 -m pip install -q --no-deps --no-build-isolation -e . -e backends/ipc -e backends/nccl \
    > /tmp/install.log 2>&1 || tail -5 /tmp/install.log
echo "$(ts) conformance across GPUs"  # a hang prints every thread's stack after 70 s
timeout 290 python3 -m pytest -v --tb=short -p no:cacheprovider -o faulthandler_timeout=70 \
    tests/backends/test_nccl_multi_gpu.py > $OUT/conformance.txt 2>&1; echo "rc $?"
grep -E "PASSED|FAILED|ERROR|passed|failed|Timeout" $OUT/conformance.txt
echo "$(ts) teardown"
timeout 75 python3 benchmarks/teardown.py --backend nccl --model qwen3-1.7b --device cuda:0 \
    --receiver-devices cuda:1 --cycles 30 > $OUT/teardown.txt 2>&1; echo "rc $?"
tail -6 $OUT/teardown.txt
echo "$(ts) bench"
# every tensor goes direct on CUDA by default, so one bucket size (for what still packs)
WTRANSFER_BENCH_DIR=$OUT timeout 150 python3 benchmarks/transfer.py --backend nccl \
    --device cuda:0 --receiver-devices cuda:1 --models qwen3-8b --bucket-mb 1024 \
    --repeats 5 > $OUT/bench.txt 2>&1; echo "rc $?"
tail -8 $OUT/bench.txt
echo "$(ts) strategies (raw NCCL)"
timeout 60 python3 benchmarks/nccl_strategies.py --model qwen3-8b --repeats 3 \
    > $OUT/strategies.txt 2>&1; echo "rc $?"
tail -13 $OUT/strategies.txt
echo "$(ts) timeline (where one send's time goes, both sides)"
timeout 60 python3 benchmarks/nccl_timeline.py --model qwen3-8b > $OUT/timeline.txt 2>&1
echo "rc $?"; tail -14 $OUT/timeline.txt
echo "$(ts) end"
