"""The layout README's Architecture section promises: one installed name, the registrar apart from the proxy."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("fleet", "proxy", "registrar", "sim")
NAMESPACE = "vllm_etcd_proxy"


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def _sources(*folders: str) -> list[Path]:
    return [p for folder in folders for p in sorted((ROOT / folder).rglob("*.py"))]


def test_nothing_imports_a_package_by_its_short_name() -> None:
    short = {
        f"{p.relative_to(ROOT)}: {name}"
        for p in _sources(*PACKAGES, "tests", "bench")
        for name in _imports(p)
        if name.split(".")[0] in PACKAGES
    }
    assert not short, f"import these as {NAMESPACE}.<package>: {sorted(short)}"


def test_the_registrar_and_the_shared_package_import_nothing_of_the_proxy() -> None:
    for folder, forbidden in (("registrar", ("proxy", "sim")), ("fleet", ("proxy", "registrar", "sim"))):
        wrong = {
            f"{p.relative_to(ROOT)}: {name}"
            for p in _sources(folder)
            for name in _imports(p)
            if any(name.startswith(f"{NAMESPACE}.{other}") for other in forbidden)
        }
        assert not wrong, f"{folder}/ must not import {forbidden}: {sorted(wrong)}"


def test_the_installed_name_links_every_package() -> None:
    for package in PACKAGES:
        link = ROOT / NAMESPACE / package
        assert link.is_symlink() and link.resolve() == ROOT / package, f"{link} must link ../{package}"


def test_node_state_is_written_by_the_pool_alone() -> None:
    from dataclasses import fields

    from vllm_etcd_proxy.proxy.discovery.pool import NodeState

    names = {f.name for f in fields(NodeState)}
    writes = set()
    for path in _sources("proxy"):
        if path.name == "pool.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, ast.AugAssign)
                else []
            )
            for target in targets:
                for item in target.elts if isinstance(target, ast.Tuple) else [target]:
                    if (
                        isinstance(item, ast.Attribute)
                        and item.attr in names
                        and not (isinstance(item.value, ast.Name) and item.value.id == "self")
                    ):
                        writes.add(f"{path.relative_to(ROOT)}:{item.lineno} .{item.attr}")
    assert not writes, f"write NodeState through Pool's methods: {sorted(writes)}"


def _module_level_imports(path: Path) -> set[str]:
    """Imports run when the module loads: module-level statements, not ``if TYPE_CHECKING:`` or function bodies."""
    names: set[str] = set()
    pending = list(ast.parse(path.read_text(), str(path)).body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.update({node.module} | {f"{node.module}.{alias.name}" for alias in node.names})
        elif isinstance(node, ast.If) and not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
            pending += node.body + node.orelse
        elif isinstance(node, ast.Try):
            pending += node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body]
    return names


def _proxy_import_graph() -> dict[str, set[str]]:
    modules = {
        NAMESPACE + "." + ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
        for p in _sources("proxy")
    }
    return {
        name: {m for m in _module_level_imports(path) if m in modules and m != name} for name, path in modules.items()
    }


def test_the_http_client_to_the_nodes_sits_below_serving_and_discovery() -> None:
    graph = _proxy_import_graph()
    above_upstream = (".serving", ".discovery", ".routing", ".operations")
    upward = {
        f"{m} -> {d}"
        for m, deps in graph.items()
        for d in deps
        if (".upstream" in m and any(room in d for room in above_upstream)) or (".discovery" in m and ".serving" in d)
    }
    assert not upward, f"a room imports a room above it: {sorted(upward)}"


def test_the_kv_cache_room_sits_below_routing_and_above_discovery() -> None:
    # kvcache/ learns its nodes from discovery's pool and feeds the kv-aware policy: it imports nothing of the
    # rooms that decide or serve, and discovery nothing of it.
    graph = _proxy_import_graph()
    above = (".routing", ".serving", ".operations", ".tenancy")
    upward = {
        f"{m} -> {d}"
        for m, deps in graph.items()
        for d in deps
        if (".kvcache" in m and any(room in d for room in above)) or (".discovery" in m and ".kvcache" in d)
    }
    assert not upward, f"a room imports a room above it: {sorted(upward)}"


def test_what_the_request_path_records_sits_below_every_room_that_records_it() -> None:
    rooms = (".serving", ".discovery", ".routing", ".operations", ".tenancy", ".upstream")
    upward = {
        f"{m} -> {d}"
        for m, deps in _proxy_import_graph().items()
        if ".telemetry" in m
        for d in deps
        if any(r in d for r in rooms)
    }
    assert not upward, f"telemetry/ imports a room above it: {sorted(upward)}"


def test_no_import_circles_among_the_proxy_modules() -> None:
    graph = _proxy_import_graph()
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            raise AssertionError("import circle: " + " -> ".join([*path[path.index(name) :], name]))
        if name in done:
            return
        for dep in sorted(graph[name]):
            visit(dep, [*path, name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])
