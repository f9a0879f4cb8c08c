#!/usr/bin/env python3
"""Writes every ```cpp block of a Markdown file to OUT_DIR/snippet_<n>.cpp, so
that the build compiles, and ctest runs, the README's examples exactly as a
reader copies them (they cannot drift from the library).

Usage: extract_snippets.py README.md OUT_DIR   (prints the files written)"""
import pathlib
import re
import sys


def main():
    src, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    blocks = re.findall(r"^```cpp\n(.*?)^```", src.read_text(), flags=re.S | re.M)
    names = []
    for n, body in enumerate(blocks, 1):
        if "int main(" not in body:
            sys.exit(f"{src}: C++ block {n} is not a complete program (no main): every README snippet must compile")
        path = out / f"snippet_{n}.cpp"
        text = f"// Extracted from {src.name}, C++ block {n}: edit the README, not this file.\n" + body
        if not path.exists() or path.read_text() != text:  # keep timestamps: no needless rebuilds
            path.write_text(text)
        names.append(str(path))
    for old in out.glob("snippet_*.cpp"):
        if str(old) not in names:
            old.unlink()
    print(";".join(names), end="")


if __name__ == "__main__":
    main()
