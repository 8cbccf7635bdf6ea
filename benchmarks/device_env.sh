# Sourced by the GPU session scripts (h200_session.sh, h200_storage.sh), from the repo root: the
# carried wheels ($WHEELS) installed into $SITE_DIR (default /tmp/site; a folder in the repo root
# outlives the machine's /tmp between calls), the environment, and `stamp`, a clock that
# also writes to $OUT/$SESSION_LOG.
SITE_DIR=${SITE_DIR:-/tmp/site}
export PYTHONUNBUFFERED=1 PYTHONPATH=$SITE_DIR:$PWD OMP_NUM_THREADS=4
t0=$(date +%s)
stamp() { echo "[$(($(date +%s) - t0)) s] $*" | tee -a "$OUT/${SESSION_LOG:-session.log}"; }
# SITE_PARTS: the carried parts of one tar.xz of the dependencies already unpacked for the node's
# Python (pip install --target on this machine; xz packs them ~20% smaller than the wheels, so three
# carry calls of < 64 MiB hold them). Python's own lzma unpacks it: no xz binary needed there.
if [ -n "${SITE_PARTS:-}" ] && [ ! -d "$SITE_DIR/dagster" ]; then
  mkdir -p "$SITE_DIR"
  cat $SITE_PARTS | python3 -c "import sys, tarfile; tarfile.open(fileobj=sys.stdin.buffer, mode='r|xz').extractall(sys.argv[1])" "$SITE_DIR"
fi
if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE_DIR" \
    "$WHEELS"/*.whl 2>&1 | tail -3
fi
# RG: a folder of reasoning-gym's wheel, its pure-Python needs and pycosat's source (built there,
# no wheel for the node's Python exists), for the experiments with generator:reasoning-gym/*.
if [ -n "${RG:-}" ] && ! python3 -c "import reasoning_gym" 2>/dev/null; then
  (python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE_DIR" "$RG"/*.whl \
   && python3 -m pip install -q --no-index --no-deps --no-build-isolation --target "$SITE_DIR" "$RG"/pycosat-*.tar.gz \
   && python3 -c "import reasoning_gym" && echo "reasoning-gym installed") > "$OUT/rg_install.log" 2>&1
  stamp "$(tail -1 "$OUT/rg_install.log")"
fi
