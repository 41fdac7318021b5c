# The multi-GPU nccl run: trainer on cuda:0, receiver on cuda:1 (nvidia-h200-x2).
# Run from the repository root on the device machine with the pyzmq wheel carried in .whl/
# (the image has torch and NCCL but not pyzmq); results and log.txt go to $OUT.
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site NCCL_NVLS_ENABLE=0
ts() { date +%H:%M:%S; }
L=$OUT/log.txt
{
echo "$(ts) setup"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/pyzmq*.whl
python3 -m pip install -q --no-deps --no-build-isolation -e . -e backends/ipc -e backends/nccl > /tmp/install.log 2>&1 || tail -5 /tmp/install.log
nvidia-smi topo -m | head -4
export WTRANSFER_BENCH_DIR=$OUT
echo "$(ts) bench qwen3-8b"
timeout 110 python3 benchmarks/transfer.py --backend nccl --device cuda:0 --receiver-devices cuda:1 --models qwen3-8b --bucket-mb 64,256,1024 --repeats 3 2>&1 | tail -8
echo "$(ts) teardown"
timeout 150 python3 benchmarks/teardown.py --backend nccl --model qwen3-1.7b --device cuda:0 --receiver-devices cuda:1 --cycles 20 2>&1 | tail -5
echo "$(ts) tests"
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/backends/test_nccl_multi_gpu.py tests/backends/test_nccl_cuda.py 2>&1 | tail -8
echo "$(ts) bench qwen3-1.7b"
timeout 50 python3 benchmarks/transfer.py --backend nccl --device cuda:0 --receiver-devices cuda:1 --models qwen3-1.7b --bucket-mb 64,256,1024 --repeats 3 2>&1 | tail -7
echo "$(ts) end"
} 2>&1 | tee $L
