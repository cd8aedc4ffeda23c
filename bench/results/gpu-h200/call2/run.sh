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
stamp "GPU tests"
timeout 150 python3 -m pytest -q -p no:cacheprovider -rs tests/test_devices.py 2>&1 | tee "$OUT/test_devices.log"
left=$(( ${BUDGET_S:-300} - ($(date +%s) - start) ))
stamp "FedAvg E=5 B=10 by role, lr ${LR}, ${WORKERS} workers, to 54%: ${left} s"
timeout "$left" python3 -m fedemu.launch launch examples/fedavg-shakespeare.toml --out /tmp/e5 --workers $WORKERS \
    --set algorithm.E=5 --set algorithm.lr=$LR --set run.rounds=80 > "$OUT/e5-launch.log" 2>&1; echo "rc $?"
cp /tmp/e5/events.jsonl "$OUT/e5-events.jsonl" 2>/dev/null; cp /tmp/e5/summary.json "$OUT/e5-summary.json" 2>/dev/null
python3 - <<'PY'
import json, os
rounds = [json.loads(l) for l in open(f"{os.environ['OUT']}/e5-events.jsonl") if '"round"' in l]
rounds = [r for r in rounds if r.get("event") == "round"]
if len(rounds) > 1:
    print(len(rounds), "rounds", f"{(rounds[-1]['t'] - rounds[0]['t']) / (len(rounds) - 1):.2f} s a round",
          "acc", [round(r["accuracy"], 4) for r in rounds])
PY
stamp done
