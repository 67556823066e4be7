#!/usr/bin/env python3
"""Do two host binaries carry the same GPU machine code?

    python3 scripts/compare_kernel_text.py BINARY_A BINARY_B

Extracts each binary's .nv_fatbin section (objcopy), walks the ELF cubins in
it and compares the bytes of every `.text.<kernel>` section by name, with the
anonymous-namespace hash (which nvcc derives from the source path) masked.
Used to show that a change leaves the kernels' machine code as it was (a
refactor, a build-system change): build both commits, compare their CLIs or
test binaries. Needs only objcopy, not cuobjdump. Exit 0 when the sets of (kernel, text) are equal, 1 otherwise.
Assumes uncompressed cubins in the fatbin (nvcc's default for sm_90a here).
"""
import hashlib
import re
import struct
import subprocess
import sys
import tempfile


def fatbin(path):
    with tempfile.NamedTemporaryFile() as tmp:
        subprocess.run(["objcopy", "-O", "binary", "--only-section=.nv_fatbin", path, tmp.name], check=True)
        return open(tmp.name, "rb").read()


def kernel_texts(blob):
    """[(kernel section name with the namespace hash masked, md5 of its bytes)], sorted."""
    out = []
    start = 0
    while (elf := blob.find(b"\x7fELF\x02", start)) >= 0:  # ELF64 cubins
        start = elf + 4
        shoff, = struct.unpack_from("<Q", blob, elf + 0x28)
        shentsize, shnum, shstrndx = struct.unpack_from("<HHH", blob, elf + 0x3A)

        def header(k):  # name, type, flags, addr, offset, size, ...
            return struct.unpack_from("<IIQQQQIIQQ", blob, elf + shoff + k * shentsize)

        names = elf + header(shstrndx)[4]
        for k in range(shnum):
            h = header(k)
            name = blob[names + h[0]:blob.index(b"\0", names + h[0])].decode()
            if name.startswith(".text."):
                name = re.sub(r"_GLOBAL__N__[0-9a-f]+_", "_GLOBAL__N__#_", name)
                out.append((name, hashlib.md5(blob[elf + h[4]:elf + h[4] + h[5]]).hexdigest()))
    return sorted(out)


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    a, b = (kernel_texts(fatbin(p)) for p in sys.argv[1:])
    if not a:
        sys.exit(f"no kernel text found in {sys.argv[1]}")
    differ = sorted(set(a) ^ set(b))
    print(f"{len(a)} / {len(b)} kernel text sections; {'identical' if not differ else 'DIFFER'}")
    for name, digest in differ:
        print(f"  {name[:110]} {digest}")
    return 0 if not differ else 1


if __name__ == "__main__":
    sys.exit(main())
