"""The README's commands and tables agree with what the build and the release really use."""

import re
import shlex
from pathlib import Path

import pytest

from aotinfer._arch import RELEASE_ARCH_LISTS, release_arch_list

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def setup_commands():
    block = re.search(r"^<!-- setup -->\n```bash\n(.*?)```\n<!-- /setup -->$", README, re.S | re.M)
    assert block, "README.md needs its <!-- setup --> block (.ci/run runs it)"
    return [shlex.split(line, comments=True) for line in block.group(1).splitlines() if line.strip()]


def test_setup_installs_the_build_requirements_before_building():
    commands = setup_commands()
    with open(ROOT / "pyproject.toml", "rb") as f:
        requires = tomllib.load(f)["build-system"]["requires"]
    needed = sorted(r for r in requires if ";" not in r)  # tomli: Python < 3.11 only
    tools = next(c for c in commands if c[:2] == ["pip", "install"] and "scikit-build-core" in " ".join(c))
    build = next(i for i, c in enumerate(commands) if "--no-build-isolation" in c)
    narrowed = next(i for i, c in enumerate(commands) if c and c[0] == "export" and "AOTINFER_CUDA_ARCH_LIST" in c[1])
    assert sorted(t for t in tools[2:] if t.startswith(("scikit", "apache", "nvidia"))) == needed
    assert commands.index(tools) < build and narrowed < build  # tools and a narrow arch list first
    assert ["pip", "install", "torch", "--index-url", "https://download.pytorch.org/whl/cpu"] in commands


def test_supported_gpus_table_matches_the_release_lists():
    table = README[README.index("## Supported GPUs"):]
    rows = re.findall(r"^\| `([^`]+)` \| [^|]+ \| ([^|]+) \|$", table.split("\n\n", 2)[1], re.M)
    listed = {arch: where.strip() for arch, where in rows}
    all_archs = {a for major in RELEASE_ARCH_LISTS for a in release_arch_list(major, "aarch64").split()}
    assert set(listed) == all_archs
    for arch, where in listed.items():
        in_12, in_13 = arch in RELEASE_ARCH_LISTS[12].split(), arch in RELEASE_ARCH_LISTS[13].split()
        x86 = arch in release_arch_list(13, "x86_64").split() or arch in release_arch_list(12, "x86_64").split()
        expected = "both" if in_12 and in_13 and x86 else None
        if expected:
            assert where == "both", arch
        else:
            assert ("+cu129" in where) == (in_12 and not in_13) and ("aarch64" in where) == (not x86), arch


def test_readme_never_tells_to_install_from_pypi():
    code = "\n".join(re.findall(r"```bash\n(.*?)```", README, re.S))
    assert not re.search(r"pip install aotinfer\b", code)


def python_blocks():
    return re.findall(r"^```python\n(.*?)^```$", README, re.S | re.M)


def test_python_examples_call_the_api_as_it_is():
    """Every call of an aotinfer function, class or wrapper method in the README's examples binds
    to its current signature (positional count and keyword names)."""
    import ast
    import inspect

    import aotinfer

    calls = 0
    for block in python_blocks():
        classes = {}  # variable -> the aotinfer class it was made from
        for node in ast.walk(ast.parse(block)):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
                func = node.value.func
                if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "aotinfer":
                    for target in node.targets:
                        if isinstance(target, ast.Name) and inspect.isclass(getattr(aotinfer, func.attr)):
                            classes[target.id] = getattr(aotinfer, func.attr)
        for node in ast.walk(ast.parse(block)):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name)):
                continue
            owner, name = node.func.value.id, node.func.attr
            if owner == "aotinfer":
                target, extra = getattr(aotinfer, name), ()
                if inspect.isclass(target):
                    target, extra = target.__init__, (None,)
            elif owner in classes:
                target, extra = getattr(classes[owner], name), (None,)
            else:
                continue
            positional = [None] * len(node.args)
            keywords = {k.arg: None for k in node.keywords}
            inspect.signature(target).bind(*extra, *positional, **keywords)  # TypeError names the mismatch
            calls += 1
    assert calls >= 20, calls  # the quickstarts' calls were found


@pytest.mark.gpu
def test_python_examples_run():
    """The README's Python blocks run in order, in one namespace (later blocks use earlier ones' names)."""
    import torch

    namespace = {}
    for block in python_blocks():
        exec(compile(block, "README.md", "exec"), namespace)
    torch.cuda.synchronize()
    tokens = namespace["tokens"]
    assert tokens.dtype == torch.int32 and tokens.shape == (4,) and bool(((tokens >= 0) & (tokens < 128256)).all())
    assert namespace["out"].shape == (3, 32, 128) and bool(torch.isfinite(namespace["out"]).all())


def test_performance_table_is_the_one_perf_chart_prints():
    """The README's table comes from benchmarks/perf_figures.json (python benchmarks/perf_chart.py)."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("perf_chart", ROOT / "benchmarks/perf_chart.py")
    perf_chart = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(perf_chart)
    families = json.loads((ROOT / "benchmarks/perf_figures.json").read_text())["families"]
    assert perf_chart.markdown_table(families) in README
    assert (ROOT / "docs/perf.png").is_file()
