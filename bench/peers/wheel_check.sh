#!/usr/bin/env bash
# A non-editable install carries csrc/ and builds the extension from it: builds the wheel
# (`pip wheel .`), lists its csrc/ files, installs it into a bare target directory, and in a
# process that sees only that copy (fresh extension cache) runs a store with backend "auto"
# on CPU: the extension is built from the installed kvwrite/csrc and "cpu" is what auto picks.
# Usage: bash bench/peers/wheel_check.sh [python]   (the python needs torch; default .venv)
set -eu
PY=${1:-.venv/bin/python}
PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")   # keep the venv (no symlink resolution)
W=$(mktemp -d)
"$PY" -m pip wheel --no-deps --no-build-isolation -q -w "$W/wheel" .
echo "wheel: $(ls "$W"/wheel)"
"$PY" -c "import zipfile,glob,sys; n=[x for x in zipfile.ZipFile(glob.glob(sys.argv[1]+'/*.whl')[0]).namelist() if '/csrc/' in x]; print(len(n), 'csrc files in the wheel, e.g.', n[:4])" "$W/wheel"
"$PY" -m pip install -q --no-deps --target "$W/site" "$W"/wheel/*.whl
cd "$W" && PYTHONPATH="$W/site" KVWRITE_EXT_CACHE="$W/cache" "$PY" - <<'PYEOF'
import torch, kvwrite
from kvwrite import _ext, backend
print("kvwrite from", kvwrite.__file__)
print("csrc found at", _ext.csrc_dir())
k = torch.randn(4, 2, 16)
cache = torch.zeros(2, 8, 2, 16)
kvwrite.store_kv(k, k, cache, cache.clone(), torch.tensor([0, 3, 9, -1]))
print("backends('cpu'):", kvwrite.backends("cpu"))
print("auto picks:", backend.resolve("auto", torch.device("cpu"), "store_kv"))
print("extension built in:", sorted(p.name for p in (__import__("pathlib").Path(__import__("os").environ["KVWRITE_EXT_CACHE"])).iterdir()))
PYEOF
rm -rf "$W"
