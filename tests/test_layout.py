"""The package's shape (README, module list): each concept in a module of a few hundred lines,
and Ray imported only where actors are made and driven (and by the Ray Serve application), so
that the cores, the recovery and elasticity decisions, the learner and the serving state run
and are tested without Ray."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "tidegraph"
MAX_LINES = 600
RAY_PACKAGES = ("actors", "orchestrator", "jobs")
RAY_MODULES = ("serving/app.py",)  # the Ray Serve application (the serving state needs no Ray)


def modules() -> list[Path]:
    found = sorted(PACKAGE.rglob("*.py"))
    assert len(found) > 50, found  # the package was found
    return found


def test_no_module_is_longer_than_600_lines():
    long = {str(p.relative_to(PACKAGE)): n for p in modules()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}  # fmt: skip
    assert long == {}


def imports_ray(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        if any(n == "ray" or n.startswith("ray.") for n in names):
            return True
    return False


def test_ray_is_imported_only_by_actors_orchestrator_jobs_and_the_serve_app():
    inside = [p for p in modules() if p.relative_to(PACKAGE).parts[0] in RAY_PACKAGES
              or p.relative_to(PACKAGE).as_posix() in RAY_MODULES]  # fmt: skip
    outside = [str(p.relative_to(PACKAGE)) for p in modules() if p not in inside and imports_ray(p)]
    assert outside == []
    assert any(imports_ray(p) for p in inside)  # the check sees Ray imports where they are
