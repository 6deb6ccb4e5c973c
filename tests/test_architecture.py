"""The package's shape, checked from the source: which module may import which.

- No import cycle, counting every import: at module level, inside functions, and those made
  only for type checking (a module that needs a caller's type declares a Protocol of what
  it uses, as checkpoint.py does for the engine).
- No module below the ``Client`` facade imports ``hybridps.client.client``, not even for
  type checking: the store, the mover, the groups, the optimizer, the tracer and the rest
  take their collaborators in their constructors.
- No module of the package is over 800 lines, no function over 80.
- No list of listeners grows outside a constructor: listeners are constructor arguments, or
  join the chunk-activity channel (memory/activity.py) from their own constructor and hear
  what their own switches say while training runs.
"""

import ast
import pathlib

import hybridps

ROOT = pathlib.Path(hybridps.__file__).parent


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for f in ROOT.rglob("*.py"):
        parts = f.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = f
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.Module, mods, *, module_level_only: bool):
    """Modules of the package that ``tree`` imports."""
    found = set()

    def targets(node):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith("hybridps"):
            subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in mods]
            return subs if len(subs) == len(node.names) else [node.module, *subs]
        if isinstance(node, ast.Import):
            return [a.name for a in node.names if a.name.startswith("hybridps")]
        return []

    def visit(body):
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found.update(t for t in targets(node) if t in mods)
            elif isinstance(node, ast.If) and _is_type_checking(node):
                if not module_level_only:
                    visit(node.body)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if not module_level_only:
                    for inner in ast.walk(node):
                        if isinstance(inner, (ast.Import, ast.ImportFrom)):
                            found.update(t for t in targets(inner) if t in mods)
            elif isinstance(node, (ast.If, ast.Try, ast.With)):
                for field in ("body", "orelse", "finalbody", "handlers"):
                    for child in getattr(node, field, []):
                        visit([child] if not isinstance(child, ast.ExceptHandler) else child.body)

    visit(tree.body)
    return found


def _graph(*, module_level_only: bool) -> dict[str, set[str]]:
    mods = _modules()
    graph = {}
    for name, path in mods.items():
        deps = _imports(ast.parse(path.read_text()), mods, module_level_only=module_level_only)
        deps.discard(name)
        # importing a submodule runs its package's __init__ first; that edge is not a design choice
        graph[name] = {d for d in deps if not name.startswith(d + ".")}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_imports_have_no_cycle():
    assert _cycles(_graph(module_level_only=False)) == []
    assert _cycles(_graph(module_level_only=True)) == []


def test_no_module_below_the_client_facade_imports_it():
    graph = _graph(module_level_only=False)
    below = set()
    todo = [d for d in graph["hybridps.client.client"]]
    while todo:  # everything client.py reaches
        m = todo.pop()
        if m not in below and m != "hybridps.client.client":
            below.add(m)
            todo.extend(graph[m])
    offenders = sorted(m for m in below if "hybridps.client.client" in graph[m])
    assert offenders == []
    # and the collaborators are below it, not beside it
    for m in ("chunks.store", "memory.mover", "sharding.groups", "optim.adam", "params.pending_grads", "memory.placement"):
        assert f"hybridps.client.{m}" in below


#: the client's wings, bottom first: a module imports only its own wing and those before it
WINGS = ("chunks", "memory", "sharding", "optim", "params")
#: the modules at the client's root, and the wings each may import
ROOT_MODULES = {
    "hybridps.client.client": set(WINGS) | {"rank_parts"},
    "hybridps.client.rank_parts": set(WINGS) | {"remote"},
    "hybridps.client.prefetch": {"chunks", "memory", "sharding"},
    "hybridps.client.remote": {"request_line", "lease_heartbeat", "held_back"},
    "hybridps.client.request_line": set(),
    "hybridps.client.lease_heartbeat": set(),
    "hybridps.client.held_back": set(),
    "hybridps.client.assembly": set(WINGS) | {"client", "prefetch", "deferred_init"},
    "hybridps.client.deferred_init": {"chunks", "client"},
    "hybridps.client": set(WINGS) | {"client", "assembly"},
}


def _wing(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["hybridps", "client"] else None


def test_client_wings_import_only_downwards():
    """chunks < memory < sharding < optim < params < client.py, every import counted (type-only
    and function-level included): no arrow up, none sideways into the root's modules."""
    graph = _graph(module_level_only=False)
    up = []
    for module, deps in graph.items():
        wing = _wing(module)
        if wing is None:
            continue
        for dep in deps:
            target = _wing(dep)
            if target is None:
                continue
            if module in ROOT_MODULES:
                allowed = ROOT_MODULES[module]
                if target not in allowed:
                    up.append(f"{module} -> {dep}")
            elif wing in WINGS:
                if target not in WINGS or WINGS.index(target) > WINGS.index(wing):
                    up.append(f"{module} -> {dep}")
    assert up == []


def test_every_client_module_sits_in_a_wing_or_the_root():
    stray = sorted(m for m in _modules() if _wing(m) is not None and _wing(m) not in WINGS and m not in ROOT_MODULES)
    assert stray == []


#: the most public names of the client the engine may use (see ``_engine_client_uses``)
ENGINE_CLIENT_NAMES = 15
#: what of ``hybridps/client/`` the engine imports: the facade (with ``build``) and the hooks
ENGINE_CLIENT_IMPORTS = {"hybridps.client", "hybridps.client.params.hooks"}


def _client_uses(source: str) -> tuple[set[str], list[str], list[str]]:
    """What ``source`` (the engine's) uses of its client, from the AST: the names read on
    ``self.client`` (or on a local bound to it or to one of its parts), the private names
    reached anywhere down such a chain, and every assignment (``=``, ``+=``, ``del``) to an
    attribute down such a chain."""
    tree = ast.parse(source)
    aliases: dict[str, list[str]] = {}

    def chain(node) -> list[str] | None:
        """``self.client.a.b`` -> ["a", "b"]; None where the chain does not start at the client."""
        names = []
        while isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id == "self" and node.attr == "client":
                return names[::-1]
            names.append(node.attr)
            node = node.value
        if isinstance(node, ast.Name) and node.id in aliases:
            return aliases[node.id] + names[::-1]
        return None

    for _ in range(2):  # locals bound to the client or to a part of it (an alias of an alias too)
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                path = chain(node.value)
                if path is not None:
                    aliases[node.targets[0].id] = path
    names: set[str] = set()
    private: set[str] = set()
    assigned: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            path = chain(node)
            if path:
                names.add(path[0])
                if any(p.startswith("_") for p in path):
                    private.add(".".join(path))
                if isinstance(node.ctx, (ast.Store, ast.Del)):
                    assigned.append(".".join(path))
    return names, sorted(private), assigned


def test_the_engine_uses_a_small_public_surface_of_the_client_and_assigns_none_of_it():
    names, private, assigned = _client_uses((ROOT / "engine.py").read_text())
    assert private == [] and assigned == []
    assert len(names) <= ENGINE_CLIENT_NAMES, sorted(names)


def test_the_engine_reaches_the_client_through_the_facade_and_the_hooks_only():
    graph = _graph(module_level_only=False)
    reached = {m for m in graph["hybridps.engine"] if m == "hybridps.client" or m.startswith("hybridps.client.")}
    assert reached <= ENGINE_CLIENT_IMPORTS, sorted(reached - ENGINE_CLIENT_IMPORTS)


def test_the_count_of_the_client_surface_sees_aliases_reach_ins_and_assignments():
    source = """
class Engine:
    def f(self):
        client = self.client
        guard = client.guard
        guard.read_cache = None
        self.client.in_backward = True
        self.client.hook_handles += [1]
        client._placeholder(client.param_dtype)
        return self.client.pending._waiting
"""
    names, private, assigned = _client_uses(source)
    assert names == {"guard", "in_backward", "hook_handles", "_placeholder", "param_dtype", "pending"}
    assert private == ["_placeholder", "pending._waiting"]
    assert sorted(assigned) == ["guard.read_cache", "hook_handles", "in_backward"]


MAX_MODULE_LINES = 800
MAX_FUNCTION_LINES = 80


def test_no_module_is_over_800_lines_and_no_function_over_80():
    long_modules, long_functions = [], []
    for name, path in _modules().items():
        source = path.read_text()
        if source.count("\n") > MAX_MODULE_LINES:
            long_modules.append((name, source.count("\n")))
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long_functions.append((f"{name}.{node.name}", lines))
    assert long_modules == [] and long_functions == []


def _listener_growth(tree: ast.Module) -> list[str]:
    """``<...>listeners.append/extend/insert(...)`` and ``<...>activity.join(...)`` calls
    outside an ``__init__``."""
    found = []

    def grows(call: ast.Call) -> bool:
        if not isinstance(call.func, ast.Attribute):
            return False
        owner = ast.unparse(call.func.value)
        return (call.func.attr in ("append", "extend", "insert") and owner.endswith("listeners")) or (
            call.func.attr == "join" and owner.endswith("activity")
        )

    def visit(node, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, child.name)
                continue
            if isinstance(child, ast.Call) and grows(child) and function != "__init__":
                found.append(f"{function}: {ast.unparse(child)}")
            visit(child, function)

    visit(tree, "<module>")
    return found


def test_no_list_of_listeners_grows_outside_a_constructor():
    grown = {name: calls for name, path in _modules().items() if (calls := _listener_growth(ast.parse(path.read_text())))}
    assert grown == {}
    example = "class A:\n    def __init__(self, fs):\n        self.listeners = []\n        self.listeners.extend(fs)\n"
    example += "    def on(self, fn):\n        self.tick_listeners.append(fn)\n"
    example += "class B:\n    def __init__(self, activity):\n        activity.join(self)\n"
    example += "    def later(self):\n        self.mover.activity.join(self)\n"
    assert _listener_growth(ast.parse(example)) == [
        "on: self.tick_listeners.append(fn)",
        "later: self.mover.activity.join(self)",
    ]
