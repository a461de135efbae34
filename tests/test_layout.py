"""The package's layout (docs/guide/design.md, "Package layout"): imports point downwards only.

Every import of a `tf_adasum` module, at module level or inside a function, is
read from the source (no import runs); each module has a layer, and a module
may import only modules of lower layers (or, inside one package, of lower
sub-layers). mpi4py and matplotlib/tensorboard are never imported at module
level; the launcher imports nothing of ours but its own modules.
"""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "tf_adasum"

#: Lower numbers sit lower. Modules of one layer never import each other.
LAYERS = {
    "reference": 0,
    "native.build": 0,
    "ops": 1,
    "combiners": 2,
    "tree.buckets": 2.75,  # over ops: below the tree
    "tree.communicator": 2.5,  # the interface the tree asks of a transport (TF only): below both
    "tree.topology": 2.75,  # which ranks meet at which level (over reference): below the tree
    "tree.exchanges": 2.875,  # how one process's ranks reach their partners: over tree.topology
    "tree.rvh": 3,
    "comm.cluster": 2.5,  # reads device strings and cluster specs: below every transport
    "comm.collective": 3,  # over comm.cluster and comm.collective_keys
    "comm.collective_keys": 2.5,  # group and instance keys: below every transport that draws them
    "comm.compression": 3,
    "comm.ordering": 3,
    "comm.mpi_transport": 3.5,  # over comm.ordering
    "comm.sockets": 3.5,  # over comm.ordering and comm.socket_link
    "comm.socket_link": 3,  # below comm.sockets
    "comm.socket_communicator": 3.75,  # over comm.sockets and comm.collective_keys
    "comm.socket_setup": 3.75,  # over comm.sockets: the socket transport's settings and set-up
    "comm.socket_listener": 3,  # below comm.sockets
    "comm.mpi_communicator": 3.75,  # over comm.mpi_transport
    "engines.base": 4,
    "engines.mpi_native": 4,
    "engines.tf": 5,
    "engines.simulated": 5,
    "engines.mpi": 5,
    "engines.agreement": 4.5,  # what processes must agree on, over any small all-gather: over engines.base
    "engines.workers": 5,  # over comm.collective and engines.base: the workers of a cluster as processes
    "engines.select": 6,
    "cross_device_ops": 7,
    "processes": 7,  # which process, how many, a sum over them: over engines.tf and engines.select
    "step.adacons": 7,
    "step.diagnostics": 7,
    "step.keras_step": 7,
    "step.local_steps": 7,
    "step.settings": 7,
    "step.members": 7,
    "resume.folder": 0,  # the backup folder's files (standard library and numpy)
    "resume.notice": 0,  # a preemption notice caught (standard library and the launcher's constants)
    "resume.save": 7.5,  # one backup by every process together (over resume.folder and resume.replica_states)
    "resume.replica_states": 7.25,  # each replica's copies of the optimizer's variables (over step.keras_step)
    "step.combine": 7.5,  # over step.adacons and step.settings
    "step.replica_loop": 7.75,  # SimulatedReplicas' replicas in this process: over step.combine and engines
    "optimizer": 8,
    "simulation": 8,  # beside the optimizer: the same step, every replica in one process
    "callbacks": 9,
    "backup": 9,
    "mpi": 9,
    "compat": 9,
    "cli": 11,
}
EVAL_LAYER = 10  # tf_adasum.eval.*: the evaluation, on top (its modules may import each other)
#: Standard library only: import nothing of ours but the launcher's modules (tf_adasum/launcher/).
STANDALONE = {
    "launch",
    "launcher.children",
    "launcher.elastic",
    "launcher.helper",
    "launcher.mpirun",
    "launcher.startup_log",
    "launcher.tf_config",
}
PACKAGE_INITS = {"", "comm", "engines", "eval", "launcher", "native", "resume", "step", "tree"}


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        name = ".".join(p for p in parts if p != "__init__")
        if name.startswith("eval.") and name != "eval.__main__":
            yield name, path
        elif name not in PACKAGE_INITS and name != "eval.__main__":
            yield name, path


def _layer(name: str) -> int:
    if name in STANDALONE:
        return -1  # imports nothing of ours, so anything may import it
    if name.startswith("eval"):
        return EVAL_LAYER
    return LAYERS[name]


def _imports(path: pathlib.Path):
    """(module imported, line, at module level) for every import in `path`."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    top_level = {id(node) for node in tree.body}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            yield name, node.lineno, id(node) in top_level


def _ours(imported: str) -> str | None:
    """The tf_adasum module an import names (None for other packages and for
    names that are functions or classes rather than modules)."""
    if not imported.startswith("tf_adasum."):
        return None
    name = imported[len("tf_adasum.") :]
    while name and name not in LAYERS and not name.startswith("eval") and name not in STANDALONE:
        name = name.rpartition(".")[0]
    return name or None


def test_every_module_has_a_layer():
    unknown = [
        name for name, _ in _modules() if name not in LAYERS and name not in STANDALONE and not name.startswith("eval")
    ]
    assert not unknown, f"give these modules a layer in tests/test_layout.py: {unknown}"


@pytest.mark.parametrize("name, path", list(_modules()), ids=lambda v: v if isinstance(v, str) else "")
def test_imports_point_downwards(name, path):
    for imported, line, _ in _imports(path):
        target = _ours(imported)
        if target is None or target == name:
            continue
        assert name not in STANDALONE or target.startswith("launcher."), (
            f"tf_adasum.{name} must import nothing of ours but the launcher's modules (line {line}: {imported})"
        )
        both_eval = name.startswith("eval") and target.startswith("eval")
        assert both_eval or name in STANDALONE or _layer(target) < _layer(name), (
            f"tf_adasum.{name} (layer {_layer(name)}) imports tf_adasum.{target} (layer {_layer(target)}) "
            f"at line {line}: imports must point downwards (docs/guide/design.md, 'Package layout')"
        )


@pytest.mark.parametrize("name, path", list(_modules()), ids=lambda v: v if isinstance(v, str) else "")
def test_optional_packages_are_imported_lazily(name, path):
    for imported, line, top_level in _imports(path):
        root = imported.split(".")[0]
        if root in ("mpi4py", "matplotlib", "tensorboard"):
            assert not top_level, f"tf_adasum.{name} imports {imported} at module level (line {line})"


def _reachable() -> dict[str, set[str]]:
    """For each module, every module of ours it imports, directly or through others."""
    direct = {
        name: {target for imported, _, _ in _imports(path) if (target := _ours(imported)) not in (None, name)}
        for name, path in _modules()
    }
    reach = {}
    for name in direct:
        seen, todo = set(), list(direct[name])
        while todo:
            module = todo.pop()
            if module not in seen:
                seen.add(module)
                todo.extend(direct.get(module, ()))
        reach[name] = seen
    return reach


#: Modules are meant to stay under about 400 lines (docs/guide/design.md, "Package layout"); this is the hard stop.
MAX_MODULE_LINES = 480


def test_no_source_file_is_much_over_400_lines():
    sources = [p for p in sorted(PACKAGE.rglob("*")) if p.suffix in (".py", ".h", ".cc")]
    lengths = {str(p.relative_to(PACKAGE)): len(p.read_text("utf-8").splitlines()) for p in sources}
    long = {name: n for name, n in lengths.items() if n > MAX_MODULE_LINES}
    assert not long, f"over {MAX_MODULE_LINES} lines: {long}; split by role (docs/guide/design.md)"


def test_the_layers_are_the_design():
    """The imports themselves (not the LAYERS table) follow the design page: along
    eval/cli -> callbacks, mpi helpers -> optimizer -> keras_step, adacons,
    diagnostics, cross_device_ops -> engines -> comm, rvh -> combiners -> ops
    -> reference, no module reaches one above it through any chain of imports,
    the transports reach no engine and no launcher, and nothing reaches the command line."""
    chain = ["reference", "ops", "combiners", "tree.rvh", "engines.base", "cross_device_ops", "optimizer", "callbacks"]
    reach = _reachable()
    for i, lower in enumerate(chain):
        above = [upper for upper in chain[i + 1 :] if upper in reach[lower]]
        assert not above, f"tf_adasum.{lower} reaches {above}, above it (docs/guide/design.md, 'Package layout')"
    assert "mpi" not in reach["optimizer"]  # the MPI helpers sit above the optimizer
    for name, reached in reach.items():
        if name.startswith("comm."):
            above = ("engines", "cross_device_ops", "optimizer", "launch", "launcher")
            upward = sorted(m for m in reached if m.split(".")[0] in above)
            assert not upward, f"tf_adasum.{name} (a transport) reaches {upward}"
        if not name.startswith("eval") and name != "cli":
            top = sorted(m for m in reached if m.startswith("eval") or m == "cli")
            assert not top, f"tf_adasum.{name} reaches the command line or the evaluation: {top}"
