# Sourced by the GPU session scripts (h200_session.sh, h200_storage.sh), from the repo root: the
# carried wheels ($WHEELS) installed into /tmp/site, the environment, and `stamp`, a clock that
# also writes to $OUT/$SESSION_LOG.
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD OMP_NUM_THREADS=4
t0=$(date +%s)
stamp() { echo "[$(($(date +%s) - t0)) s] $*" | tee -a "$OUT/${SESSION_LOG:-session.log}"; }
if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$WHEELS"/*.whl 2>&1 | tail -3
fi
