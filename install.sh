#!/usr/bin/env bash
# Installs what commtune's build, demo and tests need when it is missing, then builds the
# extension against the installed torch. Safe to run again: it only adds what is absent.
set -euo pipefail
cd "$(dirname "$0")"
py=${PYTHON:-python3}

if ! "$py" -c "import torch" 2>/dev/null; then
  echo "install.sh: torch not found; installing torch==2.13.0 (a supported version)"
  "$py" -m pip install -q "torch==2.13.0"
fi
for mod in pytest numpy setuptools wheel matplotlib; do
  "$py" -c "import $mod" 2>/dev/null || "$py" -m pip install -q "$mod"
done

need=()
command -v cmake >/dev/null || need+=(cmake)
command -v ninja >/dev/null || need+=(ninja-build)
command -v g++ >/dev/null || need+=(g++)
[ -f /usr/include/gtest/gtest.h ] || need+=(libgtest-dev)
if [ ${#need[@]} -gt 0 ]; then
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "install.sh: installing ${need[*]} (Debian packages)"
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi

echo "install.sh: building commtune._C (MAX_JOBS=${MAX_JOBS:-2})"
MAX_JOBS=${MAX_JOBS:-2} "$py" -m pip install -q --no-build-isolation --no-deps -e .
"$py" -c "import commtune, torch; print('install.sh: commtune', commtune.__version__, 'on torch', torch.__version__, '(CUDA' , 'on)' if commtune._C.with_cuda else 'off)')"
