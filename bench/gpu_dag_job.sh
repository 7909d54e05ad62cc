#!/usr/bin/env bash
# One device call of the real-shape DAG (bench/real_shape_dag.py), after a device-wheels.sh batch put the
# pieces in /tmp/parts (04: PyAV, 05: MLflow and ruamel.yaml, which the stages import and the image lacks).
# Env: JOB_BUDGET (s, default 540), DAG_ARGS (extra arguments, e.g. "--only validate,export").
[ -n "${DEVICE_ENV_DONE:-}" ] || source device-env.sh || exit 1  # a caller that sourced it already sets DEVICE_ENV_DONE=1
python3 -c "import av, mlflow, ruamel.yaml; print('av', av.__version__, 'mlflow', mlflow.__version__)" || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 bench/real_shape_dag.py --budget "${JOB_BUDGET:-540}" ${DAG_ARGS:-}
rc=$?
python3 - <<'PY'
import json, os
d = json.load(open(os.path.join(os.environ["OUT"], "real_shape_dag.json")))
print("setup_s", d.get("setup_s"), "total_s", d.get("total_s"))
for r in d["stages"]:
    print(f'{r["stage"]:24s} rc={r.get("rc")} wall={r.get("wall_s")} busy={r.get("gpu_busy_fraction")} peak={r.get("peak_gpu_mem_gib")} '
          f'pre={r.get("before_gpu_s")} post={r.get("after_gpu_s")} hashed={r.get("hashed_mib")} reused={r.get("reused_mib")} '
          f'{r.get("skipped", "")}{r.get("error", "")[:300]}')
PY
exit $rc
