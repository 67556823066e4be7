#!/usr/bin/env python3
"""Do two host binaries carry the same GPU machine code?

    python3 scripts/compare_kernel_text.py [--allow-new] [--ignore-names] BINARY_A BINARY_B

With --allow-new, kernels only in B (new ones) are listed but pass: the check
is then that every kernel of A is in B with the same bytes.
With --ignore-names, sections are compared by their bytes alone, as multisets:
a renamed type, namespace or source file changes a kernel's mangled name but
not its machine code, so a rename passes and any change of code fails.

Extracts each binary's .nv_fatbin section (objcopy), walks the ELF cubins in
it and compares the bytes of every `.text.<kernel>` section by name, with the
anonymous-namespace hash (which nvcc derives from the source path) masked.
Used to show that a change leaves the kernels' machine code as it was (a
refactor, a build-system change): build both commits, compare their CLIs or
test binaries. Needs only objcopy, not cuobjdump. Exit 0 when the sets of (kernel, text) are equal, 1 otherwise,
2 for a usage error or an input that is no CUDA host binary (missing, unreadable, no kernels).
Assumes uncompressed cubins in the fatbin (nvcc's default for sm_90a here).
"""
import hashlib
import os
import re
import struct
import subprocess
import sys
import tempfile


def bad_input(message):
    """A usage error or an input that is no CUDA host binary: exit 2, apart from 1 (the kernels differ)."""
    print(f"compare_kernel_text: {message}", file=sys.stderr)
    sys.exit(2)


def fatbin(path):
    """The .nv_fatbin section of the host binary `path`; exits with 2, naming the
    file, where it is missing or objcopy cannot read it."""
    if not os.path.exists(path):
        bad_input(f"{path}: no such file")
    if not os.path.isfile(path):
        bad_input(f"{path}: not a regular file")
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "fatbin")
        r = subprocess.run(["objcopy", "-O", "binary", "--only-section=.nv_fatbin", path, out],
                           capture_output=True, text=True)
        if r.returncode != 0 or not os.path.isfile(out):
            bad_input(f"{path}: objcopy could not read it ({r.stderr.strip()})")
        return open(out, "rb").read()


def mask_anonymous_namespace(name):
    """nvcc names an anonymous namespace _GLOBAL__N__<hash>_<n>_<file name, n chars>_<8 hex>: the
    first hash follows the source path, the last the translation unit's first external
    definition. Both are masked; the file name stays."""
    def mask(m):
        n = int(m.group(1))
        rest = m.group(2)
        return f"_GLOBAL__N__#_{n}_{rest[:n]}_#" + rest[n + 1 + 8:]
    return re.sub(r"_GLOBAL__N__[0-9a-f]+_(\d+)_(.*)", mask, name)


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
                name = mask_anonymous_namespace(name)
                out.append((name, hashlib.md5(blob[elf + h[4]:elf + h[4] + h[5]]).hexdigest()))
    return sorted(out)


def compare_by_text(a, b, allow_new):
    """The multisets of section bytes (digests) of A and B; names only in the report."""
    from collections import Counter
    ca, cb = Counter(d for _, d in a), Counter(d for _, d in b)
    missing = ca - cb  # in A, not in B with the same bytes
    added = cb - ca
    differ = bool(missing) or (bool(added) and not allow_new)
    print(f"{len(a)} / {len(b)} kernel text sections, compared by bytes alone; "
          f"{'identical' if not missing and not added else 'DIFFER' if differ else 'A in B unchanged'}"
          f" ({sum(missing.values())} of A's not in B, {sum(added.values())} only in B)")
    for name, digest in a:
        if digest in missing:
            print(f"  only in A: {name[:100]} {digest}")
    for name, digest in b:
        if digest in added:
            print(f"  only in B: {name[:100]} {digest}")
    return 1 if differ else 0


def main():
    args = sys.argv[1:]
    allow_new = "--allow-new" in args
    ignore_names = "--ignore-names" in args
    args = [x for x in args if x not in ("--allow-new", "--ignore-names")]
    if len(args) != 2:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    texts = []
    for p in args:
        try:
            t = kernel_texts(fatbin(p))
        except (struct.error, ValueError, UnicodeDecodeError) as e:
            bad_input(f"{p}: its .nv_fatbin is not a well-formed set of cubins ({e})")
        if not t:
            bad_input(f"{p}: no kernel text found (no CUDA kernels in its .nv_fatbin)")
        texts.append(t)
    a, b = texts
    if ignore_names:
        return compare_by_text(a, b, allow_new)
    changed = sorted(set(a) - set(b))  # in A, and not in B with the same text
    added = sorted(set(b) - set(a))
    differ = changed if allow_new else sorted(set(a) ^ set(b))
    print(f"{len(a)} / {len(b)} kernel text sections; {'identical' if not differ else 'DIFFER'}"
          + (f" ({len(a) - len(changed)} of A's in B unchanged, {len(added)} only in B)" if allow_new else ""))
    for name, digest in differ:
        print(f"  {name[:110]} {digest}")
    if allow_new:
        for name, digest in added:
            print(f"  only in B: {name[:100]} {digest}")
    return 0 if not differ else 1


if __name__ == "__main__":
    sys.exit(main())
