"""Rewrites a CUDA source file (.cu, .cuh) into C++ that the host compiler
builds against include/cuda_emulation.h. Three constructs change, nothing else:

- a launch ``kernel<<<grid, block[, shared[, stream]]>>>(args)`` becomes
  ``::cuda_emulation::launch(kernel, ::cuda_emulation::config(site, "kernel",
  grid, block[, shared[, stream]]), args)``;
- ``__shared__ T name[N];`` becomes a reference to the block's storage for that
  declaration (``auto& name = ::cuda_emulation::shared_variable<T[N], align>(site);``),
  and ``extern __shared__ T name[];`` a pointer to the dynamic shared memory;
- a ``__global__`` function's body starts with
  ``::cuda_emulation::enter_kernel(__PRETTY_FUNCTION__, site, max_threads,
  "param,names")``, where max_threads comes from its ``__launch_bounds__`` (0
  without one).

The output includes ``cuda_emulation.h`` first, then every line keeps its number
(``#line 1 "<source>"``), so messages of the compiler and of the emulation name
the original file and line.
``rewrite_tree`` also returns the inventory of kernels and launch sites that
the coverage report compares the launch log against.
"""

import json
import os
import re
import sys

IDENT = re.compile(r"[A-Za-z_][A-Za-z_0-9]*")


def code_mask(text):
    """The text with comments, string and character literals replaced by spaces
    (newlines kept), so that searches see code only and offsets stay the same."""
    out = list(text)
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            for k in range(i, j):
                out[k] = " "
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            for k in range(i, j):
                if out[k] != "\n":
                    out[k] = " "
            i = j
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            for k in range(i + 1, min(j, n)):
                if out[k] != "\n":
                    out[k] = " "
            i = j + 1
        else:
            i += 1
    return "".join(out)


def matching(mask, start, open_char, close_char):
    """Index of the bracket closing the one at `start`."""
    depth = 0
    for i in range(start, len(mask)):
        if mask[i] == open_char:
            depth += 1
        elif mask[i] == close_char:
            depth -= 1
            if depth == 0:
                return i
    raise ValueError(f"unbalanced {open_char!r} at offset {start}")


def line_of(text, offset):
    return text.count("\n", 0, offset) + 1


class Rewriter:
    def __init__(self, text, path):
        self.text = text
        self.path = path
        self.mask = code_mask(text)
        self.edits = []  # (start, end, replacement)
        self.kernels = []
        self.launches = []

    def replace(self, start, end, replacement):
        # Newlines of the replaced text are kept after the replacement: line numbers stay.
        self.edits.append((start, end, replacement + "\n" * self.text.count("\n", start, end)))

    def insert(self, at, text):
        self.edits.append((at, at, text))

    def tokens(self, word):
        for m in re.finditer(rf"\b{re.escape(word)}\b", self.mask):
            yield m.start()

    # -- launches ---------------------------------------------------------------
    def callee_start(self, end):
        """Start of the kernel expression that ends just before `end` (`name`,
        `ns::name`, `name<T, 4>`)."""
        i = end
        while i > 0 and self.mask[i - 1].isspace():
            i -= 1
        if self.mask[i - 1] == ">":
            depth = 0
            while i > 0:
                i -= 1
                if self.mask[i] == ">":
                    depth += 1
                elif self.mask[i] == "<":
                    depth -= 1
                    if depth == 0:
                        break
        while i > 0 and (self.mask[i - 1].isalnum() or self.mask[i - 1] in "_:"):
            i -= 1
        return i

    def rewrite_launches(self):
        for m in re.finditer(r"<<<", self.mask):
            open_at = m.start()
            close_at = self.mask.find(">>>", open_at + 3)
            callee_at = self.callee_start(open_at)
            args_open = close_at + 3
            while self.mask[args_open].isspace():
                args_open += 1
            if self.mask[args_open] != "(":
                raise ValueError(f"{self.path}:{line_of(self.text, open_at)}: launch without arguments")
            args_close = matching(self.mask, args_open, "(", ")")
            callee = " ".join(self.text[callee_at:open_at].split())
            empty = not self.mask[args_open + 1:args_close].strip()
            self.insert(callee_at, "::cuda_emulation::launch(")
            self.replace(open_at, open_at + 3,
                         f", ::cuda_emulation::config(NANFREE_CUDA_EMULATION_SITE, {json.dumps(callee)}, ")
            self.replace(close_at, close_at + 3, ")")
            self.replace(args_open, args_open + 1, "" if empty else ", ")
            self.launches.append({"site": f"{self.path}:{line_of(self.text, open_at)}",
                                  "callee": callee})

    # -- shared memory ------------------------------------------------------------
    def rewrite_shared(self):
        for at in self.tokens("__shared__"):
            start = at
            before = self.mask[:at].rstrip()
            is_extern = before.endswith("extern") and not (
                len(before) > 6 and (before[-7].isalnum() or before[-7] == "_"))
            if is_extern:
                start = len(before) - len("extern")
            end = self.mask.find(";", at)
            decl = self.text[at + len("__shared__"):end]
            align = None
            am = re.search(r"__align__\s*\(\s*([^)]*?)\s*\)", decl)
            if am:
                align = am.group(1)
                decl = decl[:am.start()] + decl[am.end():]
            decl = " ".join(decl.split())
            bracket = decl.find("[")
            head = decl if bracket < 0 else decl[:bracket]
            dims = "" if bracket < 0 else decl[bracket:]
            nm = list(IDENT.finditer(head))
            if not nm:
                raise ValueError(f"{self.path}:{line_of(self.text, at)}: cannot parse {decl!r}")
            name = nm[-1].group(0)
            type_ = head[:nm[-1].start()].strip()
            site = "NANFREE_CUDA_EMULATION_SITE"
            if is_extern:
                if dims.replace(" ", "") != "[]":
                    raise ValueError(f"{self.path}:{line_of(self.text, at)}: extern __shared__ "
                                     f"must be an array of unknown size: {decl!r}")
                targs = type_ + (f", {align}" if align else "")
                code = f"{type_}* const {name} = ::cuda_emulation::dynamic_shared<{targs}>({site})"
            else:
                targs = f"{type_}{dims}" + (f", {align}" if align else "")
                code = f"auto& {name} = ::cuda_emulation::shared_variable<{targs}>({site})"
            self.replace(start, end, code)

    # -- kernels -------------------------------------------------------------------
    def rewrite_kernels(self):
        for at in self.tokens("__global__"):
            # The declaration runs to its body's brace or to a semicolon.
            i = at
            depth = 0
            while i < len(self.mask):
                c = self.mask[i]
                if c == "(":
                    depth += 1
                elif c == ")":
                    depth -= 1
                elif depth == 0 and c in "{;":
                    break
                i += 1
            if self.mask[i] == ";":
                continue  # a declaration: the definition gets the call
            body = i
            head = self.mask[at:body]
            bounds = "0"
            lb = re.search(r"__launch_bounds__\s*\(", head)
            if lb:
                lb_open = at + lb.end() - 1
                lb_close = matching(self.mask, lb_open, "(", ")")
                args = split_top_level(self.mask[lb_open + 1:lb_close])
                bounds = args[0].strip()
                self.replace(at + lb.start(), lb_close + 1, "")
            params_close = self.mask.rfind(")", at, body)
            params_open = self.matching_open(params_close)
            name_match = list(IDENT.finditer(self.mask[at:params_open]))
            name = name_match[-1].group(0)
            names = [parameter_name(p) for p in split_top_level(self.mask[params_open + 1:params_close])]
            names = [n for n in names if n]
            self.insert(body + 1, " ::cuda_emulation::enter_kernel(__PRETTY_FUNCTION__, "
                        f"NANFREE_CUDA_EMULATION_SITE, {bounds}, {json.dumps(','.join(names))});")
            self.kernels.append({"name": name, "site": f"{self.path}:{line_of(self.text, at)}",
                                 "params": names})

    def matching_open(self, close):
        depth = 0
        for i in range(close, -1, -1):
            if self.mask[i] == ")":
                depth += 1
            elif self.mask[i] == "(":
                depth -= 1
                if depth == 0:
                    return i
        raise ValueError("unbalanced parenthesis")

    def result(self):
        out = self.text
        for start, end, replacement in sorted(self.edits, key=lambda e: (e[0], e[1]), reverse=True):
            out = out[:start] + replacement + out[end:]
        return f'#include <cuda_emulation.h>\n#line 1 "{self.path}"\n' + out


def split_top_level(text):
    """Splits at commas outside (), [], {} and <>."""
    parts, depth, current = [], 0, []
    for c in text:
        if c in "([{<":
            depth += 1
        elif c in ")]}>":
            depth -= 1
        if c == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(c)
    if "".join(current).strip():
        parts.append("".join(current))
    return parts


def parameter_name(param):
    param = param.split("=")[0]
    names = [m.group(0) for m in IDENT.finditer(param)
             if m.group(0) not in ("const", "volatile", "__restrict__")]
    return names[-1] if names else ""


def rewrite_text(text, path):
    r = Rewriter(text, path)
    r.rewrite_launches()
    r.rewrite_shared()
    r.rewrite_kernels()
    return r.result(), {"kernels": r.kernels, "launches": r.launches}


def rewrite_tree(source_dir, output_dir, relative_to):
    """Rewrites every .cu and .cuh of source_dir into output_dir (a .cu becomes
    .cpp; a .cuh keeps its name, so that includes find the rewritten header
    when output_dir's parent comes first on the include path). Files are only
    written when their content changes. Returns the inventory."""
    os.makedirs(output_dir, exist_ok=True)
    inventory = {"kernels": [], "launches": []}
    for name in sorted(os.listdir(source_dir)):
        if not name.endswith((".cu", ".cuh")):
            continue
        source = os.path.join(source_dir, name)
        with open(source) as f:
            text = f.read()
        shown = os.path.relpath(source, relative_to)
        out_text, found = rewrite_text(text, shown)
        for key in inventory:
            inventory[key] += found[key]
        target = os.path.join(output_dir, name[:-3] + ".cpp" if name.endswith(".cu") else name)
        old = None
        if os.path.exists(target):
            with open(target) as f:
                old = f.read()
        if old != out_text:
            with open(target, "w") as f:
                f.write(out_text)
    return inventory


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: rewrite.py <file.cu> <out.cpp>")
    with open(sys.argv[1]) as f:
        text, _ = rewrite_text(f.read(), sys.argv[1])
    with open(sys.argv[2], "w") as f:
        f.write(text)
