"""The share of annotated functions in plugins/, per file and in all; fails under the floor (make typecheck).

A function counts as annotated when its return and every parameter except a method's self/cls are
annotated, inline or with a `# type: (...) -> ...` comment. Generated code (the gRPC stubs) is left out.
"""

import argparse
import ast
import sys
from pathlib import Path
from typing import Iterator, List, Tuple

ROOT = Path(__file__).resolve().parent.parent
EXCLUDED = ("plugins/plugin_utils/_mux/agent_pb/",)
FLOOR = 100.0  # every plugin file is annotated (mypy: disallow_untyped_defs over plugins.*)

FunctionNode = (ast.FunctionDef, ast.AsyncFunctionDef)


def functions(tree: ast.AST) -> Iterator[Tuple[ast.AST, bool]]:
    """Every function of a module with whether it is a method (its first parameter is the instance or class)."""
    def visit(node: ast.AST, in_class: bool) -> Iterator[Tuple[ast.AST, bool]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, FunctionNode):
                is_static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in child.decorator_list)
                yield child, in_class and not is_static
                yield from visit(child, False)
            elif isinstance(child, ast.ClassDef):
                yield from visit(child, True)
            else:
                yield from visit(child, in_class)
    return visit(tree, False)


def is_annotated(fn: "ast.FunctionDef | ast.AsyncFunctionDef", method: bool) -> bool:
    if fn.type_comment:
        return True
    args = fn.args
    params = args.posonlyargs + args.args
    if method and params:
        params = params[1:]
    params = params + args.kwonlyargs + [a for a in (args.vararg, args.kwarg) if a is not None]
    return fn.returns is not None and all(p.annotation is not None for p in params)


def measure(path: Path) -> Tuple[int, int, List[str]]:
    """(functions, annotated, names of the unannotated) of one file."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path), type_comments=True)
    total = typed = 0
    missing = []
    for fn, method in functions(tree):
        total += 1
        if is_annotated(fn, method):  # type: ignore[arg-type]
            typed += 1
        else:
            missing.append("%s:%d" % (fn.name, fn.lineno))  # type: ignore[attr-defined]
    return total, typed, missing


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--floor", type=float, default=FLOOR, help="the share (percent) under which this fails")
    parser.add_argument("--missing", action="store_true", help="name each unannotated function")
    parser.add_argument("--quiet", action="store_true", help="only the total line")
    opts = parser.parse_args()
    files = sorted(p for p in (ROOT / "plugins").rglob("*.py")
                   if not any(str(p.relative_to(ROOT)).startswith(e) for e in EXCLUDED))
    all_total = all_typed = 0
    for path in files:
        total, typed, missing = measure(path)
        all_total += total
        all_typed += typed
        if total and not opts.quiet:
            print("%5.1f%% %4d/%-4d %s" % (100.0 * typed / total, typed, total, path.relative_to(ROOT)))
            if opts.missing and missing:
                print("        not annotated: " + ", ".join(missing))
    share = 100.0 * all_typed / all_total if all_total else 100.0
    print("%5.1f%% %4d/%-4d functions in plugins/ annotated (floor %.0f%%)" % (share, all_typed, all_total, opts.floor))
    if share < opts.floor:
        print("FAILED: annotate the functions above (hack/typed_share.py --missing names them)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
