"""vlft from its source tree, with no install step: for a device machine's Python as it is.

A lent device machine has its own Python (torch, transformers, peft, pluggy, click, pytest ...), no
package registry and no setuptools to be relied on, so ``pip install -e .`` cannot run there. vlft's
plugins (the built-in ones too) are found through the entry-point group ``vlft``, which needs
distribution metadata. Where no ``vlft`` distribution is installed, :func:`prepare` makes one inside
the checkout, in the git-ignored folder ``.device-site/``:

- ``vlft-<version>.dist-info/`` with ``METADATA`` and an ``entry_points.txt`` generated from
  ``pyproject.toml`` (``[project.entry-points.*]`` and ``[project.scripts]``), read with tomllib: no
  module name is written here, so a move inside the source tree needs only pyproject.toml updated;
- a symbolic link (a copy where links cannot be made) for each top-level package that
  ``[tool.setuptools.package-dir]`` maps elsewhere (``vlft_cuda -> plugins/cuda`` ...);

and puts ``.device-site`` and the repository root first on ``sys.path`` here and on ``PYTHONPATH`` for
the child processes (pytest, ``python -m vlft``, the bench scripts). Nothing is written outside the
checkout and no ``.pth`` file is used. It then checks, in a child process with that environment, that
pluggy's ``load_setuptools_entrypoints("vlft")`` registers every plugin pyproject.toml names.

An installed ``vlft`` whose ``vlft`` entry points match pyproject.toml is used as it is. One whose entry
points differ (an install made before modules moved) is shadowed by the source tree's metadata, which
comes first on the path.

    python bench/source_tree.py          # prepare, check, print the way taken and the PYTHONPATH
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SITE_NAME = ".device-site"
GROUP = "vlft"
INSTALLED = "installed"
SOURCE_TREE = "source-tree"


class SourceTreeError(Exception):
    """pyproject.toml and the source tree disagree, or the entry points do not load."""


@dataclass
class Way:
    """How vlft is made importable here: ``mode`` is ``installed`` or ``source-tree``."""

    mode: str
    line: str
    env: dict = field(default_factory=dict)  # to add to a child process's environment
    paths: list = field(default_factory=list)  # put first on sys.path / PYTHONPATH
    entry_points: dict = field(default_factory=dict)  # the "vlft" group, as pyproject.toml names it
    plugins: list = field(default_factory=list)  # what pluggy registered in a child process
    metadata: str = ""  # the dist-info or egg-info folder that was used

    def child_env(self, base: dict | None = None) -> dict:
        env = dict(os.environ if base is None else base)
        env.update(self.env)
        return env

    def as_dict(self) -> dict:
        return {"mode": self.mode, "line": self.line, "paths": [str(p) for p in self.paths],
                "metadata": self.metadata, "entry_points": self.entry_points, "plugins": self.plugins}


def _toml(path: Path) -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib
        except ModuleNotFoundError:
            raise SourceTreeError("reading pyproject.toml needs Python >= 3.11 (tomllib) or the tomli package") \
                from None
    with open(path, "rb") as f:
        return tomllib.load(f)


def read_project(repo: Path = REPO) -> dict:
    """What an install would take from pyproject.toml: name, version, entry points, package locations."""
    data = _toml(repo / "pyproject.toml")
    project = data.get("project", {})
    setuptools = data.get("tool", {}).get("setuptools", {})
    groups = {g: dict(eps) for g, eps in project.get("entry-points", {}).items()}
    if project.get("scripts"):
        groups["console_scripts"] = dict(project["scripts"])
    if project.get("gui-scripts"):
        groups["gui_scripts"] = dict(project["gui-scripts"])
    if GROUP not in groups:
        raise SourceTreeError(f"pyproject.toml has no [project.entry-points.{GROUP}] table")
    package_dir = dict(setuptools.get("package-dir", {}))
    packages = setuptools.get("packages", [])
    tops = {p.split(".")[0] for p in packages} if isinstance(packages, list) else set()
    tops |= {k for k in package_dir if k and "." not in k}
    tops |= {value.split(":")[0].strip().split(".")[0] for value in groups[GROUP].values()}
    return {"name": project.get("name", "vlft"), "version": project.get("version", "0+source"),
            "summary": project.get("description", ""), "requires_python": project.get("requires-python", ""),
            "dependencies": list(project.get("dependencies", [])), "groups": groups,
            "package_dir": package_dir, "top_level": sorted(tops)}


def package_sources(repo: Path, project: dict) -> dict[str, Path]:
    """Top-level package name -> its folder in the checkout (after package-dir)."""
    package_dir = project["package_dir"]
    nested = sorted(k for k in package_dir if "." in k)
    if nested:
        raise SourceTreeError(f"[tool.setuptools.package-dir] maps sub-packages ({', '.join(nested)}): "
                              "the source-tree way serves only top-level packages")
    root = repo / package_dir.get("", "")
    found = {}
    for name in project["top_level"]:
        src = repo / package_dir[name] if name in package_dir else root / name
        if not (src / "__init__.py").is_file() and not (src.with_suffix(".py")).is_file():
            raise SourceTreeError(f"pyproject.toml names the package {name!r}, but {src.relative_to(repo)} holds "
                                  "no __init__.py: update pyproject.toml after moving modules")
        found[name] = src if src.is_dir() else src.with_suffix(".py")
    return found


def _entry_points_txt(groups: dict) -> str:
    return "".join(f"[{g}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n" for g, eps in groups.items())


def _metadata(project: dict) -> str:
    lines = ["Metadata-Version: 2.1", f"Name: {project['name']}", f"Version: {project['version']}"]
    if project["summary"]:
        lines.append(f"Summary: {project['summary']}")
    if project["requires_python"]:
        lines.append(f"Requires-Python: {project['requires_python']}")
    lines += [f"Requires-Dist: {d}" for d in project["dependencies"]]
    return "\n".join(lines) + "\n"


def build_site(repo: Path = REPO, site: Path | None = None) -> tuple[Path, dict]:
    """(Re)write ``site``: the dist-info and the package links. Returns (site, project)."""
    site = site or repo / SITE_NAME
    project = read_project(repo)
    sources = package_sources(repo, project)
    if site.is_symlink() or site.is_file():
        site.unlink()
    elif site.exists():
        shutil.rmtree(site)
    site.mkdir(parents=True)
    (site / ".gitignore").write_text("*\n")  # never committed, whatever the checkout's .gitignore says
    dist_name = project["name"].replace("-", "_")
    info = site / f"{dist_name}-{project['version']}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(_metadata(project))
    (info / "entry_points.txt").write_text(_entry_points_txt(project["groups"]))
    (info / "top_level.txt").write_text("".join(f"{n}\n" for n in sorted(sources)))
    (info / "INSTALLER").write_text("bench/source_tree.py\n")
    for name, src in sources.items():
        if src.parent == repo:  # at its own name in the repository root: the root on the path serves it
            continue
        link = site / src.name if src.is_file() else site / name
        try:
            os.symlink(os.path.relpath(src, site), link, target_is_directory=src.is_dir())
        except OSError:  # a file system without links: a copy, made anew on every run
            (shutil.copytree if src.is_dir() else shutil.copy2)(src, link)
    return site, project


def installed() -> importlib.metadata.Distribution | None:
    try:
        return importlib.metadata.distribution(GROUP)
    except importlib.metadata.PackageNotFoundError:
        return None


def _where(dist) -> str:
    path = getattr(dist, "_path", None)  # PathDistribution: its .dist-info / .egg-info folder
    return str(path) if path is not None else "?"


# pluggy's own entry-point loading, one name at a time (the names pyproject.toml gives): a plugin of another
# installed distribution is left alone, and each one registered says which metadata served it
_PROBE = r"""
import json, sys
import pluggy
pm = pluggy.PluginManager("vlft")
for name in sys.argv[1:]:
    pm.load_setuptools_entrypoints("vlft", name=name)
served = {}
for plugin, dist in pm.list_plugin_distinfo():
    served[pm.get_name(plugin)] = str(getattr(getattr(dist, "_dist", dist), "_path", "?"))
print(json.dumps(served))
"""


def check_entry_points(way: Way, python: str = sys.executable) -> list[str]:
    """pluggy's ``load_setuptools_entrypoints("vlft")`` in a child with ``way``'s environment; raises
    :class:`SourceTreeError` unless it registers every plugin pyproject.toml names, each from the
    metadata ``way`` chose (``way.metadata``)."""
    # ``-c`` puts the working folder first on the path: this file's folder holds no package that could
    # serve vlft, so only the installed metadata or the paths given here can (-I and -P would drop
    # PYTHONPATH as well)
    proc = subprocess.run([python, "-c", _PROBE, *way.entry_points], env=way.child_env(), capture_output=True,
                          text=True, cwd=Path(__file__).resolve().parent, timeout=120)
    if proc.returncode != 0:
        raise SourceTreeError("pluggy could not load the vlft entry points:\n" + proc.stderr[-3000:])
    served = json.loads(proc.stdout.strip().splitlines()[-1])
    missing = sorted(set(way.entry_points) - set(served))
    if missing:
        raise SourceTreeError(f"pluggy did not register {missing} (named in pyproject.toml) through "
                              f"{way.metadata}; it registered {sorted(served)}")
    others = {n: m for n, m in served.items() if Path(m).resolve() != Path(way.metadata).resolve()}
    if others:
        raise SourceTreeError(f"pluggy loaded {sorted(others)} from other metadata than {way.metadata}: {others}")
    way.plugins = sorted(served)
    return way.plugins


def _found_at(name: str) -> Path | None:
    """Where ``import name`` would load the top-level package or module from, without running it."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0]).resolve()
    return Path(spec.origin).resolve() if spec.origin else None


def choose(wanted: dict, dist, site: Path, sources: dict[str, Path] | None = None,
           repo: Path | None = None) -> tuple[bool, str]:
    """(use the installed distribution ``dist``?, why not). It is used where its ``vlft`` entry points are
    the ones pyproject.toml names and its packages are this checkout's (``sources``: name -> folder, an
    editable install of it); not where it is the metadata this module generated in ``site``."""
    if dist is None:
        return False, "vlft not installed"
    where = Path(_where(dist))
    if where.parent.resolve() == site.resolve():
        return False, "vlft not installed"  # a previous run's metadata, found through an inherited PYTHONPATH
    if repo is not None and where.parent.resolve() == repo.resolve():
        # a vlft.egg-info in the checkout: what `pip install -e .` (`make install`) leaves there for *its*
        # Python; found here only because the checkout is on sys.path, it installs nothing in this one
        return False, "vlft not installed in this Python (the checkout's vlft.egg-info is another venv's)"
    have = {ep.name: ep.value for ep in dist.entry_points if ep.group == GROUP}
    if have != wanted:
        differ = sorted(k for k in {*have, *wanted} if have.get(k) != wanted.get(k))
        return False, (f"vlft installed at {where} but its entry points differ from pyproject.toml ("
                       + "; ".join(f"{k}: {have.get(k, '-')} installed, {wanted.get(k, '-')} in pyproject.toml"
                                   for k in differ) + ")")
    elsewhere = {name: at for name, src in (sources or {}).items()
                 if (at := _found_at(name)) is not None and at != src.resolve()}
    if elsewhere:
        return False, (f"vlft installed at {where} but not from this checkout ("
                       + ", ".join(f"{n} from {at}" for n, at in sorted(elsewhere.items())) + ")")
    return True, ""


def prepare(repo: Path = REPO, site: Path | None = None, check: bool = True, python: str = sys.executable,
            activate: bool = True) -> Way:
    """Make vlft importable with its plugins, in child processes (``Way.env``) and, with ``activate``, in
    this one (``sys.path``); see the module's docstring. Raises :class:`SourceTreeError`."""
    project = read_project(repo)
    wanted = project["groups"][GROUP]
    site = site or repo / SITE_NAME
    dist = installed()
    use, reason = choose(wanted, dist, site, package_sources(repo, project), repo)
    if use:
        way = Way(INSTALLED, f"vlft installed: using its metadata ({_where(dist)})", entry_points=wanted,
                  metadata=_where(dist))
        if check:
            check_entry_points(way, python)
        return way
    site, _ = build_site(repo, site)
    root = project["package_dir"].get("", "")
    paths = [site, repo, *([repo / root] if root else [])]
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in map(str, paths)]
    env = {"PYTHONPATH": os.pathsep.join([*map(str, paths), *inherited])}
    [info] = site.glob("*.dist-info")
    way = Way(SOURCE_TREE, f"{reason}: using the source tree via {site.name} (entry points from pyproject.toml)",
              env=env, paths=paths, entry_points=wanted, metadata=str(info))
    if activate:
        for path in reversed(paths):
            if str(path) in sys.path:
                sys.path.remove(str(path))
            sys.path.insert(0, str(path))
        importlib.invalidate_caches()
    if check:
        check_entry_points(way, python)
    return way


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--no-check", action="store_true", help="skip the pluggy check in a child process")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    try:
        way = prepare(check=not args.no_check)
    except SourceTreeError as e:
        print(f"source tree: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(way.as_dict(), indent=2))
    else:
        print(way.line)
        if way.plugins:
            print(f"pluggy registered: {', '.join(way.plugins)}")
        if way.env:
            print(f"PYTHONPATH={way.env['PYTHONPATH']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
