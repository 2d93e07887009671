#!/usr/bin/env bash
# Sets up a Debian 12 / Python 3.11 machine for opennpu and installs it. Idempotent, and fast
# when everything is already in place:
#   1. build tools from Debian (g++, cmake, ninja, ccache) if missing;
#   2. torch (the pinned version below) from PyPI into the machine's Python, once;
#   3. build, run-time (libcst) and test dependencies from PyPI, only those missing;
#   4. opennpu itself with `pip install --no-build-isolation`, only when its sources changed
#      since the last install (the persistent build/ folder and ccache keep rebuilds incremental).
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_VERSION="2.11.0"
TRANSFORMERS_VERSION="5.23.0"  # graph-mode tests build decoder layers from small configs
ACCELERATE_VERSION="1.15.0"    # tests: accelerate detects and trains on the npu device
EN_DTYPES_VERSION="0.0.4"      # tests: op-plugin's goldens' float4 / hifloat8 codecs, an oracle for ours
PYTHON="${PYTHON:-python}"
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
say() { printf '[setup] %s\n' "$*" >&2; }

# 1. System build tools.
missing=()
for tool in g++:g++ cmake:cmake ninja:ninja-build ccache:ccache; do
  command -v "${tool%%:*}" >/dev/null 2>&1 || missing+=("${tool##*:}")
done
if ((${#missing[@]})); then
  sudo_cmd=()
  [ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
  say "installing ${missing[*]} from Debian"
  if ! "${sudo_cmd[@]}" apt-get install -y --no-install-recommends "${missing[@]}" >/dev/null; then
    "${sudo_cmd[@]}" apt-get update >/dev/null
    "${sudo_cmd[@]}" apt-get install -y --no-install-recommends "${missing[@]}" >/dev/null
  fi
fi

# 2. torch, pinned.
dist_version() {  # installed version of a PyPI distribution, without importing it
  "$PYTHON" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]).split('+')[0])" "$1" 2>/dev/null || true
}
installed_torch=$(dist_version torch)
if [ "$installed_torch" != "$TORCH_VERSION" ]; then
  say "installing torch==$TORCH_VERSION from PyPI (found: ${installed_torch:-none})"
  "$PYTHON" -m pip install --quiet "torch==$TORCH_VERSION"
fi

# 3. Build and test dependencies.
if ! "$PYTHON" -c 'import libcst' 2>/dev/null; then
  say "installing libcst from PyPI (the offline converter, opennpu.migrate)"
  "$PYTHON" -m pip install --quiet "libcst>=1.0"
fi
if ! "$PYTHON" -c 'import scikit_build_core, numpy, pytest, xdist, hypothesis, expecttest' 2>/dev/null; then
  say "installing build and test dependencies from PyPI"
  "$PYTHON" -m pip install --quiet "scikit-build-core>=0.10" numpy "pytest>=8" pytest-xdist \
    hypothesis expecttest
fi
if [ "$(dist_version transformers)" != "$TRANSFORMERS_VERSION" ]; then
  say "installing transformers==$TRANSFORMERS_VERSION from PyPI (test dependency)"
  "$PYTHON" -m pip install --quiet "transformers==$TRANSFORMERS_VERSION"
fi
if [ "$(dist_version accelerate)" != "$ACCELERATE_VERSION" ]; then
  say "installing accelerate==$ACCELERATE_VERSION from PyPI (test dependency)"
  "$PYTHON" -m pip install --quiet "accelerate==$ACCELERATE_VERSION"
fi

if [ "$(dist_version en_dtypes)" != "$EN_DTYPES_VERSION" ]; then
  say "installing en_dtypes==$EN_DTYPES_VERSION from PyPI (test dependency)"
  "$PYTHON" -m pip install --quiet "en_dtypes==$EN_DTYPES_VERSION"
fi

# 4. opennpu, rebuilt only when a source file changed.
stamp_file=build/.setup-stamp
stamp=$( (find csrc src -type f ! -name '*.pyc' -print0; printf '%s\0' CMakeLists.txt pyproject.toml) \
  | sort -z | xargs -0 sha1sum | sha1sum | cut -d' ' -f1)
if [ "$(cat "$stamp_file" 2>/dev/null)" != "$stamp" ] || [ -z "$(dist_version opennpu)" ]; then
  say "building and installing opennpu"
  "$PYTHON" -m pip install --quiet --no-build-isolation --no-deps .
  mkdir -p build && echo "$stamp" > "$stamp_file"
  # pyenv finds new console scripts (`opennpu`) only after a rehash.
  if command -v pyenv >/dev/null 2>&1; then pyenv rehash || true; fi
fi
say "ready: $("$PYTHON" -c 'import opennpu, torch; print(f"torch {torch.__version__}, opennpu {opennpu.__version__}, CPU kernels {opennpu.cpu_isa()}")')"
