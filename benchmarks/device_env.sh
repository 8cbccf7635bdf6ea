# Sourced by the GPU session scripts (h200_session.sh, h200_storage.sh), from the repo root: the
# carried wheels ($WHEELS) installed into /tmp/site, the environment, and `stamp`, a clock that
# also writes to $OUT/$SESSION_LOG.
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD OMP_NUM_THREADS=4
t0=$(date +%s)
stamp() { echo "[$(($(date +%s) - t0)) s] $*" | tee -a "$OUT/${SESSION_LOG:-session.log}"; }
# SITE_PARTS: the carried parts of one tar.xz of the dependencies already unpacked for the node's
# Python (pip install --target on this machine; xz packs them ~20% smaller than the wheels, so three
# carry calls of < 64 MiB hold them). Python's own lzma unpacks it: no xz binary needed there.
if [ -n "${SITE_PARTS:-}" ] && [ ! -d /tmp/site/dagster ]; then
  mkdir -p /tmp/site
  cat $SITE_PARTS | python3 -c "import sys, tarfile; tarfile.open(fileobj=sys.stdin.buffer, mode='r|xz').extractall('/tmp/site')"
fi
if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$WHEELS"/*.whl 2>&1 | tail -3
fi
