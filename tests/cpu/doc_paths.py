#!/usr/bin/env python3
"""Every file path that the docs and the code comments name exists in the tree.

Usage: doc_paths.py REPO_ROOT      check the tree; exit 1 listing each missing path as file:line
       doc_paths.py --self-test    the checker on a small temporary tree: a missing path fails

What is checked:
- every *.md file, whole (text, links, code blocks);
- the comments of the source files under src/, include/, tests/, bench/, cli/, python/, scripts/,
  fuzz/, cmake/, examples/ and of the CMakeLists.txt files (// and /* */ in C, C++ and CUDA; # in
  Python, shell and CMake).
A token counts as a path when it has a known extension and either a '/' (a path: it must exist
relative to the repository root, relative to the naming file's folder, or, when it starts with no
top-level folder of the tree, as the tail of a file's path, e.g. dsaib/tensor.hpp) or a source
extension alone (a bare file name: some file of the tree must have that name).
"""
import os
import re
import subprocess
import sys
import tempfile

# Extensions that make a token a path when it contains a '/'.
PATH_EXTENSIONS = ("cuh", "cu", "hpp", "h", "cpp", "c", "py", "md", "sh", "cmake", "in", "txt",
                   "toml", "png", "dict")
# Extensions that make a bare name (no '/') a file of the tree.
BARE_EXTENSIONS = ("cuh", "cu", "hpp", "h", "cpp", "c", "py", "md", "sh", "cmake")

# Names that are not files of this tree, each with its reason. Keep it short: a path that should
# exist is fixed, not listed here.
ALLOWED = {
    # Headers of the CUDA toolkit.
    "cuda_runtime.h",
    # The reader's own program in the link commands of docs/api.md.
    "app.cpp", "app.c",
    # Files of other projects that the peer benchmarks (bench/peers/) load from the user's own
    # copy (.peers/, --tilelang-example, --megatron-dir): TileLang's DSA example and
    # Megatron-Core's TileLang kernels.
    "indexer_bwd.py", "index.py", "utils.py", "examples/dsa_sparse_finetune/indexer_bwd.py",
    "tilelang_indexer_loss.py", "tilelang_utils.py", "ops/tilelang_indexer_loss.py",
}
# Path prefixes of outputs: build trees and the folders that commands write.
OUTPUT_PREFIXES = ("build/", "build-", "$", "/", "~", "out/")

SOURCE_DIRS = ("src", "include", "tests", "bench", "cli", "python", "scripts", "fuzz", "cmake",
               "examples")
C_LIKE = (".c", ".cc", ".cpp", ".cu", ".cuh", ".h", ".hpp")
HASH_COMMENTS = (".py", ".sh", ".cmake", ".cmake.in")

TOKEN = re.compile(r"[A-Za-z0-9_.$~/+-]*[A-Za-z0-9_]\.(?:%s)\b" % "|".join(
    sorted(set(PATH_EXTENSIONS) | set(BARE_EXTENSIONS), key=len, reverse=True)))


def tree_files(root):
    """The files of the tree: git's list when root is a git checkout, else a walk."""
    try:
        out = subprocess.run(["git", "-C", root, "ls-files", "--cached", "--others",
                              "--exclude-standard"], capture_output=True, text=True, check=True)
        files = [f for f in out.stdout.splitlines() if os.path.isfile(os.path.join(root, f))]
        if files:
            return files
    except (OSError, subprocess.CalledProcessError):
        pass
    files = []
    for d, dirs, names in os.walk(root):
        dirs[:] = [x for x in dirs if not x.startswith((".", "build")) and x != "__pycache__"]
        files += [os.path.relpath(os.path.join(d, n), root) for n in names]
    return files


def comment_lines(path, text):
    """(line number, comment text) of a source file's comments."""
    out = []
    if path.endswith(C_LIKE):
        in_block = False
        for no, line in enumerate(text.splitlines(), 1):
            rest = line
            parts = []
            while rest:
                if in_block:
                    end = rest.find("*/")
                    parts.append(rest if end < 0 else rest[:end])
                    if end < 0:
                        rest = ""
                    else:
                        in_block, rest = False, rest[end + 2:]
                    continue
                # Skip string literals so that "a // b" is not a comment.
                m = re.search(r'"(?:\\.|[^"\\])*"|//|/\*', rest)
                if not m:
                    break
                if m.group(0) == "//":
                    parts.append(rest[m.end():])
                    break
                if m.group(0) == "/*":
                    in_block, rest = True, rest[m.end():]
                    continue
                rest = rest[m.end():]
            if parts:
                out.append((no, " ".join(parts)))
    elif path.endswith(HASH_COMMENTS) or os.path.basename(path) == "CMakeLists.txt":
        in_doc = False
        for no, line in enumerate(text.splitlines(), 1):
            s = line.strip()
            if path.endswith(".py") and (in_doc or s.startswith(('"""', "'''"))):
                # Docstrings count as comments.
                out.append((no, s))
                quotes = s.count('"""') + s.count("'''")
                if in_doc:
                    in_doc = quotes % 2 == 0
                else:
                    in_doc = quotes % 2 == 1
                continue
            m = re.search(r"(?:^|\s)#(?!include|!)(.*)$", line)
            if m:
                out.append((no, m.group(1)))
    return out


def checked_lines(root, rel):
    with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
        text = f.read()
    if rel.endswith(".md"):
        return list(enumerate(text.splitlines(), 1))
    return comment_lines(rel, text)


def is_checked(rel):
    if rel.endswith(".md"):
        return True
    top = rel.split("/", 1)[0]
    if os.path.basename(rel) == "CMakeLists.txt":
        return True
    return top in SOURCE_DIRS and rel.endswith(C_LIKE + HASH_COMMENTS)


def missing_paths(root):
    files = tree_files(root)
    present = set(files)
    names = {os.path.basename(f) for f in files}
    dirs = {d for f in files for d in [os.path.dirname(f)] if d}
    dirs |= {"/".join(d.split("/")[:i]) for d in list(dirs) for i in range(1, d.count("/") + 1)}
    tops = {f.split("/", 1)[0] for f in files if "/" in f}
    problems = []
    for rel in sorted(files):
        if not is_checked(rel):
            continue
        base = os.path.dirname(rel)
        for no, line in checked_lines(root, rel):
            line = re.sub(r"https?://\S+", " ", line)  # web addresses are not tree paths
            for m in TOKEN.finditer(line):
                token = m.group(0).strip(".")
                if m.start() > 0 and line[m.start() - 1] in "<>{*":
                    continue  # placeholders and globs: <family>_kernel.cuh, tests/{cpu,gpu}/x.cpp, *_backend.cu
                if m.end() < len(line) and line[m.end()] in ">}*(":
                    continue  # a call such as cudaFoo.cu(…) or a templated name
                if token in ALLOWED or token.startswith(OUTPUT_PREFIXES):
                    continue
                if token + ".in" in present or token + ".in" in names:
                    continue  # written by configure_file from the .in file of the tree
                if re.fullmatch(r"[A-Z][A-Z_]*", re.split(r"[/.]", token, 1)[0]) and token not in names:
                    continue  # a placeholder: OUTDIR/..., O/..., DIR/..., PATH/TO/..., FILE.md
                if "/" in token:
                    t = token[2:] if token.startswith("./") else token
                    candidates = {t, os.path.normpath(os.path.join(base, t))}
                    if any(c in present or c in dirs for c in candidates):
                        continue
                    if t.split("/", 1)[0] not in tops and any(
                            f.endswith("/" + t) for f in files):
                        continue
                else:
                    ext = token.rsplit(".", 1)[1]
                    if ext not in BARE_EXTENSIONS or token in names:
                        continue
                problems.append(f"{rel}:{no}: {token}")
    return problems


def self_test():
    with tempfile.TemporaryDirectory() as root:
        os.makedirs(os.path.join(root, "src", "a"))
        os.makedirs(os.path.join(root, "docs"))
        with open(os.path.join(root, "src", "a", "kernel.cuh"), "w") as f:
            f.write('// see helper.cuh and src/a/kernel.cuh\nint x = 0;  // "gone.cuh" below\n'
                    'const char* s = "missing_in_a_string.cuh";\n/* two\n lines: old_name.cu */\n')
        with open(os.path.join(root, "docs", "a.md"), "w") as f:
            f.write("# A\n\n[b](b.md), `src/a/kernel.cuh`, `build/out.md`, `src/a/moved.cuh`\n"
                    "`<name>_kernel.cuh`, `*_backend.cu`, `OUTDIR/log.md`\n")
        with open(os.path.join(root, "docs", "b.md"), "w") as f:
            f.write("[a](a.md#a), [tree](../src/a/kernel.cuh)\n")
        os.makedirs(os.path.join(root, "scripts"))
        with open(os.path.join(root, "scripts", "run.sh"), "w") as f:
            f.write("#!/bin/sh\n# runs src/a/kernel.cuh's tests, then gone.sh\n")
        with open(os.path.join(root, "scripts", "tool.py"), "w") as f:
            # (the comment's path is assembled, so that this file's own comment scan does not see it)
            f.write('"""Reads docs/a.md and docs/c.md."""\nX = "src/missing.cuh"  # see b' + '.md\n')
        got = missing_paths(root)
        want = ["docs/a.md:3: src/a/moved.cuh", "scripts/run.sh:2: gone.sh",
                "scripts/tool.py:1: docs/c.md", "src/a/kernel.cuh:1: helper.cuh",
                "src/a/kernel.cuh:2: gone.cuh", "src/a/kernel.cuh:5: old_name.cu"]
        if got != want:
            print("self-test FAILED\n  got:  %s\n  want: %s" % (got, want))
            return 1
        with open(os.path.join(root, "src", "a", "kernel.cuh"), "w") as f:
            f.write("// see src/a/kernel.cuh\n")
        with open(os.path.join(root, "docs", "a.md"), "w") as f:
            f.write("[b](b.md)\n")
        for name in ("run.sh", "tool.py"):
            os.remove(os.path.join(root, "scripts", name))
        if missing_paths(root):
            print("self-test FAILED: a clean tree reported %s" % missing_paths(root))
            return 1
    print("self-test passed: missing paths are reported, a clean tree passes")
    return 0


def main(argv):
    if argv[1:] == ["--self-test"]:
        return self_test()
    if len(argv) != 2:
        print(__doc__)
        return 2
    problems = missing_paths(argv[1])
    for p in problems:
        print(p)
    if problems:
        print("%d path(s) named in docs or comments do not exist in the tree" % len(problems))
        return 1
    print("every path named in docs and comments exists")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
