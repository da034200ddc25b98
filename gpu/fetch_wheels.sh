#!/usr/bin/env bash
# Fetch (here, with network) what gpu/check.sh needs on the GPU machine, which has none:
#   .whl/  slim flashinfer-python 0.7.2.post1 (sampling sources only: the full wheel is 62 MB and
#          the whole carried tree must stay under 64 MiB), apache-tvm-ffi, and the cp312 wheels
#          that sglang 0.5.23's hooked modules import beyond the machine's image
#   .gpu/  sglang_py.zip: sglang 0.5.23's Python modules without its Rust .so files; flashinfer/test_sampling.py:
#          flashinfer's own sampling tests (tests/utils/test_sampling.py at its release tag)
# flashinfer's sampling module is JIT-built on the GPU machine at first use (~100 s); copy the
# built sampling.so back into .gpu/flashinfer-jit/ to skip that on later calls (gpu/check.sh returns it
# as $OUT/sampling.so; flashinfer 0.7.2.post1 loads it from flashinfer/data/aot/sampling/ as an AOT module).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl .gpu /tmp/tpguard-fetch
PIP_PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
          --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
          --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64)
# sglang's wheel is cp311-only and flashinfer's pure Python: fetched as they are; tvm-ffi for the GPU's cp312
python3 -m pip download -q --no-deps -d /tmp/tpguard-fetch flashinfer-python==0.7.2.post1 sglang==0.5.23
python3 -m pip download -q --no-deps "${PIP_PLAT[@]}" -d /tmp/tpguard-fetch "apache-tvm-ffi>=0.1.11,<0.2"
cp /tmp/tpguard-fetch/apache_tvm_ffi-*.whl .whl/
python3 - <<'PY'
# The slim flashinfer wheel: drop cutlass and other kernels' CUDA sources (the sampling JIT spec,
# flashinfer/jit/sampling.py, compiles only these three against data/include, data/cccl and data/spdlog).
import base64, glob, hashlib, zipfile
src = glob.glob('/tmp/tpguard-fetch/flashinfer_python-0.7.2.post1-*.whl')[0]
dst = '.whl/flashinfer_python-0.7.2.post1-py3-none-any.whl'
keep = {'sampling.cu', 'renorm.cu', 'flashinfer_sampling_binding.cu'}
zin, zout = zipfile.ZipFile(src), zipfile.ZipFile(dst, 'w', zipfile.ZIP_DEFLATED)
rec = [n for n in zin.namelist() if n.endswith('.dist-info/RECORD')][0]
rows = []
for i in zin.infolist():
    n = i.filename
    rest = n[len('flashinfer/data/csrc/'):] if n.startswith('flashinfer/data/csrc/') else None
    if n == rec or n.startswith('flashinfer/data/cutlass/') or (
            rest is not None and ('/' in rest or (rest.endswith('.cu') and rest not in keep))):
        continue
    data = zin.read(n)
    zout.writestr(i, data)
    h = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()
    rows.append(f'{n},sha256={h},{len(data)}')
zout.writestr(rec, '\n'.join(rows + [f'{rec},,']) + '\n')
zout.close()
# sglang's Python modules (its wheel is cp311-only; the modules are pure Python)
sg = glob.glob('/tmp/tpguard-fetch/sglang-0.5.23-*.whl')[0]
with zipfile.ZipFile(sg) as zin, zipfile.ZipFile('.gpu/sglang_py.zip', 'w', zipfile.ZIP_DEFLATED) as zout:
    for i in zin.infolist():
        n = i.filename
        if n.startswith('sglang/') and not n.endswith('.so') and not n.startswith(('sglang/multimodal_gen/', 'sglang/test/')):
            zout.writestr(i, zin.read(n))
PY
python3 -m pip download -q --no-deps "${PIP_PLAT[@]}" -d .whl jiter==0.19.0 msgspec==0.23.0 pybase64==1.5.1 \
  pyzmq==27.3.0 setproctitle==1.3.8 orjson compressed-tensors==0.18.0 loguru==0.7.3 dill==0.4.1 distro==1.9.0 \
  openai==2.8.0 sniffio==1.3.1 fastapi==0.165.0 starlette==1.10.0 opentelemetry-api==1.45.2 uvicorn==0.54.0 \
  gguf==0.19.0 partial-json-parser==0.2.1.1.post7 ipython==9.18.1 ipython-pygments-lexers==1.1.1 jedi==0.20.1 \
  parso==0.8.7 traitlets==5.16.1 matplotlib-inline==0.2.2 stack-data==0.6.3 executing==2.3.0 asttokens==3.0.2 \
  pure-eval==0.2.4 pexpect==4.9.0 ptyprocess==0.7.0 prompt-toolkit==3.0.53 wcwidth==0.9.4 pydantic==2.14.4 \
  pydantic-core==2.50.5 annotated-types typing-inspection
# pytest-xdist: gpu/check.sh's tests phase runs the GPU tests 8 at a time when it is there
python3 -m pip download -q --no-deps "${PIP_PLAT[@]}" -d .whl pytest-xdist==3.8.0 execnet==2.1.2
# flashinfer's own sampling tests (tests/test_flashinfer_own.py runs its renorm functions): not in its wheel
# or sdist; from its repository at the release tag, when this machine can reach GitHub (else they skip)
mkdir -p .gpu/flashinfer
if curl -fsSL -o /tmp/tpguard-fetch/test_sampling.py \
    https://raw.githubusercontent.com/flashinfer-ai/flashinfer/v0.7.2.post1/tests/utils/test_sampling.py; then
  mv /tmp/tpguard-fetch/test_sampling.py .gpu/flashinfer/test_sampling.py
else
  echo "flashinfer's tests/utils/test_sampling.py not fetched: tests/test_flashinfer_own.py skips without it"
fi
du -sh .whl .gpu
