#!/bin/bash
# GPU checks for issue 18, one call: set-up, the GPU tests, Shakespeare round time, then
# FedAvg E=5 B=10 by role towards 54% for what time is left.
set -u
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
start=$(date +%s); stamp() { echo "== [$(( $(date +%s) - start )) s] $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/whl/*.whl || exit 1
mkdir -p /tmp/pkg/fedemu && for d in node server worker launch; do ln -sfn "$PWD/$d" /tmp/pkg/fedemu/$d; done
export PYTHONPATH=/tmp/pkg:/tmp/site
mkdir -p /tmp/data && tar -C /tmp/data -xzf .gpu/data.tgz && export FEDEMU_DATA_DIR=/tmp/data
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; echo "cores: $(nproc)"
python3 -c "import sys, torch, numpy, numba, zmq, msgpack, click; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0), 'numpy', numpy.__version__, 'numba', numba.__version__, 'pyzmq', zmq.__version__, 'msgpack', msgpack.version, 'click', click.__version__)"
stamp "GPU tests"
timeout 200 python3 -m pytest -q -p no:cacheprovider -rs tests/test_devices.py 2>&1 | tee "$OUT/test_devices.log"
stamp "Shakespeare FedAvg E=1 B=10 by role: 3 rounds, time per round"
timeout 150 python3 bench/shakespeare_table2.py --measure 3 --rows fedavg-e1-b10 --partitions natural \
    --out /tmp/sh --workers 8 2>&1 | tee "$OUT/measure.log"
cp /tmp/sh/measure/fedavg-e1-b10-natural/events.jsonl "$OUT/e1-events.jsonl" 2>/dev/null
grep -h "computes on\|device" /tmp/sh/measure/fedavg-e1-b10-natural/logs/worker-0.log /tmp/sh/measure/fedavg-e1-b10-natural/logs/server.log 2>/dev/null | head -5
left=$(( ${BUDGET_S:-440} - ($(date +%s) - start) ))
stamp "FedAvg E=5 B=10 by role, lr 1.47, to 54%: ${left} s"
timeout "$left" python3 -m fedemu.launch launch examples/fedavg-shakespeare.toml --out /tmp/e5 --workers 8 \
    --set algorithm.E=5 --set run.rounds=80 > "$OUT/e5-launch.log" 2>&1; echo "rc $?"
cp /tmp/e5/events.jsonl "$OUT/e5-events.jsonl" 2>/dev/null; cp /tmp/e5/summary.json "$OUT/e5-summary.json" 2>/dev/null
python3 - <<'PY'
import json
for name in ("e1", "e5"):
    try:
        rounds = [json.loads(l) for l in open(f"{__import__('os').environ['OUT']}/{name}-events.jsonl") if '"round"' in l]
    except OSError:
        continue
    rounds = [r for r in rounds if r.get("event") == "round"]
    if len(rounds) > 1:
        per = (rounds[-1]["t"] - rounds[0]["t"]) / (len(rounds) - 1)
        print(name, len(rounds), "rounds", f"{per:.2f} s a round", "acc", [round(r["accuracy"], 4) for r in rounds])
PY
stamp done
