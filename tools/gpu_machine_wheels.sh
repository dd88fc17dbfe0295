#!/usr/bin/env bash
# Builds .whl/ (git-ignored): PyTriton 0.7.0 and the serving packages a GPU machine without a package index lacks,
# as CPython 3.12 x86-64 wheels that fit one 64 MiB transfer beside the repository. PyTriton's wheel is trimmed: only
# the Python 3.12 backend stub is kept, without the libpython 3.13 of the 3.13 stub, and ICU's 30 MB data library is
# replaced by an empty one (libxml2 links ICU; Triton converts no encoding through it here).
# On the GPU machine (bench/README.md, "On a GPU machine without a package index", says why each step):
#   python3 -m pip uninstall -y -q scipy scikit-learn
#   python3 -m pip install -q --no-index --no-deps --force-reinstall .whl/np/*.whl .whl/*.whl
set -euo pipefail
cd "$(dirname "$0")/.."
out=.whl
platforms=(--platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
           --platform manylinux_2_26_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
packages=(nvidia-pytriton==0.7.0 tritonclient==2.73.0 pyzmq==27.3.0 sh==2.4.0 geventhttpclient==2.6.1 gevent==26.9.0
          greenlet==3.5.6 python-rapidjson==1.25 omegaconf==2.3.0 zope.event==6.2 zope.interface==8.7 brotli==1.2.1
          importlib_metadata==10.2.0)
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
rm -rf "$out" && mkdir -p "$out/np"
download() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d "$1" "$2"
}
for package in "${packages[@]}"; do download "$out" "$package"; done
download "$out/np" numpy==1.26.4
python3 -m pip wheel -q --no-deps antlr4-python3-runtime==4.9.3 -w "$out"  # omegaconf's parser: no wheel on PyPI

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
wheel=$(realpath "$out"/nvidia_pytriton-*.whl)
python3 -m zipfile -e "$wheel" "$work/original"
icu=$(cd "$work/original" && ls nvidia_pytriton.libs/libicudata-*.so.*)
symbol=$(readelf --dyn-syms -W "$work/original/$icu" | awk '/icudt[0-9]+_dat/ {print $8; exit}')
printf '%s\n' \
  '/* ICU data library with no data in it: the one symbol libicuuc links to, an empty "ToCP" table. */' \
  '#include <stdint.h>' \
  'struct info { uint16_t size, reserved; uint8_t big_endian, charset, uchar_size, reserved_byte;' \
  '              uint8_t format[4], format_version[4], data_version[4]; };' \
  'struct header { uint16_t header_size; uint8_t magic1, magic2; struct info info; char padding[8];' \
  '                uint32_t count, reserved; uint32_t toc[2]; };' \
  "__attribute__((visibility(\"default\"))) const struct header ${symbol} = {" \
  '  32, 0xda, 0x27, {20, 0, 0, 0, 2, 0, {0x54, 0x6f, 0x43, 0x50}, {1, 0, 0, 0}, {0, 0, 0, 0}}, {0}, 0, 0, {0, 0}};' \
  > "$work/icudata.c"
gcc -shared -fPIC -O2 -Wl,-soname,"$(basename "$icu")" -o "$work/icudata.so" "$work/icudata.c"
# the same entries, their permissions kept, less the other Pythons' stubs and libpython, the ICU data replaced
python3 tools/trim_wheel.py "$wheel" "$work/trimmed.whl" "$icu" "$work/icudata.so"
mv "$work/trimmed.whl" "$wheel"
du -sh "$out"
