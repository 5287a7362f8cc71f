"""The sandbox's child: runs as `python -I -S _sandbox_child.py MODE MEMORY_BYTES CPU_S PPID`
with the untrusted source on stdin. Standard library only (it never imports gjax).

Before it reads the source it binds itself: SIGKILL when the parent dies, address space
MEMORY_BYTES, CPU seconds CPU_S (then SIGXCPU, at CPU_S + 1 SIGKILL), no file writes, no
new processes, no core files. Then, by MODE:
  calc    one arithmetic expression, evaluated by a walker that knows numbers, + - * / // % **,
          unary signs, parentheses and a few `math` functions and constants, nothing else;
          its value is printed.
  python  a Python snippet with curated builtins (no import, open, eval, exec, getattr...),
          no attribute starting with '_', no name starting with '__' (the ways out of a
          builtins-free exec go through such names, e.g. `().__class__`); what it prints
          is the output, and the value of a final expression is printed as in a notebook.
Exit status: 0 ok (stdout is the output), 1 the code raised (stderr: `Type: message`),
3 MemoryError. The parent turns signals and its own kills into `timeout` / `output`.
"""

import ast
import builtins
import contextlib
import ctypes
import math
import os
import resource
import signal
import sys

_FUNC_NAMES = "sqrt exp log log2 log10 sin cos tan asin acos atan floor ceil factorial gcd isqrt"
_FUNCS = {name: getattr(math, name) for name in _FUNC_NAMES.split()}
_FUNCS.update({"abs": abs, "round": round, "min": min, "max": max, "pow": pow})
_CONSTS = {"pi": math.pi, "e": math.e, "tau": math.tau}
_BINOPS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
    ast.FloorDiv: lambda a, b: a // b,
    ast.Mod: lambda a, b: a % b,
    ast.Pow: lambda a, b: a**b,
}
_UNARY = {ast.UAdd: lambda a: +a, ast.USub: lambda a: -a}


def _calc(node):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        return _BINOPS[type(node.op)](_calc(node.left), _calc(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_calc(node.operand))
    if isinstance(node, ast.Name) and node.id in _CONSTS:
        return _CONSTS[node.id]
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in _FUNCS
        and not node.keywords
    ):
        return _FUNCS[node.func.id](*[_calc(a) for a in node.args])
    raise ValueError(f"not allowed in an arithmetic expression: {ast.unparse(node)[:80]!r}")


_BUILTIN_NAMES = (
    "abs all any bool dict divmod enumerate filter float int len list map max min pow print "
    "range repr reversed round set sorted str sum tuple zip isinstance ValueError "
    "ZeroDivisionError ArithmeticError Exception"
)
_BUILTINS = {name: getattr(builtins, name) for name in _BUILTIN_NAMES.split()}


def _python(source):
    tree = ast.parse(source, mode="exec")
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            raise ValueError("import is not allowed")
        if isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            raise ValueError(f"attribute {node.attr!r} is not allowed")
        if isinstance(node, ast.Name) and node.id.startswith("__"):
            raise ValueError(f"name {node.id!r} is not allowed")
    scope = {"__builtins__": dict(_BUILTINS), "math": math}
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, "<tool>", "exec"), scope)
    if last is not None:
        value = eval(compile(ast.Expression(last.value), "<tool>", "eval"), scope)
        if value is not None:
            print(repr(value))


def _bind(memory_bytes, cpu_s, ppid):
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != ppid:  # the parent died before the signal was armed
        os._exit(1)
    limits = [
        (resource.RLIMIT_AS, memory_bytes, memory_bytes),
        (resource.RLIMIT_CPU, cpu_s, cpu_s + 1),
        (resource.RLIMIT_FSIZE, 0, 0),
        (resource.RLIMIT_CORE, 0, 0),
        (resource.RLIMIT_NPROC, 0, 0),
    ]
    for which, soft, hard in limits:
        with contextlib.suppress(ValueError, OSError):  # an already-lower hard limit stays
            resource.setrlimit(which, (soft, hard))


def main():
    mode, memory_bytes, cpu_s, ppid = (
        sys.argv[1],
        int(sys.argv[2]),
        int(sys.argv[3]),
        int(sys.argv[4]),
    )
    _bind(memory_bytes, cpu_s, ppid)
    sys.set_int_max_str_digits(0)  # a huge value is cut by the output bound, not by str()
    source = sys.stdin.read()
    try:
        if mode == "calc":
            print(_calc(ast.parse(source.strip(), mode="eval").body))
        else:
            _python(source)
        sys.stdout.flush()
    except MemoryError:
        os.write(2, b"MemoryError")
        os._exit(3)
    except Exception as e:  # noqa: BLE001 (the code's error is the tool's output)
        sys.stderr.write(f"{type(e).__name__}: {str(e)[:500]}")
        sys.stderr.flush()
        os._exit(1)


if __name__ == "__main__":
    main()
